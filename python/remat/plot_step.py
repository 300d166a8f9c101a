#!/usr/bin/env python3
"""A picture of a planned step: its memory over time as the plan predicts it, drawn from the planner library's
timeline JSON (remat/planner/timeline.h: remat._core.step_timeline_json, `remat plan --plot`).

Each operation is drawn at its predicted peak over its predicted time; each stage's forward and backward are
marked under the curve, coloured by how the plan runs the stage (kept, checkpointed, under a policy, sent to the
host, streamed); the budget is a line, and so is a measured peak where one is given. A second timeline (the
plain step's) is drawn beside it for comparison.

Needs matplotlib only (not the rest of remat), so that the C++ command can run this file with any python3:

    python3 plot_step.py step.json [--compare plain.json] [--measured-peak BYTES] -o step.png
"""
from __future__ import annotations

import argparse
import json

__all__ = ["draw", "main"]

_WAY_COLOURS = {"Fa": "#4c72b0", "Fc": "#dd8452", "Fk": "#55a868", "Fn": "#c44e52"}


def _colour(way: str) -> str:
    base = way.split("[")[0].split("{")[0].split("@")[0]
    return _WAY_COLOURS.get(base, "#8172b3")


def _curve(timeline: dict):
    xs, ys = [], []
    for p in timeline["points"]:
        xs += [p["start_ms"], p["end_ms"]]
        ys += [p["peak_bytes"] / 2**20] * 2
    return xs, ys


def draw(timeline: dict, path: str, *, compare: dict | None = None, compare_label: str = "plain step",
         measured_peak: int | None = None, title: str | None = None) -> None:
    """Draws `timeline` (the timeline JSON, parsed) to `path` (any format matplotlib writes: .png, .svg, .pdf)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    fig, ax = plt.subplots(figsize=(11, 5))
    top = 0.0
    if compare is not None:
        xs, ys = _curve(compare)
        ax.plot(xs, ys, color="0.6", lw=1.2, ls="--", label=f"{compare_label} (predicted)")
        top = max(ys)
    xs, ys = _curve(timeline)
    ax.plot(xs, ys, color="black", lw=1.6, label=f"planned step (predicted): {timeline['plan']}"[:110])
    top = max([top] + ys)
    budget = timeline.get("budget_bytes", -1)
    if budget is not None and budget >= 0:
        ax.axhline(budget / 2**20, color="#c44e52", lw=1.2, label=f"budget {budget / 2**20:.1f} MiB")
        top = max(top, budget / 2**20)
    if measured_peak is not None and measured_peak >= 0:
        ax.axhline(measured_peak / 2**20, color="#8172b3", lw=1, ls=":",
                   label=f"measured peak {measured_peak / 2**20:.1f} MiB")
        top = max(top, measured_peak / 2**20)
    # Each stage's forward and backward under the curve, coloured by its way.
    ways = [s["way"] for s in timeline["stages"]]
    band = max(top, 1e-9) * 0.04
    for p in timeline["points"]:
        stage = p["stage"]
        if stage < 0 or stage >= len(ways) or p["end_ms"] <= p["start_ms"]:
            continue
        y = -band * (1.6 if p["backward"] else 0.6)
        ax.broken_barh([(p["start_ms"], p["end_ms"] - p["start_ms"])], (y, band * 0.9),
                       facecolors=_colour(ways[stage]), edgecolor="white", lw=0.3)
    ax.text(0, -band * 0.15, " forward", va="bottom", fontsize=7, color="0.3")
    ax.text(0, -band * 1.15, " backward", va="bottom", fontsize=7, color="0.3")
    handles, labels = ax.get_legend_handles_labels()
    for way in sorted(set(ways)):
        handles.append(Patch(color=_colour(way)))
        labels.append(f"{way} ({sum(w == way for w in ways)} of {len(ways)} stages)")
    ax.legend(handles, labels, fontsize=7, loc="upper left")
    ax.set_ylim(-band * 2, top * 1.12 + band)
    ax.set_xlabel("predicted time in the step (ms)")
    ax.set_ylabel("memory above the step's base (MiB)")
    ax.set_title(title or "the planned step's memory over time")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="Draws a planned step's timeline JSON (remat/planner/timeline.h).")
    ap.add_argument("timeline", help="the timeline JSON (remat plan --plot writes it beside the picture)")
    ap.add_argument("--compare", help="another timeline to draw beside it (the plain step's)")
    ap.add_argument("--measured-peak", type=int, help="a measured peak to mark (bytes)")
    ap.add_argument("--title")
    ap.add_argument("-o", "--output", required=True)
    a = ap.parse_args(argv)
    with open(a.timeline) as f:
        timeline = json.load(f)
    compare = None
    if a.compare:
        with open(a.compare) as f:
            compare = json.load(f)
    draw(timeline, a.output, compare=compare, measured_peak=a.measured_peak, title=a.title)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
