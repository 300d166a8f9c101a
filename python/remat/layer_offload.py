"""Offloading planned layers: each layer the plan sends to the host runs under its own Offload on one host pool,
and the plan's offload schedule (the planner's, which simulate() charges and the C++ executor carries out) is
carried out at the layers' boundaries."""
from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from . import _core
from ._state import Walk, walk
from .layer_calls import taken_tensors
from .offload import CopyEngine, HostPool, Offload, storage_ptrs
from .policies import is_groups, is_streamed, split_choice, stream_window

__all__ = ["LayerOffloads", "carry_out", "carry_out_then", "layer_points"]


def carry_out(points) -> None:
    """Carries out offload-schedule points: (action, Offload) each, "wait_to_host" (its copies to the host waited
    for, what they freed leaving the device) or "start_back" (what it holds on the host starts coming back)."""
    for action, offload in points:
        if action == "wait_to_host":
            offload.finish_copies()
        else:
            offload.prefetch()


def carry_out_then(points, grad):
    """A gradient hook: carries out the points (the backward pass has reached a layer), lets the gradient
    through."""
    carry_out(points)
    return grad


def layer_points(plan) -> tuple[list, list]:
    """The plan's offload schedule (remat::offload_schedule: the one simulate() charges and the C++ executor
    carries out) per layer of a per-layer plan (choices_of's shape): after[i], the points carried out once layer
    i's forward has run (ops[i]); at_backward[i], those carried out when the backward pass reaches layer i's
    output (before its recompute or its backward), each (action, stage)."""
    before, after = _core.offload_schedule(plan)
    ops = list(plan.ops)
    loss = next(k for k, op in enumerate(ops) if op.kind == _core.OpKind.L)
    at_backward: list[list] = [[] for _ in range(plan.num_stages)]
    for k in range(loss + 1, len(ops)):
        at_backward[ops[k].stage].extend(before[k])
        if after[k]:  # a recompute that waits for copies: no per-layer plan has one
            raise RuntimeError(f"remat: internal error: plan '{plan}' waits for copies after operation {k}, "
                               "which the planned layers cannot carry out")
    return [list(after[i]) for i in range(plan.num_stages)], at_backward


class LayerOffloads:
    """The offloading of one LayerPlan's layers: its options, the host pool (reused from step to step), a copy
    engine per device, and this step's offloaded layers."""

    STATS = ("offloaded", "offloaded_bytes", "brought_back", "prefetched", "kept_on_device", "found_on_device",
             "alignment_bytes")

    def __init__(self, offload: bool, max_host_bytes: int | None, min_bytes: int):
        self.enabled = offload
        self.max_host_bytes = max_host_bytes
        self.min_bytes = min_bytes
        self.host_pool = HostPool()
        self.engines: dict[torch.device, CopyEngine] = {}  # a copy engine per device (a test may put its own)
        # This step's offloaded layers, (index, Offload) in order, and the storages they keep on the device.
        self._step: list[tuple[int, Offload]] = []
        self._by_index: dict[int, Offload] = {}  # the same, by layer (the schedule's points name layers)
        self._never_sent: set[int] | None = None
        self._walk: Walk | None = None  # the model's, kept across steps while it is current

    def planner_options(self) -> dict:
        """The planner's offloading options (plan_step's keywords)."""
        return dict(offload=self.enabled,
                    max_host_bytes=self.max_host_bytes if self.max_host_bytes is not None else -1)

    def stats(self) -> dict:
        """The last step's offloading, summed over its offloaded layers (Offload's counts, STATS)."""
        return {k: sum(getattr(o, k) for _, o in self._step) for k in self.STATS}

    def begin_step(self) -> None:
        self._step = []
        self._by_index = {}
        self._never_sent = None

    def for_layer(self, i: int, how: str, fn: Callable, args: tuple, shape, model: nn.Module) -> Offload | None:
        """The Offload layer i's call runs under when its choice `how` sends anything to the host (an "...@host"
        or "...@stream" choice, or a group assignment with an 'h'), else None."""
        if not (split_choice(how)[1] or (is_groups(how) and "h" in how)):
            return None
        device = args[0].device
        engine = self.engines.get(device)
        if engine is None:
            # On the CPU a copy's source is held until the plan's schedule waits for it, as on a GPU (CopyEngine).
            engine = self.engines[device] = CopyEngine(device, hold=True)
        # What the profile counted as alive anyway stays on the device: the parameters and buffers (their
        # storages found once a step) and the tensors the call takes beside its input (a mask, a position bias).
        if self._never_sent is None:
            # (Through the model's Walk, kept: walked anew each step, the model was about a tenth of an offloaded
            # layer's Python time inside a step on the CI machine's CPU.)
            w = self._walk
            if w is None or w.modules[0] is not model or not w.current():
                w = self._walk = walk([model])
            self._never_sent = storage_ptrs(w.tensors())
        # Streamed ("keep@stream", "keep@stream0"): copies bounded by the plan's window each way, each tensor
        # brought back ahead of its use (at it, with no window); otherwise the whole layer comes back at once
        # (prefetch()).
        window = stream_window(shape.plan, shape.chain, i) if is_streamed(how) else None
        o = Offload(pool=self.host_pool, min_bytes=self.min_bytes, lookahead=0, engine=engine, window=window)
        o.keep_on_device(taken_tensors(fn, args), storages=self._never_sent)
        self._step.append((i, o))
        self._by_index[i] = o
        return o

    def carry_out_after(self, i: int, points) -> list:
        """The plan's offload schedule at layer i (layer_points'): the copies to the host in flight beside its
        forward are waited for now. Returns what is carried out when the backward pass reaches the layer's output
        (carry_out_then, a gradient hook on it), (action, Offload) each."""
        after, at_backward = points
        offloads = self._by_index
        carry_out([(action, offloads[s]) for action, s in after[i] if s in offloads])
        return [(action, offloads[s]) for action, s in at_backward[i] if s in offloads]

    # -- copies: copy.deepcopy(model), pickle, torch.save(model) ---------------------------------------------------
    def __getstate__(self):
        """A copy carries the options; not this step's Offloads, the host pool's memory or the copy engines (a copy
        starts its own)."""
        return dict(enabled=self.enabled, max_host_bytes=self.max_host_bytes, min_bytes=self.min_bytes)

    def __setstate__(self, state):
        self.__init__(state["enabled"], state["max_host_bytes"], state["min_bytes"])
