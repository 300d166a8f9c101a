#!/usr/bin/env python3
"""Writes the chains of the planner speed benchmark: a random heterogeneous 100-stage chain and a homogeneous
100,000-stage one (docs/chain-format.md), into the folder given."""
import json
import os
import random
import sys

out = sys.argv[1] if len(sys.argv) > 1 else "."
rng = random.Random(2019)
mib = 2 ** 20
stages = []
for i in range(100):
    output = rng.randint(2, 12) * mib
    stages.append({"name": f"s{i}", "fwd_ms": rng.uniform(1, 10), "bwd_ms": rng.uniform(2, 20), "output_bytes": output,
                   "saved_bytes": output + rng.randint(0, 30) * mib, "fwd_tmp_bytes": rng.randint(0, 4) * mib,
                   "bwd_tmp_bytes": rng.randint(0, 8) * mib})
with open(os.path.join(out, "random-100.json"), "w") as f:
    json.dump({"input_bytes": 4 * mib, "stages": stages}, f)
with open(os.path.join(out, "uniform-100000.json"), "w") as f:
    json.dump({"input_bytes": mib, "stages": [{"fwd_ms": 0.01, "bwd_ms": 0.02, "output_bytes": mib,
                                               "saved_bytes": 2 * mib} for _ in range(100000)]}, f)
print(f"make_chains: wrote {out}/random-100.json and {out}/uniform-100000.json")
