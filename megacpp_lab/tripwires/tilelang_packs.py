"""TileLang packs 08 and 13: lowering reproducers for an sm_90 CUDA target, run on any machine, no GPU.

`tilelang.lower` with a CUDA target produces the kernel's CUDA source without nvcc or a device. Each case lowers
one kernel inside a `PassContext` whose config switches TMA lowering (`tl.disable_tma_lower`,
`tl.disable_warp_specialized`), and reads the source for TMA copies (`tl::tma_load` / `tl::tma_store`): a
kernel that compiled because it fell back to cp.async or plain loads is not a bulk-copy pass.

The kernels are defined in this file because TileLang parses a kernel's Python source. The packs run in a
subprocess (`python -m megacpp_lab.tripwires.tilelang_packs` prints JSON): TileLang loads its own TVM and
threads, and an abort inside a pass must end that process, not the caller's.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from megacpp_lab.tripwires import BUG_FIRED, FIXED, NOT_RUN, PACKS, Case, PackResult

__all__ = ["EXPECTED", "EXPECTED_WHY", "PINNED_TILELANG", "TARGET", "results_from", "run_tilelang_packs"]

# The release these packs were measured on (pyproject's `tripwires` extra pins it). A new release is a
# deliberate change: rerun the packs, read what moved, then update PINNED_TILELANG, EXPECTED and EXPECTED_WHY
# together.
PINNED_TILELANG = "0.1.15"
TARGET = {"kind": "cuda", "arch": "sm_90"}  # H100 / H200
TMA_ON: dict[str, bool] = {"tl.disable_tma_lower": False, "tl.disable_warp_specialized": False}
TMA_OFF: dict[str, bool] = {"tl.disable_tma_lower": True, "tl.disable_warp_specialized": True}

LOWERED_TMA = "lowered, with TMA copies"
LOWERED_NO_TMA = "lowered, no TMA copies (non-bulk copy)"
DIVIDE_BY_ZERO = "error: Divide by zero"  # the pack-13 bug: TryConstFold<FloorMod> on a divisor folded to 0
NOT_INDEPENDENT = "error: Mapped indices are not independent"
TIMEOUT_S = 300

# case name -> outcome on PINNED_TILELANG (measured on this project's CPU machine)
EXPECTED: dict[str, dict[str, str]] = {
    "08": {
        "rank-2 smem [64, 64] bf16, pipelined load (control)": LOWERED_TMA,
        "rank-3 smem [64, 4, 16] bf16, pipelined load": LOWERED_TMA,
        "rank-4 smem [32, 2, 4, 16] bf16, pipelined load": LOWERED_TMA,
        # R=4 bf16 rows are 8 bytes, under TMA's 16-byte minimum box row: compiles through cp.async instead
        "MIMO qk_dot_shared [64, 4, 4] bf16, pipelined load": LOWERED_NO_TMA,
        "rank-3 smem [64, 4, 16] bf16, TMA lowering off (control)": LOWERED_NO_TMA,
    },
    "13": {
        # 0.1.8 aborted here with 'Divide by zero' (the pack's bug); 0.1.15 lowers it
        "R=3, K=48, N=64, TMA on": LOWERED_TMA,
        # ...and now fails with TMA off, the configuration that was the workaround on 0.1.8
        "R=3, K=48, N=64, TMA off": NOT_INDEPENDENT,
        "R=4, K=64, N=64, TMA on": LOWERED_TMA,
        "R=4, K=64, N=64, TMA off": LOWERED_NO_TMA,
    },
}

# pack -> case name -> why its pinned outcome, an error, is the expected one: printed in the case's line when it
# is what the run saw, since the console shows the pack FIXED above an error
EXPECTED_WHY: dict[str, dict[str, str]] = {
    "13": {
        "R=3, K=48, N=64, TMA off": "(expected on tilelang 0.1.15, and not the pack's bug: with TMA lowering off, "
                                    "the seeds' workaround for the divide-by-zero, the 24 x 128 shared layout "
                                    "TileLang picks for out_s [16, 3, 64] fails TVM's iter-map check, so the "
                                    "workaround does not compile here)",
    },
}


# ----------------------------------------------------------------------------- the kernels (TileLang parses them)


def _pipelined_load(shared_shape: tuple[int, ...], steps: int = 4) -> Any:
    """A[bx] streamed tile by tile through one shared buffer of `shared_shape` (T.Pipelined: the loop TileLang
    turns into TMA loads), summed into a fragment and stored."""
    import tilelang.language as T

    chunk, rest = shared_shape[0], shared_shape[1:]
    dtype = "bfloat16"

    if len(shared_shape) == 2:
        (n,) = rest

        @T.prim_func
        def rank2(A: T.Tensor((4, steps * chunk, n), dtype), O: T.Tensor((4, chunk, n), "float32")):
            with T.Kernel(4, threads=128) as bx:
                s = T.alloc_shared((chunk, n), dtype)
                acc = T.alloc_fragment((chunk, n), "float32")
                T.clear(acc)
                for k in T.Pipelined(steps, num_stages=2):
                    T.copy(A[bx, k * chunk : (k + 1) * chunk, :], s)
                    for i, j in T.Parallel(chunk, n):
                        acc[i, j] += s[i, j]
                T.copy(acc, O[bx, :, :])

        return rank2
    if len(shared_shape) == 3:
        r, n = rest

        @T.prim_func
        def rank3(A: T.Tensor((4, steps * chunk, r, n), dtype), O: T.Tensor((4, chunk, r, n), "float32")):
            with T.Kernel(4, threads=128) as bx:
                s = T.alloc_shared((chunk, r, n), dtype)
                acc = T.alloc_fragment((chunk, r, n), "float32")
                T.clear(acc)
                for k in T.Pipelined(steps, num_stages=2):
                    T.copy(A[bx, k * chunk : (k + 1) * chunk, :, :], s)
                    for i, j, m in T.Parallel(chunk, r, n):
                        acc[i, j, m] += s[i, j, m]
                T.copy(acc, O[bx, :, :, :])

        return rank3
    g, r, n = rest  # rank 4: the leading dim is the pipelined one

    @T.prim_func
    def rank4(A: T.Tensor((4, steps * chunk, g, r, n), dtype), O: T.Tensor((4, chunk, g, r, n), "float32")):
        with T.Kernel(4, threads=128) as bx:
            s = T.alloc_shared((chunk, g, r, n), dtype)
            acc = T.alloc_fragment((chunk, g, r, n), "float32")
            T.clear(acc)
            for k in T.Pipelined(steps, num_stages=2):
                T.copy(A[bx, k * chunk : (k + 1) * chunk, :, :, :], s)
                for i, j, p, m in T.Parallel(chunk, g, r, n):
                    acc[i, j, p, m] += s[i, j, p, m]
            T.copy(acc, O[bx, :, :, :, :])

    return rank4


def _floormod_scatter(R: int, K: int, N: int) -> Any:
    """Pack 13's pattern: inside T.Parallel(K, N), out_s[csr // R, csr % R, n] = frag[csr % R, n], with R a
    Python int closed over from here, frag an (R, N) fragment and out_s a rank-3 shared buffer."""
    import tilelang.language as T

    dtype = "float32"

    @T.prim_func
    def scatter(A: T.Tensor((R, N), dtype), O: T.Tensor((K // R, R, N), dtype)):
        with T.Kernel(1, threads=128) as bx:  # noqa: F841 (the block index is unused: one block)
            frag = T.alloc_fragment((R, N), dtype)
            out_s = T.alloc_shared((K // R, R, N), dtype)
            T.copy(A, frag)
            for csr, n in T.Parallel(K, N):
                out_s[csr // R, csr % R, n] = frag[csr % R, n]
            T.copy(out_s, O)

    return scatter


# ----------------------------------------------------------------------------- lowering, in the subprocess


@contextmanager
def _stderr_to(path: str) -> Iterator[None]:
    """Redirect file descriptor 2 (TVM's C++ LOG(WARNING) writes there, past Python's sys.stderr)."""
    sys.stderr.flush()
    saved = os.dup(2)
    with open(path, "w") as f:
        os.dup2(f.fileno(), 2)
    try:
        yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)


def _classify(err: BaseException) -> str:
    text = str(err)
    for needle, outcome in (("Divide by zero", DIVIDE_BY_ZERO), ("Mapped indices are not independent", NOT_INDEPENDENT)):
        if needle in text:
            return outcome
    last = [line for line in text.strip().splitlines() if line.strip()][-1:] or [type(err).__name__]
    return f"error: {type(err).__name__}: {last[0].strip()[:160]}"


def _lower_case(name: str, build: Callable[[], Any], config: dict[str, bool]) -> dict[str, Any]:
    import tilelang
    from tilelang import tvm

    target = tvm.target.Target(TARGET)
    with tempfile.TemporaryDirectory() as tmp:
        log = os.path.join(tmp, "stderr.txt")
        start = time.perf_counter()
        with _stderr_to(log):
            try:
                with tvm.transform.PassContext(config=config), target:
                    source = tilelang.lower(build(), target=target).kernel_source
                error = None
            except Exception as err:  # noqa: BLE001 (every lowering failure is a result here, named)
                source, error = "", err
        seconds = time.perf_counter() - start
        warnings = [line.strip() for line in open(log).read().splitlines() if "warning" in line.lower()]
    loads, stores = len(re.findall(r"tl::tma_load\b", source)), len(re.findall(r"tl::tma_store\b", source))
    tma = (loads + stores) > 0 if error is None else None
    outcome = _classify(error) if error is not None else (LOWERED_TMA if tma else LOWERED_NO_TMA)
    detail = f"{seconds:.2f} s"
    if error is None:
        detail += f"; tma_load x{loads}, tma_store x{stores}, cp.async: {'yes' if 'cp_async' in source else 'no'}"
    if warnings:
        detail += f"; warned: {warnings[0][:160]}"
    return {"name": name, "outcome": outcome, "tma_copies": tma, "detail": detail}


def _cases() -> dict[str, list[tuple[str, Callable[[], Any], dict[str, bool]]]]:
    return {
        "08": [
            ("rank-2 smem [64, 64] bf16, pipelined load (control)", lambda: _pipelined_load((64, 64)), TMA_ON),
            ("rank-3 smem [64, 4, 16] bf16, pipelined load", lambda: _pipelined_load((64, 4, 16)), TMA_ON),
            ("rank-4 smem [32, 2, 4, 16] bf16, pipelined load", lambda: _pipelined_load((32, 2, 4, 16)), TMA_ON),
            ("MIMO qk_dot_shared [64, 4, 4] bf16, pipelined load", lambda: _pipelined_load((64, 4, 4)), TMA_ON),
            ("rank-3 smem [64, 4, 16] bf16, TMA lowering off (control)", lambda: _pipelined_load((64, 4, 16)), TMA_OFF),
        ],
        "13": [
            (f"R={r}, K={k}, N=64, TMA {'on' if on else 'off'}", (lambda r=r, k=k: _floormod_scatter(r, k, 64)),
             TMA_ON if on else TMA_OFF)
            for r, k in ((3, 48), (4, 64)) for on in (True, False)
        ],  # fmt: skip
    }


def _versions() -> dict[str, str]:
    import tilelang
    import torch
    from tilelang import tvm

    def dist(name: str) -> str:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            return "absent"

    return {"tilelang": tilelang.__version__, "tvm": str(getattr(tvm, "__version__", "?")),
            "apache-tvm-ffi": dist("apache-tvm-ffi"), "torch": torch.__version__,
            "python": sys.version.split()[0]}  # fmt: skip


def _main() -> None:
    from datetime import datetime, timezone

    from megacpp_lab.receipts import git_commit

    out = {"versions": _versions(), "target": json.dumps(TARGET), "commit": git_commit(),
           "date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "packs": {}}  # fmt: skip
    for pack, cases in _cases().items():
        out["packs"][pack] = [_lower_case(*case) for case in cases]
    print(json.dumps(out))


# ----------------------------------------------------------------------------- the caller's side


def _not_run(why: str) -> list[PackResult]:
    return [PackResult(n, PACKS[n].title, NOT_RUN, (), {"tilelang": "absent"}, json.dumps(TARGET),
                       (f"pack {n} ({PACKS[n].title}): {why}",)) for n in ("08", "13")]  # fmt: skip


def run_tilelang_packs() -> list[PackResult]:
    """Packs 08 and 13, lowered in a subprocess of this interpreter. NOT_RUN, with the reason, when tilelang is
    not installed or the subprocess fails."""
    if importlib.util.find_spec("tilelang") is None:
        return _not_run("tilelang is not installed; install the extra: pip install -e '.[tripwires]'")
    try:
        proc = subprocess.run([sys.executable, "-m", "megacpp_lab.tripwires.tilelang_packs"], capture_output=True,
                              text=True, timeout=TIMEOUT_S)  # fmt: skip
    except subprocess.TimeoutExpired:
        return _not_run(f"lowering did not finish within {TIMEOUT_S} s")
    if proc.returncode != 0:  # an abort inside a pass (SIGABRT) lands here: name it rather than crash
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        return _not_run(f"the lowering subprocess exited {proc.returncode}: {' | '.join(tail)}")
    return results_from(json.loads(proc.stdout.strip().splitlines()[-1]))


def results_from(data: dict[str, Any]) -> list[PackResult]:
    """PackResults from the subprocess's JSON (`python -m megacpp_lab.tripwires.tilelang_packs`), judged against
    PINNED_TILELANG and EXPECTED: also for a run recorded on another release."""
    versions = data["versions"]
    results = []
    for pack, raw in data["packs"].items():
        expected, why = EXPECTED[pack], EXPECTED_WHY.get(pack, {})
        cases = []
        for c in raw:
            pinned, detail = expected.get(c["name"], "(not pinned)"), c["detail"]
            if c["outcome"] == pinned and c["name"] in why:
                detail = f"{detail} {why[c['name']]}".strip()
            cases.append(Case(c["name"], c["outcome"], pinned, detail, c["tma_copies"]))
        if pack == "13":
            fired = any(c.outcome == DIVIDE_BY_ZERO for c in cases)
        else:  # pack 08's bug aborted the build on any rank >= 3 shared layout
            fired = any(c.outcome.startswith("error") for c in cases)
        problems = []
        if versions["tilelang"] != PINNED_TILELANG:
            problems.append(f"pack {pack} ({PACKS[pack].title}): tilelang {versions['tilelang']} is not the pinned "
                            f"{PINNED_TILELANG}; rerun the pack and update PINNED_TILELANG and EXPECTED together")  # fmt: skip
        results.append(PackResult(pack, PACKS[pack].title, BUG_FIRED if fired else FIXED, tuple(cases), versions,
                                  data["target"], tuple(problems)))  # fmt: skip
    return results

if __name__ == "__main__":
    _main()
