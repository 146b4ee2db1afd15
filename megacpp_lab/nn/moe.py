"""Mixture of experts: the E block's FFN. Token-choice top-k routing, SwiGLU experts, dropless by default.

    x [N,d] -> router: logits = x W_r (fp32), scores s = sigmoid(logits) (or softmax)
            -> each token's top_k experts by s + bias (the bias steers the choice only, never the weights)
            -> weights: the chosen scores, normalised to sum 1 when top_k > 1, times route_scale
            -> y = sum over the token's experts of weight * SwiGLU_e(x)          (+ a shared SwiGLU, optional)

Balance (DeepSeek-V3's auxiliary-loss-free balancing, `balance="bias"`): every forward adds its tokens per expert to
the buffer `load`; after each optimizer step `update_balance(model)` moves each expert's bias by bias_update_rate
toward the mean load (up for an underloaded expert, down for an overloaded one) and clears `load`. The bias has no
gradient. An auxiliary balance loss (Switch's E * sum_e f_e P_e) is optional (aux_loss_weight > 0), and a router
z-loss (mean logsumexp(logits)^2, ST-MoE) keeps the logits small. Both losses reach the parameters through the
block's output (`attach_loss`, Megatron's MoEAuxLossAutoScaler idea): the block keeps its x -> y signature, under
torch.compile too. Their last values, the dropped fraction and the busiest expert's share are in `stats`.

**Documents.** Dropless routing (the default) is a function of each token alone: no output depends on another
token, so the block keeps documents apart and is causal (tests/test_moe.py runs the leak harness on it).
Capacity-limited routing (capacity_factor set) is not: each expert takes at most C = ceil(capacity_factor * N *
top_k / E) of the batch's tokens, the highest-scoring first, and drops the rest (their weight is 0; the shared
expert and the residual still carry them). Whether a token is dropped then depends on every other token of the
batch, later ones and other documents included, and the leak harness catches it.

Experts run grouped (`experts="grouped"`: the assignments sorted by expert, two torch._grouped_mm calls over
the groups, no host sync and no recompile when the group sizes change) or one expert at a time
(`experts="loop"`: the reference, with a host sync per expert). On CUDA torch._grouped_mm is fast only in bf16
on sm90+ (elsewhere it loops on the host over offsets copied to the CPU), and under torch.compile it takes bf16
alone: the grouped path refuses other dtypes there rather than fall back (a CPU runs it eager in fp32). Capacity routing runs as one batched matmul over [E, C] slots.

**Expert-GEMM recompute** (`recompute_experts=True`, the seeds' recompute_moe_experts): the experts' part of the
forward (the gather of each assignment's row, the two expert GEMMs, the SwiGLU, the un-sort and the weighted
sum) runs under a non-reentrant selective checkpoint whose inputs are the rows and the routing as plain tensors
(ids, weights). It keeps the down GEMM's output (the routing weights' gradient reads it) and recomputes the rest
in the backward: the gathered rows and the hiddens are never kept, and the price is one grouped GEMM (gate_up)
again. The recompute routes every token exactly as the forward did (it never calls the router). Eager and under
torch.compile alike (the checkpoint becomes a recompute region the partitioner honours).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from megacpp_lab.checks import check_ints, config_error
from megacpp_lab.nn.config_builder import build_config
from megacpp_lab.nn.primitives import SwiGLU, attach_loss

__all__ = ["EXPERT_IMPLS", "RECOMPUTE_FIELDS", "SCORES", "MoE", "MoEConfig", "Routing", "attach_loss", "capacity_experts",
           "grouped_experts", "loop_experts", "moe_activation_fields", "route", "update_balance"]

SCORES = ("sigmoid", "softmax")
EXPERT_IMPLS = ("grouped", "loop")
BALANCE = ("bias", "none")
RECOMPUTE_FIELDS = ("none", "experts", "save_list")  # moe_activation_fields' recompute modes
STATS = ("z_loss", "aux_loss", "dropped_fraction", "max_load_fraction")  # MoE.stats, in this order

_fail = functools.partial(config_error, "MoEConfig")


@dataclass(frozen=True)
class MoEConfig:
    """E block FFN settings; build it with MoEConfig.build. Frozen, checked on construction."""

    d_model: int
    n_experts: int = 16
    top_k: int = 2
    expert_hidden: int = 512  # each expert's SwiGLU hidden size (a multiple of 8: torch._grouped_mm's alignment)
    shared_hidden: int = 0  # the shared expert's hidden size; 0: none
    score: str = "sigmoid"  # "sigmoid" (DeepSeek-V3) or "softmax"
    route_scale: float = 1.0
    balance: str = "bias"  # "bias": auxiliary-loss-free balancing (update_balance); "none"
    bias_update_rate: float = 1e-3
    aux_loss_weight: float = 0.0  # > 0: Switch's balance loss, besides (or instead of) the bias
    z_loss_weight: float = 1e-3
    capacity_factor: float | None = None  # None: dropless (the default; keeps documents apart)
    experts: str = "grouped"  # "grouped" (torch._grouped_mm) or "loop" (one expert at a time, the reference)
    # the expert-GEMM recompute lever: the experts' dispatch, GEMMs and combine run under a checkpoint, which keeps
    # their input rows and the routing (ids, weights) and runs them again in the backward (module docstring)
    recompute_experts: bool = False
    init_std: float = 0.02

    def __post_init__(self) -> None:
        check_ints("MoEConfig", self, ("d_model", "n_experts", "top_k", "expert_hidden"))
        check_ints("MoEConfig", self, ("shared_hidden",), low=0)
        if self.top_k > self.n_experts:
            raise _fail("top_k", f"an int in [1, n_experts={self.n_experts}]", self.top_k)
        for name in ("d_model", "expert_hidden", "shared_hidden"):
            if getattr(self, name) % 8:
                raise _fail(name, "a multiple of 8 (torch._grouped_mm needs 16-byte aligned bf16 rows)", getattr(self, name))
        for name, allowed in (("score", SCORES), ("balance", BALANCE), ("experts", EXPERT_IMPLS)):
            if getattr(self, name) not in allowed:
                raise _fail(name, f"one of {allowed}", getattr(self, name))
        for name, low in (("route_scale", 0.0), ("bias_update_rate", 0.0), ("aux_loss_weight", 0.0),
                          ("z_loss_weight", 0.0), ("init_std", 0.0)):  # fmt: skip
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < low:
                raise _fail(name, f"a finite number >= {low}", value)
        if self.route_scale == 0 or self.init_std == 0:
            raise _fail("route_scale" if self.route_scale == 0 else "init_std", "a number > 0", 0)
        if not isinstance(self.recompute_experts, bool):
            raise _fail("recompute_experts", "a bool", self.recompute_experts)
        cf = self.capacity_factor
        if cf is not None and (isinstance(cf, bool) or not isinstance(cf, (int, float)) or not 0 < cf < math.inf):
            raise _fail("capacity_factor", "None (dropless) or a finite number > 0", cf)

    @classmethod
    def build(cls, source: Any = None, **overrides: Any) -> MoEConfig:
        aliases = {"d_model": ("d_model", "hidden_size"), "n_experts": ("moe_n_experts", "num_experts", "n_experts"),
                   "top_k": ("moe_top_k", "moe_router_topk", "top_k")}  # fmt: skip
        return build_config(cls, source, overrides, prefix="moe", aliases=aliases, required=("d_model",))

    def capacity(self, n_tokens: int) -> int:
        """Slots per expert under capacity routing: ceil(capacity_factor * tokens * top_k / n_experts)."""
        if self.capacity_factor is None:
            raise ValueError("MoEConfig.capacity: routing is dropless (capacity_factor=None): no expert has a capacity")
        return max(1, math.ceil(self.capacity_factor * n_tokens * self.top_k / self.n_experts))


@dataclass
class Routing:
    """One batch's routing: each token's experts ids [N,k] (int64) and their weights [N,k] (fp32, 0 for an
    assignment capacity routing dropped), the router logits [N,E] (fp32) and scores [N,E]."""

    ids: torch.Tensor
    weights: torch.Tensor
    logits: torch.Tensor | None = None  # None: the experts' own view (they read ids and weights alone)
    scores: torch.Tensor | None = None


def route(x: torch.Tensor, router_weight: torch.Tensor, bias: torch.Tensor, config: MoEConfig) -> Routing:
    """The router in fp32 (module docstring): x [N,d], router_weight [E,d], bias [E]."""
    logits = F.linear(x.float(), router_weight.float())
    scores = torch.sigmoid(logits) if config.score == "sigmoid" else torch.softmax(logits, dim=-1)
    ids = torch.topk(scores + bias.float(), config.top_k, dim=-1).indices  # the bias picks; it never weighs
    weights = scores.gather(-1, ids)
    if config.top_k > 1:  # with one expert a token's weight stays its score: normalised it would be 1, no gradient
        weights = weights / weights.sum(-1, keepdim=True)
    return Routing(ids, weights * config.route_scale, logits, scores)


def _sorted_by_expert(ids: torch.Tensor, n_experts: int, priority: torch.Tensor | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """The assignments (token, slot) flattened to N*k and sorted by expert (stably: token order within an expert;
    by descending `priority` [N*k] first, if given): (order [N*k], tokens per expert [E] int64, their running
    sum, each group's end). Fixed shapes, no host sync."""
    flat = ids.reshape(-1)
    if priority is None:
        order = torch.argsort(flat, stable=True)
    else:
        by_priority = torch.argsort(priority, descending=True, stable=True)
        order = by_priority[torch.argsort(flat[by_priority], stable=True)]
    counts = torch.zeros(n_experts, dtype=torch.int64, device=ids.device).scatter_add_(0, flat, torch.ones_like(flat))
    return order, counts, torch.cumsum(counts, 0)


def _swiglu_rows(h: torch.Tensor) -> torch.Tensor:
    gate, up = h.chunk(2, dim=-1)
    return F.silu(gate) * up


def grouped_experts(x: torch.Tensor, routing: Routing, w_gate_up: torch.Tensor, w_down: torch.Tensor) -> torch.Tensor:
    """Dropless experts through torch._grouped_mm: x [N,d], w_gate_up [E,d,2h], w_down [E,h,d] -> [N,d] in x's
    dtype. The assignments are sorted by expert, gathered, run as two grouped GEMMs over the groups (an empty
    group is fine), put back in (token, slot) order and summed over the k slots with their weights (a sum, not
    an atomic scatter: deterministic)."""
    if (x.is_cuda or torch.compiler.is_compiling()) and (x.dtype != torch.bfloat16 or w_gate_up.dtype != torch.bfloat16):
        where = "on CUDA" if x.is_cuda else "under torch.compile"
        raise ValueError(f"MoE experts='grouped' {where} needs bf16 x and expert weights (torch._grouped_mm's fast "
                         f"path, and the only dtype its compiled form takes; on CUDA other dtypes loop on the host), "
                         f"got x {x.dtype}, weights {w_gate_up.dtype}: run the model in bf16 or name "
                         f"experts='loop' (eager)")  # fmt: skip
    N, k = routing.ids.shape
    order, _, ends = _sorted_by_expert(routing.ids, w_gate_up.shape[0])
    token = order // k
    offs = ends.to(torch.int32)
    hidden = _swiglu_rows(torch._grouped_mm(x[token], w_gate_up, offs=offs))
    out_sorted = torch._grouped_mm(hidden, w_down, offs=offs)  # [N*k, d], by expert
    per_slot = torch.empty_like(out_sorted).index_copy_(0, order, out_sorted).view(N, k, -1)
    return (per_slot.float() * routing.weights[..., None]).sum(1).to(x.dtype)


def capacity_experts(x: torch.Tensor, routing: Routing, w_gate_up: torch.Tensor, w_down: torch.Tensor,
                     capacity: int) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """Capacity-limited experts: each expert's C highest-scoring assignments of the batch go to its C slots
    ([E, C, d], zero where unfilled), one batched matmul each way; the rest are dropped. Returns y [N,d] in x's
    dtype and the kept mask [N,k]. A slot index past the buffer sends a dropped assignment to a scratch row."""
    N, k = routing.ids.shape
    E, d = w_gate_up.shape[0], x.shape[-1]
    flat_ids = routing.ids.reshape(-1)
    order, counts, ends = _sorted_by_expert(routing.ids, E, priority=routing.weights.reshape(-1))
    expert = flat_ids[order]
    rank_in_expert = torch.arange(N * k, device=x.device) - (ends - counts)[expert]
    kept_sorted = rank_in_expert < capacity
    slot = torch.where(kept_sorted, expert * capacity + rank_in_expert, E * capacity)  # scratch row E*C
    buf = x.new_zeros(E * capacity + 1, d).index_put_((slot,), x[order // k])  # each real slot written at most once
    hidden = _swiglu_rows(torch.bmm(buf[:-1].view(E, capacity, d), w_gate_up))
    out = torch.cat((torch.bmm(hidden, w_down).reshape(E * capacity, d), x.new_zeros(1, d)))  # scratch row: 0
    per_slot = torch.empty(N * k, d, dtype=out.dtype, device=x.device).index_copy_(0, order, out[slot]).view(N, k, d)
    kept = torch.empty(N * k, dtype=torch.bool, device=x.device).index_copy_(0, order, kept_sorted).view(N, k)
    weights = routing.weights * kept
    return (per_slot.float() * weights[..., None]).sum(1).to(x.dtype), kept


def loop_experts(x: torch.Tensor, routing: Routing, w_gate_up: torch.Tensor, w_down: torch.Tensor) -> torch.Tensor:
    """The reference: one expert at a time over the tokens routed to it (a host sync per expert), each
    token's slots summed in slot order as grouped_experts sums them."""
    N, k = routing.ids.shape
    per_slot = x.new_zeros(N, k, x.shape[-1], dtype=torch.float32)
    for e in range(w_gate_up.shape[0]):
        token, slot = (routing.ids == e).nonzero(as_tuple=True)
        if token.numel():
            y = _swiglu_rows(x[token] @ w_gate_up[e]) @ w_down[e]
            per_slot = per_slot.index_put((token, slot), y.float())
    return (per_slot * routing.weights[..., None]).sum(1).to(x.dtype)


def _keep_down_outputs(down: tuple[int, ...]) -> tuple[Any, Any]:
    """The expert recompute's selective checkpoint (MoE, recompute_experts): keep the down GEMM's output (the
    combine's backward reads it for the routing weights' gradient), recompute everything else: one grouped GEMM
    again in the backward, not two. The down GEMM is the one whose weight has experts_down's shape `down`
    (gate_up's [E, d, 2h] never does): grouped, batched under capacity routing, one expert's slice in the loop."""
    gemms = {torch.ops.aten._grouped_mm.default: down, torch.ops.aten.bmm.default: down,
             torch.ops.aten.mm.default: down[1:]}  # fmt: skip

    def policy(_ctx: Any, op: Any, *args: Any, **_kwargs: Any) -> CheckpointPolicy:
        if op in gemms and gemms[op] == tuple(args[1].shape):
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


class MoE(nn.Module):
    """[B,T,d] -> [B,T,d]: the mixture of experts (module docstring). Buffers: `bias` [E] (the balancing bias),
    `load` [E] (tokens routed to each expert since the last update_balance), `stats` (STATS). The router and
    the buffers stay fp32 under apply_precision (a bf16 load would stop counting past 256)."""

    _fp32_params = ("router", "bias", "load", "stats")

    def __init__(self, config: MoEConfig) -> None:
        super().__init__()
        if not isinstance(config, MoEConfig):
            raise TypeError(f"MoE needs a MoEConfig, got {type(config).__name__}")
        self.config = c = config
        E, d, h = c.n_experts, c.d_model, c.expert_hidden
        self.router = nn.Parameter(torch.randn(E, d) * c.init_std)
        self.experts_gate_up = nn.Parameter(torch.randn(E, d, 2 * h) * c.init_std)
        self.experts_down = nn.Parameter(torch.randn(E, h, d) * c.init_std)
        self.shared = SwiGLU(d, c.shared_hidden) if c.shared_hidden else None
        self.register_buffer("bias", torch.zeros(E))
        self.register_buffer("load", torch.zeros(E))
        self.register_buffer("stats", torch.zeros(len(STATS)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        c = self.config
        flat = x.reshape(-1, x.shape[-1])
        routing = route(flat, self.router, self.bias, c)
        if c.recompute_experts and torch.is_grad_enabled():
            # the routing goes in as plain tensors, so the recompute sends every token where the forward did
            y, kept = checkpoint(self._experts, flat, routing.ids, routing.weights, use_reentrant=False,
                                 context_fn=functools.partial(_keep_down_outputs, tuple(self.experts_down.shape)))
        else:
            y, kept = self._experts(flat, routing.ids, routing.weights)
        if self.shared is not None:
            y = y + self.shared(flat)
        loss, stats = self._losses(routing, kept)
        if self.training:  # the routing statistics (decode and evaluation leave them). A recompute under
            with torch.no_grad():  # checkpointing may add the same load again (torch stops one early once it has
                self.load.add_(stats["load"])  # what the backward needs): every expert's alike, signs unchanged
                self.stats.copy_(torch.stack([stats[k].float() for k in STATS]))
        if loss is not None:
            y = attach_loss(y, loss)
        return y.view_as(x)

    def _experts(self, flat: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor | None]:  # fmt: skip
        """The experts' output [N,d] and, under capacity routing, the kept mask [N,k] (None when dropless)."""
        c, routing = self.config, Routing(ids, weights)
        if c.capacity_factor is not None:
            return capacity_experts(flat, routing, self.experts_gate_up, self.experts_down, c.capacity(flat.shape[0]))
        if c.experts == "grouped":
            return grouped_experts(flat, routing, self.experts_gate_up, self.experts_down), None
        return loop_experts(flat, routing, self.experts_gate_up, self.experts_down), None

    def _losses(self, routing: Routing, kept: torch.Tensor | None) -> tuple[torch.Tensor | None, dict[str, torch.Tensor]]:
        """The weighted router losses (None when both weights are 0) and the batch's statistics."""
        c = self.config
        N, E = routing.logits.shape
        ones = torch.ones_like(routing.ids, dtype=torch.float32) if kept is None else kept.float()
        load = torch.zeros(E, device=ones.device).scatter_add_(0, routing.ids.reshape(-1), ones.reshape(-1))
        z_loss = torch.logsumexp(routing.logits, dim=-1).pow(2).mean()
        # Switch's balance loss: E * sum_e (the fraction of assignments to e) * (e's mean normalised score)
        share = routing.scores / routing.scores.sum(-1, keepdim=True)
        fraction = torch.zeros(E, device=ones.device).scatter_add_(
            0, routing.ids.reshape(-1), torch.ones_like(ones).reshape(-1)) / (N * c.top_k)  # fmt: skip
        aux_loss = E * (fraction.detach() * share.mean(0)).sum()
        stats = {"z_loss": z_loss.detach(), "aux_loss": aux_loss.detach(), "load": load,
                 "dropped_fraction": 1 - ones.mean(), "max_load_fraction": fraction.max()}  # fmt: skip
        terms = [w * v for w, v in ((c.z_loss_weight, z_loss), (c.aux_loss_weight, aux_loss)) if w > 0]
        return (sum(terms[1:], terms[0]) if terms else None), stats

    @torch.no_grad()
    def update_balance(self) -> None:
        """Move each expert's bias toward the mean load (balance="bias"; a no-op otherwise) and clear the load.
        Under torch.distributed the loads are summed over the ranks first, so every rank moves the same way."""
        if self.config.balance == "bias":
            load = self.load.clone()
            if torch.distributed.is_available() and torch.distributed.is_initialized():
                torch.distributed.all_reduce(load)
            self.bias.add_(self.config.bias_update_rate * torch.sign(load.mean() - load))
        self.load.zero_()


def moe_activation_fields(config: MoEConfig, tokens: int, dtype: torch.dtype, *, recompute: str = "none"
                          ) -> dict[str, int]:  # fmt: skip
    """What one MoE layer's forward keeps for the backward over `tokens` tokens of activations in `dtype`, in
    bytes, by field (the seeds' E-layer terms; the memory estimator's E fields):
      router     its fp32 input copy [N, d], logits and scores [N, E] fp32, the top-k [N, k]
      dispatch   the gathered rows (N*k dropless, E*C under capacity) [rows, d] and their sort order
      hiddens    the experts' hiddens: gate and up [rows, 2h], SiLU(gate) and the product [rows, h] each
      combine    the experts' outputs [rows, d], the per-slot outputs in fp32 [N, k, d] and the weights
    recompute (RECOMPUTE_FIELDS): "none"; "experts", the layer with MoEConfig.recompute_experts (the router's
    fields kept; dispatch holds the checkpoint's inputs, the rows [N, d] (16-bit: fp32 rows are the router's input)
    and the weights; the hiddens go; combine keeps the down GEMM's output alone);
    "save_list", an E-block save list that keeps the matmuls' outputs and the top-k (the router's logits and
    top-k alone). tests/test_moe.py holds each sum within 15% of what autograd keeps."""
    if recompute not in RECOMPUTE_FIELDS:
        raise ValueError(f"moe_activation_fields: recompute must be one of {RECOMPUTE_FIELDS}, got {recompute!r}")
    c = config
    N, E, k, d, h = tokens, c.n_experts, c.top_k, c.d_model, c.expert_hidden
    es = torch.tensor([], dtype=dtype).element_size()
    topk = N * k * (4 + 8)  # values fp32, indices int64
    if recompute == "save_list":
        return {"router": N * E * 4 + topk, "dispatch": 0, "hiddens": 0, "combine": 0}
    router = N * d * 4 + 2 * N * E * 4 + topk
    rows = N * k if c.capacity_factor is None else E * c.capacity(N) + 1
    if recompute == "experts":  # the rows: in fp32 they are the router's input itself (x.float() is x), else a copy
        return {"router": router, "dispatch": (N * d * es if es != 4 else 0) + N * k * 4, "hiddens": 0,
                "combine": (rows - (c.capacity_factor is not None)) * d * es}  # the down GEMM's output, kept
    return {"router": router, "dispatch": rows * d * es + 2 * N * k * 8,
            "hiddens": rows * 4 * h * es, "combine": rows * d * es + N * k * d * 4 + 2 * N * k * 4}  # fmt: skip


def update_balance(model: nn.Module) -> int:
    """MoE.update_balance on every MoE in the model (after the optimizer step); returns how many there were. The
    MoE layers are found once per model and remembered on it: the training loop calls this every step, and a
    walk over every module would be host time on the step's critical path."""
    layers = model.__dict__.get("_moe_layers")
    if layers is None:
        layers = [m for m in model.modules() if isinstance(m, MoE)]
        model.__dict__["_moe_layers"] = layers  # a plain attribute: no submodule registered, no state_dict entry
    for layer in layers:
        layer.update_balance()
    return len(layers)
