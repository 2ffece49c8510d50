"""``clm eval``: measure what a context budget keeps (retention), and build test material for it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import click
from rich.console import Console

from clm_middleware.cli.eval_variants import eval_options, markdown_table, print_table, write_markdown
from clm_middleware.cli.options import model_options

DEFAULT_TAGGINGS = "auto,signals,constrained,free,rules"


@click.group(name="eval")
def eval_group() -> None:
    """Retention evaluation: which facts survive a context budget."""


@eval_group.command(name="retention")
@eval_options(default_tagging=DEFAULT_TAGGINGS)
@model_options
def retention_command(
    transcript: Path,
    transcript_format: str,
    probes_path: Path,
    budget: int,
    taggings: str,
    compression: str,
    report_path: Path | None,
    markdown_path: Path | None,
    **engine_options: Any,
) -> None:
    """Replay TRANSCRIPT teacher-forced under clm (each tagging mode), truncation and keep-all,
    and report the share of probes whose answer is still in the final context."""
    from clm_middleware.cli.eval_variants import read_inputs, variants
    from clm_middleware.cli.setup import build_engine, driver_factory, sibling_engine
    from clm_middleware.evaluation.retention import run_variant

    planned = variants(taggings, budget, compression)
    transcripts, probes = read_inputs(transcript, transcript_format, probes_path)
    first = build_engine(**engine_options)
    stderr = Console(stderr=True)
    results = []
    for name, mode, lifecycle in planned:
        stderr.print(f"[bold]{name}[/bold] …")
        results.append(run_variant(name, sibling_engine(first), transcripts, probes, driver_factory, lifecycle, mode))
    header = ["variant", "retained", "context tokens", "prefill tokens", "lifecycle share", "signals share"]
    print_table(
        f"retention · {transcript.name} · budget {budget} · {len(probes)} probes", [*header, "invented"], _rows(results)
    )
    if report_path:
        from clm_middleware.replay.report import write_json_atomic

        write_json_atomic(
            report_path,
            {
                "transcript": str(transcript),
                "budget": budget,
                "probes": len(probes),
                "variants": [r.as_dict() for r in results],
            },
        )
    if markdown_path:
        lines = markdown_table([*header, "invented"], _rows(results))
        lines += ["", "Lost (answers not in the final context):", ""]
        lines += [f"- {r.name}: " + (", ".join(f"`{a}`" for a in r.lost) or "none") for r in results]
        write_markdown(markdown_path, f"{len(probes)} probes; budget {budget} tokens; model {first.model_name}.", lines)


def _rows(results) -> list[list[str]]:
    rows = []
    for r in results:
        share = "" if r.lifecycle_share is None else f"{r.lifecycle_share:.1%}"
        signals = "" if r.observation_share is None else f"{r.observation_share:.1%}"
        invented = "" if r.lifecycle_share is None else f"{r.invented} in {r.compressed_segments} compressed"
        rows.append(
            [
                r.name,
                f"{r.retained}/{r.probes} ({r.share:.0%})",
                f"{r.context_tokens:,}",
                f"{r.prefill_tokens:,}",
                share,
                signals,
                invented,
            ]
        )
    return rows


@eval_group.command(name="planted")
@click.option("--out", type=click.Path(path_type=Path), required=True, help="Transcript JSONL to write.")
@click.option(
    "--probes",
    "probes_path",
    type=click.Path(path_type=Path),
    required=True,
    help="Probes JSON to write.",
)
@click.option("--turns", type=click.IntRange(min=4), default=60, show_default=True, help="User turns.")
@click.option(
    "--facts",
    type=click.IntRange(min=1, max=12),
    default=10,
    show_default=True,
    help="Facts to plant.",
)
@click.option("--seed", type=int, default=0, show_default=True)
def planted_command(out: Path, probes_path: Path, turns: int, facts: int, seed: int) -> None:
    """Write a planted-fact transcript: facts stated once early, a question about each at the end."""
    from clm_middleware.evaluation.planted import planted_transcript
    from clm_middleware.evaluation.probes import write_probes

    try:
        planted = planted_transcript(user_turns=turns, facts=facts, seed=seed)
    except ValueError as error:
        raise click.BadParameter(str(error)) from None
    _write_jsonl(out, planted.messages)
    write_probes(probes_path, planted.probes)
    click.echo(f"{out}: {len(planted.messages)} messages; {probes_path}: {len(planted.probes)} probes")


@eval_group.command(name="session")
@click.option("--dataset", type=click.Choice(["sgd", "multiwoz"]), required=True)
@click.option(
    "--index",
    "index_path",
    type=click.Path(path_type=Path),
    required=True,
    help="The dataset's *_index.json.",
)
@click.option(
    "--transcripts",
    "transcripts_path",
    type=click.Path(path_type=Path),
    required=True,
    help="The dataset's *_transcripts.jsonl.",
)
@click.option(
    "--dialogues",
    type=click.IntRange(min=1),
    default=10,
    show_default=True,
    help="Dialogues to concatenate.",
)
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--out", type=click.Path(path_type=Path), required=True)
@click.option("--probes", "probes_path", type=click.Path(path_type=Path), required=True)
def session_command(
    dataset: str,
    index_path: Path,
    transcripts_path: Path,
    dialogues: int,
    seed: int,
    out: Path,
    probes_path: Path,
) -> None:
    """Concatenate public dialogues into one long session, with probes from their ground truth."""
    from clm_middleware.evaluation.probes import write_probes
    from clm_middleware.evaluation.public import build_session

    messages, probes = build_session(dataset, index_path, transcripts_path, dialogues=dialogues, seed=seed)
    _write_jsonl(out, messages)
    write_probes(probes_path, probes)
    click.echo(f"{out}: {len(messages)} messages; {probes_path}: {len(probes)} probes")


def _write_jsonl(path: Path, messages: list[dict[str, str]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(m, ensure_ascii=False) + "\n" for m in messages), encoding="utf-8")


# registered here so `clm eval` lists it; it lives in its own module
from clm_middleware.cli.eval_answers_cmd import answers_command  # noqa: E402

eval_group.add_command(answers_command)
