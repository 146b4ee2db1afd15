"""model/remat.py: the remat explorer reads the partitioner's decision; a lower budget saves fewer activation
bytes and recomputes more, for every block kind."""

from __future__ import annotations

import pytest
import torch

from megacpp_lab.bench.harness import ModelShape, make_batch
from megacpp_lab.model.config import model_config
from megacpp_lab.model.hybrid import HybridLM
from megacpp_lab.model.remat import remat_plan
from megacpp_lab.varlen import build_context

DEV = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    model = HybridLM(model_config("tiny", DEV, m2rnn=dict(kernel="triton"), ssd=dict(kernel="triton"), mamba3=dict(kernel="triton"))).to(DEV)
    tokens, doc_ids, _ = make_batch(ModelShape("tiny", 2, 32, 3), 512, DEV)
    x = model.embed(tokens).detach().requires_grad_()
    return model, x, tokens, build_context(doc_ids)


@pytest.mark.parametrize("layer", [0, 1, 2])  # A, M with Engram, R
def test_a_lower_budget_saves_less_and_recomputes_more(tiny, layer):
    model, x, tokens, ctx = tiny
    block = model.blocks[layer]
    full = remat_plan(block, x, tokens, ctx, budget=1.0)
    low = remat_plan(block, x, tokens, ctx, budget=0.0)
    assert low.activation_bytes < 0.7 * full.activation_bytes, (block.kind, low.activation_bytes, full.activation_bytes)
    assert sum(r["count"] for r in low.recomputed) > sum(r["count"] for r in full.recomputed)
    # torch's FLOP formulas price the recomputed matmuls (a formula called wrongly once priced everything at 0)
    assert low.recomputed_flops > full.recomputed_flops >= 0
    assert any(r["flops"] > 0 for r in low.recomputed if r["op"] in ("aten.mm", "aten.bmm", "aten.addmm"))
    # inputs and parameters are read by the backward at every budget: recomputing more needs every input the full
    # budget's backward read (the forward's inputs are saved under the same placeholder names at both budgets)
    full_inputs = {s["name"] for s in full.saved if s["op"] == "input"}
    low_inputs = {s["name"] for s in low.saved if s["op"] == "input"}
    assert full_inputs and full_inputs <= low_inputs, (block.kind, sorted(full_inputs - low_inputs))
    for plan in (full, low):
        assert all(s["bytes"] >= 0 and (s["shape"] is None) == (s["dtype"] == "symint") for s in plan.saved)
        assert all(r["count"] >= 1 and r["bytes"] >= 0 for r in plan.recomputed)


def test_the_scan_outputs_are_saved_at_full_budget(tiny):
    model, x, tokens, ctx = tiny
    ops = {s["op"] for s in remat_plan(model.blocks[2], x, tokens, ctx, budget=1.0).saved}
    assert any("megacpp" in op for op in ops), ops


def test_inductor_plan_stops_at_the_partition_and_leaves_nothing_cached(tiny):
    """backend='inductor' reads inductor's own partition (joint-graph passes included) and stops the compile
    there: it must give a plan, restore the partitioner, and leave no compiled graph behind."""
    import torch._inductor.compile_fx as compile_fx

    model, x, tokens, ctx = tiny
    original = compile_fx.min_cut_rematerialization_partition
    plan = remat_plan(model.blocks[1], x, tokens, ctx, budget=0.3, backend="inductor")
    decomp = remat_plan(model.blocks[1], x, tokens, ctx, budget=0.3, backend="aot_eager_decomp_partition")
    assert compile_fx.min_cut_rematerialization_partition is original
    assert plan.activation_bytes > 0 and decomp.activation_bytes > 0
    assert {s["op"] for s in plan.saved if "megacpp" in s["op"]} == {s["op"] for s in decomp.saved if "megacpp" in s["op"]}


def test_bad_budget_and_no_backward_are_refused(tiny):
    model, x, tokens, ctx = tiny
    with pytest.raises(ValueError, match=r"budget must be in \[0, 1\]"):
        remat_plan(model.blocks[0], x, tokens, ctx, budget=1.5)
    with pytest.raises(ValueError, match="backend must be one of"):
        remat_plan(model.blocks[0], x, tokens, ctx, budget=0.5, backend="eager")
    frozen = x.detach()
    for p in model.blocks[0].parameters():
        p.requires_grad_(False)
    try:
        with pytest.raises(ValueError, match="needs no gradient"):
            remat_plan(model.blocks[0], frozen, tokens, ctx, budget=0.5)
    finally:
        for p in model.blocks[0].parameters():
            p.requires_grad_(True)


@pytest.mark.parametrize("m_block", [dict(m_block="mamba2"), dict(mamba3=dict(mimo_rank=2))], ids=["mamba2", "mamba3-mimo2"])
def test_every_m_block_variant_has_a_remat_plan(m_block):
    """The explorer partitions whichever M block the config builds: Mamba-2's SSD, Mamba-3 MIMO (the default SISO
    is layer 1 above), and the scan's custom op is among what the backward reads at full budget."""
    torch.manual_seed(0)
    kernels = dict(m2rnn=dict(kernel="triton"), ssd=dict(kernel="triton"))
    config = model_config("tiny", DEV, **kernels, **{**m_block, "mamba3": dict(kernel="triton", **m_block.get("mamba3", {}))})
    model = HybridLM(config).to(DEV)
    tokens, doc_ids, _ = make_batch(ModelShape("tiny", 2, 32, 3), 512, DEV)
    x = model.embed(tokens).detach().requires_grad_()
    block, ctx = model.blocks[3], build_context(doc_ids)  # an M block without Engram
    full = remat_plan(block, x, tokens, ctx, budget=1.0)
    low = remat_plan(block, x, tokens, ctx, budget=0.0)
    assert low.activation_bytes < full.activation_bytes
    assert any("megacpp" in s["op"] for s in full.saved), {s["op"] for s in full.saved}
