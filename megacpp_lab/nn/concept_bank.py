"""The concept bank (CBlock): an optional, read-only cross-attention from every token to a learned bank.

    x [B,T,d_model] -> parameter-free RMSNorm -> q_proj -> q [B,T,H,Dh]
    bank = nn.Embedding(n_concepts, concept_dim).weight -> k_proj, v_proj -> k, v [n_concepts,H,Dh]
    softmax(q k^T / sqrt(Dh)) v, in fp32 -> out_proj (zero-initialised) -> [B,T,d_model]

Each token attends to the bank only, never to another token: there is no causal mask and no RoPE
(the bank is a set of global prototypes, not a sequence), and no information crosses tokens, so the
layer is document-safe by construction. It takes doc_ids / ctx= like every other mixer, for one
block interface, checks only that they fit the input's [B,T], and otherwise ignores them.

Identity at step 0: out_proj is zero-initialised, so x + ConceptBank(x) == x exactly; the gradient
still reaches out_proj, and through it everything else once it moves off zero.

Read-only: the forward never writes the bank (no in-place update, no buffer; the layer has no
buffers at all). The bank changes only through the optimizer. Its weight is an fp32-contract tensor
(`_fp32_params` of the bank module): each concept's update is a softmax-weighted average over the
batch and small next to its value, which bf16 storage would round away.

The model decides whether and where to use it (off by default in the memory-stack recipe).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from megacpp_lab.checks import check_ints, config_error
from megacpp_lab.nn.config_builder import build_config
from megacpp_lab.nn.primitives import ParameterFreeRMSNorm
from megacpp_lab.varlen import PackedContext, context_positions

__all__ = ["ConceptBank", "ConceptBankConfig", "concept_attention"]

_fail = functools.partial(config_error, "ConceptBankConfig")


@dataclass(frozen=True)
class ConceptBankConfig:
    """Concept-bank settings; build it with ConceptBankConfig.build. Frozen, checked on construction.
    concept_dim None means d_model."""

    d_model: int
    n_concepts: int = 1024
    concept_dim: int | None = None
    n_heads: int = 8
    head_dim: int = 64
    eps: float = 1e-6  # the queries' pre-norm

    def __post_init__(self) -> None:
        if self.concept_dim is None:
            object.__setattr__(self, "concept_dim", self.d_model)
        check_ints("ConceptBankConfig", self, ("d_model", "n_concepts", "concept_dim", "n_heads", "head_dim"))
        if isinstance(self.eps, bool) or not isinstance(self.eps, (int, float)) or not 0 < self.eps < 1:
            raise _fail("eps", "a float in (0, 1)", self.eps)

    @classmethod
    def build(cls, source: Any = None, **overrides: Any) -> ConceptBankConfig:
        """The one builder: fields from a model config object (d_model or hidden_size; every other field only
        as concept_<name>, or concept_dim: the model's own attention n_heads is not the bank's) and keyword
        overrides, else the defaults."""
        aliases = {name: (f"concept_{name}",) for name in cls.__dataclass_fields__}
        aliases.update(d_model=("d_model", "hidden_size"), concept_dim=("concept_dim",))
        return build_config(cls, source, overrides, prefix="concept", aliases=aliases, required=("d_model",))


def concept_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Unmasked softmax attention of queries q [B,T,H,Dh] over one shared bank k, v [N,H,Dh], in fp32
    whatever the inputs' dtype: scores, softmax and the weighted sum. Returns [B,T,H,Dh] fp32.

    Tokens are independent, so B*T is folded into one query axis and the bank is not copied per row."""
    B, T, H, D = q.shape
    qf = q.float().reshape(B * T, H, D).transpose(0, 1)[None]  # [1,H,B*T,D]
    kf = k.float().transpose(0, 1)[None]  # [1,H,N,D]
    vf = v.float().transpose(0, 1)[None]
    o = F.scaled_dot_product_attention(qf, kf, vf, is_causal=False, scale=1.0 / math.sqrt(D))
    return o[0].transpose(0, 1).reshape(B, T, H, D)


class _ConceptEmbedding(nn.Embedding):
    """The bank: an nn.Embedding whose weight is kept fp32 under mixed precision."""

    _fp32_params = ("weight",)


class ConceptBank(nn.Module):
    """[B,T,d_model] -> [B,T,d_model] read-only cross-attention to a learned concept bank (CBlock)."""

    def __init__(self, config: ConceptBankConfig) -> None:
        super().__init__()
        if not isinstance(config, ConceptBankConfig):
            raise TypeError(f"ConceptBank needs a ConceptBankConfig, got {type(config).__name__}")
        self.config = c = config
        inner = c.n_heads * c.head_dim
        self.norm = ParameterFreeRMSNorm(c.eps)
        self.bank = _ConceptEmbedding(c.n_concepts, c.concept_dim)
        self.q_proj = nn.Linear(c.d_model, inner, bias=False)
        self.k_proj = nn.Linear(c.concept_dim, inner, bias=False)
        self.v_proj = nn.Linear(c.concept_dim, inner, bias=False)
        self.out_proj = nn.Linear(inner, c.d_model, bias=False)
        nn.init.zeros_(self.out_proj.weight)  # identity at step 0 inside a residual

    def _qkv(self, x: torch.Tensor, ctx: PackedContext | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        c = self.config
        if x.dim() != 3 or x.shape[-1] != c.d_model:
            raise ValueError(f"ConceptBank input must be [B,T,{c.d_model}], got {tuple(x.shape)}")
        # ctx is accepted for the uniform block interface and ignored (no token sees another): its shape only
        context_positions(ctx, tuple(x.shape))
        B, T = x.shape[:2]
        H, D = c.n_heads, c.head_dim
        bank = self.bank.weight.to(self.k_proj.weight.dtype)  # a read: out of place, the parameter untouched
        q = self.q_proj(self.norm(x)).reshape(B, T, H, D)
        return q, self.k_proj(bank).reshape(-1, H, D), self.v_proj(bank).reshape(-1, H, D)

    def forward(self, x: torch.Tensor, *, ctx: PackedContext | None = None) -> torch.Tensor:
        """x [B,T,d_model]; ctx (the batch's PackedContext) is accepted and ignored."""
        q, k, v = self._qkv(x, ctx)
        o = concept_attention(q, k, v).to(x.dtype)
        return self.out_proj(o.flatten(2))

    def attention_weights(self, x: torch.Tensor, *, ctx: PackedContext | None = None) -> torch.Tensor:
        """The fp32 softmax weights [B,T,H,n_concepts] the forward applies (for diagnostics: concept use)."""
        q, k, _ = self._qkv(x, ctx)
        scores = torch.einsum("bthd,nhd->bthn", q.float(), k.float()) / math.sqrt(self.config.head_dim)
        return scores.softmax(-1)

    def extra_repr(self) -> str:
        c = self.config
        return f"n_concepts={c.n_concepts}, concept_dim={c.concept_dim}, n_heads={c.n_heads}, head_dim={c.head_dim}"
