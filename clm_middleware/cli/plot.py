"""PNG plots of a replay: context tokens and prefill tokens per turn, one line per mode."""

from __future__ import annotations

from pathlib import Path

from clm_middleware.replay.report import ReplayReport


def plot_reports(reports: dict[str, ReplayReport], path: Path, title: str) -> None:
    """Context tokens (solid) and prefill tokens (dashed) per turn, for each mode."""
    import matplotlib

    matplotlib.use("Agg")  # files only: works with no display
    from matplotlib import pyplot as plt

    figure, axes = plt.subplots(figsize=(9, 4.5), dpi=120)
    for index, (mode, report) in enumerate(reports.items()):
        color = f"C{index}"
        turns = [t.turn for t in report.turns]
        axes.plot(turns, [t.context_tokens for t in report.turns], color=color, label=f"{mode}: context")
        axes.plot(
            turns, [t.prefill_tokens for t in report.turns], color=color, linestyle="--", label=f"{mode}: prefill"
        )
    axes.set_xlabel("turn")
    axes.set_ylabel("tokens")
    axes.set_title(title)
    axes.grid(alpha=0.3)
    axes.legend(fontsize="small", ncols=2)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path)
    plt.close(figure)
