"""M2RNN scan: the torch reference loop and the Triton forward/backward kernels, side by side.

Per head, with state h [K, V] (fp32), W [V, V], and per step q_t, k_t [K], v_t [V], f_t:

    z_t = tanh(h_{t-1} @ W + k_t (x) v_t)
    h_t = f_t * h_{t-1} + (1 - f_t) * z_t
    y_t = q_t @ h_t                                   [V]

At every document start the previous state is replaced by the initial state h0.

Layout (all contiguous): q, k [B,S,H,K]; v [B,S,H,V]; f [B,S,H]; W [H,V,V]; y [B,S,H,V].
The kernels see the flattened time axis split into *ranges* (rows, or varlen sequences from
cu_seqlens), each with its own h0 [P,H,K,V], and a per-token reset flag for document starts
inside a range. One program runs one (range, head, block of state rows) from start to end; a range's programs
start longest range first (PackedContext.longest_first) and the rows a program are planned from the ranges' host
lengths (plan_block_k).

Backward states: the forward stores the state every CHUNK steps (fp32). The backward (bwd_order="parallel", the
default) first recomputes every chunk of every document at once from its checkpoint (_m2rnn_recompute_kernel: the
state each step used, into one [B*S, H, K, V] buffer, and dq), then runs the reverse recurrence as one chain of S steps
a document. bwd_order="serial" keeps only a chunk of scratch a program: it walks the chunks in reverse, recomputing
each before reversing it, two chains of S steps (for memory: the parallel order's buffer is B*S*H*K*V states).
CHUNK=1 degenerates to storing every state.

Precision: the state is fp32 in every path. For 16-bit inputs the state matmuls run on TF32, tanh is the GPU's
tanh.approx.f32 (relative error about 2**-11, the order of TF32's own rounding; the exact form under the interpreter
and for fp32 inputs), and the backward's reverse pass takes its three MMAs with operands in the inputs' dtype and
reads the parallel order's states stored in it (BWD_DOTS_IN_INPUT_DTYPE; fp32 accumulation, fp32 state gradient).
"""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from megacpp_lab.kernels import INTERPRETED, OFFLINE_COMPILE, launchable, warn_at_caller
from megacpp_lab.kernels.ssd import FLOAT_DTYPES, slot_document
from megacpp_lab.varlen import (PackedContext, build_context, check_context, check_cu_seqlens,
                                documents_longest_first, host_lengths)

__all__ = [
    "BWD_ORDERS",
    "DEFAULT_KERNEL",
    "KERNELS",
    "m2rnn_scan",
    "m2rnn_scan_bwd",
    "m2rnn_scan_fwd",
    "m2rnn_scan_reference",
    "plan_backward",
    "plan_block_k",
    "plan_bwd_block_k",
    "plan_segments",
    "plan_warps",
    "plan_z_scratch",
    "resolve_kernel",
]


# ----------------------------------------------------------------------------- reference


@torch.compiler.disable
def m2rnn_scan_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    f: torch.Tensor,
    W: torch.Tensor,
    h0: torch.Tensor,
    reset: torch.Tensor,
    h0_index: torch.Tensor,
    grad_clip: float = 0.0,
) -> torch.Tensor:
    """Plain step loop, fp32 state. reset [B,S] bool: document starts (row starts included);
    h0 [N,H,K,V]; h0_index [B,S]: which h0 a reset at (b,t) loads. Returns y [B,S,H,V] (input dtype).

    Disabled for torch.compile: dynamo would unroll the S steps into one enormous graph.
    grad_clip > 0 clamps the gradient of every state h_t to [-clip, clip] in the backward.
    """
    B, S, H, K = q.shape
    acc = torch.promote_types(q.dtype, torch.float32)  # fp32 state; fp64 for gradcheck
    Wf, h0f = W.to(acc), h0.to(acc)
    h = h0f[h0_index[:, 0]]  # [B,H,K,V]
    ys = []
    for t in range(S):
        r = reset[:, t].view(B, 1, 1, 1)
        h = torch.where(r, h0f[h0_index[:, t]], h)
        kt, vt, qt = k[:, t].to(acc), v[:, t].to(acc), q[:, t].to(acc)
        z = torch.tanh(h @ Wf + kt[..., :, None] * vt[..., None, :])
        ft = f[:, t].to(acc).view(B, H, 1, 1)
        h = ft * h + (1 - ft) * z
        if grad_clip > 0 and h.requires_grad:
            h.register_hook(lambda g: g.clamp(-grad_clip, grad_clip))
        ys.append((qt[..., None, :] @ h).squeeze(-2))
    return torch.stack(ys, dim=1).to(q.dtype)


# ----------------------------------------------------------------------------- kernels


@triton.jit
def _tanh(x, PRECISION: tl.constexpr):
    """tanh for the state update: for 16-bit inputs (PRECISION "tf32") the GPU's tanh.approx.f32, one MUFU op
    (relative error about 2**-11, TF32's own order; the exact form's exp and division were the largest share of the
    state update's time at V=64 in an H200 probe, not a receipt: no receipt row isolates it); the exact form for
    fp32 inputs and under the interpreter."""
    if PRECISION == "tf32" and not INTERPRETED:
        return tl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=r,r", [x], dtype=tl.float32, is_pure=True, pack=1)
    return 1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0)


@triton.jit
def _state_times_w(h, W, PRECISION: tl.constexpr):
    """h [K,V] @ W [V,V] on the tensor cores; PRECISION is "ieee" for fp32 inputs, "tf32" for bf16/fp16.

    (A broadcast-and-sum written out by hand is rewritten by Triton into the same MMA at its
    default TF32 precision, so the precision is chosen here, explicitly.)
    """
    return tl.dot(h, W, input_precision=PRECISION)


@triton.jit
def _mma(a, b, PRECISION: tl.constexpr, DOT: tl.constexpr):
    """a @ b accumulated in fp32, its operands in DOT: fp32 at PRECISION (the forward's), or the inputs' 16-bit
    dtype (the backward's reverse pass with BWD_DOTS_IN_INPUT_DTYPE: twice the MMA rate, half the registers)."""
    if DOT == tl.float32:
        return tl.dot(a, b, input_precision=PRECISION)
    if INTERPRETED:  # the interpreter multiplies 16-bit floats' raw bits: the same rounding, the products in fp32
        return tl.dot(a.to(DOT).to(tl.float32), b.to(DOT).to(tl.float32), input_precision="ieee")
    return tl.dot(a.to(DOT), b.to(DOT), out_dtype=tl.float32)


L2_AHEAD = tl.constexpr(8)  # steps between the L2 prefetch and the use


@triton.jit
def _prefetch_l2(ptr):
    if not INTERPRETED:
        tl.inline_asm_elementwise(
            "prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;", "=r,l", [ptr], dtype=tl.int32, is_pure=False, pack=1
        )


@triton.jit
def _prefetch_step(q_ptr, k_ptr, v_ptr, f_ptr, reset_ptr, t, hd, H, k0, K: tl.constexpr, V: tl.constexpr):
    """Pull step t's inputs into L2 without waiting for them.

    The scan is one dependent chain: a step's loads issued one step ahead can still be waiting on
    DRAM when the step needs them; prefetched into L2 several steps ahead, they are served from L2.
    Under the interpreter nothing is prefetched, and the address arithmetic is skipped too (about a third
    of an interpreted scan's time on a CPU)."""
    if not INTERPRETED:
        row = t * H + hd
        _prefetch_l2(q_ptr + row * K + k0)
        _prefetch_l2(k_ptr + row * K + k0)
        _prefetch_l2(v_ptr + row * V)
        _prefetch_l2(f_ptr + row)
        _prefetch_l2(reset_ptr + t)


@triton.jit
def _load_step(q_ptr, k_ptr, v_ptr, f_ptr, reset_ptr, t, hd, H, rk, rv, K: tl.constexpr, V: tl.constexpr):
    row = t * H + hd
    qt = tl.load(q_ptr + row * K + rk).to(tl.float32)
    kt = tl.load(k_ptr + row * K + rk).to(tl.float32)
    vt = tl.load(v_ptr + row * V + rv).to(tl.float32)
    ft = tl.load(f_ptr + row).to(tl.float32)
    rt = tl.load(reset_ptr + t)
    return qt, kt, vt, ft, rt


@triton.jit
def _next_step(q_ptr, k_ptr, v_ptr, f_ptr, reset_ptr, t, last, hd, H, rk, rv, k0, K: tl.constexpr, V: tl.constexpr):
    """Software pipelining by hand, in a loop forward over steps: step t + 1's inputs (clamped to `last`), loaded
    before step t's math, off the state's critical path, and step t + L2_AHEAD's pulled into L2."""
    _prefetch_step(q_ptr, k_ptr, v_ptr, f_ptr, reset_ptr, tl.minimum(t + L2_AHEAD, last), hd, H, k0, K, V)
    return _load_step(q_ptr, k_ptr, v_ptr, f_ptr, reset_ptr, tl.minimum(t + 1, last), hd, H, rk, rv, K, V)


@triton.jit
def _program(order_ptr, H, NKB: tl.constexpr, ORDERED: tl.constexpr):
    """A scan program's (range p, head hd, row block kb) on the one-axis grid of ranges * H * NKB programs (axis 0:
    2**31 - 1 programs, where axis 1 would cap the ranges at 65535), in the order the GPU starts them: the j-th
    range's H * NKB programs, then the next's, the j-th range being order_ptr[j] (ORDERED: the ranges longest first,
    PackedContext.longest_first; else the ranges in order). Every program of a range is a serial chain of its
    steps, so the launch lasts at least the longest range's chain: started first, it runs beside the rest instead
    of after them."""
    pid = tl.program_id(0)
    j = pid // (H * NKB)
    p = tl.load(order_ptr + j) if ORDERED else j
    return p, (pid // NKB) % H, pid % NKB


@triton.jit
def _m2rnn_fwd_kernel(
    q_ptr, k_ptr, v_ptr, f_ptr, w_ptr, h0_ptr, ranges_ptr, order_ptr, reset_ptr,
    y_ptr, ckpt_ptr,
    H, n_rows,
    K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, CHUNK: tl.constexpr, SAVE: tl.constexpr,
    PRECISION: tl.constexpr, HAS_H0: tl.constexpr, ORDERED: tl.constexpr,
):  # fmt: skip
    # rows of the state evolve independently (W acts on V), so a program may own BK of the K rows;
    # with BK < K its y is a partial sum over its rows, written as fp32 [K/BK, n_rows, V]
    p, hd, kb = _program(order_ptr, H, K // BK, ORDERED)
    start = tl.load(ranges_ptr + p)
    end = tl.load(ranges_ptr + p + 1)
    rk = kb * BK + tl.arange(0, BK)
    rv = tl.arange(0, V)
    kv = rk[:, None] * V + rv[None, :]
    W = tl.load(w_ptr + hd * V * V + rv[:, None] * V + rv[None, :]).to(tl.float32)
    if HAS_H0:
        h0 = tl.load(h0_ptr + (p * H + hd) * K * V + kv)
    else:  # h0=None: every document starts from zeros (h0_ptr is a placeholder, never read)
        h0 = tl.zeros((BK, V), dtype=tl.float32)
    h = h0
    slot = start // CHUNK + p  # kernels/ssd.py's slot layout: this document's first checkpoint
    # software pipelining: step t+1's inputs are loaded before step t's math, off the state's critical path
    qn, kn, vn, fn, rn = _load_step(q_ptr, k_ptr, v_ptr, f_ptr, reset_ptr, start, hd, H, rk, rv, K, V)
    for t in range(start, end):
        qt, kt, vt, ft, rt = qn, kn, vn, fn, rn
        qn, kn, vn, fn, rn = _next_step(q_ptr, k_ptr, v_ptr, f_ptr, reset_ptr, t, end - 1, hd, H, rk, rv, kb * BK, K, V)
        if SAVE:
            rel = t - start
            if rel % CHUNK == 0:
                tl.store(ckpt_ptr + ((slot + rel // CHUNK) * H + hd) * K * V + kv, h)
        h = tl.where(rt != 0, h0, h)
        z = _tanh(_state_times_w(h, W, PRECISION) + kt[:, None] * vt[None, :], PRECISION)
        h = ft * h + (1.0 - ft) * z
        yt = tl.sum(qt[:, None] * h, axis=0)
        if BK == K:
            tl.store(y_ptr + (t * H + hd) * V + rv, yt.to(y_ptr.dtype.element_ty))
        else:
            tl.store(y_ptr + (kb * n_rows + t * H + hd) * V + rv, yt)


@triton.jit
def _recompute_step(h, h0, kt, vt, rt, W, PRECISION: tl.constexpr):
    """A forward step from the state before it: the state the step used (h0 at a document start), and z."""
    hp = tl.where(rt != 0, h0, h)
    return hp, _tanh(_state_times_w(hp, W, PRECISION) + kt[:, None] * vt[None, :], PRECISION)


@triton.jit
def _reverse_step(qt, kt, vt, ft, rt, dyt, hp, z, dh, dW, dh0, W, clip, row, kb, n_rows, rk, rv,
                  dq_ptr, dk_ptr, dv_ptr, df_ptr, K: tl.constexpr, V: tl.constexpr, NKB: tl.constexpr,
                  CLIP: tl.constexpr, PRECISION: tl.constexpr, HAS_H0: tl.constexpr, DOT: tl.constexpr,
                  STORE_DQ: tl.constexpr):  # fmt: skip
    """One step of the reverse recurrence for the state rows rk, from the state the step used (hp) and its z:
    stores dk, dv (an fp32 partial when K is split), df's partial and (STORE_DQ: unless the parallel order's
    recompute pass stored it) dq, and returns dh (the gradient of the state before the step), dW and dh0 summed on.
    The three MMAs take their operands in DOT (_mma)."""
    g = dh + qt[:, None] * dyt[None, :]
    if CLIP:
        g = tl.minimum(tl.maximum(g, -clip), clip)
    if STORE_DQ:
        ht = ft * hp + (1.0 - ft) * z
        tl.store(dq_ptr + row * K + rk, tl.sum(ht * dyt[None, :], axis=1).to(dq_ptr.dtype.element_ty))
    tl.store(df_ptr + kb * n_rows + row, tl.sum(tl.sum(g * (hp - z), axis=1), axis=0))
    da = g * (1.0 - ft) * (1.0 - z * z)
    tl.store(dk_ptr + row * K + rk, tl.sum(da * vt[None, :], axis=1).to(dk_ptr.dtype.element_ty))
    dvt = tl.sum(da * kt[:, None], axis=0)
    if NKB == 1:
        tl.store(dv_ptr + row * V + rv, dvt.to(dv_ptr.dtype.element_ty))
    else:
        tl.store(dv_ptr + (kb * n_rows + row) * V + rv, dvt)
    dprev = ft * g + _mma(da, tl.trans(W), PRECISION, DOT)
    dW += _mma(tl.trans(hp), da, PRECISION, DOT)
    if HAS_H0:
        dh0 += tl.where(rt != 0, dprev, 0.0)
    return tl.where(rt != 0, 0.0, dprev), dW, dh0


@triton.jit
def _bwd_program(w_ptr, h0_ptr, ranges_ptr, order_ptr, H, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr,
                 CHUNK: tl.constexpr, HAS_H0: tl.constexpr, ORDERED: tl.constexpr):  # fmt: skip
    """A backward program's (range p, head hd, row block kb) (_program), its range [start, end), its rows rk and
    columns rv, its state offsets (kv in the [K, V] state, local in a [BK, V] block), W and h0 (zeros without one:
    h0_ptr and dh0_ptr are placeholders then, never read or written), its first checkpoint slot and its program
    index."""
    p, hd, kb = _program(order_ptr, H, K // BK, ORDERED)
    start = tl.load(ranges_ptr + p)
    end = tl.load(ranges_ptr + p + 1)
    rk = kb * BK + tl.arange(0, BK)
    rv = tl.arange(0, V)
    kv = rk[:, None] * V + rv[None, :]
    local = tl.arange(0, BK)[:, None] * V + rv[None, :]
    W = tl.load(w_ptr + hd * V * V + rv[:, None] * V + rv[None, :]).to(tl.float32)
    if HAS_H0:
        h0 = tl.load(h0_ptr + (p * H + hd) * K * V + kv)
    else:
        h0 = tl.zeros((BK, V), dtype=tl.float32)
    return p, hd, kb, start, end, rk, rv, kv, local, W, h0, start // CHUNK + p, (p * H + hd) * (K // BK) + kb


@triton.jit
def _reverse_span(q_ptr, k_ptr, v_ptr, f_ptr, reset_ptr, dy_ptr, prev_ptr, z_ptr, dq_ptr, dk_ptr, dv_ptr, df_ptr,
                  t0, t1, base, stride, offs, dh, dW, dh0, W, clip, hd, H, kb, n_rows, rk, rv, K: tl.constexpr,
                  V: tl.constexpr, BK: tl.constexpr, NKB: tl.constexpr, CLIP: tl.constexpr, PRECISION: tl.constexpr,
                  HAS_H0: tl.constexpr, Z_SCRATCH: tl.constexpr, DOT: tl.constexpr, STORE_DQ: tl.constexpr):  # fmt: skip
    """The reverse recurrence over steps t1 - 1 down to t0 (t1 > t0), from the state each step used, stored at
    prev_ptr + base + (t - t0) * stride + offs (z beside it in z_ptr, or recomputed from it); the next (earlier)
    step's inputs and state loaded before this step's math, off the dh chain, and those L2_AHEAD steps back pulled
    into L2. Returns dh, dW and dh0 summed on."""
    qn, kn, vn, fn, rn = _load_step(q_ptr, k_ptr, v_ptr, f_ptr, reset_ptr, t1 - 1, hd, H, rk, rv, K, V)
    dyn = tl.load(dy_ptr + ((t1 - 1) * H + hd) * V + rv).to(tl.float32)
    at = base + tl.cast(t1 - 1 - t0, tl.int64) * stride + offs  # int64: the parallel order's buffer spans B*S*H*K*V
    hpn = tl.load(prev_ptr + at).to(tl.float32)
    zn = tl.load(z_ptr + at) if Z_SCRATCH else hpn
    for tt in range(t0, t1):
        t = t1 - 1 - (tt - t0)
        qt, kt, vt, ft, rt, dyt, hp, z = qn, kn, vn, fn, rn, dyn, hpn, zn
        if not Z_SCRATCH:
            z = _tanh(_mma(hp, W, PRECISION, DOT) + kt[:, None] * vt[None, :], PRECISION)
        tp = tl.maximum(t - 1, t0)
        ta = tl.maximum(t - L2_AHEAD, t0)
        _prefetch_step(q_ptr, k_ptr, v_ptr, f_ptr, reset_ptr, ta, hd, H, kb * BK, K, V)
        _prefetch_l2(dy_ptr + (ta * H + hd) * V)
        qn, kn, vn, fn, rn = _load_step(q_ptr, k_ptr, v_ptr, f_ptr, reset_ptr, tp, hd, H, rk, rv, K, V)
        dyn = tl.load(dy_ptr + (tp * H + hd) * V + rv).to(tl.float32)
        at = base + tl.cast(tp - t0, tl.int64) * stride + offs
        hpn = tl.load(prev_ptr + at).to(tl.float32)
        if Z_SCRATCH:
            zn = tl.load(z_ptr + at)
        dh, dW, dh0 = _reverse_step(qt, kt, vt, ft, rt, dyt, hp, z, dh, dW, dh0, W, clip, t * H + hd, kb, n_rows,
                                    rk, rv, dq_ptr, dk_ptr, dv_ptr, df_ptr, K, V, NKB, CLIP, PRECISION, HAS_H0,
                                    DOT, STORE_DQ)  # fmt: skip
    return dh, dW, dh0


@triton.jit(do_not_specialize=["seg", "SEG"])
def _m2rnn_recompute_kernel(
    k_ptr, v_ptr, f_ptr, w_ptr, h0_ptr, ranges_ptr, reset_ptr, ckpt_ptr, dy_ptr,
    prev_ptr, z_ptr, dq_ptr, seg_off_ptr, seg, SEG, H, D, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr,
    CHUNK: tl.constexpr, PRECISION: tl.constexpr, HAS_H0: tl.constexpr, Z_SCRATCH: tl.constexpr,
):  # fmt: skip
    """The parallel order's first pass over segment `seg` (steps [seg * SEG, (seg + 1) * SEG) of every document): one
    program per (checkpoint slot, head, block of BK state rows) recomputes its chunk from the checkpoint, every chunk
    of the segment at once, and stores the state each step used (after any reset) in the buffer's row of that step
    (document p's steps of the segment from row seg_off[p]), in the buffer's dtype (z beside it with Z_SCRATCH). It
    also stores dq = h_t dy_t, which needs no state gradient: the reverse pass's serial steps skip that reduction (a
    probe on the H200, not a receipt, found every reduction off the chain worth moving). Slots outside the segment,
    or past a document's chunks (the slot count is a bound), store nothing."""
    s = tl.program_id(0)
    hd = tl.program_id(1)
    kb = tl.program_id(2)
    p, start = slot_document(ranges_ptr, s, D, CHUNK)
    end = tl.load(ranges_ptr + p + 1)
    c = s - (start // CHUNK + p)
    t0 = start + c * CHUNK
    t1 = tl.minimum(t0 + CHUNK, end)
    # another segment's chunk, or a slot before the first document (ranges[0] > 0: c < 0, and // truncates): no steps
    t1 = tl.where((c >= 0) & (c // (SEG // CHUNK) == seg), t1, t0)
    row0 = tl.load(seg_off_ptr + p) - (start + seg * SEG)  # the buffer row of step t is row0 + t
    rk = kb * BK + tl.arange(0, BK)
    rv = tl.arange(0, V)
    kv = rk[:, None] * V + rv[None, :]
    if t0 < t1:
        W = tl.load(w_ptr + hd * V * V + rv[:, None] * V + rv[None, :]).to(tl.float32)
        if HAS_H0:
            h0 = tl.load(h0_ptr + (p * H + hd) * K * V + kv)
        else:
            h0 = tl.zeros((BK, V), dtype=tl.float32)
        h = tl.load(ckpt_ptr + (s * H + hd) * K * V + kv)
        # the step loaders read q too: k's pointer stands in for it here, and the unused load is dropped as dead code
        _, kn, vn, fn, rn = _load_step(k_ptr, k_ptr, v_ptr, f_ptr, reset_ptr, t0, hd, H, rk, rv, K, V)
        for t in range(t0, t1):
            kt, vt, ft, rt = kn, vn, fn, rn
            _, kn, vn, fn, rn = _next_step(k_ptr, k_ptr, v_ptr, f_ptr, reset_ptr, t, t1 - 1, hd, H, rk, rv, kb * BK, K, V)
            hp, z = _recompute_step(h, h0, kt, vt, rt, W, PRECISION)
            at = (tl.cast(row0 + t, tl.int64) * H + hd) * (K * V) + kv
            tl.store(prev_ptr + at, hp.to(prev_ptr.dtype.element_ty))
            if Z_SCRATCH:
                tl.store(z_ptr + at, z)
            h = ft * hp + (1.0 - ft) * z
            dyt = tl.load(dy_ptr + (t * H + hd) * V + rv).to(tl.float32)
            tl.store(dq_ptr + (t * H + hd) * K + rk, tl.sum(h * dyt[None, :], axis=1).to(dq_ptr.dtype.element_ty))


@triton.jit(do_not_specialize=["seg", "SEG"])
def _m2rnn_bwd_kernel(
    q_ptr, k_ptr, v_ptr, f_ptr, w_ptr, h0_ptr, ranges_ptr, order_ptr, reset_ptr, ckpt_ptr, dy_ptr,
    dq_ptr, dk_ptr, dv_ptr, df_ptr, dw_ptr, dh0_ptr, prev_ptr, z_ptr, seg_off_ptr, carry_ptr, seg, SEG,
    H, n_rows, clip,
    K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, CHUNK: tl.constexpr, CLIP: tl.constexpr,
    PRECISION: tl.constexpr, HAS_H0: tl.constexpr, Z_SCRATCH: tl.constexpr, PARALLEL: tl.constexpr,
    CARRY: tl.constexpr, DOT: tl.constexpr, ORDERED: tl.constexpr,
):  # fmt: skip
    # one program per (range, head, block of BK state rows): dq, dk, dh0 are row-local; dv, df and
    # dW sum over rows, so each block writes fp32 partials [K/BK, ...] that the launcher adds up.
    # Z_SCRATCH: the recompute pass stores z beside the previous state, or the reverse pass recomputes z
    # from that state (one more MMA a step, off the dh chain; half the scratch traffic).
    # PARALLEL: _m2rnn_recompute_kernel has already stored the state (and z) of every step of segment `seg` (steps
    # [seg * SEG, (seg + 1) * SEG) of each document, document p's from buffer row seg_off[p]), and dq; this kernel
    # is the reverse pass over the segment, one chain. CARRY (more than one segment, launched last first): dh, dW
    # and dh0 are read from and written back to memory (carry_ptr, dw_ptr, dh0_ptr, zeroed by the launcher) around
    # the segment. Otherwise (serial) each chunk, last first, is recomputed into a chunk of scratch and then
    # reversed: two chains.
    NKB: tl.constexpr = K // BK
    p, hd, kb, start, end, rk, rv, kv, local, W, h0, slot, prog = _bwd_program(
        w_ptr, h0_ptr, ranges_ptr, order_ptr, H, K, V, BK, CHUNK, HAS_H0, ORDERED)
    dh = tl.zeros((BK, V), dtype=tl.float32)
    dW = tl.zeros((V, V), dtype=tl.float32)
    dh0 = tl.zeros((BK, V), dtype=tl.float32)
    if PARALLEL:
        lo = start + seg * SEG
        hi = tl.minimum(end, lo + SEG)
        if lo < hi:
            if CARRY:
                dh = tl.load(carry_ptr + prog * BK * V + local)
                dW = tl.load(dw_ptr + prog * V * V + rv[:, None] * V + rv[None, :])
                if HAS_H0:
                    dh0 = tl.load(dh0_ptr + (p * H + hd) * K * V + kv)
            base = (tl.cast(tl.load(seg_off_ptr + p), tl.int64) * H + hd) * (K * V)
            dh, dW, dh0 = _reverse_span(q_ptr, k_ptr, v_ptr, f_ptr, reset_ptr, dy_ptr, prev_ptr, z_ptr, dq_ptr, dk_ptr,
                                        dv_ptr, df_ptr, lo, hi, base, H * K * V, kv, dh, dW, dh0, W, clip, hd, H, kb,
                                        n_rows, rk, rv, K, V, BK, NKB, CLIP, PRECISION, HAS_H0, Z_SCRATCH, DOT,
                                        False)  # fmt: skip
            if CARRY:
                tl.store(carry_ptr + prog * BK * V + local, dh)
                tl.store(dw_ptr + prog * V * V + rv[:, None] * V + rv[None, :], dW)
                if HAS_H0:
                    tl.store(dh0_ptr + (p * H + hd) * K * V + kv, dh0)
    else:
        scratch = prog * CHUNK * BK * V
        n_chunks = (end - start + CHUNK - 1) // CHUNK
        for cc in range(0, n_chunks):
            c = n_chunks - 1 - cc
            t0 = start + c * CHUNK
            t1 = tl.minimum(t0 + CHUNK, end)
            # recompute the chunk: the previous state each step used (after any reset), and z
            h = tl.load(ckpt_ptr + ((slot + c) * H + hd) * K * V + kv)
            qn, kn, vn, fn, rn = _load_step(q_ptr, k_ptr, v_ptr, f_ptr, reset_ptr, t0, hd, H, rk, rv, K, V)
            for t in range(t0, t1):
                qt, kt, vt, ft, rt = qn, kn, vn, fn, rn
                qn, kn, vn, fn, rn = _next_step(q_ptr, k_ptr, v_ptr, f_ptr, reset_ptr, t, t1 - 1, hd, H, rk, rv, kb * BK,
                                                K, V)  # fmt: skip
                h, z = _recompute_step(h, h0, kt, vt, rt, W, PRECISION)
                tl.store(prev_ptr + scratch + (t - t0) * BK * V + local, h.to(prev_ptr.dtype.element_ty))
                if Z_SCRATCH:
                    tl.store(z_ptr + scratch + (t - t0) * BK * V + local, z)
                h = ft * h + (1.0 - ft) * z
            # reverse over the chunk, next (earlier) step's inputs prefetched
            dh, dW, dh0 = _reverse_span(q_ptr, k_ptr, v_ptr, f_ptr, reset_ptr, dy_ptr, prev_ptr, z_ptr, dq_ptr, dk_ptr,
                                        dv_ptr, df_ptr, t0, t1, scratch, BK * V, local, dh, dW, dh0, W, clip, hd, H,
                                        kb, n_rows, rk, rv, K, V, BK, NKB, CLIP, PRECISION, HAS_H0, Z_SCRATCH, DOT,
                                        True)  # fmt: skip
    if not (PARALLEL and CARRY):  # (with CARRY each segment's program wrote its own sums above)
        tl.store(dw_ptr + prog * V * V + rv[:, None] * V + rv[None, :], dW)
        if HAS_H0:
            tl.store(dh0_ptr + (p * H + hd) * K * V + kv, dh0)


# ----------------------------------------------------------------------------- launchers

# num_warps per kernel and state-matmul precision. bf16 (tf32) measured on an H200 (bench m2rnn's peer grid,
# B=16 S=1024 H=32 V in {16, 32, 64}, and B=8 S=512 H=64): two warps a program are fastest at every state block
# in the forward and up to 2048 state elements in the backward; more warps only add cross-warp reductions and
# barriers to each serial step, and cost resident programs. fp32 (ieee) kept from the H100 tuning.
FWD_WARPS = {"tf32": 2, "ieee": 4}
BWD_WARPS = {"tf32": 2, "ieee": 2}
# The backward's state block: at most this many elements (BK x V), one warp per BWD_ELEMENTS_PER_WARP of them past
# the tuned count (plan_warps). With the reverse pass's MMA operands in the inputs' dtype (half the registers), 64 rows
# at 4 warps beat 32 rows at 2 at V=64 in an H200 probe (not a receipt); the fp32-operand kernel had spilled past
# 2048 elements at 2 warps.
BWD_MAX_BLOCK = 4096
BWD_ELEMENTS_PER_WARP = 1024
MIN_BLOCK_K = 16  # the smallest K-split block (tl.dot's smallest M)
MAX_WARPS = 8
Z_MODES = ("auto", "scratch", "recompute")
# the backward's order (module docstring): "parallel" (every chunk recomputed at once, then one reverse chain: a
# [B*S, H, K, V] buffer of states) or "serial" (a chunk of scratch a program, two chains). Parallel is the default: it
# took 0.61x to 0.83x serial's forward+backward time at the six points of
# profiles/nvidia-h200/m2rnn/m2rnn_peer_grid.json at c29df51 (bench m2rnn keeps a serial row beside the plan). A third order, chunk c reversed while chunk c-1 was
# recomputed in one loop, took 1.27x to 1.71x serial's at all seven points of that receipt at 28de8fc and was removed.
BWD_ORDERS = ("parallel", "serial")
# the reverse pass's three MMAs (z from the stored state, the state gradient through W, dW) with operands in the inputs'
# 16-bit dtype, and the parallel order's stored states in it too (the MMAs round them to it; df's hp - z is the one
# other reader): fp32 accumulation, fp32 state gradient. False: fp32 operands (TF32, the forward's precision) and fp32
# states. bench m2rnn's peer grid measures the other setting beside the default, with both gradients' errors.
BWD_DOTS_IN_INPUT_DTYPE = True
# the parallel order's state buffer: at most this many bytes where segmenting the documents' steps can keep it there
# (plan_segments), segments of at least PARALLEL_MIN_SEGMENT steps (a pair of launches each)
PARALLEL_BUFFER_BYTES = 64 * 2**20
PARALLEL_MIN_SEGMENT = 1024
_BWD_DOT = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


@functools.lru_cache(maxsize=None)
def _gpu_limits(index: int) -> tuple[int, int]:
    """(SM count, L2 bytes) of CUDA device `index`; on a CPU (the interpreter) one SM and no L2 to spill from."""
    if index < 0:
        return 1, 1 << 62
    props = torch.cuda.get_device_properties(index)
    return props.multi_processor_count, props.L2_cache_size


# kernels/resources.py's offline compile plans as a GH100 would (the H100 SXM and the H200): 132 SMs, 50 MiB of L2
OFFLINE_LIMITS = (132, 50 * 2**20)


def _limits(device: torch.device) -> tuple[int, int]:
    if device.type == "cpu" and OFFLINE_COMPILE.get():
        return OFFLINE_LIMITS
    return _gpu_limits(-1 if device.type != "cuda" else device.index if device.index is not None else torch.cuda.current_device())


# The launch plan's cost model (plan_block_k). A program, one (range, head, block of BK state rows), is a serial chain
# of its range's steps. Alone on an SM a step takes about a + b * BK * V * 2 / warps microseconds (its latency: the
# state elements a warp holds); with several programs taking turns on an SM, each step occupies the SM for about
# c + d * BK * V (its throughput cost). A launch then lasts about max(the longest range * latency, every program's
# steps * throughput cost / SMs): the longest document's chain, started first (_program), or the SMs' work. Fitted on
# an H100 to bf16 scans at H=16, K=64, V=16 (scripts/m2rnn_plan_probe.py: B=4 T=4096 with 8 even documents a row,
# and with bench compile's seeded-random ones, the longest 1821 tokens, at BK = 16, 32, 64; and bench m2rnn's
# one-document rows; profiles/nvidia-h100-80gb-hbm3/m2rnn/m2rnn_plan_probe.json); the backward's is its reverse pass
# (the recompute pass runs every chunk at once and takes whole rows, _recompute_block_k).
PLAN_COST_US = {  # stage: (a, b, c, d)
    "fwd": (0.267, 2.1e-4, 0.044, 1.1e-4),
    "bwd": (0.51, 3.4e-4, 0.079, 2.25e-4),
}
# the plan takes the largest block whose modelled time is within this factor of the fastest's: a split also writes
# fp32 partials of y (dv and df) and reduces them, which the model does not count
PLAN_SPLIT_MARGIN = 0.9
PLAN_STAGES = tuple(PLAN_COST_US)


def _check_block_k(block_k: int, K: int) -> int:
    if block_k < MIN_BLOCK_K or K % block_k or block_k & (block_k - 1):
        raise ValueError(f"block_k must be a power of two >= {MIN_BLOCK_K} dividing K={K}, got {block_k}")
    return block_k


def plan_makespan_us(lengths: Sequence[int], H: int, K: int, V: int, bk: int, device: torch.device,
                     stage: str = "fwd") -> float:  # fmt: skip
    """The cost model's time for a launch over ranges of these lengths (host ints) at BK = bk (PLAN_COST_US). The
    interpreter runs one program at a time: there every program's steps add up at their latency."""
    a, b, c, d = PLAN_COST_US[stage]
    # a step's latency grows with the state elements each warp holds: the backward gives a large block more warps
    # (plan_warps; 64 x 64 at 4 warps took its reverse pass faster than 32 x 64 at 2 on an H100, m2rnn_plan_probe)
    warps = plan_warps(BWD_WARPS["tf32"], bk, V) if stage == "bwd" else FWD_WARPS["tf32"]
    latency, occupancy = a + b * bk * V * FWD_WARPS["tf32"] / warps, c + d * bk * V
    steps = sum(lengths) * H * (K // bk)
    if device.type == "cpu" and not OFFLINE_COMPILE.get():
        return steps * latency
    sms, _ = _limits(device)
    return max(max(lengths, default=0) * latency, steps * occupancy / sms)


def plan_block_k(lengths: Sequence[int], H: int, K: int, V: int, device: torch.device, *, stage: str = "fwd",
                 block_k: int = 0, max_rows: int = 0) -> int:  # fmt: skip
    """State rows per program (block_k, when given, else the plan) for ranges of these lengths (host ints: a
    PackedContext's cu_seqlens_host, no device read) and H heads. Splitting a (range, head) pair's K rows over K/BK
    programs shortens each step of its chain but multiplies the programs' steps: the plan takes the BK with the
    shortest plan_makespan_us, or a larger one within PLAN_SPLIT_MARGIN of it. One long document among short
    ones is split (its chain is the launch), many documents of even lengths are not (the SMs' work is). max_rows
    (> 0) caps BK: the backward's register budget (BWD_MAX_BLOCK // V rows)."""
    if block_k:
        return _check_block_k(block_k, K)
    if stage not in PLAN_STAGES:
        raise ValueError(f"stage must be one of {PLAN_STAGES}, got {stage!r}")
    sizes = [bk for bk in (K >> i for i in range(K.bit_length())) if bk >= MIN_BLOCK_K and not (max_rows and bk > max_rows)]
    if not sizes:  # a cap below the smallest split (never the backward's, _bwd_max_rows), or K below it: the smallest
        return min(MIN_BLOCK_K, K)
    times = {bk: plan_makespan_us(lengths, H, K, V, bk, device, stage) for bk in sizes}
    fastest = min(times.values())
    # the largest block within the margin of the fastest (sizes run from the largest down)
    return next(bk for bk in sizes if PLAN_SPLIT_MARGIN * times[bk] <= fastest)


def _bwd_max_rows(V: int) -> int:
    return max(MIN_BLOCK_K, BWD_MAX_BLOCK // V)


def plan_bwd_block_k(lengths: Sequence[int], H: int, K: int, V: int, device: torch.device, block_k: int = 0) -> int:
    """The backward's state rows per program: plan_block_k's backward model under the register cap of
    BWD_MAX_BLOCK elements."""
    return plan_block_k(lengths, H, K, V, device, stage="bwd", block_k=block_k, max_rows=_bwd_max_rows(V))


def _recompute_block_k(K: int, V: int) -> int:
    """The parallel order's recompute pass: one program per checkpoint slot runs a chunk, thousands of short chains
    at once, so nothing is gained by splitting rows (whole rows, up to the backward's register cap)."""
    return min(K, _bwd_max_rows(V)) if K >= MIN_BLOCK_K else K


def plan_warps(base: int, bk: int, V: int) -> int:
    """The backward's num_warps for BK x V state blocks: one warp per BWD_ELEMENTS_PER_WARP elements, at least the
    tuned count, so a large block (64 x 64 at BWD_MAX_BLOCK, or a block_k override) does not spill. The forward runs
    its tuned count at every block."""
    return max(base, min(MAX_WARPS, (bk * V) // BWD_ELEMENTS_PER_WARP))


def plan_z_scratch(programs: int, chunk: int, bk: int, V: int, device: torch.device, z_mode: str = "auto") -> bool:
    """Whether the backward keeps z in scratch beside the previous state (z_mode 'scratch') or recomputes it in the
    reverse pass ('recompute'). 'auto' keeps it while both scratch buffers, written and read back a chunk later,
    fit in half of L2: past that they go to DRAM, twice, and one more MMA a step is the cheaper side."""
    if z_mode not in Z_MODES:
        raise ValueError(f"z_mode must be one of {Z_MODES}, got {z_mode!r}")
    if z_mode != "auto":
        return z_mode == "scratch"
    _, l2 = _limits(device)
    return 2 * programs * chunk * bk * V * 4 <= l2 // 2


def plan_segments(docs: int, tokens: int, chunk: int, bytes_per_step: int) -> tuple[int, int]:
    """The parallel backward's segment (steps of each document recomputed and reversed per pair of launches, a
    multiple of chunk) and the segment count. One segment spans every step (its buffer holds every step of every
    document: tokens x bytes_per_step) unless that buffer is over PARALLEL_BUFFER_BYTES and documents are few
    enough that segments of at least PARALLEL_MIN_SEGMENT steps shrink it (docs x segment < tokens): then the
    segment is the longest that keeps docs x segment steps within the budget. Few long documents get segments
    (B=2 rows of 4096 at H=8, K=64, V=16: two segments of 2048 steps, a 64 MiB buffer where one was 128 MiB);
    many short ones one segment, whose buffer is then no larger than their own total."""
    whole = -(-tokens // chunk) * chunk
    if tokens * bytes_per_step <= PARALLEL_BUFFER_BYTES:
        return whole, 1
    seg = max(PARALLEL_MIN_SEGMENT, PARALLEL_BUFFER_BYTES // (docs * bytes_per_step)) // chunk * chunk
    if seg == 0 or docs * seg >= tokens:
        return whole, 1
    return seg, -(-tokens // seg)


def plan_backward(lengths: Sequence[int], H: int, K: int, V: int, chunk: int, device: torch.device, *,
                  block_k: int = 0, z_mode: str = "auto", bwd_order: str = "parallel") -> tuple[int, bool]:
    """The backward's (state rows a program, z kept in scratch) for ranges of these lengths (host ints) and H heads:
    plan_bwd_block_k, and plan_z_scratch over the order's buffers (the parallel order's holds every step of every
    head, the serial order's a chunk a program)."""
    bk = plan_bwd_block_k(lengths, H, K, V, device, block_k)
    if bwd_order == "parallel":
        return bk, plan_z_scratch(sum(lengths) * H * (K // bk), 1, bk, V, device, z_mode)
    return bk, plan_z_scratch(len(lengths) * H * (K // bk), chunk, bk, V, device, z_mode)


def _precision(dtype: torch.dtype) -> str:
    """TF32 tensor cores for bf16/fp16 inputs (finer than the inputs' own rounding); IEEE fp32 for fp32."""
    return "ieee" if dtype == torch.float32 else "tf32"


def _range_lengths(lengths: torch.Tensor | None, P: int, tokens: int) -> list[int]:
    """The ranges' lengths for the launch plan, from their host copy (a PackedContext's cu_seqlens_host: no device
    read); without one (rows: every range one row) the P ranges split the tokens evenly."""
    if lengths is not None:
        return host_lengths(lengths)
    return [tokens // P] * P if P else []


@torch.library.custom_op("megacpp::m2rnn_scan_fwd", mutates_args=())
def m2rnn_scan_fwd(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, f: torch.Tensor, W: torch.Tensor, h0: torch.Tensor | None,
    ranges: torch.Tensor, order: torch.Tensor | None, lengths: torch.Tensor | None, reset: torch.Tensor, chunk: int,
    save: bool, clip: float, block_k: int = 0, z_mode: str = "auto", bwd_order: str = "parallel",
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """y [B,S,H,V] and the every-`chunk`-steps state checkpoints (empty unless save).

    h0 [P,H,K,V] fp32, or None: every range starts from zeros, made inside the kernel. (A zeros h0 made by
    the caller would be a [P,...] tensor in the compiled graph, P the number of documents: its contiguity
    check guards P != 1, and a batch of one document recompiled the graph.)
    order [P+1] int32 on the device: the ranges longest first (PackedContext.longest_first), the programs' launch
    order; None runs them in order (rows: one length). lengths: the host copy of ranges (cu_seqlens_host), for the
    launch plan; None: the ranges split the B*S tokens evenly (rows).
    clip, z_mode and bwd_order are only carried to the backward (gradient clipping of the state; where z is
    kept; the order of its two passes).
    block_k: state rows per program, 0 = plan_block_k's choice (made here, inside the op, from the host lengths:
    the plan follows the batch's documents without a recompile under torch.compile)."""
    B, S, H, K = q.shape
    V = v.shape[-1]
    P = ranges.numel() - 1
    precision = _precision(q.dtype)
    bk = plan_block_k(_range_lengths(lengths, P, B * S), H, K, V, q.device, block_k=block_k)
    warps = FWD_WARPS[precision]
    y = torch.empty_like(v) if bk == K else torch.empty((K // bk, B * S * H, V), device=q.device, dtype=torch.float32)
    # kernels/ssd.py's slot layout: document p's chunk c checkpointed in slot ranges[p] // chunk + p + c, of at most
    # B*S // chunk + P slots (nothing computed per batch on the device: no launches beyond the scan's)
    ckpt = torch.empty((B * S // chunk + P if save else 0, H, K, V), device=q.device, dtype=torch.float32)
    h0_arg = W if h0 is None else h0  # a placeholder pointer when HAS_H0 is off
    _m2rnn_fwd_kernel[(P * H * (K // bk),)](
        q, k, v, f, W, h0_arg, ranges, ranges if order is None else order, reset, y, ckpt if save else h0_arg, H,
        B * S * H, K=K, V=V, BK=bk, CHUNK=chunk, SAVE=save, PRECISION=precision, HAS_H0=h0 is not None,
        ORDERED=order is not None, num_warps=warps,
    )  # fmt: skip
    if bk != K:
        y = y.sum(0).view(v.shape).to(v.dtype)
    return y, ckpt


@m2rnn_scan_fwd.register_fake
def _(q, k, v, f, W, h0, ranges, order, lengths, reset, chunk, save, clip, block_k=0, z_mode="auto",
      bwd_order="parallel"):  # fmt: skip
    B, S, H, K = q.shape
    slots = B * S // chunk + ranges.shape[0] - 1
    return torch.empty_like(v), q.new_empty((slots if save else 0, H, K, v.shape[-1]), dtype=torch.float32)


@torch.library.custom_op("megacpp::m2rnn_scan_bwd", mutates_args=())
def m2rnn_scan_bwd(
    dy: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, f: torch.Tensor, W: torch.Tensor,
    h0: torch.Tensor | None, ranges: torch.Tensor, order: torch.Tensor | None, lengths: torch.Tensor | None,
    reset: torch.Tensor, ckpt: torch.Tensor, chunk: int, clip: float, block_k: int = 0, z_mode: str = "auto",
    bwd_order: str = "parallel",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """Gradients for q, k, v, f, W and h0. With h0=None (zeros, the forward's) the last is an empty
    [0,H,K,V] tensor: no [P,...] tensor enters the backward graph either. order and lengths as the forward's: the
    reverse pass's launch order and plan (plan_backward); the recompute pass takes whole rows."""
    B, S, H, K = q.shape
    V = v.shape[-1]
    P = ranges.numel() - 1
    precision = _precision(q.dtype)
    bk, z_scratch = plan_backward(_range_lengths(lengths, P, B * S), H, K, V, chunk, q.device, block_k=block_k,
                                  z_mode=z_mode, bwd_order=bwd_order)  # fmt: skip
    order_arg = ranges if order is None else order  # a placeholder pointer when ORDERED is off
    warps = plan_warps(BWD_WARPS[precision], bk, V)
    nkb, n_rows = K // bk, B * S * H
    parallel = bwd_order == "parallel"
    low = BWD_DOTS_IN_INPUT_DTYPE and q.dtype != torch.float32  # the reverse pass's MMA operands in the inputs' dtype
    dot = _BWD_DOT[q.dtype] if low else tl.float32
    dy = dy.contiguous()
    dq, dk = torch.empty_like(q), torch.empty_like(k)
    dv = torch.empty_like(v) if nkb == 1 else torch.empty((nkb, n_rows, V), device=q.device, dtype=torch.float32)
    df = torch.empty((nkb, n_rows), device=f.device, dtype=torch.float32)
    dW = torch.empty((P, H, nkb, V, V), device=q.device, dtype=torch.float32)
    dh0 = torch.empty((0 if h0 is None else P, H, K, V), device=q.device, dtype=torch.float32)
    h0_arg = W if h0 is None else h0  # a placeholder pointer when HAS_H0 is off
    if parallel:  # every step's state, recomputed from the checkpoints all chunks at once, segment by segment
        esize = q.element_size() if low else 4
        seg, n_seg = plan_segments(P, B * S, chunk, H * K * V * esize)
        carry = n_seg > 1
        if carry:  # each document's first buffer row, per segment; the chain's state and sums carried from zero
            lens = (ranges[1:] - ranges[:-1]).to(torch.int64)
            seg_lens = (lens[None, :] - torch.arange(n_seg, device=q.device)[:, None] * seg).clamp(0, seg)  # [n_seg, P]
            seg_off = (torch.cumsum(seg_lens, 1) - seg_lens).to(torch.int32)
            dW.zero_()
            dh0.zero_()
        # (one segment: step t's buffer row is t itself, so ranges stands in: ranges[p] - start + t)
        prev = torch.empty((min(B * S, P * seg), H, K, V), device=q.device, dtype=q.dtype if low else torch.float32)
        zbuf = torch.empty(prev.shape, device=q.device, dtype=torch.float32) if z_scratch else prev  # else never read
        dh_carry = torch.zeros((P * H * nkb, bk, V), device=q.device, dtype=torch.float32) if carry else prev  # else unread
        rbk = _recompute_block_k(K, V)
        for j in reversed(range(n_seg)):
            rows = seg_off[j] if carry else ranges
            _m2rnn_recompute_kernel[(ckpt.shape[0], H, K // rbk)](
                k, v, f, W, h0_arg, ranges, reset, ckpt, dy, prev, zbuf, dq, rows, j, seg, H, P,
                K=K, V=V, BK=rbk, CHUNK=chunk, PRECISION=precision, HAS_H0=h0 is not None,
                Z_SCRATCH=z_scratch, num_warps=FWD_WARPS[precision],
            )  # fmt: skip
            _m2rnn_bwd_kernel[(P * H * nkb,)](
                q, k, v, f, W, h0_arg, ranges, order_arg, reset, ckpt, dy, dq, dk, dv, df, dW, dh0, prev, zbuf, rows,
                dh_carry, j, seg, H, n_rows, float(clip), K=K, V=V, BK=bk, CHUNK=chunk, CLIP=clip > 0,
                PRECISION=precision, HAS_H0=h0 is not None, Z_SCRATCH=z_scratch, PARALLEL=True, CARRY=carry, DOT=dot,
                ORDERED=order is not None, num_warps=warps,
            )  # fmt: skip
    else:
        prev = torch.empty((P * H * nkb * chunk, bk, V), device=q.device, dtype=torch.float32)
        zbuf = torch.empty_like(prev) if z_scratch else prev
        _m2rnn_bwd_kernel[(P * H * nkb,)](
            q, k, v, f, W, h0_arg, ranges, order_arg, reset, ckpt, dy, dq, dk, dv, df, dW, dh0, prev, zbuf, ranges,
            prev, 0, chunk, H, n_rows, float(clip), K=K, V=V, BK=bk, CHUNK=chunk, CLIP=clip > 0, PRECISION=precision,
            HAS_H0=h0 is not None, Z_SCRATCH=z_scratch, PARALLEL=False, CARRY=False, DOT=dot,
            ORDERED=order is not None, num_warps=warps,
        )  # fmt: skip
    if nkb > 1:
        dv = dv.sum(0).view(v.shape).to(v.dtype)
    df = df[0] if nkb == 1 else df.sum(0)  # one row block: its partial is the sum (no reduction launched)
    return dq, dk, dv, df.view(f.shape).to(f.dtype), dW.sum((0, 2)).to(W.dtype), dh0


@m2rnn_scan_bwd.register_fake
def _(dy, q, k, v, f, W, h0, ranges, order, lengths, reset, ckpt, chunk, clip, block_k=0, z_mode="auto",
      bwd_order="parallel"):  # fmt: skip
    dh0 = q.new_empty((0, *q.shape[2:], v.shape[-1]), dtype=torch.float32) if h0 is None else torch.empty_like(h0)
    return (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), torch.empty_like(f),
            torch.empty_like(W), dh0)  # fmt: skip


def _setup_context(ctx, inputs, output):
    q, k, v, f, W, h0, ranges, order, lengths, reset, chunk, save, clip, block_k, z_mode, bwd_order = inputs
    ctx.save_for_backward(q, k, v, f, W, h0, ranges, order, lengths, reset, output[1])
    ctx.chunk, ctx.clip, ctx.block_k, ctx.z_mode, ctx.bwd_order = chunk, clip, block_k, z_mode, bwd_order


def _backward(ctx, dy, _dckpt):
    q, k, v, f, W, h0, ranges, order, lengths, reset, ckpt = ctx.saved_tensors
    if ckpt.numel() == 0:
        raise RuntimeError("m2rnn_scan_fwd ran with save=False; its output cannot be differentiated")
    dq, dk, dv, df, dW, dh0 = m2rnn_scan_bwd(dy, q, k, v, f, W, h0, ranges, order, lengths, reset, ckpt, ctx.chunk,
                                             ctx.clip, ctx.block_k, ctx.z_mode, ctx.bwd_order)  # fmt: skip
    return (dq, dk, dv, df, dW, None if h0 is None else dh0) + (None,) * 10


m2rnn_scan_fwd.register_autograd(_backward, setup_context=_setup_context)


# ----------------------------------------------------------------------------- public entry

KERNELS = ("auto", "triton", "reference")
# read once at import: a dynamo-friendly constant, never polled per step
DEFAULT_KERNEL = os.environ.get("MEGACPP_M2RNN_KERNEL", "auto").strip().lower()
if DEFAULT_KERNEL not in KERNELS:
    raise ValueError(f"MEGACPP_M2RNN_KERNEL must be one of {KERNELS}, got {DEFAULT_KERNEL!r}")


@functools.lru_cache(maxsize=None)
def _warn_reference_fallback(reason: str) -> None:
    warn_at_caller(
        f"M2RNN is running the reference step loop ({reason}). It is a correctness reference, "
        "orders of magnitude slower than the Triton kernel; pass kernel='reference' to silence this."
    )


def resolve_kernel(kernel: str, device: torch.device) -> str:
    """'triton' or 'reference'. 'auto' is Triton on a GPU; without one it falls back to the
    reference loop with a loud one-time warning, never silently."""
    kernel = DEFAULT_KERNEL if kernel == "auto" else kernel
    if kernel not in KERNELS:
        raise ValueError(f"kernel must be one of {KERNELS}, got {kernel!r}")
    triton_ok = launchable(device)
    if kernel == "auto":
        if device.type == "cuda":
            return "triton"
        _warn_reference_fallback(f"no GPU: inputs are on {device.type}")
        return "reference"
    if kernel == "triton" and not triton_ok:
        raise RuntimeError(
            f"kernel='triton' needs CUDA tensors (or TRITON_INTERPRET=1 for CPU tests); inputs are on {device}. "
            "Pass kernel='reference' to run the step loop explicitly."
        )
    return kernel


def _check(name: str, t: torch.Tensor, shape: tuple[int, ...], floating: bool = True) -> None:
    if tuple(t.shape) != shape:
        raise ValueError(f"{name} must have shape {shape}, got {tuple(t.shape)}")
    if floating and t.dtype not in FLOAT_DTYPES:
        raise ValueError(f"{name} must be float32, bfloat16, float16 (or float64 for the reference), got {t.dtype}")


def m2rnn_scan(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    f: torch.Tensor,
    W: torch.Tensor,
    h0: torch.Tensor | None = None,
    *,
    doc_ids: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
    ctx: PackedContext | None = None,
    chunk: int = 64,
    grad_clip: float = 0.0,
    kernel: str = "auto",
    block_k: int = 0,
    z_mode: str = "auto",
    bwd_order: str = "parallel",
) -> torch.Tensor:
    """The M2RNN recurrence over [B,S,H,*] inputs; returns y [B,S,H,V] in q's dtype.

    Document starts reset the state to h0: give doc_ids [B,S] (h0 is [B,H,K,V], one per row, each document of the
    row starting from it; on the Triton kernel the documents are made a PackedContext here, a host sync, and
    scanned as ctx's are: the one path for documents),
    or cu_seqlens [N+1] int32 for packed varlen input with B=1 (h0 is [N,H,K,V], one per
    sequence; checked here, varlen.check_cu_seqlens), or ctx, the batch's PackedContext (the rows are
    flattened and scanned one program per document, from its cu_seqlens, validated when it was built;
    h0 is [N,H,K,V]), or none (each row is one document). h0=None means zeros.

    block_k, z_mode and bwd_order are the Triton kernel's launch plan, for benchmarks and tests: state rows per
    program (0: plan_block_k's choice from the documents, heads and the GPU's SMs), where the backward keeps z
    (plan_z_scratch), and the order of the backward's passes (BWD_ORDERS). Every plan computes the same
    recurrence.
    """
    if q.dim() != 4:
        raise ValueError(f"q must be [B,S,H,K], got shape {tuple(q.shape)}")
    B, S, H, K = q.shape
    if v.dim() != 4:
        raise ValueError(f"v must be [B,S,H,V], got shape {tuple(v.shape)}")
    V = v.shape[-1]
    _check("k", k, (B, S, H, K))
    _check("v", v, (B, S, H, V))
    _check("f", f, (B, S, H))
    _check("W", W, (H, V, V))
    _check("q", q, (B, S, H, K))
    if (doc_ids is not None) + (cu_seqlens is not None) + (ctx is not None) > 1:
        raise ValueError("give only one of doc_ids, cu_seqlens and ctx")
    check_context(ctx)
    if B == 0 or S == 0:  # no document: an IndexError deep in the scan before
        raise ValueError(f"q must hold tokens, got [B,S,H,K] = {list(q.shape)}")
    # a negative clip turned clipping off silently (the hook clamps only for grad_clip > 0)
    if isinstance(grad_clip, bool) or not isinstance(grad_clip, (int, float)) or not 0 <= grad_clip < math.inf:
        raise ValueError(f"grad_clip must be a number >= 0 (0: no clipping), got {grad_clip!r}")
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1, got {chunk}")
    if z_mode not in Z_MODES:
        raise ValueError(f"z_mode must be one of {Z_MODES}, got {z_mode!r}")
    if bwd_order not in BWD_ORDERS:
        raise ValueError(f"bwd_order must be one of {BWD_ORDERS}, got {bwd_order!r}")
    if block_k:
        _check_block_k(block_k, K)  # checked here, before any kernel
    if doc_ids is not None and resolve_kernel(kernel, q.device) != "reference":
        # one path for documents: the rows' documents become a context (built and checked here, a host sync), so
        # the kernel runs one program per document as with cu_seqlens, where one program per row walked every
        # document of its row in turn (a row's documents in sequence: fewer programs, each longer)
        if doc_ids.shape != (B, S) or doc_ids.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"doc_ids must be int32/int64 [B,S] = {(B, S)}, got {doc_ids.dtype} {tuple(doc_ids.shape)}")
        ctx = build_context(doc_ids)
        if h0 is not None:  # each row's h0 for every document of that row
            _check("h0", h0, (B, H, K, V))
            h0 = h0[torch.div(ctx.cu_seqlens[:-1], S, rounding_mode="floor").long()]
        doc_ids = None
    if ctx is not None:  # validated when it was built: flatten the rows, one program per document
        if ctx.shape != (B, S):
            raise ValueError(f"ctx is for [B,S] = {ctx.shape}, the input is {(B, S)}")
        if resolve_kernel(kernel, q.device) == "reference":  # the step loop over rows, not over B*S steps
            if h0 is None:
                h0 = torch.zeros((ctx.n_seqs, H, K, V), device=q.device, dtype=torch.float32)
            _check("h0", h0, (ctx.n_seqs, H, K, V))
            return m2rnn_scan_reference(q, k, v, f, W, h0, ctx.starts, ctx.seq_index.view(B, S), grad_clip)
        N = B * S
        y = _scan(q.reshape(1, N, H, K), k.reshape(1, N, H, K), v.reshape(1, N, H, V), f.reshape(1, N, H), W, h0,
                  ctx.cu_seqlens, ctx.starts.reshape(1, N), ctx.seq_index.view(1, N), chunk, grad_clip,
                  kernel, block_k, z_mode, bwd_order, ctx.longest_first, ctx.cu_seqlens_host)  # fmt: skip
        return y.view(B, S, H, V)
    dev = q.device
    if cu_seqlens is not None:
        if B != 1:
            raise ValueError(f"cu_seqlens needs packed input with B=1, got B={B}")
        check_cu_seqlens(cu_seqlens, S, device=dev)
        ranges = cu_seqlens.to(dev)
        # bare boundaries have no host copy (reading one would wait on the GPU): the plan takes the tokens split
        # evenly (a PackedContext gives it the documents' lengths), the launch the longest first, found on the device
        lengths = None
        order = documents_longest_first(ranges) if resolve_kernel(kernel, dev) == "triton" else None
        reset = torch.zeros(S, dtype=torch.int8, device=dev)
        reset[ranges[:-1].long()] = 1
        reset2d = reset.view(1, S).bool()
        seq_of_token = torch.searchsorted(ranges, torch.arange(S, device=dev, dtype=torch.int32), right=True) - 1
        h0_index = seq_of_token.view(1, S).long()
    else:
        lengths = order = None  # rows: one length, in order
        ranges = torch.arange(B + 1, device=dev, dtype=torch.int32) * S
        if doc_ids is not None:
            if doc_ids.shape != (B, S) or doc_ids.dtype not in (torch.int32, torch.int64):
                raise ValueError(f"doc_ids must be int32/int64 [B,S] = {(B, S)}, got {doc_ids.dtype} {tuple(doc_ids.shape)}")
            reset2d = torch.ones((B, S), dtype=torch.bool, device=dev)
            reset2d[:, 1:] = doc_ids[:, 1:] != doc_ids[:, :-1]
        else:
            reset2d = torch.zeros((B, S), dtype=torch.bool, device=dev)
            reset2d[:, 0] = True
        h0_index = torch.arange(B, device=dev).view(B, 1).expand(B, S)
    return _scan(q, k, v, f, W, h0, ranges, reset2d, h0_index, chunk, grad_clip, kernel, block_k, z_mode, bwd_order,
                 order, lengths)  # fmt: skip


def _scan(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, f: torch.Tensor, W: torch.Tensor, h0: torch.Tensor | None,
          ranges: torch.Tensor, reset2d: torch.Tensor, h0_index: torch.Tensor, chunk: int, grad_clip: float,
          kernel: str, block_k: int = 0, z_mode: str = "auto", bwd_order: str = "parallel",
          order: torch.Tensor | None = None, lengths: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
    """The scan over sequences [ranges[i], ranges[i+1]) of the flattened tokens, resetting at reset2d; order and
    lengths: the ranges longest first (on the device) and their host copy, for the launch (m2rnn_scan_fwd)."""
    B, S, H, K = q.shape
    V = v.shape[-1]
    dev = q.device
    reset = reset2d.reshape(-1).to(torch.int8)
    # P is the number of documents: under compile a symbol (cu_seqlens is dynamic). No tensor with a
    # dimension of size P is made here: h0=None goes to the op as None (zeros inside the kernel). A [P,...]
    # tensor in the graph is contiguity-checked when AOTAutograd traces it, which guards P != 1 (sizes 0
    # and 1 are specialised), so a batch of exactly one document compiled a second graph.
    P = ranges.numel() - 1
    if h0 is not None:
        _check("h0", h0, (P, H, K, V))
    which = resolve_kernel(kernel, dev)
    if which == "reference":
        if h0 is None:
            h0 = torch.zeros((P, H, K, V), device=dev, dtype=torch.float32)
        return m2rnn_scan_reference(q, k, v, f, W, h0, reset2d, h0_index, grad_clip)
    if q.dtype == torch.float64:
        raise ValueError("the Triton kernel takes float32, bfloat16 or float16 inputs; float64 is for kernel='reference'")
    for name, size in (("K", K), ("V", V)):  # its blocks are tl.arange ranges and tl.dot operands
        if size < MIN_BLOCK_K or size & (size - 1):
            raise ValueError(f"the Triton kernel needs {name} (the head's {'key' if name == 'K' else 'value'} dim) a power "
                             f"of two >= {MIN_BLOCK_K}, got {name}={size}; kernel='reference' takes any size")  # fmt: skip
    # no generator expression: dynamo on torch 2.11 cannot trace one under fullgraph
    needs_grad = torch.is_grad_enabled() and (
        q.requires_grad or k.requires_grad or v.requires_grad or f.requires_grad or W.requires_grad
        or (h0 is not None and h0.requires_grad)
    )
    y, _ = m2rnn_scan_fwd(
        q.contiguous(), k.contiguous(), v.contiguous(), f.contiguous(), W.contiguous(),
        None if h0 is None else h0.float().contiguous(), ranges, order, lengths, reset, chunk, needs_grad,
        float(grad_clip), block_k, z_mode, bwd_order,
    )  # fmt: skip
    return y
