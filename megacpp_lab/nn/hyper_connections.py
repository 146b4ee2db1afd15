"""mHC: multi-stream (manifold-constrained) hyper-connections around one block.

The residual stream is widened to n streams, x_l [B,T,n,d]. Around a block F ([B,T,d] -> [B,T,d]):

    h        = RMSNorm(flatten(x_l))                     [B,T,n*d]   (fp32, one fused F.rms_norm)
    logits   = h @ W^T + b                                [B,T,2n+n*n] (fp32)
    H_pre    = sigmoid(logits_pre)                        [B,T,n]     in (0, 1)
    H_post   = 2 * sigmoid(logits_post)                   [B,T,n]     in (0, 2)
    H_res    = SinkhornKnopp(logits_res, iters)           [B,T,n,n]   doubly stochastic, entries >= 0
    x_{l+1}  = H_res x_l + H_post^T F(H_pre x_l)

i.e. x_{l+1}[i] = sum_j H_res[i,j] x_l[j] + H_post[i] * F(sum_j H_pre[j] x_l[j]). The coefficients are
per token: mHC mixes across streams, never across tokens, so a doc-causal block stays doc-causal.

Identity at init (the model equals the single-stream residual model). W = 0, so logits = b, and with
every stream equal to x (`expand_streams` at the model input):
  - H_res x_l = x, because every row of H_res sums to 1 (the Sinkhorn iteration ends on the rows);
  - H_pre x_l = x * sum_j H_pre[j] = x: b_pre is chosen so the H_pre sum to 1. The layer's own stream
    (layer_idx % n) gets `pre_init_main` and the others (1 - pre_init_main) / (n - 1), each through
    b = logit(p) = log(p / (1 - p)). Uneven weights break the symmetry between streams: with every
    stream and every coefficient equal, the gradients are equal too and the streams never diverge
    (the original hyper-connections pick stream layer_idx % n for the same reason);
  - H_post = 2 * sigmoid(0) = 1 for every stream (b_post = 0), so each stream gets the whole F(x);
  - so x_{l+1}[i] = x + F(x) for every i: the streams stay equal and `collapse_streams` (mean) at the
    output gives the single-stream residual stack, to fp32 rounding.
H_res starts identity-favouring: logits diag c = log(p (n-1) / (1-p)) with p = `res_init_diag`, 0 off
the diagonal. exp(logits) then has every row and column summing to e^c + n - 1, so it is already doubly
stochastic and Sinkhorn returns diag p, off-diagonal (1 - p) / (n - 1). p = 1/n gives zero logits
(uniform mixing). The default p = 0.5 is a compromise: the further from uniform, the slower 20 Sinkhorn
iterations converge once the weights move (logits perturbed by ~0.5 leave column sums off by ~1e-4 at
p = 0.5, ~1e-2 at p = 0.9); the rows are exact either way.

The norm weight, W and b are fp32-contract parameters (`_fp32_params`): the sigmoid gates and the
Sinkhorn exponentials are computed in fp32 whatever the stream dtype, and the mixing sums run in fp32
before the result is cast back to the stream dtype.
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

from megacpp_lab.checks import config_error, is_int
from megacpp_lab.nn.config_builder import build_config

__all__ = ["COLLAPSE_MODES", "HyperConnection", "HyperConnectionConfig", "collapse_streams", "expand_streams",
           "sinkhorn_knopp"]

COLLAPSE_MODES = ("mean", "sum")
_MAX_STREAMS = 64

_fail = functools.partial(config_error, "HyperConnectionConfig")




def _is_float(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


@dataclass(frozen=True)
class HyperConnectionConfig:
    """mHC settings; build it with HyperConnectionConfig.build. Frozen, checked on construction."""

    n_streams: int = 4
    sinkhorn_iters: int = 20
    eps: float = 1e-6  # the RMSNorm of the flattened streams
    pre_init_main: float = 0.7  # H_pre at init on stream layer_idx % n; the rest share 1 - this equally
    res_init_diag: float = 0.5  # H_res diagonal at init; off-diagonal (1 - this) / (n - 1) (see the docstring)

    def __post_init__(self) -> None:
        if not is_int(self.n_streams) or not 2 <= self.n_streams <= _MAX_STREAMS:
            raise _fail("n_streams", f"an int in 2..{_MAX_STREAMS} (one stream is the plain residual)", self.n_streams)
        if not is_int(self.sinkhorn_iters) or not 1 <= self.sinkhorn_iters <= 1000:
            raise _fail("sinkhorn_iters", "an int in 1..1000", self.sinkhorn_iters)
        if not _is_float(self.eps) or not 0 < self.eps < 1:
            raise _fail("eps", "a float in (0, 1)", self.eps)
        low = f"1/n_streams={1 / self.n_streams:.4g}"
        for name in ("pre_init_main", "res_init_diag"):
            value = getattr(self, name)
            if not _is_float(value) or not 1 / self.n_streams <= value < 1:
                raise _fail(name, f"a float in [{low}, 1)", value)

    @classmethod
    def build(cls, source: Any = None, **overrides: Any) -> HyperConnectionConfig:
        """The one builder: fields from a model config object (only as mhc_<name>: a model's own eps is not
        this layer's) and keyword overrides, else the defaults."""
        aliases = {name: (f"mhc_{name}",) for name in cls.__dataclass_fields__}
        return build_config(cls, source, overrides, prefix="mhc", aliases=aliases, required=())


def sinkhorn_knopp(logits: torch.Tensor, iters: int) -> torch.Tensor:
    """[..., n, n] logits -> exp(logits) made doubly stochastic by `iters` column-then-row normalisations,
    in log space and fp32. The last step normalises the rows, so every row sums to 1 to rounding (what
    keeps equal streams equal); the columns converge to 1 geometrically."""
    if logits.dim() < 2 or logits.shape[-1] != logits.shape[-2]:
        raise ValueError(f"sinkhorn_knopp needs [..., n, n] logits, got {tuple(logits.shape)}")
    log_m = logits.float()
    for _ in range(iters):
        log_m = log_m - torch.logsumexp(log_m, dim=-2, keepdim=True)  # columns
        log_m = log_m - torch.logsumexp(log_m, dim=-1, keepdim=True)  # rows
    return log_m.exp()


def expand_streams(x: torch.Tensor, n: int) -> torch.Tensor:
    """[B,T,d] -> [B,T,n,d]: every stream a copy of x (the model input of an mHC stack)."""
    if x.dim() != 3:
        raise ValueError(f"expand_streams needs [B,T,d], got {tuple(x.shape)}")
    if not is_int(n) or n < 1:
        raise ValueError(f"expand_streams needs n >= 1 streams, got {n!r}")
    return x.unsqueeze(-2).expand(*x.shape[:2], n, x.shape[-1]).contiguous()


def collapse_streams(x: torch.Tensor, reduce: str = "mean") -> torch.Tensor:
    """[B,T,n,d] -> [B,T,d]: the mean (default: equal streams collapse to themselves, so an mHC stack at
    init equals the single-stream model) or the sum of the streams."""
    if x.dim() != 4:
        raise ValueError(f"collapse_streams needs [B,T,n,d], got {tuple(x.shape)}")
    if reduce == "mean":
        return x.mean(dim=-2)
    if reduce == "sum":
        return x.sum(dim=-2)
    raise ValueError(f"collapse_streams reduce must be one of {COLLAPSE_MODES}, got {reduce!r}")


def _logit(p: float) -> float:
    return math.log(p / (1 - p))


class HyperConnection(nn.Module):
    """The mHC seam around one block: forward(streams [B,T,n,d], block, **block_kwargs) -> [B,T,n,d].

    The block is any callable taking [B,T,d] (plus the keyword arguments given here, e.g. ctx=) and
    returning [B,T,d]; it is not owned by this module. `layer_idx` picks the stream H_pre
    favours at init (layer_idx % n), which breaks the symmetry between streams.
    """

    _fp32_params = ("norm_weight", "weight", "bias")

    def __init__(self, d_model: int, config: HyperConnectionConfig, *, layer_idx: int = 0) -> None:
        super().__init__()
        if not isinstance(config, HyperConnectionConfig):
            raise TypeError(f"HyperConnection needs a HyperConnectionConfig, got {type(config).__name__}")
        if not is_int(d_model) or d_model < 1:
            raise ValueError(f"HyperConnection d_model must be an int >= 1, got {d_model!r}")
        if not is_int(layer_idx) or layer_idx < 0:
            raise ValueError(f"HyperConnection layer_idx must be an int >= 0, got {layer_idx!r}")
        self.config = c = config
        self.d_model, self.layer_idx = d_model, layer_idx
        n = c.n_streams
        self.norm_weight = nn.Parameter(torch.ones(n * d_model, dtype=torch.float32))
        self.weight = nn.Parameter(torch.zeros(2 * n + n * n, n * d_model, dtype=torch.float32))
        self.bias = nn.Parameter(self.init_bias())

    def init_bias(self) -> torch.Tensor:
        """[2n + n*n] fp32: the biases that make this step x + F(x) on equal streams (module docstring)."""
        c, n = self.config, self.config.n_streams
        main = self.layer_idx % n
        pre = torch.full((n,), _logit((1 - c.pre_init_main) / (n - 1)), dtype=torch.float64)
        pre[main] = _logit(c.pre_init_main)
        post = torch.zeros(n, dtype=torch.float64)  # 2 * sigmoid(0) = 1
        diag = math.log(c.res_init_diag * (n - 1) / (1 - c.res_init_diag))
        res = torch.eye(n, dtype=torch.float64) * diag
        return torch.cat([pre, post, res.flatten()]).float()

    def reset_parameters(self) -> None:
        with torch.no_grad():
            self.norm_weight.fill_(1.0)
            self.weight.zero_()
            self.bias.copy_(self.init_bias())

    def coefficients(self, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(H_pre [B,T,n], H_post [B,T,n], H_res [B,T,n,n]), all fp32, from streams [B,T,n,d] of any dtype."""
        c, n, d = self.config, self.config.n_streams, self.d_model
        if streams.dim() != 4 or streams.shape[-2:] != (n, d):
            raise ValueError(f"HyperConnection streams must be [B,T,{n},{d}], got {tuple(streams.shape)}")
        h = F.rms_norm(streams.float().flatten(-2), (n * d,), weight=self.norm_weight.float(), eps=c.eps)
        logits = F.linear(h, self.weight.float(), self.bias.float())
        pre, post, res = logits.split([n, n, n * n], dim=-1)
        h_res = sinkhorn_knopp(res.unflatten(-1, (n, n)), c.sinkhorn_iters)
        return torch.sigmoid(pre), 2.0 * torch.sigmoid(post), h_res

    def forward(self, streams: torch.Tensor, block: Callable[..., torch.Tensor], **block_kwargs: Any) -> torch.Tensor:
        h_pre, h_post, h_res = self.coefficients(streams)
        xf = streams.float()
        block_in = torch.einsum("btn,btnd->btd", h_pre, xf).to(streams.dtype)
        out = block(block_in, **block_kwargs)
        if not isinstance(out, torch.Tensor) or out.shape != block_in.shape:
            got = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
            raise ValueError(f"the block wrapped by HyperConnection must return [B,T,{self.d_model}] "
                             f"({tuple(block_in.shape)}), got {got}")  # fmt: skip
        mixed = torch.einsum("btij,btjd->btid", h_res, xf) + h_post.unsqueeze(-1) * out.float().unsqueeze(-2)
        return mixed.to(streams.dtype)

    def extra_repr(self) -> str:
        c = self.config
        return f"d_model={self.d_model}, n_streams={c.n_streams}, sinkhorn_iters={c.sinkhorn_iters}, layer_idx={self.layer_idx}"
