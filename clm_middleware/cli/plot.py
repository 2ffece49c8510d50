"""PNG plots of a replay: context tokens and prefill tokens per turn, one line per mode."""

from __future__ import annotations

from pathlib import Path

from clm_middleware.replay.report import ReplayReport

MARKERS = ("o", "s", "^", "D", "v")


def plot_reports(reports: dict[str, ReplayReport], path: Path, title: str) -> None:
    """Context tokens (solid) and prefill tokens (dashed) per turn, for each mode."""
    import matplotlib

    matplotlib.use("Agg")  # files only: works with no display
    from matplotlib import pyplot as plt

    figure, axes = plt.subplots(figsize=(9, 4.5), dpi=120)
    for index, (mode, report) in enumerate(reports.items()):
        # modes often coincide (stateless and prefix show the same context): each mode has
        # its own marker, and earlier modes are drawn wider, so a line on top of another
        # leaves the one below visible at its edges
        style = {**line_style(index, len(reports)), "markevery": max(1, len(report.turns) // 12)}
        turns = [t.turn for t in report.turns]
        axes.plot(turns, [t.context_tokens for t in report.turns], label=f"{mode}: context", **style)
        axes.plot(turns, [t.prefill_tokens for t in report.turns], linestyle="--", label=f"{mode}: prefill", **style)
    axes.set_xlabel("turn")
    axes.set_ylabel("tokens")
    axes.set_title(title)
    axes.grid(alpha=0.3)
    axes.legend(fontsize="small", ncols=2)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path)
    plt.close(figure)


def line_style(index: int, modes: int) -> dict[str, object]:
    """Mode ``index`` of ``modes``: its own colour and marker, and wider the earlier it is
    drawn, so that a later line over it leaves its edges showing."""
    return {
        "color": f"C{index}",
        "linewidth": 1.2 + 1.8 * (modes - 1 - index),
        "marker": MARKERS[index % len(MARKERS)],
        "alpha": 0.85,
    }
