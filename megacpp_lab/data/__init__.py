"""Packed rows of real C++: corpus, tokenizers (bytes; a BPE trained on the corpus), packing, committed samples."""

from megacpp_lab.data.bpe import BpeTokenizer, BpeTrainConfig, load_bpe, train_bpe
from megacpp_lab.data.corpus import SourceFile, list_cpp_files, load_corpus, torch_include_dir
from megacpp_lab.data.packing import (
    PackedBatch,
    PackedRows,
    boundary_windows,
    cu_seqlens_from_doc_ids,
    doc_starts,
    next_token_targets,
    pack_documents,
    positions_from_doc_ids,
    validate_packed,
)
from megacpp_lab.data.sample import SampleConfig, build_sample, load_sample
from megacpp_lab.data.tokenizer import ByteTokenizer

__all__ = [
    "BpeTokenizer",
    "BpeTrainConfig",
    "ByteTokenizer",
    "PackedBatch",
    "PackedRows",
    "SampleConfig",
    "SourceFile",
    "boundary_windows",
    "build_sample",
    "cu_seqlens_from_doc_ids",
    "doc_starts",
    "list_cpp_files",
    "load_bpe",
    "load_corpus",
    "load_sample",
    "next_token_targets",
    "pack_documents",
    "positions_from_doc_ids",
    "torch_include_dir",
    "train_bpe",
    "validate_packed",
]
