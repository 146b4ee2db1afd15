"""DSA indexer scores: the einsum slab reference, the per-head stream and the fused Triton kernel;
forward drift, gradients (gradcheck and parity), top-k. CPU runs the kernel under TRITON_INTERPRET=1."""

from __future__ import annotations

import pytest
import torch

from megacpp_lab.kernels.dsa_indexer import (
    indexer_scores,
    indexer_scores_reference,
    indexer_scores_streaming,
    topk_keys,
)

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _inputs(sq: int, sk: int, b: int, h: int, d: int, dtype=torch.float32, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(sq, b, h, d, generator=g).to(DEV, dtype)
    k = torch.randn(sk, b, d, generator=g).to(DEV, dtype)
    w = torch.randn(sq, b, h, generator=g).to(DEV, dtype)
    return q, k, w


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize("shape", [(20, 20, 2, 3, 16), (33, 17, 1, 4, 32)])
def test_streaming_and_fused_match_the_slab_in_fp32(shape) -> None:
    q, k, w = _inputs(*shape)
    ref = indexer_scores_reference(q, k, w)
    assert _rel(indexer_scores_streaming(q, k, w), ref) <= 1e-6
    assert _rel(indexer_scores(q, k, w), ref) <= 1e-6


def test_gradients_match_the_reference() -> None:
    q, k, w = _inputs(18, 21, 2, 3, 16)
    grads = []
    for fn in (indexer_scores_reference, indexer_scores):
        args = [t.clone().requires_grad_() for t in (q, k, w)]
        g = torch.randn(2, 18, 21, generator=torch.Generator().manual_seed(1)).to(DEV)
        (fn(*args) * g).sum().backward()
        grads.append([a.grad for a in args])
    for a, b in zip(grads[1], grads[0]):
        assert _rel(a, b) <= 1e-5


def test_triton_backward_matches_the_torch_backward_reference() -> None:
    from megacpp_lab.kernels.dsa_indexer import launch_indexer_backward, indexer_scores_backward_reference

    q, k, w = _inputs(37, 45, 2, 3, 16)  # neither a multiple of the tile: the edge masks are exercised
    dS = torch.randn(2, 37, 45, generator=torch.Generator().manual_seed(4)).to(DEV)
    for got, ref in zip(launch_indexer_backward(q, k, w, dS), indexer_scores_backward_reference(q, k, w, dS)):
        assert _rel(got, ref) <= 1e-5


def test_backward_gradcheck_at_a_small_shape() -> None:
    from megacpp_lab.kernels.dsa_indexer import indexer_scores_backward_reference

    q, k, w = (t.double() for t in _inputs(5, 6, 1, 2, 16))
    dS = torch.randn(1, 5, 6, dtype=torch.float64, device=DEV)
    dq, dk, dw = indexer_scores_backward_reference(q, k, w, dS)
    args = [t.clone().requires_grad_() for t in (q, k, w)]
    ref = torch.autograd.grad((indexer_scores_reference(*args).double() * dS).sum(), args)
    for a, b in zip((dq, dk, dw), ref):
        torch.testing.assert_close(a, b.to(a.dtype), atol=1e-10, rtol=1e-10)
    # and the reference itself is differentiable to fp64 precision
    assert torch.autograd.gradcheck(lambda *a: (indexer_scores_reference(*a).double() * dS).sum(), args)


def test_topk_follows_the_scores_and_respects_causality() -> None:
    q, k, w = _inputs(16, 16, 2, 2, 16)
    scores = indexer_scores(q, k, w)
    idx = topk_keys(scores, 4)
    # a stable sort: relu leaves many scores exactly 0, and equal scores rank by the lower key
    ref_idx = torch.sort(indexer_scores_reference(q, k, w), dim=-1, descending=True, stable=True).indices[..., :4]
    assert torch.equal(idx.sort(-1).values, ref_idx.sort(-1).values)
    causal = topk_keys(scores, 1, causal=True)
    assert bool((causal[..., 0] <= torch.arange(16, device=DEV)).all())


def test_topk_ranks_equal_scores_by_the_lower_key() -> None:
    """The same token twice gives the same indexer key, so equal scores are common: the lower index wins, as in
    the DSA selection (torch.topk's order among ties is unspecified)."""
    scores = torch.tensor([[[1.0, 3.0, 3.0, 2.0, 3.0, 0.0]] * 6])  # [1, 6, 6]
    assert topk_keys(scores, 2)[0, 0].tolist() == [1, 2]
    assert topk_keys(scores, 4)[0, 0].tolist() == [1, 2, 4, 3]
    assert topk_keys(scores, 2, causal=True)[0, 3].tolist() == [1, 2]


def test_topk_never_selects_a_key_of_another_document() -> None:
    q, k, w = _inputs(24, 24, 2, 2, 16)
    doc_ids = torch.tensor([[0] * 10 + [1] * 14, [0] * 3 + [1] * 5 + [2] * 16], device=DEV)
    scores = indexer_scores(q, k, w)
    idx = topk_keys(scores, 3, causal=True, doc_ids=doc_ids)
    picked = torch.gather(doc_ids[:, None, :].expand(-1, 24, -1), 2, idx)
    pos = torch.arange(24, device=DEV)
    start = torch.stack([(doc_ids[r][:, None] == doc_ids[r][None, :]).float().argmax(-1) for r in range(2)])  # first token of the doc
    real = pos[None, :, None] - start[:, :, None] >= torch.arange(3, device=DEV)  # the query's doc has that many keys so far
    assert bool((picked == doc_ids[:, :, None])[real].all())
    assert bool((idx <= pos[None, :, None])[real].all())
    # and without the doc mask, queries do pick keys across the boundary (the mask is not vacuous)
    free = torch.gather(doc_ids[:, None, :].expand(-1, 24, -1), 2, topk_keys(scores, 3, causal=True))
    assert bool((free != doc_ids[:, :, None]).any())


def test_bad_inputs_fail_closed() -> None:
    q, k, w = _inputs(8, 8, 1, 2, 16)
    with pytest.raises(ValueError, match="k must be"):
        indexer_scores(q, k[:, :, :8], w)
    with pytest.raises(ValueError, match="power of two"):
        indexer_scores(q[..., :12], k[..., :12], w)
    with pytest.raises(ValueError, match="top_k"):
        topk_keys(torch.zeros(1, 2, 3), 4)
    with pytest.raises(ValueError, match="doc_ids"):
        topk_keys(torch.zeros(1, 3, 3), 2, doc_ids=torch.zeros(1, 4, dtype=torch.long))


@pytest.mark.cuda
def test_cuda_bar_shape_parity_without_the_slab() -> None:
    q, k, w = _inputs(4096, 4096, 2, 32, 64)  # b=2 of the bar's 8: the slab reference must fit to compare
    ref = indexer_scores_streaming(q, k, w)
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out = indexer_scores(q, k, w)
    extra = torch.cuda.max_memory_allocated() - base - out.numel() * 4
    assert _rel(out, ref) <= 1e-6
    assert extra < 2**30


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("values", ["integer", "gaussian"])
def test_cuda_bar_shape_gradients_match_autograd_through_the_stream(dtype: torch.dtype, values: str) -> None:
    """relu has a kink at 0: where two paths round q.k to opposite signs, that term's gradient flips by
    dS * w. With small-integer q and k every path computes q.k exactly (in bf16, TF32 and fp32), so the
    masks agree and only the sums' rounding is left: the strict check. Gaussian inputs add the kink's
    flips: the looser check bounds them."""
    q, k, w = _inputs(4096, 4096, 1, 32, 64, dtype)  # b=1: autograd through the stream keeps every head's scores
    if values == "integer":
        q, k = q.float().mul(0.7).round().clamp(-2, 2).to(dtype), k.float().mul(0.7).round().clamp(-2, 2).to(dtype)
    dS = torch.randn(1, 4096, 4096, generator=torch.Generator(device=DEV).manual_seed(2), device=DEV)
    grads = []
    for fn in (indexer_scores_streaming, indexer_scores):
        args = [t.clone().requires_grad_() for t in (q, k, w)]
        fn(*args).backward(dS)
        grads.append([a.grad.float() for a in args])
    bf16 = dtype == torch.bfloat16  # the kernel feeds dS * w to the tensor cores in the input dtype
    tol = {("integer", False): 1e-5, ("gaussian", False): 2e-3, ("integer", True): 1e-2, ("gaussian", True): 1e-2}[(values, bf16)]
    for a, b in zip(grads[1], grads[0]):
        assert _rel(a, b) <= tol


@pytest.mark.parametrize(("T", "cuts"), [(40, (0, 5, 6, 23, 40)), (37, (0, 37)), (33, (0, 1, 2, 31, 33))])
def test_document_aware_scores_and_gradients_are_the_references_on_the_selectable_keys(T, cuts) -> None:
    """indexer_scores(starts=...): the reference's scores on every key a query may select (its document, at or
    before it), zero elsewhere; the gradients those of the reference with dS zero outside them, whatever dS holds
    there (documents of one token, one document per row, tile edges)."""
    from megacpp_lab.kernels.dsa_indexer import document_ends

    q, k, w = _inputs(T, T, 2, 3, 16, seed=T)
    doc = torch.zeros(T, dtype=torch.long)
    for c in cuts[1:-1]:
        doc[c:] += 1
    pos = torch.arange(T)
    starts = torch.stack([torch.tensor([int((doc == doc[t]).nonzero()[0]) for t in range(T)])] * 2).to(DEV)
    allowed = ((pos[None, :] <= pos[:, None]) & (doc[None, :] == doc[:, None])).to(DEV).expand(2, T, T)
    assert torch.equal(document_ends(starts)[0].cpu(), torch.tensor([int((doc == doc[t]).nonzero()[-1]) for t in range(T)]))
    ref = indexer_scores_reference(q, k, w)
    got = indexer_scores(q, k, w, starts=starts)
    assert _rel(got[allowed], ref[allowed]) <= 1e-6 and not bool(got[~allowed].any())
    dS = torch.randn(2, T, T, generator=torch.Generator().manual_seed(T)).to(DEV)  # nonzero outside them too
    grads = []
    for fn, g in ((lambda *a: indexer_scores(*a, starts=starts), dS), (indexer_scores_reference, dS * allowed)):
        args = [t.clone().requires_grad_() for t in (q, k, w)]
        (fn(*args) * g).sum().backward()
        grads.append([a.grad for a in args])
    for a, b in zip(*grads):
        assert _rel(a, b) <= 1e-5
