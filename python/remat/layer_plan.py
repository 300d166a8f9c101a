"""Per-layer plans applied to a model's own layers, planned in place for a budget.

``remat.enable(model, layers, budget=...)`` makes each of the model's layers run as a plan says: kept whole,
checkpointed (``torch.utils.checkpoint``, non-reentrant), or checkpointed under a selective policy (keep the
matrix multiplications), through each layer's forward (``remat.hf.enable`` uses Hugging Face's own
checkpointing hook instead). The model's forward is not changed: it calls its layers as before.

With a budget and no plan, the first training step (per input shape) profiles the layers where they run, on
their real inputs, and measures what surrounds them in the step (what runs before them, the rest of the
forward, the loss and the backward pass, and the gradients the backward pass allocates); at the end of that
step's backward pass it plans (remat.plan_step with the per-layer planner) for the budget, and the steps after
run the plan. The profiling step runs every layer checkpointed and gives the plain run's gradients.

The budget bounds the step's peak as the meter reads it above the bytes alive when the model's forward is
called (parameters, existing gradients, the batch, the optimizer's state are the base): what the layers keep,
what runs before and after them, and the gradients the step allocates are inside it.
"""
from __future__ import annotations

import gc
import operator
import os
import sys
import warnings
from typing import Callable, Iterable, Sequence

import torch
from torch import nn

from . import _core, agreement, fit, oom
from .fit import parse_budget
from .grad_buckets import GradBuckets
from ._state import Walk, kept_walk
from .compiled import CHOICES_ATTR, INSIDE, compiled_module, publish, set_step_key, unwrap_call, wrap_call
from .dispatch import LAYER_PLAN_ATTR, PlannedForward, dispatch, layers_skipped
from .layer_calls import autocast_state, call_key, key_form
from .layer_offload import LayerOffloads, layer_points
from .measure_step import (RETIMED_STEPS, Shape, Step, TrainingCall, fsdp1_sharded, graph_reaches,
                           graph_state_not_run, layer_grads_bytes, local_bytes, measure_planned_step,
                           queue_at_backward_end, sharded_modules, step_context, storage_key, unsharded_grads_reduced,
                           unsynced_grad_bytes)
from .meter import meter_for
from .profile import checked_timing
from .progress import planning_wait
from .policies import CHECKPOINT, KEEP, choices_of, is_groups, is_streamed, policy_fn, split_choice

__all__ = ["LayerPlan", "enable", "parse_budget"]

# Plans kept per input shape for the budgets it was planned at (LayerPlan._planned).
PLANS_KEPT = 16


def _fsdp1_refusal(who: str, where: str) -> str:
    return (f"{who}: FSDP1 (torch.distributed.fsdp.FullyShardedDataParallel) shards this model ({where}), and remat "
            "cannot profile its layers under it for a budget (FSDP1 frees a layer's gathered parameters after its "
            "forward, which the profile runs again): shard it with FSDP2 (torch.distributed.fsdp.fully_shard; "
            "Accelerate's fsdp_version: 2), under which remat profiles and plans for a budget, or give a plan "
            "(plan=...), which runs under FSDP1 as planned")


class LayerPlan:
    """The layers of a model run per layer as a plan says; made by remat.enable and remat.hf.enable.

    Attributes and methods to read: is_planned(), plan (the Plan in force for the last input shape, its str()
    the C++ Plan::to_string()), choices ("keep", "checkpoint" or a policy's name, per layer), chain (the
    profile, a remat.Chain: chain.to_json() is the remat command's chain JSON), context (the StepContext
    measured), predicted_peak_bytes, last_peak_bytes (the step's measured peak above its base, after a planned
    step's backward pass; -1 for a given plan, which is run without measuring), profiling_steps, profiled_shapes,
    borrowed_shapes, plan_borrowed.
    """

    def __init__(self, model: nn.Module, layers: Sequence[nn.Module], *, budget=None, plan=None,
                 policies=("matmuls",), repeats: int = 1, exclude: Sequence[str] = (), agree=None,
                 offload: bool = False, max_host_bytes=None, offload_min_bytes: int = 1 << 20,
                 groups: bool = False, replan_on_oom: bool = False, replan_on_overshoot: bool = False,
                 borrow_plans: bool = True, choose_plan=None, who: str = "remat.enable"):
        self.who = who
        if choose_plan is not None and not callable(choose_plan):
            raise TypeError(f"{who}: choose_plan must be a callable (chain, context, budget) -> remat.Plan, got "
                            f"{type(choose_plan).__name__}")
        if choose_plan is not None and budget is None:
            raise ValueError(f"{who}: choose_plan is called with a budget, and the plan it returns is held to it: "
                             "give budget too")
        self.choose_plan = choose_plan
        where = fsdp1_sharded(model) if budget is not None and plan is None else None
        if where is not None:  # (sharded after enable: refused at its first training step, _refuse_fsdp1)
            raise ValueError(_fsdp1_refusal(who, where))
        if borrow_plans not in (True, False):
            raise ValueError(f"{who}: borrow_plans must be True or False, got {borrow_plans!r}")
        self.borrow_plans = borrow_plans
        if replan_on_oom not in (True, False):
            raise ValueError(f"{who}: replan_on_oom must be True or False, got {replan_on_oom!r}")
        self.replan_on_oom = replan_on_oom
        if replan_on_overshoot not in (True, False):
            raise ValueError(f"{who}: replan_on_overshoot must be True or False, got {replan_on_overshoot!r}")
        self.replan_on_overshoot = replan_on_overshoot
        if groups not in (True, False):
            raise ValueError(f"{who}: groups must be True or False, got {groups!r}")
        self.groups = groups
        if offload not in (True, False):
            raise ValueError(f"{who}: offload must be True or False, got {offload!r}")
        if max_host_bytes is not None and not offload:
            raise ValueError(f"{who}: max_host_bytes bounds what offloading holds in host memory; it needs "
                             "offload=True")
        if isinstance(offload_min_bytes, bool) or not isinstance(offload_min_bytes, int) or offload_min_bytes < 0:
            raise ValueError(f"{who}: offload_min_bytes must be a number of bytes >= 0, got {offload_min_bytes!r}")
        host = parse_budget(max_host_bytes, who, "max_host_bytes") if max_host_bytes is not None else None
        self.offloads = LayerOffloads(offload, host, offload_min_bytes)
        self.agree = agreement.check_agree(agree, who)
        if replan_on_overshoot and agree:
            raise ValueError(f"{who}: replan_on_overshoot plans again from one rank's measured peak, and ranks that "
                             "agree must run one plan: not both (agree=False to plan each rank on its own)")
        self.model = model
        # A layer given as torch.compile(layer)'s wrapper: its module, whose forward the wrapper's compiled
        # call runs (and traces, remat's call inside).
        self.layers = [compiled_module(m) for m in layers]
        if not self.layers:
            raise ValueError(f"{who}: no layers")
        for i, layer in enumerate(self.layers):
            if not isinstance(layer, nn.Module):
                raise TypeError(f"{who}: layer {i} is a {type(layer).__name__}, not an nn.Module")
        if len({id(m) for m in self.layers}) != len(self.layers):
            raise ValueError(f"{who}: a layer is listed twice")
        if (budget is None) == (plan is None):
            raise ValueError(f"{who}: give a budget (planned in place) or a plan (applied as it is), not "
                             f"{'both' if budget is not None else 'neither'}")
        # A budget in bytes, or a device budget ("auto", "90%"): the fraction of what the device has free when a
        # profiling step begins (fit.py), each shape's budget made from its own profiling step's reading.
        self.budget, self.fit = fit.parse_budget_spec(budget, who) if budget is not None else (None, None)
        self._budget_text = budget if self.fit is not None else None
        if isinstance(policies, str):
            # Read as a sequence, a name would be its letters (before 2026-12-07: "the plan keeps with policy 'm'").
            raise TypeError(f"{who}: policies must be a sequence of policy names or a dict of name to policy "
                            f"function, got the string {policies!r}; write ({policies!r},)")
        if isinstance(policies, dict):
            self.policies = dict(policies)
        else:
            self.policies = {name: policy_fn(name) for name in (policies or ())}
        if isinstance(exclude, str) or not isinstance(exclude, Iterable):
            raise TypeError(f"{who}: exclude must be a sequence of plan operations such as ('Fk',), got "
                            f"{type(exclude).__name__} {exclude!r}")
        exclude = list(exclude)  # (read once: a generator given)
        for e in exclude:
            if not isinstance(e, str):
                raise TypeError(f"{who}: exclude must be a sequence of plan operations such as ('Fk',), got "
                                f"{type(e).__name__} {e!r} among them")
        # Checked here, not at the first plan (before 2026-12-07 a ValueError at the end of the first training
        # step's backward pass, the planner library's), by the planner library's own rule.
        _core.check_exclude(exclude, who)
        if isinstance(repeats, bool) or not isinstance(repeats, int):
            raise TypeError(f"{who}: repeats must be an int >= 1, got {type(repeats).__name__} {repeats!r}")
        if repeats < 1:
            raise ValueError(f"{who}: repeats must be >= 1, got {repeats}")
        self.repeats = repeats
        self._profile_timing = "synced"  # profile_timing
        self.exclude = list(exclude)
        self.index = {id(m): i for i, m in enumerate(self.layers)}
        # The layers whose calls came from a compiled graph (compiled.eager_dispatch): profiled through it.
        self.compiled_layers: set[int] = set()
        # Whether torch.compile ran a compiled layer's call eagerly while the profiler forced a choice on it
        # (compiled.ran_eagerly: warned of once).
        self.compiled_ran_eagerly = False
        self._shapes: dict[tuple, Shape] = {}
        self._fixed: Shape | None = None
        if plan is not None:
            if not isinstance(plan, _core.Plan):
                raise TypeError(f"{who}: plan must be a remat.Plan (remat.per_layer's, a LayerPlan's .plan, or "
                                f"remat.Plan.from_json's), got {type(plan).__name__} {plan!r:.80}")
            if plan.num_stages != len(self.layers):
                raise ValueError(f"{who}: the plan is for {plan.num_stages} stages but there are "
                                 f"{len(self.layers)} layers")
            fixed = Shape()
            fixed.plan = plan
            fixed.choices = choices_of(plan)
            fixed.points = layer_points(plan)
            for c in fixed.choices:
                if is_groups(c):
                    raise ValueError(f"{who}: the plan runs a layer under a group assignment ('{c}'), whose groups "
                                     "only the chain it was planned from names; give a budget with groups=True "
                                     "(planned in place) instead")
                if is_streamed(c):
                    raise ValueError(f"{who}: the plan streams a layer ('{c}'), which only a plan made in place "
                                     "runs (its window and stream figures are the profiled chain's); give a "
                                     "budget with offload=True instead")
                c = split_choice(c)[0]
                if c not in (KEEP, CHECKPOINT) and c not in self.policies:
                    self.policies[c] = policy_fn(c)
            self._fixed = fixed
        self._last: Shape | None = self._fixed
        self._step: Step | None = None
        for layer in self.layers:
            layer.__dict__[CHOICES_ATTR] = {}
        self._wrap_calls()
        if self._fixed is not None:
            publish(self.layers, self._fixed, self.policies)
        # First among the model's forward pre-hooks: the step's base is read before FSDP2's root all-gathers its
        # parameters (fully_shard prepends its hook too; _first_hook moves remat's back in front).
        self._begin_hook = model.register_forward_pre_hook(self._step_begins, prepend=True, with_kwargs=True)
        # A forward hook: a planned step whose last layer ran inside its compiled graph (its call did not reach
        # remat's dispatch) is measured from the model's outputs (_forward_ends).
        self._handles = [self._begin_hook, model.register_forward_hook(self._forward_ends)]
        self._unmeasured = False  # this step runs every layer checkpointed, measuring nothing
        # The model's training calls whose graphs may be alive (TrainingCall), the last one this call's; whether
        # a call inside an earlier one's step was said (_inside_earlier_call).
        self._calls: list[TrainingCall] = []
        self._inside_said = False
        self._many_shapes_said = False  # _new_shape's warning was given
        self._skips_said: set[str] = set()  # the steps whose forward skipped layers said: "profiling", "planned"
        # The step keys whose shapes are profiled and planned for every layer only (not for the layers its steps
        # call, Shape.stages): a shape planned so had a step that called another layer (dispatch._outside_stages).
        self._whole_only: set = set()
        # The model's parameters, read again at each step's key (_refresh_params: a module or parameter replaced
        # since), and their dtypes and shapes in order as the id of that form among those seen (_params_key).
        self._params = [p for p in model.parameters()]
        self._param_form: list = []
        self._forms: dict[tuple, int] = {}
        self._form_id = -1
        # The indices (in _params) of the parameters a profiling step's backward gave no gradient though the
        # layers' forward used them (Step.gradless: a DSA indexer's), charged no gradient; each watched for one
        # (_watch_gradless: its hook's handle), which a later step that gives it one warns of.
        self._gradless: set[int] = set()
        self._gradless_hooks: dict[int, object] = {}
        # Those whose gradients end each step in memory that outlives it (DDP's gradient_as_bucket_view): a step
        # that begins with them None makes none of their memory (GradBuckets), so it is charged none.
        self._buckets = GradBuckets()
        # The indices (in _params) of the parameters outside the layers (embeddings, a head, a final norm), and of
        # those a profiling step's backward accumulated a gradient for, where it did: "rest" (the rest's backward,
        # before the layers'), "between" (during the layers' backward) or "before" (after it: the part before the
        # layers'). A step that begins with other of their gradients None than the profiling step did is charged
        # the difference there (_grads_charge, the planner library's context_for_grads).
        self._outside = self._outside_indices()
        self._outside_phase: dict[int, str] = {}
        # Per layer, its modules' Walk (remat._state: what a checkpointed call's attribute contexts read), kept
        # while current (walk_of).
        self._walks: dict[int, Walk] = {}

    # -- copies: copy.deepcopy(model), pickle, torch.save(model) ---------------------------------------------------
    def __getstate__(self):
        """A copy carries the plans and what they were made from (chains, contexts, per step key), and what the
        copied model's layers need to run them; not the step in progress, nor the offloading's host memory or
        copy engines (a copy starts its own: LayerOffloads' own copy)."""
        state = dict(self.__dict__)
        state.update(_step=None, _unmeasured=False, _calls=[], _calls_wrapped=False, _gradless_hooks={}, _walks={})
        del state["index"]  # ids of the copy's layers
        return state

    # Fields added since a LayerPlan first pickled, which a pickle from an earlier remat lacks, each with the
    # value a LayerPlan made without its option has (a type: a new one of it).
    _DEFAULTS = dict(replan_on_oom=False, replan_on_overshoot=False, groups=False, compiled_layers=set, fit=None,
                     _budget_text=None, _calls=list, _inside_said=False, _many_shapes_said=False, borrow_plans=True,
                     _profile_timing="synced", _calls_wrapped=False, _gradless=set, _gradless_hooks=dict,
                     _walks=dict, _outside=None, _outside_phase=dict, _param_form=list, _forms=dict, _form_id=-1,
                     _skips_said=set, _whole_only=set, _buckets=GradBuckets)

    def __setstate__(self, state):
        """From a copy or a pickle, perhaps one an earlier remat saved (torch.save of a planned model): the fields
        in _DEFAULTS it lacks take their defaults."""
        for name, default in self._DEFAULTS.items():
            if name not in state:
                state[name] = default() if isinstance(default, type) else default
        self.__dict__.update(state)
        self.index = {id(m): i for i, m in enumerate(self.layers)}
        if self._outside is None:
            self._outside = self._outside_indices()
        # Step keys from before they named the frozen parameters or the parameters' dtypes and shapes (made for
        # the parameters as they are now: an earlier remat planned them without telling these apart) or the
        # autocast state (made without autocast: an earlier remat kept one plan for both, the first profiled).
        # (Not read from the model: a deep copy's model is not filled in yet here.)
        frozen, form = self._params_key(refresh=False)
        for key in [k for k in self._shapes if len(k) < 4 or not _params_part(k[2])]:
            shape = self._shapes.pop(key)
            params = (key[2] if len(key) > 2 else frozen, form)
            shape.key = (key[0], key[1], params, key[3] if len(key) == 4 else ())
            self._shapes[shape.key] = shape
        self._watch_gradless()  # the copy's parameters: a Parameter's copy has no hooks

    def _takes_stages(self, shape: Shape) -> bool:
        """Whether `shape` may be profiled and planned for the layers its steps call (Shape.stages) rather than
        for every layer: not with layers compiled on their own (their graphs' plans are published per layer), a
        given plan (of every layer), nor for a shape whose planned steps called a layer outside those
        (_whole_only). Under agree the ranks plan from such a profile only where every rank profiled the same
        layers (_profiled_on_every_rank); FSDP2's ranks without agree profile together with no agreement to
        check that by, so not there."""
        if self.compiled_layers or self._fixed is not None or shape.key in self._whole_only:
            return False
        return not self._ranks_in_lockstep() or agreement.agreeing(self.agree, self.who)

    def _ranks_in_lockstep(self) -> bool:
        """Whether the ranks profile together (_profile_in_lockstep): a process group of more than one rank whose
        ranks agree on plans (agree), or whose layers FSDP2 shards (it all-gathers while the layers are
        profiled)."""
        import torch.distributed as dist
        if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
            return False
        return agreement.agreeing(self.agree, self.who) or any(sharded_modules(m) for m in (self.model, *self.layers))

    def walk_of(self, i: int) -> Walk:
        """Layer i's modules' Walk (remat._state.walk), kept while current: a checkpointed call's attribute and
        buffer contexts take 9.5 us a Llama layer's call with it kept, 35 us with it made (7.8 us the buffers'
        alone, before the attributes and written buffers were followed; the CI machine's CPU)."""
        return kept_walk(self._walks, i, self.layers[i])

    def _step_key(self, tag: str, entries: tuple) -> tuple:
        """A training step's key, under which its plan is kept: `tag` ("model": the model's call, whose shapes
        call_key gives; "layer 0": the first layer's, layer_key's, where the layers are called outside the
        model's forward) and those `entries`, the parameters (_params_key: which are frozen, their dtypes and
        shapes) and the autocast state (layer_calls.autocast_state). A step that differs in any of them is
        profiled and planned on its own."""
        return (tag, entries, self._params_key(), autocast_state())

    def _params_key(self, refresh: bool = True) -> tuple[tuple[int, ...], int]:
        """The parameters' part of every step's key: the indices of the model's parameters that require no grad,
        and the id of their dtypes and shapes in order among the forms seen. A layer frozen on an input that
        needs no gradient makes no graph and saves nothing, so a plan is made for one set of frozen parameters,
        and freezing or unfreezing any (gradual unfreezing, an adapter's weights) profiles and plans again, as a
        new input shape does; so does a model whose parameters changed dtype (`model.to(torch.bfloat16)`: its
        layers' activations halve, and inputs that are token ids say nothing of it) or changed in number or
        shape (`resize_token_embeddings`, a new head). Before (found 2026-12-07), such a model kept the plan of
        its first form: after `to(torch.bfloat16)` every later step ran every layer checkpointed, measured by
        nothing (its layers' shapes off the plan's), and after a vocabulary grew from 256 to 300 tokens a
        4-layer Llama's steps held 6.6% above their prediction (28.7% in the test, where it doubles).
        `refresh`: read the model's parameters first (_refresh_params)."""
        if refresh:
            self._refresh_params()
        params, form = self._params, self._param_form
        if len(form) != len(params) or any(p.dtype != d or p.shape != s for p, (d, s) in zip(params, form)):
            form = self._param_form = [(p.dtype, p.shape) for p in params]
            self._form_id = self._forms.setdefault(tuple(form), len(self._forms))
        return tuple(i for i, p in enumerate(params) if not p.requires_grad), self._form_id

    def _refresh_params(self) -> None:
        """`_params` made the model's parameters as they are now, where any was replaced since they were read
        (a new embedding and head from `resize_token_embeddings`, a head assigned, FSDP2's sharded parameters
        where the model was sharded after enable): the indices that name parameters (those charged no gradient,
        the phases of those outside the layers) follow each to its new place, or, where the new ones have the
        old ones' dtypes and shapes in order, stay (a parameter replaced by one like it). Before (found
        2026-12-07), the parameters read at enable were kept: a step's gradient state was read off replaced
        ones, whose gradients no `zero_grad` reached."""
        now = parameters_of(self.model)
        old = self._params
        if len(now) == len(old) and all(map(operator.is_, now, old)):
            return
        if len(now) == len(old) and all(p.dtype == q.dtype and p.shape == q.shape for p, q in zip(now, old)):
            place = {i: i for i in range(len(old))}
        else:
            where = {id(p): j for j, p in enumerate(now)}
            place = {i: where[id(q)] for i, q in enumerate(old) if id(q) in where}
        for h in self._gradless_hooks.values():
            h.remove()
        self._gradless_hooks = {}
        self._gradless = {place[i] for i in self._gradless if i in place}
        self._buckets = GradBuckets()  # looked for again among the new parameters' gradients
        self._outside_phase = {place[i]: phase for i, phase in self._outside_phase.items() if i in place}
        self._params = now
        self._outside = self._outside_indices()
        self._watch_gradless()

    def _run_whole(self, run_step: Callable[[], None]) -> None:
        """Runs `run_step()`, one training step of the model inside the caller's Restore(fresh_grads=True) (the
        example step of remat.hf.enable(example=) and remat.hf.profile, remat.max_batch's), again while it skips
        layers (LayerDrop: a step that was to profile then profiles nothing, a planned one measures nothing;
        dispatch.layers_skipped; a try that calls the layers the one before called profiles those, Shape.stages),
        the gradients as at the first try's start (none, or zeros), at most
        WHOLE_STEP_TRIES times; then a ValueError. Before (found 2026-12-07), such a step left no profile:
        remat.hf.profile returned (None, None)."""
        params = parameters_of(self.model)
        had = [p.grad is not None for p in params]
        for _ in range(WHOLE_STEP_TRIES):
            run_step()
            if self._step is None or not self._step.skipped:
                if self._last is not None and self._last.chain is not None:
                    self._last.from_example = True  # (_check_prediction)
                return
            with torch.no_grad():
                for p, g in zip(params, had):
                    if not g:
                        p.grad = None
                    elif p.grad is not None:
                        p.grad.zero_()
        raise ValueError(f"{self.who}: each of {WHOLE_STEP_TRIES} training steps on the example batch skipped a "
                         "layer (a model that skips layers at random in training: LayerDrop), and a profile is of "
                         "every layer, or of the layers two steps in a row called: set the model's layerdrop to 0 "
                         "for this call")

    # -- what can be read ----------------------------------------------------------------------------------------
    def is_planned(self) -> bool:
        """Whether a plan is in force for the last input shape."""
        return self._last is not None and self._last.choices is not None

    @property
    def plan(self):
        return self._last.plan if self._last else None

    @property
    def choices(self):
        return list(self._last.choices) if self._last and self._last.choices else None

    @property
    def chain(self):
        return self._last.chain if self._last else None

    @property
    def stages(self) -> list[int] | None:
        """The indices in `layers` of the last input shape's chain's stages, of which `plan`, `choices` and `chain`
        are: every layer's, or where that shape's steps call only some layers (a vision-language model's text-only
        batches, which call no vision layer), those; None before a plan."""
        shape = self._last
        if shape is None or shape.choices is None:
            return None
        return list(range(len(self.layers))) if shape.stages is None else list(shape.stages)

    @property
    def saved_calls(self):
        """Per layer, every call of its forward the last input shape's profiling step measured as a candidate saved
        group (remat.SavedGroup, in the forward's order), of which fit_groups chose the chain's Stage.groups: what a
        bound over every saved tensor reads (bench/offload_cuda.py). None without groups=True or before the
        profiling step."""
        return getattr(self._last, "saved_calls", None)  # (a pickle from before it has none)

    @property
    def context(self):
        """What surrounds the layers in the last input shape's step (a StepContext), for the parameter gradients
        the plan in force is for (_plan_for_grads): the profiling step's own where its steps begin as that one
        did, else a copy made from it; None before its profiling step."""
        shape = self._last
        return self._context_in_force(shape) if shape is not None and shape.context is not None else None

    @property
    def profile_timing(self) -> str:
        """How the profiling steps time the layers' work (remat.profile's `timing`): "synced" (the default), or,
        on CUDA, the experimental "pipelined" (the device held busy ahead of the host's queuing; docs/planning.md,
        "Timing the layers"). Set it before the first step; ValueError naming the value for another."""
        return self._profile_timing

    @profile_timing.setter
    def profile_timing(self, timing: str) -> None:
        self._profile_timing = checked_timing(timing, f"{self.who}: profile_timing")

    @property
    def predicted_peak_bytes(self) -> int:
        return self._last.predicted if self._last else -1

    @property
    def predicted_host_bytes(self) -> int:
        """The host memory the plan in force holds at most (bytes: its offloaded layers'; 0 when it offloads
        none, -1 without a plan)."""
        plan = self.plan
        return plan.predicted.host_peak_bytes if plan is not None else -1

    @property
    def offload_stats(self) -> dict:
        """The last step's offloading, summed over its offloaded layers (remat.offload.Offload's counts):
        offloaded (tensors sent to the host), offloaded_bytes, brought_back (copies back to the device), prefetched
        (of them, started before the backward pass asked for the tensor), kept_on_device, found_on_device (still on
        the device when needed back: not copied), alignment_bytes (device bytes beyond the copies brought back that
        keep each at its saved tensor's alignment)."""
        return self.offloads.stats()

    @property
    def host_pool(self):
        """The host memory of offloaded layers (remat.offload.HostPool), reused from step to step."""
        return self.offloads.host_pool

    @property
    def last_peak_bytes(self) -> int:
        return self._last.last_peak if self._last else -1

    @property
    def prediction_error(self) -> float | None:
        """The last planned step's measured peak against the plan's prediction: (last_peak_bytes -
        predicted_peak_bytes) / predicted_peak_bytes, above 0 when the step held more (a share; None before a
        planned step of the last input shape was measured). Beyond remat.PREDICTION_TOLERANCE (2%) either way,
        a warning says so once per input shape; with replan_on_overshoot=True a step that held more plans again
        (see enable)."""
        return self._last.prediction_error if self._last else None

    @property
    def min_budget_bytes(self) -> int:
        """The least budget a plan exists for, for the last input shape (bytes; -1 before its profiling step):
        the step's predicted peak under the least-memory per-layer plan, or the profiling step's measured peak
        (every layer checkpointed) when that is lower, for the parameter gradients the last step began without
        (_plan_for_grads)."""
        shape = self._last
        if shape is None or shape.chain is None or shape.context is None:
            return -1
        # The measured every-layer-checkpointed peak (context.checkpoint_all_peak_bytes) counts, as in plan_step.
        return _core.min_step_budget(shape.chain, self._context_in_force(shape), "per-layer", self.exclude,
                                     **self.offloads.planner_options())

    @property
    def budget_bytes(self) -> int:
        """The budget in force for the last input shape (bytes): the one given, or a device budget's ("auto",
        "90%") as made from that shape's profiling step (-1 before it)."""
        if self.fit is None:
            return self.budget if self.budget is not None else -1
        return self._last.budget if self._last is not None else -1

    @property
    def profiling_steps(self) -> int:
        return self._last.profiling_steps if self._last else 0

    @property
    def profiled_shapes(self) -> int:
        """How many input shapes (step keys: the shapes of the tensors the model's call takes, which parameters
        are frozen, their dtypes and shapes) have been profiled, each in its first training step; a copy counts
        those it carries. At remat.PROFILED_SHAPES_WARNED_AT (8) a warning says what they cost (_new_shape)."""
        return sum(1 for shape in self._shapes.values() if shape.profiled())

    @property
    def borrowed_shapes(self) -> int:
        """How many input shapes run the plan of a larger shape (borrow_plans), not profiled."""
        return sum(1 for shape in self._shapes.values() if shape.borrowed_from is not None)

    @property
    def plan_borrowed(self) -> bool:
        """Whether the plan in force for the last input shape is a larger shape's (borrow_plans): its chain,
        context, predicted_peak_bytes, timeline() and min_budget_bytes are then that shape's, and its prediction
        bounds the step (prediction_error below 0)."""
        return self._last is not None and self._last.borrowed_from is not None

    @property
    def profiling_time(self) -> dict[str, float]:
        """Where the last input shape's profile spent its time: seconds by phase ("forward without saving",
        "forward and backward", "checkpointed", "policy NAME", "offloading", "groups", "bandwidth";
        remat.ProfileProgress), in the order they ran; {} before its profiling step. The profiling step's own
        run of the layers, checkpointed, is not in it."""
        return dict(self._last.profiling_time) if self._last else {}

    def timeline(self) -> dict:
        """The plan in force's predicted step, operation by operation, for the last input shape (the planner
        library's remat/planner/timeline.h): a dict with plan, peak_bytes, time_ms, budget_bytes, stages (each
        layer's name and way: "Fa", "Fc", "Fk[matmuls]", with "@host" or "@stream") and points (each operation:
        op, stage, backward, start_ms, end_ms, peak_bytes above the step's base). Raises ValueError before the
        shape has a plan (and for a given plan, which has no profile)."""
        import json
        shape = self._last
        if shape is None or shape.plan is None or shape.chain is None or shape.context is None:
            raise ValueError(f"{self.who}: no plan with its profile yet (timeline and plot follow a profiling step "
                             "under a budget)")
        return json.loads(_core.step_timeline_json(shape.chain, self._context_in_force(shape), shape.plan,
                                                   self.budget_bytes))

    def plot(self, path, *, plain: bool = True, title: str | None = None) -> None:
        """Draws the planned step's memory over time to `path` (.png, .svg, .pdf; needs matplotlib): the predicted
        curve, each layer's forward and backward coloured by its way, the budget, the last measured peak, and with
        `plain` the plain step's predicted curve beside it (remat.plot_step draws it; timeline() is the data).
        Raises ValueError as timeline()."""
        import json
        from .plot_step import draw
        t = self.timeline()
        shape = self._last
        compare = json.loads(_core.step_timeline_json(shape.chain, self._context_in_force(shape),
                                                      _core.no_checkpoint(shape.chain))) if plain else None
        draw(t, str(path), compare=compare, measured_peak=self.last_peak_bytes if self.last_peak_bytes >= 0 else None,
             title=title)

    def set_budget(self, budget) -> None:
        """Plans again for another budget (bytes, a size string, or a device budget such as "auto" or "90%") from
        what was measured, without profiling again: every input shape already profiled gets its new plan at
        once (one it planned before at that budget, from the same figures, is used again). Raises
        remat.InfeasibleBudget naming the least feasible budget when one of them has none (that shape keeps no
        plan and its next training step raises the same error), and ValueError for a device budget when a
        shape was profiled without reading the device (under a budget in bytes)."""
        if self._fixed is not None:
            raise ValueError(f"{self.who}: this LayerPlan runs a given plan; it has no budget to change")
        spec = fit.parse_budget_spec(budget, self.who)
        if spec[1] is not None and any(s.chain is not None and s.room is None for s in self._shapes.values()):
            raise ValueError(f"{self.who}: set_budget({budget!r}) fits the device as read in each shape's profiling "
                             "step, but a shape was profiled under a budget in bytes, without that reading; enable "
                             "with the device budget instead")
        self.budget, self.fit = spec
        self._budget_text = budget if self.fit is not None else None
        first_error = None
        for shape in self._shapes.values():
            if shape.chain is None or shape.context is None:
                continue
            shape.error = None
            try:
                self._plan_from(shape, self._context_in_force(shape))
            except _core.InfeasibleBudget as e:
                first_error = first_error or e
        if first_error is not None:
            raise first_error

    def remove(self):
        """Stops planning: the hooks go; the layers' forward is what it was (remat.enable) ."""
        for h in [*self._handles, *self._gradless_hooks.values()]:
            h.remove()
        self._handles, self._gradless_hooks = [], {}
        for layer in self.layers:
            layer.__dict__.pop(CHOICES_ATTR, None)
            unwrap_call(self.model, layer)

    @property
    def _may_offload(self) -> bool:
        """Whether some plan of this LayerPlan may send a layer to the host: planned with offload=True, or given a
        plan that offloads (read by compiled.Around on every compiled layer call)."""
        return self.offloads.enabled or (self._fixed is not None and self._fixed.offloads())

    def _wrap_calls(self) -> None:
        """Wraps the compiled calls of the layers compiled by now (compiled.wrap_call: an offloading plan's part
        outside their graphs), once per LayerPlan and copy (a copy's layers come without them); a layer compiled
        later is wrapped at its first call outside its graph (compiled.eager_dispatch)."""
        for layer in self.layers:
            wrap_call(self, layer)
        self._calls_wrapped = True

    # -- the step ------------------------------------------------------------------------------------------------
    def _training(self) -> bool:
        return torch.is_grad_enabled() and self.model.training

    def _first_hook(self) -> bool:
        """Moves remat's step-begin hook in front of the model's other forward pre-hooks (FSDP2, sharding after
        enable(), prepends its own); True when it was not first, and another hook ran before it this step."""
        hooks = self.model._forward_pre_hooks
        if next(iter(hooks), None) == self._begin_hook.id:
            return False
        hooks.move_to_end(self._begin_hook.id, last=False)
        return True

    def _step_begins(self, module, args, kwargs):
        self._unmeasured = False
        oom.over()
        if not self._calls_wrapped:  # a copy's first call
            self._wrap_calls()
        if self._fixed is not None or not self._training():
            self._step = None
            return
        earlier = [c for c in self._calls if c.open()]
        call = TrainingCall()
        self._calls = [*earlier, call]
        if earlier:
            for c in earlier:
                if c.step is not None:
                    c.step.inside.append(call)
            self._inside_earlier_call()
            return
        if self._first_hook():
            # FSDP2 all-gathered the root's parameters before this step's base could be read: this step runs
            # every layer checkpointed and measures nothing; the next one profiles.
            self._unmeasured = True
            self._step = None
            return
        self._refuse_fsdp1()
        key = self._step_key("model", call_key(args, kwargs))
        self._step = call.step = self._begin_step(key, self._device_of(args), collect_garbage=True)
        self._step.given = {storage_key(t) for t in torch.utils._pytree.tree_leaves((args, kwargs))
                            if isinstance(t, torch.Tensor)}
        self._step.in_model_forward = True

    def _refuse_fsdp1(self) -> None:
        """Before a training step while no shape is profiled: raises RuntimeError where FSDP1 shards the model
        (fsdp1_sharded). FSDP1 frees a layer's gathered parameters after its forward, and the profiling step runs
        the layers again where the last one ran: before (found 2026-12-08) that read freed memory, a segmentation
        fault on the CPU (use_orig_params=False), or raised PyTorch's "post accumulate grad hooks cannot be
        registered on non-leaf tensors" (use_orig_params=True). Nothing has run: the model and its gradients are
        as they were. A given plan (plan=) runs under FSDP1 (not checked here: it profiles nothing)."""
        import torch.distributed as dist
        if not (dist.is_available() and dist.is_initialized()):
            return  # (FSDP1 needs a process group)
        if any(s.chain is not None for s in self._shapes.values()):
            return
        where = fsdp1_sharded(self.model)
        if where is not None:
            raise RuntimeError(_fsdp1_refusal(self.who, where))

    def _outside_indices(self) -> list[int]:
        """The indices in _params of the parameters no layer holds (an embedding, a head)."""
        inside = {id(p) for layer in self.layers for p in layer.parameters()}
        return [i for i, p in enumerate(self._params) if id(p) not in inside]

    def _grads_state(self, sharded: Sequence[nn.Module] = ()) -> tuple[set[int], tuple, dict[int, int]]:
        """The gradients a step beginning now makes: the ids of the parameters that need a gradient and have
        none (as after zero_grad()); Shape.grads_key's form: per layer their bytes (layer_grads_bytes), then the
        indices of the parameters outside the layers among them (a frozenset), then those of them whose
        gradients the step makes at another size than their own, with that size (a frozenset of pairs: FSDP2's
        unsharded gradients with its sync off); and those other sizes by parameter id (unsynced_grad_bytes of
        `sharded`, the model's FSDP2-sharded modules: _sharded_modules)."""
        gradless, held = self._gradless, self._buckets.params
        params = self._params
        grads_none = {id(p) for i, p in enumerate(params)
                      if p.requires_grad and p.grad is None and i not in gradless and i not in held}
        sizes = unsynced_grad_bytes(sharded)
        outside = frozenset(i for i in self._outside if id(params[i]) in grads_none)
        resized = frozenset((i, sizes[id(params[i])]) for i in outside if id(params[i]) in sizes)
        return grads_none, (*layer_grads_bytes(self.layers, grads_none, sizes), outside, resized), sizes

    def _sharded_modules(self) -> list[nn.Module]:
        """The model's modules FSDP2 shards (read once at each step's beginning: it may be applied after enable;
        none without a process group, which FSDP2 needs, so a single process walks nothing)."""
        import torch.distributed as dist
        return sharded_modules(self.model) if dist.is_available() and dist.is_initialized() else []

    def _outside_of(self, grads: tuple | None) -> frozenset | None:
        """The outside part of a gradient state's key (_grads_state's: its entry after the layers'), or None (no
        key, or one from before the key had it: a pickle's)."""
        n = len(self.layers)
        return grads[n] if grads is not None and len(grads) > n else None

    def _outside_sizes(self, grads: tuple | None) -> dict[int, int] | None:
        """Of the parameters outside the layers a step in gradient state `grads` makes gradients for
        (_outside_of), each index's gradient bytes: its own (local_bytes), or the size the key gives it (its
        entry after the outside indices: FSDP2's unsharded gradients with its sync off). None as _outside_of."""
        outside = self._outside_of(grads)
        if outside is None:
            return None
        n = len(self.layers)
        other = dict(grads[n + 1]) if len(grads) > n + 1 else {}
        return {i: other[i] if i in other else local_bytes(self._params[i]) for i in outside}

    def _outside_more(self, shape: Shape, grads: tuple) -> list[int]:
        """Of the parameters outside the layers, the gradients a step beginning in state `grads` (_grads_state's
        key) makes beyond those the shape's profiling step made (bytes; negative: fewer), by where a profiling
        step's backward accumulated them (_outside_phase): [rest, between, before] (the planner library's
        GradsOutside). One never given a gradient there is not counted."""
        more = {"rest": 0, "between": 0, "before": 0}
        now, then = self._outside_sizes(grads), shape.measured_outside_sizes
        if then is None and shape.measured_outside is not None:  # (a pickle from before the sizes were kept)
            then = {i: local_bytes(self._params[i]) for i in shape.measured_outside}
        if now is not None and then is not None:
            for i in now.keys() | then.keys():
                phase = self._outside_phase.get(i)
                if phase is not None:
                    more[phase] += now.get(i, 0) - then.get(i, 0)
        return [more["rest"], more["between"], more["before"]]

    def _note_gradless(self, step: Step) -> None:
        """The end of a profiling step's backward: the parameters the layers' forward used and its backward gave
        no gradient (Step.gradless) are charged none from here on, this step's plan among them (its gradient
        state, Step.grads_key, is that of a step that began without them). Before (found 2026-12-06), each was
        charged: GLM-MoE-DSA's checkpointed plans 7.5% high, each layer's backward charged its DSA indexer's
        gradients. A parameter the forward did not use (an expert no token reached) stays charged."""
        gradless = step.gradless()
        if not gradless:
            return
        less = layer_grads_bytes(self.layers, gradless, step.grad_sizes)
        step.grads_none = (step.grads_none or set()) - gradless
        if step.grads_key is not None:
            step.grads_key = (*(g - d for g, d in zip(step.grads_key, less)), *step.grads_key[len(less):])
        self._gradless |= {i for i, p in enumerate(self._params) if id(p) in gradless}
        self._watch_gradless()

    def _watch_gradless(self) -> None:
        """Each parameter charged no gradient (_gradless) watched for one not watched yet (a copy's parameters
        are new: watched as it is made, __setstate__)."""
        for i in self._gradless - self._gradless_hooks.keys():
            self._gradless_hooks[i] = self._params[i].register_post_accumulate_grad_hook(
                lambda p, i=i: self._gradless_given(i, p))

    def _gradless_given(self, i: int, p: torch.Tensor) -> None:
        """A parameter charged no gradient was given one (its hook, in the backward pass): charged from the next
        step on, and said, since the step that made it was planned without it."""
        self._gradless.discard(i)
        h = self._gradless_hooks.pop(i, None)
        if h is not None:
            h.remove()
        name = next((n for n, q in self.model.named_parameters() if q is p), f"parameter {i}")
        warnings.warn(f"{self.who}: {name} was given a gradient ({_core.format_bytes(local_bytes(p))}), which the "
                      "profiling step's backward did not give it though its layer's forward used it: this step was "
                      "planned without it, and its peak may be that much above the prediction; steps from here on "
                      "charge it", stacklevel=2)

    def _grads_charge(self, shape: Shape, grads: tuple) -> list[int]:
        """What a plan for a step of `shape` that begins in the gradient state `grads` (Shape.grads_key's form)
        charges: per layer, the gradients its backward makes (none where the rest of the step makes them), then
        the gradients of the parameters outside the layers made beyond the profiling step's (_outside_more)."""
        n = len(self.layers)
        stages = list(grads[:n]) if shape.stages is None else [grads[j] for j in shape.stages]
        return ([0] * len(stages) if shape.grads_in_rest else stages) + self._outside_more(shape, grads)

    def _plan_for_grads(self, key, grads: tuple) -> None:
        """A training step under `key` begins with `grads` of the parameter gradients None (_grads_state's key: the
        layers' bytes, those outside them): where its shape is planned for another state (gradient accumulation:
        the first micro-batch makes the gradients, the others add to them, and a plan made at one is above or
        below the other's peak), the plan for this one is put in force, made from the profile (and kept,
        LayerPlan._planned, for the next step in this state). Where no plan fits, the plan in force is put back
        and InfeasibleBudget raised, naming the gradients, before anything of the step runs."""
        shape = self._shapes.get(key)
        if shape is None or shape.grads_key is None or shape.context is None or shape.choices is None:
            return
        if grads == shape.grads_key:
            return
        before = shape.grads_key
        charged = shape.charged.setdefault(grads, self._grads_charge(shape, grads))
        shape.grads_key = grads
        try:
            self._plan_from(shape, self._context_in_force(shape))
        except _core.InfeasibleBudget as e:
            shape.grads_key = before
            shape.error = None
            self._plan_from(shape, self._context_in_force(shape))  # the plan in force, as before
            n = len(shape.chain.stages)
            err = _core.InfeasibleBudget(
                f"{e}. This step began with {_core.format_bytes(sum(charged[:n]))} of the layers' parameter "
                f"gradients None, which its backward pass makes; the plan in force, {shape.plan}, was made for "
                f"steps that began with {_core.format_bytes(sum(shape.charged[before][:n]))} of them None, and is "
                "kept for such steps")
            err.budget_bytes, err.min_bytes = e.budget_bytes, e.min_bytes
            raise err from None

    def _context_in_force(self, shape: Shape):
        """The profile's StepContext for the gradient state in force (Shape.charged): the profiling step's own,
        or one made from it (the planner library's context_for_grads, C++'s remat::Planned's rule too)."""
        ctx = shape.context
        charged = shape.charged.get(shape.grads_key)
        if charged is None:
            return ctx
        n = len(shape.chain.stages)
        stages, outside = charged[:n], charged[n:]  # (outside: none in a pickle from before it was charged)
        if stages == list(ctx.stage_grads_bytes) and not any(outside):
            return ctx
        return _core.context_for_grads(ctx, stages, *outside)

    def _profile_in_lockstep(self, key, grads: tuple):
        """Under a process group of more than one rank whose ranks agree on plans (agree), or whose layers FSDP2
        shards: a training step under `key` begins, and the ranks profile together or not at all. Where any rank
        profiles this step (its input shape is new to it), every rank does, one whose shape has a plan profiling
        it again: the collectives of a profiling step (agreement.agree at the end of its backward pass, FSDP2's
        all-gathers while the layers are profiled, least_room) then meet on every rank. Before (found
        2026-12-02), a rank whose batch had another shape profiled alone, and its agreement met the other ranks'
        next collective: Gloo aborted ("collective mismatch"), NCCL would hang or mix buffers. One all-reduce of
        two integers per step (agreement.most).

        Under agree, a step whose gradient state (_plan_for_grads) its shape has no plan for on some rank: every
        rank takes the maximum over the ranks of the gradients to charge (one all-reduce), and the ranks that
        need a plan make it from that, so that ranks in the same state make the same plan."""
        if not self._ranks_in_lockstep():
            return
        agreeing = agreement.agreeing(self.agree, self.who)
        new = self._profiles(key)
        shape = self._shapes.get(key)
        planned = not new and shape.grads_key is not None
        needs = planned and agreeing and grads not in shape.charged
        any_new, any_needs = agreement.most([int(new), int(needs)])
        if any_new:
            if not new and not shape.no_backward:
                # Profiled again, with the ranks whose shape is new: one planned for the layers its steps call
                # profiles those again (Shape.tried).
                self._shapes[key] = Shape(key)
                self._shapes[key].tried = None if shape.stages is None else frozenset(shape.stages)
            return
        if any_needs:
            # A collective on every rank, of one figure per layer (a shape planned for the layers its steps call,
            # Shape.stages, gives its stages' at their layers' places) and the three outside them; what it says is
            # kept only by the ranks that need it.
            n = len(self.layers)
            per_layer = [0] * (n + 3)
            if planned:
                charge = self._grads_charge(shape, grads)
                k = len(charge) - 3  # the chain's stages
                for j in range(k):
                    per_layer[shape.layer_of(j)] = charge[j]
                per_layer[n:] = charge[k:]
            told = agreement.most(per_layer)
            if needs:
                shape.charged[grads] = [told[shape.layer_of(j)] for j in range(k)] + told[n:]

    def _borrow(self, key):
        """A training step under `key` begins. Where its shape is new and a planned shape covers it (borrow_plans;
        the same tensors, dtypes, ranks and frozen parameters, and none of the planned shape's sizes smaller than
        the new one's: _core.covering_shape, the C++ library's rule too), the step runs the plan of the covering
        shape with the fewest elements, and its shape keeps that plan and the profile it was made from
        (set_budget plans it from that profile): no profiling step for a sequence shorter than one planned, or a
        smaller last batch. Its steps are measured against that plan's prediction (_check_prediction). Not for
        layers compiled on their own (their graphs are compiled per shape and profiled through)."""
        if not self.borrow_plans or key in self._shapes or self.compiled_layers:
            return
        form, sizes = key_form(key)
        planned = []  # (shape, its sizes): the planned shapes of this key's form
        for s in self._shapes.values():
            if s.borrowed_from is None and s.choices is not None and s.chain is not None and s.context is not None:
                s_form, s_sizes = key_form(s.key)
                if s_form == form:
                    planned.append((s, s_sizes))
        j = _core.covering_shape([s_sizes for _, s_sizes in planned], sizes)
        if j < 0:
            return
        donor = planned[j][0]
        shape = Shape(key)
        for name in ("stages", "layer_keys", "gathered", "chain", "context", "room", "budget", "lowered",
                     "planned_chain", "planned_at", "plan", "choices", "points", "predicted", "grads_key",
                     "grads_in_rest", "measured_outside", "measured_outside_sizes"):
            setattr(shape, name, getattr(donor, name))
        shape.charged = dict(donor.charged)
        shape.borrowed_from = donor
        shape.rest_retimed = RETIMED_STEPS  # the covering shape's rest of the step is not timed again on this one
        self._shapes[key] = shape
        publish(self.layers, shape, self.policies)

    def _profiles(self, key) -> bool:
        """Whether a training step under `key` profiles the layers: its shape has no profile yet, and its layers
        have a backward pass (not every layer frozen)."""
        shape = self._shapes.get(key)
        return shape is None or (shape.chain is None and not shape.no_backward)

    def _new_shape(self, key):
        """A training step under `key` begins. Where it is a new input shape, its step profiles the layers (several
        planned steps' time: docs/python.md, "Many input shapes"): at the remat.PROFILED_SHAPES_WARNED_AT-th such
        shape a warning says what the shapes cost so far and how to have fewer (batches padded to a few lengths).
        Said once per model."""
        if self._many_shapes_said or not self._profiles(key):
            return
        profiled = [s for s in self._shapes.values() if s.profiled()]
        if len(profiled) + 1 < _core.PROFILED_SHAPES_WARNED_AT:
            return
        self._many_shapes_said = True
        seconds = sum(sum(s.profiling_time.values()) for s in profiled)
        warnings.warn(
            f"{self.who}: this training step's input shape is new, so its step profiles the layers, as the first "
            f"step of each new shape does: {len(profiled) + 1} shapes so far "
            f"({_varying([s.key for s in profiled] + [key])}), {seconds:.1f} s of profiling besides those steps' "
            "own runs. Batches padded to a few lengths are profiled "
            "once per length (Hugging Face: DataCollatorWithPadding(tokenizer, pad_to_multiple_of=64), or "
            "padding=\"max_length\"); LayerPlan.profiled_shapes counts the shapes (docs/python.md, \"Many input "
            "shapes\"). Said once",
            stacklevel=_caller_level())

    def _inside_earlier_call(self):
        """A training call that began while an earlier one's graph was alive (two forwards before one backward
        pass: a contrastive loss, a pair of batches): it runs inside the earlier call's step, every layer
        checkpointed and nothing measured. The earlier call's step, from its base until its own backward pass and
        this call's have ended (Step.after_inside), holds this call's run: a profiling step measures it there, so
        the plan made from it charges it, and a planned step's peak checked against the prediction includes it.
        Said once."""
        self._unmeasured = True
        self._step = None
        set_step_key(self.layers, INSIDE)  # compiled layers checkpoint in their graphs (compiled_call)
        if not self._inside_said:
            self._inside_said = True
            warnings.warn(
                f"{self.who}: the model was called for training while the graph of an earlier training call was "
                "alive (its backward pass had not run); such a call runs inside the earlier call's step: its "
                "layers run checkpointed, and the earlier call's plan is made for, and its prediction checked "
                "against, the step with this call in it, so that the budget holds for both together. Calling "
                "the model once on the inputs concatenated lets remat plan them as one (docs/python.md, "
                "\"Several calls before one backward pass\")", stacklevel=_caller_level())

    def _forward_ends(self, module, args, output):
        """The model's forward is over. A training call's graph is marked (TrainingCall.tag). A profiling step reads
        whether the layers' output is alive still (Step.rest_frees), and the first and last layers' inputs
        (Step.inputs_held). A planned step whose last layer did not reach remat's dispatch (it ran inside its
        compiled graph) is measured from the outputs the backward pass starts at: its peak, checked against the
        prediction at the end of that pass, as a step measured from its last layer is."""
        if self._calls and self._fixed is None and self._training():
            for t in torch.utils._pytree.tree_leaves(output):
                self._calls[-1].tag(t)
        step = self._step
        if step is not None and step.chain_out_ref is not None:
            # A profiling step: whether the model's code let go of the layers' output before returning (a
            # residual sum over the last layer: StepContext.rest_frees_output).
            step.rest_frees = step.chain_out_ref.expired()
            step.chain_out_ref = None
            # And whether it took the last layer's input too (StepContext.rest_takes_last_input: a residual sum
            # over the last layer, whose backward hands that input the output's gradient, held through the last
            # layer's backward): its graph reaches that input's node other than through the layer's output.
            if step.last_nodes is not None:
                into, made = step.last_nodes
                roots = [t.grad_fn for t in torch.utils._pytree.tree_leaves(output)
                         if isinstance(t, torch.Tensor) and t.grad_fn is not None]
                step.rest_takes_input = graph_reaches(roots, into, made)
        if step is not None:
            stages = step.shape.stages if step.shape is not None else None
            expected = range(len(self.layers)) if stages is None else stages
            in_training = step.in_model_forward and not step.inside and self._training()
            if in_training and not step.off_plan and not set(expected) <= step.layers_called:
                # The last layers were not called (LayerDrop), or none was: as for a layer skipped before another.
                if step.shape is None:
                    step.shape = self._last = self._shapes.setdefault(step.key, Shape(step.key))
                called = max(step.layers_called, default=-1)
                if not step.shape.no_backward:
                    layers_skipped(self, step, [j for j in expected if j > called], stacklevel=6)  # (the model's call)
            if in_training and step.abandoned and step.shape is not None and step.shape.chain is None:
                # A step that was to profile and did not: the layers it called are the next one's to profile, where
                # it calls those (Shape.stages; not where one it did not call was in eval mode).
                called = frozenset(step.layers_called)
                uncalled = [j for j in range(len(self.layers)) if j not in called]
                step.shape.tried = called if uncalled and all(self.layers[j].training for j in uncalled) else None
                step.shape.stages = None  # (a try of those that called others: the next one tries this one's)
                if agreement.agreeing(self.agree, self.who):
                    self._join_agreement_at_backward_end(output)
            step.in_model_forward = False
            step.last_nodes = None
            # A profiling step: whether anything held the last layer's input past its forward, and the first
            # layer's into the backward pass (StepContext.inputs_held_in_forward; held where not read).
            step.last_input_alive(len(expected) - 1)
            step.read_input_past_forward(0)
        if step is None or step.done or step.measured or step.off_plan or step.skipped or step.key is None:
            return
        shape = self._shapes.get(step.key)
        if shape is None or shape.choices is None or step.shape not in (None, shape):
            return
        step.shape = shape
        outs = [t for t in torch.utils._pytree.tree_leaves(output)
                if isinstance(t, torch.Tensor) and t.requires_grad and t.grad_fn is not None]
        if outs:
            measure_planned_step(step, shape, outs, lambda: self._check_prediction(shape), retime=False)

    def _join_agreement_at_backward_end(self, output) -> None:
        """Under agree, a step that was to profile and profiled nothing (it skipped layers): at the end of its
        backward pass it meets the other ranks' agreement as one that has nothing to agree on (_profiled_on_every
        _rank), so that theirs waits for nothing."""
        outs = [t for t in torch.utils._pytree.tree_leaves(output)
                if isinstance(t, torch.Tensor) and t.requires_grad and t.grad_fn is not None]
        if not outs:
            return
        joined = []

        def hook(g):
            if not joined:
                joined.append(True)
                queue_at_backward_end(lambda: self._profiled_on_every_rank(None))
            return g

        for t in outs:
            t.register_hook(hook)

    def _profiled_on_every_rank(self, stages: tuple[int, ...] | None) -> bool:
        """Under agree, at the end of a profiling step's backward pass, before the ranks agree on its figures:
        whether every rank profiled, and profiled the same layers (one all-reduce of 2n + 1 integers, n the
        layers). `stages`: the layers this rank profiled (indices into `layers`; Shape.stages, or every layer),
        None where it profiled nothing. A rank whose step skipped layers (a vision-language model's text-only
        batch where another rank's has images, LayerDrop's draws) has no figures to agree on, and one that
        profiled a text-only shape's layers (Shape.stages) has figures of another chain than a rank that profiled
        every layer: then no rank plans from this step, and the next one profiles again on every rank. Before
        (found 2026-12-07), the other ranks' agreement waited for one that profiled nothing until the process
        group's timeout (Gloo: "Timed out waiting ... for recv"); NCCL would hang. Ranks whose steps all
        profiled the same layers (the same kind of batch on every rank, as LLaVA's data groups text-only samples)
        agree on them."""
        n = len(self.layers)
        called = [0] * n if stages is None else [int(j in stages) for j in range(n)]
        told = agreement.most([int(stages is None)] + called + [-c for c in called])
        everywhere = told[0] == 0 and all(told[1 + j] == -told[1 + n + j] for j in range(n))
        if not everywhere and stages is not None and "ranks" not in self._skips_said:
            self._skips_said.add("ranks")
            warnings.warn(f"{self.who}: another rank's step called other layers than this one's in a step that was "
                          "to profile them (a vision-language model's text-only batch where this rank's had images, "
                          "or LayerDrop's draws), and the ranks agree on one plan (agree, on by default under a "
                          "process group): none is made from this step, and the next one profiles again on every "
                          "rank; a plan is made at a step whose ranks all call the same layers (text-only batches "
                          "on every rank are planned for the layers they call). With agree=False each rank plans "
                          "alone", stacklevel=2)
        return everywhere

    def _begin_step(self, key, device: torch.device, collect_garbage: bool = False) -> Step:
        """The training step under `key` beginning now on `device` (at the model's call, or at the first layer's
        where the layers are called outside it): a plan borrowed for a new shape (_borrow), the ranks in
        lockstep, the plan for the gradients it begins without put in force (which may raise InfeasibleBudget
        before anything runs), the new-shape warning, and the step made (_new_step), its key published to
        compiled layers. collect_garbage: where the step may profile, garbage in reference cycles is collected
        before the base is read; collected during the step, its tensors' frees would lower the count every
        reading is taken against (a dropped model collected in another's profiling step: docs/BENCHMARKS.md,
        "Figures behind the code")."""
        last = self._step
        if last is not None and last.abandoned and not last.done:
            last.finish()  # (its backward pass has run, or its graph is gone: no call of it is open)
        self._borrow(key)
        sharded = self._sharded_modules()
        grads_none, grads, sizes = self._grads_state(sharded)
        self._profile_in_lockstep(key, grads)
        self._plan_for_grads(key, grads)
        if collect_garbage and (not self._shapes or any(shape.chain is None for shape in self._shapes.values())):
            gc.collect()
        self._new_shape(key)
        step = self._new_step(device, key, grads_none, grads)
        step.grad_sizes = sizes
        step.key = key
        shape = self._shapes.get(key)
        if (shape is None or shape.chain is None) and unsharded_grads_reduced(sharded):
            # A step that would profile, and lets go of unsharded gradients FSDP2 held from micro-batches whose
            # gradient sync was off (gradient accumulation): their frees would lower every reading taken in its
            # backward, and a plan made from it holds more than predicted where nothing is let go of (found
            # 2026-12-08: a Llama's first micro-batches 6.0% above their predictions). It profiles nothing and
            # runs every layer checkpointed (on every rank alike: the ranks accumulate alike); the next step
            # that would profile, a first micro-batch, does.
            step.abandoned = True
        set_step_key(self.layers, key)
        return step

    def _new_step(self, device: torch.device, key, grads_none: set[int], grads: tuple) -> Step:
        """The training step under `key` beginning now on `device`: its base read, and, with a device budget and
        no profile yet for that key (a step that profiles), what the device has (fit.read_device, which raises on
        a device that has no capacity to fill)."""
        shape = self._shapes.get(key)
        profiles = shape is None or shape.chain is None
        reading = fit.read_device(device, self.who, self._budget_text) if self.fit is not None and profiles else None
        step = Step(meter_for(device), grads_none)
        step.grads_key = grads
        if profiles:
            step.watch_outside(self._params, self._outside)
        step.reading = reading
        step.device = device
        if device.type == "cuda":
            oom.attach_observer()
        return step

    def _device_of(self, args) -> torch.device:
        for a in args:
            if isinstance(a, torch.Tensor):
                return a.device
        for p in self._params:
            return p.device
        return torch.device("cpu")

    def dispatch(self, i: int, fn: Callable, *args):
        """Runs layer i's call fn(*args) (args[0] its input tensor) as the plan in force says, or profiles it
        (remat.dispatch)."""
        return dispatch(self, i, fn, *args)

    # -- planning -------------------------------------------------------------------------------------------------
    def _plan_shape(self, step: Step, shape: Shape):
        """The end of a profiling step's backward pass: its step context measured, agreed on by the ranks, the
        shape planned."""
        self._note_gradless(step)
        self._buckets.observe(self._params)  # (its plan is for the state it began in; the next step's may differ)
        graph_state_not_run(self, step)
        ctx = step_context(self, step, shape)
        agreeing = agreement.agreeing(self.agree, self.who)
        if agreeing and self.replan_on_overshoot:
            raise ValueError(f"{self.who}: replan_on_overshoot plans again from one rank's measured peak, and the "
                             "ranks of this process group agree on one plan: not both (agree=False to plan each "
                             "rank on its own)")
        if agreeing:
            stages = tuple(range(len(self.layers))) if shape.stages is None else shape.stages
            if not self._profiled_on_every_rank(stages):
                # Profiled again at its next step; one profiled for the layers its step called, those again.
                self._shapes[shape.key] = Shape(shape.key)
                self._shapes[shape.key].tried = None if shape.stages is None else frozenset(shape.stages)
                return
            agreement.agree(shape.chain, ctx)
        if self.fit is not None:
            r = step.reading.room
            shape.room = (r.free_bytes, r.cached_bytes, r.total_bytes,
                          fit.lost_bytes(step.reading, max(step.true_peak, step.profiling_peak) - step.base))
            if agreeing:  # every rank plans for the room of the tightest
                shape.room = agreement.least_room(shape.room)
        shape.context = ctx
        shape.grads_key = step.grads_key
        shape.grads_in_rest = step.grads_in_rest
        shape.measured_outside = self._outside_of(step.grads_key)
        shape.measured_outside_sizes = self._outside_sizes(step.grads_key)
        self._outside_phase.update(step.outside_phase)
        shape.charged = {step.grads_key: list(ctx.stage_grads_bytes) + [0, 0, 0]}
        self._plan_from(shape, ctx)

    def _check_prediction(self, shape: Shape) -> None:
        """The end of a planned step's backward pass: its measured peak checked against the prediction (the
        planner library's rule, which remat::Planned follows too), a warning when beyond the tolerance, and
        with replan_on_overshoot a new plan for the budget less the overshoot (once per input shape, so never
        in a loop; a budget only goes down)."""
        if shape.predicted <= 0 or shape.last_peak < 0 or self._fixed is not None:
            return
        budget = self.budget_bytes
        check = _core.check_prediction(shape.predicted, shape.last_peak, max(budget, 1))
        shape.prediction_error = check.error
        found = self._buckets.observe(self._params) and self._buckets.params
        if check.error <= 0 and (found or self._buckets.pending):
            # Gradients found held in memory that outlives the steps (GradBuckets), or perhaps so (seen to end as
            # views, confirmed or not at the next step's end): this step's plan charged them, the next one's does
            # not where they are (a plan for that gradient state: _plan_for_grads). Below its prediction by them,
            # as expected: not said.
            return
        if shape.borrowed_from is not None:
            # A larger shape's plan: below its prediction is what was expected. Above it (a model whose memory
            # does not only grow with its inputs' sizes), the shape's next step profiles it.
            if check.beyond and check.error > 0:
                self._shapes[shape.key] = Shape(shape.key)
                f = _core.format_bytes
                warnings.warn(
                    f"{self.who}: a step of a new input shape ran the plan of a larger shape (borrow_plans) and held "
                    f"{f(shape.last_peak)} ({shape.last_peak} bytes) above its base, {check.error:.1%} above that "
                    f"plan's prediction of {f(shape.predicted)} (this model's memory does not only grow with its "
                    "inputs' sizes): the next step of this shape profiles it, and it is planned on its own from "
                    "then on", RuntimeWarning, stacklevel=2)
            return
        # Said (and, above, planned again) once per input shape and direction. Before (found 2026-12-07), once per
        # shape: a step below its prediction silenced a later one above it (gradient accumulation's two states
        # run two plans of one shape).
        above = check.error > 0
        if check.beyond and not above and shape.from_example:
            # Profiled on an example batch (enable(example=), remat.max_batch), whose step holds the model's
            # outputs through its backward pass, as `out = model(**batch); out.loss.backward()` does: a training
            # loop that lets go of them first (Trainer keeps the loss only) holds less, its logits' bytes at most.
            # Its next step of this shape is profiled as the loop runs it. Before (found 2026-12-07), such steps
            # stayed planned from the example's: a Llama's 11.7% below their prediction (a logits tensor).
            self._shapes[shape.key] = Shape(shape.key)
            f = _core.format_bytes
            warnings.warn(f"{self.who}: the planned step held {f(shape.last_peak)} ({shape.last_peak} bytes) above "
                          f"its base, {abs(check.error):.1%} below the prediction made from the example batch's step "
                          "(whose loop holds the model's outputs through its backward pass; this one holds less, as "
                          "a loop that keeps only the loss does): the next step of this input shape is profiled as "
                          "this loop runs it, and planned from that", RuntimeWarning, stacklevel=2)
            return
        if not check.beyond or (shape.replanned if above else shape.said_below):
            return
        f = _core.format_bytes
        words = (f"{self.who}: the planned step held {f(shape.last_peak)} ({shape.last_peak} bytes) above its base, "
                 f"{abs(check.error):.1%} {'above' if check.error > 0 else 'below'} the plan's prediction of "
                 f"{f(shape.predicted)} (tolerance {_core.PREDICTION_TOLERANCE:.0%}; plan {shape.plan})")
        if check.error < 0:
            words += ("; the plan recomputes more than the budget needs (a step that held less is not planned "
                      "again for more: nothing measured says a faster plan would fit)")
        elif not self.replan_on_overshoot:
            words += (f", budget {f(budget)}; replan_on_overshoot=True plans again for the budget less the "
                      "overshoot")
        else:
            lowered = budget - check.replan_budget_bytes
            shape.lowered += lowered
            try:
                self._plan_from(shape, self._context_in_force(shape))
                words += (f"; replan_on_overshoot: planned again below the budget by {f(lowered)}: the next step "
                          f"runs the plan {shape.plan}, predicted {f(shape.predicted)}")
            except _core.InfeasibleBudget as e:
                shape.lowered -= lowered
                shape.error = None
                self._plan_from(shape, self._context_in_force(shape))  # the plan that ran, as before
                words += (f"; replan_on_overshoot: no plan fits below the budget by {f(lowered)} (the least "
                          f"feasible budget is {f(e.min_bytes)}); the plan is unchanged")
        if above:
            shape.replanned = True  # warned (and planned again) once per input shape
        else:
            shape.said_below = True
        warnings.warn(words, RuntimeWarning, stacklevel=2)

    def _plan_from(self, shape: Shape, ctx):
        chain = shape.chain
        budget = self.budget
        if self.fit is not None:
            budget = shape.budget = fit.fitted_budget(shape.room, self.fit)  # 0 when the margin takes all: refused
        # Below it by what a step measured above its prediction took (replan_on_overshoot).
        budget -= shape.lowered
        try:
            # Where the model refuses a budget that the profiling step's measured schedule (every layer
            # checkpointed) fits, plan_step falls back to that schedule (ctx.checkpoint_all_peak_bytes).
            plan, predicted = self._planned(shape, ctx, max(budget, 1))
        except _core.InfeasibleBudget as e:
            least = e.min_bytes
            err = e if self.choose_plan is not None else _core.InfeasibleBudget(
                f"{self.who}: the budget of {_core.format_bytes(budget)} ({budget} bytes){self._fitted_words(shape)} "
                f"is below the "
                f"least feasible one, {_core.format_bytes(least)} ({least} bytes): the step's peak "
                f"above the bytes alive when the model's forward is called, with every layer checkpointed (the "
                f"layers keep their inputs, {_core.format_bytes(chain.input_bytes)} each at the input's size; what "
                f"runs before them holds {_core.format_bytes(ctx.before_saved_bytes)}; the rest of the step peaks "
                f"at {_core.format_bytes(ctx.rest_peak_bytes)}; the backward pass allocates "
                f"{_core.format_bytes(sum(ctx.stage_grads_bytes) + max(0, ctx.rest_grads_bytes))} of gradients in the layers and after "
                "them)")
            err.budget_bytes = budget
            err.min_bytes = least  # choose_plan's: its plan's predicted peak
            shape.error = err
            shape.plan = shape.choices = shape.points = None
            shape.predicted = -1
            publish(self.layers, shape, self.policies)
            raise err from None
        shape.plan = plan
        shape.choices = choices_of(plan)
        shape.points = layer_points(plan)
        shape.predicted = predicted
        publish(self.layers, shape, self.policies)

    def _planned(self, shape: Shape, ctx, budget: int) -> tuple:
        """_core.plan_step for `shape` at `budget` bytes, (plan, predicted step peak): planned again only where
        a figure the plan depends on (_core.plan_figures), the budget or the planner's options changed since
        that shape last planned it, so that set_budget back to an earlier budget (a benchmark's rounds) costs
        no planning. Raises InfeasibleBudget as plan_step does (refusals are not kept)."""
        if self.choose_plan is not None:  # its plans are never the planner's, nor kept
            return self._chosen(shape, ctx, budget)
        options = self.offloads.planner_options()
        ints, reals = _core.plan_figures(shape.chain, ctx)
        key = (budget, tuple(self.exclude), tuple(sorted(options.items())), tuple(ints), tuple(reals))
        if shape.planned_chain is not shape.chain:  # profiled again: its plans go
            shape.planned_chain, shape.planned_at = shape.chain, {}
        planned = shape.planned_at.get(key)
        if planned is None:
            with planning_wait(f"{self.who}: planning"):
                step = _core.plan_step(shape.chain, ctx, budget, "per-layer", self.exclude, **options)
            if len(shape.planned_at) >= PLANS_KEPT:
                shape.planned_at.pop(next(iter(shape.planned_at)))
            planned = shape.planned_at[key] = (step.plan, step.step_peak_bytes)
        return planned

    def _chosen(self, shape: Shape, ctx, budget: int) -> tuple:
        """choose_plan's plan for `shape` at `budget` bytes, (plan, predicted step peak): a per-layer plan for the
        profiled layers (ValueError naming it otherwise; TypeError for no remat.Plan), predicted by
        step_peak_bytes and held to the budget (remat.InfeasibleBudget above it, a ValueError, its min_bytes the
        plan's predicted peak). What the function raises goes through as it is. Not kept: called at each
        planning, as C++'s PlannedOptions::choose_plan."""
        f = _core.format_bytes
        plan = self.choose_plan(shape.chain, ctx, budget)
        if not isinstance(plan, _core.Plan):
            raise TypeError(f"{self.who}: choose_plan returned a {type(plan).__name__}, not a remat.Plan")
        try:
            choices_of(plan)
            if plan.num_stages != len(shape.chain.stages):
                raise ValueError(f"the plan is for {plan.num_stages} stages but the profile has "
                                 f"{len(shape.chain.stages)}")
            predicted = _core.step_peak_bytes(shape.chain, ctx, plan)
            plan.predicted = _core.simulate(shape.chain, plan)  # as the planner's plans carry it
        except ValueError as e:
            raise ValueError(f"{self.who}: choose_plan's plan {plan} is not one for the profiled layers: {e}") from None
        if predicted > budget:
            # As a budget no plan fits: the shape keeps no plan (set_budget), or the plan in force stays
            # (another state of the gradients, replan_on_overshoot).
            err = _core.InfeasibleBudget(f"{self.who}: choose_plan's plan {plan} is predicted to peak at "
                                         f"{f(predicted)} ({predicted} bytes), above the budget of {f(budget)} "
                                         f"({budget} bytes)")
            err.budget_bytes, err.min_bytes = budget, predicted
            raise err
        return plan, predicted

    def _fitted_words(self, shape: Shape) -> str:
        """How a device budget's bytes were made, for messages ("" for a budget in bytes)."""
        if self.fit is None or shape.room is None:
            return ""
        return f" (budget={self._budget_text!r}: {self.fit:.0%} of {fit.describe(shape.room)})"

def enable(model: nn.Module, layers: Sequence[nn.Module], *, budget=None, plan=None, policies=("matmuls",),
           repeats: int = 1, exclude: Sequence[str] = (), agree=None, offload: bool = False, max_host_bytes=None,
           offload_min_bytes: int = 1 << 20, groups: bool = False, replan_on_oom: bool = False,
           replan_on_overshoot: bool = False, borrow_plans: bool = True, choose_plan=None) -> LayerPlan:
    """Runs `layers` (the model's own modules, called in this order by its forward, each with its input tensor
    as the first positional argument) per layer as planned: for `budget` (bytes, a string such as "300MiB", or a
    device budget, "auto" or "90%": that share of what the CUDA device has free when the profiling step begins,
    less a margin, remat.fit;
    the whole step's peak above the bytes alive when `model`'s forward is called; planned in place at the first
    training step per input shape), or as a given per-layer `plan` (remat.per_layer's). choose_plan: a plan of
    your own in place of the planner's, made from each shape's profile: called where remat would plan (after the
    profiling step, for another state of the gradients, after replan_on_overshoot) as choose_plan(chain,
    context, budget) -> remat.Plan, a per-layer plan (remat.Plan.from_json, remat.per_layer) run, predicted
    (remat.step_peak_bytes) and checked as remat's own; TypeError where it returns no remat.Plan, ValueError
    where the plan is not one for the profiled layers, remat.InfeasibleBudget (a ValueError) where it is
    predicted above the budget (C++'s PlannedOptions::choose_plan). policies: the selective policies a layer may
    run under ("matmuls" by default; a dict name -> policy function for your own).
    Each layer's forward is wrapped (an instance attribute running the class's forward; LayerPlan.remove()
    puts it back). Layers compiled one by one (layer.compile(), torch.compile(layer)) run the plan inside their
    compiled graphs (the profiling step runs them eagerly, then profiles them through their graphs). In eval mode or
    under no_grad the layers run plainly. Raises ValueError/TypeError for bad arguments; at the end of the
    profiling step's backward pass, remat.InfeasibleBudget naming the least feasible budget when none fits.
    agree: every rank of a torch.distributed process group plans from the same numbers (each figure's maximum
    over the ranks), so that all run the same plan, one that fits each (C++'s PlannedOptions::agree); None (the
    default) turns it on when a process group of more than one rank is initialized. The ranks then profile in
    lockstep (one all-reduce of an integer as each training step begins): where any rank's input shape is new to
    it, every rank profiles that step; so do the ranks of layers FSDP2 shards, agree or not.
    offload=True: the planner may also offload a layer (its choice "keep@host", "checkpoint@host" or a policy's,
    "matmuls@host": what it saves, a checkpointed layer's input, or a policy's kept tensors and its input,
    copied to host memory while the next layer runs and brought back while the backward pass runs the layer
    after it; saved tensors of at least offload_min_bytes), where that
    is the fastest way to fit the budget; the profiling step also measures what each layer would offload and the
    copies' bandwidth each way. max_host_bytes (bytes, or a size string) bounds the host memory a plan holds
    (LayerPlan.predicted_host_bytes; the pool's own counts in LayerPlan.host_pool).
    groups=True: the profiling step also measures each layer's saved groups (the calls whose outputs autograd
    saves, remat.profile's groups), and the planner may run a layer under a group assignment (its choice
    "{khr}": each group kept on the device, sent to the host when offload=True, or recomputed, the rest of the
    layer recomputed); off by default until measured on a GPU.
    replan_on_oom=True: an out-of-memory error in a planned step lowers the budget to the one that would have fit
    and plans again, so that the next step runs (remat.oom; the error's note says what was done). Off by
    default: either way the error carries remat's words (the plan, its predicted peak against the budget, what
    the allocator reserved, the budget that would have fit).
    replan_on_overshoot=True: a planned step whose measured peak is above the plan's prediction by more than
    remat.PREDICTION_TOLERANCE (2%) plans again for the budget less the overshoot, so that the next plan, held
    above its prediction as much, stays within the budget; once per input shape (a step that held less is
    reported, not planned again for more). Off by default: either way LayerPlan.prediction_error reports the
    last step's error, and a warning says when it is beyond the tolerance. Not with ranks that agree (one
    rank's measurement would part their plans): ValueError.
    borrow_plans=True (the default): a training step of a new input shape that a planned shape covers (the
    same tensors, dtypes and ranks, no size larger: a shorter sequence, a smaller last batch) runs the plan of
    the covering shape with the fewest elements instead of profiling (LayerPlan.borrowed_shapes,
    plan_borrowed); a step that holds more than that plan predicted is warned of, and its shape profiled at its
    next step. Such a plan can recompute more than the smaller shape needs; False profiles every new shape."""
    lp = LayerPlan(model, layers, budget=budget, plan=plan, policies=policies, repeats=repeats, exclude=exclude,
                   agree=agree, offload=offload, max_host_bytes=max_host_bytes,
                   offload_min_bytes=offload_min_bytes, groups=groups, replan_on_oom=replan_on_oom,
                   replan_on_overshoot=replan_on_overshoot, borrow_plans=borrow_plans, choose_plan=choose_plan)
    for i, layer in enumerate(lp.layers):
        if "forward" in layer.__dict__:
            lp.remove()
            raise ValueError(f"remat.enable: layer {i}'s forward is already wrapped (remat.enable twice, or "
                             "another library's wrapper?); remat runs the class's forward")
    for layer in lp.layers:
        layer.__dict__[LAYER_PLAN_ATTR] = lp
        layer.forward = PlannedForward(layer).forward  # one graph per choice for every compiled layer

    lp._handles.append(_Unwrap(lp.layers))
    return lp


class _Unwrap:
    """A handle of remat.enable's: removing it gives the layers their class's forward back."""

    def __init__(self, layers):
        self.layers = layers

    def remove(self):
        for layer in self.layers:
            layer.__dict__.pop("forward", None)
            layer.__dict__.pop(LAYER_PLAN_ATTR, None)


_TORCH_MODULES = os.path.dirname(nn.Module.__init__.__code__.co_filename)
_REMAT = os.path.dirname(os.path.abspath(__file__))


# The training steps LayerPlan._run_whole runs at most, each skipping a layer (LayerDrop), before it gives up.
WHOLE_STEP_TRIES = 16


def parameters_of(model: nn.Module) -> list[nn.Parameter]:
    """model.parameters() as a list, in its order (each module's before its children's, each parameter once), in
    a third of its time (110 to 120 us for a 32-layer Llama's 291 parameters against 350 to 420, medians of five
    runs of 1,000 in three runs on the CI machine's CPU): read at every training step's key, of which the whole
    part (LayerPlan._params_key: the walk, the dtypes and shapes compared, the frozen ones) took 210 us there."""
    out, seen, stack = [], set(), [model]
    while stack:
        module = stack.pop()
        for p in module._parameters.values():
            if p is not None and id(p) not in seen:
                seen.add(id(p))
                out.append(p)
        children = module._modules
        if children:  # (most modules have none)
            stack.extend(reversed([m for m in children.values() if m is not None]))
    return out


def _params_part(part) -> bool:
    """Whether a step key's third entry is the parameters' part of today (_params_key's: the frozen indices, the
    form's id), not the frozen indices alone of an earlier remat's pickle."""
    return isinstance(part, tuple) and len(part) == 2 and isinstance(part[0], tuple)


def _varying(keys: list) -> str:
    """The step keys' input shapes in words, for _new_shape's warning: the shapes of the first tensor whose shape
    differs between them, named by where it was passed (input_ids: (8, 128), (8, 120), ...; the last eight), or,
    where no tensor's shape tells them apart, words that say they differ in other tensors or frozen parameters."""
    calls = [k[1] for k in keys]
    if len({len(c) for c in calls}) == 1:
        for j in range(len(calls[0])):
            shapes = [tuple(c[j][-2]) for c in calls]
            if len(set(shapes)) > 1:
                more = "..., " if len(shapes) > 8 else ""
                return f"{_where(keys[0][0], j, calls[0][j])}: {more}" + ", ".join(map(str, shapes[-8:]))
    return ("keys that differ in other tensors, in which parameters are frozen, in the parameters' dtypes or "
            "shapes, or in the autocast state")


def _where(kind: str, j: int, entry: tuple) -> str:
    """Where the j-th tensor of a step key (call_key's entry, or layer_key's for layers called outside the
    model's forward) was passed: "input_ids", "args[0]", "the first layer's input"."""
    if kind != "model":
        return "the first layer's input" if j == 0 else f"tensor {j} of the first layer's call"

    def name(where):
        if not isinstance(where, tuple):
            return str(where)
        head, last = where
        return (last if head == "kwargs" else f"{name(head)}.{last}") if isinstance(last, str) \
            else f"{name(head)}[{last}]"

    return name(entry[0])


def _caller_level() -> int:
    """warnings.warn's stacklevel, for a warning given by its caller, that names the first line outside remat and
    torch.nn's module calls: the line that called the model (a hook's warning)."""
    level, frame = 1, sys._getframe(1)
    while frame.f_back is not None and os.path.dirname(os.path.abspath(frame.f_code.co_filename)) in (_TORCH_MODULES,
                                                                                                      _REMAT):
        frame = frame.f_back
        level += 1
    return level
