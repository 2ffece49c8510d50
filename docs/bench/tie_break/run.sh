#!/bin/bash
# with tie_break.patch applied: every variant on the 11 retention files, two at a time
files="examples/retention/sgd_session_10.jsonl examples/retention/multiwoz_session_10.jsonl $(ls examples/retention/heldout/*.jsonl)"
for v in oldest newest asks both; do for f in $files; do echo "$v $f"; done; done |
  xargs -P 2 -L 1 bash -c 'CLM_TIE=$0 OMP_NUM_THREADS=1 .venv/bin/python docs/bench_lifecycle_variants.py $1 2>/dev/null | head -1 | sed "s/^/$0 /"'
