"""The packed-batch context: built and validated once, then taken as given by M2RNN, MLA, Engram and the n-gram
memory; the doc-aware shift helpers read its positions."""

from __future__ import annotations

import pytest
import torch

from megacpp_lab.data import PackedBatch, load_sample
from megacpp_lab.kernels.m2rnn import m2rnn_scan
from megacpp_lab.varlen import (
    PackedContext,
    build_context,
    check_cu_seqlens,
    cu_seqlens_from_doc_ids,
    doc_causal_block_mask,
    doc_causal_shift,
    doc_ids_from_cu_seqlens,
    doc_starts,
    documents_longest_first,
    packed_cu_seqlens,
    positions_from_doc_ids,
    same_doc_as_lag,
)
from megacpp_lab.nn.m2rnn import M2RNN, M2RNNConfig
from megacpp_lab.nn.mla import MLAConfig, MultiLatentAttention
from megacpp_lab.testing import check_leaks, each_document_alone

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DOC_IDS = [[0, 0, 0, 1, 1, 2, 2, 2], [0, 1, 1, 1, 1, 1, 2, 2]]


def test_context_holds_every_form_derived_once() -> None:
    ctx = build_context(torch.tensor(DOC_IDS))
    assert ctx.shape == (2, 8) and ctx.n_seqs == 6 and ctx.max_seqlen == 5
    assert ctx.positions.tolist() == [[0, 1, 2, 0, 1, 0, 1, 2], [0, 0, 1, 2, 3, 4, 0, 1]]
    assert ctx.cu_seqlens.tolist() == ctx.cu_seqlens_host.tolist() == [0, 3, 5, 8, 9, 14, 16]
    assert ctx.cu_seqlens.dtype == torch.int32 and ctx.cu_seqlens_host.device.type == "cpu"
    assert ctx.seq_index.tolist() == [0, 0, 0, 1, 1, 2, 2, 2, 3, 4, 4, 4, 4, 4, 5, 5]
    assert ctx.starts.reshape(-1).nonzero().reshape(-1).tolist() == ctx.cu_seqlens.tolist()[:-1]
    # lengths 3 2 3 1 5 2: longest first, equal lengths in order, then the end mark (the document count)
    assert ctx.longest_first.tolist() == [4, 0, 2, 1, 5, 3, 6] and ctx.longest_first.dtype == torch.int32
    assert ctx.block_mask is None
    # one document: the order keeps cu_seqlens's length (a one-element tensor would be specialised by dynamo)
    one = build_context(torch.zeros(1, 5, dtype=torch.int64))
    assert one.longest_first.tolist() == [0, 1] and documents_longest_first(one.cu_seqlens).tolist() == [0, 1]


def test_context_from_a_packed_batch_holds_the_batch_and_a_same_document_causal_flex_mask() -> None:
    batch = PackedBatch.from_doc_ids(torch.zeros(2, 8, dtype=torch.long), torch.tensor(DOC_IDS))
    ctx = PackedContext.from_batch(batch, block_mask=True)
    assert torch.equal(ctx.positions, batch.positions) and torch.equal(ctx.cu_seqlens, batch.cu_seqlens)
    assert ctx.seq_index.view(2, 8).tolist() == [[0, 0, 0, 1, 1, 2, 2, 2], [3, 4, 4, 4, 4, 4, 5, 5]]
    # the mask's predicate, token by token, against the contract written out by hand
    q, k = torch.arange(8)[:, None], torch.arange(8)[None, :]
    for b, row in enumerate(DOC_IDS):
        ids = torch.tensor(row)
        want = (k <= q) & (ids[:, None] == ids[None, :])
        got = ctx.block_mask.mask_mod(torch.tensor(b), torch.tensor(0), q.expand(8, 8), k.expand(8, 8))
        assert torch.equal(got, want), b
    assert ctx.block_mask.seq_lengths == (8, 8) and ctx.block_mask.shape[0] == 2


@pytest.mark.parametrize(
    "bad, message",
    [
        (dict(positions=torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2], [0, 0, 1, 2, 3, 5, 0, 1]])),
         r"positions do not advance inside a document: row 1, offset 5"),
        (dict(cu_seqlens=torch.tensor([0, 3, 5, 8, 9, 16], dtype=torch.int32)),
         r"cu_seqlens disagree with doc_ids at row 1, offset 6"),
        (dict(doc_ids=torch.tensor([[0, 0, 1, 0, 1, 2, 2, 2], DOC_IDS[1]])), r"doc_ids go backwards at row 0, offset 3"),
    ],
)  # fmt: skip
def test_context_is_validated_once_with_the_field_row_and_offset(bad: dict, message: str) -> None:
    doc_ids = bad.pop("doc_ids", torch.tensor(DOC_IDS))
    with pytest.raises(ValueError, match=message):
        build_context(doc_ids, **bad)


def _m2rnn(**kw) -> M2RNN:
    torch.manual_seed(0)
    return M2RNN(M2RNNConfig.build(d_model=32, n_heads=2, k_head_dim=16, v_head_dim=16, kernel="triton", **kw)).to(DEVICE)


def test_m2rnn_through_the_context_equals_each_document_alone_forward_and_backward() -> None:
    """The layer: one program per document over the flattened rows, against each document run alone (ctx=None,
    _each_document_alone) and the reference kernel. The scan: the context path against its doc_ids path (one
    program per row with resets), which the kernel entry point keeps."""
    layer = _m2rnn()
    doc_ids = torch.tensor([[0] * 5 + [1] * 9 + [2] * 6, [0] * 13 + [1] * 7], device=DEVICE)
    ctx = build_context(doc_ids)
    x_alone = torch.randn(2, 20, 32, device=DEVICE).requires_grad_()
    x_ctx = x_alone.detach().clone().requires_grad_()
    y_alone, y_ctx = each_document_alone(layer, doc_ids, x_alone), layer(x_ctx, ctx=ctx)
    torch.testing.assert_close(y_ctx, y_alone, atol=1e-5, rtol=1e-5)
    dy = torch.randn_like(y_alone)
    grads_alone = torch.autograd.grad(y_alone, [x_alone, *layer.parameters()], dy)
    grads_ctx = torch.autograd.grad(y_ctx, [x_ctx, *layer.parameters()], dy)
    for a, b in zip(grads_ctx, grads_alone):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(layer(x_ctx, ctx=ctx, kernel="reference"), y_alone, atol=1e-5, rtol=1e-5)
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, 20, 2, 16, generator=g).to(DEVICE).requires_grad_() for _ in range(3))
    f = torch.rand(2, 20, 2, generator=g).to(DEVICE).requires_grad_()
    W = (torch.randn(2, 16, 16, generator=g) * 0.1).to(DEVICE).requires_grad_()
    y_ids, y_ctx = (m2rnn_scan(q, k, v, f, W, kernel="triton", **kw) for kw in (dict(doc_ids=doc_ids), dict(ctx=ctx)))
    torch.testing.assert_close(y_ctx, y_ids, atol=1e-5, rtol=1e-5)
    dy = torch.randn_like(y_ids)
    for a, b in zip(torch.autograd.grad(y_ctx, [q, k, v, f, W], dy), torch.autograd.grad(y_ids, [q, k, v, f, W], dy)):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


def test_m2rnn_and_mla_through_the_context_pass_the_leak_harness_on_real_packed_rows() -> None:
    from megacpp_lab.data import boundary_windows

    w = boundary_windows(load_sample()[0].batch, 2, 24, lead=9)
    tokens, doc_ids = w.tokens.to(DEVICE), w.doc_ids.to(DEVICE)
    torch.manual_seed(0)
    emb = torch.nn.Embedding(259, 32).to(DEVICE)
    m2rnn = _m2rnn()
    mla = MultiLatentAttention(MLAConfig.build(d_model=32, n_heads=2, q_lora_rank=16, kv_lora_rank=16, d_nope=8,
                                               d_rope=8, d_v=8, max_positions=64)).to(DEVICE)  # fmt: skip
    for layer in (m2rnn, mla):
        report = check_leaks(lambda t, d: layer(emb(t), ctx=build_context(d)), tokens, doc_ids, vocab_size=259,
                             causal_positions=range(0, 24, 2))  # fmt: skip
        assert report.passed, str(report)


def test_mla_through_the_context_equalseach_document_alone() -> None:
    """RoPE from the context's positions and same-document causal attention, against each document run alone
    (ctx=None: RoPE rows from 0, causal attention; _each_document_alone)."""
    torch.manual_seed(0)
    mla = MultiLatentAttention(MLAConfig.build(d_model=32, n_heads=2, q_lora_rank=16, kv_lora_rank=16, d_nope=8,
                                               d_rope=8, d_v=8, max_positions=64)).to(DEVICE)  # fmt: skip
    doc_ids = torch.tensor(DOC_IDS, device=DEVICE)
    ctx = build_context(doc_ids)
    x = torch.randn(2, 8, 32, device=DEVICE)
    torch.testing.assert_close(mla(x, ctx=ctx), each_document_alone(mla, doc_ids, x), atol=1e-6, rtol=1e-6)
    with pytest.raises(TypeError, match="ctx must be a PackedContext"):
        mla(x, ctx=doc_ids)
    with pytest.raises(ValueError, match=r"ctx is for \[B,T\] = \(2, 8\)"):
        mla(x[:1], ctx=ctx)


def test_engram_and_ngram_memory_through_the_context_equaleach_document_alone() -> None:
    """Their doc-aware shifts and convs read the context's positions: against each document run alone (ctx=None,
    _each_document_alone)."""
    from megacpp_lab.nn.engram import EngramBranch, EngramConfig
    from megacpp_lab.nn.ngram_hash import NgramHashConfig, NgramHashMemory

    torch.manual_seed(0)
    doc_ids = torch.tensor(DOC_IDS, device=DEVICE)
    ctx = build_context(doc_ids)
    h = torch.randn(2, 8, 32, device=DEVICE, dtype=torch.float64)  # fp64: shorter rows round their matmuls apart
    branch = EngramBranch(EngramConfig(d_model=32, bottleneck=8, gated=True, conv_kernel=4)).to(DEVICE).double()
    memory = NgramHashMemory(NgramHashConfig(vocab_size=259, d_model=32, pad_id=258,
                                             table_size=101, head_dim=8), layer_id=0).to(DEVICE).double()  # fmt: skip
    for zero_init in (branch.out_proj.weight, memory.value_proj.weight):  # else both sides are 0
        torch.nn.init.normal_(zero_init, std=0.05)
    tokens = torch.randint(0, 259, (2, 8), device=DEVICE)
    for got, alone, row in ((branch(h, ctx=ctx), each_document_alone(branch, doc_ids, h), branch(h)),
                            (memory(h, tokens, ctx=ctx), each_document_alone(memory, doc_ids, h, tokens),
                             memory(h, tokens))):  # fmt: skip
        torch.testing.assert_close(got, alone, atol=1e-12, rtol=0)
        assert not torch.allclose(got, row, atol=1e-6)  # the documents' windows differ from the whole row's
    for call in (lambda: branch(h, ctx=doc_ids), lambda: memory(h, tokens, ctx=doc_ids)):
        with pytest.raises(TypeError, match="ctx must be a PackedContext"):
            call()
    for call in (lambda: branch(h[:1], ctx=ctx), lambda: memory(h[:1], tokens[:1], ctx=ctx)):
        with pytest.raises(ValueError, match=r"ctx is for \[B,T\] = \(2, 8\), the input is \(1, 8\)"):
            call()


def test_doc_shift_helpers_read_positions_as_the_doc_ids_definition_on_random_packed_rows() -> None:
    """same_doc_as_lag(positions, lag) is exactly "t-lag exists and holds t's document", written out from doc_ids;
    doc_causal_shift puts x[t-lag] there and the fill elsewhere (an inf of another document included), and with
    positions None treats each row as one document. Seeded random packed rows, every lag from 0 to past T."""
    g = torch.Generator().manual_seed(0)
    B, T = 3, 40
    t = torch.arange(T)
    for docs in (1, 5, 17):
        doc_ids = doc_ids_from_cu_seqlens(packed_cu_seqlens(B, T, docs, g), B, T)
        positions = build_context(doc_ids).positions
        x = torch.randn(B, T, 2, generator=g)
        x[:, ::7, 0] = float("inf")
        for lag in range(T + 2):
            src = (t - lag).clamp_min(0)
            same = (t >= lag) & (doc_ids == doc_ids[:, src])
            assert torch.equal(same_doc_as_lag(positions, lag), same), (docs, lag)
            want = torch.where(same[..., None], x[:, src], torch.tensor(-1.0))
            assert torch.equal(doc_causal_shift(x, positions, lag, fill=-1), want), (docs, lag)
            want = torch.where((t >= lag)[None, :, None], x[:, src], torch.tensor(-1.0))
            assert torch.equal(doc_causal_shift(x, None, lag, fill=-1), want), lag
    with pytest.raises(ValueError, match="lag must be >= 0"):
        same_doc_as_lag(positions, -1)


def test_random_packed_layout_round_trips_through_doc_ids() -> None:
    cu = packed_cu_seqlens(3, 40, 5, torch.Generator().manual_seed(0))
    assert cu.numel() == 3 * 5 + 1 and cu.dtype == torch.int32
    assert set(range(0, 121, 40)) <= set(cu.tolist())  # every row start is a document start
    doc_ids = doc_ids_from_cu_seqlens(cu, 3, 40)
    assert doc_ids.shape == (3, 40) and torch.equal(cu_seqlens_from_doc_ids(doc_ids), cu)
    with pytest.raises(ValueError, match="end at B\\*T = 100"):
        doc_ids_from_cu_seqlens(cu, 2, 50)
    with pytest.raises(ValueError, match=r"strictly increasing \(no empty document\): cu_seqlens\[1\] = 5, cu_seqlens\[2\] = 3"):
        doc_ids_from_cu_seqlens(torch.tensor([0, 5, 3, 8], dtype=torch.int32), 1, 8)
    with pytest.raises(ValueError, match=r"strictly increasing"):
        doc_ids_from_cu_seqlens(torch.tensor([0, 4, 4, 8], dtype=torch.int32), 1, 8)
    with pytest.raises(ValueError, match=r"offset 8 \(row 1\) is not a document start"):
        doc_ids_from_cu_seqlens(torch.tensor([0, 6, 16], dtype=torch.int32), 2, 8)
    with pytest.raises(ValueError, match=r"docs per row must be in \[1, T=4\]"):
        packed_cu_seqlens(1, 4, 5, torch.Generator())


def _blocks(mask, b):
    """Row b's block structure of a BlockMask: per query block, the ordered partial and full key blocks."""
    out = []
    for i in range(mask.kv_num_blocks.shape[-1]):
        part = mask.kv_indices[b, 0, i, : int(mask.kv_num_blocks[b, 0, i])].tolist()
        full = mask.full_kv_indices[b, 0, i, : int(mask.full_kv_num_blocks[b, 0, i])].tolist()
        out.append((part, full))
    return out


@pytest.mark.parametrize("T", [512, 448, 128, 100])
def test_doc_causal_block_mask_from_runs_equals_create_block_mask(T):
    """The block mask computed from the documents' runs has create_block_mask's partial and full key blocks for
    every query block (documents shorter, longer and exactly one block long, a row of one document, T not a
    whole number of blocks, a single block), and the same element mask; its q-side blocks (the backward's) too."""
    from torch.nn.attention.flex_attention import create_block_mask

    from megacpp_lab.varlen import FLEX_BLOCK

    g = torch.Generator().manual_seed(T)
    rows = []
    for r in range(3):
        cuts = sorted(torch.randint(1, T, (r * 3,), generator=g).tolist()) if r else []
        if r == 2 and T >= 2 * FLEX_BLOCK:  # a document exactly one block long, on block boundaries
            cuts = sorted(set(cuts) | {FLEX_BLOCK, 2 * FLEX_BLOCK})
        ids = torch.zeros(T, dtype=torch.long)
        for c in cuts:
            ids[c:] += 1
        rows.append(ids)
    doc_ids = torch.stack(rows)
    got = doc_causal_block_mask(doc_ids)

    def same_doc_causal(b, h, q, k):
        return (k <= q) & (doc_ids[b, q] == doc_ids[b, k])

    want = create_block_mask(same_doc_causal, 3, None, T, T, device="cpu", BLOCK_SIZE=FLEX_BLOCK)
    for b in range(3):
        if T % FLEX_BLOCK == 0:
            assert _blocks(got, b) == _blocks(want, b), b
        else:  # a partial last block is never full here; every block either lists is one the mask reaches
            for (gp, gf), (wp, wf) in zip(_blocks(got, b), _blocks(want, b)):
                assert sorted(gp + gf) == sorted(wp + wf) and set(gf) <= set(wf)
    q = torch.arange(T)[:, None].expand(T, T)
    k = torch.arange(T)[None, :].expand(T, T)
    for b in range(3):
        dense = got.mask_mod(torch.tensor(b), torch.tensor(0), q, k)
        assert torch.equal(dense, same_doc_causal(b, 0, q, k))
    assert torch.equal(got.q_num_blocks.sum(), got.kv_num_blocks.sum())
    assert torch.equal(got.full_q_num_blocks.sum(), got.full_kv_num_blocks.sum())


# ----------------------------------------------------------------------------- bad arguments fail closed, by name


def test_doc_causal_shift_names_a_negative_lag_and_positions_of_another_shape() -> None:
    """A negative lag sliced x to a shorter tensor when positions was None; positions of another shape failed in
    a reshape that named neither the argument nor the expected shape."""
    x = torch.ones(2, 4)
    with pytest.raises(ValueError, match=r"doc_causal_shift: lag must be an int >= 0, got -1"):
        doc_causal_shift(x, None, -1)
    with pytest.raises(ValueError, match=r"doc_causal_shift: lag must be an int >= 0, got 1.5"):
        doc_causal_shift(x, None, 1.5)
    with pytest.raises(ValueError, match=r"doc_causal_shift: positions must be None or a \[B,T\] = \(2, 4\) tensor, "
                                         r"got \(1, 4\)"):  # fmt: skip
        doc_causal_shift(x, torch.zeros(1, 4, dtype=torch.long), 1)
    with pytest.raises(ValueError, match=r"doc_causal_shift: positions .* got \(2, 2\)"):  # checked at lag 0 too
        doc_causal_shift(torch.ones(2, 4, 3), torch.zeros(2, 2, dtype=torch.long), 0)
    assert doc_causal_shift(x, None, 0) is x and doc_causal_shift(x, None, 1)[:, 0].eq(0).all()


@pytest.mark.parametrize(
    "cu, B, T, message",
    [
        (torch.tensor([0.0, 1.5, 4.0]), 1, 4, r"doc_ids_from_cu_seqlens: cu_seqlens must be an int32 tensor, got torch.float32"),
        (torch.tensor([0, 2, 4]), 1, 4, r"doc_ids_from_cu_seqlens: cu_seqlens must be an int32 tensor, got torch.int64"),
        ([0, 2, 4], 1, 4, r"doc_ids_from_cu_seqlens: cu_seqlens must be an int32 tensor, got list"),
        (torch.tensor([0, 4], dtype=torch.int32), -1, -4, r"doc_ids_from_cu_seqlens: B must be an int >= 1, got -1"),
        (torch.tensor([0], dtype=torch.int32), 0, 4, r"doc_ids_from_cu_seqlens: B must be an int >= 1, got 0"),
        (torch.tensor([0, 0], dtype=torch.int32), 2, 0, r"doc_ids_from_cu_seqlens: T must be an int >= 1, got 0"),
    ],
)  # fmt: skip
def test_doc_ids_from_cu_seqlens_requires_int32_boundaries_and_positive_sizes(cu, B, T, message) -> None:
    """A float boundary (1.5) was cut silently into [[0, 1, 1, 1]]; B = -1 failed as 'invalid shape dimension'."""
    with pytest.raises(ValueError, match=message):
        doc_ids_from_cu_seqlens(cu, B, T)


@pytest.mark.parametrize("row_len", [0, -2, 3])
def test_check_cu_seqlens_names_a_row_len_that_would_skip_the_row_start_check(row_len: int) -> None:
    """0, a negative row length or one not dividing the tokens skipped the row-start check without a word."""
    cu = torch.tensor([0, 3, 4], dtype=torch.int32)
    with pytest.raises(ValueError, match=rf"check_cu_seqlens: row_len must be a positive int dividing the 4 tokens, "
                                         rf"got {row_len}"):  # fmt: skip
        check_cu_seqlens(cu, 4, row_len=row_len)
    check_cu_seqlens(cu, 4, row_len=4)  # a whole row: fine
    with pytest.raises(ValueError, match=r"row 1 \(offset 2\) is not one"):
        check_cu_seqlens(cu, 4, row_len=2)  # the check row_len turns on still runs


@pytest.mark.parametrize("B, T, message", [(0, 4, "B must be an int >= 1, got 0"), (-1, 4, "B must be an int >= 1, got -1"),
                                           (2, 0, "T must be an int >= 1, got 0")])  # fmt: skip
def test_packed_cu_seqlens_requires_positive_sizes(B: int, T: int, message: str) -> None:
    """B = 0 or -1 returned [0], boundaries over no tokens."""
    with pytest.raises(ValueError, match=rf"packed_cu_seqlens: {message}"):
        packed_cu_seqlens(B, T, 1, torch.Generator())


@pytest.mark.parametrize("builder", [doc_starts, positions_from_doc_ids, cu_seqlens_from_doc_ids])
def test_doc_id_builders_require_rows_by_name(builder) -> None:
    """1-D doc_ids failed as 'not enough values to unpack' or an IndexError."""
    with pytest.raises(ValueError, match=rf"{builder.__name__}: doc_ids must be a \[B,T\] tensor, got \(3,\)"):
        builder(torch.tensor([0, 0, 1]))


def test_doc_ids_going_backwards_fail_by_name_where_the_batch_is_validated() -> None:
    """The builders read documents as runs of equal ids and do not check values (they run every step, on the GPU
    and in compiled regions, and on time-reversed rows); ids going backwards, for which they would return
    positions [[0, 0, 0]], fail once per batch where it is validated: build_context and PackedBatch."""
    backwards = torch.tensor([[0, 1, 0]])
    assert positions_from_doc_ids(backwards).tolist() == [[0, 0, 0]]  # the runs' offsets, as documented
    with pytest.raises(ValueError, match=r"doc_ids go backwards at row 0, offset 2: 1 -> 0"):
        build_context(backwards)
    with pytest.raises(ValueError, match=r"doc_ids go backwards at row 0, offset 2: 1 -> 0"):
        PackedBatch.from_doc_ids(torch.zeros(1, 3, dtype=torch.long), backwards)
    with pytest.raises(ValueError, match=r"doc_ids go backwards at row 0, offset 2: 1 -> 0"):
        build_context(backwards, torch.tensor([[0, 0, 0]]), torch.tensor([0, 1, 2, 3], dtype=torch.int32))


@pytest.mark.parametrize("field", ["positions", "cu_seqlens"])
def test_build_context_names_positions_or_cu_seqlens_that_are_not_tensors(field: str) -> None:
    """A list of cu_seqlens failed with "'list' object has no attribute 'contiguous'" before any named check."""
    given = {"positions": [[0, 1, 0, 1]], "cu_seqlens": [0, 2, 4]}[field]
    with pytest.raises(ValueError, match=rf"build_context: {field} must be a torch.Tensor or None, got list"):
        build_context(torch.tensor([[0, 0, 1, 1]]), **{field: given})


def test_host_lengths_are_the_documents_lengths_without_an_operator():
    """host_lengths (PackedContext.doc_lengths, and the M2RNN launchers' plan) differences a host cu_seqlens in
    Python: the documents' lengths, in order, as torch's diff gives them, with no aten operator dispatched beyond
    tolist's own."""
    from torch.profiler import ProfilerActivity, profile

    from megacpp_lab.varlen import host_lengths

    cu = torch.tensor([0, 5, 5, 17, 64], dtype=torch.int32)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        lengths = host_lengths(cu)
    assert lengths == [5, 0, 12, 47] == cu.diff().tolist()
    dispatched = {e.name for e in prof.events() if e.name.startswith("aten::")}
    assert dispatched <= {"aten::resolve_conj", "aten::resolve_neg", "aten::_local_scalar_dense"}, dispatched  # tolist's
    doc_ids = torch.tensor([[0, 0, 1, 1, 1, 2], [0, 1, 1, 1, 1, 1]])
    assert build_context(doc_ids).doc_lengths == [2, 3, 1, 1, 5]
