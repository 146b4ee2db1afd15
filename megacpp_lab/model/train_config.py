"""TrainConfig: everything a training run needs, in one frozen dataclass, checked on construction (the error
names the field), built from a JSON/TOML file and flags with `TrainConfig.build`; and resolve_device, which
fails before any work on what this machine cannot do. The loop is model/train.py.

    config = TrainConfig(preset="small", steps=2000, batch_size=16, seq_len=1024, out_dir="runs/small")
    config = TrainConfig.build("run.toml", steps=500)      # a file, then flags over it
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

import torch

from megacpp_lab.checks import is_int
from megacpp_lab.model.parallelize import ParallelConfig
from megacpp_lab.nn.config_builder import Option, build_config, option, options

if TYPE_CHECKING:
    from megacpp_lab.model.config import HybridConfig

# model/config.py (the layers' configs, and through them the kernels) is imported where a preset is read, not
# here: TrainConfig's fields generate `megacpp-lab train`'s options, and building the parser stays light

__all__ = ["TrainConfig", "default_warmup", "resolve_device", "train_options"]


@dataclass(frozen=True)
class TrainConfig:
    """Everything a training run needs. Frozen, checked on construction (the error names the field);
    build it from a JSON/TOML file and flags with `TrainConfig.build`."""

    # model: a preset, optionally reshaped
    preset: str = option("small", "model preset: tiny, small or base")
    pattern: str | None = option(None, "block letters tiled over the layers, e.g. AMRM", shown="the preset's")
    d_model: int | None = option(None, "model width", shown="the preset's")
    n_layers: int | None = option(None, "layers", shown="the preset's")
    engram_layers: str | None = option(None, "Engram layers, e.g. 1,5,9, or none", shown="the preset's")
    ngram_layers: str | None = option(None, "hashed n-gram memory layers, e.g. 1,5,9, or none", shown="the preset's")
    m_block: str | None = option(None, "the M block's mixer: mamba3 or mamba2 (Mamba-2's SSD)", shown="the preset's")
    mimo_rank: int | None = option(None, "Mamba-3's MIMO rank: 1 (SISO), 2, 4 or 8", shown="the preset's")
    dsa_layers: str | None = option(None, "A layers that run DeepSeek Sparse Attention, e.g. 0,4, or none", shown="the preset's")
    dsa_top_k: int | None = option(None, "keys each query of a DSA layer attends", shown="the preset's")
    dsa_warmup_steps: int | None = option(None, "steps of the DSA indexer's dense warm-up", shown="the preset's")
    mtp_depth: int | None = option(None, "multi-token prediction modules after the stack (0: none)", shown="the preset's")
    mtp_loss_weight: float | None = option(None, "the MTP losses' weight in the training loss", shown="the preset's")
    # data
    corpus: str | None = option(None, "directory of C++ files, or a corpus `megacpp-lab data corpus` built (its "
                                "train, val and held-out library splits)", shown="the installed torch's headers")
    max_files: int | None = option(None, "read at most this many files of the corpus", shown="all")
    val_fraction: float = option(0.05, "share of files held out for validation, by path (a plain directory; a built "
                                 "corpus has its own splits)")
    seq_len: int = option(1024, "tokens per packed row, T")
    batch_size: int = option(8, "rows per batch, B")
    val_batches: int = option(8, "validation batches per evaluation")
    # optimisation
    steps: int = option(1000, "optimizer steps; the cosine schedule ends here")
    lr: float = option(1e-3, "peak learning rate")
    min_lr_ratio: float = option(0.1, "final LR as a fraction of the peak")
    # None: default_warmup(steps), resolved on construction, so the field (and the checkpoint's copy, which a
    # resume compares) always holds the number of steps the schedule warms up over
    warmup_steps: int | None = option(None, "linear warmup steps, fewer than --steps",
                                      shown="100, or --steps // 10 when that is fewer")  # fmt: skip
    weight_decay: float = option(0.1, "AdamW weight decay on matrices")
    beta1: float = option(0.9, "AdamW beta1")
    beta2: float = option(0.95, "AdamW beta2")
    grad_clip: float = option(1.0, "clip the global gradient norm to this; 0 = off")
    # run
    device: str = option("auto", "auto, cpu or cuda", shown="auto: cuda when there is one")
    # how the model is made ready (model/parallelize.py): dtype, the remat policy, compile, FSDP2's options.
    # Flags and flat keys of a config file with these names (compile, remat, ...) land here (TrainConfig.build)
    parallel: ParallelConfig = dataclasses.field(default_factory=ParallelConfig)
    seed: int = option(0, "seed of the weights and of the data order")
    data_seed: int | None = option(None, "seed of the data order alone (an ablation's seeds vary the weights over "
                                   "the same batches)", shown="seed")
    log_every: int = option(10, "steps per logged training loss")
    val_every: int = option(100, "steps per validation")
    ckpt_every: int = option(200, "steps per checkpoint")
    tensorboard: bool = option(True, "write TensorBoard scalars under <out-dir>/tensorboard")
    trace_steps: int = option(0, "profile the last N steps on rank 0 into <out-dir>/trace/ (torch.profiler; their "
                                 "log interval is marked traced); 0 = off")  # fmt: skip
    out_dir: str = option("runs/train", "run directory: checkpoint.pt, history.json, loss.png, tensorboard/")

    def __post_init__(self) -> None:
        def fail(name: str, expected: str) -> ValueError:
            return ValueError(f"TrainConfig.{name} must be {expected}, got {getattr(self, name)!r}")

        def is_num(v: Any) -> bool:
            return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)

        from megacpp_lab.model.config import HYBRID_PRESETS, M_BLOCKS
        from megacpp_lab.nn.mamba3 import MIMO_RANKS

        if self.preset not in HYBRID_PRESETS:
            raise fail("preset", f"one of {tuple(HYBRID_PRESETS)}")
        if self.m_block is not None and self.m_block not in M_BLOCKS:
            raise fail("m_block", f"one of {M_BLOCKS} or None")
        if self.mimo_rank is not None and (isinstance(self.mimo_rank, bool) or self.mimo_rank not in MIMO_RANKS):
            raise fail("mimo_rank", f"one of {MIMO_RANKS} or None")
        if self.mimo_rank not in (None, 1) and self.m_block == "mamba2":
            raise fail("mimo_rank", "1 or None with m_block='mamba2' (MIMO is Mamba-3's; Mamba-2's SSD has no rank)")
        for name in ("d_model", "n_layers", "max_files"):
            v = getattr(self, name)
            if v is not None and (not is_int(v) or v < 1):
                raise fail(name, "an int >= 1 or None")
        for name in ("seq_len", "batch_size", "val_batches", "steps", "log_every", "val_every", "ckpt_every"):
            if not is_int(getattr(self, name)) or getattr(self, name) < 1:
                raise fail(name, "an int >= 1")
        if self.seq_len < 16:
            raise fail("seq_len", "at least 16 tokens")
        if self.warmup_steps is None:  # frozen: the one place the default is resolved
            object.__setattr__(self, "warmup_steps", default_warmup(self.steps))
        for name in ("warmup_steps", "seed", "trace_steps"):
            if not is_int(getattr(self, name)) or getattr(self, name) < 0:
                raise fail(name, "an int >= 0")
        if self.data_seed is not None and (not is_int(self.data_seed) or self.data_seed < 0):
            raise fail("data_seed", "an int >= 0 or None")
        if self.warmup_steps >= self.steps:
            raise fail("warmup_steps", f"fewer than steps={self.steps}")
        if self.trace_steps and self.trace_steps + 1 >= self.steps:  # +1: the profiler's warm-up step
            raise fail("trace_steps", f"fewer than steps - 1 = {self.steps - 1} (the first step compiles)")
        if not is_num(self.lr) or not 0 < self.lr < 1:
            raise fail("lr", "a number in (0, 1)")
        for name in ("min_lr_ratio", "weight_decay", "beta1", "beta2"):
            v = getattr(self, name)
            if not is_num(v) or not 0 <= v < 1 + (name == "min_lr_ratio"):
                raise fail(name, "a number in [0, 1]" if name == "min_lr_ratio" else "a number in [0, 1)")
        if not is_num(self.grad_clip) or self.grad_clip < 0:
            raise fail("grad_clip", "a number >= 0 (0 = no clipping)")
        if not is_num(self.val_fraction) or not 0 < self.val_fraction < 1:
            raise fail("val_fraction", "a number in (0, 1)")
        if self.device not in ("auto", "cpu", "cuda"):
            raise fail("device", "'auto', 'cpu' or 'cuda'")
        if isinstance(self.parallel, Mapping):  # a config file's [parallel] table, a checkpoint's asdict
            object.__setattr__(self, "parallel", ParallelConfig(**self.parallel))
        if not isinstance(self.parallel, ParallelConfig):
            raise fail("parallel", "a ParallelConfig (or a mapping of its fields)")
        for name in ("tensorboard",):
            if not isinstance(getattr(self, name), bool):
                raise fail(name, "a bool")
        for name in ("pattern", "engram_layers", "ngram_layers", "dsa_layers", "corpus"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), str):
                raise fail(name, "a string or None")
        if not isinstance(self.out_dir, str) or not self.out_dir:
            raise fail("out_dir", "a non-empty path")

    @classmethod
    def build(cls, source: Any = None, **overrides: Any) -> TrainConfig:
        """The one builder: fields from a source (a .json / .toml file of TrainConfig fields, a mapping, or an
        object with these attributes), then keyword overrides, else the defaults. Unknown fields are refused,
        named; an override of None means "not given" (an unset command-line flag)."""
        if isinstance(source, (str, Path)):
            path = Path(source)
            values = _read_config_file(path)
            unknown = sorted(set(values) - set(cls.__dataclass_fields__) - set(ParallelConfig.__dataclass_fields__))
            if unknown:
                raise ValueError(f"config file {path}: TrainConfig has no field(s) {unknown}")
            source = SimpleNamespace(**values)
        elif isinstance(source, Mapping):
            source = SimpleNamespace(**source)
        given = {k: v for k, v in overrides.items() if v is not None}
        # ParallelConfig's fields, given flat (command-line flags, a flat config file): into `parallel`
        flat = {k for k in ParallelConfig.__dataclass_fields__ if k in given or hasattr(source, k)}
        if flat:
            if source is not None and hasattr(source, "parallel") and any(hasattr(source, k) for k in flat):
                raise ValueError(f"TrainConfig.build: {sorted(k for k in flat if hasattr(source, k))} given both flat "
                                 "and under 'parallel': give each once")  # fmt: skip
            base = getattr(source, "parallel", None) if source is not None else None
            base = dataclasses.asdict(base) if isinstance(base, ParallelConfig) else dict(base or {})
            base.update({k: getattr(source, k) for k in flat if source is not None and hasattr(source, k)})
            base.update({k: given.pop(k) for k in flat if k in given})
            given["parallel"] = ParallelConfig(**base)
            if source is not None:
                source = SimpleNamespace(**{k: v for k, v in vars(source).items() if k not in flat and k != "parallel"})
        return build_config(cls, source, given, prefix="train", aliases={}, required=())

    def hybrid_config(self, device: str, vocab_size: int) -> HybridConfig:
        """The model's config: the preset with this run's reshaping, the tokenizer's vocab, and scans named
        for the device (Triton on a GPU, and on a CPU when compiled: the reference loops cannot enter a graph)."""
        from megacpp_lab.model.config import model_config

        overrides: dict[str, Any] = {"vocab_size": vocab_size}
        for name in ("pattern", "d_model", "n_layers", "m_block", "mtp_depth", "mtp_loss_weight"):
            if getattr(self, name) is not None:
                overrides[name] = getattr(self, name)
        if self.mimo_rank is not None:
            overrides["mamba3"] = dict(mimo_rank=self.mimo_rank)
        if self.engram_layers is not None:
            overrides["engram_layers"] = "" if self.engram_layers.strip().lower() == "none" else self.engram_layers
        if self.ngram_layers is not None:
            overrides["ngram_layers"] = "" if self.ngram_layers.strip().lower() == "none" else self.ngram_layers
        if self.dsa_layers is not None:
            overrides["dsa_layers"] = "" if self.dsa_layers.strip().lower() == "none" else self.dsa_layers
        dsa = {k: v for k, v in (("top_k", self.dsa_top_k), ("warmup_steps", self.dsa_warmup_steps)) if v is not None}
        if dsa:
            overrides["dsa"] = dsa
        return model_config(self.preset, device, compiled=self.parallel.compile, **overrides)


def train_options() -> list[Option]:
    """`megacpp-lab train`'s settings options, generated from the fields: TrainConfig's, with ParallelConfig's
    in place of `parallel` (but the backend, which the benches choose)."""
    own = options(TrainConfig, skip=("parallel",))
    at = [f.name for f in dataclasses.fields(TrainConfig)].index("parallel")
    return own[:at] + options(ParallelConfig, skip=("backend",)) + own[at:]


def default_warmup(steps: int) -> int:
    """TrainConfig.warmup_steps when not given: a tenth of the steps, at most 100 (0 below 10 steps)."""
    return min(100, steps // 10)


def _read_config_file(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise FileNotFoundError(f"no config file {path}")
    text = path.read_text()
    try:
        if path.suffix == ".toml":
            import tomllib

            values = tomllib.loads(text)
        elif path.suffix == ".json":
            values = json.loads(text)
        else:
            raise ValueError(f"config file {path}: expected a .json or .toml file")
    except (json.JSONDecodeError, ValueError) as err:
        raise ValueError(f"config file {path} cannot be parsed: {err}") from None
    if not isinstance(values, dict):
        raise ValueError(f"config file {path} must hold a table of TrainConfig fields, got {type(values).__name__}")
    return values


def resolve_device(config: TrainConfig) -> tuple[str, torch.dtype]:
    """(device, dtype) for the run; fails before any work on what this machine cannot do."""
    device = ("cuda" if torch.cuda.is_available() else "cpu") if config.device == "auto" else config.device
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("TrainConfig.device is 'cuda' but this machine has no CUDA device")
    dtype = config.parallel.resolve_dtype(device)
    if config.parallel.compile and device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError("TrainConfig.parallel.compile on a CPU needs TRITON_INTERPRET=1: the compiled blocks run the scans' "
                         "Triton kernels (under the interpreter on a CPU); the reference loops cannot enter a graph")
    return device, dtype
