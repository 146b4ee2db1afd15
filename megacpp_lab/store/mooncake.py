"""Engram tables in a Mooncake store: ``MooncakeBackend`` (a TableBackend) and ``MooncakeMaster``.

Needs the optional extra (``pip install -e '.[mooncake]'``: mooncake-transfer-engine-non-cuda 0.3.13.post1)
and the system library libibverbs1, which Mooncake's extension links against even for TCP; ``make install``
installs both. This module imports Mooncake only when a backend or master is made, so it imports without
them, and ``mooncake_unavailable()`` says which one is missing.

``TableStore`` (megacpp_lab.nn.table_store) keeps every EngramStore rule: create-only populate with
rollback, bounds checks, keys ``engram:l{layer}:h{head}``. This backend only moves bytes.

Layout: a key holds one head's table the way Mooncake's own ``EngramStore`` lays it out (N*D float32,
row r at byte r*D*4), then a 24-byte trailer (magic, N, D), so that a reader in another process learns
the shape from the store. ``mooncake.store.EngramStore.lookup`` reads these tables unchanged (the tests
check it). A table that ``EngramStore.populate`` wrote has no trailer: ``shape()`` refuses it by name.

Reads: the API reads byte ranges (``get_into_ranges``, ``batch_get_into_multi_buffer_ranges``) into
registered memory, or whole objects (``get_into``, ``batch_get_buffer``); every range pays a fixed cost.
Mooncake's ``EngramStore.lookup`` reads one range per row: 0.96 s for the issue's [8,4096,2] rows of
D=256 on 2 CPU cores, where a numpy gather takes 0.043 s (the receipt under
profiles/cpu-intel-r-xeon-r-processor/table_store/: 8-20 us per range, about 1-1.5 GB/s for a whole
table over TCP loopback). So ``plan_reads`` prices a read as ranges * range_cost_s + bytes / bytes_per_s
and picks, per head and lookup, the cheapest block size (1, 2, 4, ... rows, up to the whole table), one
range per run of touched blocks: single rows for a few ids in a large table, one read of the table when
most blocks are touched. One ``get_into_ranges`` call fills a reused registered staging buffer and one
``np.take`` gathers the rows: 0.10 s for the issue's lookup through TableStore, within 15% of the better
of the two forced extremes (single rows, whole tables; both without TableStore's checks) at every shape
of the receipt.

Exposure: do not run this on a host whose ports others can reach.

* The master has no authentication: whoever reaches its RPC port can read, overwrite or remove any key.
* Its HTTP metadata server listens on 0.0.0.0 even when ``-http_metadata_server_host=127.0.0.1`` is
  given (measured with 0.3.13.post1: the log line says 127.0.0.1, the socket is bound to 0.0.0.0).
* Every client (this backend too) listens on 0.0.0.0 for the transfer engine's TCP transport and serves
  the memory segment it lent to the store.

``MooncakeMaster`` binds what it can to 127.0.0.1 (RPC, admin) and can run without the HTTP metadata
server (``http_metadata=False``: clients then use Mooncake's P2PHANDSHAKE mode).

Measured Mooncake behaviour (0.3.13.post1) that this module turns into errors that say what happened:

* Every read, ``is_exist`` or ``get_size`` grants the reader a lease of the master's
  ``--default_kv_lease_ttl`` (10 s by default). A read that outlives it fails with LEASE_EXPIRED (-707);
  ``EngramStore.lookup`` says only "EngramStore lookup failed". A lookup that takes seconds works under
  the default. ``get_rows`` raises ``MooncakeLeaseError`` naming the elapsed time and the TTL.
* Removing a key within that lease fails with OBJECT_HAS_LEASE (-706), so ``remove_from_store()`` right
  after a lookup fails (``EngramStore.remove_from_store(force=False)`` says "remove_from_store failed,
  rc=-706"). ``delete`` raises ``MooncakeLeaseError`` saying so; ``MooncakeConfig(force_remove=True)``
  skips the lease check, as Mooncake's ``force=True`` does (a reader still inside its lease may then read
  memory that has been reused).
* ``put`` of an existing key returns 0 and keeps the old value, so ``put`` checks first (a writer in
  another process can still race that check).
* ``setup`` against an unreachable master retries for about 90 s, then returns -1. The backend first
  connects to the master and the metadata server with a short timeout and raises ``ConnectionError``.
"""

from __future__ import annotations

import functools
import importlib.util
import math
import os
import shutil
import signal
import socket
import struct
import subprocess
import tempfile
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from megacpp_lab.nn.config_builder import config_error
from megacpp_lab.nn.table_store import TableBackend

__all__ = [
    "MOONCAKE_REQUIREMENT",
    "ERROR_NAMES",
    "MooncakeError",
    "MooncakeLeaseError",
    "MooncakeMasterError",
    "MooncakeConfig",
    "MooncakeBackend",
    "MooncakeMaster",
    "ReadPlan",
    "plan_reads",
    "mooncake_unavailable",
]

MOONCAKE_REQUIREMENT = "mooncake-transfer-engine-non-cuda==0.3.13.post1"
P2P_METADATA = "P2PHANDSHAKE"  # no metadata server: peers exchange segment descriptors directly

# Mooncake's ErrorCode (mooncake-store/include/types.h); the ones this module meets are measured.
ERROR_NAMES = {
    -1: "INTERNAL_ERROR",
    -10: "BUFFER_OVERFLOW",
    -101: "SEGMENT_NOT_FOUND",
    -200: "NO_AVAILABLE_HANDLE",
    -600: "INVALID_PARAMS",
    -601: "ILLEGAL_CLIENT",
    -700: "INVALID_WRITE",
    -701: "INVALID_READ",
    -703: "REPLICA_IS_NOT_READY",
    -704: "OBJECT_NOT_FOUND",
    -705: "OBJECT_ALREADY_EXISTS",
    -706: "OBJECT_HAS_LEASE",
    -707: "LEASE_EXPIRED",
    -708: "OBJECT_HAS_REPLICATION_TASK",
    -800: "TRANSFER_FAIL",
    -900: "RPC_FAIL",
}
OBJECT_NOT_FOUND, OBJECT_HAS_LEASE, LEASE_EXPIRED = -704, -706, -707

_TRAILER = struct.Struct("<8sqq")  # magic, rows N, width D: after the rows, so row offsets match EngramStore's
_MAGIC = b"MCLENGR1"
_FLOAT_BYTES = 4
_MIB = 1 << 20
MIN_SEGMENT_BYTES = 16 * _MIB  # Mooncake's smallest segment


def _code(rc: int) -> str:
    return f"{ERROR_NAMES.get(rc, 'error')} ({rc})"


class MooncakeError(RuntimeError):
    """A Mooncake call returned an error code (``code``; ``ERROR_NAMES`` names it)."""

    def __init__(self, message: str, code: int | None = None) -> None:
        super().__init__(message)
        self.code = code


class MooncakeLeaseError(MooncakeError):
    """The master's read lease got in the way: OBJECT_HAS_LEASE (-706) or LEASE_EXPIRED (-707)."""


class MooncakeMasterError(RuntimeError):
    """A local mooncake_master did not start or did not answer; the message ends with its log."""


@functools.cache
def mooncake_unavailable() -> str | None:
    """None when ``mooncake.store`` imports; otherwise why not, naming the package or library to install."""
    try:
        import mooncake.store  # noqa: F401
    except ModuleNotFoundError as exc:
        if exc.name and exc.name.split(".")[0] == "mooncake":
            return f"the Python package {MOONCAKE_REQUIREMENT} is not installed (pip install -e '.[mooncake]')"
        return f"mooncake.store failed to import: {exc}"
    except ImportError as exc:
        if "libibverbs" in str(exc):
            return (f"the system library libibverbs1 is missing ({exc}); install it with "
                    "`apt-get install -y libibverbs1` (make install does, when it runs as root)")  # fmt: skip
        return f"mooncake.store failed to import: {exc}"
    return None


def _require_mooncake() -> Any:
    reason = mooncake_unavailable()
    if reason is not None:
        raise ImportError(f"the Mooncake backend needs Mooncake: {reason}")
    import mooncake.store

    return mooncake.store


# ---------------------------------------------------------------------------------------------- config

_fail = functools.partial(config_error, "MooncakeConfig")


def _host_port(value: object, name: str) -> tuple[str, int]:
    if not isinstance(value, str) or value.count(":") != 1:
        raise _fail(name, "'host:port'", value)
    host, port = value.split(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise _fail(name, "'host:port' with a port in 1..65535", value)
    return host, int(port)


def _url_host_port(value: object, name: str) -> tuple[str, int]:
    parsed = urllib.parse.urlsplit(value) if isinstance(value, str) else None
    if parsed is None or parsed.scheme != "http" or not parsed.hostname or parsed.port is None:
        raise _fail(name, "an http://host:port[/path] URL", value)
    return parsed.hostname, parsed.port


@dataclass(frozen=True)
class MooncakeConfig:
    """Where the Mooncake store is and how this client joins it. ``MooncakeMaster.config()`` fills the
    addresses; the read-planner constants default to what was measured on a 2-core CPU."""

    master_address: str  # "host:port" of the master's RPC server
    metadata_server: str  # "http://host:port/metadata" (the master's HTTP metadata server) or "P2PHANDSHAKE"
    admin_url: str | None = None  # the master's HTTP admin server, "http://host:port": keys() reads /get_all_keys
    local_hostname: str = "127.0.0.1"  # the address this client advertises to peers
    protocol: str = "tcp"
    segment_bytes: int = 512 * _MIB  # memory this client lends to the store: tables land in some client's segment
    local_buffer_bytes: int = 64 * _MIB  # Mooncake's client-side staging buffer
    lease_ttl_s: float = 10.0  # the master's --default_kv_lease_ttl, for error messages
    force_remove: bool = False  # delete() skips the lease check (Mooncake's remove(force=True))
    connect_timeout_s: float = 5.0  # reachability probe before setup, which itself retries for ~90 s
    range_cost_s: float = 15e-6  # planner: seconds per byte range (the receipt: 8-20 us on 2 cores)
    bytes_per_s: float = 1.2e9  # planner: bytes/s of a large range (the receipt: 1-1.5 GB/s, TCP loopback)
    max_staging_bytes: int = 1 << 30  # planner: the largest block read it may stage for one head

    def __post_init__(self) -> None:
        _host_port(self.master_address, "master_address")
        if self.metadata_server != P2P_METADATA:
            _url_host_port(self.metadata_server, "metadata_server")
        if self.admin_url is not None:
            _url_host_port(self.admin_url, "admin_url")
        if not isinstance(self.local_hostname, str) or not self.local_hostname:
            raise _fail("local_hostname", "a non-empty host name or address", self.local_hostname)
        if self.protocol not in ("tcp", "rdma"):
            raise _fail("protocol", "'tcp' or 'rdma'", self.protocol)
        for name in ("segment_bytes", "local_buffer_bytes", "max_staging_bytes"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise _fail(name, "an int >= 0 (bytes)", value)
        if 0 < self.segment_bytes < MIN_SEGMENT_BYTES:  # measured: setup fails with INVALID_PARAMS below it
            raise _fail("segment_bytes", f"0 (lend no memory) or at least {MIN_SEGMENT_BYTES} (16 MiB)", self.segment_bytes)
        for name in ("lease_ttl_s", "connect_timeout_s", "bytes_per_s"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0:
                raise _fail(name, "a number > 0", value)
        if not isinstance(self.range_cost_s, (int, float)) or isinstance(self.range_cost_s, bool) or not (
            math.isfinite(self.range_cost_s) and self.range_cost_s >= 0
        ):
            raise _fail("range_cost_s", "a finite number >= 0 (seconds)", self.range_cost_s)
        if not isinstance(self.force_remove, bool):
            raise _fail("force_remove", "a bool", self.force_remove)


# ---------------------------------------------------------------------------------------------- read plan


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


# ---------------------------------------------------------------------------------------------- backend


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
                raise MooncakeError(f"register_buffer of {array.nbytes} bytes failed: {_code(rc)}", rc)
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
        module = _require_mooncake()
        self.config = config
        host, port = _host_port(config.master_address, "master_address")
        fix = "start one (megacpp_lab.store.mooncake.MooncakeMaster) or fix MooncakeConfig"
        _probe(host, port, "the Mooncake master", f"{fix}.master_address", config.connect_timeout_s)
        if config.metadata_server != P2P_METADATA:
            host, port = _url_host_port(config.metadata_server, "metadata_server")
            _probe(host, port, "the Mooncake metadata server", f"{fix}.metadata_server", config.connect_timeout_s)
        self._store = module.MooncakeDistributedStore()
        rc = self._store.setup(config.local_hostname, config.metadata_server, config.segment_bytes,
                               config.local_buffer_bytes, config.protocol, "", config.master_address)  # fmt: skip
        if rc != 0:
            raise MooncakeError(f"MooncakeDistributedStore.setup with {config} failed: {_code(rc)}", rc)
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
            raise MooncakeError(f"is_exist({key!r}) failed: {_code(rc)}", rc)
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
                    raise MooncakeError(f"register_buffer for {key!r} failed: {_code(rc)}", rc)
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
            raise MooncakeError(f"put of {key!r} ({rows.nbytes} bytes) failed: {_code(rc)}{hint}", rc)

    def _size(self, key: str) -> int:
        size = self._client().get_size(key)
        if size == OBJECT_NOT_FOUND:
            raise KeyError(f"no table stored under {key!r}")
        if size < 0:
            raise MooncakeError(f"get_size({key!r}) failed: {_code(size)}", size)
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
                f"outlives its lease ({_code(LEASE_EXPIRED)} on {int((got == LEASE_EXPIRED).sum())} range(s); "
                "Mooncake's EngramStore.lookup reports this as a bare 'lookup failed'). Raise the master's "
                "--default_kv_lease_ttl (MooncakeMaster(lease_ttl_s=...)) or look up fewer rows per call",
                LEASE_EXPIRED,
            )
        bad = int(np.flatnonzero(got != np.asarray(sizes))[0])
        code = int(got[bad])
        what = _code(code) if code < 0 else f"{code} of {sizes[bad]} bytes"
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
                f"remove of {key!r} refused: {_code(rc)}. A lookup, exists() or shape() of it less than the "
                f"master's lease ago ({self.config.lease_ttl_s:g} s, --default_kv_lease_ttl) holds a read lease; "
                "retry after it runs out, or use MooncakeConfig(force_remove=True) to skip the check "
                "(Mooncake's remove(force=True))",
                rc,
            )
        raise MooncakeError(f"remove of {key!r} failed: {_code(rc)}", rc)

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


# ---------------------------------------------------------------------------------------------- master


def _master_binary() -> Path:
    spec = importlib.util.find_spec("mooncake")
    if spec is None or not spec.submodule_search_locations:
        raise MooncakeMasterError(f"mooncake_master ships with {MOONCAKE_REQUIREMENT}, which is not installed")
    for location in spec.submodule_search_locations:
        path = Path(location) / "mooncake_master"
        if path.is_file():
            return path
    raise MooncakeMasterError(f"no mooncake_master binary in {list(spec.submodule_search_locations)}")


def _free_ports(count: int) -> list[int]:
    """Ports free on every interface (bound together, so distinct), released for the master to take."""
    sockets = []
    try:
        for _ in range(count):
            s = socket.socket()
            s.bind(("0.0.0.0", 0))
            sockets.append(s)
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def _decode_address(hex_address: str) -> str:
    raw = bytes.fromhex(hex_address)
    if len(raw) == 4:
        return socket.inet_ntop(socket.AF_INET, raw[::-1])
    # /proc/net/tcp6 writes each 32-bit word in host (little-endian) order
    return socket.inet_ntop(socket.AF_INET6, b"".join(raw[i : i + 4][::-1] for i in range(0, 16, 4)))


def _stop_process(process: subprocess.Popen, timeout_s: float) -> None:
    if process.poll() is None:
        os.kill(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            os.kill(process.pid, signal.SIGKILL)
            process.wait()


def _serves_http(url: str) -> bool:
    """True when `url` gives any HTTP answer: the metadata server answers 404 for a key it does not hold."""
    try:
        urllib.request.urlopen(url, timeout=0.5).close()
    except urllib.error.HTTPError:
        return True
    except OSError:
        return False
    return True


class MooncakeMaster:
    """A local ``mooncake_master`` for tests and benchmarks, as a context manager.

    Starts the binary that ships with the Mooncake wheel on free ports: RPC and HTTP admin (metrics,
    /health, /get_all_keys) bound to ``host`` (127.0.0.1), and, with ``http_metadata``, the HTTP metadata
    server. Waits until all of them answer (``start_timeout_s``; on failure the error ends with the
    master's log), and stops it by its PID (SIGTERM, SIGKILL after ``stop_timeout_s``), also when the
    object is collected or the interpreter exits.

    Exposure: the master has no authentication, and its HTTP metadata server binds 0.0.0.0 although it is
    told ``-http_metadata_server_host=host`` (measured on 0.3.13.post1; ``listening()`` shows it). Anyone
    who reaches those ports can read, overwrite or remove every key. Use it on a host whose other
    interfaces are firewalled, or with ``http_metadata=False`` (clients then use P2PHANDSHAKE and the
    master opens no metadata port; the clients' own transfer port still binds 0.0.0.0).
    """

    def __init__(self, *, lease_ttl_s: float = 10.0, http_metadata: bool = True, host: str = "127.0.0.1",
                 start_timeout_s: float = 30.0, stop_timeout_s: float = 10.0,
                 extra_args: Sequence[str] = ()) -> None:  # fmt: skip
        fail = functools.partial(config_error, "MooncakeMaster")
        for name, value in (("lease_ttl_s", lease_ttl_s), ("start_timeout_s", start_timeout_s),
                            ("stop_timeout_s", stop_timeout_s)):  # fmt: skip
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0:
                raise fail(name, "a number > 0 (seconds)", value)
        if lease_ttl_s < 1e-3:
            raise fail("lease_ttl_s", "at least 0.001 (the master counts milliseconds)", lease_ttl_s)
        if not isinstance(http_metadata, bool):
            raise fail("http_metadata", "a bool", http_metadata)
        if isinstance(extra_args, str) or not all(isinstance(a, str) for a in extra_args):
            raise fail("extra_args", "a sequence of str flags", extra_args)
        self.lease_ttl_s = float(lease_ttl_s)  # -default_kv_lease_ttl: how long a read holds its lease
        self.http_metadata = http_metadata
        self.host = host
        self.start_timeout_s = float(start_timeout_s)
        self.stop_timeout_s = float(stop_timeout_s)
        self.extra_args = tuple(extra_args)
        self.rpc_port = 0
        self.metadata_port: int | None = None
        self.admin_port = 0
        self.log_path: Path | None = None
        self._process: subprocess.Popen | None = None
        self._finalizer: weakref.finalize | None = None

    def __repr__(self) -> str:
        state = f"pid {self.pid}, {self.master_address}" if self._process is not None else "stopped"
        return f"MooncakeMaster({state}, lease_ttl_s={self.lease_ttl_s:g}, http_metadata={self.http_metadata})"

    # -- addresses

    @property
    def pid(self) -> int | None:
        return None if self._process is None else self._process.pid

    @property
    def master_address(self) -> str:
        return f"{self.host}:{self.rpc_port}"

    @property
    def metadata_server(self) -> str:
        return f"http://{self.host}:{self.metadata_port}/metadata" if self.http_metadata else P2P_METADATA

    @property
    def admin_url(self) -> str:
        return f"http://{self.host}:{self.admin_port}"

    def config(self, **overrides: Any) -> MooncakeConfig:
        """A MooncakeConfig that joins this master (its addresses and lease), with keyword overrides."""
        if self._process is None:
            raise MooncakeMasterError("the master is not running; start() it (or enter its context) first")
        base = MooncakeConfig(self.master_address, self.metadata_server, self.admin_url, lease_ttl_s=self.lease_ttl_s)
        return replace(base, **overrides)

    # -- lifecycle

    def _log_tail(self, lines: int = 25) -> str:
        try:
            text = self.log_path.read_text(errors="replace") if self.log_path else ""
        except OSError:
            text = ""
        tail = text.strip().splitlines()[-lines:]
        return "\n".join(tail) if tail else "(the log is empty)"

    def _answers(self) -> bool:
        try:
            socket.create_connection((self.host, self.rpc_port), timeout=0.5).close()
            with urllib.request.urlopen(self.admin_url + "/health", timeout=0.5) as response:
                if response.status != 200:
                    return False
            return not self.http_metadata or _serves_http(self.metadata_server)
        except OSError:
            return False

    def start(self) -> MooncakeMaster:
        if self._process is not None:
            raise MooncakeMasterError(f"this master is already running (pid {self.pid})")
        binary = _master_binary()
        self.rpc_port, metadata_port, self.admin_port = _free_ports(3)
        self.metadata_port = metadata_port if self.http_metadata else None
        args = [
            str(binary),
            f"-rpc_address={self.host}",
            f"-rpc_port={self.rpc_port}",
            f"-metrics_host={self.host}",
            f"-metrics_port={self.admin_port}",
            f"-default_kv_lease_ttl={max(1, round(self.lease_ttl_s * 1000))}",
        ]
        if self.http_metadata:
            args += ["-enable_http_metadata_server=true", f"-http_metadata_server_host={self.host}",
                     f"-http_metadata_server_port={self.metadata_port}"]  # fmt: skip
        args += list(self.extra_args)
        # a file, not a pipe: the master logs every few seconds and would block on a pipe nobody reads
        self.log_path = Path(tempfile.mkdtemp(prefix="mooncake-master-")) / "master.log"
        with open(self.log_path, "wb") as log:
            self._process = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        self._finalizer = weakref.finalize(self, _stop_process, self._process, self.stop_timeout_s)
        deadline = time.monotonic() + self.start_timeout_s
        while not self._answers():
            status = self._process.poll()
            if status is not None or time.monotonic() > deadline:
                what = (f"exited with status {status}" if status is not None
                        else f"did not answer within {self.start_timeout_s:g} s")  # fmt: skip
                self.stop(keep_log=True)
                raise MooncakeMasterError(f"mooncake_master {what} ({' '.join(args)}); its log ends:\n{self._log_tail()}")
            time.sleep(0.05)
        return self

    def stop(self, keep_log: bool = False) -> None:
        """Stop the master by its PID and reap it; idempotent."""
        process, self._process = self._process, None
        if self._finalizer is not None:
            self._finalizer.detach()
            self._finalizer = None
        if process is not None:
            _stop_process(process, self.stop_timeout_s)
        if not keep_log and self.log_path is not None:
            shutil.rmtree(self.log_path.parent, ignore_errors=True)  # the log's own temporary directory
            self.log_path = None

    def __enter__(self) -> MooncakeMaster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def listening(self) -> dict[int, list[str]]:
        """The master's listening TCP sockets, port -> bound addresses (Linux: /proc/net/tcp{,6})."""
        if self._process is None:
            return {}
        inodes = set()
        fd_dir = Path(f"/proc/{self._process.pid}/fd")
        for fd in fd_dir.iterdir():
            try:
                target = os.readlink(fd)
            except OSError:
                continue
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
        found: dict[int, list[str]] = {}
        for table in ("/proc/net/tcp", "/proc/net/tcp6"):
            try:
                lines = Path(table).read_text().splitlines()[1:]
            except OSError:
                continue
            for line in lines:
                parts = line.split()
                if parts[3] != "0A" or parts[9] not in inodes:  # 0A: LISTEN
                    continue
                address, port = parts[1].split(":")
                found.setdefault(int(port, 16), []).append(_decode_address(address))
        return {port: sorted(addresses) for port, addresses in sorted(found.items())}
