"""What `clm eval retention` and `clm eval answers` replay: the variants, and their inputs."""

from __future__ import annotations

import shlex
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import click

from clm_middleware.cli.options import OutputPath, format_option
from clm_middleware.errors import ClmError


def eval_options(*, default_tagging: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """TRANSCRIPT..., --format, --probes, --budget, --tagging, --compression, --report, --markdown."""

    def apply(command: Callable[..., Any]) -> Callable[..., Any]:
        decorators = [
            click.argument("transcripts", nargs=-1, required=True, type=click.Path(path_type=Path)),
            format_option,
            click.option(
                "--probes",
                "probes_paths",
                type=click.Path(path_type=Path),
                multiple=True,
                help='JSON list of {"question", "answer", "alternatives"?}; once per TRANSCRIPT, in order '
                "[default: each TRANSCRIPT's FILE.probes.json next to it].",
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
                callback=_known_taggings,
                help="clm tagging modes to run, comma-separated.",
            ),
            click.option(
                "--compression",
                type=click.Choice(["auto", "extractive", "abstractive"]),
                default="auto",
                show_default=True,
            ),
            click.option("--report", "report_path", type=OutputPath(), help="Write the results as JSON here."),
            click.option(
                "--markdown",
                "markdown_path",
                type=OutputPath(),
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
    from clm_middleware.lifecycle.modes import TAGGING_MODES

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


def _known_taggings(ctx: click.Context, param: click.Parameter, value: str) -> str:
    """Refuse an unknown mode when the options are parsed, before any model loads."""
    from clm_middleware.lifecycle.modes import TAGGING_MODES

    given = [m.strip() for m in value.split(",") if m.strip()]
    unknown = sorted(set(given) - set(TAGGING_MODES))
    if unknown:
        raise click.BadParameter(f"unknown tagging modes {unknown}; use {', '.join(TAGGING_MODES)}")
    if not given or len(set(given)) != len(given):
        raise click.BadParameter(f"give one or more distinct tagging modes from {', '.join(TAGGING_MODES)}")
    return value


@dataclass(frozen=True, slots=True)
class EvalInput:
    """One transcript file to evaluate, its conversations and its probes."""

    path: Path
    transcripts: list[Any]
    probes: list[Any]
    label: str  # its name in tables: the file name, or as much of its path as tells it from the others


def file_labels(paths: Sequence[Path]) -> list[str]:
    """Each path's file name, lengthened by parent folders (``a/x.jsonl``, ``b/x.jsonl``)
    until no two different paths share a label; the same path given twice keeps one."""
    distinct = list(dict.fromkeys(paths))
    labels = {}
    for path in distinct:
        depth = 1
        while depth < len(path.parts) and any(
            other != path and other.parts[-depth:] == path.parts[-depth:] for other in distinct
        ):
            depth += 1
        labels[path] = "/".join(path.parts[-depth:])
    return [labels[path] for path in paths]


def read_inputs(paths: Sequence[Path], transcript_format: str, probes_paths: Sequence[Path]) -> list[EvalInput]:
    """Each file with its probes: ``--probes`` given once per file in order, or none at all,
    and then each file's ``FILE.probes.json`` (a missing one is an error naming both)."""
    from clm_middleware.evaluation.probes import read_probes
    from clm_middleware.evaluation.sessions import default_probes_path
    from clm_middleware.replay.formats import read_transcripts

    if probes_paths and len(probes_paths) != len(paths):
        raise click.BadParameter(
            f"give --probes once per transcript ({len(paths)}), or not at all to use FILE.probes.json",
            param_hint="--probes",
        )
    inputs = []
    labels = file_labels(paths)
    seen: set[Path] = set()
    for index, path in enumerate(paths):
        if path.resolve() in seen:  # the overall row would count its probes twice
            raise click.BadParameter(f"{path}: given twice", param_hint="TRANSCRIPTS")
        seen.add(path.resolve())
        if path.is_dir():
            raise click.BadParameter(f"{path}: is a directory, not a transcript", param_hint="TRANSCRIPTS")
        if not path.exists():  # named as the transcript it is, not by the probes file beside it
            raise click.BadParameter(f"{path}: no such file", param_hint="TRANSCRIPTS")
        probes_path = probes_paths[index] if probes_paths else default_probes_path(path)
        if not probes_paths and not probes_path.exists():
            raise click.BadParameter(f"{path}: no probes file {probes_path}; pass --probes", param_hint="--probes")
        item = EvalInput(path, read_transcripts(path, transcript_format), read_probes(probes_path), labels[index])
        _warn_unanswerable(item, probes_path)
        inputs.append(item)
    return inputs


def _warn_unanswerable(item: EvalInput, probes_path: Path) -> None:
    """Warn (on stderr) about probes whose answer the transcript never says: no variant,
    keep-all included, can retain them, so they only lower every row alike."""
    from clm_middleware.replay.transcript_text import message_text

    said = "\n".join(message_text(m) for t in item.transcripts for m in t.messages)
    absent = [p.answer for p in item.probes if not p.retained_in(said)]
    if absent:
        shown = ", ".join(repr(a) for a in absent[:5]) + (f" and {len(absent) - 5} more" if len(absent) > 5 else "")
        click.echo(
            f"warning: {probes_path}: {len(absent)} probe answer(s) never said in {item.path}: {shown} "
            "(no variant can retain them)",
            err=True,
        )


OVERALL = "OVERALL"


def print_table(title: str, header: list[str], rows: list[list[str]]) -> None:
    """The results on stdout: the file and variant columns left-aligned, the figures right-aligned.

    No cell is ever cut: each column is at least as wide as its widest cell, and a table
    wider than the terminal is printed whole (the terminal wraps its lines)."""
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    from clm_middleware.cli.output import print_whole

    table = Table(title=Text(title), title_justify="left")
    for column in header:
        table.add_column(column, justify="left" if column in ("file", "variant") else "right")
    for previous, row in zip([None, *rows], rows, strict=False):
        if row[0] == OVERALL and (previous is None or previous[0] != OVERALL):
            table.add_section()  # a rule above the overall rows
        table.add_row(*map(Text, row))  # file names and answers as said, never markup
    print_whole(Console(emoji=False), table)


def with_files(
    inputs: Sequence[EvalInput], per_file: Sequence[list[list[str]]], overall: list[list[str]]
) -> list[list[str]]:
    """Rows prefixed by a file column: each file's variants, then the ``OVERALL`` ones."""
    rows = [[item.label, *row] for item, file_rows in zip(inputs, per_file, strict=True) for row in file_rows]
    return rows + [[OVERALL, *row] for row in overall]


@dataclass(frozen=True, slots=True)
class VariantFailure:
    """A variant that failed on a file: it is left out of every file's results."""

    path: Path
    label: str  # the file's name in tables
    variant: str
    error: ClmError

    def as_dict(self) -> dict[str, str]:
        return {"transcript": str(self.path), "variant": self.variant, "error": self.error.message}


def run_files(
    inputs: Sequence[EvalInput],
    taggings: str,
    budget: int,
    compression: str,
    first: Any,
    per_variant: Callable[[EvalInput, str, Any, Any, Any], Any],
) -> tuple[list[list[Any]], list[VariantFailure]]:
    """Replay every file under every variant (truncation, keep-all, each tagging) on its
    own sibling engine of ``first``; ``per_variant(item, name, engine, lifecycle, retention)`` makes
    the result kept for it. One list of results per file, in variant order, and the failures.

    A variant that fails on a file (e.g. a budget under one tagging mode's protocol prompt)
    is said on stderr, not run on later files and left out of every file's results, so
    the others finish and are reported (what they cost is not lost); when every variant
    fails, the first failure is raised at once."""
    from rich.console import Console
    from rich.markup import escape

    from clm_middleware.cli.setup import driver_factory, sibling_engine
    from clm_middleware.evaluation.retention import run_variant

    stderr = Console(stderr=True, emoji=False)  # "clm:free:" is not an emoji
    planned = variants(taggings, budget, compression)
    per_file: list[list[Any]] = []
    failures: list[VariantFailure] = []
    for item in inputs:
        results = []
        # options of its own per file: they hold the drivers the file's replay made, and a
        # file is judged on its own final contexts only
        for name, mode, lifecycle in variants(taggings, budget, compression):
            if any(f.variant == name for f in failures):
                continue
            stderr.print(f"[bold]{escape(item.label)} · {name}[/bold] …")
            engine = sibling_engine(first)
            try:
                retention = run_variant(name, engine, item.transcripts, item.probes, driver_factory, lifecycle, mode)
            except ClmError as error:
                failures.append(VariantFailure(item.path, item.label, name, error))
                if len(failures) == len(planned):  # nothing left to run: the run's error says it, once
                    raise failures_error(failures[:1]) from error
                stderr.print(f"[red]error:[/red] {escape(f'{item.label} · {name}: {error.message}')}", highlight=False)
                continue
            results.append(per_variant(item, name, engine, lifecycle, retention))
        per_file.append(results)
    failed = {f.variant for f in failures}
    return [[r for r in results if r.name not in failed] for results in per_file], failures


def failures_error(failures: Sequence[VariantFailure]) -> ClmError:
    """The error a run with failed variants ends with (after the others are reported)."""
    said = "; ".join(f"{f.label} · {f.variant}: {f.error.message}" for f in failures)
    hints = {f.error.hint for f in failures if f.error.hint}
    return ClmError(
        f"{len(failures)} variant(s) failed: {said}" if len(failures) > 1 else said,
        hint="; ".join(sorted(hints)) or "--tagging picks which clm variants run",
    )


def table_rows(
    inputs: Sequence[EvalInput],
    header: list[str],
    rows_of: Callable[[Sequence[Any]], list[list[str]]],
    per_file: Sequence[Sequence[Any]],
    total: Sequence[Any],
) -> tuple[str, list[str], list[list[str]]]:
    """``(title, header, rows)`` of the results table: the variants of one file, or a row
    per file and variant then the OVERALL rows."""
    if len(inputs) == 1:
        return inputs[0].path.name, header, rows_of(total)
    return f"{len(inputs)} files", ["file", *header], with_files(inputs, [rows_of(r) for r in per_file], rows_of(total))


def files_report(
    report: dict[str, Any],
    inputs: Sequence[EvalInput],
    per_file: Sequence[Sequence[Any]],
    failures: Sequence[VariantFailure] = (),
) -> dict[str, Any]:
    """``report`` (overall figures) with where they come from: ``transcript`` for one
    file (the one-file shape, unchanged), else ``transcripts`` and a ``files`` entry each;
    ``failed`` lists the variants left out, when any failed."""
    if failures:
        report = {**report, "failed": [f.as_dict() for f in failures]}
    if len(inputs) == 1:
        return {"transcript": str(inputs[0].path), **report}
    return {
        **report,
        "transcripts": [str(item.path) for item in inputs],
        "files": [
            {"transcript": str(item.path), "probes": len(item.probes), "variants": [r.as_dict() for r in results]}
            for item, results in zip(inputs, per_file, strict=True)
        ],
    }


def markdown_table(header: list[str], rows: list[list[str]]) -> list[str]:
    return [
        "| " + " | ".join(header) + " |",
        "|" + " --- |" * len(header),
        *("| " + " | ".join(r) + " |" for r in rows),
    ]


def write_markdown(path: Path, summary: str, body: list[str], failures: Sequence[VariantFailure] = ()) -> None:
    """``Command: `clm ...``` (this process's own arguments), ``summary``, then ``body``
    lines, then the failed variants, if any."""
    command = "clm " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    failed = [f"- {f.label} · {f.variant}: {f.error.message}" for f in failures]
    if failed:
        failed = ["", "Failed (left out of every row):", "", *failed]
    path.parent.mkdir(parents=True, exist_ok=True)
    text = "\n".join([f"Command: `{command}`", "", summary, "", *body, *failed]) + "\n"
    path.write_text(text, encoding="utf-8")
