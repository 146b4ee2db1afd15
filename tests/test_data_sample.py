import json

import pytest
import torch

from megacpp_lab.data import ByteTokenizer, SampleConfig, build_sample, list_cpp_files, load_corpus, load_sample
from megacpp_lab.data.corpus import CPP_SUFFIXES, torch_include_dir
from megacpp_lab.data.sample import MIN_SEQ_LEN, repo_data_dir


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
    assert all(d.relpath.endswith(CPP_SUFFIXES) for d in docs), [d.relpath for d in docs]  # the lister's C++ suffixes
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
    assert manifest["source"] == "the training split of the Debian C++ corpus"  # `megacpp-lab data --root <corpus>`
    assert "libboost1.81-dev" in manifest["corpus_sources"] and "libcgal-dev" not in manifest["corpus_sources"]
    assert {f["path"].split("/")[0] for f in manifest["files"]} <= set(manifest["corpus_sources"])
    assert manifest["documents"] >= 20
    assert (b.doc_ids.max(dim=1).values >= 1).float().mean() > 0.5  # most rows hold several documents
    text = ByteTokenizer().decode(b.tokens[0])
    assert "#" in text and "<bos>" in text


def test_sample_config_fails_closed():
    with pytest.raises(ValueError, match="SampleConfig.rows must be >= 1, got 0"):
        SampleConfig(rows=0)
    with pytest.raises(ValueError, match="SampleConfig.stride must be >= 1, got -2"):
        SampleConfig(stride=-2)
    with pytest.raises(ValueError, match="SampleConfig.max_file_bytes must be an int, got 4.5"):
        SampleConfig(max_file_bytes=4.5)
    with pytest.raises(ValueError, match="SampleConfig.rows must be an int, got True"):
        SampleConfig(rows=True)


def test_sample_config_refuses_rows_too_short_for_a_boundary():
    """1-token rows pack without complaint but hold no document boundary: the floor is MIN_SEQ_LEN."""
    with pytest.raises(ValueError, match=f"SampleConfig.seq_len must be >= {MIN_SEQ_LEN} .*, got {MIN_SEQ_LEN - 1}"):
        SampleConfig(seq_len=MIN_SEQ_LEN - 1)
    assert SampleConfig(seq_len=MIN_SEQ_LEN).seq_len == MIN_SEQ_LEN


def test_short_corpus_warns_and_says_what_it_wrote(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    for i in range(3):
        (src / f"f{i}.h").write_bytes(b"int x%d;\n" % i)  # 8 bytes + bos/eos: 10 tokens each
    config = SampleConfig(rows=4, seq_len=16, stride=1)
    expected = (r"asked for 4 rows x 16 tokens, but the 3 files taken \(stride 1 over the 3 C\+\+ files .* "
                r"hold 30 tokens: the sample has 2 rows, 2 tokens of them padding")
    with pytest.warns(UserWarning, match=expected):
        out = build_sample(tmp_path / "out", root=src, config=config, progress=False)
    rows, manifest = load_sample(out)
    assert rows.batch.tokens.shape == (2, 16) and manifest["pad_tokens"] == 2 and manifest["config"]["rows"] == 4


def test_full_sample_does_not_warn(tmp_path, recwarn):
    build_sample(tmp_path, config=SampleConfig(rows=2, seq_len=256, stride=101), progress=False)
    assert not [w for w in recwarn if issubclass(w.category, UserWarning)]


def test_manifest_has_no_wall_clock():
    """A rebuild of the same files must not dirty the checkout: nothing in the manifest may be a date."""
    manifest = json.loads((repo_data_dir() / "manifest.json").read_text())
    assert "created" not in manifest and "date" not in manifest


def test_the_committed_samples_files_are_not_the_validation_files_of_their_own_split():
    """The sample walks files in a salted hash order: walking them in the unsalted one (the order split_by_file and
    the corpus's splits hash by) would make its files mostly validation files of any split of the sample."""
    from megacpp_lab.data.loader import _unit_hash

    for kind in ("byte", "bpe"):
        files = load_sample(tokenizer=kind)[1]["files"]
        share = sum(_unit_hash(f["path"]) < 0.2 for f in files) / len(files)
        assert 0.05 < share < 0.4, (kind, share)  # about a fifth, as for any draw
