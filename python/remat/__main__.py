"""python -m remat: the Python package's command line.

    python -m remat plot --chain chain.json --budget 300MiB -o step.png   # a picture of the planned step

`plot` plans a saved chain (the remat command's or LayerPlan.chain.to_json()'s JSON) for the budget with the
per-layer planner (or --planner optimal) and draws the step's predicted memory over time beside the plain
step's (remat.plot_step); --timeline also writes the data behind it (remat/planner/timeline.h's JSON). With
--context (a step context's figures as JSON: {"rest_peak_bytes": N, ...}) the step around the chain counts too;
without it the step is the chain alone.
"""
from __future__ import annotations

import argparse
import json
import sys

from . import _core


def _context(path: str | None) -> _core.StepContext:
    ctx = _core.StepContext()
    if path is None:
        return ctx
    with open(path) as f:
        figures = json.load(f)
    for key, value in figures.items():
        if not hasattr(ctx, key):
            raise SystemExit(f"python -m remat plot: --context: a step context has no figure '{key}'")
        setattr(ctx, key, value)
    return ctx


def plot(argv) -> int:
    ap = argparse.ArgumentParser(prog="python -m remat plot", description="A picture of the planned step.")
    ap.add_argument("--chain", required=True, help="the chain JSON")
    ap.add_argument("--budget", required=True, help="the step's budget (bytes, or a size such as 300MiB)")
    ap.add_argument("--planner", default="per-layer", choices=("per-layer", "optimal"))
    ap.add_argument("--context", help="the step context's figures as JSON (default: the chain alone)")
    ap.add_argument("--timeline", help="also write the timeline JSON here")
    ap.add_argument("-o", "--output", required=True, help="the picture (.png, .svg, .pdf)")
    a = ap.parse_args(argv)
    try:
        budget = _core.parse_size(a.budget)
        chain = _core.load_chain(a.chain)
        ctx = _context(a.context)
        planned = _core.plan_step(chain, ctx, budget, a.planner)
    except (ValueError, OSError) as e:  # InfeasibleBudget is a ValueError: it names the least budget
        print(f"python -m remat plot: {e}", file=sys.stderr)
        return 1
    text = _core.step_timeline_json(chain, ctx, planned.plan, budget)
    if a.timeline:
        with open(a.timeline, "w") as f:
            f.write(text)
    from .plot_step import draw
    draw(json.loads(text), a.output, compare=json.loads(_core.step_timeline_json(chain, ctx, _core.no_checkpoint(chain))))
    print(f"python -m remat plot: {planned.plan} (predicted peak {_core.format_bytes(planned.step_peak_bytes)} of "
          f"{_core.format_bytes(budget)}) drawn to {a.output}")
    return 0


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0 if argv else 2
    if argv[0] == "plot":
        return plot(argv[1:])
    print(f"python -m remat: unknown command '{argv[0]}' (plot)", file=sys.stderr)
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
