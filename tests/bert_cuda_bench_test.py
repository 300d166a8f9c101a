"""bench/bert_cuda.cpp (scripts/gpu-session's C++ BertModel, issue 42's C++ row) run on the CPU at a tiny size
with the options of the next GPU call (--offload --groups --budgets per-layer): an error in its code paths would
otherwise first show on a lent GPU. Checks what the GPU table reads from its JSON and its --chain file.

    python3 tests/bert_cuda_bench_test.py build/bin/remat_bert_cuda
"""
import json
import os
import subprocess
import sys
import tempfile


def main(binary):
    with tempfile.TemporaryDirectory() as tmp:
        out, chain = os.path.join(tmp, "bert.json"), os.path.join(tmp, "chain.json")
        args = [binary, "--device", "cpu", "--layers", "3", "--hidden", "32", "--heads", "2", "--intermediate",
                "128", "--seq", "16", "--batch", "2", "--rounds", "2", "--offload", "--groups", "--budgets",
                "per-layer", "--json", out, "--chain", chain]
        r = subprocess.run(args, capture_output=True, text=True, timeout=240)
        assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
        ways = json.load(open(out))
        assert [w["way"] for w in ways[:4]] == ["plain", "per-layer kNonReentrant", "per-layer kReentrant",
                                                 "per-layer policy::matmuls"], ways
        planned = [w for w in ways if w["budget"] > 0]
        # At per-layer checkpointing's measured peak (--budgets per-layer), and at the least feasible budget.
        assert planned[0]["budget"] == ways[1]["peak_bytes"] and planned[-1]["least"], planned
        for w in ways:
            assert w["stage"] == "measured" and w["peak_bytes"] > 0, w
            assert len(w["ratios"]) == (0 if w["way"] == "plain" else 2), w
        for w in planned:
            # Each Planned way's plan, its predicted time on its own profile, and its peak within the prediction.
            assert w["plan"].startswith("F") and w["predicted_ms"] > 0, w
            assert 0 < w["window_peak_bytes"] <= w["predicted_bytes"] <= w["budget"], w
        c = json.load(open(chain))
        assert len(c["chain"]["stages"]) == 3 and c["rest_ms"] >= 0, c.keys()
        assert c["least_budget"] == min(w["budget"] for w in planned), (c["least_budget"], planned)


if __name__ == "__main__":
    main(sys.argv[1])
    print("bert_cuda_bench_test: passed")
