"""A 20-call agent session through ChatCLM vs. a stateless wrapper re-sending the same histories.

    python docs/bench_agent.py --out docs/bench/agent.md

The session is τ-bench airline task 3 (trial 0), an OpenAI-format trajectory with tool
calls and tool results, from examples/data/tau_bench. Like an agent framework, each call
sends the whole history up to one of the first 20 assistant turns; the trajectory's own
assistant message (not ChatCLM's reply) goes into the next history, so every call is a
branch of the previous one and ChatCLM forks at the common prefix. A stateless wrapper
computes every prompt token of every call; ChatCLM reports what it computed
(``prefill_tokens``) and what the pool served (``usage_metadata`` ``cache_read``), which
is checked against the engine's own count for each call.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TRAJECTORIES = ROOT / "examples/data/tau_bench/gpt-4o-airline-8.json"
TASK, CALLS = 3, 20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--max-tokens", type=int, default=16)
    args = parser.parse_args()

    from langchain_core.messages import convert_to_messages

    from clm_middleware.adapters import ChatCLM
    from clm_middleware.cli.setup import build_engine

    record = next(r for r in json.loads(TRAJECTORIES.read_text()) if r["task_id"] == TASK and r["trial"] == 0)
    messages = convert_to_messages(record["traj"])
    cut_points = [i for i, m in enumerate(messages) if m.type == "ai"][:CALLS]
    engine = build_engine(None)
    llm = ChatCLM(engine=engine, max_tokens=args.max_tokens, tagging="signals")
    rows, stateless, computed, mismatches = [], 0, 0, 0
    for call, cut in enumerate(cut_points, start=1):
        before = engine.stats.cached_tokens
        reply = llm.invoke(messages[:cut])
        usage = reply.usage_metadata
        cache_read = usage["input_token_details"]["cache_read"]
        pool_count = engine.stats.cached_tokens - before
        mismatches += cache_read != pool_count
        stateless += usage["input_tokens"]
        prefill = reply.response_metadata["prefill_tokens"]
        computed += prefill
        rows.append(f"| {call} | {cut} | {usage['input_tokens']:,} | {prefill:,} | {cache_read:,} | {pool_count:,} |")
    lines = [
        "Command: `python docs/bench_agent.py --out docs/bench/agent.md`",
        "",
        f"τ-bench airline task {TASK}, trial 0; {len(cut_points)} calls; model {engine.model_name}; "
        f"replies ≤ {args.max_tokens} tokens; tagging signals.",
        "",
        f"- stateless wrapper prefill (every prompt token of every call): **{stateless:,}** tokens",
        f"- ChatCLM prefill: **{computed:,}** tokens — **{stateless / computed:.1f}×** fewer",
        f"- calls where `usage_metadata` cache_read ≠ the engine's count: **{mismatches}**",
        "",
        "| call | messages sent | prompt tokens | prefilled | cache_read | engine count |",
        "| --- | --- | --- | --- | --- | --- |",
        *rows,
        "",
    ]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(lines), encoding="utf-8")
    print("\n".join(lines[:8]))


if __name__ == "__main__":
    main()
