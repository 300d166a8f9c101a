"""The import path of remat.enable and LayerPlan before the planned layers' code was split by concern; it keeps
working. The code lives in:

- ``remat.layer_plan``: LayerPlan, the controller over a model's planned layers, and ``enable``;
- ``remat.dispatch``: each layer's call, run as the plan says or profiled;
- ``remat.measure_step``: the training step's measurement and the profiling step;
- ``remat.layer_offload``: the planned layers' offloading and the plan's offload schedule;
- ``remat.compiled``: compiled layers under a plan;
- ``remat.agreement``: one plan on every rank;
- ``remat.layer_calls``: what a layer's call takes and hands on.
"""
from .compiled import CHOICES_ATTR, STEP, compiled_call, eager_dispatch
from .dispatch import LAYER_PLAN_ATTR
from .dispatch import planned_forward as _planned_forward  # noqa: F401  (copies pickled before the split)
from .layer_plan import LayerPlan, enable, parse_budget

__all__ = ["CHOICES_ATTR", "LAYER_PLAN_ATTR", "LayerPlan", "STEP", "compiled_call", "eager_dispatch", "enable",
           "parse_budget"]
