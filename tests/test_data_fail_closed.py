"""Bad data input fails closed: a corrupt or malformed manifest (the sample's manifest.json, a built corpus's
corpus_manifest.json) raises a ValueError naming the file and the missing key or wrong type, so the CLI prints one
line; PackedRowStream refuses float documents and a pad_id that is not an int >= 0."""

from __future__ import annotations

import json
import re
import shutil

import numpy as np
import pytest
import torch

from megacpp_lab.cli import main
from megacpp_lab.data.bpe import load_bpe
from megacpp_lab.data.corpus import (
    CORPUS_MANIFEST,
    MANIFEST_FILE,
    archive_corpus,
    describe_source,
    list_cpp_files,
    load_corpus_split,
    read_json_manifest,
    repo_data_dir,
)
from megacpp_lab.data.loader import PackedRowStream
from megacpp_lab.data.sample import load_sample


@pytest.fixture
def data_dir(tmp_path):
    """A copy of the committed data/: both samples, the BPE and their manifest."""
    d = tmp_path / "data"
    shutil.copytree(repo_data_dir(), d)
    return d


def _edit_manifest(d, edit) -> None:
    manifest = json.loads((d / MANIFEST_FILE).read_text())
    edit(manifest)
    (d / MANIFEST_FILE).write_text(json.dumps(manifest))


def _named(path, *parts: str) -> str:
    """A match pattern: the file's path, then each part in order."""
    return ".*".join(re.escape(str(p)) for p in (path, *parts))


# ----------------------------------------------------------------------------- the sample's manifest.json


def test_the_committed_manifest_still_loads(data_dir):
    rows, fields = load_sample(data_dir)
    assert fields == json.loads((data_dir / MANIFEST_FILE).read_text())
    assert rows.batch.tokens.shape == (fields["shape"]["rows"], fields["shape"]["seq_len"])
    assert load_sample(data_dir, tokenizer="bpe")[1]["sample_sha256"]
    assert load_bpe(data_dir).vocab_size == 32768


@pytest.mark.parametrize("content, message", [
    (b'{"a": ', "is not valid JSON"),  # truncated
    (b"\xff\xfe{}", "is not valid JSON"),  # not UTF-8
    (b"[1, 2]", "must be a JSON object, got a JSON list"),
], ids=["truncated", "not_utf8", "a_list"])  # fmt: skip
@pytest.mark.parametrize("loader", [load_sample, load_bpe], ids=["load_sample", "load_bpe"])
def test_a_manifest_that_is_no_json_object_names_the_file(data_dir, loader, content, message):
    path = data_dir / MANIFEST_FILE
    path.write_bytes(content)
    with pytest.raises(ValueError, match=_named(path, message)):
        loader(data_dir)


def test_missing_sample_sha256_is_named(data_dir):
    _edit_manifest(data_dir, lambda m: m.pop("sample_sha256"))
    with pytest.raises(ValueError, match=_named(data_dir / MANIFEST_FILE, "has no 'sample_sha256'")):
        load_sample(data_dir)
    _edit_manifest(data_dir, lambda m: m["bpe_sample"].pop("sample_sha256"))
    with pytest.raises(ValueError, match=_named(data_dir / MANIFEST_FILE, "bpe_sample has no 'sample_sha256'")):
        load_sample(data_dir, tokenizer="bpe")


def test_bpe_sample_without_its_tokenizer_is_named(data_dir):
    _edit_manifest(data_dir, lambda m: m["bpe_sample"].pop("tokenizer"))
    with pytest.raises(ValueError, match=_named(data_dir / MANIFEST_FILE, "bpe_sample has no 'tokenizer'")):
        load_sample(data_dir, tokenizer="bpe")
    _edit_manifest(data_dir, lambda m: m["bpe_sample"].update(tokenizer="bpe-32768.json"))
    with pytest.raises(ValueError, match=_named(data_dir / MANIFEST_FILE, "bpe_sample.tokenizer must be a JSON object, "
                                                "got a JSON string")):  # fmt: skip
        load_sample(data_dir, tokenizer="bpe")


def test_bpe_sample_with_a_malformed_tokenizer_section_is_named(data_dir):
    _edit_manifest(data_dir, lambda m: m.update(bpe_tokenizer=[1]))
    with pytest.raises(ValueError, match=_named(data_dir / MANIFEST_FILE, "bpe_tokenizer must be a JSON object")):
        load_sample(data_dir, tokenizer="bpe")
    with pytest.raises(ValueError, match=_named(data_dir / MANIFEST_FILE, "bpe_tokenizer must be a JSON object")):
        load_bpe(data_dir)


@pytest.mark.parametrize("key", ["file", "sha256"])
def test_bpe_tokenizer_section_missing_a_key_is_named(data_dir, key):
    _edit_manifest(data_dir, lambda m: m["bpe_tokenizer"].pop(key))
    with pytest.raises(ValueError, match=_named(data_dir / MANIFEST_FILE, f"bpe_tokenizer has no '{key}'")):
        load_bpe(data_dir)


def test_bpe_tokenizer_file_outside_the_data_dir_is_refused(data_dir):
    _edit_manifest(data_dir, lambda m: m["bpe_tokenizer"].update(file="../bpe-32768.json"))
    with pytest.raises(ValueError, match=_named(data_dir / MANIFEST_FILE, "bpe_tokenizer 'file' must be a relative")):
        load_bpe(data_dir)


def test_read_json_manifest_names_file_and_key(tmp_path):
    path = tmp_path / "m.json"
    path.write_text('{"a": 1}')
    assert read_json_manifest(path, required=("a",)) == {"a": 1}
    with pytest.raises(ValueError, match=_named(path, "has no 'b'")):
        read_json_manifest(path, required=("a", "b"))
    path.write_text("null")
    with pytest.raises(ValueError, match=_named(path, "must be a JSON object, got a JSON null")):
        read_json_manifest(path)


# ----------------------------------------------------------------------------- a built corpus's manifest


def _corpus(tmp_path, records=None, text=None):
    root = tmp_path / "corpus"
    (root / "files" / "x").mkdir(parents=True)
    (root / "files" / "x" / "a.h").write_bytes(b"int a;")
    if records is None:
        import hashlib

        records = [{"path": "x/a.h", "status": "kept", "split": "train", "sha256": hashlib.sha256(b"int a;").hexdigest()}]
    (root / CORPUS_MANIFEST).write_text(text if text is not None else json.dumps({"files": records}))
    return root


def test_a_good_corpus_manifest_still_reads(tmp_path):
    root = _corpus(tmp_path)
    assert [f.relpath for f in load_corpus_split("train", root)] == ["x/a.h"]
    assert list_cpp_files(root) == [root / "files" / "x" / "a.h"]


def test_truncated_corpus_manifest_names_the_file(tmp_path):
    root = _corpus(tmp_path, text='{"files": [\n')
    for call in (lambda: load_corpus_split("train", root), lambda: list_cpp_files(root),
                 lambda: archive_corpus(root, tmp_path / "a.tar.xz")):  # fmt: skip
        with pytest.raises(ValueError, match=_named(root / CORPUS_MANIFEST, "is not valid JSON")):
            call()


def test_corpus_manifest_without_files_names_the_key(tmp_path):
    root = _corpus(tmp_path, text="{}")
    with pytest.raises(ValueError, match=_named(root / CORPUS_MANIFEST, "has no 'files'")):
        load_corpus_split("train", root)
    with pytest.raises(ValueError, match=_named(root / CORPUS_MANIFEST, "has no 'files'")):
        list_cpp_files(root)
    (root / CORPUS_MANIFEST).write_text('{"files": {}}')
    with pytest.raises(ValueError, match=_named(root / CORPUS_MANIFEST, "'files' must be a JSON list, got a JSON object")):
        load_corpus_split("train", root)
    (root / CORPUS_MANIFEST).write_text('{"files": []}')
    with pytest.raises(ValueError, match=_named(root / CORPUS_MANIFEST, "has no 'summary'")):
        describe_source(root)


@pytest.mark.parametrize("key", ["sha256", "path", "split", "status"])
def test_corpus_record_missing_a_key_names_record_and_key(tmp_path, key):
    rec = {"path": "x/a.h", "status": "kept", "split": "train", "sha256": "0" * 64}
    del rec[key]
    root = _corpus(tmp_path, records=[rec])
    with pytest.raises(ValueError, match=_named(root / CORPUS_MANIFEST, f"files[0] has no '{key}'")):
        load_corpus_split("train", root)


def test_corpus_record_path_outside_files_is_refused(tmp_path):
    root = _corpus(tmp_path, records=[{"path": "../../etc/hostname", "status": "kept", "split": "train",
                                       "sha256": "0" * 64}])  # fmt: skip
    with pytest.raises(ValueError, match=_named(root / CORPUS_MANIFEST, "files[0] 'path' must be a relative path")):
        load_corpus_split("train", root)


@pytest.mark.parametrize(("text", "expected"), [('{"files": [\n', "is not valid JSON"), ("{}", "has no 'files'")])
def test_train_on_a_bad_corpus_manifest_is_one_line(tmp_path, capsys, text, expected):
    root = _corpus(tmp_path, text=text)
    rc = main(["train", "--corpus", str(root), "--preset", "tiny", "--device", "cpu", "--steps", "1",
               "--no-tensorboard", "--quiet", "--out-dir", str(tmp_path / "run")])  # fmt: skip
    err = capsys.readouterr().err.strip()
    assert rc == 2
    assert len(err.splitlines()) == 1 and err.startswith("megacpp-lab: error: "), err
    assert re.search(_named(root / CORPUS_MANIFEST, expected), err), err


# ----------------------------------------------------------------------------- PackedRowStream


def _docs() -> list[np.ndarray]:
    return [np.arange(3, 32, dtype=np.int32) for _ in range(10)]


def test_stream_takes_integer_documents_of_every_kind():
    for docs in (_docs(), [torch.arange(3, 32) for _ in range(10)], [list(range(3, 32)) for _ in range(10)]):
        assert next(PackedRowStream(docs, seq_len=16, batch_size=2, pad_id=2)).tokens.shape == (2, 16)


@pytest.mark.parametrize("bad", [np.linspace(0, 5, 30), torch.linspace(0, 5, 30), [0.5] * 30,
                                 np.ones(30, dtype=bool)], ids=["numpy", "torch", "list", "bool"])  # fmt: skip
def test_stream_refuses_non_integer_documents_naming_the_index(bad):
    docs = _docs()
    docs[4] = bad
    with pytest.raises(ValueError, match="PackedRowStream: document 4 must hold integer token ids"):
        PackedRowStream(docs, seq_len=16, batch_size=2, pad_id=2)


@pytest.mark.parametrize("pad_id", [-1, 0.5, True, None, "2"])
def test_stream_refuses_a_pad_id_that_is_not_an_int_at_least_0(pad_id):
    with pytest.raises(ValueError, match=re.escape(f"PackedRowStream.pad_id must be an int >= 0, got {pad_id!r}")):
        PackedRowStream(_docs(), seq_len=16, batch_size=2, pad_id=pad_id)
    assert next(PackedRowStream(_docs(), seq_len=16, batch_size=2, pad_id=np.int64(0))).tokens.shape == (2, 16)
