"""The training loader: a held-out split by file that no seed changes, batches deterministic per seed and
different across seeds and epochs, every row a valid packed row, and resume from a saved state."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from megacpp_lab.data import load_corpus
from megacpp_lab.data.corpus import SourceFile
from megacpp_lab.data.loader import PackedRowStream, split_by_file, tokenize_files
from megacpp_lab.data.packing import validate_packed


def _files(n: int = 200) -> list[SourceFile]:
    return [SourceFile(f"dir{i % 7}/file{i}.h", b"x" * (1 + i % 5)) for i in range(n)]


def _docs(n: int = 40, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 500, size=int(rng.integers(5, 90))).astype(np.int32) for _ in range(n)]


def test_split_is_by_file_fixed_by_path_and_fails_closed():
    files = _files()
    train, val = split_by_file(files, 0.1)
    assert {f.relpath for f in train}.isdisjoint({f.relpath for f in val}) and len(train) + len(val) == len(files)
    assert 5 <= len(val) <= 40  # ~10% of 200
    # the same files are held out whatever the order or the company
    train2, val2 = split_by_file(list(reversed(files)) + [SourceFile("extra.h", b"y")], 0.1)
    assert {f.relpath for f in val} <= {f.relpath for f in val2} | {"extra.h"}
    assert {f.relpath for f in val2} - {"extra.h"} == {f.relpath for f in val}
    with pytest.raises(ValueError, match=r"val_fraction must be a number in \(0, 1\)"):
        split_by_file(files, 1.0)
    with pytest.raises(ValueError, match="both need at least one"):
        split_by_file(files[:1], 0.01)
    with pytest.raises(ValueError, match="holds 'a.h' twice"):
        split_by_file([SourceFile("a.h", b"1"), SourceFile("a.h", b"2")], 0.5)


def test_batches_are_valid_packed_rows_deterministic_per_seed_and_shuffled_per_epoch():
    docs = _docs()
    make = lambda seed: PackedRowStream(docs, seq_len=32, batch_size=4, pad_id=2, seed=seed)  # noqa: E731
    a, b, c = make(0), make(0), make(1)
    n = a.batches_per_epoch
    assert n == sum(len(d) for d in docs) // 32 // 4 >= 2
    run_a = [next(a) for _ in range(2 * n)]
    run_b = [next(b) for _ in range(2 * n)]
    run_c = [next(c) for _ in range(n)]
    for x, y in zip(run_a, run_b):
        assert torch.equal(x.tokens, y.tokens) and torch.equal(x.doc_ids, y.doc_ids)
    for batch in run_a:
        assert batch.tokens.shape == (4, 32)
        validate_packed(batch.tokens, batch.doc_ids, batch.positions, batch.cu_seqlens)
    assert not torch.equal(run_a[0].tokens, run_c[0].tokens)  # another seed, another order
    assert not torch.equal(run_a[0].tokens, run_a[n].tokens)  # another epoch, another order
    assert (a.epoch, a.batch) == (2, 0)
    # each epoch's rows are its documents back to back, in the order epoch_order says
    for epoch in (0, 1):
        stream_tokens = torch.cat([x.tokens.flatten() for x in run_a[epoch * n:(epoch + 1) * n]])
        expected = np.concatenate([docs[i] for i in a.epoch_order(epoch)])[: stream_tokens.numel()]
        assert torch.equal(stream_tokens, torch.from_numpy(expected.astype(np.int64)))


def test_resume_from_a_saved_state_yields_the_same_batches_and_refuses_another_stream():
    docs = _docs()
    stream = PackedRowStream(docs, seq_len=32, batch_size=4, pad_id=2, seed=3)
    for _ in range(stream.batches_per_epoch + 1):
        next(stream)
    state = stream.state_dict()
    expected = [next(stream) for _ in range(3)]
    resumed = PackedRowStream(docs, seq_len=32, batch_size=4, pad_id=2, seed=3)
    resumed.load_state_dict(state)
    for x, y in zip(expected, (next(resumed) for _ in range(3))):
        assert torch.equal(x.tokens, y.tokens) and torch.equal(x.doc_ids, y.doc_ids)
    other = PackedRowStream(docs, seq_len=32, batch_size=4, pad_id=2, seed=4)
    with pytest.raises(ValueError, match="loader state field 'seed' is 3, this stream has 4"):
        other.load_state_dict(state)
    with pytest.raises(ValueError, match=r"loader state field 'batch' must be an int in \[0, "):
        resumed.load_state_dict({**state, "batch": 10**6})


def test_stream_fails_closed_on_bad_settings():
    with pytest.raises(ValueError, match=r"PackedRowStream.seq_len must be an int >= 1"):
        PackedRowStream(_docs(), seq_len=0, batch_size=1, pad_id=2)
    with pytest.raises(ValueError, match="document 1 is empty"):
        PackedRowStream([np.ones(3, np.int32), np.zeros(0, np.int32)], seq_len=2, batch_size=1, pad_id=2)
    with pytest.raises(ValueError, match="make fewer than one batch"):
        PackedRowStream(_docs(2), seq_len=4096, batch_size=8, pad_id=2)


def test_real_corpus_files_through_the_bpe_tokenizer():
    """A slice of the real corpus (torch's headers), split, tokenized with the lab's BPE, streamed."""
    from megacpp_lab.data import load_bpe

    files = load_corpus(stride=400)
    train, val = split_by_file(files, 0.2)
    bpe = load_bpe()
    docs = tokenize_files(train, bpe)
    assert all(d[0] == bpe.special_ids["bos"] and d[-1] == bpe.special_ids["eos"] for d in docs)
    stream = PackedRowStream(docs, seq_len=128, batch_size=2, pad_id=bpe.special_ids["pad"], seed=0)
    batch = next(stream)
    validate_packed(batch.tokens, batch.doc_ids, batch.positions, batch.cu_seqlens)
    assert int(batch.tokens.max()) < bpe.vocab_size and len(val) >= 1
