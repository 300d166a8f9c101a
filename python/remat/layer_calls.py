"""What a planned layer's call takes and hands on: its output split from what it passes along, the tensors it
takes beside its input, and the shapes that key a step's plan."""
from __future__ import annotations

from collections.abc import MutableMapping
from functools import partial

import torch
from torch import nn

from . import _core

__all__ = ["autocast_state", "call_key", "covers", "describe", "key_form", "layer_key", "layer_output",
           "taken_mappings", "taken_tensors", "tensor_ids", "tensors_put"]


def layer_output(out, who: str, i: int, layer: nn.Module) -> tuple[torch.Tensor, tuple]:
    """What a layer returned, split into the tensor the next layer takes (the output itself, or a tuple's first
    element, as Transformers' T5 blocks return it) and the rest it hands on. Raises TypeError otherwise."""
    if isinstance(out, torch.Tensor):
        return out, ()
    if isinstance(out, (tuple, list)) and out and isinstance(out[0], torch.Tensor):
        return out[0], tuple(out[1:])
    raise TypeError(f"{who}: layer {i} ({type(layer).__name__}) returned {type(out).__name__}, not a tensor or a "
                    "tuple whose first element is one: remat plans layers whose output (or its first element) is "
                    "the next layer's input")


def _tensors_in(values, out: list) -> None:
    for v in values:
        if isinstance(v, torch.Tensor):
            out.append(v)
        elif isinstance(v, (tuple, list)):
            _tensors_in(v, out)


def tensors_in(values) -> list[torch.Tensor]:
    """The tensors among `values`, tuples and lists inside them walked (xLSTM's blocks hand on their recurrent
    state as a tuple beside their output)."""
    out: list[torch.Tensor] = []
    _tensors_in(values, out)
    return out


def _taken(fn, args):
    """(where, value) for what a layer's call takes besides its input (args[0]): the other positional arguments
    ("argument 2"), and what the call's partials bind ("bound argument 1", or a keyword's name)."""
    yield from ((f"argument {k}", v) for k, v in enumerate(args[1:], 1))
    while isinstance(fn, partial):
        yield from ((f"bound argument {k}", v) for k, v in enumerate(fn.args, 1))
        yield from fn.keywords.items()
        fn = fn.func


def taken_tensors(fn, args) -> list[torch.Tensor]:
    """The tensors a layer's call takes besides its input (args[0]): the other positional arguments, and what
    the call's partials bind (keyword arguments such as T5's position bias or a decoder's encoder states)."""
    return tensors_in([v for _, v in _taken(fn, args)])


def taken_mappings(fn, args) -> list[tuple[str, MutableMapping]]:
    """The mutable mappings a layer's call takes besides its input, (where: "argument 2" or the keyword's name,
    the mapping): a container the layers share, into which one layer may put what later ones read (Gemma-3n's
    shared keys and values, `shared_kv_states`)."""
    return [(where, v) for where, v in _taken(fn, args) if isinstance(v, MutableMapping)]


def tensor_ids(mappings) -> list[set[int]]:
    """For each (where, mapping) of taken_mappings, the ids of the tensors in it now (tensors_put's `before`)."""
    return [{id(t) for t in tensors_in(list(m.values()))} for _, m in mappings]


def tensors_put(mappings, before: list[set[int]]) -> list[tuple[str, object]]:
    """(where, key) for each entry of the mappings (taken_mappings) that holds a tensor now that it did not hold
    when `before` (tensor_ids) was read, in the mappings' order."""
    put = []
    for (where, m), ids in zip(mappings, before):
        for key, value in list(m.items()):
            if any(id(t) not in ids for t in tensors_in([value])):
                put.append((where, key))
    return put


def layer_key(fn, args) -> tuple:
    """A layer call's shapes: its input's, and those of every other tensor it takes (positional, or bound by the
    call's partials: a decoder's encoder states, an attention mask), with their dtypes."""
    return tuple((tuple(t.shape), t.dtype) for t in (args[0], *taken_tensors(fn, args)))


def describe(key: tuple) -> str:
    """A layer_key for people: "[4, 32, 64] float32, [4, 1, 32, 32] float32"."""
    return ", ".join(f"{list(shape)} {str(dtype).replace('torch.', '')}" for shape, dtype in key)


def call_key(args, kwargs) -> tuple:
    """A model call's shapes: those of every tensor it takes, positional or keyword (in lists, tuples and dicts
    too), with their dtypes and where each was passed. A training step's plan is kept under it: a decoder's
    length (its labels') shows here, where the first layer's input (the encoder's) does not show it."""
    out: list = []

    def walk(v, where):
        if isinstance(v, torch.Tensor):
            out.append((where, tuple(v.shape), v.dtype))
        elif isinstance(v, (tuple, list)):
            for j, e in enumerate(v):
                walk(e, (where, j))
        elif isinstance(v, dict):
            for k in sorted(v, key=str):
                walk(v[k], (where, str(k)))

    walk(args, "args")
    walk(kwargs, "kwargs")
    return tuple(out)


def autocast_state() -> tuple:
    """The autocast regions in force on the devices remat plans for: (device type, dtype) for each of "cpu" and
    "cuda" whose autocast is on, () where none is. Part of every step's key: under autocast a layer saves its
    matmuls' inputs and outputs in the lower precision, so the same shapes peak apart (a bfloat16 plan run in
    float32 held 19% above its prediction, found 2026-12-02), and a step in each state is planned on its own."""
    return tuple((device, torch.get_autocast_dtype(device)) for device in ("cpu", "cuda")
                 if torch.is_autocast_enabled(device))


def key_form(key: tuple) -> tuple[tuple, list[list[int]]]:
    """A step key's form (whether it is the model's call or the first layer's, each tensor's place, dtype and
    rank, the frozen parameters, the autocast state) and its tensors' sizes: two keys of one form differ in
    sizes only."""
    tag, entries, frozen, autocast = key
    if tag == "model":  # call_key's entries: (where, shape, dtype)
        form = tuple((where, dtype, len(shape)) for where, shape, dtype in entries)
        sizes = [list(shape) for _, shape, _ in entries]
    else:  # layer_key's: (shape, dtype)
        form = tuple((dtype, len(shape)) for shape, dtype in entries)
        sizes = [list(shape) for shape, _ in entries]
    return (tag, form, frozen, autocast), sizes


def covers(big: tuple, small: tuple) -> bool:
    """Whether layer call shapes `big` (a layer_key) cover `small`: the same tensors, dtypes and ranks, and no
    size of `big` smaller (remat.covering_shape, the rule the C++ library's Planned borrows plans by)."""
    return (len(big) == len(small) and all(b[1] == s[1] and len(b[0]) == len(s[0]) for b, s in zip(big, small))
            and _core.covering_shape([[list(b[0]) for b in big]], [list(s[0]) for s in small]) == 0)
