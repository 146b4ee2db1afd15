"""bench compile's process plumbing on the CPU: a contender stopped at its first-step cap reports how long
its first step ran (not the process's time since launch), and the summary takes that as a lower bound."""

from __future__ import annotations

from pathlib import Path

import pytest

from megacpp_lab.bench import compile as bc


def test_a_run_stopped_at_its_first_step_cap_reports_a_lower_bound(tmp_path: Path) -> None:
    run = bc.Run("whole-model cold", "whole", preset="tiny", B=1, T=32, docs=2, backend="aot_eager", device="cpu",
                 first_step_cap_s=0.5)  # fmt: skip
    row = bc.launch_contender(run, tmp_path / "whole", timeout=None, interpret=True)
    assert row["stopped_by"] == "cap" and row["stopped_at_s"] == 0.5 and "first_step_s" not in row
    assert row["import_s"] > 0 and row["build_s"] >= 0  # written before the first step began
    assert bc.first_step_seconds(row) == 0.5


def _summary(rows: dict) -> dict:
    """compile_receipt's summary for `rows` at base B=4 T=4096, 12 and 48 layers."""
    receipt = bc.compile_receipt(rows, {}, preset="base", B=4, T=4096, docs=8, device="cuda", backend="inductor",
                                 shallow=12, deep=48, make_receipt=lambda *a, **k: k)  # fmt: skip
    return receipt["summary"]


def test_the_depth_bar_compares_first_steps_and_marks_a_lower_bound() -> None:
    rows = {
        "regional cold": {"contender": "regional cold", "mode": "regional", "first_step_s": 10.0},
        "regional cold 48 layers": {"contender": "regional cold 48 layers", "mode": "regional", "first_step_s": 11.0},
        "whole-model cold 48 layers": {"contender": "whole-model cold 48 layers", "mode": "whole",
                                       "stopped_at_s": 30.0, "stopped_by": "cap"},
    }  # fmt: skip
    summary = _summary(rows)
    assert summary["whole_at_depth_is_lower_bound"] is True
    assert summary["bar"]["48 layers: regional cold first step <= 1/3 of the whole-model's"] is False  # 11 > 30 / 3
    assert summary["bar"]["48 layers: regional cold first step <= 1.15x that at 12"] is True
    rows["whole-model cold 48 layers"]["stopped_at_s"] = 34.0
    summary = _summary(rows)
    assert summary["bar"]["48 layers: regional cold first step <= 1/3 of the whole-model's"] is True


def test_a_host_that_writes_no_bytecode_gets_a_primed_bytecode_cache(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(bc, "BYTECODE_PRIME", ("megacpp_lab.varlen", "tqdm"))
    monkeypatch.setenv("PYTHONDONTWRITEBYTECODE", "1")
    info = bc.bytecode_cache(tmp_path)
    assert info["host_writes_bytecode"] is False and info["primed_s"] > 0
    compiled = [p.relative_to(info["cache"]).as_posix() for p in Path(info["cache"]).rglob("*.pyc")]
    assert any("megacpp_lab/__pycache__/varlen." in c or "megacpp_lab/varlen." in c for c in compiled)  # the lab's
    assert any("/tqdm/" in c for c in compiled)  # and site-packages' modules
    env = bc.python_env(Path(info["cache"]))
    assert "PYTHONDONTWRITEBYTECODE" not in env and env["PYTHONPYCACHEPREFIX"] == info["cache"]
    monkeypatch.delenv("PYTHONDONTWRITEBYTECODE")
    monkeypatch.setattr(bc.sys, "dont_write_bytecode", False)
    assert bc.bytecode_cache(tmp_path / "other") == {"host_writes_bytecode": True, "cache": None}
    assert not (tmp_path / "other").exists()


def test_a_one_process_run_stopped_at_the_deadline_is_a_lower_bound() -> None:
    rows = {
        "regional cold": {"contender": "regional cold", "mode": "regional", "first_step_s": 10.0},
        "regional cold, one process": {"contender": "regional cold, one process", "mode": "regional",
                                       "stopped_at_s": 25.0, "stopped_by": "deadline"},
    }  # fmt: skip
    summary = _summary(rows)
    assert summary["one_process_is_lower_bound"] is True and summary["regional_cold_one_process_first_step_s"] == 25.0
    assert summary["workers_over_one_process"] == 10.0 / 25.0


def test_the_warm_bars_read_the_median_of_the_warm_runs() -> None:
    runs = [{"contender": "regional warm", "first_step_s": f, "total_s": t, "import_s": 1.0, "build_s": 0.5, "tag": i}
            for i, (f, t) in enumerate([(5.0, 9.0), (3.0, 12.0), (4.0, 8.0)])]  # fmt: skip
    row = bc.median_run(runs)
    assert row["first_step_s"] == 4.0 and row["total_s"] == 9.0  # each a median over the runs
    assert row["tag"] == 2 and len(row["runs"]) == 3  # the median run's own fields; every run's times kept
    summary = _summary({"regional warm": row})
    assert summary["warm_first_step_s"] == 4.0 and summary["warm_runs"] == row["runs"]
    assert summary["bar"]["warm: first compiled step <= 4 s"] is True
    assert summary["bar"]["warm: import, build and first step <= 10 s"] is True


def test_the_step_mfu_counts_attention_per_document_and_keeps_the_row_bound_beside_it() -> None:
    from megacpp_lab.model.config import hybrid_preset
    from megacpp_lab.model.hybrid import HybridLM

    model = HybridLM(hybrid_preset("tiny", m2rnn=dict(kernel="reference")))
    T, lens, ms = 512, [64] * 8, 2.0
    f = bc.step_flops(model, T, lens, T, ms)
    per_doc, per_row = model.flops_per_token(T, doc_lens=lens)["total"], model.flops_per_token(T)["total"]
    assert f["flops_per_token"] == per_doc and f["flops_per_token_upper_bound"] == per_row and per_doc < per_row
    assert f["mfu"] == per_doc * T / (ms / 1e3) / 1e12 / bc.PEAK_BF16_TFLOPS
    assert f["mfu_upper_bound"] / f["mfu"] == pytest.approx(per_row / per_doc, rel=1e-12)


def test_the_mfu_bar_reads_the_per_document_figure() -> None:
    rows = {
        bc.EAGER: {"contender": bc.EAGER, "ms": 200.0},
        "regional cold": {"contender": "regional cold", "mode": "regional", "first_step_s": 10.0, "ms": 100.0,
                          "mfu": 0.25, "mfu_upper_bound": 0.31},
    }  # fmt: skip
    name = "regional MFU >= 30% of 989 TFLOP/s, attention FLOPs per document"
    summary = _summary(rows)
    assert summary["bar"][name] is False  # the upper bound's 31% does not count
    assert summary["regional_mfu"] == 0.25 and summary["regional_mfu_upper_bound"] == 0.31
    rows["regional cold"]["mfu"] = 0.30
    assert _summary(rows)["bar"][name] is True
