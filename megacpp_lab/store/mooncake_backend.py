"""``MooncakeBackend``: Engram tables in a Mooncake store behind TableStore's backend contract. It only moves
bytes; the layout (a head's table the way Mooncake's EngramStore lays it out, then a 24-byte trailer), the
reads and the measured Mooncake behaviour it turns into errors are in megacpp_lab.store.mooncake's docstring.
"""

from __future__ import annotations

import socket
import struct
import threading
import time
import urllib.parse
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from megacpp_lab.nn.table_store import TableBackend
from megacpp_lab.store.mooncake import (LEASE_EXPIRED, OBJECT_HAS_LEASE, OBJECT_NOT_FOUND, P2P_METADATA, MooncakeConfig,
                                        MooncakeError, MooncakeLeaseError, error_label, host_port, require_mooncake,
                                        url_host_port)  # fmt: skip
from megacpp_lab.store.mooncake_plan import ReadPlan, plan_reads

__all__ = ["MooncakeBackend"]

_TRAILER = struct.Struct("<8sqq")  # magic, rows N, width D: after the rows, so row offsets match EngramStore's
_MAGIC = b"MCLENGR1"
_FLOAT_BYTES = 4


def _probe(host: str, port: int, what: str, fix: str, timeout_s: float) -> None:
    try:
        socket.create_connection((host, port), timeout=timeout_s).close()
    except OSError as exc:
        raise ConnectionError(
            f"{what} at {host}:{port} is not reachable ({exc}); {fix}. (Mooncake's own setup() would retry "
            "for about 90 s before failing.)"
        ) from exc


class _Registered:
    """A numpy byte buffer registered with the client for direct transfers (grown, never shrunk)."""

    def __init__(self, store: Any) -> None:
        self._store = store
        self.array: np.ndarray | None = None

    def get(self, nbytes: int) -> np.ndarray:
        if self.array is None or self.array.nbytes < nbytes:
            self.release()
            array = np.empty(max(nbytes, 1 << 16), dtype=np.uint8)
            rc = self._store.register_buffer(array.ctypes.data, array.nbytes)
            if rc != 0:
                raise MooncakeError(f"register_buffer of {array.nbytes} bytes failed: {error_label(rc)}", rc)
            self.array = array
        return self.array

    def release(self) -> None:
        if self.array is not None:
            self._store.unregister_buffer(self.array.ctypes.data)
            self.array = None


class MooncakeBackend(TableBackend):
    """Tables in a Mooncake store, one key per head (EngramStore's layout plus a shape trailer).

    Joins the store as one Mooncake client (``MooncakeDistributedStore.setup``) that lends
    ``segment_bytes`` of its memory to the store: tables live in some client's segment, and vanish with it,
    so keep the writing backend open while others read. Close it (or use it as a context manager) when
    done; closing takes 1-2 s. Returns CPU tensors. Not meant for concurrent use from several threads
    (one lock serialises reads into the staging buffer).
    """

    device = torch.device("cpu")

    def __init__(self, config: MooncakeConfig) -> None:
        if not isinstance(config, MooncakeConfig):
            raise TypeError(f"config must be a MooncakeConfig, got {type(config).__name__}")
        module = require_mooncake()
        self.config = config
        host, port = host_port(config.master_address, "master_address")
        fix = "start one (megacpp_lab.store.mooncake_master.MooncakeMaster) or fix MooncakeConfig"
        _probe(host, port, "the Mooncake master", f"{fix}.master_address", config.connect_timeout_s)
        if config.metadata_server != P2P_METADATA:
            host, port = url_host_port(config.metadata_server, "metadata_server")
            _probe(host, port, "the Mooncake metadata server", f"{fix}.metadata_server", config.connect_timeout_s)
        self._store = module.MooncakeDistributedStore()
        rc = self._store.setup(config.local_hostname, config.metadata_server, config.segment_bytes,
                               config.local_buffer_bytes, config.protocol, "", config.master_address)  # fmt: skip
        if rc != 0:
            raise MooncakeError(f"MooncakeDistributedStore.setup with {config} failed: {error_label(rc)}", rc)
        self._lock = threading.Lock()
        self._staging = _Registered(self._store)
        self._trailer = _Registered(self._store)
        self._closed = False

    # -- lifecycle

    def close(self) -> None:
        """Release the buffers and leave the store (the tables in this client's segment go with it)."""
        if self._closed:
            return
        self._closed = True
        with self._lock:
            self._staging.release()
            self._trailer.release()
        self._store.close()

    def __enter__(self) -> MooncakeBackend:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _client(self) -> Any:
        if self._closed:
            raise RuntimeError("this MooncakeBackend is closed")
        return self._store

    # -- TableBackend

    def exists(self, key: str) -> bool:
        rc = self._client().is_exist(key)
        if rc < 0:
            raise MooncakeError(f"is_exist({key!r}) failed: {error_label(rc)}", rc)
        return rc == 1

    def put(self, key: str, table: torch.Tensor) -> None:
        if not isinstance(table, torch.Tensor) or table.dim() != 2 or 0 in table.shape:
            raise ValueError(f"table for {key!r} must be a non-empty 2-D tensor, got "
                             f"{list(table.shape) if isinstance(table, torch.Tensor) else type(table).__name__}")  # fmt: skip
        store = self._client()
        if self.exists(key):
            # Mooncake's put of an existing key returns 0 and keeps the old value: refuse it here
            raise KeyError(f"key {key!r} already exists; delete it before putting a new table")
        rows = np.ascontiguousarray(table.detach().to("cpu", torch.float32).numpy())
        trailer = np.frombuffer(_TRAILER.pack(_MAGIC, *rows.shape), dtype=np.uint8).copy()
        # batch_put_from_multi_buffers sends the caller's memory as is (registered, no staging copy), so a
        # table may be larger than local_buffer_bytes; put/put_parts copy through that buffer first.
        registered = []
        try:
            for part in (rows, trailer):
                rc = store.register_buffer(part.ctypes.data, part.nbytes)
                if rc != 0:
                    raise MooncakeError(f"register_buffer for {key!r} failed: {error_label(rc)}", rc)
                registered.append(part)
            (rc,) = store.batch_put_from_multi_buffers(
                [key], [[rows.ctypes.data, trailer.ctypes.data]], [[rows.nbytes, trailer.nbytes]]
            )
        finally:
            for part in registered:
                store.unregister_buffer(part.ctypes.data)
        if rc != 0:
            store.remove(key, True)  # best effort: leave no half-written key behind
            hint = " (no segment has room: the store holds what its clients lend, segment_bytes each)" if rc == -200 else ""
            raise MooncakeError(f"put of {key!r} ({rows.nbytes} bytes) failed: {error_label(rc)}{hint}", rc)

    def _size(self, key: str) -> int:
        size = self._client().get_size(key)
        if size == OBJECT_NOT_FOUND:
            raise KeyError(f"no table stored under {key!r}")
        if size < 0:
            raise MooncakeError(f"get_size({key!r}) failed: {error_label(size)}", size)
        return int(size)

    def _read(self, key: str, buffer: np.ndarray, dst: Sequence[int], src: Sequence[int],
              sizes: Sequence[int]) -> None:  # fmt: skip
        """One get_into_ranges call; every range must come back whole."""
        start = time.perf_counter()
        (per_key,) = self._client().get_into_ranges([buffer.ctypes.data], [[key]], [[list(dst)]],
                                                    [[list(src)]], [[list(sizes)]])  # fmt: skip
        elapsed = time.perf_counter() - start
        got = np.asarray(per_key[0], dtype=np.int64)
        if np.array_equal(got, np.asarray(sizes, dtype=np.int64)):
            return
        if (got == LEASE_EXPIRED).any():
            raise MooncakeLeaseError(
                f"reading {len(sizes)} range(s) of {key!r} took {elapsed:.2f} s, longer than the master's read "
                f"lease ({self.config.lease_ttl_s:g} s, --default_kv_lease_ttl): Mooncake drops a read that "
                f"outlives its lease ({error_label(LEASE_EXPIRED)} on {int((got == LEASE_EXPIRED).sum())} range(s); "
                "Mooncake's EngramStore.lookup reports this as a bare 'lookup failed'). Raise the master's "
                "--default_kv_lease_ttl (MooncakeMaster(lease_ttl_s=...)) or look up fewer rows per call",
                LEASE_EXPIRED,
            )
        bad = int(np.flatnonzero(got != np.asarray(sizes))[0])
        code = int(got[bad])
        what = error_label(code) if code < 0 else f"{code} of {sizes[bad]} bytes"
        raise MooncakeError(f"reading range {bad} of {key!r} (offset {src[bad]}) failed: {what}", min(code, 0) or None)

    def shape(self, key: str) -> tuple[int, int]:
        size = self._size(key)
        if size < _TRAILER.size:
            raise ValueError(f"{key!r} holds {size} bytes, too few for a MooncakeBackend table")
        with self._lock:
            buffer = self._trailer.get(_TRAILER.size)
            self._read(key, buffer, [0], [size - _TRAILER.size], [_TRAILER.size])
            magic, n, d = _TRAILER.unpack(buffer[: _TRAILER.size].tobytes())
        if magic != _MAGIC:
            raise ValueError(
                f"{key!r} ({size} bytes) has no MooncakeBackend shape trailer: it was written by another writer "
                "(EngramStore.populate stores bare rows), so its row width is unknown; remove it and populate "
                "through MooncakeBackend"
            )
        if n < 1 or d < 1 or size != n * d * _FLOAT_BYTES + _TRAILER.size:
            raise ValueError(f"{key!r} is corrupt: its trailer says [{n}, {d}] but it holds {size} bytes")
        return int(n), int(d)

    @property
    def client(self) -> Any:
        """The underlying ``mooncake.store.MooncakeDistributedStore`` (for Mooncake's own APIs, e.g. EngramStore)."""
        return self._client()

    def plan(self, rows: torch.Tensor | np.ndarray, n_rows: int, width: int, *,
             rows_per_block: int | None = None) -> ReadPlan:  # fmt: skip
        """The read ``get_rows`` makes for ``rows`` of an [n_rows, width] table (this config's cost model)."""
        cfg = self.config
        ids = rows.detach().to("cpu", torch.long).numpy() if isinstance(rows, torch.Tensor) else rows
        return plan_reads(ids, n_rows, width * _FLOAT_BYTES, range_cost_s=cfg.range_cost_s,
                          bytes_per_s=cfg.bytes_per_s, max_staging_bytes=cfg.max_staging_bytes,
                          rows_per_block=rows_per_block)  # fmt: skip

    def get_rows(self, key: str, rows: torch.Tensor, *, rows_per_block: int | None = None) -> torch.Tensor:
        """Gather rows through one planned block read (``plan_reads``); ``rows_per_block`` forces the block size."""
        ids = rows.detach().to("cpu", torch.long).reshape(-1).numpy()
        n, d = self.shape(key)
        if ids.size == 0:
            return torch.empty(0, d)
        lo, hi = int(ids.min()), int(ids.max())
        if lo < 0 or hi >= n:
            raise IndexError(f"row ids for {key!r} must be in [0, {n}), got min {lo}, max {hi}")
        row_bytes = d * _FLOAT_BYTES
        plan = self.plan(ids, n, d, rows_per_block=rows_per_block)
        with self._lock:
            buffer = self._staging.get(plan.staged_rows * row_bytes)
            self._read(key, buffer, plan.dst_offsets.tolist(), plan.src_offsets.tolist(), plan.sizes.tolist())
            staged = buffer[: plan.staged_rows * row_bytes].view(np.float32).reshape(plan.staged_rows, d)
            out = np.take(staged, plan.index, axis=0)  # a fresh array: the staging buffer is reused
        return torch.from_numpy(out)

    def delete(self, key: str) -> bool:
        rc = self._client().remove(key, self.config.force_remove)
        if rc == 0:
            return True
        if rc == OBJECT_NOT_FOUND:
            return False
        if rc == OBJECT_HAS_LEASE:
            raise MooncakeLeaseError(
                f"remove of {key!r} refused: {error_label(rc)}. A lookup, exists() or shape() of it less than the "
                f"master's lease ago ({self.config.lease_ttl_s:g} s, --default_kv_lease_ttl) holds a read lease; "
                "retry after it runs out, or use MooncakeConfig(force_remove=True) to skip the check "
                "(Mooncake's remove(force=True))",
                rc,
            )
        raise MooncakeError(f"remove of {key!r} failed: {error_label(rc)}", rc)

    def keys(self) -> list[str]:
        if self.config.admin_url is None:
            raise RuntimeError(
                "keys() lists the store through the master's HTTP admin server (/get_all_keys): "
                "set MooncakeConfig.admin_url (MooncakeMaster.config() does)"
            )
        url = self.config.admin_url.rstrip("/") + "/get_all_keys"
        try:
            with urllib.request.urlopen(url, timeout=self.config.connect_timeout_s) as response:
                body = response.read().decode()
        except OSError as exc:
            raise ConnectionError(f"listing keys through {url} failed: {exc}") from exc
        return [line for line in body.splitlines() if line]

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        return f"MooncakeBackend(master={self.config.master_address!r}, {state})"
