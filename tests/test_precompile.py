"""The cold compile's worker processes (model/precompile.py): which blocks each worker compiles and which this
process compiles itself, how many workers a host gets, and, end to end (the CPU, or the GPU when there is
one), that a worker's structure reaches this process through the caches (every FX-graph and AOTAutograd lookup
of it hits), that this process's own structure is compiled before the step without keeping a gradient or
moving the random state, with the loss and gradients of the eager model; a warm restart, told by the manifest,
starts no worker; a worker that fails is an error naming its blocks."""

from __future__ import annotations

import pytest
import torch

import megacpp_lab.model.precompile as precompile_module
from megacpp_lab.bench.harness import ModelShape, TrainingStep, build_model, make_batch
from megacpp_lab.model.config import model_config
from megacpp_lab.model.checkpointing import CheckpointingPolicy, apply_ac
from megacpp_lab.model.hybrid import HybridLM
from megacpp_lab.model.parallelize import ParallelConfig
from megacpp_lab.model.precompile import heaviest_block, precompile, precompile_plan, worker_count
from megacpp_lab.varlen import build_context

DEV = "cuda" if torch.cuda.is_available() else "cpu"
TRITON = dict(m2rnn=dict(kernel="triton"), ssd=dict(kernel="triton"), mamba3=dict(kernel="triton"))

pytestmark = pytest.mark.usefixtures("fresh_dynamo")  # tests/conftest.py


def _tiny(**overrides) -> HybridLM:
    return HybridLM(model_config("tiny", "cpu", **{**TRITON, **overrides}))


def test_the_plan_keeps_the_heaviest_structure_here_and_deals_the_others_to_the_workers_in_block_order():
    model = _tiny(n_layers=8)  # AMRMAMRM, Engram at 1: structures A (0), M+engram (1), R (2), M (3)
    assert heaviest_block(model) == 1  # M with Engram: the most modules
    assert precompile_plan(model, 8) == [[0], [2], [3]]
    assert precompile_plan(model, 2) == [[0, 3], [2]]
    assert precompile_plan(model, 0) == []
    # under a budget the last block is never recomputed: its own graph, its own worker
    apply_ac(model, CheckpointingPolicy.parse("0.3"), compiled=True)
    assert precompile_plan(model, 8) == [[0], [2], [3], [7]]
    assert precompile_plan(_tiny(n_layers=1, engram_layers=()), 8) == []  # one structure: this process compiles it


@pytest.mark.parametrize(("limit", "others", "cpus", "expected"), [
    (8, 3, 16, 3), (2, 3, 16, 2), (8, 3, 2, 0), (8, 3, 6, 2), (0, 3, 16, 0), (8, 0, 16, 0)])  # fmt: skip
def test_workers_are_capped_by_the_config_the_structures_and_the_cores(limit, others, cpus, expected):
    assert worker_count(limit, others, cpus) == expected


def test_compile_workers_fails_closed_naming_the_field():
    with pytest.raises(ValueError, match="compile_workers must be an int >= 0"):
        ParallelConfig(compile_workers=-1)
    with pytest.raises(ValueError, match="compile_workers"):
        ParallelConfig(compile_workers=True)


def _cold_caches(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton"))
    monkeypatch.setattr(precompile_module.os, "cpu_count", lambda: 8)  # a CI host has two cores: allow a worker


@pytest.mark.slow
def test_a_workers_structure_reaches_the_step_through_the_caches_with_the_eager_loss(tmp_path, monkeypatch):
    from torch._dynamo.utils import clear_compilation_metrics, get_compilation_metrics

    _cold_caches(tmp_path, monkeypatch)
    config = model_config("tiny", DEV, **TRITON, n_layers=2)  # A, then M with Engram: one worker
    tokens, doc_ids, targets = make_batch(ModelShape("tiny", 2, 32, 3), config.vocab_size, DEV)
    # fp32 on a GPU too: the comparison is of the compiled graphs, not of bf16 rounding
    reference = build_model(config, DEV, parallel=ParallelConfig(dtype="fp32"))
    eager = TrainingStep(reference, tokens, build_context(doc_ids), targets)()
    # torch.compile's entry (saved_graphs off): dynamo traces block 0 here and finds the rest in the caches
    model = build_model(config, DEV, parallel=ParallelConfig(dtype="fp32", compile=True, saved_graphs=False))
    step = TrainingStep(model, tokens, build_context(doc_ids), targets)
    clear_compilation_metrics()  # this process's records of earlier tests' compiles
    rng = torch.get_rng_state(), torch.cuda.get_rng_state() if DEV == "cuda" else None
    job = precompile(model, tokens, build_context(doc_ids), targets)  # what the step's first call does
    assert job is not None and job.plan == [[0]] and job.own == 1 and job.own_s > 0  # M+Engram here, A in a worker
    assert all(p.grad is None for p in model.parameters())  # the own compile's backward kept no gradient
    assert torch.equal(torch.get_rng_state(), rng[0])
    assert DEV != "cuda" or torch.equal(torch.cuda.get_rng_state(), rng[1])
    loss = step()
    assert step.precompile is job  # once per model
    report = job.reports[0]
    assert report["blocks"] == [0] and 0 < report["built_s"] < report["compiled_s"], report
    forward = [m for m in get_compilation_metrics() if m.is_forward is not False and getattr(m, "is_runtime", None) is not True]
    assert len(forward) == 2, forward
    own, worker = forward  # in job.compile_order: block 1 here, then block 0 from the worker's caches
    assert job.compile_order == [1, 0]
    assert own.inductor_fx_local_cache_miss_count and not own.aotautograd_local_cache_hit_count
    assert worker.aotautograd_local_cache_hit_count == 1 and not worker.inductor_fx_local_cache_miss_count, worker
    torch.testing.assert_close(loss, eager, atol=1e-5, rtol=1e-5)
    for (name, a), b in zip(reference.named_parameters(), model.parameters()):
        if a.grad is not None:
            torch.testing.assert_close(b.grad, a.grad, atol=1e-4, rtol=1e-3, msg=lambda m, n=name: f"{n}: {m}")
    assert step.precompile.manifest.is_file()
    # a new model on the same batch shape: the manifest says its structures are in the caches, no worker starts
    again = build_model(config, DEV, parallel=ParallelConfig(dtype="fp32", compile=True, saved_graphs=False))
    assert precompile(again, tokens, build_context(doc_ids), targets) is None
    # another parallel config is another model to the caches: its manifest is its own
    other = build_model(config, DEV, parallel=ParallelConfig(dtype="fp32", compile=True, compile_workers=1,
                                                               saved_graphs=False))  # fmt: skip
    assert precompile_module.manifest_path(other, tokens, build_context(doc_ids), targets) != step.precompile.manifest


def test_the_precompiled_graphs_serve_a_step_whose_context_carries_the_block_mask(tmp_path, monkeypatch):
    """On a GPU the step's context gains the flex block mask before the blocks run (HybridLM.attention_context,
    for the A blocks that read it), and a saved graph's key says whether the context has one: the structures
    precompiled for the step must see the context the step will, or the step compiles each of them again. (At
    7d4a5dc on the H200, bench compile's base step compiled [M, engram] twice and the workers' R and M again.)
    Here the CPU takes the GPU's rule: every structure is compiled once, the worker's loaded by the step, and the
    step's loss and gradients equal eager's (the CPU's A blocks run sdpa, which reads no block mask). (This test
    also holds what a test of its own held before, the worker's saved graph against eager, at the cost of one
    precompile less on CI.)"""
    from megacpp_lab.model.hybrid import HybridLM

    _cold_caches(tmp_path, monkeypatch)
    monkeypatch.setattr(HybridLM, "attention_context", lambda self, ctx: ctx.with_block_mask())
    config = model_config("tiny", DEV, **TRITON, n_layers=2)  # A in the worker, M+Engram here
    tokens, doc_ids, targets = make_batch(ModelShape("tiny", 2, 32, 3), config.vocab_size, DEV)
    reference = build_model(config, DEV, parallel=ParallelConfig(dtype="fp32"))
    eager = TrainingStep(reference, tokens, build_context(doc_ids), targets)()
    model = build_model(config, DEV, parallel=ParallelConfig(dtype="fp32", compile=True))
    job = precompile(model, tokens, build_context(doc_ids), targets)
    assert job is not None and job.plan == [[0]] and job.own == 1
    loss = TrainingStep(model, tokens, build_context(doc_ids), targets)()
    events = sorted((tuple(e["structure"]), e["how"]) for e in model.saved_graphs.events)
    assert events == [(("A",), "loaded"), (("M", "engram"), "compiled")], model.saved_graphs.events
    torch.testing.assert_close(loss, eager, atol=1e-5, rtol=1e-5)
    for (name, a), b in zip(reference.named_parameters(), model.parameters()):
        if a.grad is not None:
            torch.testing.assert_close(b.grad, a.grad, atol=1e-4, rtol=1e-3, msg=lambda m, n=name: f"{n}: {m}")


def test_a_failed_worker_is_an_error_naming_its_blocks_and_the_switch(tmp_path, monkeypatch):
    _cold_caches(tmp_path, monkeypatch)
    config = model_config("tiny", DEV, **TRITON, n_layers=2)
    tokens, doc_ids, targets = make_batch(ModelShape("tiny", 2, 32, 3), config.vocab_size, DEV)
    model = build_model(config, DEV, parallel=ParallelConfig(compile=True))
    # this process's own compile skipped: the kill below lands while the worker still imports torch, whatever
    # the host's speed (a worker can finish its structure before this process finishes its own)
    monkeypatch.setattr(precompile_module, "_compile_here", lambda *args: None)
    job = precompile(model, tokens, build_context(doc_ids), targets)
    assert job is not None
    job.procs[0].kill()  # a worker that dies (out of memory, a crash) before its structure is in the caches
    assert precompile(model, tokens, build_context(doc_ids), targets) is job  # once per model
    with pytest.raises(RuntimeError, match=r"compile worker 0 \(blocks \[0\]\) exited with status .*compile_workers=0"):
        model(tokens, build_context(doc_ids), targets)  # block 0 waits for its worker
