#!/usr/bin/env bash
# The main job on the bundled GPT-shaped example: plan the fault-free schedule and a failure,
# compare against plain re-routing, and draw both. Called by `make demo` as
#   bash examples/demo.sh .venv/bin out
set -euo pipefail
BIN=${1:-.venv/bin}
OUT=${2:-out}
SPEC=examples/gpt.toml
RP="$BIN/recycle-planner"
mkdir -p "$OUT"

echo "== fault-free plan of $SPEC"
"$RP" plan "$SPEC" -o "$OUT/gpt-fault-free.json"
echo
echo "== worker 1:3 dies: re-route its micro-batches to the stage-3 peers (all mechanisms on)"
"$RP" plan "$SPEC" --fail 1:3 -o "$OUT/gpt-fail-1-3.json"
echo
echo "== the same failure with plain re-routing (fused backward, global barrier)"
"$RP" plan "$SPEC" --fail 1:3 --no-decouple --no-stagger -o "$OUT/gpt-fail-1-3-plain.json"
"$BIN/python" - "$OUT/gpt-fail-1-3.json" "$OUT/gpt-fail-1-3-plain.json" <<'EOF'
import json, sys
recycle, plain = (json.load(open(path))["metrics"]["period"] for path in sys.argv[1:])
print(f"(each degradation is against its own policy's fault-free period; the two plans of this "
      f"failure: {recycle:.4g} ms with ReCycle's mechanisms, {plain:.4g} ms plain, "
      f"{1 - recycle / plain:.0%} shorter)")
EOF
echo
"$RP" validate "$OUT/gpt-fail-1-3.json"
"$RP" show "$OUT/gpt-fail-1-3.json" --max-workers 16 --no-critical-path | tail -n 20
"$RP" gantt "$OUT/gpt-fail-1-3.json" --compare "$OUT/gpt-fault-free.json" -o "$OUT/gpt-fail-1-3.png"
"$RP" gantt "$OUT/gpt-fail-1-3-plain.json" --compare "$OUT/gpt-fail-1-3.json" --max-workers 16 \
    -o "$OUT/gpt-plain-vs-recycle.png"
"$RP" export-torch "$OUT/gpt-fault-free.json" -o "$OUT/gpt-fault-free-torch.csv"
echo
echo "== the plan library: the best plan for every situation with up to 2 dead workers"
"$RP" plan-all "$SPEC" --max-failures 2 --solver auto -o "$OUT/gpt-plans"
"$RP" report "$OUT/gpt-plans" -o "$OUT/gpt-plans-degradation.png" | tail -n 1
echo
echo "== a launcher looks up the workers that are actually dead"
"$RP" lookup "$OUT/gpt-plans" --fail 2:5 --fail 0:1
echo
echo "== ... or takes every rank's program: its compute, peers and message order (docs/programs.md)"
"$RP" program "$OUT/gpt-plans" --fail 2:5 --fail 0:1 -o "$OUT/gpt-programs"
echo
echo "plans, pictures, the plan library, per-rank programs and the torch CSV are in $OUT/"

echo
echo "== the executor: measure the tiny MLP of examples/tiny_mlp.py on this machine"
TINY=examples/tiny_mlp.py:make_job
"$RP" profile "$TINY" --pipelines 2 --microbatches 4 --name tiny-mlp -o "$OUT/tiny.toml"
# the profile differs from run to run, so its library is rebuilt (--force) rather than resumed
"$RP" plan-all "$OUT/tiny.toml" --max-failures 2 --force -o "$OUT/tiny-plans" | tail -n 4
echo
echo "== train it on 4 CPU processes (2 stages x 2 pipelines), nothing fails"
# --start-over: a run folder belongs to one run; the demo's earlier run there is replaced
"$RP" launch -n 4 --run-dir "$OUT/tiny-fault-free" --start-over "$TINY" -- --library "$OUT/tiny-plans" \
    --iterations 30
echo
echo "== the same training; worker 1:0 (rank 2) is killed mid-forward in iteration 10"
"$RP" launch -n 4 --run-dir "$OUT/tiny-killed" --start-over --inject-fault 2:10:F1 "$TINY" -- \
    --library "$OUT/tiny-plans" --iterations 30
echo
echo "== no library at all: every situation is planned when first met (here two dead workers)"
rm -rf "$OUT/tiny-no-library"
"$RP" launch -n 4 --run-dir "$OUT/tiny-no-library" --spec "$OUT/tiny.toml" \
    --inject-fault 2:10:F1 --inject-fault 1:15:I0 "$TINY" -- --iterations 30
echo
echo "== the final parameters and losses equal the fault-free run's and one process's"
"$BIN/python" examples/compare_runs.py "$OUT/tiny-fault-free" "$OUT/tiny-killed" \
    --reference "$TINY" -- --iterations 30
"$BIN/python" examples/compare_runs.py "$OUT/tiny-fault-free" "$OUT/tiny-no-library" \
    --reference "$TINY" -- --iterations 30
