"""What the digest is worth to the replies: each reply scored with and without it.

Replays one session teacher-forced under ``clm`` (default settings, ``auto`` tagging,
the given budget), records the prompt of every turn, then scores each forced reply
again on that prompt with the digest message ("Notes from earlier turns: ...", header to
footer) cut out, everything else unchanged. Prints, over the turns that had a digest,
its mean size, the mean prompt and the token-weighted ``reply_nll`` with and without it;
with ``--report`` (a ``clm replay --report`` JSON of another mode on the same file, e.g.
``truncate`` or ``prefix``; repeatable) also that mode's ``reply_nll`` and mean prompt
over the same turns, so the value of a digest token can be set beside the value of a
verbatim one.

    python docs/bench_digest_value.py examples/retention/sgd_session_10.jsonl --report T.json --report P.json
"""

from __future__ import annotations

import argparse
import json

from clm_middleware import Conversation, Engine
from clm_middleware.lifecycle.config import LifecycleConfig
from clm_middleware.lifecycle.renderer import DIGEST_TITLE
from clm_middleware.lifecycle.tagging import TaggingConfig
from clm_middleware.render import ChatFormat
from clm_middleware.replay.runner import turn_plan
from clm_middleware.replay.transcript import read_jsonl
from clm_middleware.replay.transcript_text import message_text


def digest_span(prompt: list[int], opening: list[int], footer: list[int]) -> tuple[int, int] | None:
    """[start, end) of the digest message in ``prompt``: its system header and title to its footer."""
    for start in range(len(prompt) - len(opening) + 1):
        if prompt[start : start + len(opening)] == opening:
            for end in range(start + len(opening), len(prompt) - len(footer) + 1):
                if prompt[end : end + len(footer)] == footer:
                    return start, end + len(footer)
    return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("transcript")
    parser.add_argument("--budget", type=int, default=1024)
    parser.add_argument(
        "--report",
        action="append",
        default=[],
        help="a replay report of another mode on the same file, scored over the same turns (repeatable)",
    )
    args = parser.parse_args()
    engine = Engine.from_pretrained()
    chat = ChatFormat.from_tokenizer(engine.tokenizer)
    requests: list[tuple[list[int], list[int]]] = []  # (prompt, forced reply) of each teacher-forced call
    generate = engine.generate

    def recording(prompt, *args, forced_token_ids=None, **kwargs):
        if forced_token_ids:
            requests.append((list(prompt), list(forced_token_ids)))
        return generate(prompt, *args, forced_token_ids=forced_token_ids, **kwargs)

    engine.generate = recording  # the conversation's calls, seen on their way to the engine
    config = LifecycleConfig(tagging=TaggingConfig(mode="auto"), budget=args.budget)
    conversation = Conversation(engine, config=config, max_new_tokens=48)
    turns = []  # (turn index, prompt ids, forced reply ids, reply_nll as replayed)
    for index, (before, answer) in enumerate(turn_plan(read_jsonl(args.transcript)[0])):
        for message in before:
            conversation.add(message.role, message_text(message))
        if answer is None:
            break
        calls = len(requests)
        stats = conversation.respond(forced_reply=message_text(answer)).stats
        if len(requests) > calls and stats.reply_nll is not None:
            prompt, forced = requests[-1]
            turns.append((index, prompt, forced, stats.reply_nll))
    engine.generate = generate
    content = chat.encode(DIGEST_TITLE)
    titled = chat.message_ids("system", content)
    header = next(h for h in range(len(titled)) if titled[h : h + len(content)] == content)
    opening = titled[: header + len(content)]  # system header and title: the digest's first ids
    footer = chat.message_ids("system", [])[header:]  # what closes a system message
    scored, with_digest, without, digest_tokens, prompt_tokens, tokens = [], 0.0, 0.0, 0, 0, 0
    for index, prompt, forced, nll in turns:
        span = digest_span(prompt, opening, footer)
        if span is None or not forced:
            continue
        cut = prompt[: span[0]] + prompt[span[1] :]
        again = engine.generate(cut, max_new_tokens=0, forced_token_ids=forced, use_pool=False).result()
        with_digest += nll * len(forced)
        without += again.forced_nll * len(forced)
        tokens += len(forced)
        digest_tokens += span[1] - span[0]
        prompt_tokens += len(prompt)
        scored.append(index)
    if not scored:
        print(f"{args.transcript}: no turn had a digest")
        return
    print(
        f"{args.transcript}: {len(scored)} turns with a digest (mean {digest_tokens / len(scored):.0f} tokens "
        f"of a mean prompt of {prompt_tokens / len(scored):.0f}); "
        f"reply_nll with it {with_digest / tokens:.4f}, cut out {without / tokens:.4f}"
    )
    for path in args.report:
        with open(path) as handle:
            report = json.load(handle)
        other = [report["turns"][i] for i in scored]
        weight = sum(t["forced_tokens"] for t in other)
        print(
            f"{report['mode']} over the same turns: reply_nll "
            f"{sum(t['reply_nll'] * t['forced_tokens'] for t in other) / weight:.4f}, "
            f"mean prompt {sum(t['prompt_tokens'] for t in other) / len(other):.0f} tokens"
        )


if __name__ == "__main__":
    main()
