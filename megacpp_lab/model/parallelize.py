"""The one way a HybridLM is made ready to run: `parallelize(model, config)`, torchtitan's
`parallelize_llama` for this model. It applies, in this order and in this place only,

    precision  one in-place cast (bf16 on a GPU, the fp32 contract kept; model/precision.py), or, under FSDP2,
               its MixedPrecisionPolicy (apply_fsdp, below)
    apply_ac   the activation-checkpointing policy (model/checkpointing.py): eager wrappers, or under regional
               compile one activation_memory_budget per block structure
    apply_compile  regional compile: every block compiled on its own
    apply_fsdp FSDP2 over the blocks, when the run has several processes

each still a small public function. `ParallelConfig` is the one frozen config that drives it: TrainConfig holds
it (TrainConfig.parallel) and every bench reads it.

Regional compile: every block is compiled on its own (`block.compile(fullgraph=True)`), not the whole
model. Blocks of one structure (the same letter and the same branches) run the same code on the same
shapes, so dynamo traces Block.forward once per structure and every other block of that structure reuses
the graph: a 12-layer `base` model compiles four graphs (A, M, R, M with Engram), not twelve. The scans
(SSD, M2RNN) stay opaque `megacpp::` custom ops, and the batch's PackedContext comes in as an argument
whose cu_seqlens build_context marks dynamic, so a new number of documents per row reuses the graphs.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from megacpp_lab.checks import check_int, is_int
from megacpp_lab.model.precision import PrecisionPlan, apply_precision
from megacpp_lab.nn.config_builder import option
from megacpp_lab.source_key import source_digest

if TYPE_CHECKING:
    from megacpp_lab.model.checkpointing import CheckpointingPolicy

# checkpointing.py (which imports the model, and through it the kernels) is imported where a policy is read or
# applied, not here: ParallelConfig's fields generate the CLI's options, and building the parser stays light

__all__ = ["PHASES", "CompileStats", "ParallelConfig", "apply_compile", "apply_fsdp", "block_structures",
           "compile_breakdown", "compile_stats", "describe_compile", "fp32_contract_params", "fsdp_groups", "graphs_needed", "model_fingerprint", "parallelize",
           "ready_inductor", "structure_keys"]

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
# aot_eager_decomp_partition: AOTAutograd's min-cut partitioner (which reads the remat budget) without inductor
BACKENDS = ("inductor", "aot_eager", "aot_eager_decomp_partition", "eager")


@dataclass(frozen=True)
class ParallelConfig:
    """How parallelize makes a model ready: precision, the activation-checkpointing policy, compile, FSDP2.
    Frozen, checked on construction (the error names the field)."""

    dtype: str = option("auto", "auto, bf16 or fp32", shown="auto: bf16 on a GPU with fp32 master weights, fp32 on a CPU")
    # the activation-checkpointing policy, as text (CheckpointingPolicy.parse): "none"; "full"; a save list
    # "mm+addmm" (eager); a budget "0.3" or per kind "A=1.0,M=0.3,R=1.0" (inductor's activation_memory_budget,
    # under compile). The last block is never checkpointed.
    remat: str = option("none", "activation checkpointing: none, full, a save list (mm+addmm), or with --compile a "
                                "budget (0.3) or one per block kind (A=1.0,M=0.3,R=1.0); the last block never")  # fmt: skip
    compile: bool = option(False, "regional torch.compile of every block")
    backend: str = "inductor"  # the compile backend; aot_eager / eager: dynamo's graphs without inductor
    # FSDP2 (several processes): free each block's gathered bf16 weights after its forward and gather them again
    # for its backward. Off: the gathered weights stay to the backward (ZeRO-2's memory for them: 0.2 GB a GPU
    # at base), which saves an all-gather per block and, more, its host time in a step the host must keep fed
    reshard_after_forward: bool = option(False, "with --nproc > 1: free each block's gathered weights after its "
                                                "forward and gather them again for its backward (less memory; one "
                                                "more all-gather per block, and its host time, in every backward)")  # fmt: skip
    # FSDP2: consecutive blocks sharded as one group (fewer collectives and hooks)
    fsdp_blocks_per_group: int = option(1, "with --nproc > 1: consecutive blocks sharded as one FSDP2 group")
    # the cold compile's worker processes: the block structures compiled at once (model/precompile.py), at most
    # one per two cores; 0: every structure compiled in this process, one after another
    compile_workers: int = option(8, "with --compile: processes that compile the block structures at once on a "
                                     "cold start, at most one per two cores; 0 = all in this process")  # fmt: skip
    # regional compile through saved graphs (model/saved_graphs.py): each block structure's graph is traced once,
    # saved, and loaded by later processes instead of traced again; one process only (FSDP2 keeps torch.compile)
    saved_graphs: bool = option(True, "with --compile: save each block structure's compiled graph and load it in "
                                      "later runs instead of tracing it again (one process; FSDP2 traces)")  # fmt: skip

    def __post_init__(self) -> None:
        def fail(name: str, expected: str) -> ValueError:
            return ValueError(f"ParallelConfig.{name} must be {expected}, got {getattr(self, name)!r}")

        if self.dtype not in ("auto", *DTYPES):
            raise fail("dtype", f"'auto' or one of {tuple(DTYPES)}")
        for name in ("compile", "reshard_after_forward", "saved_graphs"):
            if not isinstance(getattr(self, name), bool):
                raise fail(name, "a bool")
        if self.backend not in BACKENDS:
            raise fail("backend", f"one of {BACKENDS}")
        check_int("ParallelConfig", "fsdp_blocks_per_group", self.fsdp_blocks_per_group, low=1)
        check_int("ParallelConfig", "compile_workers", self.compile_workers, low=0)
        try:
            policy = self.policy
        except ValueError as err:
            raise ValueError(f"ParallelConfig.remat: {err}") from None
        if policy.is_budget and not self.compile:
            raise ValueError(f"ParallelConfig.remat {self.remat!r} holds a budget, which only regional compile reads "
                             "(inductor's activation_memory_budget): set compile, or give 'none', 'full' or an op list")
        if policy.is_eager and self.compile:
            raise ValueError(f"ParallelConfig.remat {self.remat!r} holds an eager-only lever (an op list, offload or "
                             "compact), which regional compile does not apply: under compile the budget is the single "
                             "authority; give a budget in [0, 1] (or 'none' / 'full')")  # fmt: skip
        object.__setattr__(self, "remat", policy.spec)  # one spelling: '0.30' and '0.3' are one policy

    @classmethod
    def build(cls, source: Any = None, **overrides: Any) -> ParallelConfig:
        """Fields from a source (a mapping, or an object with these attributes), then keyword overrides, else
        the defaults; an override of None means "not given". Unknown fields are refused, named."""
        from types import SimpleNamespace

        from megacpp_lab.nn.config_builder import build_config

        if isinstance(source, dict):
            source = SimpleNamespace(**source)
        given = {k: v for k, v in overrides.items() if v is not None}
        return build_config(cls, source, given, prefix="parallel", aliases={}, required=())

    @property
    def policy(self) -> CheckpointingPolicy:
        from megacpp_lab.model.checkpointing import CheckpointingPolicy

        return CheckpointingPolicy.parse(self.remat)

    def resolve_dtype(self, device: str) -> torch.dtype:
        """The forward's dtype on this device ('auto': bf16 on a GPU, fp32 on a CPU)."""
        if self.dtype == "auto":
            return torch.bfloat16 if device == "cuda" else torch.float32
        return DTYPES[self.dtype]


def _hybrid(model: nn.Module) -> nn.Module:
    if not hasattr(model, "blocks") or not hasattr(model, "config"):
        raise TypeError(f"expected a HybridLM, got {type(model).__name__}")
    return model


def parallelize(model: nn.Module, config: ParallelConfig, *, device: str | None = None, fsdp: bool | None = None,
                mesh: Any = None) -> nn.Module:  # fmt: skip
    """Make a plain fp32 HybridLM ready to run, in place, and return it: precision, then activation
    checkpointing, then regional compile, then FSDP2 (see the module docstring).

    device: where the model lives (default: its parameters' device). fsdp: shard with FSDP2 (default: when a
    process group of more than one rank is initialised). The precision plan is kept as `model.precision_plan`
    (None when the model stays fp32 or FSDP2 casts)."""
    import torch.distributed as dist

    lm = _hybrid(model)
    if not isinstance(config, ParallelConfig):
        raise TypeError(f"parallelize needs a ParallelConfig, got {type(config).__name__}")
    low = sorted(n for n, p in lm.named_parameters() if p.dtype != torch.float32)
    if low:
        raise ValueError(f"parallelize takes a plain fp32 model, but {low[:3]} ({len(low)} in all) are not fp32: it "
                         "applies the precision itself, once")  # fmt: skip
    device = device or next(lm.parameters()).device.type
    if fsdp is None:
        fsdp = dist.is_initialized() and dist.get_world_size() > 1
    if not fsdp:  # FSDP2's own knobs: one process would silently run without them
        defaults = {f.name: f.default for f in dataclasses.fields(ParallelConfig)}
        for name in ("reshard_after_forward", "fsdp_blocks_per_group"):
            default = defaults[name]
            if getattr(config, name) != default:
                raise ValueError(f"ParallelConfig.{name} ({getattr(config, name)!r}) applies to FSDP2 over several "
                                 f"processes (--nproc > 1); this model is not sharded: leave it at {default!r}")
    dtype = config.resolve_dtype(device)
    plan: PrecisionPlan | None = None
    if dtype != torch.float32 and not fsdp:
        plan = apply_precision(lm, dtype)
    lm.precision_plan = plan
    lm.parallel_config = config  # what precompile's workers build again
    if config.remat != "none":  # the policy's one spelling (ParallelConfig normalises it)
        from megacpp_lab.model.checkpointing import apply_ac

        apply_ac(lm, config.policy, compiled=config.compile)
    if config.compile:
        apply_compile(lm, backend=config.backend, saved_graphs=config.saved_graphs and not fsdp)
    if fsdp:
        low_dtype = dtype if dtype != torch.float32 else None
        apply_fsdp(lm, mesh=mesh, param_dtype=low_dtype, reduce_dtype=torch.float32 if low_dtype is not None else None,
                   reshard_after_forward=config.reshard_after_forward, blocks_per_group=config.fsdp_blocks_per_group)
    return model


def structure_keys(lm: nn.Module) -> list[tuple[str, ...]]:
    """Each block's structure, in block order (see block_structures)."""
    streams = ("streams",) if lm.config.mhc else ()  # the stack's blocks only: an MTP block reads one stream
    return [(block.kind, *(("dsa",) if getattr(block.mixer, "indexer", None) is not None else ()),
             *(n for n in ("engram", "ngram", "cblock") if getattr(block, n) is not None),
             *(("mhc",) if block.hc is not None else ()), *(streams if i < len(lm.blocks) else ()))
            for i, block in enumerate(lm.all_blocks())]  # fmt: skip


def block_structures(model: nn.Module) -> Counter[tuple[str, ...]]:
    """How many blocks share each structure: (letter, 'dsa' for a sparse A, its optional branches..., 'mhc' when the block has
    hyper-connections, 'streams' when the residual is mHC's [B,T,n,d]). One compiled graph per structure."""
    return Counter(structure_keys(_hybrid(model)))


def graphs_needed(model: nn.Module) -> int:
    """The compiled graphs regional compile makes of this model, all of them entries of one code object's
    cache (Block.forward's): one per block structure, plus one where a block of a structure carries a remat
    budget of its own (the last block: never recomputed), one more per DSA structure (its indexer's two phases,
    nn/dsa.py), and all of that twice, with gradients (training)
    and without (validation under no_grad in eval mode: grad mode is part of dynamo's guards). Batches with
    other numbers of documents add none (tests/test_recompiles.py)."""
    from megacpp_lab.model.checkpointing import block_budget

    lm = _hybrid(model)
    keys = set((s, block_budget(b)) for s, b in zip(structure_keys(lm), lm.all_blocks()))
    # a DSA block guards on its indexer's phase: the warm-up's graph, then the sparse phase's
    return 2 * (len(keys) + sum(1 for s, _ in keys if "dsa" in s))


def apply_compile(model: nn.Module, *, fullgraph: bool = True, saved_graphs: bool = False,
                  **compile_kwargs: Any) -> nn.Module:  # fmt: skip
    """Compile every block of the model on its own, in place (torchtitan's per-block compile), and return
    the model. fullgraph=True: a graph break is an error, not a silent split.

    saved_graphs=True: every block's forward runs through the model's SavedGraphs (model/saved_graphs.py,
    kept as `model.saved_graphs`): one graph per structure, traced once by dynamo's ahead-of-time compile and
    saved, and loaded instead of traced by a later process. It needs fullgraph and a single-process model, and
    applies to the inductor backend (the others' graphs are not saved: they compile with torch.compile).

    Every graph is an entry of Block.forward's cache, and past dynamo's recompile_limit dynamo stops compiling
    and runs the frame eager with a warning: the silent fallback the lab refuses. So the graphs this model
    needs (graphs_needed) are counted here, before any compile, and the limit is raised to that count when it
    is lower: a guard failure beyond the model's own graphs still meets the limit."""
    lm = _hybrid(model)
    needed = graphs_needed(lm)
    if needed > torch._dynamo.config.recompile_limit:
        torch._dynamo.config.recompile_limit = needed
    from megacpp_lab.model.checkpointing import AC_ATTR

    wrapped = [i for i, b in enumerate(lm.all_blocks()) if any(hasattr(m, AC_ATTR) for m in b.modules())]
    if wrapped:
        raise ValueError(f"blocks {wrapped} hold manual checkpoint wrappers (apply_ac without compiled=True); under "
                         "regional compile the activation_memory_budget is the single authority: build the model "
                         "again and call apply_ac(model, policy, compiled=True) before apply_compile")  # fmt: skip
    backend = compile_kwargs.get("backend", "inductor")
    _cache_compiles(backend)
    if saved_graphs and backend == "inductor":
        from megacpp_lab.model.saved_graphs import SavedForward, SavedGraphs

        if not fullgraph or set(compile_kwargs) - {"backend"}:
            raise ValueError(f"saved_graphs compiles whole blocks with the backend alone: fullgraph={fullgraph}, "
                             f"other options {sorted(set(compile_kwargs) - {'backend'})}")  # fmt: skip
        lm.saved_graphs = SavedGraphs(model_fingerprint(lm), backend=backend)
        for block, structure in zip(lm.all_blocks(), structure_keys(lm)):
            if _attends_through_flex(block):  # a loaded graph holding flex fails (below): compiled as usual
                _compile_block(block, fullgraph, compile_kwargs)
            else:
                block.forward = SavedForward(block, structure, lm.saved_graphs)
        return model
    for block in lm.all_blocks():
        _compile_block(block, fullgraph, compile_kwargs)
    return model


def _attends_through_flex(block: nn.Module) -> bool:
    """Whether the block's attention runs flex_attention (MultiLatentAttention.attends_through_flex). Their
    saved graphs are not used: on an H200 (torch 2.11) loading one in another process failed with "TracingContext.get()
    must be called within an ongoing trace" (flex's graph does not survive save and load)."""
    from megacpp_lab.nn.mla import MultiLatentAttention

    mixer = getattr(block, "mixer", None)
    if not isinstance(mixer, MultiLatentAttention):
        return False
    return mixer.attends_through_flex(mixer.w_o.weight.device)


def _compile_block(block: nn.Module, fullgraph: bool, compile_kwargs: dict[str, Any]) -> None:
    """torch.compile the block in place, its remat budget read by the partitioner when its graph compiles."""
    from megacpp_lab.model.checkpointing import block_budget

    budget = block_budget(block)
    if budget is None:
        block.compile(fullgraph=fullgraph, **compile_kwargs)
    else:  # the partitioner reads the budget when this block's graph compiles (its first call)
        block._compiled_call_impl = _with_budget(torch.compile(block._call_impl, fullgraph=fullgraph, **compile_kwargs),
                                                 budget)  # fmt: skip


def model_fingerprint(lm: nn.Module) -> str:
    """What a compiled graph of this model depends on beyond its inputs: the model's and the parallel config,
    the device, torch's and Triton's versions, the Triton interpreter flag and the lab's source (a changed
    kernel or block changes the graphs). Precompile's manifest and the saved graphs are keyed by it."""
    import hashlib
    import os

    import triton

    param = next(lm.parameters())
    device = torch.cuda.get_device_name(param.device) if param.is_cuda else param.device.type
    text = repr((lm.config, getattr(lm, "parallel_config", None), device, torch.__version__, triton.__version__,
                 os.environ.get("TRITON_INTERPRET", "0"), source_digest()))  # fmt: skip
    return hashlib.sha256(text.encode()).hexdigest()


def _cache_compiles(backend: Any) -> None:
    """What a warm restart needs to hit every cache, and a cold start to use inductor's compile workers:
    AOTAutogradCache refuses a graph that holds a custom autograd.Function (FusedDownNormUp, in every A block)
    unless it is allowed to cache them, and then re-traces the joint graph in every new process; and the
    workers that compile inductor's Triton kernels start now, while dynamo traces the first block, not when
    the first kernel waits for them."""
    functorch = torch._functorch.config
    if hasattr(functorch, "autograd_cache_allow_custom_autograd_functions"):  # the lab's Functions are pure
        functorch.autograd_cache_allow_custom_autograd_functions = True
    if backend == "inductor":
        # every generated Triton kernel is named `triton_`, not triton_<kind>_<ops>_<n> with n its place in its
        # graph: a kernel two block structures share (the MLP's, the norms', M's in M and M+Engram) is then
        # one source, which Triton's cache compiles once, not once per structure. Profiler traces show the
        # kernels as `triton_` (inductor keeps the descriptive name in each kernel's metadata)
        torch._inductor.config.triton.unique_kernel_names = False
        from torch._inductor.async_compile import AsyncCompile

        if hasattr(AsyncCompile, "warm_pool"):
            AsyncCompile.warm_pool()
        ready_inductor()


@functools.cache
def ready_inductor() -> float:
    """Start inductor in this process, once, and return how long that took (the first call's seconds, on
    every call): import it, with its lowerings, kernel templates and decompositions, and compute the system
    key that every FX-graph and AOTAutograd cache lookup includes (it hashes Triton's sources and libraries).

    A process pays this once, whichever graph it compiles first. apply_compile calls it when the model is made
    compile-ready, so a warm start's first step holds the model's own compile (dynamo tracing every block
    structure and the cache lookups) and the console and `bench compile` report the start-up on its own, not
    folded into the first graph's AOTAutograd time. It moves the seconds; it does not remove them: `bench
    compile`'s warm total counts them."""
    t0 = time.perf_counter()
    import torch._inductor.compile_fx  # noqa: F401  (the lowerings, the scheduler, Triton codegen, the templates)
    from torch._inductor.codecache import CacheBase, torch_key

    CacheBase.get_system()  # both cached by inductor for the process: the lookups that follow reuse them
    torch_key()  # the hash of torch's own sources, in every cache key too
    return time.perf_counter() - t0


def _with_budget(fn: Any, budget: float) -> Any:
    # specialize_float: without it, the recompile for the last block's budget turns the budget into a symbolic
    # float (automatic dynamic), Block.forward's range check guards only 0 <= b <= 1, and that one graph,
    # partitioned at the last block's budget, then serves every block of the structure from the next step on.
    def call(*args: Any, **kwargs: Any) -> Any:
        with torch._functorch.config.patch(activation_memory_budget=budget), \
                torch._dynamo.config.patch(specialize_float=True):
            return fn(*args, **kwargs)

    return call


@dataclass(frozen=True)
class CompileStats:
    """dynamo's counters since the last `torch._dynamo.utils.counters.clear()`. Every graph dynamo compiles,
    a recompile after a guard failure included, adds one to `graphs`: after the first step of each block
    structure, a step that adds a graph has recompiled."""

    graphs: int  # graphs dynamo compiled (unique_graphs)
    graph_breaks: int
    aot_graphs: int  # graphs AOTAutograd compiled (forward, with its backward when gradients are needed)

    def __str__(self) -> str:
        return f"{self.graphs} graphs, {self.graph_breaks} graph breaks, {self.aot_graphs} AOT graphs"


def compile_stats() -> CompileStats:
    """Read dynamo's counters (torch._dynamo.utils.counters) into a CompileStats."""
    from torch._dynamo.utils import counters

    return CompileStats(
        graphs=int(counters["stats"]["unique_graphs"]),
        graph_breaks=int(sum(counters["graph_break"].values())),
        aot_graphs=int(counters["aot_autograd"]["total"]),
    )


# the phases of a cold compile, from the fields of dynamo's CompilationMetrics (each field holds the ones after it:
# the frame's whole compile > AOTAutograd > inductor > inductor's code generation > the Triton compile it waits on)
PHASES = ("dynamo_trace", "aot_autograd", "inductor_lowering", "inductor_codegen", "triton_compile", "autotune")
CACHE_FIELDS = ("inductor_fx_local_cache_hit_count", "inductor_fx_local_cache_miss_count",
                "aotautograd_local_cache_hit_count", "aotautograd_local_cache_miss_count")  # fmt: skip


def _seconds(m: Any, *keys: str) -> float | None:
    """The first of these CompilationMetrics fields that is set, in seconds (fields ending _us are microseconds)."""
    for key in keys:
        value = getattr(m, key, None)
        if value is not None:
            return float(value) / (1e6 if key.endswith("_us") else 1.0)
    return None


def _phases(fwd: Any, bwd: Any | None, runtime_s: float) -> dict[str, float]:
    """One region's compile split by phase, from its forward frame record and its lazily compiled backward's."""
    out = dict.fromkeys(PHASES, 0.0)
    entire = _seconds(fwd, "dynamo_cumulative_compile_time_us", "entire_frame_compile_time_s") or 0.0
    aot = _seconds(fwd, "aot_autograd_cumulative_compile_time_us", "backend_compile_time_s") or 0.0
    out["dynamo_trace"] = max(0.0, entire - aot)
    for m, whole in ((fwd, aot), (bwd, None)):
        if m is None:
            continue
        inductor = _seconds(m, "inductor_cumulative_compile_time_us", "inductor_compile_time_s") or 0.0
        codegen = _seconds(m, "inductor_code_gen_cumulative_compile_time_us", "code_gen_time_s") or 0.0
        triton = _seconds(m, "triton_compile_time_us") or 0.0
        if whole is not None:  # the forward record's AOTAutograd holds the joint trace and the partitioner
            out["aot_autograd"] += max(0.0, whole - inductor)
        out["inductor_lowering"] += max(0.0, inductor - codegen)
        out["inductor_codegen"] += max(0.0, codegen - triton)
        out["triton_compile"] += triton
        out["autotune"] += _seconds(m, "compile_time_autotune_time_us") or 0.0
    out["autotune"] += runtime_s
    return out


def compile_breakdown(structures: list[tuple[tuple[str, ...], int]], n_first: int,
                      metrics: list[Any] | None = None) -> dict[str, Any]:  # fmt: skip
    """Cold compile per region from dynamo's CompilationMetrics (torch._dynamo.utils.get_compilation_metrics,
    on torch 2.11 and 2.13): one forward frame compile per block structure (the k-th is the k-th structure
    in block order: they are compiled as the forward first reaches them), plus the lazily compiled backward
    of the same compile id where it is logged on its own (when AOTAutograd compiled it with the forward, the
    forward's time holds it), plus the runtime records of that id (kernels compiled or autotuned lazily at
    the first call; torch 2.11 logs them on a GPU). Each region's compile is split by phase (PHASES) and
    carries its FX-graph and AOTAutograd cache hits and misses. n_first: how many records the first step
    left; later ones are recompiles. metrics: dynamo's records (default: get_compilation_metrics())."""
    from torch._dynamo.utils import get_compilation_metrics

    metrics = get_compilation_metrics() if metrics is None else metrics

    def forward(ms: list[Any]) -> list[Any]:
        # frame compiles only: not the lazily compiled backward, nor a runtime record (torch 2.11 logs one per
        # compile id when the first call autotunes or lowers at run time, with no graph of its own)
        return [m for m in ms if getattr(m, "is_forward", True) is not False and getattr(m, "is_runtime", None) is not True]

    cold, late = forward(metrics[:n_first]), forward(metrics[n_first:])
    backward = {str(m.compile_id): m for m in metrics
                if getattr(m, "is_forward", True) is False and getattr(m, "is_runtime", None) is not True}  # fmt: skip
    runtime: dict[str, float] = {}  # lazy kernel compiles and autotuning at the first call, per compile id
    for m in metrics[:n_first]:
        if getattr(m, "is_runtime", None) is True:
            runtime[str(m.compile_id)] = runtime.get(str(m.compile_id), 0.0) + (_seconds(m, "duration_us") or 0.0)
    if not cold:
        raise RuntimeError("compiled=True, but torch._dynamo.utils.get_compilation_metrics() recorded no compile in "
                           "the first step: cannot report cold compile times")  # fmt: skip
    regions = []
    for i, m in enumerate(cold):
        cid = str(m.compile_id)
        fwd = _seconds(m, "entire_frame_compile_time_s", "duration_us", "dynamo_cumulative_compile_time_us")
        bwd_m = backward.get(cid)
        bwd = _seconds(bwd_m, "backward_cumulative_compile_time_us", "duration_us") if bwd_m is not None else None
        if fwd is None:
            raise RuntimeError(f"dynamo's record of compile {cid} holds no compile time")
        structure, blocks = structures[i] if len(cold) == len(structures) else (None, None)
        caches = {k.removesuffix("_count"): sum(int(getattr(r, k, None) or 0) for r in (m, bwd_m) if r is not None)
                  for k in CACHE_FIELDS}  # fmt: skip
        regions.append({"compile_id": cid, "structure": list(structure) if structure else None,
                        "blocks": blocks, "forward_s": fwd, "backward_s": bwd, "runtime_s": runtime.get(cid),
                        "cold_compile_s": fwd + (bwd or 0.0) + runtime.get(cid, 0.0),
                        "phases_s": _phases(m, bwd_m, runtime.get(cid, 0.0)), "caches": caches,
                        "graph_ops": getattr(m, "graph_op_count", None)})  # fmt: skip
    phases = {p: sum(r["phases_s"][p] for r in regions) for p in PHASES}
    caches = {k: sum(r["caches"][k] for r in regions) for k in regions[0]["caches"]}
    return {"per_region": regions, "cold_compile_s": sum(r["cold_compile_s"] for r in regions), "phases_s": phases,
            "caches": caches,
            "compiled_later": [{"compile_id": str(m.compile_id), "reason": getattr(m, "recompile_reason", None)}
                               for m in late],
            "source": "torch._dynamo.utils.get_compilation_metrics(): entire_frame_compile_time_s per forward frame "
                      "compile, backward_cumulative_compile_time_us per lazily compiled backward, duration_us of "
                      "the runtime records (lazy kernel compiles at the first call); phases from the cumulative "
                      "dynamo / AOTAutograd / inductor / code-generation / Triton-compile times, each holding the "
                      "next"}  # fmt: skip


def describe_compile(seconds: float, since: int = 0, metrics: list[Any] | None = None, model: nn.Module | None = None) -> str:
    """One console line for a first compiled step: how long it took and whether its compile was cold or warm:
    for a model with saved graphs (apply_compile(saved_graphs=True)), how many it loaded and how many it
    compiled; otherwise from the FX-graph and AOTAutograd cache hits of dynamo's records after the first
    `since` (torch._dynamo.utils.get_compilation_metrics())."""
    from torch._dynamo.utils import get_compilation_metrics

    start = (f"; inductor started in {ready_inductor():.1f} s before it, when the model was built"
             if ready_inductor.cache_info().currsize else "")  # fmt: skip
    saved = getattr(_hybrid(model), "saved_graphs", None) if model is not None else None
    if saved is not None:
        n = saved.summary()
        state = ("warm" if n["compiled"] == 0 else "cold" if n["loaded"] == 0 else "partly warm")
        return (f"{n['loaded'] + n['compiled']} block graphs ready in {seconds:.1f} s, {state}: {n['loaded']} loaded "
                f"from saved graphs in {n['loaded_s']:.1f} s, {n['compiled']} compiled and saved in "
                f"{n['compiled_s']:.1f} s{start}")  # fmt: skip

    records = (get_compilation_metrics() if metrics is None else metrics)[since:]
    count = {k: sum(int(getattr(m, k, None) or 0) for m in records) for k in CACHE_FIELDS}
    hits, misses = count["inductor_fx_local_cache_hit_count"], count["inductor_fx_local_cache_miss_count"]
    graphs = sum(1 for m in records if getattr(m, "is_forward", True) is not False and getattr(m, "is_runtime", None) is not True)
    if hits + misses == 0:
        state = "no inductor graph (another backend, or nothing compiled)"
    else:
        state = "warm" if misses == 0 else "cold" if hits == 0 else "partly warm"
        state += (f": {hits} of {hits + misses} inductor graphs and {count['aotautograd_local_cache_hit_count']} "
                  f"AOTAutograd graphs from the caches")  # fmt: skip
    return f"{graphs} region{'' if graphs == 1 else 's'} compiled in {seconds:.1f} s, {state}{start}"


# ----------------------------------------------------------------------------- FSDP2


def fp32_contract_params(lm: nn.Module) -> dict[str, nn.Parameter]:
    """The parameters submodules declare fp32 (`_fp32_params`; declared buffers, the RoPE tables, are not sharded)."""
    from megacpp_lab.model.precision import fp32_contract

    params = dict(lm.named_parameters())
    return {name: params[name] for name in fp32_contract(lm) if name in params}


class _ReplicatedGradAverage:
    """The gradient average of the replicated fp32-contract parameters: one all-reduce per backward, at its
    end, over all of them at once (one flat buffer per dtype).

    One all-reduce per parameter, from each parameter's post-accumulate hook, cost the step dearly under
    FSDP2: a blocking collective in the middle of the backward makes the compute stream wait until it is
    done, and it is queued behind the block's reduce-scatter and the next all-gather on the same
    communicator, so every block with a decay stalled the backward on communication FSDP2 would have hidden.
    The first hook of a backward queues one callback on the autograd engine; it runs when the backward ends.
    Under gradient accumulation the average is still right: it is linear, and the average of an average is
    itself."""

    def __init__(self, params: list[nn.Parameter], group: Any, world: int) -> None:
        self.params, self.group, self.world = params, group, world
        self.queued = False

    def hook(self, param: torch.Tensor) -> None:
        if not self.queued:
            self.queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self.reduce)

    def reduce(self) -> None:
        import torch.distributed as dist
        from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

        self.queued = False
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for p in self.params:
            if p.grad is not None:
                by_dtype.setdefault(p.grad.dtype, []).append(p.grad)
        for grads in by_dtype.values():
            flat = _flatten_dense_tensors(grads)
            dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=self.group)  # SUM then divide: gloo has no AVG
            flat.div_(self.world)
            torch._foreach_copy_(grads, list(_unflatten_dense_tensors(flat, grads)))


def fsdp_groups(model: nn.Module, blocks_per_group: int = 1) -> list[tuple[str, list[nn.Module]]]:
    """The FSDP2 groups apply_fsdp makes, innermost first: the blocks (each on its own, or `blocks_per_group`
    consecutive blocks together: one all-gather, one reduce-scatter and one set of hooks for them), the MTP
    modules (if any), the embedding, [final norm, LM head], then the root (what is left: nothing, for a HybridLM)."""
    if not is_int(blocks_per_group) or blocks_per_group < 1:
        raise ValueError(f"blocks_per_group must be an int >= 1, got {blocks_per_group!r}")
    lm = _hybrid(model)
    blocks, k = list(lm.blocks), blocks_per_group
    groups = [(f"blocks.{i}" if len(blocks[i : i + k]) == 1 else f"blocks.{i}-{i + len(blocks[i : i + k]) - 1}",
               blocks[i : i + k]) for i in range(0, len(blocks), k)]  # fmt: skip
    mtp = [("mtp", list(lm.mtp))] if len(lm.mtp) else []  # the MTP modules, one group
    return groups + mtp + [("embed", [lm.embed]), ("norm+lm_head", [lm.norm, lm.lm_head]), ("root", [lm])]


def apply_fsdp(model: nn.Module, *, mesh: Any = None, param_dtype: torch.dtype | None = torch.bfloat16,
               reduce_dtype: torch.dtype | None = torch.float32, reshard_after_forward: bool = True,
               blocks_per_group: int = 1) -> nn.Module:  # fmt: skip
    """FSDP2 (`fully_shard`) over the groups of fsdp_groups, in torchtitan's order: after apply_ac and
    apply_compile, on an fp32 model (the shards are the fp32 masters; param_dtype is what the forward sees).

    FSDP2 casts every parameter of a group to param_dtype: that would cast the fp32-contract parameters
    (`_fp32_params`: the SSD / M2RNN decay path, the mHC gates, the concept bank) to bf16, the blanket cast the
    seeds' Float16Module bug was. They are left out of every group (ignored_params): fp32, replicated on every
    rank, their gradients averaged over the mesh in one all-reduce at the end of each backward
    (_ReplicatedGradAverage). Needs an initialised process group."""
    import torch.distributed as dist
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    lm = _hybrid(model)
    low = sorted(n for n, p in lm.named_parameters() if p.dtype != torch.float32)
    if low:
        raise ValueError(f"apply_fsdp shards fp32 masters, but {low[:3]} ({len(low)} in all) are not fp32: build "
                         "the model in fp32 and let param_dtype cast the forward's copies")  # fmt: skip
    if not dist.is_initialized():
        raise RuntimeError("apply_fsdp needs an initialised process group (torchrun, or dist.init_process_group)")
    if mesh is None:  # on the model's device: fully_shard's own default picks CUDA whenever a GPU is present,
        # and a CPU model on a one-GPU machine then failed on rank 1 ("invalid device ordinal")
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh(next(lm.parameters()).device.type, (dist.get_world_size(),))
    contract = fp32_contract_params(lm)  # by name: the same order on every rank (the flat buffer's layout)
    keep = set(contract.values())
    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    for name, modules in fsdp_groups(lm, blocks_per_group):
        target = modules[0] if len(modules) == 1 else modules
        # the LM head runs last in the forward and first in the backward: resharding it in between would
        # only buy an all-gather the backward waits on at once (torchtitan keeps its last layer likewise)
        reshard = reshard_after_forward and name != "norm+lm_head"
        fully_shard(target, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard, ignored_params=keep)
    group = mesh.get_group() if mesh is not None else None
    world = dist.get_world_size(group)
    average = _ReplicatedGradAverage([contract[n] for n in sorted(contract)], group, world)
    for param in keep:
        param.register_post_accumulate_grad_hook(average.hook)
    return model
