"""Progress of long work: what remat.profile hands its `progress` callback after each run of one stage, and the
progress bar remat draws by default (tqdm's, on stderr). As tqdm does by default, the bar is drawn only while
stderr is a terminal and is erased when the work ends; REMAT_PROGRESS=0 turns it off, REMAT_PROGRESS=1 on
anywhere (the remat command reads the same variable)."""
from __future__ import annotations

import os
import sys
import threading
import time
from dataclasses import dataclass
from typing import Callable

__all__ = ["ProfileProgress", "progress_bar", "PhaseTimes", "planning_wait"]


@dataclass(frozen=True)
class ProfileProgress:
    """How far profiling has come, after one run of one stage (the C++ remat::ProfileProgress)."""

    done: int  #: runs of one stage finished
    total: int  #: the runs this profile makes in all (done reaches it last)
    #: what the run measured: "forward without saving", "forward and backward", "checkpointed", "policy NAME",
    #: "offloading" (one stage's stream figures), "groups" (one stage's saved groups), "bandwidth"
    phase: str
    phase_ms: float  #: that run's wall-clock time (ms); summed by phase, where profiling's time goes
    elapsed_ms: float  #: since profiling began (ms)
    stage: str  #: the stage's name ("" for bandwidth)
    stages: int  #: the stages profiled


def _bar_disabled():
    """tqdm's `disable`: True off, False on, None (tqdm's own test) on only where stderr is a terminal."""
    forced = os.environ.get("REMAT_PROGRESS", "")
    if forced:
        return forced == "0"
    return None


class progress_bar:
    """A `progress` callback for remat.profile that draws a tqdm bar on stderr, erased when the profile ends (or
    by close(), when it stops early); nothing where tqdm is not installed (it is one of remat's dependencies) or
    where the bar is disabled."""

    def __init__(self, desc: str):
        self.desc = desc
        self.bar = None

    def __call__(self, p: ProfileProgress) -> None:
        if self.bar is None:
            try:
                from tqdm.auto import tqdm
            except ImportError:
                return
            self.bar = tqdm(total=p.total, desc=self.desc, unit="run", leave=False, disable=_bar_disabled(),
                            dynamic_ncols=True)
        self.bar.set_postfix_str(p.phase + (f" ({p.stage})" if p.stage else ""), refresh=False)
        self.bar.update(p.done - self.bar.n)
        if p.done >= p.total:
            self.close()

    def close(self) -> None:
        """Erases the bar, if drawn."""
        if self.bar is not None:
            self.bar.close()
            self.bar = None


class planning_wait:
    """A context around a planner call (remat._core's planners run without the GIL) that, where a progress bar
    would be drawn (progress_bar's rule: stderr a terminal, or REMAT_PROGRESS), shows `desc` and the seconds
    elapsed on stderr once the call has run `after` seconds, redrawn every `every` seconds by a thread of its own,
    and erased when the call ends. Nothing, and no thread, where no bar would be drawn."""

    def __init__(self, desc: str, after: float = 0.5, every: float = 0.25):
        self.desc, self.after, self.every = desc, after, every
        self.drawn = False  #: whether the line was drawn (the call ran past `after`)
        self._done = None
        self._thread = None

    def __enter__(self):
        disabled = _bar_disabled()
        if disabled is None:
            disabled = not (hasattr(sys.stderr, "isatty") and sys.stderr.isatty())
        if disabled:
            return self
        try:
            from tqdm.auto import tqdm
        except ImportError:
            return self
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._draw, args=(tqdm,), name="remat-planning", daemon=True)
        self._thread.start()
        return self

    def _draw(self, tqdm) -> None:
        if self._done.wait(self.after):
            return
        bar = tqdm(total=None, desc=self.desc, bar_format="{desc}: {elapsed}", leave=False, disable=False,
                   dynamic_ncols=True)
        self.drawn = True
        try:
            while not self._done.wait(self.every):
                bar.refresh()
        finally:
            bar.close()

    def __exit__(self, *exc) -> None:
        if self._thread is not None:
            self._done.set()
            self._thread.join()
            self._thread = None


class PhaseTimes:
    """A `progress` callback that sums each phase's time (seconds), in order of first appearance, and hands
    each report on to `then` (a bar, say)."""

    def __init__(self, then: Callable[[ProfileProgress], None] | None = None):
        self.seconds: dict[str, float] = {}
        self.then = then

    def __call__(self, p: ProfileProgress) -> None:
        self.seconds[p.phase] = self.seconds.get(p.phase, 0.0) + p.phase_ms / 1e3
        if self.then is not None:
            self.then(p)


class Reporter:
    """Hands a profile's `progress` callback each finished run of one stage, with the time since the last, so
    that the phases' times add up to all of profiling's."""

    def __init__(self, progress: Callable[[ProfileProgress], None] | None, stages: int, total: int):
        self.progress, self.stages, self.total = progress, stages, total
        self.done = 0
        self.start = self.last = time.perf_counter()

    def __call__(self, phase: str, stage: str = "") -> None:
        if self.progress is None:
            return
        now = time.perf_counter()
        self.done += 1
        p = ProfileProgress(self.done, self.total, phase, (now - self.last) * 1e3, (now - self.start) * 1e3,
                            stage, self.stages)
        self.last = now
        self.progress(p)
