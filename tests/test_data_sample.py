import json

import pytest
import torch

from megacpp_lab.data import ByteTokenizer, SampleConfig, build_sample, list_cpp_files, load_corpus, load_sample
from megacpp_lab.data.corpus import torch_include_dir


def test_tokenizer_round_trips_real_cpp_and_marks_specials():
    tok = ByteTokenizer()
    doc = load_corpus(max_files=3, stride=500)[0]
    ids = tok.encode(doc.data)
    assert ids[0] == tok.bos_id and ids[-1] == tok.eos_id
    assert tok.decode(ids[1:-1]).encode("utf-8") == doc.data
    assert tok.decode([tok.bos_id, 0x69, 0x6E, 0x74, tok.eos_id]) == "<bos>int<eos>"
    with pytest.raises(ValueError, match="outside the byte tokenizer"):
        tok.decode([300])


def test_corpus_is_real_torch_headers():
    files = list_cpp_files(torch_include_dir())
    assert len(files) > 1000
    docs = load_corpus(max_files=20, stride=len(files) // 20)
    assert len(docs) == 20
    assert all(d.relpath.endswith(".h") or "." in d.relpath for d in docs)
    assert sum(b"#include" in d.data or b"#pragma" in d.data for d in docs) >= 10


def test_corpus_from_user_directory(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "x.hpp").write_text("int f();\n")
    (tmp_path / "notes.txt").write_text("not C++")
    docs = load_corpus(tmp_path)
    assert [d.relpath for d in docs] == ["a/x.hpp"]
    with pytest.raises(ValueError, match="holds no C\\+\\+ files"):
        list_cpp_files(tmp_path / "a", (".cu",))


def test_build_and_load_sample_with_manifest(tmp_path):
    out = build_sample(tmp_path, config=SampleConfig(rows=4, seq_len=512, stride=101), progress=False)
    rows, manifest = load_sample(out)
    b = rows.batch
    assert b.tokens.shape == (4, 512)
    assert manifest["shape"] == {"rows": 4, "seq_len": 512}
    assert manifest["segments"] == rows.segments.shape[0] == b.num_docs
    assert sum(f["tokens_in_sample"] for f in manifest["files"]) + manifest["pad_tokens"] == 4 * 512
    first = manifest["files"][0]
    assert len(first["sha256"]) == 64
    # every segment decodes to the bytes of its source file at the recorded offset
    tok = ByteTokenizer()
    src = (torch_include_dir() / first["path"]).read_bytes()
    full = torch.tensor(tok.encode(src))
    for row, start, length, source, offset in rows.segments.tolist():
        if source == 0:
            assert torch.equal(b.tokens[row, start : start + length], full[offset : offset + length])


def test_load_sample_rejects_tampering(tmp_path):
    out = build_sample(tmp_path, config=SampleConfig(rows=2, seq_len=256), progress=False)
    manifest = json.loads((out / "manifest.json").read_text())
    manifest["sample_sha256"] = "0" * 64
    (out / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ValueError, match="does not match the manifest"):
        load_sample(out)


def test_committed_sample_is_valid_real_cpp():
    rows, manifest = load_sample()
    b = rows.batch
    assert b.tokens.shape == (manifest["shape"]["rows"], manifest["shape"]["seq_len"])
    assert manifest["source"] == "torch/include of the installed torch"
    assert manifest["documents"] >= 20
    assert (b.doc_ids.max(dim=1).values >= 1).float().mean() > 0.5  # most rows hold several documents
    text = ByteTokenizer().decode(b.tokens[0])
    assert "#" in text and "<bos>" in text


def test_sample_config_fails_closed():
    with pytest.raises(ValueError, match="SampleConfig.rows"):
        SampleConfig(rows=0)
