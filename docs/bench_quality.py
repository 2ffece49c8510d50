"""Do no harm: what a user gets through the middleware next to the bare model, in one run.

Run from the repo root (SmolLM2-135M, CPU, a few minutes per part; figures in docs/benchmarks.md)::

    HF_HUB_OFFLINE=1 .venv/bin/python docs/bench_quality.py --out docs/bench/quality

Parts, each written to ``OUT/<part>.json`` and summarised in ``OUT/quality.md``:

- ``quickstart``: the README quickstart (``Conversation``, default settings, budget 1024)
  against the bare model: the same messages through the tokenizer's own chat template
  (``apply_chat_template``), no middleware, recomputed every turn. Replies side by side,
  with their flags (``reply_quality.reply_flags``).
- ``chatclm``: ``ChatCLM(max_tokens=24)``, six calls of one re-sent chat (each call sends
  the whole history plus one new message, as LangChain does): replies, flags, and
  ``cache_read`` ÷ input tokens per call.
- ``generated``: ``clm bench`` with generated replies (``--modes prefix,clm --budget 1024
  --max-new-tokens 48``) on the demo transcript and on the first ``--turns`` assistant
  turns of two public-data sessions; the flagged-reply row of each table.

The teacher-forced ``reply_nll`` and ``clm eval answers`` figures come from the CLI
commands listed in docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from clm_middleware import Conversation, Engine
from clm_middleware.adapters import ChatCLM
from clm_middleware.lifecycle.reply_quality import reply_flags

SYSTEM = "You are a helpful airline customer support agent."
QUICKSTART = [
    "Hi!",
    "My booking reference is ZK4R2P. I need to move my flight to Friday.",
    "It is the morning flight from Lisbon to Paris.",
    "ok thanks, what is my booking reference again?",
]
CHAT = [
    "Hello, I'd like to plan a weekend in Porto.",
    "I arrive on Friday at 18:40 and leave on Sunday evening.",
    "My budget for the hotel is 120 euros a night.",
    "Which neighbourhood would you suggest?",
    "And what should I eat there?",
    "Remind me: when do I arrive?",
]
SUMMARY_KEYS = ("generated_replies", "flagged_replies", "reply_flags", "hit_rate", "final_context_tokens")
SESSIONS = [
    Path("examples/transcripts/lisbon_trip.jsonl"),
    Path("examples/retention/sgd_session_10.jsonl"),
    Path("examples/retention/multiwoz_session_10.jsonl"),
]


def bare_replies(engine: Engine, messages: list[str], max_new_tokens: int) -> list[str]:
    """The model with no middleware: the chat template re-rendered and recomputed each turn."""
    history = [{"role": "system", "content": SYSTEM}]
    replies = []
    for message in messages:
        history.append({"role": "user", "content": message})
        ids = engine.tokenizer.apply_chat_template(history, add_generation_prompt=True, tokenize=True)
        ids = ids["input_ids"] if hasattr(ids, "keys") else ids  # transformers 5 returns a BatchEncoding
        text = engine.generate(list(ids), max_new_tokens=max_new_tokens, use_pool=False).result().text.strip()
        history.append({"role": "assistant", "content": text})
        replies.append(text)
    return replies


def quickstart(engine: Engine, max_new_tokens: int) -> dict:
    chat = Conversation(engine, system_prompt=SYSTEM, budget=1024, max_new_tokens=max_new_tokens)
    ours = [chat.send(message) for message in QUICKSTART]
    bare = bare_replies(engine, QUICKSTART, max_new_tokens)
    rows = [
        {
            "message": message,
            "clm": reply.text,
            "clm_flags": reply.stats.reply_flags,
            "bare": plain,
            "bare_flags": reply_flags(plain, plain),
        }
        for message, reply, plain in zip(QUICKSTART, ours, bare, strict=True)
    ]
    return {"calibration": chat.stats()["protocol_calibration"], "max_new_tokens": max_new_tokens, "turns": rows}


def chatclm(max_tokens: int) -> dict:
    from langchain_core.messages import AIMessage, HumanMessage, SystemMessage

    llm = ChatCLM(max_tokens=max_tokens)
    history = [SystemMessage(SYSTEM.replace("airline customer support", "travel"))]
    calls = []
    for message in CHAT:
        history.append(HumanMessage(message))
        reply = llm.invoke(history)
        usage = reply.usage_metadata or {}
        inputs = usage.get("input_tokens", 0)
        cached = (usage.get("input_token_details") or {}).get("cache_read", 0)
        calls.append(
            {
                "message": message,
                "reply": reply.content,
                "flags": reply_flags(reply.content, reply.content),
                "input_tokens": inputs,
                "cache_read": cached,
                "cache_read_share": cached / inputs if inputs else 0.0,
            }
        )
        history.append(AIMessage(reply.content))
    return {"max_tokens": max_tokens, "calls": calls}


def head(path: Path, turns: int, folder: Path) -> Path:
    """The first ``turns`` assistant turns of a JSONL transcript (and what precedes them)."""
    kept, answered = [], 0
    for line in path.read_text(encoding="utf-8").splitlines():
        record = json.loads(line)
        if record.get("role") == "assistant":
            if answered == turns:
                break
            answered += 1
        kept.append(line)
    target = folder / f"{path.stem}.head{turns}.jsonl"
    target.write_text("\n".join(kept) + "\n", encoding="utf-8")
    return target


def generated(out: Path, turns: int) -> dict:
    results = {}
    with tempfile.TemporaryDirectory() as scratch:
        for session in SESSIONS:
            source = session if session.name == "lisbon_trip.jsonl" else head(session, turns, Path(scratch))
            markdown = out / f"generated_{session.stem}.md"
            command = [
                str(Path(sys.executable).with_name("clm")),
                "bench",
                str(source),
                "--modes",
                "prefix,clm",
                "--budget",
                "1024",
                "--max-new-tokens",
                "48",
                "--markdown",
                str(markdown),
                "--report-dir",
                str(out / f"generated_{session.stem}"),
            ]
            started = time.perf_counter()
            subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
            reports = {
                mode: json.loads((out / f"generated_{session.stem}" / f"{mode}.json").read_text())
                for mode in ("prefix", "clm")
            }
            results[session.name] = {
                "turns": turns if source is not session else None,
                "seconds": time.perf_counter() - started,
                **{mode: {key: report["totals"][key] for key in SUMMARY_KEYS} for mode, report in reports.items()},
            }
    return results


def markdown(results: dict) -> str:
    lines = ["# Do no harm: replies through clm next to the bare model", ""]
    quick = results["quickstart"]
    lines += [
        f"Protocol calibration: {quick['calibration']}",
        "",
        "## README quickstart (budget 1024)",
        "",
        "| message | clm | bare model |",
        "| --- | --- | --- |",
    ]
    for row in quick["turns"]:
        clm = row["clm"].replace("\n", " ") + (f" **{row['clm_flags']}**" if row["clm_flags"] else "")
        bare = row["bare"].replace("\n", " ") + (f" **{row['bare_flags']}**" if row["bare_flags"] else "")
        lines.append(f"| {row['message']} | {clm} | {bare} |")
    lines += ["", "## ChatCLM, six calls of one re-sent chat", "", "| call | cache_read ÷ input | flags | reply |"]
    lines.append("| --- | --- | --- | --- |")
    for index, call in enumerate(results["chatclm"]["calls"], start=1):
        reply = call["reply"].replace("\n", " ")
        share = f"{call['cache_read']}/{call['input_tokens']} = {call['cache_read_share']:.0%}"
        lines.append(f"| {index} | {share} | {call['flags'] or '-'} | {reply} |")
    lines += ["", "## Generated replays (`clm bench --modes prefix,clm --budget 1024 --max-new-tokens 48`)", ""]
    lines += [
        "| session | mode | flagged / replies | flags | hit rate | final context |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for name, result in results["generated"].items():
        label = name if result["turns"] is None else f"{name} (first {result['turns']} turns)"
        for mode in ("prefix", "clm"):
            totals = result[mode]
            lines.append(
                f"| {label} | {mode} | {totals['flagged_replies']}/{totals['generated_replies']} | "
                f"{totals['reply_flags'] or '-'} | {totals['hit_rate']:.1%} | {totals['final_context_tokens']} |"
            )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("docs/bench/quality"))
    parser.add_argument("--turns", type=int, default=40, help="assistant turns of each public session to generate")
    parser.add_argument("--max-new-tokens", type=int, default=96, help="quickstart reply length")
    parser.add_argument("--parts", default="quickstart,chatclm,generated")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    parts = set(args.parts.split(","))
    results: dict = {}
    path = args.out / "quality.json"
    if path.exists():
        results = json.loads(path.read_text())
    if "quickstart" in parts:
        results["quickstart"] = quickstart(Engine.from_pretrained(), args.max_new_tokens)
    if "chatclm" in parts:
        results["chatclm"] = chatclm(24)
    if "generated" in parts:
        results["generated"] = generated(args.out, args.turns)
    path.write_text(json.dumps(results, indent=2, ensure_ascii=False) + "\n")
    if {"quickstart", "chatclm", "generated"} <= set(results):
        (args.out / "quality.md").write_text(markdown(results), encoding="utf-8")
    print(json.dumps(results, indent=2, ensure_ascii=False))


if __name__ == "__main__":
    main()
