"""The scale-out receipt: `megacpp-lab train` on one GPU and on every GPU of the host (torchrun, FSDP2), at
the same per-GPU batch: tokens/s of each, the ratio, per-GPU peak memory, both loss curves, and a profiler
trace of each run's last steps on rank 0, split into compute, communication (exposed or hidden) and idle
time, so the receipt names where the N-GPU step loses time against the 1-GPU step.

What it measures and writes, and how long it takes: `megacpp-lab bench scale_out --help`
(megacpp_lab.bench.COMMANDS["scale_out"]). The runs go under build/bench-scale-out/ (their checkpoints are
not receipts). The corpus is tokenized once, here, into train's token cache, and both runs share one
inductor and one Triton cache: the N-GPU run finds every graph and kernel the 1-GPU run compiled.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import statistics
import subprocess
import sys
import time
from collections import deque
from pathlib import Path
from typing import Any

from megacpp_lab.bench import BenchSetupError, bench_device, output_root
from megacpp_lab.model.train import read_history, tokenize_corpus
from megacpp_lab.model.train_config import TrainConfig
from megacpp_lab.receipts import make_receipt, write_receipt

# per-GPU batch: the base preset at B=4 x T=4096 per GPU, bf16, regional compile (the memory sweep's shape)
FULL = TrainConfig.build(preset="base", seq_len=4096, batch_size=4, steps=40, warmup_steps=5, max_files=3000,
                         log_every=5, val_every=40, ckpt_every=40, val_batches=1, compile=True, tensorboard=False,
                         trace_steps=3)  # fmt: skip
# a CPU smoke run of the same code: 2 gloo processes against 1
SMALL = TrainConfig(preset="tiny", seq_len=64, batch_size=2, steps=8, warmup_steps=2, max_files=60, val_fraction=0.2,
                    log_every=2, val_every=8, ckpt_every=8, val_batches=1, device="cpu", tensorboard=False,
                    trace_steps=1)  # fmt: skip
RUNS_DIR = Path("build") / "bench-scale-out"
BAR = 1.85  # N-GPU throughput over 1-GPU throughput, at 2 GPUs


def _caches(runs_dir: Path) -> dict[str, str]:
    """One inductor and one Triton cache for every run of the benchmark, under runs_dir; a user's own setting
    wins. (Importing the kernels writes inductor's default directory into TORCHINDUCTOR_CACHE_DIR, so a value
    equal to that default is not taken for the user's.)"""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    own = {"TORCHINDUCTOR_CACHE_DIR": runs_dir / "inductor-cache", "TRITON_CACHE_DIR": runs_dir / "triton-cache"}
    user = {k: os.environ.get(k) for k in own}
    if user["TORCHINDUCTOR_CACHE_DIR"] == default_cache_dir():
        user["TORCHINDUCTOR_CACHE_DIR"] = None
    return {k: user[k] or str(v.resolve()) for k, v in own.items()}


def _launch(config: TrainConfig, nproc: int, env: dict[str, str], label: str) -> list[dict[str, Any]]:
    """`megacpp-lab train --nproc N` from scratch, its lines echoed as they come (prefixed with `label`); its
    history rows."""
    out = Path(config.out_dir)
    if out.exists():  # a receipt is one fresh run, never a resume
        shutil.rmtree(out)
    flags = []
    values = {f.name: getattr(config, f.name) for f in dataclasses.fields(config) if f.name != "parallel"}
    values.update((f.name, getattr(config.parallel, f.name)) for f in dataclasses.fields(config.parallel)
                  if f.name != "backend")  # the flags of `train`: ParallelConfig's fields are flat there
    if nproc == 1:  # FSDP2's knobs: one process shards nothing, and parallelize refuses them set
        values.update(reshard_after_forward=None, fsdp_blocks_per_group=None)
    for name, value in values.items():
        if value is None:
            continue
        name = name.replace("_", "-")
        flags.append(f"--{name}" if value is True else f"--no-{name}" if value is False else f"--{name}={value}")
    cmd = [sys.executable, "-m", "megacpp_lab.cli", "train", f"--nproc={nproc}", *flags]
    proc = subprocess.Popen(cmd, env={**os.environ, **env, "PYTHONUNBUFFERED": "1"}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)  # fmt: skip
    tail: deque[str] = deque(maxlen=60)
    assert proc.stdout is not None
    for line in proc.stdout:
        tail.append(line)
        print(f"[{label}] {line}", end="", file=sys.stderr, flush=True)
    if proc.wait():
        raise RuntimeError(f"train --nproc {nproc} failed ({proc.returncode}):\n{''.join(tail)[-4000:]}")
    return read_history(out)[1]


def _trace_split(run_dir: Path, device: str) -> tuple[Path | None, dict[str, Any] | None]:
    """The run's rank-0 trace and, on a GPU, its compute / communication / idle split per traced step."""
    from megacpp_lab.profiling import gpu_time_split

    traces = sorted((run_dir / "trace").glob("*.pt.trace.json*"), key=lambda p: p.stat().st_mtime)
    if not traces:
        return None, None
    return traces[-1], (gpu_time_split(traces[-1]) if device == "cuda" else None)


def step_split(split: dict[str, Any]) -> dict[str, float]:
    """Milliseconds per traced step (medians over the steps): period (one step's GPU start to the next's, the
    gap between them included), window, compute, communication, exposed communication, and idle (period
    minus compute and exposed communication: the GPU doing nothing, between the steps too). The steps'
    own GPU events only: a GPU-bound run's trace also holds kernels launched before the profiler started,
    which a division of the whole trace by its step count would add to the first step."""
    steps = split.get("per_step") or []
    if len(steps) < 2:
        raise ValueError(f"the trace split holds {len(steps)} profiled steps; a period needs 2 or more")
    rows = []
    for step, after in zip(steps, steps[1:]):
        period = after["start_ms"] - step["start_ms"]
        rows.append({"period_ms": period, "window_ms": step["window_ms"], "compute_ms": step["compute_ms"],
                     "comm_ms": step["comm_ms"], "exposed_comm_ms": step["exposed_comm_ms"],
                     "idle_ms": period - step["compute_ms"] - step["exposed_comm_ms"]})  # fmt: skip
    return {k: statistics.median(r[k] for r in rows) for k in rows[0]}


def gap_notes(one: dict[str, float], many: dict[str, float], nproc: int) -> str:
    """Where the N-GPU step's time differs from the 1-GPU step's, in the trace's own numbers."""
    delta = {"compute": many["compute_ms"] - one["compute_ms"],
             "exposed communication": many["exposed_comm_ms"] - one["exposed_comm_ms"],
             "GPU idle": many["idle_ms"] - one["idle_ms"]}  # fmt: skip
    why = {"compute": ("more compute: NCCL kernels share the SMs and memory bandwidth, FSDP2 adds copy-in/copy-out"
                       if delta["compute"] > 0 else "less compute: a rank steps AdamW over its shard alone, and the "
                       "1-GPU step also rounds bf16 weights from its fp32 masters"),
           "exposed communication": "NCCL running while no compute kernel does",
           "GPU idle": "the GPU waiting for its host: launch overhead, FSDP2's hooks"}  # fmt: skip
    order = sorted(delta, key=lambda k: -delta[k])
    parts = "; ".join(f"{delta[k]:+.1f} ms {k} ({why[k]})" for k in order)
    return (f"Traced steps (rank 0, median period from one step's GPU start to the next): {nproc} GPUs "
            f"{many['period_ms']:.1f} ms against 1 GPU {one['period_ms']:.1f} ms "
            f"({many['period_ms'] - one['period_ms']:+.1f} ms): {parts}. NCCL kernels run "
            f"{many['comm_ms']:.1f} ms a step, {many['comm_ms'] - many['exposed_comm_ms']:.1f} ms of it under compute. "
            f"The largest added term is {order[0]}.")  # fmt: skip


def bench_scale_out(base: TrainConfig, nprocs: tuple[int, ...], *, runs_dir: Path = RUNS_DIR,
                    traces_to: Path | None = None) -> dict[str, Any]:  # fmt: skip
    """One run per process count, each at base.batch_size rows per process (the global batch grows with it).
    traces_to: copy each run's rank-0 trace there (the receipt's directory)."""
    print(f"scale_out: tokenizing the corpus once for every run (cached, {base.max_files} files at most)",
          file=sys.stderr, flush=True)  # fmt: skip
    tokenize_corpus(base, progress=True)
    env = _caches(runs_dir)
    cold = not any(Path(env["TORCHINDUCTOR_CACHE_DIR"]).glob("*"))
    results, curves, splits, traces = [], {}, {}, {}
    for nproc in nprocs:
        config = dataclasses.replace(base, batch_size=base.batch_size * nproc, out_dir=str(runs_dir / f"nproc{nproc}"))
        unit = ("GPU" if nproc == 1 else "GPUs") if base.device == "cuda" else ("process" if nproc == 1 else "processes")
        warm = "cold" if cold and nproc == nprocs[0] else "warm"
        print(f"scale_out: {nproc} {unit}, global batch {config.batch_size} x {base.seq_len}, {base.steps} steps "
              f"({warm} compile caches: {env['TORCHINDUCTOR_CACHE_DIR']})", file=sys.stderr, flush=True)  # fmt: skip
        start = time.perf_counter()
        history = _launch(config, nproc, env, f"{nproc} {unit}")
        elapsed = time.perf_counter() - start
        rows = [r for r in history if "tokens_per_s" in r]
        steady = sorted(r["tokens_per_s"] for r in rows[1:] if not r.get("traced")) or [rows[-1]["tokens_per_s"]]
        rate = steady[len(steady) // 2]
        results.append({"contender": f"{nproc} {unit}", "nproc": nproc,
                        "global_batch": config.batch_size, "tokens_per_s": rate, "tokens_per_s_per_rank": rate / nproc,
                        "tokens_per_s_min": steady[0], "tokens_per_s_max": steady[-1], "intervals": len(steady),
                        **({"peak_mib": max(r["peak_mib"] for r in rows)} if "peak_mib" in rows[0] else {}),
                        "train_loss": rows[-1]["train_loss"], "elapsed_s": elapsed,
                        **({"compile_caches": warm} if base.parallel.compile else {})})  # fmt: skip
        print(f"scale_out: {nproc} {unit}: {rate / 1e3:.1f}k tokens/s (median of {len(steady)} intervals, "
              f"{steady[0] / 1e3:.1f}k-{steady[-1] / 1e3:.1f}k) in {elapsed:.0f} s", file=sys.stderr, flush=True)  # fmt: skip
        curves[str(nproc)] = history
        trace, split = _trace_split(Path(config.out_dir), base.device)
        if split is not None and len(split.get("per_step") or []) < 2:
            split = None  # fewer than 2 profiled steps (trace_steps 1): no period to split
        if trace is not None and traces_to is not None:
            traces_to.mkdir(parents=True, exist_ok=True)
            dest = traces_to / f"scale_out_{nproc}{'gpu' if base.device == 'cuda' else 'proc'}.pt.trace.json.gz"
            shutil.copyfile(trace, dest)
            traces[str(nproc)] = dest.name
        if split is not None:
            splits[str(nproc)] = {**step_split(split), "comm_kernels": split["comm_kernels"][:8],
                                  "per_step": split.get("per_step", [])}  # fmt: skip
    one, many = results[0], results[-1]
    scaling = many["tokens_per_s"] / one["tokens_per_s"]
    gap = gap_notes(splits[str(one["nproc"])], splits[str(many["nproc"])], many["nproc"]) if len(splits) > 1 else ""
    return make_receipt(
        "scale_out", "scale_out",
        shape={"preset": base.preset, "B_per_rank": base.batch_size, "T": base.seq_len, "steps": base.steps},
        dtype="bfloat16" if base.device == "cuda" else "float32", results=results, device=base.device,
        config=dataclasses.asdict(base), curves=curves, trace_split=splits, traces=traces,
        summary={"scaling": scaling, "ideal": float(many["nproc"]), "efficiency": scaling / many["nproc"],
                 "bar": {f"{many['nproc']}-rank throughput >= {BAR}x one rank": scaling >= BAR}},  # fmt: skip
        notes=("`megacpp-lab train --nproc N` (torchrun; FSDP2 per block, embedding and [norm, LM head]; fp32 "
               "masters sharded; the fp32-contract parameters replicated, their gradients averaged in one "
               "all-reduce per backward) from scratch at each N with the same rows per rank, so the global batch "
               "is N x B_per_rank. tokens_per_s: the median over log intervals after the first (which holds the "
               "compile), leaving out the traced interval (profiler overhead), every rank's tokens. The loss "
               "curves differ because the global batch does. "
               + ("On the GPU: bf16 forward, fp32 gradient reduce, NCCL; peak_mib is torch.cuda.max_memory_allocated, "
                  "the largest over the ranks. trace_split: rank 0's profiler trace of the run's last steps, "
                  "split by profiling.gpu_time_split. " + gap if base.device == "cuda" else
                  "On the CPU (a smoke run, not a receipt): fp32 throughout, gloo over loopback, one thread per "
                  "process, no peak memory, a CPU-only trace.")),
    )  # fmt: skip


def plot_scale_out(receipt: dict[str, Any]) -> Any:
    """Loss against tokens seen for each process count, the throughput bars with the ideal line, and (GPU
    receipts) each run's traced step split into compute, exposed communication and idle time."""
    import matplotlib.pyplot as plt

    splits = receipt.get("trace_split") or {}
    fig, axes = plt.subplots(1, 3 if splits else 2, figsize=(15 if splits else 10, 3.8))
    ax, bx = axes[0], axes[1]
    for r in receipt["results"]:
        rows = [h for h in receipt["curves"][str(r["nproc"])] if "train_loss" in h]
        tokens = [h["step"] * r["global_batch"] * receipt["shape"]["T"] for h in rows]
        ax.plot(tokens, [h["train_loss"] for h in rows], "o-", ms=3, label=r["contender"])
    ax.set(xlabel="tokens seen", ylabel="train loss", title="loss against tokens")
    ax.legend()
    names = [r["contender"] for r in receipt["results"]]
    rates = [r["tokens_per_s"] / 1e3 for r in receipt["results"]]
    spread = [[(r["tokens_per_s"] - r.get("tokens_per_s_min", r["tokens_per_s"])) / 1e3 for r in receipt["results"]],
              [(r.get("tokens_per_s_max", r["tokens_per_s"]) - r["tokens_per_s"]) / 1e3 for r in receipt["results"]]]
    bx.bar(names, rates, color="tab:blue", yerr=spread, capsize=4)
    bx.axhline(rates[0] * receipt["results"][-1]["nproc"], color="gray", ls="--", label="ideal")
    for i, r in enumerate(receipt["results"]):
        peak = f"\n{r['peak_mib'] / 1024:.1f} GiB/rank" if "peak_mib" in r else ""  # GPU runs only
        bx.annotate(f"{rates[i]:.1f}k{peak}", (i, rates[i]), ha="center", va="bottom", fontsize=8)
    bx.set(ylabel="k tokens / s (median, min-max)", title=f"throughput: {receipt['summary']['scaling']:.2f}x")
    bx.legend()
    if splits:
        cx = axes[2]
        keys = sorted(splits, key=int)
        bottom = [0.0] * len(keys)
        for part, color in (("compute", "tab:blue"), ("exposed_comm", "tab:red"), ("idle", "tab:gray")):
            values = [splits[k][f"{part}_ms"] for k in keys]
            cx.bar([f"{k} GPU{'s' if k != '1' else ''}" for k in keys], values, bottom=bottom, color=color,
                   label=part.replace("_", " "))  # fmt: skip
            bottom = [b + v for b, v in zip(bottom, values)]
        cx.set(ylabel="ms per traced step (rank 0)", title="where the step goes")
        cx.legend(fontsize=8)
    fig.tight_layout()
    return fig


def run(out_root: str | Path | None = None, *, small: bool = False, trace: bool = True) -> list[Path]:
    import matplotlib
    import torch

    matplotlib.use("Agg")
    from megacpp_lab.plots import save_figure
    from megacpp_lab.receipts import device_name, device_slug

    device = "cpu" if small else bench_device("scale_out", small)  # the smoke run: gloo processes, any machine
    if device == "cuda" and torch.cuda.device_count() < 2:
        raise BenchSetupError(f"bench scale_out compares 1 GPU with several: this machine has "
                              f"{torch.cuda.device_count()} (use a host with 2 or more, e.g. nvidia-h200-x2)")  # fmt: skip
    nprocs = (1, torch.cuda.device_count()) if device == "cuda" else (1, 2)
    root = output_root(out_root, small)
    base = dataclasses.replace(SMALL if small else FULL, device=device)
    if not trace:
        base = dataclasses.replace(base, trace_steps=0)
    start = time.perf_counter()
    here = root / device_slug(device_name(device)) / "scale_out"
    receipt = bench_scale_out(base, nprocs, runs_dir=root / "scale-out-runs" if small else RUNS_DIR, traces_to=here)
    receipt["elapsed_s"] = time.perf_counter() - start
    written = [write_receipt(receipt, root)]
    written.append(save_figure(plot_scale_out(receipt), written[-1].with_suffix(".png")))
    written += [here / name for name in receipt["traces"].values()]
    return written
