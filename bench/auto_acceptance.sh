#!/usr/bin/env bash
# Issue 31's acceptance runs: per rank count, one `bench crossover --tune`, then RUNS x
# (bench/peers.py with that table; bench/peers.py with no table), every contender of ours,
# mpi4py and DeepSpeed's op (not gloo: not among the issue's contenders, and its threads stay
# busy after each call, slowing the next one), --json into OUT; then bench/peers_summary.py.
#     bash bench/auto_acceptance.sh OUT [RANKS...]        (default ranks: 2 4; RUNS=3)
# RUN_LENGTH=K: bench/peers.py --run-length K (each contender's turn K calls in a row, the last
# timed, as learning times them; default 1: single calls).
# TRACE=1: bench/peers_trace.py instead of bench/peers.py (the same timing, every sample kept in
# OUT/trace_*.jsonl with its slot stores and each rank's CPU: for a run that goes wrong).
# Needs the bench and bench-deepspeed extras.  Each line of OUT/log.txt says when it ran.
set -euo pipefail
out=${1:?usage: auto_acceptance.sh OUT [RANKS...]}; shift
ranks=("${@:-2}"); [ $# -eq 0 ] && ranks=(2 4)
runs=${RUNS:-3}
here=$(cd "$(dirname "$0")" && pwd)
mkdir -p "$out"
log="$out/log.txt"
stamp() { echo "== $(date -u +%H:%M:%S) $* (load $(cut -d' ' -f1 /proc/loadavg))" | tee -a "$log"; }
for n in "${ranks[@]}"; do
  table="$out/tune_$n.json"
  rm -f "$table"
  stamp "crossover --tune, $n ranks"
  AL_TUNING_FILE="$table" mpiexec -n "$n" python -m aluminum_py bench crossover --tune --quiet \
    --json "$out/crossover_$n.json" >> "$log" 2>&1
  for r in $(seq 1 "$runs"); do
    for t in table none; do
      stamp "peers.py, $n ranks, run $r, $([ $t = table ] && echo table || echo no table)"
      [ $t = table ] && tf="$table" || tf="$out/none.json"
      if [ -n "${TRACE:-}" ]; then
        prog=("$here/peers_trace.py" --trace "$out/trace_${t}_${n}_$r.jsonl")
      else
        prog=("$here/peers.py")
      fi
      AL_TUNING_FILE="$tf" mpiexec -n "$n" python "${prog[@]}" --algorithms all --no-gloo \
        --run-length "${RUN_LENGTH:-1}" --json "$out/peers_${t}_${n}_$r.json" >> "$log" 2>&1
    done
  done
done
stamp done
python "$here/peers_summary.py" "$out"/peers_*.json | tee -a "$log"
