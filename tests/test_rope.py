"""RoPE kernels against the torch reference: MLA Q side, MLA KV side, generic GQA; forward and backward;
bthd, packed thd (cu_seqlens, or a validated PackedContext) and explicit positions. CPU runs the kernels
under TRITON_INTERPRET=1."""

from __future__ import annotations


import pytest
import torch

from megacpp_lab.kernels.rope import (
    mla_rope_kv,
    mla_rope_kv_reference,
    mla_rope_q_,
    mla_rope_q_op,
    mla_rope_q_reference,
    rope_qk_,
    rope_qk_reference,
)
from megacpp_lab.nn.rope_freqs import RopeScaling, rope_cos_sin
from megacpp_lab.varlen import build_context
from megacpp_lab.testing import no_host_reads

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
    with pytest.raises(ValueError, match=r"d_rope / 2 must be a power of two"):  # was a Triton error deep in the launch
        mla_rope_q_(torch.randn(1, 8, 2, 16, device=DEV), *rope_cos_sin(8, 12, device=DEV), 4)
    with pytest.raises(ValueError, match=r"head dim D / 2 must be a power of two"):
        rope_qk_(torch.randn(1, 8, 2, 12, device=DEV), torch.randn(1, 8, 1, 12, device=DEV), *rope_cos_sin(8, 12, device=DEV))
    with pytest.raises(ValueError, match="k_pe must be"):
        mla_rope_kv(torch.randn(1, 8, 2, 8, device=DEV), torch.randn(1, 7, 8, device=DEV), cos, sin, 4)
    # positions one a token in the input's order: a [T, B] transpose has as many and was once taken, every token
    # rotated by another's position
    q2 = torch.randn(2, 4, 2, 12, device=DEV)
    rows = torch.tensor([[0, 1, 2, 3], [0, 1, 0, 1]], device=DEV)
    assert torch.equal(mla_rope_q_(q2.clone(), cos, sin, 4, positions=rows),
                       mla_rope_q_(q2.clone(), cos, sin, 4, positions=rows.reshape(-1)))  # [B, T] and [N] agree
    with pytest.raises(ValueError, match=r"positions must be \[8\] or \[2, 4\] .*got \(4, 2\)"):
        mla_rope_q_(q2.clone(), cos, sin, 4, positions=rows.T.contiguous())
    with pytest.raises(ValueError, match=r"positions must be \[8\] \(one entry a token.*got \(2, 4\)"):
        mla_rope_q_(q2.view(8, 2, 12).clone(), cos, sin, 4, positions=rows)  # a packed input takes [N]
    if DEV == "cpu":  # value checks run on the host for CPU tensors (device asserts on the GPU)
        with pytest.raises(ValueError, match=r"positions\[3\] = 9"):
            mla_rope_q_(q.clone(), cos, sin, 4, positions=torch.tensor([0, 1, 2, 9, 0, 1, 2, 3]))
        with pytest.raises(ValueError, match="cu_seqlens do not cover the 8 tokens: they end at 7"):
            mla_rope_q_(q.view(8, 2, 12).clone(), cos, sin, 4, cu_seqlens=torch.tensor([0, 5, 7], dtype=torch.int32))


# ----------------------------------------------------------------------------- a validated PackedContext


def _packed(B: int = 2, T: int = 12):
    """A context over B rows of packed documents (one crosses no row: rows always start a document)."""
    doc_ids = torch.tensor([[0] * 5 + [1] * 4 + [2] * (T - 9), [0] * 3 + [1] * (T - 3)][:B], device=DEV)
    return build_context(doc_ids)


@pytest.mark.parametrize("layout", ["bthd", "thd"])
def test_context_path_equals_the_checked_cu_seqlens_path_and_the_reference(layout: str) -> None:
    B, T, H, dn, dr, dv, rank = 2, 12, 3, 8, 8, 4, 16
    ctx = _packed(B, T)
    cos, sin = (t.to(DEV) for t in rope_cos_sin(T, dr))
    shape = (lambda *rest: (B, T, *rest)) if layout == "bthd" else (lambda *rest: (B * T, *rest))
    x, gq = torch.randn(shape(H, dn + dr), device=DEV), torch.randn(shape(H, dn + dr), device=DEV)
    outs = {}
    for name, kw in (("ctx", {"ctx": ctx}), ("cu_seqlens", {"cu_seqlens": ctx.cu_seqlens})):
        leaf = x.clone().requires_grad_()
        y = mla_rope_q_(leaf * 1.0, cos, sin, dn, **kw)
        y.backward(gq)
        outs[name] = (y.detach(), leaf.grad)
    xr = x.clone().requires_grad_()
    ref = mla_rope_q_reference(xr, cos, sin, dn, positions=ctx.positions)
    ref.backward(gq)
    for got in outs.values():
        torch.testing.assert_close(got[0], ref, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(got[1], xr.grad, atol=1e-5, rtol=1e-5)
    kv, lat = torch.randn(shape(H, dn + dv), device=DEV), torch.randn(shape(rank + dr), device=DEV)
    gk, gv = torch.randn(shape(H, dn + dr), device=DEV), torch.randn(shape(H, dv), device=DEV)
    grads = []
    for fn, kw in ((mla_rope_kv_reference, {"positions": ctx.positions}), (mla_rope_kv, {"ctx": ctx})):
        a, b = kv.clone().requires_grad_(), lat.clone().requires_grad_()
        key, value = fn(a, b[..., rank:], cos, sin, dn, **kw)
        ((key * gk).sum() + (value * gv).sum()).backward()
        grads.append((key.detach(), value.detach(), a.grad, b.grad))
    for got, want in zip(grads[1], grads[0]):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    cos_g, sin_g = (t.to(DEV) for t in rope_cos_sin(T, 16))
    q, k = torch.randn(shape(4, 16), device=DEV), torch.randn(shape(2, 16), device=DEV)
    rq, rk = rope_qk_reference(q, k, cos_g, sin_g, positions=ctx.positions)
    oq, ok = rope_qk_(q.clone(), k.clone(), cos_g, sin_g, ctx=ctx)
    torch.testing.assert_close(oq, rq, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ok, rk, atol=1e-5, rtol=1e-5)


def test_context_path_reads_nothing_back_and_the_detector_can_fail() -> None:
    ctx = _packed()
    cos, sin = (t.to(DEV) for t in rope_cos_sin(12, 8))
    q = torch.randn(2, 12, 3, 16, device=DEV, requires_grad=True)
    kv = torch.randn(2, 12, 3, 12, device=DEV, requires_grad=True)
    pe = torch.randn(2, 12, 8, device=DEV, requires_grad=True)
    qg, kg = torch.randn(2, 12, 4, 8, device=DEV, requires_grad=True), torch.randn(2, 12, 2, 8, device=DEV, requires_grad=True)
    with no_host_reads():  # forward and backward of all three public calls
        y = mla_rope_q_(q * 1.0, cos, sin, 8, ctx=ctx)
        key, value = mla_rope_kv(kv, pe, cos, sin, 8, ctx=ctx)
        a, b = rope_qk_(qg * 1.0, kg * 1.0, cos, sin, ctx=ctx)
        (y.sum() + key.sum() + value.sum() + a.sum() + b.sum()).backward()
    # the same calls given bare cu_seqlens check their values on every call: on CPU by reading them back (the
    # detector sees it); on a GPU by device-side asserts, so there the detector is shown firing on a plain read
    if DEV == "cuda":
        with pytest.raises(AssertionError, match="host read on the validated path"), no_host_reads():
            ctx.cu_seqlens.tolist()
    for call in () if DEV == "cuda" else (lambda: mla_rope_q_(q.detach().clone(), cos, sin, 8, cu_seqlens=ctx.cu_seqlens),
                 lambda: mla_rope_kv(kv.detach(), pe.detach(), cos, sin, 8, cu_seqlens=ctx.cu_seqlens),
                 lambda: rope_qk_(qg.detach().clone(), kg.detach().clone(), cos, sin, positions=ctx.positions)):  # fmt: skip
        with pytest.raises(AssertionError, match="host read on the validated path"), no_host_reads():
            call()
    # a backward reuses what its forward checked: checked once, outside, then no read in the backward
    y = mla_rope_q_(q * 1.0, cos, sin, 8, cu_seqlens=ctx.cu_seqlens)
    with no_host_reads():
        y.sum().backward()


def test_context_path_fails_closed_on_what_it_still_checks() -> None:
    ctx = _packed()
    cos, sin = (t.to(DEV) for t in rope_cos_sin(12, 8))
    q = torch.randn(2, 12, 3, 16, device=DEV)
    with pytest.raises(ValueError, match="not both"):
        mla_rope_q_(q.clone(), cos, sin, 8, ctx=ctx, cu_seqlens=ctx.cu_seqlens)
    with pytest.raises(ValueError, match="not both"):
        mla_rope_kv(torch.randn(2, 12, 3, 12, device=DEV), torch.randn(2, 12, 8, device=DEV), cos, sin, 8, ctx=ctx,
                    positions=ctx.positions)  # fmt: skip
    with pytest.raises(ValueError, match="does not hold the context's tokens"):
        mla_rope_q_(torch.randn(2, 11, 3, 16, device=DEV), cos, sin, 8, ctx=ctx)
    with pytest.raises(ValueError, match="does not hold the context's tokens"):
        mla_rope_q_(torch.randn(23, 3, 16, device=DEV), cos, sin, 8, ctx=ctx)
    with pytest.raises(ValueError, match="ctx must be a PackedContext"):
        mla_rope_q_(q.clone(), cos, sin, 8, ctx=ctx.cu_seqlens)
    # rows longer than the table: the context's host max_seqlen decides, nothing read from the device
    short_cos, short_sin = (t.to(DEV) for t in rope_cos_sin(8, 8))
    with pytest.raises(ValueError, match="a document of 9 tokens is longer than the cos/sin table"), no_host_reads():
        mla_rope_q_(q.clone(), short_cos, short_sin, 8, ctx=ctx)  # documents of 5, 4, 3 | 3, 9 tokens
    fits = build_context(torch.tensor([[0] * 6 + [1] * 6, [0] * 4 + [1] * 8], device=DEV))
    with no_host_reads():
        out = mla_rope_q_(q.clone(), short_cos, short_sin, 8, ctx=fits)
    torch.testing.assert_close(out, mla_rope_q_reference(q, short_cos, short_sin, 8, positions=fits.positions))


def test_ops_skip_value_checks_only_when_told_validated() -> None:
    """The op is what the benchmark times as the kernel alone (validated=True); by default it checks."""
    cos, sin = (t.to(DEV) for t in rope_cos_sin(16, 8))
    x = torch.randn(8, 2, 12, device=DEV)
    bad = torch.tensor([0, 5, 7], dtype=torch.int32, device=DEV)  # ends short of the 8 tokens
    if DEV == "cpu":
        with pytest.raises(ValueError, match="cu_seqlens do not cover the 8 tokens: they end at 7"):
            mla_rope_q_op(x.clone(), cos, sin, None, bad, 4, False)
    good = torch.tensor([0, 5, 8], dtype=torch.int32, device=DEV)
    y = x.clone()
    with no_host_reads():
        mla_rope_q_op(y, cos, sin, None, good, 4, False, validated=True)
    torch.testing.assert_close(y, mla_rope_q_reference(x, cos, sin, 4, cu_seqlens=good))
    with pytest.raises(ValueError, match="cu_seqlens must be a 1-D int32 tensor"):  # structure is checked even when validated
        mla_rope_q_op(x.clone(), cos, sin, None, good.long(), 4, False, validated=True)


def test_strided_cu_seqlens_and_positions_are_read_by_value() -> None:
    """The kernel indexes them by pointer: a strided view must reach it as its values, not its storage."""
    cos, sin = (t.to(DEV) for t in rope_cos_sin(16, 8))
    x = torch.randn(12, 2, 12, device=DEV)
    cu = torch.tensor([0, 99, 5, 99, 12, 99], dtype=torch.int32, device=DEV)[::2]
    torch.testing.assert_close(mla_rope_q_(x.clone(), cos, sin, 4, cu_seqlens=cu),
                               mla_rope_q_reference(x, cos, sin, 4, cu_seqlens=cu.contiguous()))  # fmt: skip
    pos = torch.arange(24, device=DEV).view(12, 2)[:, 0] % 7
    torch.testing.assert_close(mla_rope_q_(x.clone(), cos, sin, 4, positions=pos),
                               mla_rope_q_reference(x, cos, sin, 4, positions=pos))  # fmt: skip


def test_tripwire_backward_leaves_a_shared_incoming_gradient_alone() -> None:
    """The backward used to rotate the incoming gradient in place. Autograd hands the same gradient tensor to
    every branch of a sum, so a residual beside the rope (y = b + rope(q)) got a rotated gradient, and
    rope_qk_ rotated q's and k's shared gradient twice: wrong gradients, no error."""
    cos, sin = (t.to(DEV) for t in rope_cos_sin(16, 8))
    x, g = torch.randn(1, 8, 2, 16, device=DEV), torch.randn(1, 8, 2, 16, device=DEV)
    grads = []
    for fn in (mla_rope_q_reference, mla_rope_q_):
        a, b = x.clone().requires_grad_(), x.clone().requires_grad_()
        y = b * 2.0 + fn(a * 1.0, cos, sin, 8)  # b's branch runs its backward after the rope's
        y.backward(g)
        grads.append((a.grad, b.grad))
    for got, want in zip(grads[1], grads[0]):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    cos_g, sin_g = (t.to(DEV) for t in rope_cos_sin(16, 16))
    grads = []
    for fn in (rope_qk_reference, rope_qk_):
        a, k = x.clone().requires_grad_(), x.clone().requires_grad_()
        q2, k2 = fn(a * 1.0, k * 1.0, cos_g, sin_g)
        (q2 + k2).backward(g)  # one gradient tensor for both
        grads.append((a.grad, k.grad))
    for got, want in zip(grads[1], grads[0]):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.cuda
def test_cuda_context_path_never_syncs() -> None:
    ctx = build_context(torch.tensor([[0] * 1000 + [1] * 3096] * 2, device="cuda"))
    cos, sin = (t.cuda() for t in rope_cos_sin(4096, 64))
    q = torch.randn(2, 4096, 16, 192, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    kv = torch.randn(2, 4096, 16, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    pe = torch.randn(2, 4096, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    mla_rope_q_(q.detach().clone(), cos, sin, 128, ctx=ctx)  # autotune outside the sync check
    mla_rope_kv(kv, pe, cos, sin, 128, ctx=ctx)[0].sum().backward()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        y = mla_rope_q_(q * 1.0, cos, sin, 128, ctx=ctx)
        key, value = mla_rope_kv(kv, pe, cos, sin, 128, ctx=ctx)
        (y.float().sum() + key.float().sum() + value.float().sum()).backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    ref = mla_rope_q_reference(q.detach(), cos, sin, 128, positions=ctx.positions)
    torch.testing.assert_close(y.detach(), ref, atol=2e-2, rtol=2e-2)


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


def test_count_search_width_buckets() -> None:
    from megacpp_lab.kernels.rope import COUNT_SEARCH_MAX_DOCS, COUNT_SEARCH_WIDTHS, count_search_width

    assert [count_search_width(n) for n in (1, 2, 16, 17, 128, 129, 512, 513, COUNT_SEARCH_MAX_DOCS)] == \
        [16, 16, 16, 128, 128, 512, 512, 512, 512]  # fmt: skip
    assert {count_search_width(n) for n in range(1, COUNT_SEARCH_MAX_DOCS + 1)} == set(COUNT_SEARCH_WIDTHS)


@pytest.mark.parametrize("n_docs", [1, 16, 17, 40])
def test_thd_positions_at_width_bucket_edges(n_docs: int) -> None:
    # a width larger than the document count: the masked lanes must not count as starts
    N, H, dn, dr = 48, 2, 4, 8
    cos, sin = (t.to(DEV) for t in rope_cos_sin(64, dr))
    bounds = torch.linspace(0, N, n_docs + 1).round().to(torch.int32)
    cu = torch.unique(bounds).to(DEV) if n_docs <= N else bounds.to(DEV)
    x = torch.randn(N, H, dn + dr, device=DEV)
    want = mla_rope_q_reference(x, cos, sin, dn, cu_seqlens=cu)
    torch.testing.assert_close(mla_rope_q_(x.clone(), cos, sin, dn, cu_seqlens=cu), want, atol=1e-5, rtol=1e-5)


def _compiled_binaries(kernels) -> int:
    device = torch.cuda.current_device()
    return sum(len(k.fn.device_caches[device][0]) for k in kernels)


@pytest.mark.cuda
def test_cuda_new_document_counts_compile_nothing() -> None:
    # tripwire: each batch's document count used to be an int Triton specialises on (== 1, % 16) and a
    # constexpr width per power of two, so a training run recompiled the RoPE kernels on most new batches
    from megacpp_lab.kernels.rope import mla_rope_kv_bwd_kernel, mla_rope_kv_fwd_kernel, mla_rope_q_kernel

    kernels = (mla_rope_q_kernel, mla_rope_kv_fwd_kernel, mla_rope_kv_bwd_kernel)
    T, H, dn, dr, dv = 4096, 4, 128, 64, 128
    cos, sin = (t.cuda() for t in rope_cos_sin(T, dr))

    def step(n_docs: int) -> None:
        cu = torch.linspace(0, T, n_docs + 1, device="cuda").round().to(torch.int32)
        q = torch.randn(T, H, dn + dr, device="cuda", dtype=torch.bfloat16)
        kv = torch.randn(T, H, dn + dv, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        pe = torch.randn(T, dr, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        mla_rope_q_(q, cos, sin, dn, cu_seqlens=cu)
        key, value = mla_rope_kv(kv, pe, cos, sin, dn, cu_seqlens=cu)
        (key.float().sum() + value.float().sum()).backward()

    for n_docs in (8, 100, 300):  # one per width bucket (autotuning compiles every config once)
        step(n_docs)
    before = _compiled_binaries(kernels)
    for n_docs in (1, 2, 7, 16, 17, 28, 48, 60, 64, 127, 128, 129, 500, 512):
        step(n_docs)
    torch.cuda.synchronize()
    assert _compiled_binaries(kernels) == before
