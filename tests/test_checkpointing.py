"""model/checkpointing.py: the policy fails closed naming the field; eager checkpointing keeps the gradients and
saves fewer bytes; the last layer is never checkpointed; under regional compile the budget reaches the
partitioner (saved bytes fall as the budget falls) and manual wrappers are refused."""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters

from megacpp_lab.bench.harness import ModelShape, make_batch
from megacpp_lab.model.checkpointing import AC_ATTR, CheckpointingPolicy, apply_ac, block_budget
from megacpp_lab.model.config import model_config
from megacpp_lab.model.hybrid import HybridLM
from megacpp_lab.model.parallelize import apply_compile, compile_stats
from megacpp_lab.profiling import retained_bytes, saved_tensor_bytes
from megacpp_lab.testing import wake_zero_initialised
from megacpp_lab.varlen import build_context

DEV = "cuda" if torch.cuda.is_available() else "cpu"
SHAPE = ModelShape("tiny", B=2, T=32, docs=3)


def _model(**overrides) -> HybridLM:
    torch.manual_seed(0)
    model = HybridLM(model_config("tiny", DEV, **overrides)).to(DEV)
    wake_zero_initialised(model)  # Engram's output projection too: its branch must carry gradient
    return model


def _batch(vocab: int = 512):
    tokens, doc_ids, targets = make_batch(SHAPE, vocab, DEV)
    return tokens, build_context(doc_ids), targets


def _grads(model: HybridLM, batch) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    model(*batch).loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("field, value, message", [
    ("A", "some", "CheckpointingPolicy.A must be 'none', 'full'"),
    ("M", 1.5, r"CheckpointingPolicy.M budget must be in \[0, 1\]"),
    ("R", (), "CheckpointingPolicy.R must be"),
    ("engram", True, "CheckpointingPolicy.engram must be"),
    ("last_layer", "always", "CheckpointingPolicy.last_layer must be 'never'"),
    ("offload", "yes", "CheckpointingPolicy.offload must be a bool"),
])  # fmt: skip
def test_bad_policy_fails_naming_the_field(field, value, message):
    with pytest.raises(ValueError, match=message):
        CheckpointingPolicy(**{field: value})


@pytest.mark.parametrize("entry", ["full", ("mm",)])
def test_eager_checkpointing_keeps_the_gradients_and_saves_less(entry):
    batch = _batch()
    plain = _model(engram_layers=(1,))
    wrapped = _model(engram_layers=(1,))
    apply_ac(wrapped, CheckpointingPolicy.uniform(entry))
    ref, got = _grads(plain, batch), _grads(wrapped, batch)
    assert ref.keys() == got.keys()
    for name in ref:
        torch.testing.assert_close(got[name], ref[name], rtol=1e-5, atol=1e-6, msg=name)
    full = retained_bytes(lambda: plain(*batch).loss)
    less = retained_bytes(lambda: wrapped(*batch).loss)
    assert less < 0.8 * full, (entry, less, full)


def test_selective_saves_more_than_full_and_less_than_none():
    batch = _batch()
    sizes = {}
    for name, entry in (("none", "none"), ("selective", ("mm", "bmm")), ("full", "full")):
        model = _model()
        apply_ac(model, CheckpointingPolicy.uniform(entry))
        sizes[name] = retained_bytes(lambda: model(*batch).loss)
    assert sizes["full"] < sizes["selective"] < sizes["none"], sizes
    # the saved-tensor hooks see what autograd saves, not selective checkpointing's cache
    plain = _model()
    assert saved_tensor_bytes(lambda: plain(*batch).loss) > sizes["full"]


def test_the_last_layer_is_never_checkpointed():
    model = _model()
    apply_ac(model, CheckpointingPolicy.uniform("full"))
    marked = [hasattr(b, AC_ATTR) for b in model.blocks]
    assert marked == [True] * (len(model.blocks) - 1) + [False]
    compiled = _model()
    apply_ac(compiled, CheckpointingPolicy.uniform(0.0), compiled=True)
    assert [block_budget(b) for b in compiled.blocks] == [0.0] * (len(compiled.blocks) - 1) + [1.0]


def test_engram_branch_entry_wraps_only_the_branch():
    model = _model(engram_layers=(1,))
    apply_ac(model, CheckpointingPolicy(engram="full"))
    assert hasattr(model.blocks[1].engram, AC_ATTR) and not hasattr(model.blocks[1], AC_ATTR)
    assert not any(hasattr(b, AC_ATTR) for i, b in enumerate(model.blocks) if i != 1)


def test_offload_wraps_unchecked_blocks_and_keeps_the_gradients():
    batch = _batch()
    ref = _grads(_model(), batch)
    model = _model()
    apply_ac(model, CheckpointingPolicy(A="full", offload=True))
    assert getattr(model.blocks[0], AC_ATTR) == "full" and getattr(model.blocks[1], AC_ATTR) == "offload"
    got = _grads(model, batch)
    for name in ref:
        torch.testing.assert_close(got[name], ref[name], rtol=1e-5, atol=1e-6, msg=name)


def test_misuse_is_refused():
    model = _model()
    with pytest.raises(ValueError, match="op list, which only the eager path applies"):
        apply_ac(model, CheckpointingPolicy(M=("mm",)), compiled=True)
    with pytest.raises(ValueError, match="is a budget .* which only regional compile reads"):
        apply_ac(_model(), CheckpointingPolicy(A=0.5))
    apply_ac(model, CheckpointingPolicy(A="full"))
    with pytest.raises(ValueError, match="already applied"):
        apply_ac(model, CheckpointingPolicy())
    with pytest.raises(ValueError, match="hold manual checkpoint wrappers .* single authority"):
        apply_compile(model)
    with pytest.raises(TypeError, match="CheckpointingPolicy"):
        apply_ac(_model(), {"A": "full"})


TRITON = dict(m2rnn=dict(kernel="triton"), ssd=dict(kernel="triton"), mamba3=dict(kernel="triton"))


def test_the_budget_reaches_the_partitioner():
    """apply_ac(compiled=True) then apply_compile: the bytes the compiled blocks hold for the backward fall as the
    budget falls (3 M layers; the last keeps budget 1.0). The min-cut partitioner of aot_eager_decomp_partition
    is inductor's, without the C++ compile; tests/test_remat.py reads its decision for every block kind."""
    kind = "M"
    torch._dynamo.reset()
    counters.clear()
    batch = _batch()
    saved = {}
    for budget in (1.0, 0.0):
        torch._dynamo.reset()
        model = _model(pattern=kind, n_layers=3, engram_layers=(), **TRITON)
        apply_ac(model, CheckpointingPolicy.uniform(budget), compiled=True)
        apply_compile(model, backend="aot_eager_decomp_partition")
        # the first forward compiles outside the measured window: what compiling retains depends on what the process
        # compiled before (a fresh-clone CI run once read 706384 bytes at budget 1.0 against 1311048 alone)
        model(*batch).loss
        saved[budget] = retained_bytes(lambda: model(*batch).loss)
    torch._dynamo.reset()
    assert saved[0.0] < 0.8 * saved[1.0], saved


def test_the_last_block_keeps_its_budget_under_regional_compile():
    """Tripwire: blocks of one structure share one compiled graph, and the budget is read when it compiles. The
    last block (budget 1.0: never recomputed) once reused its structure's graph compiled at the lower budget:
    on the H200 base model at budget 0.0 all six M blocks, the last included, kept only their inputs. The budget
    is now part of a block's graph identity: the last block compiles apart and saves what budget 1.0 saves.
    Measured on the second step: a range check on a budget dynamo had made symbolic (the recompile for the last
    block) let that last graph serve every block from the second step on, and the first step hid it."""
    from megacpp_lab.bench.memory import block_accounting

    batch = _batch()
    saved = {}
    for budget in (0.0, 1.0):
        torch._dynamo.reset()
        counters.clear()
        model = _model(pattern="M", n_layers=3, engram_layers=(), **TRITON)
        apply_ac(model, CheckpointingPolicy.uniform(budget), compiled=True)
        apply_compile(model, backend="aot_eager_decomp_partition")
        for b, block in enumerate(model.blocks):
            block.kind = f"M{b}"  # one accounting bucket per block
        model(*batch).loss.backward()  # the first step compiles both graphs
        with block_accounting(list(model.blocks), DEV) as acc:
            model(*batch).loss
        saved[budget] = acc["saved"]
        if budget == 0.0:
            assert compile_stats().graphs == 2  # the first two blocks share a graph, the last has its own
    torch._dynamo.reset()
    low, high = saved[0.0], saved[1.0]
    assert low["M0"] < 0.5 * high["M0"] and low["M1"] < 0.5 * high["M1"], (low, high)
    assert low["M2"] == pytest.approx(high["M2"], rel=0.02), (low, high)


def test_a_block_refuses_a_budget_outside_0_1():
    """Set by hand past apply_ac's checks, a bad budget fails in the block, naming it."""
    from megacpp_lab.model.hybrid import REMAT_BUDGET_ATTR

    model = _model()
    setattr(model.blocks[2], REMAT_BUDGET_ATTR, 1.5)
    with pytest.raises(ValueError, match=r"block 2: remat budget 1.5 is outside \[0, 1\]"):
        model(*_batch())


# ----------------------------------------------------------------------------- the E block's routing


@pytest.mark.parametrize("experts", ["grouped", "loop"])
def test_an_e_block_saves_its_routing_so_a_recompute_that_rounds_otherwise_routes_as_the_forward(monkeypatch, experts):
    """Why an E block's routing is saved under every checkpoint entry (checkpointing.ROUTING_OPS). Experts 2 and 3
    share a router row, so every token ties between them; the recompute rounds expert 3's logit one ulp up (as
    another kernel or reduction order may), which breaks the ties the other way. Recomputed, the routing then
    differs from the forward's: with the loop experts the per-expert shapes change and torch's strict metadata
    check raises; with the grouped experts every shape is fixed, so nothing raises and the gradients silently
    belong to another routing. With the routing saved (checkpoint_module on the E block) the gradients equal an
    uncheckpointed backward's, and the strict check stays on."""
    import torch.nn.functional as F
    from torch.utils.checkpoint import CheckpointError, checkpoint

    from megacpp_lab.model.checkpointing import checkpoint_module

    torch.manual_seed(0)
    model = HybridLM(model_config("tiny", "cpu", pattern="EA", n_layers=2, engram_layers=(),
                                  moe=dict(n_experts=4, top_k=2, expert_hidden=32, init_std=0.5, experts=experts)))  # fmt: skip
    block = model.blocks[0]
    with torch.no_grad():
        block.mlp.router[3] = block.mlp.router[2]
    tokens, doc_ids, _ = make_batch(ModelShape("tiny", 2, 32, 2), 512, "cpu")
    ctx = build_context(doc_ids)
    x = torch.randn(2, 32, 64, requires_grad=True)
    params = [x, block.mlp.experts_gate_up, block.mlp.experts_down, block.mlp.router]
    real_linear, calls = F.linear, {"router": 0}

    def linear(inp, weight, bias=None):  # the router's second call (the recompute) rounds expert 3 up by one ulp;
        out = real_linear(inp, weight, bias)  # the same ops on every call, so only what the routing shapes differs
        if weight is block.mlp.router:
            calls["router"] += 1
            with torch.no_grad():
                ulp = torch.nextafter(out[..., 3:], out[..., 3:] + float("inf")) - out[..., 3:]
            out = torch.cat((out[..., :3], out[..., 3:] + ulp * (1.0 if calls["router"] > 1 else 0.0)), dim=-1)
        return out

    monkeypatch.setattr(F, "linear", linear)
    want = torch.autograd.grad(block(x, tokens, ctx).square().sum(), params)  # no checkpoint: one router call

    def recomputed_routing() -> tuple[torch.Tensor, ...]:
        calls["router"] = 0
        y = checkpoint(block.forward, x, tokens, ctx, use_reentrant=False)  # routing recomputed with the rest
        return torch.autograd.grad(y.square().sum(), params)

    if experts == "loop":
        with pytest.raises(CheckpointError, match="metadata"):
            recomputed_routing()
    else:
        got = recomputed_routing()
        assert calls["router"] == 2
        rel = [((a - b).norm() / b.norm()).item() for a, b in zip(got, want)]
        assert min(rel) > 1e-2, rel  # the gradients of another routing (expert 2's tokens went to expert 3)
    checkpoint_module(block, "full")
    calls["router"] = 0
    got = torch.autograd.grad(block(x, tokens, ctx).square().sum(), params)
    assert calls["router"] == 2  # recomputed, and the recompute's logits were nudged: the saved top-k routed it
    for a, b in zip(got, want):  # within the ulp the recompute added to expert 3's logits, not a routing apart
        assert ((a - b).norm() / b.norm()).item() < 1e-5


def test_a_save_list_recomputes_the_conv_kernel_and_keeps_the_scans():
    """The lab's scans are always saved; its conv kernel (megacpp::doc_conv_fwd) is recomputed like the torch form it
    stands in for, unless the list names it."""
    import megacpp_lab.kernels.doc_conv  # noqa: F401  (registers the op)
    import megacpp_lab.kernels.m2rnn  # noqa: F401
    from megacpp_lab.model.checkpointing import saves_output

    conv, scan = torch.ops.megacpp.doc_conv_fwd.default, torch.ops.megacpp.m2rnn_scan_fwd.default
    assert saves_output(scan, ()) and not saves_output(conv, ("mm",))
    assert saves_output(conv, ("doc_conv_fwd",)) and not saves_output(scan, (), scans=False)
