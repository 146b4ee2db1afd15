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

_INT_DTYPES = (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)
_ID_DTYPES = (torch.int32, torch.int64)


def _first_true(mask: torch.Tensor) -> tuple[int, int]:
    """(row, offset) of the first True in a [B,T'] mask."""
    flat = int(mask.reshape(-1).nonzero()[0, 0])
    return flat // mask.shape[1], flat % mask.shape[1]


def doc_starts(doc_ids: torch.Tensor) -> torch.Tensor:
    """Bool [B,T]: True at every document start (offset 0 of each row included)."""
    starts = torch.ones_like(doc_ids, dtype=torch.bool)
    starts[:, 1:] = doc_ids[:, 1:] != doc_ids[:, :-1]
    return starts


def positions_from_doc_ids(doc_ids: torch.Tensor) -> torch.Tensor:
    """Offset of each token inside its document."""
    B, T = doc_ids.shape
    idx = torch.arange(T, device=doc_ids.device).expand(B, T)
    last_start = torch.where(doc_starts(doc_ids), idx, torch.zeros_like(idx)).cummax(dim=1).values
    return (idx - last_start).to(torch.int64)


def cu_seqlens_from_doc_ids(doc_ids: torch.Tensor) -> torch.Tensor:
    """Flattened varlen boundaries (flash-attention convention), int32."""
    B, T = doc_ids.shape
    starts = doc_starts(doc_ids).reshape(-1).nonzero().reshape(-1)
    end = torch.tensor([B * T], device=doc_ids.device)
    return torch.cat([starts, end]).to(torch.int32)


def validate_packed(
    tokens: torch.Tensor,
    doc_ids: torch.Tensor,
    positions: torch.Tensor,
    cu_seqlens: torch.Tensor,
) -> None:
    """Raise ValueError naming the field, row and offset of the first contract violation."""
    for name, t in (("tokens", tokens), ("doc_ids", doc_ids), ("positions", positions), ("cu_seqlens", cu_seqlens)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if tokens.dim() != 2:
        raise ValueError(f"tokens must be [B,T], got shape {tuple(tokens.shape)}")
    B, T = tokens.shape
    if B == 0 or T == 0:
        raise ValueError(f"tokens must be non-empty, got shape {tuple(tokens.shape)}")
    if tokens.dtype not in _INT_DTYPES:
        raise ValueError(f"tokens dtype must be an integer type, got {tokens.dtype}")
    for name, t in (("doc_ids", doc_ids), ("positions", positions)):
        if t.shape != tokens.shape:
            raise ValueError(f"{name} shape {tuple(t.shape)} does not match tokens shape {tuple(tokens.shape)}")
        if t.dtype not in _ID_DTYPES:
            raise ValueError(f"{name} dtype must be int32 or int64, got {t.dtype}")
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise ValueError(f"cu_seqlens must be 1-D with at least 2 entries, got shape {tuple(cu_seqlens.shape)}")
    if cu_seqlens.dtype != torch.int32:
        raise ValueError(f"cu_seqlens dtype must be int32, got {cu_seqlens.dtype}")
    devices = {t.device for t in (tokens, doc_ids, positions, cu_seqlens)}
    if len(devices) != 1:
        raise ValueError(f"tokens, doc_ids, positions and cu_seqlens must share one device, got {sorted(map(str, devices))}")

    if T > 1:
        backwards = doc_ids[:, 1:] < doc_ids[:, :-1]
        if backwards.any():
            r, t = _first_true(backwards)
            raise ValueError(
                f"doc_ids go backwards at row {r}, offset {t + 1}: "
                f"{int(doc_ids[r, t])} -> {int(doc_ids[r, t + 1])}"
            )

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

    total = B * T
    cu = cu_seqlens.to(torch.int64)
    if int(cu[0]) != 0:
        raise ValueError(f"cu_seqlens must start at 0, got {int(cu[0])}")
    if int(cu[-1]) != total:
        last = min(int(cu[-1]), total)
        raise ValueError(
            f"cu_seqlens do not cover T: they end at {int(cu[-1])} but the batch holds B*T = {B}*{T} = {total} "
            f"tokens (row {last // T}, offset {last % T} onward is uncovered)"
            if int(cu[-1]) < total
            else f"cu_seqlens do not cover T: they end at {int(cu[-1])}, past B*T = {B}*{T} = {total}"
        )
    steps = cu[1:] - cu[:-1]
    if (steps <= 0).any():
        i = int((steps <= 0).nonzero()[0, 0])
        at = int(cu[i])
        raise ValueError(
            f"cu_seqlens must increase strictly: entries {i} and {i + 1} are {int(cu[i])}, {int(cu[i + 1])} "
            f"(row {at // T}, offset {at % T})"
        )
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
        if doc_ids.dtype not in _ID_DTYPES:
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
