"""Readable output for the CLI: per-turn tables and summaries (rich), progress on stderr."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table
from rich.text import Text

from clm_middleware.replay.report import Failure, ReplayReport, TurnRecord

REPLY_PREVIEW_CHARS = 48


# columns a narrow terminal drops first, in order; "turn" and the token counts stay
_DROP_ORDER = ("reply", "turn s", "by", "TTFT s", "context", "k/c/d", "prefill")
_MIN_REPLY = 12


def skipped_line(failure: Failure) -> str:
    """What ``--on-error skip`` says on stderr of a turn or a record it went past."""
    where = f"turn {failure.turn} ({failure.conversation_id})" if failure.turn else "a record"
    return f"skipped {where}: {failure.error}"


def print_whole(console: Console, table: Table) -> None:
    """Print ``table`` with no cell cut or wrapped: wider than the terminal when it must
    be (the terminal wraps its lines), so an id or a figure is never shown as ``t_unic…``.
    For tables of short cells; a reply preview has its own room (``turn_table``)."""
    needed = console.measure(table, options=console.options.update_width(10**5)).maximum
    if needed > console.width:
        console = Console(width=needed, stderr=console.stderr, emoji=False)
    console.print(table)


def turn_table(report: ReplayReport, width: int | None = None) -> Table:
    """One row per turn. In ``width`` columns (a terminal's), columns are dropped by
    ``_DROP_ORDER`` until the rest fit whole: a number is never cut, the turn column never
    goes, and the reply preview takes what room is left (every reply is printed in full
    below the table anyway). A turn ``--on-error skip`` went past is a row of its own,
    its reply cell saying why."""
    lifecycle = any("decisions" in turn.extra for turn in report.turns)
    names = ["turn", "prompt", "cached", "prefill", "context", "TTFT s", "turn s"]
    if lifecycle:
        names += ["k/c/d", "by"]
    names.append("reply")
    numbered: list[tuple[int, list[str]]] = [(turn.turn, _row(turn, lifecycle)) for turn in report.turns]
    for failure in report.failures:
        if failure.turn is not None:
            blanks = ["-"] * (len(names) - 2)
            numbered.append((failure.turn, [str(failure.turn), *blanks, f"failed: {failure.error}"]))
    rows = [row for _, row in sorted(numbered, key=lambda pair: pair[0])]
    widths = {name: max([len(name), *(len(row[i]) for row in rows)]) for i, name in enumerate(names)}
    widths["reply"] = min(widths["reply"], _MIN_REPLY)
    shown = list(names)
    for name in _DROP_ORDER:
        if width is None or _table_width(shown, widths) <= width:
            break
        shown.remove(name)
    table = Table(title=Text(f"{report.mode} · {report.model}"), title_justify="left")
    for name in shown:
        if name == "reply":
            table.add_column(name, overflow="ellipsis", no_wrap=True, max_width=REPLY_PREVIEW_CHARS, ratio=1)
        else:
            table.add_column(name, justify="left" if name == "by" else "right", no_wrap=True, min_width=widths[name])
    for row in rows:
        # Text: a reply is shown as said, never read as markup ("[/i]" ended the run) or emoji (":x:")
        table.add_row(*(Text(cell) for name, cell in zip(names, row, strict=True) if name in shown))
    return table


def _table_width(names: list[str], widths: dict[str, int]) -> int:
    return sum(widths[name] + 3 for name in names) + 1  # "│ cell " per column, one closing border


def _row(turn: TurnRecord, lifecycle: bool) -> list[str]:
    cells = [
        str(turn.turn),
        str(turn.prompt_tokens),
        str(turn.cached_tokens),
        str(turn.prefill_tokens),
        str(turn.context_tokens),
        f"{turn.ttft_s:.3f}",
        f"{turn.turn_s:.3f}",
    ]
    if lifecycle:
        cells.extend(_decision_cells(turn))
    cells.append(" ".join(turn.reply.split())[:REPLY_PREVIEW_CHARS])
    return cells


def replies_text(report: ReplayReport) -> Text | None:
    """Every generated reply in full, one paragraph per turn (wrapped by the console),
    with its flags: the table only previews them. None when all replies were forced."""
    turns = [t for t in report.turns if not t.forced_tokens and t.reply_nll is None]
    if not turns:
        return None
    text = Text()
    text.append(f"replies · {report.mode}\n", style="bold")
    for turn in turns:
        text.append(f"{turn.turn:>3} ", style="bold")
        if turn.reply_flags:
            text.append(f"[{', '.join(turn.reply_flags)}] ", style="red")
        text.append(" ".join(turn.reply.split()) or "(empty)")
        text.append("\n")
    return text


def summary_table(report: ReplayReport) -> Table:
    totals = report.totals()
    table = Table(title="totals", show_header=False, title_justify="left")
    table.add_column("what")
    table.add_column("value", justify="right")
    rows: list[tuple[str, Any]] = [("turns", totals["turns"])]
    if report.failures or report.settings.get("on_error") == "skip":
        skipped = report.settings.get("on_error") == "skip"
        rows.append(("failed turns (skipped)" if skipped else "failed turns (the run stopped)", totals["failed_turns"]))
        if totals["skipped_records"]:
            rows.append(("unreadable records (skipped)", totals["skipped_records"]))
    rows += [
        ("prompt tokens", totals["prompt_tokens"]),
        ("cached tokens", totals["cached_tokens"]),
        ("prefill tokens", totals["prefill_tokens"]),
        ("hit rate", f"{totals['hit_rate']:.1%}"),
        ("TTFT p50 / p95 s", f"{totals['ttft_p50_s']:.3f} / {totals['ttft_p95_s']:.3f}"),
        ("turn time s", f"{totals['turn_s']:.2f}"),
        *([("decode tok/s", f"{totals['decode_tokens_per_s']:.1f}")] if totals["decode_tokens_per_s"] else []),
        ("pool bookkeeping", f"{totals['bookkeeping_share']:.2%} of turn time"),
        ("peak KV MiB", f"{totals['peak_kv_bytes'] / 2**20:.1f}"),
        ("final context tokens", totals["final_context_tokens"]),
    ]
    if totals["reply_nll"] is not None:
        # over the replies fed as recorded: all under --teacher-force, else recorded tool calls and the like
        rows.append(("reply NLL (recorded replies)", f"{totals['reply_nll']:.3f} nats/token"))
    if totals["generated_replies"]:
        flags = ", ".join(f"{name} {count}" for name, count in sorted(totals["reply_flags"].items()))
        rows.append(
            (
                "flagged replies",
                f"{totals['flagged_replies']}/{totals['generated_replies']}" + (f" ({flags})" if flags else ""),
            )
        )
    retention = report.extra.get("retention")
    if retention:
        rows.append(("facts retained", f"{retention['retained']}/{retention['probes']}"))
    if "lifecycle_share" in totals:
        decisions = totals["decisions"]
        rows += [
            ("lifecycle work", f"{totals['lifecycle_share']:.1%} of turn time"),
            ("decisions keep/compress/drop", f"{decisions['keep']}/{decisions['compress']}/{decisions['drop']}"),
            ("tagging modes", ", ".join(f"{m} {n}" for m, n in totals["tagging_modes"].items())),
            ("compactions", ", ".join(f"{m} {n}" for m, n in totals["compactions"].items()) or "none"),
            ("compactions per 10 turns", f"{totals['compactions_per_10_turns']:.1f}"),
            ("digest share of prompts", f"{totals['digest_share']:.1%}"),
            ("max context tokens", totals["max_context_tokens"]),
        ]
    for name, value in rows:
        table.add_row(name, Text(str(value)))
    return table


def _decision_cells(turn: TurnRecord) -> list[str]:
    decisions = turn.extra.get("decisions") or {}
    counts = f"{decisions.get('keep', 0)}/{decisions.get('compress', 0)}/{decisions.get('drop', 0)}"
    sources = ",".join(sorted(k for k, v in (decisions.get("by_source") or {}).items() if any(v.values())))
    if turn.extra.get("compaction"):
        sources += f" [{turn.extra['compaction']}]"
    return [counts, sources or "-"]


PLAIN_PROGRESS_EVERY_S = 10.0


@contextmanager
def turn_progress(total: int, console: Console, enabled: bool) -> Iterator[Any]:
    """A progress bar over turns on stderr; yields ``advance()``. Not on a terminal (a
    pipe, CI, ``make demo | tee``), a plain line every ``PLAIN_PROGRESS_EVERY_S`` seconds
    and at the end instead, so a long run is never silent."""
    if not enabled:
        yield lambda: None
        return
    if not console.is_terminal:
        yield _plain_progress(total, console)
        return
    progress = Progress(
        TextColumn("[bold]replay"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
        transient=True,
    )
    with progress:
        task = progress.add_task("turns", total=total)
        yield lambda: progress.advance(task)


def _plain_progress(total: int, console: Console):
    started = last = time.monotonic()
    done = 0

    def advance() -> None:
        nonlocal done, last
        done += 1
        now = time.monotonic()
        if now - last >= PLAIN_PROGRESS_EVERY_S or done == total:
            last = now
            console.print(f"replay: {done}/{total} turns, {now - started:.0f} s", markup=False, highlight=False)

    return advance
