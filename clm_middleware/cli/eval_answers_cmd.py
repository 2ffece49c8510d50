"""``clm eval answers``: ask each probe question of every variant's final context."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click

from clm_middleware.cli.eval_variants import eval_options, files_report, markdown_table, print_table, write_markdown
from clm_middleware.cli.options import (
    check_budget_option,
    check_engine_options,
    model_options,
    refuse_inputs_as_outputs,
    transcript_inputs,
)

ANSWERS_EPILOG = """\b
Several TRANSCRIPTs: one row per file and variant, then an OVERALL row per variant: the mean
gold logp over all probes pooled, and gap closed computed from those pooled means.
The --report JSON: transcript (one file) or transcripts[] and files[] (transcript, probes,
variants[]), budget, model, max_answer_tokens, probes (total), and variants[] (overall):
variant, context_tokens, probes, retained (answer string in the final context), hits (greedy
answer contains it), mean_gold_logprob (nats per token, mean over probes), gap_closed (clm
only: (clm - truncate) / (keep-all - truncate) of mean_gold_logprob; null when keep-all does not
score above truncation),
replay (the replay the answers were asked after, as `eval retention` reports it: retained, lost,
prefill_tokens, lifecycle_share, invented, compressed_segments, reply_nll: the token-weighted mean
NLL of the transcript's replies, teacher-forced, pooled over the files' reply tokens),
answers[]: question, answer, gold_mean_logprob, greedy_answer, hit, retained.
A variant that fails is left out and named in failed[] (transcript, variant, error), as in
`eval retention`; without truncate or keep-all, gap_closed is null. The command exits 1.
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
    transcripts: tuple[Path, ...],
    transcript_format: str,
    probes_paths: tuple[Path, ...],
    budget: int,
    taggings: str,
    compression: str,
    max_answer_tokens: int,
    report_path: Path | None,
    markdown_path: Path | None,
    **engine_options: Any,
) -> None:
    """Replay each TRANSCRIPT as `eval retention` does, then ask each probe question of every variant's
    final context: the gold answer's mean log-likelihood, and whether a greedy answer contains it."""
    check_engine_options(engine_options)  # a clash of engine options, before any model loads
    from clm_middleware.cli.eval_variants import failures_error, read_inputs, run_files, table_rows, variants
    from clm_middleware.cli.read import remove_stale
    from clm_middleware.cli.setup import build_engine
    from clm_middleware.evaluation.answers import answer_variant, close_gaps, overall
    from clm_middleware.evaluation.retention import KEEP_ALL, TRUNCATE

    def answered(item: Any, name: str, engine: Any, lifecycle: Any, kept: Any) -> Any:
        driver = lifecycle.drivers[-1]  # the last conversation's final context, as retention reads it
        return answer_variant(name, engine, driver, item.probes, max_answer_tokens=max_answer_tokens, replay=kept)

    variants(taggings, budget, compression)  # a bad --tagging fails before any file is read
    refuse_inputs_as_outputs(
        transcript_inputs(transcripts, probes_paths), {"--report": report_path, "--markdown": markdown_path}
    )
    remove_stale(report_path, markdown_path)  # a run whose input cannot be read leaves none of an older run's
    inputs = read_inputs(transcripts, transcript_format, probes_paths)
    for item in inputs:  # retention needs only the answer; a question is what this command asks
        unasked = next((n for n, p in enumerate(item.probes) if not p.question.strip()), None)
        if unasked is not None:
            raise click.BadParameter(
                f'the probes for {item.path}: probe {unasked} has no question to ask; give each a "question"',
                param_hint="--probes",
            )
    for item in inputs:
        if len(item.transcripts) > 1:  # which conversation's context would a question go to?
            raise click.BadParameter(
                f"{item.path}: holds {len(item.transcripts)} conversations; probes are asked of one "
                "conversation's final context: give each conversation its own file",
                param_hint="TRANSCRIPTS",
            )
    first = build_engine(**engine_options)
    check_budget_option(budget, first)
    per_file, failures = run_files(inputs, taggings, budget, compression, first, answered)
    for results in per_file:
        close_gaps(results, truncate=TRUNCATE, keep_all=KEEP_ALL)
    total = overall(per_file, truncate=TRUNCATE, keep_all=KEEP_ALL)
    probes = sum(len(item.probes) for item in inputs)
    header = [
        "variant",
        "context tokens",
        "retained",
        "greedy hits",
        "mean gold logp",
        "gap closed",
        "reply nll",
        "lifecycle share",
        "invented",
    ]
    title, table_header, rows = table_rows(inputs, header, _answer_rows, per_file, total)
    print_table(f"answers · {title} · budget {budget} · {probes} probes", table_header, rows)
    if report_path:
        from clm_middleware.replay.report import write_json_atomic

        report: dict[str, Any] = {
            "budget": budget,
            "model": first.model_name,
            "max_answer_tokens": max_answer_tokens,
            "probes": probes,
            "variants": [r.as_dict() for r in total],
        }
        write_json_atomic(report_path, files_report(report, inputs, per_file, failures))
    if markdown_path:
        lines = markdown_table(table_header, rows)
        for item, results in zip(inputs, per_file, strict=True):
            per_probe = [
                [
                    f"`{probe.answer}`",
                    *(f"{a.gold_mean_logprob:.2f}{' ✓' if a.hit else ''}" for a in (r.answers[i] for r in results)),
                ]
                for i, probe in enumerate(item.probes)
            ]
            where = "" if len(inputs) == 1 else f" · {item.label}"
            lines += ["", f"Per probe{where} (gold logp; ✓ greedy hit):", ""]
            lines += markdown_table(["answer", *(r.name for r in results)], per_probe)
        files = f" in {len(inputs)} files" if len(inputs) > 1 else ""
        summary = (
            f"{probes} probes{files}; budget {budget} tokens; model {first.model_name}; "
            f"greedy answers of at most {max_answer_tokens} tokens."
        )
        write_markdown(markdown_path, summary, lines, failures)
    if failures:
        raise failures_error(failures)


def _answer_rows(results: list[Any]) -> list[list[str]]:
    from clm_middleware.cli.eval_cmd import lifecycle_cells

    rows = []
    for r in results:
        mean = "" if r.mean_gold_logprob is None else f"{r.mean_gold_logprob:.3f}"
        gap = "" if r.gap_closed is None else f"{r.gap_closed:.0%}"
        nll = "" if r.replay is None or r.replay.reply_nll is None else f"{r.replay.reply_nll:.4f}"
        share, _, invented = lifecycle_cells(r.replay) if r.replay is not None else ("", "", "")
        rows.append(
            [
                r.name,
                f"{r.context_tokens:,}",
                f"{r.retained}/{r.probes}",
                f"{r.hits}/{r.probes}",
                mean,
                gap,
                nll,
                share,
                invented,
            ]
        )
    return rows
