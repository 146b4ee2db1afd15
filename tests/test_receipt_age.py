"""receipts.measured_files and receipt_age: which files a receipt measures, and whether they changed since its
commit. On the project's own tree (what each subsystem's benchmark reaches), and in a scratch git repository whose
history the test writes (current, changed by a commit, changed in the working tree, bookkeeping that does not
count, a commit or tree no checkout holds). `megacpp-lab receipts` prints the same for every receipt."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from megacpp_lab.cli import main
from megacpp_lab.receipts import NOT_MEASURED, measured_files, receipt_age


def test_a_subsystem_measures_its_writer_and_what_that_imports_not_the_rest():
    loss = measured_files("loss")
    assert loss[0] == "megacpp_lab/bench/loss.py"  # the writer first
    assert "megacpp_lab/kernels/linear_cross_entropy.py" in loss  # imported inside a function
    assert "megacpp_lab/kernels/__init__.py" in loss  # a parent package runs on import
    assert "megacpp_lab/kernels/mamba3.py" not in loss and "megacpp_lab/bench/ssd.py" not in loss
    assert not set(NOT_MEASURED) & set(loss)
    ssd = measured_files("ssd")
    assert {"megacpp_lab/bench/mamba3.py", "megacpp_lab/kernels/mamba3.py", "megacpp_lab/kernels/ssd.py"} <= set(ssd)
    assert "megacpp_lab/bench/loss.py" not in ssd  # bench/__init__ names every bench in strings: not followed
    # scale_out runs `python -m megacpp_lab.cli train` in a subprocess: the writer's strings are followed
    assert {"megacpp_lab/cli.py", "megacpp_lab/model/train.py"} <= set(measured_files("scale_out"))
    assert measured_files("profile")[0] == "megacpp_lab/bench/profile.py"  # a CLI command's own writer


def test_an_unknown_subsystem_fails_closed_naming_it():
    with pytest.raises(ValueError, match="'ssd2'.*known: .*ssd"):
        measured_files("ssd2")


def _git(root: Path, *args: str) -> str:
    cmd = ["git", "-c", "user.name=lab", "-c", "user.email=lab@example.invalid", "-c", "commit.gpgsign=false", *args]
    return subprocess.run(cmd, cwd=root, check=True, capture_output=True, text=True).stdout.strip()


@pytest.fixture
def scratch(tmp_path: Path) -> Path:
    """A repository with the package layout the profile receipt's writer needs: bench/profile.py imports
    kernels.fast inside a function; kernels/other.py is imported by nothing it reaches."""
    pkg = tmp_path / "megacpp_lab"
    files = {
        "__init__.py": "",
        "receipts.py": "STAMP = 1\n",
        "bench/__init__.py": "",
        "bench/profile.py": "def run():\n    from megacpp_lab.kernels.fast import scan\n    return scan()\n",
        "kernels/__init__.py": "",
        "kernels/fast.py": "def scan():\n    return 1\n",
        "kernels/other.py": "def other():\n    return 2\n",
    }
    for name, text in files.items():
        (pkg / name).parent.mkdir(parents=True, exist_ok=True)
        (pkg / name).write_text(text)
    _git(tmp_path, "init", "-q")
    _git(tmp_path, "add", ".")
    _git(tmp_path, "commit", "-qm", "first")
    return tmp_path


def _commit(root: Path, path: str, text: str) -> None:
    (root / path).write_text(text)
    _git(root, "commit", "-qam", f"edit {path}")


def test_receipt_age_follows_the_files_the_receipt_measures(scratch: Path):
    assert measured_files("profile", scratch) == (
        "megacpp_lab/bench/profile.py", "megacpp_lab/bench/__init__.py", "megacpp_lab/__init__.py",
        "megacpp_lab/kernels/fast.py", "megacpp_lab/kernels/__init__.py")  # fmt: skip
    receipt = {"subsystem": "profile", "commit": _git(scratch, "rev-parse", "HEAD")}
    assert receipt_age(receipt, scratch) == {"status": "current"}
    _commit(scratch, "megacpp_lab/kernels/other.py", "def other():\n    return 3\n")  # not reached
    _commit(scratch, "megacpp_lab/receipts.py", "STAMP = 2\n")  # bookkeeping: NOT_MEASURED
    assert receipt_age(receipt, scratch) == {"status": "current"}
    (scratch / "megacpp_lab/kernels/fast.py").write_text("def scan():\n    return 5\n")  # uncommitted
    assert receipt_age(receipt, scratch) == {"status": "changed", "changed": ["megacpp_lab/kernels/fast.py"],
                                             "commits": 0}  # fmt: skip
    _git(scratch, "commit", "-qam", "faster scan")
    assert receipt_age(receipt, scratch)["commits"] == 1
    # '-dirty': the package was the commit's (git_commit), so it is judged as that commit
    dirty = {**receipt, "commit": _git(scratch, "rev-parse", "HEAD") + "-dirty"}
    assert receipt_age(dirty, scratch) == {"status": "current"}


def test_receipt_age_is_unknown_where_no_commit_of_the_checkout_names_the_code(scratch: Path):
    tree = receipt_age({"subsystem": "profile", "commit": "tree:" + "ab" * 20}, scratch)
    assert tree["status"] == "unknown" and "resolve_tree_stamp" in tree["why"]
    missing = receipt_age({"subsystem": "profile", "commit": "0123456789" * 4}, scratch)
    assert missing["status"] == "unknown" and "012345678901" in missing["why"]


def test_cli_receipts_prints_every_receipt_with_its_status(capsys):
    assert main(["receipts", "--subsystem", "loss"]) == 0
    out = capsys.readouterr().out.splitlines()
    rows = [line for line in out if line.startswith("nvidia-") or line.startswith("cpu-")]
    assert rows and all("/loss/" in line for line in rows)
    assert all(line.split()[3] in ("current", "changed", "unknown") for line in rows)
    counts = re.findall(r"(\d+) (current|changed|unknown)", out[-1])  # the closing tally: '2 current, 1 changed'
    assert counts and sum(int(n) for n, _ in counts) == len(rows)
