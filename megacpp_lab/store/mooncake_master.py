"""``MooncakeMaster``: a local mooncake_master process for tests, notebooks and single-host runs, bound to
127.0.0.1 where Mooncake allows it (the exposure notes are in megacpp_lab.store.mooncake's docstring).
"""

from __future__ import annotations

import functools
import importlib.util
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
import weakref
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from megacpp_lab.checks import config_error
from megacpp_lab.store.mooncake import MOONCAKE_REQUIREMENT, P2P_METADATA, MooncakeConfig, MooncakeMasterError

__all__ = ["MooncakeMaster"]


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
