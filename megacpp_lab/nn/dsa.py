"""DeepSeek Sparse Attention (DSA, DeepSeek-V3.2) for the A layers that HybridConfig.dsa_layers names: a lightning
indexer scores every (query, key) pair cheaply, each query keeps its top_k keys inside its own document (keys at
or before it), and MLA attends over those keys only.

    indexer   q_I = W_q RMSNorm(c_q)            [B,T,H_I,d_I]   c_q: the MLA query latent (detached)
              k_I = LayerNorm(W_k x)            [B,T,d_I]       x: the layer's input (detached)
              w   = W_w x / sqrt(H_I)           [B,T,H_I]
              I[t, s] = sum_h w[t,h] relu(q_I[t,h] . k_I[s])     (kernels/dsa_indexer.py, no [T,H,T] slab)
    selection each query's top_k keys by I among the keys s <= t of t's document (ties to the lower index); fewer
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

Two paths (DSAConfig.attn_impl; "auto" takes the fast one on CUDA, the reference elsewhere):
    "flex"       the selection as one (threshold, cut) pair per query (kernels/dsa_sparse.py's Triton radix select,
                 reading only each query's document), the attention through flex over the batch's document block
                 mask (the context's, built outside any compiled region; HybridLM builds it when its layers need
                 one) with the selection as a score_mod (selection_score_mod), and the KL recomputing the attention's probabilities from flex's log-sum-exp a tile at a time
                 (kernels/dsa_sparse.py's sparse_kl): no [B,T,T] mask, no [B,H,T,T] slab. The indexer's scores are
                 still a [B,T,T] fp32 tensor (kernels/dsa_indexer.py), and so is their gradient.
    "reference"  the selection by a stable sort (selection_mask), MLA's scores materialised per batch ([B,H,T,T]
                 fp32) and masked (dsa_attention), the KL on those probabilities (indexer_kl). Exact and slow: what
                 the tests hold the flex path to, and the CPU path (flex has no CPU backward).
Ties in the indexer's scores go to the lower key index in both. Decode (MultiLatentAttention.decode) keeps each
DSA layer's indexer keys in the KV cache (MLAKVCache's index_dims) and selects every new query's top_k over them.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from megacpp_lab.checks import check_ints, config_error, is_int
from megacpp_lab.kernels.dsa_indexer import indexer_scores, indexer_scores_reference
from megacpp_lab.kernels.dsa_sparse import select_thresholds_reference, selection_from_thresholds
from megacpp_lab.nn.config_builder import build_config
from megacpp_lab.varlen import positions_from_doc_ids

__all__ = ["DSA_ATTN_IMPLS", "DSA_PHASES", "DSAConfig", "DSAIndexer", "document_starts", "dsa_attention", "indexer_kl",
           "selection_mask", "selection_score_mod", "set_dsa_phase"]  # fmt: skip

DSA_PHASES = ("warmup", "sparse")
SCORE_IMPLS = ("auto", "triton", "reference")
DSA_ATTN_IMPLS = ("auto", "flex", "reference")

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
    attn_impl: str = "auto"  # selection, attention and KL: "auto" (flex on CUDA, else reference), "flex", "reference"

    def __post_init__(self) -> None:
        check_ints("DSAConfig", self, ("d_model", "n_heads", "head_dim", "top_k"))
        if not is_int(self.warmup_steps) or self.warmup_steps < 0:
            raise _fail("warmup_steps", "an int >= 0", self.warmup_steps)
        w = self.loss_weight
        if isinstance(w, bool) or not isinstance(w, (int, float)) or not (math.isfinite(w) and w >= 0):
            raise _fail("loss_weight", "a finite number >= 0", w)
        if self.score_impl not in SCORE_IMPLS:
            raise _fail("score_impl", f"one of {SCORE_IMPLS}", self.score_impl)
        if self.attn_impl not in DSA_ATTN_IMPLS:
            raise _fail("attn_impl", f"one of {DSA_ATTN_IMPLS}", self.attn_impl)
        d = self.head_dim
        if self.score_impl != "reference" and (d < 16 or d & (d - 1)):  # the Triton scores' tl.dot tiles
            raise _fail("head_dim", "a power of two >= 16 (the Triton indexer scores; or score_impl='reference')", d)

    @classmethod
    def build(cls, source: Any = None, **overrides: Any) -> DSAConfig:
        aliases = {name: (f"dsa_{name}",) for name in cls.__dataclass_fields__}
        aliases.update(d_model=("d_model", "hidden_size"))
        return build_config(cls, source, overrides, prefix="dsa", aliases=aliases, required=("d_model",))


class DSAIndexer(nn.Module):
    """The lightning indexer (module docstring): forward(x [B,T,d], q_lat [B,T,q_lora_rank], starts) -> I [B,T,T] fp32.
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

    def forward(self, x: torch.Tensor, q_lat: torch.Tensor, starts: torch.Tensor | None = None) -> torch.Tensor:
        """starts [B,T] (each token's document start, document_starts): the Triton scores compute only the keys a
        query may select and are zero at the others (kernels/dsa_indexer.py); the reference computes every pair."""
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
        return indexer_scores(q, k, w, starts=starts) if impl == "triton" else indexer_scores_reference(q, k, w)


def document_starts(doc_ids: torch.Tensor | None, positions: torch.Tensor | None, batch: int, seq_len: int,
                    device: torch.device) -> torch.Tensor:  # fmt: skip
    """[B,T] int32: the index of each token's document start in its row (t - position_t): from a context's
    positions, else from doc_ids, else 0 (one document per row)."""
    if positions is None and doc_ids is not None:
        positions = positions_from_doc_ids(doc_ids)
    t = torch.arange(seq_len, device=device, dtype=torch.int32)
    if positions is None:
        return torch.zeros(batch, seq_len, dtype=torch.int32, device=device)
    return (t - positions.to(torch.int32)).contiguous()


def selection_mask(scores: torch.Tensor, top_k: int, doc_ids: torch.Tensor) -> torch.Tensor:
    """[B,T,T] bool: each query's top_k keys by `scores` [B,T,T] among its allowed keys (at or before it, in its
    document), ties to the lower index; a query with fewer allowed keys keeps them all. The reference (a sort)."""
    B, T = scores.shape[:2]
    starts = document_starts(doc_ids, None, B, T, scores.device)
    return selection_from_thresholds(scores, starts, *select_thresholds_reference(scores, starts, top_k))


def selection_score_mod(scores: torch.Tensor, thr: torch.Tensor, cut: torch.Tensor) -> Callable[..., torch.Tensor]:
    """The flex score_mod of a DSA layer: a key the selection (thr, cut) of kernels/dsa_sparse.py drops scores -inf
    (key s of query t kept iff scores[t,s] > thr[t], or scores[t,s] == thr[t] and s <= cut[t]). The documents and
    causality are the block mask's (the batch's doc_causal_block_mask, built outside any compiled region): a
    score_mod applies on every block it computes, full blocks too. scores are read detached."""
    scores = scores.detach()

    def keep_selected(score, b, h, q_idx, kv_idx):
        picked, th = scores[b, q_idx, kv_idx], thr[b, q_idx]
        chosen = (picked > th) | ((picked == th) & (kv_idx <= cut[b, q_idx]))
        return torch.where(chosen, score, float("-inf"))

    return keep_selected


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
