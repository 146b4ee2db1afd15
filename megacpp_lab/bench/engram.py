"""Engram benchmark: eager vs compiled forward+backward of the branch, one run, one receipt.

What it measures and writes, and how long it takes: `megacpp-lab bench engram --help`
(megacpp_lab.bench.COMMANDS["engram"]).
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from megacpp_lab.bench import bench_device, output_root
from megacpp_lab.data import ByteTokenizer, load_corpus, pack_documents
from megacpp_lab.nn.engram import EngramBranch, EngramConfig
from megacpp_lab.nn.primitives import ParameterFreeRMSNorm
from megacpp_lab.profiling import peak_extra_mib, profile_trace, time_ms
from megacpp_lab.receipts import device_slug, make_receipt, write_receipt
from megacpp_lab.varlen import PackedContext


@dataclass(frozen=True)
class EngramBenchShape:
    B: int
    T: int
    C: int
    bottleneck: int


FULL_SHAPE = EngramBenchShape(B=8, T=4096, C=1024, bottleneck=256)
SMALL_SHAPE = EngramBenchShape(B=2, T=256, C=128, bottleneck=32)
FULL_SWEEP_T = (1024, 2048, 4096, 8192)
SMALL_SWEEP_T = (128, 256)
SMALL_REPS = {"rep": 1, "warmup": 0}  # a --small run is a smoke test: one timed call per contender


def packed_context(B: int, T: int, device: torch.device | str) -> PackedContext:
    """The PackedContext of B rows of T tokens packed from real torch headers (realistic boundary density):
    built and validated once, on the host, then moved, as the training loop does."""
    tok = ByteTokenizer()
    docs = load_corpus(stride=7, max_bytes=int(B * T * 1.1) + 4096)
    packed = pack_documents([tok.encode(d.data) for d in docs], T, pad_id=tok.pad_id, max_rows=B)
    if packed.batch.batch_size < B:
        raise ValueError(f"the corpus filled only {packed.batch.batch_size} of {B} rows of {T} tokens")
    return PackedContext.from_batch(packed.batch).to(device)


def _branch(shape: EngramBenchShape, *, gated: bool, conv_impl: str, dtype: torch.dtype, device: str) -> EngramBranch:
    cfg = EngramConfig(
        d_model=shape.C,
        bottleneck=shape.bottleneck,
        gated=gated,
        conv_kernel=4 if gated else 0,
        conv_impl=conv_impl,
    )
    torch.manual_seed(0)
    branch = EngramBranch(cfg)
    nn.init.normal_(branch.out_proj.weight, std=0.02)  # a trained branch, not the zero init
    return branch.to(device=device, dtype=dtype)


def _measure(module: nn.Module, x: torch.Tensor, ctx: PackedContext, grad: torch.Tensor, device: str,
             rep: int | None = None, warmup: int = 3) -> tuple[dict[str, float], torch.Tensor]:  # fmt: skip
    """Timings of fwd+bwd and fwd, and the output of the first call (for the error columns: taken from
    the call that compiled, so a compiled module is not compiled again for a no_grad forward)."""
    x = x.detach().requires_grad_(True)

    def fwd() -> torch.Tensor:
        return module(x, ctx=ctx)

    def fwd_bwd() -> torch.Tensor:
        y = module(x, ctx=ctx)
        y.backward(grad)
        return y

    out: dict[str, float] = {}
    t0 = time.perf_counter()
    first = fwd_bwd().detach()  # for a compiled module, this call compiles
    if device == "cuda":
        torch.cuda.synchronize()
    out["first_call_s"] = time.perf_counter() - t0
    if device == "cuda":
        out["peak_mib"] = peak_extra_mib(fwd_bwd)
    if rep is None:
        rep = 20 if device == "cuda" else 5
    out["ms"] = time_ms(fwd_bwd, warmup=warmup, rep=rep, device=device)
    out["fwd_ms"] = time_ms(fwd, warmup=warmup, rep=rep, device=device)
    return out, first


ALL_CONTENDERS = (
    ("gated", True, "maxtext_depthwise"),
    ("gated", True, "xla_safe"),
    ("minimal", False, "maxtext_depthwise"),
)


def bench_engram_branch(
    shape: EngramBenchShape,
    *,
    dtype: torch.dtype = torch.bfloat16,
    device: str = "cuda",
    contenders: tuple[tuple[str, bool, str], ...] = ALL_CONTENDERS,
    progress: bool = True,
    rep: int | None = None,
    warmup: int = 3,
) -> dict[str, Any]:
    """Eager vs compiled fwd+bwd for gated (both conv impls) and minimal modes; one receipt.
    rep: timed calls per contender (default 20 on CUDA, 5 on CPU)."""
    from tqdm.auto import tqdm

    ctx = packed_context(shape.B, shape.T, device)
    gen = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(shape.B, shape.T, shape.C, generator=gen, device=device, dtype=dtype)
    grad = torch.randn(shape.B, shape.T, shape.C, generator=gen, device=device, dtype=dtype)

    reference = _branch(shape, gated=True, conv_impl="maxtext_depthwise", dtype=torch.float32, device=device)
    with torch.no_grad():
        ref_out = reference(x.float(), ctx=ctx)
    del reference

    plan = contenders
    results: list[dict[str, Any]] = []
    eager_ms: dict[str, float] = {}
    eager_out: dict[str, torch.Tensor] = {}
    bar = tqdm(total=2 * len(plan), desc="engram contenders", disable=not progress)
    for mode, gated, impl in plan:
        label = f"{mode}[{impl}]" if gated else mode
        eager = _branch(shape, gated=gated, conv_impl=impl, dtype=dtype, device=device)
        torch._dynamo.reset()
        compiled = torch.compile(eager)
        for kind, module in (("eager", eager), ("compiled", compiled)):
            stats, y = _measure(module, x, ctx, grad, device, rep=rep, warmup=warmup)
            row: dict[str, Any] = {"contender": f"{kind} {label}", **stats}
            if kind == "compiled":
                row["compile_s"] = row.pop("first_call_s")
                row["speedup"] = eager_ms[label] / stats["ms"]
                row["max_abs_err"] = float((y.float() - eager_out[label].float()).abs().max())
            else:
                row.pop("first_call_s")
                eager_ms[label], eager_out[label] = stats["ms"], y
            if gated and impl == "maxtext_depthwise":
                row["rel_err"] = float((y.float() - ref_out).norm() / ref_out.norm())
            row["tokens_per_s"] = shape.B * shape.T / (stats["ms"] / 1e3)
            results.append(row)
            bar.update()
        del eager, compiled, eager_out[label]
    bar.close()
    return make_receipt(
        "engram_gated_fwd_bwd",
        "engram",
        shape=asdict(shape),
        dtype=dtype,
        results=results,
        device=device,
        notes=(
            "forward+backward of EngramBranch on packed rows of real torch headers (their PackedContext, built once); "
            "compiled = torch.compile(branch) (inductor, default mode), per block; speedup = eager ms / compiled ms "
            "of the same mode in this run; max_abs_err = compiled vs eager output; rel_err = vs fp32 eager"
        ),
        num_docs=ctx.n_seqs,
    )


def bench_engram_sweep(
    shape: EngramBenchShape,
    seq_lens: tuple[int, ...],
    *,
    dtype: torch.dtype = torch.bfloat16,
    device: str = "cuda",
    progress: bool = True,
    rep: int | None = None,
    warmup: int = 3,
) -> dict[str, Any]:
    """Eager vs compiled gated branch over sequence length (speed curve)."""
    from tqdm.auto import tqdm

    results = []
    for T in tqdm(seq_lens, desc="engram T sweep", disable=not progress):
        s = EngramBenchShape(B=shape.B, T=T, C=shape.C, bottleneck=shape.bottleneck)
        ctx = packed_context(s.B, T, device)
        x = torch.randn(s.B, T, s.C, device=device, dtype=dtype)
        grad = torch.randn_like(x)
        eager = _branch(s, gated=True, conv_impl="maxtext_depthwise", dtype=dtype, device=device)
        torch._dynamo.reset()
        compiled = torch.compile(eager)
        for kind, module in (("eager", eager), ("compiled", compiled)):
            stats, _ = _measure(module, x, ctx, grad, device, rep=rep, warmup=warmup)
            stats.pop("first_call_s")
            results.append({"contender": kind, "shape": asdict(s), **stats, "tokens_per_s": s.B * T / (stats["ms"] / 1e3)})
    return make_receipt(
        "engram_gated_seq_sweep", "engram", shape=asdict(shape) | {"T": list(seq_lens)}, dtype=dtype,
        results=results, device=device,
    )


def manual_rms_norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """The RMSNorm docs/design.md forbids (variance by hand in the input dtype); kept to measure against."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def rmsnorm_overflow_sweep(
    device: str = "cuda", scales: tuple[float, ...] = (1.0, 1e8, 1e16, 1e17, 3e17, 1e18, 1e19), D: int = 4096
) -> dict[str, Any]:
    """Max error vs an fp64 reference of the manual and the fused RMSNorm on bf16 activations."""
    norm = ParameterFreeRMSNorm()
    results = []
    for scale in scales:
        gen = torch.Generator(device=device).manual_seed(0)
        x = (torch.randn(64, D, generator=gen, device=device) * scale).to(torch.bfloat16)
        ref = F.rms_norm(x.double(), (D,), eps=1e-6)
        for name, fn in (("manual x.pow(2).mean(-1)", manual_rms_norm), ("F.rms_norm (_RMSNorm)", norm)):
            y = fn(x)
            finite = bool(torch.isfinite(y).all())
            err = float((y.double() - ref).abs().max()) if finite else float("inf")
            row: dict[str, Any] = {"contender": name, "shape": {"rows": 64, "D": D, "scale": scale}, "finite": finite}
            if finite:
                row["max_abs_err"] = err
            else:
                row["nonfinite_outputs"] = int((~torch.isfinite(y)).sum())
            results.append(row)
    return make_receipt(
        "rmsnorm_bf16_overflow", "engram", shape={"rows": 64, "D": D}, dtype=torch.bfloat16,
        results=results, device=device,
        notes="x = randn * scale in bf16; error vs F.rms_norm in float64; sum(x^2) passes 3.4e38 near scale 2.9e17",
    )


def run(out_root: str | Path | None = None, *, small: bool = False, trace: bool = True) -> list[Path]:
    """The whole Engram benchmark; returns the files written (see megacpp_lab.bench.output_root for where)."""
    import matplotlib

    matplotlib.use("Agg")
    from megacpp_lab.plots import plot_contenders, plot_sweep, save_figure

    device = bench_device("engram", small)
    shape, sweep = (SMALL_SHAPE, SMALL_SWEEP_T) if small else (FULL_SHAPE, FULL_SWEEP_T)
    reps = SMALL_REPS if small else {}
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    root = output_root(out_root, small)
    written: list[Path] = []

    main = bench_engram_branch(shape, dtype=dtype, device=device, **reps)
    written.append(write_receipt(main, root))
    written.append(save_figure(plot_contenders(main, "ms"), written[-1].with_suffix(".png")))

    curve = bench_engram_sweep(shape, sweep, dtype=dtype, device=device, **reps)
    written.append(write_receipt(curve, root))
    written.append(save_figure(plot_sweep(curve, "T", "ms"), written[-1].with_suffix(".png")))

    written.append(write_receipt(rmsnorm_overflow_sweep(device), root))

    if trace:
        branch = _branch(shape, gated=True, conv_impl="maxtext_depthwise", dtype=dtype, device=device)
        torch._dynamo.reset()
        compiled = torch.compile(branch)
        ctx = packed_context(shape.B, shape.T, device)
        x = torch.randn(shape.B, shape.T, shape.C, device=device, dtype=dtype, requires_grad=True)
        g = torch.randn_like(x)
        path, _ = profile_trace(
            lambda: compiled(x, ctx=ctx).backward(g),
            root / device_slug(main["device"]) / "engram",
            "engram_gated_compiled",
            steps=1 if small else 2,
            warmup=1 if small else 2,
        )
        written.append(path)
    return written
