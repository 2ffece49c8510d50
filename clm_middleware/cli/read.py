"""Reading a command's transcript before anything heavy loads (torch, the model)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from clm_middleware.errors import ClmError, TranscriptError
from clm_middleware.replay.formats import read_transcripts


def read_or_report(
    transcript: Path,
    transcript_format: str,
    skipped: list[TranscriptError] | None,
    reports: dict[Path, str],
    json_mode: str | None = None,
) -> list[Any]:
    """The transcript's conversations (``read_transcripts``); when it cannot be read, each
    of ``reports`` (path → mode) is written first, as a run that failed before its first
    turn (``complete: false``, the error in ``failures``), and with ``json_mode`` (the
    mode of a ``--json`` run) the same is said on stdout: a ``skipped_record`` line and the
    ``totals``, as a replay that stops says it. When it can, an earlier run's report at
    those paths is removed. Either way a report left from an earlier run never stands
    for this one."""
    try:
        transcripts = read_transcripts(transcript, transcript_format, skipped)
    except ClmError as error:
        from clm_middleware.cli.json_lines import emit, failure_line, totals_line

        for path, mode in reports.items():
            _failed_report(transcript, mode, error, skipped).write(path)
        if json_mode is not None:
            failed = _failed_report(transcript, json_mode, error, skipped)
            for failure in failed.failures:
                emit(failure_line(failure))
            emit(totals_line(failed))
        raise
    except BaseException:  # a reader's own fault (or Ctrl-C): no report of this run, and none of an earlier one
        remove_stale(*reports)
        raise
    remove_stale(*reports)  # until this run writes its own (Ctrl-C while the model loads leaves none)
    return transcripts


def _failed_report(transcript: Path, mode: str, error: ClmError, skipped: list[TranscriptError] | None) -> Any:
    """A run that failed before its first turn: no turn; in ``failures`` the records
    ``--on-error skip`` went past, then the error."""
    from clm_middleware.replay.report import Failure, ReplayReport

    settings = {"transcript": str(transcript), "on_error": "stop" if skipped is None else "skip"}
    failed = ReplayReport(mode=mode, model="", settings=settings, complete=False)
    failed.failures += [*(Failure(str(record)) for record in skipped or ()), Failure(str(error))]
    return failed


def remove_stale(*paths: Path | None) -> None:
    """An earlier run's outputs, once this run's inputs are read: a run that then fails or
    is interrupted must not leave figures of other inputs or settings beside it."""
    for path in paths:
        if path is not None:
            path.unlink(missing_ok=True)
