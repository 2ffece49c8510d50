"""Decode speed and equality of ``compile_decode``, in one process, rounds alternating.

The same loaded weights behind four engines (working arena or ``paged_kv``, each with
and without the compiled step; pools at ``--kv-dtype``): 64 greedy tokens at ~1,000
tokens of context (EOS not honoured), decoded through the pool as a conversation's
request is, ``--rounds`` rounds alternating the engines; medians. Then equality: a
greedy reply to one question from the arena engine with and without the compiled
step, compared token by token and by the largest logit difference (with bf16-compute
weights a near tie can flip a token, after which the replies' logits are not
comparable: the report says at which token they first differ).

    python docs/bench_compiled_decode.py --quantization int4-bf16
    python docs/bench_compiled_decode.py            # fp32 weights
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

import torch

from clm_middleware.cache.layout import PoolConfig
from clm_middleware.engine import Engine
from clm_middleware.models.loading import load_model, load_tokenizer
from clm_middleware.render import ChatFormat

ROOT = Path(__file__).resolve().parent.parent
DECODE_TOKENS = 64
QUESTION = "Tell me about Lisbon and what to see there in three days."


def no_eos(stop_ids):
    banned = list(stop_ids)

    def ban(generated, logits):
        logits[..., banned] = float("-inf")
        return logits

    return ban


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quantization", choices=["int4", "int4-bf16"], default=None)
    parser.add_argument("--kv-dtype", default="fp16")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model, tokenizer = load_model(quantization=args.quantization), load_tokenizer()

    def engine(paged: bool, compiled: bool) -> Engine:
        config = PoolConfig(kv_dtype=args.kv_dtype)
        return Engine(model, tokenizer, pool_config=config, paged_kv=paged, compile_decode=compiled)

    engines = {
        "arena, compiled": engine(False, True),
        "paged, compiled": engine(True, True),
        "paged": engine(True, False),
        "arena": engine(False, False),
    }
    for name, built in engines.items():
        if built.decoder is not None:
            report = built.decoder.report
            print(f"{name}: library {report.source} in {report.seconds:.1f} s, self-check {report.max_logit_error:.3g}")
    text = (ROOT / "examples/transcripts/lisbon_trip.jsonl").read_text()
    prompt = tokenizer(text).input_ids[:1000]
    rates: dict[str, list[float]] = {name: [] for name in engines}
    for _ in range(args.rounds):
        for name, built in engines.items():
            ban = (no_eos(built.default_stop_ids),)
            generation = built.generate(prompt, max_new_tokens=DECODE_TOKENS, logits_processors=ban).result()
            rates[name].append(generation.stats.decode_tokens_per_s)
    weights = args.quantization or "fp32"
    print(f"\ndecode, {DECODE_TOKENS} tokens at 1,000 of context ({weights} weights, {args.kv_dtype} pool):")
    print("| engine | rounds (tok/s) | median |\n| --- | --- | --- |")
    for name, values in rates.items():
        print(f"| {name} | {', '.join(f'{v:.1f}' for v in values)} | {statistics.median(values):.1f} |")

    chat = ChatFormat.from_tokenizer(tokenizer)
    question = chat.render([("user", chat.encode(QUESTION))])
    replies = {
        name: engines[name].generate(question, max_new_tokens=60, return_logits=True, use_pool=False).result()
        for name in ("arena", "arena, compiled")
    }
    plain, compiled = replies["arena"], replies["arena, compiled"]
    same = next(
        (i for i, (a, b) in enumerate(zip(plain.token_ids, compiled.token_ids, strict=False)) if a != b),
        None,
    )
    agreed = len(plain.token_ids) if same is None else same
    difference = max(
        float((a - b).abs().max()) for a, b in zip(plain.logits[:agreed], compiled.logits[:agreed], strict=True)
    )
    print(
        f"\nequality: {agreed} of {len(plain.token_ids)} greedy tokens the same"
        f"{'' if same is None else f' (first difference at token {same})'}; largest logit difference "
        f"while they agree {difference:.3g}\nuncompiled: {plain.text[:160]!r}\ncompiled:   {compiled.text[:160]!r}"
    )


if __name__ == "__main__":
    main()
