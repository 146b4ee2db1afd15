"""SSD scan (Mamba-2 state-space duality, per-head scalar decay): step loop, plain-torch chunked, Triton.

Per head h, with state S [P, N] (fp32), decay a_t = exp(dt_t * A_h) and a group g(h) for B and C:

    S_t = a_t * S_{t-1} + dt_t * x_t (x) B_t          x_t [P], B_t [N]
    y_t = S_t @ C_t                                   [P]  (the sum over N)

S is zero before every document start. The D skip and the gate are the layer's job, not the scan's.

An optional input weight w [B,T,H] (fp32) replaces dt as the input's scale, S_t = a_t S_{t-1} + w_t x_t (x) B_t,
with the decay still exp(dt_t A): Mamba-3's trapezoid weights its inputs apart from its decay, and its MIMO form
runs the scan over rank sub-tokens whose decay is 1 (dt = 0) but whose weight is not (kernels/mamba3.py).

Layout: x [B,T,H,P]; dt [B,T,H] (already softplus'd, > 0); A [H] (< 0, fp32 contract);
Bm, Cm [B,T,G,N] with G dividing H (Mamba-2's n_groups: head h reads group h // (H // G); G = H
is one B/C per head); y [B,T,H,P] in x's dtype.

Documents: `cu_seqlens` [D+1] int32 over the *flattened* B*T tokens (flash-linear-attention's varlen
convention), rising strictly from 0 to B*T. With B > 1 every row start (a multiple of T) must be a
document start: a document never spans two rows (the packed-row contract). cu_seqlens=None means each
row is one document.

Three implementations, one contract:
- `ssd_scan_reference`: the step loop. The oracle.
- `ssd_chunked_torch`: chunked SSD in plain torch (Mamba-2's `ssd_minimal`), loop-free across chunks,
  so inductor compiles it. A document start is a token whose log-decay is -inf: every segment sum
  that crosses it is -inf, its exp is exactly 0, so no state and no intra-chunk term crosses a
  boundary. Segment sums are formed by masked cumsums, never by differences (-inf - -inf is nan).
- the Triton op (`megacpp::ssd_scan_fwd` / `megacpp::ssd_scan_bwd`), Mamba-2's split into a short
  sequential pass and a wide parallel one. Forward: (1) one program per (document, head, [P, N] block)
  walks its document's chunks in order (the running state in fp32) and stores the state entering each
  (`states_dtype`: bf16 for bf16 inputs, else fp32); (2) one program per
  (chunk, head) forms y = (C B^T * L) u + exp(cs) C S^T with tl.dot, every chunk at once. Backward: (1)
  the same sequential walk in reverse stores the gradient of the state leaving each chunk; (2) one
  program per (chunk, head) forms every input gradient from the saved states and those gradients.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch
import triton
import triton.language as tl

from megacpp_lab.kernels import TRITON_INTERPRET, launchable
from megacpp_lab.varlen import PackedContext, check_context, check_cu_seqlens, documents_longest_first

__all__ = [
    "FLOAT_DTYPES",
    "KERNELS",
    "Mamba3Operands",
    "chunk_log_decay",
    "decay_mask",
    "doc_start_mask",
    "dot_types",
    "launch_ssd_bwd",
    "launch_ssd_bwd_states",
    "launch_ssd_fwd",
    "rank_inputs",
    "slot_chunk",
    "slot_document",
    "ssd_chunked_torch",
    "ssd_scan",
    "ssd_scan_bwd",
    "ssd_scan_fwd",
    "ssd_scan_reference",
    "states_dtype",
    "validate_ssd_inputs",
]

# ----------------------------------------------------------------------------- inputs


def doc_start_mask(cu_seqlens: torch.Tensor | None, B: int, T: int, device: torch.device) -> torch.Tensor:
    """[B,T] bool: True at every document start (row starts included). Loop-free, no host sync. The SSD and
    Mamba-3 scans' resets."""
    if cu_seqlens is None:
        reset = torch.zeros((B, T), dtype=torch.bool, device=device)
        reset[:, 0] = True
        return reset
    # every entry, the final B*T included (one slot past the tokens): indexing with cu_seqlens[:-1] made dynamo
    # specialise on a single document (an index of size 1) and compile again for one document against several
    reset = torch.zeros(B * T + 1, dtype=torch.bool, device=device)
    reset[cu_seqlens.long()] = True
    return reset[: B * T].view(B, T)


# the floating dtypes the scans take (float64 on their torch paths only): an integer or bool input is refused
FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def _check(name: str, t: torch.Tensor, shape: tuple[int, ...]) -> None:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a tensor, got {type(t).__name__}")
    if tuple(t.shape) != shape:
        raise ValueError(f"{name} must have shape {shape}, got {tuple(t.shape)}")
    if t.dtype not in FLOAT_DTYPES:
        raise ValueError(f"{name} must be float32, bfloat16, float16 (or float64 off the kernel), got {t.dtype}")


def validate_ssd_inputs(
    x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, Bm: torch.Tensor, Cm: torch.Tensor,
    cu_seqlens: torch.Tensor | None, *, validated: bool = False, x_weight: torch.Tensor | None = None,
) -> None:  # fmt: skip
    """Fail closed, naming the argument. cu_seqlens are checked by varlen.check_cu_seqlens: their structure
    always, their values unless `validated` (a PackedContext's, checked when it was built)."""
    if not isinstance(x, torch.Tensor) or x.dim() != 4:
        raise ValueError(f"x must be [B,T,H,P], got shape {tuple(getattr(x, 'shape', ()))}")
    B, T, H, P = x.shape
    if B == 0 or T == 0:  # no document: it failed deep inside the chunking (a reshape, a zero step) before
        raise ValueError(f"x must hold tokens, got [B,T,H,P] = {list(x.shape)}")
    if not isinstance(Bm, torch.Tensor) or Bm.dim() != 4:
        raise ValueError(f"Bm must be [B,T,G,N], got shape {tuple(getattr(Bm, 'shape', ()))}")
    G, N = Bm.shape[2], Bm.shape[3]
    if G < 1 or H % G != 0:
        raise ValueError(f"Bm's group count G={G} must divide the head count H={H}")
    _check("x", x, (B, T, H, P))
    _check("dt", dt, (B, T, H))
    _check("A", A, (H,))
    _check("Bm", Bm, (B, T, G, N))
    _check("Cm", Cm, (B, T, G, N))
    if x_weight is not None:
        _check("x_weight", x_weight, (B, T, H))
    if cu_seqlens is not None and not validated:
        check_cu_seqlens(cu_seqlens, B * T, device=x.device, row_len=T)


def _per_head(t: torch.Tensor, H: int) -> torch.Tensor:
    """[B,T,G,N] -> [B,T,H,N]: head h reads group h // (H // G)."""
    return t.repeat_interleave(H // t.shape[2], dim=2) if t.shape[2] != H else t


# ----------------------------------------------------------------------------- references


@torch.compiler.disable
def ssd_scan_reference(
    x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, Bm: torch.Tensor, Cm: torch.Tensor,
    cu_seqlens: torch.Tensor | None = None, *, x_weight: torch.Tensor | None = None, y_fp32: bool = False,
) -> torch.Tensor:  # fmt: skip
    """The step loop: fp32 state (fp64 for gradcheck), explicit resets. Returns y [B,T,H,P] in x's dtype (at least
    fp32 with y_fp32). x_weight: the input's weight per token (module docstring), dt when None.

    Disabled for torch.compile: dynamo would unroll the T steps into one enormous graph."""
    B, T, H, P = x.shape
    acc = torch.promote_types(x.dtype, torch.float32)
    reset = doc_start_mask(cu_seqlens, B, T, x.device)
    Bh, Ch = _per_head(Bm, H).to(acc), _per_head(Cm, H).to(acc)
    xs, dts, Af = x.to(acc), dt.to(acc), A.to(acc)
    ws = dts if x_weight is None else x_weight.to(acc)
    S = torch.zeros((B, H, P, Bm.shape[-1]), dtype=acc, device=x.device)
    ys = []
    for t in range(T):
        S = torch.where(reset[:, t].view(B, 1, 1, 1), torch.zeros_like(S), S)
        a = torch.exp(dts[:, t] * Af).view(B, H, 1, 1)
        S = a * S + (ws[:, t, :, None] * xs[:, t])[..., None] * Bh[:, t, :, None, :]
        ys.append((S @ Ch[:, t, :, :, None]).squeeze(-1))
    return torch.stack(ys, dim=1).to(acc if y_fp32 else x.dtype)


def _segsum(a: torch.Tensor) -> torch.Tensor:
    """a [..., L] -> [..., L, L]: out[i, j] = a[j+1] + ... + a[i] for i >= j, -inf above the diagonal.

    Masked cumsum, no differences: a holds -inf at document starts."""
    L = a.shape[-1]
    strict = torch.ones(L, L, dtype=torch.bool, device=a.device).tril(-1)
    s = torch.cumsum(a[..., :, None].expand(*a.shape, L).masked_fill(~strict, 0), dim=-2)
    return s.masked_fill(~torch.ones(L, L, dtype=torch.bool, device=a.device).tril(), float("-inf"))


def ssd_chunked_torch(
    x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, Bm: torch.Tensor, Cm: torch.Tensor,
    cu_seqlens: torch.Tensor | None = None, *, chunk: int = 64, x_weight: torch.Tensor | None = None,
    y_fp32: bool = False,
) -> torch.Tensor:  # fmt: skip
    """Chunked SSD in plain torch, loop-free across chunks (inductor compiles it). y [B,T,H,P] in x's dtype.
    x_weight: the input's weight per token (module docstring), dt when None.

    Mamba-2's ssd_minimal over each row, with the log-decay set to -inf at document starts."""
    B, T, H, P = x.shape
    N = Bm.shape[-1]
    acc = torch.promote_types(x.dtype, torch.float32)
    pad = (-T) % chunk
    reset = doc_start_mask(cu_seqlens, B, T, x.device)
    loga = torch.where(reset[..., None], float("-inf"), dt.to(acc) * A.to(acc))  # [B,T,H]
    u = x.to(acc) * (dt if x_weight is None else x_weight).to(acc)[..., None]
    Bh, Ch = _per_head(Bm, H).to(acc), _per_head(Cm, H).to(acc)
    if pad:  # zero tail tokens: no input, decay 1, read by no real token
        u, loga = torch.nn.functional.pad(u, (0, 0, 0, 0, 0, pad)), torch.nn.functional.pad(loga, (0, 0, 0, pad))
        Bh, Ch = (torch.nn.functional.pad(t, (0, 0, 0, 0, 0, pad)) for t in (Bh, Ch))
    nc = (T + pad) // chunk
    u, Bh, Ch = (t.reshape(B, nc, chunk, H, -1) for t in (u, Bh, Ch))
    a = loga.reshape(B, nc, chunk, H).permute(0, 3, 1, 2)  # [B,H,c,l]
    a_cum = torch.cumsum(a, dim=-1)
    seg = _segsum(a)  # [B,H,c,l,l]
    # 1. within each chunk: the quadratic (attention-like) form with the decay mask
    y = torch.einsum("bclhn,bcshn,bhcls,bcshp->bclhp", Ch, Bh, seg.exp(), u)
    # 2. each chunk's own final state; decay from j to the chunk end is the segsum's last row
    states = torch.einsum("bclhn,bhcl,bclhp->bchpn", Bh, seg[..., -1, :].exp(), u)
    # 3. state passing across chunks: one more segsum over the chunk totals, no loop over chunks
    states = torch.cat([torch.zeros_like(states[:, :1]), states], dim=1)
    decay_chunk = _segsum(torch.nn.functional.pad(a_cum[..., -1], (1, 0))).exp()  # [B,H,c+1,c+1]
    states = torch.einsum("bhzc,bchpn->bzhpn", decay_chunk, states)[:, :-1]
    # 4. the state entering each chunk, read by C with the decay from the chunk start
    y = y + torch.einsum("bclhn,bchpn,bhcl->bclhp", Ch, states, a_cum.exp())
    return y.reshape(B, nc * chunk, H, P)[:, :T].to(acc if y_fp32 else x.dtype)


# ----------------------------------------------------------------------------- kernels
#
# Chunks never cross a document: document d's chunk k covers tokens [cu[d] + k*CHUNK, min(cu[d] + (k+1)*CHUNK,
# cu[d+1])), and its saved state lives in slot cu[d] // CHUNK + d + k. That slot map is strictly increasing
# over (d, k), needs no prefix sum over documents (no extra launch, no host sync), and stays below
# B*T // CHUNK + D; the slots between two documents are gaps that no program reads.


# The chunk-slot layout every varlen scan shares (the SSD's, Mamba-3's and M2RNN's checkpoints): document d's chunk c
# is slot cu[d] // CHUNK + d + c. No two documents' slots meet (a document of n tokens from cu[d] ends at most one
# slot past cu[d + 1] // CHUNK + d), and total // CHUNK + D slots bound them all: no prefix sum over the documents'
# chunk counts, so no launcher computes a slot table per batch.


@triton.jit
def slot_document(cu_ptr, slot, D, CHUNK: tl.constexpr):
    """The document whose slots hold `slot` (the last d with first slot cu[d] // CHUNK + d <= slot; a gap slot
    past a document's chunks goes to that document) and that document's start, by binary search over D."""
    lo = slot * 0
    hi = lo + D
    while hi - lo > 1:
        mid = (lo + hi) // 2
        go = tl.load(cu_ptr + mid) // CHUNK + mid <= slot
        lo = tl.where(go, mid, lo)
        hi = tl.where(go, hi, mid)
    return lo, tl.load(cu_ptr + lo)


@triton.jit
def slot_chunk(cu_ptr, slot, D, CHUNK: tl.constexpr):
    """(first token, end token) of the chunk in `slot`; first >= end for a gap slot."""
    d, doc_start = slot_document(cu_ptr, slot, D, CHUNK)
    first = doc_start + (slot - doc_start // CHUNK - d) * CHUNK
    return first, tl.minimum(first + CHUNK, tl.load(cu_ptr + d + 1))


@triton.jit
def chunk_log_decay(dt_ptr, t, m, hd, H, A_h, rl, CHUNK: tl.constexpr):
    """dt (fp32, 0 past the chunk's end), the in-chunk cumulative log-decay cs, and cs at the chunk's last
    token (dt is 0 past the end, so the last row holds it; not a min, since dt*A may be > 0)."""
    dt = tl.load(dt_ptr + t * H + hd, mask=m, other=0.0).to(tl.float32)
    cs = tl.cumsum(dt * A_h, axis=0)
    return dt, cs, tl.sum(tl.where(rl == CHUNK - 1, cs, 0.0), axis=0)


@triton.jit
def _input_weight(w_ptr, t, m, hd, H, dt, HAS_W: tl.constexpr):
    """The input's weight per token: w (fp32, 0 past the chunk's end) when given, else dt."""
    if HAS_W:
        return tl.load(w_ptr + t * H + hd, mask=m, other=0.0).to(tl.float32)
    return dt


@triton.jit
def rank_inputs(x_ptr, xs_ptr, t, m, hd, H, rp, P: tl.constexpr, RANK: tl.constexpr):
    """x at the tokens t [CHUNK] and head-dim columns rp, in x's dtype (0 where m is False). RANK > 1 (Mamba-3's
    MIMO: t = step * RANK + r, a rank sub-token): the step's x [B*T, H, P] times its rank's scale mimo_x [H, RANK, P]
    (fp32, rounded to x's dtype first), rounded to x's dtype: torch's x * mimo_x.to(x.dtype) bit for bit, with x read
    once a step (its R sub-tokens hit the same lines) and no [B, T, R, H, P] copy in memory."""
    if RANK == 1:
        return tl.load(x_ptr + (t[:, None] * H + hd) * P + rp[None, :], mask=m[:, None], other=0.0)
    xv = tl.load(x_ptr + ((t // RANK)[:, None] * H + hd) * P + rp[None, :], mask=m[:, None], other=0.0)
    scale = tl.load(xs_ptr + ((hd * RANK + t % RANK) * P)[:, None] + rp[None, :]).to(xv.dtype)
    return (xv.to(tl.float32) * scale.to(tl.float32)).to(xv.dtype)


@triton.jit
def decay_mask(cs, step):
    """L[i, j] = exp(cs_i - cs_j) for step_i >= step_j, else 0 (the exponent is masked before exp: no overflow).
    step: the chunk's token index (Mamba-3's MIMO: its step, token // RANK, so a step's ranks see each other)."""
    causal = step[:, None] >= step[None, :]
    return tl.where(causal, tl.exp(tl.where(causal, cs[:, None] - cs[None, :], 0.0)), 0.0)


# Mamba-3 mode (M3, kernels/mamba3.py): tokens are rank sub-tokens t = step * RANK + r (RANK = 1: SISO), a step's
# ranks see each other (the decay mask by step), and a step's own inputs take the weight gamma where every later
# step takes x_weight (the trapezoid's exact diagonal). B and C come in as the rotated keys and queries per head (the
# forward's kernels rotating them as they read the group's B and C took 1.77 ms in the state pass against its 0.19
# with the key pass's stored keys, and 0.90 against 0.34 in the output kernel: scripts/mamba3_probe.py on the H200 at
# bench ssd's main shape, SISO). The forward's kernels below take that mode; the backward's chunk pass for it is
# kernels/mamba3's _m3_bwd_chunk_kernel.


@triton.jit
def _state_program(cu_ptr, order_ptr, a_ptr, H, G, P: tl.constexpr, N: tl.constexpr, BP: tl.constexpr,
                   BN: tl.constexpr, CHUNK: tl.constexpr):  # fmt: skip
    """What a sequential-pass program (document, head, [BP, BN] state block) works on: its head and group,
    the document's token range and first state slot, the head's decay rate, and the chunk/P/N index ranges.
    Program i (a one-axis grid, _state_grid) takes state block i % NB (NB = P // BP * N // BN blocks) of head
    i // NB % H of the document order[i // (NB * H)] (varlen.documents_longest_first, as PackedContext.longest_first
    holds it), so the GPU, which starts programs in their order, starts every block of the longest chains first:
    each program walks its document's chunks one after another, so a pass lasts at least its longest document's
    chain, and started last (in document order) that chain adds to the time the others took. At bench ssd's main
    shape (64 documents of 8 a row, the longest 35 chunks of 545; 264 programs at once on an H100) a list schedule in
    document order ends at 62 chunk-times, longest first at 36 (the work spread evenly: 35)."""
    NB: tl.constexpr = (P // BP) * (N // BN)
    i = tl.program_id(0)
    doc = tl.load(order_ptr + i // (NB * H))
    hd = i // NB % H
    pb = i % NB % (P // BP)
    nb = i % NB // (P // BP)
    start = tl.load(cu_ptr + doc)
    A_h = tl.load(a_ptr + hd).to(tl.float32)
    rp = pb * BP + tl.arange(0, BP)
    rn = nb * BN + tl.arange(0, BN)
    return hd, hd // (H // G), start, tl.load(cu_ptr + doc + 1), start // CHUNK + doc, A_h, tl.arange(0, CHUNK), rp, rn


@triton.jit
def _ssd_fwd_state_kernel(
    x_ptr, xs_ptr, dt_ptr, w_ptr, a_ptr, b_ptr, cu_ptr, order_ptr, st_ptr,
    H, G,
    P: tl.constexpr, N: tl.constexpr, BP: tl.constexpr, BN: tl.constexpr, CHUNK: tl.constexpr,
    PRECISION: tl.constexpr, DOT: tl.constexpr, HAS_W: tl.constexpr, RANK: tl.constexpr,
):  # fmt: skip
    """Pass 1 (sequential over one document's chunks, one [BP, BN] block of the state per program):
    store the state entering every chunk (fp32 running, stored in the states' dtype); S' = exp(cs_last) S +
    (u * w)^T B, u = dt x (or x times the input weight), w_j = exp(cs_last - cs_j). The state starts at zero: the document-start reset. RANK > 1: the
    tokens are Mamba-3's rank sub-tokens, x per step scaled by mimo_x at xs_ptr (rank_inputs)."""
    hd, g, start, end, slot0, A_h, rl, rp, rn = _state_program(cu_ptr, order_ptr, a_ptr, H, G, P, N, BP, BN, CHUNK)
    S = tl.zeros((BP, BN), dtype=tl.float32)
    for k in range(0, tl.cdiv(end - start, CHUNK)):
        tl.store(st_ptr + (((slot0 + k) * H + hd) * P + rp[:, None]) * N + rn[None, :], S)
        t = start + k * CHUNK + rl
        m = t < end
        dt, cs, cs_last = chunk_log_decay(dt_ptr, t, m, hd, H, A_h, rl, CHUNK)
        xw = _input_weight(w_ptr, t, m, hd, H, dt, HAS_W)
        x = rank_inputs(x_ptr, xs_ptr, t, m, hd, H, rp, P, RANK)
        Bc = tl.load(b_ptr + (t[:, None] * G + g) * N + rn[None, :], mask=m[:, None], other=0.0)
        uw = (x.to(tl.float32) * (tl.exp(cs_last - cs) * xw)[:, None]).to(DOT)
        S = tl.exp(cs_last) * S + tl.dot(tl.trans(uw), Bc.to(DOT), input_precision=PRECISION)


@triton.jit
def _ssd_fwd_output_kernel(
    x_ptr, xs_ptr, dt_ptr, w_ptr, a_ptr, b_ptr, c_ptr, cu_ptr, st_ptr, y_ptr, gam_ptr, skip_ptr,
    H, G, D,
    P: tl.constexpr, N: tl.constexpr, BP: tl.constexpr, CHUNK: tl.constexpr, PRECISION: tl.constexpr,
    DOT: tl.constexpr, HAS_W: tl.constexpr, M3: tl.constexpr, RANK: tl.constexpr,
):  # fmt: skip
    """Pass 2 (every chunk at once): y = (C B^T * L) u + exp(cs) * (C S^T), S the saved entering state.
    M3: the same step's tokens take the weight gamma, not w: y = (C B^T * L * W) x + ..., W[i, j] = w_j for an
    earlier step j, gamma_j for the same step (the trapezoid's exact diagonal); and the skip D x (D [H] fp32). RANK > 1:
    rank sub-tokens, a step's x scaled by mimo_x at xs_ptr (rank_inputs); y [B*T*RANK, H, P] per sub-token."""
    slot = tl.program_id(0)
    hd = tl.program_id(1)
    rp = tl.program_id(2) * BP + tl.arange(0, BP)
    first, end = slot_chunk(cu_ptr, slot, D, CHUNK)
    if first < end:
        g = hd // (H // G)
        A_h = tl.load(a_ptr + hd).to(tl.float32)
        rl = tl.arange(0, CHUNK)
        rn = tl.arange(0, N)
        t = first + rl
        m = t < end
        dt, cs, _ = chunk_log_decay(dt_ptr, t, m, hd, H, A_h, rl, CHUNK)
        x = rank_inputs(x_ptr, xs_ptr, t, m, hd, H, rp, P, RANK)
        Bc = tl.load(b_ptr + (t[:, None] * G + g) * N + rn[None, :], mask=m[:, None], other=0.0).to(DOT)
        Cc = tl.load(c_ptr + (t[:, None] * G + g) * N + rn[None, :], mask=m[:, None], other=0.0).to(DOT)
        S = tl.load(st_ptr + ((slot * H + hd) * P + rp[:, None]) * N + rn[None, :])
        step = rl // RANK
        CB = tl.dot(Cc, tl.trans(Bc), input_precision=PRECISION) * decay_mask(cs, step)
        xw = _input_weight(w_ptr, t, m, hd, H, dt, HAS_W)
        if M3:
            gam = tl.load(gam_ptr + t * H + hd, mask=m, other=0.0)
            CB = CB * tl.where(step[:, None] > step[None, :], xw[None, :], gam[None, :])
            y = tl.dot(CB.to(DOT), x.to(DOT), input_precision=PRECISION) + tl.load(skip_ptr + hd) * x.to(tl.float32)
        else:
            u = (x.to(tl.float32) * xw[:, None]).to(DOT)
            y = tl.dot(CB.to(DOT), u, input_precision=PRECISION)
        # the state term in the stored state's dtype (states_dtype: bf16 for bf16 inputs, else fp32 with tf32
        # tensor cores for 16-bit inputs)
        y += tl.exp(cs)[:, None] * tl.dot(Cc.to(S.dtype), tl.trans(S), input_precision=PRECISION)
        tl.store(y_ptr + (t[:, None] * H + hd) * P + rp[None, :], y.to(y_ptr.dtype.element_ty), mask=m[:, None])


@triton.jit
def _ssd_bwd_state_kernel(
    dy_ptr, dt_ptr, a_ptr, c_ptr, cu_ptr, order_ptr, dst_ptr,
    H, G,
    P: tl.constexpr, N: tl.constexpr, BP: tl.constexpr, BN: tl.constexpr, CHUNK: tl.constexpr,
    PRECISION: tl.constexpr, DOT: tl.constexpr,
):  # fmt: skip
    """Backward pass 1 (sequential, chunks in reverse): store dS', the gradient of the state leaving every
    chunk; the gradient of the entering state is exp(cs_last) dS' + sum_i exp(cs_i) dy_i C_i^T."""
    hd, g, start, end, slot0, A_h, rl, rp, rn = _state_program(cu_ptr, order_ptr, a_ptr, H, G, P, N, BP, BN, CHUNK)
    dS = tl.zeros((BP, BN), dtype=tl.float32)  # nothing leaves the last chunk: the next document starts at zero
    n_chunks = tl.cdiv(end - start, CHUNK)
    for kk in range(0, n_chunks):
        k = n_chunks - 1 - kk
        tl.store(dst_ptr + (((slot0 + k) * H + hd) * P + rp[:, None]) * N + rn[None, :], dS)
        t = start + k * CHUNK + rl
        m = t < end
        dt, cs, cs_last = chunk_log_decay(dt_ptr, t, m, hd, H, A_h, rl, CHUNK)
        dy = tl.load(dy_ptr + (t[:, None] * H + hd) * P + rp[None, :], mask=m[:, None], other=0.0)
        Cc = tl.load(c_ptr + (t[:, None] * G + g) * N + rn[None, :], mask=m[:, None], other=0.0).to(DOT)
        dye = (dy.to(tl.float32) * tl.exp(cs)[:, None]).to(DOT)
        dS = tl.exp(cs_last) * dS + tl.dot(tl.trans(dye), Cc, input_precision=PRECISION)


@triton.jit
def _ssd_bwd_chunk_kernel(
    x_ptr, dt_ptr, w_ptr, a_ptr, b_ptr, c_ptr, cu_ptr, st_ptr, dst_ptr, dy_ptr,
    dx_ptr, ddt_ptr, dw_ptr, da_ptr, db_ptr, dc_ptr,
    H, G, D,
    P: tl.constexpr, N: tl.constexpr, BN: tl.constexpr, CHUNK: tl.constexpr, PRECISION: tl.constexpr,
    DOT: tl.constexpr, HAS_W: tl.constexpr,
):  # fmt: skip
    """Backward pass 2 (every chunk at once, all of P; N in blocks of BN, twice). Per chunk, with u = dt x
    (u = w x given an input weight w: then dt reaches only the decay, and dw = du . x),
    L the decay mask, S the entering state, dS' the leaving state's gradient, w_j = exp(cs_last - cs_j):
        y = (C B^T * L) u + exp(cs) * (C S^T);   S' = exp(cs_last) S + (u * w)^T B
    dB and dC go to [B,T,H,N] (fp32 when G < H: the launcher sums each group's heads). Mamba-3 mode's backward
    chunk pass is kernels/mamba3's own (_m3_bwd_chunk_kernel)."""
    slot = tl.program_id(0)
    hd = tl.program_id(1)
    first, end = slot_chunk(cu_ptr, slot, D, CHUNK)
    if first >= end:
        tl.store(da_ptr + slot * H + hd, 0.0)  # a gap slot: the launcher sums every slot
    else:
        g = hd // (H // G)
        A_h = tl.load(a_ptr + hd).to(tl.float32)
        rl = tl.arange(0, CHUNK)
        rp = tl.arange(0, P)
        t = first + rl
        m = t < end
        dt, cs, cs_last = chunk_log_decay(dt_ptr, t, m, hd, H, A_h, rl, CHUNK)
        st_at = st_ptr + (slot * H + hd) * P * N
        dst_at = dst_ptr + (slot * H + hd) * P * N
        bc_at = (t[:, None] * G + g) * N
        # first sweep over N: the reductions over N (state terms in the stored states' dtype: states_dtype)
        CB = tl.zeros((CHUNK, CHUNK), dtype=tl.float32)
        Q = tl.zeros((CHUNK, P), dtype=tl.float32)  # [j] = dS' B_j
        CS = tl.zeros((CHUNK, P), dtype=tl.float32)  # [i] = S C_i
        SdS = tl.zeros((P,), dtype=tl.float32)
        for nb in tl.static_range(N // BN):
            rn = nb * BN + tl.arange(0, BN)
            Bc = tl.load(b_ptr + bc_at + rn[None, :], mask=m[:, None], other=0.0)
            Cc = tl.load(c_ptr + bc_at + rn[None, :], mask=m[:, None], other=0.0)
            S = tl.load(st_at + rp[:, None] * N + rn[None, :])
            dS = tl.load(dst_at + rp[:, None] * N + rn[None, :])
            CB += tl.dot(Cc.to(DOT), tl.trans(Bc.to(DOT)), input_precision=PRECISION)
            Q += tl.dot(Bc.to(dS.dtype), tl.trans(dS), input_precision=PRECISION)
            CS += tl.dot(Cc.to(S.dtype), tl.trans(S), input_precision=PRECISION)
            SdS += tl.sum(dS.to(tl.float32) * S.to(tl.float32), axis=1)
        # x and dy read after the sweep (held across it they cost 64 registers a thread), and the sweep's tiles
        # used in the order below: compiled for sm_90 (kernels/resources.py) the kernel's spills fell from
        # 1096/1100 to 524/528 bytes a thread (stores/loads), the same arithmetic; not yet timed on a GPU
        x = tl.load(x_ptr + (t[:, None] * H + hd) * P + rp[None, :], mask=m[:, None], other=0.0).to(tl.float32)
        dy = tl.load(dy_ptr + (t[:, None] * H + hd) * P + rp[None, :], mask=m[:, None], other=0.0).to(tl.float32)
        xw = _input_weight(w_ptr, t, m, hd, H, dt, HAS_W)
        u = x * xw[:, None]
        w = tl.exp(cs_last - cs)
        ecs = tl.exp(cs)
        # each of the sweep's tiles used as soon as it can be (CS, then Q), so fewer stay live
        dyCS = tl.sum(dy * CS, axis=1)
        R = w * xw * tl.sum(x * Q, axis=1)
        du = w[:, None] * Q
        Lm = decay_mask(cs, rl)
        du += tl.dot(tl.trans((CB * Lm).to(DOT)), dy.to(DOT), input_precision=PRECISION)
        dYU = tl.dot(dy.to(DOT), tl.trans(u.to(DOT)), input_precision=PRECISION)  # [i, j] = dy_i . u_j
        LdYU = Lm * dYU
        dxw = tl.sum(du * x, axis=1)
        dx = du * xw[:, None]
        # gradient of the cumulative log-decay: +/- each exp(cs_i - cs_j), then the state terms
        Sm = LdYU * CB
        dcs = tl.sum(Sm, axis=1) - tl.sum(Sm, axis=0) + ecs * dyCS - R
        to_last = tl.exp(cs_last) * tl.sum(SdS, axis=0) + tl.sum(R, axis=0)
        # cs_i sums a_0..a_i, so da_k = sum_{i >= k} dcs_i; cs_last reaches every real token
        dloga = tl.cumsum(dcs, axis=0, reverse=True) + to_last
        if HAS_W:
            ddt = dloga * A_h
            tl.store(dw_ptr + t * H + hd, dxw.to(dw_ptr.dtype.element_ty), mask=m)
        else:
            ddt = dxw + dloga * A_h
        tl.store(da_ptr + slot * H + hd, tl.sum(tl.where(m, dloga * dt, 0.0), axis=0))
        tl.store(dx_ptr + (t[:, None] * H + hd) * P + rp[None, :], dx.to(dx_ptr.dtype.element_ty), mask=m[:, None])
        tl.store(ddt_ptr + t * H + hd, ddt.to(ddt_ptr.dtype.element_ty), mask=m)
        # second sweep over N: dC = (L * dy u^T) B + exp(cs) dy S;  dB = (L * dy u^T)^T C + w u dS'
        LdYU_lo = LdYU.to(DOT)
        dye, uw = dy * ecs[:, None], u * w[:, None]
        for nb in tl.static_range(N // BN):
            rn = nb * BN + tl.arange(0, BN)
            Bc = tl.load(b_ptr + bc_at + rn[None, :], mask=m[:, None], other=0.0).to(DOT)
            Cc = tl.load(c_ptr + bc_at + rn[None, :], mask=m[:, None], other=0.0).to(DOT)
            S = tl.load(st_at + rp[:, None] * N + rn[None, :])
            dS = tl.load(dst_at + rp[:, None] * N + rn[None, :])
            dC = tl.dot(LdYU_lo, Bc, input_precision=PRECISION) + tl.dot(dye.to(S.dtype), S, input_precision=PRECISION)
            dB = (tl.dot(tl.trans(LdYU_lo), Cc, input_precision=PRECISION)
                  + tl.dot(uw.to(dS.dtype), dS, input_precision=PRECISION))
            out_at = (t[:, None] * H + hd) * N + rn[None, :]
            tl.store(db_ptr + out_at, dB.to(db_ptr.dtype.element_ty), mask=m[:, None])
            tl.store(dc_ptr + out_at, dC.to(dc_ptr.dtype.element_ty), mask=m[:, None])



# ----------------------------------------------------------------------------- launchers and custom ops

# The sequential passes split the [P, N] state into blocks, one program each: more programs in flight.
STATE_BLOCK_P = 64
STATE_BLOCK_N = 64
OUT_BLOCK_P = 64  # head-dim columns per forward-output program
STATE_WARPS = 4
OUT_WARPS = 4
# state columns per sweep step of the backward's parallel pass. On the H100 (triton 3.6) 64 beat 128;
# 32 compiled to a kernel that wrote NaN into dC and, at P=128, read out of bounds: never below 64 there.
BWD_BLOCK_N = 64
BWD_WARPS = 4
BWD_STAGES = 1
# bf16 inputs' chunk states stored in bf16 (states_dtype); False: fp32, the dots against them TF32
STATES_IN_BF16 = True


_TL_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


def dot_types(dtype: torch.dtype) -> dict[str, object]:
    """fp32 inputs: IEEE fp32 dots. 16-bit inputs: the dots take the inputs' own dtype (fp32 accumulation),
    and the dots against the stored states take the states' dtype (states_dtype: bf16, or fp32 states on TF32
    tensor cores). The Triton interpreter multiplies bf16 operands as raw integers, so under it every dot takes
    fp32 operands (and the states are fp32)."""
    dot = tl.float32 if TRITON_INTERPRET else _TL_DTYPES[dtype]
    return {"PRECISION": "ieee" if dtype == torch.float32 else "tf32", "DOT": dot}


def states_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype of the chunk states the passes store and read back (the forward's, saved for the backward, and the
    backward's state gradients), for inputs of `dtype`. The sequential passes carry the running state in fp32 either
    way; only the stored copy is rounded. bf16 inputs store bf16 (STATES_IN_BF16, mamba_ssm's choice: the dots
    against the states then run in bf16, where fp32 states ran TF32 ones, and the states' traffic, the largest of
    the backward's chunk pass, halves); fp16 keeps fp32 (a state can outgrow fp16's range); fp32 stays fp32; under
    the interpreter fp32 (dot_types says why)."""
    return torch.bfloat16 if dtype == torch.bfloat16 and STATES_IN_BF16 and not TRITON_INTERPRET else torch.float32


def _n_slots(total: int, chunk: int, n_docs: int) -> int:
    """A bound on the state slots (see the slot map above the kernels)."""
    return total // chunk + n_docs


def _state_grid(D: int, H: int, P: int, N: int) -> tuple[tuple[int], int, int]:
    """The state passes' one-axis grid (_state_program: document, head, block, the block fastest) and their block."""
    bp, bn = min(STATE_BLOCK_P, P), min(STATE_BLOCK_N, N)
    if D * H * (P // bp) * (N // bn) >= 2048 and N >= 2 * bn:  # programs to spare: wider blocks, fewer re-reads of x
        bn *= 2
    return (D * H * (P // bp) * (N // bn),), bp, bn


class Mamba3Operands(NamedTuple):
    """The kernels' Mamba-3 mode (kernels/mamba3.py's op): the scan's tokens are rank sub-tokens (step, r);
    gamma [B, T*R, H] fp32 weights a step's own inputs (x_weight every later step's); the rank R; the skip D [H]
    fp32 (y += D x in the output kernel, one rounding); MIMO's rank scale mimo_x [H, R, P] fp32 (None for R = 1),
    applied to x [B, T, H, P] (one row a step) as the kernels read it."""

    gamma: torch.Tensor
    rank: int
    skip: torch.Tensor
    x_scale: torch.Tensor | None = None


def _m3_args(m3: Mamba3Operands | None, placeholder: torch.Tensor) -> tuple[dict[str, object], torch.Tensor, ...]:
    """The kernels' Mamba-3 constexprs, and the gamma, skip and x-scale pointers (placeholders the kernels never read
    without M3, or the scale at rank 1)."""
    if m3 is None:
        return {"M3": False, "RANK": 1}, placeholder, placeholder, placeholder
    if (m3.rank > 1) != (m3.x_scale is not None):
        raise ValueError(f"Mamba3Operands: x_scale (mimo_x) is MIMO's, given exactly when rank > 1; rank={m3.rank}, "
                         f"x_scale {'given' if m3.x_scale is not None else 'None'}")
    return {"M3": True, "RANK": m3.rank}, m3.gamma, m3.skip, placeholder if m3.x_scale is None else m3.x_scale


def launch_ssd_fwd(
    x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, Bm: torch.Tensor, Cm: torch.Tensor, cu_seqlens: torch.Tensor,
    order: torch.Tensor, chunk: int, save: bool, x_weight: torch.Tensor | None, y_dtype: torch.dtype,
    m3: Mamba3Operands | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """The forward kernels (the SSD op's, and kernels/mamba3's in Mamba-3 mode): y [B, T', H, P] in y_dtype over the
    scan's tokens (T' = dt's: the steps, or Mamba-3's T*R rank sub-tokens, x then one row a step) and the state
    entering every chunk (states_dtype) of every document, by slot (empty unless save). Inputs contiguous and validated;
    order: the documents longest first (varlen.documents_longest_first), the sequential state pass's start order."""
    B, T = dt.shape[:2]
    H, P = x.shape[2], x.shape[3]
    G, N = Bm.shape[2], Bm.shape[3]
    D = cu_seqlens.numel() - 1
    n_slots = _n_slots(B * T, chunk, D)
    dots = dot_types(x.dtype)
    states = torch.empty((n_slots, H, P, N), device=x.device, dtype=states_dtype(x.dtype))
    grid, bp, bn = _state_grid(D, H, P, N)
    has_w = x_weight is not None
    w = x_weight if has_w else dt  # a placeholder pointer the kernels never read
    flags, gam, skip, x_scale = _m3_args(m3, dt)
    _ssd_fwd_state_kernel[grid](
        x, x_scale, dt, w, A, Bm, cu_seqlens, order, states, H, G,
        P=P, N=N, BP=bp, BN=bn, CHUNK=chunk, **dots, HAS_W=has_w, RANK=flags["RANK"], num_warps=STATE_WARPS,
    )  # fmt: skip
    y = torch.empty((B, T, H, P), device=x.device, dtype=y_dtype)
    bp = min(OUT_BLOCK_P, P)
    _ssd_fwd_output_kernel[(n_slots, H, P // bp)](
        x, x_scale, dt, w, A, Bm, Cm, cu_seqlens, states, y, gam, skip, H, G, D,
        P=P, N=N, BP=bp, CHUNK=chunk, **dots, HAS_W=has_w, **flags, num_warps=OUT_WARPS,
    )  # fmt: skip
    return y, states if save else states.new_empty((0, H, P, N))


def launch_ssd_bwd_states(dy: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, Cm: torch.Tensor,
                          cu_seqlens: torch.Tensor, order: torch.Tensor, states: torch.Tensor, chunk: int,
                          dtype: torch.dtype) -> torch.Tensor:  # fmt: skip
    """Backward pass 1 (the SSD op's, and kernels/mamba3's): the gradient of the state leaving every chunk of
    every document, by slot, [n_slots, H, P, N] in the dtype of the forward's saved states. dy contiguous [B,T,H,P]; dtype:
    x's, which sets the dots' (dot_types); order: the documents longest first, as launch_ssd_fwd takes it."""
    H, P, N = states.shape[1:]
    G = Cm.shape[2]
    dstates = torch.empty_like(states)
    grid, bp, bn = _state_grid(cu_seqlens.numel() - 1, H, P, N)
    _ssd_bwd_state_kernel[grid](
        dy, dt, A, Cm, cu_seqlens, order, dstates, H, G,
        P=P, N=N, BP=bp, BN=bn, CHUNK=chunk, **dot_types(dtype), num_warps=STATE_WARPS,
    )  # fmt: skip
    return dstates


def launch_ssd_bwd(
    dy: torch.Tensor, x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, Bm: torch.Tensor, Cm: torch.Tensor,
    cu_seqlens: torch.Tensor, order: torch.Tensor, states: torch.Tensor, chunk: int, x_weight: torch.Tensor | None,
) -> tuple[torch.Tensor, ...]:  # fmt: skip
    """The SSD op's backward kernels: dx, ddt, dA, dB, dC (in Bm's dtype) and dw (empty without x_weight)."""
    B, T, H, P = x.shape
    G, N = Bm.shape[2], Bm.shape[3]
    D = cu_seqlens.numel() - 1
    n_slots = states.shape[0]
    dy = dy.contiguous()
    dstates = launch_ssd_bwd_states(dy, dt, A, Cm, cu_seqlens, order, states, chunk, x.dtype)
    dx, ddt = torch.empty_like(x), torch.empty_like(dt)
    dA = torch.empty((n_slots, H), device=x.device, dtype=torch.float32)
    has_w = x_weight is not None
    dw = torch.empty_like(x_weight) if has_w else dt.new_empty((0,))
    if G == H:  # one head per group: the kernel writes the gradients in their own dtype
        dB, dC = torch.empty_like(Bm), torch.empty_like(Cm)
    else:
        dB = torch.empty((B, T, H, N), device=x.device, dtype=torch.float32)
        dC = torch.empty_like(dB)
    _ssd_bwd_chunk_kernel[(n_slots, H)](
        x, dt, x_weight if has_w else dt, A, Bm, Cm, cu_seqlens, states, dstates, dy, dx, ddt, dw if has_w else ddt,
        dA, dB, dC, H, G, D,
        P=P, N=N, BN=min(BWD_BLOCK_N, N), CHUNK=chunk, **dot_types(x.dtype), HAS_W=has_w,
        num_warps=BWD_WARPS, num_stages=BWD_STAGES,
    )  # fmt: skip
    if G != H:
        dB, dC = (t.view(B, T, G, H // G, N).sum(3).to(Bm.dtype) for t in (dB, dC))
    return dx, ddt, dA.sum(0).to(A.dtype), dB, dC, dw


@torch.library.custom_op("megacpp::ssd_scan_fwd", mutates_args=())
def ssd_scan_fwd(
    x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, Bm: torch.Tensor, Cm: torch.Tensor,
    cu_seqlens: torch.Tensor, order: torch.Tensor, chunk: int, save: bool,
    x_weight: Optional[torch.Tensor] = None, y_fp32: bool = False,  # noqa: UP045
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """y [B,T,H,P] and the state entering every chunk of every document (states_dtype), by slot (empty unless save).

    Inputs contiguous, validated by the caller; cu_seqlens [D+1] int32 covers the flattened B*T tokens; order: its
    documents longest first (varlen.documents_longest_first, [D+1] with its end mark; PackedContext.longest_first).
    x_weight (fp32, [B,T,H]): the input's weight per token, dt when None (the module docstring). y_fp32: y in
    fp32, not x's dtype (the kernels accumulate in fp32 and store in y's dtype)."""
    return launch_ssd_fwd(x, dt, A, Bm, Cm, cu_seqlens, order, chunk, save, x_weight,
                          torch.float32 if y_fp32 else x.dtype)  # fmt: skip


@ssd_scan_fwd.register_fake
def _(x, dt, A, Bm, Cm, cu_seqlens, order, chunk, save, x_weight=None, y_fp32=False):
    B, T, H, P = x.shape
    n_slots = _n_slots(B * T, chunk, cu_seqlens.shape[0] - 1)
    return (torch.empty_like(x, dtype=torch.float32 if y_fp32 else x.dtype),
            x.new_empty((n_slots if save else 0, H, P, Bm.shape[-1]), dtype=states_dtype(x.dtype)))


@torch.library.custom_op("megacpp::ssd_scan_bwd", mutates_args=())
def ssd_scan_bwd(
    dy: torch.Tensor, x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, Bm: torch.Tensor, Cm: torch.Tensor,
    cu_seqlens: torch.Tensor, order: torch.Tensor, states: torch.Tensor, chunk: int,
    x_weight: Optional[torch.Tensor] = None,  # noqa: UP045
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """Gradients for x, dt, A, Bm, Cm and x_weight (empty when it is None), from the forward's saved chunk
    states."""
    return launch_ssd_bwd(dy, x, dt, A, Bm, Cm, cu_seqlens, order, states, chunk, x_weight)


@ssd_scan_bwd.register_fake
def _(dy, x, dt, A, Bm, Cm, cu_seqlens, order, states, chunk, x_weight=None):
    dw = torch.empty_like(x_weight) if x_weight is not None else dt.new_empty((0,))
    return torch.empty_like(x), torch.empty_like(dt), torch.empty_like(A), torch.empty_like(Bm), torch.empty_like(Cm), dw


def _setup_context(ctx, inputs, output):
    x, dt, A, Bm, Cm, cu_seqlens, order, chunk, save, x_weight, _y_fp32 = inputs
    ctx.save_for_backward(x, dt, A, Bm, Cm, cu_seqlens, order, output[1], x_weight)
    ctx.chunk = chunk
    ctx.set_materialize_grads(False)  # else autograd allocates zeros the size of the states for their unused grad


def _backward(ctx, dy, _dstates):
    x, dt, A, Bm, Cm, cu_seqlens, order, states, x_weight = ctx.saved_tensors
    if states.numel() == 0:
        raise RuntimeError("ssd_scan_fwd ran with save=False; its output cannot be differentiated")
    dx, ddt, dA, dB, dC, dw = ssd_scan_bwd(dy, x, dt, A, Bm, Cm, cu_seqlens, order, states, ctx.chunk, x_weight)
    return dx, ddt, dA, dB, dC, None, None, None, None, (dw if x_weight is not None else None), None


ssd_scan_fwd.register_autograd(_backward, setup_context=_setup_context)


# ----------------------------------------------------------------------------- public entry

KERNELS = ("auto", "triton", "chunked", "reference")


def _pow2_at_least_16(name: str, n: int) -> None:
    if n < 16 or n & (n - 1):
        raise ValueError(f"the Triton SSD needs {name} a power of two >= 16 (tl.dot tiles), got {n}")


def ssd_scan(
    x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, Bm: torch.Tensor, Cm: torch.Tensor,
    *, cu_seqlens: torch.Tensor | None = None, ctx: PackedContext | None = None, chunk: int = 64,
    kernel: str = "auto", x_weight: torch.Tensor | None = None, checked: bool = False, y_fp32: bool = False,
) -> torch.Tensor:  # fmt: skip
    """The SSD scan over packed rows; returns y [B,T,H,P] in x's dtype (see the module docstring). x_weight
    [B,T,H]: the input's weight per token in place of dt (the Triton op takes it in fp32). checked: the caller
    checked bare cu_seqlens' values already (kernels/mamba3 hands over its rank sub-tokens' boundaries). y_fp32: y in
    fp32 (at least), not x's dtype (Mamba-3 subtracts a term from it that a bf16 y would have rounded).

    The documents: ctx, the batch's PackedContext (its cu_seqlens, validated when it was built: nothing is
    checked or read back here), or bare cu_seqlens (checked here, varlen.check_cu_seqlens), or neither (each
    row one document). kernel: "triton" (the custom op; CUDA, or CPU under TRITON_INTERPRET=1), "chunked"
    (plain torch, compilable: the CPU path), "reference" (the step loop), or "auto": Triton on CUDA, chunked
    elsewhere.
    """
    if ctx is not None:
        check_context(ctx)
        if cu_seqlens is not None:
            raise ValueError("give ctx or cu_seqlens, not both")
        if ctx.shape != tuple(x.shape[:2]):
            raise ValueError(f"ctx is for [B,T] = {ctx.shape}, x is {tuple(x.shape)}")
        cu_seqlens = ctx.cu_seqlens
    validate_ssd_inputs(x, dt, A, Bm, Cm, cu_seqlens, validated=ctx is not None or checked, x_weight=x_weight)
    if kernel not in KERNELS:
        raise ValueError(f"kernel must be one of {KERNELS}, got {kernel!r}")
    if not isinstance(chunk, int) or chunk < 1:
        raise ValueError(f"chunk must be an int >= 1, got {chunk!r}")
    if kernel == "auto":
        kernel = "triton" if x.device.type == "cuda" else "chunked"
    if kernel == "reference":
        return ssd_scan_reference(x, dt, A, Bm, Cm, cu_seqlens, x_weight=x_weight, y_fp32=y_fp32)
    if kernel == "chunked":
        return ssd_chunked_torch(x, dt, A, Bm, Cm, cu_seqlens, chunk=chunk, x_weight=x_weight, y_fp32=y_fp32)
    B, T, H, P = x.shape
    N, n_docs = Bm.shape[-1], (B if cu_seqlens is None else cu_seqlens.shape[0] - 1)
    elements = max(_n_slots(B * T, chunk, n_docs) * H * P * N, B * T * H * max(P, N))
    if elements >= 2**31:  # the kernels index in int32
        raise ValueError(f"the Triton SSD indexes in int32: x {tuple(x.shape)} with N={N}, chunk={chunk} and "
                         f"{n_docs} documents needs {elements} elements in one buffer (limit 2**31); split the batch")
    if not launchable(x.device):
        raise RuntimeError(f"kernel='triton' needs CUDA tensors (or TRITON_INTERPRET=1 for CPU tests); x is on {x.device}")
    _pow2_at_least_16("chunk", chunk)
    _pow2_at_least_16("P (x's head dim)", P)
    _pow2_at_least_16("N (Bm's state dim)", N)
    if x.dtype == torch.float64:
        raise ValueError("the Triton SSD takes float32, bfloat16 or float16 x; float64 is for the torch paths")
    if cu_seqlens is None:
        cu_seqlens = torch.arange(0, B * T + 1, T, device=x.device, dtype=torch.int32)
    order = ctx.longest_first if ctx is not None else documents_longest_first(cu_seqlens)
    # no generator expression: dynamo cannot trace one under fullgraph
    needs_grad = torch.is_grad_enabled() and (
        x.requires_grad or dt.requires_grad or A.requires_grad or Bm.requires_grad or Cm.requires_grad
        or (x_weight is not None and x_weight.requires_grad)
    )
    if x_weight is not None:
        x_weight = x_weight.float().contiguous()
    y, _ = ssd_scan_fwd(
        x.contiguous(), dt.contiguous(), A.contiguous(), Bm.contiguous(), Cm.contiguous(), cu_seqlens, order, chunk,
        needs_grad, x_weight, y_fp32,
    )
    return y
