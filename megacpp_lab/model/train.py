"""Training HybridLM on packed C++ rows: one config, one loop, atomic checkpoints that resume bit-exactly.

    config = TrainConfig(preset="small", steps=2000, batch_size=16, seq_len=1024, out_dir="runs/small")
    result = train(config)                      # resumes from out_dir/checkpoint.pt when it is there
    model, model_config = load_checkpoint_model("runs/small/checkpoint.pt")

The loop, per step: the next packed batch (data.PackedRowStream: shuffled per epoch, deterministic per
seed, validation files held out by path), its PackedContext built once outside the model, next-token
targets that never cross a document boundary, forward to the fused loss, backward, then
MasterWeightAdamW: gradients into fp32 master weights, clip the global norm, fused AdamW on the masters,
and the bf16 model weights rounded from them. Parameters a layer declares fp32 (`_fp32_params`: decays,
RoPE tables) are fp32 in the model and are their own masters. On a CPU in fp32 every parameter is its
own master and nothing is copied.

LR: linear warmup from 0 to `lr` over `warmup_steps` (by default a tenth of `steps`, at most 100), then
cosine down to `lr * min_lr_ratio` at `steps`; a function of the step alone, so a resumed run needs no
scheduler state.

Checkpoints (out_dir/checkpoint.pt) are written to a temporary file, flushed to disk and renamed over the
old one: an interrupted save leaves the previous checkpoint whole. A checkpoint holds the master weights,
the optimizer state, the loader position, the RNG states, the step, both configs and the history so far,
and resuming from it continues exactly as the uninterrupted run would have (tested bit for bit on a CPU).
A checkpoint that cannot be read, lacks a field, or was written for another config fails with an error
that names the field.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from torch import nn

from megacpp_lab.data import PackedRowStream, load_bpe, load_corpus, next_token_targets, split_by_file, tokenize_files
from megacpp_lab.nn.config_builder import build_config
from megacpp_lab.model.config import HYBRID_PRESETS, HybridConfig, model_config
from megacpp_lab.model.hybrid import HybridLM
from megacpp_lab.model.distributed import (
    SHARDED_DIR,
    Ranks,
    all_reduce_sum,
    init_ranks,
    latest_sharded,
    load_sharded,
    load_sharded_full,
    rank_rows,
    read_sharded_meta,
    save_sharded,
    token_share,
)
from megacpp_lab.model.parallelize import ParallelConfig, block_structures, describe_compile, parallelize
from megacpp_lab.model.precompile import precompile
from megacpp_lab.varlen import PackedContext, build_context, copy_to_device

__all__ = [
    "CHECKPOINT_FILE",
    "MasterWeightAdamW",
    "TrainConfig",
    "TokenizedCorpus",
    "TrainResult",
    "check_resume",
    "default_warmup",
    "load_checkpoint",
    "load_checkpoint_model",
    "read_history",
    "lr_at",
    "resolve_device",
    "save_checkpoint",
    "tokenize_corpus",
    "train",
]

CHECKPOINT_FILE = "checkpoint.pt"
# token ids of the corpus, cached between runs and ranks (data.tokenize_files): build/ beside the package
TOKEN_CACHE = Path(__file__).resolve().parents[2] / "build" / "tokenized"
CHECKPOINT_FORMAT = 2  # 2: the optimizer state keyed by parameter name (any process count)
CHECKPOINT_FIELDS = ("format", "step", "train_config", "model_config", "model", "optimizer", "loader", "rng", "history",
                     "pending_loss")
# fields that may change between a run and its resume: where and how often it reports, not what it computes
RESUME_FREE = ("out_dir", "log_every", "val_every", "ckpt_every", "tensorboard", "trace_steps",
               "parallel.reshard_after_forward", "parallel.fsdp_blocks_per_group", "parallel.compile_workers")
HISTORY_FILE = "history.json"


@dataclass(frozen=True)
class TrainConfig:
    """Everything a training run needs. Frozen, checked on construction (the error names the field);
    build it from a JSON/TOML file and flags with `TrainConfig.build`."""

    # model: a preset, optionally reshaped
    preset: str = "small"
    pattern: str | None = None
    d_model: int | None = None
    n_layers: int | None = None
    engram_layers: str | None = None  # None: the preset's; "none": no Engram branch; "1,5": those layers
    # data
    corpus: str | None = None  # a directory of C++ files; None: the installed torch's headers
    max_files: int | None = None
    val_fraction: float = 0.05
    seq_len: int = 1024
    batch_size: int = 8
    val_batches: int = 8
    # optimisation
    steps: int = 1000
    lr: float = 1e-3
    min_lr_ratio: float = 0.1
    # None: default_warmup(steps), resolved on construction, so the field (and the checkpoint's copy, which a
    # resume compares) always holds the number of steps the schedule warms up over
    warmup_steps: int | None = None
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0
    # run
    device: str = "auto"  # auto: cuda when there is one
    # how the model is made ready (model/parallelize.py): dtype, the remat policy, compile, FSDP2's options.
    # Flags and flat keys of a config file with these names (compile, remat, ...) land here (TrainConfig.build)
    parallel: ParallelConfig = dataclasses.field(default_factory=ParallelConfig)
    seed: int = 0
    log_every: int = 10
    val_every: int = 100
    ckpt_every: int = 200
    tensorboard: bool = True
    trace_steps: int = 0  # profile the run's last steps on rank 0 (torch.profiler) into out_dir/trace/
    out_dir: str = "runs/train"

    def __post_init__(self) -> None:
        def fail(name: str, expected: str) -> ValueError:
            return ValueError(f"TrainConfig.{name} must be {expected}, got {getattr(self, name)!r}")

        def is_int(v: Any) -> bool:
            return isinstance(v, int) and not isinstance(v, bool)

        def is_num(v: Any) -> bool:
            return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)

        if self.preset not in HYBRID_PRESETS:
            raise fail("preset", f"one of {tuple(HYBRID_PRESETS)}")
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
        for name in ("pattern", "engram_layers", "corpus"):
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
        overrides: dict[str, Any] = {"vocab_size": vocab_size}
        for name in ("pattern", "d_model", "n_layers"):
            if getattr(self, name) is not None:
                overrides[name] = getattr(self, name)
        if self.engram_layers is not None:
            overrides["engram_layers"] = "" if self.engram_layers.strip().lower() == "none" else self.engram_layers
        return model_config(self.preset, device, compiled=self.parallel.compile, **overrides)


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


def lr_at(step: int, config: TrainConfig) -> float:
    """Linear warmup to lr over warmup_steps, then cosine to lr * min_lr_ratio at `steps`."""
    if step < config.warmup_steps:
        return config.lr * (step + 1) / config.warmup_steps
    progress = min(1.0, (step - config.warmup_steps) / max(1, config.steps - config.warmup_steps))
    floor = config.lr * config.min_lr_ratio
    return floor + 0.5 * (config.lr - floor) * (1 + math.cos(math.pi * progress))


# ----------------------------------------------------------------------------- the optimizer


class MasterWeightAdamW:
    """AdamW over fp32 master weights of a (possibly bf16) model; see the module docstring.

    Weight decay applies to matrices (2-D and up), never to norms, biases, decays or the embedding."""

    def __init__(self, model: nn.Module, config: TrainConfig, *, fused: bool = True) -> None:
        self.named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        persistent = model.state_dict().keys()  # not the RoPE tables, which are rebuilt, never saved
        self.buffers = [(n, b) for n, b in model.named_buffers() if n in persistent]
        self.masters = [p if p.dtype == torch.float32 else p.detach().float().requires_grad_() for _, p in self.named]
        self.copied = [i for i, (_, p) in enumerate(self.named) if self.masters[i] is not p]
        from torch.distributed.tensor import DTensor

        # one group per (decay, sharded): under FSDP2 a fused step cannot mix DTensors with the replicated
        # fp32-contract parameters' plain tensors, and AdamW steps each group on its own
        groups = []
        for decays in (True, False):
            for sharded in (True, False):
                params = [m for (n, p), m in zip(self.named, self.masters)
                          if (p.dim() >= 2 and not n.startswith("embed.")) == decays and isinstance(p, DTensor) == sharded]
                if params:
                    groups.append(dict(params=params, weight_decay=config.weight_decay if decays else 0.0))
        self.optimizer = torch.optim.AdamW(groups, lr=config.lr, betas=(config.beta1, config.beta2), fused=fused)
        self.grad_clip = config.grad_clip

    def step(self, lr: float) -> torch.Tensor:
        """Gradients to the masters, clip, step, round back; returns the global gradient norm (before
        clipping, a 0-dim fp32 tensor: no host sync).

        Under FSDP2 the sharded masters and their gradients are DTensors, and every op on a list of DTensors
        pays DTensor's dispatch on the host (about 10 ms a step for the norm, the clip and the fused AdamW of
        the base preset, in a step the host must issue faster than the GPU runs it). Clipping and AdamW are
        elementwise on each shard, so they run on the local shards (DTensor.to_local, no copy); the norm
        sums the shards' squares over the mesh in one all-reduce."""
        for i in self.copied:
            g = self.named[i][1].grad
            self.masters[i].grad = None if g is None else g.float()
        grads = [m.grad for m in self.masters if m.grad is not None]
        norm = _global_norm(grads)
        if self.grad_clip > 0 and grads:  # scale by min(1, clip / norm) on the device: no host sync
            factor = torch.clamp(self.grad_clip / (norm + 1e-6), max=1.0)
            torch._foreach_mul_(_local(grads), factor)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self._adamw_step(lr)
        if self.copied:
            with torch.no_grad():
                torch._foreach_copy_([self.named[i][1] for i in self.copied], [self.masters[i] for i in self.copied])
        return norm.detach().float()

    @torch.no_grad()
    def _adamw_step(self, lr: float) -> None:
        """torch.optim.AdamW's fused step (the same `_foreach_add_` of the step counts and `_fused_adamw_`, so
        the same bits) on the local shards. The first step, and any step with a parameter that has no state
        yet, goes through torch.optim, which creates the state as it always does."""
        opt = self.optimizer
        live = [[p for p in g["params"] if p.grad is not None] for g in opt.param_groups]
        if not opt.defaults["fused"] or any(p not in opt.state for ps in live for p in ps):
            opt.step()
            return
        beta1, beta2 = opt.defaults["betas"]
        for group, params in zip(opt.param_groups, live):
            if not params:
                continue
            state = [opt.state[p] for p in params]
            steps = _local([st["step"] for st in state])
            torch._foreach_add_(steps, 1)
            torch._fused_adamw_(_local(params), _local([p.grad for p in params]), _local([st["exp_avg"] for st in state]),
                                _local([st["exp_avg_sq"] for st in state]), [], steps, amsgrad=False, lr=lr,
                                beta1=beta1, beta2=beta2, weight_decay=group["weight_decay"], eps=group["eps"],
                                maximize=False, grad_scale=None, found_inf=None)  # fmt: skip

    def zero_grad(self) -> None:
        for (_, p), m in zip(self.named, self.masters):
            p.grad = None
            m.grad = None

    def optimizer_state_by_name(self) -> dict[str, Any]:
        """The AdamW state keyed by parameter name (torch.distributed.checkpoint's layout), so a checkpoint
        fits any process count and any parameter order."""
        raw = self.optimizer.state_dict()
        index = self._names_in_optimizer_order()
        groups = [{**g, "params": [index[i] for i in g["params"]]} for g in raw["param_groups"]]
        return {"state": {index[i]: st for i, st in raw["state"].items()}, "param_groups": groups}

    def load_optimizer_state_by_name(self, state: dict[str, Any], where: str) -> None:
        """Load a state from optimizer_state_by_name (of this or any other process count); fails naming the field."""
        order = self._names_in_optimizer_order()
        index = {n: i for i, n in enumerate(order)}
        try:  # groups differ with the process count (FSDP2 splits sharded from replicated): match by name
            saved_group = {n: g for g in state["param_groups"] for n in g["params"]}
            groups, i = [], 0
            for mine in self.optimizer.param_groups:
                names = order[i : i + len(mine["params"])]
                i += len(names)
                hyper = [{k: v for k, v in saved_group[n].items() if k != "params"} for n in names]
                if any(h != hyper[0] for h in hyper):
                    raise ValueError(f"parameters {names[:3]}... share a group here but not in the checkpoint")
                groups.append({**hyper[0], "params": [index[n] for n in names]})
            raw = {"state": {index[n]: st for n, st in state["state"].items()}, "param_groups": groups}
            self.optimizer.load_state_dict(raw)
        except (KeyError, TypeError, ValueError, RuntimeError) as err:
            raise ValueError(f"{where}: field 'optimizer' does not fit this model: {type(err).__name__}: {err}") from None

    def _names_in_optimizer_order(self) -> list[str]:
        ids = {id(m): n for (n, _), m in zip(self.named, self.masters)}
        return [ids[id(m)] for g in self.optimizer.param_groups for m in g["params"]]

    def master_state_dict(self) -> dict[str, torch.Tensor]:
        """The model's parameters at full precision (the masters), by HybridLM parameter name, plus its
        buffers."""
        state = {n: m.detach().clone() for (n, _), m in zip(self.named, self.masters)}
        state.update((n, b.detach().clone()) for n, b in self.buffers)
        return state

    def load_master_state_dict(self, model: nn.Module, state: dict[str, torch.Tensor], where: str) -> None:
        """Load masters (and the model's weights rounded from them) and buffers; fails naming the tensor."""
        expected = dict(model.state_dict(keep_vars=True))
        missing, unexpected = sorted(set(expected) - set(state)), sorted(set(state) - set(expected))
        if missing or unexpected:
            raise ValueError(f"{where}: field 'model' does not fit this model: missing {missing[:5]}, "
                             f"unexpected {unexpected[:5]}")  # fmt: skip
        for name, t in expected.items():
            if not isinstance(state[name], torch.Tensor) or state[name].shape != t.shape:
                got = getattr(state[name], "shape", type(state[name]).__name__)
                raise ValueError(f"{where}: field 'model.{name}' has shape {tuple(got)}, this model's is {tuple(t.shape)}")
        with torch.no_grad():
            for (n, p), m in zip(self.named, self.masters):
                m.copy_(state[n])
                if m is not p:
                    p.copy_(m)
            for n, b in self.buffers:
                b.copy_(state[n])


def _local(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Each DTensor's local shard (a view: in-place ops on it update the DTensor), other tensors as they are."""
    from torch.distributed.tensor import DTensor

    return [t.to_local() if isinstance(t, DTensor) else t for t in tensors]


def _global_norm(grads: list[torch.Tensor]) -> torch.Tensor:
    """The L2 norm over every gradient, a 0-dim fp32 tensor on their device. FSDP2's sharded gradients
    (DTensors) add their local shards' squares, summed over the mesh in one all-reduce; the replicated
    fp32-contract gradients (plain tensors, the same on every rank) add theirs once."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    if not grads:
        return torch.zeros(())
    sharded = [g for g in grads if isinstance(g, DTensor)]
    plain = [g for g in grads if not isinstance(g, DTensor)]
    total = torch.zeros((), dtype=torch.float32, device=grads[0].device)
    if sharded:
        shards = _local(sharded)
        part = torch.stack(torch._foreach_norm(shards)).float().square().sum()
        dist.all_reduce(part, op=dist.ReduceOp.SUM, group=sharded[0].device_mesh.get_group())
        total = total + part
    if plain:
        total = total + torch.stack(torch._foreach_norm(plain)).float().square().sum()
    return total.sqrt()


# ----------------------------------------------------------------------------- checkpoints


def save_checkpoint(path: str | Path, state: dict[str, Any]) -> Path:
    """Write `state` atomically: to a temporary file beside `path`, flushed to disk, then renamed over it."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return path


def load_checkpoint(path: str | Path) -> dict[str, Any]:
    """Read a checkpoint: a checkpoint.pt; a run directory (train's out_dir), whose newest checkpoint is read
    as a resume would pick it; or a sharded checkpoint (a run's checkpoint.dcp directory or one of its step
    directories) gathered into the same dict of full tensors. Fails closed, naming the file and the field,
    when it is unreadable or incomplete."""
    path = Path(path)
    if path.is_dir():
        if (path / CHECKPOINT_FILE).exists() or (path / SHARDED_DIR).is_dir():  # a run directory
            found = _latest_checkpoint(path, Ranks())
            if found is None:
                raise FileNotFoundError(f"no complete checkpoint in {path / SHARDED_DIR} (no LATEST)")
            kind, where, state = found
            return state if kind == "pt" else load_checkpoint(where)
        step_dir = latest_sharded(path) if (path / "LATEST").exists() else path
        if step_dir is None or not (step_dir / ".metadata").is_file():
            raise FileNotFoundError(f"no checkpoint in {path}: neither a run directory ({CHECKPOINT_FILE} or "
                                    f"{SHARDED_DIR}) nor a sharded checkpoint (LATEST or .metadata)")  # fmt: skip
        return _checked(load_sharded_full(step_dir), step_dir)
    if not path.is_file():
        raise FileNotFoundError(f"no checkpoint {path}")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception:  # noqa: BLE001 - a truncated zip, a foreign pickle: all mean the same to the user
        # torch's own text is for a file one trusts (load it with weights_only=False): not advice for a checkpoint
        raise ValueError(f"checkpoint {path} is corrupt or not a checkpoint") from None
    return _checked(state, path)


def _checked(state: Any, path: Path, *, skip: tuple[str, ...] = ()) -> dict[str, Any]:
    if not isinstance(state, dict):
        raise ValueError(f"checkpoint {path} holds a {type(state).__name__}, not a training checkpoint")
    for field in CHECKPOINT_FIELDS:
        if field not in state and field not in skip:
            raise ValueError(f"checkpoint {path} lacks the field '{field}'")
    if state["format"] != CHECKPOINT_FORMAT:
        raise ValueError(f"checkpoint {path} field 'format' is {state['format']!r}, this code reads {CHECKPOINT_FORMAT}")
    return state


def check_resume(state: dict[str, Any], config: TrainConfig, where: Path) -> None:
    saved = state["train_config"]
    if not isinstance(saved, dict):
        raise ValueError(f"checkpoint {where} field 'train_config' is not a table")
    now = dataclasses.asdict(config)
    for name in sorted(now):  # the parallel table field by field: some of its fields are free
        pairs = [(f"{name}.{k}", (saved.get(name) or {}).get(k) if isinstance(saved.get(name), dict) else None, v)
                 for k, v in now[name].items()] if isinstance(now[name], dict) else [(name, saved.get(name), now[name])]  # fmt: skip
        for dotted, was, value in pairs:
            if dotted not in RESUME_FREE and was != value:
                raise ValueError(f"checkpoint {where} field 'train_config.{dotted}' is {was!r}, this run has {value!r}: "
                                 "resume with the same config, or use another out_dir")  # fmt: skip


def _config_diff(now: Any, saved: Any, *, skip: tuple[str, ...], where: str = "") -> tuple[str, Any, Any] | None:
    """The first field where two asdict() trees differ: (dotted name, saved, now), or None."""
    if isinstance(now, dict) and isinstance(saved, dict):
        for key in sorted(set(now) | set(saved)):
            if key in skip:
                continue
            found = _config_diff(now.get(key), saved.get(key), skip=skip, where=f"{where}.{key}" if where else key)
            if found:
                return found
        return None
    return None if now == saved else (where, saved, now)


def load_checkpoint_model(path: str | Path, device: str = "cpu") -> tuple[HybridLM, HybridConfig]:
    """A fp32 HybridLM from a checkpoint's master weights (for sampling and evaluation)."""
    state = load_checkpoint(path)
    try:  # rebuilt from the run's own config, with the kernels named for this device
        run = TrainConfig.build(state["train_config"], compile=False)  # older checkpoints: the parallel fields flat
        config = run.hybrid_config(device, int(state["model_config"]["vocab_size"]))
    except (TypeError, ValueError, KeyError) as err:
        raise ValueError(f"checkpoint {path} field 'train_config' does not build the model: {err}") from None
    kernels = ("kernel", "loss_impl")  # where the model runs, not what it is
    diff = _config_diff(dataclasses.asdict(config), state["model_config"], skip=kernels)
    if diff:
        raise ValueError(f"checkpoint {path} field 'model_config.{diff[0]}' differs from the model this code "
                         f"builds from its train_config ({diff[1]!r} saved, {diff[2]!r} now)")  # fmt: skip
    model = HybridLM(config)
    expected = model.state_dict()
    bad = sorted(set(expected) ^ set(state["model"]))
    if bad:
        raise ValueError(f"checkpoint {path} field 'model' does not fit its model_config: {bad[:5]}")
    model.load_state_dict(state["model"], strict=True)
    return model.to(device).eval(), config


# ----------------------------------------------------------------------------- the loop


@dataclass
class TrainResult:
    """What a run produced: its history (one row per log / validation point) and where it wrote."""

    history: list[dict[str, float]]
    checkpoint: Path
    out_dir: Path
    model: nn.Module
    config: HybridConfig
    tokens_per_s: float
    step: int = 0  # the step the run stopped at (its checkpoint's), logged or not


@dataclass(frozen=True)
class TokenizedCorpus:
    """The corpus as token ids, split by file: what a run trains and validates on. Tokenize once and hand the
    same one to several runs (an ablation over the same tokens)."""

    train: list[Any]
    val: list[Any]
    corpus: str | None
    max_files: int | None
    val_fraction: float


def tokenize_corpus(config: TrainConfig, *, progress: bool = False,
                    cache_dir: str | Path | None = TOKEN_CACHE) -> TokenizedCorpus:  # fmt: skip
    """Read the corpus, hold out validation files by path, and tokenize both sides with the BPE. The token
    ids are cached under cache_dir (data.tokenize_files; None: no cache), so every rank of a run and every
    later run over the same files reads them instead of tokenizing again."""
    files = load_corpus(config.corpus, max_files=config.max_files, progress=False)
    train_files, val_files = split_by_file(files, config.val_fraction)
    tok = load_bpe()
    docs = [tokenize_files(part, tok, progress=progress, cache_dir=cache_dir) for part in (train_files, val_files)]
    return TokenizedCorpus(*docs, config.corpus, config.max_files, config.val_fraction)


def _data(config: TrainConfig, corpus: TokenizedCorpus, pad_id: int) -> tuple[PackedRowStream, list[Any]]:
    """The training stream and the fixed validation batches (the first of the held-out files, in order)."""
    for name in ("corpus", "max_files", "val_fraction"):
        if getattr(corpus, name) != getattr(config, name):
            raise ValueError(f"the tokenized corpus was built with {name}={getattr(corpus, name)!r}, the run asks "
                             f"{getattr(config, name)!r}")  # fmt: skip
    stream = PackedRowStream(corpus.train, seq_len=config.seq_len, batch_size=config.batch_size, pad_id=pad_id,
                             seed=config.seed)  # fmt: skip
    val = PackedRowStream(corpus.val, seq_len=config.seq_len, batch_size=config.batch_size, pad_id=pad_id,
                          shuffle=False)  # fmt: skip
    return stream, [next(val) for _ in range(min(config.val_batches, val.batches_per_epoch))]


def _targets(tokens: torch.Tensor, doc_ids: torch.Tensor, pad_id: int, ignore_index: int) -> torch.Tensor:
    targets = next_token_targets(tokens, doc_ids, ignore_index)
    return targets.masked_fill(targets == pad_id, ignore_index)  # padding is never a target


def _latest_checkpoint(out: Path, ranks: Ranks) -> tuple[str, Path, dict[str, Any]] | None:
    """The newest checkpoint in a run directory: ("pt", checkpoint.pt, its dict) or ("dcp", step directory, its
    metadata). A run resumed at another process count writes the other kind; the higher step wins, and at
    equal steps the kind this run writes."""
    found = []
    if (out / CHECKPOINT_FILE).exists():
        found.append(("pt", out / CHECKPOINT_FILE, load_checkpoint(out / CHECKPOINT_FILE)))
    step_dir = latest_sharded(out / SHARDED_DIR)
    if step_dir is not None:
        found.append(("dcp", step_dir, _checked(read_sharded_meta(step_dir), step_dir, skip=("model", "optimizer"))))
    if not found:
        return None
    mine = "dcp" if ranks.world > 1 else "pt"
    return max(found, key=lambda f: (int(f[2]["step"]), f[0] == mine))


def _sharded_state(model: nn.Module, opt: MasterWeightAdamW) -> dict[str, Any]:
    """{"model", "optimizer"} of an FSDP2 model as DCP saves and loads them (sharded, keyed by name)."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optim_state = get_state_dict(model, opt.optimizer)
    return {"model": model_state, "optimizer": optim_state}


def _load_state(model: nn.Module, opt: MasterWeightAdamW, found: tuple[str, Path, dict[str, Any]], ranks: Ranks) -> None:
    """Weights and optimizer state from either checkpoint kind, at this run's process count (resharded)."""
    kind, where, saved = found
    if ranks.world == 1:
        full = saved if kind == "pt" else load_checkpoint(where)
        opt.load_master_state_dict(model, full["model"], f"checkpoint {where}")
        opt.load_optimizer_state_by_name(full["optimizer"], f"checkpoint {where}")
        return
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

    if kind == "dcp":  # each rank reads the slices its shards need, whatever the saving world was
        state = _sharded_state(model, opt)
        load_sharded(where, state)
        options = StateDictOptions()
    else:  # one process's full tensors: every rank reads the file and keeps its shards
        state, options = saved, StateDictOptions(full_state_dict=True)
    try:
        set_state_dict(model, opt.optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optimizer"], options=options)  # fmt: skip
    except (KeyError, RuntimeError, ValueError) as err:
        raise ValueError(f"checkpoint {where} does not fit this model: {type(err).__name__}: {err}") from None


def train(config: TrainConfig, *, progress: bool = True, resume: bool = True, stop_after: int | None = None,
          corpus: TokenizedCorpus | None = None) -> TrainResult:  # fmt: skip
    """Run (or resume) a training run; see the module docstring. Everything checkable is checked before the
    corpus is read. resume=False refuses an out_dir that holds a checkpoint. stop_after: end after this many
    steps of the schedule, with a checkpoint (a job sliced into pieces; the next call resumes). corpus: the
    tokenized corpus (tokenize_corpus), read here when None.

    Under torchrun (WORLD_SIZE > 1) this process is one rank of the run (model/distributed.py): FSDP2 over an
    fp32 model (bf16 forward on a GPU), batch_size the global batch, sharded checkpoints, and rank 0 alone
    writing logs, plots and the progress bar. A process group this call made is torn down when it returns."""
    if stop_after is not None and (not isinstance(stop_after, int) or isinstance(stop_after, bool) or stop_after < 1):
        raise ValueError(f"stop_after must be an int >= 1 or None, got {stop_after!r}")
    device, dtype = resolve_device(config)
    ranks = init_ranks(device)
    result = _train(config, device, dtype, ranks, progress=progress, resume=resume, stop_after=stop_after,
                    corpus=corpus)  # fmt: skip
    if ranks.owns_group:  # an exception skips this: torchrun stops the other ranks
        import torch.distributed as dist

        dist.barrier()
        dist.destroy_process_group()
    return result


def _train(config: TrainConfig, device: str, dtype: torch.dtype, ranks: Ranks, *, progress: bool, resume: bool,
           stop_after: int | None, corpus: TokenizedCorpus | None) -> TrainResult:  # fmt: skip
    from tqdm.auto import tqdm

    rows = rank_rows(config.batch_size, ranks)
    tok = load_bpe()
    hcfg = config.hybrid_config(device, tok.vocab_size)
    out = Path(config.out_dir)
    ckpt_path = out / CHECKPOINT_FILE
    found = _latest_checkpoint(out, ranks)
    if not resume and found is not None:
        raise ValueError(f"{found[1]} exists and resume is off: remove it or choose another out_dir")
    saved = found[2] if found is not None else None
    if saved is not None:
        check_resume(saved, config, found[1])
    ignore = hcfg.lm_head.ignore_index

    if corpus is None:
        corpus = tokenize_corpus(config, progress=progress and ranks.main)
    stream, val_batches = _data(config, corpus, tok.pad_id)
    torch.manual_seed(config.seed)
    model = parallelize(HybridLM(hcfg).to(device), config.parallel, device=device, fsdp=ranks.world > 1)
    opt = MasterWeightAdamW(model, config)
    history: list[dict[str, float]] = []
    start = 0
    if saved is not None:
        _load_state(model, opt, found, ranks)
        stream.load_state_dict(saved["loader"])
        torch.set_rng_state(saved["rng"]["torch"])
        if device == "cuda" and saved["rng"].get("cuda") is not None:
            torch.cuda.set_rng_state(saved["rng"]["cuda"])
        start, history = int(saved["step"]), list(saved["history"])
    writer = None
    if config.tensorboard and ranks.main:
        from torch.utils.tensorboard import SummaryWriter

        writer = SummaryWriter(log_dir=str(out / "tensorboard"), purge_step=start)

    def rank_batch(batch: Any) -> tuple[torch.Tensor, PackedContext, torch.Tensor, float]:
        """This rank's rows on the device, their context, their targets, and their share of the global batch's
        targets. Everything is derived and validated on the host and copied from pinned memory without
        waiting: the step holds no host sync, so the CPU queues the next step while the GPU runs this one."""
        targets = _targets(batch.tokens, batch.doc_ids, hcfg.pad_id, ignore)  # the whole batch, on the host
        share = token_share(targets, rows, ignore) if ranks.world > 1 else 1.0
        ctx = build_context(batch.doc_ids[rows]).to(device)
        tokens, targets = (copy_to_device(t[rows], device) for t in (batch.tokens, targets))
        return tokens, ctx, targets, share

    def validate() -> float:
        model.eval()
        total = torch.zeros((), device=device, dtype=torch.float64)
        with torch.no_grad():
            for b in val_batches:
                tokens, ctx, targets, share = rank_batch(b)
                total += model(tokens, ctx, targets).loss.double() * share
        model.train()
        return float(all_reduce_sum(total, ranks)) / len(val_batches)

    def checkpoint(step: int) -> None:
        rng = {"torch": torch.get_rng_state(), "cuda": torch.cuda.get_rng_state() if device == "cuda" else None}
        meta = dict(format=CHECKPOINT_FORMAT, step=step, train_config=dataclasses.asdict(config),
                    model_config=dataclasses.asdict(hcfg), loader=stream.state_dict(), rng=rng, history=history,
                    pending_loss=(float(all_reduce_sum(loss_sum, ranks)), s_log))  # fmt: skip
        if ranks.world > 1:
            save_sharded(out / SHARDED_DIR, step, _sharded_state(model, opt), meta, ranks)
        else:
            save_checkpoint(ckpt_path, dict(meta, model=opt.master_state_dict(), optimizer=opt.optimizer_state_by_name()))

    def log(row: dict[str, float]) -> None:
        history.append(row)
        if writer is not None:
            for key, value in row.items():
                if key != "step":
                    writer.add_scalar(key.replace("_", "/", 1) if key in ("train_loss", "val_loss") else key,
                                      value, int(row["step"]))  # fmt: skip

    model.train()
    tokens_per_step = config.batch_size * config.seq_len  # the global batch: every rank's rows
    end = config.steps if stop_after is None else min(config.steps, stop_after)
    # a bar on a terminal or in a notebook; piped to a log (torchrun, a benchmark, a rented box's nohup) a plain
    # line per log row instead of a bar redrawn into the file
    lines = progress and ranks.main and not sys.stderr.isatty() and "ipykernel" not in sys.modules
    bar = tqdm(range(start, end), initial=start, total=config.steps, desc="training", unit="step",
               disable=not (progress and ranks.main) or lines)  # fmt: skip

    def say(text: str) -> None:
        if progress and ranks.main:
            bar.write(text, file=sys.stderr)  # beside the bar; stdout stays for results (paths, the summary)

    where = f"{ranks.world} x {device}" if ranks.world > 1 else device
    if config.parallel.remat != "none":
        say(f"activation checkpointing: remat policy {config.parallel.remat!r}"
            f"{' (activation_memory_budget per block structure)' if config.parallel.policy.is_budget else ''}")
    if config.parallel.compile and start < end:
        cache = os.environ.get("TORCHINDUCTOR_CACHE_DIR") or "inductor's default cache directory"
        say(f"step {start + 1}: compiling {len(block_structures(model))} block structures on {where} "
            f"(warm if {cache} holds them, else cold: a minute or two)")  # fmt: skip
    # the profiler's warm-up step, then trace_steps traced steps: the run's last, on rank 0
    trace_from = config.steps - config.trace_steps - 1 if config.trace_steps and ranks.main else None
    if trace_from is not None and not start <= trace_from < end:
        trace_from = None  # a resumed or sliced run that does not reach them
    prof = None
    t_log, s_log, r_log, rates = time.perf_counter(), start, start, []  # r_log: the rate's own start
    loss_sum = torch.zeros((), device=device, dtype=torch.float64)  # this rank's share of the global mean
    if saved is not None and ranks.main:  # the steps since the last log row (the global sum: on one rank only)
        loss_sum += saved["pending_loss"][0]
    if saved is not None:
        s_log = int(saved["pending_loss"][1])
    for step in bar:
        if step == trace_from:
            prof = _trace(out / "trace", config.trace_steps, device)
            say(f"step {step + 1}: tracing steps {step + 2}-{config.steps} on rank 0 into {out / 'trace'}")
        tokens, ctx, targets, share = rank_batch(next(stream))
        lr = lr_at(step, config)
        compiling = config.parallel.compile and step == start
        if compiling:
            from torch._dynamo.utils import get_compilation_metrics

            since, t_compile = len(get_compilation_metrics()), time.perf_counter()
            workers = precompile(model, tokens, ctx, targets)  # the other block structures compile at once
            if workers is not None:
                say(f"step {step + 1}: {sum(map(len, workers.plan))} block structures compiling in "
                    f"{len(workers.plan)} worker processes beside this one")  # fmt: skip
        loss = model(tokens, ctx, targets).loss
        # FSDP2 averages gradients over ranks: weighted by share * world, the average is the global mean's
        (loss * (share * ranks.world) if ranks.world > 1 else loss).backward()
        grad_norm = opt.step(lr)
        opt.zero_grad()
        if compiling:  # one host sync, once: the first step's time is what the compile cost
            if device == "cuda":
                torch.cuda.synchronize()
            say(f"step {step + 1}: {describe_compile(time.perf_counter() - t_compile, since)}")
        loss_sum += loss.detach().double() * share if ranks.world > 1 else loss.detach().double()
        done = step + 1
        if prof is not None:
            prof.step()
        if done % config.log_every == 0 or done == config.steps:
            mean_loss = float(all_reduce_sum(loss_sum, ranks)) / (done - s_log)  # one host sync per log interval
            now = time.perf_counter()
            rate = tokens_per_step * (done - r_log) / (now - t_log)
            traced = trace_from is not None and done > trace_from  # the profiler's overhead is not throughput
            if not traced:
                rates.append(rate)
            if not math.isfinite(mean_loss):
                raise FloatingPointError(f"training loss is {mean_loss} at step {done}: stopping (lr={lr:.3g})")
            row = dict(step=done, train_loss=mean_loss, lr=lr, grad_norm=float(grad_norm), tokens_per_s=rate)
            if device == "cuda":  # per-GPU peak so far, the largest over the ranks
                peak = torch.tensor(float(torch.cuda.max_memory_allocated()) / 2**20, device=device)
                if ranks.world > 1:
                    import torch.distributed as dist

                    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
                row["peak_mib"] = float(peak)
            if traced:
                row["traced"] = 1.0
            log(row)
            bar.set_postfix(loss=f"{mean_loss:.3f}", tok_s=f"{rate / 1e3:.1f}k", lr=f"{lr:.2e}")
            if lines or done == config.log_every:  # the first row also on a terminal: the compile is over
                peak_text = f", peak {row['peak_mib'] / 1024:.1f} GiB per GPU" if "peak_mib" in row else ""
                say(f"step {done}/{config.steps} on {where}: loss {mean_loss:.4f}, {rate / 1e3:.1f}k tokens/s"
                    f"{' (traced)' if traced else ''}{peak_text}")  # fmt: skip
            loss_sum.zero_()
            t_log, s_log, r_log = time.perf_counter(), done, done
        if done % config.val_every == 0 or done == config.steps:
            t0 = time.perf_counter()
            log(dict(step=done, val_loss=validate()))
            t_log += time.perf_counter() - t0  # validation time is not training throughput
        if done % config.ckpt_every == 0 or done == end:
            t0 = time.perf_counter()
            checkpoint(done)
            t_log += time.perf_counter() - t0
    bar.close()
    if prof is not None:
        prof.stop()
    if writer is not None:
        writer.close()
    if ranks.main:
        peaks = [r["peak_mib"] for r in history if "peak_mib" in r]
        run = {"preset": config.preset, "device": where, "dtype": str(dtype).removeprefix("torch."),
               "parallel": dataclasses.asdict(config.parallel), "remat": config.parallel.remat,
               "peak_mib": max(peaks) if peaks else None}  # fmt: skip
        write_history(out / HISTORY_FILE, run, history)
        plot_history(history, out / "loss.png", title=f"{config.preset} on {where}")
    # the first interval holds compilation and warm-up: the median of the rest is the steady rate
    steady = sorted(rates[1:] or rates)
    checkpoint_at = out / SHARDED_DIR if ranks.world > 1 else ckpt_path
    return TrainResult(history, checkpoint_at, out, model, hcfg, steady[len(steady) // 2] if steady else float("nan"),
                       step=max(start, end))  # fmt: skip


def write_history(path: Path, run: dict[str, Any], rows: list[dict[str, float]]) -> None:
    """history.json: what ran (`run`: the preset, the device, the parallel config and its remat policy, the peak
    memory per GPU over the run, None on a CPU) and one row per log or validation point (`rows`)."""
    path.write_text(json.dumps({"run": run, "rows": rows}, indent=1) + "\n")


def read_history(path: str | Path) -> tuple[dict[str, Any], list[dict[str, float]]]:
    """(run, rows) of a history.json (a run directory or the file); fails naming the field."""
    path = Path(path)
    path = path / HISTORY_FILE if path.is_dir() else path
    data = json.loads(path.read_text())
    if not isinstance(data, dict) or not isinstance(data.get("run"), dict) or not isinstance(data.get("rows"), list):
        raise ValueError(f"{path} is not a history: expected a table with fields 'run' and 'rows'")
    return data["run"], data["rows"]


def _trace(out: Path, steps: int, device: str) -> Any:
    """A started torch.profiler over one warm-up step and then `steps` traced ones (call .step() after each),
    writing a gzipped TensorBoard trace (`*.pt.trace.json.gz`, which Perfetto opens too) into `out`."""
    from torch.profiler import ProfilerActivity, profile, schedule, tensorboard_trace_handler

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    prof = profile(activities=activities, schedule=schedule(wait=0, warmup=1, active=steps, repeat=1),
                   on_trace_ready=tensorboard_trace_handler(str(out), worker_name="rank0", use_gzip=True))  # fmt: skip
    prof.start()
    return prof


def plot_history(history: list[dict[str, float]], path: str | Path, *, title: str = "") -> Path:
    """Train and validation loss against the step, as a PNG."""
    from matplotlib.figure import Figure  # no pyplot: a notebook's backend stays as it is

    fig = Figure(figsize=(6.4, 3.6))
    ax = fig.subplots()
    for key, style in (("train_loss", "-"), ("val_loss", "o-")):
        rows = [r for r in history if key in r]
        if rows:
            ax.plot([r["step"] for r in rows], [r[key] for r in rows], style, label=key.replace("_", " "), ms=3)
    ax.set(xlabel="step", ylabel="loss (nats / token)", title=title)
    ax.grid(alpha=0.3)
    if ax.lines:  # a run stopped before its first log row has no curve yet
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return Path(path)
