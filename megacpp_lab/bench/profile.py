"""Profile HybridLM's training step, compiled regionally or eager: the logic of `megacpp-lab profile`.

One run: a fresh dynamo, the model built by parallelize (bf16 on a GPU, regional compile when compiled), one cold
(compiling) step timed on its own, every later batch once unprofiled (its first sight: what its documents select
compiles there), then wait + warmup + active steps on those batches under torch.profiler's schedule, every step
on a batch with another number of documents per row (so a recompile would show). Writes, under
<out>/<device-slug>/profile/: the TensorBoard `*.pt.trace.json` (torch-tb-profiler and Perfetto open it), a
receipt `<name>.json` (top kernels, each block kind's share of the step, step times, tokens/s and MFU, the
compiled regions: graphs, graph breaks, recompiles, cold compile per region from dynamo's own records) and
`<name>.png`.
"""

from __future__ import annotations

import json
import math
import statistics
import sys
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager, nullcontext
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from torch import nn

from megacpp_lab.bench import bench_device, output_root, require_triton_interpreter
from megacpp_lab.bench.compile import PEAK_BF16_TFLOPS
from megacpp_lab.bench.harness import FORWARD_ONLY, ModelShape, TrainingStep, build_model, make_batch, profile_labels
from megacpp_lab.model.config import HYBRID_PRESETS, model_config
from megacpp_lab.model.hybrid import HybridLM
from megacpp_lab.model.parallelize import (
    ParallelConfig,
    block_structures,
    compile_breakdown,
    compile_stats,
    describe_compile,
)
from megacpp_lab.model.precompile import precompile
from megacpp_lab.profiling import (LABEL_SEP, gpu_idle_by_cause, host_time_by_op, label_modules, name_inductor_kernels,
                                   read_trace_events, sync, time_by_label)
from megacpp_lab.receipts import device_name, device_slug, make_receipt, write_receipt
from megacpp_lab.varlen import build_context

__all__ = ["FULL", "SMALL", "STALL_FACTOR", "profile_training", "stalled_active_steps", "varied_doc_counts"]

SUBSYSTEM = "profile"
# (preset, batch, seq_len, docs, wait, warmup, active): a full run and a --small CPU smoke run. Small: the cold
# step and two batches, each once unprofiled (first sight) and once under the profiler, three different document
# counts out of 1..4; few, because on a CPU the
# compiled scans run their Triton kernels under the interpreter, about 13 s per step at B=2, T=64.
FULL = dict(preset="base", batch=4, seq_len=4096, docs=8, wait=1, warmup=2, active=3)
SMALL = dict(preset="tiny", batch=2, seq_len=64, docs=2, wait=0, warmup=1, active=1)
# rounds over the active steps' batches run again after the profiler, unprofiled (bench compile's MFU counts such
# steps; the profiled ones carry the profiler's per-event cost)
UNPROFILED_ROUNDS = 2
TOP_KERNELS = 12


class _Outside(nn.Module):
    """Calls a compiled block from eager code. label_modules' hooks open profiler ranges, an op dynamo cannot
    trace under fullgraph; on this wrapper they run outside the block's compiled region, around it."""

    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.block = block

    def forward(self, *args: Any) -> Any:
        return self.block(*args)


@contextmanager
def _labelled(lm: HybridLM, compiled: bool) -> Iterator[list[str]]:
    """Profiler ranges per block (and, eager, per Engram / n-gram / CBlock branch), embedding, final norm and
    LM head; yields the label names. Compiled: each block is swapped for an _Outside wrapper for the run and
    put back after; branches inside a compiled block count towards the block."""
    labels = profile_labels(lm)
    if not compiled:
        with label_modules(labels, forward_only=FORWARD_ONLY):
            yield list(labels)
        return
    blocks = list(lm.blocks)
    outer = [_Outside(b) for b in blocks]
    labels = {k: v for k, v in labels.items() if not k.startswith(("engram", "ngram", "cblock"))}
    labels.update({f"{b.kind}{LABEL_SEP}blocks.{i}": outer[i] for i, b in enumerate(blocks)})
    try:
        for i, o in enumerate(outer):
            lm.blocks[i] = o
        with label_modules(labels, forward_only=FORWARD_ONLY):
            yield list(labels)
    finally:
        for i, b in enumerate(blocks):
            lm.blocks[i] = b


def varied_doc_counts(docs: int, seq_len: int, n: int, seed: int) -> list[int]:
    """n documents-per-row counts around `docs` (docs//2 .. 2*docs, within 1 .. seq_len), a seeded order of
    them repeated: consecutive steps always differ."""
    values = list(range(max(1, docs // 2), min(seq_len, max(2 * docs, 2)) + 1))
    order = [values[i] for i in torch.randperm(len(values), generator=torch.Generator().manual_seed(seed)).tolist()]
    if len(order) > 1 and order[0] != docs:  # the cold step sees `docs` itself
        order.remove(docs)
        order.insert(0, docs)
    return [order[i % len(order)] for i in range(n)]


def _check(preset: str, batch: int, seq_len: int, docs: int, wait: int, warmup: int, active: int) -> None:
    """Fail closed, naming the argument, before any work."""
    if preset not in HYBRID_PRESETS:
        raise ValueError(f"preset must be one of {tuple(HYBRID_PRESETS)}, got {preset!r}")
    for name, value, low in (("batch", batch, 1), ("seq_len", seq_len, 2), ("docs", docs, 1), ("wait", wait, 0),
                             ("warmup", warmup, 0), ("active", active, 1)):  # fmt: skip
        if not isinstance(value, int) or isinstance(value, bool) or value < low:
            raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
    if docs > seq_len:
        raise ValueError(f"docs (documents per row) must be at most seq_len={seq_len}, got {docs}")


def _self_time(trace: Path, category: str) -> list[dict[str, Any]]:
    """Time and calls per event name of one category, longest first, each event's nested events of the same
    category excluded: CPU operators nest (aten::linear holds aten::addmm), so inclusive times would count the
    same work several times; GPU kernels do not nest, and keep their whole duration. Inductor's kernels go by
    their descriptive names (name_inductor_kernels), not all as `triton_`."""
    events = read_trace_events(trace)
    if category == "kernel":
        name_inductor_kernels(events)
    threads: dict[tuple[Any, Any], list[dict[str, Any]]] = {}
    for e in events:
        if e.get("ph") == "X" and e.get("cat") == category and "dur" in e:
            threads.setdefault((e["pid"], e["tid"]), []).append(e)
    totals: dict[str, list[float]] = {}
    for events in threads.values():
        events.sort(key=lambda e: (float(e["ts"]), -float(e["dur"])))
        stack: list[list[Any]] = []  # [end, name, own time]; the innermost open event last

        def close(until: float) -> None:
            while stack and stack[-1][0] <= until:
                _, name, own = stack.pop()
                entry = totals.setdefault(name, [0.0, 0])
                entry[0], entry[1] = entry[0] + own, entry[1] + 1

        for e in events:
            ts, dur = float(e["ts"]), float(e["dur"])
            close(ts)
            if stack:  # the parent loses the span of this child (clipped to the parent's end)
                stack[-1][2] -= min(dur, stack[-1][0] - ts)
            stack.append([ts + dur, e["name"], dur])
        close(math.inf)
    rows = [{"name": name, "us": max(0.0, us), "calls": int(n)} for name, (us, n) in totals.items()]
    return sorted(rows, key=lambda r: -r["us"])


def profile_training(*, preset: str | None = None, batch: int | None = None, seq_len: int | None = None,
                     docs: int | None = None, wait: int | None = None, warmup: int | None = None,
                     active: int | None = None, compiled: bool = True, optimizer: bool = True,
                     device: str | None = None, out: str | Path | None = None, small: bool = False,
                     inductor_caches: bool = False, backend: str = "inductor", seed: int = 0,
                     progress: bool = True) -> dict[str, Path]:  # fmt: skip
    """Profile the training step and write trace, receipt and plot; returns {'receipt', 'trace', 'plot'}.

    Arguments left None take FULL's values (base, B=4, T=4096, 8 documents per row, schedule wait 1, warmup 2,
    active 3), or with small=True SMALL's (tiny, B=2, T=64, 2 documents per row, schedule 0 / 1 / 1). A step is
    zero_grad, forward to the fused LM-head loss, backward and (optimizer=True) an AdamW step, fused on a GPU.
    Before the profiler, every later batch runs once unprofiled (the receipt's first_sight), so that the profiled
    steps are the steady state, not the compiles a batch's first sight triggers.
    compiled: apply_compile (every block on its own, fullgraph); on a CPU the scans then run their Triton
    kernels under the interpreter (the reference loops are compiler-disabled), eager CPU runs take
    model_config's chunked SSD and M2RNN reference loop. device: default 'cuda' when there is one, else 'cpu'
    for a small run (a full-size run needs a GPU). out: the receipt root (default profiles/, with small=True
    build/bench-small/). backend: the compiler of the regions (inductor; a CPU test may take dynamo's aot_eager,
    whose graphs, breaks, recompiles and compile records are the same, without inductor's C++ compile).
    inductor_caches=False disables inductor's on-disk caches, so the first step is a
    truly cold compile; True lets them serve it (the receipt counts the cache hits). The run resets dynamo
    (every compiled graph of this process), so that the first step compiles from nothing.
    """
    # ---- arguments, checked before any work
    chosen = {**(SMALL if small else FULL)}
    chosen.update({k: v for k, v in dict(preset=preset, batch=batch, seq_len=seq_len, docs=docs, wait=wait,
                                         warmup=warmup, active=active).items() if v is not None})  # fmt: skip
    _check(**chosen)
    preset, B, T, docs = chosen["preset"], chosen["batch"], chosen["seq_len"], chosen["docs"]
    wait, warmup, active = chosen["wait"], chosen["warmup"], chosen["active"]
    if device is None:
        device = bench_device(SUBSYSTEM, small)
    if device not in ("cpu", "cuda") or (device == "cuda" and not torch.cuda.is_available()):
        raise ValueError(f"device must be 'cpu' or 'cuda' (with a CUDA GPU present), got {device!r}")
    root = output_root(out, small)
    if compiled and device == "cpu":
        require_triton_interpreter(SUBSYSTEM)  # the compiled scans' Triton kernels, under the interpreter
    import torch._inductor.config as inductor_config
    from torch._dynamo.utils import clear_compilation_metrics, counters, get_compilation_metrics
    from tqdm.auto import tqdm

    # ---- model, batches (contexts built here, outside every compiled region), fresh dynamo
    start = time.perf_counter()
    n_steps = wait + warmup + active
    config = model_config(preset, device, compiled=compiled)
    if T > config.mla.max_positions:  # the RoPE table's length costs no time
        config = model_config(preset, device, compiled=compiled, mla=dict(max_positions=T))
    # saved_graphs off: this profile splits the cold compile by dynamo's phases, which a loaded graph has none of
    parallel = ParallelConfig(compile=compiled, backend=backend, saved_graphs=False)
    model = build_model(config, device, seed=seed, parallel=parallel)
    counts = varied_doc_counts(docs, T, 1 + n_steps, seed)
    batches = []
    for i, d in enumerate(counts):
        tokens, doc_ids, targets = make_batch(ModelShape(preset, B, T, d), config.vocab_size, device, seed=seed + i,
                                              ignore_index=config.lm_head.ignore_index)  # fmt: skip
        batches.append((tokens, build_context(doc_ids), targets))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device == "cuda") if optimizer else None
    torch._dynamo.reset()
    counters.clear()
    clear_compilation_metrics()
    structures = list(block_structures(model).items())  # in block order: the order dynamo compiles them
    name = f"profile_{preset}_{'compiled' if compiled else 'eager'}"
    slug = device_slug(device_name(device))
    trace_dir = root / slug / SUBSYSTEM
    trace_dir.mkdir(parents=True, exist_ok=True)
    before = set(trace_dir.glob(f"{name}*.pt.trace.json"))
    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if device == "cuda" else [])
    caches = nullcontext() if inductor_caches or not compiled else inductor_config.patch(force_disable_caches=True)
    bar = tqdm(total=1 + 2 * n_steps + UNPROFILED_ROUNDS * active, desc=f"profile {preset} B={B} T={T} {'compiled' if compiled else 'eager'}",
               disable=not progress)  # fmt: skip

    # ---- the cold step, then the profiled steps
    with ExitStack() as scope:
        scope.enter_context(caches)
        sync(device)
        t0 = time.perf_counter()
        job = precompile(model, *batches[0]) if compiled else None  # before _labelled wraps the blocks
        if job is not None:  # dynamo compiles the structures in the job's order (None with the caches off)
            structures = job.structures_in_compile_order(model)
        label_names = scope.enter_context(_labelled(model, compiled))
        loss0 = TrainingStep(model, *batches[0], opt)()
        sync(device)
        first_s = time.perf_counter() - t0
        if compiled and progress:
            tqdm.write(f"first step: {describe_compile(first_s, 0)}", file=sys.stderr)
        n_first = len(get_compilation_metrics())
        after_first = compile_stats()
        bar.update()
        step_ms, losses = [], [float(loss0)]
        unprofiled_ms: list[float] = []
        unprofiled_losses: list[float] = []

        def timed_step(batch: tuple[torch.Tensor, Any, torch.Tensor], times: list[float], step_losses: list[float]) -> None:
            t0 = time.perf_counter()
            loss = TrainingStep(model, *batch, opt)()
            sync(device)
            times.append((time.perf_counter() - t0) * 1e3)
            step_losses.append(float(loss))
            bar.update()

        # every profiled batch once before the profiler, unprofiled: a batch's first sight compiles what its
        # documents select and no earlier batch did (the M2RNN launch plan's state rows a program, a Triton
        # constexpr: at 07348d0 on an H100 the active steps of 15 and 12 documents a row, the first to plan 64 and
        # 32 rows, took 0.75 and 0.69 s against 0.077 for 16 documents, planned as 15), a once-a-run cost that a
        # training run amortises; the profiled steps are then the steady state
        first_sight_ms: list[float] = []
        for batch in batches[1:]:
            timed_step(batch, first_sight_ms, [])
        if device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        with torch.profiler.profile(
            activities=activities,
            schedule=torch.profiler.schedule(wait=wait, warmup=warmup, active=active, repeat=1),
            on_trace_ready=torch.profiler.tensorboard_trace_handler(str(trace_dir), worker_name=name),
        ) as prof:
            for batch in batches[1:]:
                timed_step(batch, step_ms, losses)
                prof.step()
        # the active steps' batches again, the profiler off (the labels' ranges stay: no module changes, no
        # recompile): the step as training runs it, beside the profiled one that the profiler's cost stretches
        for batch in batches[-active:] * UNPROFILED_ROUNDS:
            timed_step(batch, unprofiled_ms, unprofiled_losses)
    bar.close()
    stats = compile_stats()
    peak_mib = torch.cuda.max_memory_allocated() / 2**20 if device == "cuda" else None
    written = sorted(set(trace_dir.glob(f"{name}*.pt.trace.json")) - before, key=lambda p: p.stat().st_mtime)
    if not written:
        raise RuntimeError(f"the profiler wrote no trace for {name!r} under {trace_dir}")
    trace = written[-1]
    if not all(math.isfinite(v) for v in losses + unprofiled_losses):
        raise RuntimeError(f"a step's loss is not finite: profiled {losses}, unprofiled {unprofiled_losses}")

    # ---- the summary
    split = time_by_label(trace)
    gpu = "gpu" in split["basis"]
    step_us = split["step_us"] or statistics.median(step_ms[-active:]) * 1e3
    category = "kernel" if gpu else "cpu_op"
    ops = _self_time(trace, category)
    active_ms = sorted(step_ms[-active:])
    ms = statistics.median(active_ms)
    tokens_per_s = B * T / (ms / 1e3)
    block_time = {
        "basis": split["basis"], "labels": label_names,
        "profiled_step_ms": step_us / 1e3, "labelled_ms": split["total_us"] / 1e3,
        "ms_per_step": {k: v / 1e3 for k, v in sorted(split["us"].items(), key=lambda kv: -kv[1])},
        "backward_ms_per_step": {k: v / 1e3 for k, v in split["us_backward"].items()},
        "share": split["share"],  # of the labelled (GPU: kernel) time: sums to 1
        "share_of_step": {k: v / step_us for k, v in split["us"].items()},
        "unaccounted_share_of_step": max(0.0, 1.0 - split["total_us"] / step_us),
        "kernels_without_launch": split["kernels_without_launch"],
        "note": ("branches inside a compiled block (Engram, n-gram, CBlock) count towards the block; " if compiled else "")
                + ("'other': kernels launched outside every labelled range (the embedding's and the LM head's "
                   "backward, gradient zeroing, the optimizer)" if gpu else
                   "CPU: wall time in each labelled range (nested ones excluded); the rest of the step is unaccounted"),
    }  # fmt: skip
    # where the GPU waits on the host, and which labelled ranges queue their kernels slower than the GPU runs them
    gpu_idle = gpu_idle_by_cause(trace) if gpu else None
    host_by_op = host_time_by_op(trace)  # the host cost of each of the lab's custom operators (launchers)
    top_kernels = {
        "category": category, "steps": active,
        "basis": "GPU kernel time per profiled step" if gpu else
                 "CPU operators' self time per profiled step (the operators each one calls excluded)",
        "total_ms_per_step": sum(r["us"] for r in ops) / active / 1e3,
        "rows": [{"name": r["name"], "calls_per_step": r["calls"] / active, "us_per_step": r["us"] / active,
                  "share_of_step": r["us"] / active / step_us} for r in ops[:TOP_KERNELS]],
    }  # fmt: skip
    row: dict[str, Any] = {
        "contender": f"{'regional compile' if compiled else 'eager'} fwd+bwd{' + AdamW' if optimizer else ''} (profiled)",
        "ms": ms, "ms_min": active_ms[0], "ms_max": active_ms[-1], "steps": active, "tokens_per_s": tokens_per_s,
        **({"peak_total_mib": peak_mib} if peak_mib is not None else {}),
        **active_flops(model, T, B * T, [ctx.doc_lengths for _, ctx, _ in batches[-active:]], step_ms[-active:]),
    }  # fmt: skip
    unprofiled_lens = [ctx.doc_lengths for _, ctx, _ in batches[-active:]] * UNPROFILED_ROUNDS
    unprofiled_step = {
        "rounds": UNPROFILED_ROUNDS, "steps": len(unprofiled_ms), "ms": unprofiled_ms,
        "median_ms": statistics.median(unprofiled_ms), "min_ms": min(unprofiled_ms), "max_ms": max(unprofiled_ms),
        "losses": unprofiled_losses,
        **active_flops(model, T, B * T, unprofiled_lens, unprofiled_ms),
    }  # fmt: skip
    if gpu:  # the GPU kernel time is the profiled steps' (kernel durations barely move under the profiler)
        unprofiled_step["median_less_kernel_ms"] = unprofiled_step["median_ms"] - top_kernels["total_ms_per_step"]
    compile_section = None
    if compiled:
        records = compile_breakdown(structures, n_first)
        row["compile_s"] = records["cold_compile_s"]
        compile_section = {
            "regions": len(structures), "graphs": stats.graphs, "graph_breaks": stats.graph_breaks,
            "aot_graphs": stats.aot_graphs, "graphs_after_first_step": after_first.graphs,
            # dynamo counts every block structure after the first as a recompile of Block.forward: the number
            # here is what matters, graphs compiled after the first step (a batch broke a guard)
            "recompiles": stats.graphs - after_first.graphs,
            "block_structures": [{"structure": list(s), "blocks": n} for s, n in structures],
            **records, "first_step_s": first_s, "backend": backend, "inductor_caches": "enabled" if inductor_caches else "disabled",
            "cache_counters": {k: int(v) for g in ("inductor", "aot_autograd")
                               for k, v in counters[g].items() if "cache" in k},
        }  # fmt: skip
    first_row = {"contender": "first step" + (" (cold compile)" if compiled else ""), "ms": first_s * 1e3}
    receipt = make_receipt(
        name, SUBSYSTEM, shape=asdict(ModelShape(preset, B, T, docs)), dtype="bfloat16" if device == "cuda" else "float32",
        results=[row, first_row], device=device, compiled=compiled, trace=trace.name,
        schedule={"wait": wait, "warmup": warmup, "active": active, "repeat": 1, "steps": n_steps, "cold_steps_before": 1},
        doc_counts={"first_step": counts[0], "per_step": counts[1:]},
        step_time={"all_steps_ms": step_ms, "active_ms": step_ms[-active:], "median_ms": ms,
                   "mean_ms": statistics.fmean(active_ms), "tokens_per_s": tokens_per_s, "losses": losses},
        first_sight={"ms": first_sight_ms, "doc_counts": counts[1:],
                     "median_ms": statistics.median(first_sight_ms), "max_ms": max(first_sight_ms)},
        unprofiled_step=unprofiled_step, block_time=block_time, gpu_idle=gpu_idle, host_by_op=host_by_op,
        top_kernels=top_kernels,
        compile=compile_section,
        config={"pattern": config.pattern, "blocks": config.blocks, "n_layers": config.n_layers, "d_model": config.d_model,
                "vocab_size": config.vocab_size, "engram_layers": list(config.engram_layers),
                "ssd_kernel": config.ssd.kernel, "m2rnn_kernel": config.m2rnn.kernel, "attn_impl": config.mla.attn_impl,
                "optimizer": ("AdamW(fused=True)" if device == "cuda" else "AdamW") if optimizer else None},
        elapsed_s=time.perf_counter() - start,
        notes=("Training steps of HybridLM, each on a batch with another number of documents per row (doc_counts), "
               "contexts built before the steps. The first step runs before the profiler and is timed on its own "
               "(with compiled=True it compiles every block structure; on a GPU it also autotunes the Triton "
               "kernels). Then every later batch once, unprofiled (first_sight: each step's wall time, synchronised: a "
               "batch whose documents select a Triton specialisation no earlier batch did, the M2RNN launch plan's "
               "state rows a program say, compiles it there, once a run), so that the profiled steps are the "
               "steady state. Then torch.profiler's schedule (wait, warmup, active, repeat=1) over the same "
               "batches; step times are wall "
               "times of the profiled steps (synchronised), so they carry the profiler's overhead; ms / "
               "tokens_per_s: the median active step; mfu / tflops: the active steps' FLOPs over their summed "
               "time (HybridLM.flops_per_token with each batch's document lengths: attention per document) against "
               "989 TFLOP/s dense bf16, mfu_upper_bound the same with attention over each row's whole causal "
               "triangle (the old count). block_time: time_by_label over the trace (per block kind; "
               "GPU: each kernel to the labelled range that launched it). gpu_idle (GPU only): "
               "profiling.gpu_idle_by_cause over the trace: the GPU's idle time per step by the range and the host "
               "operator it waited on, and each range's host time against the kernel time it launched. "
               "unprofiled_step: the active steps' batches again, UNPROFILED_ROUNDS rounds with the profiler off "
               "(wall times, synchronised; mfu as above), and on a GPU its median less the profiled steps' kernel "
               "time (an estimate of the GPU's idle time without the profiler). host_by_op: "
               "profiling.host_time_by_op, each megacpp:: custom operator's host time per call and step, with the "
               "kernel launches and other operators it called directly. compile: graphs, breaks and recompiles "
               "from dynamo's counters, cold compile per region from dynamo's CompilationMetrics."),
    )  # fmt: skip
    path = write_receipt(receipt, root)
    plot = _plot(receipt, path.with_suffix(".png"))
    return {"receipt": path, "trace": trace, "plot": plot}


# an active step this many times the unprofiled median holds more than the profiler's overhead (on an H100 the
# base step's clean profiled steps ran 1.03-1.10x the unprofiled median, profiles at bc8cbac and 07348d0): a compile
# at the batch's first sight, say
STALL_FACTOR = 2.0


def stalled_active_steps(receipt: dict[str, Any], factor: float = STALL_FACTOR) -> list[dict[str, Any]]:
    """The profiled active steps of a profile receipt that took over `factor` times the unprofiled median of the same
    batches: each one's position among the active steps, its documents a row and its ms. Receipts written before
    the first-sight pass (no `first_sight`) can hold such steps; a newer one should hold none."""
    times = receipt["step_time"]["active_ms"]
    counts = receipt["doc_counts"]["per_step"][-len(times):]
    plain = receipt.get("unprofiled_step")
    if plain is None:  # receipts before the unprofiled rounds: nothing to hold the steps against
        return []
    limit = factor * plain["median_ms"]
    return [{"active_step": i, "docs_per_row": d, "ms": ms} for i, (d, ms) in enumerate(zip(counts, times)) if ms > limit]


def active_flops(model: HybridLM, T: int, n_tokens: int, doc_lens: list[list[int]], ms: list[float]) -> dict[str, float]:
    """The active steps' FLOP rate (their FLOPs over their summed time, each batch with its own documents): mfu
    with attention per document (HybridLM.flops_per_token given the batch's document lengths), mfu_upper_bound
    over each row's whole causal triangle. Against bench.compile's PEAK_BF16_TFLOPS."""
    seconds = sum(ms) / 1e3
    per_doc = sum(model.flops_per_token(T, doc_lens=lens)["total"] for lens in doc_lens) * n_tokens
    per_row = model.flops_per_token(T)["total"] * n_tokens * len(doc_lens)
    return {"tflops": per_doc / seconds / 1e12, "mfu": per_doc / seconds / 1e12 / PEAK_BF16_TFLOPS,
            "tflops_upper_bound": per_row / seconds / 1e12, "mfu_upper_bound": per_row / seconds / 1e12 / PEAK_BF16_TFLOPS,
            "flops_per_token": per_doc / n_tokens / len(doc_lens)}


def _plot(receipt: dict[str, Any], path: Path) -> Path:
    """Per-kind share of the step beside the top kernels (time per step)."""
    from matplotlib.figure import Figure  # no pyplot: a notebook's backend stays as it is

    from megacpp_lab.plots import save_figure

    fig = Figure(figsize=(14, 4.5))
    left, right = fig.subplots(1, 2)
    split = receipt["block_time"]
    share = {**split["share_of_step"], "unaccounted": split["unaccounted_share_of_step"]}
    keys = sorted(share, key=lambda k: -share[k])
    bars = left.barh(keys, [100 * share[k] for k in keys], color="tab:orange")
    left.bar_label(bars, labels=[f"{100 * share[k]:.1f}%" for k in keys], padding=3, fontsize=8)
    left.invert_yaxis()
    left.set_xlabel("% of the profiled step")
    comp = receipt["compile"]
    what = (f"compiled: {comp['regions']} regions, cold compile {comp['cold_compile_s']:.1f} s, {comp['graph_breaks']} "
            f"breaks, {comp['recompiles']} recompiles" if comp else "eager")  # fmt: skip
    shape = ", ".join(f"{k}={v}" for k, v in receipt["shape"].items())
    left.set_title(f"{receipt['name']} ({receipt['dtype']}), {shape}\n{what}; median step "
                   f"{receipt['step_time']['median_ms']:.1f} ms\n{receipt['device']}", fontsize=9)  # fmt: skip
    rows = receipt["top_kernels"]["rows"]
    names = [r["name"] if len(r["name"]) <= 60 else r["name"][:57] + "..." for r in rows]
    bars = right.barh(names, [r["us_per_step"] / 1e3 for r in rows], color="tab:blue")
    right.bar_label(bars, labels=[f"{100 * r['share_of_step']:.1f}%" for r in rows], padding=3, fontsize=7)
    right.invert_yaxis()
    right.tick_params(axis="y", labelsize=7)
    right.set_xlabel("ms per profiled step")
    what = "GPU kernels" if receipt["top_kernels"]["category"] == "kernel" else "CPU operators (self time)"
    right.set_title(f"top {len(rows)} {what}, % of the profiled step", fontsize=9)
    return Path(save_figure(left, path))
