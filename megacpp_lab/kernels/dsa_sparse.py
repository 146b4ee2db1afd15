"""DSA's sparse path (nn/dsa.py) without a [B,T,T] mask or a [B,H,T,T] slab: each query's selection as two
numbers, and the indexer's KL loss against the attention's probabilities recomputed a tile at a time.

Selection. Query t may select the keys s in [start_t, t] (its document, causal; start_t = t - position_t).
With at most top_k of them it keeps them all; else its top_k by indexer score I, ties going to the lower index:

    selected(t, s) = start_t <= s <= t  and  (I[t,s] > thr[t]  or  (I[t,s] == thr[t] and s <= cut[t]))

thr[t] is the top_k-th largest allowed score and cut[t] the index of the last tie kept; a query that keeps every
allowed key has thr = -inf. `select_thresholds` (Triton: a radix select over the scores' order-preserving bit
patterns, one query per program, reading only its document's allowed keys) and `select_thresholds_reference`
(a stable sort) return (thr, cut); `selection_from_thresholds` expands them into the [B,T,T] mask for tests and
the reference path. The attention reads the pair in its flex score_mod (nn/dsa.py `selection_score_mod`).

KL. Per query t, over its selected keys S_t:  KL(p_t || softmax(I_t[S_t])), with
    p_t[s] = sum_h exp(scale q_h[t] . k_h[s] - lse_h[t]) / Z_t      (Z_t sums it over S_t: H when lse is exact)
the attention's probabilities summed over heads, recomputed from its log-sum-exp one head and one key tile at a
time. `sparse_kl` (Triton forward and backward; differentiable in I only: p is the target) and
`sparse_kl_reference` (the probabilities materialised) return the per-query KL [B,T]. Its kernels walk only the
key tiles of the query tile's documents, so their work is the documents' causal area, not T^2; each query tile's
key range is split into chunks of keys, one program each (the forward's per-chunk sums merged after), so a long
document keeps every SM busy rather than a few programs walking it.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from megacpp_lab.kernels import TRITON_INTERPRET

__all__ = [
    "select_thresholds",
    "select_thresholds_reference",
    "selection_from_thresholds",
    "sparse_kl",
    "sparse_kl_reference",
]

_LOG2E = 1.4426950408889634


# ----------------------------------------------------------------------------- selection


def _check_scores(scores: torch.Tensor, starts: torch.Tensor, name: str) -> tuple[int, int]:
    if scores.dim() != 3 or scores.shape[1] != scores.shape[2]:
        raise ValueError(f"{name}: scores must be [B,T,T], got {tuple(scores.shape)}")
    B, T = scores.shape[:2]
    if tuple(starts.shape) != (B, T) or starts.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{name}: starts must be int32/int64 [B,T] = [{B},{T}], got {starts.dtype} {tuple(starts.shape)}")
    if scores.dtype != torch.float32:
        raise ValueError(f"{name}: scores must be float32 (the indexer's output), got {scores.dtype}")
    return B, T


def _allowed(starts: torch.Tensor, T: int) -> torch.Tensor:
    """[B,T,T] bool: key s allowed for query t iff starts[b,t] <= s <= t."""
    s = torch.arange(T, device=starts.device)
    return (s[None, None, :] <= s[None, :, None]) & (s[None, None, :] >= starts[:, :, None])


def select_thresholds_reference(scores: torch.Tensor, starts: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(thr fp32 [B,T], cut int32 [B,T]) by a stable descending sort of each query's allowed scores."""
    B, T = _check_scores(scores, starts, "select_thresholds_reference")
    if top_k < 1:
        raise ValueError(f"top_k must be >= 1, got {top_k}")
    allowed = _allowed(starts, T)
    k = min(top_k, T)
    vals, idx = torch.sort(scores.masked_fill(~allowed, float("-inf")), dim=-1, descending=True, stable=True)
    keeps_all = allowed.sum(-1) <= top_k
    thr = torch.where(keeps_all, float("-inf"), vals[..., k - 1])
    cut = torch.where(keeps_all, T - 1, idx[..., k - 1]).to(torch.int32)
    return thr.contiguous(), cut.contiguous()


def selection_from_thresholds(scores: torch.Tensor, starts: torch.Tensor, thr: torch.Tensor, cut: torch.Tensor) -> torch.Tensor:
    """The [B,T,T] bool selection the pair (thr, cut) describes (module docstring)."""
    T = scores.shape[-1]
    kv = torch.arange(T, device=scores.device)
    chosen = (scores > thr[..., None]) | ((scores == thr[..., None]) & (kv <= cut[..., None]))
    return _allowed(starts, T) & chosen


@triton.jit
def _order_key(v):
    """fp32 -> uint32 whose unsigned order is the floats' order (-0.0 taken as +0.0, as float compares do)."""
    bits = v.to(tl.uint32, bitcast=True)
    bits = tl.where(bits == 0x80000000, 0, bits)
    return tl.where((bits >> 31) == 1, ~bits, bits | 0x80000000)


@triton.jit
def _digit_counts(row, lo, t, prefix, prefix_mask, shift, BLOCK: tl.constexpr):
    """Counts [256] of byte `shift` of the order keys of row[lo..t] whose higher bytes equal prefix."""
    counts = tl.zeros((256,), dtype=tl.int32)
    for c0 in range(lo, t + 1, BLOCK):
        idx = c0 + tl.arange(0, BLOCK)
        m = idx <= t
        key = _order_key(tl.load(row + idx, mask=m, other=0.0))
        match = m & ((key & prefix_mask) == prefix)
        digit = tl.where(match, (key >> shift) & 255, 0).to(tl.int32)
        counts += tl.histogram(digit, 256)
        counts -= tl.where(tl.arange(0, 256) == 0, tl.sum((~match).to(tl.int32), axis=0), 0)  # the unmatched sat in bin 0
    return counts


@triton.jit
def _select_kernel(s_ptr, start_ptr, thr_ptr, cut_ptr, T, TOP_K, BLOCK: tl.constexpr):
    # one query per program; its row read over its allowed range [start, t] only, five times: a radix select of
    # the TOP_K-th largest key one byte at a time (four passes of 256-bin counts), then the ties' cut
    t = tl.program_id(0)
    b = tl.program_id(1)
    lo = tl.load(start_ptr + b * T + t).to(tl.int32)
    row = s_ptr + (b * T + t).to(tl.int64) * T
    if t - lo + 1 <= TOP_K:  # every allowed key is kept
        tl.store(thr_ptr + b * T + t, float("-inf"))
        tl.store(cut_ptr + b * T + t, T - 1)
    else:
        bins = tl.arange(0, 256)
        prefix = tl.zeros((), dtype=tl.uint32)
        prefix_mask = tl.zeros((), dtype=tl.uint32)
        need = TOP_K  # keys still to take at or below the prefix
        shift = tl.full((), 24, tl.uint32)
        for _ in range(4):
            counts = _digit_counts(row, lo, t, prefix, prefix_mask, shift, BLOCK)
            at_or_above = tl.sum(counts, axis=0) - tl.cumsum(counts, axis=0) + counts  # keys with digit >= bin
            digit = tl.max(tl.where(at_or_above >= need, bins, -1), axis=0)
            need -= tl.sum(tl.where(bins == digit, at_or_above - counts, 0), axis=0)  # those strictly above it
            prefix = prefix | (digit.to(tl.uint32) << shift)
            prefix_mask = prefix_mask | (tl.full((), 255, tl.uint32) << shift)
            shift = tl.where(shift >= 8, shift - 8, shift)
        # prefix is the TOP_K-th largest key; keep the `need` lowest-index keys equal to it
        seen = tl.zeros((), dtype=tl.int32)
        cut = tl.full((), -1, tl.int32)
        thr = tl.zeros((), dtype=tl.float32)
        for c0 in range(lo, t + 1, BLOCK):
            idx = c0 + tl.arange(0, BLOCK)
            m = idx <= t
            v = tl.load(row + idx, mask=m, other=0.0)
            tie = m & (_order_key(v) == prefix)
            rank = tl.cumsum(tie.to(tl.int32), axis=0) + seen
            hit = tie & (rank == need)
            cut = tl.maximum(cut, tl.max(tl.where(hit, idx, -1), axis=0))
            thr += tl.sum(tl.where(hit, v, 0.0), axis=0)
            seen += tl.sum(tie.to(tl.int32), axis=0)
        tl.store(thr_ptr + b * T + t, thr)
        tl.store(cut_ptr + b * T + t, cut)


@torch.library.custom_op("megacpp::dsa_select", mutates_args=())
def _select_op(scores: torch.Tensor, starts: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    B, T = scores.shape[:2]
    thr = torch.empty(B, T, device=scores.device, dtype=torch.float32)
    cut = torch.empty(B, T, device=scores.device, dtype=torch.int32)
    block = 256 if TRITON_INTERPRET else 1024
    _select_kernel[(T, B)](scores, starts, thr, cut, T, top_k, BLOCK=block, num_warps=4)
    return thr, cut


@_select_op.register_fake
def _(scores, starts, top_k):
    B, T = scores.shape[:2]
    return scores.new_empty((B, T)), scores.new_empty((B, T), dtype=torch.int32)


def select_thresholds(scores: torch.Tensor, starts: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(thr fp32 [B,T], cut int32 [B,T]) of each query's top_k allowed keys (module docstring); scores [B,T,T]
    fp32, starts [B,T] each query's document start. Triton; not differentiable (a selection)."""
    _check_scores(scores, starts, "select_thresholds")
    if top_k < 1:
        raise ValueError(f"top_k must be >= 1, got {top_k}")
    if scores.device.type != "cuda" and not TRITON_INTERPRET:
        raise RuntimeError("select_thresholds needs CUDA tensors (or TRITON_INTERPRET=1); use select_thresholds_reference")
    return _select_op(scores.detach().contiguous(), starts.to(torch.int32).contiguous(), int(top_k))


# ----------------------------------------------------------------------------- KL


def sparse_kl_reference(q: torch.Tensor, k: torch.Tensor, lse: torch.Tensor, scores: torch.Tensor,
                        selected: torch.Tensor, scale: float) -> torch.Tensor:  # fmt: skip
    """Per-query KL [B,T] (module docstring) with the probabilities materialised: q, k [B,T,H,d], lse [B,H,T] (the
    attention's, natural log), scores [B,T,T], selected [B,T,T] bool. Differentiable in scores."""
    s = torch.einsum("bthd,bshd->bhts", q.float(), k.float()) * scale
    p = torch.exp(s - lse.float()[..., None]).sum(1).masked_fill(~selected, 0.0).detach()
    p = p / p.sum(-1, keepdim=True).clamp_min(1e-30)
    log_q = torch.log_softmax(scores.masked_fill(~selected, float("-inf")), dim=-1)
    return torch.where(selected & (p > 0), p * (torch.log(p.clamp_min(1e-30)) - log_q), 0.0).sum(-1)


@triton.jit
def _kl_tile(q_ptr, k_ptr, lse_ptr, s_ptr, b, rm, rn, mm, st, thr, cut, T, H, sq_b, sq_t, sq_h, sk_b, sk_t, sk_h,
             scale_log2, D1: tl.constexpr, D2: tl.constexpr, PRECISION: tl.constexpr):  # fmt: skip
    """One [BM,BN] tile: (the selection, I, the head-summed probabilities p~ on it)."""
    sel = mm[:, None] & (rn[None, :] <= rm[:, None]) & (rn[None, :] >= st[:, None])
    score = tl.load(s_ptr + (b * T + rm[:, None]).to(tl.int64) * T + rn[None, :], mask=sel, other=0.0)
    sel = sel & ((score > thr[:, None]) | ((score == thr[:, None]) & (rn[None, :] <= cut[:, None])))
    mn = rn < T
    r1 = tl.arange(0, D1)
    r2 = tl.arange(0, D2)
    p = tl.zeros((rm.shape[0], rn.shape[0]), dtype=tl.float32)
    for h in range(H):
        qb = q_ptr + b * sq_b + rm[:, None] * sq_t + h * sq_h
        kb = k_ptr + b * sk_b + rn[:, None] * sk_t + h * sk_h
        s = tl.dot(tl.load(qb + r1[None, :], mask=mm[:, None], other=0.0),
                   tl.trans(tl.load(kb + r1[None, :], mask=mn[:, None], other=0.0)), input_precision=PRECISION)
        s = tl.dot(tl.load(qb + D1 + r2[None, :], mask=mm[:, None], other=0.0),
                   tl.trans(tl.load(kb + D1 + r2[None, :], mask=mn[:, None], other=0.0)), s, input_precision=PRECISION)
        lse = tl.load(lse_ptr + (b * H + h) * T + rm, mask=mm, other=0.0)
        p += tl.exp2(s * scale_log2 - lse[:, None] * 1.4426950408889634)
    return sel, score, tl.where(sel, p, 0.0)


@triton.jit
def _query_chunk(start_ptr, thr_ptr, cut_ptr, T, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 CHUNK: tl.constexpr):  # fmt: skip
    """This program's query tile and key chunk: (b, rows, row mask, document starts, thr, cut, first key, end key).
    The tile's keys run from its earliest document start (its first query's) to its last query; program c of
    axis 1 takes the c-th CHUNK keys of that range (an empty range past its end)."""
    b = tl.program_id(2)
    m0 = tl.program_id(0) * BLOCK_M
    rm = m0 + tl.arange(0, BLOCK_M)
    mm = rm < T
    st = tl.load(start_ptr + b * T + rm, mask=mm, other=0)
    thr = tl.load(thr_ptr + b * T + rm, mask=mm, other=0.0)
    cut = tl.load(cut_ptr + b * T + rm, mask=mm, other=0)
    n_lo = (tl.load(start_ptr + b * T + m0) // BLOCK_N) * BLOCK_N + tl.program_id(1) * CHUNK
    n_hi = tl.minimum(tl.minimum(m0 + BLOCK_M, T), n_lo + CHUNK)
    return b, rm, mm, st, thr, cut, n_lo, n_hi


@triton.jit
def _kl_fwd_kernel(q_ptr, k_ptr, lse_ptr, s_ptr, start_ptr, thr_ptr, cut_ptr, part_ptr, T, H, NCH,
                   sq_b, sq_t, sq_h, sk_b, sk_t, sk_h, scale_log2, D1: tl.constexpr, D2: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CHUNK: tl.constexpr, PRECISION: tl.constexpr):  # fmt: skip
    # one program per (query tile, key chunk): its five partial sums per query, combined by _kl_op
    b, rm, mm, st, thr, cut, n_lo, n_hi = _query_chunk(start_ptr, thr_ptr, cut_ptr, T, BLOCK_M, BLOCK_N, CHUNK)
    plogp = tl.zeros((BLOCK_M,), dtype=tl.float32)
    p_score = tl.zeros((BLOCK_M,), dtype=tl.float32)
    z = tl.zeros((BLOCK_M,), dtype=tl.float32)
    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
    for n0 in range(n_lo, n_hi, BLOCK_N):
        rn = n0 + tl.arange(0, BLOCK_N)
        sel, score, p = _kl_tile(q_ptr, k_ptr, lse_ptr, s_ptr, b, rm, rn, mm, st, thr, cut, T, H, sq_b, sq_t, sq_h,
                                 sk_b, sk_t, sk_h, scale_log2, D1, D2, PRECISION)  # fmt: skip
        plogp += tl.sum(tl.where(p > 0, p * tl.log(tl.where(p > 0, p, 1.0)), 0.0), axis=1)
        p_score += tl.sum(p * score, axis=1)
        z += tl.sum(p, axis=1)
        m_new = tl.maximum(m_i, tl.max(tl.where(sel, score, float("-inf")), axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        l_i = l_i * tl.exp(m_i - m_safe) + tl.sum(tl.where(sel, tl.exp(score - m_safe[:, None]), 0.0), axis=1)
        m_i = m_new
    row = part_ptr + (b * NCH + tl.program_id(1)) * T + rm  # part [5, B, NCH, T]
    plane = tl.num_programs(2) * NCH * T
    tl.store(row, m_i, mask=mm)
    tl.store(row + plane, l_i, mask=mm)
    tl.store(row + 2 * plane, plogp, mask=mm)
    tl.store(row + 3 * plane, p_score, mask=mm)
    tl.store(row + 4 * plane, z, mask=mm)


@triton.jit
def _kl_bwd_kernel(q_ptr, k_ptr, lse_ptr, s_ptr, start_ptr, thr_ptr, cut_ptr, z_ptr, lsei_ptr, g_ptr, ds_ptr, T, H,
                   sq_b, sq_t, sq_h, sk_b, sk_t, sk_h, scale_log2, D1: tl.constexpr, D2: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CHUNK: tl.constexpr, PRECISION: tl.constexpr):  # fmt: skip
    b, rm, mm, st, thr, cut, n_lo, n_hi = _query_chunk(start_ptr, thr_ptr, cut_ptr, T, BLOCK_M, BLOCK_N, CHUNK)
    if n_lo < n_hi:
        z = tl.load(z_ptr + b * T + rm, mask=mm, other=1.0)
        z = tl.where(z > 0, z, 1.0)
        lse_i = tl.load(lsei_ptr + b * T + rm, mask=mm, other=0.0)
        g = tl.load(g_ptr + b * T + rm, mask=mm, other=0.0)
        for n0 in range(n_lo, n_hi, BLOCK_N):
            rn = n0 + tl.arange(0, BLOCK_N)
            sel, score, p = _kl_tile(q_ptr, k_ptr, lse_ptr, s_ptr, b, rm, rn, mm, st, thr, cut, T, H, sq_b, sq_t,
                                     sq_h, sk_b, sk_t, sk_h, scale_log2, D1, D2, PRECISION)  # fmt: skip
            # d KL_t / d I[t,s] = softmax(I_t)[s] - p_t[s] on the selected keys
            ds = g[:, None] * (tl.exp(score - lse_i[:, None]) - p / z[:, None])
            tl.store(ds_ptr + (b * T + rm[:, None]).to(tl.int64) * T + rn[None, :], tl.where(sel, ds, 0.0),
                     mask=mm[:, None] & (rn[None, :] < T))


_KL_CHUNK = 256  # keys per program: a query tile's key range split this finely keeps every SM busy at any T


def _kl_launch_args(q: torch.Tensor, k: torch.Tensor, d_nope: int) -> tuple[tuple[int, ...], dict, tuple[int, int, int]]:
    B, T, H, D = q.shape
    bm, bn, warps = (16, 16, 1) if TRITON_INTERPRET else (64, 64, 4)
    chunk = 32 if TRITON_INTERPRET else _KL_CHUNK
    precision = "tf32x3" if q.dtype == torch.float32 and not TRITON_INTERPRET else "ieee"
    strides = (*q.stride()[:3], *k.stride()[:3])
    meta = dict(D1=d_nope, D2=D - d_nope, BLOCK_M=bm, BLOCK_N=bn, CHUNK=chunk, PRECISION=precision,
                num_warps=warps, num_stages=2)  # fmt: skip
    return strides, meta, (triton.cdiv(T, bm), triton.cdiv(T, chunk), B)


@torch.library.custom_op("megacpp::dsa_sparse_kl", mutates_args=())
def _kl_op(q: torch.Tensor, k: torch.Tensor, lse: torch.Tensor, scores: torch.Tensor, starts: torch.Tensor,
           thr: torch.Tensor, cut: torch.Tensor, scale: float, d_nope: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    B, T, H, _ = q.shape
    strides, meta, grid = _kl_launch_args(q, k, d_nope)
    part = torch.empty(5, B, grid[1], T, device=q.device, dtype=torch.float32)  # every program writes its row
    _kl_fwd_kernel[grid](q, k, lse, scores, starts, thr, cut, part, T, H, grid[1], *strides, scale * _LOG2E, **meta)
    m_c, l_c, plogp, p_score, z = part[0], part[1], part[2].sum(1), part[3].sum(1), part[4].sum(1)
    m = m_c.amax(1)  # the chunks' online log-sum-exps of the indexer scores, merged
    m = torch.where(m == float("-inf"), 0.0, m)
    l = (l_c * torch.exp(m_c - m[:, None])).sum(1)
    lse_i = m + torch.log(torch.where(l > 0, l, 1.0))
    z_safe = torch.where(z > 0, z, 1.0)
    kl = plogp / z_safe - torch.log(z_safe) - p_score / z_safe + lse_i
    return kl, z, lse_i


@_kl_op.register_fake
def _(q, k, lse, scores, starts, thr, cut, scale, d_nope):
    B, T = q.shape[:2]
    return tuple(q.new_empty((B, T), dtype=torch.float32) for _ in range(3))


@torch.library.custom_op("megacpp::dsa_sparse_kl_bwd", mutates_args=())
def _kl_bwd_op(q: torch.Tensor, k: torch.Tensor, lse: torch.Tensor, scores: torch.Tensor, starts: torch.Tensor,
               thr: torch.Tensor, cut: torch.Tensor, z: torch.Tensor, lse_i: torch.Tensor, grad: torch.Tensor,
               scale: float, d_nope: int) -> torch.Tensor:  # fmt: skip
    B, T, H, _ = q.shape
    ds = torch.zeros(B, T, T, device=q.device, dtype=torch.float32)  # unselected keys: no gradient
    strides, meta, grid = _kl_launch_args(q, k, d_nope)
    _kl_bwd_kernel[grid](q, k, lse, scores, starts, thr, cut, z, lse_i, grad.float().contiguous(), ds, T, H, *strides,
                         scale * _LOG2E, **meta)  # fmt: skip
    return ds


@_kl_bwd_op.register_fake
def _(q, k, lse, scores, starts, thr, cut, z, lse_i, grad, scale, d_nope):
    return scores.new_empty(scores.shape)


def _kl_setup(ctx, inputs, output):
    q, k, lse, scores, starts, thr, cut, scale, d_nope = inputs
    _, z, lse_i = output
    ctx.save_for_backward(q, k, lse, scores, starts, thr, cut, z, lse_i)
    ctx.scale, ctx.d_nope = scale, d_nope


def _kl_backward(ctx, grad_kl, grad_z, grad_lse_i):
    q, k, lse, scores, starts, thr, cut, z, lse_i = ctx.saved_tensors
    ds = _kl_bwd_op(q, k, lse, scores, starts, thr, cut, z, lse_i, grad_kl, ctx.scale, ctx.d_nope)
    return None, None, None, ds, None, None, None, None, None


_kl_op.register_autograd(_kl_backward, setup_context=_kl_setup)


def sparse_kl(q: torch.Tensor, k: torch.Tensor, lse: torch.Tensor, scores: torch.Tensor, starts: torch.Tensor,
              thr: torch.Tensor, cut: torch.Tensor, scale: float, d_nope: int) -> torch.Tensor:  # fmt: skip
    """Per-query KL [B,T] over the selection (thr, cut) (module docstring), fused in Triton: q, k [B,T,H,d] with
    d = d_nope + d_rope (each a power of two >= 16: the two tl.dot pieces), lse [B,H,T] the attention's natural-log
    log-sum-exp, scores [B,T,T] fp32 (the only input it differentiates), starts [B,T]. q, k and lse are the
    target's: detached here."""
    if q.dim() != 4 or q.shape != k.shape:
        raise ValueError(f"sparse_kl: q and k must be [B,T,H,d] alike, got {tuple(q.shape)} and {tuple(k.shape)}")
    B, T, H, D = q.shape
    _check_scores(scores, starts, "sparse_kl")
    if scores.shape[0] != B or scores.shape[1] != T:
        raise ValueError(f"sparse_kl: scores must be [{B},{T},{T}], got {tuple(scores.shape)}")
    if tuple(lse.shape) != (B, H, T):
        raise ValueError(f"sparse_kl: lse must be [B,H,T] = [{B},{H},{T}], got {tuple(lse.shape)}")
    for name, n in (("d_nope", d_nope), ("d_rope", D - d_nope)):
        if n < 16 or n & (n - 1):
            raise ValueError(f"sparse_kl: {name} must be a power of two >= 16 (a tl.dot piece), got {n}")
    if q.device.type != "cuda" and not TRITON_INTERPRET:
        raise RuntimeError("sparse_kl needs CUDA tensors (or TRITON_INTERPRET=1); use sparse_kl_reference")
    if not math.isfinite(scale) or scale <= 0:
        raise ValueError(f"sparse_kl: scale must be a finite positive number, got {scale}")
    q, k = (t.detach() if t.stride(-1) == 1 else t.detach().contiguous() for t in (q, k))
    kl, _, _ = _kl_op(q, k, lse.detach().float().contiguous(), scores.contiguous(), starts.to(torch.int32).contiguous(),
                      thr.contiguous(), cut.to(torch.int32).contiguous(), float(scale), int(d_nope))  # fmt: skip
    return kl
