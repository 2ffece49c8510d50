"""Teacher-forced reply_nll and facts retained under clm for LifecycleConfig variants.

The figures behind the ``recent_share`` / ``low_water`` choice in docs/lifecycle.md: one
session replayed teacher-forced under ``Conversation(config=LifecycleConfig(budget=...,
**overrides))``, default ``auto`` tagging, 48-token generation cap (unused: replies are
forced). Prints the token-weighted mean ``reply_nll``, the probes retained in the final
context, the number of compactions, the prefill tokens and the hit rate (cached ÷ prompt
tokens); then, from the first compaction on, the mean prompt and how much of it is the
content of the verbatim messages after the digest (the rest is the system block, the
digest and the chat glue).

    python docs/bench_lifecycle_variants.py examples/retention/sgd_session_10.jsonl '{"recent_share": 0.75}'
"""

from __future__ import annotations

import argparse
import json
import time

from clm_middleware import Conversation, Engine
from clm_middleware.evaluation.probes import read_probes, retention
from clm_middleware.lifecycle.config import LifecycleConfig
from clm_middleware.lifecycle.tagging import TaggingConfig
from clm_middleware.replay.runner import turn_plan
from clm_middleware.replay.transcript import read_jsonl
from clm_middleware.replay.transcript_text import message_text


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("transcript")
    parser.add_argument("overrides", nargs="?", default="{}", help="LifecycleConfig fields as JSON")
    parser.add_argument("--budget", type=int, default=1024)
    args = parser.parse_args()
    overrides = json.loads(args.overrides)
    config = LifecycleConfig(tagging=TaggingConfig(mode="auto"), budget=args.budget, **overrides)
    conversation = Conversation(Engine.from_pretrained(), config=config, max_new_tokens=48)
    nll_sum = tokens = compactions = prefill = prompt = 0.0
    split: list[tuple[int, int]] = []  # (prompt tokens, tokens of the messages after the fold) per turn
    started = time.perf_counter()
    for before, answer in turn_plan(read_jsonl(args.transcript)[0]):
        for message in before:
            conversation.add(message.role, message_text(message))
        if answer is None:
            break
        stats = conversation.respond(forced_reply=message_text(answer)).stats
        nll_sum += stats.reply_nll * stats.forced_tokens
        tokens += stats.forced_tokens
        compactions += bool(stats.compaction)
        prefill += stats.prefill_tokens
        prompt += stats.prompt_tokens
        if compactions:  # from the first compaction on: how the prompt splits
            window = conversation.history[conversation.fold :]
            verbatim = sum(len(conversation.segment(s).visible_ids) for m in window for s in m.segment_ids)
            split.append((stats.prompt_tokens, verbatim))
    probes = read_probes(args.transcript.replace(".jsonl", ".probes.json"))
    kept, _ = retention(probes, conversation.context)
    print(
        f"{args.transcript} {overrides}: reply_nll {nll_sum / tokens:.4f}, facts {kept}/{len(probes)}, "
        f"compactions {compactions:.0f}, prefill {prefill:.0f}, hit rate {1 - prefill / prompt:.1%}, "
        f"{time.perf_counter() - started:.0f} s"
    )
    if split:
        mean_prompt = sum(p for p, _ in split) / len(split)
        mean_verbatim = sum(v for _, v in split) / len(split)
        print(
            f"from the first compaction on ({len(split)} turns): mean prompt {mean_prompt:.0f} tokens, "
            f"of them {mean_verbatim:.0f} the content of the verbatim messages after the digest (without chat glue)"
        )


if __name__ == "__main__":
    main()
