"""Parameters whose gradients land in memory that outlives a step: DDP's `gradient_as_bucket_view=True`.

Under DDP with `gradient_as_bucket_view=True`, each parameter's gradient ends every backward pass as a view of
one of DDP's communication buckets, allocated once (and again after DDP rebuilds its buckets at its second
iteration) and held from step to step. A step that begins with such a gradient None (`zero_grad()` sets it so)
makes no new memory for it: autograd hands the incoming gradient to the parameter, and DDP's hook copies it into
the bucket and lets go of it at once, as an accumulation into an existing gradient does. Charged as a gradient
the step makes, it put every planned step below its prediction (a small Llama on two Gloo processes: 5.1%, found
2026-12-08). GradBuckets finds such parameters by what the steps leave behind, without seeing DDP: a gradient
that ends two steps in a row as a view of the same tensor, alive across both, is held in memory the step does
not own (a tensor made inside a step, even at the same address, is another object); the gradient state then
leaves them out (LayerPlan._grads_state), as it does gradients that exist when a step begins."""
from __future__ import annotations

import weakref
from typing import Sequence

import torch

# Steps observed, at most, before GradBuckets stops looking where no gradient ended as a view of a tensor that
# outlived a step (DDP rebuilds its buckets after its first iteration: the profiling step's views may be of
# buckets that the next step no longer uses).
LOOKS = 4


class GradBuckets:
    """The indices (into a LayerPlan's parameters) of those whose gradients end each step as views of a tensor
    that outlives the steps (`params`), found by observe() at the end of each step's backward pass."""

    def __init__(self):
        self.params: frozenset[int] = frozenset()
        self._last: list[tuple[weakref.ref, tuple[int, ...]]] = []  # the last step's views: (base, parameters)
        self._looks = 0
        self._done = False

    def __getstate__(self):
        """A copy (of a planned model) starts afresh: its parameters' gradients are its own."""
        return {}

    def __setstate__(self, state):
        self.__init__()

    @property
    def pending(self) -> bool:
        """Whether the last step's gradients ended as views of tensors not yet seen to outlive a step (looked for
        again at the next step's end)."""
        return not self._done and not self.params and bool(self._last)

    def observe(self, params: Sequence[torch.Tensor]) -> bool:
        """At the end of a step's backward pass: whether `params` changes (the gradient state of the steps after
        it then differs). Once found, each base's first parameter is checked at every step (one attribute read a
        bucket); where a gradient no longer ends in its base (DDP's buckets rebuilt, DDP dropped), none is left
        out from the next step on, and they are looked for again."""
        if self._done:
            return False
        if self.params:
            for ref, idx in self._last:
                base = ref()
                g = params[idx[0]].grad if idx[0] < len(params) else None
                if base is None or g is None or g._base is not base:
                    self.__init__()
                    return True
            return False
        now: dict[int, tuple[torch.Tensor, list[int]]] = {}
        for i, p in enumerate(params):
            g = p.grad
            base = None if g is None else g._base
            if base is not None and not isinstance(g, torch.nn.Parameter):
                now.setdefault(id(base), (base, []))[1].append(i)
        held = []
        for ref, idx in self._last:
            base = ref()
            if base is not None and id(base) in now and tuple(now[id(base)][1]) == idx:
                held.append((ref, idx))
        if held:
            self._last = held
            self.params = frozenset(i for _, idx in held for i in idx)
            return True
        self._last = [(weakref.ref(base), tuple(idx)) for base, idx in now.values()]
        self._looks += 1
        self._done = not now or self._looks >= LOOKS
        return False
