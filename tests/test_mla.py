"""MLA: config, training path (rope kernels vs reference, recompute flags, fused projections, leak
harness, compile boundary), the packed context path, the compressed KV cache and decode."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from megacpp_lab.data import boundary_windows, load_sample
from megacpp_lab.nn.mla import MLAConfig, MLAKVCache, MultiLatentAttention, cache_bytes_per_token
from megacpp_lab.testing import check_leaks, no_host_reads, with_doc_ids
from megacpp_lab.varlen import PackedContext, build_context

DEV = "cuda" if torch.cuda.is_available() else "cpu"
SMALL = dict(d_model=32, n_heads=2, q_lora_rank=16, kv_lora_rank=16, d_nope=8, d_rope=8, d_v=8, max_positions=64)


def _layer(**kw) -> MultiLatentAttention:
    torch.manual_seed(0)
    return MultiLatentAttention(MLAConfig.build(**{**SMALL, "attn_impl": "sdpa", **kw})).to(DEV)  # sdpa: the reference


def _grads(layer: nn.Module, x: torch.Tensor, **kw) -> tuple[torch.Tensor, list[torch.Tensor]]:
    x = x.clone().requires_grad_()
    y = layer(x, **kw)
    y.square().sum().backward()
    grads = [x.grad] + [p.grad.clone() for p in layer.parameters()]
    layer.zero_grad()
    return y.detach(), grads


def test_config_fails_closed_naming_the_field() -> None:
    for bad, name in ((dict(d_rope=7), "d_rope"), (dict(n_heads=0), "n_heads"), (dict(rope_impl="cuda"), "rope_impl"),
                      (dict(attn_impl="fa9"), "attn_impl"), (dict(recompute_kv_upproj=1), "recompute_kv_upproj")):  # fmt: skip
        with pytest.raises(ValueError, match=f"MLAConfig.{name}"):
            MLAConfig.build(**{**SMALL, **bad})
    with pytest.raises(ValueError, match="no field"):
        MLAConfig.build(**SMALL, kv_rank=3)

    class Megatron:
        hidden_size, num_attention_heads, qk_head_dim, qk_pos_emb_head_dim, v_head_dim = 64, 4, 16, 8, 16

    c = MLAConfig.build(Megatron(), q_lora_rank=8)
    assert (c.d_model, c.n_heads, c.d_nope, c.d_rope, c.d_v) == (64, 4, 16, 8, 16)


@pytest.mark.parametrize("doc", [False, True])
def test_triton_rope_path_equals_reference_forward_and_backward(doc: bool) -> None:
    x = torch.randn(2, 24, 32, device=DEV)
    kw = {"ctx": build_context(torch.tensor([[0] * 10 + [1] * 14, [0] * 24], device=DEV))} if doc else {}
    y_ref, g_ref = _grads(_layer(rope_impl="reference"), x, **kw)
    y_tri, g_tri = _grads(_layer(rope_impl="triton"), x, **kw)
    torch.testing.assert_close(y_tri, y_ref, atol=1e-5, rtol=1e-5)
    for a, b in zip(g_tri, g_ref):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("flags", [dict(recompute_kv_upproj=False), dict(recompute_q_upproj=True),
                                   dict(recompute_kv_upproj=False, recompute_q_upproj=True), dict(kv_fused_down_norm_up=True)])  # fmt: skip
def test_recompute_and_fusion_flags_change_no_numbers(flags: dict) -> None:
    x = torch.randn(2, 16, 32, device=DEV)
    y0, g0 = _grads(_layer(rope_impl="triton"), x)
    y1, g1 = _grads(_layer(rope_impl="triton", **flags), x)
    torch.testing.assert_close(y1, y0, atol=1e-5, rtol=1e-5)
    for a, b in zip(g1, g0):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


def test_fused_down_proj_equals_separate_matmuls() -> None:
    sep, fused = _layer(), _layer(fused_down_proj=True)
    with torch.no_grad():
        fused.w_dqkv.weight.copy_(torch.cat((sep.w_dq.weight, sep.w_dkv.weight)))
        for name in ("w_uq", "w_ukv", "w_o", "q_norm", "kv_norm"):
            getattr(fused, name).load_state_dict(getattr(sep, name).state_dict())
    x = torch.randn(1, 12, 32, device=DEV)
    torch.testing.assert_close(fused(x), sep(x), atol=1e-5, rtol=1e-5)
    fk = _layer(fused_down_proj=True, kv_fused_down_norm_up=True)
    fk.load_state_dict(fused.state_dict())
    torch.testing.assert_close(fk(x), fused(x), atol=1e-5, rtol=1e-5)


def test_layer_passes_the_leak_harness_on_real_packed_rows() -> None:
    w = boundary_windows(load_sample()[0].batch, 2, 24, lead=9)
    torch.manual_seed(0)
    emb = nn.Embedding(259, 32).to(DEV)
    layer = _layer(rope_impl="triton").eval()
    tokens, doc_ids = w.tokens.to(DEV), w.doc_ids.to(DEV)
    assert torch.equal(build_context(doc_ids).positions, w.positions.to(DEV))  # the batch's own positions
    mixer = with_doc_ids(layer)  # layer(x, ctx=build_context(doc_ids))
    report = check_leaks(lambda t, d: mixer(emb(t), d), tokens, doc_ids, vocab_size=259, causal_positions=range(0, 24, 4))
    assert report.passed, str(report)
    leaky = check_leaks(lambda t, d: layer(emb(t)), tokens, doc_ids, vocab_size=259, causal=False)
    assert not leaky.passed  # without the context the next document attends to the previous one


@pytest.mark.parametrize("packed", [False, True], ids=["no_ctx", "ctx"])
def test_compiled_layer_has_no_graph_break(packed: bool) -> None:
    import torch._dynamo.testing

    layer = _layer(rope_impl="triton")
    counter = torch._dynamo.testing.CompileCounter()
    compiled = torch.compile(layer, backend=counter, fullgraph=True)
    x = torch.randn(2, 16, 32, device=DEV, requires_grad=True)
    ctx = build_context(torch.tensor([[0] * 6 + [1] * 10] * 2, device=DEV)) if packed else None
    y = compiled(x, ctx=ctx)
    torch.testing.assert_close(y, layer(x, ctx=ctx), atol=1e-5, rtol=1e-5)
    y.sum().backward()
    assert counter.frame_count == 1


# ----------------------------------------------------------------------------- the packed context (ctx=)

PACKED = [[0] * 5 + [1] * 4 + [2] * 7, [0] * 3 + [1] * 13]  # two rows, five documents


def _ctx(doc_ids: list[list[int]]) -> PackedContext:
    return build_context(torch.tensor(doc_ids, device=DEV))


def _per_document(layer: nn.Module, x: torch.Tensor, rows: list[list[int]]) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """_grads of the packed rows with each document run alone (ctx=None: RoPE from 0, causal) and stitched
    back: outputs and input grads in place, weight grads summed over the documents."""
    y_doc, g_doc = torch.zeros_like(x), [torch.zeros_like(x)] + [torch.zeros_like(p) for p in layer.parameters()]
    for b, row in enumerate(rows):
        for d in dict.fromkeys(row):
            s, e = row.index(d), len(row) - row[::-1].index(d)
            y, (gx, *gp) = _grads(layer, x[b : b + 1, s:e])
            y_doc[b, s:e], g_doc[0][b, s:e] = y[0], gx[0]
            for acc, g in zip(g_doc[1:], gp):
                acc += g
    return y_doc, g_doc


@pytest.mark.parametrize("rope_impl", ["triton", "reference"])
@pytest.mark.parametrize("flags", [dict(), dict(recompute_kv_upproj=False, recompute_q_upproj=True)], ids=["default", "recompute_q"])
def test_context_path_equals_per_document_runs_forward_and_backward(rope_impl: str, flags: dict) -> None:
    ctx = _ctx(PACKED)
    x = torch.randn(2, 16, 32, device=DEV)
    y_doc, g_doc = _per_document(_layer(rope_impl=rope_impl, **flags), x, PACKED)
    y_ctx, g_ctx = _grads(_layer(rope_impl=rope_impl, **flags), x, ctx=ctx)
    torch.testing.assert_close(y_ctx, y_doc, atol=1e-5, rtol=1e-5)
    for a, b in zip(g_ctx, g_doc, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)
    y_ref, _ = _grads(_layer(rope_impl="reference", **flags), x, ctx=ctx)  # and the kernels' equal the reference's
    torch.testing.assert_close(y_ctx, y_ref, atol=1e-5, rtol=1e-5)


def test_context_reaches_the_kernels_packed_thd_path(monkeypatch) -> None:
    """With ctx the layer hands the context itself to both RoPE kernels (their packed thd path on its validated
    cu_seqlens), not positions to re-check."""
    import megacpp_lab.kernels.rope as R
    import megacpp_lab.nn.mla as M

    seen = []
    for name in ("mla_rope_q_", "mla_rope_kv"):
        real = getattr(R, name)
        monkeypatch.setattr(M, name, lambda *a, _real=real, _name=name, **kw: seen.append((_name, kw)) or _real(*a, **kw))
    ctx = _ctx(PACKED)
    _layer(rope_impl="triton")(torch.randn(2, 16, 32, device=DEV), ctx=ctx).sum().backward()
    assert {n for n, _ in seen} == {"mla_rope_q_", "mla_rope_kv"}
    assert all(kw["ctx"] is ctx and kw.get("positions") is None and kw.get("cu_seqlens") is None for _, kw in seen)


def test_context_path_reads_nothing_back_from_the_device_and_the_check_can_fail() -> None:
    ctx = _ctx(PACKED)
    x = torch.randn(2, 16, 32, device=DEV, requires_grad=True)
    for flags in (dict(), dict(recompute_kv_upproj=False, recompute_q_upproj=True, kv_fused_down_norm_up=True)):
        layer = _layer(rope_impl="triton", **flags)
        with no_host_reads():
            layer(x, ctx=ctx).square().sum().backward()
    # bare doc_ids (with_doc_ids) are validated on every call by build_context, on the host: the same detector
    # trips on that path, on either device
    with pytest.raises(AssertionError, match="host read on the validated path"), no_host_reads():
        with_doc_ids(layer)(x, ctx.doc_ids)


def test_flex_attention_through_the_context_equals_sdpa_and_per_document_runs() -> None:
    """attn_impl='flex' takes the context's block mask (built once with it), sdpa its doc_ids; both equal
    each document run alone."""
    ctx = build_context(torch.tensor(PACKED, device=DEV), block_mask=True)
    sdpa, flex = _layer(rope_impl="triton"), _layer(rope_impl="triton", attn_impl="flex")
    flex.load_state_dict(sdpa.state_dict())
    x = torch.randn(2, 16, 32, device=DEV)
    y_doc, _ = _per_document(sdpa, x, PACKED)
    with torch.no_grad():  # flex has no CPU backward (FLEX_PROVEN)
        torch.testing.assert_close(flex(x, ctx=ctx), sdpa(x, ctx=ctx), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(sdpa(x, ctx=ctx), y_doc, atol=1e-5, rtol=1e-5)


def test_context_path_fails_closed() -> None:
    ctx = _ctx(PACKED)
    layer, x = _layer(rope_impl="triton"), torch.randn(2, 16, 32, device=DEV)
    with pytest.raises(TypeError, match="ctx must be a PackedContext"):
        layer(x, ctx=ctx.doc_ids)
    with pytest.raises(TypeError, match="positional argument"):  # the old bare doc_ids call
        layer(x, ctx.doc_ids)
    with pytest.raises(ValueError, match=r"ctx is for \[B,T\] = \(2, 16\), the input is \(2, 12\)"):
        layer(torch.randn(2, 12, 32, device=DEV), ctx=ctx)
    with pytest.raises(ValueError, match="doc_ids go backwards at row 1, offset 3"):  # bad ids fail in build_context
        with_doc_ids(layer)(x, torch.tensor([[0] * 16, [0, 0, 1] + [0] * 13], device=DEV))


def test_compiled_layer_through_the_context_has_no_graph_break_and_one_graph_for_any_document_count() -> None:
    import torch._dynamo.testing

    torch._dynamo.reset()
    layer = _layer(rope_impl="triton")
    counter = torch._dynamo.testing.CompileCounter()
    compiled = torch.compile(layer, backend=counter, fullgraph=True)
    for doc_ids in (PACKED, [[0] * 16, [0] * 8 + [1] * 8], [[0] * 2 + [1] * 2 + [2] * 12, [0] * 3 + [1] * 4 + [2] * 4 + [3] * 5]):
        ctx = _ctx(doc_ids)
        # no mark here: build_context marks cu_seqlens dynamic (their length is the document count)
        x = torch.randn(2, 16, 32, device=DEV, requires_grad=True)
        y = compiled(x, ctx=ctx)
        torch.testing.assert_close(y, layer(x, ctx=ctx), atol=1e-5, rtol=1e-5)
        y.sum().backward()
    assert counter.frame_count == 1


def _stack(n_layers: int = 2, **kw) -> nn.ModuleList:
    torch.manual_seed(0)
    return nn.ModuleList(MultiLatentAttention(MLAConfig.build(**{**SMALL, **kw})) for _ in range(n_layers)).to(DEV).eval()


def _full_forward(layers: nn.ModuleList, x: torch.Tensor) -> torch.Tensor:
    for layer in layers:
        x = x + layer(x)
    return x


def _decode(layers: nn.ModuleList, x: torch.Tensor, *, absorbed: bool, per_layer_advance: bool = False,
            prefill: int = 0) -> torch.Tensor:  # fmt: skip
    c = layers[0].config
    max_len = x.shape[1] * (len(layers) if per_layer_advance else 1)  # room for the buggy advance's extra slots
    cache = MLAKVCache(len(layers), x.shape[0], max_len, c.kv_lora_rank, c.d_rope, dtype=torch.float32,
                       device=DEV, strict=not per_layer_advance)  # fmt: skip
    outs, t = [], 0
    for n in ([prefill] if prefill else []) + [1] * (x.shape[1] - prefill):
        h = x[:, t : t + n]
        for i, layer in enumerate(layers):
            h = h + layer.decode(h, cache, i, absorbed=absorbed)
            if per_layer_advance:
                cache.advance()
        if not per_layer_advance:
            cache.advance()
        outs.append(h)
        t += n
    return torch.cat(outs, dim=1)


@pytest.mark.parametrize("absorbed", [False, True])
@pytest.mark.parametrize("prefill", [0, 5])
def test_step_by_step_decode_equals_the_full_forward(absorbed: bool, prefill: int) -> None:
    layers = _stack()
    x = torch.randn(2, 12, 32, device=DEV)
    with torch.no_grad():
        torch.testing.assert_close(_decode(layers, x, absorbed=absorbed, prefill=prefill), _full_forward(layers, x),
                                   atol=1e-5, rtol=1e-5)  # fmt: skip


def test_absorbed_decode_equals_expanded() -> None:
    layers = _stack(1)
    x = torch.randn(2, 9, 32, device=DEV)
    with torch.no_grad():
        torch.testing.assert_close(_decode(layers, x, absorbed=True), _decode(layers, x, absorbed=False), atol=1e-5, rtol=1e-5)


def test_tripwire_per_layer_advance_corrupts_decode_and_strict_cache_refuses_it() -> None:
    layers = _stack(2)
    x = torch.randn(1, 8, 32, device=DEV)
    with torch.no_grad():
        full = _full_forward(layers, x)
        wrong = _decode(layers, x, absorbed=False, per_layer_advance=True)
    assert (wrong - full)[:, 1:].abs().max() > 1e-2  # later layers read slots that were never written
    cache = MLAKVCache(2, 1, 8, 16, 8, dtype=torch.float32, device=DEV)
    layers[0].decode(x[:, :1], cache, 0)
    with pytest.raises(ValueError, match="never per layer"):
        cache.advance()
    with pytest.raises(ValueError, match="already wrote"):
        layers[0].decode(x[:, :1], cache, 0)


def test_cache_fails_closed_on_overflow_and_shape() -> None:
    cache = MLAKVCache(1, 2, 4, 16, 8, dtype=torch.float32, device=DEV)
    with pytest.raises(ValueError, match="overflow"):
        cache.update(0, torch.zeros(2, 5, 16, device=DEV), torch.zeros(2, 5, 1, 8, device=DEV))
    with pytest.raises(ValueError, match="c_kv must be"):
        cache.update(0, torch.zeros(2, 1, 15, device=DEV), torch.zeros(2, 1, 1, 8, device=DEV))


def test_cache_bytes_per_token_against_mha() -> None:
    c = MLAConfig.build(d_model=4096, n_heads=32)
    got = cache_bytes_per_token(c)
    assert got == {"mla_bytes": 1152.0, "mha_bytes": 32 * 320 * 2.0, "ratio": 32 * 320 * 2 / 1152}
    assert MLAKVCache(1, 1, 2, 512, 64).nbytes_per_token() == 1152


@pytest.mark.cuda
def test_cuda_layer_bf16_triton_vs_reference_at_real_width() -> None:
    cfg = dict(d_model=1024, n_heads=16, q_lora_rank=384, kv_lora_rank=512, d_nope=128, d_rope=64, d_v=128, max_positions=2048)
    x = torch.randn(2, 1024, 1024, device="cuda", dtype=torch.bfloat16)
    doc_ids = torch.zeros(2, 1024, dtype=torch.long, device="cuda")
    doc_ids[:, 600:] = 1
    outs = []
    for impl in ("reference", "triton"):
        torch.manual_seed(0)
        layer = MultiLatentAttention(MLAConfig.build(**cfg, rope_impl=impl)).cuda().to(torch.bfloat16)
        outs.append(_grads(layer, x, ctx=build_context(doc_ids)))
    torch.testing.assert_close(outs[1][0], outs[0][0], atol=2e-2, rtol=2e-2)
    for a, b in zip(outs[1][1], outs[0][1]):
        assert (a.float() - b.float()).norm() <= 2e-2 * b.float().norm()


def test_rope_tables_stay_fp32_when_the_layer_is_cast() -> None:
    layer = _layer().to(torch.bfloat16)
    assert layer.rope_cos.dtype == torch.float32 and layer.rope_sin.dtype == torch.float32
    torch.testing.assert_close(layer.rope_cos, _layer().rope_cos)


def test_rope_tables_stay_fp32_under_apply_precision() -> None:
    """Tripwire: apply_precision sets tensors directly (no .to), so only the fp32 contract keeps the
    tables fp32. Without it the Triton RoPE refused the bf16 tables on the GPU ("cos must be contiguous
    float32") and the torch path rotated by rounded angles."""
    from megacpp_lab.model.precision import apply_precision, check_precision, fp32_contract

    layer = _layer()
    assert {"rope_cos", "rope_sin"} <= set(fp32_contract(layer))
    x, doc_ids = torch.randn(2, 16, 32, device=DEV), torch.zeros(2, 16, dtype=torch.long, device=DEV)
    doc_ids[:, 9:] = 1
    ctx = build_context(doc_ids)
    with torch.no_grad():
        y_fp32 = layer(x, ctx=ctx)
        plan = apply_precision(layer, torch.bfloat16)
        check_precision(layer, plan)
        assert layer.rope_cos.dtype == torch.float32 and layer.w_o.weight.dtype == torch.bfloat16
        torch.testing.assert_close(layer.rope_cos, _layer().rope_cos, atol=0, rtol=0)
        y = layer(x.bfloat16(), ctx=ctx)
    assert y.dtype == torch.bfloat16
    assert (y.float() - y_fp32).norm() <= 3e-2 * y_fp32.norm()
