"""Training concerns applied to a plain HybridLM, in torchtitan's order: activation checkpointing, then
compile, then sharding. This file holds the compile step.

Regional compile: every block is compiled on its own (`block.compile(fullgraph=True)`), not the whole
model. Blocks of one structure (the same letter and the same branches) run the same code on the same
shapes, so dynamo traces Block.forward once per structure and every other block of that structure reuses
the graph: a 12-layer `base` model compiles four graphs (A, M, R, M with Engram), not twelve. The scans
(SSD, M2RNN) stay opaque `megacpp::` custom ops, and the batch's PackedContext comes in as an argument
whose cu_seqlens build_context marks dynamic, so a new number of documents per row reuses the graphs.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

__all__ = ["CompileStats", "apply_compile", "block_structures", "compile_stats"]


def _lm(model: nn.Module) -> nn.Module:
    """The HybridLM inside a wrapper (apply_mixed_precision's MixedPrecision keeps it as .module)."""
    inner = getattr(model, "module", model)
    if not hasattr(inner, "blocks"):
        raise TypeError(f"expected a HybridLM (or a wrapper holding one as .module), got {type(model).__name__}")
    return inner


def block_structures(model: nn.Module) -> Counter[tuple[str, ...]]:
    """How many blocks share each structure: (letter, its optional branches..., 'mhc' when the block has
    hyper-connections, 'streams' when the residual is mHC's [B,T,n,d]). One compiled graph per structure."""
    lm = _lm(model)
    streams = ("streams",) if lm.config.mhc else ()
    out: Counter[tuple[str, ...]] = Counter()
    for block in lm.blocks:
        branches = tuple(n for n in ("engram", "ngram", "cblock") if getattr(block, n) is not None)
        out[(block.kind, *branches, *(("mhc",) if block.hc is not None else ()), *streams)] += 1
    return out


def apply_compile(model: nn.Module, *, fullgraph: bool = True, **compile_kwargs: Any) -> nn.Module:
    """Compile every block of the model on its own, in place (torchtitan's per-block compile), and return
    the model. fullgraph=True: a graph break is an error, not a silent split. Each block structure is one
    entry of Block.forward's cache, so a model with more structures than dynamo's recompile_limit is
    refused here, before any compile, rather than failing (or falling back to eager) mid-step."""
    lm = _lm(model)
    structures = block_structures(lm)
    limit = torch._dynamo.config.recompile_limit
    if len(structures) > limit:
        raise ValueError(f"the model has {len(structures)} block structures {sorted(structures)}, one compiled graph "
                         f"each, over torch._dynamo.config.recompile_limit={limit}; raise the limit to at least "
                         f"{len(structures)} before apply_compile")
    from megacpp_lab.model.checkpointing import AC_ATTR, block_budget

    wrapped = [i for i, b in enumerate(lm.blocks) if any(hasattr(m, AC_ATTR) for m in b.modules())]
    if wrapped:
        raise ValueError(f"blocks {wrapped} hold manual checkpoint wrappers (apply_ac without compiled=True); under "
                         "regional compile the activation_memory_budget is the single authority: build the model "
                         "again and call apply_ac(model, policy, compiled=True) before apply_compile")  # fmt: skip
    for block in lm.blocks:
        budget = block_budget(block)
        if budget is None:
            block.compile(fullgraph=fullgraph, **compile_kwargs)
        else:  # the partitioner reads the budget when this block's graph compiles (its first call)
            block._compiled_call_impl = _with_budget(torch.compile(block._call_impl, fullgraph=fullgraph, **compile_kwargs),
                                                     budget)  # fmt: skip
    return model


def _with_budget(fn: Any, budget: float) -> Any:
    def call(*args: Any, **kwargs: Any) -> Any:
        with torch._functorch.config.patch(activation_memory_budget=budget):
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
