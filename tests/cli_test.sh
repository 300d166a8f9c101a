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
for cmd in bench profile plan max-batch sweep demo; do
  check "help-$cmd" 0 "--model" -- "$remat" "$cmd" --help
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
check bench-table 0 "grads" -- "$remat" bench --model mlp --depth 3 --width 16 --batch 4 --strategy none,all,sqrt --steps 1 --warmup 1
check profile-verdict 0 "verdict: checkpointing can save at most" -- "$remat" profile --model forum-cnn --batch 4 --repeats 1
check sweep 0 "optimal" -- "$remat" sweep --model mlp --depth 4 --width 16 --budgets 3
exit $fail
