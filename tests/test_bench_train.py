"""bench/train.py's ablation arithmetic: the seed spread decides whether a gap between arms is named, the runs a
device call measures are chosen by name, and the receipt is assembled from one piece per run."""

from __future__ import annotations

import pytest

from megacpp_lab.bench import train as bt


def _piece(arm: str, seed: int, val: float, held: float | None = None) -> dict:
    evals = [{"step": 2, "tokens": 256, "val_loss": val + 1.0, "heldout_loss": None if held is None else held + 1.0},
             {"step": 4, "tokens": 512, "val_loss": val, "heldout_loss": held}]  # fmt: skip
    return {"arm": arm, "seed": seed, "contender": f"{arm} {seed}", "engram_layers": [], "ngram_layers": [],
            "parameters": 10, "tokens_per_s": 100.0 + seed, "peak_mib": None, "elapsed_s": 1.0, "evals": evals,
            "train_curve": [{"step": 4, "train_loss": val}], "val_loss": val, "heldout_loss": held}  # fmt: skip


def test_a_gap_is_named_only_beyond_the_seed_spread():
    arms = {"engram": [_piece("engram", s, v) for s, v in enumerate((2.0, 2.1, 2.05))],
            "none": [_piece("none", s, v) for s, v in enumerate((2.3, 2.2, 2.25))]}  # fmt: skip
    c = bt.compare(arms, "val_loss", "engram", "none")
    assert c["beyond_seed_spread"] and c["verdict"] == "lower" and c["mean_a_minus_b"] == pytest.approx(-0.2)
    arms["none"][1] = _piece("none", 1, 2.08)  # the ranges now overlap: no direction, whatever the means say
    c = bt.compare(arms, "val_loss", "engram", "none")
    assert not c["beyond_seed_spread"] and c["verdict"] == "within the seed spread" and c["mean_a_minus_b"] < 0
    assert bt.compare(arms, "heldout_loss", "engram", "none") is None  # a plain corpus has no held-out library


def test_the_receipt_holds_every_arm_with_its_seed_spread_at_each_evaluation():
    pieces = [_piece(a, s, 2.0 + 0.1 * i + 0.01 * s, 3.0 + 0.1 * i) for i, a in enumerate(bt.ARMS) for s in (1, 0)]
    receipt = bt.assemble(pieces, bt.SMALL, {"train_files": 1})
    arms = receipt["summary"]["arms"]
    assert list(arms) == list(bt.ARMS) and [r["seed"] for r in receipt["results"]][:2] == [0, 1]
    curve = arms["none"]["curve"]
    assert [r["tokens"] for r in curve] == [256, 512]
    assert curve[1]["val_loss"]["min"] == pytest.approx(2.1) and curve[1]["val_loss"]["max"] == pytest.approx(2.11)
    assert arms["engram"]["heldout_loss"]["mean"] == pytest.approx(3.0)
    names = {(c["a"], c["loss"]) for c in receipt["summary"]["comparisons"]}
    assert names == {("engram", "val_loss"), ("engram", "heldout_loss"), ("ngram", "val_loss"), ("ngram", "heldout_loss")}
    assert all("peak_mib" not in r for r in receipt["results"])  # unmeasured (a CPU): left out, not None


def test_the_runs_of_a_call_are_chosen_by_name(monkeypatch):
    monkeypatch.delenv(bt.RUNS_ENV, raising=False)
    assert len(bt._selected_runs(bt.SEEDS)) == len(bt.ARMS) * len(bt.SEEDS)
    monkeypatch.setenv(bt.RUNS_ENV, "engram:0, ngram:2")
    assert bt._selected_runs(bt.SEEDS) == [("engram", 0), ("ngram", 2)]
    for bad in ("engram:5", "mystery:0", "engram"):
        monkeypatch.setenv(bt.RUNS_ENV, bad)
        with pytest.raises(ValueError, match=f"{bt.RUNS_ENV}: '{bad}' is not a run of the ablation"):
            bt._selected_runs(bt.SEEDS)


def test_a_receipt_gathers_only_pieces_of_the_same_code_device_and_run(tmp_path):
    """Pieces from earlier device calls count only with the same commit, device and fingerprint (the corpus's
    manifest, the tokenizer, torch and the settings), and only for a run of the ablation; the later directory
    wins."""
    import json

    key = ("abc123", "NVIDIA H200", "f" * 64)
    earlier, here = tmp_path / "earlier", tmp_path / "here"
    earlier.mkdir()
    here.mkdir()

    def put(d, arm, seed, **stamp):
        piece = {**_piece(arm, seed, 2.0), "commit": key[0], "device": key[1], "fingerprint": key[2], **stamp}
        (d / f"{bt.PIECE_PREFIX}{arm}_s{seed}.json").write_text(json.dumps(piece))

    put(earlier, "engram", 0)
    put(earlier, "none", 0, fingerprint="0" * 64)  # another corpus or setting
    put(earlier, "ngram", 0, commit="old")  # older code
    put(earlier, "ngram", 7)  # not a seed of this ablation
    put(here, "engram", 1)
    put(here, "engram", 0, val_loss=9.0)  # measured again here: this one counts
    found = bt.collect_pieces([earlier, here], key, bt.SEEDS)
    assert sorted(found) == [("engram", 0), ("engram", 1)] and found[("engram", 0)]["val_loss"] == 9.0


def test_pieces_evaluated_at_different_steps_are_refused():
    a, b = _piece("engram", 0, 2.0), _piece("none", 0, 2.1)
    b["evals"] = b["evals"][:1]
    with pytest.raises(ValueError, match="evaluated at different steps"):
        bt.assemble([a, b], bt.SMALL, {})


def test_a_run_named_twice_is_refused(monkeypatch):
    monkeypatch.setenv(bt.RUNS_ENV, "engram:0,engram:0")
    with pytest.raises(ValueError, match="'engram:0' is named twice"):
        bt._selected_runs(bt.SEEDS)
