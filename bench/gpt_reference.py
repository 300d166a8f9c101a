#!/usr/bin/env python3
"""The PyTorch side of the GPT table: examples/gpt's model (nanoGPT's model.py) in Python, checkpointed per block
with torch.utils.checkpoint and with selective-checkpointing policies that make the same choices as remat's
presets, measured with remat's CPU meter as examples/gpt measures remat.

Ways: none; all (per block, use_reentrant=False); all-reentrant (per block, use_reentrant=True);
sac-matmuls, sac-attention_core, sac-recompute_pointwise (per block, use_reentrant=False, with
create_selective_checkpoint_contexts and a policy mirroring remat::policy::matmuls(), attention_core() and
recompute_pointwise(): see the policy functions below); uniform:K (checkpoint_sequential over the blocks, K
segments). Each step is a forward and backward pass (timed), then AdamW steps (not timed); the ways are
interleaved, one warm-up step each, then `--rounds` rounds of `--steps` steps of each way in turn.

    python bench/gpt_reference.py --meter build-pypi/libremat_meter.so --layers 6 --width 384 --heads 6 \
        --block 256 --batch 8 --steps 3 --rounds 1 --json out.json

Needs PyTorch 2.4 or later (selective checkpointing); the manual attention path of nanoGPT (no
scaled_dot_product_attention), as examples/gpt/gpt.h has.
"""
import argparse
import json
import math
import os
import statistics
import sys
import time
from functools import partial

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, checkpoint_sequential, \
    create_selective_checkpoint_contexts

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from pytorch_reference import Meter  # noqa: E402  (remat's meter through ctypes)

aten = torch.ops.aten

# ---------------------------------------------------------------------------------------------------------------
# Selective-checkpointing policies making remat's presets' choices. PyTorch asks below autograd, where
# aten::linear and aten::matmul have become addmm/mm/bmm, so the matrix multiplications are those.

MATMULS = {aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default, aten.convolution.default}


def _shape_of_product(op, args):
    """The output shape of a matrix product from its inputs (the policy is not shown outputs)."""
    a, b = (args[0], args[1]) if op in (aten.mm.default, aten.bmm.default) else (args[1], args[2])
    return tuple(a.shape[:-1]) + (b.shape[-1],)


def _score_shaped(shape, least_dims):
    return len(shape) >= least_dims and shape[-1] == shape[-2] and shape[-1] > 1


def keep_matmuls(ctx, op, *args, **kwargs):
    return CheckpointPolicy.MUST_SAVE if op in MATMULS else CheckpointPolicy.PREFER_RECOMPUTE


def keep_all_but_attention_core(ctx, op, *args, **kwargs):
    """remat::policy::attention_core(): recompute what has a [.., T, T] score among its inputs or output (scores,
    scale, mask, softmax, dropout, the context product); keep the rest."""
    dims = 3 if op in (aten.bmm.default, aten.baddbmm.default) else 4
    shapes = [tuple(a.shape) for a in args if isinstance(a, torch.Tensor)]
    if op in (aten.mm.default, aten.bmm.default, aten.addmm.default, aten.baddbmm.default):
        shapes.append(_shape_of_product(op, args))
    core = any(_score_shaped(s, dims) for s in shapes)
    return CheckpointPolicy.PREFER_RECOMPUTE if core or _never_saved(op) else CheckpointPolicy.MUST_SAVE


RECOMPUTED = {aten.native_dropout.default, aten.dropout.default, aten._to_copy.default}


def _never_saved(op):
    """Under a dispatch mode PyTorch's dropout reaches the policy decomposed (empty_like, then bernoulli_ in
    place): saving the empty buffer that is then written fails ("Tensor cached ... has been mutated"), so
    in-place and random calls and empty buffers are recomputed, as remat never keeps an in-place call."""
    return (op._schema.is_mutable or torch.Tag.nondeterministic_seeded in op.tags
            or op in (aten.empty_like.default, aten.empty.memory_format))


def keep_all_but_pointwise(ctx, op, *args, **kwargs):
    """remat::policy::recompute_pointwise(): recompute operators tagged pointwise (and dropout, casts)."""
    cheap = torch.Tag.pointwise in op.tags or op in RECOMPUTED or _never_saved(op)
    return CheckpointPolicy.PREFER_RECOMPUTE if cheap else CheckpointPolicy.MUST_SAVE


POLICIES = {"sac-matmuls": keep_matmuls, "sac-attention_core": keep_all_but_attention_core,
            "sac-recompute_pointwise": keep_all_but_pointwise}

# ---------------------------------------------------------------------------------------------------------------
# nanoGPT's model, as examples/gpt/gpt.h has it.


class CausalSelfAttention(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.n_head, self.n_embd = c["heads"], c["width"]
        self.c_attn = nn.Linear(self.n_embd, 3 * self.n_embd)
        self.c_proj = nn.Linear(self.n_embd, self.n_embd)
        self.attn_dropout, self.resid_dropout = nn.Dropout(c["dropout"]), nn.Dropout(c["dropout"])
        t = c["block"]
        self.register_buffer("bias", torch.tril(torch.ones(t, t)).view(1, 1, t, t))

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        att = att.masked_fill(self.bias[:, :, :T, :T] == 0, float("-inf"))
        att = self.attn_dropout(F.softmax(att, dim=-1))
        y = (att @ v).transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.c_fc, self.c_proj = nn.Linear(c["width"], 4 * c["width"]), nn.Linear(4 * c["width"], c["width"])
        self.dropout = nn.Dropout(c["dropout"])

    def forward(self, x):
        return self.dropout(self.c_proj(F.gelu(self.c_fc(x))))


class Block(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.ln_1, self.attn = nn.LayerNorm(c["width"]), CausalSelfAttention(c)
        self.ln_2, self.mlp = nn.LayerNorm(c["width"]), MLP(c)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(c["vocab"], c["width"]), nn.Embedding(c["block"], c["width"])
        self.drop = nn.Dropout(c["dropout"])
        self.h = nn.ModuleList([Block(c) for _ in range(c["layers"])])
        self.ln_f = nn.LayerNorm(c["width"])
        with torch.no_grad():
            for name, p in self.named_parameters():
                if "ln_" in name:
                    continue
                if name.endswith("bias"):
                    p.zero_()
                else:
                    p.normal_(0.0, 0.02 / math.sqrt(2 * c["layers"]) if name.endswith("c_proj.weight") else 0.02)

    def loss(self, idx, targets, way):
        x = self.drop(self.wte(idx) + self.wpe(torch.arange(idx.size(1))))
        if way.startswith("uniform:"):
            x = checkpoint_sequential(self.h, int(way[8:]), x, use_reentrant=False)
        else:
            for block in self.h:
                if way == "none":
                    x = block(x)
                elif way == "all":
                    x = checkpoint(block, x, use_reentrant=False)
                elif way == "all-reentrant":
                    x = checkpoint(block, x, use_reentrant=True)
                else:
                    x = checkpoint(block, x, use_reentrant=False,
                                   context_fn=partial(create_selective_checkpoint_contexts, POLICIES[way]))
        logits = F.linear(self.ln_f(x), self.wte.weight)
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--meter", required=True, help="path of libremat_meter.so")
    p.add_argument("--way", default="none,all,all-reentrant,sac-matmuls,sac-attention_core,sac-recompute_pointwise",
                   help="comma-separated: none, all, all-reentrant, sac-matmuls, sac-attention_core, "
                        "sac-recompute_pointwise, uniform:K")
    for name, default in (("layers", 6), ("width", 384), ("heads", 6), ("block", 256), ("batch", 8),
                          ("vocab", 65), ("steps", 3), ("rounds", 1)):
        p.add_argument(f"--{name}", type=int, default=default)
    p.add_argument("--dropout", type=float, default=0.2)
    p.add_argument("--json", help="write the results to this file")
    a = p.parse_args()
    ways = [w for w in a.way.split(",") if w]
    for w in ways:
        if w not in ("none", "all", "all-reentrant", *POLICIES) and not w.startswith("uniform:"):
            sys.exit(f"gpt_reference.py: unknown way '{w}'")
    if "none" not in ways:
        ways.insert(0, "none")

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", os.cpu_count())))
    meter = Meter(a.meter)  # before any tensor, so that everything is counted
    c = vars(a)
    torch.manual_seed(0)
    model = GPT(c)
    torch.manual_seed(42)
    idx = torch.randint(a.vocab, (a.batch, a.block))
    targets = torch.randint(a.vocab, (a.batch, a.block))
    adamw = torch.optim.AdamW(model.parameters(), lr=6e-4, weight_decay=0.1)

    def step(way):
        for q in model.parameters():
            if q.grad is not None:
                q.grad.zero_()
        meter.reset_peak()
        base = meter.active()
        t0 = time.perf_counter()
        loss = model.loss(idx, targets, way)
        kept = meter.active() - base
        loss.backward()
        ms = (time.perf_counter() - t0) * 1000
        del loss
        return ms, meter.peak() - base, kept

    print(f"pytorch {torch.__version__}: GPT {a.layers} layers x {a.width} ({a.heads} heads), block {a.block}, "
          f"batch {a.batch}, dropout {a.dropout}", file=sys.stderr)
    rows = {w: {"way": w, "ms": [], "ratio": [], "peak_bytes": 0, "kept_bytes": 0} for w in ways}
    for w in ways:  # warm-up, and the optimizer's state
        step(w)
        adamw.step()
    for r in range(a.rounds):
        for w in ways:
            times = []
            for _ in range(a.steps):
                ms, peak, kept = step(w)
                times.append(ms)
                rows[w]["peak_bytes"] = max(rows[w]["peak_bytes"], peak)
                rows[w]["kept_bytes"] = max(rows[w]["kept_bytes"], kept)
            adamw.step()
            rows[w]["ms"].append(statistics.median(times))
            rows[w]["ratio"].append(rows[w]["ms"][-1] / rows["none"]["ms"][-1])
    print(f"{'way':<26}{'peak MiB':>10}{'kept MiB':>10}{'ms':>10}{'x none':>8}")
    for r in rows.values():
        r["median_ms"], r["time_ratio"] = statistics.median(r["ms"]), statistics.median(r["ratio"])
        print(f"{r['way']:<26}{r['peak_bytes'] / 2**20:>10.1f}{r['kept_bytes'] / 2**20:>10.1f}"
              f"{r['median_ms']:>10.1f}{r['time_ratio']:>8.2f}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"library": f"pytorch {torch.__version__}", "rows": list(rows.values())}, f, indent=2)


if __name__ == "__main__":
    main()
