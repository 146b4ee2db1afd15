import pytest
import torch

from megacpp_lab.data import (
    ByteTokenizer,
    PackedBatch,
    cu_seqlens_from_doc_ids,
    pack_documents,
    positions_from_doc_ids,
    validate_packed,
)


def _batch() -> PackedBatch:
    doc_ids = torch.tensor([[0, 0, 0, 1, 1, 2, 2, 2], [0, 1, 1, 1, 1, 1, 2, 2]])
    tokens = torch.arange(16).reshape(2, 8)
    return PackedBatch.from_doc_ids(tokens, doc_ids)


def test_derived_positions_and_cu_seqlens():
    b = _batch()
    assert b.positions.tolist() == [[0, 1, 2, 0, 1, 0, 1, 2], [0, 0, 1, 2, 3, 4, 0, 1]]
    assert b.cu_seqlens.tolist() == [0, 3, 5, 8, 9, 14, 16]
    assert b.cu_seqlens.dtype == torch.int32
    assert b.num_docs == 6 and b.max_seqlen == 5
    assert b.segments(1) == [(0, 0, 1), (1, 1, 6), (2, 6, 8)]


def test_rows_subset_rebuilds_cu_seqlens():
    sub = _batch().rows([1])
    assert sub.cu_seqlens.tolist() == [0, 1, 6, 8]


def test_doc_ids_going_backwards_names_row_and_offset():
    b = _batch()
    doc_ids = b.doc_ids.clone()
    doc_ids[1, 5] = 0
    with pytest.raises(ValueError, match=r"doc_ids go backwards at row 1, offset 5"):
        validate_packed(b.tokens, doc_ids, b.positions, b.cu_seqlens)


def test_positions_not_reset_names_row_and_offset():
    b = _batch()
    positions = b.positions.clone()
    positions[0, 3:5] = torch.tensor([3, 4])  # doc 1 of row 0 continues doc 0's count
    with pytest.raises(ValueError, match=r"positions not reset at a document boundary: row 0, offset 3"):
        PackedBatch(b.tokens, b.doc_ids, positions, b.cu_seqlens)


def test_positions_not_advancing_names_row_and_offset():
    b = _batch()
    positions = b.positions.clone()
    positions[1, 4] = 7
    with pytest.raises(ValueError, match=r"row 1, offset 4"):
        PackedBatch(b.tokens, b.doc_ids, positions, b.cu_seqlens)


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("doc_ids", torch.zeros(2, 7, dtype=torch.int64), r"doc_ids shape \(2, 7\) does not match tokens shape \(2, 8\)"),
        ("positions", torch.zeros(2, 8, dtype=torch.float32), r"positions dtype must be int32 or int64"),
        ("tokens", torch.zeros(2, 8, dtype=torch.float32), r"tokens dtype must be an integer type"),
        ("tokens", torch.zeros(16, dtype=torch.int64), r"tokens must be \[B,T\]"),
        ("cu_seqlens", torch.tensor([0, 3, 5, 8, 9, 14, 16]), r"cu_seqlens must be a 1-D int32 tensor"),
    ],
)
def test_shape_and_dtype_mismatches(field, value, message):
    b = _batch()
    fields = {"tokens": b.tokens, "doc_ids": b.doc_ids, "positions": b.positions, "cu_seqlens": b.cu_seqlens}
    fields[field] = value
    with pytest.raises(ValueError, match=message):
        PackedBatch(**fields)


def test_cu_seqlens_not_covering_T_names_row_and_offset():
    b = _batch()
    short = torch.tensor([0, 3, 5, 8, 9, 14], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"cu_seqlens do not cover the 16 tokens: they end at 14 .*row 1, offset 6 onward"):
        PackedBatch(b.tokens, b.doc_ids, b.positions, short)
    long = torch.tensor([0, 3, 5, 8, 9, 14, 20], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"they end at 20, past them"):
        PackedBatch(b.tokens, b.doc_ids, b.positions, long)


def test_cu_seqlens_disagreeing_with_doc_ids():
    b = _batch()
    missing_boundary = torch.tensor([0, 3, 8, 9, 14, 16], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"row 0, offset 5: a document starts there"):
        PackedBatch(b.tokens, b.doc_ids, b.positions, missing_boundary)
    extra_boundary = torch.tensor([0, 3, 5, 8, 9, 12, 14, 16], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"row 1, offset 4: cu_seqlens has a boundary there"):
        PackedBatch(b.tokens, b.doc_ids, b.positions, extra_boundary)
    not_increasing = torch.tensor([0, 3, 3, 8, 9, 14, 16], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"increase strictly"):
        PackedBatch(b.tokens, b.doc_ids, b.positions, not_increasing)


def test_row_start_always_starts_a_document():
    # A row that starts with the same id the previous row ended with is still a new document.
    doc_ids = torch.tensor([[0, 0], [0, 0]])
    b = PackedBatch.from_doc_ids(torch.zeros(2, 2, dtype=torch.int64), doc_ids)
    assert b.cu_seqlens.tolist() == [0, 2, 4]
    assert b.positions.tolist() == [[0, 1], [0, 1]]


def test_pack_documents_streams_and_records_sources():
    tok = ByteTokenizer()
    docs = [tok.encode("int a;"), tok.encode("struct S {};"), tok.encode("x")]  # 8, 14, 3 tokens
    packed = pack_documents(docs, seq_len=10, pad_id=tok.pad_id)
    b = packed.batch
    assert b.tokens.shape == (3, 10)
    flat = b.tokens.reshape(-1).tolist()
    assert flat[:25] == docs[0] + docs[1] + docs[2]
    assert flat[25:] == [tok.pad_id] * 5
    # doc 1 is cut at the row boundary: offset 8 of row 0 and offset 0 of row 1 both start segments
    assert b.segments(0) == [(0, 0, 8), (1, 8, 10)]
    assert packed.segment_at(1, 0) == {"row": 1, "start": 0, "length": 10, "source": 1, "source_offset": 2}
    assert packed.segment_at(2, 7)["source"] == -1  # padding
    assert b.positions[1, 0] == 0 and b.positions[1, 9] == 9


def test_pack_documents_max_doc_tokens_and_max_rows():
    docs = [list(range(1, 26))]
    packed = pack_documents(docs, seq_len=16, pad_id=0, max_doc_tokens=6, max_rows=1)
    assert packed.batch.tokens.shape == (1, 16)
    assert [s for _, s, _ in packed.batch.segments(0)] == [0, 6, 12]
    assert packed.segments[:, 4].tolist() == [0, 6, 12]


def test_pack_documents_rejects_bad_input():
    with pytest.raises(ValueError, match="document 1 is empty"):
        pack_documents([[1, 2], []], seq_len=4, pad_id=0)
    with pytest.raises(ValueError, match="seq_len"):
        pack_documents([[1, 2]], seq_len=0, pad_id=0)


def test_derivation_helpers_match_packing():
    doc_ids = torch.tensor([[0, 0, 1, 1, 1, 2]])
    assert positions_from_doc_ids(doc_ids).tolist() == [[0, 1, 0, 1, 2, 0]]
    assert cu_seqlens_from_doc_ids(doc_ids).tolist() == [0, 2, 5, 6]


@pytest.mark.cuda
def test_packed_batch_validates_on_gpu():
    b = _batch().to("cuda")
    assert b.cu_seqlens.device.type == "cuda" and b.cu_seqlens.dtype == torch.int32
    bad = b.positions.clone()
    bad[1, 6] = 3
    with pytest.raises(ValueError, match=r"row 1, offset 6"):
        PackedBatch(b.tokens, b.doc_ids, bad, b.cu_seqlens)


def test_boundary_windows_cut_real_rows_around_a_boundary():
    from megacpp_lab.data import boundary_windows

    b = PackedBatch.from_doc_ids(torch.arange(24).reshape(2, 12), torch.tensor([[0] * 7 + [1] * 5, [0] * 3 + [1] * 9]))
    w = boundary_windows(b, 2, 6, lead=2)
    assert w.tokens.tolist() == [[5, 6, 7, 8, 9, 10], [13, 14, 15, 16, 17, 18]]
    assert [s for _, s, _ in w.segments(0)] == [0, 2]
    with pytest.raises(ValueError, match="only 2 of the 2 rows"):
        boundary_windows(b, 3, 6, lead=2)


def test_next_token_targets_stop_at_every_document_end():
    from megacpp_lab.data import next_token_targets

    b = _batch()
    targets = next_token_targets(b.tokens, b.doc_ids)
    # row 0: docs [0,1,2] [3,4] [5,6,7]; row 1: [8] [9..13] [14,15]
    assert targets.tolist() == [[1, 2, -100, 4, -100, 6, 7, -100], [-100, 10, 11, 12, 13, -100, 15, -100]]
    assert next_token_targets(b.tokens, b.doc_ids, ignore_index=-1)[0, 2] == -1
    with pytest.raises(ValueError, match="tokens and doc_ids must both be"):
        next_token_targets(b.tokens[:, :4], b.doc_ids)
