"""Rotary embeddings for MLA and for plain GQA attention: torch reference and Triton kernels.

One numerical contract everywhere (the reference, both kernel families, forward and backward):
a rope slice of even size d is split in halves x1 = x[:d/2], x2 = x[d/2:] and rotated as

    y1 =  x1 cos + x2 sin        backward (the transposed rotation):  dx1 = dy1 cos - dy2 sin
    y2 = -x1 sin + x2 cos                                             dx2 = dy1 sin + dy2 cos

with cos/sin tables [P, d/2] fp32 from `megacpp_lab.nn.rope_freqs.rope_cos_sin` (plain, YaRN or
piecewise frequencies all feed the same tables). Each token's table row is its position:
- "bthd": x is [B, T, H, D] (or [B*T, H, D] with seq_len=T) and the position is t;
- "thd":  x is packed [N, H, D] and `cu_seqlens` [S+1] give the documents; the position is the
  offset from the token's document start (the kernel counts the document starts at or before the
  token, or binary-searches cu_seqlens beyond COUNT_SEARCH_MAX_DOCS documents);
- explicit `positions` [N] (e.g. packed rows in bthd whose positions reset at every document).

Public calls (checked, differentiable): `mla_rope_q_`, `mla_rope_kv`, `rope_qk_`. Positions come as one of
- nothing: bthd, the position is t;
- `positions=` or `cu_seqlens=`: checked on every call (host checks for CPU tensors; device-side asserts,
  no host sync, on a GPU);
- `ctx=`, a `megacpp_lab.varlen.PackedContext` whose rows x holds: the packed thd path over its B*T
  tokens with the context's cu_seqlens, validated once when the context was built. Nothing is checked or
  derived again and nothing is read back from the device: only host metadata (shapes, device, the
  context's host max_seqlen against the table).

Kernels (`@triton.autotune`d, public so the benchmark can report the config autotune picked), each behind an
opaque custom op (`torch.library.custom_op`: no graph break under torch.compile; the ops take the positions
as given and check their values unless `validated=True`):
- MLA Q side (`mla_rope_q_kernel`, op `mla_rope_q_op`): rotates the last d_rope dims of each of H heads of
  q [*, H, d_nope+d_rope], in place; its backward rotates a copy of dq. Autotuned over BLOCK_H.
- MLA KV side (`mla_rope_kv_fwd_kernel` / `mla_rope_kv_bwd_kernel`, ops `mla_rope_kv_fwd_op` /
  `mla_rope_kv_bwd_op`): split + rope + broadcast + concat in one pass: from the up-projected
  kv [*, H, d_nope+d_v] and the single shared rope row k_pe [*, d_rope] it writes key
  [*, H, d_nope+d_rope] (the rotated row copied to every head); value is returned as a strided view of
  kv (attention reads it in place, so it is never copied). Its backward writes dkv (dk_nope and dv) and
  dk_pe (the heads' rope gradients summed, then rotated back) in one pass. It is not in place: the
  rotated row has to be broadcast into H heads, so an output buffer is written anyway. (Rotating the
  cached k_pe row in place, for decode, is the Q-side kernel with H=1.)
- Generic full-head RoPE for Q and K with GQA (`rope_qk_kernel`, op `rope_qk_op`): head counts are constexpr,
  ROPE_GROUP_SIZE heads per program share one cos/sin load, K heads beyond n_heads_k are skipped. In place.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from megacpp_lab.kernels import AUTOTUNE_CACHE, TRITON_INTERPRET
from megacpp_lab.varlen import PackedContext, check_cu_seqlens

__all__ = [
    "COUNT_SEARCH_MAX_DOCS",
    "COUNT_SEARCH_WIDTHS",
    "DOC_COUNT_ARGS",
    "ROPE_GROUP_SIZE",
    "count_search_width",
    "mla_rope_kv",
    "mla_rope_kv_bwd_kernel",
    "mla_rope_kv_bwd_op",
    "mla_rope_kv_fwd_kernel",
    "mla_rope_kv_fwd_op",
    "mla_rope_kv_reference",
    "mla_rope_q_",
    "mla_rope_q_kernel",
    "mla_rope_q_op",
    "mla_rope_q_reference",
    "rope_qk_",
    "rope_qk_kernel",
    "rope_qk_op",
    "rope_qk_reference",
    "rotate_half_split",
    "token_positions",
]

# ----------------------------------------------------------------------------- reference


def rotate_half_split(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, inverse: bool = False) -> torch.Tensor:
    """The split-half rotation of x's full last dim; cos/sin broadcast against x[..., :d/2]. fp32 math."""
    d = x.shape[-1]
    x1, x2 = x[..., : d // 2].float(), x[..., d // 2 :].float()
    s = -sin if inverse else sin
    return torch.cat((x1 * cos + x2 * s, -x1 * s + x2 * cos), dim=-1).to(x.dtype)


def token_positions(n_tokens: int, seq_len: int | None, positions: torch.Tensor | None,
                    cu_seqlens: torch.Tensor | None, device: torch.device) -> torch.Tensor:  # fmt: skip
    """The table row of each of n_tokens flattened tokens, by the same rule as the kernels."""
    if positions is not None:
        return positions.reshape(-1).long()
    idx = torch.arange(n_tokens, device=device)
    if cu_seqlens is not None:
        doc = torch.searchsorted(cu_seqlens.long(), idx, right=True) - 1
        return idx - cu_seqlens.long()[doc]
    return idx % seq_len


def mla_rope_q_reference(q: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, d_nope: int, *,
                         positions: torch.Tensor | None = None, cu_seqlens: torch.Tensor | None = None,
                         inverse: bool = False) -> torch.Tensor:  # fmt: skip
    """Split q [..., H, d_nope + d_rope] into nope and rope parts, rotate the rope part, concat. Out of place."""
    shape = q.shape
    flat = q.reshape(-1, shape[-2], shape[-1])
    seq_len = shape[1] if q.dim() == 4 else None
    pos = token_positions(flat.shape[0], seq_len, positions, cu_seqlens, q.device)
    c, s = cos[pos][:, None, :], sin[pos][:, None, :]
    rope = rotate_half_split(flat[..., d_nope:], c, s, inverse=inverse)
    return torch.cat((flat[..., :d_nope], rope), dim=-1).reshape(shape)


def mla_rope_kv_reference(kv: torch.Tensor, k_pe: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, d_nope: int, *,
                          positions: torch.Tensor | None = None,
                          cu_seqlens: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """key = cat(kv[..., :d_nope], rope(k_pe) broadcast over heads), value = kv[..., d_nope:]."""
    shape = kv.shape
    H = shape[-2]
    flat = kv.reshape(-1, H, shape[-1])
    seq_len = shape[1] if kv.dim() == 4 else None
    pos = token_positions(flat.shape[0], seq_len, positions, cu_seqlens, kv.device)
    pe = rotate_half_split(k_pe.reshape(flat.shape[0], -1), cos[pos], sin[pos])
    key = torch.cat((flat[..., :d_nope], pe[:, None, :].expand(-1, H, -1)), dim=-1)
    return key.reshape(*shape[:-1], -1), flat[..., d_nope:].reshape(*shape[:-1], -1)


def rope_qk_reference(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *,
                      positions: torch.Tensor | None = None, cu_seqlens: torch.Tensor | None = None,
                      inverse: bool = False) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """Full-head rotation of q [..., Hq, D] and k [..., Hk, D]. Out of place."""
    return (mla_rope_q_reference(q, cos, sin, 0, positions=positions, cu_seqlens=cu_seqlens, inverse=inverse),
            mla_rope_q_reference(k, cos, sin, 0, positions=positions, cu_seqlens=cu_seqlens, inverse=inverse))  # fmt: skip


# ----------------------------------------------------------------------------- kernels

# Every batch has another number of documents. Triton would compile a new binary per value class of an int
# argument (== 1, divisible by 16) and per constexpr, so a training run with varying document counts paid a
# compile (~0.25 s per kernel) on most new counts. n_seqs is left unspecialised and the count width is one of
# three buckets: at most 3 binaries per kernel and mode for any number of documents up to COUNT_SEARCH_MAX_DOCS.
DOC_COUNT_ARGS = ("n_seqs",)
COUNT_SEARCH_WIDTHS = (16, 128, 512)


def count_search_width(n_seqs: int) -> int:
    """The vector width with which the thd kernels count document starts: the smallest bucket >= n_seqs."""
    return next((w for w in COUNT_SEARCH_WIDTHS if n_seqs <= w), COUNT_SEARCH_WIDTHS[-1])



@triton.jit
def _token_position(n, pos_ptr, cu_ptr, n_seqs, seq_len, POS_MODE: tl.constexpr, SEARCH: tl.constexpr):
    if POS_MODE == 0:  # bthd: the token's index within its row
        return n % seq_len
    elif POS_MODE == 1:  # thd, few documents: count the document starts <= n in SEARCH-wide vector loads
        count = tl.zeros((), dtype=tl.int32)
        for s0 in range(1, n_seqs, SEARCH):  # independent loads: one memory latency, not log2(S) in a row
            rs = s0 + tl.arange(0, SEARCH)
            starts = tl.load(cu_ptr + rs, mask=rs < n_seqs, other=2147483647)
            count += tl.sum((starts <= n).to(tl.int32))
        return n - tl.load(cu_ptr + count)
    elif POS_MODE == 3:  # thd, many documents: binary search, SEARCH steps
        lo = 0
        hi = n_seqs - 1
        for _ in tl.static_range(SEARCH):
            mid = (lo + hi + 1) // 2
            go_right = tl.load(cu_ptr + mid) <= n
            lo = tl.where(go_right, mid, lo)
            hi = tl.where(go_right, hi, mid - 1)
        return n - tl.load(cu_ptr + lo)
    else:  # explicit positions
        return tl.load(pos_ptr + n)


@triton.jit
def _rotate(x1, x2, c, s, BACKWARD: tl.constexpr):
    if BACKWARD:  # the transposed rotation
        return x1 * c - x2 * s, x1 * s + x2 * c
    return x1 * c + x2 * s, x2 * c - x1 * s


def _head_configs() -> list[triton.Config]:
    if TRITON_INTERPRET:  # the interpreter cannot benchmark: one small config (masking still exercised)
        return [triton.Config({"BLOCK_H": 2}, num_warps=1)]
    # the winners of the H100 and H200 sweeps over BLOCK_H 1..128 x warps 1, 2, 4 at the bench shapes
    # (profiles/<device>/mla/mla_rope_kernels.json: BLOCK_H 64 with 1, 2 or 4 warps, or 32 with 1 for the packed
    # layout). Each config is one Triton compile in every process that autotunes: 22 of them cost seconds of
    # every cold start, eager and again inside each compiled graph that calls the kernel.
    return [triton.Config({"BLOCK_H": bh}, num_warps=w) for bh, w in ((32, 1), (64, 1), (64, 2), (64, 4))]


@triton.autotune(configs=_head_configs(), key=["H", "D_NOPE", "D_ROPE", "POS_MODE"], restore_value=["x_ptr"],
                 **AUTOTUNE_CACHE)
@triton.jit(do_not_specialize=DOC_COUNT_ARGS)
def mla_rope_q_kernel(
    x_ptr, cos_ptr, sin_ptr, pos_ptr, cu_ptr, n_seqs, seq_len, stride_n, stride_h, H,
    D_NOPE: tl.constexpr, D_ROPE: tl.constexpr, POS_MODE: tl.constexpr, SEARCH: tl.constexpr,
    BACKWARD: tl.constexpr, BLOCK_H: tl.constexpr,
):  # fmt: skip
    n = tl.program_id(0).to(tl.int64)
    HALF: tl.constexpr = D_ROPE // 2
    ri = tl.arange(0, HALF)
    rh = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask = (rh < H)[:, None]
    p1 = x_ptr + n * stride_n + rh[:, None] * stride_h + D_NOPE + ri[None, :]
    # the HBM loads go out first; the position lookup (a loop for thd) and the table loads overlap them
    x1 = tl.load(p1, mask=mask).to(tl.float32)
    x2 = tl.load(p1 + HALF, mask=mask).to(tl.float32)
    pos = _token_position(n, pos_ptr, cu_ptr, n_seqs, seq_len, POS_MODE, SEARCH)
    c = tl.load(cos_ptr + pos * HALF + ri)[None, :]
    s = tl.load(sin_ptr + pos * HALF + ri)[None, :]
    y1, y2 = _rotate(x1, x2, c, s, BACKWARD)
    tl.store(p1, y1.to(x_ptr.dtype.element_ty), mask=mask)
    tl.store(p1 + HALF, y2.to(x_ptr.dtype.element_ty), mask=mask)


def _kv_fwd_configs() -> list[triton.Config]:
    if TRITON_INTERPRET:
        return [triton.Config({"BLOCK_H": 2, "BLOCK_N": 2}, num_warps=1)]
    # H100 sweep (bench shape, CUDA-graph timing): one token per program and wide head blocks win; 2 or 4
    # tokens per program, or 8-head blocks, were 2-15% slower. BLOCK_N stays a parameter (and its masks,
    # which this sweep measured as part of the fastest variant); the interpreter runs BLOCK_N=2.
    # The mla bench's winner on the H100 and the H200 was BLOCK_H 64 with 8 warps; 32 with 4 for fewer heads.
    return [triton.Config({"BLOCK_H": bh, "BLOCK_N": 1}, num_warps=w) for bh, w in ((32, 4), (64, 8))]


@triton.autotune(configs=_kv_fwd_configs(), key=["H", "D_NOPE", "D_V", "D_ROPE", "POS_MODE"], **AUTOTUNE_CACHE)
@triton.jit(do_not_specialize=DOC_COUNT_ARGS)
def mla_rope_kv_fwd_kernel(
    kv_ptr, kpe_ptr, cos_ptr, sin_ptr, pos_ptr, cu_ptr, k_ptr, N, n_seqs, seq_len, stride_kpe, H,
    D_NOPE: tl.constexpr, D_V: tl.constexpr, D_ROPE: tl.constexpr, POS_MODE: tl.constexpr,
    SEARCH: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    # one program per (BLOCK_N tokens, block of BLOCK_H heads)
    HALF: tl.constexpr = D_ROPE // 2
    DKV: tl.constexpr = D_NOPE + D_V
    DK: tl.constexpr = D_NOPE + D_ROPE
    rh = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    rn = tl.arange(0, D_NOPE)
    ri = tl.arange(0, HALF)
    for i in tl.static_range(BLOCK_N):
        n = tl.program_id(0).to(tl.int64) * BLOCK_N + i
        live = (n + 0 * ri) < N  # as a vector: the interpreter rejects a scalar bool in a mask
        mask = (rh < H)[:, None] & (n + 0 * rn < N)[None, :]
        dst = k_ptr + n * H * DK + rh[:, None] * DK
        # the bulk copy's loads go out first; the rope row's chain (position, tables, k_pe) overlaps them
        k_nope = tl.load(kv_ptr + n * H * DKV + rh[:, None] * DKV + rn[None, :], mask=mask, eviction_policy="evict_first")
        x1 = tl.load(kpe_ptr + n * stride_kpe + ri, mask=live, other=0.0).to(tl.float32)
        x2 = tl.load(kpe_ptr + n * stride_kpe + HALF + ri, mask=live, other=0.0).to(tl.float32)
        pos = _token_position(tl.minimum(n, N - 1), pos_ptr, cu_ptr, n_seqs, seq_len, POS_MODE, SEARCH)
        c = tl.load(cos_ptr + pos * HALF + ri)
        s = tl.load(sin_ptr + pos * HALF + ri)
        y1, y2 = _rotate(x1, x2, c, s, False)  # the one shared row, rotated once per program
        # [y1 | y2] as one row, so each head gets one contiguous D_ROPE store
        row = tl.reshape(tl.permute(tl.join(y1, y2), (1, 0)), (D_ROPE,)).to(k_ptr.dtype.element_ty)[None, :]
        tl.store(dst + rn[None, :], k_nope, mask=mask)
        rr = tl.arange(0, D_ROPE)
        mask_r = (rh < H)[:, None] & (n + 0 * rr < N)[None, :]
        tl.store(dst + D_NOPE + rr[None, :], tl.broadcast_to(row, (BLOCK_H, D_ROPE)), mask=mask_r)


@triton.autotune(configs=_head_configs(), key=["H", "D_NOPE", "D_V", "D_ROPE", "POS_MODE"], **AUTOTUNE_CACHE)
@triton.jit(do_not_specialize=DOC_COUNT_ARGS)
def mla_rope_kv_bwd_kernel(
    dk_ptr, dv_ptr, cos_ptr, sin_ptr, pos_ptr, cu_ptr, dkv_ptr, dkpe_ptr, n_seqs, seq_len, H,
    D_NOPE: tl.constexpr, D_V: tl.constexpr, D_ROPE: tl.constexpr, POS_MODE: tl.constexpr,
    SEARCH: tl.constexpr, BLOCK_H: tl.constexpr,
):  # fmt: skip
    n = tl.program_id(0).to(tl.int64)
    HALF: tl.constexpr = D_ROPE // 2
    DKV: tl.constexpr = D_NOPE + D_V
    DK: tl.constexpr = D_NOPE + D_ROPE
    ri = tl.arange(0, HALF)
    rn = tl.arange(0, D_NOPE)
    rv = tl.arange(0, D_V)
    g1 = tl.zeros((HALF,), dtype=tl.float32)
    g2 = tl.zeros((HALF,), dtype=tl.float32)
    for h0 in range(0, H, BLOCK_H):
        rh = h0 + tl.arange(0, BLOCK_H)
        mask = (rh < H)[:, None]
        src = dk_ptr + n * H * DK + rh[:, None] * DK
        dst = dkv_ptr + n * H * DKV + rh[:, None] * DKV
        tl.store(dst + rn[None, :], tl.load(src + rn[None, :], mask=mask), mask=mask)
        tl.store(dst + D_NOPE + rv[None, :], tl.load(dv_ptr + n * H * D_V + rh[:, None] * D_V + rv[None, :], mask=mask), mask=mask)
        g1 += tl.sum(tl.load(src + D_NOPE + ri[None, :], mask=mask, other=0.0).to(tl.float32), axis=0)
        g2 += tl.sum(tl.load(src + D_NOPE + HALF + ri[None, :], mask=mask, other=0.0).to(tl.float32), axis=0)
    # the rope row was shared by every head: its gradient is the heads' sum, rotated back
    pos = _token_position(n, pos_ptr, cu_ptr, n_seqs, seq_len, POS_MODE, SEARCH)
    c = tl.load(cos_ptr + pos * HALF + ri)
    s = tl.load(sin_ptr + pos * HALF + ri)
    d1, d2 = _rotate(g1, g2, c, s, True)
    tl.store(dkpe_ptr + n * D_ROPE + ri, d1.to(dkpe_ptr.dtype.element_ty))
    tl.store(dkpe_ptr + n * D_ROPE + HALF + ri, d2.to(dkpe_ptr.dtype.element_ty))


@triton.autotune(
    configs=[triton.Config({}, num_warps=w) for w in ((1,) if TRITON_INTERPRET else (1, 2, 4, 8))],
    key=["N_HEADS_Q", "N_HEADS_K", "D", "ROPE_GROUP_SIZE", "POS_MODE"],
    restore_value=["q_ptr", "k_ptr"],
    **AUTOTUNE_CACHE,
)
@triton.jit(do_not_specialize=DOC_COUNT_ARGS)
def rope_qk_kernel(
    q_ptr, k_ptr, cos_ptr, sin_ptr, pos_ptr, cu_ptr, n_seqs, seq_len,
    N_HEADS_Q: tl.constexpr, N_HEADS_K: tl.constexpr, D: tl.constexpr, ROPE_GROUP_SIZE: tl.constexpr,
    POS_MODE: tl.constexpr, SEARCH: tl.constexpr, BACKWARD: tl.constexpr,
):  # fmt: skip
    n = tl.program_id(0).to(tl.int64)
    HALF: tl.constexpr = D // 2
    pos = _token_position(n, pos_ptr, cu_ptr, n_seqs, seq_len, POS_MODE, SEARCH)
    ri = tl.arange(0, HALF)
    c = tl.load(cos_ptr + pos * HALF + ri)[None, :]  # one cos/sin load for ROPE_GROUP_SIZE heads
    s = tl.load(sin_ptr + pos * HALF + ri)[None, :]
    rh = tl.program_id(1) * ROPE_GROUP_SIZE + tl.arange(0, ROPE_GROUP_SIZE)
    mq = (rh < N_HEADS_Q)[:, None]
    pq = q_ptr + n * N_HEADS_Q * D + rh[:, None] * D + ri[None, :]
    y1, y2 = _rotate(tl.load(pq, mask=mq).to(tl.float32), tl.load(pq + HALF, mask=mq).to(tl.float32), c, s, BACKWARD)
    tl.store(pq, y1.to(q_ptr.dtype.element_ty), mask=mq)
    tl.store(pq + HALF, y2.to(q_ptr.dtype.element_ty), mask=mq)
    if tl.program_id(1) * ROPE_GROUP_SIZE < N_HEADS_K:  # GQA: fewer K heads; the rest of the grid skips K
        mk = (rh < N_HEADS_K)[:, None]
        pk = k_ptr + n * N_HEADS_K * D + rh[:, None] * D + ri[None, :]
        z1, z2 = _rotate(tl.load(pk, mask=mk).to(tl.float32), tl.load(pk + HALF, mask=mk).to(tl.float32), c, s, BACKWARD)
        tl.store(pk, z1.to(k_ptr.dtype.element_ty), mask=mk)
        tl.store(pk + HALF, z2.to(k_ptr.dtype.element_ty), mask=mk)


# ----------------------------------------------------------------------------- launchers and checks
# Who checks what. The public calls (mla_rope_q_, mla_rope_kv, rope_qk_) check shapes, dtypes, devices and the
# cos/sin tables (host metadata: cheap, no sync) and hand the positions to the ops. The ops check their values
# unless told `validated=True`: on CPU tensors on the host (a ValueError naming the offset), on CUDA tensors as
# device-side asserts (a few tiny kernels, no host sync). A PackedContext was validated when it was built
# (megacpp_lab.varlen.build_context), so a call given ctx= passes validated=True: no value check at all, no
# sync, nothing re-derived (its device cu_seqlens are used as they are, its host max_seqlen bounds the
# documents against the table). A backward reuses what its forward checked, so it passes validated=True too.

COUNT_SEARCH_MAX_DOCS = 2048  # thd: up to this many documents, count starts; beyond, binary search
ROPE_GROUP_SIZE = 4  # heads per program in the generic kernel, sharing one cos/sin load
_ID_DTYPES = (torch.int32, torch.int64)


def _check_position_values(positions: torch.Tensor, table_len: int) -> None:
    """positions [N] within the cos/sin table: a named ValueError on the host for CPU tensors, a device assert
    (no sync) on a GPU."""
    if positions.device.type != "cpu":
        torch._assert_async(((positions >= 0) & (positions < table_len)).all(), "positions outside the cos/sin table")
        return
    bad = (positions < 0) | (positions >= table_len)
    if positions.numel() and bool(bad.any()):
        i = int(bad.nonzero()[0, 0])
        raise ValueError(f"positions[{i}] = {int(positions[i])} is outside the cos/sin table [0, {table_len})")


def _check_document_lengths(cu_seqlens: torch.Tensor, table_len: int) -> None:
    """Every document of (checked) cu_seqlens within the cos/sin table: a named ValueError on the host for CPU
    tensors, a device assert (no sync) on a GPU."""
    lens = cu_seqlens[1:] - cu_seqlens[:-1]
    if cu_seqlens.device.type != "cpu":
        torch._assert_async((lens <= table_len).all(), "a document is longer than the cos/sin table")
        return
    if int(lens.max()) > table_len:
        raise ValueError(f"a document of {int(lens.max())} tokens is longer than the cos/sin table ({table_len} rows)")


def _pos_args(n_tokens: int, seq_len: int | None, positions: torch.Tensor | None, cu_seqlens: torch.Tensor | None,
              table: torch.Tensor, validated: bool) -> tuple[int, torch.Tensor, torch.Tensor, int, int, int]:  # fmt: skip
    """(POS_MODE, pos_ptr, cu_ptr, n_seqs, seq_len, SEARCH) for a launch; fails closed on bad input.

    table is the cos table: its length bounds the positions, its device is the input's. Structural checks
    (dtype, shape, device) always run. The value checks run unless validated=True. No allocation: a pointer
    the mode never reads is given an input tensor that is already there."""
    device, table_len = table.device, table.shape[0]
    if positions is not None and cu_seqlens is not None:
        raise ValueError("give positions or cu_seqlens, not both")
    if positions is not None:
        if positions.numel() != n_tokens or positions.dtype not in _ID_DTYPES:
            raise ValueError(f"positions must be int32/int64 with {n_tokens} entries, got {positions.dtype} {tuple(positions.shape)}")
        # one entry a token, in the input's token order: [N], or [B, T] beside a [B, T, H, D] input (a [T, B]
        # transpose has as many entries and once rotated every token by another's position)
        if not (positions.dim() == 1 or (seq_len is not None and positions.dim() == 2 and positions.shape[1] == seq_len)):
            rows = f"[{n_tokens}]" + (f" or [{n_tokens // seq_len}, {seq_len}]" if seq_len else "")
            raise ValueError(f"positions must be {rows} (one entry a token, in the input's order), got "
                             f"{tuple(positions.shape)}")  # fmt: skip
        if positions.device != device:
            raise ValueError(f"positions are on {positions.device}, the input on {device}")
        pos = positions.reshape(-1)
        if not pos.is_contiguous():  # the kernel indexes it by pointer arithmetic
            pos = pos.contiguous()
        if not validated:
            _check_position_values(pos, table_len)
        return 2, pos, pos, 1, 1, 1
    if cu_seqlens is not None:
        check_cu_seqlens(cu_seqlens, n_tokens, device=device, values=not validated)  # the structure always
        cu = cu_seqlens if cu_seqlens.is_contiguous() else cu_seqlens.contiguous()
        if not validated:
            _check_document_lengths(cu, table_len)
        n_seqs = cu.numel() - 1
        if n_seqs <= COUNT_SEARCH_MAX_DOCS:
            return 1, cu, cu, n_seqs, 1, count_search_width(n_seqs)
        return 3, cu, cu, n_seqs, 1, (n_seqs - 1).bit_length()
    if seq_len is None:
        raise ValueError("a packed [N, H, D] input needs cu_seqlens or positions, or ctx (bthd inputs are [B, T, H, D])")
    if seq_len > table_len:
        raise ValueError(f"seq_len {seq_len} is longer than the cos/sin table ({table_len} rows)")
    return 0, table, table, 1, seq_len, 1


def _check_tables(cos: torch.Tensor, sin: torch.Tensor, d: int, device: torch.device, what: str = "d_rope") -> None:
    if d < 2 or d % 2:
        raise ValueError(f"{what} must be even and >= 2, got {d}")
    if (d // 2) & (d // 2 - 1):
        raise ValueError(f"{what} / 2 must be a power of two for the kernel, got {d // 2}")
    for name, t in (("cos", cos), ("sin", sin)):
        if t.dim() != 2 or t.shape[1] != d // 2 or t.dtype != torch.float32 or not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous float32 [P, {d // 2}], got {t.dtype} {tuple(t.shape)}")
        if t.device != device:
            raise ValueError(f"{name} is on {t.device}, the input on {device}")
    if sin.shape[0] != cos.shape[0]:
        raise ValueError(f"cos and sin must have the same rows, got {cos.shape[0]} and {sin.shape[0]}")


def _check_heads(name: str, x: torch.Tensor, last: int) -> None:
    if x.dim() not in (3, 4) or x.shape[-1] != last:
        raise ValueError(f"{name} must be [B, T, H, {last}] or packed [N, H, {last}], got {tuple(x.shape)}")
    if x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"{name} must be float32, bfloat16 or float16, got {x.dtype}")
    if x.stride(-1) != 1:
        raise ValueError(f"{name} must have a contiguous last dim, got strides {x.stride()}")


def _tokens_view(name: str, x: torch.Tensor) -> torch.Tensor:
    """x as [N, H, D] without a copy (the kernels write in place), or a ValueError."""
    if x.dim() == 3:
        return x
    try:
        return x.view(-1, x.shape[-2], x.shape[-1])
    except RuntimeError:
        raise ValueError(f"{name} must flatten to [B*T, H, D] without a copy, got strides {x.stride()}") from None


def _context_positions(name: str, x: torch.Tensor, positions: torch.Tensor | None, cu_seqlens: torch.Tensor | None,
                       ctx: PackedContext | None, table_len: int) -> tuple[torch.Tensor | None, torch.Tensor | None, bool]:  # fmt: skip
    """(positions, cu_seqlens, validated) of a public call. With ctx: the context's device cu_seqlens (the
    packed thd path over its B*T flattened tokens), validated when it was built, so no value is read back.
    What is checked here is host metadata only: x's tokens are the context's, the device, and the longest
    document (the context's host max_seqlen) against the table."""
    if ctx is None:
        return positions, cu_seqlens, False
    if positions is not None or cu_seqlens is not None:
        raise ValueError("give ctx, or positions / cu_seqlens, not both")
    if not isinstance(ctx, PackedContext):
        raise ValueError(f"ctx must be a PackedContext (megacpp_lab.varlen.build_context), got {type(ctx).__name__}")
    B, T = ctx.shape
    if (tuple(x.shape[:2]) != (B, T)) if x.dim() == 4 else (x.shape[0] != B * T):
        raise ValueError(f"{name} {tuple(x.shape)} does not hold the context's tokens: [B, T] = {(B, T)}, B*T = {B * T}")
    if ctx.cu_seqlens.device != x.device:
        raise ValueError(f"ctx is on {ctx.cu_seqlens.device}, {name} on {x.device}")
    if T <= table_len:  # no document is longer than its row
        return None, ctx.cu_seqlens, True
    if torch.compiler.is_compiling():  # reading max_seqlen here would guard (and recompile) on it: the op checks
        return None, ctx.cu_seqlens, False
    if ctx.max_seqlen > table_len:
        raise ValueError(f"a document of {ctx.max_seqlen} tokens is longer than the cos/sin table ({table_len} rows)")
    return None, ctx.cu_seqlens, True


# ----------------------------------------------------------------------------- ops and public calls


def _launch_mla_rope_q(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor | None,
                       cu_seqlens: torch.Tensor | None, d_nope: int, backward: bool, validated: bool) -> None:  # fmt: skip
    d_rope = x.shape[-1] - d_nope
    _check_tables(cos, sin, d_rope, x.device)
    flat = _tokens_view("q", x)
    N, H = flat.shape[0], flat.shape[1]
    mode, pos, cu, n_seqs, seq_len, steps = _pos_args(N, x.shape[1] if x.dim() == 4 else None, positions, cu_seqlens,
                                                      cos, validated)  # fmt: skip
    grid = lambda meta: (N, triton.cdiv(H, meta["BLOCK_H"]))  # noqa: E731
    mla_rope_q_kernel[grid](
        flat, cos, sin, pos, cu, n_seqs, seq_len, flat.stride(0), flat.stride(1), H,
        D_NOPE=d_nope, D_ROPE=d_rope, POS_MODE=mode, SEARCH=steps, BACKWARD=backward,
    )  # fmt: skip


@torch.library.custom_op("megacpp::mla_rope_q_", mutates_args={"x"})
def mla_rope_q_op(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor | None,
                  cu_seqlens: torch.Tensor | None, d_nope: int, backward: bool, validated: bool = False) -> None:  # fmt: skip
    """The Q-side kernel as an opaque op (no autograd): rotates x's last D - d_nope dims in place
    (backward=True: the transposed rotation). validated=True skips the value checks of positions / cu_seqlens."""
    _launch_mla_rope_q(x, cos, sin, positions, cu_seqlens, d_nope, backward, validated)


@mla_rope_q_op.register_fake
def _(x, cos, sin, positions, cu_seqlens, d_nope, backward, validated=False):
    return None


class _MLARopeQ(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, cos, sin, positions, cu_seqlens, d_nope, validated):
        mla_rope_q_op(q, cos, sin, positions, cu_seqlens, d_nope, False, validated)
        ctx.mark_dirty(q)
        ctx.save_for_backward(cos, sin, positions, cu_seqlens)
        ctx.d_nope = d_nope
        return q

    @staticmethod
    def backward(ctx, dq):
        cos, sin, positions, cu_seqlens = ctx.saved_tensors
        # a fresh buffer, rotated in place: the incoming gradient may be shared with another branch (the
        # residual's, when the output was added to something) and must not be changed under it
        dq = dq.clone(memory_format=torch.contiguous_format)
        mla_rope_q_op(dq, cos, sin, positions, cu_seqlens, ctx.d_nope, True, True)  # checked in the forward
        return dq, None, None, None, None, None, None


def mla_rope_q_(q: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, d_nope: int, *,
                positions: torch.Tensor | None = None, cu_seqlens: torch.Tensor | None = None,
                ctx: PackedContext | None = None) -> torch.Tensor:  # fmt: skip
    """Rotate the last d_rope = D - d_nope dims of every head of q [B,T,H,D] (or packed [N,H,D]) in place.

    Positions: t in bthd; `positions` [N]; `cu_seqlens` [S+1] (packed thd, checked here); or `ctx`, a
    PackedContext, whose rows q holds (packed thd over its B*T tokens, validated once when it was built: no
    value check, no host sync). Differentiable; the backward rotates a copy of the incoming gradient."""
    _check_heads("q", q, q.shape[-1] if q.dim() in (3, 4) else -1)
    if not 0 <= d_nope < q.shape[-1]:
        raise ValueError(f"d_nope must be in [0, {q.shape[-1]}), got {d_nope}")
    positions, cu_seqlens, validated = _context_positions("q", q, positions, cu_seqlens, ctx, cos.shape[0])
    if not (torch.is_grad_enabled() and q.requires_grad):  # no autograd node (dynamo traces mark_dirty only under grad)
        mla_rope_q_op(q, cos, sin, positions, cu_seqlens, d_nope, False, validated)
        return q
    return _MLARopeQ.apply(q, cos, sin, positions, cu_seqlens, d_nope, validated)


@torch.library.custom_op("megacpp::mla_rope_kv_fwd", mutates_args=())
def mla_rope_kv_fwd_op(kv: torch.Tensor, k_pe: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                       positions: torch.Tensor | None, cu_seqlens: torch.Tensor | None, seq_len: int,
                       d_nope: int, validated: bool = False) -> torch.Tensor:  # fmt: skip
    """The KV-side forward kernel as an opaque op: key [N, H, d_nope + d_rope] from a contiguous kv [N, H,
    d_nope + d_v] and k_pe [N, d_rope] (seq_len: the bthd row length, 0 for thd)."""
    N, H, DKV = kv.shape
    d_rope = k_pe.shape[-1]
    key = kv.new_empty((N, H, d_nope + d_rope))
    mode, pos, cu, n_seqs, sl, steps = _pos_args(N, seq_len or None, positions, cu_seqlens, cos, validated)
    grid = lambda meta: (triton.cdiv(N, meta["BLOCK_N"]), triton.cdiv(H, meta["BLOCK_H"]))  # noqa: E731
    mla_rope_kv_fwd_kernel[grid](
        kv, k_pe, cos, sin, pos, cu, key, N, n_seqs, sl, k_pe.stride(0), H,
        D_NOPE=d_nope, D_V=DKV - d_nope, D_ROPE=d_rope, POS_MODE=mode, SEARCH=steps,
    )  # fmt: skip
    return key


@mla_rope_kv_fwd_op.register_fake
def _(kv, k_pe, cos, sin, positions, cu_seqlens, seq_len, d_nope, validated=False):
    N, H, DKV = kv.shape
    return kv.new_empty((N, H, d_nope + k_pe.shape[-1]))


@torch.library.custom_op("megacpp::mla_rope_kv_bwd", mutates_args=())
def mla_rope_kv_bwd_op(dkey: torch.Tensor, dvalue: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                       positions: torch.Tensor | None, cu_seqlens: torch.Tensor | None, seq_len: int,
                       d_nope: int, kpe_dtype: torch.dtype, validated: bool = False) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """The KV-side backward kernel as an opaque op: (dkv, dk_pe) from dkey and dvalue."""
    N, H, DK = dkey.shape
    d_rope, d_v = DK - d_nope, dvalue.shape[-1]
    dkey, dvalue = dkey.contiguous(), dvalue.contiguous()  # no-ops when they already are
    dkv = dkey.new_empty((N, H, d_nope + d_v))
    dkpe = torch.empty((N, d_rope), device=dkey.device, dtype=kpe_dtype)
    mode, pos, cu, n_seqs, sl, steps = _pos_args(N, seq_len or None, positions, cu_seqlens, cos, validated)
    mla_rope_kv_bwd_kernel[(N,)](
        dkey, dvalue, cos, sin, pos, cu, dkv, dkpe, n_seqs, sl, H,
        D_NOPE=d_nope, D_V=d_v, D_ROPE=d_rope, POS_MODE=mode, SEARCH=steps,
    )  # fmt: skip
    return dkv, dkpe


@mla_rope_kv_bwd_op.register_fake
def _(dkey, dvalue, cos, sin, positions, cu_seqlens, seq_len, d_nope, kpe_dtype, validated=False):
    N, H, DK = dkey.shape
    return dkey.new_empty((N, H, d_nope + dvalue.shape[-1])), dkey.new_empty((N, DK - d_nope), dtype=kpe_dtype)


class _MLARopeKV(torch.autograd.Function):
    """key from the kernel; value is a view of kv (attention reads it strided), so it is never copied.
    The backward kernel writes the whole dkv (dk_nope and dv) and dk_pe in one pass."""

    @staticmethod
    def forward(ctx, kv, k_pe, cos, sin, positions, cu_seqlens, seq_len, d_nope, validated):
        key = mla_rope_kv_fwd_op(kv, k_pe, cos, sin, positions, cu_seqlens, seq_len, d_nope, validated)
        ctx.save_for_backward(cos, sin, positions, cu_seqlens)
        ctx.seq_len, ctx.d_nope, ctx.kpe_dtype = seq_len, d_nope, k_pe.dtype
        return key, kv[..., d_nope:]

    @staticmethod
    def backward(ctx, dkey, dvalue):
        cos, sin, positions, cu_seqlens = ctx.saved_tensors
        dkv, dkpe = mla_rope_kv_bwd_op(dkey, dvalue, cos, sin, positions, cu_seqlens, ctx.seq_len, ctx.d_nope,
                                       ctx.kpe_dtype, True)  # checked in the forward  # fmt: skip
        return dkv, dkpe, None, None, None, None, None, None, None


def mla_rope_kv(kv: torch.Tensor, k_pe: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, d_nope: int, *,
                positions: torch.Tensor | None = None, cu_seqlens: torch.Tensor | None = None,
                ctx: PackedContext | None = None) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """(key, value) from the up-projected kv [B,T,H,d_nope+d_v] (or packed [N,H,...]) and the shared rope
    row k_pe [B,T,d_rope] (or [N,d_rope]; a strided slice of the down-projection is fine): key =
    cat(kv[..., :d_nope], rope(k_pe) on every head), value = kv[..., d_nope:]. One pass, differentiable.
    Positions as for mla_rope_q_ (ctx: a validated PackedContext, no value check, no host sync)."""
    _check_heads("kv", kv, kv.shape[-1] if kv.dim() in (3, 4) else -1)
    d_rope = k_pe.shape[-1]
    _check_tables(cos, sin, d_rope, kv.device)
    if not 0 < d_nope < kv.shape[-1]:
        raise ValueError(f"d_nope must be in (0, {kv.shape[-1]}), got {d_nope}")
    if tuple(k_pe.shape[:-1]) != tuple(kv.shape[:-2]) or k_pe.stride(-1) != 1:
        raise ValueError(f"k_pe must be {tuple(kv.shape[:-2])} + (d_rope,) with a contiguous last dim, got {tuple(k_pe.shape)}")
    if k_pe.device != kv.device:
        raise ValueError(f"k_pe is on {k_pe.device}, kv on {kv.device}")
    for name, d in (("d_nope", d_nope), ("d_v", kv.shape[-1] - d_nope)):
        if d & (d - 1):
            raise ValueError(f"{name} must be a power of two for the kernel, got {d}")
    positions, cu_seqlens, validated = _context_positions("kv", kv, positions, cu_seqlens, ctx, cos.shape[0])
    shape = kv.shape
    flat = kv.reshape(-1, shape[-2], shape[-1])
    if not flat.is_contiguous():  # the kernel reads kv by token and head: a copy only when it is strided
        flat = flat.contiguous()
    pe = k_pe.reshape(-1, d_rope)  # a view for a strided slice of the down-projection (rows of any stride)
    key, value = _MLARopeKV.apply(flat, pe, cos, sin, positions, cu_seqlens, shape[1] if kv.dim() == 4 else 0, d_nope, validated)
    return key.view(*shape[:-1], -1), value.view(*shape[:-1], -1)


@torch.library.custom_op("megacpp::rope_qk_", mutates_args={"q", "k"})
def rope_qk_op(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor | None,
               cu_seqlens: torch.Tensor | None, seq_len: int, backward: bool, validated: bool = False) -> None:  # fmt: skip
    """The generic full-head kernel as an opaque op: rotates contiguous q and k in place (seq_len: the bthd
    row length, 0 for thd)."""
    q, k = _tokens_view("q", q), _tokens_view("k", k)
    N, HQ, D = q.shape
    mode, pos, cu, n_seqs, sl, steps = _pos_args(N, seq_len or None, positions, cu_seqlens, cos, validated)
    rope_qk_kernel[(N, triton.cdiv(HQ, ROPE_GROUP_SIZE))](
        q, k, cos, sin, pos, cu, n_seqs, sl, N_HEADS_Q=HQ, N_HEADS_K=k.shape[1], D=D,
        ROPE_GROUP_SIZE=ROPE_GROUP_SIZE, POS_MODE=mode, SEARCH=steps, BACKWARD=backward,
    )  # fmt: skip


@rope_qk_op.register_fake
def _(q, k, cos, sin, positions, cu_seqlens, seq_len, backward, validated=False):
    return None


class _RopeQK(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, cos, sin, positions, cu_seqlens, seq_len, validated):
        rope_qk_op(q, k, cos, sin, positions, cu_seqlens, seq_len, False, validated)
        ctx.mark_dirty(q, k)
        ctx.save_for_backward(cos, sin, positions, cu_seqlens)
        ctx.seq_len = seq_len
        return q, k

    @staticmethod
    def backward(ctx, dq, dk):
        cos, sin, positions, cu_seqlens = ctx.saved_tensors
        # fresh buffers: an incoming gradient may be shared (q + k hands both the same tensor) and must not
        # be rotated under its other users, or twice
        dq, dk = dq.clone(memory_format=torch.contiguous_format), dk.clone(memory_format=torch.contiguous_format)
        rope_qk_op(dq, dk, cos, sin, positions, cu_seqlens, ctx.seq_len, True, True)  # checked in the forward
        return dq, dk, None, None, None, None, None, None


def rope_qk_(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *,
             positions: torch.Tensor | None = None, cu_seqlens: torch.Tensor | None = None,
             ctx: PackedContext | None = None) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """Full-head RoPE of q [B,T,Hq,D] and k [B,T,Hk,D] (or packed [N,H,D]) in place, Hk <= Hq (GQA).
    Positions as for mla_rope_q_ (ctx: a validated PackedContext). Differentiable."""
    _check_heads("q", q, q.shape[-1] if q.dim() in (3, 4) else -1)
    _check_heads("k", k, q.shape[-1])
    _check_tables(cos, sin, q.shape[-1], q.device, what="head dim D")
    if q.shape[:-2] != k.shape[:-2] or k.shape[-2] > q.shape[-2]:
        raise ValueError(f"k {tuple(k.shape)} must match q {tuple(q.shape)} except for fewer (or equal) heads")
    if q.dtype != k.dtype or q.device != k.device:
        raise ValueError(f"q and k must share dtype and device, got {q.dtype} {q.device} and {k.dtype} {k.device}")
    if not (q.is_contiguous() and k.is_contiguous()):
        raise ValueError("q and k must be contiguous (the kernel rotates them in place)")
    positions, cu_seqlens, validated = _context_positions("q", q, positions, cu_seqlens, ctx, cos.shape[0])
    seq_len = q.shape[1] if q.dim() == 4 else 0
    if not (torch.is_grad_enabled() and (q.requires_grad or k.requires_grad)):
        rope_qk_op(q, k, cos, sin, positions, cu_seqlens, seq_len, False, validated)
        return q, k
    return _RopeQK.apply(q, k, cos, sin, positions, cu_seqlens, seq_len, validated)
