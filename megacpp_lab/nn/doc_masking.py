"""Document-boundary masking shared by every token mixer.

A packed row holds several documents back to back. Any op that looks back in time
(shift, pool, conv) must see zeros where its window would cross into the previous
document, exactly as if each document had been left-padded on its own.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def same_doc_as_lag(doc_ids: torch.Tensor, lag: int) -> torch.Tensor:
    """Bool [B,T]: True where position t-lag exists and belongs to the same document as t."""
    if lag < 0:
        raise ValueError(f"lag must be >= 0, got {lag}")
    T = doc_ids.shape[1]
    if lag == 0:
        return torch.ones_like(doc_ids, dtype=torch.bool)
    if lag >= T:
        return torch.zeros_like(doc_ids, dtype=torch.bool)
    # functional (no in-place slice write): Inductor fuses it into the consumer
    return F.pad(doc_ids[:, lag:] == doc_ids[:, : T - lag], (lag, 0), value=False)


def doc_causal_shift(
    x: torch.Tensor, doc_ids: torch.Tensor | None, lag: int, *, fill: float | int = 0
) -> torch.Tensor:
    """x[:, t-lag] placed at t, `fill` where t-lag is before the row or in another document.

    x is [B,T,...]; doc_ids is [B,T] or None (one document per row). Token ids use
    fill=pad_id, hidden states the default zero.
    """
    if lag == 0:
        return x
    B, T = x.shape[:2]
    if lag >= T:
        shifted = torch.full_like(x, fill)
    else:
        shifted = F.pad(x[:, : T - lag], [0, 0] * (x.dim() - 2) + [lag, 0], value=fill)
    if doc_ids is None:
        return shifted
    mask = same_doc_as_lag(doc_ids, lag).view(B, T, *([1] * (x.dim() - 2)))
    # where, not multiply: 0 * inf from another document would still leak a NaN
    return torch.where(mask, shifted, torch.full((), fill, dtype=x.dtype, device=x.device))
