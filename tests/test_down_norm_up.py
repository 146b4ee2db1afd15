"""FusedDownNormUp against its unfused reference: values, every gradient (fp64 gradcheck), saved activations,
and on the GPU in bf16 at a real MLA shape."""

from __future__ import annotations

import pytest
import torch

from megacpp_lab.kernels.down_norm_up import FusedDownNormUp, down_norm_up_reference


def test_fused_down_norm_up_matches_the_chain_and_saves_no_latent() -> None:
    torch.manual_seed(0)
    x = torch.randn(3, 5, 12, dtype=torch.float64, requires_grad=True)
    w_down = torch.randn(16, 12, dtype=torch.float64, requires_grad=True)
    rms_w = (1 + 0.1 * torch.randn(16, dtype=torch.float64)).requires_grad_()
    w_up = torch.randn(20, 16, dtype=torch.float64, requires_grad=True)
    args = (x, w_down, rms_w, w_up)
    assert torch.autograd.gradcheck(lambda *a: FusedDownNormUp.apply(*a, 1e-6), args)
    y = FusedDownNormUp.apply(*args, 1e-6)
    torch.testing.assert_close(y, down_norm_up_reference(*args, 1e-6))
    g = torch.randn_like(y)
    grads = torch.autograd.grad(y, args, g)
    ref = torch.autograd.grad(down_norm_up_reference(*args, 1e-6), args, g)
    for a, b in zip(grads, ref):
        torch.testing.assert_close(a, b)

    def saved_activation_shapes(fn) -> list[tuple[int, ...]]:
        shapes: list[tuple[int, ...]] = []
        params = {p.data_ptr() for p in args[1:]}
        with torch.autograd.graph.saved_tensors_hooks(lambda t: shapes.append(tuple(t.shape)) if t.data_ptr() not in params else None or t,
                                                      lambda t: t):  # fmt: skip
            fn(*args, 1e-6)
        return shapes

    fused = saved_activation_shapes(FusedDownNormUp.apply)
    chain = saved_activation_shapes(down_norm_up_reference)
    assert (3, 5, 16) not in fused and (3, 5, 16) in chain  # the [*, rank] latent is not kept
    assert sorted(fused) == [(3, 5, 1), (3, 5, 12)]  # x and rrms


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_fused_down_norm_up_matches_the_chain_on_gpu_bf16() -> None:
    torch.manual_seed(0)
    dev, dt = "cuda", torch.bfloat16
    x = torch.randn(4, 1024, 2048, device=dev, dtype=dt, requires_grad=True)
    w_down = (torch.randn(512, 2048, device=dev) / 2048**0.5).to(dt).requires_grad_()
    rms_w = (1 + 0.1 * torch.randn(512, device=dev)).to(dt).requires_grad_()
    w_up = (torch.randn(4096, 512, device=dev) / 512**0.5).to(dt).requires_grad_()
    args = (x, w_down, rms_w, w_up)
    y = FusedDownNormUp.apply(*args, 1e-6)
    y_ref = down_norm_up_reference(*args, 1e-6)
    torch.testing.assert_close(y.float(), y_ref.float(), atol=3e-2, rtol=3e-2)
    g = torch.randn_like(y)
    for a, b in zip(torch.autograd.grad(y, args, g), torch.autograd.grad(y_ref, args, g)):
        rel = ((a.float() - b.float()).norm() / b.float().norm()).item()
        assert rel < 2e-2, rel
