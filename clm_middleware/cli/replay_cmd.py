"""``clm replay``: one transcript file, one mode, a per-turn table, a JSON report, a plot."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import click
from rich.console import Console
from rich.text import Text

from clm_middleware.cli.options import (
    OutputPath,
    PlotPath,
    check_budget_option,
    check_engine_options,
    format_option,
    generation_options,
    lifecycle_options,
    model_options,
    on_error_option,
    refuse_inputs_as_outputs,
    remote_engine_options,
    transcript_inputs,
    unused_lifecycle_options,
)

MODES = ("stateless", "prefix", "truncate", "clm")


@click.command()
@click.argument("transcript", type=click.Path(path_type=Path))
@format_option
@click.option(
    "--mode",
    type=click.Choice(MODES),
    default="prefix",
    show_default=True,
    help="stateless: re-prefill the whole chat every turn; prefix: reuse cached blocks; "
    "truncate: keep the newest messages that fit --budget; "
    "clm: the model manages its context (lifecycle labels, budget, compression).",
)
@generation_options
@lifecycle_options
@click.option("--report", "report_path", type=OutputPath(), help="Write the JSON report here.")
@click.option(
    "--plot", "plot_path", type=PlotPath(), help="Write a PNG (or .pdf, .svg) of context and prefill tokens per turn."
)
@click.option(
    "--probes",
    "probes_path",
    type=click.Path(path_type=Path),
    help="Probes JSON [default: FILE.probes.json beside the transcript].",
)
@model_options
@remote_engine_options
@click.option(
    "--limit", type=click.IntRange(min=1), default=None, help="Replay only the first N conversations of the file."
)
@on_error_option
@click.option(
    "--json",
    "json_lines",
    is_flag=True,
    help="Print one JSON object per turn (and the totals last) on stdout, for scripts; progress goes to stderr.",
)
@click.option("--quiet", is_flag=True, help="No per-turn table or progress bar; print only the totals.")
def replay(
    transcript: Path,
    transcript_format: str,
    mode: str,
    max_new_tokens: int,
    teacher_force: bool,
    temperature: float,
    top_p: float,
    top_k: int | None,
    min_p: float | None,
    seed: int | None,
    repetition_penalty: float | None,
    frequency_penalty: float,
    presence_penalty: float,
    no_repeat_ngram_size: int | None,
    budget: int | None,
    k: int,
    tagging: str,
    compression: str,
    compact_ahead: bool,
    db: Path | None,
    tenant: str | None,
    summarizer: str | None,
    report_path: Path | None,
    plot_path: Path | None,
    probes_path: Path | None,
    limit: int | None,
    on_error: str,
    json_lines: bool,
    quiet: bool,
    **engine_options: Any,
) -> None:
    """Replay TRANSCRIPT and report, turn by turn, what was cached, computed and kept.

    Several conversations in one file replay one after another through one pool, so
    prefixes they share (a system prompt, a document) are cache hits. TRANSCRIPT "-"
    reads standard input.
    """
    check_engine_options(engine_options)  # a clash of engine options, before any model loads
    from clm_middleware.cli.read import read_or_report, remove_stale
    from clm_middleware.errors import TranscriptError

    if mode == "truncate" and budget is None:  # before the model loads (seconds)
        raise click.BadParameter("the truncate mode needs --budget", param_hint="--budget")
    refuse_inputs_as_outputs(
        transcript_inputs([transcript], [probes_path]),
        {"--report": report_path, "--plot": plot_path, "--db": db},
    )
    # the file first: a bad transcript is named before torch and the model load (seconds)
    skipped: list[TranscriptError] | None = [] if on_error == "skip" else None
    reports = {report_path: mode} if report_path else {}
    transcripts = read_or_report(transcript, transcript_format, skipped, reports, mode if json_lines else None)
    transcripts = transcripts[:limit]
    remove_stale(plot_path)

    from clm_middleware.cli import json_lines as lines
    from clm_middleware.cli.output import replies_text, skipped_line, summary_table, turn_progress, turn_table
    from clm_middleware.cli.plot import plot_reports
    from clm_middleware.cli.runs import add_retention, finish_on_failure, load_probes, report_settings
    from clm_middleware.cli.setup import LifecycleOptions, build_engine, driver_factory
    from clm_middleware.replay.report import Failure, ReplayReport, TurnRecord
    from clm_middleware.replay.runner import ReplayOptions, count_turns
    from clm_middleware.replay.runner import replay as run_replay

    stderr = Console(stderr=True)
    from clm_middleware.replay.formats import declared_tools_note

    if (note := declared_tools_note(transcripts)) is not None:
        stderr.print(Text(f"warning: {note}", style="yellow"))
    for warning in unused_lifecycle_options(click.get_current_context(), [mode]):
        stderr.print(Text(warning, style="yellow"))  # e.g. stateless and prefix keep the whole history
    probes = load_probes(transcript, probes_path)
    options = ReplayOptions(
        mode=mode,
        max_new_tokens=max_new_tokens,
        teacher_force=teacher_force,
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        min_p=min_p,
        seed=seed,
        repetition_penalty=repetition_penalty,
        frequency_penalty=frequency_penalty,
        presence_penalty=presence_penalty,
        no_repeat_ngram_size=no_repeat_ngram_size,
    )
    lifecycle = LifecycleOptions(
        budget=budget,
        k=k,
        tagging=tagging,
        compression=compression,
        compact_ahead=compact_ahead,
        db=str(db) if db else None,
        tenant=tenant,
    )
    engine = build_engine(**engine_options)
    if mode in ("clm", "truncate"):
        check_budget_option(budget, engine)
    if summarizer and mode == "clm":
        lifecycle.summarizer = build_engine(summarizer, device=engine_options["device"], dtype=engine_options["dtype"])
    settings = {**report_settings(transcript, options, engine, lifecycle), "on_error": on_error}
    report = ReplayReport(mode=mode, model=engine.model_name, settings=settings)
    report.failures.extend(Failure(str(error)) for error in skipped or [])
    stdout = Console()

    def answered(record: TurnRecord, advance: Callable[[], None]) -> None:
        advance()
        if json_lines:
            lines.emit(lines.turn_line(record))

    told = 0  # report.failures[:told] are written: they are told in order, as they are appended

    def failed(failure: Failure, advance: Callable[[], None] = lambda: None) -> None:
        nonlocal told
        advance()
        told += 1
        if json_lines:
            lines.emit(lines.failure_line(failure))
        else:
            stderr.print(skipped_line(failure), markup=False, highlight=False)

    for failure in report.failures:  # the records left out while reading
        failed(failure)
    turns = count_turns(transcripts)
    if not turns:
        stderr.print(
            f"{transcript.name}: no turn to replay (a turn is a user or tool message the assistant answers)",
            markup=False,
            highlight=False,
        )

    def save() -> None:
        engine.close()  # spill to the disk tier, if one is set
        report.disk_stats = engine.disk_stats()
        add_retention(report, lifecycle.drivers, probes)
        if report_path:
            report.write(report_path)
        if plot_path and report.turns:
            plot_reports({mode: report}, plot_path, f"{transcript.name} · {mode}")

    def run() -> None:
        with turn_progress(turns, stderr, enabled=not quiet) as advance:
            run_replay(
                transcripts,
                driver_factory(engine, options, lifecycle),
                report,
                teacher_force=teacher_force,
                on_turn=lambda record: answered(record, advance),
                on_error=on_error,
                on_failure=lambda failure: failed(failure, advance),
            )

    def show() -> None:
        if not quiet:
            stdout.print(turn_table(report, width=stdout.width))
            replies = replies_text(report)
            if replies is not None:
                stdout.print(replies)
        stdout.print(summary_table(report))

    def stop() -> None:  # a failed turn under --on-error stop, Ctrl-C or SIGTERM
        report.complete = False
        save()
        if json_lines:
            for failure in report.failures[told:]:  # the one a stop raised on
                lines.emit(lines.failure_line(failure))
            lines.emit(lines.totals_line(report))
        elif report.turns:  # the turns that finished, as a run that ends shows them
            show()

    finish_on_failure(run, stop, stderr, reports=report_path is not None)
    save()
    if json_lines:
        lines.emit(lines.totals_line(report))
        return
    show()
