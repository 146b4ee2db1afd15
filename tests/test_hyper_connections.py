"""mHC: identity at init, doubly stochastic H_res, gate ranges, fp32 coefficients under bf16, gradients,
fail-closed config, and documents kept isolated (the mixing is across streams, never across tokens)."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from megacpp_lab.model.precision import apply_precision, check_precision
from megacpp_lab.nn.hyper_connections import (
    HyperConnection,
    HyperConnectionConfig,
    collapse_streams,
    expand_streams,
    sinkhorn_knopp,
)
from megacpp_lab.testing import DocCausalAttention, check_leaks

D = 16


def _doc_ids(B: int = 2, T: int = 12) -> torch.Tensor:
    ids = torch.zeros(B, T, dtype=torch.long)
    ids[0, 4:], ids[0, 9:] = 1, 2
    ids[1, 7:] = 1
    return ids


def _perturb(hc: HyperConnection, scale: float = 0.5, seed: int = 1) -> HyperConnection:
    """Move every parameter off its init; the projection by scale / sqrt(fan_in), so the logits move by
    about `scale` (the normed input has unit RMS)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in hc.parameters():
            p.add_(scale * torch.randn(p.shape, generator=g) / (p.shape[-1] ** 0.5 if p.dim() == 2 else 1.0))
    return hc


def _blocks() -> list[nn.Module]:
    torch.manual_seed(0)
    return [nn.Linear(D, D), DocCausalAttention(D, 2), nn.Sequential(nn.Linear(D, 2 * D), nn.GELU(), nn.Linear(2 * D, D)),
            DocCausalAttention(D, 4)]  # fmt: skip


def _call(block: nn.Module, x: torch.Tensor, doc_ids: torch.Tensor) -> torch.Tensor:
    return block(x, doc_ids=doc_ids) if isinstance(block, DocCausalAttention) else block(x)


class _Wrapped(nn.Module):
    """A block that takes doc_ids as a keyword (the kwargs path of HyperConnection.forward)."""

    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.block = block

    def forward(self, x: torch.Tensor, doc_ids: torch.Tensor | None = None) -> torch.Tensor:
        return _call(self.block, x, doc_ids)


# ----------------------------------------------------------------------------- identity at init


@pytest.mark.parametrize("n", [2, 4, 7])
def test_at_init_the_stack_equals_the_plain_residual_stack(n: int) -> None:
    cfg = HyperConnectionConfig.build(n_streams=n)
    blocks = [_Wrapped(b) for b in _blocks()]
    hcs = [HyperConnection(D, cfg, layer_idx=i) for i in range(len(blocks))]
    torch.manual_seed(2)
    x, doc_ids = torch.randn(2, 12, D), _doc_ids()
    plain = x
    for block in blocks:
        plain = plain + block(plain, doc_ids=doc_ids)
    streams = expand_streams(x, n)
    assert streams.shape == (2, 12, n, D)
    for hc, block in zip(hcs, blocks):
        streams = hc(streams, block, doc_ids=doc_ids)
        assert torch.allclose(streams, streams[:, :, :1].expand_as(streams), rtol=1e-5, atol=1e-5)  # stay equal
    torch.testing.assert_close(collapse_streams(streams), plain, rtol=1e-5, atol=1e-5)  # fp32 rounding
    assert not torch.allclose(plain, x, atol=1e-2)  # the blocks did something: the comparison is not trivial


def test_init_coefficients_are_the_documented_ones() -> None:
    cfg = HyperConnectionConfig.build(n_streams=4, pre_init_main=0.7, res_init_diag=0.9)
    hc = HyperConnection(D, cfg, layer_idx=6)
    pre, post, res = hc.coefficients(torch.randn(1, 3, 4, D))
    torch.testing.assert_close(pre[0, 0], torch.tensor([0.1, 0.1, 0.7, 0.1]))  # stream 6 % 4 favoured
    assert torch.allclose(pre.sum(-1), torch.ones(1, 3), atol=1e-6)
    torch.testing.assert_close(post, torch.ones(1, 3, 4))
    expected = torch.full((4, 4), 0.1 / 3)
    expected.fill_diagonal_(0.9)
    torch.testing.assert_close(res[0, 0], expected)
    uniform = HyperConnection(D, HyperConnectionConfig.build(n_streams=4, pre_init_main=0.25, res_init_diag=0.25))
    pre, _, res = uniform.coefficients(torch.randn(1, 1, 4, D))
    torch.testing.assert_close(res, torch.full((1, 1, 4, 4), 0.25))
    torch.testing.assert_close(pre, torch.full((1, 1, 4), 0.25))


def test_trained_weights_are_not_a_no_op_and_match_the_formula() -> None:
    """The identity test above would pass for a seam that ignores its coefficients: check the formula."""
    hc = _perturb(HyperConnection(D, HyperConnectionConfig.build()))
    block = nn.Linear(D, D)
    streams = torch.randn(2, 5, 4, D)
    out = hc(streams, block)
    pre, post, res = hc.coefficients(streams)
    f = block((pre[..., None] * streams).sum(-2))
    ref = (res[..., None] * streams[:, :, None, :, :]).sum(-2) + post[..., None] * f[:, :, None, :]
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    plain = streams + block(streams.mean(-2))[:, :, None]
    assert (out - plain).abs().max() > 1e-2


# ----------------------------------------------------------------------------- coefficients


@pytest.mark.parametrize("n, perturb", [(4, 0.0), (4, 0.5), (7, 0.5), (4, 4.0)])
def test_h_res_is_doubly_stochastic_and_the_gates_are_in_range(n: int, perturb: float) -> None:
    hc = _perturb(HyperConnection(D, HyperConnectionConfig.build(n_streams=n)), perturb)
    pre, post, res = hc.coefficients(torch.randn(3, 9, n, D) * 3)
    ones = torch.ones(3, 9, n)
    assert (res >= 0).all()
    torch.testing.assert_close(res.sum(-1), ones, rtol=0, atol=1e-5)  # rows: exact to rounding
    if perturb <= 1:
        assert ((pre > 0) & (pre < 1)).all() and ((post > 0) & (post < 2)).all()
    else:  # fp32 sigmoid saturates at extreme logits: the closed interval
        assert ((pre >= 0) & (pre <= 1)).all() and ((post >= 0) & (post <= 2)).all()
    if perturb:
        assert pre.std() > 1e-3 and res.std(dim=(0, 1)).max() > 1e-3  # per-token, not the init constants
    if perturb <= 1:  # realistic logits: 20 iterations have converged the columns
        torch.testing.assert_close(res.sum(-2), ones, rtol=0, atol=1e-3)
    else:  # extreme logits (std ~4): 20 iterations are approximate; more iterations get closer
        longer = dataclasses.replace(hc.config, sinkhorn_iters=200)
        hc_long = HyperConnection(D, longer)
        hc_long.load_state_dict(hc.state_dict())
        x = torch.randn(3, 9, n, D) * 3
        err20 = (hc.coefficients(x)[2].sum(-2) - 1).abs().max()
        err200 = (hc_long.coefficients(x)[2].sum(-2) - 1).abs().max()
        assert err200 < err20 and err200 < 0.05


def test_sinkhorn_converges_and_only_ends_on_rows() -> None:
    logits = torch.randn(50, 5, 5, generator=torch.Generator().manual_seed(0))
    one = sinkhorn_knopp(logits, 1)
    many = sinkhorn_knopp(logits, 20)
    ones = torch.ones(50, 5)
    torch.testing.assert_close(one.sum(-1), ones)  # rows are always normalised last
    assert (one.sum(-2) - 1).abs().max() > 1e-3  # after one iteration the columns are not there yet
    torch.testing.assert_close(many.sum(-2), ones, rtol=0, atol=1e-3)
    assert many.dtype == torch.float32 and sinkhorn_knopp(logits.bfloat16(), 3).dtype == torch.float32
    with pytest.raises(ValueError, match=r"\[\.\.\., n, n\]"):
        sinkhorn_knopp(torch.zeros(3, 4), 3)


# ----------------------------------------------------------------------------- precision


def test_coefficients_are_fp32_under_bf16_streams_and_mixed_precision() -> None:
    hc = _perturb(HyperConnection(D, HyperConnectionConfig.build()))
    block = nn.Linear(D, D)

    class Step(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.hc, self.block = hc, block

        def forward(self, streams: torch.Tensor) -> torch.Tensor:
            return self.hc(streams, self.block)

    exact = {n: p.detach().clone() for n, p in hc.named_parameters()}
    step = Step()
    plan = apply_precision(step, torch.bfloat16)
    assert set(plan.fp32) == {"hc.norm_weight", "hc.weight", "hc.bias"}
    for name, p in hc.named_parameters():
        assert p.dtype == torch.float32 and torch.equal(p, exact[name]), name  # kept, not rounded through bf16
    assert block.weight.dtype == torch.bfloat16
    streams = torch.randn(2, 6, 4, D).bfloat16()
    coeffs = hc.coefficients(streams)
    assert all(t.dtype == torch.float32 for t in coeffs)
    for got, ref in zip(coeffs, hc.coefficients(streams.float())):
        assert torch.equal(got, ref)  # the bf16 input is upcast once, then everything is fp32
    out = step(streams)
    assert out.dtype == torch.bfloat16
    check_precision(step, plan)
    step.to(torch.bfloat16)  # a later blanket cast: the check names the contract tensor it cast away
    with pytest.raises(ValueError, match=r"fp32-contract tensor 'hc\.\w+' is torch.bfloat16"):
        check_precision(step, plan)


# ----------------------------------------------------------------------------- gradients


def test_gradients_reach_every_parameter() -> None:
    hc = _perturb(HyperConnection(D, HyperConnectionConfig.build()), 0.2)
    block = DocCausalAttention(D, 2)
    x = torch.randn(2, 12, D, requires_grad=True)
    y = collapse_streams(hc(expand_streams(x, 4) + 0.1 * torch.randn(2, 12, 4, D), block, doc_ids=_doc_ids()))
    (y * torch.randn_like(y)).sum().backward()
    for name, p in [*hc.named_parameters(), *(("block." + n, p) for n, p in block.named_parameters())]:
        assert p.grad is not None and torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0, name
    assert x.grad is not None and x.grad.abs().sum() > 0


def test_init_breaks_the_symmetry_between_streams() -> None:
    """With uneven H_pre at init the streams get different gradients, so they can diverge from equal."""
    torch.manual_seed(0)
    blocks = [nn.Linear(D, D), nn.Linear(D, D)]
    for pre_main, symmetric in ((0.7, False), (0.25, True)):
        cfg = HyperConnectionConfig.build(pre_init_main=pre_main)
        hcs = [HyperConnection(D, cfg, layer_idx=i) for i in range(2)]
        streams = expand_streams(torch.randn(2, 5, D), 4)
        for hc, block in zip(hcs, blocks):
            streams = hc(streams, block)
        (collapse_streams(streams) ** 2).sum().backward()
        post_grad = hcs[0].bias.grad[4:8]
        assert torch.allclose(post_grad, post_grad[:1].expand(4), rtol=1e-5, atol=1e-7) == symmetric


# ----------------------------------------------------------------------------- documents stay isolated


def test_wrapping_a_doc_causal_block_keeps_documents_isolated() -> None:
    torch.manual_seed(0)
    emb = nn.Embedding(259, D)
    hcs = [_perturb(HyperConnection(D, HyperConnectionConfig.build(), layer_idx=i), 0.3, seed=i) for i in range(2)]
    tokens = torch.randint(0, 259, (2, 24))
    doc_ids = torch.zeros(2, 24, dtype=torch.long)
    doc_ids[0, 7:], doc_ids[0, 15:], doc_ids[1, 11:] = 1, 2, 1

    def stack(block: nn.Module):
        def fn(t: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
            streams = expand_streams(emb(t), 4)
            for hc in hcs:
                streams = hc(streams, block, doc_ids=d)
            return collapse_streams(streams)

        return fn

    with torch.no_grad():
        report = check_leaks(stack(DocCausalAttention(D, 2).eval()), tokens, doc_ids, vocab_size=259)
        assert report.passed, str(report)
        leaky = check_leaks(stack(DocCausalAttention(D, 2, doc_masked=False).eval()), tokens, doc_ids,
                            vocab_size=259, causal=False)  # fmt: skip
    assert not leaky.passed and leaky.cross_doc.magnitude > leaky.tol


# ----------------------------------------------------------------------------- config and API


@pytest.mark.parametrize(
    "field, value",
    [("n_streams", 1), ("n_streams", 65), ("n_streams", True), ("n_streams", 4.0), ("sinkhorn_iters", 0),
     ("sinkhorn_iters", True), ("eps", 0.0), ("eps", 1.0), ("eps", float("nan")), ("pre_init_main", 0.2),
     ("pre_init_main", 1.0), ("res_init_diag", 0.1), ("res_init_diag", 1.0), ("res_init_diag", "0.9")],
)  # fmt: skip
def test_config_fails_closed_naming_the_field(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=rf"HyperConnectionConfig\.{field} must be"):
        HyperConnectionConfig.build(**{field: value})


def test_config_build_reads_only_prefixed_fields_and_is_frozen() -> None:
    cfg = HyperConnectionConfig.build()
    assert (cfg.n_streams, cfg.sinkhorn_iters) == (4, 20)
    src = SimpleNamespace(mhc=True, mhc_n_streams=2, mhc_sinkhorn_iters=5, eps=0.5, n_streams=8)
    cfg = HyperConnectionConfig.build(src, sinkhorn_iters=7)
    assert (cfg.n_streams, cfg.sinkhorn_iters, cfg.eps) == (2, 7, 1e-6)  # a model's bare eps is not this layer's
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.n_streams = 3
    with pytest.raises(ValueError, match=r"HyperConnectionConfig has no field\(s\) \['mhc'\]"):
        HyperConnectionConfig.build(mhc=True)


def test_module_and_helpers_fail_closed() -> None:
    with pytest.raises(TypeError, match="HyperConnectionConfig"):
        HyperConnection(D, SimpleNamespace(n_streams=4))
    hc = HyperConnection(D, HyperConnectionConfig.build())
    with pytest.raises(ValueError, match=r"streams must be \[B,T,4,16\]"):
        hc(torch.randn(2, 3, D), nn.Identity())
    with pytest.raises(ValueError, match="must return"):
        hc(torch.randn(2, 3, 4, D), lambda x: x[..., :3])
    with pytest.raises(ValueError, match="reduce must be one of"):
        collapse_streams(torch.randn(1, 2, 4, D), "max")
    torch.testing.assert_close(collapse_streams(expand_streams(torch.ones(1, 2, D), 4), "sum"), torch.full((1, 2, D), 4.0))
    _perturb(hc)
    hc.reset_parameters()
    assert torch.equal(hc.weight, torch.zeros_like(hc.weight)) and torch.equal(hc.bias, hc.init_bias())
