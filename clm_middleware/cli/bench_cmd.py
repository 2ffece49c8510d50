"""``clm bench``: the same transcript under several modes in one process, as ratios."""

from __future__ import annotations

import shlex
import sys
from pathlib import Path

import click
from rich.console import Console
from rich.table import Table

from clm_middleware.cli.options import generation_options, lifecycle_options, model_options

BENCH_MODES = ("stateless", "prefix", "clm")


@click.command()
@click.argument("transcript", type=click.Path(path_type=Path))
@click.option(
    "--modes",
    default="stateless,prefix",
    show_default=True,
    help="Comma-separated modes; the first is the baseline of every ratio.",
)
@generation_options
@lifecycle_options
@model_options
@click.option(
    "--markdown",
    "markdown_path",
    type=click.Path(path_type=Path),
    help="Write the comparison as a markdown table here.",
)
@click.option(
    "--report-dir",
    type=click.Path(path_type=Path),
    help="Write one JSON report per mode into this folder.",
)
def bench(
    transcript: Path,
    modes: str,
    max_new_tokens: int,
    teacher_force: bool,
    budget: int | None,
    k: int,
    tagging: str,
    compression: str,
    db: Path | None,
    model: str | None,
    device: str,
    dtype: str,
    block_size: int,
    max_kv_bytes: int | None,
    markdown_path: Path | None,
    report_dir: Path | None,
) -> None:
    """Run TRANSCRIPT through each mode, turn by turn in rotating order, and print ratios."""
    from clm_middleware.cli.output import turn_progress
    from clm_middleware.cli.setup import (
        LifecycleOptions,
        build_engine,
        driver_factory,
        final_context_fields,
        sibling_engine,
    )
    from clm_middleware.replay.bench import comparison_rows, header, to_markdown
    from clm_middleware.replay.report import ReplayReport
    from clm_middleware.replay.runner import ReplayOptions, count_turns, replay_interleaved
    from clm_middleware.replay.transcript import read_jsonl

    chosen = [m.strip() for m in modes.split(",") if m.strip()]
    unknown = sorted(set(chosen) - set(BENCH_MODES))
    if unknown or len(chosen) < 2 or len(set(chosen)) != len(chosen):
        raise click.BadParameter(f"give two or more distinct modes from {', '.join(BENCH_MODES)}", param_hint="--modes")
    transcripts = read_jsonl(transcript)
    first = build_engine(model, device=device, dtype=dtype, block_size=block_size, max_kv_bytes=max_kv_bytes)
    lifecycle = LifecycleOptions(
        budget=budget, k=k, tagging=tagging, compression=compression, db=str(db) if db else None
    )
    factories, reports = {}, {}
    for index, mode in enumerate(chosen):
        engine = first if index == 0 else sibling_engine(first)  # own pool, shared weights
        options = ReplayOptions(mode=mode, max_new_tokens=max_new_tokens, teacher_force=teacher_force)
        factories[mode] = driver_factory(engine, options, lifecycle)
        settings = {
            "transcript": str(transcript),
            **(lifecycle.settings() if mode == "clm" else {}),
        }
        reports[mode] = ReplayReport(mode=mode, model=first.model_name, settings=settings)
    stderr = Console(stderr=True)
    total = count_turns(transcripts) * len(chosen)
    try:
        with turn_progress(total, stderr, enabled=True) as advance:
            replay_interleaved(
                transcripts,
                factories,
                reports,
                teacher_force=teacher_force,
                on_turn=lambda *_: advance(),
            )
    except KeyboardInterrupt:
        stderr.print("interrupted; nothing written")
        sys.exit(130)
    if "clm" in reports:
        reports["clm"].extra.update(final_context_fields(lifecycle))
    baseline = chosen[0]
    table = Table(title=f"{transcript.name} · {first.model_name}", title_justify="left")
    for index, name in enumerate(header(reports, baseline)):
        table.add_column(name, justify="left" if index == 0 else "right")
    for row in comparison_rows(reports, baseline):
        table.add_row(*row)
    Console().print(table)
    command = "clm " + " ".join(shlex.quote(arg) for arg in sys.argv[1:]) if sys.argv[1:] else "clm bench"
    if markdown_path:
        markdown_path.parent.mkdir(parents=True, exist_ok=True)
        notes = [f"Model: {first.model_name}; {count_turns(transcripts)} turns; teacher-forced: {teacher_force}."]
        markdown_path.write_text(to_markdown(reports, baseline, command, notes), encoding="utf-8")
    if report_dir:
        for mode, report in reports.items():
            report.write(report_dir / f"{mode}.json")
