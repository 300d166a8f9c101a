#!/usr/bin/env python3
"""The PyTorch side of remat's side-by-side benchmark.

Runs remat's models (the same architectures and weight initialisation, written again in Python) in Debian's
python3-torch with torch.utils.checkpoint, and measures them with remat's own CPU meter (libremat_meter.so, loaded
with ctypes), so that both libraries are measured on the same scale. Steps of the strategies are interleaved, as in
`remat bench`, so that the machine's drift affects them alike.

Strategies: none, all (per layer, use_reentrant=False), all-reentrant (per layer, use_reentrant=True),
uniform:K (checkpoint_sequential with K segments), selective (PyTorch 2.4 and later: per layer with
create_selective_checkpoint_contexts, saving the outputs of matrix multiplications and recomputing the rest),
compile:B (PyTorch 2.4 and later: the whole model under torch.compile with activation_memory_budget B, no
checkpointing of its own; its first warm-up step, compilation included, is reported as compile_s).

Model hf-bert is Hugging Face's BertModel (transformers) built from a BertConfig of the same sizes (random
weights, nothing downloaded); its strategies are none and all (gradient_checkpointing_enable()).

    python3 bench/pytorch_reference.py --meter build/libremat_meter.so --model bert --strategy none,all --json out.json
"""
import argparse
import ctypes
import json
import math
import os
import statistics
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint, checkpoint_sequential

try:  # PyTorch 2.4 and later
    from functools import partial

    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    # The common selective policy: keep what the matrix multiplications produce, recompute everything else.
    SAVED_OPS = {torch.ops.aten.mm.default, torch.ops.aten.bmm.default, torch.ops.aten.addmm.default,
                 torch.ops.aten.baddbmm.default}

    def _save_matmuls(ctx, op, *args, **kwargs):
        return CheckpointPolicy.MUST_SAVE if op in SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE

    SELECTIVE = partial(create_selective_checkpoint_contexts, _save_matmuls)
except ImportError:
    SELECTIVE = None


def compiled_runner(model, budget):
    """model("none") compiled with torch.compile, with torch._functorch.config.activation_memory_budget = budget
    (the min-cut partitioner's memory budget: 1.0 is compile's default, 0.0 recomputes all it can). Each budget
    gets a code object of its own, since dynamo keeps its compiled graphs per code object, and is compiled and
    run under its own budget, so that the strategies of one run can be interleaved."""
    import types

    def run():
        return model("none")

    code = run.__code__.replace(co_name=f"run_budget_{str(budget).replace('.', '_')}")
    compiled = torch.compile(types.FunctionType(code, run.__globals__, code.co_name, None, run.__closure__))

    def call(strategy):
        with torch._functorch.config.patch(activation_memory_budget=budget):
            return compiled()

    return call


def checkpointed(fn, *args, strategy):
    """fn(*args) under a per-layer strategy: none, all, all-reentrant or selective."""
    if strategy == "all":
        return checkpoint(fn, *args, use_reentrant=False)
    if strategy == "all-reentrant":
        return checkpoint(fn, *args, use_reentrant=True)
    if strategy == "selective":
        if SELECTIVE is None:
            sys.exit(f"pytorch_reference.py: 'selective' needs PyTorch 2.4 or later, this is {torch.__version__}")
        return checkpoint(fn, *args, use_reentrant=False, context_fn=SELECTIVE)
    return fn(*args)


class Meter:
    """remat's counting CPU allocator, through its C interface."""

    def __init__(self, path):
        self.lib = ctypes.CDLL(path)
        for name in ("remat_meter_active_bytes", "remat_meter_peak_bytes", "remat_meter_allocations"):
            getattr(self.lib, name).restype = ctypes.c_int64
        if self.lib.remat_meter_install() != 0:
            raise RuntimeError("remat_meter_install failed")

    def active(self):
        return self.lib.remat_meter_active_bytes()

    def peak(self):
        return self.lib.remat_meter_peak_bytes()

    def reset_peak(self):
        self.lib.remat_meter_reset_peak()


# ----------------------------------------------------------------------------------------------------------------
# Models: the same as remat::models (include/remat/models/*.h).

class BertEmbeddings(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.word_embeddings = nn.Embedding(c["vocab"], c["hidden"])
        self.position_embeddings = nn.Embedding(max(512, c["seq"]), c["hidden"])
        self.token_type_embeddings = nn.Embedding(2, c["hidden"])
        self.layer_norm = nn.LayerNorm(c["hidden"], eps=1e-12)
        self.dropout = nn.Dropout(c["dropout"])

    def forward(self, ids, types):
        positions = torch.arange(ids.size(1), dtype=torch.long).unsqueeze(0)
        h = self.word_embeddings(ids) + self.position_embeddings(positions) + self.token_type_embeddings(types)
        return self.dropout(self.layer_norm(h))


class BertLayer(nn.Module):
    def __init__(self, c):
        super().__init__()
        h, i = c["hidden"], c["intermediate"]
        self.heads, self.head_size = c["heads"], h // c["heads"]
        self.query, self.key, self.value = nn.Linear(h, h), nn.Linear(h, h), nn.Linear(h, h)
        self.attention_output = nn.Linear(h, h)
        self.intermediate, self.output = nn.Linear(h, i), nn.Linear(i, h)
        self.attention_norm, self.output_norm = nn.LayerNorm(h, eps=1e-12), nn.LayerNorm(h, eps=1e-12)
        self.attention_dropout, self.hidden_dropout = nn.Dropout(c["dropout"]), nn.Dropout(c["dropout"])

    def forward(self, hidden, ext):
        b, s, w = hidden.shape

        def heads(t):
            return t.view(b, s, self.heads, self.head_size).transpose(1, 2)

        q, k, v = heads(self.query(hidden)), heads(self.key(hidden)), heads(self.value(hidden))
        scores = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(self.head_size)
        probs = self.attention_dropout(torch.softmax(scores + ext, -1))
        context = torch.matmul(probs, v).transpose(1, 2).reshape(b, s, w)
        attended = self.attention_norm(self.hidden_dropout(self.attention_output(context)) + hidden)
        return self.output_norm(self.hidden_dropout(self.output(F.gelu(self.intermediate(attended)))) + attended)


class MaskedLayer(nn.Module):
    """A layer with its attention mask bound, so that checkpoint_sequential can chain layers."""

    def __init__(self, layer, ext):
        super().__init__()
        self.layer, self.ext = layer, ext

    def forward(self, h):
        return self.layer(h, self.ext)


class Bert(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.embeddings = BertEmbeddings(c)
        self.layers = nn.ModuleList([BertLayer(c) for _ in range(c["layers"])])
        self.pooler = nn.Linear(c["hidden"], c["hidden"])
        for m in self.modules():  # BERT's initialisation, as remat's BertModel
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, 0.0, 0.02)
            if isinstance(m, nn.Linear):
                nn.init.zeros_(m.bias)
        b, s = c["batch"], c["seq"]
        self.ids = torch.randint(0, c["vocab"], (b, s))
        self.mask = torch.ones(b, s)
        self.types = torch.zeros(b, s, dtype=torch.long)

    def forward(self, strategy):
        ext = ((1.0 - self.mask) * -10000.0).unsqueeze(1).unsqueeze(2)
        h = self.embeddings(self.ids, self.types)
        if strategy.startswith("uniform:"):
            seq = nn.Sequential(*[MaskedLayer(layer, ext) for layer in self.layers])
            return checkpoint_sequential(seq, int(strategy[8:]), h)
        for layer in self.layers:
            h = checkpointed(layer, h, ext, strategy=strategy)
        return h


class ResidualBlock(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)
        self.drop = nn.Dropout(0.0)

    def forward(self, x):
        return x + self.drop(self.fc2(F.gelu(self.fc1(x))))


class Mlp(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.blocks = nn.Sequential(*[ResidualBlock(c["width"]) for _ in range(c["depth"])])
        # The input requires grad: PyTorch's reentrant checkpoint trains nothing (and its backward fails) otherwise.
        self.x = torch.randn(c["batch"], c["width"], requires_grad=True)

    def forward(self, strategy):
        if strategy.startswith("uniform:"):
            return checkpoint_sequential(self.blocks, int(strategy[8:]), self.x)
        h = self.x
        for block in self.blocks:
            h = checkpointed(block, h, strategy=strategy)
        return h


class BasicBlock(nn.Module):
    """remat::models::BasicBlock: two 3x3 convolutions with a BatchNorm each, a downsample where the shape changes."""

    def __init__(self, i, o, stride):
        super().__init__()
        self.conv1 = nn.Conv2d(i, o, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(o)
        self.conv2 = nn.Conv2d(o, o, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(o)
        self.downsample = None
        if stride != 1 or i != o:
            self.downsample = nn.Sequential(nn.Conv2d(i, o, 1, stride, bias=False), nn.BatchNorm2d(o))

    def forward(self, x):
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + (self.downsample(x) if self.downsample is not None else x))


class ResNet(nn.Module):
    """remat::models::ResNet: stem, layer1..layer3 of BasicBlocks (16, 32, 64 channels), pooling head."""

    def __init__(self, c):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 16, 3, 1, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(16)

        def layer(i, o, stride):
            return nn.Sequential(BasicBlock(i, o, stride), *[BasicBlock(o, o, 1) for _ in range(c["blocks"] - 1)])

        self.layer1, self.layer2, self.layer3 = layer(16, 16, 1), layer(16, 32, 2), layer(32, 64, 2)
        self.fc = nn.Linear(64, 10)
        self.x = torch.randn(c["batch"], 3, 32, 32)

    def forward(self, strategy):
        h = F.relu(self.bn1(self.conv1(self.x)))
        blocks = [*self.layer1, *self.layer2, *self.layer3]
        if strategy.startswith("uniform:"):  # the nested stack flattened by hand, as users must
            h = checkpoint_sequential(nn.Sequential(*blocks), int(strategy[8:]), h)
        else:
            for block in blocks:
                h = checkpointed(block, h, strategy=strategy)
        return self.fc(F.adaptive_avg_pool2d(h, 1).flatten(1))


class HfBert(nn.Module):
    """Hugging Face's BertModel at the same sizes, random weights; eager attention, the same math as remat's."""

    def __init__(self, c):
        super().__init__()
        from transformers import BertConfig, BertModel
        config = BertConfig(vocab_size=c["vocab"], hidden_size=c["hidden"], num_hidden_layers=c["layers"],
                            num_attention_heads=c["heads"], intermediate_size=c["intermediate"],
                            max_position_embeddings=max(512, c["seq"]), hidden_dropout_prob=c["dropout"],
                            attention_probs_dropout_prob=c["dropout"], attn_implementation="eager")
        self.bert = BertModel(config, add_pooling_layer=False)
        self.bert.train()
        b, s = c["batch"], c["seq"]
        self.ids = torch.randint(0, c["vocab"], (b, s))
        self.mask = torch.ones(b, s, dtype=torch.long)
        self.checkpointing = None

    def forward(self, strategy):
        if strategy not in ("none", "all"):
            sys.exit(f"pytorch_reference.py: hf-bert has strategies none and all, not '{strategy}'")
        if strategy != self.checkpointing:
            if strategy == "all":
                self.bert.gradient_checkpointing_enable()
            else:
                self.bert.gradient_checkpointing_disable()
            self.checkpointing = strategy
        return self.bert(input_ids=self.ids, attention_mask=self.mask).last_hidden_state


def heavy_function(x, a, adds):
    for _ in range(adds):
        x = x + a
    return x


class Heavy(nn.Module):
    """The model of the 'PyTorch Tip: Checkpoints' article."""

    def __init__(self, c):
        super().__init__()
        self.a = nn.Parameter(torch.tensor(1.0))
        self.calls, self.adds = c["calls"], c["adds"]
        self.x = torch.tensor(0.0, requires_grad=True)

    def forward(self, strategy):
        x = self.x
        for _ in range(self.calls):
            if strategy in ("all", "all-reentrant"):
                x = checkpoint(heavy_function, x, self.a, self.adds, use_reentrant=strategy == "all-reentrant")
            else:
                x = heavy_function(x, self.a, self.adds)
        return x


class Cifar(nn.Module):
    """The CIFAR-10 model of the 'Training larger-than-memory PyTorch models' article."""

    def __init__(self, c):
        super().__init__()

        def block(i, m, o):
            return nn.Sequential(nn.Conv2d(i, m, 3, padding=1), nn.ReLU(), nn.Conv2d(m, o, 3, padding=1), nn.ReLU(),
                                 nn.MaxPool2d(2))

        self.cnn_block_1, self.cnn_block_2 = block(3, 32, 64), block(64, 64, 64)
        self.dropout_1, self.dropout_2, self.dropout_3 = nn.Dropout(0.25), nn.Dropout(0.25), nn.Dropout(0.5)
        self.linearize = nn.Sequential(nn.Linear(64 * 8 * 8, 512), nn.ReLU())
        self.out = nn.Linear(512, 10)
        self.x = torch.randn(c["batch"], 3, 32, 32)

    def forward(self, strategy):
        x = self.dropout_1(self.cnn_block_1(self.x))
        if strategy in ("all", "all-reentrant"):
            x = checkpoint(self.cnn_block_2, x, use_reentrant=strategy == "all-reentrant")
        else:
            x = self.cnn_block_2(x)
        x = torch.flatten(self.dropout_2(x), 1)
        return self.out(self.dropout_3(self.linearize(x)))


def describe(c):
    m = c["model"]
    if m in ("bert", "hf-bert"):
        return (f"{m} {c['layers']} layers x {c['hidden']} ({c['heads']} heads, ffn {c['intermediate']}), "
                f"seq {c['seq']}, batch {c['batch']}, dropout {c['dropout']}")
    if m == "mlp":
        return f"mlp {c['depth']} residual blocks x {c['width']} (hidden {4 * c['width']}), batch {c['batch']}"
    if m == "heavy":
        return f"heavy: {c['calls']} calls of {c['adds']} additions"
    if m == "resnet":
        return f"resnet (CIFAR, {3 * c['blocks']} BasicBlocks), batch {c['batch']}"
    return f"cifar (CifarNet), batch {c['batch']}"


# ----------------------------------------------------------------------------------------------------------------

def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--meter", required=True, help="path of libremat_meter.so")
    p.add_argument("--model", default="bert", choices=["bert", "hf-bert", "mlp", "heavy", "cifar", "resnet"])
    p.add_argument("--strategy", default="none,all",
                   help="comma-separated: none, all, all-reentrant, uniform:K, selective (PyTorch >= 2.4)")
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--hidden", type=int, default=768)
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--intermediate", type=int, default=3072)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--vocab", type=int, default=30522)
    p.add_argument("--dropout", type=float, default=0.1)
    p.add_argument("--batch", type=int, default=0)
    p.add_argument("--depth", type=int, default=16)
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--blocks", type=int, default=3)
    p.add_argument("--calls", type=int, default=1000)
    p.add_argument("--adds", type=int, default=100)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="write the results to this file")
    a = p.parse_args()

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", os.cpu_count())))
    meter = Meter(a.meter)  # before any tensor, so that everything is counted
    torch.manual_seed(a.seed)
    c = vars(a).copy()
    c["batch"] = a.batch or {"bert": 8, "hf-bert": 8, "mlp": 64, "cifar": 64, "heavy": 1, "resnet": 64}[a.model]
    model = {"bert": Bert, "hf-bert": HfBert, "mlp": Mlp, "heavy": Heavy, "cifar": Cifar, "resnet": ResNet}[a.model](c)
    strategies = [s for s in a.strategy.split(",") if s]
    runners = {s: compiled_runner(model, float(s[8:])) for s in strategies if s.startswith("compile:")}
    if "none" not in strategies:
        strategies.insert(0, "none")
    for p_ in model.parameters():
        p_.grad = torch.zeros_like(p_)

    def step(strategy):
        for p_ in model.parameters():
            p_.grad.zero_()
        meter.reset_peak()
        base = meter.active()
        t0 = time.perf_counter()
        out = runners[strategy](strategy) if strategy in runners else model(strategy)
        forward_ms = (time.perf_counter() - t0) * 1000
        kept = meter.active() - base
        # The loss of remat's workloads: the mean of squares; HeavyChain's article backpropagates its output.
        (out.sum() if a.model == "heavy" else out.float().pow(2).mean()).backward()
        ms = (time.perf_counter() - t0) * 1000
        del out
        return ms, forward_ms, meter.peak() - base, kept, base

    print(f"pytorch {torch.__version__}: {describe(c)}", file=sys.stderr)
    rows = {s: {"strategy": s, "step_ms": [], "forward_ms_all": [], "peak_bytes": 0, "after_forward_bytes": 0}
            for s in strategies}
    for s in strategies:
        for w in range(max(a.warmup, 1 if s in runners else 0)):
            ms = step(s)[0]
            if w == 0 and s in runners:
                rows[s]["compile_s"] = ms / 1000  # the first step: compilation and one step
                print(f"pytorch: {s} compiled and ran its first step in {ms / 1000:.1f} s", file=sys.stderr)
    base = 0
    for i in range(a.steps):
        print(f"pytorch: step {i + 1}/{a.steps} of every strategy", file=sys.stderr)
        for s in strategies:
            ms, fwd, peak, kept, base = step(s)
            r = rows[s]
            r["step_ms"].append(ms)
            r["forward_ms_all"].append(fwd)
            r["peak_bytes"] = max(r["peak_bytes"], peak)
            r["after_forward_bytes"] = max(r["after_forward_bytes"], kept)
    none = rows["none"]
    none["median_ms"] = statistics.median(none["step_ms"])
    for r in rows.values():
        r["median_ms"] = statistics.median(r["step_ms"])
        r["forward_ms"] = statistics.median(r.pop("forward_ms_all"))
        r["peak_ratio"] = r["peak_bytes"] / none["peak_bytes"] if none["peak_bytes"] else 0
        r["time_ratio"] = r["median_ms"] / none["median_ms"]
    result = {"library": f"pytorch {torch.__version__}", "model": describe(c), "base_bytes": base,
              "rows": [rows[s] for s in strategies]}
    print(f"{'strategy':<16}{'peak MiB':>10}{'kept MiB':>10}{'median ms':>11}{'fwd ms':>9}{'peak/none':>11}"
          f"{'time/none':>11}")
    for r in result["rows"]:
        print(f"{r['strategy']:<16}{r['peak_bytes'] / 2**20:>10.1f}{r['after_forward_bytes'] / 2**20:>10.1f}"
              f"{r['median_ms']:>11.1f}{r['forward_ms']:>9.1f}{r['peak_ratio']:>11.3f}{r['time_ratio']:>11.2f}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
