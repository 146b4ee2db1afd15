"""Training batches: packed BPE rows streamed from the corpus, shuffled per epoch, deterministic per seed.

    files = load_corpus()                                        # SourceFile per C++ file
    train, val = split_by_file(files, val_fraction=0.05)         # held out by file, not by row
    docs = tokenize_files(train, load_bpe())                     # token ids per file (bos ... eos)
    stream = PackedRowStream(docs, seq_len=4096, batch_size=8, pad_id=2, seed=0)
    for batch in stream:                                          # PackedBatch [8, 4096], forever
        ...
    state = stream.state_dict()                                   # (epoch, batch): resume where it stopped

The split hashes each file's relative path, so the validation files are the same for every seed and
every run: no training row ever holds a token of a validation file. Each epoch permutes the file order with
a generator seeded by (seed, epoch), packs the files back to back into rows (`pack_documents`: a file
that runs past the end of a row continues in the next, as a new segment) and yields full batches; the
last partial batch of an epoch is dropped, so every batch has the same shape.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from megacpp_lab.checks import check_int
from megacpp_lab.data.corpus import SourceFile
from megacpp_lab.data.packing import PackedBatch, pack_documents

__all__ = ["PackedRowStream", "split_by_file", "tokenize_files"]


def _unit_hash(relpath: str) -> float:
    """A number in [0, 1) fixed by the path alone."""
    return int.from_bytes(hashlib.sha256(relpath.encode()).digest()[:8], "big") / 2.0**64


def split_by_file(files: Sequence[SourceFile], val_fraction: float) -> tuple[list[SourceFile], list[SourceFile]]:
    """(train, val): a file is held out when the hash of its relative path falls under val_fraction, so the
    split does not depend on the seed, the file order or which other files are present. Fails closed when
    either side would be empty."""
    if isinstance(val_fraction, bool) or not isinstance(val_fraction, (int, float)) or not 0 < val_fraction < 1:
        raise ValueError(f"val_fraction must be a number in (0, 1), got {val_fraction!r}")
    relpaths = [f.relpath for f in files]
    if len(set(relpaths)) != len(relpaths):
        dup = next(p for p in relpaths if relpaths.count(p) > 1)
        raise ValueError(f"the corpus holds {dup!r} twice: a file cannot be split by path")
    train = [f for f in files if _unit_hash(f.relpath) >= val_fraction]
    val = [f for f in files if _unit_hash(f.relpath) < val_fraction]
    if not train or not val:
        raise ValueError(f"val_fraction={val_fraction} over {len(files)} files leaves {len(train)} training and "
                         f"{len(val)} validation files; both need at least one")  # fmt: skip
    return train, val


def tokenize_files(files: Sequence[SourceFile], tokenizer: Any, *, progress: bool = False,
                   cache_dir: str | Path | None = None) -> list[np.ndarray]:  # fmt: skip
    """Token ids of each file, <bos> ... <eos>, as int32 arrays (the tokenizer's encode).

    cache_dir: keep the result in `<cache_dir>/<key>.npz`, the key a sha256 over the tokenizer's recorded
    sha256 and every file's path and content, and read it back on the next call with the same files (every
    rank of a run, a notebook restart, both runs of a benchmark): tokenizing thousands of files takes far
    longer than reading them. A tokenizer that records no sha256 (`record`, set by load_bpe) cannot be
    named in a key, so it is never cached."""
    from tqdm.auto import tqdm

    identity = (getattr(tokenizer, "record", None) or {}).get("sha256")
    path = None
    if cache_dir is not None and identity:
        h = hashlib.sha256(f"tokenize_files v1 {identity}".encode())
        for f in files:
            h.update(f"\0{f.relpath}\0{f.sha256}".encode())
        path = Path(cache_dir) / f"{h.hexdigest()[:32]}.npz"
        if path.is_file():
            with np.load(path) as saved:
                flat, ends = saved["tokens"], saved["ends"]
            return np.split(flat, ends[:-1]) if len(ends) else []
    docs: list[np.ndarray] = []
    batch = 256 if hasattr(tokenizer, "encode_batch") else 1  # the BPE encodes a batch on all cores
    with tqdm(total=len(files), desc="tokenizing", unit="file", disable=not progress) as bar:
        for i in range(0, len(files), batch):
            part = files[i : i + batch]
            ids = tokenizer.encode_batch([f.data for f in part]) if batch > 1 else [tokenizer.encode(part[0].data)]
            docs.extend(np.asarray(d, dtype=np.int32) for d in ids)
            bar.update(len(part))
    if path is not None:  # written beside and renamed: a reader (another rank) sees a whole file or none
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.stem}.{os.getpid()}.tmp.npz")
        ends = np.cumsum([len(d) for d in docs], dtype=np.int64)
        np.savez(tmp, tokens=np.concatenate(docs) if docs else np.zeros(0, np.int32), ends=ends)
        os.replace(tmp, path)
    return docs


def _is_int_dtype(dtype: np.dtype | torch.dtype) -> bool:
    """An integer dtype, numpy's or torch's; bool is not one."""
    if isinstance(dtype, torch.dtype):
        return not (dtype.is_floating_point or dtype.is_complex or dtype == torch.bool)
    return np.issubdtype(dtype, np.integer)


class PackedRowStream:
    """Full batches of packed rows over `docs`, epoch after epoch; see the module docstring.

    state_dict() / load_state_dict() hold (epoch, batch): a stream restored from a state yields exactly the
    batches the original would have yielded next."""

    def __init__(self, docs: Sequence[np.ndarray], *, seq_len: int, batch_size: int, pad_id: int, seed: int = 0,
                 shuffle: bool = True, max_doc_tokens: int | None = None) -> None:  # fmt: skip
        check_int("PackedRowStream", "seq_len", seq_len, low=1)
        check_int("PackedRowStream", "batch_size", batch_size, low=1)
        check_int("PackedRowStream", "pad_id", pad_id, low=0)
        if not docs:
            raise ValueError("PackedRowStream needs at least one document")
        empty = [i for i, d in enumerate(docs) if len(d) == 0]
        if empty:
            raise ValueError(f"PackedRowStream: document {empty[0]} is empty")
        for i, d in enumerate(docs):  # pack_documents casts to int64: a float document would be truncated silently
            dtype = d.dtype if isinstance(d, (np.ndarray, torch.Tensor)) else np.asarray(d).dtype
            if not _is_int_dtype(dtype):
                raise ValueError(f"PackedRowStream: document {i} must hold integer token ids, got dtype {dtype}")
        self.docs, self.seq_len, self.batch_size = list(docs), seq_len, batch_size
        self.pad_id, self.seed, self.shuffle, self.max_doc_tokens = pad_id, seed, shuffle, max_doc_tokens
        tokens = sum(len(d) for d in docs)
        self.batches_per_epoch = tokens // seq_len // batch_size
        if self.batches_per_epoch < 1:
            raise ValueError(f"PackedRowStream: {tokens} tokens make fewer than one batch of {batch_size} x {seq_len}")
        self.epoch, self.batch = 0, 0
        self._rows: tuple[int, PackedBatch] | None = None  # the current epoch's rows

    def epoch_order(self, epoch: int) -> list[int]:
        """The document order of an epoch: a permutation seeded by (seed, epoch), or as given."""
        if not self.shuffle:
            return list(range(len(self.docs)))
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        return torch.randperm(len(self.docs), generator=gen).tolist()

    def _epoch_rows(self, epoch: int) -> PackedBatch:
        if self._rows is None or self._rows[0] != epoch:
            order = self.epoch_order(epoch)
            rows = self.batches_per_epoch * self.batch_size
            packed = pack_documents([self.docs[i] for i in order], self.seq_len, pad_id=self.pad_id, max_rows=rows,
                                    max_doc_tokens=self.max_doc_tokens)  # fmt: skip
            self._rows = (epoch, packed.batch)
        return self._rows[1]

    def __iter__(self) -> Iterator[PackedBatch]:
        return self

    def __next__(self) -> PackedBatch:
        rows = self._epoch_rows(self.epoch)
        lo = self.batch * self.batch_size
        out = rows.rows(slice(lo, lo + self.batch_size))
        self.batch += 1
        if self.batch == self.batches_per_epoch:
            self.epoch, self.batch = self.epoch + 1, 0
        return out

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "batch": self.batch, "seed": self.seed, "documents": len(self.docs),
                "batches_per_epoch": self.batches_per_epoch}  # fmt: skip

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Resume at a saved position; fails closed, naming the field, on a state from another stream."""
        mine = self.state_dict()
        for field in ("seed", "documents", "batches_per_epoch"):
            if state.get(field) != mine[field]:
                raise ValueError(f"loader state field {field!r} is {state.get(field)!r}, this stream has {mine[field]!r}")
        epoch, batch = state.get("epoch"), state.get("batch")
        if not isinstance(epoch, int) or epoch < 0:
            raise ValueError(f"loader state field 'epoch' must be an int >= 0, got {epoch!r}")
        if not isinstance(batch, int) or not 0 <= batch < self.batches_per_epoch:
            raise ValueError(f"loader state field 'batch' must be an int in [0, {self.batches_per_epoch}), got {batch!r}")
        self.epoch, self.batch = epoch, batch
