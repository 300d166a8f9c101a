"""Compiled layers under a plan: layers compiled one by one (``layer.compile()``, ``torch.compile(layer)``) run
their plan's choice inside their compiled graphs.

Each planned layer carries its choices per step key as a plain attribute (CHOICES_ATTR), with the key of the
step in progress (STEP) and, per step key, the shapes the layer was profiled with, which the traced call reads:
dynamo guards on their values, so layers with the same choice share one compiled graph and a new plan
recompiles. The key None holds a given plan's choices, for every shape. What torch.compile cannot trace
(remat's profiling step, streamed layers, group assignments) runs outside the graph through LayerPlan.dispatch;
an offloaded choice runs its base inside the graph, with the layer's Offload opened around the compiled call
(each compiled call is wrapped: Around, remat.dispatch.around_compiled), whose hooks see what the graph saves.
The profiling step then profiles each compiled layer through its compiled call (compiled_entry), its choice set
for each run as a plan with that choice sets it (forced_choice), so that the profile is the compiled graph's.
"""
from __future__ import annotations

import contextlib
import warnings
from functools import partial
from typing import TYPE_CHECKING, Callable, Sequence

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

from .layer_calls import layer_key
from .policies import CHECKPOINT, KEEP, is_groups, is_streamed, policy_fn, split_choice

if TYPE_CHECKING:
    from .layer_plan import LayerPlan
    from .measure_step import Shape

__all__ = ["AROUND", "Around", "CHOICES_ATTR", "FORCED_ATTR", "STEP", "choice_of", "compiled_call", "compiled_call_of",
           "compiled_entry", "compiled_module", "eager_dispatch", "forced_choice", "noted_around", "publish",
           "ran_eagerly", "set_step_key", "unwrap_call", "wrap_call"]

CHOICES_ATTR = "_remat_choices"
# Set on a layer while forced_choice is open (a plain attribute apart from CHOICES_ATTR, which traced calls
# read and dynamo guards on).
FORCED_ATTR = "_remat_forced"
STEP = "step"
# The step key of a call that runs inside an earlier call's step (LayerPlan._inside_earlier_call): every layer
# checkpointed, whatever its shapes.
INSIDE = ("inside an earlier call",)
# The choice around_compiled runs a layer's call under outside its graph (its Offload open, the step's schedule
# carried out), while that call is in progress: compiled_call runs an offloaded choice's base in the graph only
# where it is the choice noted here.
AROUND = "around"


def compiled_module(m):
    """torch.compile(module)'s wrapper (an OptimizedModule): the module it compiles; anything else as it is."""
    try:
        from torch._dynamo.eval_frame import OptimizedModule
    except ImportError:
        return m
    return m._orig_mod if isinstance(m, OptimizedModule) else m


def compiled_call_of(model: nn.Module, layer: nn.Module) -> nn.Module | None:
    """The module whose call runs `layer` compiled: the layer itself after layer.compile(), or the
    torch.compile(layer) wrapper that holds it in `model`; None for a layer that is not compiled on its own."""
    if getattr(layer, "_compiled_call_impl", None) is not None:
        return layer
    try:
        from torch._dynamo.eval_frame import OptimizedModule
    except ImportError:
        return None
    return next((m for m in model.modules() if isinstance(m, OptimizedModule) and m._orig_mod is layer), None)


def compiled_entry(model: nn.Module, layer: nn.Module, fn: Callable) -> tuple[Callable, dict] | None:
    """How the profiler runs `layer` as it runs compiled: (the call that enters its compiled graph, the keyword
    arguments the layer's call `fn` was given), or None when the layer does not run compiled or its call cannot
    be made again. The call is the layer itself after layer.compile(), or the torch.compile(layer) wrapper that
    holds it in `model`; fn is the partial of the layer's forward that remat's call was handed (Hugging Face's
    checkpointing hook's, or remat.enable's planned forward), whose keywords are the call's own."""
    entry = compiled_call_of(model, layer)
    if entry is None:
        return None
    keywords: dict = {}
    while isinstance(fn, partial) and not fn.args:  # keywords bound on top of the forward's partial
        keywords = {**fn.keywords, **keywords}
        fn = fn.func
    if not (isinstance(fn, partial) and len(fn.args) == 1 and fn.args[0] is layer):
        return None
    return entry, {**fn.keywords, **keywords}


@contextlib.contextmanager
def forced_choice(layer: nn.Module, key, layer_key_: tuple, how: str, policies: dict):
    """While it is open, `layer`'s compiled call runs choice `how` (KEEP, CHECKPOINT or a policy's name) for
    calls with the shapes `layer_key_` under step key `key`: the entries publish() makes, as a plan with that
    choice would (so that the graph compiled for it is the one a planned step with that choice runs). Puts the
    layer's choices back as they were on exit."""
    choices = layer.__dict__.setdefault(CHOICES_ATTR, {})
    before = dict(choices)
    choices[STEP] = key
    _set_choice(choices, key, how, layer_key_, policies)
    layer.__dict__[FORCED_ATTR] = True
    try:
        yield
    finally:
        layer.__dict__.pop(FORCED_ATTR, None)
        choices.clear()
        choices.update(before)


def choice_of(choices: dict, fn: Callable, args: tuple, shapes: dict, fixed) -> tuple[str | None, "Shape | None"]:
    """The choice a compiled layer's call fn(*args) runs under (its CHOICES_ATTR entries `choices`), with the
    Shape whose plan it is (from `shapes`, a LayerPlan's by step key, or `fixed`, its given plan): inside an
    earlier call's step, checkpointed (no shape); else the plan for this step's key where the call's shapes are
    those it was made for, else a given plan's; (None, None) where none holds. Read by the traced call
    (compiled_call, whose graph dynamo guards on the entries it reads) and outside the graph (around_compiled),
    from the same tensors."""
    key = choices.get(STEP)
    if key == INSIDE:
        return CHECKPOINT, None
    how = choices.get(key) if key is not None else None
    if how is not None and choices.get(("layer", key)) == layer_key(fn, args):
        return how, shapes.get(key)
    how = choices.get(None)
    return how, (fixed if how is not None else None)


def compiled_call(lp: "LayerPlan", layer: nn.Module, fn: Callable, args: tuple):
    """Layer `layer`'s call fn(*args) while torch.compile traces it: as its plan for this step's shapes says,
    through the checkpointing torch.compile traces (torch.utils.checkpoint, a policy as selective
    checkpointing's context), or, where the layer has no plan for them (the profiling step, an infeasible
    budget, a call whose shapes are not those the plan was made with), lp.dispatch outside the compiled graph
    (eager_dispatch, a graph break). An offloaded choice ("keep@host", "checkpoint@host", a policy's) runs its
    base choice in the graph where around_compiled opened the layer's Offload around the compiled call (noted
    under AROUND: the hooks see what the compiled function saves), else through lp.dispatch as well."""
    choices = layer.__dict__.get(CHOICES_ATTR)
    how = None
    if choices is not None and args and isinstance(args[0], torch.Tensor):
        if choices.get(STEP) == INSIDE:  # inside an earlier call's step: checkpointed in the graph
            return checkpoint(fn, *args, use_reentrant=False)
        how = choice_of(choices, fn, args, {}, None)[0]
    if how is not None and split_choice(how)[1] and not is_streamed(how) and choices.get(AROUND) == how:
        how = split_choice(how)[0]  # the layer's Offload is open around the graph
    if how is None or split_choice(how)[1] or is_groups(how):
        # No plan yet, an offloaded choice with no Offload around the graph (saved-tensor hooks are not traced;
        # a streamed one's copies go as the forward makes its tensors), or a group assignment (remat's dispatch
        # modes are not traced): outside the graph.
        return eager_dispatch(lp, layer, fn, args)
    if how == KEEP:
        return fn(*args)
    if how == CHECKPOINT:
        return checkpoint(fn, *args, use_reentrant=False)
    policy = choices.get(("policy", how))
    return checkpoint(fn, *args, use_reentrant=False,
                      context_fn=partial(create_selective_checkpoint_contexts, policy))


def noted_around(layer: nn.Module) -> bool:
    """Whether around_compiled has noted a choice for `layer`'s call in progress (AROUND): a call of its
    forward outside a trace is then torch.compile running the compiled call eagerly (past its recompile limit),
    and runs as compiled_call would have traced it."""
    choices = layer.__dict__.get(CHOICES_ATTR)
    return choices is not None and choices.get(AROUND) is not None


def ran_eagerly(lp: "LayerPlan", layer: nn.Module) -> None:
    """Notes that torch.compile ran `layer`'s compiled call eagerly while the profiler forced a choice on it
    (forced_choice): dynamo ran the call outside any graph, as it does once a function has reached
    torch._dynamo.config.recompile_limit graphs (the profiling step compiles each choice for each input shape;
    layers that run alike share them, on PyTorch 2.11 since PlannedForward). That layer's figures are then its
    eager run's, and the planned steps may run it either way: warns once per LayerPlan."""
    if lp.compiled_ran_eagerly:
        return
    lp.compiled_ran_eagerly = True
    limit = getattr(torch._dynamo.config, "recompile_limit", None)
    warnings.warn(
        f"{lp.who}: torch.compile ran layer {lp.index[id(layer)]}'s compiled call outside its graph while remat "
        f"profiled it (dynamo's recompile limit, torch._dynamo.config.recompile_limit = {limit}, reached: the "
        "profiler compiles each choice of the layers, for each input shape): its figures are its eager run's, and "
        "planned steps may run layers eagerly too, so the plan's prediction may not hold. Raise "
        "torch._dynamo.config.recompile_limit (and accumulated_recompile_limit) above the choices (kept, "
        "checkpointed, each policy, and each of these offloaded where offload=True) times the input shapes and the "
        "kinds of layer before the first step",
        RuntimeWarning, stacklevel=3)


@torch.compiler.disable
def eager_dispatch(lp: "LayerPlan", layer: nn.Module, fn: Callable, args: tuple):
    """lp.dispatch for `layer`, run outside torch.compile's graph (the profiling step of a compiled layer). The
    layer is noted as compiled (LayerPlan.compiled_layers): the profiling step profiles it through its graph;
    and its compiled call is wrapped (Around: what of an offloading plan torch.compile cannot trace is done
    outside the graph)."""
    i = lp.index[id(layer)]
    lp.compiled_layers.add(i)
    wrap_call(lp, layer)
    step = lp._step
    if i > 0 and step is not None and step.shape is None and getattr(step, "key", None) in lp._shapes:
        # The first layer ran inside its graph under this step's plan (its call did not reach lp.dispatch, which
        # takes the step's shape there): the shape it ran, for this layer's call.
        step.shape = lp._shapes[step.key]
    return lp.dispatch(i, fn, *args)


class Around:
    """A compiled layer's compiled call wrapped (wrap_call): each call goes through remat.dispatch's
    around_compiled, which opens the layer's Offload around the graph and carries out the plan's offload
    schedule where the plan in force asks for them, and otherwise makes the call as it is."""

    def __init__(self, lp: "LayerPlan", layer: nn.Module, call: Callable):
        self.lp, self.layer, self.call = lp, layer, call

    def __call__(self, *args, **kwargs):
        lp = self.lp
        if not lp._may_offload:  # nothing of its plans offloads: as it is, at once
            return self.call(*args, **kwargs)
        from .dispatch import around_compiled
        return around_compiled(lp, self.layer, self.call, args, kwargs)


def _call_attr(model: nn.Module, layer: nn.Module) -> tuple[nn.Module, str] | None:
    """Where `layer`'s compiled call is held: (layer, "_compiled_call_impl") after layer.compile(), the
    torch.compile(layer) wrapper's "forward" (its compiled call of the layer); None for a layer not compiled on
    its own."""
    entry = compiled_call_of(model, layer)
    if entry is None:
        return None
    attr = "_compiled_call_impl" if entry is layer else "forward"
    return (entry, attr) if entry.__dict__.get(attr) is not None else None


def wrap_call(lp: "LayerPlan", layer: nn.Module) -> None:
    """Wraps `layer`'s compiled call in an Around (once; again where torch.compile replaced it, or a copy of the
    model came without it: copies and pickles drop compiled calls, and a torch.compile wrapper's copy makes its
    own)."""
    held = _call_attr(lp.model, layer)
    if held is not None:
        entry, attr = held
        if not isinstance(entry.__dict__[attr], Around):
            entry.__dict__[attr] = Around(lp, layer, entry.__dict__[attr])


def unwrap_call(model: nn.Module, layer: nn.Module) -> None:
    """Puts `layer`'s compiled call back as it was before wrap_call (LayerPlan.remove)."""
    held = _call_attr(model, layer)
    if held is not None:
        entry, attr = held
        if isinstance(entry.__dict__[attr], Around):
            entry.__dict__[attr] = entry.__dict__[attr].call


def publish(layers: Sequence[nn.Module], shape: "Shape", policies: dict) -> None:
    """Hands shape's plan to the layers' compiled calls (compiled_call): each layer's choice under the shape's
    key, the shapes the layer was profiled with, and the policy functions the choices name (for the layers of its
    chain's stages: Shape.stages)."""
    stages = shape.stages
    if stages is not None:
        layers = [layers[j] for j in stages]
    for i, (layer, how) in enumerate(zip(layers, shape.choices or [None] * len(layers))):
        choices = layer.__dict__.setdefault(CHOICES_ATTR, {})
        if how is None:
            choices.pop(shape.key, None)
            choices.pop(("layer", shape.key), None)
            continue
        _set_choice(choices, shape.key, how, shape.layer_keys[i] if shape.layer_keys is not None else None,
                    policies)


def _set_choice(choices: dict, key, how: str, layer_key_: tuple | None, policies: dict) -> None:
    """The entries compiled_call reads for step key `key`: the choice `how`, the shapes the layer was profiled
    with (None: not recorded), and the policy function the choice names (publish's and forced_choice's)."""
    choices[key] = how
    if layer_key_ is not None:
        choices[("layer", key)] = layer_key_
    base = split_choice(how)[0]
    if base not in (KEEP, CHECKPOINT) and not is_groups(base):
        choices[("policy", base)] = policy_fn(base, policies)


def set_step_key(layers: Sequence[nn.Module], key) -> None:
    """Tells the layers' compiled calls which step is in progress (compiled_call reads its choices)."""
    for layer in layers:
        choices = layer.__dict__.get(CHOICES_ATTR)
        if choices is not None and choices.get(STEP) != key:
            choices[STEP] = key
