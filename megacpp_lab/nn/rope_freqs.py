"""Rotary-embedding frequency tables, including long-context (YaRN, Llama-3.1 piecewise) variants.

Convention (lab-wide): split-half rotation of an even rope slice of size d. With x1 = x[..., :d/2]
and x2 = x[..., d/2:]: y1 = x1*cos + x2*sin, y2 = -x1*sin + x2*cos, where cos/sin are float32
tables of shape [max_positions, d/2] and angle[p, i] = p * inv_freq[i].

Precompute only: the Triton RoPE kernels and the torch reference below both read the same
(cos, sin) tables, so every scaling variant lives here and there is one numerical contract.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from megacpp_lab.checks import is_int
from megacpp_lab.nn.config_builder import build_config

__all__ = ["RopeScaling", "apply_rope_reference", "rope_attention_scale", "rope_cos_sin", "rope_inv_freq"]

_KINDS = ("none", "yarn", "piecewise")


@dataclass(frozen=True)
class RopeScaling:
    """Long-context scaling of the rotary frequencies. Frozen, checked on construction."""

    kind: str = "none"  # "none" | "yarn" | "piecewise"
    factor: float = 1.0  # context extension factor (>= 1)
    original_max_positions: int = 4096
    beta_fast: float = 32.0  # yarn: rotations count above which a frequency is kept (extrapolation)
    beta_slow: float = 1.0  # yarn: rotations count below which a frequency is divided (interpolation)
    mscale: float = 1.0  # yarn attention-temperature coefficient: 0.1*mscale*ln(factor)+1
    low_freq_factor: float = 1.0  # piecewise (Llama-3.1) band edges
    high_freq_factor: float = 4.0

    def __post_init__(self) -> None:
        if self.kind not in _KINDS:
            raise ValueError(f"kind must be one of {_KINDS}, got {self.kind!r}")
        for name in ("factor", "beta_fast", "beta_slow", "mscale", "low_freq_factor", "high_freq_factor"):
            if not math.isfinite(getattr(self, name)):
                raise ValueError(f"{name} must be finite, got {getattr(self, name)}")
        if self.factor < 1.0:
            raise ValueError(f"factor must be >= 1 (context extension), got {self.factor}")
        if not is_int(self.original_max_positions):
            raise ValueError(f"original_max_positions must be an int, got {self.original_max_positions!r}")
        if self.original_max_positions <= 0:
            raise ValueError(f"original_max_positions must be positive, got {self.original_max_positions}")
        if self.beta_slow <= 0.0:
            raise ValueError(f"beta_slow must be positive, got {self.beta_slow}")
        if self.beta_fast <= self.beta_slow:
            raise ValueError(f"beta_fast ({self.beta_fast}) must be > beta_slow ({self.beta_slow})")
        if self.mscale < 0.0:
            raise ValueError(f"mscale must be >= 0, got {self.mscale}")
        if self.low_freq_factor <= 0.0:
            raise ValueError(f"low_freq_factor must be positive, got {self.low_freq_factor}")
        if self.low_freq_factor >= self.high_freq_factor:
            raise ValueError(
                f"low_freq_factor ({self.low_freq_factor}) must be < high_freq_factor ({self.high_freq_factor})"
            )

    @classmethod
    def build(cls, source: Any = None, **overrides: Any) -> RopeScaling:
        """The one builder: fields from a source object, read only as rope_scaling_<name> (the bare names,
        factor or kind, are too generic to take from a model config), and keyword overrides."""
        aliases = {name: (f"rope_scaling_{name}",) for name in cls.__dataclass_fields__}
        return build_config(cls, source, overrides, prefix="rope_scaling", aliases=aliases, required=())


def _check_dim_base(dim: int, base: float) -> None:
    if not is_int(dim) or dim < 2 or dim % 2:
        raise ValueError(f"dim must be an even int >= 2, got {dim!r}")
    if not math.isfinite(base) or base <= 1.0:
        raise ValueError(f"base must be finite and > 1, got {base}")


def rope_inv_freq(dim: int, base: float = 10000.0, scaling: RopeScaling = RopeScaling()) -> torch.Tensor:
    """Per-pair angular frequencies, [dim//2] float32 (computed in float64, rounded once)."""
    _check_dim_base(dim, base)
    inv = float(base) ** (-torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    # factor == 1 means no extension: return the plain table bit-for-bit (a blend
    # a*(1-g) + a*g is not guaranteed to round back to a).
    if scaling.kind == "none" or scaling.factor == 1.0:
        return inv.float()
    s, L = scaling.factor, scaling.original_max_positions
    if scaling.kind == "yarn":
        # NTK-by-parts (YaRN paper, eq. for gamma): r = rotations a frequency completes over the
        # original context. gamma = 1 keeps it (r >= beta_fast: well trained, extrapolate),
        # gamma = 0 divides by s (r <= beta_slow: never saw a full turn, interpolate), linear in r
        # between. h = (1 - gamma) * inv/s + gamma * inv.
        rotations = L * inv / (2 * math.pi)
        gamma = ((rotations - scaling.beta_slow) / (scaling.beta_fast - scaling.beta_slow)).clamp(0.0, 1.0)
        return (inv * ((1.0 - gamma) / s + gamma)).float()
    # piecewise (Llama-3.1): bands by wavelength against the original context.
    wavelen = 2 * math.pi / inv
    lo, hi = scaling.low_freq_factor, scaling.high_freq_factor
    smooth = ((L / wavelen - lo) / (hi - lo)).clamp(0.0, 1.0)
    out = (1.0 - smooth) * inv / s + smooth * inv  # smooth band
    out = torch.where(wavelen < L / hi, inv, out)  # short wavelengths: unchanged
    out = torch.where(wavelen > L / lo, inv / s, out)  # long wavelengths: divided by factor
    return out.float()


def rope_attention_scale(scaling: RopeScaling) -> float:
    """Magnitude folded into cos/sin. yarn: 0.1*mscale*ln(factor) + 1 for factor > 1, else 1.

    YaRN's temperature is sqrt(1/t) = 0.1*ln(s) + 1; scaling both q and k by it multiplies the
    logits by 1/t without touching the attention kernel. `mscale` is DeepSeek's coefficient on
    ln(s) (mscale=1 is the paper). Other kinds leave the logits alone: 1.0.
    """
    if scaling.kind != "yarn" or scaling.factor <= 1.0:
        return 1.0
    return 0.1 * scaling.mscale * math.log(scaling.factor) + 1.0


def rope_cos_sin(
    max_positions: int,
    dim: int,
    base: float = 10000.0,
    scaling: RopeScaling = RopeScaling(),
    device: torch.device | str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin tables, each [max_positions, dim//2] float32, yarn attention scale multiplied in."""
    if not is_int(max_positions) or max_positions < 1:
        raise ValueError(f"max_positions must be an int >= 1, got {max_positions!r}")
    inv = rope_inv_freq(dim, base, scaling)
    # Angles in float64 from the float32 inv_freq: p * inv_freq at p ~ 1e5 loses ~1e-2 rad in
    # float32, so the table is the correctly rounded value of the stated contract instead.
    pos = torch.arange(max_positions, dtype=torch.float64)
    angle = pos[:, None] * inv.double()[None, :]
    m = rope_attention_scale(scaling)
    cos = (angle.cos() * m).float()
    sin = (angle.sin() * m).float()
    return cos.to(device), sin.to(device)


def apply_rope_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [..., T, H, d] over its full last dim (split-half); cos/sin [T, d/2] already gathered.

    Computes in float32 and returns x.dtype, out of place. Passing -sin applies the transposed
    (inverse) rotation, which is what the kernels use for backward.
    """
    if x.dim() < 3:
        raise ValueError(f"x must be [..., T, H, d], got shape {tuple(x.shape)}")
    T, d = x.shape[-3], x.shape[-1]
    if d % 2:
        raise ValueError(f"x last dim (rope size d) must be even, got {d}")
    expected = (T, d // 2)
    for name, t in (("cos", cos), ("sin", sin)):
        if tuple(t.shape) != expected:
            raise ValueError(f"{name} shape: expected (T, d/2) = {expected}, got {tuple(t.shape)}")
    xf = x.float()
    c = cos.float()[:, None, :]  # [T, 1, d/2]: broadcast over H and leading dims
    s = sin.float()[:, None, :]
    x1, x2 = xf[..., : d // 2], xf[..., d // 2 :]
    y = torch.cat((x1 * c + x2 * s, -x1 * s + x2 * c), dim=-1)
    return y.to(x.dtype)
