#!/usr/bin/env bash
# The pruning curve of a drafter, measured on held-out prompts: two `prune run`s on the default calibration
# (humaneval:calib, 16 prompts x 64 tokens, replay, LoRA heal on HEAL_DATA), one removing PER_STEP (default 3)
# layers per step up to 12 with the default 40-update heals, one removing 5 at once and healing it with AT5_HEAL_STEPS
# (default 160, as long as `prune heal`; its scoring round is the first one's, read from the score cache); then
# every step's drafter, healed and before its heal, against the unpruned one on the evaluation parts of the
# three suites (async, greedy, B = 16, replay of the target's float32 outputs, 128 tokens), as one table.
# About 110 minutes on 2 CPU cores with distilled heals; every part resumes or is skipped when its output exists.
#
#   bash scripts/pruning-curve.sh OUT [DRAFTER] [HEAL_DATA...]
#
# Defaults: the demo drafter, healed on its shipped mix (models/demo.py DEMO_HEAL_DATA, prune run's default);
# HEAL_DATA is one or more `prune distill` folders, each weighted 1.
#
# SUITES (default "humaneval champ mtbench") are the suites whose eval parts every drafter is measured on;
# the pre-heal drafters and the intermediate steps are measured on FULL_SUITE (default humaneval) only;
# COMPARE (default none) names more drafter folders to measure beside them on every suite.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:?usage: bash scripts/pruning-curve.sh OUT [DRAFTER] [HEAL_DATA...]}
DRAFTER=${2:-models/demo_drafter}
HEAL_DATA=("${@:3}")
SUITES=${SUITES:-humaneval champ mtbench}
FULL_SUITE=${FULL_SUITE:-humaneval}
PER_STEP=${PER_STEP:-3}
AT5_HEAL_STEPS=${AT5_HEAL_STEPS:-160}
COMPARE=${COMPARE:-}
PY=${PYTHON:-.venv/bin/python}
PRUNE=${PRUNE:-.venv/bin/prune}
mkdir -p "$OUT"
HEAL=()
if [ ${#HEAL_DATA[@]} -gt 0 ]; then HEAL=(--heal-data "${HEAL_DATA[@]}"); fi
RUN=(--drafter "$DRAFTER" "${HEAL[@]}" --no-stop-on-speedup --min-retention 0.5 --speed-prompts 0 --no-wandb --resume)

echo "== prune run: $PER_STEP layers per step, 12 in all"
$PRUNE run --out "$OUT/steps" --layers-to-remove 12 --per-step "$PER_STEP" "${RUN[@]}" --json "$OUT/steps.json"
echo "== prune run: 5 layers at once"
$PRUNE run --out "$OUT/at5" --layers-to-remove 5 --per-step 5 --heal-steps "$AT5_HEAL_STEPS" "${RUN[@]}" \
    --json "$OUT/at5.json"
$PY scripts/curve_table.py preheal "$OUT/steps" "$OUT/at5"

for suite in $SUITES; do
    if [ ! -f "$OUT/ar-$suite.jsonl" ]; then
        echo "== the target's outputs on $suite:eval"
        $PRUNE bench --suite "$suite:eval" --decoder ar --dtype float32 --max-new-tokens 128 --save-outputs "$OUT/ar-$suite.jsonl.tmp"
        mv "$OUT/ar-$suite.jsonl.tmp" "$OUT/ar-$suite.jsonl"
    fi
    drafters=(--drafter "$DRAFTER" --drafter "$OUT/at5/step-01" --drafter "$OUT/steps/final")
    for folder in $COMPARE; do drafters+=(--drafter "$folder"); done
    if [ "$suite" = "$FULL_SUITE" ]; then
        mapfile -t extra < <($PY scripts/curve_table.py drafters "$OUT/steps" "$OUT/at5")
        for folder in "${extra[@]}"; do drafters+=(--drafter "$folder"); done
    fi
    if [ ! -f "$OUT/bench-$suite.json" ]; then
        echo "== held-out tau on $suite:eval (${#drafters[@]} / 2 drafters)"
        $PRUNE bench --suite "$suite:eval" --decoder async --verify replay --replay-batch 16 --max-new-tokens 128 \
            --ar-outputs "$OUT/ar-$suite.jsonl" "${drafters[@]}" --json "$OUT/bench-$suite.json.tmp" > /dev/null
        mv "$OUT/bench-$suite.json.tmp" "$OUT/bench-$suite.json"
    fi
done
$PY scripts/curve_table.py table "$OUT" "$DRAFTER" $SUITES | tee "$OUT/curve.md"
