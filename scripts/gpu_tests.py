"""Run the whole test suite on a GPU machine, one pytest process per test file, several at a time,
and write one log: each file's output, then a table of per-file counts and the total.

    python scripts/gpu_tests.py --out profiles/<device-slug>/tests/pytest_gpu.log [--jobs 6] [--xdist FILE=N]

A file named with --xdist is itself split over N pytest-xdist workers (for long parametrised grids).
Exit status: 0 when every file passed (skips allowed), 1 otherwise.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
COUNT = re.compile(r"(\d+) (passed|failed|skipped|errors?|xfailed|xpassed|deselected)")


def run_file(path: Path, xdist: int, timeout_s: int, threads: int) -> tuple[Path, dict[str, int], float, str]:
    cmd = [sys.executable, "-m", "pytest", str(path.relative_to(ROOT)), "-q", "-rfEs", "-p", "no:cacheprovider"]
    # torch's intra-op pool takes every core by default: with several files at once the CPU-bound ones (a CPU
    # training run, the CLI's subprocesses) oversubscribe the host and time out, so each file gets its share
    env = {"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads), **os.environ}
    if xdist > 1:
        cmd += ["-n", str(xdist)]
    start = time.perf_counter()
    try:
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout_s, env=env)
        output, code = proc.stdout + proc.stderr, proc.returncode
    except subprocess.TimeoutExpired as e:
        output, code = f"{e.stdout or ''}{e.stderr or ''}\nTIMEOUT after {timeout_s} s", -1
    seconds = time.perf_counter() - start
    summary = [line for line in output.splitlines() if COUNT.search(line) and " in " in line]
    counts = {kind.rstrip("s") if kind.startswith("error") else kind: int(n)
              for n, kind in COUNT.findall(summary[-1] if summary else "")}  # fmt: skip
    if code not in (0, 5) and not counts.get("failed") and not counts.get("error"):
        counts["error"] = 1  # a crash or timeout with no pytest summary still fails the run
    return path, counts, seconds, output


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="log file to write")
    parser.add_argument("--jobs", type=int, default=6, help="test files run at once")
    parser.add_argument("--timeout", type=int, default=540, help="seconds per test file")
    parser.add_argument("--xdist", action="append", default=[], metavar="FILE=N", help="split FILE over N workers")
    parser.add_argument("files", nargs="*", help="test files (default: tests/test_*.py)")
    args = parser.parse_args()
    split = {name: int(n) for name, n in (item.split("=") for item in args.xdist)}
    files = [Path(f).resolve() for f in args.files] or sorted((ROOT / "tests").glob("test_*.py"))
    # the longest files first, so the pool does not end on one straggler
    files.sort(key=lambda p: (-split.get(p.name, 1), -p.stat().st_size))
    started = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    t0 = time.perf_counter()
    # each file's section lands in <out>.partial (and a line on stdout) as it finishes: a run killed from
    # outside still leaves what it measured
    partial = Path(str(args.out) + ".partial")
    partial.parent.mkdir(parents=True, exist_ok=True)
    partial.write_text(f"# partial log, started {started}; the full log replaces it at the end\n")
    results = []
    threads = max(1, (os.cpu_count() or 1) // args.jobs)
    with ThreadPoolExecutor(args.jobs) as pool:
        futures = [pool.submit(run_file, p, split.get(p.name, 1), args.timeout, threads) for p in files]
        for done in as_completed(futures):
            path, counts, seconds, output = done.result()
            results.append((path, counts, seconds, output))
            with partial.open("a") as f:
                f.write(f"===== {path.relative_to(ROOT)} ({seconds:.0f} s) {counts}\n{output.rstrip()}\n\n")
            print(f"{len(results)}/{len(files)} {path.name}: {counts} in {seconds:.0f} s", flush=True)
    wall = time.perf_counter() - t0

    import torch
    import triton

    sys.path.insert(0, str(ROOT))
    from megacpp_lab.receipts import git_commit  # the project's own commit, or its package's tree hash

    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    n_gpus = torch.cuda.device_count()
    if n_gpus > 1:
        device = f"{n_gpus} x {device}"
    commit = git_commit()
    kinds = ("passed", "failed", "error", "skipped")
    lines = [f"# whole test suite, one pytest process per file ({args.jobs} at a time, {threads} CPU threads each "
             "unless OMP_NUM_THREADS was set)",
             f"# device: {device}; torch {torch.__version__}; triton {triton.__version__}; commit {commit}",
             f"# started {started}; wall {wall:.0f} s", ""]  # fmt: skip
    for path, counts, seconds, output in sorted(results):
        lines += [f"===== {path.relative_to(ROOT)} ({seconds:.0f} s)", output.rstrip(), ""]
    lines.append(f"{'file':<44}" + "".join(f"{k:>9}" for k in kinds) + f"{'seconds':>9}")
    total = dict.fromkeys(kinds, 0)
    for path, counts, seconds, _ in sorted(results):
        lines.append(f"{path.name:<44}" + "".join(f"{counts.get(k, 0):>9}" for k in kinds) + f"{seconds:>9.0f}")
        for k in kinds:
            total[k] += counts.get(k, 0)
    lines.append(f"{'TOTAL':<44}" + "".join(f"{total[k]:>9}" for k in kinds) + f"{wall:>9.0f}")
    lines.append(f"{total['passed']} passed, {total['failed'] + total['error']} failed, {total['skipped']} skipped")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text("\n".join(lines) + "\n")
    partial.unlink()
    print("\n".join(lines[-(len(results) + 3) :]))
    return 0 if total["failed"] == 0 and total["error"] == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
