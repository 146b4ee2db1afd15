"""`megacpp-lab memory sweep`: activation memory against step time, one run, every point on a fresh model.

Points: the regionally compiled model at global activation_memory_budgets from 1.0 down to 0.0, per-block-kind
budgets, and the eager model under the manual policies (none, full, a save list) and with CPU offload. Each
point measures, on the same fixed batch:
- activation_mib: what the forward leaves allocated for the backward (memory after the forward minus before
  it, on the GPU allocator): the activation memory at its peak, the fwd/bwd boundary;
- peak_step_mib: the step's max_memory_allocated minus what was allocated before it (gradients included);
- saved_tensor_mib_by_kind: the bytes autograd's saved-tensor hooks see per block kind (each storage once,
  parameters, buffers and their views left out);
  a checkpointed region hides its inner saves from them, so on the GPU retained_mib_by_kind (the allocator's
  delta over each block's forward, its output included) is the one to compare across policies;
- ms: the median fwd+bwd step (CUDA events);
- estimate_mib: model/memory.estimate_memory for the same config, shape, policy and device, and
  estimate_vs_measured: its per-kind bytes against the measured ones (estimate_checks).
The summary holds the bar (budget 0.3 against 1.0: activation memory -40% or more, step time +25% or less; a
per-kind point faster than the global budgets at its memory: one it dominates, or below the line between the two
global points around its memory; the estimator within 15% per kind at every point), the Pareto front over the
compiled points, and whether the memory falls monotonically as the budget falls (it need not: the partitioner's
choices are discrete).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from megacpp_lab.bench import bench_device, output_root
from megacpp_lab.bench.harness import (FULL_SHAPE, SMALL_COMPILE_SHAPE, ModelShape, TrainingStep, build_model, fresh_dynamo,
                                       make_batch, triton_config)
from megacpp_lab.model.checkpointing import CheckpointingPolicy
from megacpp_lab.model.memory import MemoryEstimate, estimate_memory
from megacpp_lab.model.parallelize import ParallelConfig, compile_stats
from megacpp_lab.profiling import saved_storages, step_times_ms, sync
from megacpp_lab.receipts import device_name, make_receipt, write_receipt
from megacpp_lab.varlen import build_context

__all__ = ["MemoryPoint", "block_accounting", "estimate_checks", "measure_point", "memory_sweep", "run", "sweep_points"]

GLOBAL_BUDGETS = (1.0, 0.9, 0.8, 0.7, 0.5, 0.3, 0.1, 0.0)  # each point compiles the base model's 4 structures
SMALL_BUDGETS = (1.0, 0.0)
# per-kind candidates: spend recompute where a block kind's saved bytes are cheap to rebuild (the base model's
# M blocks, Engram's among them, hold about two thirds of its activations at budget 1.0)
PER_KIND = (dict(A=1.0, M=0.3, R=1.0), dict(A=0.3, M=0.3, R=1.0), dict(A=1.0, M=0.1, R=1.0))
TOLERANCE = 0.15  # the estimator's per-kind bar against the measured bytes
# eager save list: keep the matmuls' and attention's outputs (and the megacpp scans, always), recompute the rest
SAVE_LIST = ("mm", "addmm", "bmm", "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention")
BAR = {"budget": 0.3, "activation_cut_at_least": 0.40, "step_cost_at_most": 0.25}


@dataclass(frozen=True)
class MemoryPoint:
    """One sweep point: a name, how the model runs (compiled or eager) and the policy."""

    name: str
    compiled: bool
    policy: CheckpointingPolicy
    family: str  # "global", "per-kind" or "eager"


def sweep_points(small: bool = False) -> list[MemoryPoint]:
    budgets = SMALL_BUDGETS if small else GLOBAL_BUDGETS
    points = [MemoryPoint(f"budget {b:.1f}", True, CheckpointingPolicy.uniform(b), "global") for b in budgets]
    for kw in PER_KIND[:1] if small else PER_KIND:
        name = "per-kind " + " ".join(f"{k}={v:.1f}" for k, v in kw.items())
        # engram / cblock stay "none": a block with a branch then takes its kind's budget
        points.append(MemoryPoint(name, True, CheckpointingPolicy(**kw), "per-kind"))
    eager = [("eager none", CheckpointingPolicy()), ("eager full", CheckpointingPolicy.uniform("full")),
             ("eager save list", CheckpointingPolicy.uniform(SAVE_LIST)),
             ("eager none + CPU offload", CheckpointingPolicy(offload=True))]  # fmt: skip
    points += [MemoryPoint(n, False, p, "eager") for n, p in (eager[:2] if small else eager)]
    return points


@contextmanager
def block_accounting(blocks: list[nn.Module], device: str) -> Iterator[dict[str, dict[str, int]]]:
    """Per block kind: saved-tensor bytes (profiling.saved_storages: each storage once, parameters and buffers
    left out) and, on a GPU, the allocator's delta over each block's forward. Filled while the context is open."""
    acc: dict[str, dict[str, int]] = {"retained": {}}
    current: list[str] = []
    start: dict[int, int] = {}

    def enter(i: int, kind: str) -> None:
        current.append(kind)
        if device == "cuda":
            start[i] = torch.cuda.memory_allocated()

    def leave(i: int, kind: str) -> None:
        current.pop()
        if device == "cuda":
            acc["retained"][kind] = acc["retained"].get(kind, 0) + torch.cuda.memory_allocated() - start[i]

    def around(fn: Callable[..., Any], i: int, kind: str) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            enter(i, kind)
            try:
                return fn(*args, **kwargs)
            finally:
                leave(i, kind)
        return call

    # wrap the call from outside: a module hook would run inside a compiled block's graph
    patched = []
    for i, block in enumerate(blocks):
        name = "_compiled_call_impl" if getattr(block, "_compiled_call_impl", None) is not None else "forward"
        own = name in block.__dict__
        patched.append((block, name, own, block.__dict__.get(name)))
        setattr(block, name, around(getattr(block, name), i, block.kind))
    state = [t for b in blocks for t in (*b.parameters(), *b.buffers())]
    try:
        with saved_storages(lambda t: current[-1] if current else None, exclude=state) as saved:
            acc["saved"] = saved
            yield acc
    finally:
        for block, name, own, original in patched:
            if own:
                setattr(block, name, original)
            else:
                delattr(block, name)


def measure_point(point: MemoryPoint, shape: ModelShape, device: str, *, steps: int, warmup: int, backend: str,
             ) -> dict[str, Any]:  # fmt: skip
    fresh_dynamo()
    config = triton_config(shape.preset, device)
    model = build_model(config, device, parallel=ParallelConfig(remat=point.policy.spec, compile=point.compiled,
                                                                backend=backend))  # fmt: skip
    tokens, doc_ids, targets = make_batch(shape, config.vocab_size, device, ignore_index=config.lm_head.ignore_index)
    ctx = build_context(doc_ids)
    step = TrainingStep(model, tokens, ctx, targets)
    t0 = time.perf_counter()
    step()  # compiles (compiled points) and autotunes
    sync(device)
    first_s = time.perf_counter() - t0
    model.zero_grad(set_to_none=True)
    mib = 2**20
    row: dict[str, Any] = {"contender": point.name, "family": point.family, "compiled": point.compiled,
                           "policy": {k: (list(v) if isinstance(v, tuple) else v) for k, v in point.policy.entries().items()},
                           "offload": point.policy.offload, "first_step_s": first_s}  # fmt: skip
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated() if device == "cuda" else 0
    with block_accounting(list(model.blocks), device) as acc:
        loss = model(tokens, ctx, targets).loss
    if device == "cuda":
        row["activation_mib"] = (torch.cuda.memory_allocated() - before) / mib
    loss.backward()
    if device == "cuda":
        torch.cuda.synchronize()
        row["peak_step_mib"] = (torch.cuda.max_memory_allocated() - before) / mib
        row["retained_mib_by_kind"] = {k: v / mib for k, v in sorted(acc["retained"].items())}
    row["saved_tensor_mib_by_kind"] = {k: v / mib for k, v in sorted(acc["saved"].items())}
    row["saved_tensor_mib"] = sum(acc["saved"].values()) / mib
    del loss
    samples = sorted(step_times_ms(step, warmup=warmup, steps=steps, device=device))
    row.update(ms=statistics.median(samples), ms_min=samples[0], ms_max=samples[-1], steps=steps)
    if point.compiled:
        stats = compile_stats()
        row.update(graphs=stats.graphs, graph_breaks=stats.graph_breaks)
    del step, model
    if device == "cuda":
        torch.cuda.empty_cache()
    return row


def _pareto(rows: list[dict[str, Any]], memory_key: str) -> list[str]:
    """Names of the points no other point beats on both memory and time."""
    front = []
    for r in rows:
        if not any(o is not r and o[memory_key] <= r[memory_key] and o["ms"] <= r["ms"]
                   and (o[memory_key] < r[memory_key] or o["ms"] < r["ms"]) for o in rows):  # fmt: skip
            front.append(r["contender"])
    return front


def _global_ms_at(memory: float, glob: list[dict[str, Any]], memory_key: str) -> float | None:
    """The global budgets' step time at this memory, linear between the two measured global points around it
    (the budget is continuous: some budget between them lands there); None outside their range."""
    pts = sorted((r[memory_key], r["ms"]) for r in glob)
    for (m0, t0), (m1, t1) in zip(pts, pts[1:]):
        if m0 <= memory <= m1:
            return t0 if m1 == m0 else t0 + (t1 - t0) * (memory - m0) / (m1 - m0)
    return None


def estimate_checks(row: dict[str, Any], estimate: MemoryEstimate, device: str) -> list[dict[str, Any]]:
    """Per block kind: the estimate against the measured bytes. Saved-tensor hooks are the measure, except for
    a save list on a GPU: the hooks cannot see a selective checkpoint's cache, the allocator's retained bytes
    can (on a CPU a save list is not checked)."""
    mib = 2**20
    if any(isinstance(v, list) for v in row["policy"].values()):
        if device != "cuda":
            return []
        measured = row["retained_mib_by_kind"]
    else:
        measured = row["saved_tensor_mib_by_kind"]
    out = []
    for kind, est in sorted(estimate.activations_by_kind.items()):
        got = measured.get(kind, 0.0)
        ratio = 1.0 if got == 0 and est == 0 else (est / mib) / got if got else float("inf")
        out.append({"point": row["contender"], "kind": kind, "estimate_mib": est / mib, "measured_mib": got, "ratio": ratio})
    return out


def summarize(rows: list[dict[str, Any]], memory_key: str) -> dict[str, Any]:
    """The bar, the Pareto front over the compiled points, per-kind against global, and the monotonicity check."""
    compiled = [r for r in rows if r["compiled"]]
    glob = {r["contender"]: r for r in compiled if r["family"] == "global"}
    summary: dict[str, Any] = {"memory_key": memory_key, "pareto_compiled": _pareto(compiled, memory_key)}
    top, cut = glob.get("budget 1.0"), glob.get(f"budget {BAR['budget']:.1f}")
    if top and cut:
        reduction = 1 - cut[memory_key] / top[memory_key]
        cost = cut["ms"] / top["ms"] - 1
        summary["budget_0.3_vs_1.0"] = {"memory_reduction": reduction, "step_cost": cost}
        summary["bar"] = {
            f"budget 0.3 cuts activation memory >= 40% vs 1.0": reduction >= BAR["activation_cut_at_least"],
            f"its step-time cost <= 25%": cost <= BAR["step_cost_at_most"],
        }  # fmt: skip
    per_kind = [r for r in compiled if r["family"] == "per-kind"]
    summary["per_kind_vs_global_front"] = [
        {"per_kind": p["contender"], "memory": p[memory_key], "ms": p["ms"],
         "global_ms_at_same_memory": _global_ms_at(p[memory_key], list(glob.values()), memory_key)}
        for p in per_kind]  # fmt: skip
    beats = []
    for p in per_kind:  # a global point using at least as much memory but slower
        for g in glob.values():
            if g[memory_key] >= p[memory_key] and g["ms"] > p["ms"]:
                beats.append({"per_kind": p["contender"], "global": g["contender"],
                              "memory": [p[memory_key], g[memory_key]], "ms": [p["ms"], g["ms"]]})  # fmt: skip
    summary["per_kind_beats_global"] = beats
    below_front = [c for c in summary["per_kind_vs_global_front"]
                   if c["global_ms_at_same_memory"] is not None and c["ms"] < c["global_ms_at_same_memory"]]  # fmt: skip
    if "bar" in summary:
        summary["bar"]["a per-kind policy beats the global budgets at the same memory"] = bool(beats or below_front)
    checks = [c for r in rows for c in r.get("estimate_vs_measured", [])]
    if checks:
        worst = max(checks, key=lambda c: abs(c["ratio"] - 1))
        summary["estimator"] = {"tolerance": TOLERANCE, "checked": len(checks), "worst": worst,
                                "within": all(abs(c["ratio"] - 1) <= TOLERANCE for c in checks)}  # fmt: skip
        if "bar" in summary:
            summary["bar"][f"the estimator lands within {TOLERANCE:.0%} per block kind at every point"] = summary["estimator"]["within"]
    ordered = [glob[k] for k in sorted(glob, key=lambda k: -float(k.split()[1]))]
    values = [r[memory_key] for r in ordered]
    summary["memory_monotonic_in_budget"] = all(a >= b for a, b in zip(values, values[1:]))
    summary["memory_by_budget"] = {r["contender"]: r[memory_key] for r in ordered}
    return summary


def plot(rows: list[dict[str, Any]], summary: dict[str, Any], title: str) -> Any:
    """Three panels: the compiled points up close (the Pareto front, per-kind against the global budgets), every
    point on a log time axis (the eager policies and CPU offload), and memory against the global budget with the
    estimator's activations beside the measured ones."""
    from matplotlib.figure import Figure

    key = summary["memory_key"]
    fig = Figure(figsize=(15, 4.8))
    ax, wide, bx = fig.subplots(1, 3)
    styles = {"global": ("o-", "C0"), "per-kind": ("s", "C2"), "eager": ("^", "C3")}
    for panel, families in ((ax, ("global", "per-kind")), (wide, ("global", "per-kind", "eager"))):
        for family in families:
            marker, color = styles[family]
            pts = [r for r in rows if r["family"] == family]
            if family == "global":
                pts = sorted(pts, key=lambda r: -float(r["contender"].split()[1]))
            panel.plot([r["ms"] for r in pts], [r[key] for r in pts], marker, color=color, label=family)
            for i, r in enumerate(pts if panel is ax or family != "per-kind" else []):
                label = r["contender"].replace("budget ", "").replace("per-kind ", "")
                dy = 3 if family != "per-kind" else 3 + 9 * i
                panel.annotate(label, (r["ms"], r[key]), fontsize=7, xytext=(4, dy), textcoords="offset points")
    front = sorted((r for r in rows if r["contender"] in summary["pareto_compiled"]), key=lambda r: r["ms"])
    ax.step([r["ms"] for r in front], [r[key] for r in front], where="post", color="0.5", lw=0.8, label="Pareto (compiled)")
    ax.set(xlabel="fwd+bwd step (ms)", ylabel=key.replace("_", " "), title="regional compile: memory against time")
    ax.legend(fontsize=8)
    from matplotlib.ticker import NullFormatter, ScalarFormatter

    wide.set_xscale("log")
    wide.xaxis.set_major_formatter(ScalarFormatter())
    wide.xaxis.set_minor_formatter(NullFormatter())
    times = [r["ms"] for r in rows]
    wide.set_xticks([t for t in (1, 2, 5, 10, 20, 50, 100, 150, 200, 300, 500, 800, 1000, 2000, 5000, 10000, 20000)
                     if min(times) * 0.9 <= t <= max(times) * 1.1])  # fmt: skip
    wide.set(xlabel="fwd+bwd step (ms, log)", ylabel=key.replace("_", " "), title="every policy")
    glob = sorted((r for r in rows if r["family"] == "global"), key=lambda r: -float(r["contender"].split()[1]))
    budgets = [float(r["contender"].split()[1]) for r in glob]
    bx.plot(budgets, [r[key] for r in glob], "o-", label=key)
    if glob and "peak_step_mib" in glob[0]:
        bx.plot(budgets, [r["peak_step_mib"] for r in glob], "s--", label="peak_step_mib")
    if glob and "estimate_mib" in glob[0] and key == "activation_mib":
        bx.plot(budgets, [r["estimate_mib"]["activations"] for r in glob], "x:", color="k", label="estimate (activations)")
    bx.invert_xaxis()
    bx.set(xlabel="activation_memory_budget (global)", ylabel="MiB", title="memory against the budget")
    bx.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return fig


def memory_sweep(shape: ModelShape = FULL_SHAPE, *, device: str = "cuda", small: bool = False, steps: int = 8,
                 warmup: int = 2, backend: str = "inductor", progress: bool = True,
                 partial: Path | None = None) -> dict[str, Any]:  # fmt: skip
    """Every point of sweep_points(small); partial: a file rewritten with the rows so far after each point (a
    run cut off keeps what it measured; not a receipt)."""
    import json

    from tqdm.auto import tqdm

    rows = []
    points = sweep_points(small)
    for point in tqdm(points, desc="memory sweep", unit="point", disable=not progress):
        rows.append(measure_point(point, shape, device, steps=steps, warmup=warmup, backend=backend))
        if partial is not None:
            partial.parent.mkdir(parents=True, exist_ok=True)
            partial.write_text(json.dumps(rows, indent=1) + "\n")
    config, cache, mib = triton_config(shape.preset, device), {}, 2**20
    for point, row in zip(tqdm(points, desc="estimates", unit="point", disable=not progress), rows):
        est = estimate_memory(config, batch=shape.B, seq_len=shape.T, docs=shape.docs, policy=point.policy,
                              compiled=point.compiled, device=device, backend=backend, trace_cache=cache)  # fmt: skip
        fields = est.as_dict()
        row["estimate_mib"] = {k: ({kk: vv / mib for kk, vv in v.items()} if isinstance(v, dict) else v / mib)
                               for k, v in fields.items() if k not in ("batch", "seq_len", "device", "per_block")}  # fmt: skip
        row["estimate_vs_measured"] = estimate_checks(row, est, device)
        if partial is not None:
            partial.write_text(json.dumps(rows, indent=1) + "\n")
    memory_key = "activation_mib" if device == "cuda" else "saved_tensor_mib"
    receipt = make_receipt(
        "memory_sweep", "memory", device=device, dtype="bfloat16" if device == "cuda" else "float32",
        shape={"preset": shape.preset, "B": shape.B, "T": shape.T, "docs": shape.docs}, results=rows,
    )  # fmt: skip
    receipt["summary"] = summarize(rows, memory_key)
    receipt["backend"] = backend
    receipt["notes"] = __doc__.split("\n\n", 1)[1].strip()
    return receipt


def run(out_root: str | Path | None = None, *, small: bool = False, progress: bool = True) -> list[Path]:
    device = bench_device("memory sweep", small)
    root = output_root(out_root, small)
    start = time.perf_counter()
    shape = SMALL_COMPILE_SHAPE if small else FULL_SHAPE
    receipt = memory_sweep(shape, device=device, small=small, steps=1 if small else 8, warmup=0 if small else 2,
                           backend="aot_eager_decomp_partition" if small else "inductor", progress=progress,
                           partial=root / "memory_sweep.partial.json")  # fmt: skip
    receipt["elapsed_s"] = time.perf_counter() - start
    path = write_receipt(receipt, root)
    (root / "memory_sweep.partial.json").unlink(missing_ok=True)
    fig = plot(receipt["results"], receipt["summary"],
               f"{device_name(device)}: {shape.preset} B={shape.B} T={shape.T}, {receipt['dtype']}")  # fmt: skip
    png = path.with_suffix(".png")
    fig.savefig(png, dpi=120)
    return [path, png]
