"""Training HybridLM on packed C++ rows: one config, one loop, atomic checkpoints that resume bit-exactly.

    config = TrainConfig(preset="small", steps=2000, batch_size=16, seq_len=1024, out_dir="runs/small")
    result = train(config)                      # resumes from out_dir/checkpoint.pt when it is there
    model, model_config = load_checkpoint_model("runs/small/checkpoint.pt")

The loop, per step: the next packed batch (data.PackedRowStream: shuffled per epoch, deterministic per
seed, validation files held out by path), its PackedContext built once outside the model, next-token
targets that never cross a document boundary, forward to the fused loss, backward, then the optimizer
step. The run's pieces each have their module: the config (model/train_config.py: TrainConfig,
resolve_device), the optimizer and the LR schedule (model/optim.py: MasterWeightAdamW, lr_at), checkpoint
I/O (model/checkpoint_io.py: save, load, resume); this file is the loop, the data it reads, and the
history it writes.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from megacpp_lab.data import PackedRowStream, load_bpe, load_corpus, next_token_targets, split_by_file, tokenize_files
from megacpp_lab.data.corpus import CORPUS_MANIFEST, load_corpus_split
from megacpp_lab.model.checkpoint_io import (CHECKPOINT_FILE, CHECKPOINT_FORMAT, check_resume, latest_checkpoint,
                                             load_train_state, save_checkpoint, sharded_state)  # fmt: skip
from megacpp_lab.model.config import HybridConfig
from megacpp_lab.model.distributed import SHARDED_DIR, Ranks, all_reduce_sum, init_ranks, rank_rows, save_sharded, token_share
from megacpp_lab.model.hybrid import HybridLM
from megacpp_lab.model.optim import MasterWeightAdamW, lr_at
from megacpp_lab.model.parallelize import block_structures, describe_compile, parallelize
from megacpp_lab.model.precompile import precompile
from megacpp_lab.model.train_config import TrainConfig, resolve_device
from megacpp_lab.nn.dsa import set_dsa_phase
from megacpp_lab.nn.moe import update_balance
from megacpp_lab.varlen import PackedContext, copy_to_device

__all__ = ["HISTORY_FILE", "TokenizedCorpus", "TrainResult", "plot_history", "read_history", "tokenize_corpus", "train",
           "write_history"]  # fmt: skip

# token ids of the corpus, cached between runs and ranks (data.tokenize_files): build/ beside the package
TOKEN_CACHE = Path(__file__).resolve().parents[2] / "build" / "tokenized"
HISTORY_FILE = "history.json"


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
    heldout: list[Any] = dataclasses.field(default_factory=list)  # a built corpus's held-out library (transfer)


def tokenize_corpus(config: TrainConfig, *, progress: bool = False,
                    cache_dir: str | Path | None = TOKEN_CACHE) -> TokenizedCorpus:  # fmt: skip
    """Read the corpus, hold out validation files by path, and tokenize both sides with the BPE. A corpus built by
    `megacpp-lab data corpus` (its manifest in config.corpus) brings its own splits: train, val, and the held-out
    library (max_files caps each, a draw across its libraries). The token ids are cached under cache_dir (data.tokenize_files; None: no cache),
    so every rank of a run and every later run over the same files reads them instead of tokenizing again."""
    tok = load_bpe()
    if config.corpus is not None and (Path(config.corpus) / CORPUS_MANIFEST).exists():  # `megacpp-lab data corpus`
        parts = [_capped(load_corpus_split(split, config.corpus), config.max_files) for split in ("train", "val", "heldout")]
        for split, part in zip(("train", "val"), parts):
            if not part:
                raise ValueError(f"corpus {config.corpus}: its {split} split holds no file; a run needs both train and val "
                                 "(build the corpus from more packages)")  # fmt: skip
    else:
        files = load_corpus(config.corpus, max_files=config.max_files, progress=False)
        parts = [*split_by_file(files, config.val_fraction), []]
    train_docs, val_docs, heldout = (tokenize_files(part, tok, progress=progress, cache_dir=cache_dir) if part else []
                                     for part in parts)  # fmt: skip
    return TokenizedCorpus(train_docs, val_docs, config.corpus, config.max_files, config.val_fraction, heldout)


def _capped(files: list[Any], max_files: int | None) -> list[Any]:
    """At most max_files of a split, a draw across its libraries (by a salted hash of each path), in path order."""
    if max_files is None or len(files) <= max_files:
        return files
    keep = {f.relpath for f in sorted(files, key=lambda f: hashlib.sha256(b"cap\0" + f.relpath.encode()).digest())[:max_files]}
    return [f for f in files if f.relpath in keep]


def _data(config: TrainConfig, corpus: TokenizedCorpus, pad_id: int
          ) -> tuple[PackedRowStream, list[Any], list[Any]]:  # fmt: skip
    """The training stream and the fixed evaluation batches: validation (the first of the held-out files, in
    order) and, for a built corpus, the held-out library's (none otherwise)."""
    for name in ("corpus", "max_files", "val_fraction"):
        if getattr(corpus, name) != getattr(config, name):
            raise ValueError(f"the tokenized corpus was built with {name}={getattr(corpus, name)!r}, the run asks "
                             f"{getattr(config, name)!r}")  # fmt: skip
    stream = PackedRowStream(corpus.train, seq_len=config.seq_len, batch_size=config.batch_size, pad_id=pad_id,
                             seed=config.seed if config.data_seed is None else config.data_seed)  # fmt: skip

    def fixed(docs: list[Any]) -> list[Any]:
        if not docs:
            return []
        rows = PackedRowStream(docs, seq_len=config.seq_len, batch_size=config.batch_size, pad_id=pad_id, shuffle=False)
        return [next(rows) for _ in range(min(config.val_batches, rows.batches_per_epoch))]

    return stream, fixed(corpus.val), fixed(corpus.heldout)


def _targets(tokens: torch.Tensor, doc_ids: torch.Tensor, pad_id: int, ignore_index: int) -> torch.Tensor:
    targets = next_token_targets(tokens, doc_ids, ignore_index)
    return targets.masked_fill(targets == pad_id, ignore_index)  # padding is never a target


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
    found = latest_checkpoint(out, ranks)
    if not resume and found is not None:
        raise ValueError(f"{found[1]} exists and resume is off: remove it or choose another out_dir")
    saved = found[2] if found is not None else None
    if saved is not None:
        check_resume(saved, config, found[1])
    ignore = hcfg.lm_head.ignore_index

    if corpus is None:
        corpus = tokenize_corpus(config, progress=progress and ranks.main)
    stream, val_batches, heldout_batches = _data(config, corpus, tok.pad_id)
    torch.manual_seed(config.seed)
    model = parallelize(HybridLM(hcfg).to(device), config.parallel, device=device, fsdp=ranks.world > 1)
    opt = MasterWeightAdamW(model, config)
    history: list[dict[str, float]] = []
    start = 0
    if saved is not None:
        load_train_state(model, opt, found, ranks)
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
        mine = batch if rows == slice(0, batch.batch_size) else batch.rows(rows)  # a sub-batch: its own cu_seqlens
        ctx = PackedContext.from_batch(mine).to(device)  # the batch's positions and cu_seqlens, not derived again
        tokens, targets = (copy_to_device(t[rows], device) for t in (batch.tokens, targets))
        return tokens, ctx, targets, share

    def validate(batches: list[Any]) -> float:
        model.eval()
        total = torch.zeros((), device=device, dtype=torch.float64)
        with torch.no_grad():
            for b in batches:
                tokens, ctx, targets, share = rank_batch(b)
                # the next-token loss alone (the MTP modules skipped): with MTP the training objective adds their
                # losses, and validation compares models with and without them
                total += model(tokens, ctx, targets, with_mtp=False).lm_loss.double() * share
        model.train()
        return float(all_reduce_sum(total, ranks)) / len(batches)

    def checkpoint(step: int) -> None:
        rng = {"torch": torch.get_rng_state(), "cuda": torch.cuda.get_rng_state() if device == "cuda" else None}
        meta = dict(format=CHECKPOINT_FORMAT, step=step, train_config=dataclasses.asdict(config),
                    model_config=dataclasses.asdict(hcfg), loader=stream.state_dict(), rng=rng, history=history,
                    pending_loss=(float(all_reduce_sum(loss_sum, ranks)), s_log))  # fmt: skip
        if ranks.world > 1:
            save_sharded(out / SHARDED_DIR, step, sharded_state(model, opt), meta, ranks)
        else:
            save_checkpoint(ckpt_path, dict(meta, model=opt.master_state_dict(), optimizer=opt.optimizer_state_by_name()))

    def log(row: dict[str, float]) -> None:
        history.append(row)
        if writer is not None:
            for key, value in row.items():
                if key != "step":
                    writer.add_scalar(key.replace("_", "/", 1) if key in ("train_loss", "val_loss", "heldout_loss") else key,
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
    dsa_warmup = hcfg.dsa.warmup_steps if hcfg.dsa_layers else 0
    for step in bar:
        if hcfg.dsa_layers and step in (start, dsa_warmup):  # DSA: the indexer's dense warm-up, then sparse
            phase = "warmup" if step < dsa_warmup else "sparse"
            set_dsa_phase(model, phase)
            say(f"step {step + 1}: DSA layers {list(hcfg.dsa_layers)} in their {phase} phase")
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
        update_balance(model)  # E blocks: each expert's routing bias toward the mean load (no host sync)
        if compiling:  # one host sync, once: the first step's time is what the compile cost
            if device == "cuda":
                torch.cuda.synchronize()
            say(f"step {step + 1}: {describe_compile(time.perf_counter() - t_compile, since, model=model)}")
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
            row = dict(step=done, val_loss=validate(val_batches))
            if heldout_batches:  # a built corpus: the held-out library's loss (transfer)
                row["heldout_loss"] = validate(heldout_batches)
            log(row)
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
    """Train, validation and (a built corpus) held-out-library loss against the step, as a PNG."""
    from matplotlib.figure import Figure  # no pyplot: a notebook's backend stays as it is

    fig = Figure(figsize=(6.4, 3.6))
    ax = fig.subplots()
    for key, style in (("train_loss", "-"), ("val_loss", "o-"), ("heldout_loss", "s--")):
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
