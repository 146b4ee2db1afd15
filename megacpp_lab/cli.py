"""Build the packed C++ sample, benchmark each subsystem into receipts, and run the notebooks headless.

Full-size benchmarks need a CUDA GPU and write receipts under profiles/; every command also runs on a
CPU at small size (`bench <subsystem> --small`, `tour --size small`). `megacpp-lab <command> --help`
says what each command does, and `megacpp-lab bench <subsystem> --help` what each benchmark measures.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import textwrap
import traceback
import warnings
from pathlib import Path
from typing import Any

from megacpp_lab.bench import COMMANDS, SMALL_OUT, BenchSetupError

PROG = "megacpp-lab"
# Bad input from the user: a bad flag value or environment variable (ValueError), a path that is not
# there (OSError), a benchmark this machine cannot run (BenchSetupError). One line, exit status 2.
USAGE_ERRORS: tuple[type[BaseException], ...] = (ValueError, OSError, BenchSetupError)


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Descriptions as written; every flag's default in its help, unless the help states it itself."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None or "default" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


def _one_line(text: str) -> str:
    return " ".join(str(text).split())


def _paragraphs(*paragraphs: str) -> str:
    """A description kept as written by the raw formatter: each paragraph filled to 100 columns."""
    return "\n\n".join(textwrap.fill(_one_line(p), width=100) for p in paragraphs)


def _show_warning(message: Warning | str, category: type[Warning], filename: str, lineno: int,
                  file: Any = None, line: str | None = None) -> None:  # fmt: skip
    print(f"{PROG}: warning: {_one_line(str(message))}", file=sys.stderr)


def _cmd_data(args: argparse.Namespace) -> int:
    from megacpp_lab.data.bpe import BpeTrainConfig, load_bpe, train_bpe
    from megacpp_lab.data.corpus import CORPUS_MANIFEST, repo_data_dir
    from megacpp_lab.data.sample import BPE_SAMPLE_CONFIG, SampleConfig, build_sample, load_sample

    def config_for(kind: str) -> SampleConfig:
        default = BPE_SAMPLE_CONFIG if kind == "bpe" else SampleConfig()
        max_file_bytes = default.max_file_bytes if args.max_file_bytes is None else args.max_file_bytes
        return SampleConfig(rows=args.rows, seq_len=args.seq_len, stride=args.stride, max_file_bytes=max_file_bytes)

    if args.train_tokenizer and args.tokenizer == "byte":
        raise ValueError("--train-tokenizer trains the BPE: it needs --tokenizer bpe or all, got --tokenizer byte")
    if args.vocab_size is not None and not args.train_tokenizer:  # read only when training: else silently unused
        raise ValueError(f"--vocab-size {args.vocab_size} sizes a BPE being trained: it needs --train-tokenizer")
    kinds = ("byte", "bpe") if args.tokenizer == "all" else (args.tokenizer,)
    # one build, one warning line: a short corpus leaves both samples short, and each says so
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for kind in kinds:
            tok = None
            if kind == "bpe":
                if args.train_tokenizer:
                    bpe_config = BpeTrainConfig(vocab_size=DEFAULT_VOCAB_SIZE if args.vocab_size is None else args.vocab_size)
                    path = train_bpe(args.out, root=args.root, config=bpe_config, progress=not args.quiet)
                    print(f"trained {path} (vocab {bpe_config.vocab_size})")
                tok = load_bpe(args.out if args.train_tokenizer else None)
            config = config_for(kind)
            out = build_sample(args.out, root=args.root, config=config, tokenizer=tok, progress=not args.quiet)
            rows, fields = load_sample(out, tokenizer=kind)
            n_rows = fields["shape"]["rows"]
            asked = "" if n_rows == config.rows else f" (of {config.rows} asked)"
            name = "sample.pt" if kind == "byte" else "sample_bpe.pt"
            per_byte = f", {fields['tokens_per_byte']} tokens per byte" if kind == "bpe" else ""
            print(
                f"wrote {out}/{name} and manifest.json: {n_rows} rows{asked} x "
                f"{fields['shape']['seq_len']} tokens, {fields['documents']} files, "
                f"{fields['segments']} segments, {fields['pad_tokens']} pad tokens{per_byte}"
            )
    if args.root is not None and (Path(args.root) / CORPUS_MANIFEST).exists():  # a built corpus: its numbers too
        from megacpp_lab.data.corpus import write_corpus_summary

        tok = load_bpe(args.out) if "bpe" in kinds else None
        print(f"wrote {write_corpus_summary(args.root, args.out or repo_data_dir(), tok)}")
    if caught:
        warnings.warn("; ".join(str(w.message) for w in caught), caught[0].category, stacklevel=1)
    return 0


def _cmd_corpus(args: argparse.Namespace) -> int:
    from megacpp_lab.data.corpus import CorpusConfig, archive_corpus, build_corpus, restore_corpus

    given = [flag for flag, value in (("--out", args.out), ("--root", args.root), ("--quiet", args.quiet),
                                      ("--train-tokenizer", args.train_tokenizer)) if value]  # fmt: skip
    if given:
        raise ValueError(f"{', '.join(given)} before `corpus` are `data`'s (the sample's) flags; give the corpus's "
                         "own after it: `megacpp-lab data corpus --out DIR --quiet`")  # fmt: skip
    if args.from_archive is not None:
        path = restore_corpus(args.from_archive, args.corpus_out)
        print(f"restored {path} from {args.from_archive}")
        return 0
    packages = None if args.packages is None else tuple(n.strip() for n in args.packages.split(",") if n.strip())
    config = CorpusConfig(packages=packages, include_torch=not args.no_torch, near_threshold=args.near_threshold)
    path = build_corpus(args.corpus_out, config, mirror=args.mirror, use_apt=not args.no_apt, progress=not args.corpus_quiet)
    summary = json.loads(path.read_text())["summary"]
    splits = ", ".join(f"{k} {v['files']} files" for k, v in summary["splits"].items())
    print(f"wrote {path}: {splits}")
    if args.archive is not None:
        print(f"wrote {archive_corpus(path.parent, args.archive)}")
    return 0


def _cmd_info(args: argparse.Namespace) -> int:
    from megacpp_lab.receipts import device_slug, stamp
    from megacpp_lab.sizing import lab_scale

    info = stamp()
    info["device_slug"] = device_slug(info["device"])
    info["scale"] = lab_scale()
    print(json.dumps(info, indent=1))
    return 0


def _cmd_tour(args: argparse.Namespace) -> int:
    """Execute every notebook headless at small size and write HTML."""
    if args.timeout < 1:
        raise ValueError(f"--timeout must be >= 1 second, got {args.timeout}")
    notebooks = sorted(Path(args.notebooks).glob("*.ipynb"))
    if not notebooks:
        raise FileNotFoundError(f"no notebooks (*.ipynb) under {args.notebooks}")
    import nbformat
    from nbconvert import HTMLExporter
    from nbconvert.preprocessors import ExecutePreprocessor
    from tqdm.auto import tqdm

    from megacpp_lab.sizing import SIZE_ENV

    os.environ[SIZE_ENV] = args.size
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for nb_path in tqdm(notebooks, desc="executing notebooks", unit="nb"):
        nb = nbformat.read(nb_path, as_version=4)
        ExecutePreprocessor(timeout=args.timeout, kernel_name="python3").preprocess(
            nb, {"metadata": {"path": str(nb_path.parent)}}
        )
        html, _ = HTMLExporter().from_notebook_node(nb)
        (out / f"{nb_path.stem}.html").write_text(html)
    print(f"wrote {len(notebooks)} HTML pages under {out}/")
    return 0


def _cmd_bench(args: argparse.Namespace) -> int:
    # run_bench sets up the Triton interpreter (no GPU) before it imports any kernel
    from megacpp_lab.bench import run_bench

    for path in run_bench(args.subsystem, args.out, small=args.small, trace=not args.no_trace):
        print(path)
    return 0


def _cmd_train(args: argparse.Namespace) -> int:
    from megacpp_lab.model.train import train
    from megacpp_lab.model.train_config import TrainConfig, train_options

    if args.nproc is not None:
        if args.nproc < 1:
            raise ValueError(f"--nproc must be >= 1, got {args.nproc}")
        world = os.environ.get("WORLD_SIZE")
        if world is not None and int(world) != args.nproc:
            raise ValueError(f"--nproc {args.nproc} under a launcher that started WORLD_SIZE={world} processes")
        if world is None and args.nproc > 1:
            return _launch_ranks(args.nproc, args.argv)
    flags = {o.name: getattr(args, o.name) for o in train_options()}
    config = TrainConfig.build(args.config, **flags)
    result = train(config, progress=not args.quiet, resume=not args.no_resume, stop_after=args.stop_after)
    last = {key: next((r[key] for r in reversed(result.history) if key in r), float("nan"))
            for key in ("train_loss", "val_loss")}  # fmt: skip
    # under torchrun rank 0 alone reports. RANK counts only beside WORLD_SIZE > 1, as init_ranks reads them: a
    # RANK left in a single process's environment (a cluster shell, a job script) must not silence its summary
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and os.environ.get("RANK", "0") != "0":
        return 0
    logged = "" if last["train_loss"] != last["train_loss"] else (  # nan: no row logged before the stop
        f": train loss {last['train_loss']:.4f}, val loss {last['val_loss']:.4f}, {result.tokens_per_s:,.0f} tokens/s")
    print(f"trained to step {result.step}{logged}; wrote {result.out_dir}/")
    return 0


def _launch_ranks(nproc: int, argv: list[str]) -> int:
    """`train --nproc N`: the same command under torchrun, N processes on this host. torchrun stops every
    rank when one fails (no restarts), so a dead rank ends the job instead of leaving the others waiting."""
    rest, skip = [], False
    for a in argv:  # the command without --nproc: under torchrun each rank reads WORLD_SIZE instead
        if skip:
            skip = False
        elif a == "--nproc":
            skip = True
        elif not a.startswith("--nproc="):
            rest.append(a)
    # a static rendezvous on loopback: --standalone's c10d rendezvous looks the host's name up, which can
    # stall for minutes on a machine without DNS
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=1", "--node-rank=0", "--master-addr=127.0.0.1",
           f"--master-port={port}", f"--nproc-per-node={nproc}", "--max-restarts=0", "--monitor-interval=1",
           "-m", "megacpp_lab.cli", *rest]  # fmt: skip
    code = subprocess.run(cmd).returncode
    if code:
        print(f"{PROG}: error: training failed on {nproc} processes (torchrun exit code {code}): the failing rank "
              "and its exit code are in torchrun's summary above, its traceback above that; the other ranks were "
              "stopped. The last complete checkpoint is intact: the same command resumes from it.", file=sys.stderr)
    return code


def _cmd_sample(args: argparse.Namespace) -> int:
    from megacpp_lab.model.decode import sample_text

    if args.max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    if not 0 <= args.seed < 2**64:  # torch would take -1 as 2**64 - 1: two seeds, the same samples
        raise ValueError(f"--seed must be >= 0 and < 2**64, got {args.seed}")
    prompt: str | bytes = args.prompt
    if args.prompt_file is not None:
        path = Path(args.prompt_file)
        if not path.is_file():
            raise FileNotFoundError(f"--prompt-file {path} is not a file")
        prompt = path.read_bytes()  # as bytes: the tokenizer encodes invalid UTF-8 as byte tokens
        if not prompt:
            raise ValueError(f"--prompt-file {path} is empty: a sample starts from a prompt")
    elif not prompt:
        raise ValueError("--prompt must not be empty: a sample starts from a prompt")
    text = sample_text(args.checkpoint, prompt, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                       top_k=args.top_k, seed=args.seed, device=args.device, num_samples=args.num_samples)
    for i, piece in enumerate(text):
        if len(text) > 1:
            print(f"--- sample {i}")
        print(piece)
    return 0


def _cmd_profile(args: argparse.Namespace) -> int:
    import torch

    from megacpp_lab.bench import use_triton_interpreter

    if args.small and args.compiled and not torch.cuda.is_available():
        use_triton_interpreter()  # the compiled scans' Triton kernels, before any kernel module is imported
    from megacpp_lab.bench.profile import profile_training

    paths = profile_training(preset=args.preset, batch=args.batch, seq_len=args.seq_len, docs=args.docs,
                             wait=args.wait, warmup=args.warmup, active=args.active, compiled=args.compiled,
                             optimizer=not args.no_optimizer, out=args.out, small=args.small,
                             inductor_caches=args.inductor_caches, progress=not args.quiet)  # fmt: skip
    for path in paths.values():
        print(path)
    return 0


def _cmd_memory_sweep(args: argparse.Namespace) -> int:
    import torch

    from megacpp_lab.bench import use_triton_interpreter

    if args.small and not torch.cuda.is_available():
        use_triton_interpreter()  # the compiled scans' Triton kernels, before any kernel module is imported
    from megacpp_lab.bench.memory import run

    for path in run(args.out, small=args.small, progress=not args.quiet):
        print(path)
    return 0


def _cmd_resources(args: argparse.Namespace) -> int:
    from megacpp_lab.bench.resources import report, resources_table
    from megacpp_lab.receipts import stamp

    result = report(tuple(args.subjects) if args.subjects else None)
    print(resources_table(result))
    if args.json:
        path = Path(args.json)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({**stamp(), **result}, indent=1) + "\n")
        print(f"wrote {path}")
    return 0


def _cmd_receipts(args: argparse.Namespace) -> int:
    from megacpp_lab.bench.receipt_ages import receipts_table

    print(receipts_table(subsystem=args.subsystem, device=args.device))
    return 0


def _cmd_tripwires(args: argparse.Namespace) -> int:
    from dataclasses import asdict

    from megacpp_lab.receipts import stamp
    from megacpp_lab.tripwires import run_packs

    results = run_packs(args.pack)
    for r in results:
        print("\n".join(r.lines()))
    deviations = [line for r in results for line in r.deviations()]
    if args.json:
        out = {**stamp(), "packs": [{**asdict(r), "as_expected": r.as_expected} for r in results]}
        path = Path(args.json)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(out, indent=1) + "\n")
        print(f"wrote {path}")
    for line in deviations:
        print(f"{PROG}: tripwire: {line}", file=sys.stderr)
    return 1 if deviations else 0


def build_parser() -> argparse.ArgumentParser:
    """The parser; building it imports no kernel (TRITON_INTERPRET is still free to be set)."""
    from megacpp_lab.data.bpe import DEFAULT_VOCAB_SIZE
    from megacpp_lab.data.sample import BPE_SAMPLE_CONFIG, MIN_SEQ_LEN, SampleConfig

    debug = argparse.ArgumentParser(add_help=False)
    debug.add_argument(
        "--debug", action="store_true", default=argparse.SUPPRESS,
        help="on an error, show the traceback (default: off; also accepted before the command)",
    )  # fmt: skip
    common: dict[str, Any] = {"formatter_class": _HelpFormatter, "parents": [debug]}

    parser = argparse.ArgumentParser(
        prog=PROG,
        description=__doc__,
        epilog="Errors print one line and exit with status 2; --debug shows the traceback.",
        formatter_class=_HelpFormatter,
    )
    parser.add_argument("--debug", action="store_true", help="on an error, show the traceback (default: off)")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    defaults = SampleConfig()
    p = sub.add_parser(
        "data",
        help="build the packed C++ sample and its manifest",
        description=_paragraphs(
            "Tokenize real C++ files, pack them into rows of documents back to back, and write sample.pt (bytes), "
            "sample_bpe.pt (the byte-level BPE recorded in the manifest, copied beside it) and manifest.json.",
            "The build is reproducible: the same files and flags give byte-identical output, so rebuilding the "
            "committed data/ changes nothing. When the files taken cannot fill the rows asked for, the sample is "
            "smaller and a warning says so.",
        ),
        **common,
    )
    p.add_argument("--out", default=None, help="output directory (default: data/ at the repository root)")
    p.add_argument("--root", default=None,
                   help="directory of C++ sources (default: torch/include of the installed torch)")  # fmt: skip
    p.add_argument("--rows", type=int, default=defaults.rows, help="rows to pack")
    p.add_argument("--seq-len", type=int, default=defaults.seq_len,
                   help=f"tokens per row, at least {MIN_SEQ_LEN} (a row must hold a document boundary with 4 tokens "
                   "on each side)")  # fmt: skip
    p.add_argument("--stride", type=int, default=defaults.stride,
                   help="take every n-th file in an order fixed by a hash of each path")  # fmt: skip
    p.add_argument("--max-file-bytes", type=int, default=None,
                   help=f"skip files larger than this (default: {defaults.max_file_bytes} for sample.pt, "
                   f"{BPE_SAMPLE_CONFIG.max_file_bytes} for sample_bpe.pt, whose rows hold ~3.4x more bytes)")  # fmt: skip
    p.add_argument("--tokenizer", choices=("byte", "bpe", "all"), default="all",
                   help="which samples to build: sample.pt (bytes), sample_bpe.pt (BPE), or both")  # fmt: skip
    p.add_argument("--train-tokenizer", action="store_true",
                   help="train the BPE on --root into --out first (about 15 s on torch/include with 2 cores) "
                   "instead of using the committed data/bpe-32768.json (default: off)")  # fmt: skip
    p.add_argument("--vocab-size", type=int, default=None,
                   help=f"BPE vocab with --train-tokenizer (default {DEFAULT_VOCAB_SIZE})")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=_cmd_data)
    data_sub = p.add_subparsers(dest="data_command", metavar="{corpus}",
                                help="corpus: build the Debian C++ corpus instead of the sample")  # fmt: skip
    from megacpp_lab.data.corpus import CorpusConfig
    from megacpp_lab.data.debian import DEBIAN_MIRROR, PINNED

    corpus_defaults = CorpusConfig()
    c = data_sub.add_parser(
        "corpus",
        help="fetch the pinned Debian C++ packages and build the deduplicated, split training corpus",
        description=_paragraphs(
            "Fetch the pinned .deb files (data/debian.py: Debian 12, each checked against its sha256; with "
            "`apt-get download` where apt is present, as any user, else from the archive's pool over HTTP), unpack "
            "their C/C++ files under usr/include in Python, add torch's headers as a second source, drop generated "
            "files, exact and near duplicates (MinHash over 5-token shingles), and split by file (val, test) and "
            "by library (the held-out one). Writes <out>/files/<source>/<path> and <out>/corpus_manifest.json "
            "(per file: source, version, the .deb's sha256, licence, sha256, status, split).",
            "A package that is not pinned, or a download whose sha256 differs from its pin, fails closed and names "
            "the package. Reruns reuse the verified .deb files under <out>/debs.",
        ),
        **common,
    )
    # own dests: `data`'s --out and --quiet would otherwise be overwritten by these defaults
    c.add_argument("--out", dest="corpus_out", default=None, help="corpus directory (default: $MEGACPP_CORPUS_DIR, "
                   "else ~/.cache/megacpp-lab/corpus)")  # fmt: skip
    c.add_argument("--packages", default=None,
                   help="comma-separated package names, a subset of the pinned ones (default: all of "
                   f"{', '.join(p.name for p in PINNED)})")  # fmt: skip
    c.add_argument("--no-torch", action="store_true", help="leave torch's headers out (default: a second source)")
    c.add_argument("--near-threshold", type=float, default=corpus_defaults.near_threshold,
                   help="the least estimated Jaccard similarity of a near duplicate")  # fmt: skip
    c.add_argument("--mirror", default=DEBIAN_MIRROR, help="the Debian archive's root, for the HTTP download")
    c.add_argument("--no-apt", action="store_true", help="download over HTTP even where apt-get is present")
    c.add_argument("--archive", default=None, help="also write the built corpus as one tar.xz here, to carry to a "
                   "machine that cannot reach the archive (default: none)")  # fmt: skip
    c.add_argument("--from-archive", default=None, help="restore a corpus from such a tar.xz into --out (each file "
                   "checked against the manifest's sha256) instead of fetching (default: fetch)")  # fmt: skip
    c.add_argument("--quiet", dest="corpus_quiet", action="store_true", help="no progress lines or bars")
    c.set_defaults(func=_cmd_corpus)

    p = sub.add_parser(
        "bench",
        help="benchmark one subsystem and write receipts (GPU; --small for a CPU smoke run)",
        description=_paragraphs(
            "Benchmark one subsystem and write its receipts: JSON stamped with device, versions and commit, plots, "
            "and a profiler trace.",
            "A full run needs a CUDA GPU (table_store, which measures host code, runs on the CPU) and writes under "
            "profiles/<device>/<subsystem>/; --small runs CPU-sized "
            f"shapes as a smoke test and writes under {SMALL_OUT}/. `megacpp-lab bench <subsystem> --help` says "
            "what each one measures, what it writes and how long it takes.",
        ),
        **common,
    )
    bench = p.add_subparsers(dest="subsystem", required=True, metavar="SUBSYSTEM")
    for cmd in COMMANDS.values():
        b = bench.add_parser(cmd.name, help=cmd.summary, description=cmd.description, **common)
        b.add_argument("--out", default=None,
                       help=f"receipt root (default: profiles/ at the repository root; with --small, {SMALL_OUT}/ "
                       "under the current directory)")  # fmt: skip
        b.add_argument("--small", action="store_true",
                       help="CPU-sized shapes: a smoke run of the same code, not a receipt; without a GPU the Triton "
                       "kernels run under the interpreter, which this command sets up")  # fmt: skip
        b.add_argument("--no-trace", action="store_true", help="skip the profiler trace")
        b.set_defaults(func=_cmd_bench)

    p = sub.add_parser(
        "info",
        help="device, versions, commit and problem scale",
        description=_paragraphs(
            "Print, as JSON, what a receipt is stamped with (device, torch, triton, git commit, date) and the "
            "problem scale the notebooks will use: small on CPU, full on a GPU, unless MEGACPP_LAB_SIZE=small|full "
            "says which."
        ),
        **common,
    )
    p.set_defaults(func=_cmd_info)

    p = sub.add_parser(
        "tripwires",
        help="run the upstream regression packs and print their sentinels",
        description=_paragraphs(
            "Run each upstream regression pack's reproducer: TileLang packs 08 and 13 lower kernels for an sm_90 "
            "target on this machine (the `tripwires` extra; no GPU needed), packs 10, 11, 12 and 16 check the "
            "lab's own fixes. Each prints BUG FIRED or FIXED, the versions it ran on and one line per case.",
            "Exit status 1, with one line per deviation naming the pack, when any run differs from the behaviour "
            "measured on the pinned versions (a fix reverted, another tilelang release, the extra missing).",
        ),
        **common,
    )
    p.add_argument("--pack", nargs="+", default=None, metavar="N", help="packs to run (default: all): 08 10 11 12 13 16")
    p.add_argument("--json", default=None, metavar="FILE", help="also write the results, stamped, to FILE (default: none written)")
    p.set_defaults(func=_cmd_tripwires)

    p = sub.add_parser(
        "tour",
        help="execute every notebook headless and write HTML",
        description=_paragraphs(
            "Execute every notebook headless (MEGACPP_LAB_SIZE set to --size) and write one HTML page each."
        ),
        **common,
    )
    p.add_argument("--notebooks", default="notebooks", help="directory of the notebooks to run")
    p.add_argument("--out", default="build", help="directory for the HTML pages")
    p.add_argument("--size", choices=("small", "full"), default="small", help="problem scale of the notebooks")
    p.add_argument("--timeout", type=int, default=1200, help="seconds allowed per cell")
    p.set_defaults(func=_cmd_tour)

    p = sub.add_parser(
        "train",
        help="train the hybrid model on packed C++ rows (resumes from its checkpoint)",
        description=_paragraphs(
            "Train HybridLM on packed BPE rows of real C++: shuffled per epoch and deterministic per seed, with "
            "validation files held out by path. Fused AdamW over fp32 master weights (bf16 on a GPU, the "
            "fp32-contract parameters kept fp32), linear warmup then cosine LR, global gradient clipping, a "
            "progress bar with loss, tokens/s and LR, TensorBoard scalars and a loss-curve PNG.",
            "Checkpoints are atomic (written, then renamed), and a run resumes from <out-dir>/checkpoint.pt "
            "exactly where it stopped. Settings come from --config (a .json or .toml file of the same names), "
            "then the flags; a bad value fails before any work starts.",
        ),
        **common,
    )
    p.add_argument("--config", default=None, help="a .json or .toml file of training settings (default: none)")
    from megacpp_lab.model.train_config import train_options

    # one per TrainConfig / ParallelConfig field: its kind, help and default from the field. Every flag's own
    # default is None (not given), so a config file's value stands unless a flag overrides it
    for o in train_options():
        kind = {"action": argparse.BooleanOptionalAction} if o.kind is bool else {"type": o.kind}
        p.add_argument(f"--{o.name.replace('_', '-')}", dest=o.name, default=None, help=o.help, **kind)
    p.add_argument("--stop-after", type=int, default=None,
                   help="stop after this step of the schedule, with a checkpoint; the next call resumes "
                   "(default: run to --steps)")  # fmt: skip
    p.add_argument("--no-resume", action="store_true",
                   help="refuse to start over an existing checkpoint instead of resuming from it (default: resume)")
    p.add_argument("--nproc", type=int, default=None,
                   help="processes (GPUs) on this host: torchrun underneath, FSDP2 over the ranks, --batch-size the "
                   "global batch, sharded checkpoints in <out-dir>/checkpoint.dcp (default: 1)")  # fmt: skip
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=_cmd_train)

    p = sub.add_parser(
        "sample",
        help="generate C++ from a training checkpoint",
        description=_paragraphs(
            "Generate C++ from a checkpoint written by `megacpp-lab train`, one token at a time with real per-layer "
            "decode state: MLA's compressed KV cache, the SSD and M2RNN states, the conv and Engram windows. "
            "Temperature and top-k sampling; temperature 0 is greedy."
        ),
        **common,
    )
    p.add_argument("checkpoint",
                   help="a run directory of `megacpp-lab train` (its --out-dir: the newest checkpoint in it), its "
                   "checkpoint.pt, or its checkpoint.dcp")  # fmt: skip
    prompt = p.add_mutually_exclusive_group()
    prompt.add_argument("--prompt", default="#include <", help="the start of the C++ document")
    prompt.add_argument("--prompt-file", default=None, metavar="PATH",
                        help="read the prompt from this file instead of --prompt, as bytes: invalid UTF-8 too, "
                        "which a shell cannot pass to --prompt (default: none)")  # fmt: skip
    p.add_argument("--max-new-tokens", type=int, default=200, help="tokens to generate, at least 1")
    p.add_argument("--temperature", type=float, default=0.8, help="softmax temperature; 0 = greedy")
    p.add_argument("--top-k", type=int, default=50, help="sample among the k most likely tokens; 0 = all")
    p.add_argument("--num-samples", type=int, default=1, help="independent samples (one batch)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed")
    p.add_argument("--device", default="auto", help="auto, cpu or cuda")
    p.set_defaults(func=_cmd_sample)

    p = sub.add_parser(
        "profile",
        help="profile the compiled training step region by region (trace, JSON summary, plot)",
        description=_paragraphs(
            "Profile HybridLM's training step under torch.profiler: one cold (compiling) step timed on its own, "
            "every later batch once unprofiled (its first sight compiles what its documents select), then wait, "
            "warmup and active steps on the profiler's schedule over those batches, each with another number "
            "of documents per row, with a record_function range per block. Writes under "
            "<out>/<device-slug>/profile/ a TensorBoard trace (*.pt.trace.json: open it with `tensorboard "
            "--logdir <that folder>` and the torch-tb-profiler plugin, or drop it on ui.perfetto.dev), a JSON "
            "summary (the top kernels, each block kind's share of the step, step times, tokens/s and MFU with "
            "attention FLOPs per document (the row-triangle count beside it), and the compiled regions: count, "
            "graph breaks, recompiles, cold compile time per region) and a PNG.",
            "The defaults profile the base preset at B=4, T=4096 on a GPU; --small runs the tiny preset on a CPU.",
        ),
        **common,
    )
    p.add_argument("--preset", default=None, help="model preset (default: base; tiny with --small)")
    p.add_argument("--batch", type=int, default=None, help="rows per batch (default: 4; 2 with --small)")
    p.add_argument("--seq-len", type=int, default=None, help="tokens per row (default: 4096; 64 with --small)")
    p.add_argument("--docs", type=int, default=None,
                   help="documents per row; the steps vary it between half and twice this (default: 8; 2 with --small)")
    p.add_argument("--wait", type=int, default=None, help="schedule: steps skipped (default: 1; 0 with --small)")
    p.add_argument("--warmup", type=int, default=None, help="schedule: steps traced, not kept (default: 2; 1 with --small)")
    p.add_argument("--active", type=int, default=None, help="schedule: steps recorded (default: 3; 1 with --small)")
    p.add_argument("--eager", dest="compiled", action="store_false",
                   help="profile the eager step instead of the regionally compiled one (default: compiled)")
    p.add_argument("--no-optimizer", action="store_true", help="leave the fused AdamW step out of each step (default: in)")
    p.add_argument("--inductor-caches", action="store_true",
                   help="let inductor's on-disk caches serve the first step (default: off, a truly cold compile)")
    p.add_argument("--out", default=None,
                   help=f"receipt root (default: profiles/ at the repository root; with --small, {SMALL_OUT}/)")
    p.add_argument("--small", action="store_true", help="the tiny preset on a CPU: a smoke run, not a receipt")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=_cmd_profile)

    p = sub.add_parser(
        "resources",
        help="each Triton kernel's registers, spills and shared memory on a Hopper, compiled here without a GPU",
        description=_paragraphs(
            "The scans' Triton kernels (Mamba-3 SISO and MIMO, Mamba-2's SSD; forward and backward) compiled for "
            "sm_90 by Triton's compiler and the ptxas its wheel ships, on any machine: no GPU, nothing launched. "
            "For each kernel: registers a thread, bytes spilled to local memory (stores/loads), stack frame, shared "
            "memory, warps, and the programs one SM holds at once. A kernel that spills is a kernel to restructure; "
            "whether the restructured one is faster is for bench on a GPU to say.",
            "About 20 seconds for every subject on a CPU. The figures are this Triton's and this ptxas's "
            "(megacpp_lab/kernels/resources.py compiles; megacpp_lab/bench/resources.py says what and at which shapes).",
        ),
        **common,
    )
    p.add_argument("subjects", nargs="*", metavar="SUBJECT",
                   help="what to compile: doc_conv, mamba3, mamba3-mimo2, mamba3-mimo4, ssd, m2rnn (default: all)")  # fmt: skip
    p.add_argument("--json", default=None,
                   help="also write the table, with the commit and versions, here as JSON (default: print only)")
    p.set_defaults(func=_cmd_resources)

    p = sub.add_parser(
        "receipts",
        help="each receipt under profiles/ against today's code: current, or which measured files changed since",
        description=_paragraphs(
            "For every receipt at profiles/<device>/<subsystem>/<name>.json: its commit and date, and whether the "
            "code it measures changed since. What it measures (megacpp_lab/bench/receipt_ages.py, measured_files): its "
            "benchmark module, every package module that module imports at any depth (with their parent packages), "
            "the package modules the benchmark module's own strings name (what its subprocesses run), the CLI "
            "for the profile and memory commands (their flag defaults), and the committed data/ wherever the "
            "package's data module is reached; the receipts' own bookkeeping (receipts.py, plots.py, receipt_ages.py) does not count.",
            "'current': none of those files differs from the receipt's commit, in HEAD or in the working tree (a "
            "tree: stamp is judged as the commit holding that package). 'changed': some do, listed nearest the "
            "benchmark first with the number of commits since that touch them; an upper bound, not a verdict (a "
            "file a benchmark imports can change where the path it times did not), so read the listed files' diffs "
            "before calling a receipt stale. 'unknown': a package tree no commit holds, a commit not in this "
            "checkout's history, no git, or a file that does not parse.",
        ),
        **common,
    )
    p.add_argument("--subsystem", default=None, help="only this subsystem's receipts (default: all)")
    p.add_argument("--device", default=None,
                   help="only one device's receipts: its folder's start or the card's name, e.g. nvidia-h100 or "
                        "'NVIDIA H200' (default: all)")  # fmt: skip
    p.set_defaults(func=_cmd_receipts)

    p = sub.add_parser(
        "memory",
        help="activation memory: the checkpointing budget sweep",
        description="Activation memory of HybridLM's training step under checkpointing policies and budgets.",
        **common,
    )
    memory = p.add_subparsers(dest="memory_command", required=True, metavar="ACTION")
    p = memory.add_parser(
        "sweep",
        help="activation memory and step time over remat budgets, per-kind budgets and manual policies",
        description=_paragraphs(
            "The regionally compiled base model (B=4, T=4096, 8 documents per row, bf16, Triton scans) at global "
            "activation_memory_budgets 1.0 down to 0.0 and at per-block-kind budgets, and the eager model under "
            "the manual policies (none, full, a save list) and with CPU offload; every point a fresh model, one "
            "run. Each point: the activation memory left for the backward, the step's peak, saved-tensor bytes "
            "and the allocator's retained bytes per block kind, and the median fwd+bwd step. The summary holds "
            "the bar (budget 0.3 against 1.0), the Pareto front and whether a per-kind policy beats every global "
            "budget at its memory.",
            "Receipts under <out>/<device-slug>/memory/: memory_sweep.json and memory_sweep.png (the Pareto plot). "
            "Run time on an H200: about four minutes (the committed receipt: 229 s for 13 points, 9 of them a "
            "compile of the base model's four block structures, with inductor's caches on). --small (CPU, the tiny preset at B=1, T=32, the scans' Triton kernels under the "
            "interpreter, dynamo's aot_eager_decomp_partition backend, which runs the min-cut partitioner): about "
            "a minute.",
        ),
        **common,
    )
    p.add_argument("--out", default=None,
                   help=f"receipt root (default: profiles/ at the repository root; with --small, {SMALL_OUT}/)")
    p.add_argument("--small", action="store_true", help="the tiny preset on a CPU: a smoke run, not a receipt")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=_cmd_memory_sweep)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # train --nproc relaunches the same command
    try:
        with warnings.catch_warnings():
            if not args.debug:
                warnings.showwarning = _show_warning  # one line each, as the errors
            return args.func(args)
    except USAGE_ERRORS as exc:
        if args.debug:
            traceback.print_exc()
        # the same exception types can come from a bug rather than bad input: say how to see where
        hint = "" if args.debug else " (--debug shows the traceback)"
        print(f"{PROG}: error: {_one_line(str(exc))}{hint}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
