"""kernels/doc_conv.py (the doc-masked causal depthwise conv with its SiLU, in Triton) against the module's torch
form (nn/primitives.DocCausalDepthwiseConv, xla_safe) and its decode step: forward and every gradient, across
dtypes, kernel sizes, widths that are not a multiple of the block, with and without bias, positions and SiLU;
under the Triton interpreter on CPU at small fp32 shapes and on the GPU at the R block's width."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from megacpp_lab.kernels import TRITON_INTERPRET
from megacpp_lab.kernels.doc_conv import doc_conv
from megacpp_lab.nn.m2rnn import M2RNN, M2RNNConfig
from megacpp_lab.nn.primitives import DocCausalDepthwiseConv
from megacpp_lab.nn.ssm import SSD, SSDConfig
from megacpp_lab.varlen import build_context, doc_ids_from_cu_seqlens, positions_from_doc_ids

ON_GPU = torch.cuda.is_available()
DEVICE = "cuda" if ON_GPU else "cpu"
needs_kernels = pytest.mark.skipif(not (ON_GPU or TRITON_INTERPRET), reason="needs CUDA or TRITON_INTERPRET=1")


def _doc_ids(B: int, T: int, cuts: list[list[int]], device: str) -> torch.Tensor:
    """[B,T] document ids with the given in-row document starts (row starts always start one)."""
    ids = torch.zeros(B, T, dtype=torch.long)
    for b, row in enumerate(cuts):
        for c in row:
            ids[b, c:] += 1
    return ids.to(device)


def _pair(D: int, K: int, bias: bool, dtype: torch.dtype, device: str) -> tuple[DocCausalDepthwiseConv, ...]:
    torch.manual_seed(0)
    ref = DocCausalDepthwiseConv(D, K, "xla_safe", bias=bias).to(device, dtype)
    with torch.no_grad():  # a bias and weights away from init's small values, so every term counts
        ref.weight.normal_()
        if bias:
            ref.bias.normal_()
    fast = DocCausalDepthwiseConv(D, K, "triton", bias=bias).to(device, dtype)
    fast.load_state_dict(ref.state_dict())
    return ref, fast


def _run(conv: DocCausalDepthwiseConv, x: torch.Tensor, ctx, silu: bool, dy: torch.Tensor) -> list[torch.Tensor]:
    x = x.detach().clone().requires_grad_()
    y = conv(x, ctx, silu=silu)
    params = [conv.weight] + ([conv.bias] if conv.bias is not None else [])
    grads = torch.autograd.grad(y, [x, *params], dy)
    return [y.detach(), *grads]


def _compare(B, T, D, K, *, bias, silu, cuts, dtype, device, tol):  # noqa: ANN001, ANN202
    ref, fast = _pair(D, K, bias, dtype, device)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(B, T, D, generator=g).to(device, dtype)
    dy = torch.randn(B, T, D, generator=g).to(device, dtype)
    ctx = build_context(_doc_ids(B, T, cuts, device)) if cuts is not None else None
    # the oracle: the torch form in fp32 (fp64 on CPU), on the same (rounded) values
    acc = torch.float64 if device == "cpu" else torch.float32
    oracle = DocCausalDepthwiseConv(D, K, "xla_safe", bias=bias).to(device, acc)
    oracle.load_state_dict({k: v.to(acc) for k, v in ref.state_dict().items()})
    want = _run(oracle, x.to(acc), ctx, silu, dy.to(acc))
    got = _run(fast, x, ctx, silu, dy)
    names = ["y", "dx", "dweight", "dbias"]
    for name, a, b in zip(names, got, want):
        assert a.dtype == (x.dtype if name in ("y", "dx") else ref.weight.dtype), name
        err = ((a.to(acc) - b).abs().max() / b.abs().max().clamp_min(1e-6)).item()
        assert err <= tol, f"{name}: max error {err:.2e} of its largest magnitude (tol {tol:.0e})"
    return got


@needs_kernels
@pytest.mark.parametrize("K", [1, 2, 4, 7])
@pytest.mark.parametrize("bias,silu", [(True, True), (False, False), (True, False)])
def test_kernel_matches_torch_form_fp32(K, bias, silu):
    # D = 136: a second, partial block of channels; T = 40: a partial block of tokens; documents of 1 to 23 tokens,
    # one starting at t = 1 (shorter than the window) and one a single token
    _compare(2, 40, 136, K, bias=bias, silu=silu, cuts=[[1, 2, 25], [17]], dtype=torch.float32, device=DEVICE,
             tol=1e-5)  # fmt: skip


@needs_kernels
def test_kernel_without_positions_is_one_document_a_row():
    """ctx None: each row one document (no tap crosses a row start), as the torch form."""
    _compare(3, 24, 40, 4, bias=True, silu=True, cuts=None, dtype=torch.float32, device=DEVICE, tol=1e-5)


@needs_kernels
def test_bf16_holds_within_its_rounding_under_the_interpreter():
    """bf16 x, weights and gradient (the stored dpre in bf16, as eager's SiLU backward hands it on) against the fp32
    torch form on the same values."""
    _compare(2, 40, 136, 4, bias=True, silu=True, cuts=[[1, 2, 25], [17]], dtype=torch.bfloat16, device=DEVICE,
             tol=2e-2)  # fmt: skip


@needs_kernels
def test_a_slice_of_a_wider_row_is_read_in_place():
    """x a slice of a wider projection's channels (the layers' conv inputs): the same y and gradients as from a
    contiguous copy, and the op reads it without one (the forward's input is the slice itself)."""
    from megacpp_lab.kernels import doc_conv as dc

    torch.manual_seed(0)
    wide = torch.randn(2, 24, 56, device=DEVICE)
    x = wide[..., 8:48]
    assert not x.is_contiguous() and dc._rows(x)[1] == 56
    w, b = torch.randn(40, 1, 4, device=DEVICE), torch.randn(40, device=DEVICE)
    pos = positions_from_doc_ids(_doc_ids(2, 24, [[5], [11, 12]], DEVICE))
    dy = torch.randn(2, 24, 40, device=DEVICE)
    dense = x.contiguous().requires_grad_()
    y_dense = doc_conv(dense, w, b, pos, silu=True)
    (g_dense,) = torch.autograd.grad(y_dense, [dense], dy)
    sliced = wide.clone().requires_grad_()
    y = doc_conv(sliced[..., 8:48], w, b, pos, silu=True)
    (g,) = torch.autograd.grad(y, [sliced], dy)
    torch.testing.assert_close(y, y_dense, rtol=0, atol=0)
    torch.testing.assert_close(g[..., 8:48], g_dense, rtol=0, atol=0)
    assert not g[..., :8].any() and not g[..., 48:].any()


@needs_kernels
def test_positions_that_do_not_restart_at_a_row_start_never_reach_another_row():
    """Unchecked positions (continuing across a row start, or larger than the offset in the row): no tap reaches
    before its row, as the torch form's padding within each row; the kernel equals that form."""
    torch.manual_seed(0)
    B, T, D = 2, 12, 16
    ref, fast = _pair(D, 4, True, torch.float32, DEVICE)
    x = torch.randn(B, T, D, device=DEVICE)
    pos = (torch.arange(B * T, device=DEVICE) + 5).view(B, T)  # 5 at t = 0, and row 1 continuing row 0
    torch.testing.assert_close(doc_conv(x, fast.weight, fast.bias, pos, silu=True),
                               F.silu(ref._unfold_sum(x, pos)), rtol=1e-6, atol=1e-6)  # fmt: skip


@needs_kernels
def test_a_nan_gradient_stays_in_its_document():
    """The backward's dx: a NaN in one document's output gradient reaches no earlier document."""
    B, T, D = 1, 16, 8
    ids = _doc_ids(B, T, [[6]], DEVICE)
    x = torch.randn(B, T, D, device=DEVICE, requires_grad=True)
    y = doc_conv(x, torch.randn(D, 1, 4, device=DEVICE), torch.randn(D, device=DEVICE), positions_from_doc_ids(ids),
                 silu=True)  # fmt: skip
    dy = torch.randn_like(y)
    dy[0, 6] = float("nan")  # the second document's first token
    (dx,) = torch.autograd.grad(y, [x], dy)
    assert torch.isfinite(dx[0, :6]).all() and torch.isnan(dx[0, 6]).all()


@needs_kernels
def test_positions_and_a_single_row_document_layout_agree():
    """positions given for one document a row give what no positions give, bit for bit."""
    torch.manual_seed(0)
    x = torch.randn(2, 20, 24, device=DEVICE)
    w, b = torch.randn(24, 1, 4, device=DEVICE), torch.randn(24, device=DEVICE)
    pos = positions_from_doc_ids(torch.zeros(2, 20, dtype=torch.long, device=DEVICE))
    assert torch.equal(doc_conv(x, w, b, pos, silu=True), doc_conv(x, w, b, None, silu=True))


@needs_kernels
def test_nothing_crosses_a_document_start():
    """A NaN in one document reaches no other: the masked taps read zero, never 0 * NaN."""
    B, T, D = 1, 16, 8
    ids = _doc_ids(B, T, [[6]], DEVICE)
    x = torch.randn(B, T, D, device=DEVICE)
    x[0, 5] = float("nan")  # the first document's last token
    y = doc_conv(x, torch.randn(D, 1, 4, device=DEVICE), torch.randn(D, device=DEVICE), positions_from_doc_ids(ids),
                 silu=True)  # fmt: skip
    assert torch.isnan(y[0, 5]).all() and torch.isfinite(y[0, 6:]).all() and torch.isfinite(y[0, :5]).all()


LAYERS = {
    "m2rnn": lambda **kw: M2RNN(M2RNNConfig.build(d_model=32, n_heads=2, k_head_dim=16, v_head_dim=16,
                                                  kernel="reference", **kw)),
    "ssd": lambda **kw: SSD(SSDConfig.build(d_model=32, n_heads=2, head_dim=16, state_dim=16, chunk=16,
                                            kernel="chunked", **kw)),
}  # fmt: skip


@needs_kernels
@pytest.mark.parametrize("layer", LAYERS)
def test_layer_with_the_kernel_equals_the_torch_form(layer):
    """The R block's mixer and Mamba-2's SSD with conv_impl='triton' against 'xla_safe': the same output and input
    gradient (fp32)."""
    torch.manual_seed(0)
    ref = LAYERS[layer]().to(DEVICE)
    fast = LAYERS[layer](conv_impl="triton").to(DEVICE)
    fast.load_state_dict(ref.state_dict())
    ctx = build_context(_doc_ids(2, 12, [[5], [3, 4]], DEVICE))
    x = torch.randn(2, 12, 32, device=DEVICE)
    outs = []
    for layer in (ref, fast):
        xi = x.clone().requires_grad_()
        y = layer(xi, ctx=ctx)
        (gx,) = torch.autograd.grad(y.square().sum(), [xi])
        outs.append((y.detach(), gx))
    torch.testing.assert_close(outs[1][0], outs[0][0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(outs[1][1], outs[0][1], rtol=1e-4, atol=1e-4)


@needs_kernels
def test_step_equals_the_kernel_forward():
    """The decode step (the module's step loop) reproduces the Triton forward at every position (fp32)."""
    torch.manual_seed(0)
    conv = DocCausalDepthwiseConv(24, 4, "triton").to(DEVICE)
    x = torch.randn(1, 10, 24, device=DEVICE)
    y = conv(x, None, silu=True)
    window = conv.init_window(1, DEVICE, x.dtype)
    for t in range(10):
        yt, window = conv.step(x[:, t : t + 1], window)
        torch.testing.assert_close(F.silu(yt)[0, 0], y[0, t], rtol=1e-6, atol=1e-6)


@needs_kernels
@pytest.mark.parametrize("bias,positions,silu", [(True, False, True), (False, True, False)])
def test_op_passes_opcheck(bias, positions, silu):
    """The custom op's schema, fake kernel (shapes and strides: a wrong fake broke the compiled backward) and
    autograd registration, by torch.library.opcheck."""
    from megacpp_lab.kernels.doc_conv import doc_conv_fwd

    x = torch.randn(2, 8, 16, device=DEVICE, requires_grad=True)
    w = torch.randn(16, 1, 4, device=DEVICE, requires_grad=True)
    b = torch.randn(16, device=DEVICE, requires_grad=True) if bias else None
    pos = positions_from_doc_ids(_doc_ids(2, 8, [[3], []], DEVICE)) if positions else None
    torch.library.opcheck(doc_conv_fwd, (x, w, b, pos, silu))


@needs_kernels
@pytest.mark.parametrize("bias", [True, False])
def test_the_backward_op_leaves_the_weight_sums_to_the_autograd_formula(bias):
    """doc_conv_bwd hands back dx and the weight's and bias's fp32 partial sums per token block, and dispatches no
    reduction of its own: the autograd formula sums them, where inductor fuses the sum, the flip and the casts
    (inside the op they were aten kernels inductor cannot fuse); its fake gives the partials' shape (opcheck), and the
    gradients still equal the torch form's."""
    from megacpp_lab.kernels.doc_conv import doc_conv_bwd
    from megacpp_lab.testing.host_reads import LAUNCHER_PLUMBING, launcher_operators

    B, T, D, K = 2, 40, 16, 4
    x = torch.randn(B, T, D, device=DEVICE, requires_grad=True)
    conv = DocCausalDepthwiseConv(D, K, impl="triton", bias=bias).to(DEVICE)
    ctx = build_context(_doc_ids(B, T, [[7, 30], []], DEVICE))
    y = conv(x, ctx, silu=True)
    dy = torch.randn_like(y)
    _, called = launcher_operators(lambda: y.backward(dy), "megacpp::doc_conv_bwd")
    assert [name for name in called if name not in LAUNCHER_PLUMBING] == [], called
    ref = DocCausalDepthwiseConv(D, K, impl="xla_safe", bias=bias).to(DEVICE)
    ref.load_state_dict(conv.state_dict())
    xr = x.detach().clone().requires_grad_()
    ref(xr, ctx, silu=True).backward(dy)
    pos = positions_from_doc_ids(ctx.doc_ids)
    torch.testing.assert_close(x.grad, xr.grad, rtol=1e-5, atol=1e-5)
    for got, want in zip(conv.parameters(), ref.parameters()):
        torch.testing.assert_close(got.grad, want.grad, rtol=1e-5, atol=1e-5)
    grad, xd = dy.contiguous(), x.detach()
    torch.library.opcheck(doc_conv_bwd, (grad, xd, conv.weight.detach(), None if conv.bias is None else conv.bias.detach(),
                                         pos, True))


@needs_kernels
def test_m2rnn_layer_with_the_kernel_compiles_fullgraph():
    """No graph break around the op: the R block with the Triton conv (and the Triton scan) compiled fullgraph
    equals its eager run, output and input gradient (fp32, the interpreter on CPU)."""
    torch.manual_seed(0)
    layer = M2RNN(M2RNNConfig.build(d_model=32, n_heads=2, k_head_dim=16, v_head_dim=16, conv_impl="triton",
                                    kernel="triton")).to(DEVICE)  # fmt: skip
    ctx = build_context(_doc_ids(2, 12, [[5], []], DEVICE))
    x = torch.randn(2, 12, 32, device=DEVICE, requires_grad=True)
    runs = []
    for fn in (torch.compile(layer, fullgraph=True), layer):
        y = fn(x, ctx=ctx)
        runs.append((y.detach(), *torch.autograd.grad(y.square().sum(), [x])))
    torch.testing.assert_close(runs[0][0], runs[1][0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(runs[0][1], runs[1][1], rtol=1e-4, atol=1e-4)


def test_auto_takes_the_torch_form_off_the_gpu(monkeypatch):
    """'auto' on a CPU tensor is xla_safe, bit for bit, and never calls the kernel (interpreted or not)."""
    import megacpp_lab.nn.primitives as primitives

    def refuse(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        raise AssertionError("'auto' called the Triton conv on a CPU tensor")

    monkeypatch.setattr(primitives, "doc_conv", refuse)
    torch.manual_seed(0)
    auto = DocCausalDepthwiseConv(16, 4, "auto")
    ref = DocCausalDepthwiseConv(16, 4, "xla_safe")
    ref.load_state_dict(auto.state_dict())
    x = torch.randn(2, 8, 16)
    assert torch.equal(auto(x, silu=True), ref(x, silu=True))


@pytest.mark.parametrize(
    "change,message",
    [
        (lambda a: a.update(x=a["x"][0]), "x must be a tensor [B,T,D]"),
        (lambda a: a.update(x=a["x"].double()), "float64 is the torch form's"),
        (lambda a: a.update(x=a["x"][:, :0]), "must hold tokens"),
        (lambda a: a.update(weight=a["weight"][:, :, :0]), "weight must be [D,1,K]"),
        (lambda a: a.update(weight=a["weight"][:4]), "weight must be [D,1,K]"),
        (lambda a: a.update(bias=a["bias"][:3]), "bias must be None or [D]"),
        (lambda a: a.update(positions=a["positions"].float()), "positions must be None or an integer"),
        (lambda a: a.update(positions=a["positions"][:, :3]), "positions must be None or an integer"),
    ],
)
def test_bad_input_fails_closed_naming_the_field(change, message):
    args = dict(x=torch.randn(2, 6, 8), weight=torch.randn(8, 1, 4), bias=torch.randn(8),
                positions=torch.zeros(2, 6, dtype=torch.long))  # fmt: skip
    change(args)
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        doc_conv(args["x"], args["weight"], args["bias"], args["positions"])


def test_triton_impl_refuses_a_cpu_tensor_without_the_interpreter(monkeypatch):
    """No silent fallback: the explicit 'triton' form on a device it cannot launch on raises, naming the device."""
    import megacpp_lab.kernels.doc_conv as dc

    monkeypatch.setattr(dc, "launchable", lambda device: False)
    with pytest.raises(RuntimeError, match="needs CUDA tensors"):
        dc.doc_conv(torch.randn(1, 4, 8), torch.randn(8, 1, 4), None, None)


# ------------------------------------------------------------------ GPU, real shapes


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_on_gpu_at_the_r_blocks_width(dtype):
    """[2, 4096, 2304] (the base model's R block: 2304 q/k/v channels), 8 uneven documents a row, K = 4."""
    B, T, D = 2, 4096, 2304
    cu = torch.tensor([0, 700, 1500, 1501, 2600, 3000, 3500, 3900, 4096], dtype=torch.int32)
    cu = torch.cat([cu, cu[1:] + T]).cuda()
    ids = doc_ids_from_cu_seqlens(cu, B, T)
    cuts = [[int(c) for c in (ids[b, 1:] != ids[b, :-1]).nonzero()[:, 0] + 1] for b in range(B)]
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for silu in (True, False):
        _compare(B, T, D, 4, bias=True, silu=silu, cuts=cuts, dtype=dtype, device="cuda", tol=tol)


@pytest.mark.cuda
def test_auto_takes_the_kernel_on_a_gpu_and_the_torch_form_for_float64(monkeypatch):
    import megacpp_lab.nn.primitives as primitives

    calls = []
    real = primitives.doc_conv
    monkeypatch.setattr(primitives, "doc_conv", lambda *a, **k: calls.append(a[0].dtype) or real(*a, **k))
    conv = DocCausalDepthwiseConv(64, 4, "auto").cuda()
    conv(torch.randn(2, 16, 64, device="cuda"), silu=True)
    conv.double()(torch.randn(2, 16, 64, device="cuda", dtype=torch.float64), silu=True)
    assert calls == [torch.float32]


@pytest.mark.cuda
def test_m2rnn_layer_compiles_with_the_kernel_without_breaks():
    """The R block with conv_impl='auto' (the kernel on a GPU) compiles fullgraph and matches eager (bf16)."""
    layer = M2RNN(M2RNNConfig.build(d_model=256, n_heads=4, conv_impl="auto")).cuda().to(torch.bfloat16)
    x = torch.randn(2, 256, 256, device="cuda", dtype=torch.bfloat16)
    ctx = build_context(_doc_ids(2, 256, [[100, 101], [7]], "cuda"))
    compiled = torch.compile(layer, fullgraph=True)
    torch.testing.assert_close(compiled(x, ctx=ctx).float(), layer(x, ctx=ctx).float(), atol=5e-2, rtol=5e-2)
