"""DSA's fast path (kernels/dsa_sparse.py, the flex path of nn/dsa.py) against its references: the Triton selection
against a stable sort (documents, ties, -0.0, top_k on either side of a document's length), the fused KL and its
gradient against the materialised probabilities, flex's log-sum-exp base, the flex layer against the reference
layer in both phases, the leak harness on a model whose DSA layer takes the flex path, and the refusals. CPU runs
the kernels under TRITON_INTERPRET=1 at small fp32 shapes; the cuda tests run them at real shapes, compiled, with
gradients."""

from __future__ import annotations

import pytest
import torch
from torch.nn.attention.flex_attention import AuxRequest, flex_attention

from megacpp_lab.kernels.dsa_sparse import (
    select_thresholds,
    select_thresholds_reference,
    selection_from_thresholds,
    sparse_kl,
    sparse_kl_reference,
)
from megacpp_lab.model.config import hybrid_preset
from megacpp_lab.model.hybrid import HybridLM
from megacpp_lab.nn.dsa import DSAConfig, document_starts, selection_score_mod, set_dsa_phase
from megacpp_lab.nn.mla import FlexNotProvenError, MLAConfig, MultiLatentAttention
from megacpp_lab.testing import model_leak_report, wake_zero_initialised
from megacpp_lab.varlen import build_context, doc_causal_block_mask, doc_ids_from_cu_seqlens, packed_cu_seqlens

# the kernels run on the GPU where there is one (CUDA tensors), else under the interpreter (CPU tensors)
DEV = "cuda" if torch.cuda.is_available() else "cpu"
MLA = dict(d_model=64, n_heads=2, q_lora_rank=32, kv_lora_rank=32, d_nope=16, d_rope=16, d_v=16, max_positions=512,
           rope_impl="reference")  # fmt: skip


def _layout(B: int, T: int, docs: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    doc_ids = doc_ids_from_cu_seqlens(packed_cu_seqlens(B, T, docs, torch.Generator().manual_seed(seed)), B, T)
    return doc_ids, document_starts(doc_ids, None, B, T, torch.device("cpu"))


def _tied_scores(B: int, T: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    scores = torch.randn(B, T, T, generator=g)
    scores[:, ::3] = scores[:, ::3].round()  # many ties
    scores[0, T // 2] = 0.0  # a row of ties only
    scores[-1, -1, ::2] = -0.0  # -0.0 ties +0.0, as float compares say
    return scores


@pytest.mark.parametrize(("B", "T", "docs", "top_k"), [(2, 40, 3, 1), (2, 40, 3, 5), (1, 70, 1, 16), (3, 33, 5, 64)])
def test_the_triton_selection_is_the_stable_sorts(B, T, docs, top_k):
    doc_ids, starts = _layout(B, T, docs, seed=T + top_k)
    scores = _tied_scores(B, T, seed=top_k)
    doc_ids, starts, scores = doc_ids.to(DEV), starts.to(DEV), scores.to(DEV)
    ref = select_thresholds_reference(scores, starts, top_k)
    got = select_thresholds(scores, starts, top_k)
    mask = selection_from_thresholds(scores, starts, *got)
    assert torch.equal(mask, selection_from_thresholds(scores, starts, *ref))
    allowed = (torch.arange(T, device=DEV) - starts + 1)  # each query's allowed keys
    assert torch.equal(mask.sum(-1), allowed.clamp(max=top_k))  # exactly top_k kept, ties or not
    for b, t in ((0, T // 2), (B - 1, T - 1)):  # ties go to the lower index
        kept = mask[b, t].nonzero().flatten()
        if allowed[b, t] > top_k:
            dropped = [s for s in range(int(starts[b, t]), t + 1) if not mask[b, t, s]]
            for s in dropped:  # every kept key outranks it: a higher score, or the same score at a lower index
                assert all(scores[b, t, s] < scores[b, t, r] or (scores[b, t, s] == scores[b, t, r] and s > r)
                           for r in kept.tolist())
    assert bool((mask & (doc_ids[:, :, None] != doc_ids[:, None, :])).any()) is False  # never another document
    assert bool(mask.triu(1).any()) is False  # never the future


@pytest.mark.parametrize(("H", "top_k"), [(1, 3), (2, 7), (3, 200)])
def test_the_fused_kl_and_its_gradient_are_the_materialised_ones(H, top_k):
    B, T, scale = 2, 48, 0.3
    _, starts = _layout(B, T, 4, seed=H)
    g = torch.Generator().manual_seed(H)
    q, k = torch.randn(B, T, H, 32, generator=g).to(DEV), torch.randn(B, T, H, 32, generator=g).to(DEV)
    scores, starts = torch.randn(B, T, T, generator=g).to(DEV), starts.to(DEV)
    thr, cut = select_thresholds(scores, starts, top_k)
    sel = selection_from_thresholds(scores, starts, thr, cut)
    s = torch.einsum("bthd,bshd->bhts", q, k) * scale
    lse = torch.logsumexp(s.masked_fill(~sel[:, None], float("-inf")), -1)  # the attention over the selection
    mine, ref = scores.clone().requires_grad_(True), scores.clone().requires_grad_(True)
    kl = sparse_kl(q, k, lse, mine, starts, thr, cut, scale, 16)
    kl_ref = sparse_kl_reference(q, k, lse, ref, sel, scale)
    torch.testing.assert_close(kl, kl_ref, rtol=1e-5, atol=2e-6)
    assert kl_ref.max() > 1e-2  # random scores are far from the attention
    w = torch.randn(B, T, generator=g).to(DEV)
    (kl * w).sum().backward()
    (kl_ref * w).sum().backward()
    torch.testing.assert_close(mine.grad, ref.grad, rtol=1e-5, atol=1e-6)
    assert not bool(mine.grad.masked_select(~sel).any())  # unselected keys get no gradient


def test_flex_returns_a_natural_log_sum_exp_over_the_documents_and_the_selection():
    B, T = 2, 160  # two flex blocks: the block structure is walked, not one tile
    doc_ids, starts = _layout(B, T, 3, seed=9)
    g = torch.Generator().manual_seed(9)
    q, k, v = (torch.randn(B, 2, T, d, generator=g).to(DEV) for d in (32, 32, 16))
    scores, starts, doc_ids = torch.randn(B, T, T, generator=g).to(DEV), starts.to(DEV), doc_ids.to(DEV)
    thr, cut = select_thresholds_reference(scores, starts, 9)  # the selection is the other tests'
    sel = selection_from_thresholds(scores, starts, thr, cut)
    with torch.no_grad():
        out, aux = flex_attention(q, k, v, score_mod=selection_score_mod(scores, thr, cut),
                                  block_mask=doc_causal_block_mask(doc_ids), scale=0.3, return_aux=AuxRequest(lse=True))
    lse = aux.lse
    s = (torch.einsum("bhtd,bhsd->bhts", q, k) * 0.3).masked_fill(~sel[:, None], float("-inf"))
    torch.testing.assert_close(lse, torch.logsumexp(s, -1), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out, torch.softmax(s, -1) @ v, rtol=1e-5, atol=1e-5)


def _pair(top_k: int, seed: int = 0) -> tuple[MultiLatentAttention, MultiLatentAttention]:
    cfg = MLAConfig.build(**MLA)
    torch.manual_seed(seed)
    fast = MultiLatentAttention(cfg, dsa=DSAConfig.build(d_model=64, n_heads=2, head_dim=16, top_k=top_k, attn_impl="flex"))
    ref = MultiLatentAttention(cfg, dsa=DSAConfig.build(d_model=64, n_heads=2, head_dim=16, top_k=top_k, attn_impl="reference"))
    ref.load_state_dict(fast.state_dict())
    return fast.eval(), ref.eval()


@pytest.mark.parametrize("top_k", [2, 40, 1000])
def test_the_flex_layer_is_the_reference_layer_in_both_phases(top_k):
    doc_ids, _ = _layout(2, 160, 4, seed=top_k)
    ctx = build_context(doc_ids).to(DEV)
    x = torch.randn(2, 160, 64, generator=torch.Generator().manual_seed(top_k)).to(DEV)
    fast, ref = (m.to(DEV) for m in _pair(top_k))
    outs = {}
    for phase in ("sparse", "warmup"):
        set_dsa_phase(fast, phase), set_dsa_phase(ref, phase)
        with torch.no_grad():  # flex has no CPU backward: the gradients are the cuda tests'
            outs[phase] = fast(x, ctx=ctx)
            torch.testing.assert_close(outs[phase], ref(x, ctx=ctx), rtol=1e-5, atol=1e-5)
    if top_k < 160:  # the sparse phase attends fewer keys than the warm-up: another output
        assert (outs["sparse"] - outs["warmup"]).abs().max() > 1e-3


def test_a_model_whose_dsa_layer_takes_the_flex_path_keeps_documents_apart_and_is_causal():
    from megacpp_lab.data import boundary_windows, load_sample

    V = 512
    w = boundary_windows(load_sample(tokenizer="bpe")[0].batch, 2, 24, lead=9)
    tokens, doc_ids = w.tokens.long() % V, w.doc_ids
    torch.manual_seed(0)
    cfg = hybrid_preset("tiny", m2rnn=dict(kernel="reference"), lm_head=dict(loss_impl="eager"), pattern="AM",
                        n_layers=2, engram_layers=(), dsa_layers=(0,), dsa=dict(top_k=3, attn_impl="flex"))  # fmt: skip
    model = wake_zero_initialised(HybridLM(cfg).eval()).to(DEV)
    with torch.no_grad():
        report = model_leak_report(model, tokens.to(DEV), doc_ids.to(DEV), vocab_size=V, causal_positions=range(0, 24, 3))
    assert report.passed, str(report)


def test_refusals_name_the_field_or_the_path():
    fast, _ = _pair(4)
    fast.train()
    x = torch.randn(1, 24, 64, requires_grad=True)
    with pytest.raises(FlexNotProvenError, match=r"DSA layer's flex path.*DSAConfig\.attn_impl='reference'"):
        fast(x)  # flex has no CPU backward: refused, never run densely (a CPU layer, on any machine)
    with pytest.raises(ValueError, match=r"DSAConfig\.attn_impl"):
        DSAConfig.build(d_model=64, attn_impl="dense")
    with pytest.raises(ValueError, match=r"MLAConfig\.d_nope.*power of two"):
        MultiLatentAttention(MLAConfig.build(**{**MLA, "d_nope": 24}), dsa=DSAConfig.build(d_model=64, head_dim=16))
    MultiLatentAttention(MLAConfig.build(**{**MLA, "d_nope": 24}), dsa=DSAConfig.build(d_model=64, head_dim=16,
                                                                                        attn_impl="reference"))  # fmt: skip
    scores, starts = torch.randn(1, 8, 8, device=DEV), torch.zeros(1, 8, dtype=torch.int32, device=DEV)
    with pytest.raises(ValueError, match="scores must be float32"):
        select_thresholds(scores.half(), starts, 2)
    with pytest.raises(ValueError, match="starts must be"):
        select_thresholds(scores, starts[:, :4], 2)
    q = torch.randn(1, 8, 1, 40, device=DEV)
    with pytest.raises(ValueError, match="d_rope must be a power of two"):
        sparse_kl(q, q, torch.zeros(1, 1, 8, device=DEV), scores, starts, torch.zeros(1, 8, device=DEV),
                  torch.zeros(1, 8, dtype=torch.int32, device=DEV), 0.1, 16)


# ----------------------------------------------------------------------------- cuda: real shapes


@pytest.mark.cuda
@pytest.mark.parametrize(("T", "docs", "top_k"), [(4096, 8, 256), (2048, 1, 2048), (3072, 3, 100)])
def test_cuda_selection_matches_the_sort_at_real_shapes(T, docs, top_k):
    doc_ids, starts = _layout(2, T, docs, seed=docs)
    scores = _tied_scores(2, T, seed=docs).cuda()
    starts = starts.cuda()
    got = selection_from_thresholds(scores, starts, *select_thresholds(scores, starts, top_k))
    ref = selection_from_thresholds(scores, starts, *select_thresholds_reference(scores, starts, top_k))
    assert torch.equal(got, ref)


@pytest.mark.cuda
@pytest.mark.parametrize("compiled", [False, True])
def test_cuda_flex_layer_forward_and_backward_match_the_reference(compiled):
    """bf16 at T=1024 over 5 documents: the flex path (compiled or not) against the reference path with the same
    weights on the same bf16 input (the same Triton indexer scores, so the same selection): outputs, the input's
    gradient and the indexer's gradient (its KL), in both phases."""
    B, T = 2, 1024
    doc_ids, _ = _layout(B, T, 5, seed=11)
    ctx = build_context(doc_ids).to("cuda").with_block_mask()  # built outside the compiled layer, as HybridLM does
    cfg = MLAConfig.build(d_model=256, n_heads=4, q_lora_rank=128, kv_lora_rank=64, d_nope=64, d_rope=32, d_v=64,
                          max_positions=T)  # fmt: skip
    torch.manual_seed(0)
    dsa = dict(d_model=256, n_heads=2, head_dim=32, top_k=96, score_impl="triton")
    fast = MultiLatentAttention(cfg, dsa=DSAConfig.build(**dsa, attn_impl="flex")).cuda().bfloat16().train()
    ref = MultiLatentAttention(cfg, dsa=DSAConfig.build(**dsa, attn_impl="reference")).cuda().bfloat16().train()
    ref.load_state_dict(fast.state_dict())
    run = torch.compile(fast, fullgraph=True) if compiled else fast
    x = torch.randn(B, T, 256, device="cuda", generator=torch.Generator("cuda").manual_seed(1)).bfloat16()
    for phase in ("sparse", "warmup"):
        set_dsa_phase(fast, phase), set_dsa_phase(ref, phase)
        fast.zero_grad(), ref.zero_grad()
        grads = []
        for layer, module in ((run, fast), (ref, ref)):
            xi = x.clone().requires_grad_(True)
            out = layer(xi, ctx=ctx)
            out.float().square().mean().backward()
            grads.append((out.float(), xi.grad.float(), {n: p.grad.float() for n, p in module.indexer.named_parameters()}))
        (out, gx, gi), (ref_out, ref_gx, ref_gi) = grads
        assert (out - ref_out).abs().max() < 2e-2 * ref_out.abs().max(), phase
        assert (gx - ref_gx).norm() < 3e-2 * ref_gx.norm(), phase
        for name, g in ref_gi.items():
            assert g.norm() > 0 and (gi[name] - g).norm() < 5e-2 * g.norm(), (phase, name)
