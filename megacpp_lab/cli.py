"""`megacpp-lab` console script. Each subsystem issue adds its subcommands here."""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
from pathlib import Path


def _cmd_data(args: argparse.Namespace) -> int:
    from megacpp_lab.data.sample import SampleConfig, build_sample, load_sample

    config = SampleConfig(rows=args.rows, seq_len=args.seq_len, stride=args.stride, max_file_bytes=args.max_file_bytes)
    out = build_sample(args.out, root=args.root, config=config, progress=not args.quiet)
    rows, manifest = load_sample(out)
    print(
        f"wrote {out}/sample.pt and manifest.json: {manifest['shape']['rows']} rows x "
        f"{manifest['shape']['seq_len']} tokens, {manifest['documents']} files, "
        f"{manifest['segments']} segments, {manifest['pad_tokens']} pad tokens"
    )
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
    import nbformat
    from nbconvert import HTMLExporter
    from nbconvert.preprocessors import ExecutePreprocessor
    from tqdm.auto import tqdm

    from megacpp_lab.sizing import SIZE_ENV

    os.environ[SIZE_ENV] = args.size
    notebooks = sorted(Path(args.notebooks).glob("*.ipynb"))
    if not notebooks:
        print(f"no notebooks under {args.notebooks}", file=sys.stderr)
        return 1
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
    if args.subsystem == "engram":
        from megacpp_lab.bench.engram import run
    elif args.subsystem == "m2rnn":
        from megacpp_lab.bench.m2rnn import run
    elif args.subsystem == "mla":
        from megacpp_lab.bench.mla import run
    elif args.subsystem in ("loss", "dsa"):
        from megacpp_lab.bench.loss import run as run_loss

        run = functools.partial(run_loss, which=args.subsystem)
    else:  # argparse choices keep this unreachable
        raise ValueError(f"unknown subsystem {args.subsystem!r}")
    written = run(args.out, small=args.small, trace=not args.no_trace)
    for path in written:
        print(path)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="megacpp-lab", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    from megacpp_lab.data.sample import SampleConfig

    defaults = SampleConfig()
    p = sub.add_parser("data", help="build the packed C++ sample and its manifest")
    p.add_argument("--out", default=None, help="output directory (default: data/ at the repo root)")
    p.add_argument("--root", default=None, help="C++ source directory (default: torch/include)")
    p.add_argument("--rows", type=int, default=defaults.rows)
    p.add_argument("--seq-len", type=int, default=defaults.seq_len)
    p.add_argument("--stride", type=int, default=defaults.stride, help="take every n-th file")
    p.add_argument("--max-file-bytes", type=int, default=defaults.max_file_bytes)
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=_cmd_data)

    p = sub.add_parser("bench", help="benchmark a subsystem and write receipts (run it on a GPU)")
    p.add_argument("subsystem", choices=("engram", "m2rnn", "mla", "loss", "dsa"))
    p.add_argument("--out", default=None, help="receipt root (default: profiles/)")
    p.add_argument("--small", action="store_true", help="CPU-sized shapes (smoke run, not a receipt to commit)")
    p.add_argument("--no-trace", action="store_true", help="skip the profiler trace")
    p.set_defaults(func=_cmd_bench)

    p = sub.add_parser("info", help="device, versions, commit and problem scale")
    p.set_defaults(func=_cmd_info)

    p = sub.add_parser("tour", help="execute every notebook headless and write HTML")
    p.add_argument("--notebooks", default="notebooks")
    p.add_argument("--out", default="build")
    p.add_argument("--size", choices=("small", "full"), default="small")
    p.add_argument("--timeout", type=int, default=1200, help="seconds per cell")
    p.set_defaults(func=_cmd_tour)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    raise SystemExit(main())
