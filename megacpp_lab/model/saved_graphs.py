"""Saved graphs: each block structure's compiled forward and backward, traced once and loaded by later processes.

Regional compile (model/parallelize.py) makes one graph per block structure. With plain `torch.compile`, every new
process traces every structure with dynamo again, even when inductor's and AOTAutograd's caches hold all the rest:
on a warm start that tracing is most of the first step. Here each structure is compiled with dynamo's
ahead-of-time entry (`torch.compile(fn, fullgraph=True).aot_compile`, torch >= 2.11): one call traces the block's
forward, partitions it (at the block's remat budget), compiles forward and backward, and returns a function with
its guards, which is saved under inductor's cache directory. A later process loads it (tens of milliseconds) and
traces nothing.

`SavedGraphs` holds a model's graphs and is what `apply_compile(model, saved_graphs=True)` installs: every block's
`forward` becomes a `SavedForward`, which calls the first graph of its (structure, remat budget, grad mode) whose
guards pass, loads one from disk when none in memory does, and compiles and saves one when none on disk does.
The block's hooks stay outside the graph (nn.Module runs them around `forward`, eagerly): profiler ranges and the
like need no graph of their own.

- **Keys.** The files of one structure are named by a digest of the model's config, the parallel config, the
  structure, its remat budget, grad mode, the lab's source, torch's and Triton's versions, the device and the
  shapes and dtypes of the block's inputs; the guards, saved with the graph, decide the rest. A file whose guards
  fail is kept, and one more graph is compiled next to it, up to `ParallelConfig`'s graph count per key; past
  it the call is an error that names the block and the failing guard, never a silent eager run.
- **Dynamic dimensions.** The context's per-document tensors (varlen.PER_DOCUMENT_FIELDS: cu_seqlens, its host
  copy, longest_first) are marked dynamic (build_context) so that one graph serves every document count. Torch
  saves the guards without the mark, and a loaded graph then refuses any tensor that carries one
  (`_has_dynamo_dim_marking ... absent at compile time`), though its graph is dynamic in that dimension. So graphs
  are called with a view of the context whose per-document tensors are fresh views of the same memory, without
  marks (`unmarked`): the guards still check their dtype, device, stride and rank.
- **One process's model only.** FSDP2 shards the blocks' parameters into DTensors, which these graphs are not
  traced for: parallelize keeps plain `torch.compile` under FSDP2.
"""

from __future__ import annotations

import dataclasses
import hashlib
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from megacpp_lab.varlen import PER_DOCUMENT_FIELDS

__all__ = ["SavedForward", "SavedGraphs", "saveable_guards", "saved_graphs_dir", "unmarked"]

# graphs compiled for one key before a guard failure is an error: one per input signature the guards tell apart
# beyond the key (a batch of another shape changes the key, so this is about what the key cannot see)
GRAPHS_PER_KEY = 4


def saved_graphs_dir() -> Path:
    """Where saved graphs live: inside inductor's cache directory (TORCHINDUCTOR_CACHE_DIR), so that clearing
    inductor's caches clears them too, and a run with caches of its own has graphs of its own."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    return Path(cache_dir()) / "megacpp_saved_graphs"


def unmarked(ctx: Any) -> Any:
    """The context with its per-document tensors (cu_seqlens, its host copy, longest_first) as new views of the
    same memory, which carry none of dynamo's dimension marks (see the module docstring). Other fields are the
    same objects."""
    return dataclasses.replace(ctx, **{name: getattr(ctx, name).view(getattr(ctx, name).shape)
                                       for name in PER_DOCUMENT_FIELDS})  # fmt: skip


def saveable_guards(entries: Any) -> list[bool]:
    """The guards a saved graph keeps: aot_compile's own choice (none on a global, none of a type torch cannot
    save) and none on a function's default arguments. Torch 2.11 saves a guard on a default
    (DefaultsSource) but cannot load it back ("DefaultsSource.__init__() takes from 3 to 4 positional
    arguments"). A default is a constant of the lab's source, and a changed source is another key."""
    from torch._dynamo.guards import CheckFunctionManager

    unsaveable = getattr(CheckFunctionManager, "UNSUPPORTED_SERIALIZATION_GUARD_TYPES", ())
    return [not (e.is_global or e.guard_type in unsaveable or "__defaults__" in e.name or "__kwdefaults__" in e.name)
            for e in entries]  # fmt: skip


def _signature(*tensors: torch.Tensor) -> tuple[Any, ...]:
    return tuple((tuple(t.shape), str(t.dtype), tuple(t.stride()), t.device.type) for t in tensors)


@dataclass
class SavedGraphs:
    """The saved graphs of one model (see the module docstring): in memory by key, on disk under `root`.
    `events` records, per graph, whether it was loaded or compiled, for which structure, and in how long."""

    model_key: str
    backend: str = "inductor"
    limit: int = GRAPHS_PER_KEY
    root: Path | None = None  # None: saved_graphs_dir()
    graphs: dict[str, list[Any]] = field(default_factory=dict)
    files_seen: dict[str, set[str]] = field(default_factory=dict)
    events: list[dict[str, Any]] = field(default_factory=list)
    _ctx: Any = None  # the last context and its unmarked view: every block of a step gets the same one
    _view: Any = None
    _keys: dict[tuple[Any, ...], str] = field(default_factory=dict)  # this context's keys: hashed once a step

    @property
    def directory(self) -> Path:
        return self.root if self.root is not None else saved_graphs_dir()

    def view(self, ctx: Any) -> Any:
        if ctx is not self._ctx:
            self._ctx, self._view = ctx, unmarked(ctx)
            self._keys.clear()
        return self._view

    def key(self, structure: tuple[str, ...], budget: float | None, x: torch.Tensor, tokens: torch.Tensor,
            ctx: Any) -> str:  # fmt: skip
        marks = {n: sorted(getattr(ctx.cu_seqlens, n)) for n in ("_dynamo_dynamic_indices", "_dynamo_weak_dynamic_indices")
                 if hasattr(ctx.cu_seqlens, n)}  # fmt: skip
        text = repr((self.model_key, structure, budget, torch.is_grad_enabled(),
                     _signature(x, tokens, ctx.doc_ids, ctx.positions, ctx.starts, ctx.seq_index),
                     (str(ctx.cu_seqlens.dtype), ctx.cu_seqlens.device.type),  # its length: the document count
                     marks, ctx.block_mask is not None))  # fmt: skip
        return hashlib.sha256(text.encode()).hexdigest()[:32]

    def call(self, block: nn.Module, structure: tuple[str, ...], x: torch.Tensor, tokens: torch.Tensor, ctx: Any) -> Any:
        """Run `block` through the graph for these inputs: in memory, on disk, or compiled and saved now."""
        from megacpp_lab.model.checkpointing import block_budget

        view = self.view(ctx)
        budget = block_budget(block)
        # the key hashes the model and the inputs' signature: once per (structure, budget, grad mode, x) and
        # context, not at every block of every step (tokens' and the context's shapes are the context's)
        memo = (structure, budget, torch.is_grad_enabled(), x.shape, x.dtype, x.stride(), x.device)
        key = self._keys.get(memo)
        if key is None:
            key = self._keys[memo] = self.key(structure, budget, x, tokens, ctx)
        for graph in self.graphs.get(key, ()):
            if graph.guard_check(block, x, tokens, view):
                return graph(block, x, tokens, view)
        graph = self._load(key, block, structure, x, tokens, view) or self._compile(key, block, structure, budget,
                                                                                     x, tokens, ctx, view)  # fmt: skip
        return graph(block, x, tokens, view)

    def _load(self, key: str, block: nn.Module, structure: tuple[str, ...], x: torch.Tensor, tokens: torch.Tensor,
              view: Any) -> Any | None:  # fmt: skip
        seen = self.files_seen.setdefault(key, set())
        for path in sorted(self.directory.glob(f"{key}-*.bin")):
            if path.name in seen:
                continue
            seen.add(path.name)
            t0 = time.perf_counter()
            try:
                with path.open("rb") as fh:
                    graph = torch.compiler.load_compiled_function(fh)
            except Exception as err:  # a truncated or foreign file, or one of another torch: never run around it
                raise RuntimeError(f"saved graph {path} cannot be loaded ({type(err).__name__}: {err}): delete it (or "
                                   f"{self.directory}) and the next call compiles and saves it again") from err  # fmt: skip
            graph.disable_guard_check()  # call() checks the guards once, before the call
            self.graphs.setdefault(key, []).append(graph)
            ok = graph.guard_check(block, x, tokens, view)
            self.events.append({"structure": list(structure), "grad": torch.is_grad_enabled(), "how": "loaded",
                                "file": path.name, "seconds": time.perf_counter() - t0, "guards_pass": bool(ok)})  # fmt: skip
            if ok:
                return graph
        return None

    def _compile(self, key: str, block: nn.Module, structure: tuple[str, ...], budget: float | None, x: torch.Tensor,
                 tokens: torch.Tensor, ctx: Any, view: Any) -> Any:  # fmt: skip
        graphs = self.graphs.setdefault(key, [])
        if len(graphs) >= self.limit:
            reason = graphs[0]._artifacts.guard_manager.check_verbose(graphs[0].prepare_f_locals(block, x, tokens, view))
            raise RuntimeError(f"block {getattr(block, 'layer', '?')} ({'+'.join(structure)}): {len(graphs)} saved graphs "
                               f"for its key and none passes its guards (the first fails: {reason.verbose_code_parts}); "
                               "compiling more would hide a recompile storm")  # fmt: skip
        t0 = time.perf_counter()
        dynamo = torch._dynamo.config
        aot_flag = dynamo.patch(enable_aot_compile=True) if hasattr(dynamo, "enable_aot_compile") else nullcontext()
        # the partitioner reads the budget while aot_compile partitions the joint graph (now, not at a first call);
        # specialize_float keeps it a constant, as parallelize._with_budget does for torch.compile
        budgeted = (torch._functorch.config.patch(activation_memory_budget=budget) if budget is not None else nullcontext())
        # the saved guards pickle each parameter with its .grad, and a gradient outside the guards comes back as a
        # placeholder that torch cannot assign on load: trace with the gradients set aside (a validation pass
        # after a training step compiles while they are there)
        grads = {p: p.grad for p in block.parameters() if p.grad is not None}
        try:
            for p in grads:
                p.grad = None
            with aot_flag, budgeted, dynamo.patch(specialize_float=True):
                compiled = torch.compile(type(block).forward, fullgraph=True, backend=self.backend,
                                         options={"guard_filter_fn": saveable_guards})  # fmt: skip
                graph = compiled.aot_compile(((block, x, tokens, ctx), {}))
        finally:
            for p, g in grads.items():
                p.grad = g
        compile_s = time.perf_counter() - t0
        if not graph.guard_check(block, x, tokens, view):
            raise RuntimeError(f"block {getattr(block, 'layer', '?')}: a graph saved for these inputs refuses them "
                               "(its guards fail on the unmarked context): torch's aot_compile changed")  # fmt: skip
        self.directory.mkdir(parents=True, exist_ok=True)
        path = self.directory / f"{key}-{len(list(self.directory.glob(f'{key}-*.bin')))}.bin"
        graph.save_compiled_function(str(path))  # written to a temporary file and renamed: readers see all or none
        self.files_seen.setdefault(key, set()).add(path.name)
        graph.disable_guard_check()
        graphs.append(graph)
        self.events.append({"structure": list(structure), "grad": torch.is_grad_enabled(), "how": "compiled",
                            "file": path.name, "seconds": compile_s, "save_s": time.perf_counter() - t0 - compile_s})  # fmt: skip
        return graph

    def summary(self) -> dict[str, Any]:
        """Graphs loaded and compiled so far, and their seconds."""
        out: dict[str, Any] = {}
        for how in ("loaded", "compiled"):
            rows = [e for e in self.events if e["how"] == how]
            out[how] = len(rows)
            out[f"{how}_s"] = sum(e["seconds"] for e in rows)
        return out


class SavedForward:
    """A block's forward through its model's SavedGraphs (installed as the block's `forward` by apply_compile)."""

    def __init__(self, block: nn.Module, structure: tuple[str, ...], graphs: SavedGraphs) -> None:
        self.block, self.structure, self.graphs = block, structure, graphs

    def __call__(self, x: torch.Tensor, tokens: torch.Tensor, ctx: Any) -> torch.Tensor:
        return self.graphs.call(self.block, self.structure, x, tokens, ctx)

    def __reduce__(self) -> tuple[Any, tuple[()]]:
        # a saved graph's guards pickle the block they were traced with, its __dict__ included, and so this
        # object: the graphs it reaches hold guard managers, which cannot be pickled. What a guard needs of a
        # block is its parameters and attributes, never its forward, so the pickle keeps a placeholder
        return _unpickled_forward, ()


def _unpickled_forward() -> None:
    """What a pickled SavedForward becomes (see SavedForward.__reduce__)."""
    return None
