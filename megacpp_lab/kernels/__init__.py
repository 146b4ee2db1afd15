"""Triton kernels beside their torch references, one file per kernel family."""

import contextvars
import inspect
import os
import sys
import warnings

import torch
import triton

__all__ = ["AUTOTUNE_CACHE", "INTERPRETED", "OFFLINE_COMPILE", "TRITON_INTERPRET", "launchable", "warn_at_caller"]

# read once at import, for every kernel module: kernels run under the Triton interpreter (CPU tests)
TRITON_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
# the same inside a @triton.jit function (a constexpr global: the branch it guards is compiled out)
INTERPRETED = triton.language.constexpr(TRITON_INTERPRET)
# set inside kernels.resources.offline_compile(): every launch is compiled for sm_90 and none runs, so the launchers
# may take CPU tensors (their shapes and dtypes are all the compiler reads)
OFFLINE_COMPILE: contextvars.ContextVar[bool] = contextvars.ContextVar("megacpp_offline_compile", default=False)


def launchable(device: torch.device) -> bool:
    """Whether the lab's Triton launchers may take tensors on `device`: CUDA; the CPU under TRITON_INTERPRET=1 (the
    CPU tests); the CPU inside kernels.resources.offline_compile() (compiled for a Hopper, never launched)."""
    return device.type == "cuda" or (device.type == "cpu" and (TRITON_INTERPRET or OFFLINE_COMPILE.get()))

# the lab's @triton.autotune'd kernels keep their autotuning results on disk, in Triton's cache directory
# (TRITON_CACHE_DIR), keyed by the kernel's source, its configs and the autotune key: a new process, a kernel
# restart in a notebook, benchmarks nothing it has benchmarked before. Triton >= 3.2 has the switch.
AUTOTUNE_CACHE = {"cache_results": True} if "cache_results" in inspect.signature(triton.autotune).parameters else {}

# frames in these trees are the library's own (and torch's module-call plumbing), never the user's line
_LIBRARY_DIRS = (os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep,
                 os.path.dirname(os.path.abspath(torch.__file__)) + os.sep)  # fmt: skip


def warn_at_caller(message: str, category: type[Warning] = RuntimeWarning) -> None:
    """warnings.warn attributed to the first frame outside megacpp_lab and torch: the caller's own line,
    however deep in the library (layers, autograd functions, compiled wrappers) the warning was raised."""
    level, frame = 1, sys._getframe(0)
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(_LIBRARY_DIRS):
        level, frame = level + 1, frame.f_back
    warnings.warn(message, category, stacklevel=level)
