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

import ast
import fnmatch
import hashlib
import json
import math
import os
import re
import stat
import subprocess
from collections import deque
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


def _git(root: Path, *args: str, stdin: str | None = None) -> str:
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
        if Path(_git(root, "rev-parse", "--show-toplevel")).resolve() != root:
            return tree
        head = _git(root, "rev-parse", "HEAD")
        # Receipts are not code: a bench that follows another in one session finds the first one's receipts
        # rewritten, and the code that ran is still HEAD's
        if not _git(root, "status", "--porcelain", "-uno", "--", ".", f":(exclude){RECEIPT_ROOT}"):
            return head
        # A package that differs from HEAD's ran code no commit names yet (or a copy's stale .git: the GPU
        # machine's checkout can lag behind the files sent over it): the tree names it
        return head + "-dirty" if tree == "tree:" + _git(root, "rev-parse", f"HEAD:{PACKAGE}") else tree
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
        commits = _git(root, "rev-list", f"--max-count={max_commits}", "HEAD").split()
        # One cat-file for all commits; a commit without the package answers '<commit>:megacpp_lab missing'
        trees = _git(
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


# ----------------------------------------------------------------------------- a receipt against today's code

# The module that writes each subsystem's receipts where bench.COMMANDS does not name it (CLI commands of their own)
RECEIPT_WRITERS = {"profile": "megacpp_lab.bench.profile", "memory": "megacpp_lab.bench.memory"}
# Files a subsystem's numbers depend on that no import reaches: the CLI whose flag defaults the profile and memory
# commands pass their writers (the file alone, not every command it imports)
EXTRA_MEASURED = {"profile": (f"{PACKAGE}/cli.py",), "memory": (f"{PACKAGE}/cli.py",)}
# the committed data (the packed sample, the BPE, the manifest): measured wherever the package's data module is
# reached
DATA_DIR = "data"
# What stamps, validates and draws the receipts: no measured number passes through them, so a change to them
# leaves every receipt measuring the same code (the measuring itself, profiling.py and bench/harness.py, counts)
NOT_MEASURED = (f"{PACKAGE}/receipts.py", f"{PACKAGE}/plots.py")
_MODULE_NAME = re.compile(rf"\b{PACKAGE}(?:\.[A-Za-z_]\w*)+\b|\b{PACKAGE}\b")


def _module_file(module: str, root: Path) -> Path | None:
    """The file of a package module ('megacpp_lab.kernels.ssd' -> megacpp_lab/kernels/ssd.py, a package's
    __init__.py), None if there is none (a name inside a module, not a module)."""
    base = root.joinpath(*module.split("."))
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.is_file():
            return path
    return None


def _referenced_modules(path: Path, module: str, *, strings: bool) -> set[str]:
    """The package modules a file names: its imports at any depth (the benches import their kernels inside
    functions), relative ones resolved, `from pkg import name` as pkg and pkg.name, and with `strings` every dotted
    package name its string constants hold (a subprocess's `-m megacpp_lab.cli`)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1])
                source = f"{base}.{node.module}" if node.module else base
            else:
                source = node.module or ""
            names.add(source)
            names.update(f"{source}.{alias.name}" for alias in node.names)
        elif strings and isinstance(node, ast.Constant) and isinstance(node.value, str):
            names.update(_MODULE_NAME.findall(node.value))
    return {n for n in names if n == PACKAGE or n.startswith(PACKAGE + ".")}


def measured_files(subsystem: str, root: str | Path | None = None) -> tuple[str, ...]:
    """The files a receipt of `subsystem` measures, as paths from the repository root, nearest the writer first:
    the module that writes it (bench.COMMANDS's, or RECEIPT_WRITERS's), every package module it reaches by imports,
    with each one's parent packages (importing a module runs them), and the package modules its own string
    constants name by dotted path (what its subprocesses run: _referenced_modules); then EXTRA_MEASURED's files and,
    where the package's data module is reached, the committed data/ directory; less NOT_MEASURED. Strings in other
    modules are not followed: bench/__init__.py names every benchmark's module, and would make every receipt measure
    every file. Fails closed (ValueError) on a subsystem no module writes, a writer missing under root, or a file
    that does not parse."""
    from megacpp_lab.bench import COMMANDS

    root = Path(root if root is not None else repo_root())
    writer = COMMANDS[subsystem].module if subsystem in COMMANDS else RECEIPT_WRITERS.get(subsystem)
    if writer is None:
        known = sorted({*COMMANDS, *RECEIPT_WRITERS})
        raise ValueError(f"subsystem {subsystem!r}: no module writes its receipts (known: {', '.join(known)})")
    if _module_file(writer, root) is None:  # else only its parent packages would be compared: a false 'current'
        raise ValueError(f"subsystem {subsystem!r}: its writer {writer} is not under {root}")
    seen: dict[str, Path] = {}
    todo = deque([writer])
    while todo:  # breadth first: the files come nearest the writer first
        parts = todo.popleft().split(".")
        for i in range(len(parts), 0, -1):  # the module, then its parent packages
            name = ".".join(parts[:i])
            path = _module_file(name, root)
            if name in seen or path is None:  # None: a name inside a module (`from pkg.mod import fn`: pkg.mod.fn)
                continue
            seen[name] = path
            try:
                todo.extend(sorted(_referenced_modules(path, name, strings=name == writer)))
            except SyntaxError as err:
                raise ValueError(f"subsystem {subsystem!r}: {path} does not parse ({err.msg}, line {err.lineno})") from err
    files = [p.relative_to(root).as_posix() for p in seen.values()]
    files += EXTRA_MEASURED.get(subsystem, ())
    if f"{PACKAGE}.data" in seen and (root / DATA_DIR).is_dir():
        files.append(DATA_DIR)
    return tuple(dict.fromkeys(f for f in files if f not in NOT_MEASURED))


def _receipt_commit(receipt: dict[str, Any], root: Path) -> tuple[str | None, str]:
    """The commit whose code a receipt measured, or None and why not."""
    commit = str(receipt["commit"])
    if commit.startswith("tree:"):  # a GPU machine's stamp: the commit holding that package, if one does
        found = commit_for_tree(commit, root=root)
        if found is None:
            return None, (f"stamped {commit[:17]}..., a package tree no commit of this checkout holds "
                          "(resolve_tree_stamp once the code that ran is committed)")  # fmt: skip
        return found, ""
    # '-dirty': the package was HEAD's, other tracked files were not (git_commit): the code that ran is the commit's
    commit = commit.removesuffix("-dirty")
    if not re.fullmatch(r"[0-9a-f]{7,40}", commit):  # a forced MEGACPP_LAB_COMMIT such as 'main' names no code
        return None, f"commit {commit!r} is no commit sha"
    return commit, ""


def receipt_age(receipt: dict[str, Any], root: str | Path | None = None, *,
                files: tuple[str, ...] | None = None) -> dict[str, Any]:  # fmt: skip
    """Whether a receipt still measures today's code, by the files it measures (measured_files, or `files`):
    'status' is 'current' (none differs from its commit, in HEAD or in the working tree: it measures this code),
    'changed' or 'unknown' (with 'why': a package tree no commit holds, a commit this checkout lacks, a project that
    is not its git checkout's top level, no git, a subsystem no module writes). With 'changed': 'changed' (the files
    that differ, nearest the writer first), 'uncommitted' (those of them edited in the working tree) and 'commits'
    (how many commits from the receipt's to HEAD touch them; None where its commit is no ancestor of HEAD: a side
    branch's). 'changed' is an upper bound, not a verdict: a file it imports may have changed where its measured
    path did not (a comment, another kernel in an imported package); the listed files are where to look."""
    root = Path(root if root is not None else repo_root()).resolve()
    commit, why = _receipt_commit(receipt, root)
    if commit is None:
        return {"status": "unknown", "why": why}
    try:
        files = files if files is not None else measured_files(receipt["subsystem"], root)
    except ValueError as err:
        return {"status": "unknown", "why": str(err)}
    try:
        # only the project's own checkout: inside another repository, git's paths are relative to its top level
        if Path(_git(root, "rev-parse", "--show-toplevel")).resolve() != root:
            return {"status": "unknown", "why": f"{root} is not its git checkout's top level"}
        _git(root, "cat-file", "-e", f"{commit}^{{commit}}")
    except (OSError, subprocess.CalledProcessError):
        return {"status": "unknown", "why": f"commit {commit[:12]} is not in this checkout's history (or no git)"}
    # against the working tree, so an uncommitted edit to a measured file counts too
    differ = set(_git(root, "diff", "--name-only", commit, "--", *files).splitlines())
    changed = [f for f in _expand(files, differ) if f in differ]  # nearest the writer first
    if not changed:
        return {"status": "current"}
    uncommitted = set(_git(root, "diff", "--name-only", "HEAD", "--", *changed).splitlines())
    try:
        _git(root, "merge-base", "--is-ancestor", commit, "HEAD")
        commits: int | None = int(_git(root, "rev-list", "--count", f"{commit}..HEAD", "--", *changed))
    except subprocess.CalledProcessError:  # not an ancestor: no count of commits since means anything
        commits = None
    return {"status": "changed", "changed": changed, "uncommitted": [f for f in changed if f in uncommitted],
            "commits": commits}  # fmt: skip


def _expand(files: tuple[str, ...], differ: set[str]) -> list[str]:
    """files in their order, a directory among them (data/) replaced by the differing files under it."""
    out = []
    for f in files:
        inside = sorted(d for d in differ if d.startswith(f + "/"))
        out += inside if inside else [f]
    return out


def receipts_table(*, subsystem: str | None = None, device: str | None = None, root: str | Path | None = None) -> str:
    """Every receipt load_receipts finds (profiles/<device>/<subsystem>/<name>.json; optionally one subsystem's, or
    one device's: its slug or name), a line each: path, commit, date, receipt_age's status and what it found, then
    the tally."""
    prefix = device_slug(device.removeprefix(RECEIPT_ROOT + "/")) if device else None
    measured: dict[str, tuple[str, ...] | str] = {}  # per subsystem, once a table: the files, or why not
    lines = []
    for receipt in load_receipts(subsystem, root=Path(root) / RECEIPT_ROOT if root is not None else None):
        path = receipt["_path"].removeprefix(RECEIPT_ROOT + "/")
        if prefix and not path.startswith(prefix):
            continue
        sub = receipt["subsystem"]
        if sub not in measured:
            try:
                measured[sub] = measured_files(sub, root)
            except ValueError as err:
                measured[sub] = str(err)
        files = measured[sub]
        age = ({"status": "unknown", "why": files} if isinstance(files, str)
               else receipt_age(receipt, root, files=files))  # fmt: skip
        if age["status"] == "changed":
            names = [f.removeprefix(PACKAGE + "/") for f in age["changed"]]
            shown = ", ".join(names[:6]) + (f" and {len(names) - 6} more" if len(names) > 6 else "")
            since = ("its commit is no ancestor of HEAD" if age["commits"] is None
                     else f"{age['commits']} commits since")  # fmt: skip
            detail = f"{since} touch {shown}"
            if age["uncommitted"]:
                detail += f" (uncommitted edits: {len(age['uncommitted'])} of them)"
        else:
            detail = age.get("why", "none of the files it measures changed since")
        stamp_ = receipt["commit"]
        short = stamp_[:12] if stamp_.startswith("tree:") else stamp_[:7] + ("-dirty" if stamp_.endswith("-dirty") else "")
        lines.append((path, short, receipt["date"][:10], age["status"], detail))
    if not lines:
        return "no receipts match"
    width = max(len(line[0]) for line in lines)
    cw = max(len(line[1]) for line in lines)
    tally = {s: sum(line[3] == s for line in lines) for s in ("current", "changed", "unknown")}
    return "\n".join([*(f"{p:{width}s}  {c:{cw}s}  {d}  {s:8s} {why}" for p, c, d, s, why in lines),
                      ", ".join(f"{n} {s}" for s, n in tally.items() if n)])  # fmt: skip
