"""The SSD layer (nn/ssm.py): config, the paths against each other, the context, the leak harness, fp32 contract."""

from __future__ import annotations

import pytest
import torch

from megacpp_lab.model.precision import apply_precision
from megacpp_lab.nn.ssm import SSD, SSDConfig
from megacpp_lab.varlen import build_context

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SMALL = dict(d_model=32, n_heads=2, head_dim=16, state_dim=16, chunk=16)


def _layer(**kw) -> SSD:
    torch.manual_seed(0)
    return SSD(SSDConfig.build(**{**SMALL, **kw})).to(DEVICE)


def test_config_fails_closed_naming_the_field() -> None:
    for bad, name in ((dict(n_groups=3), "n_groups"), (dict(head_dim=0), "head_dim"), (dict(kernel="fast"), "kernel"),
                      (dict(conv_kernel=17), "conv_kernel"), (dict(conv_impl="cudnn"), "conv_impl"),
                      (dict(A_init_range=(0.0, 1.0)), "A_init_range")):  # fmt: skip
        with pytest.raises(ValueError, match=f"SSDConfig.{name}"):
            SSDConfig.build(**{**SMALL, **bad})

    class Megatron:
        hidden_size, num_attention_heads = 64, 4

    assert (SSDConfig.build(Megatron()).d_model, SSDConfig.build(Megatron()).n_heads) == (64, 4)


@pytest.mark.parametrize("kernel", ["triton", "reference"])
def test_layer_paths_equal_the_chunked_path_forward_and_backward(kernel: str) -> None:
    layer = _layer()
    doc_ids = torch.tensor([[0] * 11 + [1] * 25 + [2] * 4, [0] * 40], device=DEVICE)
    x = torch.randn(2, 40, 32, device=DEVICE)
    ctx = build_context(doc_ids)
    outs, grads = [], []
    for k in ("chunked", kernel):
        xk = x.clone().requires_grad_()
        y = layer(xk, ctx=ctx, kernel=k)
        y.square().sum().backward()
        outs.append(y.detach())
        grads.append([xk.grad] + [p.grad.clone() for p in layer.parameters()])
        layer.zero_grad()
    torch.testing.assert_close(outs[1], outs[0], atol=1e-4, rtol=1e-4)
    for a, b in zip(grads[1], grads[0]):
        torch.testing.assert_close(a, b, atol=1e-3, rtol=1e-3)


def test_layer_through_the_context_equals_each_document_run_alone() -> None:
    """The packed rows through their PackedContext equal every document run on its own as a one-document row
    (ctx=None): no state, conv window or gate crosses a boundary. A context of another shape, or anything
    but a context, fails by name."""
    layer = _layer()
    doc_ids = torch.tensor([[0] * 7 + [1] * 9, [0] * 3 + [1] * 13], device=DEVICE)
    x = torch.randn(2, 16, 32, device=DEVICE)
    packed = layer(x, ctx=build_context(doc_ids))
    for row, cuts in ((0, (0, 7, 16)), (1, (0, 3, 16))):
        for s, e in zip(cuts, cuts[1:]):
            torch.testing.assert_close(packed[row, s:e], layer(x[row : row + 1, s:e])[0], atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match=r"ctx is for \[B,T\] = \(2, 16\), the input is \(2, 15\)"):
        layer(x[:, :15], ctx=build_context(doc_ids))
    with pytest.raises(TypeError, match="ctx must be a PackedContext"):
        layer(x, ctx=doc_ids)


def test_layer_passes_the_leak_harness_on_real_packed_rows_and_fails_without_doc_ids(sample_leak_reports) -> None:
    torch.manual_seed(0)
    report, leaky = sample_leak_reports(_layer(), DEVICE)
    assert report.passed, str(report)
    assert not leaky.passed and leaky.cross_doc.magnitude > leaky.tol


def test_mixed_precision_keeps_the_decay_path_fp32() -> None:
    layer = _layer()
    exact = layer.A_log.detach().clone()
    apply_precision(layer, torch.bfloat16)
    for name in SSD._fp32_params:
        assert getattr(layer, name).dtype == torch.float32, name
    assert layer.in_proj.weight.dtype == torch.bfloat16
    assert torch.equal(layer.A_log, exact)  # kept, not rounded through bf16
