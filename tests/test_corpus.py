"""The Debian C++ corpus: pinned .deb files fetched and checked, unpacked in Python, generated files and duplicates
removed (data/dedup.py against exact Jaccard), split by file and by library; bad input fails closed, naming
the package or file."""

from __future__ import annotations

import hashlib
import io
import json
import math
import tarfile
from dataclasses import replace

import numpy as np
import pytest

from megacpp_lab.cli import main
from megacpp_lab.data import debian
from megacpp_lab.data.corpus import (
    CORPUS_MANIFEST,
    CorpusConfig,
    archive_corpus,
    build_corpus,
    describe_source,
    is_generated,
    load_corpus,
    load_corpus_split,
    restore_corpus,
)
from megacpp_lab.data.debian import DebPackage, cpp_members, fetch_deb, is_cpp_header, resolve_packages
from megacpp_lab.data.dedup import DedupConfig, dedup, jaccard, minhash, shingles

SMALL = ("libfmt-dev", "nlohmann-json3-dev")  # 171 KB and 259 KB: the network test's packages


def _deb(members: dict[str, bytes]) -> bytes:
    """A minimal .deb: the ar archive of debian-binary, an empty control.tar.xz and data.tar.xz holding members."""
    def tar(files: dict[str, bytes]) -> bytes:
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w:xz") as tf:
            for name, data in files.items():
                info = tarfile.TarInfo(name)
                info.size = len(data)
                tf.addfile(info, io.BytesIO(data))
        return buf.getvalue()

    out = b"!<arch>\n"
    for name, body in (("debian-binary", b"2.0\n"), ("control.tar.xz", tar({})), ("data.tar.xz", tar(members))):
        out += f"{name:<16}{0:<12}{0:<6}{0:<6}{100644:<8}{len(body):<10}".encode() + b"`\n" + body
        out += b"\n" if len(body) % 2 else b""
    return out


def _pinned_to(tmp_path, blob: bytes, name: str = "libfake-dev") -> DebPackage:
    """A package pinned to blob, served from a file:// mirror under tmp_path."""
    pool = "pool/main/f/fake/libfake-dev_1.0_all.deb"
    (tmp_path / "mirror" / pool).parent.mkdir(parents=True)
    (tmp_path / "mirror" / pool).write_bytes(blob)
    return DebPackage(name, "1.0", pool, len(blob), hashlib.sha256(blob).hexdigest(), "MIT")


def test_only_pinned_packages_enter_and_an_unknown_name_is_named():
    assert [p.name for p in resolve_packages(None)] == [p.name for p in debian.PINNED]
    assert [p.name for p in resolve_packages(["nlohmann-json3-dev", "libfmt-dev"])] == ["libfmt-dev", "nlohmann-json3-dev"]
    with pytest.raises(ValueError, match="'libnope-dev' is not pinned"):
        resolve_packages(["libfmt-dev", "libnope-dev"])
    with pytest.raises(ValueError, match="'libfmt-dev' is named twice"):
        resolve_packages(["libfmt-dev", "libfmt-dev"])
    assert all(len(p.sha256) == 64 and p.pool_path.endswith(p.file_name) for p in debian.PINNED)
    assert [p.name for p in debian.PINNED if p.role == "heldout"] == ["libcgal-dev"]


def test_a_deb_unpacks_in_python_to_its_cpp_headers(tmp_path):
    members = {"./usr/include/lib/a.hpp": b"int a();\n", "./usr/include/c++/12/vector": b"#pragma once\n",
               "./usr/include/lib/blob": b"\0\1\2", "./usr/share/doc/lib/copyright": b"MIT",
               "./usr/include/lib/impl.tcc": b"template<> int f();", "./usr/lib/x.so": b"\x7fELF"}  # fmt: skip
    pkg = _pinned_to(tmp_path, _deb(members))
    path = fetch_deb(pkg, tmp_path / "cache", mirror=(tmp_path / "mirror").as_uri(), use_apt=False)
    assert sorted(name for name, _ in cpp_members(path, pkg)) == [
        "usr/include/c++/12/vector", "usr/include/lib/a.hpp", "usr/include/lib/impl.tcc"]
    assert is_cpp_header("usr/include/eigen3/Eigen/Dense", b"#include \"Core\"\n")
    assert not is_cpp_header("usr/include/x/data.bin", b"\0")  # no C++ suffix
    assert not is_cpp_header("usr/share/x/a.h", b"int a;")  # not under usr/include


def test_a_corrupt_download_fails_closed_naming_the_package_and_is_deleted(tmp_path, monkeypatch):
    good = _deb({"./usr/include/a.h": b"int a;"})
    pkg = _pinned_to(tmp_path, good)
    (tmp_path / "mirror" / pkg.pool_path).write_bytes(good[:-10] + b"corrupted!")  # the mirror now serves bad bytes
    with pytest.raises(ValueError, match=r"package libfake-dev 1.0: the download is sha256 [0-9a-f]{64}, the pin"):
        fetch_deb(pkg, tmp_path / "cache", mirror=(tmp_path / "mirror").as_uri(), use_apt=False)
    assert list((tmp_path / "cache").iterdir()) == []
    (tmp_path / "mirror" / pkg.pool_path).write_bytes(good[:-10])  # a truncated download
    with pytest.raises(ValueError, match=f"package libfake-dev 1.0: the download is {len(good) - 10} bytes, the pin {len(good)}"):
        fetch_deb(pkg, tmp_path / "cache", mirror=(tmp_path / "mirror").as_uri(), use_apt=False)
    # a cached copy that went bad is fetched again, not trusted
    (tmp_path / "mirror" / pkg.pool_path).write_bytes(good)
    (tmp_path / "cache" / pkg.file_name).write_bytes(b"stale")
    path = fetch_deb(pkg, tmp_path / "cache", mirror=(tmp_path / "mirror").as_uri(), use_apt=False)
    assert hashlib.sha256(path.read_bytes()).hexdigest() == pkg.sha256
    # apt's file that is not the pinned one (another architecture's build) is discarded for the pool's
    path.unlink()
    wrong = tmp_path / "apt-got.part"
    monkeypatch.setattr(debian, "_apt_download", lambda p, d: (wrong.write_bytes(b"other build"), wrong)[1])
    path = fetch_deb(pkg, tmp_path / "cache", mirror=(tmp_path / "mirror").as_uri(), use_apt=True)
    assert hashlib.sha256(path.read_bytes()).hexdigest() == pkg.sha256 and not wrong.exists()
    with pytest.raises(OSError, match="package libfake-dev: download of .* failed"):
        fetch_deb(replace(pkg, pool_path="pool/none.deb"), tmp_path / "c2", mirror=(tmp_path / "mirror").as_uri(),
                  use_apt=False)  # fmt: skip


def test_a_malformed_deb_names_the_package(tmp_path):
    for blob, match in ((b"not an archive", "not an ar archive"),
                        (b"!<arch>\n" + b"x" * 30, "truncated or malformed ar member header at byte 8")):  # fmt: skip
        pkg = _pinned_to(tmp_path / match[:3].strip(), blob)
        path = fetch_deb(pkg, tmp_path / "cache", mirror=(tmp_path / match[:3].strip() / "mirror").as_uri(), use_apt=False)
        with pytest.raises(ValueError, match=f"package libfake-dev .*{match}"):
            list(cpp_members(path, pkg))


def _variants(seed: int, n_tokens: int = 400) -> tuple[bytes, bytes, bytes]:
    """(a document, a near copy with 1% of its tokens changed (Jaccard about 0.9 over 5-token shingles), an unrelated one)."""
    rng = np.random.default_rng(seed)
    words = [f"name{i}" for i in range(300)] + list("{}();,<>=+*&")
    a = [words[i] for i in rng.integers(0, len(words), n_tokens)]
    b = list(a)
    for i in rng.choice(n_tokens, n_tokens // 100, replace=False):
        b[i] = "changed"
    c = [words[i] for i in rng.integers(0, len(words), n_tokens)]
    return tuple(" ".join(t).encode() for t in (a, b, c))


def test_minhash_estimates_the_exact_jaccard():
    errors = []
    for seed in range(6):
        a, b, c = _variants(seed)
        for x, y in ((a, b), (a, c), (b, c)):
            sx, sy = shingles(x), shingles(y)
            exact = jaccard(sx, sy)
            est = float(np.mean(minhash(sx, 256) == minhash(sy, 256)))
            errors.append(abs(est - exact))
    # 256 slots: the estimate's standard deviation is at most 1/32
    assert max(errors) < 0.1 and np.mean(errors) < 0.04, errors
    # layout does not count: the same tokens differently spaced are one shingle set
    assert np.array_equal(shingles(b"int  f ( ) ;\n"), shingles(b"int f();"))


def test_dedup_keeps_the_first_copy_and_names_what_each_duplicates():
    a, near_a, other = _variants(0)
    exact_a = bytes(a)
    result = dedup([a, other, near_a, exact_a, b"tiny"], DedupConfig(threshold=0.8))
    assert result.status == ["kept", "kept", "near", "exact", "kept"]
    assert result.dup_of == [-1, -1, 0, 0, -1]
    assert 0.8 <= result.similarity[2] < 1.0 and result.similarity[3] == 1.0
    # the order decides the survivor
    assert dedup([near_a, a]).status == ["kept", "near"]
    # an exact copy of a near duplicate points at what was kept, with the near duplicate's similarity to it
    chained = dedup([a, near_a, bytes(near_a)])
    assert chained.dup_of == [-1, 0, 0] and chained.similarity[2] == chained.similarity[1] < 1.0
    with pytest.raises(ValueError, match="DedupConfig.threshold"):
        DedupConfig(threshold=0)


def test_generated_files_are_recognised_by_their_marker():
    assert is_generated(b"// @generated by torchgen/gen.py from Function.h\n#pragma once")
    assert is_generated(b"/* Preprocessed version. DO NOT EDIT! */")
    assert not is_generated(b"#pragma once\nint f();")
    assert not is_generated(b"x" * 4096 + b"@generated")  # only a file's head says who wrote it


def test_corpus_config_refuses_bad_fractions_and_thresholds():
    with pytest.raises(ValueError, match="CorpusConfig.near_threshold"):
        CorpusConfig(near_threshold=1.5)
    with pytest.raises(ValueError, match="CorpusConfig.val_fraction"):
        CorpusConfig(val_fraction=0.0)
    with pytest.raises(ValueError, match="CorpusConfig.test_fraction"):
        CorpusConfig(test_fraction=True)


def test_the_corpus_builds_from_the_debian_archive_and_splits_by_file_and_library(tmp_path, capsys):
    """The network test: the two smallest pinned packages, through the CLI, from the Debian archive (apt-get
    download where apt is present, else the pool over HTTP)."""
    out = tmp_path / "corpus"
    assert main(["data", "corpus", "--packages", ",".join(SMALL), "--no-torch", "--out", str(out), "--quiet"]) == 0
    assert "wrote" in capsys.readouterr().out
    manifest = json.loads((out / CORPUS_MANIFEST).read_text())
    files = manifest["files"]
    assert {f["source"] for f in files} == set(SMALL)
    pinned = {p.name: p for p in debian.PINNED}
    for f in files:
        assert f["version"] == pinned[f["source"]].version and f["deb_sha256"] == pinned[f["source"]].sha256
        assert f["license"] == "MIT" and f["status"] in ("kept", "exact", "near", "generated")
        assert (f["split"] in ("train", "val", "test")) == (f["status"] == "kept")
    assert any(f["path"] == "libfmt-dev/usr/include/fmt/core.h" for f in files)
    summary = manifest["summary"]
    assert summary["sources"]["libfmt-dev"]["files"] == 13
    kept = sum(s["kept"] for s in summary["sources"].values())
    assert kept == sum(v["files"] for v in summary["splits"].values()) and summary["splits"]["heldout"]["files"] == 0
    train = load_corpus_split("train", out)
    assert len(train) == summary["splits"]["train"]["files"] and all(f.relpath.startswith(SMALL) for f in train)
    # the split is the path's, not the run's: a rebuild gives the same manifest
    first = (out / CORPUS_MANIFEST).read_bytes()
    build_corpus(out, CorpusConfig(packages=SMALL, include_torch=False))
    assert (out / CORPUS_MANIFEST).read_bytes() == first
    # an edited corpus file fails closed, naming it
    victim = out / "files" / train[0].relpath
    victim.write_bytes(victim.read_bytes() + b"// edited")
    with pytest.raises(ValueError, match=f"corpus file {train[0].relpath}: its sha256 differs"):
        load_corpus_split("train", out)
    with pytest.raises(FileNotFoundError, match="megacpp-lab data corpus"):
        load_corpus_split("train", tmp_path / "none")


def test_a_run_trains_on_a_built_corpus_and_reports_the_held_out_librarys_loss(tmp_path, monkeypatch):
    """build_corpus end to end on two packages served from a file:// mirror (40 distinct synthetic headers split
    between a training library and a held-out one), then a tiny run on it: validation from its val split, and the
    held-out library's loss beside it at every evaluation."""
    from megacpp_lab.model.train import tokenize_corpus, train
    from megacpp_lab.model.train_config import TrainConfig

    headers = {f"lib/h{i:02d}.hpp": b"#pragma once\n" + _variants(100 + i, 300)[0] for i in range(40)}
    # the held-out library also ships a near copy of a training header: dropped there, kept in training
    headers["lib/zz_copy.hpp"] = b"#pragma once\n" + _variants(100, 300)[1]
    names = sorted(headers)
    halves = {"libtrain-dev": names[:30], "libheld-dev": names[30:]}
    pinned = []
    for name, part in halves.items():
        blob = _deb({f"./usr/include/{n}": headers[n] for n in part})
        pool = f"pool/main/x/{name}/{name}_1.0_all.deb"
        (tmp_path / "mirror" / pool).parent.mkdir(parents=True)
        (tmp_path / "mirror" / pool).write_bytes(blob)
        pinned.append(DebPackage(name, "1.0", pool, len(blob), hashlib.sha256(blob).hexdigest(), "MIT",
                                 role="heldout" if name == "libheld-dev" else "train"))  # fmt: skip
    monkeypatch.setattr(debian, "PINNED", tuple(pinned))
    out = build_corpus(tmp_path / "corpus", CorpusConfig(include_torch=False, val_fraction=0.2, test_fraction=0.1),
                       mirror=(tmp_path / "mirror").as_uri(), use_apt=False).parent  # fmt: skip
    manifest = json.loads((out / CORPUS_MANIFEST).read_text())
    summary = manifest["summary"]
    assert summary["sources"]["libheld-dev"]["kept"] == summary["splits"]["heldout"]["files"] > 0
    copy = next(f for f in manifest["files"] if f["path"].endswith("zz_copy.hpp"))
    assert copy["status"] == "near" and copy["dup_of"] == "libtrain-dev/usr/include/lib/h00.hpp" and copy["split"] is None
    assert all(f.relpath.startswith("libheld-dev/") for f in load_corpus_split("heldout", out))
    assert not any(f.relpath.startswith("libheld-dev/") for f in load_corpus_split("train", out))
    # what trains the tokenizer or fills the sample from a built corpus: its training split alone
    assert [f.relpath for f in load_corpus(out)] == [f.relpath for f in load_corpus_split("train", out)]
    assert describe_source(out)["corpus_sources"] == {"libtrain-dev": "1.0"}  # the training split's sources
    # carried as one archive to a machine without the Debian archive, and restored there byte for byte
    archive = archive_corpus(out, tmp_path / "corpus.tar.xz")
    moved = tmp_path / "moved"
    assert main(["data", "corpus", "--from-archive", str(archive), "--out", str(moved), "--quiet"]) == 0
    assert load_corpus_split("heldout", moved) == load_corpus_split("heldout", out)
    assert (moved / CORPUS_MANIFEST).read_bytes() == (out / CORPUS_MANIFEST).read_bytes()
    victim = next((moved / "files").rglob("*.hpp"))
    victim.write_bytes(b"// altered")
    archive_corpus(moved, tmp_path / "bad.tar.xz")  # the archive holds the altered file under the old manifest
    with pytest.raises(ValueError, match=f"file {victim.relative_to(moved / 'files').as_posix()} is missing or differs"):
        restore_corpus(tmp_path / "bad.tar.xz", out)
    assert (out / CORPUS_MANIFEST).exists() and load_corpus_split("train", out)  # the corpus there is untouched
    import tarfile

    for member, data in (("../escape.h", b"x"), ("files/../../escape.h", b"x"), ("notes.txt", b"x")):
        with tarfile.open(tmp_path / "evil.tar.xz", "w:xz") as tf:
            info = tarfile.TarInfo(member)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
        with pytest.raises(ValueError, match=f"unexpected member {member!r}"):
            restore_corpus(tmp_path / "evil.tar.xz", tmp_path / "evil")
        assert not (tmp_path / "escape.h").exists() and not (tmp_path / "evil").exists()
    tarfile.open(tmp_path / "empty.tar.xz", "w:xz").close()  # an archive with no member at all
    with pytest.raises(ValueError, match="holds no corpus_manifest.json"):
        restore_corpus(tmp_path / "empty.tar.xz", tmp_path / "evil")
    # the corpus's own flags come after `corpus`; `data`'s before it are refused, not silently dropped
    assert main(["data", "--out", str(tmp_path / "x"), "corpus", "--from-archive", str(archive)]) == 2
    assert not (tmp_path / "x").exists()
    config = TrainConfig(preset="tiny", corpus=str(out), seq_len=64, batch_size=2, steps=4, warmup_steps=1, log_every=2,
                         val_every=2, ckpt_every=4, val_batches=2, device="cpu", tensorboard=False,
                         out_dir=str(tmp_path / "run"))  # fmt: skip
    corpus = tokenize_corpus(config, cache_dir=None)
    assert len(corpus.heldout) == summary["splits"]["heldout"]["files"] and len(corpus.val) == summary["splits"]["val"]["files"]
    result = train(config, progress=False, corpus=corpus)
    evals = [r for r in result.history if "val_loss" in r]
    assert [r["step"] for r in evals] == [2, 4]
    assert all(math.isfinite(r["heldout_loss"]) and r["heldout_loss"] != r["val_loss"] for r in evals)
