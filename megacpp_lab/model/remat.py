"""The remat explorer: what the min-cut partitioner decided for one compiled block at one budget.

    plan = remat_plan(model.blocks[1], x, tokens, ctx, budget=0.3)
    plan.saved          # the tensors the forward keeps for the backward: name, producing op, shape, dtype, bytes
    plan.recomputed     # the forward ops the backward runs again: op, count, output bytes, FLOPs

Read from the partitioner's own output, not guessed: the block is compiled (fullgraph) by inductor, and the
min_cut_rematerialization_partition call inductor makes (after its decompositions and joint-graph passes) is
captured and the compile stopped there (or, backend="aot_eager_decomp_partition", the same partitioner without
the joint-graph passes: what the CPU sweep runs) under torch._functorch.config's
activation_memory_budget; the backward graph's inputs other than the tangents are the saved values, and the
backward's call nodes that share a name with a forward node are the recomputed ops (the partitioner copies
them from the joint graph with their names). Sizes that dynamo keeps symbolic (the document count) are
evaluated at the example inputs.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

__all__ = ["PLAN_BACKENDS", "RematPlan", "remat_plan"]


@dataclass(frozen=True)
class RematPlan:
    """One block's partition at one budget: saved tensors and recomputed ops, with their bytes and FLOPs."""

    budget: float
    saved: list[dict[str, Any]]
    recomputed: list[dict[str, Any]]

    @property
    def saved_bytes(self) -> int:
        """Everything the backward reads from the forward, inputs and parameters included."""
        return sum(s["bytes"] for s in self.saved)

    @property
    def activation_bytes(self) -> int:
        """The saved tensors the forward computed (not its inputs or parameters): what a budget trades."""
        return sum(s["bytes"] for s in self.saved if s["op"] != "input")

    @property
    def recomputed_flops(self) -> int:
        return sum(r["flops"] for r in self.recomputed)


def _stopped_by_plan(error: BaseException | None) -> bool:
    while error is not None:
        if isinstance(error, _Partitioned):
            return True
        error = error.__cause__ or error.__context__
    return False


def _hint(value: Any) -> Any:
    return int(value.node.hint) if isinstance(value, torch.SymInt) else value


def _shape(value: Any) -> tuple[int, ...] | None:
    return tuple(_hint(d) for d in value.shape) if isinstance(value, torch.Tensor) else None


def _bytes(value: Any) -> int:
    shape = _shape(value)
    if shape is None:
        return 0
    n = 1
    for d in shape:
        n *= d
    return n * value.element_size()


def _flops(node: torch.fx.Node) -> int:
    """FLOPs of one aten call from torch's own FLOP formulas (0 for ops it has none for: elementwise)."""
    from torch.utils.flop_counter import flop_registry

    packet = getattr(node.target, "_overloadpacket", None)
    if packet not in flop_registry:
        return 0
    shapes = [_shape(a.meta.get("val")) if isinstance(a, torch.fx.Node) else a for a in node.args]
    try:
        return int(flop_registry[packet](*shapes, out_val=_shape(node.meta.get("val"))))
    except (TypeError, IndexError):  # a formula that wants arguments this call spells otherwise
        return 0


def _op(node: torch.fx.Node) -> str:
    """The op's name; an element of a tuple output is named after the op that produced it (scan[1])."""
    import operator

    if node.target is operator.getitem and isinstance(node.args[0], torch.fx.Node):
        return f"{_op(node.args[0])}[{node.args[1]}]"
    name = str(getattr(node.target, "_overloadpacket", node.target))
    if name in ("aten.detach", "aten.alias") and isinstance(node.args[0], torch.fx.Node):  # the tensor it names
        return _op(node.args[0])
    return name


class _Partitioned(Exception):
    """Raised from inside inductor once its partitioner returned: the plan needs no generated code."""


PLAN_BACKENDS = ("inductor", "aot_eager_decomp_partition")


def remat_plan(module: nn.Module, *args: Any, budget: float, backend: str = "inductor", **kwargs: Any) -> RematPlan:
    """Compile `module` on `args` at `budget` and return what the min-cut partitioner saved and recomputed.

    backend="inductor": inductor's own partition, its joint-graph passes included, read by wrapping the
    partitioner inductor calls and stopping the compile there (no code is generated). "aot_eager_decomp_partition":
    AOTAutograd with inductor's decompositions and the same partitioner, without the joint-graph passes (the
    backend the CPU sweep compiles with). Resets dynamo first and after (the plan's compile must not reuse or leave
    a cached graph)."""
    import torch._inductor.compile_fx as compile_fx
    from torch._functorch.aot_autograd import aot_module_simplified
    from torch._functorch.partitioners import min_cut_rematerialization_partition
    from torch._inductor.decomposition import select_decomp_table

    if not 0.0 <= budget <= 1.0:
        raise ValueError(f"budget must be in [0, 1], got {budget!r}")
    if backend not in PLAN_BACKENDS:
        raise ValueError(f"backend must be one of {PLAN_BACKENDS}, got {backend!r}")
    captured: dict[str, torch.fx.GraphModule] = {}

    def partition(joint: torch.fx.GraphModule, inputs: Any, **kw: Any) -> Any:
        fw, bw = min_cut_rematerialization_partition(joint, inputs, **kw)
        captured["fw"], captured["bw"] = fw, bw
        if backend == "inductor":
            raise _Partitioned
        return fw, bw

    def decomp_partition(gm: torch.fx.GraphModule, example: Any) -> Any:
        return aot_module_simplified(gm, example, fw_compiler=lambda g, _: g, bw_compiler=lambda g, _: g,
                                     partition_fn=partition, decompositions=select_decomp_table())  # fmt: skip

    torch._dynamo.reset()
    original = compile_fx.min_cut_rematerialization_partition
    try:
        compile_fx.min_cut_rematerialization_partition = partition
        # no cache: a cached compile would skip the partitioner
        with torch._functorch.config.patch(activation_memory_budget=budget, enable_autograd_cache=False), \
                torch._inductor.config.patch(fx_graph_cache=False), torch.enable_grad():  # fmt: skip
            compiled = torch.compile(module, backend="inductor" if backend == "inductor" else decomp_partition,
                                     fullgraph=True)  # fmt: skip
            compiled(*args, **kwargs)
    except Exception as error:  # dynamo wraps what a backend raises
        if "bw" not in captured or not _stopped_by_plan(error):
            raise
    finally:
        compile_fx.min_cut_rematerialization_partition = original
        torch._dynamo.reset()
    if "bw" not in captured:
        raise ValueError("the module's output needs no gradient: there is no backward to partition (give inputs or "
                         "parameters that require grad)")
    fw, bw = captured["fw"], captured["bw"]
    producers = {n.name: _op(n) for n in fw.graph.nodes if n.op == "call_function"}
    saved = [{"name": n.name, "op": producers.get(n.name, "input"), "shape": _shape(n.meta.get("val")),
              "dtype": str(n.meta["val"].dtype).removeprefix("torch.") if isinstance(n.meta.get("val"), torch.Tensor)
              else "symint", "bytes": _bytes(n.meta.get("val"))}
             for n in bw.graph.nodes if n.op == "placeholder" and not n.name.startswith("tangents")]  # fmt: skip
    again = [n for n in bw.graph.nodes if n.op == "call_function" and n.name in producers]
    counts: Counter[str] = Counter(_op(n) for n in again)
    recomputed = [{"op": op, "count": count, "bytes": sum(_bytes(n.meta.get("val")) for n in again if _op(n) == op),
                   "flops": sum(_flops(n) for n in again if _op(n) == op)}
                  for op, count in counts.most_common()]  # fmt: skip
    return RematPlan(float(budget), saved, recomputed)
