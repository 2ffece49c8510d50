"""``clm chat``: an interactive managed conversation that shows its lifecycle decisions."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click
from click.core import ParameterSource
from rich.console import Console
from rich.table import Table
from rich.text import Text

from clm_middleware.cli.options import (
    OutputPath,
    check_engine_options,
    model_options,
    penalty_options,
    remote_engine_options,
    sampling_options,
)
from clm_middleware.errors import ClmError
from clm_middleware.lifecycle.modes import TAGGING_MODES

if TYPE_CHECKING:
    from clm_middleware.conversation import Conversation

COMMANDS = "/segments  /pin N  /forget N  /stats  /save [PATH]  /help  /quit"
HELP = (
    ("/segments", "every segment: id, role, status, label, who decided, text"),
    ("/pin N", "keep segment N (or seg_N) in the context whatever the budget"),
    ("/forget N", "drop segment N from the context (it stays in the history)"),
    ("/stats", "turn, tokens prompted / cached / prefilled this session, hit rate, segments"),
    ("/save [PATH]", "a .json PATH exports the conversation; otherwise save to a store (default clm_chat.db)"),
    ("/help", "this list"),
    ("/quit", "leave (also /exit, /q, end of input)"),
)
PREVIEW_CHARS = 60


@click.command()
@click.option(
    "--db",
    type=OutputPath(),
    default=None,
    help="SQLite store: every turn is saved; resume with --session.",
)
@click.option(
    "--session", default=None, help="Conversation id: resumed from --db if it is there, else started under this id."
)
@click.option("--system", "system_prompt", default=None, help="System prompt for a new conversation.")
@click.option("--budget", type=click.IntRange(min=64), default=None, help="Max context tokens per prompt.")
@click.option(
    "--k", type=click.IntRange(min=0), default=2, show_default=True, help="Rounds removed segments' blocks are held."
)
@click.option(
    "--tagging", type=click.Choice(TAGGING_MODES), default="auto", show_default=True, help="Who labels segments."
)
@click.option(
    "--compact-ahead",
    is_flag=True,
    help="After a reply, compute what the next turn would wait for: under --budget the "
    "compaction when the next message would not fit, and the next message's opening "
    "(docs/lifecycle.md).",
)
@click.option("--max-new-tokens", type=click.IntRange(min=1), default=256, show_default=True, help="Reply length cap.")
@sampling_options
@penalty_options
@click.option("--tenant", default=None, help="Tenant key mixed into every KV block key; tenants never share blocks.")
@click.option(
    "--json",
    "json_lines",
    is_flag=True,
    help="Print one JSON object per turn on stdout (reply, tokens, labels), for scripts; "
    "no prompt, and everything else (banner, command output) goes to stderr.",
)
@model_options
@remote_engine_options
def chat(
    db: Path | None,
    session: str | None,
    system_prompt: str | None,
    budget: int | None,
    k: int,
    tagging: str,
    compact_ahead: bool,
    max_new_tokens: int,
    temperature: float,
    top_p: float,
    top_k: int | None,
    min_p: float | None,
    seed: int | None,
    repetition_penalty: float | None,
    frequency_penalty: float,
    presence_penalty: float,
    no_repeat_ngram_size: int | None,
    tenant: str | None,
    json_lines: bool,
    **engine_options: Any,
) -> None:
    """Chat with a managed model. After each reply it shows what was cached and decided.

    Each input line is one message (a multi-line paste is one message per line); to send
    a whole transcript, replay it with `clm replay`."""
    check_engine_options(engine_options)  # a clash of engine options, before any model loads
    from clm_middleware.cli import json_lines as lines
    from clm_middleware.cli.setup import build_engine
    from clm_middleware.conversation import Conversation
    from clm_middleware.store import Store

    # with --json, stdout carries only the JSON lines; nothing printed is read as markup or emoji
    # (a reply, a segment or an error that holds "[/x]" or ":x:" is shown as said), styles are Text
    console = Console(stderr=json_lines, markup=False, emoji=False)
    engine = build_engine(**engine_options)
    # however the chat ends (end of input, /quit, an error): spill to the disk tier, if one
    # is set, so a resumed chat hits from disk (only evictions were written there before)
    click.get_current_context().call_on_close(engine.close)
    store = Store(db) if db else None
    if store is not None and session is not None and session in store.conversation_ids():
        given = {
            name: value
            for name, value in (
                ("budget", budget),
                ("k", k),
                ("tagging", tagging),
                ("compact_ahead", compact_ahead),
                ("max_new_tokens", max_new_tokens),
                ("temperature", temperature),
                ("top_p", top_p),
                ("top_k", top_k),
                ("min_p", min_p),
                ("seed", seed),
                ("repetition_penalty", repetition_penalty),
                ("frequency_penalty", frequency_penalty),
                ("presence_penalty", presence_penalty),
                ("no_repeat_ngram_size", no_repeat_ngram_size),
            )
            if click.get_current_context().get_parameter_source(name) is ParameterSource.COMMANDLINE
        }
        # the stored conversation keeps its tenant unless one is given now
        source = click.get_current_context().get_parameter_source("tenant")
        salt = {"cache_salt": tenant} if source in (ParameterSource.COMMANDLINE, ParameterSource.ENVIRONMENT) else {}
        conversation = Conversation.load(store, session, engine, **salt, **given)
        console.print(f"resumed {session}: {len(conversation.history)} messages, turn {conversation.turn}")
        if given:  # they apply from now on, and the store records them with the next turn
            applied = ", ".join(f"--{name.replace('_', '-')} {value}" for name, value in given.items())
            console.print(f"applied to the resumed conversation: {applied}")
        if system_prompt:
            console.print(Text("--system is ignored on resume: the conversation keeps its own", style="yellow"))
    else:
        conversation = Conversation(
            engine,
            conversation_id=session,
            system_prompt=system_prompt,
            tagging=tagging,
            budget=budget,
            k=k,
            compact_ahead=compact_ahead,
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            min_p=min_p,
            seed=seed,
            repetition_penalty=repetition_penalty,
            frequency_penalty=frequency_penalty,
            presence_penalty=presence_penalty,
            no_repeat_ngram_size=no_repeat_ngram_size,
            store=store,
            cache_salt=tenant,
        )
    console.print(Text(f"{engine.model_name} · conversation {conversation.id} · {COMMANDS}", style="dim"))
    with conversation:
        while True:
            text = _read_line("" if json_lines else "you> ")
            if text is None:
                if not json_lines:
                    sys.stdout.write("\n")  # end the prompt's line: the shell's prompt starts on its own
                break
            if isinstance(text, bytes):  # e.g. piped in from a file in another encoding
                if json_lines:
                    lines.emit(lines.error_line("that line is not valid UTF-8; it was skipped"))
                else:
                    console.print(Text("that line is not valid UTF-8; it was skipped", style="red"))
                continue
            text = text.strip()
            if not text:
                continue
            if text.startswith("/"):
                if not _command(text, conversation, console):
                    break
                continue
            if json_lines:
                answered = len(conversation.history)
                try:
                    reply = conversation.send(text)
                except ClmError as error:
                    lines.emit(lines.error_line(_after_failure(conversation, answered, error)))
                    continue
                lines.emit(lines.chat_turn_line(conversation.id, reply))
                continue
            console.print(Text("model> ", style="bold"), end="")
            answered = len(conversation.history)
            stream = conversation.stream(text)
            try:
                for piece in stream:
                    console.print(piece, end="", highlight=False)
            except ClmError as error:  # e.g. a message over the budget: say so, keep the chat
                console.print(Text(f"\n{_after_failure(conversation, answered, error)}", style="red"))
                continue
            except KeyboardInterrupt:  # Ctrl-C stops this reply, not the chat
                stream.close()  # a stream closed early takes its message back
                console.print(Text("\ninterrupted: that message and its reply were not kept", style="yellow"))
                continue
            console.print()
            _report_turn(conversation, console)


def _after_failure(conversation: Conversation, answered: int, error: ClmError) -> str:
    """What to tell the user of a failed message, after taking back what it added: a
    turn that failed before its reply leaves nothing; one whose reply came but could not
    be saved (a read-only or full store, another writer) keeps the reply in this chat."""
    if any(message.role == "assistant" for message in conversation.history[answered:]):
        return f"{error} (the reply stands in this chat, but it was not saved)"
    conversation.discard(answered)
    return str(error)


def _read_line(prompt: str) -> str | bytes | None:
    """One line of input, decoded on its own: ``None`` at the end, the raw bytes when
    they are not UTF-8 (so one bad line is skipped, not the rest of the input)."""
    sys.stdout.write(prompt)
    sys.stdout.flush()
    stream = getattr(sys.stdin, "buffer", None)
    if stream is None:
        line = sys.stdin.readline()
        return line or None
    raw = stream.readline()
    if not raw:
        return None
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return raw


def _command(text: str, conversation: Any, console: Console) -> bool:
    """Run a slash command; False means quit."""
    name, _, argument = text.partition(" ")
    argument = argument.strip()
    if name in ("/quit", "/exit", "/q"):
        return False
    if name == "/segments":
        console.print(_segments_table(conversation, console.width))
    elif name in ("/pin", "/forget"):
        if not argument:
            console.print(f"usage: {name} N (a segment number, or seg_N)")
            return True
        try:
            segment = conversation.pin(argument) if name == "/pin" else conversation.forget(argument)
        except Exception as error:  # a ClmError names the segment; keep the chat going
            console.print(Text(str(error), style="red"))
            return True
        console.print(f"{segment.id}: {'pinned' if name == '/pin' else 'forgotten'}")
    elif name == "/stats":
        stats = conversation.stats()
        console.print(f"{'turn':>18}: {conversation.turn}")
        for key in (
            "turns",
            "context_tokens",
            "prompt_tokens",
            "cached_tokens",
            "prefill_tokens",
            "hit_rate",
            "dropped_tokens",
            "compressed_tokens",
            "summaries",
        ):
            value = stats[key]
            console.print(f"{key:>18}: {value:.1%}" if key == "hit_rate" else f"{key:>18}: {value}")
        by_status = ", ".join(f"{status} {count}" for status, count in stats["segments_by_status"].items())
        console.print(f"{'segments':>18}: {by_status}")
    elif name == "/save":
        try:
            if argument.endswith(".json"):
                _export(conversation, Path(argument), console)
            else:
                _save(conversation, argument, console)
        except (ClmError, OSError) as error:  # an unwritable path, a file that is no store: keep the chat
            console.print(Text(f"/save failed: {error}", style="red"))
    elif name == "/help":
        for usage, meaning in HELP:
            console.print(f"  {usage:<14} {meaning}", highlight=False)
    else:
        console.print(f"unknown command {name}; /help lists them: {COMMANDS}", highlight=False)
    return True


def _export(conversation: Any, path: Path, console: Console) -> None:
    """Every message as said, every segment as the context holds it, and the totals, as JSON."""
    from clm_middleware.replay.report import write_json_atomic

    write_json_atomic(
        path,
        {
            "conversation_id": conversation.id,
            "settings": conversation.settings(),
            "messages": [{"role": m.role, "content": m.content, "turn": m.turn} for m in conversation.history],
            "segments": [
                {"id": s.id, "role": s.role, "status": s.status.value, "label": s.label.value, "text": s.visible_text}
                for s in conversation.segments
            ],
            "context": conversation.context,
            "stats": conversation.stats(),
        },
    )
    console.print(f"exported {conversation.id} to {path}")


def _save(conversation: Any, argument: str, console: Console) -> None:
    from clm_middleware.store import Store

    wanted = Path(argument or "clm_chat.db").expanduser()
    if conversation.store is None:
        conversation.attach_store(Store(wanted))
    elif argument and wanted.resolve() != conversation.store.path.resolve():
        console.print(Text(f"already saving to {conversation.store.path}; {wanted} is not used", style="yellow"))
        return
    console.print(f"saved to {conversation.store.path} as {conversation.id}; later turns are saved as they happen")


def _report_turn(conversation: Any, console: Console) -> None:
    reply = conversation.last_reply
    stats = reply.stats
    decided = [f"{d.segment_id}:{d.label.value}" for d in reply.decisions if d.label.value != "keep"]
    console.print(
        Text(
            f"turn {stats.turn} · prompt {stats.prompt_tokens} · cached {stats.cached_tokens} · "
            f"prefilled {stats.prefill_tokens} · by {stats.tagging_mode or '-'}"
            + (f" · {', '.join(decided)}" if decided else "")
            + (f" · compaction: {stats.compaction}" if stats.compaction else ""),
            style="dim",
        )
    )


def _segments_table(conversation: Any, width: int) -> Table:
    """Every segment, fitted to ``width`` columns: the short columns show whole (the id is
    what /pin and /forget take) and only the text is cut, with an ellipsis."""
    rows = [
        [
            segment.id,
            segment.role,
            segment.kind,
            segment.status.value + (" (pinned)" if segment.pinned else ""),
            segment.label.value,
            segment.decided_by.value if segment.decided_by else "-",
            " ".join(segment.visible_text.split()) or " ".join(segment.text.split()),
        ]
        for segment in conversation.segments
    ]
    names = ("id", "role", "kind", "status", "label", "by")
    widths = [max([len(name), *(len(row[i]) for row in rows)]) for i, name in enumerate(names)]
    room = max(8, min(PREVIEW_CHARS, width - sum(w + 3 for w in widths) - 4))  # 3 per column: borders, padding
    table = Table(show_lines=False)
    for name, column_width in zip(names, widths, strict=True):
        table.add_column(name, no_wrap=True, width=column_width)
    table.add_column("text", no_wrap=True, width=room)
    for row in rows:
        text = row[-1]
        # Text: a segment's words are shown as said, never read as markup ("[/x]") or emoji (":x:")
        table.add_row(*row[:-1], Text(text if len(text) <= room else text[: room - 1] + "…"))
    return table
