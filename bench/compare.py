#!/usr/bin/env python3
"""remat and PyTorch side by side, in one go: runs `remat bench` and bench/pytorch_reference.py on the same model
(both measured with remat's meter), prints the two tables and the ratios, and with --plot draws the trade-off curve.

    bench/compare.py                                  # the headline: BERT-base-like on CPU, writes out/tradeoff.png
    bench/compare.py --model mlp --depth 16 --width 1024 --remat none,all,uniform:4 --pytorch none,all,uniform:4

Timing across two processes drifts on a shared machine: --rounds R alternates the two programs R times and keeps,
for every row, the median over rounds of its per-round median.
"""
import argparse
import csv as csvmod
import json
import os
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL_FLAGS = ["layers", "hidden", "heads", "intermediate", "seq", "vocab", "dropout", "batch", "depth", "width",
               "calls", "adds", "blocks"]
DEFAULT_REMAT = "none,all,sqrt,optimal:overhead=0.5"


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
    p.add_argument("--model", default="bert", choices=["bert", "mlp", "heavy", "cifar", "resnet"])
    for flag in MODEL_FLAGS:
        p.add_argument("--" + flag)
    p.add_argument("--remat", default=DEFAULT_REMAT, help="remat strategies")
    p.add_argument("--pytorch", default="none,all", help="PyTorch strategies (none, all, all-reentrant, uniform:K, selective and compile:BUDGET on PyTorch >= 2.4)")
    p.add_argument("--steps", default="3")
    p.add_argument("--warmup", default="1")
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--plot", action="store_true", help="also sweep the optimal planner and draw the trade-off PNG")
    p.add_argument("--frontier", action="store_true",
                   help="run PyTorch first, then remat's optimal planner at every PyTorch point's measured peak; "
                        "print the side-by-side frontier table and draw out/frontier.png")
    p.add_argument("--granularity", default="layer", help="remat's chain: layer or sublayer (bert)")
    p.add_argument("--keep", default="",
                   help="remat::keep tags to profile the chain with (matmul: the planner may keep a layer's "
                        "matrix multiplications, conv its convolutions); remat's all-keep-matmul or all-keep-conv "
                        "is measured too")
    p.add_argument("--policy", default="",
                   help="operator-level policy presets to profile the chain with (e.g. matmuls,recompute_pointwise: "
                        "the planner may run a layer as Fk[NAME]); remat's all-policy-NAME is measured too")
    p.add_argument("--hf", action="store_true",
                   help="with --frontier: also Hugging Face's BertModel (none, gradient_checkpointing_enable)")
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
    if a.frontier:
        return frontier(a, python, flags, chain)
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


def frontier(a, python, flags, chain):
    """Every PyTorch option against remat's planner at that option's measured peak, in alternated rounds."""
    remat_bin = os.path.join(a.build, "bin", "remat")
    meter = os.path.join(a.build, "libremat_meter.so")
    torch_rounds, hf_rounds, remat_rounds = [], [], []
    remat_strategies = None
    # The chain once, and from the planner's curve its floor: the least memory of any schedule. A PyTorch point
    # below it gets remat's plan at the floor (and says so).
    g = ["--granularity", a.granularity]
    keep = ["--keep", a.keep] if a.keep else []
    keep += ["--policy", a.policy] if a.policy else []
    run([remat_bin, "profile", *flags, *g, *keep, "--repeats", "3", "--json", chain])
    csv = os.path.join(a.out, f"{a.model}-tradeoff.csv")
    title = f"{a.model} ({a.granularity} stages)"
    run([remat_bin, "sweep", "--chain", chain, "--budgets", "32", "--csv", csv, "--title", title])
    with open(csv) as f:
        curve = list(csvmod.DictReader(line for line in f if not line.startswith("#")))
    floor = min(int(r["predicted_peak_bytes"]) for r in curve if r["kind"] == "optimal")
    for r in range(a.rounds):
        tj = os.path.join(a.out, f"pytorch-{r}.json")
        run([python, os.path.join(ROOT, "bench", "pytorch_reference.py"), "--meter", meter, *flags, "--strategy",
             a.pytorch, "--steps", a.steps, "--warmup", a.warmup, "--json", tj])
        torch_rounds.append(json.load(open(tj)))
        if a.hf:
            hj = os.path.join(a.out, f"hf-{r}.json")
            hflags = ["--model", "hf-bert"] + flags[2:]
            run([python, os.path.join(ROOT, "bench", "pytorch_reference.py"), "--meter", meter, *hflags,
                 "--strategy", "none,all", "--steps", a.steps, "--warmup", a.warmup, "--json", hj])
            hf_rounds.append(json.load(open(hj)))
        if remat_strategies is None:  # the budgets: PyTorch's peaks of the first round
            points = [row for res in [torch_rounds[0]] + hf_rounds[:1] for row in res["rows"]
                      if row["strategy"] != "none"]
            budgets = sorted({max(row["peak_bytes"], floor) for row in points})
            kept = [f"all-keep-{t}" for t in a.keep.split(",") if t in ("matmul", "conv")]
            kept += [f"all-policy-{n}" for n in a.policy.split(",") if n]
            remat_strategies = ["none", "all"] + kept + [f"optimal:{b}" for b in budgets]
            if a.remat and a.remat != DEFAULT_REMAT:
                remat_strategies += [s for s in a.remat.split(",") if s and s not in remat_strategies]
        rj = os.path.join(a.out, f"remat-{r}.json")
        run([remat_bin, "bench", *flags, *g, "--chain", chain, "--strategy", ",".join(remat_strategies),
             "--steps", a.steps, "--warmup", a.warmup, "--json", rj])
        remat_rounds.append(json.load(open(rj)))
    rm, pt = merge(remat_rounds), merge(torch_rounds)
    hf = merge(hf_rounds) if hf_rounds else None
    rrows = {row["strategy"]: row for row in rm["rows"]}

    print(f"\n{rm['model']} ({a.granularity} stages); {a.rounds} alternated round(s) of {a.steps} interleaved "
          f"steps; peaks are bytes over parameters + gradients + inputs\n")
    header = (f"{'PyTorch option':<34}{'peak MiB':>9}{'time/none':>10} | {'remat at that peak':>9}{'time/none':>10}"
              f"{'predicted':>10}{'overhead vs PyTorch':>21}  verdict")
    print(header + "\n" + "-" * len(header))
    table = []
    sources = [("PyTorch", pt)] + ([("Hugging Face", hf)] if hf else [])
    for lib, res in sources:
        for row in res["rows"]:
            if row["strategy"] == "none":
                continue
            # The budget is the first round's peak; the row's peak is the largest over rounds.
            first = next(x for x in (torch_rounds[0] if lib == "PyTorch" else hf_rounds[0])["rows"]
                         if x["strategy"] == row["strategy"])
            mine = rrows.get(f"optimal:{max(first['peak_bytes'], floor)}")
            if mine is None:
                continue
            t, tr = row["time_ratio"], mine["time_ratio"]
            pred = mine.get("predicted_time_ratio")
            ratio = (tr - 1) / (t - 1) if t > 1 else float("inf")
            if first["peak_bytes"] < floor:
                verdict = f"below remat's floor ({mib(floor)} MiB): remat at its floor"
            elif mine["peak_bytes"] > first["peak_bytes"]:
                verdict = "over budget"
            elif tr - 1 <= (t - 1) / 2:
                verdict = "at most half the overhead"
            elif pred is not None and pred - 1 > (t - 1) / 2:
                verdict = f"halving impossible in the model (planner's best {100 * (pred - 1):.0f}%)"
            elif tr <= t:
                verdict = "faster, not half"
            else:
                verdict = "slower"
            name = f"{lib}: {row['strategy']}"
            print(f"{name:<34}{mib(row['peak_bytes']):>9}{t:>10.2f} | {mib(mine['peak_bytes']):>9}{tr:>10.2f}"
                  f"{(pred or 0):>10.2f}{ratio:>21.2f}  {verdict}")
            table.append({"library": lib, "floor_bytes": floor, "strategy": row["strategy"], "peak_bytes": row["peak_bytes"],
                          "budget_bytes": first["peak_bytes"], "time_ratio": t,
                          "remat_peak_bytes": mine["peak_bytes"], "remat_time_ratio": tr,
                          "remat_predicted_time_ratio": pred, "overhead_ratio": ratio, "verdict": verdict})
    summary = {"remat": rm, "pytorch": pt, "frontier": table}
    if hf:
        summary["hf"] = hf
    with open(os.path.join(a.out, "compare.json"), "w") as f:
        json.dump(summary, f, indent=2)
    png = os.path.join(a.out, "frontier.png")
    run([remat_bin, "sweep", "--chain", chain, "--budgets", "32", "--csv", csv, "--title",
         rm["model"] + f" ({a.granularity} stages)", "--plot", png, "--frontier", os.path.join(a.out, "compare.json")])
    print(f"\nfrontier plot written to {png}")


if __name__ == "__main__":
    main()
