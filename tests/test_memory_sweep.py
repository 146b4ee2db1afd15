"""`megacpp-lab memory sweep`: the summary's bar, Pareto front and per-kind check on hand-made rows, and a
CPU smoke run (tiny preset, the min-cut partitioner through aot_eager_decomp_partition) whose budgets and
policies move the saved bytes the way they must. The H200 run is the receipt."""

from __future__ import annotations

import json

import pytest
import torch

from megacpp_lab.bench.memory import summarize, sweep_points
from megacpp_lab.cli import main


def _row(name: str, family: str, mem: float, ms: float) -> dict:
    return {"contender": name, "family": family, "compiled": family != "eager", "activation_mib": mem, "ms": ms}


def test_summary_bar_pareto_per_kind_and_monotonicity():
    rows = [_row("budget 1.0", "global", 1000, 100), _row("budget 0.5", "global", 500, 110),
            _row("budget 0.3", "global", 550, 118), _row("budget 0.0", "global", 300, 140),
            _row("per-kind A=1.0 M=0.3 R=0.3", "per-kind", 480, 105), _row("eager none", "eager", 900, 90)]  # fmt: skip
    s = summarize(rows, "activation_mib")
    assert s["budget_0.3_vs_1.0"]["memory_reduction"] == pytest.approx(0.45)
    assert s["budget_0.3_vs_1.0"]["step_cost"] == pytest.approx(0.18)
    assert all(s["bar"].values())
    # the eager point is not on the compiled front; budget 0.5 and 0.3 are beaten by the per-kind point
    assert s["pareto_compiled"] == ["budget 1.0", "budget 0.0", "per-kind A=1.0 M=0.3 R=0.3"]
    assert {b["global"] for b in s["per_kind_beats_global"]} == {"budget 0.5", "budget 0.3"}
    assert s["memory_monotonic_in_budget"] is False  # 0.3 holds more than 0.5: shown, not hidden
    # against the global front at its memory: 480 MiB lies between budget 0.0 (300, 140 ms) and 0.5 (500, 110 ms)
    (front,) = s["per_kind_vs_global_front"]
    assert front["global_ms_at_same_memory"] == pytest.approx(140 - 30 * 180 / 200)
    slow = [dict(r, ms=r["ms"] * (1.5 if r["contender"] == "budget 0.3" else 1)) for r in rows]
    assert summarize(slow, "activation_mib")["bar"]["its step-time cost <= 25%"] is False


def test_sweep_points_cover_budgets_per_kind_and_manual_policies():
    names = [p.name for p in sweep_points()]
    assert names[:8] == [f"budget {b:.1f}" for b in (1.0, 0.9, 0.8, 0.7, 0.5, 0.3, 0.1, 0.0)]
    assert sum(n.startswith("per-kind") for n in names) >= 3
    assert {"eager none", "eager full", "eager save list", "eager none + CPU offload"} <= set(names)
    per_kind = next(p for p in sweep_points() if p.family == "per-kind")
    assert per_kind.policy.engram == "none"  # else an M block with Engram would take the engram entry


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the CLI would start the full-size sweep")
def test_small_sweep_on_cpu(tmp_path, capsys):
    assert main(["memory", "sweep", "--small", "--quiet", "--out", str(tmp_path)]) == 0
    paths = capsys.readouterr().out.split()
    receipt = json.loads(open(paths[0]).read())
    assert paths[1].endswith(".png")
    rows = {r["contender"]: r for r in receipt["results"]}
    top, bottom = rows["budget 1.0"], rows["budget 0.0"]
    assert top["graphs"] == bottom["graphs"] == 4 and top["graph_breaks"] == 0
    for kind in ("A", "M", "R"):  # a lower budget saves less in every block kind
        assert bottom["saved_tensor_mib_by_kind"][kind] < top["saved_tensor_mib_by_kind"][kind], kind
    assert rows["eager full"]["saved_tensor_mib"] < rows["eager none"]["saved_tensor_mib"]
    assert receipt["summary"]["memory_key"] == "saved_tensor_mib"
    estimator = receipt["summary"]["estimator"]  # the estimator at every point, per block kind
    assert estimator["checked"] == 3 * len(rows) and estimator["within"], estimator["worst"]


@pytest.mark.cuda
def test_memory_point_on_gpu_measures_activation_and_peak():
    from megacpp_lab.bench.memory import MemoryPoint, measure_point
    from megacpp_lab.bench.harness import ModelShape
    from megacpp_lab.model.checkpointing import CheckpointingPolicy

    shape = ModelShape("small", B=1, T=1024, docs=4)
    rows = [measure_point(MemoryPoint(f"budget {b}", True, CheckpointingPolicy.uniform(b), "global"), shape, "cuda",
                     steps=2, warmup=1, backend="inductor") for b in (1.0, 0.0)]  # fmt: skip
    top, bottom = rows
    assert 0 < bottom["activation_mib"] < top["activation_mib"] < top["peak_step_mib"]
    assert set(top["retained_mib_by_kind"]) == {"A", "M", "R"}
