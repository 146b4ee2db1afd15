"""MLA with attn_impl='varlen' (torch's flash varlen attention over the context's cu_seqlens) against the dense
SDPA path with the same weights.

Flash attention runs on CUDA only. On a CPU the layer's side of the contract (the [B*T, heads, D] layout, v padded
to the q/k head dim and the output cut back, the cu_seqlens it passes, with and without a context, the leak harness)
runs through `varlen_attention_reference` (SMALL's d_v 8 against q/k 16, as the base model's 128 against 192: the
padding runs), a plain-torch form of varlen_attn's contract put in the kernel's place;
the refusals run as they are. The kernel itself is checked on the GPU (the `cuda` tests below)."""

from __future__ import annotations

import inspect

import pytest
import torch
from torch import nn

from megacpp_lab.data import boundary_windows, load_sample
from megacpp_lab.nn import mla
from megacpp_lab.nn.dsa import DSAConfig
from megacpp_lab.nn.mla import (VARLEN_CAUSAL, MLAConfig, MultiLatentAttention, VarlenRefusedError, varlen_attention,
                                varlen_attention_reference, varlen_refusal)  # fmt: skip
from megacpp_lab.testing import check_leaks, with_doc_ids
from megacpp_lab.varlen import build_context
from mla_pairs import REAL, SMALL, check_across_shapes, check_against_sdpa, layer_pair, packed_doc_ids, rel


@pytest.fixture
def reference_kernel(monkeypatch: pytest.MonkeyPatch) -> list[dict]:
    """The plain-torch contract in the kernel's place, on a CPU in fp32/fp64; records each call's arguments."""
    calls: list[dict] = []

    def kernel(q, k, v, cu_q, cu_k, max_q, max_k, **kw):
        calls.append(dict(shapes=(q.shape, k.shape, v.shape), cu=cu_q.tolist(), max_q=max_q, max_k=max_k, kw=kw))
        return varlen_attention_reference(q, k, v, cu_q, cu_k, max_q, max_k, **kw)

    monkeypatch.setattr(mla, "_varlen_attn", kernel)
    monkeypatch.setattr(mla, "varlen_refusal", lambda *a, **k: None)
    return calls


# ----------------------------------------------------------------------------- CPU


def test_the_causal_keyword_is_one_this_torchs_varlen_attn_takes() -> None:
    varlen = pytest.importorskip("torch.nn.attention.varlen")
    params = inspect.signature(varlen.varlen_attn).parameters
    ((name, value),) = VARLEN_CAUSAL.items()
    assert name in params and "scale" in params
    assert (name, value) in (("window_size", (-1, 0)), ("is_causal", True))
    # the reference reads the same keyword as causal attention
    cu = torch.tensor([0, 4], dtype=torch.int32)
    q, k, v = (torch.randn(4, 1, 8) for _ in range(3))
    out = varlen_attention_reference(q, k, v, cu, cu, 4, 4, **VARLEN_CAUSAL)
    torch.testing.assert_close(out[0], v[0])  # the first query sees its own key only


def test_the_reference_is_causal_attention_inside_each_document() -> None:
    torch.manual_seed(0)
    cu = torch.tensor([0, 3, 10, 16], dtype=torch.int32)
    q, k, v = (torch.randn(16, 2, 8, dtype=torch.float64) for _ in range(3))
    out = varlen_attention_reference(q, k, v, cu, cu, 7, 7, scale=0.3, **VARLEN_CAUSAL)
    doc = torch.repeat_interleave(torch.arange(3), cu.diff().long())
    allowed = (doc[:, None] == doc[None, :]) & torch.ones(16, 16, dtype=torch.bool).tril()
    scores = torch.einsum("thd,shd->hts", q, k) * 0.3
    want = torch.einsum("hts,shd->thd", scores.masked_fill(~allowed, float("-inf")).softmax(-1), v)
    torch.testing.assert_close(out, want)
    with pytest.raises(ValueError, match="causal attention only"):
        varlen_attention_reference(q, k, v, cu, cu, 7, 7, window_size=(-1, -1))
    with pytest.raises(ValueError, match="documents of 1..6 tokens"):
        varlen_attention_reference(q, k, v, cu, cu, 6, 6, **VARLEN_CAUSAL)


def test_varlen_attention_pads_v_and_cuts_the_output_back(reference_kernel: list[dict]) -> None:
    torch.manual_seed(1)
    B, T, H = 2, 12, 3
    q, k = (torch.randn(B, T, H, 16, dtype=torch.float64) for _ in range(2))
    v = torch.randn(B, T, H, 8, dtype=torch.float64)
    doc_ids = torch.tensor([[0] * 5 + [1] * 7, [0] * 12])
    ctx = build_context(doc_ids)
    out = varlen_attention(q, k, v, ctx.cu_seqlens, 0.25)
    assert out.shape == (B, T, H, 8)
    (call,) = reference_kernel
    assert call["shapes"] == ((B * T, H, 16),) * 3 and call["cu"] == [0, 5, 12, 24]
    assert call["max_q"] == call["max_k"] == T and call["kw"] == {"scale": 0.25, **VARLEN_CAUSAL}
    mask = (doc_ids[:, :, None] == doc_ids[:, None, :]) & torch.ones(T, T, dtype=torch.bool).tril()
    want = torch.nn.functional.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                            attn_mask=mask[:, None], scale=0.25).transpose(1, 2)  # fmt: skip
    torch.testing.assert_close(out, want)


@pytest.mark.parametrize("packed", [False, True], ids=["no_ctx", "ctx"])
def test_the_layer_equals_sdpa_with_gradients(reference_kernel: list[dict], packed: bool) -> None:
    sdpa, varlen = layer_pair("varlen", "cpu", torch.float64, **SMALL)
    doc_ids = packed_doc_ids(3, 40, "cpu", seed=5)
    ctx = build_context(doc_ids) if packed else None
    x = torch.randn(3, 40, 32, dtype=torch.float64)
    xs = [x.clone().requires_grad_() for _ in range(2)]
    y, ref = varlen(xs[0], ctx=ctx), sdpa(xs[1], ctx=ctx)
    torch.testing.assert_close(y, ref)
    dy = torch.randn_like(ref)
    y.backward(dy)
    ref.backward(dy)
    torch.testing.assert_close(xs[0].grad, xs[1].grad)
    for (name, p), q in zip(sdpa.named_parameters(), varlen.parameters()):
        torch.testing.assert_close(q.grad, p.grad, msg=name)
    # without a context each row is one document: cu_seqlens are the rows' bounds
    assert reference_kernel[0]["cu"] == (ctx.cu_seqlens.tolist() if packed else [0, 40, 80, 120])


def test_the_layer_passes_the_leak_harness_on_real_packed_rows(reference_kernel: list[dict]) -> None:
    w = boundary_windows(load_sample()[0].batch, 2, 24, lead=9)
    torch.manual_seed(0)
    emb = nn.Embedding(259, 32)
    _, layer = layer_pair("varlen", "cpu", **SMALL)
    mixer = with_doc_ids(layer.eval())
    report = check_leaks(lambda t, d: mixer(emb(t), d), w.tokens, w.doc_ids, vocab_size=259,
                         causal_positions=range(0, 24, 4))  # fmt: skip
    assert report.passed, str(report)
    assert reference_kernel, "the varlen path did not run"


def test_auto_never_takes_varlen(reference_kernel: list[dict]) -> None:
    """attn_impl='auto' does not run varlen even where varlen_refusal lets it (here patched to let everything
    through): varlen was measured slower than flex (MLAConfig.attn_impl)."""
    sdpa, auto = layer_pair("varlen", "cpu", **SMALL)
    auto.config = MLAConfig.build(**SMALL, attn_impl="auto")
    x = torch.randn(2, 16, 32)
    ctx = build_context(packed_doc_ids(2, 16, "cpu", seed=3))
    torch.testing.assert_close(auto(x, ctx=ctx), sdpa(x, ctx=ctx), atol=0, rtol=0)
    assert not reference_kernel
    cuda, long_ctx = torch.device("cuda"), build_context(torch.zeros(1, 256, dtype=torch.long))
    for compiling, want in ((True, "flex"), (False, "sdpa")):
        for dtype in (torch.bfloat16, torch.float16):
            got = auto.auto_impl(cuda, dtype, compiling=compiling, grad=True, seq_len=256, ctx=long_ctx)
            assert got == (want if dtype == torch.bfloat16 else "sdpa"), (compiling, dtype, got)


def test_refusals_name_what_is_missing() -> None:
    cuda, cpu, h100 = torch.device("cuda"), torch.device("cpu"), (9, 0)
    assert varlen_refusal(cuda, torch.bfloat16, 192, 128, h100) is None
    assert varlen_refusal(cuda, torch.bfloat16, 32, 16, h100) is None
    assert "not proven on CUDA capability (9, 0) in float16 at head dims 192/128" in varlen_refusal(cuda, torch.float16, 192, 128, h100)
    assert "not proven on CUDA capability (8, 0) in bfloat16" in varlen_refusal(cuda, torch.bfloat16, 192, 128, (8, 0))
    assert "not proven" in varlen_refusal(cuda, torch.bfloat16, 64, 64, h100)
    assert "CUDA only" in varlen_refusal(cpu, torch.bfloat16, 192, 128)
    assert "float16 or bfloat16" in varlen_refusal(cuda, torch.float32, 192, 128)
    assert "<= 256" in varlen_refusal(cuda, torch.bfloat16, 320, 128)
    assert "multiple of 8" in varlen_refusal(cuda, torch.bfloat16, 100, 64)
    assert "d_v=256 > 192" in varlen_refusal(cuda, torch.bfloat16, 192, 256)
    with pytest.raises(ValueError, match="attn_impl.*not 'varlen' in a DSA layer"):
        MultiLatentAttention(MLAConfig.build(**SMALL, attn_impl="varlen"), DSAConfig.build(d_model=32, n_heads=2, head_dim=16, top_k=8))


@pytest.mark.parametrize("fullgraph", [True, False], ids=["fullgraph", "graph_breaks_allowed"])
def test_varlen_on_a_cpu_is_refused_eager_and_compiled(fullgraph: bool) -> None:
    """Never a silent fallback: eager raises the reason; compiled, the refusal runs outside the graph, so it
    raises the same reason with and without fullgraph."""
    _, varlen = layer_pair("varlen", "cpu", **SMALL)
    x = torch.randn(1, 16, 32)
    with pytest.raises(VarlenRefusedError, match="CUDA only"):
        varlen(x)
    torch._dynamo.reset()
    with pytest.raises((VarlenRefusedError, RuntimeError), match="CUDA only|refuses this compiled attention call"):
        torch.compile(varlen, fullgraph=fullgraph)(x)



# ----------------------------------------------------------------------------- CUDA, the kernel itself


@pytest.mark.cuda
@pytest.mark.parametrize("grad", [False, True], ids=["no_grad", "grad"])
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize(("B", "T"), [(1, 256), (2, 1024), (4, 2048), (3, 640)])
def test_cuda_varlen_equals_sdpa(B: int, T: int, compiled: bool, grad: bool) -> None:
    torch._dynamo.reset()
    sdpa, varlen = layer_pair("varlen", "cuda", torch.bfloat16, **REAL)
    fn = torch.compile(varlen, fullgraph=True, dynamic=False) if compiled else varlen
    check_against_sdpa(fn, sdpa, B, T, grad, seed=B * 10_000 + T)
    check_against_sdpa(fn, sdpa, B, T, grad, seed=1 + B * 10_000 + T, packed=False)


@pytest.mark.cuda
@pytest.mark.parametrize("grad", [False, True], ids=["no_grad", "grad"])
def test_cuda_compiled_varlen_one_module_across_shapes_without_recompiling_per_layout(grad: bool) -> None:
    """One compiled layer over shapes no test names; new document layouts at one shape do not recompile."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    sdpa, varlen = layer_pair("varlen", "cuda", torch.bfloat16, **REAL)
    compiled = torch.compile(varlen, fullgraph=True)
    check_across_shapes(compiled, sdpa, [(3, 640), (1, 4096), (4, 256), (2, 1152), (8, 512), (2, 100)], grad)
    before = counters["stats"]["unique_graphs"]
    for seed in range(5):
        check_against_sdpa(compiled, sdpa, 2, 1152, grad, seed=200 + seed)
    assert counters["stats"]["unique_graphs"] == before


@pytest.mark.cuda
def test_cuda_varlen_layer_passes_the_leak_harness() -> None:
    w = boundary_windows(load_sample()[0].batch, 2, 256, lead=9)
    torch.manual_seed(0)
    emb = nn.Embedding(259, REAL["d_model"]).cuda().bfloat16()
    _, layer = layer_pair("varlen", "cuda", torch.bfloat16, **REAL)
    mixer = with_doc_ids(layer.eval())
    report = check_leaks(lambda t, d: mixer(emb(t), d), w.tokens.cuda(), w.doc_ids.cuda(), vocab_size=259,
                         causal_positions=range(0, 256, 32))  # fmt: skip
    assert report.passed, str(report)
