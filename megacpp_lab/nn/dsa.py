"""DeepSeek Sparse Attention (DSA, DeepSeek-V3.2) for the A layers that HybridConfig.dsa_layers names: a lightning
indexer scores every (query, key) pair cheaply, each query keeps its top_k keys inside its own document (keys at
or before it), and MLA attends over those keys only.

    indexer   q_I = W_q RMSNorm(c_q)            [B,T,H_I,d_I]   c_q: the MLA query latent (detached)
              k_I = LayerNorm(W_k x)            [B,T,d_I]       x: the layer's input (detached)
              w   = W_w x / sqrt(H_I)           [B,T,H_I]
              I[t, s] = sum_h w[t,h] relu(q_I[t,h] . k_I[s])     (kernels/dsa_indexer.py, no [T,H,T] slab)
    selection each query's top_k keys by I among the keys s <= t of t's document (topk_keys); a query with fewer
              allowed keys keeps all of them (the padding picks are marked and never attended)
    attention MLA's scores and values, masked to the selected keys

Training, in two phases (`DSAIndexer.phase`, set for the whole model by `set_dsa_phase`; the training loop runs
"warmup" for DSAConfig.warmup_steps steps, then "sparse"):
    "warmup"  the attention stays dense; the indexer learns to rank keys as the attention does: its loss is
              KL(p || softmax(I)) over each query's allowed keys, p the attention's probabilities summed over
              heads and normalised (a target: no gradient);
    "sparse"  the attention reads the selected keys only; the indexer's loss is the same KL over the selected keys.
The indexer's inputs are detached in both: its only gradient is its own loss, weighted by DSAConfig.loss_weight and
carried into the backward on the layer's output (attach_loss), as V3.2 trains it apart from the language model.

The attention here is the reference: MLA's scores materialised per batch ([B,H,T,T] fp32) and masked. It is exact
(tests/test_dsa.py holds it to dense MLA when top_k covers every allowed key) and it is what the leak harness
checks; a sparse kernel that gathers only the selected keys is not built yet, and at long T this path costs more
than dense attention, not less. Decode through a DSA layer is refused (no indexer-key cache yet).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from megacpp_lab.checks import check_ints, config_error, is_int
from megacpp_lab.kernels.dsa_indexer import allowed_keys, indexer_scores, indexer_scores_reference, topk_keys
from megacpp_lab.nn.config_builder import build_config

__all__ = ["DSA_PHASES", "DSAConfig", "DSAIndexer", "dsa_attention", "indexer_kl", "selection_mask", "set_dsa_phase"]

DSA_PHASES = ("warmup", "sparse")
SCORE_IMPLS = ("auto", "triton", "reference")

_fail = functools.partial(config_error, "DSAConfig")


@dataclass(frozen=True)
class DSAConfig:
    """The lightning indexer and the selection of a DSA layer; build it with DSAConfig.build. Frozen, checked."""

    d_model: int
    n_heads: int = 4  # indexer heads H_I
    head_dim: int = 64  # indexer head size d_I
    top_k: int = 2048  # keys each query keeps
    warmup_steps: int = 1000  # training steps of the dense warm-up (the training loop's phase switch)
    loss_weight: float = 1.0  # the indexer's KL loss, as attached to the layer's output
    score_impl: str = "auto"  # the indexer scores: "auto" (Triton on CUDA), "triton", "reference"

    def __post_init__(self) -> None:
        check_ints("DSAConfig", self, ("d_model", "n_heads", "head_dim", "top_k"))
        if not is_int(self.warmup_steps) or self.warmup_steps < 0:
            raise _fail("warmup_steps", "an int >= 0", self.warmup_steps)
        w = self.loss_weight
        if isinstance(w, bool) or not isinstance(w, (int, float)) or not (math.isfinite(w) and w >= 0):
            raise _fail("loss_weight", "a finite number >= 0", w)
        if self.score_impl not in SCORE_IMPLS:
            raise _fail("score_impl", f"one of {SCORE_IMPLS}", self.score_impl)
        d = self.head_dim
        if self.score_impl != "reference" and (d < 16 or d & (d - 1)):  # the Triton scores' tl.dot tiles
            raise _fail("head_dim", "a power of two >= 16 (the Triton indexer scores; or score_impl='reference')", d)

    @classmethod
    def build(cls, source: Any = None, **overrides: Any) -> DSAConfig:
        aliases = {name: (f"dsa_{name}",) for name in cls.__dataclass_fields__}
        aliases.update(d_model=("d_model", "hidden_size"))
        return build_config(cls, source, overrides, prefix="dsa", aliases=aliases, required=("d_model",))


class DSAIndexer(nn.Module):
    """The lightning indexer (module docstring): forward(x [B,T,d], q_lat [B,T,q_lora_rank]) -> I [B,T,T] fp32.
    `phase`: "warmup" or "sparse" (a plain attribute: the training loop sets it through set_dsa_phase)."""

    def __init__(self, config: DSAConfig, q_lora_rank: int) -> None:
        super().__init__()
        if not isinstance(config, DSAConfig):
            raise TypeError(f"DSAIndexer needs a DSAConfig, got {type(config).__name__}")
        self.config = c = config
        self.q_norm = nn.RMSNorm(q_lora_rank)
        self.w_q = nn.Linear(q_lora_rank, c.n_heads * c.head_dim, bias=False)
        self.w_k = nn.Linear(c.d_model, c.head_dim, bias=False)
        self.k_norm = nn.LayerNorm(c.head_dim)
        self.w_w = nn.Linear(c.d_model, c.n_heads, bias=False)
        self.phase = "sparse"  # inference reads the selection; training starts with the warm-up (set_dsa_phase)

    def forward(self, x: torch.Tensor, q_lat: torch.Tensor) -> torch.Tensor:
        c = self.config
        B, T, _ = x.shape
        x, q_lat = x.detach(), q_lat.detach()  # the indexer learns from its own loss alone
        q = self.w_q(self.q_norm(q_lat)).view(B, T, c.n_heads, c.head_dim)
        k = self.k_norm(self.w_k(x))
        w = self.w_w(x) * c.n_heads**-0.5
        # the kernels' layout: q [sq,b,h,d], k [sk,b,d], w [sq,b,h]
        q, k, w = q.transpose(0, 1).contiguous(), k.transpose(0, 1).contiguous(), w.transpose(0, 1).contiguous()
        impl = c.score_impl
        if impl == "auto":
            impl = "triton" if x.is_cuda else "reference"
        return indexer_scores(q, k, w) if impl == "triton" else indexer_scores_reference(q, k, w)


def selection_mask(scores: torch.Tensor, top_k: int, doc_ids: torch.Tensor) -> torch.Tensor:
    """[B,T,T] bool: each query's top_k keys by `scores` [B,T,T] among its allowed keys (at or before it, in its
    document); a query with fewer allowed keys keeps them all (topk_keys' padding picks are dropped)."""
    allowed = allowed_keys(scores, causal=True, doc_ids=doc_ids)
    k = min(top_k, scores.shape[-1])
    picked = torch.zeros(scores.shape, dtype=torch.bool, device=scores.device)
    picked.scatter_(-1, topk_keys(scores, k, causal=True, doc_ids=doc_ids), True)
    return picked & allowed


def indexer_kl(attn_probs: torch.Tensor, scores: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean over queries of KL(p || softmax(I)) on the keys `mask` [B,T,T] keeps: p = attn_probs [B,H,T,T] summed
    over heads and normalised over those keys (a target, detached), I = scores [B,T,T]. Queries with no key
    (none kept) add nothing."""
    p = attn_probs.detach().float().sum(1).masked_fill(~mask, 0.0)
    p = p / p.sum(-1, keepdim=True).clamp_min(1e-30)
    log_q = torch.log_softmax(scores.float().masked_fill(~mask, float("-inf")), dim=-1)
    terms = torch.where(mask & (p > 0), p * (torch.log(p.clamp_min(1e-30)) - log_q), 0.0)
    has = mask.any(-1)
    return terms.sum(-1).sum() / has.sum().clamp_min(1)


def dsa_attention(q: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor, scale: float
                  ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """Attention [B,T,H,d] -> ([B,T,H,d_v], probabilities [B,H,T,T] fp32) over the keys `mask` [B,T,T] keeps
    (every query keeps at least itself). The reference: scores materialised in fp32."""
    q, key, value = (t.transpose(1, 2) for t in (q, key, value))
    s = torch.matmul(q.float(), key.float().transpose(-1, -2)) * scale
    probs = torch.softmax(s.masked_fill(~mask[:, None], float("-inf")), dim=-1)
    return torch.matmul(probs.to(value.dtype), value).transpose(1, 2), probs


def set_dsa_phase(model: nn.Module, phase: str) -> int:
    """Put every DSA indexer of the model in `phase` ("warmup" or "sparse"); returns how many there are. A
    compiled block guards on the phase: the switch compiles its graphs once more, once."""
    if phase not in DSA_PHASES:
        raise ValueError(f"set_dsa_phase: phase must be one of {DSA_PHASES}, got {phase!r}")
    n = 0
    for module in model.modules():
        if isinstance(module, DSAIndexer):
            module.phase = phase
            n += 1
    return n
