"""The lab's source as a key: what a compiled graph of this code depends on beyond torch's own keys.

source_digest() hashes the package's Python source; compile_cache_tag() is its part of torch's compile cache keys,
put there by tag_compile_caches() when `megacpp_lab` is imported (its __init__ calls it, before any compile can run);
model.parallelize.model_fingerprint keys the saved graphs and precompile's manifest by the digest. Imports nothing
of ours: every layer sits above it."""

from __future__ import annotations

import hashlib
import os
import sys
from pathlib import Path

__all__ = ["COMPILE_CACHE_TAG_ENV", "TAG_PREFIX", "compile_cache_tag", "source_digest", "tag_compile_caches"]

# the environment variable torch.compiler.config.cache_key_tag reads at torch's import
COMPILE_CACHE_TAG_ENV = "TORCH_COMPILE_CACHE_KEY_TAG"


def source_digest() -> str:
    """sha256 (hex) of the lab's Python source as it is on disk now: every megacpp_lab/**/*.py, its path and its
    bytes, each length-prefixed (about 3 ms). A compiled graph of older code is not this code's: the saved graphs'
    and precompile's key (model.parallelize.model_fingerprint, which calls this each time, so a kernel edited in a
    running notebook is seen) and torch's compile caches (compile_cache_tag, taken once at import) include it."""
    package = Path(__file__).resolve().parent  # megacpp_lab/
    h = hashlib.sha256()
    for path in sorted(package.rglob("*.py")):
        for part in (str(path.relative_to(package)).encode(), path.read_bytes()):
            h.update(len(part).to_bytes(8, "little"))
            h.update(part)
    return h.hexdigest()


TAG_PREFIX = "megacpp_lab-"


def compile_cache_tag() -> str:
    """This source's part of torch's compile cache keys: `megacpp_lab-<source_digest()[:16]>`.

    Why: inductor's FX-graph and AOTAutograd caches key a graph by its operators, not by the Python behind them.
    A custom op's autograd formula (kernels/*.py: register_autograd) and a custom autograd.Function's backward
    (allowed in the cache by model.parallelize) are Python the key never reads; after an edit, a graph whose
    forward is unchanged was served from the cache with the old backward (on an H100 at 01de276: a backward op
    called without the argument its new schema requires). The cost: any edit of the package's .py files, a
    docstring's too, makes the next compile cold (inductor's caches, AOTAutograd's, dynamo's automatic-dynamic
    profiles all miss once)."""
    return f"{TAG_PREFIX}{source_digest()[:16]}"


def tag_compile_caches() -> None:
    """Put compile_cache_tag() in torch's cache_key_tag (torch >= 2.7): through the environment when
    torch.compiler.config is not imported yet (it reads COMPILE_CACHE_TAG_ENV then; child processes inherit it), and
    on the config if it is. A tag the user set before importing the lab stays, before a '+'; a `megacpp_lab-` part
    already there (a parent process's, of this tree or another) is replaced, not added to. A tag set after the
    import replaces the lab's: set it before. Idempotent."""
    tag = compile_cache_tag()
    config = sys.modules.get("torch.compiler.config")
    has_tag = config is not None and hasattr(config, "cache_key_tag")
    current = config.cache_key_tag if has_tag else os.environ.get(COMPILE_CACHE_TAG_ENV, "")
    kept = [part for part in current.split("+") if part and not part.startswith(TAG_PREFIX)]
    tagged = "+".join([*kept, tag])
    os.environ[COMPILE_CACHE_TAG_ENV] = tagged
    if has_tag:
        config.cache_key_tag = tagged
