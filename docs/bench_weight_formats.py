"""Decode and prefill speed, and NLL, of SmolLM2 with int8 weight formats against fp32.

One process, one thread, the formats alternating each round (ratios, not absolutes).
Needs torchao (`pip install torchao`), which is not a dependency of the project.
Run: `python docs/bench_weight_formats.py`.
"""

import copy
import time
from pathlib import Path

import torch
from torchao.quantization import Int8WeightOnlyConfig, quantize_

from clm_middleware.engine import Engine

torch.set_num_threads(1)
engine = Engine.from_pretrained()
fp32 = engine.model
weight_only = copy.deepcopy(fp32)
quantize_(weight_only, Int8WeightOnlyConfig())
dynamic = torch.ao.quantization.quantize_dynamic(copy.deepcopy(fp32), {torch.nn.Linear}, dtype=torch.qint8)
text = (Path(__file__).parent.parent / "examples/transcripts/lisbon_trip.jsonl").read_text()[:8000]
ids = torch.tensor([engine.tokenizer(text).input_ids[:1000]])
formats = {"fp32": fp32, "torchao int8 weight-only": weight_only, "torch.ao dynamic int8": dynamic}


def decode_rate(model: torch.nn.Module, tokens: int = 32) -> float:
    with torch.no_grad():
        out = model(ids, use_cache=True)
        past, token = out.past_key_values, out.logits[:, -1:].argmax(-1)
        started = time.perf_counter()
        for _ in range(tokens):
            out = model(token, past_key_values=past, use_cache=True)
            past, token = out.past_key_values, out.logits[:, -1:].argmax(-1)
        return tokens / (time.perf_counter() - started)


def prefill_rate(model: torch.nn.Module, tokens: int = 512) -> float:
    with torch.no_grad():
        started = time.perf_counter()
        model(ids[:, :tokens])
        return tokens / (time.perf_counter() - started)


for round_ in range(3):
    for name, model in formats.items():
        print(round_, name, f"decode {decode_rate(model):.2f} tok/s", f"prefill {prefill_rate(model):.1f} tok/s")
with torch.no_grad():
    for name, model in formats.items():
        logprobs = torch.log_softmax(model(ids).logits.float(), -1)[0, :-1]
        print(name, "nll", round(-logprobs.gather(-1, ids[0, 1:, None]).mean().item(), 4))
