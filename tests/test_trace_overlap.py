"""gpu_time_split on synthetic traces whose answers are known by construction, and on a real CPU-only trace."""

from __future__ import annotations

import gzip
import json
import re
from pathlib import Path
from typing import Any

import pytest
import torch

from megacpp_lab.profiling import union_us, gpu_time_split

HOST_PID = 4242  # the host process; GPU events sit on pid = device index, as Kineto writes them
ALL_GATHER = "ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage<4096ul>)"
GEMM = "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1_execute_segment_k_off_kernel"


def gpu(name: str, start_ms: float, end_ms: float, *, cat: str = "kernel", device: int = 0,
        corr: int | None = None) -> dict[str, Any]:  # fmt: skip
    """A GPU event from start_ms to end_ms (the trace itself holds microseconds)."""
    args: dict[str, Any] = {"device": device, "stream": 7}
    if corr is not None:
        args["correlation"] = corr
    return {"ph": "X", "cat": cat, "name": name, "pid": device, "tid": 7, "ts": start_ms * 1e3,
            "dur": (end_ms - start_ms) * 1e3, "args": args}  # fmt: skip


def launch(corr: int, ts_us: float, *, tid: int = 1) -> dict[str, Any]:
    return {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": HOST_PID, "tid": tid, "ts": ts_us,
            "dur": 3.0, "args": {"correlation": corr}}  # fmt: skip


def step(n: int, start_us: float, end_us: float) -> dict[str, Any]:
    return {"ph": "X", "cat": "user_annotation", "name": f"ProfilerStep#{n}", "pid": HOST_PID, "tid": 1,
            "ts": start_us, "dur": end_us - start_us, "args": {}}  # fmt: skip


def write(path: Path, events: list[dict[str, Any]]) -> Path:
    text = json.dumps({"schemaVersion": 1, "traceEvents": events})
    if path.suffix == ".gz":
        path.write_bytes(gzip.compress(text.encode()))
    else:
        path.write_text(text)
    return path


def test_union_merges_overlapping_nested_and_touching_intervals() -> None:
    # [0,10] swallows [2,3]; [5,12] extends it to 12; [12,13] touches; [20,21] stands alone: 13 + 1
    assert union_us([(20, 21), (5, 12), (0, 10), (2, 3), (12, 13)]) == 14
    assert union_us([]) == 0


def test_comm_overlapping_compute(tmp_path: Path) -> None:
    # compute [0,10] and [12,20] ms, AllGather [8,14] ms:
    #   comm = 14 - 8 = 6; compute = 10 + 8 = 18; everything = [0,20] = 20
    #   exposed = everything - compute = 20 - 18 = 2 (the gap [10,12], where only the AllGather runs)
    #   overlapped = 6 - 2 = 4 ([8,10] and [12,14]); window = 20; idle = 20 - 20 = 0
    trace = write(tmp_path / "r0.pt.trace.json", [gpu(GEMM, 0, 10), gpu(GEMM, 12, 20), gpu(ALL_GATHER, 8, 14)])
    got = gpu_time_split(trace)
    assert got["device"] == 0
    assert got["window_ms"] == pytest.approx(20)
    assert got["comm_ms"] == pytest.approx(6)
    assert got["compute_ms"] == pytest.approx(18)
    assert got["exposed_comm_ms"] == pytest.approx(2)
    assert got["overlapped_comm_ms"] == pytest.approx(4)
    assert got["idle_ms"] == pytest.approx(0)
    assert got["comm_share"] == pytest.approx(6 / 20)
    assert got["exposed_comm_share"] == pytest.approx(2 / 20)
    assert got["idle_share"] == pytest.approx(0)
    assert got["comm_kernels"] == [
        {"name": "ncclDevKernel_AllGather_RING_LL", "calls": 1, "total_ms": pytest.approx(6)}
    ]
    assert "per_step" not in got and "step_ms" not in got


def test_idle_gaps_memcpy_memset_and_gzip(tmp_path: Path) -> None:
    # compute: kernel [0,10], memcpy [30,36], memset [36,40] (memcpy/memset count as compute) -> 10 + 10 = 20
    # comm: ReduceScatter [35,50] -> 15; everything: [0,10] + [30,50] = 30; window [0,50] = 50
    #   exposed = 30 - 20 = 10 ([40,50]); overlapped = 15 - 10 = 5 ([35,40]); idle = 50 - 30 = 20 ([10,30])
    events = [gpu(GEMM, 0, 10), gpu("Memcpy HtoD (Pinned -> Device)", 30, 36, cat="gpu_memcpy"),
              gpu("Memset (Device)", 36, 40, cat="gpu_memset"),
              gpu("ncclKernel_ReduceScatter_RING_LL_Sum_bf16(ncclWorkElem)", 35, 50)]  # fmt: skip
    got = gpu_time_split(write(tmp_path / "r0.pt.trace.json.gz", events))
    assert (got["window_ms"], got["compute_ms"], got["comm_ms"]) == pytest.approx((50, 20, 15))
    assert (got["exposed_comm_ms"], got["overlapped_comm_ms"], got["idle_ms"]) == pytest.approx((10, 5, 20))
    assert (got["comm_share"], got["exposed_comm_share"], got["idle_share"]) == pytest.approx((0.3, 0.2, 0.4))
    # the identity the docstring rests on: window = compute + exposed comm + idle
    assert got["window_ms"] == pytest.approx(got["compute_ms"] + got["exposed_comm_ms"] + got["idle_ms"])


def test_reads_the_device_with_the_most_kernel_time(tmp_path: Path) -> None:
    # device 0: one 1 ms kernel and a 50 ms memcpy (memcpy is not kernel time); device 1: 4 + 3 ms of kernels
    events = [gpu(GEMM, 0, 1, device=0), gpu("Memcpy DtoH (Device -> Pageable)", 1, 51, cat="gpu_memcpy", device=0),
              gpu(GEMM, 0, 4, device=1), gpu(ALL_GATHER, 6, 9, device=1)]  # fmt: skip
    got = gpu_time_split(write(tmp_path / "two_gpus.pt.trace.json", events))
    assert got["device"] == 1
    assert (got["window_ms"], got["compute_ms"], got["comm_ms"], got["idle_ms"]) == pytest.approx((9, 4, 3, 2))


def test_comm_kernels_grouped_by_name_before_the_parenthesis(tmp_path: Path) -> None:
    rs = "ncclDevKernel_ReduceScatter_Sum_bf16_RING_LL(ncclDevKernelArgsStorage<4096ul>)"
    events = [gpu(ALL_GATHER, 0, 3), gpu(ALL_GATHER, 10, 11),
              gpu("ncclDevKernel_AllGather_RING_LL", 20, 21),  # no argument list: same group
              gpu(rs, 30, 36),
              gpu("NCCLDevKernel_Broadcast_RING_LL(x)", 40, 40.5),  # case does not matter
              gpu("void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float> >(int)", 50, 52),
              # "nccl" not at the start of the name: compute
              gpu("my_nccl_helper_kernel(float*)", 60, 61)]  # fmt: skip
    got = gpu_time_split(write(tmp_path / "names.pt.trace.json", events))
    assert got["comm_kernels"] == [
        {"name": "ncclDevKernel_ReduceScatter_Sum_bf16_RING_LL", "calls": 1, "total_ms": pytest.approx(6)},
        {"name": "ncclDevKernel_AllGather_RING_LL", "calls": 3, "total_ms": pytest.approx(5)},
        {"name": "NCCLDevKernel_Broadcast_RING_LL", "calls": 1, "total_ms": pytest.approx(0.5)},
    ]
    assert got["comm_ms"] == pytest.approx(11.5)
    assert got["compute_ms"] == pytest.approx(3)


def stepped_trace() -> list[dict[str, Any]]:
    """Two profiled steps; GPU events tied to their host launches by correlation id.

    Host: ProfilerStep#4 over [0, 4000] us, ProfilerStep#5 over [5000, 9000] us.
    Step 4 launches (host 100, 200 us): compute [1,6] ms, AllGather [4,8] ms
      -> window 7, compute 5, comm 4, everything [1,8] = 7, exposed 2, overlapped 2, idle 0
    Step 5 launches (host 5100 us on the main thread, 5200 us on the autograd thread): compute [10,12] ms,
      AllGather [14,15] ms -> window 5, compute 2, comm 1, everything 3, exposed 1, overlapped 0, idle 2
    Outside every step: a kernel [8.5,9] ms launched at host 4500 us (between the steps), and one [12.5,13] ms
      whose launch is not in the trace.
    Whole window [1,15] = 14: compute [1,6]+[8.5,9]+[10,12]+[12.5,13] = 8, comm [4,8]+[14,15] = 5,
      everything [1,8]+[8.5,9]+[10,12]+[12.5,13]+[14,15] = 11 -> exposed 11 - 8 = 3, idle 14 - 11 = 3.
    """
    return [
        step(4, 0, 4000), step(5, 5000, 9000),
        # the profiler mirrors each step on the GPU track too: not a step annotation, not a GPU event
        {"ph": "X", "cat": "gpu_user_annotation", "name": "ProfilerStep#4", "pid": 0, "tid": 7, "ts": 1000.0,
         "dur": 7000.0, "args": {}},
        launch(1, 100), launch(2, 200), launch(3, 5100), launch(4, 5200, tid=2), launch(5, 4500),
        gpu(GEMM, 1, 6, corr=1), gpu(ALL_GATHER, 4, 8, corr=2),
        gpu(GEMM, 10, 12, corr=3), gpu(ALL_GATHER, 14, 15, corr=4),
        gpu(GEMM, 8.5, 9, corr=5), gpu(GEMM, 12.5, 13, corr=99),
    ]  # fmt: skip


def test_per_step_from_launch_correlation(tmp_path: Path) -> None:
    got = gpu_time_split(write(tmp_path / "steps.pt.trace.json", stepped_trace()))
    assert (got["window_ms"], got["compute_ms"], got["comm_ms"]) == pytest.approx((14, 8, 5))
    assert (got["exposed_comm_ms"], got["idle_ms"]) == pytest.approx((3, 3))
    assert got["events_outside_steps"] == 2
    s4, s5 = got["per_step"]
    assert s4["step"] == 4 and s5["step"] == 5
    assert (s4["window_ms"], s4["compute_ms"], s4["comm_ms"]) == pytest.approx((7, 5, 4))
    assert (s4["exposed_comm_ms"], s4["overlapped_comm_ms"], s4["idle_ms"]) == pytest.approx((2, 2, 0))
    assert (s5["window_ms"], s5["compute_ms"], s5["comm_ms"]) == pytest.approx((5, 2, 1))
    assert (s5["exposed_comm_ms"], s5["overlapped_comm_ms"], s5["idle_ms"]) == pytest.approx((1, 0, 2))
    assert (s5["exposed_comm_share"], s5["idle_share"]) == pytest.approx((0.2, 0.4))
    assert got["step_ms"] == pytest.approx([7, 5])


def test_steps_keeps_the_last_ones(tmp_path: Path) -> None:
    trace = write(tmp_path / "steps.pt.trace.json", stepped_trace())
    got = gpu_time_split(trace, steps=1)
    assert [row["step"] for row in got["per_step"]] == [5]
    assert got["step_ms"] == pytest.approx([5])
    assert got["window_ms"] == pytest.approx(14)  # the top level still covers the whole window
    assert [row["step"] for row in gpu_time_split(trace, steps=10)["per_step"]] == [4, 5]
    with pytest.raises(ValueError, match="steps must be >= 1"):
        gpu_time_split(trace, steps=0)


def test_cpu_only_trace_fails_closed(tmp_path: Path) -> None:
    events = [step(1, 0, 100), {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "pid": HOST_PID, "tid": 1,
                                "ts": 10.0, "dur": 50.0, "args": {}}]  # fmt: skip
    trace = write(tmp_path / "cpu.pt.trace.json", events)
    with pytest.raises(ValueError, match="no GPU kernels") as err:
        gpu_time_split(trace)
    assert str(trace) in str(err.value)


def test_missing_file_names_it(tmp_path: Path) -> None:
    missing = tmp_path / "nope.pt.trace.json"
    with pytest.raises(FileNotFoundError, match=re.escape(str(missing))):
        gpu_time_split(missing)


@pytest.mark.parametrize("suffix", [".pt.trace.json", ".pt.trace.json.gz"])
def test_real_cpu_profiler_trace_has_no_gpu_kernels(tmp_path: Path, suffix: str) -> None:
    from torch.profiler import ProfilerActivity, profile

    a = torch.randn(64, 64)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(3):
            a = a @ a / 8
    trace = tmp_path / f"cpu{suffix}"
    prof.export_chrome_trace(str(trace))  # a .gz path is written gzipped
    raw = trace.read_bytes()
    assert (raw[:2] == b"\x1f\x8b") == suffix.endswith(".gz")
    events = json.loads(gzip.decompress(raw) if suffix.endswith(".gz") else raw)["traceEvents"]
    assert any(e.get("name") == "aten::mm" for e in events)  # a real trace of the matmuls, not an empty file
    # JSONDecodeError is a ValueError too: the message shows the file was read and judged, not failed to parse
    with pytest.raises(ValueError, match="no GPU kernels") as err:
        gpu_time_split(trace)
    assert str(trace) in str(err.value)
