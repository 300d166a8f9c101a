"""The layers' dispatch: each planned layer's call, run as the plan in force says (kept, checkpointed, under a
policy, offloaded), profiled in a profiling step, or checkpointed where no plan holds."""
from __future__ import annotations

import contextlib
import warnings
from functools import partial
from typing import TYPE_CHECKING, Callable

import torch
from torch import nn

from .compiled import AROUND, CHOICES_ATTR, FORCED_ATTR, choice_of, compiled_call, noted_around, ran_eagerly
from .layer_calls import covers, describe, layer_key, layer_output
from .layer_offload import carry_out_then
from .measure_step import Shape, Step, measure_planned_step, profiling_call, sharded_modules
from .policies import CHECKPOINT, is_groups, is_streamed, run_layer, split_choice
from . import oom

if TYPE_CHECKING:
    from .layer_plan import LayerPlan

__all__ = ["LAYER_PLAN_ATTR", "PlannedForward", "around_compiled", "dispatch", "layer_begins", "layer_ends",
           "layers_skipped", "planned_forward", "run"]

LAYER_PLAN_ATTR = "_remat_layer_plan"
# The steps of one input shape that were to profile it and skipped a layer (LayerDrop) at which that is said again.
SKIPPED_PROFILES_WARNED_AT = 8


# -- a layer's call -------------------------------------------------------------------------------------------------
def planned_forward(self: nn.Module, *args, **kwargs):
    """The forward remat.enable gives each layer (bound to it): the class's forward, run as the plan says. One
    function for every layer, so that torch.compile shares a graph between layers that run alike."""
    fn = partial(type(self).forward, self, **kwargs)
    lp = self.__dict__[LAYER_PLAN_ATTR]
    if torch.compiler.is_compiling():
        return compiled_call(lp, self, fn, args)
    # A choice forced by the profiler outside a trace: torch.compile ran the layer's compiled call eagerly (as
    # it does past its recompile limit, torch._dynamo.config.recompile_limit), and the choice runs so, not as
    # another call of the layer in the step (before 2026-12-03 an IndexError in the profiling step, on
    # PyTorch 2.11 with three layers compiled one by one, whose graphs were one per layer and choice there
    # until PlannedForward, and count against one code object's limit).
    if self.__dict__.get(FORCED_ATTR):
        ran_eagerly(lp, self)
        return compiled_call(lp, self, fn, args)
    if noted_around(self):  # the same, in a planned step whose part outside the graph around_compiled did
        return compiled_call(lp, self, fn, args)
    if kwargs and self.training and torch.is_grad_enabled():
        _refuse_cache(lp, self, kwargs)
    return lp.dispatch(lp.index[id(self)], fn, *args)


# Per type of a layer's keyword argument: whether it is a Transformers cache (transformers.cache_utils.Cache or a
# model's own subclass of one).
_IS_CACHE: dict[type, bool] = {}


def _refuse_cache(lp: "LayerPlan", layer: nn.Module, kwargs: dict) -> None:
    """A layer called in training with a Transformers cache (past_key_values, use_cache=True) under remat.enable:
    the profiling step and the recomputes run the layer again, and each run appends to the cache, so that a layer
    profiled reads keys of an earlier run whose graph is gone. Refused by name before the layer runs. Before
    (found 2026-12-07) remat.enable(model, model.model.layers, ...) on a Transformers Llama, whose config keeps the
    cache on, failed in the profiling step with "Trying to backward through the graph a second time".
    remat.hf.enable turns the cache off in training, as Hugging Face's own checkpointing does."""
    for name, v in kwargs.items():
        t = type(v)
        cache = _IS_CACHE.get(t)
        if cache is None:
            cache = _IS_CACHE[t] = any(c.__module__ == "transformers.cache_utils" for c in t.__mro__)
        if cache:
            raise ValueError(
                f"{lp.who}: layer {lp.index[id(layer)]} ({type(layer).__name__}) was called in training with a "
                f"cache ({name}={t.__name__}): remat runs a layer again to profile and to recompute it, and each "
                "run would append to the cache. Turn the cache off in training (model(..., use_cache=False), or "
                "model.config.use_cache = False; a vision-language model's model.config.text_config.use_cache), "
                "or plan with remat.hf.enable, which turns it off as Hugging Face's checkpointing does")


class PlannedForward:
    """What remat.enable sets as a layer's forward: PlannedForward(layer).forward, planned_forward bound to the
    layer through this holder. A bound method of the holder, not a partial of planned_forward (remat before
    e85dea9 of 2026-12-03, which copies pickled then still hold, and which still run): torch.compile on PyTorch
    2.11 guards a layer's own forward by identity where it is a partial (a graph per layer and choice: three
    layers under three choices passed dynamo's recompile limit of 8 and ran eagerly), and by its function's code
    where it is a bound method (one graph per choice, shared by the layers, as 2.15 shares them for either). It
    pickles and deep-copies with its layer (getattr(holder, "forward") on the copy), which a method bound to the
    layer itself would not (the layer has no attribute of planned_forward's name)."""

    def __init__(self, layer: nn.Module):
        self.layer = layer

    def forward(self, *args, **kwargs):
        return planned_forward(self.layer, *args, **kwargs)


def dispatch(lp: "LayerPlan", i: int, fn: Callable, *args):
    """Runs layer i's call fn(*args) (args[0] its input tensor) as the plan in force says, or profiles it."""
    layer = lp.layers[i]
    if not (torch.is_grad_enabled() and layer.training):
        return fn(*args)
    if not args or not isinstance(args[0], torch.Tensor):
        raise TypeError(f"{lp.who}: layer {i} ({type(layer).__name__}) was called without its input tensor "
                        "as the first positional argument; remat follows the tensor passed there from layer "
                        "to layer")
    x = args[0]
    step = lp._step
    first = i == 0  # the step's first layer call
    missed: list[int] = []
    if step is not None and step.in_model_forward and not step.inside and not lp._unmeasured:
        if i in step.layers_called:
            # The plan's model is a chain of layers each called once per step, in order. A module the model calls
            # several times (ALBERT's one layer group, called for every layer) was taken, each time it came
            # round, for a step of its own begun outside the model's forward: a 4-layer ALBERT's planned step held
            # 75% above its prediction (found 2026-12-06; its gradients were the plain run's).
            raise RuntimeError(
                f"{lp.who}: layer {i} ({type(layer).__name__}) was called a second time in one call of the model; "
                "remat plans layers that the model calls once each per step, in order, and a module it calls "
                "several times (ALBERT's shared layer group) cannot be one of them: leave it out of the layers "
                "and checkpoint its calls with remat.checkpoint, or plan modules that are called once")
        last = max(step.layers_called, default=-1)
        if i < last:
            raise RuntimeError(f"{lp.who}: layer {i} ran after layer {last} in a training step; the layers must "
                               "run in the order given")
        # Layers the model did not call since the last one (LayerDrop: BART's encoder_layerdrop, Wav2Vec2's
        # layerdrop skip each layer at random in training; those a shape's steps never call are not its stages).
        missed = list(range(last + 1, i))
        first = last < 0
        step.layers_called.add(i)
    if lp._unmeasured or (i > 0 and step is not None and (step.off_plan or step.abandoned)):
        # (The schedule's points for the layers before still hold: their copies are waited for and come back.)
        return run(lp, i, CHECKPOINT, fn, args, step.shape if step is not None else None)
    if lp._fixed is not None:  # a given plan: nothing to measure
        lp._last = lp._fixed
        return run(lp, i, lp._fixed.choices[i], fn, args, lp._fixed)
    if first:
        if i == 0 and (step is None or step.shape is not None):  # layers called outside the model's forward
            # Outside the model's forward: the first layer's shapes (and the frozen parameters and the autocast
            # state, as for the model's).
            step = lp._step = lp._begin_step(lp._step_key("layer 0", layer_key(fn, args)), x.device)
            step.input_in_base = True  # the base is taken here, the layers' input alive
        key = step.key
        shape = lp._shapes.setdefault(key, Shape(key))
        step.shape = shape
        lp._last = shape
        if shape.error is not None:
            raise shape.error
        if (shape.chain is None and shape.stages is None and shape.tried is not None and i == min(shape.tried)
                and lp._takes_stages(shape)):
            # The last step that was to profile this shape called only these layers: this one profiles them.
            shape.stages = tuple(sorted(shape.tried))
    if step is None or step.shape is None:
        raise RuntimeError(f"{lp.who}: layer {i} ran before layer 0 in a training step; the layers must run "
                           "in the order given")
    shape = step.shape
    if shape.no_backward:  # every layer frozen on an input that needs no gradient: nothing to plan
        return fn(*args)
    k = shape.stage_of(i)  # its stage in the shape's chain
    if shape.stages is not None:
        missed = [j for j in missed if j in shape.stages]
        if k is None:
            _outside_stages(lp, step, shape, i)
    skipped = layers_skipped(lp, step, missed) if missed else []
    if skipped and shape.stage_of(skipped[0]) == 0:
        lp.offloads.begin_step()  # (run's at the first layer, which this step did not call)
    if step.abandoned or step.off_plan:
        return run(lp, i, CHECKPOINT, fn, args, shape)
    if shape.choices is not None:
        if shape.layer_keys is not None and not _planned_for(shape, k, layer_key(fn, args)):
            return _off_plan(lp, step, shape, i, fn, args)
        if first:
            oom.running(lp)
        out = run(lp, i, shape.choices[k], fn, args, shape, explained=True)
        if k == len(shape.choices) - 1 and not step.skipped:
            main, _ = layer_output(out, lp.who, i, layer)
            if main.requires_grad:
                measure_planned_step(step, shape, main, lambda: lp._check_prediction(shape))
        return out
    return profiling_call(lp, step, shape, k, fn, args, x)


def _outside_stages(lp: "LayerPlan", step: "Step", shape: "Shape", i: int) -> None:
    """The model's forward called layer i, which the shape's chain has no stage for (Shape.stages: the layers
    the steps that profiled it called). A step that was to profile it profiles nothing (the layers from here on
    run checkpointed), and the next one profiles every layer, or those this one called; a planned shape's plan
    is dropped, and the shape profiled again at its next step, of every layer it calls (LayerPlan._whole_only:
    its steps do not call the same layers each time, as under LayerDrop). This step runs the layers from here on
    checkpointed, measured by nothing."""
    if shape.choices is None:
        step.abandoned = True
        step.calls = []
        shape.stages = None
        shape.skipped_profiles += 1
        return
    step.off_plan = True
    lp._whole_only.add(shape.key)
    lp._shapes[shape.key] = Shape(shape.key)
    warnings.warn(f"{lp.who}: the model's forward called layer {i} ({type(lp.layers[i]).__name__}), which the "
                  f"steps that profiled this input shape did not call (they called layers {list(shape.stages)}, "
                  "and it was planned for those): the rest of this step runs every layer checkpointed, and the next "
                  "step of this shape profiles it again, planned for every layer it calls from then on",
                  stacklevel=4)


def layers_skipped(lp: "LayerPlan", step: "Step", missed: list[int], stacklevel: int = 4) -> list[int]:
    """The model's forward did not call the layers `missed` in this training step; returns those of them taken
    as skipped (LayerDrop: BART's and Whisper's `encoder_layerdrop`, Wav2Vec2's `layerdrop` skip each layer at
    random in training; dispatch, or LayerPlan._forward_ends for the last layers): all but, in a planned step, the
    layers compiled on their own, which run a planned step's choice in their graphs without reaching remat's
    dispatch (in a profiling step every layer reaches it). A planned step runs its plan for the layers called, and is
    not measured against its prediction (which is of every layer). A step that was to profile profiles nothing:
    a profile is of every layer, so the layers from here on run checkpointed, and the next step profiles again
    (Shape.skipped_profiles counts such steps). Each said once per LayerPlan, the first again at the
    SKIPPED_PROFILES_WARNED_AT-th such step of a shape. Before (found 2026-12-07), a 4-layer BART with
    encoder_layerdrop 0.5 raised "layer 1 ran before layer 0" where the first was skipped, and where another
    was, its profile had too few stages (a ValueError from the planner library at the end of the backward pass,
    at every later step too)."""
    shape = step.shape
    profiling = shape.choices is None
    skipped = missed if profiling else [j for j in missed if j not in lp.compiled_layers]
    if not skipped:
        return skipped
    step.skipped.extend(skipped)
    if profiling and not step.abandoned:
        step.abandoned = True
        step.calls = []  # (the layers before hold their inputs in their checkpoints)
        shape.skipped_profiles += 1
    evals = [j for j in skipped if not lp.layers[j].training]
    kind = "eval" if evals else "profiling" if profiling else "planned"
    again = profiling and shape.skipped_profiles == SKIPPED_PROFILES_WARNED_AT
    if kind in lp._skips_said and not again:
        return skipped
    lp._skips_said.add(kind)
    names = ", ".join(f"{j} ({type(lp.layers[j]).__name__})" for j in evals or skipped)
    if evals:
        # A layer in eval mode in a training step (its dropout off): run as it is, not through remat (Hugging
        # Face's layers call their checkpointing function only in training mode). Before (found 2026-12-07), its
        # profile had too few stages: a ValueError at the end of every step's backward pass.
        warnings.warn(f"{lp.who}: layer {names} is in eval mode in this training step (its `training` flag off), "
                      "and runs as it is, not through remat; a plan is of every layer, so "
                      + ("none is made: the layers from there on run checkpointed, measured by nothing" if profiling
                         else "this step is not measured against its prediction")
                      + "; put every layer in training mode (model.train()) for remat to plan them",
                      stacklevel=stacklevel)
        return skipped
    if profiling:
        done = ("this step was to profile the layers it calls: it profiled nothing, the layers from the first one "
                "skipped ran checkpointed, and the next training step of this input shape profiles again, of the "
                "layers this one called where it calls the same ones (a vision-language model's text-only batches "
                "call no vision or cross-attention layer: their second step is profiled and planned for the layers "
                f"they call), else of every layer ({shape.skipped_profiles} such steps for this input shape so far; "
                "under LayerDrop's probability p a step runs all n layers with probability (1 - p)^n: where that is "
                "small, set the model's layerdrop to 0 for the first steps of each input shape)")
    else:
        done = ("the plan runs for the layers called, and such a step is not measured against its prediction, "
                "which is of every layer")
    warnings.warn(f"{lp.who}: the model's forward did not call layer {names} in this training step (a model that "
                  f"skips layers at random in training, LayerDrop, or a call that runs only some of them); {done}",
                  stacklevel=stacklevel)
    return skipped


def _planned_for(shape: "Shape", i: int, key: tuple) -> bool:
    """Whether layer i's call shapes `key` are those the plan of `shape` was made for: the profiled ones, or for
    a borrowed plan (LayerPlan.borrow_plans) shapes that the covering shape's cover."""
    if shape.borrowed_from is None:
        return key == shape.layer_keys[i]
    return covers(shape.layer_keys[i], key)


def _off_plan(lp: "LayerPlan", step: "Step", shape: "Shape", i: int, fn: Callable, args: tuple):
    """Layer i's call has shapes other than those the step's plan was made with (shapes that follow the values
    of the batch, or layers called outside the model's forward, whose step is keyed by the first layer's shapes
    only): a plan made for other shapes is not run. This layer and the rest of the step run checkpointed,
    measured by nothing. A borrowed plan's shape is profiled at its next step instead (not warned: the plan was
    remat's guess, not one made for these shapes)."""
    step.off_plan = True
    if shape.borrowed_from is not None:
        lp._shapes[shape.key] = Shape(shape.key)
    elif not shape.warned:
        shape.warned = True
        warnings.warn(
            f"{lp.who}: layer {i} ({type(lp.layers[i]).__name__}) was called with shapes "
            f"{describe(layer_key(fn, args))}, but this step's plan was made with "
            f"{describe(shape.layer_keys[shape.stage_of(i)])} (steps are told apart by the shapes of the model's "
            "inputs, or of the first layer's when the layers are called outside the model's forward); the rest of such "
            "a step runs every layer checkpointed, and its peak is not what was planned", stacklevel=4)
    return run(lp, i, CHECKPOINT, fn, args, shape)


def run(lp: "LayerPlan", i: int, how: str, fn: Callable, args: tuple, shape: "Shape | None" = None,
        explained: bool = False):
    """Layer i's call as its choice says. Offloaded ("...@host"): under its own Offload's hooks, on the host
    pool. With the step's shape, the plan's offload schedule is carried out (the planner's, which simulate()
    charges): typically the previous layer's copies to the host are waited for once this layer's forward has
    run, and when the backward pass reaches this layer's output the previous layer's tensors start coming
    back (so that their copies overlap this layer's backward). explained: a planned step's call, whose
    out-of-memory errors carry remat's words (_Explained)."""
    # A group assignment: its sent groups go through the layer's Offload (not opened as hooks: the layer's input
    # and the rest stay, as the chain's group figures count them).
    groups = [g.name for g in shape.chain.stages[shape.stage_of(i)].groups] if is_groups(how) else None
    o = layer_begins(lp, i, how, fn, args, shape)
    out = run_layer(how, _Explained(lp, i, fn) if explained else fn, args, lp.walk_of(i), lp.policies, offload=o,
                    groups=groups)
    layer_ends(lp, i, out, shape)
    return out


def layer_begins(lp: "LayerPlan", i: int, how: str, fn: Callable, args: tuple, shape: "Shape | None"):
    """What the step does as layer i's call under choice `how` begins (run's, and around_compiled's for a layer
    that runs in its compiled graph): the step's offloading begins at the first layer; returns the Offload the
    call runs under when `how` sends anything to the host, else None. (i: an index into lp.layers; the
    offloading's are the shape's stages, Shape.stage_of.)"""
    k = i if shape is None else shape.stage_of(i)
    if k == 0:
        lp.offloads.begin_step()
    return None if k is None else lp.offloads.for_layer(k, how, fn, args, shape, lp.model)


def layer_ends(lp: "LayerPlan", i: int, out, shape: "Shape | None") -> None:
    """What the step does once layer i's forward has run (run's and around_compiled's): the plan's offload
    schedule at the layer (the copies it waits for now; what it carries out when the backward pass reaches the
    layer's output, as a gradient hook on it)."""
    k = None if shape is None else shape.stage_of(i)
    if k is not None and shape.points is not None:
        due = lp.offloads.carry_out_after(k, shape.points)
        if due:
            main, _ = layer_output(out, lp.who, i, lp.layers[i])
            if main.requires_grad:
                main.register_hook(partial(carry_out_then, due))


def around_compiled(lp: "LayerPlan", layer: nn.Module, call: Callable, args: tuple, kwargs: dict):
    """A compiled layer's call `call(*args, **kwargs)` (its compiled call: layer.compile()'s, or the
    torch.compile(layer) wrapper's), outside its graph (compiled.Around). Where the plan in force runs the layer
    inside its graph (compiled.choice_of) and either sends what it saves to the host or has offload-schedule
    points at it, the step's part that torch.compile cannot trace is done here as run() does it: the layer's
    Offload opened around the graph, whose saved tensors its hooks see as the compiled function saves them
    (kept, its operators' saves; checkpointed, its input; under a policy, its input and what the policy keeps),
    and the schedule carried out after. The choice is noted for the traced call (compiled.AROUND), which runs
    the choice's base in its graph only where it was (else eagerly, through lp.dispatch). Else the call as it
    is (no plan: it runs eagerly through lp.dispatch, which does all of this). Called only where some plan of
    lp may offload (Around: LayerPlan._may_offload)."""
    i = lp.index.get(id(layer))
    choices = layer.__dict__.get(CHOICES_ATTR)
    if (i is None or choices is None or layer.__dict__.get(FORCED_ATTR)
            or not (torch.is_grad_enabled() and layer.training) or not args or not isinstance(args[0], torch.Tensor)):
        return call(*args, **kwargs)
    fn = partial(_call_shapes, **kwargs)  # the call's tensors, as layer_key and taken_tensors read a partial's
    how, shape = choice_of(choices, fn, args, lp._shapes, lp._fixed)
    if how is None or is_groups(how) or is_streamed(how):
        return call(*args, **kwargs)
    host = split_choice(how)[1]
    if not host and not (shape is not None and shape.offloads()):
        return call(*args, **kwargs)  # the step offloads nothing: nothing to do outside the graph
    if host and sharded_modules(layer):
        # Sharded by FSDP2: the graph may save the all-gathered parameters as plain tensors (PyTorch 2.11), on
        # storages the Offload cannot tell from activations and that FSDP2 frees after the forward: run eagerly
        # (the call, not noted, leaves its graph for lp.dispatch), where the layer saves them as parameters.
        return call(*args, **kwargs)
    o = layer_begins(lp, i, how, fn, args, shape)
    choices[AROUND] = how
    try:
        with o if host else contextlib.nullcontext():
            out = call(*args, **kwargs)
    finally:
        choices.pop(AROUND, None)
    layer_ends(lp, i, out, shape)
    return out


def _call_shapes(*args, **kwargs):
    """Stands in for a compiled layer's forward in around_compiled's partial, which only its tensors are read of."""
    raise AssertionError("not called")


class _Explained:
    """A planned layer's call (its forward, and its recompute in the backward pass): an out-of-memory error
    raised inside carries remat's words (remat.oom), and remat's observer leaves it to them."""

    def __init__(self, lp: "LayerPlan", i: int, fn: Callable):
        self.lp, self.i, self.fn = lp, i, fn

    def __call__(self, *args):
        oom._depth += 1
        try:
            return self.fn(*args)
        except BaseException as e:
            oom.explain(self.lp, e, self.i)
            raise
        finally:
            oom._depth -= 1
