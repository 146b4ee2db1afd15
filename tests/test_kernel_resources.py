"""kernels/resources.py and bench/resources.py: the lab's Triton kernels compiled for sm_90 on a machine without a
GPU (Triton's compiler and the wheel's ptxas), their registers, spills and shared memory read from ptxas -v, and
programs per SM from Hopper's limits. The compile runs in a subprocess with the interpreter off (these tests run
under it)."""

from __future__ import annotations

import os
from collections import Counter

import pytest
import torch

from megacpp_lab.bench.resources import report, resources_table
from megacpp_lab.kernels import OFFLINE_COMPILE, launchable
from megacpp_lab.kernels.resources import HOPPER, KernelResources, compile_launches, offline_compile


def _row(regs: int, warps: int = 4, shared: int = 0, spill: int = 0) -> KernelResources:
    return KernelResources(kernel="k", regs=regs, spill_store_bytes=spill, spill_load_bytes=spill, stack_bytes=spill,
                           shared_bytes=shared, num_warps=warps, num_stages=1, constexprs={}, sass={})  # fmt: skip


def test_programs_per_sm_take_the_least_of_registers_shared_memory_and_threads():
    # 255 registers round up to 256 a thread: 32 K a 4-warp program, two per SM
    assert _row(255).programs_per_sm == 2
    # 128 registers: four; 72 KiB of shared memory a program: three fit 228 KiB, so three
    assert _row(128).programs_per_sm == 4
    assert _row(128, shared=72 * 1024).programs_per_sm == 3
    # 32 registers and 1 warp: registers would allow 64, the SM's 32 block slots do not
    assert _row(32, warps=1).programs_per_sm == HOPPER["blocks_per_sm"]
    # 16 warps of 32 registers: the 2048 threads an SM holds allow 4
    assert _row(32, warps=16).programs_per_sm == 4
    # 192 registers at 2 warps: 2 warps of 6 K fit each 16 K sub-partition, 8 in all, so 4 programs (not 5)
    assert _row(192, warps=2).programs_per_sm == 4
    # the driver's 1 KiB a block counts: 76 KiB a program leaves room for two, not three
    assert _row(64, shared=76 * 1024).programs_per_sm == 2
    # more than a block may have: it cannot launch at all
    assert _row(64, shared=HOPPER["smem_per_block"] + 1).programs_per_sm == 0
    assert _row(64, spill=8).spills and not _row(64).spills


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU's case: tests/conftest.py sets the interpreter there")
def test_the_launchers_take_cpu_tensors_only_inside_the_offline_compile(monkeypatch):
    import megacpp_lab.kernels as kernels

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert launchable(cuda) and launchable(cpu)  # these tests run under TRITON_INTERPRET=1 (tests/conftest.py)
    monkeypatch.setattr(kernels, "TRITON_INTERPRET", False)  # off the interpreter: the CPU only inside the compile
    assert launchable(cuda) and not launchable(cpu) and not OFFLINE_COMPILE.get()
    with offline_compile():
        assert OFFLINE_COMPILE.get() and launchable(cpu)
    assert not OFFLINE_COMPILE.get() and not launchable(cpu)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU's case: tests/conftest.py sets the interpreter there")
def test_compile_launches_refuses_to_run_under_the_interpreter():
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET unset"):
        compile_launches(lambda: None)


def test_unknown_subjects_fail_naming_them():
    with pytest.raises(ValueError, match=r"\['mamba9'\] unknown"):
        report(("mamba9",))


@pytest.fixture(scope="module")
def mamba3_report():
    return report(("mamba3", "ssd", "m2rnn", "doc_conv"))


def test_the_mamba3_scan_compiles_every_kernel_for_sm90(mamba3_report):
    assert mamba3_report["arch"] == "sm_90"
    rows = mamba3_report["subjects"]["mamba3"]
    names = {r["kernel"] for r in rows}
    assert names == {"_angle_keys_kernel", "_keys_kernel", "_ssd_fwd_state_kernel", "_ssd_fwd_output_kernel", "_ssd_bwd_state_kernel",
                     "_m3_bwd_chunk_kernel", "_doc_scan_totals_kernel",
                     "_doc_scan_kernel", "_group_sum_kernel", "_angle_grads_kernel"}
    from megacpp_lab.kernels.mamba3 import SCAN_WARPS

    for r in rows:
        assert 0 < r["regs"] <= 255, r  # Hopper's limit a thread
        warps = SCAN_WARPS if r["kernel"].startswith("_doc_scan") else 4  # the launches' own num_warps
        assert r["num_warps"] == warps and 1 <= r["programs_per_sm"] <= HOPPER["blocks_per_sm"], r
        assert r["spills"] == (r["spill_store_bytes"] > 0 or r["spill_load_bytes"] > 0), r
    chunk = next(r for r in rows if r["kernel"] == "_m3_bwd_chunk_kernel")
    assert chunk["constexprs"]["CHUNK"] == "64" and chunk["constexprs"]["P"] == "64" and chunk["constexprs"]["N"] == "128"
    # the forward's output kernel holds the main shape's tiles in shared memory: tens of KiB (Triton's dynamic part)
    output = next(r for r in rows if r["kernel"] == "_ssd_fwd_output_kernel")
    assert output["shared_bytes"] > 16 * 1024


def test_the_table_tells_two_compilations_of_one_kernel_apart(mamba3_report):
    """The angle sums' two passes each compile twice (forward and reverse): the table names the constexprs that
    differ."""
    for kernel in ("_doc_scan_totals_kernel", "_doc_scan_kernel"):
        lines = [line for line in resources_table(mamba3_report).splitlines() if f"{kernel} " in line]
        assert len(lines) == 2 and "REVERSE=False" in lines[0] + lines[1] and "REVERSE=True" in lines[0] + lines[1], lines


def test_mamba2s_ssd_compiles_its_four_kernels(mamba3_report):
    names = [r["kernel"] for r in mamba3_report["subjects"]["ssd"]]
    assert sorted(names) == ["_ssd_bwd_chunk_kernel", "_ssd_bwd_state_kernel", "_ssd_fwd_output_kernel",
                             "_ssd_fwd_state_kernel"]


def test_the_sass_mix_agrees_with_ptxas_and_finds_hoppers_mmas(mamba3_report):
    """cuobjdump's instructions against ptxas's report: a kernel has local-memory spill instructions exactly when
    ptxas says it spills. The scans' tile dots lower to Hopper's warpgroup MMAs (wgmma), not mma.sync."""
    for subject, rows in mamba3_report["subjects"].items():
        for r in rows:
            assert r["sass"]["total"] > 0, (subject, r["kernel"])
            assert (r["sass"]["spill_store"] > 0) == (r["spill_store_bytes"] > 0), (subject, r["kernel"], r["sass"])
            assert (r["sass"]["spill_load"] > 0) == (r["spill_load_bytes"] > 0), (subject, r["kernel"], r["sass"])
    rows = {r["kernel"]: r for r in mamba3_report["subjects"]["mamba3"]}
    for kernel in ("_ssd_fwd_output_kernel", "_m3_bwd_chunk_kernel"):
        assert rows[kernel]["sass"]["wgmma"] > 0 and rows[kernel]["sass"]["mma"] == 0, rows[kernel]["sass"]
    keys = rows["_angle_keys_kernel"]["sass"]  # the angle sums' second pass and the key pass: no dot in it
    assert keys["wgmma"] == keys["mma"] == 0


def test_m2rnn_compiles_its_three_kernels_planned_for_a_gh100(mamba3_report):
    """The M2RNN launcher plans its blocks from the GPU's SMs and L2; inside the offline compile it plans for a
    GH100's (kernels/m2rnn.OFFLINE_LIMITS), so the compiled kernels are the ones an H100 or H200 runs."""
    from megacpp_lab.kernels import m2rnn

    assert m2rnn._limits(torch.device("cpu")) == (1, 1 << 62)  # the interpreter's: one SM
    with offline_compile():
        assert m2rnn._limits(torch.device("cpu")) == m2rnn.OFFLINE_LIMITS
    names = [r["kernel"] for r in mamba3_report["subjects"]["m2rnn"]]
    assert names == ["_m2rnn_fwd_kernel", "_m2rnn_recompute_kernel", "_m2rnn_bwd_kernel"]


def test_the_doc_conv_compiles_its_kernels_without_spills(mamba3_report):
    """kernels/doc_conv.py compiled for sm_90 (which the interpreter is not: an int64 and an int32 branch of one
    helper compiled only here), forward and backward, with no bytes spilled at their block sizes."""
    rows = {r["kernel"]: r for r in mamba3_report["subjects"]["doc_conv"]}
    assert sorted(rows) == ["_doc_conv_fwd_kernel", "_doc_conv_grad_pre_kernel", "_doc_conv_grad_x_kernel"]
    for name, row in rows.items():
        assert row["spill_store_bytes"] == 0 and row["spill_load_bytes"] == 0, (name, row)


@pytest.mark.cuda
@pytest.mark.parametrize("subject", ["mamba3", "ssd", "doc_conv"])
def test_on_a_hopper_the_offline_report_equals_what_the_driver_loads(subject):
    """The offline compile against the truth: on an sm_90 GPU, the subject's launches run for real, and each kernel
    Triton loads reports, through the driver, the registers and the local memory a thread (Triton's n_spills: the
    local bytes / 4) that the offline compile read from ptxas for the same compilation. Compared as multisets of
    (kernel, registers, stack bytes), in this process's Triton."""
    from megacpp_lab.bench.resources import SUBJECTS
    from megacpp_lab.kernels import doc_conv as conv_kernels, mamba3 as m3_kernels, ssd as ssd_kernels

    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip(f"needs an sm_90 GPU (H100, H200); this is sm_{''.join(map(str, torch.cuda.get_device_capability()))}")
    offline = sorted((r.kernel, r.regs, r.stack_bytes) for r in compile_launches(SUBJECTS[subject]))
    SUBJECTS[subject]("cuda")
    torch.cuda.synchronize()
    loaded = []
    for module in (ssd_kernels, m3_kernels, conv_kernels):
        for name in dir(module):
            caches = getattr(getattr(module, name), "device_caches", None)
            for device_cache in (caches or {}).values():
                for kernel in device_cache[0].values():
                    if getattr(kernel, "n_regs", None) is None:
                        kernel._init_handles()  # loaded on first launch; every one here has launched
                    loaded.append((kernel.metadata.name, kernel.n_regs, 4 * kernel.n_spills))
    # earlier tests in this process may have loaded other specialisations of the same kernels: each offline row must
    # be among the loaded ones (a kernel whose registers or stack differ from the driver's fails here)
    missing = Counter(offline) - Counter(loaded)
    assert not missing, f"offline rows the driver does not report: {sorted(missing)}; loaded: {sorted(loaded)}"


def test_ptxas_for_picks_a_ptxas_that_reads_the_ptx_version(monkeypatch):
    """Triton may emit a newer PTX version than the ptxas its get_ptxas names for sm_90 reads (the GPU box: PTX 9.0
    from Triton 3.6, whose `ptxas` is CUDA 12.8's, 8.7 at most: both driver-comparison tests failed there). The spill
    report takes the first ptxas, from get_ptxas's and those beside it in Triton's wheel, that reads it, and fails
    naming each candidate's version when none does."""
    from megacpp_lab.kernels import resources

    folder = os.path.dirname(resources._ptxas_path())
    old = os.path.join(folder, "ptxas")
    new = os.path.join(folder, "ptxas-blackwell")
    if not (os.path.isfile(old) and os.path.isfile(new)) or resources._ptx_isa_of(old) >= resources._ptx_isa_of(new):
        pytest.skip("needs Triton's wheel with an older `ptxas` beside a newer `ptxas-blackwell` (Triton 3.9's)")
    newest = resources._ptx_isa_of(new)
    header = "//\n.version {}.{}\n.target sm_90a\n"
    monkeypatch.setattr(resources, "_ptxas_path", lambda: old)  # get_ptxas naming the older one, as on the GPU box
    assert resources.ptxas_for(header.format(*divmod(resources._ptx_isa_of(old), 10))) == old
    assert resources.ptxas_for(header.format(*divmod(newest, 10))) == new
    with pytest.raises(RuntimeError, match=r"no ptxas here reads PTX 99\.9: .*ptxas reads up to"):
        resources.ptxas_for(header.format(99, 9))
    with pytest.raises(RuntimeError, match="no .version directive"):
        resources.ptxas_for(".target sm_90a\n")


def _fake_ptxas(folder, release: str) -> str:
    """An executable `ptxas` in folder whose --version names CUDA `release` (what _ptx_isa_of reads)."""
    path = os.path.join(folder, "ptxas")
    with open(path, "w") as f:
        f.write(f"#!/bin/sh\necho 'Cuda compilation tools, release {release}, V{release}.1'\n"
                f"echo 'Build cuda_{release}.r{release}/compiler.0_0'\n")  # fmt: skip
    os.chmod(path, 0o755)
    return path


def test_ptxas_for_takes_torchs_ptxas_where_inductor_pointed_triton_at_it(monkeypatch, tmp_path):
    """Where Triton wrote a PTX version the ptxas _ptxas_path names cannot read (the last two H100 boxes: PTX 9.0,
    the wheel's ptxas 8.7; torch's CUDA 13.0 ptxas, where inductor points TRITON_PTXAS_PATH, is the guess at its
    source), the spill report takes TRITON_PTXAS_PATH's, or a ptxas in torch's bin folders, that reads it, skips
    one it cannot run, and fails closed naming each otherwise. cuobjdump is found in Triton's wheel when
    _ptxas_path names a folder without one (the box's 'sass: unread'), or at TRITON_CUOBJDUMP_PATH."""
    from megacpp_lab.kernels import resources

    old_dir, torch_dir, wheel_dir = tmp_path / "old", tmp_path / "torch_bin", tmp_path / "wheel_bin"
    for d in (old_dir, torch_dir, wheel_dir):
        d.mkdir()
    old = _fake_ptxas(str(old_dir), "12.8")
    new = _fake_ptxas(str(torch_dir), "13.0")
    (wheel_dir / "cuobjdump").write_text("")
    header = "//\n.version 9.0\n.target sm_90a\n"
    real = resources._tool_folders()  # the real search: Triton's wheel and torch's folders are in it
    from triton.backends import nvidia

    assert os.path.join(os.path.dirname(nvidia.__file__), "bin") in real
    assert os.path.join(os.path.dirname(torch.__file__), "bin") in real
    monkeypatch.setattr(resources, "_ptxas_path", lambda: old)
    monkeypatch.setattr(resources, "_tool_folders", lambda: [str(old_dir), str(wheel_dir)])
    for env in ("TRITON_PTXAS_PATH", "TRITON_PTXAS_BLACKWELL_PATH"):
        monkeypatch.delenv(env, raising=False)
    with pytest.raises(RuntimeError, match=r"no ptxas here reads PTX 9\.0: .*old/ptxas reads up to 8\.7"):
        resources.ptxas_for(header)
    monkeypatch.setenv("TRITON_PTXAS_PATH", new)
    assert resources.ptxas_for(header) == new
    monkeypatch.delenv("TRITON_PTXAS_PATH")
    broken_dir = tmp_path / "broken"
    broken_dir.mkdir()
    (broken_dir / "ptxas").write_text("#!/bin/sh\necho no release here\n")
    os.chmod(broken_dir / "ptxas", 0o755)
    monkeypatch.setattr(resources, "_tool_folders",
                        lambda: [str(old_dir), str(broken_dir), str(wheel_dir), str(torch_dir)])
    assert resources.ptxas_for(header) == new  # past the one that names no CUDA release
    with pytest.raises(RuntimeError, match=r"broken/ptxas unreadable"):
        resources.ptxas_for("//\n.version 99.9\n.target sm_90a\n")
    monkeypatch.delenv("TRITON_CUOBJDUMP_PATH", raising=False)
    assert resources._nvidia_tool("cuobjdump") == str(wheel_dir / "cuobjdump")  # not beside _ptxas_path's
    monkeypatch.setenv("TRITON_CUOBJDUMP_PATH", str(old))  # any file: Triton's own knob comes first
    assert resources._nvidia_tool("cuobjdump") == old
    monkeypatch.delenv("TRITON_CUOBJDUMP_PATH")
    monkeypatch.setattr(resources, "_tool_folders", lambda: [str(old_dir)])
    with pytest.raises(RuntimeError, match="kernel resources need cuobjdump"):
        resources._nvidia_tool("cuobjdump")
