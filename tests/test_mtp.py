"""Multi-token prediction (model/hybrid.py's MTPModule): the tokens and targets k ahead stop at each document's
end, the loss is the next-token loss plus the weighted MTP mean, depth k reads the tokens up to i+k of i's
document and none of another (the leak harness on each depth, and a planted leak that must fail), regional
compile and checkpointing treat the MTP blocks as blocks, and the memory estimate carries their share."""

from __future__ import annotations

import pytest
import torch

from megacpp_lab.model import hybrid
from megacpp_lab.model.checkpointing import AC_ATTR, CheckpointingPolicy, apply_ac
from megacpp_lab.model.config import hybrid_preset
from megacpp_lab.model.hybrid import HybridLM, tokens_ahead
from megacpp_lab.model.memory import estimate_memory
from megacpp_lab.model.parallelize import ParallelConfig, fsdp_groups, parallelize, structure_keys
from megacpp_lab.profiling import saved_tensor_bytes
from megacpp_lab.testing import check_leaks, wake_zero_initialised
from megacpp_lab.varlen import build_context, doc_ids_from_cu_seqlens

V = 512  # the tiny preset's vocab
CPU = dict(m2rnn=dict(kernel="reference"), lm_head=dict(loss_impl="eager"))
IGNORE = -100


def _model(seed: int = 0, **overrides) -> HybridLM:
    torch.manual_seed(seed)
    return HybridLM(hybrid_preset("tiny", **{**CPU, "mtp_depth": 2, **overrides})).eval()


def _batch(B: int = 2, T: int = 24, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    cu = torch.tensor([0, 5, 6, 20, 24, 33, 48], dtype=torch.int32)  # a one-token document, a doc across rows' end
    doc_ids = doc_ids_from_cu_seqlens(cu, B, T)
    tokens = torch.randint(3, V, (B, T), generator=g)
    targets = torch.full_like(tokens, IGNORE)
    same = doc_ids[:, 1:] == doc_ids[:, :-1]
    targets[:, :-1] = torch.where(same, tokens[:, 1:], IGNORE)
    return tokens, doc_ids, targets


@pytest.mark.parametrize("k", [1, 2, 3, 30])
def test_tokens_ahead_stop_at_each_documents_end(k):
    tokens, doc_ids, _ = _batch()
    ahead, same = tokens_ahead(tokens, doc_ids, k, fill=-7)
    B, T = tokens.shape
    for b in range(B):
        for i in range(T):
            inside = i + k < T and doc_ids[b, i + k] == doc_ids[b, i]
            assert bool(same[b, i]) == bool(inside)
            assert ahead[b, i] == (tokens[b, i + k] if inside else -7)


@pytest.mark.parametrize("k", [1, 2])
def test_mtp_targets_are_the_token_k_plus_one_ahead_inside_the_document(k):
    """tokens_ahead(targets, k) is what the depth-k loss reads: t_{i+k+1} where i+k+1 is in i's document, else
    ignored (the next-token targets already stop at each document's last token)."""
    tokens, doc_ids, targets = _batch()
    target_k, _ = tokens_ahead(targets, doc_ids, k, IGNORE)
    B, T = tokens.shape
    for b in range(B):
        for i in range(T):
            j = i + k + 1
            inside = j < T and doc_ids[b, j] == doc_ids[b, i]
            assert target_k[b, i] == (tokens[b, j] if inside else IGNORE)
    assert (target_k != IGNORE).any()


def test_the_loss_is_the_next_token_loss_plus_the_weighted_mtp_mean():
    tokens, doc_ids, targets = _batch()
    ctx = build_context(doc_ids)
    model = _model(mtp_loss_weight=0.25)
    out = model(tokens, ctx, targets)
    assert out.mtp_losses.shape == (2,) and torch.isfinite(out.mtp_losses).all()
    torch.testing.assert_close(out.loss, out.lm_loss + 0.25 * out.mtp_losses.mean())
    # the next-token loss is the model's without MTP, on the same weights: MTP only adds
    plain = HybridLM(hybrid_preset("tiny", **CPU)).eval()
    plain.load_state_dict({k: v for k, v in model.state_dict().items() if not k.startswith("mtp.")})
    torch.testing.assert_close(out.lm_loss, plain(tokens, ctx, targets).loss)
    # every MTP parameter learns from the loss; at weight 0 none of them does
    out.loss.backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in model.mtp.parameters())
    zero = _model(mtp_loss_weight=0.0)
    zero(tokens, ctx, targets).loss.backward()
    assert all(p.grad is None or p.grad.abs().sum() == 0 for p in zero.mtp.parameters())
    # no targets: no MTP loss (inference never runs the modules)
    assert model(tokens, ctx, return_logits=True).mtp_losses is None


def _depth_fn(model: HybridLM, k: int, *, shifted: bool):
    """(tokens, doc_ids) -> depth k's hidden state h^k [B,T,d]; shifted: h^k_i placed at i+k and kept only where
    i+k is in i's document (zero elsewhere), so that 'reads tokens up to i+k of its document' reads as causal."""

    def fn(tokens: torch.Tensor, doc_ids: torch.Tensor) -> torch.Tensor:
        ctx = build_context(doc_ids)
        with torch.no_grad():
            h = model.mtp_hiddens(model.hidden(tokens, ctx), tokens, ctx)[k - 1]
        if not shifted:
            return h
        _, same = tokens_ahead(doc_ids, doc_ids, k, 0)
        placed = torch.zeros_like(h)
        placed[:, k:] = (h * same[..., None])[:, : h.shape[1] - k]
        return placed

    return fn


@pytest.mark.parametrize("k", [1, 2])
def test_each_depth_reads_only_its_document_up_to_k_ahead(k):
    tokens, doc_ids, _ = _batch()
    model = wake_zero_initialised(_model())
    # unshifted: no position reads another document (the embedding k ahead is zero past the document's end)
    report = check_leaks(_depth_fn(model, k, shifted=False), tokens, doc_ids, vocab_size=V, causal=False)
    assert report.passed, str(report)
    # shifted by k: causal and document-tight, so depth k reads nothing beyond i+k. A document of at most k
    # tokens has no position whose i+k stays inside it, so no shifted output: vacuous there by construction
    report = check_leaks(_depth_fn(model, k, shifted=True), tokens, doc_ids, vocab_size=V,
                         causal_positions=range(0, 24, 2), allow_vacuous=True)  # fmt: skip
    assert not report.leaked, str(report)
    assert {span.end - span.start for span in report.dependence.ignored} <= set(range(1, k + 1)), str(report)


def test_an_unmasked_embedding_ahead_fails_the_document_check(monkeypatch):
    """The planted leak: the token k ahead embedded even where it is in the next document."""
    tokens, doc_ids, _ = _batch()
    model = wake_zero_initialised(_model())

    def unmasked(t, d, k, fill):
        ahead, same = tokens_ahead(t, d, k, fill)
        n = min(k, t.shape[1])
        return torch.cat((t[:, n:], t.new_full((t.shape[0], n), fill)), dim=1), torch.ones_like(same)

    monkeypatch.setattr(hybrid, "tokens_ahead", unmasked)
    report = check_leaks(_depth_fn(model, 1, shifted=False), tokens, doc_ids, vocab_size=V, causal=False)
    assert report.leaked and report.cross_doc.magnitude > report.tol, str(report)


def test_compile_and_checkpointing_treat_the_mtp_blocks_as_blocks():
    model = _model(pattern="A", n_layers=2, engram_layers=())
    assert len(model.all_blocks()) == 4 and structure_keys(model)[2:] == [("A",), ("A",)]
    apply_ac(model, CheckpointingPolicy(A="full", mtp="full"))
    # the stack's last block is checkpointed now that MTP follows it; the model's last block (MTP 2) never is
    assert [hasattr(b, AC_ATTR) for b in model.all_blocks()] == [True, True, True, False]
    assert [name for name, _ in fsdp_groups(model)][2] == "mtp"
    with pytest.raises(ValueError, match=r"mtp"):
        CheckpointingPolicy.parse("mtp=1.5")  # a budget past 1
    assert CheckpointingPolicy.parse("mtp=full").mtp == "full"


def test_regionally_compiled_mtp_model_equals_eager_without_a_graph_break():
    from torch._dynamo.utils import counters

    tokens, doc_ids, targets = _batch()
    ctx = build_context(doc_ids)
    torch._dynamo.reset()
    counters.clear()
    eager = _model(pattern="A", n_layers=2, engram_layers=())
    compiled = parallelize(_model(pattern="A", n_layers=2, engram_layers=()),
                           ParallelConfig(compile=True, backend="aot_eager", compile_workers=0, saved_graphs=False),
                           device="cpu")  # fmt: skip
    a, b = compiled(tokens, ctx, targets), eager(tokens, ctx, targets)
    torch.testing.assert_close(a.loss, b.loss)
    torch.testing.assert_close(a.mtp_losses, b.mtp_losses)
    assert sum(counters["graph_break"].values()) == 0


def test_the_memory_estimate_carries_the_mtp_share_within_15_percent():
    tokens, doc_ids, targets = _batch()
    ctx = build_context(doc_ids)
    measured, estimated = {}, {}
    for depth in (0, 2):
        torch.manual_seed(0)
        config = hybrid_preset("tiny", **CPU, mtp_depth=depth)
        model = HybridLM(config)
        measured[depth] = saved_tensor_bytes(lambda model=model: model(tokens, ctx, targets).loss,
                                             exclude=list(model.parameters()))  # fmt: skip
        estimated[depth] = estimate_memory(config, batch=2, seq_len=24, docs=3)
    share = measured[2] - measured[0]
    assert estimated[0].activations_by_kind.get("mtp") is None
    assert abs(estimated[2].activations_by_kind["mtp"] / share - 1) < 0.15, (estimated[2].activations_by_kind, share)


@pytest.mark.parametrize("field, value, allowed", [
    ("mtp_depth", -1, r"an int in \[0, 8\]"), ("mtp_depth", 9, r"an int in \[0, 8\]"), ("mtp_depth", "2", "an int"),
    ("mtp_loss_weight", -0.1, "a finite number >= 0"), ("mtp_loss_weight", float("nan"), "a finite number >= 0"),
])  # fmt: skip
def test_bad_mtp_config_fails_naming_the_field(field, value, allowed):
    with pytest.raises(ValueError, match=rf"HybridConfig\.{field}.*{allowed}|{field}.*{allowed}"):
        hybrid_preset("tiny", **{field: value})


def test_mtp_acceptance_counts_greedy_drafts_against_the_main_heads_verification():
    from megacpp_lab.model.decode import mtp_acceptance

    tokens, doc_ids, _ = _batch()
    ctx = build_context(doc_ids)
    model = _model()
    got = mtp_acceptance(model, tokens, ctx)
    # brute force: the same definitions, one position at a time
    h = model.hidden(tokens, ctx)
    main = model.lm_head(model.norm(h), return_logits=True).logits.argmax(-1)
    drafts = [model.lm_head(m.norm(hk), return_logits=True).logits.argmax(-1)
              for m, hk in zip(model.mtp, model.mtp_hiddens(h, tokens, ctx))]  # fmt: skip
    B, T = tokens.shape
    alive = {(b, i) for b in range(B) for i in range(T)}
    for k, draft in enumerate(drafts, start=1):
        valid = [(b, i) for b in range(B) for i in range(T) if i + k + 1 < T and doc_ids[b, i + k + 1] == doc_ids[b, i]]
        reached = [p for p in valid if p in alive]
        hits = {(b, i) for b, i in reached if draft[b, i] == main[b, i + k]}
        assert got["positions"][k - 1] == len(reached)
        assert got["accepted"][k - 1] == pytest.approx(len(hits) / max(1, len(reached)))
        correct = sum(int(draft[b, i] == tokens[b, i + k + 1]) for b, i in valid)
        assert got["correct"][k - 1] == pytest.approx(correct / len(valid))
        alive = hits
    # a model without MTP modules has nothing to draft
    with pytest.raises(ValueError, match="mtp_depth"):
        mtp_acceptance(HybridLM(hybrid_preset("tiny", **CPU)).eval(), tokens, ctx)


def test_with_mtp_false_skips_the_modules_and_keeps_the_next_token_loss():
    tokens, doc_ids, targets = _batch()
    model = _model()
    ctx = build_context(doc_ids)
    calls = []
    handle = model.mtp[0].register_forward_hook(lambda *a: calls.append(1))
    full = model(tokens, ctx, targets)
    lm_only = model(tokens, ctx, targets, with_mtp=False)
    handle.remove()
    assert len(calls) == 1 and lm_only.mtp_losses is None  # the modules ran for the first call alone
    torch.testing.assert_close(lm_only.loss, full.lm_loss)
    torch.testing.assert_close(lm_only.lm_loss, full.lm_loss)


def test_generate_with_drafts_is_greedy_decoding_and_its_drafts_are_the_mtp_heads():
    """The drafting decode: its tokens are generate(temperature=0)'s, and each draft it checks is the MTP head's
    greedy token at that position in one teacher-forced forward over the generated sequence (the module's own KV
    cache, stepped, equals its training-time attention), so its acceptance is that forward's."""
    from megacpp_lab.model.decode import generate, generate_with_drafts

    model = _model(mtp_depth=1)
    prompt = torch.randint(3, V, (2, 7), generator=torch.Generator().manual_seed(3))
    new = 9
    tokens, stats = generate_with_drafts(model, prompt, new)
    assert torch.equal(tokens, generate(model, prompt, new, temperature=0))
    assert stats.drafts == [new - 1] * 2
    doc_ids = torch.zeros_like(tokens)
    ctx = build_context(doc_ids)
    with torch.no_grad():
        h1 = model.mtp_hiddens(model.hidden(tokens, ctx), tokens, ctx)[0]
        drafts = model.lm_head(model.mtp[0].norm(h1), return_logits=True).logits.argmax(-1)  # at i: t_{i+2}
    P = prompt.shape[1]
    assert stats.draft_tokens == drafts[:, P - 1 : P - 1 + new - 1].tolist()  # draft by draft, not only the count
    expected = (drafts[:, P - 1 : P - 1 + new - 1] == tokens[:, P + 1 : P + new]).sum(1)
    assert stats.accepted == expected.tolist()
    assert stats.acceptance == expected.sum().item() / (2 * (new - 1))
    with pytest.raises(ValueError, match="mtp_depth"):
        generate_with_drafts(_model(mtp_depth=0), prompt, 2)
    with pytest.raises(ValueError, match="max_new_tokens"):
        generate_with_drafts(model, prompt, 0)
