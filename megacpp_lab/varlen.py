"""The packed-batch context: built and checked once per batch, then taken as given by every mixer and kernel.

A packed row holds several documents back to back. Each form the kernels need (per-token document ids,
positions, document starts, flattened `cu_seqlens` and the sequence index of each token, the flex block
mask) is derived here, by one function each, and the whole layout is validated by one function,
`validate_packed_layout`; the doc-aware shift every look-back op uses is `doc_causal_shift`. `build_context`
does both once per batch, eagerly, outside any compiled region;
layers and kernels that receive a `PackedContext` neither re-derive nor re-check what it holds.

Layout contract (docs/design.md, "Packed rows"):
  doc_ids    [B,T] int32/int64, non-decreasing along a row, changing at every boundary
  positions  [B,T] integer, 0 at each document start, +1 inside a document
  cu_seqlens [S+1] int32 over the flattened B*T tokens: 0, every document start, B*T
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask

__all__ = [
    "FLEX_BLOCK",
    "PER_DOCUMENT_FIELDS",
    "PackedContext",
    "build_context",
    "check_context",
    "check_cu_seqlens",
    "copy_to_device",
    "context_positions",
    "cu_seqlens_from_doc_ids",
    "doc_causal_block_mask",
    "doc_causal_shift",
    "doc_ids_from_cu_seqlens",
    "doc_starts",
    "documents_longest_first",
    "host_lengths",
    "packed_cu_seqlens",
    "positions_from_doc_ids",
    "same_doc_as_lag",
    "sequence_index",
    "validate_packed_layout",
]

ID_DTYPES = (torch.int32, torch.int64)
FLEX_BLOCK = 128  # the flex block mask's block size, in tokens


# ----------------------------------------------------------------------------- conversions, one each


def _require_rows(doc_ids: Any, function: str) -> None:
    """doc_ids must be a [B,T] tensor: a shape check, free on any device and inside a compiled region."""
    if not isinstance(doc_ids, torch.Tensor) or doc_ids.dim() != 2:
        got = tuple(doc_ids.shape) if isinstance(doc_ids, torch.Tensor) else type(doc_ids).__name__
        raise ValueError(f"{function}: doc_ids must be a [B,T] tensor, got {got}")


def doc_starts(doc_ids: torch.Tensor) -> torch.Tensor:
    """Bool [B,T]: True at every document start (offset 0 of each row included).

    A document is a run of equal ids: this and the two builders below compare neighbouring ids only and do not
    check that ids never go backwards. That is the layout contract, checked once per batch on the host by
    validate_packed_layout (build_context, PackedBatch): these run every step, on the GPU and inside compiled
    regions (dsa.document_starts), where reading values would be a host sync, and on time-reversed rows, whose
    ids decrease by design (testing.planted.CenteredSmoother)."""
    _require_rows(doc_ids, "doc_starts")
    starts = torch.ones_like(doc_ids, dtype=torch.bool)
    starts[:, 1:] = doc_ids[:, 1:] != doc_ids[:, :-1]
    return starts


def positions_from_doc_ids(doc_ids: torch.Tensor) -> torch.Tensor:
    """Offset of each token inside its document, int64 [B,T] (documents are runs of equal ids: doc_starts)."""
    _require_rows(doc_ids, "positions_from_doc_ids")
    B, T = doc_ids.shape
    idx = torch.arange(T, device=doc_ids.device).expand(B, T)
    last_start = torch.where(doc_starts(doc_ids), idx, torch.zeros_like(idx)).cummax(dim=1).values
    return (idx - last_start).to(torch.int64)


def cu_seqlens_from_doc_ids(doc_ids: torch.Tensor) -> torch.Tensor:
    """Flattened varlen boundaries (flash-attention convention), int32 [S+1] (documents are runs of equal ids:
    doc_starts)."""
    _require_rows(doc_ids, "cu_seqlens_from_doc_ids")
    B, T = doc_ids.shape
    starts = doc_starts(doc_ids).reshape(-1).nonzero().reshape(-1)
    end = torch.tensor([B * T], device=doc_ids.device)
    return torch.cat([starts, end]).to(torch.int32)


def sequence_index(starts: torch.Tensor) -> torch.Tensor:
    """int64 [B*T]: which flattened sequence (document) each token belongs to, from doc_starts."""
    return starts.reshape(-1).to(torch.int64).cumsum(0) - 1


def doc_causal_block_mask(doc_ids: torch.Tensor | None, *, batch: int | None = None, seq_len: int | None = None,
                          device: torch.device | str | None = None) -> BlockMask:  # fmt: skip
    """The flex-attention block mask of packed rows: key s is visible to query t iff s <= t and both lie in
    the same document (one document per row when doc_ids is None: give batch, seq_len and device). A document is
    a run of equal ids in a row (doc_starts), so ids that came back to an earlier value would not join it.

    The block structure is computed from the documents' runs, not by evaluating the mask at every (query, key):
    in a row the run index never decreases, so a key block j < i shares a document with query block i iff the
    run of j's last token is the run of i's first (any visible pair), and is fully visible iff the run of j's
    first token is the run of i's last (whole blocks only); the diagonal block is partial. About twenty small
    tensor ops, where create_block_mask's vmapped evaluation of the [B, T, T] mask kept the host busy while the
    GPU, at every step's start, had nothing queued: about 5 ms of idle GPU a step at B=4 T=4096 in the H200's
    profile_base_compiled trace at f66f060. tests/test_varlen.py checks it against create_block_mask.

    Build it once per batch, eagerly, outside any compiled region: built inside, inductor fused the mask
    construction into the attention kernel, which returned wrong numbers with no error on an H100."""
    if torch.compiler.is_compiling():
        raise RuntimeError("doc_causal_block_mask must run outside the compiled region (once per batch)")
    if doc_ids is None:
        if batch is None or seq_len is None:
            raise ValueError("doc_causal_block_mask needs doc_ids, or batch and seq_len for one document per row")
        doc_ids = torch.zeros(batch, seq_len, dtype=torch.long, device=device)
    if doc_ids.dim() != 2:
        raise ValueError(f"doc_ids must be [B, T], got shape {tuple(doc_ids.shape)}")
    B, T = doc_ids.shape
    dev = doc_ids.device
    run = doc_starts(doc_ids).to(torch.int32).cumsum(1)  # [B,T]: the document (run) of each token in its row
    n = -(-T // FLEX_BLOCK)
    blocks = torch.arange(n, device=dev)
    first = run[:, blocks * FLEX_BLOCK]  # [B, n]: the run of each block's first token
    last = run[:, torch.clamp((blocks + 1) * FLEX_BLOCK, max=T) - 1]  # ... and of its last
    below = blocks[None, :] < blocks[:, None]  # [q block i, kv block j]: j < i
    whole = (blocks + 1) * FLEX_BLOCK <= T
    any_visible = (blocks[None, :] == blocks[:, None]) | (below & (last[:, None, :] == first[:, :, None]))
    full = below & (first[:, None, :] == last[:, :, None]) & whole[None, :, None] & whole[None, None, :]

    def ordered(mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[B, i, j] bool -> each query block's count [B, 1, n] and its key blocks in order first [B, 1, n, n]."""
        order = torch.argsort((~mask).to(torch.uint8), dim=-1, stable=True).to(torch.int32)
        return mask.sum(-1, dtype=torch.int32)[:, None], order[:, None]

    def same_doc_causal(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & (run[b, q_idx] == run[b, kv_idx])

    kv_num, kv_indices = ordered(any_visible & ~full)
    full_num, full_indices = ordered(full)
    return BlockMask.from_kv_blocks(kv_num, kv_indices, full_num, full_indices, BLOCK_SIZE=FLEX_BLOCK,
                                    mask_mod=same_doc_causal, seq_lengths=(T, T))  # fmt: skip


# ----------------------------------------------------------------------------- doc-aware shifts
# Any op that looks back in time (shift, pool, conv) must see zeros where its window would cross into the
# previous document, exactly as if each document had been left-padded on its own.


def same_doc_as_lag(positions: torch.Tensor, lag: int) -> torch.Tensor:
    """Bool [B,T]: True where position t-lag exists and belongs to the same document as t, read from each
    token's offset inside its document (a PackedContext's positions): exactly where that offset is >= lag."""
    if lag < 0:
        raise ValueError(f"lag must be >= 0, got {lag}")
    return positions >= lag


def doc_causal_shift(
    x: torch.Tensor, positions: torch.Tensor | None, lag: int, *, fill: float | int = 0
) -> torch.Tensor:
    """x[:, t-lag] placed at t, `fill` where t-lag is before the row or in another document.

    x is [B,T,...]; positions [B,T] is each token's offset inside its document (a PackedContext's
    positions), or None (one document per row). Token ids use fill=pad_id, hidden states the default zero.
    The checks read shapes and Python ints only: no host sync, no graph break where a layer runs it compiled.
    """
    # a negative lag would slice x[:, :T+|lag|] and return a shorter tensor without an error
    if isinstance(lag, bool) or not isinstance(lag, int) or lag < 0:
        raise ValueError(f"doc_causal_shift: lag must be an int >= 0, got {lag!r}")
    if x.dim() < 2:
        raise ValueError(f"doc_causal_shift: x must be [B,T,...], got shape {tuple(x.shape)}")
    B, T = x.shape[:2]
    if positions is not None and (not isinstance(positions, torch.Tensor) or tuple(positions.shape) != (B, T)):
        got = tuple(positions.shape) if isinstance(positions, torch.Tensor) else type(positions).__name__
        raise ValueError(f"doc_causal_shift: positions must be None or a [B,T] = {(B, T)} tensor, got {got}")
    if lag == 0:
        return x
    if lag >= T:
        return torch.full_like(x, fill)
    shifted = F.pad(x[:, : T - lag], [0, 0] * (x.dim() - 2) + [lag, 0], value=fill)
    if positions is None:
        return shifted
    mask = same_doc_as_lag(positions, lag).view(B, T, *([1] * (x.dim() - 2)))
    # where, not multiply: 0 * inf from another document would still leak a NaN
    return torch.where(mask, shifted, torch.full((), fill, dtype=x.dtype, device=x.device))


# ----------------------------------------------------------------------------- checks


def _first_true(mask: torch.Tensor) -> tuple[int, int]:
    """(row, offset) of the first True in a [B,T'] mask."""
    flat = int(mask.reshape(-1).nonzero()[0, 0])
    return flat // mask.shape[1], flat % mask.shape[1]


def _check_doc_ids(doc_ids: torch.Tensor, shape: tuple[int, int]) -> None:
    """Host tensors only (validate_packed_layout's): shape, dtype, and ids never going backwards (masks compare
    ids for equality only, so 0,0,1,0 would silently join two documents); a ValueError with row and offset."""
    if doc_ids.shape != shape:
        raise ValueError(f"doc_ids shape {tuple(doc_ids.shape)} does not match [B,T] = {tuple(shape)}")
    if doc_ids.dtype not in ID_DTYPES:
        raise ValueError(f"doc_ids dtype must be int32 or int64, got {doc_ids.dtype}")
    backwards = doc_ids[:, 1:] < doc_ids[:, :-1]
    if bool(backwards.any()):
        r, t = _first_true(backwards)
        raise ValueError(
            f"doc_ids go backwards at row {r}, offset {t + 1}: {int(doc_ids[r, t])} -> {int(doc_ids[r, t + 1])}"
        )


def check_context(ctx: Any) -> None:
    """ctx, when given, must be a PackedContext: anything else (a str, a bare block mask, doc_ids) fails here by
    name, not deep inside a layer on an attribute it lacks."""
    if ctx is not None and not isinstance(ctx, PackedContext):
        raise TypeError(f"ctx must be a PackedContext (megacpp_lab.varlen.build_context), got {type(ctx).__name__}")


def context_positions(ctx: PackedContext | None, shape: tuple[int, ...]) -> torch.Tensor | None:
    """The positions a layer of input [B,T,...] = shape reads its look-back masks from: its context's
    (validated when it was built), or None without one (one document per row). A context of another batch
    shape fails closed."""
    if ctx is None:
        return None
    check_context(ctx)
    if ctx.shape != tuple(shape[:2]):
        raise ValueError(f"ctx is for [B,T] = {ctx.shape}, the input is {tuple(shape[:2])}")
    return ctx.positions


def packed_cu_seqlens(B: int, T: int, docs: int, generator: torch.Generator) -> torch.Tensor:
    """[B*docs + 1] int32 over the flattened B*T tokens: each row cut into `docs` documents of unequal,
    seeded-random lengths (distinct cut points), every row start a document start."""
    # B < 1 would return [0], boundaries over no tokens, without an error
    for name, size in (("B", B), ("T", T)):
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(f"packed_cu_seqlens: {name} must be an int >= 1, got {size!r}")
    if not 1 <= docs <= T:
        raise ValueError(f"docs per row must be in [1, T={T}], got {docs}")
    bounds = [0]
    for b in range(B):
        cuts = torch.randperm(T - 1, generator=generator)[: docs - 1].add(1).sort().values
        bounds += [b * T + int(c) for c in cuts] + [(b + 1) * T]
    return torch.tensor(bounds, dtype=torch.int32)


def doc_ids_from_cu_seqlens(cu_seqlens: torch.Tensor, B: int, T: int) -> torch.Tensor:
    """[B,T] int64 document ids (0, 1, ... over the flattened batch) from cu_seqlens over the B*T tokens.
    cu_seqlens: int32, as check_cu_seqlens requires (a float boundary such as 1.5 would be cut silently)."""
    for name, size in (("B", B), ("T", T)):
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(f"doc_ids_from_cu_seqlens: {name} must be an int >= 1, got {size!r}")
    if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dtype != torch.int32:
        raise ValueError(f"doc_ids_from_cu_seqlens: cu_seqlens must be an int32 tensor, got "
                         f"{getattr(cu_seqlens, 'dtype', type(cu_seqlens).__name__)}")  # fmt: skip
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2 or int(cu_seqlens[0]) != 0 or int(cu_seqlens[-1]) != B * T:
        raise ValueError(f"cu_seqlens must be 1-D, start at 0 and end at B*T = {B * T}, got {cu_seqlens.tolist()}")
    lengths = cu_seqlens[1:] - cu_seqlens[:-1]
    if bool((lengths <= 0).any()):
        i = int((lengths <= 0).nonzero()[0])
        raise ValueError(f"cu_seqlens must be strictly increasing (no empty document): cu_seqlens[{i}] = "
                         f"{int(cu_seqlens[i])}, cu_seqlens[{i + 1}] = {int(cu_seqlens[i + 1])}")
    missing = sorted(set(range(0, B * T, T)) - set(cu_seqlens.tolist()))
    if missing:
        raise ValueError(f"cu_seqlens must hold every row start (a document never spans two rows): offset {missing[0]} "
                         f"(row {missing[0] // T}) is not a document start")
    flat = torch.arange(B * T, device=cu_seqlens.device)
    return torch.searchsorted(cu_seqlens[1:].to(torch.int64), flat, right=True).view(B, T)


def check_cu_seqlens(cu_seqlens: Any, n_tokens: int, *, device: torch.device | None = None,
                     row_len: int | None = None, values: bool = True) -> None:  # fmt: skip
    """Fail closed on varlen boundaries handed over bare (a PackedContext's were checked when it was built).

    Always (host metadata, no sync): a 1-D int32 tensor of >= 2 entries, on `device` when given. Then, unless
    values=False (a caller that checked them already) and outside a compiled region, the values: 0, rising
    strictly, ending at n_tokens, and with row_len (a positive int dividing n_tokens) a document start at every
    row start (a multiple of row_len: a document never spans two rows). On a CPU tensor a ValueError naming the
    entry, row and offset; on a GPU one device-side assert, so the caller's stream never waits on the host. The
    one check of cu_seqlens: build_context, the SSD and M2RNN scans and the rope kernels use it."""
    if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dtype != torch.int32 or cu_seqlens.dim() != 1:
        raise ValueError(f"cu_seqlens must be a 1-D int32 tensor, got {getattr(cu_seqlens, 'dtype', type(cu_seqlens))} "
                         f"{tuple(getattr(cu_seqlens, 'shape', ()))}")  # fmt: skip
    if cu_seqlens.numel() < 2:
        raise ValueError(f"cu_seqlens must hold >= 2 entries (0 and the {n_tokens} tokens), got {cu_seqlens.numel()}")
    if device is not None and cu_seqlens.device != torch.device(device):
        raise ValueError(f"cu_seqlens must be on the input's device {device}, got {cu_seqlens.device}")
    if not values or torch.compiler.is_compiling():
        return
    # a row_len of 0, below 0 or not dividing the tokens would silently skip the row-start check below (Python
    # ints: no sync; after the compiled-region return, so a symbolic row length adds no guard)
    if row_len is not None and (isinstance(row_len, bool) or not isinstance(row_len, int) or row_len <= 0
                                or n_tokens % row_len):  # fmt: skip
        raise ValueError(f"check_cu_seqlens: row_len must be a positive int dividing the {n_tokens} tokens, got "
                         f"{row_len!r}")  # fmt: skip
    if cu_seqlens.device.type != "cpu":
        ok = (cu_seqlens[0] == 0) & (cu_seqlens[-1] == n_tokens) & (cu_seqlens[1:] > cu_seqlens[:-1]).all()
        if row_len is not None:  # every row start is among the boundaries
            rows = torch.arange(0, n_tokens, row_len, device=cu_seqlens.device, dtype=torch.int32)
            ok = ok & torch.isin(rows, cu_seqlens).all()
        torch._assert_async(ok, "cu_seqlens must rise strictly from 0 to the token count, a document starting at every row start")
        return
    cu = cu_seqlens.tolist()
    where = (lambda at: f" (row {at // row_len}, offset {at % row_len})") if row_len else (lambda at: "")
    if cu[0] != 0:
        raise ValueError(f"cu_seqlens must start at 0, got cu_seqlens[0]={cu[0]}")
    bad = next((i for i in range(1, len(cu)) if cu[i] <= cu[i - 1]), None)
    if bad is not None:
        raise ValueError(f"cu_seqlens must increase strictly: entries {bad - 1} and {bad} are {cu[bad - 1]}, {cu[bad]}"
                         f"{where(min(cu[bad - 1], n_tokens - 1)) if n_tokens else ''}")  # fmt: skip
    if cu[-1] < n_tokens:
        raise ValueError(f"cu_seqlens do not cover the {n_tokens} tokens: they end at {cu[-1]}"
                         + (f" (row {cu[-1] // row_len}, offset {cu[-1] % row_len} onward is uncovered)" if row_len else ""))  # fmt: skip
    if cu[-1] > n_tokens:
        raise ValueError(f"cu_seqlens do not cover the {n_tokens} tokens: they end at {cu[-1]}, past them")
    if row_len:
        starts = set(cu)
        row = next((r for r in range(n_tokens // row_len) if r * row_len not in starts), None)
        if row is not None:
            raise ValueError(f"cu_seqlens must start a document at every row start: row {row} (offset {row * row_len}) "
                             "is not one")  # fmt: skip


def validate_packed_layout(doc_ids: torch.Tensor, positions: torch.Tensor, cu_seqlens: torch.Tensor) -> None:
    """Raise ValueError naming the field, row and offset of the first violation of the layout contract."""
    for name, t in (("doc_ids", doc_ids), ("positions", positions), ("cu_seqlens", cu_seqlens)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if doc_ids.dim() != 2 or doc_ids.numel() == 0:
        raise ValueError(f"doc_ids must be a non-empty [B,T] tensor, got shape {tuple(doc_ids.shape)}")
    B, T = doc_ids.shape
    for name, t in (("doc_ids", doc_ids), ("positions", positions)):
        if t.shape != doc_ids.shape:
            raise ValueError(f"{name} shape {tuple(t.shape)} does not match doc_ids shape {tuple(doc_ids.shape)}")
        if t.dtype not in ID_DTYPES:
            raise ValueError(f"{name} dtype must be int32 or int64, got {t.dtype}")
    devices = {t.device for t in (doc_ids, positions, cu_seqlens)}
    if len(devices) != 1:
        raise ValueError(f"doc_ids, positions and cu_seqlens must share one device, got {sorted(map(str, devices))}")

    _check_doc_ids(doc_ids.cpu(), (B, T))  # on the host: a named error, not a device assert
    starts = doc_starts(doc_ids)
    bad_start = starts & (positions != 0)
    if bad_start.any():
        r, t = _first_true(bad_start)
        raise ValueError(
            f"positions not reset at a document boundary: row {r}, offset {t} starts doc "
            f"{int(doc_ids[r, t])} but positions[{r}, {t}] = {int(positions[r, t])}, expected 0"
        )
    if T > 1:
        bad_step = ~starts[:, 1:] & (positions[:, 1:] != positions[:, :-1] + 1)
        if bad_step.any():
            r, t = _first_true(bad_step)
            raise ValueError(
                f"positions do not advance inside a document: row {r}, offset {t + 1} has "
                f"{int(positions[r, t + 1])} after {int(positions[r, t])}"
            )

    check_cu_seqlens(cu_seqlens.cpu(), B * T, row_len=T)  # on the host, as doc_ids: a named error
    cu = cu_seqlens.to(torch.int64)
    expected = starts.reshape(-1).nonzero().reshape(-1)
    got = cu[:-1]
    n = min(expected.numel(), got.numel())
    mismatch = (expected[:n] != got[:n]).nonzero()
    if mismatch.numel() or expected.numel() != got.numel():
        i = int(mismatch[0, 0]) if mismatch.numel() else n
        if i < expected.numel() and (i >= got.numel() or int(expected[i]) < int(got[i])):
            at, what = int(expected[i]), "a document starts there but cu_seqlens has no entry"
        else:
            at, what = int(got[i]), "cu_seqlens has a boundary there but doc_ids do not change"
        raise ValueError(f"cu_seqlens disagree with doc_ids at row {at // T}, offset {at % T}: {what}")


# ----------------------------------------------------------------------------- the context


def copy_to_device(t: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """`t` on `device`. Host to GPU, the copy is non-blocking from pinned memory: from pageable memory
    cudaMemcpyAsync first waits for all the work queued on the stream, a host sync in disguise. (The caching
    host allocator keeps the pinned block until the copy has run.)"""
    device = torch.device(device)
    if t.device == device:
        return t
    if device.type == "cuda" and t.device.type == "cpu":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


# the context's tensors whose length is the document count plus one, marked dynamic by build_context
PER_DOCUMENT_FIELDS = ("cu_seqlens", "cu_seqlens_host", "longest_first")


@dataclass(frozen=True, eq=False)
class PackedContext:
    """One packed batch in every form the mixers and kernels use, validated once (build_context).

    doc_ids, positions: [B,T] int64. starts: [B,T] bool document starts. cu_seqlens: [S+1] int32 over the
    flattened B*T tokens, on the device; cu_seqlens_host: the same on the CPU, for launch grids. seq_index:
    [B*T] int64, the flattened sequence of each token. max_seqlen: the longest document. block_mask: the
    flex mask (doc_causal_block_mask) when asked for, else None."""

    doc_ids: torch.Tensor
    positions: torch.Tensor
    starts: torch.Tensor
    cu_seqlens: torch.Tensor
    cu_seqlens_host: torch.Tensor
    seq_index: torch.Tensor
    longest_first: torch.Tensor
    max_seqlen: int
    block_mask: BlockMask | None = None

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.doc_ids.shape)  # type: ignore[return-value]

    @property
    def n_seqs(self) -> int:
        return self.cu_seqlens_host.numel() - 1

    @property
    def doc_lengths(self) -> list[int]:
        """Every document's length in tokens, in order, from the host copy of cu_seqlens (no device sync): what
        HybridLM.flops_per_token counts attention over."""
        return host_lengths(self.cu_seqlens_host)

    def to(self, device: torch.device | str) -> PackedContext:
        """The same context on `device` (cu_seqlens_host stays on the host), copied without a host sync
        (copy_to_device). Build and validate on the host, then move: validation reads values, and on a GPU
        each read is a host sync, after which the CPU can no longer queue the next step ahead of the GPU."""
        device = torch.device(device)
        cu_seqlens = copy_to_device(self.cu_seqlens, device)
        longest_first = copy_to_device(self.longest_first, device)
        for moved in (cu_seqlens, longest_first):  # new tensors: marked as build_context marked the ones it made
            torch._dynamo.maybe_mark_dynamic(moved, 0)  # (cu_seqlens_host stays, with its mark)
        return PackedContext(
            doc_ids=copy_to_device(self.doc_ids, device), positions=copy_to_device(self.positions, device),
            starts=copy_to_device(self.starts, device), cu_seqlens=cu_seqlens, cu_seqlens_host=self.cu_seqlens_host,
            seq_index=copy_to_device(self.seq_index, device), longest_first=longest_first, max_seqlen=self.max_seqlen,
            # rebuilt, not moved: BlockMask.to moves its block tensors but its mask_mod keeps reading the doc_ids it
            # captured where it was built (a host tensor, indexed from the device kernel)
            block_mask=None if self.block_mask is None else doc_causal_block_mask(copy_to_device(self.doc_ids, device)),
        )  # fmt: skip

    def with_block_mask(self) -> PackedContext:
        """This context with its flex block mask (doc_causal_block_mask, built where its doc_ids live), or itself
        when it has one. Eager only: called inside a compiled region it raises, as the mask builder does."""
        if self.block_mask is not None:
            return self
        return dataclasses.replace(self, block_mask=doc_causal_block_mask(self.doc_ids))

    @classmethod
    def from_batch(cls, batch: Any, *, block_mask: bool = False) -> PackedContext:
        """From anything holding doc_ids, positions and cu_seqlens (a data.PackedBatch)."""
        return build_context(batch.doc_ids, batch.positions, batch.cu_seqlens, block_mask=block_mask)


def host_lengths(cu_seqlens_host: torch.Tensor) -> list[int]:
    """The documents' lengths from a host copy of cu_seqlens, differenced in Python: no operator dispatched (the
    M2RNN launchers read them in every call)."""
    bounds = cu_seqlens_host.tolist()
    return [end - start for start, end in zip(bounds, bounds[1:])]


def documents_longest_first(cu_seqlens: torch.Tensor) -> torch.Tensor:
    """[S+1] int32 on cu_seqlens's device: the S documents' indices by length, longest first (equal lengths in
    order), then S, an end mark no kernel reads. The mark gives the tensor cu_seqlens's length: a batch of one
    document would otherwise make it a one-element tensor, which dynamo specialises (a recompile). From the values
    on their device: no host sync."""
    lengths = torch.cat([cu_seqlens.diff(), cu_seqlens.new_full((1,), -1)])  # the mark's -1 sorts after every length
    return torch.argsort(lengths, descending=True, stable=True).to(torch.int32)


def build_context(doc_ids: torch.Tensor, positions: torch.Tensor | None = None, cu_seqlens: torch.Tensor | None = None,
                  *, block_mask: bool = False) -> PackedContext:  # fmt: skip
    """The context of one batch, validated once: positions and cu_seqlens are derived from doc_ids when not
    given, and checked against them when given. block_mask=True also builds the flex block mask."""
    if torch.compiler.is_compiling():
        raise RuntimeError("build_context runs once per batch, outside the compiled region")
    if not isinstance(doc_ids, torch.Tensor) or doc_ids.dim() != 2:
        raise ValueError(f"doc_ids must be a [B,T] tensor, got {getattr(doc_ids, 'shape', type(doc_ids))}")
    if doc_ids.dtype not in ID_DTYPES:
        raise ValueError(f"doc_ids dtype must be int32 or int64, got {doc_ids.dtype}")
    # checked before first use: a list would otherwise fail on .contiguous() with an AttributeError, unnamed
    for name, given in (("positions", positions), ("cu_seqlens", cu_seqlens)):
        if given is not None and not isinstance(given, torch.Tensor):
            raise ValueError(f"build_context: {name} must be a torch.Tensor or None, got {type(given).__name__}")
    positions = positions_from_doc_ids(doc_ids) if positions is None else positions
    # contiguous: kernels index cu_seqlens by pointer arithmetic
    cu_seqlens = cu_seqlens_from_doc_ids(doc_ids) if cu_seqlens is None else cu_seqlens.contiguous()
    validate_packed_layout(doc_ids, positions, cu_seqlens)
    starts = doc_starts(doc_ids)
    host = cu_seqlens.cpu()
    longest_first = documents_longest_first(cu_seqlens)
    # the document count changes every batch: one compiled graph for all of them, not one per count
    for per_document in (cu_seqlens, host, longest_first):  # PER_DOCUMENT_FIELDS
        torch._dynamo.maybe_mark_dynamic(per_document, 0)
    return PackedContext(
        doc_ids=doc_ids.to(torch.int64),
        positions=positions.to(torch.int64),
        starts=starts,
        cu_seqlens=cu_seqlens,
        cu_seqlens_host=host,
        seq_index=sequence_index(starts),
        longest_first=longest_first,
        max_seqlen=int((host[1:] - host[:-1]).max()),
        block_mask=doc_causal_block_mask(doc_ids) if block_mask else None,
    )
