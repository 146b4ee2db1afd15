"""Cold compile in parallel: the block structures compiled at once, in processes of their own.

Regional compile makes one graph per block structure (model/parallelize.py), and the first step compiles
them one after another: dynamo, AOTAutograd and inductor run on one thread of one process, and only the Triton
compile of inductor's kernels uses its workers. `precompile(model, tokens, ctx, targets)`, called once before
the first compiled step, hands every structure but the heaviest to worker processes, each of which builds the
same model, keeps only the blocks it was given, and runs one forward and backward on the same batch: their
graphs, their Triton kernels, the lab's own kernels and their autotuning land in the caches on disk
(inductor's FX-graph and AOTAutograd caches, Triton's). Meanwhile this process compiles the heaviest
structure itself (one block's forward and a backward to its input, no gradient kept, the random state
restored): a worker first spends seconds importing torch and building the model, so the longest compile is
done where none of that is paid. When the step then reaches a block of a worker's structure it waits for that
worker, traces the block with dynamo and finds every later stage in the caches. The step's graphs, guards and
kernels are the ones a serial compile makes (the caches are keyed by the graph and its inputs): only the wall
time differs.

Triton's compile of the generated kernels keeps every core of the host busy on its own (inductor's compile
workers), so what runs at once is the single-threaded part: dynamo, AOTAutograd and inductor's lowering and
code generation. parallelize also names every generated kernel `triton_`, so that a kernel two structures
share is one source and one compile.

A manifest in inductor's cache directory remembers a batch shape and model whose structures a run has
compiled: a later process (a warm start) starts no worker. One process only: under FSDP2 every rank compiles
for itself, and workers per rank would share the host's cores with each other.
"""

from __future__ import annotations

import atexit
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

__all__ = ["Precompile", "heaviest_block", "manifest_path", "precompile", "precompile_plan", "worker_count"]

_PACKAGE = Path(__file__).resolve().parents[1]  # megacpp_lab/
_CONTEXT_TENSORS = ("doc_ids", "positions", "starts", "cu_seqlens", "cu_seqlens_host", "seq_index", "longest_first")
# dynamo's marks on an input tensor (mark_dynamic, maybe_mark_dynamic, mark_unbacked): part of what it traces
_MARKS = ("_dynamo_dynamic_indices", "_dynamo_weak_dynamic_indices", "_dynamo_unbacked_indices")


def worker_count(limit: int, others: int, cpus: int | None = None) -> int:
    """Worker processes for `others` structures: at most `limit` (ParallelConfig.compile_workers), and one per
    two cores beyond this process's own two (each compiles on one thread and starts Triton compiles)."""
    cpus = os.cpu_count() or 1 if cpus is None else cpus
    return max(0, min(limit, others, cpus // 2 - 1))


def _first_blocks(model: nn.Module) -> list[int]:
    """The first block of every (structure, remat budget): one compiled graph each."""
    from megacpp_lab.model.checkpointing import block_budget
    from megacpp_lab.model.parallelize import structure_keys

    first: dict[Any, int] = {}
    for i, (key, block) in enumerate(zip(structure_keys(model), model.blocks)):
        first.setdefault((key, block_budget(block)), i)
    return list(first.values())


def heaviest_block(model: nn.Module) -> int:
    """The first block of the structure with the most modules (the largest graph: Engram on M, say): this
    process compiles it itself while the workers start. The earliest on a tie."""
    return max(_first_blocks(model), key=lambda i: (len(list(model.blocks[i].modules())), -i))


def precompile_plan(model: nn.Module, workers: int) -> list[list[int]]:
    """The blocks each worker compiles: the first block of every (structure, remat budget) but the heaviest
    (this process compiles that one), dealt out in block order to `workers` lists."""
    own = heaviest_block(model)
    blocks = [i for i in _first_blocks(model) if i != own]
    if workers < 1 or not blocks:
        return []
    return [blocks[w::workers] for w in range(min(workers, len(blocks)))]


@dataclass
class Precompile:
    """The workers of one precompile: which blocks each compiles, and each worker's wall time when it is done."""

    plan: list[list[int]]
    manifest: Path
    own: int = 0  # the block this process compiled itself, before the step
    own_s: float | None = None  # how long that took
    started: float = field(default_factory=time.perf_counter)
    procs: list[subprocess.Popen] = field(default_factory=list)
    logs: list[Path] = field(default_factory=list)
    seconds: list[float | None] = field(default_factory=list)
    threads: int = 0  # each worker's inductor compile threads
    reports: list[dict[str, Any] | None] = field(default_factory=list)  # each worker's timeline (_worker)
    workdir: tempfile.TemporaryDirectory | None = None

    @property
    def compile_order(self) -> list[int]:
        """The first blocks of the structures in the order this process's dynamo compiles them: its own, then
        the others as the step reaches them."""
        return [self.own, *sorted(i for blocks in self.plan for i in blocks)]

    def structures_in_compile_order(self, model: nn.Module) -> list[tuple[tuple[str, ...], int]]:
        """block_structures(model)'s (structure, blocks) pairs in compile_order: how compile_breakdown reads
        this process's compile records."""
        from megacpp_lab.model.parallelize import block_structures, structure_keys

        keys, count = structure_keys(model), block_structures(model)
        return list(dict.fromkeys((keys[i], count[keys[i]]) for i in self.compile_order))

    def wait(self, worker: int) -> None:
        """Block until this worker is done; a worker that failed is an error naming its blocks and its log."""
        if self.seconds[worker] is not None:
            return
        # done when its report is written: the process then still takes seconds to exit (its compile pool's
        # shutdown), which the step need not wait for
        report, proc = self.logs[worker].with_suffix(".json"), self.procs[worker]
        while not report.is_file() and proc.poll() is None:
            time.sleep(0.02)
        code = 0 if report.is_file() else proc.wait()
        self.seconds[worker] = time.perf_counter() - self.started
        self.reports[worker] = json.loads(report.read_text()) if report.is_file() else None
        if code != 0:
            tail = self.logs[worker].read_text(errors="replace")[-3000:]
            raise RuntimeError(f"compile worker {worker} (blocks {self.plan[worker]}) exited with status {code}; set "
                               f"ParallelConfig.compile_workers=0 to compile in this process only. Its log:\n{tail}")
        if all(s is not None for s in self.seconds):
            self.manifest.parent.mkdir(parents=True, exist_ok=True)
            self.manifest.write_text(json.dumps({"blocks": self.plan, "seconds": self.seconds}) + "\n")
            if self.workdir is not None:
                self.workdir.cleanup()

    def wait_all(self) -> None:
        for w in range(len(self.procs)):
            self.wait(w)

    def close(self) -> None:
        """Stop the workers still running (a step that failed before it reached their blocks) and drop the files."""
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        if self.workdir is not None:
            self.workdir.cleanup()


def _dynamic_marks(ctx: Any) -> dict[str, dict[str, list[int]]]:
    """dynamo's dimension marks on the context's tensors, by tensor and mark."""
    return {name: {m: sorted(getattr(getattr(ctx, name), m)) for m in _MARKS if hasattr(getattr(ctx, name), m)}
            for name in _CONTEXT_TENSORS}  # fmt: skip


def _set_marks(ctx: Any, marks: dict[str, dict[str, list[int]]]) -> None:
    """The parent's marks on this context's tensors, no more and no fewer."""
    for name, tensor_marks in marks.items():
        tensor = getattr(ctx, name)
        for m in _MARKS:
            if hasattr(tensor, m):
                delattr(tensor, m)
        for m, dims in tensor_marks.items():
            setattr(tensor, m, set(dims))
        if tensor_marks:
            tensor._has_dynamo_dim_marking = True  # type: ignore[attr-defined]


def manifest_path(model: nn.Module, tokens: torch.Tensor, ctx: Any, targets: torch.Tensor | None) -> Path:
    """Where the manifest of this model, parallel config, batch shape, code, versions and Triton cache lives (in
    inductor's cache directory: clearing it clears the manifest; another TRITON_CACHE_DIR is another key)."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    from megacpp_lab.model.parallelize import model_fingerprint

    key = repr((model_fingerprint(model), tuple(tokens.shape), str(tokens.dtype), str(tokens.device),
                None if targets is None else tuple(targets.shape), _dynamic_marks(ctx), ctx.block_mask is not None,
                os.environ.get("TRITON_CACHE_DIR"), _dsa_phase(model)))  # fmt: skip
    return Path(cache_dir()) / "megacpp_precompiled" / (hashlib.sha256(key.encode()).hexdigest()[:24] + ".json")


def _dsa_phase(model: nn.Module) -> str | None:
    """The phase the model's DSA indexers are in (the training loop sets it before the first step), or None."""
    from megacpp_lab.nn.dsa import DSAIndexer

    return next((m.phase for m in model.modules() if isinstance(m, DSAIndexer)), None)


def precompile(model: nn.Module, tokens: torch.Tensor, ctx: Any, targets: torch.Tensor | None = None) -> Precompile | None:
    """Start the compile workers for this model's first compiled step on this batch (see the module
    docstring), and make every block of a worker's structures wait for that worker at its first call. Returns
    the workers' handle, or None when there is nothing to hand out: the model is not compiled with inductor,
    compile_workers is 0 or the host too small, the model has one structure, FSDP2 shards it, inductor's caches
    are off (force_disable_caches), or the manifest says an earlier run compiled this model on this batch shape
    (its graphs are in the caches). Once per model: a later call returns what the first returned."""
    import torch.distributed as dist

    config = getattr(model, "parallel_config", None)
    if config is None or not config.compile or config.backend != "inductor":
        return None
    if hasattr(model, "compile_job"):  # once per model: a later call (a later step) returns the first's answer
        return model.compile_job
    model.compile_job = None
    if dist.is_initialized() and dist.get_world_size() > 1:
        return None
    if getattr(torch._inductor.config, "force_disable_caches", False):  # what the workers compile would not be read
        return None
    others = len(_first_blocks(model)) - 1  # every structure but the one this process compiles
    plan = precompile_plan(model, worker_count(config.compile_workers, others))
    if not plan:
        return None
    # the context the step's blocks will see: on a GPU HybridLM adds the flex block mask before the blocks run, and
    # a saved graph's key says whether the context has one; compiled on the bare context, each structure missed
    # its graph at the step and was compiled again (bench compile at 7d4a5dc on the H200: [M, engram] twice, the
    # workers' R and M again in this process)
    ctx = model.attention_context(ctx)
    manifest = manifest_path(model, tokens, ctx, targets)
    if manifest.exists():
        return None
    work = tempfile.TemporaryDirectory(prefix="megacpp-precompile-")
    spec = Path(work.name) / "spec.pt"
    torch.save({"config": model.config, "parallel": config, "device": tokens.device.type,
                "tokens": tokens.cpu(), "targets": None if targets is None else targets.cpu(),
                "doc_ids": ctx.doc_ids.cpu(),
                "marks": _dynamic_marks(ctx), "block_mask": ctx.block_mask is not None,
                "dsa_phase": _dsa_phase(model)}, spec)  # fmt: skip
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(_PACKAGE.parent), *filter(None, [env.get("PYTHONPATH")])])
    # every worker's inductor compiles its Triton kernels on as many threads as this process: the processes'
    # Triton compiles come in bursts at different times, and a worker held to its share of the cores (four of
    # sixteen, for three workers) took two to three times as long for its structure as this process on an H100 host
    threads = max(1, int(torch._inductor.config.compile_threads or os.cpu_count() or 1))
    env["TORCHINDUCTOR_COMPILE_THREADS"] = str(threads)
    job = Precompile(plan, manifest, threads=threads, workdir=work)
    for w, blocks in enumerate(plan):
        log = Path(work.name) / f"worker{w}.log"
        with log.open("w") as fh:
            job.procs.append(subprocess.Popen([sys.executable, "-m", "megacpp_lab.model.precompile", str(spec),
                                               ",".join(map(str, blocks)), str(log.with_suffix(".json")), str(time.time())],
                                              env=env, stdout=fh, stderr=subprocess.STDOUT))  # fmt: skip
        job.logs.append(log)
        job.seconds.append(None)
        job.reports.append(None)
    atexit.register(job.close)
    model.compile_job = job
    _wait_at_first_call(model, job)
    job.own = heaviest_block(model)
    t0 = time.perf_counter()
    _compile_here(model, job.own, tokens, ctx)
    job.own_s = time.perf_counter() - t0
    return job


def _compile_here(model: nn.Module, index: int, tokens: torch.Tensor, ctx: Any) -> None:
    """Compile block `index`'s structure in this process: its forward on the embedding of the batch (a block's
    input: the same shape, dtype, strides and grad mode), then a backward to that input alone, which runs the
    compiled backward graph and leaves no gradient on any parameter. The random state is restored."""
    from megacpp_lab.nn.hyper_connections import expand_streams

    devices = [tokens.device] if tokens.is_cuda else []
    with torch.random.fork_rng(devices=devices):
        x = model.embed(tokens)
        if model.config.mhc:
            x = expand_streams(x, model.config.hyper.n_streams)
        out = model.blocks[index](x, tokens, ctx)
        torch.autograd.grad(out, x, torch.ones_like(out))


def _wait_at_first_call(model: nn.Module, job: Precompile) -> None:
    """Every block of a worker's structures, at its first call, waits for that worker and then runs compiled
    (its saved-graph forward, or torch.compile's entry: whichever apply_compile installed)."""
    from megacpp_lab.model.checkpointing import block_budget
    from megacpp_lab.model.parallelize import structure_keys

    keys = [(k, block_budget(b)) for k, b in zip(structure_keys(model), model.blocks)]
    owner = {keys[i]: w for w, blocks in enumerate(job.plan) for i in blocks}
    for key, block in zip(keys, model.blocks):
        if key not in owner:
            continue
        attr = "forward" if "forward" in vars(block) else "_compiled_call_impl"
        compiled = getattr(block, attr)

        def first_call(*args: Any, _w: int = owner[key], _block: nn.Module = block, _fn: Any = compiled,
                       _attr: str = attr, **kwargs: Any) -> Any:  # fmt: skip
            job.wait(_w)
            setattr(_block, _attr, _fn)
            return _fn(*args, **kwargs)

        setattr(block, attr, first_call)


def _worker(spec_path: str, blocks: list[int], report: Path, launched_at: float) -> None:
    """Build the model as the parent did, keep the given blocks, and run one forward and backward on its batch;
    write when each stage ended, in seconds since the launch, to `report`."""
    imported = time.time()
    from megacpp_lab.model.hybrid import HybridLM
    from megacpp_lab.model.parallelize import parallelize
    from megacpp_lab.varlen import build_context

    spec = torch.load(spec_path, weights_only=False)
    device = spec["device"]
    parallel = spec["parallel"]
    with torch.device(device):
        model = HybridLM(spec["config"]).to(device)
    parallelize(model, parallel, device=device, fsdp=False)
    if spec["dsa_phase"] is not None:  # a DSA layer compiles the phase the parent's first step runs
        from megacpp_lab.nn.dsa import set_dsa_phase

        set_dsa_phase(model, spec["dsa_phase"])
    built = time.time()
    model.blocks = nn.ModuleList(model.blocks[i] for i in blocks)  # after parallelize: the budgets are the model's
    ctx = build_context(spec["doc_ids"].to(device), block_mask=spec["block_mask"])
    _set_marks(ctx, spec["marks"])
    targets = None if spec["targets"] is None else spec["targets"].to(device)
    model.train()
    out = model(spec["tokens"].to(device), ctx, targets)
    out.loss.backward()
    if device == "cuda":
        torch.cuda.synchronize()
    done = time.time()
    partial = report.with_suffix(".tmp")  # renamed into place: the parent never reads half a report
    partial.write_text(json.dumps({"blocks": blocks, "torch_imported_s": imported - launched_at,
                                   "built_s": built - launched_at, "compiled_s": done - launched_at}) + "\n")
    partial.replace(report)


if __name__ == "__main__":  # python -m megacpp_lab.model.precompile SPEC BLOCKS REPORT LAUNCHED_AT
    _worker(sys.argv[1], [int(i) for i in sys.argv[2].split(",")], Path(sys.argv[3]), float(sys.argv[4]))
