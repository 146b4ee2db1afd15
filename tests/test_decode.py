"""Step-by-step decode: every layer's recurrent step equals its forward at every position, the whole model's
decode_step logits equal the full forward's, generate / sample_next, and the fail-closed input checks."""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch

from megacpp_lab.bench.harness import leak_features
from megacpp_lab.model.config import model_config
from megacpp_lab.model.decode import DecodeState, decode_step, generate, init_decode_state, prefill, sample_next
from megacpp_lab.model.hybrid import HybridLM
from megacpp_lab.model.parallelize import ParallelConfig, parallelize
from megacpp_lab.nn.concept_bank import ConceptBank, ConceptBankConfig
from megacpp_lab.nn.engram import EngramBranch, EngramConfig
from megacpp_lab.nn.m2rnn import M2RNN, M2RNNConfig
from megacpp_lab.nn.mla import MLAConfig, MLAKVCache, MultiLatentAttention
from megacpp_lab.nn.ngram_hash import NgramHashConfig, NgramHashMemory
from megacpp_lab.nn.primitives import CONV_IMPLS, DocCausalDepthwiseConv
from megacpp_lab.nn.ssm import SSD, SSDConfig
from megacpp_lab.testing import wake_zero_initialised
from megacpp_lab.varlen import build_context

B, T, C = 2, 20, 32
TOL = dict(atol=1e-5, rtol=1e-5)


def _x(seed: int = 0) -> torch.Tensor:
    return torch.randn(B, T, C, generator=torch.Generator().manual_seed(seed))


def _stepped(step: Callable[[int], torch.Tensor]) -> torch.Tensor:
    """step(t) -> [B,1,...] for t in 0..T-1, stacked back to [B,T,...]."""
    return torch.cat([step(t) for t in range(T)], dim=1)


def _woken(module: torch.nn.Module) -> torch.nn.Module:
    torch.manual_seed(0)
    return wake_zero_initialised(module, std=0.2).eval()


# ----------------------------------------------------------------------------- per layer


@pytest.mark.parametrize("impl", CONV_IMPLS)
@pytest.mark.parametrize("kernel", [1, 4])
def test_conv_step_equals_forward(impl: str, kernel: int) -> None:
    torch.manual_seed(0)
    conv, x = DocCausalDepthwiseConv(C, kernel, impl), _x()
    window = conv.init_window(B)
    assert window.shape == (B, kernel - 1, C) and not window.any()  # zeros: the forward's padding

    def step(t: int) -> torch.Tensor:
        nonlocal window
        y, window = conv.step(x[:, t : t + 1], window)
        return y

    with torch.no_grad():
        torch.testing.assert_close(_stepped(step), conv(x), **TOL)


def test_bf16_conv_sums_in_fp32_once_and_its_step_equals_the_forward_bit_for_bit() -> None:
    """bf16 activations and parameters (the model's, apply_precision): xla_safe's taps sum in fp32 and round once to
    bf16, as an fp32 conv of the same values rounded; the decode step sums the same terms in the same order, so
    it equals the forward bit for bit (an einsum rounded to bf16 before the bias differed on 12% of elements)."""
    import torch.nn.functional as F

    torch.manual_seed(0)
    conv, x = DocCausalDepthwiseConv(C, 4, "xla_safe").to(torch.bfloat16), _x().to(torch.bfloat16)
    with torch.no_grad():
        y = conv(x)
        want = F.conv1d(F.pad(x.float().transpose(1, 2), (3, 0)), conv.weight.float(), conv.bias.float(), groups=C)
        assert y.dtype == torch.bfloat16
        torch.testing.assert_close(y.float(), want.transpose(1, 2), atol=0, rtol=2**-8)  # one bf16 rounding
        window = conv.init_window(B, dtype=torch.bfloat16)
        steps = []
        for t in range(x.shape[1]):
            out, window = conv.step(x[:, t : t + 1], window)
            steps.append(out)
        assert torch.equal(torch.cat(steps, dim=1), y)


@pytest.mark.parametrize("kw", [dict(n_groups=2), dict(n_groups=1, conv_kernel=0)])
def test_ssd_step_equals_forward(kw: dict) -> None:
    ssd = _woken(SSD(SSDConfig(d_model=C, n_heads=4, head_dim=8, state_dim=8, chunk=8, kernel="chunked", **kw)))
    x, state = _x(), ssd.init_state(B)
    assert state.h.dtype == torch.float32 and state.h.shape == (B, 4, 8, 8)
    with torch.no_grad():
        torch.testing.assert_close(_stepped(lambda t: ssd.step(x[:, t : t + 1], state)), ssd(x), **TOL)


@pytest.mark.parametrize("kw", [{}, dict(conv_kernel=0, residual=False)])
def test_m2rnn_step_equals_forward(kw: dict) -> None:
    cfg = M2RNNConfig(d_model=C, n_heads=2, k_head_dim=16, v_head_dim=16, chunk=8, kernel="reference", **kw)
    rnn, x = _woken(M2RNN(cfg)), _x()
    state = rnn.init_state(B)
    assert state.h.dtype == torch.float32 and state.h.shape == (B, 2, 16, 16)
    with torch.no_grad():
        torch.testing.assert_close(_stepped(lambda t: rnn.step(x[:, t : t + 1], state)), rnn(x), **TOL)


@pytest.mark.parametrize("absorbed", [False, True])
def test_mla_decode_equals_forward(absorbed: bool) -> None:
    cfg = MLAConfig(d_model=C, n_heads=2, q_lora_rank=16, kv_lora_rank=16, d_nope=8, d_rope=8, d_v=8, max_positions=64)
    mla, x = _woken(MultiLatentAttention(cfg)), _x()
    cache = MLAKVCache(1, B, T, cfg.kv_lora_rank, cfg.d_rope, dtype=torch.float32)

    def step(t: int) -> torch.Tensor:
        y = mla.decode(x[:, t : t + 1], cache, 0, absorbed=absorbed)
        cache.advance()
        return y

    with torch.no_grad():
        torch.testing.assert_close(_stepped(step), mla(x), **TOL)


@pytest.mark.parametrize("mode", [dict(gated=True, conv_kernel=4), dict(gated=False, conv_kernel=0),
                                  dict(gated=True, conv_kernel=3, conv_impl="xla_safe", orders=(2, 5))])  # fmt: skip
def test_engram_step_equals_forward(mode: dict) -> None:
    engram, x = _woken(EngramBranch(EngramConfig(d_model=C, bottleneck=8, **mode))), _x()
    state = engram.init_state(B)
    assert state.u.shape == (B, max(engram.config.orders) - 1, 8)  # a window, not the prefix
    with torch.no_grad():
        torch.testing.assert_close(_stepped(lambda t: engram.step(x[:, t : t + 1], state)), engram(x), **TOL)


@pytest.mark.parametrize("max_ngram, conv_kernel", [(3, 4), (4, 0)])
def test_ngram_step_equals_forward(max_ngram: int, conv_kernel: int) -> None:
    cfg = NgramHashConfig(vocab_size=50, d_model=C, pad_id=2, max_ngram=max_ngram, heads_per_order=2, table_size=31,
                          head_dim=4, conv_kernel=conv_kernel)  # fmt: skip
    mem, x = _woken(NgramHashMemory(cfg, layer_id=1)), _x()
    tokens = torch.randint(0, 50, (B, T), generator=torch.Generator().manual_seed(1))
    tokens[:, 1] = 2  # the pad id inside the document too
    state = mem.init_state(B)
    assert state.tokens.tolist() == [[2] * (max_ngram - 1)] * B  # pad before the document start
    step = lambda t: mem.step(x[:, t : t + 1], tokens[:, t : t + 1], state)  # noqa: E731
    with torch.no_grad():
        torch.testing.assert_close(_stepped(step), mem(x, tokens), **TOL)


def test_concept_bank_is_per_token() -> None:
    """No state to carry: each token's output is the forward on that token alone."""
    bank, x = _woken(ConceptBank(ConceptBankConfig(d_model=C, n_concepts=16, n_heads=2, head_dim=8))), _x()
    with torch.no_grad():
        torch.testing.assert_close(_stepped(lambda t: bank(x[:, t : t + 1])), bank(x), **TOL)


# ----------------------------------------------------------------------------- the whole model

CASES = {"tiny": {}, "tiny+leak": leak_features(4), "no_attention": dict(pattern="MR", engram_layers=(0,))}


def _model(**overrides) -> HybridLM:
    torch.manual_seed(0)
    return _woken(HybridLM(model_config("tiny", "cpu", **overrides)))


def _full_logits(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(tokens, build_context(torch.zeros_like(tokens)), return_logits=True).logits.float()


@pytest.fixture(scope="module")
def tiny() -> HybridLM:
    return _model()


@pytest.mark.parametrize("case", sorted(CASES))
def test_decode_step_equals_the_full_forward(case: str) -> None:
    model = _model(**CASES[case])
    tokens = torch.randint(0, model.config.vocab_size, (B, T), generator=torch.Generator().manual_seed(2))
    state = init_decode_state(model, B, T)
    got = torch.stack([decode_step(model, state, tokens[:, t]) for t in range(T)], dim=1)
    assert got.dtype == torch.float32 and state.length == T
    torch.testing.assert_close(got, _full_logits(model, tokens), **TOL)


def test_prefill_returns_the_last_position_and_advances_the_cache_once_per_step(tiny: HybridLM, monkeypatch) -> None:
    calls = []
    advance = MLAKVCache.advance
    monkeypatch.setattr(MLAKVCache, "advance", lambda self: (calls.append(self.length), advance(self))[1])
    tokens = torch.randint(0, 512, (B, 7), generator=torch.Generator().manual_seed(3))
    state = init_decode_state(tiny, B, 16)
    logits = prefill(tiny, state, tokens)
    assert calls == list(range(7)) and state.kv_cache.length == state.length == 7
    torch.testing.assert_close(logits, _full_logits(tiny, tokens)[:, -1], **TOL)
    nxt = torch.tensor([5, 6])
    torch.testing.assert_close(decode_step(tiny, state, nxt),
                               _full_logits(tiny, torch.cat([tokens, nxt[:, None]], 1))[:, -1], **TOL)  # fmt: skip


def test_bf16_model_decodes_in_bf16() -> None:
    model = parallelize(_model(**leak_features(4)), ParallelConfig(dtype="bf16"))
    tokens = torch.randint(0, 512, (B, 8), generator=torch.Generator().manual_seed(4))
    state = init_decode_state(model, B, 8)
    assert state.kv_cache.low_rank_main[0].dtype == torch.bfloat16 and state.blocks[1].mixer.h.dtype == torch.float32
    got = torch.stack([decode_step(model, state, tokens[:, t]) for t in range(8)], dim=1)
    ref = _full_logits(model, tokens)
    assert (got - ref).abs().max() < 0.1 * ref.abs().max()  # bf16 activations: close, not equal
    out = generate(model, tokens[:, :4], 3, temperature=0)
    assert out.shape == (B, 7) and out.dtype == torch.int64


# ----------------------------------------------------------------------------- generate and sampling


def _prompt(P: int = 5, seed: int = 5) -> torch.Tensor:
    return torch.randint(0, 512, (B, P), generator=torch.Generator().manual_seed(seed))


def test_greedy_is_deterministic_and_equals_argmax_of_the_full_forward(tiny: HybridLM) -> None:
    prompt = _prompt()
    out = generate(tiny, prompt, 8, temperature=0)
    assert out.shape == (B, 13) and out.dtype == torch.int64 and torch.equal(out[:, :5], prompt)
    assert torch.equal(generate(tiny, prompt, 8, temperature=0), out)
    seq = prompt
    for _ in range(8):
        seq = torch.cat([seq, _full_logits(tiny, seq)[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert torch.equal(out, seq)


def test_top_k_1_equals_greedy(tiny: HybridLM) -> None:
    prompt = _prompt(seed=6)
    assert torch.equal(generate(tiny, prompt, 6, temperature=1.5, top_k=1), generate(tiny, prompt, 6, temperature=0))


def test_seeded_sampling_is_reproducible_and_top_k_restricts(tiny: HybridLM) -> None:
    prompt = _prompt(seed=7)

    def draw(seed: int, **kw) -> torch.Tensor:
        return generate(tiny, prompt, 10, generator=torch.Generator().manual_seed(seed), **kw)

    assert torch.equal(draw(0), draw(0))
    assert not torch.equal(draw(0), draw(1))  # 20 draws over 512 ids: equal only by a ~0 chance
    out = draw(3, top_k=4, temperature=2.0)
    allowed = _full_logits(tiny, out[:, :-1])[:, 4:].topk(4, dim=-1).indices  # each new token's top 4
    assert (allowed == out[:, 5:, None]).any(-1).all()


def test_sample_next() -> None:
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0], [5.0, 0.0, 0.0, 0.0]])
    assert sample_next(logits, 0).tolist() == [1, 0]
    g = torch.Generator().manual_seed(0)
    picks = torch.stack([sample_next(logits, 1.0, 2, g) for _ in range(200)])
    assert set(picks[:, 0].tolist()) == {1, 3} and set(picks[:, 1].tolist()) <= {0, 1, 2, 3}


def test_max_new_tokens_zero_returns_the_prompt(tiny: HybridLM) -> None:
    prompt = _prompt().to(torch.int32)
    out = generate(tiny, prompt, 0)
    assert out.dtype == torch.int64 and torch.equal(out, prompt.long())


# ----------------------------------------------------------------------------- fail closed

BAD_GENERATE = [
    (dict(temperature=-0.5), "temperature"),
    (dict(temperature=math.nan), "temperature"),
    (dict(temperature=math.inf), "temperature"),
    (dict(top_k=0), "top_k"),
    (dict(top_k=513), "top_k"),
    (dict(top_k=2.0), "top_k"),
    (dict(prompt=torch.zeros(2, 3)), "prompt"),
    (dict(prompt=torch.zeros(6, dtype=torch.int64)), "prompt"),
    (dict(prompt=torch.zeros(2, 0, dtype=torch.int64)), "prompt"),
    (dict(prompt=torch.tensor([[1, 512]])), "prompt holds id"),
    (dict(prompt=torch.tensor([[-1, 3]])), "prompt holds id"),
    (dict(max_new_tokens=-1), "max_new_tokens"),
    (dict(max_new_tokens=1020), "max_positions"),
]


@pytest.mark.parametrize("kw, field", BAD_GENERATE, ids=[f"{f}-{i}" for i, (_, f) in enumerate(BAD_GENERATE)])
def test_generate_refuses_bad_input_naming_the_field(tiny: HybridLM, kw: dict, field: str) -> None:
    args = dict(prompt=_prompt(), max_new_tokens=4) | kw
    with pytest.raises(ValueError, match=field):
        generate(tiny, args.pop("prompt"), args.pop("max_new_tokens"), **args)


def test_state_checks_name_the_field(tiny: HybridLM) -> None:
    with pytest.raises(ValueError, match="max_len"):
        init_decode_state(tiny, B, tiny.config.mla.max_positions + 1)
    with pytest.raises(ValueError, match="batch"):
        init_decode_state(tiny, 0, 8)
    with pytest.raises(TypeError, match="HybridLM"):
        init_decode_state(torch.nn.Linear(2, 2), B, 8)
    state = init_decode_state(tiny, B, 6)
    with pytest.raises(ValueError, match="max_len"):  # the prompt does not fit the state
        prefill(tiny, state, _prompt(P=7))
    prefill(tiny, state, _prompt(P=6))
    with pytest.raises(ValueError, match="max_len"):  # the state is full
        decode_step(tiny, state, torch.tensor([1, 2]))
    fresh = init_decode_state(tiny, B, 6)
    with pytest.raises(ValueError, match="batch"):
        decode_step(tiny, fresh, torch.tensor([1, 2, 3]))
    with pytest.raises(ValueError, match="another model"):
        decode_step(_model(), fresh, torch.tensor([1, 2]))
    with pytest.raises(ValueError, match="tokens holds id 512"):
        decode_step(tiny, fresh, torch.tensor([1, 512]))
    with pytest.raises(ValueError, match="tokens"):
        decode_step(tiny, fresh, torch.tensor([[1, 2]]))
    with pytest.raises(TypeError, match="DecodeState"):
        decode_step(tiny, object(), torch.tensor([1, 2]))
    assert isinstance(fresh, DecodeState) and fresh.length == 0  # refused calls leave the state untouched
