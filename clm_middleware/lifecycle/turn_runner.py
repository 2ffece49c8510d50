"""One turn of a managed conversation, step by step (``Conversation`` holds the state).

Steps, in order: restore what the new turn refers to; compaction (if due); render;
generate (streaming the visible answer); keep the reply's ids; record what the prefill
observed; label the window; release what waited K rounds; persist. See
``conversation.py`` for the invariants a turn keeps.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Generator
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from clm_middleware.engine import CallStats, Engine, Generation, penalty_processors
from clm_middleware.engine.penalties import LogitBias, check_logit_bias
from clm_middleware.errors import ConfigError, ContextBudgetError, ContextWindowError, TurnCancelled
from clm_middleware.lifecycle.calibration import record_runtime_failure
from clm_middleware.lifecycle.checkpoint import TurnCheckpoint
from clm_middleware.lifecycle.compaction import CompactionResult, calls_a_tool
from clm_middleware.lifecycle.config import GenerationSettings
from clm_middleware.lifecycle.distinctive import distinctive_tokens, missing_from, unstated
from clm_middleware.lifecycle.observation import record_observation
from clm_middleware.lifecycle.protocol import CLOSE_TAG, block_may_follow, could_open_block
from clm_middleware.lifecycle.renderer import RenderedContext, digest_lines
from clm_middleware.lifecycle.reply import IncrementalText, cut_at_stop
from clm_middleware.lifecycle.reply_filter import ReplyFilter, cuts_a_repeat, model_answer, visible_answer
from clm_middleware.lifecycle.reply_quality import first_repeated_sentence, reply_flags, shows_machinery
from clm_middleware.lifecycle.segmenter import is_ack
from clm_middleware.lifecycle.segments import (
    LOOP_KIND,
    DecidedBy,
    Decision,
    Label,
    MessageRecord,
    Segment,
    Status,
)
from clm_middleware.lifecycle.turn import Reply, TurnStats, decision_counts
from clm_middleware.render.tool_calls import OPEN as TOOL_CALL_OPEN
from clm_middleware.structured.array_watch import ArrayWatch
from clm_middleware.structured.format import digits_loop_in_string, inside_string, number_loops, phrase_loop_in_string
from clm_middleware.structured.server_side import ServerFormat

if TYPE_CHECKING:
    from clm_middleware.conversation import Conversation
    from clm_middleware.structured.call_ban import CallOpeningBan
    from clm_middleware.structured.constraint import GrammarConstraint
    from clm_middleware.structured.grammar import GrammarCompiler


@dataclass(frozen=True, slots=True)
class WorkAhead:
    """The call ``compact_ahead`` ran after a reply: its stats, the context it computed
    (before the next message's opening) and whether a compaction ran first."""

    stats: CallStats
    context_tokens: int
    compacted: bool


def _flag_once(stats: TurnStats, flag: str) -> None:
    """Raise ``flag`` on the turn: a flag says what happened, not how often."""
    if flag not in stats.reply_flags:
        stats.reply_flags.append(flag)


class TurnRunner:
    """Runs turns for one conversation; holds no state of its own."""

    def __init__(self, conversation: Conversation) -> None:
        self.conversation = conversation

    def turn_steps(
        self,
        forced: str | None,
        prefix: str,
        settings: GenerationSettings,
        cancelled: Callable[[], bool] | None = None,
    ) -> Generator[str, None, None]:
        c = self.conversation
        started = time.perf_counter()
        if not c.messages:
            raise ConfigError("messages", "there is nothing to answer yet; add a user message first")
        structured = settings.response_format is not None and forced is None
        if structured:
            # the grammar ends the reply with its document; a stop string, text a JSON string
            # may hold, ends nothing (stop=["Paris"] had cut '{"city": "', parsed as city="")
            settings = replace(settings, stop=())
        # a schema the grammar rejects, or a reply_prefix it cannot continue, fails before the turn starts;
        # a remote engine samples on its server, so its own grammar enforces the format there
        local = c.engine.sees_logits
        constraint = self._constraint(settings, c.chat_format.encode(prefix)) if structured and local else None
        server_format = self._server_format(settings, prefix) if structured and not local else None
        c.turn += 1
        turn = c.turn
        c.refresh_live()
        checkpoint = TurnCheckpoint.take(self._changeable_segments(), c.fold)
        last_render = c.last_render  # the held chain's, which an undone turn keeps
        stats = TurnStats(turn=turn)
        decisions: list[Decision] = []
        generation: Generation | None = None
        try:
            tick = time.perf_counter()
            decisions += self._restore_referenced(turn, stats)
            stats.phases["restore_s"] = time.perf_counter() - tick
            tick = time.perf_counter()
            try:
                compaction = c.compactor.run(c.live_messages(), c.segment_map(), turn, c.fold, history=c.messages)
            except ContextBudgetError as error:
                raise c.budget_refusal(error) from error
            c.fold = compaction.fold
            self._after_compaction(compaction, turn, stats, decisions)
            # protocol left or tools changed: the start of a prompt this conversation ran moved
            # (before its first turn there is none: tools bound at the start change nothing)
            if c.take_format_change() and c.turn_log and not stats.compaction:
                stats.compaction = "format"
            stats.phases["compaction_s"] = time.perf_counter() - tick - stats.phases["compression_s"]
            reply_id = c.next_segment_id()
            stats.protocol_context = c.protocol_context
            rendered = c.render_prompt(reply_id)
            prefix_ids = c.chat_format.encode(prefix) if forced is None else []
            grammar = constraint if constraint is not None else server_format
            generation = self._generate(rendered, prefix_ids, forced, settings, grammar)
            generation.cancelled = cancelled
            escaped_at = 0  # structured: where the text stood when a loop in a string was last closed
            arrays = ArrayWatch()  # structured: arrays whose items repeat
            machinery = shows_machinery(c.protocol_context, (s.visible_text for s in c.live_segments() if s.visible))
            given = len(prefix) if forced is None else 0
            reply_filter = ReplyFilter(
                stops=settings.stop,
                cut_repeats=settings.cut_repeats,
                verbatim=structured,
                machinery=machinery,
                given=given,
            )
            detok = IncrementalText(c.engine.tokenizer, skip_ids=c.engine.default_stop_ids)
            answer_cap = settings.max_new_tokens
            # the engine call starts at the first token asked for: what came before it
            # (restoring, compacting, rendering) is part of the time to the first token
            stats.ttft_s = time.perf_counter() - started
            for token in generation:
                if cancelled is not None and cancelled():
                    raise TurnCancelled(f"turn {turn} was cancelled by its caller")
                detok.push(token)
                if forced is None:
                    delta = reply_filter.delta(prefix + detok.text)
                    if delta:
                        yield delta
                    if constraint is not None:
                        written = prefix + detok.text
                        if settings.cut_repeats and self._loops_in_a_string(written, escaped_at, settings, given):
                            constraint.close_string()  # the document cannot be cut: end the string instead
                            escaped_at = len(written)
                            _flag_once(stats, "string_loop_closed")
                        elif settings.cut_repeats and number_loops(written):
                            constraint.close_number()  # a digit loop: the number ends here
                            _flag_once(stats, "number_loop_closed")
                        elif settings.cut_repeats and (closer := arrays.closing(written)) is not None:
                            constraint.close_array(closer)  # the same item again and again: the array ends
                            _flag_once(stats, "array_loop_closed")
                    elif reply_filter.repeated:
                        generation.close()
                        generation.finish_reason = "repetition"
                        break
                    # the block allowance is for a block the protocol asks for: an answer
                    # that has not opened one ends at max_new_tokens like any other
                    extra = len(generation.token_ids) - answer_cap
                    if extra >= 0 and not (c.protocol_context and block_may_follow(detok.text, extra)):
                        generation.close()
                        generation.finish_reason = "stop" if generation.stopped() else "length"
                        break
            raw_output = prefix + detok.text if forced is None else forced
            answer_text, answer_ids = self._answer(forced, raw_output, generation, settings, machinery, given)
            if forced is None:
                tail = reply_filter.finish(answer_text)
                if tail:
                    yield tail
                earlier = [s.visible_text for s in c.live_segments() if s.role == "assistant" and s.visible]
                notes = digest_lines(c.live_messages(), c.segment_map(), c.fold)
                stats.reply_flags = [
                    *reply_flags(
                        model_answer(raw_output, settings.stop, given),
                        answer_text,
                        earlier,
                        machinery=machinery,
                        notes=notes,
                    ),
                    *stats.reply_flags,  # string_loop_closed, raised while generating
                ]
                if generation.finish_reason == "repetition" or (
                    settings.cut_repeats
                    and settings.response_format is None
                    and cuts_a_repeat(raw_output, stops=settings.stop, machinery=machinery, given=given)
                ):
                    stats.reply_flags.append("repetition_cut")
                    if generation.finish_reason == "length":  # the reply ends before the cap:
                        generation.finish_reason = "repetition"  # a client told "length" asks for more
            else:
                stats.reply_nll = generation.forced_nll
                yield answer_text  # a caller that stops reading here undoes the turn too
        except BaseException:
            c.turn -= 1
            if generation is not None:  # failed or cancelled (a closed stream): its blocks go back
                generation.abandon()
                c.engine.pool.release(list(reversed(generation.block_ids)))
                generation.block_ids = []
            # what restoring and compacting changed goes back: the older turns read as before
            c.fold = checkpoint.fold
            c.restore_render(last_render)
            for segment in checkpoint.restore(c.segment_map()):
                c.journal.segment(segment)
            raise
        self._hand_over_chain(generation)
        asks_block = c.protocol_context and c.tagger.asks_for_block(turn) and not structured
        model_written = raw_output  # only what the model generated may be parsed as its block
        if forced is not None and asks_block:
            model_written = self._probe_block(rendered.token_ids + answer_ids, stats)
            raw_output = answer_text + "\n" + model_written
        # the answer that closes a tool exchange stays, though it repeats an earlier one:
        # an agent's context of calls and results alone taught the model that a result is
        # followed by the same call again (a helper's agent loop at budget 512: it repeated
        # the Oslo call; the bare model, shown one dropped answer, answered)
        answers_result = bool(c.messages) and c.messages[-1].role == "tool"
        reply_message = MessageRecord(len(c.messages), "assistant", answer_text, turn, raw_output=raw_output)
        c.messages.append(reply_message)
        c.journal.message(reply_message)
        kind = "ack" if is_ack(answer_text) else "reply"
        # a document that was asked for stays in the context, however repetitive its values,
        # and so does a tool call: the result that follows answers it (an agent polling a
        # tool asks the same thing again; dropped, the result had followed no call)
        calls = c.tools_prompt is not None and TOOL_CALL_OPEN in answer_text
        if (
            not structured
            and not calls
            and (
                "repetition_loop" in stats.reply_flags
                or (
                    {"repeats_earlier_reply", "reads_back_notes"} & set(stats.reply_flags)
                    and not self._adds_facts(answer_text)
                    and not answers_result
                )
            )
        ):
            kind = LOOP_KIND
        reply_segment = c.new_segment(reply_message, answer_text, answer_ids, kind, "", forced_id=reply_id)
        if kind == LOOP_KIND:
            decisions.append(self._drop_loop(reply_segment, turn))
            stats.dropped_tokens += len(reply_segment.token_ids)  # it leaves the context as it arrives
        tick = time.perf_counter()
        record_observation(rendered, generation, c.live_segments(), reply_segment, len(prefix_ids))
        # the engine's own observation work (all-position logits, log-softmax, attention probe) counts too
        stats.phases["observation_s"] = time.perf_counter() - tick + generation.stats.observe_s
        decisions += self._tag(turn, rendered, answer_ids, model_written if asks_block else None, generation, stats)
        c.reclaimer.release_due(turn)
        warm = self._work_ahead(turn, stats, decisions)
        stats.prefix_tokens = len(prefix_ids)
        stats.dropped_tokens += c.forgotten_tokens  # what the user forgot before this turn left with it
        c.forgotten_tokens = 0
        self._finish_stats(stats, rendered, generation, decisions, started, warm)
        c.last_reply = Reply(answer_text, turn, reply_segment.id, decisions, stats, generation.finish_reason)
        c.journal.decisions(decisions)
        c.persist([stats])

    def _generate(
        self,
        rendered: RenderedContext,
        prefix_ids: list[int],
        forced: str | None,
        settings: GenerationSettings,
        grammar: GrammarConstraint | ServerFormat | None = None,
    ) -> Generation:
        c = self.conversation
        prompt = rendered.token_ids + prefix_ids
        structured = grammar is not None
        asks_block = c.protocol_context and c.tagger.asks_for_block(c.turn) and not structured
        forced_ids = c.encode_content(forced, "assistant") if forced else None
        processors = penalty_processors(settings, c.engine.generation_defaults)
        bias = settings.logit_bias
        check_logit_bias(bias, c.engine.vocab_size)
        ban = self._call_ban() if settings.forbid_tool_calls and not structured and forced is None else None
        if ban is not None and c.engine.sees_logits:
            processors = (*processors, ban)  # last: a banned token stays banned
        elif ban is not None:  # the server samples: a static ban, for the whole reply
            bias = tuple((dict(bias) | dict(ban.everywhere)).items())
        if bias:
            processors = (LogitBias(bias), *processors)
        if forced is not None:
            max_new, stops = 1, ()
        elif structured:
            # the grammar ends the reply with its document: no block follows, and the
            # close tag may be text inside a JSON string, so it stops nothing; the
            # constraint runs first so that the penalties only reorder allowed tokens
            max_new, stops = settings.max_new_tokens, settings.stop
            processors = (grammar, *processors)
        else:
            max_new = settings.max_new_tokens + (settings.block_tokens if asks_block else 0)
            # end_after texts stop the engine but are no stop strings to cut: the reply keeps them
            stops = settings.stop + settings.end_after + ((CLOSE_TAG,) if c.protocol_context else ())
        budget_room = c.engine.max_positions - len(prompt) if c.engine.max_positions else max_new
        if budget_room < 1 and forced is None:
            raise ContextWindowError(
                f"the prompt ({len(prompt)} tokens) fills the model's {c.engine.max_positions} positions: "
                "no room is left for a reply",
                hint=(
                    "set a context budget (budget=...) so that older turns are folded, or shorten the messages"
                    if c.config.budget is None
                    else "lower the budget so that a reply has room, or shorten the messages"
                ),
            )
        # near the window the reply is cut at its last position (finish_reason "length"), as llama.cpp does
        return c.engine.generate(
            prompt,
            max_new_tokens=max(1, min(max_new, budget_room)),
            temperature=settings.temperature,
            top_p=settings.top_p,
            top_k=settings.top_k,
            min_p=settings.min_p,
            seed=settings.seed,
            stop=stops or None,
            hold_blocks=True,
            use_pool=c.use_pool,
            observe=c.tagger.observe(self._unscored_positions(rendered), attention=c.config.budget is not None),
            cache_salt=c.cache_salt,
            logits_processors=processors,
            forced_token_ids=forced_ids,
        )

    def _constraint(self, settings: GenerationSettings, prefix_ids: list[int]) -> GrammarConstraint:
        assert settings.response_format is not None
        return self._grammars().constraint(settings.response_format, prefix_ids)

    @staticmethod
    def _server_format(settings: GenerationSettings, prefix: str) -> ServerFormat:
        """The format a remote engine's server enforces. Its grammar starts at the first
        token the server writes, so a reply prefix (a document's opening given by the
        caller) cannot be continued under it."""
        assert settings.response_format is not None
        if prefix:
            raise ConfigError(
                "reply_prefix",
                "a reply prefix with a response_format needs the local engine: the server's grammar "
                "starts at the first token it writes, after the prefix",
                hint="leave out the prefix (the server's grammar opens the document), or use the local engine",
            )
        return ServerFormat(settings.response_format)

    @staticmethod
    def _loops_in_a_string(written: str, since: int, settings: GenerationSettings, given: int) -> bool:
        """A sentence repeats since the last close, and the document is inside a string
        value: a loop the grammar allows forever (``The cat was a cat, and the cat was
        a cat, ...``) and only the model could end; or a run of digits there repeats
        itself (``"user_id": "1234567890123456789012..."``), or a phrase with no sentence
        mark (``"The movie The movie The movie``)."""
        if digits_loop_in_string(written) or phrase_loop_in_string(written):
            return True
        return first_repeated_sentence(
            cut_at_stop(written, settings.stop, given)[since:]
        ) is not None and inside_string(written)

    def _call_ban(self) -> CallOpeningBan:
        from clm_middleware.structured.call_ban import call_ban_for  # xgrammar loads on first use

        return call_ban_for(self.conversation.engine)

    def _grammars(self) -> GrammarCompiler:
        from clm_middleware.structured.grammar import compiler_for  # xgrammar loads on first use

        return compiler_for(self.conversation.engine)

    def _unscored_positions(self, rendered: RenderedContext) -> frozenset[int]:
        """Word-initial prompt positions of segments with no self-information yet (a
        generated reply has it from decoding; a forced reply or a message gets it from
        this prefill). See ``ChatFormat.word_initial``."""
        c = self.conversation
        positions: set[int] = set()
        for identifier, (start, _) in rendered.spans.items():
            segment = c.segment(identifier)
            if segment.surprisal is None and segment.status is Status.ACTIVE:
                flags = c.chat_format.word_initial(segment.token_ids)
                positions.update(start + i for i, initial in enumerate(flags) if initial)
        return frozenset(positions)

    def _answer(
        self,
        forced: str | None,
        raw: str,
        generation: Generation,
        settings: GenerationSettings,
        machinery: bool,
        given: int = 0,
    ) -> tuple[str, list[int]]:
        """The visible answer and the token ids the context keeps for it: the answer's text
        tokenized as the chat template tokenizes a message (prefix included), which is
        what the bare model sees of it next turn, and what a client that re-sends the
        history has. The generated ids are mostly those; where the model spelled a word
        another way (" past" + "a" for " pasta"), the next turn recomputes from there
        instead of showing the model a prompt the bare template never makes.
        ``machinery``: markers and blocks are cut (``reply_quality.shows_machinery``)."""
        c = self.conversation
        if forced is not None:
            return forced, list(generation.token_ids) if forced else []
        verbatim = settings.response_format is not None
        answer = visible_answer(
            raw,
            stops=settings.stop,
            cut_repeats=settings.cut_repeats,
            verbatim=verbatim,
            machinery=machinery,
            given=given,
        )
        return answer, c.encode_content(answer, "assistant")

    def _probe_block(self, prefix: list[int], stats: TurnStats) -> str:
        """After a forced reply, let the model continue and see whether it writes a block.

        The probe stops at the first token that cannot begin an opening tag, so a
        model that does not follow the protocol costs about one decoded token.
        """
        c = self.conversation
        tick = time.perf_counter()
        probe = c.engine.generate(
            prefix,
            max_new_tokens=c.generation.block_tokens,
            stop=[CLOSE_TAG],
            cache_salt=c.cache_salt,
        )
        detok = IncrementalText(c.engine.tokenizer, skip_ids=c.engine.default_stop_ids)
        for token in probe:
            detok.push(token)
            if not could_open_block(detok.text):
                probe.close()
                break
        stats.extra_calls += 1
        stats.phases["tagging_s"] += time.perf_counter() - tick
        return detok.text

    def _tag(
        self,
        turn: int,
        rendered: RenderedContext,
        answer_ids: list[int],
        model_output: str | None,
        generation: Generation,
        stats: TurnStats,
    ) -> list[Decision]:
        c = self.conversation
        tick = time.perf_counter()
        live = c.live_segments()
        candidates = c.tagger.candidates(live, turn)
        valid = {s.id for s in live if s.visible or c.is_recently_removed(s, turn)}
        outcome = c.tagger.label(
            turn=turn,
            candidates=candidates,
            valid_ids=valid,
            model_output=model_output,
            prefix_ids=rendered.token_ids + answer_ids if c.config.tagging.mode == "constrained" else None,
            signals_ready=generation.attention is not None or generation.prompt_logprobs is not None,
            cache_salt=c.cache_salt,
        )
        if c.config.tagging.mode == "constrained" and candidates:
            stats.extra_calls += 1
        stats.tagging_mode, stats.parse_ok = outcome.mode, outcome.parse_ok
        applied = []
        for decision in outcome.decisions:
            segment = c.segment(decision.segment_id)
            if segment.pinned:
                continue
            if not segment.visible:
                if decision.label is Label.KEEP and decision.decided_by is DecidedBy.MODEL:
                    c.restore(segment)  # the model relabelled a removed segment keep
                else:
                    continue
            segment.label, segment.decided_by = decision.label, decision.decided_by
            c.journal.segment(segment.id)
            applied.append(decision)
        self._maybe_leave_protocol(stats)
        elapsed = time.perf_counter() - tick
        stats.phases["parsing_s" if outcome.mode == "free" else "tagging_s"] += elapsed
        return applied

    def _adds_facts(self, text: str) -> bool:
        """Whether ``text`` states a distinctive token (a code, a number, a name) that no
        visible segment states yet: a templated reply with a new booking reference is not
        a repeat to drop."""
        facts = distinctive_tokens(text)
        visible = " ".join(s.visible_text for s in self.conversation.live_segments() if s.visible)
        return bool(facts and unstated(facts, visible))

    def _drop_loop(self, segment: Segment, turn: int) -> Decision:
        """A generated reply that is a repetition loop, or mostly repeats an earlier reply
        still in the context with no fact of its own, leaves the context at once: it adds
        nothing the context does not hold, it is the context's last segment (so the next prompt still reuses
        everything before it), and a model that sees its own loop repeats it. Its blocks
        stay in the conversation's chain until the next turn hands the chain over."""
        segment.label, segment.decided_by = Label.DROP, DecidedBy.RULES
        segment.status, segment.removed_round = Status.DROPPED, turn
        self.conversation.journal.segment(segment.id)
        return Decision(turn, segment.id, Label.DROP, DecidedBy.RULES, "repetition loop")

    def _maybe_leave_protocol(self, stats: TurnStats) -> None:
        """``auto``: a model that failed every probe is not asked again; the context drops
        the protocol prompt and markers (one re-prefill, then a smaller context for good)."""
        c = self.conversation
        if c.protocol_context and c.tagger.model_failed_protocol:
            record_runtime_failure(c.engine, c.protocol_text)
            c.protocol_context = False
            c.rebuild_renderer()

    # ------------------------------------------------------------- helpers

    def _changeable_segments(self) -> list[Segment]:
        """The segments a turn's steps before its reply may change: the live ones (restores,
        pending labels, compaction's passes) and, under a budget, those of every message
        after the fold (the folding pass walks them, live or not)."""
        c = self.conversation
        segments = {s.id: s for s in c.live_segments()}
        if c.config.budget is not None:
            map_ = c.segment_map()
            segments.update((s, map_[s]) for m in c.messages[c.fold :] for s in m.segment_ids)
        return list(segments.values())

    def _after_compaction(
        self, compaction: CompactionResult, turn: int, stats: TurnStats, decisions: list[Decision]
    ) -> None:
        """Record ``compaction`` in the turn's stats, added to what an earlier compaction
        of the same turn recorded (one at its start, one ahead after its reply)."""
        c = self.conversation
        stats.compaction = "+".join(reason for reason in (stats.compaction, compaction.reason) if reason)
        stats.dropped_tokens += compaction.dropped_tokens
        stats.compressed_tokens += compaction.compressed_tokens
        stats.phases["compression_s"] += compaction.compression_s
        for segment in compaction.removed:
            c.reclaimer.hold(segment.id, c.blocks_of(segment.id), turn)
            segment.removed_round = turn
            c.journal.segment(segment.id)
        for segment, outcome in compaction.compressions:
            stats.summaries.append(
                {
                    "segment_id": segment.id,
                    "ok": outcome.ok,
                    "method": outcome.method,
                    "original_tokens": outcome.original_tokens,
                    "summary_tokens": len(outcome.token_ids),
                    "error": outcome.error,
                    "rejected": outcome.rejected,
                    "summary": outcome.text,
                }
            )
            c.journal.segment(segment.id)
        decisions += compaction.decisions

    def _restore_referenced(self, turn: int, stats: TurnStats) -> list[Decision]:
        """Segments the new messages clearly refer to come back (the reference test:
        they share a distinctive token) if removed within the last K rounds and, under a
        budget, if the prompt still fits with them; a pending drop or compression of them
        is cancelled."""
        c = self.conversation
        new_text = " ".join(m.content for m in c.live_messages() if m.turn == turn and m.role in ("user", "tool"))
        wanted = distinctive_tokens(new_text)
        if not wanted:
            return []
        decisions = []
        budget = c.config.budget
        for segment in c.live_segments():
            if segment.pinned or segment.role == "system" or segment.kind == LOOP_KIND or calls_a_tool(segment):
                continue  # a tool call is machinery: it leaves the digest once folded, and stays out
            removed = segment.status is Status.DROPPED and c.is_recently_removed(segment, turn)
            if not (removed or segment.pending):
                continue
            shared = wanted - missing_from(wanted, segment.text)
            if not shared:
                continue
            if removed:
                removed_round = segment.removed_round
                c.restore(segment)
                if budget is not None and c.prompt_length(c.fold) > budget:
                    # a restore that does not fit would only make the compaction that
                    # follows drop something else (or it again): a second compaction
                    # in a row for pressure of our own making
                    segment.status, segment.removed_round = Status.DROPPED, removed_round
                    continue
                stats.restored.append(segment.id)
            segment.label, segment.decided_by = Label.KEEP, DecidedBy.RULES
            c.journal.segment(segment.id)
            decisions.append(
                Decision(
                    turn,
                    segment.id,
                    Label.KEEP,
                    DecidedBy.RULES,
                    f"referenced again: {sorted(shared)[:3]}",
                )
            )
        return decisions

    def _work_ahead(self, turn: int, stats: TurnStats, decisions: list[Decision]) -> WorkAhead | None:
        """With ``compact_ahead``, after the reply, compute now what the next turn would
        wait for: under a budget, when the next turn's messages (as many tokens as the
        most said in one of the last few turns) would take the prompt over it, compact
        and compute the compacted context into the pool; in any case the opening of the
        next message (the template's user header, and the end of the reply before it),
        so the next turn prefills only what its messages say. The computing call's stats,
        or None if none ran (or it failed: the next turn computes it instead)."""
        c = self.conversation
        if not c.config.compact_ahead or not c.use_pool or not isinstance(c.engine, Engine):
            return None
        compacted = False
        if c.config.budget is not None:
            tick = time.perf_counter()
            headroom = c.compactor.next_messages_tokens(c.messages, c.segment_map(), turn)
            compaction = c.compactor.run(
                c.live_messages(), c.segment_map(), turn, c.fold, history=c.messages, headroom=max(1, headroom)
            )
            if compaction.ran:
                compacted = True
                c.fold = compaction.fold
                self._after_compaction(compaction, turn, stats, decisions)
                stats.phases["compaction_s"] += time.perf_counter() - tick - compaction.compression_s
        context = c.render_prompt(None, for_generation=False).token_ids
        # a user message is what usually comes next; a tool message shares all but its role name
        opening = c.renderer.format.header_ids("user")
        try:
            warm = c.engine.generate(
                context + opening, max_new_tokens=0, hold_blocks=True, use_pool=True, cache_salt=c.cache_salt
            ).result()
        except Exception:  # the pool is full, the engine failed: the next turn computes it instead
            return None
        self._hand_over_chain(warm)
        return WorkAhead(warm.stats, len(context), compacted)

    def _hand_over_chain(self, generation: Generation) -> None:
        """Hold the new prompt + reply chain, then let the previous one go (tail first)."""
        c = self.conversation
        previous = c.swap_chain(generation.block_ids)
        c.engine.pool.release(list(reversed(previous)))

    def _finish_stats(
        self,
        stats: TurnStats,
        rendered: RenderedContext,
        generation: Generation,
        decisions: list[Decision],
        started: float,
        warm: WorkAhead | None = None,
    ) -> None:
        """``warm``: the work done ahead (``ahead_tokens``); after a compaction ahead the
        context is the compacted one."""
        c = self.conversation
        call = generation.stats
        stats.prompt_tokens, stats.context_tokens = call.prompt_tokens, call.prompt_tokens
        stats.digest_tokens = rendered.digest_tokens
        stats.cached_tokens, stats.prefill_tokens = call.cached_tokens, call.prefill_tokens
        if warm is not None:
            # a compacted context counts whole (the next turn reads it back); otherwise
            # only what was computed ahead, the next message's opening
            stats.ahead_tokens = warm.stats.prompt_tokens if warm.compacted else warm.stats.prefill_tokens
            stats.ahead_prefill_tokens = warm.stats.prefill_tokens
            if warm.compacted:
                stats.context_tokens = warm.context_tokens
        stats.approximate_tokens = call.approximate_tokens
        stats.forced_tokens = call.forced_tokens
        stats.generated_tokens, stats.bookkeeping_s, stats.arena_s = (
            call.generated_tokens,
            call.bookkeeping_s,
            call.arena_s,
        )
        stats.ttft_s += call.ttft_s
        stats.decode_s = call.decode_s
        stats.decisions = decision_counts(decisions)
        stats.lifecycle_s = sum(stats.phases.values())
        stats.pool_blocks_in_use = c.engine.pool.stats().blocks_in_use
        stats.conversation_blocks = c.chain_blocks
        stats.reclaimer_blocks = c.reclaimer.held_blocks
        stats.turn_s = time.perf_counter() - started
        c.log_turn(stats)
