"""Hashed n-gram memory (DeepSeek Engram style): 2..N-gram ids hashed into per-head tables.

For every order n in 2..N and each of `heads_per_order` heads:

    mix_n[t] = XOR_{i<n} (token[t-i] * m_{layer,i})      per-layer odd multipliers
    row[t]   = mix_n[t] mod p_{n,head}                    a distinct prime per head

Tokens before the start of the current document hash as the pad id, so no n-gram ever
spans a document boundary. The looked-up rows [B,T,H,D] are concatenated and fused with
the hidden state by the same context gate as the Engram branch:

    k, v = key_proj(e), value_proj(e);  alpha = sigmoid(RMSNorm(h) . RMSNorm(k) / sqrt(C))
    y = alpha * v;  y = y + SiLU(conv_K(RMSNorm(y)))       value_proj zero-initialised

The tables are trained as one nn.Parameter; for serving they are exported per head into a
TableStore (keys engram:l{layer}:h{head}), and forward(store=...) reads rows from it.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from megacpp_lab.checks import config_error
from megacpp_lab.nn.config_builder import build_config
from megacpp_lab.nn.primitives import DocCausalDepthwiseConv, ParameterFreeRMSNorm, context_gate, conv_stepper
from megacpp_lab.nn.table_store import TableBackend, TableStore, TableStoreConfig
from megacpp_lab.varlen import PackedContext, context_positions, doc_causal_shift

__all__ = [
    "MAX_NGRAM",
    "MAX_VOCAB",
    "NgramHashConfig",
    "NgramHashMemory",
    "NgramHashState",
    "check_token_ids",
    "distinct_primes",
    "hash_statistics",
    "is_prime",
    "layer_multipliers",
    "ngram_row_ids",
]

MAX_NGRAM = 8
# tokens < 2**20 and multipliers < 2**31 keep every product and XOR inside int64
MAX_VOCAB = 1 << 20
MULTIPLIER_BITS = 31


_fail = functools.partial(config_error, "NgramHashConfig")


def is_prime(n: int) -> bool:
    if n < 2:
        return False
    if n % 2 == 0:
        return n == 2
    return all(n % d for d in range(3, math.isqrt(n) + 1, 2))


def distinct_primes(start: int, count: int) -> tuple[int, ...]:
    """The `count` smallest primes >= start, in increasing order."""
    primes: list[int] = []
    n = max(2, start)
    while len(primes) < count:
        if is_prime(n):
            primes.append(n)
        n += 1
    return tuple(primes)


@dataclass(frozen=True)
class NgramHashConfig:
    """One hashed n-gram memory layer's settings; build it with NgramHashConfig.build. Frozen, checked on
    construction. Which layers carry a memory is model-level: megacpp_lab.model.config.HybridConfig.ngram_layers."""

    vocab_size: int
    d_model: int
    pad_id: int
    max_ngram: int = 3
    heads_per_order: int = 4
    table_size: int = 49_999
    head_dim: int = 32
    conv_kernel: int = 4
    seed: int = 0
    eps: float = 1e-6

    def __post_init__(self) -> None:
        for name in ("vocab_size", "d_model", "pad_id", "max_ngram", "heads_per_order",
                     "table_size", "head_dim", "conv_kernel", "seed"):  # fmt: skip
            if isinstance(getattr(self, name), bool):
                raise _fail(name, "an int, not a bool", getattr(self, name))
        if not isinstance(self.seed, int) or not 0 <= self.seed < 2**31:
            raise _fail("seed", "an int in [0, 2**31)", self.seed)
        if not isinstance(self.vocab_size, int) or not 2 <= self.vocab_size <= MAX_VOCAB:
            raise _fail("vocab_size", f"an int in 2..{MAX_VOCAB}", self.vocab_size)
        if not isinstance(self.pad_id, int) or not 0 <= self.pad_id < self.vocab_size:
            raise _fail("pad_id", f"a token id in [0, vocab_size={self.vocab_size})", self.pad_id)
        if not isinstance(self.d_model, int) or self.d_model < 1:
            raise _fail("d_model", "an int >= 1", self.d_model)
        if not isinstance(self.max_ngram, int) or not 2 <= self.max_ngram <= MAX_NGRAM:
            raise _fail("max_ngram", f"an int in 2..{MAX_NGRAM} (orders 2..max_ngram are hashed)", self.max_ngram)
        if not isinstance(self.heads_per_order, int) or self.heads_per_order < 1:
            raise _fail("heads_per_order", "an int >= 1", self.heads_per_order)
        if not isinstance(self.table_size, int) or self.table_size < 2:
            raise _fail("table_size", "an int >= 2 (rounded up to distinct primes per head)", self.table_size)
        if not isinstance(self.head_dim, int) or self.head_dim < 1:
            raise _fail("head_dim", "an int >= 1", self.head_dim)
        if not isinstance(self.conv_kernel, int) or not 0 <= self.conv_kernel <= 16:
            raise _fail("conv_kernel", "0 (no conv) or a kernel size in 1..16", self.conv_kernel)
        if not isinstance(self.eps, float) or not 0.0 < self.eps < 1.0:
            raise _fail("eps", "a float in (0, 1)", self.eps)

    @classmethod
    def build(cls, source: Any = None, **overrides: Any) -> NgramHashConfig:
        """The one builder: fields from a model config object (vocab_size, pad_id, d_model or Megatron's
        hidden_size; every other field only as ngram_<name>: a model's own head_dim, eps, conv_kernel or
        training seed is not this memory's) and keyword overrides, else the defaults."""
        aliases = {name: (f"ngram_{name}",) for name in cls.__dataclass_fields__}
        aliases.update(d_model=("d_model", "hidden_size"), vocab_size=("vocab_size",), pad_id=("pad_id",))
        return build_config(cls, source, overrides, prefix="ngram", aliases=aliases,
                            required=("vocab_size", "d_model", "pad_id"))  # fmt: skip

    @property
    def orders(self) -> tuple[int, ...]:
        return tuple(range(2, self.max_ngram + 1))

    @property
    def num_heads(self) -> int:
        return len(self.orders) * self.heads_per_order

    @property
    def table_sizes(self) -> tuple[int, ...]:
        """One distinct prime per head, order-major: heads of order 2 first."""
        return distinct_primes(self.table_size, self.num_heads)


def layer_multipliers(config: NgramHashConfig, layer_id: int) -> torch.Tensor:
    """[max_ngram] odd int64 multipliers, different for every layer, fixed by (seed, layer)."""
    gen = torch.Generator().manual_seed(config.seed * 1_000_003 + layer_id)
    # drawn on the CPU (the generator's device) whatever the default device a model is built under
    m = torch.randint(1, 1 << MULTIPLIER_BITS, (config.max_ngram,), generator=gen, dtype=torch.int64, device="cpu")
    return m | 1


def ngram_row_ids(
    tokens: torch.Tensor,
    positions: torch.Tensor | None,
    config: NgramHashConfig,
    layer_id: int,
    *,
    multipliers: torch.Tensor | None = None,
    moduli: torch.Tensor | None = None,
) -> torch.Tensor:
    """[B,T] token ids -> [B,T,H] row ids, each in [0, table_sizes[h]) of its own head. positions [B,T]: each
    token's offset in its document (a PackedContext's), or None for one document per row."""
    if tokens.dim() != 2 or tokens.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"tokens must be [B,T] int32/int64, got shape {tuple(tokens.shape)} dtype {tokens.dtype}")
    check_token_ids(tokens, config.vocab_size)
    if multipliers is None:
        multipliers = layer_multipliers(config, layer_id).to(tokens.device)
    if moduli is None:
        moduli = torch.tensor(config.table_sizes, dtype=torch.int64, device=tokens.device)
    tok = tokens.to(torch.int64)
    shifted = [doc_causal_shift(tok, positions, i, fill=config.pad_id) for i in range(config.max_ngram)]
    per_order = []
    mix = shifted[0] * multipliers[0]
    for n in range(2, config.max_ngram + 1):
        mix = mix ^ (shifted[n - 1] * multipliers[n - 1])
        per_order.append(mix[..., None].expand(*mix.shape, config.heads_per_order))
    return torch.remainder(torch.cat(per_order, dim=-1), moduli)


def check_token_ids(tokens: torch.Tensor, vocab_size: int) -> None:
    """Fail closed on ids outside the vocab: they would hash, silently, to valid rows.

    On a GPU and under torch.compile the check is an asynchronous device assert (no host
    sync, no graph break).
    """
    if torch.compiler.is_compiling() or tokens.device.type != "cpu":
        torch._assert_async(((tokens >= 0) & (tokens < vocab_size)).all(), "token id outside [0, vocab_size)")
        return
    lo, hi = int(tokens.min()), int(tokens.max())
    if lo < 0 or hi >= vocab_size:
        bad = ((tokens < 0) | (tokens >= vocab_size)).nonzero()[0].tolist()
        raise ValueError(
            f"token id {int(tokens[tuple(bad)])} at row {bad[0]}, offset {bad[1]} is outside [0, vocab_size={vocab_size})"
        )


@dataclass
class NgramHashState:
    """One n-gram memory's decode state: the last max_ngram-1 token ids [B,max_ngram-1] int64 (pad_id before
    the document start) and the conv window [B,K-1,C] (None without a conv)."""

    tokens: torch.Tensor
    conv: torch.Tensor | None


class NgramHashMemory(nn.Module):
    """Hashed 2..N-gram embeddings fused with the hidden state; (h, tokens) -> [B,T,C]."""

    def __init__(self, config: NgramHashConfig, layer_id: int) -> None:
        super().__init__()
        if not isinstance(config, NgramHashConfig):
            raise TypeError(f"NgramHashMemory needs an NgramHashConfig, got {type(config).__name__}")
        if not isinstance(layer_id, int) or isinstance(layer_id, bool) or layer_id < 0:
            raise ValueError(f"layer_id must be an int >= 0 (the model places the layer), got {layer_id!r}")
        self.config = config
        self.layer_id = layer_id
        sizes = torch.tensor(config.table_sizes, dtype=torch.int64)
        self.register_buffer("multipliers", layer_multipliers(config, layer_id), persistent=False)
        self.register_buffer("moduli", sizes, persistent=False)
        self.register_buffer("row_offsets", torch.cumsum(sizes, 0) - sizes, persistent=False)
        H, D, C = config.num_heads, config.head_dim, config.d_model
        self.tables = nn.Parameter(torch.randn(int(sizes.sum()), D) / math.sqrt(D))
        self.norm = ParameterFreeRMSNorm(config.eps)
        self.key_proj = nn.Linear(H * D, C, bias=False)
        self.value_proj = nn.Linear(H * D, C, bias=False)
        nn.init.zeros_(self.value_proj.weight)  # identity on the residual at step 0
        # no conv bias: SiLU(conv(0)) must be 0 for the memory to start as an identity
        self.conv = DocCausalDepthwiseConv(C, config.conv_kernel, bias=False) if config.conv_kernel else None

    def row_ids(self, tokens: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """[B,T,H] per-head row ids (what a TableStore lookup takes); positions as for ngram_row_ids."""
        return ngram_row_ids(tokens, positions, self.config, self.layer_id, multipliers=self.multipliers,
                             moduli=self.moduli)  # fmt: skip

    def head_tables(self) -> list[torch.Tensor]:
        """The per-head tables [N_h, D], views into the trained parameter."""
        return list(torch.split(self.tables, self.config.table_sizes, dim=0))

    def make_store(self, backend: TableBackend | None = None) -> TableStore:
        """A TableStore for this layer, populated with the current tables (create-only)."""
        store = TableStore(self.layer_id, TableStoreConfig.build(self.config), backend)
        store.populate([t.detach() for t in self.head_tables()])
        return store

    def forward(
        self,
        h: torch.Tensor,
        tokens: torch.Tensor,
        *,
        store: TableStore | None = None,
        ctx: PackedContext | None = None,
    ) -> torch.Tensor:
        """h: [B,T,C] hidden state; tokens: [B,T] ids; ctx, the batch's PackedContext (None: one document per
        row). With `store`, rows come from it (no grad to tables)."""
        if h.dim() != 3 or h.shape[-1] != self.config.d_model or tokens.shape != h.shape[:2]:
            raise ValueError(
                f"NgramHashMemory needs h [B,T,{self.config.d_model}] and tokens [B,T]; "
                f"got h {tuple(h.shape)}, tokens {tuple(tokens.shape)}"
            )
        e = self._lookup(self.row_ids(tokens, context_positions(ctx, tuple(tokens.shape))), h, store)
        return self._fuse(h, e, lambda y: self.conv(y, ctx))

    def _lookup(self, ids: torch.Tensor, h: torch.Tensor, store: TableStore | None) -> torch.Tensor:
        """Row ids [B,T,H] -> the concatenated rows [B,T,H*D] in h's dtype: from the tables, or from `store`."""
        if store is None:
            e = F.embedding(ids + self.row_offsets, self.tables)
        else:
            if store.layer_id != self.layer_id:
                raise ValueError(f"store holds layer {store.layer_id}'s tables, this is layer {self.layer_id}")
            if store.get_table_vocab_sizes() != list(self.config.table_sizes) or (
                store.get_embedding_dim() != self.config.head_dim
            ):
                raise ValueError(
                    f"store tables {store.get_table_vocab_sizes()} x D={store.get_embedding_dim()} do not match "
                    f"this layer's {list(self.config.table_sizes)} x D={self.config.head_dim}"
                )
            e = store.lookup(ids).to(device=h.device, dtype=h.dtype)
        return e.flatten(2).to(h.dtype)

    def _fuse(self, h: torch.Tensor, e: torch.Tensor, conv: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """The context gate over the rows e, then the conv (the forward's or the decode step's)."""
        y = context_gate(self.norm(h), self.norm(self.key_proj(e))) * self.value_proj(e)
        if self.conv is not None:
            y = y + F.silu(conv(self.norm(y)))
        return y

    # -- decode: the recurrent form

    def init_state(self, batch: int, device: torch.device | str | None = None,
                   dtype: torch.dtype | None = None) -> NgramHashState:  # fmt: skip
        """The state at a document start: pad_id for the tokens before it (the forward's fill), a zero conv window."""
        tokens = torch.full((batch, self.config.max_ngram - 1), self.config.pad_id, dtype=torch.int64, device=device)
        return NgramHashState(tokens, self.conv.init_window(batch, device, dtype) if self.conv is not None else None)

    def step(self, h: torch.Tensor, tokens: torch.Tensor, state: NgramHashState, *,
             store: TableStore | None = None) -> torch.Tensor:  # fmt: skip
        """One token: h [B,1,C], tokens [B,1] -> [B,1,C]; advances `state` in place."""
        window = torch.cat([state.tokens, tokens.to(torch.int64)], dim=1)  # [B, max_ngram], oldest first
        state.tokens = window[:, 1:]
        ids = self.row_ids(window)[:, -1:]  # the window holds every token the last position's n-grams read
        return self._fuse(h, self._lookup(ids, h, store), conv_stepper(self.conv, state))


def hash_statistics(
    tokens: torch.Tensor, positions: torch.Tensor | None, config: NgramHashConfig, layer_id: int
) -> list[dict[str, float]]:
    """Per head: n-gram order, table size, distinct n-grams seen, rows hit, collisions, occupancy.

    An n-gram is the exact tuple of its n token ids (pad-filled before a document start);
    a collision is a row that two or more distinct n-grams land on.
    """
    tok = tokens.to(torch.int64).cpu()
    pos = positions.cpu() if positions is not None else None
    ids = ngram_row_ids(tok, pos, config, layer_id).reshape(-1, config.num_heads)
    shifted = [doc_causal_shift(tok, pos, i, fill=config.pad_id).reshape(-1) for i in range(config.max_ngram)]
    stats = []
    for h, size in enumerate(config.table_sizes):
        n = config.orders[h // config.heads_per_order]
        grams = torch.stack(shifted[:n], dim=1)  # exact identity of each n-gram
        pairs = torch.unique(torch.cat([grams, ids[:, h : h + 1]], dim=1), dim=0)
        distinct_grams = pairs.shape[0]
        rows, per_row = torch.unique(pairs[:, -1], return_counts=True)
        stats.append(
            {
                "head": h,
                "order": n,
                "table_size": size,
                "tokens": int(ids.shape[0]),
                "distinct_ngrams": distinct_grams,
                "rows_hit": int(rows.numel()),
                "colliding_rows": int((per_row > 1).sum()),
                "collision_rate": 1.0 - rows.numel() / max(1, distinct_grams),
                "occupancy": rows.numel() / size,
            }
        )
    return stats
