#!/usr/bin/env bash
# Issue 13's figures (and issue 12's teacher-forced ones) in one run, at one commit:
#   1. `clm eval answers` on the nine held-out files: retention, gold-answer log-likelihood,
#      greedy hits, reply_nll, lifecycle share and invented tokens, per file and OVERALL;
#   2. the same on the two tuning sessions (SGD and MultiWOZ);
#   3. the 200-turn long-message session under clm and truncate (lifecycle share, hit rate).
#
#   bash docs/bench_retention.sh [OUT]      (default OUT: docs/bench/retention_run)
#
# Budget 1024, teacher-forced, default settings (`--tagging auto`). Hours on 2 cores.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="${1:-docs/bench/retention_run}"
CLM="${CLM:-.venv/bin/clm}"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
mkdir -p "$OUT"
echo "commit $(git rev-parse --short HEAD), started $(date -u +%Y-%m-%dT%H:%MZ)" >"$OUT/run.txt"
"$CLM" eval answers examples/retention/heldout/*.jsonl --budget 1024 --tagging auto \
    --report "$OUT/answers_heldout.json" --markdown "$OUT/answers_heldout.md"
"$CLM" eval answers examples/retention/sgd_session_10.jsonl examples/retention/multiwoz_session_10.jsonl \
    --budget 1024 --tagging auto --report "$OUT/answers_tuning.json" --markdown "$OUT/answers_tuning.md"
LONG=examples/retention/heldout/long/chitchat_200.jsonl
"$CLM" replay "$LONG" --mode clm --budget 1024 --teacher-force --quiet --report "$OUT/long_clm.json"
"$CLM" replay "$LONG" --mode truncate --budget 1024 --teacher-force --quiet --report "$OUT/long_truncate.json"
echo "finished $(date -u +%Y-%m-%dT%H:%MZ)" >>"$OUT/run.txt"
