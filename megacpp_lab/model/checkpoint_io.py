"""Training checkpoints on disk: save, load, resume. (Activation checkpointing, a different thing, is
model/checkpointing.py.)

    state = load_checkpoint("runs/small")                       # a run directory, a checkpoint.pt or a DCP step
    model, model_config = load_checkpoint_model("runs/small/checkpoint.pt")

One process writes out_dir/checkpoint.pt: to a temporary file, flushed to disk and renamed over the old one,
so an interrupted save leaves the previous checkpoint whole. Several processes (FSDP2) write a sharded DCP
checkpoint under out_dir/checkpoint.dcp (model/distributed.py); either kind resumes at any process count. A
checkpoint holds the master weights, the optimizer state keyed by parameter name, the loader position, the
RNG states, the step, both configs and the history so far, and resuming from it continues exactly as the
uninterrupted run would have (tested bit for bit on a CPU). A checkpoint that cannot be read, lacks a field,
or was written for another config fails with an error that names the field.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

from megacpp_lab.model.config import HybridConfig
from megacpp_lab.model.distributed import SHARDED_DIR, Ranks, latest_sharded, load_sharded, load_sharded_full, read_sharded_meta
from megacpp_lab.model.hybrid import HybridLM
from megacpp_lab.model.optim import MasterWeightAdamW
from megacpp_lab.model.train_config import TrainConfig

__all__ = ["CHECKPOINT_FIELDS", "CHECKPOINT_FILE", "CHECKPOINT_FORMAT", "RESUME_FREE", "check_resume",
           "latest_checkpoint", "load_checkpoint", "load_checkpoint_model", "load_train_state", "save_checkpoint",
           "sharded_state"]  # fmt: skip

CHECKPOINT_FILE = "checkpoint.pt"
CHECKPOINT_FORMAT = 2  # 2: the optimizer state keyed by parameter name (any process count)
CHECKPOINT_FIELDS = ("format", "step", "train_config", "model_config", "model", "optimizer", "loader", "rng", "history",
                     "pending_loss")
# fields that may change between a run and its resume: where and how often it reports, not what it computes
RESUME_FREE = ("out_dir", "log_every", "val_every", "ckpt_every", "tensorboard", "trace_steps",
               "parallel.reshard_after_forward", "parallel.fsdp_blocks_per_group", "parallel.compile_workers")


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
            found = latest_checkpoint(path, Ranks())
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
    kernels = ("kernel", "loss_impl", "conv_impl")  # how the model runs, not what it is (conv_impl: its default
    # changed, the weights are the same)
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


def latest_checkpoint(out: Path, ranks: Ranks) -> tuple[str, Path, dict[str, Any]] | None:
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


def sharded_state(model: nn.Module, opt: MasterWeightAdamW) -> dict[str, Any]:
    """{"model", "optimizer"} of an FSDP2 model as DCP saves and loads them (sharded, keyed by name)."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optim_state = get_state_dict(model, opt.optimizer)
    return {"model": model_state, "optimizer": optim_state}


def load_train_state(model: nn.Module, opt: MasterWeightAdamW, found: tuple[str, Path, dict[str, Any]], ranks: Ranks) -> None:
    """Weights and optimizer state from either checkpoint kind, at this run's process count (resharded)."""
    kind, where, saved = found
    if ranks.world == 1:
        full = saved if kind == "pt" else load_checkpoint(where)
        opt.load_master_state_dict(model, full["model"], f"checkpoint {where}")
        opt.load_optimizer_state_by_name(full["optimizer"], f"checkpoint {where}")
        return
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

    if kind == "dcp":  # each rank reads the slices its shards need, whatever the saving world was
        state = sharded_state(model, opt)
        load_sharded(where, state)
        options = StateDictOptions()
    else:  # one process's full tensors: every rank reads the file and keeps its shards
        state, options = saved, StateDictOptions(full_state_dict=True)
    try:
        set_state_dict(model, opt.optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optimizer"], options=options)  # fmt: skip
    except (KeyError, RuntimeError, ValueError) as err:
        raise ValueError(f"checkpoint {where} does not fit this model: {type(err).__name__}: {err}") from None
