"""DeepSeek Sparse Attention (nn/dsa.py) in the A layers: the selection against a brute-force top-k inside each
query's document, the layer equal to dense MLA when top_k covers every allowed key (and in its warm-up), the
indexer's KL loss and its gradient (the indexer's alone), the warm-up aligning the indexer to the attention, the
leak harness on a model with a DSA layer (and a planted cross-document selection that must fail it), compile,
and the refusals."""

from __future__ import annotations

import pytest
import torch

from megacpp_lab.model.config import hybrid_preset
from megacpp_lab.model.hybrid import HybridLM
from megacpp_lab.nn.dsa import DSAConfig, dsa_attention, indexer_kl, selection_mask, set_dsa_phase
from megacpp_lab.nn.mla import MLAConfig, MultiLatentAttention
from megacpp_lab.testing import model_leak_report, wake_zero_initialised
from megacpp_lab.varlen import build_context, doc_ids_from_cu_seqlens

V = 512
CPU = dict(m2rnn=dict(kernel="reference"), lm_head=dict(loss_impl="eager"))
MLA = dict(d_model=64, n_heads=2, q_lora_rank=32, kv_lora_rank=32, d_nope=16, d_rope=16, d_v=16, max_positions=256,
           rope_impl="reference")  # fmt: skip


def _doc_ids(B=2, T=24):
    cu = torch.tensor([0, 5, 6, 20, 24, 33, 48], dtype=torch.int32)  # a one-token document, one across rows
    return doc_ids_from_cu_seqlens(cu, B, T)


def _layers(top_k: int, seed: int = 0):
    """A DSA layer and a dense MLA layer with the same weights."""
    torch.manual_seed(seed)
    cfg = MLAConfig.build(**MLA)
    sparse = MultiLatentAttention(cfg, dsa=DSAConfig.build(d_model=64, n_heads=2, head_dim=16, top_k=top_k))
    dense = MultiLatentAttention(cfg)
    dense.load_state_dict({k: v for k, v in sparse.state_dict().items() if not k.startswith("indexer.")})
    return sparse, dense


@pytest.mark.parametrize("top_k", [1, 3, 7, 100])
def test_the_selection_is_each_querys_top_k_inside_its_document_and_past(top_k):
    doc_ids = _doc_ids()
    scores = torch.randn(2, 24, 24, generator=torch.Generator().manual_seed(top_k))
    mask = selection_mask(scores, top_k, doc_ids)
    for b in range(2):
        for t in range(24):
            allowed = [s for s in range(t + 1) if doc_ids[b, s] == doc_ids[b, t]]
            best = sorted(allowed, key=lambda s: -float(scores[b, t, s]))[:top_k]
            assert set(torch.nonzero(mask[b, t]).flatten().tolist()) == set(best)


def test_with_top_k_covering_every_key_the_layer_is_dense_mla_and_so_is_its_warmup():
    doc_ids = _doc_ids()
    ctx = build_context(doc_ids)
    x = torch.randn(2, 24, 64, generator=torch.Generator().manual_seed(1))
    sparse, dense = _layers(top_k=24)
    sparse.eval(), dense.eval()
    ref = dense(x, ctx=ctx)
    torch.testing.assert_close(sparse(x, ctx=ctx), ref, rtol=1e-5, atol=1e-5)
    few, _ = _layers(top_k=2)
    few.eval()
    set_dsa_phase(few, "warmup")  # the warm-up attends every allowed key, whatever top_k
    torch.testing.assert_close(few(x, ctx=ctx), ref, rtol=1e-5, atol=1e-5)
    set_dsa_phase(few, "sparse")
    assert (few(x, ctx=ctx) - ref).abs().max() > 1e-3  # two keys of up to 14: another output


def test_dsa_attention_attends_the_masked_keys_only():
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(1, 6, 2, 8, generator=g) for _ in range(3))
    mask = torch.zeros(1, 6, 6, dtype=torch.bool)
    mask[0, torch.arange(6), torch.arange(6)] = True  # each query its own key only
    mask[0, 5, 2] = True
    out, probs = dsa_attention(q, k, v, mask, scale=0.5)
    torch.testing.assert_close(out[0, :5], v[0, :5])  # one key: its value
    assert torch.equal(probs[0, :, 5] > 0, mask[0, 5].expand(2, 6))


def test_the_indexer_kl_is_zero_on_the_attention_itself_and_reaches_the_indexer_alone():
    g = torch.Generator().manual_seed(3)
    mask = torch.ones(2, 5, 5, dtype=torch.bool).tril()
    logits = torch.randn(2, 5, 5, generator=g)
    p = torch.softmax(logits.masked_fill(~mask, float("-inf")), -1)
    probs = torch.stack((p, p), 1) / 2  # two heads, alike
    assert indexer_kl(probs, logits, mask).abs() < 1e-6
    assert indexer_kl(probs, torch.randn(2, 5, 5, generator=g), mask) > 1e-3
    # the layer: the KL's gradient reaches the indexer's parameters and no other
    doc_ids = _doc_ids()
    ctx = build_context(doc_ids)
    x = torch.randn(2, 24, 64, generator=g, requires_grad=True)
    grads = {}
    for weight in (0.0, 1.0):
        layer, _ = _layers(top_k=4)
        layer.indexer.config = DSAConfig.build(d_model=64, n_heads=2, head_dim=16, top_k=4, loss_weight=weight)
        layer.train()
        layer(x, ctx=ctx).sum().backward()
        grads[weight] = {n: p.grad.clone() if p.grad is not None else None for n, p in layer.named_parameters()}
    for name, g0 in grads[0.0].items():
        if name.startswith("indexer."):
            assert g0 is None or g0.abs().sum() == 0  # detached inputs: no gradient but its own loss
            assert grads[1.0][name] is not None and grads[1.0][name].abs().sum() > 0
        else:
            torch.testing.assert_close(grads[1.0][name], g0)  # the language model never feels the KL


def test_the_warmup_aligns_the_indexer_with_the_attention():
    doc_ids = _doc_ids()
    ctx = build_context(doc_ids)
    layer, _ = _layers(top_k=4, seed=4)
    set_dsa_phase(layer, "warmup")
    opt = torch.optim.Adam(layer.indexer.parameters(), lr=3e-2)
    x = torch.randn(2, 24, 64, generator=torch.Generator().manual_seed(5))

    def kl() -> torch.Tensor:
        scores = layer.indexer(x, layer.down_proj(x)[0])
        mask = selection_mask(scores, 24, doc_ids)  # every allowed key
        q = layer.q_up_rope(layer.down_proj(x)[0], None, ctx=ctx)
        key, value = layer.kv_up_rope(x, *layer.down_proj(x)[1:], None, ctx=ctx)
        _, probs = dsa_attention(q, key, value, mask, 1 / 32**0.5)
        return indexer_kl(probs, scores, mask)

    before = float(kl().detach())
    for _ in range(40):
        opt.zero_grad()
        kl().backward()
        opt.step()
    after = float(kl().detach())
    assert after < 0.5 * before, (before, after)


@pytest.fixture(scope="module")
def window():
    from megacpp_lab.data import boundary_windows, load_sample

    w = boundary_windows(load_sample(tokenizer="bpe")[0].batch, 2, 24, lead=9)
    return w.tokens.long() % V, w.doc_ids


def _dsa_model(**overrides):
    torch.manual_seed(0)
    cfg = hybrid_preset("tiny", **{**CPU, "pattern": "AM", "n_layers": 2, "engram_layers": (), "dsa_layers": (0,),
                                   "dsa": dict(top_k=3), **overrides})  # fmt: skip
    return HybridLM(cfg).eval()


def test_a_model_with_a_dsa_layer_keeps_documents_apart_and_is_causal(window):
    tokens, doc_ids = window
    model = wake_zero_initialised(_dsa_model())
    report = model_leak_report(model, tokens, doc_ids, vocab_size=V, causal_positions=range(0, 24, 3))
    assert report.passed, str(report)


def test_a_selection_that_ignores_the_documents_fails_the_whole_model_check(window, monkeypatch):
    """The planted leak: the top-k picked over the whole row (the document mask dropped)."""
    tokens, doc_ids = window
    model = wake_zero_initialised(_dsa_model(dsa=dict(top_k=24)))
    row = torch.zeros_like(doc_ids)
    monkeypatch.setattr("megacpp_lab.nn.mla.selection_mask", lambda s, k, d: selection_mask(s, k, row))
    report = model_leak_report(model, tokens, doc_ids, vocab_size=V, causal=False)
    assert report.leaked and report.cross_doc.magnitude > report.tol, str(report)


def test_a_compiled_dsa_model_equals_eager_without_a_graph_break():
    from torch._dynamo.utils import counters

    from megacpp_lab.model.parallelize import ParallelConfig, parallelize, structure_keys

    doc_ids = _doc_ids()
    ctx = build_context(doc_ids)
    tokens = torch.randint(3, V, (2, 24), generator=torch.Generator().manual_seed(6))
    torch._dynamo.reset()
    counters.clear()
    eager = _dsa_model(pattern="A")
    compiled = parallelize(_dsa_model(pattern="A"), ParallelConfig(compile=True, backend="aot_eager", compile_workers=0,
                                                                   saved_graphs=False), device="cpu")  # fmt: skip
    assert structure_keys(compiled) == [("A", "dsa"), ("A",)]
    torch.testing.assert_close(compiled(tokens, ctx, return_logits=True).logits, eager(tokens, ctx, return_logits=True).logits)
    assert sum(counters["graph_break"].values()) == 0


def test_refusals_name_the_field():
    with pytest.raises(ValueError, match=r"HybridConfig\.dsa_layers.*A layers"):
        hybrid_preset("tiny", **CPU, dsa_layers=(1,))  # tiny's layer 1 is an M block
    for field, value in (("top_k", 0), ("warmup_steps", -1), ("loss_weight", float("inf")), ("score_impl", "cuda"),
                         ("head_dim", 48)):  # fmt: skip
        with pytest.raises(ValueError, match=rf"DSAConfig\.{field}"):
            DSAConfig.build(d_model=64, **{field: value})
    assert DSAConfig.build(d_model=64, head_dim=48, score_impl="reference").head_dim == 48  # the reference takes any
    layer, _ = _layers(top_k=4)
    with pytest.raises(ValueError, match="phase"):
        set_dsa_phase(layer, "dense")


def test_flops_count_a_dsa_layer_at_its_top_k_keys_plus_its_indexer():
    dense = HybridLM(hybrid_preset("tiny", **CPU, pattern="AM", n_layers=2, engram_layers=()))
    sparse = _dsa_model(dsa=dict(top_k=8, n_heads=2, head_dim=16))
    T = 1024
    mla = sparse.config.mla
    per_key = 3 * 2 * mla.n_heads * (mla.d_nope + mla.d_rope + mla.d_v)
    indexer_params = sum(p.numel() for p in sparse.blocks[0].mixer.indexer.parameters())
    expected = dense.flops_per_token(T)["A"] - per_key * (T // 2 - 8) + 3 * 2 * 2 * 16 * T // 2 + 6 * indexer_params
    assert sparse.flops_per_token(T)["A"] == expected
    # per document: each query min(i, top_k) keys, the indexer every causal key of its document
    lens = [8, 100, 916]
    causal = sum(n * (n + 1) // 2 for n in lens) / T
    picked = sum(min(n, 8) * (min(n, 8) + 1) // 2 + (n - min(n, 8)) * 8 for n in lens) / T
    expected = (dense.flops_per_token(T, doc_lens=lens)["A"] - round(per_key * causal) + round(per_key * picked
                + 3 * 2 * 2 * 16 * causal) + 6 * indexer_params)  # fmt: skip
    assert sparse.flops_per_token(T, doc_lens=lens)["A"] == expected


def test_a_compiled_dsa_model_trains_through_its_phase_switch_within_the_graphs_it_counts():
    """The warm-up's graph, then the sparse phase's, with and without gradients: graphs_needed counts them, and
    apply_compile raises dynamo's recompile limit to that count, so a switch past it would fail under fullgraph."""
    from megacpp_lab.model.parallelize import ParallelConfig, graphs_needed, parallelize

    doc_ids = _doc_ids()
    ctx = build_context(doc_ids)
    tokens = torch.randint(3, V, (2, 24), generator=torch.Generator().manual_seed(7))
    targets = torch.randint(3, V, (2, 24), generator=torch.Generator().manual_seed(8))
    torch._dynamo.reset()
    limit = torch._dynamo.config.recompile_limit
    torch._dynamo.config.recompile_limit = 1  # apply_compile raises it to graphs_needed, exactly
    try:
        model = parallelize(_dsa_model(pattern="A").train(), ParallelConfig(compile=True, backend="aot_eager",
                            compile_workers=0, saved_graphs=False), device="cpu")  # fmt: skip
        assert torch._dynamo.config.recompile_limit == graphs_needed(model) == 2 * (2 + 1)
        for phase in ("warmup", "sparse"):
            set_dsa_phase(model, phase)
            model(tokens, ctx, targets).loss.backward()
            with torch.no_grad():
                model.eval()
                model(tokens, ctx, targets)
                model.train()
    finally:
        torch._dynamo.config.recompile_limit = limit
        torch._dynamo.reset()


def test_the_stack_layout_keeps_documents_apart_in_its_head_and_its_mtp_module(window):
    """The stack preset's layout at the tiny width (its pattern over 9 layers, so both its A ranks: layer 0 dense
    MLA, layer 8 DSA; E blocks, Engram, mHC, MTP depth 1): the main head's logits are causal and document-tight,
    and the MTP module's hidden state at i reads nothing past i+1 of i's document."""
    from megacpp_lab.model.hybrid import tokens_ahead
    from megacpp_lab.testing import check_leaks

    tokens, doc_ids = window
    torch.manual_seed(0)
    stack = hybrid_preset("stack")
    cfg = hybrid_preset("tiny", **CPU, pattern=stack.pattern, n_layers=9, engram_layers=(1, 5), mhc=True,
                        dsa_layers=(8,), dsa=dict(top_k=3), mtp_depth=stack.mtp_depth)  # fmt: skip
    model = wake_zero_initialised(HybridLM(cfg).eval())
    assert [b.kind for b in model.blocks] == list(stack.blocks[:9]) and model.blocks[8].mixer.indexer is not None
    report = model_leak_report(model, tokens, doc_ids, vocab_size=V, causal_positions=range(0, 24, 4))
    assert report.passed, str(report)

    def mtp_shifted(t: torch.Tensor, d: torch.Tensor) -> torch.Tensor:  # h^1_i placed at i+1, inside i's document
        ctx = build_context(d)
        with torch.no_grad():
            h = model.mtp_hiddens(model.hidden(t, ctx), t, ctx)[0]
        _, same = tokens_ahead(d, d, 1, 0)
        placed = torch.zeros_like(h)
        placed[:, 1:] = (h * same[..., None])[:, :-1]
        return placed

    report = check_leaks(mtp_shifted, tokens, doc_ids, vocab_size=V, causal_positions=range(0, 24, 4),
                         allow_vacuous=True)  # fmt: skip
    assert not report.leaked, str(report)


def test_the_optimizer_clips_the_indexers_gradients_apart_from_the_language_models():
    """The indexer learns from its own loss: a large indexer gradient must not shrink the language model's step
    through the global norm, and its own clip still holds it."""
    from megacpp_lab.model.optim import MasterWeightAdamW
    from megacpp_lab.model.train_config import TrainConfig

    model = _dsa_model()
    opt = MasterWeightAdamW(model, TrainConfig(preset="tiny", grad_clip=1.0, steps=10, device="cpu"), fused=False)
    for name, p in model.named_parameters():
        p.grad = torch.full_like(p, 1e3 if ".indexer." in name else 1e-6)
    lm_before = {n: p.grad.clone() for n, p in model.named_parameters() if ".indexer." not in n}
    norm = opt.step(1e-3)
    assert float(norm) < 1.0  # the language model's norm alone
    for name, grad in lm_before.items():
        assert torch.equal(dict(model.named_parameters())[name].grad, grad), name  # not scaled by the indexer's
    indexer = torch.stack([p.grad.norm() for n, p in model.named_parameters() if ".indexer." in n]).norm()
    assert abs(float(indexer) - 1.0) < 1e-3  # clipped by its own norm


@pytest.mark.parametrize("phase", ["sparse", "warmup"])
def test_a_dsa_model_decodes_step_by_step_as_its_forward_scores_the_sequence(phase):
    """Decode through a DSA layer: the cache holds its indexer keys, each new query keeps its top_k of every
    earlier key (3 of up to 20 here, so the selection matters), and the step-by-step logits are the forward's."""
    from megacpp_lab.model.decode import decode_step, init_decode_state

    model = _dsa_model(pattern="AM")
    set_dsa_phase(model, phase)
    tokens = torch.randint(3, V, (2, 20), generator=torch.Generator().manual_seed(8))
    ref = model(tokens, build_context(torch.zeros_like(tokens)), return_logits=True).logits
    state = init_decode_state(model, 2, 20)
    assert state.kv_cache.index_keys[0] is not None
    steps = torch.stack([decode_step(model, state, tokens[:, t]) for t in range(20)], dim=1)
    torch.testing.assert_close(steps, ref.float(), rtol=1e-4, atol=1e-4)
    if phase == "sparse":  # the same model attending every key would give other logits: the selection is read
        set_dsa_phase(model, "warmup")
        dense = model(tokens, build_context(torch.zeros_like(tokens)), return_logits=True).logits
        assert (dense - ref).abs().max() > 1e-3
