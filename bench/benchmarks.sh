#!/usr/bin/env bash
# Runs every benchmark quoted in docs/BENCHMARKS.md, one after the other (they must not share the CPU), and
# keeps each one's output in out/bench/<name>.log. Takes about an hour on 2 cores. Run after ./run or scripts/build.
#   bench/benchmarks.sh              # everything
#   bench/benchmarks.sh heavy scale  # only these sections
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/env.sh
remat=build/bin/remat
out=out/bench
mkdir -p "$out"
sections=("$@")
[ ${#sections[@]} -eq 0 ] && sections=(machine bert heavy small noise scale planner cifar forum demo maxbatch resnet modes earlystop dataparallel sublayer timemodel frontier gpt compile hf)

log() { echo "\$ $*" | tee -a "$out/$name.log"; "$@" 2>&1 | grep -v -E "^(remat|pytorch): step " | tee -a "$out/$name.log"; }

for name in "${sections[@]}"; do
  : > "$out/$name.log"
  echo "=== $name ($(date -u +%FT%TZ))" | tee -a "$out/$name.log"
  case "$name" in
    timemodel)  # the time model: each row's predicted step time (a fresh profile per round) beside the measured one
      mkdir -p "$out/timemodel"
      for r in 1 2 3; do
        log "$remat" bench --model bert --batch 8 --predict \
          --strategy none,all,uniform:4,sqrt,optimal:150MiB,optimal:300MiB --steps 3 --warmup 1 --json "$out/timemodel/bert-$r.json"
        log "$remat" bench --model mlp --depth 16 --width 512 --predict \
          --strategy none,all,uniform:4,sqrt,optimal:8MiB,optimal:12MiB --steps 15 --warmup 3 --json "$out/timemodel/mlp-$r.json"
      done
      ;;
    frontier)  # every PyTorch 2.15 option against remat's planner at that option's peak (./test --torch pypi first)
      py="$REMAT_PYPI_VENV/bin/python"
      REMAT_PYTHON="$py" log "$py" bench/compare.py --frontier --build build-pypi --model resnet --batch 128 --keep conv \
        --pytorch none,all,all-reentrant,uniform:2,uniform:3,uniform:4,uniform:6 --steps 7 --warmup 2 --rounds 3 \
        --out "$out/frontier-resnet"
      REMAT_PYTHON="$py" log "$py" bench/compare.py --frontier --hf --build build-pypi --model bert --granularity layer \
        --keep matmul --pytorch none,all,all-reentrant,uniform:2,uniform:3,uniform:4,uniform:6,selective --steps 3 \
        --warmup 1 --rounds 3 --out "$out/frontier-bert"
      ;;
    gpt)  # examples/gpt (remat, LibTorch 2.15) and bench/gpt_reference.py (PyTorch 2.15) alternated, 3 rounds
      py="$REMAT_PYPI_VENV/bin/python"
      for r in 1 2 3; do
        log build-pypi/examples/example_gpt 6 384 6 256 8 3 1
        log "$py" bench/gpt_reference.py --meter build-pypi/libremat_meter.so --layers 6 --width 384 --heads 6 \
          --block 256 --batch 8 --steps 3 --rounds 1 --json "$out/gpt-pytorch-$r.json"
      done
      ;;
    compile)  # BERT-base: torch.compile's activation_memory_budget against remat's planner with policies at its peaks
      py="$REMAT_PYPI_VENV/bin/python"
      REMAT_PYTHON="$py" log "$py" bench/compare.py --frontier --build build-pypi --model bert --granularity layer \
        --policy matmuls,recompute_pointwise --pytorch none,compile:1.0,compile:0.5,compile:0.2,compile:0.0 \
        --steps 3 --warmup 1 --rounds 3 --out "$out/compile-bert"
      ;;
    hf)  # the Python package on Hugging Face BERT-base and GPT-2 small: PyTorch's options, torch.compile's budgets
         # and remat.hf.enable at each one's peak, 3 rounds in one process per model (pip install ./python first)
      py="$REMAT_PYPI_VENV/bin/python"
      for model in bert gpt2; do
        log "$py" bench/hf_compare.py --model $model --layers 12 --seq 128 --batch 8 --rounds 3 --steps 3 \
          --warmup 1 --json "$out/hf-$model.json"
      done
      ;;
    sublayer)  # BERT-base on sub-layer stages against layer stages: selective, and the planner at PyTorch's peaks
      for r in 1 2 3; do
        log "$remat" bench --model bert --batch 8 --granularity sublayer \
          --strategy none,all,selective,optimal:135.1MiB,optimal:258.1MiB --steps 3 --warmup 1 --json "$out/sub$r.json"
        log "$remat" bench --model bert --batch 8 --granularity layer \
          --strategy none,all,optimal:135.1MiB,optimal:258.1MiB --steps 3 --warmup 1 --json "$out/layer$r.json"
      done
      ;;
    dataparallel)  # remat::distributed::DataParallel on 1, 2 and 4 local processes (Gloo over loopback)
      for n in 1 2 4; do
        log "$remat" bench --nproc "$n" --model bert --batch 8 \
          --strategy none,all,all-reentrant,uniform:4,sqrt,optimal:overhead=0.5 --steps 3 --warmup 1 \
          --json "$out/dataparallel-$n.json"
      done
      ;;
    machine)
      log uname -srm
      log nproc
      log sh -c 'grep -m1 "model name" /proc/cpuinfo; grep -o -m1 -w "avx512f\|avx2" /proc/cpuinfo; echo OPENBLAS_CORETYPE=$OPENBLAS_CORETYPE OMP_NUM_THREADS=$OMP_NUM_THREADS'
      log sh -c 'dpkg-query -W libtorch-dev python3-torch libopenblas0-openmp'
      ;;
    bert)  # the headline, with PyTorch's per-layer and checkpoint_sequential(4) on the same model, 3 rounds
      log "$REMAT_PYTHON" bench/compare.py --model bert \
        --remat none,all,all-reentrant,sqrt,uniform:4,optimal:as=uniform:4,optimal:overhead=0.5 \
        --pytorch none,all,all-reentrant,uniform:4 --steps 3 --warmup 1 --rounds 3 --plot --out "$out/bert"
      # The optimal planner with PyTorch's checkpoint_sequential(4) peak (just measured) as its budget.
      budget=$("$REMAT_PYTHON" -c "import json; r=json.load(open('$out/bert/compare.json'))['pytorch']['rows']; \
print(next(x['peak_bytes'] for x in r if x['strategy']=='uniform:4'))")
      log "$remat" bench --model bert --strategy "none,uniform:4,optimal:$budget" --steps 3 --warmup 1
      ;;
    heavy)  # HeavyChain: 1000 calls of 100 additions, checkpointed per call
      log "$REMAT_PYTHON" bench/compare.py --model heavy --remat none,all,all-reentrant \
        --pytorch none,all,all-reentrant --steps 5 --warmup 1 --rounds 3 --out "$out/heavy"
      # Where a plain step's time goes (needs perf; skipped where it is not permitted).
      if perf record -q -o "$out/heavy.perf.data" true 2>/dev/null; then
        log perf record -q -g -o "$out/heavy.perf.data" "$remat" bench --model heavy --strategy none --steps 3 --warmup 1
        log sh -c "perf report -i $out/heavy.perf.data --no-children --stdio -g none --percent-limit 2 2>/dev/null | grep '%'"
      fi
      ;;
    small)  # a small BERT, where the per-operation and per-checkpoint costs are a large part of a step
      log "$REMAT_PYTHON" bench/compare.py --model bert --layers 4 --hidden 128 --heads 4 --intermediate 512 \
        --seq 64 --batch 8 --remat none,all,all-reentrant,uniform:2 --pytorch none,all,all-reentrant,uniform:2 \
        --steps 20 --warmup 3 --rounds 3 --out "$out/small"
      ;;
    noise)  # the noise floor of a cross-process comparison: the same plain step in both, five alternated rounds
      log "$REMAT_PYTHON" bench/compare.py --model bert --layers 4 --hidden 128 --heads 4 --intermediate 512 \
        --seq 64 --batch 8 --remat none --pytorch none --steps 20 --warmup 3 --rounds 5 --out "$out/noise"
      log "$REMAT_PYTHON" -c "import json; [print('round', i, 'remat/pytorch', round(json.load(open(f'$out/noise/remat-{i}.json'))['rows'][0]['median_ms'] / json.load(open(f'$out/noise/pytorch-{i}.json'))['rows'][0]['median_ms'], 3)) for i in range(5)]"
      ;;
    scale)  # peak activation memory against depth: none, sqrt, and optimal within 1.25x and 1.4x the plain step's predicted time
      for depth in 16 64 256; do
        log "$remat" bench --model mlp --depth "$depth" --width 256 --batch 256 \
          --strategy none,sqrt,optimal:time=1.25,optimal:time=1.4 --steps 2 --warmup 1
      done
      ;;
    planner)  # planning speed: optimal on 100 stages with 500 slots, revolve on 100,000 stages
      log "$REMAT_PYTHON" bench/make_chains.py "$out"
      log "$remat" plan --chain "$out/random-100.json" --budget 600MiB --slots 500
      log "$remat" plan --chain "$out/random-100.json" --budget 300MiB --slots 500
      log "$remat" plan --chain "$out/uniform-100000.json" --budget 64MiB --planner revolve
      log "$remat" plan --chain "$out/uniform-100000.json" --planner revolve:20
      ;;
    cifar)  # the CIFAR-10 article's model and its checkpointed second block
      log "$remat" bench --model cifar --batch 64 --strategy none,all --steps 5 --warmup 2
      log "$remat" max-batch --model cifar --budget 256MiB --strategy none,all,sqrt,optimal
      ;;
    forum)  # the forum thread's models: where the memory goes
      log "$remat" profile --model forum-cnn --batch 100 --optimizer adam
      for placement in each-op conv-relu all-convs; do
        log "$remat" bench --model forum-cnn --batch 100 --placement "$placement" --strategy none,all --steps 3
      done
      log "$remat" profile --model forum-cnn --variant full --batch 4 --optimizer adam --repeats 1
      ;;
    demo)  # the gradient checkpointing article's BERT experiment, scaled to this machine
      log "$remat" demo --steps 3
      ;;
    maxbatch)  # the largest batch within a budget (the articles quote 24 -> 132 samples)
      log "$remat" max-batch --model bert --layers 6 --hidden 512 --heads 8 --intermediate 2048 --seq 128 \
        --budget 1GiB --strategy none,all,sqrt,optimal
      ;;
    pypi)  # PyTorch 2.15 and Hugging Face beside remat built on the LibTorch of the same wheel (./test --torch pypi)
      py="$REMAT_PYPI_VENV/bin/python"
      log "$py" -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__)'
      REMAT_PYTHON="$py" log "$py" bench/compare.py --build build-pypi --model bert \
        --remat none,all,all-reentrant,uniform:2,uniform:3,uniform:4,uniform:6 \
        --pytorch none,all,all-reentrant,uniform:2,uniform:3,uniform:4,uniform:6,selective \
        --steps 3 --warmup 1 --out "$out/bert-2.15"
      log "$py" bench/pytorch_reference.py --meter build-pypi/libremat_meter.so --model hf-bert --strategy none,all \
        --steps 3 --warmup 1
      ;;
    resnet)  # the ResNet example: every way of checkpointing it, peak and same-round time ratio
      log build/examples/example_resnet 64 5 5
      log build/tests/remat_tests --gtest_filter=StateRestore.CostPerOperator
      ;;
    modes)  # kNonReentrant against kReentrant on BERT-base-sized layers (docs/checkpointing.md: choosing a mode)
      for round in 1 2 3; do
        log "$remat" bench --model bert --layers 4 --hidden 768 --heads 12 --intermediate 3072 --seq 128 --batch 8 \
          --strategy none,all,all-reentrant
      done
      ;;
    earlystop)  # kNonReentrant early stopping on and off
      for round in 1 2 3; do
        log "$remat" bench --model mlp --depth 8 --width 1024 --batch 64 --strategy none,all,all-no-early-stop
      done
      for round in 1 2; do
        log "$remat" bench --model bert --layers 4 --hidden 768 --heads 12 --intermediate 3072 --seq 128 --batch 8 \
          --strategy none,all,all-no-early-stop
      done
      ;;
    soak)  # 10,000 steps per mode (docs/RELIABILITY.md)
      OMP_NUM_THREADS=1 log build/bin/remat_soak --steps 10000
      ;;
    fuzz)  # 200,000 random programs (docs/RELIABILITY.md)
      REMAT_FUZZ_SEED=1000000 REMAT_FUZZ_COUNT=200000 log build/tests/remat_tests --gtest_filter=Fuzz.Long
      ;;
    *) echo "unknown section $name" >&2; exit 2 ;;
  esac
done
