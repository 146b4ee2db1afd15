"""Duplicate removal for a code corpus: exact (content sha256), then near (MinHash over token shingles, LSH).

    result = dedup(docs, config=DedupConfig(threshold=0.8))   # docs: bytes, in priority order (first kept)
    result.status[i]      # "kept", "exact" or "near"
    result.dup_of[i]      # the kept document it duplicates (-1 when kept)

A document's shingles are its overlapping k-grams of C++ tokens (identifiers, numbers, single punctuation
characters: whitespace and layout do not count). Its MinHash signature holds, for each of `perms` seeded
multiply-shift hashes, the least hash over its shingles; two signatures agree in a slot with probability the
Jaccard similarity of the shingle sets. Greedy in the given order: a document is a near duplicate when a kept
document shares an LSH band with it (bands x rows = perms) and their signatures agree in at least `threshold` of
the slots; else it is kept. The order decides which copy survives, and no chain of near duplicates can drop a
document far from every kept one. `jaccard` is the exact similarity the estimate is tested against.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

__all__ = ["DedupConfig", "DedupResult", "dedup", "jaccard", "minhash", "shingles"]

_TOKEN = re.compile(rb"[A-Za-z_][A-Za-z0-9_]*|\d+|\S")
_MASK64 = (1 << 64) - 1


@dataclass(frozen=True)
class DedupConfig:
    """threshold: the least estimated Jaccard similarity of a near duplicate; shingle: tokens per shingle;
    perms = bands * rows: the signature's length; seed fixes the hashes (the same corpus dedups the same way)."""

    threshold: float = 0.8
    shingle: int = 5
    bands: int = 16
    rows: int = 8
    seed: int = 0

    def __post_init__(self) -> None:
        if not 0 < self.threshold <= 1:
            raise ValueError(f"DedupConfig.threshold must be in (0, 1], got {self.threshold}")
        for name in ("shingle", "bands", "rows"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"DedupConfig.{name} must be an int >= 1, got {getattr(self, name)!r}")

    @property
    def perms(self) -> int:
        return self.bands * self.rows


@dataclass
class DedupResult:
    """Per document, in the input order: status ("kept", "exact", "near"), dup_of (the kept index, -1 when
    kept) and similarity (the estimated Jaccard with dup_of: 1.0 for an exact copy of a kept document, the near
    duplicate's for an exact copy of one; 0.0 when kept)."""

    status: list[str] = field(default_factory=list)
    dup_of: list[int] = field(default_factory=list)
    similarity: list[float] = field(default_factory=list)

    def kept(self) -> list[int]:
        return [i for i, s in enumerate(self.status) if s == "kept"]


class _TokenHasher:
    """A stable 64-bit hash per token (blake2b, not Python's salted hash), memoised across documents."""

    def __init__(self) -> None:
        self._memo: dict[bytes, int] = {}

    def __call__(self, tokens: list[bytes]) -> np.ndarray:
        memo = self._memo
        out = np.empty(len(tokens), dtype=np.uint64)
        for i, t in enumerate(tokens):
            h = memo.get(t)
            if h is None:
                h = memo[t] = int.from_bytes(hashlib.blake2b(t, digest_size=8).digest(), "little")
            out[i] = h
        return out


def shingles(data: bytes, k: int = 5, hasher: _TokenHasher | None = None) -> np.ndarray:
    """The distinct k-token shingles of a document as uint64 hashes (sorted). A document of fewer than k tokens
    has one shingle: all its tokens."""
    tokens = _TOKEN.findall(data)
    if not tokens:
        return np.zeros(0, dtype=np.uint64)
    h = (hasher or _TokenHasher())(tokens)
    if len(h) < k:
        k = len(h)
    # a polynomial over the window, wrapping mod 2**64: g_i = sum_j h[i+j] * P^(k-1-j)
    P = np.uint64(0x100000001B3)
    with np.errstate(over="ignore"):
        g = np.zeros(len(h) - k + 1, dtype=np.uint64)
        for j in range(k):
            g = g * P + h[j : len(h) - k + 1 + j]
    return np.unique(g)


def _coefficients(perms: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.Generator(np.random.PCG64(seed))
    a = rng.integers(1, 2**63, size=perms, dtype=np.uint64) * np.uint64(2) + np.uint64(1)  # odd multipliers
    b = rng.integers(0, 2**63, size=perms, dtype=np.uint64)
    return a, b


def minhash(sh: np.ndarray, perms: int = 128, seed: int = 0, *, _coef: tuple[np.ndarray, np.ndarray] | None = None) -> np.ndarray:
    """[perms] uint32: for each seeded hash x -> (a x + b) mod 2**64 >> 32, its least value over the shingles
    (an empty set: all ones, equal only to another empty set)."""
    a, b = _coef if _coef is not None else _coefficients(perms, seed)
    sig = np.full(perms, np.iinfo(np.uint32).max, dtype=np.uint64)
    with np.errstate(over="ignore"):
        for i in range(0, len(sh), 4096):  # [perms, 4096] at a time: bounded memory for large files
            block = sh[i : i + 4096]
            sig = np.minimum(sig, ((a[:, None] * block[None, :] + b[:, None]) >> np.uint64(32)).min(axis=1))
    return sig.astype(np.uint32)


def jaccard(a: np.ndarray, b: np.ndarray) -> float:
    """The exact Jaccard similarity of two shingle sets (sorted unique uint64 arrays)."""
    if len(a) == 0 and len(b) == 0:
        return 1.0
    inter = len(np.intersect1d(a, b, assume_unique=True))
    return inter / (len(a) + len(b) - inter)


def dedup(docs: Sequence[bytes], config: DedupConfig = DedupConfig(), *, progress: bool = False) -> DedupResult:
    """Exact, then near duplicates of docs (in priority order: the first copy is kept). Module docstring."""
    result = DedupResult()
    first_by_hash: dict[bytes, int] = {}
    coef = _coefficients(config.perms, config.seed)
    hasher = _TokenHasher()
    buckets: list[dict[bytes, list[int]]] = [{} for _ in range(config.bands)]
    signatures: dict[int, np.ndarray] = {}
    iterator: Sequence[bytes] = docs
    if progress:
        from tqdm.auto import tqdm

        iterator = tqdm(docs, desc="dedup (exact, then MinHash near duplicates)", unit="file")
    for i, data in enumerate(iterator):
        digest = hashlib.sha256(data).digest()
        if digest in first_by_hash:
            first = first_by_hash[digest]  # kept, or itself a near duplicate: point at what was kept
            near = result.status[first] == "near"
            result.status.append("exact")
            result.dup_of.append(result.dup_of[first] if near else first)
            result.similarity.append(result.similarity[first] if near else 1.0)  # with what it points at
            continue
        first_by_hash[digest] = i
        sig = minhash(shingles(data, config.shingle, hasher), config.perms, _coef=coef)
        keys = [sig[r * config.rows : (r + 1) * config.rows].tobytes() for r in range(config.bands)]
        best, best_sim = -1, 0.0
        seen: set[int] = set()
        for band, key in enumerate(keys):
            for j in buckets[band].get(key, ()):
                if j in seen:
                    continue
                seen.add(j)
                sim = float(np.mean(signatures[j] == sig))
                if sim >= config.threshold and (sim > best_sim or (sim == best_sim and j < best)):
                    best, best_sim = j, sim
        if best >= 0:
            result.status.append("near")
            result.dup_of.append(best)
            result.similarity.append(best_sim)
            continue
        result.status.append("kept")
        result.dup_of.append(-1)
        result.similarity.append(0.0)
        signatures[i] = sig
        for band, key in enumerate(keys):
            buckets[band].setdefault(key, []).append(i)
    return result
