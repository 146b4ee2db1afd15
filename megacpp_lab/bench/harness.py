"""The model-step harness every whole-model benchmark, test and notebook shares: a shape, a seeded packed
batch, a model built through `parallelize`, and one training step on it (which starts the cold compile's
workers on its first call when the model is regionally compiled).

    shape = ModelShape("base", B=4, T=4096, docs=8)
    model = build_model(triton_config(shape.preset, "cuda"), "cuda", parallel=ParallelConfig(compile=True))
    tokens, doc_ids, targets = make_batch(shape, model.config.vocab_size, "cuda")
    step = TrainingStep(model, tokens, build_context(doc_ids), targets)
    loss = step()
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from megacpp_lab.data import next_token_targets
from megacpp_lab.model.config import HybridConfig, model_config
from megacpp_lab.model.hybrid import HybridLM
from megacpp_lab.model.parallelize import ParallelConfig, parallelize
from megacpp_lab.model.precompile import Precompile, precompile
from megacpp_lab.nn.moe import update_balance
from megacpp_lab.profiling import LABEL_SEP, peak_extra_mib, sync, time_ms
from megacpp_lab.varlen import PackedContext, doc_ids_from_cu_seqlens, packed_cu_seqlens

__all__ = ["FORWARD_ONLY", "FULL_SHAPE", "OTHER_NOTE", "SMALL_COMPILE_SHAPE", "SMALL_SHAPE", "ModelShape", "TrainingStep",
           "build_model", "fresh_dynamo", "leak_features", "make_batch", "measure_fwd_bwd", "profile_labels", "timed_call",
           "triton_config"]


@dataclass(frozen=True)
class ModelShape:
    preset: str
    B: int
    T: int
    docs: int  # documents per row, of seeded-random lengths


FULL_SHAPE = ModelShape("base", B=4, T=4096, docs=8)
SMALL_SHAPE = ModelShape("tiny", B=2, T=64, docs=3)
SMALL_COMPILE_SHAPE = ModelShape("tiny", B=1, T=32, docs=2)  # the interpreted Triton scans: seconds a step


def leak_features(n_layers: int) -> dict[str, Any]:
    """Every optional branch on: mHC over the Engram layers, the n-gram memory at layer 2, a CBlock at the
    middle layer."""
    return dict(mhc=True, ngram_layers=(min(2, n_layers - 1),), cblock_layers=(n_layers // 2,))


def triton_config(preset: str, device: str, **overrides: Any) -> HybridConfig:
    """The preset with the scans on Triton everywhere (under the interpreter on a CPU): a compiled graph may
    hold the scans' custom ops, never the reference loops."""
    return model_config(preset, device, compiled=True, **overrides)


def fresh_dynamo() -> None:
    """Forget every compiled graph and zero dynamo's counters (the next compile is cold in this process)."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()


def build_model(config: HybridConfig, device: str, *, seed: int = 0, parallel: ParallelConfig | None = None) -> HybridLM:
    """HybridLM on the device, made ready by parallelize (model/parallelize.py) under `parallel` (default
    ParallelConfig(): bf16 on a GPU with the fp32 contract kept, fp32 on a CPU, eager, no remat)."""
    torch.manual_seed(seed)
    with torch.device(device):  # initialised where it runs: seconds of host-side init and a copy saved at base
        model = HybridLM(config).to(device)  # .to: what a layer draws on the CPU on purpose (seeded tables)
    return parallelize(model, parallel or ParallelConfig(), device=device)


def make_batch(shape: ModelShape, vocab_size: int, device: str, *, seed: int = 0, ignore_index: int = -100,
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """tokens, doc_ids, targets [B,T]: uniform token ids (3.. vocab: no specials), `docs` documents of
    seeded-random lengths per row, next-token targets ignored at each document's last token."""
    g = torch.Generator().manual_seed(seed)
    cu = packed_cu_seqlens(shape.B, shape.T, shape.docs, g)
    doc_ids = doc_ids_from_cu_seqlens(cu, shape.B, shape.T)
    tokens = torch.randint(3, vocab_size, (shape.B, shape.T), generator=g)
    return tokens.to(device), doc_ids.to(device), next_token_targets(tokens, doc_ids, ignore_index).to(device)


def profile_labels(model: HybridLM) -> dict[str, nn.Module]:
    """'<bucket>|<module path>' -> module, for label_modules: each block under its letter, the Engram /
    n-gram / concept-bank branches inside it under their own bucket (the innermost range wins), the
    embedding, final norm and LM head. The buckets are those of HybridLM.num_parameters."""
    labels: dict[str, nn.Module] = {f"embedding{LABEL_SEP}embed": model.embed}
    for i, block in enumerate(model.blocks):
        labels[f"{block.kind}{LABEL_SEP}blocks.{i}"] = block
        for name in ("engram", "ngram", "cblock"):
            if getattr(block, name) is not None:
                labels[f"{name}{LABEL_SEP}blocks.{i}.{name}"] = getattr(block, name)
    labels[f"final_norm{LABEL_SEP}norm"] = model.norm
    labels[f"lm_head{LABEL_SEP}lm_head"] = model.lm_head
    return labels


# the embedding's input and the LM head's output (a NamedTuple) take no backward range: see `other` below
FORWARD_ONLY = (f"embedding{LABEL_SEP}embed", f"lm_head{LABEL_SEP}lm_head")
OTHER_NOTE = (
    "'other': kernels launched outside every labelled range: the embedding's backward, the LM head's "
    "backward (it only scales the gradients the fused loss formed in its forward), gradient zeroing, the "
    "optimizer when it is in the step"
)


class TrainingStep:
    """One training step on a fixed batch, eager or regionally compiled: zero the grads, forward to the loss,
    backward; optionally an optimizer step. The batch's context is built once, outside the step, as the
    training loop does. The first call of a compiled model's first step starts precompile's workers."""

    def __init__(self, model: nn.Module, tokens: torch.Tensor, ctx: PackedContext, targets: torch.Tensor,
                 optimizer: torch.optim.Optimizer | None = None) -> None:  # fmt: skip
        self.model, self.tokens, self.ctx, self.targets, self.optimizer = model, tokens, ctx, targets, optimizer
        self.precompile: Precompile | None = None  # the first step's compile workers, if it started any
        self.steps = 0

    def __call__(self) -> torch.Tensor:
        if self.steps == 0:  # a regionally compiled model compiles its block structures at once (precompile)
            self.precompile = precompile(self.model, self.tokens, self.ctx, self.targets)
        self.steps += 1
        self.model.zero_grad(set_to_none=True)
        loss = self.model(self.tokens, self.ctx, self.targets).loss
        loss.backward()
        if self.optimizer is not None:
            self.optimizer.step()
            update_balance(self.model)  # E blocks: their routing bias, as the training loop moves it
        return loss.detach()

    def release(self) -> None:
        """Free the gradients, so that a peak measured next starts from parameters and batch alone."""
        self.model.zero_grad(set_to_none=True)

    def forward_only(self) -> torch.Tensor:
        with torch.no_grad():
            return self.model(self.tokens, self.ctx, self.targets).loss


# ----------------------------------------------------------------------------- kernel timing (the scan benchmarks)


def measure_fwd_bwd(fwd: Callable[[], object], fwd_bwd: Callable[[], object] | None, *, device: str,
                    rep: int) -> dict[str, float]:  # fmt: skip
    """fwd_ms (no_grad), ms (fwd+bwd), bwd_ms and, on a GPU, peak_mib of fwd+bwd; the callers have warmed up
    (rep=1: a --small smoke run, one timed call and no warm-up)."""
    warmup = 0 if rep == 1 else 2
    out = {"fwd_ms": time_ms(fwd, warmup=warmup, rep=rep, device=device)}
    if fwd_bwd is not None:
        if device == "cuda":
            out["peak_mib"] = peak_extra_mib(fwd_bwd)
        out["ms"] = time_ms(fwd_bwd, warmup=warmup, rep=rep, device=device)
        out["bwd_ms"] = out["ms"] - out["fwd_ms"]
    return out


def timed_call(fn: Callable[[], Any], device: str) -> tuple[Any, float]:
    """fn's result and the seconds of this one call (for first calls: JIT, autotuning, torch.compile)."""
    sync(device)
    t0 = time.perf_counter()
    out = fn()
    sync(device)
    return out, time.perf_counter() - t0
