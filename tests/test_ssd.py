"""SSD scan: step loop = plain-torch chunked = Triton (TRITON_INTERPRET=1 on CPU), document resets, compile boundary."""

import pytest
import torch
from torch._dynamo.utils import counters

import megacpp_lab.kernels.ssd as ssd_mod
from megacpp_lab.kernels.ssd import ssd_chunked_torch, ssd_scan, ssd_scan_reference
from megacpp_lab.varlen import documents_longest_first

ON_GPU = torch.cuda.is_available()
# Triton runs on the GPU where there is one, else under TRITON_INTERPRET=1 (tests/conftest.py)
DEVICE = "cuda" if ON_GPU else "cpu"
GRADS = ("x", "dt", "A", "Bm", "Cm")


def _inputs(B, T, H, P, N, G, *, dtype=torch.float32, device=DEVICE, seed=0, grad=True):
    g = torch.Generator(device="cpu").manual_seed(seed)
    rnd = lambda *shape, scale=1.0: torch.randn(*shape, generator=g) * scale
    x = rnd(B, T, H, P)
    dt = torch.nn.functional.softplus(rnd(B, T, H) - 1.0)  # > 0, as the layer gives it
    A = -(torch.rand(H, generator=g) * 2 + 0.5)  # < 0
    Bm, Cm = rnd(B, T, G, N, scale=N**-0.5), rnd(B, T, G, N, scale=N**-0.5)
    out = [x.to(device, dtype), dt.to(device, dtype), A.to(device), Bm.to(device, dtype), Cm.to(device, dtype)]
    return [t.requires_grad_() for t in out] if grad else out


def _cu(*bounds, device=DEVICE):
    return torch.tensor(bounds, dtype=torch.int32, device=device)


def _fwd_bwd(fn, inputs, dy):
    """y and every gradient, on fresh leaves (fp32 copies of the inputs)."""
    leaves = [t.detach().clone().requires_grad_() for t in inputs]
    y = fn(*leaves)
    return y, torch.autograd.grad(y, leaves, dy.to(y.dtype))


def _assert_close(got, want, *, fwd_tol, grad_rtol):
    (y, grads), (yr, grads_ref) = got, want
    err = (y.float() - yr.float()).abs().max().item()
    assert err <= fwd_tol, f"y: max abs error {err:.2e}"
    for name, a, b in zip(GRADS, grads, grads_ref):
        rel = ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12)).item()
        assert rel <= grad_rtol, f"d{name}: relative error {rel:.2e}"


# packed rows: boundaries off the chunk grid (chunk 16), a one-token document, a long one spanning chunks
PACKED = dict(B=1, T=53, cu=(0, 5, 6, 40, 53))
ROWS = dict(B=2, T=37, cu=(0, 11, 12, 37, 38, 74))  # [B,T] rows: every row start is a document start


@pytest.mark.parametrize("layout", [PACKED, ROWS], ids=["packed_B1", "rows_B2"])
@pytest.mark.parametrize("G", [1, 4], ids=["G1", "G=H"])
def test_chunked_matches_step_loop_forward_and_every_gradient(layout, G):
    inputs = _inputs(layout["B"], layout["T"], 4, 16, 16, G, device="cpu")
    cu = _cu(*layout["cu"], device="cpu")
    dy = torch.randn(layout["B"], layout["T"], 4, 16)
    want = _fwd_bwd(lambda *a: ssd_scan_reference(*a, cu), inputs, dy)
    got = _fwd_bwd(lambda *a: ssd_chunked_torch(*a, cu, chunk=16), inputs, dy)
    _assert_close(got, want, fwd_tol=1e-5, grad_rtol=1e-5)


def test_chunked_gradcheck_fp64():
    inputs = [t.detach().double().requires_grad_() for t in _inputs(1, 9, 2, 3, 2, 1, device="cpu")]
    cu = _cu(0, 4, 5, 9, device="cpu")
    assert torch.autograd.gradcheck(lambda *a: ssd_chunked_torch(*a, cu, chunk=4), inputs)


def test_reference_resets_at_every_document_start():
    """Each document of a packed row gives what it gives alone (the oracle's own contract)."""
    x, dt, A, Bm, Cm = _inputs(1, 20, 2, 4, 3, 1, device="cpu", grad=False)
    y = ssd_scan_reference(x, dt, A, Bm, Cm, _cu(0, 8, 20, device="cpu"))
    alone = ssd_scan_reference(x[:, 8:], dt[:, 8:], A, Bm[:, 8:], Cm[:, 8:])
    assert torch.equal(y[:, 8:], alone)
    joined = ssd_scan_reference(x, dt, A, Bm, Cm)
    assert not torch.allclose(joined[:, 8:], alone)  # without the reset, state does flow across


# ------------------------------------------------------------------ Triton


@pytest.mark.parametrize("layout", [PACKED, ROWS], ids=["packed_B1", "rows_B2"])
@pytest.mark.parametrize("G", [1, 2, 4], ids=["G1", "G2", "G=H"])
def test_triton_matches_chunked_and_step_loop(layout, G, monkeypatch):
    """Forward and every gradient; P=N=32 with 16-wide blocks exercises the state passes' [P, N] split and
    the output pass's P split; G=H takes the backward's direct (no per-head buffer) dB/dC path."""
    for name in ("STATE_BLOCK_P", "STATE_BLOCK_N", "OUT_BLOCK_P", "BWD_BLOCK_N"):
        monkeypatch.setattr(ssd_mod, name, 16)
    B, T = layout["B"], layout["T"]
    inputs = _inputs(B, T, 4, 32, 32, G)
    cu = _cu(*layout["cu"])
    dy = torch.randn(B, T, 4, 32, device=DEVICE)
    got = _fwd_bwd(lambda *a: ssd_scan(*a, cu_seqlens=cu, chunk=16, kernel="triton"), inputs, dy)
    _assert_close(got, _fwd_bwd(lambda *a: ssd_chunked_torch(*a, cu, chunk=16), inputs, dy), fwd_tol=1e-5, grad_rtol=1e-5)
    _assert_close(got, _fwd_bwd(lambda *a: ssd_scan_reference(*a, cu), inputs, dy), fwd_tol=1e-5, grad_rtol=1e-5)


def test_the_state_passes_take_any_document_order(monkeypatch):
    """The sequential state passes start their documents in the order the op is given (the longest first, from the
    context); the order only schedules: y and every gradient are the same under any permutation of it, here the
    reverse of the longest-first order and the identity, at PACKED's out-of-order lengths (5, 1, 34, 13)."""
    inputs = _inputs(1, 53, 4, 32, 32, 4)
    cu = _cu(*PACKED["cu"])
    dy = torch.randn(1, 53, 4, 32, device=DEVICE)
    longest = documents_longest_first(cu)
    assert longest.tolist() == [2, 3, 0, 1, 4]  # by length, then the end mark
    results = []
    for order in (longest, torch.cat([longest[:-1].flip(0), longest[-1:]]), torch.arange(5, dtype=torch.int32)):
        monkeypatch.setattr(ssd_mod, "documents_longest_first", lambda _cu, order=order: order.to(DEVICE))
        results.append(_fwd_bwd(lambda *a: ssd_scan(*a, cu_seqlens=cu, chunk=16, kernel="triton"), inputs, dy))
    for other in results[1:]:
        _assert_close(other, results[0], fwd_tol=0.0, grad_rtol=0.0)


def test_the_state_passes_read_the_order_and_the_context_gives_it(monkeypatch):
    """The control for the test above: the passes do take their documents from the order. With buffers born NaN, an
    order that runs document 2 (34 tokens, three chunks) four times and the others never leaves the others' later
    chunks reading states no pass wrote (document 3's second chunk), while the longest-first order writes every state
    before it is read. And the order comes from the context (its longest_first, found once a batch) where one is
    given, else from the bare boundaries."""
    from megacpp_lab.varlen import build_context, doc_ids_from_cu_seqlens

    inputs = [t.detach() for t in _inputs(1, 53, 4, 32, 32, 4, grad=False)]
    cu = _cu(*PACKED["cu"])
    empty = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *a, **k: empty(*a, **k).fill_(float("nan"))
                        if k.get("dtype", torch.get_default_dtype()).is_floating_point else empty(*a, **k))  # fmt: skip
    run = lambda: ssd_scan(*inputs, cu_seqlens=cu, chunk=16, kernel="triton")  # noqa: E731
    assert not run().isnan().any()
    monkeypatch.setattr(ssd_mod, "documents_longest_first", lambda _cu: _cu.new_tensor([2, 2, 2, 2, 4]))
    assert run()[0, 48:].isnan().any()  # document 3 (tokens 40-52): its second chunk's entering state never written
    monkeypatch.setattr(torch, "empty", empty)
    seen = []
    real = ssd_mod.ssd_scan_fwd
    monkeypatch.setattr(ssd_mod, "ssd_scan_fwd", lambda *a: seen.append(a[6]) or real(*a))
    ctx = build_context(doc_ids_from_cu_seqlens(cu.cpu(), 1, 53), cu_seqlens=cu.cpu()).to(DEVICE)
    ssd_scan(*inputs, ctx=ctx, chunk=16, kernel="triton")
    assert seen[-1] is ctx.longest_first


@pytest.mark.parametrize("G", [1, 4], ids=["G1", "G=H"])
def test_input_weight_apart_from_the_decay_on_every_path(G, monkeypatch):
    """x_weight replaces dt as the input's scale and dt keeps only the decay (Mamba-3's trapezoid weight, and its
    MIMO sub-tokens whose dt is 0 but whose weight is not): the step loop against the same scan with the weight
    folded into x (x * w / dt, the old way), and the chunked and Triton paths against the step loop, forward and
    every gradient, the weight's included. Some dt are exactly 0 here, as MIMO's sub-tokens give them."""
    for name in ("STATE_BLOCK_P", "STATE_BLOCK_N", "OUT_BLOCK_P", "BWD_BLOCK_N"):
        monkeypatch.setattr(ssd_mod, name, 16)
    B, T, H = 1, 53, 4
    x, dt, A, Bm, Cm = _inputs(B, T, H, 32, 32, G, grad=False)
    w = torch.rand(B, T, H, generator=torch.Generator().manual_seed(3)).to(DEVICE) + 0.1
    dt_zero = dt.clone()
    dt_zero[:, 1::3] = 0.0  # decay 1 at every third token, as a MIMO rank sub-token
    cu = _cu(*PACKED["cu"])
    dy = torch.randn(B, T, H, 32, generator=torch.Generator().manual_seed(4)).to(DEVICE)
    folded = ssd_scan_reference(x * (w / dt)[..., None], dt, A, Bm, Cm, cu)
    assert torch.allclose(ssd_scan_reference(x, dt, A, Bm, Cm, cu, x_weight=w), folded, atol=1e-5, rtol=1e-5)
    inputs = [t.requires_grad_() for t in (x, dt_zero, A, Bm, Cm, w)]

    def run(kernel):
        return _fwd_bwd(lambda x, dt, A, Bm, Cm, w: ssd_scan(x, dt, A, Bm, Cm, cu_seqlens=cu, chunk=16, kernel=kernel,
                                                               x_weight=w), inputs, dy)  # fmt: skip

    want = run("reference")
    assert want[1][5].abs().sum() > 0 and want[1][1].abs().sum() > 0  # the weight and dt both get gradients
    for kernel in ("chunked", "triton"):
        (y, grads), (yr, grads_ref) = run(kernel), want
        assert (y - yr).abs().max().item() <= 1e-5, kernel
        for name, a, b in zip((*GRADS, "x_weight"), grads, grads_ref):
            rel = ((a - b).norm() / b.norm().clamp_min(1e-12)).item()
            assert rel <= 1e-5, f"{kernel} d{name}: relative error {rel:.2e}"


def test_triton_rows_without_cu_seqlens_are_one_document_each():
    inputs = _inputs(2, 21, 2, 16, 16, 1)
    dy = torch.randn(2, 21, 2, 16, generator=torch.Generator().manual_seed(5)).to(DEVICE)  # seeded: a tolerance of 1e-5 is not for any draw
    got = _fwd_bwd(lambda *a: ssd_scan(*a, chunk=16, kernel="triton"), inputs, dy)
    want = _fwd_bwd(lambda *a: ssd_scan_reference(*a, _cu(0, 21, 42)), inputs, dy)
    _assert_close(got, want, fwd_tol=1e-5, grad_rtol=1e-5)


def test_triton_matches_the_step_loop_when_some_decay_grows():
    """A > 0 on one head (exp(dt*A) > 1): the chunk's last cumulative log-decay is not its minimum.
    The kernel once took the minimum, which is right only when every dt*A <= 0: 0.33 off, no error."""
    x, dt, A, Bm, Cm = _inputs(1, 40, 2, 16, 16, 1, grad=False)
    A = torch.tensor([0.05, -0.5], device=DEVICE)
    inputs = [t.requires_grad_() for t in (x, dt, A, Bm, Cm)]
    cu = _cu(0, 13, 40)
    dy = torch.randn(1, 40, 2, 16, device=DEVICE)
    got = _fwd_bwd(lambda *a: ssd_scan(*a, cu_seqlens=cu, chunk=16, kernel="triton"), inputs, dy)
    _assert_close(got, _fwd_bwd(lambda *a: ssd_scan_reference(*a, cu), inputs, dy), fwd_tol=1e-5, grad_rtol=1e-5)


def test_triton_bf16_inputs_keep_an_fp32_state():
    inputs = _inputs(1, 40, 2, 16, 16, 1, dtype=torch.bfloat16)
    cu = _cu(0, 17, 40)
    # seeded: the global RNG's state depends on which tests ran before in this process (pytest-xdist)
    dy = torch.randn(1, 40, 2, 16, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    y, grads = _fwd_bwd(lambda *a: ssd_scan(*a, cu_seqlens=cu, chunk=16, kernel="triton"), inputs, dy)
    assert y.dtype == torch.bfloat16 and all(g.dtype == t.dtype for g, t in zip(grads, inputs))
    want = _fwd_bwd(lambda *a: ssd_chunked_torch(*a, cu, chunk=16), [t.float() for t in inputs], dy)
    _assert_close((y, grads), want, fwd_tol=3e-2, grad_rtol=2e-2)


def _perturb_doc(inputs, lo, hi):
    """Inputs with every per-token tensor changed on flattened tokens [lo, hi) only."""
    out = []
    for i, t in enumerate(inputs):
        t = t.detach().clone()
        if i != 2:  # A is per head, not per token
            flat = t.view(-1, *t.shape[2:])
            flat[lo:hi] = flat[lo:hi] * 3 + (0.5 if i != 1 else 0.0)
        out.append(t)
    return out


@pytest.mark.parametrize("kernel", ["triton", "chunked"])
def test_tripwire_no_state_runs_into_the_next_document(kernel):
    """Perturb document j: every output of every other document is bitwise unchanged, and the
    gradient of the other documents' outputs w.r.t. document j's inputs is exactly zero."""
    B, T = ROWS["B"], ROWS["T"]
    cu = ROWS["cu"]
    inputs = _inputs(B, T, 2, 16, 16, 1, grad=False)
    run = lambda a, c=cu: ssd_scan(*a, cu_seqlens=_cu(*c), chunk=16, kernel=kernel).reshape(B * T, -1)
    y = run(inputs)
    for j in range(len(cu) - 1):
        lo, hi = cu[j], cu[j + 1]
        y2 = run(_perturb_doc(inputs, lo, hi))
        others = torch.ones(B * T, dtype=torch.bool)
        others[lo:hi] = False
        assert torch.equal(y[others.to(y.device)], y2[others.to(y.device)]), f"document {j} leaked"
        assert not torch.equal(y[lo:hi], y2[lo:hi])  # the perturbation did reach document j itself
    # the check can fail: merge documents 0 and 1 (drop boundary 11) and document 0 reaches document 1
    merged = (0, 12, 37, 38, 74)
    assert not torch.equal(run(inputs, merged)[11:12], run(_perturb_doc(inputs, 0, 11), merged)[11:12])
    # gradients: the outputs of documents other than 2 never depend on document 2's inputs
    leaves = [t.clone().requires_grad_() for t in inputs]
    out = run(leaves)
    mask = torch.ones(B * T, 1, device=out.device)
    mask[cu[2] : cu[3]] = 0
    grads = torch.autograd.grad((out * mask).sum(), leaves, allow_unused=True)
    for name, gr in zip(GRADS, grads):
        if name != "A":
            assert torch.count_nonzero(gr.reshape(B * T, -1)[cu[2] : cu[3]]) == 0, f"d{name} leaks into document 2"


def test_compiled_custom_op_has_no_graph_break():
    """fullgraph compile of a function calling the op, forward and backward: 0 graph breaks."""
    torch._dynamo.reset()
    counters.clear()
    cu = _cu(*PACKED["cu"])
    inputs = _inputs(1, PACKED["T"], 2, 16, 16, 1)

    def block(x, dt, A, Bm, Cm):
        return ssd_scan(x, dt, A, Bm, Cm, cu_seqlens=cu, chunk=16, kernel="triton") * 2

    dy = torch.randn(1, PACKED["T"], 2, 16, device=DEVICE)
    got = _fwd_bwd(torch.compile(block, fullgraph=True, backend="aot_eager"), inputs, dy)
    assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])
    assert counters["stats"]["unique_graphs"] >= 1  # dynamo really traced it
    _assert_close(got, _fwd_bwd(block, inputs, dy), fwd_tol=0.0, grad_rtol=0.0)


def test_chunked_path_is_loop_free_across_chunks():
    """No Python loop over chunks: the traced graph has the same size at 2 and at 8 chunks."""
    sizes = {}
    for T in (32, 128):
        x, dt, A, Bm, Cm = _inputs(1, T, 2, 4, 4, 1, device="cpu", grad=False)
        cu = _cu(0, 7, T, device="cpu")
        explained = torch._dynamo.explain(lambda *a: ssd_chunked_torch(*a, cu, chunk=16))(x, dt, A, Bm, Cm)
        assert explained.graph_break_count == 0
        sizes[T] = sum(len(list(g.graph.nodes)) for g in explained.graphs)
    assert sizes[32] == sizes[128]


def test_op_without_saved_states_refuses_backward():
    """save=False (a no-grad forward) keeps no states: differentiating that output fails loudly."""
    x, dt, A, Bm, Cm = _inputs(1, 16, 1, 16, 16, 1)
    y, states = ssd_mod.ssd_scan_fwd(x, dt, A, Bm, Cm, _cu(0, 16), documents_longest_first(_cu(0, 16)), 16, False)
    assert states.numel() == 0
    with pytest.raises(RuntimeError, match="save=False"):
        y.sum().backward()


# ------------------------------------------------------------------ bad inputs fail closed


def _bad(field, value):
    x, dt, A, Bm, Cm = _inputs(2, 8, 2, 16, 16, 1, grad=False)
    kw = dict(x=x, dt=dt, A=A, Bm=Bm, Cm=Cm, cu_seqlens=_cu(0, 3, 8, 16))
    kw[field] = value(kw[field] if field in kw else None)
    return kw


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("x", lambda t: t[..., 0], r"x must be \[B,T,H,P\]"),
        ("dt", lambda t: t[:, :4], r"dt must have shape \(2, 8, 2\)"),
        ("A", lambda t: t[:1], r"A must have shape \(2,\)"),
        ("Bm", lambda t: t.expand(2, 8, 3, 16), "group count G=3 must divide the head count H=2"),
        ("Cm", lambda t: t[..., :8], r"Cm must have shape \(2, 8, 1, 16\)"),
        ("x", lambda t: t.to(torch.int32), "x must be float32"),
        ("dt", lambda t: t.to(torch.int64), "dt must be float32"),
        ("cu_seqlens", lambda t: t.long(), "cu_seqlens must be a 1-D int32 tensor"),
        ("cu_seqlens", lambda t: t[:1], "cu_seqlens must hold >= 2 entries"),
        ("cu_seqlens", lambda t: t + 1, r"cu_seqlens must start at 0, got cu_seqlens\[0\]=1"),
        ("cu_seqlens", lambda t: _cu(0, 8, 5, 16), r"increase strictly: entries 1 and 2 are 8, 5 \(row 1, offset 0\)"),
        ("cu_seqlens", lambda t: _cu(0, 8, 15), r"do not cover the 16 tokens: they end at 15 \(row 1, offset 7 onward"),
        ("cu_seqlens", lambda t: _cu(0, 3, 16), r"every row start: row 1 \(offset 8\)"),
    ],
)
def test_bad_inputs_fail_closed_naming_the_argument(field, value, message):
    """Shapes, dtypes and cu_seqlens' structure fail on any device. cu_seqlens' values (varlen.check_cu_seqlens)
    fail by name on the host; on a GPU they are a device-side assert (no host sync), which would end the test
    process, so those cases run on CPU tensors: the check runs before any kernel is chosen."""
    kw = _bad(field, value)
    if field == "cu_seqlens" and ON_GPU and kw["cu_seqlens"].dtype == torch.int32 and kw["cu_seqlens"].numel() >= 2:
        kw = {k: v.cpu() for k, v in kw.items()}
    x, dt, A, Bm, Cm, cu = kw["x"], kw["dt"], kw["A"], kw["Bm"], kw["Cm"], kw["cu_seqlens"]
    for kernel in ("triton", "chunked", "reference"):
        with pytest.raises(ValueError, match=message):
            ssd_scan(x, dt, A, Bm, Cm, cu_seqlens=cu, kernel=kernel)


def test_a_context_that_is_none_and_an_empty_batch_fail_closed_on_every_path():
    """Both once failed deep inside torch (an AttributeError on ctx.shape; a reshape of 0 elements, a zero step)."""
    x, dt, A, Bm, Cm = _inputs(2, 16, 2, 16, 16, 1, grad=False)
    for kernel in ("triton", "chunked", "reference"):
        with pytest.raises(TypeError, match="ctx must be a PackedContext .*got str"):
            ssd_scan(x, dt, A, Bm, Cm, ctx="rows", kernel=kernel)
        with pytest.raises(ValueError, match=r"x must hold tokens, got \[B,T,H,P\] = \[2, 0, 2, 16\]"):
            ssd_scan(x[:, :0], dt[:, :0], A, Bm[:, :0], Cm[:, :0], kernel=kernel)


def test_kernel_constraints_fail_closed():
    x, dt, A, Bm, Cm = _inputs(1, 16, 1, 16, 16, 1, grad=False)
    with pytest.raises(ValueError, match="kernel must be one of"):
        ssd_scan(x, dt, A, Bm, Cm, kernel="xla")
    with pytest.raises(ValueError, match="chunk a power of two >= 16"):
        ssd_scan(x, dt, A, Bm, Cm, chunk=24, kernel="triton")
    with pytest.raises(ValueError, match=r"P \(x's head dim\) a power of two >= 16"):
        ssd_scan(x[..., :12], dt, A, Bm, Cm, kernel="triton")
    with pytest.raises(ValueError, match="float64 is for the torch paths"):
        ssd_scan(x.double(), dt, A, Bm, Cm, kernel="triton")


def test_triton_without_gpu_or_interpreter_fails_closed(monkeypatch):
    import megacpp_lab.kernels as kernels

    monkeypatch.setattr(kernels, "TRITON_INTERPRET", False)  # what kernels.launchable reads
    x, dt, A, Bm, Cm = _inputs(1, 16, 1, 16, 16, 1, device="cpu", grad=False)
    with pytest.raises(RuntimeError, match="kernel='triton' needs CUDA tensors"):
        ssd_scan(x, dt, A, Bm, Cm, kernel="triton")


# ------------------------------------------------------------------ GPU, real shapes


def _real_shape_inputs(dtype=torch.bfloat16):
    """B=8 rows of T=4096, flattened to one packed row, 8 documents per row (random lengths)."""
    B, T, H, P, N = 8, 4096, 16, 64, 128
    g = torch.Generator().manual_seed(1)
    bounds = [0]
    for b in range(B):
        cuts = torch.randperm(T - 1, generator=g)[:7].add(1).sort().values
        bounds += [b * T + int(c) for c in cuts] + [(b + 1) * T]
    inputs = _inputs(1, B * T, H, P, N, 1, dtype=dtype, device="cuda")
    return inputs, torch.tensor(bounds, dtype=torch.int32, device="cuda")


@pytest.mark.cuda
def test_triton_matches_chunked_on_gpu_at_real_shape_bf16():
    inputs, cu = _real_shape_inputs()
    dy = torch.randn(inputs[0].shape, device="cuda", dtype=torch.bfloat16)
    got = _fwd_bwd(lambda *a: ssd_scan(*a, cu_seqlens=cu, kernel="triton"), inputs, dy)
    want = _fwd_bwd(lambda *a: ssd_chunked_torch(*a, cu), [t.float() for t in inputs], dy.float())
    _assert_close(got, want, fwd_tol=5e-2, grad_rtol=2e-2)


@pytest.mark.cuda
def test_bf16_states_agree_with_fp32_states_on_gpu_at_real_shape(monkeypatch):
    """bf16 inputs store their chunk states in bf16 (states_dtype, STATES_IN_BF16); against fp32 states (the dots
    against them TF32) y and every gradient agree to within the inputs' own rounding, and both stay within the
    fp32 chunked path's tolerance."""
    from megacpp_lab.kernels import ssd as ssd_mod

    inputs, cu = _real_shape_inputs()
    x, dt, A, Bm, Cm = (t.detach() for t in inputs)
    _, states = ssd_mod.ssd_scan_fwd(x, dt.float(), A.float(), Bm, Cm, cu, documents_longest_first(cu), 64, True)
    assert states.dtype == torch.bfloat16 == ssd_mod.states_dtype(torch.bfloat16)
    assert ssd_mod.states_dtype(torch.float16) == torch.float32 == ssd_mod.states_dtype(torch.float32)
    dy = torch.randn(inputs[0].shape, device="cuda", dtype=torch.bfloat16)
    runs = {}
    for bf16 in (True, False):
        monkeypatch.setattr(ssd_mod, "STATES_IN_BF16", bf16)
        runs[bf16] = _fwd_bwd(lambda *a: ssd_scan(*a, cu_seqlens=cu, kernel="triton"), inputs, dy)
    _assert_close(runs[True], runs[False], fwd_tol=5e-2, grad_rtol=1e-2)
    want = _fwd_bwd(lambda *a: ssd_chunked_torch(*a, cu), [t.float() for t in inputs], dy.float())
    _assert_close(runs[True], want, fwd_tol=5e-2, grad_rtol=2e-2)


@pytest.mark.cuda
def test_triton_rows_equal_flattened_on_gpu_at_real_shape():
    """[B,T] rows and the same tokens flattened to B=1 give the same y, bitwise."""
    inputs, cu = _real_shape_inputs()
    flat = ssd_scan(*[t.detach() for t in inputs], cu_seqlens=cu, kernel="triton")
    rows = [t.detach().reshape(8, 4096, *t.shape[2:]) if t.dim() > 1 else t.detach() for t in inputs]
    assert torch.equal(ssd_scan(*rows, cu_seqlens=cu, kernel="triton").reshape(flat.shape), flat)


@pytest.mark.cuda
def test_triton_matches_step_loop_on_gpu_fp32():
    inputs = _inputs(2, 300, 4, 64, 128, 1, device="cuda")
    cu = _cu(0, 100, 101, 300, 450, 600)
    dy = torch.randn(2, 300, 4, 64, device="cuda")
    got = _fwd_bwd(lambda *a: ssd_scan(*a, cu_seqlens=cu, kernel="triton"), inputs, dy)
    _assert_close(got, _fwd_bwd(lambda *a: ssd_scan_reference(*a, cu), inputs, dy), fwd_tol=1e-3, grad_rtol=1e-4)


@pytest.mark.cuda
def test_fla_core_forward_agrees_with_the_oracle_where_installed():
    """fla-core's chunk_simple_gla as the optional peer: q=C, k=B, v=dt*x, g=dt*A, scale 1."""
    simple_gla = pytest.importorskip("fla.ops.simple_gla")
    inputs, cu = _real_shape_inputs()
    x, dt, A, Bm, Cm = (t.detach() for t in inputs)
    H = x.shape[2]
    o, _ = simple_gla.chunk_simple_gla(
        q=Cm.expand(-1, -1, H, -1), k=Bm.expand(-1, -1, H, -1), v=(x.float() * dt.float()[..., None]).to(x.dtype),
        g=dt.float() * A, scale=1.0, cu_seqlens=cu.long(),
    )  # fmt: skip
    want = ssd_chunked_torch(*(t.float() for t in (x, dt, A, Bm, Cm)), cu)
    assert (o.float() - want).abs().max().item() <= 5e-2


def test_a_context_s_cu_seqlens_take_no_host_read():
    """A PackedContext's cu_seqlens are validated once per batch: the scan given ctx= then reads nothing back to
    the host (forward and backward). Bare cu_seqlens are checked in the call: on a CPU by reading them back (a
    named error; the tripwire fires), on a GPU by a device assert (no read)."""
    from megacpp_lab.testing import no_host_reads
    from megacpp_lab.varlen import build_context, doc_ids_from_cu_seqlens

    inputs = _inputs(1, 53, 2, 16, 16, 1)
    cu = _cu(*PACKED["cu"])
    ctx = build_context(doc_ids_from_cu_seqlens(cu, 1, 53), cu_seqlens=cu)
    with no_host_reads():
        y = ssd_scan(*inputs, ctx=ctx, chunk=16, kernel="triton")
        torch.autograd.grad(y, inputs, torch.ones_like(y))
    torch.testing.assert_close(y, ssd_scan(*inputs, cu_seqlens=cu, chunk=16, kernel="triton"))
    if DEVICE == "cpu":
        with pytest.raises(AssertionError, match="host read"), no_host_reads():
            ssd_scan(*inputs, cu_seqlens=cu, chunk=16, kernel="triton")
    else:
        with no_host_reads():
            ssd_scan(*inputs, cu_seqlens=cu, chunk=16, kernel="triton")
    with pytest.raises(ValueError, match="give ctx or cu_seqlens, not both"):
        ssd_scan(*inputs, cu_seqlens=cu, ctx=ctx, kernel="triton")
    with pytest.raises(ValueError, match=r"ctx is for \[B,T\] = \(1, 53\)"):
        ssd_scan(*[t[:, :50] if t.dim() > 1 else t for t in inputs], ctx=ctx, kernel="triton")


def test_buffers_past_int32_offsets_fail_closed():
    """The kernels index in int32: a call whose saved states would pass 2**31 elements is refused, not wrapped.
    (Meta tensors: the check runs before any kernel or device check, so nothing of that size is allocated.)"""
    x = torch.empty(1, 2**20, 32, 64, device="meta")
    dt = torch.empty(1, 2**20, 32, device="meta")
    Bm = torch.empty(1, 2**20, 1, 128, device="meta")
    with pytest.raises(ValueError, match=r"indexes in int32.*split the batch"):
        ssd_scan(x, dt, torch.empty(32, device="meta"), Bm, Bm, kernel="triton")
