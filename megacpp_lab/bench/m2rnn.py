"""M2RNN benchmark: Triton scan vs the reference step loop, one run, one receipt.

What it measures and writes, and how long it takes: `megacpp-lab bench m2rnn --help`
(megacpp_lab.bench.COMMANDS["m2rnn"]).
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from megacpp_lab.bench import bench_device, output_root, require_triton_interpreter
from megacpp_lab.kernels.m2rnn import m2rnn_scan
from megacpp_lab.profiling import peak_extra_mib, profile_trace, time_ms
from megacpp_lab.receipts import device_slug, make_receipt, write_receipt

BAR = {"ms": 7.0, "fwd_ms": 1.7, "max_abs_err": 0.06, "peak_mib": 150.0}


@dataclass(frozen=True)
class M2RNNShape:
    B: int
    S: int
    H: int
    K: int
    V: int


FULL_SHAPE = M2RNNShape(B=2, S=4096, H=8, K=64, V=16)
SMALL_SHAPE = M2RNNShape(B=1, S=32, H=2, K=16, V=16)
# A --small run is a smoke test under the Triton interpreter, where one scan takes seconds: one timed call each.
SMALL_CHUNKS, SMALL_SEQ_LENS, SMALL_REP = (8, 64), (16, 32), 1


def make_inputs(shape: M2RNNShape, dtype: torch.dtype, device: str, seed: int = 0) -> list[torch.Tensor]:
    """q, k, v, f, W with the scales the layer produces (q, k / sqrt(K); f near 0.9; W as initialised)."""
    g = torch.Generator(device=device).manual_seed(seed)
    B, S, H, K, V = asdict(shape).values()
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


def run(out_root: str | Path | None = None, *, small: bool = False, trace: bool = True) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    from megacpp_lab.plots import plot_contenders, plot_sweep, save_figure

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
