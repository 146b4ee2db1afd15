"""Benchmark receipts: one JSON schema for every performance claim (docs/design.md, "Receipts").

A receipt lives at profiles/<device-slug>/<subsystem>/<name>.json and is stamped with the
device, torch, triton, git commit and date of the run that produced it.

The `commit` field is MEGACPP_LAB_COMMIT when that is set; else, in the project's own git checkout whose
megacpp_lab/ package is HEAD's, HEAD's sha ('-dirty' if tracked files outside the package and outside profiles/
changed: the receipts a run writes, and those of earlier commands in the same run, are not code); else (a
copy without .git, such as the GPU machine's, perhaps inside some other repository; a stale .git; uncommitted
changes to the package) 'tree:<sha>', the git tree hash of the package as it ran, which equals
`git rev-parse <commit>:megacpp_lab` for every commit with that package: `commit_for_tree` finds one.
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
import math
import os
import re
import stat
import subprocess
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

COMMIT_ENV = "MEGACPP_LAB_COMMIT"
PACKAGE = "megacpp_lab"
# The root .gitignore's patterns that can match inside the package (those not anchored by a leading "/"; a
# test keeps the two in step). A trailing "/" matches only directories, as there. Left out of the tree hash, as
# git leaves them out of a commit; hard-coded so the hash does not depend on a .gitignore beside the copy.
GITIGNORED = ("__pycache__/", "*.pyc", "*.egg-info/", ".ipynb_checkpoints/", ".venv/", "build/", ".pytest_cache/", "runs/")
METRIC_KEYS = (
    "ms", "fwd_ms", "bwd_ms", "peak_mib", "gb_per_s", "tflops", "max_abs_err", "rel_err",
    "compile_s", "tokens_per_s", "speedup", "nonfinite_outputs", "pct_of_copy", "saved_mib", "bytes_per_token",
    "compression_vs_bf16", "cross_doc_leak", "causal_leak", "ms_min", "ms_max", "peak_total_mib", "mfu", "val_loss", "train_loss",
    "rows_per_s",
)  # fmt: skip
REQUIRED_KEYS = ("name", "subsystem", "device", "torch", "triton", "commit", "date", "shape", "dtype", "results")


def repo_root() -> Path:
    return Path(__file__).resolve().parents[1]


RECEIPT_ROOT = "profiles"  # receipts live under <repository>/profiles/


def profiles_dir() -> Path:
    return repo_root() / RECEIPT_ROOT


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


def git_output(root: Path, *args: str, stdin: str | None = None) -> str:
    """`git <args>` run in root: its stdout, stripped (CalledProcessError on failure, OSError without git)."""
    done = subprocess.run(["git", *args], cwd=root, input=stdin, capture_output=True, text=True, check=True)
    return done.stdout.strip()


def _git_object(kind: bytes, body: bytes) -> bytes:
    return hashlib.sha1(b"%s %d\0" % (kind, len(body)) + body).digest()


def _ignored(name: str, is_dir: bool) -> bool:
    return any(fnmatch.fnmatchcase(name, p.rstrip("/")) for p in GITIGNORED if is_dir or not p.endswith("/"))


def _tree(directory: Path) -> bytes | None:
    """The raw sha of the tree object git writes for `directory`; None if it holds nothing git tracks."""
    entries = []  # (sort key, entry bytes)
    with os.scandir(directory) as it:
        for entry in it:
            is_dir = entry.is_dir(follow_symlinks=False)
            if _ignored(entry.name, is_dir):
                continue
            name = os.fsencode(entry.name)
            if entry.is_symlink():  # git stores the link's target, not what it points at
                mode, sha = b"120000", _git_object(b"blob", os.readlink(os.fsencode(entry.path)))
            elif is_dir:
                sub = _tree(Path(entry.path))
                if sub is None:  # git has no empty directories
                    continue
                mode, sha = b"40000", sub
            elif entry.is_file(follow_symlinks=False):
                executable = entry.stat(follow_symlinks=False).st_mode & stat.S_IXUSR
                mode = b"100755" if executable else b"100644"
                sha = _git_object(b"blob", Path(entry.path).read_bytes())
            else:  # sockets, fifos: nothing git can add
                continue
            # git orders a tree's entries by name bytes, a directory's name as if it ended in "/"
            entries.append((name + b"/" if is_dir else name, b"%s %s\0%s" % (mode, name, sha)))
    if not entries:
        return None
    return _git_object(b"tree", b"".join(body for _, body in sorted(entries)))


def tree_hash(directory: str | Path | None = None) -> str:
    """The git tree hash (hex) of `directory` (default: this package) as it is on disk, computed without git:
    what `git rev-parse <commit>:<path>` prints for a commit holding exactly these files, less the ignored ones."""
    path = Path(directory) if directory is not None else repo_root() / PACKAGE
    sha = _tree(path)
    if sha is None:
        raise ValueError(f"{path} holds no file git would track")
    return sha.hex()


def git_commit(root: str | Path | None = None) -> str:
    """Which code runs: MEGACPP_LAB_COMMIT if set; in the project's own checkout (default root:
    repo_root()), HEAD's sha, plus '-dirty' if tracked files outside the package and outside profiles/
    (RECEIPT_ROOT) changed; elsewhere, or when
    the package differs from HEAD's, 'tree:' + tree_hash of the package."""
    forced = os.environ.get(COMMIT_ENV)
    if forced:
        return forced
    root = Path(root if root is not None else repo_root()).resolve()
    tree = "tree:" + tree_hash(root / PACKAGE)  # what ran, read from the files
    try:
        # Only a checkout whose top level is root itself: a copy without .git inside another repository would
        # otherwise be stamped with that repository's HEAD.
        if Path(git_output(root, "rev-parse", "--show-toplevel")).resolve() != root:
            return tree
        head = git_output(root, "rev-parse", "HEAD")
        # Receipts are not code: a bench that follows another in one session finds the first one's receipts
        # rewritten, and the code that ran is still HEAD's
        if not git_output(root, "status", "--porcelain", "-uno", "--", ".", f":(exclude){RECEIPT_ROOT}"):
            return head
        # A package that differs from HEAD's ran code no commit names yet (or a copy's stale .git: the GPU
        # machine's checkout can lag behind the files sent over it): the tree names it
        return head + "-dirty" if tree == "tree:" + git_output(root, "rev-parse", f"HEAD:{PACKAGE}") else tree
    except (OSError, subprocess.CalledProcessError):  # no git, not a repository, or no commit yet
        return tree


def commit_for_tree(tree: str, *, max_commits: int = 2000, root: str | Path | None = None) -> str | None:
    """The newest of HEAD's last `max_commits` commits whose megacpp_lab/ is `tree` ('tree:<hex>' or hex, as
    git_commit stamps it), in the checkout at root (default repo_root()); None if none is, or there is no git."""
    want = tree.removeprefix("tree:").lower()
    if not re.fullmatch(r"[0-9a-f]{40}", want):
        raise ValueError(f"{tree!r} is not a tree hash ('tree:' and 40 hex digits)")
    root = Path(root if root is not None else repo_root())
    try:
        # rev-list (newest first), not `git log --format=%H`: plumbing, so no user config adds lines to its output
        commits = git_output(root, "rev-list", f"--max-count={max_commits}", "HEAD").split()
        # One cat-file for all commits; a commit without the package answers '<commit>:megacpp_lab missing'
        trees = git_output(
            root, "cat-file", "--batch-check=%(objectname)", stdin="".join(f"{c}:{PACKAGE}\n" for c in commits)
        ).splitlines()
    except (OSError, subprocess.CalledProcessError):
        return None
    return next((c for c, t in zip(commits, trees, strict=True) if t == want), None)


def resolve_tree_stamp(path: str | Path) -> str | None:
    """A receipt measured where git cannot name the commit (the copy of the checkout on a GPU machine) is stamped
    'tree:<hash>' of the package it ran. Back in the checkout, the commit whose megacpp_lab/ is that tree ran the
    same code: the receipt's 'commit' becomes that commit, the tree kept as 'package_tree'. Returns the commit
    (None, the receipt untouched, when no commit holds the tree: commit the code that ran first)."""
    path = Path(path)
    receipt = json.loads(path.read_text())
    tree = receipt.get("commit", "")
    if not tree.startswith("tree:"):
        return tree or None
    commit = commit_for_tree(tree)
    if commit is not None:
        receipt.update(commit=commit, package_tree=tree.removeprefix("tree:"))
        path.write_text(json.dumps(receipt, indent=1) + "\n")
    return commit


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
    """Every receipt under root (default profiles/), optionally filtered; each is validated. Profiler traces
    (`*.pt.trace.json`) and other records kept beside the receipts (a JSON without a receipt's `results`,
    such as the tripwires' recorded lowering runs) are not receipts and are skipped."""
    base = Path(root) if root is not None else profiles_dir()
    out = []
    for path in sorted(base.glob("*/*/*.json")):
        if path.name.endswith(".pt.trace.json"):
            continue
        receipt = json.loads(path.read_text())
        if not isinstance(receipt, dict) or "results" not in receipt:
            continue
        if subsystem is not None and receipt.get("subsystem") != subsystem:
            continue
        if name is not None and receipt.get("name") != name:
            continue
        validate_receipt(receipt)
        receipt["_path"] = str(path.relative_to(base.parent) if base.parent in path.parents else path)
        out.append(receipt)
    return out
