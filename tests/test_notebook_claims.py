"""The saved notebooks state only what they compute, and their outputs are clean.

- No measured figure is typed into a markdown cell: a number with a unit of time, memory, bandwidth, rate or
  share ("3.2 ms", "18 GiB", "62%") or a ratio ("1.85x") in prose. The code cell beside it prints the figure
  from a receipt or its own measurement. Allowed: code spans and math (formulas, flags, shapes), block quotes
  (a source quoted as a source), and a sentence that states a bar or a limit ("at most 60 ms", "its bar:
  1.85x"), which is a definition, not a measurement.
- No saved progress bar is stuck at its first state, no Kineto `USDT` line is left in an output, no output
  shows a receipt stamped with a `-dirty` commit, and no table is cut with "...".

Re-execute a notebook with `scripts/execute_notebooks.py`, which leaves its bars settled.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

NOTEBOOKS = sorted((Path(__file__).resolve().parent.parent / "notebooks").glob("*.ipynb"))

_UNIT = r"(?:ms|µs|us|s|min|h|GiB|MiB|KiB|GB|MB|KB|TB/s|GB/s|MB/s|tokens/s|tok/s|TFLOP/s|TFLOPS|%)"
_FIGURE = re.compile(r"(?<![\w.=/^-])\d+(?:[.,]\d+)*\s?" + _UNIT + r"(?![\w/])")
_RATIO = re.compile(r"(?<![\w.=/^-])\d+(?:\.\d+)?[x×](?![\w/])")
_CODE = re.compile(r"```.*?```|`[^`\n]*`|\$\$.*?\$\$|\$[^$\n]*\$", re.S)
_LIMIT = re.compile(r"\b(?:bar|bars|at least|at most|threshold|limit|no more than|no less than|within)\b|>=|<=|≥|≤",
                    re.I)  # fmt: skip


def typed_figures(markdown: str) -> list[str]:
    """The measured figures a markdown text types outside code, math, block quotes and bar statements."""
    lines = [line for line in _CODE.sub(" ", markdown).splitlines() if not line.lstrip().startswith(">")]
    found = []
    # a sentence may wrap over lines; a blank line, a heading or a list item starts a new one
    for block in re.split(r"\n\s*\n|\n(?=\s*(?:[-*+]|\d+\.|#+|\|)\s)", "\n".join(lines)):
        for sentence in re.split(r"(?<=[.;!?])\s+", " ".join(block.split())):
            if _LIMIT.search(sentence):
                continue
            found += [f"{m.group(0)!r} in {sentence!r}" for m in (*_FIGURE.finditer(sentence), *_RATIO.finditer(sentence))]
    return found


def test_the_detector_flags_measured_figures_and_passes_definitions():
    assert typed_figures("The fused kernel runs in 3.2 ms, 2.5x faster.") and typed_figures("Peak: 18 GiB (62% of it).")
    assert typed_figures("The step takes about\n40 s on this machine.")  # wrapped over two lines
    for fine in ("Its bar: the 2-GPU throughput at least\n1.85x the 1-GPU throughput.",
                 "Run `bench loss --small` at `T=4096`; the kernel is `3.2 ms` in the receipt.",
                 "> the seeds measured 20% of backward throughput", "the state is 64 x 16, B=4 x T=4096",
                 "$y = 6 \\times N$ FLOPs per token, each card holds `80 GB`", "within 1% of the reference"):  # fmt: skip
        assert not typed_figures(fine), (fine, typed_figures(fine))


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_markdown_types_no_measured_figure(path: Path):
    cells = json.loads(path.read_text())["cells"]
    found = [f"cell {i}: {hit}" for i, cell in enumerate(cells) if cell["cell_type"] == "markdown"
             for hit in typed_figures("".join(cell["source"]))]  # fmt: skip
    assert not found, "\n".join(found)


def _output_texts(cell: dict) -> list[str]:
    texts = []
    for out in cell.get("outputs", []):
        if "text" in out:
            texts.append("".join(out["text"]))
        for key in ("text/plain", "text/html"):
            if key in out.get("data", {}):
                texts.append("".join(out["data"][key]))
    return texts


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_saved_outputs_are_clean(path: Path):
    nb = json.loads(path.read_text())
    stuck, noise, dirty, cut = [], [], [], []
    for i, cell in enumerate(nb["cells"]):
        for out in cell.get("outputs", []):
            plain = "".join(out.get("data", {}).get("text/plain", ""))
            if "application/vnd.jupyter.widget-view+json" in out.get("data", {}) and re.search(r"\b0/\d+\b", plain):
                stuck.append(f"cell {i}: {plain[:80]}")
            html = "".join(out.get("data", {}).get("text/html", ""))
            # a pandas table cut by its display options: "..." rows, columns or cells
            if "<table" in html and ("<td>...</td>" in html or re.search(r"\.\.\.\s|\[\d+ rows x \d+ columns\]", plain)):
                cut.append(f"cell {i}: {next((ln for ln in plain.splitlines() if '...' in ln), plain[:80])[:100]}")
        for text in _output_texts(cell):
            noise += [f"cell {i}: {line[:80]}" for line in text.splitlines() if line.startswith("USDT:")]
            dirty += [f"cell {i}: {m}" for m in re.findall(r"\b[0-9a-f]{7,40}-dirty\b", text)]
    assert not stuck, f"progress bars saved at their first state (re-execute with scripts/execute_notebooks.py): {stuck}"
    assert not noise, f"Kineto USDT lines in saved outputs: {noise[:5]}"
    assert not dirty, f"receipts stamped with a -dirty commit shown: {dirty[:5]}"
    assert not cut, f"tables cut with '...' (print them whole): {cut[:5]}"
