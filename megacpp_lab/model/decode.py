"""Step-by-step decode for HybridLM with real per-layer state, and a sampler.

    state = init_decode_state(model, batch, max_len)      # every layer at a document start
    logits = prefill(model, state, prompt)                 # [B,V] fp32: the prompt's last position
    logits = decode_step(model, state, tokens)             # [B,V] fp32: one more token per row
    out = generate(model, prompt, 32, temperature=0.8, top_k=50, generator=g)   # [B, P+32]

Each row is one document, started by its prompt. A layer's state is what its forward reads of the past:
SSD and M2RNN keep a conv window and an fp32 recurrent state; MLA the compressed KV cache (one MLAKVCache
for all A layers, advanced once per step after the whole stack, never per layer); Engram and the n-gram
memory short windows; the MLPs and the concept bank (per token) nothing. A step costs the same at any
position except MLA's attention over its cache.

The model is a HybridLM (made ready by parallelize, or loaded from a checkpoint): the step runs in its
parameters' dtype. Everything runs under torch.inference_mode.
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from megacpp_lab.checks import is_int
from megacpp_lab.model.hybrid import BlockState, HybridLM, tokens_ahead
from megacpp_lab.nn.hyper_connections import collapse_streams, expand_streams
from megacpp_lab.nn.mla import MLAKVCache
from megacpp_lab.varlen import PackedContext

__all__ = ["DecodeState", "DraftStats", "decode_step", "generate", "generate_with_drafts", "init_decode_state",
           "mtp_acceptance", "prefill", "sample_next", "sample_text"]


@dataclass
class DecodeState:
    """Every layer's decode state for one model and batch: blocks[i] is layer i's, kv_cache the MLA cache
    shared by the A layers (None without any). length tokens consumed of max_len."""

    blocks: list[BlockState]
    kv_cache: MLAKVCache | None
    batch: int
    max_len: int
    length: int = 0
    model_ref: weakref.ReferenceType[HybridLM] | None = field(default=None, repr=False)


def _hybrid(model: nn.Module) -> HybridLM:
    if not isinstance(model, HybridLM):
        raise TypeError(f"model must be a HybridLM, got {type(model).__name__}")
    return model




def _check_ids(name: str, ids: torch.Tensor, dims: int, vocab_size: int) -> None:
    shape = "[B,P]" if dims == 2 else "[B]"
    want = f"{name} must be a non-empty {shape} int32/int64 tensor of token ids"
    if not isinstance(ids, torch.Tensor):
        raise ValueError(f"{want}, got {type(ids).__name__}")
    if ids.dim() != dims or ids.dtype not in (torch.int32, torch.int64) or ids.numel() == 0:
        raise ValueError(f"{want}, got shape {tuple(ids.shape)} dtype {ids.dtype}")
    bad = (ids < 0) | (ids >= vocab_size)
    if bool(bad.any()):  # an out-of-vocab id would index past the embedding (or hash to a valid row)
        raise ValueError(f"{name} holds id {int(ids[bad][0])}, outside [0, vocab_size={vocab_size})")


def _check_state(lm: HybridLM, state: DecodeState, batch: int) -> None:
    if not isinstance(state, DecodeState):
        raise TypeError(f"state must be a DecodeState (init_decode_state), got {type(state).__name__}")
    if state.model_ref is None or state.model_ref() is not lm:
        raise ValueError("state was built for another model: build it with init_decode_state(this model, ...)")
    if batch != state.batch:
        raise ValueError(f"state was built for batch {state.batch}, got a batch of {batch}")


def _check_room(state: DecodeState, n: int) -> None:
    if state.length + n > state.max_len:
        raise ValueError(f"decode state max_len={state.max_len} overflows: {state.length} tokens held + {n} new")


def _check_sampling(temperature: float, top_k: int | None, vocab_size: int) -> None:
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not 0 <= temperature < math.inf:
        raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got {temperature!r}")
    if top_k is not None and (not is_int(top_k) or not 1 <= top_k <= vocab_size):
        raise ValueError(f"top_k must be None or an int in 1..vocab_size={vocab_size}, got {top_k!r}")


@torch.inference_mode()
def init_decode_state(model: nn.Module, batch: int, max_len: int, device: torch.device | str | None = None,
                      dtype: torch.dtype | None = None) -> DecodeState:  # fmt: skip
    """Every layer's state at a document start, for `batch` rows of up to `max_len` tokens. device and dtype
    (of the windows and the KV cache; the recurrent states are fp32) default to the embedding's."""
    lm = _hybrid(model)
    c = lm.config
    if not is_int(batch) or batch < 1:
        raise ValueError(f"batch must be an int >= 1, got {batch!r}")
    if not is_int(max_len) or max_len < 1:
        raise ValueError(f"max_len must be an int >= 1, got {max_len!r}")
    n_attn = c.blocks.count("A")
    if n_attn and max_len > c.mla.max_positions:  # no RoPE row past the table
        raise ValueError(f"max_len={max_len} exceeds MLAConfig.max_positions={c.mla.max_positions}")
    device = lm.embed.weight.device if device is None else device
    dtype = lm.embed.weight.dtype if dtype is None else dtype
    cache = None
    if n_attn:
        dsa_dim = c.dsa.head_dim if c.dsa_layers else None
        index_dims = [dsa_dim if i in c.dsa_layers else None for i, kind in enumerate(c.blocks) if kind == "A"]
        cache = MLAKVCache(n_attn, batch, max_len, c.mla.kv_lora_rank, c.mla.d_rope, dtype=dtype, device=device,
                           index_dims=index_dims)  # fmt: skip
    blocks, a = [], 0
    for block in lm.blocks:
        kv = None
        if block.kind == "A":  # the cache's layer index: the position among the A layers
            kv, a = (cache, a), a + 1
        blocks.append(block.init_state(batch, device, dtype, kv))
    return DecodeState(blocks, cache, batch, max_len, model_ref=weakref.ref(lm))


def _step(lm: HybridLM, state: DecodeState, tokens: torch.Tensor) -> torch.Tensor:
    """One token per row through the whole stack (inputs already checked) -> fp32 logits [B,V]."""
    return _step_hidden(lm, state, tokens)[0]


def _step_hidden(lm: HybridLM, state: DecodeState, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """_step's logits [B,V] and the stack's output [B,1,d] before the final norm (what the MTP modules read)."""
    tokens = tokens.to(torch.int64)[:, None]  # [B,1]: every layer steps on a length-1 sequence
    x = lm.embed(tokens)
    if lm.config.mhc:
        x = expand_streams(x, lm.config.hyper.n_streams)
    for block, block_state in zip(lm.blocks, state.blocks):
        x = block.step(x, tokens, block_state)
    if state.kv_cache is not None:
        state.kv_cache.advance()  # once per step, after the whole stack: a per-layer advance leaves holes
    state.length += 1
    if lm.config.mhc:
        x = collapse_streams(x)
    return lm.lm_head(lm.norm(x), return_logits=True).logits[:, -1].float(), x


@torch.inference_mode()
def decode_step(model: nn.Module, state: DecodeState, tokens: torch.Tensor) -> torch.Tensor:
    """Feed one token per row, tokens [B] int; advances `state`; returns the fp32 next-token logits [B,V]."""
    lm = _hybrid(model)
    _check_ids("tokens", tokens, 1, lm.config.vocab_size)
    _check_state(lm, state, tokens.shape[0])
    _check_room(state, 1)
    return _step(lm, state, tokens)


@torch.inference_mode()
def prefill(model: nn.Module, state: DecodeState, prompt: torch.Tensor) -> torch.Tensor:
    """Feed prompt [B,P] int, step by step; returns the fp32 logits [B,V] at its last position."""
    lm = _hybrid(model)
    _check_ids("prompt", prompt, 2, lm.config.vocab_size)
    _check_state(lm, state, prompt.shape[0])
    _check_room(state, prompt.shape[1])
    for t in range(prompt.shape[1]):
        logits = _step(lm, state, prompt[:, t])
    return logits


def sample_next(logits: torch.Tensor, temperature: float = 1.0, top_k: int | None = None,
                generator: torch.Generator | None = None) -> torch.Tensor:  # fmt: skip
    """Next ids [B] int64 from logits [B,V]: argmax at temperature 0 (or top_k=1), else a draw from
    softmax(logits / temperature) over the top_k most likely (all with top_k None)."""
    _check_sampling(temperature, top_k, logits.shape[-1])
    if temperature == 0 or top_k == 1:
        return logits.argmax(dim=-1)
    logits = logits.float() / temperature
    if top_k is not None and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    return torch.multinomial(logits.softmax(dim=-1), 1, generator=generator)[:, 0]


@torch.inference_mode()
def generate(model: nn.Module, prompt: torch.Tensor, max_new_tokens: int, *, temperature: float = 1.0,
             top_k: int | None = None, generator: torch.Generator | None = None) -> torch.Tensor:  # fmt: skip
    """prompt [B,P] int (one document per row) -> [B, P+max_new_tokens] int64 on the model's device: the prompt
    then the sampled tokens (sample_next; generator on that device). The model runs in eval mode meanwhile."""
    lm = _hybrid(model)
    c = lm.config
    _check_ids("prompt", prompt, 2, c.vocab_size)
    _check_sampling(temperature, top_k, c.vocab_size)
    if not is_int(max_new_tokens) or max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be an int >= 0, got {max_new_tokens!r}")
    B, P = prompt.shape
    total = P + max_new_tokens
    if "A" in c.blocks and total > c.mla.max_positions:
        raise ValueError(f"prompt length {P} + max_new_tokens {max_new_tokens} = {total} exceeds "
                         f"MLAConfig.max_positions={c.mla.max_positions}")  # fmt: skip
    prompt = prompt.to(device=lm.embed.weight.device, dtype=torch.int64)
    out = [prompt]
    training = lm.training
    lm.eval()  # dropout off: generation is inference
    try:
        state = init_decode_state(lm, B, total)
        logits = prefill(lm, state, prompt)
        for i in range(max_new_tokens):
            out.append(sample_next(logits, temperature, top_k, generator)[:, None])
            if i + 1 < max_new_tokens:  # the last token is returned, never fed
                logits = _step(lm, state, out[-1][:, 0])
    finally:
        lm.train(training)
    return torch.cat(out, dim=1)


def sample_text(checkpoint: str | Path, prompt: str | bytes, *, max_new_tokens: int = 200, temperature: float = 0.8,
                top_k: int | None = 50, seed: int = 0, device: str = "auto", num_samples: int = 1) -> list[str]:  # fmt: skip
    """C++ text from a training checkpoint (`megacpp-lab sample`; load_checkpoint says which paths it reads):
    the prompt encoded as the start of one document (<bos> first; bytes as they are, invalid UTF-8 as byte
    tokens), `num_samples` rows sampled in one batch, each decoded until its first <eos>. top_k 0 or None
    samples from the whole vocab."""
    from megacpp_lab.data import load_bpe
    from megacpp_lab.model.checkpoint_io import load_checkpoint_model

    if not is_int(num_samples) or num_samples < 1:
        raise ValueError(f"num_samples must be an int >= 1, got {num_samples!r}")
    if device not in ("auto", "cpu", "cuda"):
        raise ValueError(f"device must be 'auto', 'cpu' or 'cuda', got {device!r}")
    # torch.Generator.manual_seed takes -1 as 2**64 - 1: two seeds would draw the same samples
    if not is_int(seed) or not 0 <= seed < 2**64:
        raise ValueError(f"seed must be an int in [0, 2**64), got {seed!r}")
    dev = ("cuda" if torch.cuda.is_available() else "cpu") if device == "auto" else device
    if dev == "cuda" and not torch.cuda.is_available():
        raise ValueError("device is 'cuda' but this machine has no CUDA device")
    tok = load_bpe()
    ids = tok.encode(prompt, add_eos=False)
    model, config = load_checkpoint_model(checkpoint, dev)
    if config.vocab_size != tok.vocab_size:
        raise ValueError(f"checkpoint {checkpoint} has vocab_size {config.vocab_size}, the BPE has {tok.vocab_size}")
    gen = torch.Generator(device=dev).manual_seed(seed)
    rows = generate(model, torch.tensor([ids] * num_samples), max_new_tokens, temperature=temperature,
                    top_k=top_k or None, generator=gen)  # fmt: skip
    texts = []
    for row in rows.tolist():
        new = row[len(ids):]
        end = new.index(tok.eos_id) if tok.eos_id in new else len(new)
        texts.append(tok.decode(row[1 : len(ids)] + new[:end], show_special=False))
    return texts


@torch.inference_mode()
def mtp_acceptance(model: nn.Module, tokens: torch.Tensor, ctx: PackedContext) -> dict[str, list[float] | list[int]]:
    """How often the MTP modules' greedy drafts would be accepted by greedy self-speculative decoding, measured on
    held-out text in one teacher-forced forward (no decode loop): at position i the main head predicts t_{i+1}
    and depth k, having read t_{i+1..i+k} (the text's), drafts t_{i+k+1}; a draft is accepted when it equals the
    main head's own greedy prediction at position i+k, that is, what verifying it would give.
      accepted[k-1]    the fraction of depth k's drafts accepted, over the positions whose i+k+1 is in i's
                       document, given that the drafts of depths < k at i were accepted (a chain stops at the
                       first rejection), so the expected tokens a step gains is the sum of the products;
      correct[k-1]     the fraction of depth k's drafts equal to the text's t_{i+k+1}, unconditioned;
      positions[k-1]   how many positions each rate is over (accepted: those the chain reached).
    Teacher-forced, the drafts read the text's tokens where a drafting decode loop reads its own greedy ones: a
    proxy for the rate such a loop sees (none is built yet). The model needs mtp_depth > 0; tokens [B,T] and ctx
    as for the forward."""
    lm = _hybrid(model)
    if not lm.mtp:
        raise ValueError("mtp_acceptance needs a model with MTP modules (HybridConfig.mtp_depth > 0)")
    _check_ids("tokens", tokens, 2, lm.config.vocab_size)
    h = lm.hidden(tokens, ctx)
    main = lm.lm_head(lm.norm(h), return_logits=True).logits.argmax(-1)  # [B,T]: the greedy t_{i+1} at i
    chain = torch.ones_like(tokens, dtype=torch.bool)
    out: dict[str, list[float] | list[int]] = {"accepted": [], "correct": [], "positions": []}
    for module, h_k in zip(lm.mtp, lm.mtp_hiddens(h, tokens, ctx)):
        k = module.depth
        draft = lm.lm_head(module.norm(h_k), return_logits=True).logits.argmax(-1)  # t_{i+k+1} at i
        verify, inside = tokens_ahead(main, ctx.doc_ids, k, -1)  # the main head's prediction at i+k
        truth, inside_truth = tokens_ahead(tokens, ctx.doc_ids, k + 1, -1)
        valid = inside & inside_truth  # i+k+1 in i's document
        reached = valid & chain
        hit = (draft == verify) & reached
        out["accepted"].append(float(hit.sum() / reached.sum().clamp(min=1)))
        out["correct"].append(float(((draft == truth) & valid).sum() / valid.sum().clamp(min=1)))
        out["positions"].append(int(reached.sum()))
        chain = hit
    return out


@dataclass(frozen=True)
class DraftStats:
    """What the MTP head's drafts did over one generate_with_drafts call, per row: drafts[b] drafts checked,
    accepted[b] of them equal to the main head's greedy token (what verifying them would keep), and the drafted
    tokens themselves in order (draft_tokens[b][j] drafted for new token j + 1)."""

    drafts: list[int]
    accepted: list[int]
    draft_tokens: list[list[int]]

    @property
    def acceptance(self) -> float:
        """Accepted over checked drafts, every row together."""
        return sum(self.accepted) / max(1, sum(self.drafts))


@torch.inference_mode()
def generate_with_drafts(model: nn.Module, prompt: torch.Tensor, max_new_tokens: int) -> tuple[torch.Tensor, DraftStats]:
    """Greedy decoding whose every step also drafts the token after next with the first MTP module (DeepSeek-V3's
    self-speculative drafting), and checks each draft when the main head reaches that position. prompt [B,P] int
    (one document per row) -> ([B, P+max_new_tokens] int64, DraftStats): the tokens are generate(temperature=0)'s
    exactly, and the stats say how often a draft equals the main head's greedy token there, which is the share a
    self-speculative loop keeps.

    The MTP module steps as the main stack does: its block holds its own compressed KV cache, and at position i it
    reads the stack's output h_i and the embedding of t_{i+1} (the prompt's, then the greedy token), as in
    training. Every token still costs one main-stack step: verifying a draft in the same forward as the token
    before it needs a two-token step of every mixer, which the decode state does not have; this measures the
    acceptance, not a speed-up. Deeper MTP modules are not used."""
    lm = _hybrid(model)
    c = lm.config
    if not lm.mtp:
        raise ValueError("generate_with_drafts needs a model with MTP modules (HybridConfig.mtp_depth > 0)")
    _check_ids("prompt", prompt, 2, c.vocab_size)
    if not is_int(max_new_tokens) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
    B, P = prompt.shape
    total = P + max_new_tokens
    if total > c.mla.max_positions:  # the MTP module's attention, and the stack's A layers, have no RoPE row past it
        raise ValueError(f"prompt length {P} + max_new_tokens {max_new_tokens} = {total} exceeds "
                         f"MLAConfig.max_positions={c.mla.max_positions}")  # fmt: skip
    device, dtype = lm.embed.weight.device, lm.embed.weight.dtype
    prompt = prompt.to(device=device, dtype=torch.int64)
    module = lm.mtp[0]
    training = lm.training
    lm.eval()
    try:
        state = init_decode_state(lm, B, total)
        mtp_cache = MLAKVCache(1, B, total, c.mla.kv_lora_rank, c.mla.d_rope, dtype=dtype, device=device)
        mtp_state = module.block.init_state(B, device, dtype, (mtp_cache, 0))

        def draft(h: torch.Tensor, ahead: torch.Tensor) -> torch.Tensor:
            """The MTP module at this position: h [B,1,d] and the token after it [B] -> its greedy draft [B]."""
            x = module.proj(torch.cat((module.hidden_norm(h), module.embed_norm(lm.embed(ahead[:, None]))), dim=-1))
            x = module.block.step(x, ahead[:, None], mtp_state)
            mtp_cache.advance()
            return lm.lm_head(module.norm(x), return_logits=True).logits[:, -1].argmax(-1)

        h_prev = None
        for t in range(P):
            logits, h = _step_hidden(lm, state, prompt[:, t])
            if h_prev is not None:  # the module at t-1 reads t's token: fills its cache, no draft checked
                draft(h_prev, prompt[:, t])
            h_prev = h
        out, drafts, accepted = [prompt], torch.zeros(B, dtype=torch.int64), torch.zeros(B, dtype=torch.int64)
        proposed: list[torch.Tensor] = []
        pending = None  # the draft for the token the main head gives next
        for i in range(max_new_tokens):
            nxt = logits.argmax(-1)
            if pending is not None:
                drafts += 1
                accepted += (pending == nxt).cpu()
                proposed.append(pending)
            out.append(nxt[:, None])
            if i + 1 < max_new_tokens:
                pending = draft(h_prev, nxt)  # position of h_prev reads nxt: drafts the token after nxt
                logits, h_prev = _step_hidden(lm, state, nxt)
    finally:
        lm.train(training)
    drafted = torch.stack(proposed, dim=1).tolist() if proposed else [[] for _ in range(B)]
    return torch.cat(out, dim=1), DraftStats(drafts.tolist(), accepted.tolist(), drafted)
