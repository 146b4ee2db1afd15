"""Each receipt against today's code (`megacpp-lab receipts`): the files a subsystem's receipts measure
(measured_files), whether any changed since a receipt's commit (receipt_age) and the table of every receipt
(receipts_table). In the bench layer, not in receipts.py, since a subsystem's files start at the benchmark module
COMMANDS names (receipts.py is imported by the benchmarks, and imports none of them).
"""

from __future__ import annotations

import ast
import re
import subprocess
from collections import deque
from pathlib import Path
from typing import Any

from megacpp_lab.bench import COMMANDS
from megacpp_lab.receipts import (PACKAGE, RECEIPT_ROOT, commit_for_tree, device_slug, git_output, load_receipts,
                                  repo_root)

__all__ = ["DATA_DIR", "EXTRA_MEASURED", "NOT_MEASURED", "RECEIPT_WRITERS", "measured_files", "receipt_age",
           "receipts_table"]


# The module that writes each subsystem's receipts where bench.COMMANDS does not name it (CLI commands of their own)
RECEIPT_WRITERS = {"profile": "megacpp_lab.bench.profile", "memory": "megacpp_lab.bench.memory"}
# Files a subsystem's numbers depend on that no import reaches: the CLI whose flag defaults the profile and memory
# commands pass their writers (the file alone, not every command it imports)
EXTRA_MEASURED = {"profile": (f"{PACKAGE}/cli.py",), "memory": (f"{PACKAGE}/cli.py",)}
# the committed data (the packed sample, the BPE, the manifest): measured wherever the package's data module is
# reached
DATA_DIR = "data"
# What stamps, validates, draws and dates the receipts: no measured number passes through them, so a change to them
# leaves every receipt measuring the same code (the measuring itself, profiling.py and bench/harness.py, counts)
NOT_MEASURED = (f"{PACKAGE}/receipts.py", f"{PACKAGE}/plots.py", f"{PACKAGE}/bench/receipt_ages.py")
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
        if Path(git_output(root, "rev-parse", "--show-toplevel")).resolve() != root:
            return {"status": "unknown", "why": f"{root} is not its git checkout's top level"}
        git_output(root, "cat-file", "-e", f"{commit}^{{commit}}")
    except (OSError, subprocess.CalledProcessError):
        return {"status": "unknown", "why": f"commit {commit[:12]} is not in this checkout's history (or no git)"}
    # against the working tree, so an uncommitted edit to a measured file counts too
    differ = set(git_output(root, "diff", "--name-only", commit, "--", *files).splitlines())
    changed = [f for f in _expand(files, differ) if f in differ]  # nearest the writer first
    if not changed:
        return {"status": "current"}
    uncommitted = set(git_output(root, "diff", "--name-only", "HEAD", "--", *changed).splitlines())
    try:
        git_output(root, "merge-base", "--is-ancestor", commit, "HEAD")
        commits: int | None = int(git_output(root, "rev-list", "--count", f"{commit}..HEAD", "--", *changed))
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
            detail = (f"differ from a commit that is no ancestor of HEAD: {shown}" if age["commits"] is None
                      else f"{age['commits']} commits since touch {shown}")  # fmt: skip
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
