#!/usr/bin/env bash
# The GPU check: the tests that exercise CUDA first (tests/test_devices.py: exactness, replay, the drafter
# stream's ordering against weight changes, staged inputs, sampling and timing on the device), then
# `prune bench` of the demo pair on cuda in bfloat16 and float32 and the measured overlap of the verify and
# packed passes, and the same bench in bfloat16 with draft trees (`--tree-branches 2`, decode/tree.py), as one
# table. About 5 minutes on one H200; each part has a time limit, so the whole stays under 8 minutes
# (2 + 2 x 2 + 1.5). Needs the demo target already cached (no network on a GPU box): copy the
# cache folder ($D3D_PRUNE_CACHE or ~/.cache/d3d-prune, the `targets/` and `suites` parts) there first, or
# set D3D_PRUNE_CACHE to a copy of it.
#
#   bash scripts/gpu-check.sh            (OUT=dir to keep the JSON reports; default a temporary folder)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
PRUNE=${PRUNE:-.venv/bin/prune}
OUT=${OUT:-$(mktemp -d)}
mkdir -p "$OUT"

echo "== tests on cuda (CPU cases run too; nothing may skip for want of a GPU)"
set +e
timeout 120 $PY -m pytest -q -rs -p no:cacheprovider tests/test_devices.py tests/test_masks.py tests/test_lean.py \
    tests/test_decoders.py 2>&1 | tee "$OUT/tests.txt"
status=${PIPESTATUS[0]}
set -e
if grep -q "torch sees no CUDA" "$OUT/tests.txt"; then echo "gpu-check: torch sees no GPU" >&2; exit 1; fi
if [ "$status" -ne 0 ]; then echo "gpu-check: the tests failed or ran past 2 minutes (exit $status)" >&2; exit 1; fi

for dtype in bfloat16 float32; do
    echo "== prune bench on cuda, $dtype"
    timeout 120 $PRUNE bench --device cuda --dtype "$dtype" --decoder all --suite humaneval:eval --limit 10 \
        --max-new-tokens 128 --json "$OUT/bench-$dtype.json" > "$OUT/bench-$dtype.txt" \
        || { echo "gpu-check: prune bench ($dtype) failed or ran past 2 minutes (exit $?)" >&2; exit 1; }
    cat "$OUT/bench-$dtype.txt"
done
echo "== prune bench on cuda, bfloat16, draft trees"
timeout 90 $PRUNE bench --device cuda --dtype bfloat16 --decoder ar,sync,async --tree-branches 2 \
    --suite humaneval:eval --limit 10 --max-new-tokens 128 --json "$OUT/bench-tree.json" > "$OUT/bench-tree.txt" \
    || { echo "gpu-check: prune bench (trees) failed or ran past 1.5 minutes (exit $?)" >&2; exit 1; }
cat "$OUT/bench-tree.txt"

echo "== one table"
$PY - "$OUT" <<'PY'
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
print(f"{'dtype':9} {'decoder':9} {'tau':>6} {'ms/token':>9} {'speedup':>8} {'predicted':>9} {'exact':>6} {'limit':>6}")
for dtype, part in (("bfloat16", "bfloat16"), ("float32", "float32"), ("bf16+tree", "tree")):
    report = json.loads((out / f"bench-{part}.json").read_text())
    decoders = report.get("decoders") or report["drafters"][0]["decoders"]
    for name, d in decoders.items():
        cells = [d.get(k) for k in ("tau_macro", "time_per_token_ms", "speedup_vs_ar", "predicted_speedup",
                                    "exact_match_vs_ar", "speedup_limit")]
        text = ["-" if c is None else (str(c) if isinstance(c, bool) else f"{c:.2f}") for c in cells]
        print(f"{dtype:9} {name:9} {text[0]:>6} {text[1]:>9} {text[2]:>8} {text[3]:>9} {text[4]:>6} {text[5]:>6}")
    times = report["settings"].get("pass_times")
    if times:
        print(f"{dtype:9} pass times (ms): " + ", ".join(f"{k} {v:.2f}" for k, v in times.items()))
PY
