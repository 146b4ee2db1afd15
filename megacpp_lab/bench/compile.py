"""Compile time of HybridLM, cold and warm, region by region, and the compiled step against eager: one run.

What it measures and writes, and how long it takes: `megacpp-lab bench compile --help`
(megacpp_lab.bench.COMMANDS["compile"]).

Every contender runs in a process of its own (`python -m megacpp_lab.bench.compile RUN.json`), so that cold means
cold: a fresh interpreter, a fresh dynamo, and inductor and Triton cache directories of its own
(TORCHINDUCTOR_CACHE_DIR, TRITON_CACHE_DIR), empty unless the run is a warm restart of an earlier one. A run
writes its result file as it goes, so a run stopped at its time cap (the whole-model compile of a deep model)
still reports how far it got. The parent times the process from its launch: the imports, the build and the
first step are what a user waits for after a kernel restart.
"""

from __future__ import annotations

import functools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

# the bar's reference: an H100 SXM's dense bf16 peak (the H200 has the same SMs and clocks, so the same peak)
PEAK_BF16_TFLOPS = 989.0
# documents per row of the batches after the first: a new count must reuse the graphs, never recompile
DOC_COUNTS = (1, 2, 3, 17, 64)
SMALL_DOC_COUNTS = (1, 2, 3, 5)
# a whole-model compile stopped here has taken at least this many times the regional one at its depth: the
# 1/3 bar holds, and the receipt says the whole-model time is a lower bound
WHOLE_CAP_FACTOR = 3.05
EAGER = "eager (timed after regional cold, in its process)"
STOPPED = 75  # the exit status of a run stopped at its first-step cap
# warm processes in a row on the same caches: a warm start's first step spreads by seconds between processes on
# one host, so the warm bars read the median of these (summary.warm_runs keeps each)
WARM_RUNS = 3
# what every contender imports before its first step ends (bytecode_cache compiles these once)
BYTECODE_PRIME = ("torch", "torch._dynamo", "torch._inductor.compile_fx", "triton", "megacpp_lab.bench.compile",
                  "megacpp_lab.bench.harness", "megacpp_lab.model.precompile")  # fmt: skip
BARS = {
    "cold_s": 40.0,  # regional first step, fresh caches, 12 layers
    "warm_first_step_s": 4.0,  # a new process, caches on disk
    "warm_total_s": 10.0,  # import, build and first step of that process
    "depth_ratio": 1.15,  # regional cold first step at 48 layers over 12
    "whole_fraction": 1 / 3,  # regional cold first step over whole-model at 48 layers
    "step_over_eager": 0.8,
    "mfu": 0.30,  # the compiled step's model FLOP utilisation, attention counted per document
}


@dataclass(frozen=True)
class Run:
    """One contender, run in a process of its own (see the module docstring)."""

    name: str
    mode: str  # eager | regional | whole
    preset: str = "base"
    n_layers: int | None = None  # None: the preset's
    B: int = 4
    T: int = 4096
    docs: int = 8
    backend: str = "inductor"
    device: str = "cuda"
    steps: int = 0  # timed steps after the first (0: the first step only)
    warmup: int = 0
    doc_counts: tuple[int, ...] = ()  # batches after the first, with gradients then without: none may add a graph
    megacache_save: str | None = None  # write torch.compiler.save_cache_artifacts() here after the run
    megacache_load: str | None = None  # load these artifacts (torch.compiler.load_cache_artifacts) before the build
    trace_dir: str | None = None  # one profiled step of the compiled model
    eager_after: bool = False  # then time the eager step of the same model in this process (the baseline)
    first_step_cap_s: float | None = None  # stop the process this long into its first step (a lower bound then)
    compile_workers: int | None = None  # ParallelConfig.compile_workers (None: its default); 0: one process
    saved_graphs: bool = True  # ParallelConfig.saved_graphs: a warm run loads the graphs a cold run saved
    launched_at: float = 0.0  # time.time() when the parent launched the process


# ----------------------------------------------------------------------------- the run, in its own process


def _triton_kernels(cache: str | None) -> int:
    """Compiled Triton kernels in a Triton cache directory (one .cubin / .hsaco / interpreter-free binary each)."""
    if not cache or not Path(cache).is_dir():
        return 0
    return sum(1 for p in Path(cache).rglob("*") if p.suffix in (".cubin", ".hsaco"))


def _run(run: Run, out: Path) -> None:
    """Measure one contender and write its result to `out` after every phase (see Run)."""
    imported_at = time.time()
    import torch

    torch_at = time.time()
    from torch._dynamo.utils import clear_compilation_metrics, counters, get_compilation_metrics

    from megacpp_lab.bench.harness import ModelShape, TrainingStep, build_model, make_batch, triton_config
    from megacpp_lab.model.parallelize import (ParallelConfig, block_structures, compile_breakdown, compile_stats,
                                              ready_inductor)
    from megacpp_lab.profiling import profile_trace, step_times_ms, sync
    from megacpp_lab.varlen import build_context

    result: dict[str, Any] = {"contender": run.name, "mode": run.mode, "n_layers": run.n_layers, "preset": run.preset}

    def save(**values: Any) -> None:
        result.update(values)
        out.write_text(json.dumps(result, indent=1, default=str) + "\n")

    ready_at = time.time()
    save(import_s=ready_at - run.launched_at, torch_import_s=torch_at - imported_at, megacpp_import_s=ready_at - torch_at,
         compile_threads=int(torch._inductor.config.compile_threads), triton_cache=os.environ.get("TRITON_CACHE_DIR"),
         inductor_cache=os.environ.get("TORCHINDUCTOR_CACHE_DIR"))  # fmt: skip
    if run.megacache_load:
        t0 = time.perf_counter()
        info = torch.compiler.load_cache_artifacts(Path(run.megacache_load).read_bytes())
        save(megacache_load_s=time.perf_counter() - t0, megacache_loaded=info is not None)
    config = triton_config(run.preset, run.device, **({"n_layers": run.n_layers} if run.n_layers else {}))
    parallel = ParallelConfig.build(compile=run.mode == "regional", backend=run.backend, compile_workers=run.compile_workers,
                                    saved_graphs=run.saved_graphs)  # fmt: skip
    model = build_model(config, run.device, parallel=parallel)
    if run.mode == "whole":
        model = torch.compile(model, backend=run.backend)
    shape = ModelShape(run.preset, run.B, run.T, run.docs)
    ignore = config.lm_head.ignore_index
    tokens, doc_ids, targets = make_batch(shape, config.vocab_size, run.device, ignore_index=ignore)
    ctx = build_context(doc_ids)
    step = TrainingStep(model, tokens, ctx, targets)
    structures = list(block_structures(model if run.mode != "whole" else model._orig_mod).items())
    counters.clear()
    clear_compilation_metrics()
    kernels_before = _triton_kernels(os.environ.get("TRITON_CACHE_DIR"))
    sync(run.device)
    built_at = time.time()
    save(build_s=built_at - ready_at, layers=config.n_layers, structures=[[list(s), n] for s, n in structures],
         inductor_start_s=ready_inductor() if ready_inductor.cache_info().currsize else None)  # fmt: skip
    if run.first_step_cap_s is not None:  # the cap counts from the first step, not from the launch

        def stop() -> None:
            save(stopped_at_s=run.first_step_cap_s, compile_s=run.first_step_cap_s, stopped_by="cap")
            os._exit(STOPPED)

        timer = threading.Timer(run.first_step_cap_s, stop)
        timer.daemon = True
        timer.start()
    t0 = time.perf_counter()
    step()
    sync(run.device)
    first = time.perf_counter() - t0
    stats = compile_stats()
    n_first = len(get_compilation_metrics())
    save(first_step_s=first, compile_s=first, total_s=time.time() - run.launched_at, graphs=stats.graphs,
         graph_breaks=stats.graph_breaks, triton_kernels_compiled=_triton_kernels(os.environ.get("TRITON_CACHE_DIR"))
         - kernels_before)  # fmt: skip
    job = step.precompile
    if job is not None:  # the block structures compiled at once, by worker processes and this one (model/precompile.py)
        save(compile_workers={"blocks": job.plan, "done_at_s": job.seconds, "threads_each": job.threads,
                              "timelines": job.reports, "own_block": job.own, "own_s": job.own_s})  # fmt: skip
        structures = job.structures_in_compile_order(model)  # dynamo compiled them in the job's order
    saved = getattr(model, "saved_graphs", None)
    if saved is not None:  # loaded or compiled by dynamo's ahead-of-time entry: no frame records to split by phase
        summary = saved.summary()
        save(saved_graphs=summary, saved_graph_events=saved.events,
             saved_graphs_s=summary["loaded_s"] + summary["compiled_s"],
             outside_saved_graphs_s=max(0.0, first - summary["loaded_s"] - summary["compiled_s"]))  # fmt: skip
    elif run.mode != "eager":
        breakdown = compile_breakdown(structures if run.mode == "regional" else [(("model",), 1)], n_first)
        save(compile=breakdown, dynamo_and_inductor_s=breakdown["cold_compile_s"],
             outside_dynamo_s=max(0.0, first - breakdown["cold_compile_s"]),
             generated_kernels=int(counters["inductor"].get("async_compile_cache_miss", 0)))  # fmt: skip
    if run.doc_counts:  # with gradients, then without: after the first call of each mode, no graph may be added
        for i, docs in enumerate(run.doc_counts):
            t, d, y = make_batch(replace(shape, docs=docs), config.vocab_size, run.device, seed=1 + i, ignore_index=ignore)
            TrainingStep(model, t, build_context(d), y)()
        grad_graphs = compile_stats().graphs
        with torch.no_grad():
            model(tokens, build_context(doc_ids), targets)
            no_grad_first = compile_stats().graphs
            for i, docs in enumerate(run.doc_counts):
                t, d, y = make_batch(replace(shape, docs=docs), config.vocab_size, run.device, seed=1 + i, ignore_index=ignore)
                model(t, build_context(d), y)
        sync(run.device)
        save(recompiles_with_grad=grad_graphs - stats.graphs, no_grad_graphs=no_grad_first - grad_graphs,
             recompiles_without_grad=compile_stats().graphs - no_grad_first, doc_counts=list(run.doc_counts))  # fmt: skip
    if run.steps:
        samples = sorted(step_times_ms(step, warmup=run.warmup, steps=run.steps, device=run.device))
        ms = statistics.median(samples)
        n_tokens = run.B * run.T
        save(ms=ms, ms_min=samples[0], ms_max=samples[-1], steps=run.steps, tokens_per_s=n_tokens / (ms / 1e3),
             compile_s=max(0.0, first - ms / 1e3),
             **step_flops(model if run.mode != "whole" else model._orig_mod, run.T, ctx.doc_lengths, n_tokens, ms))  # fmt: skip
    if run.trace_dir:
        trace, _ = profile_trace(step, Path(run.trace_dir), f"compile_{run.mode}", steps=1, warmup=1, record_shapes=False)
        save(trace=trace.name)
    if run.megacache_save:
        artifacts = torch.compiler.save_cache_artifacts()
        if artifacts is None:
            save(megacache_bytes=0)
        else:
            Path(run.megacache_save).write_bytes(artifacts[0])
            save(megacache_bytes=len(artifacts[0]))
    if run.eager_after:  # same weights (seed 0), same batch; the lab's kernels compiled and autotuned by now
        del step
        eager = build_model(config, run.device)
        eager_step = TrainingStep(eager, tokens, build_context(doc_ids), targets)
        eager_step()
        samples = sorted(step_times_ms(eager_step, warmup=run.warmup, steps=run.steps, device=run.device))
        ms = statistics.median(samples)
        save(eager={"ms": ms, "ms_min": samples[0], "ms_max": samples[-1], "steps": run.steps,
                    "tokens_per_s": run.B * run.T / (ms / 1e3),
                    **step_flops(eager, run.T, ctx.doc_lengths, run.B * run.T, ms)})  # fmt: skip
    save(done=True)


def step_flops(model: Any, T: int, doc_lens: list[int], n_tokens: int, ms: float) -> dict[str, float]:
    """A step's FLOP rate two ways: mfu with attention over each document's causal triangle (the batch's doc_lens,
    HybridLM.flops_per_token), the figure the bar reads; mfu_upper_bound with attention over each row's whole
    triangle (what the old formula counted: packed rows never compute it)."""
    per_doc = model.flops_per_token(T, doc_lens=doc_lens)["total"]
    per_row = model.flops_per_token(T)["total"]
    tflops, tflops_upper = (f * n_tokens / (ms / 1e3) / 1e12 for f in (per_doc, per_row))
    return {"flops_per_token": per_doc, "tflops": tflops, "mfu": tflops / PEAK_BF16_TFLOPS,
            "flops_per_token_upper_bound": per_row, "tflops_upper_bound": tflops_upper,
            "mfu_upper_bound": tflops_upper / PEAK_BF16_TFLOPS}


# ----------------------------------------------------------------------------- the parent


def python_env(bytecode: Path | None) -> dict[str, str]:
    """The environment of a contender's interpreter: this one's, the library importable, and with `bytecode`
    Python's bytecode cache there (PYTHONPYCACHEPREFIX) even where this host turns bytecode writing off."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(Path(__file__).resolve().parents[2]),
                                                                  os.environ.get("PYTHONPATH")) if p)}  # fmt: skip
    if bytecode is not None:
        env.pop("PYTHONDONTWRITEBYTECODE", None)
        env["PYTHONPYCACHEPREFIX"] = str(bytecode)
    return env


def bytecode_cache(root: Path) -> dict[str, Any]:
    """A host that writes no Python bytecode (PYTHONDONTWRITEBYTECODE, as container images often set) with a torch
    installed without .pyc files makes every new process compile torch's, dynamo's and inductor's sources,
    seconds of every process's start and of every compile worker's, which an installed torch does not pay. A
    pip-installed torch carries its bytecode, so the contenders get a bytecode cache under `root`, compiled
    once here (`primed_s`) before the first contender, and the receipt says so. Where the host writes bytecode,
    nothing changes (`cache` None)."""
    if not (sys.dont_write_bytecode or os.environ.get("PYTHONDONTWRITEBYTECODE")):
        return {"host_writes_bytecode": True, "cache": None}
    cache = root / "pycache"
    start = time.perf_counter()
    subprocess.run([sys.executable, "-c", "import " + ", ".join(BYTECODE_PRIME)], env=python_env(cache), check=True)
    return {"host_writes_bytecode": False, "cache": str(cache), "primed_s": time.perf_counter() - start,
            "primed_modules": list(BYTECODE_PRIME)}  # fmt: skip


def launch_contender(run: Run, caches: Path, *, timeout: float | None, interpret: bool,
                     bytecode: Path | None = None) -> dict[str, Any]:  # fmt: skip
    """Run one contender in a new process with `caches`/inductor and `caches`/triton as its cache directories
    (and `bytecode` as Python's bytecode cache: bytecode_cache); its result, `stopped_at_s` set when it ran
    past `timeout`."""
    reused = caches.is_dir()
    caches.mkdir(parents=True, exist_ok=True)
    out = caches.parent / f"{caches.name}-{run.name.replace(' ', '_')}.json"
    out.unlink(missing_ok=True)
    env = {**python_env(bytecode), "TORCHINDUCTOR_CACHE_DIR": str(caches / "inductor"), "TRITON_CACHE_DIR": str(caches / "triton")}
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    run = replace(run, launched_at=time.time())
    spec = out.with_suffix(".run.json")
    spec.write_text(json.dumps(asdict(run)))
    print(f"[bench compile] {run.name}: {'the caches of an earlier run' if reused else 'empty caches'} in {caches}"
          f"{f', stopped at {timeout:.0f} s' if timeout else ''}", file=sys.stderr, flush=True)  # fmt: skip
    proc = subprocess.Popen([sys.executable, "-m", "megacpp_lab.bench.compile", str(spec), str(out)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)  # fmt: skip
    try:
        log, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:  # the deadline: the first step's lower bound is what ran of it
        proc.kill()
        log, _ = proc.communicate()
        result = json.loads(out.read_text()) if out.is_file() else {"contender": run.name, "mode": run.mode}
        since = time.time() - run.launched_at
        result["stopped_at_s"] = max(0.0, since - result.get("import_s", since) - result.get("build_s", 0.0))
        result.update(compile_s=result["stopped_at_s"], stopped_by="deadline")
        return result
    if proc.returncode == STOPPED:
        return json.loads(out.read_text())
    if proc.returncode:
        raise RuntimeError(f"bench compile: {run.name} failed ({proc.returncode}):\n{log[-4000:]}")
    return json.loads(out.read_text())


def median_run(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Several runs of one contender as one row: the run with the median first step (its per-region breakdown
    is the row's), every run's times beside it (`runs`), and the median first step and total of them all."""
    ordered = sorted(runs, key=lambda r: r["first_step_s"])
    row = dict(ordered[len(ordered) // 2])
    row["runs"] = [{k: r.get(k) for k in ("import_s", "build_s", "inductor_start_s", "first_step_s", "total_s")} for r in runs]
    row["first_step_s"] = statistics.median(r["first_step_s"] for r in runs)
    row["total_s"] = statistics.median(r["total_s"] for r in runs)
    return row


def first_step_seconds(row: dict[str, Any]) -> float:
    """The first step's time, or for a run stopped in it, how long it had run (a lower bound)."""
    return row["first_step_s"] if "first_step_s" in row else row["stopped_at_s"]


def bench_compile(*, preset: str = "base", B: int = 4, T: int = 4096, docs: int = 8, deep_layers: int = 48,
                  device: str = "cuda", doc_counts: tuple[int, ...] = DOC_COUNTS, steps: int = 10, warmup: int = 3,
                  backend: str = "inductor", trace_dir: Path | None = None, caches: Path | None = None,
                  progress: bool = True, partial: Path | None = None, whole_shallow: bool = False,
                  deadline_s: float | None = None, warm_runs: int = WARM_RUNS) -> dict[str, Any]:  # fmt: skip
    """Eager, regional cold / warm / from Mega-Cache artifacts, regional at `deep_layers`, whole-model there
    (and at the preset's depth with whole_shallow): see the module docstring and COMMANDS["compile"]. partial:
    write the receipt there after every run. deadline_s: stop a whole-model run early enough to finish by then
    (its time is then a lower bound, marked as such). warm_runs: warm processes, whose medians the bars read."""
    start = time.time()
    from tqdm.auto import tqdm

    from megacpp_lab.model.config import hybrid_preset
    from megacpp_lab.receipts import make_receipt

    interpret = device == "cpu"
    if caches is not None:
        caches.mkdir(parents=True, exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix="megacpp-compile-", dir=caches))
    base = Run("", "", preset=preset, B=B, T=T, docs=docs, backend=backend, device=device)
    shallow = hybrid_preset(preset).n_layers
    mega = root / "regional.megacache"
    # the runs the bars read first; then the whole-model run at depth, stopped at its cap or at the deadline;
    # last, the two that only explain (Mega-Cache, one process), stopped at the deadline if it comes first
    plan = [
        ("regional cold", root / "regional", Run("regional cold", "regional", steps=steps, warmup=warmup,
                                                 doc_counts=doc_counts, megacache_save=str(mega), eager_after=True,
                                                 trace_dir=str(trace_dir) if trace_dir else None), None),  # fmt: skip
        ("regional warm", root / "regional", Run("regional warm", "regional"), None),
        (f"regional cold {deep_layers} layers", root / "regional-deep", Run(f"regional cold {deep_layers} layers", "regional",
                                                                            n_layers=deep_layers), None),  # fmt: skip
        (f"whole-model cold {deep_layers} layers", root / "whole-deep", Run(f"whole-model cold {deep_layers} layers", "whole",
                                                                            n_layers=deep_layers), f"regional cold {deep_layers} layers"),  # fmt: skip
    ] + ([("whole-model cold", root / "whole", Run("whole-model cold", "whole"), "regional cold")] if whole_shallow else []) + [
        ("regional from Mega-Cache", root / "megacache", Run("regional from Mega-Cache", "regional", megacache_load=str(mega),
                                                               saved_graphs=False), None),  # fmt: skip
        ("regional cold, one process", root / "regional-serial", Run("regional cold, one process", "regional",
                                                                       compile_workers=0, saved_graphs=False), None),  # fmt: skip
    ]
    never_stopped = {"regional cold", "regional warm", f"regional cold {deep_layers} layers"}  # their times are the bars
    bytecode = bytecode_cache(root)
    rows: dict[str, dict[str, Any]] = {}
    skipped: dict[str, str] = {}
    receipt: dict[str, Any] = {}
    for name, cache, run, capped_by in tqdm(plan, desc=f"compile {preset} B={B} T={T}", disable=not progress):
        run = replace(run, preset=base.preset, B=B, T=T, docs=docs, backend=backend, device=device)
        if run.megacache_load and not Path(run.megacache_load).is_file():
            skipped[name] = f"torch.compiler.save_cache_artifacts() returned nothing to carry (backend {backend})"
            continue
        if run.compile_workers == 0 and backend != "inductor":
            skipped[name] = f"compile workers fill inductor's caches: with backend {backend} 'regional cold' runs in one process"
            continue
        cap = WHOLE_CAP_FACTOR * first_step_seconds(rows[capped_by]) if capped_by and capped_by in rows else None
        timeout = deadline_s - (time.time() - start) - 15 if deadline_s is not None and name not in never_stopped else None
        if timeout is not None and timeout < 30:
            skipped[name] = f"the run's deadline ({deadline_s:g} s) came first"
            continue
        launch = functools.partial(launch_contender, replace(run, first_step_cap_s=cap), cache, timeout=timeout,
                                   interpret=interpret, bytecode=Path(bytecode["cache"]) if bytecode["cache"] else None)  # fmt: skip
        rows[name] = median_run([launch() for _ in range(warm_runs)]) if name == "regional warm" else launch()
        if "eager" in rows[name]:
            rows[EAGER] = {"contender": EAGER, "mode": "eager", "preset": preset, **rows[name].pop("eager")}
        if cap is not None:
            rows[name]["cap_s"] = cap
        receipt = compile_receipt(rows, skipped, preset=preset, B=B, T=T, docs=docs, device=device, backend=backend,
                           shallow=shallow, deep=deep_layers, make_receipt=make_receipt, bytecode=bytecode)  # fmt: skip
        if partial is not None:
            partial.parent.mkdir(parents=True, exist_ok=True)
            partial.write_text(json.dumps(receipt, indent=1) + "\n")
    import shutil

    shutil.rmtree(root, ignore_errors=True)  # the runs' caches and result files: gigabytes at base size
    return receipt


def compile_receipt(rows: dict[str, dict[str, Any]], skipped: dict[str, str], *, preset: str, B: int, T: int, docs: int, device: str, backend: str,
             shallow: int, deep: int, make_receipt: Any, bytecode: dict[str, Any] | None = None) -> dict[str, Any]:  # fmt: skip
    eager, cold = rows.get(EAGER), rows.get("regional cold")
    warm, deep_r = rows.get("regional warm"), rows.get(f"regional cold {deep} layers")
    serial = rows.get("regional cold, one process")
    deep_w = rows.get(f"whole-model cold {deep} layers")
    summary: dict[str, Any] = {"contenders": len(rows), "skipped": skipped, "python_bytecode": bytecode}
    bar: dict[str, bool] = {}
    if cold:
        summary["regional_cold_first_step_s"] = cold["first_step_s"]
        bar[f"cold: regional first step at {shallow} layers <= {BARS['cold_s']:g} s"] = cold["first_step_s"] <= BARS["cold_s"]
        if "recompiles_with_grad" in cold:
            bar[f"zero recompiles over {cold['doc_counts']} documents per row, with and without gradients"] = (
                cold["recompiles_with_grad"] == 0 and cold["recompiles_without_grad"] == 0)  # fmt: skip
    if cold and serial:
        summary.update(regional_cold_one_process_first_step_s=first_step_seconds(serial),
                       one_process_is_lower_bound="first_step_s" not in serial,
                       workers_over_one_process=cold["first_step_s"] / first_step_seconds(serial))  # fmt: skip
    if warm:
        summary.update(warm_first_step_s=warm["first_step_s"], warm_total_s=warm["total_s"],
                       warm_inductor_start_s=warm.get("inductor_start_s"), warm_runs=warm.get("runs"))  # fmt: skip
        bar[f"warm: first compiled step <= {BARS['warm_first_step_s']:g} s"] = warm["first_step_s"] <= BARS["warm_first_step_s"]
        bar[f"warm: import, build and first step <= {BARS['warm_total_s']:g} s"] = warm["total_s"] <= BARS["warm_total_s"]
    if cold and deep_r:
        ratio = deep_r["first_step_s"] / cold["first_step_s"]
        summary["deep_over_shallow_regional"] = ratio
        bar[f"{deep} layers: regional cold first step <= {BARS['depth_ratio']:g}x that at {shallow}"] = ratio <= BARS["depth_ratio"]
    if deep_r and deep_w:
        whole = first_step_seconds(deep_w)
        summary["regional_over_whole_at_depth"] = deep_r["first_step_s"] / whole
        summary["whole_at_depth_is_lower_bound"] = "first_step_s" not in deep_w
        bar[f"{deep} layers: regional cold first step <= 1/3 of the whole-model's"] = deep_r["first_step_s"] <= whole * BARS["whole_fraction"]
    if eager and cold and "ms" in cold:
        summary.update(regional_step_over_eager=cold["ms"] / eager["ms"], regional_mfu=cold["mfu"],
                       regional_mfu_upper_bound=cold.get("mfu_upper_bound"))  # fmt: skip
        bar[f"compiled step <= {BARS['step_over_eager']:g}x eager"] = cold["ms"] <= BARS["step_over_eager"] * eager["ms"]
        bar[f"regional MFU >= {BARS['mfu']:.0%} of {PEAK_BF16_TFLOPS:g} TFLOP/s, attention FLOPs per document"] = (
            cold["mfu"] >= BARS["mfu"])  # fmt: skip
    summary["bar"] = bar
    return make_receipt(
        "compile_step", "compile", shape={"preset": preset, "B": B, "T": T, "docs": docs, "layers": shallow,
                                          "deep_layers": deep},  # fmt: skip
        dtype="bfloat16" if device == "cuda" else "float32", results=list(rows.values()), device=device,
        summary=summary, backend=backend, peak_bf16_tflops=PEAK_BF16_TFLOPS,
        notes=(
            "Every contender in a process of its own with its own inductor and Triton cache directories (but the eager "
            "baseline, timed in the regional cold run's process after it, on the same weights and batch): cold runs "
            "start with empty ones; 'regional warm' is a new process on the caches 'regional cold' left on disk, run "
            "warm_runs times in a row (runs: each one's times; first_step_s and total_s: their medians; the "
            "per-region breakdown: the median run's); "
            "'regional from Mega-Cache' starts with empty caches and loads the artifacts 'regional cold' saved "
            "(torch.compiler.save_cache_artifacts / load_cache_artifacts), as a fresh container would. "
            "The regional runs compile through saved graphs (ParallelConfig.saved_graphs, model/saved_graphs.py), as "
            "`train --compile` does: the cold run traces each block structure once with dynamo's ahead-of-time "
            "compile and saves the graph, a warm run loads it and traces nothing (saved_graphs: graphs loaded and "
            "compiled and their seconds; saved_graph_events: each graph; outside_saved_graphs_s: the rest of the "
            "first step). 'regional cold, one process' and the Mega-Cache run compile with torch.compile (saved graphs "
            "off): the first so that its compile splits by dynamo's phases, the second because Mega-Cache carries "
            "inductor's and AOTAutograd's caches, not saved graphs. import_s: "
            "from the launch of the process to the library imported; build_s: the model built and made ready "
            "(parallelize, which starts inductor in the process once: inductor_start_s of it, its imports and the system key every cache lookup includes, which the first graph's compile paid before) and the batch made; first_step_s: the first training step (forward to the fused loss, "
            "backward), which compiles, with the block structures but block 0's compiled at once by worker processes "
            "(ParallelConfig.compile_workers, model/precompile.py; compile_workers in a row: each worker's blocks, "
            "when the first step had it done, its compile threads), all in one process in 'regional cold, one "
            "process' (compile_workers=0), the per-region breakdown's source; compile_s: the first step less the median step where steps were timed, else "
            "the first step; total_s: launch to the end of the first step. compile: per region, from "
            "dynamo's CompilationMetrics, split by phase (dynamo trace, AOTAutograd's joint trace and partitioner, "
            "inductor's lowering, its code generation, the Triton compile of its kernels, autotuning), with the "
            "FX-graph and AOTAutograd cache hits; outside_dynamo_s: the rest of the first step (the lab's own Triton "
            "kernels compiling and autotuning at their first launch, and the step itself). triton_kernels_compiled: "
            "kernel binaries the run added to its Triton cache. Recompiles: graphs added by batches of doc_counts "
            "documents per row after the first step, with gradients, then without (no_grad_graphs: the graphs the "
            "first call without gradients adds: one per block structure, grad mode being part of dynamo's guards). "
            "A whole-model run is stopped cap_s = 3.05x the regional first step at its depth into its own first "
            "step (or earlier, at the run's deadline: stopped_by); stopped_at_s, the seconds of its first step it "
            "ran, is then a lower bound of its first step. ms: median of `steps` CUDA-event-timed steps (min and max "
            "beside it); mfu against 989 TFLOP/s (dense bf16), from HybridLM.flops_per_token with the batch's document "
            "lengths: attention over each document's causal triangle (what a document-sparse attention computes); "
            "mfu_upper_bound (and flops_per_token_upper_bound, tflops_upper_bound) counts attention over each row's "
            "whole causal triangle, the old formula's figure, which packed rows never compute. summary.python_bytecode: where the host writes no "
            "Python bytecode, every process (the contenders and their compile workers) gets a bytecode cache, "
            "compiled once before the first contender (primed_s), as a pip-installed torch carries its own."
        ),
    )  # fmt: skip


def run(out_root: str | Path | None = None, *, small: bool = False, trace: bool = True) -> list[Path]:
    from megacpp_lab.bench import bench_device, output_root
    from megacpp_lab.receipts import device_name, device_slug, write_receipt

    device = bench_device("compile", small)
    root = output_root(out_root, small)
    start = time.perf_counter()
    folder = root / device_slug(device_name(device)) / "compile"
    folder.mkdir(parents=True, exist_ok=True)
    kwargs: dict[str, Any] = dict(preset="tiny", B=1, T=32, docs=2, deep_layers=8, doc_counts=SMALL_DOC_COUNTS,
                                  steps=1, warmup=0, backend="aot_eager", warm_runs=1) if small else {}  # fmt: skip
    # a run that must end by a deadline (the device tool's ten-minute calls): the whole-model run at depth is
    # stopped in time to write the receipt
    if "MEGACPP_BENCH_DEADLINE_S" in os.environ:
        kwargs["deadline_s"] = float(os.environ["MEGACPP_BENCH_DEADLINE_S"])
    from megacpp_lab.bench import SMALL_OUT

    receipt = bench_compile(device=device, trace_dir=folder if trace else None, caches=SMALL_OUT if small else Path("build"),
                            partial=folder / "compile_step.partial.json", **kwargs)  # fmt: skip
    receipt["elapsed_s"] = time.perf_counter() - start
    written = [write_receipt(receipt, root)]
    (folder / "compile_step.partial.json").unlink(missing_ok=True)
    written.append(_plot(receipt, folder / "compile_step.png"))
    if trace:
        written += [folder / r["trace"] for r in receipt["results"] if "trace" in r]
    return written


def _plot(receipt: dict[str, Any], path: Path) -> Path:
    """Left: each region's cold compile split by phase, with the rest of the first step, compiled in one
    process (the serial contender). Right: the first step of every contender (cold with workers and in one
    process, warm, Mega-Cache, both depths), stopped runs hatched."""
    from matplotlib.figure import Figure

    from megacpp_lab.model.parallelize import PHASES

    rows = {r["contender"]: r for r in receipt["results"]}
    fig = Figure(figsize=(12, 4.2))
    left, right = fig.subplots(1, 2, gridspec_kw={"width_ratios": [1.2, 1]})
    cold = rows.get("regional cold, one process") or rows.get("regional cold")
    if cold and "compile" in cold:
        regions = cold["compile"]["per_region"]
        labels = ["+".join(r["structure"] or ["?"]) for r in regions]
        bottom = [0.0] * len(regions)
        for phase in PHASES:
            values = [r["phases_s"][phase] for r in regions]
            left.barh(labels, values, left=bottom, label=phase.replace("_", " "))
            bottom = [b + v for b, v in zip(bottom, values)]
        left.barh(["outside dynamo\n(lab kernels, step)"], [cold["outside_dynamo_s"]], color="0.5")
        left.set(xlabel="seconds of the cold first step", title=f"{cold['contender']}: by region and phase "
                 f"(first step {cold['first_step_s']:.1f} s)")  # fmt: skip
        left.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=4, frameon=False)
        left.invert_yaxis()
    names = [n for n in rows if rows[n]["mode"] != "eager"]
    values = [first_step_seconds(rows[n]) for n in names]
    bars = right.barh(names, values, color=["C3" if "whole" in n else "C0" for n in names])
    for b, n in zip(bars, names):
        if "stopped_at_s" in rows[n]:
            b.set_hatch("//")
        right.text(b.get_width(), b.get_y() + b.get_height() / 2, f" {b.get_width():.1f} s"
                   f"{' (stopped: at least)' if 'stopped_at_s' in rows[n] else ''}", va="center", fontsize=8)  # fmt: skip
    right.axvline(BARS["cold_s"], color="k", ls="--", lw=0.8)
    right.text(BARS["cold_s"], len(names) - 0.5, f" cold bar {BARS['cold_s']:g} s", fontsize=7, va="bottom")
    right.set(xlabel="first step, seconds (log)", xscale="log", title="first training step: cold, warm, depth")
    right.invert_yaxis()
    fig.suptitle(f"{receipt['device']}: {receipt['shape']['preset']} B={receipt['shape']['B']} T={receipt['shape']['T']}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return path


if __name__ == "__main__":  # one contender, in its own process: python -m megacpp_lab.bench.compile RUN.json OUT.json
    spec = json.loads(Path(sys.argv[1]).read_text())
    spec["doc_counts"] = tuple(spec["doc_counts"])
    _run(Run(**spec), Path(sys.argv[2]))
