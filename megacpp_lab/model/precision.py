"""bf16 mixed precision that honours fp32 contracts: one in-place cast, no wrapper module.

A submodule declares the parameters (or buffers) its numerics need in fp32 by name:

    class M2RNN(nn.Module):
        _fp32_params = ("A_log", "dt_bias", "D")   # the decay path

`apply_precision(model, torch.bfloat16)` casts every other floating parameter and buffer to bf16 once, in
place, and keeps the declared ones fp32 (they are made fp32 if they were not). Nothing is recast per step,
and the model stays the model: no caller unwraps anything. The training loop keeps fp32 master weights in the
optimizer (model/optim.py's MasterWeightAdamW). Under FSDP2 the model stays fp32 and FSDP2's
MixedPrecisionPolicy does the cast of the forward's copies (model/parallelize.py's apply_fsdp), with the
contract's parameters kept out of it.

A later blanket `model.to(torch.bfloat16)` casts the contract away like any other tensor: `check_precision`
fails closed on it, naming the tensor, and the fp32-contract tripwire (pack 16) is built to see it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

__all__ = ["FP32_ATTR", "PrecisionPlan", "apply_precision", "check_precision", "fp32_contract"]

FP32_ATTR = "_fp32_params"
LOW_DTYPES = (torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class PrecisionPlan:
    """What apply_precision did: the low-precision dtype, and the qualified names kept fp32 and cast."""

    dtype: torch.dtype
    fp32: tuple[str, ...]
    cast: tuple[str, ...]


def fp32_contract(model: nn.Module) -> tuple[str, ...]:
    """Qualified names of the tensors that submodules declare fp32 (declared names set to None are skipped)."""
    names: list[str] = []
    for path, module in model.named_modules():
        declared = getattr(type(module), FP32_ATTR, ())
        if isinstance(declared, str) or not all(isinstance(n, str) for n in declared):
            raise ValueError(f"{type(module).__name__}.{FP32_ATTR} must be a tuple of names, got {declared!r}")
        for name in declared:
            qual = f"{path}.{name}" if path else name
            if name in module._parameters or name in module._buffers:
                if (module._parameters.get(name) if name in module._parameters else module._buffers.get(name)) is not None:
                    names.append(qual)
            elif hasattr(module, name) and getattr(module, name) is None:
                continue  # an optional tensor this instance does not have (e.g. M2RNN's D without the residual)
            else:
                raise ValueError(f"{type(module).__name__} at '{path or '<root>'}' declares {FP32_ATTR} '{name}', "
                                 "which is not one of its own parameters or buffers")  # fmt: skip
    return tuple(names)


def _floating(model: nn.Module) -> dict[str, tuple[nn.Module, str, bool]]:
    """qualified name -> (owning module, local name, is_parameter) for every floating tensor."""
    out: dict[str, tuple[nn.Module, str, bool]] = {}
    for path, module in model.named_modules():
        for store, is_param in ((module._parameters, True), (module._buffers, False)):
            for name, t in store.items():
                if t is not None and t.is_floating_point():
                    out[f"{path}.{name}" if path else name] = (module, name, is_param)
    return out


def _tensor(owner: nn.Module, name: str, is_param: bool) -> torch.Tensor:
    return owner._parameters[name] if is_param else owner._buffers[name]


def apply_precision(model: nn.Module, dtype: torch.dtype = torch.bfloat16) -> PrecisionPlan:
    """Cast `model` in place, once: every floating parameter and buffer to `dtype` except the fp32 contract,
    which is kept (or made) fp32. Parameters stay the same nn.Parameter objects (their .data is replaced), so
    an optimizer or a hook built before still holds them. Returns the plan check_precision checks against."""
    if dtype not in LOW_DTYPES:
        raise ValueError(f"apply_precision dtype must be torch.bfloat16 or torch.float16, got {dtype}")
    keep = set(fp32_contract(model))
    tensors = _floating(model)
    with torch.no_grad():
        for qual, (owner, name, is_param) in tensors.items():
            t = _tensor(owner, name, is_param)
            value = t.detach().float() if qual in keep else t.detach().to(dtype)
            if is_param:
                t.data = value
            else:
                owner._buffers[name] = value
    return PrecisionPlan(dtype, tuple(sorted(keep)), tuple(sorted(set(tensors) - keep)))


def check_precision(model: nn.Module, plan: PrecisionPlan) -> None:
    """Fail closed, naming the tensor, if the model drifted from the plan (a later blanket or in-place cast)."""
    tensors = _floating(model)
    for quals, want in ((plan.fp32, torch.float32), (plan.cast, plan.dtype)):
        for qual in quals:
            if qual not in tensors:
                raise ValueError(f"tensor '{qual}' of the precision plan is gone from the model")
            t = _tensor(*tensors[qual])
            if t.dtype != want:
                what = "fp32-contract tensor" if want == torch.float32 else "tensor"
                raise ValueError(f"{what} '{qual}' is {t.dtype}, the precision plan says {want}")
