"""The E block's mixture of experts (megacpp_lab/nn/moe.py): the grouped experts against the per-expert loop,
capacity routing against a brute-force reference, the router's weights and bias, the balance update, the
attached losses' gradients, the leak harness (dropless passes, capacity fails), and torch.compile without graph
breaks or recompiles as the routing changes."""

from __future__ import annotations

import math

import pytest
import torch

from megacpp_lab.nn.moe import (MoE, MoEConfig, capacity_experts, grouped_experts, loop_experts,
                                moe_activation_fields, route, update_balance)  # fmt: skip
from megacpp_lab.profiling import retained_bytes, saved_tensor_bytes
from megacpp_lab.testing import check_leaks


def _moe(**overrides) -> MoE:
    torch.manual_seed(0)
    cfg = MoEConfig.build(**{**dict(d_model=32, n_experts=8, top_k=2, expert_hidden=16, init_std=0.2), **overrides})
    return MoE(cfg)  # fp32: torch._grouped_mm takes no float64


def _x(N=64, d=32, seed=1, dtype=torch.float32):
    return torch.randn(N, d, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def _grads(layer, x, dy, experts):
    x = x.clone().requires_grad_()
    routing = route(x, layer.router, layer.bias, layer.config)
    y = experts(x, routing, layer.experts_gate_up, layer.experts_down)
    params = [x, layer.router, layer.experts_gate_up, layer.experts_down]
    return y, torch.autograd.grad((y * dy).sum(), params)


@pytest.mark.parametrize("top_k", [1, 2, 3])
def test_grouped_experts_equal_the_loop_forward_and_every_gradient(top_k):
    layer = _moe(top_k=top_k)
    x, dy = _x(), _x(seed=2)
    layer.bias.copy_(torch.tensor([5.0, 0, 0, 0, 0, 0, -5.0, -5.0]))  # expert 0 full, 6, 7 empty
    y, g = _grads(layer, x, dy, grouped_experts)
    y_ref, g_ref = _grads(layer, x, dy, loop_experts)
    assert not (layer.bias[6:] > -5).any() and route(x, layer.router, layer.bias, layer.config).ids.max() < 6
    torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-6)
    for name, a, b in zip(("x", "router", "experts_gate_up", "experts_down"), g, g_ref):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"d{n}: {m}")


def test_router_weights_are_the_chosen_scores_normalised_and_the_bias_only_chooses():
    layer = _moe(score="sigmoid", route_scale=2.5)
    x = _x()
    plain = route(x, layer.router, layer.bias, layer.config)
    scores = torch.sigmoid(x @ layer.router.T)
    torch.testing.assert_close(plain.scores, scores)
    assert torch.equal(plain.ids.sort(-1).values, scores.topk(2, -1).indices.sort(-1).values)
    torch.testing.assert_close(plain.weights.sum(-1), torch.full((64,), 2.5))
    layer.bias[3] = 100.0  # every token picks expert 3; its weight is still its score's share
    biased = route(x, layer.router, layer.bias, layer.config)
    assert (biased.ids == 3).any(-1).all()
    chosen = scores.gather(-1, biased.ids)
    torch.testing.assert_close(biased.weights, 2.5 * chosen / chosen.sum(-1, keepdim=True))
    one = route(x, layer.router, torch.zeros(8), MoEConfig.build(d_model=32, n_experts=8, top_k=1,
                                                                                      score="softmax"))  # fmt: skip
    torch.testing.assert_close(one.weights[:, 0], torch.softmax(x @ layer.router.T, -1).max(-1).values)


def _capacity_reference(routing, capacity, E):
    """Per expert, its assignments sorted by weight (descending, ties by token order); the first `capacity` kept."""
    N, k = routing.ids.shape
    kept = torch.zeros(N, k, dtype=torch.bool)
    for e in range(E):
        token, slot = (routing.ids == e).nonzero(as_tuple=True)
        w = routing.weights[token, slot].detach()
        order = sorted(range(len(w)), key=lambda i: (-float(w[i]), int(token[i]) * k + int(slot[i])))
        for i in order[:capacity]:
            kept[token[i], slot[i]] = True
    return kept


@pytest.mark.parametrize("factor", [0.25, 0.5, 1.0, 100.0])
def test_capacity_keeps_each_experts_highest_weights_and_drops_the_rest(factor):
    layer = _moe(capacity_factor=factor)
    x, dy = _x(), _x(seed=2)
    C = layer.config.capacity(64)
    assert C == max(1, math.ceil(factor * 64 * 2 / 8))
    routing = route(x, layer.router, layer.bias, layer.config)
    y, kept = capacity_experts(x, routing, layer.experts_gate_up, layer.experts_down, C)
    assert torch.equal(kept, _capacity_reference(routing, C, 8))
    for e in range(8):
        assert int(kept[routing.ids == e].sum()) == min(C, int((routing.ids == e).sum()))
    # the kept assignments through the loop: the same output
    masked = type(routing)(routing.ids, routing.weights * kept, routing.logits, routing.scores)
    torch.testing.assert_close(y, loop_experts(x, masked, layer.experts_gate_up, layer.experts_down))
    if factor == 100.0:  # room for every assignment: dropless
        assert kept.all()
        torch.testing.assert_close(y, grouped_experts(x, routing, layer.experts_gate_up, layer.experts_down))
    else:
        assert not kept.all()


def test_the_layer_records_load_and_stats_in_training_only_and_update_balance_moves_the_bias():
    layer = _moe(bias_update_rate=0.01, shared_hidden=8).train()
    x = _x().view(2, 32, 32)
    layer(x)
    routing = route(x.view(-1, 32), layer.router, layer.bias, layer.config)
    want = torch.bincount(routing.ids.reshape(-1), minlength=8).float()
    assert torch.equal(layer.load, want) and layer.load.sum() == 64 * 2
    z = torch.logsumexp(routing.logits, -1).pow(2).mean()
    torch.testing.assert_close(layer.stats[0], z)
    assert layer.stats[2] == 0 and layer.stats[3] == want.max() / 128
    assert update_balance(torch.nn.Sequential(layer)) == 1
    torch.testing.assert_close(layer.bias, 0.01 * torch.sign(want.mean() - want))
    assert not layer.load.any()
    layer.eval()
    layer(x)
    assert not layer.load.any()
    frozen = _moe(balance="none").train()
    frozen(x)
    frozen.update_balance()
    assert not frozen.bias.any() and not frozen.load.any()


def test_the_router_losses_reach_the_router_as_if_added_to_the_loss():
    layer = _moe(z_loss_weight=0.1, aux_loss_weight=0.05).train()
    x, dy = _x().view(2, 32, 32), _x(seed=2).view(2, 32, 32)
    (g,) = torch.autograd.grad((layer(x) * dy).sum(), [layer.router])
    routing = route(x.view(-1, 32), layer.router, layer.bias, layer.config)
    y = grouped_experts(x.view(-1, 32), routing, layer.experts_gate_up, layer.experts_down)
    z = torch.logsumexp(routing.logits, -1).pow(2).mean()
    share = routing.scores / routing.scores.sum(-1, keepdim=True)
    fraction = torch.bincount(routing.ids.reshape(-1), minlength=8).float() / 128
    aux = 8 * (fraction * share.mean(0)).sum()
    (want,) = torch.autograd.grad((y * dy.view(-1, 32)).sum() + 0.1 * z + 0.05 * aux, [layer.router])
    torch.testing.assert_close(g, want)
    torch.testing.assert_close(layer.stats[1], aux.detach())


def _as_mixer(layer):
    return lambda x, doc_ids: layer(x)


def test_dropless_routing_passes_the_leak_harness_and_capacity_routing_fails_it():
    x = _x(N=2 * 48, d=32).view(2, 48, 32)
    doc_ids = torch.tensor([[0] * 20 + [1] * 28, [0] * 7 + [1] * 30 + [2] * 11])
    report = check_leaks(_as_mixer(_moe(shared_hidden=8).eval()), x, doc_ids)
    assert report.passed, str(report)
    leaky = check_leaks(_as_mixer(_moe(capacity_factor=0.5).eval()), x, doc_ids)
    assert leaky.leaked and leaky.cross_doc.magnitude > leaky.tol, str(leaky)
    assert leaky.causal is not None and leaky.causal.magnitude > leaky.tol, str(leaky)


def test_compiled_layer_has_no_graph_break_and_no_recompile_as_routing_and_batches_change():
    """In bf16, as the model runs it (torch._grouped_mm's fake kernel takes bf16 alone under torch.compile)."""
    torch._dynamo.reset()
    layer = MoE(MoEConfig.build(d_model=32, n_experts=8, top_k=2, expert_hidden=16, init_std=0.2)).train()
    layer.experts_gate_up.data, layer.experts_down.data = layer.experts_gate_up.bfloat16(), layer.experts_down.bfloat16()
    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
    compiled(torch.randn(2, 48, 32, dtype=torch.bfloat16)).float().sum().backward()
    with torch.compiler.set_stance("fail_on_recompile"):
        for seed in range(5):  # new values each time: other routing, other group sizes, empty experts
            g = torch.Generator().manual_seed(seed)
            x = (torch.randn(2, 48, 32, generator=g) * (1 + seed)).bfloat16()
            layer.bias.copy_(torch.randn(8, generator=g) * seed)
            y = compiled(x)
            y.float().sum().backward()
            torch.testing.assert_close(y, layer(x))


@pytest.mark.parametrize("change, message", [
    (dict(top_k=9), r"MoEConfig.top_k must be an int in \[1, n_experts=8\], got 9"),
    (dict(expert_hidden=12), r"MoEConfig.expert_hidden must be a multiple of 8"),
    (dict(score="relu"), r"MoEConfig.score must be one of \('sigmoid', 'softmax'\), got 'relu'"),
    (dict(capacity_factor=0), r"MoEConfig.capacity_factor must be None \(dropless\) or a finite number > 0, got 0"),
    (dict(experts="bmm"), r"MoEConfig.experts must be one of \('grouped', 'loop'\), got 'bmm'"),
    (dict(z_loss_weight=-1.0), r"MoEConfig.z_loss_weight must be a finite number >= 0.0, got -1.0"),
    (dict(n_experts=True), r"MoEConfig.n_experts must be an int >= 1, got True"),
])  # fmt: skip
def test_bad_config_fails_naming_the_field(change, message):
    with pytest.raises(ValueError, match=message):
        MoEConfig.build(**{**dict(d_model=32, n_experts=8, expert_hidden=16), **change})


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("capacity_factor", [None, 1.0, 0.5])
@pytest.mark.parametrize("N, d, E, k, h", [(256, 64, 8, 2, 48), (1024, 128, 16, 2, 176), (512, 64, 4, 1, 64)])
def test_the_activation_fields_hold_what_autograd_saves_within_15_percent(dtype, capacity_factor, N, d, E, k, h):
    cfg = MoEConfig.build(d_model=d, n_experts=E, top_k=k, expert_hidden=h, capacity_factor=capacity_factor)
    layer = MoE(cfg).train()
    layer.experts_gate_up.data, layer.experts_down.data = layer.experts_gate_up.to(dtype), layer.experts_down.to(dtype)
    x = torch.randn(N, d, dtype=dtype, requires_grad=True)
    saved = saved_tensor_bytes(lambda: layer(x), exclude=[x, *layer.parameters(), *layer.buffers()])
    fields = moe_activation_fields(cfg, N, dtype)
    assert fields["hiddens"] > 0 and fields["dispatch"] > 0
    assert abs(sum(fields.values()) / saved - 1) < 0.15, (fields, saved)


def test_the_recompute_fields_hold_what_the_expert_gemm_save_list_keeps_within_15_percent():
    from torch.utils.checkpoint import checkpoint

    from megacpp_lab.model.checkpointing import ROUTING_OPS, _selective

    cfg = MoEConfig.build(d_model=128, n_experts=16, top_k=2, expert_hidden=176)
    layer = MoE(cfg).train()
    x = torch.randn(1024, 128, requires_grad=True)
    # what the selective checkpoint caches (the router's mm and the top-k): all the call holds but its output
    kept = retained_bytes(lambda: checkpoint(layer, x, use_reentrant=False,
                                             context_fn=_selective(("mm", "addmm", *ROUTING_OPS)))) - x.numel() * 4  # fmt: skip
    fields = moe_activation_fields(cfg, 1024, torch.float32, recompute="save_list")
    assert fields["hiddens"] == fields["dispatch"] == fields["combine"] == 0
    assert abs(sum(fields.values()) / kept - 1) < 0.15, (fields, kept)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("capacity_factor", [None, 0.5])
def test_recompute_experts_gives_the_same_output_and_gradients_and_keeps_what_its_fields_say(dtype, capacity_factor):
    """The expert-GEMM recompute lever (MoEConfig.recompute_experts): bit-identical output and gradients (the
    recompute takes the forward's routing as tensors), and what the forward keeps matches its fields within 15%,
    at most half of what the layer keeps without it."""
    N, d, E, k, h = 1024, 128, 16, 2, 176
    layers = {}
    for lever in (False, True):
        torch.manual_seed(0)
        cfg = MoEConfig.build(d_model=d, n_experts=E, top_k=k, expert_hidden=h, capacity_factor=capacity_factor,
                              recompute_experts=lever)  # fmt: skip
        layers[lever] = layer = MoE(cfg).train()
        layer.experts_gate_up.data, layer.experts_down.data = layer.experts_gate_up.to(dtype), layer.experts_down.to(dtype)
    x = torch.randn(N, d, dtype=dtype, requires_grad=True)
    dy = torch.randn(N, d, dtype=dtype)
    outs = {}
    for lever, layer in layers.items():
        y = layer(x * 1)  # the rows are the call's own tensor, as a block's normed input is
        outs[lever] = (y, *torch.autograd.grad((y.float() * dy.float()).sum(), [x, *layer.parameters()]))
    for a, b in zip(outs[False], outs[True]):
        assert torch.equal(a, b)
    kept = {}
    for lever, layer in layers.items():  # what the call holds but its output [N, d]
        kept[lever] = retained_bytes(lambda layer=layer: layer(x * 1)) - N * d * x.element_size()
        mode = "experts" if lever else "none"
        fields = moe_activation_fields(layer.config, N, dtype, recompute=mode)
        assert abs(sum(fields.values()) / kept[lever] - 1) < 0.15, (mode, fields, kept[lever])
    assert kept[True] < 0.5 * kept[False], kept


def test_recompute_experts_compiles_without_a_graph_break_and_matches_eager():
    torch._dynamo.reset()
    torch.manual_seed(0)
    layer = MoE(MoEConfig.build(d_model=32, n_experts=8, top_k=2, expert_hidden=16, init_std=0.2,
                                recompute_experts=True)).train()  # fmt: skip
    layer.experts_gate_up.data, layer.experts_down.data = layer.experts_gate_up.bfloat16(), layer.experts_down.bfloat16()
    x = torch.randn(2, 48, 32, dtype=torch.bfloat16, requires_grad=True)
    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
    grads = [torch.autograd.grad(f(x).float().sum(), [x, *layer.parameters()]) for f in (compiled, layer)]
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b)


def test_the_memory_estimate_breaks_the_e_layers_down_by_field():
    from megacpp_lab.model.checkpointing import CheckpointingPolicy
    from megacpp_lab.model.config import model_config
    from megacpp_lab.model.memory import estimate_memory

    config = model_config("tiny", "cpu", pattern="MAEE", moe=dict(n_experts=4, top_k=2, expert_hidden=32))
    saved = estimate_memory(config, batch=2, seq_len=32)
    per_layer = moe_activation_fields(config.moe, 64, torch.float32)
    assert saved.moe_layers_modelled == 2
    assert saved.moe_fields == {k: 2 * v for k, v in per_layer.items()}
    assert sum(saved.moe_fields.values()) < saved.activations_by_kind["E"]  # inside the E blocks' total
    lever = estimate_memory(config, batch=2, seq_len=32, policy=CheckpointingPolicy(E=("mm", "addmm")))
    # the save list drops layer 2's hiddens; layer 3, the last, is never checkpointed and keeps its own
    assert lever.moe_fields["hiddens"] == per_layer["hiddens"]
    assert lever.activations_by_kind["E"] < saved.activations_by_kind["E"]
    # "full" is not broken down; the last layer (an E block here) is never checkpointed, so it still is
    full = estimate_memory(config, batch=2, seq_len=32, policy=CheckpointingPolicy(E="full"))
    assert full.moe_layers_modelled == 1
    # a fully checkpointed E block keeps its input and its routing decision (the top-k: fp32 values, int64 ids)
    assert full.per_block[2]["entry"] == "full" and full.per_block[2]["bytes"] == 2 * 32 * 64 * 4 + 64 * 2 * (4 + 8)


@pytest.mark.parametrize("capacity_factor", [None, 0.5])
def test_the_layer_reads_no_value_to_the_host(capacity_factor):
    """Routing, grouped or capacity experts, losses and statistics, forward and backward: no tensor value reaches
    the host (on a GPU each would be a sync; test_grouped_experts_on_gpu... checks CUDA's own sync detector)."""
    from megacpp_lab.testing import no_host_reads

    layer = _moe(capacity_factor=capacity_factor, shared_hidden=8, aux_loss_weight=0.01).train()
    x = _x().view(2, 32, 32).requires_grad_()
    with no_host_reads():
        layer(x).sum().backward()
        layer.update_balance()
    assert x.grad is not None and layer.router.grad is not None


def test_dropless_routing_has_no_capacity():
    with pytest.raises(ValueError, match="dropless"):
        MoEConfig.build(d_model=32).capacity(64)


# ----------------------------------------------------------------------------- the GPU


@pytest.mark.cuda
def test_grouped_experts_on_gpu_bf16_at_a_real_shape_equal_the_loop():
    """16 experts, top-2, d=1024, 16384 tokens (the issue's shape), bf16: the grouped GEMMs against the per-expert
    loop in bf16, forward and gradients, and both against the loop in fp32 within bf16's rounding, on one routing."""
    torch.manual_seed(0)
    cfg = MoEConfig.build(d_model=1024, n_experts=16, top_k=2, expert_hidden=1368)
    layer = MoE(cfg).cuda()
    x = torch.randn(16384, 1024, device="cuda")
    dy = torch.randn(16384, 1024, device="cuda")
    # one routing for all three (from the fp32 rows): routed from bf16 rows, a token near a tie goes elsewhere
    routing = route(x, layer.router, layer.bias, cfg)
    out = {}
    for name, experts, dtype in (("grouped", grouped_experts, torch.bfloat16), ("loop", loop_experts, torch.bfloat16),
                                 ("fp32", loop_experts, torch.float32)):  # fmt: skip
        xs = x.to(dtype).requires_grad_()
        wg, wd = (layer.experts_gate_up.detach().to(dtype).requires_grad_(),
                  layer.experts_down.detach().to(dtype).requires_grad_())  # fmt: skip
        y = experts(xs, routing, wg, wd)
        out[name] = (y, *torch.autograd.grad((y.float() * dy).sum(), [xs, wg, wd]))
    rel = lambda a, b: ((a.float() - b.float()).norm() / b.float().norm()).item()  # noqa: E731
    for a, b, c in zip(out["grouped"], out["loop"], out["fp32"]):
        assert rel(a, b) < 1e-2 and rel(a, c) < 1e-2, (rel(a, b), rel(a, c))
    # the grouped layer, forward and backward, never waits on the GPU (CUDA's own sync detector)
    bf16 = MoE(cfg).cuda()
    bf16.experts_gate_up.data, bf16.experts_down.data = bf16.experts_gate_up.bfloat16(), bf16.experts_down.bfloat16()
    xb = x.bfloat16().requires_grad_()
    bf16(xb).float().sum().backward()  # warm-up: first calls may allocate and sync
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        bf16(xb).float().sum().backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.cuda
def test_grouped_experts_refuse_fp32_on_gpu_rather_than_loop_on_the_host():
    layer = MoE(MoEConfig.build(d_model=32, n_experts=4, expert_hidden=16)).cuda()
    x = torch.randn(8, 32, device="cuda")
    with pytest.raises(ValueError, match="needs bf16 x and expert weights"):
        layer(x)
