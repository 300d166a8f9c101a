"""Fitting the device: a budget that names the device instead of bytes (``budget="auto"`` or ``"90%"``).

When a training step that may profile begins, remat reads what the device has for it: free on the device
(``torch.cuda.mem_get_info``) and cached by the caching allocator beyond its tensors (reserved - allocated). At
the end of the profiling step it reads what the allocator lost to fragmentation: its reserved bytes beyond the
most the step's tensors occupied at once. The planner library turns these into bytes
(``remat._core.device_budget``: the fraction of free + cached - lost, less a margin of 2% of the device, at least
256 MiB), the rule C++'s ``PlannedOptions::fit_device`` uses too.

On the CPU a device budget is an error naming what to pass instead: a CPU has no capacity of its own that a
step could fill. ``pretend_device`` stands in a device's readings (for tests, on any device).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from . import _core

__all__ = ["DeviceReading", "fitted_budget", "lost_bytes", "parse_budget", "parse_budget_spec", "pretend_device",
           "read_device"]

_pretended: dict | None = None


@contextlib.contextmanager
def pretend_device(free_bytes: int, total_bytes: int, cached_bytes: int = 0):
    """While open, every device reads as having `free_bytes` free and `cached_bytes` cached by its allocator, of
    `total_bytes`, and loses nothing to fragmentation: device budgets work on the CPU, for tests."""
    global _pretended
    before = _pretended
    _pretended = dict(free=int(free_bytes), cached=int(cached_bytes), total=int(total_bytes))
    try:
        yield
    finally:
        _pretended = before


def parse_budget(budget, who: str, what: str = "the budget") -> int:
    """A budget in bytes: an int, or a string with a unit ("300MiB", "1.5GiB"). Raises ValueError naming `who`,
    `what` the value is (max_host_bytes is read so too) and the value otherwise, or when it is not positive."""
    if isinstance(budget, bool):
        raise TypeError(f"{who}: {what} must be bytes (an int) or a size string such as '300MiB', got {budget!r}")
    if isinstance(budget, str):
        try:
            value = _core.parse_size(budget)
        except ValueError as e:
            raise ValueError(f"{who}: {what} '{budget}' is not a size ({e})") from None
    elif isinstance(budget, int):
        value = budget
    else:
        raise TypeError(f"{who}: {what} must be bytes (an int) or a size string such as '300MiB', got "
                        f"{type(budget).__name__} {budget!r}")
    if value <= 0:
        raise ValueError(f"{who}: {what} must be a positive number of bytes, got {budget!r}")
    return value


@dataclass
class DeviceReading:
    """What a device had when a step began: the room (remat._core.DeviceRoom, lost_bytes still 0) and the
    caching allocator's reserved and allocated bytes then (None when pretended)."""
    device: torch.device
    room: _core.DeviceRoom
    reserved: int | None = None
    allocated: int | None = None


def parse_budget_spec(budget, who: str) -> tuple[int | None, float | None]:
    """(bytes, None) for a budget in bytes, (None, fraction) for a device budget ("auto": 1.0, "90%": 0.9).
    Raises ValueError or TypeError naming `who` and the value otherwise."""
    if isinstance(budget, str):
        try:
            fraction = _core.parse_device_fraction(budget)
        except ValueError as e:
            raise ValueError(f"{who}: {e}") from None
        if fraction is not None:
            return None, fraction
    return parse_budget(budget, who), None


def read_device(device: torch.device, who: str, budget) -> DeviceReading:
    """What `device` has for the step beginning now. Raises ValueError naming `who` and `budget` on a device
    other than CUDA (unless pretend_device is open)."""
    room = _core.DeviceRoom()
    if _pretended is not None:
        room.free_bytes, room.cached_bytes, room.total_bytes = (_pretended["free"], _pretended["cached"],
                                                              _pretended["total"])
        return DeviceReading(device, room)
    if device.type != "cuda":
        raise ValueError(f"{who}: budget={budget!r} fits the step to a CUDA device's free memory, but this step runs "
                         f"on {device}, which has no capacity of its own to fill; pass the budget in bytes instead "
                         "(an int, or a size such as '2GiB')")
    free, total = torch.cuda.mem_get_info(device)
    reserved, allocated = torch.cuda.memory_reserved(device), torch.cuda.memory_allocated(device)
    room.free_bytes, room.cached_bytes, room.total_bytes = free, max(0, reserved - allocated), total
    return DeviceReading(device, room, reserved, allocated)


def lost_bytes(reading: DeviceReading, peak_over_base: int) -> int:
    """What the caching allocator lost to fragmentation in the step that began at `reading` and peaked
    `peak_over_base` bytes above its base: its reserved bytes now beyond what it would have needed (what it
    cached then, or the step's peak of tensors, whichever is more). 0 when pretended."""
    if reading.reserved is None:
        return 0
    return _core.lost_to_fragmentation(reading.reserved, reading.allocated, peak_over_base,
                                       torch.cuda.memory_reserved(reading.device))


def _room(room: tuple[int, int, int, int]) -> _core.DeviceRoom:
    r = _core.DeviceRoom()
    r.free_bytes, r.cached_bytes, r.total_bytes, r.lost_bytes = room
    return r


def fitted_budget(room: tuple[int, int, int, int], fraction: float) -> int:
    """The budget in bytes for `fraction` of what a device had, room = (free, cached, total, lost) bytes
    (remat._core.device_budget)."""
    return _core.device_budget(_room(room), fraction)


def describe(room: tuple[int, int, int, int]) -> str:
    """The room for people (remat._core.describe_room: the words C++'s messages use too)."""
    return _core.describe_room(_room(room))
