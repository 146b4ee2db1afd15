"""model/memory.py: the estimator's static fields are exact, its activation fields land within 15% of the
saved bytes measured on a whole model (every policy family, CPU), its feature fields are what a branch adds, and
bad input fails naming the field. The whole-sweep check (every point of `memory sweep`) is in
tests/test_memory_sweep.py; the GPU receipt carries it at the base shape."""

from __future__ import annotations

import pytest
import torch

from megacpp_lab.bench.harness import triton_config as _config
from megacpp_lab.bench.memory import MemoryPoint, measure_point
from megacpp_lab.bench.harness import ModelShape
from megacpp_lab.model.checkpointing import CheckpointingPolicy
from megacpp_lab.model.config import hybrid_preset
from megacpp_lab.model.hybrid import HybridLM
from megacpp_lab.model.memory import estimate_memory

SHAPE = ModelShape("tiny", B=2, T=32, docs=2)
BACKEND = "aot_eager_decomp_partition"  # the CPU sweep's backend: the same partitioner, no C++ compile
# the CPU traces run the Triton scans under the interpreter, which the test setup turns on only without a GPU
cpu_only = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU traces (the interpreted scans); the GPU test is below")


def _estimate(policy: CheckpointingPolicy, compiled: bool, **kw):
    return estimate_memory(_config("tiny", "cpu"), batch=SHAPE.B, seq_len=SHAPE.T, docs=SHAPE.docs, policy=policy,
                           compiled=compiled, device="cpu", backend=BACKEND, **kw)  # fmt: skip


@cpu_only
def test_parameters_gradients_and_optimizer_are_counted_exactly():
    config = _config("tiny", "cpu")
    est = _estimate(CheckpointingPolicy(), False)
    n = sum(p.numel() for p in HybridLM(config).parameters())
    assert est.parameters == est.gradients == 4 * n  # fp32 on a CPU: every parameter its own master
    assert est.optimizer == 8 * n  # two fp32 AdamW moments
    assert est.peak_step_bytes >= est.activations > sum(est.activations_by_kind.values())


# budgets 1.0 and 0.0, a per-kind policy, eager none and full: checked at every point of the CPU sweep
# (tests/test_memory_sweep.py); here the points that sweep leaves out
@cpu_only
@pytest.mark.parametrize("name,policy,compiled", [
    ("eager offload", CheckpointingPolicy(offload=True), False),
    ("budget 0.3", CheckpointingPolicy.uniform(0.3), True),
])  # fmt: skip
def test_activations_per_kind_within_15_percent_of_measured(name, policy, compiled):
    row = measure_point(MemoryPoint(name, compiled, policy, "x"), SHAPE, "cpu", steps=1, warmup=0, backend=BACKEND)
    est = _estimate(policy, compiled)
    for kind, measured_mib in row["saved_tensor_mib_by_kind"].items():
        got = est.activations_by_kind[kind] / 2**20
        assert got == pytest.approx(measured_mib, rel=0.15), (name, kind, got, measured_mib)
    if policy.offload:  # the device keeps the last block alone; the rest waits in host memory
        assert set(row["saved_tensor_mib_by_kind"]) == {"M"} and est.host_offload > 0
        assert est.activations_by_kind["A"] == est.activations_by_kind["R"] == 0


@cpu_only
def test_feature_fields_are_what_a_branch_adds():
    none = _estimate(CheckpointingPolicy(), False)
    assert none.activations_by_feature["engram"] > 0  # tiny has Engram at layer 1
    full = _estimate(CheckpointingPolicy.uniform("full"), False)
    assert full.activations_by_feature["engram"] == 0  # a checkpointed block keeps its input, branch or not
    mhc = estimate_memory(hybrid_preset("tiny", mhc=True), batch=1, seq_len=32, device="cpu")
    assert mhc.activations_by_feature["mhc"] > 0


@cpu_only
def test_the_m_block_variants_are_traced_as_built():
    """The estimator traces whichever M block the config builds: MIMO's rank inputs and outputs hold more than
    SISO's, and Mamba-2's SSD differs from both."""
    def m_bytes(**overrides):
        config = _config("tiny", "cpu", **overrides)
        est = estimate_memory(config, batch=1, seq_len=32, docs=2, device="cpu")
        return est.activations_by_kind["M"]

    siso, mimo, mamba2 = m_bytes(), m_bytes(mamba3=dict(mimo_rank=4)), m_bytes(m_block="mamba2")
    assert mimo > siso > 0 and mamba2 > 0 and mamba2 != siso, (siso, mimo, mamba2)


@cpu_only
def test_a_trace_cache_is_shared_across_policies():
    cache: dict = {}
    first = _estimate(CheckpointingPolicy.uniform(0.0), True, trace_cache=cache)
    entries = len(cache)
    again = _estimate(CheckpointingPolicy(A=0.0, M=0.0, R=0.0), True, trace_cache=cache)
    assert len(cache) == entries and again.activations_by_kind == first.activations_by_kind


@pytest.mark.parametrize("kwargs,message", [
    (dict(batch=0), "batch must be an int >= 1"),
    (dict(seq_len=8, docs=9), "docs=9 documents do not fit"),
    (dict(policy=CheckpointingPolicy.uniform(("mm",)), compiled=True), "CheckpointingPolicy.A is an op list"),
    (dict(policy=CheckpointingPolicy.uniform(0.5)), r"CheckpointingPolicy.A is a budget \(0.5\)"),
    (dict(policy=CheckpointingPolicy(compact_rank=4)), "compact_rank"),
    (dict(policy=CheckpointingPolicy(offload=True), compiled=True), "offload is eager-only"),
    (dict(policy=CheckpointingPolicy(engram="full")), "CheckpointingPolicy.engram"),
])  # fmt: skip
def test_bad_input_fails_naming_the_field(kwargs, message):
    args = dict(batch=1, seq_len=16, device="cpu") | kwargs
    with pytest.raises(ValueError, match=message):
        estimate_memory(_config("tiny", "cpu"), **args)
    with pytest.raises(TypeError, match="HybridConfig"):
        estimate_memory(object(), batch=1, seq_len=16)  # type: ignore[arg-type]


@pytest.mark.cuda
@pytest.mark.parametrize("name,policy,compiled", [
    ("budget 1.0", CheckpointingPolicy.uniform(1.0), True),
    ("budget 0.3", CheckpointingPolicy.uniform(0.3), True),
    ("eager save list", CheckpointingPolicy.uniform(("mm", "addmm")), False),
])  # fmt: skip
def test_estimate_against_the_gpu_allocator(name, policy, compiled):
    shape = ModelShape("small", B=2, T=1024, docs=4)
    row = measure_point(MemoryPoint(name, compiled, policy, "x"), shape, "cuda", steps=2, warmup=1, backend="inductor")
    est = estimate_memory(_config("small", "cuda"), batch=shape.B, seq_len=shape.T, docs=shape.docs, policy=policy,
                          compiled=compiled, device="cuda")  # fmt: skip
    for kind, measured_mib in row["retained_mib_by_kind"].items():  # the allocator sees a save list's cache too
        got = est.activations_by_kind[kind] / 2**20
        assert got == pytest.approx(measured_mib, rel=0.15), (name, kind, got, measured_mib)
    assert est.activations / 2**20 == pytest.approx(row["activation_mib"], rel=0.15)
    torch.cuda.empty_cache()
