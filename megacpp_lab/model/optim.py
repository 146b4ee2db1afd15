"""The optimizer of a training run: MasterWeightAdamW and the learning-rate schedule.

MasterWeightAdamW: gradients into fp32 master weights, clip the global norm, fused AdamW on the masters, and
the bf16 model weights rounded from them. The DSA indexers (nn/dsa.py) learn from their own KL loss alone, as
DeepSeek-V3.2 trains them apart from the language model, so their gradients are clipped by their own norm: in the
global norm they would shrink the language model's step whenever the indexer's loss moved, and the reverse. Parameters a layer declares fp32 (`_fp32_params`: decays, RoPE
tables) are fp32 in the model and are their own masters. On a CPU in fp32 every parameter is its own master
and nothing is copied. Under FSDP2 the masters are the local shards (DTensors), and the global norm sums
over the mesh.

LR (lr_at): linear warmup from 0 to `lr` over `warmup_steps` (by default a tenth of `steps`, at most 100), then
cosine down to `lr * min_lr_ratio` at `steps`; a function of the step alone, so a resumed run needs no
scheduler state.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

if TYPE_CHECKING:
    from megacpp_lab.model.train_config import TrainConfig

__all__ = ["MasterWeightAdamW", "lr_at"]


def lr_at(step: int, config: TrainConfig) -> float:
    """Linear warmup to lr over warmup_steps, then cosine to lr * min_lr_ratio at `steps`."""
    if step < config.warmup_steps:
        return config.lr * (step + 1) / config.warmup_steps
    progress = min(1.0, (step - config.warmup_steps) / max(1, config.steps - config.warmup_steps))
    floor = config.lr * config.min_lr_ratio
    return floor + 0.5 * (config.lr - floor) * (1 + math.cos(math.pi * progress))


class MasterWeightAdamW:
    """AdamW over fp32 master weights of a (possibly bf16) model; see the module docstring.

    Weight decay applies to matrices (2-D and up), never to norms, biases, decays or the embedding."""

    def __init__(self, model: nn.Module, config: TrainConfig, *, fused: bool = True) -> None:
        self.named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        persistent = model.state_dict().keys()  # not the RoPE tables, which are rebuilt, never saved
        self.buffers = [(n, b) for n, b in model.named_buffers() if n in persistent]
        self.masters = [p if p.dtype == torch.float32 else p.detach().float().requires_grad_() for _, p in self.named]
        self.copied = [i for i, (_, p) in enumerate(self.named) if self.masters[i] is not p]
        from torch.distributed.tensor import DTensor

        # one group per (decay, sharded): under FSDP2 a fused step cannot mix DTensors with the replicated
        # fp32-contract parameters' plain tensors, and AdamW steps each group on its own
        groups = []
        for decays in (True, False):
            for sharded in (True, False):
                params = [m for (n, p), m in zip(self.named, self.masters)
                          if (p.dim() >= 2 and not n.startswith("embed.")) == decays and isinstance(p, DTensor) == sharded]
                if params:
                    groups.append(dict(params=params, weight_decay=config.weight_decay if decays else 0.0))
        self.optimizer = torch.optim.AdamW(groups, lr=config.lr, betas=(config.beta1, config.beta2), fused=fused)
        self.grad_clip = config.grad_clip
        # the DSA indexers' parameters: a clip group of their own (module docstring)
        self.apart = [i for i, (n, _) in enumerate(self.named) if ".indexer." in f".{n}"]

    def step(self, lr: float) -> torch.Tensor:
        """Gradients to the masters, clip, step, round back; returns the language model's global gradient norm
        (before clipping, a 0-dim fp32 tensor: no host sync; the DSA indexers' gradients are clipped by their own).

        Under FSDP2 the sharded masters and their gradients are DTensors, and every op on a list of DTensors
        pays DTensor's dispatch on the host (about 10 ms a step for the norm, the clip and the fused AdamW of
        the base preset, in a step the host must issue faster than the GPU runs it). Clipping and AdamW are
        elementwise on each shard, so they run on the local shards (DTensor.to_local, no copy); the norm
        sums the shards' squares over the mesh in one all-reduce."""
        for i in self.copied:
            g = self.named[i][1].grad
            self.masters[i].grad = None if g is None else g.float()
        apart = set(self.apart)
        grads = [m.grad for i, m in enumerate(self.masters) if m.grad is not None and i not in apart]
        norm = _global_norm(grads)
        indexer = [self.masters[i].grad for i in self.apart if self.masters[i].grad is not None]
        for group, group_norm in ((grads, norm), (indexer, _global_norm(indexer) if indexer else None)):
            if self.grad_clip > 0 and group:  # scale by min(1, clip / norm) on the device: no host sync
                factor = torch.clamp(self.grad_clip / (group_norm + 1e-6), max=1.0)
                torch._foreach_mul_(_local(group), factor)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self._adamw_step(lr)
        if self.copied:
            with torch.no_grad():
                torch._foreach_copy_([self.named[i][1] for i in self.copied], [self.masters[i] for i in self.copied])
        return norm.detach().float()

    @torch.no_grad()
    def _adamw_step(self, lr: float) -> None:
        """torch.optim.AdamW's fused step (the same `_foreach_add_` of the step counts and `_fused_adamw_`, so
        the same bits) on the local shards. The first step, and any step with a parameter that has no state
        yet, goes through torch.optim, which creates the state as it always does."""
        opt = self.optimizer
        live = [[p for p in g["params"] if p.grad is not None] for g in opt.param_groups]
        if not opt.defaults["fused"] or any(p not in opt.state for ps in live for p in ps):
            opt.step()
            return
        beta1, beta2 = opt.defaults["betas"]
        for group, params in zip(opt.param_groups, live):
            if not params:
                continue
            state = [opt.state[p] for p in params]
            steps = _local([st["step"] for st in state])
            torch._foreach_add_(steps, 1)
            torch._fused_adamw_(_local(params), _local([p.grad for p in params]), _local([st["exp_avg"] for st in state]),
                                _local([st["exp_avg_sq"] for st in state]), [], steps, amsgrad=False, lr=lr,
                                beta1=beta1, beta2=beta2, weight_decay=group["weight_decay"], eps=group["eps"],
                                maximize=False, grad_scale=None, found_inf=None)  # fmt: skip

    def zero_grad(self) -> None:
        for (_, p), m in zip(self.named, self.masters):
            p.grad = None
            m.grad = None

    def optimizer_state_by_name(self) -> dict[str, Any]:
        """The AdamW state keyed by parameter name (torch.distributed.checkpoint's layout), so a checkpoint
        fits any process count and any parameter order."""
        raw = self.optimizer.state_dict()
        index = self._names_in_optimizer_order()
        groups = [{**g, "params": [index[i] for i in g["params"]]} for g in raw["param_groups"]]
        return {"state": {index[i]: st for i, st in raw["state"].items()}, "param_groups": groups}

    def load_optimizer_state_by_name(self, state: dict[str, Any], where: str) -> None:
        """Load a state from optimizer_state_by_name (of this or any other process count); fails naming the field."""
        order = self._names_in_optimizer_order()
        index = {n: i for i, n in enumerate(order)}
        try:  # groups differ with the process count (FSDP2 splits sharded from replicated): match by name
            saved_group = {n: g for g in state["param_groups"] for n in g["params"]}
            groups, i = [], 0
            for mine in self.optimizer.param_groups:
                names = order[i : i + len(mine["params"])]
                i += len(names)
                hyper = [{k: v for k, v in saved_group[n].items() if k != "params"} for n in names]
                if any(h != hyper[0] for h in hyper):
                    raise ValueError(f"parameters {names[:3]}... share a group here but not in the checkpoint")
                groups.append({**hyper[0], "params": [index[n] for n in names]})
            raw = {"state": {index[n]: st for n, st in state["state"].items()}, "param_groups": groups}
            self.optimizer.load_state_dict(raw)
        except (KeyError, TypeError, ValueError, RuntimeError) as err:
            raise ValueError(f"{where}: field 'optimizer' does not fit this model: {type(err).__name__}: {err}") from None

    def _names_in_optimizer_order(self) -> list[str]:
        ids = {id(m): n for (n, _), m in zip(self.named, self.masters)}
        return [ids[id(m)] for g in self.optimizer.param_groups for m in g["params"]]

    def master_state_dict(self) -> dict[str, torch.Tensor]:
        """The model's parameters at full precision (the masters), by HybridLM parameter name, plus its
        buffers."""
        state = {n: m.detach().clone() for (n, _), m in zip(self.named, self.masters)}
        state.update((n, b.detach().clone()) for n, b in self.buffers)
        return state

    def load_master_state_dict(self, model: nn.Module, state: dict[str, torch.Tensor], where: str) -> None:
        """Load masters (and the model's weights rounded from them) and buffers; fails naming the tensor."""
        expected = dict(model.state_dict(keep_vars=True))
        missing, unexpected = sorted(set(expected) - set(state)), sorted(set(state) - set(expected))
        if missing or unexpected:
            raise ValueError(f"{where}: field 'model' does not fit this model: missing {missing[:5]}, "
                             f"unexpected {unexpected[:5]}")  # fmt: skip
        for name, t in expected.items():
            if not isinstance(state[name], torch.Tensor) or state[name].shape != t.shape:
                got = getattr(state[name], "shape", type(state[name]).__name__)
                raise ValueError(f"{where}: field 'model.{name}' has shape {tuple(got)}, this model's is {tuple(t.shape)}")
        with torch.no_grad():
            for (n, p), m in zip(self.named, self.masters):
                m.copy_(state[n])
                if m is not p:
                    p.copy_(m)
            for n, b in self.buffers:
                b.copy_(state[n])


def _local(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Each DTensor's local shard (a view: in-place ops on it update the DTensor), other tensors as they are."""
    from torch.distributed.tensor import DTensor

    return [t.to_local() if isinstance(t, DTensor) else t for t in tensors]


def _global_norm(grads: list[torch.Tensor]) -> torch.Tensor:
    """The L2 norm over every gradient, a 0-dim fp32 tensor on their device. FSDP2's sharded gradients
    (DTensors) add their local shards' squares, summed over the mesh in one all-reduce; the replicated
    fp32-contract gradients (plain tensors, the same on every rank) add theirs once."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    if not grads:
        return torch.zeros(())
    sharded = [g for g in grads if isinstance(g, DTensor)]
    plain = [g for g in grads if not isinstance(g, DTensor)]
    total = torch.zeros((), dtype=torch.float32, device=grads[0].device)
    if sharded:
        shards = _local(sharded)
        part = torch.stack(torch._foreach_norm(shards)).float().square().sum()
        dist.all_reduce(part, op=dist.ReduceOp.SUM, group=sharded[0].device_mesh.get_group())
        total = total + part
    if plain:
        total = total + torch.stack(torch._foreach_norm(plain)).float().square().sum()
    return total.sqrt()
