"""Timing and profiler traces, the same way on CPU (live notebook cells) and GPU (receipts)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch


def time_ms(fn: Callable[[], object], *, warmup: int = 3, rep: int = 20, device: torch.device | str | None = None,
            cuda_graph: bool = False) -> float:  # fmt: skip
    """Median milliseconds of fn() after warm-up.

    CUDA: triton.testing.do_bench (CUDA events, L2 flushed between runs); with cuda_graph=True,
    triton.testing.do_bench_cudagraph (fn captured once and replayed, so host-side dispatch is out of
    the number: for kernels of tens of microseconds, where Python launch cost would otherwise dominate).
    CPU: perf_counter around each call.
    """
    dev = torch.device(device) if device is not None else torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if warmup < 0 or rep < 1:
        raise ValueError(f"warmup must be >= 0 and rep >= 1, got warmup={warmup}, rep={rep}")
    if dev.type == "cuda":
        from triton.testing import do_bench

        for _ in range(warmup):
            fn()
        torch.cuda.synchronize(dev)
        if cuda_graph:
            from triton.testing import do_bench_cudagraph

            return float(do_bench_cudagraph(fn, rep=max(rep, 20), return_mode="median"))
        return float(do_bench(fn, warmup=25, rep=max(rep * 5, 100), return_mode="median"))
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(rep):
        start = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - start) * 1e3)
    return statistics.median(samples)


def profile_trace(
    fn: Callable[[], object],
    out_dir: str | Path,
    name: str,
    *,
    steps: int = 3,
    warmup: int = 1,
    record_shapes: bool = True,
) -> tuple[Path, torch.profiler.profile]:
    """Profile `steps` calls of fn after `warmup` and write a TensorBoard `*.pt.trace.json`.

    Returns the trace path (open it with TensorBoard's PyTorch profiler plugin or Perfetto)
    and the profiler, whose key_averages() gives the table.
    """
    from torch.profiler import ProfilerActivity, profile, schedule, tensorboard_trace_handler

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    activities = [ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(ProfilerActivity.CUDA)
    before = set(out.glob(f"{name}*.pt.trace.json"))
    with profile(
        activities=activities,
        schedule=schedule(wait=0, warmup=warmup, active=steps, repeat=1),
        on_trace_ready=tensorboard_trace_handler(str(out), worker_name=name),
        record_shapes=record_shapes,
    ) as prof:
        for _ in range(warmup + steps):
            fn()
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            prof.step()
    written = sorted(set(out.glob(f"{name}*.pt.trace.json")) - before, key=lambda p: p.stat().st_mtime)
    if not written:
        raise RuntimeError(f"the profiler wrote no trace for {name!r} under {out}")
    return written[-1], prof


def trace_summary(trace_path: str | Path, *, category: str | None = None, top: int = 10) -> list[dict[str, float | str]]:
    """The `top` events of a `*.pt.trace.json` by total duration, grouped by name.

    category: 'kernel' for GPU kernels, 'cpu_op' for operators; default: 'kernel' when the
    trace has GPU kernels, else 'cpu_op'.
    """
    import json

    events = [e for e in json.loads(Path(trace_path).read_text())["traceEvents"] if e.get("ph") == "X" and "dur" in e]
    if category is None:
        category = "kernel" if any(e.get("cat") == "kernel" for e in events) else "cpu_op"
    totals: dict[str, list[float]] = {}
    for e in events:
        if e.get("cat") == category:
            entry = totals.setdefault(e["name"], [0.0, 0])
            entry[0] += float(e["dur"])
            entry[1] += 1
    rows = [{"name": name, "total_us": t, "calls": int(n)} for name, (t, n) in totals.items()]
    rows.sort(key=lambda r: -float(r["total_us"]))
    return rows[:top]


def peak_extra_mib(fn: Callable[[], object]) -> float:
    """Peak CUDA memory that one call of fn allocates beyond what is already held, in MiB."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20
