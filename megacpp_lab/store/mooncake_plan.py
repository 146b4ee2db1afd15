"""How a lookup reads its rows from a Mooncake store: ``plan_reads`` prices a read as ranges * range_cost_s +
bytes / bytes_per_s and picks, per head and lookup, the cheapest block size (see megacpp_lab.store.mooncake's
docstring for the measurements behind it). Pure numpy: it needs no Mooncake.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["ReadPlan", "plan_reads"]


@dataclass(frozen=True, eq=False)
class ReadPlan:
    """Byte ranges of one table to stage, and where each requested row lands in the staging buffer."""

    rows_per_block: int
    src_offsets: np.ndarray  # [ranges] byte offsets into the table
    sizes: np.ndarray  # [ranges] bytes
    dst_offsets: np.ndarray  # [ranges] byte offsets into the staging buffer
    staged_rows: int  # rows the staging buffer holds
    index: np.ndarray  # [n] staging row of each requested row
    estimated_s: float  # the cost model's estimate

    @property
    def num_ranges(self) -> int:
        return int(self.sizes.size)


def _staged_rows(blocks: np.ndarray, rows_per_block: int, n_rows: int) -> int:
    # only the table's last block can be short
    return int(blocks.size) * rows_per_block - max(0, (int(blocks[-1]) + 1) * rows_per_block - n_rows)


def plan_reads(rows: np.ndarray, n_rows: int, row_bytes: int, *, range_cost_s: float, bytes_per_s: float,
               max_staging_bytes: int, rows_per_block: int | None = None) -> ReadPlan:  # fmt: skip
    """The cheapest block read of ``rows`` (ids in [0, n_rows)) by ``ranges * range_cost_s + bytes /
    bytes_per_s``, over block sizes 1, 2, 4, ... rows up to the whole table; a block size whose staged
    bytes exceed ``max_staging_bytes`` is skipped (single rows never are: they stage at most the output).
    ``rows_per_block`` forces a block size instead (1: one range per distinct row; >= n_rows: the table)."""
    rows = np.asarray(rows, dtype=np.int64).reshape(-1)
    if rows.size == 0:
        raise ValueError("plan_reads needs at least one row")
    if n_rows < 1 or row_bytes < 1:
        raise ValueError(f"plan_reads needs n_rows >= 1 and row_bytes >= 1, got {n_rows} and {row_bytes}")
    if rows.min() < 0 or rows.max() >= n_rows:
        raise IndexError(f"plan_reads: row ids must be in [0, {n_rows}), got min {rows.min()}, max {rows.max()}")
    if rows_per_block is not None and (not isinstance(rows_per_block, int) or rows_per_block < 1):
        raise ValueError(f"rows_per_block must be an int >= 1 or None, got {rows_per_block!r}")

    def cost_of(blocks: np.ndarray, rows_per_block: int) -> float:
        ranges = 1 + int(np.count_nonzero(np.diff(blocks) != 1))  # one range per run of adjacent blocks
        return ranges * range_cost_s + _staged_rows(blocks, rows_per_block, n_rows) * row_bytes / bytes_per_s

    def touched(rows_per_block: int) -> np.ndarray:
        """Sorted ids of the blocks the rows fall in."""
        blocks = rows // rows_per_block
        n_blocks = -(-n_rows // rows_per_block)
        if n_blocks <= 8 * rows.size:  # a mask beats sorting the ids when the table is not much larger
            mask = np.zeros(n_blocks, dtype=bool)
            mask[blocks] = True
            return np.flatnonzero(mask)
        return np.unique(blocks)

    if rows_per_block is not None:
        blocks = touched(rows_per_block)
        best = (cost_of(blocks, rows_per_block), rows_per_block, blocks)
    else:
        blocks = touched(1)
        best = (cost_of(blocks, 1), 1, blocks)
        size = 1
        # once the touched blocks form one run, coarser blocks only add bytes
        while size < n_rows and np.any(np.diff(blocks) != 1):
            size *= 2
            halved = blocks // 2  # floor(floor(r / b) / 2) == floor(r / 2b): coarser blocks from the finer ones
            blocks = halved[np.concatenate(([True], halved[1:] != halved[:-1]))]
            if _staged_rows(blocks, size, n_rows) * row_bytes <= max_staging_bytes:
                best = min(best, (cost_of(blocks, size), size, blocks), key=lambda b: b[0])
    cost, rows_per_block, blocks = best
    breaks = np.flatnonzero(np.diff(blocks) != 1) + 1
    starts = np.concatenate(([0], breaks))
    ends = np.concatenate((breaks, [blocks.size]))
    src = blocks[starts] * rows_per_block * row_bytes
    end_rows = np.minimum((blocks[ends - 1] + 1) * rows_per_block, n_rows)
    n_blocks = -(-n_rows // rows_per_block)
    if n_blocks <= 8 * rows.size:  # staging position of every block through a lookup table: no search
        position = np.zeros(n_blocks, dtype=np.int64)
        position[blocks] = np.arange(blocks.size)
        index = position[rows // rows_per_block] * rows_per_block + rows % rows_per_block
    else:
        index = np.searchsorted(blocks, rows // rows_per_block) * rows_per_block + rows % rows_per_block
    return ReadPlan(
        rows_per_block=rows_per_block,
        src_offsets=src,
        sizes=end_rows * row_bytes - src,
        dst_offsets=starts * rows_per_block * row_bytes,
        staged_rows=_staged_rows(blocks, rows_per_block, n_rows),
        index=index,
        estimated_s=float(cost),
    )
