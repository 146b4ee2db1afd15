"""`megacpp-lab bench loss` and `megacpp-lab bench dsa`: the loss-and-memory receipts.

What each measures and writes, and how long it takes: `megacpp-lab bench loss --help` and
`megacpp-lab bench dsa --help` (megacpp_lab.bench.COMMANDS["loss"], ["dsa"]).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import torch

from megacpp_lab.bench import bench_device, output_root, require_triton_interpreter
from megacpp_lab.kernels.dsa_indexer import (
    indexer_scores,
    indexer_scores_backward_reference,
    indexer_scores_reference,
    indexer_scores_streaming,
)
from megacpp_lab.kernels.linear_cross_entropy import (
    BF16_FILTER_EPS,
    FILTER_MAX_KEPT,
    default_chunk_size,
    fused_linear_cross_entropy,
    kept_block_fraction,
    last_filter_gate,
    linear_cross_entropy_reference,
)
from megacpp_lab.profiling import paired_ratio, peak_extra_mib, profile_trace, time_ms, time_spread_ms
from megacpp_lab.receipts import device_slug, make_receipt, write_receipt

FLCE_BAR = {"ms": 60.0, "peak_mib": 1.3 * 1024}
DSA_BAR = {"ms": 10.0, "peak_mib": 1024.0}
LIGER = "liger-kernel"
EXACT, FILTERED = "fused (default chunk)", "fused, filter_eps (default chunk)"
# long-T small-H heads: the peer bar's shape, the model's own head (B=4 x T=4096, d=1024, its vocabulary), and a
# wide one; the peer bar: the exact fused path at most PEER_BAR x Liger's time at the first two
PEER_SHAPES = ((32768, 1024, 50304), (16384, 1024, 32768), (8192, 4096, 65536))
SMALL_PEER_SHAPES = ((96, 32, 640), (64, 32, 384))
PEER_BAR = 1.0
# the exact path's chunk rows at the peer shapes (beside the default chunk's, which is not repeated): the trade
# kernels/linear_cross_entropy.DEFAULT_CHUNK_BYTES stands on
PEER_CHUNKS = (1024, 2048, 4096)
GATE_SLACK = 1.02  # the gate's cost where it skips the filter: the keep-flags of GATE_ROWS rows and one host read
PAIRED_ROUNDS = 30  # the filtered row's paired rounds against the exact row (its bar's ratio)
# the break-even sweep: the gradient's mass on a band of this share of the vocabulary (its blocks kept, the
# rest dropped), at an eps below 1 / band so the band's blocks stay above it
BAND_SHARES = (0.02, 0.05, 0.1, 0.2, 0.4)
SWEEP_EPS = 2.0**-17


def _peers() -> dict[str, Callable[..., torch.Tensor]]:
    """Optional peer FLCE implementations, for the packages that are installed."""
    from importlib.util import find_spec

    peers: dict[str, Callable[..., torch.Tensor]] = {}
    if find_spec("liger_kernel") is not None:
        from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy

        peers["liger-kernel"] = lambda x, w, t: liger_fused_linear_cross_entropy(x, w, t)
    if find_spec("cut_cross_entropy") is not None:
        from cut_cross_entropy import linear_cross_entropy

        peers["cut-cross-entropy"] = lambda x, w, t: linear_cross_entropy(x, w, t)  # its default: gradient filtering
        peers["cut-cross-entropy (filter_eps=None)"] = lambda x, w, t: linear_cross_entropy(x, w, t, filter_eps=None)  # exact
    return peers


def _step(loss_fn: Callable[[], torch.Tensor], params: list[torch.Tensor]) -> Callable[[], None]:
    """One timed training step of a contender: its gradients cleared, its loss and backward."""
    def step() -> None:
        for p in params:
            p.grad = None
        loss_fn().backward()

    return step


def _measure(loss_fn: Callable[[], torch.Tensor], params: list[torch.Tensor], device: str, rep: int) -> dict[str, float]:
    step = _step(loss_fn, params)
    step()
    row = {"ms": time_ms(step, warmup=2, rep=rep, device=device)}
    if device == "cuda":
        for p in params:
            p.grad = None
        row["peak_mib"] = peak_extra_mib(step)
    return row


def bench_flce(T: int = 8192, H: int = 4096, V: int = 151552, *, dtype: torch.dtype = torch.bfloat16,
               device: str = "cuda", rep: int = 5, peers: bool = True, chunk_sizes: tuple[int, ...] = (),
               filtered: bool = True, progress: bool = True, paired_rounds: int = PAIRED_ROUNDS) -> dict[str, Any]:  # fmt: skip
    """Forward+backward of the mean CE: materialised logits, the fused path at its default chunk (the bar
    row) and at each of chunk_sizes (the time / memory trade), and the installed peers; the filtered row also
    against the exact one in paired_rounds pairs of back-to-back calls."""
    from tqdm.auto import tqdm

    g = torch.Generator(device=device).manual_seed(0)
    x = (torch.randn(T, H, generator=g, device=device) / H**0.25).to(dtype).requires_grad_()
    w = (torch.randn(V, H, generator=g, device=device) / H**0.5).to(dtype).requires_grad_()
    t = torch.randint(0, V, (T,), generator=g, device=device)
    ref_loss = float(linear_cross_entropy_reference(x.detach(), w.detach(), t))
    xr, wr = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    linear_cross_entropy_reference(xr, wr, t).backward()
    ref_dx, ref_dw = xr.grad.float(), wr.grad.float()
    del xr, wr
    eps = BF16_FILTER_EPS if dtype == torch.bfloat16 else 2.0**-20
    contenders: dict[str, tuple[Callable[[], torch.Tensor], dict[str, Any]]] = {
        "materialised logits": (lambda: linear_cross_entropy_reference(x, w, t), {}),
        "fused (default chunk)": (lambda: fused_linear_cross_entropy(x, w, t), {"chunk_size": default_chunk_size(T, V, dtype)}),
    }  # fmt: skip
    for c in chunk_sizes:
        contenders[f"fused (chunk={c})"] = (lambda c=c: fused_linear_cross_entropy(x, w, t, chunk_size=c), {"chunk_size": c})
    if filtered:
        contenders["fused, filter_eps (default chunk)"] = (lambda: fused_linear_cross_entropy(x, w, t, filter_eps=eps),
                                                           {"chunk_size": default_chunk_size(T, V, dtype), "filter_eps": eps,
                                                            "kept_block_frac": kept_block_fraction(x, w, t, eps)})  # fmt: skip
    if peers:
        contenders |= {name: (lambda fn=fn: fn(x, w, t), {}) for name, fn in _peers().items()}
    results = []
    for name, (fn, extra) in tqdm(contenders.items(), desc=f"flce V={V}", disable=not progress):
        row: dict[str, Any] = {"contender": name, **extra, **_measure(fn, [x, w], device, rep)}
        row["rel_err"] = abs(float(fn().detach()) - ref_loss) / abs(ref_loss)
        x.grad = w.grad = None
        fn().backward()  # the gradients against the materialised path's
        row["dx_rel_err"] = float((x.grad.float() - ref_dx).norm() / ref_dx.norm())
        row["dw_rel_err"] = float((w.grad.float() - ref_dw).norm() / ref_dw.norm())
        if name == FILTERED:  # what the gate decided on this call (its own flags, at the loss's scale)
            gate = last_filter_gate()
            row["filter_ran"], row["gate_kept_fraction"] = bool(gate["filtered"]), float(gate["kept_fraction"])
            # its time over the exact path's, in pairs of back-to-back calls (profiling.paired_ratio): the gate's
            # overhead is a few percent at most, the size of two separate runs' drift
            paired = paired_ratio(_step(contenders[EXACT][0], [x, w]), _step(fn, [x, w]), rounds=paired_rounds,
                                  device=device)  # fmt: skip
            row["over_exact_paired"] = {k: paired[k] for k in ("ratio", "ratio_p20", "ratio_p80")}
        x.grad = w.grad = None
        results.append(row)
    # the bar, read on the exact default and (when measured) on the filtered default, each on both metrics at once
    meets = {}
    for label, name in (("exact", EXACT), ("filter_eps", FILTERED)):
        row = next((r for r in results if r["contender"] == name), None)
        if row is not None and "peak_mib" in row:
            meets[label] = bool(all(row[k] <= v for k, v in FLCE_BAR.items()))
    return make_receipt("flce_fwd_bwd", "loss", shape={"T": T, "H": H, "V": V}, dtype=dtype, results=results,
                        device=device, bar=FLCE_BAR, meets_bar=meets,
                        notes=("forward+backward of the mean CE; peak_mib = peak extra memory of one step, dW and dx "
                               "included; rel_err = loss vs the materialised path (logits in the input dtype, upcast to fp32); dx_rel_err / dw_rel_err = "
                               "gradient norm error vs the materialised path's; meets_bar reads both bar numbers at once on the "
                               "exact default-chunk row and on the filtered one; the chunk rows show the exact path's time / "
                               "memory trade; the filter_eps row drops gradient "
                               "blocks below eps (kept_block_frac = share kept on the first chunk: these random inputs "
                               "give a near-uniform softmax, the filter's best case)"))  # fmt: skip


def bench_flce_peers(shapes: tuple[tuple[int, int, int], ...] = PEER_SHAPES, *, dtype: torch.dtype = torch.bfloat16,
                     device: str = "cuda", rep: int = 5, progress: bool = True,
                     chunk_sizes: tuple[int, ...] = PEER_CHUNKS, paired_rounds: int = PAIRED_ROUNDS) -> dict[str, Any]:  # fmt: skip
    """At each (T, H, V): the materialised logits, the exact fused path at its default chunk and at each of
    chunk_sizes below T (the default's own not repeated), the filtered one through its gate, and the installed
    peers (Liger the bar's), same inputs; the bars: exact (its default chunk) at most PEER_BAR x Liger at the first
    two shapes, and filtered never slower than exact (within GATE_SLACK) at every shape."""
    from tqdm.auto import tqdm

    rows: list[dict[str, Any]] = []
    for T, H, V in tqdm(shapes, desc="flce peer shapes", disable=not progress):
        chunks = tuple(c for c in chunk_sizes if c != default_chunk_size(T, V, dtype) and c < T)
        one = bench_flce(T, H, V, dtype=dtype, device=device, rep=rep, peers=True, filtered=True, progress=False,
                         chunk_sizes=chunks, paired_rounds=paired_rounds)  # fmt: skip
        rows += [{**r, "point": f"T={T} H={H} V={V}", "shape": {"T": T, "H": H, "V": V}} for r in one["results"]]
    at = lambda point, name: next((r for r in rows if r["point"] == point and r["contender"] == name), None)
    points = [f"T={T} H={H} V={V}" for T, H, V in shapes]
    bar: dict[str, bool] = {}
    over_liger: dict[str, float] = {}
    for point in points[:2]:
        exact, liger = at(point, EXACT), at(point, LIGER)
        if liger is not None:
            over_liger[point] = exact["ms"] / liger["ms"]
        bar[f"exact fused <= {PEER_BAR:.1f}x {LIGER} at {point}"] = point in over_liger and over_liger[point] <= PEER_BAR
    filtered_over_exact = {p: at(p, FILTERED)["over_exact_paired"]["ratio"] for p in points}
    bar[f"filter_eps never slower than exact (<= {GATE_SLACK:g}x: the gate's one host read) at every shape"] = (
        max(filtered_over_exact.values()) <= GATE_SLACK)  # fmt: skip
    summary = {"exact_over_liger": over_liger, "filtered_over_exact": filtered_over_exact,
               "filter_ran": {p: at(p, FILTERED)["filter_ran"] for p in points}, "filter_max_kept": FILTER_MAX_KEPT,
               "liger": "measured" if over_liger else "not installed (pip install liger-kernel)", "bar": bar}  # fmt: skip
    return make_receipt("flce_peer_shapes", "loss", shape={"grid": points}, dtype=dtype, results=rows, device=device,
                        summary=summary,
                        notes=("bench_flce at each shape (its notes hold): ms is the do_bench median of forward+backward; "
                               "the filter_eps row goes through the gate (filter_ran: whether the kept share of its first GATE_ROWS rows "
                               "let it filter; where it did not, the call ran exact after reading the flags); "
                               "filtered_over_exact (the gate bar's ratio) is the median over PAIRED_ROUNDS rounds of back-to-back "
                               "calls of the two (over_exact_paired, with p20 / p80), not the ratio of their separate ms"))  # fmt: skip


def band_inputs(T: int, H: int, V: int, share: float, *, dtype: torch.dtype, device: str,
                seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """x, w, targets whose softmax mass sits on a band of `share` of the vocabulary (ids below share * V, nine
    nats above the rest) with the targets in it: the filter keeps about that share of the gradient's blocks."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    band = max(1, int(share * V))
    x = torch.randn(T, H, generator=g) / H**0.25
    w = torch.randn(V, H, generator=g) / H**0.5
    x[:, 0], w[:, 0] = 3.0, torch.where(torch.arange(V) < band, 1.5, -1.5)
    t = torch.randint(0, band, (T,), generator=g)
    return x.to(device, dtype).requires_grad_(), w.to(device, dtype).requires_grad_(), t.to(device)


def bench_filter_break_even(T: int = 16384, H: int = 1024, V: int = 32768, *, shares: tuple[float, ...] = BAND_SHARES,
                            dtype: torch.dtype = torch.bfloat16, device: str = "cuda", rep: int = 5,
                            progress: bool = True) -> dict[str, Any]:  # fmt: skip
    """The filtered path forced on (filter_max_kept=1.0) against the exact one as the kept share grows: where the
    block-sparse GEMMs stop paying, the number FILTER_MAX_KEPT stands for. One row per (share, contender)."""
    from tqdm.auto import tqdm

    rows: list[dict[str, Any]] = []
    for share in tqdm(shares, desc="filter break-even", disable=not progress):
        x, w, t = band_inputs(T, H, V, share, dtype=dtype, device=device)
        kept = kept_block_fraction(x, w, t, SWEEP_EPS)
        for name, kw in (("exact", {}), ("filtered (ungated)", {"filter_eps": SWEEP_EPS, "filter_max_kept": 1.0})):
            def step(kw=kw) -> None:
                x.grad = w.grad = None
                fused_linear_cross_entropy(x, w, t, **kw).backward()

            rows.append({"contender": name, "band_share": share, "kept_block_frac": kept,
                         **time_spread_ms(step, warmup=2, rep=rep, device=device)})  # fmt: skip
        del x, w, t
    ratio = {r["band_share"]: r["ms"] / next(e["ms"] for e in rows if e["contender"] == "exact"
                                             and e["band_share"] == r["band_share"])
             for r in rows if r["contender"] != "exact"}  # fmt: skip
    kept_at = {r["band_share"]: r["kept_block_frac"] for r in rows}
    paying = [kept_at[b] for b, v in ratio.items() if v < 1.0]
    summary = {"filtered_over_exact": {f"band {b:g}, kept {kept_at[b]:.3f}": v for b, v in ratio.items()},
               "largest_kept_share_that_pays": max(paying) if paying else None, "filter_max_kept": FILTER_MAX_KEPT,
               "bar": {f"FILTER_MAX_KEPT={FILTER_MAX_KEPT:g} is no larger than the largest kept share that pays here":
                       bool(paying) and FILTER_MAX_KEPT <= max(paying)}}  # fmt: skip
    return make_receipt("flce_filter_break_even", "loss", shape={"T": T, "H": H, "V": V, "band_share": list(shares)},
                        dtype=dtype, results=rows, device=device, summary=summary, filter_eps=SWEEP_EPS,
                        notes=("the gradient's mass on a band of band_share of the vocabulary (band_inputs); kept_block_frac "
                               "= the first chunk's kept share at filter_eps; the filtered rows force the filter on "
                               "(filter_max_kept=1.0); ms = do_bench median of forward+backward with p20 / p80"))  # fmt: skip


def bench_dsa(sq: int = 4096, b: int = 8, h: int = 32, d: int = 64, *, device: str = "cuda", rep: int = 10,
              slab_max_bytes: int = 48 * 2**30, dtypes: tuple[torch.dtype, ...] = (torch.bfloat16, torch.float32),
              backward: bool = True) -> dict[str, Any]:  # fmt: skip
    """Every contender for each input dtype (the output is fp32 throughout). The bar is read on the bf16 fused row."""
    out_mib = b * sq * sq * 4 / 2**20
    results = []
    for dtype in dtypes:
        g = torch.Generator(device=device).manual_seed(0)
        q = torch.randn(sq, b, h, d, generator=g, device=device).to(dtype)
        k = torch.randn(sq, b, d, generator=g, device=device).to(dtype)
        w = torch.randn(sq, b, h, generator=g, device=device).to(dtype)
        ref = indexer_scores_streaming(q, k, w)
        contenders = {"per-head stream": indexer_scores_streaming, "fused triton": indexer_scores}
        if sq * b * h * sq * 4 <= slab_max_bytes:
            contenders = {"einsum slab": indexer_scores_reference, **contenders}
        for name, fn in contenders.items():
            row: dict[str, Any] = {"contender": name, "inputs": str(dtype).removeprefix("torch."),
                                   "ms": time_ms(lambda fn=fn: fn(q, k, w), warmup=2, rep=rep, device=device)}  # fmt: skip
            if device == "cuda":
                row["peak_mib"] = peak_extra_mib(lambda fn=fn: fn(q, k, w)) - out_mib  # working memory beyond the output
            row["rel_err"] = float((fn(q, k, w) - ref).norm() / ref.norm())
            results.append(row)
        if backward:  # the fused op: Triton forward and Triton backward
            qg, kg, wg = (t.clone().requires_grad_() for t in (q, k, w))
            dS = torch.randn(b, sq, sq, generator=g, device=device)

            def fwd_bwd() -> None:
                for t in (qg, kg, wg):
                    t.grad = None
                indexer_scores(qg, kg, wg).backward(dS)

            def torch_bwd() -> None:
                indexer_scores_backward_reference(q, k, w, dS)

            ref_grads = indexer_scores_backward_reference(q, k, w, dS)
            fwd_bwd()
            for name, fn in (("fused triton fwd+bwd", fwd_bwd), ("torch backward only (head stream)", torch_bwd)):
                row = {"contender": name, "inputs": str(dtype).removeprefix("torch."),
                       "ms": time_ms(fn, warmup=1, rep=max(2, rep // 3), device=device)}  # fmt: skip
                if device == "cuda":
                    for t in (qg, kg, wg):  # the gradients this call allocates count in its peak
                        t.grad = None
                    # fwd+bwd writes the [b,sq,sk] output, so it is taken off; the backward alone writes none
                    row["peak_mib"] = peak_extra_mib(fn) - (out_mib if fn is fwd_bwd else 0.0)
                if fn is fwd_bwd:  # worst relative error of dq, dk, dw against the torch backward
                    row["rel_err"] = max(float((t.grad.float() - r.float()).norm() / r.float().norm())
                                         for t, r in zip((qg, kg, wg), ref_grads))  # fmt: skip
                results.append(row)
    main = next(r for r in results if r["contender"] == "fused triton" and r["inputs"] == str(dtypes[0]).removeprefix("torch."))
    return make_receipt("dsa_scores", "dsa", shape={"sq": sq, "sk": sq, "b": b, "h": h, "d": d}, dtype=dtypes[0],
                        results=results, device=device, bar=DSA_BAR,
                        meets_bar={k: bool(k in main and main[k] <= v) for k, v in DSA_BAR.items()},  # unmeasured: not met
                        notes=("inputs = q, k, w dtype; output fp32 always; bar read on the fused row of the first input dtype; "
                               "peak_mib = peak extra memory minus the [b,sq,sk] fp32 output (for fwd+bwd it also holds the "
                               "gradients; the torch backward alone writes no output, so nothing is taken off it); rel_err = ||out - ref|| / ||ref|| against the per-head stream on the same inputs "
                               "(fwd+bwd: the worst of dq, dk, dw against the torch head-streaming backward); "
                               "the fused kernel runs 3xTF32 for fp32 inputs"))  # fmt: skip


def run(out_root: str | Path | None = None, *, small: bool = False, trace: bool = True, which: str = "loss") -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    from megacpp_lab.plots import plot_contenders, plot_grid, plot_sweep, save_figure

    if which not in ("loss", "dsa"):
        raise ValueError(f"which must be 'loss' or 'dsa', got {which!r}")
    device = bench_device(which, small)
    if device == "cpu" and which == "dsa":  # the fused indexer is a Triton kernel; the CPU loss runs eager
        require_triton_interpreter(which)
    root = output_root(out_root, small)
    written: list[Path] = []
    if which == "loss":
        dtype = torch.bfloat16 if device == "cuda" else torch.float32
        T, H = (64, 32) if small else (8192, 4096)
        main = bench_flce(T, H, 512 if small else 151552, dtype=dtype, device=device, rep=2 if small else 5,
                          chunk_sizes=(16, 32) if small else (128, 384, 512, 1024),
                          paired_rounds=2 if small else PAIRED_ROUNDS)  # fmt: skip
        written.append(write_receipt(main, root))
        written.append(save_figure(plot_contenders(main, "ms"), written[-1].with_suffix(".png")))
        sweep = [bench_flce(T, H, V, dtype=dtype, device=device, rep=2, peers=False, filtered=False, progress=False)
                 for V in ((256, 512) if small else (32768, 65536, 131072, 151552))]  # fmt: skip
        rows = [{**r, "shape": s["shape"]} for s in sweep for r in s["results"]]
        vs = make_receipt("flce_vocab_sweep", "loss", shape={"T": T, "H": H, "V": [s["shape"]["V"] for s in sweep]},
                          dtype=dtype, results=rows, device=device)  # fmt: skip
        written.append(write_receipt(vs, root))
        written.append(save_figure(plot_sweep(vs, "V", "peak_mib" if device == "cuda" else "ms"), written[-1].with_suffix(".png")))
        peers = bench_flce_peers(SMALL_PEER_SHAPES if small else PEER_SHAPES, dtype=dtype, device=device,
                                 rep=2 if small else 5, chunk_sizes=(32,) if small else PEER_CHUNKS,
                                 paired_rounds=2 if small else PAIRED_ROUNDS)  # fmt: skip
        written.append(write_receipt(peers, root))
        written.append(save_figure(plot_grid(peers, "ms"), written[-1].with_suffix(".png")))
        even = bench_filter_break_even(*((256, 32, 2048) if small else (16384, 1024, 32768)), dtype=dtype, device=device,
                                       shares=(0.05, 0.4) if small else BAND_SHARES, rep=2 if small else 5)  # fmt: skip
        written.append(write_receipt(even, root))
        if trace:
            g = torch.Generator(device=device).manual_seed(0)
            Tt, V = (64, 512) if small else (2048, 151552)
            x = torch.randn(Tt, H, generator=g, device=device).to(dtype).requires_grad_()
            w = (torch.randn(V, H, generator=g, device=device) / H**0.5).to(dtype).requires_grad_()
            t = torch.randint(0, V, (Tt,), generator=g, device=device)
            path, _ = profile_trace(lambda: fused_linear_cross_entropy(x, w, t).backward(), root / device_slug(main["device"]) / "loss",
                                    "flce", steps=1, warmup=1)  # fmt: skip
            written.append(path)
    else:
        dtypes = (torch.float32,) if device == "cpu" else (torch.bfloat16, torch.float32)
        b, h, d = (1, 2, 16) if small else (8, 32, 64)
        main = bench_dsa(32 if small else 4096, b, h, d, device=device, rep=2 if small else 10, dtypes=dtypes)
        written.append(write_receipt(main, root))
        written.append(save_figure(plot_contenders(main, "ms"), written[-1].with_suffix(".png")))
        sweep = [bench_dsa(s, b, h, d, device=device, rep=3, dtypes=dtypes[:1], backward=False)
                 for s in ((16, 32) if small else (1024, 2048, 4096, 8192))]  # fmt: skip
        rows = [{**r, "shape": s["shape"]} for s in sweep for r in s["results"]]
        seqs = [s["shape"]["sq"] for s in sweep]
        ss = make_receipt("dsa_seq_sweep", "dsa", shape={"sq": seqs, "sk": seqs, "b": b, "h": h, "d": d},
                          dtype=dtypes[0], results=rows, device=device,
                          notes="sq = sk in every row; inputs in the first dtype, fp32 output")  # fmt: skip
        written.append(write_receipt(ss, root))
        written.append(save_figure(plot_sweep(ss, "sq", "ms"), written[-1].with_suffix(".png")))
        if trace:
            g = torch.Generator(device=device).manual_seed(0)
            S = 32 if small else 4096
            q, k, w = (torch.randn(*shape, generator=g, device=device).to(dtypes[0]).requires_grad_()
                       for shape in ((S, 1, h, d), (S, 1, d), (S, 1, h)))  # fmt: skip
            path, _ = profile_trace(lambda: indexer_scores(q, k, w).sum().backward(), root / device_slug(main["device"]) / "dsa",
                                    "dsa_scores", steps=1, warmup=1)  # fmt: skip
            written.append(path)
    return written
