"""bf16 mixed precision that honours fp32 contracts.

A submodule declares the parameters (or buffers) its numerics need in fp32 by name:

    class M2RNN(nn.Module):
        _fp32_params = ("A_log", "dt_bias", "D")   # the decay path

`apply_mixed_precision(model)` casts every other floating parameter and buffer to bf16 once, at wrap
time, and keeps the declared ones fp32. Nothing is recast per step. A later `model.to(torch.bfloat16)`
(or `.half()`) on the wrapper keeps the contract too: the fp32 values are restored from a copy taken
before the cast, not cast back up from rounded values.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

__all__ = ["FP32_ATTR", "MixedPrecision", "PrecisionPlan", "apply_mixed_precision", "fp32_contract"]

FP32_ATTR = "_fp32_params"


@dataclass(frozen=True)
class PrecisionPlan:
    """What the wrapper did: the low-precision dtype, and the qualified names kept fp32 and cast."""

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


def _tensors(model: nn.Module) -> dict[str, tuple[nn.Module, str, bool]]:
    """qualified name -> (owning module, local name, is_parameter) for every floating tensor."""
    out: dict[str, tuple[nn.Module, str, bool]] = {}
    for path, module in model.named_modules():
        for store, is_param in ((module._parameters, True), (module._buffers, False)):
            for name, t in store.items():
                if t is not None and t.is_floating_point():
                    out[f"{path}.{name}" if path else name] = (module, name, is_param)
    return out


def _set(module: nn.Module, name: str, is_param: bool, value: torch.Tensor) -> None:
    if is_param:
        module._parameters[name].data = value
    else:
        module._buffers[name] = value


class MixedPrecision(nn.Module):
    """Wraps a module: its tensors in `dtype` except the fp32 contract; floating inputs cast to `dtype`."""

    def __init__(self, module: nn.Module, dtype: torch.dtype = torch.bfloat16, *, cast_inputs: bool = True) -> None:
        super().__init__()
        if dtype not in (torch.bfloat16, torch.float16):
            raise ValueError(f"dtype must be torch.bfloat16 or torch.float16, got {dtype}")
        self.module = module
        self.dtype = dtype
        self.cast_inputs = cast_inputs
        keep = set(fp32_contract(module))
        tensors = _tensors(module)
        for qual, (owner, name, is_param) in tensors.items():  # once, here: never per step
            t = owner._parameters[name] if is_param else owner._buffers[name]
            _set(owner, name, is_param, t.detach().float() if qual in keep else t.detach().to(dtype))
        self.plan = PrecisionPlan(dtype, tuple(sorted(keep)), tuple(sorted(set(tensors) - keep)))

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self.cast_inputs:
            cast = lambda a: a.to(self.dtype) if isinstance(a, torch.Tensor) and a.is_floating_point() else a  # noqa: E731
            args = tuple(cast(a) for a in args)
            kwargs = {k: cast(v) for k, v in kwargs.items()}
        return self.module(*args, **kwargs)

    def _apply(self, fn, recurse=True):
        # keep the contract under .to(dtype) / .half(): restore the fp32 values saved before the cast
        tensors = _tensors(self.module)
        saved = {q: (tensors[q][0]._parameters if tensors[q][2] else tensors[q][0]._buffers)[tensors[q][1]].detach().clone()
                 for q in self.plan.fp32 if q in tensors}  # fmt: skip
        super()._apply(fn, recurse)
        for qual, value in saved.items():
            owner, name, is_param = _tensors(self.module)[qual]
            now = owner._parameters[name] if is_param else owner._buffers[name]
            if now.dtype != torch.float32:
                _set(owner, name, is_param, value.to(device=now.device))
        return self

    def check_contract(self) -> None:
        """Fail closed, naming the tensor, if anything drifted from the plan (e.g. a later in-place cast)."""
        tensors = _tensors(self.module)
        for qual in self.plan.fp32:
            owner, name, is_param = tensors[qual]
            t = owner._parameters[name] if is_param else owner._buffers[name]
            if t.dtype != torch.float32:
                raise ValueError(f"fp32-contract tensor '{qual}' is {t.dtype}")
        for qual in self.plan.cast:
            owner, name, is_param = tensors[qual]
            t = owner._parameters[name] if is_param else owner._buffers[name]
            if t.dtype != self.dtype:
                raise ValueError(f"tensor '{qual}' is {t.dtype}, the plan says {self.dtype}")


def apply_mixed_precision(model: nn.Module, dtype: torch.dtype = torch.bfloat16, *, cast_inputs: bool = True) -> MixedPrecision:
    """torchtitan-style entry point: wrap `model` in MixedPrecision (see the module docstring)."""
    return MixedPrecision(model, dtype, cast_inputs=cast_inputs)
