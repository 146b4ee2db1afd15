"""Table-store lookup throughput: a plain numpy gather, the in-process backend and the Mooncake backend (and
Mooncake's own EngramStore.lookup) over the same tables and row ids, one run, one receipt.

What it measures and writes, and how long it takes: `megacpp-lab bench table_store --help`
(megacpp_lab.bench.COMMANDS["table_store"]). The lookup runs on the host whatever the machine, so a
full run on a CPU writes a receipt.
"""

from __future__ import annotations

import importlib.metadata
import os
import select
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from megacpp_lab.bench import bench_device, output_root
from megacpp_lab.checks import config_error
from megacpp_lab.nn.ngram_hash import distinct_primes
from megacpp_lab.nn.table_store import InProcessBackend, TableStore, TableStoreConfig
from megacpp_lab.profiling import step_times_ms
from megacpp_lab.receipts import make_receipt, write_receipt
from megacpp_lab.store.mooncake import MOONCAKE_REQUIREMENT, mooncake_unavailable
from megacpp_lab.store.mooncake_backend import MooncakeBackend
from megacpp_lab.store.mooncake_master import MooncakeMaster


@dataclass(frozen=True)
class LookupShape:
    """[B, L, H] row ids into H tables of rows of width D; head h's table has the h-th prime >= N rows."""

    B: int
    L: int
    H: int
    D: int
    N: int

    def __post_init__(self) -> None:
        for name, value in asdict(self).items():
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise config_error("LookupShape", name, "an int >= 1", value)

    @property
    def sizes(self) -> tuple[int, ...]:
        return distinct_primes(self.N, self.H)  # prime-sized per-head tables, as NgramHashConfig makes them

    @property
    def rows(self) -> int:
        return self.B * self.L * self.H

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "rows": self.rows, "table_sizes": list(self.sizes)}


# The issue's shape, a small batch on large tables (the planner reads single rows) and a large batch of
# narrow rows; N near the lab's default table_size (49_999).
ISSUE_SHAPE = LookupShape(B=8, L=4096, H=2, D=256, N=49_999)
FULL_SHAPES = (ISSUE_SHAPE, LookupShape(B=1, L=1024, H=2, D=256, N=199_999), LookupShape(B=16, L=4096, H=4, D=64, N=49_999))
SMALL_SHAPES = (LookupShape(B=2, L=32, H=2, D=16, N=101), LookupShape(B=1, L=8, H=3, D=8, N=4_001))
FULL_REPS = {"warmup": 1, "rep": 7, "slow_rep": 3}
SMALL_REPS = {"warmup": 0, "rep": 1, "slow_rep": 1}  # a --small run is a smoke test: one timed call each

NUMPY = "numpy gather"
IN_PROCESS = "in-process backend (TableStore)"
MOONCAKE = "mooncake backend (TableStore, planned reads)"
MOONCAKE_ROWS = "mooncake backend, one range per row"
MOONCAKE_WHOLE = "mooncake backend, whole tables"
ENGRAM_STORE = "mooncake EngramStore.lookup"
MOONCAKE_CONTENDERS = (MOONCAKE, MOONCAKE_ROWS, MOONCAKE_WHOLE, ENGRAM_STORE)
SLOW = {MOONCAKE_ROWS, ENGRAM_STORE}  # one range per row: seconds at the large shapes, so fewer repeats

# A second process lends the store its memory, so every Mooncake read crosses TCP loopback between two
# processes, as it would from a serving process to the store; the benchmark's own client lends none.
_SEGMENT_HOST = """\
import sys
from megacpp_lab.store.mooncake import MooncakeConfig
from megacpp_lab.store.mooncake_backend import MooncakeBackend
with MooncakeBackend(MooncakeConfig(sys.argv[1], sys.argv[2], segment_bytes=int(sys.argv[3]))):
    print("ready", flush=True)
    sys.stdin.read()  # hold the segment until the benchmark closes stdin
"""


class _SegmentHost:
    """A Python process whose Mooncake client lends ``segment_bytes`` to the store, until closed."""

    def __init__(self, master: MooncakeMaster, segment_bytes: int, timeout_s: float = 60.0) -> None:
        self._log = tempfile.TemporaryFile()
        args = [sys.executable, "-c", _SEGMENT_HOST, master.master_address, master.metadata_server, str(segment_bytes)]
        self.process = subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log, text=True)
        ready, _, _ = select.select([self.process.stdout], [], [], timeout_s)
        if not ready or self.process.stdout.readline().strip() != "ready":
            self.close()
            self._log.seek(0)
            tail = self._log.read().decode(errors="replace").strip().splitlines()[-15:]
            raise RuntimeError("the Mooncake segment host did not start; its log ends:\n" + "\n".join(tail))

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.stdin.close()
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self._log.close()


def _measure(fn: Callable[[], torch.Tensor | np.ndarray], reference: np.ndarray, *, warmup: int,
             rep: int) -> dict[str, Any]:  # fmt: skip
    """Median, min and max ms of `rep` calls after the first call (checked against the reference) and
    `warmup` more."""
    out = fn()
    got = out.numpy() if isinstance(out, torch.Tensor) else np.asarray(out)
    if got.shape != reference.shape:
        raise RuntimeError(f"lookup returned shape {list(got.shape)}, expected {list(reference.shape)}")
    times = step_times_ms(fn, warmup=warmup, steps=rep, device="cpu")
    return {"ms": float(np.median(times)), "ms_min": min(times), "ms_max": max(times),
            "max_abs_err": float(np.abs(got - reference).max()), "exact": bool(np.array_equal(got, reference))}  # fmt: skip


def _per_head(backend: MooncakeBackend, keys: list[str], ids: torch.Tensor, rows_per_block: int) -> torch.Tensor:
    """TableStore.lookup's gather without its checks, at a forced block size."""
    B, L, H = ids.shape
    rows = [backend.get_rows(k, ids[:, :, h].reshape(-1), rows_per_block=rows_per_block) for h, k in enumerate(keys)]
    return torch.stack(rows, dim=1).view(B, L, H, -1)


def bench_table_store(shapes: tuple[LookupShape, ...] = FULL_SHAPES, *, warmup: int = 1, rep: int = 7,
                      slow_rep: int = 3, progress: bool = True) -> dict[str, Any]:  # fmt: skip
    """Every contender at every shape, same tables and ids, one run. Mooncake: a local master, a second
    process holding the tables, this process reading them over TCP loopback."""
    from tqdm.auto import tqdm

    start = time.perf_counter()
    unavailable = mooncake_unavailable()
    contenders = (NUMPY, IN_PROCESS) + (MOONCAKE_CONTENDERS if unavailable is None else ())
    results: list[dict[str, Any]] = []
    extra: dict[str, Any] = {}
    bar = tqdm(total=len(shapes) * len(contenders), desc="table_store contenders", disable=not progress)
    with ExitStack() as stack:
        if unavailable is None:
            import mooncake.store

            master = stack.enter_context(MooncakeMaster())
            # one shape's tables at a time (each is removed after its shape), plus the allocator's slack
            need = max(sum(s.sizes) * s.D * 4 for s in shapes)
            stack.callback(_SegmentHost(master, need + need // 4 + (64 << 20)).close)
            reader = stack.enter_context(MooncakeBackend(master.config(segment_bytes=0, force_remove=True)))
            extra["mooncake"] = {
                "package": MOONCAKE_REQUIREMENT,
                "version": importlib.metadata.version("mooncake-transfer-engine-non-cuda"),
                "placement": "tables in a second process's segment, read over TCP loopback (protocol tcp)",
                "lease_ttl_s": master.lease_ttl_s,
                "planner": {k: getattr(reader.config, k) for k in ("range_cost_s", "bytes_per_s", "max_staging_bytes")},
            }
        else:
            extra["not_measured"] = [{"contender": c, "status": "not installed", "reason": unavailable}
                                     for c in MOONCAKE_CONTENDERS]  # fmt: skip
        for layer, shape in enumerate(shapes):
            g = torch.Generator().manual_seed(layer)
            tables = [torch.randn(n, shape.D, generator=g) for n in shape.sizes]
            ids = torch.stack([torch.randint(0, n, (shape.B, shape.L), generator=g) for n in shape.sizes], dim=-1)
            np_tables, np_ids = [t.numpy() for t in tables], ids.numpy()
            reference = np.stack([np_tables[h][np_ids[..., h]] for h in range(shape.H)], axis=2)
            config = TableStoreConfig(shape.sizes, shape.D)
            in_process = TableStore(layer, config, InProcessBackend())
            in_process.populate(tables)
            fns: dict[str, Callable[[], Any]] = {
                NUMPY: lambda: np.stack([np_tables[h][np_ids[..., h]] for h in range(shape.H)], axis=2),
                IN_PROCESS: lambda: in_process.lookup(ids),
            }
            plan_info: dict[str, Any] = {}
            if unavailable is None:
                store = TableStore(layer, config, reader)
                t0 = time.perf_counter()
                store.populate(tables)
                plan_info["populate_s"] = time.perf_counter() - t0
                keys = store.get_store_keys()
                engram_config = mooncake.store.EngramStoreConfig()
                engram_config.table_vocab_sizes, engram_config.embedding_dim = list(shape.sizes), shape.D
                engram = mooncake.store.EngramStore(layer, engram_config, reader.client)  # reads the same keys
                fns.update({
                    MOONCAKE: lambda: store.lookup(ids),
                    MOONCAKE_ROWS: lambda: _per_head(reader, keys, ids, 1),
                    MOONCAKE_WHOLE: lambda: _per_head(reader, keys, ids, max(shape.sizes)),
                    ENGRAM_STORE: lambda: engram.lookup(np_ids),
                })  # fmt: skip
                plans = [reader.plan(ids[:, :, h].reshape(-1), n, shape.D) for h, n in enumerate(shape.sizes)]
                plan_info["planned_reads"] = [{"rows_per_block": p.rows_per_block, "ranges": p.num_ranges,
                                               "staged_mib": p.staged_rows * shape.D * 4 / 2**20,
                                               "estimated_ms": p.estimated_s * 1e3} for p in plans]  # fmt: skip
            for name in contenders:
                row = {"contender": name, "shape": shape.as_dict()}
                row.update(_measure(fns[name], reference, warmup=warmup, rep=slow_rep if name in SLOW else rep))
                row["rows_per_s"] = shape.rows / (row["ms"] / 1e3)
                row["gb_per_s"] = shape.rows * shape.D * 4 / (row["ms"] / 1e3) / 1e9  # bytes gathered
                if name == MOONCAKE:
                    row.update(plan_info)
                results.append(row)
                bar.update()
            if unavailable is None:
                store.remove_from_store()  # force_remove: frees the host's segment for the next shape
    bar.close()
    main = ISSUE_SHAPE if ISSUE_SHAPE in shapes else shapes[0]
    return make_receipt(
        "table_store_lookup", "table_store", shape=main.as_dict(), dtype="float32", results=results, device="cpu",
        shapes=[s.as_dict() for s in shapes], cpu_cores=len(os.sched_getaffinity(0)),
        torch_threads=torch.get_num_threads(), numpy=np.__version__, elapsed_s=time.perf_counter() - start,
        notes=(
            "Lookup of [B, L, H] precomputed row ids -> [B, L, H, D] float32, every contender on the same tables "
            "and ids in one run, on the CPU. ms: median of the timed calls after a first call (checked against "
            "the numpy gather: exact) and warm-up; rows_per_s = B*L*H / s; gb_per_s = bytes gathered "
            "(B*L*H*D*4) / s. numpy gather: np.stack of per-head fancy indexing. in-process / mooncake backend "
            "(TableStore): TableStore.lookup with its id and table checks. mooncake backend: plan_reads picks a "
            "block size per head (planned_reads: rows per block, ranges, staged MB), one get_into_ranges call "
            "into a registered buffer, one np.take; 'one range per row' and 'whole tables' force the two "
            "extremes through the same get_rows. mooncake EngramStore.lookup: Mooncake's own lookup (one range "
            "per row) on the same keys."
        ),
        **extra,
    )  # fmt: skip


def run(out_root: str | Path | None = None, *, small: bool = False, trace: bool = True) -> list[Path]:
    """The table-store benchmark; no profiler trace (the time is in Mooncake's transfer threads and numpy)."""
    import matplotlib

    matplotlib.use("Agg")
    from megacpp_lab.plots import plot_sweep, save_figure

    bench_device("table_store", small)  # the host's lookup: a CPU is the device
    root = output_root(out_root, small)
    receipt = bench_table_store(SMALL_SHAPES if small else FULL_SHAPES, **(SMALL_REPS if small else FULL_REPS))
    written = [write_receipt(receipt, root)]
    ax = plot_sweep(receipt, "rows", "rows_per_s", title=f"table-store lookup (float32)\n{receipt['device']}, "
                    f"{receipt['cpu_cores']} cores")  # fmt: skip
    shapes = {s["rows"]: s for s in receipt["shapes"]}  # one tick per shape, named in full
    ax.set_xticks(list(shapes), [f"{r}\nB={s['B']} L={s['L']}\nH={s['H']} D={s['D']}" for r, s in shapes.items()],
                  fontsize=7)  # fmt: skip
    ax.minorticks_off()
    ax.set(xlabel="rows per lookup (B*L*H)", ylabel="rows / s")
    ax.figure.set_size_inches(9, 4.5)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0)
    written.append(save_figure(ax, written[-1].with_suffix(".png")))
    return written
