"""What each of the lab's Triton kernels asks of a Hopper SM, read on a machine without a GPU.

`compile_launches(run)` calls `run()` with every @triton.jit launch compiled for sm_90 and not launched: Triton's
own compiler lowers the kernel with the arguments the launcher gave it (their dtypes, alignments and constexprs:
the same specialisation a GPU launch compiles). The cubin it produces records what the driver will load: registers
per thread, stack frame and static shared memory (cuobjdump, bundled in the Triton wheel with ptxas); ptxas -v on
the same PTX, with Triton's flags, adds the bytes spilled to local memory (the kernel's own entry in the report, not
a helper function's); cuobjdump's SASS gives the instruction mix (Hopper's
asynchronous warpgroup MMAs against the older mma.sync, the local-memory spill instructions, barriers, warp
shuffles, global and shared loads and stores: static counts, not executions). Shared memory is what the kernel
asks for: ptxas's static part plus Triton's dynamic part (the driver's reserved 1 KiB a block is counted in
`programs_per_sm`). From those and Hopper's limits, `programs_per_sm`: how many of the kernel's programs one SM
holds at once.

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
import functools
import os
import re
import subprocess
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from typing import Any

import torch
import triton

from megacpp_lab.kernels import OFFLINE_COMPILE

__all__ = ["ARCH", "HOPPER", "SASS_CLASSES", "KernelResources", "compile_launches", "cubin_usage", "offline_compile",
           "ptxas_spills", "sass_mix"]

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
_PTXAS_SPILL = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")
_PTXAS_SMEM = re.compile(r"(\d+) bytes smem")
_CUBIN_USAGE = re.compile(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)")
# the PTX target Triton assembles an sm_90 kernel for (the 'a' features: wgmma, setmaxnreg)
PTXAS_ARCH = f"sm_{ARCH}a"


def _ptxas_path() -> str:
    """The ptxas Triton assembles sm_90 kernels with (its get_ptxas: by Triton 3.9 the wheel's newer
    `ptxas-blackwell`, whose PTX version Triton emits; older Triton takes no arch; the oldest name it
    _path_to_binary). TRITON_PTXAS_PATH is honoured as Triton honours it."""
    from triton.backends.nvidia import compiler as nvidia

    if hasattr(nvidia, "get_ptxas"):
        try:
            return nvidia.get_ptxas(ARCH).path
        except TypeError:  # a Triton whose get_ptxas takes no arch
            return nvidia.get_ptxas().path
    return nvidia._path_to_binary("ptxas")[0]


def _tool_folders() -> list[str]:
    """Where CUDA binaries may be, in order: beside _ptxas_path's ptxas, Triton's wheel (backends/nvidia/bin), and
    torch's (bin/ and _inductor/bin/ of a CUDA build, where inductor points TRITON_PTXAS_PATH before it compiles).
    Why torch's: on the last two H100 boxes (Triton 3.6, torch 2.11+cu130) Triton wrote PTX 9.0, which neither
    ptxas of its wheel reads (8.7, 8.8), and the driver-comparison tests failed for want of a ptxas that does. A
    newer ptxas from torch's CUDA 13.0 build is a guess at where that PTX version came from, not yet confirmed on
    such a box: _ptxas_path (which honours TRITON_PTXAS_PATH) named the wheel's there."""
    from triton.backends import nvidia

    torch_root = os.path.dirname(torch.__file__)
    folders = [os.path.dirname(_ptxas_path()), os.path.join(os.path.dirname(nvidia.__file__), "bin"),
               os.path.join(torch_root, "bin"), os.path.join(torch_root, "_inductor", "bin")]  # fmt: skip
    return list(dict.fromkeys(folders))


def _nvidia_tool(name: str) -> str:
    """A CUDA binary (cuobjdump): TRITON_<NAME>_PATH's as Triton honours it, else the first of _tool_folders that
    holds it; ptxas itself: ptxas_for."""
    folders = _tool_folders()
    for path in [os.environ.get(f"TRITON_{name.upper()}_PATH", "")] + [os.path.join(f, name) for f in folders]:
        if path and os.path.isfile(path):
            return path
    raise RuntimeError(f"kernel resources need {name}: not in {', '.join(folders)} (Triton's wheel ships it in "
                       f"backends/nvidia/bin)")  # fmt: skip


_PTX_VERSION = re.compile(r"^\s*\.version\s+(\d+)\.(\d+)", re.MULTILINE)
_CUDA_RELEASE = re.compile(r"cuda_(\d+)\.(\d+)")


@functools.lru_cache(maxsize=None)
def _ptx_isa_of(ptxas: str) -> int:
    """The newest PTX ISA version (as 10 * major + minor) the ptxas at `ptxas` reads, by Triton's own table
    (ptx_get_version: CUDA 12.8's reads 8.7, 13.0's 9.0)."""
    from triton.backends.nvidia.compiler import ptx_get_version

    out = subprocess.run([ptxas, "--version"], capture_output=True, text=True).stdout
    found = _CUDA_RELEASE.search(out)
    if found is None:
        raise RuntimeError(f"{ptxas} --version names no CUDA release:\n{out}")
    return ptx_get_version(f"{found[1]}.{found[2]}")


def ptxas_for(ptx: str) -> str:
    """A ptxas that reads this PTX's `.version`: _ptxas_path's, else TRITON_PTXAS_PATH's, else `ptxas` or
    `ptxas-blackwell` in one of _tool_folders (Triton's wheel, torch's), else TRITON_PTXAS_BLACKWELL_PATH's. Triton
    may emit a newer PTX version than the ptxas its get_ptxas names for sm_90 reads (on the GPU box, Triton 3.6
    emitted PTX 9.0 for sm_90 and its `ptxas` was CUDA 12.8's, which reads 8.7 at most); fails closed, naming each
    candidate's version, when none reads it."""
    found = _PTX_VERSION.search(ptx)
    if found is None:
        raise RuntimeError("the PTX has no .version directive")
    need = 10 * int(found[1]) + int(found[2])
    candidates = [_ptxas_path(), os.environ.get("TRITON_PTXAS_PATH", ""),
                  *(os.path.join(f, n) for f in _tool_folders() for n in ("ptxas", "ptxas-blackwell")),
                  os.environ.get("TRITON_PTXAS_BLACKWELL_PATH", "")]  # fmt: skip
    seen: dict[str, int | str] = {}
    for path in candidates:
        if path and path not in seen and os.path.isfile(path):
            try:
                seen[path] = _ptx_isa_of(path)
            except (OSError, RuntimeError) as e:  # not executable, or no CUDA release named: the next one
                seen[path] = f"unreadable ({e})".splitlines()[0]
                continue
            if seen[path] >= need:
                return path
    raise RuntimeError(f"no ptxas here reads PTX {need // 10}.{need % 10}: " + ", ".join(
        f"{p} reads up to {v // 10}.{v % 10}" if isinstance(v, int) else f"{p} {v}" for p, v in seen.items()))


def _tool_output(binary: str, args: list[str], data: bytes | str, suffix: str) -> str:
    """Run the CUDA tool at `binary` on `data` written to a temporary file; its stdout and stderr together."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "kernel" + suffix)
        with open(path, "wb" if isinstance(data, bytes) else "w") as f:
            f.write(data)
        done = subprocess.run([binary, *args, path], capture_output=True, text=True, cwd=tmp)
    if done.returncode != 0:
        raise RuntimeError(f"{os.path.basename(binary)} {' '.join(args)} failed ({done.returncode}):\n{done.stdout}{done.stderr}")
    return done.stdout + done.stderr


def cubin_usage(cubin: bytes, name: str) -> dict[str, int]:
    """The kernel's resources as its cubin records them (cuobjdump --dump-resource-usage: what the driver loads):
    registers a thread, stack frame bytes, shared memory (with the 1 KiB sm_90 reserves for a block that uses any)
    and local memory."""
    out = _tool_output(_nvidia_tool("cuobjdump"), ["--dump-resource-usage"], cubin, ".cubin")
    entry = out.split(f"Function {name}:", 1)
    found = _CUBIN_USAGE.search(entry[1]) if len(entry) == 2 else None
    if found is None:
        raise RuntimeError(f"cuobjdump reported no resource usage for {name!r}:\n{out}")
    return {"regs": int(found[1]), "stack": int(found[2]), "shared": int(found[3]), "local": int(found[4])}


def ptxas_spills(ptx: str, name: str, fp_fusion: bool, ptx_options: str | None) -> tuple[int, int, int]:
    """(spill store bytes, spill load bytes) a thread, and the static shared memory the kernel itself declares, of
    the entry `name`, from ptxas -v on the kernel's PTX with the flags Triton assembles it with (line info, fmad,
    register allocation, any TRITON_PTXAS_OPTIONS): what the cubin does not record apart."""
    cmd = ["-lineinfo", *([] if fp_fusion else ["--fmad=false"]), "-v", "--regAllocOptLevel=2",
           *(ptx_options.split() if ptx_options else []), f"--gpu-name={PTXAS_ARCH}", "-o", "kernel.o"]  # fmt: skip
    log = _tool_output(ptxas_for(ptx), cmd, ptx, ".ptx")
    head = f"Compiling entry function '{name}'"
    if head not in log:
        raise RuntimeError(f"ptxas -v printed no report for the entry {name!r}:\n{log}")
    entry = log.split(head, 1)[1].split("Compiling entry function", 1)[0]  # this entry's lines only
    found, smem = _PTXAS_SPILL.search(entry), _PTXAS_SMEM.search(entry)
    if found is None:
        raise RuntimeError(f"ptxas -v printed no spill report for {name!r}:\n{log}")
    return int(found[1]), int(found[2]), int(smem[1]) if smem else 0


def sass_mix(cubin: bytes) -> dict[str, int]:
    """The cubin's SASS instructions by class (SASS_CLASSES; every class present, 0 where none), and "total"."""
    sass = _tool_output(_nvidia_tool("cuobjdump"), ["-sass"], cubin, ".cubin")
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
        name = compiled.metadata.name
        usage = cubin_usage(compiled.asm["cubin"], name)
        stores, loads, static_smem = ptxas_spills(compiled.asm["ptx"], name, options.enable_fp_fusion,
                                                  options.ptx_options)  # fmt: skip
        names = [p.name for p in self.params]
        shown = {names[path[0]]: _constexpr_text(value) for path, value in constexprs.items() if len(path) == 1}
        rows[key] = KernelResources(
            kernel=self.fn.__name__, regs=usage["regs"], spill_store_bytes=stores, spill_load_bytes=loads,
            stack_bytes=usage["stack"], shared_bytes=static_smem + int(compiled.metadata.shared),
            num_warps=options.num_warps,
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
