"""Progress while profiling: remat.profile's `progress` callback gets every run of one stage, in order, with
phases whose times add up; the default bar is drawn on stderr only where asked (not a terminal under pytest
unless REMAT_PROGRESS=1) and erased; a planned model's profiling step says where its profile's time went, and a
plan that takes long says it is planning."""
import threading
import time

import pytest
import torch

import remat

from conftest import mlp, train_step


def test_the_callback_gets_every_run_of_one_stage_and_the_phases_add_up():
    model = mlp(depth=3, width=32, hidden=64)
    x = torch.randn(8, 32)
    got = []
    remat.profile(remat.stages_of(model), x, warmup=1, repeats=2, offload_min_bytes=0, progress=got.append)
    n, rounds = 3, 3
    # Each round: a forward without saving and a forward and backward per stage, then checkpointed (a forward,
    # then a recompute and backward, per stage) and the policy (forward and backward per stage); then the
    # offloading figures per stage and the bandwidth once.
    total = rounds * n * (1 + 1 + 2 + 1) + n + 1
    assert [p.done for p in got] == list(range(1, total + 1))
    assert all(p.total == total and p.stages == n for p in got)
    phases = list(dict.fromkeys(p.phase for p in got))
    assert phases == ["forward without saving", "forward and backward", "checkpointed", "policy matmuls",
                      "offloading", "bandwidth"]
    assert sum(p.phase_ms for p in got) == pytest.approx(got[-1].elapsed_ms, rel=1e-6)
    assert got[0].stage == "0:Sequential" and got[-1].stage == ""


def test_the_bar_is_drawn_only_where_asked_and_bad_progress_is_refused(capfd, monkeypatch):
    model = mlp(depth=2, width=16, hidden=32)
    x = torch.randn(4, 16)
    monkeypatch.delenv("REMAT_PROGRESS", raising=False)
    remat.profile(remat.stages_of(model), x)  # stderr is not a terminal here: no bar
    assert "remat: profiling" not in capfd.readouterr().err
    monkeypatch.setenv("REMAT_PROGRESS", "1")
    remat.profile(remat.stages_of(model), x)
    assert "remat: profiling" in capfd.readouterr().err
    remat.profile(remat.stages_of(model), x, progress=False)
    assert capfd.readouterr().err == ""
    with pytest.raises(TypeError, match="progress must be None, False or a callable, got int"):
        remat.profile(remat.stages_of(model), x, progress=3)
    # A profile that stops early erases its bar all the same (tqdm's close writes the line's erasure).
    from remat.progress import progress_bar
    closed = []
    original = progress_bar.close
    monkeypatch.setattr(progress_bar, "close", lambda self: (closed.append(self.bar is not None), original(self)))

    def fails(x):
        raise RuntimeError("stage fails")
    with pytest.raises(RuntimeError, match="stage fails"):
        remat.profile([lambda t: t * 2, fails], x)
    assert closed == [True]


def test_a_planned_model_says_where_its_profile_spent_its_time():
    model = mlp(depth=3, width=32, hidden=64)
    lp = remat.enable(model, list(model), budget=1 << 40)
    assert lp.profiling_time == {}
    train_step(model, torch.randn(8, 32))
    times = lp.profiling_time
    assert list(times) == ["forward without saving", "forward and backward", "checkpointed", "policy matmuls"]
    assert all(s > 0 for s in times.values())
    lp.remove()


def test_a_long_plan_says_it_is_planning_where_a_bar_would_be_drawn(capfd, monkeypatch):
    from remat import _core
    from remat.progress import planning_wait
    # The context alone: past `after`, the line is drawn and erased; off, no thread at all.
    monkeypatch.setenv("REMAT_PROGRESS", "1")
    with planning_wait("remat: planning", after=0.05, every=0.02) as w:
        time.sleep(0.3)
    assert w.drawn and "remat: planning" in capfd.readouterr().err
    with planning_wait("remat: planning", after=0.5) as w:  # a plan quicker than `after`: nothing
        pass
    assert not w.drawn and capfd.readouterr().err == ""
    monkeypatch.setenv("REMAT_PROGRESS", "0")
    threads = threading.active_count()
    with planning_wait("remat: planning", after=0.0) as w:
        assert threading.active_count() == threads
        time.sleep(0.05)
    assert not w.drawn and capfd.readouterr().err == ""
    # A planned model's plan that takes long (its planner slowed here) says so, under its own name.
    real = _core.plan_step

    def slow(*args, **kwargs):
        time.sleep(0.8)
        return real(*args, **kwargs)
    monkeypatch.setenv("REMAT_PROGRESS", "1")
    monkeypatch.setattr(_core, "plan_step", slow)
    model = mlp(depth=2, width=16, hidden=32)
    lp = remat.enable(model, list(model), budget=1 << 40)
    train_step(model, torch.randn(4, 16))
    assert "remat.enable: planning" in capfd.readouterr().err
    lp.remove()
