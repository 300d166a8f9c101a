"""The plan executor: any of the planner's schedules over a list of stages.

``CheckpointedSequential(stages, plan)`` (or ``run_plan(stages, plan, x)``) runs a Plan from remat.optimal,
remat.per_layer or any planner: Fn (forward without saving), Fc (forward keeping its input), Fa (keep
everything), Fk[NAME] (keep what a selective policy keeps: the stage under torch.utils.checkpoint with it),
L, and B (a stage's backward, recomputing first what the plan dropped). It is one autograd node over the
chain, as torch.utils.checkpoint's reentrant variant is: its forward runs the plan's operations up to the loss,
its backward runs the rest, each stage's backward a nested backward call that accumulates the parameters'
gradients into their .grad (so, as with reentrant checkpointing, torch.autograd.grad cannot reach the
parameters through it; loss.backward() does).

Every recompute replays the random numbers of the stage's first run (dropout masks equal) and puts the stage's
buffers back afterwards (BatchNorm's statistics updated once); the generators are left where the plain run
leaves them.
"""
from __future__ import annotations

from typing import Callable, Sequence

import torch
from torch import nn

from . import _core
from ._state import AttributesSeen, RestoreModules, RngState, each_once
from .policies import autocast_cache_off, checked_checkpoint, policy_fn
from .profile import StageFn, input_needs_grad

__all__ = ["run_plan", "CheckpointedSequential"]


def _as_stages(stages) -> list[StageFn]:
    out = []
    for i, s in enumerate(stages):
        if isinstance(s, StageFn):
            out.append(s)
        elif callable(s):
            out.append(StageFn(s, f"{i}:{type(s).__name__}", s if isinstance(s, nn.Module) else None))
        else:
            raise TypeError(f"remat.run_plan: stage {i} is a {type(s).__name__}, not callable")
    return out


class _Runner:
    def __init__(self, stages: list[StageFn], plan, policies: dict[str, Callable]):
        self.stages = stages
        self.plan = plan
        self.ops = list(plan.ops)
        self.loss_at = next(k for k, op in enumerate(self.ops) if op.kind == _core.OpKind.L)
        n = len(stages)
        self.policies = [None] * len(plan.policies)
        for op in self.ops:
            if op.offload or op.stream:
                raise ValueError(f"remat.run_plan: operation {plan.op_text(op)} offloads, which the plan executor "
                                 "does not run (it is not one run without offloading): run a per-layer plan that "
                                 "offloads through remat.enable(model, layers, plan=plan), or one that streams "
                                 "through remat.enable(model, layers, budget=..., offload=True)")
            if op.groups:
                raise ValueError(f"remat.run_plan: operation {plan.op_text(op)} is a group assignment, which the "
                                 "plan executor does not run: plan it with remat.enable(..., groups=True)")
            if op.kind == _core.OpKind.Fk:
                if op.policy < 0:
                    raise ValueError(f"remat.run_plan: operation {plan.op_text(op)} keeps with remat::keep tags, "
                                     "which only the C++ library has; plan with policies instead")
                name = plan.policies[op.policy]
                self.policies[op.policy] = policy_fn(name, policies)
        self.held: list = [None] * (n + 1)  # ("plain", t) or ("abar", leaf, out)
        self.rng: list[RngState | None] = [None] * n
        self.seen: list[AttributesSeen | None] = [None] * n  # what each stage's first run found (AttributesSeen)
        self.ran = [False] * n
        self.grad = None
        self.input_grads: list[bool] = []
        self.cuda_devices: list[int] = []
        self.calls = [0] * n

    def value(self, i):
        h = self.held[i]
        return h[1] if h[0] == "plain" else h[2].detach()

    def run_forward(self, op):
        i = op.stage
        stage = self.stages[i]
        x = self.value(i).detach()
        mods = [stage.module] if stage.module is not None else []
        restore = None
        if self.ran[i]:
            current = RngState(self.cuda_devices)
            self.rng[i].restore()
            # Run again: as its first run found the attributes it reassigned, and leaving them as now.
            restore = RestoreModules(self.seen[i].walk, seen=self.seen[i]) if mods else None
        else:
            self.rng[i] = RngState(self.cuda_devices)
            restore = self.seen[i] = AttributesSeen(mods) if mods else None
        if restore:
            restore.__enter__()
        try:
            with autocast_cache_off():  # as every layer remat runs
                self._run_stage(op, i, x, mods)
        finally:
            if restore:
                restore.__exit__(None, None, None)
            if self.ran[i]:
                current.restore()
        self.ran[i] = True
        self.calls[i] += 1

    def _run_stage(self, op, i, x, mods):
        """Stage i's forward as op says, on x (its input, detached); mods: its module, as a list."""
        K = _core.OpKind
        stage = self.stages[i]
        if op.kind in (K.Fa, K.Fk):
            leaf = x
            if (x.is_floating_point() or x.is_complex()) and self.input_grads[i]:
                leaf = x.detach().requires_grad_(True)
            with torch.enable_grad():
                if op.kind == K.Fk:
                    out = checked_checkpoint(stage.fn, (leaf,), mods, self.policies[op.policy])
                else:
                    out = stage.fn(leaf)
            self.check(i, out)
            self.held[i + 1] = ("abar", leaf, out)
        else:
            with torch.no_grad():
                out = stage.fn(x)
            self.check(i, out)
            self.held[i + 1] = ("plain", out)
            if op.kind == K.Fn and i > 0 and self.held[i] is not None and self.held[i][0] == "plain":
                self.held[i] = None

    def check(self, i, out):
        if not isinstance(out, torch.Tensor):
            raise TypeError(f"remat.run_plan: stage {i} ('{self.stages[i].name}') returned {type(out).__name__}, "
                            "not a tensor")

    def forward(self, x: torch.Tensor):
        # Whether each stage's input needs a gradient (profile.input_needs_grad: a stage frozen on an input that
        # needs none makes no graph, as the profiler measures it).
        self.input_grads = [x.requires_grad]
        for stage in self.stages[:-1]:
            self.input_grads.append(input_needs_grad(self.input_grads[-1], stage))
        self.cuda_devices = [x.device.index or 0] if x.is_cuda else []
        self.held[0] = ("plain", x.detach())
        for op in self.ops[: self.loss_at]:
            self.run_forward(op)
        return self.value(len(self.stages))

    def backward(self, grad: torch.Tensor):
        K = _core.OpKind
        n = len(self.stages)
        self.grad = grad
        if self.held[n] is not None and self.held[n][0] == "plain":
            self.held[n] = None  # the loss frees a plain a_n, as plan.h says
        for op in self.ops[self.loss_at + 1:]:
            if op.kind != K.B:
                self.run_forward(op)
                continue
            i = op.stage
            _, leaf, out = self.held[i + 1]
            self.held[i + 1] = None
            targets = [p for p in (self.stages[i].module.parameters() if self.stages[i].module is not None else ())
                       if p.requires_grad]
            if leaf.requires_grad:
                targets.append(leaf)
            grad, self.grad = self.grad, None
            if out.requires_grad and targets:
                torch.autograd.backward(out, grad, inputs=targets)
            del out, grad
            self.grad = leaf.grad if leaf.requires_grad else None
            if i > 0 and self.held[i] is not None and self.held[i][0] == "plain":
                self.held[i] = None
        g, self.grad = self.grad, None
        self.held = [None] * (n + 1)
        return g


class _PlanFunction(torch.autograd.Function):
    # The parameters are inputs of the node so that a step whose input needs no gradient still has one; their
    # gradients are accumulated by the stages' nested backward calls, not returned.
    @staticmethod
    def forward(ctx, runner, x, *params):
        ctx.runner = runner
        ctx.num_params = len(params)
        return runner.forward(x)

    @staticmethod
    def backward(ctx, grad):
        runner, ctx.runner = ctx.runner, None
        if runner is None:
            raise RuntimeError("remat.run_plan: the backward pass ran twice through one plan's node; run the "
                               "forward again (retain_graph is not supported by the plan executor)")
        return (None, runner.backward(grad)) + (None,) * ctx.num_params


def run_plan(stages: Sequence[StageFn | Callable], plan, x: torch.Tensor, *, policies: dict | None = None,
             stats: list | None = None) -> torch.Tensor:
    """Runs `plan` over `stages` on x: the output of the last stage, with one autograd node behind it whose
    backward runs the rest of the plan. Outside training with grad, runs the stages plainly. policies: the
    selective policies the plan's Fk[NAME] use, beyond remat's presets. stats: a list that gets each stage's
    forward call count once the backward pass is done. Raises ValueError when the plan does not fit the
    stages, TypeError when a stage returns something other than a tensor."""
    stage_list = _as_stages(stages)
    if plan.num_stages != len(stage_list):
        raise ValueError(f"remat.run_plan: the plan is for {plan.num_stages} stages but there are "
                         f"{len(stage_list)} stages")
    _core.check_plan(plan)
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"remat.run_plan: the input must be a tensor, got {type(x).__name__}")
    if not torch.is_grad_enabled():
        for s in stage_list:
            x = s(x)
        return x
    runner = _Runner(stage_list, plan, policies or {})
    if stats is not None:
        stats.clear()
        stats.append(runner.calls)
    params = each_once(p for s in stage_list if s.module is not None for p in s.module.parameters()
                       if p.requires_grad)
    return _PlanFunction.apply(runner, x, *params)


class CheckpointedSequential(nn.Module):
    """An nn.Sequential (or a list of modules) run by a plan: forward(x) is run_plan(stages, plan, x) in
    training, the modules in turn in eval mode. The modules are registered as its children, so their
    parameters are its parameters."""

    def __init__(self, modules: nn.Sequential | Sequence[nn.Module], plan, *, policies: dict | None = None):
        super().__init__()
        mods = list(modules)
        for i, m in enumerate(mods):
            if not isinstance(m, nn.Module):
                raise TypeError(f"remat.CheckpointedSequential: element {i} is a {type(m).__name__}, not a module")
        self.layers = nn.ModuleList(mods)
        if plan.num_stages != len(mods):
            raise ValueError(f"remat.CheckpointedSequential: the plan is for {plan.num_stages} stages but there "
                             f"are {len(mods)} modules")
        _core.check_plan(plan)
        for name in plan.policies:  # refused now rather than at the first forward()
            policy_fn(name, policies)
        self.plan = plan
        self.policies = policies or {}

    def forward(self, x):
        if not self.training:
            for m in self.layers:
                x = m(x)
            return x
        return run_plan([StageFn(m, f"{i}:{type(m).__name__}", m) for i, m in enumerate(self.layers)], self.plan,
                        x, policies=self.policies)
