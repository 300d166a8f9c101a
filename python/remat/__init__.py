"""remat for Python: gradient checkpointing planned for a memory budget.

    import remat
    chain = remat.profile(remat.stages_of(model), x)            # each stage's exact kept bytes and times
    plan = remat.per_layer(chain, 300 << 20)                    # keep, keep matmuls or checkpoint, per layer
    remat.enable(model, list(model), plan=plan)                 # applied with torch.utils.checkpoint
    remat.hf.enable(hf_model, budget="600MiB")                  # a Transformers model, in one line
    remat.hf.enable(hf_model, budget="600MiB", offload=True)    # ... that may offload layers to host memory
    remat.max_batch(hf_model, make_batch, budget="auto")        # the largest batch that trains, and its plan

The planner is remat's C++ planner library (remat._core, no LibTorch inside): chains and plans are the same JSON
as the C++ library and the ``remat`` command (``remat.Chain.from_json``, ``chain.to_json()``), and
``str(plan)`` is the C++ ``Plan::to_string()``. Budgets are bytes.
"""
from . import _core, inplace, offload  # inplace: the old path of enable and LayerPlan, kept working
from ._core import (PREDICTION_TOLERANCE, PROFILED_SHAPES_WARNED_AT, STRATEGY_WORDS, Chain, InfeasibleBudget,
                    MemoryBreakdown, OffloadCost, Op, OpKind, Plan, PolicyCost, SavedGroup,
                    Simulation, Stage, StepContext, StepPlan, check_plan, check_prediction, checkpoint_all, checkpoint_stages,
                    format_bytes, group_cost, group_unsaved_bytes, load_chain, make_plan, memory_breakdown,
                    min_feasible_budget, min_step_budget,
                    no_checkpoint, optimal, parse_size, per_call_time_ms, per_layer, per_layer_min_budget,
                    plan_step, revolve, save_chain, simulate, sqrt_n, step_peak_bytes, step_time_ms,
                    summarize_plan_json, uniform, uniform_chain)
from .batch import MaxBatch, max_batch
from .executor import CheckpointedSequential, run_plan
from .layer_plan import LayerPlan, enable
from .meter import MeterUnavailable, cpu_meter, meter_for
from .policies import (MATMUL_OPS, POLICIES, POLICY_OFFLOAD, RestoreBuffers, checkpoint, checkpoint_context, choices_of,
                       matmuls, run_layer)
from .selective import MUST_CPU_OFFLOAD, PREFER_CPU_OFFLOAD
from .profile import Restore, StageFn, profile, stages, stages_of
from .progress import ProfileProgress
from .verdict import Placement, explain_placement, memory_verdict

__version__ = "0.1.0"

__all__ = [
    "CheckpointedSequential", "Chain", "InfeasibleBudget", "LayerPlan", "MATMUL_OPS", "MaxBatch", "MemoryBreakdown",
    "MUST_CPU_OFFLOAD", "MeterUnavailable", "OffloadCost", "Op", "OpKind", "POLICIES", "POLICY_OFFLOAD", "PREDICTION_TOLERANCE", "PROFILED_SHAPES_WARNED_AT", "PREFER_CPU_OFFLOAD", "Placement", "Plan", "PolicyCost", "ProfileProgress", "Restore", "RestoreBuffers", "SavedGroup",
    "STRATEGY_WORDS", "Simulation", "Stage", "StageFn", "StepContext", "StepPlan", "check_plan", "check_prediction", "checkpoint",
    "checkpoint_all",
    "checkpoint_context", "checkpoint_stages", "choices_of", "cpu_meter", "enable", "explain_placement",
    "format_bytes", "group_cost", "group_unsaved_bytes", "load_chain", "make_plan", "matmuls", "max_batch", "memory_breakdown", "memory_verdict", "meter_for",
    "min_feasible_budget", "min_step_budget", "no_checkpoint", "optimal", "parse_size", "per_call_time_ms",
    "per_layer", "per_layer_min_budget", "plan_step", "profile", "revolve", "run_layer", "run_plan",
    "save_chain", "simulate", "sqrt_n", "stages", "stages_of", "step_peak_bytes", "step_time_ms", "summarize_plan_json",
    "uniform", "uniform_chain",
]


def __getattr__(name):  # remat.hf imports transformers only when asked for
    if name == "hf":
        import importlib
        return importlib.import_module(".hf", __name__)
    raise AttributeError(f"module 'remat' has no attribute '{name}'")
