"""HybridLM: the whole model in one file, read top to bottom.

    tokens [B,T] -> embedding -> n_layers blocks -> RMSNorm -> LMHead (fused linear cross-entropy)

Block i has the kind HybridConfig.blocks[i] (the pattern tiled across the layers): A = MLA (DeepSeek Sparse
Attention at HybridConfig.dsa_layers, nn/dsa.py), M = Mamba-3
(SISO or MIMO; Mamba-2's SSD with m_block="mamba2"), R = M2RNN, each followed by a SwiGLU MLP; E = the M
block's mixer followed by a mixture of experts (nn/moe.py) in place of the MLP. The seeds' hybrid is
Nemotron-style (Megatron hybrid layers), where the MoE layers follow the Mamba mixers and attention stays
sparse; an SSM mixer also keeps the E block linear in T. A block is a list of residual branches, each x -> x + f(x):

    engram   x + EngramBranch(x, ctx=ctx)                 at engram_layers   (normalises x itself)
    ngram    x + NgramHashMemory(x, tokens, ctx=ctx)      at ngram_layers    (normalises x itself)
    mixer    x + mixer(RMSNorm(x), ctx=ctx)               every layer
    mlp      x + SwiGLU(RMSNorm(x))                       every layer (E: x + MoE(RMSNorm(x)))
    cblock   x + ConceptBank(x, ctx=ctx)                  at cblock_layers   (read-only concept bank)

Engram, the n-gram memory and the concept bank zero-initialise their output projections, so each starts
as the identity on the residual. Every branch that mixes tokens gets the batch's PackedContext as given:
no layer re-derives document boundaries.

mHC (mhc=True): the residual is widened once, expand_streams(x, n) [B,T,n,d], and collapsed once before
the final norm (collapse_streams, the mean). At the mHC layers (engram_layers, see HybridConfig's tripwire)
every branch runs through its own HyperConnection: x <- H_res x + H_post^T f(H_pre x). At the other
layers a branch reads the mean of the streams and adds f to every stream (the fixed connection
H_pre = 1/n, H_post = 1, H_res = I). At init every HyperConnection is x + f(x) on equal streams, so the
model equals the single-stream model to fp32 rounding.

MTP (mtp_depth = K > 0, DeepSeek-V3's multi-token prediction): after the stack, K modules in sequence; module k
takes the previous depth's hidden state (the stack's output before the final norm for k = 1) and the embedding of
the token k ahead, RMSNorms both, projects their concatenation to d, runs one dense MLA block (A), and its own
norm feeds the shared LM head for the token k+1 ahead. Packed rows: where i+k leaves i's document the embedding
is zero and the target ignored, so no module sees or predicts across a boundary. The loss is lm_loss +
mtp_loss_weight * mean over k of the depth-k losses (ModelOutput keeps each).

Decode (megacpp_lab.model.decode): Block.step runs the same branches in their recurrent form, one token at a
time (each layer's `step` beside its forward; MLA through its compressed KV cache), through the same residual
and mHC rule as the forward (Block.apply_branches).

FLOPs per token (flops_per_token, forward + backward = 3 x forward):
    matmul: 6 * (parameters applied to every token)  - every parameter except the lookups (token
            embedding, n-gram tables, the concept bank and its k/v projections, applied once per step);
            norm weights and biases are counted too (a small overcount); an E block's experts count
            top_k / n_experts of their parameters (the active ones)
    A:      + 3 * 2 * H * (d_nope + d_rope + d_v) * K       (QK^T and AV over the K keys a token attends on
            average). Given the batch's documents (doc_lens), K counts each document's own causal triangle:
            sum_d L_d (L_d + 1) / 2 over sum_d L_d tokens, what document-sparse attention computes. Without
            them, K = T / 2, the row's whole causal triangle: an upper bound that packed rows never reach (8
            documents in a row of 4096 attend about 1/8 of it). A DSA layer's token at in-document position i
            attends min(i, top_k) keys, and its indexer adds 3 * 2 * H_I * d_I * K (every causal key scored;
            the sparse method's FLOPs: the reference attention computes more)
    M, E:   + 3 * 4 * H * P * N * R                           (state update B x^T and readout C h; R: Mamba-3's
                                                              MIMO rank, 1 for SISO and Mamba-2)
    R:      + 3 * H * (2 K V^2 + 4 K V)                       (h W, k (x) v, gate mix, q h)
    cblock: + 3 * 4 * H * Dh * n_concepts                     (scores and values over the bank)
    mtp:    its parameters, its A block's attention term, and 6 * V * d per module (the shared head again)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import nn

from megacpp_lab.model.config import HybridConfig
from megacpp_lab.nn.concept_bank import ConceptBank
from megacpp_lab.nn.engram import EngramBranch, EngramState
from megacpp_lab.nn.hyper_connections import HyperConnection, collapse_streams, expand_streams
from megacpp_lab.nn.lm_head import LMHead
from megacpp_lab.nn.m2rnn import M2RNN, M2RNNState
from megacpp_lab.nn.mamba3 import Mamba3, Mamba3State
from megacpp_lab.nn.mla import MLAKVCache, MultiLatentAttention, reads_block_mask
from megacpp_lab.nn.moe import MoE
from megacpp_lab.nn.ngram_hash import NgramHashMemory, NgramHashState
from megacpp_lab.nn.primitives import SwiGLU
from megacpp_lab.nn.ssm import SSD, SSDState
from megacpp_lab.varlen import PackedContext

__all__ = ["Block", "BlockState", "HybridLM", "MTPModule", "ModelOutput", "REMAT_BUDGET_ATTR", "attended_keys",
           "tokens_ahead"]

REMAT_BUDGET_ATTR = "_megacpp_ac_budget"  # the activation_memory_budget apply_ac gives a block (regional compile)

Branch = Callable[[torch.Tensor], torch.Tensor]


def attended_keys(doc_lens: Sequence[int], *, top_k: int | None = None) -> float:
    """The keys a token attends on average under per-document causal masking: the token at position i (from 1) of
    its document attends i keys (min(i, top_k) with a DSA layer's top_k), averaged over every token of the
    documents doc_lens. A document of L tokens attends L (L + 1) / 2 keys in all, L k - k (k - 1) / 2 past top_k."""
    total, tokens = 0, 0
    for n in doc_lens:
        k = n if top_k is None else min(n, top_k)
        total += k * (k + 1) // 2 + (n - k) * k
        tokens += n
    if tokens == 0:
        raise ValueError("attended_keys: no documents (doc_lens is empty)")
    return total / tokens


def _mixer(config: HybridConfig, kind: str, layer: int) -> nn.Module:
    if kind == "A":  # DSA at the layers that name it (an MTP module's block is past the stack: always dense)
        return MultiLatentAttention(config.mla, dsa=config.dsa if layer in config.dsa_layers else None)
    if kind in ("M", "E"):
        return Mamba3(config.mamba3) if config.m_block == "mamba3" else SSD(config.ssd)
    return M2RNN(config.m2rnn)


@dataclass
class BlockState:
    """One layer's decode state: its Engram / n-gram windows (None where the layer has no such branch) and its
    mixer's state: Mamba-3 / SSD / M2RNN state, or for an A layer the shared MLAKVCache and this layer's index in it."""

    engram: EngramState | None
    ngram: NgramHashState | None
    mixer: Mamba3State | SSDState | M2RNNState | None
    kv_cache: MLAKVCache | None
    kv_layer: int


class Block(nn.Module):
    """One layer: its residual branches in order (engram?, ngram?, mixer, mlp, cblock?), each x + f(x),
    through a HyperConnection each at an mHC layer."""

    def __init__(self, config: HybridConfig, layer: int, kind: str | None = None) -> None:
        super().__init__()
        c, d = config, config.d_model
        self.layer, self.kind = layer, kind or c.blocks[layer]  # kind: an MTP module's A block, past the stack
        self.engram = EngramBranch(c.engram) if layer in c.engram_layers else None
        self.ngram = NgramHashMemory(c.ngram, layer) if layer in c.ngram_layers else None
        self.mixer_norm = nn.RMSNorm(d, eps=c.norm_eps)
        self.mixer = _mixer(c, self.kind, layer)
        self.mlp_norm = nn.RMSNorm(d, eps=c.norm_eps)
        self.mlp = MoE(c.moe) if self.kind == "E" else SwiGLU(d, c.mlp_hidden)
        self.cblock = ConceptBank(c.concept) if layer in c.cblock_layers else None
        names = [n for n in ("engram", "ngram", "mixer", "mlp", "cblock") if getattr(self, n) is not None]
        on = c.mhc and layer in c.engram_layers
        self.hc = nn.ModuleDict({n: HyperConnection(d, c.hyper, layer_idx=layer) for n in names}) if on else None

    def branches(self, tokens: torch.Tensor, ctx: PackedContext) -> list[tuple[str, Branch]]:
        """(name, f) for every residual branch of this layer, in order; f: [B,T,d] -> [B,T,d]."""
        out: list[tuple[str, Branch]] = []
        if self.engram is not None:
            out.append(("engram", lambda x: self.engram(x, ctx=ctx)))
        if self.ngram is not None:
            out.append(("ngram", lambda x: self.ngram(x, tokens, ctx=ctx)))
        out.append(("mixer", lambda x: self.mixer(self.mixer_norm(x), ctx=ctx)))
        out.append(("mlp", lambda x: self.mlp(self.mlp_norm(x))))
        if self.cblock is not None:
            out.append(("cblock", lambda x: self.cblock(x, ctx=ctx)))
        return out

    def step_branches(self, tokens: torch.Tensor, state: BlockState) -> list[tuple[str, Branch]]:
        """The same branches in their recurrent form, one token: f: [B,1,d] -> [B,1,d], advancing `state`."""
        out: list[tuple[str, Branch]] = []
        if self.engram is not None:
            out.append(("engram", lambda x: self.engram.step(x, state.engram)))
        if self.ngram is not None:
            out.append(("ngram", lambda x: self.ngram.step(x, tokens, state.ngram)))
        if self.kind == "A":  # writes this layer's row of the shared cache; the caller advances it once per step
            out.append(("mixer", lambda x: self.mixer.decode(self.mixer_norm(x), state.kv_cache, state.kv_layer)))
        else:
            out.append(("mixer", lambda x: self.mixer.step(self.mixer_norm(x), state.mixer)))
        out.append(("mlp", lambda x: self.mlp(self.mlp_norm(x))))
        if self.cblock is not None:  # per token: no state
            out.append(("cblock", lambda x: self.cblock(x)))
        return out

    def apply_branches(self, x: torch.Tensor, branches: list[tuple[str, Branch]]) -> torch.Tensor:
        """Apply the branches in order, x + f(x) each, through the mHC seams: shared by forward and step."""
        for name, f in branches:
            if x.dim() == 3:  # the plain pre-norm residual
                x = x + f(x)
            elif self.hc is not None:  # an mHC layer
                x = self.hc[name](x, f)
            else:  # streams through a layer without mHC: read the mean, add to every stream
                x = x + f(x.mean(dim=-2)).unsqueeze(-2)
        return x

    def forward(self, x: torch.Tensor, tokens: torch.Tensor, ctx: PackedContext) -> torch.Tensor:
        """x: [B,T,d] (single stream) or [B,T,n,d] (mHC streams)."""
        # Blocks of one structure share a compiled graph, and the partitioner reads the remat budget when it
        # compiles. Checking the budget here makes dynamo guard on its exact value (apply_compile traces budgeted
        # blocks with specialize_float, so it stays a constant), and a block with another budget (the last: never
        # recomputed) compiles apart instead of reusing a graph partitioned for a lower one.
        budget = getattr(self, REMAT_BUDGET_ATTR, None)
        if budget is not None and not 0.0 <= budget <= 1.0:
            raise ValueError(f"block {self.layer}: remat budget {budget!r} is outside [0, 1] (set it with apply_ac)")
        return self.apply_branches(x, self.branches(tokens, ctx))

    def step(self, x: torch.Tensor, tokens: torch.Tensor, state: BlockState) -> torch.Tensor:
        """One decode step: x [B,1,d] or [B,1,n,d], tokens [B,1]; advances `state` in place."""
        return self.apply_branches(x, self.step_branches(tokens, state))

    def init_state(self, batch: int, device: torch.device | str | None = None, dtype: torch.dtype | None = None,
                   kv: tuple[MLAKVCache, int] | None = None) -> BlockState:  # fmt: skip
        """This layer's decode state at a document start; an A layer takes (the shared cache, its index in it)."""
        if (self.kind == "A") != (kv is not None):
            raise ValueError(f"layer {self.layer} ({self.kind}): kv=(cache, index) is for A layers and required there")
        mixer = None if kv is not None else self.mixer.init_state(batch, device, dtype)
        return BlockState(
            engram=self.engram.init_state(batch, device, dtype) if self.engram is not None else None,
            ngram=self.ngram.init_state(batch, device, dtype) if self.ngram is not None else None,
            mixer=mixer, kv_cache=kv[0] if kv else None, kv_layer=kv[1] if kv else -1,
        )  # fmt: skip


def tokens_ahead(t: torch.Tensor, doc_ids: torch.Tensor, k: int, fill: int) -> tuple[torch.Tensor, torch.Tensor]:
    """t [B,T] moved k positions left (position i holds t[i+k]) and the mask [B,T] of the positions whose i+k is
    in i's document; positions past that (another document, or past the row) hold `fill`."""
    n = min(k, t.shape[1])
    ahead = torch.cat((t[:, n:], t.new_full((t.shape[0], n), fill)), dim=1)
    same = torch.cat((doc_ids[:, n:] == doc_ids[:, : doc_ids.shape[1] - n],
                      torch.zeros_like(doc_ids[:, :n], dtype=torch.bool)), dim=1)  # fmt: skip
    return torch.where(same, ahead, fill), same


class MTPModule(nn.Module):
    """Multi-token prediction at depth k (DeepSeek-V3): h^k_i = Block(W [RMSNorm(h^{k-1}_i); RMSNorm(Emb(t_{i+k}))]),
    one dense MLA block (an A block, never sparse: the MTP head needs dense attention), its own final norm before
    the model's shared LM head, which reads h^k_i for t_{i+k+1}. h^0 is the stack's output before the final norm.
    Emb(t_{i+k}) is zero where i+k is past i's document (model/hybrid.py's module docstring)."""

    def __init__(self, config: HybridConfig, depth: int) -> None:
        super().__init__()
        d, eps = config.d_model, config.norm_eps
        self.depth = depth
        self.hidden_norm = nn.RMSNorm(d, eps=eps)
        self.embed_norm = nn.RMSNorm(d, eps=eps)
        self.proj = nn.Linear(2 * d, d, bias=False)
        self.block = Block(config, config.n_layers + depth - 1, kind="A")
        self.norm = nn.RMSNorm(d, eps=eps)

    def forward(self, h: torch.Tensor, embedded_ahead: torch.Tensor, tokens: torch.Tensor, ctx: PackedContext
                ) -> torch.Tensor:  # fmt: skip
        """h [B,T,d] (h^{k-1}), embedded_ahead [B,T,d] (Emb(t_{i+k}), zero past the document) -> h^k [B,T,d]."""
        x = self.proj(torch.cat((self.hidden_norm(h), self.embed_norm(embedded_ahead)), dim=-1))
        return self.block(x, tokens, ctx)


class ModelOutput(NamedTuple):
    loss: torch.Tensor | None  # what training minimises: lm_loss + mtp_loss_weight * mean(mtp_losses); None without targets
    logits: torch.Tensor | None  # [B,T,V] only when asked for
    lm_loss: torch.Tensor | None  # the next-token loss alone (what evaluation compares across models)
    mtp_losses: torch.Tensor | None  # [mtp_depth]: depth k's loss on t_{i+k+1}; None without MTP or targets


class HybridLM(nn.Module):
    """forward(tokens [B,T], ctx, targets=None, *, return_logits=False, with_mtp=True) -> ModelOutput(loss, logits,
    lm_loss, mtp_losses)."""

    def __init__(self, config: HybridConfig) -> None:
        super().__init__()
        if not isinstance(config, HybridConfig):
            raise TypeError(f"HybridLM needs a HybridConfig, got {type(config).__name__}")
        self.config = c = config
        self.embed = nn.Embedding(c.vocab_size, c.d_model)
        self.blocks = nn.ModuleList(Block(c, i) for i in range(c.n_layers))
        self.norm = nn.RMSNorm(c.d_model, eps=c.norm_eps)
        self.lm_head = LMHead(c.lm_head)
        self.mtp = nn.ModuleList(MTPModule(c, k) for k in range(1, c.mtp_depth + 1))

    def all_blocks(self) -> list[Block]:
        """The stack's blocks, then each MTP module's: every block regional compile, checkpointing and FSDP2 treat."""
        return [*self.blocks, *(m.block for m in self.mtp)]

    def forward(self, tokens: torch.Tensor, ctx: PackedContext, targets: torch.Tensor | None = None, *,
                return_logits: bool = False, with_mtp: bool = True) -> ModelOutput:  # fmt: skip
        """tokens [B,T] int ids; ctx: the batch's PackedContext (build_context, once per batch, outside any
        compiled region), passed as given to every mixer; targets [B,T] for the loss. with_mtp=False skips the
        MTP modules (the next-token loss alone: what validation compares)."""
        if tokens.dim() != 2 or tokens.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"tokens must be [B,T] int32/int64, got shape {tuple(tokens.shape)} dtype {tokens.dtype}")
        if not isinstance(ctx, PackedContext):
            raise TypeError("ctx must be the batch's PackedContext (megacpp_lab.varlen.build_context), "
                            f"got {type(ctx).__name__}")  # fmt: skip
        if ctx.shape != tuple(tokens.shape):
            raise ValueError(f"ctx is for [B,T] = {ctx.shape}, tokens are {tuple(tokens.shape)}")
        ctx = self.attention_context(ctx)
        h = self.hidden(tokens, ctx)
        out = self.lm_head(self.norm(h), targets, return_logits=return_logits)
        if targets is None or not self.mtp or not with_mtp:
            return ModelOutput(out.loss, out.logits, out.loss, None)
        # each depth's loss through the shared head, on the targets k ahead (ignored where i+k leaves i's document)
        ignore = self.lm_head.config.ignore_index
        losses = [self.lm_head(module.norm(h_k), tokens_ahead(targets, ctx.doc_ids, module.depth, ignore)[0]).loss
                  for module, h_k in zip(self.mtp, self.mtp_hiddens(h, tokens, ctx))]  # fmt: skip
        mtp = torch.stack(losses)
        return ModelOutput(out.loss + self.config.mtp_loss_weight * mtp.mean(), out.logits, out.loss, mtp)

    @property
    def needs_block_mask(self) -> bool:
        """Whether an attention layer (of the stack or an MTP module) reads the batch's flex block mask: the layers'
        own rule, MultiLatentAttention.attends_through_flex (a DSA layer's flex path, attn_impl 'flex', or 'auto' on
        a GPU). It walks modules(), not each block's mixer, so a wrapped block (bench profile's) still answers."""
        return reads_block_mask(self, self.embed.weight.device)

    def attention_context(self, ctx: PackedContext) -> PackedContext:
        """ctx with the flex block mask built (once per batch, here, outside the compiled blocks) when the model
        has a layer that reads it and ctx has none (needs_block_mask); else ctx as given. On a CPU, where those
        layers take their reference or eager path, nothing is built."""
        if not self.needs_block_mask or ctx.block_mask is not None or ctx.doc_ids.device.type != "cuda":
            return ctx
        return ctx.with_block_mask()

    def hidden(self, tokens: torch.Tensor, ctx: PackedContext) -> torch.Tensor:
        """The stack's output [B,T,d] before the final norm (mHC's streams collapsed)."""
        ctx = self.attention_context(ctx)
        x = self.embed(tokens)
        if self.config.mhc:
            x = expand_streams(x, self.config.hyper.n_streams)
        for block in self.blocks:
            x = block(x, tokens, ctx)
        return collapse_streams(x) if self.config.mhc else x

    def mtp_hiddens(self, h: torch.Tensor, tokens: torch.Tensor, ctx: PackedContext) -> list[torch.Tensor]:
        """Each MTP depth's hidden state h^k [B,T,d] in order, from the stack's output h (hidden()): position i
        of depth k has read the tokens up to i+k of i's document, none of another."""
        ctx = self.attention_context(ctx)
        out = []
        for module in self.mtp:
            ahead, same = tokens_ahead(tokens, ctx.doc_ids, module.depth, self.config.pad_id)
            h = module(h, self.embed(ahead) * same[..., None].to(h.dtype), ahead, ctx)
            out.append(h)
        return out

    # -- accounting

    def _kind_of(self, name: str) -> str:
        """The accounting bucket of a parameter: embedding / lm_head / final_norm, or within a block its
        branch (engram, ngram, cblock, mhc) else the block's letter (mixer, MLP and their norms)."""
        parts = name.split(".")
        if parts[0] != "blocks":
            return {"embed": "embedding", "norm": "final_norm"}.get(parts[0], parts[0])
        branch = parts[2]
        if branch == "hc":
            return "mhc"
        if branch in ("engram", "ngram", "cblock"):
            return branch
        return self.config.blocks[int(parts[1])]

    def _active_share(self, name: str) -> float:
        """The share of a parameter one token uses: top_k / n_experts for an E block's experts, else 1."""
        moe = self.config.moe
        return moe.top_k / moe.n_experts if ".mlp.experts_" in name else 1.0

    def num_parameters(self) -> dict[str, int]:
        """Parameter counts: 'total' and one entry per bucket (embedding, A, M, R, E, engram, ngram, cblock,
        mhc, final_norm, lm_head; buckets the model does not have are left out)."""
        counts: dict[str, int] = {}
        for name, p in self.named_parameters():
            key = self._kind_of(name)
            counts[key] = counts.get(key, 0) + p.numel()
        counts["total"] = sum(counts.values())
        return counts

    def active_parameters(self) -> int:
        """The parameters one token uses: all of them, but an E block's experts at top_k / n_experts."""
        return round(sum(p.numel() * self._active_share(name) for name, p in self.named_parameters()))

    def flops_per_token(self, seq_len: int, *, doc_lens: Sequence[int] | None = None) -> dict[str, int]:
        """Training (forward + backward) FLOPs per token, per bucket and 'total', at sequence length seq_len (the
        attention term grows with it). doc_lens: the batch's document lengths (PackedContext.doc_lengths), for
        attention over each document's causal triangle; None: over the row's (T / 2 keys, an upper bound). The
        formula is in the module docstring."""
        c = self.config
        if doc_lens is not None:
            lens = [int(n) for n in doc_lens]
            if not lens or min(lens) < 1 or max(lens) > seq_len:
                raise ValueError(f"flops_per_token doc_lens: every document 1..{seq_len} tokens long (seq_len), got "
                                 f"{len(lens)} lengths from {min(lens, default=None)} to {max(lens, default=None)}")  # fmt: skip
        lookups = ("embed.weight", ".tables", ".bank.weight", ".k_proj.weight", ".v_proj.weight")
        flops: dict[str, int] = {}
        for name, p in self.named_parameters():
            key = self._kind_of(name)
            cblock_lookup = key == "cblock" and name.endswith(lookups[2:])
            if name == lookups[0] or name.endswith(lookups[1]) or cblock_lookup:
                continue
            flops[key] = flops.get(key, 0) + round(6 * p.numel() * self._active_share(name))
        for i, kind in enumerate(c.blocks + "A" * c.mtp_depth):  # each MTP module's block is an A block
            if kind == "A":
                a = c.mla
                causal = seq_len / 2 if doc_lens is None else attended_keys(lens)
                keys, extra = causal, 0.0
                if i in c.dsa_layers:  # DSA: each query attends at most top_k keys, after the indexer scores them all
                    extra = 3 * 2 * c.dsa.n_heads * c.dsa.head_dim * causal
                    keys = min(keys, c.dsa.top_k) if doc_lens is None else attended_keys(lens, top_k=c.dsa.top_k)
                extra = round(extra + 3 * 2 * a.n_heads * (a.d_nope + a.d_rope + a.d_v) * keys)
            elif kind in ("M", "E"):
                s = c.mamba3 if c.m_block == "mamba3" else c.ssd
                rank = c.mamba3.mimo_rank if c.m_block == "mamba3" else 1
                extra = 3 * 4 * s.n_heads * s.head_dim * s.state_dim * rank
            else:
                r = c.m2rnn
                extra = 3 * r.n_heads * (2 * r.k_head_dim * r.v_head_dim**2 + 4 * r.k_head_dim * r.v_head_dim)
            bucket = "mtp" if i >= c.n_layers else kind
            flops[bucket] = flops.get(bucket, 0) + extra
            if i in c.cblock_layers:
                b = c.concept
                flops["cblock"] = flops.get("cblock", 0) + 3 * 4 * b.n_heads * b.head_dim * b.n_concepts
        if c.mtp_depth:  # the shared LM head runs once more per MTP module (its parameters counted once above)
            flops["mtp"] = flops.get("mtp", 0) + 6 * c.mtp_depth * c.vocab_size * c.d_model
        flops["total"] = sum(flops.values())
        return flops
