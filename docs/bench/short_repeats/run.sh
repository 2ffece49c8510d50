#!/bin/bash
# A 70-message generated chat (user turns of the held-out SGD session
# examples/retention/heldout/sgd_heldout_1.jsonl, CC BY-SA 4.0, with placeholder assistant
# lines, built by a helper's sweep) under clm at budget 1024 and under prefix (the bare
# model's context): how often the most common reply was given, and how many distinct replies
F=docs/bench/short_repeats/sgd_script_70.jsonl
for mode in clm prefix; do
  extra=$([ $mode = clm ] && echo "--budget 1024")
  HF_HUB_OFFLINE=1 OMP_NUM_THREADS=1 .venv/bin/clm replay $F --mode $mode $extra --max-new-tokens 48 \
    --on-error skip --report /tmp/short_repeats_$mode.json > /dev/null 2>&1
  python3 -c "
import collections, json
r = json.load(open('/tmp/short_repeats_$mode.json')); c = collections.Counter(t['reply'] for t in r['turns'])
reply, times = c.most_common(1)[0]
print('$mode', len(r['turns']), 'turns;', len(c), 'distinct replies; most common', times, 'times:', repr(reply[:60]))"
done
