"""Regional compile (model/parallelize.py): one graph per block structure, shared by every block of that
structure; the scans stay opaque custom ops; no graph break; no recompile when the number of documents per
row changes from batch to batch; compiled equals eager. CPU at the tiny preset (the Triton scans under the
interpreter), the GPU at the base preset."""

from __future__ import annotations

import time

import pytest
import torch

from megacpp_lab.bench.harness import ModelShape, TrainingStep, build_model, leak_features, make_batch
from megacpp_lab.model.config import model_config
from megacpp_lab.model.hybrid import HybridLM
from megacpp_lab.model.parallelize import apply_compile, block_structures, compile_stats
from megacpp_lab.varlen import build_context

# the scans by name: Triton (the interpreter on a CPU), never the reference loop, which no graph may hold
TRITON = dict(m2rnn=dict(kernel="triton"), ssd=dict(kernel="triton"), mamba3=dict(kernel="triton"))
# the tiny tests run where the kernels can: the GPU when there is one (its Triton kernels are not built for
# the interpreter there), else the CPU under TRITON_INTERPRET (tests/conftest.py)
DEV = "cuda" if torch.cuda.is_available() else "cpu"
# 4 batches of 3, 1, 8 and 2 documents a row (the fewest and the most the tiny rows take): each a new length of the
# context's cu_seqlens (B=2 rows: 7, 3, 17 and 5 offsets), the shape dynamo would recompile for if it were static
# (8 batches of every count 1..8 took two minutes of CI's interpreted scans)
DOCS = [3, 1, 8, 2]


def _tiny(**overrides) -> HybridLM:
    torch.manual_seed(0)
    return HybridLM(model_config("tiny", DEV, **{**TRITON, **overrides})).to(DEV)


class _Capture:
    """A dynamo backend that keeps each graph and runs it as traced (no inductor: the guards, graph count
    and graph breaks are dynamo's, whatever the backend)."""

    def __init__(self) -> None:
        self.graphs: list[torch.fx.GraphModule] = []

    def __call__(self, gm: torch.fx.GraphModule, inputs) -> object:
        self.graphs.append(gm)
        return gm.forward


pytestmark = pytest.mark.usefixtures("fresh_dynamo")  # tests/conftest.py


def _ops(gm: torch.fx.GraphModule) -> set[str]:
    return {str(n.target) for n in gm.graph.nodes if n.op == "call_function" and "megacpp" in str(n.target)}


def test_one_graph_per_block_structure_with_the_scans_as_opaque_ops():
    model = _tiny(**leak_features(4)).eval()
    structures = block_structures(model)
    assert len(structures) == 4 and sum(structures.values()) == 4
    tokens, doc_ids, targets = make_batch(ModelShape("tiny", 2, 32, 3), 512, DEV)
    ctx = build_context(doc_ids)
    with torch.no_grad():
        eager = model(tokens, ctx, targets).loss
    capture = _Capture()
    apply_compile(model, backend=capture)
    with torch.no_grad():
        compiled = model(tokens, ctx, targets).loss
    stats = compile_stats()
    assert stats.graphs == len(structures) == len(capture.graphs) and stats.graph_breaks == 0, stats
    torch.testing.assert_close(compiled, eager)
    kinds = [k for k, _ in sorted(structures.items(), key=lambda kv: kv[0])]
    # the M block's scan (Mamba-3's op, or Mamba-2's SSD op) and the R block's
    scans = {"megacpp.mamba3_scan_fwd", "megacpp.ssd_scan_fwd", "megacpp.m2rnn_scan_fwd"}
    rope = {"megacpp.mla_rope_q_", "megacpp.mla_rope_kv_fwd"}  # A graphs on a GPU: the RoPE kernels' ops
    angles = {"megacpp.doc_angle_sum"}  # the chunked scan's document angle sums (the Triton op sums its own)
    for gm in capture.graphs:
        ops = [op.split(".default")[0] for op in _ops(gm)]
        # every M or R graph holds its scan as one custom op call; an unrolled step loop would hold none
        assert sum(op in scans for op in ops) <= 1 and set(ops) <= scans | rope | angles, ops
    with_scan = sum(1 for gm in capture.graphs if any(op.split(".default")[0] in scans for op in _ops(gm)))
    assert with_scan == sum(1 for k in kinds if k[0] in "MR")


def test_training_steps_at_new_document_counts_add_no_graph():
    model = _tiny().train()
    capture = _Capture()
    apply_compile(model, backend=capture)
    after_first = None
    for i, docs in enumerate(DOCS):
        tokens, doc_ids, targets = make_batch(ModelShape("tiny", 2, 16, docs), 512, DEV, seed=i)
        step = TrainingStep(model, tokens, build_context(doc_ids), targets)
        loss = step()
        assert torch.isfinite(loss)
        if i == 0:
            after_first = compile_stats()
    stats = compile_stats()
    assert after_first.graphs == len(block_structures(model)) == 4, after_first
    assert stats.graphs == after_first.graphs and stats.graph_breaks == 0, (after_first, stats)
    assert len(set(DOCS)) == len(DOCS)


def test_inductor_compiled_step_equals_eager_loss_and_gradients():
    eager, compiled = _tiny().train(), _tiny().train()
    apply_compile(compiled)
    tokens, doc_ids, targets = make_batch(ModelShape("tiny", 2, 32, 4), 512, DEV)
    ctx = build_context(doc_ids)
    losses = [TrainingStep(m, tokens, ctx, targets)() for m in (eager, compiled)]
    torch.testing.assert_close(losses[1], losses[0], atol=1e-5, rtol=1e-5)
    for (name, a), b in zip(eager.named_parameters(), compiled.parameters()):
        if a.grad is not None:
            torch.testing.assert_close(b.grad, a.grad, atol=1e-4, rtol=1e-3, msg=lambda m, n=name: f"{n}: {m}")
    stats = compile_stats()
    assert stats.graph_breaks == 0 and stats.aot_graphs >= stats.graphs == 4, stats


def test_apply_compile_counts_its_graphs_against_the_recompile_limit_and_refuses_a_non_model():
    """tiny with every branch: 4 structures, each with and without gradients. Under a budget the last block
    (never recomputed) compiles apart: one more per grad mode. Past the limit dynamo would run a block eager
    with a warning, so apply_compile raises the limit to the count (never lowers it)."""
    from megacpp_lab.model.checkpointing import CheckpointingPolicy, apply_ac
    from megacpp_lab.model.parallelize import graphs_needed

    assert graphs_needed(_tiny(**leak_features(4))) == 8
    budgeted = _tiny()  # AMRM, Engram at 1: the last block is the only plain M, so its budget adds no graph
    apply_ac(budgeted, CheckpointingPolicy.uniform(0.3), compiled=True)
    assert graphs_needed(budgeted) == 8
    deep = _tiny(n_layers=8)  # AMRMAMRM: blocks 3 and 7 share a structure, the last one's budget is its own
    apply_ac(deep, CheckpointingPolicy.uniform(0.3), compiled=True)
    assert graphs_needed(deep) == 2 * (len(block_structures(deep)) + 1)
    with torch._dynamo.config.patch(recompile_limit=3):
        apply_compile(deep, backend="eager")
        assert torch._dynamo.config.recompile_limit == graphs_needed(deep)
    with torch._dynamo.config.patch(recompile_limit=64):
        apply_compile(_tiny(), backend="eager")
        assert torch._dynamo.config.recompile_limit == 64
    with pytest.raises(TypeError, match="expected a HybridLM"):
        apply_compile(torch.nn.Linear(2, 2))


@pytest.mark.cuda
def test_base_model_compiles_regionally_on_gpu_without_recompiles_across_document_counts():
    """The base preset, bf16, inductor: four graphs for twelve blocks, no graph break, none added over 20
    training steps of 1..64 documents per row, and the compiled loss equals the eager one. (Every call here
    runs with gradients on: grad mode is part of dynamo's guards, so a no_grad call would add its own
    graphs.)"""
    config = model_config("base", "cuda")
    model = build_model(config, "cuda")
    tokens, doc_ids, targets = make_batch(ModelShape("base", 2, 4096, 8), config.vocab_size, "cuda")
    ctx = build_context(doc_ids)
    eager = TrainingStep(model, tokens, ctx, targets)()  # no optimizer: the weights do not move
    apply_compile(model)
    start = time.perf_counter()
    compiled = TrainingStep(model, tokens, ctx, targets)()
    torch.cuda.synchronize()
    print(f"first compiled step (cold compile, forward and backward): {time.perf_counter() - start:.1f} s")
    assert abs(compiled.item() - eager.item()) < 2e-2 * abs(eager.item()), (compiled.item(), eager.item())
    after_first = compile_stats()
    for i, docs in enumerate([1 + (13 * i) % 64 for i in range(20)]):
        tokens, doc_ids, targets = make_batch(ModelShape("base", 2, 4096, docs), config.vocab_size, "cuda", seed=i)
        assert torch.isfinite(TrainingStep(model, tokens, build_context(doc_ids), targets)())
    stats = compile_stats()
    print(f"after the first step: {after_first}; after 20 more: {stats}")
    assert after_first.graphs == len(block_structures(model)) == 4, after_first
    assert stats.graphs == after_first.graphs and stats.graph_breaks == 0, stats


# ----------------------------------------------------------------------------- parallelize: the one pipeline


@pytest.mark.parametrize("fields, message", [
    (dict(dtype="fp16"), r"ParallelConfig.dtype must be 'auto' or one of"),
    (dict(compile="yes"), r"ParallelConfig.compile must be a bool"),
    (dict(backend="tvm"), r"ParallelConfig.backend must be one of"),
    (dict(fsdp_blocks_per_group=0), r"ParallelConfig.fsdp_blocks_per_group must be an int >= 1"),
    (dict(remat="A=2"), r"ParallelConfig.remat: CheckpointingPolicy.A budget must be in \[0, 1\]"),
    (dict(remat="0.3"), r"holds a budget, which only regional compile reads"),
    (dict(remat="mm+addmm", compile=True), r"holds an eager-only lever"),
    (dict(remat="full,offload", compile=True), r"holds an eager-only lever"),
])  # fmt: skip
def test_parallel_config_fails_closed_naming_the_field(fields, message):
    from megacpp_lab.model.parallelize import ParallelConfig

    with pytest.raises(ValueError, match=message):
        ParallelConfig(**fields)


@pytest.mark.parametrize("fields", [dict(reshard_after_forward=True), dict(fsdp_blocks_per_group=2)])
def test_parallelize_refuses_fsdp_knobs_without_fsdp(fields):
    """One process (no FSDP2) would run as if reshard_after_forward or fsdp_blocks_per_group were unset: refused,
    naming the field. (With fsdp=True they reach apply_fsdp; tests/test_fsdp.py shards through apply_fsdp with
    blocks_per_group on two processes.)"""
    from megacpp_lab.model.parallelize import ParallelConfig, parallelize

    name = next(iter(fields))
    with pytest.raises(ValueError, match=rf"ParallelConfig.{name} \(.*\) applies to FSDP2 over several processes"):
        parallelize(_tiny(), ParallelConfig(**fields), fsdp=False)


def test_parallel_config_spells_one_policy_one_way():
    from megacpp_lab.model.parallelize import ParallelConfig

    assert ParallelConfig(remat="0.30", compile=True).remat == "0.3"
    assert ParallelConfig(remat="A=1.0,M=0.3,R=1.0", compile=True).remat == "A=1,M=0.3,R=1"
    assert ParallelConfig(remat="M=0.3", compile=True).policy.M == 0.3


def test_parallelize_applies_precision_then_remat_then_compile():
    """Under a budget: every block but the last gets its kind's budget (the last: never recomputed, 1.0), the
    blocks are compiled, the model is cast once (bf16 here, asked for on a CPU) and returned as itself."""
    from megacpp_lab.model.checkpointing import block_budget
    from megacpp_lab.model.parallelize import ParallelConfig, parallelize

    model = _tiny()
    ready = parallelize(model, ParallelConfig(dtype="bf16", remat="A=1.0,M=0.3,R=0.5", compile=True, backend="aot_eager"))
    assert ready is model and model.precision_plan is not None
    want = {"A": 1.0, "M": 0.3, "R": 0.5}
    budgets = [block_budget(b) for b in model.blocks]
    assert budgets == [want[b.kind] for b in model.blocks[:-1]] + [1.0], budgets
    assert all(b._compiled_call_impl is not None for b in model.blocks)
    eager = _tiny()
    parallelize(eager, ParallelConfig(remat="full"))  # eager: checkpoint wrappers, no budget, no compile
    assert all(block_budget(b) is None for b in eager.blocks)
    assert all(getattr(b, "_compiled_call_impl", None) is None for b in eager.blocks)
    with pytest.raises(TypeError, match="ParallelConfig"):
        parallelize(_tiny(), {"compile": True})


def test_describe_compile_says_cold_warm_or_partly_warm_from_the_cache_hits():
    from types import SimpleNamespace as R

    from megacpp_lab.model.parallelize import describe_compile

    cold = [R(is_forward=True, inductor_fx_local_cache_miss_count=1), R(is_forward=False, inductor_fx_local_cache_miss_count=1)]
    warm = [R(is_forward=True, inductor_fx_local_cache_hit_count=1, aotautograd_local_cache_hit_count=1),
            R(is_forward=False, inductor_fx_local_cache_hit_count=1)]  # fmt: skip
    assert describe_compile(80.04, 0, cold).startswith("1 region compiled in 80.0 s, cold: 0 of 2 inductor graphs and 0 "
                                                       "AOTAutograd graphs from the caches")  # fmt: skip
    assert ", warm: 2 of 2 inductor graphs and 1 AOTAutograd" in describe_compile(6.9, 0, warm)
    assert ", partly warm: 2 of 4" in describe_compile(9.0, 0, cold + warm)
    assert "no inductor graph (another backend, or nothing compiled)" in describe_compile(1.0, 2, cold)


def test_apply_compile_starts_inductor_once_and_the_console_line_says_how_long_it_took():
    """A model made compile-ready with inductor has inductor imported and its cache system key computed
    before the first step (ready_inductor, once a process): the first step's time is the model's compile, and
    describe_compile names the start-up apart. Another backend starts nothing."""
    import sys
    from types import SimpleNamespace as R

    from megacpp_lab.model.parallelize import describe_compile, ready_inductor

    ready_inductor.cache_clear()
    apply_compile(_tiny(), backend="eager")
    assert ready_inductor.cache_info().currsize == 0
    assert "inductor started" not in describe_compile(1.0, 0, [])
    apply_compile(_tiny())
    assert ready_inductor.cache_info().currsize == 1 and "torch._inductor.compile_fx" in sys.modules
    seconds = ready_inductor()
    assert seconds > 0 and ready_inductor() == seconds and ready_inductor.cache_info().hits >= 2
    from torch._inductor.codecache import CacheBase

    assert CacheBase.get_system.cache_info().currsize == 1  # the system key the cache lookups include
    line = describe_compile(6.9, 0, [R(is_forward=True, inductor_fx_local_cache_hit_count=1)])
    assert line.endswith(f"; inductor started in {seconds:.1f} s before it, when the model was built")
