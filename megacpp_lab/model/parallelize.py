"""Training concerns applied to a plain HybridLM, in torchtitan's order: activation checkpointing, then
compile, then sharding. This file holds the compile and the sharding steps.

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

__all__ = ["CompileStats", "apply_compile", "apply_fsdp", "block_structures", "compile_stats", "fsdp_groups"]


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


# ----------------------------------------------------------------------------- FSDP2


def _fp32_contract_params(lm: nn.Module) -> dict[str, nn.Parameter]:
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
    consecutive blocks together: one all-gather, one reduce-scatter and one set of hooks for them), the
    embedding, [final norm, LM head], then the root (what is left: nothing, for a HybridLM)."""
    if isinstance(blocks_per_group, bool) or not isinstance(blocks_per_group, int) or blocks_per_group < 1:
        raise ValueError(f"blocks_per_group must be an int >= 1, got {blocks_per_group!r}")
    lm = _lm(model)
    blocks, k = list(lm.blocks), blocks_per_group
    groups = [(f"blocks.{i}" if len(blocks[i : i + k]) == 1 else f"blocks.{i}-{i + len(blocks[i : i + k]) - 1}",
               blocks[i : i + k]) for i in range(0, len(blocks), k)]  # fmt: skip
    return groups + [("embed", [lm.embed]), ("norm+lm_head", [lm.norm, lm.lm_head]), ("root", [lm])]


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

    lm = _lm(model)
    if lm is not model:
        raise ValueError(f"apply_fsdp shards a plain HybridLM; got a {type(model).__name__} wrapper (FSDP2's "
                         "MixedPrecisionPolicy replaces apply_mixed_precision: build the model in fp32)")  # fmt: skip
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
    contract = _fp32_contract_params(lm)  # by name: the same order on every rank (the flat buffer's layout)
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
