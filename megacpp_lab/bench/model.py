"""Whole-model benchmark: HybridLM's eager training step, one run, three receipts.

What it measures and writes, and how long it takes: `megacpp-lab bench model --help`
(megacpp_lab.bench.COMMANDS["model"]). This is the eager baseline that regional compile and the
activation-memory policies are measured against.
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
from megacpp_lab.bench.harness import (FORWARD_ONLY, FULL_SHAPE, OTHER_NOTE, SMALL_SHAPE, ModelShape, TrainingStep,
                                       build_model, leak_features, make_batch, profile_labels)
from megacpp_lab.data import boundary_windows, load_sample
from megacpp_lab.model.config import HybridConfig, hybrid_preset, model_config
from megacpp_lab.model.parallelize import ParallelConfig
from megacpp_lab.profiling import label_modules, peak_mib, profile_trace, step_times_ms, time_by_label
from megacpp_lab.receipts import device_name, device_slug, make_receipt, write_receipt
from megacpp_lab.testing import model_leak_report, wake_zero_initialised
from megacpp_lab.varlen import build_context

# generality: batch sizes at T=4096, T at B*T fixed, 1 and 64 documents per row
FULL_SWEEP = tuple(replace(FULL_SHAPE, **kw) for kw in (
    dict(B=1), dict(B=2), {}, dict(B=8), dict(B=8, T=2048), dict(B=2, T=8192), dict(docs=1), dict(docs=64),
))  # fmt: skip
SMALL_SWEEP = (SMALL_SHAPE, replace(SMALL_SHAPE, B=1, docs=1))
# the leak check: real packed BPE rows through the `small` preset (and with every optional branch on)
LEAK_ROWS, LEAK_LEN, LEAK_LEAD = 2, 512, 200


def _timed_row(contender: str, fn: Callable[[], object], release: Callable[[], None], tokens: int,
               flops_per_token: int, *, device: str, warmup: int, steps: int, key: str = "ms") -> dict[str, Any]:  # fmt: skip
    fn()  # first call outside the peak: kernel autotuning and allocator growth
    release()  # the peak's baseline holds parameters and batch, no gradients
    row: dict[str, Any] = {"contender": contender, **(peak_mib(fn) if device == "cuda" else {})}
    samples = sorted(step_times_ms(fn, warmup=warmup, steps=steps, device=device))
    ms = statistics.median(samples)
    row.update({key: ms, "ms_min": samples[0], "ms_max": samples[-1], "steps": steps,
                "tokens_per_s": tokens / (ms / 1e3), "tflops": flops_per_token * tokens / (ms / 1e3) / 1e12})  # fmt: skip
    return row


def bench_model_step(shape: ModelShape = FULL_SHAPE, *, device: str = "cuda", warmup: int = 3, steps: int = 10,
                     trace_dir: str | Path | None = None, progress: bool = True) -> dict[str, Any]:  # fmt: skip
    """The eager training step at one shape: fwd+bwd, forward alone, fwd+bwd+fused AdamW, the context
    build, and (with trace_dir) one profiled fwd+bwd step with each bucket's share of it."""
    from tqdm.auto import tqdm

    config = model_config(shape.preset, device)
    model = build_model(config, device)
    tokens, doc_ids, targets = make_batch(shape, config.vocab_size, device, ignore_index=config.lm_head.ignore_index)
    n_tokens = shape.B * shape.T
    bar = tqdm(total=5 if trace_dir is not None else 4, desc=f"model {shape.preset} B={shape.B} T={shape.T}",
               disable=not progress)  # fmt: skip
    ctx_ms = sorted(step_times_ms(lambda: build_context(doc_ids), warmup=1, steps=steps, device=device))
    ctx = build_context(doc_ids)
    flops = model.flops_per_token(shape.T, doc_lens=ctx.doc_lengths)
    step = TrainingStep(model, tokens, ctx, targets)
    bar.update()
    results = [_timed_row("eager fwd+bwd", step, step.release, n_tokens, flops["total"], device=device, warmup=warmup, steps=steps)]
    bar.update()
    fwd = _timed_row("eager forward (no_grad)", step.forward_only, step.release, n_tokens, flops["total"] // 3, device=device,
                     warmup=warmup, steps=steps, key="fwd_ms")  # fmt: skip
    results.append(fwd)
    bar.update()
    adamw = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device == "cuda")
    results.append(_timed_row("eager fwd+bwd + fused AdamW", TrainingStep(model, tokens, ctx, targets, adamw), step.release, n_tokens,
                              flops["total"], device=device, warmup=warmup, steps=steps))  # fmt: skip
    del adamw
    results.append({"contender": "build_context (per batch, outside the step)", "ms": ctx_ms[len(ctx_ms) // 2]})
    bar.update()
    main = results[0]
    extra: dict[str, Any] = {}
    if trace_dir is not None:
        with label_modules(profile_labels(model), forward_only=FORWARD_ONLY):
            path, _ = profile_trace(step, trace_dir, "model_step", steps=1, warmup=1, record_shapes=False)
        split = time_by_label(path)
        # GPU: kernel durations are device-side and barely moved by the profiler, whose host-side recording
        # stretches the profiled step with gaps; so the shares are of the unprofiled median step. CPU: the
        # profiler slows the host work itself, so the shares are of the profiled step.
        gpu = "gpu" in split["basis"]
        step_us = main["ms"] * 1e3 if gpu else split["step_us"]
        forward_us = split["total_us"] - sum(split["us_backward"].values()) - split["us"].get("other", 0.0)
        extra["block_time"] = {
            "basis": split["basis"],
            "trace": path.name,
            "step_ms": step_us / 1e3,
            "step": "the unprofiled median fwd+bwd step" if gpu else "the profiled step",
            "profiled_step_ms": split["step_us"] / 1e3,
            "labelled_ms": split["total_us"] / 1e3,
            "forward_ms": forward_us / 1e3,
            "backward_ms": sum(split["us_backward"].values()) / 1e3,
            "ms_per_step": {k: v / 1e3 for k, v in sorted(split["us"].items(), key=lambda kv: -kv[1])},
            "backward_ms_per_step": {k: v / 1e3 for k, v in split["us_backward"].items()},
            "share_of_labelled_time": split["share"],
            "share_of_step": {k: v / step_us for k, v in split["us"].items()},
            "unaccounted_share_of_step": max(0.0, 1.0 - split["total_us"] / step_us),
            "kernels_without_launch": split["kernels_without_launch"],
            "note": OTHER_NOTE + ("; unaccounted: the GPU idle (no kernel running) in the unprofiled step, taking "
                                  "the profiled kernel times as they are" if gpu else
                                  "; unaccounted: host time outside every labelled range"),
        }  # fmt: skip
        bar.update()
    bar.close()
    params = model.num_parameters()
    return make_receipt(
        "model_step", "model", shape=asdict(shape), dtype="bfloat16" if device == "cuda" else "float32",
        results=results, device=device, **extra,
        config={"pattern": config.pattern, "blocks": config.blocks, "n_layers": config.n_layers,
                "d_model": config.d_model, "vocab_size": config.vocab_size, "engram_layers": list(config.engram_layers),
                "attn_impl": config.mla.attn_impl, "m_block": config.m_block, "mamba3_kernel": config.mamba3.kernel,
                "mimo_rank": config.mamba3.mimo_rank, "ssd_kernel": config.ssd.kernel, "m2rnn_kernel": config.m2rnn.kernel,
                "documents": int(ctx.n_seqs)},  # fmt: skip
        parameters=params, flops_per_token=flops,
        notes=(
            "Eager (no torch.compile) training step of HybridLM on one fixed batch: zero_grad, forward to the fused "
            "LM-head loss, backward (and a fused AdamW step in its row). Parameters bf16 (parallelize's in-place cast), "
            "fp32-contract parameters fp32. ms: median of `steps` steps, each timed with CUDA events after warm-up; "
            "peak_mib: peak memory of one step beyond what was held before it (parameters, batch, optimizer state in "
            "its row; gradients freed first), "
            "peak_total_mib: the whole allocation peak. tflops = flops_per_token['total'] * tokens / time, with "
            "HybridLM.flops_per_token given the batch's document lengths (attention over each document's causal "
            "triangle). block_time: one profiled step; each GPU kernel goes to the innermost labelled module "
            "range (forward or backward) that launched it; block_time.forward_ms / backward_ms: kernel time in the "
            "forward and backward ranges."
        ),
    )


def bench_model_sweep(shapes: tuple[ModelShape, ...] = FULL_SWEEP, *, device: str = "cuda", warmup: int = 2,
                      steps: int = 5, progress: bool = True) -> dict[str, Any]:  # fmt: skip
    """Forward+backward and forward alone at every shape: batch size, sequence length, documents per row."""
    from tqdm.auto import tqdm

    results = []
    by_preset: dict[str, tuple[HybridConfig, nn.Module]] = {}
    for shape in tqdm(shapes, desc="model sweep", disable=not progress):
        if shape.preset not in by_preset:  # RoPE table for the longest T swept (its length costs no time)
            longest = max(s.T for s in shapes if s.preset == shape.preset)
            config = model_config(shape.preset, device)
            if longest > config.mla.max_positions:
                config = model_config(shape.preset, device, mla=dict(max_positions=longest))
            by_preset[shape.preset] = config, build_model(config, device)
        config, model = by_preset[shape.preset]
        tokens, doc_ids, targets = make_batch(shape, config.vocab_size, device, ignore_index=config.lm_head.ignore_index)
        ctx = build_context(doc_ids)
        step = TrainingStep(model, tokens, ctx, targets)
        flops, n = model.flops_per_token(shape.T, doc_lens=ctx.doc_lengths)["total"], shape.B * shape.T
        results.append({"shape": asdict(shape), **_timed_row("eager fwd+bwd", step, step.release, n, flops, device=device,
                                                             warmup=warmup, steps=steps)})  # fmt: skip
        results.append({"shape": asdict(shape), **_timed_row("eager forward (no_grad)", step.forward_only, step.release, n, flops // 3,
                                                             device=device, warmup=warmup, steps=steps, key="fwd_ms")})  # fmt: skip
        model.zero_grad(set_to_none=True)
    return make_receipt("model_sweep", "model", shape={"preset": shapes[0].preset, "points": len(shapes)},
                        dtype="bfloat16" if device == "cuda" else "float32", results=results, device=device,
                        notes="as model_step's rows, at each shape (rows carry their own shape)")  # fmt: skip


# the M block's variants, side by side in one run: Mamba-3 (the presets' default, SISO and MIMO R=2) and Mamba-2's SSD
M_BLOCK_VARIANTS = {
    "mamba3 SISO": dict(m_block="mamba3"),
    "mamba3 MIMO R=2": dict(m_block="mamba3", mamba3=dict(mimo_rank=2)),
    "mamba2 SSD": dict(m_block="mamba2"),
}


def bench_m_blocks(shape: ModelShape = FULL_SHAPE, *, device: str = "cuda", warmup: int = 3, steps: int = 10,
                   progress: bool = True) -> dict[str, Any]:  # fmt: skip
    """The eager training step (fwd+bwd) of the preset with each M block variant, on the same batch: time, peak
    memory, parameters and FLOPs side by side, and each variant's ratios to Mamba-2's."""
    from tqdm.auto import tqdm

    results = []
    for name, overrides in tqdm(M_BLOCK_VARIANTS.items(), desc=f"M blocks {shape.preset}", disable=not progress):
        config = model_config(shape.preset, device, **overrides)
        model = build_model(config, device)
        tokens, doc_ids, targets = make_batch(shape, config.vocab_size, device, ignore_index=config.lm_head.ignore_index)
        ctx = build_context(doc_ids)
        step = TrainingStep(model, tokens, ctx, targets)
        flops = model.flops_per_token(shape.T, doc_lens=ctx.doc_lengths)
        row = _timed_row(f"eager fwd+bwd, M = {name}", step, step.release, shape.B * shape.T, flops["total"],
                         device=device, warmup=warmup, steps=steps)  # fmt: skip
        row |= {"variant": name, "parameters": model.num_parameters()["total"], "flops_per_token": flops["total"],
                "m_parameters": model.num_parameters().get("M", 0)}  # fmt: skip
        results.append(row)
        del model, step
        if device == "cuda":
            torch.cuda.empty_cache()
    base = next(r for r in results if r["variant"] == "mamba2 SSD")
    for r in results:
        r["ms_over_mamba2"] = r["ms"] / base["ms"]
        if "peak_mib" in r and "peak_mib" in base:
            r["peak_over_mamba2"] = r["peak_mib"] / base["peak_mib"]
    return make_receipt(
        "model_m_blocks", "model", shape=asdict(shape), dtype="bfloat16" if device == "cuda" else "float32",
        results=results, device=device, variants={k: {kk: str(vv) for kk, vv in v.items()} for k, v in M_BLOCK_VARIANTS.items()},
        notes=(
            "The eager training step (zero_grad, forward to the fused loss, backward) of the preset with each M block "
            "variant (HybridConfig.m_block, mamba3.mimo_rank), everything else equal, on one seeded packed batch. ms: "
            "median of `steps` steps (CUDA events after warm-up), with min and max; peak_mib: the step's peak beyond "
            "parameters and batch; ms_over_mamba2 / peak_over_mamba2: against the Mamba-2 SSD row of this run."
        ),
    )  # fmt: skip


def leak_windows(device: str, length: int = LEAK_LEN) -> tuple[torch.Tensor, torch.Tensor]:
    """Real packed BPE rows: LEAK_ROWS windows of `length` tokens of the committed BPE sample, each with a
    document boundary LEAK_LEAD tokens in (more where the documents are short)."""
    window = boundary_windows(load_sample(tokenizer="bpe")[0].batch, LEAK_ROWS, length, lead=min(LEAK_LEAD, length // 3))
    return window.tokens.long().to(device), window.doc_ids.to(device)


def whole_model_leak_check(preset: str, device: str, *, compiled: bool = False, features: bool = False,
                           length: int = LEAK_LEN, **overrides: Any) -> tuple[Any, HybridConfig]:  # fmt: skip
    """The whole-model leak check on real packed BPE rows: the preset (its Triton scans on a GPU, in bf16),
    its zero-initialised outputs woken, optionally every optional branch on (mHC, n-gram memory, concept
    bank: leak_features) and every block compiled on its own (apply_compile). Returns (LeakReport, config)."""
    if features:
        overrides = {**leak_features(hybrid_preset(preset).n_layers), **overrides}
    config = model_config(preset, device, **overrides)
    model = build_model(config, device, parallel=ParallelConfig(compile=compiled))  # compiles at its first call
    wake_zero_initialised(model)
    model.eval()
    tokens, doc_ids = leak_windows(device, length)
    return model_leak_report(model, tokens % config.vocab_size, doc_ids, vocab_size=config.vocab_size), config


def bench_model_leaks(preset: str, *, device: str, length: int = LEAK_LEN, progress: bool = True) -> dict[str, Any]:
    """The whole-model leak check, eager, as a receipt: the worst cross-document and causal change of the
    logits against the tolerance, for the preset and for the preset with every optional branch."""
    from tqdm.auto import tqdm

    results = []
    for features in tqdm((False, True), desc="whole-model leak check", disable=not progress):
        start = time.perf_counter()
        report, config = whole_model_leak_check(preset, device, features=features, length=length)
        results.append({
            "contender": f"{preset} eager" + (" + mHC, n-gram memory, CBlock" if features else ""),
            "passed": report.passed, "tol": report.tol,
            "cross_doc_leak": report.cross_doc.magnitude if report.cross_doc else 0.0,
            "causal_leak": report.causal.magnitude if report.causal else 0.0,
            "docs_perturbed": report.n_docs_perturbed, "positions_perturbed": report.n_positions_perturbed,
            "weakest_own_response": report.dependence.weakest,
            "engram_layers": list(config.engram_layers), "mhc": config.mhc, "ngram_layers": list(config.ngram_layers),
            "cblock_layers": list(config.cblock_layers), "check_s": time.perf_counter() - start,
            "report": str(report),
        })  # fmt: skip
    return make_receipt("model_leaks", "model", shape={"preset": preset, "B": LEAK_ROWS, "T": length},
                        dtype="bfloat16" if device == "cuda" else "float32", results=results, device=device,
                        notes="check_leaks on the logits of real packed BPE rows (the committed sample), the "
                              "zero-initialised outputs woken (testing.wake_zero_initialised), the scans on their "
                              "Triton paths; cross_doc_leak / causal_leak: the largest change of a logit of another "
                              "document / an earlier position, which must stay below tol")  # fmt: skip


def _plot_step(receipt: dict[str, Any]) -> Any:
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4))
    rows = [r for r in receipt["results"] if "tokens_per_s" in r]
    names = [r["contender"] for r in rows]
    ms = [r.get("ms", r.get("fwd_ms")) for r in rows]
    bars = left.barh(names, ms, color="tab:blue")
    left.bar_label(bars, labels=[f"{v:.1f} ms, {r['tokens_per_s'] / 1e3:.0f}k tok/s" for v, r in zip(ms, rows)],
                   padding=3, fontsize=8)  # fmt: skip
    left.invert_yaxis()
    left.set_xlabel("ms per step (median)")
    left.set_xlim(0, max(ms) * 1.6)
    shape = ", ".join(f"{k}={v}" for k, v in receipt["shape"].items())
    left.set_title(f"HybridLM eager step ({receipt['dtype']})\n{shape}\n{receipt['device']}", fontsize=9)
    split = receipt.get("block_time")
    if split:
        idle = "GPU idle" if "gpu" in split["basis"] else "unlabelled"
        share = {**split["share_of_step"], idle: split["unaccounted_share_of_step"]}
        keys = sorted(share, key=lambda k: -share[k])
        bars = right.barh(keys, [100 * share[k] for k in keys], color="tab:orange")
        right.bar_label(bars, labels=[f"{100 * share[k]:.1f}%" for k in keys], padding=3, fontsize=8)
        right.invert_yaxis()
        right.set_xlabel("% of the profiled fwd+bwd step")
        right.set_title(f"share of the step by block kind (of {split['step']}, {split['step_ms']:.1f} ms)\n"
                        f"{split['basis']}", fontsize=9)
    else:
        right.axis("off")
    fig.tight_layout()
    return left


def run(out_root: str | Path | None = None, *, small: bool = False, trace: bool = True) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    from megacpp_lab.plots import save_figure

    device = bench_device("model", small)
    root = output_root(out_root, small)
    shape = SMALL_SHAPE if small else FULL_SHAPE
    slug = device_slug(device_name(device))
    written: list[Path] = []
    start = time.perf_counter()
    main = bench_model_step(shape, device=device, warmup=1 if small else 3, steps=2 if small else 10,
                            trace_dir=root / slug / "model" if trace else None)  # fmt: skip
    main["elapsed_s"] = time.perf_counter() - start
    written.append(write_receipt(main, root))
    written.append(save_figure(_plot_step(main), written[-1].with_suffix(".png")))
    if trace:
        written.append(root / slug / "model" / main["block_time"]["trace"])
    start = time.perf_counter()
    sweep = bench_model_sweep(SMALL_SWEEP if small else FULL_SWEEP, device=device, warmup=1 if small else 2,
                              steps=2 if small else 5)  # fmt: skip
    sweep["elapsed_s"] = time.perf_counter() - start
    written.append(write_receipt(sweep, root))
    written.append(save_figure(_plot_sweep(sweep), written[-1].with_suffix(".png")))
    start = time.perf_counter()
    m_blocks = bench_m_blocks(shape, device=device, warmup=1 if small else 3, steps=2 if small else 10)
    m_blocks["elapsed_s"] = time.perf_counter() - start
    written.append(write_receipt(m_blocks, root))
    start = time.perf_counter()
    leaks = bench_model_leaks("tiny" if small else "small", device=device, length=48 if small else LEAK_LEN)
    leaks["elapsed_s"] = time.perf_counter() - start
    written.append(write_receipt(leaks, root))
    failed = [r["contender"] for r in leaks["results"] if not r["passed"]]
    if failed:  # the receipt says what leaked; the command must not end as if nothing did
        raise RuntimeError(f"the whole-model leak check failed for {failed}: see {written[-1]}")
    return written


def _plot_sweep(receipt: dict[str, Any]) -> Any:
    """Tokens/s at every swept shape, forward+backward beside forward alone."""
    import matplotlib.pyplot as plt

    labels = list(dict.fromkeys(f"B={r['shape']['B']} T={r['shape']['T']}\n{r['shape']['docs']} docs/row"
                                for r in receipt["results"]))  # fmt: skip
    _, ax = plt.subplots(figsize=(max(7, 1.1 * len(labels)), 4))
    width = 0.4
    for i, contender in enumerate(dict.fromkeys(r["contender"] for r in receipt["results"])):
        rows = [r for r in receipt["results"] if r["contender"] == contender]
        xs = [labels.index(f"B={r['shape']['B']} T={r['shape']['T']}\n{r['shape']['docs']} docs/row") + (i - 0.5) * width
              for r in rows]  # fmt: skip
        bars = ax.bar(xs, [r["tokens_per_s"] / 1e3 for r in rows], width, label=contender)
        ax.bar_label(bars, labels=[f"{r['tokens_per_s'] / 1e3:.0f}" for r in rows], fontsize=7)
    ax.set_xticks(range(len(labels)), labels, fontsize=8)
    ax.set_ylabel("thousand tokens / s")
    ax.legend(fontsize=8)
    ax.set_title(f"{receipt['name']}: HybridLM {receipt['shape']['preset']}, eager ({receipt['dtype']})\n"
                 f"{receipt['device']}", fontsize=9)  # fmt: skip
    return ax
