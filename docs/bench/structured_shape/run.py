"""SmolLM2 through ChatCLM.with_structured_output on four pydantic models: does the reply parse?

Usage: ``HF_HUB_OFFLINE=1 OMP_NUM_THREADS=1 python docs/bench/structured_shape/run.py
json_schema,function_calling [--max-tokens 120]``. One line per (method, model): parsed
or FAILED, the finish reason, and the document or call arguments (cut to 230 characters).
Figures and what they measured: docs/benchmarks.md, "Structured output with SmolLM2".
"""

from __future__ import annotations

import argparse
import json
import time

from pydantic import BaseModel

from clm_middleware.adapters import ChatCLM


class Booking(BaseModel):
    """A hotel booking."""

    name: str
    nights: int
    tags: list[str] = []


class Recipe(BaseModel):
    """A recipe."""

    title: str
    ingredients: list[str]
    minutes: int


class Person(BaseModel):
    name: str
    age: int | None = None


class Meeting(BaseModel):
    """A meeting."""

    topic: str
    attendees: list[Person]


CASES = [
    (Booking, "Book the Hotel Avenida for Ana Silva, 3 nights; tag it business and late-checkout."),
    (Recipe, "Pancakes: flour, milk, eggs and sugar; ready in 20 minutes."),
    (Meeting, "Budget review with Ana (34) and Rui (41)."),
    (Person, "My friend Joao is 29 years old."),
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("methods", help="comma-separated: json_schema, function_calling, json_mode")
    parser.add_argument("--max-tokens", type=int, default=120)
    args = parser.parse_args()
    llm = ChatCLM(max_tokens=args.max_tokens)
    for method in args.methods.split(","):
        for schema, text in CASES:
            started = time.perf_counter()
            out = llm.with_structured_output(schema, method=method, include_raw=True).invoke(text)
            raw = out["raw"]
            shown = raw.content if raw.content else json.dumps([c["args"] for c in raw.tool_calls])
            verdict = "parsed" if out["parsed"] is not None else "FAILED"
            finish = raw.response_metadata.get("finish_reason")
            took = time.perf_counter() - started
            print(method, schema.__name__, verdict, finish, repr(shown)[:230], f"{took:.1f}s", flush=True)


if __name__ == "__main__":
    main()
