"""What `clm eval retention` and `clm eval answers` replay: the variants, and their inputs."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click


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
