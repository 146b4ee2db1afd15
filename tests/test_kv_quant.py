"""TurboQuant / PolarQuant KV-row quantisers: rotation, packing, error bounds, norms, fail-closed checks.

Derived 4-bit bounds (relative MSE = E||x - x_hat||^2 / ||x||^2, on Gaussian rows):
* TurboQuant: dim * per-coordinate distortion of a 16-level Lloyd-Max codebook on the coordinate
  marginal (close to N(0, 1/dim)). That is the Gaussian Lloyd-Max value 0.009497. The bound is 0.0095 + 10 %.
* PolarQuant: the sum over levels of E[2 (1 - cos delta)]. Level 1 is uniform on [0, 2pi) with step
  2pi/16, so it gives about pi^2 / (3 * 16^2) = 0.01285. The deeper levels (density sin(2 psi)^(m-1)) add
  about 0.0017 together, which gives about 0.0145. The bound is 0.016.
"""

from __future__ import annotations

import math

import pytest
import torch

from megacpp_lab.nn.kv_quant import (
    PolarQuant,
    QuantizedRows,
    TurboQuant,
    haar_rotation,
    make_quantizer,
    pack_codes,
    unpack_codes,
)

METHODS = ("turboquant", "polarquant")
LLOYD_GAUSS_4BIT = 0.009497  # Lloyd-Max 16-level MSE of N(0, 1), in units of the variance
BOUND_4BIT = {"turboquant": LLOYD_GAUSS_4BIT * 1.10, "polarquant": 0.016}


def _rows(n: int, dim: int, seed: int = 1, device: str = "cpu") -> torch.Tensor:
    return torch.randn(n, dim, generator=torch.Generator().manual_seed(seed)).to(device)


def _rel_mse(x: torch.Tensor, x_hat: torch.Tensor) -> float:
    return float(((x - x_hat).pow(2).sum(-1) / x.pow(2).sum(-1)).mean())


def test_rotation_orthogonal_and_seeded() -> None:
    r = haar_rotation(512, seed=3)
    assert torch.allclose(r @ r.T, torch.eye(512), atol=1e-5)
    assert torch.equal(r, haar_rotation(512, seed=3))
    assert not torch.allclose(r, haar_rotation(512, seed=4))
    assert torch.equal(TurboQuant(64, seed=7).rotation, PolarQuant(64, seed=7).rotation)


@pytest.mark.parametrize("bits", range(1, 9))
@pytest.mark.parametrize("n", [1, 7, 64, 511])
def test_pack_unpack_round_trip(bits: int, n: int) -> None:
    codes = torch.randint(0, 1 << bits, (3, 5, n), generator=torch.Generator().manual_seed(bits * n), dtype=torch.uint8)
    packed = pack_codes(codes, bits)
    assert packed.dtype == torch.uint8 and packed.shape == (3, 5, math.ceil(n * bits / 8))
    assert torch.equal(unpack_codes(packed, bits, n), codes)


def test_pack_4bit_two_codes_per_byte() -> None:
    # Code 2i goes in the low nibble. The 4-bit fast path has the same layout as the generic bitstream.
    assert pack_codes(torch.tensor([[1, 2, 3]], dtype=torch.uint8), 4).tolist() == [[0x21, 0x03]]
    with pytest.raises(ValueError, match="codes"):
        pack_codes(torch.tensor([16]), 4)


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("dim", [512, 64])
def test_relative_mse_bound_and_monotone_in_bits(method: str, dim: int) -> None:
    x = _rows(2000, dim)
    errs = {}
    for bits in (2, 3, 4, 6):
        q = make_quantizer(method, dim, bits=bits, seed=0)
        errs[bits] = _rel_mse(x, q.dequantize(q.quantize(x)))
        # The measured error matches the codebook's own predicted distortion.
        assert errs[bits] == pytest.approx(q.expected_rel_mse(), rel=0.05), (bits, errs[bits])
    assert errs[4] < BOUND_4BIT[method], errs
    assert errs[2] > errs[3] > errs[4] > errs[6], errs


def test_turbo_codebook_matches_gaussian_lloyd_max() -> None:
    # For large dim, the coordinate marginal is close to N(0, 1/dim). So the predicted error is the Gaussian value.
    assert TurboQuant(512).expected_rel_mse() == pytest.approx(LLOYD_GAUSS_4BIT, rel=0.01)
    assert PolarQuant(512).expected_rel_mse() == pytest.approx(0.0145, rel=0.03)


@pytest.mark.parametrize("dim", [512, 64])
def test_norms_preserved(dim: int) -> None:
    x = _rows(2000, dim, seed=2) * 3.0
    for method in METHODS:
        q = make_quantizer(method, dim)
        ratio = q.dequantize(q.quantize(x)).norm(dim=-1) / x.norm(dim=-1)
        assert abs(float(ratio.mean()) - 1) < 0.01, method
        assert float((ratio - 1).abs().quantile(0.99)) < (0.03 if dim == 512 else 0.08), method
        if method == "polarquant":  # exact up to the fp16 rounding of the stored norm
            assert float((ratio - 1).abs().max()) < 1e-3


def test_compression_figures() -> None:
    for method in METHODS:
        q = make_quantizer(method, 512)
        # 512 codes (TurboQuant) or 511 codes (PolarQuant) at 4 bits -> 256 bytes, plus a 2-byte fp16 norm.
        assert q.bytes_per_row() == 258.0
        assert q.compression_vs_bf16() == 1024 / 258  # 3.969x
    assert TurboQuant(64).bytes_per_row() == 34.0 and PolarQuant(64).bytes_per_row() == 34.0


@pytest.mark.parametrize("method", METHODS)
def test_shapes_bf16_determinism_and_zero_rows(method: str) -> None:
    x = _rows(2 * 3 * 4, 512, seed=5).reshape(2, 3, 4, 512).bfloat16()
    q = make_quantizer(method, 512, seed=11)
    rows = q.quantize(x)
    assert rows.codes.dtype == torch.uint8 and rows.codes.shape == (2, 3, 4, 256)
    assert rows.norms.dtype == torch.float16 and rows.norms.shape == (2, 3, 4)
    assert (rows.method, rows.dim, rows.bits) == (method, 512, 4)
    up = q.quantize(x.float())
    assert torch.equal(rows.codes, up.codes) and torch.equal(rows.norms, up.norms)
    again = make_quantizer(method, 512, seed=11).quantize(x)
    assert torch.equal(rows.codes, again.codes)
    assert not torch.equal(rows.codes, make_quantizer(method, 512, seed=12).quantize(x).codes)
    out = q.dequantize(rows, dtype=torch.bfloat16)
    assert out.dtype == torch.bfloat16 and out.shape == x.shape
    assert torch.equal(q.dequantize(q.quantize(torch.zeros(2, 512))), torch.zeros(2, 512))
    assert q.dequantize(q.quantize(torch.zeros(0, 512))).shape == (0, 512)  # an empty cache slice


@pytest.mark.parametrize("method", METHODS)
def test_fail_closed(method: str) -> None:
    q = make_quantizer(method, 64)
    with pytest.raises(ValueError, match=r"x\.shape\[-1\]: expected dim=64, got 32"):
        q.quantize(torch.randn(4, 32))
    with pytest.raises(ValueError, match=r"x\.dtype"):
        q.quantize(torch.ones(4, 64, dtype=torch.int32))
    bad = torch.randn(4, 64)
    bad[0, 0], bad[1, 5], bad[3, 9] = float("nan"), float("inf"), -float("inf")
    with pytest.raises(ValueError, match="x has 3 non-finite"):
        q.quantize(bad)
    with pytest.raises(ValueError, match="norm exceeds the float16"):
        q.quantize(torch.full((2, 64), 1e4))
    for bits in (1, 9, 4.0, True):
        with pytest.raises(ValueError, match="bits"):
            make_quantizer(method, 64, bits=bits)
    with pytest.raises(ValueError, match="dim"):
        make_quantizer(method, 1)
    rows = q.quantize(torch.randn(4, 64))
    other = "polarquant" if method == "turboquant" else "turboquant"
    with pytest.raises(ValueError, match=r"q\.method"):
        make_quantizer(other, 64).dequantize(rows)
    with pytest.raises(ValueError, match=r"q\.dim"):
        make_quantizer(method, 128).dequantize(rows)
    with pytest.raises(ValueError, match=r"q\.bits"):
        make_quantizer(method, 64, bits=3).dequantize(rows)
    with pytest.raises(ValueError, match=r"q\.codes"):
        q.dequantize(QuantizedRows(rows.codes[:, :-1], rows.norms, 64, 4, method))
    with pytest.raises(ValueError, match=r"q\.norms"):
        q.dequantize(QuantizedRows(rows.codes, rows.norms[:2], 64, 4, method))


def test_fail_closed_dim_and_method() -> None:
    for dim in (48, 100, 0):
        with pytest.raises(ValueError, match="dim must be a power of two"):
            PolarQuant(dim)
    TurboQuant(48)  # TurboQuant takes any dim >= 2
    with pytest.raises(ValueError, match="method"):
        make_quantizer("int4", 64)


@pytest.mark.cuda
def test_cuda_100k_rows() -> None:
    x = _rows(100_000, 512, seed=9, device="cuda")
    for method in METHODS:
        q = make_quantizer(method, 512, device="cuda")
        rows = q.quantize(x)
        assert rows.codes.is_cuda and rows.norms.is_cuda
        err = _rel_mse(x, q.dequantize(rows))
        assert err < BOUND_4BIT[method] and err == pytest.approx(q.expected_rel_mse(), rel=0.03), (method, err)
        # The codes agree with the CPU path, except where fp32 rounding crosses a boundary.
        cpu = make_quantizer(method, 512).quantize(x[:4096].cpu())
        n = q.n_codes
        same = unpack_codes(rows.codes[:4096].cpu(), 4, n) == unpack_codes(cpu.codes, 4, n)
        assert float(same.float().mean()) > 0.99, method
