"""The whole-model leak check: a language model's logits on packed rows, through the leak harness.

A model's zero-initialised outputs (Engram, the n-gram memory, the concept bank, mHC's mixing weights) make
those branches the identity at step 0, so a check at init could not see a leak inside them:
`wake_zero_initialised` moves every all-zero parameter off zero first. `model_leak_report` then runs `check_leaks` on the
logits of `model(tokens, build_context(doc_ids), return_logits=True)`, the context rebuilt per call as the
model gets it in training. Works for any model with that forward (HybridLM); imports nothing from nn/.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from megacpp_lab.testing.leaks import LeakReport, check_leaks
from megacpp_lab.varlen import build_context

__all__ = ["model_leak_report", "wake_zero_initialised"]


def wake_zero_initialised(model: nn.Module, *, std: float = 0.05, seed: int = 1) -> nn.Module:
    """Redraw every floating parameter that is all zero (the branches' zero-initialised output projections,
    mHC's coefficient weights, any zero bias) from N(0, std^2), seeded, so that every branch changes the
    logits and a leak inside it could show. Chosen by value, not by name: a zero-initialised parameter under
    a new name is woken too. Call it on a model at initialisation."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.is_floating_point() and p.numel() and not p.any():
                p.copy_(torch.randn(p.shape, generator=gen) * std)
    return model


def model_leak_report(model: nn.Module, tokens: torch.Tensor, doc_ids: torch.Tensor, *, vocab_size: int,
                      causal_positions: Sequence[int] | None = None, **kw: Any) -> LeakReport:  # fmt: skip
    """check_leaks on the model's logits [B,T,V]: no logit of one document moves when another document's
    tokens change, and none moves when a later token changes. kw goes to check_leaks (causal=False, ...)."""

    def logits(t: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return model(t, build_context(d), return_logits=True).logits

    return check_leaks(logits, tokens, doc_ids, vocab_size=vocab_size, causal_positions=causal_positions, **kw)
