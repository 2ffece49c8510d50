"""Who labels the segments each turn, and how.

Modes:
- ``free``: the model writes a ``[LIFECYCLE]`` block after its answer; it is parsed.
- ``constrained``: the block's text is supplied, the model picks keep / compress / drop
  per segment from its logits (``Engine.choose``); always parseable.
- ``signals``: labels from self-information and attention (``signals.py``).
- ``rules``: the fallback rules (``rules.py``).
- ``auto`` (default): ``free`` while the model's recent parse rate is ≥ ``auto_parse_rate``
  over the last ``auto_history`` tries, otherwise ``signals``, with rules as the last
  fallback. Following the protocol is a property of the model: before its first turn
  an ``auto`` conversation asks the calibration (``calibration.py``, measured once per
  model and prompt); a model that fails it never sees the protocol prompt or a marker
  (``assume_protocol_failed``). A model that passes is watched: when it keeps failing,
  auto asks for the block only every ``auto_probe_every`` turns, and once it failed
  ``auto_history`` probes in a row the conversation leaves the protocol, and later
  ``auto`` conversations on the same engine start without it.

Which segments are labelled each turn (bounded cost): the non-pinned, visible or
pending segments added in the last ``label_window_turns`` turns, newest first, at
most ``max_labels_per_turn``. Older segments keep their last label; budget pressure
still orders them by eviction value. In ``free`` mode the model may also label any
visible id or a recently removed one (which restores it).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from clm_middleware.engine.observe import Observe
from clm_middleware.engine.protocol import ServingEngine
from clm_middleware.errors import ConfigError
from clm_middleware.lifecycle.modes import TAGGING_MODES
from clm_middleware.lifecycle.protocol import OPEN_TAG, parse_block
from clm_middleware.lifecycle.rules import RuleConfig, rule_label
from clm_middleware.lifecycle.segments import DecidedBy, Decision, Label, Segment, SegmentId
from clm_middleware.lifecycle.signals import SignalThresholds, signal_label
from clm_middleware.render import ChatFormat

PROTOCOL_MODES = frozenset({"auto", "free", "constrained"})
LABEL_CHOICES = (Label.KEEP, Label.COMPRESS, Label.DROP)


@dataclass(frozen=True, slots=True)
class TaggingConfig:
    mode: str = "auto"
    label_window_turns: int = 3
    max_labels_per_turn: int = 24
    auto_parse_rate: float = 0.9
    auto_history: int = 5
    auto_probe_every: int = 8
    attention_window: int = 32
    rules: RuleConfig = field(default_factory=RuleConfig)
    signals: SignalThresholds = field(default_factory=SignalThresholds)

    def __post_init__(self) -> None:
        if self.mode not in TAGGING_MODES:
            raise ConfigError("tagging", f"unknown mode {self.mode!r}; use one of {', '.join(TAGGING_MODES)}")
        if not 0 < self.auto_parse_rate <= 1:
            raise ConfigError("auto_parse_rate", f"must be in (0, 1], got {self.auto_parse_rate}")
        for name in (
            "label_window_turns",
            "max_labels_per_turn",
            "auto_history",
            "auto_probe_every",
        ):
            if getattr(self, name) < 1:
                raise ConfigError(name, f"must be ≥ 1, got {getattr(self, name)}")

    @property
    def uses_protocol(self) -> bool:
        return self.mode in PROTOCOL_MODES


@dataclass(slots=True)
class TaggingOutcome:
    mode: str  # which source decided this turn: free | constrained | signals | rules
    decisions: list[Decision]
    parse_ok: bool | None = None  # free-form block parsed (None when none was asked for)
    seconds: float = 0.0


class Tagger:
    def __init__(self, config: TaggingConfig, engine: ServingEngine, chat_format: ChatFormat) -> None:
        self.config = config
        self.engine = engine
        self.format = chat_format
        self.parse_history: deque[bool] = deque(maxlen=config.auto_history)
        self._choices: tuple[list[int], list[int], list[list[int]]] | None = None

    # ------------------------------------------------------------ per turn

    def observe(self, positions: frozenset[int], *, attention: bool = True) -> Observe:
        """What the turn's generation should record: self-information at ``positions``
        (the tokens of what the model was told, not yet scored; its own replies get
        theirs from decoding), and, for signals, the newest turn's attention: the queries
        of the last ``attention_window`` prompt tokens, which the engine computes even
        where the pool holds them, so the window never depends on what is cached.
        ``attention=False`` (no budget: labels from signals never apply) skips that
        recompute, which would buy nothing: the turn prefills only its new tokens."""
        signals = self.config.mode in ("signals", "auto") and attention
        window = self.config.attention_window if signals else 0
        return Observe(logprobs=True, logprob_positions=positions, attention_window=window)

    def asks_for_block(self, turn: int) -> bool:
        """Whether this turn leaves room for, and parses, a free-form block."""
        if self.config.mode == "free":
            return True
        if self.config.mode != "auto":
            return False
        history = self.parse_history
        if len(history) < history.maxlen or self.parse_rate >= self.config.auto_parse_rate:
            return True
        return turn % self.config.auto_probe_every == 0

    @property
    def model_failed_protocol(self) -> bool:
        """``auto`` only: the last ``auto_history`` probes all failed (here, or in an
        earlier conversation on this engine)."""
        history = self.parse_history
        return self.config.mode == "auto" and len(history) == history.maxlen and not any(history)

    def assume_protocol_failed(self) -> None:
        """Start from a history of failed probes: the model is known not to follow the protocol."""
        self.parse_history.extend([False] * self.config.auto_history)

    @property
    def parse_rate(self) -> float:
        return sum(self.parse_history) / len(self.parse_history) if self.parse_history else 0.0

    def candidates(self, segments: Sequence[Segment], turn: int) -> list[Segment]:
        window = [s for s in segments if not s.pinned and s.visible and turn - s.turn < self.config.label_window_turns]
        window.sort(key=lambda s: s.index, reverse=True)
        return sorted(window[: self.config.max_labels_per_turn], key=lambda s: s.index)

    def label(
        self,
        *,
        turn: int,
        candidates: list[Segment],
        valid_ids: set[SegmentId],
        model_output: str | None,
        prefix_ids: list[int] | None,
        signals_ready: bool,
        cache_salt: str | None = None,
    ) -> TaggingOutcome:
        """Decide labels for ``candidates``; ``model_output`` is the raw reply when a block was asked for."""
        started = time.perf_counter()
        mode = self.config.mode
        outcome: TaggingOutcome | None = None
        parse_ok: bool | None = None
        if mode in ("free", "auto") and model_output is not None:
            parsed = parse_block(model_output, valid_ids)
            parse_ok = parsed.ok
            self.parse_history.append(parsed.ok)
            trusted = mode == "free" or self.parse_rate >= self.config.auto_parse_rate
            if parsed.ok and trusted:
                decisions = [
                    Decision(
                        turn,
                        s.id,
                        parsed.labels.get(s.id, Label.KEEP),
                        DecidedBy.MODEL,
                        "block" if s.id in parsed.labels else "left out: keep",
                    )
                    for s in candidates
                ]
                extra = [
                    Decision(turn, sid, label, DecidedBy.MODEL, "block")
                    for sid, label in parsed.labels.items()
                    if sid not in {s.id for s in candidates}
                ]
                outcome = TaggingOutcome("free", decisions + extra, parse_ok)
        elif mode == "constrained" and prefix_ids is not None and candidates:
            outcome = self._constrained(turn, candidates, prefix_ids, cache_salt)
        if outcome is None and mode in ("signals", "auto") and signals_ready:
            decisions = [
                _decision(turn, s, signal_label(s, turn, self.config.signals), DecidedBy.SIGNALS) for s in candidates
            ]
            outcome = TaggingOutcome("signals", decisions, parse_ok)
        if outcome is None:
            decisions = [
                _decision(turn, s, rule_label(s, turn, self.config.rules), DecidedBy.RULES) for s in candidates
            ]
            outcome = TaggingOutcome("rules", decisions, parse_ok)
        outcome.seconds = time.perf_counter() - started
        return outcome

    # -------------------------------------------------------------- internal

    def _constrained(
        self, turn: int, candidates: list[Segment], prefix_ids: list[int], cache_salt: str | None
    ) -> TaggingOutcome | None:
        shared, firsts, tails = self._label_tokens()
        if not firsts:
            return None
        pieces = []
        for position, segment in enumerate(candidates):
            head = f"\n{OPEN_TAG}\n" if position == 0 else "\n"
            pieces.append(self.format.encode(f"{head}{segment.id}:") + shared)
        # one forward with the block supplied (see Engine.choose): the cost of labelling
        # stays that of prefilling the block's text
        picked = self.engine.choose(
            prefix_ids, pieces, firsts, continuations=tails, cache_salt=cache_salt, sequential=False
        )
        decisions = [
            Decision(
                turn,
                segment.id,
                LABEL_CHOICES[index],
                DecidedBy.CONSTRAINED,
                "logits",
                confidence=probs[index],
            )
            for segment, (index, probs) in zip(candidates, picked, strict=True)
        ]
        return TaggingOutcome("constrained", decisions, None)

    def _label_tokens(self) -> tuple[list[int], list[int], list[list[int]]]:
        """Token ids of " keep" / " compress" / " drop" split as (shared prefix, first
        distinct token of each, rest of each). With SmolLM2 each label is one token;
        a byte-level tokenizer shares the leading space. Empty firsts: cannot choose."""
        if self._choices is None:
            ids = [self.format.encode(f" {label.value}") for label in LABEL_CHOICES]
            shared: list[int] = []
            while all(len(i) > len(shared) for i in ids) and len({i[len(shared)] for i in ids}) == 1:
                shared.append(ids[0][len(shared)])
            at = len(shared)
            firsts = [i[at] for i in ids if len(i) > at]
            if len(firsts) == 3 and len(set(firsts)) == 3:
                self._choices = (shared, firsts, [i[at + 1 :] for i in ids])
            else:
                self._choices = ([], [], [])
        return self._choices


def _decision(turn: int, segment: Segment, labelled: tuple[Label, str], source: DecidedBy) -> Decision:
    label, reason = labelled
    return Decision(turn, segment.id, label, source, reason)
