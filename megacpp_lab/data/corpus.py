"""The C++ corpus: hand-written C++ from pinned Debian packages, deduplicated and split (`build_corpus`, `megacpp-lab
data corpus`), the headers shipped inside the installed torch package, or any directory."""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

CPP_SUFFIXES = (".h", ".hpp", ".hh", ".hxx", ".cuh", ".cpp", ".cc", ".cxx", ".cu", ".inl", ".ipp")


@dataclass(frozen=True)
class SourceFile:
    """One document of the corpus: its path relative to the corpus root, bytes and sha256."""

    relpath: str
    data: bytes

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.data).hexdigest()


def _json_kind(value: object) -> str:
    return {dict: "object", list: "list", str: "string", bool: "boolean", type(None): "null"}.get(
        type(value), "number")


def read_json_manifest(path: str | Path, required: tuple[str, ...] = ()) -> dict:
    """The top-level object of a JSON manifest at path, holding every key of `required`. Fails closed with a
    ValueError naming the file: not UTF-8 JSON, a top level that is not an object, or a missing key."""
    path = Path(path)
    try:
        value = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"manifest {path} is not valid JSON ({exc}); rebuild it") from exc
    return manifest_object(value, path, required=required)


def manifest_object(value: object, path: str | Path, where: str = "", required: tuple[str, ...] = ()) -> dict:
    """value, checked to be a JSON object holding every key of `required`; else a ValueError naming the manifest
    file, the place in it (`where`: "bpe_sample", "files[3]"; the top level when empty) and the missing key."""
    place = f"manifest {path}" + (f": {where}" if where else "")
    if not isinstance(value, dict):
        raise ValueError(f"{place} must be a JSON object, got a JSON {_json_kind(value)}")
    for key in required:
        if key not in value:
            raise ValueError(f"{place} has no {key!r}")
    return value


def manifest_relpath(rec: dict, key: str, path: str | Path, where: str) -> str:
    """rec[key], checked to be a non-empty relative path that stays below its base (no '..', not absolute)."""
    rel = rec[key]
    if not isinstance(rel, str) or not rel or Path(rel).is_absolute() or ".." in Path(rel).parts:
        raise ValueError(f"manifest {path}: {where} {key!r} must be a relative path with no '..', got {rel!r}")
    return rel


def read_corpus_manifest(path: str | Path) -> tuple[dict, list[dict]]:
    """A built corpus's manifest and its 'files' records, each checked: every record has a 'status', and a kept
    one a 'path' (relative, inside files/), 'split' and 'sha256'. Fails closed naming the file, record and key."""
    manifest = read_json_manifest(path, required=("files",))
    records = manifest["files"]
    if not isinstance(records, list):
        raise ValueError(f"manifest {path}: 'files' must be a JSON list, got a JSON {_json_kind(records)}")
    for i, rec in enumerate(records):
        manifest_object(rec, path, f"files[{i}]", required=("status",))
        if rec["status"] == "kept":
            manifest_object(rec, path, f"files[{i}]", required=("path", "split", "sha256"))
            manifest_relpath(rec, "path", path, f"files[{i}]")
    return manifest, records


def torch_include_dir() -> Path:
    """`torch/include` of the installed torch: about 9k real C++ headers."""
    import torch

    root = Path(torch.__file__).parent / "include"
    if not root.is_dir():
        raise FileNotFoundError(f"this torch install has no headers at {root}; pass a corpus directory instead")
    return root


def list_cpp_files(root: str | Path, suffixes: tuple[str, ...] = CPP_SUFFIXES) -> list[Path]:
    """Every C++ file under root, sorted by relative path so that corpora are reproducible. A corpus that
    `megacpp-lab data corpus` built (its manifest in root): the files of its training split alone, so that what
    trains the tokenizer or fills the sample never holds a validation, test or held-out file."""
    root = Path(root)
    if not root.exists():
        raise FileNotFoundError(f"corpus root {root} does not exist")
    if not root.is_dir():
        raise NotADirectoryError(f"corpus root {root} is not a directory")
    if (root / CORPUS_MANIFEST).exists():
        records = read_corpus_manifest(root / CORPUS_MANIFEST)[1]
        files = sorted(root / "files" / r["path"] for r in records if r["status"] == "kept" and r["split"] == "train")
    else:
        files = sorted(p for p in root.rglob("*") if p.is_file() and p.suffix in suffixes)
    if not files:
        raise ValueError(f"corpus root {root} holds no C++ files with suffixes {suffixes}")
    return files


def describe_source(root: str | Path | None) -> dict:
    """The manifest's words for where a sample's or tokenizer's files came from, the same on every machine: torch's
    headers (root None), a built corpus's training split (its sources and versions), or a user directory."""
    if root is None:
        return {"source_root": "torch/include", "source": "torch/include of the installed torch"}
    path = Path(root) / CORPUS_MANIFEST
    if path.exists():
        summary = read_json_manifest(path, required=("summary",))["summary"]
        manifest_object(summary, path, "summary", required=("sources",))
        sources = manifest_object(summary["sources"], path, "summary.sources")
        for name, s in sources.items():
            manifest_object(s, path, f"summary.sources.{name}", required=("version", "role"))
        return {"source_root": "megacpp-lab data corpus", "source": "the training split of the Debian C++ corpus",
                "corpus_sources": {name: s["version"] for name, s in sources.items() if s["role"] != "heldout"}}  # fmt: skip
    return {"source_root": str(root), "source": "user directory"}


def corpus_base(root: str | Path) -> Path:
    """What a file's relpath is relative to: root, or a built corpus's files/ (relpaths <source>/<path>)."""
    root = Path(root)
    return root / "files" if (root / CORPUS_MANIFEST).exists() else root


def load_corpus(
    root: str | Path | None = None,
    *,
    max_files: int | None = None,
    max_bytes: int | None = None,
    min_bytes: int = 1,
    stride: int = 1,
    progress: bool = False,
) -> list[SourceFile]:
    """Read C++ files under root (default: torch's headers).

    `stride` takes every n-th file so a small sample still spans the whole tree;
    `max_bytes` stops once that many bytes are read; files under `min_bytes` are skipped.
    """
    root = Path(root) if root is not None else torch_include_dir()
    if stride < 1:
        raise ValueError(f"stride must be >= 1, got {stride}")
    paths = list_cpp_files(root)[::stride]
    docs: list[SourceFile] = []
    total = 0
    iterator = paths
    if progress:
        from tqdm.auto import tqdm

        iterator = tqdm(paths, desc="reading C++ files", unit="file")
    for path in iterator:
        data = path.read_bytes()
        if len(data) < min_bytes:
            continue
        docs.append(SourceFile(relpath=path.relative_to(corpus_base(root)).as_posix(), data=data))
        total += len(data)
        if max_files is not None and len(docs) >= max_files:
            break
        if max_bytes is not None and total >= max_bytes:
            break
    return docs


MANIFEST_FILE = "manifest.json"
# manifest.json sections written beside the byte sample's top-level fields, always after them, in this order
BPE_SECTIONS = ("bpe_tokenizer", "bpe_sample")


def repo_data_dir() -> Path:
    """data/ at the repository root (beside the package)."""
    return Path(__file__).resolve().parents[2] / "data"


def read_manifest(data_dir: Path) -> dict:
    path = Path(data_dir) / MANIFEST_FILE
    return read_json_manifest(path) if path.exists() else {}


def update_manifest(data_dir: Path, byte_fields: dict | None = None, **sections: dict) -> None:
    """Rewrite data_dir/manifest.json with new byte-sample fields and/or BPE sections, keeping the rest.

    The byte sample's fields come first and the BPE sections after them in a fixed order, so the same
    contents give the same bytes whichever part was built first (the manifest holds no wall-clock time).
    """
    unknown = set(sections) - set(BPE_SECTIONS)
    if unknown:
        raise ValueError(f"unknown manifest sections {sorted(unknown)}; known: {BPE_SECTIONS}")
    old = read_manifest(data_dir)
    manifest = dict(byte_fields) if byte_fields is not None else {k: v for k, v in old.items() if k not in BPE_SECTIONS}
    for key in BPE_SECTIONS:
        value = sections.get(key, old.get(key))
        if value is not None:
            manifest[key] = value
    (Path(data_dir) / MANIFEST_FILE).write_text(json.dumps(manifest, indent=1) + "\n")


# ----------------------------------------------------------------------------- the Debian corpus

CORPUS_ENV = "MEGACPP_CORPUS_DIR"
CORPUS_MANIFEST = "corpus_manifest.json"
SPLITS = ("train", "val", "test", "heldout")
# a generator's marker in a file's first 2 KiB: torchgen's "@generated" (the ATen/ops family), protobuf's and
# others' "DO NOT EDIT". Generated files are not the hand-written C++ the corpus is for.
GENERATED_MARKERS = (b"@generated", b"DO NOT EDIT", b"Do not edit", b"do not edit")


@dataclass(frozen=True)
class CorpusConfig:
    """What `build_corpus` takes: packages (names from data/debian.py PINNED; None: all), the torch headers as a
    second source, the near-duplicate threshold (estimated Jaccard over 5-token shingles), and the shares of the
    training libraries' files held out (by a hash of the path: whole files, the same for every seed)."""

    packages: tuple[str, ...] | None = None
    include_torch: bool = True
    near_threshold: float = 0.8
    val_fraction: float = 0.02
    test_fraction: float = 0.02

    def __post_init__(self) -> None:
        t = self.near_threshold
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not 0 < t <= 1:
            raise ValueError(f"CorpusConfig.near_threshold must be a number in (0, 1], got {t!r}")
        for name in ("val_fraction", "test_fraction"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v < 0.5:
                raise ValueError(f"CorpusConfig.{name} must be a number in (0, 0.5), got {v!r}")


def default_corpus_dir() -> Path:
    """$MEGACPP_CORPUS_DIR, else ~/.cache/megacpp-lab/corpus."""
    env = os.environ.get(CORPUS_ENV)
    return Path(env) if env else Path.home() / ".cache" / "megacpp-lab" / "corpus"


def is_generated(data: bytes) -> bool:
    head = data[:2048]
    return any(marker in head for marker in GENERATED_MARKERS)


def _split_of(key: str, config: CorpusConfig) -> str:
    u = int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "big") / 2.0**64
    return "val" if u < config.val_fraction else "test" if u < config.val_fraction + config.test_fraction else "train"


def build_corpus(out_dir: str | Path | None = None, config: CorpusConfig = CorpusConfig(), *, mirror: str | None = None,
                 use_apt: bool = True, progress: bool = False) -> Path:  # fmt: skip
    """Fetch the pinned packages (data/debian.py), take their C/C++ files under usr/include (and torch's headers),
    drop generated files, exact and near duplicates (data/dedup.py: the pinned libraries first, torch's headers
    next, the held-out library last, so a copy survives in training and never in the held-out set), split the
    rest, write each kept file under out_dir/files/<source>/<path> and the manifest (every file: source, version,
    the .deb's sha256, licence, the file's sha256, bytes, status, the file it duplicates, split). Returns the
    manifest's path. Reruns reuse the verified .deb files in out_dir/debs."""
    import shutil

    from megacpp_lab.data.debian import DEBIAN_MIRROR, cpp_members, fetch_deb, resolve_packages
    from megacpp_lab.data.dedup import DedupConfig, dedup

    out = Path(out_dir) if out_dir is not None else default_corpus_dir()
    packages = resolve_packages(config.packages)
    records: list[dict] = []
    blobs: list[bytes] = []

    def say(msg: str) -> None:
        if progress:
            print(f"[data corpus] {msg}", flush=True)

    ordered = [p for p in packages if p.role != "heldout"], [p for p in packages if p.role == "heldout"]
    sources: list[tuple[str, object]] = [("deb", p) for p in ordered[0]]
    if config.include_torch:
        sources.append(("torch", None))
    sources += [("deb", p) for p in ordered[1]]
    for kind, pkg in sources:
        if kind == "deb":
            say(f"{pkg.name} {pkg.version}: fetching (apt-get download, else {mirror or DEBIAN_MIRROR}), checking sha256")
            deb = fetch_deb(pkg, out / "debs", mirror=mirror or DEBIAN_MIRROR, use_apt=use_apt)
            meta = dict(source=pkg.name, version=pkg.version, deb_sha256=pkg.sha256, license=pkg.license, role=pkg.role)
            members = sorted(cpp_members(deb, pkg))
        else:
            import torch

            meta = dict(source="torch", version=torch.__version__, deb_sha256=None, license="BSD-3-Clause", role="train")
            root = torch_include_dir()
            members = [(p.relative_to(root).as_posix(), p.read_bytes()) for p in list_cpp_files(root)]
        say(f"{meta['source']}: {len(members)} C/C++ files")
        for path, data in members:
            records.append(dict(path=f"{meta['source']}/{path}", **meta, sha256=hashlib.sha256(data).hexdigest(),
                                bytes=len(data)))  # fmt: skip
            blobs.append(data)
    generated = [is_generated(b) for b in blobs]
    candidates = [i for i, g in enumerate(generated) if not g]
    say(f"{sum(generated)} generated files dropped; deduplicating {len(candidates)} (exact, then near at estimated "
        f"Jaccard >= {config.near_threshold})")  # fmt: skip
    result = dedup([blobs[i] for i in candidates], DedupConfig(threshold=config.near_threshold), progress=progress)
    for i, g in enumerate(generated):
        if g:
            records[i].update(status="generated", dup_of=None, similarity=None, split=None)
    for local, i in enumerate(candidates):
        status = result.status[local]
        dup = result.dup_of[local]
        records[i].update(status=status, dup_of=None if dup < 0 else records[candidates[dup]]["path"],
                          similarity=None if dup < 0 else round(result.similarity[local], 4))  # fmt: skip
        records[i]["split"] = None if status != "kept" else (
            "heldout" if records[i]["role"] == "heldout" else _split_of(records[i]["path"], config))
    files_dir = out / "files"
    if files_dir.exists():
        shutil.rmtree(files_dir)
    for rec, data in zip(records, blobs):
        if rec["status"] == "kept":
            target = files_dir / rec["path"]
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(data)
    summary = corpus_summary(records)
    manifest = dict(config=asdict(config) | {"dedup": asdict(DedupConfig(threshold=config.near_threshold))},
                    mirror=mirror or DEBIAN_MIRROR, summary=summary, files=records)  # fmt: skip
    path = out / CORPUS_MANIFEST
    path.write_text(json.dumps(manifest, indent=0) + "\n")
    for src, s in summary["sources"].items():
        say(f"{src}: {s['files']} files, kept {s['kept']} ({s['kept_bytes'] / 1e6:.1f} MB); removed: generated "
            f"{s['generated']}, exact {s['exact']}, near {s['near']}")  # fmt: skip
    say(f"splits: " + ", ".join(f"{k} {v['files']} files {v['bytes'] / 1e6:.1f} MB" for k, v in summary["splits"].items()))
    return path


def corpus_summary(records: list[dict]) -> dict:
    """Per source: files, kept, the removed counts by reason and their share; per split: files and bytes."""
    sources: dict[str, dict] = {}
    for rec in records:
        s = sources.setdefault(rec["source"], dict(version=rec["version"], license=rec["license"], role=rec["role"],
                                                   files=0, bytes=0, kept=0, kept_bytes=0, generated=0, exact=0,
                                                   near=0))  # fmt: skip
        s["files"] += 1
        s["bytes"] += rec["bytes"]
        if rec["status"] == "kept":
            s["kept"] += 1
            s["kept_bytes"] += rec["bytes"]
        else:
            s[rec["status"]] += 1
    for s in sources.values():
        s["removed_share"] = round(1 - s["kept"] / s["files"], 4) if s["files"] else 0.0
    splits = {k: dict(files=0, bytes=0) for k in SPLITS}
    for rec in records:
        if rec["status"] == "kept":
            splits[rec["split"]]["files"] += 1
            splits[rec["split"]]["bytes"] += rec["bytes"]
    return dict(sources=sources, splits=splits)


def load_corpus_split(split: str, corpus_dir: str | Path | None = None) -> list[SourceFile]:
    """The kept files of one split ("train", "val", "test" or "heldout") of a built corpus, as SourceFile (relpath:
    <source>/<install path>), each checked against the manifest's sha256."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    root = Path(corpus_dir) if corpus_dir is not None else default_corpus_dir()
    path = root / CORPUS_MANIFEST
    if not path.exists():
        raise FileNotFoundError(f"no corpus at {root} ({CORPUS_MANIFEST} missing): `megacpp-lab data corpus` builds it")
    out = []
    for rec in read_corpus_manifest(path)[1]:
        if rec["status"] == "kept" and rec["split"] == split:
            data = (root / "files" / rec["path"]).read_bytes()
            if hashlib.sha256(data).hexdigest() != rec["sha256"]:
                raise ValueError(f"corpus file {rec['path']}: its sha256 differs from the manifest's (edited or "
                                 "corrupt); rebuild with `megacpp-lab data corpus`")  # fmt: skip
            out.append(SourceFile(relpath=rec["path"], data=data))
    return out


def archive_corpus(corpus_dir: str | Path | None, path: str | Path) -> Path:
    """A built corpus (its manifest and kept files) as one tar.xz, to carry to a machine that cannot reach the
    archive (a GPU box without a registry): `restore_corpus` puts it back. Members are sorted with zeroed
    owners and times, so the same corpus gives the same archive."""
    import tarfile

    root = Path(corpus_dir) if corpus_dir is not None else default_corpus_dir()
    manifest = root / CORPUS_MANIFEST
    if not manifest.exists():
        raise FileNotFoundError(f"no corpus at {root} ({CORPUS_MANIFEST} missing): `megacpp-lab data corpus` builds it")
    kept = sorted(r["path"] for r in read_corpus_manifest(manifest)[1] if r["status"] == "kept")

    def add(tf: tarfile.TarFile, src: Path, name: str) -> None:
        info = tarfile.TarInfo(name)
        info.size, info.mode = src.stat().st_size, 0o644
        with open(src, "rb") as f:
            tf.addfile(info, f)

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(path, "w:xz", preset=6) as tf:
        add(tf, manifest, CORPUS_MANIFEST)
        for rel in kept:
            add(tf, root / "files" / rel, f"files/{rel}")
    return path


def restore_corpus(archive: str | Path, out_dir: str | Path | None = None) -> Path:
    """Unpack an `archive_corpus` archive and check every kept file against the archive's own manifest (a missing
    or altered file, an unexpected member, or no manifest fails closed, naming it). It unpacks beside out_dir and
    replaces out_dir only once all is checked, so a bad archive leaves a corpus there untouched. Returns the
    manifest's path."""
    import shutil
    import tarfile
    import tempfile

    out = Path(out_dir) if out_dir is not None else default_corpus_dir()
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.restoring-", dir=out.parent))
    try:
        with tarfile.open(archive, "r:xz") as tf:
            for member in tf:
                name = Path(member.name)
                if not member.isfile() or name.is_absolute() or ".." in name.parts or not (
                        member.name == CORPUS_MANIFEST or member.name.startswith("files/")):  # fmt: skip
                    raise ValueError(f"corpus archive {archive}: unexpected member {member.name!r}")
                target = staging / name
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_bytes(tf.extractfile(member).read())
        if not (staging / CORPUS_MANIFEST).exists():
            raise ValueError(f"corpus archive {archive} holds no {CORPUS_MANIFEST}")
        try:
            records = read_corpus_manifest(staging / CORPUS_MANIFEST)[1]
        except ValueError as exc:  # the staging copy goes: name the archive it came from
            raise ValueError(f"corpus archive {archive}: {exc}") from exc
        for rec in records:
            if rec["status"] == "kept":
                f = staging / "files" / rec["path"]
                if not f.exists() or hashlib.sha256(f.read_bytes()).hexdigest() != rec["sha256"]:
                    raise ValueError(f"corpus archive {archive}: file {rec['path']} is missing or differs from the "
                                     "manifest")  # fmt: skip
        if out.exists():
            if (out / "debs").is_dir():  # the verified .deb cache stays
                os.replace(out / "debs", staging / "debs")
            shutil.rmtree(out)
        os.replace(staging, out)
    finally:
        if staging.exists():
            shutil.rmtree(staging)
    return out / CORPUS_MANIFEST


CORPUS_SUMMARY_FILE = "corpus_summary.json"
_LENGTH_BINS = [2**k for k in range(6, 22)]  # 64 B .. 2 MiB: the upper edges of the file-length histogram


def write_corpus_summary(corpus_dir: str | Path, out_dir: str | Path, tokenizer: Any | None = None) -> Path:
    """out_dir/corpus_summary.json: what a notebook shows of a built corpus without the corpus (CI has none): its
    summary (per source and split), the dedup settings, and per source histograms of the kept files' bytes, and
    with a tokenizer of their tokens (tokens per byte per source). Deterministic: no times."""
    import numpy as np

    root = Path(corpus_dir)
    path = root / CORPUS_MANIFEST
    manifest, records = read_corpus_manifest(path)
    manifest_object(manifest, path, required=("summary", "config"))
    kept = [r for r in records if r["status"] == "kept"]
    for i, rec in enumerate(records):
        if rec["status"] == "kept":
            manifest_object(rec, path, f"files[{i}]", required=("source", "bytes"))
    edges = [0, *_LENGTH_BINS, 2**62]
    hist: dict[str, dict] = {}
    for key in sorted({r["source"] for r in kept}):
        rows = [r for r in kept if r["source"] == key]
        entry = {"bytes_hist": np.histogram([r["bytes"] for r in rows], bins=edges)[0].tolist(),
                 "files": len(rows), "bytes": sum(r["bytes"] for r in rows)}  # fmt: skip
        if tokenizer is not None:
            tokens = [len(ids) - 2 for ids in tokenizer.encode_batch([(root / "files" / r["path"]).read_bytes()
                                                                      for r in rows])]  # fmt: skip
            entry.update(tokens_hist=np.histogram(tokens, bins=edges)[0].tolist(), tokens=int(sum(tokens)),
                         tokens_per_byte=round(sum(tokens) / max(1, entry["bytes"]), 4))  # fmt: skip
        hist[key] = entry
    out = {"summary": manifest["summary"], "config": manifest["config"], "bin_upper_edges": [*_LENGTH_BINS, None],
           "per_source": hist,
           "tokenizer": None if tokenizer is None else (getattr(tokenizer, "record", None) or {}).get("sha256")}  # fmt: skip
    path = Path(out_dir) / CORPUS_SUMMARY_FILE
    path.write_text(json.dumps(out, indent=1) + "\n")
    return path
