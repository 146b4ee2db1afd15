"""Fused linear cross-entropy: loss and gradients of CE(x @ W.T, y) without the [T, V] logits.

The tokens are walked in chunks of C rows. One [C, V] buffer (in x's dtype) is reused by every chunk:
1. logits = x_c @ W.T (cuBLAS) into the buffer;
2. `_ce_grad_inplace_kernel` (Triton, one program per row) makes two passes over the row: an online
   max / sum-exp for lse, then it overwrites the logits with dlogits = (softmax * (1 + 2z lse) - onehot)
   * scale (scale = 1/n_valid for the mean, on the device: no host sync), and writes the row's loss;
3. dx_c = dlogits @ W and dW += dlogits.T @ x_c (cuBLAS; dW is held in the weight dtype between chunks).
The backward only scales dx and dW by the incoming gradient, in place. Memory beyond the inputs: dx,
dW and the one [C, V] buffer; the chunk size follows a byte budget for that buffer.

Dispatch: on CUDA with bf16/fp32 inputs (sm80+) step 2 is the Triton kernel. Anywhere else the same
chunked loop runs with a torch version of step 2, after a RuntimeWarning: never a crash, never
silently. The reference is `linear_cross_entropy_reference`, F.cross_entropy over materialised logits.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from megacpp_lab.kernels import TRITON_INTERPRET, warn_at_caller

__all__ = [
    "BF16_FILTER_EPS",
    "DEFAULT_CHUNK_BYTES",
    "FILTER_MAX_KEPT",
    "GATE_ROWS",
    "IMPLS",
    "REDUCTIONS",
    "block_filter_",
    "block_keep",
    "default_chunk_size",
    "filter_pays",
    "fused_linear_cross_entropy",
    "kept_block_fraction",
    "last_filter_gate",
    "linear_cross_entropy_reference",
    "resolve_impl",
]

REDUCTIONS = ("mean", "sum")
IMPLS = ("auto", "triton", "eager")
# The one reused [C, V] logits/gradient buffer: C is the largest power of two whose buffer fits 256 MiB (C = 2048 at
# V = 50304 in bf16, 4096 at V = 32768, 512 at V = 151552). A larger chunk is faster: each chunk reads and rewrites
# all of dW ([V, H], 4 V H bytes), so dW's traffic over the GEMMs' time falls as 1/C, and a power of two fills whole
# GEMM tiles (the chunk rows of profiles/<device>/loss/flce_peer_shapes.json and flce_fwd_bwd.json time the trade).
# The buffer costs C * V * 2 bytes; with dW (V x H) and dx the loss's extra memory at T=8192, H=4096, V=151552 in
# bf16 is 1.4 GiB.
DEFAULT_CHUNK_BYTES = 256 * 2**20
# Gradient filtering (opt-in, filter_eps): the [C, V] gradient is cut into FILTER_ROWS x FILTER_COLS blocks;
# a block whose every |softmax * (1 + 2 z lse) - onehot| (before the mean's 1/n) is below filter_eps is
# dropped from dx and dW, and the block-sparse GEMMs skip it: no W read, no dW read-modify-write for it.
FILTER_ROWS, FILTER_COLS = 64, 128
BF16_FILTER_EPS = 2.0**-12
# The filter is skipped (the call runs exact) when the gate's rows (GATE_ROWS) keep more than this share of their blocks: the
# block-sparse GEMMs cost more per kept block than cuBLAS's dense ones, so past a kept share they are slower than
# the exact path. bench loss's kept-share sweep (profiles/<device>/loss/flce_filter_break_even.json) measures where,
# at the model's head shape; flce_fwd_bwd.json's filtered row is one point at H=4096.
FILTER_MAX_KEPT = 0.10
# The gate reads the keep-flags of the first chunk's first GATE_ROWS rows (a whole number of FILTER_ROWS blocks): only
# they run the flag-raising variant of the row kernel before the decision, so a call the gate turns exact pays for
# flags over those rows alone, not over a whole chunk (4096 rows at the model's head). Where it filters, the rest of
# the first chunk's flags come from its stored gradient (_keep_flags_kernel: block_keep's flags, the kernel's too).
GATE_ROWS = 4 * FILTER_ROWS


def linear_cross_entropy_reference(x: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, *,
                                   ignore_index: int = -100, reduction: str = "mean",
                                   z_loss: float = 0.0) -> torch.Tensor:  # fmt: skip
    """Materialised logits [T, V] (x @ W.T in the input dtype, upcast to fp32), F.cross_entropy, plus
    z_loss * mean(lse^2) over valid tokens."""
    logits = (x @ weight.t()).float()
    loss = F.cross_entropy(logits, target, ignore_index=ignore_index, reduction="sum")
    if z_loss:
        valid = target != ignore_index
        loss = loss + z_loss * (torch.logsumexp(logits, -1)[valid] ** 2).sum()
    if reduction == "mean":
        loss = loss / (target != ignore_index).sum().clamp(min=1)
    return loss


def _ce_grad_torch_(logits: torch.Tensor, target: torch.Tensor, scale: torch.Tensor, ignore_index: int,
                    z_loss: float) -> torch.Tensor:  # fmt: skip
    """The torch twin of `_ce_grad_inplace_kernel`: logits [C, V] become dlogits * scale; returns row losses."""
    f = logits.float()
    lse = torch.logsumexp(f, dim=-1)
    valid = target != ignore_index
    safe = torch.where(valid, target, 0)
    loss = torch.where(valid, lse - f.gather(1, safe[:, None]).squeeze(1) + z_loss * lse * lse, 0.0)
    grad = torch.exp(f - lse[:, None]) * (1.0 + 2.0 * z_loss * lse)[:, None]  # d/dlogits of lse - logit_y + z lse^2
    grad.scatter_add_(1, safe[:, None], -torch.ones_like(lse)[:, None])
    logits.copy_(torch.where(valid[:, None], grad * scale, 0.0))
    return loss


def block_filter_(grad: torch.Tensor, scale: torch.Tensor, filter_eps: float) -> torch.Tensor:
    """Zero every FILTER_ROWS x FILTER_COLS block of the scaled gradient whose entries are all below
    filter_eps * scale in magnitude; returns the int32 keep-flags [ceil(C/FR), ceil(V/FC)]. The torch
    twin of the flags that `_ce_grad_inplace_kernel` raises and the block-sparse GEMMs read."""
    keep = block_keep(grad, scale, filter_eps)
    _drop_blocks_(grad, keep)
    return keep.int()


def block_keep(grad: torch.Tensor, scale: torch.Tensor, filter_eps: float) -> torch.Tensor:
    """The bool keep-flags [ceil(C/FR), ceil(V/FC)] of block_filter_, the gradient left as it is."""
    C, V = grad.shape
    nr, nc = -(-C // FILTER_ROWS), -(-V // FILTER_COLS)
    padded = F.pad(grad.float().abs(), (0, nc * FILTER_COLS - V, 0, nr * FILTER_ROWS - C))
    return padded.view(nr, FILTER_ROWS, nc, FILTER_COLS).amax(dim=(1, 3)) >= filter_eps * scale


def _drop_blocks_(grad: torch.Tensor, keep: torch.Tensor) -> None:
    C, V = grad.shape
    grad.mul_(keep.repeat_interleave(FILTER_ROWS, 0).repeat_interleave(FILTER_COLS, 1)[:C, :V])


@triton.jit
def _ce_grad_inplace_kernel(
    logits_ptr, target_ptr, loss_ptr, scale_ptr, flags_ptr, stride_row, V, ignore_index, z_loss, filter_eps, n_fcols,
    BLOCK_V: tl.constexpr, FILTER: tl.constexpr, FR: tl.constexpr, FC: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    ptr = logits_ptr + row * stride_row
    y = tl.load(target_ptr + row)
    valid = y != ignore_index
    cols = tl.arange(0, BLOCK_V)
    # pass 1: per-lane running max and sum of exp, merged once at the end
    m = tl.full((BLOCK_V,), float("-inf"), tl.float32)
    acc = tl.zeros((BLOCK_V,), tl.float32)
    for v0 in range(0, V, BLOCK_V):
        x = tl.load(ptr + v0 + cols, mask=v0 + cols < V, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, x)
        # a lane that has seen only masked (-inf) entries rescales against 0, not itself: -inf - -inf is NaN
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        acc = acc * tl.exp(m - m_ref) + tl.exp(x - m_ref)
        m = m_new
    m_row = tl.max(m, axis=0)
    lse = m_row + tl.log(tl.sum(acc * tl.exp(m - m_row), axis=0))
    y_safe = tl.where(valid, y, 0)
    target_logit = tl.load(ptr + y_safe).to(tl.float32)
    tl.store(loss_ptr + row, tl.where(valid, lse - target_logit + z_loss * lse * lse, 0.0))
    coef = tl.where(valid, (1.0 + 2.0 * z_loss * lse) * tl.load(scale_ptr), 0.0)
    hit = tl.where(valid, tl.load(scale_ptr), 0.0)  # the onehot term, scaled alike
    # pass 2: overwrite the row with its gradient
    for v0 in range(0, V, BLOCK_V):
        c = v0 + cols
        x = tl.load(ptr + c, mask=c < V, other=0.0).to(tl.float32)
        g = tl.where(valid, tl.exp(x - lse) * coef - tl.where(c == y_safe, hit, 0.0), 0.0)  # ignored rows: exactly 0
        g = g.to(logits_ptr.dtype.element_ty)
        tl.store(ptr + c, g, mask=c < V)
        if FILTER:  # raise the keep-flag of every FC-wide block of this row that holds an entry >= eps
            # on the stored (rounded) value, as block_filter_ sees it
            big = tl.reshape(tl.where(c < V, tl.abs(g.to(tl.float32)), 0.0), (BLOCK_V // FC, FC))
            keep = tl.max(big, axis=1) >= filter_eps * tl.load(scale_ptr)
            fcol = v0 // FC + tl.arange(0, BLOCK_V // FC)
            at = flags_ptr + (row // FR) * n_fcols + fcol
            # only flags still down: once a block is kept, the FR rows of its row block need not each raise it (a
            # dense gradient raised every flag FR times over, FR atomics to one address; a stale read only costs
            # one redundant atomic, since flags only rise)
            down = tl.load(at, mask=fcol < n_fcols, other=1) == 0
            tl.atomic_or(at, keep.to(tl.int32), mask=keep & down & (fcol < n_fcols))


@triton.jit
def _keep_flags_kernel(g_ptr, flags_ptr, scale_ptr, C, V, stride_row, n_fcols, filter_eps,
                       FR: tl.constexpr, FC: tl.constexpr):  # fmt: skip
    """flags[rb, cb] = 1 where the stored gradient's FR x FC block (rb, cb) holds an entry >= filter_eps * scale in
    magnitude (block_keep's rule on the same rounded values), else 0: one program per block, nothing materialised."""
    rb, cb = tl.program_id(0), tl.program_id(1)
    rows = rb * FR + tl.arange(0, FR)
    cols = cb * FC + tl.arange(0, FC)
    m = (rows < C)[:, None] & (cols < V)[None, :]
    g = tl.load(g_ptr + rows[:, None].to(tl.int64) * stride_row + cols[None, :], mask=m, other=0.0).to(tl.float32)
    keep = tl.max(tl.max(tl.abs(g), axis=1), axis=0) >= filter_eps * tl.load(scale_ptr)
    tl.store(flags_ptr + rb * n_fcols + cb, keep.to(tl.int32))


def _keep_flags_triton(grad: torch.Tensor, scale: torch.Tensor, filter_eps: float, flags: torch.Tensor) -> None:
    """block_keep's flags of the stored gradient [C, V] written into flags [ceil(C/FR), ceil(V/FC)] int32 by one
    Triton pass (block_keep's fp32 copy of a [C, V] chunk cost 300 MiB at V=151552)."""
    C, V = grad.shape
    _keep_flags_kernel[tuple(flags.shape)](grad, flags, scale, C, V, grad.stride(0), flags.shape[1], filter_eps,
                                           FR=FILTER_ROWS, FC=FILTER_COLS, num_warps=4)  # fmt: skip


def _ce_grad_triton_(logits: torch.Tensor, target: torch.Tensor, scale: torch.Tensor, ignore_index: int,
                     z_loss: float, flags: torch.Tensor | None = None, filter_eps: float = 0.0) -> torch.Tensor:  # fmt: skip
    """Row losses; logits become dlogits * scale in place. With flags (zeroed, [ceil(C/FR), ceil(V/FC)]
    int32) it also raises the keep-flag of every block holding an entry >= filter_eps (unscaled)."""
    C, V = logits.shape
    loss = torch.empty(C, device=logits.device, dtype=torch.float32)
    block = 128 if TRITON_INTERPRET else max(FILTER_COLS, min(4096, triton.next_power_of_2(V)))
    _ce_grad_inplace_kernel[(C,)](
        logits, target, loss, scale, loss if flags is None else flags, logits.stride(0), V, ignore_index, z_loss,
        filter_eps, triton.cdiv(V, FILTER_COLS), BLOCK_V=block, FILTER=flags is not None, FR=FILTER_ROWS,
        FC=FILTER_COLS, num_warps=1 if TRITON_INTERPRET else 8,
    )  # fmt: skip
    return loss


@triton.jit
def _dx_block_sparse_kernel(g_ptr, w_ptr, dx_ptr, flags_ptr, C, V, H, n_fcols,
                            FR: tl.constexpr, FC: tl.constexpr, BLOCK_H: tl.constexpr, PRECISION: tl.constexpr):  # fmt: skip
    """dx[rows] = G[rows, kept blocks] @ W[kept blocks]: one program per (FR rows, BLOCK_H columns)."""
    mb = tl.program_id(0)
    rm = mb * FR + tl.arange(0, FR)
    rn = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    rk = tl.arange(0, FC)
    acc = tl.zeros((FR, BLOCK_H), dtype=tl.float32)
    for kb in range(0, n_fcols):
        if tl.load(flags_ptr + mb * n_fcols + kb) != 0:
            cols = kb * FC + rk
            g = tl.load(g_ptr + rm[:, None].to(tl.int64) * V + cols[None, :], mask=(rm < C)[:, None] & (cols < V)[None, :], other=0.0)
            w = tl.load(w_ptr + cols[:, None].to(tl.int64) * H + rn[None, :], mask=(cols < V)[:, None] & (rn < H)[None, :], other=0.0)
            acc = tl.dot(g, w, acc, input_precision=PRECISION)
    tl.store(dx_ptr + rm[:, None].to(tl.int64) * H + rn[None, :], acc.to(dx_ptr.dtype.element_ty), mask=(rm < C)[:, None] & (rn < H)[None, :])


@triton.jit
def _dw_block_sparse_kernel(g_ptr, x_ptr, dw_ptr, flags_ptr, C, V, H, n_fcols, n_frows,
                            FR: tl.constexpr, FC: tl.constexpr, BLOCK_H: tl.constexpr, PRECISION: tl.constexpr):  # fmt: skip
    """dW[vocab block] += G[:, block].T @ x over the kept row blocks; a block no row kept is not touched."""
    vb = tl.program_id(0)
    rv = vb * FC + tl.arange(0, FC)
    rn = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    rk = tl.arange(0, FR)
    acc = tl.zeros((FC, BLOCK_H), dtype=tl.float32)
    kept = 0
    for mb in range(0, n_frows):
        if tl.load(flags_ptr + mb * n_fcols + vb) != 0:
            rows = mb * FR + rk
            g = tl.load(g_ptr + rows[:, None].to(tl.int64) * V + rv[None, :], mask=(rows < C)[:, None] & (rv < V)[None, :], other=0.0)
            x = tl.load(x_ptr + rows[:, None].to(tl.int64) * H + rn[None, :], mask=(rows < C)[:, None] & (rn < H)[None, :], other=0.0)
            acc = tl.dot(tl.trans(g), x, acc, input_precision=PRECISION)
            kept += 1
    if kept > 0:
        p = dw_ptr + rv[:, None].to(tl.int64) * H + rn[None, :]
        m = (rv < V)[:, None] & (rn < H)[None, :]
        tl.store(p, (tl.load(p, mask=m, other=0.0).to(tl.float32) + acc).to(dw_ptr.dtype.element_ty), mask=m)


def _block_sparse_grads_(grad: torch.Tensor, flags: torch.Tensor, weight: torch.Tensor, xc: torch.Tensor,
                         dx: torch.Tensor | None, dw: torch.Tensor | None) -> None:  # fmt: skip
    C, V = grad.shape
    H = weight.shape[1]
    bh = 32 if TRITON_INTERPRET else 128
    warps = 1 if TRITON_INTERPRET else 4
    # fp32 inputs: 3xTF32, fp32-level sums like the dense path's cuBLAS; bf16 inputs ignore the setting
    prec = "tf32x3" if grad.dtype == torch.float32 and not TRITON_INTERPRET else "ieee"
    if dx is not None:
        _dx_block_sparse_kernel[(flags.shape[0], triton.cdiv(H, bh))](
            grad, weight, dx, flags, C, V, H, flags.shape[1], FR=FILTER_ROWS, FC=FILTER_COLS, BLOCK_H=bh, PRECISION=prec,
            num_warps=warps)  # fmt: skip
    if dw is not None:
        _dw_block_sparse_kernel[(flags.shape[1], triton.cdiv(H, bh))](
            grad, xc, dw, flags, C, V, H, flags.shape[1], flags.shape[0], FR=FILTER_ROWS, FC=FILTER_COLS, BLOCK_H=bh,
            PRECISION=prec, num_warps=warps)  # fmt: skip


@functools.lru_cache(maxsize=None)
def _warn_fallback(reason: str) -> None:
    warn_at_caller(f"fused_linear_cross_entropy: {reason}; running the eager chunked fallback (same math, slower)")


def resolve_impl(impl: str, x: torch.Tensor) -> str:
    """'triton' on CUDA sm80+; otherwise 'eager' with a one-time RuntimeWarning (dtypes are checked before)."""
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    if impl != "auto":
        if impl == "triton" and x.device.type != "cuda" and not TRITON_INTERPRET:
            raise RuntimeError("impl='triton' needs CUDA tensors (or TRITON_INTERPRET=1); use impl='auto' or 'eager'")
        return impl
    if x.device.type != "cuda":
        _warn_fallback(f"no CUDA device (inputs on {x.device.type})")
        return "eager"
    if torch.cuda.get_device_capability(x.device) < (8, 0):
        _warn_fallback(f"GPU capability {torch.cuda.get_device_capability(x.device)} is below sm80")
        return "eager"
    return "triton"


def filter_pays(kept_fraction: float, filter_max_kept: float = FILTER_MAX_KEPT) -> bool:
    """Whether gradient filtering runs for a call whose gate rows (the first GATE_ROWS) keep kept_fraction of their
    blocks."""
    return kept_fraction <= filter_max_kept


_SKIPPED_FILTER_WARNED = False
_LAST_GATE: dict[str, float | bool] = {}


def last_filter_gate() -> dict[str, float | bool]:
    """What the gate saw on the last call with filter_eps that computed gradients: {"kept_fraction", "filtered"}
    (empty before any): benchmarks report the decision the call made, not one predicted beside it."""
    return dict(_LAST_GATE)


def _gate(kept_fraction: float, filter_max_kept: float) -> bool:
    """filter_pays, saying once per process when it turns the filter off (the call then runs exact)."""
    global _SKIPPED_FILTER_WARNED
    pays = filter_pays(kept_fraction, filter_max_kept)
    _LAST_GATE.update(kept_fraction=kept_fraction, filtered=pays)
    if not pays and not _SKIPPED_FILTER_WARNED:
        _SKIPPED_FILTER_WARNED = True
        warn_at_caller(f"fused_linear_cross_entropy: filter_eps skipped, the gradients exact: the first {GATE_ROWS} rows keep "
                       f"{kept_fraction:.1%} of their blocks, above filter_max_kept={filter_max_kept:g}, where the "
                       f"block-sparse GEMMs would be slower than the dense ones (said once per process)")  # fmt: skip
    return pays


def _to_host(value: torch.Tensor) -> Callable[[], float]:
    """A scalar's host read that waits for the work queued up to here alone: a copy into pinned memory and an event
    on CUDA, so the kernels queued after it keep the GPU busy while the host waits (a plain float() waited for the
    whole stream, leaving the GPU idle until the host queued more); float() elsewhere."""
    if not value.is_cuda:
        return lambda: float(value)
    host = torch.empty((), dtype=value.dtype, pin_memory=True)
    host.copy_(value, non_blocking=True)
    ready = torch.cuda.Event()
    ready.record()

    def read() -> float:
        ready.synchronize()
        return float(host)

    return read


class _FusedLinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, target, ignore_index, reduction, z_loss, chunk, impl, need_dx, need_dw, filter_eps,
                filter_max_kept):  # fmt: skip
        T, V = x.shape[0], weight.shape[0]
        dx = torch.empty_like(x) if need_dx else None
        dw = torch.zeros_like(weight) if need_dw else None
        scale = torch.ones((), device=x.device, dtype=torch.float32)
        if reduction == "mean":  # no host sync: the count stays on the device
            scale = 1.0 / (target != ignore_index).sum().clamp(min=1).float()
        buf = x.new_empty((min(chunk, T), V))
        losses = torch.empty(T, device=x.device, dtype=torch.float32)
        flags = None
        if filter_eps is not None:
            flags = torch.empty((triton.cdiv(min(chunk, T), FILTER_ROWS), triton.cdiv(V, FILTER_COLS)), device=x.device, dtype=torch.int32)
        filtering = filter_eps is not None and (need_dx or need_dw)
        for s in range(0, T, chunk):
            xc, tc = x[s : s + chunk], target[s : s + chunk]
            logits = buf[: xc.shape[0]]
            torch.mm(xc, weight.t(), out=logits)
            if filtering and impl == "triton":
                fl = flags[: triton.cdiv(xc.shape[0], FILTER_ROWS)]
                fl.zero_()
                if s == 0:  # the gate: one host read a call, on the keep-flags of the first GATE_ROWS rows
                    g = min(GATE_ROWS, xc.shape[0])
                    losses[:g] = _ce_grad_triton_(logits[:g], tc[:g], scale, ignore_index, z_loss, fl, filter_eps)
                    share = _to_host(fl[: triton.cdiv(g, FILTER_ROWS)].float().mean())
                    if xc.shape[0] > g:  # queued before the host waits: the GPU works on while the host reads the share
                        losses[g : xc.shape[0]] = _ce_grad_triton_(logits[g:], tc[g:], scale, ignore_index, z_loss)
                    filtering = _gate(share(), filter_max_kept)
                    if filtering and xc.shape[0] > g:
                        _keep_flags_triton(logits[g:], scale, filter_eps, fl[g // FILTER_ROWS :])
                else:
                    losses[s : s + chunk] = _ce_grad_triton_(logits, tc, scale, ignore_index, z_loss, fl, filter_eps)
                if filtering:
                    _block_sparse_grads_(logits, fl, weight, xc, None if dx is None else dx[s : s + chunk], dw)
                    continue
            else:
                grad_step = _ce_grad_triton_ if impl == "triton" else _ce_grad_torch_
                losses[s : s + chunk] = grad_step(logits, tc, scale, ignore_index, z_loss)  # logits -> dlogits * scale
            if filtering:  # eager twin of the block-sparse path: the same gate, the same blocks dropped, dense GEMMs
                keep = block_keep(logits, scale, filter_eps)
                if s == 0:  # the same sample as the Triton path's gate
                    filtering = _gate(float(keep[: triton.cdiv(GATE_ROWS, FILTER_ROWS)].float().mean()), filter_max_kept)
                if filtering:
                    _drop_blocks_(logits, keep)
            if dx is not None:
                torch.mm(logits, weight, out=dx[s : s + chunk])
            if dw is not None:
                dw.addmm_(logits.t(), xc)  # weight dtype between chunks
        del buf
        ctx.save_for_backward(dx, dw)
        ctx.backward_done = False
        return losses.sum() * scale

    @staticmethod
    def backward(ctx, g):
        if ctx.backward_done:  # the stored gradients are scaled in place: a second pass would scale them twice
            raise RuntimeError("fused_linear_cross_entropy supports one backward per forward (no retain_graph reuse)")
        ctx.backward_done = True
        dx, dw = ctx.saved_tensors
        s = g.float()  # multiplied in fp32 and rounded once: casting a loss scale to bf16 first would bias it
        if dx is not None:
            dx.mul_(s)
        if dw is not None:
            dw.mul_(s)
        return dx, dw, None, None, None, None, None, None, None, None, None, None


def default_chunk_size(n_tokens: int, vocab: int, dtype: torch.dtype) -> int:
    """Rows per chunk: the largest power of two (at least 16) whose [C, V] buffer fits DEFAULT_CHUNK_BYTES, and no
    more than the tokens (one chunk then holds them all)."""
    rows = DEFAULT_CHUNK_BYTES // (vocab * torch.tensor([], dtype=dtype).element_size())
    return max(16, min(n_tokens, 1 << max(rows, 1).bit_length() - 1))


def kept_block_fraction(x: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, filter_eps: float, *,
                        ignore_index: int = -100) -> float:  # fmt: skip
    """Share of the gradient's filter blocks that filter_eps keeps on the first default-size chunk of
    these inputs: how much work the filtered path still does (1.0 = none skipped)."""
    c = default_chunk_size(x.shape[0], weight.shape[0], x.dtype)
    with torch.no_grad():
        buf = x[:c] @ weight.t()
        one = torch.ones((), device=x.device)
        _ce_grad_torch_(buf, target[:c], one, ignore_index, 0.0)
        return float(block_filter_(buf, one, filter_eps).float().mean())


def fused_linear_cross_entropy(x: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, *,
                               ignore_index: int = -100, reduction: str = "mean", z_loss: float = 0.0,
                               chunk_size: int | None = None, impl: str = "auto",
                               filter_eps: float | None = None,
                               filter_max_kept: float = FILTER_MAX_KEPT) -> torch.Tensor:  # fmt: skip
    """Drop-in LM-head loss: x [..., H] hidden states, weight [V, H] (the LM head), target [...] int64.

    Returns the scalar loss (mean over non-ignored tokens, or sum) plus z_loss * lse^2 on the same
    tokens; gradients flow to x and weight. chunk_size defaults to the rows whose [C, V] buffer fits DEFAULT_CHUNK_BYTES. One backward per forward.

    filter_eps (default None: exact) opts into gradient filtering: FILTER_ROWS x FILTER_COLS blocks of
    the gradient whose every |softmax - onehot| is below filter_eps are dropped from dx and dW (the loss
    is unaffected). 2**-12 (`BF16_FILTER_EPS`) is bf16's resolution near 1 over 32. The dropped mass
    is real: the notebook and the receipt show its effect on the gradients. The filter runs only where it
    pays (filter_pays): when the first GATE_ROWS rows keep more than filter_max_kept of their blocks, the whole call runs
    exact, said once per process with a warning (filter_max_kept=1.0 always filters)."""
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")
    if weight.dim() != 2 or x.shape[-1] != weight.shape[1]:
        raise ValueError(f"weight must be [V, H] with H = x.shape[-1] = {x.shape[-1]}, got {tuple(weight.shape)}")
    if tuple(target.shape) != tuple(x.shape[:-1]) or target.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"target must be int64/int32 of shape {tuple(x.shape[:-1])}, got {target.dtype} {tuple(target.shape)}")
    if x.dtype != weight.dtype:
        raise ValueError(f"x and weight must share a dtype, got {x.dtype} and {weight.dtype}")
    if x.dtype not in (torch.bfloat16, torch.float32):  # fp16: dlogits / n_valid underflows in the [C, V] buffer
        raise ValueError(f"x.dtype must be bfloat16 or float32, got {x.dtype}")
    # ints, not anything that compares: a chunk_size of 2.7 was truncated to 2, an ignore_index of 5.5 ignored nothing
    for name, value in (("chunk_size", chunk_size), ("ignore_index", ignore_index)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            raise ValueError(f"{name} must be an int, got {value!r}")
    if x.shape[-1] == 0:  # a reshape error deep in the chunking before
        raise ValueError(f"x must have a hidden size H >= 1, got shape {tuple(x.shape)}")
    if not z_loss >= 0:
        raise ValueError(f"z_loss must be >= 0, got {z_loss}")
    if filter_eps is not None and not 0 < filter_eps < 1:
        raise ValueError(f"filter_eps must be in (0, 1) or None, got {filter_eps}")
    if not 0 <= filter_max_kept <= 1:
        raise ValueError(f"filter_max_kept must be in [0, 1], got {filter_max_kept}")
    V = weight.shape[0]
    x2, t2 = x.reshape(-1, x.shape[-1]), target.reshape(-1).long().contiguous()  # the kernel reads targets at stride 1
    if x2.device.type == "cpu" and t2.numel():
        bad = (t2 != ignore_index) & ((t2 < 0) | (t2 >= V))
        if bool(bad.any()):
            i = int(bad.nonzero()[0, 0])
            raise ValueError(f"target[{i}] = {int(t2[i])} is outside [0, {V}) and is not ignore_index={ignore_index}")
    elif t2.numel():
        torch._assert_async(((t2 == ignore_index) | ((t2 >= 0) & (t2 < V))).all(), "target outside [0, V)")
    if chunk_size is None:
        chunk_size = default_chunk_size(x2.shape[0], V, x.dtype)
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    which = resolve_impl(impl, x2)
    if filter_eps is not None and which == "triton":  # the block-sparse GEMMs index W and x by rows
        weight, x2 = weight.contiguous(), x2.contiguous()
    grad_on = torch.is_grad_enabled()  # under no_grad the gradients are not computed at all
    return _FusedLinearCrossEntropy.apply(x2, weight, t2, ignore_index, reduction, float(z_loss), int(chunk_size), which,
                                          grad_on and x2.requires_grad, grad_on and weight.requires_grad,
                                          None if filter_eps is None else float(filter_eps),
                                          float(filter_max_kept))  # fmt: skip
