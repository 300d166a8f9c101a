#!/usr/bin/env python3
"""How long LayerPlan.set_budget takes with saved groups and offloading, the planner's largest search (issue
42's GPU benchmark calls it before each remat row of each round): a Hugging Face BertForMaskedLM of --layers
(24) from its config (hidden 64, 2 heads, ffn 256, vocabulary 128, batch 4, sequence 128, random weights),
profiled on the CPU by remat.hf.enable(model, budget=1 << 40, offload=True, offload_min_bytes=4096,
groups=True): ten saved groups a layer. Plans at each budget twice, in turn, and prints each call's seconds (the second round's are
plans kept from the first) and the plan's predicted peak. --chain saves the profiled chain (the remat command's
chain JSON). docs/BENCHMARKS.md ("Planner speed") quotes these runs:

    python bench/set_budget_speed.py --chain out/bench/bert24-groups.json
    python bench/set_budget_speed.py --layers 48 --budgets 30000000     # and --layers 96: the time with depth
"""
import argparse
import time

import torch
import transformers

import remat
import remat.hf


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--budgets", default="16000000,20000000,30000000", help="bytes, comma-separated")
    ap.add_argument("--chain", help="write the profiled chain here")
    ap.add_argument("--layers", type=int, default=24)
    args = ap.parse_args()
    torch.manual_seed(0)
    cfg = transformers.BertConfig(hidden_size=64, num_hidden_layers=args.layers, num_attention_heads=2, intermediate_size=256,
                                  vocab_size=128)
    model = transformers.BertForMaskedLM(cfg).train()
    ids = torch.randint(0, 128, (4, 128), generator=torch.Generator().manual_seed(0))
    lp = remat.hf.enable(model, budget=1 << 40, offload=True, offload_min_bytes=4096, groups=True)
    model(input_ids=ids, labels=ids).loss.backward()
    if args.chain:
        with open(args.chain, "w") as f:
            f.write(lp.chain.to_json())
    print(f"{len(lp.chain.stages)} layers, {sum(len(s.groups) for s in lp.chain.stages)} saved groups; least "
          f"feasible budget {lp.min_budget_bytes} bytes")
    for rnd in (1, 2):
        for b in (int(x) for x in args.budgets.split(",")):
            t0 = time.perf_counter()
            lp.set_budget(b)
            s = time.perf_counter() - t0
            print(f"round {rnd}: set_budget({b}) {s:.3f} s, predicted peak {lp.predicted_peak_bytes} bytes, "
                  f"plan {str(lp.plan)[:60]}...")


if __name__ == "__main__":
    main()
