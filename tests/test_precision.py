"""fp32-contract mixed precision: declared tensors stay fp32, the rest bf16, once at wrap time; tripwire."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from megacpp_lab.model.precision import MixedPrecision, apply_mixed_precision, fp32_contract
from megacpp_lab.nn.m2rnn import M2RNN, M2RNNConfig, softplus_decay_gate


def _m2rnn(**kw) -> M2RNN:
    torch.manual_seed(0)
    return M2RNN(M2RNNConfig.build(d_model=32, n_heads=2, k_head_dim=16, v_head_dim=16, kernel="reference", **kw))


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.mixer = _m2rnn()
        self.mlp = nn.Linear(32, 32)
        self.register_buffer("scale", torch.ones(32))


def test_contract_is_collected_with_qualified_names_and_kept_fp32() -> None:
    block = _Block()
    assert fp32_contract(block) == ("mixer.A_log", "mixer.dt_bias", "mixer.D")
    wrapped = apply_mixed_precision(block)
    assert wrapped.plan.fp32 == ("mixer.A_log", "mixer.D", "mixer.dt_bias")
    for name, p in block.named_parameters():
        assert p.dtype == (torch.float32 if name in wrapped.plan.fp32 else torch.bfloat16), name
    assert block.scale.dtype == torch.bfloat16
    wrapped.check_contract()
    assert fp32_contract(_m2rnn(residual=False)) == ("A_log", "dt_bias")  # D is None: nothing to keep


def test_no_per_step_recasts_and_outputs_are_low_precision() -> None:
    wrapped = apply_mixed_precision(_m2rnn())
    ptrs = {n: p.data_ptr() for n, p in wrapped.named_parameters()}
    x = torch.randn(1, 16, 32)
    for _ in range(2):
        y = wrapped(x)
    assert y.dtype == torch.bfloat16
    assert ptrs == {n: p.data_ptr() for n, p in wrapped.named_parameters()}


def test_a_later_blanket_cast_of_the_wrapper_keeps_the_fp32_values() -> None:
    layer = _m2rnn()
    exact = layer.A_log.detach().clone()
    wrapped = apply_mixed_precision(copy.deepcopy(layer)).to(torch.bfloat16)
    assert wrapped.module.A_log.dtype == torch.float32
    assert torch.equal(wrapped.module.A_log, exact)  # restored from the saved fp32, not cast back up
    wrapped.check_contract()
    wrapped.module.dt_bias.data = wrapped.module.dt_bias.data.bfloat16()
    with pytest.raises(ValueError, match="dt_bias"):
        wrapped.check_contract()


def test_tripwire_blanket_bf16_cast_breaks_the_decay_path_and_the_wrapper_keeps_it() -> None:
    # long memory: 1 - f ~ 1e-3, where bf16 rounding of A_log / dt_bias is a percent-level error of the rate
    layer = _m2rnn(dt_min=1e-4, dt_max=1e-3, dt_init_floor=1e-5)
    decay = torch.zeros(2)
    rate = lambda m: 1 - softplus_decay_gate(decay, m.A_log, m.dt_bias)  # noqa: E731
    exact = rate(layer).detach()
    blanket = copy.deepcopy(layer).to(torch.bfloat16)
    wrapped = apply_mixed_precision(copy.deepcopy(layer))
    err = lambda m: float(((rate(m).detach() - exact).abs() / exact).max())  # noqa: E731
    assert err(blanket) > 1e-3
    assert err(wrapped.module) == 0.0


def test_bad_contracts_fail_closed() -> None:
    class Bad(nn.Module):
        _fp32_params = ("nope",)

        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.ones(2))

    with pytest.raises(ValueError, match="declares _fp32_params 'nope'"):
        apply_mixed_precision(Bad())

    class Str(nn.Module):
        _fp32_params = "w"

    with pytest.raises(ValueError, match="tuple of names"):
        fp32_contract(Str())
    with pytest.raises(ValueError, match="dtype must be"):
        MixedPrecision(nn.Linear(2, 2), torch.float64)
