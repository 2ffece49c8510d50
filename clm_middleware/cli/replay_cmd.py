"""``clm replay``: one transcript file, one mode, a per-turn table and a JSON report."""

from __future__ import annotations

import sys
from pathlib import Path

import click
from rich.console import Console

from clm_middleware.cli.options import generation_options, lifecycle_options, model_options


@click.command()
@click.argument("transcript", type=click.Path(path_type=Path))
@click.option(
    "--mode",
    type=click.Choice(["stateless", "prefix", "truncate", "clm"]),
    default="prefix",
    show_default=True,
    help="stateless: re-prefill the whole chat every turn; prefix: reuse cached blocks; "
    "truncate: keep the newest messages that fit --budget; "
    "clm: the model manages its context (lifecycle labels, budget, compression).",
)
@generation_options
@lifecycle_options
@click.option("--report", "report_path", type=click.Path(path_type=Path), help="Write the JSON report here.")
@model_options
@click.option("--quiet", is_flag=True, help="No per-turn table or progress bar; print only the totals.")
def replay(
    transcript: Path,
    mode: str,
    max_new_tokens: int,
    teacher_force: bool,
    budget: int | None,
    k: int,
    tagging: str,
    compression: str,
    db: Path | None,
    report_path: Path | None,
    model: str | None,
    device: str,
    dtype: str,
    block_size: int,
    max_kv_bytes: int | None,
    quiet: bool,
) -> None:
    """Replay TRANSCRIPT (JSONL of {"role", "content"}) and report cache use per turn."""
    from clm_middleware.cli.output import summary_table, turn_progress, turn_table
    from clm_middleware.cli.setup import (
        LifecycleOptions,
        build_engine,
        driver_factory,
        final_context_fields,
    )
    from clm_middleware.replay.report import ReplayReport
    from clm_middleware.replay.runner import ReplayOptions, count_turns
    from clm_middleware.replay.runner import replay as run_replay
    from clm_middleware.replay.transcript import read_jsonl

    transcripts = read_jsonl(transcript)
    options = ReplayOptions(mode=mode, max_new_tokens=max_new_tokens, teacher_force=teacher_force)
    lifecycle = LifecycleOptions(
        budget=budget, k=k, tagging=tagging, compression=compression, db=str(db) if db else None
    )
    engine = build_engine(model, device=device, dtype=dtype, block_size=block_size, max_kv_bytes=max_kv_bytes)
    settings = {
        "transcript": str(transcript),
        "max_new_tokens": max_new_tokens,
        "teacher_force": teacher_force,
        "block_size": engine.block_size,
    }
    if mode in ("clm", "truncate"):
        settings.update(lifecycle.settings())
    report = ReplayReport(mode=mode, model=engine.model_name, settings=settings)
    stdout, stderr = Console(), Console(stderr=True)
    try:
        with turn_progress(count_turns(transcripts), stderr, enabled=not quiet) as advance:
            run_replay(
                transcripts,
                driver_factory(engine, options, lifecycle),
                report,
                teacher_force=teacher_force,
                on_turn=lambda _: advance(),
            )
    except KeyboardInterrupt:
        report.extra.update(final_context_fields(lifecycle))
        if report_path:
            report.write(report_path)
        stderr.print(f"interrupted after {len(report.turns)} turns")
        sys.exit(130)
    report.extra.update(final_context_fields(lifecycle))
    if report_path:
        report.write(report_path)
    if not quiet:
        stdout.print(turn_table(report))
    stdout.print(summary_table(report))
