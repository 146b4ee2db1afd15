"""The small packed sample under data/: real torch C++ headers, packed, with a manifest.

The build is reproducible: the same corpus and config give byte-identical sample.pt and manifest.json
(no wall-clock time in either), so rebuilding the committed sample leaves the checkout clean.
"""

from __future__ import annotations

import hashlib
import shutil
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from megacpp_lab.checks import check_int
from megacpp_lab.data.bpe import MANIFEST_KEY as BPE_TOKENIZER_KEY
from megacpp_lab.data.bpe import BpeTokenizer, sha256_file
from megacpp_lab.data.corpus import (
    MANIFEST_FILE,
    corpus_base,
    describe_source,
    list_cpp_files,
    manifest_object,
    manifest_relpath,
    read_manifest,
    repo_data_dir,
    torch_include_dir,
    update_manifest,
)
from megacpp_lab.data.packing import PackedBatch, PackedRows, pack_documents
from megacpp_lab.data.tokenizer import ByteTokenizer

SAMPLE_FILE = "sample.pt"
BPE_SAMPLE_FILE = "sample_bpe.pt"
BPE_SAMPLE_KEY = "bpe_sample"
TOKENIZER_KINDS = ("byte", "bpe")
# A row must hold a document boundary with context on both sides: the widest local window in the lab is
# 4 tokens (Engram's n-gram order 4 and conv kernel 4), so eos + 4 tokens before it and bos + 4 after it
# take 10 tokens; 16 is the next power of two. Shorter rows pack (1-token rows are valid) but test nothing.
MIN_SEQ_LEN = 16


@dataclass(frozen=True)
class SampleConfig:
    """How the committed sample is cut: rows x seq_len tokens from every `stride`-th file (in build_sample's order)."""

    rows: int = 48
    seq_len: int = 2048
    stride: int = 37
    max_file_bytes: int = 4096

    def __post_init__(self) -> None:
        floors = {"rows": 1, "seq_len": MIN_SEQ_LEN, "stride": 1, "max_file_bytes": 1}
        for name, floor in floors.items():
            value = getattr(self, name)
            check_int("SampleConfig", name, value)
            if value < floor:
                why = " (a row must hold a document boundary with 4 tokens on each side)" if name == "seq_len" else ""
                raise ValueError(f"SampleConfig.{name} must be >= {floor}{why}, got {value}")


# The BPE sample's default: its rows hold ~3.4x the bytes of a byte row, so it takes files up to 8 KiB (about
# 2400 BPE tokens) to fill 48 x 2048 from every 37th file; its files include all of the byte sample's.
BPE_SAMPLE_CONFIG = SampleConfig(max_file_bytes=8192)


def _sample_file(tok: ByteTokenizer | BpeTokenizer) -> str:
    return BPE_SAMPLE_FILE if isinstance(tok, BpeTokenizer) else SAMPLE_FILE


def _tokenizer_record(tok: ByteTokenizer | BpeTokenizer) -> dict:
    """What the manifest says about the tokenizer a sample was built with."""
    if isinstance(tok, ByteTokenizer):
        return {"kind": "byte", "vocab_size": tok.vocab_size, **tok.special_ids}
    return {"kind": "bpe", "file": tok.record["file"], "sha256": tok.record["sha256"], "vocab_size": tok.vocab_size,
            **tok.special_ids}  # fmt: skip


def _place_tokenizer(tok: BpeTokenizer, out: Path) -> None:
    """Put the BPE file and its manifest section in out/, so the sample there names a file that is there."""
    if tok.record is None or tok.path is None:
        raise ValueError("a BPE sample needs a tokenizer loaded with load_bpe (its manifest record pins its sha256)")
    target = out / tok.record["file"]
    if not target.exists() or sha256_file(target) != tok.record["sha256"]:
        shutil.copyfile(tok.path, target)
    if read_manifest(out).get(BPE_TOKENIZER_KEY) != tok.record:
        update_manifest(out, **{BPE_TOKENIZER_KEY: tok.record})


def build_sample(
    out_dir: str | Path | None = None,
    *,
    root: str | Path | None = None,
    config: SampleConfig | None = None,
    tokenizer: ByteTokenizer | BpeTokenizer | None = None,
    progress: bool = True,
) -> Path:
    """Tokenize and pack C++ files under root (default torch/include); write the sample and its manifest.

    The byte tokenizer (default) writes sample.pt and the manifest's top-level fields; a BpeTokenizer
    (from load_bpe) writes sample_bpe.pt, the manifest's 'bpe_sample' section, and copies the tokenizer
    file beside it. config defaults to SampleConfig() for bytes, BPE_SAMPLE_CONFIG for BPE. Both take files: every
    `stride`-th in an order fixed by a hash of each relative path (so the files taken before the rows fill span the
    whole tree, every library of a corpus, not its first directories), skipping files over max_file_bytes so rows
    hold several whole documents; the BPE sample
    takes more of them, as its rows hold more bytes. When the files taken do not fill config.rows rows,
    the sample is smaller (the last row padded) and a UserWarning says what was produced against what
    was asked.
    """
    out = Path(out_dir) if out_dir is not None else repo_data_dir()
    src_root = Path(root) if root is not None else torch_include_dir()
    tok = tokenizer if tokenizer is not None else ByteTokenizer()
    is_bpe = isinstance(tok, BpeTokenizer)
    if config is None:
        config = BPE_SAMPLE_CONFIG if is_bpe else SampleConfig()
    budget = config.rows * config.seq_len

    all_paths = list_cpp_files(src_root)  # a bad root fails here, before out/ is created
    out.mkdir(parents=True, exist_ok=True)
    if is_bpe:
        _place_tokenizer(tok, out)
    base = corpus_base(src_root)
    # salted: the unsalted hash of a path is what splits files into validation (loader.split_by_file, the corpus's
    # splits), and the sample's first files by it would all be validation files of any split of the sample
    order = sorted(all_paths, key=lambda p: hashlib.sha256(b"sample order\0" + p.relative_to(base).as_posix().encode()).digest())
    paths = order[:: config.stride]
    chosen: list[tuple[str, bytes]] = []
    docs: list[list[int]] = []
    n_tokens = 0
    iterator = paths
    if progress:
        from tqdm.auto import tqdm

        iterator = tqdm(paths, desc=f"tokenizing C++ files ({'bpe' if is_bpe else 'byte'})", unit="file")
    for p in iterator:
        if n_tokens >= budget:
            break
        data = p.read_bytes()
        if not data or len(data) > config.max_file_bytes:
            continue
        chosen.append((p.relative_to(corpus_base(src_root)).as_posix(), data))
        docs.append(tok.encode(data))
        n_tokens += len(docs[-1])
    if not chosen:
        raise ValueError(
            f"no C++ file under {src_root} taken with stride {config.stride} is between 1 and "
            f"{config.max_file_bytes} bytes (max_file_bytes)"
        )

    packed = pack_documents(
        [torch.tensor(d, dtype=torch.int64) for d in docs], config.seq_len, pad_id=tok.pad_id, max_rows=config.rows
    )
    b = packed.batch
    what = "BPE sample" if is_bpe else "sample"
    if n_tokens < budget:
        # a short sample is legitimate (a small user corpus) but must not pass for the one asked for
        warnings.warn(
            f"asked for {config.rows} rows x {config.seq_len} tokens, but the {len(chosen)} files taken (stride "
            f"{config.stride} over the {len(all_paths)} C++ files under {src_root}, files over max_file_bytes="
            f"{config.max_file_bytes} skipped) hold {n_tokens} tokens: the {what} has {b.batch_size} rows, "
            f"{int((b.tokens == tok.pad_id).sum())} tokens of them padding; lower the stride or raise max_file_bytes",
            UserWarning,
            stacklevel=2,
        )
    # int16 holds every id of a vocab up to 32768 (ids 0..32767) and halves the committed file
    dtype = torch.int16 if tok.vocab_size <= 2**15 else torch.int32
    sample_path = out / _sample_file(tok)
    torch.save({"tokens": b.tokens.to(dtype), "doc_ids": b.doc_ids.to(torch.int16), "segments": packed.segments},
               sample_path)  # fmt: skip

    seg = packed.segments
    files = []
    for i, (rel, data) in enumerate(chosen):
        in_sample = int(seg[seg[:, 3] == i, 2].sum())
        if in_sample == 0:
            continue
        files.append(
            {
                "path": rel,
                "sha256": hashlib.sha256(data).hexdigest(),
                "bytes": len(data),
                "tokens": len(docs[i]),
                "tokens_in_sample": in_sample,
                "segments": int((seg[:, 3] == i).sum()),
            }
        )
    import triton

    fields = {
        **describe_source(root),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "tokenizer": _tokenizer_record(tok),
        "config": asdict(config),
        "shape": {"rows": b.batch_size, "seq_len": b.seq_len},
        "tokens": b.batch_size * b.seq_len,
        "pad_tokens": int((b.tokens == tok.pad_id).sum()),
        "documents": len(files),
        "segments": int(seg.shape[0]),
        "sample_sha256": sha256_file(sample_path),
    }
    if is_bpe:
        # tokens per source byte over the whole files listed, bos/eos not counted (the byte tokenizer's is 1)
        n_doc_tokens = sum(f["tokens"] - 2 for f in files)
        fields["tokens_per_byte"] = round(n_doc_tokens / sum(f["bytes"] for f in files), 4)
    fields["files"] = files
    if is_bpe:
        update_manifest(out, **{BPE_SAMPLE_KEY: fields})
    else:
        update_manifest(out, byte_fields=fields)
    return out


def load_sample(data_dir: str | Path | None = None, *, tokenizer: str = "byte") -> tuple[PackedRows, dict]:
    """Load the packed sample as validated PackedRows, with its manifest fields (sha256 checked).

    tokenizer="byte" loads sample.pt and returns the whole manifest; tokenizer="bpe" loads sample_bpe.pt
    and returns the manifest's 'bpe_sample' section, after checking it was built with the tokenizer the
    manifest records (load_bpe gives that tokenizer).
    """
    if tokenizer not in TOKENIZER_KINDS:
        raise ValueError(f"tokenizer must be one of {TOKENIZER_KINDS}, got {tokenizer!r}")
    d = Path(data_dir) if data_dir is not None else repo_data_dir()
    manifest = read_manifest(d)
    fields = manifest if tokenizer == "byte" else manifest.get(BPE_SAMPLE_KEY)
    path = d / (SAMPLE_FILE if tokenizer == "byte" else BPE_SAMPLE_FILE)
    if not path.exists() or not fields:
        flag = "" if tokenizer == "byte" else " --tokenizer bpe"
        raise FileNotFoundError(f"no packed {tokenizer} sample in {d}: run `megacpp-lab data{flag}` to build it")
    manifest_path = d / MANIFEST_FILE
    manifest_object(fields, manifest_path, "" if tokenizer == "byte" else BPE_SAMPLE_KEY,
                    required=("sample_sha256",) if tokenizer == "byte" else ("sample_sha256", "tokenizer"))  # fmt: skip
    digest = sha256_file(path)
    if digest != fields["sample_sha256"]:
        raise ValueError(f"{path} sha256 {digest} does not match the manifest's {fields['sample_sha256']}")
    if tokenizer == "bpe":
        built_with = manifest_object(fields["tokenizer"], manifest_path, f"{BPE_SAMPLE_KEY}.tokenizer",
                                     required=("sha256",))["sha256"]  # fmt: skip
        recorded = manifest_object(manifest.get(BPE_TOKENIZER_KEY, {}), manifest_path, BPE_TOKENIZER_KEY).get("sha256")
        if built_with != recorded:
            raise ValueError(
                f"{path} was built with tokenizer sha256 {built_with}, but {d / MANIFEST_FILE} records tokenizer "
                f"sha256 {recorded}: rebuild it with `megacpp-lab data --tokenizer bpe`"
            )
    blob = torch.load(path, weights_only=True)
    missing = [k for k in ("tokens", "doc_ids", "segments") if not isinstance(blob, dict) or k not in blob]
    if missing:
        raise ValueError(f"{path} holds no {missing[0]!r}: not a packed sample; rebuild it with `megacpp-lab data`")
    batch = PackedBatch.from_doc_ids(blob["tokens"].to(torch.int64), blob["doc_ids"].to(torch.int64))
    return PackedRows(batch=batch, segments=blob["segments"]), fields


def write_sample_corpus(out_dir: str | Path, data_dir: str | Path | None = None) -> Path:
    """Write the committed byte sample's source documents back as C++ files under out_dir (their relative
    paths from the manifest), and return out_dir: a small real corpus pinned by the manifest's sha256, the
    same on every machine, where the installed torch's headers differ between torch versions."""
    rows, manifest = load_sample(data_dir, tokenizer="byte")
    manifest_path = (Path(data_dir) if data_dir is not None else repo_data_dir()) / MANIFEST_FILE
    files = manifest_object(manifest, manifest_path, required=("files",))["files"]
    if not isinstance(files, list):
        raise ValueError(f"manifest {manifest_path}: 'files' must be a JSON list")
    tokens = rows.batch.tokens
    parts: dict[int, list[tuple[int, bytes]]] = {}
    for row, start, length, source, offset in rows.segments.tolist():
        if source < 0:
            continue
        ids = tokens[row, start : start + length].tolist()
        parts.setdefault(source, []).append((offset, bytes(t for t in ids if t < ByteTokenizer.bos_id)))  # no specials
    out = Path(out_dir)
    for source, pieces in sorted(parts.items()):
        if not 0 <= source < len(files):
            raise ValueError(f"segment source {source} is not a file of the manifest ({len(files)} files)")
        where = f"files[{source}]"
        rec = manifest_object(files[source], manifest_path, where, required=("path",))
        path = out / manifest_relpath(rec, "path", manifest_path, where)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"".join(piece for _, piece in sorted(pieces)))
    return out
