"""Regional compile adds no graph when the number of documents changes: after the first step of each grad
mode, batches of 1, 2, 3, 17 and 64 documents in all reuse the graphs, with gradients (training steps) and
without (validation: model.eval() under torch.no_grad()).

The backend is aot_eager, not a graph-capturing backend: the guard that recompiled a batch of one document
(the M2RNN graph's `n_seqs != 1`) was added while AOTAutograd traced the graph, which a dynamo-only backend
never does. dynamo's guards and recompiles are the same under inductor. CPU: the Triton scans run under
TRITON_INTERPRET (tests/conftest.py); a GPU runs them natively.

The graph count this pins, per block structure: one graph per grad mode the model runs in (two when it is
trained and validated), whatever the number of documents, one of them included, and whether the model is
in train() or eval() mode (the Engram branch holds no Dropout module at dropout=0).
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import pytest
import torch

from megacpp_lab.data import next_token_targets
from megacpp_lab.kernels.m2rnn import m2rnn_scan
from megacpp_lab.model.config import model_config
from megacpp_lab.model.hybrid import HybridLM
from megacpp_lab.model.parallelize import apply_compile, block_structures, compile_stats
from megacpp_lab.varlen import build_context, doc_ids_from_cu_seqlens, packed_cu_seqlens

DEV = "cuda" if torch.cuda.is_available() else "cpu"
# one head per scan: the interpreter's time grows with the programs launched (documents x heads), and the
# guards do not depend on the head count (a static size). The structures are the tiny preset's: A, M with
# Engram, R, M.
SCANS = dict(ssd=dict(kernel="triton", n_heads=1), mamba3=dict(kernel="triton", n_heads=1),
             m2rnn=dict(kernel="triton", n_heads=1))
T = 64  # one row of 64 tokens holds 1 to 64 documents
COUNTS = (1, 2, 3, 17, 64)  # documents in all (B=1)
FIRST = 5  # the first batch of each grad mode, a count not in COUNTS


pytestmark = pytest.mark.usefixtures("fresh_dynamo")  # tests/conftest.py


def _in_thread(fn: Callable[[], None]) -> None:
    """Run fn in a fresh thread and re-raise what it raised. The interpreted scans call deep chains of
    Python frames; on CPython 3.11, started from pytest's stack depth (deeper still under xdist), they
    crossed a 16 KiB frame-stack chunk boundary at every step, and the chunk was mapped and unmapped each
    time: 4.7 M page faults and 40 s of system time, 85 s in all against 40 s from a shallow stack (129 s
    under `-n 2`). dynamo compiles and runs the blocks in any thread."""
    errors: list[BaseException] = []

    def run() -> None:
        try:
            fn()
        except BaseException as e:  # noqa: BLE001  (re-raised in the test's thread)
            errors.append(e)

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    if errors:
        raise errors[0]


def _batch(docs: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """tokens, doc_ids, targets [1,T]: `docs` documents of seeded-random lengths (bench.harness.make_batch's)."""
    g = torch.Generator().manual_seed(seed)
    doc_ids = doc_ids_from_cu_seqlens(packed_cu_seqlens(1, T, docs, g), 1, T)
    tokens = torch.randint(3, 512, (1, T), generator=g)
    return tokens.to(DEV), doc_ids.to(DEV), next_token_targets(tokens, doc_ids, -100).to(DEV)


def _step(model: HybridLM, docs: int, seed: int, grad: bool) -> torch.Tensor:
    tokens, doc_ids, targets = _batch(docs, seed)
    ctx = build_context(doc_ids).to(DEV)
    assert ctx.n_seqs == docs
    if not grad:
        with torch.no_grad():
            return model(tokens, ctx, targets).loss
    model.zero_grad(set_to_none=True)
    loss = model(tokens, ctx, targets).loss
    loss.backward()
    return loss.detach()


def test_no_graph_added_over_1_2_3_17_64_documents_with_and_without_gradients():
    _in_thread(_document_counts)


def _document_counts() -> None:
    torch.manual_seed(0)
    model = HybridLM(model_config("tiny", DEV, **SCANS)).to(DEV)
    n = len(block_structures(model))
    assert n == 4
    apply_compile(model, backend="aot_eager")
    added: dict[str, int] = {}
    for grad in (True, False):
        model.train(grad)  # training steps in train(), validation in eval() under no_grad
        assert torch.isfinite(_step(model, FIRST, 0, grad))
        first = compile_stats()
        # one graph per structure and grad mode: the first no_grad call adds one per structure
        assert first.graphs == n * (1 if grad else 2) and first.graph_breaks == 0, first
        for i, docs in enumerate(COUNTS, start=1):
            assert torch.isfinite(_step(model, docs, i, grad))
            added[f"{'grad' if grad else 'no_grad'}, {docs} docs"] = compile_stats().graphs - first.graphs
    # the other train()/eval() mode of each grad mode: nothing in a block reads `training` (no Dropout at p=0)
    model.eval()
    _step(model, 1, 7, True)
    model.train()
    _step(model, 1, 8, False)
    added["grad in eval(), no_grad in train()"] = compile_stats().graphs - 2 * n
    assert not any(added.values()), added
    assert compile_stats().graph_breaks == 0


@pytest.mark.parametrize("grad", [True, False], ids=["grad", "no_grad"])
def test_compiled_m2rnn_scan_of_one_document_reuses_the_graph(grad):
    """The root cause on its own: the scan over a PackedContext, compiled, then given one document. With
    h0=None no [n_seqs, H, K, V] tensor is made in the graph, whose contiguity check guarded n_seqs != 1."""
    H, K, V = 1, 16, 16
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, T, H, K, generator=g).mul(0.5).to(DEV).requires_grad_(grad) for _ in range(3))
    f = torch.sigmoid(torch.randn(1, T, H, generator=g)).to(DEV).requires_grad_(grad)
    W = torch.randn(H, V, V, generator=g).mul(0.1).to(DEV).requires_grad_(grad)
    scan = torch.compile(lambda ctx: m2rnn_scan(q, k, v, f, W, ctx=ctx, chunk=16, kernel="triton"),
                         backend="aot_eager", fullgraph=True)  # fmt: skip
    with torch.set_grad_enabled(grad):
        for docs in (4, 1):
            ctx = build_context(_batch(docs, docs)[1]).to(DEV)
            y = scan(ctx)
            ref = m2rnn_scan(q, k, v, f, W, ctx=ctx, chunk=16, kernel="reference")
            torch.testing.assert_close(y, ref, atol=1e-5, rtol=1e-5)
            if grad:
                dy = torch.randn_like(y)
                got = torch.autograd.grad(y, (q, k, v, f, W), dy)
                want = torch.autograd.grad(ref, (q, k, v, f, W), dy)
                for a, b in zip(got, want):
                    torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
    assert compile_stats().graphs == 1, compile_stats()
