"""Fused linear cross-entropy: loss and gradients of CE(x @ W.T, y) without the [T, V] logits.

The tokens are walked in chunks of C rows. One [C, V] buffer (in x's dtype) is reused by every chunk:
1. logits = x_c @ W.T (cuBLAS) into the buffer;
2. `_ce_grad_inplace_kernel` (Triton, one program per row) makes two passes over the row: an online
   max / sum-exp for lse, then it overwrites the logits with dlogits = (softmax * (1 + 2z lse) - onehot)
   * scale (scale = 1/n_valid for the mean, on the device: no host sync), and writes the row's loss;
3. dx_c = dlogits @ W and dW += dlogits.T @ x_c (cuBLAS, fp32 accumulation inside each GEMM).
The backward only scales dx and dW by the incoming gradient, in place. Memory beyond the inputs: dx,
dW and the one [C, V] buffer; the chunk size follows a byte budget for that buffer.

Dispatch: on CUDA with bf16/fp32 inputs (sm80+) step 2 is the Triton kernel. Anywhere else the same
chunked loop runs with a torch version of step 2, after a RuntimeWarning: never a crash, never
silently. The reference is `linear_cross_entropy_reference`, F.cross_entropy over materialised logits.
"""

from __future__ import annotations

import functools
import warnings

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from megacpp_lab.kernels import TRITON_INTERPRET

REDUCTIONS = ("mean", "sum")
IMPLS = ("auto", "triton", "eager")
# The one reused [C, V] logits/gradient buffer. 80 MiB gives C = 256 at V = 151552 in bf16: with dW (V x H)
# and dx that keeps the LM-head loss under 1.3 GiB of extra memory at T=8192, H=4096. A larger chunk
# is faster (fewer passes over W and dW; see profiles/*/loss/flce_fwd_bwd.json) and costs C * V * 2 bytes.
DEFAULT_CHUNK_BYTES = 80 * 2**20
CHUNK_MULTIPLE = 64  # GEMM-tile friendly row count


def linear_cross_entropy_reference(x: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, *,
                                   ignore_index: int = -100, reduction: str = "mean",
                                   z_loss: float = 0.0) -> torch.Tensor:  # fmt: skip
    """Materialised logits [T, V] in fp32, F.cross_entropy, plus z_loss * mean(lse^2) over valid tokens."""
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


@triton.jit
def _ce_grad_inplace_kernel(
    logits_ptr, target_ptr, loss_ptr, scale_ptr, stride_row, V, ignore_index, z_loss,
    BLOCK_V: tl.constexpr,
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
        alpha = tl.where(m_new == float("-inf"), 1.0, tl.exp(m - m_new))
        acc = acc * alpha + tl.where(x == float("-inf"), 0.0, tl.exp(x - m_new))
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
        g = tl.exp(x - lse) * coef - tl.where(c == y_safe, hit, 0.0)
        tl.store(ptr + c, g.to(logits_ptr.dtype.element_ty), mask=c < V)


def _ce_grad_triton_(logits: torch.Tensor, target: torch.Tensor, scale: torch.Tensor, ignore_index: int,
                     z_loss: float) -> torch.Tensor:  # fmt: skip
    C, V = logits.shape
    loss = torch.empty(C, device=logits.device, dtype=torch.float32)
    block = 64 if TRITON_INTERPRET else min(4096, triton.next_power_of_2(V))
    _ce_grad_inplace_kernel[(C,)](logits, target, loss, scale, logits.stride(0), V, ignore_index, z_loss,
                                  BLOCK_V=block, num_warps=1 if TRITON_INTERPRET else 8)  # fmt: skip
    return loss


@functools.lru_cache(maxsize=None)
def _warn_fallback(reason: str) -> None:
    warnings.warn(f"fused_linear_cross_entropy: {reason}; running the eager chunked fallback (same math, slower)",
                  RuntimeWarning, stacklevel=4)  # fmt: skip


def resolve_impl(impl: str, x: torch.Tensor) -> str:
    """'triton' on CUDA with bf16/fp32 on sm80+; otherwise 'eager' with a one-time RuntimeWarning."""
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    if impl != "auto":
        if impl == "triton" and x.device.type != "cuda" and not TRITON_INTERPRET:
            raise RuntimeError("impl='triton' needs CUDA tensors (or TRITON_INTERPRET=1); use impl='auto' or 'eager'")
        return impl
    if x.device.type != "cuda":
        _warn_fallback(f"no CUDA device (inputs on {x.device.type})")
        return "eager"
    if x.dtype not in (torch.bfloat16, torch.float32):
        _warn_fallback(f"dtype {x.dtype} is not bf16/fp32")
        return "eager"
    if torch.cuda.get_device_capability(x.device) < (8, 0):
        _warn_fallback(f"GPU capability {torch.cuda.get_device_capability(x.device)} is below sm80")
        return "eager"
    return "triton"


class _FusedLinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, target, ignore_index, reduction, z_loss, chunk, impl, need_dx, need_dw):
        grad_step = _ce_grad_triton_ if impl == "triton" else _ce_grad_torch_
        T, V = x.shape[0], weight.shape[0]
        dx = torch.empty_like(x) if need_dx else None
        dw = torch.zeros_like(weight) if need_dw else None
        scale = torch.ones((), device=x.device, dtype=torch.float32)
        if reduction == "mean":  # no host sync: the count stays on the device
            scale = 1.0 / (target != ignore_index).sum().clamp(min=1).float()
        buf = x.new_empty((min(chunk, T), V))
        losses = torch.empty(T, device=x.device, dtype=torch.float32)
        for s in range(0, T, chunk):
            xc, tc = x[s : s + chunk], target[s : s + chunk]
            logits = buf[: xc.shape[0]]
            torch.mm(xc, weight.t(), out=logits)
            losses[s : s + chunk] = grad_step(logits, tc, scale, ignore_index, z_loss)  # logits -> dlogits * scale
            if dx is not None:
                torch.mm(logits, weight, out=dx[s : s + chunk])
            if dw is not None:
                dw.addmm_(logits.t(), xc)  # fp32 accumulation inside the GEMM, weight dtype between chunks
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
        s = g.float()
        if dx is not None:
            dx.mul_(s.to(dx.dtype))
        if dw is not None:
            dw.mul_(s.to(dw.dtype))
        return dx, dw, None, None, None, None, None, None, None, None


def default_chunk_size(n_tokens: int, vocab: int, dtype: torch.dtype) -> int:
    """Rows per chunk whose [C, V] buffer fits DEFAULT_CHUNK_BYTES, rounded down to CHUNK_MULTIPLE."""
    rows = DEFAULT_CHUNK_BYTES // (vocab * torch.tensor([], dtype=dtype).element_size())
    return max(16, min(n_tokens, rows // CHUNK_MULTIPLE * CHUNK_MULTIPLE or rows))


def fused_linear_cross_entropy(x: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, *,
                               ignore_index: int = -100, reduction: str = "mean", z_loss: float = 0.0,
                               chunk_size: int | None = None, impl: str = "auto") -> torch.Tensor:  # fmt: skip
    """Drop-in LM-head loss: x [..., H] hidden states, weight [V, H] (the LM head), target [...] int64.

    Returns the scalar loss (mean over non-ignored tokens, or sum) plus z_loss * lse^2 on the same
    tokens; gradients flow to x and weight. chunk_size defaults to the rows whose [C, V] buffer fits DEFAULT_CHUNK_BYTES. One backward per forward."""
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")
    if weight.dim() != 2 or x.shape[-1] != weight.shape[1]:
        raise ValueError(f"weight must be [V, H] with H = x.shape[-1] = {x.shape[-1]}, got {tuple(weight.shape)}")
    if tuple(target.shape) != tuple(x.shape[:-1]) or target.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"target must be int64/int32 of shape {tuple(x.shape[:-1])}, got {target.dtype} {tuple(target.shape)}")
    if x.dtype != weight.dtype:
        raise ValueError(f"x and weight must share a dtype, got {x.dtype} and {weight.dtype}")
    if not z_loss >= 0:
        raise ValueError(f"z_loss must be >= 0, got {z_loss}")
    V = weight.shape[0]
    x2, t2 = x.reshape(-1, x.shape[-1]), target.reshape(-1).long()
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
    grad_on = torch.is_grad_enabled()  # under no_grad the gradients are not computed at all
    return _FusedLinearCrossEntropy.apply(x2, weight, t2, ignore_index, reduction, float(z_loss), int(chunk_size), which,
                                          grad_on and x2.requires_grad, grad_on and weight.requires_grad)  # fmt: skip
