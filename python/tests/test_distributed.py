"""One plan on every rank: under DDP (two processes on Gloo, CPU), remat.enable plans from the same numbers on
every rank (each figure's maximum over the ranks), so both run the same plan, and every step's loss is the
plain DDP run's. Rank 1's first layer is made slower, so that the ranks' own measurements differ."""
import os
import socket
import tempfile
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

import remat


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def mlp():
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64)) for _ in range(4)])


def worker(rank, port, agree, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        if rank == 1:  # rank 1's first layer takes longer: its own timings differ from rank 0's
            mlp_layer_delay = lambda module, args: time.sleep(0.02)  # noqa: E731
        x = torch.randn(8, 64, generator=torch.Generator().manual_seed(rank))
        results = {}
        for way in ("plain", "remat"):
            model = mlp()
            if rank == 1:
                model[0].register_forward_pre_hook(mlp_layer_delay)
            lp = None
            if way == "remat":
                lp = remat.enable(model, list(model), budget=600 << 10, agree=None if agree else False)
            ddp = nn.parallel.DistributedDataParallel(model)
            losses = []
            for step in range(3):
                ddp.zero_grad(set_to_none=True)
                torch.manual_seed(step)
                loss = ddp(x).square().mean()
                loss.backward()
                losses.append(loss.detach())
            results[way] = dict(losses=torch.stack(losses), grads=[p.grad.clone() for p in model.parameters()])
            if lp is not None:
                results["plan"] = str(lp.plan)
                results["chain"] = lp.chain.to_json()
        gathered = [None, None]
        dist.all_gather_object(gathered, dict(plan=results["plan"], chain=results["chain"]))
        same_steps = torch.equal(results["plain"]["losses"], results["remat"]["losses"]) and all(
            torch.equal(a, b) for a, b in zip(results["plain"]["grads"], results["remat"]["grads"]))
        if rank == 0:
            torch.save(dict(gathered=gathered, same_steps=same_steps), out)
    finally:
        dist.destroy_process_group()


def run(agree):
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "out.pt")
        mp.spawn(worker, args=(free_port(), agree, out), nprocs=2, join=True)
        return torch.load(out)


def test_ranks_agree_on_one_plan_under_ddp():
    r = run(agree=True)
    assert r["same_steps"], "a remat step differs from the plain DDP run's"
    a, b = r["gathered"]
    assert a["chain"] == b["chain"], "the ranks planned from different numbers"
    assert a["plan"] == b["plan"]
    # Without agreeing, each rank plans from its own timings (rank 1's first layer is slower): the numbers
    # differ, which is what agreeing removes.
    r = run(agree=False)
    a, b = r["gathered"]
    assert a["chain"] != b["chain"]
