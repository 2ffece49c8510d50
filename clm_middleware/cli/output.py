"""Readable output for the CLI: per-turn tables and summaries (rich), progress on stderr."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table
from rich.text import Text

from clm_middleware.replay.report import ReplayReport, TurnRecord

REPLY_PREVIEW_CHARS = 48


def turn_table(report: ReplayReport) -> Table:
    table = Table(title=f"{report.mode} · {report.model}", title_justify="left")
    for name in ("turn", "prompt", "cached", "prefill", "context", "TTFT s", "turn s"):
        table.add_column(name, justify="right", no_wrap=True, min_width=len(name))
    lifecycle = any("decisions" in turn.extra for turn in report.turns)
    if lifecycle:
        table.add_column("k/c/d", justify="right", no_wrap=True, min_width=5)
        table.add_column("by", justify="left", no_wrap=True, min_width=5)
    # the reply preview gives way first when the terminal is narrow
    table.add_column("reply", overflow="ellipsis", no_wrap=True, max_width=REPLY_PREVIEW_CHARS, ratio=1)
    for turn in report.turns:
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
        table.add_row(*cells)
    return table


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
    rows: list[tuple[str, Any]] = [
        ("turns", totals["turns"]),
        ("prompt tokens", totals["prompt_tokens"]),
        ("cached tokens", totals["cached_tokens"]),
        ("prefill tokens", totals["prefill_tokens"]),
        ("hit rate", f"{totals['hit_rate']:.1%}"),
        ("TTFT p50 / p95 s", f"{totals['ttft_p50_s']:.3f} / {totals['ttft_p95_s']:.3f}"),
        ("turn time s", f"{totals['turn_s']:.2f}"),
        ("pool bookkeeping", f"{totals['bookkeeping_share']:.2%} of turn time"),
        ("peak KV MiB", f"{totals['peak_kv_bytes'] / 2**20:.1f}"),
        ("final context tokens", totals["final_context_tokens"]),
    ]
    if totals["reply_nll"] is not None:
        rows.append(("reply NLL (teacher-forced)", f"{totals['reply_nll']:.3f} nats/token"))
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
            ("max context tokens", totals["max_context_tokens"]),
        ]
    for name, value in rows:
        table.add_row(name, str(value))
    return table


def _decision_cells(turn: TurnRecord) -> list[str]:
    decisions = turn.extra.get("decisions") or {}
    counts = f"{decisions.get('keep', 0)}/{decisions.get('compress', 0)}/{decisions.get('drop', 0)}"
    sources = ",".join(sorted(k for k, v in (decisions.get("by_source") or {}).items() if any(v.values())))
    if turn.extra.get("compaction"):
        sources += f" [{turn.extra['compaction']}]"
    return [counts, sources or "-"]


@contextmanager
def turn_progress(total: int, console: Console, enabled: bool) -> Iterator[Any]:
    """A progress bar over turns on stderr; yields ``advance()``."""
    if not enabled:
        yield lambda: None
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
