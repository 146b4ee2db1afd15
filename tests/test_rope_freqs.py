"""RoPE frequency tables: closed form, yarn / piecewise bands, rotation properties, fail-closed."""

import math

import pytest
import torch

from megacpp_lab.nn.rope_freqs import (
    RopeScaling,
    apply_rope_reference,
    rope_attention_scale,
    rope_cos_sin,
    rope_inv_freq,
)

DIM = 128


def _closed_form(dim: int, base: float) -> torch.Tensor:
    return (base ** (-torch.arange(0, dim, 2, dtype=torch.float64) / dim)).float()


def test_none_matches_closed_form() -> None:
    for dim, base in ((2, 10000.0), (64, 10000.0), (DIM, 500000.0)):
        inv = rope_inv_freq(dim, base)
        assert inv.dtype == torch.float32 and inv.shape == (dim // 2,)
        torch.testing.assert_close(inv, _closed_form(dim, base), rtol=0, atol=0)
    cos, sin = rope_cos_sin(300, 64)
    assert cos.shape == sin.shape == (300, 32) and cos.dtype == sin.dtype == torch.float32
    angle = torch.arange(300, dtype=torch.float64)[:, None] * rope_inv_freq(64).double()
    torch.testing.assert_close(cos, angle.cos().float(), rtol=0, atol=1e-7)
    torch.testing.assert_close(sin, angle.sin().float(), rtol=0, atol=1e-7)


@pytest.mark.parametrize("kind", ["yarn", "piecewise"])
def test_factor_one_is_none_exactly(kind: str) -> None:
    sc = RopeScaling(kind=kind, factor=1.0, mscale=0.7)
    assert torch.equal(rope_inv_freq(DIM, 10000.0, sc), rope_inv_freq(DIM, 10000.0))
    assert rope_attention_scale(sc) == 1.0
    for a, b in zip(rope_cos_sin(64, DIM, scaling=sc), rope_cos_sin(64, DIM)):
        assert torch.equal(a, b)


def _check_bands(ratio: torch.Tensor, keep: torch.Tensor, divide: torch.Tensor, factor: float) -> None:
    assert keep.any() and divide.any() and (~(keep | divide)).any()  # all three bands populated
    torch.testing.assert_close(ratio[keep], torch.ones_like(ratio[keep]), rtol=1e-6, atol=0)
    torch.testing.assert_close(ratio[divide], torch.full_like(ratio[divide], 1 / factor), rtol=1e-6, atol=0)
    mid = ratio[~(keep | divide)]
    assert ((mid < 1) & (mid > 1 / factor)).all()
    # inv_freq falls with the index, so the kept fraction must never grow: a monotone ramp.
    assert (ratio[1:] <= ratio[:-1] + 1e-7).all()


def test_yarn_bands_and_ramp() -> None:
    sc = RopeScaling(kind="yarn", factor=16.0, original_max_positions=4096)
    base_inv = _closed_form(DIM, 10000.0).double()
    ratio = rope_inv_freq(DIM, 10000.0, sc).double() / base_inv
    rotations = sc.original_max_positions * base_inv / (2 * math.pi)
    _check_bands(ratio, rotations >= sc.beta_fast, rotations <= sc.beta_slow, sc.factor)
    assert ratio[0] == 1.0 and abs(ratio[-1] - 1 / 16) < 1e-7  # highest kept, lowest divided
    # Inside the ramp: linear in rotations, gamma = (r - beta_slow) / (beta_fast - beta_slow).
    gamma = ((rotations - sc.beta_slow) / (sc.beta_fast - sc.beta_slow)).clamp(0, 1)
    torch.testing.assert_close(ratio, (1 - gamma) / sc.factor + gamma, rtol=1e-6, atol=0)


def test_yarn_attention_scale() -> None:
    assert rope_attention_scale(RopeScaling(kind="yarn", factor=40.0)) == pytest.approx(0.1 * math.log(40) + 1)
    sc = RopeScaling(kind="yarn", factor=40.0, mscale=0.707)
    m = 0.1 * 0.707 * math.log(40) + 1
    assert rope_attention_scale(sc) == pytest.approx(m)
    assert rope_attention_scale(RopeScaling(kind="piecewise", factor=8.0)) == 1.0
    assert rope_attention_scale(RopeScaling()) == 1.0
    cos, sin = rope_cos_sin(128, 64, scaling=sc)
    torch.testing.assert_close(cos[0], torch.full((32,), m, dtype=torch.float32))  # cos(0) * m
    torch.testing.assert_close(cos**2 + sin**2, torch.full_like(cos, m * m))


def test_piecewise_bands() -> None:
    # Llama-3.1 settings.
    sc = RopeScaling(kind="piecewise", factor=8.0, original_max_positions=8192, low_freq_factor=1.0, high_freq_factor=4.0)
    base_inv = _closed_form(DIM, 500000.0).double()
    ratio = rope_inv_freq(DIM, 500000.0, sc).double() / base_inv
    wavelen = 2 * math.pi / base_inv
    _check_bands(ratio, wavelen < 8192 / 4.0, wavelen > 8192 / 1.0, sc.factor)
    assert ratio[0] == 1.0 and ratio[-1] == pytest.approx(1 / 8)


def _rope_at(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, p: int) -> torch.Tensor:
    return apply_rope_reference(x, cos[p : p + 1], sin[p : p + 1])  # x [1, H, d]


def test_rotation_norm_identity_and_relative_position() -> None:
    g = torch.Generator().manual_seed(0)
    d = 64
    cos, sin = rope_cos_sin(512, d, scaling=RopeScaling(kind="piecewise", factor=4.0, original_max_positions=128))
    x = torch.randn(2, 16, 3, d, generator=g)
    y = apply_rope_reference(x, cos[:16], sin[:16])
    assert y.shape == x.shape and y is not x
    pair_norm = lambda t: t[..., : d // 2] ** 2 + t[..., d // 2 :] ** 2  # noqa: E731
    torch.testing.assert_close(pair_norm(y), pair_norm(x), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(y[:, 0], x[:, 0], rtol=0, atol=0)  # position 0 is the identity

    q, k = torch.randn(1, 1, d, generator=g), torch.randn(1, 1, d, generator=g)
    for diff in (0, 3, 100):
        dots = [
            (_rope_at(q, cos, sin, s + diff) * _rope_at(k, cos, sin, s)).sum().item() for s in (0, 7, 250, 400)
        ]
        assert max(dots) - min(dots) < 1e-4 * max(1.0, abs(dots[0])), (diff, dots)


def test_negated_sin_inverts() -> None:
    x = torch.randn(4, 32, 2, 16, generator=torch.Generator().manual_seed(1))
    cos, sin = rope_cos_sin(32, 16, base=500.0)
    y = apply_rope_reference(x, cos, sin)
    assert not torch.allclose(y, x)
    torch.testing.assert_close(apply_rope_reference(y, cos, -sin), x, rtol=1e-5, atol=1e-5)


def test_bf16_in_bf16_out_computed_in_fp32() -> None:
    x = torch.randn(2, 24, 4, 32, generator=torch.Generator().manual_seed(2)).bfloat16()
    cos, sin = rope_cos_sin(24, 32)
    y = apply_rope_reference(x, cos, sin)
    assert y.dtype == torch.bfloat16
    ref = apply_rope_reference(x.float(), cos, sin)
    assert torch.equal(y, ref.bfloat16())  # one fp32 computation, one rounding at the end
    torch.testing.assert_close(y.float(), ref, rtol=1.6e-2, atol=1e-2)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"kind": "ntk"}, "kind"),
        ({"factor": 0.5}, "factor"),
        ({"factor": float("nan")}, "factor"),
        ({"original_max_positions": 0}, "original_max_positions"),
        ({"original_max_positions": 4096.0}, "original_max_positions"),
        ({"beta_fast": 1.0, "beta_slow": 1.0}, "beta_fast"),
        ({"beta_slow": 0.0}, "beta_slow"),
        ({"mscale": -1.0}, "mscale"),
        ({"low_freq_factor": 4.0, "high_freq_factor": 4.0}, "low_freq_factor"),
        ({"low_freq_factor": 0.0}, "low_freq_factor"),
    ],
)
def test_scaling_fail_closed(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        RopeScaling(**kwargs)


@pytest.mark.parametrize(
    "call, field",
    [
        (lambda: rope_inv_freq(7), "dim"),
        (lambda: rope_inv_freq(0), "dim"),
        (lambda: rope_inv_freq(8, base=1.0), "base"),
        (lambda: rope_cos_sin(8, 5), "dim"),
        (lambda: rope_cos_sin(8, 8, base=0.5), "base"),
        (lambda: rope_cos_sin(0, 8), "max_positions"),
    ],
)
def test_args_fail_closed(call, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        call()


def test_apply_shape_mismatch_fails_closed() -> None:
    cos, sin = rope_cos_sin(16, 8)
    x = torch.randn(2, 16, 2, 8)
    with pytest.raises(ValueError, match=r"cos shape: expected \(T, d/2\) = \(16, 4\), got \(16, 2\)"):
        apply_rope_reference(x, cos[:, :2], sin)
    with pytest.raises(ValueError, match="sin shape"):
        apply_rope_reference(x, cos, sin[:8])
    with pytest.raises(ValueError, match="last dim"):
        apply_rope_reference(torch.randn(16, 2, 7), cos, sin)
    with pytest.raises(ValueError, match="x must be"):
        apply_rope_reference(torch.randn(16, 8), cos, sin)
