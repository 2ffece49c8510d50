"""Compare modes measured in one interleaved run: absolute figures and ratios to a baseline.

Ratios are the numbers to quote: the modes ran turn by turn in rotating order on the
same machine at the same time, so noise cancels in a ratio but not in a single time.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from clm_middleware.replay.report import ReplayReport

LAST_TURNS = 5  # "TTFT over the last five turns": where re-prefilling hurts most


@dataclass(frozen=True, slots=True)
class Metric:
    name: str
    unit: str
    value: Callable[[ReplayReport], float]
    ratio: bool = True  # False for shares, where baseline ÷ mode means nothing


def _last_ttft(report: ReplayReport) -> float:
    tail = report.turns[-LAST_TURNS:]
    return sum(t.ttft_s for t in tail) / len(tail) if tail else 0.0


METRICS: tuple[Metric, ...] = (
    Metric("prefill tokens", "tokens", lambda r: r.totals()["prefill_tokens"]),
    # from the block pool, or the server's own count behind --engine
    Metric("cached tokens", "tokens", lambda r: r.totals()["cached_tokens"], ratio=False),
    Metric("TTFT p50", "s", lambda r: r.totals()["ttft_p50_s"]),
    Metric("TTFT p95", "s", lambda r: r.totals()["ttft_p95_s"]),
    Metric(f"TTFT mean, last {LAST_TURNS} turns", "s", _last_ttft),
    Metric("turn time, total", "s", lambda r: r.totals()["turn_s"]),
    # a rate: higher is faster, so no "baseline ÷ mode" cost ratio (0 when teacher-forced)
    Metric("decode rate", "tok/s", lambda r: r.totals()["decode_tokens_per_s"], ratio=False),
    Metric("peak KV", "MiB", lambda r: r.totals()["peak_kv_bytes"] / 2**20),
    Metric("context tokens at the end", "tokens", lambda r: r.totals()["final_context_tokens"]),
    Metric(
        "pool bookkeeping share of turn time",
        "%",
        lambda r: 100 * r.totals()["bookkeeping_share"],
        ratio=False,
    ),
    Metric(
        "working-cache allocation share of turn time",
        "%",
        lambda r: 100 * r.totals()["arena_share"],
        ratio=False,
    ),
)


def comparison_rows(reports: dict[str, ReplayReport], baseline: str) -> list[list[str]]:
    """Rows of ``metric | value per mode | baseline ÷ mode`` for every non-baseline mode."""
    modes = list(reports)
    others = [mode for mode in modes if mode != baseline]
    rows = []
    for metric in METRICS:
        values = {mode: metric.value(reports[mode]) for mode in modes}
        row = [f"{metric.name} ({metric.unit})"] + [_format(values[mode]) for mode in modes]
        for mode in others:
            row.append(_ratio(values[baseline], values[mode]) if metric.ratio else "")
        rows.append(row)
    for name, extract in extra_metrics(reports):
        row = [name] + [extract(reports[mode]) for mode in modes] + ["" for _ in others]
        rows.append(row)
    return rows


def extra_metrics(
    reports: dict[str, ReplayReport],
) -> list[tuple[str, Callable[[ReplayReport], str]]]:
    """Metrics only some reports carry (e.g. facts retained, when the file has probes)."""
    extras = []
    if any("retention" in report.extra for report in reports.values()):
        extras.append(("facts retained", lambda r: _retention(r)))
    totals = [report.totals() for report in reports.values()]
    if any(t["reply_nll"] is not None for t in totals):
        # over the replies fed as recorded: all under --teacher-force, else recorded tool calls and the like
        extras.append(("reply NLL, recorded replies (nats/token)", _reply_nll))
    if any(t["generated_replies"] for t in totals):
        extras.append(
            (
                "flagged replies (artifact / loop / repeats earlier / reads notes back / cut at a repeat / empty)",
                _flagged,
            )
        )
    return extras


def _reply_nll(report: ReplayReport) -> str:
    value = report.totals()["reply_nll"]
    return "-" if value is None else f"{value:.3f}"


def _flagged(report: ReplayReport) -> str:
    totals = report.totals()
    flags = totals["reply_flags"]
    counts = "/".join(
        str(flags.get(f, 0))
        for f in (
            "protocol_artifact",
            "repetition_loop",
            "repeats_earlier_reply",
            "reads_back_notes",
            "repetition_cut",
            "empty",
        )
    )
    return f"{totals['flagged_replies']} of {totals['generated_replies']} ({counts})"


def header(reports: dict[str, ReplayReport], baseline: str) -> list[str]:
    others = [mode for mode in reports if mode != baseline]
    return ["metric", *reports, *(f"{baseline} ÷ {mode}" for mode in others)]


def to_markdown(reports: dict[str, ReplayReport], baseline: str, command: str, notes: list[str] | None = None) -> str:
    head = header(reports, baseline)
    lines = [
        f"Command: `{command}`",
        "",
        *(notes or []),
        "",
        "| " + " | ".join(head) + " |",
        "|" + "|".join(" --- " for _ in head) + "|",
    ]
    lines += ["| " + " | ".join(row) + " |" for row in comparison_rows(reports, baseline)]
    return "\n".join(lines) + "\n"


def _retention(report: ReplayReport) -> str:
    retention = report.extra.get("retention")
    if not retention:
        return "-"
    return f"{retention['retained']}/{retention['probes']}"


def _format(value: float) -> str:
    if isinstance(value, int) or float(value).is_integer():
        return f"{int(value):,}"
    return f"{value:.3f}" if abs(value) < 100 else f"{value:,.1f}"


def _ratio(baseline: float, value: float) -> str:
    if not value:
        return "∞" if baseline else "—"
    return f"{baseline / value:.1f}×"
