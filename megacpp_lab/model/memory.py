"""The memory estimator: what a training step of a config holds, in structured fields, before you run it.

    est = estimate_memory(config, batch=4, seq_len=4096, policy=CheckpointingPolicy.uniform(0.3), device="cuda")
    est.activations_by_kind      # {"A": bytes, "M": ..., "R": ...}: the saved activations of every block of a kind
    est.activations_by_feature   # what the Engram / n-gram / mHC / CBlock branches add to their blocks' totals
    est.lm_head                  # the fused loss's dx [B*T, d] and dW [V, d], computed in the forward
    est.peak_step_bytes          # parameters + activations at the fwd/bwd boundary + the loss's chunk buffer ...

Where each number comes from:
- parameters, gradients, optimizer state: counted from the model built on the meta device (nothing allocated),
  in the dtypes the lab trains with (bf16 under apply_precision on a GPU, fp32-contract tensors fp32;
  fp32 on a CPU). The optimizer is MasterWeightAdamW: an fp32 master per non-fp32 parameter, and AdamW's two
  fp32 moments per parameter.
- activations: one block of each distinct structure (kind + branches) is traced on a batch of the shape
  ([B, T], `docs` documents per row) on `device`, under the policy's entry for it (not one row scaled by B:
  the partitioner's choices are discrete, and a budget's saved set at one row differs from the batch's):
    "none"      autograd's saved-tensor hooks (each storage once, parameters excluded);
    "full"      the same hooks around the checkpointed block: the inputs it keeps;
    a save list the inputs plus every output the selective checkpoint caches (the named aten ops and the
                `megacpp::` scans; model/checkpointing.saves_output), read from a dispatch mode over the call;
    offload     the device keeps nothing of the block (host_offload holds it instead);
    a budget    the min-cut partitioner's saved values at that budget, as inductor partitions the block's graph
                (model/remat.remat_plan), and the block input.
  The last block is traced as the policy runs it: never checkpointed.
  MTP (mtp_depth > 0): each module's A block is traced like the stack's (on one stream, under the policy's mtp
  entry; the last module's never checkpointed), plus what the module keeps around it, analytic (its norms'
  inputs, the projection's [n, 2d] input, the shared head's normed input and the dW its fused loss computes):
  activations_by_kind["mtp"].
  A feature's field is its block minus the same block traced without that branch, under the same entry.
  An E block's mixture of experts is also broken down by field (router, dispatch, hiddens, combine: `moe_fields`,
  nn/moe.moe_activation_fields), analytically, for eager entries that save everything or a save list.
- the LM head: analytic, from kernels/linear_cross_entropy.py. Its forward computes dx and dW for the backward
  and reuses one [C, V] logits buffer (transient: in the peak, not in the activations).
The estimate is for the device it is traced on: the kernels a block runs (and so what they save) differ
between a GPU (Triton scans, fused RoPE, bf16) and a CPU (reference paths, fp32).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from megacpp_lab.checks import is_int
from megacpp_lab.kernels.linear_cross_entropy import default_chunk_size
from megacpp_lab.model.checkpointing import CheckpointingPolicy, Entry, cached_ops, checkpoint_module, saves_output
from megacpp_lab.model.config import HybridConfig
from megacpp_lab.model.hybrid import Block, HybridLM
from megacpp_lab.model.precision import apply_precision
from megacpp_lab.model.remat import remat_plan
from megacpp_lab.nn.mla import reads_block_mask
from megacpp_lab.nn.moe import moe_activation_fields
from megacpp_lab.profiling import saved_storages
from megacpp_lab.varlen import build_context, doc_ids_from_cu_seqlens, packed_cu_seqlens

__all__ = ["FEATURES", "MemoryEstimate", "estimate_memory"]

FEATURES = ("engram", "ngram", "mhc", "cblock")


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes, per field; see the module docstring for where each comes from."""

    batch: int
    seq_len: int
    device: str
    parameters: int
    gradients: int  # the model's .grad tensors, in the parameters' dtypes
    optimizer: int  # MasterWeightAdamW: fp32 masters of non-fp32 parameters + two fp32 AdamW moments
    activations_by_kind: dict[str, int]  # every block of a kind: its saved activations, its input included
    activations_by_feature: dict[str, int]  # inside the by-kind totals: what each branch adds to its blocks
    inputs: int  # the token ids (the embedding's backward reads them) and the context tensors blocks save, once
    final_norm: int  # the final RMSNorm's input [B*T, d] and its per-token statistics (fp32)
    lm_head: int  # the fused loss's dx [B*T, d] and dW [V, d], made in the forward
    lm_head_chunk_buffer: int  # the loss's one [C, V] logits buffer (transient, forward only)
    host_offload: int  # saved tensors CPU offload keeps in pinned host memory instead
    per_block: list[dict[str, Any]] = field(default_factory=list)  # layer, kind, structure, entry, bytes
    # inside activations_by_kind["E"]: the E layers' mixtures of experts by field (router, dispatch, hiddens,
    # combine; nn/moe.moe_activation_fields), analytic, for the entries it models ("none" and save lists; a layer
    # under "full", a budget or offload is left out: moe_layers_modelled says how many were counted)
    moe_fields: dict[str, int] = field(default_factory=dict)
    moe_layers_modelled: int = 0

    @property
    def activations(self) -> int:
        """What the forward leaves on the device for the backward: the fwd/bwd boundary."""
        return sum(self.activations_by_kind.values()) + self.inputs + self.final_norm + self.lm_head

    @property
    def peak_step_bytes(self) -> int:
        """The larger of the forward's end (activations plus the loss's chunk buffer) and the backward's end
        (every gradient plus the lm_head's dW still held), above parameters and batch."""
        return max(self.activations + self.lm_head_chunk_buffer, self.gradients + self.lm_head)

    def as_dict(self) -> dict[str, Any]:
        out = {k: getattr(self, k) for k in self.__dataclass_fields__ if k != "per_block"}
        return {**out, "activations": self.activations, "peak_step_bytes": self.peak_step_bytes,
                "per_block": self.per_block}  # fmt: skip


# ----------------------------------------------------------------------------- static state


def _model_state_bytes(config: HybridConfig, device: str) -> tuple[int, int, int]:
    """(parameters, gradients, optimizer) for the model as the lab trains it on `device`."""
    with torch.device("meta"):
        model = HybridLM(config)
    if device == "cuda":
        apply_precision(model, torch.bfloat16)
    params = [p for p in model.parameters() if p.requires_grad]
    weights = sum(p.numel() * p.element_size() for p in params)
    masters = sum(p.numel() * 4 for p in params if p.dtype != torch.float32)
    moments = sum(2 * p.numel() * 4 for p in params)
    return weights, weights, masters + moments


# ----------------------------------------------------------------------------- one block


def _structure(config: HybridConfig, layer: int) -> tuple[str, ...]:
    """A block's structure: its kind and the branches it carries (blocks of one structure save alike)."""
    c = config
    feats = [f for f, on in (("dsa", layer in c.dsa_layers), ("engram", layer in c.engram_layers), ("ngram", layer in c.ngram_layers),
                             ("mhc", c.mhc and layer in c.engram_layers), ("cblock", layer in c.cblock_layers)) if on]  # fmt: skip
    return (c.blocks[layer], *feats)


def _without(block: Block, feature: str) -> Block:
    """The same block without one branch (the fixed mean-read connection in place of mHC; dense attention in
    place of DSA)."""
    if feature == "mhc":
        block.hc = None
    elif feature == "dsa":
        block.mixer.indexer = None
    else:
        setattr(block, feature, None)
    return block


class _SavedOutputs(TorchDispatchMode):
    """Records the storages of the outputs a save list's selective checkpoint caches (each storage once)."""

    def __init__(self, save: tuple[str, ...], scans: bool = True) -> None:
        super().__init__()
        self.save, self.scans, self.bytes, self.seen = frozenset(save), scans, 0, set()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if saves_output(func, self.save, scans=self.scans):
            for t in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in self.seen:
                    self.seen.add(t.untyped_storage().data_ptr())
                    self.bytes += t.untyped_storage().nbytes()
        return out


def _hooked_bytes(block: nn.Module, x: torch.Tensor, tokens: torch.Tensor, ctx: Any, shared: dict[Any, int], *,
                  record: _SavedOutputs | None = None) -> int:  # fmt: skip
    """Bytes of the tensors autograd saves during one forward of `block` (profiling.saved_storages: parameters
    and buffers excluded, each storage once), plus what `record` sees cached. The batch's token ids and context
    tensors are read by every block but held once: a saved one is noted in `shared` (storage -> bytes)."""
    from torch.multiprocessing.reductions import StorageWeakRef

    batch_inputs = {StorageWeakRef(t.untyped_storage()) for t in (tokens, *vars(ctx).values())
                    if isinstance(t, torch.Tensor)}  # fmt: skip

    def tag(t: torch.Tensor) -> str | None:
        ref = StorageWeakRef(t.untyped_storage())
        if ref in batch_inputs:
            shared[ref] = t.untyped_storage().nbytes()
            return None
        return "block"

    with torch.enable_grad(), saved_storages(tag, exclude=(*block.parameters(), *block.buffers())) as acc:
        if record is None:
            out = block(x, tokens, ctx)
        else:
            with record:
                out = block(x, tokens, ctx)
    del out
    return acc.get("block", 0) + (record.bytes if record is not None else 0)


def _block_bytes(block: Block, entry: Entry, x: torch.Tensor, tokens: torch.Tensor, ctx: Any, shared: dict[Any, int],
               *, compiled: bool, offload: bool, backend: str) -> tuple[int, int]:  # fmt: skip
    """(device bytes, host bytes) this block keeps for the backward under `entry`."""
    if compiled:
        budget = {"none": 1.0, "full": 0.0}.get(entry, entry)  # type: ignore[arg-type]
        plan = remat_plan(block, x, tokens, ctx, budget=float(budget), backend=backend)
        # the block input is a graph input the backward reads at every budget (norm backward or recompute)
        block_input = x.numel() * x.element_size() if any(
            s["op"] == "input" and s["shape"] == tuple(x.shape) for s in plan.saved) else 0  # fmt: skip
        return plan.activation_bytes + block_input, 0
    if entry == "none":
        saved = _hooked_bytes(block, x, tokens, ctx, shared)
        return (0, saved) if offload else (saved, 0)
    checkpoint_module(block, entry)
    cached = cached_ops(block, entry)  # a save list's ops; an E block's routing under "full" too
    record = _SavedOutputs(*cached) if cached is not None else None
    return _hooked_bytes(block, x, tokens, ctx, shared, record=record), 0


def _block_input(config: HybridConfig, batch: int, seq_len: int, docs: int, device: str, dtype: torch.dtype,
                 ) -> tuple[torch.Tensor, torch.Tensor, Any]:  # fmt: skip
    """A block's input: x [B,T,d] (or [B,T,n,d] with mHC), token ids and the packed context (docs per row)."""
    g = torch.Generator().manual_seed(0)
    doc_ids = doc_ids_from_cu_seqlens(packed_cu_seqlens(batch, seq_len, docs, g), batch, seq_len)
    tokens = torch.randint(3, config.vocab_size, (batch, seq_len), generator=g)
    ctx = build_context(doc_ids.to(device))
    shape = (batch, seq_len, config.d_model)
    shape = (*shape[:2], config.hyper.n_streams, config.d_model) if config.mhc else shape
    base = torch.randn(shape, generator=g, dtype=torch.float32).to(device=device, dtype=dtype)
    return base.requires_grad_(), tokens.to(device), ctx


# ----------------------------------------------------------------------------- the estimate


def _entry(policy: CheckpointingPolicy, config: HybridConfig, layer: int, compiled: bool) -> Entry:
    """The entry apply_ac gives this layer of the stack (the last block never checkpointed: the stack's last
    unless MTP modules follow it)."""
    if layer == config.n_layers - 1 and not config.mtp_depth:
        return 1.0 if compiled else "none"
    entries = policy.entries()
    entry = entries[config.blocks[layer]]
    for branch, layers in (("engram", config.engram_layers), ("cblock", config.cblock_layers)):
        if layer in layers and entries[branch] != "none":
            if compiled:  # one budget per block structure: the branch's
                entry = entries[branch]
            elif entry == "none":  # eager: a branch's own wrapper inside an unwrapped block
                raise ValueError(f"CheckpointingPolicy.{branch}: the estimator traces whole blocks; an eager entry "
                                 f"for the {branch} branch inside an unwrapped block is not estimated")  # fmt: skip
    return entry


def estimate_memory(config: HybridConfig, *, batch: int, seq_len: int, docs: int = 1,
                    policy: CheckpointingPolicy | None = None, compiled: bool = False, device: str = "cpu",
                    backend: str = "inductor", trace_cache: dict[tuple[Any, ...], Any] | None = None,
                    ) -> MemoryEstimate:  # fmt: skip
    """The estimate for a [batch, seq_len] step of `config` (docs documents per row) under `policy` (eager,
    or with compiled=True the regional-compile budgets apply_ac gives, partitioned as `backend` partitions them:
    remat_plan's backends), traced on `device`. trace_cache: a dict
    to reuse block traces across calls (several policies of one config, shape and device)."""
    if not isinstance(config, HybridConfig):
        raise TypeError(f"estimate_memory needs a HybridConfig, got {type(config).__name__}")
    for name, value in (("batch", batch), ("seq_len", seq_len), ("docs", docs)):
        if not is_int(value) or value < 1:
            raise ValueError(f"estimate_memory: {name} must be an int >= 1, got {value!r}")
    if docs > seq_len:
        raise ValueError(f"estimate_memory: docs={docs} documents do not fit in seq_len={seq_len} tokens")
    policy = policy if policy is not None else CheckpointingPolicy()
    if policy.compact_rank is not None:
        raise ValueError("CheckpointingPolicy.compact_rank: the estimator does not model compact activations")
    if compiled and policy.offload:
        raise ValueError("CheckpointingPolicy.offload is eager-only; under regional compile the budget is the authority")
    for kind, entry in policy.entries().items():  # the same refusals apply_ac makes, before any tracing
        if compiled and isinstance(entry, tuple):
            raise ValueError(f"CheckpointingPolicy.{kind} is an op list: under regional compile give a budget")
        if not compiled and isinstance(entry, float):
            raise ValueError(f"CheckpointingPolicy.{kind} is a budget ({entry}): pass compiled=True")
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    params, grads, optimizer = _model_state_bytes(config, device)
    x, tokens, ctx = _block_input(config, batch, seq_len, docs, device, dtype)
    cache = trace_cache if trace_cache is not None else {}
    shared: dict[Any, int] = cache.setdefault(("shared", config, batch, seq_len, docs, device), {})

    @functools.cache
    def masked_ctx() -> Any:
        """ctx with its flex block mask, built once (on a CPU the attention layers take no mask: ctx as it is)."""
        return ctx.with_block_mask() if device == "cuda" else ctx

    def traced(layer: int, entry: Entry, offload: bool, drop: str | None = None) -> tuple[int, int]:
        structure = tuple(f for f in _structure(config, layer) if f != drop)  # a bare twin is that structure
        key = (config, batch, seq_len, docs, device, compiled, backend, structure, entry, offload)
        if key not in cache:
            torch.manual_seed(layer)
            block = Block(config, layer).to(device)
            if device == "cuda":
                apply_precision(block, torch.bfloat16)
            if drop is not None:
                _without(block, drop)
            # the block mask as HybridLM.attention_context builds it, where the block's attention reads it
            block_ctx = masked_ctx() if reads_block_mask(block, torch.device(device)) else ctx
            cache[key] = _block_bytes(block, entry, x, tokens, block_ctx, shared, compiled=compiled, offload=offload,
                                      backend=backend)
            del block
        return cache[key]

    by_kind: dict[str, int] = {}
    by_feature: dict[str, int] = {}
    moe_fields: dict[str, int] = {}
    moe_layers = 0
    host = 0
    per_block = []
    last = config.n_layers - 1 if not config.mtp_depth else -1  # the model's last block: never checkpointed or offloaded
    for layer in range(config.n_layers):
        entry = _entry(policy, config, layer, compiled)
        offload = policy.offload and layer != last
        dev, off = traced(layer, entry, offload)
        kind = config.blocks[layer]
        by_kind[kind] = by_kind.get(kind, 0) + dev
        host += off
        if kind == "E" and not offload and (entry == "none" or isinstance(entry, tuple)):
            # a save list keeps the router's logits (mm) and top-k and recomputes the experts, unless it names
            # them; else the MoE's own expert-GEMM recompute (MoEConfig.recompute_experts), if set
            recompute = ("save_list" if isinstance(entry, tuple) and "_grouped_mm" not in entry
                         else "experts" if config.moe.recompute_experts else "none")  # fmt: skip
            for name, n in moe_activation_fields(config.moe, batch * seq_len, dtype, recompute=recompute).items():
                moe_fields[name] = moe_fields.get(name, 0) + n
            moe_layers += 1
        structure = _structure(config, layer)
        for feature in structure[1:]:
            bare_dev, bare_off = traced(layer, entry, offload, drop=feature)
            by_feature[feature] = by_feature.get(feature, 0) + dev + off - bare_dev - bare_off
        per_block.append({"layer": layer, "kind": kind, "structure": "+".join(structure),
                          "entry": list(entry) if isinstance(entry, tuple) else entry, "bytes": dev,
                          "host_bytes": off})  # fmt: skip
    d, V, n = config.d_model, config.vocab_size, batch * seq_len
    es = torch.tensor([], dtype=dtype).element_size()
    if config.mtp_depth:  # the MTP modules: each one's A block traced on one stream, under the mtp entry
        x1 = x[..., 0, :].detach().clone().requires_grad_() if config.mhc else x
        for k in range(1, config.mtp_depth + 1):
            entry = policy.entries()["mtp"]
            if k == config.mtp_depth:  # the last block of the model: never checkpointed
                entry = "none"
            offload = policy.offload and entry == "none" and k < config.mtp_depth  # as apply_ac offloads
            entry = {"none": 1.0, "full": 0.0}.get(entry, entry) if compiled else entry  # type: ignore[arg-type]
            key = (config, batch, seq_len, docs, device, compiled, backend, ("A", "mtp"), entry, offload)
            if key not in cache:
                torch.manual_seed(config.n_layers + k)
                block = Block(config, config.n_layers + k - 1, kind="A").to(device)
                if device == "cuda":
                    apply_precision(block, torch.bfloat16)
                cache[key] = _block_bytes(block, entry, x1, tokens, ctx, shared, compiled=compiled, offload=offload,
                                          backend=backend)  # fmt: skip
                del block
            dev, off = cache[key]
            host += off
            # around the block (analytic): the embedding's ids and its document mask, the embedding norm's input,
            # the [n, 2d] concatenation the projection keeps, the final norm's input and the head's normed input,
            # the norms' fp32 rstd, and the fused loss's dW [V, d] that each head call computes in its forward.
            # The hidden norm's input is the previous depth's final-norm input (the stack's final norm's for k = 1):
            # counted there
            dev += 5 * n * d * es + n * (8 + es) + 3 * n * 4 + V * d * es
            by_kind["mtp"] = by_kind.get("mtp", 0) + dev
            per_block.append({"layer": config.n_layers + k - 1, "kind": "A", "structure": f"mtp{k}",
                              "entry": list(entry) if isinstance(entry, tuple) else entry, "bytes": dev,
                              "host_bytes": 0})  # fmt: skip
    chunk = config.lm_head.loss_chunk_size or default_chunk_size(n, V, dtype)
    return MemoryEstimate(
        batch=batch, seq_len=seq_len, device=device, parameters=params, gradients=grads, optimizer=optimizer,
        activations_by_kind=by_kind, activations_by_feature=by_feature,
        inputs=sum(shared.values()) + n * tokens.element_size(),
        final_norm=n * d * es + n * 4,
        lm_head=n * d * es + V * d * es, lm_head_chunk_buffer=min(chunk, n) * V * es + n * 4,
        host_offload=host, per_block=per_block, moe_fields=moe_fields, moe_layers_modelled=moe_layers,
    )  # fmt: skip
