"""What `clm eval retention` and `clm eval answers` replay: the variants, and their inputs."""

from __future__ import annotations

import shlex
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from clm_middleware.cli.options import format_option


def eval_options(*, default_tagging: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """TRANSCRIPT, --format, --probes, --budget, --tagging, --compression, --report, --markdown."""

    def apply(command: Callable[..., Any]) -> Callable[..., Any]:
        decorators = [
            click.argument("transcript", type=click.Path(path_type=Path)),
            format_option,
            click.option(
                "--probes",
                "probes_path",
                type=click.Path(path_type=Path),
                required=True,
                help='JSON list of {"question", "answer", "alternatives"?}.',
            ),
            click.option(
                "--budget",
                type=click.IntRange(min=64),
                required=True,
                help="Context budget in tokens for clm and truncation.",
            ),
            click.option(
                "--tagging",
                "taggings",
                default=default_tagging,
                show_default=True,
                help="clm tagging modes to run, comma-separated.",
            ),
            click.option(
                "--compression",
                type=click.Choice(["auto", "extractive", "abstractive"]),
                default="auto",
                show_default=True,
            ),
            click.option(
                "--report", "report_path", type=click.Path(path_type=Path), help="Write the results as JSON here."
            ),
            click.option(
                "--markdown",
                "markdown_path",
                type=click.Path(path_type=Path),
                help="Write the results as markdown here.",
            ),
        ]
        for decorator in reversed(decorators):
            command = decorator(command)
        return command

    return apply


def variants(taggings: str, budget: int, compression: str) -> list[tuple[str, str, Any]]:
    """``(name, replay mode, LifecycleOptions)``: ``clm:<tagging>`` per mode asked for, then
    truncation to the same budget, then keep-all; an unknown tagging mode is a usage error."""
    from clm_middleware.cli.setup import LifecycleOptions
    from clm_middleware.evaluation.retention import KEEP_ALL, TRUNCATE
    from clm_middleware.lifecycle.tagging import TAGGING_MODES

    modes = [m.strip() for m in taggings.split(",") if m.strip()]
    unknown = sorted(set(modes) - set(TAGGING_MODES))
    if unknown:
        raise click.BadParameter(
            f"unknown tagging modes {unknown}; use {', '.join(TAGGING_MODES)}", param_hint="--tagging"
        )
    planned: list[tuple[str, str, Any]] = [
        (f"clm:{m}", "clm", LifecycleOptions(budget=budget, tagging=m, compression=compression)) for m in modes
    ]
    return [*planned, (TRUNCATE, "truncate", LifecycleOptions(budget=budget)), (KEEP_ALL, "prefix", LifecycleOptions())]


def read_inputs(transcript: Path, transcript_format: str, probes_path: Path) -> tuple[list[Any], list[Any]]:
    from clm_middleware.evaluation.probes import read_probes
    from clm_middleware.replay.formats import read_transcripts

    return read_transcripts(transcript, transcript_format), read_probes(probes_path)


def print_table(title: str, header: list[str], rows: list[list[str]]) -> None:
    """The results on stdout: the variant column left-aligned, the figures right-aligned."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title, title_justify="left")
    for column in header:
        table.add_column(column, justify="left" if column == "variant" else "right", no_wrap=True)
    for row in rows:
        table.add_row(*row)
    Console().print(table)


def markdown_table(header: list[str], rows: list[list[str]]) -> list[str]:
    return [
        "| " + " | ".join(header) + " |",
        "|" + " --- |" * len(header),
        *("| " + " | ".join(r) + " |" for r in rows),
    ]


def write_markdown(path: Path, summary: str, body: list[str]) -> None:
    """``Command: `clm ...``` (this process's own arguments), ``summary``, then ``body`` lines."""
    command = "clm " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join([f"Command: `{command}`", "", summary, "", *body]) + "\n", encoding="utf-8")
