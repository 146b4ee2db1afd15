"""Packed rows: several documents back to back in fixed-length rows, validated fail-closed.

Contract (see docs/design.md, "Packed rows"):
  tokens     [B,T] integer
  doc_ids    [B,T] int32/int64, non-decreasing along a row, changes at every boundary
  positions  [B,T] integer, 0 at each document start, +1 inside a document
  cu_seqlens [S+1] int32 over the flattened B*T tokens: 0, every document start, B*T
Row starts are always document starts, so a document never spans two rows.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from megacpp_lab.varlen import (
    ID_DTYPES,
    cu_seqlens_from_doc_ids,
    doc_starts,
    positions_from_doc_ids,
    validate_packed_layout,
)

_INT_DTYPES = (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)


def validate_packed(
    tokens: torch.Tensor,
    doc_ids: torch.Tensor,
    positions: torch.Tensor,
    cu_seqlens: torch.Tensor,
) -> None:
    """Raise ValueError naming the field, row and offset of the first contract violation: the tokens
    here, the layout (doc_ids, positions, cu_seqlens) in varlen.validate_packed_layout."""
    if not isinstance(tokens, torch.Tensor):
        raise ValueError(f"tokens must be a torch.Tensor, got {type(tokens).__name__}")
    if tokens.dim() != 2:
        raise ValueError(f"tokens must be [B,T], got shape {tuple(tokens.shape)}")
    if tokens.shape[0] == 0 or tokens.shape[1] == 0:
        raise ValueError(f"tokens must be non-empty, got shape {tuple(tokens.shape)}")
    if tokens.dtype not in _INT_DTYPES:
        raise ValueError(f"tokens dtype must be an integer type, got {tokens.dtype}")
    for name, t in (("doc_ids", doc_ids), ("positions", positions)):
        if isinstance(t, torch.Tensor) and t.shape != tokens.shape:
            raise ValueError(f"{name} shape {tuple(t.shape)} does not match tokens shape {tuple(tokens.shape)}")
    if isinstance(cu_seqlens, torch.Tensor) and cu_seqlens.device != tokens.device:
        raise ValueError(f"tokens, doc_ids, positions and cu_seqlens must share one device, got "
                         f"{sorted(map(str, {tokens.device, cu_seqlens.device}))}")  # fmt: skip
    validate_packed_layout(doc_ids, positions, cu_seqlens)


@dataclass(frozen=True)
class PackedBatch:
    """A validated batch of packed rows. Construction fails closed on any contract violation."""

    tokens: torch.Tensor
    doc_ids: torch.Tensor
    positions: torch.Tensor
    cu_seqlens: torch.Tensor

    def __post_init__(self) -> None:
        validate_packed(self.tokens, self.doc_ids, self.positions, self.cu_seqlens)

    @classmethod
    def from_doc_ids(cls, tokens: torch.Tensor, doc_ids: torch.Tensor) -> PackedBatch:
        """Derive positions and cu_seqlens from doc_ids (validated like any other batch)."""
        if not isinstance(doc_ids, torch.Tensor) or doc_ids.dim() != 2:
            raise ValueError(f"doc_ids must be a [B,T] tensor, got {getattr(doc_ids, 'shape', type(doc_ids))}")
        if doc_ids.dtype not in ID_DTYPES:
            raise ValueError(f"doc_ids dtype must be int32 or int64, got {doc_ids.dtype}")
        return cls(tokens, doc_ids, positions_from_doc_ids(doc_ids), cu_seqlens_from_doc_ids(doc_ids))

    @property
    def batch_size(self) -> int:
        return self.tokens.shape[0]

    @property
    def seq_len(self) -> int:
        return self.tokens.shape[1]

    @property
    def num_docs(self) -> int:
        return self.cu_seqlens.numel() - 1

    @property
    def seqlens(self) -> torch.Tensor:
        return self.cu_seqlens[1:] - self.cu_seqlens[:-1]

    @property
    def max_seqlen(self) -> int:
        return int(self.seqlens.max())

    def to(self, device: torch.device | str) -> PackedBatch:
        return PackedBatch(*(t.to(device) for t in (self.tokens, self.doc_ids, self.positions, self.cu_seqlens)))

    def rows(self, index: slice | Sequence[int]) -> PackedBatch:
        """A sub-batch of rows, with cu_seqlens rebuilt for it."""
        tokens, doc_ids = self.tokens[index], self.doc_ids[index]
        if tokens.dim() == 1:
            tokens, doc_ids = tokens[None], doc_ids[None]
        return PackedBatch.from_doc_ids(tokens, doc_ids)

    def segments(self, row: int) -> list[tuple[int, int, int]]:
        """(doc_id, start, end) of every document in a row, end exclusive."""
        T = self.seq_len
        starts = doc_starts(self.doc_ids[row : row + 1])[0].nonzero().reshape(-1).tolist()
        ends = starts[1:] + [T]
        return [(int(self.doc_ids[row, s]), s, e) for s, e in zip(starts, ends)]


@dataclass(frozen=True)
class PackedRows:
    """A PackedBatch plus where each segment came from.

    segments is int64 [S, 5]: row, start, length, source document index (-1 for padding),
    token offset inside that source document.
    """

    batch: PackedBatch
    segments: torch.Tensor

    def segment_at(self, row: int, offset: int) -> dict[str, int]:
        seg = self.segments
        hit = ((seg[:, 0] == row) & (seg[:, 1] <= offset) & (offset < seg[:, 1] + seg[:, 2])).nonzero()
        if hit.numel() == 0:
            raise ValueError(f"no segment covers row {row}, offset {offset}")
        r, start, length, source, source_offset = seg[int(hit[0, 0])].tolist()
        return {"row": r, "start": start, "length": length, "source": source, "source_offset": source_offset}


def pack_documents(
    documents: Sequence[Sequence[int] | np.ndarray | torch.Tensor],
    seq_len: int,
    *,
    pad_id: int,
    max_rows: int | None = None,
    max_doc_tokens: int | None = None,
) -> PackedRows:
    """Stream tokenized documents into rows of seq_len.

    A document longer than max_doc_tokens is cut into pieces of that size, and one that runs
    past the end of a row continues in the next row; every piece starts a new segment with
    positions reset. The last row is filled with pad_id as a segment of its own. With
    max_rows, packing stops once that many rows are full.
    """
    if seq_len < 1:
        raise ValueError(f"seq_len must be >= 1, got {seq_len}")
    if max_doc_tokens is not None and max_doc_tokens < 1:
        raise ValueError(f"max_doc_tokens must be >= 1 or None, got {max_doc_tokens}")
    if max_rows is not None and max_rows < 1:
        raise ValueError(f"max_rows must be >= 1 or None, got {max_rows}")
    arrays = [np.asarray(d.cpu() if isinstance(d, torch.Tensor) else d, dtype=np.int64).reshape(-1) for d in documents]
    lengths = np.array([a.size for a in arrays], dtype=np.int64)
    if lengths.size == 0 or lengths.sum() == 0:
        raise ValueError("pack_documents needs at least one non-empty document")
    empty = np.flatnonzero(lengths == 0)
    if empty.size:
        raise ValueError(f"document {int(empty[0])} is empty")

    stream = np.concatenate(arrays)
    doc_start = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    n_rows = -(-stream.size // seq_len)
    if max_rows is not None:
        n_rows = min(n_rows, max_rows)
    total = n_rows * seq_len
    used = min(stream.size, total)

    is_start = np.zeros(total, dtype=bool)
    is_start[::seq_len] = True
    in_range = doc_start[doc_start < used]
    is_start[in_range] = True
    if max_doc_tokens is not None:
        for s, n in zip(doc_start, lengths):
            cuts = np.arange(s + max_doc_tokens, s + n, max_doc_tokens)
            is_start[cuts[cuts < used]] = True
    tokens = np.full(total, pad_id, dtype=np.int64)
    tokens[:used] = stream[:used]
    if used < total:
        is_start[used] = True  # padding is a segment of its own

    starts2d = torch.from_numpy(is_start.reshape(n_rows, seq_len))
    doc_ids = (starts2d.to(torch.int64).cumsum(dim=1) - 1).to(torch.int64)
    batch = PackedBatch.from_doc_ids(torch.from_numpy(tokens.reshape(n_rows, seq_len)), doc_ids)

    flat_starts = np.flatnonzero(is_start)
    seg_len = np.diff(np.append(flat_starts, total))
    source = np.searchsorted(doc_start, flat_starts, side="right") - 1
    source_offset = flat_starts - doc_start[source]
    padding = flat_starts >= used
    source[padding] = -1
    source_offset[padding] = 0
    segments = torch.from_numpy(
        np.stack([flat_starts // seq_len, flat_starts % seq_len, seg_len, source, source_offset], axis=1)
    ).to(torch.int64)
    return PackedRows(batch=batch, segments=segments)


def boundary_windows(batch: PackedBatch, rows: int, length: int, *, lead: int | None = None) -> PackedBatch:
    """`rows` windows of `length` tokens cut from packed rows, each with a document boundary
    `lead` tokens in (default length // 3): small real inputs for leak tests and plots."""
    lead = length // 3 if lead is None else lead
    if not 0 < lead < length <= batch.seq_len:
        raise ValueError(f"need 0 < lead ({lead}) < length ({length}) <= seq_len ({batch.seq_len})")
    picked: list[tuple[int, int]] = []
    for r in range(batch.batch_size):
        starts = [s for _, s, _ in batch.segments(r) if lead <= s <= batch.seq_len - (length - lead)]
        if starts:
            picked.append((r, starts[0] - lead))
        if len(picked) == rows:
            break
    if len(picked) < rows:
        raise ValueError(f"only {len(picked)} of the {batch.batch_size} rows have a boundary that fits a window")
    tokens = torch.stack([batch.tokens[r, lo : lo + length] for r, lo in picked])
    doc_ids = torch.stack([batch.doc_ids[r, lo : lo + length] for r, lo in picked])
    return PackedBatch.from_doc_ids(tokens, doc_ids)


def next_token_targets(tokens: torch.Tensor, doc_ids: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    """[B,T] int64 targets for next-token prediction on packed rows: tokens[t+1] where t+1 is in t's document,
    ignore_index at every document's last token (its next token belongs to another document, or to no one)."""
    if tokens.shape != doc_ids.shape or tokens.dim() != 2:
        raise ValueError(f"tokens and doc_ids must both be [B,T], got {tuple(tokens.shape)} and {tuple(doc_ids.shape)}")
    targets = torch.full_like(tokens, ignore_index, dtype=torch.int64)
    same_doc = doc_ids[:, 1:] == doc_ids[:, :-1]
    targets[:, :-1] = torch.where(same_doc, tokens[:, 1:].long(), ignore_index)
    return targets
