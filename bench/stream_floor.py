"""The least budget remat.hf.enable(..., offload=True) reaches on the CPU (the CPU as the device, remat's meter),
against Hugging Face's per-layer checkpointing peak, with streamed layers (keep@stream, and keep@stream0 with no
window) and without them (the same chain, its stream figures removed): the issue-42 configurations. Each planned step is checked bitwise
against the plain run's.

    source scripts/env.sh; $REMAT_PYPI_VENV/bin/python bench/stream_floor.py [llama|neox] [--vocab N]
"""
import argparse
import sys
from pathlib import Path

import torch
import transformers

import remat
import remat.hf
from remat import _core

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python" / "tests"))
from test_hf import hf_checkpointing, same, step  # noqa: E402
from test_offload import drop_stream_figures  # noqa: E402


def make(arch, vocab):
    torch.manual_seed(0)
    if arch == "llama":
        cfg = transformers.LlamaConfig(vocab_size=vocab, hidden_size=128, intermediate_size=512,
                                       num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=2,
                                       max_position_embeddings=512)
        model, spec = transformers.LlamaForCausalLM(cfg), dict(batch=16, seq=512, vocab=vocab, loss="lm")
    else:
        cfg = transformers.GPTNeoXConfig(vocab_size=vocab, hidden_size=128, intermediate_size=512,
                                         num_hidden_layers=8, num_attention_heads=4, max_position_embeddings=512)
        model, spec = transformers.GPTNeoXForCausalLM(cfg), dict(batch=16, seq=256, vocab=vocab, loss="lm")
    model.train()
    return model, spec


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("arch", nargs="?", default="llama", choices=("llama", "neox"))
    ap.add_argument("--vocab", type=int, default=1000)
    a = ap.parse_args()
    torch.set_num_threads(2)
    meter = remat.cpu_meter()
    MiB = 1 << 20
    model, spec = make(a.arch, a.vocab)
    plain = [step(model, spec, k, meter) for k in range(2)]
    model, spec = make(a.arch, a.vocab)
    hf_checkpointing(model)
    hf = step(model, spec, 0, meter)[2]
    model, spec = make(a.arch, a.vocab)
    lp = remat.hf.enable(model, budget=1 << 40, offload=True)
    same(plain[0], step(model, spec, 0, meter))
    chain, ctx = lp.chain, lp.context
    unstreamed = drop_stream_figures(remat.Chain.from_json(chain.to_json()))
    without = _core.min_step_budget(unstreamed, ctx, "per-layer", offload=True)
    least = lp.min_budget_bytes
    lp.set_budget(least)
    got = step(model, spec, 1, meter)
    same(plain[1], got)
    print(f"{a.arch}, vocab {a.vocab}: Hugging Face checkpointing peak {hf / MiB:.1f} MiB; the rest of the step "
          f"(LM head and loss) alone {ctx.rest_peak_bytes / MiB:.1f} MiB ({ctx.rest_peak_bytes / hf:.2f})")
    print(f"  least budget without streaming {without / MiB:.1f} MiB ({without / hf:.2f})")
    print(f"  least budget with streaming    {least / MiB:.1f} MiB ({least / hf:.2f}); measured at it "
          f"{got[2] / MiB:.1f} MiB ({got[2] / hf:.2f}), bitwise; host {lp.host_pool.peak_bytes / MiB:.1f} MiB "
          f"(predicted {lp.predicted_host_bytes / MiB:.1f})")
    print(f"  predicted {lp.predicted_peak_bytes} bytes, measured {got[2]} bytes: the prediction "
          f"{(lp.predicted_peak_bytes - got[2]) / got[2]:+.2%} of the measured peak")
    print(f"  choices {lp.choices}")


if __name__ == "__main__":
    main()
