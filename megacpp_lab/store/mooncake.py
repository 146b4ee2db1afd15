"""Engram tables in a Mooncake store. This module holds what the pieces share (the config, the errors, whether
Mooncake is installed); the pieces are ``mooncake_backend.MooncakeBackend`` (a TableBackend),
``mooncake_plan.plan_reads`` (how a lookup reads its rows) and ``mooncake_master.MooncakeMaster`` (a local
master).

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
import math
import urllib.parse
from dataclasses import dataclass
from typing import Any

from megacpp_lab.checks import config_error

__all__ = ["ERROR_NAMES", "MIN_SEGMENT_BYTES", "MOONCAKE_REQUIREMENT", "P2P_METADATA", "MooncakeConfig", "MooncakeError",
           "MooncakeLeaseError", "MooncakeMasterError", "error_label", "host_port", "mooncake_unavailable",
           "require_mooncake", "url_host_port"]  # fmt: skip


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

_MIB = 1 << 20
MIN_SEGMENT_BYTES = 16 * _MIB  # Mooncake's smallest segment



def error_label(rc: int) -> str:
    """A Mooncake return code as its name and number, e.g. 'LEASE_EXPIRED (-707)'."""
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


def require_mooncake() -> Any:
    """mooncake.store, or an ImportError saying what to install."""
    reason = mooncake_unavailable()
    if reason is not None:
        raise ImportError(f"the Mooncake backend needs Mooncake: {reason}")
    import mooncake.store

    return mooncake.store


# ---------------------------------------------------------------------------------------------- config

_fail = functools.partial(config_error, "MooncakeConfig")


def host_port(value: object, name: str) -> tuple[str, int]:
    if not isinstance(value, str) or value.count(":") != 1:
        raise _fail(name, "'host:port'", value)
    host, port = value.split(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise _fail(name, "'host:port' with a port in 1..65535", value)
    return host, int(port)


def url_host_port(value: object, name: str) -> tuple[str, int]:
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
        host_port(self.master_address, "master_address")
        if self.metadata_server != P2P_METADATA:
            url_host_port(self.metadata_server, "metadata_server")
        if self.admin_url is not None:
            url_host_port(self.admin_url, "admin_url")
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
