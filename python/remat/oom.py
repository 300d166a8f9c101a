"""Out of memory in a step remat planned: remat's words beside the allocator's, and, when asked, a new plan.

An out-of-memory error raised while a planned step runs one of remat's layers (its forward, or its recompute in
the backward pass) carries a note (``BaseException.add_note``, shown under the allocator's message in the
traceback) with:

- the plan the step ran, and its predicted peak against the budget;
- what the step held above its base when the allocation failed, and the allocation;
- what the caching allocator reserved beyond what tensors occupied, and what the device had free (CUDA);
- the budget that would have fit: what the device could give the step (what it held plus what was free or
  cached), less what the step needed beyond its prediction when it ran out.

The rule and the words are the planner library's (``remat._core.budget_that_would_fit`` and
``describe_out_of_memory``), which remat::Planned uses in C++.

With ``replan_on_oom=True`` (remat.enable, remat.hf.enable; off by default) the LayerPlan lowers its budget to
that one and plans again from what it measured (``LayerPlan.set_budget``), so that the next step runs; the
note says so. A budget only goes down, and a budget below the least feasible one raises
``remat.InfeasibleBudget`` at the next step, so this cannot loop.

On CUDA the caching allocator's out-of-memory observer also reports the failed allocation's size and the
device's free bytes; an error outside remat's layers (in a kept layer's backward, or after the layers) is
reported by a warning with the same words from the observer, since it never passes through remat's code.
"""
from __future__ import annotations

import re
import weakref
import warnings

import torch

from . import _core, fit

__all__ = ["is_oom", "requested_bytes"]

_CPU_WORDS = "DefaultCPUAllocator: can't allocate memory"
_REQUESTS = (re.compile(r"Tried to allocate ([0-9.]+) ?([KMGT]?i?B)"), re.compile(r"tried to allocate (\d+) bytes"))


def is_oom(e: BaseException) -> bool:
    """Whether `e` is an out-of-memory error: torch.OutOfMemoryError, or the CPU allocator's."""
    return isinstance(e, torch.OutOfMemoryError) or (isinstance(e, RuntimeError) and _CPU_WORDS in str(e))


def requested_bytes(e: BaseException) -> int | None:
    """The failed allocation's size as the allocator's message gives it (bytes), or None."""
    text = str(e)
    m = _REQUESTS[0].search(text)
    if m:
        return _core.parse_size(m.group(1) + m.group(2))
    m = _REQUESTS[1].search(text)
    return int(m.group(1)) if m else None


def read(lp, step, shape, e: BaseException | None, where: str, event=None) -> _core.OutOfMemory:
    """What remat knows of an out-of-memory error in `step` (running `shape`'s plan): the step's count, the
    allocator's (CUDA) or a pretended device's figures, the failed allocation (the observer's `event`, or the
    error's message); remat._core.OutOfMemory, which the planner library describes for both languages."""
    o = _core.OutOfMemory()
    o.who, o.where, o.plan = lp.who, where, str(shape.plan)
    o.budget_bytes, o.budget_words = lp.budget_bytes, lp._fitted_words(shape)
    o.predicted_peak_bytes = shape.predicted
    o.held_bytes = max(0, step.meter.count() - step.base)
    request = event[1] if event is not None else (requested_bytes(e) if e is not None else None)
    o.request_bytes = -1 if request is None else request
    device = step.device
    if fit._pretended is not None:
        o.free_bytes = fit._pretended["free"] + fit._pretended["cached"]
        o.reserved_bytes = o.allocated_bytes = 0
    elif device is not None and device.type == "cuda":
        o.free_bytes = event[3] if event is not None else torch.cuda.mem_get_info(device)[0]
        o.reserved_bytes = torch.cuda.memory_reserved(device)
        o.allocated_bytes = torch.cuda.memory_allocated(device)
    return o


def respond(lp, o) -> str:
    """remat's words for `o`, after planning again for the budget that would have fit when lp.replan_on_oom."""
    fitted = _core.budget_that_would_fit(o)
    f = _core.format_bytes
    if not lp.replan_on_oom:
        last = ("lp.set_budget(...) with it plans again without profiling; replan_on_oom=True does so on its own"
                if fitted > 0 else "")
    elif fitted < 0:
        last = "replan_on_oom: the budget that would have fit is not known; the plan is unchanged"
    elif fitted == 0:
        last = "replan_on_oom: no budget would have fit; the plan is unchanged"
    else:
        try:
            lp.set_budget(fitted)
            last = f"replan_on_oom: the budget is now {f(fitted)} ({fitted} bytes); the next step runs the plan {lp.plan}"
        except _core.InfeasibleBudget as err:
            last = (f"replan_on_oom: the budget is now {f(fitted)}, below the least feasible one "
                    f"({f(err.min_bytes)}): the next step raises remat.InfeasibleBudget")
    return _core.describe_out_of_memory(o, last)


def _planned(lp):
    """lp's step in progress and its shape, when that step runs a plan made from a profile; else None (a
    profiling step, every layer checkpointed, or a given plan: no prediction to speak of)."""
    step = lp._step
    shape = step.shape if step is not None else None
    if shape is None or shape.plan is None or shape.context is None:
        return None
    return step, shape


def explain(lp, e: BaseException, layer: int) -> None:
    """Adds remat's words to `e`, raised in layer `layer`'s call in lp's planned step, when it is an
    out-of-memory error (once; nothing for other errors or outside a planned step)."""
    if getattr(e, "_remat_explained", False) or not is_oom(e):
        return
    global _event
    event, _event = _event, None  # the observer's record of this error (CUDA)
    planned = _planned(lp)
    if planned is None:
        return
    try:
        e._remat_explained = True
    except AttributeError:
        return
    backward = torch._C._current_graph_task_id() != -1
    where = f"in layer {layer}'s " + ("recompute (the backward pass)" if backward else "forward")
    text = respond(lp, read(lp, *planned, e, where, event))
    if hasattr(e, "add_note"):
        e.add_note(text)
    else:  # Python 3.10
        e.args = ((e.args[0] if e.args else "") + "\n" + text,) + tuple(e.args[1:])


# -- CUDA: the caching allocator's observer ------------------------------------------------------------------------
_event = None  # the last out-of-memory the observer saw: (device, requested, allocated, free)
_active = None  # a weak reference to the LayerPlan whose planned step runs now
_depth = 0  # how many of remat's layer calls are running (an error inside one is explained there)
_attached = False


def attach_observer() -> None:
    """Attaches remat's out-of-memory observer to CUDA's caching allocator, once per process."""
    global _attached
    if _attached:
        return
    attach = getattr(torch._C, "_cuda_attach_out_of_memory_observer", None)
    if attach is None:
        return
    attach(observed)
    _attached = True


def observed(device, requested, allocated, free) -> None:
    """The observer: records the failed allocation; outside remat's layers, warns with remat's words."""
    global _event
    _event = (device, int(requested), int(allocated), int(free))
    lp = _active() if _active is not None else None
    if lp is None or _depth > 0:
        return
    planned = _planned(lp)
    if planned is None:
        return
    event, _event = _event, None
    text = respond(lp, read(lp, *planned, None, "outside remat's layers (a kept layer's backward, or after the "
                                                "layers)", event))
    warnings.warn(text, RuntimeWarning, stacklevel=2)


def running(lp) -> None:
    """lp's planned step runs from now until its backward pass ends (or the model's next call)."""
    global _active
    _active = weakref.ref(lp)


def over() -> None:
    """No planned step runs (its backward pass ended, or the model was called again)."""
    global _active
    _active = None
