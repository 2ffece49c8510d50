"""Local scorers behind a remote engine: what the server does not return, computed here.

A serving engine returns the tokens it generates; it does not say how surprising each
prompt token was (self-information), where the newest tokens' attention went, or how
likely a given continuation is. A ``RemoteEngine`` asks a small local model instead
(LLMLingua's and Selective Context's approach: a small model scores the text). Two
kinds, one interface (``observe`` / ``score`` / ``choose``, ``model_name``):

- ``SameTokenizerScorer``: a local engine with the served model's own tokenizer (the
  served model itself on CPU, or a smaller one of its family). Positions are the
  engine's positions: the figures are exactly that model's.
- ``AlignedScorer``: a small local model with a tokenizer of its own (the default
  SmolLM2-135M in front of a large model of another family). The engine's token ids
  are decoded to text, the scorer scores that text in its own tokens, and each engine
  token gets what the scorer tokens covering its characters carry, shared out by
  character overlap::

      engine tokens   |  The|  qu|ick|  fox|
      scorer tokens   |  The|  quick |  fox|
      surprisal       |  1.0|   6.0  |  2.0|   →  engine: 1.0, 2.0, 4.0, 2.0

  Sums are conserved (the prompt's total self-information, a reply's total log p and
  the attention mass are the scorer's); per-token figures are the scorer's, spread
  over the engine's tokens. ``choose`` (constrained labels over token ids of the
  engine's vocabulary) has no meaning across vocabularies and is refused.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

from clm_middleware.engine.observe import Observe
from clm_middleware.errors import ConfigError
from clm_middleware.remote.server_info import TOKENIZER_PROBE

Span = tuple[int, int]  # [start, end) in characters of the decoded text
_DECODE_WINDOW = 8  # tokens of left context when a token's characters are read by difference


@dataclass(slots=True)
class PromptScores:
    """What a scorer read from one prompt: per engine position, ``None`` where not scored."""

    prompt_logprobs: list[float | None] | None = None
    attention: torch.Tensor | None = None  # mass per prompt position (the engine's)
    token_logprobs: list[float] | None = None  # of the forced reply's tokens, one per token


def same_tokenizer(a: Any, b: Any) -> bool:
    """Whether two tokenizers give the same ids for the probe text and the same vocabulary size."""
    probe_a = list(a.encode(TOKENIZER_PROBE, add_special_tokens=False))
    return probe_a == list(b.encode(TOKENIZER_PROBE, add_special_tokens=False)) and len(a) == len(b)


def make_scorer(engine_tokenizer: Any, scorer_engine: Any) -> SameTokenizerScorer | AlignedScorer:
    """The exact scorer when ``scorer_engine`` shares the served model's tokenizer, else the aligned one."""
    if same_tokenizer(engine_tokenizer, scorer_engine.tokenizer):
        return SameTokenizerScorer(scorer_engine)
    return AlignedScorer(scorer_engine, engine_tokenizer)


class SameTokenizerScorer:
    """A local engine that tokenizes as the server does: positions map one to one."""

    aligned = False

    def __init__(self, engine: Any) -> None:
        self.engine = engine

    @property
    def model_name(self) -> str:
        return str(self.engine.model_name)

    def observe(self, prompt: Sequence[int], observe: Observe, forced: Sequence[int] | None) -> PromptScores:
        forced = list(forced or ())
        scored = self.engine.generate(
            list(prompt), max_new_tokens=0, observe=observe, forced_token_ids=forced or None
        ).result()
        return PromptScores(scored.prompt_logprobs, scored.attention, list(scored.token_logprobs) if forced else None)

    def score(
        self, prefix_ids: Sequence[int], continuations: Sequence[Sequence[int]], *, cache_salt: str | None = None
    ) -> list[float]:
        return list(self.engine.score(prefix_ids, continuations, cache_salt=cache_salt))

    def choose(self, *args: Any, **kwargs: Any) -> list[tuple[int, list[float]]]:
        return list(self.engine.choose(*args, **kwargs))


class AlignedScorer:
    """A local model with its own tokenizer, its figures moved onto the engine's tokens by characters."""

    aligned = True

    def __init__(self, engine: Any, engine_tokenizer: Any) -> None:
        if not getattr(engine.tokenizer, "is_fast", False):
            raise ConfigError(
                "scorer", "a scorer with a tokenizer of its own needs a fast tokenizer (character offsets)"
            )
        self.engine = engine
        self.engine_tokenizer = engine_tokenizer

    @property
    def model_name(self) -> str:
        return str(self.engine.model_name)

    def observe(self, prompt: Sequence[int], observe: Observe, forced: Sequence[int] | None) -> PromptScores:
        """The scorer's reading of ``prompt`` (and of a forced reply after it), on the engine's positions."""
        forced = list(forced or ())
        text, spans = char_spans(self.engine_tokenizer, [*prompt, *forced])
        prompt_spans, forced_spans = spans[: len(prompt)], spans[len(prompt) :]
        boundary = prompt_spans[-1][1] if prompt_spans else 0
        ids, offsets = self._encode(text)
        cut = bisect.bisect_left([start for start, _ in offsets], boundary) if forced else len(ids)
        if cut == 0:  # the prompt decodes to nothing the scorer can read
            return PromptScores()
        own_prompt, own_forced = ids[:cut], ids[cut:]
        wanted = None
        if observe.logprob_positions is not None:
            positions = sorted(p for p in observe.logprob_positions if 0 <= p < len(prompt_spans))
            chars = [prompt_spans[p] for p in positions if prompt_spans[p][1] > prompt_spans[p][0]]
            starts = [start for start, _ in chars]
            wanted = frozenset(j for j, span in enumerate(offsets[:cut]) if _overlaps_any(span, chars, starts))
        window = 0
        if observe.attention_window:
            start = prompt_spans[max(0, len(prompt) - observe.attention_window)][0]
            window = max(1, cut - bisect.bisect_right([end for _, end in offsets[:cut]], start))
        own = replace(
            observe,
            logprobs=observe.logprobs or bool(forced),
            logprob_positions=wanted,
            attention_window=window,
        )
        scored = self.engine.generate(
            own_prompt, max_new_tokens=0, observe=own, forced_token_ids=own_forced or None
        ).result()
        result = PromptScores()
        if observe.logprobs and scored.prompt_logprobs is not None:
            positions = range(len(prompt)) if observe.logprob_positions is None else observe.logprob_positions
            values = spread(scored.prompt_logprobs, offsets[:cut], prompt_spans)
            result.prompt_logprobs = [None] * len(prompt)
            for p in positions:
                if 0 < p < len(prompt):
                    result.prompt_logprobs[p] = values[p]
        if observe.attention_window and scored.attention is not None:
            mass = spread([float(v) for v in scored.attention], offsets[:cut], prompt_spans)
            result.attention = torch.tensor([v or 0.0 for v in mass], dtype=torch.float32)
        if forced:
            own_values: list[float | None] = list(scored.token_logprobs)
            if len(own_values) == len(own_forced):
                result.token_logprobs = [v or 0.0 for v in spread(own_values, offsets[cut:], forced_spans)]
        return result

    def score(
        self, prefix_ids: Sequence[int], continuations: Sequence[Sequence[int]], *, cache_salt: str | None = None
    ) -> list[float]:
        """The scorer's log p of each continuation's text after the prefix's text (its own
        tokens' sum: the same text's probability, in another tokenization)."""
        totals = []
        for continuation in continuations:
            text, spans = char_spans(self.engine_tokenizer, [*prefix_ids, *continuation])
            boundary = spans[len(prefix_ids) - 1][1] if prefix_ids else 0
            ids, offsets = self._encode(text)
            cut = bisect.bisect_left([start for start, _ in offsets], boundary)
            if cut == 0 or cut == len(ids):
                totals.append(0.0)
                continue
            [total] = self.engine.score(ids[:cut], [ids[cut:]], cache_salt=cache_salt)
            totals.append(float(total))
        return totals

    def choose(self, *args: Any, **kwargs: Any) -> list[tuple[int, list[float]]]:
        raise ConfigError(
            "scorer",
            "constrained labels choose among the served model's token ids; a scorer with another tokenizer "
            "cannot score them",
            hint="use --tagging signals or rules behind this engine, or a scorer with the served model's tokenizer",
        )

    def _encode(self, text: str) -> tuple[list[int], list[Span]]:
        encoded = self.engine.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        return list(encoded["input_ids"]), tile(encoded["offset_mapping"])


def char_spans(tokenizer: Any, ids: Sequence[int]) -> tuple[str, list[Span]]:
    """``ids`` decoded (special tokens as text), and each token's characters in it.

    Where re-encoding the text gives back ``ids`` (the usual case), the tokenizer's own
    offsets are used; otherwise a token's characters are what it adds to the text
    decoded with a few tokens of left context (word-initial spaces, bytes of one
    character split over tokens), so the spans still tile the text in order."""
    ids = [int(t) for t in ids]
    text = tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
    if getattr(tokenizer, "is_fast", False):
        encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        if list(encoded["input_ids"]) == ids:
            return text, tile(encoded["offset_mapping"])
    spans, position = [], 0
    for index in range(len(ids)):
        low = max(0, index - _DECODE_WINDOW)
        before = tokenizer.decode(ids[low:index], skip_special_tokens=False, clean_up_tokenization_spaces=False)
        after = tokenizer.decode(ids[low : index + 1], skip_special_tokens=False, clean_up_tokenization_spaces=False)
        end = min(len(text), position + max(0, len(after) - len(before)))
        spans.append((position, end))
        position = end
    return text, spans


def tile(offsets: Sequence[Sequence[int]]) -> list[Span]:
    """Offsets made to tile the text in order: a tokenizer gives every byte of one
    character split over several tokens that character's offsets; here the first token
    keeps it and the others are empty, so no character is counted twice."""
    spans, end = [], 0
    for a, b in offsets:
        start = max(int(a), end)
        end = max(int(b), start)
        spans.append((start, end))
    return spans


def spread(values: Sequence[float | None], sources: Sequence[Span], targets: Sequence[Span]) -> list[float | None]:
    """Each target span's share of ``values`` (one per source span): a source's value is
    split over the targets its characters overlap, in proportion to the overlap. A target
    that overlaps no scored source gets ``None``. Both span lists are in text order."""
    out: list[float | None] = [None] * len(targets)
    first = 0
    for value, source in zip(values, sources, strict=False):
        if value is None or source[1] <= source[0]:
            continue
        width = source[1] - source[0]
        while first < len(targets) and targets[first][1] <= source[0]:
            first += 1
        index = first
        while index < len(targets) and targets[index][0] < source[1]:
            shared = _overlap(source, targets[index])
            if shared:
                out[index] = (out[index] or 0.0) + value * shared / width
            index += 1
    return out


def _overlaps_any(span: Span, spans: Sequence[Span], starts: Sequence[int]) -> bool:
    """Whether ``span`` shares a character with any of ``spans`` (non-empty, in text order,
    not overlapping, so their ends grow with their starts: the last one starting before
    ``span`` ends reaches furthest); ``starts`` are their starts."""
    last = bisect.bisect_left(starts, span[1]) - 1
    return last >= 0 and _overlap(span, spans[last]) > 0


def _overlap(a: Span, b: Span) -> int:
    return max(0, min(a[1], b[1]) - max(a[0], b[0]))
