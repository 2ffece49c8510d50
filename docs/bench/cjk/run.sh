#!/bin/bash
# Chinese and Japanese chats (and the English translation of the Chinese one), written for
# this project by a helper's sweep: budget 384, teacher-forced, default settings; facts
# retained per the probes beside each file
for f in zh ja en; do
  HF_HUB_OFFLINE=1 OMP_NUM_THREADS=2 .venv/bin/clm replay docs/bench/cjk/$f.jsonl --mode clm --budget 384 \
    --teacher-force --report /tmp/cjk_$f.json > /dev/null 2>&1
  python3 -c "
import json, sys
r = json.load(open('/tmp/cjk_$f.json')); t = r['totals']
print('$f', 'facts', r['retention']['retained'], 'of', r['retention']['probes'], 'summaries ok/failed',
      t['summaries'], '/', t['summaries_failed'], 'reply_nll', round(t['reply_nll'], 4))"
done
