"""Mamba-3's mixer over packed rows, SISO or MIMO: the M block's layer for m_block="mamba3" (model/config.py).

    x -> in_proj -> [z (gate) | x | B | C | dt | trap | angles]        (B and C: R ranks each under MIMO)
      -> B, C: RMSNorm over N, + a learnable bias per head (and rank) (Mamba-3's B/C norm and bias)
      -> dt = softplus(dt + dt_bias), A = -exp(A_log) (fp32); trap: the trapezoid's logits; angles: the
         rotary angle rates, shared by the heads
      -> the Mamba-3 scan (megacpp_lab.kernels.mamba3: SSD's Triton op on a GPU, its chunked torch form on a
         CPU; the step loop by name), + D x
      SISO:  -> * SiLU(z) -> RMSNorm -> out_proj
      MIMO:  the scan reads R inputs x * mimo_x[r] and gives R outputs y_r; each is gated by SiLU(z * mimo_z[r])
             and RMS-normed, then sum_r mimo_o[r] * y_r -> out_proj (mamba_ssm's MIMO module, with SiLU gating)

No short convolution: the trapezoid's previous-input term takes its place. A is per head, as in Mamba-2
(mamba_ssm's module makes it data-dependent; the scan would take that as a per-token decay). The decode `step`
keeps the scan's state (S, the angles, the previous keys and inputs of every rank) and equals the forward at
every position.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from megacpp_lab.checks import config_error, is_int
from megacpp_lab.kernels.mamba3 import mamba3_scan, mamba3_step
from megacpp_lab.nn.config_builder import build_config
from megacpp_lab.nn.primitives import init_decay_params
from megacpp_lab.nn.ssm import StateSpaceFields
from megacpp_lab.varlen import PackedContext, context_positions

__all__ = ["MIMO_RANKS", "Mamba3", "Mamba3Config", "Mamba3State"]

_fail = functools.partial(config_error, "Mamba3Config")

MIMO_RANKS = (1, 2, 4, 8)  # 1 is SISO


@dataclass(frozen=True)
class Mamba3Config(StateSpaceFields):
    """Mamba-3 layer settings (StateSpaceFields's, the rotated pairs and the MIMO rank); build it with
    Mamba3Config.build. chunk counts the scan's SSD tokens: under MIMO a chunk covers chunk / mimo_rank steps."""

    rope_pairs: int = 32  # rotated (B, C) pairs per head: at most state_dim / 2
    mimo_rank: int = 1  # inputs and outputs per head and step: 1 is SISO

    def __post_init__(self) -> None:
        super().__post_init__()
        if not is_int(self.rope_pairs) or not 0 <= 2 * self.rope_pairs <= self.state_dim:
            raise _fail("rope_pairs", f"an int in [0, state_dim / 2 = {self.state_dim // 2}]", self.rope_pairs)
        if self.mimo_rank not in MIMO_RANKS or isinstance(self.mimo_rank, bool):
            raise _fail("mimo_rank", f"one of {MIMO_RANKS} (1 is SISO)", self.mimo_rank)

    @classmethod
    def build(cls, source: Any = None, **overrides: Any) -> Mamba3Config:
        """Fields from a model config object (these names or mamba3_<name>) and keyword overrides, else the defaults."""
        aliases = {"d_model": ("d_model", "hidden_size"), "n_heads": ("mamba3_n_heads", "n_heads", "num_attention_heads")}
        return build_config(cls, source, overrides, prefix="mamba3", aliases=aliases, required=("d_model", "n_heads"))


@dataclass
class Mamba3State:
    """One layer's decode state: S [B,H,P,N] (fp32), the angles theta [B,H,rope_pairs] (fp32), and the previous
    token's rotated keys [B,R,H,N] and rank inputs [B,R,H,P] (the trapezoid's previous term; R = 1 for SISO):
    all zero at a document start."""

    h: torch.Tensor
    theta: torch.Tensor
    k_prev: torch.Tensor
    x_prev: torch.Tensor


class Mamba3(nn.Module):
    """[B,T,d_model] -> [B,T,d_model] Mamba-3 mixer (SISO, or MIMO of rank mimo_rank) with document resets."""

    # the decay path, and the B/C biases (fp32 as mamba_ssm keeps them: one bf16 rounding less on every key)
    _fp32_params = ("A_log", "dt_bias", "D", "b_bias", "c_bias")

    def __init__(self, config: Mamba3Config) -> None:
        super().__init__()
        if not isinstance(config, Mamba3Config):
            raise TypeError(f"Mamba3 needs a Mamba3Config, got {type(config).__name__}")
        self.config = c = config
        H, P, G, N, R = c.n_heads, c.head_dim, c.n_groups, c.state_dim, c.mimo_rank
        self.mimo = R > 1
        self.splits = [H * P, H * P, R * G * N, R * G * N, H, H, c.rope_pairs]  # z, x, B, C, dt, trap, angles
        self.in_proj = nn.Linear(c.d_model, sum(self.splits), bias=False)
        self.A_log, self.dt_bias = init_decay_params(H, c)
        self.D = nn.Parameter(torch.ones(H))
        bias_shape = (H, R, N) if self.mimo else (H, N)
        self.b_bias = nn.Parameter(torch.ones(bias_shape))  # mamba_ssm initialises both biases at 1
        self.c_bias = nn.Parameter(torch.ones(bias_shape))
        if self.mimo:  # mamba_ssm's initialisation: the inputs and outputs averaged over the ranks, the gates at 1
            self.mimo_x = nn.Parameter(torch.full((H, R, P), 1.0 / R))
            self.mimo_z = nn.Parameter(torch.ones(H, R, P))
            self.mimo_o = nn.Parameter(torch.full((H, R, P), 1.0 / R))
        self.norm = nn.RMSNorm(H * P, eps=c.eps)
        self.out_proj = nn.Linear(H * P, c.d_model, bias=False)

    def _inputs(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        c = self.config
        B, T, _ = x.shape
        H, P, G, N = c.n_heads, c.head_dim, c.n_groups, c.state_dim
        ranked = (c.mimo_rank,) if self.mimo else ()
        z, xs, Bm, Cm, dt, trap, angles = self.in_proj(x).split(self.splits, dim=-1)
        Bm = F.rms_norm(Bm.reshape(B, T, *ranked, G, N), (N,), eps=c.eps)
        Cm = F.rms_norm(Cm.reshape(B, T, *ranked, G, N), (N,), eps=c.eps)
        dt = F.softplus(dt.float() + self.dt_bias.float())
        angles = angles.float()[:, :, None, :]  # [B,T,1,rope_pairs]: one rate row a token, shared by the heads
        return z, xs.reshape(B, T, H, P), Bm, Cm, dt, trap.float(), angles

    def forward(self, x: torch.Tensor, *, ctx: PackedContext | None = None, kernel: str | None = None) -> torch.Tensor:
        """x [B,T,d_model]; ctx, the batch's PackedContext, or None for one document per row."""
        c = self.config
        if x.dim() != 3 or x.shape[-1] != c.d_model:
            raise ValueError(f"Mamba3 input must be [B,T,{c.d_model}], got {tuple(x.shape)}")
        context_positions(ctx, tuple(x.shape))  # a context of another batch shape fails here, by name
        z, xs, Bm, Cm, dt, trap, angles = self._inputs(x)
        A = -torch.exp(self.A_log.float())
        y = mamba3_scan(xs, dt, A, Bm, Cm, trap, angles, self.b_bias, self.c_bias, self.D,
                        mimo_x=self.mimo_x if self.mimo else None, ctx=ctx, chunk=c.chunk,
                        kernel=kernel or c.kernel)  # fmt: skip
        return self._output(y, z)

    def _output(self, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """The scan's output (D x included) [B,T,H,P] (MIMO [B,T,R,H,P]) and the gate's input z [B,T,H*P]."""
        if not self.mimo:
            return self.out_proj(self.norm(y.reshape(*y.shape[:2], -1) * F.silu(z)))
        B, T, R, H, P = y.shape
        gate = F.silu(z.view(B, T, 1, H, P) * self.mimo_z.transpose(0, 1).to(z.dtype))
        y = self.norm((y * gate).reshape(B, T, R, H * P)).view(B, T, R, H, P)
        return self.out_proj((y * self.mimo_o.transpose(0, 1).to(y.dtype)).sum(2).reshape(B, T, H * P))

    # -- decode: the scan's step

    def init_state(self, batch: int, device: torch.device | str | None = None,
                   dtype: torch.dtype | None = None) -> Mamba3State:  # fmt: skip
        """The state at a document start: every part zero, fp32 (dtype, the activations', is not used: the
        state is kept in fp32 as the scan keeps it)."""
        c = self.config
        H, P, N, R = c.n_heads, c.head_dim, c.state_dim, c.mimo_rank
        zeros = functools.partial(torch.zeros, device=device)
        return Mamba3State(zeros(batch, H, P, N), zeros(batch, H, c.rope_pairs), zeros(batch, R, H, N),
                           zeros(batch, R, H, P))  # fmt: skip

    def step(self, x: torch.Tensor, state: Mamba3State) -> torch.Tensor:
        """One token x [B,1,d_model] -> [B,1,d_model]; advances `state` in place (kernels/mamba3's recurrence)."""
        c = self.config
        H = c.n_heads
        z, xs, Bm, Cm, dt, trap, angles = self._inputs(x)
        if not self.mimo:  # the rank form: one rank
            Bm, Cm, b_bias, c_bias = Bm[:, :, None], Cm[:, :, None], self.b_bias[:, None], self.c_bias[:, None]
            xr = xs[:, 0, None]  # [B,1,H,P]
        else:
            b_bias, c_bias = self.b_bias, self.c_bias
            xr = xs[:, 0, None] * self.mimo_x.transpose(0, 1).to(xs.dtype)  # [B,R,H,P]
        per_head = H // c.n_groups
        acc = torch.promote_types(xs.dtype, torch.float32)  # the scan's accumulation dtype
        B_h = Bm[:, 0].to(acc).repeat_interleave(per_head, dim=2) + b_bias.transpose(0, 1).to(acc)
        C_h = Cm[:, 0].to(acc).repeat_interleave(per_head, dim=2) + c_bias.transpose(0, 1).to(acc)
        y, state.h, state.theta, state.k_prev, state.x_prev = mamba3_step(
            state.h, state.theta, state.k_prev, state.x_prev, xr.to(acc), dt[:, 0].to(acc),
            -torch.exp(self.A_log.float()).to(acc), torch.sigmoid(trap[:, 0].to(acc)),
            torch.tanh(angles[:, 0].to(acc)) * math.pi, B_h, C_h, self.D)  # A as the forward makes it  # fmt: skip
        y = y[:, None].to(xs.dtype)  # [B,1,R,H,P]
        return self._output(y if self.mimo else y[:, :, 0], z)
