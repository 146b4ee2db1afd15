"""The model config: HybridConfig, the fields that describe the whole stack, not one layer, and its presets.

Per-layer configs (EngramConfig, NgramHashConfig, M2RNNConfig, SSDConfig, MLAConfig, ...) live beside
their layers in `megacpp_lab.nn` and hold only what one layer needs. Which layers exist, and which of
them carry an Engram branch, a hashed n-gram memory or hyper-connections, is decided here, once:

    cfg = HybridConfig.build(args, engram_layers="0,2", mhc=True)    # args: any object with attributes
    cfg.engram                                                         # the EngramConfig, d_model from cfg
    cfg = hybrid_preset("small", d_model=512)                          # a preset, reshaped

Every config has one construction style: a frozen dataclass, checked on construction, with
`build(source=None, **overrides)`, failing closed with a message that names the field.
"""

from __future__ import annotations

import functools
import math
import os
import sys
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from megacpp_lab.checks import check_ints, config_error, is_int
from megacpp_lab.nn.concept_bank import ConceptBankConfig
from megacpp_lab.nn.config_builder import build_config
from megacpp_lab.nn.dsa import DSAConfig
from megacpp_lab.nn.engram import EngramConfig
from megacpp_lab.nn.hyper_connections import HyperConnectionConfig
from megacpp_lab.nn.lm_head import LMHeadConfig
from megacpp_lab.nn.m2rnn import M2RNNConfig
from megacpp_lab.nn.mamba3 import Mamba3Config
from megacpp_lab.nn.mla import MLAConfig
from megacpp_lab.nn.moe import MoEConfig
from megacpp_lab.nn.ngram_hash import NgramHashConfig
from megacpp_lab.nn.ssm import SSDConfig

__all__ = ["BLOCK_KINDS", "HYBRID_PRESETS", "M_BLOCKS", "HybridConfig", "device_kernels", "hybrid_preset", "model_config"]

# block letters of the layer pattern: A = MLA + MLP, M = Mamba-3 (or Mamba-2's SSD) + MLP, R = M2RNN + MLP,
# E = the M block's mixer + a mixture of experts (nn/moe.py) in place of the MLP
BLOCK_KINDS = ("A", "M", "R", "E")
# the M block's mixer (HybridConfig.m_block): Mamba-3 (nn/mamba3.py, SISO or MIMO by mamba3.mimo_rank), or
# Mamba-2's SSD (nn/ssm.py), kept as the baseline one flag away
M_BLOCKS = ("mamba3", "mamba2")

_fail = functools.partial(config_error, "HybridConfig")
_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep


def _warn_at_caller(message: str) -> None:
    """A UserWarning attributed to the first frame outside megacpp_lab and the dataclass-generated __init__."""
    level, frame = 1, sys._getframe(0)
    while frame is not None and (frame.f_code.co_filename == "<string>"
                                 or os.path.abspath(frame.f_code.co_filename).startswith(_PACKAGE_DIR)):  # fmt: skip
        level, frame = level + 1, frame.f_back
    warnings.warn(message, UserWarning, stacklevel=level)


def _layer_list(name: str, value: str | Sequence[int], n_layers: int, fail: Any = _fail) -> tuple[int, ...]:
    """'0,2,4' / 'all' / '' / [0, 2] -> unique layer indices in [0, n_layers), or fail naming the field."""
    if isinstance(value, str):
        text = value.strip().lower()
        if text == "all":
            return tuple(range(n_layers))
        try:
            value = tuple(int(p) for p in text.split(",") if p.strip())
        except ValueError:
            raise fail(name, "a comma-separated list of layer indices or 'all'", value) from None
    if isinstance(value, (bytes, bytearray)) or not isinstance(value, Sequence):
        raise fail(name, "a sequence of layer indices, a comma-separated string or 'all'", value)
    layers = tuple(value)
    bad = [i for i in layers if not is_int(i) or not 0 <= i < n_layers]
    if bad:
        raise fail(name, f"layer indices in [0, n_layers={n_layers})", bad)
    if len(set(layers)) != len(layers):
        raise fail(name, "unique layer indices", layers)
    return layers


def _engram_layers(value: Any, mhc: bool, n_layers: int, fail: Any) -> tuple[int, ...]:
    """The Engram (and mHC) layers, with the tripwire: mhc without layers means all of them, loudly, and an
    explicitly empty list with mhc fails closed (mHC over no layer was a silent no-op)."""
    if value is None:
        if not mhc:
            return ()
        _warn_at_caller(f"mhc is on but no engram_layers were given: Engram (and mHC) default to all {n_layers} "
                        "layers. Pass engram_layers explicitly to choose.")  # fmt: skip
        return tuple(range(n_layers))
    layers = _layer_list("engram_layers", value, n_layers, fail)
    if mhc and not layers:
        raise fail("engram_layers", "non-empty when mhc=True (hyper-connections over no Engram layer are a silent "
                   "no-op; leave engram_layers unset for all layers)", value)  # fmt: skip
    return layers



# per-layer config field of HybridConfig -> (its class, defaults derived from the model's d_model)
def _mla_defaults(d: int) -> dict[str, Any]:
    heads = max(1, d // 128)
    head = 128 if d >= 128 else max(8, d // heads)
    return dict(n_heads=heads, q_lora_rank=max(16, d // 2), kv_lora_rank=max(16, d // 4), d_nope=head,
                d_rope=max(8, head // 2), d_v=head)  # fmt: skip


def _ssd_defaults(d: int) -> dict[str, Any]:
    head = 64 if d >= 256 else 16
    return dict(n_heads=max(1, 2 * d // head), head_dim=head, state_dim=128 if d >= 512 else 32)


def _moe_defaults(d: int) -> dict[str, Any]:
    # each expert half the dense MLP's hidden size (8/3 d): at the default top-2, the active FLOPs of the MLP
    return dict(expert_hidden=8 * math.ceil(4 * d / 3 / 8))


def _mamba3_defaults(d: int) -> dict[str, Any]:
    ssd = _ssd_defaults(d)
    return dict(ssd, rope_pairs=ssd["state_dim"] // 4)  # mamba_ssm's rope_fraction 0.5: a quarter of N in pairs


_SUBCONFIGS: dict[str, tuple[type, Any]] = {
    "mla": (MLAConfig, _mla_defaults),
    "ssd": (SSDConfig, _ssd_defaults),
    "mamba3": (Mamba3Config, _mamba3_defaults),
    "m2rnn": (M2RNNConfig, lambda d: dict(n_heads=max(1, d // 64))),  # per-head state 64 x 16 (K x V)
    "moe": (MoEConfig, _moe_defaults),
    "dsa": (DSAConfig, lambda d: dict(head_dim=64 if d >= 64 else 16)),  # a power of two: the Triton scores
    "engram": (EngramConfig, lambda d: dict(bottleneck=max(1, d // 4))),
    "ngram": (NgramHashConfig, lambda d: {}),
    "concept": (ConceptBankConfig, lambda d: dict(n_heads=max(1, d // 128), head_dim=min(64, d))),
    "hyper": (HyperConnectionConfig, lambda d: {}),
    "lm_head": (LMHeadConfig, lambda d: {}),
}


@dataclass(frozen=True)
class HybridConfig:
    """Everything HybridLM (megacpp_lab.model.hybrid) needs. Frozen, checked on construction, fails closed
    naming the field. Build it with HybridConfig.build, or from a preset with hybrid_preset(name, **overrides).

    pattern: block letters tiled across n_layers (layer i is pattern[i % len(pattern)]): A = MLA + SwiGLU MLP,
    M = the m_block mixer + MLP, R = M2RNN + MLP, E = the m_block mixer + a mixture of experts (its `moe` config)
    in place of the MLP. m_block: "mamba3" (Mamba-3, its `mamba3` config: SISO, or MIMO
    by mamba3.mimo_rank) or "mamba2" (Mamba-2's SSD, its `ssd` config). engram_layers / ngram_layers / cblock_layers: explicit layer indices
    (tuple, '0,2' or 'all'); mhc: multi-stream hyper-connections over the Engram layers (the tripwire: mhc
    without engram_layers means all layers, with a warning; an explicitly empty list fails: mHC over no layer
    was a silent no-op). mtp_depth / mtp_loss_weight: multi-token prediction (MTPModule in model/hybrid.py).

    dsa_layers: A layers whose attention is DeepSeek Sparse Attention (nn/dsa.py; its `dsa` config); an MTP
    module's block is never sparse.

    The per-layer configs (mla, ssd, mamba3, m2rnn, moe, dsa, engram, ngram, concept, hyper, lm_head) are built through each
    layer's own build(): leave one None for the defaults derived from d_model (and vocab_size / pad_id),
    give a dict of overrides, or a finished config (its d_model must match). All are built even when no
    layer uses them, so a bad field fails here, not at the first forward.
    """

    vocab_size: int
    d_model: int
    n_layers: int
    pattern: str = "AMRM"
    m_block: str = "mamba3"
    engram_layers: tuple[int, ...] | None = None
    mhc: bool = False
    ngram_layers: tuple[int, ...] = ()
    cblock_layers: tuple[int, ...] = ()
    dsa_layers: tuple[int, ...] = ()  # A layers that run DeepSeek Sparse Attention (nn/dsa.py, its `dsa` config)
    mlp_ratio: float = 8 / 3  # SwiGLU hidden = mlp_ratio * d_model, rounded up to a multiple of 64
    norm_eps: float = 1e-6
    pad_id: int = 2  # the tokenizer's pad id (the BPE's); the n-gram memory hashes tokens before a doc start as it
    # multi-token prediction (DeepSeek-V3's MTP, model/hybrid.py's MTPModule): mtp_depth modules after the stack,
    # module k predicting the token k+1 ahead through one dense MLA block and the shared LM head; the training
    # loss adds mtp_loss_weight times their mean loss. 0: none
    mtp_depth: int = 0
    mtp_loss_weight: float = 0.3
    mla: MLAConfig | Mapping[str, Any] | None = None
    ssd: SSDConfig | Mapping[str, Any] | None = None
    mamba3: Mamba3Config | Mapping[str, Any] | None = None
    m2rnn: M2RNNConfig | Mapping[str, Any] | None = None
    moe: MoEConfig | Mapping[str, Any] | None = None
    dsa: DSAConfig | Mapping[str, Any] | None = None
    engram: EngramConfig | Mapping[str, Any] | None = None
    ngram: NgramHashConfig | Mapping[str, Any] | None = None
    concept: ConceptBankConfig | Mapping[str, Any] | None = None
    hyper: HyperConnectionConfig | Mapping[str, Any] | None = None
    lm_head: LMHeadConfig | Mapping[str, Any] | None = None

    def __post_init__(self) -> None:
        check_ints("HybridConfig", self, ("vocab_size", "d_model", "n_layers"))
        if not isinstance(self.mhc, bool):
            raise _fail("mhc", "a bool", self.mhc)
        if not isinstance(self.pattern, str) or not self.pattern.strip() or any(
            c not in BLOCK_KINDS for c in self.pattern.strip().upper()
        ):
            raise _fail("pattern", f"a non-empty string of block letters from {BLOCK_KINDS}", self.pattern)
        object.__setattr__(self, "pattern", self.pattern.strip().upper())
        if self.m_block not in M_BLOCKS:
            raise _fail("m_block", f"one of {M_BLOCKS}", self.m_block)
        object.__setattr__(self, "engram_layers", _engram_layers(self.engram_layers, self.mhc, self.n_layers, _fail))
        for name in ("ngram_layers", "cblock_layers", "dsa_layers"):
            object.__setattr__(self, name, _layer_list(name, getattr(self, name), self.n_layers, _fail))
        not_a = [i for i in self.dsa_layers if self.blocks[i] != "A"]
        if not_a:
            raise _fail("dsa_layers", "indices of A layers (DSA is a kind of attention)", not_a)
        ratio = self.mlp_ratio
        if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0 < ratio <= 64:
            raise _fail("mlp_ratio", "a number in (0, 64]", ratio)
        if isinstance(self.norm_eps, bool) or not isinstance(self.norm_eps, float) or not 0 < self.norm_eps < 1:
            raise _fail("norm_eps", "a float in (0, 1)", self.norm_eps)
        if not is_int(self.mtp_depth) or not 0 <= self.mtp_depth <= 8:
            raise _fail("mtp_depth", "an int in [0, 8] (0: no multi-token prediction)", self.mtp_depth)
        w = self.mtp_loss_weight
        if isinstance(w, bool) or not isinstance(w, (int, float)) or not (math.isfinite(w) and w >= 0):
            raise _fail("mtp_loss_weight", "a finite number >= 0", w)
        if not is_int(self.pad_id) or not 0 <= self.pad_id < self.vocab_size:
            raise _fail("pad_id", f"a token id in [0, vocab_size={self.vocab_size})", self.pad_id)
        for name, (cls, defaults) in _SUBCONFIGS.items():
            object.__setattr__(self, name, self._sub_config(name, cls, defaults(self.d_model)))

    def _sub_config(self, name: str, cls: type, defaults: dict[str, Any]) -> Any:
        value = getattr(self, name)
        if isinstance(value, cls):
            config = value
        elif value is None or isinstance(value, Mapping):
            try:  # the layer's own builder reads d_model (vocab_size, pad_id) from this config
                config = cls.build(self, **{**defaults, **dict(value or {})})
            except ValueError as err:
                raise ValueError(f"HybridConfig.{name}: {err}") from None
        else:
            raise _fail(name, f"a {cls.__name__}, a dict of its fields, or None", value)
        for field in ("d_model", "vocab_size", "pad_id"):
            if hasattr(config, field) and hasattr(self, field) and getattr(config, field) != getattr(self, field):
                raise _fail(name, f"a {cls.__name__} with {field}={getattr(self, field)}", getattr(config, field))
        return config

    @classmethod
    def build(cls, source: Any = None, **overrides: Any) -> HybridConfig:
        """The one builder: fields from a source object (these names, hybrid_<name>, or Megatron's
        hidden_size / num_layers / padded_vocab_size) and keyword overrides, else the defaults."""
        aliases = {name: (f"hybrid_{name}", name) for name in cls.__dataclass_fields__}
        aliases.update(d_model=("d_model", "hidden_size"), n_layers=("n_layers", "num_layers"),
                       vocab_size=("vocab_size", "padded_vocab_size"))  # fmt: skip
        return build_config(cls, source, overrides, prefix="hybrid", aliases=aliases,
                            required=("vocab_size", "d_model", "n_layers"))  # fmt: skip

    @property
    def blocks(self) -> str:
        """The block letter of every layer: the pattern tiled across n_layers."""
        return (self.pattern * (self.n_layers // len(self.pattern) + 1))[: self.n_layers]

    @property
    def mlp_hidden(self) -> int:
        return 64 * math.ceil(self.mlp_ratio * self.d_model / 64)


# Presets: name -> HybridConfig fields. tiny: CPU tests (< 2M parameters); small: ~50M; base: 12 layers, d=1024;
# stack: every block kind, MoE, Engram and mHC.
HYBRID_PRESETS: dict[str, dict[str, Any]] = {
    "tiny": dict(
        vocab_size=512, d_model=64, n_layers=4, pattern="AMRM", engram_layers=(1,),
        mla=dict(n_heads=2, q_lora_rank=32, kv_lora_rank=32, d_nope=16, d_rope=16, d_v=16, max_positions=1024),
        ssd=dict(n_heads=4, head_dim=16, state_dim=16, chunk=16),
        mamba3=dict(n_heads=4, head_dim=16, state_dim=16, chunk=16, rope_pairs=4),
        m2rnn=dict(n_heads=2, k_head_dim=16, v_head_dim=16, chunk=16),
        engram=dict(bottleneck=16),
        ngram=dict(max_ngram=3, heads_per_order=2, table_size=61, head_dim=8),
        concept=dict(n_concepts=32, n_heads=2, head_dim=16),
        hyper=dict(n_streams=2),
    ),  # fmt: skip
    "small": dict(vocab_size=32768, d_model=384, n_layers=12, pattern="AMRM", engram_layers=(1, 5, 9)),
    "base": dict(vocab_size=32768, d_model=1024, n_layers=12, pattern="AMRM", engram_layers=(1, 5, 9)),
    # the seeds' taxonomy at a size one H100 trains: every block kind (per 8 layers 1 A, 4 M, 2 E, 1 R; the E blocks
    # 16 experts, top-2), Engram every fourth layer with mHC over those layers. The seeds' attention layout: some A
    # ranks MLA, others DSA (layer 0 dense, layer 8 sparse), and one MTP module (always dense MLA). About 548M
    # parameters, 313M active.
    "stack": dict(vocab_size=32768, d_model=1024, n_layers=16, pattern="AMEMRMEM", engram_layers=(1, 5, 9, 13),
                  mhc=True, dsa_layers=(8,), mtp_depth=1),  # fmt: skip
}


def hybrid_preset(name: str, **overrides: Any) -> HybridConfig:
    """A preset's HybridConfig with keyword overrides. A dict override of a per-layer config (mla=dict(...))
    is merged into the preset's dict for it; anything else replaces the preset's value."""
    if name not in HYBRID_PRESETS:
        raise ValueError(f"hybrid preset must be one of {tuple(HYBRID_PRESETS)}, got {name!r}")
    values = dict(HYBRID_PRESETS[name])
    for key, value in overrides.items():
        base = values.get(key)
        values[key] = {**base, **value} if isinstance(base, Mapping) and isinstance(value, Mapping) else value
    return HybridConfig.build(**values)


def model_config(preset: str, device: str, *, compiled: bool = False, **overrides: Any) -> HybridConfig:
    """The preset with its kernels named explicitly for the device and whether the model is compiled
    (device_kernels), asked for by name so that none falls back, loudly or silently."""
    kernels = device_kernels(device, compiled)
    # a dict override of a layer config (mamba3=dict(mimo_rank=2)) is merged into the device's kernel choice for it,
    # not put in its place: the kernel stays named
    merged = {k: {**kernels[k], **v} if k in kernels and isinstance(v, Mapping) else v for k, v in overrides.items()}
    return hybrid_preset(preset, **{**kernels, **merged})


def device_kernels(device: str, compiled: bool = False) -> dict[str, dict[str, str]]:
    """HybridConfig overrides that name the scans' and the loss's kernels for a device: Triton on a GPU; on a
    CPU the chunked SSD and Mamba-3 scans, the M2RNN reference loop and the eager chunked loss, but the scans'
    Triton kernels (under the interpreter) when the model is compiled, since a compiled graph holds the scans'
    custom ops and never the reference loops. The one place that rule is written. device: anything
    torch.device takes ('cuda:1', a torch.device); its type decides, and any type but cuda or cpu is refused (a
    GPU named another way must not quietly get the CPU's reference loops)."""
    import torch  # here: the configs themselves import no torch

    try:
        kind = torch.device(device).type
    except (RuntimeError, TypeError) as err:
        raise ValueError(f"device_kernels device: a torch device ('cuda', 'cuda:0', 'cpu'), got {device!r}") from err
    if kind not in ("cuda", "cpu"):
        raise ValueError(f"device_kernels device: the lab's kernels run on 'cuda' or 'cpu', got {device!r}")
    device = kind
    if device == "cuda" or compiled:
        scans = dict(m2rnn=dict(kernel="triton"), ssd=dict(kernel="triton"), mamba3=dict(kernel="triton"))
        return dict(scans, lm_head=dict(loss_impl="triton" if device == "cuda" else "eager"))
    return dict(m2rnn=dict(kernel="reference"), ssd=dict(kernel="chunked"), mamba3=dict(kernel="chunked"),
                lm_head=dict(loss_impl="eager"))  # fmt: skip
