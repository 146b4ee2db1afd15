"""bench/receipt_ages.py's measured_files and receipt_age: which files a receipt measures, and whether they changed since its
commit. On the project's own tree (what each subsystem's benchmark reaches), and in a scratch git repository whose
history the test writes (current, changed by a commit, changed in the working tree, bookkeeping that does not
count, a commit or tree no checkout holds). `megacpp-lab receipts` prints the same for every receipt."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from megacpp_lab.cli import main
from megacpp_lab.bench.receipt_ages import NOT_MEASURED, measured_files, receipt_age


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
        "kernels/__init__.py": "from .tiles import TILE  # a relative import, resolved against the package\n",
        "kernels/tiles.py": "TILE = 64\n",
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
        "megacpp_lab/kernels/fast.py", "megacpp_lab/kernels/__init__.py", "megacpp_lab/kernels/tiles.py",
        "megacpp_lab/cli.py")  # fmt: skip  (cli.py: EXTRA_MEASURED, the profile command's flag defaults)
    receipt = {"subsystem": "profile", "commit": _git(scratch, "rev-parse", "HEAD")}
    assert receipt_age(receipt, scratch) == {"status": "current"}
    _commit(scratch, "megacpp_lab/kernels/other.py", "def other():\n    return 3\n")  # not reached
    _commit(scratch, "megacpp_lab/receipts.py", "STAMP = 2\n")  # bookkeeping: NOT_MEASURED
    assert receipt_age(receipt, scratch) == {"status": "current"}
    (scratch / "megacpp_lab/kernels/fast.py").write_text("def scan():\n    return 5\n")  # uncommitted
    fast = ["megacpp_lab/kernels/fast.py"]
    assert receipt_age(receipt, scratch) == {"status": "changed", "changed": fast, "uncommitted": fast, "commits": 0}
    _git(scratch, "commit", "-qam", "faster scan")
    _commit(scratch, "megacpp_lab/kernels/tiles.py", "TILE = 128\n")  # reached through the relative import
    assert receipt_age(receipt, scratch) == {"status": "changed", "uncommitted": [], "commits": 2,
                                             "changed": [*fast, "megacpp_lab/kernels/tiles.py"]}  # fmt: skip
    # '-dirty': the package was the commit's (git_commit), so it is judged as that commit
    dirty = {**receipt, "commit": _git(scratch, "rev-parse", "HEAD") + "-dirty"}
    assert receipt_age(dirty, scratch) == {"status": "current"}


def test_receipt_age_is_unknown_where_no_commit_of_the_checkout_names_the_code(scratch: Path):
    tree = receipt_age({"subsystem": "profile", "commit": "tree:" + "ab" * 20}, scratch)
    assert tree["status"] == "unknown" and "resolve_tree_stamp" in tree["why"]
    missing = receipt_age({"subsystem": "profile", "commit": "0123456789" * 4}, scratch)
    assert missing["status"] == "unknown" and "012345678901" in missing["why"]
    named = receipt_age({"subsystem": "profile", "commit": "HEAD"}, scratch)  # a forced MEGACPP_LAB_COMMIT
    assert named["status"] == "unknown" and "no commit sha" in named["why"]
    unknown_subsystem = receipt_age({"subsystem": "foo", "commit": _git(scratch, "rev-parse", "HEAD")}, scratch)
    assert unknown_subsystem["status"] == "unknown" and "'foo'" in unknown_subsystem["why"]


def test_a_tree_stamp_is_judged_as_the_commit_holding_that_package(scratch: Path):
    tree = _git(scratch, "rev-parse", "HEAD:megacpp_lab")
    receipt = {"subsystem": "profile", "commit": f"tree:{tree}"}
    assert receipt_age(receipt, scratch) == {"status": "current"}
    _commit(scratch, "megacpp_lab/kernels/fast.py", "def scan():\n    return 7\n")
    assert receipt_age(receipt, scratch)["changed"] == ["megacpp_lab/kernels/fast.py"]


def test_a_side_branch_commit_has_no_count_of_commits_since(scratch: Path):
    _git(scratch, "checkout", "-qb", "side")
    _commit(scratch, "megacpp_lab/kernels/fast.py", "def scan():\n    return 9\n")
    side = _git(scratch, "rev-parse", "HEAD")
    _git(scratch, "checkout", "-q", "-")
    age = receipt_age({"subsystem": "profile", "commit": side}, scratch)
    assert age["status"] == "changed" and age["commits"] is None and age["uncommitted"] == []


def test_a_missing_writer_or_a_file_that_does_not_parse_is_never_current(scratch: Path):
    receipt = {"subsystem": "profile", "commit": _git(scratch, "rev-parse", "HEAD")}
    (scratch / "megacpp_lab/kernels/fast.py").write_text("def scan(:\n")  # an edit in progress
    broken = receipt_age(receipt, scratch)
    assert broken["status"] == "unknown" and "fast.py does not parse" in broken["why"]
    (scratch / "megacpp_lab/bench/profile.py").unlink()  # only the parent packages would be compared
    gone = receipt_age(receipt, scratch)
    assert gone["status"] == "unknown" and "megacpp_lab.bench.profile is not under" in gone["why"]


def test_the_committed_data_counts_where_the_data_module_is_reached(scratch: Path):
    (scratch / "megacpp_lab/data").mkdir()
    (scratch / "megacpp_lab/data/__init__.py").write_text("")
    (scratch / "megacpp_lab/kernels/fast.py").write_text("import megacpp_lab.data\n\ndef scan():\n    return 1\n")
    (scratch / "data").mkdir()
    (scratch / "data/manifest.json").write_text("{}\n")
    _git(scratch, "add", ".")
    _git(scratch, "commit", "-qm", "data")
    assert measured_files("profile", scratch)[-1] == "data"
    receipt = {"subsystem": "profile", "commit": _git(scratch, "rev-parse", "HEAD")}
    _commit(scratch, "data/manifest.json", '{"rows": 1}\n')
    assert receipt_age(receipt, scratch)["changed"] == ["data/manifest.json"]


def test_cli_receipts_prints_every_receipt_with_its_status(capsys):
    assert main(["receipts", "--subsystem", "loss"]) == 0
    out = capsys.readouterr().out.splitlines()
    rows = [line for line in out if line.startswith("nvidia-") or line.startswith("cpu-")]
    assert rows and all("/loss/" in line for line in rows)
    if (Path(__file__).resolve().parents[1] / ".git").exists():  # a checkout with its history: git could answer
        assert not all(line.split()[3] == "unknown" for line in rows)
    assert all(line.split()[3] in ("current", "changed", "unknown") for line in rows)
    counts = re.findall(r"(\d+) (current|changed|unknown)", out[-1])  # the closing tally: '2 current, 1 changed'
    assert counts and sum(int(n) for n, _ in counts) == len(rows)


def test_cli_receipts_takes_a_device_by_its_slug_or_its_name(capsys):
    assert main(["receipts", "--device", "nvidia-h200"]) == 0
    by_slug = capsys.readouterr().out.splitlines()
    assert main(["receipts", "--device", "NVIDIA H200"]) == 0
    assert capsys.readouterr().out.splitlines() == by_slug
    assert all(line.startswith("nvidia-h200/") for line in by_slug[:-1])
    assert main(["receipts", "--device", "no-such-card"]) == 0
    assert capsys.readouterr().out.strip() == "no receipts match"
