#!/usr/bin/env bash
# Decoding before vs after, alternating rounds in one sitting (compare medians; run on a quiet machine).
#
#   benchmarks/translate_before_after.sh BASE_TREE WORKDIR DATA_DIR [ROUNDS]
#
# BASE_TREE: a checkout of the earlier release (e.g. `git worktree add ../base <commit>`); this tree is
# the after. WORKDIR: a trained Multi30k workdir. DATA_DIR: the Multi30k folder of
# `python -m transformer_jax.data.prepare multi30k --dir=DATA_DIR` (test.en is test2016).
# Both trees run with this tree's virtual environment (.venv); PYTHONPATH picks the tree.
# Prints JSON lines tagged {"tree": "before"|"after", "round": N}; evaluate.py outputs go to $OUT (a temp dir).
set -euo pipefail
BASE=$(cd "$1" && pwd); WORKDIR=$2; DATA=$3; ROUNDS=${4:-3}
AFTER=$(cd "$(dirname "$0")/.." && pwd); PY="$AFTER/.venv/bin/python"
OUT=${OUT:-$(mktemp -d)}; mkdir -p "$OUT"
run() {  # tree-name tree-path round: the fixed shapes, then test2016 through evaluate.py
  local name=$1 tree=$2 round=$3
  (cd "$tree" && PYTHONPATH="$tree" "$PY" -m transformer_jax.benchmarks.decoding --presets=tiny,base \
     --beam_size=4 --repeats=5 --peak_repeats=5) | sed "s/^{/{\"tree\": \"$name\", \"round\": $round, /"
  (cd "$tree" && PYTHONPATH="$tree" "$PY" evaluate.py --workdir="$WORKDIR" --split=test --beam_size=5 \
     --output_dir="$OUT/$name-$round" --overwrite) > "$OUT/$name-$round.json"
  "$PY" -c "import json,sys; r=json.loads(open(sys.argv[1]).read().split('\n\n')[0]); \
print(json.dumps({'tree': '$name', 'round': $round, 'measured': 'evaluate_test2016_beam5', \
**{k: r[k] for k in ('decode_seconds', 'sentences_per_second', 'multi30k_bleu', 'sacrebleu')}}))" \
    "$OUT/$name-$round.json"
}
for round in $(seq 1 "$ROUNDS"); do
  run before "$BASE" "$round"
  run after "$AFTER" "$round"
  # The translate command's path on the same file (after only): cold first pass and warm passes.
  (cd "$AFTER" && "$PY" -m transformer_jax.benchmarks.decoding --file="$DATA/test.en" \
     --workdir="$WORKDIR" --beam_size=5 --repeats=2) | sed "s/^{/{\"tree\": \"after\", \"round\": $round, /"
done
