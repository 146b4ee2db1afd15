"""Mamba-3's scan (Lahoti et al., ICLR 2026): the step-loop reference over packed rows.

Mamba-3 changes Mamba-2's SSD recurrence in three ways; the SISO form (one input and one output per head and
step) is

    theta_t = (theta_{t-1} + pi * tanh(angles_t) * dt_t) mod 2 pi          data-dependent rotary angles
    k_t = rot(B_t + b_bias, theta_t),  q_t = rot(C_t + c_bias, theta_t)   (a complex-valued state, as rotations)
    lam_t = sigmoid(trap_t),  alpha_t = exp(dt_t * A)
    S_t = alpha_t S_{t-1} + (1 - lam_t) dt_t alpha_t x_{t-1} k_{t-1}^T + lam_t dt_t x_t k_t^T    (trapezoid)
    y_t = S_t q_t + D x_t

with S [P,N] per head in fp32. The trapezoid mixes the current input and the previous one (which is why the
block needs no short convolution); with lam = 1 and no angles it is Mamba-2's SSD exactly (tests/test_mamba3.py
checks that against kernels/ssd.py's step loop). At every document start the whole state restarts: S, the
previous input and key (so the trapezoid's previous term is zero there) and the angles.

**The SISO scan is Mamba-2's SSD with a per-token input scale.** Token s's x_s k_s^T enters S_t (t >= s) with
weight (gamma_s + [t > s] delta_{s+1}) prod_{j=s+1..t} alpha_j, where gamma_s = lam_s dt_s and delta_{s+1} =
(1 - lam_{s+1}) dt_{s+1} (zero when s+1 starts a document): the trapezoid's previous term is token s's
contribution one step later. So with the rotated, biased keys and queries per head, y = SSD(x * w / dt, dt, A,
k, q) - delta_next * (q . k) x + D x, w = gamma + delta_next: the SSD scan (its chunked torch form, or the lab's
Triton kernel) does the scan, and what Mamba-3 adds is elementwise. `mamba3_scan` is that; the step loop is its
oracle. MIMO, a fused Triton kernel and the layer are issue 29's remaining work. Shapes follow kernels/ssd.py: x [B,T,H,P], dt [B,T,H], A [H], B and C [B,T,G,N]
(G groups of heads, H % G == 0), the trapezoid logits trap [B,T,H], the angle rates angles [B,T,H,N_a] with
N_a <= N/2 (the pairs past N_a are not rotated), the biases [H,N], D [H].
"""

from __future__ import annotations

import math

import torch

from megacpp_lab.kernels.ssd import doc_start_mask, ssd_scan
from megacpp_lab.varlen import PackedContext

__all__ = ["KERNELS", "mamba3_scan", "mamba3_scan_reference", "rotate_pairs"]

KERNELS = ("auto", "triton", "chunked", "reference")


def _check(name: str, t: torch.Tensor, shape: tuple[int, ...]) -> None:
    if not isinstance(t, torch.Tensor) or tuple(t.shape) != shape:
        raise ValueError(f"mamba3 {name} must be a tensor of shape {list(shape)}, got "
                         f"{list(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__}")  # fmt: skip


def rotate_pairs(v: torch.Tensor, theta: torch.Tensor) -> torch.Tensor:
    """Rotate the first theta.shape[-1] pairs (v[2i], v[2i+1]) of v [..., N] by theta [..., N_a]."""
    n_a = theta.shape[-1]
    pairs = v[..., : 2 * n_a].unflatten(-1, (n_a, 2))
    re, im = pairs[..., 0], pairs[..., 1]
    cos, sin = torch.cos(theta), torch.sin(theta)
    rotated = torch.stack((re * cos - im * sin, re * sin + im * cos), dim=-1).flatten(-2)
    return torch.cat((rotated, v[..., 2 * n_a :]), dim=-1)


@torch.compiler.disable  # dynamo would unroll the T steps into one enormous graph
def mamba3_scan_reference(
    x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, Bm: torch.Tensor, Cm: torch.Tensor, trap: torch.Tensor,
    angles: torch.Tensor, b_bias: torch.Tensor, c_bias: torch.Tensor, D: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
) -> torch.Tensor:  # fmt: skip
    """The SISO step loop (module docstring): fp32 state and angles (fp64 inputs stay fp64), every state
    restarted at each document start of cu_seqlens (over the flattened B*T tokens; None: one document per row).
    Returns y [B,T,H,P] in x's dtype."""
    B, T, H, P, G, N, n_a = _validate(x, dt, A, Bm, Cm, trap, angles, b_bias, c_bias, D)
    acc = torch.promote_types(x.dtype, torch.float32)
    reset = doc_start_mask(cu_seqlens, B, T, x.device)
    per_head = H // G
    Bh = (Bm.to(acc).repeat_interleave(per_head, dim=2) + b_bias.to(acc))  # [B,T,H,N]
    Ch = (Cm.to(acc).repeat_interleave(per_head, dim=2) + c_bias.to(acc))
    xs, dts, Af, lam = x.to(acc), dt.to(acc), A.to(acc), torch.sigmoid(trap.to(acc))
    rates = torch.tanh(angles.to(acc)) * math.pi
    S = torch.zeros((B, H, P, N), dtype=acc, device=x.device)
    theta = torch.zeros((B, H, max(n_a, 0)), dtype=acc, device=x.device)
    k_prev = torch.zeros((B, H, N), dtype=acc, device=x.device)
    x_prev = torch.zeros((B, H, P), dtype=acc, device=x.device)
    ys = []
    for t in range(T):
        start = reset[:, t].view(B, 1, 1)
        S = torch.where(start[..., None], torch.zeros_like(S), S)
        theta = torch.where(start, torch.zeros_like(theta), theta)
        k_prev = torch.where(start, torch.zeros_like(k_prev), k_prev)
        x_prev = torch.where(start, torch.zeros_like(x_prev), x_prev)
        theta = torch.remainder(theta + rates[:, t] * dts[:, t, :, None], 2 * math.pi)
        k, q = rotate_pairs(Bh[:, t], theta), rotate_pairs(Ch[:, t], theta)
        alpha = torch.exp(dts[:, t] * Af)  # [B,H]
        prev_w = ((1 - lam[:, t]) * dts[:, t] * alpha)[..., None, None]
        cur_w = (lam[:, t] * dts[:, t])[..., None, None]
        S = alpha[..., None, None] * S + prev_w * x_prev[..., None] * k_prev[:, :, None] + cur_w * xs[:, t, ..., None] * k[:, :, None]
        y = (S @ q[..., None]).squeeze(-1)
        if D is not None:
            y = y + D.to(acc)[:, None] * xs[:, t]
        ys.append(y)
        k_prev, x_prev = k, xs[:, t]
    return torch.stack(ys, dim=1).to(x.dtype)


def _validate(x, dt, A, Bm, Cm, trap, angles, b_bias, c_bias, D) -> tuple[int, int, int, int, int, int, int]:  # noqa: ANN001
    if x.dim() != 4:
        raise ValueError(f"mamba3 x must be [B,T,H,P], got {list(x.shape)}")
    B, T, H, P = x.shape
    if Bm.dim() != 4:
        raise ValueError(f"mamba3 Bm must be [B,T,G,N], got {list(Bm.shape)}")
    G, N = Bm.shape[2], Bm.shape[3]
    if H % G:
        raise ValueError(f"mamba3: the heads H={H} must be a multiple of the groups G={G} (Bm's dim 2)")
    n_a = angles.shape[-1] if angles.dim() == 4 else -1
    for name, t, shape in (("dt", dt, (B, T, H)), ("A", A, (H,)), ("Bm", Bm, (B, T, G, N)), ("Cm", Cm, (B, T, G, N)),
                           ("trap", trap, (B, T, H)), ("angles", angles, (B, T, H, n_a)), ("b_bias", b_bias, (H, N)),
                           ("c_bias", c_bias, (H, N))):  # fmt: skip
        _check(name, t, shape)
    if not 0 <= 2 * n_a <= N:
        raise ValueError(f"mamba3 angles: at most N/2 = {N // 2} rotated pairs per head, got {n_a}")
    if D is not None:
        _check("D", D, (H,))
    return B, T, H, P, G, N, n_a


def mamba3_scan(
    x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, Bm: torch.Tensor, Cm: torch.Tensor, trap: torch.Tensor,
    angles: torch.Tensor, b_bias: torch.Tensor, c_bias: torch.Tensor, D: torch.Tensor | None = None, *,
    cu_seqlens: torch.Tensor | None = None, ctx: PackedContext | None = None, chunk: int = 64, kernel: str = "auto",
) -> torch.Tensor:  # fmt: skip
    """The SISO Mamba-3 scan over packed rows, y [B,T,H,P] in x's dtype, through the SSD scan (module
    docstring). The documents: ctx (the batch's PackedContext), or bare cu_seqlens, or neither (one document per
    row). kernel: "triton" (the lab's SSD Triton op), "chunked" (plain torch, compilable), "reference" (the step
    loop), "auto" (Triton on CUDA, chunked elsewhere)."""
    if kernel not in KERNELS:
        raise ValueError(f"mamba3 kernel must be one of {KERNELS}, got {kernel!r}")
    if ctx is not None:
        if cu_seqlens is not None:
            raise ValueError("mamba3: give ctx or cu_seqlens, not both")
        cu_seqlens = ctx.cu_seqlens
    if kernel == "reference":
        return mamba3_scan_reference(x, dt, A, Bm, Cm, trap, angles, b_bias, c_bias, D, cu_seqlens)
    B, T, H, P, G, N, n_a = _validate(x, dt, A, Bm, Cm, trap, angles, b_bias, c_bias, D)
    acc = torch.promote_types(x.dtype, torch.float32)
    start = doc_start_mask(cu_seqlens, B, T, x.device)  # [B,T]
    dts, lam = dt.to(acc), torch.sigmoid(trap.to(acc))
    # the angles: a cumulative sum that restarts at every document start, in fp64 (a long document's sum
    # would lose the angle's low bits in fp32), then taken mod 2 pi as the step loop does at every step
    inc = (torch.tanh(angles.double()) * math.pi) * dt.double()[..., None]  # [B,T,H,n_a]
    total = torch.cumsum(inc, dim=1)
    before = total - inc  # the sum before each token
    first = torch.cummax(torch.where(start, torch.arange(T, device=x.device), 0), dim=1).values  # [B,T]
    base = torch.gather(before, 1, first[:, :, None, None].expand_as(before))
    theta = torch.remainder(total - base, 2 * math.pi).to(acc)
    per_head = H // G
    k = rotate_pairs(Bm.to(acc).repeat_interleave(per_head, dim=2) + b_bias.to(acc), theta)  # [B,T,H,N]
    q = rotate_pairs(Cm.to(acc).repeat_interleave(per_head, dim=2) + c_bias.to(acc), theta)
    # delta_next: the next token's previous-input weight, zero where the next token starts a document (or past the row)
    continues = torch.cat((~start[:, 1:], torch.zeros_like(start[:, :1])), dim=1)
    delta_next = torch.cat((((1 - lam) * dts)[:, 1:], torch.zeros_like(dts[:, :1])), dim=1) * continues[..., None]
    scale = lam + delta_next / dts  # w / dt, w = gamma + delta_next
    y = ssd_scan((x.to(acc) * scale[..., None]).to(x.dtype), dt, A, k.to(x.dtype), q.to(x.dtype),
                 cu_seqlens=cu_seqlens, chunk=chunk, kernel=kernel)  # fmt: skip
    y = y.to(acc) - (delta_next * (q * k).sum(-1))[..., None] * x.to(acc)
    if D is not None:
        y = y + D.to(acc)[:, None] * x.to(acc)
    return y.to(x.dtype)
