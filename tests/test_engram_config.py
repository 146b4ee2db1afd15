"""Configs fail closed naming the field; model-level fields live in HybridConfig; the mHC fallback never
silently becomes empty; every per-layer config has the one construction style."""

import dataclasses
import importlib
import inspect
import pkgutil
import warnings
from types import SimpleNamespace

import pytest

import megacpp_lab.model
import megacpp_lab.nn
from megacpp_lab.model.config import HybridConfig
from megacpp_lab.nn.engram import EngramConfig
from megacpp_lab.nn.m2rnn import M2RNNConfig
from megacpp_lab.nn.ngram_hash import NgramHashConfig
from megacpp_lab.nn.table_store import TableStoreConfig

BASE = dict(d_model=64, bottleneck=16)
MODEL = dict(vocab_size=512, d_model=64, n_layers=6)

# ----------------------------------------------------------------------------- EngramConfig (one layer)


@pytest.mark.parametrize(
    "field, value, allowed",
    [
        ("orders", (1, 2), r"a non-empty tuple of n-gram orders in 2\.\.16"),
        ("orders", (2, 17), r"a non-empty tuple of n-gram orders in 2\.\.16"),
        ("orders", (), r"a non-empty tuple of n-gram orders in 2\.\.16"),
        ("orders", (3, 3), "unique n-gram orders"),
        ("orders", "2,x", "a comma-separated list of ints"),
        ("bottleneck", 0, r"an int in 1\.\.d_model=64"),
        ("bottleneck", 65, r"an int in 1\.\.d_model=64"),
        ("dropout", -0.1, r"a float in \[0, 1\)"),
        ("dropout", 1.0, r"a float in \[0, 1\)"),
        ("conv_kernel", -1, r"0 \(no conv\) or a kernel size in 1\.\.16"),
        ("conv_kernel", 17, r"0 \(no conv\) or a kernel size in 1\.\.16"),
        ("conv_impl", "cudnn", r"one of \('xla_safe', 'maxtext_depthwise', 'triton', 'auto'\)"),
        ("eps", 0.0, r"a float in \(0, 1\)"),
        ("d_model", 0, "an int >= 1"),
    ],
)
def test_engram_config_names_field_and_allowed_values(field, value, allowed):
    kwargs = {**BASE, field: value}
    with pytest.raises(ValueError, match=rf"EngramConfig\.{field} must be {allowed}"):
        EngramConfig(**kwargs)


def test_engram_config_is_frozen_and_normalises_sequences():
    cfg = EngramConfig(**BASE, orders=[2, 3])
    assert cfg.orders == (2, 3)
    assert EngramConfig(**BASE, orders="2, 4").orders == (2, 4)  # command-line style
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.bottleneck = 8


@pytest.mark.parametrize("field, value", [("gated", "false"), ("conv_kernel", True), ("bottleneck", True), ("dropout", True)])
def test_engram_config_rejects_truthy_impostors(field, value):
    with pytest.raises(ValueError, match=rf"EngramConfig\.{field} must be"):
        EngramConfig(**{**BASE, field: value})


@pytest.mark.parametrize("field", ["n_layers", "layers", "mhc"])
def test_engram_config_holds_no_model_level_field(field):
    assert field not in {f.name for f in dataclasses.fields(EngramConfig)}
    with pytest.raises(ValueError, match=rf"EngramConfig has no field\(s\) \['{field}'\]"):
        EngramConfig.build(d_model=64, **{field: 1})
    assert not hasattr(EngramConfig, "from_args") and not hasattr(NgramHashConfig, "from_args")


def test_engram_config_build_reads_the_model_config_and_overrides():
    model = HybridConfig(**MODEL, engram_layers="1,3")
    cfg = EngramConfig.build(model, bottleneck=8, orders="2,3")
    assert (cfg.d_model, cfg.bottleneck, cfg.orders) == (64, 8, (2, 3))
    # prefixed source attributes win over bare ones; Megatron's hidden_size is d_model
    src = SimpleNamespace(hidden_size=32, engram_bottleneck=4, bottleneck=99, engram_gated=False)
    cfg = EngramConfig.build(src)
    assert (cfg.d_model, cfg.bottleneck, cfg.gated) == (32, 4, False)
    # a model's own bare eps / conv_kernel / dropout (e.g. a Mamba conv of 4, a norm eps) are not the branch's
    bare = EngramConfig.build(SimpleNamespace(d_model=512, eps=0.5, conv_kernel=7, dropout=0.5, orders=(5,)))
    assert bare == EngramConfig(d_model=512)
    with pytest.raises(ValueError, match=r"EngramConfig\.build needs \['d_model'\]"):
        EngramConfig.build(SimpleNamespace())
    with pytest.raises(ValueError, match=r"EngramConfig\.conv_impl must be one of"):
        EngramConfig.build(model, bottleneck=8, conv_impl="tpu")


# ----------------------------------------------------------------------------- HybridConfig (the stack)


@pytest.mark.parametrize(
    "field, value, allowed",
    [
        ("engram_layers", (0, 6), r"layer indices in \[0, n_layers=6\)"),
        ("engram_layers", (-1,), r"layer indices in \[0, n_layers=6\)"),
        ("engram_layers", (True,), r"layer indices in \[0, n_layers=6\)"),
        ("engram_layers", "0,9", r"layer indices in \[0, n_layers=6\)"),
        ("engram_layers", (1, 1), "unique layer indices"),
        ("engram_layers", "1,1", "unique layer indices"),
        ("engram_layers", "0,x", "a comma-separated list of layer indices or 'all'"),
        ("engram_layers", 3, "a sequence of layer indices"),
        ("ngram_layers", (6,), r"layer indices in \[0, n_layers=6\)"),
        ("ngram_layers", (2, 2), "unique layer indices"),
        ("ngram_layers", "a", "a comma-separated list of layer indices or 'all'"),
        ("n_layers", 0, "an int >= 1"),
        ("n_layers", True, "an int >= 1"),
        ("d_model", 0, "an int >= 1"),
        ("mhc", 1, "a bool"),
        ("vocab_size", 0, "an int >= 1"),
        ("pattern", "AMX", r"a non-empty string of block letters from \('A', 'M', 'R', 'E'\)"),
        ("pattern", " ", r"a non-empty string of block letters from \('A', 'M', 'R', 'E'\)"),
        ("pattern", ("A",) * 6, "a non-empty string of block letters"),
    ],
)
def test_hybrid_config_names_field_and_allowed_values(field, value, allowed):
    with pytest.raises(ValueError, match=rf"HybridConfig\.{field} must be {allowed}"):
        HybridConfig(**{**MODEL, field: value})


def test_hybrid_config_parses_layer_lists():
    assert HybridConfig(**MODEL, engram_layers="0,2,4").engram_layers == (0, 2, 4)
    assert HybridConfig(**MODEL, engram_layers=" ALL ").engram_layers == tuple(range(6))
    assert HybridConfig(**MODEL, engram_layers=[5]).engram_layers == (5,)
    assert HybridConfig(**MODEL, engram_layers="").engram_layers == ()
    assert HybridConfig(**MODEL, ngram_layers="1,3").ngram_layers == (1, 3)
    assert HybridConfig(**MODEL, ngram_layers="all").ngram_layers == tuple(range(6))
    cfg = HybridConfig(**MODEL, pattern="amr")
    assert cfg.pattern == "AMR" and cfg.blocks == "AMRAMR"  # the pattern tiled over the layers
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.engram_layers = (1,)


def test_hybrid_config_build_from_a_source_and_overrides():
    args = SimpleNamespace(hidden_size=128, num_layers=4, padded_vocab_size=512, engram_layers="all", mhc=False, lr=3e-4)
    cfg = HybridConfig.build(args, ngram_layers="1")
    assert (cfg.d_model, cfg.n_layers, cfg.engram_layers, cfg.ngram_layers) == (128, 4, (0, 1, 2, 3), (1,))
    assert HybridConfig.build(**MODEL) == HybridConfig(**MODEL)
    with pytest.raises(ValueError, match=r"HybridConfig\.build needs \['n_layers'\]"):
        HybridConfig.build(vocab_size=512, d_model=64)
    with pytest.raises(ValueError, match=r"HybridConfig has no field\(s\) \['bottleneck'\]"):
        HybridConfig.build(**MODEL, bottleneck=16)
    with pytest.raises(ValueError, match=r"HybridConfig\.engram_layers must be layer indices in \[0, n_layers=4\)"):
        HybridConfig.build(args, engram_layers="4")


def test_tripwire_mhc_without_engram_layers_defaults_to_all_layers_with_warning():
    """The historical bug: mHC fell back to an empty engram layer list and silently did nothing."""
    with pytest.warns(UserWarning, match="defaults? to all 6 layers") as record:
        cfg = HybridConfig(**MODEL, mhc=True)
    assert cfg.engram_layers == tuple(range(6)) and cfg.mhc
    assert record[0].filename == __file__  # attributed to the caller, not to the dataclass machinery
    with pytest.warns(UserWarning, match="defaults? to all 4 layers") as record:
        cfg = HybridConfig.build(SimpleNamespace(vocab_size=512, d_model=64, n_layers=4, mhc=True))
    assert cfg.engram_layers == (0, 1, 2, 3) and record[0].filename == __file__


@pytest.mark.parametrize("empty", ["", (), []])
def test_mhc_with_explicitly_empty_engram_layers_fails_closed(empty):
    with pytest.raises(ValueError, match=r"HybridConfig\.engram_layers must be non-empty when mhc=True .*silent no-op"):
        HybridConfig(**MODEL, mhc=True, engram_layers=empty)
    with pytest.raises(ValueError, match=r"HybridConfig\.engram_layers must be non-empty when mhc=True"):
        HybridConfig.build(SimpleNamespace(**MODEL, mhc=True, engram_layers=empty))


def test_no_mhc_and_no_layers_means_engram_off_without_warning():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cfg = HybridConfig(**MODEL)
    assert cfg.engram_layers == () and cfg.ngram_layers == () and not cfg.mhc


# ----------------------------------------------------------------------------- NgramHashConfig (one layer)

NG = dict(vocab_size=259, d_model=32, pad_id=258)


@pytest.mark.parametrize(
    "field, value, allowed",
    [
        ("vocab_size", 1, r"an int in 2\.\.1048576"),
        ("pad_id", 259, r"a token id in \[0, vocab_size=259\)"),
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


def test_ngram_hash_config_build():
    model = SimpleNamespace(d_model=32, n_layers=4, ngram_layers="1,3")  # any object with the model's attributes
    src = SimpleNamespace(vocab_size=259, pad_id=258, head_dim=128, seed=7, ngram_max_ngram=4)
    cfg = NgramHashConfig.build(model, vocab_size=259, pad_id=258, max_ngram=4)
    assert (cfg.d_model, cfg.orders, cfg.num_heads) == (32, (2, 3, 4), 12)
    # an attention head_dim or a training seed on the source is not the memory's: only ngram_<name> is read
    from_src = NgramHashConfig.build(src, d_model=32)
    assert (from_src.head_dim, from_src.seed, from_src.max_ngram) == (32, 0, 4)
    bare = NgramHashConfig.build(SimpleNamespace(**NG, eps=0.5, conv_kernel=7, max_ngram=5, table_size=11))
    assert bare == NgramHashConfig(**NG)
    for field in ("n_layers", "layers"):
        assert field not in {f.name for f in dataclasses.fields(NgramHashConfig)}
        with pytest.raises(ValueError, match=rf"NgramHashConfig has no field\(s\) \['{field}'\]"):
            NgramHashConfig.build(**NG, **{field: 2})
    with pytest.raises(ValueError, match=r"NgramHashConfig\.build needs \['vocab_size', 'pad_id'\]"):
        NgramHashConfig.build(model)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.head_dim = 4
    store = TableStoreConfig.build(cfg)
    assert store.table_vocab_sizes == cfg.table_sizes and store.embedding_dim == cfg.head_dim


# ----------------------------------------------------------------------------- one construction style


# every config class of nn/ and model/; the census below fails when one is added and not listed here
CONFIGS = (
    "megacpp_lab.nn.concept_bank.ConceptBankConfig",
    "megacpp_lab.nn.dsa.DSAConfig",
    "megacpp_lab.nn.engram.EngramConfig",
    "megacpp_lab.nn.hyper_connections.HyperConnectionConfig",
    "megacpp_lab.nn.lm_head.LMHeadConfig",
    "megacpp_lab.nn.m2rnn.M2RNNConfig",
    "megacpp_lab.nn.mamba3.Mamba3Config",
    "megacpp_lab.nn.mla.MLAConfig",
    "megacpp_lab.nn.moe.MoEConfig",
    "megacpp_lab.nn.ngram_hash.NgramHashConfig",
    "megacpp_lab.nn.rope_freqs.RopeScaling",
    "megacpp_lab.nn.ssm.SSDConfig",
    "megacpp_lab.nn.table_store.TableStoreConfig",
    "megacpp_lab.model.config.HybridConfig",
    "megacpp_lab.model.train_config.TrainConfig",
    "megacpp_lab.model.parallelize.ParallelConfig",
)


def _load(qualname: str) -> type:
    module, name = qualname.rsplit(".", 1)
    return getattr(importlib.import_module(module), name)


def test_the_config_census_lists_every_config_class():
    """Every class named *Config defined in a module of megacpp_lab.nn or megacpp_lab.model is in CONFIGS."""
    found = set()
    for package in (megacpp_lab.nn, megacpp_lab.model):
        for info in pkgutil.iter_modules(package.__path__):
            module = importlib.import_module(f"{package.__name__}.{info.name}")
            found |= {f"{module.__name__}.{name}" for name, obj in vars(module).items()
                      if inspect.isclass(obj) and obj.__module__ == module.__name__ and name.endswith("Config")}  # fmt: skip
    assert found - set(CONFIGS) == set(), "add these to CONFIGS"
    assert len(found) >= 7  # the discovery itself works


@pytest.mark.parametrize("qualname", CONFIGS, ids=lambda q: q.rsplit(".", 1)[1])
def test_every_config_is_a_frozen_dataclass_with_one_build_classmethod(qualname):
    cls = _load(qualname)
    assert dataclasses.is_dataclass(cls), f"{cls.__name__} is not a dataclass"
    assert cls.__dataclass_params__.frozen, f"{cls.__name__} is not frozen"
    assert isinstance(inspect.getattr_static(cls, "build", None), classmethod), f"{cls.__name__}.build is not a classmethod"
    assert list(inspect.signature(cls.build).parameters) == ["source", "overrides"], f"{cls.__name__}.build(source, **overrides)"
    others = [n for n, v in vars(cls).items() if isinstance(v, (classmethod, staticmethod)) and n != "build"]
    assert not others, f"{cls.__name__} has a second construction style: {others}"
    with pytest.raises(ValueError, match=rf"{cls.__name__} has no field\(s\) \['no_such_field'\]"):
        cls.build(no_such_field=1)


def test_m2rnn_config_builds_from_the_model_config():
    cfg = M2RNNConfig.build(HybridConfig(**MODEL), n_heads=2, k_head_dim=16, v_head_dim=16)
    assert (cfg.d_model, cfg.n_heads) == (64, 2)
