"""The MLA down-projection, RMSNorm and up-projection in one autograd function that keeps no latent.

`FusedDownNormUp` saves x, the per-row reciprocal RMS and the weights; the [*, rank] latent is recomputed
in the backward and the RMSNorm gradient is written out. `down_norm_up_reference` is the unfused chain
it must match (tests/test_down_norm_up.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["FusedDownNormUp", "down_norm_up_reference"]


class FusedDownNormUp(torch.autograd.Function):
    """y = W_up @ RMSNorm(W_down @ x) * rms_weight, saving only x, rrms and the weights.

    The latent [*, rank] is recomputed in the backward, and the RMSNorm gradient is written out
    (grad_latent = rrms * (g - n * mean(g * n)), n = latent * rrms), not taken through autograd."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, w_down: torch.Tensor, rms_weight: torch.Tensor, w_up: torch.Tensor, eps: float):
        acc = torch.promote_types(x.dtype, torch.float32)  # norm math in fp32 (fp64 stays fp64 for gradcheck)
        latent = (x @ w_down.t()).to(acc)
        rrms = torch.rsqrt(latent.pow(2).mean(-1, keepdim=True) + eps)
        normed = (latent * rrms * rms_weight.to(acc)).to(x.dtype)
        ctx.save_for_backward(x, rrms, w_down, rms_weight, w_up)
        return normed @ w_up.t()

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        x, rrms, w_down, rms_weight, w_up = ctx.saved_tensors
        acc = rrms.dtype
        n = (x @ w_down.t()).to(acc) * rrms  # the latent, recomputed: the one [*, rank] tensor not kept
        normed = (n * rms_weight.to(acc)).to(x.dtype)
        d_normed = (dy @ w_up).to(acc)
        d_up = dy.reshape(-1, dy.shape[-1]).t() @ normed.reshape(-1, normed.shape[-1])
        d_weight = (d_normed * n).reshape(-1, n.shape[-1]).sum(0)
        g = d_normed * rms_weight.to(acc)
        d_latent = (rrms * (g - n * (g * n).mean(-1, keepdim=True))).to(x.dtype)
        dx = d_latent @ w_down
        d_down = d_latent.reshape(-1, d_latent.shape[-1]).t() @ x.reshape(-1, x.shape[-1])
        return dx, d_down, d_weight.to(rms_weight.dtype), d_up, None


def down_norm_up_reference(x: torch.Tensor, w_down: torch.Tensor, rms_weight: torch.Tensor, w_up: torch.Tensor,
                           eps: float) -> torch.Tensor:  # fmt: skip
    """The unfused chain FusedDownNormUp must match."""
    acc = torch.promote_types(x.dtype, torch.float32)
    latent = (x @ w_down.t()).to(acc)
    return F.rms_norm(latent, (latent.shape[-1],), rms_weight.to(acc), eps).to(x.dtype) @ w_up.t()
