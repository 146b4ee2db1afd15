"""A real C++ corpus: the headers shipped inside the installed torch package (or any directory)."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

CPP_SUFFIXES = (".h", ".hpp", ".hh", ".hxx", ".cuh", ".cpp", ".cc", ".cxx", ".cu", ".inl", ".ipp")


@dataclass(frozen=True)
class SourceFile:
    """One document of the corpus: its path relative to the corpus root, bytes and sha256."""

    relpath: str
    data: bytes

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.data).hexdigest()


def torch_include_dir() -> Path:
    """`torch/include` of the installed torch: about 9k real C++ headers."""
    import torch

    root = Path(torch.__file__).parent / "include"
    if not root.is_dir():
        raise FileNotFoundError(f"this torch install has no headers at {root}; pass a corpus directory instead")
    return root


def list_cpp_files(root: str | Path, suffixes: tuple[str, ...] = CPP_SUFFIXES) -> list[Path]:
    """Every C++ file under root, sorted by relative path so that corpora are reproducible."""
    root = Path(root)
    if not root.exists():
        raise FileNotFoundError(f"corpus root {root} does not exist")
    if not root.is_dir():
        raise NotADirectoryError(f"corpus root {root} is not a directory")
    files = sorted(p for p in root.rglob("*") if p.is_file() and p.suffix in suffixes)
    if not files:
        raise ValueError(f"corpus root {root} holds no C++ files with suffixes {suffixes}")
    return files


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
        docs.append(SourceFile(relpath=path.relative_to(root).as_posix(), data=data))
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
    return json.loads(path.read_text()) if path.exists() else {}


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
