#!/usr/bin/env python3
"""Vision-language models trained on batches with and without images in turn (docs/BENCHMARKS.md, "Vision-language
models, text-only batches"): every step against the plain run's, bitwise, and each planned step's peak against its
prediction.

The models are bench/architectures.py's VISION (tiny configs, nothing downloaded: a vision tower of 2 layers, a
text model of 4), on the CPU, under remat.hf.enable(offload=True, groups=True, offload_min_bytes=1 KiB). Batches
of 2 sequences of 24 tokens; those with images are architectures.vision_batch's, the text-only ones its tokens
alone. A text-only batch calls no vision layer (Mllama's: no cross-attention layer): its first step profiles
nothing, its second profiles the layers it calls (Shape.stages), and its steps after run their own plan. The
steps: an image batch (profiled), three text-only ones, an image batch; then at each of three budgets (the larger
of the two kinds of batches' least budgets, and 1.1 and 1.25 times it) two text-only steps and an image step. Each
row: the model, the text-only shape's stages (indices into lp.layers), whether every step was bitwise, and the
prediction errors' range (measured less predicted, over predicted) of the planned text-only and image steps apart.

    python bench/vision_text_only.py                     # the 7 of architectures.VISION
    python bench/vision_text_only.py --models llava-2,mllama
    python bench/vision_text_only.py --freeze-vision     # the vision tower frozen (its parameters named "vision"
                                                         # or "visual"), the projector and text model trained

Exits 1 where a step is not the plain run's bitwise or a planned step holds more than its prediction's
tolerance (remat's 2%) above it.
"""
import argparse
import os
import sys
import warnings

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch  # noqa: E402

import remat  # noqa: E402
import remat.hf  # noqa: E402
from architectures import VISION, build_vision, vision_batch  # noqa: E402

BUDGETS = {5: 1.0, 8: 1.1, 11: 1.25}  # step -> share of the image batches' least budget, set before it
ORDER = [True, False, False, False, True] + [False, False, True] * 3  # whether each step's batch has images


def batch(model, k: int, images: bool) -> dict:
    g = torch.Generator().manual_seed(100 + k)
    ids = torch.randint(0, 900, (2, 24), generator=g)
    b = vision_batch(model, ids, g) if images else {"use_cache": False}
    return dict(b, input_ids=ids, labels=ids.clone())


def step(model, k: int, images: bool, meter):
    """Training step k: its loss, every gradient, the next random draw and the peak above the step's base."""
    model.zero_grad(set_to_none=True)
    torch.manual_seed(1000 + k)
    b = batch(model, k, images)
    base = meter.active()
    meter.reset_peak()
    loss = model(**b).loss
    loss.backward()
    peak = meter.peak() - base
    return loss.detach(), [None if p.grad is None else p.grad.clone() for p in model.parameters()], torch.rand(4), peak


def same(a, b) -> bool:
    return torch.equal(a[0], b[0]) and torch.equal(a[2], b[2]) and all(
        (g is None) == (h is None) and (g is None or torch.equal(g, h)) for g, h in zip(a[1], b[1]))


def build(kind: str, freeze: bool):
    """architectures.build_vision's model, its vision tower's parameters frozen where `freeze`."""
    model = build_vision(kind)
    if freeze:
        frozen = [p.requires_grad_(False) for name, p in model.named_parameters()
                  if "vision" in name or "visual" in name]
        assert frozen, f"{kind}: no parameter named for a vision tower"
    return model


def run(kind: str, meter, freeze: bool = False) -> tuple[bool, dict]:
    plain = build(kind, freeze)
    want = [step(plain, k, im, meter) for k, im in enumerate(ORDER)]
    del plain
    model = build(kind, freeze)
    lp = remat.hf.enable(model, budget=1 << 40, offload=True, groups=True, offload_min_bytes=1024)
    errors = {True: [], False: []}
    bitwise, stages, least = True, None, None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for k, images in enumerate(ORDER):
            if k in BUDGETS:
                lp.set_budget(int(least * BUDGETS[k]))
            got = step(model, k, images, meter)
            bitwise &= same(want[k], got)
            if k in (3, 4):  # the text-only batches' least budget, then the image batches': the larger
                least = max(least or 0, lp.min_budget_bytes)
            if not images and k >= 3:
                stages = lp.stages
            if k >= 3 and lp.is_planned() and lp.last_peak_bytes == got[3]:
                errors[images].append((got[3] - lp.predicted_peak_bytes) / lp.predicted_peak_bytes)
    return bitwise, dict(stages=stages, text=errors[False], images=errors[True])


def span(errs: list[float]) -> str:
    return f"{min(errs):+.3%} .. {max(errs):+.3%} ({len(errs)})" if errs else "none measured"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default=",".join(VISION), help="comma-separated, of " + ", ".join(VISION))
    ap.add_argument("--freeze-vision", action="store_true", help="the vision tower's parameters frozen")
    args = ap.parse_args()
    torch.set_num_threads(1)
    meter = remat.cpu_meter()
    failed = False
    print(f"{'model':10s} {'text-only stages':18s} {'bitwise':8s} {'text-only steps':28s} image steps")
    for kind in args.models.split(","):
        bitwise, r = run(kind, meter, args.freeze_vision)
        above = max(r["text"] + r["images"], default=0) > remat._core.PREDICTION_TOLERANCE
        failed |= not bitwise or above or len(r["text"]) < 7
        print(f"{kind:10s} {str(r['stages']):18s} {'yes' if bitwise else 'NO':8s} {span(r['text']):28s} "
              f"{span(r['images'])}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
