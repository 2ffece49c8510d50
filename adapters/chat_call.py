"""One chat call on a managed conversation, whatever the client (``ChatCLM``, ``clm serve``).

route the re-sent history (sessions.py) → add the messages that are new → set the
system sections (tools, JSON instruction) → choose the reply head (a required tool
call, ``{`` for JSON) → stream the visible reply, tool calls held back → parse the calls.

Invariant: when a call ends, the router's digests of its session describe the
conversation's messages exactly. A call that fails or is cancelled before its reply is
recorded leaves the router as it was: on a conversation it extended, it discards the
messages it added, whatever their roles (``Conversation.discard``); a conversation it
created (``new``, ``fork``) goes, with its never-saved store row, and the caller's
session name leads where it led before (``SessionRouter.abandon``). If even that is
impossible the session is closed and forgotten, never left out of step.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from clm_middleware.conversation import Conversation
from clm_middleware.engine.protocol import ServingEngine
from clm_middleware.errors import ClmError, ConfigError
from clm_middleware.lifecycle.config import GenerationSettings
from clm_middleware.lifecycle.turn import Reply
from clm_middleware.structured import ResponseFormat
from clm_middleware.structured.keywords import without_patterns

from .messages import Turn, assistant_text, turn_digest
from .sessions import Route, SessionRouter
from .tools import (
    CHOOSE_TOOL,
    CLOSE,
    OPEN,
    call_head,
    parse_tool_calls,
    required_tool,
    split_tool_calls,
    template_tools_section,
    tools_prompt,
    type_text,
)

JSON_INSTRUCTION = "Respond with a single JSON {} and nothing else."
JSON_INSTRUCTION_WITH_TOOLS = "Call a tool, or respond with a single JSON {} and nothing else."
ToolSpecs = Sequence[dict[str, Any]]


@dataclass(frozen=True, slots=True)
class ChatRequest:
    """What a client asks: the whole history and how to answer it.

    ``tools`` are OpenAI function specs (``{"type": "function", "function": {...}}``);
    ``tool_choice`` as OpenAI or LangChain give it (see ``tools.required_tool``);
    ``response_format``: the reply is grammar-constrained JSON (``structured/``), one
    object or valid against a schema; it wins over ``settings.response_format``.
    ``parallel_tool_calls``: False (the default, as llama.cpp's server) ends the reply
    with its first tool call, so nothing the client never sees follows it in the context.
    """

    turns: Sequence[Turn]
    settings: GenerationSettings
    tools: ToolSpecs = ()
    tool_choice: Any = None
    response_format: ResponseFormat | None = None
    session_id: str | None = None
    parallel_tool_calls: bool = False
    # a reply whose only calls cannot run (unparsable, an unbound tool) keeps them as text
    # in ``content``: OpenAI's schema has no field for them, and an empty answer would
    # hide that the model answered at all (vLLM returns such text as content too)
    invalid_calls_as_text: bool = False
    # where each of ``tools`` stands in the client's own list (an error names it there);
    # empty: as listed (``clm serve``'s allowed_tools shows the model only some of them)
    tool_positions: Sequence[int] = ()


@dataclass(slots=True)
class ChatAnswer:
    reply: Reply
    conversation: Conversation
    route: str  # "new" | "extend" | "fork"
    content: str  # the reply without its tool calls
    tool_calls: list[dict[str, Any]] = field(default_factory=list)  # {"name", "args", "id", "type"}
    invalid_tool_calls: list[dict[str, Any]] = field(default_factory=list)

    @property
    def finish_reason(self) -> str:
        """OpenAI's: ``tool_calls``, ``length`` or ``stop`` (a reply cut at a repeated
        sentence ended as the model's own stop would)."""
        if self.tool_calls:
            return "tool_calls"
        return "length" if self.reply.finish_reason == "length" else "stop"

    def usage(self) -> tuple[int, int, int]:
        """``(prompt, completion, cached)`` tokens as OpenAI counts them: a reply's given
        opening (a required call's head, a JSON object's ``{``) is answer, not prompt,
        though the engine read it as prompt; of the cached, none beyond the prompt."""
        stats = self.reply.stats
        prompt = stats.prompt_tokens - stats.prefix_tokens
        return prompt, stats.generated_tokens + stats.prefix_tokens, min(stats.cached_tokens, prompt)

    def returned_digest(self) -> str:
        """The digest of this reply as the client will send it back: text plus parsed calls."""
        calls = [{"name": c["name"], "arguments": c["args"]} for c in self.tool_calls]
        return turn_digest("assistant", assistant_text(self.content, calls))


class ChatCall:
    """Iterate ``stream()`` for the visible reply as it is generated; ``answer`` is set at its end."""

    def __init__(
        self,
        router: SessionRouter,
        engine: ServingEngine,
        request: ChatRequest,
        cancelled: Callable[[], bool] | None = None,
    ) -> None:
        self.router = router
        self.engine = engine
        self.request = request
        self.cancelled = cancelled  # asked after every token (see Conversation.respond_stream)
        self.answer: ChatAnswer | None = None

    def stream(self) -> Iterator[str]:
        request = self.request
        tools = [] if request.tool_choice == "none" else list(request.tools)
        # before routing, so a refused request changes nothing: the calls a grammar will write
        check_call_grammars(self.engine, _grammar_calls(request, tools), tools, request.tool_positions)
        digests = [t.digest for t in request.turns]
        route = self.router.route(request.turns, request.session_id)
        base = len(route.session.digests)
        conversation = route.session.conversation
        replies: Iterator[str] | None = None
        try:
            # a required call wins, as on OpenAI: response_format shapes a text answer
            json_format = (
                request.response_format if not tools or required_tool(request.tool_choice, tools) is None else None
            )
            conversation.set_tools_prompt(system_sections(self.engine, tools, json_format))
            for turn in route.new_turns:
                conversation.add(turn.role, turn.text)
            required = required_call(conversation, request.tool_choice, tools) if tools else None
            prefix = call_head(required, tools) if required else None
            settings = request.settings
            if not tools and answers_a_result(request.turns):
                # a call the model copies from the history could not run: it answers instead
                settings = dataclasses.replace(settings, forbid_tool_calls=True)
            if tools and not request.parallel_tool_calls:
                settings = dataclasses.replace(settings, end_after=(*settings.end_after, CLOSE))
            if json_format is not None:
                # the document, or (tools the model may call) a call of one of them instead.
                # An object's reply starts inside it; the grammar leads any other reply, and
                # a serving engine's grammar leads every reply (it starts where the server writes)
                fmt = json_format.or_calls(call_formats(self.engine, tools)) if tools else json_format
                prefix = "{" if fmt.is_object and self.engine.sees_logits else None
                settings = dataclasses.replace(settings, response_format=fmt)
            elif required and (call_format := tool_call_format(self.engine, required, tools)) is not None:
                settings = dataclasses.replace(settings, response_format=call_format)
            # with no tools bound, a call the model copies from the history is text: nothing can run it
            hidden = ToolCallHider() if tools else None
            replies = conversation.respond_stream(reply_prefix=prefix, settings=settings, cancelled=self.cancelled)
            for delta in replies:
                visible = hidden.feed(delta) if hidden is not None else delta
                if visible:
                    yield visible
            reply = conversation.last_reply
            assert reply is not None
            content, payloads = split_tool_calls(reply.text) if tools else (reply.text, [])
            cut = reply.finish_reason == "length" and bool(payloads) and not reply.text.rstrip().endswith(CLOSE)
            valid, invalid = parse_tool_calls(payloads, tools, last_cut=cut)
            if invalid and not valid and request.invalid_calls_as_text:
                content = reply.text
            if not content.strip() and not valid and "empty" not in reply.stats.reply_flags:
                reply.stats.reply_flags.append("empty")  # all it wrote was a call nothing can run
            answer = ChatAnswer(reply, conversation, route.kind, content, valid, invalid)
        except BaseException:
            if replies is not None:
                replies.close()  # the turn gives back its blocks before its messages go
            self._undo(route, base, digests)
            raise
        self.router.done(route.session, [*digests, answer.returned_digest()])
        self.answer = answer
        if hidden is not None and (rest := hidden.rest(content)):
            yield rest  # text held back as a possible call opening that never became one

    def _undo(self, route: Route, base: int, digests: list[str]) -> None:
        if route.kind in ("new", "fork"):  # this call created the conversation: it goes
            self.router.abandon(route)
            return
        try:
            route.session.conversation.discard(base)
        except ClmError:
            self.router.forget(route.session)
            return
        self.router.done(route.session, digests[:base])


def answers_a_result(turns: Sequence[Turn]) -> bool:
    """Whether the reply follows a tool's result (the last message) to a call an assistant
    message of ``turns`` made: where a small model copies that call instead of answering.
    Later replies (after a user message) may write markup freely (an HTML page)."""
    return bool(turns) and turns[-1].role == "tool" and any(t.role == "assistant" and OPEN in t.text for t in turns)


def system_sections(engine: ServingEngine, tools: ToolSpecs, response_format: ResponseFormat | None) -> str | None:
    """The system message's extra sections: the tools (the template's own section where it
    has one) and the JSON instruction, with the schema when one is given (the grammar
    makes the reply valid; the instruction tells the model what to put in it)."""
    sections = []
    if tools:
        sections.append(tools_prompt(tools, template_tools_section(engine.tokenizer, tools)))
    if response_format is not None:
        instruction = JSON_INSTRUCTION_WITH_TOOLS if tools else JSON_INSTRUCTION
        schema = response_format.schema
        what = "value" if schema is not None and schema.get("type", "object") != "object" else "object"
        sections.append(instruction.format(what) + shape_text(response_format))
    return "\n\n".join(sections) or None


def shape_text(response_format: ResponseFormat) -> str:
    """What the instruction says of a schema: its shape as ``type_text`` writes it
    (``{name: string, tags: string[]}``) and a line per described property, not the
    schema itself: SmolLM2 shown the schema filled a list with its keywords (``["type",
    "string", "null", ...]``). The grammar enforces the schema either way."""
    schema = response_format.schema
    if schema is None:
        return ""
    notes = [
        f"\n    {name}: {spec['description']}"
        for name, spec in (schema.get("properties") or {}).items()
        if isinstance(spec, dict) and isinstance(spec.get("description"), str) and spec["description"]
    ]
    about = (
        f" ({schema['description']})" if isinstance(schema.get("description"), str) and schema["description"] else ""
    )
    return f" Its shape: {type_text(schema, schema)}{about}" + "".join(notes)


def required_call(conversation: Conversation, tool_choice: Any, tools: ToolSpecs) -> str | None:
    """The tool a required call calls (None: no call is required); when the choice leaves
    the tool to the model, the model's own log-probabilities pick it among the bound names."""
    required = required_tool(tool_choice, tools)
    if required is None or isinstance(required, str):
        return required
    names = [t["function"]["name"] for t in tools]
    scores = conversation.score_continuations(CHOOSE_TOOL, [json.dumps(n)[1:] for n in names])
    return names[max(range(len(names)), key=scores.__getitem__)]


def tool_call_format(engine: Any, name: str, tools: ToolSpecs, positions: Sequence[int] = ()) -> ResponseFormat | None:
    """The grammar of a call to ``name``: ``<tool_call>{"name": ..., "arguments":
    ...}</tool_call>`` with the arguments valid against the tool's schema, so a required
    call has every required argument of the right type whatever the model. ``None``
    where no grammar can run (a remote engine: the call head alone guides the model
    there). A ``pattern`` the grammar engine cannot hold (``\\p{L}``, ``\\b``, a
    backreference) is left to the tool, which checks its own arguments; a schema that no
    grammar can hold even then (``minimum`` above ``maximum``, ``"items": 5``, a ``$ref``
    to nothing) is a ``ConfigError`` naming ``tools[i].function.parameters``, as a
    ``response_format`` schema is: a call is never written without its grammar."""
    if not engine.sees_logits:
        return None
    from clm_middleware.structured.grammar import compiler_for  # xgrammar loads on first use

    index = next(i for i, t in enumerate(tools) if t["function"]["name"] == name)
    field = f"tools[{positions[index] if positions else index}].function.parameters"
    parameters = tools[index]["function"].get("parameters")
    fmt = ResponseFormat.tool_call(name, parameters, (OPEN, CLOSE), field=field)
    try:
        compiler_for(engine).compile(fmt, field=field)
    except ConfigError as as_given:
        lenient = ResponseFormat.tool_call(name, without_patterns(parameters), (OPEN, CLOSE), field=field)
        if lenient == fmt:
            raise
        try:
            compiler_for(engine).compile(lenient, field=field)
        except ConfigError:
            raise as_given from None  # the error of the schema as given
        return lenient
    return fmt


def check_call_grammars(engine: Any, names: Sequence[str], tools: ToolSpecs, positions: Sequence[int] = ()) -> None:
    """Raise ``ConfigError`` naming the tool (``tools[2].function.parameters``, at its
    ``positions`` entry where given) unless a call of each of ``names`` compiles to a
    grammar on ``engine`` (``tool_call_format``). Compiled grammars are cached per
    engine, so a re-sent tool list costs a lookup."""
    for name in names:
        tool_call_format(engine, name, tools, positions)


def _grammar_calls(request: ChatRequest, tools: ToolSpecs) -> list[str]:
    """The tools whose calls this request decodes under a grammar: the required one (any
    bound tool, when the model picks), or every tool beside a ``response_format``; none
    under ``auto`` with free text, where a call is written as the model writes it."""
    required = required_tool(request.tool_choice, tools) if tools else None
    if isinstance(required, str):
        return [required]
    if required or request.response_format is not None:
        return [t["function"]["name"] for t in tools]
    return []


def call_formats(engine: Any, tools: ToolSpecs) -> tuple[ResponseFormat, ...]:
    """The grammars of a call to each tool in ``tools`` that can have one (see
    ``tool_call_format``): the calls a structured reply may be instead of its document."""
    names = [t["function"]["name"] for t in tools]
    return tuple(fmt for name in names if (fmt := tool_call_format(engine, name, tools)) is not None)


class ToolCallHider:
    """Streams the reply's text while holding back tool calls (they arrive parsed, at the end).

    Trailing whitespace and a suffix that may still become ``<tool_call>`` are held
    until the next delta settles them, so the streamed text equals the final content.
    """

    def __init__(self) -> None:
        self._text = ""
        self._shown = 0

    def feed(self, delta: str) -> str:
        self._text += delta
        start = self._text.find(OPEN)
        if start >= 0:
            visible = self._text[:start]
        else:
            visible = self._text
            for size in range(min(len(OPEN) - 1, len(visible)), 0, -1):
                if OPEN.startswith(visible[-size:]):
                    visible = visible[:-size]
                    break
        visible = visible.rstrip()
        if len(visible) <= self._shown:
            return ""
        out, self._shown = visible[self._shown :], len(visible)
        return out

    def rest(self, content: str) -> str:
        """What of the final ``content`` (the reply without its calls) was never shown:
        a trailing ``<`` or ``<tool`` that no call followed, or trailing whitespace."""
        return content[self._shown :]
