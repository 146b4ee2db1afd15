"""Compact activations: a Linear that saves a seeded random projection of its input, not the input.

    y = x W^T                                      (exact)
    saved: x R,  R [in, rank] ~ N(0, 1/rank)      (rank/in of the input's bytes; R itself is not stored:
                                                   it is regenerated from its seed in the backward)
    dx = dy W                                      (exact)
    dW = dy^T (x R) R^T                            (approximate: E[R R^T] = I, so dW is unbiased)

Every call draws a new R (seed = base seed + call count), so the error does not point the same way step after
step. Opt-in: the weight gradient is noisier (tests/test_compact_linear.py measures the error against the
exact one, and its fall with the rank).
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["CompactLinear", "compact_linear", "projection"]


def projection(features: int, rank: int, seed: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """R [features, rank] with N(0, 1/rank) entries, the same for the same seed (drawn on the CPU: the same on
    every device)."""
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(features, rank, generator=gen, device="cpu") / rank**0.5).to(device=device, dtype=dtype)


class _CompactLinearFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, rank: int, seed: int) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        if weight.requires_grad:
            ctx.save_for_backward(flat @ projection(x.shape[-1], rank, seed, x.device, x.dtype), weight)
        else:
            ctx.save_for_backward(None, weight)
        ctx.rank, ctx.seed, ctx.in_shape = rank, seed, x.shape
        return x @ weight.t()

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        x_proj, weight = ctx.saved_tensors
        g = dy.reshape(-1, dy.shape[-1])
        dx = (g @ weight).view(ctx.in_shape) if ctx.needs_input_grad[0] else None
        dw = None
        if ctx.needs_input_grad[1]:
            r = projection(ctx.in_shape[-1], ctx.rank, ctx.seed, g.device, x_proj.dtype)
            dw = (g.t().to(x_proj.dtype) @ x_proj) @ r.t()
            dw = dw.to(weight.dtype)
        return dx, dw, None, None


def compact_linear(x: torch.Tensor, weight: torch.Tensor, rank: int, seed: int) -> torch.Tensor:
    """x [..., in] @ weight[out, in]^T, saving x R [..., rank] for the backward; see the module docstring."""
    if not isinstance(rank, int) or isinstance(rank, bool) or not 1 <= rank <= x.shape[-1]:
        raise ValueError(f"rank must be an int in [1, {x.shape[-1]}] (the input features), got {rank!r}")
    return _CompactLinearFn.apply(x, weight, rank, seed)


class CompactLinear(nn.Module):
    """Holds a bias-free nn.Linear's weight (same parameter, same state-dict key) and runs compact_linear,
    with a new projection seed every call."""

    def __init__(self, linear: nn.Linear, rank: int, seed: int = 0) -> None:
        super().__init__()
        if linear.bias is not None:
            raise ValueError("CompactLinear wraps bias-free Linears (the model's projections have no bias)")
        if not isinstance(rank, int) or isinstance(rank, bool) or not 1 <= rank <= linear.in_features:
            raise ValueError(f"rank must be an int in [1, {linear.in_features}] (in_features), got {rank!r}")
        self.weight = linear.weight
        self.rank, self.seed, self.calls = rank, seed, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not torch.is_grad_enabled():
            return x @ self.weight.t()
        self.calls += 1
        return compact_linear(x, self.weight, self.rank, self.seed * 1_000_003 + self.calls)

    def extra_repr(self) -> str:
        return f"in_features={self.weight.shape[1]}, out_features={self.weight.shape[0]}, rank={self.rank}"
