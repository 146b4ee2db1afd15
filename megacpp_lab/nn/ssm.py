"""Mamba-2's SSD layer over packed rows (state resets at every document start): the M block with m_block="mamba2".

    x -> in_proj -> [z (gate) | x B C | dt]
      -> doc-masked causal depthwise conv + SiLU over x, B, C
      -> dt = softplus(dt + dt_bias), A = -exp(A_log)                       (fp32)
      -> SSD scan (megacpp_lab.kernels.ssd: Triton on a GPU, the chunked torch path on a CPU)
      -> + x * D -> * SiLU(z) -> RMSNorm -> out_proj

The scan is an opaque custom op on the Triton path, so a compiled block holding this layer has no
graph break. A_log, dt_bias and D are fp32-contract parameters (`_fp32_params`): the decay exp(dt * A)
sits near 1, where bf16 would round it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from megacpp_lab.checks import check_ints, config_error, is_int
from megacpp_lab.kernels.ssd import KERNELS, ssd_scan
from megacpp_lab.nn.config_builder import build_config
from megacpp_lab.nn.primitives import CONV_IMPLS, DocCausalDepthwiseConv, check_decay_init, conv_stepper, init_decay_params
from megacpp_lab.varlen import PackedContext, context_positions

__all__ = ["SSD", "SSDConfig", "SSDState", "StateSpaceFields"]

_fail = functools.partial(config_error, "SSDConfig")


@dataclass(frozen=True)
class StateSpaceFields:
    """What the M block's state-space mixers share (SSD here, Mamba-3 in nn/mamba3.py): n_heads heads of
    head_dim channels over a state_dim state, B and C shared by groups of heads, the scan's chunk, Mamba's decay
    initialisation, the scan kernel by name and the output norm's eps. A base of fields, not a config of its own
    (its subclasses are built); checked on construction, the error naming the subclass and the field."""

    d_model: int
    n_heads: int
    head_dim: int = 64  # P
    state_dim: int = 128  # N
    n_groups: int = 1  # heads sharing one B and C
    chunk: int = 64
    A_init_range: tuple[float, float] = (1.0, 16.0)
    dt_min: float = 0.001
    dt_max: float = 0.1
    dt_init_floor: float = 1e-4
    kernel: str = "auto"
    eps: float = 1e-6

    def __post_init__(self) -> None:
        name = type(self).__name__
        fail = functools.partial(config_error, name)
        object.__setattr__(self, "A_init_range", tuple(self.A_init_range))
        check_ints(name, self, ("d_model", "n_heads", "head_dim", "state_dim", "n_groups", "chunk"))
        if self.n_heads % self.n_groups:
            raise fail("n_groups", f"a divisor of n_heads={self.n_heads}", self.n_groups)
        check_decay_init(self, fail)
        if self.kernel not in KERNELS:  # the SSD and Mamba-3 scans take the same four
            raise fail("kernel", f"one of {KERNELS}", self.kernel)
        if self.kernel == "triton":  # tl.dot tiles: refused here, not at the first forward (kernels/ssd.py's rule)
            for field in ("chunk", "head_dim", "state_dim"):
                value = getattr(self, field)
                if value < 16 or value & (value - 1):
                    raise fail(field, "a power of two >= 16 with kernel='triton' (the Triton scan's tiles)", value)
        if not 0 < self.eps < 1:
            raise fail("eps", "in (0, 1)", self.eps)


@dataclass(frozen=True)
class SSDConfig(StateSpaceFields):
    """SSD layer settings; build it with SSDConfig.build. Frozen, checked on construction."""

    conv_kernel: int = 4
    conv_impl: str = "xla_safe"  # nn/primitives.CONV_IMPLS: the x/B/C conv's form ("auto": Triton on a GPU)

    def __post_init__(self) -> None:
        super().__post_init__()
        if not is_int(self.conv_kernel) or not 0 <= self.conv_kernel <= 16:
            raise _fail("conv_kernel", "0 (no conv) or a kernel size in 1..16", self.conv_kernel)
        if self.conv_impl not in CONV_IMPLS:
            raise _fail("conv_impl", f"one of {CONV_IMPLS}", self.conv_impl)

    @classmethod
    def build(cls, source: Any = None, **overrides: Any) -> SSDConfig:
        """The one builder: fields from a model config object (these names, ssd_<name>, or Megatron's
        hidden_size / num_attention_heads) and keyword overrides, else the defaults."""
        aliases = {"d_model": ("d_model", "hidden_size"), "n_heads": ("ssd_n_heads", "n_heads", "num_attention_heads")}
        return build_config(cls, source, overrides, prefix="ssd", aliases=aliases, required=("d_model", "n_heads"))


@dataclass
class SSDState:
    """One SSD layer's decode state: the conv window [B,K-1,xbc_dim] (None without a conv) and the fp32 SSM
    state h [B,H,P,N]."""

    conv: torch.Tensor | None
    h: torch.Tensor


class SSD(nn.Module):
    """[B,T,d_model] -> [B,T,d_model] Mamba-2-style state-space mixer with document resets."""

    _fp32_params = ("A_log", "dt_bias", "D")

    def __init__(self, config: SSDConfig) -> None:
        super().__init__()
        if not isinstance(config, SSDConfig):
            raise TypeError(f"SSD needs an SSDConfig, got {type(config).__name__}")
        self.config = c = config
        H, P, G, N = c.n_heads, c.head_dim, c.n_groups, c.state_dim
        self.xbc_dim = H * P + 2 * G * N
        self.in_proj = nn.Linear(c.d_model, H * P + self.xbc_dim + H, bias=False)
        self.conv = DocCausalDepthwiseConv(self.xbc_dim, c.conv_kernel, c.conv_impl) if c.conv_kernel else None
        self.A_log, self.dt_bias = init_decay_params(H, c)
        self.D = nn.Parameter(torch.ones(H))
        self.norm = nn.RMSNorm(H * P, eps=c.eps)
        self.out_proj = nn.Linear(H * P, c.d_model, bias=False)

    def forward(self, x: torch.Tensor, *, ctx: PackedContext | None = None, kernel: str | None = None) -> torch.Tensor:
        """x [B,T,d_model]; ctx, the batch's PackedContext (validated once, its cu_seqlens used as given), or
        None for one document per row."""
        c = self.config
        if x.dim() != 3 or x.shape[-1] != c.d_model:
            raise ValueError(f"SSD input must be [B,T,{c.d_model}], got {tuple(x.shape)}")
        context_positions(ctx, tuple(x.shape))  # a context of another batch shape fails here, by name
        z, xs, Bm, Cm, dt = self._inputs(x, lambda xbc: self.conv(xbc, ctx, silu=True))
        A = -torch.exp(self.A_log.float())
        y = ssd_scan(xs, dt, A, Bm, Cm, ctx=ctx, chunk=c.chunk, kernel=kernel or c.kernel)
        return self._output(y, xs, z)

    def _inputs(self, x: torch.Tensor, conv: Callable[[torch.Tensor], torch.Tensor]) -> tuple[torch.Tensor, ...]:
        """in_proj -> conv + SiLU (the forward's, fused, or the decode step's; SiLU alone without a conv) -> z, xs
        [B,T,H,P], B, C [B,T,G,N],
        dt [B,T,H] fp32 (the decay exp(dt * A) is near 1: bf16 would round it)."""
        c = self.config
        B, T, _ = x.shape
        H, P, G, N = c.n_heads, c.head_dim, c.n_groups, c.state_dim
        z, xbc, dt = self.in_proj(x).split([H * P, self.xbc_dim, H], dim=-1)
        xbc = conv(xbc) if self.conv is not None else F.silu(xbc)
        xs, Bm, Cm = xbc.split([H * P, G * N, G * N], dim=-1)
        dt = F.softplus(dt.float() + self.dt_bias.float())
        return z, xs.reshape(B, T, H, P), Bm.reshape(B, T, G, N), Cm.reshape(B, T, G, N), dt

    def _output(self, y: torch.Tensor, xs: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """+ x * D -> * SiLU(z) -> RMSNorm -> out_proj."""
        y = y + xs * self.D.to(xs.dtype)[:, None]
        y = y.reshape(*y.shape[:2], -1) * F.silu(z)
        return self.out_proj(self.norm(y))

    # -- decode: the recurrent form, ssd_scan_reference's step

    def init_state(self, batch: int, device: torch.device | str | None = None,
                   dtype: torch.dtype | None = None) -> SSDState:  # fmt: skip
        """The state at a document start: an empty conv window (dtype: the activations') and h = 0 (fp32)."""
        c = self.config
        conv = self.conv.init_window(batch, device, dtype) if self.conv is not None else None
        return SSDState(conv, torch.zeros(batch, c.n_heads, c.head_dim, c.state_dim, device=device))

    def step(self, x: torch.Tensor, state: SSDState) -> torch.Tensor:
        """One token x [B,1,d_model] -> [B,1,d_model]; advances `state` in place. The forward's math at that
        token: h = exp(dt A) h + dt x (outer) B, y = h C."""
        H = self.config.n_heads
        conv_step = conv_stepper(self.conv, state)
        z, xs, Bm, Cm, dt = self._inputs(x, lambda xbc: F.silu(conv_step(xbc)))
        # per head: head h reads group h // (H / G), as the scan does
        Bh, Ch = (m[:, 0].repeat_interleave(H // m.shape[2], dim=1).float() for m in (Bm, Cm))  # [B,H,N]
        dt, A = dt[:, 0], -torch.exp(self.A_log.float())
        a = torch.exp(dt * A)[..., None, None]  # [B,H,1,1]
        state.h = a * state.h + (dt[..., None] * xs[:, 0].float())[..., None] * Bh[:, :, None, :]
        y = (state.h @ Ch[..., None]).squeeze(-1)  # [B,H,P]
        return self._output(y[:, None].to(xs.dtype), xs, z)
