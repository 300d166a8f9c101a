#!/usr/bin/env bash
# The remat command: help for every command, one-line errors with a non-zero exit, plan --json's keys.
set -u
remat="$1"
fail=0
check() {  # check NAME EXPECTED_EXIT(0|nonzero) NEEDLE -- command...
  local name="$1" want="$2" needle="$3"
  shift 4
  local out rc
  out=$("$@" 2>&1)
  rc=$?
  if [ "$want" = 0 ] && [ $rc -ne 0 ]; then echo "FAIL $name: exit $rc: $out"; fail=1; return; fi
  if [ "$want" != 0 ] && [ $rc -eq 0 ]; then echo "FAIL $name: exit 0"; fail=1; return; fi
  if ! grep -qF -- "$needle" <<<"$out"; then echo "FAIL $name: no '$needle' in: $out"; fail=1; return; fi
  if [ "$want" != 0 ] && grep -qE "terminate called|Exception raised from|Aborted|Segmentation" <<<"$out"; then
    echo "FAIL $name: not a clean error: $out"; fail=1; return
  fi
  echo "ok   $name"
}
# Help names each command's own options, not only the shared ones.
declare -A own=([bench]="--nproc" [profile]="--repeats" [plan]="--budget" [max-batch]="--budget"
                [sweep]="--budgets" [demo]="--steps")
for cmd in bench profile plan max-batch sweep demo; do
  check "help-$cmd" 0 "--model" -- "$remat" "$cmd" --help
  check "help-$cmd-own" 0 "${own[$cmd]}" -- "$remat" "$cmd" --help
done
check no-command nonzero "subcommand" -- "$remat"
check bad-model nonzero "--model" -- "$remat" bench --model gpt
check bad-budget nonzero "'banana' is not a size" -- "$remat" plan --model mlp --budget banana
check no-budget nonzero "needs --budget" -- "$remat" plan --model mlp --depth 2 --width 8 --planner optimal
check infeasible nonzero "the minimum for this chain is" -- "$remat" plan --model mlp --depth 4 --width 16 --budget 1KiB
check bad-strategy nonzero "unknown strategy 'fastest'" -- "$remat" bench --model mlp --depth 2 --width 8 --strategy fastest --steps 1
check missing-chain nonzero "cannot read" -- "$remat" plan --chain /nonexistent.json --budget 1MiB
check heavy-batch nonzero "no batch dimension" -- "$remat" max-batch --model heavy --budget 1MiB
check cuda nonzero "no CUDA device" -- "$remat" bench --model mlp --device cuda --steps 1
json=$("$remat" plan --model mlp --depth 6 --width 32 --budget 1MiB --json 2>/dev/null)
for key in planner budget_bytes predicted_peak_bytes predicted_time_ms forward_calls ops; do
  if grep -q "\"$key\"" <<<"$json"; then echo "ok   plan-json-$key"; else echo "FAIL plan-json-$key: $json"; fail=1; fi
done
# budget_bytes is the budget passed, for every planner (the plan's own is plan_budget_bytes: 0 for those that
# take none).
for planner in optimal per-layer sqrt uniform:3 all none revolve:2; do
  j=$("$remat" plan --model mlp --depth 6 --width 32 --budget 4MiB --planner "$planner" --json 2>/dev/null)
  if grep -q '"budget_bytes": 4194304' <<<"$j" && grep -q '"plan_budget_bytes"' <<<"$j"; then
    echo "ok   plan-json-budget-$planner"
  else
    echo "FAIL plan-json-budget-$planner: $j"; fail=1
  fi
done
# The bench table: one row per strategy, each saying its gradients equal those of "none".
out=$("$remat" bench --model mlp --depth 3 --width 16 --batch 4 --strategy none,all,sqrt --steps 1 --warmup 1 2>&1)
rc=$?
rows=$(grep -cE '^(none|all|sqrt) .* equal ' <<<"$out")
if [ $rc -eq 0 ] && [ "$rows" = 3 ] && ! grep -qE '^(none|all|sqrt) .* differ' <<<"$out"; then
  echo "ok   bench-table"
else
  echo "FAIL bench-table: exit $rc, $rows rows with equal gradients: $out"; fail=1
fi
# Data parallel: remat launch passes torchrun's environment; bench --nproc 2 reports each strategy, with the
# gradients equal across the ranks.
check launch-env 0 "1 2 127.0.0.1" -- "$remat" launch --nproc-per-node 2 --master-port 0 -- sh -c 'test "$RANK" = 1 && echo "$RANK $WORLD_SIZE $MASTER_ADDR"; true'
check launch-fail nonzero "" -- "$remat" launch --nproc-per-node 2 --master-port 0 -- sh -c 'exit 3'
check launch-no-command nonzero "command" -- "$remat" launch --nproc-per-node 2
out=$("$remat" bench --nproc 2 --model mlp --depth 3 --width 16 --batch 8 --strategy none,all,all-reentrant,sqrt --steps 2 --warmup 1 2>&1)
rc=$?
rows=$(grep -cE '^(none|all|all-reentrant|sqrt) .* equal' <<<"$out")
if [ $rc -eq 0 ] && [ "$rows" = 4 ] && grep -q "2 processes (Gloo, loopback), global batch 8" <<<"$out"; then
  echo "ok   bench-nproc"
else
  echo "FAIL bench-nproc: exit $rc, $rows rows with gradients equal across ranks: $out"; fail=1
fi
check bench-nproc-split nonzero "does not split evenly over 3 processes" -- "$remat" bench --nproc 3 --model mlp --depth 2 --width 8 --batch 4 --steps 1
# Sub-layer stages: the selective preset recomputes attention cores only, its gradients equal none's.
check selective 0 "equal" -- "$remat" bench --model bert --layers 2 --hidden 32 --heads 2 --intermediate 64 --seq 16 --batch 2 --granularity sublayer --strategy selective --steps 1 --warmup 0
check selective-layer nonzero "this chain has none" -- "$remat" bench --model bert --layers 2 --hidden 32 --heads 2 --intermediate 64 --seq 16 --batch 2 --strategy selective --steps 1 --warmup 0
check granularity-mlp nonzero "no sub-layer stages" -- "$remat" bench --model mlp --granularity sublayer --steps 1
# --keep matmul: the profile shows what Fk keeps, and a plan at a middle budget keeps the matrix multiplications
# of some layer (Fk) with gradients equal to none's.
check profile-keep 0 "Fk kept MiB" -- "$remat" profile --model bert --layers 2 --hidden 32 --heads 2 --intermediate 64 --seq 16 --batch 2 --keep matmul --repeats 1
keepchain=$(mktemp)
cat >"$keepchain" <<'EOF'
{"input_bytes": 100, "keep": ["matmul"], "stages": [
 {"name": "l0", "fwd_ms": 10, "bwd_ms": 20, "output_bytes": 100, "saved_bytes": 1000, "keep_saved_bytes": 200, "keep_fwd_ms": 10, "keep_bwd_ms": 22},
 {"name": "l1", "fwd_ms": 10, "bwd_ms": 20, "output_bytes": 100, "saved_bytes": 1000, "keep_saved_bytes": 200, "keep_fwd_ms": 10, "keep_bwd_ms": 22},
 {"name": "l2", "fwd_ms": 10, "bwd_ms": 20, "output_bytes": 100, "saved_bytes": 1000, "keep_saved_bytes": 200, "keep_fwd_ms": 10, "keep_bwd_ms": 22}]}
EOF
check plan-keep 0 "schedule: Fk0 Fk1 Fa2 L B2 B1 B0" -- "$remat" plan --chain "$keepchain" --budget 2000
check plan-keep-json 0 '"keep": [' -- "$remat" plan --chain "$keepchain" --budget 2000 --json
rm -f "$keepchain"
out=$("$remat" bench --model bert --layers 2 --hidden 32 --heads 2 --intermediate 64 --seq 16 --batch 2 --keep matmul --strategy all-keep-matmul,optimal:overhead=0.5 --steps 1 --warmup 0 2>&1)
rc=$?
rows=$(grep -cE '^(all-keep-matmul|optimal:overhead=0.5) .* equal ' <<<"$out")
if [ $rc -eq 0 ] && [ "$rows" = 2 ]; then echo "ok   bench-keep"; else echo "FAIL bench-keep: exit $rc: $out"; fail=1; fi
# --policy: the profile measures each stage under a policy preset, plans may run stages as Fk[NAME], and
# --exclude or a strategy's /no-Fk[NAME] keeps them from it.
check profile-policy 0 "Fk[matmuls] kept MiB" -- "$remat" profile --model bert --layers 2 --hidden 32 --heads 2 --intermediate 64 --seq 16 --batch 2 --policy matmuls --repeats 1
check bad-policy nonzero "'bogus' is not a policy preset" -- "$remat" plan --model mlp --depth 2 --width 8 --policy matmuls,bogus --budget 1MiB
policychain=$(mktemp)
cat >"$policychain" <<'EOF'
{"input_bytes": 100, "policies": ["matmuls"], "stages": [
 {"name": "l0", "fwd_ms": 10, "bwd_ms": 20, "output_bytes": 100, "saved_bytes": 1000, "policies": [{"policy": "matmuls", "saved_bytes": 200, "fwd_ms": 10, "bwd_ms": 22}]},
 {"name": "l1", "fwd_ms": 10, "bwd_ms": 20, "output_bytes": 100, "saved_bytes": 1000, "policies": [{"policy": "matmuls", "saved_bytes": 200, "fwd_ms": 10, "bwd_ms": 22}]},
 {"name": "l2", "fwd_ms": 10, "bwd_ms": 20, "output_bytes": 100, "saved_bytes": 1000, "policies": [{"policy": "matmuls", "saved_bytes": 200, "fwd_ms": 10, "bwd_ms": 22}]}]}
EOF
check plan-policy 0 "schedule: Fk0[matmuls] Fk1[matmuls] Fa2 L B2 B1 B0" -- "$remat" plan --chain "$policychain" --budget 2000
check plan-policy-json 0 '"stages_fk": 2' -- "$remat" plan --chain "$policychain" --budget 2000 --json
check plan-exclude 0 "schedule: Fc0 Fc1 Fa2 L B2 Fa1 B1 Fa0 B0" -- "$remat" plan --chain "$policychain" --budget 2000 --exclude 'Fk[matmuls]'
check plan-no-fk 0 "schedule: Fc0 Fc1 Fa2 L B2 Fa1 B1 Fa0 B0" -- "$remat" plan --chain "$policychain" --budget 2000 --planner 'optimal/no-Fk'
check plan-all-policy 0 "schedule: Fk0[matmuls] Fk1[matmuls] Fk2[matmuls] L" -- "$remat" plan --chain "$policychain" --planner all-policy-matmuls
check bad-exclude nonzero "cannot exclude 'Fq'" -- "$remat" plan --chain "$policychain" --budget 2000 --exclude Fq
check all-policy-unprofiled nonzero "attention_core" -- "$remat" plan --chain "$policychain" --planner all-policy-attention_core
rm -f "$policychain"
# --offload lets the per-layer planner offload (stages profiled for it); --max-host bounds the host memory.
offchain=$(mktemp)
cat >"$offchain" <<'EOF'
{"input_bytes": 100, "to_host_gb_per_s": 1000, "to_device_gb_per_s": 1000, "stages": [
 {"name": "l0", "fwd_ms": 10, "bwd_ms": 20, "output_bytes": 100, "saved_bytes": 1000, "offload": {"bytes": 900, "input": true}},
 {"name": "l1", "fwd_ms": 10, "bwd_ms": 20, "output_bytes": 100, "saved_bytes": 1000, "offload": {"bytes": 900, "input": true}},
 {"name": "l2", "fwd_ms": 10, "bwd_ms": 20, "output_bytes": 100, "saved_bytes": 1000, "offload": {"bytes": 900, "input": true}}]}
EOF
check plan-offload 0 "schedule: Fa0@host Fa1@host Fa2 L B2 B1 B0" -- "$remat" plan --chain "$offchain" --planner per-layer --budget 2500 --offload
check plan-offload-json 0 '"host_peak_bytes": 2000' -- "$remat" plan --chain "$offchain" --planner per-layer --budget 2500 --offload --json
check plan-no-offload 0 "schedule: Fc0 Fa1 Fa2 L B2 B1 Fa0 B0" -- "$remat" plan --chain "$offchain" --planner per-layer --budget 2500
check plan-max-host 0 "schedule: Fa0@host Fa1 Fa2 L B2 B1 B0" -- "$remat" plan --chain "$offchain" --planner per-layer --budget 2500 --offload --max-host 1000
check offload-optimal nonzero "only the per-layer planner plans offloading" -- "$remat" plan --chain "$offchain" --budget 2500 --offload
check max-host-alone nonzero "needs --offload" -- "$remat" plan --chain "$offchain" --planner per-layer --budget 2500 --max-host 1000
# --threads: the per-layer planner's threads; the plan is the same for any count.
check plan-threads 0 "schedule: Fa0@host Fa1@host Fa2 L B2 B1 B0" -- "$remat" plan --chain "$offchain" --planner per-layer --budget 2500 --offload --threads 3
check plan-threads-negative nonzero "--threads" -- "$remat" plan --chain "$offchain" --planner per-layer --budget 2500 --threads -1
rm -f "$offchain"
# A model profiled for offloading: the bandwidths, each way's costs, the executor's holding of outputs; plan
# --offload on a model profiles for it by itself.
offprofile=$(mktemp)
check profile-offload 0 "" -- "$remat" profile --model mlp --depth 3 --width 128 --batch 64 --repeats 1 --policy matmuls --offload-min-bytes 16KiB --json "$offprofile"
for key in '"to_host_gb_per_s"' '"holds_outputs": true' '"checkpoint_offload"' '"offload": {'; do
  if grep -qF -- "$key" "$offprofile"; then echo "ok   profile-offload-$key"; else echo "FAIL profile-offload: no $key in $(cat "$offprofile")"; fail=1; fi
done
rm -f "$offprofile"
check plan-offload-model 0 "schedule:" -- "$remat" plan --model mlp --depth 3 --width 128 --batch 64 --planner per-layer --budget 1GiB --offload
out=$("$remat" bench --model bert --layers 2 --hidden 32 --heads 2 --intermediate 64 --seq 16 --batch 2 --policy matmuls --strategy all-policy-matmuls,all-policy-attention_core,optimal:overhead=0.5 --steps 1 --warmup 0 2>&1)
rc=$?
rows=$(grep -cE '^(all-policy-matmuls|all-policy-attention_core|optimal:overhead=0.5) .* equal ' <<<"$out")
if [ $rc -eq 0 ] && [ "$rows" = 3 ]; then echo "ok   bench-policy"; else echo "FAIL bench-policy: exit $rc: $out"; fail=1; fi
check profile-verdict 0 "verdict: checkpointing can save at most" -- "$remat" profile --model forum-cnn --batch 4 --repeats 1
# The sweep: 3 optimal points and the baselines, the optimal overheads never growing with the budget.
out=$("$remat" sweep --model mlp --depth 4 --width 16 --budgets 3 2>/dev/null)
opt=$(grep -c '^optimal ' <<<"$out")
increasing=$(grep '^optimal ' <<<"$out" | awk '{gsub("%","",$NF); if (NR > 1 && $NF + 0 > prev + 1e-9) bad = 1; prev = $NF + 0} END {print bad + 0}')
if [ "$opt" = 3 ] && [ "$increasing" = 0 ] && grep -q '^baseline  none' <<<"$out" && grep -q '^baseline  sqrt' <<<"$out"; then
  echo "ok   sweep"
else
  echo "FAIL sweep: $opt optimal rows, increasing=$increasing: $out"; fail=1
fi

# Bad input: one line, non-zero exit, naming the value.
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
# The frontier plot: remat sweep --plot draws a PNG through scripts/plot_tradeoff.py, the plain curve and, with
# --frontier, compare.py --frontier's points (a hand-made compare.json with one PyTorch option here).
cat >"$tmp/frontier.json" <<'JSON'
{"remat": {"rows": [{"strategy": "none", "peak_bytes": 4000000, "time_ratio": 1.0},
                    {"strategy": "all", "peak_bytes": 1000000, "time_ratio": 1.3}]},
 "frontier": [{"library": "PyTorch", "strategy": "uniform:2", "peak_bytes": 2000000, "time_ratio": 1.2,
               "remat_peak_bytes": 1900000, "remat_time_ratio": 1.08}]}
JSON
for mode in curve frontier; do
  extra=()
  [ "$mode" = frontier ] && extra=(--frontier "$tmp/frontier.json")
  if "$remat" sweep --model mlp --depth 4 --width 16 --budgets 3 --plot "$tmp/$mode.png" "${extra[@]}" >/dev/null 2>&1 &&
    [ "$(head -c 4 "$tmp/$mode.png" | tail -c 3)" = PNG ]; then
    echo "ok   sweep-plot-$mode"
  else
    echo "FAIL sweep-plot-$mode: no PNG at $tmp/$mode.png"; fail=1
  fi
done
# The step's picture: remat plan --plot draws it through python/remat/plot_step.py, its data beside it.
if "$remat" plan --model mlp --depth 4 --width 16 --budget 256KiB --planner per-layer --plot "$tmp/step.png" \
    >/dev/null 2>&1 && [ "$(head -c 4 "$tmp/step.png" | tail -c 3)" = PNG ] &&
  grep -q '"budget_bytes": 262144' "$tmp/step.png.json" && grep -q '"op": "B(after)"' "$tmp/step.png.plain.json"; then
  echo "ok   plan-plot"
else
  echo "FAIL plan-plot: no picture or data at $tmp/step.png"; fail=1
fi
# Progress: where stderr is not a terminal no bar is drawn and the profile's time is said by phase; on one
# (script(1) gives the command a pseudo-terminal), a bar is drawn and erased; REMAT_PROGRESS=0 turns it off.
progress_cmd=("$remat" plan --model mlp --depth 3 --width 16 --budget 256KiB --planner per-layer)
piped=$(REMAT_PROGRESS= "${progress_cmd[@]}" 2>&1 >/dev/null)
if grep -qE '^remat: profiled 3 stages in [0-9.]+ s \(forward without saving [0-9.]+ s, forward and backward [0-9.]+ s, checkpointed [0-9.]+ s\)$' <<<"$piped" &&
  ! grep -q $'\r' <<<"$piped"; then
  echo "ok   progress-piped"
else
  echo "FAIL progress-piped: $piped"; fail=1
fi
if command -v script >/dev/null; then
  for forced in "" 0; do
    script -qfec "env REMAT_PROGRESS=$forced ${progress_cmd[*]}" "$tmp/tty.txt" >/dev/null 2>&1 </dev/null
    drawn=$(grep -c 'remat: profiling \[#*\.*\] ' "$tmp/tty.txt")
    erased=$(grep -c $'\e\\[Kremat: profiled 3 stages' "$tmp/tty.txt")
    if { [ -z "$forced" ] && [ "$drawn" -gt 0 ] && [ "$erased" = 1 ]; } || { [ "$forced" = 0 ] && [ "$drawn" = 0 ]; }; then
      echo "ok   progress-terminal${forced:+-off}"
    else
      echo "FAIL progress-terminal${forced:+-off}: drawn $drawn, erased $erased: $(cat -v "$tmp/tty.txt")"; fail=1
    fi
  done
  # A plan that runs past half a second says it is planning, with its time, and the line is erased once planned
  # (a chain of 200 stages for the optimal program at 1,000 slots: about 2 s here).
  stages=$(for i in $(seq 0 199); do printf '{"fwd_ms": %d, "bwd_ms": 2, "output_bytes": %d, "saved_bytes": 3000},' \
    $((1 + i % 3)) $((1000 + 7 * (i % 5))); done)
  printf '{"input_bytes": 1000, "stages": [%s]}\n' "${stages%,}" >"$tmp/long.json"
  script -qfec "env REMAT_PROGRESS= $remat plan --chain $tmp/long.json --planner optimal --budget 60000 --slots 1000" \
    "$tmp/tty.txt" >/dev/null 2>&1 </dev/null
  if grep -qE $'\e\\[Kremat: planning: 00:0[0-9]' "$tmp/tty.txt" &&
    grep -qE $'\e\\[Kremat: planned 200 stages in' "$tmp/tty.txt"; then
    echo "ok   planning-terminal"
  else
    echo "FAIL planning-terminal: $(cat -v "$tmp/tty.txt")"; fail=1
  fi
fi
check plan-plot-no-script nonzero "is not there" -- env REMAT_STEP_PLOT_SCRIPT=/nonexistent/plot.py "$remat" plan --model mlp --depth 4 --width 16 --budget 256KiB --planner per-layer --plot "$tmp/x.png"
check sweep-plot-no-script nonzero "is not there" -- env REMAT_PLOT_SCRIPT=/nonexistent/plot.py "$remat" sweep --model mlp --depth 4 --width 16 --budgets 3 --plot "$tmp/x.png"
good='{"input_bytes": 1000, "stages": [{"fwd_ms": 1, "bwd_ms": 2, "output_bytes": 1000, "saved_bytes": 3000}]}'
bad_chain() {  # bad_chain NAME NEEDLE JSON
  printf '%s' "$3" >"$tmp/$1.json"
  check "chain-$1" nonzero "$2" -- "$remat" plan --chain "$tmp/$1.json" --budget 1MiB
}
bad_chain malformed "malformed JSON" '{"input_bytes": 1000, "stages": ['
bad_chain no-stages '"stages" must be an array' '{"input_bytes": 1000}'
bad_chain missing-key 'has no "bwd_ms"' '{"input_bytes": 1, "stages": [{"fwd_ms": 1, "output_bytes": 1, "saved_bytes": 1}]}'
bad_chain wrong-type '"fwd_ms" must be a number, got "fast"' '{"input_bytes": 1, "stages": [{"fwd_ms": "fast", "bwd_ms": 1, "output_bytes": 1, "saved_bytes": 1}]}'
bad_chain negative "negative output_bytes (-5)" '{"input_bytes": 1, "stages": [{"fwd_ms": 1, "bwd_ms": 1, "output_bytes": -5, "saved_bytes": 1}]}'
bad_chain fraction "whole number of bytes, got 1.5" '{"input_bytes": 1.5, "stages": [{"fwd_ms": 1, "bwd_ms": 1, "output_bytes": 1, "saved_bytes": 1}]}'
bad_chain overflow "is too large (18446744073709551615)" '{"input_bytes": 18446744073709551615, "stages": [{"fwd_ms": 1, "bwd_ms": 1, "output_bytes": 1, "saved_bytes": 1}]}'
bad_chain huge "2^60" '{"input_bytes": 9000000000000000000, "stages": [{"fwd_ms": 1, "bwd_ms": 1, "output_bytes": 1, "saved_bytes": 1}]}'
bad_chain slow "too large a fwd_ms" '{"input_bytes": 1, "stages": [{"fwd_ms": 1e300, "bwd_ms": 1, "output_bytes": 1, "saved_bytes": 1}]}'
bad_chain saved-below-output "saved_bytes (1) < output_bytes (9)" '{"input_bytes": 1, "stages": [{"fwd_ms": 1, "bwd_ms": 1, "output_bytes": 9, "saved_bytes": 1}]}'
bad_chain empty "no stages" '{"input_bytes": 1, "stages": []}'
printf '%s' "$good" >"$tmp/good.json"
check chain-good 0 "predicted" -- "$remat" plan --chain "$tmp/good.json" --budget 1MiB
# A chain inside a model: the whole step as a chain of n+2 stages (prefix, chain, suffix with the loss).
step='{"input_bytes": 100, "stages": [{"name": "stem", "fwd_ms": 1, "bwd_ms": 1, "output_bytes": 1000, "saved_bytes": 1500},
  {"fwd_ms": 1, "bwd_ms": 2, "output_bytes": 1000, "saved_bytes": 3000},
  {"fwd_ms": 1, "bwd_ms": 2, "output_bytes": 1000, "saved_bytes": 3000},
  {"name": "head", "fwd_ms": 1, "bwd_ms": 1, "output_bytes": 4, "saved_bytes": 600}]}'
printf '%s' "$step" >"$tmp/step.json"
check step-text 0 "predicted peak of the whole step" -- "$remat" plan --step "$tmp/step.json" --planner all
step_json=$("$remat" plan --step "$tmp/step.json" --planner all --json 2>/dev/null)
step_peak=$(printf '%s' "$step_json" | python3 -c 'import json,sys; j=json.load(sys.stdin); print(j["step_predicted_peak_bytes"] - j["predicted_peak_bytes"])')
# The step keeps the stem's 1500 saved bytes and the model input (100) below the chain, whose own input
# (1000) is the stem's output: the step's peak is above the chain's.
if [ "${step_peak:-0}" -gt 0 ] 2>/dev/null; then
  echo "ok   step-peak ($step_peak bytes above the chain's)"
else
  echo "FAIL step-peak: the step's peak is not above the chain's: $step_json"; fail=1
fi
check step-mismatch nonzero "has 4 stages, but the chain has 1" -- "$remat" plan --chain "$tmp/good.json" --step "$tmp/step.json" --planner all
check negative-budget nonzero "'-5MiB' is not a size" -- "$remat" plan --chain "$tmp/good.json" --budget -5MiB
check nan-budget nonzero "is not a size" -- "$remat" plan --chain "$tmp/good.json" --budget nan
check overflow-budget nonzero "too large" -- "$remat" plan --chain "$tmp/good.json" --budget 99999999999TiB
check bad-unit nonzero "unknown unit" -- "$remat" plan --chain "$tmp/good.json" --budget 5furlongs
check bad-segments nonzero "uniform:0" -- "$remat" bench --model mlp --depth 3 --width 16 --strategy uniform:0 --steps 1
check bad-uniform nonzero "whole number" -- "$remat" bench --model mlp --depth 3 --width 16 --strategy uniform:x --steps 1
check bad-depth nonzero "--depth" -- "$remat" bench --model mlp --depth 0
check bad-width nonzero "--width" -- "$remat" bench --model mlp --width -3
check bad-batch nonzero "--batch" -- "$remat" bench --model mlp --batch -1
check bad-slots nonzero "--slots" -- "$remat" plan --chain "$tmp/good.json" --budget 1MiB --slots 0
check bad-planner nonzero "unknown" -- "$remat" plan --chain "$tmp/good.json" --budget 1MiB --planner fastest
check unwritable-json nonzero "cannot write" -- "$remat" plan --chain "$tmp/good.json" --budget 1MiB --out /nonexistent/dir/plan.json
check unwritable-csv nonzero "/nonexistent/dir" -- "$remat" sweep --chain "$tmp/good.json" --budgets 3 --csv /nonexistent/dir/curve.csv
check max-batch-nothing-fits nonzero "not even a batch of 1 fits" -- "$remat" max-batch --model mlp --depth 2 --width 16 --budget 1KiB --strategy none,all
exit $fail
