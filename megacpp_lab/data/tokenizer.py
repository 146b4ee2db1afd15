"""Byte-level tokenizer with special tokens: needs no download and never fails to encode.

Ids 0..255 are raw bytes, then BOS, EOS and PAD. Every C++ source round-trips exactly.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch


def decode_with_specials(ids: list[int], piece: Callable[[int], bytes], specials: dict[int, str],
                         show_special: bool) -> str:  # fmt: skip
    """Text of checked ids: the bytes of each run of ordinary ids decode together as UTF-8 (invalid sequences
    replaced, so a character split over tokens survives); a special id ends the run and prints its name."""
    out: list[str] = []
    run = bytearray()
    for i in ids:
        if i not in specials:
            run += piece(i)
            continue
        out.append(run.decode("utf-8", errors="replace"))
        run.clear()
        if show_special:
            out.append(specials[i])
    out.append(run.decode("utf-8", errors="replace"))
    return "".join(out)


@dataclass(frozen=True)
class ByteTokenizer:
    """Raw UTF-8 bytes plus three special ids appended after the byte range."""

    bos_id: int = 256
    eos_id: int = 257
    pad_id: int = 258

    @property
    def vocab_size(self) -> int:
        return 259

    @property
    def special_ids(self) -> dict[str, int]:
        return {"bos": self.bos_id, "eos": self.eos_id, "pad": self.pad_id}

    def encode(self, text: str | bytes, *, add_bos: bool = True, add_eos: bool = True) -> list[int]:
        data = text.encode("utf-8") if isinstance(text, str) else bytes(text)
        ids = list(data)
        if add_bos:
            ids.insert(0, self.bos_id)
        if add_eos:
            ids.append(self.eos_id)
        return ids

    def decode(self, ids: list[int] | torch.Tensor, *, show_special: bool = True) -> str:
        """Bytes decode as UTF-8 (invalid sequences replaced); specials print as <bos>/<eos>/<pad>."""
        ids = ids.tolist() if isinstance(ids, torch.Tensor) else list(ids)
        bad = next((i for i in ids if not 0 <= i < self.vocab_size), None)
        if bad is not None:
            raise ValueError(f"token id {bad} is outside the byte tokenizer's vocab (0..{self.vocab_size - 1})")
        names = {self.bos_id: "<bos>", self.eos_id: "<eos>", self.pad_id: "<pad>"}
        return decode_with_specials(ids, lambda i: bytes((i,)), names, show_special)
