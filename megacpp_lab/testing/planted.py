"""Small reference mixers, correct and with planted leaks, for tests and the tour notebook.

Each is an ``nn.Module`` with ``forward(x, doc_ids=None)`` on [B,T,C] hidden states
(``TokenMixer`` takes [B,T] token ids). The leaky variants reproduce the two classic
packed-row bugs: a causal conv / attention that forgets document masking (cross-doc
leak) and a window that looks ahead (causality leak). ``ZeroInitProjection`` plants the
third trap: a zero-initialised output projection, whose constant output no leak check
can fail on.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from megacpp_lab.varlen import doc_causal_shift, positions_from_doc_ids

__all__ = ["CausalSmoother", "CenteredSmoother", "TokenMixer", "DocCausalAttention", "ZeroInitProjection"]


def _check_window(window: int) -> int:
    if int(window) < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    return int(window)


class CausalSmoother(nn.Module):
    """y_t = tanh(mean_{lag=0..window-1} x_{t-lag}), zero-padded at row / doc starts.

    ``doc_masked=False`` ignores doc_ids: the "causal conv without doc masking" leak,
    where the first window-1 positions of a document see the end of the previous one.
    ``nonlinear=False`` drops the tanh (a linear mixer with a known exact Jacobian).
    """

    def __init__(self, window: int, doc_masked: bool = True, *, nonlinear: bool = True) -> None:
        super().__init__()
        self.window = _check_window(window)
        self.doc_masked = bool(doc_masked)
        self.nonlinear = bool(nonlinear)

    def forward(self, x: torch.Tensor, doc_ids: torch.Tensor | None = None) -> torch.Tensor:
        pos = positions_from_doc_ids(doc_ids) if self.doc_masked and doc_ids is not None else None
        acc = sum(doc_causal_shift(x, pos, lag) for lag in range(self.window))
        y = acc / self.window
        return torch.tanh(y) if self.nonlinear else y

    def extra_repr(self) -> str:
        return f"window={self.window}, doc_masked={self.doc_masked}, nonlinear={self.nonlinear}"


class CenteredSmoother(nn.Module):
    """Doc-masked symmetric window: y_t = tanh(mean of x_{t-back..t+ahead}) within t's document.

    ``ahead = window // 2`` future positions are read: the planted causality leak (it
    never crosses documents, so only the causal check catches it).
    """

    def __init__(self, window: int) -> None:
        super().__init__()
        self.window = _check_window(window)
        self.ahead = self.window // 2
        self.back = self.window - 1 - self.ahead

    def forward(self, x: torch.Tensor, doc_ids: torch.Tensor | None = None) -> torch.Tensor:
        pos = positions_from_doc_ids(doc_ids) if doc_ids is not None else None
        acc = sum(doc_causal_shift(x, pos, lag) for lag in range(self.back + 1))
        if self.ahead:
            # look ahead = look back on the time-reversed row (its positions count from each reversed document's
            # start: doc_starts only compares neighbouring ids)
            xr = x.flip(1)
            pos_r = positions_from_doc_ids(doc_ids.flip(1)) if doc_ids is not None else None
            acc = acc + sum(doc_causal_shift(xr, pos_r, lag) for lag in range(1, self.ahead + 1)).flip(1)
        return torch.tanh(acc / self.window)

    def extra_repr(self) -> str:
        return f"window={self.window} (back={self.back}, ahead={self.ahead})"


class TokenMixer(nn.Module):
    """nn.Embedding followed by a hidden-state mixer: the same mixers on [B,T] token ids."""

    def __init__(self, vocab_size: int, dim: int, inner: nn.Module) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab_size, dim)
        self.inner = inner

    def forward(self, x: torch.Tensor, doc_ids: torch.Tensor | None = None) -> torch.Tensor:
        return self.inner(self.embed(x), doc_ids)


class DocCausalAttention(nn.Module):
    """One softmax attention layer: t attends s iff s <= t and doc_ids[s] == doc_ids[t].

    ``doc_masked=False`` keeps only the causal mask: the plain (cross-doc leaky)
    attention over a packed row.
    """

    def __init__(self, dim: int, heads: int, doc_masked: bool = True) -> None:
        super().__init__()
        if dim % heads:
            raise ValueError(f"dim={dim} must be divisible by heads={heads}")
        self.dim, self.heads, self.doc_masked = dim, heads, bool(doc_masked)
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.out = nn.Linear(dim, dim, bias=False)

    def forward(self, x: torch.Tensor, doc_ids: torch.Tensor | None = None) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, self.heads, C // self.heads).permute(2, 0, 3, 1, 4)
        pos = torch.arange(T, device=x.device)
        mask = (pos[None, :] <= pos[:, None]).expand(B, 1, T, T)  # [B,1,T(query),T(key)]
        if self.doc_masked and doc_ids is not None:
            mask = mask & (doc_ids[:, None, :, None] == doc_ids[:, None, None, :])
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.out(y.transpose(1, 2).reshape(B, T, C))

    def extra_repr(self) -> str:
        return f"dim={self.dim}, heads={self.heads}, doc_masked={self.doc_masked}"


class ZeroInitProjection(nn.Module):
    """``inner`` followed by a bias-free ``nn.Linear(dim, dim)`` out projection initialised to zero.

    Residual branches (Engram, the hashed n-gram memory) start this way so that they are an
    identity on the residual at step 0. Until ``out.weight`` is re-initialised the output is
    constant (zero), whatever ``inner`` does: a leak check on it is vacuous.
    """

    def __init__(self, inner: nn.Module, dim: int) -> None:
        super().__init__()
        self.inner = inner
        self.out = nn.Linear(dim, dim, bias=False)
        nn.init.zeros_(self.out.weight)

    def forward(self, x: torch.Tensor, doc_ids: torch.Tensor | None = None) -> torch.Tensor:
        return self.out(self.inner(x, doc_ids))
