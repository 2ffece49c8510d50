"""Settings of a managed conversation: lifecycle and generation, each validated by field."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from clm_middleware.engine.penalties import check_logit_bias, check_penalties
from clm_middleware.engine.sampling import check_sampling_filters, check_seed, check_stop_strings
from clm_middleware.errors import ConfigError
from clm_middleware.lifecycle.compressor import METHODS
from clm_middleware.lifecycle.rules import RuleConfig
from clm_middleware.lifecycle.signals import SignalThresholds
from clm_middleware.lifecycle.tagging import TaggingConfig
from clm_middleware.structured import ResponseFormat


def check_integers(settings: object, *names: str) -> None:
    """``ConfigError`` naming the first of ``names`` that is set but not an integer: a
    ``budget="256"`` read from a config file must fail as a type, not as a comparison."""
    for name in names:
        value = getattr(settings, name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            raise ConfigError(name, f"must be an integer, got {type(value).__name__} {value!r}")


MIN_BUDGET_TOKENS = 64  # a smaller budget holds no more than a system prompt and a short exchange


@dataclass(frozen=True, slots=True)
class GenerationSettings:
    max_new_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    # sampling filters (engine/sampling.py), applied with temperature > 0; 0 is off,
    # None: the model's generation_config
    top_k: int | None = None
    min_p: float | None = None
    stop: tuple[str, ...] = ()
    # the reply ends right after the first of these it writes, which it keeps (unlike a
    # stop string): a tool call's closing tag, when one call per reply is asked for
    end_after: tuple[str, ...] = ()
    block_tokens: int = 96  # extra room for a free-form [LIFECYCLE] block
    # repetition controls (engine/penalties.py); None: the model's generation_config
    repetition_penalty: float | None = None
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    no_repeat_ngram_size: int | None = None
    # OpenAI's logit_bias as (token id, bias) pairs, each bias in [-100, 100]
    logit_bias: tuple[tuple[int, float], ...] = ()
    # end a reply before the first sentence it repeats, and stop generating there
    # (lifecycle/reply_quality.py): a repeated sentence tells the user nothing
    cut_repeats: bool = True
    # the reply cannot open a tool call (structured/call_ban.py: no line starts with '<',
    # no '<tool'); a remote engine, which shows no logits, ends the reply where one opens.
    # For a reply to a tool's result that may make no call (tool_choice="none")
    forbid_tool_calls: bool = False
    # structured output (clm_middleware/structured/): the reply is one JSON object, or
    # JSON valid against a schema, by grammar; a dict is read as OpenAI's response_format
    response_format: ResponseFormat | None = None

    def __post_init__(self) -> None:
        check_integers(self, "max_new_tokens", "block_tokens", "top_k", "seed", "no_repeat_ngram_size")
        for name in ("stop", "end_after"):  # one string is one stop string, never its characters
            value = getattr(self, name)
            value = (value,) if isinstance(value, str) else tuple(value)
            check_stop_strings(value, name)
            object.__setattr__(self, name, value)
        if self.response_format is not None and not isinstance(self.response_format, ResponseFormat):
            object.__setattr__(self, "response_format", ResponseFormat.parse(self.response_format))
        if self.max_new_tokens < 1:
            raise ConfigError("max_new_tokens", f"must be ≥ 1, got {self.max_new_tokens}")
        if self.block_tokens < 0:
            raise ConfigError("block_tokens", f"must be ≥ 0, got {self.block_tokens}")
        if not self.temperature >= 0:
            raise ConfigError("temperature", f"must be ≥ 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ConfigError("top_p", f"must be in (0, 1], got {self.top_p}")
        check_sampling_filters(self.top_k, self.min_p)
        check_seed(self.seed)
        check_penalties(self)
        bias = tuple(self.logit_bias.items() if isinstance(self.logit_bias, Mapping) else self.logit_bias)
        # token ids as JSON object keys are strings ({"1234": -100}), as OpenAI clients send them
        bias = tuple((int(t) if isinstance(t, str) and t.strip().isdigit() else t, v) for t, v in bias)
        check_logit_bias(bias)
        object.__setattr__(self, "logit_bias", tuple((token, float(value)) for token, value in bias))


@dataclass(frozen=True, slots=True)
class LifecycleConfig:
    """How the context is managed.

    ``budget`` (``max_context_tokens``) caps every prompt. When the next prompt would
    exceed it, pending decisions are applied and then rules compress or drop the
    lowest-value, oldest segments until the prompt is under the low-water mark:
    the slack means the costly re-prefill after a change happens every few turns,
    not every turn. The mark is ``low_water × budget``; with ``room_turns`` > 0 (opt-in)
    it leaves room for that many turns at the pace of the last few (tokens per turn):
    ``budget − room_turns × pace``, at most ``low_water × budget`` and at least
    ``min(min_low_water, low_water) × budget``. Short messages keep the mark at
    ``low_water``; long ones lower it, so a compaction buys several turns instead of
    one or two: fewer re-prefills, for less context on average (docs/lifecycle.md
    measures the trade: on long-message sessions ``room_turns = 4`` cut compactions by
    a quarter and cost ~0.06 nats/token of ``reply_nll``).
    Under a budget nothing changes before that: while the prompt fits, the model sees
    every message as the bare model would (labels wait, no re-prefill).
    Without a budget, the drops and compressions the model gave itself (``free`` or
    ``constrained`` tagging) are applied once they would free ``min_reclaim_tokens``
    (each application re-prefills from the first changed segment on, so they are
    batched); labels from signals or rules never apply without a budget.

    ``recent_share`` of the budget is kept for the newest messages verbatim, whole and
    in order: old messages are folded into the digest only while the messages after
    the fold stay above it, and further room comes from the digest first (what has no
    fact, then, with the verbatim messages down to half of it, facts down to halfway
    between the low-water mark and the budget). The next reply depends most on the
    last few turns as they were said (teacher-forced ``reply_nll`` measures it); the
    digest keeps the facts of the rest. 0 lets the digest take everything but the
    newest turn.

    ``request_share`` of the budget holds requests in plain words in the digest as if
    they were facts ("a cheap place in the north", "I took up the clarinet": no number
    or name, but what the user wants and said once), those the model found most
    surprising where they were said first; beyond it they go before the verbatim
    messages shrink. 0 keeps none of them under pressure.

    ``compact_ahead`` (opt-in): after a reply, when the next turn's messages (as long
    as the longest of the last few turns') would take the prompt over the budget, the
    compaction runs then and the compacted context is computed into the pool, so the
    next turn prefills only its new message: the re-prefill leaves the next turn's time
    to first token for the end of this one (a user reading the reply does not wait for
    it). It compacts a turn early, and somewhat more often (docs/lifecycle.md measures
    the trade). With or without a budget, the same call computes the reply's end and the
    next message's opening (the template's user header). Local engines only; a serving
    engine keeps its own cache.
    """

    tagging: TaggingConfig = field(default_factory=TaggingConfig)
    budget: int | None = None
    k: int = 2
    compress_min_tokens: int = 48
    compression: str = "auto"
    target_ratio: float = 4.0
    low_water: float = 0.75
    min_low_water: float = 0.5
    room_turns: int = 0
    min_reclaim_tokens: int = 64
    protect_turns: int = 1
    recent_share: float = 0.75
    request_share: float = 0.0625
    compact_ahead: bool = False

    def __post_init__(self) -> None:
        check_integers(self, "budget", "k", "compress_min_tokens", "room_turns", "min_reclaim_tokens", "protect_turns")
        if isinstance(self.tagging, str):  # a mode's name, as Conversation(tagging=...) takes it
            object.__setattr__(self, "tagging", tagging_config(self.tagging, self.compress_min_tokens))
        elif not isinstance(self.tagging, TaggingConfig):
            raise ConfigError("tagging", f"must be a TaggingConfig or a mode's name, got {type(self.tagging).__name__}")
        if self.budget is not None and self.budget < MIN_BUDGET_TOKENS:
            raise ConfigError("budget", f"must be ≥ {MIN_BUDGET_TOKENS} tokens, got {self.budget}")
        if self.k < 0:
            raise ConfigError("k", f"must be ≥ 0, got {self.k}")
        if self.compression not in METHODS:
            raise ConfigError("compression", f"unknown method {self.compression!r}; use one of {METHODS}")
        if not 0.2 <= self.low_water <= 1.0:
            raise ConfigError("low_water", f"must be in [0.2, 1], got {self.low_water}")
        if not 0.2 <= self.min_low_water <= 1.0:
            raise ConfigError("min_low_water", f"must be in [0.2, 1], got {self.min_low_water}")
        if self.room_turns < 0:
            raise ConfigError("room_turns", f"must be ≥ 0, got {self.room_turns}")
        if self.compress_min_tokens < 1:
            raise ConfigError("compress_min_tokens", f"must be ≥ 1, got {self.compress_min_tokens}")
        if not 0.0 <= self.recent_share <= 0.9:
            raise ConfigError("recent_share", f"must be in [0, 0.9], got {self.recent_share}")
        if not 0.0 <= self.request_share <= 0.5:
            raise ConfigError("request_share", f"must be in [0, 0.5], got {self.request_share}")
        if not isinstance(self.compact_ahead, bool):
            raise ConfigError("compact_ahead", f"must be true or false, got {self.compact_ahead!r}")
        if self.protect_turns < 1:
            raise ConfigError("protect_turns", f"must be ≥ 1, got {self.protect_turns}")
        if self.min_reclaim_tokens < 0:
            raise ConfigError("min_reclaim_tokens", f"must be ≥ 0, got {self.min_reclaim_tokens}")


def tagging_config(mode: str, compress_min_tokens: int) -> TaggingConfig:
    """The tagging settings of a mode's name, its rules and signals condensing from
    ``compress_min_tokens`` tokens as the lifecycle does."""
    return TaggingConfig(
        mode=mode,
        rules=RuleConfig(compress_min_tokens=compress_min_tokens),
        signals=SignalThresholds(compress_min_tokens=compress_min_tokens),
    )
