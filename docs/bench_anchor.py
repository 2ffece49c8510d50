"""``prefix`` against llama.cpp on the same token ids, turn by turn, alternating (issue #16).

Both sides get the same SmolLM2-135M-Instruct (ours: the GGUF de-quantized to fp32;
llama.cpp: the Q4_1 GGUF itself), the same chat text and token ids (rendered here once,
by ``PlainChatDriver``, the ``prefix`` replay mode), one thread each, teacher-forced:
each turn's prompt is the whole history, and the transcript's reply is then fed as
given. llama.cpp runs in a worker process in its own venv (``docs/bench_anchor_llama.py``;
``make bench-anchor`` installs llama-cpp-python there) and keeps its context between
turns, which is its prompt cache: the longest common prefix stays, the rest is computed.
The order of the two sides swaps every turn (the machine is shared and noisy).

Per transcript: prefill tokens (prompt tokens computed, the forced replies not counted:
they are the same on both sides), TTFT sum, peak KV (ours: the stored chain, its partial
last block included, plus the working arena, or with ``--paged-kv`` the one tile of one
layer its attention reads at a time, as ``clm replay`` reports it; llama.cpp: the cells
in use × K+V bytes per cell at its default f16) and one copy of the final context at our
KV dtype. Then decode (64 greedy tokens at ~1k tokens of context, EOS not honoured; with
``--paged-kv`` through the pool, as a conversation's request runs, else outside it) and
a 1,024-token prefill from scratch, 3 rounds alternating,
medians; peak RSS of each process after the replays. ``--quantization int4`` runs ours
with 4-bit weights (``models/quantization.py``) throughout and adds the fp32 weights'
decode and prefill rates to the speed rounds (loaded after the RSS is read);
``--compile-decode`` runs ours with the decode step compiled ahead of time
(``engine/compiled_decode.py``; its compile or load time is in anchor.json), and the
speed rounds show the default (fp32 weights, uncompiled) beside it.

Run: ``make bench-anchor`` (or ``python docs/bench_anchor.py --llama-python VENV/bin/python``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from clm_middleware.cli.setup import build_engine
from clm_middleware.models.loading import resolve_model_source
from clm_middleware.render import ChatFormat
from clm_middleware.replay.plain import PlainChatDriver, forced_ids
from clm_middleware.replay.runner import ReplayOptions, turn_plan
from clm_middleware.replay.transcript import read_jsonl

ROOT = Path(__file__).resolve().parent.parent
TRANSCRIPTS = {
    "bundled chat (34 turns)": (ROOT / "examples/transcripts/lisbon_trip.jsonl", None),
    "SGD session, first 60 turns": (ROOT / "examples/retention/sgd_session_10.jsonl", 60),
}
ROUNDS = 3
DECODE_TOKENS = 64
PREFILL_TOKENS = 1024


class LlamaWorker:
    def __init__(self, python: str, gguf: str, threads: int, n_ctx: int) -> None:
        script = str(Path(__file__).with_name("bench_anchor_llama.py"))
        self.process = subprocess.Popen(
            [python, script, gguf, str(threads), str(n_ctx)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        self.version = self._read()["version"]

    def ask(self, **request) -> dict:
        assert self.process.stdin is not None
        self.process.stdin.write(json.dumps(request) + "\n")
        self.process.stdin.flush()
        return self._read()

    def _read(self) -> dict:
        assert self.process.stdout is not None
        line = self.process.stdout.readline()
        if not line:
            raise RuntimeError(f"the llama.cpp worker exited with {self.process.wait()}")
        return json.loads(line)

    def close(self) -> None:
        if self.process.stdin is not None:
            self.process.stdin.close()
        self.process.wait(timeout=60)


def peak_rss() -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmHWM:"))


def replay(engine, llama: LlamaWorker, path: Path, limit: int | None) -> dict:
    transcript = read_jsonl(path)[0]
    llama.ask(op="prefill", prompt=[0])  # one worker serves every transcript: a fresh context for this one
    chat = ChatFormat.from_tokenizer(engine.tokenizer)
    driver = PlainChatDriver(engine, chat, ReplayOptions(mode="prefix", teacher_force=True), path.stem)
    turns = []
    for number, (before, answer) in enumerate(turn_plan(transcript)[:limit], start=1):
        if answer is None:
            break
        for message in before:
            driver.add(message)
        history = driver.history if driver.history is not None else chat.start_ids(None)
        prompt = history + list(chat.generation_prompt_ids)
        reply = forced_ids(answer, chat) or []
        row = {"turn": number, "prompt_tokens": len(prompt)}
        for side in ("ours", "llama") if number % 2 else ("llama", "ours"):
            if side == "ours":
                record = driver.respond(answer)
                row["ours"] = {
                    "prefill": record.prefill_tokens,
                    "ttft_s": record.ttft_s,
                    "kv_bytes": record.live_kv_bytes + record.working_kv_bytes,
                }
            else:
                row["llama"] = llama.ask(op="turn", prompt=prompt, reply=reply)
        turns.append(row)
    context = driver.context_tokens
    cell = llama.ask(op="memory")["kv_bytes_per_cell"]
    return {
        "turns": turns,
        "ours": {
            "prefill": sum(t["ours"]["prefill"] for t in turns),
            "ttft_s": sum(t["ours"]["ttft_s"] for t in turns),
            "peak_kv_bytes": max(t["ours"]["kv_bytes"] for t in turns),
            "one_copy_bytes": context * (engine.pool.stats().block_bytes // engine.block_size),
        },
        "llama": {
            "prefill": sum(t["llama"]["prefill"] for t in turns),
            "ttft_s": sum(t["llama"]["ttft_s"] for t in turns),
            "peak_kv_bytes": max(t["llama"]["cells"] for t in turns) * cell,
        },
        "context_tokens": context,
    }


def no_eos(stop_ids):
    def ban(generated, logits):
        logits[..., list(stop_ids)] = float("-inf")
        return logits

    return ban


def speeds(engines: dict[str, object], llama: LlamaWorker) -> dict:
    """Decode and prefill rates of each of our engines and llama.cpp's, rounds alternating the order."""
    first = next(iter(engines.values()))
    text = (ROOT / "examples/transcripts/lisbon_trip.jsonl").read_text()
    ids = first.tokenizer(text).input_ids
    decode_prompt, prefill_prompt = ids[:1000], ids[:PREFILL_TOKENS]
    sides = [*engines, "llama"]
    rows = {f"{side}_{kind}": [] for side in sides for kind in ("decode", "prefill")}
    for round_ in range(ROUNDS):
        for side in sides if round_ % 2 == 0 else reversed(sides):
            if side == "llama":
                rows["llama_decode"].append(
                    llama.ask(op="decode", prompt=decode_prompt, tokens=DECODE_TOKENS)["tokens_per_s"]
                )
                rows["llama_prefill"].append(llama.ask(op="prefill", prompt=prefill_prompt)["tokens_per_s"])
                continue
            engine = engines[side]
            generation = engine.generate(
                decode_prompt,
                max_new_tokens=DECODE_TOKENS,
                # a paged engine decodes a conversation's request over the pool's blocks;
                # outside the pool it would run through a working arena copy instead
                use_pool=engine.paged_kv,
                logits_processors=(no_eos(engine.default_stop_ids),),
            ).result()
            rows[f"{side}_decode"].append(generation.stats.decode_tokens_per_s)
            started = time.perf_counter()
            engine.generate(prefill_prompt, max_new_tokens=1, use_pool=False).result()
            rows[f"{side}_prefill"].append(len(prefill_prompt) / (time.perf_counter() - started))
    return {name: statistics.median(values) for name, values in rows.items()} | {"rounds": rows}


MIB = 1024 * 1024


def _row(group: str, metric: str, ours: float, theirs: float, number: str) -> str:
    share = f"{ours / theirs:.2f}×" if theirs else "—"
    return f"| {group} | {metric} | {number.format(ours)} | {number.format(theirs)} | {share} |"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--llama-python", required=True, help="python of the venv that has llama-cpp-python")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--kv-dtype", default="fp16", help="our pool's KV dtype (llama.cpp's cache is f16)")
    parser.add_argument(
        "--paged-kv", action="store_true", help="ours attends over the pool's blocks (no working arena)"
    )
    parser.add_argument(
        "--quantization",
        choices=["int4", "int4-bf16"],
        default=None,
        help="ours runs quantized weights; the speed rows also show the default fp32 weights beside",
    )
    parser.add_argument(
        "--compile-decode",
        action="store_true",
        help="ours decodes through the step compiled ahead of time (engine/compiled_decode.py)",
    )
    parser.add_argument("--out", type=Path, default=ROOT / "docs/bench/anchor")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    engine = build_engine(
        None,
        kv_dtype=args.kv_dtype,
        paged_kv=args.paged_kv,
        quantization=args.quantization,
        compile_decode=args.compile_decode,
    )
    gguf = str(resolve_model_source(None).path)
    llama = LlamaWorker(args.llama_python, gguf, args.threads, 8192)
    results = {name: replay(engine, llama, path, limit) for name, (path, limit) in TRANSCRIPTS.items()}
    # peak RSS before a second model loads for the speed rows
    results["peak_rss_bytes"] = {"ours": peak_rss(), "llama": llama.ask(op="memory")["peak_rss_bytes"]}
    engines = {"ours": engine}
    if engine.decoder is not None:
        report = engine.decoder.report
        results["compiled_decode"] = {"source": report.source, "seconds": report.seconds}
    if args.quantization or args.compile_decode:
        engines["ours_fp32"] = build_engine(None, kv_dtype=args.kv_dtype, paged_kv=args.paged_kv)
    results["speeds"] = speeds(engines, llama)
    llama.close()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "anchor.json").write_text(json.dumps(results, indent=1))
    paged = " --paged-kv" if args.paged_kv else ""
    quantized = f" --quantization {args.quantization}" if args.quantization else ""
    compiled = " --compile-decode" if args.compile_decode else ""
    options = f"--threads {args.threads}{paged}{quantized}{compiled}"
    command = f"python docs/bench_anchor.py --llama-python VENV/bin/python {options}"
    weights = f"{args.quantization} weights" if args.quantization else "fp32 weights"
    weights += ", compiled decode step" if args.compile_decode else ""
    lines = [
        f"`{command} --kv-dtype {args.kv_dtype}` (llama-cpp-python {llama.version}, `{Path(gguf).name}`;"
        f" ours: {weights}, {args.kv_dtype} KV)",
        "",
        "| transcript | metric | ours `prefix` | llama.cpp | ours ÷ llama.cpp |",
        "| --- | --- | --- | --- | --- |",
    ]
    for name in TRANSCRIPTS:
        ours, theirs, context = results[name]["ours"], results[name]["llama"], results[name]["context_tokens"]
        lines += [
            _row(name, "prefill tokens", ours["prefill"], theirs["prefill"], "{:,}"),
            _row("", "TTFT, sum (s)", ours["ttft_s"], theirs["ttft_s"], "{:.2f}"),
            _row(
                "",
                "peak KV (MiB; llama.cpp: cells used, f16)",
                ours["peak_kv_bytes"] / MIB,
                theirs["peak_kv_bytes"] / MIB,
                "{:.1f}",
            ),
            f"| | one copy of the final context, {context:,} tokens (MiB) | {ours['one_copy_bytes'] / MIB:.1f} | | |",
        ]
    speed, rss = results["speeds"], results["peak_rss_bytes"]
    lines += [
        _row(
            "speed",
            f"decode, {DECODE_TOKENS} tokens at 1,000 of context (tok/s)",
            speed["ours_decode"],
            speed["llama_decode"],
            "{:.1f}",
        ),
        _row(
            "",
            f"prefill, {PREFILL_TOKENS:,} tokens from scratch (tok/s)",
            speed["ours_prefill"],
            speed["llama_prefill"],
            "{:.1f}",
        ),
    ]
    if "ours_fp32_decode" in speed:
        default = "fp32 weights, uncompiled" if args.compile_decode else "fp32 weights"
        lines += [
            _row(
                "", f"decode, ours with {default} (tok/s)", speed["ours_fp32_decode"], speed["llama_decode"], "{:.1f}"
            ),
            _row(
                "",
                f"prefill, ours with {default} (tok/s)",
                speed["ours_fp32_prefill"],
                speed["llama_prefill"],
                "{:.1f}",
            ),
        ]
    lines += [_row("process", "peak RSS (MiB)", rss["ours"] / MIB, rss["llama"] / MIB, "{:.0f}")]
    (args.out / "summary.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    sys.exit(main())
