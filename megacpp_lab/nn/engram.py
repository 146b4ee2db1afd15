"""Engram: the local causal n-gram branch that runs beside a block and adds to the residual.

(B,T,C) hidden states -> (B,T,C) features:

    u      = in_proj(RMSNorm(h))                          bottleneck, C -> d
    a_n    = causal local average of u over n tokens       n in orders (2, 3, 4)
    m      = sum_n mix_n * a_n                             per-order, per-channel mixing
    gated:  k = key_proj(m);  alpha = sigmoid(RMSNorm(h) . RMSNorm(k) / sqrt(C));  m = alpha * m
    conv:   m = m + SiLU(depthwise causal conv_K(m))
    out    = out_proj(m)                                   zero-initialised: identity at step 0

Minimal mode is gated=False, conv_kernel=0; gated mode is gated=True, conv_kernel=4.
The batch's PackedContext is threaded through every shift, pool and conv (its positions mask each look-back):
a window that would cross a document boundary sees zeros, exactly as if each document were left-padded on its
own.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from megacpp_lab.checks import config_error, is_int
from megacpp_lab.nn.config_builder import build_config
from megacpp_lab.nn.primitives import (CONV_IMPLS, DocCausalDepthwiseConv, ParameterFreeRMSNorm, context_gate,
                                       conv_stepper)
from megacpp_lab.varlen import PackedContext, context_positions, doc_causal_shift

__all__ = ["MAX_CONV_KERNEL", "MAX_ORDER", "EngramBranch", "EngramConfig", "EngramState", "causal_local_averages"]

MAX_ORDER = 16
MAX_CONV_KERNEL = 16

_fail = functools.partial(config_error, "EngramConfig")


@dataclass(frozen=True)
class EngramConfig:
    """One Engram branch's settings; build it with EngramConfig.build. Frozen, checked on construction.

    Which layers carry a branch (and mHC over them) is model-level: megacpp_lab.model.config.HybridConfig
    (engram_layers, mhc).
    """

    d_model: int
    bottleneck: int = 256
    orders: tuple[int, ...] = (2, 3, 4)
    gated: bool = True
    conv_kernel: int = 4
    conv_impl: str = "xla_safe"  # nn/primitives.DocCausalDepthwiseConv says why
    dropout: float = 0.0
    eps: float = 1e-6

    def __post_init__(self) -> None:
        if not isinstance(self.gated, bool):
            raise _fail("gated", "a bool", self.gated)
        for name in ("d_model", "bottleneck", "conv_kernel"):
            if isinstance(getattr(self, name), bool):
                raise _fail(name, "an int, not a bool", getattr(self, name))
        if not isinstance(self.d_model, int) or self.d_model < 1:
            raise _fail("d_model", "an int >= 1", self.d_model)
        orders = self.orders
        if isinstance(orders, str):  # '2,3,4' from a command line
            try:
                orders = tuple(int(p) for p in orders.split(",") if p.strip())
            except ValueError:
                raise _fail("orders", "a comma-separated list of ints", self.orders) from None
        if not isinstance(orders, Sequence):
            raise _fail("orders", f"a non-empty tuple of n-gram orders in 2..{MAX_ORDER}", self.orders)
        object.__setattr__(self, "orders", tuple(orders))
        if not self.orders or any(
            not is_int(n) or not 2 <= n <= MAX_ORDER for n in self.orders
        ):
            raise _fail("orders", f"a non-empty tuple of n-gram orders in 2..{MAX_ORDER}", self.orders)
        if len(set(self.orders)) != len(self.orders):
            raise _fail("orders", "unique n-gram orders", self.orders)
        if not isinstance(self.bottleneck, int) or not 1 <= self.bottleneck <= self.d_model:
            raise _fail("bottleneck", f"an int in 1..d_model={self.d_model}", self.bottleneck)
        if isinstance(self.dropout, bool) or not isinstance(self.dropout, (int, float)) or not 0.0 <= self.dropout < 1.0:
            raise _fail("dropout", "a float in [0, 1)", self.dropout)
        if not isinstance(self.conv_kernel, int) or not 0 <= self.conv_kernel <= MAX_CONV_KERNEL:
            raise _fail("conv_kernel", f"0 (no conv) or a kernel size in 1..{MAX_CONV_KERNEL}", self.conv_kernel)
        if self.conv_impl not in CONV_IMPLS:
            raise _fail("conv_impl", f"one of {CONV_IMPLS}", self.conv_impl)
        if not isinstance(self.eps, float) or not 0.0 < self.eps < 1.0:
            raise _fail("eps", "a float in (0, 1)", self.eps)

    @classmethod
    def build(cls, source: Any = None, **overrides: Any) -> EngramConfig:
        """The one builder: fields from a model config object (d_model or Megatron's hidden_size; every other
        field only as engram_<name>: a model's own eps or conv_kernel is not this branch's) and keyword
        overrides, else the defaults."""
        aliases = {name: (f"engram_{name}",) for name in cls.__dataclass_fields__}
        aliases["d_model"] = ("d_model", "hidden_size")
        return build_config(cls, source, overrides, prefix="engram", aliases=aliases, required=("d_model",))


def causal_local_averages(u: torch.Tensor, positions: torch.Tensor | None, orders: Sequence[int]) -> torch.Tensor:
    """[B,T,D] -> [B,T,len(orders),D]: mean of the last n tokens for each order n.

    The same numbers as F.avg_pool1d(kernel=n, stride=1) over each document left-padded
    with n-1 zeros (count_include_pad): tokens of an earlier document count as zeros. positions: each
    token's offset in its document (a PackedContext's), or None for one document per row.
    Shifts are shared across orders, so orders (2, 3, 4) cost 3 shifts, not 9.
    """
    max_order = max(orders)
    running = u
    sums = {1: u}
    for lag in range(1, max_order):
        running = running + doc_causal_shift(u, positions, lag)
        sums[lag + 1] = running
    return torch.stack([sums[n] / n for n in orders], dim=2)


@dataclass
class EngramState:
    """One Engram branch's decode state: the last max(orders)-1 bottleneck values u [B,max(orders)-1,d] and
    the conv window over m [B,K-1,d] (None without a conv)."""

    u: torch.Tensor
    conv: torch.Tensor | None


class EngramBranch(nn.Module):
    """(B,T,C) -> (B,T,C) local n-gram features, added to the residual by the caller."""

    def __init__(self, config: EngramConfig) -> None:
        super().__init__()
        if not isinstance(config, EngramConfig):
            raise TypeError(f"EngramBranch needs an EngramConfig, got {type(config).__name__}")
        self.config = config
        C, d = config.d_model, config.bottleneck
        self.norm = ParameterFreeRMSNorm(config.eps)
        self.in_proj = nn.Linear(C, d, bias=False)
        self.order_mix = nn.Parameter(torch.full((len(config.orders), d), 1.0 / len(config.orders)))
        self.key_proj = nn.Linear(d, C, bias=False) if config.gated else None
        self.conv = DocCausalDepthwiseConv(d, config.conv_kernel, config.conv_impl) if config.conv_kernel else None
        # no Dropout module at p=0: its forward reads self.training, which a compiled block guards on, so
        # model.eval() compiled the block again for a dropout that does nothing
        self.dropout = nn.Dropout(config.dropout) if config.dropout > 0 else nn.Identity()
        self.out_proj = nn.Linear(d, C, bias=False)
        nn.init.zeros_(self.out_proj.weight)  # identity on the residual at step 0

    def forward(self, h: torch.Tensor, *, ctx: PackedContext | None = None) -> torch.Tensor:
        """h: [B,T,C] pre-norm residual; ctx, the batch's PackedContext (None: one document per row)."""
        if h.dim() != 3 or h.shape[-1] != self.config.d_model:
            raise ValueError(f"EngramBranch input must be [B,T,{self.config.d_model}], got {tuple(h.shape)}")
        positions = context_positions(ctx, tuple(h.shape))
        h_norm = self.norm(h)
        u = self.in_proj(h_norm)
        m = (causal_local_averages(u, positions, self.config.orders) * self.order_mix).sum(dim=2)
        return self._output(h_norm, m, lambda m_: self.conv(m_, ctx))

    def _output(self, h_norm: torch.Tensor, m: torch.Tensor,
                conv: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:  # fmt: skip
        """The context gate, the conv (the forward's or the decode step's) and out_proj over the averages m."""
        if self.key_proj is not None:
            m = context_gate(h_norm, self.norm(self.key_proj(m))) * m
        if self.conv is not None:
            m = m + F.silu(conv(m))
        return self.out_proj(self.dropout(m))

    # -- decode: the recurrent form

    def init_state(self, batch: int, device: torch.device | str | None = None,
                   dtype: torch.dtype | None = None) -> EngramState:  # fmt: skip
        """The state at a document start: zero windows, exactly the forward's zero fill."""
        u = torch.zeros(batch, max(self.config.orders) - 1, self.config.bottleneck, device=device, dtype=dtype)
        return EngramState(u, self.conv.init_window(batch, device, dtype) if self.conv is not None else None)

    def step(self, h: torch.Tensor, state: EngramState) -> torch.Tensor:
        """One token h [B,1,C] -> [B,1,C]; advances `state` in place. The averages come from the last
        max(orders) bottleneck values only, the conv from its own window: no prefix is recomputed."""
        h_norm = self.norm(h)
        window = torch.cat([state.u, self.in_proj(h_norm)], dim=1)  # [B, max(orders), d], oldest first
        state.u = window[:, 1:]
        # the forward's averages over a window that holds all they read: its last position is this token's
        m = (causal_local_averages(window, None, self.config.orders)[:, -1:] * self.order_mix).sum(dim=2)
        return self._output(h_norm, m, conv_stepper(self.conv, state))
