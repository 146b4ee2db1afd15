"""The Engram ablation receipt: the `small` preset with Engram, without it, and with the hashed n-gram memory in
its place, three seeds per arm, over the same tokens in the same order, on the Debian C++ corpus.

What it measures and writes, and how long it takes: `megacpp-lab bench train --help`
(megacpp_lab.bench.COMMANDS["train"]). Each run's checkpoint goes under build/bench-train/ (not a receipt).

Pieces. A device call may not hold all nine runs: MEGACPP_BENCH_TRAIN_RUNS="engram:0,none:0" runs those alone and
writes each as a piece (<out>/<device>/train/engram_ablation_piece_<arm>_s<seed>.json, stamped with the commit;
beside the receipt, not in a folder of its own: the device tool returns no deeper folder);
MEGACPP_BENCH_TRAIN_PIECES names a directory of earlier pieces to read. The receipt is written once every run
has a piece from this commit and device; until then the command says which runs remain.
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from megacpp_lab.bench import bench_device, output_root
from megacpp_lab.data.corpus import CORPUS_MANIFEST, default_corpus_dir
from megacpp_lab.model.decode import sample_text
from megacpp_lab.model.train import TokenizedCorpus, tokenize_corpus, train
from megacpp_lab.model.train_config import TrainConfig
from megacpp_lab.receipts import device_slug, make_receipt, stamp, write_receipt

PRESET_ENGRAM_LAYERS = "preset-engram-layers"  # resolved per run to the preset's Engram layers

# the arms: what sits at the preset's Engram layers (1, 5, 9 in `small`)
ARMS: dict[str, dict[str, str | None]] = {
    "engram": {"engram_layers": None},
    "none": {"engram_layers": "none"},
    "ngram": {"engram_layers": "none", "ngram_layers": PRESET_ENGRAM_LAYERS},
}
ARM_LABELS = {"engram": "Engram at the preset's Engram layers", "none": "no Engram",
              "ngram": "the hashed n-gram memory at the preset's Engram layers (no Engram)"}  # fmt: skip
SEEDS = (0, 1, 2)
RUNS_ENV = "MEGACPP_BENCH_TRAIN_RUNS"
PIECES_ENV = "MEGACPP_BENCH_TRAIN_PIECES"
PIECE_PREFIX = "engram_ablation_piece_"  # a piece is no receipt: it holds no `results` (load_receipts skips it)
# a GPU run: the small preset (12 layers, d=384, AMRM), 16 x 1024 tokens a step, evaluated every 50 steps (819,200
# tokens) on 8 fixed validation batches and 8 of the held-out library. Sized so that nine runs fit one device call.
FULL = TrainConfig.build(preset="small", seq_len=1024, batch_size=16, steps=400, warmup_steps=40, lr=2e-3,
                         log_every=25, val_every=50, ckpt_every=400, val_batches=8, data_seed=0, compile=True)  # fmt: skip
# a CPU smoke run of the same code: the tiny preset on 40 files of a plain directory (no held-out library)
SMALL = TrainConfig(preset="tiny", seq_len=64, batch_size=2, steps=4, warmup_steps=1, lr=2e-3, max_files=40,
                    val_fraction=0.2, log_every=2, val_every=2, ckpt_every=4, val_batches=2, data_seed=0,
                    device="cpu")  # fmt: skip
SMALL_SEEDS = (0, 1)
PROMPT = "#include <vector>\n\nnamespace detail {\n"
RUNS_DIR = Path("build") / "bench-train"


def _selected_runs(seeds: tuple[int, ...]) -> list[tuple[str, int]]:
    every = [(arm, seed) for arm in ARMS for seed in seeds]
    wanted = os.environ.get(RUNS_ENV, "").strip()
    if not wanted:
        return every
    runs = []
    for item in wanted.split(","):
        arm, _, seed = item.strip().partition(":")
        if (arm, int(seed) if seed.isdigit() else -1) not in every:
            raise ValueError(f"{RUNS_ENV}: {item!r} is not a run of the ablation (arm:seed with arm in {tuple(ARMS)} "
                             f"and seed in {seeds})")  # fmt: skip
        if (arm, int(seed)) in runs:
            raise ValueError(f"{RUNS_ENV}: {item.strip()!r} is named twice")
        runs.append((arm, int(seed)))
    return runs


def run_arm(base: TrainConfig, arm: str, seed: int, corpus: TokenizedCorpus, runs_dir: Path, *,
            progress: bool = True, sample_tokens: int = 160) -> dict[str, Any]:  # fmt: skip
    """One fresh run of one arm and seed (never a resume): its evaluation curve, rate, memory and, for seed 0,
    a sample from its checkpoint."""
    from megacpp_lab.model.config import HYBRID_PRESETS

    preset_layers = ",".join(str(i) for i in HYBRID_PRESETS[base.preset]["engram_layers"])
    fields = {k: preset_layers if v == PRESET_ENGRAM_LAYERS else v for k, v in ARMS[arm].items()}
    config = dataclasses.replace(base, seed=seed, out_dir=str(runs_dir / f"{arm}_s{seed}"), **fields)
    ckpt = Path(config.out_dir) / "checkpoint.pt"
    if ckpt.exists():
        ckpt.unlink()
    start = time.perf_counter()
    result = train(config, progress=progress, corpus=corpus)
    elapsed = time.perf_counter() - start
    tokens_per_step = base.batch_size * base.seq_len
    evals = [{"step": int(r["step"]), "tokens": int(r["step"]) * tokens_per_step, "val_loss": r["val_loss"],
              "heldout_loss": r.get("heldout_loss")} for r in result.history if "val_loss" in r]  # fmt: skip
    train_rows = [r for r in result.history if "train_loss" in r]
    peaks = [r["peak_mib"] for r in result.history if "peak_mib" in r]
    piece = {"arm": arm, "seed": seed, "contender": f"{base.preset}, {ARM_LABELS[arm]}, seed {seed}",
             "engram_layers": list(result.config.engram_layers), "ngram_layers": list(result.config.ngram_layers),
             "parameters": sum(p.numel() for p in result.model.parameters()), "tokens_per_s": result.tokens_per_s,
             "peak_mib": max(peaks) if peaks else None, "elapsed_s": elapsed, "evals": evals,
             "train_curve": [{"step": int(r["step"]), "train_loss": r["train_loss"]} for r in train_rows],
             "val_loss": evals[-1]["val_loss"], "heldout_loss": evals[-1]["heldout_loss"]}  # fmt: skip
    if seed == min(SEEDS):
        piece["sample"] = sample_text(ckpt, PROMPT, max_new_tokens=sample_tokens, temperature=0.8, top_k=50, seed=0,
                                      device=base.device)[0]  # fmt: skip
    return piece


def _spread(values: list[float]) -> dict[str, float]:
    return {"mean": statistics.fmean(values), "min": min(values), "max": max(values),
            "std": statistics.stdev(values) if len(values) > 1 else 0.0, "n": len(values)}  # fmt: skip


def compare(arms: dict[str, list[dict[str, Any]]], key: str, a: str, b: str) -> dict[str, Any] | None:
    """Arm a against arm b on the final `key` loss over their seeds: the difference of the means (a - b) and whether
    it is beyond the seed spread (the two arms' ranges over seeds do not overlap). None without the key."""
    va = [p[key] for p in arms.get(a, []) if p.get(key) is not None]
    vb = [p[key] for p in arms.get(b, []) if p.get(key) is not None]
    if not va or not vb:
        return None
    diff = statistics.fmean(va) - statistics.fmean(vb)
    beyond = max(va) < min(vb) or max(vb) < min(va)
    verdict = ("lower" if diff < 0 else "higher") if beyond else "within the seed spread"
    return {"a": a, "b": b, "loss": key, "mean_a_minus_b": diff, "beyond_seed_spread": beyond, "verdict": verdict,
            "range_a": [min(va), max(va)], "range_b": [min(vb), max(vb)]}  # fmt: skip


def assemble(pieces: list[dict[str, Any]], base: TrainConfig, corpus_info: dict[str, Any]) -> dict[str, Any]:
    """The receipt from one piece per run: per arm the mean and spread over seeds at every evaluation (fixed token
    counts), the final losses, rate and memory, the samples, and each arm against no Engram."""
    pieces = sorted(pieces, key=lambda p: (list(ARMS).index(p["arm"]), p["seed"]))
    steps = {tuple(e["step"] for e in p["evals"]) for p in pieces}
    if len(steps) != 1:
        raise ValueError(f"the runs were evaluated at different steps ({sorted(steps)}): pieces of different configs")
    arms: dict[str, list[dict[str, Any]]] = {}
    for p in pieces:
        arms.setdefault(p["arm"], []).append(p)
    summary: dict[str, Any] = {"arms": {}, "comparisons": []}
    for arm, runs in arms.items():
        curve = []
        for i, point in enumerate(runs[0]["evals"]):
            row = {"step": point["step"], "tokens": point["tokens"],
                   "val_loss": _spread([r["evals"][i]["val_loss"] for r in runs])}  # fmt: skip
            held = [r["evals"][i]["heldout_loss"] for r in runs if r["evals"][i]["heldout_loss"] is not None]
            if held:
                row["heldout_loss"] = _spread(held)
            curve.append(row)
        summary["arms"][arm] = {
            "label": ARM_LABELS[arm], "seeds": [r["seed"] for r in runs], "curve": curve,
            "val_loss": _spread([r["val_loss"] for r in runs]),
            "heldout_loss": _spread([r["heldout_loss"] for r in runs]) if runs[0]["heldout_loss"] is not None else None,
            "tokens_per_s": _spread([r["tokens_per_s"] for r in runs]),
            "peak_mib": max((r["peak_mib"] for r in runs if r["peak_mib"] is not None), default=None),
            "parameters": runs[0]["parameters"], "sample": next((r["sample"] for r in runs if "sample" in r), None),
        }  # fmt: skip
    for a in ("engram", "ngram"):
        for key in ("val_loss", "heldout_loss"):
            c = compare(arms, key, a, "none")
            if c is not None:
                summary["comparisons"].append(c)
    tokens = base.steps * base.batch_size * base.seq_len
    return make_receipt(
        "engram_ablation", "train",
        shape={"preset": base.preset, "B": base.batch_size, "T": base.seq_len, "steps": base.steps, "tokens": tokens,
               "seeds": sorted({p["seed"] for p in pieces})},  # fmt: skip
        dtype="bfloat16" if bench_dtype(base) == "bf16" else "float32",
        results=[{k: v for k, v in p.items() if k not in ("evals", "train_curve") and v is not None} for p in pieces],
        device=base.device, config=dataclasses.asdict(base), summary=summary, corpus=corpus_info,
        curves={f"{p['arm']}_s{p['seed']}": {"evals": p["evals"], "train": p["train_curve"]} for p in pieces},
        prompt=PROMPT,
        notes=("Every run: TrainConfig as in `config` (fused AdamW over fp32 master weights, warmup + cosine, grad "
               "clip; bf16 with fp32-contract parameters on a GPU; regional compile), from one tokenized corpus, the "
               "batches in one order for every run (data_seed); the seed sets the weights. Arms: the preset (its "
               "Engram layers), engram_layers=none, and engram_layers=none with ngram_layers at the preset's Engram "
               "layers. val_loss: the mean "
               "next-token loss over the fixed validation batches (whole held-out files of the training libraries); "
               "heldout_loss: the same over the held-out library's files (transfer). Evaluated every val_every "
               "steps, i.e. at fixed token counts. tokens_per_s: the median of the log intervals after the first. "
               "comparisons: an arm against no Engram on the final loss; beyond_seed_spread when the two arms' "
               "ranges over seeds do not overlap (the only case the verdict names a direction). The samples: seed 0 "
               "of each arm, temperature 0.8, top-k 50."),
    )  # fmt: skip


def bench_dtype(config: TrainConfig) -> str:
    """The run's dtype: the config's, or bf16 on a GPU and fp32 on a CPU (config.device is never auto here)."""
    dtype = config.parallel.dtype
    return dtype if dtype != "auto" else ("bf16" if config.device == "cuda" else "fp32")


def _plot(receipt: dict[str, Any]) -> Any:
    """Validation and held-out-library loss against tokens, each arm's mean with its seed range as a band."""
    import matplotlib.pyplot as plt

    arms = receipt["summary"]["arms"]
    keys = [k for k in ("val_loss", "heldout_loss") if any(k in row for a in arms.values() for row in a["curve"])]
    fig, axes = plt.subplots(1, len(keys), figsize=(6.5 * len(keys), 4.2), squeeze=False)
    for ax, key in zip(axes[0], keys):
        for (arm, a), color in zip(arms.items(), ("tab:blue", "tab:gray", "tab:orange")):
            rows = [r for r in a["curve"] if key in r]
            x = [r["tokens"] / 1e6 for r in rows]
            ax.plot(x, [r[key]["mean"] for r in rows], "o-", ms=3, color=color, label=a["label"])
            ax.fill_between(x, [r[key]["min"] for r in rows], [r[key]["max"] for r in rows], color=color, alpha=0.2)
        ax.set(xlabel="training tokens (M)", ylabel="loss (nats / token)",
               title=("validation files" if key == "val_loss" else "held-out library") + ": mean, band = seed range")  # fmt: skip
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def collect_pieces(dirs: list[Path], stamp_key: tuple[str, str, str], seeds: tuple[int, ...]
                   ) -> dict[tuple[str, int], dict[str, Any]]:  # fmt: skip
    """The pieces under dirs (later directories win) that belong to this receipt: measured by the same (commit,
    device, run_fingerprint), of a run the ablation has (an arm of ARMS, a seed of seeds)."""
    expected = {(a, s) for a in ARMS for s in seeds}
    found: dict[tuple[str, int], dict[str, Any]] = {}
    for path in [q for d in dirs for q in sorted(Path(d).glob(f"{PIECE_PREFIX}*.json"))]:
        piece = json.loads(path.read_text())
        same = (piece.get("commit"), piece.get("device"), piece.get("fingerprint")) == stamp_key
        if same and (piece.get("arm"), piece.get("seed")) in expected:
            found[(piece["arm"], piece["seed"])] = piece
    return found


def run_fingerprint(base: TrainConfig) -> str:
    """What pieces of one receipt must share beyond the commit and the device: the corpus's manifest and the
    tokenizer (files, not code), the torch version, and every setting but the seed and the output directory."""
    import hashlib

    import torch

    from megacpp_lab.data import load_bpe

    h = hashlib.sha256()
    manifest = Path(base.corpus) / CORPUS_MANIFEST if base.corpus else None
    h.update(manifest.read_bytes() if manifest is not None and manifest.exists() else str(base.corpus).encode())
    h.update(str(load_bpe().record["sha256"]).encode() + torch.__version__.encode())
    settings = {k: v for k, v in dataclasses.asdict(base).items() if k not in ("seed", "out_dir")}
    h.update(json.dumps(settings, sort_keys=True, default=str).encode())
    return h.hexdigest()


def _corpus_info(base: TrainConfig, corpus: TokenizedCorpus) -> dict[str, Any]:
    info = {"train_files": len(corpus.train), "val_files": len(corpus.val), "heldout_files": len(corpus.heldout),
            "train_tokens": int(sum(len(d) for d in corpus.train)), "val_tokens": int(sum(len(d) for d in corpus.val)),
            "heldout_tokens": int(sum(len(d) for d in corpus.heldout))}  # fmt: skip
    manifest = Path(base.corpus) / CORPUS_MANIFEST if base.corpus else None
    if manifest is not None and manifest.exists():
        info["sources"] = {k: {f: v[f] for f in ("version", "license", "role", "kept")}
                           for k, v in json.loads(manifest.read_text())["summary"]["sources"].items()}  # fmt: skip
    return info


def run(out_root: str | Path | None = None, *, small: bool = False, trace: bool = True) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    from megacpp_lab.plots import save_figure

    device = bench_device("train", small)
    root = output_root(out_root, small)
    base = dataclasses.replace(SMALL if small else FULL, device=device)
    if not small:
        corpus_dir = default_corpus_dir()
        if not (corpus_dir / CORPUS_MANIFEST).exists():
            raise FileNotFoundError(f"bench train trains on the Debian C++ corpus, and {corpus_dir} holds none: "
                                    "`megacpp-lab data corpus` (or `--from-archive` on a machine without the "
                                    "archive) builds it")  # fmt: skip
        base = dataclasses.replace(base, corpus=str(corpus_dir))
    seeds = SMALL_SEEDS if small else SEEDS
    runs = _selected_runs(seeds)
    runs_dir = root / "train-runs" if small else RUNS_DIR
    here = stamp(device)
    commit, where = here["commit"], here["device"]
    fingerprint = run_fingerprint(base)
    pieces_dir = root / device_slug(where) / "train"
    pieces_dir.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    corpus = tokenize_corpus(base, progress=True)
    if not small and not corpus.heldout:
        raise ValueError(f"the corpus at {base.corpus} has no held-out library (built without libcgal-dev?): the "
                         "ablation measures transfer on it; `megacpp-lab data corpus` builds it with every package")  # fmt: skip
    written = []
    for arm, seed in runs:
        print(f"[bench train] {arm} seed {seed}: {ARM_LABELS[arm]}", file=sys.stderr, flush=True)
        piece = run_arm(base, arm, seed, corpus, runs_dir, sample_tokens=24 if small else 160)
        piece.update(commit=commit, device=where, fingerprint=fingerprint)
        path = pieces_dir / f"{PIECE_PREFIX}{arm}_s{seed}.json"
        path.write_text(json.dumps(piece, indent=1) + "\n")
        written.append(path)
    dirs = [Path(os.environ[PIECES_ENV])] if os.environ.get(PIECES_ENV) else []
    found = collect_pieces([*dirs, pieces_dir], (commit, where, fingerprint), seeds)
    missing = [f"{a}:{s}" for a in ARMS for s in seeds if (a, s) not in found]
    if missing:
        print(f"[bench train] {len(found)} of {len(ARMS) * len(seeds)} runs measured at this commit on this device; "
              f"{RUNS_ENV}={','.join(missing)} measures the rest (with {PIECES_ENV} naming these pieces)",
              file=sys.stderr)  # fmt: skip
        return written
    receipt = assemble(list(found.values()), base, _corpus_info(base, corpus))
    receipt["elapsed_s"] = time.perf_counter() - start
    written = [write_receipt(receipt, root)]  # the pieces stay beside it
    written.append(save_figure(_plot(receipt), written[-1].with_suffix(".png")))
    return written
