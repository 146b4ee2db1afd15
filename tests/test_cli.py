"""The `megacpp-lab` console script: one-line errors (exit 2), --debug tracebacks, per-subsystem help,
bench --small smoke runs that set up the Triton interpreter and write only under build/, and a
reproducible `data` build."""

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from megacpp_lab.bench import COMMANDS, SMALL_OUT
from megacpp_lab.cli import _HelpFormatter, build_parser, main
from megacpp_lab.data import load_sample
from megacpp_lab.data.sample import MANIFEST_FILE, SAMPLE_FILE, repo_data_dir
from megacpp_lab.receipts import profiles_dir, repo_root

no_gpu = pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU a full-size bench would start instead")


def run_cli(*argv: str, cwd: Path, env_drop: tuple[str, ...] = ("TRITON_INTERPRET",), code: str | None = None,
            timeout: float = 300) -> subprocess.CompletedProcess:  # fmt: skip
    """The CLI in a fresh interpreter (nothing imported yet), without TRITON_INTERPRET in its environment."""
    env = {k: v for k, v in os.environ.items() if k not in env_drop}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(repo_root()), env.get("PYTHONPATH")]))
    cmd = [sys.executable, "-c", code, *argv] if code else [sys.executable, "-m", "megacpp_lab.cli", *argv]
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def one_error_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert err[0].startswith("megacpp-lab: error: "), err
    assert err[0].endswith(" (--debug shows the traceback)"), err
    return err[0]


def test_cli_data_writes_sample_and_manifest(tmp_path, capsys):
    assert main(["data", "--out", str(tmp_path), "--rows", "3", "--seq-len", "256", "--quiet"]) == 0
    rows, manifest = load_sample(tmp_path)
    assert rows.batch.tokens.shape == (3, 256)
    out = capsys.readouterr()
    assert "3 rows x 256 tokens" in out.out and out.err == ""
    assert manifest["config"]["rows"] == 3


def test_cli_info_prints_stamp(capsys):
    assert main(["info"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert {"device", "torch", "triton", "commit", "date", "device_slug", "scale"} <= info.keys()


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["--root", "/nonexistent/cpp"], "corpus root /nonexistent/cpp does not exist"),
        (["--rows", "-3"], "SampleConfig.rows must be >= 1, got -3"),
        (["--stride", "0"], "SampleConfig.stride must be >= 1, got 0"),
        (["--max-file-bytes", "0"], "SampleConfig.max_file_bytes must be >= 1, got 0"),
        (["--seq-len", "1"], "SampleConfig.seq_len must be >= 16"),
        # read only when a BPE is trained: without --train-tokenizer it was silently unused
        (["--vocab-size", "5"], "--vocab-size 5 sizes a BPE being trained: it needs --train-tokenizer"),
    ],
)
def test_data_bad_values_are_one_line_errors(tmp_path, capsys, argv, expected):
    assert main(["data", "--out", str(tmp_path / "out"), "--quiet", *argv]) == 2
    assert expected in one_error_line(capsys)
    assert not (tmp_path / "out").exists()  # nothing written, not even the folder


def test_data_root_without_cpp_files_is_one_line_error(tmp_path, capsys):
    (tmp_path / "notes.txt").write_text("not C++")
    assert main(["data", "--root", str(tmp_path), "--out", str(tmp_path / "out"), "--quiet"]) == 2
    assert f"corpus root {tmp_path} holds no C++ files" in one_error_line(capsys)
    assert main(["data", "--root", str(tmp_path / "notes.txt"), "--out", str(tmp_path / "out"), "--quiet"]) == 2
    assert "is not a directory" in one_error_line(capsys)


def test_bad_size_env_is_one_line_error(monkeypatch, capsys):
    monkeypatch.setenv("MEGACPP_LAB_SIZE", "bogus")
    assert main(["info"]) == 2
    line = one_error_line(capsys)
    assert "MEGACPP_LAB_SIZE must be 'small' or 'full'" in line and "got 'bogus'" in line
    monkeypatch.setenv("MEGACPP_LAB_SIZE", "Bogus")
    assert main(["info"]) == 2
    assert "got 'Bogus'" in one_error_line(capsys)


@pytest.mark.parametrize("where", ["before", "after"])
def test_debug_shows_the_traceback(tmp_path, capsys, where):
    argv = ["data", "--out", str(tmp_path), "--rows", "-3"]
    argv = ["--debug", *argv] if where == "before" else [*argv, "--debug"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("Traceback (most recent call last):")
    assert "ValueError: SampleConfig.rows must be >= 1, got -3" in err
    assert err.rstrip().splitlines()[-1] == "megacpp-lab: error: SampleConfig.rows must be >= 1, got -3"


def test_data_short_corpus_warns_what_it_wrote_against_what_was_asked(tmp_path, capsys):
    src = tmp_path / "src"  # one small header: whichever file a stride lands on elsewhere may be over max_file_bytes
    src.mkdir()
    (src / "one.h").write_bytes(b"#pragma once\nint f(int x);  // a short corpus\n" * 4)
    assert main(["data", "--root", str(src), "--out", str(tmp_path), "--stride", "100000", "--quiet"]) == 0
    out = capsys.readouterr()
    warning = out.err.strip().splitlines()
    assert len(warning) == 1 and warning[0].startswith("megacpp-lab: warning: asked for 48 rows x 2048 tokens")
    assert "the sample has 1 rows" in warning[0] and "stride 100000" in warning[0]
    assert "1 rows (of 48 asked) x 2048 tokens" in out.out
    assert load_sample(tmp_path)[1]["shape"]["rows"] == 1


def test_tour_without_notebooks_is_one_line_error(tmp_path, capsys):
    assert main(["tour", "--notebooks", str(tmp_path), "--out", str(tmp_path / "html")]) == 2
    assert "no notebooks (*.ipynb) under" in one_error_line(capsys)


@no_gpu
@pytest.mark.parametrize("name", sorted(n for n, c in COMMANDS.items() if not c.cpu_receipts))
def test_bench_refuses_full_size_on_cpu(tmp_path, capsys, name):
    """Every GPU subsystem, engram included, refuses a full-size CPU run before doing any work."""
    assert main(["bench", name, "--out", str(tmp_path)]) == 2
    line = one_error_line(capsys)
    assert f"bench {name}` runs full-size shapes and needs a CUDA GPU" in line and "--small" in line
    assert list(tmp_path.iterdir()) == []


def test_host_side_benchmarks_run_full_size_on_the_cpu():
    """table_store measures host code (the lookup runs on the CPU either way): its full run is a receipt."""
    from megacpp_lab.bench import bench_device

    assert {n for n, c in COMMANDS.items() if c.cpu_receipts} == {"table_store"}
    assert bench_device("table_store", small=False) == "cpu"


def test_bench_small_refuses_to_write_into_profiles(capsys):
    before = set(profiles_dir().rglob("*"))
    assert main(["bench", "loss", "--small", "--out", str(profiles_dir() / "smoke")]) == 2
    assert "profiles/ holds receipts only" in one_error_line(capsys)
    assert set(profiles_dir().rglob("*")) == before


def test_top_level_help_is_for_users(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--help"])
    assert exit_.value.code == 0
    text = capsys.readouterr().out
    assert "issue" not in text.lower()
    assert "benchmark each subsystem into receipts" in text and "--debug" in text
    for command in ("data", "bench", "info", "tour", "train", "sample", "profile"):
        assert f"\n    {command} " in text


def bench_help(name: str, capsys) -> str:
    with pytest.raises(SystemExit) as exit_:
        main(["bench", name, "--help"])
    assert exit_.value.code == 0
    return capsys.readouterr().out


# contenders and a shape detail each subsystem's help must name (read from megacpp_lab/bench/*.py)
HELP_MUST_SAY = {
    "engram": ("maxtext_depthwise", "xla_safe", "minimal", "T=4096, C=1024", "F.rms_norm"),
    "m2rnn": ("reference loop", "every 1, 16, 64", "S=4096, H=8, K=64, V=16"),
    "ssd": ("chunk_simple_gla", "g_gamma", "torch.compile(ssd_chunked_torch)", "reference step loop",
            "T=4096, H=16, N=128", "refused"),
    "mla": ("torch.compile of the torch", "copy of the same bytes", "TurboQuant", "PolarQuant", "kv_lora_rank=512"),
    "loss": ("materialised logits", "liger-kernel", "cut-cross-entropy", "filter_eps", "V=151552"),
    "dsa": ("einsum slab", "per-head stream", "fused Triton", "sq = sk = 4096"),
    "model": ("base preset (12 layers, d=1024, pattern AMRM", "T=4096", "fused AdamW", "forward alone",
              "share of the step", "64 documents per row", "real packed BPE rows"),
    "train": ("small preset", "engram_layers=none", "hashed n-gram memory", "Three seeds per arm", "held-out library",
              "master weights", "sampled tokens", "seed ranges do not overlap", "MEGACPP_BENCH_TRAIN_RUNS"),
    "compile": ("regional cold", "regional warm", "Mega-Cache", "torch.compile(model)", "split by phase",
                "recompiles", "MFU", "989 TFLOP/s", "1/3 of whole-model", "0.8x eager", "<= 40 s", "<= 4 s"),
    "attention": ("attn_impl sdpa", "attn_impl flex", "sparse and its warm-up phase", "T=16384, 8 documents per row",
                  "top-k 2048", "0.5x", "mtp_depth 1 and 0", "+15%", "acceptance rate", "held-out files"),
    "moe": ("per-expert loop", "torch._grouped_mm", "dense SwiGLU of the same active FLOPs", "16 experts, d=1024, 16384 tokens",
            "expert-GEMM recompute", "stack preset", "recompiles"),
    "scale_out": ("--nproc N", "same per-GPU batch", "fp32-contract", "B=4 x T=4096 per GPU", "1.85x", "peak memory"),
    "table_store": ("numpy gather", "in-process backend", "Mooncake backend through TableStore", "one range per row",
                    "whole tables", "EngramStore.lookup", "B=8, L=4096, H=2, D=256", "TCP loopback", "libibverbs1"),
}


def test_each_bench_subsystem_has_its_own_help(capsys):
    texts = {name: bench_help(name, capsys) for name in COMMANDS}
    assert len(set(texts.values())) == len(COMMANDS)
    assert HELP_MUST_SAY.keys() == COMMANDS.keys()
    for name, text in texts.items():
        for phrase in HELP_MUST_SAY[name]:
            assert phrase in " ".join(text.split()), (name, phrase)
        assert f"Receipts under <out>/<device-slug>/{name}/" in text
        # the GPU its receipts were measured on, or the CPU for a host-side benchmark
        where = r"Run time on a \d+-core CPU" if COMMANDS[name].cpu_receipts else r"Run time on an H[12]00"
        assert re.search(where, " ".join(text.split())), name
        for flag in ("--out", "--small", "--no-trace", "--debug"):
            assert flag in text


def walk(parser: argparse.ArgumentParser):
    """The parser and every subcommand parser under it."""
    yield parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for child in action.choices.values():
                yield from walk(child)


def test_every_flag_has_help_that_states_its_default():
    parsers = list(walk(build_parser()))
    # top, data/bench/info/tripwires/tour/train/sample/profile/memory/resources/receipts, data corpus, memory sweep,
    # one per subsystem
    assert len(parsers) == 1 + 11 + 2 + len(COMMANDS)
    for parser in parsers:
        assert parser.formatter_class is _HelpFormatter
        formatter = parser._get_formatter()
        for action in parser._actions:
            if not action.option_strings or action.dest == "help":
                continue
            assert action.help, (parser.prog, action.option_strings)
            assert "default" in formatter._get_help_string(action), (parser.prog, action.option_strings)


def test_building_the_parser_imports_no_kernel(tmp_path):
    code = (
        "import sys; from megacpp_lab.cli import build_parser; build_parser(); "
        "print(sorted(m for m in sys.modules if m.startswith('megacpp_lab.kernels') or m == 'triton'))"
    )
    result = run_cli(cwd=tmp_path, code=code)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


@no_gpu
def test_bench_small_refuses_kernels_imported_without_the_interpreter(tmp_path):
    """TRITON_INTERPRET is read once, when megacpp_lab.kernels is imported: too late to set it after."""
    code = "import sys, megacpp_lab.kernels; from megacpp_lab.cli import main; sys.exit(main(sys.argv[1:]))"
    result = run_cli("bench", "m2rnn", "--small", cwd=tmp_path, code=code)
    assert result.returncode == 2, result.stderr
    err = result.stderr.strip().splitlines()
    assert len(err) == 1 and "imported without TRITON_INTERPRET=1" in err[0], err
    assert list(tmp_path.iterdir()) == []


@no_gpu
def test_bench_run_called_directly_refuses_without_the_interpreter(tmp_path):
    """The library entry point fails closed, instead of Triton's "0 active drivers" deep in an autotuner."""
    code = (
        "import sys; from megacpp_lab.bench import BenchSetupError; from megacpp_lab.bench.mla import run\n"
        "try:\n    run(sys.argv[1], small=True)\nexcept BenchSetupError as e:\n    print(e)\n    sys.exit(3)"
    )
    result = run_cli(str(tmp_path / "out"), cwd=tmp_path, code=code)
    assert result.returncode == 3, result.stderr
    assert "imported without TRITON_INTERPRET=1" in result.stdout
    assert not (tmp_path / "out").exists()


# engram compiles seven graphs on a cold inductor cache; mla compiles five and interprets seven kernels
SLOW = {"engram", "mla"}
# `bench compile --small` is six processes of cold compiles by design (about two minutes of CI's two cores): CI
# runs it in notebook 06 (bench_compile at the same size, plus the whole-model contender at the preset's depth),
# and test_bench_compile_small_run_writes_its_receipt_plot_and_traces_under_build checks run()'s wiring here
SMOKE_ELSEWHERE = {"compile"}


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n in SLOW else n
                                  for n in sorted(set(COMMANDS) - SMOKE_ELSEWHERE)])  # fmt: skip
def test_bench_small_runs_without_setup_and_writes_only_under_build(tmp_path, name):
    """`bench <name> --small` from a bare shell: no TRITON_INTERPRET exported, output under ./build/bench-small."""
    before = set(profiles_dir().rglob("*"))
    result = run_cli("bench", name, "--small", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    written = [Path(line) for line in result.stdout.splitlines() if line.strip()]
    small_root = tmp_path / SMALL_OUT
    assert written and all((tmp_path / p).resolve().is_relative_to(small_root) for p in written)
    assert all((tmp_path / p).is_file() for p in written)
    assert all(p.is_relative_to(small_root) for p in tmp_path.rglob("*") if p.is_file())
    assert set(profiles_dir().rglob("*")) == before  # nothing into the repo's receipts
    # the help names what it writes: every receipt, and every trace by its prefix
    receipts = sorted(p.name for p in written if p.suffix == ".json" and not p.name.endswith(".pt.trace.json"))
    assert receipts and all(r in COMMANDS[name].description for r in receipts)
    traces = [p.name.split(".")[0] for p in written if p.name.endswith((".pt.trace.json", ".pt.trace.json.gz"))]
    text = " ".join(COMMANDS[name].description.split())
    if ".pt.trace.json" in text:  # one trace per profiled run: named as it is, or with its run's count as <N>
        assert traces and all(f"{t}.*.pt.trace.json" in text or f"{re.sub(r'[0-9]+', '<N>', t)}.pt.trace.json" in text
                              for t in traces), (traces, text)  # fmt: skip
    else:  # a command without a trace (the training receipt) says none
        assert not traces
    for r in receipts:
        receipt = json.loads((tmp_path / next(p for p in written if p.name == r)).read_text())
        assert receipt["device"].startswith("CPU") or torch.cuda.is_available()
        assert receipt["subsystem"] == name


def test_bench_compile_small_run_writes_its_receipt_plot_and_traces_under_build(tmp_path, monkeypatch):
    """bench compile's run(small=True) in process, bench_compile and the plot stubbed (the bench itself runs at this
    size in notebook 06): the small settings reach bench_compile, with its caches and traces under
    ./build/bench-small; the receipt, the plot and each trace a result names are written there, and the partial file
    is gone; the help names the receipt and the traces' prefix; nothing goes into the repo's receipts."""
    from megacpp_lab.bench import compile as bench_compile_mod
    from megacpp_lab.receipts import make_receipt

    seen = {}

    def fake_bench_compile(**kwargs):
        seen.update(kwargs)
        kwargs["partial"].write_text("{}")  # what a run leaves while it goes
        (kwargs["trace_dir"] / "compile_regional.1.pt.trace.json").write_text("{}")
        return make_receipt("compile_step", "compile", shape={"preset": kwargs["preset"]}, dtype="float32", device="cpu",
                            results=[{"contender": "regional cold", "ms": 1.0, "trace": "compile_regional.1.pt.trace.json"},
                                     {"contender": "regional warm", "ms": 1.0}])  # fmt: skip

    def fake_plot(receipt, path):
        path.write_bytes(b"png")
        return path

    monkeypatch.setattr(bench_compile_mod, "bench_compile", fake_bench_compile)
    monkeypatch.setattr(bench_compile_mod, "_plot", fake_plot)
    monkeypatch.chdir(tmp_path)
    before = set(profiles_dir().rglob("*"))
    written = bench_compile_mod.run(small=True)
    small_root = (tmp_path / SMALL_OUT).resolve()
    folder = written[0].parent
    assert [p.name for p in written] == ["compile_step.json", "compile_step.png", "compile_regional.1.pt.trace.json"]
    assert all(p.resolve().is_relative_to(small_root) and p.is_file() for p in written)
    assert not (folder / "compile_step.partial.json").exists()
    assert (seen["preset"], seen["B"], seen["T"], seen["backend"], seen["warm_runs"]) == ("tiny", 1, 32, "aot_eager", 1)
    assert Path(seen["caches"]) == Path(SMALL_OUT) and seen["trace_dir"] == folder
    assert json.loads(written[0].read_text())["elapsed_s"] >= 0
    text = " ".join(COMMANDS["compile"].description.split())
    assert "compile_step.json" in text and "compile_regional.*.pt.trace.json" in text
    assert set(profiles_dir().rglob("*")) == before


@no_gpu
def test_bench_ssd_small_records_what_it_did_not_measure():
    """The --small SSD receipt: the Triton op and the step loop agree with the fp32 oracle (y and every
    gradient), and what a CPU run cannot measure (torch.compile, fla, peak memory, so the whole bar) is
    listed with its reason instead of a number."""
    from megacpp_lab.bench import ssd

    receipt = ssd.bench_ssd(ssd.SMALL_SHAPE, ssd.SMALL_REF_SHAPE, dtype=torch.float32, device="cpu",
                            compile=False, rep=1, progress=False)  # fmt: skip
    assert receipt["subsystem"] == "ssd" and receipt["name"] == "ssd_fwd_bwd"
    rows = {r["contender"]: r for r in receipt["results"]}
    assert {"triton", ssd.EAGER_CHUNKED, "reference step loop", "triton (at the step loop's shape)"} <= rows.keys()
    for name in ("triton", "reference step loop", "triton (at the step loop's shape)"):
        assert {"ms", "fwd_ms", "bwd_ms"} <= rows[name].keys()
        assert rows[name]["max_abs_err"] < 1e-4, name
        assert set(rows[name]["grad_rel_err"]) == {"x", "dt", "A", "Bm", "Cm"}
        assert max(rows[name]["grad_rel_err"].values()) < 1e-4, (name, rows[name]["grad_rel_err"])
    assert rows["reference step loop"]["shape"]["B"] == 1
    skipped = {m["contender"]: m for m in receipt["not_measured"]}
    assert skipped.keys() == {ssd.COMPILED, ssd.FLA, ssd.FLA_GAMMA}
    assert all(m["status"] in ("not installed", "skipped") and m["reason"] for m in skipped.values())
    assert receipt["meets_bar"] == {} and receipt["bar_not_measured"].keys() == ssd.BAR.keys()
    lengths = receipt["cu_seqlens"]["lengths"]
    B, T, docs = ssd.SMALL_SHAPE.B, ssd.SMALL_SHAPE.T, ssd.SMALL_SHAPE.docs
    assert len(lengths) == B * docs and len(set(lengths)) > 1  # unequal documents ...
    assert all(sum(lengths[b * docs : (b + 1) * docs]) == T for b in range(B))  # ... that fill each row exactly


def test_bench_table_store_small_receipt_is_exact_and_says_where_it_ran(monkeypatch):
    """Every contender returns exactly the numpy gather's rows at the tiny shapes; the receipt records the CPU
    and its cores; without Mooncake its contenders are listed as not measured, with the reason."""
    from megacpp_lab.bench import table_store

    def run() -> dict:
        return table_store.bench_table_store(table_store.SMALL_SHAPES, **table_store.SMALL_REPS, progress=False)

    monkeypatch.setattr(table_store, "mooncake_unavailable", lambda: "the system library libibverbs1 is missing")
    receipt = run()
    assert receipt["device"].startswith("CPU") and receipt["cpu_cores"] == len(os.sched_getaffinity(0))
    assert {r["contender"] for r in receipt["results"]} == {table_store.NUMPY, table_store.IN_PROCESS}
    assert [m["contender"] for m in receipt["not_measured"]] == list(table_store.MOONCAKE_CONTENDERS)
    assert all("libibverbs1" in m["reason"] for m in receipt["not_measured"])
    monkeypatch.undo()
    from megacpp_lab.store.mooncake import mooncake_unavailable

    if mooncake_unavailable() is not None:
        pytest.skip(f"Mooncake backend not testable here: {mooncake_unavailable()}")
    receipt = run()
    rows = receipt["results"]
    assert len(rows) == len(table_store.SMALL_SHAPES) * 6 and "not_measured" not in receipt
    assert all(r["exact"] and r["max_abs_err"] == 0 and r["rows_per_s"] > 0 for r in rows), rows
    planned = [r for r in rows if r["contender"] == table_store.MOONCAKE]
    assert all(len(r["planned_reads"]) == r["shape"]["H"] for r in planned)
    assert receipt["mooncake"]["version"] == "0.3.13.post1"


def build_twice(tmp_path: Path, *argv: str) -> tuple[Path, Path]:
    first, second = tmp_path / "a", tmp_path / "b"
    assert main(["data", "--out", str(first), "--quiet", *argv]) == 0
    time.sleep(1.1)  # a wall-clock stamp (seconds) would differ between the two builds
    assert main(["data", "--out", str(second), "--quiet", *argv]) == 0
    return first, second


def test_data_build_is_byte_reproducible(tmp_path):
    first, second = build_twice(tmp_path, "--rows", "4", "--seq-len", "512", "--stride", "101")
    for name in (SAMPLE_FILE, MANIFEST_FILE):
        assert (first / name).read_bytes() == (second / name).read_bytes(), name


def test_data_build_reproduces_the_committed_sample(tmp_path):
    """`megacpp-lab data --root <the Debian corpus>` rebuilds data/ byte for byte: both samples, the tokenizer
    (trained again) and the manifest. The corpus is a download (`megacpp-lab data corpus`), so a machine without
    it (CI) skips; the torch headers in it must be the installed torch's."""
    from megacpp_lab.data.corpus import CORPUS_MANIFEST, default_corpus_dir

    committed = json.loads((repo_data_dir() / MANIFEST_FILE).read_text())
    import triton

    if (committed["torch"], committed["triton"]) != (torch.__version__, triton.__version__):
        pytest.skip(f"the committed sample was built with torch {committed['torch']}, triton {committed['triton']}")
    corpus = default_corpus_dir()
    if not (corpus / CORPUS_MANIFEST).exists():
        pytest.skip(f"no Debian corpus at {corpus}: `megacpp-lab data corpus` builds it")
    assert main(["data", "--root", str(corpus), "--out", str(tmp_path), "--train-tokenizer", "--quiet"]) == 0
    for name in (SAMPLE_FILE, "sample_bpe.pt", "bpe-32768.json", "corpus_summary.json", MANIFEST_FILE):
        assert (tmp_path / name).read_bytes() == (repo_data_dir() / name).read_bytes(), name


def test_train_options_are_generated_from_the_config_fields():
    from megacpp_lab.model.train_config import TrainConfig, train_options

    defaults = TrainConfig()
    parallel = defaults.parallel
    found = {o.name: o for o in train_options()}
    # every field has a flag: TrainConfig's own, and its ParallelConfig's in place of `parallel` (but the backend,
    # which benches choose)
    fields = set(defaults.__dataclass_fields__) - {"parallel"} | set(parallel.__dataclass_fields__) - {"backend"}
    assert set(found) == fields
    for name, o in found.items():
        value = getattr(parallel if name in parallel.__dataclass_fields__ else defaults, name)
        if isinstance(value, bool):  # a switch: --name / --no-name
            assert o.kind is bool and o.help.endswith(f"(default: {'on' if value else 'off'})"), (name, o)
        elif value is not None:
            assert isinstance(value, o.kind) and f"(default: {value}" in o.help, (name, value, o)
        else:
            assert "(default: " in o.help and "None" not in o.help, (name, o)


def test_options_refuse_a_field_without_help_or_of_a_type_no_flag_reads():
    import dataclasses

    from megacpp_lab.nn.config_builder import option, options

    @dataclasses.dataclass(frozen=True)
    class Bare:
        steps: int = 3

    @dataclasses.dataclass(frozen=True)
    class Listed:
        layers: tuple = option((), "layers")

    with pytest.raises(TypeError, match=r"Bare\.steps has no help"):
        options(Bare)
    with pytest.raises(TypeError, match=r"Listed\.layers: no command-line option"):
        options(Listed)
    assert options(Bare, skip=("steps",)) == []


def test_train_then_sample_from_the_command_line(tmp_path, capsys):
    out = tmp_path / "run"
    argv = ["train", "--preset", "tiny", "--max-files", "40", "--val-fraction", "0.2", "--seq-len", "64",
            "--batch-size", "2", "--steps", "4", "--warmup-steps", "1", "--log-every", "2", "--val-every", "4",
            "--ckpt-every", "4", "--val-batches", "1", "--no-tensorboard", "--out-dir", str(out), "--quiet"]  # fmt: skip
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "trained to step 4" in text and (out / "checkpoint.pt").is_file() and (out / "loss.png").is_file()
    assert main(["sample", str(out / "checkpoint.pt"), "--prompt", "int main(", "--max-new-tokens", "8",
                 "--num-samples", "2", "--temperature", "0"]) == 0  # fmt: skip
    samples = capsys.readouterr().out
    assert samples.count("int main(") == 2 and "--- sample 1" in samples
    # greedy twice: the same text
    assert samples.split("--- sample 1")[0].split("--- sample 0")[1].strip() == samples.split("--- sample 1")[1].strip()
    assert main(argv[:-1] + ["--no-resume", "--quiet"]) == 2
    assert "exists and resume is off" in capsys.readouterr().err
    assert main(["sample", str(out / "checkpoint.pt"), "--top-k", "-3"]) == 2
    assert "top_k" in capsys.readouterr().err
    (tmp_path / "cfg.toml").write_text("steps = -1\n")
    assert main(["train", "--config", str(tmp_path / "cfg.toml")]) == 2
    assert "TrainConfig.steps must be an int >= 1, got -1" in capsys.readouterr().err


# a tiny run's flags without --steps, --warmup-steps and --out-dir (what the tests below vary)
TINY_TRAIN = ("--preset", "tiny", "--max-files", "40", "--val-fraction", "0.2", "--seq-len", "64", "--batch-size", "2",
              "--log-every", "2", "--val-every", "4", "--ckpt-every", "4", "--val-batches", "1", "--no-tensorboard",
              "--quiet")  # fmt: skip


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory) -> Path:
    """A run directory of `train` holding checkpoint.pt (2 steps of the tiny preset)."""
    out = tmp_path_factory.mktemp("cli-run") / "run"
    assert main(["train", *TINY_TRAIN, "--steps", "2", "--warmup-steps", "1", "--out-dir", str(out)]) == 0
    return out


def greedy(capsys, checkpoint: Path | str, *argv: str) -> str:
    assert main(["sample", str(checkpoint), "--max-new-tokens", "4", "--temperature", "0", *argv]) == 0
    out = capsys.readouterr()
    assert out.err == ""
    return out.out


def test_train_warmup_defaults_to_a_tenth_of_the_steps(tmp_path, capsys):
    """`--steps 30` alone trains (the warmup was 100 >= 30); an explicit warmup is still checked, and a resume
    compares the resolved warmup: the same number given explicitly resumes, another one is refused by name."""
    out = tmp_path / "run"
    assert main(["train", *TINY_TRAIN, "--steps", "30", "--stop-after", "1", "--out-dir", str(out)]) == 0
    assert "trained to step 1" in capsys.readouterr().out
    assert torch.load(out / "checkpoint.pt", weights_only=True)["train_config"]["warmup_steps"] == 3
    assert main(["train", *TINY_TRAIN, "--steps", "30", "--warmup-steps", "3", "--stop-after", "2",
                 "--out-dir", str(out)]) == 0  # fmt: skip
    assert "trained to step 2" in capsys.readouterr().out
    assert main(["train", *TINY_TRAIN, "--steps", "30", "--warmup-steps", "4", "--out-dir", str(out)]) == 2
    assert "field 'train_config.warmup_steps' is 3, this run has 4" in one_error_line(capsys)
    assert main(["train", *TINY_TRAIN, "--steps", "30", "--warmup-steps", "30", "--out-dir", str(tmp_path / "b")]) == 2
    assert "TrainConfig.warmup_steps must be fewer than steps=30, got 30" in one_error_line(capsys)
    assert not (tmp_path / "b").exists()


def test_default_train_out_dir_is_ignored_by_git():
    """`train` writes under runs/ by default (from the checkout too): git must not list it as untracked."""
    from megacpp_lab.model.checkpoint_io import CHECKPOINT_FILE
    from megacpp_lab.model.train_config import TrainConfig

    if shutil.which("git") is None or subprocess.run(["git", "-C", str(repo_root()), "rev-parse"],
                                                     capture_output=True).returncode != 0:  # fmt: skip
        pytest.skip("git is not installed or this is not a git checkout")
    written = f"{TrainConfig().out_dir}/{CHECKPOINT_FILE}"
    check = subprocess.run(["git", "-C", str(repo_root()), "check-ignore", "-q", "--no-index", written])
    assert check.returncode == 0, f"{written} is not ignored by git"


def test_quiet_train_still_prints_its_summary(tmp_path, capsys, monkeypatch):
    """--quiet drops the progress, not the result; a RANK left in a single process's environment (no WORLD_SIZE:
    not a torchrun rank) does not silence it either."""
    monkeypatch.setenv("RANK", "1")
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert main(["train", *TINY_TRAIN, "--steps", "2", "--warmup-steps", "1", "--out-dir", str(tmp_path / "run")]) == 0
    out = capsys.readouterr()
    assert re.fullmatch(r"trained to step 2: train loss \S+, val loss \S+, \S+ tokens/s; wrote \S+/\n", out.out), out.out
    assert out.err == ""


def test_sample_reads_a_run_directory_or_either_checkpoint_kind(tiny_run, tmp_path, capsys):
    """The run directory, its checkpoint.pt, and the same checkpoint sharded (checkpoint.dcp in a run directory,
    or the checkpoint.dcp directory itself) all sample the same greedy text."""
    from megacpp_lab.model.distributed import SHARDED_DIR, Ranks, one_process_group, save_sharded
    from megacpp_lab.model.checkpoint_io import CHECKPOINT_FILE, load_checkpoint

    want = greedy(capsys, tiny_run / CHECKPOINT_FILE)
    assert greedy(capsys, tiny_run) == want
    state = load_checkpoint(tiny_run / CHECKPOINT_FILE)
    sharded_run = tmp_path / "sharded"
    with one_process_group():
        save_sharded(sharded_run / SHARDED_DIR, int(state["step"]), {k: state[k] for k in ("model", "optimizer")},
                     {k: v for k, v in state.items() if k not in ("model", "optimizer")}, Ranks())  # fmt: skip
    assert greedy(capsys, sharded_run) == greedy(capsys, sharded_run / SHARDED_DIR) == want
    assert main(["sample", str(tmp_path)]) == 2  # neither kind in it
    assert f"no checkpoint in {tmp_path}: neither a run directory" in one_error_line(capsys)


@pytest.mark.parametrize("content", ["garbage", "foreign pickle"])
def test_corrupt_checkpoint_is_named_without_torch_advice(tmp_path, capsys, content):
    path = tmp_path / "checkpoint.pt"
    if content == "garbage":
        path.write_bytes(b"not a checkpoint at all")
    else:  # a torch.save of a class weights_only refuses: torch's message advises weights_only=False
        torch.save({"x": argparse.Namespace(a=1)}, path)
    assert main(["sample", str(path)]) == 2
    assert one_error_line(capsys) == (f"megacpp-lab: error: checkpoint {path} is corrupt or not a checkpoint "
                                      "(--debug shows the traceback)")  # fmt: skip


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["--prompt", ""], "--prompt must not be empty"),
        (["--max-new-tokens", "0"], "--max-new-tokens must be >= 1, got 0"),
        (["--seed", "-1"], "--seed must be >= 0 and < 2**64, got -1"),
        (["--prompt-file", "EMPTY"], "--prompt-file EMPTY is empty"),
        (["--prompt-file", "MISSING"], "--prompt-file MISSING is not a file"),
    ],
)
def test_sample_refuses_an_empty_prompt_or_no_tokens_naming_the_flag(tiny_run, tmp_path, capsys, argv, expected):
    (tmp_path / "EMPTY").write_bytes(b"")
    argv = [str(tmp_path / a) if a in ("EMPTY", "MISSING") else a for a in argv]
    assert main(["sample", str(tiny_run / "checkpoint.pt"), *argv]) == 2
    assert expected.replace("EMPTY", str(tmp_path / "EMPTY")).replace("MISSING", str(tmp_path / "MISSING")) in \
        one_error_line(capsys)  # fmt: skip


def test_sample_prompt_file_passes_bytes_the_shell_cannot(tiny_run, tmp_path, capsys):
    """A prompt holding invalid UTF-8, read from --prompt-file as bytes: the byte is a byte token and prints as
    U+FFFD; the valid part samples as it does from --prompt. --prompt and --prompt-file exclude each other."""
    from megacpp_lab.model.decode import sample_text

    checkpoint = tiny_run / "checkpoint.pt"
    (tmp_path / "valid.cpp").write_bytes(b"int main(")
    assert greedy(capsys, checkpoint, "--prompt-file", str(tmp_path / "valid.cpp")) == \
        greedy(capsys, checkpoint, "--prompt", "int main(")  # fmt: skip
    (tmp_path / "prompt.cpp").write_bytes(b"int f\xff(")
    text = greedy(capsys, checkpoint, "--prompt-file", str(tmp_path / "prompt.cpp"))
    assert text.startswith("int f\ufffd(")
    assert text == sample_text(checkpoint, b"int f\xff(", max_new_tokens=4, temperature=0)[0] + "\n"
    with pytest.raises(SystemExit) as exit_:
        main(["sample", str(checkpoint), "--prompt", "x", "--prompt-file", str(tmp_path / "prompt.cpp")])
    assert exit_.value.code == 2
    assert "argument --prompt-file: not allowed with argument --prompt" in capsys.readouterr().err


def test_cli_resources_prints_the_kernels_table_and_writes_its_json(tmp_path, capsys):
    """`megacpp-lab resources ssd`: Mamba-2's four kernels compiled for sm_90 (a subprocess without the interpreter),
    one table line each, and the JSON with the commit stamp."""
    out = tmp_path / "resources.json"
    assert main(["resources", "ssd", "--json", str(out)]) == 0
    table = capsys.readouterr().out
    for kernel in ("_ssd_fwd_state_kernel", "_ssd_fwd_output_kernel", "_ssd_bwd_state_kernel", "_ssd_bwd_chunk_kernel"):
        assert f"ssd           {kernel}" in table, table
    saved = json.loads(out.read_text())
    assert saved["arch"] == "sm_90" and {"commit", "torch", "triton"} <= saved.keys()
    assert [r["kernel"] for r in saved["subjects"]["ssd"]][-1] == "_ssd_bwd_chunk_kernel"


def test_cli_resources_fails_closed_on_an_unknown_subject(capsys):
    assert main(["resources", "mamba9"]) == 2
    assert "['mamba9'] unknown" in one_error_line(capsys)


@pytest.mark.parametrize("seed", [-1, 2**64, 1.5, True])
def test_sample_text_refuses_a_seed_torch_would_wrap_or_cast(seed):
    """torch.Generator.manual_seed takes -1 as 2**64 - 1 (two seeds, the same samples): the library refuses it before
    reading any checkpoint, as it refuses a float or a bool."""
    from megacpp_lab.model.decode import sample_text

    with pytest.raises(ValueError, match=r"seed must be an int in \[0, 2\*\*64\)"):
        sample_text("no-such-checkpoint", "int", seed=seed)
