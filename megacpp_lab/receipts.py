"""Benchmark receipts: one JSON schema for every performance claim (docs/design.md, "Receipts").

A receipt lives at profiles/<device-slug>/<subsystem>/<name>.json and is stamped with the
device, torch, triton, git commit and date of the run that produced it.
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

COMMIT_ENV = "MEGACPP_LAB_COMMIT"
METRIC_KEYS = (
    "ms", "fwd_ms", "bwd_ms", "peak_mib", "gb_per_s", "tflops", "max_abs_err", "rel_err",
    "compile_s", "tokens_per_s", "speedup", "nonfinite_outputs", "pct_of_copy", "saved_mib", "bytes_per_token",
    "compression_vs_bf16", "cross_doc_leak", "causal_leak", "ms_min", "ms_max", "peak_total_mib", "mfu", "val_loss", "train_loss",
    "rows_per_s",
)  # fmt: skip
REQUIRED_KEYS = ("name", "subsystem", "device", "torch", "triton", "commit", "date", "shape", "dtype", "results")


def repo_root() -> Path:
    return Path(__file__).resolve().parents[1]


def profiles_dir() -> Path:
    return repo_root() / "profiles"


def device_name(device: torch.device | str | None = None) -> str:
    """The GPU's marketing name, or the CPU's model name."""
    dev = torch.device(device) if device is not None else torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if dev.type == "cuda":
        return torch.cuda.get_device_name(dev)
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return "CPU " + line.split(":", 1)[1].strip()
    except OSError:
        return "CPU"
    return "CPU"


def device_slug(name: str) -> str:
    """'NVIDIA H100 80GB HBM3' -> 'nvidia-h100-80gb-hbm3'."""
    slug = re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")
    return slug or "unknown-device"


def git_commit() -> str:
    """HEAD of the repo, '-dirty' if tracked files changed; MEGACPP_LAB_COMMIT wins (the GPU copy has no .git)."""
    forced = os.environ.get(COMMIT_ENV)
    if forced:
        return forced
    try:
        root = repo_root()
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, check=True)
        dirty = subprocess.run(["git", "status", "--porcelain", "-uno"], cwd=root, capture_output=True, text=True)
        return sha.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def stamp(device: torch.device | str | None = None) -> dict[str, str]:
    """Where and with what a measurement ran."""
    import triton

    return {
        "device": device_name(device),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "commit": git_commit(),
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }


def validate_receipt(receipt: dict[str, Any]) -> None:
    """Fail closed on a receipt that does not follow the schema."""
    missing = [k for k in REQUIRED_KEYS if k not in receipt]
    if missing:
        raise ValueError(f"receipt {receipt.get('name', '?')!r} is missing keys {missing}")
    if not isinstance(receipt["shape"], dict):
        raise ValueError(f"receipt {receipt['name']!r}: shape must be a dict, got {type(receipt['shape']).__name__}")
    results = receipt["results"]
    if not isinstance(results, list) or not results:
        raise ValueError(f"receipt {receipt['name']!r}: results must be a non-empty list")
    for i, row in enumerate(results):
        if not isinstance(row, dict) or not isinstance(row.get("contender"), str):
            raise ValueError(f"receipt {receipt['name']!r}: results[{i}] needs a 'contender' string")
        for key in METRIC_KEYS:
            if key in row:
                value = row[key]
                if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
                    raise ValueError(
                        f"receipt {receipt['name']!r}: results[{i}] ({row['contender']}) {key} = {value!r} "
                        "is not a finite number"
                    )
        if not any(key in row for key in METRIC_KEYS):
            raise ValueError(
                f"receipt {receipt['name']!r}: results[{i}] ({row['contender']}) has no metric; "
                f"expected one of {METRIC_KEYS}"
            )


def make_receipt(
    name: str,
    subsystem: str,
    *,
    shape: dict[str, Any],
    dtype: str | torch.dtype,
    results: list[dict[str, Any]],
    device: torch.device | str | None = None,
    **extra: Any,
) -> dict[str, Any]:
    """Stamp and validate a receipt; `extra` keys (notes, config) are kept."""
    receipt = {
        "name": name,
        "subsystem": subsystem,
        **stamp(device),
        "shape": dict(shape),
        "dtype": str(dtype).removeprefix("torch."),
        "results": results,
        **extra,
    }
    validate_receipt(receipt)
    return receipt


def receipt_path(receipt: dict[str, Any], root: str | Path | None = None) -> Path:
    base = Path(root) if root is not None else profiles_dir()
    return base / device_slug(receipt["device"]) / receipt["subsystem"] / f"{receipt['name']}.json"


def write_receipt(receipt: dict[str, Any], root: str | Path | None = None) -> Path:
    """Write to <root>/<device-slug>/<subsystem>/<name>.json and return the path."""
    validate_receipt(receipt)
    path = receipt_path(receipt, root)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(receipt, indent=1) + "\n")
    return path


def load_receipts(
    subsystem: str | None = None, name: str | None = None, root: str | Path | None = None
) -> list[dict[str, Any]]:
    """Every receipt under root (default profiles/), optionally filtered; each is validated."""
    base = Path(root) if root is not None else profiles_dir()
    out = []
    for path in sorted(base.glob("*/*/*.json")):
        receipt = json.loads(path.read_text())
        if subsystem is not None and receipt.get("subsystem") != subsystem:
            continue
        if name is not None and receipt.get("name") != name:
            continue
        validate_receipt(receipt)
        receipt["_path"] = str(path.relative_to(base.parent) if base.parent in path.parents else path)
        out.append(receipt)
    return out
