"""Saved graphs (model/saved_graphs.py): regional compile through dynamo's ahead-of-time entry. A cold model
compiles one graph per (block structure, grad mode) and saves it; another model of the same config, on the same
batch shape, loads them and traces nothing; both equal eager, forward and gradients; other document counts reuse
the graphs; the block's hooks still run; a graph whose guards fail past the limit, and a corrupt file, are errors
that name the block or the file. CPU at the tiny preset (the Triton scans under the interpreter), the GPU at base."""

from __future__ import annotations

import pytest
import torch

from megacpp_lab.bench.harness import ModelShape, TrainingStep, build_model, make_batch
from megacpp_lab.model.config import model_config
from megacpp_lab.model.parallelize import ParallelConfig, block_structures, compile_stats, describe_compile
from megacpp_lab.model.saved_graphs import SavedForward, saved_graphs_dir, unmarked
from megacpp_lab.varlen import build_context

TRITON = dict(m2rnn=dict(kernel="triton"), ssd=dict(kernel="triton"), mamba3=dict(kernel="triton"))
DEV = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.usefixtures("fresh_dynamo")  # tests/conftest.py


@pytest.fixture
def own_caches(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    return tmp_path / "inductor"


def _models(**overrides):
    # A, then M with Engram (the SSD scan reads the context's cu_seqlens, which build_context marks dynamic)
    # sdpa: on a GPU attn_impl 'auto' attends through flex, whose blocks compile with torch.compile, not saved graphs
    config = model_config("tiny", DEV, **{**TRITON, "n_layers": 2, "mla": dict(attn_impl="sdpa"), **overrides})
    fp32 = ParallelConfig(dtype="fp32", compile=True, compile_workers=0)  # the graphs compared, not bf16 rounding
    return config, build_model(config, DEV, parallel=ParallelConfig(dtype="fp32")), lambda: build_model(config, DEV, parallel=fp32)


def _grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _assert_same(loss, grads, ref_loss, ref_grads):
    torch.testing.assert_close(loss, ref_loss, atol=1e-5, rtol=1e-5)
    assert grads.keys() == ref_grads.keys()
    for name, g in grads.items():
        torch.testing.assert_close(g, ref_grads[name], atol=1e-4, rtol=1e-3, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.slow
def test_a_cold_model_saves_one_graph_per_structure_and_a_new_one_loads_them_with_the_eager_result(own_caches):
    config, reference, compiled = _models()
    tokens, doc_ids, targets = make_batch(ModelShape("tiny", 2, 32, 3), config.vocab_size, DEV)
    ref_loss = TrainingStep(reference, tokens, build_context(doc_ids), targets)()
    ref_grads = _grads(reference)
    n = len(block_structures(reference))

    cold = compiled()
    assert all(isinstance(b.forward, SavedForward) for b in cold.blocks)
    loss = TrainingStep(cold, tokens, build_context(doc_ids), targets)()
    _assert_same(loss, _grads(cold), ref_loss, ref_grads)
    assert cold.saved_graphs.summary()["compiled"] == n and cold.saved_graphs.summary()["loaded"] == 0
    assert len(list(saved_graphs_dir().glob("*.bin"))) == n
    assert "0 loaded" in describe_compile(1.0, model=cold) and ", cold:" in describe_compile(1.0, model=cold)
    # other document counts per row: the same graphs (cu_seqlens' length is dynamic in them)
    for docs in (1, 7):
        t, d, y = make_batch(ModelShape("tiny", 2, 32, docs), config.vocab_size, DEV, seed=docs)
        TrainingStep(cold, t, build_context(d), y)()
    assert cold.saved_graphs.summary()["compiled"] == n
    with torch.no_grad():  # grad mode is in the guards: one graph per structure more
        cold(tokens, build_context(doc_ids), targets)
    assert cold.saved_graphs.summary()["compiled"] == 2 * n

    torch._dynamo.reset()
    warm = compiled()  # what a new process builds: the same config on the same batch shape
    graphs_before = compile_stats().graphs
    loss = TrainingStep(warm, tokens, build_context(doc_ids), targets)()
    _assert_same(loss, _grads(warm), ref_loss, ref_grads)
    summary = warm.saved_graphs.summary()
    assert summary["loaded"] == n and summary["compiled"] == 0, warm.saved_graphs.events
    assert compile_stats().graphs == graphs_before  # dynamo traced nothing
    assert ", warm:" in describe_compile(1.0, model=warm)
    with torch.no_grad():
        warm(tokens, build_context(doc_ids), targets)
    assert warm.saved_graphs.summary() == {**summary, "loaded": 2 * n, "loaded_s": warm.saved_graphs.summary()["loaded_s"]}


@pytest.mark.slow
def test_hooks_run_around_a_saved_graph_and_a_guard_failure_past_the_limit_names_the_block(own_caches):
    config, _, compiled = _models(n_layers=1, engram_layers=())  # one A block
    tokens, doc_ids, targets = make_batch(ModelShape("tiny", 1, 32, 2), config.vocab_size, DEV)
    model = compiled()
    calls = []
    model.blocks[0].register_forward_hook(lambda module, args, out: calls.append(tuple(out.shape)))
    model(tokens, build_context(doc_ids), targets)
    assert calls == [(1, 32, config.d_model)]  # nn.Module ran the hook around the saved graph, eagerly

    model.saved_graphs.limit = 1
    block, ctx = model.blocks[0], build_context(doc_ids)
    x = model.embed(tokens).detach()  # requires_grad off where the graph was traced with it on: the guards refuse
    with pytest.raises(RuntimeError, match=r"block 0 \(A\): 1 saved graphs for its key and none passes its guards"):
        block(x, tokens, ctx)


@pytest.mark.slow
def test_under_a_remat_budget_each_budget_gets_its_own_graph_and_the_step_equals_eager(own_caches):
    config = model_config("tiny", DEV, **TRITON, n_layers=3, pattern="AAA", engram_layers=(), mla=dict(attn_impl="sdpa"))
    tokens, doc_ids, targets = make_batch(ModelShape("tiny", 2, 32, 3), config.vocab_size, DEV)
    reference = build_model(config, DEV, parallel=ParallelConfig(dtype="fp32"))
    ref_loss = TrainingStep(reference, tokens, build_context(doc_ids), targets)()
    model = build_model(config, DEV, parallel=ParallelConfig(dtype="fp32", compile=True, remat="0.3", compile_workers=0))
    loss = TrainingStep(model, tokens, build_context(doc_ids), targets)()
    _assert_same(loss, _grads(model), ref_loss, _grads(reference))
    # blocks 0 and 1 share the graph partitioned at 0.3; block 2, the last, is never recomputed: a graph of its own
    assert model.saved_graphs.summary()["compiled"] == 2
    assert len({e["file"] for e in model.saved_graphs.events}) == 2


def test_a_corrupt_saved_graph_is_an_error_naming_the_file(own_caches):
    config, _, compiled = _models(n_layers=1, engram_layers=())
    tokens, doc_ids, targets = make_batch(ModelShape("tiny", 1, 32, 2), config.vocab_size, DEV)
    model = compiled()
    block, ctx = model.blocks[0], build_context(doc_ids)
    x = model.embed(tokens)
    key = model.saved_graphs.key(("A",), None, x, tokens, ctx)
    saved_graphs_dir().mkdir(parents=True)
    (saved_graphs_dir() / f"{key}-0.bin").write_bytes(b"not a graph")
    with pytest.raises(RuntimeError, match=rf"saved graph .*{key}-0\.bin.* cannot be loaded.*delete it"):
        block(x, tokens, ctx)


def test_the_unmarked_context_shares_memory_and_drops_only_the_marks():
    _, doc_ids, _ = make_batch(ModelShape("tiny", 2, 32, 3), 512, "cpu")
    ctx = build_context(doc_ids)
    assert hasattr(ctx.cu_seqlens, "_dynamo_weak_dynamic_indices")  # build_context marks the document count dynamic
    view = unmarked(ctx)
    assert not hasattr(view.cu_seqlens, "_dynamo_weak_dynamic_indices")
    assert view.cu_seqlens.data_ptr() == ctx.cu_seqlens.data_ptr() and torch.equal(view.cu_seqlens, ctx.cu_seqlens)
    assert view.doc_ids is ctx.doc_ids and view.positions is ctx.positions and view.max_seqlen == ctx.max_seqlen


def test_saved_graphs_apply_to_inductor_alone_and_fail_closed_naming_the_field():
    config = model_config("tiny", "cpu", **TRITON, n_layers=1, engram_layers=())
    other = build_model(config, "cpu", parallel=ParallelConfig(compile=True, backend="aot_eager"))
    assert "forward" not in vars(other.blocks[0]) and not hasattr(other, "saved_graphs")  # torch.compile's entry
    plain = build_model(config, "cpu", parallel=ParallelConfig(compile=True, saved_graphs=False))
    assert "forward" not in vars(plain.blocks[0]) and plain.blocks[0]._compiled_call_impl is not None
    with pytest.raises(ValueError, match=r"ParallelConfig.saved_graphs must be a bool"):
        ParallelConfig(compile=True, saved_graphs="yes")


@pytest.mark.cuda
def test_on_a_gpu_an_auto_attention_block_compiles_with_torch_compile_and_the_rest_through_saved_graphs(own_caches):
    """attn_impl 'auto' attends through flex in a compiled block on a GPU, and a saved graph holding flex fails to load
    (parallelize._attends_through_flex): that block compiles with torch.compile, the others through saved graphs."""
    config = model_config("tiny", "cuda", **TRITON, n_layers=2)
    model = build_model(config, "cuda", parallel=ParallelConfig(compile=True, compile_workers=0))
    assert model.needs_block_mask
    assert not isinstance(model.blocks[0].forward, SavedForward) and isinstance(model.blocks[1].forward, SavedForward)
    tokens, doc_ids, targets = make_batch(ModelShape("tiny", 2, 128, 3), config.vocab_size, "cuda")
    loss = TrainingStep(model, tokens, build_context(doc_ids), targets)()
    assert torch.isfinite(loss) and model.saved_graphs.summary()["compiled"] == 1


@pytest.mark.cuda
def test_on_a_gpu_a_varlen_attention_block_runs_through_a_saved_graph(own_caches):
    """attn_impl 'varlen' on a GPU runs torch's flash varlen attention (a custom op, no block mask): every block,
    the attention block too, goes through saved graphs, each structure compiled once and saved, and a step over
    packed documents gives the eager model's loss and gradients (bf16: within its rounding)."""
    config = model_config("tiny", "cuda", **TRITON, n_layers=2, mla=dict(attn_impl="varlen"))
    tokens, doc_ids, targets = make_batch(ModelShape("tiny", 2, 128, 3), config.vocab_size, "cuda")
    reference = build_model(config, "cuda")
    ref_loss = TrainingStep(reference, tokens, build_context(doc_ids), targets)()
    model = build_model(config, "cuda", parallel=ParallelConfig(compile=True, compile_workers=0))
    assert not model.needs_block_mask
    assert all(isinstance(b.forward, SavedForward) for b in model.blocks)
    loss = TrainingStep(model, tokens, build_context(doc_ids), targets)()
    torch.testing.assert_close(loss, ref_loss, atol=2e-2, rtol=2e-2)
    grads, ref_grads = _grads(model), _grads(reference)
    assert grads.keys() == ref_grads.keys()
    for name, g in grads.items():
        err = (g.float() - ref_grads[name].float()).norm() / ref_grads[name].float().norm().clamp_min(1e-12)
        assert err < 5e-2, (name, err.item())
    summary = model.saved_graphs.summary()
    assert summary["compiled"] == len(block_structures(model)) and summary["loaded"] == 0
