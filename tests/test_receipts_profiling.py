import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from megacpp_lab import receipts
from megacpp_lab.profiling import forward_dtypes, profile_trace, time_ms, trace_summary, working_memory
from megacpp_lab.sizing import SIZE_ENV, by_device, lab_scale


def _receipt(**over):
    kw = dict(
        shape={"B": 2, "T": 64},
        dtype=torch.float32,
        results=[{"contender": "compiled", "ms": 1.5}, {"contender": "eager", "ms": 3.0, "fwd_ms": 1.0}],
    )
    kw.update(over)
    return receipts.make_receipt("toy_fwd_bwd", "tour", **kw)


def test_receipt_is_stamped_and_round_trips(tmp_path, monkeypatch):
    monkeypatch.setenv(receipts.COMMIT_ENV, "abc123")
    r = _receipt()
    for key in ("device", "torch", "triton", "commit", "date"):
        assert r[key]
    assert r["commit"] == "abc123" and r["dtype"] == "float32" and r["torch"] == torch.__version__
    path = receipts.write_receipt(r, root=tmp_path)
    assert path == tmp_path / receipts.device_slug(r["device"]) / "tour" / "toy_fwd_bwd.json"
    loaded = receipts.load_receipts("tour", root=tmp_path)
    assert len(loaded) == 1 and loaded[0]["results"] == r["results"]
    assert receipts.load_receipts("other", root=tmp_path) == []


def test_load_receipts_skips_traces_and_other_records_but_fails_closed_on_a_broken_receipt(tmp_path):
    path = receipts.write_receipt(_receipt(), root=tmp_path)
    (path.parent / "toy.123.pt.trace.json").write_text(json.dumps({"traceEvents": []}))  # a profiler trace beside it
    (path.parent / "lowering.json").write_text(json.dumps({"versions": {}, "packs": []}))  # a record, not a receipt
    assert [r["name"] for r in receipts.load_receipts(root=tmp_path)] == ["toy_fwd_bwd"]
    (path.parent / "broken.json").write_text(json.dumps({"name": "broken", "results": []}))  # claims to be one
    with pytest.raises(ValueError, match="broken"):
        receipts.load_receipts(root=tmp_path)


def test_git_commit_reads_the_repo(monkeypatch):
    monkeypatch.delenv(receipts.COMMIT_ENV, raising=False)
    sha = receipts.git_commit()
    root = receipts.repo_root()
    package_is_heads = (root / ".git").exists() and shutil.which("git") and receipts.tree_hash(root / "megacpp_lab") == \
        _git(root, "rev-parse", "HEAD:megacpp_lab")
    if package_is_heads:  # the project's own checkout running HEAD's package: HEAD
        assert re.fullmatch(r"[0-9a-f]{40}(-dirty)?", sha), sha
    else:  # a copy without .git (the GPU machine's), a stale .git, or an uncommitted package: the package's tree
        assert sha == "tree:" + receipts.tree_hash(root / "megacpp_lab"), sha


# ----------------------------------------------------------------------------- the commit stamp of a copy

needs_git = pytest.mark.skipif(shutil.which("git") is None, reason="needs the git executable")


def _git(cwd: Path, *args: str) -> str:
    ident = ["-c", "user.name=t", "-c", "user.email=t@t", "-c", "commit.gpgsign=false"]
    return subprocess.run(["git", *ident, *args], cwd=cwd, capture_output=True, text=True, check=True).stdout.strip()


def _commit_all(repo: Path, message: str) -> str:
    _git(repo, "add", "-A")
    _git(repo, "commit", "-q", "-m", message)
    return _git(repo, "rev-parse", "HEAD")


def _copy_project(dest: Path) -> Path:
    """The package (with whatever __pycache__ it has) and the root .gitignore under dest; returns dest."""
    shutil.copytree(receipts.repo_root() / receipts.PACKAGE, dest / receipts.PACKAGE, symlinks=True)
    shutil.copy(receipts.repo_root() / ".gitignore", dest / ".gitignore")
    return dest


def test_gitignored_mirrors_the_root_gitignore():
    lines = (receipts.repo_root() / ".gitignore").read_text().splitlines()
    unanchored = {line for line in lines if line.strip() and not line.startswith(("#", "/"))}
    assert unanchored == set(receipts.GITIGNORED)


@needs_git
def test_tree_hash_is_what_git_stores_for_the_package(tmp_path):
    repo = _copy_project(tmp_path)
    pkg = repo / receipts.PACKAGE
    (pkg / "__pycache__").mkdir(exist_ok=True)
    (pkg / "__pycache__" / "x.pyc").write_bytes(b"bytecode")
    (pkg / "stale.pyc").write_bytes(b"bytecode")  # ignored outside __pycache__ too
    (pkg / "empty" / "nested").mkdir(parents=True)  # git stores no empty directory
    (pkg / "zz_tool.sh").write_text("#!/bin/sh\necho hi\n")
    (pkg / "zz_tool.sh").chmod(0o755)
    (pkg / "zz_link").symlink_to("zz_tool.sh")
    # the directory sorts as "zz/", after the file "zz.py" ("." < "/"); a plain sort by name puts it before
    (pkg / "zz").mkdir()
    (pkg / "zz" / "a.py").write_text("x = 1\n")
    (pkg / "zz.py").write_text("y = 2\n")
    _git(repo, "init", "-q")
    _commit_all(repo, "copy")
    tracked = _git(repo, "ls-files")
    assert "__pycache__" not in tracked and ".pyc" not in tracked and "empty" not in tracked
    listing = [line.split() for line in _git(repo, "ls-tree", "HEAD:megacpp_lab").splitlines()]
    modes = {name: mode for mode, _, _, name in listing}
    assert (modes["zz_tool.sh"], modes["zz_link"], modes["zz"]) == ("100755", "120000", "040000")
    names = [name for *_, name in listing]
    assert names.index("zz.py") < names.index("zz")
    assert receipts.tree_hash(pkg) == _git(repo, "rev-parse", "HEAD:megacpp_lab")
    (pkg / "zz_tool.sh").chmod(0o644)  # the executable bit is part of the hash
    changed = receipts.tree_hash(pkg)
    assert changed != _git(repo, "rev-parse", "HEAD:megacpp_lab")
    _git(repo, "add", "-A")
    assert changed == _git(repo, "write-tree", "--prefix=megacpp_lab/")


@needs_git
def test_a_copy_inside_another_repository_is_stamped_with_its_tree_not_that_repositorys_head(tmp_path, monkeypatch):
    monkeypatch.delenv(receipts.COMMIT_ENV, raising=False)
    outer = tmp_path / "outer"
    (outer / "work").mkdir(parents=True)
    (outer / "README").write_text("someone else's repository\n")
    _git(outer, "init", "-q")
    outer_head = _commit_all(outer, "unrelated")
    copy = _copy_project(outer / "work" / "copy")
    assert Path(_git(copy, "rev-parse", "--show-toplevel")).resolve() == outer.resolve()  # the trap is real
    stamp = receipts.git_commit(copy)
    assert stamp == "tree:" + receipts.tree_hash(copy / receipts.PACKAGE)
    assert outer_head not in stamp
    monkeypatch.setattr(receipts, "repo_root", lambda: copy)  # what stamp() reads on the GPU machine
    assert receipts.git_commit() == stamp
    monkeypatch.setenv("PATH", str(tmp_path / "no-git-here"))  # no git at all: still the tree
    assert receipts.git_commit() == stamp
    monkeypatch.setenv(receipts.COMMIT_ENV, "abc123")  # the variable still wins
    assert receipts.git_commit() == "abc123"


@needs_git
def test_commit_for_tree_finds_the_newest_commit_with_that_package(tmp_path):
    repo = tmp_path / "repo"
    repo.mkdir()
    (repo / "README").write_text("before the package\n")
    _git(repo, "init", "-q")
    _commit_all(repo, "no package yet")  # its '<commit>:megacpp_lab missing' line must not derail the search
    (repo / "megacpp_lab").mkdir()
    (repo / "megacpp_lab" / "a.py").write_text("v = 1\n")
    first = _commit_all(repo, "v1")
    assert receipts.git_commit(repo) == first  # a checkout of its own: HEAD's sha
    tree1 = receipts.tree_hash(repo / "megacpp_lab")
    (repo / "README").write_text("changed outside the package\n")
    assert receipts.git_commit(repo) == first + "-dirty"  # the code that ran is HEAD's
    (repo / "README").write_text("before the package\n")
    (repo / "profiles").mkdir()
    (repo / "profiles" / "r.json").write_text("{}\n")
    first = _commit_all(repo, "a receipt")  # the same package: commit_for_tree(tree1) is now this one
    (repo / "profiles" / "r.json").write_text('{"rewritten": true}\n')  # an earlier bench of the same run
    assert receipts.git_commit(repo) == first  # receipts are not code: not dirty
    (repo / "README").write_text("changed outside the package\n")
    assert receipts.git_commit(repo) == first + "-dirty"
    (repo / "megacpp_lab" / "a.py").write_text("v = 2\n")  # the package is not HEAD's (or .git is stale):
    tree2 = receipts.tree_hash(repo / "megacpp_lab")
    assert receipts.git_commit(repo) == "tree:" + tree2  # the files name what ran, never HEAD
    assert receipts.commit_for_tree(tree2, root=repo) is None  # not committed yet
    _commit_all(repo, "v2")
    (repo / "README").write_text("the package unchanged\n")
    third = _commit_all(repo, "docs only")
    assert receipts.tree_hash(repo / "megacpp_lab") == tree2
    assert receipts.commit_for_tree("tree:" + tree1, root=repo) == first
    assert receipts.commit_for_tree(tree2, root=repo) == third  # the newer of the two commits with that package
    assert receipts.commit_for_tree(tree1, root=repo, max_commits=2) is None  # older than the window
    assert receipts.commit_for_tree("0" * 40, root=repo) is None
    assert receipts.commit_for_tree(tree1, root=tmp_path) is None  # not a repository
    with pytest.raises(ValueError, match="not a tree hash"):
        receipts.commit_for_tree("tree:abc", root=repo)


@needs_git
@pytest.mark.skipif(not (receipts.repo_root() / ".git").exists(), reason="needs the project's own git checkout")
def test_commit_for_tree_maps_heads_package_back_to_head():
    root = receipts.repo_root()
    head = _git(root, "rev-parse", "HEAD")
    tree = _git(root, "rev-parse", "HEAD:megacpp_lab")
    assert receipts.commit_for_tree("tree:" + tree) == head


@pytest.mark.parametrize(
    "results, message",
    [
        ([], "non-empty list"),
        ([{"ms": 1.0}], "contender"),
        ([{"contender": "x"}], "has no metric"),
        ([{"contender": "x", "ms": float("nan")}], "not a finite number"),
        ([{"contender": "x", "ms": "fast"}], "not a finite number"),
    ],
)
def test_bad_receipts_fail_closed(results, message):
    with pytest.raises(ValueError, match=message):
        _receipt(results=results)


def test_receipt_missing_key_fails(tmp_path):
    r = _receipt()
    del r["commit"]
    with pytest.raises(ValueError, match=r"missing keys \['commit'\]"):
        receipts.write_receipt(r, root=tmp_path)


def test_device_slug():
    assert receipts.device_slug("NVIDIA H100 80GB HBM3") == "nvidia-h100-80gb-hbm3"
    assert receipts.device_slug("***") == "unknown-device"


def test_sizing_helper(monkeypatch):
    monkeypatch.setenv(SIZE_ENV, "small")
    assert lab_scale() == "small" and by_device(small=16, full=4096) == 16
    monkeypatch.setenv(SIZE_ENV, "full")
    assert by_device(small=16, full=4096) == 4096
    monkeypatch.setenv(SIZE_ENV, "huge")
    with pytest.raises(ValueError, match=SIZE_ENV):
        lab_scale()
    monkeypatch.delenv(SIZE_ENV)
    assert lab_scale() == ("full" if torch.cuda.is_available() else "small")


def test_time_ms_and_profile_trace(tmp_path):
    x = torch.randn(64, 64)
    assert time_ms(lambda: x @ x, warmup=1, rep=3, device="cpu") > 0
    path, prof = profile_trace(lambda: (x @ x).relu(), tmp_path, "matmul_relu", steps=2)
    assert path.name.endswith(".pt.trace.json") and path.name.startswith("matmul_relu")
    events = json.loads(path.read_text())["traceEvents"]
    names = {e.get("name", "") for e in events}
    assert any("mm" in n for n in names)
    assert any("relu" in n for n in prof.key_averages().table().lower().split())
    summary = trace_summary(path)
    assert summary and {"name", "total_us", "calls"} <= summary[0].keys()
    assert any("mm" in str(r["name"]) for r in summary)
    assert summary == sorted(summary, key=lambda r: -r["total_us"])


def test_time_spread_brackets_the_median_of_calls_that_differ():
    """time_spread_ms: median with p20 <= median <= p80, over calls whose times really differ (every third sleeps
    5 ms), and the same argument checks as time_ms."""
    import time as _time

    from megacpp_lab.profiling import time_spread_ms

    calls = iter(range(10**6))
    out = time_spread_ms(lambda: _time.sleep(0.005 if next(calls) % 3 == 0 else 0.0), warmup=0, rep=9, device="cpu")
    assert set(out) == {"ms", "ms_p20", "ms_p80"}
    assert out["ms_p20"] <= out["ms"] <= out["ms_p80"] and out["ms_p80"] >= 4.0 > out["ms"], out
    with pytest.raises(ValueError, match="warmup must be >= 0 and rep >= 1"):
        time_spread_ms(lambda: None, rep=0, device="cpu")


def test_plots_of_a_receipt_are_saved(tmp_path):
    from megacpp_lab.plots import plot_contenders, save_figure

    r = _receipt()
    path = save_figure(plot_contenders(r, "ms"), tmp_path / "r.png")
    assert path.exists() and path.read_bytes()[:4] == b"\x89PNG"


@pytest.mark.cuda
def test_peak_extra_mib_counts_a_new_allocation():
    from megacpp_lab.profiling import peak_extra_mib

    assert 60 < peak_extra_mib(lambda: torch.empty(64 * 2**20, dtype=torch.uint8, device="cuda")) < 70


@pytest.mark.cuda
def test_kernel_ms_counts_the_gpus_time_and_not_the_hosts():
    """A call that sleeps on the host before its matmul takes the same kernel time as the bare matmul, far below its
    wall time: kernel_ms is the GPU's time alone, so a launch-bound contender shows as wall time past it."""
    import time

    from megacpp_lab.profiling import kernel_ms

    x = torch.randn(4096, 4096, device="cuda")
    bare = kernel_ms(lambda: x @ x)

    def slow():
        time.sleep(0.02)
        return x @ x

    assert 0 < bare < 20
    assert kernel_ms(slow) < 2 * bare + 0.1 < time_ms(slow) / 2


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without a GPU")
def test_kernel_ms_refuses_without_cuda():
    from megacpp_lab.profiling import kernel_ms

    with pytest.raises(RuntimeError, match="needs a CUDA device"):
        kernel_ms(lambda: None)


@pytest.mark.cuda
def test_receipt_on_gpu_names_the_gpu(tmp_path):
    x = torch.randn(1024, 1024, device="cuda")
    ms = time_ms(lambda: x @ x)
    r = _receipt(results=[{"contender": "matmul", "ms": ms}], device="cuda")
    assert r["device"] == torch.cuda.get_device_name()
    path = receipts.write_receipt(r, root=tmp_path)
    assert receipts.device_slug(torch.cuda.get_device_name()) in str(path)


def test_label_points_keeps_labels_apart_inside_the_axes_and_leader_lines_uncrossed():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from megacpp_lab.plots import LABEL_X, segments_cross, label_points

    _, ax = plt.subplots()
    xs, ys = [1.0, 1.01, 1.02, 1.0, 1.01, 9.0], [5.0, 5.01, 5.0, 4.99, 5.02, 1.0]  # five near-coincident points
    ax.scatter(xs, ys)
    texts = label_points(ax, xs, ys, [f"p{i}" for i in range(6)], min_gap=0.08)
    placed = sorted(t.xyann[1] for t in texts)
    assert all(0.0 <= y <= 1.0 for y in placed)
    assert min(b - a for a, b in zip(placed, placed[1:])) >= 0.08 - 1e-9
    to_axes = ax.transAxes.inverted()
    segments = [(tuple(to_axes.transform(ax.transData.transform(t.xy))), (LABEL_X, t.xyann[1])) for t in texts]
    assert not any(segments_cross(*a, *b) for i, a in enumerate(segments) for b in segments[i + 1 :])
    with pytest.raises(ValueError, match="min_gap=0.5 cannot fit 6 labels"):
        label_points(ax, xs, ys, [f"p{i}" for i in range(6)], min_gap=0.5)
    with pytest.raises(ValueError, match="one entry per point"):
        label_points(ax, xs, ys[:2], ["a"])
    plt.close("all")


# ----------------------------------------------------------------------------- time per labelled module


class _Costly(torch.nn.Module):
    """x -> tanh(x W)^k: `work` matmuls of n x n per call, forward and backward."""

    def __init__(self, n: int, work: int) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(n, n) / n**0.5)
        self.work = work

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for _ in range(self.work):
            x = torch.tanh(x @ self.w)
        return x


class _Outer(torch.nn.Module):
    """heavy(light(x)): the heavy stage nested inside the labelled outer module."""

    def __init__(self, light: torch.nn.Module, heavy: torch.nn.Module) -> None:
        super().__init__()
        self.light, self.heavy = light, heavy

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.heavy(self.light(x))


def _two_stage(device: str, n: int):
    torch.manual_seed(0)
    light, heavy = _Costly(n, 1).to(device), _Costly(n, 12).to(device)
    x = torch.randn(n, n, device=device, requires_grad=True)
    return light, heavy, lambda: heavy(light(x)).sum().backward()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_label_modules_and_time_by_label_split_a_step_by_module(tmp_path, device):
    from megacpp_lab.profiling import label_modules, time_by_label

    # 512 on a CPU: each matmul outweighs the profiler's per-range overhead, also with a busy second core
    light, heavy, step = _two_stage(device, 512 if device == "cpu" else 2048)
    with label_modules({"light|a": light, "heavy|b": heavy}):
        path, _ = profile_trace(step, tmp_path, "two_stage", steps=2, warmup=1, record_shapes=False)
    names = {e.get("name") for e in json.loads(path.read_text())["traceEvents"]}
    assert {"light|a", "light|a.backward", "heavy|b", "heavy|b.backward"} <= names
    split = time_by_label(path)
    assert split["steps"] == 2 and split["step_us"] > 0
    assert ("gpu kernel" in split["basis"]) == (device == "cuda")
    assert split["kernels_without_launch"] == 0
    us = split["us"]
    assert us["heavy"] > 4 * us["light"] > 0, us  # 12 matmuls (+ their backward) against 1
    back = split["us_backward"]
    assert 0 < back["heavy"] < us["heavy"] and 0 < back["light"] < us["light"]  # both directions were seen
    assert abs(sum(split["share"].values()) - 1) < 1e-9
    assert split["total_us"] <= split["step_us"] * 1.01
    # nested: the innermost labelled range wins, the outer module keeps only its own (light) part
    outer = _Outer(light, heavy)
    x = torch.randn(light.w.shape, device=device, requires_grad=True)
    with label_modules({"outer|o": outer, "heavy|b": heavy}):
        path3, _ = profile_trace(lambda: outer(x).sum().backward(), tmp_path, "nested", steps=1, warmup=1)
    nested = time_by_label(path3)["us"]
    assert nested["heavy"] > 4 * nested["outer"] > 0, nested
    # the hooks are gone afterwards: a trace without labels has nothing to split
    path2, _ = profile_trace(step, tmp_path, "unlabelled", steps=1, warmup=0)
    assert not any("|" in str(e.get("name")) for e in json.loads(path2.read_text())["traceEvents"])


def test_label_modules_forward_only_and_bad_names():
    from megacpp_lab.profiling import label_modules

    light, heavy, step = _two_stage("cpu", 16)
    with pytest.raises(ValueError, match=r"forward_only names labels that are not in labels: \['nope'\]"):
        with label_modules({"light|a": light}, forward_only=("nope",)):
            pytest.fail("label_modules accepted a forward_only label that is not among its labels")
    with torch.profiler.profile() as prof, label_modules({"light|a": light, "heavy|b": heavy}, forward_only=("heavy|b",)):
        step()
    names = {e.name for e in prof.events()}
    assert {"light|a", "light|a.backward", "heavy|b"} <= names and "heavy|b.backward" not in names


def test_time_by_label_on_a_hand_written_trace(tmp_path):
    """The attribution rules on a trace whose answer is known: the innermost range wins (two ranges that start
    together), a backward range on its own thread, driver-API launches, GPU-side copies of the ranges and of
    ProfilerStep ignored, a kernel launched outside every range or with no launch event goes to 'other'."""
    from megacpp_lab.profiling import time_by_label

    def x(name, ts, dur, cat, tid=1, pid=1, **args):
        return {"ph": "X", "name": name, "ts": ts, "dur": dur, "cat": cat, "pid": pid, "tid": tid, "args": args}

    events = [
        x("ProfilerStep#1", 0, 400, "user_annotation"), x("ProfilerStep#1", 0, 390, "gpu_user_annotation", pid=0, tid=7),
        x("A|x", 0, 100, "user_annotation"), x("B|y", 0, 50, "user_annotation"),
        x("A|x.backward", 200, 100, "user_annotation", tid=2), x("A|x", 5, 90, "gpu_user_annotation", pid=0, tid=7),
        x("cudaLaunchKernel", 10, 1, "cuda_runtime", correlation=1), x("cudaLaunchKernel", 60, 1, "cuda_runtime", correlation=2),
        x("cudaLaunchKernel", 250, 1, "cuda_runtime", tid=2, correlation=3),
        x("cudaLaunchKernel", 350, 1, "cuda_runtime", correlation=4), x("cuLaunchKernel", 55, 1, "cuda_driver", correlation=6),
    ]
    for corr, dur in ((1, 10), (2, 20), (3, 30), (4, 5), (5, 7), (6, 3)):
        events.append(x(f"k{corr}", 1000 + corr, dur, "kernel", pid=0, tid=7, correlation=corr))
    events.append(x("Memcpy DtoD", 2000, 4, "gpu_memcpy", pid=0, tid=7, correlation=2))
    path = tmp_path / "hand.pt.trace.json"
    path.write_text(json.dumps({"traceEvents": events}))
    split = time_by_label(path)
    assert split["us"] == {"B": 10.0, "A": 20.0 + 30.0 + 3.0 + 4.0, "other": 5.0 + 7.0}
    assert split["us_backward"] == {"A": 30.0}
    assert split["kernels_without_launch"] == 1 and split["steps"] == 1 and split["step_us"] == 400.0
    assert split["total_us"] == 79.0 and split["basis"].startswith("gpu kernel time")


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_working_memory_counts_the_peak_of_new_storages_alive_at_once(device: str) -> None:
    held = torch.ones(1 << 20, device=device)  # existed before: not counted

    def fn():
        a = torch.ones(1 << 18, device=device)  # 1 MiB
        b = torch.ones(1 << 19, device=device)  # 2 MiB, with a alive: 3 MiB
        view = b[:10]  # no new storage
        del a
        c = torch.ones(1 << 18, device=device) + view[0]  # a freed: 2 + 1 (+ the 1 MiB `ones` before the add)
        held.add_(1.0)  # in place on an old storage: nothing new
        return c

    mem = working_memory(fn)
    assert mem.peak_bytes == 4 * 2**20  # b, the ones and the sum: a is gone by then
    assert (mem.largest_bytes, mem.largest_shape, mem.largest_op) == (2 * 2**20, (1 << 19,), "ones")


def test_forward_dtypes_records_what_each_module_runs_with_and_removes_its_hooks() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    model[0].to(torch.bfloat16)
    model[1].register_buffer("scale", torch.ones(4))
    with forward_dtypes(model, buffers=True) as seen:
        model[1](model[0](torch.randn(2, 4, dtype=torch.bfloat16)).float())
    assert seen == {"0.weight": {torch.bfloat16}, "0.bias": {torch.bfloat16}, "1.weight": {torch.float32},
                    "1.bias": {torch.float32}, "1.scale": {torch.float32}}
    assert all(not m._forward_pre_hooks for m in model.modules())
    with forward_dtypes(model) as params_only:
        model[0](torch.randn(2, 4, dtype=torch.bfloat16))
    assert params_only == {"0.weight": {torch.bfloat16}, "0.bias": {torch.bfloat16}}  # buffers left out; 1 not run


def test_a_tree_stamp_resolves_to_the_commit_that_holds_the_package(tmp_path):
    """A GPU copy of the checkout stamps 'tree:<hash>'; back here the receipt names the commit with that package."""
    import json
    import subprocess

    from megacpp_lab.receipts import repo_root, resolve_tree_stamp

    try:
        head = subprocess.run(["git", "rev-parse", "HEAD", "HEAD:megacpp_lab"], cwd=repo_root(), capture_output=True,
                              text=True, check=True).stdout.split()  # fmt: skip
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("no git checkout")
    path = tmp_path / "r.json"
    path.write_text(json.dumps({"name": "x", "commit": f"tree:{head[1]}"}))
    commit = resolve_tree_stamp(path)
    got = json.loads(path.read_text())
    assert commit is not None and got["commit"] == commit and got["package_tree"] == head[1]
    tree_of = subprocess.run(["git", "rev-parse", f"{commit}:megacpp_lab"], cwd=repo_root(), capture_output=True,
                             text=True, check=True).stdout.strip()  # fmt: skip
    assert tree_of == head[1]
    path.write_text(json.dumps({"name": "x", "commit": "tree:" + "0" * 40}))
    assert resolve_tree_stamp(path) is None and json.loads(path.read_text())["commit"] == "tree:" + "0" * 40


def test_paired_ratio_times_both_in_alternating_pairs():
    """paired_ratio on the CPU clock: a call that sleeps twice as long reads about 2x, each function runs warmup +
    rounds times, in A B / B A order, and bad counts fail closed naming the field."""
    import time as _time

    from megacpp_lab.profiling import paired_ratio

    order: list[str] = []
    a = lambda: (order.append("a"), _time.sleep(0.002))  # noqa: E731
    b = lambda: (order.append("b"), _time.sleep(0.004))  # noqa: E731
    out = paired_ratio(a, b, rounds=6, warmup=1, device="cpu")
    assert 1.5 < out["ratio"] < 2.6 and out["ratio_p20"] <= out["ratio"] <= out["ratio_p80"]
    assert out["b_ms"] > out["a_ms"] >= 2.0
    assert order == ["a", "b"] + ["a", "b", "b", "a"] * 3
    with pytest.raises(ValueError, match="rounds must be >= 1"):
        paired_ratio(a, b, rounds=0, device="cpu")


def test_gpu_idle_by_cause_charges_each_gap_to_the_launch_that_ended_it(tmp_path):
    """A hand-made trace of one profiled step: two labelled ranges, the first host-bound (its host time 100 us,
    its one kernel 10 us), the second GPU-bound, and a mask builder between them. Each GPU gap goes to the range
    and outermost host operator around the launch of the kernel after it; kernels outside the step are not read."""
    from megacpp_lab.profiling import gpu_idle_by_cause

    cpu = dict(ph="X", pid=1, tid=1)

    def kernel(ts, dur, corr, name="k"):
        return [dict(ph="X", cat="kernel", pid=0, tid=7, ts=ts, dur=dur, name=name, args={"correlation": corr}),
                dict(cpu, cat="cuda_runtime", ts=ts - 5, dur=2, name="cudaLaunchKernel", args={"correlation": corr})]

    events = [dict(cpu, cat="user_annotation", ts=0, dur=1000, name="ProfilerStep#1"),
              dict(cpu, cat="user_annotation", ts=10, dur=100, name="A|blocks.0"),
              dict(cpu, cat="cpu_op", ts=12, dur=90, name="Torch-Compiled Region: 0/0"),
              dict(cpu, cat="cpu_op", ts=150, dur=200, name="VmappedModIndex"),
              dict(cpu, cat="user_annotation", ts=360, dur=250, name="M|blocks.1"),
              dict(cpu, cat="cpu_op", ts=362, dur=240, name="Torch-Compiled Region: 0/1")]
    events += kernel(20, 5, 1) + kernel(100, 5, 2)  # in A (host-bound: 10 us of kernels in 100 us of host)
    events += kernel(370, 200, 3) + kernel(575, 100, 4)  # in M: GPU-bound, 5 us apart
    events += kernel(2000, 50, 5)  # launched after the step: not read
    events[-1]["ts"] = 1990
    path = tmp_path / "t.pt.trace.json"
    path.write_text(json.dumps({"traceEvents": events}))
    out = gpu_idle_by_cause(path)
    assert out["steps"] == 1 and out["idle_us"] == pytest.approx(75 + 265 + 5)
    assert out["idle_by_range"] == pytest.approx({"A|blocks.0": 75, "M|blocks.1": 270})
    assert out["idle_by_host_op"] == pytest.approx({"Torch-Compiled Region: 0/1": 270, "Torch-Compiled Region: 0/0": 75})
    assert out["ranges"]["A|blocks.0"] == {"host_us": 100.0, "gpu_us": 10.0, "host_bound": True}
    assert out["ranges"]["M|blocks.1"] == {"host_us": 250.0, "gpu_us": 300.0, "host_bound": False}
    with pytest.raises(ValueError, match="no GPU kernels"):
        path.write_text(json.dumps({"traceEvents": events[:6]}))
        gpu_idle_by_cause(path)


def test_inductor_kernels_take_the_name_of_the_host_range_around_their_launch(tmp_path):
    """parallelize names every inductor kernel `triton_`; the profiler's host range around each launch keeps the
    descriptive name, and trace_summary groups by it: the innermost such range wins, a kernel without its launch
    or without a range keeps `triton_`, other kernels keep their names."""
    from megacpp_lab.profiling import INDUCTOR_KERNEL_NAME, name_inductor_kernels, trace_summary

    cpu = dict(ph="X", pid=1, tid=1)

    def launch(ts, corr, name=INDUCTOR_KERNEL_NAME, kernel_ts=1000, dur=10):
        return [dict(ph="X", cat="kernel", pid=0, tid=7, ts=kernel_ts + ts, dur=dur, name=name, args={"correlation": corr}),
                dict(cpu, cat="cuda_runtime", ts=ts + 1, dur=1, name="cudaLaunchKernel", args={"correlation": corr})]

    events = [dict(cpu, cat="cpu_op", ts=0, dur=100, name="Torch-Compiled Region: 0/1"),
              dict(cpu, cat="cpu_op", ts=10, dur=5, name="triton_poi_fused_mul_silu_0"),
              dict(cpu, cat="cpu_op", ts=20, dur=5, name="triton_red_fused_sum_1"),
              dict(cpu, cat="cpu_op", ts=30, dur=8, name="triton_per_fused_rms_norm_2"),
              dict(cpu, cat="cpu_op", ts=31, dur=4, name="triton_poi_fused_inner_3"),  # nested: the innermost wins
              dict(cpu, cat="cpu_op", ts=40, dur=5, name="triton_poi_fused_mul_silu_0")]
    events += launch(10, 1) + launch(20, 2, dur=30) + launch(31, 3) + launch(40, 4) + launch(60, 5)  # 5: no range
    events += launch(70, 6, name="_m3_bwd_chunk_kernel", dur=40)
    orphan = launch(80, 7)[:1]  # its launch is not in the trace
    events += orphan
    renamed = [dict(e) for e in events]
    assert name_inductor_kernels(renamed) == 4
    kernels = {e["args"]["correlation"]: e["name"] for e in renamed if e.get("cat") == "kernel"}
    assert kernels == {1: "triton_poi_fused_mul_silu_0", 2: "triton_red_fused_sum_1", 3: "triton_poi_fused_inner_3",
                       4: "triton_poi_fused_mul_silu_0", 5: INDUCTOR_KERNEL_NAME, 6: "_m3_bwd_chunk_kernel",
                       7: INDUCTOR_KERNEL_NAME}  # fmt: skip
    path = tmp_path / "t.pt.trace.json"
    path.write_text(json.dumps({"traceEvents": events}))
    rows = {r["name"]: (r["total_us"], r["calls"]) for r in trace_summary(path, category="kernel", top=100)}
    assert rows == {"_m3_bwd_chunk_kernel": (40.0, 1), "triton_red_fused_sum_1": (30.0, 1),
                    "triton_poi_fused_mul_silu_0": (20.0, 2), INDUCTOR_KERNEL_NAME: (20.0, 2),
                    "triton_poi_fused_inner_3": (10.0, 1)}  # fmt: skip


def test_host_time_by_op_counts_each_custom_operators_calls_launches_and_operators(tmp_path):
    """Two profiled steps, each calling one custom operator with an allocation and two launches inside it (100 us
    a call) and another with one launch (40 us); a call outside the steps is not read, nor a non-lab operator."""
    from megacpp_lab.profiling import host_time_by_op

    cpu = dict(ph="X", pid=1, tid=1)
    events = []
    for step, t0 in enumerate((0, 1000)):
        events += [dict(cpu, cat="user_annotation", ts=t0, dur=900, name=f"ProfilerStep#{step}"),
                   dict(cpu, cat="cpu_op", ts=t0 + 10, dur=100, name="megacpp::scan_bwd"),
                   dict(cpu, cat="cpu_op", ts=t0 + 15, dur=5, name="aten::empty"),
                   dict(cpu, cat="cuda_driver", ts=t0 + 30, dur=8, name="cuLaunchKernelEx", args={"correlation": 1}),
                   dict(cpu, cat="cuda_driver", ts=t0 + 60, dur=8, name="cuLaunchKernelEx", args={"correlation": 2}),
                   dict(cpu, cat="cpu_op", ts=t0 + 200, dur=40, name="megacpp::rope"),
                   dict(cpu, cat="cuda_runtime", ts=t0 + 210, dur=8, name="cudaLaunchKernel", args={"correlation": 3}),
                   dict(cpu, cat="cpu_op", ts=t0 + 300, dur=50, name="aten::mm")]  # fmt: skip
    events += [dict(cpu, cat="cpu_op", ts=5000, dur=70, name="megacpp::rope"),  # after the steps: not read
               dict(cpu, cat="cuda_runtime", ts=5010, dur=8, name="cudaLaunchKernel", args={"correlation": 9})]
    path = tmp_path / "t.pt.trace.json"
    path.write_text(json.dumps({"traceEvents": events}))
    out = host_time_by_op(path)
    assert out["steps"] == 2 and out["host_us_per_step"] == pytest.approx(140.0)
    assert list(out["ops"]) == ["megacpp::scan_bwd", "megacpp::rope"]
    assert out["ops"]["megacpp::scan_bwd"] == {"calls_per_step": 1.0, "host_us_per_step": 100.0, "host_us_per_call": 100.0,
                                               "launches_per_call": 2.0, "operators_per_call": 1.0}  # fmt: skip
    assert out["ops"]["megacpp::rope"]["launches_per_call"] == 1.0 and out["ops"]["megacpp::rope"]["host_us_per_call"] == 40
    with pytest.raises(ValueError, match="no ProfilerStep"):
        path.write_text(json.dumps({"traceEvents": events[1:3]}))
        host_time_by_op(path)
