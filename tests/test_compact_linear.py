"""nn/compact_linear.py: the forward and dx are exact; dW is unbiased, its error falls with the rank; the input
is not saved; CheckpointingPolicy.compact_rank applies it to the MLPs."""

from __future__ import annotations

import pytest
import torch

from megacpp_lab.nn.compact_linear import CompactLinear, compact_linear
from megacpp_lab.profiling import retained_bytes


def _data(n=256, d_in=64, d_out=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d_in, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(d_out, d_in, generator=g, dtype=torch.float64, requires_grad=True)
    dy = torch.randn(n, d_out, generator=g, dtype=torch.float64)
    return x, w, dy


def _grads(fn, x, w, dy):
    x.grad = w.grad = None
    y = fn(x, w)
    y.backward(dy)
    return y.detach(), x.grad.clone(), w.grad.clone()


def test_forward_and_input_gradient_are_exact_weight_gradient_is_close():
    x, w, dy = _data()
    y0, dx0, dw0 = _grads(lambda a, b: a @ b.t(), x, w, dy)
    errors = {}
    for rank in (8, 32, 64):
        y, dx, dw = _grads(lambda a, b: compact_linear(a, b, rank, seed=1), x, w, dy)
        assert torch.equal(y, y0) and torch.allclose(dx, dx0, rtol=1e-12, atol=1e-12)
        errors[rank] = float((dw - dw0).norm() / dw0.norm())
    assert errors[8] > errors[32] > errors[64] > 0, errors  # approximate, and better with the rank


def test_weight_gradient_is_unbiased():
    x, w, dy = _data()
    _, _, exact = _grads(lambda a, b: a @ b.t(), x, w, dy)
    mean = torch.zeros_like(exact)
    n = 400
    for seed in range(n):
        mean += _grads(lambda a, b: compact_linear(a, b, 8, seed=seed), x, w, dy)[2] / n
    one = _grads(lambda a, b: compact_linear(a, b, 8, seed=0), x, w, dy)[2]
    mean_err, one_err = float((mean - exact).norm() / exact.norm()), float((one - exact).norm() / exact.norm())
    assert mean_err < one_err / 8, (mean_err, one_err)  # the error averages away (~1/sqrt(n)): no bias


def test_the_input_is_not_saved():
    lin = torch.nn.Linear(512, 512, bias=False)
    x = torch.randn(1024, 512, requires_grad=True)
    # the Linear's input made inside the forward, as in a model (x * 2 saves nothing of its own)
    full = retained_bytes(lambda: lin(x * 2).sum())
    compact = CompactLinear(lin, rank=32)
    small = retained_bytes(lambda: compact(x * 2).sum())
    assert small < full / 4, (small, full)


def test_module_draws_a_new_projection_every_call_and_refuses_bad_input():
    lin = torch.nn.Linear(16, 8, bias=False)
    compact = CompactLinear(lin, rank=4, seed=3)
    assert compact.weight is lin.weight
    x = torch.randn(32, 16)
    grads = []
    for _ in range(2):
        lin.weight.grad = None
        compact(x).sum().backward()
        grads.append(lin.weight.grad.clone())
    assert not torch.equal(grads[0], grads[1]) and compact.calls == 2
    with pytest.raises(ValueError, match=r"rank must be an int in \[1, 16\]"):
        CompactLinear(lin, rank=17)
    with pytest.raises(ValueError, match="bias-free"):
        CompactLinear(torch.nn.Linear(4, 4), rank=2)
    with pytest.raises(ValueError, match="rank must be"):
        compact_linear(x, lin.weight, 0, seed=0)


def test_policy_compacts_the_mlps_except_the_last_layer():
    from megacpp_lab.model.checkpointing import CheckpointingPolicy, apply_ac
    from megacpp_lab.model.config import model_config
    from megacpp_lab.model.hybrid import HybridLM

    torch.manual_seed(0)
    model = HybridLM(model_config("tiny", "cpu"))
    keys = set(model.state_dict())
    apply_ac(model, CheckpointingPolicy(compact_rank=16))
    kinds = [type(b.mlp.w_gate_up).__name__ for b in model.blocks]
    assert kinds == ["CompactLinear"] * 3 + ["Linear"] and set(model.state_dict()) == keys
    with pytest.raises(ValueError, match="compact_rank is eager-only"):
        apply_ac(HybridLM(model_config("tiny", "cpu")), CheckpointingPolicy(compact_rank=16), compiled=True)
    with pytest.raises(ValueError, match="compact_rank must be at most d_model=64"):
        apply_ac(HybridLM(model_config("tiny", "cpu")), CheckpointingPolicy(compact_rank=65))
    with pytest.raises(ValueError, match="compact_rank must be an int >= 1"):
        CheckpointingPolicy(compact_rank=0)
