import os

import torch

# Triton kernels run under the interpreter on CPU; it must be set before any kernel module is imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("MPLBACKEND", "Agg")

import pytest  # noqa: E402


# The unit tests' files start heaviest first (make test: pytest-xdist's loadfile over two workers, with
# --no-loadscope-reorder, without which xdist deals the files by their count of tests), so that the workers end together
# instead of one running a long file alone at the end; the rest keep their path order. Seconds of each file's tests at
# a391a83 on the 2-core CI-like machine (two workers, one OpenMP thread each; 2405 s in all, the run 1263 s): cli 389,
# mamba3 242, memory_estimate 220, parallelize 184, memory_sweep 177, train 148, precompile 135, saved_graphs 124, fsdp
# 113, checkpointing 92, dsa_sparse 65, profile 63, recompiles 62. loadfile's rule (a worker is dealt the next file once
# at most two of its tests are pending), simulated for two workers on the per-test seconds of a later three-worker run
# (slower: 3893 s in all): dealt by count of tests the workers end at 2029 and 1864 s, in this order at 1932 and 1960.
HEAVIEST_FIRST = ("test_cli", "test_mamba3", "test_memory_estimate", "test_parallelize", "test_memory_sweep",
                  "test_train", "test_precompile", "test_saved_graphs", "test_fsdp", "test_checkpointing",
                  "test_dsa_sparse", "test_profile", "test_recompiles")  # fmt: skip


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    from megacpp_lab.testing.ordering import heaviest_first  # here: after TRITON_INTERPRET is set above

    heaviest_first(items, HEAVIEST_FIRST, ".py")  # only the unit tests move (a run with notebooks keeps theirs)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def fresh_dynamo():
    """A dynamo with no compiled graph and zeroed counters, before and after the test (graph counts start at 0)."""
    from megacpp_lab.bench.harness import fresh_dynamo as reset

    reset()
    yield
    reset()


@pytest.fixture
def sample_leak_reports():
    """The leak harness on 2 real packed rows of the byte sample (24 tokens, a document boundary at 9),
    a fixed 32-wide embedding in front of `layer(x, ctx=build_context(doc_ids))` (testing.with_doc_ids):
    (the report with the context, the control with it withheld, ctx=None). The mixer tests assert on both."""
    from megacpp_lab.data import boundary_windows, load_sample
    from megacpp_lab.testing import check_leaks, with_doc_ids

    def run(layer, device):
        w = boundary_windows(load_sample()[0].batch, 2, 24, lead=9)
        torch.manual_seed(0)
        emb = torch.nn.Embedding(259, 32).to(device)
        tokens, doc_ids = w.tokens.to(device), w.doc_ids.to(device)
        mixer = with_doc_ids(layer)
        report = check_leaks(lambda t, d: mixer(emb(t), d), tokens, doc_ids, vocab_size=259,
                             causal_positions=range(0, 24, 2))  # fmt: skip
        leaky = check_leaks(lambda t, d: mixer(emb(t), None), tokens, doc_ids, vocab_size=259, causal=False)
        return report, leaky

    return run


# ------------------------------------------------------------------ Mooncake (the optional `mooncake` extra)


def _require_mooncake() -> None:
    """Skip, naming what is missing, only when the package or libibverbs1 is absent; any other failure
    (a master that does not start, a client that cannot join) is an error, never a skip."""
    from megacpp_lab.store.mooncake import mooncake_unavailable

    reason = mooncake_unavailable()
    if reason is not None:
        pytest.skip(f"Mooncake backend not testable here: {reason}")


@pytest.fixture(scope="session")
def mooncake_installed() -> None:
    """Skips the test, naming the package or libibverbs1, when Mooncake cannot run here."""
    _require_mooncake()


@pytest.fixture(scope="session")
def mooncake_master():
    """One local mooncake_master for the session (default 10 s lease)."""
    _require_mooncake()
    from megacpp_lab.store.mooncake_master import MooncakeMaster

    with MooncakeMaster() as master:
        yield master


@pytest.fixture(scope="session")
def _mooncake_session_backend(mooncake_master):
    from megacpp_lab.store.mooncake_backend import MooncakeBackend

    # force_remove: the contract's remove_from_store works right after a lookup; without it the master's
    # read lease refuses that remove (OBJECT_HAS_LEASE), which tests/test_mooncake_store.py tests on its own
    with MooncakeBackend(mooncake_master.config(force_remove=True, segment_bytes=64 << 20)) as backend:
        yield backend


@pytest.fixture
def mooncake_backend(_mooncake_session_backend):
    """The session's Mooncake backend (one client: joining takes ~25 ms, leaving 1-2 s), emptied of every
    key before and after the test."""
    backend = _mooncake_session_backend
    for key in backend.keys():
        backend.delete(key)
    yield backend
    for key in backend.keys():
        backend.delete(key)
