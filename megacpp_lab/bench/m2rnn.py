"""M2RNN benchmark: Triton scan vs the reference step loop, and vs XMA over a shape grid, one run.

What it measures and writes, and how long it takes: `megacpp-lab bench m2rnn --help`
(megacpp_lab.bench.COMMANDS["m2rnn"]).
"""

from __future__ import annotations

import importlib
import sys
import time
from contextlib import contextmanager, nullcontext
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

from megacpp_lab.bench import bench_device, output_root, peer_checkout, require_triton_interpreter
from megacpp_lab.kernels.m2rnn import m2rnn_scan, plan_backward, plan_block_k
from megacpp_lab.profiling import peak_extra_mib, profile_trace, time_ms, time_spread_ms
from megacpp_lab.receipts import device_slug, make_receipt, write_receipt
from megacpp_lab.varlen import build_context, doc_ids_from_cu_seqlens, packed_cu_seqlens

BAR = {"ms": 7.0, "fwd_ms": 1.7, "max_abs_err": 0.06, "peak_mib": 150.0}
PEER_BAR = 1.0  # the lab's forward+backward over XMA's, at most, at every grid point
XMA_ENV = "MEGACPP_XMA_PEER"  # a checkout of accelerated-model-architectures (../shared/peers/xma)
XMA = "xma m2rnn"
XMA_SOURCE = "open-lm-engine/accelerated-model-architectures at 384ed0a7 (Apache-2.0)"


@dataclass(frozen=True)
class M2RNNShape:
    B: int
    S: int
    H: int
    K: int
    V: int


FULL_SHAPE = M2RNNShape(B=2, S=4096, H=8, K=64, V=16)
SMALL_SHAPE = M2RNNShape(B=1, S=32, H=2, K=16, V=16)


@dataclass(frozen=True)
class GridPoint:
    """One shape of the peer grid: docs documents of seeded-random lengths in each row."""

    shape: M2RNNShape
    docs: int = 1

    @property
    def label(self) -> str:
        s = self.shape
        return f"B={s.B} S={s.S} H={s.H} K={s.K} V={s.V}" + (f", {self.docs} docs" if self.docs > 1 else "")


# many heads over short rows (H >= 32, S <= 1024, V of 16, 32 and 64), few heads over long packed rows, the
# lab's main shape and the base model's R block (B=4 T=4096, 16 heads of 64 x 16, 8 documents a row)
PEER_GRID = (
    GridPoint(M2RNNShape(16, 1024, 32, 64, 16)),
    GridPoint(M2RNNShape(16, 1024, 32, 64, 32)),
    GridPoint(M2RNNShape(16, 1024, 32, 64, 64)),
    GridPoint(M2RNNShape(8, 512, 64, 64, 32), docs=2),
    GridPoint(M2RNNShape(4, 8192, 4, 64, 32), docs=16),
    GridPoint(FULL_SHAPE),
    GridPoint(M2RNNShape(4, 4096, 16, 64, 16), docs=8),
)
GRID_CHUNK = 64  # the layer's default state interval (M2RNNConfig.chunk)
SMALL_GRID = (GridPoint(M2RNNShape(2, 12, 4, 32, 16)), GridPoint(M2RNNShape(1, 16, 2, 32, 32), docs=3))
# A --small run is a smoke test under the Triton interpreter, where one scan takes seconds: one timed call each.
SMALL_CHUNKS, SMALL_SEQ_LENS, SMALL_REP = (8, 64), (16, 32), 1


def make_inputs(shape: M2RNNShape, dtype: torch.dtype, device: str, seed: int = 0) -> list[torch.Tensor]:
    """q, k, v, f, W with the scales the layer produces (q, k / sqrt(K); f near 0.9; W as initialised)."""
    g = torch.Generator(device=device).manual_seed(seed)
    B, S, H, K, V = shape.B, shape.S, shape.H, shape.K, shape.V
    rnd = lambda *s: torch.randn(*s, generator=g, device=device)
    q = (rnd(B, S, H, K) / K**0.5).to(dtype)
    k = (rnd(B, S, H, K) / K**0.5).to(dtype)
    v = rnd(B, S, H, V).to(dtype)
    f = torch.sigmoid(rnd(B, S, H) + 2.0).to(dtype)
    W = (rnd(H, V, V) * (0.5 / V**0.5)).to(dtype)  # the layer's init: spectral norm about 1
    return [t.requires_grad_() for t in (q, k, v, f, W)]


def _measure(inputs: list[torch.Tensor], grad: torch.Tensor, *, kernel: str, chunk: int, device: str, rep: int) -> dict[str, float]:
    """Triton fwd+bwd and fwd time (warm-up scales with rep: none for a single-call smoke run)."""
    def fwd() -> torch.Tensor:
        with torch.no_grad():
            return m2rnn_scan(*inputs, kernel=kernel, chunk=chunk)

    def fwd_bwd() -> None:
        y = m2rnn_scan(*inputs, kernel=kernel, chunk=chunk)
        torch.autograd.grad(y, inputs, grad)

    out: dict[str, float] = {}
    if device == "cuda":
        fwd_bwd()
        out["peak_mib"] = peak_extra_mib(fwd_bwd)
    warmup = 0 if rep == 1 else 1 if rep <= 2 else 3
    out["ms"] = time_ms(fwd_bwd, warmup=warmup, rep=rep, device=device)
    out["fwd_ms"] = time_ms(fwd, warmup=warmup, rep=rep, device=device)
    out["bwd_ms"] = out["ms"] - out["fwd_ms"]
    return out


def _slow_ms(fn, device: str) -> float:
    """One timed call after one warm-up: for the reference loop, which takes seconds."""
    fn()
    if device == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    if device == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1e3


def bench_m2rnn(shape: M2RNNShape = FULL_SHAPE, *, dtype: torch.dtype = torch.bfloat16, device: str = "cuda",
                chunks: tuple[int, ...] = (1, 16, 64, 256), progress: bool = True, rep: int = 20) -> dict[str, Any]:  # fmt: skip
    from tqdm.auto import tqdm

    inputs = make_inputs(shape, dtype, device)
    grad = torch.randn_like(inputs[2])
    ref_inputs = [t.detach().float().requires_grad_() for t in inputs]
    bar = tqdm(total=len(chunks) + 2, desc="m2rnn contenders", disable=not progress)
    y_ref = m2rnn_scan(*ref_inputs, kernel="reference")
    grads_ref = torch.autograd.grad(y_ref, ref_inputs, grad.float())
    bar.update()
    results = []
    for chunk in chunks:
        row: dict[str, Any] = {"contender": f"triton (states every {chunk})" if chunk != 64 else "triton", "chunk": chunk}
        row.update(_measure(inputs, grad, kernel="triton", chunk=chunk, device=device, rep=rep))
        y = m2rnn_scan(*inputs, kernel="triton", chunk=chunk)
        grads = torch.autograd.grad(y, inputs, grad)
        row["max_abs_err"] = float((y.detach().float() - y_ref.detach()).abs().max())
        row["grad_rel_err"] = {
            n: float((a.float() - b).norm() / b.norm()) for n, a, b in zip(("q", "k", "v", "f", "W"), grads, grads_ref)
        }
        results.append(row)
        bar.update()
    ref_row: dict[str, Any] = {"contender": "reference_loop"}
    ref_row["fwd_ms"] = _slow_ms(lambda: m2rnn_scan(*[t.detach() for t in inputs], kernel="reference"), device)
    ref_row["ms"] = _slow_ms(lambda: torch.autograd.grad(m2rnn_scan(*inputs, kernel="reference"), inputs, grad), device)
    results.append(ref_row)
    bar.update()
    bar.close()
    main = next(r for r in results if r["contender"] == "triton")
    main["speedup"] = ref_row["ms"] / main["ms"]
    return make_receipt(
        "m2rnn_fwd_bwd", "m2rnn", shape=asdict(shape), dtype=dtype, results=results, device=device,
        bar=BAR, meets_bar={k: bool(main[k] <= v) for k, v in BAR.items() if k in main},
        notes=(
            "Triton scan forward+backward (do_bench median) vs the reference step loop (one timed call after a "
            "warm-up), same inputs; max_abs_err = y vs the fp32-state reference loop on the same values; "
            "chunk = steps between stored fp32 states (1 = every state stored; the backward recomputes the rest)"
        ),
    )


def bench_m2rnn_sweep(shape: M2RNNShape = FULL_SHAPE, seq_lens: tuple[int, ...] = (512, 1024, 2048, 4096, 8192, 16384),
                      *, ref_up_to: int = 2048, dtype: torch.dtype = torch.bfloat16, device: str = "cuda",
                      progress: bool = True, rep: int = 10) -> dict[str, Any]:  # fmt: skip
    from tqdm.auto import tqdm

    results = []
    for S in tqdm(seq_lens, desc="m2rnn S sweep", disable=not progress):
        s = M2RNNShape(B=shape.B, S=S, H=shape.H, K=shape.K, V=shape.V)
        inputs = make_inputs(s, dtype, device)
        grad = torch.randn_like(inputs[2])
        results.append({"contender": "triton", "shape": asdict(s), **_measure(inputs, grad, kernel="triton", chunk=64, device=device, rep=rep)})
        if S <= ref_up_to:
            results.append({
                "contender": "reference_loop", "shape": asdict(s),
                "ms": _slow_ms(lambda: torch.autograd.grad(m2rnn_scan(*inputs, kernel="reference"), inputs, grad), device),
            })  # fmt: skip
    return make_receipt("m2rnn_seq_sweep", "m2rnn", shape=asdict(shape) | {"S": list(seq_lens)}, dtype=dtype,
                        results=results, device=device)  # fmt: skip


def find_xma(device: str) -> tuple[Callable[..., Any] | None, str | None]:
    """(a call of XMA's m2rnn on its Triton backend, None), or (None, why not): the checkout named by
    $MEGACPP_XMA_PEER, else ../shared/peers/xma, else .peers/xma (a copy carried to a GPU box). XMA's Triton
    backend asserts a CUDA device, so on a CPU it is recorded as missing, never timed on another backend."""
    where = peer_checkout(XMA_ENV, "xma", "xma/layers/m2rnn")
    if where is None:
        return None, f"not found (set {XMA_ENV} to a checkout of accelerated-model-architectures)"
    if device != "cuda":
        return None, "needs CUDA: its Triton backend asserts a GPU"
    if str(where) not in sys.path:
        sys.path.insert(0, str(where))
    try:
        m2rnn = importlib.import_module("xma.layers.m2rnn").m2rnn
        backend = importlib.import_module("xma").KernelBackend.triton
    except Exception as exc:  # noqa: BLE001  (a peer that cannot import is recorded, never faked)
        return None, f"import failed: {type(exc).__name__}: {exc}"
    return lambda *a, **kw: m2rnn(*a, **kw, kernel_backend=backend), None


def xma_call(m2rnn: Callable[..., Any], cu_seqlens: torch.Tensor | None) -> Callable[..., torch.Tensor]:
    """The peer on the lab's inputs (q, k, v, f, W): without documents its [B,S,N,*] layout; with them the
    batch flattened to [B*S,N,*] over cu_seqlens (its varlen layout), y given back as [B,S,N,V]."""
    # its max_seqlen, read here once (not a device read inside every timed call)
    max_len = None if cu_seqlens is None else int((cu_seqlens[1:] - cu_seqlens[:-1]).max())

    def call(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, f: torch.Tensor, W: torch.Tensor) -> torch.Tensor:
        if cu_seqlens is None:
            return m2rnn(q, k, v, W, f)[0]
        B, S, H, K = q.shape
        flat = lambda t: t.reshape(B * S, *t.shape[2:])
        y = m2rnn(flat(q), flat(k), flat(v), W, flat(f), cu_seqlens=cu_seqlens, max_seqlen=max_len)[0]
        return y.view(B, S, H, v.shape[-1])

    return call


def lab_plans(K: int) -> dict[str, tuple[int, str, str, bool]]:
    """The lab's contenders, (block_k, z_mode, bwd_order, the backward's MMA operands in the inputs' dtype) each: its
    launch plan ('triton'), two fixed plans beside it (kernels.m2rnn.plan_bwd_block_k, plan_z_scratch), the plan
    with the serial backward, and the plan with fp32 MMA operands in the backward (kernels.m2rnn.
    BWD_DOTS_IN_INPUT_DTYPE off), so the receipt shows what the plan chose against what it could have, in time and
    in the gradients' error."""
    return {"triton": (0, "auto", "parallel", True),
            "triton (16 rows a program, z in scratch)": (16, "scratch", "parallel", True),
            f"triton ({K} rows a program, z recomputed)": (K, "recompute", "parallel", True),
            "triton (the plan, serial backward)": (0, "auto", "serial", True),
            "triton (the plan, fp32 MMA operands in the backward)": (0, "auto", "parallel", False)}  # fmt: skip


@contextmanager
def backward_operands(in_input_dtype: bool) -> Iterator[None]:
    """kernels.m2rnn.BWD_DOTS_IN_INPUT_DTYPE set for the calls inside (a launch constant the backward's launcher
    reads when it runs), restored after: the peer grid's row with fp32 MMA operands in the backward."""
    from megacpp_lab.kernels import m2rnn as m2k

    saved, m2k.BWD_DOTS_IN_INPUT_DTYPE = m2k.BWD_DOTS_IN_INPUT_DTYPE, in_input_dtype
    try:
        yield
    finally:
        m2k.BWD_DOTS_IN_INPUT_DTYPE = saved


def _errors(y: torch.Tensor, grads: tuple[torch.Tensor, ...], y_ref: torch.Tensor,
            grads_ref: tuple[torch.Tensor, ...]) -> dict[str, Any]:  # fmt: skip
    return {"max_abs_err": float((y.detach().float() - y_ref).abs().max()),
            "grad_rel_err": {n: float((a.float() - b).norm() / b.norm().clamp_min(1e-30))
                             for n, a, b in zip(("q", "k", "v", "f", "W"), grads, grads_ref)}}  # fmt: skip


def bench_m2rnn_peers(grid: tuple[GridPoint, ...] = PEER_GRID, *, dtype: torch.dtype = torch.bfloat16,
                      device: str = "cuda", rep: int = 10, progress: bool = True,
                      on_point: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:  # fmt: skip
    """At each grid point, same inputs: the lab's scan as the model calls it (the batch's PackedContext) under its
    launch plan, two fixed plans, the plan with the serial backward and with fp32 backward MMA operands (lab_plans),
    and XMA's m2rnn; forward and forward+backward time with their spread, peak memory, and each one's y and gradient error against the fp32
    reference loop. on_point gets the receipt of the points measured so far after each (run() writes it, so a run
    cut short keeps what it measured)."""
    from tqdm.auto import tqdm

    xma, missing = find_xma(device)
    results: list[dict[str, Any]] = []
    ratios: dict[str, float] = {}
    bar = tqdm(total=len(grid), desc="m2rnn vs xma grid", disable=not progress)
    for i, point in enumerate(grid):
        s = point.shape
        inputs = make_inputs(s, dtype, device, seed=i)
        grad = torch.randn_like(inputs[2])
        cu = packed_cu_seqlens(s.B, s.S, point.docs, torch.Generator().manual_seed(i))
        ctx = build_context(doc_ids_from_cu_seqlens(cu, s.B, s.S).to(device))
        ref_inputs = [t.detach().float().requires_grad_() for t in inputs]
        y_ref = m2rnn_scan(*ref_inputs, ctx=ctx, kernel="reference")
        grads_ref = torch.autograd.grad(y_ref, ref_inputs, grad.float())
        y_ref = y_ref.detach()
        calls: dict[str, Callable[..., torch.Tensor]] = {
            name: (lambda *a, bk=bk, zm=zm, order=order: m2rnn_scan(*a, ctx=ctx, chunk=GRID_CHUNK, kernel="triton",
                                                                     block_k=bk, z_mode=zm, bwd_order=order))
            for name, (bk, zm, order, _) in lab_plans(s.K).items()
        }  # fmt: skip
        if xma is not None:
            calls[XMA] = xma_call(xma, None if point.docs == 1 else cu.to(device))
        for name, call in calls.items():
            def fwd(call=call) -> torch.Tensor:
                with torch.no_grad():
                    return call(*inputs)

            def fwd_bwd(call=call) -> None:
                torch.autograd.grad(call(*inputs), inputs, grad)

            row: dict[str, Any] = {"contender": name, "point": point.label, "docs": point.docs, "shape": asdict(s)}
            operands = nullcontext()
            if name in lab_plans(s.K):  # the launch plan this row ran (the backward's: its z placement too)
                block_k, z_mode, order, low_dots = lab_plans(s.K)[name]
                lengths, dev = ctx.doc_lengths, inputs[0].device
                bk, z_scratch = plan_backward(lengths, s.H, s.K, s.V, GRID_CHUNK, dev, block_k=block_k, z_mode=z_mode,
                                              bwd_order=order)  # fmt: skip
                row["plan"] = {"block_k": plan_block_k(lengths, s.H, s.K, s.V, dev, block_k=block_k),
                               "bwd_block_k": bk, "bwd_order": order, "z_in_scratch": z_scratch,
                               "bwd_mma_operands": "input dtype" if low_dots else "fp32"}  # fmt: skip
                operands = backward_operands(low_dots)
            with operands:
                y = call(*inputs)
                row.update(_errors(y, torch.autograd.grad(y, inputs, grad), y_ref, grads_ref))
                del y
                warmup = 0 if rep == 1 else 2  # a single-call smoke run: the error pass above was its warm-up
                row.update(time_spread_ms(fwd_bwd, warmup=warmup, rep=rep, device=device))
                row.update({f"fwd_{k}": v for k, v in time_spread_ms(fwd, warmup=warmup, rep=rep, device=device).items()})
                if device == "cuda":
                    row["peak_mib"] = peak_extra_mib(fwd_bwd)
            results.append(row)
        if xma is not None:
            lab_ms = next(r["ms"] for r in results if r["point"] == point.label and r["contender"] == "triton")
            ratios[point.label] = lab_ms / next(r["ms"] for r in results if r["point"] == point.label and r["contender"] == XMA)
        del inputs, ref_inputs, grads_ref, y_ref
        bar.update()
        if on_point is not None and i + 1 < len(grid):
            on_point(_peer_grid_receipt(grid, i + 1, results, ratios, missing, dtype=dtype, device=device))
    bar.close()
    return _peer_grid_receipt(grid, len(grid), results, ratios, missing, dtype=dtype, device=device)


def _peer_grid_receipt(grid: tuple[GridPoint, ...], measured: int, results: list[dict[str, Any]],
                       ratios: dict[str, float], missing: str | None, *, dtype: torch.dtype,
                       device: str) -> dict[str, Any]:  # fmt: skip
    """The grid's receipt after its first `measured` points: the bar holds only over every point, all measured."""
    text = f"'triton' forward+backward <= {PEER_BAR:.1f}x {XMA}'s at every one of the {len(grid)} grid points"
    held = measured == len(grid) and len(ratios) == len(grid) and max(ratios.values()) <= PEER_BAR
    summary = {"lab_over_xma": ratios, "worst_lab_over_xma": max(ratios.values()) if ratios else None,
               "xma": missing or "measured", "points_measured": measured, "bar": {text: bool(held)}}  # fmt: skip
    return make_receipt(
        "m2rnn_peer_grid", "m2rnn", shape={"grid": [p.label for p in grid]}, dtype=dtype, results=results,
        device=device, summary=summary, peers={XMA: XMA_SOURCE},
        notes=(
            "every contender on the same inputs at each point; 'triton' is the lab's scan as the model calls it "
            "(the batch's PackedContext: one program per document) under its launch plan, two other triton rows "
            "fixed plans, then the plan with the serial backward (kernels.m2rnn.BWD_ORDERS) and with fp32 MMA "
            "operands in the backward (kernels.m2rnn.BWD_DOTS_IN_INPUT_DTYPE off); xma m2rnn on "
            "its Triton backend (autotuned on the first call, in the warm-up), in its "
            "[B,S,N,*] layout for one document a row and its varlen layout over cu_seqlens for more; ms / fwd_ms are "
            "do_bench medians with p20 / p80; max_abs_err / grad_rel_err against the fp32 reference loop (the lab's "
            "state is fp32; XMA's is in the input dtype); peak_mib = peak extra memory of one forward+backward"
        ),
    )  # fmt: skip


def run(out_root: str | Path | None = None, *, small: bool = False, trace: bool = True) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    from megacpp_lab.plots import plot_contenders, plot_grid, plot_sweep, save_figure

    device = bench_device("m2rnn", small)
    if device == "cpu":
        require_triton_interpreter("m2rnn")
    shape = SMALL_SHAPE if small else FULL_SHAPE
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    root = output_root(out_root, small)
    written: list[Path] = []
    main = bench_m2rnn(shape, dtype=dtype, device=device, chunks=SMALL_CHUNKS if small else (1, 16, 64, 256),
                       rep=SMALL_REP if small else 20)  # fmt: skip
    written.append(write_receipt(main, root))
    ax = plot_contenders(main, "ms")
    ax.set_xscale("log")  # the reference loop is ~1000x the kernel
    written.append(save_figure(ax, written[-1].with_suffix(".png")))
    seqs = SMALL_SEQ_LENS if small else (512, 1024, 2048, 4096, 8192, 16384)
    sweep = bench_m2rnn_sweep(shape, seqs, ref_up_to=32 if small else 2048, dtype=dtype, device=device,
                              rep=SMALL_REP if small else 10)  # fmt: skip
    written.append(write_receipt(sweep, root))
    written.append(save_figure(plot_sweep(sweep, "S", "ms"), written[-1].with_suffix(".png")))
    grid = bench_m2rnn_peers(SMALL_GRID if small else PEER_GRID, dtype=dtype, device=device, rep=SMALL_REP if small else 10,
                             on_point=lambda partial: write_receipt(partial, root))  # fmt: skip
    written.append(write_receipt(grid, root))
    written.append(save_figure(plot_grid(grid, "ms"), written[-1].with_suffix(".png")))
    if trace:
        inputs = make_inputs(shape, dtype, device)
        grad = torch.randn_like(inputs[2])
        path, _ = profile_trace(
            lambda: torch.autograd.grad(m2rnn_scan(*inputs, kernel="triton"), inputs, grad),
            root / device_slug(main["device"]) / "m2rnn", "m2rnn_triton",
            steps=1 if small else 2, warmup=1 if small else 2,
        )  # fmt: skip
        written.append(path)
    return written
