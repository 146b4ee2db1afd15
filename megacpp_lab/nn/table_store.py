"""Per-layer store for the hashed n-gram (Engram) embedding tables.

Engram memory hashes every 2..N-gram with several hash heads; head h indexes its own
prime-sized table of N_h rows of width D. This module owns only those tables. It knows
nothing about tokenization, n-gram extraction or hashing: callers hash on their side and
pass precomputed row ids [B, L, H]; the store validates them and returns [B, L, H, D].

The contract follows Mooncake's EngramStore so that a distributed key-value store can back
it later without touching callers:

* one float32 table per head, stored under the key ``engram:l{layer_id}:h{head}``;
* ``populate`` is create-only: all checks happen before any write, an existing key is
  refused (call ``remove_from_store`` first to reuse a layer id), and a failed upload
  removes the keys that call wrote before the error propagates;
* ``lookup`` bounds-checks every id per head (``0 <= id < N_h``) before any gather.

Two layers split the work: ``TableBackend`` is the handful of raw key-value primitives a
backend implements (``InProcessBackend`` is the embedded default, a dict of tensors), and
``TableStore`` holds every rule above, so a new backend gets the validation for free.
"""

from __future__ import annotations

import abc
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from megacpp_lab.checks import is_int
from megacpp_lab.nn.config_builder import build_config

__all__ = ["TableBackend", "InProcessBackend", "TableStoreConfig", "TableStore"]


class TableBackend(abc.ABC):
    """Raw key -> 2-D float table primitives; the only part a distributed store implements.

    Backends do no Engram-specific validation: ``TableStore`` checks shapes, ids and
    create-only semantics before it calls them.
    """

    @abc.abstractmethod
    def exists(self, key: str) -> bool:
        """True if a table is stored under ``key``."""

    @abc.abstractmethod
    def put(self, key: str, table: torch.Tensor) -> None:
        """Store a float32 copy of the 2-D ``table``; raise if ``key`` exists; leave no key behind on failure."""

    @abc.abstractmethod
    def get_rows(self, key: str, rows: torch.Tensor) -> torch.Tensor:
        """Gather rows: int64 ``rows`` [n] on any device -> [n, D] on the backend's device; KeyError if absent."""

    @abc.abstractmethod
    def delete(self, key: str) -> bool:
        """Remove ``key``; True if something was removed, False if it was absent."""

    @abc.abstractmethod
    def shape(self, key: str) -> tuple[int, int]:
        """(N, D) of the table under ``key``; KeyError if absent."""

    @abc.abstractmethod
    def keys(self) -> list[str]:
        """Every key currently stored, in no particular order."""


class InProcessBackend(TableBackend):
    """Embedded default backend: a per-instance dict of contiguous float32 tensors on ``device``."""

    def __init__(self, device: str | torch.device = "cpu") -> None:
        self.device = torch.device(device)
        self._tables: dict[str, torch.Tensor] = {}

    def exists(self, key: str) -> bool:
        return key in self._tables

    def put(self, key: str, table: torch.Tensor) -> None:
        if key in self._tables:
            raise KeyError(f"key {key!r} already exists; delete it before putting a new table")
        if not isinstance(table, torch.Tensor) or table.dim() != 2:
            raise ValueError(f"table for {key!r} must be a 2-D tensor")
        # Own copy: later in-place edits of the caller's tensor must not reach the store.
        self._tables[key] = table.detach().to(self.device, torch.float32).contiguous().clone()

    def get_rows(self, key: str, rows: torch.Tensor) -> torch.Tensor:
        try:
            table = self._tables[key]
        except KeyError:
            raise KeyError(f"no table stored under {key!r}") from None
        return table.index_select(0, rows.to(self.device, torch.long))

    def delete(self, key: str) -> bool:
        return self._tables.pop(key, None) is not None

    def shape(self, key: str) -> tuple[int, int]:
        try:
            n, d = self._tables[key].shape
        except KeyError:
            raise KeyError(f"no table stored under {key!r}") from None
        return int(n), int(d)

    def keys(self) -> list[str]:
        return list(self._tables)

    def __repr__(self) -> str:
        return f"InProcessBackend(device={str(self.device)!r}, keys={len(self._tables)})"




@dataclass(frozen=True)
class TableStoreConfig:
    """Physical layout of one layer: rows per head table (N_0..N_{H-1}) and row width D."""

    table_vocab_sizes: tuple[int, ...]
    embedding_dim: int

    def __post_init__(self) -> None:
        sizes = self.table_vocab_sizes
        if isinstance(sizes, (str, bytes)) or not isinstance(sizes, Sequence):
            raise ValueError(
                f"table_vocab_sizes must be a sequence of positive ints, got {type(sizes).__name__}: {sizes!r}"
            )
        if len(sizes) == 0:
            raise ValueError("table_vocab_sizes must be non-empty (one size per hash head), got []")
        for i, n in enumerate(sizes):
            if not is_int(n) or n <= 0:
                raise ValueError(f"table_vocab_sizes[{i}] must be a positive int, got {n!r}")
        if not is_int(self.embedding_dim) or self.embedding_dim <= 0:
            raise ValueError(f"embedding_dim must be a positive int, got {self.embedding_dim!r}")
        object.__setattr__(self, "table_vocab_sizes", tuple(int(n) for n in sizes))
        object.__setattr__(self, "embedding_dim", int(self.embedding_dim))

    @classmethod
    def build(cls, source: Any = None, **overrides: Any) -> TableStoreConfig:
        """The one builder: fields from a source object (these names, or an NgramHashConfig's table_sizes /
        head_dim) and keyword overrides."""
        aliases = {"table_vocab_sizes": ("table_vocab_sizes", "table_sizes"), "embedding_dim": ("embedding_dim", "head_dim")}
        return build_config(cls, source, overrides, prefix="table_store", aliases=aliases,
                            required=("table_vocab_sizes", "embedding_dim"))  # fmt: skip

    @property
    def num_heads(self) -> int:
        return len(self.table_vocab_sizes)


class TableStore:
    """The Engram tables of one layer behind a ``TableBackend``, with Mooncake EngramStore semantics."""

    def __init__(self, layer_id: int, config: TableStoreConfig, backend: TableBackend | None = None) -> None:
        if not is_int(layer_id) or layer_id < 0:
            raise ValueError(f"layer_id must be an int >= 0, got {layer_id!r}")
        if not isinstance(config, TableStoreConfig):
            raise TypeError(f"config must be a TableStoreConfig, got {type(config).__name__}")
        if backend is not None and not isinstance(backend, TableBackend):
            raise TypeError(f"backend must be a TableBackend, got {type(backend).__name__}")
        self.layer_id = int(layer_id)
        self.config = config
        self.backend: TableBackend = backend if backend is not None else InProcessBackend()

    # ----------------------------------------------------------------- metadata

    def key(self, head: int) -> str:
        """Store key of one head's table; the layer id in it keeps layers apart in a shared backend."""
        if not is_int(head) or not 0 <= head < self.get_num_heads():
            raise IndexError(f"head must be in [0, {self.get_num_heads()}), got {head!r}")
        return f"engram:l{self.layer_id}:h{int(head)}"

    def get_store_keys(self) -> list[str]:
        """All head keys of this layer, in head order."""
        return [self.key(h) for h in range(self.get_num_heads())]

    def get_table_vocab_sizes(self) -> list[int]:
        """Rows per head table, N_0..N_{H-1}."""
        return list(self.config.table_vocab_sizes)

    def get_num_heads(self) -> int:
        """Number of hash heads H (= number of tables)."""
        return self.config.num_heads

    def get_embedding_dim(self) -> int:
        """Row width D shared by every head table."""
        return self.config.embedding_dim

    def is_populated(self) -> bool:
        """True when every head key exists in the backend (a partial layer counts as not populated)."""
        return all(self.backend.exists(k) for k in self.get_store_keys())

    # ----------------------------------------------------------------- populate

    def _validate_tables(self, tables: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        tables = list(tables)
        H, D = self.get_num_heads(), self.get_embedding_dim()
        if len(tables) != H:
            raise ValueError(f"expected {H} tables (one per head), got {len(tables)}")
        for h, (t, n) in enumerate(zip(tables, self.config.table_vocab_sizes)):
            if not isinstance(t, torch.Tensor):
                raise ValueError(f"table for head {h} must be a torch.Tensor, got {type(t).__name__}")
            if not t.is_floating_point():
                raise ValueError(f"table for head {h} must have a floating dtype, got {t.dtype}")
            if tuple(t.shape) != (n, D):
                raise ValueError(
                    f"table for head {h} must have shape [{n}, {D}] (N_{h}, D), got {list(t.shape)}"
                )
        return tables

    def populate(self, tables: Sequence[torch.Tensor]) -> None:
        """Upload one [N_h, D] table per head; create-only, all-or-nothing.

        Every check (count, dtype, shape, no existing key) runs before the first write, so a
        rejected call leaves the backend untouched. If a write fails part way, the keys this
        call wrote are deleted and a RuntimeError chained to the original error is raised.
        """
        tables = self._validate_tables(tables)
        keys = self.get_store_keys()
        existing = [k for k in keys if self.backend.exists(k)]
        if existing:
            raise ValueError(
                f"populate is create-only but key(s) {existing} already exist for layer {self.layer_id}; "
                "call remove_from_store() first to reuse this layer id"
            )
        written: list[str] = []
        for h, (key, table) in enumerate(zip(keys, tables)):
            try:
                self.backend.put(key, table)
            except Exception as exc:
                self._rollback(h, key, written, exc)
            written.append(key)

    def _rollback(self, head: int, key: str, written: list[str], exc: Exception) -> None:
        # Best effort: a failing delete is collected and reported, never allowed to replace `exc`.
        failures: list[str] = []
        # the failing key too: populate checked it did not exist, and a backend may have stored
        # it before raising (a lost acknowledgement), which would block every retry
        for k in [key, *reversed(written)]:
            try:
                self.backend.delete(k)
            except Exception as del_exc:  # noqa: BLE001 - reported in the message below
                failures.append(f"{k!r}: {del_exc!r}")
        undeleted = sum(1 for f in failures if not f.startswith(repr(key) + ":"))
        msg = (
            f"populate failed at head {head} (key {key!r}): {exc!r}; "
            f"rolled back {len(written) - undeleted} of {len(written)} key(s) written by this call"
        )
        if failures:
            msg += f"; rollback incomplete, could not delete {', '.join(failures)}"
        raise RuntimeError(msg) from exc

    # ----------------------------------------------------------------- lookup

    def _as_row_ids(self, row_ids: torch.Tensor | Sequence) -> torch.Tensor:
        if not isinstance(row_ids, torch.Tensor):
            try:
                row_ids = torch.as_tensor(row_ids)
            except (ValueError, TypeError, RuntimeError) as exc:
                raise ValueError(
                    f"row_ids must be a rectangular [B, L, H] integer array; could not convert: {exc}"
                ) from exc
        H = self.get_num_heads()
        if row_ids.dim() != 3:
            raise ValueError(f"row_ids must be 3-D [B, L, H], got shape {list(row_ids.shape)}")
        if row_ids.numel() == 0:
            raise ValueError(f"row_ids must be non-empty, got shape {list(row_ids.shape)}")
        if row_ids.shape[-1] != H:
            raise ValueError(f"row_ids last dim must equal the number of heads {H}, got shape {list(row_ids.shape)}")
        dt = row_ids.dtype
        if dt == torch.bool or dt.is_floating_point or dt.is_complex:
            raise ValueError(f"row_ids must have an integer dtype, got {dt}")
        return row_ids.long()

    def _check_bounds(self, ids: torch.Tensor) -> None:
        sizes = torch.tensor(self.config.table_vocab_sizes, dtype=torch.long, device=ids.device)
        bad = (ids < 0) | (ids >= sizes)
        if bool(bad.any()):
            b, l, h = (int(i) for i in bad.nonzero()[0])
            n_h = self.config.table_vocab_sizes[h]
            raise IndexError(
                f"row id {int(ids[b, l, h])} for head {h} at position (b={b}, l={l}) is out of range: "
                f"expected 0 <= id < {n_h} ({int(bad.sum())} bad id(s) in total)"
            )

    def _require_populated(self) -> None:
        D = self.get_embedding_dim()
        for key, n in zip(self.get_store_keys(), self.config.table_vocab_sizes):
            if not self.backend.exists(key):
                raise ValueError(f"layer {self.layer_id} is not populated: missing key {key!r}; call populate() first")
            # Guards against another store with a different config having written this layer id.
            if self.backend.shape(key) != (n, D):
                raise ValueError(
                    f"table under {key!r} has shape {list(self.backend.shape(key))}, "
                    f"config expects [{n}, {D}]"
                )

    def lookup(self, row_ids: torch.Tensor | Sequence) -> torch.Tensor:
        """Gather per-head rows for precomputed ids [B, L, H] -> [B, L, H, D] on the backend's device.

        Ids may be a tensor on any device or nested lists; every id is bounds-checked per
        head before anything is gathered, so a bad hash never turns into a silent wrong row
        (or a device-side assert on CUDA).
        """
        ids = self._as_row_ids(row_ids)
        self._check_bounds(ids)
        self._require_populated()
        B, L, H = ids.shape
        D = self.get_embedding_dim()
        per_head = []
        for h in range(H):
            rows = self.backend.get_rows(self.key(h), ids[:, :, h].reshape(-1))
            if tuple(rows.shape) != (B * L, D):
                raise RuntimeError(
                    f"backend returned shape {list(rows.shape)} for head {h}, expected [{B * L}, {D}]"
                )
            per_head.append(rows)
        return torch.stack(per_head, dim=1).view(B, L, H, D)

    # ----------------------------------------------------------------- remove / read back

    def remove_from_store(self, force: bool = False) -> int:
        """Delete whatever head keys of this layer exist; return how many were removed.

        Idempotent (a second call returns 0) and works on a partially populated layer.
        Every key is attempted either way. ``force=False``: if any delete raised, a
        RuntimeError chained to the first error is raised after all attempts. ``force=True``:
        delete errors are downgraded to a RuntimeWarning and the count is returned.
        """
        removed = 0
        errors: list[tuple[str, Exception]] = []
        for key in self.get_store_keys():
            try:
                removed += bool(self.backend.delete(key))
            except Exception as exc:  # noqa: BLE001 - collected, then raised or warned below
                errors.append((key, exc))
        if errors:
            detail = "; ".join(f"{k!r}: {e!r}" for k, e in errors)
            msg = f"remove_from_store for layer {self.layer_id} removed {removed} key(s) but failed on {detail}"
            if not force:
                raise RuntimeError(msg) from errors[0][1]
            warnings.warn(msg + " (ignored: force=True)", RuntimeWarning, stacklevel=2)
        return removed

    def tables(self) -> list[torch.Tensor]:
        """Read back every head's full [N_h, D] table (for tests and export)."""
        self._require_populated()
        out = []
        for h, n in enumerate(self.config.table_vocab_sizes):
            out.append(self.backend.get_rows(self.key(h), torch.arange(n, dtype=torch.long)))
        return out

    def __repr__(self) -> str:
        return (
            f"TableStore(layer_id={self.layer_id}, heads={self.get_num_heads()}, "
            f"table_vocab_sizes={list(self.config.table_vocab_sizes)}, embedding_dim={self.get_embedding_dim()}, "
            f"backend={type(self.backend).__name__})"
        )
