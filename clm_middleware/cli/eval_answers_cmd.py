"""``clm eval answers``: ask each probe question of every variant's final context."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click
from rich.console import Console

from clm_middleware.cli.eval_variants import eval_options, markdown_table, print_table, write_markdown
from clm_middleware.cli.options import model_options

ANSWERS_EPILOG = """\b
The --report JSON: transcript, budget, model, max_answer_tokens, probes, and variants[]:
variant, context_tokens, probes, retained (answer string in the final context), hits (greedy
answer contains it), mean_gold_logprob (nats per token, mean over probes), gap_closed (clm
only: (clm - truncate) / (keep-all - truncate) of mean_gold_logprob; null when keep-all does not
score above truncation),
answers[]: question, answer, gold_mean_logprob, greedy_answer, hit, retained.
"""


@click.command(name="answers", epilog=ANSWERS_EPILOG)
@eval_options(default_tagging="auto")
@click.option(
    "--max-answer-tokens",
    type=click.IntRange(min=1),
    default=32,
    show_default=True,
    help="Length cap of each greedy answer.",
)
@model_options
def answers_command(
    transcript: Path,
    transcript_format: str,
    probes_path: Path,
    budget: int,
    taggings: str,
    compression: str,
    max_answer_tokens: int,
    report_path: Path | None,
    markdown_path: Path | None,
    **engine_options: Any,
) -> None:
    """Replay TRANSCRIPT as `eval retention` does, then ask each probe question of every variant's
    final context: the gold answer's mean log-likelihood, and whether a greedy answer contains it."""
    from clm_middleware.cli.eval_variants import read_inputs, variants
    from clm_middleware.cli.setup import build_engine, driver_factory, sibling_engine
    from clm_middleware.evaluation.answers import answer_variant, close_gaps
    from clm_middleware.evaluation.retention import KEEP_ALL, TRUNCATE, run_variant

    planned = variants(taggings, budget, compression)
    transcripts, probes = read_inputs(transcript, transcript_format, probes_path)
    first = build_engine(**engine_options)
    stderr = Console(stderr=True)
    results = []
    for name, mode, lifecycle in planned:
        stderr.print(f"[bold]{name}[/bold] …")
        engine = sibling_engine(first)
        run_variant(name, engine, transcripts, probes, driver_factory, lifecycle, mode)
        driver = lifecycle.drivers[-1]  # the last conversation's final context, as retention reads it
        results.append(answer_variant(name, engine, driver, probes, max_answer_tokens=max_answer_tokens))
    close_gaps(results, truncate=TRUNCATE, keep_all=KEEP_ALL)
    header = ["variant", "context tokens", "retained", "greedy hits", "mean gold logp", "gap closed"]
    print_table(f"answers · {transcript.name} · budget {budget} · {len(probes)} probes", header, _answer_rows(results))
    if report_path:
        from clm_middleware.replay.report import write_json_atomic

        write_json_atomic(
            report_path,
            {
                "transcript": str(transcript),
                "budget": budget,
                "model": first.model_name,
                "max_answer_tokens": max_answer_tokens,
                "probes": len(probes),
                "variants": [r.as_dict() for r in results],
            },
        )
    if markdown_path:
        per_probe = [
            [
                f"`{probe.answer}`",
                *(f"{a.gold_mean_logprob:.2f}{' ✓' if a.hit else ''}" for a in (r.answers[i] for r in results)),
            ]
            for i, probe in enumerate(probes)
        ]
        lines = markdown_table(header, _answer_rows(results))
        lines += ["", "Per probe (gold logp; ✓ greedy hit):", ""]
        lines += markdown_table(["answer", *(r.name for r in results)], per_probe)
        summary = (
            f"{len(probes)} probes; budget {budget} tokens; model {first.model_name}; "
            f"greedy answers of at most {max_answer_tokens} tokens."
        )
        write_markdown(markdown_path, summary, lines)


def _answer_rows(results) -> list[list[str]]:
    rows = []
    for r in results:
        mean = "" if r.mean_gold_logprob is None else f"{r.mean_gold_logprob:.3f}"
        gap = "" if r.gap_closed is None else f"{r.gap_closed:.0%}"
        rows.append(
            [
                r.name,
                f"{r.context_tokens:,}",
                f"{r.retained}/{r.probes}",
                f"{r.hits}/{r.probes}",
                mean,
                gap,
            ]
        )
    return rows
