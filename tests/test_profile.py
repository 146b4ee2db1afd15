"""profile_training (bench/profile.py): the small run writes a trace TensorBoard and Perfetto can open, a receipt
that validates, and a plot; the compiled regions report no graph break, no recompile across batches of different
document counts, and a cold compile time per region from dynamo's records; an eager run claims no compile; bad
arguments fail before any work. CPU (the scans' Triton kernels under the interpreter), and a base-size run on a GPU."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from megacpp_lab import receipts
from megacpp_lab.bench.profile import SMALL, STALL_FACTOR, profile_training, stalled_active_steps, varied_doc_counts
from megacpp_lab.model.parallelize import compile_breakdown


def _run(out: Path, **kw: Any) -> tuple[dict[str, Path], dict[str, Any]]:
    # dynamo's aot_eager compiles the regions on a CPU: the same graphs, breaks, recompiles and compile records
    # as inductor, without a minute of gcc; T=32 because the interpreted scans cost seconds a step; B=2 keeps
    # two documents or more in every batch (a batch of one document in all recompiles the M2RNN region once)
    paths = profile_training(out=out, small=True, batch=2, seq_len=32, backend="aot_eager", progress=False, **kw)
    return paths, json.loads(paths["receipt"].read_text())


@pytest.fixture(scope="module")
def compiled(tmp_path_factory) -> tuple[dict[str, Path], dict[str, Any]]:
    return _run(tmp_path_factory.mktemp("profile_compiled"))


@pytest.fixture(scope="module")
def eager(tmp_path_factory) -> tuple[dict[str, Path], dict[str, Any]]:
    return _run(tmp_path_factory.mktemp("profile_eager"), compiled=False)


def _check_files(paths: dict[str, Path], receipt: dict[str, Any]) -> None:
    trace = paths["trace"]
    assert trace.name.endswith(".pt.trace.json") and trace.parent == paths["receipt"].parent
    assert trace.parent.name == "profile" and trace.parent.parent.name == receipts.device_slug(receipt["device"])
    events = json.loads(trace.read_text())["traceEvents"]
    steps = {e["name"] for e in events if str(e.get("name", "")).startswith("ProfilerStep#")}
    assert len(steps) == receipt["schedule"]["active"], steps  # the active steps only
    receipts.validate_receipt(receipt)
    assert receipt["subsystem"] == "profile" and receipt["trace"] == trace.name
    assert receipts.load_receipts("profile", root=paths["receipt"].parents[2])[0]["name"] == receipt["name"]
    assert paths["plot"].read_bytes()[:4] == b"\x89PNG"
    split = receipt["block_time"]
    assert math.isclose(sum(split["share"].values()), 1.0, rel_tol=1e-6), split["share"]
    assert {"A", "M", "R", "lm_head"} <= set(split["share"]) and all(v >= 0 for v in split["share"].values())
    assert 0 < sum(split["share_of_step"].values()) <= 1.0 + 1e-6
    rows = receipt["top_kernels"]["rows"]
    assert rows and rows == sorted(rows, key=lambda r: -r["us_per_step"])
    times = receipt["step_time"]
    assert len(times["all_steps_ms"]) == receipt["schedule"]["steps"] and times["tokens_per_s"] > 0
    counts = [receipt["doc_counts"]["first_step"], *receipt["doc_counts"]["per_step"]]
    assert all(a != b for a, b in zip(counts, counts[1:])) and len(counts) == 1 + receipt["schedule"]["steps"]
    assert all(math.isfinite(v) for v in times["losses"])
    # every later batch ran once before the profiler (its first sight compiles what its documents select)
    sight = receipt["first_sight"]
    assert sight["doc_counts"] == receipt["doc_counts"]["per_step"] and len(sight["ms"]) == receipt["schedule"]["steps"]
    assert all(v > 0 for v in sight["ms"]) and sight["median_ms"] <= sight["max_ms"] == max(sight["ms"])
    row = receipt["results"][0]  # several documents a row: attention per document counts less than the row bound
    assert 0 < row["mfu"] < row["mfu_upper_bound"] and row["tflops"] / row["mfu"] == pytest.approx(989.0)
    plain = receipt["unprofiled_step"]  # the active batches again without the profiler, each with its documents
    assert plain["steps"] == len(plain["ms"]) == plain["rounds"] * receipt["schedule"]["active"]
    assert plain["min_ms"] <= plain["median_ms"] <= plain["max_ms"] and 0 < plain["mfu"] < plain["mfu_upper_bound"]
    assert plain["flops_per_token"] == pytest.approx(row["flops_per_token"])  # the same batches, rounds repeated
    assert "host_by_op" in receipt and receipt["host_by_op"]["steps"] == receipt["schedule"]["active"]


def test_small_compiled_run_writes_trace_receipt_and_plot(compiled):
    paths, receipt = compiled
    _check_files(paths, receipt)
    small = {"preset": SMALL["preset"], "B": 2, "T": 32, "docs": SMALL["docs"]}  # SMALL's, with _run's B and T
    assert receipt["compiled"] is True and receipt["shape"] == small and receipt["compile"]["backend"] == "aot_eager"
    assert set(receipt["block_time"]["labels"]) >= {"A|blocks.0", "M|blocks.1", "R|blocks.2", "M|blocks.3"}


def test_compiled_regions_no_break_no_recompile_and_a_cold_compile_per_region(compiled):
    _, receipt = compiled
    comp = receipt["compile"]
    counts = {receipt["doc_counts"]["first_step"], *receipt["doc_counts"]["per_step"]}
    assert len(counts) == 3, counts  # three document counts went through the same graphs
    assert comp["graph_breaks"] == 0 and comp["recompiles"] == 0 and comp["compiled_later"] == [], comp
    assert comp["regions"] == comp["graphs"] == len(comp["block_structures"]) == 4
    per_region = comp["per_region"]
    assert len(per_region) == 4 and all(r["cold_compile_s"] > 0 and r["forward_s"] > 0 for r in per_region)
    assert [r["structure"] for r in per_region] == [s["structure"] for s in comp["block_structures"]]
    assert sum(r["blocks"] for r in per_region) == 4
    assert math.isclose(comp["cold_compile_s"], sum(r["cold_compile_s"] for r in per_region))
    assert comp["first_step_s"] * 1e3 == receipt["results"][1]["ms"] and comp["first_step_s"] > 0
    assert receipt["results"][0]["compile_s"] == comp["cold_compile_s"]


def test_eager_run_claims_no_compile(eager):
    paths, receipt = eager
    _check_files(paths, receipt)
    assert receipt["compiled"] is False and receipt["compile"] is None
    assert not any("compile_s" in row or "compile" in row["contender"] for row in receipt["results"])
    assert "engram" in receipt["block_time"]["share"]  # eager: the Engram branch has its own range


@pytest.mark.parametrize(
    "kw, name",
    [
        (dict(wait=-1), "wait"), (dict(warmup=-1), "warmup"), (dict(active=0), "active"), (dict(batch=0), "batch"),
        (dict(seq_len=1), "seq_len"), (dict(docs=0), "docs"), (dict(seq_len=8, docs=9), "docs"),
        (dict(preset="huge"), "preset"), (dict(active=1.5), "active"), (dict(device="tpu"), "device"),
    ],
)  # fmt: skip
def test_bad_arguments_fail_closed_naming_the_argument_before_any_work(tmp_path, kw, name):
    with pytest.raises(ValueError, match=rf"\b{name}\b"):
        profile_training(out=tmp_path, small=True, progress=False, **kw)
    assert not any(tmp_path.iterdir())


def test_compile_records_keep_runtime_records_out_of_the_regions():
    """torch 2.11 on a GPU logs a runtime record per compile id (lazy kernel compiles at the first call) beside
    the frame compile: it once counted as a region, so the regions lost their block structures."""
    from types import SimpleNamespace as R

    structures = [(("A",), 3), (("M", "engram"), 3)]
    first = [R(compile_id="0/0", is_forward=True, entire_frame_compile_time_s=8.0, graph_op_count=38),
             R(compile_id="0/0", is_forward=True, is_runtime=True, duration_us=100_000),
             R(compile_id="0/0", is_forward=False, backward_cumulative_compile_time_us=500_000),
             R(compile_id="1/0", is_forward=True, entire_frame_compile_time_s=16.0, graph_op_count=195),
             R(compile_id="1/0", is_forward=True, is_runtime=True, duration_us=900_000)]  # fmt: skip
    later = [R(compile_id="1/0", is_forward=False, is_runtime=True, duration_us=5_000)]
    rec = compile_breakdown(structures, len(first), first + later)
    assert [(r["structure"], r["blocks"]) for r in rec["per_region"]] == [(["A"], 3), (["M", "engram"], 3)]
    a, m = rec["per_region"]
    assert (a["forward_s"], a["backward_s"], a["runtime_s"]) == (8.0, 0.5, 0.1)
    assert math.isclose(a["cold_compile_s"], 8.6) and math.isclose(m["cold_compile_s"], 16.9)
    assert rec["compiled_later"] == []  # a runtime record after the first step is no recompile


def test_doc_counts_vary_around_docs_within_the_row():
    for docs, seq_len in ((8, 4096), (2, 64), (1, 2), (5, 5)):
        counts = varied_doc_counts(docs, seq_len, 20, seed=3)
        assert counts[0] == docs and all(a != b for a, b in zip(counts, counts[1:]))
        assert all(max(1, docs // 2) <= c <= min(seq_len, 2 * docs) for c in counts)
    assert varied_doc_counts(8, 4096, 6, seed=0) == varied_doc_counts(8, 4096, 6, seed=0)


@pytest.mark.cuda
def test_base_profile_on_gpu(tmp_path):
    """A short base-size profile, bf16, fused AdamW: GPU kernels in the trace and in the top rows, each block
    kind's share of the kernel time, four regions with no break and no recompile."""
    paths = profile_training(preset="base", batch=1, seq_len=2048, docs=4, wait=0, warmup=1, active=2, out=tmp_path,
                             inductor_caches=True, progress=False)  # fmt: skip
    receipt = json.loads(paths["receipt"].read_text())
    _check_files(paths, receipt)
    assert receipt["dtype"] == "bfloat16" and receipt["config"]["optimizer"] == "AdamW(fused=True)"
    assert receipt["top_kernels"]["category"] == "kernel" and "gpu" in receipt["block_time"]["basis"]
    assert receipt["results"][0]["peak_total_mib"] > 0
    comp = receipt["compile"]
    assert comp["graph_breaks"] == 0 and comp["recompiles"] == 0 and comp["graphs"] == 4
    assert all(r["cold_compile_s"] > 0 and r["blocks"] for r in comp["per_region"]) and len(comp["per_region"]) == 4
    assert [r["blocks"] for r in comp["per_region"]] == [s["blocks"] for s in comp["block_structures"]]
    print(json.dumps({k: comp[k] for k in ("cold_compile_s", "first_step_s", "per_region")}, indent=1))


def test_compile_breakdown_splits_a_region_by_phase_and_counts_cache_hits():
    """Each cumulative CompilationMetrics field holds the next (frame > AOTAutograd > inductor > code generation
    > Triton compile): the phases are their differences, the backward's inductor phases added, the runtime
    records' time counted as autotuning."""
    from types import SimpleNamespace as R

    fwd = R(compile_id="0/0", is_forward=True, entire_frame_compile_time_s=10.0,
            dynamo_cumulative_compile_time_us=10_000_000, aot_autograd_cumulative_compile_time_us=8_000_000,
            inductor_cumulative_compile_time_us=5_000_000, inductor_code_gen_cumulative_compile_time_us=4_000_000,
            triton_compile_time_us=3_000_000, compile_time_autotune_time_us=500_000,
            inductor_fx_local_cache_miss_count=1, aotautograd_local_cache_hit_count=1)  # fmt: skip
    bwd = R(compile_id="0/0", is_forward=False, backward_cumulative_compile_time_us=2_000_000,
            inductor_cumulative_compile_time_us=2_000_000, inductor_code_gen_cumulative_compile_time_us=1_500_000,
            triton_compile_time_us=1_000_000, inductor_fx_local_cache_miss_count=1)  # fmt: skip
    run = R(compile_id="0/0", is_forward=True, is_runtime=True, duration_us=250_000)
    rec = compile_breakdown([(("A",), 2)], 3, [fwd, bwd, run])
    phases = rec["per_region"][0]["phases_s"]
    assert phases == pytest.approx({"dynamo_trace": 2.0, "aot_autograd": 3.0, "inductor_lowering": 1.5,
                                    "inductor_codegen": 1.5, "triton_compile": 4.0, "autotune": 0.75})  # fmt: skip
    assert rec["phases_s"] == phases and rec["cold_compile_s"] == pytest.approx(12.25)
    assert rec["caches"] == {"inductor_fx_local_cache_hit": 0, "inductor_fx_local_cache_miss": 2,
                             "aotautograd_local_cache_hit": 1, "aotautograd_local_cache_miss": 0}  # fmt: skip


def test_stalled_active_steps_names_the_steps_past_the_factor():
    """An active step over STALL_FACTOR x the unprofiled median is named with its documents and time; one at or
    under it is not; a receipt without unprofiled steps has nothing to hold its steps against."""
    receipt = {"step_time": {"active_ms": [75.0, 751.0, 2 * STALL_FACTOR * 35.0]},
               "doc_counts": {"first_step": 8, "per_step": [7, 4, 15, 12, 16]},
               "unprofiled_step": {"median_ms": 70.0}}
    assert stalled_active_steps(receipt) == [{"active_step": 1, "docs_per_row": 12, "ms": 751.0}]
    assert [s["active_step"] for s in stalled_active_steps(receipt, factor=1.0)] == [0, 1, 2]
    assert stalled_active_steps({**receipt, "unprofiled_step": None}) == []
