"""The byte-level BPE: committed file pinned by sha256, exact round trips, fixed special ids, deterministic
training, and the BPE-packed sample. CI never retrains the 32k vocab: it loads the committed file."""

import hashlib
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

from megacpp_lab.data import (
    BpeTokenizer,
    BpeTrainConfig,
    ByteTokenizer,
    SampleConfig,
    build_sample,
    list_cpp_files,
    load_bpe,
    load_corpus,
    load_sample,
    pack_documents,
    train_bpe,
)
from megacpp_lab.data.bpe import DEFAULT_VOCAB_SIZE, bpe_file_name, sha256_file
from megacpp_lab.data.sample import write_sample_corpus
from megacpp_lab.data.corpus import repo_data_dir, torch_include_dir


@pytest.fixture(scope="module")
def bpe() -> BpeTokenizer:
    return load_bpe()


@pytest.fixture(scope="module")
def small_corpus(tmp_path_factory):
    """About 40 real headers spread over the whole tree, copied so training sees only them."""
    root = torch_include_dir()
    dst = tmp_path_factory.mktemp("corpus")
    for p in list_cpp_files(root)[::230]:
        target = dst / p.relative_to(root)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(p, target)
    return dst


def test_committed_tokenizer_matches_manifest_and_has_fixed_special_ids(bpe):
    section = json.loads((repo_data_dir() / "manifest.json").read_text())["bpe_tokenizer"]
    assert section["file"] == bpe_file_name(DEFAULT_VOCAB_SIZE) and bpe.path.name == section["file"]
    assert sha256_file(bpe.path) == section["sha256"]
    assert bpe.vocab_size == section["vocab_size"] == DEFAULT_VOCAB_SIZE
    assert (bpe.bos_id, bpe.eos_id, bpe.pad_id) == (0, 1, 2) == (section["bos"], section["eos"], section["pad"])
    assert bpe.special_ids == {"bos": 0, "eos": 1, "pad": 2}
    assert bpe.decode([0, 1, 2]) == "<bos><eos><pad>" and bpe.decode([0, 1, 2], show_special=False) == ""


def test_real_headers_round_trip_exactly(bpe):
    docs = load_corpus(stride=157)  # ~60 files across the whole tree
    assert len(docs) > 50
    for doc in docs:
        ids = bpe.encode(doc.data)
        assert ids[0] == bpe.bos_id and ids[-1] == bpe.eos_id, doc.relpath
        assert bpe.pad_id not in ids and bpe.bos_id not in ids[1:-1] and bpe.eos_id not in ids[1:-1], doc.relpath
        assert bpe.decode_bytes(ids) == doc.data, doc.relpath
        assert bpe.decode(ids[1:-1]) == doc.data.decode("utf-8"), doc.relpath
        assert bpe.encode(doc.data.decode("utf-8")) == ids, doc.relpath  # str and bytes encode alike
        assert len(ids) < 0.5 * len(doc.data), doc.relpath


@pytest.mark.parametrize(
    "data",
    [
        b"",
        "// caf\u00e9, \u65e5\u672c\u8a9e, \U0001f600 \u2014 template<class T> T* f();\n".encode(),
        b"\xff\xfeint x; // \x80 latin-1 \xe9t\xe9\n",  # not UTF-8: every byte still comes back
        b"char s[] = \"\xe6\x97\";\n",  # a UTF-8 sequence cut short
        b"\t\t  \r\n\x00\x01#define X \\\n  1\n",
    ],
    ids=["empty", "unicode", "latin1", "truncated-utf8", "control-bytes"],
)
def test_tricky_bytes_round_trip_exactly(bpe, data):
    ids = bpe.encode(data, add_bos=False, add_eos=False)
    assert all(3 <= i < bpe.vocab_size for i in ids)
    assert bpe.decode_bytes(ids) == data
    assert bpe.decode(ids) == data.decode("utf-8", errors="replace")


def test_batch_encoding_is_encoding_one_at_a_time(bpe):
    """encode_batch (the tokenizer's threads, what tokenize_files uses) gives each text encode's ids, across
    invalid bytes, empty texts and special-token text, with and without bos/eos."""
    texts = [b"", b"\xff\xfeint x; // \x80 latin-1 \xe9t\xe9\n", "std::vector<bos> v;".encode(), b"\xff",
             *[d.data for d in load_corpus(max_files=40, stride=97)]]  # fmt: skip
    for kw in ({}, {"add_bos": False, "add_eos": False}):
        assert bpe.encode_batch(texts, **kw) == [bpe.encode(t, **kw) for t in texts]
    assert bpe.encode_batch([]) == []


def test_invalid_utf8_becomes_single_byte_tokens(bpe):
    ids = bpe.encode(b"int\xffx", add_bos=False, add_eos=False)
    assert [bpe.decode_bytes([i]) for i in ids] == [b"int", b"\xff", b"x"]


def test_special_token_text_in_a_document_is_plain_text(bpe):
    """A header that spells "<bos>" must not forge a document boundary."""
    text = "std::vector<bos> v; // <eos><pad>"
    ids = bpe.encode(text, add_bos=False, add_eos=False)
    assert not set(ids) & {bpe.bos_id, bpe.eos_id, bpe.pad_id}
    assert bpe.decode(ids) == text


def test_bad_input_fails_closed(bpe):
    with pytest.raises(ValueError, match="outside the BPE tokenizer's vocab \\(0..32767\\)"):
        bpe.decode([5, 32768])
    with pytest.raises(ValueError, match="outside the BPE tokenizer's vocab"):
        bpe.decode_bytes([-1])
    with pytest.raises(ValueError, match="lone surrogate"):
        bpe.encode("x\udcff")


def test_same_interface_as_byte_tokenizer_so_packing_takes_either(bpe):
    text = b"#pragma once\nint f();\n"
    for tok in (ByteTokenizer(), bpe):
        for name in ("bos_id", "eos_id", "pad_id", "vocab_size", "special_ids", "encode", "decode"):
            assert hasattr(tok, name), (type(tok).__name__, name)
        ids = tok.encode(text)
        assert tok.decode(ids, show_special=False) == text.decode()
        rows = pack_documents([torch.tensor(ids), torch.tensor(ids)], 64, pad_id=tok.pad_id)
        assert int((rows.segments[:, 3] >= 0).sum()) == 2  # two documents, then one padding segment
        assert int((rows.batch.tokens == tok.pad_id).sum()) == 64 - 2 * len(ids)


def _train_in_subprocess(out, root, vocab, threads, hash_seed):
    env = {**os.environ, "RAYON_NUM_THREADS": str(threads), "PYTHONHASHSEED": str(hash_seed)}
    code = (
        "import sys; from megacpp_lab.data import BpeTrainConfig, train_bpe; "
        "train_bpe(sys.argv[1], root=sys.argv[2], config=BpeTrainConfig(vocab_size=int(sys.argv[3])), progress=False)"
    )
    subprocess.run([sys.executable, "-c", code, str(out), str(root), str(vocab)], env=env, check=True)
    return (out / bpe_file_name(vocab)).read_bytes()


def test_training_is_deterministic_across_threads_and_hash_seeds(tmp_path, small_corpus):
    """Rayon's thread count and Python's hash seed change nothing: the json is byte-identical."""
    one = _train_in_subprocess(tmp_path / "a", small_corpus, 800, threads=1, hash_seed=0)
    two = _train_in_subprocess(tmp_path / "b", small_corpus, 800, threads=2, hash_seed=1)
    assert one == two
    assert json.loads((tmp_path / "a" / "manifest.json").read_text()) == json.loads(
        (tmp_path / "b" / "manifest.json").read_text()
    )
    assert _train_in_subprocess(tmp_path / "c", small_corpus, 700, threads=2, hash_seed=0) != one


def test_small_training_round_trips_and_records_itself(tmp_path, small_corpus):
    path = train_bpe(tmp_path, root=small_corpus, config=BpeTrainConfig(vocab_size=600), progress=False)
    section = json.loads((tmp_path / "manifest.json").read_text())["bpe_tokenizer"]
    assert section["sha256"] == sha256_file(path) and section["corpus"]["files"] == len(list_cpp_files(small_corpus))
    tok = load_bpe(tmp_path)
    assert tok.vocab_size == 600 and tok.special_ids == {"bos": 0, "eos": 1, "pad": 2}
    for p in list_cpp_files(small_corpus)[:10]:
        assert tok.decode_bytes(tok.encode(p.read_bytes())) == p.read_bytes()


def test_train_config_fails_closed():
    with pytest.raises(ValueError, match="BpeTrainConfig.vocab_size must be >= 259 .*, got 100"):
        BpeTrainConfig(vocab_size=100)
    with pytest.raises(ValueError, match="BpeTrainConfig.min_frequency must be an int, got 1.5"):
        BpeTrainConfig(min_frequency=1.5)


def test_sha_mismatch_fails_closed_naming_file_and_both_hashes(tmp_path, bpe):
    shutil.copyfile(bpe.path, tmp_path / bpe.path.name)
    manifest = {"bpe_tokenizer": dict(bpe.record)}
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    assert load_bpe(tmp_path).vocab_size == bpe.vocab_size
    with open(tmp_path / bpe.path.name, "ab") as f:
        f.write(b" ")
    tampered = sha256_file(tmp_path / bpe.path.name)
    expected = f"tokenizer {tmp_path / bpe.path.name} sha256 {tampered} does not match the manifest's {bpe.record['sha256']}"
    with pytest.raises(ValueError, match=expected.replace("(", "\\(").replace(")", "\\)")):
        load_bpe(tmp_path)
    (tmp_path / "manifest.json").write_text("{}")
    with pytest.raises(FileNotFoundError, match="records no BPE tokenizer"):
        load_bpe(tmp_path)


def _whole_sources(tmp_path) -> dict[str, bytes]:
    """The committed byte sample's files that it holds whole, rebuilt from it (write_sample_corpus), each checked
    against the manifest's sha256: the sample's sources without the corpus they came from."""
    root = write_sample_corpus(tmp_path / "sources")
    out = {}
    for f in load_sample(tokenizer="byte")[1]["files"]:
        data = (root / f["path"]).read_bytes()
        if hashlib.sha256(data).hexdigest() == f["sha256"]:
            out[f["path"]] = data
    return out


def test_committed_bpe_sample_loads_validates_and_decodes_to_its_files(bpe, tmp_path):
    rows, fields = load_sample(tokenizer="bpe")
    b = rows.batch
    assert b.tokens.shape == (fields["shape"]["rows"], fields["shape"]["seq_len"]) == (48, 2048)
    assert fields["tokenizer"]["sha256"] == bpe.record["sha256"] and fields["tokenizer"]["kind"] == "bpe"
    assert int(b.tokens.max()) < bpe.vocab_size and int(b.tokens.min()) >= 0
    assert fields["segments"] == rows.segments.shape[0] == b.num_docs
    assert (b.doc_ids.max(dim=1).values >= 1).float().mean() > 0.5  # most rows hold several documents
    # the BPE sample's files include every file of the byte sample
    byte_files = {f["path"] for f in load_sample()[1]["files"]}
    assert byte_files <= {f["path"] for f in fields["files"]}
    # every segment of a file the byte sample holds whole is the BPE of that file at the recorded offset
    sources = _whole_sources(tmp_path)
    assert len(sources) >= len(byte_files) - 1  # all but at most the last, cut by the end of the sample
    checked = 0
    for row, start, length, source, offset in rows.segments.tolist():
        path = fields["files"][source]["path"]
        if path not in sources:
            continue
        ids = torch.tensor(bpe.encode(sources[path]))
        assert len(ids) == fields["files"][source]["tokens"], path
        assert torch.equal(b.tokens[row, start : start + length], ids[offset : offset + length]), path
        checked += 1
    assert checked >= len(sources)


def test_bpe_tokens_per_byte_is_well_below_the_byte_tokenizer(bpe, tmp_path):
    """The manifest's tokens per byte is its files' BPE tokens over their bytes, and the files rebuilt from the
    byte sample encode to the token counts it lists: the BPE spends well under half a token per byte."""
    fields = load_sample(tokenizer="bpe")[1]
    files = fields["files"]
    assert round(sum(f["tokens"] - 2 for f in files) / sum(f["bytes"] for f in files), 4) == fields["tokens_per_byte"]
    listed = {f["path"]: f for f in files}
    for path, data in _whole_sources(tmp_path).items():
        assert len(bpe.encode(data)) == listed[path]["tokens"] and len(data) == listed[path]["bytes"], path
    assert fields["tokens_per_byte"] < 0.4


def test_bpe_sample_build_is_reproducible_and_copies_its_tokenizer(tmp_path, bpe):
    config = SampleConfig(rows=3, seq_len=256, stride=101)
    for d in ("a", "b"):
        build_sample(tmp_path / d, config=config, tokenizer=bpe, progress=False)
    # the other order (BPE first, then bytes) gives the same manifest bytes
    build_sample(tmp_path / "a", config=config, progress=False)
    build_sample(tmp_path / "c", config=config, progress=False)
    build_sample(tmp_path / "c", config=config, tokenizer=bpe, progress=False)
    for name in ("sample_bpe.pt", "manifest.json", bpe.path.name):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "c" / name).read_bytes(), name
    assert (tmp_path / "a" / "sample_bpe.pt").read_bytes() == (tmp_path / "b" / "sample_bpe.pt").read_bytes()
    assert load_bpe(tmp_path / "a").vocab_size == bpe.vocab_size
    rows, fields = load_sample(tmp_path / "a", tokenizer="bpe")
    assert rows.batch.tokens.shape == (3, 256) and fields["config"]["stride"] == 101
    assert load_sample(tmp_path / "a")[0].batch.tokens.shape == (3, 256)  # the byte sample is still there


def test_bpe_sample_from_another_tokenizer_is_refused(tmp_path, bpe):
    build_sample(tmp_path, config=SampleConfig(rows=2, seq_len=256, stride=101), tokenizer=bpe, progress=False)
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    manifest["bpe_tokenizer"]["sha256"] = "0" * 64
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ValueError, match=f"was built with tokenizer sha256 {bpe.record['sha256']}, but .* records "
                       f"tokenizer sha256 {'0' * 64}"):  # fmt: skip
        load_sample(tmp_path, tokenizer="bpe")
    with pytest.raises(ValueError, match="tokenizer must be one of \\('byte', 'bpe'\\), got 'gpt2'"):
        load_sample(tmp_path, tokenizer="gpt2")
    with pytest.raises(FileNotFoundError, match="no packed byte sample in"):
        load_sample(tmp_path)
