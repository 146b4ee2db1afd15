"""Regional against whole-model compile of HybridLM: cold compile time, step time, MFU, recompiles; one run.

What it measures and writes, and how long it takes: `megacpp-lab bench compile --help`
(megacpp_lab.bench.COMMANDS["compile"]). The eager row is the same step as `bench model`'s baseline,
re-measured in this run so that every ratio is taken between contenders of one process.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

from megacpp_lab.bench import bench_device, output_root
from megacpp_lab.bench.model import FULL_SHAPE, ModelShape, TrainingStep, build_model, make_batch
from megacpp_lab.model.config import model_config
from megacpp_lab.model.parallelize import apply_compile, compile_stats
from megacpp_lab.profiling import profile_trace, step_times_ms
from megacpp_lab.receipts import device_name, device_slug, make_receipt, write_receipt
from megacpp_lab.varlen import build_context

# the bar's reference: an H100 SXM's dense bf16 peak (the H200 has the same SMs and clocks, so the same peak)
PEAK_BF16_TFLOPS = 989.0
# documents per row of the batches after the first: a new count must reuse the graphs, never recompile
DOC_COUNTS = (1, 3, 17, 64, 5, 8)
# B=1 in the smoke run: each batch keeps >= 2 documents (a batch of exactly one document in all is the one
# count that recompiles: a contiguity check in the M2RNN graph's backward trace specializes on it)
SMALL_DOC_COUNTS = (3, 5)
SMALL_COMPILE_SHAPE = ModelShape("tiny", B=1, T=32, docs=2)  # the interpreted Triton scans: seconds a step


def _config(preset: str, device: str) -> Any:
    """The preset with the scans on Triton everywhere (under the interpreter on a CPU): a compiled graph may
    hold the scans' custom ops, never the reference loops."""
    return model_config(preset, device, m2rnn=dict(kernel="triton"), ssd=dict(kernel="triton"))


def _reset() -> None:
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _contender(name: str, wrap: Callable[[nn.Module], nn.Module], shape: ModelShape, device: str, *,
               doc_counts: tuple[int, ...], steps: int, warmup: int, flops_per_token: int,
               trace_dir: Path | None = None) -> dict[str, Any]:  # fmt: skip
    """One contender on a fresh model and a fresh dynamo: the first (cold) step, then steps over batches with
    other document counts (graphs added there are recompiles), then the median step on the first batch."""
    _reset()
    config = _config(shape.preset, device)
    model = wrap(build_model(config, device))
    ignore = config.lm_head.ignore_index
    tokens, doc_ids, targets = make_batch(shape, config.vocab_size, device, ignore_index=ignore)
    step = TrainingStep(model, tokens, build_context(doc_ids), targets)
    _sync(device)
    t0 = time.perf_counter()
    step()
    _sync(device)
    first_s = time.perf_counter() - t0
    after_first = compile_stats()
    for i, docs in enumerate(doc_counts):
        t, d, y = make_batch(replace(shape, docs=docs), config.vocab_size, device, seed=1 + i, ignore_index=ignore)
        TrainingStep(model, t, build_context(d), y)()
    stats = compile_stats()
    samples = sorted(step_times_ms(step, warmup=warmup, steps=steps, device=device))
    ms = statistics.median(samples)
    trace = None
    if trace_dir is not None:  # one step of the compiled regions, for TensorBoard / Perfetto
        trace, _ = profile_trace(step, trace_dir, "compile_regional", steps=1, warmup=1, record_shapes=False)
    n_tokens = shape.B * shape.T
    tflops = flops_per_token * n_tokens / (ms / 1e3) / 1e12
    row: dict[str, Any] = {
        "contender": name, "ms": ms, "ms_min": samples[0], "ms_max": samples[-1], "steps": steps,
        "tokens_per_s": n_tokens / (ms / 1e3), "tflops": tflops, "mfu": tflops / PEAK_BF16_TFLOPS,
        "first_step_s": first_s, "compile_s": max(0.0, first_s - ms / 1e3),
        "graphs": stats.graphs, "graph_breaks": stats.graph_breaks,
        "recompiles": stats.graphs - after_first.graphs, "doc_counts_after_first": list(doc_counts),
    }  # fmt: skip
    if trace is not None:
        row["trace"] = trace.name
    del step, model
    if device == "cuda":
        torch.cuda.empty_cache()
    return row


def bench_compile(shape: ModelShape = FULL_SHAPE, *, device: str = "cuda", doc_counts: tuple[int, ...] = DOC_COUNTS,
                  steps: int = 10, warmup: int = 3, backend: str = "inductor", trace_dir: Path | None = None,
                  progress: bool = True) -> dict[str, Any]:  # fmt: skip
    """Eager, regional (apply_compile) and whole-model torch.compile of one model at one shape, cold caches.
    backend: inductor for a receipt; aot_eager for a CPU smoke run (dynamo's graphs, breaks and recompiles are
    the same, without inductor's minutes of C++ compiles)."""
    from tqdm.auto import tqdm

    from megacpp_lab.model.hybrid import HybridLM

    flops = HybridLM(_config(shape.preset, "cpu")).flops_per_token(shape.T)  # counted on a CPU-built twin
    contenders: list[tuple[str, Callable[[nn.Module], nn.Module]]] = [
        ("eager", lambda m: m),  # first: the Triton kernels' autotuning lands in its first step, not a compile's
        ("regional compile (apply_compile, fullgraph per block)", lambda m: apply_compile(m, backend=backend)),
        ("whole-model torch.compile", lambda m: torch.compile(m, backend=backend)),
    ]
    results = []
    # cold: no inductor or autotune cache from an earlier run may shorten a compile
    with torch._inductor.config.patch(force_disable_caches=True):
        for name, wrap in tqdm(contenders, desc=f"compile {shape.preset} B={shape.B} T={shape.T}", disable=not progress):
            results.append(_contender(name, wrap, shape, device, doc_counts=doc_counts, steps=steps, warmup=warmup,
                                      flops_per_token=flops["total"],
                                      trace_dir=trace_dir if name.startswith("regional") else None))  # fmt: skip
    _reset()
    eager, regional, whole = results
    for row in results[1:]:
        row["step_vs_eager"] = row["ms"] / eager["ms"]
    summary = {
        "regional_over_whole_compile_s": regional["compile_s"] / max(whole["compile_s"], 1e-9),
        "regional_step_over_eager": regional["ms"] / eager["ms"],
        "whole_step_over_eager": whole["ms"] / eager["ms"],
        "regional_mfu": regional["mfu"],
        "bar": {"regional compile <= 1/3 of whole-model compile": regional["compile_s"] <= whole["compile_s"] / 3,
                "regional step <= 0.8x eager": regional["ms"] <= 0.8 * eager["ms"],
                "regional MFU >= 30% of 989 TFLOP/s": regional["mfu"] >= 0.30},  # fmt: skip
    }
    return make_receipt(
        "compile_step", "compile", shape=asdict(shape), dtype="bfloat16" if device == "cuda" else "float32",
        results=results, device=device, summary=summary, backend=backend, flops_per_token=flops, peak_bf16_tflops=PEAK_BF16_TFLOPS,
        notes=(
            "Each contender: a fresh model (seed 0) and a fresh dynamo, inductor caches disabled. first_step_s: the "
            "first training step (zero_grad, forward to the fused loss, backward), which compiles; compile_s = "
            "first_step_s minus the steady step. The eager contender runs first, so the Triton kernels' autotuning "
            "is done before either compile. Then one step on each of doc_counts_after_first (other numbers of "
            "documents per row): graphs dynamo compiled there are recompiles. ms: median of `steps` CUDA-event-timed "
            "steps on the first batch. tflops from HybridLM.flops_per_token (matmuls and attention, forward and "
            "backward); mfu = tflops / 989 (the H100's dense bf16 peak; the H200's is the same)."
        ),
    )  # fmt: skip


def run(out_root: str | Path | None = None, *, small: bool = False, trace: bool = True) -> list[Path]:
    device = bench_device("compile", small)
    root = output_root(out_root, small)
    start = time.perf_counter()
    slug = device_slug(device_name(device))
    trace_dir = root / slug / "compile" if trace else None
    receipt = bench_compile(SMALL_COMPILE_SHAPE if small else FULL_SHAPE, device=device,
                            doc_counts=SMALL_DOC_COUNTS if small else DOC_COUNTS, steps=1 if small else 10,
                            warmup=0 if small else 3, backend="aot_eager" if small else "inductor",
                            trace_dir=trace_dir)  # fmt: skip
    receipt["elapsed_s"] = time.perf_counter() - start
    written = [write_receipt(receipt, root)]
    if trace:
        written.append(trace_dir / next(r["trace"] for r in receipt["results"] if "trace" in r))
    return written
