"""Shared pieces of the layers: the doc-masked causal depthwise conv, the parameter-free RMSNorm,
the context gate (Engram, the hashed n-gram memory and M2RNN use them), the Mamba-style decay
parameters with their config checks (M2RNN and SSD), and the SwiGLU MLP (every block's FFN, MoE's shared
expert)."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from megacpp_lab.kernels.doc_conv import CONV_DTYPES, doc_conv
from megacpp_lab.varlen import PackedContext, context_positions, doc_causal_shift, same_doc_as_lag

__all__ = ["CONV_IMPLS", "DocCausalDepthwiseConv", "ParameterFreeRMSNorm", "SwiGLU", "attach_loss", "check_decay_init",
           "context_gate", "conv_stepper", "init_decay_params"]

# "auto": the Triton kernel where it can launch (CUDA) for the dtypes it takes, xla_safe elsewhere (a documented
# choice per call, by device and dtype: the CPU and float64 have no Triton kernel)
CONV_IMPLS = ("xla_safe", "maxtext_depthwise", "triton", "auto")


class ParameterFreeRMSNorm(nn.Module):
    """Parameter-free RMSNorm: exactly one fused F.rms_norm call.

    Never the manual x.pow(2).mean(-1) form: it loses bf16 precision on large
    activations and breaks Inductor's fusion (docs/design.md, historical bugs).
    """

    def __init__(self, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), weight=None, eps=self.eps)


class SwiGLU(nn.Module):
    """[..., d] -> [..., d]: w_down(SiLU(w_gate x) * w_up x), the gate and up projections as one matrix."""

    def __init__(self, d_model: int, hidden: int) -> None:
        super().__init__()
        self.w_gate_up = nn.Linear(d_model, 2 * hidden, bias=False)
        self.w_down = nn.Linear(hidden, d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.w_gate_up(x).chunk(2, dim=-1)
        return self.w_down(F.silu(gate) * up)


def context_gate(h_norm: torch.Tensor, k_norm: torch.Tensor) -> torch.Tensor:
    """alpha = sigmoid(RMSNorm(h) . RMSNorm(k) / sqrt(C)), [B,T,1]: how much memory this context wants."""
    return torch.sigmoid((h_norm * k_norm).sum(-1, keepdim=True) / math.sqrt(h_norm.shape[-1]))


class DocCausalDepthwiseConv(nn.Module):
    """Depthwise (groups=D) causal conv over time on [B,T,D], doc-masked.

    Three implementations, the same numbers up to rounding (each sums in fp32 for 16-bit inputs):
    - xla_safe (the default): unfold by hand, each of the K taps a doc-masked shift of x, weighted sum: pointwise
      work that inductor fuses into one kernel, and one reduction for the weight's gradient. (No Tensor.unfold:
      Inductor's CPU backward for a masked unfold corrupted memory.)
    - triton: kernels/doc_conv.py's op, one forward pass and two backward passes (the SiLU fused when forward is
      asked for it), against xla_safe in tests/test_doc_conv.py; "auto" takes it on CUDA for fp32/bf16/fp16 inputs
      and xla_safe elsewhere.
    - maxtext_depthwise: nn.Conv1d-style F.conv1d(groups=D) over the row; the first K-1
      tokens of each document, whose window would reach into the previous one, take the
      masked unfold result instead (torch.where, so nothing crosses, not even a NaN). ATen's depthwise kernels
      and the transposes around them, plus the unfold for the document starts: on an H100 at the R block's
      [4, 4096, 2304] in bf16 its compiled forward and backward took 1.87 ms of kernels against xla_safe's 0.45
      (eager 5.9 against 3.6 ms; scripts/conv_probe.py, a probe), so it stays only as the contender.
    """

    def __init__(self, channels: int, kernel: int, impl: str = "xla_safe", *, bias: bool = True) -> None:
        super().__init__()
        if impl not in CONV_IMPLS:
            raise ValueError(f"conv_impl must be one of {CONV_IMPLS}, got {impl!r}")
        if kernel < 1:
            raise ValueError(f"conv kernel must be >= 1, got {kernel}")
        self.kernel = kernel
        self.impl = impl
        # nn.Conv1d(channels, channels, kernel, groups=channels) layout and init
        conv = nn.Conv1d(channels, channels, kernel, groups=channels, bias=bias)
        self.weight = nn.Parameter(conv.weight.detach().clone())  # [D, 1, K]
        self.bias = nn.Parameter(conv.bias.detach().clone()) if bias else None  # [D]

    def _tap_sum(self, tap: Callable[[int], torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        """sum over lags of tap(lag) * the lag's weight, plus the bias, in fp32 for 16-bit inputs (as F.conv1d
        accumulates: bf16 sums would round at every tap in eager), out in `dtype`. tap(lag) is the input `lag`
        tokens back, in the input's dtype (the products promote: eager's autograd keeps it, not an fp32 copy). The
        forward and the decode step both sum here, in this one order: the step equals the forward bit for bit."""
        K = self.kernel
        w = self.weight[:, 0].to(torch.promote_types(self.weight.dtype, torch.float32))
        out = tap(0) * w[:, K - 1]
        if self.bias is not None:
            out = out + self.bias.to(w.dtype)
        for lag in range(1, K):
            out = out + tap(lag) * w[:, K - 1 - lag]
        return out.to(dtype)

    def _unfold_sum(self, x: torch.Tensor, positions: torch.Tensor | None) -> torch.Tensor:
        """The K taps of each window as K doc-masked shifts of x, weighted and summed (_tap_sum)."""
        return self._tap_sum(lambda lag: doc_causal_shift(x, positions, lag), x.dtype)

    def forward(self, x: torch.Tensor, ctx: PackedContext | None = None, *, silu: bool = False) -> torch.Tensor:
        """x [B,T,D]; ctx, the batch's PackedContext (None: one document per row). silu: F.silu of the conv's
        output (what the layers apply next; the Triton form fuses it)."""
        positions = context_positions(ctx, tuple(x.shape))
        impl = self.impl
        if impl == "auto":
            impl = "triton" if x.device.type == "cuda" and x.dtype in CONV_DTYPES else "xla_safe"
        if impl == "triton":
            return doc_conv(x, self.weight, self.bias, positions, silu=silu)
        y = self._conv_torch(x, positions, impl)
        return F.silu(y) if silu else y

    def _conv_torch(self, x: torch.Tensor, positions: torch.Tensor | None, impl: str) -> torch.Tensor:
        if impl == "xla_safe":
            return self._unfold_sum(x, positions)
        K = self.kernel
        full = F.conv1d(F.pad(x.transpose(1, 2), (K - 1, 0)), self.weight, self.bias, groups=x.shape[-1])
        full = full.transpose(1, 2)
        if positions is None or K == 1:
            return full
        clean = same_doc_as_lag(positions, K - 1)  # the whole window lies in the token's document
        return torch.where(clean[..., None], full, self._unfold_sum(x, positions))

    # -- decode: the recurrent form

    def init_window(self, batch: int, device: torch.device | str | None = None,
                    dtype: torch.dtype | None = None) -> torch.Tensor:  # fmt: skip
        """[B, K-1, D] zeros: the inputs before a document start, exactly the forward's zero padding."""
        return torch.zeros(batch, self.kernel - 1, self.weight.shape[0], device=device, dtype=dtype)

    def step(self, x: torch.Tensor, window: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One token x [B,1,D] after `window` [B,K-1,D] (the last K-1 inputs) -> (y [B,1,D], the next window)."""
        taps = torch.cat([window, x.to(window.dtype)], dim=1)  # [B,K,D], oldest first: F.conv1d's tap order
        y = self._tap_sum(lambda lag: taps[:, self.kernel - 1 - lag], x.dtype)  # the forward's sum, term by term
        return y[:, None], taps[:, 1:]

    def extra_repr(self) -> str:
        return f"channels={self.weight.shape[0]}, kernel={self.kernel}, impl={self.impl}"


def conv_stepper(conv: DocCausalDepthwiseConv | None, state: Any) -> Callable[[torch.Tensor], torch.Tensor]:
    """x [B,1,D] -> conv.step over the window held in state.conv, advancing it: the decode twin of a layer's
    `lambda x: conv(x, ctx)` (never called when the layer has no conv)."""

    def step(x: torch.Tensor) -> torch.Tensor:
        y, state.conv = conv.step(x, state.conv)
        return y

    return step


def check_decay_init(config: Any, fail: Callable[[str, str, Any], Exception]) -> None:
    """Fail closed on a config's A_init_range, dt_min, dt_max and dt_init_floor (fail names the field)."""
    lo, hi = config.A_init_range if len(config.A_init_range) == 2 else (None, None)
    if lo is None or not 0 < lo <= hi:
        raise fail("A_init_range", "(lo, hi) with 0 < lo <= hi", config.A_init_range)
    if not 0 < config.dt_min <= config.dt_max < 1:
        bad = "dt_max" if 0 < config.dt_min <= config.dt_max else "dt_min"
        raise fail(bad, "0 < dt_min <= dt_max < 1", (config.dt_min, config.dt_max))
    if not 0 < config.dt_init_floor <= config.dt_min:
        raise fail("dt_init_floor", f"in (0, dt_min={config.dt_min}]", config.dt_init_floor)


def init_decay_params(n_heads: int, config: Any) -> tuple[nn.Parameter, nn.Parameter]:
    """Mamba's decay initialisation, per head: A_log = log(A), A ~ U(A_init_range), and dt_bias =
    softplus^-1(dt) with dt log-uniform in [dt_min, dt_max], floored at dt_init_floor."""
    lo, hi = config.A_init_range
    A_log = nn.Parameter(torch.log(torch.empty(n_heads).uniform_(lo, hi)))
    dt = torch.exp(torch.rand(n_heads) * (math.log(config.dt_max) - math.log(config.dt_min)) + math.log(config.dt_min))
    dt = dt.clamp(min=config.dt_init_floor)
    return A_log, nn.Parameter(dt + torch.log(-torch.expm1(-dt)))  # softplus^-1(dt)


class _AttachLoss(torch.autograd.Function):
    """y unchanged forward; backward: y's gradient, and 1 for the loss (as if it were added to the model's)."""

    @staticmethod
    def forward(ctx: Any, y: torch.Tensor, loss: torch.Tensor) -> torch.Tensor:
        ctx.loss_shape = loss.shape
        ctx.loss_dtype = loss.dtype
        return y.view_as(y)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return grad, torch.ones(ctx.loss_shape, dtype=ctx.loss_dtype, device=grad.device)


def attach_loss(y: torch.Tensor, loss: torch.Tensor) -> torch.Tensor:
    """y, carrying `loss` (a scalar) into the backward: whatever loss the model's output reaches gets loss's
    gradient added, with weight 1 (weight it before: the MoE's router losses, DSA's indexer loss). Under gradient accumulation over n
    micro-batches whose loss is divided by n, an attached loss counts n times as much as in one batch. Every
    backward through y adds it, whatever y's gradient: a Jacobian of y (influence_matrix(method="jacobian"))
    shows it as a floor of influence between all tokens, so measure an E block's influence by perturbation
    (the leak harness's default), or with z_loss_weight=0."""
    return _AttachLoss.apply(y, loss)
