"""Timing and profiler traces, the same way on CPU (live notebook cells) and GPU (receipts)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode


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


def time_spread_ms(fn: Callable[[], object], *, warmup: int = 3, rep: int = 20,
                   device: torch.device | str | None = None) -> dict[str, float]:  # fmt: skip
    """{"ms": median, "ms_p20", "ms_p80"} of fn() after warm-up: time_ms's measurement with its spread (do_bench's
    quantiles on a GPU, L2 flushed between runs; perf_counter samples on a CPU)."""
    dev = torch.device(device) if device is not None else torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if warmup < 0 or rep < 1:
        raise ValueError(f"warmup must be >= 0 and rep >= 1, got warmup={warmup}, rep={rep}")
    for _ in range(warmup):
        fn()
    if dev.type == "cuda":
        from triton.testing import do_bench

        torch.cuda.synchronize(dev)
        p20, med, p80 = do_bench(fn, warmup=25, rep=max(rep * 5, 100), quantiles=[0.2, 0.5, 0.8])
        return {"ms": float(med), "ms_p20": float(p20), "ms_p80": float(p80)}
    samples = []
    for _ in range(rep):
        start = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - start) * 1e3)
    qs = statistics.quantiles(samples, n=5, method="inclusive") if len(samples) > 1 else [samples[0]] * 4
    return {"ms": statistics.median(samples), "ms_p20": qs[0], "ms_p80": qs[3]}


def paired_ratio(fn_a: Callable[[], object], fn_b: Callable[[], object], *, rounds: int = 20, warmup: int = 2,
                 device: torch.device | str | None = None) -> dict[str, float]:  # fmt: skip
    """fn_b's time over fn_a's, measured in pairs: each round times one call of each back to back (the order
    alternating, A B then B A, so neither always runs second), L2 flushed before each call on a GPU (do_bench's
    256 MB buffer), CUDA events around each; the median of the rounds' ratios with its p20 / p80, and each one's
    median ms. Two do_bench runs minutes apart drift with the clock and the card's temperature by a few percent;
    the ratio within a round does not, so a bar on a small difference (a gate's overhead) reads this."""
    dev = torch.device(device) if device is not None else torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if rounds < 1 or warmup < 0:
        raise ValueError(f"rounds must be >= 1 and warmup >= 0, got rounds={rounds}, warmup={warmup}")
    for _ in range(warmup):
        fn_a()
        fn_b()
    times: dict[int, list[float]] = {0: [], 1: []}
    if dev.type == "cuda":
        flush = torch.empty(256 * 2**20, dtype=torch.int8, device=dev)
        events = []
        for r in range(rounds):
            for which in ((0, 1) if r % 2 == 0 else (1, 0)):
                flush.zero_()
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                (fn_a if which == 0 else fn_b)()
                end.record()
                events.append((which, start, end))
        torch.cuda.synchronize(dev)
        for which, start, end in events:
            times[which].append(start.elapsed_time(end))
    else:
        for r in range(rounds):
            for which in ((0, 1) if r % 2 == 0 else (1, 0)):
                t0 = time.perf_counter()
                (fn_a if which == 0 else fn_b)()
                times[which].append((time.perf_counter() - t0) * 1e3)
    ratios = [b / a for a, b in zip(times[0], times[1])]
    qs = statistics.quantiles(ratios, n=5, method="inclusive") if len(ratios) > 1 else [ratios[0]] * 4
    return {"ratio": statistics.median(ratios), "ratio_p20": qs[0], "ratio_p80": qs[3],
            "a_ms": statistics.median(times[0]), "b_ms": statistics.median(times[1])}  # fmt: skip


def kernel_ms(fn: Callable[[], object], *, calls: int = 5) -> float:
    """The GPU kernels' time of one call of fn in ms: the durations of every kernel, memcpy and memset the profiler
    records over `calls` calls (after one untimed call), summed and divided by `calls`; no host time. Beside a
    wall-clock time (time_ms) it tells where the GPU waited on the host: a launch-bound contender's wall time is
    well above its kernel time. Kernels on concurrent streams would count twice; CUDA only."""
    return sum(kernel_times_ms(fn, calls=calls).values())


def kernel_times_ms(fn: Callable[[], object], *, calls: int = 5) -> dict[str, float]:
    """kernel_ms by kernel name: each kernel's (memcpy's, memset's) time in one call of fn, in ms, the largest first."""
    from collections import defaultdict

    from torch.profiler import ProfilerActivity, profile

    if not torch.cuda.is_available():
        raise RuntimeError("kernel_times_ms reads CUDA kernel times: it needs a CUDA device")
    if calls < 1:
        raise ValueError(f"calls must be >= 1, got {calls}")
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    by_name: dict[str, float] = defaultdict(float)
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            by_name[e.name] += e.self_device_time_total / 1e3 / calls
    return dict(sorted(by_name.items(), key=lambda kv: -kv[1]))


def step_times_ms(fn: Callable[[], object], *, warmup: int = 2, steps: int = 10,
                  device: torch.device | str | None = None) -> list[float]:  # fmt: skip
    """Milliseconds of each of `steps` calls of fn after `warmup`, one CUDA event pair per call on a GPU.

    For calls of tens of milliseconds or more (a training step), where do_bench would time one or two
    calls: each call is timed on its own, so the spread shows too. No L2 flush: a step's working set is
    far larger than the cache.
    """
    dev = torch.device(device) if device is not None else torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if warmup < 0 or steps < 1:
        raise ValueError(f"warmup must be >= 0 and steps >= 1, got warmup={warmup}, steps={steps}")
    for _ in range(warmup):
        fn()
    if dev.type != "cuda":
        samples = []
        for _ in range(steps):
            start = time.perf_counter()
            fn()
            samples.append((time.perf_counter() - start) * 1e3)
        return samples
    torch.cuda.synchronize(dev)
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(steps)]
    for start, end in events:
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize(dev)
    return [start.elapsed_time(end) for start, end in events]


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
    """The `top` events of a `*.pt.trace.json` by total duration, grouped by name (inductor's kernels by their
    descriptive names: name_inductor_kernels).

    category: 'kernel' for GPU kernels, 'cpu_op' for operators; default: 'kernel' when the
    trace has GPU kernels, else 'cpu_op'.
    """
    events = [e for e in read_trace_events(Path(trace_path)) if e.get("ph") == "X" and "dur" in e]
    name_inductor_kernels(events)  # `triton_` -> inductor's descriptive name of each kernel
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


def sync(device: str | torch.device) -> None:
    """Wait for the work queued on the device (nothing to wait for on a CPU): around what a host clock times."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def peak_mib(fn: Callable[[], object]) -> dict[str, float]:
    """Peak CUDA memory of one call of fn, in MiB: beyond what was held before it (peak_mib) and in all
    (peak_total_mib)."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated()
    return {"peak_mib": (peak - base) / 2**20, "peak_total_mib": peak / 2**20}


def peak_extra_mib(fn: Callable[[], object]) -> float:
    """Peak CUDA memory that one call of fn allocates beyond what is already held, in MiB."""
    return peak_mib(fn)["peak_mib"]


@dataclass(frozen=True)
class WorkingMemory:
    """What one call allocated through torch ops: the peak of its new storages alive at once, and the largest."""

    peak_bytes: int
    largest_bytes: int
    largest_shape: tuple[int, ...]
    largest_op: str


class _LiveStorages(TorchDispatchMode):
    """Tracks the storages that ops create while active (each once; an in-place op's output or a view of a known
    storage is not new) and, after every op, the bytes of those still alive."""

    def __init__(self) -> None:
        super().__init__()
        from torch.multiprocessing.reductions import StorageWeakRef

        self._ref = StorageWeakRef
        self.live: dict[Any, int] = {}
        self.live_bytes = self.peak = self.largest = 0
        self.largest_shape: tuple[int, ...] = ()
        self.largest_op = ""

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self._sweep()  # what was freed since the last op
        seen_before = set()
        for a in torch.utils._pytree.tree_leaves((args, kwargs)):
            if isinstance(a, torch.Tensor):
                seen_before.add(self._ref(a.untyped_storage()))
        out = func(*args, **(kwargs or {}))
        for t in torch.utils._pytree.tree_leaves(out):
            if not isinstance(t, torch.Tensor):
                continue
            ref = self._ref(t.untyped_storage())
            if ref in seen_before or ref in self.live:
                continue
            nbytes = t.untyped_storage().nbytes()
            self.live[ref] = nbytes
            self.live_bytes += nbytes
            if nbytes > self.largest:
                self.largest, self.largest_shape, self.largest_op = nbytes, tuple(t.shape), str(func.overloadpacket.__name__)
        self.peak = max(self.peak, self.live_bytes)  # inputs and outputs of this op are alive together
        return out

    def _sweep(self) -> None:
        for ref in [r for r in self.live if r.expired()]:
            self.live_bytes -= self.live.pop(ref)


def working_memory(fn: Callable[[], object]) -> WorkingMemory:
    """The working memory of one call of fn: the peak bytes of the storages its torch ops allocate that are alive
    at once (what existed before the call not counted), and the largest one with its shape and op. Works on real
    tensors (CPU, GPU) and on meta tensors, so a memory contract can be checked at a shape that would not fit:
    the same ops run, without data. Allocations outside torch's dispatcher (inside a Triton kernel, an
    allocator's rounding, the caching allocator's slack) are not seen: on a GPU, peak_extra_mib is the truth."""
    with _LiveStorages() as live:
        out = fn()
    del out
    return WorkingMemory(live.peak, live.largest, live.largest_shape, live.largest_op)


@contextmanager
def saved_storages(tag: Callable[[torch.Tensor], str | None] = lambda t: "saved",
                   exclude: Iterable[torch.Tensor] = ()) -> Iterator[dict[str, int]]:  # fmt: skip
    """Bytes autograd saves for the backward while the context is open, per tag(tensor) at save time (None: not
    counted): every saved tensor's storage, each storage once (views share it), the storages of `exclude`
    (parameters, buffers: held anyway, no new memory) left out. Filled while open; works on a CPU."""
    from torch.multiprocessing.reductions import StorageWeakRef

    skip = {StorageWeakRef(t.untyped_storage()) for t in exclude}
    seen: set[Any] = set()
    acc: dict[str, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        ref = StorageWeakRef(t.untyped_storage())
        if ref not in skip and ref not in seen:
            key = tag(t)
            if key is not None:
                seen.add(ref)
                acc[key] = acc.get(key, 0) + t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        yield acc


def saved_tensor_bytes(fn: Callable[[], object], exclude: Iterable[torch.Tensor] = ()) -> int:
    """Bytes that autograd saves for the backward during one call of fn (saved_storages): leaf tensors that
    require grad (parameters) and the storages of `exclude` (give the model's parameters and buffers: a view
    of a parameter is no new memory either) left out. The activation memory a checkpointing policy or budget
    acts on; works on a CPU."""
    with saved_storages(lambda t: None if t.is_leaf and t.requires_grad else "saved", exclude) as acc:
        fn()  # storages stay alive while fn's output holds the graph
    return sum(acc.values())


def retained_bytes(fn: Callable[[], object]) -> int:
    """Bytes that one call of fn allocates and still holds when it returns (CPU and GPU memory together): for a
    forward, what waits for the backward, the caches of selective checkpointing included (which
    saved_tensor_bytes cannot see: they bypass the saved-tensor hooks). From the profiler's memory records."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=activities, profile_memory=True) as prof:
        out = fn()  # held past the profile: dropping it would free the graph and what it saved
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    del out
    total = 0
    for event in prof.events():
        total += event.self_cpu_memory_usage
        total += event.self_device_memory_usage if hasattr(event, "self_device_memory_usage") else 0
    return int(total)


# ----------------------------------------------------------------------------- time per labelled module

LABEL_SEP = "|"  # "<bucket>|<module path>": time_by_label sums a label's time into its bucket


@contextmanager
def forward_dtypes(model: torch.nn.Module, *, buffers: bool = False) -> Iterator[dict[str, set[torch.dtype]]]:
    """Forward pre-hooks on every module of `model` while open: the dtypes each of its own parameters (and, with
    buffers=True, its floating buffers) has when the module's forward runs, by qualified name. What a precision
    wrapper or FSDP2's policy really hands the forward (the unsharded, cast copies), not what the model holds."""
    seen: dict[str, set[torch.dtype]] = {}
    handles = []
    for path, module in model.named_modules():

        def pre(mod: torch.nn.Module, args: Any, path: str = path) -> None:
            tensors = list(mod._parameters.items()) + (list(mod._buffers.items()) if buffers else [])
            for name, t in tensors:
                if t is not None and t.is_floating_point():
                    seen.setdefault(f"{path}.{name}" if path else name, set()).add(t.dtype)

        handles.append(module.register_forward_pre_hook(pre))
    try:
        yield seen
    finally:
        for handle in handles:
            handle.remove()


@contextmanager
def label_modules(labels: Mapping[str, torch.nn.Module], *, forward_only: Collection[str] = ()) -> Iterator[None]:
    """Profiler ranges around each module's forward (`<label>`) and backward (`<label>.backward`).

    The backward range runs from the moment the gradient of the module's output arrives to the moment
    the gradient of its inputs is complete (full backward hooks), on the autograd thread that launches
    the backward kernels. Labels in forward_only get no backward range: a full backward hook rebuilds a
    tuple output as a plain tuple (a NamedTuple loses its fields), and a module whose inputs need no
    gradient (an embedding) has no backward range to time. time_by_label reads the ranges back. A forward
    that raises leaves its range open until the context exits: profile steps that complete.
    """
    unknown = set(forward_only) - set(labels)
    if unknown:
        raise ValueError(f"forward_only names labels that are not in labels: {sorted(unknown)}")
    enter, leave = torch.ops.profiler._record_function_enter_new, torch.ops.profiler._record_function_exit
    open_ranges: dict[tuple[int, str], list[Any]] = {}

    def opener(key: tuple[int, str]) -> Callable[..., None]:
        def hook(*_: Any) -> None:
            open_ranges.setdefault(key, []).append(enter(key[1], None))
        return hook

    def closer(key: tuple[int, str]) -> Callable[..., None]:
        def hook(*_: Any) -> None:
            stack = open_ranges.get(key)
            if stack:  # a backward hook fires without its pre-hook when no output needed a gradient
                leave(stack.pop())
        return hook

    handles = []
    try:  # registration too: a failure half-way must not leave hooks behind
        for label, module in labels.items():
            fwd, bwd = (id(module), label), (id(module), label + ".backward")
            handles += [module.register_forward_pre_hook(opener(fwd)), module.register_forward_hook(closer(fwd))]
            if label not in forward_only:
                handles += [module.register_full_backward_pre_hook(opener(bwd)),
                            module.register_full_backward_hook(closer(bwd))]  # fmt: skip
        yield
    finally:
        for handle in handles:
            handle.remove()
        for stack in open_ranges.values():  # an exception mid-forward leaves ranges open
            while stack:
                leave(stack.pop())


def _enclosing_span(spans: list[tuple[Any, ...]], ts: float, *, innermost: bool) -> tuple[Any, ...] | None:
    """Of host ranges (start, end, ...) sorted by start (ties: the longer first), the innermost or the outermost
    one that holds timestamp ts, or None: the last or the first enclosing one in that order."""
    import bisect

    found = None
    for span in spans[: bisect.bisect_right(spans, (ts, float("inf")))]:
        if span[0] <= ts <= span[1]:
            if not innermost:
                return span
            found = span
    return found


def time_by_label(trace_path: str | Path, *, sep: str = LABEL_SEP) -> dict[str, Any]:
    """Time per bucket of the label_modules ranges in a `*.pt.trace.json` (labels "<bucket>|<name>").

    With GPU kernels in the trace: each kernel (memcpy and memset too) goes to the innermost labelled range
    that encloses its launch on the launching thread, found through the launch's correlation id; a kernel
    launched outside every range, or whose launch the trace lacks, counts as 'other' (the latter are
    counted in 'kernels_without_launch'). Without GPU kernels (a CPU run): each range's wall time minus
    the labelled ranges nested in it. Times are per profiled step (the trace's ProfilerStep ranges, whose
    mean wall time is 'step_us'; None without them). Returns {'basis', 'steps', 'step_us', 'total_us',
    'us': {bucket: us}, 'us_backward': {bucket: the part of us in `.backward` ranges}, 'share': {bucket:
    fraction of total_us}, 'kernels_without_launch'}.
    """
    events = [e for e in read_trace_events(Path(trace_path)) if e.get("ph") == "X" and "dur" in e]
    # (start, end, bucket, is_backward) per thread
    ranges: dict[tuple[Any, Any], list[tuple[float, float, str, bool]]] = {}
    for e in events:
        if e.get("cat") == "user_annotation" and sep in e["name"]:
            span = (float(e["ts"]), float(e["ts"]) + float(e["dur"]), e["name"].split(sep, 1)[0], e["name"].endswith(".backward"))
            ranges.setdefault((e["pid"], e["tid"]), []).append(span)
    for spans in ranges.values():
        spans.sort(key=lambda s: (s[0], -s[1]))

    def innermost(thread: tuple[Any, Any], ts: float) -> tuple[str, bool]:
        span = _enclosing_span(ranges.get(thread, []), ts, innermost=True)
        return ("other", False) if span is None else (span[2], span[3])

    def add(bucket: str, backward: bool, dur: float) -> None:
        us[bucket] = us.get(bucket, 0.0) + dur
        if backward:
            us_backward[bucket] = us_backward.get(bucket, 0.0) + dur

    device = [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    us: dict[str, float] = {}
    us_backward: dict[str, float] = {}
    unmatched = 0
    if device:
        launches = {e["args"]["correlation"]: e for e in events
                    if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {})}  # fmt: skip
        for k in device:
            launch = launches.get(k.get("args", {}).get("correlation"))
            unmatched += launch is None
            add(*(innermost((launch["pid"], launch["tid"]), float(launch["ts"])) if launch else ("other", False)),
                float(k["dur"]))
        basis = "gpu kernel time, by the labelled range that launched each kernel"
    else:
        for thread, spans in ranges.items():
            for i, (start, end, bucket, backward) in enumerate(spans):
                nested, reach = 0.0, start  # time of labelled ranges directly inside this one
                for s2, e2, _, _ in spans[i + 1:]:
                    if s2 >= end:
                        break
                    if s2 >= reach:
                        nested += min(e2, end) - s2
                        reach = e2
                add(bucket, backward, end - start - nested)
        basis = "cpu wall time inside each labelled range, nested labelled ranges excluded"
    steps = [float(e["dur"]) for e in events if e.get("cat") == "user_annotation" and e["name"].startswith("ProfilerStep#")]
    n = max(1, len(steps))
    us = {k: v / n for k, v in us.items()}
    total = sum(us.values())
    return {"basis": basis, "steps": len(steps), "step_us": sum(steps) / n if steps else None, "total_us": total,
            "us": us, "us_backward": {k: v / n for k, v in us_backward.items()}, "kernels_without_launch": unmatched,
            "share": {k: v / total for k, v in us.items()} if total else {}}  # fmt: skip


# ----------------------------------------------------------------------------- GPU timeline: compute, comm, idle

_GPU_CATS = frozenset({"kernel", "gpu_memcpy", "gpu_memset"})
_LAUNCH_CATS = frozenset({"cuda_runtime", "cuda_driver"})
_STEP_PREFIX = "ProfilerStep#"


def union_us(spans: Iterable[tuple[float, float]]) -> float:
    """Length of the union of (start, end) intervals: sorted by start, then merged in one pass (O(n log n))."""
    total = 0.0
    run: tuple[float, float] | None = None  # the merged interval being extended
    for start, end in sorted(spans):
        if run is not None and start <= run[1]:
            run = (run[0], max(run[1], end))
            continue
        if run is not None:
            total += run[1] - run[0]
        run = (start, end)
    return total + (run[1] - run[0] if run is not None else 0.0)


def _is_comm_kernel(name: str) -> bool:
    # NCCL's kernels are plain (non-template) functions, so their demangled names start with "nccl":
    # "ncclDevKernel_AllGather_RING_LL(...)" (NCCL >= 2.19), "ncclKernel_AllReduce_RING_LL_Sum_float(...)" (older)
    return name.lower().startswith("nccl")


def _split(gpu: list[dict[str, Any]]) -> dict[str, float]:
    """The timeline split of a non-empty list of GPU events, in ms (see gpu_time_split)."""
    comm: list[tuple[float, float]] = []
    compute: list[tuple[float, float]] = []
    for e in gpu:
        start = float(e["ts"])
        span = (start, start + float(e["dur"]))
        (comm if e.get("cat") == "kernel" and _is_comm_kernel(e["name"]) else compute).append(span)
    window = max(end for _, end in comm + compute) - min(start for start, _ in comm + compute)
    comm_us, compute_us, busy_us = union_us(comm), union_us(compute), union_us(comm + compute)
    exposed = busy_us - compute_us  # |comm or compute| - |compute| = |comm and not compute|

    def share(us: float) -> float:
        return us / window if window else 0.0

    return {"window_ms": window / 1e3, "comm_ms": comm_us / 1e3, "compute_ms": compute_us / 1e3,
            "exposed_comm_ms": exposed / 1e3, "overlapped_comm_ms": (comm_us - exposed) / 1e3,
            "idle_ms": (window - busy_us) / 1e3, "comm_share": share(comm_us), "exposed_comm_share": share(exposed),
            "idle_share": share(window - busy_us)}  # fmt: skip


def read_trace_events(path: Path) -> list[dict[str, Any]]:
    import gzip
    import json

    if not path.is_file():
        raise FileNotFoundError(f"no profiler trace at {path}")
    raw = path.read_bytes()
    if raw[:2] == b"\x1f\x8b":  # gzip magic, whatever the suffix: export_chrome_trace("x.json.gz") writes this
        raw = gzip.decompress(raw)
    data = json.loads(raw)
    # The Chrome trace format allows a bare event array as well as {"traceEvents": [...]}
    return data["traceEvents"] if isinstance(data, dict) else data


# model/parallelize.py names every inductor kernel `triton_` (one source for a kernel several block structures share);
# under the profiler inductor still wraps each launch in a host range with the kernel's descriptive name
INDUCTOR_KERNEL_NAME = "triton_"


def name_inductor_kernels(events: list[dict[str, Any]]) -> int:
    """Give each GPU kernel named `triton_` (inductor's, under unique_kernel_names=False) the name of the innermost
    host range named `triton_<kind>_fused_...` around its launch, found through the launch's correlation id, in
    place; returns how many kernels were renamed (a kernel whose launch or range the trace lacks keeps `triton_`)."""
    anonymous = [e for e in events if e.get("cat") == "kernel" and e.get("name") == INDUCTOR_KERNEL_NAME]
    if not anonymous:
        return 0
    launches = {e["args"]["correlation"]: e for e in events
                if e.get("cat") in _LAUNCH_CATS and "correlation" in e.get("args", {})}  # fmt: skip
    ranges: dict[tuple[Any, Any], list[tuple[float, float, str]]] = {}
    for e in events:
        name = e.get("name", "")
        if e.get("cat") == "cpu_op" and name.startswith(INDUCTOR_KERNEL_NAME) and name != INDUCTOR_KERNEL_NAME:
            ranges.setdefault((e["pid"], e["tid"]), []).append((float(e["ts"]), float(e["ts"]) + float(e["dur"]), name))
    for spans in ranges.values():
        spans.sort(key=lambda s: (s[0], -s[1]))
    renamed = 0
    for k in anonymous:
        launch = launches.get(k.get("args", {}).get("correlation"))
        if launch is None:
            continue
        span = _enclosing_span(ranges.get((launch["pid"], launch["tid"]), []), float(launch["ts"]), innermost=True)
        if span is not None:
            k["name"] = span[2]
            renamed += 1
    return renamed


def _trace_gpu_events(path: Path) -> tuple[list[dict[str, Any]], Any, list[dict[str, Any]]]:
    """A trace's complete events, and the GPU events (kernel, memcpy, memset) of its device with the most kernel
    time, with that device's id; ValueError for a trace with none (a CPU-only trace)."""
    events = [e for e in read_trace_events(path) if e.get("ph") == "X" and "dur" in e and "ts" in e]
    by_device: dict[Any, list[dict[str, Any]]] = {}
    for e in events:
        if e.get("cat") in _GPU_CATS:
            by_device.setdefault(e.get("args", {}).get("device", e.get("pid")), []).append(e)
    if not by_device:
        raise ValueError(f"{path} has no GPU kernels (no kernel/memcpy/memset events): a CPU-only trace?")
    device = max(by_device, key=lambda d: sum(float(e["dur"]) for e in by_device[d] if e.get("cat") == "kernel"))
    return events, device, by_device[device]


def gpu_time_split(trace_path: str | Path, *, steps: int | None = None) -> dict[str, Any]:
    """Where the GPU time of a profiled training window went: compute, communication (NCCL), and nothing.

    Reads a PyTorch profiler Chrome trace (`*.pt.trace.json`, or `.json.gz`) recorded with CUDA activity, one
    rank's file under torch.distributed. GPU events are the complete ("X") events of categories kernel,
    gpu_memcpy and gpu_memset; if the trace holds several devices, only the one with the most kernel time is
    read ('device' names it). A communication kernel is one whose name starts with "nccl" (any case); every
    other GPU event is compute. Intervals on different streams overlap, so every time below is the length of a
    union of intervals, not a sum of durations. All times in ms (the trace's ts/dur are microseconds):

    - window_ms: first GPU event's start to the last one's end.
    - comm_ms: time at least one communication kernel runs.
    - compute_ms: time at least one other GPU event (kernel, memcpy, memset) runs.
    - exposed_comm_ms: communication with no compute beside it (comm minus compute): the GPU only talks, or waits
      inside a collective for a slower peer (a straggling rank shows up here, not as idle).
    - overlapped_comm_ms: comm_ms - exposed_comm_ms, communication hidden under compute.
    - idle_ms: window_ms minus the time anything runs: the GPU waits on the host (launch overhead, Python, a
      synchronising call, the data loader).
    - comm_share, exposed_comm_share, idle_share: those three over window_ms.
    - comm_kernels: [{"name", "calls", "total_ms"}] per communication kernel name (the part before "("), by
      total_ms descending; total_ms sums durations (concurrent calls both count).
    - device: the device read.

    By construction window_ms = compute_ms + exposed_comm_ms + idle_ms. That is why exposed communication and
    idle time are the two terms that make an N-GPU step slower than a 1-GPU step at the same per-GPU batch:
    each GPU runs the same compute kernels on the same shapes as the single GPU does, so compute_ms stays put,
    and only the other two terms can grow. Overlapped communication costs no wall time here; idle grows when
    the GPU waits for the host (a host sync on a collective's result, launch-bound work). One caveat: a
    communication kernel running beside compute shares its SMs and memory bandwidth, which shows up as a
    longer compute_ms; compare compute_ms with the 1-GPU trace's to see that cost.

    per_step (only when the trace has ProfilerStep#<n> CPU annotations): the same numbers for each step, with
    'step' = n, over the GPU events launched inside that step: each GPU event's args["correlation"] names its
    launch (a cuda_runtime / cuda_driver event with the same correlation), and the step is the ProfilerStep
    range that contains the launch's host timestamp, on whichever thread launched it (the autograd thread
    launches the backward). A step's window runs from its own first GPU event to its own last, so the GPU gap
    between two steps belongs to neither step (the top-level idle_ms counts it). Steps that launched no GPU
    event are left out; `steps` keeps at most that many last steps. Each row also holds start_ms and end_ms, its
    first GPU event's start and its last one's end from the trace's first GPU event: the start of the next
    step minus a step's start is its period, gaps included. Alongside: step_ms (each kept step's window_ms)
    and events_outside_steps (GPU events whose launch lies in no step or is missing from the trace: a
    GPU-bound run's trace opens with kernels launched before the profiler became active).

    Fails closed: FileNotFoundError for a missing file, ValueError for a trace with no GPU events (a CPU-only
    trace).
    """
    import bisect

    if steps is not None and steps < 1:
        raise ValueError(f"steps must be >= 1 or None, got {steps}")
    path = Path(trace_path)
    events, device, gpu = _trace_gpu_events(path)
    out: dict[str, Any] = {"device": device, **_split(gpu)}

    calls: dict[str, list[float]] = {}
    for e in gpu:
        if e.get("cat") == "kernel" and _is_comm_kernel(e["name"]):
            entry = calls.setdefault(e["name"].split("(", 1)[0].strip(), [0, 0.0])
            entry[0] += 1
            entry[1] += float(e["dur"])
    rows = [{"name": name, "calls": int(n), "total_ms": us / 1e3} for name, (n, us) in calls.items()]
    out["comm_kernels"] = sorted(rows, key=lambda row: -row["total_ms"])

    # ProfilerStep ranges are sequential on the host (each closes before the next opens): sorted by start,
    # a bisect finds the only candidate for a launch timestamp
    ranges = sorted((float(e["ts"]), float(e["ts"]) + float(e["dur"]), int(e["name"][len(_STEP_PREFIX):]))
                    for e in events if e.get("cat") == "user_annotation" and e["name"].startswith(_STEP_PREFIX)
                    and e["name"][len(_STEP_PREFIX):].isdigit())  # fmt: skip
    if not ranges:
        return out
    starts = [start for start, _, _ in ranges]
    launch_ts = {e["args"]["correlation"]: float(e["ts"]) for e in events
                 if e.get("cat") in _LAUNCH_CATS and "correlation" in e.get("args", {})}  # fmt: skip
    per_step: dict[int, list[dict[str, Any]]] = {}
    outside = 0
    for e in gpu:
        ts = launch_ts.get(e.get("args", {}).get("correlation"))
        i = -1 if ts is None else bisect.bisect_right(starts, ts) - 1
        if ts is not None and i >= 0 and ts <= ranges[i][1]:
            per_step.setdefault(ranges[i][2], []).append(e)
        else:
            outside += 1
    kept = sorted(per_step)[-steps:] if steps is not None else sorted(per_step)
    t0 = min(float(e["ts"]) for e in gpu)
    out["per_step"] = [{"step": n, **_split(per_step[n]),
                        "start_ms": (min(float(e["ts"]) for e in per_step[n]) - t0) / 1e3,
                        "end_ms": (max(float(e["ts"]) + float(e["dur"]) for e in per_step[n]) - t0) / 1e3}
                       for n in kept]  # fmt: skip
    out["step_ms"] = [row["window_ms"] for row in out["per_step"]]
    out["events_outside_steps"] = outside
    return out


def _profiler_steps(events: list[dict[str, Any]], path: Path) -> tuple[list[tuple[float, float]], Callable[[float], bool]]:
    """The trace's ProfilerStep windows (start, end), sorted, and a test of whether a host timestamp lies in one;
    ValueError for a trace without them."""
    import bisect

    steps = sorted((float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in events
                   if e.get("cat") == "user_annotation" and e["name"].startswith(_STEP_PREFIX))  # fmt: skip
    if not steps:
        raise ValueError(f"{path} has no {_STEP_PREFIX} ranges: profile with a schedule (profile_trace) to read steps")
    starts = [s for s, _ in steps]

    def in_step(ts: float) -> bool:
        i = bisect.bisect_right(starts, ts) - 1
        return i >= 0 and ts <= steps[i][1]

    return steps, in_step


def host_time_by_op(trace_path: str | Path, *, prefix: str = "megacpp::", top: int = 20) -> dict[str, Any]:
    """What the host spends in each of the lab's custom operators (names starting with `prefix`) per profiled step,
    from a `*.pt.trace.json` with ProfilerStep ranges: per operator, its calls a step, its host time per call (from
    entering the operator to leaving it: the dispatcher, the launcher's Python, its allocations and its launches),
    and per call the kernel launches it queued itself and the other operators it called directly (each one more
    pass through the dispatcher). The `top` operators by host time a step. Launches are cudaLaunchKernel /
    cuLaunchKernel(Ex) events directly inside the operator. The profiler's own cost per recorded event inflates
    the host times (tens of microseconds an event): compare operators within one trace, not across runs."""
    path = Path(trace_path)
    events = [e for e in read_trace_events(path) if e.get("ph") == "X" and "dur" in e and "ts" in e]
    windows, in_step = _profiler_steps(events, path)
    threads: dict[tuple[Any, Any], list[dict[str, Any]]] = {}
    for e in events:
        if e.get("cat") == "cpu_op" or e.get("cat") in _LAUNCH_CATS:
            threads.setdefault((e["pid"], e["tid"]), []).append(e)
    totals: dict[str, list[float]] = {}  # name -> [calls, host us, launches, operators]
    for thread_events in threads.values():
        thread_events.sort(key=lambda e: (float(e["ts"]), -float(e["dur"])))
        stack: list[tuple[float, str | None]] = []  # (end, the counted operator's name, or None) per open event
        for e in thread_events:
            ts = float(e["ts"])
            while stack and stack[-1][0] <= ts:
                stack.pop()
            parent = stack[-1][1] if stack else None
            if parent is not None:
                if e.get("cat") == "cpu_op":
                    totals[parent][3] += 1
                elif "Launch" in e["name"]:  # not the runtime's other calls (memsets, attribute queries)
                    totals[parent][2] += 1
            counted = e.get("cat") == "cpu_op" and e["name"].startswith(prefix) and in_step(ts)
            if counted:
                row = totals.setdefault(e["name"], [0, 0.0, 0, 0])
                row[0] += 1
                row[1] += float(e["dur"])
            stack.append((ts + float(e["dur"]), e["name"] if counted else None))
    n = len(windows)
    ops = {name: {"calls_per_step": calls / n, "host_us_per_step": us / n, "host_us_per_call": us / calls,
                  "launches_per_call": launches / calls, "operators_per_call": operators / calls}
           for name, (calls, us, launches, operators) in totals.items() if calls}  # fmt: skip
    ranked = sorted(ops, key=lambda k: -ops[k]["host_us_per_step"])[:top]
    return {"steps": n, "prefix": prefix, "host_us_per_step": sum(ops[k]["host_us_per_step"] for k in ops),
            "ops": {k: ops[k] for k in ranked}}


def gpu_idle_by_cause(trace_path: str | Path, *, sep: str = LABEL_SEP, top: int = 10) -> dict[str, Any]:
    """Where a profiled step leaves the GPU idle, and which labelled ranges are host-bound, from a `*.pt.trace.json`
    with CUDA activity and label_modules ranges ("<bucket>|<name>"). Per profiled step (the ProfilerStep ranges;
    the device with the most kernel time, as gpu_time_split reads):

    - idle_us: the time inside the steps' GPU windows when no GPU event runs;
    - idle_by_range: that idle time, each gap charged to the innermost labelled range enclosing the launch of the
      GPU event that ends it ('other' outside every range): the range whose host work the GPU was waiting for;
    - idle_by_host_op: the same gaps by the outermost CPU operator running at that launch (a compiled region, a
      mask builder, the optimizer), the `top` largest;
    - ranges: per label (its `.backward` range separate), the host's wall time in it (host_us) and the GPU kernel
      time it launched (gpu_us); host_bound where host_us > gpu_us: the GPU finishes that range's kernels faster
      than the host queues them, so no queue builds up behind it.

    A profiler's own per-event cost inflates host times (tens of microseconds an operator): a range host-bound in
    the trace may not be without the profiler, the GPU-bound ones are not either way. Fails closed as
    gpu_time_split does (missing file, no GPU events, no ProfilerStep ranges)."""
    path = Path(trace_path)
    events, _, gpu = _trace_gpu_events(path)
    gpu = sorted(gpu, key=lambda e: float(e["ts"]))
    steps, in_step = _profiler_steps(events, path)
    launches = {e["args"]["correlation"]: e for e in events
                if e.get("cat") in _LAUNCH_CATS and "correlation" in e.get("args", {})}  # fmt: skip
    labelled: dict[tuple[Any, Any], list[tuple[float, float, str]]] = {}
    host_ops: dict[tuple[Any, Any], list[tuple[float, float, str]]] = {}
    for e in events:
        span = (float(e["ts"]), float(e["ts"]) + float(e["dur"]))
        if e.get("cat") == "user_annotation" and sep in e["name"]:
            labelled.setdefault((e["pid"], e["tid"]), []).append((*span, e["name"]))
        elif e.get("cat") == "cpu_op":
            host_ops.setdefault((e["pid"], e["tid"]), []).append((*span, e["name"]))
    for table in (labelled, host_ops):
        for spans in table.values():
            spans.sort(key=lambda s: (s[0], -s[1]))

    def enclosing(table: dict[tuple[Any, Any], list[tuple[float, float, str]]], launch: dict[str, Any],
                  innermost: bool) -> str | None:  # fmt: skip
        span = _enclosing_span(table.get((launch["pid"], launch["tid"]), []), float(launch["ts"]), innermost=innermost)
        return None if span is None else span[2]

    idle_by_range: dict[str, float] = {}
    idle_by_op: dict[str, float] = {}
    gpu_by_label: dict[str, float] = {}
    idle = 0.0
    busy_until = None
    for e in gpu:
        launch = launches.get(e.get("args", {}).get("correlation"))
        start = float(e["ts"])
        if launch is not None and in_step(float(launch["ts"])):
            label = enclosing(labelled, launch, innermost=True)
            if label is not None:
                gpu_by_label[label] = gpu_by_label.get(label, 0.0) + float(e["dur"])
            if busy_until is not None and start > busy_until:
                gap = start - busy_until
                idle += gap
                idle_by_range[label or "other"] = idle_by_range.get(label or "other", 0.0) + gap
                op = enclosing(host_ops, launch, innermost=False) or "(no operator)"
                idle_by_op[op] = idle_by_op.get(op, 0.0) + gap
        busy_until = max(busy_until or start, start + float(e["dur"]))
    host_by_label: dict[str, float] = {}
    first_seen: dict[str, float] = {}  # each label's first start: the table in the step's order
    for spans in labelled.values():
        for start, end, name in spans:
            if in_step(start):
                host_by_label[name] = host_by_label.get(name, 0.0) + end - start
                first_seen[name] = min(first_seen.get(name, start), start)
    n = len(steps)
    ranges = {name: {"host_us": host_by_label[name] / n, "gpu_us": gpu_by_label.get(name, 0.0) / n,
                      "host_bound": host_by_label[name] > gpu_by_label.get(name, 0.0)}
              for name in sorted(host_by_label, key=first_seen.__getitem__)}  # fmt: skip
    ops = sorted(idle_by_op.items(), key=lambda kv: -kv[1])
    return {"steps": n, "idle_us": idle / n,
            "idle_by_range": {k: v / n for k, v in sorted(idle_by_range.items(), key=lambda kv: -kv[1])},
            "idle_by_host_op": {k: v / n for k, v in ops[:top]}, "ranges": ranges}  # fmt: skip
