#!/usr/bin/env bash
# The small GPT of examples/gpt_small.py end to end on this machine: profile its stages, plan
# the library for one failure, train it fault-free and with worker 1:0 killed mid-forward,
# compare the runs, and draw both loss curves (they coincide). float64, so that the runs agree
# to rounding: the re-routed micro-batches' gradients are summed in another order, and in
# float32 Adam amplifies that to ~1e-3 relative in a few parameters after 20 steps.
# Further arguments go to the job: `--min-seq 32` draws each batch's length (shapes that vary
# with the data; the runs still agree).
#   bash examples/gpt_demo.sh .venv/bin out [JOB ARGS...]
set -euo pipefail
BIN=${1:-.venv/bin}
OUT=${2:-out}/gpt-small
RP="$BIN/recycle-planner"
JOB=examples/gpt_small.py:make_job
ARGS=(--dtype float64 "${@:3}")
ITER=${ITER:-40}
mkdir -p "$OUT"
"$RP" profile "$JOB" --pipelines 2 --microbatches 4 --name gpt-small \
    -o "$OUT/gpt-small.toml" -- "${ARGS[@]}"
"$RP" plan-all "$OUT/gpt-small.toml" --max-failures 1 --force -o "$OUT/plans" | tail -n 3
"$RP" launch -n 4 --run-dir "$OUT/fault-free" --start-over "$JOB" -- --library "$OUT/plans" \
    --iterations "$ITER" "${ARGS[@]}"
"$RP" launch -n 4 --run-dir "$OUT/killed" --start-over --inject-fault 2:$((ITER / 2)):F1 "$JOB" -- \
    --library "$OUT/plans" --iterations "$ITER" "${ARGS[@]}"
"$BIN/python" examples/compare_runs.py "$OUT/fault-free" "$OUT/killed" --rtol 1e-6
"$BIN/python" examples/plot_losses.py "$OUT/fault-free=fault-free" \
    "$OUT/killed=worker 1:0 killed" -o "$OUT/losses.png" \
    --title "small GPT, 2 stages x 2 pipelines, byte-level, stdlib source"
echo "loss curves in $OUT/losses.png"
