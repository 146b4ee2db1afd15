"""Mamba-3 scan benchmark: the lab's SISO and MIMO scans against mamba_ssm's Triton SISO kernels and the lab's
Mamba-2 SSD, one run, one receipt (written beside the SSD receipts by `megacpp-lab bench ssd`).

What it measures and writes: `megacpp-lab bench ssd --help` (megacpp_lab.bench.COMMANDS["ssd"]).
"""

from __future__ import annotations

import importlib
import math
import os
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from megacpp_lab.bench import peer_checkout
from megacpp_lab.bench.harness import measure_fwd_bwd, timed_call
from megacpp_lab.kernels import mamba3 as m3_kernels
from megacpp_lab.kernels.mamba3 import mamba3_scan
from megacpp_lab.kernels.ssd import ssd_scan
from megacpp_lab.profiling import kernel_ms, time_ms
from megacpp_lab.receipts import make_receipt
from megacpp_lab.varlen import PackedContext, build_context, doc_ids_from_cu_seqlens, packed_cu_seqlens

__all__ = ["FULL_SHAPES", "VARIANTS", "Mamba3Shape", "bench_mamba3", "find_peer", "lab_variant", "make_inputs",
           "mamba3_receipt", "plot_mamba3"]

PEER_ENV = "MEGACPP_MAMBA3_PEER"  # a checkout of mamba_ssm holding ops/triton/mamba3 (../shared/peers/mamba3)
LAB = "lab mamba3 SISO (torch.compile, Triton op)"
LAB_EAGER = "lab mamba3 SISO (eager, Triton op)"
PEER = "mamba_ssm mamba3_siso_combined"
MAMBA2 = "lab mamba2 SSD (Triton op)"


# kernels/mamba3's switches of the backward's chunk pass: the main shape measures each set against its default
VARIANTS = ("STATE_DOTS_IN_INPUT_DTYPE",)


def lab_variant(flag: str, value: bool) -> str:
    """The compiled lab row's name with kernels/mamba3's switch `flag` set to `value` (VARIANTS)."""
    return f"lab mamba3 SISO (torch.compile, Triton op, {flag}={value})"
FIRST_CALL_BAR_S = 30.0
MIMO_BAR = 1.6
M_BLOCK_SCAN_BAR_MS = 2.0  # the M block's scan (Mamba-3 SISO, as the base preset defines it) fwd+bwd at main


@dataclass(frozen=True)
class Mamba3Shape:
    B: int
    T: int
    H: int
    N: int  # state
    P: int  # head
    G: int  # groups of B/C
    docs: int  # documents per row
    chunk: int  # SSD tokens per chunk (MIMO: chunk / R steps)
    rope_pairs: int


MAIN = Mamba3Shape(B=8, T=4096, H=16, N=128, P=64, G=16, docs=8, chunk=64, rope_pairs=32)
# the shape, then one with H >= 32 (one B/C group, the peer's tuned layout) and one with T >= 16384
FULL_SHAPES = {"main": MAIN, "H=32": replace(MAIN, B=4, H=32, G=1), "T=16384": replace(MAIN, B=2, T=16384)}
SMALL_SHAPES = {"main": Mamba3Shape(B=2, T=32, H=2, N=16, P=16, G=2, docs=2, chunk=16, rope_pairs=4)}
MIMO_RANKS = (2, 4)
GRADS = ("x", "Bm", "Cm", "trap", "angles", "b_bias", "c_bias", "D")  # the inputs both the lab and the peer take


def make_inputs(s: Mamba3Shape, dtype: torch.dtype, device: str, *, rank: int = 1, seed: int = 0
                ) -> tuple[dict[str, torch.Tensor], torch.Tensor]:  # fmt: skip
    """The scan's inputs as the layer gives them (leaves with requires_grad) and cu_seqlens: x, B, C in `dtype`
    (B and C RMS-normed), dt = softplus(randn - 1), A = -exp(U(0, log 16)), trap and angles logits (angles
    [B,T,1,pairs]: one row a token for every head), the biases and D in fp32. rank > 1: MIMO's B, C and biases per
    rank and mimo_x. Drawn on the CPU (same values on every device)."""
    g = torch.Generator().manual_seed(seed)
    rnd = lambda *shape: torch.randn(*shape, generator=g)  # noqa: E731
    ranked = (rank,) if rank > 1 else ()
    out = dict(
        x=rnd(s.B, s.T, s.H, s.P).to(dtype),
        dt=F.softplus(rnd(s.B, s.T, s.H) - 1.0),
        A=-torch.exp(torch.empty(s.H).uniform_(0.0, math.log(16.0), generator=g)),
        Bm=F.rms_norm(rnd(s.B, s.T, *ranked, s.G, s.N), (s.N,)).to(dtype),
        Cm=F.rms_norm(rnd(s.B, s.T, *ranked, s.G, s.N), (s.N,)).to(dtype),
        trap=rnd(s.B, s.T, s.H),
        angles=rnd(s.B, s.T, 1, s.rope_pairs),  # one rate row a token, shared by the heads, as the layer gives it
        b_bias=1 + 0.1 * rnd(s.H, *ranked, s.N),
        c_bias=1 + 0.1 * rnd(s.H, *ranked, s.N),
        D=torch.ones(s.H) + 0.1 * rnd(s.H),
    )
    if rank > 1:
        out["mimo_x"] = (1 + 0.1 * rnd(s.H, rank, s.P)) / rank
    cu = packed_cu_seqlens(s.B, s.T, s.docs, g)
    return {k: v.to(device).requires_grad_() for k, v in out.items()}, cu.to(device)


def find_peer() -> tuple[Callable[..., Any] | None, str | None]:
    """(mamba3_siso_combined, None), or (None, why not): the checkout named by $MEGACPP_MAMBA3_PEER, else
    ../shared/peers/mamba3 beside the repository, else .peers/mamba3 inside it (a copy carried to a GPU box)."""
    where = peer_checkout(PEER_ENV, "mamba3", "mamba_ssm")
    if where is None:
        return None, f"not found (set {PEER_ENV} to a mamba_ssm checkout with ops/triton/mamba3)"
    if str(where) not in sys.path:
        sys.path.insert(0, str(where))
    try:
        module = importlib.import_module("mamba_ssm.ops.triton.mamba3.mamba3_siso_combined")
    except Exception as exc:  # noqa: BLE001  (a peer that cannot import is recorded, never faked)
        return None, f"import failed: {type(exc).__name__}: {exc}"
    return module.mamba3_siso_combined, None


def _lab(chunk: int, ctx: PackedContext, *, backend: str | None) -> Callable[..., torch.Tensor]:
    """The lab's scan as the model calls it, compiled whole with `backend` (fullgraph), or eager (None)."""
    def scan(**a: torch.Tensor) -> torch.Tensor:
        return mamba3_scan(**a, ctx=ctx, chunk=chunk, kernel="triton")

    return torch.compile(scan, fullgraph=True, backend=backend) if backend else scan


def _peer_call(peer: Callable[..., Any], cu: torch.Tensor, chunk: int) -> Callable[..., torch.Tensor]:
    """The peer on the lab's inputs: the batch flattened to one row (its varlen mode needs batch 1), its
    [B,H,T] layouts for A*dt, dt and the trapezoid, the angles expanded over the heads (as its module expands them);
    y back as [B,T,H,P]."""

    def scan(x, dt, A, Bm, Cm, trap, angles, b_bias, c_bias, D) -> torch.Tensor:  # noqa: ANN001
        B, T, H, P = x.shape
        flat = lambda t: t.reshape(1, B * T, *t.shape[2:])  # noqa: E731
        heads_first = lambda t: flat(t).transpose(1, 2)  # noqa: E731  [1,H,B*T]
        y = peer(flat(Cm), flat(Bm), flat(x), heads_first(dt * A), heads_first(dt), heads_first(trap), c_bias, b_bias,
                 flat(angles.expand(B, T, H, angles.shape[-1])), D=D, chunk_size=chunk, cu_seqlens=cu)  # fmt: skip
        return y.view(B, T, H, P)

    return scan


def _fns(scan: Callable[..., torch.Tensor], a: dict[str, torch.Tensor], dy: torch.Tensor, grads: tuple[str, ...]):
    def fwd() -> torch.Tensor:
        with torch.no_grad():
            return scan(**a)

    def fwd_bwd() -> tuple[torch.Tensor, ...]:
        return torch.autograd.grad(scan(**a), [a[n] for n in grads], dy)

    return fwd, fwd_bwd


def _errors(y: torch.Tensor, grads: tuple[torch.Tensor, ...], ref: tuple[torch.Tensor, dict[str, torch.Tensor]],
            names: tuple[str, ...]) -> dict[str, Any]:  # fmt: skip
    y_ref, g_ref = ref
    rel = lambda a, b: float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))  # noqa: E731
    return {"max_abs_err": float((y.float() - y_ref).abs().max()), "rel_err": rel(y, y_ref),
            "grad_rel_err": {n: rel(g, g_ref[n]) for n, g in zip(names, grads)}}  # fmt: skip


def _oracle(a: dict[str, torch.Tensor], cu: torch.Tensor, dy: torch.Tensor, chunk: int, names: tuple[str, ...]):
    """y and the gradients of the chunked torch scan in fp32 on the same values (the step loop is its oracle in
    tests/test_mamba3.py)."""
    leaves = {k: v.detach().float().requires_grad_() for k, v in a.items()}
    y = mamba3_scan(**leaves, cu_seqlens=cu, chunk=chunk, kernel="chunked")
    grads = torch.autograd.grad(y, [leaves[n] for n in names], dy.float())
    return y.detach(), dict(zip(names, grads))


def _with_flag(fn: Callable[[], Any], flag: str, value: bool) -> Callable[[], Any]:
    """fn with kernels/mamba3's switch `flag` set to `value` for the call (the backward reads it as it runs)."""
    def call() -> Any:
        default = getattr(m3_kernels, flag)
        setattr(m3_kernels, flag, value)
        try:
            return fn()
        finally:
            setattr(m3_kernels, flag, default)

    return call


# A row's timings, and its calls kept for the second round (_second_round)
Timed = tuple[dict[str, Any], Callable[[], Any], Callable[[], Any]]


def _row(contender: str, scan: Callable[..., torch.Tensor], a: dict[str, torch.Tensor], dy: torch.Tensor,
         ref: Any, names: tuple[str, ...], *, device: str, rep: int, flag: tuple[str, bool] | None = None) -> Timed:  # fmt: skip
    fwd, fwd_bwd = _fns(scan, a, dy, names)
    if flag is not None:
        fwd, fwd_bwd = _with_flag(fwd, *flag), _with_flag(fwd_bwd, *flag)
    (grads, t_first_bwd), (y, t_first_fwd) = timed_call(fwd_bwd, device), timed_call(fwd, device)
    row: dict[str, Any] = {"contender": contender, "first_call_s": t_first_bwd + t_first_fwd}
    if ref is not None:
        row |= _errors(y, grads, ref, names)
    row |= measure_fwd_bwd(fwd, fwd_bwd, device=device, rep=rep)
    if device == "cuda":  # the GPU's own time beside the wall clock's: what waits on the host shows as the gap
        row |= {"fwd_kernel_ms": kernel_ms(fwd), "kernel_ms": kernel_ms(fwd_bwd)}
    return row, fwd, fwd_bwd


def _second_round(timed: list[Timed], *, device: str, rep: int) -> list[dict[str, Any]]:
    """Every row timed once more, in reverse order, once all of them ran once: each keeps both rounds' medians
    (fwd_ms_rounds, ms_rounds) and takes the lower of each, the same rule for every contender. (A receipt at
    d62f82f timed the first row's forward at 1.53 ms and the same compiled forward two rows later at 0.89 ms, its
    kernels at 0.88 both times: one round let a transient on the host decide a bar.) A --small run (rep=1) keeps
    its one round."""
    rows = [row for row, _, _ in timed]
    if rep == 1:
        return rows
    for row, fwd, fwd_bwd in reversed(timed):
        again = {"fwd_ms": time_ms(fwd, warmup=2, rep=rep, device=device),
                 "ms": time_ms(fwd_bwd, warmup=2, rep=rep, device=device)}  # fmt: skip
        for key in ("fwd_ms", "ms"):
            row[f"{key}_rounds"] = [row[key], again[key]]
            row[key] = min(row[f"{key}_rounds"])
        row["bwd_ms"] = row["ms"] - row["fwd_ms"]
    return rows


def _shape_rows(label: str, s: Mamba3Shape, peer: Callable[..., Any] | None, *, dtype: torch.dtype, device: str,
                rep: int, oracle: bool, eager: bool, backend: str) -> list[dict[str, Any]]:  # fmt: skip
    a, cu = make_inputs(s, dtype, device)
    ctx = build_context(doc_ids_from_cu_seqlens(cu, s.B, s.T), cu_seqlens=cu)
    dy = torch.randn(a["x"].shape, generator=torch.Generator().manual_seed(1)).to(device, dtype)
    ref = _oracle(a, cu, dy, s.chunk, GRADS) if oracle else None
    tag = {"shape": label, **asdict(s)}

    def row(contender: str, scan: Callable[..., torch.Tensor], ref_: Any, names: tuple[str, ...], **extra: Any) -> Timed:
        flag = extra.pop("flag", None)
        r, fwd, fwd_bwd = _row(contender, scan, a, dy, ref_, names, device=device, rep=rep, flag=flag)
        return {**tag, **extra, **r}, fwd, fwd_bwd

    timed = [row(LAB, _lab(s.chunk, ctx, backend=backend), ref, GRADS, backend=backend)]
    if eager:
        timed.append(row(LAB_EAGER, _lab(s.chunk, ctx, backend=None), ref, GRADS))
        # the backward's switches (VARIANTS), each set the other way from its default, alone: compiled anew
        for flag in VARIANTS:
            value = not getattr(m3_kernels, flag)
            timed.append(row(lab_variant(flag, value), _lab(s.chunk, ctx, backend=backend), ref, GRADS,
                             backend=backend, flag=(flag, value)))  # fmt: skip
    if peer is not None:
        timed.append(row(PEER, _peer_call(peer, cu, s.chunk), ref, GRADS))
    # Mamba-2's SSD on the same x, dt, A, B, C: the M block's baseline (its own gradients, no oracle here)
    ssd = lambda x, dt, A, Bm, Cm, **_: ssd_scan(x, dt, A, Bm, Cm, ctx=ctx, chunk=s.chunk, kernel="triton")  # noqa: E731
    timed.append(row(MAMBA2, ssd, None, ("x", "dt", "A", "Bm", "Cm")))
    return _second_round(timed, device=device, rep=rep)


def _mimo_rows(s: Mamba3Shape, *, dtype: torch.dtype, device: str, rep: int, oracle: bool,
               backend: str) -> list[dict[str, Any]]:  # fmt: skip
    rows = []
    for rank in MIMO_RANKS:
        a, cu = make_inputs(s, dtype, device, rank=rank)
        ctx = build_context(doc_ids_from_cu_seqlens(cu, s.B, s.T), cu_seqlens=cu)
        dy = torch.randn(s.B, s.T, rank, s.H, s.P, generator=torch.Generator().manual_seed(1)).to(device, dtype)
        names = (*GRADS, "mimo_x")
        ref = _oracle(a, cu, dy, s.chunk, names) if oracle else None
        row, fwd, fwd_bwd = _row(f"lab mamba3 MIMO R={rank} (torch.compile, Triton op)",
                                 _lab(s.chunk, ctx, backend=backend), a, dy, ref, names, device=device, rep=rep)  # fmt: skip
        rows.append(({"shape": "main", **asdict(s), "rank": rank, "backend": backend, **row}, fwd, fwd_bwd))
    return _second_round(rows, device=device, rep=rep)


# at a later shape the peer autotunes again, for about this share of its first shape's autotuning (the H100 receipt at
# a869f53: 43 s at H=32 against 191 s at the main shape)
PEER_REAUTOTUNE_SHARE = 0.25


def next_shape_estimate_s(main_shape_s: float, rows: list[dict[str, Any]]) -> float:
    """Seconds a later shape is expected to take, from the main shape's seconds and rows: all of them but the
    one-time part of the peer's first call (the lab's first calls compile again at every shape, and the peer
    autotunes again for PEER_REAUTOTUNE_SHARE of its first). bench_mamba3's deadline begins no shape that this
    estimate puts past it (an estimate without any first call let a run of 300 s begin a shape at 284 s)."""
    peer_first = sum(r.get("first_call_s", 0.0) for r in rows if r["shape"] == "main" and r["contender"] == PEER)
    return max(0.0, main_shape_s - (1.0 - PEER_REAUTOTUNE_SHARE) * peer_first)


def bench_mamba3(shapes: dict[str, Mamba3Shape] = FULL_SHAPES, *, dtype: torch.dtype = torch.bfloat16,
                 device: str = "cuda", rep: int = 20, peer: bool = True, progress: bool = True,
                 partial: Path | None = None, backend: str = "inductor",
                 deadline_s: float | None = None) -> dict[str, Any]:  # fmt: skip
    """Every contender at the main shape, MIMO there, then the other shapes; the bars at the end. partial: a JSON
    file the rows so far are written to after each stage. deadline_s: seconds from the start after which no
    further shape begins when the slowest shape so far would not end by then (the receipt lists it as not
    measured, with that reason). backend: what torch.compile hands the lab's traced scan to (a --small run:
    "eager", dynamo's trace without inductor's codegen, which takes minutes on a CPU)."""
    import json

    from tqdm.auto import tqdm

    if "main" not in shapes or any(label not in FULL_SHAPES for label in shapes):
        raise ValueError(f"bench_mamba3 shapes: labels from {tuple(FULL_SHAPES)}, 'main' among them (MIMO and the "
                         f"bars are taken there), got {tuple(shapes)}")  # fmt: skip
    t_start = time.perf_counter()
    if not peer:
        scan_peer, why = None, "skipped: this run was asked for without the peer (peer=False)"
    elif device != "cuda":
        scan_peer, why = None, "skipped: the peer's kernels need a GPU"
    else:
        scan_peer, why = find_peer()
    results: list[dict[str, Any]] = []

    def stage_done() -> None:
        if partial is not None:
            partial.write_text(json.dumps(results, indent=1))

    # every shape and grad mode compiles the scan once more: past dynamo's default limit of 8
    limit = "recompile_limit" if hasattr(torch._dynamo.config, "recompile_limit") else "cache_size_limit"
    skipped: dict[str, str] = {}
    slowest = 0.0  # the slowest shape so far; for the main one, next_shape_estimate_s
    with torch._dynamo.config.patch(**{limit: 64}):
        for i, (label, s) in enumerate(tqdm(shapes.items(), desc="mamba3 shapes", disable=not progress)):
            elapsed = time.perf_counter() - t_start
            if i > 0 and deadline_s is not None and elapsed + slowest > deadline_s:
                skipped[label] = (f"not begun: {elapsed:.0f} s had passed and a shape was expected to take "
                                  f"{slowest:.0f} s, past the run's deadline of {deadline_s:.0f} s")  # fmt: skip
                continue
            if progress:
                print(f"mamba3 bench: shape {label} {asdict(s)} (first calls compile; the peer autotunes once)",
                      file=sys.stderr, flush=True)
            t_shape = time.perf_counter()
            results += _shape_rows(label, s, scan_peer, dtype=dtype, device=device, rep=rep, oracle=label == "main",
                                   eager=label == "main", backend=backend)  # fmt: skip
            if label == "main":
                slowest = next_shape_estimate_s(time.perf_counter() - t_shape, results)
                results += _mimo_rows(s, dtype=dtype, device=device, rep=rep, oracle=True, backend=backend)
            else:
                slowest = max(slowest, time.perf_counter() - t_shape)
            stage_done()
    summary = _summary(results, {k: v for k, v in shapes.items() if k not in skipped}, why, skipped)
    return make_receipt(
        "mamba3_fwd_bwd", "ssd", shape=asdict(shapes["main"]), dtype=dtype, results=results, device=device,
        summary=summary, elapsed_s=time.perf_counter() - t_start,
        notes=(
            "Mamba-3 scan (kernels/mamba3.py) over packed rows: documents of seeded-random unequal lengths per row "
            "(cu_seqlens over the flattened B*T tokens). Inputs as the layer gives them: x, B, C in the dtype (B and C "
            "RMS-normed), dt, A, the trapezoid and angle logits, the biases and D in fp32. fwd_ms: forward under "
            "no_grad; ms: forward + backward (the gradients of x, B, C, trap, angles, both biases and D, the inputs "
            "both the lab and the peer take; MIMO adds mimo_x); medians of do_bench after warm-up (wall clock, host "
            "included: the bars take these), in two rounds (every row of a shape once, then again in reverse order: "
            "fwd_ms_rounds, ms_rounds), each row taking the lower of its two; fwd_kernel_ms / kernel_ms: the same calls' GPU kernel time alone "
            "(profiling.kernel_ms, mean of 5 calls; a contender whose ms is well above its kernel_ms waits on its "
            "host); peak_mib: peak "
            "extra CUDA memory of one forward+backward; backend: what torch.compile handed the lab's scan to (inductor "
            "on a GPU; a --small run, 'eager'); first_call_s: the first forward+backward and forward calls "
            "(torch.compile, Triton JIT, the peer's autotuning). The lab's rows call mamba3_scan(kernel='triton') "
            "with the batch's PackedContext (the op megacpp::mamba3_scan_fwd: the angle sums' block totals, then one "
            "Triton pass for their second pass and the keys' rotation, the SSD kernels in Mamba-3 mode; MIMO's x read "
            "a step at a time, scaled by mimo_x in the kernels; its backward takes the angle sums' suffix sums in "
            "the op), compiled whole (fullgraph: the elementwise work around the ops "
            "fused by inductor) as the model runs it, and at the main shape eager beside it, and compiled with each "
            "of the backward's switches (kernels/mamba3: STATE_DOTS_IN_INPUT_DTYPE, the chunk pass's dots against "
            "the state in bf16 or TF32) set the other way from its default, one at a time (the row's name says "
            "which; the bars take the default row). The peer: "
            "mamba3_siso_combined with the batch flattened to one row (its varlen mode needs batch 1), ADT = dt*A per "
            "token. max_abs_err / rel_err / grad_rel_err (error norm / oracle norm): against the chunked torch scan "
            "in fp32 on the same values, at the main shape. The Mamba-2 rows run the lab's SSD op on the same x, dt, "
            "A, B, C (its own gradients): the M block's baseline. MIMO rows: rank R inputs and outputs per head at the "
            "same P and N, chunk in SSD tokens (chunk / R steps)."
        ),
    )  # fmt: skip


def _summary(results: list[dict[str, Any]], shapes: dict[str, Mamba3Shape], why: str | None,
             skipped: dict[str, str]) -> dict[str, Any]:  # fmt: skip
    find = lambda contender, shape: next((r for r in results if r["contender"] == contender and r["shape"] == shape), None)  # noqa: E731
    bar: dict[str, bool] = {}
    not_measured: dict[str, str] = {}
    ratios: dict[str, dict[str, float]] = {}
    for label in FULL_SHAPES:
        if label not in shapes:
            not_measured[f"SISO at {label}"] = skipped.get(label, "this run measured fewer shapes than FULL_SHAPES")
            continue
        lab, peer, m2 = find(LAB, label), find(PEER, label), find(MAMBA2, label)
        ratios[label] = {"lab_over_mamba2_ms": lab["ms"] / m2["ms"]}
        keys = (f"SISO fwd+bwd at {label} <= 1.0 x mamba_ssm", f"SISO forward at {label} <= 1.1 x mamba_ssm")
        if peer is None:
            not_measured |= {k: f"mamba_ssm: {why}" for k in keys}
            continue
        ratios[label] |= {"lab_over_peer_ms": lab["ms"] / peer["ms"], "lab_over_peer_fwd_ms": lab["fwd_ms"] / peer["fwd_ms"]}
        if "kernel_ms" in lab and "kernel_ms" in peer:  # the GPU's time alone (no bar: the bars take the wall clock)
            ratios[label] |= {"lab_over_peer_kernel_ms": lab["kernel_ms"] / peer["kernel_ms"],
                              "lab_over_peer_fwd_kernel_ms": lab["fwd_kernel_ms"] / peer["fwd_kernel_ms"]}  # fmt: skip
        bar[keys[0]] = bool(ratios[label]["lab_over_peer_ms"] <= 1.0)
        bar[keys[1]] = bool(ratios[label]["lab_over_peer_fwd_ms"] <= 1.1)
    siso = find(LAB, "main")
    shape = shapes["main"]
    bar[f"the M block's scan (mamba3 SISO, compiled) fwd+bwd <= {M_BLOCK_SCAN_BAR_MS:g} ms at B={shape.B} T={shape.T} "
        f"H={shape.H} P={shape.P} N={shape.N}, {shape.docs} docs/row"] = bool(siso["ms"] <= M_BLOCK_SCAN_BAR_MS)
    mimo = {r["rank"]: r for r in results if "rank" in r}
    ratios["main"] |= {f"mimo_R{k}_over_siso_ms": r["ms"] / siso["ms"] for k, r in mimo.items()}
    bar[f"MIMO R=4 fwd+bwd <= {MIMO_BAR} x SISO (same P, N)"] = bool(mimo[4]["ms"] / siso["ms"] <= MIMO_BAR)
    first = max(r["first_call_s"] for r in results if r["contender"].startswith("lab mamba3"))
    bar[f"first call (compile and JIT) <= {FIRST_CALL_BAR_S:g} s"] = bool(first <= FIRST_CALL_BAR_S)
    return {"bar": bar, "bar_not_measured": not_measured, "ratios": ratios, "lab_first_call_s_max": first,
            "peer": "found" if why is None else why}  # fmt: skip


def mamba3_receipt(device: str, *, small: bool) -> dict[str, Any]:
    """The receipt at the full shapes (bf16), or a --small smoke run's (fp32, the interpreter on a CPU, no
    peer): bench/ssd.py's run writes it beside the SSD receipts. $MEGACPP_BENCH_DEADLINE_S, where set, is the
    run's deadline (a device call's time limit); $MEGACPP_BENCH_PARTIAL, a JSON file for the rows so far."""
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    deadline = float(os.environ["MEGACPP_BENCH_DEADLINE_S"]) if "MEGACPP_BENCH_DEADLINE_S" in os.environ else None
    partial = Path(os.environ["MEGACPP_BENCH_PARTIAL"]) if "MEGACPP_BENCH_PARTIAL" in os.environ else None
    return bench_mamba3(SMALL_SHAPES if small else FULL_SHAPES, dtype=dtype, device=device, rep=1 if small else 20,
                        peer=not small, backend="eager" if small else "inductor", deadline_s=deadline,
                        partial=partial)  # fmt: skip


def plot_mamba3(receipt: dict[str, Any]) -> Any:
    """Forward+backward ms per contender at each shape (left), and MIMO's ms against its rank at the main shape
    with SISO as rank 1 (right): the cost of MIMO's arithmetic intensity."""
    import matplotlib.pyplot as plt

    rows = receipt["results"]
    shapes = list(dict.fromkeys(r["shape"] for r in rows))
    named = (LAB, *(lab_variant(f, v) for f in VARIANTS for v in (False, True)), LAB_EAGER, PEER, MAMBA2)
    contenders = [c for c in named if any(r["contender"] == c for r in rows)]
    # and a row this code no longer names (an older receipt's switch since removed) after them, never dropped
    contenders += [c for c in dict.fromkeys(r["contender"] for r in rows if "rank" not in r) if c not in contenders]
    fig, (ax, ax_r) = plt.subplots(1, 2, figsize=(11, 3.8))
    width = 0.8 / len(contenders)
    for i, c in enumerate(contenders):
        ms = [next((r["ms"] for r in rows if r["contender"] == c and r["shape"] == s), float("nan")) for s in shapes]
        ax.bar([j + i * width for j in range(len(shapes))], ms, width, label=c)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(shapes))], shapes)
    ax.set(ylabel="fwd+bwd ms (median)", title="SISO scan")
    ax.legend(fontsize=6)
    siso = next(r for r in rows if r["contender"] == LAB and r["shape"] == "main")
    ranks = [(1, siso["ms"], siso["fwd_ms"])] + [(r["rank"], r["ms"], r["fwd_ms"]) for r in rows if "rank" in r]
    ax_r.plot([k for k, *_ in ranks], [m for _, m, _ in ranks], "o-", label="fwd+bwd")
    ax_r.plot([k for k, *_ in ranks], [f for *_, f in ranks], "s--", label="forward")
    ax_r.set(xlabel="MIMO rank R (1 = SISO)", ylabel="ms", title="MIMO at the main shape", xticks=[k for k, *_ in ranks])
    ax_r.legend(fontsize=7)
    fig.suptitle(f"{receipt['name']} ({receipt['dtype']}), {receipt['device']}", fontsize=9)
    fig.tight_layout()
    return ax
