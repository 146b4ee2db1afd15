"""DSA (DeepSeek sparse attention) indexer scores without the [sq, b, h, sk] slab.

    scores[b, sq, sk] = sum_h w[sq, b, h] * relu(q[sq, b, h, :] . k[sk, b, :])

Three paths, one contract:
- `indexer_scores_reference`: the einsum that builds the fp32 [sq, b, h, sk] slab (the reference);
- `indexer_scores_streaming`: one head at a time into an fp32 accumulator (one [b, sq, sk] temporary);
- `indexer_scores` (Triton): each program owns a [BLOCK_M, BLOCK_N] tile of the output, keeps the k tile
  in registers and loops over heads, so neither the slab nor a per-head temporary exists. Its
  backward is two Triton kernels that recompute q_h . k tile by tile: dq and dw per (head, query
  block), dk per key block over every query and head; no slab and no [b,sq,sk] temporary beyond dS.
  `indexer_scores_backward_reference` is the torch twin that streams over heads.
`topk_keys` picks the keys per query that the scores rank highest (optionally causal).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from megacpp_lab.kernels import AUTOTUNE_CACHE, TRITON_INTERPRET

__all__ = [
    "allowed_keys",
    "document_ends",
    "indexer_scores",
    "indexer_scores_backward_reference",
    "indexer_scores_reference",
    "indexer_scores_streaming",
    "launch_indexer_backward",
    "topk_keys",
]



def indexer_scores_reference(q: torch.Tensor, k: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """q [sq,b,h,d], k [sk,b,d], w [sq,b,h] -> fp32 [b,sq,sk], through the [sq,b,h,sk] fp32 slab."""
    acc = torch.promote_types(q.dtype, torch.float32)
    slab = torch.einsum("sbhd,tbd->sbht", q.to(acc), k.to(acc)).relu()
    return (slab * w.to(acc)[..., None]).sum(2).permute(1, 0, 2).contiguous()


def indexer_scores_streaming(q: torch.Tensor, k: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The same scores, one head at a time into an fp32 accumulator."""
    qf, kf, wf = q.float().permute(1, 2, 0, 3), k.float().permute(1, 2, 0), w.float().permute(1, 0, 2)  # [b,h,sq,d] [b,d,sk] [b,sq,h]
    out = torch.zeros(q.shape[1], q.shape[0], k.shape[0], device=q.device, dtype=torch.float32)
    for h in range(q.shape[2]):
        out.addcmul_(torch.bmm(qf[:, h], kf).relu_(), wf[:, :, h, None])
    return out


@triton.jit
def _indexer_fwd_kernel(
    q_ptr, k_ptr, w_ptr, out_ptr, start_ptr, SQ, SK, B,
    H: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr,
    DOC: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0)
    m0 = tl.program_id(1) * BLOCK_M
    n0 = tl.program_id(2) * BLOCK_N
    rm = m0 + tl.arange(0, BLOCK_M)
    rn = n0 + tl.arange(0, BLOCK_N)
    rd = tl.arange(0, D)
    mm, mn = rm < SQ, rn < SK
    active = True
    if DOC:  # a tile with no key any of its queries may select (past them, or before their documents): zeros
        first_start = tl.load(start_ptr + b * SQ + m0)  # the tile's first query starts its earliest document
        active = (n0 <= tl.minimum(m0 + BLOCK_M, SQ) - 1) & (n0 + BLOCK_N - 1 >= first_start)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if active:
        # k tile [D, BLOCK_N], loaded once for every head
        kt = tl.load(k_ptr + (rn[None, :] * B + b) * D + rd[:, None], mask=mn[None, :], other=0.0)
        for h in range(H):
            qh = tl.load(q_ptr + ((rm[:, None] * B + b) * H + h) * D + rd[None, :], mask=mm[:, None], other=0.0)
            wh = tl.load(w_ptr + (rm * B + b) * H + h, mask=mm, other=0.0).to(tl.float32)
            s = tl.dot(qh, kt, input_precision=PRECISION)
            acc += wh[:, None] * tl.maximum(s, 0.0)
        if DOC:  # zero where a query may not select the key: past it, or before its document
            st = tl.load(start_ptr + b * SQ + rm, mask=mm, other=0)
            acc = tl.where((rn[None, :] <= rm[:, None]) & (rn[None, :] >= st[:, None]), acc, 0.0)
    tl.store(out_ptr + (b * SQ + rm[:, None]).to(tl.int64) * SK + rn[None, :], acc, mask=mm[:, None] & mn[None, :])


def _launch_fwd(q: torch.Tensor, k: torch.Tensor, w: torch.Tensor, starts: torch.Tensor | None) -> torch.Tensor:
    SQ, B, H, D = q.shape
    SK = k.shape[0]
    out = torch.empty(B, SQ, SK, device=q.device, dtype=torch.float32)
    # H100 sweep at the bar shape: 64 x 128 tiles, 4 warps, 3 stages fastest for bf16 and fp32 alike.
    # fp32 runs 3xTF32 (hi/lo split): fp32-level drift (~3e-7) at tensor-core speed; plain fp32 FMA is ~5x slower.
    bm, bn, warps, stages = (16, 16, 1, 1) if TRITON_INTERPRET else (64, 128, 4, 3)
    precision = "tf32x3" if q.dtype == torch.float32 and not TRITON_INTERPRET else "ieee"
    _indexer_fwd_kernel[(B, triton.cdiv(SQ, bm), triton.cdiv(SK, bn))](
        q, k, w, out, q if starts is None else starts, SQ, SK, B, H=H, D=D, BLOCK_M=bm, BLOCK_N=bn,
        PRECISION=precision, DOC=starts is not None, num_warps=warps, num_stages=stages,
    )  # fmt: skip
    return out


@torch.library.custom_op("megacpp::dsa_indexer_scores", mutates_args=())
def _indexer_op(q: torch.Tensor, k: torch.Tensor, w: torch.Tensor, starts: torch.Tensor | None) -> torch.Tensor:
    return _launch_fwd(q, k, w, starts)


@_indexer_op.register_fake
def _(q, k, w, starts):
    return q.new_empty((q.shape[1], q.shape[0], k.shape[0]), dtype=torch.float32)


def indexer_scores_backward_reference(q: torch.Tensor, k: torch.Tensor, w: torch.Tensor,
                                      dS: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """(dq, dk, dw) streaming over heads in torch, recomputing q_h . k: one [b,sq,sk] temporary at a time,
    never the slab. fp32 math (fp64 stays fp64, for gradcheck). The Triton backward's reference."""
    acc = torch.promote_types(q.dtype, torch.float32)
    qf, kf, wf = q.to(acc).permute(1, 2, 0, 3), k.to(acc).permute(1, 0, 2), w.to(acc).permute(1, 0, 2)  # [b,h,sq,d] [b,sk,d] [b,sq,h]
    dS = dS.to(acc)
    dq = torch.empty_like(qf)
    dk = torch.zeros_like(kf)
    dw = torch.empty_like(wf)
    for h in range(q.shape[2]):
        s = torch.bmm(qf[:, h], kf.transpose(1, 2))  # [b,sq,sk]
        dw[:, :, h] = (dS * s.relu()).sum(-1)
        g = dS * wf[:, :, h, None] * (s > 0)
        dq[:, h] = torch.bmm(g, kf)
        dk.add_(torch.bmm(g.transpose(1, 2), qf[:, h]))
    return (dq.permute(2, 0, 1, 3).to(q.dtype), dk.permute(1, 0, 2).to(k.dtype), dw.permute(1, 0, 2).to(w.dtype))


def _bwd_configs() -> list[triton.Config]:
    if TRITON_INTERPRET:
        return [triton.Config({"BLOCK_M": 16, "BLOCK_N": 16}, num_warps=1)]
    return [triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=w, num_stages=st)
            for bm in (64, 128) for bn in (64, 128) for w in (4, 8) for st in (2, 3)]  # fmt: skip


@triton.autotune(configs=_bwd_configs(), key=["SQ", "SK", "H", "D", "PRECISION"], **AUTOTUNE_CACHE)
@triton.jit
def _indexer_bwd_dq_dw_kernel(
    q_ptr, k_ptr, w_ptr, ds_ptr, dq_ptr, dw_ptr, start_ptr, SQ, SK, B,
    H: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr,
    DOC: tl.constexpr,
):  # fmt: skip
    # one program per (head, query block, batch); the head is the fastest grid axis, so the H programs
    # that read the same dS rows run together and share them through L2
    h = tl.program_id(0)
    b = tl.program_id(2)
    m0 = tl.program_id(1) * BLOCK_M
    rm = m0 + tl.arange(0, BLOCK_M)
    rd = tl.arange(0, D)
    mm = rm < SQ
    n_lo = 0
    n_hi = SK
    if DOC:  # only the key blocks its queries may select: from the earliest document start to the last query
        n_lo = (tl.load(start_ptr + b * SQ + m0) // BLOCK_N) * BLOCK_N
        n_hi = tl.minimum(m0 + BLOCK_M, SK)
    st = tl.load(start_ptr + b * SQ + rm, mask=mm, other=0) if DOC else rm
    qh = tl.load(q_ptr + ((rm[:, None] * B + b) * H + h) * D + rd[None, :], mask=mm[:, None], other=0.0)
    wh = tl.load(w_ptr + (rm * B + b) * H + h, mask=mm, other=0.0).to(tl.float32)
    dq = tl.zeros((BLOCK_M, D), dtype=tl.float32)
    dw = tl.zeros((BLOCK_M,), dtype=tl.float32)
    for n0 in range(n_lo, n_hi, BLOCK_N):
        rn = n0 + tl.arange(0, BLOCK_N)
        mn = rn < SK
        kt = tl.load(k_ptr + (rn[:, None] * B + b) * D + rd[None, :], mask=mn[:, None], other=0.0)  # [BN, D]
        keep = mm[:, None] & mn[None, :]
        if DOC:
            keep = keep & (rn[None, :] <= rm[:, None]) & (rn[None, :] >= st[:, None])
        ds = tl.load(ds_ptr + (b * SQ + rm[:, None]).to(tl.int64) * SK + rn[None, :], mask=keep, other=0.0)
        s = tl.dot(qh, tl.trans(kt), input_precision=PRECISION)
        dw += tl.sum(ds * tl.maximum(s, 0.0), axis=1)
        g = tl.where(s > 0, ds * wh[:, None], 0.0)
        dq = tl.dot(g.to(kt.dtype), kt, dq, input_precision=PRECISION)
    tl.store(dq_ptr + ((rm[:, None] * B + b) * H + h) * D + rd[None, :], dq.to(dq_ptr.dtype.element_ty), mask=mm[:, None])
    tl.store(dw_ptr + (rm * B + b) * H + h, dw.to(dw_ptr.dtype.element_ty), mask=mm)


@triton.autotune(configs=_bwd_configs(), key=["SQ", "SK", "H", "D", "PRECISION"], **AUTOTUNE_CACHE)
@triton.jit
def _indexer_bwd_dk_kernel(
    q_ptr, k_ptr, w_ptr, ds_ptr, dk_ptr, start_ptr, end_ptr, SQ, SK, B,
    H: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr,
    DOC: tl.constexpr,
):  # fmt: skip
    # one program per (key block, batch): dk sums over every query and head, so each dS tile is read
    # once and all H heads are walked against it
    b = tl.program_id(1)
    n0 = tl.program_id(0) * BLOCK_N
    rn = n0 + tl.arange(0, BLOCK_N)
    rd = tl.arange(0, D)
    mn = rn < SK
    kt = tl.load(k_ptr + (rn[:, None] * B + b) * D + rd[None, :], mask=mn[:, None], other=0.0)  # [BN, D]
    dk = tl.zeros((BLOCK_N, D), dtype=tl.float32)
    m_lo = 0
    m_hi = SQ
    if DOC:  # only the query blocks that may select these keys: from the first key to its block's last document end
        m_lo = (n0 // BLOCK_M) * BLOCK_M
        m_hi = tl.load(end_ptr + b * SQ + tl.minimum(n0 + BLOCK_N, SK) - 1) + 1
    for m0 in range(m_lo, m_hi, BLOCK_M):
        rm = m0 + tl.arange(0, BLOCK_M)
        mm = rm < SQ
        keep = mm[:, None] & mn[None, :]
        if DOC:
            st = tl.load(start_ptr + b * SQ + rm, mask=mm, other=0)
            keep = keep & (rn[None, :] <= rm[:, None]) & (rn[None, :] >= st[:, None])
        ds = tl.load(ds_ptr + (b * SQ + rm[:, None]).to(tl.int64) * SK + rn[None, :], mask=keep, other=0.0)
        for h in range(H):
            qh = tl.load(q_ptr + ((rm[:, None] * B + b) * H + h) * D + rd[None, :], mask=mm[:, None], other=0.0)
            wh = tl.load(w_ptr + (rm * B + b) * H + h, mask=mm, other=0.0).to(tl.float32)
            s = tl.dot(qh, tl.trans(kt), input_precision=PRECISION)  # [BM, BN]
            g = tl.where(s > 0, ds * wh[:, None], 0.0)
            dk = tl.dot(tl.trans(g.to(qh.dtype)), qh, dk, input_precision=PRECISION)
    tl.store(dk_ptr + (rn[:, None] * B + b) * D + rd[None, :], dk.to(dk_ptr.dtype.element_ty), mask=mn[:, None])


def document_ends(starts: torch.Tensor) -> torch.Tensor:
    """[b, s] int32: the last index of each token's document, from each token's document start (starts [b, s])."""
    T = starts.shape[1]
    pos = torch.arange(T, device=starts.device, dtype=torch.int32)
    begins = torch.where(starts.to(torch.int32) == pos, pos, T)  # T where a token starts no document
    later = torch.cat((begins[:, 1:], begins.new_full((begins.shape[0], 1), T)), dim=1)  # the starts after each token
    return (later.flip(1).cummin(1).values.flip(1) - 1).contiguous()


def launch_indexer_backward(q: torch.Tensor, k: torch.Tensor, w: torch.Tensor, dS: torch.Tensor,
                            starts: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """(dq, dk, dw) by the Triton backward. starts [b, s] (each query's document start, sq == sk): dS is read only
    where a query may select a key (its document, at or before it), the rest taken as zero, and only the tiles
    holding such keys are walked."""
    SQ, B, H, D = q.shape
    SK = k.shape[0]
    dS = dS.float().contiguous()
    dq, dk, dw = torch.empty_like(q), torch.empty_like(k), torch.empty_like(w)
    precision = "tf32x3" if q.dtype == torch.float32 and not TRITON_INTERPRET else "ieee"
    doc = starts is not None
    starts = starts.to(torch.int32).contiguous() if doc else q
    ends = document_ends(starts) if doc else q
    _indexer_bwd_dq_dw_kernel[lambda m: (H, triton.cdiv(SQ, m["BLOCK_M"]), B)](
        q, k, w, dS, dq, dw, starts, SQ, SK, B, H=H, D=D, PRECISION=precision, DOC=doc,
    )  # fmt: skip
    _indexer_bwd_dk_kernel[lambda m: (triton.cdiv(SK, m["BLOCK_N"]), B)](
        q, k, w, dS, dk, starts, ends, SQ, SK, B, H=H, D=D, PRECISION=precision, DOC=doc,
    )  # fmt: skip
    return dq, dk, dw


@torch.library.custom_op("megacpp::dsa_indexer_scores_bwd", mutates_args=())
def _indexer_bwd_op(q: torch.Tensor, k: torch.Tensor, w: torch.Tensor, dS: torch.Tensor,
                    starts: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    return launch_indexer_backward(q, k, w, dS, starts)


@_indexer_bwd_op.register_fake
def _(q, k, w, dS, starts):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(w)


def _setup(ctx, inputs, output):
    q, k, w, starts = inputs
    ctx.doc = starts is not None
    ctx.save_for_backward(q, k, w, *([starts] if ctx.doc else []))


def _backward(ctx, dS):
    q, k, w, *rest = ctx.saved_tensors
    return *_indexer_bwd_op(q, k, w, dS, rest[0] if ctx.doc else None), None


_indexer_op.register_autograd(_backward, setup_context=_setup)


def indexer_scores(q: torch.Tensor, k: torch.Tensor, w: torch.Tensor, *, starts: torch.Tensor | None = None) -> torch.Tensor:
    """Fused Triton scores: q [sq,b,h,d], k [sk,b,d], w [sq,b,h] -> fp32 [b,sq,sk]. Differentiable.

    starts [b, s] (packed rows, sq == sk: each query's document start): the scores of the keys each query may select
    (at or before it, in its document), zero elsewhere; only the tiles holding such keys are computed, and the
    backward reads the gradient only at those keys. DSA's selection and KL read no other."""
    if q.dim() != 4 or k.dim() != 3 or w.dim() != 3:
        raise ValueError(f"q must be [sq,b,h,d], k [sk,b,d], w [sq,b,h]; got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(w.shape)}")
    SQ, B, H, D = q.shape
    if k.shape[1:] != (B, D) or w.shape != (SQ, B, H):
        raise ValueError(f"k must be [sk,{B},{D}] and w [{SQ},{B},{H}]; got {tuple(k.shape)}, {tuple(w.shape)}")
    if D < 16 or D & (D - 1):
        raise ValueError(f"d must be a power of two >= 16 for the kernel, got {D}")
    if not w.is_floating_point() or w.device != q.device:
        raise ValueError(f"w must be a floating tensor on {q.device}, got {w.dtype} on {w.device}")
    if q.dtype != k.dtype or q.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"q and k must share a float32/bfloat16/float16 dtype, got {q.dtype} and {k.dtype}")
    if q.device.type != "cuda" and not TRITON_INTERPRET:
        raise RuntimeError("indexer_scores needs CUDA tensors (or TRITON_INTERPRET=1); use indexer_scores_streaming on CPU")
    if starts is not None:
        if SQ != k.shape[0] or tuple(starts.shape) != (B, SQ) or starts.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"starts must be int32/int64 [b, s] = [{B}, {SQ}] with sq == sk = {k.shape[0]}, got "
                             f"{starts.dtype} {tuple(starts.shape)}")  # fmt: skip
        starts = starts.to(device=q.device, dtype=torch.int32).contiguous()
    return _indexer_op(q.contiguous(), k.contiguous(), w.contiguous(), starts)


def topk_keys(scores: torch.Tensor, top_k: int, *, causal: bool = False,
              doc_ids: torch.Tensor | None = None) -> torch.Tensor:
    """Indices [b, sq, top_k] of each query's highest-scoring keys.

    causal: future keys are excluded. doc_ids [b, s] (packed rows, sq == sk): keys of another document
    are excluded. Excluded keys score -inf, so they are picked only when a query has fewer than top_k
    allowed keys; `allowed_keys` says which picks are real. Equal scores rank by the lower key index (a stable
    sort, as the DSA selection breaks ties; torch.topk's order among ties is unspecified)."""
    if not 1 <= top_k <= scores.shape[-1]:
        raise ValueError(f"top_k must be in [1, {scores.shape[-1]}], got {top_k}")
    masked = scores.masked_fill(~allowed_keys(scores, causal=causal, doc_ids=doc_ids), float("-inf"))
    return torch.sort(masked, dim=-1, descending=True, stable=True).indices[..., :top_k]


def allowed_keys(scores: torch.Tensor, *, causal: bool = False, doc_ids: torch.Tensor | None = None) -> torch.Tensor:
    """Bool mask broadcastable to scores [b, sq, sk]: which keys each query may select."""
    b, sq, sk = scores.shape
    allowed = torch.ones(1, sq, sk, dtype=torch.bool, device=scores.device)
    if causal:
        allowed = allowed & (torch.arange(sk, device=scores.device)[None, :] <= torch.arange(sq, device=scores.device)[:, None] + (sk - sq))
    if doc_ids is not None:
        if tuple(doc_ids.shape) != (b, sq) or sq != sk:
            raise ValueError(f"doc_ids must be [b, s] = [{b}, {sq}] with sq == sk, got {tuple(doc_ids.shape)} (sk={sk})")
        allowed = allowed & (doc_ids[:, :, None] == doc_ids[:, None, :])
    return allowed
