"""EngramConfig / NgramHashConfig fail closed; the mHC fallback never silently becomes empty."""

import dataclasses
import warnings

import pytest

from megacpp_lab.nn.engram import EngramConfig
from megacpp_lab.nn.ngram_hash import NgramHashConfig

BASE = dict(d_model=64, n_layers=6, bottleneck=16)


@pytest.mark.parametrize(
    "field, value, allowed",
    [
        ("layers", (0, 6), r"layer indices in \[0, n_layers=6\)"),
        ("layers", (-1,), r"layer indices in \[0, n_layers=6\)"),
        ("layers", (1, 1), "unique layer indices"),
        ("orders", (1, 2), r"a non-empty tuple of n-gram orders in 2\.\.16"),
        ("orders", (2, 17), r"a non-empty tuple of n-gram orders in 2\.\.16"),
        ("orders", (), r"a non-empty tuple of n-gram orders in 2\.\.16"),
        ("orders", (3, 3), "unique n-gram orders"),
        ("bottleneck", 0, r"an int in 1\.\.d_model=64"),
        ("bottleneck", 65, r"an int in 1\.\.d_model=64"),
        ("dropout", -0.1, r"a float in \[0, 1\)"),
        ("dropout", 1.0, r"a float in \[0, 1\)"),
        ("conv_kernel", -1, r"0 \(no conv\) or a kernel size in 1\.\.16"),
        ("conv_kernel", 17, r"0 \(no conv\) or a kernel size in 1\.\.16"),
        ("conv_impl", "cudnn", r"one of \('xla_safe', 'maxtext_depthwise'\)"),
        ("eps", 0.0, r"a float in \(0, 1\)"),
        ("n_layers", 0, "an int >= 1"),
    ],
)
def test_engram_config_names_field_and_allowed_values(field, value, allowed):
    kwargs = {**BASE, field: value}
    with pytest.raises(ValueError, match=rf"EngramConfig\.{field} must be {allowed}"):
        EngramConfig(**kwargs)


def test_engram_config_is_frozen_and_normalises_sequences():
    cfg = EngramConfig(**BASE, layers=[0, 3], orders=[2, 3])
    assert cfg.layers == (0, 3) and cfg.orders == (2, 3) and cfg.enabled
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.bottleneck = 8


def test_from_args_parses_layers():
    assert EngramConfig.from_args(**BASE, engram_layers="0,2,4").layers == (0, 2, 4)
    assert EngramConfig.from_args(**BASE, engram_layers="all").layers == tuple(range(6))
    assert EngramConfig.from_args(**BASE, engram_layers=[5]).layers == (5,)
    assert EngramConfig.from_args(**BASE, orders="2,3").orders == (2, 3)
    with pytest.raises(ValueError, match=r"EngramConfig\.layers must be a comma-separated list"):
        EngramConfig.from_args(**BASE, engram_layers="0,x")
    with pytest.raises(ValueError, match=r"EngramConfig\.layers must be layer indices"):
        EngramConfig.from_args(**BASE, engram_layers="0,9")
    with pytest.raises(ValueError, match=r"EngramConfig\.conv_impl"):
        EngramConfig.from_args(**BASE, engram_layers="0", conv_impl="tpu")


def test_tripwire_mhc_without_engram_layers_defaults_to_all_layers_with_warning():
    """The historical bug: mHC fell back to an empty engram layer list and silently did nothing."""
    with pytest.warns(UserWarning, match="defaults? to all 6 layers"):
        cfg = EngramConfig.from_args(**BASE, mhc=True)
    assert cfg.layers == tuple(range(6)) and cfg.mhc


def test_mhc_with_explicitly_empty_layers_fails_closed():
    with pytest.raises(ValueError, match=r"EngramConfig\.layers must be non-empty when mhc=True"):
        EngramConfig.from_args(**BASE, mhc=True, engram_layers="")
    with pytest.raises(ValueError, match="silent no-op"):
        EngramConfig(**BASE, mhc=True)


def test_no_mhc_and_no_layers_means_engram_off_without_warning():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cfg = EngramConfig.from_args(**BASE)
    assert cfg.layers == () and not cfg.enabled


NG = dict(vocab_size=259, d_model=32, n_layers=4, pad_id=258)


@pytest.mark.parametrize(
    "field, value, allowed",
    [
        ("vocab_size", 1, r"an int in 2\.\.1048576"),
        ("pad_id", 259, r"a token id in \[0, vocab_size=259\)"),
        ("layers", (4,), r"unique layer indices in \[0, n_layers=4\)"),
        ("layers", (1, 1), r"unique layer indices"),
        ("max_ngram", 1, r"an int in 2\.\.8"),
        ("max_ngram", 9, r"an int in 2\.\.8"),
        ("heads_per_order", 0, "an int >= 1"),
        ("table_size", 1, "an int >= 2"),
        ("head_dim", 0, "an int >= 1"),
        ("conv_kernel", 99, r"0 \(no conv\) or a kernel size in 1\.\.16"),
        ("eps", 1, r"a float in \(0, 1\)"),
    ],
)
def test_ngram_hash_config_names_field_and_allowed_values(field, value, allowed):
    with pytest.raises(ValueError, match=rf"NgramHashConfig\.{field} must be {allowed}"):
        NgramHashConfig(**{**NG, field: value})


def test_ngram_hash_from_args():
    cfg = NgramHashConfig.from_args(**NG, layers="1,3", orders="2,3,4")
    assert cfg.layers == (1, 3) and cfg.orders == (2, 3, 4) and cfg.num_heads == 12
    with pytest.raises(ValueError, match=r"NgramHashConfig\.max_ngram must be given through orders as the contiguous range"):
        NgramHashConfig.from_args(**NG, orders="2,4")
    with pytest.raises(ValueError, match=r"NgramHashConfig\.layers"):
        NgramHashConfig.from_args(**NG, layers="a")
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.head_dim = 4


@pytest.mark.parametrize("field, value", [("gated", "false"), ("mhc", 1), ("conv_kernel", True), ("bottleneck", True)])
def test_engram_config_rejects_truthy_impostors(field, value):
    with pytest.raises(ValueError, match=rf"EngramConfig\.{field} must be"):
        EngramConfig(**{**BASE, field: value})
