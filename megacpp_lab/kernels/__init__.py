"""Triton kernels beside their torch references, one file per kernel family."""

import os

# read once at import, for every kernel module: kernels run under the Triton interpreter (CPU tests)
TRITON_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
