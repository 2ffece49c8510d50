"""A chat through the real ``openai`` client: ``clm serve`` against ``clm serve --mode stateless``.

Both servers run the same model on this machine; each gets the bundled transcript's
user messages, one per call, with its own replies appended to its history (what a client
does). Calls alternate between the two servers, the order swapping every turn (the
machine is shared and noisy). Per call: prompt and cached tokens (from ``usage``),
prefill tokens and the server's own turn time (from the ``clm`` object), client-side
TTFT (to the first content delta of a stream) and wall time.

    python docs/bench_serve.py --turns 20 --out docs/bench/serve            # clm serve as it starts
    python docs/bench_serve.py --turns 20 --budget 1024 --out docs/bench/serve_budget
    python docs/bench_serve.py --turns 20 --budget 1024 --compact-ahead --out docs/bench/serve_ahead
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

from openai import OpenAI

sys.path.insert(0, str(Path(__file__).parents[1] / "tests"))
from live_server import start_server

TRANSCRIPT = Path(__file__).parents[1] / "examples" / "transcripts" / "lisbon_trip.jsonl"


def _messages(limit: int) -> tuple[str, list[str]]:
    records = [json.loads(line) for line in TRANSCRIPT.read_text().splitlines() if line.strip()]
    system = next(r["content"] for r in records if r["role"] == "system")
    return system, [r["content"] for r in records if r["role"] == "user"][:limit]


def _call(client: OpenAI, model: str, messages: list[dict], max_tokens: int) -> dict:
    started = time.perf_counter()
    ttft, text, usage, extension = None, "", None, {}
    stream = client.chat.completions.create(
        model=model, messages=messages, max_tokens=max_tokens, stream=True, stream_options={"include_usage": True}
    )
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            ttft = ttft or time.perf_counter() - started
            text += chunk.choices[0].delta.content
        extension = (chunk.model_extra or {}).get("clm") or extension
        usage = chunk.usage or usage
    wall = time.perf_counter() - started
    return {
        "reply": text,
        "prompt_tokens": usage.prompt_tokens,
        "cached_tokens": usage.prompt_tokens_details.cached_tokens,
        "prefill_tokens": extension.get("prefill_tokens"),
        "ahead_prefill_tokens": extension.get("ahead_prefill_tokens") or 0,  # --compact-ahead, after the reply
        "context_tokens": extension.get("context_tokens"),
        "server_turn_s": extension.get("turn_s"),
        "ttft_s": ttft if ttft is not None else wall,
        "wall_s": wall,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--turns", type=int, default=20)
    parser.add_argument("--budget", type=int, default=None, help="clm serve --budget [default: none, as clm serve]")
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--compact-ahead", action="store_true", help="clm serve --compact-ahead")
    parser.add_argument("--out", type=Path, default=Path("docs/bench/serve"))
    args = parser.parse_args()
    system, users = _messages(args.turns)
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as scratch:
        servers = {
            "clm": start_server(Path(scratch), *_clm_flags(args), model=None),
            "stateless": start_server(Path(scratch), "--mode", "stateless", model=None),
        }
        try:
            clients = {
                name: OpenAI(base_url=s.api, api_key="unused", timeout=600, max_retries=0)
                for name, s in servers.items()
            }
            model = clients["clm"].models.list().data[0].id
            histories = {name: [{"role": "system", "content": system}] for name in servers}
            rows: dict[str, list[dict]] = {name: [] for name in servers}
            for turn, text in enumerate(users):
                order = list(servers) if turn % 2 == 0 else list(reversed(servers))
                for name in order:
                    histories[name].append({"role": "user", "content": text})
                    row = _call(clients[name], model, histories[name], args.max_tokens)
                    histories[name].append({"role": "assistant", "content": row["reply"]})
                    rows[name].append(row)
                    tokens = f"prompt {row['prompt_tokens']:5d} cached {row['cached_tokens']:5d}"
                    print(f"turn {turn + 1:2d} {name:9s} {tokens} ttft {row['ttft_s']:.2f}s", flush=True)
        finally:
            for server in servers.values():
                server.stop()
    (args.out / "calls.json").write_text(json.dumps(rows, indent=1))
    (args.out / "summary.md").write_text(_summary(rows, args))
    print(_summary(rows, args))


def _clm_flags(args: argparse.Namespace) -> list[str]:
    return (["--budget", str(args.budget)] if args.budget else []) + (["--compact-ahead"] if args.compact_ahead else [])


def _summary(rows: dict[str, list[dict]], args: argparse.Namespace) -> str:
    clm, base = rows["clm"], rows["stateless"]

    def total(calls: list[dict], key: str) -> float:
        return sum(c[key] or 0 for c in calls)

    def ratio(key: str, last: int = 0) -> str:
        ours, theirs = total(clm[-last:], key), total(base[-last:], key)
        return f"{ours:.2f} | {theirs:.2f} | {theirs / ours:.1f}×"

    base_prefill = total(base, "prompt_tokens")  # stateless computes every prompt token
    clm_prefill = total(clm, "prefill_tokens") + total(clm, "ahead_prefill_tokens")  # every token computed
    shares = [c["cached_tokens"] / c["prompt_tokens"] for c in clm]
    overhead = [(c["wall_s"] - c["server_turn_s"]) / c["wall_s"] for c in clm if c["server_turn_s"]]
    lines = [
        f"`python docs/bench_serve.py {' '.join(['--turns', str(args.turns), *_clm_flags(args)])} "
        f"--max-tokens {args.max_tokens} --out {args.out}`",
        "",
        "| metric | clm serve | stateless | stateless ÷ clm |",
        "| --- | --- | --- | --- |",
        f"| prefill tokens | {clm_prefill:,.0f} | {base_prefill:,.0f} | {base_prefill / max(clm_prefill, 1):.1f}× |",
        f"| TTFT, sum (s) | {ratio('ttft_s')} |",
        f"| TTFT, last 5 calls (s) | {ratio('ttft_s', 5)} |",
        f"| wall time, sum (s) | {ratio('wall_s')} |",
        f"| context tokens at the end | {clm[-1]['context_tokens']:,} | {base[-1]['prompt_tokens']:,} | |",
        "",
        "cached ÷ prompt tokens per call (clm): " + ", ".join(f"{s:.0%}" for s in shares),
        "",
        f"from the third call on: {total(clm[2:], 'cached_tokens') / total(clm[2:], 'prompt_tokens'):.1%} of all "
        f"prompt tokens cached, min per call {min(shares[2:]):.0%}; server overhead (HTTP + routing, "
        f"wall − the server's turn time) per call: mean {sum(overhead) / len(overhead):.1%}, max {max(overhead):.1%}",
        "",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
