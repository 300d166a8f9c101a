#!/usr/bin/env python3
"""Draws `remat sweep --csv` (the optimal planner's predicted memory/time curve, baselines as points) to PNG, with
the measured points of bench/compare.py (compare.json) when given.

    scripts/plot_tradeoff.py out/bert-tradeoff.csv -o out/tradeoff.png [--measured out/compare.json]
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


if __name__ == "__main__":
    main()
