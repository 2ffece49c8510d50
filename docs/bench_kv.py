"""Engine-level KV measurements for issue 16, each system alternating turn by turn in one run.

    python docs/bench_kv.py reuse [TRANSCRIPT]     # block-granular vs token-exact reuse
    python docs/bench_kv.py decode                 # prefill and decode tokens/s per attention path
    python docs/bench_kv.py attention-op           # one SDPA call: repeat_kv copies vs enable_gqa
    python docs/bench_kv.py kv-dtype [TRANSCRIPT]  # pool storage dtype: peak KV and reply_nll
    python docs/bench_kv.py kv-hit                 # pool storage dtype: logits of a pool-served hit
    python docs/bench_kv.py blend [TRANSCRIPT]     # clm at a budget: exact vs approximate reuse
    python docs/bench_kv.py paged [TRANSCRIPT]     # working arena vs paged_kv: peak KV, TTFT, decode

Every variant is its own engine (own pool) over the same SmolLM2 weights; ratios
from one run are comparable on a noisy machine, single times are not.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from clm_middleware.cli.setup import build_engine
from clm_middleware.engine import Engine
from clm_middleware.render import ChatFormat
from clm_middleware.replay.formats import read_transcripts
from clm_middleware.replay.plain import PlainChatDriver
from clm_middleware.replay.report import ReplayReport
from clm_middleware.replay.runner import ReplayOptions, replay_interleaved

BUNDLED = Path(__file__).parent.parent / "examples" / "transcripts" / "lisbon_trip.jsonl"


def teacher_forced(engines: dict[str, Engine], transcript: Path) -> dict[str, ReplayReport]:
    """A ``prefix`` replay of ``transcript`` per engine, teacher-forced, turn by turn in rotating order."""
    options = ReplayOptions(mode="prefix", teacher_force=True)
    transcripts = read_transcripts(transcript)
    factories = {
        name: (
            lambda t, e=engine: PlainChatDriver(e, ChatFormat.from_tokenizer(e.tokenizer), options, t.conversation_id)
        )
        for name, engine in engines.items()
    }
    reports = {name: ReplayReport(mode=name, model="smollm2") for name in engines}
    return replay_interleaved(transcripts, factories, reports, teacher_force=True)


def exactly_new_tokens(report: ReplayReport) -> int:
    """The least any reuse can prefill: each turn's tokens after what the previous turn
    computed (its prompt and forced reply, less the reply's last token, never fed)."""
    total, computed = 0, 0
    for turn in report.turns:
        total += turn.prompt_tokens - computed
        computed = turn.prompt_tokens + turn.forced_tokens - 1
    return total


def reuse(args: argparse.Namespace) -> None:
    token_exact = build_engine()
    block_granular = Engine(token_exact.model, token_exact.tokenizer)
    block_granular.pool.match_tail = lambda *_args: None  # reuse full blocks only, as before issue 16
    reports = teacher_forced({"block-granular": block_granular, "token-exact": token_exact}, args.transcript)
    rows = [
        ("prefill tokens", total("prefill_tokens", "{:,}")),
        ("exactly the new tokens", lambda r: f"{exactly_new_tokens(r):,}"),
        ("hit rate", total("hit_rate", "{:.1%}")),
        ("TTFT sum (s)", total("ttft_s", "{:.2f}")),
        ("TTFT p95 (s)", total("ttft_p95_s", "{:.3f}")),
        ("reply_nll", total("reply_nll", "{:.4f}")),
    ]
    print_table(reports, rows, f"{args.transcript.name}, {len(reports['token-exact'].turns)} turns, teacher-forced")


def kv_dtype(args: argparse.Namespace) -> None:
    """The same teacher-forced ``prefix`` replay with the pool stored as fp32, bf16, fp16."""
    from clm_middleware.cache import PoolConfig

    exact = build_engine()
    engines = {"fp32": exact}
    for name in ("bf16", "fp16"):
        engines[name] = Engine(exact.model, exact.tokenizer, pool_config=PoolConfig(kv_dtype=name))
    reports = teacher_forced(engines, args.transcript)
    baseline = reports["fp32"].turns
    rows = [
        ("pool bytes per token", lambda r: f"{engines[r.mode].pool.block_bytes // engines[r.mode].block_size:,}"),
        *replay_kv_rows(baseline, "fp32"),
    ]
    print_table(reports, rows, f"{args.transcript.name}, {len(baseline)} turns, teacher-forced, pool kv_dtype")


def paged(args: argparse.Namespace) -> None:
    """The same teacher-forced ``prefix`` replay with a working arena and with ``paged_kv``
    (fp32, and fp16 storage; the past read in place a tile at a time, and gathered into a
    one-layer scratch as any other attention gets it), then decode tok/s at ~1k context
    served from the pool."""
    from clm_middleware.cache import PoolConfig

    arena = build_engine()
    engines = {"arena (default)": arena}
    for storage, config in (("", None), (", fp16 pool", PoolConfig(kv_dtype="fp16"))):
        for read in ("", "gathered"):
            engine = Engine(arena.model, arena.tokenizer, pool_config=config, paged_kv=True)
            if read:
                engine.attends_in_place = False  # the scratch path, as another attention implementation gets
            engines[f"paged_kv{storage}{', ' + read if read else ''}"] = engine
    reports = teacher_forced(engines, args.transcript)
    names = {report.mode: name for name, report in reports.items()}
    baseline = reports["arena (default)"].turns
    prompt = arena.tokenizer.encode(BUNDLED.read_text())[: args.context]
    decode_rates: dict[str, list[float]] = {name: [] for name in engines}
    for round_ in range(args.rounds):
        order = list(engines)[round_ % len(engines) :] + list(engines)[: round_ % len(engines)]
        for name in order:  # the prompt is in the pool after each engine's first round
            stats = engines[name].generate(prompt, max_new_tokens=64, stop_token_ids=[]).result().stats
            decode_rates[name].append((stats.generated_tokens - 1) / stats.decode_s)
    rows = [
        *replay_kv_rows(baseline, "arena"),
        ("peak KV ÷ peak pool KV", lambda r: f"{r.totals()['peak_kv_bytes'] / r.totals()['peak_pool_bytes']:.2f}"),
        (
            f"decode tok/s, {len(prompt)}-token prompt from the pool (median of {args.rounds})",
            lambda r: f"{sorted(decode_rates[names[r.mode]])[args.rounds // 2]:.2f}",
        ),
    ]
    print_table(reports, rows, f"{args.transcript.name}, {len(baseline)} turns, teacher-forced prefix")


def blend(args: argparse.Namespace) -> None:
    """``clm`` teacher-forced at ``--budget``, exact reuse against approximate reuse at
    each ``--shares`` (engine/blend.py), alternating turn by turn: what the blend saves
    in prefill, and what it costs in ``reply_nll`` on the same contexts."""
    from clm_middleware.cli.setup import LifecycleOptions, driver_factory
    from clm_middleware.engine.blend import BlendConfig

    exact = build_engine()
    engines = {"exact": exact}
    for share in args.shares:
        engines[f"blend {share:g}"] = Engine(exact.model, exact.tokenizer, blend=BlendConfig(recompute_share=share))
    options = ReplayOptions(mode="clm", teacher_force=True)
    factories = {
        name: driver_factory(engine, options, LifecycleOptions(budget=args.budget)) for name, engine in engines.items()
    }
    # keep-all `prefix` beside, on its own exact engine: the TTFT that clm's is held to
    factories["prefix"] = driver_factory(
        Engine(exact.model, exact.tokenizer), ReplayOptions(mode="prefix", teacher_force=True)
    )
    reports = {name: ReplayReport(mode=name, model="smollm2") for name in factories}
    replay_interleaved(read_transcripts(args.transcript), factories, reports, teacher_force=True)
    baseline = reports["exact"].turns
    prefix_p95 = reports["prefix"].totals()["ttft_p95_s"]
    changed = [i for i, turn in enumerate(baseline) if turn.cached_tokens < turn.prompt_tokens - 200]

    def worst_change(report: ReplayReport) -> str:
        if report.mode == "prefix":
            return "(other contexts)"
        return f"{max(abs(a.reply_nll - b.reply_nll) for a, b in zip(report.turns, baseline, strict=True)):.4f}"

    def heavy_ttft(report: ReplayReport) -> str:
        """TTFT summed over the turns where exact reuse recomputed over 200 tokens (compactions)."""
        return f"{sum(report.turns[i].ttft_s for i in changed):.2f}"

    rows = [
        ("prefill tokens", total("prefill_tokens", "{:,}")),
        ("of the cached tokens, approximate", total("approximate_tokens", "{:,}")),
        ("hit rate (approximate included)", total("hit_rate", "{:.1%}")),
        ("TTFT sum (s)", total("ttft_s", "{:.2f}")),
        ("TTFT p95 (s)", total("ttft_p95_s", "{:.3f}")),
        ("TTFT p95 / prefix's", lambda r: f"{r.totals()['ttft_p95_s'] / prefix_p95:.2f}×"),
        (f"TTFT over the {len(changed)} heavy turns of exact (s)", heavy_ttft),
        ("compactions per 10 turns", total("compactions_per_10_turns", "{:.2f}")),
        ("reply_nll", total("reply_nll", "{:.4f}")),
        ("max per-turn reply_nll change vs exact clm", worst_change),
    ]
    print_table(
        reports, rows, f"{args.transcript.name}, {len(baseline)} turns, clm teacher-forced, budget {args.budget}"
    )


def kv_hit(args: argparse.Namespace) -> None:
    """Logits of a prompt whose first ``--context`` tokens are served from the pool (no
    spare arena holds them), per pool dtype, against a full fp32 recompute."""
    import torch

    from clm_middleware.cache import PoolConfig
    from clm_middleware.cache.arena import ArenaRecycler

    exact = build_engine()
    prompt = exact.tokenizer.encode(args.transcript.read_text())[: args.context]
    follow = prompt + exact.tokenizer.encode(" And what about tomorrow?")
    with torch.no_grad():
        reference = exact.model(torch.tensor([follow])).logits[0, -1]
    print(f"SmolLM2, {len(prompt)} tokens served from the pool, then {len(follow) - len(prompt)} computed")
    print("| pool kv_dtype | max abs logit diff vs recompute | same argmax | log p of the argmax, diff |")
    print("| --- | --- | --- | --- |")
    for name in (None, "bf16", "fp16"):
        engine = Engine(exact.model, exact.tokenizer, pool_config=PoolConfig(kv_dtype=name))
        engine.generate(prompt, max_new_tokens=0).result()
        engine.runner.arenas = ArenaRecycler(engine.layout, engine.block_size)  # the hit must come from the pool
        generation = engine.generate(follow, max_new_tokens=1, return_logits=True).result()
        assert generation.stats.cached_tokens == len(prompt)
        logits = generation.logits[0]
        top = int(reference.argmax())
        gap = float(torch.log_softmax(logits, -1)[top] - torch.log_softmax(reference, -1)[top])
        same = int(logits.argmax()) == top
        print(f"| {name or 'fp32'} | {float((logits - reference).abs().max()):.2e} | {same} | {gap:+.2e} |")


def decode(args: argparse.Namespace) -> None:
    """Prefill 1,024 tokens from scratch (chunks after the first carry a mask) and decode
    64 greedily, per attention path, alternating; and which SDPA kernel each one runs."""
    from clm_middleware.engine.attention import GQA_SDPA, use_gqa_attention

    engine = build_engine()
    model, text = engine.model, BUNDLED.read_text()
    prompt = engine.tokenizer.encode(text)[: args.context]
    use_gqa_attention(model)
    paths = {"repeat_kv (transformers sdpa)": "sdpa", "enable_gqa": GQA_SDPA}
    rates: dict[str, dict[str, list[float]]] = {name: {"prefill": [], "decode": []} for name in paths}
    for round_ in range(args.rounds):
        names = list(paths)[round_ % 2 :] + list(paths)[: round_ % 2]
        for name in names:
            model.set_attn_implementation(paths[name])
            generation = engine.generate(prompt, max_new_tokens=64, use_pool=False, stop_token_ids=[]).result()
            stats = generation.stats
            rates[name]["prefill"].append(stats.prefill_tokens / stats.ttft_s)
            rates[name]["decode"].append((stats.generated_tokens - 1) / stats.decode_s)
    print(f"SmolLM2, context {len(prompt)} tokens, 64 generated, {args.rounds} rounds alternating; median tok/s")
    print("| attention | prefill tok/s | decode tok/s | aten calls, 512-token prompt + 1 decode step |")
    print("| --- | --- | --- | --- |")
    for name, implementation in paths.items():
        model.set_attn_implementation(implementation)
        prefill, step = (sorted(rates[name][k])[len(rates[name][k]) // 2] for k in ("prefill", "decode"))
        print(f"| {name} | {prefill:.1f} | {step:.2f} | {kernels(engine, prompt)} |")


def attention_op(args: argparse.Namespace) -> None:
    """One layer's SDPA call on SmolLM2's shapes (9 query heads, 3 K/V heads, head_dim 64),
    laid out as in the engine (queries transposed, K/V views of an arena), with a mask:
    repeat_kv + SDPA (transformers) against SDPA ``enable_gqa``; median of alternating calls."""
    import statistics

    import torch
    from transformers.integrations.sdpa_attention import repeat_kv

    sdpa = torch.nn.functional.scaled_dot_product_attention
    print("| queries × keys | repeat_kv + SDPA (ms) | enable_gqa (ms) | ratio | max abs diff |")
    print("| --- | --- | --- | --- | --- |")
    for q_length, kv_length in ((32, 1024), (256, 512), (256, 1024)):
        query = torch.randn(1, q_length, 9, 64).transpose(1, 2)
        keys, values = torch.randn(3, 2048, 64), torch.randn(3, 2048, 64)
        key, value = keys[:, :kv_length].unsqueeze(0), values[:, :kv_length].unsqueeze(0)
        mask = torch.ones(q_length, kv_length, dtype=torch.bool).tril(kv_length - q_length)[None, None]
        variants = {
            "repeat_kv": lambda q=query, k=key, v=value, m=mask: sdpa(q, repeat_kv(k, 3), repeat_kv(v, 3), attn_mask=m),
            "enable_gqa": lambda q=query, k=key, v=value, m=mask: sdpa(q, k, v, attn_mask=m, enable_gqa=True),
        }
        seconds: dict[str, list[float]] = {name: [] for name in variants}
        for _ in range(args.rounds):
            for name, call in variants.items():
                tick = time.perf_counter()
                call()
                seconds[name].append(time.perf_counter() - tick)
        copied, shared = (statistics.median(seconds[name]) * 1e3 for name in variants)
        diff = float((variants["repeat_kv"]() - variants["enable_gqa"]()).abs().max())
        print(f"| {q_length} × {kv_length} | {copied:.2f} | {shared:.2f} | {copied / shared:.2f}× | {diff:.1e} |")


def kernels(engine: Engine, prompt: list[int]) -> str:
    """The aten SDPA kernels and ``expand`` calls (``repeat_kv`` is one per K and V per
    layer) of a 512-token prompt (a square chunk, then a masked one) and one decode step."""
    import torch

    with torch.profiler.profile() as profile:
        engine.generate(prompt[:512], max_new_tokens=2, use_pool=False, stop_token_ids=[]).result()
    counts: dict[str, int] = {}
    for event in profile.events():
        if event.name.startswith("aten::_scaled_dot_product") or event.name == "aten::expand":
            counts[event.name] = counts.get(event.name, 0) + 1
    return ", ".join(f"{name.removeprefix('aten::')} ×{count}" for name, count in sorted(counts.items()))


def total(name: str, form: str):
    """A table cell: ``report.totals()[name]`` formatted with ``form`` ("—" where the mode has none)."""

    def cell(report: ReplayReport) -> str:
        value = report.totals().get(name)
        return "—" if value is None else form.format(value)

    return cell


def replay_kv_rows(baseline: list, baseline_name: str) -> list:
    """The rows every KV comparison of a teacher-forced replay prints: memory, prefill,
    reply_nll and its largest per-turn change against ``baseline``'s turns, TTFT."""
    mib = 2**20
    return [
        ("peak pool KV (MiB)", lambda r: f"{r.totals()['peak_pool_bytes'] / mib:.1f}"),
        ("peak KV, pool + working (MiB)", lambda r: f"{r.totals()['peak_kv_bytes'] / mib:.1f}"),
        ("prefill tokens", total("prefill_tokens", "{:,}")),
        ("reply_nll", total("reply_nll", "{:.5f}")),
        (
            f"max per-turn reply_nll change vs {baseline_name}",
            lambda r: f"{max(abs(a.reply_nll - b.reply_nll) for a, b in zip(r.turns, baseline, strict=True)):.5f}",
        ),
        ("TTFT sum (s)", total("ttft_s", "{:.2f}")),
    ]


def print_table(reports: dict[str, ReplayReport], rows, caption: str) -> None:
    print(caption)
    print("| metric | " + " | ".join(reports) + " |")
    print("| --- |" + " --- |" * len(reports))
    for label, cell in rows:
        print(f"| {label} | " + " | ".join(cell(report) for report in reports.values()) + " |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    command = commands.add_parser("reuse", help="block-granular vs token-exact prefix reuse")
    command.add_argument("transcript", type=Path, nargs="?", default=BUNDLED)
    command.set_defaults(run=reuse)
    command = commands.add_parser("kv-dtype", help="pool storage dtype: peak KV and reply_nll")
    command.add_argument("transcript", type=Path, nargs="?", default=BUNDLED)
    command.set_defaults(run=kv_dtype)
    command = commands.add_parser("blend", help="clm at a budget: exact vs approximate reuse")
    command.add_argument("transcript", type=Path, nargs="?", default=BUNDLED)
    command.add_argument("--budget", type=int, default=1024)
    command.add_argument("--shares", type=float, nargs="+", default=[0.15, 0.3])
    command.set_defaults(run=blend)
    command = commands.add_parser("paged", help="working arena vs paged_kv: peak KV, TTFT, decode")
    command.add_argument("transcript", type=Path, nargs="?", default=BUNDLED)
    command.add_argument("--context", type=int, default=1024)
    command.add_argument("--rounds", type=int, default=3)
    command.set_defaults(run=paged)
    command = commands.add_parser("attention-op", help="one SDPA call: repeat_kv vs enable_gqa")
    command.add_argument("--rounds", type=int, default=30)
    command.set_defaults(run=attention_op)
    command = commands.add_parser("kv-hit", help="logits of a pool-served hit per pool dtype")
    command.add_argument("transcript", type=Path, nargs="?", default=BUNDLED)
    command.add_argument("--context", type=int, default=1024)
    command.set_defaults(run=kv_hit)
    command = commands.add_parser("decode", help="prefill and decode tokens/s per attention path")
    command.add_argument("--context", type=int, default=1024)
    command.add_argument("--rounds", type=int, default=3)
    command.set_defaults(run=decode)
    args = parser.parse_args()
    started = time.perf_counter()
    args.run(args)
    print(f"({time.perf_counter() - started:.0f} s)")


if __name__ == "__main__":
    main()
