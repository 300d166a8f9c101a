#!/usr/bin/env python3
"""Predicted against measured step peaks of fine-tuning's frozen models on the test suite's Llama
(docs/BENCHMARKS.md, "Frozen layers and adapters").

The model is python/tests/test_hf.py's Llama (4 layers, width 64, batch 4, sequence 64; random weights, CPU),
frozen as fine-tuning freezes it:

- embed: the embeddings frozen (every layer trained; the first layer's input needs no gradient);
- first-layer, three-layers: the embeddings and the first one or three layers frozen;
- lora-like: only the attention's query and value projections trained (the adapters' pattern, without peft);
- lora: a LoRA model from peft (r 8, query and value; skipped where peft is not installed);
- every-layer: every layer frozen, the LM head trained alone (no plan: remat says so and runs them as they are).

Each is planned by remat.hf.enable, without and with offloading (offload=True, groups=True, offload_min_bytes
16 KiB), at a budget above every plan (1 TiB: the fastest plan, as the measured times choose it) and at the
least budget; each step is checked bitwise against
the plain run of the same frozen model. Each row: the plan, the prediction, the measured peak and the error
(measured less predicted, over predicted: negative where the model overstates).

    python bench/frozen_layers.py
"""
from __future__ import annotations

import importlib.util
import os
import sys
import warnings

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python", "tests"))

import torch  # noqa: E402

import remat  # noqa: E402
import remat.hf  # noqa: E402
import test_hf as T  # noqa: E402


def frozen(how: str):
    """The test Llama frozen as `how` says, and its batch's spec."""
    model, spec = T.make("llama")
    if how in ("embed", "first-layer", "three-layers"):
        T._frozen(model, {"embed": 0, "first-layer": 1, "three-layers": 3}[how])
    elif how == "lora-like":
        for name, p in model.named_parameters():
            p.requires_grad_("q_proj" in name or "v_proj" in name)
    elif how == "lora":
        return T.lora_llama()
    elif how == "every-layer":
        model.model.requires_grad_(False)
    else:
        raise ValueError(how)
    return model, spec


def main():
    meter = remat.cpu_meter()
    hows = ["embed", "first-layer", "three-layers", "lora-like", "lora", "every-layer"]
    print(f"torch {torch.__version__}, remat {remat.__file__}")
    print("| frozen | offloading | budget | plan | predicted | measured | error |")
    print("| --- | --- | --- | --- | ---: | ---: | ---: |")
    for how in hows:
        if how == "lora" and importlib.util.find_spec("peft") is None:
            print(f"| {how} | (peft not installed) | | | | | |")
            continue
        for offload in (False, True):
            model, spec = frozen(how)
            plain = [T.step(model, spec, k, meter) for k in range(2)]
            model, spec = frozen(how)
            kw = dict(offload=True, groups=True, offload_min_bytes=16 << 10) if offload else {}
            try:
                lp = remat.hf.enable(model, budget=1 << 40, **kw)
            except Exception as e:  # (remat before 2026-12-01 on a PEFT model)
                print(f"| {how} | {'yes' if offload else 'no'} | | raised {type(e).__name__}: {e} | | | |")
                continue
            with warnings.catch_warnings(record=True) as said:
                warnings.simplefilter("always")
                T.same(plain[0], T.step(model, spec, 0, meter))
            if not lp.is_planned():
                words = [str(w.message) for w in said if "gradient" in str(w.message)]
                print(f"| {how} | {'yes' if offload else 'no'} | | not planned: "
                      f"{words[0].split(': ', 1)[1][:60] if words else '(no word)'}... | | | |")
                continue
            for budget in ("1 TiB", "least"):
                if budget == "least":
                    lp.set_budget(lp.min_budget_bytes)
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    got = T.step(model, spec, 1, meter)
                T.same(plain[1], got)
                pred = lp.predicted_peak_bytes
                print(f"| {how} | {'yes' if offload else 'no'} | {budget} | {' '.join(lp.choices)} | {pred:,} | "
                      f"{got[2]:,} | {(got[2] - pred) / pred:+.2%} |", flush=True)


if __name__ == "__main__":
    main()
