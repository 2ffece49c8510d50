"""``clm serve --compact-ahead`` through the real ``openai`` client."""

from __future__ import annotations

from openai import OpenAI

BUDGET = 600
CALLS = 14  # bounded: one request per call, each with its own timeout
# no distinctive token (number, name): no message refers back to a segment a compaction
# dropped, which would bring it back and re-prefill from there
PLACES = [
    "river",
    "lake",
    "forest",
    "hill",
    "meadow",
    "village",
    "bridge",
    "harbour",
    "garden",
    "valley",
    "orchard",
    "canyon",
    "market",
    "island",
]


def test_the_call_after_a_compaction_ahead_reads_the_compacted_context_from_the_pool(launch, tmp_path):
    server = launch(tmp_path, "--budget", str(BUDGET), "--compact-ahead", "--max-tokens", "8", "--tagging", "signals")
    try:
        client = OpenAI(base_url=server.api, api_key="unused", timeout=60, max_retries=0)
        model = client.models.list().data[0].id
        messages, calls = [{"role": "system", "content": "You are terse."}], []
        for day in range(CALLS):
            text = f"today we walked along the {PLACES[day]} and talked about the weather for a long while."
            messages.append({"role": "user", "content": text})
            reply = client.chat.completions.create(
                model=model, messages=messages, extra_headers={"X-Session-Id": "hike"}
            )
            messages.append({"role": "assistant", "content": reply.choices[0].message.content})
            calls.append((reply.usage, reply.model_extra["clm"]))
        ahead = [i for i, (_, clm) in enumerate(calls) if clm["compaction"] == "ahead"]
        # the compacted context and the opening of the next message
        assert ahead and all(calls[i][1]["ahead_tokens"] > calls[i][1]["context_tokens"] > 0 for i in ahead)
        assert all(usage.prompt_tokens <= BUDGET for usage, _ in calls)  # usage is the reply's own prompt
        # a next call that did not compact at its start (its own compaction ahead comes after its reply)
        followed = [i for i in ahead if i + 1 < len(calls) and calls[i + 1][1]["compaction"] in ("", "ahead")]
        assert followed
        for i in followed:
            assert calls[i + 1][0].prompt_tokens_details.cached_tokens >= calls[i][1]["context_tokens"] - 1
        computed = sum(clm["prefill_tokens"] + clm["ahead_prefill_tokens"] for _, clm in calls)
        assert server.metric("clm_prefill_tokens_total") == computed  # the metrics count the work ahead too
    finally:
        server.stop()
