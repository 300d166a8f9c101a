#!/usr/bin/env python3
"""Offloading planned with checkpointing, against the other ways to fit (issue 33's GPU table): seed 001's
BertModel at BERT-large's size (fp32) or a Llama-architecture model built from a config (bf16 autocast). Ways:
the plain step, Hugging Face's gradient_checkpointing_enable(), the same saving matmuls (PyTorch's selective
checkpointing), Hugging Face's offload=True where the installed transformers has it, torch's save_on_cpu around
the whole step, with --compile torch.compile's activation_memory_budget at the budgets given, and
remat.hf.enable(..., offload=True) where --at says: by default at gradient_checkpointing_enable()'s measured
peak and at two budgets between it and selective checkpointing's; also at any way's peak, and at remat's least
feasible budget; with --compiled-layers each remat row also on a copy whose layers are compiled one by one
(remat@<at>/compiled: kept, checkpointed or a policy inside each layer's graph, each perhaps @host with the
layer's Offload around the graph; transformers 5.23 or later). Per
way: the peak device memory above the bytes alive
before the forward pass (remat's meter window: on CUDA the bytes tensors request from the caching allocator,
followed through its trace, or torch.cuda.max_memory_allocated where the meter library is missing), the
synchronized step time paired with plain steps (medians of the rounds' ratios), for remat also the host pool's
peak, the measured bandwidth each way, and the predicted step time beside the measured one; and per row the
bound that the measured bandwidths and the layers' forward time allow at its budget or peak (BOUND_TEXT below).

    python bench/offload_cuda.py --model bert --json out/offload-bert.json                  # BERT-large, fp32
    python bench/offload_cuda.py --model llama --seq 4096 --batch 2 --json out/offload-llama.json
    python bench/offload_cuda.py --model bert --groups --compile 0.5,0.2 \
        --at hf,sac,compile-0.5,compile-0.2,least --skip hf-offload,save_on_cpu    # issue 42's rows
    python bench/offload_cuda.py --device cpu --model bert --layers 2 --hidden 64 --heads 2 --intermediate 256 \\
        --seq 32 --batch 2 --rounds 1    # the script itself, on a CPU (a Llama: add --kv-heads 2)

Before measuring, remat's first two steps are compared with the plain run's (the loss, and the gradients'
largest difference beside two plain runs': CUDA's attention backward is not deterministic), and then one step
of each plan measured (its JSON's plans[...]["check"]).
"""
from __future__ import annotations

import argparse
import copy
import gc
import json
import statistics
import sys
import time
from functools import partial

import torch
from torch.utils.checkpoint import create_selective_checkpoint_contexts
import transformers

import remat
import remat.hf
import remat.offload
from remat.policies import matmuls
from remat.profile import TIMINGS

sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parent))
from hf_compare import compiled, grads_of, max_diff, paired_rounds  # noqa: E402  (the paired rounds every benchmark of this kind shares)


_T0 = time.perf_counter()


def say(text):
    """A progress line on stderr, with the seconds since the script began (where a call that ran out spent its
    time)."""
    print(f"[{time.perf_counter() - _T0:6.1f} s] {text}", file=sys.stderr, flush=True)


def context_figures(ctx):
    """A step context's figures (remat._core.StepContext's attributes), for the JSON: with the chain, the
    plans can be made again on another machine (a StepContext() given them back)."""
    return {k: getattr(ctx, k) for k in dir(ctx) if not k.startswith("_") and not callable(getattr(ctx, k))}


def build(args, dev):
    torch.manual_seed(0)
    if args.model == "bert":
        cfg = transformers.BertConfig(hidden_size=args.hidden, num_hidden_layers=args.layers,
                                      num_attention_heads=args.heads, intermediate_size=args.intermediate,
                                      max_position_embeddings=max(512, args.seq))
        model = transformers.BertModel(cfg, add_pooling_layer=False)
    else:
        cfg = transformers.LlamaConfig(hidden_size=args.hidden, num_hidden_layers=args.layers,
                                       num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
                                       intermediate_size=args.intermediate, max_position_embeddings=args.seq,
                                       vocab_size=args.vocab)
        model = transformers.LlamaForCausalLM(cfg)
    model = model.to(dev).train()
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, cfg.vocab_size, (args.batch, args.seq), generator=g).to(dev)
    if args.model == "bert":
        batch = dict(input_ids=ids, attention_mask=torch.ones_like(ids))
        loss_of = lambda out: out.last_hidden_state.square().mean()  # noqa: E731
    else:
        batch = dict(input_ids=ids, labels=ids)
        loss_of = lambda out: out.loss  # noqa: E731
    return model, batch, loss_of


BOUND_TEXT = ("the least step time / plain that the measured bandwidths and the layers' forward time allow at that "
              "budget: what the plain step holds above it leaves for the host as fast as the link takes it during "
              "the layers' forward and returns as fast during their backward, and the rest is recomputed, the "
              "cheapest bytes first (each call's recompute time per byte, every call profiled as a candidate group "
              "with --groups, else the chain's groups; a whole layer's for what no call covers), taken "
              "fractionally; what is held where, and when, is ignored, so no plan can beat it")


def physics_bound(chain, plain_peak, budget, plain_ms, calls=None):
    """The bound of BOUND_TEXT (a ratio to the plain step), from the profiled chain (its JSON object): None where
    what must leave the device is more than the layers save. calls: per layer, every call the profile measured as
    a candidate group (dicts of SavedGroup's fields; LayerPlan.saved_calls), in place of the ten groups each
    layer's chain stage lists: the bound over every saved tensor a call makes, not only the ranked ones."""
    over = plain_peak - budget
    if over <= 0:
        return 1.0
    stages = chain["stages"]
    fwd_ms = sum(s["fwd_ms"] for s in stages)
    bwd_ms = sum(s["bwd_ms"] for s in stages)
    # GB/s x ms = 1e6 bytes; each byte sent must also come back.
    hidden = min(chain.get("to_host_gb_per_s") or 0, chain.get("to_device_gb_per_s") or 0) * 1e6 * min(fwd_ms, bwd_ms)
    rest = over - hidden
    if rest <= 0:
        return 1.0
    pieces = []  # (ms per byte, bytes)
    for i, s in enumerate(stages):
        # What recomputing a group frees: the bytes of it autograd saves (since 2026-12-04 a group may be a call
        # whose outputs it does not save: recomputing that frees nothing).
        listed = calls[i] if calls is not None else s.get("groups", [])
        groups = [(g["recompute_ms"], g["bytes"] - g.get("unsaved_bytes", 0)) for g in listed]
        groups = [(ms, nbytes) for ms, nbytes in groups if nbytes > 0]
        pieces += [(ms / nbytes, nbytes) for ms, nbytes in groups]
        # What the groups leave of what the layer saves, at a whole layer's cost per byte (all of it where the
        # layer has no groups; before 2026-12-04 (later) it was left out, and the bound read None wherever the
        # groups held less than had to go: the Llama's).
        rest_saved = s["saved_bytes"] - sum(nbytes for _, nbytes in groups)
        if rest_saved > 0 and s["saved_bytes"] > 0:
            pieces.append((s["fwd_ms"] / s["saved_bytes"], rest_saved))
    extra_ms = 0.0
    for per_byte, n in sorted(pieces):
        take = min(n, rest)
        extra_ms += per_byte * take
        rest -= take
        if rest <= 0:
            return (plain_ms + extra_ms) / plain_ms
    return None


def _ratio(x):
    return "-" if x is None else f"{x:.3f}"


def plan_key(row: str) -> str:
    """The plan a remat row ran: its name less "remat@" and a "/nowait" (--nowait-rows' twin of it); a
    "/compiled" row's (--compiled-layers) is its own, "WHERE/compiled"."""
    return row[len("remat@"):].removesuffix("/nowait")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", choices=["bert", "llama"], default="bert")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--hidden", type=int, default=None)
    ap.add_argument("--heads", type=int, default=None)
    ap.add_argument("--kv-heads", type=int, default=None)
    ap.add_argument("--intermediate", type=int, default=None)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--seq", type=int, default=None)
    ap.add_argument("--batch", type=int, default=None)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=None, help="paired steps per way and round (bert 1, llama 3)")
    ap.add_argument("--min-bytes", type=int, default=1 << 20, help="offload_min_bytes")
    ap.add_argument("--skip", default="", help="ways not to run, comma-separated (hf-offload, save_on_cpu)")
    ap.add_argument("--groups", action="store_true",
                    help="remat plans each layer's saved groups too (remat.hf.enable(..., groups=True))")
    ap.add_argument("--compile", default="",
                    help="also torch.compile's activation_memory_budget at these budgets, comma-separated (ways "
                         "compile-B; issue 42: 0.5,0.2), compiled and timed after the other ways' rounds")
    ap.add_argument("--at", default="hf,b1,b2",
                    help="where remat runs, comma-separated: a way's name (its measured peak: hf, sac, compile-0.5, "
                         "...), b1 and b2 (a third and two thirds of the way from hf's peak to sac's), least "
                         "(remat's least feasible budget); rows remat@at-WAY, remat@b1, remat@b2, remat@least")
    ap.add_argument("--timing", choices=TIMINGS, default="synced",
                    help="how remat's profiling step times the layers (LayerPlan.profile_timing; pipelined: "
                         "experimental, the device held ahead of the host): the plans measured are this profile's")
    ap.add_argument("--compare-timing", action="store_true",
                    help="also profile a copy of the model with the other timing: its chain in the JSON "
                         "(other_timing), and per remat row what it predicts of the plan measured "
                         "(remat.step_time_ms) and the plan it would choose there (predicted_ms_other, "
                         "replanned_other)")
    ap.add_argument("--no-host-wait", action="store_true",
                    help="remat's copy engines with the experimental host_wait=False (remat.offload.CopyEngine: "
                         "waiting for a copy makes the current stream wait, not the host, and copies back do not "
                         "wait for the current stream's queued work)")
    ap.add_argument("--nowait-rows", action="store_true",
                    help="each remat row also run with its copy engines' experimental host_wait=False, a row "
                         "remat@<at>/nowait paired in the same rounds (the same plan)")
    ap.add_argument("--compiled-layers", nargs="?", const="inductor", default=None, metavar="BACKEND",
                    help="each remat row also on a copy of the model whose layers are compiled one by one "
                         "(layer.compile(backend=BACKEND), inductor unless given), profiled and planned on its own "
                         "at the same budget: a row remat@<at>/compiled (transformers 5.23 or later; "
                         "docs/python.md, compiled layers)")
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    if args.compiled_layers and remat.hf.wraps_whole_call():
        ap.error(f"--compiled-layers: transformers {transformers.__version__} checkpoints a layer's whole call, "
                 "around its compiled graph (before 5.23), where remat.hf.enable refuses layers compiled on their "
                 "own; run it with transformers 5.23 or later (scripts/gpu-session: GPU_SESSION_TRANSFORMERS)")
    if args.no_host_wait:
        remat.offload.CopyEngine.HOST_WAIT = False
    # BERT-large (seed 001: sequence 512, batch 64, fp32); a Llama of 886M parameters, bf16 autocast, sequence 4096.
    defaults = dict(bert=dict(layers=24, hidden=1024, heads=16, intermediate=4096, seq=512, batch=64, steps=1),
                    llama=dict(layers=16, hidden=2048, heads=16, kv_heads=8, intermediate=5632, seq=4096, batch=2,
                               steps=3))
    for k, v in defaults[args.model].items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    if args.model == "bert":  # no grouped heads
        if args.kv_heads not in (None, args.heads):
            ap.error(f"--kv-heads {args.kv_heads}: BERT has no grouped heads (leave it out, or give --heads)")
        args.kv_heads = args.heads
    if args.heads % args.kv_heads or args.hidden % args.heads:
        ap.error(f"--heads {args.heads} must divide --hidden {args.hidden} and be a multiple of --kv-heads "
                 f"{args.kv_heads} (the {args.model} default is {defaults[args.model]['kv_heads']}: give --kv-heads "
                 "with --heads)")
    dev = torch.device(args.device)
    cuda = dev.type == "cuda"
    say(f"torch {torch.__version__}, transformers {transformers.__version__}, remat.POLICY_OFFLOAD "
        f"{remat.POLICY_OFFLOAD}, {torch.cuda.get_device_name(dev) if cuda else 'CPU'}")
    meter = remat.meter_for(dev)
    base_model, batch, loss_of = build(args, dev)
    amp = dict(device_type=dev.type, dtype=torch.bfloat16, enabled=args.model == "llama")

    def sync():
        if cuda:
            torch.cuda.synchronize(dev)

    def loss_under(model, context=None, forward=None):
        """The step's loss under autocast: by `forward` (a compiled forward and loss) where given, else by the
        model's own call, inside `context` where given."""
        with torch.autocast(**amp):
            if forward is not None:
                return forward()
            if context is not None:
                with context():
                    return loss_of(model(**batch))
            return loss_of(model(**batch))

    def step(model, context=None, seed=None, forward=None):
        """One step: (ms, peak bytes above the base, loss); `forward` (a compiled forward and loss) in place of
        the model's own call."""
        model.zero_grad(set_to_none=False)
        if seed is not None:
            torch.manual_seed(seed)
        sync()
        base = meter.count()
        with meter.window() as window:
            t0 = time.perf_counter()
            loss = loss_under(model, context, forward)
            loss.backward()
            sync()
            ms = (time.perf_counter() - t0) * 1e3
            peak = window.peak() - base
        return ms, peak, loss.detach()

    ways = {"none": (base_model, None)}
    forwards, compile_s = {}, {}  # the compiled ways' forwards, and each one's first step (its compile) in s
    hf = copy.deepcopy(base_model)
    hf.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    ways["hf"] = (hf, None)
    sac = copy.deepcopy(base_model)
    sac.gradient_checkpointing_enable(gradient_checkpointing_kwargs={
        "use_reentrant": False, "context_fn": partial(create_selective_checkpoint_contexts, matmuls)})
    ways["sac"] = (sac, None)
    skip = {w for w in args.skip.split(",") if w}
    unknown = skip - {"hf-offload", "save_on_cpu"}
    if unknown:
        ap.error(f"--skip: {sorted(unknown)} are not ways this script may skip (hf-offload, save_on_cpu)")
    try:
        if "hf-offload" in skip:
            raise RuntimeError("skipped (--skip)")
        hfo = copy.deepcopy(base_model)
        hfo.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False, "offload": True})
        step(hfo)
        ways["hf-offload"] = (hfo, None)
    except Exception as e:  # not in this transformers
        say(f"hf-offload: not available ({type(e).__name__}: {e})")
    if "save_on_cpu" not in skip:
        ways["save_on_cpu"] = (base_model, partial(torch.autograd.graph.save_on_cpu, pin_memory=cuda))
    compile_budgets = [float(x) for x in args.compile.split(",") if x]
    compile_names = [f"compile-{b:g}" for b in compile_budgets]
    at = [a for a in args.at.split(",") if a]
    for a in at:  # refused before anything is measured
        if a not in ("b1", "b2", "least") and a not in compile_names and (a not in ways or a == "none"):
            ap.error(f"--at: {a!r} is not b1, b2, least or a way of this run "
                     f"({', '.join([w for w in ways if w != 'none'] + compile_names)})")
    peaks = {}

    def measure_peaks(names):
        for w in names:
            m, ctx = ways[w]
            step(m, ctx, forward=forwards.get(w))
            peaks[w] = step(m, ctx, forward=forwards.get(w))[1]
            say(f"{w}: peak {peaks[w] / 2**30:.2f} GiB")

    measure_peaks(list(ways))

    # Nothing freed by the cycle collector inside remat's profiling step (a free there lowers the count its peaks
    # are read against: a second BERT made in one process measured its floor 15.8 MB for 35.7 MB).
    gc.collect()
    plain_a, plain_b = copy.deepcopy(base_model), copy.deepcopy(base_model)
    rm = build(args, dev)[0]  # afresh, gradients allocated as the others' (a deep copy drops .grad: see BENCHMARKS)
    lp = remat.hf.enable(rm, budget=1 << 40, offload=True, offload_min_bytes=args.min_bytes,
                         groups=args.groups)  # planned per row below
    lp.profile_timing = args.timing
    check = []
    t0 = time.perf_counter()
    for k in range(2):
        la, ga = step(plain_a, seed=100 + k)[2], grads_of(plain_a)
        step(plain_b, seed=100 + k)
        gb = grads_of(plain_b)
        lr, gr = step(rm, seed=100 + k)[2], grads_of(rm)
        if k == 0:
            profile_s = time.perf_counter() - t0
        check.append(dict(step=k, loss_equal=bool(torch.equal(la, lr)), grad_max_diff=max_diff(ga, gr),
                          plain_grad_max_diff=max_diff(ga, gb)))
        say(f"check {check[-1]}")
    del plain_a, plain_b
    chain = lp.chain
    # With --groups, every call the profile measured as a candidate group (not only the ten fit_groups chose):
    # the bound's recompute side, per layer (physics_bound's `calls`).
    saved_calls = None if lp.saved_calls is None else [
        [dict(name=g.name, bytes=g.bytes, recompute_ms=g.recompute_ms, unsaved_bytes=g.unsaved_bytes,
              stays_bytes=g.stays_bytes) for g in layer] for layer in lp.saved_calls]
    piped = None
    if args.compare_timing:
        # The same model profiled with the other timing (docs/planning.md, "Timing the layers"): its chain, to
        # compare its predictions with those of the profile whose plans are measured below.
        gc.collect()
        pm = build(args, dev)[0]
        plp = remat.hf.enable(pm, budget=1 << 40, offload=True, offload_min_bytes=args.min_bytes, groups=args.groups)
        plp.profile_timing = "synced" if args.timing == "pipelined" else "pipelined"
        t0 = time.perf_counter()
        step(pm, seed=100)
        piped = dict(timing=plp.profile_timing, chain=plp.chain, profile_s=time.perf_counter() - t0)
        say(f"{piped['timing']} profile: {piped['profile_s']:.1f} s")
        remat.hf.disable(pm)
        del pm, plp
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
    comp = None
    if args.compiled_layers:
        # Another copy whose layers are compiled one by one, profiled (its first step, which compiles the
        # layers' graphs for the choices it profiles) and planned on its own: remat.hf.enable runs each
        # layer's plan inside its compiled graph, where torch.compile can trace it (docs/python.md).
        gc.collect()
        cm = build(args, dev)[0]
        for layer in remat.hf.layers_of(cm):
            layer.compile(backend=args.compiled_layers)
        clp = remat.hf.enable(cm, budget=1 << 40, offload=True, offload_min_bytes=args.min_bytes,
                              groups=args.groups)
        clp.profile_timing = args.timing
        t0 = time.perf_counter()
        step(cm, seed=100)
        comp = dict(model=cm, lp=clp, profile_s=time.perf_counter() - t0, backend=args.compiled_layers)
        say(f"compiled layers: profiled (and compiled) in {comp['profile_s']:.1f} s")
    bandwidth = dict(to_host_gb_per_s=chain.to_host_gb_per_s, to_device_gb_per_s=chain.to_device_gb_per_s)
    say(f"bandwidth: {bandwidth}")
    least_budget = lp.min_budget_bytes
    say(f"remat's least feasible budget: {least_budget / 2**30:.3f} GiB")
    name = torch.cuda.get_device_name(dev) if cuda else "CPU"
    if args.json:  # the profile now, should the planning or the rounds outrun the call (its stage says so)
        with open(args.json, "w") as f:
            json.dump(dict(config=vars(args), device=name,
                           torch=torch.__version__, peaks=peaks, least_budget=least_budget, bandwidth=bandwidth,
                           check=check, chain=json.loads(chain.to_json()), context=context_figures(lp.context),
                           stage="profiled"), f, indent=1)
    plans = {}
    # Each plan's own step is compared with a plain one of the same seed (the check above ran every layer kept,
    # before the plans): the loss, and the gradients' largest difference beside two plain runs' (check's).
    base_loss = step(base_model, seed=300)[2]
    base_grads = grads_of(base_model)

    def plan_at(plan_lp, key, b, fall_back):
        """plan_lp (remat's LayerPlan of a row's model) planned at `b` for the row remat@key, its figures in
        plans[key]; None where `b` is below its least feasible budget and not `fall_back` (recorded as such).
        With `fall_back` it is planned at that least instead, said and marked (`least`, `asked`)."""
        asked, least = b, None
        t_plan = time.perf_counter()
        try:
            plan_lp.set_budget(b)
        except remat.InfeasibleBudget as e:
            say(f"remat@{key}: infeasible at {b / 2**30:.3f} GiB, least {e.min_bytes / 2**30:.3f} GiB"
                + (": run there" if fall_back else ""))
            if not fall_back:
                plans[key] = dict(budget=b, infeasible=e.min_bytes)
                return None
            least = b = e.min_bytes
            plan_lp.set_budget(b)
        p = plans[key] = dict(budget=b, asked=asked, least=least, choices=plan_lp.choices,
                              predicted=plan_lp.predicted_peak_bytes, predicted_host=plan_lp.predicted_host_bytes,
                              plan_ms=plan_lp.plan.predicted.time_ms, transfer_ms=plan_lp.plan.predicted.transfer_ms,
                              plan=str(plan_lp.plan), plan_s=time.perf_counter() - t_plan)
        return p

    def check_against_plain(p, key, model):
        """The planned step of row remat@key on `model` against a plain step of the same seed: the loss, and the
        gradients' largest difference (the plan's `check`)."""
        loss = step(model, seed=300)[2]
        p["check"] = dict(loss_equal=bool(torch.equal(base_loss, loss)),
                          grad_max_diff=max_diff(base_grads, grads_of(model)))
        say(f"remat@{key} against plain: {p['check']}")

    def plan_rows(names):
        """Plans remat at each of `names` (--at's words); returns the rows planned."""
        rows = []
        for a in names:
            if a in ("b1", "b2"):
                w, b = a, int(peaks["hf"] + int(a[1]) / 3 * (peaks["sac"] - peaks["hf"]))
            elif a == "least":
                w, b = a, least_budget
            elif a in peaks:
                w, b = f"at-{a}", peaks[a]
            else:  # a compiled way whose compile failed (said above)
                say(f"--at {a}: left out, {a} did not run")
                continue
            say(f"remat@{w}: planning at {b / 2**30:.3f} GiB")
            # The row the first target is read at, remat@at-hf, is measured at remat's least budget
            # where hf's peak is below it, and marked so; any other such row is left out.
            p = plan_at(lp, w, b, fall_back=w == "at-hf")
            if p is None:
                continue
            b = p["budget"]
            if piped is not None:
                # The plan measured, as the other timing's chain times it (its layers' part; the rest is the
                # same), and the plan that chain would choose at this budget. (Its saved groups are the same
                # calls: fit_groups ranks them by kind and bytes.) What fails is said and left out of the row.
                try:
                    # As the planner charges the plan on that chain (remat.step_time_ms, the rest left out: it
                    # is added below). Before, plan_ms plus the difference of simulate()'s times on the two
                    # chains, which charges a checkpointed layer otherwise (its forward and whole recompute,
                    # not its per-call figures): an estimate, negative on a busy CPU.
                    p["plan_ms_other"] = remat.step_time_ms(piped["chain"], lp.context, lp.plan) - \
                        lp.context.rest_ms
                    other = remat.plan_step(piped["chain"], lp.context, b, "per-layer", [],
                                            **lp.offloads.planner_options())
                    p["replanned_other"] = dict(plan=str(other.plan), plan_ms=other.plan.predicted.time_ms,
                                                choices=remat.choices_of(other.plan))
                except Exception as e:  # noqa: BLE001  (the row is measured all the same)
                    p.pop("plan_ms_other", None)
                    say(f"remat@{w}: the {piped['timing']} profile's figures failed: {type(e).__name__}: {e}")
            say(f"remat@{w}: planned in {p['plan_s']:.1f} s: {lp.choices}")
            check_against_plain(p, w, rm)
            rows.append(f"remat@{w}")
            if args.nowait_rows:
                rows.append(f"remat@{w}/nowait")
            if comp is not None:
                # The same row on the compiled layers (--compiled-layers), at the budget this row runs at: where
                # that is below what their profile allows (they are offered no streamed choices and no group
                # assignments: so at remat@least's), at their own least budget instead, marked so, as remat@at-hf is.
                key = f"{w}/compiled"
                p = plan_at(comp["lp"], key, b, fall_back=True)
                p["compiled_layers"] = True
                say(f"remat@{key}: planned in {p['plan_s']:.1f} s: {comp['lp'].choices}")
                # Its first step compiles what the plan's choices need, if not profiled. Not bitwise: the compiled
                # graphs fuse (the gradients' largest difference from the eager plain run's).
                check_against_plain(p, key, comp["model"])
                rows.append(f"remat@{key}")
        return rows

    # The profiled chain and context, and every plan (text), to check the time model against the measured steps
    # afterwards; and the plain step as the model predicts it (every layer kept).
    keep_all = remat.Plan.from_json(json.dumps(dict(num_stages=len(chain.stages), ops=[f"Fa{i}" for i in range(
        len(chain.stages))] + ["L"] + [f"B{i}" for i in reversed(range(len(chain.stages)))])))
    keep_plan_ms = remat.simulate(chain, keep_all).time_ms
    facts = dict(config=vars(args), device=name, timing=args.timing, torch=torch.__version__, transformers=transformers.__version__,
                 policy_offload=remat.POLICY_OFFLOAD, peaks=peaks, compile_s=compile_s, least_budget=least_budget,
                 bandwidth=bandwidth, profile_s=profile_s,
                 check=check, plans=plans, chain=json.loads(chain.to_json()), profiled_rest_ms=lp.context.rest_ms,
                 context=context_figures(lp.context), saved_calls=saved_calls)
    if piped is not None:
        facts["other_timing"] = dict(timing=piped["timing"], chain=json.loads(piped["chain"].to_json()),
                                     profile_s=piped["profile_s"])
    if comp is not None:
        facts["compiled_layers"] = dict(chain=json.loads(comp["lp"].chain.to_json()),
                                        context=context_figures(comp["lp"].context), profile_s=comp["profile_s"],
                                        backend=comp["backend"],
                                        profiled_rest_ms=comp["lp"].context.rest_ms)
    host_peak = {}
    res, plain_all = {}, []

    def run_of(model, ctx, row=None, forward=None, plan=None):
        def run():
            loss = loss_under(model, ctx, forward)
            if row is not None:  # remat's host pool: its peak is at the end of the forward pass
                host_peak[row] = max(host_peak.get(row, 0), plan.host_pool.peak_bytes)
            return loss
        return run

    # The layers' copy engine as remat made it, and the experimental host_wait=False one of the /nowait rows
    # (--nowait-rows), keyed by the device the layers' tensors name (cuda:0, not the "cuda" given).
    layer_dev = next(rm.parameters()).device
    own, nowait = {}, {}

    def engines_for(no_wait):
        current = lp.offloads.engines.get(layer_dev)
        if current is not None and current.host_wait:
            own[layer_dev] = current
        if no_wait:
            if layer_dev not in nowait:
                nowait[layer_dev] = remat.offload.CopyEngine(layer_dev, hold=True, host_wait=False)
            lp.offloads.engines[layer_dev] = nowait[layer_dev]
        elif layer_dev in own:
            lp.offloads.engines[layer_dev] = own[layer_dev]
        else:
            lp.offloads.engines.pop(layer_dev, None)  # the layers make their own

    def way_of(r):
        if r.endswith("/compiled"):
            comp["lp"].set_budget(plans[plan_key(r)]["budget"])
            comp["lp"].host_pool.peak_bytes = 0
            return comp["model"], run_of(comp["model"], None, r, plan=comp["lp"])
        if r.startswith("remat@"):
            lp.set_budget(plans[plan_key(r)]["budget"])
            lp.host_pool.peak_bytes = 0
            if args.nowait_rows:
                engines_for(r.endswith("/nowait"))
            return rm, run_of(rm, None, r, plan=lp)
        model, ctx = ways[r]
        return model, run_of(model, ctx, forward=forwards.get(r))

    def write(stage, rows, plain):
        if args.json:
            with open(args.json, "w") as f:
                json.dump(dict(facts, stage=stage, plain_ms=statistics.median(plain) if plain else None, rows=rows),
                          f, indent=1)

    def timed(rows, phase):
        """Paired rounds of `rows`, added to res; the JSON written after each round, should the run be stopped."""
        def keep(results, plain):
            done = len(next(iter(results.values()))["ratios"])
            write(f"{phase}: {done} of {args.rounds} rounds", {**res, **results}, plain_all + plain)

        r, plain = paired_rounds(rows, way_of, (base_model, run_of(base_model, None)), meter, args.rounds,
                                 args.steps, warmup=1, after_round=keep)
        res.update(r)
        plain_all.extend(plain)

    # First the ways that need no compiler, and remat at their peaks: what the first targets are read at,
    # measured whatever the compiles below take.
    rows = [w for w in ways if w != "none"] + plan_rows([a for a in at if a not in compile_names])
    write("planned", {}, [])
    timed(rows, "uncompiled ways")
    # Then torch.compile's ways, each compiled on its own first step, and remat at their peaks.
    for b, w in zip(compile_budgets, compile_names):
        cm = copy.deepcopy(base_model)
        for p in cm.parameters():  # a deep copy drops .grad; allocated as the others' are
            p.grad = torch.zeros_like(p)
        forwards[w] = compiled(cm, batch, loss_of, b)
        t0 = time.perf_counter()
        try:
            step(cm, forward=forwards[w])
        except Exception as e:  # the compiler on this machine: the way is left out, the rest of the run goes on
            say(f"{w}: not run ({type(e).__name__}: {str(e)[:300]})")
            compile_s[w] = f"failed: {type(e).__name__}: {str(e)[:300]}"
            forwards.pop(w)
            cm = None  # its memory back
            continue
        compile_s[w] = time.perf_counter() - t0
        say(f"{w}: compiled in {compile_s[w]:.1f} s")
        ways[w] = (cm, None)
        measure_peaks([w])
    compiled_rows = [w for w in compile_names if w in ways]
    compiled_rows += plan_rows([a for a in at if a in compile_names])
    if compiled_rows:
        timed(compiled_rows, "compiled ways")
    rows = list(res)

    # Predicted step times: the plan's layers and copies, and the rest of the step as remat's first planned steps
    # timed it again (the profiling step's own reading includes first-time costs).
    rest_ms = lp.context.rest_ms
    keep_ms = keep_plan_ms + rest_ms
    for p in plans.values():
        if "choices" in p:
            # The compiled layers' rows: their own profile's rest (the same eager code around the layers).
            p["predicted_ms"] = p["plan_ms"] + (comp["lp"].context.rest_ms if p.get("compiled_layers") else rest_ms)
            if "plan_ms_other" in p:
                p["predicted_ms_other"] = p["plan_ms_other"] + rest_ms
                p["replanned_other"]["predicted_ms"] = p["replanned_other"]["plan_ms"] + rest_ms
    facts.update(rest_ms=rest_ms, predicted_plain_ms=keep_ms)
    plain_med = statistics.median(plain_all)
    for r in rows:
        res[r]["host_peak"] = host_peak.get(r, 0)
        # What the measured bandwidths and forward time allow at this row's budget (remat's) or peak (the others').
        res[r]["bound"] = physics_bound(facts["chain"], peaks["none"],
                                        plans[plan_key(r)]["budget"] if r.startswith("remat@") else res[r]["peak"], plain_med,
                                        saved_calls)
    print(f"\n{args.model} {args.layers}x{args.hidden}, seq {args.seq}, batch {args.batch}, "
          f"{'bf16 autocast' if amp['enabled'] else 'fp32'}, {name}, torch {torch.__version__}, transformers "
          f"{transformers.__version__}; plain step {plain_med:.1f} ms, "
          f"{peaks['none'] / 2**30:.2f} GiB; bandwidth {bandwidth['to_host_gb_per_s']:.1f} GB/s to the host, "
          f"{bandwidth['to_device_gb_per_s']:.1f} back; remat's profiling step {profile_s:.1f} s; plain step "
          f"predicted {keep_ms:.1f} ms")
    print(f"{'way':<22} {'peak GiB':>9} {'host GiB':>9} {'time/none':>9} {'bound':>6}  rounds")
    for r in rows:
        extra = ""
        if r.startswith("remat@"):
            p = plans[plan_key(r)]
            extra = (f"  (budget {p['budget'] / 2**30:.2f}{' (least; asked ' + format(p['asked'] / 2**30, '.2f') + ')' if p['least'] else ''}, predicted {p['predicted'] / 2**30:.2f} GiB, "
                     f"host {p['predicted_host'] / 2**30:.2f}; predicted {p['predicted_ms']:.1f} ms, measured "
                     f"{statistics.median(res[r]['ms']):.1f})")
            if "predicted_ms_other" in p:
                q = p["replanned_other"]
                extra += (f" {piped['timing']}: predicted {p['predicted_ms_other']:.1f} ms; would plan "
                          f"{q['choices']} at {q['predicted_ms']:.1f} ms")
        print(f"{r:<22} {res[r]['peak'] / 2**30:9.2f} {res[r]['host_peak'] / 2**30:9.2f} "
              f"{statistics.median(res[r]['ratios']):9.2f} {_ratio(res[r]['bound']):>6}  " + ", ".join(f"{v:.2f}" for v in res[r]["ratios"])
              + extra)
    print(f"remat's least feasible budget {least_budget / 2**30:.2f} GiB ({least_budget / peaks['hf']:.3f} of hf's "
          f"peak); bound: {BOUND_TEXT}")
    # What the medians leave out: each way's mean step against its median, and Python's full collections that
    # began during its timed steps (docs/BENCHMARKS.md, "Python's garbage collector in a checkpointed step").
    steps_of = {r: sum(res[r]["step_ms"], []) for r in rows if res[r].get("step_ms")}
    print("mean/median step and full collections: " + "; ".join(
        f"{r} {statistics.mean(ms) / statistics.median(ms):.3f}, "
        f"{res[r]['full_collections']} ({res[r]['full_collection_ms']:.0f} ms)" for r, ms in steps_of.items()))
    write("measured", res, plain_all)

if __name__ == "__main__":
    main()
