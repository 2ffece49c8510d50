"""``clm bench``: the same transcript under several modes in one process, as ratios."""

from __future__ import annotations

import shlex
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click
from rich.console import Console
from rich.table import Table
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

if TYPE_CHECKING:
    from clm_middleware.replay.report import ReplayReport

BENCH_MODES = ("stateless", "prefix", "truncate", "clm")


@click.command()
@click.argument("transcript", type=click.Path(path_type=Path))
@format_option
@click.option(
    "--modes",
    default="stateless,prefix,clm",
    show_default=True,
    help=f"Comma-separated modes from {', '.join(BENCH_MODES)}; the first is the baseline of every ratio.",
)
@generation_options
@lifecycle_options
@model_options
@remote_engine_options
@click.option(
    "--probes",
    "probes_path",
    type=click.Path(path_type=Path),
    help="Probes JSON [default: FILE.probes.json beside the transcript].",
)
@click.option(
    "--markdown",
    "markdown_path",
    type=OutputPath(),
    help="Write the comparison as a markdown table here.",
)
@click.option(
    "--plot",
    "plot_path",
    type=PlotPath(),
    help="Write a PNG (or .pdf, .svg) of context and prefill tokens per turn, per mode.",
)
@click.option("--report-dir", type=OutputPath(folder=True), help="Write one JSON report per mode into this folder.")
@on_error_option
def bench(
    transcript: Path,
    transcript_format: str,
    modes: str,
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
    probes_path: Path | None,
    markdown_path: Path | None,
    plot_path: Path | None,
    report_dir: Path | None,
    on_error: str,
    **engine_options: Any,
) -> None:
    """Run TRANSCRIPT through each mode, turn by turn in rotating order, and print ratios.

    Each mode has its own pool over the same weights; ratios from one run are
    comparable on a noisy machine, single times are not.
    """
    check_engine_options(engine_options)  # a clash of engine options, before any model loads
    from clm_middleware.cli.output import print_whole, skipped_line, turn_progress
    from clm_middleware.cli.plot import plot_reports
    from clm_middleware.cli.read import read_or_report, remove_stale
    from clm_middleware.cli.runs import add_retention, finish_on_failure, load_probes, report_settings
    from clm_middleware.cli.setup import (
        LifecycleOptions,
        build_engine,
        driver_factory,
        sibling_engine,
    )
    from clm_middleware.errors import TranscriptError
    from clm_middleware.replay.bench import comparison_rows, header, to_markdown
    from clm_middleware.replay.report import Failure, ReplayReport
    from clm_middleware.replay.runner import ReplayOptions, count_turns, replay_interleaved

    chosen = [m.strip() for m in modes.split(",") if m.strip()]
    unknown = sorted(set(chosen) - set(BENCH_MODES))
    if unknown:
        raise click.BadParameter(
            f"unknown mode{'s' if len(unknown) > 1 else ''} {', '.join(unknown)}; use {', '.join(BENCH_MODES)}",
            param_hint="--modes",
        )
    if len(chosen) < 2 or len(set(chosen)) != len(chosen):
        raise click.BadParameter(f"give two or more distinct modes from {', '.join(BENCH_MODES)}", param_hint="--modes")
    if "truncate" in chosen and budget is None:
        raise click.BadParameter("the truncate mode needs --budget", param_hint="--budget")
    for warning in unused_lifecycle_options(click.get_current_context(), chosen):
        Console(stderr=True).print(Text(warning, style="yellow"))
    refuse_inputs_as_outputs(
        transcript_inputs([transcript], [probes_path]), {"--markdown": markdown_path, "--plot": plot_path}
    )
    skipped: list[TranscriptError] | None = [] if on_error == "skip" else None
    transcripts = read_or_report(
        transcript,
        transcript_format,
        skipped,
        {report_dir / f"{mode}.json": mode for mode in chosen} if report_dir else {},
    )
    remove_stale(markdown_path, plot_path)
    from clm_middleware.replay.formats import declared_tools_note

    if (note := declared_tools_note(transcripts)) is not None:
        Console(stderr=True).print(Text(f"warning: {note}", style="yellow"))
    probes = load_probes(transcript, probes_path)
    first = build_engine(**engine_options)
    if {"clm", "truncate"} & set(chosen):  # prefix and stateless ignore --budget
        check_budget_option(budget, first)
    factories, reports, lifecycles, engines = {}, {}, {}, {}
    for index, mode in enumerate(chosen):
        engine = first if index == 0 else sibling_engine(first)  # own pool, shared weights
        engines[mode] = engine
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
            db=str(db) if db and mode == "clm" else None,
            tenant=tenant,
        )
        if summarizer and mode == "clm":
            lifecycle.summarizer = build_engine(
                summarizer, device=engine_options["device"], dtype=engine_options["dtype"]
            )
        lifecycles[mode] = lifecycle
        factories[mode] = driver_factory(engine, options, lifecycle)
        settings = {**report_settings(transcript, options, engine, lifecycle), "on_error": on_error}
        reports[mode] = ReplayReport(mode=mode, model=first.model_name, settings=settings)
        reports[mode].failures.extend(Failure(str(error)) for error in skipped or [])
    stderr = Console(stderr=True)
    command = "clm " + " ".join(shlex.quote(arg) for arg in sys.argv[1:]) if sys.argv[1:] else "clm bench"

    baseline = chosen[0]
    turns = count_turns(transcripts)
    notes = [
        f"Model: {first.model_name}; {len(transcripts)} conversation(s), {turns} turns; "
        f"teacher-forced: {teacher_force}; budget: {budget}; tagging: {tagging}."
    ]

    def save() -> None:
        """Every output asked for, of the turns that finished (also when stopped early)."""
        first.close()  # spill to the disk tier, if one is set
        for mode, report in reports.items():
            add_retention(report, lifecycles[mode].drivers, probes)
        for mode, report in reports.items():  # zeros for the engines without a disk tier: every report has the fields
            report.disk_stats = engines[mode].disk_stats()
        if report_dir:
            for mode, report in reports.items():
                report.write(report_dir / f"{mode}.json")
        notes.extend(failure_notes(reports))
        if not all(report.complete for report in reports.values()):
            notes.append("The run was stopped before its end: the figures are of the turns that finished.")
        if markdown_path:
            markdown_path.parent.mkdir(parents=True, exist_ok=True)
            markdown_path.write_text(to_markdown(reports, baseline, command, notes), encoding="utf-8")
        if plot_path:
            plot_reports(reports, plot_path, f"{transcript.name} · {first.model_name}")

    def run() -> None:
        with turn_progress(count_turns(transcripts) * len(chosen), stderr, enabled=True) as advance:
            replay_interleaved(
                transcripts,
                factories,
                reports,
                teacher_force=teacher_force,
                on_turn=lambda *_: advance(),
                on_error=on_error,
                on_failure=lambda mode, failure: skipped_turn(mode, failure, advance),
            )

    def skipped_turn(mode: str, failure: Failure, advance: Callable[[], None]) -> None:
        advance()
        stderr.print(f"{mode}: {skipped_line(failure)}", markup=False, highlight=False)

    finish_on_failure(run, save, stderr, reports=report_dir is not None or bool(markdown_path or plot_path))
    save()
    table = Table(title=Text(f"{transcript.name} · {first.model_name}"), title_justify="left")
    for index, name in enumerate(header(reports, baseline)):
        table.add_column(name, justify="left" if index == 0 else "right")
    for row in comparison_rows(reports, baseline):
        table.add_row(*map(Text, row))
    print_whole(Console(emoji=False), table)
    for note in notes[1:]:
        stderr.print(note, markup=False, highlight=False)


def failure_notes(reports: dict[str, ReplayReport]) -> list[str]:
    """What ``--on-error skip`` left out of each mode's figures."""
    notes = []
    for mode, report in reports.items():
        if report.failures:  # --on-error skip: the figures leave those turns out, the others' do not
            turns_left_out = ", ".join(str(f.turn) for f in report.failures if f.turn is not None) or "none"
            notes.append(
                f"{mode}: {len(report.failures)} failure(s) skipped (turns {turns_left_out}); "
                "its figures leave those turns out."
            )
    return notes
