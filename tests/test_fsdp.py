"""model/parallelize.apply_fsdp on CPU: two gloo processes (spawned), the tiny model.

- FSDP2 losses equal the single-process losses at the same global batch over 5 AdamW steps (fp32 params on
  the CPU: tolerance rtol 1e-4, reduction order only);
- the fp32-contract tripwire: inside the forward under a bf16 FSDP2 policy every declared fp32 parameter is
  fp32 while the other weights are bf16; a blanket policy (fully_shard each block with the same policy and no
  exception) fails the same check.
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
from megacpp_lab.model.precision import FP32_ATTR
from megacpp_lab.varlen import build_context

WORLD, B, T, STEPS = 2, 4, 32, 5
pytestmark = pytest.mark.skipif(not dist.is_available() or sys.platform != "linux", reason="needs torch.distributed (gloo)")


def _model() -> HybridLM:
    torch.manual_seed(0)
    return HybridLM(model_config("tiny", "cpu", mhc=True))  # mHC: its gates are fp32-contract parameters too


def _batch() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(3, 512, (B, T + 1), generator=g)
    doc_ids = torch.zeros(B, T, dtype=torch.long)
    doc_ids[:, T // 2 :] = 1
    return tokens[:, :-1], doc_ids, tokens[:, 1:]  # every target counts: each rank's mean weighs alike


def _train(model: torch.nn.Module, rows: slice) -> list[float]:
    tokens, doc_ids, targets = (t[rows] for t in _batch())
    ctx = build_context(doc_ids)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for _ in range(STEPS):
        loss = model(tokens, ctx, targets).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach())
    return [float(x) for x in losses]


def _contract_dtypes(model: torch.nn.Module) -> dict[str, list[str]]:
    """Forward pre-hooks on every module that declares fp32 parameters: their dtypes as the forward sees them."""
    seen: dict[str, list[str]] = {}
    for path, module in model.named_modules():
        names = [n for n in getattr(type(module), FP32_ATTR, ()) if n in module._parameters and module._parameters[n] is not None]
        if names:
            def pre(mod, args, path=path, names=names):
                for n in names:
                    seen.setdefault(f"{path}.{n}", []).append(str(getattr(mod, n).dtype))
            module.register_forward_pre_hook(pre)
    return seen


def _worker(mode: str, out: str) -> None:
    """One rank, under torchrun (its environment names rank, world and the master)."""
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    try:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        from megacpp_lab.model.parallelize import apply_fsdp

        model = _model()
        result: dict = {}
        if mode == "losses":
            apply_fsdp(model, param_dtype=None, reduce_dtype=None)  # fp32 on the CPU: equal to one process
            per = B // WORLD
            local = _train(model, slice(rank * per, (rank + 1) * per))
            mean = torch.tensor(local)
            dist.all_reduce(mean)
            result["losses"] = (mean / WORLD).tolist()
        else:
            if mode == "contract":
                apply_fsdp(model)  # bf16 forward
            else:  # "blanket": the same policy over every parameter of a group
                policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
                for block in model.blocks:
                    fully_shard(block, mp_policy=policy)
                fully_shard(model, mp_policy=policy)
            seen = _contract_dtypes(model)
            weights: list[str] = []
            model.blocks[0].mlp.register_forward_pre_hook(lambda m, a: weights.append(str(m.w_down.weight.dtype)))
            tokens, doc_ids, targets = _batch()
            model(tokens[:1], build_context(doc_ids[:1]), targets[:1]).loss.backward()
            result.update(contract=seen, weights=weights)
        if rank == 0:
            Path(out).write_text(json.dumps(result))
    finally:
        dist.barrier()  # no rank tears down while another is still in a collective
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawn(mode: str, tmp_path: Path) -> dict:
    """torchrun over this file (torch.multiprocessing.spawn aborted the gloo workers on exit on this CPU build)."""
    out = tmp_path / f"{mode}.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={WORLD}", f"--master_port={_free_port()}",
           __file__, mode, str(out)]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[1]), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"torchrun {mode} failed ({done.returncode}):\n{done.stderr[-3000:]}"
    return json.loads(out.read_text())


def test_fsdp_losses_equal_single_process_at_the_same_global_batch(tmp_path):
    reference = _train(_model(), slice(0, B))
    got = _spawn("losses", tmp_path)["losses"]
    assert got == pytest.approx(reference, rel=1e-4), (got, reference)
    assert reference[-1] < reference[0]  # it trains


def test_fp32_contract_parameters_stay_fp32_inside_the_forward(tmp_path):
    kept = _spawn("contract", tmp_path)
    assert kept["weights"] == ["torch.bfloat16"]  # the policy does cast the rest
    assert kept["contract"] and all(set(d) == {"torch.float32"} for d in kept["contract"].values()), kept["contract"]
    blanket = _spawn("blanket", tmp_path)  # the tripwire can fail: a blanket policy casts the contract away
    cast = sorted(n for n, d in blanket["contract"].items() if "torch.bfloat16" in d)
    assert cast, blanket["contract"]


def test_apply_fsdp_refuses_a_wrapper_a_bf16_model_and_a_missing_process_group():
    from megacpp_lab.model.parallelize import apply_fsdp
    from megacpp_lab.model.precision import apply_mixed_precision

    with pytest.raises(ValueError, match="wrapper"):
        apply_fsdp(apply_mixed_precision(_model(), torch.bfloat16))
    with pytest.raises(ValueError, match="not fp32"):
        apply_fsdp(_model().to(torch.bfloat16))
    if not dist.is_initialized():
        with pytest.raises(RuntimeError, match="initialised process group"):
            apply_fsdp(_model())


if __name__ == "__main__":  # a torchrun worker: test_fsdp.py MODE OUT
    _worker(sys.argv[1], sys.argv[2])
    # Skip the interpreter's teardown: on this CPU build a gloo worker sometimes aborted there, after its
    # work and its result were done ("terminate called without an active exception", 1 run in CI).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
