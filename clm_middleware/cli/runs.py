"""What replay-like commands share: building per-mode runs, probes, and finishing cleanly.

A run that fails, is interrupted (Ctrl-C) or terminated (SIGTERM) still writes the report of the turns it finished
(``complete: false``); a store, if one is used, holds every finished turn (one
transaction per turn), so nothing finished is lost.
"""

from __future__ import annotations

import signal
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click
from rich.console import Console

from clm_middleware.errors import ClmError
from clm_middleware.evaluation.probes import Probe, read_probes, retention, said_context
from clm_middleware.replay.formats import probes_beside
from clm_middleware.replay.report import ReplayReport
from clm_middleware.replay.runner import ReplayOptions


def report_settings(transcript: Path, options: ReplayOptions, engine: Any, lifecycle: Any) -> dict[str, Any]:
    """A report's ``settings``: how the run was made (generation, engine, and for
    ``clm`` / ``truncate`` the lifecycle's), the same for ``clm replay`` and ``clm bench``."""
    from clm_middleware.cli.setup import engine_description

    settings = {
        "transcript": str(transcript),
        "max_new_tokens": options.max_new_tokens,
        "teacher_force": options.teacher_force,
        **options.sampling,
        "repetition_penalty": options.repetition_penalty,
        "frequency_penalty": options.frequency_penalty,
        "presence_penalty": options.presence_penalty,
        "no_repeat_ngram_size": options.no_repeat_ngram_size,
        "block_size": engine.block_size,
        **engine_description(engine),
    }
    if options.mode in ("clm", "truncate"):
        settings.update(lifecycle.settings())
    return settings


def load_probes(transcript: Path, probes_path: Path | None) -> list[Probe]:
    path = probes_path or probes_beside(transcript)
    return read_probes(path) if path else []


def add_retention(report: ReplayReport, drivers: list[Any], probes: list[Probe]) -> None:
    """``retention`` (probes whose answer is in a final context: the last conversation's, or
    with several in one file any of theirs) and ``final_context`` (the last one's)."""
    if not drivers:
        return
    context = drivers[-1].context
    report.extra["final_context"] = context
    if len(drivers) > 1:
        report.extra["final_contexts"] = {d.conversation_id: d.context for d in drivers}
    if probes:  # a file of several conversations: a fact counts where its conversation kept it
        retained, lost = retention(probes, said_context(drivers))
        report.extra["retention"] = {"retained": retained, "probes": len(probes), "lost": [p.answer for p in lost]}


class Terminated(Exception):
    """SIGTERM arrived (``kill``, ``timeout``, a job scheduler): stop as on Ctrl-C."""


def _terminate(signum: int, frame: object) -> None:
    raise Terminated


def finish_on_failure(
    run: Callable[[], None], on_stop: Callable[[], None], stderr: Console, *, reports: bool = True
) -> None:
    """Run; on Ctrl-C, SIGTERM or a library error, save what finished, then exit 130,
    143 or 1. ``reports``: whether the command writes a report to hold the finished turns."""
    main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _terminate) if main_thread else None
    held = "the report holds the finished turns" if reports else "no report was asked for"
    try:
        run()
    except KeyboardInterrupt:
        on_stop()
        stderr.print(f"interrupted: {held}")
        sys.exit(130)
    except Terminated:
        on_stop()
        stderr.print(f"terminated: {held}")
        sys.exit(128 + signal.SIGTERM)
    except ClmError as error:
        on_stop()
        raise click.ClickException(str(error)) from None
    finally:
        if main_thread:  # None: a handler not set from Python, i.e. the default
            signal.signal(signal.SIGTERM, signal.SIG_DFL if previous is None else previous)
