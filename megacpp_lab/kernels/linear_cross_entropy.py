"""Fused linear cross-entropy: loss and gradients of CE(x @ W.T, y) without the [T, V] logits.

The tokens are walked in chunks of C rows. Each chunk's logits [C, V] (fp32) live only inside the
chunk: the forward computes the loss and, at once, the chunk's gradient dlogits = softmax - onehot
(plus the z-loss term), folds it into dx = dlogits @ W and dW += dlogits.T @ x, and drops it. The
backward only scales the stored dx, dW by the incoming gradient. Memory beyond the inputs: dx, dW and
one chunk's logits; the chunk size follows a byte budget.

Dispatch: on CUDA with bf16/fp32 inputs (sm80+) the chunk step runs torch.compile'd (inductor fuses
the softmax, the target gather and the z-loss term into the GEMM epilogues' neighbours). Anywhere
else the same chunked math runs eagerly, after a RuntimeWarning: never a crash, never silently.
The reference is `linear_cross_entropy_reference`, F.cross_entropy over materialised logits.
"""

from __future__ import annotations

import functools
import warnings

import torch
import torch.nn.functional as F

REDUCTIONS = ("mean", "sum")
IMPLS = ("auto", "compiled", "eager")
DEFAULT_CHUNK_BYTES = 128 * 2**20  # one chunk's fp32 logits plus their low-precision gradient copy


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


def _chunk_step(x: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, ignore_index: int,
                z_loss: float) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """(summed loss of the chunk, dlogits [C, V] in x's dtype) for unscaled (sum) reduction."""
    logits = (x @ weight.t()).float()
    lse = torch.logsumexp(logits, dim=-1)
    valid = target != ignore_index
    safe = torch.where(valid, target, 0)
    target_logit = logits.gather(1, safe[:, None]).squeeze(1)
    loss = torch.where(valid, lse - target_logit + z_loss * lse * lse, 0.0).sum()
    probs = torch.exp(logits - lse[:, None])
    grad = probs * (1.0 + 2.0 * z_loss * lse)[:, None]  # d/dlogits of lse - logit_y + z * lse^2
    grad = grad.scatter_add(1, safe[:, None], -torch.ones_like(lse)[:, None])
    grad = torch.where(valid[:, None], grad, 0.0)
    return loss, grad.to(x.dtype)


@functools.lru_cache(maxsize=None)
def _compiled_chunk_step():
    return torch.compile(_chunk_step, dynamic=True)


@functools.lru_cache(maxsize=None)
def _warn_fallback(reason: str) -> None:
    warnings.warn(f"fused_linear_cross_entropy: {reason}; running the eager chunked fallback (same math, slower)",
                  RuntimeWarning, stacklevel=4)  # fmt: skip


def resolve_impl(impl: str, x: torch.Tensor) -> str:
    """'compiled' on CUDA with bf16/fp32 on sm80+; otherwise 'eager' with a one-time RuntimeWarning."""
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    if impl != "auto":
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
    return "compiled"


class _FusedLinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, target, ignore_index, reduction, z_loss, chunk, impl):
        step = _compiled_chunk_step() if impl == "compiled" else _chunk_step
        T = x.shape[0]
        dx = torch.empty_like(x) if x.requires_grad else None
        dw = torch.zeros_like(weight) if weight.requires_grad else None
        total = torch.zeros((), device=x.device, dtype=torch.float32)
        for s in range(0, T, chunk):
            xc, tc = x[s : s + chunk], target[s : s + chunk]
            loss, grad = step(xc, weight, tc, ignore_index, z_loss)
            total = total + loss
            if dx is not None:
                torch.mm(grad, weight, out=dx[s : s + chunk])
            if dw is not None:
                dw.addmm_(grad.t(), xc)  # fp32 accumulation inside the GEMM, weight dtype between chunks
        scale = torch.ones((), device=x.device)
        if reduction == "mean":  # no host sync: the count stays on the device
            scale = 1.0 / (target != ignore_index).sum().clamp(min=1).float()
        ctx.save_for_backward(dx, dw, scale)
        return total * scale

    @staticmethod
    def backward(ctx, g):
        dx, dw, scale = ctx.saved_tensors
        s = (g.float() * scale)
        return (None if dx is None else dx * s.to(dx.dtype), None if dw is None else dw * s.to(dw.dtype),
                None, None, None, None, None, None)  # fmt: skip


def fused_linear_cross_entropy(x: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, *,
                               ignore_index: int = -100, reduction: str = "mean", z_loss: float = 0.0,
                               chunk_size: int | None = None, impl: str = "auto") -> torch.Tensor:  # fmt: skip
    """Drop-in LM-head loss: x [..., H] hidden states, weight [V, H] (the LM head), target [...] int64.

    Returns the scalar loss (mean over non-ignored tokens, or sum) plus z_loss * lse^2 on the same
    tokens; gradients flow to x and weight. chunk_size defaults to what fits DEFAULT_CHUNK_BYTES."""
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
        chunk_size = max(16, min(x2.shape[0], DEFAULT_CHUNK_BYTES // (V * (4 + x.element_size()))))
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    which = resolve_impl(impl, x2)
    return _FusedLinearCrossEntropy.apply(x2, weight, t2, ignore_index, reduction, float(z_loss), int(chunk_size), which)
