"""The scale-out receipt: `megacpp-lab train` on one GPU and on every GPU of the host (torchrun, FSDP2), at
the same per-GPU batch: tokens/s of each, the ratio, per-GPU peak memory, and both loss curves.

What it measures and writes, and how long it takes: `megacpp-lab bench scale_out --help`
(megacpp_lab.bench.COMMANDS["scale_out"]). The runs go under build/bench-scale-out/ (their checkpoints are
not receipts).
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from megacpp_lab.bench import BenchSetupError, bench_device, output_root
from megacpp_lab.model.train import TrainConfig
from megacpp_lab.receipts import make_receipt, write_receipt

# per-GPU batch: the base preset at B=4 x T=4096 per GPU, bf16, regional compile (the memory sweep's shape)
FULL = TrainConfig(preset="base", seq_len=4096, batch_size=4, steps=40, warmup_steps=5, max_files=3000,
                   log_every=5, val_every=40, ckpt_every=40, val_batches=1, compile=True, tensorboard=False)  # fmt: skip
# a CPU smoke run of the same code: 2 gloo processes against 1
SMALL = TrainConfig(preset="tiny", seq_len=64, batch_size=2, steps=8, warmup_steps=2, max_files=60, val_fraction=0.2,
                    log_every=2, val_every=8, ckpt_every=8, val_batches=1, device="cpu", tensorboard=False)  # fmt: skip
RUNS_DIR = Path("build") / "bench-scale-out"
BAR = 1.8  # N-GPU throughput over 1-GPU throughput, at 2 GPUs


def _launch(config: TrainConfig, nproc: int) -> list[dict[str, Any]]:
    """`megacpp-lab train --nproc N` from scratch; its history rows."""
    out = Path(config.out_dir)
    if out.exists():  # a receipt is one fresh run, never a resume
        import shutil

        shutil.rmtree(out)
    flags = []
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        if value is None:
            continue
        name = f.name.replace("_", "-")
        flags.append(f"--{name}" if value is True else f"--no-{name}" if value is False else f"--{name}={value}")
    cmd = [sys.executable, "-m", "megacpp_lab.cli", "train", f"--nproc={nproc}", "--quiet", *flags]
    done = subprocess.run(cmd, env={**os.environ, "PYTHONUNBUFFERED": "1"}, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"train --nproc {nproc} failed ({done.returncode}):\n{done.stderr[-4000:]}")
    return json.loads((out / "history.json").read_text())


def bench_scale_out(base: TrainConfig, nprocs: tuple[int, ...], *, runs_dir: Path = RUNS_DIR) -> dict[str, Any]:
    """One run per process count, each at base.batch_size rows per process (the global batch grows with it)."""
    results, curves = [], {}
    for nproc in nprocs:
        config = dataclasses.replace(base, batch_size=base.batch_size * nproc, out_dir=str(runs_dir / f"nproc{nproc}"))
        start = time.perf_counter()
        history = _launch(config, nproc)
        rows = [r for r in history if "tokens_per_s" in r]
        steady = sorted(r["tokens_per_s"] for r in rows[1:] or rows)  # the first interval holds the compile
        rate = steady[len(steady) // 2]
        unit = ("GPU" if nproc == 1 else "GPUs") if base.device == "cuda" else ("process" if nproc == 1 else "processes")
        results.append({"contender": f"{nproc} {unit}", "nproc": nproc,
                        "global_batch": config.batch_size, "tokens_per_s": rate, "tokens_per_s_per_rank": rate / nproc,
                        "tokens_per_s_min": steady[0], "tokens_per_s_max": steady[-1],
                        **({"peak_mib": max(r["peak_mib"] for r in rows)} if "peak_mib" in rows[0] else {}),
                        "train_loss": rows[-1]["train_loss"], "elapsed_s": time.perf_counter() - start})  # fmt: skip
        curves[str(nproc)] = history
    one, many = results[0], results[-1]
    scaling = many["tokens_per_s"] / one["tokens_per_s"]
    return make_receipt(
        "scale_out", "scale_out",
        shape={"preset": base.preset, "B_per_rank": base.batch_size, "T": base.seq_len, "steps": base.steps},
        dtype="bfloat16" if base.device == "cuda" else "float32", results=results, device=base.device,
        config=dataclasses.asdict(base), curves=curves,
        summary={"scaling": scaling, "ideal": float(many["nproc"]), "efficiency": scaling / many["nproc"],
                 "bar": {f"{many['nproc']}-rank throughput >= {BAR}x one rank": scaling >= BAR}},  # fmt: skip
        notes=("`megacpp-lab train --nproc N` (torchrun; FSDP2 per block, embedding and [norm, LM head]; fp32 "
               "masters sharded; the fp32-contract parameters replicated) from scratch at each N with the same rows "
               "per rank, so the global batch is N x B_per_rank. tokens_per_s: the median over log intervals after "
               "the first (which holds the compile), every rank's tokens. The loss curves differ because the global "
               "batch does. "
               + ("On the GPU: bf16 forward, fp32 gradient reduce, NCCL; peak_mib is torch.cuda.max_memory_allocated, "
                  "the largest over the ranks." if base.device == "cuda" else
                  "On the CPU (a smoke run, not a receipt): fp32 throughout, gloo over loopback, one thread per "
                  "process, no peak memory.")),
    )  # fmt: skip


def _plot(receipt: dict[str, Any]) -> Any:
    """Loss against tokens seen for each process count, and the throughput bars with the ideal line."""
    import matplotlib.pyplot as plt

    fig, (ax, bx) = plt.subplots(1, 2, figsize=(10, 3.8))
    for r in receipt["results"]:
        rows = [h for h in receipt["curves"][str(r["nproc"])] if "train_loss" in h]
        tokens = [h["step"] * r["global_batch"] * receipt["shape"]["T"] for h in rows]
        ax.plot(tokens, [h["train_loss"] for h in rows], "o-", ms=3, label=r["contender"])
    ax.set(xlabel="tokens seen", ylabel="train loss", title="loss against tokens")
    ax.legend()
    names = [r["contender"] for r in receipt["results"]]
    rates = [r["tokens_per_s"] / 1e3 for r in receipt["results"]]
    bx.bar(names, rates, color="tab:blue")
    bx.axhline(rates[0] * receipt["results"][-1]["nproc"], color="gray", ls="--", label="ideal")
    for i, r in enumerate(receipt["results"]):
        peak = f"\n{r['peak_mib']:.0f} MiB/rank" if "peak_mib" in r else ""  # GPU runs only
        bx.annotate(f"{rates[i]:.1f}k{peak}", (i, rates[i]), ha="center", va="bottom", fontsize=8)
    bx.set(ylabel="k tokens / s", title=f"throughput: {receipt['summary']['scaling']:.2f}x")
    bx.legend()
    fig.tight_layout()
    return fig


def run(out_root: str | Path | None = None, *, small: bool = False, trace: bool = True) -> list[Path]:
    import matplotlib
    import torch

    matplotlib.use("Agg")
    from megacpp_lab.plots import save_figure

    device = "cpu" if small else bench_device("scale_out", small)  # the smoke run: gloo processes, any machine
    if device == "cuda" and torch.cuda.device_count() < 2:
        raise BenchSetupError(f"bench scale_out compares 1 GPU with several: this machine has "
                              f"{torch.cuda.device_count()} (use a host with 2 or more, e.g. nvidia-h200-x2)")  # fmt: skip
    nprocs = (1, torch.cuda.device_count()) if device == "cuda" else (1, 2)
    root = output_root(out_root, small)
    base = dataclasses.replace(SMALL if small else FULL, device=device)
    start = time.perf_counter()
    receipt = bench_scale_out(base, nprocs, runs_dir=root / "scale-out-runs" if small else RUNS_DIR)
    receipt["elapsed_s"] = time.perf_counter() - start
    written = [write_receipt(receipt, root)]
    written.append(save_figure(_plot(receipt), written[-1].with_suffix(".png")))
    return written
