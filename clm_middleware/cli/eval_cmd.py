"""``clm eval``: measure what a context budget keeps (retention), and build test material for it."""

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

DEFAULT_TAGGINGS = "auto,signals,constrained,free,rules"


@click.group(name="eval")
def eval_group() -> None:
    """Retention evaluation: which facts survive a context budget."""


RETENTION_EPILOG = """\b
Several TRANSCRIPTs: one row per file and variant, then an OVERALL row per variant
(probes retained summed over files; tokens summed; shares of turn time weighted by it;
reply_nll, the teacher-forced replies' mean NLL, weighted by each file's scored_tokens).
The --report JSON: budget, probes (total), variants[] (overall; for one file, that
file's), and with several files transcripts[] and files[]: transcript, probes, variants[].
A variant that fails on a file (e.g. a budget under the protocol prompt) is said at once,
not run on later files and left out of every row; the others finish and are written, with
failed[]: transcript, variant, error; the command then exits 1.
"""


@eval_group.command(name="retention", epilog=RETENTION_EPILOG)
@eval_options(default_tagging=DEFAULT_TAGGINGS)
@model_options
def retention_command(
    transcripts: tuple[Path, ...],
    transcript_format: str,
    probes_paths: tuple[Path, ...],
    budget: int,
    taggings: str,
    compression: str,
    report_path: Path | None,
    markdown_path: Path | None,
    **engine_options: Any,
) -> None:
    """Replay each TRANSCRIPT teacher-forced under clm (each tagging mode), truncation and keep-all,
    and report the share of probes whose answer is still in the final context."""
    check_engine_options(engine_options)  # a clash of engine options, before any model loads
    from clm_middleware.cli.eval_variants import failures_error, read_inputs, run_files, table_rows, variants
    from clm_middleware.cli.read import remove_stale
    from clm_middleware.cli.setup import build_engine
    from clm_middleware.evaluation.retention import overall

    variants(taggings, budget, compression)  # a bad --tagging fails before any file is read
    refuse_inputs_as_outputs(
        transcript_inputs(transcripts, probes_paths), {"--report": report_path, "--markdown": markdown_path}
    )
    remove_stale(report_path, markdown_path)  # a run whose input cannot be read leaves none of an older run's
    inputs = read_inputs(transcripts, transcript_format, probes_paths)
    first = build_engine(**engine_options)
    check_budget_option(budget, first)
    per_file, failures = run_files(
        inputs, taggings, budget, compression, first, lambda item, name, engine, lifecycle, kept: kept
    )
    total = overall(per_file)
    probes = sum(len(item.probes) for item in inputs)
    header = [
        "variant",
        "retained",
        "context tokens",
        "prefill tokens",
        "reply nll",
        "lifecycle share",
        "signals share",
        "invented",
    ]
    title, table_header, rows = table_rows(inputs, header, _rows, per_file, total)
    print_table(f"retention · {title} · budget {budget} · {probes} probes", table_header, rows)
    if report_path:
        from clm_middleware.replay.report import write_json_atomic

        report: dict[str, Any] = {"budget": budget, "probes": probes, "variants": [r.as_dict() for r in total]}
        write_json_atomic(report_path, files_report(report, inputs, per_file, failures))
    if markdown_path:
        lines = markdown_table(table_header, rows)
        lines += ["", "Lost (answers not in the final context):", ""]
        for item, results in zip(inputs, per_file, strict=True):
            prefix = "" if len(inputs) == 1 else f"{item.label} · "
            lines += [f"- {prefix}{r.name}: " + (", ".join(f"`{a}`" for a in r.lost) or "none") for r in results]
        files = f" in {len(inputs)} files" if len(inputs) > 1 else ""
        write_markdown(
            markdown_path, f"{probes} probes{files}; budget {budget} tokens; model {first.model_name}.", lines, failures
        )
    if failures:
        raise failures_error(failures)


def _rows(results: list[Any]) -> list[list[str]]:
    rows = []
    for r in results:
        share, signals, invented = lifecycle_cells(r)
        rows.append(
            [
                r.name,
                f"{r.retained}/{r.probes} ({r.share:.0%})",
                f"{r.context_tokens:,}",
                f"{r.prefill_tokens:,}",
                "" if r.reply_nll is None else f"{r.reply_nll:.4f}",
                share,
                signals,
                invented,
            ]
        )
    return rows


def lifecycle_cells(result: Any) -> tuple[str, str, str]:
    """(lifecycle share, signals share, invented) of a replay's ``VariantResult``; blank for
    the variants without a lifecycle (truncate, keep-all)."""
    if result.lifecycle_share is None:
        return "", "", ""
    signals = "" if result.observation_share is None else f"{result.observation_share:.1%}"
    return f"{result.lifecycle_share:.1%}", signals, f"{result.invented} in {result.compressed_segments} compressed"


# registered here so `clm eval` lists it; it lives in its own module
from clm_middleware.cli.eval_answers_cmd import answers_command  # noqa: E402
from clm_middleware.cli.eval_build_cmd import generate_command, planted_command, session_command  # noqa: E402

for _command in (answers_command, planted_command, session_command, generate_command):
    eval_group.add_command(_command)
