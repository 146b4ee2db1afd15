"""The upstream regression packs: each behaves as measured on the pinned versions; reverting any one of the lab's
fixes, or a recorded run on another tilelang, fails naming the pack; the CLI exits 1 on a deviation."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from megacpp_lab.tripwires import BUG_FIRED, FIXED, NOT_RUN, PACKS, run_pack, status_table
from megacpp_lab.tripwires.tilelang_packs import PINNED_TILELANG, results_from, run_tilelang_packs

ROOT = Path(__file__).resolve().parent.parent
RECORDED = ROOT / "profiles" / "cpu-intel-r-xeon-r-processor" / "tripwires"

# pack -> (file under megacpp_lab/, the fix's text, the text that reverts it): each is the upstream bug put back
REVERTS = {
    "10": ("kernels/linear_cross_entropy.py",  # Megatron's dispatcher: raise on a device without a fused kernel
           '_warn_fallback(f"no CUDA device (inputs on {x.device.type})")\n        return "eager"',
           'raise ValueError(f"Unsupported architecture: {x.device.type}")'),
    "11": ("model/hybrid.py",  # the rebase-miss: the model builds its head without the fused-loss flag
           "self.lm_head = LMHead(c.lm_head)",
           'self.lm_head = LMHead(__import__("dataclasses").replace(c.lm_head, fused_loss=False))'),
    "12": ("kernels/dsa_indexer.py",  # the score slab: the streaming path back to the einsum
           "    out = torch.zeros(q.shape[1], q.shape[0], k.shape[0], device=q.device, dtype=torch.float32)\n",
           "    return indexer_scores_reference(q, k, w)\n"),
    "16-wrapper": ("model/precision.py",  # Float16Module: every tensor to the low dtype, the contract ignored
                   "t.detach().float() if qual in keep else t.detach().to(dtype)", "t.detach().to(dtype)"),
    "16-fsdp": ("model/parallelize.py",  # FSDP2's policy over the contract parameters too
                "ignored_params=keep)", "ignored_params=set())"),
}


def _tilelang_or_skip() -> None:
    if importlib.util.find_spec("tilelang") is None:
        if os.environ.get("CI"):  # make install installs the extra: a CI without it is a broken set-up
            pytest.fail("tilelang is missing in CI: the `tripwires` extra must be installed (make install)")
        pytest.skip("tilelang is not installed: pip install -e '.[tripwires]'")


@pytest.fixture(scope="module")
def tilelang_results():
    _tilelang_or_skip()
    return {r.pack: r for r in run_tilelang_packs()}


@pytest.mark.parametrize("pack", ["08", "13"])
def test_tilelang_pack_behaves_as_on_the_pinned_release(tilelang_results, pack: str) -> None:
    r = tilelang_results[pack]
    assert r.versions["tilelang"] == PINNED_TILELANG, "\n".join(r.deviations())
    assert r.as_expected, "\n".join(r.deviations())
    assert r.sentinel == FIXED
    printed = "\n".join(r.lines())
    assert f"pack {pack}" in printed and "FIXED" in printed and "tilelang 0.1.15" in printed and "sm_90" in printed


def test_pack08_reports_a_fallback_apart_from_a_bulk_copy(tilelang_results) -> None:
    """A compiled kernel is not a TMA pass: the qk_dot_shared layout (8-byte rows) lowers through cp.async."""
    cases = {c.name: c for c in tilelang_results["08"].cases}
    assert cases["rank-3 smem [64, 4, 16] bf16, pipelined load"].tma_copies is True
    qk = cases["MIMO qk_dot_shared [64, 4, 4] bf16, pipelined load"]
    assert qk.tma_copies is False and "cp.async: yes" in qk.detail


@pytest.mark.parametrize("version", ["0.1.8"])
def test_a_recorded_run_on_another_tilelang_fails_naming_the_pack(version: str) -> None:
    """The lowering run recorded with tilelang 0.1.8 (the seeds' release): pack 13's divide-by-zero fires, and
    pack 08's qk_dot_shared case took a TMA load there (with a warning); both fail against the pin, by name."""
    data = json.loads((RECORDED / f"tilelang-{version}-lowering.json").read_text())
    results = {r.pack: r for r in results_from(data)}
    assert results["13"].sentinel == BUG_FIRED
    r13 = "\n".join(results["13"].deviations())
    assert "pack 13" in r13 and "Divide by zero" in r13 and f"tilelang {version} is not the pinned" in r13
    r08 = "\n".join(results["08"].deviations())
    assert "pack 08" in r08 and "qk_dot_shared" in r08
    assert not results["08"].as_expected and not results["13"].as_expected


def test_missing_tilelang_is_not_run_and_says_how_to_install(monkeypatch) -> None:
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "tilelang" else object())
    results = run_tilelang_packs()
    assert [r.sentinel for r in results] == [NOT_RUN, NOT_RUN]
    assert all(not r.as_expected and "[tripwires]" in r.deviations()[0] for r in results)


@pytest.mark.parametrize("pack", ["10", "11", "12", "16"])
def test_lab_pack_is_fixed_and_its_watcher_fires(pack: str) -> None:
    r = run_pack(pack)
    assert r.sentinel == FIXED and r.as_expected, "\n".join(r.deviations())
    assert any("watcher must fire" in c.name or "fell back" in c.outcome for c in r.cases)


def test_pack11_measures_the_logits_it_saves() -> None:
    r = run_pack("11")
    on, off = r.measured["fused_loss=True"], r.measured["fused_loss=False"]
    assert off["peak_bytes"] - on["peak_bytes"] >= 2 * 64 * 8192 * 4  # at least the fp32 [B,T,V] logits
    assert off["largest_shape"] == [128, 8192]


@pytest.mark.cuda
def test_pack11_on_a_gpu_measures_the_allocator_peak() -> None:
    r = run_pack("11")
    assert r.as_expected, "\n".join(r.deviations())
    peaks = r.measured["cuda_peak_bytes"]
    assert peaks["fused_loss=False"] - peaks["fused_loss=True"] >= 2 * 64 * 8192 * 4


def test_pack12_at_the_seeds_shape_cuts_the_working_memory() -> None:
    m = run_pack("12").measured
    assert m["slab_bytes"] == 16 * 2**30  # the seeds' 16 GiB
    assert m["reference"]["largest_bytes"] == m["slab_bytes"]
    assert m["streaming"]["largest_bytes"] == m["output_bytes"]
    assert m["reduction"] > 20, m


def _reverted_tree(tmp_path: Path, revert: str) -> Path:
    rel, fix, bug = REVERTS[revert]
    tree = tmp_path / "tree"
    shutil.copytree(ROOT / "megacpp_lab", tree / "megacpp_lab", ignore=shutil.ignore_patterns("__pycache__"))
    path = tree / "megacpp_lab" / rel
    text = path.read_text()
    assert text.count(fix) == 1, f"the revert for pack {revert} is stale: {rel} no longer holds {fix!r} once"
    path.write_text(text.replace(fix, bug))
    return tree


@pytest.mark.parametrize("revert", sorted(REVERTS))
def test_reverting_a_lab_fix_fails_naming_its_pack(tmp_path: Path, revert: str) -> None:
    """The pack's own command on a copy of the library with one fix reverted: exit 1, BUG FIRED, the pack named."""
    pack = revert.split("-")[0]
    tree = _reverted_tree(tmp_path, revert)
    env = {**os.environ, "PYTHONPATH": str(tree)}
    proc = subprocess.run([sys.executable, "-m", "megacpp_lab.cli", "tripwires", "--pack", pack], capture_output=True,
                          text=True, env=env, cwd=tmp_path, timeout=300)  # fmt: skip
    assert f"megacpp_lab/{REVERTS[revert][0]}" not in proc.stderr  # no traceback: a sentinel, not a crash
    assert str(tree) in subprocess.run([sys.executable, "-c", "import megacpp_lab; print(megacpp_lab.__file__)"],
                                       capture_output=True, text=True, env=env, cwd=tmp_path).stdout  # fmt: skip
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert f"pack {pack} ({PACKS[pack].title}): {BUG_FIRED}" in proc.stdout, proc.stdout
    assert f"tripwire: pack {pack} " in proc.stderr, proc.stderr


def test_the_command_prints_sentinels_and_writes_stamped_json(tmp_path: Path, capsys) -> None:
    from megacpp_lab.cli import main

    assert main(["tripwires", "--pack", "12", "--json", str(tmp_path / "out.json")]) == 0
    out = capsys.readouterr().out
    assert f"pack 12 ({PACKS['12'].title}): {FIXED}" in out and "versions: megacpp-lab" in out
    data = json.loads((tmp_path / "out.json").read_text())
    assert {"device", "torch", "triton", "commit", "date"} <= set(data)
    assert [(p["pack"], p["sentinel"], p["as_expected"]) for p in data["packs"]] == [("12", FIXED, True)]


def test_status_table_has_a_row_per_pack() -> None:
    rows = status_table([run_pack("12")])
    assert rows == [{"pack": "12", "title": PACKS["12"].title, "sentinel": FIXED, "as pinned": "yes",
                     "versions": rows[0]["versions"]}]  # fmt: skip
    assert "torch" in rows[0]["versions"]


def test_unknown_pack_fails_closed() -> None:
    with pytest.raises(ValueError, match=r"unknown pack\(s\) \['99'\]"):
        run_pack("99")


@pytest.mark.parametrize("version", ["0.1.15", "0.1.8"])
def test_an_expected_error_says_why_on_the_console(monkeypatch, capsys, version: str) -> None:
    """Pack 13 prints FIXED over a case that ends in an error: that case's line says why the error is expected
    (on the pinned release only: a run that differs is a deviation, and the reason would not hold)."""
    from megacpp_lab.cli import main
    from megacpp_lab.tripwires import tilelang_packs

    data = json.loads((RECORDED / f"tilelang-{version}-lowering.json").read_text())
    monkeypatch.setattr(tilelang_packs, "run_tilelang_packs", lambda: results_from(data))
    assert main(["tripwires", "--pack", "13"]) == (0 if version == PINNED_TILELANG else 1)
    lines = capsys.readouterr().out.splitlines()
    why = [line for line in lines if "(expected on tilelang 0.1.15, and not the pack's bug" in line]
    if version == PINNED_TILELANG:
        assert lines[0].endswith(FIXED)
        assert [line.split(":")[0].strip() for line in why] == ["R=3, K=48, N=64, TMA off"]
        assert "error: Mapped indices are not independent" in why[0] and "TMA lowering off" in why[0]
    else:
        assert why == []
