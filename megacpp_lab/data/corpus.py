"""A real C++ corpus: the headers shipped inside the installed torch package (or any directory)."""

from __future__ import annotations

import hashlib
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
