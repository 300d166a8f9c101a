"""The forum verdict in Python: the forum's CNN (seed 003), checkpointed as its author did, saves nothing, and
remat says why; its weights dominate the step."""
import torch
from torch import nn

import remat


class Flat(nn.Module):
    def forward(self, x):
        return torch.flatten(x, 1)


def forum_cnn():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(20, 50, 3, padding=1), nn.ReLU(), nn.Conv2d(50, 25, 3, padding=1), nn.ReLU(),
                         nn.Conv2d(25, 10, 3, padding=1), nn.ReLU(), Flat(), nn.Linear(19 * 22 * 10, 3258))


def test_the_forum_placement_saves_nothing_and_remat_says_why(meter):
    model = forum_cnn()
    x = torch.randn(100, 20, 19, 22)
    chain = remat.profile(remat.stages_of(model), x, policies=(), repeats=1)
    # The author's placement: every operation after the first convolution in a checkpoint of its own.
    placement = remat.explain_placement(chain, [2, 3, 4, 5, 6, 7])
    assert not placement.saves_anything(), str(placement)
    text = str(placement)
    assert "saves nothing" in text
    assert "keeps only its output" in text  # single operations keep nothing but their output

    # Checkpointing runs of stages instead does save: the first convolution and its ReLU together.
    remat_plan = remat.optimal(chain, remat.min_feasible_budget(chain))
    assert remat_plan.predicted.peak_bytes < remat.no_checkpoint(chain).predicted.peak_bytes

    verdict = remat.memory_verdict(model, chain, optimizer="adam")
    assert verdict.weights_dominate()
    assert "the weights dominate" in verdict.verdict()
    assert verdict.parameters == sum(p.nbytes for p in model.parameters())
    assert verdict.saving() == verdict.activations - verdict.least_activations


def test_a_placement_that_saves_says_how_much(meter):
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(64, 512), nn.GELU(), nn.Linear(512, 64)) for _ in range(6)])
    chain = remat.profile(remat.stages_of(model), torch.randn(64, 64), policies=(), repeats=1)
    p = remat.explain_placement(chain, [0, 1, 2, 3, 4])
    assert p.saves_anything()
    assert p.saving_bytes == remat.no_checkpoint(chain).predicted.peak_bytes - p.peak_bytes
    assert "saves " in str(p) and "->" in str(p)
    import pytest
    with pytest.raises(ValueError, match="listed twice"):
        remat.explain_placement(chain, [1, 1])
