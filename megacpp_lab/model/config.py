"""The model config: the fields that describe the whole stack, not one layer.

Per-layer configs (EngramConfig, NgramHashConfig, M2RNNConfig, SSDConfig, MLAConfig, ...) live beside
their layers in `megacpp_lab.nn` and hold only what one layer needs. Which layers exist, and which of
them carry an Engram branch, a hashed n-gram memory or hyper-connections, is decided here, once:

    cfg = ModelConfig.build(args, engram_layers="0,2", mhc=True)     # args: any object with attributes
    engram = EngramConfig.build(cfg, bottleneck=64)                   # d_model comes from cfg
    branches = {i: EngramBranch(engram) for i in cfg.engram_layers}

Every config has one construction style: a frozen dataclass, checked on construction, with
`build(source=None, **overrides)`, failing closed with a message that names the field.
"""

from __future__ import annotations

import functools
import os
import sys
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from megacpp_lab.nn.config_builder import build_config, config_error

__all__ = ["BLOCK_KINDS", "ModelConfig"]

# block letters of the layer pattern: A = MLA + MLP, M = SSD + MLP, R = M2RNN + MLP
BLOCK_KINDS = ("A", "M", "R")

_fail = functools.partial(config_error, "ModelConfig")
_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep


def _warn_at_caller(message: str) -> None:
    """A UserWarning attributed to the first frame outside megacpp_lab and the dataclass-generated __init__."""
    level, frame = 1, sys._getframe(0)
    while frame is not None and (frame.f_code.co_filename == "<string>"
                                 or os.path.abspath(frame.f_code.co_filename).startswith(_PACKAGE_DIR)):  # fmt: skip
        level, frame = level + 1, frame.f_back
    warnings.warn(message, UserWarning, stacklevel=level)


def _layer_list(name: str, value: str | Sequence[int], n_layers: int) -> tuple[int, ...]:
    """'0,2,4' / 'all' / '' / [0, 2] -> unique layer indices in [0, n_layers), or fail naming the field."""
    if isinstance(value, str):
        text = value.strip().lower()
        if text == "all":
            return tuple(range(n_layers))
        try:
            value = tuple(int(p) for p in text.split(",") if p.strip())
        except ValueError:
            raise _fail(name, "a comma-separated list of layer indices or 'all'", value) from None
    if isinstance(value, (bytes, bytearray)) or not isinstance(value, Sequence):
        raise _fail(name, "a sequence of layer indices, a comma-separated string or 'all'", value)
    layers = tuple(value)
    bad = [i for i in layers if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < n_layers]
    if bad:
        raise _fail(name, f"layer indices in [0, n_layers={n_layers})", bad)
    if len(set(layers)) != len(layers):
        raise _fail(name, "unique layer indices", layers)
    return layers


@dataclass(frozen=True)
class ModelConfig:
    """Model-level settings. Frozen; every field is checked on construction. Build it with ModelConfig.build.

    engram_layers / ngram_layers take a tuple, a comma-separated string or 'all'. Left as None,
    engram_layers is empty, or every layer when mhc=True (with a warning): hyper-connections wrap the
    Engram layers, and over none of them they would be a silent no-op. An explicitly empty list with
    mhc=True is refused.
    """

    d_model: int
    n_layers: int
    # block letters, one per layer (A = MLA, M = SSD, R = M2RNN, each + MLP); "" until the hybrid model
    # chooses one
    pattern: str = ""
    engram_layers: tuple[int, ...] | None = None
    # multi-stream hyper-connections (mHC) over the Engram layers
    mhc: bool = False
    # layers with a hashed n-gram memory (NgramHashMemory(config, layer_id) for each)
    ngram_layers: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        for name in ("d_model", "n_layers"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise _fail(name, "an int >= 1", value)
        if not isinstance(self.mhc, bool):
            raise _fail("mhc", "a bool", self.mhc)
        if not isinstance(self.pattern, str):
            raise _fail("pattern", f"a string of block letters {BLOCK_KINDS}", self.pattern)
        pattern = self.pattern.strip().upper()
        if pattern and (len(pattern) != self.n_layers or any(c not in BLOCK_KINDS for c in pattern)):
            raise _fail("pattern", f"{self.n_layers} (n_layers) block letters from {BLOCK_KINDS}, or ''", self.pattern)
        object.__setattr__(self, "pattern", pattern)
        if self.engram_layers is None:
            engram_layers: tuple[int, ...] = ()
            if self.mhc:
                _warn_at_caller(
                    f"mhc is on but no engram_layers were given: Engram (and mHC) default to all {self.n_layers} "
                    "layers. Pass engram_layers explicitly to choose."
                )
                engram_layers = tuple(range(self.n_layers))
        else:
            engram_layers = _layer_list("engram_layers", self.engram_layers, self.n_layers)
        if self.mhc and not engram_layers:
            raise _fail(
                "engram_layers",
                "non-empty when mhc=True (hyper-connections over no Engram layer are a silent no-op; "
                "leave engram_layers unset for all layers)",
                self.engram_layers,
            )
        object.__setattr__(self, "engram_layers", engram_layers)
        object.__setattr__(self, "ngram_layers", _layer_list("ngram_layers", self.ngram_layers, self.n_layers))

    @classmethod
    def build(cls, source: Any = None, **overrides: Any) -> ModelConfig:
        """The one builder: fields from a source object (these names, model_<name>, or Megatron's
        hidden_size / num_layers) and keyword overrides, else the defaults."""
        aliases = {"d_model": ("d_model", "hidden_size"), "n_layers": ("n_layers", "num_layers")}
        return build_config(cls, source, overrides, prefix="model", aliases=aliases, required=("d_model", "n_layers"))

    def block(self, layer: int) -> str:
        """The block letter of one layer ('' while no pattern is set)."""
        if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer < self.n_layers:
            raise ValueError(f"layer must be an int in [0, n_layers={self.n_layers}), got {layer!r}")
        return self.pattern[layer] if self.pattern else ""
