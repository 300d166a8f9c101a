#!/usr/bin/env python3
"""The host time an Offload spends per tensor it sends (docs/BENCHMARKS.md, "The Offload's host time per saved
tensor"): a chain of --tensors `sin` calls on a small CPU tensor (--bytes each; every call saves its input), forward
and backward, under an Offload that sends each one (min_bytes = --bytes, copies made at once and held until
waited on, as the planned layers' engines do), against the same chain under an Offload that sends nothing. The
difference over the tensors is what pack, the copy each way, unpack and drop cost the host, the copies of a few
KiB included. The ways run in turn, --steps steps a round; each figure is the least of --rounds rounds (what
the machine's noise adds only raises a round), and the tenth-fastest round beside it.

--against PATH loads another version of python/remat/offload.py (`git show REV:python/remat/offload.py > old.py`)
and runs it in the same rounds, so that a change is measured against what it changed in one process:

    taskset -c 1 python bench/offload_host_time.py --against /tmp/old_offload.py

--device cuda: the tensors on the GPU, copied by the CUDA copy engine (a side stream, an event a copy, pinned host
blocks), each step synchronized at its end; the difference is then the host's time per tensor with the waits
for each copy (scripts/gpu-session's `overhead` part runs it):

    python bench/offload_host_time.py --device cuda --rounds 20
"""
from __future__ import annotations

import argparse
import importlib.util
import time

import torch

import remat.offload


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tensors", type=int, default=32)
    ap.add_argument("--bytes", type=int, default=4096, help="each saved tensor's bytes (fp32)")
    ap.add_argument("--rounds", type=int, default=40)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--against", help="another offload.py, run beside this one")
    ap.add_argument("--device", default="cpu", help="cpu, or cuda (the CUDA copy engine, a step synchronized)")
    a = ap.parse_args()
    if a.bytes < 4 or a.bytes % 4:
        raise SystemExit(f"offload_host_time.py: --bytes must be a positive multiple of 4, got {a.bytes}")
    for name in ("tensors", "rounds", "steps"):
        if getattr(a, name) < 1:
            raise SystemExit(f"offload_host_time.py: --{name} must be at least 1, got {getattr(a, name)}")
    torch.set_num_threads(1)
    modules = {"this": remat.offload}
    if a.against:
        spec = importlib.util.spec_from_file_location("remat.offload_against", a.against)
        other = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(other)
        modules["against"] = other
    dev = torch.device(a.device)
    cuda = dev.type == "cuda"
    if cuda and not torch.cuda.is_available():
        raise SystemExit("offload_host_time.py: --device cuda, but no CUDA device is available")
    sync = torch.cuda.synchronize if cuda else (lambda: None)

    def offload(mod, min_bytes):
        # On the CPU copies made at once, held until waited on (the planned layers' engines); on CUDA, pinned.
        return mod.Offload(pool=mod.HostPool(pin=cuda), min_bytes=min_bytes, engine=mod.CopyEngine(dev, hold=True))

    ways = {"sends nothing": offload(remat.offload, a.bytes + 1)}
    ways.update({name: offload(mod, a.bytes) for name, mod in modules.items()})
    x0 = torch.randn(a.bytes // 4, device=dev, requires_grad=True)

    def step(off):
        x = x0
        with off:
            for _ in range(a.tensors):
                x = x.sin()
        off.finish_copies()
        x.sum().backward()
        sync()

    for _ in range(2 * a.steps):
        for off in ways.values():
            step(off)
    rounds = {name: [] for name in ways}
    for _ in range(a.rounds):
        for name, off in ways.items():
            t0 = time.perf_counter()
            for _ in range(a.steps):
                step(off)
            rounds[name].append((time.perf_counter() - t0) / a.steps * 1e6)
    for off in list(ways.values())[1:]:
        assert off.offloaded == a.tensors * a.steps * (a.rounds + 2), off.offloaded  # each step sent them all
    base = sorted(rounds["sends nothing"])
    tenth = a.rounds // 10
    where = torch.cuda.get_device_name(dev) if cuda else "the CPU"
    print(f"torch {torch.__version__}, {where}, {a.tensors} tensors of {a.bytes} bytes a step, {a.steps} steps a "
          f"round, {a.rounds} rounds; a step sending nothing: {base[0]:.1f} us (least round)")
    for name in modules:
        r = sorted(rounds[name])
        print(f"{name:8s} per tensor sent: {(r[0] - base[0]) / a.tensors:6.2f} us (least rounds), "
              f"{(r[tenth] - base[tenth]) / a.tensors:6.2f} us (tenth-fastest rounds)")


if __name__ == "__main__":
    main()
