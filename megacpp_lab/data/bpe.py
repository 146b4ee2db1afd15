"""Byte-level BPE trained on the C++ corpus with HuggingFace `tokenizers`, pinned by sha256 in the manifest.

Ids: <bos> = 0, <eos> = 1, <pad> = 2 (the trainer puts special tokens first), then the 256 single-byte
tokens, then the merges in the order they were learned. Any byte string round-trips exactly:
- valid UTF-8 goes through the trained tokenizer (ByteLevel pre-tokenizer: every byte is a symbol);
- bytes that are not valid UTF-8 (the Rust tokenizer only takes strings) are emitted as their single-byte
  tokens, so nothing is replaced or dropped; `decode_bytes` gives the original bytes back.
Special-token text inside a document (a header that contains "<bos>") is encoded as plain text, never as
the special id, so a document cannot forge a boundary.

Training is deterministic: the same files and settings give a byte-identical tokenizer json, whatever the
number of threads (tests/test_tokenizer.py checks one and two threads and two hash seeds).
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from megacpp_lab.checks import check_int
from megacpp_lab.data.corpus import (
    MANIFEST_FILE,
    describe_source,
    list_cpp_files,
    manifest_object,
    manifest_relpath,
    read_manifest,
    repo_data_dir,
    torch_include_dir,
    update_manifest,
)
from megacpp_lab.data.tokenizer import decode_with_specials

SPECIAL_TOKENS = ("<bos>", "<eos>", "<pad>")
DEFAULT_VOCAB_SIZE = 32768
MANIFEST_KEY = "bpe_tokenizer"
# Runs of bytes that are not valid UTF-8, as `surrogateescape` decoding leaves them (U+DC80..U+DCFF).
if TYPE_CHECKING:
    import tokenizers

_BAD_BYTES = re.compile("[\udc80-\udcff]+")


def _byte_to_unicode() -> dict[int, str]:
    """GPT-2's printable stand-in for each byte: the alphabet of the ByteLevel pre-tokenizer."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


BYTE_TO_UNICODE = _byte_to_unicode()
UNICODE_TO_BYTE = {c: b for b, c in BYTE_TO_UNICODE.items()}


def bpe_file_name(vocab_size: int) -> str:
    return f"bpe-{vocab_size}.json"


def sha256_file(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _as_text(data: str | bytes) -> str:
    """bytes -> str with invalid UTF-8 kept as lone surrogates; a str must already be valid UTF-8."""
    if isinstance(data, str):
        if re.search("[\ud800-\udfff]", data):
            raise ValueError("text holds lone surrogate code points; pass the original bytes instead")
        return data
    return bytes(data).decode("utf-8", errors="surrogateescape")


def utf8_segments(data: str | bytes) -> Iterator[tuple[bool, str]]:
    """(is_text, piece) runs of a document: valid UTF-8 text, or escaped invalid bytes."""
    text = _as_text(data)
    pos = 0
    for m in _BAD_BYTES.finditer(text):
        if m.start() > pos:
            yield True, text[pos : m.start()]
        yield False, m.group()
        pos = m.end()
    if pos < len(text):
        yield True, text[pos:]


@dataclass(frozen=True)
class BpeTrainConfig:
    """How the BPE is trained: every C++ file under the corpus root, in sorted order."""

    vocab_size: int = DEFAULT_VOCAB_SIZE
    min_frequency: int = 2

    def __post_init__(self) -> None:
        floor = 256 + len(SPECIAL_TOKENS)
        for name, lo in (("vocab_size", floor), ("min_frequency", 1)):
            value = getattr(self, name)
            check_int("BpeTrainConfig", name, value)
            if value < lo:
                why = " (256 bytes + 3 special tokens)" if name == "vocab_size" else ""
                raise ValueError(f"BpeTrainConfig.{name} must be >= {lo}{why}, got {value}")


class BpeTokenizer:
    """ByteTokenizer's interface (encode/decode, vocab_size, bos/eos/pad ids) over a trained byte-level BPE."""

    def __init__(self, tokenizer: tokenizers.Tokenizer, path: Path | None = None) -> None:
        self._tok = tokenizer
        self._tok.encode_special_tokens = True  # "<bos>" written in a document is text, not a boundary
        self.path = path
        self.record: dict | None = None  # its manifest section, when loaded through load_bpe
        ids = [tokenizer.token_to_id(t) for t in SPECIAL_TOKENS]
        if ids != [0, 1, 2]:
            raise ValueError(f"tokenizer {path}: special tokens {SPECIAL_TOKENS} must have ids [0, 1, 2], got {ids}")
        self.bos_id, self.eos_id, self.pad_id = ids
        self._vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
        # id -> bytes, so decoding is exact even where the bytes are not valid UTF-8
        self._bytes: list[bytes] = [b""] * self._vocab_size
        for token, i in tokenizer.get_vocab(with_added_tokens=True).items():
            if i >= 3:
                self._bytes[i] = bytes(UNICODE_TO_BYTE[c] for c in token)
        self._byte_ids = [tokenizer.token_to_id(BYTE_TO_UNICODE[b]) for b in range(256)]
        if None in self._byte_ids:
            raise ValueError(f"tokenizer {path} lacks single-byte tokens: not a byte-level BPE")

    @classmethod
    def from_file(cls, path: str | Path, *, expected_sha256: str) -> "BpeTokenizer":
        """Load a tokenizer json, failing closed unless its sha256 is the one expected."""
        from tokenizers import Tokenizer

        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"no tokenizer file {path}: run `megacpp-lab data --train-tokenizer` to build it")
        digest = sha256_file(path)
        if digest != expected_sha256:
            raise ValueError(f"tokenizer {path} sha256 {digest} does not match the manifest's {expected_sha256}")
        return cls(Tokenizer.from_file(str(path)), path)

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def special_ids(self) -> dict[str, int]:
        return {"bos": self.bos_id, "eos": self.eos_id, "pad": self.pad_id}

    def encode(self, text: str | bytes, *, add_bos: bool = True, add_eos: bool = True) -> list[int]:
        ids = [self.bos_id] if add_bos else []
        for is_text, piece in utf8_segments(text):
            if is_text:
                ids.extend(self._tok.encode(piece, add_special_tokens=False).ids)
            else:  # invalid UTF-8: one single-byte token per byte
                ids.extend(self._byte_ids[ord(c) - 0xDC00] for c in piece)
        if add_eos:
            ids.append(self.eos_id)
        return ids

    def encode_batch(self, texts: Sequence[str | bytes], *, add_bos: bool = True, add_eos: bool = True) -> list[list[int]]:
        """`encode` of each text, the valid UTF-8 pieces of all of them through the tokenizer's batch encode (its
        Rust threads): the same ids as encoding one at a time, many times faster over thousands of files."""
        pieces = [list(utf8_segments(t)) for t in texts]
        flat = [piece for segs in pieces for is_text, piece in segs if is_text]
        encoded = iter(self._tok.encode_batch(flat, add_special_tokens=False)) if flat else iter(())
        out = []
        for segs in pieces:
            ids = [self.bos_id] if add_bos else []
            for is_text, piece in segs:
                if is_text:
                    ids.extend(next(encoded).ids)
                else:  # invalid UTF-8: one single-byte token per byte
                    ids.extend(self._byte_ids[ord(c) - 0xDC00] for c in piece)
            if add_eos:
                ids.append(self.eos_id)
            out.append(ids)
        return out

    def _check_ids(self, ids: list[int]) -> None:
        bad = next((i for i in ids if not 0 <= i < self._vocab_size), None)
        if bad is not None:
            raise ValueError(f"token id {bad} is outside the BPE tokenizer's vocab (0..{self._vocab_size - 1})")

    def decode_bytes(self, ids: Sequence[int] | torch.Tensor) -> bytes:
        """The exact bytes the ids stand for; special tokens are dropped."""
        ids = ids.tolist() if isinstance(ids, torch.Tensor) else list(ids)
        self._check_ids(ids)
        return b"".join(self._bytes[i] for i in ids)

    def decode(self, ids: Sequence[int] | torch.Tensor, *, show_special: bool = True) -> str:
        """Bytes decode as UTF-8 (invalid sequences replaced); specials print as <bos>/<eos>/<pad>."""
        ids = ids.tolist() if isinstance(ids, torch.Tensor) else list(ids)
        self._check_ids(ids)
        return decode_with_specials(ids, self._bytes.__getitem__, dict(enumerate(SPECIAL_TOKENS)), show_special)


def load_bpe(data_dir: str | Path | None = None) -> BpeTokenizer:
    """The BPE tokenizer recorded in data_dir/manifest.json (default data/), its sha256 checked."""
    d = Path(data_dir) if data_dir is not None else repo_data_dir()
    section = read_manifest(d).get(MANIFEST_KEY)
    if section is None:
        raise FileNotFoundError(
            f"{d / MANIFEST_FILE} records no BPE tokenizer ('{MANIFEST_KEY}'): run `megacpp-lab data --train-tokenizer`"
        )
    manifest_object(section, d / MANIFEST_FILE, MANIFEST_KEY, required=("file", "sha256"))
    file = manifest_relpath(section, "file", d / MANIFEST_FILE, MANIFEST_KEY)
    tok = BpeTokenizer.from_file(d / file, expected_sha256=section["sha256"])
    tok.record = section
    return tok


def _training_texts(paths: list[Path], progress: bool) -> Iterator[str]:
    iterator = paths
    if progress:
        from tqdm.auto import tqdm

        iterator = tqdm(paths, desc="reading C++ files for BPE", unit="file")
    for p in iterator:
        for is_text, piece in utf8_segments(p.read_bytes()):
            if is_text:  # invalid bytes are not learned from; they encode as single-byte tokens
                yield piece


def train_bpe(
    out_dir: str | Path | None = None,
    *,
    root: str | Path | None = None,
    config: BpeTrainConfig = BpeTrainConfig(),
    progress: bool = True,
) -> Path:
    """Train a byte-level BPE on every C++ file under root (default torch/include); write bpe-<vocab>.json.

    Records the file, its sha256 and how it was trained in out_dir/manifest.json under 'bpe_tokenizer'.
    Returns the tokenizer file's path.
    """
    from tokenizers import Tokenizer, __version__, decoders, models, pre_tokenizers, trainers

    out = Path(out_dir) if out_dir is not None else repo_data_dir()
    src_root = Path(root) if root is not None else torch_include_dir()
    paths = list_cpp_files(src_root)  # a bad root fails here, before out/ is created
    out.mkdir(parents=True, exist_ok=True)

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=config.vocab_size,
        min_frequency=config.min_frequency,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=progress,
    )
    tok.train_from_iterator(_training_texts(paths, progress), trainer=trainer, length=len(paths))
    path = out / bpe_file_name(config.vocab_size)
    tok.save(str(path), pretty=False)
    n_bytes = sum(p.stat().st_size for p in paths)
    section = {
        "file": path.name,
        "sha256": sha256_file(path),
        "kind": "byte-level BPE (HuggingFace tokenizers)",
        "vocab_size": tok.get_vocab_size(with_added_tokens=True),
        "bos": 0,
        "eos": 1,
        "pad": 2,
        "tokenizers": __version__,
        "config": asdict(config),
        "corpus": {
            **describe_source(root),
            "torch": torch.__version__,
            "files": len(paths),
            "bytes": n_bytes,
        },
    }
    update_manifest(out, **{MANIFEST_KEY: section})
    return path
