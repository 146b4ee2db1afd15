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

LR: linear warmup from 0 to `lr` over `warmup_steps`, then cosine down to `lr * min_lr_ratio` at `steps`;
a function of the step alone, so a resumed run needs no scheduler state.

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
from megacpp_lab.model.parallelize import apply_compile
from megacpp_lab.model.precision import apply_mixed_precision
from megacpp_lab.varlen import build_context

__all__ = [
    "CHECKPOINT_FILE",
    "MasterWeightAdamW",
    "TrainConfig",
    "TokenizedCorpus",
    "TrainResult",
    "load_checkpoint",
    "load_checkpoint_model",
    "lr_at",
    "resolve_device",
    "save_checkpoint",
    "tokenize_corpus",
    "train",
]

CHECKPOINT_FILE = "checkpoint.pt"
CHECKPOINT_FORMAT = 1
CHECKPOINT_FIELDS = ("format", "step", "train_config", "model_config", "model", "optimizer", "loader", "rng", "history",
                     "pending_loss")
# fields that may change between a run and its resume: where and how often it reports, not what it computes
RESUME_FREE = ("out_dir", "log_every", "val_every", "ckpt_every", "tensorboard")


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
    warmup_steps: int = 100
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0
    # run
    device: str = "auto"  # auto: cuda when there is one
    dtype: str = "auto"  # auto: bf16 on a GPU, fp32 on a CPU
    compile: bool = False
    seed: int = 0
    log_every: int = 10
    val_every: int = 100
    ckpt_every: int = 200
    tensorboard: bool = True
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
        for name in ("warmup_steps", "seed"):
            if not is_int(getattr(self, name)) or getattr(self, name) < 0:
                raise fail(name, "an int >= 0")
        if self.warmup_steps >= self.steps:
            raise fail("warmup_steps", f"fewer than steps={self.steps}")
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
        if self.dtype not in ("auto", "bf16", "fp32"):
            raise fail("dtype", "'auto', 'bf16' or 'fp32'")
        for name in ("compile", "tensorboard"):
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
            unknown = sorted(set(values) - set(cls.__dataclass_fields__))
            if unknown:
                raise ValueError(f"config file {path}: TrainConfig has no field(s) {unknown}")
            source = SimpleNamespace(**values)
        elif isinstance(source, Mapping):
            source = SimpleNamespace(**source)
        given = {k: v for k, v in overrides.items() if v is not None}
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
        if self.compile:
            overrides.update(m2rnn=dict(kernel="triton"), ssd=dict(kernel="triton"))
        return model_config(self.preset, device, **overrides)


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
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}.get(config.dtype)
    if dtype is None:
        dtype = torch.bfloat16 if device == "cuda" else torch.float32
    if config.compile and device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError("TrainConfig.compile on a CPU needs TRITON_INTERPRET=1: the compiled blocks run the scans' "
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


def _inner(model: nn.Module) -> HybridLM:
    """The HybridLM inside apply_mixed_precision's wrapper."""
    return getattr(model, "module", model)


class MasterWeightAdamW:
    """AdamW over fp32 master weights of a (possibly bf16) model; see the module docstring.

    Weight decay applies to matrices (2-D and up), never to norms, biases, decays or the embedding."""

    def __init__(self, model: nn.Module, config: TrainConfig, *, fused: bool = True) -> None:
        self.named = [(n, p) for n, p in _inner(model).named_parameters() if p.requires_grad]
        persistent = _inner(model).state_dict().keys()  # not the RoPE tables, which are rebuilt, never saved
        self.buffers = [(n, b) for n, b in _inner(model).named_buffers() if n in persistent]
        self.masters = [p if p.dtype == torch.float32 else p.detach().float().requires_grad_() for _, p in self.named]
        self.copied = [i for i, (_, p) in enumerate(self.named) if self.masters[i] is not p]
        decay = [m for (n, p), m in zip(self.named, self.masters) if p.dim() >= 2 and not n.startswith("embed.")]
        no_decay = [m for (n, p), m in zip(self.named, self.masters) if not (p.dim() >= 2 and not n.startswith("embed."))]
        groups = [dict(params=decay, weight_decay=config.weight_decay), dict(params=no_decay, weight_decay=0.0)]
        self.optimizer = torch.optim.AdamW(groups, lr=config.lr, betas=(config.beta1, config.beta2), fused=fused)
        self.grad_clip = config.grad_clip

    def step(self, lr: float) -> torch.Tensor:
        """Gradients to the masters, clip, step, round back; returns the global gradient norm (before
        clipping, a 0-dim fp32 tensor: no host sync)."""
        for i in self.copied:
            g = self.named[i][1].grad
            self.masters[i].grad = None if g is None else g.float()
        grads = [m.grad for m in self.masters if m.grad is not None]
        norm = torch.nn.utils.get_total_norm(grads)
        if self.grad_clip > 0:  # scale by min(1, clip / norm) on the device: no host sync
            torch._foreach_mul_(grads, torch.clamp(self.grad_clip / (norm + 1e-6), max=1.0))
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.step()
        if self.copied:
            with torch.no_grad():
                torch._foreach_copy_([self.named[i][1] for i in self.copied], [self.masters[i] for i in self.copied])
        return norm.detach().float()

    def zero_grad(self) -> None:
        for (_, p), m in zip(self.named, self.masters):
            p.grad = None
            m.grad = None

    def master_state_dict(self) -> dict[str, torch.Tensor]:
        """The model's parameters at full precision (the masters), by HybridLM parameter name, plus its
        buffers."""
        state = {n: m.detach().clone() for (n, _), m in zip(self.named, self.masters)}
        state.update((n, b.detach().clone()) for n, b in self.buffers)
        return state

    def load_master_state_dict(self, model: nn.Module, state: dict[str, torch.Tensor], where: str) -> None:
        """Load masters (and the model's weights rounded from them) and buffers; fails naming the tensor."""
        lm = _inner(model)
        expected = dict(lm.state_dict(keep_vars=True))
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
    """Read a checkpoint; fails closed, naming the file and the field, when it is unreadable or incomplete."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no checkpoint {path}")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # noqa: BLE001 - a truncated zip, a pickle error: all mean the same to the user
        raise ValueError(f"checkpoint {path} cannot be read (corrupt or truncated: {type(err).__name__}: "
                         f"{str(err).splitlines()[0] if str(err) else ''})") from None  # fmt: skip
    if not isinstance(state, dict):
        raise ValueError(f"checkpoint {path} holds a {type(state).__name__}, not a training checkpoint")
    for field in CHECKPOINT_FIELDS:
        if field not in state:
            raise ValueError(f"checkpoint {path} lacks the field '{field}'")
    if state["format"] != CHECKPOINT_FORMAT:
        raise ValueError(f"checkpoint {path} field 'format' is {state['format']!r}, this code reads {CHECKPOINT_FORMAT}")
    return state


def _check_resume(state: dict[str, Any], config: TrainConfig, where: Path) -> None:
    saved = state["train_config"]
    if not isinstance(saved, dict):
        raise ValueError(f"checkpoint {where} field 'train_config' is not a table")
    for f in dataclasses.fields(config):
        if f.name in RESUME_FREE:
            continue
        if saved.get(f.name) != getattr(config, f.name):
            raise ValueError(f"checkpoint {where} field 'train_config.{f.name}' is {saved.get(f.name)!r}, this run has "
                             f"{getattr(config, f.name)!r}: resume with the same config, or use another out_dir")  # fmt: skip


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
        run = TrainConfig(**{**state["train_config"], "compile": False})
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


@dataclass(frozen=True)
class TokenizedCorpus:
    """The corpus as token ids, split by file: what a run trains and validates on. Tokenize once and hand the
    same one to several runs (an ablation over the same tokens)."""

    train: list[Any]
    val: list[Any]
    corpus: str | None
    max_files: int | None
    val_fraction: float


def tokenize_corpus(config: TrainConfig, *, progress: bool = False) -> TokenizedCorpus:
    """Read the corpus, hold out validation files by path, and tokenize both sides with the BPE."""
    files = load_corpus(config.corpus, max_files=config.max_files, progress=False)
    train_files, val_files = split_by_file(files, config.val_fraction)
    tok = load_bpe()
    return TokenizedCorpus(tokenize_files(train_files, tok, progress=progress), tokenize_files(val_files, tok, progress=progress),
                           config.corpus, config.max_files, config.val_fraction)  # fmt: skip


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


def train(config: TrainConfig, *, progress: bool = True, resume: bool = True, stop_after: int | None = None,
          corpus: TokenizedCorpus | None = None) -> TrainResult:  # fmt: skip
    """Run (or resume) a training run; see the module docstring. Everything checkable is checked before the
    corpus is read. resume=False refuses an out_dir that holds a checkpoint. stop_after: end after this many
    steps of the schedule, with a checkpoint (a job sliced into pieces; the next call resumes). corpus: the
    tokenized corpus (tokenize_corpus), read here when None."""
    if stop_after is not None and (not isinstance(stop_after, int) or isinstance(stop_after, bool) or stop_after < 1):
        raise ValueError(f"stop_after must be an int >= 1 or None, got {stop_after!r}")
    from tqdm.auto import tqdm

    device, dtype = resolve_device(config)
    tok = load_bpe()
    hcfg = config.hybrid_config(device, tok.vocab_size)
    out = Path(config.out_dir)
    ckpt_path = out / CHECKPOINT_FILE
    if not resume and ckpt_path.exists():
        raise ValueError(f"{ckpt_path} exists and resume is off: remove it or choose another out_dir")
    saved = load_checkpoint(ckpt_path) if ckpt_path.exists() else None
    if saved is not None:
        _check_resume(saved, config, ckpt_path)
    ignore = hcfg.lm_head.ignore_index

    if corpus is None:
        corpus = tokenize_corpus(config, progress=progress)
    stream, val_batches = _data(config, corpus, tok.pad_id)
    torch.manual_seed(config.seed)
    model: nn.Module = HybridLM(hcfg).to(device)
    if dtype != torch.float32:
        model = apply_mixed_precision(model, dtype)
    opt = MasterWeightAdamW(model, config)
    history: list[dict[str, float]] = []
    start = 0
    if saved is not None:
        opt.load_master_state_dict(model, saved["model"], f"checkpoint {ckpt_path}")
        try:
            opt.optimizer.load_state_dict(saved["optimizer"])
        except (ValueError, KeyError, RuntimeError) as err:
            raise ValueError(f"checkpoint {ckpt_path} field 'optimizer' does not fit this model: {err}") from None
        stream.load_state_dict(saved["loader"])
        torch.set_rng_state(saved["rng"]["torch"])
        if device == "cuda" and saved["rng"].get("cuda") is not None:
            torch.cuda.set_rng_state(saved["rng"]["cuda"])
        start, history = int(saved["step"]), list(saved["history"])
    if config.compile:
        apply_compile(model)
    writer = None
    if config.tensorboard:
        from torch.utils.tensorboard import SummaryWriter

        writer = SummaryWriter(log_dir=str(out / "tensorboard"), purge_step=start)

    def validate() -> float:
        model.eval()
        total = 0.0
        with torch.no_grad():
            for b in val_batches:
                tokens, doc_ids = b.tokens.to(device), b.doc_ids.to(device)
                total += float(model(tokens, build_context(doc_ids), _targets(tokens, doc_ids, hcfg.pad_id, ignore)).loss)
        model.train()
        return total / len(val_batches)

    def checkpoint(step: int) -> None:
        rng = {"torch": torch.get_rng_state(), "cuda": torch.cuda.get_rng_state() if device == "cuda" else None}
        save_checkpoint(ckpt_path, dict(format=CHECKPOINT_FORMAT, step=step, train_config=dataclasses.asdict(config),
                                        model_config=dataclasses.asdict(hcfg), model=opt.master_state_dict(),
                                        optimizer=opt.optimizer.state_dict(), loader=stream.state_dict(), rng=rng,
                                        history=history, pending_loss=(float(loss_sum), s_log)))  # fmt: skip

    def log(row: dict[str, float]) -> None:
        history.append(row)
        if writer is not None:
            for key, value in row.items():
                if key != "step":
                    writer.add_scalar(key.replace("_", "/", 1) if key in ("train_loss", "val_loss") else key,
                                      value, int(row["step"]))  # fmt: skip

    model.train()
    tokens_per_step = config.batch_size * config.seq_len
    end = config.steps if stop_after is None else min(config.steps, stop_after)
    bar = tqdm(range(start, end), initial=start, total=config.steps, desc="training", unit="step",
               disable=not progress)  # fmt: skip
    t_log, s_log, r_log, rates = time.perf_counter(), start, start, []  # r_log: the rate's own start
    loss_sum = torch.zeros((), device=device, dtype=torch.float64)
    if saved is not None:  # the steps since the last log row, so that the row after a resume averages them too
        loss_sum += saved["pending_loss"][0]
        s_log = int(saved["pending_loss"][1])
    for step in bar:
        batch = next(stream)
        tokens, doc_ids = batch.tokens.to(device, non_blocking=True), batch.doc_ids.to(device, non_blocking=True)
        targets = _targets(tokens, doc_ids, hcfg.pad_id, ignore)
        lr = lr_at(step, config)
        loss = model(tokens, build_context(doc_ids), targets).loss
        loss.backward()
        grad_norm = opt.step(lr)
        opt.zero_grad()
        loss_sum += loss.detach().double()
        done = step + 1
        if done % config.log_every == 0 or done == config.steps:
            mean_loss = float(loss_sum) / (done - s_log)  # the one host sync per log interval
            now = time.perf_counter()
            rate = tokens_per_step * (done - r_log) / (now - t_log)
            rates.append(rate)
            if not math.isfinite(mean_loss):
                raise FloatingPointError(f"training loss is {mean_loss} at step {done}: stopping (lr={lr:.3g})")
            log(dict(step=done, train_loss=mean_loss, lr=lr, grad_norm=float(grad_norm), tokens_per_s=rate))
            bar.set_postfix(loss=f"{mean_loss:.3f}", tok_s=f"{rate / 1e3:.1f}k", lr=f"{lr:.2e}")
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
    if writer is not None:
        writer.close()
    (out / "history.json").write_text(json.dumps(history, indent=1) + "\n")
    plot_history(history, out / "loss.png", title=f"{config.preset} on {device}")
    # the first interval holds compilation and warm-up: the median of the rest is the steady rate
    steady = sorted(rates[1:] or rates)
    return TrainResult(history, ckpt_path, out, model, hcfg, steady[len(steady) // 2] if steady else float("nan"))


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
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return Path(path)
