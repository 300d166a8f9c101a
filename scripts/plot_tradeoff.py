#!/usr/bin/env python3
"""Draws `remat sweep --csv` (the optimal planner's predicted memory/time curve, baselines as points) to PNG, with
the measured points of bench/compare.py (compare.json) when given. With --frontier (compare.py --frontier's
compare.json) it draws the frontier: the planner's predicted curve and measured points, every PyTorch option's
measured point joined to remat's point at the same memory, and the floor (the least memory any schedule of the
chain needs, and the plain step's time).

    scripts/plot_tradeoff.py out/bert-tradeoff.csv -o out/tradeoff.png [--measured out/compare.json]
    scripts/plot_tradeoff.py out/bert-tradeoff.csv -o out/frontier.png --frontier out/compare.json
"""
import argparse
import csv
import json

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("csv")
    p.add_argument("-o", "--output", default="tradeoff.png")
    p.add_argument("--measured", help="compare.json of bench/compare.py: measured points to overlay")
    p.add_argument("--frontier", help="compare.json of bench/compare.py --frontier: draw the frontier")
    a = p.parse_args()

    title, rows = "", []
    with open(a.csv) as f:
        lines = [line for line in f if not (line.startswith("#") and (title := title or line[1:].strip()))]
        rows = list(csv.DictReader(lines))
    mib = 2.0 ** 20

    def peak(r):  # predicted activation peak: simulate()'s figure without the chain's input, as measured peaks are
        return (int(r["predicted_peak_bytes"]) - int(r.get("input_bytes") or 0)) / mib

    opt = sorted((r for r in rows if r["kind"] == "optimal"), key=peak)
    base = [r for r in rows if r["kind"] == "baseline"]
    labelled = {"none", "all", "sqrt", "uniform:2", "uniform:4"}

    if a.frontier:
        return draw_frontier(a, title, opt, peak)
    fig, ax = plt.subplots(figsize=(8, 5))
    ax.plot([peak(r) for r in opt], [100 * float(r["overhead"]) for r in opt], "-o", ms=3,
            label="remat optimal planner (predicted)")
    ax.plot([peak(r) for r in base], [100 * float(r["overhead"]) for r in base], "s", ms=5, color="gray",
            label="baselines (predicted)")
    for r in base:
        if r["name"] in labelled:
            ax.annotate(r["name"], (peak(r), 100 * float(r["overhead"])), fontsize=7, xytext=(4, 4),
                        textcoords="offset points")
    if a.measured:
        m = json.load(open(a.measured))
        for lib, marker in (("remat", "^"), ("pytorch", "v")):
            for r in m[lib]["rows"]:
                x, y = r["peak_bytes"] / mib, 100 * (r["time_ratio"] - 1)
                ax.plot(x, y, marker, ms=8, label=f"{lib} {r['strategy']} (measured)")
    ax.set_xlabel("peak activation memory (MiB)")
    ax.set_ylabel("time overhead over no checkpointing (%)")
    ax.set_title(title or "memory / time trade-off", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(a.output, dpi=120)
    print(f"plot_tradeoff: wrote {a.output}")


def draw_frontier(a, title, opt, peak):
    m = json.load(open(a.frontier))
    mib = 2.0 ** 20
    fig, ax = plt.subplots(figsize=(9, 5.5))
    floor = peak(opt[0]) if opt else 0
    ax.axvline(floor, color="black", ls=":", lw=1)
    ax.annotate("floor: least memory of any schedule", (floor, 0), rotation=90, fontsize=7, xytext=(3, 12),
                textcoords="offset points", va="bottom")
    ax.axhline(0, color="black", ls=":", lw=1)
    ax.plot([peak(r) for r in opt], [100 * float(r["overhead"]) for r in opt], "-", lw=1, color="tab:blue",
            alpha=0.6, label="remat optimal planner (predicted)")
    first = True
    for k, row in enumerate(m["frontier"]):
        px, py = row["peak_bytes"] / mib, 100 * (row["time_ratio"] - 1)
        rx, ry = row["remat_peak_bytes"] / mib, 100 * (row["remat_time_ratio"] - 1)
        color = "tab:orange" if row["library"] == "PyTorch" else "tab:purple"
        ax.plot(px, py, "v", ms=9, color=color, label=None)
        ax.annotate(f"{row['library']}: {row['strategy']}", (px, py), fontsize=7, xytext=(5, 3 + 9 * (k % 3)),
                    textcoords="offset points", color=color)
        ax.plot(rx, ry, "^", ms=9, color="tab:blue", label="remat planner at that memory (measured)" if first else None)
        ax.annotate("", (rx, ry), (px, py), arrowprops=dict(arrowstyle="->", color="gray", lw=0.8))
        first = False
    ax.plot([], [], "v", color="tab:orange", label="PyTorch options (measured)")
    if any(row["library"] != "PyTorch" for row in m["frontier"]):
        ax.plot([], [], "v", color="tab:purple", label="Hugging Face (measured)")
    for r in m["remat"]["rows"]:
        if r["strategy"] == "all":
            ax.plot(r["peak_bytes"] / mib, 100 * (r["time_ratio"] - 1), "s", ms=6, color="tab:green",
                    label="remat per layer (measured)")
    # The measured points decide the height: the planner's curve rises steeply next to the floor.
    tops = [100 * (row[k] - 1) for row in m["frontier"] for k in ("time_ratio", "remat_time_ratio")]
    tops += [100 * (r["time_ratio"] - 1) for r in m["remat"]["rows"]]
    ax.set_ylim(-3, 1.3 * max(tops + [1]) + 3)
    ax.annotate("plain step (no checkpointing)", (ax.get_xlim()[0], 0), fontsize=7, xytext=(40, 3),
                textcoords="offset points")
    ax.set_xlabel("peak activation memory (MiB, bytes over parameters + gradients + inputs)")
    ax.set_ylabel("step time overhead over no checkpointing (%)")
    ax.set_title((title or "memory / time frontier") + "\nlower and further left is better; arrows: PyTorch option "
                 "-> remat at the same memory", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="upper right")
    fig.tight_layout()
    fig.savefig(a.output, dpi=120)
    print(f"plot_tradeoff: wrote {a.output}")


if __name__ == "__main__":
    main()
