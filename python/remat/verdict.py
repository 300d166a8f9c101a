"""The forum verdict: how much checkpointing can save for a model and an input, why not more, and whether a
given placement of checkpoints saves anything (what ``remat profile`` says, from the same library functions).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

from torch import nn

from . import _core

__all__ = ["memory_verdict", "Placement", "explain_placement"]


def memory_verdict(model: nn.Module, chain: _core.Chain, optimizer: str = "adam") -> _core.MemoryBreakdown:
    """The training step's memory, predicted from `chain` (remat.profile of the model's stages) and the model's
    parameters, and what checkpointing can save of it: the C++ remat::memory_breakdown. Its verdict() says it
    in sentences (the weights dominate, or the activations; the most checkpointing can save; per-layer
    checkpointing's figure). optimizer: "none", "sgd-momentum" or "adam" (its state per trainable byte)."""
    params = sum(p.nbytes for p in model.parameters())
    trainable = sum(p.nbytes for p in model.parameters() if p.requires_grad)
    return _core.memory_breakdown(chain, params, trainable, optimizer)


@dataclass
class Placement:
    """What checkpointing the listed stages, each on its own, does to the predicted peak (bytes)."""

    checkpointed: list[int]
    peak_bytes: int
    plain_peak_bytes: int
    reasons: list[str] = field(default_factory=list)

    @property
    def saving_bytes(self) -> int:
        return self.plain_peak_bytes - self.peak_bytes

    def saves_anything(self) -> bool:
        return self.saving_bytes > 0

    def __str__(self) -> str:
        f = _core.format_bytes
        head = (f"checkpointing stages {self.checkpointed} saves {f(self.saving_bytes)} (peak {f(self.plain_peak_bytes)}"
                f" -> {f(self.peak_bytes)})" if self.saves_anything() else
                f"checkpointing stages {self.checkpointed} saves nothing (peak {f(self.plain_peak_bytes)} -> "
                f"{f(self.peak_bytes)})")
        return "\n".join([head] + [f"- {r}" for r in self.reasons])


def explain_placement(chain: _core.Chain, checkpointed: Sequence[int]) -> Placement:
    """Whether checkpointing each listed stage on its own (as torch.utils.checkpoint around each) lowers the
    predicted peak, and why not where it does not: a stage that saves nothing but its output frees nothing when
    checkpointed (what it saved was its input, which the checkpoint keeps anyway); the peak may sit at a stage
    that is kept, or in the recompute of a checkpointed one. Raises ValueError for a stage out of range or
    listed twice."""
    listed = list(checkpointed)
    plan = _core.checkpoint_stages(chain.size(), listed)
    sim = _core.simulate(chain, plan)
    plain = _core.simulate(chain, _core.no_checkpoint(chain))
    f = _core.format_bytes
    reasons = []
    for i in listed:
        s = chain.stages[i]
        if s.saved_bytes <= s.output_bytes:
            reasons.append(f"stage {i} ('{s.name}') keeps only its output ({f(s.output_bytes)}): checkpointing it "
                           "alone frees nothing, since what it saves for backward is its input, which the "
                           "checkpoint keeps (checkpoint runs of several stages instead)")
    if sim.peak_op >= 0:
        op = plan.ops[sim.peak_op]
        if op.stage >= 0:
            s = chain.stages[op.stage]
            where = "kept" if op.stage not in listed else "checkpointed"
            reasons.append(f"the peak is at operation {plan.op_text(op)} (stage {op.stage}, '{s.name}', {where}), "
                           f"where {f(sim.peak_bytes)} are held")
    largest = max(range(chain.size()), key=lambda i: chain.stages[i].saved_bytes)
    if largest not in listed:
        s = chain.stages[largest]
        reasons.append(f"the stage that keeps the most, {largest} ('{s.name}', {f(s.saved_bytes)}), is not "
                       "checkpointed")
    return Placement(listed, sim.peak_bytes, plain.peak_bytes, reasons)
