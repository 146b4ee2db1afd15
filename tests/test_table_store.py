"""The table-store contract (megacpp_lab.nn.table_store), run on every backend: the in-process one always,
Mooncake's when the `mooncake` extra and libibverbs1 are installed (one local master per session, see
conftest.py). Tests of what only one backend has (its defaults, CUDA) say so by taking no `backend`."""

import pytest
import torch

from megacpp_lab.nn.table_store import InProcessBackend, TableBackend, TableStore, TableStoreConfig

SIZES = [7, 11, 13]
D = 4


def make_tables(sizes=SIZES, d=D, seed=0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n, d, generator=g) for n in sizes]


def make_ids(B=2, L=5, sizes=SIZES, seed=1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.stack([torch.randint(0, n, (B, L), generator=g) for n in sizes], dim=-1)


def reference(tables: list[torch.Tensor], ids: torch.Tensor) -> torch.Tensor:
    return torch.stack([tables[h][ids[..., h]] for h in range(len(tables))], dim=2)


def make_store(layer_id=3, backend=None) -> TableStore:
    return TableStore(layer_id, TableStoreConfig(SIZES, D), backend)


@pytest.fixture(params=["in-process", "mooncake"])
def backend(request) -> TableBackend:
    """An empty backend of each kind."""
    if request.param == "mooncake":
        return request.getfixturevalue("mooncake_backend")
    return InProcessBackend()


@pytest.fixture
def store(backend) -> TableStore:
    s = make_store(backend=backend)
    s.populate(make_tables())
    return s


# ------------------------------------------------------------------ round trip / metadata


def test_lookup_matches_direct_indexing_tensor_and_list(store):
    tables = make_tables()
    ids = make_ids()
    out = store.lookup(ids)
    assert out.shape == (2, 5, 3, D)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, reference(tables, ids), rtol=0, atol=0)
    torch.testing.assert_close(store.lookup(ids.tolist()), out, rtol=0, atol=0)
    torch.testing.assert_close(store.lookup(ids.int()), out, rtol=0, atol=0)


def test_lookup_reaches_every_row_including_the_last(store):
    tables = make_tables()
    ids = torch.tensor([[[0, 0, 0], [6, 10, 12]]])
    out = store.lookup(ids)
    for h, n in enumerate(SIZES):
        torch.testing.assert_close(out[0, 0, h], tables[h][0])
        torch.testing.assert_close(out[0, 1, h], tables[h][n - 1])


def test_keys_getters_repr(store):
    assert store.get_store_keys() == ["engram:l3:h0", "engram:l3:h1", "engram:l3:h2"]
    assert sorted(store.backend.keys()) == store.get_store_keys()
    assert store.key(1) == "engram:l3:h1"
    assert store.get_table_vocab_sizes() == SIZES
    assert store.get_num_heads() == 3
    assert store.get_embedding_dim() == D
    assert store.is_populated()
    r = repr(store)
    assert "layer_id=3" in r and type(store.backend).__name__ in r and "embedding_dim=4" in r
    with pytest.raises(IndexError):
        store.key(3)


def test_tables_read_back_and_store_owns_a_copy(backend):
    src = make_tables()
    s = make_store(backend=backend)
    s.populate(src)
    src[0].add_(100.0)  # caller mutates its tensor after upload
    back = s.tables()
    expected = make_tables()
    for t, e in zip(back, expected):
        assert t.dtype == torch.float32 and t.is_contiguous()
        torch.testing.assert_close(t, e, rtol=0, atol=0)


def test_populate_accepts_other_float_dtypes_and_stores_float32(backend):
    s = make_store(backend=backend)
    s.populate([t.double() for t in make_tables()])
    assert all(t.dtype == torch.float32 for t in s.tables())


# ------------------------------------------------------------------ create-only


def test_second_populate_refused_and_original_unchanged(store):
    with pytest.raises(ValueError, match=r"engram:l3:h0.*remove_from_store"):
        store.populate(make_tables(seed=99))
    for t, e in zip(store.tables(), make_tables()):
        torch.testing.assert_close(t, e, rtol=0, atol=0)
    assert store.remove_from_store() == 3
    store.populate(make_tables(seed=99))
    for t, e in zip(store.tables(), make_tables(seed=99)):
        torch.testing.assert_close(t, e, rtol=0, atol=0)


def test_populate_refused_when_only_one_key_exists(backend):
    backend.put("engram:l3:h2", torch.zeros(13, D))
    s = make_store(backend=backend)
    with pytest.raises(ValueError, match="engram:l3:h2"):
        s.populate(make_tables())
    assert backend.keys() == ["engram:l3:h2"]


# ------------------------------------------------------------------ populate validation writes nothing


def _bad_table_cases():
    good = make_tables()
    wrong_shape = list(good)
    wrong_shape[1] = torch.randn(12, D)
    wrong_d = list(good)
    wrong_d[2] = torch.randn(13, D + 1)
    int_table = list(good)
    int_table[1] = torch.zeros(11, D, dtype=torch.long)
    one_d = list(good)
    one_d[0] = torch.randn(7)
    return [
        (good[:2], r"expected 3 tables \(one per head\), got 2"),
        (good + [torch.randn(5, D)], r"expected 3 tables \(one per head\), got 4"),
        (wrong_shape, r"head 1 .*\[11, 4\].*\[12, 4\]"),
        (wrong_d, r"head 2 .*\[13, 4\].*\[13, 5\]"),
        (int_table, r"head 1 .*floating.*int64"),
        (one_d, r"head 0 .*\[7, 4\].*\[7\]"),
    ]


@pytest.mark.parametrize("tables,pattern", _bad_table_cases())
def test_populate_validation_writes_nothing(backend, tables, pattern):
    s = make_store(backend=backend)
    with pytest.raises(ValueError, match=pattern):
        s.populate(tables)
    assert s.backend.keys() == []
    assert not s.is_populated()


# ------------------------------------------------------------------ rollback


class FaultyBackend(TableBackend):
    """Any backend with injected faults: the `fail_put_on`-th put raises before writing, a put of a key
    ending in `lost_ack_on` raises after writing (a lost acknowledgement), and deletes of keys ending in
    `fail_delete_on` raise ("" = every key)."""

    def __init__(self, inner: TableBackend, fail_put_on: int = -1, lost_ack_on: str | None = None,
                 fail_delete_on: str | None = None) -> None:  # fmt: skip
        self.inner = inner
        self.fail_put_on = fail_put_on
        self.lost_ack_on = lost_ack_on
        self.fail_delete_on = fail_delete_on
        self.puts = 0

    def put(self, key, table):
        self.puts += 1
        if self.puts == self.fail_put_on:
            raise OSError(f"simulated transfer failure on {key}")
        self.inner.put(key, table)
        if self.lost_ack_on is not None and key.endswith(self.lost_ack_on):
            raise TimeoutError(f"stored {key} but the acknowledgement was lost")

    def delete(self, key):
        if self.fail_delete_on is not None and key.endswith(self.fail_delete_on):
            raise ConnectionError(f"simulated delete failure on {key}")
        return self.inner.delete(key)

    def exists(self, key):
        return self.inner.exists(key)

    def get_rows(self, key, rows):
        return self.inner.get_rows(key, rows)

    def shape(self, key):
        return self.inner.shape(key)

    def keys(self):
        return self.inner.keys()


def test_populate_rolls_back_on_put_failure(backend):
    faulty = FaultyBackend(backend, fail_put_on=2)
    s = make_store(backend=faulty)
    with pytest.raises(RuntimeError, match=r"head 1.*rolled back 1 of 1") as info:
        s.populate(make_tables())
    assert isinstance(info.value.__cause__, OSError)
    assert backend.keys() == []
    assert not s.is_populated()
    # the layer id is reusable straight away
    faulty.fail_put_on = -1
    s.populate(make_tables())
    assert s.is_populated()


def test_rollback_delete_failure_does_not_mask_populate_error(backend):
    s = make_store(backend=FaultyBackend(backend, fail_put_on=3, fail_delete_on=""))
    with pytest.raises(RuntimeError, match="head 2") as info:
        s.populate(make_tables())
    msg = str(info.value)
    assert "rollback incomplete" in msg and "simulated delete failure" in msg
    assert "engram:l3:h0" in msg and "engram:l3:h1" in msg
    assert isinstance(info.value.__cause__, OSError)  # the original put error, not the delete error
    assert sorted(backend.keys()) == ["engram:l3:h0", "engram:l3:h1"]


def test_rollback_removes_a_key_the_backend_stored_before_raising(backend):
    with pytest.raises(RuntimeError, match="head 1"):
        make_store(backend=FaultyBackend(backend, lost_ack_on=":h1")).populate(make_tables())
    assert backend.keys() == []  # nothing half-populated blocks the retry


def test_put_failure_on_first_head_writes_nothing(backend):
    with pytest.raises(RuntimeError, match="head 0"):
        make_store(backend=FaultyBackend(backend, fail_put_on=1)).populate(make_tables())
    assert backend.keys() == []


# ------------------------------------------------------------------ lookup validation


@pytest.mark.parametrize(
    "head,value,pattern",
    [
        (0, 7, r"row id 7 for head 0 at position \(b=1, l=2\).*0 <= id < 7"),
        (2, 13, r"row id 13 for head 2 at position \(b=1, l=2\).*0 <= id < 13"),
        (1, -1, r"row id -1 for head 1 at position \(b=1, l=2\).*0 <= id < 11"),
    ],
)
def test_lookup_out_of_bounds(store, head, value, pattern):
    ids = make_ids()
    ids[1, 2, head] = value
    with pytest.raises(IndexError, match=pattern):
        store.lookup(ids)


def test_lookup_out_of_bounds_from_list(store):
    ids = make_ids().tolist()
    ids[0][4][1] = 11
    with pytest.raises(IndexError, match=r"head 1 at position \(b=0, l=4\)"):
        store.lookup(ids)


@pytest.mark.parametrize(
    "ids,pattern",
    [
        (torch.zeros(2, 5, 2, dtype=torch.long), "last dim must equal the number of heads 3"),
        (torch.zeros(2, 3, dtype=torch.long), "3-D"),
        (torch.zeros(0, 5, 3, dtype=torch.long), "non-empty"),
        (torch.zeros(2, 5, 3), "integer dtype"),
        (torch.zeros(2, 5, 3, dtype=torch.bool), "integer dtype"),
        ([[[0, 1, 2], [0, 1]]], "rectangular"),
        ([], "3-D"),
    ],
)
def test_lookup_rejects_bad_input(store, ids, pattern):
    with pytest.raises(ValueError, match=pattern):
        store.lookup(ids)


def test_lookup_before_populate_names_missing_key(backend):
    s = make_store(backend=backend)
    with pytest.raises(ValueError, match="engram:l3:h0"):
        s.lookup(make_ids())


def test_lookup_on_partially_populated_layer_names_missing_key(backend):
    s = make_store(backend=backend)
    s.populate(make_tables())
    backend.delete("engram:l3:h1")
    assert not s.is_populated()
    with pytest.raises(ValueError, match="engram:l3:h1"):
        s.lookup(make_ids())


def test_lookup_detects_table_written_with_other_config(backend):
    TableStore(3, TableStoreConfig([7, 11, 13], D + 1), backend).populate(make_tables(d=D + 1))
    with pytest.raises(ValueError, match=r"engram:l3:h0.*\[7, 4\]"):
        make_store(backend=backend).lookup(make_ids())


# ------------------------------------------------------------------ remove


def test_remove_is_idempotent(store):
    assert store.remove_from_store() == 3
    assert not store.is_populated()
    assert store.backend.keys() == []
    assert store.remove_from_store() == 0
    assert store.remove_from_store(force=True) == 0


def test_remove_partial_layer(backend):
    s = make_store(backend=backend)
    s.populate(make_tables())
    backend.delete("engram:l3:h0")
    assert s.remove_from_store() == 2
    assert backend.keys() == []


def test_remove_delete_errors_raise_or_warn_with_force(backend):
    s = make_store(backend=FaultyBackend(backend, fail_delete_on="h1"))
    s.populate(make_tables())
    with pytest.raises(RuntimeError, match=r"removed 2 key\(s\).*engram:l3:h1"):
        s.remove_from_store()
    assert backend.keys() == ["engram:l3:h1"]  # every key was attempted before raising
    with pytest.warns(RuntimeWarning, match="force=True"):
        assert s.remove_from_store(force=True) == 0


# ------------------------------------------------------------------ config


@pytest.mark.parametrize(
    "sizes,dim,pattern",
    [
        ([], 4, "table_vocab_sizes"),
        ([7, 0, 13], 4, r"table_vocab_sizes\[1\].*0"),
        ([7, -3], 4, r"table_vocab_sizes\[1\].*-3"),
        ([7, 2.5], 4, r"table_vocab_sizes\[1\].*2.5"),
        ([True, 7], 4, r"table_vocab_sizes\[0\]"),
        ("abc", 4, "table_vocab_sizes"),
        (7, 4, "table_vocab_sizes"),
        ([7, 11], 0, "embedding_dim.*0"),
        ([7, 11], -2, "embedding_dim.*-2"),
        ([7, 11], 4.0, "embedding_dim"),
    ],
)
def test_config_validation(sizes, dim, pattern):
    with pytest.raises(ValueError, match=pattern):
        TableStoreConfig(sizes, dim)


def test_config_normalises_list_to_tuple_and_is_frozen():
    cfg = TableStoreConfig([7, 11], 4)
    assert cfg.table_vocab_sizes == (7, 11)
    assert cfg.num_heads == 2
    with pytest.raises(AttributeError):
        cfg.embedding_dim = 8  # type: ignore[misc]


@pytest.mark.parametrize("layer_id", [-1, 1.0, "0", True])
def test_bad_layer_id(layer_id):
    with pytest.raises(ValueError, match="layer_id"):
        TableStore(layer_id, TableStoreConfig(SIZES, D))


# ------------------------------------------------------------------ shared backend


def test_two_layers_share_a_backend_without_colliding(backend):
    l0, l1 = make_store(0, backend), make_store(1, backend)
    t0, t1 = make_tables(seed=10), make_tables(seed=11)
    l0.populate(t0)
    l1.populate(t1)
    assert len(backend.keys()) == 6
    ids = make_ids()
    torch.testing.assert_close(l0.lookup(ids), reference(t0, ids), rtol=0, atol=0)
    torch.testing.assert_close(l1.lookup(ids), reference(t1, ids), rtol=0, atol=0)
    assert l0.remove_from_store() == 3
    assert sorted(backend.keys()) == ["engram:l1:h0", "engram:l1:h1", "engram:l1:h2"]
    torch.testing.assert_close(l1.lookup(ids), reference(t1, ids), rtol=0, atol=0)


def test_default_backends_are_independent():
    """TableStore's default backend: in-process, one per store."""
    a, b = make_store(), make_store()
    a.populate(make_tables())
    assert a.backend is not b.backend
    assert not b.is_populated()
    b.populate(make_tables(seed=5))  # same layer id, separate default backend


def test_table_backend_is_abstract():
    with pytest.raises(TypeError):
        TableBackend()  # type: ignore[abstract]


# ------------------------------------------------------------------ CUDA


@pytest.mark.cuda
def test_cuda_backend_with_cpu_and_cuda_ids():
    s = TableStore(3, TableStoreConfig(SIZES, D), InProcessBackend(device="cuda"))
    tables = make_tables()
    s.populate(tables)
    ids = make_ids()
    ref = reference(tables, ids)
    for row_ids in (ids, ids.cuda()):
        out = s.lookup(row_ids)
        assert out.is_cuda and out.dtype == torch.float32 and out.shape == (2, 5, 3, D)
        torch.testing.assert_close(out.cpu(), ref, rtol=0, atol=0)
    bad = ids.cuda()
    bad[0, 0, 2] = 13
    with pytest.raises(IndexError, match="head 2"):
        s.lookup(bad)
    assert all(t.is_cuda for t in s.tables())
