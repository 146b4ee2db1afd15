"""Re-execute notebooks in place, the way their saved outputs are meant to be made.

    .venv/bin/python scripts/execute_notebooks.py notebooks/03_m2rnn.ipynb [more.ipynb ...] [--timeout 1200]

Each notebook runs top to bottom in a fresh kernel (its own directory as the working directory), then its
saved outputs are tidied so that what a reader sees is true without a live kernel:

- tqdm's notebook bars are widgets: their saved text fallback is the bar as first drawn ("0/3"), while the
  final state lives in the notebook's widget metadata. Each bar's fallback is rewritten from that final
  state ("runs: 100% 3/3 [00:11<00:00, 3.71s/run]"), so GitHub, nbviewer and `git diff` show the finished bar.

Kineto's `USDT` profiler lines are silenced by the library itself (megacpp_lab/__init__.py).
"""

from __future__ import annotations

import argparse
import html
import re
import sys
import time
from pathlib import Path
from typing import Any

WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"
WIDGET_STATE = "application/vnd.jupyter.widget-state+json"


def _text(value: str) -> str:
    return re.sub(r"\s+", " ", html.unescape(re.sub(r"<[^>]+>", "", value)).replace("\u2007", " ")).strip()


def settle_progress_bars(nb: Any) -> int:
    """Rewrite the text fallback of every saved tqdm bar from its final widget state; returns how many."""
    state = nb.metadata.get("widgets", {}).get(WIDGET_STATE, {}).get("state", {})
    settled = 0
    for cell in nb.cells:
        for out in cell.get("outputs", []):
            view = out.get("data", {}).get(WIDGET_VIEW)
            box = state.get(view["model_id"]) if view else None
            if not box or box.get("model_name") != "HBoxModel":
                continue
            parts = [state.get(child.removeprefix("IPY_MODEL_"), {}) for child in box["state"].get("children", [])]
            texts = [_text(p["state"].get("value", "")) for p in parts if p.get("model_name") == "HTMLModel"]
            bars = [p["state"] for p in parts if p.get("model_name") in ("FloatProgressModel", "IntProgressModel")]
            if len(texts) != 2 or len(bars) != 1:
                continue
            done = bars[0].get("max") and bars[0].get("value", 0) >= bars[0]["max"]
            bar = "█" * 10 if done else "▌"
            out["data"]["text/plain"] = f"{texts[0]}|{bar}| {texts[1]}".strip()
            settled += 1
    return settled


def execute(path: Path, timeout: int) -> None:
    import nbformat
    from nbclient import NotebookClient

    nb = nbformat.read(path, as_version=4)
    start = time.perf_counter()
    NotebookClient(nb, timeout=timeout, kernel_name="python3", resources={"metadata": {"path": str(path.parent)}}).execute()
    settled = settle_progress_bars(nb)
    nbformat.write(nb, path)
    print(f"{path}: executed in {time.perf_counter() - start:.0f} s, {settled} progress bars settled", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("notebooks", nargs="+", type=Path)
    parser.add_argument("--timeout", type=int, default=1200, help="seconds per cell (default: 1200)")
    args = parser.parse_args()
    for path in args.notebooks:
        if path.suffix != ".ipynb" or not path.is_file():
            raise SystemExit(f"execute_notebooks: {path} is not a notebook file")
        execute(path, args.timeout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
