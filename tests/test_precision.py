"""fp32-contract mixed precision: declared tensors stay fp32, the rest bf16, one in-place cast; tripwire."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from megacpp_lab.model.precision import apply_precision, check_precision, fp32_contract
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
    params = dict(block.named_parameters())
    plan = apply_precision(block)
    assert plan.fp32 == ("mixer.A_log", "mixer.D", "mixer.dt_bias")
    for name, p in block.named_parameters():
        assert p is params[name]  # cast in place: the same Parameter objects, no wrapper
        assert p.dtype == (torch.float32 if name in plan.fp32 else torch.bfloat16), name
    assert block.scale.dtype == torch.bfloat16
    check_precision(block, plan)
    assert fp32_contract(_m2rnn(residual=False)) == ("A_log", "dt_bias")  # D is None: nothing to keep


def test_no_per_step_recasts_and_outputs_are_low_precision() -> None:
    layer = _m2rnn()
    apply_precision(layer)
    ptrs = {n: p.data_ptr() for n, p in layer.named_parameters()}
    x = torch.randn(1, 16, 32, dtype=torch.bfloat16)
    for _ in range(2):
        y = layer(x)
    assert y.dtype == torch.bfloat16
    assert ptrs == {n: p.data_ptr() for n, p in layer.named_parameters()}


def test_a_later_blanket_cast_is_caught_naming_the_tensor() -> None:
    layer = _m2rnn()
    plan = apply_precision(layer)
    layer.dt_bias.data = layer.dt_bias.data.bfloat16()
    with pytest.raises(ValueError, match="fp32-contract tensor 'dt_bias' is torch.bfloat16"):
        check_precision(layer, plan)
    other = _m2rnn()
    plan = apply_precision(other)
    other.float()  # the cast tensors back to fp32: the plan says bf16
    with pytest.raises(ValueError, match="the precision plan says torch.bfloat16"):
        check_precision(other, plan)


def test_tripwire_blanket_bf16_cast_breaks_the_decay_path_and_apply_precision_keeps_it() -> None:
    # long memory: 1 - f ~ 1e-3, where bf16 rounding of A_log / dt_bias is a percent-level error of the rate
    layer = _m2rnn(dt_min=1e-4, dt_max=1e-3, dt_init_floor=1e-5)
    decay = torch.zeros(2)
    rate = lambda m: 1 - softplus_decay_gate(decay, m.A_log, m.dt_bias)  # noqa: E731
    exact = rate(layer).detach()
    blanket = copy.deepcopy(layer).to(torch.bfloat16)
    kept = copy.deepcopy(layer)
    apply_precision(kept)
    err = lambda m: float(((rate(m).detach() - exact).abs() / exact).max())  # noqa: E731
    assert err(blanket) > 1e-3
    assert err(kept) == 0.0


def test_parallelize_casts_once_and_keeps_the_plan() -> None:
    from megacpp_lab.model.config import model_config
    from megacpp_lab.model.hybrid import HybridLM
    from megacpp_lab.model.parallelize import ParallelConfig, parallelize

    model = HybridLM(model_config("tiny", "cpu"))
    ready = parallelize(model, ParallelConfig(dtype="bf16"))
    assert ready is model and model.precision_plan.dtype == torch.bfloat16
    check_precision(model, model.precision_plan)
    assert model.embed.weight.dtype == torch.bfloat16
    assert all(dict(model.named_parameters())[n].dtype == torch.float32 for n in model.precision_plan.fp32
               if n in dict(model.named_parameters()))  # fmt: skip
    with pytest.raises(ValueError, match="plain fp32 model"):  # a second cast, or a model cast by hand, is refused
        parallelize(model, ParallelConfig(dtype="bf16"))
    fp32 = HybridLM(model_config("tiny", "cpu"))
    assert parallelize(fp32, ParallelConfig()).precision_plan is None  # auto on a CPU: fp32, nothing cast


def test_bad_contracts_and_dtypes_fail_closed() -> None:
    class Bad(nn.Module):
        _fp32_params = ("nope",)

        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.ones(2))

    with pytest.raises(ValueError, match="declares _fp32_params 'nope'"):
        apply_precision(Bad())

    class Str(nn.Module):
        _fp32_params = "w"

    with pytest.raises(ValueError, match="tuple of names"):
        fp32_contract(Str())
    with pytest.raises(ValueError, match="dtype must be"):
        apply_precision(nn.Linear(2, 2), torch.float64)
