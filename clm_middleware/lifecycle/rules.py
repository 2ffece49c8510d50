"""Rule-based labels: the fallback when the model gives none, and the order of eviction.

Labels (``rule_label``), first rule that applies:
1. pinned → keep;
2. content-free (kind ``ack``) → drop;
3. from the last ``recent_turns`` turns → keep;
4. holds distinctive tokens (numbers, codes, names) → keep;
5. at least ``compress_min_tokens`` long and ``old_after_turns`` old → compress;
6. otherwise → keep.

Eviction value (``eviction_value``), lowest evicted first, oldest first among equals:
labelled drop or content-free 0 · labelled compress, not yet condensed 1 · otherwise 2
· +2 with distinctive tokens, else +1 for what a user or tool said once condensed to
its content words · +1 when the newest turns attended to it more than to an average token
· +1.5 for what the user said (a reply restates it, and a small model's replies are
full of invented numbers and names that must not outlast real facts), +1 for what a
tool returned (real facts too, but the user's own ones come first: a tool can be asked
again, and its results are long — a five-row JSON result of 300 tokens had outlasted
the user's name and insurance number in an agent chat at budget 1024)
· +1 for a reply the user accepted (see acceptance.py): the agreed state, in the
assistant's words, ranks above the model's other replies and below the user's facts.
"""

from __future__ import annotations

from dataclasses import dataclass

from clm_middleware.errors import ConfigError
from clm_middleware.lifecycle.distinctive import has_distinctive
from clm_middleware.lifecycle.segments import Label, Segment, Status


@dataclass(frozen=True, slots=True)
class RuleConfig:
    recent_turns: int = 2
    compress_min_tokens: int = 48
    old_after_turns: int = 4

    def __post_init__(self) -> None:
        for name, least in (("recent_turns", 0), ("compress_min_tokens", 1), ("old_after_turns", 0)):
            if getattr(self, name) < least:
                raise ConfigError(name, f"must be ≥ {least}, got {getattr(self, name)}")


def rule_label(segment: Segment, current_turn: int, config: RuleConfig) -> tuple[Label, str]:
    """A label and the rule that gave it (see the module docstring)."""
    if segment.pinned:
        return Label.KEEP, "pinned"
    if segment.kind == "ack":
        return Label.DROP, "content-free"
    age = current_turn - segment.turn
    if age < config.recent_turns:
        return Label.KEEP, "recent"
    if has_distinctive(segment.text):
        return Label.KEEP, "distinctive tokens"
    if segment.num_tokens >= config.compress_min_tokens and age >= config.old_after_turns:
        return Label.COMPRESS, "long and old"
    return Label.KEEP, "default"


def is_condensed_request(segment: Segment) -> bool:
    """What a user or tool said, condensed to its content words (or its facts)."""
    return segment.status is Status.COMPRESSED and segment.role in ("user", "tool")


def eviction_value(segment: Segment, attention_density: float = 0.0, *, accepted: bool = False) -> float:
    if segment.label is Label.DROP or segment.kind == "ack":
        value = 0.0
    elif segment.label is Label.COMPRESS and segment.status is not Status.COMPRESSED:
        value = 1.0  # judged worth less than its length, and not condensed yet
    else:
        value = 2.0
    if segment.kind != "ack" and has_distinctive(segment.text):
        value += 2.0
    elif is_condensed_request(segment):
        value += 1.0  # a request condensed to its content words: below a fact, above a reply
    if attention_density > 1.0:
        value += 1.0
    if segment.role in ("user", "system"):
        value += 1.5
    elif segment.role == "tool" or accepted:  # a tool's facts; the state the user agreed to
        value += 1.0
    return value
