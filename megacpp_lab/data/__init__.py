"""Packed rows of real C++: corpus, tokenizers (bytes; a BPE trained on the corpus), packing, committed samples,
and the training loader (a held-out split by file, shuffled packed batches)."""

from megacpp_lab.data.bpe import BpeTokenizer, BpeTrainConfig, load_bpe, train_bpe
from megacpp_lab.data.corpus import SourceFile, list_cpp_files, load_corpus, torch_include_dir
from megacpp_lab.data.loader import PackedRowStream, split_by_file, tokenize_files
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
    "PackedRowStream",
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
    "split_by_file",
    "torch_include_dir",
    "tokenize_files",
    "train_bpe",
    "validate_packed",
]
