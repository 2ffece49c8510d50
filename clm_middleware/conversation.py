"""``Conversation``: a chat whose model manages its own context.

One turn (``send`` / ``stream`` / ``respond``)::

    new message ─ segment ─┐
    restore segments the new turn refers to (within K rounds)
    compaction, if the budget or the model's own labels call for it   (compaction.py)
    render segments → prompt ids, append-only                         (renderer.py)
    Engine.generate: pool hit, prefill the rest, decode, observe      (engine/)
    reply without its lifecycle block → a new segment, its text tokenized as a message
    label the window: model block | constrained | signals | rules      (tagging.py)
    release blocks held K rounds; persist the turn                    (reclaimer.py, store/)

Invariants:
- ``history`` holds every message as it was said; nothing is deleted, ever. The
  context (what the model sees) is derived from segments and their status.
- A label takes effect at the next compaction; until then the context is unchanged,
  so a turn without a lifecycle change prefills only its new tokens (plus < 1 block).
- The conversation holds one reference on each block of its last prompt + reply, so
  another conversation's pressure never evicts it; ``close()`` gives them back, and so
  does the pool when it runs short and no turn of it runs, or when it is collected.
- A turn that fails or is cancelled before its reply is recorded changes nothing the
  model sees: what its restoring and compaction changed goes back (``lifecycle/
  checkpoint.py``), so a refused message never costs the turns before it.
- A Conversation is used from one thread at a time; many may share one Engine.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import inspect
import os
import threading
import time
import uuid
import warnings
import weakref
from collections import Counter
from collections.abc import Callable, Generator, Iterator, Mapping, Sequence
from pathlib import Path
from types import MappingProxyType
from typing import Any

from clm_middleware.engine.protocol import ServingEngine, signals_source
from clm_middleware.errors import ClmError, ConfigError, ContextWindowError, ConversationBusyError
from clm_middleware.lifecycle.calibration import ProtocolVerdict, known_verdict, protocol_verdict
from clm_middleware.lifecycle.checkpoint import TurnCheckpoint
from clm_middleware.lifecycle.compaction import Compactor, ContextBudgetError, condensable_tokens, too_long_to_condense
from clm_middleware.lifecycle.compressor import Compressor
from clm_middleware.lifecycle.config import MIN_BUDGET_TOKENS, GenerationSettings, LifecycleConfig
from clm_middleware.lifecycle.journal import ChangeJournal
from clm_middleware.lifecycle.live import LiveIndex, recently_removed
from clm_middleware.lifecycle.prompts import PROTOCOL_PROMPT, bundled_prompt, resolve_prompt, summarizer_prompt
from clm_middleware.lifecycle.protocol import neutralise
from clm_middleware.lifecycle.reclaimer import Reclaimer
from clm_middleware.lifecycle.renderer import ContextRenderer, RenderedContext
from clm_middleware.lifecycle.segmenter import Segmenter
from clm_middleware.lifecycle.segments import (
    BY_USER,
    LOOP_KIND,
    DecidedBy,
    Decision,
    Label,
    MessageRecord,
    Segment,
    SegmentId,
    Status,
    segment_id,
)
from clm_middleware.lifecycle.tagging import Tagger
from clm_middleware.lifecycle.turn import Reply, TurnStats, sum_decision_counts, token_totals
from clm_middleware.lifecycle.turn_runner import TurnRunner
from clm_middleware.render import ChatFormat
from clm_middleware.render.chat_format import ROLES, canonical_role, lone_surrogate, longest_token_chars
from clm_middleware.store import ConversationRecord, Store, StoreError
from clm_middleware.structured import ResponseFormat

_LONGEST_TOKEN = "render.longest_token_chars"  # its slot in Engine.memo


_WARNED_MODES = "protocol_mode_warnings"  # Engine.memo: the modes warned about, once per engine


def _warn_if_known_to_fail(engine: ServingEngine, protocol_text: str, mode: str) -> None:
    """A RuntimeWarning, once per engine and mode, when ``free`` or ``constrained`` is
    chosen for a model a calibration found not to follow the protocol: it is shown the
    protocol prompt and segment markers all the same, and a model that cannot follow
    them copies them (SmolLM2 under ``constrained``: "1234567890\n1234567890" for every
    reply). Nothing is measured here."""
    warned = engine.memo.setdefault(_WARNED_MODES, set())
    if mode in warned:  # said already: no verdict to read (a server makes a conversation per session)
        return
    verdict = known_verdict(engine, protocol_text)
    if verdict is None or verdict.follows:
        return
    warned.add(mode)
    warnings.warn(
        f"tagging={mode!r}: this model failed the protocol calibration ({verdict.passed}/{verdict.probes} "
        "probes held a parseable block), yet this mode shows it the protocol prompt and segment markers, "
        "which such a model copies into its replies; tagging='auto' or 'signals' never shows them",
        RuntimeWarning,
        stacklevel=3,  # the caller of Conversation(...)
    )


def _one_caller(method: Callable[..., Any]) -> Callable[..., Any]:
    """The method runs as the conversation's one caller (``Conversation._calling``)."""

    @functools.wraps(method)
    def call(self: Conversation, *args: Any, **kwargs: Any) -> Any:
        with self._calling():
            return method(self, *args, **kwargs)

    return call


class Conversation:
    """A managed conversation. See the module docstring for what one turn does."""

    def __init__(
        self,
        engine: ServingEngine | None = None,
        *,
        system_prompt: str | None = None,
        tagging: str = "auto",
        budget: int | None = None,
        k: int = 2,
        compression: str = "auto",
        compress_min_tokens: int = 48,
        compact_ahead: bool = False,
        max_new_tokens: int = 256,
        temperature: float = 0.0,
        top_p: float = 1.0,
        top_k: int | None = None,
        min_p: float | None = None,
        seed: int | None = None,
        stop: Sequence[str] | None = None,
        repetition_penalty: float | None = None,
        frequency_penalty: float = 0.0,
        presence_penalty: float = 0.0,
        no_repeat_ngram_size: int | None = None,
        response_format: ResponseFormat | Mapping[str, Any] | None = None,
        summarizer: ServingEngine | None = None,
        store: Any = None,
        conversation_id: str | None = None,
        segmenter: Segmenter | None = None,
        protocol_prompt: str | Path | None = None,
        summarizer_prompt_text: str | Path | None = None,
        cache_salt: str | None = None,
        config: LifecycleConfig | None = None,
        generation: GenerationSettings | None = None,
        use_pool: bool = True,
    ) -> None:
        self.use_pool = use_pool  # False: every turn is computed from scratch (a stateless baseline)
        # settings are validated before a model loads: a bad one fails in milliseconds
        conversation_id = uuid.uuid4().hex if conversation_id is None else _checked_id(conversation_id)
        lifecycle = {
            "tagging": tagging,
            "budget": budget,
            "k": k,
            "compression": compression,
            "compress_min_tokens": compress_min_tokens,
            "compact_ahead": compact_ahead,
        }
        sampling = {
            "max_new_tokens": max_new_tokens,
            "temperature": temperature,
            "top_p": top_p,
            "top_k": top_k,
            "min_p": min_p,
            "seed": seed,
            "stop": stop,
            "repetition_penalty": repetition_penalty,
            "frequency_penalty": frequency_penalty,
            "presence_penalty": presence_penalty,
            "no_repeat_ngram_size": no_repeat_ngram_size,
            "response_format": response_format,
        }
        _check_not_beside("config", config, lifecycle)
        _check_not_beside("generation", generation, sampling)
        self.config = config or LifecycleConfig(**lifecycle)  # a mode's name: see LifecycleConfig.tagging
        self.generation = generation or GenerationSettings(
            **{**sampling, "stop": stop or (), "response_format": ResponseFormat.parse(response_format)}
        )
        if cache_salt is not None and not isinstance(cache_salt, str):
            raise ConfigError(
                "cache_salt", f"must be a string (a tenant's key) or None, got {type(cache_salt).__name__}"
            )
        if engine is None:
            from clm_middleware.engine import Engine  # the local default; callers may pass any ServingEngine

            engine = Engine.from_pretrained()
        self.engine = engine
        check_budget_fits_engine(self.config.budget, engine)
        warn_reply_room(self.config.budget, engine, self.generation.max_new_tokens)
        self.id = conversation_id
        self.cache_salt = cache_salt
        self.chat_format = ChatFormat.from_tokenizer(self.engine.tokenizer)
        self.segmenter = segmenter or Segmenter()
        self.tagger = Tagger(self.config.tagging, self.engine, self.chat_format)
        self.protocol_text = resolve_prompt(protocol_prompt, PROTOCOL_PROMPT)
        self.calibration: ProtocolVerdict | None = None  # auto: whether the model follows the protocol
        if self.config.tagging.mode == "auto":
            self.calibration = protocol_verdict(
                self.engine, self.protocol_text, threshold=self.config.tagging.auto_parse_rate
            )
            if not self.calibration.follows:
                self.tagger.assume_protocol_failed()
        elif self.config.tagging.uses_protocol:
            _warn_if_known_to_fail(self.engine, self.protocol_text, self.config.tagging.mode)
        self.protocol_context = self.config.tagging.uses_protocol and not self.tagger.model_failed_protocol
        self.tools_prompt: str | None = None
        self._format_changed = False  # the system block changed since the last prompt
        self.renderer = self._make_renderer()
        self.compressor = Compressor(
            self.engine,
            self.chat_format,
            method=self.config.compression,
            target_ratio=self.config.target_ratio,
            summarizer=summarizer,
            summarizer_prompt=summarizer_prompt(summarizer_prompt_text),
            shown=self.shown_text,
        )
        self.compactor = Compactor(self.config, self.compressor, self.prompt_length)
        self.reclaimer = Reclaimer(self.engine.pool, self.config.k)
        # tokens forget() took out of the context since the last turn: counted in the next
        # turn's dropped_tokens, as a compaction's drops are
        self.forgotten_tokens = 0
        self.messages: list[MessageRecord] = []
        self.fold = 0  # messages before this index are rendered in the digest
        self._live = LiveIndex(self.config.k)  # messages that can still matter (lifecycle/live.py)
        self._segments: dict[SegmentId, Segment] = {}
        self._next_index = 0
        self.turn = 0
        self._held = _HeldBlocks()  # pool blocks of the previous prompt + reply (its ``chain``)
        self._last_used = time.monotonic()  # the end of the last turn: who gives blocks back first
        self._last_render: RenderedContext | None = None
        self._turn_log: list[TurnStats] = []
        self._unsaved_turns: list[TurnStats] = []  # a fork's copied turns, for its first save
        self.journal = ChangeJournal()  # what the next save writes
        self.last_reply: Reply | None = None
        self._open_stream: Generator[str, None, None] | None = None  # a stream not finished or closed yet
        # turns running now (a stream open counts), under a lock held only to change or
        # read it: the pool's pressure listener gives the chain back only while none runs.
        # Not a lock held for the turn itself: a stream may be closed from another thread
        # (an async caller's next call), and a turn may start inside a stream's callback.
        self._turns_running = 0
        self._turns_lock = threading.Lock()
        # the thread inside a call on this conversation (a stream counts while it computes,
        # not between the pieces it yields), and how deep: its own nested calls go on
        self._caller: tuple[int, int] | None = None
        self._runner = TurnRunner(self)
        if hasattr(self.engine.pool, "add_pressure_listener"):  # a remote engine's pool has none
            self.engine.pool.add_pressure_listener(_ReleaseWhenIdle(self))
        # one dropped without close() gives its blocks back all the same
        weakref.finalize(self, _give_back_when_collected, self.engine.pool, self._held, self.reclaimer)
        self.store = _open_store(store)
        self._saved = False  # whether a turn, a user decision or close() saved (abandon removes a row never saved to)
        self._stored_turn: int | None = None  # the turn the store's row says, as this object last wrote or read it
        if self.store is not None:
            self.store.register(self.record())
            self._stored_turn = self.turn
        if system_prompt:
            self.add("system", system_prompt)
            if self.store is not None:
                # saved with its row: a process killed in the first turn left a row with no
                # system prompt, which a resume then continued without one
                self.persist()
                self._saved = False  # no turn yet: abandon still removes the row
        else:
            self._check_system_block_fits()

    # ------------------------------------------------------------ public API

    @_one_caller
    def send(self, text: str) -> Reply:
        """Add a user message and answer it.

        If the message cannot be answered as it is (a ``ValueError``: over the budget or
        the window, a bad setting), or the user interrupts the turn (Ctrl-C, a
        ``KeyboardInterrupt``), it is taken back: the conversation is as it was before
        the call, and the next ``send`` does not carry it along. If the engine failed (a
        server gone, the pool full), the message stays, unanswered, and ``respond()``
        answers it once the engine is back: no message is lost."""
        start = len(self.messages)
        self.add("user", text)
        try:
            return self.respond()
        except (ValueError, KeyboardInterrupt):
            self.discard(start)
            raise

    @_one_caller
    def stream(self, text: str) -> Iterator[str]:
        """Like ``send``, yielding the visible reply as it is generated; then ``last_reply``
        is set. A stream closed before its end takes its message back, as a ``ValueError``
        or a ``KeyboardInterrupt`` does; an engine failure leaves it pending, as in
        ``send``. A stream left unfinished (a ``break`` out of the loop) is closed by the
        next call on the conversation, which takes its message back before going on."""
        self._close_open_stream()
        return self._opened(self._streamed(text))

    def _streamed(self, text: str) -> Iterator[str]:
        start = len(self.messages)
        self.add("user", text)
        try:
            yield from self._runner.turn_steps(None, "", self.generation, None)
        except (ValueError, GeneratorExit, KeyboardInterrupt):
            self.discard(start)
            raise

    @_one_caller
    def add(self, role: str, content: str) -> list[Segment]:
        """Put a message into the conversation without answering it (system, user or tool).

        An empty message, or one of whitespace only, is an empty turn, as the chat template
        renders ``""`` (histories hold them: a chat UI's stray Enter, an export's blank turn)."""
        spelled = canonical_role(role)  # "User", "developer", "human": as the CLI and ChatCLM read them
        if spelled is None:
            raise ConfigError("role", f"unknown role {role!r}; use one of {ROLES}")
        role = spelled
        self._close_open_stream()
        if not isinstance(content, str):
            raise ConfigError("content", f"must be a string, got {type(content).__name__}")
        if lone_surrogate(content) is not None:
            raise ConfigError("content", "holds a lone surrogate (e.g. \\ud800): not Unicode text")
        self._check_length(role, content)
        text = self.segmenter.normalise_text(content)
        turn = self.turn if role == "system" and not self.messages else self.turn + 1
        message = MessageRecord(index=len(self.messages), role=role, content=content, turn=turn)
        self.messages.append(message)
        self.journal.message(message)
        created = []
        for piece in self.segmenter.split(text, role):
            created.append(
                self.new_segment(
                    message,
                    piece.text,
                    self.encode_content(piece.text, role, after_space=piece.separator.endswith(" ")),
                    piece.kind,
                    piece.separator,
                )
            )
        if role == "system":
            try:
                self._check_system_block_fits()
            except ContextBudgetError:
                self.discard(message.index)
                raise
        return created

    def respond(
        self,
        forced_reply: str | None = None,
        *,
        reply_prefix: str | None = None,
        settings: GenerationSettings | None = None,
    ) -> Reply:
        """Answer the messages added since the last reply.

        ``forced_reply`` keeps that text as the answer instead (teacher forcing): the
        model computes only its first token. ``reply_prefix`` makes the answer start
        with that text (e.g. ``<tool_call>`` to require a tool call, ``{`` for JSON);
        the model continues from it, and a stop string counts only in what it writes
        (``stats.prefix_tokens`` counts the prefix). ``settings`` override the generation settings for
        this turn only. With ``settings.response_format`` (or the constructor's
        ``response_format``) the reply is grammar-constrained JSON: valid by
        construction, ending where the document ends; a ``reply_prefix`` must then start
        such a document, and ``finish_reason == "length"`` means ``max_new_tokens`` ran
        out before it was complete.
        """
        for _ in self.respond_stream(forced_reply, reply_prefix=reply_prefix, settings=settings):
            pass
        assert self.last_reply is not None
        return self.last_reply

    @_one_caller
    def respond_stream(
        self,
        forced_reply: str | None = None,
        *,
        reply_prefix: str | None = None,
        settings: GenerationSettings | None = None,
        cancelled: Callable[[], bool] | None = None,
    ) -> Iterator[str]:
        """Like ``respond``, yielding the visible answer as it is generated.

        ``cancelled`` is asked after every generated token, and before every prefill chunk
        of the prompt; once it says yes, the turn stops with ``TurnCancelled``, as if it
        had never started (its blocks go back).
        A stream left unfinished is closed by the next call on the conversation.
        """
        self._close_open_stream()
        for name, value in (("forced_reply", forced_reply), ("reply_prefix", reply_prefix)):
            if value is not None and not isinstance(value, str):
                raise ConfigError(name, f"must be a string, got {type(value).__name__}")
        if settings is not None and not isinstance(settings, GenerationSettings):
            raise ConfigError("settings", f"must be a GenerationSettings, got {type(settings).__name__}")
        steps = self._runner.turn_steps(forced_reply, reply_prefix or "", settings or self.generation, cancelled)
        return self._opened(steps)

    def _opened(self, steps: Generator[str, None, None]) -> Iterator[str]:
        """``steps`` as the conversation's open stream until it ends or is closed."""

        def tracked() -> Generator[str, None, None]:
            with self._turns_lock:
                self._turns_running += 1
            try:
                while True:
                    with self._calling():  # each piece is computed by one caller at a time
                        try:
                            piece = next(steps)
                        except StopIteration:
                            return
                    yield piece
            finally:
                steps.close()  # closed early: the turn is undone (a no-op once it has ended)
                if self._open_stream is stream:
                    self._open_stream = None
                with self._turns_lock:
                    self._turns_running -= 1
                    self._last_used = time.monotonic()

        stream = tracked()
        self._open_stream = stream
        return stream

    @contextlib.contextmanager
    def _calling(self) -> Iterator[None]:
        """Be the conversation's one caller for the block: a call from another thread while
        one runs is a ``ConversationBusyError`` (two turns at once had interleaved their
        messages and replies); the same thread's nested calls go on."""
        me = threading.get_ident()
        with self._turns_lock:
            thread, depth = self._caller or (me, 0)
            if thread != me:
                raise ConversationBusyError(
                    f"conversation {self.id!r} is answering a call from another thread; it takes one call at a time",
                    hint="use one conversation per thread, or a lock around the calls",
                )
            self._caller = (me, depth + 1)
        try:
            yield
        finally:
            with self._turns_lock:
                self._caller = (me, depth) if depth else None

    def _close_open_stream(self) -> None:
        """Close a stream its caller left unfinished (a ``break`` out of the loop): its turn
        is undone and, for ``stream``, its message taken back, before anything else runs."""
        stream = self._open_stream
        if stream is None or stream.gi_running:  # none, or this call comes from inside it
            return
        self._open_stream = None
        stream.close()

    @_one_caller
    def discard(self, messages: int) -> None:
        """Remove the messages from index ``messages`` on: what a failed or cancelled call
        added before its reply was recorded. The conversation then renders as it did before
        that call, and nothing of it reaches the store.

        Only messages of the turn not answered yet can go, whatever their role (a caller
        may add its own assistant and tool messages before asking for a reply): a
        ``ConfigError`` if one of them belongs to an answered turn (``history`` never loses
        what was answered).
        """
        removed = self.messages[messages:]
        if not 0 <= messages <= len(self.messages) or any(m.turn <= self.turn and m.turn > 0 for m in removed):
            raise ConfigError("messages", f"only unanswered messages can be discarded, not from index {messages}")
        for message in removed:
            for segment in message.segment_ids:
                self._segments.pop(segment, None)
        self.journal.forget(removed)
        del self.messages[messages:]
        self._live.truncate(messages)
        self.fold = min(self.fold, messages)
        # their numbers are free again: the next message gets the one it would have had
        self._next_index = max((s.index for s in self._segments.values()), default=-1) + 1

    def _check_length(self, role: str, content: str) -> None:
        """Refuse, before segmenting or tokenizing it, a message too long to ever be sent:
        at ``longest_token_chars`` characters a token, it needs more positions than the
        model has, or (a person's message under a budget) more tokens than can be condensed
        to fit (``Compactor._check_condensable``'s bound). An 8 MB message had cost seconds
        and a gigabyte before its refusal. A tool's result under a budget is trimmed to fit
        instead, whatever its size."""
        per_token = self.engine.memo.get(_LONGEST_TOKEN)
        if per_token is None:
            per_token = self.engine.memo.setdefault(_LONGEST_TOKEN, longest_token_chars(self.engine.tokenizer))
        if not per_token:
            return
        least = -(-len(content) // per_token)  # tokens the text needs, at the fewest
        positions = self.engine.max_positions
        if positions and least > positions and not (role == "tool" and self.config.budget is not None):
            raise ContextWindowError(
                f"the {role} message has {len(content):,} characters, at least {least:,} tokens: "
                f"more than the model's {positions} positions",
                hint="send a shorter message, or the text in parts",
            )
        budget, ratio = self.config.budget, self.config.target_ratio
        if budget is not None and role in ("user", "assistant") and least > condensable_tokens(budget, ratio):
            raise too_long_to_condense(f"{len(content):,} characters, at least {least:,} tokens", budget, ratio)

    @_one_caller
    def set_tools_prompt(self, text: str | None) -> None:
        """The tools section of the system message (see ``adapters/tools.py``); ``None`` removes it.

        Changing it changes the start of the prompt, so the next turn re-prefills.
        """
        if text != self.tools_prompt:
            before, self.tools_prompt = self.tools_prompt, text
            self.rebuild_renderer()
            try:
                self._check_system_block_fits()
            except ContextBudgetError:
                self.tools_prompt = before
                self.rebuild_renderer()
                raise

    def system_block_tokens(self) -> int:
        """Tokens every prompt spends before any message: the system block (protocol
        prompt, tools, system messages, all pinned) and the reply glue."""
        system = [m for m in self.messages if m.role == "system"]
        reply_id = segment_id(self._next_index)
        return len(self.renderer.render(system, self._segments, reply_id=reply_id).token_ids)

    def _check_system_block_fits(self) -> None:
        """``ContextBudgetError`` when the pinned system block leaves the budget no room
        for a message: every turn would fail, so the setting that does it fails now."""
        budget = self.config.budget
        if budget is None:
            return
        fixed = self.system_block_tokens()
        if fixed < budget:
            return
        hint = "raise the budget or shorten the system prompt"
        if self.protocol_context:
            hint += "; tagging='signals' does not show the protocol prompt"
        raise ContextBudgetError(
            f"the system block ({self._system_block_parts()}) takes {fixed} tokens, "
            f"which leaves no room for a message in a budget of {budget}",
            hint=hint,
        )

    def _system_block_parts(self) -> str:
        parts = [
            name
            for name, present in (
                ("protocol prompt", self.protocol_context),
                ("tools", self.tools_prompt),
                ("system messages", any(m.role == "system" for m in self.messages)),
            )
            if present
        ]
        return ", ".join(parts) or "chat glue"

    def budget_refusal(self, error: ContextBudgetError) -> ContextBudgetError:
        """``error`` (a turn refused for the budget) saying what the system block takes of
        the budget, where that is a quarter of it or more: at budget 256 the protocol
        prompt alone is ~220 tokens, and "the prompt needs 300 tokens" did not say why."""
        budget = self.config.budget
        fixed = self.system_block_tokens()
        if budget is None or fixed * 4 < budget:
            return error
        hint = error.hint or ""
        if self.protocol_context:
            hint += ("; " if hint else "") + "tagging='signals' does not show the protocol prompt"
        return ContextBudgetError(
            f"{error.message}; the system block ({self._system_block_parts()}) takes {fixed} of the {budget}",
            hint=hint or None,
        )

    def score_continuations(self, prefix: str, candidates: Sequence[str]) -> list[float]:
        """Log-probability the model gives each candidate after the next prompt and ``prefix``.

        Scores the prompt as it stands now (before the next turn's compaction); used to
        let the model pick among fixed options, e.g. which bound tool to call.
        """
        rendered = self.renderer.render(
            self._rendered_messages(self.fold), self._segments, reply_id=segment_id(self._next_index), fold=self.fold
        )
        prompt = rendered.token_ids + self.chat_format.encode(prefix)
        return self.engine.score(prompt, [self.chat_format.encode(c) for c in candidates], cache_salt=self.cache_salt)

    def fork(self, messages: int, conversation_id: str | None = None) -> Conversation:
        """A new conversation sharing the first ``messages`` messages, with their segments
        and labels. Used when a caller edits or branches a history. ``messages`` counts
        from the start: 0 to ``len(history)``.

        This one's compaction was made for its own, longer history: the fork shows its
        messages verbatim, as a new conversation would, when it has no budget or they fit it;
        otherwise it keeps what this one did to them (it renders that prefix as this one
        does, so the prefix's blocks still hit), except that its newest exchange (the
        messages after its last reply) is never folded, as in any turn. A reply dropped as
        a repetition loop stays dropped."""
        if isinstance(messages, bool) or not isinstance(messages, int) or not 0 <= messages <= len(self.messages):
            raise ConfigError("messages", f"must be an integer from 0 to {len(self.messages)}, got {messages!r}")
        twin = Conversation(
            self.engine,
            config=self.config,
            generation=self.generation,
            segmenter=self.segmenter,
            protocol_prompt=self.protocol_text,
            summarizer=None if self.compressor.summarizer is self.engine else self.compressor.summarizer,
            summarizer_prompt_text=self.compressor.prompt,
            cache_salt=self.cache_salt,
            store=self.store,
            conversation_id=conversation_id,
        )
        copied = [dataclasses.replace(m, segment_ids=list(m.segment_ids)) for m in self.messages[:messages]]
        twin.messages = copied
        twin._segments = {s: copy.deepcopy(self._segments[s]) for m in copied for s in m.segment_ids}
        twin._next_index = self._next_index
        twin.turn = max((m.turn for m in copied if m.role == "assistant"), default=0)
        # the turns of the history it shares are its own too (clm stats, a store's turn rows)
        twin._turn_log = [copy.deepcopy(t) for t in self._turn_log if t.turn <= twin.turn]
        twin._unsaved_turns = list(twin._turn_log)
        twin.fold = min(self.fold, messages)
        twin.protocol_context = self.protocol_context
        twin.tools_prompt = self.tools_prompt
        twin.renderer = twin._make_renderer()
        twin.tagger.parse_history.extend(self.tagger.parse_history)
        twin._unfold_for_fork(twin.config.budget)
        twin.journal.everything(copied)
        return twin

    def _unfold_for_fork(self, budget: int | None) -> None:
        """See ``fork``: verbatim if that fits ``budget``, else the newest exchange unfolded.
        Without a budget, verbatim with no label pending (labels take effect without
        one): the fork's first turn sees what a new conversation would, as the turn it
        forks from did. (The live index of a fork lists every message until its first
        turn's refresh.)"""
        segments = [self._segments[s] for m in self.messages for s in m.segment_ids]
        # what to go back to if the verbatim history is over the budget (none: nothing is)
        inherited = TurnCheckpoint.take(segments, self.fold) if budget is not None else None
        self._show_verbatim(self.messages)
        self.fold = 0
        if budget is None or inherited is None:
            for segment in segments:
                if segment.pending:
                    segment.label, segment.decided_by = Label.KEEP, None
            return
        if self.prompt_length(0) <= budget:
            return
        inherited.restore(self._segments)
        self.fold = inherited.fold
        replies = [m.index for m in self.messages if m.role == "assistant"]
        newest = replies[-1] + 1 if replies else 0
        if self.fold > newest:
            self._show_verbatim(self.messages[newest:])
            self.fold = newest

    def _show_verbatim(self, messages: Sequence[MessageRecord]) -> None:
        for message in messages:
            for identifier in message.segment_ids:
                segment = self._segments[identifier]
                if segment.status is not Status.ACTIVE and segment.kind != LOOP_KIND:
                    self.restore(segment)

    @property
    def history(self) -> list[MessageRecord]:
        """Every message, complete, whatever the context keeps of it."""
        return list(self.messages)

    @property
    def segments(self) -> list[Segment]:
        """Every segment of every message, in order (the whole history: O(messages))."""
        return [self._segments[s] for m in self.messages for s in m.segment_ids]

    def live_messages(self) -> list[MessageRecord]:
        """The messages that can still change what a turn does, in order: those with a
        segment shown, pending, or removed within K rounds (``lifecycle/live.py``); a
        superset between turns. What a turn scans, so its cost follows the context."""
        return self._live.messages(self.messages)

    def live_segments(self) -> list[Segment]:
        """The segments of ``live_messages``, in order."""
        return [self._segments[s] for m in self.live_messages() for s in m.segment_ids]

    def refresh_live(self) -> None:
        """Re-check the live messages for the current turn (at the start of a turn)."""
        self._live.refresh(self.messages, self._segments, self.turn)

    @property
    def context(self) -> str:
        """The text the model sees now (before the next generation prompt)."""
        rendered = self.render_prompt(None, for_generation=False)
        return self.renderer.text(rendered.token_ids)

    @property
    def context_ids(self) -> list[int]:
        """The token ids of ``context``: what the next turn's prompt starts with."""
        return list(self.render_prompt(None, for_generation=False).token_ids)

    @property
    def context_tokens(self) -> int:
        return len(self.render_prompt(None, for_generation=False).token_ids)

    def segment(self, segment: SegmentId | str | int) -> Segment:
        """The segment named ``seg_N``, or numbered ``N`` (``3`` or ``"3"``, as ``context``
        and ``clm chat``'s /segments show it)."""
        if isinstance(segment, int) and not isinstance(segment, bool):
            segment = segment_id(segment)
        elif isinstance(segment, str) and segment.isdecimal():
            segment = segment_id(int(segment))
        try:
            return self._segments[SegmentId(segment)]
        except KeyError:
            raise ConfigError("segment", f"no segment {segment!r} in conversation {self.id}") from None

    @_one_caller
    def pin(self, segment: SegmentId | str | int) -> Segment:
        """Never drop or compress this segment; brings it back if it was removed.

        A stream left unfinished is closed first (its turn undone, its message taken
        back), as by any call: undoing it later would put the segment's old state back."""
        self._close_open_stream()
        target = self.segment(segment)
        target.pinned, target.label, target.decided_by = True, Label.KEEP, DecidedBy.RULES
        if target.status is not Status.ACTIVE:
            self.restore(target)
        self._record_user_decision(target, Label.KEEP, "pinned")
        return target

    @_one_caller
    def forget(self, segment: SegmentId | str | int) -> Segment:
        """Drop this segment from the context at the next turn (it stays in ``history``).
        Forgetting overrides a pin (the system prompt's included): a forgotten segment that
        a later message brings back is an ordinary one, not pinned again. A stream left
        unfinished is closed first, as by ``pin``: the forgotten text never comes back."""
        self._close_open_stream()
        target = self.segment(segment)
        target.pinned = False
        target.label, target.decided_by = Label.DROP, DecidedBy.RULES
        if target.visible:
            spans = self._last_render.spans if self._last_render else {}
            if target.id in spans:
                self.reclaimer.hold(target.id, self.blocks_of(target.id), self.turn)
            self.forgotten_tokens += len(target.visible_ids)
            target.status, target.removed_round = Status.DROPPED, self.turn
        self._record_user_decision(target, Label.DROP, "forgotten")
        return target

    def stats(self) -> dict[str, Any]:
        """Totals over every turn so far, and where the pool stands."""
        log = self._turn_log
        prompt, cached, prefill = token_totals(log)  # compacted contexts computed ahead count too
        return {
            "conversation_id": self.id,
            "turns": len(log),
            "prompt_tokens": prompt,
            "cached_tokens": cached,
            "prefill_tokens": prefill,
            "hit_rate": cached / prompt if prompt else 0.0,
            "context_tokens": self.context_tokens,
            "segments": len(self._segments),
            "segments_by_status": {
                status.value: sum(s.status is status for s in self._segments.values()) for status in Status
            },
            "decisions": sum_decision_counts([t.decisions for t in log]),
            "dropped_tokens": sum(t.dropped_tokens for t in log),
            "compressed_tokens": sum(t.compressed_tokens for t in log),
            "summaries": sum(len(t.summaries) for t in log),
            "lifecycle_s": sum(t.lifecycle_s for t in log),
            "turn_s": sum(t.turn_s for t in log),
            "tagging": self.config.tagging.mode,
            "protocol_context": self.protocol_context,
            "protocol_calibration": self.calibration.as_dict() if self.calibration else None,
            # over the turns that asked for a block, as the replay report's; None: none asked
            # (auto on a model that failed calibration starts from a history of failures)
            "parse_rate": _mean([float(t.parse_ok) for t in log if t.parse_ok is not None]),
            "reply_flags": dict(Counter(flag for t in log for flag in t.reply_flags)),
            "reply_nll": _mean([t.reply_nll for t in log if t.reply_nll is not None]),
            "held_blocks": len(self._held.chain) + self.reclaimer.held_blocks,
            "pool": self.engine.pool.stats().as_dict(),
            "signals_source": signals_source(self.engine),
        }

    def settings(self) -> dict[str, Any]:
        """The settings a reload needs (``Conversation.load`` passes them back): the
        constructor's arguments, and under ``lifecycle_settings`` / ``generation_settings``
        what a ``config=`` / ``generation=`` of one's own set beyond them (a custom
        ``TaggingConfig`` is not kept: a reload reads its mode's defaults)."""
        config, generation = self.config, self.generation
        return {
            "tagging": config.tagging.mode,
            "budget": config.budget,
            "k": config.k,
            "compression": config.compression,
            "compress_min_tokens": config.compress_min_tokens,
            "compact_ahead": config.compact_ahead,
            "max_new_tokens": generation.max_new_tokens,
            "temperature": generation.temperature,
            "top_p": generation.top_p,
            "top_k": generation.top_k,
            "min_p": generation.min_p,
            "seed": generation.seed,
            "stop": list(generation.stop),
            "repetition_penalty": generation.repetition_penalty,
            "frequency_penalty": generation.frequency_penalty,
            "presence_penalty": generation.presence_penalty,
            "no_repeat_ngram_size": generation.no_repeat_ngram_size,
            "response_format": None if generation.response_format is None else generation.response_format.as_openai(),
            "cache_salt": self.cache_salt,
            **({"use_pool": False} if not self.use_pool else {}),
            # prompts only where they differ from the bundled ones (a reload then reads
            # the bundled files of its own version, as a new conversation would)
            **(
                {"protocol_prompt": self.protocol_text} if self.protocol_text != bundled_prompt(PROTOCOL_PROMPT) else {}
            ),
            **(
                {"summarizer_prompt_text": self.compressor.prompt}
                if self.compressor.prompt != summarizer_prompt(None)
                else {}
            ),
            **({TOOLS_PROMPT_SETTING: self.tools_prompt} if self.tools_prompt is not None else {}),
            # what a config= or generation= of one's own set beyond the arguments above
            **_beyond_defaults(LIFECYCLE_SETTING, config, LifecycleConfig(), _LIFECYCLE_BEYOND),
            **_beyond_defaults(GENERATION_SETTING, generation, GenerationSettings(), _GENERATION_BEYOND),
        }

    @property
    def turn_log(self) -> list[TurnStats]:
        return list(self._turn_log)

    @_one_caller
    def close(self) -> None:
        """Save what the store does not hold yet (messages added since the last turn: a
        system prompt, a seeded history, a fork's copy), then give back every pool
        reference: the conversation can be loaded again from its store as it is. A
        conversation with nothing unsaved writes nothing (a store opened read-only stays
        untouched). A stream left unfinished is closed first: its message is taken back,
        never saved."""
        self._close_open_stream()
        try:
            if self.store is not None and not self.journal.empty:
                self.persist()
        finally:
            self.release_cache()

    def release_cache(self) -> int:
        """Give back every pool reference this conversation holds between turns (its last
        prompt + reply, and the blocks of segments it let go K rounds ago); returns how
        many. The blocks stay cached, nobody's, until the pool needs the room: the next
        turn still hits those left. The conversation stays usable; call it between turns.
        The engine's pool calls it itself when an allocation finds too little room and no
        turn of this conversation runs, least recently used conversation first."""
        with self._turns_lock:  # one release at a time, whichever thread asks
            return self._release_cache_locked()

    def _release_cache_locked(self) -> int:
        return self._held.give_back(self.engine.pool, self.reclaimer)

    def forget_unsaved_row(self) -> None:
        """Remove this conversation's store row if it never saved a turn, even while a
        turn runs in another thread (a shutdown that cannot wait for a first turn): no
        empty row stays of a turn the process never finishes. A turn that does end after
        this saves its row anew, whole."""
        if self.store is not None and not self._saved:
            self.store.unregister(self.id)

    @_one_caller
    def abandon(self) -> None:
        """Close a conversation whose first call failed: one that never saved a turn also
        leaves no row in its store (nothing half-done is stored)."""
        self.release_cache()
        if self.store is not None and not self._saved:
            self.store.unregister(self.id)

    def __repr__(self) -> str:
        budget = self.config.budget
        return (
            f"Conversation(id={self.id!r}, turn={self.turn}, messages={len(self.messages)}, "
            f"budget={budget}, tagging={self.config.tagging.mode!r}, model={self.engine.model_name!r})"
        )

    def __enter__(self) -> Conversation:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @classmethod
    def load(
        cls, store: Any, conversation_id: str, engine: ServingEngine | None = None, **settings: Any
    ) -> Conversation:
        """Rebuild a stored conversation: same messages, segments, labels, context.
        Segments are stored as token ids, so the engine must tokenize as the one that
        stored them: another model's engine is a ``ConfigError`` (its vocabulary would read
        the ids as other text)."""
        if settings.pop("system_prompt", None):  # None or "": the stored one, as asked
            raise ConfigError(
                "system_prompt",
                "a loaded conversation keeps the system message it was stored with",
                hint='add("system", text) adds one after its history',
            )
        if isinstance(store, Store):
            return cls._load_from(store, conversation_id, engine, settings)
        if not isinstance(store, str | Path):
            raise ClmError(f"store must be a path or a Store, got {type(store).__name__}")
        if not Path(store).expanduser().is_file():  # a mistyped path: nothing to load, nothing created
            raise StoreError(f"{store}: no such store")
        opened = _store_to_continue(Path(store).expanduser())
        try:
            return cls._load_from(opened, conversation_id, engine, settings)
        except BaseException:
            opened.close()  # the store this call opened: nobody else holds it
            raise

    @classmethod
    def _load_from(
        cls, store: Store, conversation_id: str, engine: ServingEngine | None, settings: dict[str, Any]
    ) -> Conversation:
        stored = store.load(conversation_id)
        known = inspect.signature(cls.__init__).parameters.keys() - {"self", "engine", "store", "conversation_id"}
        if unknown := sorted(stored.record.settings.keys() - known - _STORED_ONLY):
            raise StoreError(
                f"{store.path}: conversation {conversation_id!r} has settings this version does not know "
                f"({', '.join(unknown)})",
                hint="was it stored by a newer clm-middleware?",
            )
        if unknown := sorted(settings.keys() - known):
            raise ConfigError(unknown[0], f"not a setting of a loaded conversation (known: {', '.join(sorted(known))})")
        given = {**stored.record.settings, **settings}
        tools_prompt = given.pop(TOOLS_PROMPT_SETTING, None)  # set with set_tools_prompt, not a constructor argument
        _rebuild_settings(given, LIFECYCLE_SETTING, "config", LifecycleConfig, _LIFECYCLE_ARGUMENTS)
        _rebuild_settings(given, GENERATION_SETTING, "generation", GenerationSettings, _GENERATION_ARGUMENTS)
        conversation = cls(engine, conversation_id=conversation_id, **given)
        conversation.tools_prompt = tools_prompt
        conversation.store = store  # its row exists: saves continue it (no register)
        conversation._saved, conversation._stored_turn = True, stored.record.turn
        _check_stored_ids(stored.record.model, stored.segments, conversation.engine, store.path)
        conversation.messages = stored.messages
        conversation._segments = {s.id: s for s in stored.segments}
        conversation.turn = stored.record.turn
        conversation._next_index = stored.record.next_index
        conversation.fold = stored.record.fold
        if conversation.config.tagging.mode == stored.record.settings.get("tagging", "auto"):
            conversation.protocol_context = stored.record.protocol_context  # auto may have left the protocol
        # else the tagging given now decides, as for a new conversation: signals never show the protocol
        conversation.renderer = conversation._make_renderer()
        conversation.tagger.parse_history.extend(stored.record.parse_history)
        conversation._turn_log = [TurnStats.from_dict(values) for values in stored.turn_stats]
        conversation.journal = ChangeJournal()  # all of it is stored already
        conversation._check_system_block_fits()  # a budget given now must hold the stored system messages
        return conversation

    def record(self) -> ConversationRecord:
        """This conversation's row in a store: its counters and settings."""
        return ConversationRecord(
            id=self.id,
            model=self.engine.model_name,
            settings=self.settings(),
            turn=self.turn,
            next_index=self._next_index,
            fold=self.fold,
            protocol_context=self.protocol_context,
            parse_history=list(self.tagger.parse_history),
        )

    def attach_store(self, store: Store) -> None:
        """Save to ``store`` from now on, everything so far included: messages, segments,
        decisions and the stats of every turn run (``clm stats`` reads them)."""
        store.register(self.record())  # refuses an id the store holds: nothing is attached then
        self.store, self._stored_turn = store, self.turn
        self.journal.everything(self.messages)
        self._unsaved_turns = []  # among the turn log's
        self.persist(self._turn_log)

    def segment_map(self) -> Mapping[SegmentId, Segment]:
        """Every segment by id (read-only view; change segments through the conversation)."""
        return MappingProxyType(self._segments)

    def next_segment_id(self) -> SegmentId:
        """The id the next new segment gets."""
        return segment_id(self._next_index)

    # ------------------------------------- one turn (what lifecycle/turn_runner.py uses)

    def rebuild_renderer(self) -> None:
        """Render from now on with the current protocol and tools settings; the prompt's
        start moves, so the next turn re-prefills (``take_format_change`` says so once)."""
        self.renderer = self._make_renderer()
        self._format_changed = True

    def take_format_change(self) -> bool:
        """Whether the system block changed since the last call (then cleared)."""
        changed, self._format_changed = self._format_changed, False
        return changed

    def swap_chain(self, block_ids: list[int]) -> list[int]:
        """Hold ``block_ids`` (the new prompt + reply) as this conversation's chain; returns
        the previous chain, which the caller releases."""
        previous, self._held.chain = self._held.chain, list(block_ids)
        return previous

    @property
    def chain_blocks(self) -> int:
        """Pool blocks the conversation holds for its last prompt + reply."""
        return len(self._held.chain)

    def log_turn(self, stats: TurnStats) -> None:
        """Append a finished turn's figures to ``turn_log``."""
        self._turn_log.append(stats)

    def _make_renderer(self) -> ContextRenderer:
        sections = [self.protocol_text if self.protocol_context else None, self.tools_prompt]
        return ContextRenderer(
            self.chat_format,
            preamble="\n\n".join(s for s in sections if s) or None,
            markers=self.protocol_context,
        )

    @property
    def last_render(self) -> RenderedContext | None:
        """The last prompt rendered for generation: ``blocks_of`` maps segments to the held
        chain's blocks through its spans."""
        return self._last_render

    def restore_render(self, rendered: RenderedContext | None) -> None:
        """Put back the render a cancelled or failed turn replaced, with the chain it
        describes (a compacted prompt's spans had been left: the segments it dropped
        then mapped to no block, and were held for no reclamation round)."""
        self._last_render = rendered

    def render_prompt(self, reply_id: SegmentId | None, *, for_generation: bool = True) -> RenderedContext:
        """The context as the model sees it next; ``for_generation`` adds the reply glue
        (and ``reply_id``'s marker where the protocol is shown) and remembers the render,
        whose spans ``blocks_of`` reads."""
        rendered = self.renderer.render(
            self._rendered_messages(self.fold),
            self._segments,
            reply_id=reply_id,
            for_generation=for_generation,
            fold=self.fold,
        )
        if for_generation:
            self._last_render = rendered
        return rendered

    def prompt_length(self, fold: int) -> int:
        """Tokens of the next prompt if the digest held the messages before ``fold``."""
        reply_id = segment_id(self._next_index)
        messages = self._rendered_messages(fold)
        return len(self.renderer.render(messages, self._segments, reply_id=reply_id, fold=fold).token_ids)

    def _rendered_messages(self, fold: int) -> list[MessageRecord]:
        """The messages a render needs: all but the folded ones that show nothing.

        Folded messages whose segments are all removed render as nothing, and over a long
        history they are most of it; only the live ones (``LiveIndex``) are looked at, so
        a turn's cost is bound to the context, not the history. The system message, if
        first, stays."""
        first = 1 if self.messages and self.messages[0].role == "system" else 0
        limit = max(first, min(fold, len(self.messages)))
        folded = [
            m
            for m in self.live_messages()
            if first <= m.index < limit and any(self._segments[s].visible for s in m.segment_ids)
        ]
        return [*self.messages[:first], *folded, *self.messages[limit:]]

    def shown_text(self, text: str, role: str = "user") -> str:
        """The text the model is shown of ``text``: with the protocol in the context,
        content of every role but the operator's system prompt has its protocol
        look-alikes neutralised (``protocol.neutralise``); otherwise ``text`` itself.
        A segment keeps the ids it was created with when the protocol leaves."""
        return neutralise(text) if self.protocol_context and role != "system" else text

    def encode_content(self, text: str, role: str = "user", *, after_space: bool = False) -> list[int]:
        """Ids of content as shown (``shown_text``); ``after_space``: a sentence that a
        space separated from the previous one, with that space merged into its first
        word where the tokenizer does so (``ChatFormat.encode_after_space``), so a
        message whose segments are all shown tokenizes as the whole message would."""
        shown = self.shown_text(text, role)
        return self.chat_format.encode_after_space(shown) if after_space else self.chat_format.encode(shown)

    def new_segment(
        self,
        message: MessageRecord,
        text: str,
        token_ids: list[int],
        kind: str,
        separator: str,
        forced_id: SegmentId | None = None,
    ) -> Segment:
        """A new segment of ``message`` (appended to it), with the next free id or
        ``forced_id``; ids only grow (but over the messages ``discard`` takes back). System segments are pinned."""
        identifier = forced_id or segment_id(self._next_index)
        index = int(identifier.split("_")[1])
        self._next_index = max(self._next_index, index + 1)
        segment = Segment(
            id=identifier,
            index=index,
            message_index=message.index,
            role=message.role,
            kind=kind,
            text=text,
            token_ids=token_ids,
            separator=separator,
            turn=message.turn,
            pinned=message.role == "system",
        )
        self._segments[identifier] = segment
        message.segment_ids.append(identifier)
        self.journal.segment(identifier)
        return segment

    def blocks_of(self, segment: SegmentId) -> list[int]:
        """Pool blocks of the held chain that hold ``segment``'s tokens in the last generation render."""
        if self._last_render is None or segment not in self._last_render.spans:
            return []
        size = self.engine.block_size
        return [
            self._held.chain[i] for i in self._last_render.segment_blocks(segment, size) if i < len(self._held.chain)
        ]

    def is_recently_removed(self, segment: Segment, turn: int) -> bool:
        """Removed within the last ``k`` rounds: its blocks are still held and it can come back."""
        return recently_removed(segment, turn, self.config.k)

    def restore(self, segment: Segment) -> None:
        """Show ``segment`` again (active, live), journalled for the next save."""
        self._live.restore(segment.message_index)  # a long-removed segment (pin) is live again
        segment.status = Status.ACTIVE
        segment.removed_round = None
        self.journal.segment(segment.id)

    def _record_user_decision(self, segment: Segment, label: Label, what: str) -> None:
        self.journal.segment(segment.id)
        self.journal.decisions([Decision(self.turn, segment.id, label, DecidedBy.RULES, what + BY_USER)])
        self.persist()

    def persist(self, turns: Sequence[TurnStats] = ()) -> None:
        """Write what changed since the last save (and the stats of ``turns``) to the store, if any."""
        if self.store is not None:
            record = self.record()
            changes = self.journal.pending(self.messages, self._segments)
            turns = [*self._unsaved_turns, *turns]
            self.store.save(record, changes, turns, expected_turn=self._stored_turn)
            self.journal.saved()
            self._saved, self._stored_turn, self._unsaved_turns = True, record.turn, []


TOOLS_PROMPT_SETTING = "tools_prompt"  # in a stored conversation's settings: the tools section it showed
# in a stored conversation's settings: the fields of its LifecycleConfig / GenerationSettings
# that no constructor argument sets, where they differ from the defaults
LIFECYCLE_SETTING, GENERATION_SETTING = "lifecycle_settings", "generation_settings"
_STORED_ONLY = frozenset({TOOLS_PROMPT_SETTING, LIFECYCLE_SETTING, GENERATION_SETTING})
_LIFECYCLE_ARGUMENTS = ("tagging", "budget", "k", "compression", "compress_min_tokens", "compact_ahead")
_LIFECYCLE_BEYOND = (
    "target_ratio",
    "low_water",
    "min_low_water",
    "room_turns",
    "min_reclaim_tokens",
    "protect_turns",
    "recent_share",
    "request_share",
)
_GENERATION_ARGUMENTS = (
    "max_new_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "stop",
    "repetition_penalty",
    "frequency_penalty",
    "presence_penalty",
    "no_repeat_ngram_size",
    "response_format",
)
_GENERATION_BEYOND = ("end_after", "block_tokens", "logit_bias", "cut_repeats", "forbid_tool_calls")


def check_budget_fits_engine(budget: int | None, engine: ServingEngine) -> None:
    """A budget over the positions the engine serves per request is refused at once: a
    prompt would outgrow the engine turns before the budget folded anything (a remote
    llama-server with 256 positions a slot failed at turn 4 of a replay at budget 512)."""
    positions = engine.max_positions
    if budget is None or not positions or budget <= positions:
        return
    raise ConfigError(
        "budget",
        f"{budget} tokens is over the {positions} positions the engine serves per request",
        hint="lower the budget; a llama-server gives each slot its --ctx-size divided by --parallel",
    )


def warn_reply_room(budget: int | None, engine: ServingEngine, reply_tokens: int) -> None:
    """A ``RuntimeWarning`` where a prompt at the budget leaves the engine's window no room
    for a reply of ``reply_tokens``: such replies are cut at the window (budget 1024 on a
    1024-token llama-server slot cut replies within a few tokens, finish_reason
    ``length``). Not an error: ``max_new_tokens`` is a cap, and one set to the window
    (replies as long as they may be) asks for no room, so it is not warned of."""
    positions = engine.max_positions
    if budget is None or not positions or budget + reply_tokens <= positions:
        return
    fits = positions - reply_tokens
    if fits < MIN_BUDGET_TOKENS:
        return
    warnings.warn(
        f"budget {budget} leaves the {positions} positions the engine serves per request no room for a reply of up "
        f"to {reply_tokens} tokens (max_new_tokens): a reply near the budget is cut at the window; a budget of "
        f"{fits} or less leaves it room (a llama-server gives each slot its --ctx-size divided by --parallel)",
        RuntimeWarning,
        stacklevel=3,  # the caller of Conversation(...)
    )


def _beyond_defaults(key: str, settings: Any, defaults: Any, names: Sequence[str]) -> dict[str, Any]:
    """``{key: {name: value}}`` for the ``names`` whose value differs from the default, or ``{}``."""
    changed = {name: getattr(settings, name) for name in names if getattr(settings, name) != getattr(defaults, name)}
    return {key: changed} if changed else {}


def _rebuild_settings(given: dict[str, Any], key: str, argument: str, kind: type, arguments: Sequence[str]) -> None:
    """Where ``given`` (a stored conversation's settings) holds ``key``, its fields and the
    plain arguments become one ``kind`` passed as ``argument`` (the constructor takes the
    one or the others); a ``config=`` / ``generation=`` given to ``load`` wins."""
    beyond = given.pop(key, None)
    if not beyond or argument in given:
        return
    plain = {name: given.pop(name) for name in arguments if name in given}
    if "stop" in plain:
        plain["stop"] = tuple(plain["stop"] or ())
    given[argument] = kind(**plain, **beyond)


def _open_store(store: Any) -> Store | None:
    if store is None:
        return None
    if isinstance(store, Store):
        return store
    if isinstance(store, str | Path):
        return Store(store)
    raise ClmError(f"store must be a path or a Store, got {type(store).__name__}")


def _check_not_beside(name: str, settings: object | None, arguments: Mapping[str, Any]) -> None:
    """``config=`` / ``generation=`` hold every setting of their kind: one of those settings
    also given as its own argument (not at its default) would be ignored, so it is refused."""
    if settings is None:
        return
    defaults = inspect.signature(Conversation.__init__).parameters
    given = [key for key, value in arguments.items() if value != defaults[key].default]
    if given:
        raise ConfigError(
            name,
            f"{', '.join(given)} given beside {name}=; set {'it' if len(given) == 1 else 'them'} "
            f"in the {type(settings).__name__} instead (it holds every setting of its kind)",
        )


def _checked_id(conversation_id: Any) -> str:
    """A caller's conversation id: a string with something besides whitespace (it names
    the conversation in a store, a report, a URL); None gives a fresh one."""
    if not isinstance(conversation_id, str) or not conversation_id.strip():
        raise ConfigError(
            "conversation_id", f"must be a non-blank string (or None for a fresh id), got {conversation_id!r}"
        )
    return conversation_id


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def _store_to_continue(path: Path) -> Store:
    """The store at ``path``, checked without writing a byte (a file that is not a store
    is refused as it is, a zero-byte one included); opened for writing only where the
    file and its directory are writable, so the turns after a load are saved. A store in
    a read-only directory (an archive, another user's) is read as it is, and a save
    there fails as a ``StoreError`` that leaves the reply standing."""
    checked = Store(path, read_only=True)
    if not (os.access(path, os.W_OK) and os.access(path.parent, os.W_OK)):
        return checked
    checked.close()
    return Store(path)


def _check_stored_ids(
    stored_model: str, segments: Sequence[Segment], engine: ServingEngine, where: Path, sample: int = 32
) -> None:
    """Refuse stored segments whose token ids the engine's tokenizer does not read back as
    their text (a conversation stored with another model). An engine of the model that
    stored them is trusted; another model name passes when its tokenizer decodes the first
    ``sample`` written segments (not replies: a generated reply's ids may end inside a
    character its text leaves out) to their texts (a tokenizer shared by two models). A
    token id outside the vocabulary is a damaged row, whatever the model."""
    if stored_model != engine.model_name:
        written = [s for s in segments if s.role != "assistant"]
        for segment in written[:sample]:
            if engine.tokenizer.decode(segment.token_ids) != segment.text:
                raise ConfigError(
                    "engine",
                    f"this conversation ({where}) was stored with model {stored_model!r}; its token ids do not "
                    f"read back as its text with the tokenizer of {engine.model_name!r}",
                    hint=f"load it with an engine of {stored_model!r}",
                )
    outside = next(
        (s for s in segments if any(t >= engine.vocab_size for t in [*s.token_ids, *(s.summary_ids or ())])), None
    )
    if outside is not None:
        raise StoreError(
            f"{where}: segment {outside.id} holds a token id outside the vocabulary "
            f"(size {engine.vocab_size}; damaged row)"
        )


class _HeldBlocks:
    """The pool blocks a conversation holds between turns (its last prompt + reply), apart
    from the conversation so that its finalizer can give them back without keeping it alive."""

    def __init__(self) -> None:
        self.chain: list[int] = []

    def give_back(self, pool: Any, reclaimer: Reclaimer) -> int:
        """Release the chain and the reclaimer's delayed holds; returns how many blocks."""
        released = len(self.chain) + reclaimer.held_blocks
        pool.release(list(reversed(self.chain)))
        self.chain = []
        reclaimer.close()
        return released


def _give_back_when_collected(pool: Any, held: _HeldBlocks, reclaimer: Reclaimer) -> None:
    """A conversation was collected without ``close()``: its blocks go back at the pool's
    next allocation (the collector may run this while this thread is inside the pool;
    ``BlockPool.call_soon``), or at once to a pool that defers nothing."""
    if hasattr(pool, "call_soon"):
        pool.call_soon(lambda: held.give_back(pool, reclaimer))
    else:
        held.give_back(pool, reclaimer)


class _ReleaseWhenIdle:
    """A conversation's pressure listener on its engine's pool (held weakly: the pool keeps
    no conversation alive): gives the chain back when no turn of it runs, in any thread.
    ``last_used`` orders the pool's listeners, least recently used first."""

    def __init__(self, conversation: Conversation) -> None:
        self._conversation = weakref.ref(conversation)
        self._pool = conversation.engine.pool

    @property
    def alive(self) -> bool:
        return self._conversation() is not None

    @property
    def last_used(self) -> float:
        conversation = self._conversation()
        return conversation._last_used if conversation is not None else 0.0

    def __call__(self, num_blocks: int) -> None:
        conversation = self._conversation()
        if conversation is None:  # collected: stop asking
            self._pool.remove_pressure_listener(self)
            return
        with conversation._turns_lock:  # no turn starts while its chain goes
            if not conversation._turns_running:
                conversation._release_cache_locked()
