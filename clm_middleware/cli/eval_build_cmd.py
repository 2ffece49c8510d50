"""``clm eval planted|session|generate``: build the long sessions (and their probes) that evals replay.

Each writes a transcript (JSONL role/content lines) and its probes; ``--probes`` defaults
to ``OUT.probes.json``, the file ``clm eval retention`` and ``clm eval answers`` look for
next to a transcript. ``session`` and ``generate`` can also write ``--sources``: the
dialogues used (or the generator and seed), so a held-out split can be checked.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import click

from clm_middleware.cli.options import OutputPath, refuse_inputs_as_outputs
from clm_middleware.evaluation.sessions import Session, default_probes_path, write_session

_out_option = click.option("--out", type=OutputPath(), required=True, help="Transcript JSONL to write.")
_probes_option = click.option(
    "--probes",
    "probes_path",
    type=OutputPath(),
    default=None,
    help="Probes JSON to write [default: OUT with .probes.json].",
)
_sources_option = click.option(
    "--sources",
    "sources_path",
    type=OutputPath(),
    default=None,
    help="Also write where the session comes from (dialogue ids, seed) as JSON here.",
)


def _write(
    session: Session,
    out: Path,
    probes_path: Path | None,
    sources_path: Path | None = None,
    inputs: Iterable[Path | None] = (),
) -> None:
    """Write the session, its probes and sources, each to a file of its own that is none of
    ``inputs`` (a sweep had rewritten a dataset file given as --out)."""
    probes_path = probes_path or default_probes_path(out)
    refuse_inputs_as_outputs(inputs, {"--out": out, "--probes": probes_path, "--sources": sources_path})
    write_session(session, out, probes_path, sources_path)
    click.echo(f"{out}: {len(session.messages)} messages; {probes_path}: {len(session.probes)} probes")
    beside = default_probes_path(out)
    if beside.exists() and beside.resolve() != probes_path.resolve():
        # clm eval retention / answers OUT read it by default: the probes of another session
        click.echo(
            f"warning: {beside} is not this session's probes (they are in {probes_path}); "
            f"clm eval reads it for {out} unless given --probes {probes_path}",
            err=True,
        )


@click.command(name="planted")
@_out_option
@_probes_option
@click.option("--turns", type=click.IntRange(min=4), default=60, show_default=True, help="User turns.")
@click.option("--facts", type=click.IntRange(min=1, max=12), default=10, show_default=True, help="Facts to plant.")
@click.option("--seed", type=int, default=0, show_default=True)
def planted_command(out: Path, probes_path: Path | None, turns: int, facts: int, seed: int) -> None:
    """Write a planted-fact transcript: facts stated once early, a question about each at the end."""
    from clm_middleware.evaluation.planted import planted_transcript

    if turns < 2 * facts + 2:  # each fact is stated, then asked about, with turns between
        raise click.BadParameter(f"{facts} facts need at least {2 * facts + 2} user turns", param_hint="--turns")
    planted = planted_transcript(user_turns=turns, facts=facts, seed=seed)
    _write(Session(planted.messages, planted.probes), out, probes_path)


@click.command(name="session")
@click.option("--dataset", type=click.Choice(["sgd", "multiwoz", "tau-airline"]), required=True)
@click.option(
    "--index",
    "index_path",
    type=click.Path(path_type=Path),
    help="The dataset's *_index.json (sgd, multiwoz).",
)
@click.option(
    "--transcripts",
    "transcripts_path",
    type=click.Path(path_type=Path),
    required=True,
    help="The dataset's *_transcripts.jsonl; for tau-airline the trajectories JSON.",
)
@click.option(
    "--dialogues", type=click.IntRange(min=1), default=10, show_default=True, help="Dialogues to concatenate."
)
@click.option("--seed", type=int, default=0, show_default=True)
@click.option(
    "--split",
    type=click.Choice(["all", "tuning", "held-out"]),
    default="all",
    show_default=True,
    help="Draw from every dialogue, the tuning dialogues, or the held-out ones (docs/benchmarks.md).",
)
@click.option(
    "--part",
    type=click.IntRange(min=0),
    default=0,
    show_default=True,
    help="held-out: which run of --dialogues dialogues of the seeded shuffle; parts never overlap.",
)
@_out_option
@_probes_option
@_sources_option
def session_command(
    dataset: str,
    index_path: Path | None,
    transcripts_path: Path,
    dialogues: int,
    seed: int,
    split: str,
    part: int,
    out: Path,
    probes_path: Path | None,
    sources_path: Path | None,
) -> None:
    """Concatenate public dialogues into one long session, with probes from their ground truth."""
    if dataset == "tau-airline":
        from clm_middleware.evaluation.tau import build_tau_session

        if split == "tuning":
            raise click.BadParameter("τ-bench has no tuning dialogues; all of it is held-out", param_hint="--split")
        _write(build_tau_session(transcripts_path), out, probes_path, sources_path, [transcripts_path])
        return
    from clm_middleware.evaluation.public import build_session

    if index_path is None:
        raise click.UsageError(f"--index is required for --dataset {dataset}")
    try:
        session = build_session(
            dataset, index_path, transcripts_path, dialogues=dialogues, seed=seed, split=split, part=part
        )
    except ValueError as error:
        raise click.BadParameter(str(error)) from None
    _write(session, out, probes_path, sources_path, [index_path, transcripts_path])


@click.command(name="generate")
@click.option(
    "--kind",
    type=click.Choice(["chitchat", "support"]),
    required=True,
    help="chitchat: two friends over several sessions; support: a device troubleshooting chat.",
)
@click.option("--seed", type=int, default=0, show_default=True)
@click.option(
    "--turns",
    type=click.IntRange(min=20),
    default=None,
    help="User turns [default: 100 chitchat, 90 support: under 8k tokens].",
)
@click.option("--facts", type=click.IntRange(min=1), default=None, help="Facts to plant [default: 15 / 14].")
@click.option("--sessions", type=click.IntRange(min=1), default=None, help="Sessions [default: 4 / 3].")
@_out_option
@_probes_option
@_sources_option
def generate_command(
    kind: str,
    seed: int,
    turns: int | None,
    facts: int | None,
    sessions: int | None,
    out: Path,
    probes_path: Path | None,
    sources_path: Path | None,
) -> None:
    """Write a generated long session unlike booking dialogues, with probes from the generator:
    each fact is said once in passing and asked back many turns later."""
    from clm_middleware.evaluation.chitchat import chitchat_session
    from clm_middleware.evaluation.support import support_session

    make = chitchat_session if kind == "chitchat" else support_session
    given = {"user_turns": turns, "facts": facts, "sessions": sessions}
    try:
        session = make(seed=seed, **{name: value for name, value in given.items() if value is not None})
    except ValueError as error:  # "facts: between 1 and 15": the option it names
        named = str(error).split(":")[0].strip()
        option = {"user_turns": "--turns", "facts": "--facts", "sessions": "--sessions"}.get(named)
        raise click.BadParameter(str(error), param_hint=option) from None
    _write(session, out, probes_path, sources_path)
