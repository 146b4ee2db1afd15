"""The LM head: final hidden states -> the loss through the lab's fused linear cross-entropy.

With `fused_loss` on (the default) no [B,T,V] logits tensor exists: the loss streams the vocabulary in
[C,V] chunks (`kernels/linear_cross_entropy.py`). Logits are returned only when asked for
(`return_logits=True`, e.g. for sampling or the leak test); `fused_loss=False` computes the same loss
from materialised logits (the reference head, `linear_cross_entropy_reference`). tests/test_lm_head.py watches every tensor the head creates, so a head that falls back
to full logits fails a test rather than quietly costing T*V memory.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from megacpp_lab.checks import check_ints, config_error, is_int
from megacpp_lab.kernels.linear_cross_entropy import IMPLS, fused_linear_cross_entropy, linear_cross_entropy_reference
from megacpp_lab.nn.config_builder import build_config

__all__ = ["LMHead", "LMHeadConfig", "LMHeadOutput"]

_fail = functools.partial(config_error, "LMHeadConfig")


@dataclass(frozen=True)
class LMHeadConfig:
    """LM head settings; build it with LMHeadConfig.build. Frozen, checked on construction."""

    d_model: int
    vocab_size: int
    fused_loss: bool = True
    z_loss: float = 0.0
    ignore_index: int = -100
    loss_impl: str = "auto"  # the fused loss's impl: "auto" (Triton on CUDA), "triton" or "eager"
    loss_chunk_size: int | None = None  # rows per [C, V] chunk; None: the fused loss's default

    def __post_init__(self) -> None:
        check_ints("LMHeadConfig", self, ("d_model", "vocab_size"))
        if not isinstance(self.fused_loss, bool):
            raise _fail("fused_loss", "a bool", self.fused_loss)
        if isinstance(self.z_loss, bool) or not isinstance(self.z_loss, (int, float)) or not self.z_loss >= 0:
            raise _fail("z_loss", "a float >= 0", self.z_loss)
        if not is_int(self.ignore_index):
            raise _fail("ignore_index", "an int", self.ignore_index)
        if self.loss_impl not in IMPLS:
            raise _fail("loss_impl", f"one of {IMPLS}", self.loss_impl)
        chunk = self.loss_chunk_size
        if chunk is not None and (not is_int(chunk) or chunk < 1):
            raise _fail("loss_chunk_size", "None or an int >= 1", chunk)

    @classmethod
    def build(cls, source: Any = None, **overrides: Any) -> LMHeadConfig:
        """The one builder: d_model (or hidden_size) and vocab_size from a model config object, every other
        field only as lm_head_<name>, then keyword overrides, else the defaults."""
        aliases = {name: (f"lm_head_{name}",) for name in cls.__dataclass_fields__}
        aliases.update(d_model=("d_model", "hidden_size"), vocab_size=("vocab_size",))
        return build_config(cls, source, overrides, prefix="lm_head", aliases=aliases,
                            required=("d_model", "vocab_size"))  # fmt: skip


class LMHeadOutput(NamedTuple):
    loss: torch.Tensor | None  # scalar: the mean over non-ignored targets (+ z_loss * lse^2), or None
    logits: torch.Tensor | None  # [B,T,V] only when asked for, else None


class LMHead(nn.Module):
    """weight [V, d]; forward(h [B,T,d], targets [B,T] or None, *, return_logits=False) -> LMHeadOutput."""

    def __init__(self, config: LMHeadConfig) -> None:
        super().__init__()
        if not isinstance(config, LMHeadConfig):
            raise TypeError(f"LMHead needs an LMHeadConfig, got {type(config).__name__}")
        self.config = config
        self.weight = nn.Parameter(torch.empty(config.vocab_size, config.d_model))
        nn.init.normal_(self.weight, std=config.d_model**-0.5)

    def forward(self, h: torch.Tensor, targets: torch.Tensor | None = None, *,
                return_logits: bool = False) -> LMHeadOutput:  # fmt: skip
        c = self.config
        if h.dim() != 3 or h.shape[-1] != c.d_model:
            raise ValueError(f"h must be [B,T,{c.d_model}], got {tuple(h.shape)}")
        if targets is not None and tuple(targets.shape) != tuple(h.shape[:2]):
            raise ValueError(f"targets must be [B,T] = {tuple(h.shape[:2])}, got {tuple(targets.shape)}")
        if targets is None and not return_logits:
            raise ValueError("LMHead needs targets (for the loss) or return_logits=True (for the logits)")
        logits = F.linear(h, self.weight) if return_logits else None
        if targets is None:
            return LMHeadOutput(None, logits)
        if c.fused_loss:
            loss = fused_linear_cross_entropy(h, self.weight, targets, ignore_index=c.ignore_index, z_loss=c.z_loss,
                                              chunk_size=c.loss_chunk_size, impl=c.loss_impl)  # fmt: skip
        else:  # the reference head: the same loss from full [B*T, V] fp32 logits
            loss = linear_cross_entropy_reference(h.flatten(0, 1), self.weight, targets.flatten().long(),
                                                  ignore_index=c.ignore_index, z_loss=c.z_loss)  # fmt: skip
        return LMHeadOutput(loss, logits)

    def extra_repr(self) -> str:
        c = self.config
        return f"d_model={c.d_model}, vocab_size={c.vocab_size}, fused_loss={c.fused_loss}"
