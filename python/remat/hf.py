"""Hugging Face Transformers models, planned for a budget in one line.

    import remat.hf
    remat.hf.enable(model, budget="600MiB")      # instead of model.gradient_checkpointing_enable()
    remat.hf.enable(model, budget="auto")        # or: fit what the GPU has free (also "90%")

The model's repeated layers (its outermost ``GradientCheckpointingLayer`` modules: BertLayer, GPT2Block,
LlamaDecoderLayer, ...) are found in module order, and Hugging Face's own checkpointing hook
(``_set_gradient_checkpointing`` with a checkpointing function) routes each layer's call to remat, which runs it
kept whole, checkpointed, or checkpointed keeping its matrix multiplications, as the plan for the budget says.
``model.train()``, ``model.eval()`` (layers run plainly), ``torch.no_grad()`` and a ``Trainer`` work as
before; ``remat.hf.disable(model)`` (or ``model.gradient_checkpointing_disable()``) turns it off.

The budget is the whole training step's peak above the bytes alive when the model's forward is called, as
remat's meter (CPU) or the CUDA allocator reads it. Without an example batch, the first training step profiles
the layers where they run (every layer checkpointed, the plain run's gradients) and plans at the end of its
backward pass; an infeasible budget raises remat.InfeasibleBudget there, naming the least feasible one. With
``example=`` (the keyword arguments of one training batch, labels included so that the model returns a loss),
that step runs inside enable() and the model's gradients, buffers and random generators are put back.
"""
from __future__ import annotations

import functools
import inspect
import sys
import warnings
from functools import partial
from typing import Mapping, Sequence

import torch
from torch import nn

from .compiled import CHOICES_ATTR, compiled_call, compiled_call_of, noted_around
from .layer_plan import LayerPlan
from .policies import torch_checkpoint
from .profile import Restore

__all__ = ["enable", "disable", "layers_of", "profile"]


def layers_of(model: nn.Module) -> list[nn.Module]:
    """The model's repeated layers: its outermost transformers GradientCheckpointingLayer modules, in module order.
    Raises TypeError when the model has none (a model that is not a Transformers model, or one too old to have them)."""
    try:
        from transformers.modeling_layers import GradientCheckpointingLayer
    except ImportError as e:
        raise TypeError("remat.hf: needs transformers with GradientCheckpointingLayer (4.53 or later)") from e
    layers, inside = [], set()
    for m in model.modules():
        if isinstance(m, GradientCheckpointingLayer) and id(m) not in inside:
            # The outermost only: a layer inside another (Zamba2's hybrid layers hold a Mamba layer, each a
            # GradientCheckpointingLayer) runs within the call of the one that holds it, as part of it, and the
            # layers remat plans are called one after another. Before (found 2026-12-06) both were planned, and the
            # profiling step failed with an IndexError.
            layers.append(m)
            inside.update(id(d) for d in m.modules())
    if not layers:
        raise TypeError(f"remat.hf: {type(model).__name__} has no GradientCheckpointingLayer modules; use "
                        "remat.enable(model, layers, budget=...) with its layer list")
    return layers


def _layer_of_call(fn):
    """The layer a checkpointing hook's function belongs to: partial(forward, layer, **kwargs) (transformers
    5), or a bound method of the layer (older versions)."""
    if isinstance(fn, partial):
        if fn.args and isinstance(fn.args[0], nn.Module):
            return fn.args[0]
        return _layer_of_call(fn.func)
    return getattr(fn, "__self__", None)


def _pretrained(model: nn.Module) -> nn.Module:
    """The Transformers model remat plans: `model`, or in a wrapper whose class has no checkpointing hook of its
    own, the first module whose class has one. A PEFT model (peft.get_peft_model: LoRA and the other adapters)
    is such a wrapper: its attributes reach its base model's, whose layers hold the adapters, and its forward
    calls that model's, where remat's step begins. Tested with peft 0.21.2 (LoRA)."""
    if getattr(type(model), "_set_gradient_checkpointing", None) is not None:
        return model
    for m in model.modules():
        if getattr(type(m), "_set_gradient_checkpointing", None) is not None:
            return m
    return model


def _check_hook(model: nn.Module) -> None:
    """remat reaches the layers through _set_gradient_checkpointing(enable, gradient_checkpointing_func), the hook
    both public entry points (gradient_checkpointing_enable, and 5.24's activation_checkpointing_enable) call
    with torch.utils.checkpoint: neither takes a function of the caller's (they pass keyword arguments to
    torch.utils.checkpoint only), and remat's is what decides per layer. Tested on transformers 4.53.3, 5.17.0,
    5.23.0 and 5.24.0 (scripts/hf-versions). Raises TypeError naming the installed version where the hook differs."""
    hook = getattr(type(model), "_set_gradient_checkpointing", None)
    if hook is None:
        raise TypeError(f"remat.hf.enable: {type(model).__name__} is not a transformers PreTrainedModel")
    try:
        params = inspect.signature(hook).parameters
    except (TypeError, ValueError):
        params = {}
    if "gradient_checkpointing_func" not in params or "enable" not in params:
        import transformers
        raise TypeError(f"remat.hf.enable: {type(model).__name__}._set_gradient_checkpointing takes "
                        f"({', '.join(params)}), not (enable, gradient_checkpointing_func), in transformers "
                        f"{transformers.__version__}: remat.hf supports 4.53 to 5.24 and models written in their "
                        "format (a model overriding the hook in the pre-4.35 format is not); use "
                        "remat.enable(model, layers, budget=...) with its layer list")


@functools.cache
def wraps_whole_call() -> bool:
    """Whether the installed transformers checkpoints a GradientCheckpointingLayer's whole call (4.53 to 5.22:
    its `__call__` is wrapped, module hooks and a compiled call inside the checkpoint) rather than its forward
    (5.23 and later, which wrap `forward` inside the module call)."""
    from transformers.modeling_layers import GradientCheckpointingLayer
    return "__call__" in GradientCheckpointingLayer.__dict__


def _check_compiled(model: nn.Module, layers: Sequence[nn.Module], where: str) -> None:
    """Raises TypeError for a layer compiled on its own (layer.compile(), torch.compile(layer)) where transformers
    wraps the layer's whole call (wraps_whole_call): there Hugging Face's hook runs outside the compiled graph,
    around it, so no plan runs inside the graph and remat cannot profile it as it runs. Measured on the CPU with
    transformers 4.53.3 and 5.17.0: predictions 12.8% above the step, the matmuls policy's gradients not the
    compiled plain run's bitwise (6.5e-9 apart), and on PyTorch 2.11 torch.utils.checkpoint's CheckpointError on
    a torch.compile(layer) planned step. Called with the model's layers or the one being called."""
    if not layers or not wraps_whole_call():
        return
    for layer in layers:
        if compiled_call_of(model, layer) is not None:
            import transformers
            raise TypeError(
                f"{where}: layer {type(layer).__name__} is compiled on its own, and transformers "
                f"{transformers.__version__} checkpoints a layer's whole call, around its compiled graph (4.53 to "
                "5.22; 5.23 and later checkpoint its forward, inside the graph): remat plans compiled layers with "
                "transformers 5.23 or later. Upgrade transformers, or enable remat on the layers uncompiled")


def enable(model: nn.Module, budget=None, *, example: Mapping | None = None, loss=None, plan=None,
           policies=("matmuls",), repeats: int = 1, exclude: Sequence[str] = (), agree=None, offload: bool = False,
           max_host_bytes=None, offload_min_bytes: int = 1 << 20, groups: bool = False,
           replan_on_oom: bool = False, replan_on_overshoot: bool = False, borrow_plans: bool = True,
           choose_plan=None) -> LayerPlan:
    """Plans `model`'s layers for `budget` and returns the LayerPlan (plan, choices, chain, predicted_peak_bytes,
    last_peak_bytes). docs/python.md has the guide.

    budget: the whole training step's peak above the bytes alive when the forward is called (bytes, or "600MiB"),
    or a device budget: "auto" (what the GPU has free when the profiling step begins, less a margin) or "90%".
    example: one batch's keyword arguments (with labels): profile and plan now, not at the first training step.
    loss: for a model that returns no loss (BertModel), its outputs -> the loss. plan: a given per-layer plan.
    policies, exclude, agree, offload, max_host_bytes, offload_min_bytes, groups, replan_on_oom,
    replan_on_overshoot, borrow_plans, choose_plan: as remat.enable's (borrow_plans: batches padded to their longest
    sequence profile only the lengths longer than every one before).

    Raises TypeError when the model has no layer list remat knows, or has layers compiled on their own under a
    transformers before 5.23 (wraps_whole_call), ValueError for a bad budget or plan, and remat.InfeasibleBudget
    (naming the least feasible budget) when no plan fits."""
    model = _pretrained(model)
    layers = layers_of(model)
    _check_hook(model)
    _check_compiled(model, layers, "remat.hf.enable")
    disable(model)
    lp = LayerPlan(model, layers, budget=budget, plan=plan, policies=policies, repeats=repeats, exclude=exclude,
                   agree=agree, offload=offload, max_host_bytes=max_host_bytes,
                   offload_min_bytes=offload_min_bytes, groups=groups, replan_on_oom=replan_on_oom,
                   replan_on_overshoot=replan_on_overshoot, borrow_plans=borrow_plans, choose_plan=choose_plan,
                   who="remat.hf.enable")

    type(model)._set_gradient_checkpointing(model, enable=True, gradient_checkpointing_func=_Checkpointing(lp))
    model._remat_layer_plan = lp
    # Hugging Face's own calls reach remat from now on (gradient_checkpointing_disable, a later
    # gradient_checkpointing_enable): an instance attribute in front of the class's hook.
    model.__dict__["_set_gradient_checkpointing"] = _Hook(model)
    if example is not None:
        _profile_now(model, lp, example, loss)
    elif loss is not None:
        raise ValueError("remat.hf.enable: loss= is the loss of the example batch; give example= too")
    return lp


class _Checkpointing:
    """The checkpointing function remat gives Hugging Face's hook: each planned layer's call goes to the
    LayerPlan (a class, not a closure, so that a model remat plans can be copied and pickled)."""

    def __init__(self, lp: LayerPlan):
        self.lp = lp

    def __call__(self, fn, *args, **kwargs):
        lp = self.lp
        layer = _layer_of_call(fn)
        if layer is not None and CHOICES_ATTR in layer.__dict__ and (torch.compiler.is_compiling() or
                                                                    noted_around(layer)):
            # A compiled layer (layer.compile(), torch.compile(layer)) being traced: the plan inside its graph (or
            # run as traced, where torch.compile ran the compiled call eagerly: noted_around).
            return compiled_call(lp, layer, partial(fn, **kwargs) if kwargs else fn, args)
        i = lp.index.get(id(layer)) if layer is not None else None
        if i is not None and getattr(layer, "_compiled_call_impl", None) is not None:
            _check_compiled(lp.model, [layer], "remat.hf")  # layer.compile() after remat.hf.enable
        if i is None:
            if layer is not None and any(layer is m for planned in lp.layers for m in planned.modules()):
                # A layer inside a planned one (layers_of): run as part of it, as its plan runs it.
                return fn(*args, **kwargs)
            # A module remat does not plan (a model-level flag): as Hugging Face runs it.
            return torch_checkpoint(fn, *args, use_reentrant=False, **kwargs)
        return lp.dispatch(i, partial(fn, **kwargs) if kwargs else fn, *args)


_UNSET = object()


class _Hook:
    """In front of a planned model's _set_gradient_checkpointing (an instance attribute), so that Hugging Face's
    own calls reach remat: gradient_checkpointing_disable() turns remat off as remat.hf.disable does, and a
    call that gives the layers another checkpointing function (a later gradient_checkpointing_enable(),
    Trainer(gradient_checkpointing=True)) turns remat off with a warning naming it, then does what it asks."""

    def __init__(self, model: nn.Module):
        self.model = model

    def __call__(self, enable: bool = True, gradient_checkpointing_func=_UNSET, **kwargs):
        model = self.model
        ours = isinstance(gradient_checkpointing_func, _Checkpointing) and \
            gradient_checkpointing_func.lp is model.__dict__.get("_remat_layer_plan")
        if not ours:
            if enable:
                warnings.warn(f"remat.hf: {_caller()} replaced remat's checkpointing of this "
                              f"{type(model).__name__} with its own: remat no longer plans it (call "
                              "remat.hf.enable after it to plan again, or leave gradient checkpointing to remat)",
                              stacklevel=3)
            _remove(model)
        if gradient_checkpointing_func is not _UNSET:
            kwargs["gradient_checkpointing_func"] = gradient_checkpointing_func
        return type(model)._set_gradient_checkpointing(model, enable=enable, **kwargs)


def _caller() -> str:
    """Who called the model's checkpointing hook, for people: the Transformers call, and a Trainer above it."""
    names = []
    frame = sys._getframe(2)
    while frame is not None and len(names) < 40:
        names.append((frame.f_code.co_name, frame.f_code.co_filename))
        frame = frame.f_back
    calls = [n for n, _ in names if n.endswith("checkpointing_enable") and not n.startswith("_")]
    call = calls[-1] if calls else None  # the outermost: the public call
    what = f"model.{call}()" if call else "a call of the model's _set_gradient_checkpointing"
    if any(f.replace("\\", "/").endswith("transformers/trainer.py") for _, f in names):
        what = f"Trainer (TrainingArguments(gradient_checkpointing=True)), through {what},"
    return what


def _remove(model: nn.Module) -> None:
    """Takes every part of remat off the model: the LayerPlan's hooks and the layers' attributes, the model's
    attribute and its hook's stand-in (Hugging Face's own hook then runs as before)."""
    lp = model.__dict__.pop("_remat_layer_plan", None)
    if lp is not None:
        lp.remove()
    model.__dict__.pop("_set_gradient_checkpointing", None)


def _profile_now(model: nn.Module, lp: LayerPlan, example: Mapping, loss_fn=None):
    """One training step on `example`, run to plan, leaving the model as it was."""
    if not isinstance(example, Mapping):
        raise TypeError("remat.hf.enable: example must be the keyword arguments of one batch (a dict), got "
                        f"{type(example).__name__}")
    device = next(model.parameters()).device
    was_training = model.training
    model.train()
    try:
        def run_step():
            out = model(**example)
            loss = loss_fn(out) if loss_fn is not None else getattr(out, "loss", None)
            if loss is None:
                raise ValueError("remat.hf.enable: the example batch gave no loss; include labels in it, or "
                                 "give loss=, a function from the model's outputs to the loss")
            loss.backward()

        with Restore([model], device, fresh_grads=True):
            lp._run_whole(run_step)
    finally:
        model.train(was_training)


def profile(model: nn.Module, example: Mapping, *, loss=None, policies=("matmuls",), repeats: int = 1):
    """The chain of the model's layers (a remat.Chain: each layer's exact kept bytes and times, under each
    policy too), profiled where they run in one training step on `example` (one batch's keyword arguments,
    with labels, or loss= as for enable), and what surrounds them (the remat.StepContext). The model is left as
    it was, remat's planning off. Returns (chain, context)."""
    lp = enable(model, budget=1 << 62, example=example, loss=loss, policies=policies, repeats=repeats)
    try:
        return lp.chain, lp.context
    finally:
        disable(model)


def disable(model: nn.Module) -> None:
    """Turns remat's planning off: the layers run plainly again, and nothing of remat stays on the model (as after
    model.gradient_checkpointing_disable(), which does the same)."""
    model = _pretrained(model)
    if "_remat_layer_plan" in model.__dict__:
        _remove(model)
        type(model)._set_gradient_checkpointing(model, enable=False)
