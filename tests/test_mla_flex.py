"""MLA with attn_impl='flex': eager and compiled, against the dense SDPA path with the same weights.

Compiled flex once returned wrong numbers with no error (B=4, T=256, no_grad on an H100) and hit illegal
memory accesses at T >= 1024, because the block mask was built inside the compiled region and fused into
the attention kernel. The mask is now built once per batch outside, with the batch's context
(`build_context(doc_ids, block_mask=True)`), compiled calls without one are refused, and so is every
configuration that FLEX_PROVEN does not list."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch._dynamo.utils import counters

from megacpp_lab.nn import mla
from megacpp_lab.nn.mla import (FLEX_KERNEL_OPTIONS, FLEX_PROVEN, FlexNotProvenError, MLAConfig, MultiLatentAttention,
                                flex_kernel_options, flex_refusal)  # fmt: skip
from megacpp_lab.varlen import FLEX_BLOCK, build_context, doc_causal_block_mask
from mla_pairs import REAL, SMALL, check_across_shapes, check_against_sdpa, layer_pair, packed_doc_ids, rel


# ----------------------------------------------------------------------------- CPU (fp32, no gradients)


def test_flex_equals_the_dense_doc_mask_eager_with_and_without_a_prebuilt_mask() -> None:
    sdpa, flex = layer_pair("flex", "cpu", **SMALL)
    x = torch.randn(2, 16, 32)
    doc_ids = torch.tensor([[0] * 6 + [1] * 10, [0] * 3 + [1] * 4 + [2] * 9])
    ctx, ctx_mask = build_context(doc_ids), build_context(doc_ids, block_mask=True)
    with torch.no_grad():
        ref = sdpa(x, ctx=ctx)
        torch.testing.assert_close(flex(x, ctx=ctx), ref, atol=1e-5, rtol=1e-5)  # the mask built here, eagerly
        torch.testing.assert_close(flex(x, ctx=ctx_mask), ref, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(flex(x), sdpa(x), atol=1e-5, rtol=1e-5)  # one document per row


def test_compiled_flex_equals_sdpa_and_never_recompiles_for_new_document_layouts() -> None:
    torch._dynamo.reset()
    sdpa, flex = layer_pair("flex", "cpu", **SMALL)
    compiled = torch.compile(flex, fullgraph=True)
    x = torch.randn(2, 128, 32)
    counters.clear()
    with torch.no_grad():
        for seed in range(4):  # 1..6 documents per row, different at every step
            doc_ids = packed_doc_ids(2, 128, "cpu", seed)
            y = compiled(x, ctx=build_context(doc_ids, block_mask=True))
            torch.testing.assert_close(y, sdpa(x, ctx=build_context(doc_ids)), atol=1e-5, rtol=1e-5)
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])
    assert not counters["graph_break"], dict(counters["graph_break"])


# fullgraph=True reports the refusal as dynamo's Unsupported (the disabled refusal's reason); without it, the
# refusal itself propagates: it must not degrade into a graph break followed by an eager run that succeeds.
REFUSED = {True: "refuses this compiled attention call", False: None}


def test_flex_launch_options_apply_to_their_gpu_dtype_and_head_dims_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """FLEX_KERNEL_OPTIONS's entries are found only for their capability, dtype and head dims (else torch's own
    choice), and every entry is a valid flex option whose blocks tile the block mask's."""
    bf16, cuda = torch.bfloat16, torch.device("cuda", 0)
    assert flex_kernel_options(torch.device("cpu"), bf16, 192, 128) is None
    monkeypatch.setattr(mla, "_capability", lambda index: (9, 0))
    assert flex_kernel_options(cuda, bf16, 192, 128) is FLEX_KERNEL_OPTIONS[((9, 0), bf16, 192, 128)]
    assert flex_kernel_options(cuda, bf16, 128, 128) is None  # other head dims: torch's choice
    assert flex_kernel_options(cuda, torch.float16, 192, 128) is None  # another dtype (measured in bf16 only)
    monkeypatch.setattr(mla, "_capability", lambda index: (8, 0))
    assert flex_kernel_options(cuda, bf16, 192, 128) is None  # another GPU: torch's choice
    names = {f"{p}_{n}" for p in ("fwd", "bwd") for n in ("num_stages", "num_warps")}
    names |= {"fwd_BLOCK_M", "fwd_BLOCK_N"} | {f"bwd_BLOCK_{n}" for n in ("M1", "N1", "M2", "N2")}
    for key, options in FLEX_KERNEL_OPTIONS.items():
        assert set(options) <= names, (key, set(options) - names)
        assert all(FLEX_BLOCK % v == 0 for k, v in options.items() if "BLOCK" in k), (key, options)


def test_the_layer_hands_its_launch_options_to_flex_attention(monkeypatch: pytest.MonkeyPatch) -> None:
    """The flex path passes flex_kernel_options's answer for its device, dtype and head dims to flex_attention
    (eager on a CPU, fp32 without gradients: a configuration FLEX_PROVEN lists; the options recorded, then dropped,
    since the CPU's flex takes no CUDA launch options)."""
    asked, seen = [], []
    sentinel = {"fwd_num_warps": 8}

    def options(device, dtype, d_qk, d_v):  # noqa: ANN001, ANN202
        asked.append((device.type, dtype, d_qk, d_v))
        return sentinel

    real = mla.flex_attention

    def recorder(*args, kernel_options=None, **kwargs):  # noqa: ANN002, ANN003, ANN202
        seen.append(kernel_options)
        return real(*args, **kwargs)

    monkeypatch.setattr(mla, "flex_kernel_options", options)
    monkeypatch.setattr(mla, "flex_attention", recorder)
    _, flex = layer_pair("flex", "cpu", **SMALL)
    with torch.no_grad():
        flex(torch.randn(1, 16, SMALL["d_model"]))
    assert asked == [("cpu", torch.float32, SMALL["d_nope"] + SMALL["d_rope"], SMALL["d_v"])]
    assert seen == [sentinel]


@pytest.mark.parametrize("fullgraph", [True, False], ids=["fullgraph", "graph_breaks_allowed"])
def test_compiled_flex_without_a_block_mask_is_refused(fullgraph: bool) -> None:
    torch._dynamo.reset()
    _, flex = layer_pair("flex", "cpu", **SMALL)
    x = torch.randn(1, 128, 32)
    match = REFUSED[fullgraph] or "needs a context with a block mask.*build_context"
    with torch.no_grad(), pytest.raises(RuntimeError, match=match):
        torch.compile(flex, fullgraph=fullgraph)(x, ctx=build_context(torch.zeros(1, 128, dtype=torch.long)))


def test_unproven_flex_configurations_are_refused_by_name() -> None:
    _, flex = layer_pair("flex", "cpu", **SMALL)
    x = torch.randn(1, 16, 32)
    with pytest.raises(NotImplementedError, match="not proven on cpu float32 eager with gradients"):
        flex(x)  # flex has no CPU backward
    with torch.no_grad(), pytest.raises(NotImplementedError, match="not proven on cpu bfloat16 eager"):
        flex.to(torch.bfloat16)(x.bfloat16())
    with pytest.raises(NotImplementedError, match="not proven on cuda float32 compiled with gradients"):
        raise FlexNotProvenError(flex_refusal(torch.device("cuda"), torch.float32, compiled=True, grad=True,
                                              seq_len=256, has_block_mask=True))  # shared-memory overflow
    assert flex_refusal(torch.device("cuda"), torch.bfloat16, compiled=True, grad=True, seq_len=256,
                        has_block_mask=True) is None  # fmt: skip
    assert ("cuda", torch.bfloat16, True, False) in FLEX_PROVEN  # the configuration of the original bug


@pytest.mark.parametrize("fullgraph", [True, False], ids=["fullgraph", "graph_breaks_allowed"])
def test_compiled_flex_refuses_a_length_off_the_block_grid(fullgraph: bool) -> None:
    """Tripwire: one compiled module, after recompiling for dynamic shapes, gave wrong numbers at T=100."""
    torch._dynamo.reset()
    _, flex = layer_pair("flex", "cpu", **SMALL)
    x = torch.randn(1, 100, 32)
    ctx = build_context(torch.zeros(1, 100, dtype=torch.long), block_mask=True)
    match = REFUSED[fullgraph] or "needs T to be a multiple of 128, got T=100"
    with torch.no_grad(), pytest.raises(RuntimeError, match=match):
        torch.compile(flex, fullgraph=fullgraph)(x, ctx=ctx)
    with torch.no_grad():  # eager flex masks partial blocks itself
        assert torch.isfinite(flex(x, ctx=ctx)).all()


def _with_impl(layer: MultiLatentAttention, impl: str) -> MultiLatentAttention:
    """A layer of the same weights with attn_impl `impl`."""
    other = MultiLatentAttention(dataclasses.replace(layer.config, attn_impl=impl))
    other.load_state_dict(layer.state_dict())
    return other.to(layer.w_o.weight.device, layer.w_o.weight.dtype)


def test_auto_attention_is_the_default_and_runs_sdpa_on_a_cpu() -> None:
    """attn_impl='auto' (MLAConfig's default) on a CPU is sdpa, bit for bit, with gradients (flex has no CPU
    backward); it asks for no block mask there, and would on a GPU."""
    from megacpp_lab.model.config import hybrid_preset
    from megacpp_lab.model.hybrid import HybridLM

    assert MLAConfig.build(**SMALL).attn_impl == "auto"
    sdpa, _ = layer_pair("flex", "cpu", **SMALL)
    auto = _with_impl(sdpa, "auto")
    assert not auto.attends_through_flex(torch.device("cpu")) and auto.attends_through_flex(torch.device("cuda"))
    assert not sdpa.attends_through_flex(torch.device("cuda"))
    doc_ids = torch.tensor([[0] * 6 + [1] * 10, [0] * 3 + [1] * 4 + [2] * 9])
    x = torch.randn(2, 16, 32, requires_grad=True)
    for ctx in (build_context(doc_ids), None):
        y_auto, y_ref = auto(x, ctx=ctx), sdpa(x, ctx=ctx)
        torch.testing.assert_close(y_auto, y_ref, atol=0, rtol=0)
        g_auto, g_ref = (torch.autograd.grad(y.square().sum(), x)[0] for y in (y_auto, y_ref))
        torch.testing.assert_close(g_auto, g_ref, atol=0, rtol=0)
    model = HybridLM(hybrid_preset("tiny", m2rnn=dict(kernel="reference")))
    assert model.config.mla.attn_impl == "auto" and not model.needs_block_mask  # a CPU model: sdpa, no mask


def test_context_and_block_mask_mismatches_fail_closed() -> None:
    sdpa, flex = layer_pair("flex", "cpu", **SMALL)
    x = torch.randn(2, 16, 32)
    with torch.no_grad():
        with pytest.raises(ValueError, match="ctx is for \\[B,T\\] = \\(2, 32\\), the input is \\(2, 16\\)"):
            flex(x, ctx=build_context(torch.zeros(2, 32, dtype=torch.long), block_mask=True))
        with pytest.raises(ValueError, match="ctx is for \\[B,T\\] = \\(1, 16\\), the input is \\(2, 16\\)"):
            flex(x, ctx=build_context(torch.zeros(1, 16, dtype=torch.long), block_mask=True))  # no broadcast
        with pytest.raises(TypeError, match="ctx must be a PackedContext"):  # a bare block mask is no context
            flex(x, ctx=doc_causal_block_mask(None, batch=2, seq_len=16))
        # sdpa reads the context's doc_ids; a block mask it carries for flex changes nothing
        doc_ids = torch.tensor([[0] * 6 + [1] * 10, [0] * 3 + [1] * 4 + [2] * 9])
        ref = sdpa(x, ctx=build_context(doc_ids))
        torch.testing.assert_close(sdpa(x, ctx=build_context(doc_ids, block_mask=True)), ref, atol=0, rtol=0)
    with pytest.raises(ValueError, match="doc_ids must be \\[B, T\\]"):
        doc_causal_block_mask(torch.zeros(16, dtype=torch.long))


# ----------------------------------------------------------------------------- CUDA, real-shaped layer


@pytest.mark.cuda
@pytest.mark.parametrize("grad", [False, True], ids=["no_grad", "grad"])
@pytest.mark.parametrize("T", [256, 1024, 2048])
@pytest.mark.parametrize("B", [1, 2, 4])
def test_cuda_compiled_flex_equals_eager_sdpa(B: int, T: int, grad: bool) -> None:
    """B in {1, 2, 4} x T in {256, 1024, 2048}, each shape compiled on its own (static shapes), bf16; on an sm90
    GPU with FLEX_KERNEL_OPTIONS's launch options for REAL's head dims (192, 128)."""
    if torch.cuda.get_device_capability() == (9, 0):
        assert flex_kernel_options(torch.device("cuda"), torch.bfloat16, REAL["d_nope"] + REAL["d_rope"], REAL["d_v"])
    torch._dynamo.reset()
    sdpa, flex = layer_pair("flex", "cuda", torch.bfloat16, **REAL)
    compiled = torch.compile(flex, fullgraph=True, dynamic=False)
    check_against_sdpa(compiled, sdpa, B, T, grad, seed=B * 10_000 + T)


@pytest.mark.cuda
@pytest.mark.parametrize("grad", [False, True], ids=["no_grad", "grad"])
def test_cuda_compiled_flex_one_module_across_shapes_and_document_counts(grad: bool) -> None:
    """One compiled layer fed shapes no test names, as a user's loop would (dynamo may go dynamic)."""
    torch._dynamo.reset()
    sdpa, flex = layer_pair("flex", "cuda", torch.bfloat16, **REAL)
    compiled = torch.compile(flex, fullgraph=True)
    check_across_shapes(compiled, sdpa, [(3, 640), (1, 4096), (4, 256), (2, 1152), (8, 512), (5, 384), (2, 128), (6, 2816)],
                        grad)  # fmt: skip


@pytest.mark.cuda
@pytest.mark.parametrize("grad", [False, True], ids=["no_grad", "grad"])
def test_cuda_eager_flex_fp32_equals_eager_sdpa(grad: bool) -> None:
    sdpa, flex = layer_pair("flex", "cuda", torch.float32, **REAL)
    check_against_sdpa(flex, sdpa, 2, 512, grad, seed=7, dtype=torch.float32)


@pytest.mark.cuda
def test_cuda_compiled_flex_fp32_is_refused() -> None:
    """At this layer's head dim (192) inductor's fp32 flex kernel needs 273 KiB of shared memory (H100: 227 KiB)."""
    torch._dynamo.reset()
    _, flex = layer_pair("flex", "cuda", torch.float32, **REAL)
    x = torch.randn(1, 256, REAL["d_model"], device="cuda")
    ctx = build_context(torch.zeros(1, 256, dtype=torch.long, device="cuda"), block_mask=True)
    for fullgraph in (True, False):
        torch._dynamo.reset()
        match = REFUSED[fullgraph] or "not proven on cuda float32 compiled without gradients"
        with torch.no_grad(), pytest.raises(RuntimeError, match=match):
            torch.compile(flex, fullgraph=fullgraph)(x, ctx=ctx)


@pytest.mark.cuda
@pytest.mark.parametrize("grad", [False, True], ids=["no_grad", "grad"])
def test_cuda_eager_flex_bf16_equals_eager_sdpa(grad: bool) -> None:
    sdpa, flex = layer_pair("flex", "cuda", torch.bfloat16, **REAL)
    check_against_sdpa(flex, sdpa, 2, 512, grad, seed=11)


@pytest.mark.cuda
@pytest.mark.parametrize("grad", [False, True], ids=["no_grad", "grad"])
def test_cuda_auto_attention_runs_flex_over_documents_and_sdpa_elsewhere(grad: bool) -> None:
    """attn_impl='auto' on a GPU: compiled bf16 over a batch's documents it is flex (the same numbers as the flex
    layer, bit for bit); eager, or with no context, it is sdpa; compiled fp32 or off the block grid (unproven for
    flex, which refuses both) it is sdpa. Never varlen (MLAConfig.attn_impl says why)."""
    torch._dynamo.reset()
    sdpa, flex = layer_pair("flex", "cuda", torch.bfloat16, **REAL)
    auto = _with_impl(flex, "auto")
    T = 1024
    x = torch.randn(2, T, REAL["d_model"], device="cuda", dtype=torch.bfloat16, requires_grad=grad)
    ctx = build_context(packed_doc_ids(2, T, "cuda", 1), block_mask=True)
    with torch.set_grad_enabled(grad):
        y_auto = torch.compile(auto, fullgraph=True)(x, ctx=ctx)
        y_flex = torch.compile(flex, fullgraph=True)(x, ctx=ctx)
        torch.testing.assert_close(y_auto, y_flex, atol=0, rtol=0)
        torch.testing.assert_close(auto(x), sdpa(x), atol=0, rtol=0)  # one causal document a row: sdpa
        torch.testing.assert_close(auto(x, ctx=ctx), sdpa(x, ctx=ctx), atol=0, rtol=0)  # eager: sdpa
    check_against_sdpa(torch.compile(auto, fullgraph=True), sdpa, 2, T, grad, seed=2)
    sdpa32, auto32 = sdpa.float(), auto.float()
    x32 = torch.randn(1, 256, REAL["d_model"], device="cuda")
    ctx32 = build_context(packed_doc_ids(1, 256, "cuda", 3), block_mask=True)
    with torch.set_grad_enabled(grad):
        torch.testing.assert_close(torch.compile(auto32, fullgraph=True)(x32, ctx=ctx32), sdpa32(x32, ctx=ctx32),
                                   atol=1e-4, rtol=1e-4)  # fmt: skip
    sdpa, auto = sdpa.bfloat16(), auto.bfloat16()  # off the block grid (T=200): sdpa, where flex itself refuses
    ctx_off = build_context(packed_doc_ids(1, 200, "cuda", 4), block_mask=True)
    x_off = torch.randn(1, 200, REAL["d_model"], device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        torch.testing.assert_close(torch.compile(auto, fullgraph=True)(x_off, ctx=ctx_off), sdpa(x_off, ctx=ctx_off),
                                   atol=2e-2, rtol=2e-2)  # fmt: skip
        with pytest.raises(RuntimeError, match=REFUSED[True]):
            torch.compile(flex, fullgraph=True)(x_off, ctx=ctx_off)


def test_needs_block_mask_sees_attention_through_wrapped_blocks() -> None:
    """needs_block_mask asks every attention layer of the model, found among its modules: a block swapped for a
    wrapper (bench profile's _Outside, a checkpoint wrapper) still answers, and a model without flex asks none."""
    from megacpp_lab.bench.profile import _Outside
    from megacpp_lab.model.config import hybrid_preset
    from megacpp_lab.model.hybrid import HybridLM

    for impl, wanted in (("flex", True), ("sdpa", False)):
        model = HybridLM(hybrid_preset("tiny", mla=dict(attn_impl=impl), m2rnn=dict(kernel="reference")))
        assert model.needs_block_mask is wanted
        for i, block in enumerate(list(model.blocks)):
            model.blocks[i] = _Outside(block)
        assert model.needs_block_mask is wanted, impl
