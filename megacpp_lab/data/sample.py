"""The small packed sample under data/: real torch C++ headers, packed, with a manifest.

The build is reproducible: the same corpus and config give byte-identical sample.pt and manifest.json
(no wall-clock time in either), so rebuilding the committed sample leaves the checkout clean.
"""

from __future__ import annotations

import hashlib
import json
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from megacpp_lab.data.corpus import list_cpp_files, torch_include_dir
from megacpp_lab.data.packing import PackedBatch, PackedRows, pack_documents
from megacpp_lab.data.tokenizer import ByteTokenizer

SAMPLE_FILE = "sample.pt"
MANIFEST_FILE = "manifest.json"
# A row must hold a document boundary with context on both sides: the widest local window in the lab is
# 4 tokens (Engram's n-gram order 4 and conv kernel 4), so eos + 4 tokens before it and bos + 4 after it
# take 10 tokens; 16 is the next power of two. Shorter rows pack (1-token rows are valid) but test nothing.
MIN_SEQ_LEN = 16


@dataclass(frozen=True)
class SampleConfig:
    """How the committed sample is cut: rows x seq_len tokens from every `stride`-th file."""

    rows: int = 48
    seq_len: int = 2048
    stride: int = 37
    max_file_bytes: int = 4096

    def __post_init__(self) -> None:
        floors = {"rows": 1, "seq_len": MIN_SEQ_LEN, "stride": 1, "max_file_bytes": 1}
        for name, floor in floors.items():
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"SampleConfig.{name} must be an int, got {value!r}")
            if value < floor:
                why = " (a row must hold a document boundary with 4 tokens on each side)" if name == "seq_len" else ""
                raise ValueError(f"SampleConfig.{name} must be >= {floor}{why}, got {value}")


def repo_data_dir() -> Path:
    """data/ at the repository root (beside the package)."""
    return Path(__file__).resolve().parents[2] / "data"


def build_sample(
    out_dir: str | Path | None = None,
    *,
    root: str | Path | None = None,
    config: SampleConfig = SampleConfig(),
    progress: bool = True,
) -> Path:
    """Tokenize and pack C++ files under root (default torch/include); write sample.pt and manifest.json.

    Files are taken every `stride`-th in sorted order so the sample spans the whole tree;
    files over max_file_bytes are skipped so rows hold several whole documents. When the files
    taken do not fill config.rows rows, the sample is smaller (the last row padded) and a
    UserWarning says what was produced against what was asked.
    """
    out = Path(out_dir) if out_dir is not None else repo_data_dir()
    src_root = Path(root) if root is not None else torch_include_dir()
    tok = ByteTokenizer()
    budget = config.rows * config.seq_len

    all_paths = list_cpp_files(src_root)  # a bad root fails here, before out/ is created
    out.mkdir(parents=True, exist_ok=True)
    paths = all_paths[:: config.stride]
    chosen: list[tuple[str, bytes]] = []
    n_tokens = 0
    iterator = paths
    if progress:
        from tqdm.auto import tqdm

        iterator = tqdm(paths, desc="tokenizing C++ files", unit="file")
    for p in iterator:
        if n_tokens >= budget:
            break
        data = p.read_bytes()
        if not data or len(data) > config.max_file_bytes:
            continue
        chosen.append((p.relative_to(src_root).as_posix(), data))
        n_tokens += len(data) + 2
    if not chosen:
        raise ValueError(
            f"no C++ file under {src_root} taken with stride {config.stride} is between 1 and "
            f"{config.max_file_bytes} bytes (max_file_bytes)"
        )

    docs = [torch.tensor(tok.encode(data), dtype=torch.int64) for _, data in chosen]
    packed = pack_documents(docs, config.seq_len, pad_id=tok.pad_id, max_rows=config.rows)
    b = packed.batch
    if n_tokens < budget:
        # a short sample is legitimate (a small user corpus) but must not pass for the one asked for
        warnings.warn(
            f"asked for {config.rows} rows x {config.seq_len} tokens, but the {len(chosen)} files taken (stride "
            f"{config.stride} over the {len(all_paths)} C++ files under {src_root}, files over max_file_bytes="
            f"{config.max_file_bytes} skipped) hold {n_tokens} tokens: the sample has {b.batch_size} rows, "
            f"{int((b.tokens == tok.pad_id).sum())} tokens of them padding; lower the stride or raise max_file_bytes",
            UserWarning,
            stacklevel=2,
        )
    torch.save(
        {
            "tokens": b.tokens.to(torch.int16),
            "doc_ids": b.doc_ids.to(torch.int16),
            "segments": packed.segments,
        },
        out / SAMPLE_FILE,
    )

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
                "tokens": len(data) + 2,
                "tokens_in_sample": in_sample,
                "segments": int((seg[:, 3] == i).sum()),
            }
        )
    import triton

    manifest = {
        "source_root": "torch/include" if root is None else str(src_root),
        "source": "torch/include of the installed torch" if root is None else "user directory",
        "torch": torch.__version__,
        "triton": triton.__version__,
        "tokenizer": {"kind": "byte", "vocab_size": tok.vocab_size, **tok.special_ids},
        "config": asdict(config),
        "shape": {"rows": b.batch_size, "seq_len": b.seq_len},
        "tokens": b.batch_size * b.seq_len,
        "pad_tokens": int((b.tokens == tok.pad_id).sum()),
        "documents": len(files),
        "segments": int(seg.shape[0]),
        "sample_sha256": hashlib.sha256((out / SAMPLE_FILE).read_bytes()).hexdigest(),
        "files": files,
    }
    (out / MANIFEST_FILE).write_text(json.dumps(manifest, indent=1) + "\n")
    return out


def load_sample(data_dir: str | Path | None = None) -> tuple[PackedRows, dict]:
    """Load data/sample.pt as validated PackedRows, with its manifest (sha256 checked)."""
    d = Path(data_dir) if data_dir is not None else repo_data_dir()
    path, manifest_path = d / SAMPLE_FILE, d / MANIFEST_FILE
    if not path.exists() or not manifest_path.exists():
        raise FileNotFoundError(f"no packed sample in {d}: run `megacpp-lab data` to build it")
    manifest = json.loads(manifest_path.read_text())
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    if digest != manifest["sample_sha256"]:
        raise ValueError(f"{path} sha256 {digest} does not match the manifest's {manifest['sample_sha256']}")
    blob = torch.load(path, weights_only=True)
    batch = PackedBatch.from_doc_ids(blob["tokens"].to(torch.int64), blob["doc_ids"].to(torch.int64))
    return PackedRows(batch=batch, segments=blob["segments"]), manifest
