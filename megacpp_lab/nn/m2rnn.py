"""M2RNN layer: a matrix-state recurrent mixer (state K x V per head).

    x -> input_proj -> [q k v | decay input | output gate]
      -> doc-masked causal conv1d + SiLU over q, k, v
      -> f = exp(-A * softplus(decay + dt_bias))                      (softplus_decay_gate)
      -> recurrence (megacpp_lab.kernels.m2rnn: Triton by default on a GPU)
      -> + v * D  -> * SiLU(gate) -> RMSNorm -> output_proj

The recurrence runs through a registered custom op, so a regionally compiled block that holds
this layer has no graph break; the reference loop is disabled for dynamo so that a whole-model
compile never unrolls S steps.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from megacpp_lab.checks import check_ints, config_error
from megacpp_lab.kernels.m2rnn import KERNELS, m2rnn_scan
from megacpp_lab.varlen import PackedContext, context_positions
from megacpp_lab.nn.config_builder import build_config
from megacpp_lab.nn.primitives import CONV_IMPLS, DocCausalDepthwiseConv, check_decay_init, conv_stepper, init_decay_params

__all__ = ["M2RNN", "M2RNNConfig", "M2RNNMegatronMixer", "M2RNNState", "softplus_decay_gate"]


_fail = functools.partial(config_error, "M2RNNConfig")


@dataclass(frozen=True)
class M2RNNConfig:
    """M2RNN layer settings; build it with M2RNNConfig.build. Frozen, checked on construction."""

    d_model: int
    n_heads: int
    k_head_dim: int = 64
    v_head_dim: int = 16
    conv_kernel: int = 4
    # nn/primitives.CONV_IMPLS: the q/k/v conv's form. "auto": kernels/doc_conv.py's Triton op on a GPU (xla_safe on
    # a CPU and for float64). Its first form (a one-pass backward) measured faster than xla_safe in the compiled R
    # block on an H100 (scripts/conv_probe.py's R block rows, profiles/nvidia-h100-80gb-hbm3/compile/conv_probe.json,
    # at aba0e7f); the two-pass backward that replaced it is not yet timed on a GPU
    conv_impl: str = "auto"
    gradient_clipping: float = 0.0
    residual: bool = True
    A_init_range: tuple[float, float] = (1.0, 16.0)
    dt_min: float = 0.001
    dt_max: float = 0.1
    dt_init_floor: float = 1e-4
    chunk: int = 64
    kernel: str = "auto"
    eps: float = 1e-6

    def __post_init__(self) -> None:
        object.__setattr__(self, "A_init_range", tuple(self.A_init_range))
        check_ints("M2RNNConfig", self, ("d_model", "n_heads", "k_head_dim", "v_head_dim", "conv_kernel", "chunk"), low=None)
        if self.d_model < 1 or self.n_heads < 1:
            raise _fail("d_model" if self.d_model < 1 else "n_heads", "an int >= 1", min(self.d_model, self.n_heads))
        for name in ("k_head_dim", "v_head_dim"):
            value = getattr(self, name)
            if value < 16 or value & (value - 1):
                raise _fail(name, "a power of two >= 16 (the Triton kernel's block shape)", value)
        if not 0 <= self.conv_kernel <= 16:
            raise _fail("conv_kernel", "0 (no conv) or a kernel size in 1..16", self.conv_kernel)
        if self.conv_impl not in CONV_IMPLS:
            raise _fail("conv_impl", f"one of {CONV_IMPLS}", self.conv_impl)
        if not isinstance(self.gradient_clipping, (int, float)) or isinstance(self.gradient_clipping, bool) or not (
            0 <= self.gradient_clipping < math.inf
        ):
            raise _fail("gradient_clipping", "a finite float >= 0 (0 = off)", self.gradient_clipping)
        if not isinstance(self.residual, bool):
            raise _fail("residual", "a bool", self.residual)
        check_decay_init(self, _fail)
        if self.chunk < 1:
            raise _fail("chunk", "an int >= 1 (steps between stored states)", self.chunk)
        if self.kernel not in KERNELS:
            raise _fail("kernel", f"one of {KERNELS}", self.kernel)
        if not isinstance(self.eps, float) or not 0 < self.eps < 1:
            raise _fail("eps", "a float in (0, 1)", self.eps)

    @classmethod
    def build(cls, source: Any = None, **overrides: Any) -> M2RNNConfig:
        """The one builder: fields from a model config object (attributes with these names, or
        Megatron's hidden_size / num_attention_heads) and keyword overrides, else the defaults."""
        aliases = {"d_model": ("d_model", "hidden_size"), "n_heads": ("m2rnn_heads", "n_heads", "num_attention_heads")}
        return build_config(cls, source, overrides, prefix="m2rnn", aliases=aliases, required=("d_model", "n_heads"))


def softplus_decay_gate(x: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor) -> torch.Tensor:
    """Forget factor f = exp(-A * softplus(x + dt_bias)) in (0, 1), A = exp(A_log) > 0, in fp32."""
    return torch.exp(-torch.exp(A_log.float()) * F.softplus(x.float() + dt_bias.float()))


@dataclass
class M2RNNState:
    """One M2RNN layer's decode state: the conv window [B,K-1,qkv_dim] (None without a conv) and the fp32
    matrix state h [B,H,K,V]."""

    conv: torch.Tensor | None
    h: torch.Tensor


class M2RNN(nn.Module):
    """[B,S,d_model] -> [B,S,d_model] matrix-state recurrent mixer with document resets."""

    # the decay path: f = exp(-exp(A_log) * softplus(x + dt_bias)) near 1 needs fp32 inputs, as does
    # the skip D (megacpp_lab.model.precision keeps these fp32 under bf16 mixed precision)
    _fp32_params = ("A_log", "dt_bias", "D")

    def __init__(self, config: M2RNNConfig) -> None:
        super().__init__()
        if not isinstance(config, M2RNNConfig):
            raise TypeError(f"M2RNN needs an M2RNNConfig, got {type(config).__name__}")
        self.config = c = config
        H, K, V = c.n_heads, c.k_head_dim, c.v_head_dim
        self.qkv_dim = H * (2 * K + V)
        self.input_proj = nn.Linear(c.d_model, self.qkv_dim + H + H * V, bias=False)
        self.conv = DocCausalDepthwiseConv(self.qkv_dim, c.conv_kernel, c.conv_impl) if c.conv_kernel else None
        self.A_log, self.dt_bias = init_decay_params(H, c)
        # spectral norm about 1: the state map starts near the edge of contraction, not chaotic
        self.W = nn.Parameter(torch.randn(H, V, V) * (0.5 / math.sqrt(V)))
        self.D = nn.Parameter(torch.ones(H, V)) if c.residual else None
        self.norm = nn.RMSNorm(H * V, eps=c.eps)
        self.output_proj = nn.Linear(H * V, c.d_model, bias=False)

    def forward(self, x: torch.Tensor, *, ctx: PackedContext | None = None, kernel: str | None = None) -> torch.Tensor:
        """x [B,S,d_model]; ctx, the batch's PackedContext (validated when it was built: the scan runs one
        program per document over the flattened rows, nothing re-checked), or None for one document per row."""
        c = self.config
        if x.dim() != 3 or x.shape[-1] != c.d_model:
            raise ValueError(f"M2RNN input must be [B,S,{c.d_model}], got {tuple(x.shape)}")
        context_positions(ctx, tuple(x.shape))  # a context of another batch shape fails here, by name
        q, k, v, f, gate = self._inputs(x, lambda qkv: self.conv(qkv, ctx, silu=True))
        y = m2rnn_scan(q, k, v, f, self.W.to(q.dtype), ctx=ctx, chunk=c.chunk, grad_clip=c.gradient_clipping,
                       kernel=kernel or c.kernel)  # fmt: skip
        return self._output(y, v, gate)

    def _inputs(self, x: torch.Tensor, conv: Callable[[torch.Tensor], torch.Tensor]) -> tuple[torch.Tensor, ...]:
        """input_proj -> conv + SiLU (the forward's, fused, or the decode step's) -> q, k [B,S,H,K] (scaled by
        1/sqrt(K)), v [B,S,H,V], f [B,S,H] fp32 (bf16 would round f near 1), the output gate."""
        c = self.config
        B, S, _ = x.shape
        H, K, V = c.n_heads, c.k_head_dim, c.v_head_dim
        qkv, decay, gate = self.input_proj(x).split([self.qkv_dim, H, H * V], dim=-1)
        if self.conv is not None:
            qkv = conv(qkv)
        q, k, v = qkv.split([H * K, H * K, H * V], dim=-1)
        q = q.reshape(B, S, H, K) / math.sqrt(K)
        k = k.reshape(B, S, H, K) / math.sqrt(K)
        return q, k, v.reshape(B, S, H, V), softplus_decay_gate(decay, self.A_log, self.dt_bias), gate

    def _output(self, y: torch.Tensor, v: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """+ v * D -> * SiLU(gate) -> RMSNorm -> output_proj."""
        if self.D is not None:
            y = y + v * self.D.to(v.dtype)
        y = y.reshape(*y.shape[:2], -1) * F.silu(gate)
        return self.output_proj(self.norm(y))

    # -- decode: the recurrent form, m2rnn_scan_reference's step

    def init_state(self, batch: int, device: torch.device | str | None = None,
                   dtype: torch.dtype | None = None) -> M2RNNState:  # fmt: skip
        """The state at a document start: an empty conv window (dtype: the activations') and h = 0 (fp32)."""
        c = self.config
        conv = self.conv.init_window(batch, device, dtype) if self.conv is not None else None
        return M2RNNState(conv, torch.zeros(batch, c.n_heads, c.k_head_dim, c.v_head_dim, device=device))

    def step(self, x: torch.Tensor, state: M2RNNState) -> torch.Tensor:
        """One token x [B,1,d_model] -> [B,1,d_model]; advances `state` in place. The forward's math at that
        token: z = tanh(h W + k (outer) v), h = f h + (1 - f) z, y = q h (no grad_clip: it acts on gradients)."""
        step = conv_stepper(self.conv, state)
        q, k, v, f, gate = self._inputs(x, lambda qkv: F.silu(step(qkv)))
        W = self.W.to(q.dtype).float()  # the forward hands the scan W in the activations' dtype
        qt, kt, vt, ft = q[:, 0].float(), k[:, 0].float(), v[:, 0].float(), f[:, 0, :, None, None]
        z = torch.tanh(state.h @ W + kt[..., :, None] * vt[..., None, :])
        state.h = ft * state.h + (1 - ft) * z
        y = (qt[..., None, :] @ state.h).squeeze(-2)  # [B,H,V]
        return self._output(y[:, None].to(q.dtype), v, gate)


class M2RNNMegatronMixer(nn.Module):
    """Megatron mixer protocol: hidden_states [seq, batch, hidden] -> (output, None)."""

    def __init__(self, config: Any, **overrides: Any) -> None:
        super().__init__()
        self.m2rnn = M2RNN(config if isinstance(config, M2RNNConfig) else M2RNNConfig.build(config, **overrides))

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        *,
        ctx: PackedContext | None = None,
        **_: Any,
    ) -> tuple[torch.Tensor, None]:
        """attention_mask is ignored (the recurrence is causal); ctx is the batch's PackedContext over
        [batch, seq] (None: one document per sequence)."""
        out = self.m2rnn(hidden_states.transpose(0, 1), ctx=ctx)
        return out.transpose(0, 1), None
