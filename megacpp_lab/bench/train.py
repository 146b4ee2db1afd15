"""The training receipt: the `small` preset trained on the GPU, and the same run without Engram over the same
tokens (the ablation), each with its train and validation loss curves, and a sample from the trained model.

What it measures and writes, and how long it takes: `megacpp-lab bench train --help`
(megacpp_lab.bench.COMMANDS["train"]). The runs' checkpoints go under build/bench-train/ (a `small`
checkpoint is ~0.6 GB with its optimizer state: not a receipt).
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Any

from megacpp_lab.bench import bench_device, output_root
from megacpp_lab.model.decode import sample_text
from megacpp_lab.model.train import tokenize_corpus, train
from megacpp_lab.model.train_config import TrainConfig
from megacpp_lab.receipts import make_receipt, write_receipt

# a GPU run: the small preset (12 layers, d=384, AMRM, Engram at 1, 5, 9), 16 x 1024 tokens a step
FULL = TrainConfig.build(preset="small", seq_len=1024, batch_size=16, steps=1500, warmup_steps=100, lr=2e-3,
                         log_every=25, val_every=100, ckpt_every=500, val_batches=8, compile=True)  # fmt: skip
# a CPU smoke run of the same code: the tiny preset on 60 files
SMALL = TrainConfig(preset="tiny", seq_len=64, batch_size=2, steps=24, warmup_steps=3, lr=2e-3, max_files=60,
                    val_fraction=0.2, log_every=4, val_every=8, ckpt_every=24, val_batches=2, device="cpu")  # fmt: skip
ARMS = (("engram", None), ("no_engram", "none"))  # (name, engram_layers): the preset's layers, then none
PROMPT = "#include <vector>\n\nnamespace at {\n"
RUNS_DIR = Path("build") / "bench-train"


def _falling(values: list[float]) -> dict[str, Any]:
    """How steadily a curve falls: the share of its steps that go down, and first / last / min."""
    downs = sum(b < a for a, b in zip(values, values[1:]))
    return {"first": values[0], "last": values[-1], "min": min(values), "fraction_of_steps_down":
            downs / max(1, len(values) - 1), "last_is_min": values[-1] == min(values)}  # fmt: skip


def bench_train(base: TrainConfig = FULL, *, runs_dir: Path = RUNS_DIR, progress: bool = True) -> dict[str, Any]:
    """Both arms over one tokenized corpus (same files, same split, same batches in the same order), then a
    sample from the Engram arm's checkpoint."""
    corpus = tokenize_corpus(base, progress=progress)
    results, curves = [], {}
    sample: list[str] = []
    for name, engram_layers in ARMS:
        config = dataclasses.replace(base, engram_layers=engram_layers, out_dir=str(runs_dir / name))
        ckpt = Path(config.out_dir) / "checkpoint.pt"
        if ckpt.exists():  # a receipt is one fresh run, never a resume of an older one
            ckpt.unlink()
        start = time.perf_counter()
        result = train(config, progress=progress, corpus=corpus)
        elapsed = time.perf_counter() - start
        val = [r["val_loss"] for r in result.history if "val_loss" in r]
        train_rows = [r["train_loss"] for r in result.history if "train_loss" in r]
        params = sum(p.numel() for p in result.model.parameters())
        results.append({"contender": f"{base.preset}, " + ("Engram at the preset's layers" if engram_layers is None
                                                           else "no Engram"),  # fmt: skip
                        "arm": name, "engram_layers": list(result.config.engram_layers), "parameters": params,
                        "tokens_per_s": result.tokens_per_s, "val_loss": val[-1], "train_loss": train_rows[-1],
                        "elapsed_s": elapsed, "val_curve": _falling(val)})  # fmt: skip
        curves[name] = result.history
        if name == "engram":
            sample = sample_text(ckpt, PROMPT, max_new_tokens=160, temperature=0.8, top_k=50, seed=0,
                                 device=base.device)  # fmt: skip
        del result
    on, off = results
    return make_receipt(
        "train_ablation", "train",
        shape={"preset": base.preset, "B": base.batch_size, "T": base.seq_len, "steps": base.steps},
        dtype="bfloat16" if bench_dtype(base) == "bf16" else "float32", results=results, device=base.device,
        config=dataclasses.asdict(base), curves=curves, sample={"prompt": PROMPT, "text": sample[0]},
        ablation={"val_loss_engram_minus_none": on["val_loss"] - off["val_loss"],
                  "tokens": base.steps * base.batch_size * base.seq_len},  # fmt: skip
        corpus={"train_files": len(corpus.train), "val_files": len(corpus.val),
                "train_tokens": int(sum(len(d) for d in corpus.train)),
                "val_tokens": int(sum(len(d) for d in corpus.val))},  # fmt: skip
        notes=("Two runs from one tokenized corpus, the same seed, the same batches in the same order: the preset, "
               "and the preset with engram_layers=none. Each: TrainConfig as in `config` (fused AdamW over fp32 "
               "master weights, warmup + cosine, grad clip; bf16 with fp32-contract parameters on a GPU; regional "
               "compile when config.parallel.compile). tokens_per_s: the median of the log intervals after the first (which "
               "holds the compile). val_loss: the mean over the fixed validation batches (held-out files). "
               "val_curve.fraction_of_steps_down: the share of validation points below the one before. The sample "
               "is from the Engram arm's final checkpoint, temperature 0.8, top-k 50, seed 0."),
    )  # fmt: skip


def bench_dtype(config: TrainConfig) -> str:
    """The run's dtype: the config's, or bf16 on a GPU and fp32 on a CPU (config.device is never auto here)."""
    dtype = config.parallel.dtype
    return dtype if dtype != "auto" else ("bf16" if config.device == "cuda" else "fp32")


def _plot(receipt: dict[str, Any]) -> Any:
    """Train and val loss of both arms on one plot."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.2))
    for (name, history), color in zip(receipt["curves"].items(), ("tab:blue", "tab:orange")):
        label = "Engram" if name == "engram" else "no Engram"
        tr = [r for r in history if "train_loss" in r]
        va = [r for r in history if "val_loss" in r]
        ax.plot([r["step"] for r in tr], [r["train_loss"] for r in tr], color=color, alpha=0.45, lw=1, label=f"{label}: train")
        ax.plot([r["step"] for r in va], [r["val_loss"] for r in va], "o-", color=color, ms=3, label=f"{label}: val")
    s = receipt["shape"]
    ax.set(xlabel="step", ylabel="loss (nats / token)",
           title=f"{s['preset']} preset, B={s['B']} T={s['T']}: Engram on / off over the same tokens")  # fmt: skip
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def run(out_root: str | Path | None = None, *, small: bool = False, trace: bool = True) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    from megacpp_lab.plots import save_figure

    device = bench_device("train", small)
    root = output_root(out_root, small)
    base = dataclasses.replace(SMALL if small else FULL, device=device)
    start = time.perf_counter()
    # a smoke run keeps everything under its output root; a receipt's checkpoints go to build/, not profiles/
    receipt = bench_train(base, runs_dir=root / "train-runs" if small else RUNS_DIR)
    receipt["elapsed_s"] = time.perf_counter() - start
    written = [write_receipt(receipt, root)]
    written.append(save_figure(_plot(receipt), written[-1].with_suffix(".png")))
    return written
