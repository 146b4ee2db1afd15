"""megacpp-lab: a workbench for the memory and attention subsystems of a hybrid C++ code LM."""

import os

# Kineto (torch.profiler) logs a `USDT: ... profiler_start/stop` line to stderr at every profile on CPU builds:
# blocks of them buried notebook outputs and bench logs. Level 6 is above all of its log levels; a user's own
# KINETO_LOG_LEVEL wins. Read when the first profile starts, so setting it here, at import, is enough.
os.environ.setdefault("KINETO_LOG_LEVEL", "6")

__version__ = "0.1.0"

# the lab's source in every torch compile cache key (source_key.py says why), set before any compile can run
from megacpp_lab.source_key import tag_compile_caches  # noqa: E402

tag_compile_caches()
