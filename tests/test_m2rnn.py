"""M2RNN: reference loop, Triton scan (TRITON_INTERPRET=1 on CPU), kernel selection, layer, compile boundary."""

import types
import sys
import warnings

import pytest
import torch

import megacpp_lab.kernels.m2rnn as m2k
from megacpp_lab.kernels import OFFLINE_COMPILE
from megacpp_lab.data import boundary_windows, load_sample
from megacpp_lab.kernels.m2rnn import BWD_ORDERS, m2rnn_scan_reference, m2rnn_scan, resolve_kernel
from megacpp_lab.nn.m2rnn import M2RNN, M2RNNConfig, M2RNNMegatronMixer
from megacpp_lab.testing import LAUNCHER_PLUMBING, check_leaks, each_document_alone, launcher_operators, with_doc_ids
from megacpp_lab.varlen import build_context, documents_longest_first

ON_GPU = torch.cuda.is_available()
# Triton runs on the GPU where there is one, else under TRITON_INTERPRET=1 (tests/conftest.py)
DEVICE = "cuda" if ON_GPU else "cpu"


def _inputs(B, S, H, K, V, *, dtype=torch.float32, device=DEVICE, seed=0, n_h0=None):
    g = torch.Generator(device="cpu").manual_seed(seed)
    mk = lambda *shape, scale=1.0: (torch.randn(*shape, generator=g) * scale).to(device=device, dtype=dtype)
    q, k, v = mk(B, S, H, K, scale=0.5), mk(B, S, H, K, scale=0.5), mk(B, S, H, V)
    f = torch.sigmoid(torch.randn(B, S, H, generator=g) + 1.0).to(device=device, dtype=dtype)
    W = mk(H, V, V, scale=0.5 * V**-0.5)  # contractive: rounding differences do not grow with S
    h0 = (torch.randn(n_h0 or B, H, K, V, generator=g) * 0.5).to(device=device, dtype=torch.float32)
    return [t.requires_grad_() for t in (q, k, v, f, W, h0)]


def _compare(kw_triton, kw_ref, inputs, *, fwd_tol, grad_rtol):
    q, k, v, f, W, h0 = inputs
    y = m2rnn_scan(q, k, v, f, W, h0, kernel="triton", **kw_triton)
    ref_inputs = [t.detach().float().requires_grad_() for t in inputs]
    yr = m2rnn_scan(*ref_inputs, kernel="reference", **kw_ref)
    assert (y.float() - yr).abs().max() <= fwd_tol
    g = torch.randn_like(yr)
    grads = torch.autograd.grad(y, inputs, g.to(y.dtype))
    grads_ref = torch.autograd.grad(yr, ref_inputs, g)
    for name, a, b in zip(("q", "k", "v", "f", "W", "h0"), grads, grads_ref):
        rel = (a.float() - b).norm() / b.norm().clamp_min(1e-12)
        assert rel <= grad_rtol, f"d{name}: relative error {rel:.2e}"
    return y, yr


def test_reference_gradcheck_fp64():
    B, S, H, K, V = 1, 4, 1, 3, 2
    g = torch.Generator().manual_seed(0)
    args = [torch.randn(*s, generator=g, dtype=torch.float64, requires_grad=True)
            for s in ((B, S, H, K), (B, S, H, K), (B, S, H, V))]  # fmt: skip
    f = torch.rand(B, S, H, generator=g, dtype=torch.float64, requires_grad=True)
    W = torch.randn(H, V, V, generator=g, dtype=torch.float64, requires_grad=True)
    h0 = torch.randn(B, H, K, V, generator=g, dtype=torch.float64, requires_grad=True)
    reset = torch.tensor([[True, False, True, False]])
    idx = torch.zeros(B, S, dtype=torch.long)
    fn = lambda q, k, v, f, W, h0: m2rnn_scan_reference(q, k, v, f, W, h0, reset, idx)
    assert torch.autograd.gradcheck(fn, (*args, f, W, h0))


@pytest.mark.parametrize("chunk", [1, 3, 64])
def test_triton_matches_reference_on_packed_rows_with_initial_state(chunk):
    """Two rows, several documents, non-zero h0, K != V, every gradient (TRITON_INTERPRET on CPU)."""
    inputs = _inputs(2, 13, 2, 32, 16)
    doc_ids = torch.tensor([[0] * 5 + [1] * 1 + [2] * 7, [0] * 13], device=DEVICE)
    kw = dict(doc_ids=doc_ids, chunk=chunk)
    _compare(kw, dict(doc_ids=doc_ids), inputs, fwd_tol=1e-5, grad_rtol=1e-5)


def test_triton_matches_reference_varlen_cu_seqlens():
    cu = torch.tensor([0, 6, 7, 15], dtype=torch.int32, device=DEVICE)
    inputs = _inputs(1, 15, 2, 16, 16, n_h0=3)
    _compare(dict(cu_seqlens=cu, chunk=4), dict(cu_seqlens=cu), inputs, fwd_tol=1e-5, grad_rtol=1e-5)


@pytest.mark.parametrize("bwd_order", BWD_ORDERS)
@pytest.mark.parametrize("block_k,z_mode", [(16, "scratch"), (16, "recompute"), (32, "recompute"), (0, "auto")])
def test_every_launch_plan_matches_the_reference(block_k, z_mode, bwd_order):
    """Each K-split (16 rows a program: fp32 partials summed; 32 = K: one program a pair), either place for z
    (kept in scratch, or recomputed in the reverse pass) and either order of the backward's passes (parallel: every
    chunk recomputed at once, then one reverse chain; serial: chunk by chunk) computes the reference's y and every gradient: documents of
    1 to 7 steps over chunks of 4 (a partial last chunk, a single-chunk document), a non-zero h0."""
    inputs = _inputs(2, 11, 2, 32, 16, n_h0=5)
    doc_ids = torch.tensor([[0] * 4 + [1] * 7, [0] * 1 + [1] * 3 + [2] * 7], device=DEVICE)
    ctx = build_context(doc_ids)
    kw = dict(ctx=ctx, chunk=4, block_k=block_k, z_mode=z_mode, bwd_order=bwd_order)
    _compare(kw, dict(ctx=ctx), inputs, fwd_tol=1e-5, grad_rtol=1e-5)


@pytest.mark.parametrize("bwd_order", BWD_ORDERS)
@pytest.mark.parametrize("chunk", [1, 3, 16])
def test_backward_orders_with_clipping_and_one_or_many_chunks_a_document(chunk, bwd_order):
    """Either backward order where a document is one chunk (chunk 16), many (chunk 1: every state a checkpoint)
    or a non-divisor (3), with the state gradient clipped, against the reference loop's hooks."""
    inputs = _inputs(1, 13, 2, 16, 16)
    doc_ids = torch.tensor([[0] * 6 + [1] * 7], device=DEVICE)
    kw = dict(doc_ids=doc_ids, grad_clip=0.05)
    _compare(kw | dict(chunk=chunk, bwd_order=bwd_order), kw, inputs, fwd_tol=1e-5, grad_rtol=1e-5)


@pytest.mark.parametrize("dots_in_input_dtype", [True, False])
@pytest.mark.parametrize("bwd_order", BWD_ORDERS)
def test_bf16_backward_operands_against_the_reference(monkeypatch, bwd_order, dots_in_input_dtype):
    """bf16 inputs, packed documents: the reverse pass's MMAs with bf16 operands (the default; the parallel order's
    states stored in bf16 too) or fp32 operands: y and every gradient within bf16's own error of the fp32 reference
    loop (under the interpreter the operands' rounding is emulated: its dot of 16-bit floats multiplies their raw
    bits, which this test caught as gradient errors of 1e11)."""
    monkeypatch.setattr(m2k, "BWD_DOTS_IN_INPUT_DTYPE", dots_in_input_dtype)
    inputs = _inputs(2, 13, 2, 32, 16, dtype=torch.bfloat16)
    doc_ids = torch.tensor([[0] * 5 + [1] * 8, [0] * 9 + [1] * 4], device=DEVICE)
    _compare(dict(doc_ids=doc_ids, chunk=4, bwd_order=bwd_order), dict(doc_ids=doc_ids), inputs, fwd_tol=0.03,
             grad_rtol=1.5e-2)  # fmt: skip


@pytest.mark.parametrize("block_k,z_mode", [(16, "scratch"), (0, "auto")])
def test_parallel_backward_in_segments_matches_the_reference(monkeypatch, block_k, z_mode):
    """The parallel order with its buffer over budget: segments of 4 steps (a chunk) reversed last first, the reverse
    chain's state and its dW and dh0 sums carried between them, over documents of 1, 11 and 12 steps (one inside a
    segment, two across three: six segments over the 24 tokens, the last ones empty), a non-zero h0, a K split and
    both places for z, with the state gradient clipped, against the reference loop."""
    monkeypatch.setattr(m2k, "PARALLEL_BUFFER_BYTES", 1)
    monkeypatch.setattr(m2k, "PARALLEL_MIN_SEGMENT", 4)
    inputs = _inputs(2, 12, 2, 32, 16, n_h0=3)
    doc_ids = torch.tensor([[0] * 1 + [1] * 11, [0] * 12], device=DEVICE)
    ctx = build_context(doc_ids)
    assert m2k.plan_segments(ctx.n_seqs, 24, 4, 2 * 32 * 16 * 4) == (4, 6)
    kw = dict(ctx=ctx, chunk=4, block_k=block_k, z_mode=z_mode, bwd_order="parallel", grad_clip=0.5)
    _compare(kw, dict(ctx=ctx, grad_clip=0.5), inputs, fwd_tol=1e-5, grad_rtol=1e-5)


def test_launchers_compute_nothing_per_batch_beyond_the_scan():
    """The checkpoints take kernels/ssd.py's slot layout (document p's chunk c in slot ranges[p] // chunk + p + c),
    so neither launcher computes slot tables on the device: with one segment and one row block, the operators each
    op calls directly are allocations, views, the Triton launches' own copies (the interpreter's, on a CPU) and the
    backward's one dW reduction over documents (each operator costs host time in a step that is host-bound
    between kernels)."""
    q, k, v, f, W, _ = [t.detach() for t in _inputs(2, 11, 2, 16, 16)]
    ranges = torch.tensor([0, 4, 11, 12, 22], dtype=torch.int32, device=DEVICE)
    reset = torch.zeros(22, dtype=torch.int8, device=DEVICE)
    reset[ranges[:-1].long()] = 1  # each document's first token
    # the launch order and the plan's host lengths as a context gives them (longest_first, cu_seqlens_host)
    order, lengths = documents_longest_first(ranges), ranges.cpu()
    (y, ckpt), fwd = launcher_operators(
        lambda: torch.ops.megacpp.m2rnn_scan_fwd(q, k, v, f, W, None, ranges, order, lengths, reset, 4, True, 0.0, 16),
        "megacpp::m2rnn_scan_fwd")  # fmt: skip
    assert set(fwd) <= LAUNCHER_PLUMBING, fwd
    assert ckpt.shape[0] == 22 // 4 + 4  # the slot bound: total // chunk + documents
    _, bwd = launcher_operators(
        lambda: torch.ops.megacpp.m2rnn_scan_bwd(torch.ones_like(y), q, k, v, f, W, None, ranges, order, lengths, reset,
                                                 ckpt, 4, 0.0, 16),
        "megacpp::m2rnn_scan_bwd")  # fmt: skip
    assert [name for name in bwd if name not in LAUNCHER_PLUMBING] == ["sum"], bwd


def test_the_context_hands_the_scan_its_launch_order_and_host_lengths(monkeypatch):
    """Through ctx= the op gets the context's longest_first (the launch order) and cu_seqlens_host (the plan's
    lengths, no device read); bare cu_seqlens= the order found on the device and no host lengths; rows neither.
    (The kernels' results do not depend on the order, so the reference comparisons cannot see it dropped.)"""
    seen = []
    real = m2k.m2rnn_scan_fwd

    def spy(*args):
        seen.append(args[7:9])
        return real(*args)

    monkeypatch.setattr(m2k, "m2rnn_scan_fwd", spy)
    q, k, v, f, W, _ = (t.detach() for t in _inputs(1, 12, 1, 16, 16))
    ctx = build_context(torch.tensor([[0, 0, 1, 1, 1, 1, 1, 2, 2, 2, 3, 3]], device=DEVICE))
    m2rnn_scan(q, k, v, f, W, ctx=ctx, kernel="triton")
    assert seen[-1][0] is ctx.longest_first and seen[-1][1] is ctx.cu_seqlens_host
    assert ctx.longest_first.tolist() == [1, 2, 0, 3, 4]
    m2rnn_scan(q, k, v, f, W, cu_seqlens=ctx.cu_seqlens, kernel="triton")
    assert seen[-1][0].tolist() == [1, 2, 0, 3, 4] and seen[-1][1] is None
    m2rnn_scan(q, k, v, f, W, kernel="triton")
    assert seen[-1] == (None, None)


def test_launch_plan_rules_and_bad_plans_fail_closed():
    """plan_block_k takes the state rows a program with the shortest modelled launch (the longest document's chain,
    or the SMs' work); plan_z_scratch recomputes z once the two scratch buffers outgrow half of L2; an explicit plan
    is checked, naming the field."""
    cpu = torch.device("cpu")  # the interpreter runs one program at a time: a split only adds programs' steps
    assert m2k.plan_block_k([40], 1, 64, 16, cpu) == 64 and m2k.plan_z_scratch(10**6, 64, 16, 16, cpu)
    assert m2k.plan_block_k([40], 1, 64, 16, cpu, block_k=16) == 16
    assert m2k.plan_z_scratch(1, 64, 16, 16, cpu, "recompute") is False
    # the backward's register cap: at most BWD_MAX_BLOCK state elements a program, whatever the documents
    assert m2k.plan_bwd_block_k([40], 1, 64, 16, cpu) == 64 and m2k.plan_bwd_block_k([40], 1, 64, 32, cpu) == 64
    assert m2k.plan_bwd_block_k([40], 1, 64, 64, cpu) == 64 and m2k.plan_bwd_block_k([40], 1, 64, 128, cpu) == 32
    assert m2k.plan_bwd_block_k([40], 1, 64, 256, cpu) == 16
    # an override is taken as given, even past the register cap (the plan gives 32 rows at V=128)
    assert m2k.plan_bwd_block_k([40], 1, 64, 128, cpu, block_k=64) == 64
    assert m2k.plan_block_k([40], 1, 64, 16, cpu, max_rows=16) == 16
    assert m2k.plan_block_k([40], 1, 32, 16, cpu, max_rows=64) == 32
    assert m2k.plan_block_k([40], 1, 64, 16, cpu, max_rows=8) == 16  # never below the smallest split
    with pytest.raises(ValueError, match="stage must be one of"):
        m2k.plan_block_k([40], 1, 64, 16, cpu, stage="sideways")
    # the GPU's model (a GH100's 132 SMs, as kernels/resources.py compiles for): the base model's R block at B=4
    # T=4096 with 8 even documents a row is the SMs' work, whole rows; with bench compile's seeded-random
    # documents its longest (1821 tokens) is the launch, split to 16 rows; so is one document a row over few heads
    even, uneven = [512] * 32, [1821, 1765, 993, 982, 924] + [int((16384 - 6485) / 27)] * 27
    token = OFFLINE_COMPILE.set(True)
    try:
        for stage in m2k.PLAN_STAGES:
            assert m2k.plan_block_k(even, 16, 64, 16, cpu, stage=stage) == 64
            assert m2k.plan_block_k(uneven, 16, 64, 16, cpu, stage=stage) == 16
            assert m2k.plan_block_k([4096] * 2, 8, 64, 16, cpu, stage=stage) == 16
            # bench m2rnn's widest point (B=16 S=1024 H=32 V=64): the SMs' work at every block
            assert m2k.plan_block_k([1024] * 16, 32, 64, 64, cpu, stage=stage) == 64
            t_even = [m2k.plan_makespan_us(even, 16, 64, 16, bk, cpu, stage) for bk in (16, 32, 64)]
            assert t_even == sorted(t_even, reverse=True)  # the modelled time falls with the block on even documents
        # V=64 on the seeded documents: the forward's chain at 32 rows, the backward's whole rows at 4 warps (the
        # probe's fastest of each, profiles/nvidia-h100-80gb-hbm3/m2rnn/m2rnn_plan_probe.json)
        assert m2k.plan_block_k(uneven, 16, 64, 64, cpu) == 32 and m2k.plan_bwd_block_k(uneven, 16, 64, 64, cpu) == 64
    finally:
        OFFLINE_COMPILE.reset(token)
    # the parallel order's segments: one while its buffer fits PARALLEL_BUFFER_BYTES or segments cannot shrink it
    step = 8 * 64 * 16 * 2  # bytes a token at H=8, K=64, V=16, bf16 states
    assert m2k.plan_segments(2, 8192, 64, step) == (2048, 4)  # B=2 rows of 4096: 64 MiB of 128
    assert m2k.plan_segments(2, 2048, 64, step) == (2048, 1)  # 32 MiB: one segment
    assert m2k.plan_segments(32, 16384, 64, step) == (16384, 1)  # many documents: no segment would shrink it
    # warps: one per BWD_ELEMENTS_PER_WARP state elements, at least the tuned count
    assert m2k.plan_warps(2, 16, 16) == 2 and m2k.plan_warps(2, 64, 16) == 2 and m2k.plan_warps(2, 64, 32) == 2
    assert m2k.plan_warps(2, 32, 64) == 2 and m2k.plan_warps(2, 64, 64) == 4 and m2k.plan_warps(4, 16, 16) == 4
    assert m2k.plan_warps(2, 128, 128) == m2k.MAX_WARPS
    if ON_GPU:
        _, l2 = m2k._limits(torch.device("cuda"))
        assert not m2k.plan_z_scratch(l2, 64, 16, 16, torch.device("cuda"))
    for bad in (8, 24, 128):
        with pytest.raises(ValueError, match=f"block_k must be a power of two >= 16 dividing K=64, got {bad}"):
            m2k.plan_block_k([40], 1, 64, 16, cpu, block_k=bad)
    q, k, v, f, W, _ = (t.detach() for t in _inputs(1, 8, 1, 16, 16))
    with pytest.raises(ValueError, match="z_mode must be one of"):
        m2rnn_scan(q, k, v, f, W, kernel="triton", z_mode="sometimes")
    with pytest.raises(ValueError, match="bwd_order must be one of"):
        m2rnn_scan(q, k, v, f, W, kernel="triton", bwd_order="backwards")
    with pytest.raises(ValueError, match="block_k must be a power of two >= 16 dividing K=16, got 32"):
        m2rnn_scan(q, k, v, f, W, kernel="triton", block_k=32)
    for K, V in ((24, 16), (48, 16), (16, 8)):  # no K-split of 24 or 48 rows tiles them; tl.dot needs 16
        q, k, v, f, W, _ = (t.detach() for t in _inputs(1, 4, 1, K, V))
        name, size = ("K", K) if K != 16 else ("V", V)
        with pytest.raises(ValueError, match=f"the Triton kernel needs {name} .* a power of two >= 16, got {name}={size}"):
            m2rnn_scan(q, k, v, f, W, kernel="triton")
        m2rnn_scan(q, k, v, f, W, kernel="reference")  # the reference takes any size


def test_doc_resets_make_documents_independent():
    """Each document of a packed row gives what it gives alone, starting from h0."""
    q, k, v, f, W, h0 = (t.detach() for t in _inputs(1, 12, 1, 16, 16))
    doc_ids = torch.tensor([[0] * 7 + [1] * 5], device=DEVICE)
    y = m2rnn_scan(q, k, v, f, W, h0, doc_ids=doc_ids, kernel="triton")
    alone = m2rnn_scan(q[:, 7:], k[:, 7:], v[:, 7:], f[:, 7:], W, h0, kernel="triton")
    assert torch.allclose(y[:, 7:], alone, atol=1e-6)


def test_gradient_clipping_matches_reference_hooks():
    inputs = _inputs(1, 10, 1, 16, 16)
    kw = dict(grad_clip=0.05)
    _compare(kw, kw, inputs, fwd_tol=1e-5, grad_rtol=1e-5)


def test_bf16_inputs_keep_an_fp32_state():
    inputs = _inputs(1, 32, 2, 16, 16, dtype=torch.bfloat16)
    y, yr = _compare({}, {}, inputs, fwd_tol=0.06, grad_rtol=5e-2)
    assert y.dtype == torch.bfloat16


def test_scan_validation_names_the_field():
    q, k, v, f, W, h0 = (t.detach() for t in _inputs(1, 8, 1, 16, 16))
    with pytest.raises(ValueError, match=r"W must have shape \(1, 16, 16\)"):
        m2rnn_scan(q, k, v, f, W[:, :8], kernel="triton")
    # doc_ids on the Triton kernel become a PackedContext (the cu_seqlens kernel's one path): bad ids fail there
    with pytest.raises(ValueError, match="doc_ids go backwards at row 0, offset 4"):
        m2rnn_scan(q, k, v, f, W, doc_ids=torch.tensor([[0, 0, 1, 1, 0, 0, 0, 0]], device=DEVICE), kernel="triton")
    with pytest.raises(ValueError, match="give only one of doc_ids, cu_seqlens and ctx"):
        m2rnn_scan(q, k, v, f, W, doc_ids=torch.zeros(1, 8, dtype=torch.long, device=DEVICE),
                   cu_seqlens=torch.tensor([0, 8], dtype=torch.int32, device=DEVICE))  # fmt: skip
    with pytest.raises(ValueError, match="cu_seqlens must be a 1-D int32 tensor"):  # structure: on any device
        m2rnn_scan(q, k, v, f, W, cu_seqlens=torch.tensor([0, 8], device=DEVICE), kernel="triton")
    # values (varlen.check_cu_seqlens): by name on the host; a device assert on a GPU, which would end the process
    cpu = [t.cpu() for t in (q, k, v, f, W)]
    with pytest.raises(ValueError, match="cu_seqlens do not cover the 8 tokens: they end at 5"):
        m2rnn_scan(*cpu, cu_seqlens=torch.tensor([0, 5], dtype=torch.int32), kernel="reference")
    with pytest.raises(ValueError, match=r"h0 must have shape \(1, 1, 16, 16\)"):
        m2rnn_scan(q, k, v, f, W, h0[:, :, :8], kernel="triton")


# ------------------------------------------------------------------ kernel selection (tripwires)


def test_tripwire_no_silent_fallback_to_the_reference_loop(monkeypatch):
    """Without a GPU, 'auto' runs the reference loop only with a loud warning, once."""
    if ON_GPU:
        assert resolve_kernel("auto", torch.device("cuda")) == "triton"
        return
    m2k._warn_reference_fallback.cache_clear()
    monkeypatch.setattr(m2k, "DEFAULT_KERNEL", "auto")
    q, k, v, f, W, _ = (t.detach() for t in _inputs(1, 4, 1, 16, 16, device="cpu"))
    with pytest.warns(RuntimeWarning, match="reference step loop") as caught:
        m2rnn_scan(q, k, v, f, W)
    assert caught[0].filename == __file__  # attributed to the caller's line, not the library's
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a second call does not warn again
        m2rnn_scan(q, k, v, f, W)
        m2rnn_scan(q, k, v, f, W, kernel="reference")  # the explicit switch is silent


def test_reference_fallback_warning_points_at_the_callers_line_through_the_layer(monkeypatch):
    """Raised three calls deep (layer -> scan -> kernel choice); the warning names the line that called the layer."""
    if ON_GPU:
        pytest.skip("the fallback warning exists only without a GPU")
    from megacpp_lab.nn.m2rnn import M2RNN, M2RNNConfig

    m2k._warn_reference_fallback.cache_clear()
    monkeypatch.setattr(m2k, "DEFAULT_KERNEL", "auto")
    layer = M2RNN(M2RNNConfig.build(d_model=32, n_heads=2, kernel="auto"))
    with pytest.warns(RuntimeWarning, match="reference step loop") as caught:
        layer(torch.randn(1, 8, 32)); line = sys._getframe().f_lineno  # fmt: skip
    assert (caught[0].filename, caught[0].lineno) == (__file__, line)


def test_triton_without_gpu_or_interpreter_fails_closed(monkeypatch):
    import megacpp_lab.kernels as kernels

    monkeypatch.setattr(kernels, "TRITON_INTERPRET", False)  # what kernels.launchable reads
    with pytest.raises(RuntimeError, match="kernel='triton' needs CUDA tensors"):
        resolve_kernel("triton", torch.device("cpu"))
    with pytest.raises(ValueError, match="kernel must be one of"):
        resolve_kernel("xla", torch.device("cpu"))


def test_a_bad_context_an_empty_batch_and_a_negative_clip_fail_closed():
    """A ctx that is no PackedContext and an empty batch failed deep inside the scan (AttributeError, IndexError);
    a negative grad_clip turned clipping off without a word (the hook clamps only for grad_clip > 0)."""
    q, k, v, f, W, _ = _inputs(2, 8, 2, 16, 16)
    for kernel in ("triton", "reference"):
        with pytest.raises(TypeError, match="ctx must be a PackedContext .*got str"):
            m2rnn_scan(q, k, v, f, W, ctx="rows", kernel=kernel)
        with pytest.raises(ValueError, match=r"q must hold tokens, got \[B,S,H,K\] = \[2, 0, 2, 16\]"):
            m2rnn_scan(q[:, :0], k[:, :0], v[:, :0], f[:, :0], W, kernel=kernel)
        with pytest.raises(ValueError, match=r"grad_clip must be a number >= 0 \(0: no clipping\), got -1.0"):
            m2rnn_scan(q, k, v, f, W, grad_clip=-1.0, kernel=kernel)


def test_environment_knob_is_read_once_at_import(monkeypatch):
    """MEGACPP_M2RNN_KERNEL is read into DEFAULT_KERNEL at import, never polled per step: setting it at run time
    leaves kernel='auto' answering from the import-time default. The knob is set to the kernel that 'auto' does
    NOT pick on this device (the reference on a GPU, Triton under the interpreter on a CPU), so a resolve_kernel
    that re-read the environment would answer differently."""
    device = torch.device(DEVICE)
    with warnings.catch_warnings():  # 'auto' on a CPU warns that it falls back to the reference loop
        warnings.simplefilter("ignore", RuntimeWarning)
        before = resolve_kernel("auto", device)
        knob = "reference" if before == "triton" else "triton"
        monkeypatch.setenv("MEGACPP_M2RNN_KERNEL", knob)
        assert resolve_kernel(knob, device) == knob  # the knob's own answer really differs from the default's
        assert resolve_kernel("auto", device) == before


# ------------------------------------------------------------------ compile boundary


def _graph_nodes(fn, *args, **kwargs) -> tuple[int, int]:
    explained = torch._dynamo.explain(fn)(*args, **kwargs)
    nodes = sum(len(list(g.graph.nodes)) for g in explained.graphs)
    return explained.graph_break_count, nodes


def test_tripwire_whole_model_compile_does_not_unroll_the_reference_loop():
    """The reference is @torch.compiler.disable: compiling around it breaks the graph instead
    of unrolling S steps, so the traced graph does not grow with S."""
    sizes = {}
    for S in (8, 32):
        q, k, v, f, W, h0 = (t.detach() for t in _inputs(1, S, 1, 16, 16, device="cpu"))
        fn = lambda q, k, v, f, W: m2rnn_scan(q, k, v, f, W, kernel="reference") * 2
        breaks, nodes = _graph_nodes(fn, q, k, v, f, W)
        assert breaks >= 1
        sizes[S] = nodes
    assert sizes[8] == sizes[32]


def test_regional_compile_of_the_layer_has_no_graph_break():
    layer = M2RNN(M2RNNConfig.build(d_model=32, n_heads=2, k_head_dim=16, v_head_dim=16, kernel="triton")).to(DEVICE)
    x = torch.randn(2, 16, 32, device=DEVICE)
    doc_ids = torch.tensor([[0] * 6 + [1] * 10, [0] * 16], device=DEVICE)
    breaks, _ = _graph_nodes(layer, x, ctx=build_context(doc_ids))
    assert breaks == 0


# ------------------------------------------------------------------ layer, config, adapter


def _layer(**kw) -> M2RNN:
    torch.manual_seed(0)
    return M2RNN(M2RNNConfig.build(d_model=32, n_heads=2, k_head_dim=16, v_head_dim=16, kernel="triton", **kw)).to(DEVICE)


@pytest.mark.parametrize("conv_impl", ["xla_safe", "triton"])
def test_layer_passes_the_leak_harness_on_real_packed_rows(sample_leak_reports, conv_impl):
    """With either conv form (the Triton one: kernels/doc_conv.py, under the interpreter on CPU)."""
    torch.manual_seed(0)
    report, leaky = sample_leak_reports(_layer(conv_impl=conv_impl), DEVICE)
    assert report.passed, str(report)
    assert not leaky.passed


def test_layer_triton_equals_reference_and_packed_rows_equaleach_document_alone():
    """The packed context's path against the reference kernel, and against each document run on its own (the
    independent reference: no context, the conv and the state start from zero at the row start)."""
    layer = _layer()
    x = torch.randn(2, 20, 32, device=DEVICE)
    doc_ids = torch.tensor([[0] * 8 + [1] * 12, [0] * 3 + [1] * 16 + [2]], device=DEVICE)
    ctx = build_context(doc_ids)
    y = layer(x, ctx=ctx)
    assert torch.allclose(y, layer(x, ctx=ctx, kernel="reference"), atol=1e-5)
    assert torch.allclose(y, each_document_alone(layer, doc_ids, x), atol=1e-5)
    with pytest.raises(ValueError, match=r"ctx is for \[B,T\] = \(2, 20\), the input is \(1, 20\)"):
        layer(x[:1], ctx=ctx)
    with pytest.raises(TypeError, match="ctx must be a PackedContext"):
        layer(x, ctx=doc_ids)


def test_megatron_adapter_is_seq_first_and_returns_no_bias():
    layer = _layer()
    mixer = M2RNNMegatronMixer(layer.config).to(DEVICE)
    mixer.m2rnn.load_state_dict(layer.state_dict())
    x = torch.randn(2, 12, 32, device=DEVICE)
    out, bias = mixer(x.transpose(0, 1), attention_mask=None)
    assert bias is None and out.shape == (12, 2, 32)
    assert torch.allclose(out.transpose(0, 1), layer(x), atol=1e-6)
    ctx = build_context(torch.tensor([[0] * 5 + [1] * 7, [0] * 12], device=DEVICE))  # over [batch, seq]
    out, _ = mixer(x.transpose(0, 1), ctx=ctx)
    assert torch.allclose(out.transpose(0, 1), layer(x, ctx=ctx), atol=1e-6)
    assert not torch.allclose(out.transpose(0, 1), layer(x), atol=1e-3)  # the context reached the layer


def test_config_builder_reads_a_megatron_style_config():
    src = types.SimpleNamespace(hidden_size=64, num_attention_heads=4, m2rnn_conv_kernel=2)
    cfg = M2RNNConfig.build(src, gradient_clipping=1.0)
    assert (cfg.d_model, cfg.n_heads, cfg.conv_kernel, cfg.gradient_clipping) == (64, 4, 2, 1.0)
    assert (cfg.k_head_dim, cfg.v_head_dim) == (64, 16)
    with pytest.raises(ValueError, match=r"needs \['n_heads'\]"):
        M2RNNConfig.build(d_model=8)
    with pytest.raises(ValueError, match="no field"):
        M2RNNConfig.build(d_model=8, n_heads=1, heads=2)


@pytest.mark.parametrize(
    "field, value, allowed",
    [
        ("k_head_dim", 48, "a power of two >= 16"),
        ("v_head_dim", 8, "a power of two >= 16"),
        ("conv_kernel", 17, r"0 \(no conv\) or a kernel size in 1\.\.16"),
        ("gradient_clipping", -1.0, "a finite float >= 0"),
        ("residual", "yes", "a bool"),
        ("A_init_range", (0.0, 1.0), r"\(lo, hi\) with 0 < lo <= hi"),
        ("dt_min", 0.5, "0 < dt_min <= dt_max < 1"),
        ("dt_init_floor", 0.01, r"in \(0, dt_min=0.001\]"),
        ("chunk", 0, "an int >= 1"),
        ("kernel", "cuda", "one of"),
        ("conv_impl", "cudnn", r"one of \('xla_safe', 'maxtext_depthwise', 'triton', 'auto'\)"),
        ("n_heads", True, "an int"),
    ],
)
def test_config_fails_closed_naming_the_field(field, value, allowed):
    with pytest.raises(ValueError, match=rf"M2RNNConfig\.{field} must be {allowed}"):
        M2RNNConfig.build(**{"d_model": 32, "n_heads": 2, field: value})


# ------------------------------------------------------------------ GPU, real shapes


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_matches_reference_on_gpu_at_real_shapes(dtype, monkeypatch):
    B, S, H, K, V = 2, 512, 8, 64, 16
    inputs = _inputs(B, S, H, K, V, dtype=dtype, device="cuda")
    doc_ids = torch.zeros(B, S, dtype=torch.long, device="cuda")
    doc_ids[0, 200:] = 1
    doc_ids[0, 333:] = 2
    tol = dict(fwd_tol=1e-4, grad_rtol=1e-4) if dtype == torch.float32 else dict(fwd_tol=0.06, grad_rtol=3e-2)
    _compare(dict(doc_ids=doc_ids), dict(doc_ids=doc_ids), inputs, **tol)
    for block_k, z_mode in ((16, "scratch"), (64, "recompute"), (32, "scratch")):  # every launch plan, real shape
        for bwd_order in BWD_ORDERS:
            _compare(dict(doc_ids=doc_ids, block_k=block_k, z_mode=z_mode, bwd_order=bwd_order), dict(doc_ids=doc_ids),
                     inputs, **tol)  # fmt: skip
    # the parallel order in segments of 128 steps (its buffer budget forced down): documents across 1 to 4 of them
    monkeypatch.setattr(m2k, "PARALLEL_BUFFER_BYTES", 1)
    monkeypatch.setattr(m2k, "PARALLEL_MIN_SEGMENT", 128)
    assert m2k.plan_segments(4, B * S, 64, H * K * V * 2)[1] > 1
    _compare(dict(doc_ids=doc_ids, bwd_order="parallel"), dict(doc_ids=doc_ids), inputs, **tol)


@pytest.mark.cuda
def test_layer_on_gpu_bf16_leak_free_and_compiles_without_breaks():
    layer = M2RNN(M2RNNConfig.build(d_model=256, n_heads=4)).cuda().to(torch.bfloat16)
    w = boundary_windows(load_sample()[0].batch, 2, 256)
    x = torch.randn(2, 256, 256, device="cuda", dtype=torch.bfloat16)
    doc_ids = w.doc_ids.cuda()
    report = check_leaks(with_doc_ids(layer), x, doc_ids, causal_positions=range(0, 256, 17))
    assert report.passed, str(report)
    ctx = build_context(doc_ids)
    compiled = torch.compile(layer, fullgraph=True)
    assert torch.allclose(compiled(x, ctx=ctx).float(), layer(x, ctx=ctx).float(), atol=5e-2)


# ------------------------------------------------------------------ the benchmark's peer adapter


def test_xma_adapter_computes_the_labs_recurrence_with_and_without_documents():
    """bench m2rnn's call of XMA (its argument order, its varlen layout over cu_seqlens) gives the lab's reference
    y on the same inputs: run here on XMA's torch backend (its Triton one needs a GPU), so the grid times the
    same recurrence on both sides. Skipped where no XMA checkout is found."""
    import importlib

    from megacpp_lab.bench import peer_checkout
    from megacpp_lab.bench.m2rnn import XMA_ENV, xma_call
    from megacpp_lab.varlen import doc_ids_from_cu_seqlens, packed_cu_seqlens

    where = peer_checkout(XMA_ENV, "xma", "xma/layers/m2rnn")
    if where is None:
        pytest.skip("no XMA checkout (../shared/peers/xma or $MEGACPP_XMA_PEER)")
    sys.path.insert(0, str(where))
    try:
        xma = importlib.import_module("xma")
        m2rnn = importlib.import_module("xma.layers.m2rnn").m2rnn
    finally:
        sys.path.remove(str(where))
    def torch_backend(q, k, v, W, f, cu_seqlens=None, max_seqlen=None):
        """XMA's torch backend; it has no varlen mode, so its documented one (T,N,* over cu_seqlens) runs it on
        each document as a batch of one, concatenated: the contract the Triton backend implements."""
        run = lambda *a: m2rnn(*a, kernel_backend=xma.KernelBackend.torch)
        if cu_seqlens is None:
            return run(q, k, v, W, f)
        assert q.dim() == 3 and max_seqlen == int((cu_seqlens[1:] - cu_seqlens[:-1]).max())
        bounds = cu_seqlens.tolist()
        ys = [run(*(t[None, a:b] for t in (q, k, v)), W, f[None, a:b])[0][0] for a, b in zip(bounds, bounds[1:])]
        return torch.cat(ys), None

    q, k, v, f, W, _ = (t.detach().cpu() for t in _inputs(2, 10, 2, 16, 16, device="cpu"))
    for docs in (1, 3):
        cu = packed_cu_seqlens(2, 10, docs, torch.Generator().manual_seed(docs))
        ctx = build_context(doc_ids_from_cu_seqlens(cu, 2, 10))
        ref = m2rnn_scan(q, k, v, f, W, ctx=ctx, kernel="reference")
        got = xma_call(torch_backend, None if docs == 1 else cu)(q, k, v, f, W)
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.cuda
def test_xma_triton_backend_through_the_adapter_computes_the_labs_recurrence_on_gpu():
    """On a GPU, XMA's Triton backend through bench m2rnn's adapter, its own varlen mode over cu_seqlens included
    (the contract the CPU test above emulates), against the lab's reference loop: the peer grid times one
    recurrence on both sides. Skipped where no XMA checkout is found."""
    from megacpp_lab.bench import peer_checkout
    from megacpp_lab.bench.m2rnn import XMA_ENV, find_xma, xma_call
    from megacpp_lab.varlen import doc_ids_from_cu_seqlens, packed_cu_seqlens

    if peer_checkout(XMA_ENV, "xma", "xma/layers/m2rnn") is None:
        pytest.skip("no XMA checkout (../shared/peers/xma, .peers/xma or $MEGACPP_XMA_PEER)")
    xma, why = find_xma("cuda")
    assert xma is not None, why
    q, k, v, f, W, _ = (t.detach() for t in _inputs(2, 96, 4, 64, 32, device="cuda"))
    for docs in (1, 5):
        cu = packed_cu_seqlens(2, 96, docs, torch.Generator().manual_seed(docs))
        ctx = build_context(doc_ids_from_cu_seqlens(cu, 2, 96).cuda())
        ref = m2rnn_scan(q, k, v, f, W, ctx=ctx, kernel="reference")
        got = xma_call(xma, None if docs == 1 else cu.cuda())(q, k, v, f, W)
        torch.testing.assert_close(got.float(), ref.float(), atol=5e-3, rtol=5e-3)  # its dots may run TF32
