"""The doc-masked causal depthwise conv (nn/primitives.DocCausalDepthwiseConv), with its SiLU, in Triton.

Per channel d and token t of a packed row, with K taps and each token's offset in its document pos_t:

    pre_t = w[d, K-1] x_t + b[d] + sum_{l=1..K-1} [pos_t >= l] w[d, K-1-l] x_{t-l}      (fp32, in this order)
    y_t   = pre_t rounded to x's dtype, then SiLU'd when `silu` (F.silu(conv(x)), as the layers apply it)

A tap that would reach before the token's document start reads zero: the same mask as doc_causal_shift's, so no
value (not even a NaN) crosses a document boundary, and a row start is always a document start (positions restart
there; without positions, one document a row, pos_t = t mod T).

Why a kernel: the R block's conv and its SiLU compiled by inductor (the xla_safe form: K doc-masked shifts) took
about 1.1 ms of kernels per R layer in the compiled base step's trace on an H100 (bench compile at df0ede7, its
trace committed in 432862a under profiles/nvidia-h100-80gb-hbm3/compile/: six kernels named for constant_pad_nd, ge,
where, silu and their backward, forward, recompute, dx and the weight's reduction), where the tensors themselves
([4, 4096, 2304] in bf16, 75 MB) take tens of microseconds a pass to move. Here the forward is one pass (x read, y
written); the backward two: the gradient and x read, the pre-activation recomputed, its gradient written (in x's
dtype, as eager's SiLU backward hands it on; the weight's and bias's partial sums per block of tokens take it in fp32,
before that rounding); then dx from that gradient at each token and its K-1 successors; then one small reduction over
the blocks, in the autograd formula outside the op (_param_grads), where inductor fuses it with the flip and the casts.

The reference is the module's own xla_safe form (and its step loop, DocCausalDepthwiseConv.step):
tests/test_doc_conv.py compares them, forward and every gradient, under the interpreter and on the GPU.
Shapes: x [B,T,D] (fp32, bf16 or fp16), weight [D,1,K] (nn.Conv1d's depthwise layout), bias [D] or None,
positions [B,T] integer or None.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from megacpp_lab.kernels import launchable

__all__ = ["CONV_DTYPES", "doc_conv", "doc_conv_bwd", "doc_conv_fwd"]

CONV_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# tokens and channels a program covers (4 warps): the forward's and the backward's dx pass at 32 x 128, the backward's
# first pass (dpre, and the weight's partial sums) at 32 x 64. Compiled for sm_90 (kernels/resources.py) at the R
# block's [4, 4096, 2304] in bf16: 110, 128 and 84 registers a thread, no spills (the first pass at 32 x 128: 182).
# (A backward in one pass, recomputing dpre at each of the K later tokens it sums, took 0.495 ms there on an H100,
# profiles/nvidia-h100-80gb-hbm3/compile/conv_probe.json: K + 1 times the reads of x and of the gradient.)
BLOCK_T, BLOCK_D = 32, 128
BWD_BLOCK_T, BWD_BLOCK_D = 32, 64
WARPS = 4
# the backward's first pass at 2 warps: on an H100 at the R block's shape (scripts/conv_tiles_probe.py,
# profiles/nvidia-h100-80gb-hbm3/compile/conv_tiles_probe.json) 0.151 ms against 0.319 at 4 warps, the fastest of
# twelve tile and warp settings (64 x 64 at 4 warps 0.196, 128 x 32 at 4 warps 0.180); its weight sums reduce over
# the tile's tokens, which 2 warps hold with fewer cross-warp steps
BWD_PRE_WARPS = 2


@triton.jit
def _positions(pos_ptr, rows, rm, T, HAS_POS: tl.constexpr):
    """Each row's offset in its document (0 past the end): the context's positions, or t mod T (a document a row)."""
    if HAS_POS:  # int32 either way (positions are below T): one type for both branches, as the compiler requires
        # at most the offset in the row: a tap never reaches before its row, whatever the positions say (the torch
        # form pads each row, so it never does either; unchecked positions must not read another row, or memory)
        return tl.minimum(tl.load(pos_ptr + rows, mask=rm, other=0).to(tl.int32), rows % T)
    return rows % T


@triton.jit
def _pre_activation(x_ptr, pos_ptr, w_ptr, b_ptr, rows, total, cols, cm, T, D, XS, K: tl.constexpr,
                    HAS_BIAS: tl.constexpr, HAS_POS: tl.constexpr):  # fmt: skip
    """pre [BT, BD] fp32 at the token rows `rows` (zero where rows >= total), in the module's order (_tap_sum's): the
    current tap, the bias, then each earlier tap masked to the token's document."""
    rm = rows < total
    pos = _positions(pos_ptr, rows, rm, T, HAS_POS)
    at = rows[:, None] * XS + cols[None, :]  # x's rows XS apart (a slice of a wider row: no copy)
    w_now = tl.load(w_ptr + cols * K + (K - 1), mask=cm, other=0.0).to(tl.float32)
    pre = tl.load(x_ptr + at, mask=rm[:, None] & cm[None, :], other=0.0).to(tl.float32) * w_now[None, :]
    if HAS_BIAS:
        pre += tl.load(b_ptr + cols, mask=cm, other=0.0).to(tl.float32)[None, :]
    for lag in tl.static_range(1, K):
        ok = rm & (pos >= lag)
        w_lag = tl.load(w_ptr + cols * K + (K - 1 - lag), mask=cm, other=0.0).to(tl.float32)
        xv = tl.load(x_ptr + at - lag * XS, mask=ok[:, None] & cm[None, :], other=0.0)
        pre += xv.to(tl.float32) * w_lag[None, :]
    return pre


@triton.jit
def _pre_grad(g_ptr, x_ptr, pos_ptr, w_ptr, b_ptr, rows, total, cols, cm, T, D, XS, K: tl.constexpr,
              HAS_BIAS: tl.constexpr, HAS_POS: tl.constexpr, SILU: tl.constexpr):  # fmt: skip
    """The gradient of pre [BT, BD] fp32 at `rows` (zero past the end): the output's gradient, through the SiLU of
    the rounded pre-activation when SILU (recomputed here: nothing but x is saved)."""
    rm = rows < total
    g = tl.load(g_ptr + rows[:, None] * D + cols[None, :], mask=rm[:, None] & cm[None, :], other=0.0).to(tl.float32)
    if SILU:
        pre = _pre_activation(x_ptr, pos_ptr, w_ptr, b_ptr, rows, total, cols, cm, T, D, XS, K, HAS_BIAS, HAS_POS)
        u = pre.to(x_ptr.dtype.element_ty).to(tl.float32)  # the conv's output as the SiLU read it
        s = tl.sigmoid(u)
        g = g * s * (1.0 + u * (1.0 - s))
    return g


@triton.jit
def _doc_conv_fwd_kernel(x_ptr, pos_ptr, w_ptr, b_ptr, y_ptr, total, T, D, XS, K: tl.constexpr, BT: tl.constexpr,
                         BD: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_POS: tl.constexpr, SILU: tl.constexpr):  # fmt: skip
    rows = tl.program_id(0) * BT + tl.arange(0, BT)
    cols = tl.program_id(1) * BD + tl.arange(0, BD)
    cm = cols < D
    pre = _pre_activation(x_ptr, pos_ptr, w_ptr, b_ptr, rows, total, cols, cm, T, D, XS, K, HAS_BIAS, HAS_POS)
    y = pre.to(y_ptr.dtype.element_ty)
    if SILU:  # F.silu on the rounded conv output, rounded once more
        u = y.to(tl.float32)
        y = (u * tl.sigmoid(u)).to(y_ptr.dtype.element_ty)
    tl.store(y_ptr + rows[:, None] * D + cols[None, :], y, mask=(rows < total)[:, None] & cm[None, :])


@triton.jit
def _doc_conv_grad_pre_kernel(g_ptr, x_ptr, pos_ptr, w_ptr, b_ptr, dpre_ptr, dwb_ptr, total, T, D, XS, K: tl.constexpr,
                              BT: tl.constexpr, BD: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_POS: tl.constexpr,
                              SILU: tl.constexpr):  # fmt: skip
    """The backward's first pass: the pre-activation's gradient dpre (through the SiLU, the pre-activation recomputed
    from x; stored in dpre_ptr's dtype when SILU, else it is the output's gradient itself), and the weight's and the
    bias's partial sums over this program's tokens into dwb [blocks, K+1, D] (rows 0..K-1: the tap at lag l,
    w[:, K-1-l]; row K: the bias), from dpre in fp32, summed over the blocks by the autograd formula (_param_grads)."""
    blk = tl.program_id(0)
    rows = blk * BT + tl.arange(0, BT)
    cols = tl.program_id(1) * BD + tl.arange(0, BD)
    cm = cols < D
    rm = rows < total
    pos = _positions(pos_ptr, rows, rm, T, HAS_POS)
    at = rows[:, None] * D + cols[None, :]
    dpre = _pre_grad(g_ptr, x_ptr, pos_ptr, w_ptr, b_ptr, rows, total, cols, cm, T, D, XS, K, HAS_BIAS, HAS_POS, SILU)
    if SILU:
        tl.store(dpre_ptr + at, dpre.to(dpre_ptr.dtype.element_ty), mask=rm[:, None] & cm[None, :])
    part = dwb_ptr + blk * (K + 1) * D + cols
    for lag in tl.static_range(K):
        ok = rm & (pos >= lag)
        xv = tl.load(x_ptr + rows[:, None] * XS + cols[None, :] - lag * XS, mask=ok[:, None] & cm[None, :],
                     other=0.0).to(tl.float32)  # fmt: skip
        tl.store(part + lag * D, tl.sum(dpre * xv, axis=0), mask=cm)
    tl.store(part + K * D, tl.sum(dpre, axis=0), mask=cm)


@triton.jit
def _doc_conv_grad_x_kernel(dpre_ptr, pos_ptr, w_ptr, dx_ptr, total, T, D, K: tl.constexpr, BT: tl.constexpr,
                            BD: tl.constexpr, HAS_POS: tl.constexpr):  # fmt: skip
    """The backward's second pass: dx_t = sum_l [pos_{t+l} >= l] w[K-1-l] dpre_{t+l} (a later token's tap reaches t
    only inside t's document: pos_{t+l} >= l says t+l is in it, and never past a row's end, where the next row's
    positions restart), in fp32, stored in dx's dtype."""
    rows = tl.program_id(0) * BT + tl.arange(0, BT)
    cols = tl.program_id(1) * BD + tl.arange(0, BD)
    cm = cols < D
    rm = rows < total
    at = rows[:, None] * D + cols[None, :]
    w_now = tl.load(w_ptr + cols * K + (K - 1), mask=cm, other=0.0).to(tl.float32)
    dx = tl.load(dpre_ptr + at, mask=rm[:, None] & cm[None, :], other=0.0).to(tl.float32) * w_now[None, :]
    for lag in tl.static_range(1, K):
        later = rows + lag
        lm = later < total
        reach = lm & (_positions(pos_ptr, later, lm, T, HAS_POS) >= lag)
        w_lag = tl.load(w_ptr + cols * K + (K - 1 - lag), mask=cm, other=0.0).to(tl.float32)
        d_later = tl.load(dpre_ptr + at + lag * D, mask=reach[:, None] & cm[None, :], other=0.0).to(tl.float32)
        dx += d_later * w_lag[None, :]
    tl.store(dx_ptr + at, dx.to(dx_ptr.dtype.element_ty), mask=rm[:, None] & cm[None, :])


def _check(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, positions: torch.Tensor | None) -> None:
    if not isinstance(x, torch.Tensor) or x.dim() != 3:
        raise ValueError(f"doc_conv x must be a tensor [B,T,D], got "
                         f"{list(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__}")  # fmt: skip
    if x.dtype not in CONV_DTYPES:
        raise ValueError(f"doc_conv x must be float32, bfloat16 or float16 (float64 is the torch form's), got {x.dtype}")
    B, T, D = x.shape
    if B == 0 or T == 0 or D == 0:
        raise ValueError(f"doc_conv x must hold tokens and channels, got [B,T,D] = {list(x.shape)}")
    if not isinstance(weight, torch.Tensor) or weight.dim() != 3 or weight.shape[:2] != (D, 1) or weight.shape[2] < 1:
        raise ValueError(f"doc_conv weight must be [D,1,K] = [{D},1,K] with K >= 1 (nn.Conv1d's depthwise layout), got "
                         f"{list(weight.shape) if isinstance(weight, torch.Tensor) else type(weight).__name__}")  # fmt: skip
    if bias is not None and (not isinstance(bias, torch.Tensor) or tuple(bias.shape) != (D,)):
        raise ValueError(f"doc_conv bias must be None or [D] = [{D}], got "
                         f"{list(bias.shape) if isinstance(bias, torch.Tensor) else type(bias).__name__}")  # fmt: skip
    if positions is not None and (not isinstance(positions, torch.Tensor) or tuple(positions.shape) != (B, T)
                                  or positions.dtype.is_floating_point or positions.dtype == torch.bool):
        raise ValueError(f"doc_conv positions must be None or an integer [B,T] = {[B, T]} tensor, got "
                         f"{(positions.dtype, list(positions.shape)) if isinstance(positions, torch.Tensor) else type(positions).__name__}")  # fmt: skip
    for name, t in (("weight", weight), ("bias", bias), ("positions", positions)):
        if t is not None and t.device != x.device:
            raise ValueError(f"doc_conv {name} is on {t.device}, x on {x.device}")
    if not launchable(x.device):
        raise RuntimeError(f"doc_conv needs CUDA tensors (or TRITON_INTERPRET=1 for CPU tests); x is on {x.device}")
    if B * T * D >= 2**31:  # the kernels index in int32
        raise ValueError(f"doc_conv indexes in int32: x [B,T,D] = {list(x.shape)} holds {B * T * D} elements (limit "
                         "2**31); split the batch")  # fmt: skip


def _rows(x: torch.Tensor) -> tuple[torch.Tensor, int]:
    """x as the kernels read it and its row stride: as it is where its channels are unit-stride and its rows evenly
    spaced across the batch (a slice of a wider projection's channels, as the layers' conv inputs are: read in
    place, not copied), else a contiguous copy."""
    B, T, D = x.shape
    if x.stride(2) == 1 and x.stride(1) >= D and x.stride(0) == T * x.stride(1):
        return x, x.stride(1)
    return x.contiguous(), D


def _grid(total: int, D: int, block_t: int, block_d: int) -> tuple[int, int]:
    return (triton.cdiv(total, block_t), triton.cdiv(D, block_d))


@torch.library.custom_op("megacpp::doc_conv_fwd", mutates_args=())
def doc_conv_fwd(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],  # noqa: UP045
                 positions: Optional[torch.Tensor], silu: bool) -> torch.Tensor:  # noqa: UP045  # fmt: skip
    """y [B,T,D] in x's dtype, contiguous (module docstring). Checked by doc_conv; x read in place where its rows are
    evenly spaced (_rows), the others contiguous."""
    B, T, D = x.shape
    x, row = _rows(x)
    y = torch.empty((B, T, D), device=x.device, dtype=x.dtype)
    _doc_conv_fwd_kernel[_grid(B * T, D, BLOCK_T, BLOCK_D)](
        x, positions if positions is not None else x, weight, bias if bias is not None else weight, y, B * T, T, D, row,
        K=weight.shape[-1], BT=BLOCK_T, BD=BLOCK_D, HAS_BIAS=bias is not None, HAS_POS=positions is not None,
        SILU=silu, num_warps=WARPS,
    )  # fmt: skip
    return y


@doc_conv_fwd.register_fake
def _(x, weight, bias, positions, silu):  # noqa: ANN001, ANN202
    return x.new_empty(x.shape)


@torch.library.custom_op("megacpp::doc_conv_bwd", mutates_args=())
def doc_conv_bwd(grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],  # noqa: UP045
                 positions: Optional[torch.Tensor], silu: bool  # noqa: UP045
                 ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """dx [B,T,D] in x's dtype, and the weight's and bias's gradients as fp32 partial sums, one row a block of
    BWD_BLOCK_T tokens: [blocks, K+1, D], the taps by lag, then the bias (_param_grads sums them: in the autograd
    formula, outside the op, where inductor fuses the sum, the flip and the casts into one kernel; inside the op they
    were an aten reduction and copies of their own, 26 us a layer of the H100 compiled base step at c4f5642)."""
    B, T, D = x.shape
    K = weight.shape[-1]
    grid = _grid(B * T, D, BWD_BLOCK_T, BWD_BLOCK_D)
    x, row = _rows(x)
    dx = torch.empty((B, T, D), device=x.device, dtype=x.dtype)
    # the pre-activation's gradient in x's dtype (what eager's SiLU backward hands the conv's, and what dx is formed
    # from; the weight's and bias's sums take it in fp32, before that rounding); without the SiLU it is the output's
    # gradient, read in place
    dpre = torch.empty((B, T, D), device=x.device, dtype=x.dtype) if silu else grad
    partial = torch.empty((grid[0], K + 1, D), device=x.device, dtype=torch.float32)
    has_bias, has_pos = bias is not None, positions is not None
    pos = positions if has_pos else x  # placeholders the kernels never read
    _doc_conv_grad_pre_kernel[grid](
        grad, x, pos, weight, bias if has_bias else weight, dpre, partial, B * T, T, D, row, K=K, BT=BWD_BLOCK_T,
        BD=BWD_BLOCK_D, HAS_BIAS=has_bias, HAS_POS=has_pos, SILU=silu, num_warps=BWD_PRE_WARPS,
    )  # fmt: skip
    _doc_conv_grad_x_kernel[_grid(B * T, D, BLOCK_T, BLOCK_D)](
        dpre, pos, weight, dx, B * T, T, D, K=K, BT=BLOCK_T, BD=BLOCK_D, HAS_POS=has_pos, num_warps=WARPS,
    )  # fmt: skip
    return dx, partial


@doc_conv_bwd.register_fake
def _(grad, x, weight, bias, positions, silu):  # noqa: ANN001, ANN202
    B, T, D = x.shape
    return x.new_empty(x.shape), x.new_empty((triton.cdiv(B * T, BWD_BLOCK_T), weight.shape[-1] + 1, D),
                                             dtype=torch.float32)  # fmt: skip


def _param_grads(partial: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
                     ) -> tuple[torch.Tensor, torch.Tensor | None]:  # fmt: skip
    """doc_conv_bwd's partial sums [blocks, K+1, D] -> d weight [D,1,K] in weight's dtype and d bias [D] in bias's
    (None without a bias)."""
    K, D = weight.shape[-1], weight.shape[0]
    sums = partial.sum(0)  # [K+1, D]: the taps by lag, then the bias
    dw = sums[:K].flip(0).t().reshape(D, 1, K).to(weight.dtype)  # lag l is w[:, K-1-l]
    return dw, (sums[K].to(bias.dtype) if bias is not None else None)


def _setup(ctx, inputs, output):  # noqa: ANN001, ANN202
    x, weight, bias, positions, silu = inputs
    ctx.save_for_backward(x, weight, bias, positions)
    ctx.silu = silu


def _backward(ctx, grad):  # noqa: ANN001, ANN202
    x, weight, bias, positions = ctx.saved_tensors
    dx, partial = doc_conv_bwd(grad.contiguous(), x, weight, bias, positions, ctx.silu)
    return dx, *_param_grads(partial, weight, bias), None, None


doc_conv_fwd.register_autograd(_backward, setup_context=_setup)


def doc_conv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, positions: torch.Tensor | None, *,
             silu: bool = False) -> torch.Tensor:  # fmt: skip
    """The doc-masked causal depthwise conv of x [B,T,D] (weight [D,1,K], bias [D] or None; positions [B,T], each
    token's offset in its document, or None for one document a row), SiLU'd when `silu`, through the Triton op: y in
    x's dtype. Checked here (fail closed: a wrong shape, dtype or device names its field)."""
    _check(x, weight, bias, positions)
    return doc_conv_fwd(x, weight.contiguous(), None if bias is None else bias.contiguous(),
                        None if positions is None else positions.contiguous(), bool(silu))  # fmt: skip
