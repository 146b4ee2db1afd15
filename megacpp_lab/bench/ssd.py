"""SSD scan benchmark: the lab's Triton op vs flash-linear-attention, compiled chunked torch and the step
loop, one run, one receipt set.

What it measures and writes, and how long it takes: `megacpp-lab bench ssd --help`
(megacpp_lab.bench.COMMANDS["ssd"]).
"""

from __future__ import annotations

import functools
import math
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from megacpp_lab.bench import bench_device, output_root, require_triton_interpreter
from megacpp_lab.bench.harness import measure_fwd_bwd, timed_call
from megacpp_lab.kernels.ssd import ssd_chunked_torch, ssd_scan, ssd_scan_reference
from megacpp_lab.profiling import profile_trace
from megacpp_lab.receipts import device_slug, make_receipt, write_receipt
from megacpp_lab.varlen import PackedContext, build_context, doc_ids_from_cu_seqlens, packed_cu_seqlens

# The bar, each measured in the same run at the main shape.
BAR = {
    "fwd_ms <= 1.25 x fla forward": 1.25,
    "ms (fwd+bwd) >= 3 x faster than torch.compile(ssd_chunked_torch)": 3.0,
    "peak_mib <= 0.5 x torch.compile(ssd_chunked_torch)": 0.5,
}
GRADS = ("x", "dt", "A", "Bm", "Cm")
FLA = "fla chunk_simple_gla (g = dt*A per token)"
FLA_GAMMA = "fla chunk_simple_gla g_gamma (data-independent decay per head: a different, easier problem)"
COMPILED = "torch.compile(ssd_chunked_torch)"
EAGER_CHUNKED = "ssd_chunked_torch (eager; --small skips torch.compile)"


@dataclass(frozen=True)
class SSDShape:
    B: int
    T: int
    H: int
    N: int  # state ("K")
    P: int  # head ("V")
    G: int  # groups of B/C (G = H: one per head)
    docs: int  # documents per row
    chunk: int


FULL_SHAPE = SSDShape(B=8, T=4096, H=16, N=128, P=64, G=16, docs=8, chunk=64)
SMALL_SHAPE = SSDShape(B=2, T=32, H=2, N=16, P=16, G=2, docs=2, chunk=16)
# the step loop runs at a shorter length: at T=4096 it is thousands of launches per call
FULL_REF_SHAPE = replace(FULL_SHAPE, B=1, T=256)
SMALL_REF_SHAPE = replace(SMALL_SHAPE, B=1)
# generality sweep, tokens per batch fixed at B*T: lengths, documents per row, one B/C group
FULL_SEQ_LENS, FULL_DOCS = (1024, 2048, 4096, 8192), (1, 8, 64)
SMALL_SEQ_LENS, SMALL_DOCS = (16, 32), (1, 2)
# A --small run is a smoke test under the Triton interpreter: one timed call each, no warm-up.
SMALL_REP = 1


def make_inputs(s: SSDShape, dtype: torch.dtype, device: str, seed: int = 0) -> tuple[list[torch.Tensor], torch.Tensor]:
    """x, dt, A, Bm, Cm (leaves with requires_grad) and cu_seqlens, at the scales the layer produces:
    x ~ randn, dt = softplus(randn - 1) and A = -exp(U(log 1, log 16)) in fp32 (as nn/ssm.py passes them),
    Bm, Cm ~ randn / sqrt(N). x, Bm, Cm in `dtype`. Drawn on the CPU, so every device gets the same values."""
    g = torch.Generator().manual_seed(seed)
    rnd = lambda *shape: torch.randn(*shape, generator=g)  # noqa: E731
    x = rnd(s.B, s.T, s.H, s.P).to(dtype)
    dt = F.softplus(rnd(s.B, s.T, s.H) - 1.0)
    A = -torch.exp(torch.empty(s.H).uniform_(0.0, math.log(16.0), generator=g))
    Bm = (rnd(s.B, s.T, s.G, s.N) / s.N**0.5).to(dtype)
    Cm = (rnd(s.B, s.T, s.G, s.N) / s.N**0.5).to(dtype)
    cu = packed_cu_seqlens(s.B, s.T, s.docs, g)
    return [t.to(device).requires_grad_() for t in (x, dt, A, Bm, Cm)], cu.to(device)


def _oracle(inputs: list[torch.Tensor], cu: torch.Tensor, dy: torch.Tensor | None, chunk: int):
    """y (and the five gradients when dy is given) of ssd_chunked_torch in fp32 on the same values."""
    leaves = [t.detach().float().requires_grad_(dy is not None) for t in inputs]
    with torch.set_grad_enabled(dy is not None):
        y = ssd_chunked_torch(*leaves, cu, chunk=chunk)
    if dy is None:
        return y.detach(), None
    return y.detach(), torch.autograd.grad(y, leaves, dy.float())


def _err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max())


def _grad_errors(grads, grads_ref) -> dict[str, dict[str, float]]:
    """max abs error and relative error (norm of the error / norm of the oracle) per input."""
    return {
        "grad_max_abs_err": {n: _err(a, b) for n, a, b in zip(GRADS, grads, grads_ref)},
        "grad_rel_err": {
            n: float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))
            for n, a, b in zip(GRADS, grads, grads_ref)
        },
    }


def _first_call_s(fn: Callable[[], object], device: str) -> float:
    return timed_call(fn, device)[1]


def _scan_fns(scan: Callable[..., torch.Tensor], inputs: list[torch.Tensor], cu: torch.Tensor, dy: torch.Tensor):
    """The no_grad forward and the forward+backward (the five gradients for dy) of scan on these inputs."""

    def fwd() -> torch.Tensor:
        with torch.no_grad():
            return scan(*inputs, cu)

    def fwd_bwd() -> tuple[torch.Tensor, ...]:
        return torch.autograd.grad(scan(*inputs, cu), inputs, dy)

    return fwd, fwd_bwd


def lab_triton(chunk: int, ctx: PackedContext) -> Callable[..., torch.Tensor]:
    """The Triton op as the model calls it: with the batch's PackedContext, built and validated once per batch
    beforehand (`_validate`), so the call checks and reads back nothing (its cu argument is ctx.cu_seqlens).
    Validation is measured by no contender."""
    return lambda x, dt, A, Bm, Cm, cu: ssd_scan(x, dt, A, Bm, Cm, ctx=ctx, chunk=chunk, kernel="triton")


def _validate(inputs: list[torch.Tensor], cu: torch.Tensor) -> PackedContext:
    """The public entry's full input checks, cu_seqlens values included (fails closed on a bad batch), and the
    batch's PackedContext (build_context validates the layout once, as the training loop does)."""
    with torch.no_grad():
        ssd_scan(*inputs, cu_seqlens=cu, kernel="chunked")
    B, T = inputs[0].shape[:2]
    return build_context(doc_ids_from_cu_seqlens(cu, B, T), cu_seqlens=cu)


def eager_chunked(chunk: int) -> Callable[..., torch.Tensor]:
    return lambda x, dt, A, Bm, Cm, cu: ssd_chunked_torch(x, dt, A, Bm, Cm, cu, chunk=chunk)


@functools.cache
def compiled_chunked(chunk: int) -> Callable[..., torch.Tensor]:
    """ssd_chunked_torch under torch.compile: static shapes (each new B, T or G compiles again, as training at
    one shape would), cu_seqlens' length dynamic so documents per row do not recompile. One wrapper per chunk,
    so the sweep reuses what the main measurement compiled."""
    fn = torch.compile(ssd_chunked_torch, dynamic=False)

    def call(x, dt, A, Bm, Cm, cu):
        torch._dynamo.maybe_mark_dynamic(cu, 0)
        return fn(x, dt, A, Bm, Cm, cu, chunk=chunk)

    return call


def _fla_status(device: str) -> tuple[Callable[..., Any] | None, str | None]:
    """(chunk_simple_gla, None) where it can run, else (None, why not)."""
    from importlib.util import find_spec

    if find_spec("fla") is None:
        return None, "not installed (package fla-core)"
    if device != "cuda":
        return None, "skipped: fla's Triton kernels need a CUDA GPU (this is a CPU --small run)"
    try:
        from fla.ops.simple_gla import chunk_simple_gla
    except Exception as exc:  # an installed package that fails to import is reported, not hidden
        return None, f"import failed: {type(exc).__name__}: {exc}"
    return chunk_simple_gla, None


def _fla_args(inputs: list[torch.Tensor], H: int) -> tuple[torch.Tensor, ...]:
    """q = Cm, k = Bm (per head), v = x*dt, g = dt*A, flattened to one packed row [1, B*T, H, ...]."""
    x, dt, A, Bm, Cm = inputs
    B, T = x.shape[:2]
    per_head = lambda t: (t.repeat_interleave(H // t.shape[2], dim=2) if t.shape[2] != H else t)  # noqa: E731
    q = per_head(Cm).reshape(1, B * T, H, -1)
    k = per_head(Bm).reshape(1, B * T, H, -1)
    v = (x.float() * dt.float()[..., None]).to(x.dtype).reshape(1, B * T, H, -1)
    g = (dt.float() * A.float()).reshape(1, B * T, H)
    return q, k, v, g


def _fla_rows(chunk_simple_gla, inputs, cu, dy, y_ref, grads_ref, *, device: str,
              rep: int) -> tuple[list[dict], list[dict]]:  # fmt: skip
    """fla's gated simple GLA (the same problem) and its g_gamma variant (a different, easier one): the
    measured rows, and the contenders it refused. Timed on the mapped tensors (q, k, v, g as leaves), so the
    mapping's elementwise work is not in fla's time; errors through the mapping, against the fp32 oracle."""
    x = inputs[0]
    B, T, H, P = x.shape
    cu_cpu = cu.long().cpu()
    mapped = [t.detach().contiguous().requires_grad_() for t in _fla_args(inputs, H)]
    do = dy.reshape(1, B * T, H, P)
    varlen = {"scale": 1.0, "cu_seqlens": cu, "cu_seqlens_cpu": cu_cpu}
    call = lambda q, k, v, g: chunk_simple_gla(q, k, v, g=g, **varlen)[0]  # noqa: E731
    rows, refused = [], []

    def fwd():
        with torch.no_grad():
            return call(*mapped)

    fwd_bwd = lambda: torch.autograd.grad(call(*mapped), mapped, do)  # noqa: E731
    o, first = timed_call(fwd, device)
    row: dict[str, Any] = {"contender": FLA, "first_call_s": first, "max_abs_err": _err(o.reshape(B, T, H, P), y_ref)}
    try:
        row["first_call_s"] += _first_call_s(fwd_bwd, device)
    except Exception as exc:  # fla's own guard on Hopper with triton 3.4 .. 3.7.0, or any other failure
        msg = f"{type(exc).__name__}: {exc}"
        status = "refused by fla" if "incorrect results" in str(exc) else "error"
        row |= {"bwd": f"{status}: {msg}"}
        refused.append({"contender": FLA, "metric": "ms (fwd+bwd)", "status": status, "error": msg})
        row |= measure_fwd_bwd(fwd, None, device=device, rep=rep)
    else:
        row |= measure_fwd_bwd(fwd, fwd_bwd, device=device, rep=rep)
        leaves = [t.detach().requires_grad_() for t in inputs]
        o = call(*_fla_args(leaves, H)).reshape(B, T, H, P)
        row |= _grad_errors(torch.autograd.grad(o, leaves, dy), grads_ref)
    rows.append(row)

    gamma = (inputs[2].detach().float() * inputs[1].detach().float().mean()).contiguous()  # A * mean dt, per head
    mapped_nog = mapped[:3]
    call_g = lambda q, k, v: chunk_simple_gla(q, k, v, g_gamma=gamma, **varlen)[0]  # noqa: E731

    def fwd_g():
        with torch.no_grad():
            return call_g(*mapped_nog)

    fwd_bwd_g = lambda: torch.autograd.grad(call_g(*mapped_nog), mapped_nog, do)  # noqa: E731
    row = {"contender": FLA_GAMMA, "g_gamma": "A_h * mean(dt), per head", "first_call_s": _first_call_s(fwd_g, device)}
    try:
        row["first_call_s"] += _first_call_s(fwd_bwd_g, device)
    except Exception as exc:
        msg = f"{type(exc).__name__}: {exc}"
        row["bwd"] = f"error: {msg}"
        refused.append({"contender": FLA_GAMMA, "metric": "ms (fwd+bwd)", "status": "error", "error": msg})
        row |= measure_fwd_bwd(fwd_g, None, device=device, rep=rep)
    else:
        row |= measure_fwd_bwd(fwd_g, fwd_bwd_g, device=device, rep=rep)
    rows.append(row)
    return rows, refused


def bench_ssd(shape: SSDShape = FULL_SHAPE, ref_shape: SSDShape = FULL_REF_SHAPE, *,
              dtype: torch.dtype = torch.bfloat16, device: str = "cuda", compile: bool = True, fla: bool = True,
              rep: int = 20, progress: bool = True) -> dict[str, Any]:  # fmt: skip
    """Every contender at the main shape (the step loop at ref_shape), same inputs, same run."""
    from tqdm.auto import tqdm

    t_start = time.perf_counter()
    inputs, cu = make_inputs(shape, dtype, device)
    dy = torch.randn(inputs[0].shape, generator=torch.Generator().manual_seed(1)).to(device, dtype)
    ctx = _validate(inputs, cu)
    y_ref, grads_ref = _oracle(inputs, cu, dy, shape.chunk)
    bar = tqdm(total=4, desc="ssd contenders", disable=not progress)
    results: list[dict[str, Any]] = []
    not_measured: list[dict[str, Any]] = []
    warm = rep > 1

    # the lab's Triton op
    fwd, fwd_bwd = _scan_fns(lab_triton(shape.chunk, ctx), inputs, cu, dy)
    (y, t_fwd), (grads, t_fwd_bwd) = timed_call(fwd, device), timed_call(fwd_bwd, device)
    lab: dict[str, Any] = {"contender": "triton", "first_call_s": t_fwd + t_fwd_bwd, "max_abs_err": _err(y, y_ref)}
    lab |= _grad_errors(grads, grads_ref)
    lab |= measure_fwd_bwd(fwd, fwd_bwd, device=device, rep=rep)
    results.append(lab)
    bar.update()

    # plain-torch chunked: compiled (once, then warmed up) on a GPU, eager in a --small run
    name = COMPILED if compile else EAGER_CHUNKED
    scan = (compiled_chunked if compile else eager_chunked)(shape.chunk)
    fwd, fwd_bwd = _scan_fns(scan, inputs, cu, dy)
    chunked: dict[str, Any] = {"contender": name}
    if compile:
        chunked["compile_s"] = _first_call_s(fwd_bwd, device) + _first_call_s(fwd, device)
        if warm:
            fwd_bwd()
            fwd()
    chunked["max_abs_err"] = _err(fwd(), y_ref)
    chunked |= _grad_errors(fwd_bwd(), grads_ref)
    chunked |= measure_fwd_bwd(fwd, fwd_bwd, device=device, rep=rep)
    results.append(chunked)
    if not compile:
        not_measured.append({
            "contender": COMPILED, "status": "skipped",
            "reason": "--small runs the chunked path eager: torch.compile is the GPU receipt's contender",
        })  # fmt: skip
    bar.update()

    # flash-linear-attention, where it is installed and there is a GPU
    chunk_simple_gla, why = _fla_status(device) if fla else (None, "skipped: fla=False")
    if chunk_simple_gla is None:
        status = why.split(":")[0].split(" (")[0]  # "not installed", "skipped", "import failed"
        not_measured += [{"contender": c, "status": status, "reason": why} for c in (FLA, FLA_GAMMA)]
    else:
        try:
            rows, refused = _fla_rows(chunk_simple_gla, inputs, cu, dy, y_ref, grads_ref, device=device, rep=rep)
        except Exception as exc:  # a forward fla cannot run here: recorded, never a made-up number
            why = f"error: {type(exc).__name__}: {exc}"
            rows, refused = [], [{"contender": c, "status": "error", "error": why} for c in (FLA, FLA_GAMMA)]
        results += rows
        not_measured += refused
    bar.update()

    # the step loop, at a shorter length; the Triton op beside it at that length
    r_inputs, r_cu = make_inputs(ref_shape, dtype, device, seed=2)
    r_dy = torch.randn(r_inputs[0].shape, generator=torch.Generator().manual_seed(3)).to(device, dtype)
    r_ctx = _validate(r_inputs, r_cu)
    r_y_ref, r_grads_ref = _oracle(r_inputs, r_cu, r_dy, ref_shape.chunk)
    for contender, fn in (("reference step loop", lambda *a: ssd_scan_reference(*a)),
                          ("triton (at the step loop's shape)", lab_triton(ref_shape.chunk, r_ctx))):  # fmt: skip
        fwd, fwd_bwd = _scan_fns(fn, r_inputs, r_cu, r_dy)
        row = {"contender": contender, "shape": asdict(ref_shape), "max_abs_err": _err(fwd(), r_y_ref)}
        row |= _grad_errors(fwd_bwd(), r_grads_ref)
        row |= measure_fwd_bwd(fwd, fwd_bwd, device=device, rep=min(rep, 5))
        results.append(row)
    results[-2]["speedup_of_triton"] = results[-2]["ms"] / results[-1]["ms"]
    bar.update()
    bar.close()

    # the bar
    meets: dict[str, bool] = {}
    unmeasured: dict[str, str] = {}
    keys = list(BAR)
    fla_row = next((r for r in results if r["contender"] == FLA), None)
    if fla_row is not None:
        lab["fwd_vs_fla_fwd"] = lab["fwd_ms"] / fla_row["fwd_ms"]
        meets[keys[0]] = bool(lab["fwd_vs_fla_fwd"] <= BAR[keys[0]])
    else:
        unmeasured[keys[0]] = f"fla: {why}"
    lab["speedup"] = chunked["ms"] / lab["ms"]  # vs the chunked row of this run (compiled on a GPU)
    if compile:
        meets[keys[1]] = bool(lab["speedup"] >= BAR[keys[1]])
    else:
        unmeasured[keys[1]] = "the chunked path ran eager (--small): the bar is against torch.compile on a GPU"
    if compile and "peak_mib" in lab and "peak_mib" in chunked:
        lab["peak_vs_compiled"] = lab["peak_mib"] / chunked["peak_mib"]
        meets[keys[2]] = bool(lab["peak_vs_compiled"] <= BAR[keys[2]])
    else:
        unmeasured[keys[2]] = "peak memory is measured on a CUDA GPU with the compiled chunked path only"
    return make_receipt(
        "ssd_fwd_bwd", "ssd", shape=asdict(shape), dtype=dtype, results=results, device=device,
        input_dtypes={"x": str(dtype).removeprefix("torch."), "Bm": str(dtype).removeprefix("torch."),
                      "Cm": str(dtype).removeprefix("torch."), "dt": "float32", "A": "float32"},
        cu_seqlens={"documents": cu.numel() - 1, "lengths": (cu[1:] - cu[:-1]).tolist()},
        bar=BAR, meets_bar=meets, bar_not_measured=unmeasured, not_measured=not_measured,
        elapsed_s=time.perf_counter() - t_start,
        notes=(
            "SSD scan y = scan(x, dt, A, Bm, Cm) over packed rows (cu_seqlens over the flattened B*T tokens, "
            f"{shape.docs} documents of seeded-random unequal lengths per row, every row start a document start), "
            f"chunk {shape.chunk}. fwd_ms: forward under no_grad; ms: forward + backward (gradients of x, dt, A, Bm, "
            "Cm for a fixed random dy); bwd_ms = ms - fwd_ms; medians of do_bench after warm-up (CUDA), perf_counter "
            "on a CPU; peak_mib: peak extra CUDA memory of one forward+backward. max_abs_err: y against "
            "ssd_chunked_torch in fp32 on the same values (the oracle); grad_max_abs_err / grad_rel_err (error norm "
            "/ oracle norm): each gradient against the oracle's. compile_s: the first forward+backward and forward "
            "calls of the compiled chunked path (compile included), which are then warmed up before timing. fla: "
            "q=Cm, k=Bm, v=x*dt, g=dt*A, scale=1, the batch flattened to one row with the same int32 cu_seqlens "
            "(and its CPU copy, so fla does not sync); timed on the mapped tensors as leaves (the mapping is not in "
            "its time), its errors taken through the mapping; a backward it refuses is listed in not_measured with "
            "its message. The g_gamma row solves a different, easier problem (one constant decay per head): timing "
            "only. The step-loop rows run at their own shape (row 'shape'), beside the Triton op at that shape; "
            "speedup_of_triton = step-loop ms / Triton ms there. Triton row: speedup = chunked ms / Triton ms, "
            "fwd_vs_fla_fwd = Triton fwd_ms / fla fwd_ms, peak_vs_compiled = Triton peak_mib / compiled peak_mib. "
            "The Triton op is timed as the model calls it, with the batch's PackedContext, built and validated "
            "once per batch beforehand (ctx=: no check and no host sync in the call). first_call_s: the first forward and "
            "forward+backward calls (Triton JIT, fla's autotuning), not in any timing."
        ),
    )  # fmt: skip


def sweep_shapes(shape: SSDShape, seq_lens: tuple[int, ...], docs: tuple[int, ...]) -> list[tuple[str, SSDShape]]:
    """(series, shape): T at B*T tokens fixed, then documents per row and G=1 at the main shape."""
    tokens = shape.B * shape.T
    out = [("T", replace(shape, B=max(1, tokens // T), T=T)) for T in seq_lens]
    out += [("docs", replace(shape, docs=d)) for d in docs if d != shape.docs]
    if shape.G != 1:
        out.append(("G", replace(shape, G=1)))
    return out


def bench_ssd_sweep(shape: SSDShape = FULL_SHAPE, seq_lens: tuple[int, ...] = FULL_SEQ_LENS,
                    docs: tuple[int, ...] = FULL_DOCS, *, dtype: torch.dtype = torch.bfloat16, device: str = "cuda",
                    compile: bool = True, rep: int = 10, progress: bool = True) -> dict[str, Any]:  # fmt: skip
    """The Triton op vs the chunked path (compiled on a GPU) over other shapes: fwd, fwd+bwd, y error."""
    from tqdm.auto import tqdm

    t_start = time.perf_counter()
    chunked_name, chunked = (COMPILED, compiled_chunked) if compile else (EAGER_CHUNKED, eager_chunked)
    results: list[dict[str, Any]] = []
    for series, s in tqdm(sweep_shapes(shape, seq_lens, docs), desc="ssd sweep", disable=not progress):
        inputs, cu = make_inputs(s, dtype, device)
        dy = torch.randn(inputs[0].shape, generator=torch.Generator().manual_seed(1)).to(device, dtype)
        ctx = _validate(inputs, cu)
        y_ref, _ = _oracle(inputs, cu, None, s.chunk)
        scans = (("triton", lab_triton(s.chunk, ctx)), (chunked_name, chunked(s.chunk)))
        rows = []
        for name, scan in scans:
            fwd, fwd_bwd = _scan_fns(scan, inputs, cu, dy)
            row: dict[str, Any] = {"contender": name, "series": series, "shape": asdict(s)}
            if name == COMPILED:  # 0 where this run compiled the shape already (the main shape)
                row["compile_s"] = _first_call_s(fwd_bwd, device) + _first_call_s(fwd, device)
            row["max_abs_err"] = _err(fwd(), y_ref)  # the first call of the Triton op (JIT) when rep > 1
            if rep > 1:
                fwd_bwd()
            row |= measure_fwd_bwd(fwd, fwd_bwd, device=device, rep=rep)
            rows.append(row)
        rows[0]["speedup"] = rows[1]["ms"] / rows[0]["ms"]
        rows[0]["fwd_speedup"] = rows[1]["fwd_ms"] / rows[0]["fwd_ms"]
        results += rows
    return make_receipt(
        "ssd_seq_sweep", "ssd", dtype=dtype,
        shape=asdict(shape) | {"T": list(seq_lens), "docs": list(docs), "G": sorted({1, shape.G})},
        results=results, device=device, main_shape=asdict(shape),
        elapsed_s=time.perf_counter() - t_start,
        notes=(
            f"series T: B*T = {shape.B * shape.T} tokens fixed, B = tokens / T; series docs: documents per row at the "
            f"main shape; series G: one B/C group for all heads at the main shape (the main shape itself is the "
            f"T={shape.T} point of series T). Every row carries its shape. fwd_ms (no_grad), ms (fwd+bwd, the five "
            "gradients), medians after warm-up; max_abs_err: y against fp32 ssd_chunked_torch on the same values; "
            "Triton rows: speedup = chunked ms / Triton ms, fwd_speedup the same for the forward. The compiled "
            "path is static in B, T and G (each new one compiles again: compile_s) and dynamic in the document count."
        ),
    )  # fmt: skip


def _plot_main(receipt: dict[str, Any]) -> Any:
    """fwd and fwd+bwd time per contender (log scale); a time not measured says why in its place."""
    import textwrap

    import matplotlib.pyplot as plt

    rows = receipt["results"]
    status = {(m["contender"], m.get("metric", "")): m["status"] for m in receipt.get("not_measured", [])}
    fig, axes = plt.subplots(1, 2, figsize=(13, 0.6 * len(rows) + 2.2), sharey=True)
    at = lambda r: f"\n[B={r['shape']['B']}, T={r['shape']['T']}]" if "shape" in r else ""  # noqa: E731
    labels = [textwrap.fill(r["contender"], 36) + at(r) for r in rows]
    for ax, key, title in ((axes[0], "fwd_ms", "forward (no_grad)"), (axes[1], "ms", "forward + backward")):
        measured = [i for i, r in enumerate(rows) if key in r]
        colors = ["tab:red" if rows[i]["contender"].startswith("triton") else "tab:blue" for i in measured]
        bars = ax.barh(measured, [rows[i][key] for i in measured], color=colors)
        ax.bar_label(bars, labels=[f"{rows[i][key]:.3g}" for i in measured], padding=3, fontsize=8)
        ax.set_xscale("log")
        if measured:
            ax.set_xlim(right=4 * max(rows[i][key] for i in measured))  # room for the value labels
        for i, r in enumerate(rows):
            if key not in r:
                why = status.get((r["contender"], "ms (fwd+bwd)" if key == "ms" else "fwd_ms"), "not measured")
                ax.text(0.01, i, why, transform=ax.get_yaxis_transform(), va="center", fontsize=8, color="0.3")
        ax.set(xlabel=f"{key} (log)", title=title)
    axes[0].set_yticks(range(len(rows)), labels, fontsize=7)
    axes[0].set_ylim(len(rows) - 0.5, -0.5)
    shape = ", ".join(f"{k}={v}" for k, v in receipt["shape"].items())
    fig.suptitle(f"SSD scan, {receipt['dtype']}, {shape}\n{receipt['device']}", fontsize=9)
    missing = [m for m in receipt.get("not_measured", []) if m["contender"] not in {r["contender"] for r in rows}]
    note = "; ".join(f"{m['contender']}: {m['status']}" for m in missing)
    if note:  # a figure-level x label: tight_layout (save_figure runs it again) leaves room for it
        fig.supxlabel(textwrap.fill("not measured: " + note, 200), fontsize=6, x=0.01, ha="left")
    fig.tight_layout()
    return axes[0]


def _plot_sweep(receipt: dict[str, Any]) -> Any:
    """ms against T (B*T fixed), documents per row and G (each through the main shape), fwd and fwd+bwd."""
    import matplotlib.pyplot as plt

    main = receipt["main_shape"]
    is_main = lambda s: all(s[k] == main[k] for k in ("B", "T", "docs", "G"))  # noqa: E731
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for ax, (series, xlabel) in zip(axes, (("T", f"T (B*T = {main['B'] * main['T']} tokens)"),
                                           ("docs", "documents per row"), ("G", "B/C groups G"))):  # fmt: skip
        rows = [r for r in receipt["results"] if r["series"] == series or is_main(r["shape"])]
        for i, contender in enumerate(dict.fromkeys(r["contender"] for r in receipt["results"])):
            for metric, style in (("ms", "-"), ("fwd_ms", "--")):
                pts = sorted({r["shape"][series]: r[metric] for r in rows
                              if r["contender"] == contender and metric in r}.items())  # fmt: skip
                if pts:
                    ax.plot([p[0] for p in pts], [p[1] for p in pts], style, marker="o", color=f"C{i}",
                            label=f"{contender}, {'fwd+bwd' if metric == 'ms' else 'fwd (no_grad)'}")  # fmt: skip
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set(xlabel=xlabel, ylabel="ms")
        ax.grid(True, which="both", alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.suptitle(f"{receipt['name']} ({receipt['dtype']}), {receipt['device']}", fontsize=9)
    fig.tight_layout()
    return axes[0]


PARTS_ENV = "MEGACPP_BENCH_SSD_PARTS"  # "ssd", "mamba3" or both (the default): a run that must fit a time limit
PARTS = ("ssd", "mamba3")


def run_parts() -> tuple[str, ...]:
    """The parts a run measures: $MEGACPP_BENCH_SSD_PARTS (comma-separated, from PARTS), else all. Fails closed on
    a name it does not know."""
    text = os.environ.get(PARTS_ENV, ",".join(PARTS))
    parts = tuple(p.strip() for p in text.split(",") if p.strip())
    if not parts or any(p not in PARTS for p in parts):
        raise ValueError(f"{PARTS_ENV}={text!r}: a comma-separated list of {PARTS}")
    return parts


def run(out_root: str | Path | None = None, *, small: bool = False, trace: bool = True) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    from megacpp_lab.plots import save_figure

    device = bench_device("ssd", small)
    if device == "cpu":
        require_triton_interpreter("ssd")
    shape, ref_shape = (SMALL_SHAPE, SMALL_REF_SHAPE) if small else (FULL_SHAPE, FULL_REF_SHAPE)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    compile = device == "cuda" and not small
    root = output_root(out_root, small)
    written: list[Path] = []
    parts = run_parts()
    if "ssd" in parts:
        written += _run_ssd(root, device, shape, ref_shape, dtype, compile, small=small, trace=trace)
    if "mamba3" in parts:
        from megacpp_lab.bench.mamba3 import mamba3_receipt, plot_mamba3

        mamba3 = mamba3_receipt(device, small=small)
        written.append(write_receipt(mamba3, root))
        written.append(save_figure(plot_mamba3(mamba3), written[-1].with_suffix(".png")))
    return written


def _run_ssd(root: Path, device: str, shape: SSDShape, ref_shape: SSDShape, dtype: torch.dtype, compile: bool, *,
             small: bool, trace: bool) -> list[Path]:  # fmt: skip
    from megacpp_lab.plots import save_figure

    written: list[Path] = []
    # the compiled chunked path compiles once per (B, T, G) and grad mode: more than dynamo's default limit of 8
    limit = "recompile_limit" if hasattr(torch._dynamo.config, "recompile_limit") else "cache_size_limit"
    with torch._dynamo.config.patch(**{limit: 64}):
        main = bench_ssd(shape, ref_shape, dtype=dtype, device=device, compile=compile, fla=True,
                         rep=SMALL_REP if small else 20)  # fmt: skip
        written.append(write_receipt(main, root))
        written.append(save_figure(_plot_main(main), written[-1].with_suffix(".png")))
        sweep = bench_ssd_sweep(shape, SMALL_SEQ_LENS if small else FULL_SEQ_LENS,
                                SMALL_DOCS if small else FULL_DOCS, dtype=dtype, device=device, compile=compile,
                                rep=SMALL_REP if small else 10)  # fmt: skip
    written.append(write_receipt(sweep, root))
    written.append(save_figure(_plot_sweep(sweep), written[-1].with_suffix(".png")))
    if trace:
        inputs, cu = make_inputs(shape, dtype, device)
        dy = torch.randn(inputs[0].shape, generator=torch.Generator().manual_seed(1)).to(device, dtype)
        _, fwd_bwd = _scan_fns(lab_triton(shape.chunk, _validate(inputs, cu)), inputs, cu, dy)
        path, _ = profile_trace(fwd_bwd, root / device_slug(main["device"]) / "ssd", "ssd_triton",
                                steps=1 if small else 2, warmup=1 if small else 2)  # fmt: skip
        written.append(path)
    return written
