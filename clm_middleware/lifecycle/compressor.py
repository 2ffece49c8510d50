"""Faithful compression of a segment: it may say less, never something else.

Two methods:
- ``extractive`` (the default for small models): keep every distinctive token
  (numbers, codes, names) verbatim, and of the other words those with the highest
  self-information (mean ``-log p`` of their tokens, from the model's own prefill,
  as in Selective-Context / LLMLingua) until ``1 / target_ratio`` of their tokens are
  kept; function and filler words ("the", "great", "please") only when nothing else
  would be. It can only delete, so it cannot invent a fact; and it never deletes a
  negation while keeping what it negates ("not available on Tuesday" never becomes
  "available Tuesday"; ``negation.py``).
- ``abstractive``: the summarizer model rewrites the text with the summarizer prompt.
  Accepted only if shorter, containing every distinctive token of the original, no
  distinctive token the original lacks, and a negation where the original has one;
  otherwise the extractive result is used.

A JSON array or object (a tool's records) is neither: it is written as its keys and
values without the syntax (``json_text.json_facts``), every fact kept with the name that
gives it its meaning; word deletion made it broken JSON.

Deleting methods keep a word where it was judged worth keeping, never at another place
the same word recurs, and never a word of a sentence or line said again right after
itself or said three times or more (``record_text``: a log saying one line a hundred
times became its rarest word a hundred times). A reply that calls a tool, and a
segment with a fenced code block, are never cut down (kept or dropped whole: code cut
to some of its words is other code).
A compression that does not come out shorter fails, and the caller keeps the original:
nothing is ever lost (the original always stays in the store).
"""

from __future__ import annotations

import contextlib
import math
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import regex
from tenacity import Retrying, retry_if_exception_type, stop_after_attempt

from clm_middleware.engine.observe import Observe
from clm_middleware.engine.protocol import ServingEngine
from clm_middleware.errors import ConfigError
from clm_middleware.lifecycle.distinctive import distinctive_spans, distinctive_tokens, folded_word, missing_from
from clm_middleware.lifecycle.framing import framing_words
from clm_middleware.lifecycle.json_text import json_facts, json_prefix
from clm_middleware.lifecycle.negation import has_negation, with_negations
from clm_middleware.lifecycle.record_text import leading_records, repeated_spans
from clm_middleware.lifecycle.segmenter import UNSPACED_SCRIPTS, has_code_block
from clm_middleware.lifecycle.segments import Segment, SegmentId
from clm_middleware.render import ChatFormat
from clm_middleware.render.tool_calls import OPEN as TOOL_CALL_OPEN

METHODS = ("auto", "extractive", "abstractive")
SMALL_MODEL_PARAMETERS = 1_000_000_000  # below this, "auto" compresses extractively
# a word this surprising where it was said (p < 1/3000) is kept by ``tighten`` as a fact
# the rules cannot see ("comedysportz", "rittenhouse"); ordinary words score 0-6 nats
RARE_WORD_NATS = 8.0
# a request in plain words tightens to this many of its words, the most surprising ones:
# what it asked about, in the few tokens a fact takes ("cheap", "north", "clarinet")
REQUEST_WORDS = 4
TIGHTENED = "distinctive"  # the method ``tighten`` records: applying it again changes nothing
TRIMMED = "trimmed"  # the method ``trim`` records: part of the facts kept, the rest let go
TRIM_SCORED_TOKENS = 4096  # ``trim`` scores words by the model up to this long a text; longer, in order
JSON_FACTS = "json"  # the method ``compress`` records for JSON: its keys and values without the syntax
SCORE_CACHE_SEGMENTS = 1024  # word scores kept per compressor (a segment's text never changes)
# a word: a run of non-space characters, but each character on its own in the scripts
# written without spaces between words (Chinese, Japanese), whose whole clause would
# else be one "word" that no compression can shorten (a Chinese chat was never condensed,
# only kept whole or dropped); kept characters that stood together are joined again
# without a space (``_joined``)
_WORD = regex.compile(rf"[{UNSPACED_SCRIPTS}]|[^\s{UNSPACED_SCRIPTS}]+")
# English function words: high surprisal after a typo or an odd turn of phrase, but
# they carry no fact, so the extractive compression takes them last
_FUNCTION_WORDS_TEXT = """a about above after again all also am an and any are as at be been before being below
    between both but by can could did do does doing down during each else few for from
    further had has have having he her here hers him his how i i'd i'll i'm i've if in into
    is it it's its just let me might more most must my no nor not now of off on once only or
    other our ours out over own please same shall she should so some such than that that's
    the their theirs them then there these they this those through to too under until up
    very was we were what when where which while who whom why will with would yes you your
    yours okay ok oh well actually really thanks thank sure great maybe also need want like
    get got find looking look tell know think sounds sound perfect good nice fine cool
    alright right awesome wonderful excellent works work let's you've you're you'll that'll
    there's it'll we'll we're they're don't can't won't didn't isn't what's anything
    something everything nothing done moment yeah yep yup hmm"""
_FUNCTION_WORDS = frozenset(_FUNCTION_WORDS_TEXT.split())
# function words that bound a fact ("after 19:30", "under 100 euros", "from X to Y"): a cut
# that keeps the fact without them says something else, so ``trim`` ranks them with the
# content words, not with the fillers it lets go first
_CONSTRAINT_TEXT = """after before until since between under over above below more most less least fewer than
    only without except each every per within from to no not nor never"""
_CONSTRAINT_WORDS = frozenset(_CONSTRAINT_TEXT.split())


def content_words(text: str) -> set[str]:
    """The words of ``text`` beyond function and filler words, bare and case-folded."""
    words = (folded_word(w).casefold() for w in _WORD.findall(text) if any(c.isalnum() for c in w))
    return {w for w in words if w and w not in _FUNCTION_WORDS}


def has_content_words(text: str) -> bool:
    """Whether ``text`` says anything beyond function and filler words ("perfect, that works")."""
    return bool(content_words(text))


_FACT_WORD = regex.compile(r"[\p{L}\p{N}][\p{L}\p{N}:.,'@/-]*[\p{L}\p{N}]|[\p{L}\p{N}]")


@dataclass(frozen=True, slots=True)
class CompressionResult:
    ok: bool
    method: str  # extractive | abstractive | none
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    original_tokens: int = 0
    error: str | None = None
    missing: tuple[str, ...] = ()  # distinctive tokens an abstractive summary lost
    invented: tuple[str, ...] = ()  # distinctive tokens it made up
    rejected: str | None = None  # why an abstractive summary was not used

    @property
    def saved_tokens(self) -> int:
        return self.original_tokens - len(self.token_ids) if self.ok else 0


@dataclass(frozen=True, slots=True)
class CompressionCheck:
    missing: tuple[str, ...]
    invented: tuple[str, ...]
    lost_negation: bool = False  # the original negates something and the summary nothing

    @property
    def faithful(self) -> bool:
        return not self.missing and not self.invented and not self.lost_negation


def check_faithful(original: str, summary: str) -> CompressionCheck:
    """Every distinctive token of ``original`` is in ``summary``, ``summary`` adds none,
    and it keeps a negation if ``original`` has one.

    Missing is judged per token (a multi-word name must appear whole); invented per
    word inside the summary's distinctive tokens, so rewording around a fact is fine
    but a number, code or name the original never said is not. A summary with no
    negator at all of a text that has one may say the opposite ("not available on
    Tuesday" → "available Tuesday"), so it is refused too.
    """
    required = distinctive_tokens(original)
    original_folded = original.casefold()
    invented = {
        word
        for start, end in distinctive_spans(summary)
        for word in _FACT_WORD.findall(summary[start:end].casefold())
        if word not in original_folded
    }
    lost_negation = has_negation(original) and not has_negation(summary)
    return CompressionCheck(tuple(sorted(missing_from(required, summary))), tuple(sorted(invented)), lost_negation)


def is_function_word(word: str) -> bool:
    return folded_word(word) in _FUNCTION_WORDS


def _joined(words: Sequence[regex.Match[str]], indices: Iterable[int]) -> str:
    """The words at ``indices`` (ascending) of one text, a space between two, but for two
    that stood together there (characters of a Chinese word): they stay together."""
    parts: list[str] = []
    previous: int | None = None
    for index in indices:
        if parts and not (previous == index - 1 and words[previous].end() == words[index].start()):
            parts.append(" ")
        parts.append(words[index].group())
        previous = index
    return "".join(parts)


def _aligned(visible: list[str], original: list[regex.Match[str]]) -> list[int | None]:
    """For each word of ``visible`` (a text made by deleting words of ``original``), the
    index of the original word it is, in order; None for one that is not (an abstractive
    summary's own wording)."""
    indices: list[int | None] = []
    start = 0
    for word in visible:
        found = next((i for i in range(start, len(original)) if original[i].group() == word), None)
        indices.append(found)
        if found is not None:
            start = found + 1
    return indices


def _kept_words(text: str, words: list[regex.Match[str]]) -> set[int]:
    """Indices of the words that overlap a distinctive span of ``text`` (judged in context)."""
    spans = distinctive_spans(text)
    return {i for i, w in enumerate(words) if any(start < w.end() and w.start() < end for start, end in spans)}


def _in_repeats(text: str, words: list[regex.Match[str]]) -> set[int]:
    """Indices of the words inside a record of ``text`` that repeats an earlier one word
    for word right after it or as a frame (``record_text.repeated_spans``): a deletion
    leaves them all out, facts included (the first saying keeps them)."""
    spans, inside, at = repeated_spans(text), set(), 0
    for index, word in enumerate(words):  # both in order: one sweep
        while at < len(spans) and spans[at][1] < word.end():
            at += 1
        if at < len(spans) and spans[at][0] <= word.start():
            inside.add(index)
    return inside


def word_means(
    words: list[regex.Match[str]], offsets: list[tuple[int, int]], values: list[float | None]
) -> list[float]:
    """Mean of ``values`` over the tokens that overlap each word (0 where none is known).

    Words and token offsets both run left to right, so one sweep pairs them: linear in
    words + tokens (a long paste once took minutes here, pairing every word with every
    token). A token that spans several words counts for each of them."""
    means, first = [], 0
    tokens = list(zip(offsets, values, strict=False))
    for word in words:
        while first < len(tokens) and tokens[first][0][1] <= word.start():
            first += 1
        total, count, index = 0.0, 0, first
        while index < len(tokens) and tokens[index][0][0] < word.end():
            (_, end), value = tokens[index]
            if end > word.start() and value is not None:
                total, count = total + value, count + 1
            index += 1
        means.append(total / count if count else 0.0)
    return means


REPEAT_WINDOW = 12  # words: a content word said again this close is what the sentence is about
REPEAT_MAX_TIMES = 3  # said more often in one text it is its frame ("bin A10 holds item X370, bin B11 ...")


def _with_repeats(words: list[regex.Match[str]], scores: list[float]) -> list[float]:
    """``scores`` with a content word that the speaker says again within ``REPEAT_WINDOW``
    words (two or three times in the text) scored as a rare one (``RARE_WORD_NATS``) where
    it was said before: "allergic to peanuts, so nothing with peanuts at all" is about
    peanuts, however predictable the word is after "allergic to" (and it is less so each
    time it comes back). A word said more often is the text's frame, not its point."""
    bares = [folded_word(word.group()) for word in words]
    times = Counter(bares)
    last_seen: dict[str, int] = {}
    scored = list(scores)
    for index, bare in enumerate(bares):
        if bare in _FUNCTION_WORDS or not any(c.isalpha() for c in bare) or times[bare] > REPEAT_MAX_TIMES:
            continue
        before = last_seen.get(bare)
        if before is not None and index - before <= REPEAT_WINDOW:
            scored[before] = max(scored[before], RARE_WORD_NATS)
        last_seen[bare] = index
    return scored


def _recorded(surprisal: list[float | None] | None, segment: Segment) -> list[float | None] | None:
    """``surprisal`` if it is a value per token of ``segment``."""
    return surprisal if surprisal is not None and len(surprisal) == len(segment.token_ids) else None


def _kept_whole(text: str) -> str | None:
    """Why ``text`` is never cut down (None: it may be). A tool call cut down to some of
    its words is broken JSON that may name the wrong tool (``{"name": "Dr. Okafor",``);
    code cut down to some of its words is other code (``sort | uniq -c | sort -rn | head
    -5`` → ``sort -5``), with its lines and indentation run together. Either stays whole
    or leaves whole."""
    if TOOL_CALL_OPEN in text:
        return "a tool call is kept or dropped whole"
    if has_code_block(text):
        return "a code block is kept or dropped whole"
    return None


def _whole_only(tokens: int, reason: str) -> CompressionResult:
    return CompressionResult(False, "none", original_tokens=tokens, error=reason)


class Compressor:
    def __init__(
        self,
        engine: ServingEngine,
        chat_format: ChatFormat,
        *,
        method: str = "auto",
        target_ratio: float = 4.0,
        summarizer: ServingEngine | None = None,
        summarizer_prompt: str,
        retries: int = 2,
        shown: Callable[[str], str] | None = None,
    ) -> None:
        """``shown`` maps a text to the text the model is shown of it (the conversation's
        look-alike neutralising, ``protocol.neutralise``); it must keep the length, so
        offsets into one are offsets into the other. Summary ids are ids of ``shown(summary)``."""
        if method not in METHODS:
            raise ConfigError("compression", f"unknown method {method!r}; use one of {METHODS}")
        if target_ratio <= 1:
            raise ConfigError("target_ratio", f"must be > 1, got {target_ratio}")
        self.engine, self.format = engine, chat_format
        self._shown = shown or (lambda text: text)
        self.summarizer = summarizer or engine
        self.summarizer_format = chat_format if summarizer is None else ChatFormat.from_tokenizer(summarizer.tokenizer)
        self.prompt = summarizer_prompt
        self.target_ratio = target_ratio
        self.retries = max(1, retries)
        self._score_cache: OrderedDict[tuple[str, str], list[float]] = OrderedDict()
        # token self-information of segments scored together (score_in_order), by segment
        # and text (an id a discarded message had may come back with another text)
        self._scored_together: OrderedDict[tuple[SegmentId, str], list[float | None]] = OrderedDict()
        if method == "auto":
            small = self.summarizer.num_parameters < SMALL_MODEL_PARAMETERS
            method = "extractive" if small else "abstractive"
        self.method = method

    def tighten(self, segment: Segment) -> CompressionResult:
        """The words of the segment's visible text that hold its facts, in order.

        The strongest faithful compression: it keeps every number, code and name, and
        every content word the model found rare where it was said (self-information ≥
        ``RARE_WORD_NATS``: a name in lowercase, an odd value, that no rule sees), and
        nothing else (the distinctive tokens alone when the words cannot be scored).
        A request in plain words (no distinctive token) keeps its ``REQUEST_WORDS``
        content words of the highest self-information ("search park north instead" →
        "park north"), and fails when they cannot be scored. Fails when the result is
        not shorter.
        """
        current = len(segment.visible_ids)
        if (whole := _kept_whole(segment.text)) is not None:
            return _whole_only(current, whole)
        # judged on the original text: in a condensed text, sentence breaks are artifacts
        # that would make a name look like a sentence's first word
        original_words = list(_WORD.finditer(segment.text))
        facts = _kept_words(segment.text, original_words)
        plain = not facts  # a request in plain words: no number, code or name
        try:
            scores = self._word_scores(segment.text, original_words, segment)
        except Exception:  # no scores (the engine failed): the distinctive tokens alone
            if plain:
                return CompressionResult(False, "none", original_tokens=current, error="no distinctive token")
            scores = [0.0] * len(original_words)
        shown_words = list(_WORD.finditer(segment.visible_text))
        visible = [word.group() for word in shown_words]
        aligned = _aligned(visible, original_words)
        shown = {folded_word(word) for word in visible}
        content = [
            (score, index)
            for index, (word, score) in enumerate(zip(original_words, scores, strict=True))
            if (bare := folded_word(word.group())) in shown
            and bare not in _FUNCTION_WORDS
            and any(c.isalnum() for c in bare)
        ]
        kept = facts | {i for score, i in content if score >= RARE_WORD_NATS}
        if plain:  # its most informative words: what it asked about, as the model read it
            kept |= {i for _, i in sorted(content, key=lambda pair: -pair[0])[:REQUEST_WORDS]}
        kept -= _in_repeats(segment.text, original_words)
        required = {folded_word(original_words[i].group()) for i in kept}
        # a word is kept where it was judged, not wherever it recurs ("77121-B never
        # arrived" must not borrow the "arrived" of another order); a word no original
        # word matches (an abstractive summary's) is kept by what it is
        chosen = {
            position
            for position, (word, index) in enumerate(zip(visible, aligned, strict=True))
            if (index in kept if index is not None else folded_word(word) in required)
        }
        kept_at = sorted(with_negations(visible, chosen, is_function_word))
        tightened = _joined(shown_words, kept_at)
        ids = self._encode(tightened)
        if not kept_at or len(ids) >= current:
            return CompressionResult(False, "none", original_tokens=current, error="not shorter than the original")
        return CompressionResult(True, TIGHTENED, tightened, ids, current)

    def trim(self, segment: Segment, max_tokens: int, *, framed: bool = False) -> CompressionResult:
        """At most about ``max_tokens`` of the segment's visible words, in order: with
        ``framed`` (a new message cut to fit), the words that frame it first (its opening
        instruction, its closing question: ``framing.py``); its distinctive tokens, then
        the words the model found most surprising where they
        were said, function words last; a JSON array or object, its leading items whole
        (``json_text``); a tool's result in plain text, its leading whole lines or
        sentences (``record_text``), unless not even the first fits. Unlike ``tighten``
        it lets facts go: the budget's answer to a long segment (a pasted log, an email,
        a tool's records) when dropping it whole would free far more than needed. It says
        less, never something else. Fails when nothing fits or the result is not shorter."""
        current = len(segment.visible_ids)
        if (whole := _kept_whole(segment.text)) is not None:
            return _whole_only(current, whole)
        # JSON (a tool's records) keeps its leading items whole, and parses
        as_json = json_prefix(segment.text, lambda text: len(self._encode(text)) <= max_tokens)
        if as_json is not None and len(ids := self._encode(as_json)) < current:
            return CompressionResult(True, TRIMMED, as_json, ids, current)
        # a tool's result in plain text keeps its leading whole records (lines, sentences)
        if (
            segment.role == "tool"
            and (records := leading_records(segment.text, lambda text: len(self._encode(text)) <= max_tokens))
            and len(ids := self._encode(records)) < current
        ):
            return CompressionResult(True, TRIMMED, records, ids, current)
        original_words = list(_WORD.finditer(segment.text))
        scores = [0.0] * len(original_words)  # no scores: the words in order
        if len(segment.token_ids) <= TRIM_SCORED_TOKENS:  # longer, a forward over it would cost minutes
            with contextlib.suppress(Exception):  # the engine failed: unscored
                scores = self._word_scores(segment.text, original_words, segment)
        facts = {folded_word(original_words[i].group()) for i in _kept_words(segment.text, original_words)}
        surprise: dict[str, float] = {}
        for word, score in zip(original_words, scores, strict=True):
            bare = folded_word(word.group())
            surprise[bare] = max(surprise.get(bare, score), score)
        shown = list(_WORD.finditer(segment.visible_text))
        visible = [word.group() for word in shown]
        framing = framing_words(segment.visible_text, shown) if framed else set()
        repeats = _in_repeats(segment.visible_text, shown) - framing
        bares = [folded_word(word) for word in visible]
        counts = [max(1, len(self.format.encode(" " + word))) for word in visible]
        filler = [bare in _FUNCTION_WORDS and bare.casefold() not in _CONSTRAINT_WORDS for bare in bares]
        order = sorted(
            range(len(visible)),
            key=lambda i: (i not in framing, bares[i] not in facts, filler[i], -surprise.get(bares[i], 0.0), i),
        )
        keep: set[int] = set()
        used = 0
        for index in order:
            if index not in repeats and used + counts[index] <= max_tokens:
                keep.add(index)
                used += counts[index]
        keep = with_negations(visible, keep, is_function_word)  # a few tokens over, never the opposite
        trimmed = _joined(shown, sorted(keep))
        ids = self._encode(trimmed)
        if not keep or len(ids) >= current:
            return CompressionResult(False, "none", original_tokens=current, error="nothing fits, or not shorter")
        return CompressionResult(True, TRIMMED, trimmed, ids, current)

    def score_in_order(self, segments: Sequence[Segment]) -> None:
        """Score the tokens of ``segments`` that have no record of the model's own prefill
        in one forward, each after those before it (a new message's pieces, in order), for
        the compressions that follow: one call where scoring each alone would cost a
        forward per segment (a long paste condensed to fit is hundreds of segments). A
        failed call leaves them to be scored one by one."""
        todo = [
            s for s in segments if _recorded(s.surprisal, s) is None and (s.id, s.text) not in self._scored_together
        ]
        if len(todo) < 2:
            return
        ids = [token for segment in todo for token in segment.token_ids]
        try:
            generation = self.engine.generate(
                ids, max_new_tokens=0, use_pool=False, observe=Observe(logprobs=True)
            ).result()
        except Exception:  # an optimisation only: each compression scores its own segment instead
            return
        values = [None if lp is None else -lp for lp in generation.prompt_logprobs or []]
        if len(values) != len(ids):
            return
        offset = 0
        for segment in todo:
            self._scored_together[segment.id, segment.text] = values[offset : offset + len(segment.token_ids)]
            offset += len(segment.token_ids)
        while len(self._scored_together) > SCORE_CACHE_SEGMENTS:
            self._scored_together.popitem(last=False)

    def compress(self, segment: Segment) -> CompressionResult:
        original_tokens = len(segment.token_ids)
        if (whole := _kept_whole(segment.text)) is not None:
            return _whole_only(original_tokens, whole)
        # JSON (a tool's records): every key and value, without the syntax; cut word by
        # word it was broken JSON ({"name": {"first_name": "Mia", "Li"}) in the digest
        if (facts := json_facts(segment.text)) is not None:
            ids = self._encode(facts)
            if len(ids) < original_tokens and check_faithful(segment.text, facts).faithful:
                return CompressionResult(True, JSON_FACTS, facts, ids, original_tokens)
        rejected = None
        if self.method == "abstractive":
            try:
                summary = self._abstractive(segment.text)
            except Exception as error:  # after retries: record it and fall back
                rejected = f"summarizer failed: {error}"
            else:
                verdict = self._accept(segment.text, summary, original_tokens)
                if isinstance(verdict, CompressionResult):
                    return verdict
                rejected = verdict
        try:
            text = self._extractive(segment)
        except Exception as error:
            return CompressionResult(
                False,
                "none",
                original_tokens=original_tokens,
                error=f"extractive failed: {error}",
                rejected=rejected,
            )
        ids = self._encode(text)
        if not text.strip() or len(ids) >= original_tokens:
            return CompressionResult(
                False,
                "none",
                original_tokens=original_tokens,
                error="not shorter than the original",
                rejected=rejected,
            )
        return CompressionResult(True, "extractive", text, ids, original_tokens, rejected=rejected)

    # -------------------------------------------------------------- internal

    def _accept(self, original: str, summary: str, original_tokens: int) -> CompressionResult | str:
        summary = summary.strip()
        if not summary:
            return "empty summary"
        ids = self._encode(summary)
        if len(ids) >= original_tokens:
            return "summary not shorter"
        check = check_faithful(original, summary)
        if not check.faithful:
            lost = ", lost its negation" if check.lost_negation else ""
            return f"unfaithful summary (missing {list(check.missing)}, invented {list(check.invented)}{lost})"
        return CompressionResult(True, "abstractive", summary, ids, original_tokens)

    def _abstractive(self, text: str) -> str:
        chat = self.summarizer_format
        prompt = chat.render([("user", chat.encode(self.prompt.replace("{text}", text)))])
        budget = max(16, len(chat.encode(text)) // 2)
        for attempt in Retrying(
            stop=stop_after_attempt(self.retries),
            retry=retry_if_exception_type(Exception),
            reraise=True,
        ):
            with attempt:
                generation = self.summarizer.generate(prompt, max_new_tokens=budget).result()
                return generation.text
        raise RuntimeError("unreachable")  # pragma: no cover - Retrying reraises

    def _extractive(self, segment: Segment) -> str:
        text = segment.text
        words = list(_WORD.finditer(text))
        if not words:
            return text
        scores = self._word_scores(text, words, segment)
        repeats = _in_repeats(text, words)
        keep = _kept_words(text, words) - repeats
        token_counts = [max(1, len(self.format.encode(" " + w.group()))) for w in words]
        # the ratio applies to what is not kept verbatim: a name or a date does not use
        # up the room of the words that say what it is about
        said = [c for i, c in enumerate(token_counts) if i not in keep and i not in repeats]  # once, repeats aside
        target = math.ceil(sum(said) / self.target_ratio)
        function = [folded_word(w.group()) in _FUNCTION_WORDS for w in words]
        kept = 0
        # content words, highest self-information first; a function word only for a
        # text that has nothing else to keep
        for index in sorted(range(len(words)), key=lambda i: (function[i], -scores[i], i)):
            if kept >= target or (function[index] and keep):
                break
            if index not in keep and index not in repeats:
                keep.add(index)
                kept += token_counts[index]
        keep = with_negations([w.group() for w in words], keep, is_function_word)
        return _joined(words, sorted(keep))

    def _word_scores(self, text: str, words: list[regex.Match[str]], segment: Segment) -> list[float]:
        """Mean self-information of each word's tokens (cached per segment and text)."""
        key = (segment.id, text)
        cached = self._score_cache.get(key)
        if cached is None:
            cached = self._score_cache[key] = self._compute_word_scores(text, words, segment)
            if len(self._score_cache) > SCORE_CACHE_SEGMENTS:
                self._score_cache.popitem(last=False)
        return cached

    def _compute_word_scores(self, text: str, words: list[regex.Match[str]], segment: Segment) -> list[float]:
        ids, surprisal, lead = self._token_surprisal(text, segment)
        offsets = self._offsets(lead + self._shown(text), ids)
        if offsets is not None and lead:  # offsets into the text, not into its leading space
            offsets = [(max(0, start - len(lead)), max(0, end - len(lead))) for start, end in offsets]
        if offsets is None:  # cannot align: every token scores every word alike
            known = [v for v in surprisal if v is not None]
            return [sum(known) / len(known) if known else 0.0] * len(words)
        return _with_repeats(words, word_means(words, offsets, surprisal))

    def _encode(self, text: str) -> list[int]:
        return self.format.encode(self._shown(text))

    def _token_surprisal(self, text: str, segment: Segment) -> tuple[list[int], list[float | None], str]:
        """The ids of ``text`` as shown, their self-information, and the leading space the
        segment's ids carry ("" or " ", see ``ChatFormat.encode_after_space``)."""
        shown = self._shown(text)
        together = self._scored_together.get((segment.id, segment.text))
        recorded = _recorded(segment.surprisal, segment) or _recorded(together, segment)
        if recorded is not None:
            for lead in ("", " "):
                if self.format.encode(lead + shown) == segment.token_ids:
                    return list(segment.token_ids), list(recorded), lead
        # No usable record of the model's own prefill (e.g. a generated reply that
        # re-tokenizes differently) nor of scoring with its neighbours: score the text on
        # its own, with no context.
        ids = self.format.encode(shown)
        generation = self.engine.generate(
            ids, max_new_tokens=0, use_pool=False, observe=Observe(logprobs=True)
        ).result()
        return ids, [None if lp is None else -lp for lp in generation.prompt_logprobs or []], ""

    def _offsets(self, text: str, ids: list[int]) -> list[tuple[int, int]] | None:
        encoded: Any = self.format.content_tokenizer(
            text, add_special_tokens=False, split_special_tokens=True, return_offsets_mapping=True
        )
        if list(encoded["input_ids"]) == ids:
            return [tuple(pair) for pair in encoded["offset_mapping"]]
        return None
