"""One run over several processes: the process group, each rank's rows, and sharded checkpoints (DCP).

Launch with `megacpp-lab train --nproc N` (torchrun underneath) or `torchrun -m megacpp_lab.cli train`. Each
rank builds the same global batch from the same stream and keeps its own rows (`rank_rows`): the data order,
the loader state and a resume are then the same at every world size, and TrainConfig.batch_size is the global
batch. Gradients are weighted by each rank's share of the global batch's target tokens (`token_share`), so the
FSDP2 average over ranks is the single-process mean over every target of the batch.

Sharded checkpoints (`checkpoint.dcp/` in the run directory) keep the single-process atomic rule with a
pointer: every rank writes its shards into `step-NNNNNNNN.tmp/` through torch.distributed.checkpoint, rank 0
adds `meta.pt` (everything but the model and optimizer), renames the directory into place and only then
replaces `LATEST` (written to a temporary file, flushed and renamed). An interrupted save leaves `LATEST` on
the previous, whole checkpoint. DCP reshards on load, so a run saved on 2 ranks resumes on 1 or on 4, and
`load_sharded_full` turns one into the single-process checkpoint's dict (no process group needed).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

__all__ = ["SHARDED_DIR", "Ranks", "init_ranks", "one_process_group", "rank_rows", "token_share", "save_sharded", "latest_sharded",
           "read_sharded_meta", "load_sharded", "load_sharded_full", "all_reduce_sum"]  # fmt: skip

SHARDED_DIR = "checkpoint.dcp"
LATEST = "LATEST"
META = "meta.pt"


@dataclass(frozen=True)
class Ranks:
    """Where this process sits in the run: rank, world size, local rank (its GPU)."""

    rank: int = 0
    world: int = 1
    local_rank: int = 0
    owns_group: bool = False  # init_ranks made the process group, so the run tears it down

    @property
    def main(self) -> bool:
        """Rank 0: the one that writes logs, plots, the progress bar and checkpoint metadata."""
        return self.rank == 0


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    if value is None:
        return default
    if not value.isdigit():
        raise ValueError(f"environment variable {name}={value!r} must be a non-negative integer (torchrun sets it)")
    return int(value)


def init_ranks(device: str, *, timeout_s: float = 600.0) -> Ranks:
    """The process group for this run: gloo on a CPU, NCCL on GPUs (one per local rank), from torchrun's
    environment. A single process (no WORLD_SIZE, or 1) gets Ranks() and no group. A collective that waits
    longer than timeout_s (a rank died mid-step) fails instead of hanging."""
    import torch.distributed as dist

    if dist.is_initialized():
        return Ranks(dist.get_rank(), dist.get_world_size(), _env_int("LOCAL_RANK", 0))
    world = _env_int("WORLD_SIZE", 1)
    if world == 1:
        return Ranks()
    rank, local = _env_int("RANK", 0), _env_int("LOCAL_RANK", 0)
    if device == "cuda":
        if local >= torch.cuda.device_count():
            raise ValueError(f"LOCAL_RANK={local} but this machine has {torch.cuda.device_count()} CUDA device(s): "
                             "launch at most one process per GPU")  # fmt: skip
        torch.cuda.set_device(local)
    dist.init_process_group("nccl" if device == "cuda" else "gloo", timeout=timedelta(seconds=timeout_s))
    return Ranks(rank, world, local, owns_group=True)


@contextmanager
def one_process_group() -> Iterator[None]:
    """A one-rank gloo group in this process (FSDP2 on one CPU process: notebooks, the regression packs), torn
    down on exit; a group that is already initialised (under torchrun) is used as it is and left alone."""
    import torch.distributed as dist

    if dist.is_initialized():
        yield
        return
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def rank_rows(batch_size: int, ranks: Ranks) -> slice:
    """This rank's rows of a global batch; the batch must split evenly (the error names the field)."""
    if batch_size % ranks.world:
        raise ValueError(f"TrainConfig.batch_size={batch_size} is the global batch and must split evenly over "
                         f"{ranks.world} ranks")  # fmt: skip
    per = batch_size // ranks.world
    return slice(ranks.rank * per, (ranks.rank + 1) * per)


def token_share(targets: torch.Tensor, rows: slice, ignore_index: int) -> float:
    """This rank's share of the global batch's targets (targets: the whole global batch, on the host). The
    model's loss is a mean over the rank's own targets; weighted by this share and averaged over `world` ranks
    (FSDP2's gradient average), it is the mean over all of them."""
    valid = targets != ignore_index
    total = int(valid.sum())
    return int(valid[rows].sum()) / total if total else 0.0


def all_reduce_sum(value: torch.Tensor, ranks: Ranks) -> torch.Tensor:
    """The sum over ranks of a tensor (a copy; the input is untouched). One process: the value itself."""
    if ranks.world == 1:
        return value
    import torch.distributed as dist

    out = value.clone()
    dist.all_reduce(out, op=dist.ReduceOp.SUM)
    return out


# ----------------------------------------------------------------------------- sharded checkpoints


def _fsync_write(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_sharded(root: str | Path, step: int, state: dict[str, Any], meta: dict[str, Any], ranks: Ranks) -> Path:
    """Collective: every rank writes its shards of `state` ({"model": ..., "optimizer": ...}, DTensors sharded
    as they are), rank 0 the small `meta`; `LATEST` moves only once the step's directory is whole."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    root = Path(root)
    final, tmp = root / f"step-{step:08d}", root / f"step-{step:08d}.tmp"
    if ranks.main:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)  # a save of this step that died half-way
    dist.barrier()
    dcp.save(state, storage_writer=dcp.FileSystemWriter(str(tmp), sync_files=True))
    if ranks.main:
        with open(tmp / META, "wb") as f:
            torch.save(meta, f)
            f.flush()
            os.fsync(f.fileno())
        if final.exists():  # this step saved before (a resume that stopped at once): the new one replaces it
            shutil.rmtree(final)
        os.rename(tmp, final)
        _fsync_dir(root)
        _fsync_write(root / LATEST, final.name.encode())
        for old in root.glob("step-*"):  # older steps and stale temporaries, now that LATEST is moved
            if old != final:
                shutil.rmtree(old, ignore_errors=True)
    dist.barrier()
    return final


def latest_sharded(root: str | Path) -> Path | None:
    """The step directory `LATEST` names, or None when no sharded checkpoint was ever completed."""
    root = Path(root)
    pointer = root / LATEST
    if not pointer.is_file():
        return None
    name = pointer.read_text().strip()
    step_dir = root / name
    for needed in (step_dir / META, step_dir / ".metadata"):
        if not needed.is_file():
            raise ValueError(f"sharded checkpoint {root}: {LATEST} names {name!r}, which lacks {needed.name}")
    return step_dir


def read_sharded_meta(step_dir: str | Path) -> dict[str, Any]:
    """What rank 0 saved beside the shards: step, configs, loader, RNG, history."""
    path = Path(step_dir) / META
    try:
        meta = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # noqa: BLE001 - unreadable for any reason means the same to the user
        raise ValueError(f"sharded checkpoint {path} cannot be read ({type(err).__name__}: {err})") from None
    if not isinstance(meta, dict):
        raise ValueError(f"sharded checkpoint {path} holds a {type(meta).__name__}, not checkpoint metadata")
    return meta


def load_sharded(step_dir: str | Path, state: dict[str, Any]) -> None:
    """Collective: fill `state` (this run's own sharded {"model", "optimizer"} dicts) in place from a
    checkpoint saved at any world size; DCP reads the slices each rank's shards need."""
    import torch.distributed.checkpoint as dcp

    try:
        dcp.load(state, storage_reader=dcp.FileSystemReader(str(step_dir)))
    except Exception as err:  # noqa: BLE001 - DCP wraps every rank's error in one CheckpointException
        raise ValueError(f"sharded checkpoint {step_dir} does not fit this model: {str(err)[:800]}") from None


def load_sharded_full(step_dir: str | Path) -> dict[str, Any]:
    """A sharded checkpoint as one process's full tensors ({"model": {name: tensor}, "optimizer": {...}} plus
    its metadata): the single-process checkpoint's dict. Needs no process group."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    with tempfile.TemporaryDirectory(prefix="megacpp-dcp-") as tmp:
        out = Path(tmp) / "full.pt"
        dcp_to_torch_save(str(step_dir), str(out))
        full = torch.load(out, map_location="cpu", weights_only=True)
    return {**read_sharded_meta(step_dir), **full}
