#!/usr/bin/env python3
"""Where a planned model's profiling step spends its time (issue 44, "Progress on long work"): Hugging Face's
BertModel from its config (4 layers, hidden 256, 4 heads, ffn 1024, sequence 128, random weights) at --batch,
fp32 on the CPU. Times a plain step (the faster of two, after one untimed), then the profiling step under
remat.hf.enable and the planned step after it, and prints the profile's seconds by phase
(LayerPlan.profiling_time). docs/python.md quotes one run:

    python bench/profiling_time.py --batch 44
"""
import argparse
import time

import torch
import transformers

import remat
import remat.hf


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=44)
    args = ap.parse_args()
    torch.manual_seed(0)
    cfg = transformers.BertConfig(vocab_size=30522, hidden_size=256, num_hidden_layers=4, num_attention_heads=4,
                                  intermediate_size=1024, max_position_embeddings=512)
    model = transformers.BertModel(cfg, add_pooling_layer=False)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    ids = torch.randint(0, 30522, (args.batch, 128), generator=torch.Generator().manual_seed(args.batch))
    batch = dict(input_ids=ids, attention_mask=torch.ones_like(ids))

    def step():
        t0 = time.perf_counter()
        model(**batch).last_hidden_state.float().pow(2).mean().backward()
        return time.perf_counter() - t0

    step()
    plain = min(step() for _ in range(2))
    lp = remat.hf.enable(model, budget=1 << 40)
    profiling = step()
    times = lp.profiling_time
    print(f"plain step {plain:.2f} s; profiling step {profiling:.2f} s, of which the profile "
          f"{sum(times.values()):.2f} s:", ", ".join(f"{k} {v:.2f} s" for k, v in times.items()))
    print(f"planned step {step():.2f} s")


if __name__ == "__main__":
    main()
