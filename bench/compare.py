#!/usr/bin/env python3
"""remat and PyTorch side by side, in one go: runs `remat bench` and bench/pytorch_reference.py on the same model
(both measured with remat's meter), prints the two tables and the ratios, and with --plot draws the trade-off curve.

    bench/compare.py                                  # the headline: BERT-base-like on CPU, writes out/tradeoff.png
    bench/compare.py --model mlp --depth 16 --width 1024 --remat none,all,uniform:4 --pytorch none,all,uniform:4

Timing across two processes drifts on a shared machine: --rounds R alternates the two programs R times and keeps,
for every row, the median over rounds of its per-round median.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL_FLAGS = ["layers", "hidden", "heads", "intermediate", "seq", "vocab", "dropout", "batch", "depth", "width",
               "calls", "adds"]


def run(cmd):
    print("+ " + " ".join(cmd), file=sys.stderr, flush=True)
    subprocess.run(cmd, check=True)


def merge(rounds):
    """Rows of several rounds of one program: medians of the per-round medians; peaks are the largest seen."""
    out = json.loads(json.dumps(rounds[0]))
    for i, row in enumerate(out["rows"]):
        per_round = [r["rows"][i] for r in rounds]
        row["median_ms"] = statistics.median(x["median_ms"] for x in per_round)
        row["forward_ms"] = statistics.median(x.get("forward_ms", 0) for x in per_round)
        row["peak_bytes"] = max(x["peak_bytes"] for x in per_round)
        row["after_forward_bytes"] = max(x["after_forward_bytes"] for x in per_round)
    none = out["rows"][0]
    if none["peak_bytes"] <= 0:
        sys.exit(f"compare.py: {out.get('library', 'a program')} measured no memory at all for 'none': is "
                 "libremat_meter.so built against the LibTorch of this Python's torch (REMAT_PYTHON)?")
    for row in out["rows"]:
        row["time_ratio"] = row["median_ms"] / none["median_ms"]
        row["peak_ratio"] = row["peak_bytes"] / none["peak_bytes"]
    return out


def mib(b):
    return f"{b / 2**20:.1f}"


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="bert", choices=["bert", "mlp", "heavy", "cifar"])
    for flag in MODEL_FLAGS:
        p.add_argument("--" + flag)
    p.add_argument("--remat", default="none,all,sqrt,optimal:overhead=0.5", help="remat strategies")
    p.add_argument("--pytorch", default="none,all", help="PyTorch strategies (none, all, all-reentrant, uniform:K, selective on PyTorch >= 2.4)")
    p.add_argument("--steps", default="3")
    p.add_argument("--warmup", default="1")
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--plot", action="store_true", help="also sweep the optimal planner and draw the trade-off PNG")
    p.add_argument("--out", default=os.path.join(ROOT, "out"), help="where JSON, CSV and PNG go")
    p.add_argument("--build", default=os.path.join(ROOT, "build"))
    a = p.parse_args()

    os.makedirs(a.out, exist_ok=True)
    python = os.environ.get("REMAT_PYTHON", "/usr/bin/python3")
    flags = ["--model", a.model]
    for flag in MODEL_FLAGS:
        if getattr(a, flag) is not None:
            flags += ["--" + flag, getattr(a, flag)]
    chain = os.path.join(a.out, f"{a.model}-chain.json")
    remat_rounds, torch_rounds = [], []
    for r in range(a.rounds):
        rj, tj = os.path.join(a.out, f"remat-{r}.json"), os.path.join(a.out, f"pytorch-{r}.json")
        extra = ["--save-chain", chain] if a.plot and r == 0 else []
        run([os.path.join(a.build, "bin", "remat"), "bench", *flags, "--strategy", a.remat, "--steps", a.steps,
             "--warmup", a.warmup, "--json", rj, *extra])
        run([python, os.path.join(ROOT, "bench", "pytorch_reference.py"), "--meter",
             os.path.join(a.build, "libremat_meter.so"), *flags, "--strategy", a.pytorch, "--steps", a.steps,
             "--warmup", a.warmup, "--json", tj])
        remat_rounds.append(json.load(open(rj)))
        torch_rounds.append(json.load(open(tj)))
    rm, pt = merge(remat_rounds), merge(torch_rounds)

    print(f"\n{rm['model']}\nbytes over parameters + gradients + inputs (remat {mib(rm['base_bytes'])} MiB, "
          f"PyTorch {mib(pt['base_bytes'])} MiB); {a.rounds} round(s) of {a.steps} interleaved steps\n")
    header = (f"{'library':<10}{'strategy':<24}{'peak MiB':>10}{'kept MiB':>10}{'median ms':>11}{'fwd ms':>9}"
              f"{'time/none':>11}")
    print(header + "\n" + "-" * len(header))
    for lib, res in (("remat", rm), ("pytorch", pt)):
        for r in res["rows"]:
            print(f"{lib:<10}{r['strategy']:<24}{mib(r['peak_bytes']):>10}{mib(r['after_forward_bytes']):>10}"
                  f"{r['median_ms']:>11.1f}{r.get('forward_ms', 0):>9.1f}{r['time_ratio']:>11.2f}")
    rrows = {r["strategy"]: r for r in rm["rows"]}
    prows = {r["strategy"]: r for r in pt["rows"]}
    print("\nremat / PyTorch, same strategy:")
    for s in prows:
        if s in rrows:
            rp, pp = rrows[s]["peak_bytes"], prows[s]["peak_bytes"]
            print(f"  {s:<16} peak {rp / pp:.3f}   step time {rrows[s]['median_ms'] / prows[s]['median_ms']:.3f}   "
                  f"overhead over own none: remat {rrows[s]['time_ratio']:.2f}x, PyTorch {prows[s]['time_ratio']:.2f}x")
    summary = {"remat": rm, "pytorch": pt}
    with open(os.path.join(a.out, "compare.json"), "w") as f:
        json.dump(summary, f, indent=2)

    if a.plot:
        csv = os.path.join(a.out, f"{a.model}-tradeoff.csv")
        png = os.path.join(a.out, "tradeoff.png")
        run([os.path.join(a.build, "bin", "remat"), "sweep", "--chain", chain, "--budgets", "24", "--csv", csv,
             "--title", rm["model"]])
        run([python, os.path.join(ROOT, "scripts", "plot_tradeoff.py"), csv, "--measured",
             os.path.join(a.out, "compare.json"), "-o", png])
        print(f"\ntrade-off plot written to {png}")


if __name__ == "__main__":
    main()
