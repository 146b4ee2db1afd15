"""Document-boundary masking shared by every token mixer.

A packed row holds several documents back to back. Any op that looks back in time
(shift, pool, conv) must see zeros where its window would cross into the previous
document, exactly as if each document had been left-padded on its own.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def check_doc_ids(doc_ids: torch.Tensor | None, shape: tuple[int, int]) -> None:
    """Fail closed on doc_ids a mixer cannot trust: wrong shape or dtype, or ids going backwards.

    Masks compare ids for equality only, so ids that go backwards (0,0,1,0) would silently join
    two documents. On CPU this raises ValueError with the row and offset. On a GPU, and under
    torch.compile, it is an asynchronous device assert: no host sync in the hot path and no
    graph break, and a bad batch still stops the run (PackedBatch names the row and offset).
    """
    if doc_ids is None:
        return
    if doc_ids.shape != shape:
        raise ValueError(f"doc_ids shape {tuple(doc_ids.shape)} does not match [B,T] = {tuple(shape)}")
    if doc_ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"doc_ids dtype must be int32 or int64, got {doc_ids.dtype}")
    if doc_ids.shape[1] < 2:
        return
    backwards = doc_ids[:, 1:] < doc_ids[:, :-1]
    if torch.compiler.is_compiling() or doc_ids.device.type != "cpu":
        torch._assert_async(~backwards.any(), "doc_ids go backwards inside a row")
        return
    if bool(backwards.any()):
        r, t = (int(i) for i in backwards.nonzero()[0])
        raise ValueError(
            f"doc_ids go backwards at row {r}, offset {t + 1}: {int(doc_ids[r, t])} -> {int(doc_ids[r, t + 1])}"
        )


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
