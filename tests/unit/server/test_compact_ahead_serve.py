"""``clm serve --compact-ahead`` through the real ``openai`` client."""

from __future__ import annotations

from openai import OpenAI

BUDGET = 400
CALLS = 12  # bounded: one request per call, each with its own timeout


def test_the_call_after_a_compaction_ahead_reads_the_compacted_context_from_the_pool(launch, tmp_path):
    server = launch(tmp_path, "--budget", str(BUDGET), "--compact-ahead", "--max-tokens", "8", "--tagging", "signals")
    try:
        client = OpenAI(base_url=server.api, api_key="unused", timeout=60, max_retries=0)
        model = client.models.list().data[0].id
        messages, calls = [{"role": "system", "content": "You are terse."}], []
        for day in range(CALLS):
            messages.append({"role": "user", "content": f"Day {day}: we hiked {day + 3} km to the lake at Hallstatt."})
            reply = client.chat.completions.create(
                model=model, messages=messages, extra_headers={"X-Session-Id": "hike"}
            )
            messages.append({"role": "assistant", "content": reply.choices[0].message.content})
            calls.append((reply.usage, reply.model_extra["clm"]))
        ahead = [i for i, (_, clm) in enumerate(calls) if clm["compaction"] == "ahead"]
        assert ahead and all(calls[i][1]["ahead_tokens"] == calls[i][1]["context_tokens"] > 0 for i in ahead)
        assert all(usage.prompt_tokens <= BUDGET for usage, _ in calls)  # usage is the reply's own prompt
        followed = [i for i in ahead if i + 1 < len(calls) and not calls[i + 1][1]["compaction"]]
        assert followed
        for i in followed:
            assert calls[i + 1][0].prompt_tokens_details.cached_tokens >= calls[i][1]["context_tokens"] - 1
        computed = sum(clm["prefill_tokens"] + clm["ahead_prefill_tokens"] for _, clm in calls)
        assert server.metric("clm_prefill_tokens_total") == computed  # the metrics count the work ahead too
    finally:
        server.stop()
