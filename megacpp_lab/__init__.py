"""megacpp-lab: a workbench for the memory and attention subsystems of a hybrid C++ code LM."""

import functools
import hashlib
import os
import sys
from pathlib import Path

# Kineto (torch.profiler) logs a `USDT: ... profiler_start/stop` line to stderr at every profile on CPU builds:
# blocks of them buried notebook outputs and bench logs. Level 6 is above all of its log levels; a user's own
# KINETO_LOG_LEVEL wins. Read when the first profile starts, so setting it here, at import, is enough.
os.environ.setdefault("KINETO_LOG_LEVEL", "6")

__version__ = "0.1.0"

# the environment variable torch.compiler.config.cache_key_tag reads at torch's import
COMPILE_CACHE_TAG_ENV = "TORCH_COMPILE_CACHE_KEY_TAG"


@functools.cache
def source_digest() -> str:
    """sha256 (hex) of the lab's Python source: every megacpp_lab/**/*.py, its path and its bytes, read once a
    process (about 3 ms). A compiled graph of older code is not this code's: the saved graphs' and precompile's key
    (model.parallelize.model_fingerprint) and torch's compile caches (compile_cache_tag) include it."""
    package = Path(__file__).resolve().parent
    h = hashlib.sha256()
    for path in sorted(package.rglob("*.py")):
        h.update(str(path.relative_to(package)).encode())
        h.update(path.read_bytes())
    return h.hexdigest()


def compile_cache_tag() -> str:
    """This source's part of torch's compile cache keys: `megacpp_lab-<source_digest()[:16]>`.

    Why: inductor's FX-graph and AOTAutograd caches key a graph by its operators, not by the Python behind them.
    A custom op's autograd formula (kernels/*.py: register_autograd) and a custom autograd.Function's backward
    (allowed in the cache by model.parallelize) are Python the key never reads; after an edit, a graph whose
    forward is unchanged was served from the cache with the old backward (on an H100 at 01de276: a backward op
    called without the argument its new schema requires). The tag goes into every key (torch's cache_key_tag,
    torch >= 2.7); a tag the user set stays, with this one after a '+'."""
    return f"megacpp_lab-{source_digest()[:16]}"


def _tag_compile_caches() -> None:
    """Put compile_cache_tag() in torch's cache_key_tag: through the environment when torch.compiler.config is not
    imported yet (it reads COMPILE_CACHE_TAG_ENV then; child processes inherit it), and on the config if it is."""
    tag = compile_cache_tag()
    config = sys.modules.get("torch.compiler.config")
    current = getattr(config, "cache_key_tag", None) if config is not None else os.environ.get(COMPILE_CACHE_TAG_ENV)
    if current is not None and tag in current.split("+"):
        return
    tagged = f"{current}+{tag}" if current else tag
    os.environ[COMPILE_CACHE_TAG_ENV] = tagged
    if config is not None and hasattr(config, "cache_key_tag"):
        config.cache_key_tag = tagged


_tag_compile_caches()
