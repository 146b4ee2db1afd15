"""LMHead: the fused loss equals the reference head (values and gradients), no [B,T,V] logits exist on the
fused path (a tripwire that watches every tensor the head creates), logits only when asked, fail-closed config."""

from __future__ import annotations

import warnings

import pytest
import torch

from megacpp_lab.nn.lm_head import LMHead, LMHeadConfig
from megacpp_lab.profiling import working_memory

DEV = "cuda" if torch.cuda.is_available() else "cpu"
B, T, D, V = 2, 32, 16, 96


def _head(**kw) -> LMHead:
    torch.manual_seed(0)
    return LMHead(LMHeadConfig.build(d_model=D, vocab_size=V, loss_chunk_size=8, **kw)).to(DEV)


def _batch():
    g = torch.Generator().manual_seed(1)
    h = torch.randn(B, T, D, generator=g).to(DEV).requires_grad_()
    targets = torch.randint(0, V, (B, T), generator=g).to(DEV)
    targets[0, :3] = -100  # ignored tokens
    return h, targets


@pytest.mark.parametrize("z_loss", [0.0, 1e-3])
def test_fused_loss_equals_the_reference_head_values_and_gradients(z_loss):
    h, targets = _batch()
    out = {}
    for fused in (True, False):
        head = _head(fused_loss=fused, z_loss=z_loss, loss_impl="eager" if DEV == "cpu" else "auto")
        leaf = h.detach().clone().requires_grad_()
        loss = head(leaf, targets).loss
        out[fused] = (loss, *torch.autograd.grad(loss, (leaf, head.weight)))
    for a, b in zip(out[True], out[False]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_fused_head_never_materialises_full_logits_and_the_tripwire_can_fire():
    """The rebase-miss tripwire: with the fused loss on, no tensor of B*T*V elements is ever created in the
    forward or the backward. The reference head (full logits) trips the same watcher."""
    h, targets = _batch()
    for fused, should_trip in ((True, False), (False, True)):
        head = _head(fused_loss=fused, loss_impl="eager" if DEV == "cpu" else "auto")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the CPU eager fallback warns once; not what this test checks
            mem = working_memory(lambda: head(h, targets).loss.backward())
        largest = torch.Size(mem.largest_shape).numel()
        tripped = largest >= B * T * V
        assert tripped == should_trip, f"fused_loss={fused}: largest tensor {largest} vs B*T*V={B * T * V}"


def test_logits_only_when_asked_and_the_loss_unchanged_by_asking():
    h, targets = _batch()
    head = _head(loss_impl="eager" if DEV == "cpu" else "auto")
    plain = head(h, targets)
    assert plain.logits is None
    both = head(h, targets, return_logits=True)
    assert both.logits.shape == (B, T, V)
    torch.testing.assert_close(both.loss, plain.loss)
    torch.testing.assert_close(both.logits, h @ head.weight.t())
    only = head(h, return_logits=True)
    assert only.loss is None and only.logits.shape == (B, T, V)
    with pytest.raises(ValueError, match="needs targets"):
        head(h)
    with pytest.raises(ValueError, match=r"targets must be \[B,T\]"):
        head(h, targets[:, :-1])
    with pytest.raises(ValueError, match=r"h must be \[B,T,16\]"):
        head(h[..., :-1], targets)


@pytest.mark.parametrize(("field", "value", "message"), [
    ("d_model", 0, "d_model must be an int >= 1"),
    ("vocab_size", True, "vocab_size must be an int >= 1"),
    ("fused_loss", 1, "fused_loss must be a bool"),
    ("z_loss", -1.0, "z_loss must be a float >= 0"),
    ("loss_impl", "cuda", "loss_impl must be one of"),
    ("loss_chunk_size", 0, "loss_chunk_size must be None or an int >= 1"),
])  # fmt: skip
def test_config_fails_closed_naming_the_field(field, value, message):
    with pytest.raises(ValueError, match=rf"LMHeadConfig\.{message}"):
        LMHeadConfig.build(**{"d_model": D, "vocab_size": V, field: value})


def test_build_reads_the_model_fields_and_only_prefixed_head_fields():
    class Model:
        hidden_size, vocab_size, z_loss, lm_head_z_loss = 64, 1000, 0.5, 1e-4

    cfg = LMHeadConfig.build(Model())
    assert (cfg.d_model, cfg.vocab_size, cfg.z_loss) == (64, 1000, 1e-4)
    with pytest.raises(ValueError, match=r"needs \['d_model', 'vocab_size'\]"):
        LMHeadConfig.build()
