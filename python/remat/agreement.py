"""Distributed agreement: every rank of a torch.distributed process group plans from the same figures, so that
all run the same plan, one that fits each rank's measurements (C++'s PlannedOptions::agree)."""
from __future__ import annotations

import weakref

import torch

from . import _core

__all__ = ["agree", "agreeing", "check_agree", "least_room", "most"]


def check_agree(agree, who: str):
    """`agree` as LayerPlan takes it (True, False, or None: on when a process group of more than one rank is
    initialized); raises ValueError naming `who` otherwise."""
    if agree not in (None, True, False):
        raise ValueError(f"{who}: agree must be True, False or None (on when torch.distributed is "
                         f"initialized), got {agree!r}")
    return agree


def agreeing(agree, who: str) -> bool:
    """Whether the ranks agree on this step's plan: `agree` (check_agree's), with None on when a process group
    of more than one rank is initialized. Raises RuntimeError naming `who` for True without one."""
    if agree is False:
        return False
    import torch.distributed as dist
    on = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
    if agree and not on:
        raise RuntimeError(f"{who}: agree=True needs an initialized torch.distributed process group")
    return on


def agree(chain, ctx) -> None:
    """Every rank plans from the same figures, every figure a plan depends on (the planner library's
    plan_figures(): times, bytes, the offload costs and the bandwidths), each the maximum over the ranks in
    that encoding (a bandwidth the smallest), so that every rank runs the same plan, one that fits each rank's
    measurements. A collective: every rank calls it at the same point (the end of the profiling step's backward
    pass)."""
    import torch.distributed as dist
    ints, reals = _core.plan_figures(chain, ctx)
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else "cpu"
    t_int = torch.tensor(ints, dtype=torch.int64, device=device)
    t_real = torch.tensor(reals, dtype=torch.float64, device=device)
    sizes = torch.tensor([len(ints), len(reals)], dtype=torch.int64, device=device)
    low = sizes.clone()
    dist.all_reduce(sizes, op=dist.ReduceOp.MAX)
    dist.all_reduce(low, op=dist.ReduceOp.MIN)
    if not torch.equal(sizes, low):
        raise RuntimeError("remat: the ranks measured different numbers of figures (different models or "
                           "layer lists?); they cannot agree on one plan")
    dist.all_reduce(t_int, op=dist.ReduceOp.MAX)
    dist.all_reduce(t_real, op=dist.ReduceOp.MAX)
    _core.set_plan_figures(chain, ctx, t_int.tolist(), t_real.tolist())


# The default process group most() last ran under, and the Gloo group it runs on (None: the default group), each
# by weak reference: c10d holds them until destroy_process_group, and remat does not keep them alive after it.
_CONTROL: dict = {}


def most(values: list[int]) -> list[int]:
    """Each of `values` at its maximum over the ranks of the default process group: one all-reduce of as many
    integers, on the CPU (on the default group where it is Gloo's, else on a Gloo group made for it at the first
    call, a collective too). Every rank calls it at the same point with as many values: the beginning of each
    training step of a planned model whose ranks profile in lockstep (LayerPlan._profile_in_lockstep)."""
    import torch.distributed as dist
    world = dist.group.WORLD
    if dist.get_backend() == "gloo":
        group = None
    else:
        held = _CONTROL.get("world")
        if held is None or held() is not world:  # the first call under this group (a group made again is another)
            _CONTROL.update(world=weakref.ref(world), group=weakref.ref(dist.new_group(backend="gloo")))
        group = _CONTROL["group"]()
    t = torch.tensor(values, dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return t.tolist()


def least_room(room: tuple[int, int, int, int]) -> tuple[int, int, int, int]:
    """A device budget's readings (free, cached, total, lost bytes) agreed on by the ranks: the least free, cached
    and total, the most lost, so that one plan fits the tightest rank's device. A collective, as agree()."""
    import torch.distributed as dist
    free, cached, total, lost = room
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else "cpu"
    t = torch.tensor([free, cached, total, -lost], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    free, cached, total, neg_lost = t.tolist()
    return free, cached, total, -neg_lost
