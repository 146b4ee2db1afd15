"""Activation checkpointing: one policy, per block kind, applied before compile (torchtitan's order).

    policy = CheckpointingPolicy(A="full", M=("mm",), R="none")            # eager: checkpoint wrappers
    apply_ac(model, policy)
    policy = CheckpointingPolicy(A=0.3, M=0.5, R=1.0)                      # regional compile: budgets
    apply_ac(model, policy, compiled=True); apply_compile(model)

An entry (one per block kind A / M / R / E, and for the Engram and CBlock branches) is
    "none"            save everything (no recompute)
    "full"            non-reentrant torch.utils.checkpoint around the block (or branch): save its inputs only
    ("mm", ...)       selective, a save list: keep the outputs of the aten ops named (overload packets, e.g.
                      "mm", "addmm", "_scaled_dot_product_flash_attention") and recompute every other op (norms,
                      activations, gates, the conv). The outputs of the `megacpp::` scans are always saved: they
                      are the expensive ones to recompute (not the conv's Triton form, megacpp::doc_conv_fwd: a pass
                      over its input, recomputed as the torch form it stands in for is). A saved output that a later
                      op changes in place is refused by torch ("Tensor cached during selective activation checkpoint has been mutated").
    0.3               a budget in [0, 1]: under regional compile, inductor's activation_memory_budget while this
                      block kind compiles (the min-cut partitioner recomputes until the saved bytes fit)

Under regional compile the budget is the single authority: apply_ac(compiled=True) turns "none" / "full" into
budgets 1.0 / 0.0 and refuses op lists, and apply_compile refuses a block that holds a manual checkpoint wrapper.
A budget is per block structure (one compiled graph each): a block with an Engram or CBlock branch takes that
branch's entry when it is not "none", else its kind's.
Eager, a budget is refused (nothing would read it).

The last block (the last MTP module's with mtp_depth > 0) is never checkpointed (last_layer="never", the only value): its activations are the first the
backward consumes, so recomputing them frees nothing and costs a forward. offload=True keeps the saved tensors
of every non-checkpointed block in pinned CPU memory (torch.autograd.graph.save_on_cpu). compact_rank=r swaps
each MLP's up projection for a CompactLinear (nn/compact_linear.py): it saves a rank-r random projection of its
d_model-wide input and reconstructs an approximate, unbiased weight gradient (eager, opt-in).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from megacpp_lab.model.hybrid import REMAT_BUDGET_ATTR
from megacpp_lab.nn.compact_linear import CompactLinear

__all__ = ["AC_ATTR", "BUDGET_ATTR", "ROUTING_OPS", "CheckpointingPolicy", "apply_ac", "block_budget", "cached_ops",
           "checkpoint_module", "saves_output"]

KINDS = ("A", "M", "R", "E", "engram", "cblock", "mtp")  # mtp: the MTP modules' blocks (the seeds' mtp_recompute)
AC_ATTR = "_megacpp_ac"  # set on a module whose forward apply_ac wrapped (eager)
BUDGET_ATTR = REMAT_BUDGET_ATTR  # set on a block apply_ac gave a budget (regional compile; Block guards on it)

Entry = str | tuple[str, ...] | float


def _check_entry(name: str, value: Any) -> Entry:
    if value in ("none", "full"):
        return value
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if not 0.0 <= value <= 1.0:
            raise ValueError(f"CheckpointingPolicy.{name} budget must be in [0, 1], got {value!r}")
        return float(value)
    if isinstance(value, (list, tuple)) and value and all(isinstance(op, str) and op for op in value):
        return tuple(value)
    raise ValueError(f"CheckpointingPolicy.{name} must be 'none', 'full', a non-empty tuple of aten op names to "
                     f"save, or a budget in [0, 1]; got {value!r}")  # fmt: skip


@dataclass(frozen=True)
class CheckpointingPolicy:
    """Per block kind: see the module docstring. Frozen, checked on construction (the error names the field)."""

    A: Entry = "none"
    M: Entry = "none"
    R: Entry = "none"
    E: Entry = "none"
    engram: Entry = "none"
    cblock: Entry = "none"
    mtp: Entry = "none"
    last_layer: str = "never"
    offload: bool = False
    compact_rank: int | None = None  # the MLPs save a rank-r random projection of their inputs (eager; opt-in)

    def __post_init__(self) -> None:
        for kind in KINDS:
            object.__setattr__(self, kind, _check_entry(kind, getattr(self, kind)))
        if self.last_layer != "never":
            raise ValueError(f"CheckpointingPolicy.last_layer must be 'never' (the last block's activations are the "
                             f"first the backward reads: checkpointing it only adds a forward), got {self.last_layer!r}")
        if not isinstance(self.offload, bool):
            raise ValueError(f"CheckpointingPolicy.offload must be a bool, got {self.offload!r}")
        rank = self.compact_rank
        if rank is not None and (not isinstance(rank, int) or isinstance(rank, bool) or rank < 1):
            raise ValueError(f"CheckpointingPolicy.compact_rank must be an int >= 1 or None, got {rank!r}")

    @classmethod
    def uniform(cls, entry: Entry, **overrides: Any) -> CheckpointingPolicy:
        """The same entry for every kind (a global policy), with overrides."""
        return cls(**{**{k: entry for k in KINDS}, **overrides})

    def entries(self) -> dict[str, Entry]:
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name in KINDS}

    @classmethod
    def parse(cls, spec: str) -> CheckpointingPolicy:
        """The policy from its text (`megacpp-lab train --remat SPEC`), comma-separated parts:
            ENTRY          "none" | "full" | a budget "0.3" | a save list "mm+addmm": every kind not named
            KIND=ENTRY     one kind's entry (A, M, R, E, engram, cblock, mtp), e.g. "A=1.0,M=0.3,R=1.0"
            offload        keep the saved tensors of non-checkpointed blocks in pinned CPU memory (eager)
            compact=R      the MLPs save a rank-R random projection of their inputs (eager)
        Kinds not named take the bare ENTRY, else "none". Fails closed naming the part."""
        if not isinstance(spec, str) or not spec.strip():
            raise ValueError(f"a remat policy must be a non-empty string such as 'none', 'full', '0.3', 'mm+addmm' "
                             f"or 'A=1.0,M=0.3,R=1.0'; got {spec!r}")  # fmt: skip

        def entry(text: str, where: str) -> Entry:
            text = text.strip()
            if text in ("none", "full"):
                return text
            if text.replace(".", "", 1).isdigit():  # a budget: digits with at most one point
                return float(text)
            ops = tuple(op.strip() for op in text.split("+"))
            if not all(op and op[0].isalpha() and op.replace("_", "").replace(".", "").isalnum() for op in ops):
                raise ValueError(f"remat policy {spec!r}: {where} {text!r} is not 'none', 'full', a budget in [0, 1] "
                                 "or aten op names joined by '+'")  # fmt: skip
            # saves_output matches an op by its overload packet's name (aten.mm's is 'mm'): a misspelt or qualified
            # name ('adddmm', 'mm.default') would match nothing, and the block would quietly save less
            unknown = [op for op in ops if "." in op or not hasattr(torch.ops.aten, op)]
            if unknown:
                raise ValueError(f"remat policy {spec!r}: {where} names {unknown}, not aten ops (a save list names "
                                 "them as torch.ops.aten spells them, e.g. 'mm+addmm')")  # fmt: skip
            return ops

        default: Entry = "none"
        given: dict[str, Any] = {}
        bare = 0
        for part in (p.strip() for p in spec.split(",")):
            key, sep, value = part.partition("=")
            key = key.strip()
            if part == "offload":
                given["offload"] = True
            elif sep and key == "compact":
                if not value.strip().isdigit():
                    raise ValueError(f"remat policy {spec!r}: compact={value.strip()!r} is not a rank (an int >= 1)")
                given["compact_rank"] = int(value)
            elif sep:
                if key not in KINDS:
                    raise ValueError(f"remat policy {spec!r}: {part!r} names no kind: KIND is one of {KINDS}")
                if key in given:
                    raise ValueError(f"remat policy {spec!r}: kind {key} is given twice")
                given[key] = entry(value, f"kind {key}'s entry")
            else:
                bare += 1
                if bare > 1:
                    raise ValueError(f"remat policy {spec!r}: more than one entry for every kind; name kinds (A=...)")
                default = entry(part, "entry")
        return cls(**{**{k: default for k in KINDS}, **given})

    @property
    def spec(self) -> str:
        """The text parse() reads back into this very policy."""
        text = {k: "+".join(e) if isinstance(e, tuple) else (f"{e:g}" if isinstance(e, float) else e)
                for k, e in self.entries().items()}  # fmt: skip
        if len(set(text.values())) == 1:
            parts = [text["A"]]
        else:  # the block kinds always, the branches where they have an entry of their own
            parts = [f"{k}={v}" for k, v in text.items() if k in ("A", "M", "R") or v != "none"]
        parts += ["offload"] if self.offload else []
        parts += [f"compact={self.compact_rank}"] if self.compact_rank is not None else []
        return ",".join(parts)

    @property
    def is_budget(self) -> bool:
        """Whether any entry is a budget (read by inductor under regional compile)."""
        return any(isinstance(e, float) for e in self.entries().values())

    @property
    def is_eager(self) -> bool:
        """Whether the policy holds an eager-only lever: an op list (selective checkpoint wrappers), offload or
        compact_rank."""
        return any(isinstance(e, tuple) for e in self.entries().values()) or self.offload or self.compact_rank is not None


# An E block's routing decision (the router's top-k) is saved under every checkpoint entry, "full" included: a
# recomputed router can round its logits differently in the last bit (another kernel, another reduction order),
# and a token near a tie then goes to other experts in the backward than in the forward. The grouped experts'
# shapes do not depend on the routing, so torch's strict metadata check (kept on) could not see it: the
# gradients would silently belong to another routing. Saved, the recompute routes as the forward did.
ROUTING_OPS = ("topk",)


# the lab's ops that are no scan: as cheap to recompute as the torch forms they stand in for (a save list may still
# name them)
RECOMPUTED_LAB_OPS = ("doc_conv_fwd",)


def saves_output(op: Any, save: frozenset[str] | tuple[str, ...], *, scans: bool = True) -> bool:
    """Whether a save list keeps this op's output: the `megacpp::` scans always (unless scans=False), else the
    aten ops named (and the lab's RECOMPUTED_LAB_OPS, where named)."""
    packet = getattr(op, "_overloadpacket", op)
    namespace, _, name = getattr(packet, "_qualified_op_name", str(packet)).partition("::")
    if scans and namespace == "megacpp" and name not in RECOMPUTED_LAB_OPS:  # never recompute a scan
        return True
    return getattr(packet, "__name__", str(packet)) in save


def _selective(save: tuple[str, ...], *, scans: bool = True) -> Callable[[], Any]:
    """A context_fn for checkpoint(): save the outputs of the named aten ops and (scans=True) of the scans,
    recompute the rest."""
    names = frozenset(save)

    def policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        keep = saves_output(op, names, scans=scans)
        return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE

    return functools.partial(create_selective_checkpoint_contexts, policy)


def cached_ops(module: nn.Module, entry: Entry) -> tuple[tuple[str, ...], bool] | None:
    """What a checkpoint of `module` under the eager entry caches: (the aten ops whose outputs it keeps, whether
    the scans' too), or None for a plain checkpoint that keeps its inputs alone. An E block keeps its routing
    decision under either entry (ROUTING_OPS): "full" is then everything recomputed but the top-k, and a save
    list gains it."""
    if getattr(module, "kind", None) == "E":
        return (entry + ROUTING_OPS if isinstance(entry, tuple) else ROUTING_OPS), isinstance(entry, tuple)
    return (entry, True) if isinstance(entry, tuple) else None


def checkpoint_module(module: nn.Module, entry: Entry) -> None:
    """Checkpoint `module`'s forward in place under an eager entry: "full" or a save list (its parameters and
    state-dict keys unchanged); what it caches besides its inputs: cached_ops."""
    inner = module.forward
    cached = cached_ops(module, entry)
    context_fn = _selective(cached[0], scans=cached[1]) if cached is not None else None

    def forward(*args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return inner(*args, **kwargs)
        extra = {"context_fn": context_fn} if context_fn is not None else {}
        return checkpoint(inner, *args, use_reentrant=False, **extra, **kwargs)

    module.forward = forward
    setattr(module, AC_ATTR, entry)


def _offload(module: nn.Module) -> None:
    inner = module.forward

    def forward(*args: Any, **kwargs: Any) -> Any:
        with torch.autograd.graph.save_on_cpu(pin_memory=torch.cuda.is_available()):
            return inner(*args, **kwargs)

    module.forward = forward
    setattr(module, AC_ATTR, "offload")


def apply_ac(model: nn.Module, policy: CheckpointingPolicy, *, compiled: bool = False) -> nn.Module:
    """Apply the policy in place and return the model; call it once, before apply_compile."""
    if not isinstance(policy, CheckpointingPolicy):
        raise TypeError(f"apply_ac needs a CheckpointingPolicy, got {type(policy).__name__}")
    if not hasattr(model, "blocks"):
        raise TypeError(f"apply_ac needs a HybridLM, got {type(model).__name__}")
    lm = model
    if any(hasattr(m, AC_ATTR) or hasattr(m, BUDGET_ATTR) for m in lm.modules()):
        raise ValueError("apply_ac was already applied to this model: apply it once, to a fresh model")
    entries = policy.entries()
    if compiled and policy.compact_rank is not None:
        raise ValueError("CheckpointingPolicy.compact_rank is eager-only (its projection is drawn per call); under "
                         "regional compile the budget is the single authority")
    if policy.compact_rank is not None and policy.compact_rank > lm.config.d_model:
        raise ValueError(f"CheckpointingPolicy.compact_rank must be at most d_model={lm.config.d_model}, "
                         f"got {policy.compact_rank}")  # fmt: skip
    for kind, entry in entries.items():  # everything checked before any block changes
        if compiled and isinstance(entry, tuple):
            raise ValueError(f"CheckpointingPolicy.{kind} is an op list, which only the eager path applies; under "
                             "regional compile give a budget in [0, 1] (inductor's activation_memory_budget)")
        if not compiled and isinstance(entry, float):
            raise ValueError(f"CheckpointingPolicy.{kind} is a budget ({entry}), which only regional compile reads: "
                             "pass compiled=True (then apply_compile), or give 'none', 'full' or an op list")
    blocks = lm.all_blocks()  # the stack's, then the MTP modules' (which take the mtp entry)
    last = len(blocks) - 1
    for i, block in enumerate(blocks):
        entry = entries["mtp"] if i >= len(lm.blocks) else entries[block.kind]
        if compiled:  # one budget per block structure: a block with an Engram / CBlock branch takes that entry
            for branch in ("engram", "cblock"):
                if getattr(block, branch) is not None and entries[branch] != "none":
                    entry = entries[branch]
            budget = {"none": 1.0, "full": 0.0}.get(entry, entry)  # type: ignore[arg-type]
            setattr(block, BUDGET_ATTR, 1.0 if i == last else float(budget))
            continue
        if i == last:
            continue  # never checkpointed, never compacted
        if policy.compact_rank is not None and block.kind != "E":  # the MLP's up projection (its input: d_model
            # wide); an E block's experts are one grouped weight, which CompactLinear does not wrap
            block.mlp.w_gate_up = CompactLinear(block.mlp.w_gate_up, policy.compact_rank, seed=i)
        if entry != "none":
            checkpoint_module(block, entry)
            continue
        for name in ("engram", "cblock"):  # a branch's own entry, inside an unwrapped block
            branch = getattr(block, name)
            if branch is not None and entries[name] != "none":
                checkpoint_module(branch, entries[name])
        if policy.offload:
            _offload(block)
    return model


def block_budget(block: nn.Module) -> float | None:
    """The activation_memory_budget apply_ac gave this block for regional compile, or None."""
    return getattr(block, BUDGET_ATTR, None)
