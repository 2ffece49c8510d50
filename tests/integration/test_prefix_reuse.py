"""SmolLM2-135M through the pool: each turn computes only what is new."""

import itertools
from pathlib import Path

import torch

from clm_middleware.render import ChatFormat
from clm_middleware.replay.report import ReplayReport
from clm_middleware.replay.runner import PlainChatDriver, ReplayOptions, replay
from clm_middleware.replay.transcript import Transcript, read_jsonl

DATA = Path(__file__).parent.parent / "data"


def first_turns(transcript: Transcript, user_turns: int) -> Transcript:
    messages, seen = [], 0
    for message in transcript.messages:
        if message.role == "user":
            seen += 1
            if seen > user_turns:
                break
        messages.append(message)
    return Transcript(transcript.conversation_id, tuple(messages))


def test_ten_turn_teacher_forced_replay_prefills_exactly_the_new_tokens(smol_engine):
    [transcript] = read_jsonl(DATA / "lisbon_trip.jsonl")
    transcript = first_turns(transcript, 10)
    options = ReplayOptions(mode="prefix", teacher_force=True)
    chat = ChatFormat.from_tokenizer(smol_engine.tokenizer)
    report = ReplayReport(mode="prefix", model="smollm2")
    replay(
        [transcript],
        lambda t: PlainChatDriver(smol_engine, chat, options, t.conversation_id),
        report,
        teacher_force=True,
    )
    turns = report.turns
    assert len(turns) == 10
    for previous, turn in itertools.pairwise(turns):
        new_tokens = turn.prompt_tokens - previous.prompt_tokens  # forced reply + next user message
        # token-exact: the new tokens, plus the previous reply's last token (chosen, never fed)
        assert turn.prefill_tokens == new_tokens - previous.forced_tokens + 1, (
            turn.turn,
            turn.prefill_tokens,
            new_tokens,
        )
        assert turn.cached_tokens + turn.prefill_tokens == turn.prompt_tokens


def test_generated_reply_ids_are_reused_verbatim_on_the_next_turn(smol_engine):
    chat = ChatFormat.from_tokenizer(smol_engine.tokenizer)
    prompt = chat.render([("user", chat.encode("Name three colours."))])
    first = smol_engine.generate(prompt, max_new_tokens=24).result()
    reply = [t for t in first.token_ids if t not in smol_engine.default_stop_ids]
    follow_up = prompt + reply + list(chat.glue["assistant"].footer_ids)
    follow_up += chat.message_ids("user", chat.encode("And three animals?")) + list(chat.generation_prompt_ids)
    second = smol_engine.generate(follow_up, max_new_tokens=1, return_logits=True).result()
    computed = len(prompt) + len(first.token_ids) - 1
    assert second.stats.cached_tokens == computed  # token-exact: the partial last block is reused too
    with torch.no_grad():
        full = smol_engine.model(torch.tensor([follow_up])).logits[0, -1]
    assert (second.logits[0] - full).abs().max() <= 1e-4
