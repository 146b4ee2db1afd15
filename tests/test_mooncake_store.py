"""The Mooncake backend beyond the shared contract (tests/test_table_store.py runs that on it): the local
master's life and exposure, the errors for the measured lease behaviours and an unreachable master,
compatibility with Mooncake's own EngramStore, NgramHashMemory through it, and the read planner.

Tests that need Mooncake skip, naming what is missing, only when the package or libibverbs1 is absent.
"""

from __future__ import annotations

import builtins
import socket
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from test_table_store import D, SIZES, make_ids, make_tables, reference  # the contract tests' tables and ids

from megacpp_lab.nn.table_store import InProcessBackend, TableStore, TableStoreConfig
from megacpp_lab.store.mooncake import MooncakeConfig, MooncakeError, MooncakeLeaseError, MooncakeMasterError, mooncake_unavailable
from megacpp_lab.store.mooncake_backend import MooncakeBackend
from megacpp_lab.store.mooncake_master import MooncakeMaster
from megacpp_lab.store.mooncake_plan import plan_reads


def engram_store(layer: int, sizes: list[int], d: int, backend: MooncakeBackend):
    """Mooncake's own EngramStore over the backend's client."""
    import mooncake.store

    config = mooncake.store.EngramStoreConfig()
    config.table_vocab_sizes, config.embedding_dim = list(sizes), d
    return mooncake.store.EngramStore(layer, config, backend.client)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pid_alive(pid: int) -> bool:
    return Path(f"/proc/{pid}").exists()  # a reaped child leaves no /proc entry


@pytest.fixture(scope="module")
def leasing_backend(mooncake_master):
    """A client with Mooncake's default remove (force=False), so the master's read lease applies."""
    with MooncakeBackend(mooncake_master.config(segment_bytes=32 << 20)) as backend:
        yield backend


# ------------------------------------------------------------------ the local master


def test_master_binds_loopback_except_the_http_metadata_server(mooncake_master):
    """The exposure the module documents, measured: RPC and admin on 127.0.0.1 as asked, the HTTP metadata
    server on 0.0.0.0 although it is told -http_metadata_server_host=127.0.0.1. If Mooncake fixes this,
    this test fails: update the docstrings of megacpp_lab.store.mooncake."""
    listening = mooncake_master.listening()
    assert listening[mooncake_master.rpc_port] == ["127.0.0.1"]
    assert listening[mooncake_master.admin_port] == ["127.0.0.1"]
    assert listening[mooncake_master.metadata_port] == ["0.0.0.0"]
    assert "-http_metadata_server_host=127.0.0.1" in Path(f"/proc/{mooncake_master.pid}/cmdline").read_text().split("\0")


def test_master_without_http_metadata_starts_serves_and_stops_by_pid(mooncake_installed):
    """http_metadata=False: no metadata port at all (clients use P2PHANDSHAKE); a table round-trips; after
    the context the PID is gone."""
    with MooncakeMaster(http_metadata=False) as master:
        pid = master.pid
        assert pid_alive(pid)
        assert master.metadata_server == "P2PHANDSHAKE"
        listening = master.listening()
        assert set(listening) == {master.rpc_port, master.admin_port}
        assert all(addresses == ["127.0.0.1"] for addresses in listening.values())
        with MooncakeBackend(master.config(segment_bytes=16 << 20)) as backend:
            store = TableStore(0, TableStoreConfig(SIZES, D), backend)
            tables, ids = make_tables(), make_ids()
            store.populate(tables)
            torch.testing.assert_close(store.lookup(ids), reference(tables, ids), rtol=0, atol=0)
    assert master.pid is None and not pid_alive(pid)
    master.stop()  # idempotent


def test_master_that_exits_reports_its_log(mooncake_installed):
    master = MooncakeMaster(extra_args=["-rpc_thread_num=not-a-number"])
    with pytest.raises(MooncakeMasterError, match=r"exited with status \d+") as info:
        master.start()
    assert "not-a-number" in str(info.value) and "its log ends" in str(info.value)
    assert master.pid is None


def test_master_that_does_not_answer_in_time_is_stopped(mooncake_installed):
    master = MooncakeMaster(start_timeout_s=0.001)
    with pytest.raises(MooncakeMasterError, match=r"did not answer within 0.001 s") as info:
        master.start()
    assert "its log ends" in str(info.value)
    assert master.pid is None  # stopped and reaped


def test_master_rejects_bad_settings():
    with pytest.raises(ValueError, match=r"MooncakeMaster.lease_ttl_s must be a number > 0"):
        MooncakeMaster(lease_ttl_s=0)
    with pytest.raises(ValueError, match=r"MooncakeMaster.extra_args"):
        MooncakeMaster(extra_args="-x=1")
    with pytest.raises(MooncakeMasterError, match="not running"):
        MooncakeMaster().config()


# ------------------------------------------------------------------ joining the store


def test_unreachable_master_is_a_clear_error_at_once(mooncake_master):
    """Mooncake's setup() would retry for ~90 s and return -1; the backend probes first."""
    port = free_port()
    config = mooncake_master.config(master_address=f"127.0.0.1:{port}", connect_timeout_s=1.0)
    with pytest.raises(ConnectionError, match=rf"the Mooncake master at 127.0.0.1:{port} is not reachable"):
        MooncakeBackend(config)
    config = mooncake_master.config(metadata_server=f"http://127.0.0.1:{port}/metadata", connect_timeout_s=1.0)
    with pytest.raises(ConnectionError, match=rf"the Mooncake metadata server at 127.0.0.1:{port} is not reachable"):
        MooncakeBackend(config)


@pytest.mark.parametrize(
    "field,value,pattern",
    [
        ("master_address", "localhost", r"MooncakeConfig.master_address must be 'host:port'"),
        ("master_address", "h:0", r"MooncakeConfig.master_address must be 'host:port' with a port in 1..65535"),
        ("metadata_server", "etcd://x:1", r"MooncakeConfig.metadata_server must be an http://host:port"),
        ("admin_url", "127.0.0.1:9003", r"MooncakeConfig.admin_url must be an http://host:port"),
        ("protocol", "udp", r"MooncakeConfig.protocol must be 'tcp' or 'rdma'"),
        ("segment_bytes", -1, r"MooncakeConfig.segment_bytes must be an int >= 0"),
        ("segment_bytes", 8 << 20, r"MooncakeConfig.segment_bytes must be 0 \(lend no memory\) or at least 16777216"),
        ("lease_ttl_s", 0, r"MooncakeConfig.lease_ttl_s must be a number > 0"),
        ("range_cost_s", float("nan"), r"MooncakeConfig.range_cost_s must be a finite number >= 0"),
        ("force_remove", 1, r"MooncakeConfig.force_remove must be a bool"),
    ],
)
def test_config_fails_closed_naming_the_field(field, value, pattern):
    good = {"master_address": "127.0.0.1:50051", "metadata_server": "http://127.0.0.1:8080/metadata"}
    with pytest.raises(ValueError, match=pattern):
        MooncakeConfig(**{**good, field: value})
    assert MooncakeConfig(**good).metadata_server.startswith("http://")
    assert MooncakeConfig("127.0.0.1:1", "P2PHANDSHAKE").metadata_server == "P2PHANDSHAKE"


@pytest.mark.parametrize(
    "error,expected",
    [
        (ImportError("libibverbs.so.1: cannot open shared object file: No such file or directory"),
         "the system library libibverbs1 is missing"),
        (ModuleNotFoundError("No module named 'mooncake'", name="mooncake"),
         "mooncake-transfer-engine-non-cuda==0.3.13.post1 is not installed"),
    ],
)  # fmt: skip
def test_unavailable_reason_names_what_to_install(monkeypatch, error, expected):
    """The skip reason (and the backend's ImportError) names the package or the system library."""
    real_import = builtins.__import__

    def fake_import(name, *args, **kwargs):
        if name.startswith("mooncake"):
            raise error
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", fake_import)
    for module in [m for m in sys.modules if m == "mooncake" or m.startswith("mooncake.")]:
        monkeypatch.delitem(sys.modules, module)
    assert expected in mooncake_unavailable.__wrapped__()


# ------------------------------------------------------------------ the measured lease behaviours


def test_remove_right_after_a_lookup_names_the_lease(leasing_backend, mooncake_backend):
    """A lookup grants a read lease (10 s by default); removing within it fails with OBJECT_HAS_LEASE (-706).
    Mooncake's EngramStore says only "rc=-706"; the backend says what happened and what to do."""
    store = TableStore(3, TableStoreConfig(SIZES, D), leasing_backend)
    store.populate(make_tables())
    store.lookup(make_ids())
    with pytest.raises(RuntimeError, match=r"removed 0 key\(s\)") as info:
        store.remove_from_store()
    message = str(info.value)
    assert "OBJECT_HAS_LEASE (-706)" in message and "--default_kv_lease_ttl" in message
    assert "force_remove=True" in message
    assert isinstance(info.value.__cause__, MooncakeLeaseError) and info.value.__cause__.code == -706
    assert store.is_populated()  # nothing was removed
    with pytest.raises(RuntimeError, match=r"^remove_from_store failed, rc=-706$"):
        engram_store(3, SIZES, D, leasing_backend).remove_from_store(False)
    # Mooncake's force=True (MooncakeConfig(force_remove=True)) removes within the lease
    assert TableStore(3, TableStoreConfig(SIZES, D), mooncake_backend).remove_from_store() == 3


def test_remove_right_after_populate_needs_no_force(leasing_backend, mooncake_backend):
    """A put grants no lease: a failed populate's rollback (and a remove before any read) works."""
    store = TableStore(4, TableStoreConfig(SIZES, D), leasing_backend)
    store.populate(make_tables())
    assert store.remove_from_store() == 3


def test_lookup_longer_than_the_lease_names_lease_expiry(mooncake_master, mooncake_backend):
    """A read that outlives --default_kv_lease_ttl fails: Mooncake's EngramStore.lookup says only "lookup
    failed", the backend names LEASE_EXPIRED, the time it took and the TTL. The default (10 s) lease on the
    session master reads the same rows."""
    sizes, d = [20_011, 20_021], 8
    tables = make_tables(sizes, d, seed=3)
    ids = make_ids(B=1, L=6_000, sizes=sizes, seed=4)
    expected = reference(tables, ids)
    with MooncakeMaster(lease_ttl_s=0.001) as short, MooncakeBackend(short.config(segment_bytes=16 << 20)) as backend:
        store = TableStore(0, TableStoreConfig(sizes, d), backend)
        store.populate(tables)
        with pytest.raises(MooncakeLeaseError, match=r"took \d+\.\d+ s, longer than the master's read lease "
                           r"\(0.001 s, --default_kv_lease_ttl\).*LEASE_EXPIRED \(-707\)") as info:  # fmt: skip
            # ~6000 single-row ranges take ~0.09 s: ninety times the master's shortest lease (1 ms). At a 20 ms
            # lease (four times over) a fresh-clone CI run once saw the read come back whole
            backend.get_rows(store.key(0), ids[..., 0].reshape(-1), rows_per_block=1)
        assert info.value.code == -707
        with pytest.raises(RuntimeError, match=r"^EngramStore lookup failed$"):
            engram_store(0, sizes, d, backend).lookup(ids.numpy())
    store = TableStore(0, TableStoreConfig(sizes, d), mooncake_backend)
    store.populate(tables)
    rows = mooncake_backend.get_rows(store.key(0), ids[..., 0].reshape(-1), rows_per_block=1)
    torch.testing.assert_close(rows.view(1, 6_000, d), expected[:, :, 0], rtol=0, atol=0)


# ------------------------------------------------------------------ layout, EngramStore, NgramHashMemory


def test_mooncake_engram_store_reads_the_backends_tables(mooncake_backend):
    """The layout is EngramStore's (rows at r*D*4; the shape trailer after them): Mooncake's own lookup
    returns the same rows, and the planned read equals the one-range-per-row read."""
    sizes, d = [1009, 1013], 16
    tables = make_tables(sizes, d, seed=5)
    store = TableStore(2, TableStoreConfig(sizes, d), mooncake_backend)
    store.populate(tables)
    ids = make_ids(B=3, L=700, sizes=sizes, seed=6)
    ours = store.lookup(ids)
    theirs = engram_store(2, sizes, d, mooncake_backend).lookup(ids.numpy())
    assert theirs.shape == (3, 700, 2, d) and np.array_equal(ours.numpy(), theirs)
    per_row = mooncake_backend.get_rows(store.key(1), ids[..., 1].reshape(-1), rows_per_block=1)
    assert torch.equal(per_row, ours[:, :, 1].reshape(-1, d))
    assert mooncake_backend.shape(store.key(1)) == (1013, d)


def test_a_table_without_the_trailer_is_refused_by_name(mooncake_backend):
    """EngramStore.populate stores bare rows: the width is not in the store, so shape() says so."""
    engram_store(5, SIZES, D, mooncake_backend).populate([t.numpy() for t in make_tables()])
    store = TableStore(5, TableStoreConfig(SIZES, D), mooncake_backend)
    with pytest.raises(ValueError, match=r"'engram:l5:h0' \(112 bytes\) has no MooncakeBackend shape trailer"):
        store.lookup(make_ids())


def test_put_refuses_an_existing_key_that_mooncake_would_silently_keep(mooncake_backend):
    """Mooncake's put of an existing key returns 0 and keeps the old value; the backend refuses it."""
    old, new = torch.zeros(3, 2), torch.ones(3, 2)
    mooncake_backend.put("k", old)
    with pytest.raises(KeyError, match="'k' already exists"):
        mooncake_backend.put("k", new)
    assert mooncake_backend.client.put("k", new.numpy().tobytes()) == 0  # Mooncake: success ...
    assert torch.equal(mooncake_backend.get_rows("k", torch.arange(3)), old)  # ... but the old value stays


def test_put_larger_than_the_store_names_the_cause(mooncake_backend):
    """The store holds what its clients lend; a table no segment can hold fails as NO_AVAILABLE_HANDLE."""
    with pytest.raises(MooncakeError, match=r"NO_AVAILABLE_HANDLE \(-200\) \(no segment has room"):
        mooncake_backend.put("huge", torch.zeros(130 << 20 >> 12, 1024))  # 130 MiB, beyond every test segment
    assert not mooncake_backend.exists("huge")


def test_backend_errors_name_the_key(mooncake_backend):
    with pytest.raises(KeyError, match="no table stored under 'absent'"):
        mooncake_backend.shape("absent")
    with pytest.raises(KeyError, match="no table stored under 'absent'"):
        mooncake_backend.get_rows("absent", torch.tensor([0]))
    assert mooncake_backend.delete("absent") is False
    mooncake_backend.put("t", torch.ones(4, 3))
    with pytest.raises(IndexError, match=r"row ids for 't' must be in \[0, 4\), got min 0, max 4"):
        mooncake_backend.get_rows("t", torch.tensor([0, 4]))
    assert mooncake_backend.get_rows("t", torch.tensor([], dtype=torch.long)).shape == (0, 3)
    with pytest.raises(ValueError, match="non-empty 2-D tensor"):
        mooncake_backend.put("u", torch.ones(3))


def test_ngram_hash_memory_gives_the_same_output_from_mooncake(mooncake_backend):
    """NgramHashMemory(store=...) reads its rows from Mooncake: bit-identical to the in-process store."""
    from megacpp_lab.data import boundary_windows, load_sample
    from megacpp_lab.nn.ngram_hash import NgramHashConfig, NgramHashMemory
    from megacpp_lab.varlen import build_context

    config = NgramHashConfig(vocab_size=259, d_model=32, pad_id=256, max_ngram=4, heads_per_order=2,
                             table_size=1009, head_dim=8)  # fmt: skip
    torch.manual_seed(0)
    mem = NgramHashMemory(config, layer_id=1)
    torch.nn.init.normal_(mem.value_proj.weight, std=0.1)  # a trained layer, not the zero init
    w = boundary_windows(load_sample()[0].batch, 2, 128, lead=64)
    h, ctx = torch.randn(2, 128, 32), build_context(w.doc_ids)
    in_process = mem(h, w.tokens, ctx=ctx, store=mem.make_store(InProcessBackend()))
    mooncake = mem(h, w.tokens, ctx=ctx, store=mem.make_store(mooncake_backend))
    assert torch.equal(mooncake, in_process)
    assert not torch.equal(in_process, torch.zeros_like(in_process))


# ------------------------------------------------------------------ the read planner (no Mooncake needed)


def _apply(plan, table: np.ndarray) -> np.ndarray:
    flat = table.reshape(-1).view(np.uint8)
    staged = np.zeros(plan.staged_rows * table.shape[1] * table.itemsize, np.uint8)
    for src, size, dst in zip(plan.src_offsets, plan.sizes, plan.dst_offsets):
        assert src + size <= flat.size and dst + size <= staged.size
        staged[dst : dst + size] = flat[src : src + size]
    return staged.view(table.dtype).reshape(plan.staged_rows, table.shape[1])[plan.index]


@pytest.mark.parametrize("rows_per_block", [None, 1, 3, 64, 10_000])
def test_plan_reads_stages_exactly_the_requested_rows(rows_per_block):
    rng = np.random.default_rng(0)
    for _ in range(50):
        n, width = int(rng.integers(1, 2_000)), int(rng.integers(1, 9))
        table = rng.standard_normal((n, width)).astype(np.float32)
        rows = rng.integers(0, n, int(rng.integers(1, 300)))
        plan = plan_reads(rows, n, width * 4, range_cost_s=float(rng.choice([0.0, 1e-5, 1e-2])),
                          bytes_per_s=1e9, max_staging_bytes=int(rng.choice([64, 1 << 30])),
                          rows_per_block=rows_per_block)  # fmt: skip
        assert np.array_equal(_apply(plan, table), table[rows])
        if rows_per_block is not None:
            assert plan.rows_per_block == rows_per_block


def test_plan_reads_picks_rows_for_a_sparse_lookup_and_blocks_for_a_dense_one():
    rng = np.random.default_rng(1)
    kwargs = {"range_cost_s": 15e-6, "bytes_per_s": 1.2e9, "max_staging_bytes": 1 << 30}
    sparse = plan_reads(rng.integers(0, 200_000, 1_000), 200_000, 1024, **kwargs)
    assert sparse.rows_per_block == 1 and sparse.num_ranges > 900 and sparse.staged_rows <= 1_000
    dense = plan_reads(rng.integers(0, 50_000, 32_768), 50_000, 1024, **kwargs)
    assert dense.num_ranges == 1 and dense.staged_rows == 50_000  # every block touched: one read of the table
    capped = plan_reads(rng.integers(0, 50_000, 32_768), 50_000, 1024, **{**kwargs, "max_staging_bytes": 1 << 20})
    assert capped.rows_per_block == 1  # no block size fits 1 MiB of staging, so single rows
    contiguous = plan_reads(np.arange(100, 200), 50_000, 1024, **kwargs)
    assert (contiguous.num_ranges, contiguous.staged_rows) == (1, 100)


def test_plan_reads_rejects_bad_input():
    kwargs = {"range_cost_s": 1e-5, "bytes_per_s": 1e9, "max_staging_bytes": 1 << 20}
    with pytest.raises(ValueError, match="at least one row"):
        plan_reads(np.array([], dtype=np.int64), 10, 4, **kwargs)
    with pytest.raises(IndexError, match=r"must be in \[0, 10\), got min 0, max 10"):
        plan_reads(np.array([0, 10]), 10, 4, **kwargs)
    with pytest.raises(ValueError, match="rows_per_block must be an int >= 1"):
        plan_reads(np.array([0]), 10, 4, rows_per_block=0, **kwargs)
