"""The largest batch that trains within a budget, and the plan that trains it (``remat.max_batch``).

    best = remat.max_batch(model, lambda b: tokenizer_batch(b), budget="auto")   # a Transformers model
    best.batch, best.plan, best.ms_per_sample

Memory and time are close to linear in the batch. remat profiles one training step at each of two batch sizes
(as ``remat.hf.enable`` profiles its first step), carries both profiles to any other size on the line through
them (``remat._core.chain_at_batch``, the planner library's code, which the C++ command's ``max-batch`` runs too),
and searches for the largest size whose least feasible budget is within the budget (``remat._core.largest_batch``).
Then it confirms that size with one profiling step and one planned step and reads the planned step's measured
peak; where that is over the budget (or the device runs out of memory), it steps down and confirms again.

Every step runs under ``Restore``: the model's gradients, buffers and random generators are put back, and remat
is taken off the model at the end.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Mapping, Sequence

import torch
from torch import nn

from . import _core, fit
from .profile import Restore

__all__ = ["MaxBatch", "max_batch"]

_WHO = "remat.max_batch"


@dataclass
class MaxBatch:
    """What remat.max_batch found.

    batch: the largest batch that trains within the budget (0: not even a batch of 1 does). budget_bytes: the
    budget in bytes (a device budget's as made from the first profiling step). plan, choices: the plan that
    trains it (a remat.Plan, and its choice per layer), planned from the confirming step's own profile when
    confirmed, else from the carried one. predicted_peak_bytes: the plan's predicted step peak above the step's
    base; measured_peak_bytes: the planned step's, as remat's meter read it (-1 when not confirmed by a step).
    predicted_step_ms, measured_step_ms: the step's time as the plan predicts it and as one planned step took
    (wall clock; -1 when not measured). confirmed: a planned step at `batch` ran within the budget. sizes: the
    batches profiled to predict, and tried: every batch a step ran at. steps: the training steps run in all;
    seconds: the time remat.max_batch took.
    """
    batch: int
    budget_bytes: int
    plan: object | None = None
    choices: list | None = None
    predicted_peak_bytes: int = -1
    measured_peak_bytes: int = -1
    predicted_step_ms: float = -1.0
    measured_step_ms: float = -1.0
    confirmed: bool = False
    sizes: tuple = ()
    tried: list = field(default_factory=list)
    steps: int = 0
    seconds: float = 0.0

    @property
    def ms_per_sample(self) -> float:
        """The measured step's time per sample (milliseconds; the predicted one's when not measured, -1 without a
        batch)."""
        ms = self.measured_step_ms if self.measured_step_ms >= 0 else self.predicted_step_ms
        return ms / self.batch if self.batch > 0 and ms >= 0 else -1.0


def max_batch(model: nn.Module, make_batch: Callable[[int], object], budget, *,
              layers: Sequence[nn.Module] | None = None, loss: Callable | None = None, sizes=(2, 4),
              limit: int = 1 << 16, confirm: bool = True, policies=("matmuls",), exclude: Sequence[str] = (),
              offload: bool = False, max_host_bytes=None, offload_min_bytes: int = 1 << 20,
              groups: bool = False) -> MaxBatch:
    """The largest batch that trains `model` within `budget`, and the plan that trains it (a MaxBatch).

    make_batch(n): one batch of n samples: a dict of keyword arguments (a Transformers model's, labels included),
    a tuple of positional arguments, or the one input. budget: as remat.enable's (bytes, "2GiB", or a device
    budget, "auto" or "90%"). layers: the model's layers, as remat.enable takes them; None for a Transformers
    model (remat.hf.enable's layers). loss: the model's outputs -> the loss, for a model whose output is not a loss
    (a 0-dim tensor) and has no .loss. sizes: the two batch sizes profiled. limit: the largest batch considered.
    confirm: run the found batch (a profiling step and a planned step), stepping down while it does not fit (at
    most 6 tries); False returns the prediction alone. policies, exclude, offload, max_host_bytes,
    offload_min_bytes, groups: as remat.enable's.

    Raises ValueError (naming remat.max_batch and the value) for bad arguments, for a model remat already plans,
    and when make_batch's batches do not grow with n; what the model raises passes through. The model is left
    as it was."""
    start = time.perf_counter()
    fit.parse_budget_spec(budget, _WHO)  # refused before any step runs
    sizes = tuple(sizes)
    if (len(sizes) != 2 or any(isinstance(s, bool) or not isinstance(s, int) or s < 1 for s in sizes)
            or sizes[0] == sizes[1]):
        raise ValueError(f"{_WHO}: sizes must be two different batch sizes >= 1, got {sizes!r}")
    if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
        raise ValueError(f"{_WHO}: limit must be a batch size >= 1, got {limit!r}")
    if "_remat_layer_plan" in model.__dict__ or any("forward" in m.__dict__ for m in (layers or ())):
        raise ValueError(f"{_WHO}: remat already plans this model; take it off first (remat.hf.disable(model), or "
                         "LayerPlan.remove())")
    options = dict(policies=policies, exclude=exclude, offload=offload, max_host_bytes=max_host_bytes,
                   offload_min_bytes=offload_min_bytes, groups=groups)
    run = _Runs(model, layers, loss, options)

    # Two profiles, carried to every other batch.
    profiles = []
    budget_bytes = None
    for n in sizes:
        lp = run.profile(make_batch(n), budget)
        profiles.append((n, lp.chain, lp.context))
        b = lp.budget_bytes
        budget_bytes = b if budget_bytes is None else min(budget_bytes, b)
    (na, ca, xa), (nb, cb, xb) = profiles
    if cb.input_bytes == ca.input_bytes:
        raise ValueError(f"{_WHO}: make_batch({nb}) gave the layers an input of the size make_batch({na}) gave "
                         f"({_core.format_bytes(ca.input_bytes)}); make_batch(n) must make a batch of n samples")
    opts = run.planner_options

    def at(n):
        return _core.chain_at_batch(ca, na, cb, nb, n), _core.context_at_batch(xa, na, xb, nb, n)

    def fits(n):
        return _core.min_step_budget(*at(n), "per-layer", list(exclude), **opts) <= budget_bytes

    found = MaxBatch(batch=_core.largest_batch(fits, limit) if budget_bytes > 0 else 0, budget_bytes=budget_bytes,
                     sizes=sizes)
    while found.batch > 0:
        planned = _core.plan_step(*at(found.batch), budget_bytes, "per-layer", list(exclude), **opts)
        _take(found, planned.plan, planned.step_peak_bytes, planned.step_time_ms)
        if not confirm:
            break
        found.tried.append(found.batch)
        measured = run.confirm(make_batch(found.batch), budget_bytes, found)
        if found.confirmed or len(found.tried) == 6:
            break
        # Over the budget: down in proportion to the overshoot (by a tenth when the device ran out), at least one.
        share = budget_bytes / measured if measured else 0.9
        found.batch = max(0, min(found.batch - 1, int(found.batch * share)))
    if found.batch == 0:
        found.plan = found.choices = None
        found.predicted_peak_bytes = found.measured_peak_bytes = -1
        found.predicted_step_ms = found.measured_step_ms = -1.0
    found.steps = run.steps
    found.seconds = time.perf_counter() - start
    return found


def _take(found: MaxBatch, plan, peak_bytes: int, step_ms: float) -> None:
    from .policies import choices_of
    found.plan = plan
    found.choices = choices_of(plan)
    found.predicted_peak_bytes = peak_bytes
    found.predicted_step_ms = step_ms


class _Runs:
    """The training steps remat.max_batch runs: each on a model remat plans for it, under Restore."""

    def __init__(self, model, layers, loss, options):
        self.model, self.layers, self.loss, self.options = model, layers, loss, options
        self.steps = 0
        self.planner_options = None

    def _enable(self, budget):
        if self.layers is None:
            from . import hf
            return hf.enable(self.model, budget, **self.options)
        from .layer_plan import enable
        return enable(self.model, list(self.layers), budget=budget, **self.options)

    def _disable(self, lp):
        if self.layers is None:
            from . import hf
            hf.disable(self.model)
        else:
            lp.remove()

    def _step(self, lp, batch):
        """One training step of the model on `batch` under LayerPlan `lp` (again while it skips layers:
        LayerPlan._run_whole), leaving the model as it was."""
        model = self.model
        device = next(model.parameters()).device
        was_training = model.training
        model.train()
        try:
            def run_step():
                self.steps += 1
                if isinstance(batch, Mapping):
                    out = model(**batch)
                elif isinstance(batch, tuple):
                    out = model(*batch)
                else:
                    out = model(batch)
                loss = self.loss(out) if self.loss is not None else _loss_of(out)
                loss.backward()

            with Restore([model], device, fresh_grads=True):
                lp._run_whole(run_step)
        finally:
            model.train(was_training)

    def profile(self, batch, budget):
        """One profiling step on `batch`: the LayerPlan, its profile read (its budget may have no plan there)."""
        lp = self._enable(budget)
        try:
            self.planner_options = lp.offloads.planner_options()
            try:
                self._step(lp, batch)
            except _core.InfeasibleBudget:
                pass  # the profile is taken before planning; this size has no plan within the budget
            if lp.chain is None or lp.context is None:
                raise RuntimeError(f"{_WHO}: the step ran none of the layers; check `layers` and make_batch")
            return lp
        finally:
            self._disable(lp)

    def confirm(self, batch, budget_bytes: int, found: MaxBatch):
        """A profiling step and a planned step at the found batch. Sets found's confirmed and measured figures
        (and its plan, from this size's own profile); returns the bytes the step needed when over the budget
        (None when the device ran out of memory)."""
        lp = self._enable(budget_bytes)
        found.confirmed = False
        found.measured_peak_bytes, found.measured_step_ms = -1, -1.0
        try:
            try:
                self._step(lp, batch)  # profiles, and plans for the budget
            except _core.InfeasibleBudget as e:
                return e.min_bytes
            # The plan the step made from this size's own profile (plan_step's: its time is the chain's and the
            # rest of the step's).
            _take(found, lp.plan, lp.predicted_peak_bytes, lp.plan.predicted.time_ms + lp.context.rest_ms)
            device = next(self.model.parameters()).device
            sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
            sync()
            t = time.perf_counter()
            self._step(lp, batch)
            sync()
            found.measured_step_ms = (time.perf_counter() - t) * 1e3
            found.measured_peak_bytes = lp.last_peak_bytes
            found.confirmed = 0 <= lp.last_peak_bytes <= budget_bytes
            return None if found.confirmed else lp.last_peak_bytes
        except torch.OutOfMemoryError:
            return None
        finally:
            batch = None
            self._disable(lp)


def _loss_of(out):
    loss = getattr(out, "loss", None)
    if loss is None and isinstance(out, torch.Tensor) and out.dim() == 0:
        loss = out
    if loss is None:
        raise ValueError(f"{_WHO}: the model's output is not a loss and has none (.loss); give loss=, a function "
                         "from the model's outputs to the loss (or labels in make_batch's batches)")
    return loss
