"""RoPE kernels against the torch reference: MLA Q side, MLA KV side, generic GQA; forward and backward;
bthd, packed thd (cu_seqlens) and explicit positions. CPU runs the kernels under TRITON_INTERPRET=1."""

from __future__ import annotations

import pytest
import torch

from megacpp_lab.kernels.rope import (
    mla_rope_kv,
    mla_rope_kv_reference,
    mla_rope_q_,
    mla_rope_q_reference,
    rope_qk_,
    rope_qk_reference,
)
from megacpp_lab.nn.rope_freqs import RopeScaling, rope_cos_sin

DEV = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def _layout_kwargs(layout: str, B: int, T: int) -> dict:
    if layout == "bthd":
        return {}
    if layout == "thd":  # three documents packed into B*T tokens
        n = B * T
        return {"cu_seqlens": torch.tensor([0, n // 3, n // 2, n], dtype=torch.int32, device=DEV)}
    pos = torch.cat([torch.arange(T // 2), torch.arange(T - T // 2)]).repeat(B).to(DEV)  # positions reset mid-row
    return {"positions": pos}


def _shape(layout: str, B: int, T: int, *rest: int) -> tuple[int, ...]:
    return (B, T, *rest) if layout == "bthd" else (B * T, *rest)


@pytest.mark.parametrize("layout", ["bthd", "thd", "thd_binary_search", "positions"])
@pytest.mark.parametrize("scaling", ["none", "yarn"])
def test_mla_rope_q_matches_reference_forward_and_backward(layout: str, scaling: str, monkeypatch) -> None:
    if layout == "thd_binary_search":  # many documents: the kernel switches from counting starts to bisection
        import megacpp_lab.kernels.rope as R

        monkeypatch.setattr(R, "COUNT_SEARCH_MAX_DOCS", 1)
        layout = "thd"
    B, T, H, dn, dr = 2, 12, 3, 8, 8
    cos, sin = rope_cos_sin(32, dr, scaling=RopeScaling(kind=scaling, factor=4.0 if scaling == "yarn" else 1.0,
                                                        original_max_positions=8))  # fmt: skip
    cos, sin = cos.to(DEV), sin.to(DEV)
    kw = _layout_kwargs(layout, B, T)
    x = torch.randn(_shape(layout, B, T, H, dn + dr), device=DEV)
    g = torch.randn_like(x)
    xr = x.clone().requires_grad_()
    ref = mla_rope_q_reference(xr, cos, sin, dn, **kw)
    ref.backward(g)
    leaf = x.clone().requires_grad_()
    q = leaf * 1.0  # a non-leaf, as the up-projection's output is
    out = mla_rope_q_(q, cos, sin, dn, **kw)
    assert out.data_ptr() == q.data_ptr()  # in place
    out.backward(g)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(leaf.grad, xr.grad, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out[..., :dn], x[..., :dn])  # the nope part passes through untouched


@pytest.mark.parametrize("layout", ["bthd", "thd", "positions"])
def test_mla_rope_kv_matches_reference_forward_and_backward(layout: str) -> None:
    B, T, H, dn, dv, dr, rank = 3, 7, 3, 8, 4, 8, 16  # 21 tokens: an odd tail for the token blocks
    cos, sin = (t.to(DEV) for t in rope_cos_sin(32, dr))
    kw = _layout_kwargs(layout, B, T)
    kv = torch.randn(_shape(layout, B, T, H, dn + dv), device=DEV)
    latent = torch.randn(_shape(layout, B, T, rank + dr), device=DEV)  # k_pe is a strided slice of it
    gk = torch.randn(_shape(layout, B, T, H, dn + dr), device=DEV)
    gv = torch.randn(_shape(layout, B, T, H, dv), device=DEV)
    grads = []
    for fn in (mla_rope_kv_reference, mla_rope_kv):
        a, b = kv.clone().requires_grad_(), latent.clone().requires_grad_()
        key, value = fn(a, b[..., rank:], cos, sin, dn, **kw)
        ((key * gk).sum() + (value * gv).sum()).backward()
        grads.append((key.detach(), value.detach(), a.grad, b.grad))
    for got, want in zip(grads[1], grads[0]):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert torch.all(grads[1][3][..., :rank] == 0)  # only the rope slice of the latent gets a gradient


@pytest.mark.parametrize("layout", ["bthd", "thd"])
@pytest.mark.parametrize("hq,hk", [(4, 4), (6, 2), (5, 1)])
def test_generic_gqa_rope_matches_reference(layout: str, hq: int, hk: int) -> None:
    B, T, D = 2, 9, 16
    cos, sin = (t.to(DEV) for t in rope_cos_sin(32, D))
    kw = _layout_kwargs(layout, B, T)
    q = torch.randn(_shape(layout, B, T, hq, D), device=DEV)
    k = torch.randn(_shape(layout, B, T, hk, D), device=DEV)
    gq, gk = torch.randn_like(q), torch.randn_like(k)
    qr, kr = q.clone().requires_grad_(), k.clone().requires_grad_()
    rq, rk = rope_qk_reference(qr, kr, cos, sin, **kw)
    ((rq * gq).sum() + (rk * gk).sum()).backward()
    ql, kl = q.clone().requires_grad_(), k.clone().requires_grad_()
    oq, ok = rope_qk_(ql * 1.0, kl * 1.0, cos, sin, **kw)
    ((oq * gq).sum() + (ok * gk).sum()).backward()
    for got, want in ((oq, rq), (ok, rk), (ql.grad, qr.grad), (kl.grad, kr.grad)):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_backward_rotation_is_the_inverse() -> None:
    cos, sin = (t.to(DEV) for t in rope_cos_sin(16, 8))
    x = torch.randn(1, 16, 2, 12, device=DEV)
    y = mla_rope_q_reference(x, cos, sin, 4)
    torch.testing.assert_close(mla_rope_q_reference(y, cos, sin, 4, inverse=True), x, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("grad", [True, False])
def test_compiled_region_has_no_graph_break(grad: bool) -> None:
    import torch._dynamo.testing

    cos, sin = (t.to(DEV) for t in rope_cos_sin(16, 8))

    def block(x: torch.Tensor, kv: torch.Tensor, pe: torch.Tensor, xg: torch.Tensor, kg: torch.Tensor) -> torch.Tensor:
        q = mla_rope_q_(x * 2.0, cos, sin, 4)
        key, value = mla_rope_kv(kv, pe, cos, sin, 4)
        qg, kg2 = rope_qk_(xg * 1.0, kg * 1.0, cos, sin)
        return q.sum() + key.sum() + value.sum() + qg.sum() + kg2.sum()

    counter = torch._dynamo.testing.CompileCounter()
    compiled = torch.compile(block, backend=counter, fullgraph=True)
    shapes = ((1, 8, 2, 12), (1, 8, 2, 8), (1, 8, 8), (1, 8, 4, 8), (1, 8, 2, 8))
    args = [torch.randn(s, device=DEV, requires_grad=grad) for s in shapes]
    out, ref = compiled(*args), block(*args)
    torch.testing.assert_close(out, ref)
    if grad:
        g_c = torch.autograd.grad(out, args)
        g_e = torch.autograd.grad(ref, args)
        for a, b in zip(g_c, g_e):
            torch.testing.assert_close(a, b)
    assert counter.frame_count == 1


def test_bad_inputs_fail_closed() -> None:
    cos, sin = (t.to(DEV) for t in rope_cos_sin(8, 8))
    q = torch.randn(1, 8, 2, 12, device=DEV)
    with pytest.raises(ValueError, match="cos must be"):
        mla_rope_q_(q.clone(), cos[:, :2].contiguous(), sin, 4)
    with pytest.raises(ValueError, match="d_rope must be even"):
        mla_rope_q_(torch.randn(1, 8, 2, 11, device=DEV), cos, sin, 4)
    with pytest.raises(ValueError, match="longer than the cos/sin table"):
        mla_rope_q_(torch.randn(1, 9, 2, 12, device=DEV), cos, sin, 4)
    with pytest.raises(ValueError, match="not both"):
        mla_rope_q_(q.clone(), cos, sin, 4, positions=torch.zeros(8, dtype=torch.long, device=DEV),
                    cu_seqlens=torch.tensor([0, 8], dtype=torch.int32, device=DEV))  # fmt: skip
    with pytest.raises(ValueError, match="without a copy"):
        mla_rope_q_(torch.randn(2, 8, 2, 12, device=DEV).transpose(1, 2), cos, sin, 4)
    with pytest.raises(ValueError, match="needs cu_seqlens or positions"):
        mla_rope_q_(q.view(8, 2, 12).clone(), cos, sin, 4)
    with pytest.raises(ValueError, match="k_pe must be"):
        mla_rope_kv(torch.randn(1, 8, 2, 8, device=DEV), torch.randn(1, 7, 8, device=DEV), cos, sin, 4)
    if DEV == "cpu":  # value checks run on the host for CPU tensors (device asserts on the GPU)
        with pytest.raises(ValueError, match=r"positions\[3\] = 9"):
            mla_rope_q_(q.clone(), cos, sin, 4, positions=torch.tensor([0, 1, 2, 9, 0, 1, 2, 3]))
        with pytest.raises(ValueError, match="cu_seqlens must rise"):
            mla_rope_q_(q.view(8, 2, 12).clone(), cos, sin, 4, cu_seqlens=torch.tensor([0, 5, 7], dtype=torch.int32))


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cuda_real_shapes(dtype: torch.dtype) -> None:
    B, T, H, dn, dr, dv = 2, 4096, 32, 128, 64, 128
    cos, sin = (t.cuda() for t in rope_cos_sin(T, dr))
    q = torch.randn(B, T, H, dn + dr, device="cuda", dtype=dtype)
    ref = mla_rope_q_reference(q, cos, sin, dn)
    out = mla_rope_q_(q.clone(), cos, sin, dn)
    torch.testing.assert_close(out, ref, atol=TOL[dtype], rtol=TOL[dtype])
    kv = torch.randn(B, T, H, dn + dv, device="cuda", dtype=dtype)
    pe = torch.randn(B, T, dr, device="cuda", dtype=dtype)
    for got, want in zip(mla_rope_kv(kv, pe, cos, sin, dn), mla_rope_kv_reference(kv, pe, cos, sin, dn)):
        torch.testing.assert_close(got, want, atol=TOL[dtype], rtol=TOL[dtype])
    cu = torch.tensor([0, 1000, 5000, B * T], dtype=torch.int32, device="cuda")
    qt = q.view(B * T, H, dn + dr)
    torch.testing.assert_close(mla_rope_q_(qt.clone(), cos, sin, dn, cu_seqlens=cu),
                               mla_rope_q_reference(qt, cos, sin, dn, cu_seqlens=cu), atol=TOL[dtype], rtol=TOL[dtype])  # fmt: skip
    qg, kg = torch.randn(B, T, 32, 128, device="cuda", dtype=dtype), torch.randn(B, T, 8, 128, device="cuda", dtype=dtype)
    c2, s2 = (t.cuda() for t in rope_cos_sin(T, 128))
    for got, want in zip(rope_qk_(qg.clone(), kg.clone(), c2, s2), rope_qk_reference(qg, kg, c2, s2)):
        torch.testing.assert_close(got, want, atol=TOL[dtype], rtol=TOL[dtype])
