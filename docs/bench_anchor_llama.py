"""llama.cpp's side of ``docs/bench_anchor.py``: one ``llama_cpp.Llama``, driven over stdin.

Runs in its own venv (``make bench-anchor`` installs llama-cpp-python there), so nothing
of it is a dependency of the project. One JSON object per line in, one out:

- ``{"op": "turn", "prompt": [ids], "reply": [ids]}``: the prompt is matched against the
  tokens already in the context (llama.cpp's prompt cache: the longest common prefix is
  kept, the rest of the KV removed), the new part evaluated, the first token sampled
  (TTFT), then the transcript's reply evaluated (teacher forcing). Answers ``prefill``
  (prompt tokens computed), ``ttft_s``, ``cells`` (KV cells in use). The reply's last
  token is not evaluated, as in a generation, where the last token is chosen, never fed
  (our engine does the same), so the next prompt computes it.
- ``{"op": "decode", "prompt": [ids], "tokens": n}``: a fresh context, the prompt
  evaluated, then ``n`` greedy tokens one at a time (EOS not honoured, so both sides
  decode the same count). Answers ``tokens_per_s`` over the tokens after the first.
- ``{"op": "prefill", "prompt": [ids]}``: a fresh context, the prompt evaluated from
  scratch. Answers ``tokens_per_s``.
- ``{"op": "memory"}``: ``peak_rss_bytes`` (VmHWM), ``kv_bytes_per_cell`` (K and V, f16).
"""

import json
import sys
import time

import llama_cpp

model_path, threads, n_ctx = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
llm = llama_cpp.Llama(model_path=model_path, n_ctx=n_ctx, n_threads=threads, n_batch=512, verbose=False)
layers = llama_cpp.llama_model_n_layer(llm.model)
head_kv = llama_cpp.llama_model_n_head_kv(llm.model)
head_dim = llama_cpp.llama_model_n_embd(llm.model) // llama_cpp.llama_model_n_head(llm.model)
KV_BYTES_PER_CELL = layers * 2 * head_kv * head_dim * 2  # K and V, f16 (llama.cpp's default cache type)


def greedy() -> int:
    return int(llm.sample(top_k=1, top_p=1.0, temp=0.0))


def turn(prompt: list[int], reply: list[int]) -> dict:
    started = time.perf_counter()
    matched = llm.longest_token_prefix(llm._input_ids.tolist(), prompt)
    matched = min(matched, len(prompt) - 1)  # the last prompt token is evaluated for its logits
    llm.n_tokens = matched
    llm.eval(prompt[matched:])
    greedy()
    ttft = time.perf_counter() - started
    if len(reply) > 1:  # as a generation feeds it: every token but the last, which is only chosen
        llm.eval(reply[:-1])
    return {"prefill": len(prompt) - matched, "ttft_s": ttft, "cells": llm.n_tokens}


def decode(prompt: list[int], tokens: int) -> dict:
    llm.reset()
    llm.eval(prompt)
    token = greedy()
    started = time.perf_counter()
    for _ in range(tokens - 1):
        llm.eval([token])
        token = greedy()
    return {"tokens_per_s": (tokens - 1) / (time.perf_counter() - started)}


def prefill(prompt: list[int]) -> dict:
    llm.reset()
    started = time.perf_counter()
    llm.eval(prompt)
    greedy()
    return {"tokens_per_s": len(prompt) / (time.perf_counter() - started)}


def memory() -> dict:
    with open("/proc/self/status") as status:
        hwm = next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmHWM:"))
    return {"peak_rss_bytes": hwm, "kv_bytes_per_cell": KV_BYTES_PER_CELL}


print(json.dumps({"ready": True, "version": llama_cpp.__version__}), flush=True)
for line in sys.stdin:
    request = json.loads(line)
    op = request["op"]
    if op == "turn":
        answer = turn(request["prompt"], request["reply"])
    elif op == "decode":
        answer = decode(request["prompt"], request["tokens"])
    elif op == "prefill":
        answer = prefill(request["prompt"])
    elif op == "memory":
        answer = memory()
    else:
        answer = {"error": f"unknown op {op!r}"}
    print(json.dumps(answer), flush=True)
