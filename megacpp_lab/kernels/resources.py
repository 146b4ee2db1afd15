"""What each of the lab's Triton kernels asks of a Hopper SM, read on a machine without a GPU.

`compile_launches(run)` calls `run()` with every @triton.jit launch compiled for sm_90 and not launched: Triton's
own compiler lowers the kernel with the arguments the launcher gave it (their dtypes, alignments and constexprs:
the same specialisation a GPU launch compiles), and ptxas (bundled in the Triton wheel) assembles it with `-v`,
whose report gives the registers per thread, the bytes spilled to local memory and the stack frame (the kernel's
own entry in the report, not a helper function's); cuobjdump's SASS gives the instruction mix (Hopper's
asynchronous warpgroup MMAs against the older mma.sync, the local-memory spill instructions, barriers, warp
shuffles, global and shared loads and stores: static counts, not executions). Shared memory is ptxas's static part plus Triton's dynamic part.
From those and Hopper's limits, `programs_per_sm`: how many of the kernel's programs one SM holds at once.

What it is for: a kernel that spills (spill stores and loads in its inner loops are local-memory traffic the
kernel's arithmetic never asked for), or holds one program per SM, is found and restructured without GPU time;
whether the change is faster is still for `bench` on the GPU to say. The figures are this process's Triton and
ptxas (the receipts' `triton` names the GPU machine's, which may allocate a few registers differently).

The launchers run on CPU tensors inside `offline_compile()` (kernels.launchable accepts the CPU there); the
interpreter must be off when the kernel modules are imported (TRITON_INTERPRET=1 makes every kernel an
interpreted function). What is compiled, at which shapes, and the subprocess that keeps the interpreter off:
bench/resources.py (`megacpp-lab resources`).
"""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from typing import Any

import triton

from megacpp_lab.kernels import OFFLINE_COMPILE

__all__ = ["ARCH", "HOPPER", "SASS_CLASSES", "KernelResources", "compile_launches", "offline_compile", "sass_mix"]

# an H100 / H200 SM (compute capability 9.0): registers (four sub-partitions of 16 K, allocated per warp in units of
# 256), shared memory (228 KiB, of which a block may use 227, and the driver reserves 1 KiB per resident block) and
# resident threads and blocks
HOPPER = {"regs_per_sm": 65536, "reg_partitions": 4, "reg_alloc_unit": 256, "smem_per_sm": 233472,
          "smem_per_block": 232448, "smem_reserved_per_block": 1024, "threads_per_sm": 2048, "blocks_per_sm": 32}  # fmt: skip
ARCH = 90


@dataclass(frozen=True)
class KernelResources:
    """One compiled kernel: per thread its registers, spill stores and loads and stack frame (bytes); per program
    its shared memory; its warps and stages, and the constexprs it was compiled with."""

    kernel: str
    regs: int
    spill_store_bytes: int
    spill_load_bytes: int
    stack_bytes: int
    shared_bytes: int
    num_warps: int
    num_stages: int
    constexprs: dict[str, str]
    sass: dict[str, int]  # SASS_CLASSES -> instructions in the cubin (static), and "total"

    @property
    def spills(self) -> bool:
        return self.spill_store_bytes > 0 or self.spill_load_bytes > 0

    @property
    def programs_per_sm(self) -> int:
        """Programs one SM holds at once, the least of what its registers, shared memory, threads and block slots
        allow; 0 when one program needs more shared memory than a block may have (it cannot launch). Registers
        are allocated per warp in units of 256, within each of the four sub-partitions the warps are spread over."""
        threads = 32 * self.num_warps
        unit = HOPPER["reg_alloc_unit"]
        regs_per_warp = -(-self.regs * 32 // unit) * unit
        warps = HOPPER["regs_per_sm"] // HOPPER["reg_partitions"] // regs_per_warp * HOPPER["reg_partitions"]
        by_regs = warps // self.num_warps
        if self.shared_bytes > HOPPER["smem_per_block"]:
            return 0
        by_smem = (HOPPER["smem_per_sm"] // (self.shared_bytes + HOPPER["smem_reserved_per_block"])
                   if self.shared_bytes else HOPPER["blocks_per_sm"])  # fmt: skip
        return min(by_regs, by_smem, HOPPER["threads_per_sm"] // threads, HOPPER["blocks_per_sm"])

    def as_row(self) -> dict[str, Any]:
        return asdict(self) | {"spills": self.spills, "programs_per_sm": self.programs_per_sm}


@contextlib.contextmanager
def offline_compile() -> Iterator[None]:
    """Within: the launchers accept CPU tensors (kernels.launchable), as they do under the interpreter."""
    token = OFFLINE_COMPILE.set(True)
    try:
        yield
    finally:
        OFFLINE_COMPILE.reset(token)


# SASS opcode (before its first '.') -> the class the report counts
SASS_CLASSES = {"HGMMA": "wgmma", "HMMA": "mma", "LDL": "spill_load", "STL": "spill_store", "BAR": "barrier",
                "SHFL": "shuffle", "LDG": "global_load", "STG": "global_store", "LDS": "shared_load",
                "STS": "shared_store", "MUFU": "special_function"}  # fmt: skip
_SASS_OP = re.compile(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P[T0-9]+\s+)?([A-Z][A-Z0-9_]*)")
_PTXAS_USED = re.compile(r"Used (\d+) registers")
_PTXAS_SPILL = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")
_PTXAS_STACK = re.compile(r"(\d+) bytes stack frame")
_PTXAS_SMEM = re.compile(r"(\d+) bytes smem")


def _ptxas_report(ptx: str, name: str, fp_fusion: bool, ptx_options: str | None) -> dict[str, int]:
    """ptxas -v on the kernel's PTX, with the flags Triton assembles it with (its line info, fmad and register
    allocation flags, and any TRITON_PTXAS_OPTIONS), parsed from the entry `name`'s own part of the report."""
    from triton.backends.nvidia.compiler import get_ptxas, sm_arch_from_capability

    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "kernel.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        cmd = [get_ptxas(ARCH).path, "-lineinfo", *([] if fp_fusion else ["--fmad=false"]), "-v",
               "--regAllocOptLevel=2", *(ptx_options.split() if ptx_options else []),
               f"--gpu-name={sm_arch_from_capability(ARCH)}", src, "-o", src + ".o"]  # fmt: skip
        log = subprocess.run(cmd, check=True, capture_output=True, text=True).stderr
    head = f"Compiling entry function '{name}'"
    if head not in log:
        raise RuntimeError(f"ptxas -v printed no report for the entry {name!r}:\n{log}")
    log = log.split(head, 1)[1].split("Compiling entry function", 1)[0]  # this entry's lines only
    found = {"regs": _PTXAS_USED.search(log), "spill": _PTXAS_SPILL.search(log), "stack": _PTXAS_STACK.search(log)}
    if found["regs"] is None or found["spill"] is None or found["stack"] is None:
        raise RuntimeError(f"ptxas -v printed no register and spill report for {name!r}:\n{log}")
    smem = _PTXAS_SMEM.search(log)
    return {"regs": int(found["regs"][1]), "spill_store_bytes": int(found["spill"][1]),
            "spill_load_bytes": int(found["spill"][2]), "stack_bytes": int(found["stack"][1]),
            "static_smem": int(smem[1]) if smem else 0}  # fmt: skip


def sass_mix(cubin: bytes) -> dict[str, int]:
    """The cubin's SASS instructions by class (SASS_CLASSES; every class present, 0 where none), and "total"."""
    from triton.backends.nvidia.compiler import get_ptxas

    cuobjdump = os.path.join(os.path.dirname(get_ptxas(ARCH).path), "cuobjdump")
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "kernel.cubin")
        with open(path, "wb") as f:
            f.write(cubin)
        sass = subprocess.run([cuobjdump, "-sass", path], check=True, capture_output=True, text=True).stdout
    ops = _SASS_OP.findall(sass)
    if not ops:
        raise RuntimeError(f"cuobjdump -sass printed no instructions:\n{sass[:2000]}")
    counts = dict.fromkeys(SASS_CLASSES.values(), 0)
    for op in ops:
        if op in SASS_CLASSES:
            counts[SASS_CLASSES[op]] += 1
    return counts | {"total": len(ops)}


def compile_launches(run: Callable[[], Any]) -> list[KernelResources]:
    """Call run() with each @triton.jit launch compiled for sm_90 and reported, not launched (an autotuned kernel:
    each of its configs). One row per distinct compilation, in launch order. The interpreter must be off (module
    docstring); run() executes inside offline_compile(), on whatever device its tensors are on."""
    import megacpp_lab.kernels as kernels

    if kernels.TRITON_INTERPRET:
        raise RuntimeError("compile_launches needs TRITON_INTERPRET unset when the kernels are imported (under the "
                           "interpreter no kernel is compiled); report() runs it in a subprocess without it")  # fmt: skip
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.autotuner import Autotuner
    from triton.runtime.jit import JITFunction, create_function_from_signature

    target = GPUTarget("cuda", ARCH, 32)
    backend = make_backend(target)
    rows: dict[tuple[str, str, str], KernelResources] = {}

    def compile_run(self: JITFunction, *args: Any, grid: Any, warmup: bool, **kwargs: Any) -> None:  # noqa: ARG001
        bound, specialization, options = create_function_from_signature(self.signature, self.params, backend)(
            *args, **kwargs)  # fmt: skip
        options, signature, constexprs, attrs = self._pack_args(backend, kwargs, bound, specialization, options)
        key = (f"{self.fn.__module__}.{self.fn.__qualname__}", repr(specialization), repr(options))
        if key in rows:
            return
        compiled = triton.compile(ASTSource(self, signature, constexprs, attrs), target=target, options=options.__dict__)
        ptxas = _ptxas_report(compiled.asm["ptx"], compiled.metadata.name, options.enable_fp_fusion, options.ptx_options)
        names = [p.name for p in self.params]
        shown = {names[path[0]]: _constexpr_text(value) for path, value in constexprs.items() if len(path) == 1}
        rows[key] = KernelResources(
            kernel=self.fn.__name__, regs=ptxas["regs"], spill_store_bytes=ptxas["spill_store_bytes"],
            spill_load_bytes=ptxas["spill_load_bytes"], stack_bytes=ptxas["stack_bytes"],
            shared_bytes=ptxas["static_smem"] + int(compiled.metadata.shared), num_warps=options.num_warps,
            num_stages=options.num_stages, constexprs={k: v for k, v in shown.items() if v},
            sass=sass_mix(compiled.asm["cubin"]),
        )  # fmt: skip

    def autotuned_run(self: Autotuner, *args: Any, **kwargs: Any) -> None:
        for config in self.configs:
            self.fn.run(*args, **kwargs, **config.all_kwargs())

    saved = JITFunction.run, Autotuner.run
    JITFunction.run, Autotuner.run = compile_run, autotuned_run
    try:
        with offline_compile():
            run()
    finally:
        JITFunction.run, Autotuner.run = saved
    return list(rows.values())


def _constexpr_text(value: Any) -> str:
    """A constexpr worth showing (ints, bools, dtypes), as text; '' for the rest (functions, None)."""
    if isinstance(value, bool | int):
        return str(value)
    text = str(value)
    return text if text.startswith(("fp", "bf", "int", "uint")) or "float" in text or "dtype" in text else ""
