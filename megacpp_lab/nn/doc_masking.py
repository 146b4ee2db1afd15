"""Document-boundary masking shared by every token mixer.

A packed row holds several documents back to back. Any op that looks back in time
(shift, pool, conv) must see zeros where its window would cross into the previous
document, exactly as if each document had been left-padded on its own.
"""

from __future__ import annotations

import torch


def same_doc_as_lag(doc_ids: torch.Tensor, lag: int) -> torch.Tensor:
    """Bool [B,T]: True where position t-lag exists and belongs to the same document as t."""
    if lag < 0:
        raise ValueError(f"lag must be >= 0, got {lag}")
    B, T = doc_ids.shape
    if lag == 0:
        return torch.ones_like(doc_ids, dtype=torch.bool)
    mask = torch.zeros_like(doc_ids, dtype=torch.bool)
    if lag < T:
        mask[:, lag:] = doc_ids[:, lag:] == doc_ids[:, :-lag]
    return mask


def doc_causal_shift(x: torch.Tensor, doc_ids: torch.Tensor | None, lag: int) -> torch.Tensor:
    """x[:, t-lag] placed at t, zero where t-lag is before the row or in another document.

    x is [B,T,...]; doc_ids is [B,T] or None (one document per row).
    """
    if lag == 0:
        return x
    B, T = x.shape[:2]
    shifted = torch.zeros_like(x)
    if lag < T:
        shifted[:, lag:] = x[:, :-lag]
    if doc_ids is None:
        return shifted
    mask = same_doc_as_lag(doc_ids, lag).view(B, T, *([1] * (x.dim() - 2)))
    # where, not multiply: 0 * inf from another document would still leak a NaN
    return torch.where(mask, shifted, torch.zeros((), dtype=x.dtype, device=x.device))
