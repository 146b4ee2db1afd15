"""model/parallelize.apply_fsdp and `train --nproc`: two ranks under torchrun, the tiny model; gloo on CPU
processes (CI) and, on a host with 2 GPUs, NCCL with one GPU per rank (marked cuda).

- FSDP2 losses equal the single-process losses at the same global batch over 5 AdamW steps, and the first
  backward's gradients of the replicated fp32-contract parameters equal the whole batch's (fp32: reduction
  order only), on a tiny model with every block kind (A, M, R and an E block, whose experts FSDP2 shards with
  their block and whose router is fp32-contract, replicated);
- the fp32-contract tripwire: inside the forward under a bf16 FSDP2 policy every declared fp32 parameter is
  fp32 while the other weights are bf16; a blanket policy (fully_shard each block with the same policy and no
  exception) fails the same check;
- `megacpp-lab train --nproc 2` equals one process at the same global batch (every logged loss, validation loss
  and gradient norm, rtol 1e-4), and a run resumes across process counts (2 -> 1, 1 -> 2) onto the same curve;
- sharded checkpoints: whole into one process, atomic (LATEST moves last), and a killed rank ends the job.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from megacpp_lab.model.config import model_config
from megacpp_lab.model.hybrid import HybridLM
from megacpp_lab.model.precision import fp32_contract
from megacpp_lab.model.train import read_history
from megacpp_lab.profiling import forward_dtypes
from megacpp_lab.varlen import build_context

WORLD, B, T, STEPS = 2, 4, 32, 5
pytestmark = pytest.mark.skipif(not dist.is_available() or sys.platform != "linux", reason="needs torch.distributed (gloo)")
# gloo on CPU processes (CI), NCCL with one GPU per rank (a multi-GPU host): the same workers and assertions
BACKENDS = ["gloo", pytest.param("nccl", marks=[pytest.mark.cuda, pytest.mark.skipif(
    torch.cuda.device_count() < WORLD, reason=f"needs {WORLD} CUDA devices for NCCL")])]  # fmt: skip
# fp32 throughout, so only the reduction order differs: on a CPU 1e-4; on GPUs cuBLAS picks its kernels by
# batch size and the scans' backward kernels accumulate with atomics, so a half batch rounds differently
RTOL = {"gloo": 1e-4, "nccl": 1e-3}


def _device(backend: str) -> torch.device:
    if backend == "nccl":
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return torch.device("cpu")


def _model(device: torch.device = torch.device("cpu")) -> HybridLM:
    torch.manual_seed(0)  # mHC: its gates are fp32-contract parameters too, as is an E block's router
    # every block kind: the E block's experts are sharded with their block (no expert parallelism)
    return HybridLM(model_config("tiny", device.type, mhc=True, pattern="AMRE",
                                 moe=dict(n_experts=4, top_k=2, expert_hidden=32))).to(device)  # fmt: skip


def _batch(device: torch.device = torch.device("cpu")) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(3, 512, (B, T + 1), generator=g)
    doc_ids = torch.zeros(B, T, dtype=torch.long)
    doc_ids[:, T // 2 :] = 1
    return tokens[:, :-1].to(device), doc_ids, tokens[:, 1:].to(device)  # doc_ids stay on the host: build_context


def _train(model: torch.nn.Module, rows: slice, device: torch.device) -> tuple[list[float], dict[str, list[float]]]:
    """STEPS AdamW steps on `rows` of the batch: the losses, and the first step's gradients of the
    fp32-contract parameters (FSDP2 leaves them replicated: full tensors on every rank)."""
    tokens, doc_ids, targets = _batch(device)
    tokens, doc_ids, targets = tokens[rows], doc_ids[rows], targets[rows]
    ctx = build_context(doc_ids).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)  # FSDP2 mixes DTensors and the replicated tensors
    contract = dict(model.named_parameters())
    contract = {n: contract[n] for n in fp32_contract(model) if n in contract}
    losses, grads = [], {}
    for step in range(STEPS):
        loss = model(tokens, ctx, targets).loss
        loss.backward()
        if step == 0:
            grads = {n: p.grad.flatten().tolist() for n, p in contract.items() if p.grad is not None}
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach())
    return [float(x) for x in losses], grads


def _worker(mode: str, out: str, backend: str) -> None:
    """One rank, under torchrun (its environment names rank, world and the master)."""
    device = _device(backend)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend)
    rank = dist.get_rank()
    try:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        from megacpp_lab.model.parallelize import apply_fsdp

        mesh = init_device_mesh(device.type, (WORLD,))
        model = _model(device)
        contract = set(fp32_contract(model))
        result: dict = {}
        if mode.startswith("losses"):  # fp32: equal to one process; "losses-grouped": two blocks per FSDP2 group
            apply_fsdp(model, mesh=mesh, param_dtype=None, reduce_dtype=None,
                       blocks_per_group=2 if mode == "losses-grouped" else 1)  # fmt: skip
            per = B // WORLD
            local, grads = _train(model, slice(rank * per, (rank + 1) * per), device)
            mean = torch.tensor(local, device=device)
            dist.all_reduce(mean)
            result["losses"] = (mean / WORLD).tolist()
            result["grads"] = grads  # rank 0's: after the backward's all-reduce, the average over the ranks
        else:
            if mode == "contract":
                apply_fsdp(model, mesh=mesh)  # bf16 forward
            else:  # "blanket": the same policy over every parameter of a group
                policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
                for block in model.blocks:
                    fully_shard(block, mesh=mesh, mp_policy=policy)
                fully_shard(model, mesh=mesh, mp_policy=policy)
            tokens, doc_ids, targets = _batch(device)
            try:
                with forward_dtypes(model) as seen:  # each parameter's dtype while its module runs
                    model(tokens[:1], build_context(doc_ids[:1]).to(device), targets[:1]).loss.backward()
            except Exception as err:  # noqa: BLE001 - a kernel may refuse the blanket cast's bf16 decays (fails
                if mode == "contract":  # closed); the dtypes its module saw before that are the evidence
                    raise
                result["error"] = f"{type(err).__name__}: {err}"[:400]
            result.update(contract={n: sorted(map(str, seen[n])) for n in contract if n in seen},
                          weights=sorted(map(str, seen["blocks.0.mlp.w_down.weight"])))
        if rank == 0:
            Path(out).write_text(json.dumps(result))
    finally:
        dist.barrier()  # no rank tears down while another is still in a collective
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawn(mode: str, tmp_path: Path, backend: str) -> dict:
    """torchrun over this file (torch.multiprocessing.spawn aborted the gloo workers on exit on this CPU build)."""
    out = tmp_path / f"{mode}-{backend}.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={WORLD}", f"--master_port={_free_port()}",
           __file__, mode, str(out), backend]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[1]), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"torchrun {mode} ({backend}) failed ({done.returncode}):\n{done.stderr[-3000:]}"
    return json.loads(out.read_text())


@pytest.mark.parametrize("grouping", ["per-block", "grouped"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_fsdp_losses_and_replicated_gradients_equal_single_process_at_the_same_global_batch(tmp_path, backend, grouping):
    """Losses over 5 steps, and the first backward's gradients of the replicated fp32-contract parameters
    (averaged in one all-reduce at the end of the backward), equal one process on the whole batch; with each
    block its own FSDP2 group and with two blocks per group."""
    device = torch.device("cuda", 0) if backend == "nccl" else torch.device("cpu")
    reference, ref_grads = _train(_model(device), slice(0, B), device)
    got = _spawn("losses" if grouping == "per-block" else "losses-grouped", tmp_path, backend)
    assert got["losses"] == pytest.approx(reference, rel=RTOL[backend]), (got["losses"], reference)
    assert reference[-1] < reference[0]  # it trains
    assert got["grads"].keys() == ref_grads.keys() and len(ref_grads) > 1, (sorted(got["grads"]), sorted(ref_grads))
    # per parameter ||got - want|| / ||want||: a rank's own half-batch gradient (no average) is off by tens of
    # percent, a sum without the division by 100%; reduction order alone stays near the dtype's rounding
    errors = {}
    for name, want in ref_grads.items():
        w, g = torch.tensor(want, dtype=torch.float64), torch.tensor(got["grads"][name], dtype=torch.float64)
        errors[name] = float((g - w).norm() / w.norm().clamp_min(1e-30))
    worst = max(errors, key=errors.get)
    assert errors[worst] < RTOL[backend], (worst, errors[worst], sorted(errors.items(), key=lambda kv: -kv[1])[:5])


@pytest.mark.parametrize("backend", BACKENDS)
def test_fp32_contract_parameters_stay_fp32_inside_the_forward(tmp_path, backend):
    kept = _spawn("contract", tmp_path, backend)
    assert kept["weights"] == ["torch.bfloat16"]  # the policy does cast the rest
    assert kept["contract"] and all(set(d) == {"torch.float32"} for d in kept["contract"].values()), kept["contract"]
    blanket = _spawn("blanket", tmp_path, backend)  # the tripwire can fail: a blanket policy casts the contract away
    cast = sorted(n for n, d in blanket["contract"].items() if "torch.bfloat16" in d)
    assert cast, blanket["contract"]


def test_apply_fsdp_refuses_a_non_model_a_bf16_model_and_a_missing_process_group():
    from megacpp_lab.model.parallelize import apply_fsdp

    with pytest.raises(TypeError, match="expected a HybridLM"):
        apply_fsdp(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="not fp32"):
        apply_fsdp(_model().to(torch.bfloat16))
    if not dist.is_initialized():
        with pytest.raises(RuntimeError, match="initialised process group"):
            apply_fsdp(_model())


# ----------------------------------------------------------------------------- train --nproc: launch, resharding resume

TRAIN_ARGS = dict(preset="tiny", val_fraction=0.2, seq_len=64, batch_size=4, steps=6, warmup_steps=2, log_every=1,
                  val_every=3, ckpt_every=3, val_batches=2, device="cpu", tensorboard=False)  # fmt: skip
COMPARED = ("train_loss", "val_loss", "grad_norm", "lr")


def _cli_train(out_dir: Path, corpus: Path, *extra: str, nproc: int = 2, wait: bool = True, **overrides):
    """`megacpp-lab train --nproc N` in a subprocess (torchrun underneath), the flags from TRAIN_ARGS."""
    args = {**TRAIN_ARGS, **overrides, "corpus": str(corpus), "out_dir": str(out_dir)}
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in args.items() if not isinstance(v, bool)]
    flags += [f"--{'' if v else 'no-'}{k}" for k, v in args.items() if isinstance(v, bool)]
    cmd = [sys.executable, "-m", "megacpp_lab.cli", "train", f"--nproc={nproc}", "--quiet", *flags, *extra]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[1]), os.environ.get("PYTHONPATH", "")])}
    if not wait:
        return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"train --nproc {nproc} failed ({done.returncode}):\n{done.stderr[-3000:]}"
    return done


def _history(out_dir: Path) -> list[dict]:
    return [{k: v for k, v in row.items() if k != "tokens_per_s"} for row in read_history(out_dir)[1]]


def _assert_same_run(got: list[dict], want: list[dict], rtol: float = RTOL["gloo"]) -> None:
    """Row by row, step and keys equal, the numbers within rtol (fp32: reduction order only)."""
    assert [(r["step"], sorted(r)) for r in got] == [(r["step"], sorted(r)) for r in want]
    for a, b in zip(got, want):
        for key in COMPARED:
            if key in b:
                assert a[key] == pytest.approx(b[key], rel=rtol), (a["step"], key, a[key], b[key])


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """One process straight through; 2 ranks straight through; 2 ranks to step 3 then 1 process to the end;
    1 process to step 3 then 2 ranks to the end. Same config, same global batch."""
    from megacpp_lab.data.sample import write_sample_corpus
    from megacpp_lab.model.train import train
    from megacpp_lab.model.train_config import TrainConfig

    root = tmp_path_factory.mktemp("fsdp-train")
    corpus = write_sample_corpus(root / "corpus")

    def single(name: str, **kw):
        return train(TrainConfig(**TRAIN_ARGS, corpus=str(corpus), out_dir=str(root / name)), progress=False, **kw)

    out = dict(root=root, corpus=corpus, single=single("single"))
    out["two_stdout"] = _cli_train(root / "two", corpus).stdout
    _cli_train(root / "two_then_one", corpus, "--stop-after=3")
    out["two_then_one"] = single("two_then_one")
    single("one_then_two", stop_after=3)
    _cli_train(root / "one_then_two", corpus)
    return out


def test_train_on_two_ranks_equals_one_process(runs):
    root = runs["root"]
    _assert_same_run(_history(root / "two"), _history(root / "single"))
    assert _history(root / "single")[-2]["train_loss"] < _history(root / "single")[0]["train_loss"]  # it trains
    assert runs["two_stdout"].count("trained to step 6") == 1, runs["two_stdout"]  # rank 0 alone reports
    assert (root / "two" / "loss.png").is_file() and not (root / "two" / "checkpoint.pt").exists()
    assert (root / "two" / "checkpoint.dcp" / "LATEST").read_text() == "step-00000006"


@pytest.mark.cuda
@pytest.mark.skipif(torch.cuda.device_count() < WORLD, reason=f"needs {WORLD} CUDA devices for NCCL")
def test_train_on_two_gpus_equals_one_gpu(tmp_path):
    """`train --nproc 2` on two GPUs (NCCL, the host-built context copied without a sync, the replicated
    parameters' one all-reduce) equals one GPU at the same global batch, in fp32."""
    from megacpp_lab.data.sample import write_sample_corpus
    from megacpp_lab.model.train import train
    from megacpp_lab.model.train_config import TrainConfig

    corpus = write_sample_corpus(tmp_path / "corpus")
    gpu = dict(device="cuda", dtype="fp32")
    train(TrainConfig.build(**{**TRAIN_ARGS, **gpu}, corpus=str(corpus), out_dir=str(tmp_path / "one")), progress=False)
    _cli_train(tmp_path / "two", corpus, **gpu)
    _assert_same_run(_history(tmp_path / "two"), _history(tmp_path / "one"), rtol=RTOL["nccl"])
    assert _history(tmp_path / "one")[-2]["train_loss"] < _history(tmp_path / "one")[0]["train_loss"]  # it trains


def test_resume_reshards_two_ranks_to_one_and_one_to_two(runs):
    root = runs["root"]
    want = _history(root / "single")
    _assert_same_run(_history(root / "two_then_one"), want)
    _assert_same_run(_history(root / "one_then_two"), want)
    assert (root / "two_then_one" / "checkpoint.dcp" / "LATEST").read_text() == "step-00000003"  # it did start sharded
    assert (root / "one_then_two" / "checkpoint.dcp" / "LATEST").read_text() == "step-00000006"


def test_a_sharded_checkpoint_loads_whole_into_one_process(runs):
    """load_checkpoint gathers a sharded checkpoint into the single-process dict; the model it builds (sampling,
    evaluation) equals the one-process run's at the same step."""
    from megacpp_lab.model.checkpoint_io import load_checkpoint, load_checkpoint_model

    root = runs["root"]
    sharded, single = load_checkpoint(root / "two" / "checkpoint.dcp"), load_checkpoint(root / "single" / "checkpoint.pt")
    assert sharded["step"] == single["step"] == 6
    assert sharded["model"].keys() == single["model"].keys()
    for name, t in single["model"].items():
        # 6 AdamW steps of lr 1e-3: the update's normalisation lifts the reduction-order difference of a near-zero
        # gradient to a visible share of a whole update (one element of blocks.0.mlp.w_down moved 3.7e-5 on torch
        # 2.13's CPU build, every other below 3e-6), and an element moves at most about lr a step. So elementwise
        # the two runs agree within 6 updates, and as tensors within rounding (a shard loaded into the wrong place
        # moves whole rows by the weights' own size, 1e4 times past this bound).
        d = sharded["model"][name].float() - t.float()
        assert d.abs().max() <= 6 * 1e-3, (name, d.abs().max().item())
        assert d.norm() <= 1e-4 * t.float().norm(), (name, (d.norm() / t.float().norm()).item())
    assert sharded["optimizer"]["state"].keys() == single["optimizer"]["state"].keys()
    model, _ = load_checkpoint_model(root / "two" / "checkpoint.dcp")
    assert sum(p.numel() for p in model.parameters()) > 0


def test_an_interrupted_sharded_save_keeps_the_previous_checkpoint(runs, tmp_path):
    """LATEST moves last: a step directory left half-written (no LATEST update) is ignored; a LATEST naming
    an incomplete directory fails naming what it lacks."""
    import shutil

    from megacpp_lab.model.distributed import latest_sharded
    from megacpp_lab.model.checkpoint_io import load_checkpoint

    run = tmp_path / "checkpoint.dcp"
    shutil.copytree(runs["root"] / "two" / "checkpoint.dcp", run)
    (run / "step-00000009.tmp").mkdir()  # a save that died before its rename
    (run / "step-00000009.tmp" / "__0_0.distcp").write_bytes(b"partial")
    assert latest_sharded(run).name == "step-00000006"
    assert load_checkpoint(run)["step"] == 6
    (run / "step-00000009").mkdir()
    (run / "LATEST").write_text("step-00000009")
    with pytest.raises(ValueError, match="LATEST names 'step-00000009', which lacks meta.pt"):
        latest_sharded(run)


def test_a_rank_that_dies_fails_the_job_with_a_message(runs, tmp_path):
    """SIGKILL one rank mid-run: torchrun stops the other (nothing hangs), the command exits non-zero naming
    the launch's failure, and the last complete checkpoint still loads."""
    import signal
    import time

    from megacpp_lab.model.checkpoint_io import load_checkpoint

    out = tmp_path / "run"
    proc = _cli_train(out, runs["corpus"], wait=False, steps=100000, warmup_steps=2, ckpt_every=2, val_every=100000,
                      log_every=100000)  # fmt: skip
    try:
        deadline = time.monotonic() + 300
        while not (out / "checkpoint.dcp" / "LATEST").exists():
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[1][-3000:]
            time.sleep(0.2)
        victim = _worker_pid(rank=1)
        os.kill(victim, signal.SIGKILL)
        t0 = time.monotonic()
        _, err = proc.communicate(timeout=120)
        took = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode != 0
    assert "training failed on 2 processes" in err and "rank      : 1" in err and "SIGKILL" in err, err[-3000:]
    assert took < 60, took
    assert load_checkpoint(out / "checkpoint.dcp")["step"] >= 2


def _worker_pid(rank: int) -> int:
    """The pid of this machine's torchrun worker with RANK=rank under a megacpp_lab.cli train launch."""
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            env = (proc / "environ").read_bytes().split(b"\0")
            cmd = (proc / "cmdline").read_bytes()
        except OSError:
            continue
        if f"RANK={rank}".encode() in env and b"megacpp_lab.cli" in cmd and b"torch.distributed.run" not in cmd:
            return int(proc.name)
    raise AssertionError(f"no torchrun worker with RANK={rank}")


if __name__ == "__main__":  # a torchrun worker: test_fsdp.py MODE OUT BACKEND
    _worker(sys.argv[1], sys.argv[2], sys.argv[3])
    # Skip the interpreter's teardown: on this CPU build a gloo worker sometimes aborted there, after its
    # work and its result were done ("terminate called without an active exception", 1 run in CI).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
