"""`megacpp-lab bench attention`: the seeds' attention side, DSA layers and multi-token prediction. Two parts, three
receipts: the DSA layer against dense MLA at the bar's shape (and its parts timed alone), the same over other
lengths, document counts and batch sizes, and MTP depth 1 on the `stack` preset (step time, memory, and the draft
acceptance rate on held-out C++ after training).

What it measures and writes: `megacpp-lab bench attention --help` (megacpp_lab.bench.COMMANDS["attention"]).
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from megacpp_lab.bench import bench_device, output_root, require_triton_interpreter
from megacpp_lab.bench.harness import fresh_dynamo, timed_call
from megacpp_lab.model.config import model_config
from megacpp_lab.nn.dsa import DSAConfig, document_starts, set_dsa_phase
from megacpp_lab.nn.mla import MLAConfig, MultiLatentAttention
from megacpp_lab.profiling import peak_extra_mib, step_times_ms
from megacpp_lab.receipts import make_receipt, write_receipt
from megacpp_lab.varlen import build_context, doc_ids_from_cu_seqlens, packed_cu_seqlens

__all__ = ["DSA_SHAPE", "DSA_SWEEP", "PARTS", "DSAShape", "bench_dsa_layer", "bench_dsa_sweep", "bench_mtp_stack",
           "run", "run_parts"]  # fmt: skip

DSA_OVER_DENSE_BAR = 0.5
MTP_STEP_COST_BAR = 0.15
PARTS = ("dsa", "mtp")
PARTS_ENV = "MEGACPP_BENCH_ATTENTION_PARTS"

DENSE_SDPA = "dense MLA layer, attn_impl='sdpa' (the reference: a [B,1,T,T] document mask), compiled"
DENSE_FLEX = "dense MLA layer, attn_impl='flex' (the documents' block mask; 'auto' compiled on a GPU), compiled"
DENSE_VARLEN = "dense MLA layer, attn_impl='varlen' (torch's flash varlen kernel over cu_seqlens), compiled"
# the dense layer's contenders by attn_impl
DENSE_IMPLS = {DENSE_SDPA: "sdpa", DENSE_FLEX: "flex", DENSE_VARLEN: "varlen"}
DSA_SPARSE = "DSA layer, sparse phase (each query's top_k keys), compiled"
DSA_WARMUP = "DSA layer, warm-up phase (every allowed key, KL on all of them), compiled"


@dataclass(frozen=True)
class DSAShape:
    B: int
    T: int
    docs: int  # documents per row, of seeded-random lengths (packed_cu_seqlens)
    top_k: int


DSA_SHAPE = DSAShape(B=1, T=16384, docs=8, top_k=2048)
# document counts and batch sizes the bar does not name: a batch of four at T=4096, one long document (the
# selection prunes most), many short ones (it prunes nothing)
DSA_SWEEP = (DSAShape(B=4, T=4096, docs=8, top_k=2048), DSAShape(B=1, T=16384, docs=1, top_k=2048),
             DSAShape(B=1, T=16384, docs=32, top_k=2048))  # fmt: skip
SMALL_SHAPE = DSAShape(B=2, T=256, docs=3, top_k=48)
SMALL_SWEEP = (DSAShape(B=1, T=256, docs=1, top_k=48),)


def run_parts() -> tuple[str, ...]:
    """The parts a run measures: $MEGACPP_BENCH_ATTENTION_PARTS (comma-separated, from PARTS), else all."""
    text = os.environ.get(PARTS_ENV, ",".join(PARTS))
    parts = tuple(p.strip() for p in text.split(",") if p.strip())
    if not parts or any(p not in PARTS for p in parts):
        raise ValueError(f"{PARTS_ENV}={text!r}: a comma-separated list of {PARTS}")
    return parts


def _say(text: str) -> None:
    print(f"[bench attention] {text}", file=sys.stderr, flush=True)


def _spread(samples: list[float]) -> dict[str, float]:
    s = sorted(samples)
    return {"ms": statistics.median(s), "ms_min": s[0], "ms_max": s[-1], "ms_p10": s[len(s) // 10],
            "ms_p90": s[min(len(s) - 1, (9 * len(s)) // 10)], "samples": len(s)}  # fmt: skip


def _mla_config(device: str, T: int) -> tuple[MLAConfig, DSAConfig]:
    """The stack preset's attention (the tiny preset's on a CPU smoke run): its MLA layer (d=1024) and its DSA
    indexer, at max_positions T."""
    cfg = model_config("stack" if device == "cuda" else "tiny", device)
    return MLAConfig.build(cfg.mla, max_positions=max(T, cfg.mla.max_positions)), cfg.dsa


def _names(device: str, names: tuple[str, ...]) -> tuple[str, ...]:
    """The contenders a device runs: a CPU smoke run has no dense flex row (flex has no CPU backward) and no varlen
    row (flash attention: CUDA only)."""
    return names if device == "cuda" else tuple(n for n in names if n not in (DENSE_FLEX, DENSE_VARLEN))


def _contenders(s: DSAShape, device: str, dtype: torch.dtype, names: tuple[str, ...]) -> dict[str, MultiLatentAttention]:
    """The same MLA weights as a dense layer (sdpa, flex, varlen) and as a DSA layer (its indexer seeded alike)."""
    mla, dsa = _mla_config(device, s.T)
    torch.manual_seed(0)
    dsa_layer = MultiLatentAttention(mla, dsa=DSAConfig.build(dsa, top_k=s.top_k)).to(device, dtype).train()
    dense_state = {k: v for k, v in dsa_layer.state_dict().items() if not k.startswith("indexer.")}
    layers = {}
    for name in names:
        if name in DENSE_IMPLS:
            cfg = MLAConfig.build(mla, attn_impl=DENSE_IMPLS[name])
            layer = MultiLatentAttention(cfg).to(device, dtype).train()
            layer.load_state_dict(dense_state)
        else:
            layer = MultiLatentAttention(mla, dsa=DSAConfig.build(dsa, top_k=s.top_k)).to(device, dtype).train()
            layer.load_state_dict(dsa_layer.state_dict())
            set_dsa_phase(layer, "sparse" if name == DSA_SPARSE else "warmup")
        layers[name] = layer
    return layers


def _batch(s: DSAShape, device: str, dtype: torch.dtype, d_model: int, seed: int = 0) -> tuple[torch.Tensor, Any]:
    g = torch.Generator().manual_seed(seed)
    doc_ids = doc_ids_from_cu_seqlens(packed_cu_seqlens(s.B, s.T, s.docs, g), s.B, s.T)
    ctx = build_context(doc_ids, block_mask=True).to(device)  # the dense flex layer reads the block mask
    x = torch.randn(s.B, s.T, d_model, generator=g).to(device, dtype)
    return x, ctx


def _rows(s: DSAShape, device: str, dtype: torch.dtype, names: tuple[str, ...], steps: int) -> list[dict[str, Any]]:
    """Each contender compiled (fullgraph, as regional compile compiles a block) on one packed batch: its first
    call, forward (no_grad) and forward+backward times with their spread, and the forward+backward's peak."""
    rows = []
    for name, layer in _contenders(s, device, dtype, names).items():
        fresh_dynamo()
        x, ctx = _batch(s, device, dtype, layer.config.d_model)
        x.requires_grad_(True)
        dy = torch.randn_like(x)
        fn = torch.compile(layer, fullgraph=True, backend="inductor" if device == "cuda" else "aot_eager")
        params = [p for p in layer.parameters() if p.requires_grad]

        def fwd(fn=fn, x=x, ctx=ctx) -> None:
            with torch.no_grad():
                fn(x, ctx=ctx)

        def fwd_bwd(fn=fn, x=x, ctx=ctx, dy=dy, params=params) -> None:
            torch.autograd.grad(fn(x, ctx=ctx), [x, *params], dy, allow_unused=True)

        _say(f"{name}: B={s.B} T={s.T} docs={s.docs}: compiling (cold unless inductor's cache holds it)")
        _, first = timed_call(fwd_bwd, device)
        timed_call(fwd, device)
        row = {"contender": name, **asdict(s), "first_call_s": first}
        row.update({f"fwd_{k}": v for k, v in _spread(step_times_ms(fwd, warmup=1, steps=steps, device=device)).items()})
        row.update(_spread(step_times_ms(fwd_bwd, warmup=1, steps=steps, device=device)))
        if device == "cuda":
            row["peak_mib"] = peak_extra_mib(fwd_bwd)
        rows.append(row)
        _say(f"{name}: fwd+bwd {row['ms']:.2f} ms (min {row['ms_min']:.2f}, max {row['ms_max']:.2f})")
        del fn, layer, x, dy
    return rows


def _part_rows(s: DSAShape, device: str, dtype: torch.dtype, steps: int) -> list[dict[str, Any]]:
    """The DSA layer's own work timed alone, eagerly (custom ops: the same kernels compiled or not): the indexer's
    scores forward+backward, the top-k selection, and the KL forward+backward."""
    from torch.nn.attention.flex_attention import AuxRequest, flex_attention

    from megacpp_lab.kernels.dsa_sparse import select_thresholds, sparse_kl
    from megacpp_lab.nn.dsa import selection_score_mod

    layer = _contenders(s, device, dtype, (DSA_SPARSE,))[DSA_SPARSE]
    x, ctx = _batch(s, device, dtype, layer.config.d_model)
    c = layer.config
    with torch.no_grad():
        q_lat, c_lat, k_pe = layer.down_proj(x)
        q = layer.q_up_rope(q_lat, None, ctx=ctx)
        key, value = layer.kv_up_rope(x, c_lat, k_pe, None, ctx=ctx)
    starts = document_starts(ctx.doc_ids, ctx.positions, s.B, s.T, x.device)
    scale = (c.d_nope + c.d_rope) ** -0.5

    def indexer() -> None:
        scores = layer.indexer(x, q_lat, starts)
        torch.autograd.grad(scores, [p for p in layer.indexer.parameters()], torch.ones_like(scores))

    scores = layer.indexer(x, q_lat, starts).detach()
    thr, cut = select_thresholds(scores, starts, s.top_k)
    attend = torch.compile(flex_attention) if device == "cuda" else flex_attention  # eager: the CPU smoke run
    with torch.no_grad():
        _, aux = attend(q.transpose(1, 2).contiguous(), key.transpose(1, 2).contiguous(),
                        value.transpose(1, 2).contiguous(), score_mod=selection_score_mod(scores, thr, cut),
                        block_mask=ctx.block_mask, scale=scale, return_aux=AuxRequest(lse=True))  # fmt: skip
    lse = aux.lse
    leaf = scores.clone().requires_grad_(True)

    def kl() -> None:
        sparse_kl(q, key, lse, leaf, starts, thr, cut, scale, c.d_nope).sum().backward()

    parts = {"indexer scores, forward+backward (Triton)": indexer,
             "top-k selection (Triton radix select)": lambda: select_thresholds(scores, starts, s.top_k),
             "indexer KL, forward+backward (Triton)": kl}  # fmt: skip
    rows = []
    for name, fn in parts.items():
        timed_call(fn, device)
        rows.append({"contender": name, **asdict(s), **_spread(step_times_ms(fn, warmup=1, steps=steps, device=device))})
        _say(f"{name}: {rows[-1]['ms']:.2f} ms")
    return rows


def bench_dsa_layer(s: DSAShape, *, device: str, dtype: torch.dtype, steps: int) -> dict[str, Any]:
    """A DSA layer (sparse and warm-up phases) against the dense MLA layer of the same weights (sdpa, the reference;
    flex over the documents' blocks, 'auto' on a GPU; varlen over their cu_seqlens) at shape s, compiled; and the
    DSA layer's parts alone."""
    rows = _rows(s, device, dtype, _names(device, (*DENSE_IMPLS, DSA_SPARSE, DSA_WARMUP)), steps)
    parts = _part_rows(s, device, dtype, steps)
    ms = {r["contender"]: r["ms"] for r in rows}
    summary = {
        "dsa_over_dense_sdpa": ms[DSA_SPARSE] / ms[DENSE_SDPA],
        "dsa_over_dense_flex": ms[DSA_SPARSE] / ms[DENSE_FLEX] if DENSE_FLEX in ms else None,
        "varlen_over_dense_flex": ms[DENSE_VARLEN] / ms[DENSE_FLEX] if DENSE_VARLEN in ms else None,
        "warmup_over_dense_sdpa": ms[DSA_WARMUP] / ms[DENSE_SDPA],
        "indexer_ms": {r["contender"]: r["ms"] for r in parts},
        "indexer_share_of_dsa": sum(r["ms"] for r in parts) / ms[DSA_SPARSE],
        "bar": {f"DSA layer fwd+bwd at T={s.T}, {s.docs} documents per row, top-k {s.top_k} <= {DSA_OVER_DENSE_BAR}x "
                "the dense MLA layer with attn_impl sdpa (a [B,1,T,T] document mask)": ms[DSA_SPARSE] / ms[DENSE_SDPA] <= DSA_OVER_DENSE_BAR,
                "the DSA indexer's own time reported (its scores, selection and KL, each timed alone)": len(parts) == 3},
    }  # fmt: skip
    mla, dsa = _mla_config(device, s.T)
    return make_receipt(
        "dsa_layer", "attention", shape=asdict(s), dtype=dtype, results=rows + parts, device=device, summary=summary,
        config={"mla": asdict(mla), "dsa": asdict(DSAConfig.build(dsa, top_k=s.top_k))},
        notes=("The stack preset's MLA layer (d=1024) on x [B,T,d] of a packed batch, train mode, each contender "
               "torch.compile(fullgraph) as regional compile compiles a block: forward under no_grad and forward+backward "
               "(the gradients of x and every parameter), each step timed alone (CUDA events) after warm-up; ms is the "
               "median, ms_min/ms_max/ms_p10/ms_p90 the spread. The dense layers share the DSA layer's MLA weights. "
               "The sdpa layer attends with a [B,1,T,T] document mask (every pair computed); the flex layer skips the "
               "blocks outside the documents (attn_impl 'auto' compiled on a GPU); the varlen layer runs torch's flash varlen "
               "kernel over the documents' cu_seqlens, v zero-padded to the q/k head dim (varlen_over_dense_flex: its "
               "time over flex's). The DSA layer (nn/dsa.py, attn_impl flex): the indexer's [B,T,T] scores "
               "(Triton), the top-k selection (Triton radix select), flex over the documents' blocks masked by the "
               "selection, and the indexer's KL (Triton, forward and backward). Its parts' rows time each alone, "
               "eagerly, at the same shape. The bar compares with the sdpa layer, the reference dense layer; "
               "dsa_over_dense_flex is the comparison with the flex layer."),
    )  # fmt: skip


def bench_dsa_sweep(shapes: tuple[DSAShape, ...], *, device: str, dtype: torch.dtype, steps: int) -> dict[str, Any]:
    """bench_dsa_layer's dense and sparse contenders at other lengths, document counts and batch sizes."""
    results, by_shape = [], {}
    for s in shapes:
        rows = _rows(s, device, dtype, _names(device, (*DENSE_IMPLS, DSA_SPARSE)), steps)
        results += rows
        ms = {r["contender"]: r["ms"] for r in rows}
        by_shape[f"B={s.B} T={s.T} docs={s.docs} top_k={s.top_k}"] = {
            "dsa_over_dense_sdpa": ms[DSA_SPARSE] / ms[DENSE_SDPA],
            "dsa_over_dense_flex": ms[DSA_SPARSE] / ms[DENSE_FLEX] if DENSE_FLEX in ms else None,
            "varlen_over_dense_flex": ms[DENSE_VARLEN] / ms[DENSE_FLEX] if DENSE_VARLEN in ms else None}
    return make_receipt(
        "dsa_sweep", "attention", shape={"shapes": [asdict(s) for s in shapes]}, dtype=dtype, results=results,
        device=device, summary={"by_shape": by_shape},
        notes=("dsa_layer.json's dense and sparse contenders (its notes) at each shape, forward+backward medians with "
               "their spread. No bar: how the ratio moves with the length, the document count and the batch."),
    )  # fmt: skip


# ----------------------------------------------------------------------------- MTP on the stack preset


@dataclass(frozen=True)
class MTPRun:
    preset: str
    batch_size: int
    seq_len: int
    steps: int  # each run's optimizer steps
    dsa_warmup_steps: int
    max_files: int | None
    val_batches: int


MTP_RUN = MTPRun(preset="stack", batch_size=4, seq_len=4096, steps=120, dsa_warmup_steps=10, max_files=None, val_batches=4)
SMALL_MTP_RUN = MTPRun(preset="tiny", batch_size=2, seq_len=128, steps=6, dsa_warmup_steps=2, max_files=80, val_batches=1)


def bench_mtp_stack(r: MTPRun, *, device: str) -> dict[str, Any]:
    """Two training runs of the preset (`megacpp-lab train`'s loop, regionally compiled on a GPU), on the same
    tokens: with MTP depth 1 and without. Their steady step times and peaks, then the MTP run's draft acceptance
    (decode.mtp_acceptance) on the held-out files' validation batches. The runs' directories (their checkpoints)
    are temporary."""
    with tempfile.TemporaryDirectory(prefix="megacpp-bench-attention-") as tmp:
        return _mtp_stack(r, device=device, out_dir=Path(tmp))


def _mtp_stack(r: MTPRun, *, device: str, out_dir: Path) -> dict[str, Any]:
    from megacpp_lab.model.decode import mtp_acceptance
    from megacpp_lab.model.parallelize import ParallelConfig
    from megacpp_lab.model.train import PackedContext, tokenize_corpus, train
    from megacpp_lab.model.train_config import TrainConfig

    cuda = device == "cuda"
    base = dict(preset=r.preset, batch_size=r.batch_size, seq_len=r.seq_len, steps=r.steps, max_files=r.max_files,
                val_batches=r.val_batches, log_every=5 if cuda else 2, val_every=r.steps, ckpt_every=10**6,
                tensorboard=False, device=device, dsa_warmup_steps=r.dsa_warmup_steps,
                parallel=ParallelConfig(compile=cuda), warmup_steps=max(1, r.steps // 10))  # fmt: skip
    if not cuda:  # the CPU smoke run: the stack's layer kinds at the tiny preset's width, eager
        base.update(pattern="AE", n_layers=2, engram_layers="none", dsa_layers="0", dsa_top_k=8)
    _say("tokenizing the corpus (cached after the first run)")
    corpus = tokenize_corpus(TrainConfig(**base), progress=False)
    rows, results = [], {}
    for depth in (1, 0):
        config = TrainConfig(**base, mtp_depth=depth, out_dir=str(out_dir / f"mtp_depth_{depth}"))
        _say(f"training the {r.preset} preset with mtp_depth={depth} for {r.steps} steps"
             + (" (compiling its blocks first)" if cuda else ""))
        fresh_dynamo()
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        res = train(config, progress=True, resume=False, corpus=corpus)
        wall = time.perf_counter() - t0
        rates = [h["tokens_per_s"] for h in res.history if "tokens_per_s" in h][1:]  # the first interval compiles
        step_ms = sorted(1e3 * r.batch_size * r.seq_len / x for x in rates)
        val = [h["val_loss"] for h in res.history if "val_loss" in h]
        row = {"contender": f"{r.preset}, mtp_depth={depth}", "mtp_depth": depth, "wall_s": wall,
               **_spread(step_ms), "val_lm_loss": val[-1], "parameters": res.model.num_parameters()["total"]}  # fmt: skip
        if cuda:
            row["peak_mib"] = max(h["peak_mib"] for h in res.history if "peak_mib" in h)
        if depth:
            from megacpp_lab.data.loader import PackedRowStream

            stream = PackedRowStream(corpus.val, seq_len=r.seq_len, batch_size=r.batch_size, pad_id=res.config.pad_id,
                                     shuffle=False)  # fmt: skip
            res.model.eval()
            acc: dict[str, list[float]] = {"accepted": [], "correct": [], "positions": []}
            with torch.no_grad():
                for _ in range(min(r.val_batches, stream.batches_per_epoch)):
                    b = next(stream)
                    ctx = PackedContext.from_batch(b).to(device)
                    out = mtp_acceptance(res.model, b.tokens.to(device), ctx)
                    for key in acc:
                        acc[key].append(out[key][0])
            n = sum(acc["positions"])
            row["draft_acceptance"] = sum(a * p for a, p in zip(acc["accepted"], acc["positions"])) / max(n, 1)
            row["draft_correct"] = statistics.fmean(acc["correct"])
            row["acceptance_positions"] = n
            # the drafting decode itself: greedy continuations of held-out documents' openings, each step drafting
            # the token after next with the MTP module and checking it when the main head gets there
            from megacpp_lab.model.decode import generate_with_drafts

            prompt_len, new = (128, 64) if cuda else (32, 8)
            openings = [d[:prompt_len] for d in corpus.val if len(d) >= prompt_len + new][:8]
            prompts = torch.tensor(np.stack(openings).astype(np.int64), device=device)
            _, stats = generate_with_drafts(res.model, prompts, new)
            row["decode_draft_acceptance"] = stats.acceptance
            row["decode_drafts"] = sum(stats.drafts)
        results[depth] = row
        rows.append(row)
        _say(f"mtp_depth={depth}: step {row['ms']:.1f} ms (min {row['ms_min']:.1f}, max {row['ms_max']:.1f})")
        del res
    cost = results[1]["ms"] / results[0]["ms"] - 1
    summary = {
        "mtp_step_cost": cost,
        "draft_acceptance": results[1]["draft_acceptance"],
        "decode_draft_acceptance": results[1]["decode_draft_acceptance"],
        "mtp_memory_cost_mib": (results[1]["peak_mib"] - results[0]["peak_mib"]) if cuda else None,
        "bar": {f"MTP depth 1 on {r.preset}: step time <= +{MTP_STEP_COST_BAR:.0%} over no MTP": cost <= MTP_STEP_COST_BAR,
                "draft acceptance rate reported (held-out C++, after training)":
                    results[1]["acceptance_positions"] > 0 and results[1]["decode_drafts"] > 0},
    }  # fmt: skip
    return make_receipt(
        "mtp_stack", "attention", shape=asdict(r), dtype=torch.bfloat16 if cuda else torch.float32, results=rows,
        device=device, summary=summary,
        notes=("Two `megacpp-lab train` runs (model/train.py's loop: AdamW, the cosine schedule, regional compile on a "
               "GPU) of the preset on the same tokenized corpus (the installed torch's C++ headers, files held out by "
               "path for validation), with mtp_depth 1 and 0; the preset's DSA layers warm up for dsa_warmup_steps "
               "and then run sparse. Step time: each log interval's tokens/s turned into ms per step, the first "
               "interval (the compile) left out; ms the median, with the spread. peak_mib: the run's peak per GPU. "
               "draft_acceptance: decode.mtp_acceptance on the held-out validation batches after training (greedy "
               "self-speculative decoding, teacher-forced: the share of depth 1's drafts the main head's greedy token "
               "would accept), weighted by positions; draft_correct: the drafts equal to the text's token. "
               "decode_draft_acceptance: decode.generate_with_drafts on the openings of held-out files (greedy "
               "continuations, each step drafting the token after next with the MTP module): the share of its "
               "drafts the main head's next greedy token equals."),
    )  # fmt: skip


def run(out_root: str | Path | None = None, *, small: bool = False, trace: bool = True) -> list[Path]:
    device = bench_device("attention", small)
    if device == "cpu":
        require_triton_interpreter("attention")
    root = output_root(out_root, small)
    parts = run_parts()
    written: list[Path] = []
    cuda = device == "cuda"
    # bf16 on the GPU (compiled flex is proven there); fp32 on a CPU smoke run, whose flex has no backward: the
    # smoke run times the reference path of the same layers
    dtype = torch.bfloat16 if cuda else torch.float32
    if "dsa" in parts:
        if not cuda:
            _say("CPU smoke run: flex has no CPU backward, so the DSA layers take DSAConfig.attn_impl='reference'")
        written.append(write_receipt(bench_dsa_layer(DSA_SHAPE if cuda else SMALL_SHAPE, device=device, dtype=dtype,
                                                     steps=20 if cuda else 1), root))  # fmt: skip
        written.append(write_receipt(bench_dsa_sweep(DSA_SWEEP if cuda else SMALL_SWEEP, device=device, dtype=dtype,
                                                     steps=10 if cuda else 1), root))  # fmt: skip
    if "mtp" in parts:
        written.append(write_receipt(bench_mtp_stack(MTP_RUN if cuda else SMALL_MTP_RUN, device=device), root))
    return written
