#!/bin/bash
# the default settings on the 11 retention files, two at a time (budget 1024, teacher-forced):
# reply_nll, facts, compactions, prefill and hit rate per file
files="examples/retention/sgd_session_10.jsonl examples/retention/multiwoz_session_10.jsonl $(ls examples/retention/heldout/*.jsonl)"
for f in $files; do echo "$f"; done |
  xargs -P 2 -L 1 bash -c 'OMP_NUM_THREADS=1 .venv/bin/python docs/bench_lifecycle_variants.py $0 2>/dev/null | head -1 | sed "s|^|$(basename $0 .jsonl) |"'
