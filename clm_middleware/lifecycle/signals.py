"""Labels from the model's computation instead of its prose (the ``signals`` mode).

Per segment, all measured by the chat model while it processes the conversation:
- self-information: mean ``-log p`` of the segment's tokens, read from the prefill
  (or decode) that computed them anyway;
- attention: how much the newest turn's queries attend to the segment, as a density
  (its share of attention mass ÷ its share of context tokens; 1.0 = average); the
  conversation keeps the maximum over turns, decayed by ``ATTENTION_DECAY`` per turn;
- distinctive tokens (numbers, codes, names, emails, dates), kind, age.

Labels, first rule that applies (thresholds in :class:`SignalThresholds`):
1. pinned → keep;
2. content-free: kind ``ack``, or short (≤ ``short_tokens``) with no distinctive token
   and low self-information (< ``low_surprisal``) → drop;
3. distinctive tokens → keep (a compression would keep them verbatim anyway);
4. strongly attended (density ≥ ``attended_density``) → keep;
5. from the last ``recent_turns`` turns → keep;
6. long (≥ ``compress_min_tokens``) and predictable (< ``compress_surprisal``) → compress;
7. otherwise → keep.
"""

from __future__ import annotations

from dataclasses import dataclass

from clm_middleware.lifecycle.distinctive import has_distinctive
from clm_middleware.lifecycle.segments import Label, Segment

ATTENTION_DECAY = 0.8  # per turn: a segment attended once stays "relevant" for a few turns


@dataclass(frozen=True, slots=True)
class SignalThresholds:
    """Nats per token for surprisal; density 1.0 = average attention per token.

    Calibrated on SmolLM2-135M-Instruct over the bundled transcripts (see
    docs/lifecycle.md): its acknowledgements average ~2 nats/token, content-bearing
    sentences 3-5.
    """

    short_tokens: int = 12
    low_surprisal: float = 2.5
    attended_density: float = 2.0
    recent_turns: int = 2
    compress_min_tokens: int = 48
    compress_surprisal: float = 3.5


@dataclass(frozen=True, slots=True)
class SignalFeatures:
    mean_surprisal: float | None
    attention_density: float
    distinctive: bool
    age: int

    def as_reason(self) -> str:
        surprisal = "n/a" if self.mean_surprisal is None else f"{self.mean_surprisal:.2f}"
        return (
            f"surprisal {surprisal}, attention {self.attention_density:.2f}, "
            f"distinctive {self.distinctive}, age {self.age}"
        )


def features(segment: Segment, current_turn: int) -> SignalFeatures:
    return SignalFeatures(
        mean_surprisal=segment.mean_surprisal,
        attention_density=segment.attention,
        distinctive=has_distinctive(segment.text),
        age=current_turn - segment.turn,
    )


def signal_label(segment: Segment, current_turn: int, thresholds: SignalThresholds) -> tuple[Label, str]:
    """A label and why (see the module docstring)."""
    f = features(segment, current_turn)
    reason = f.as_reason()
    if segment.pinned:
        return Label.KEEP, "pinned"
    if segment.kind == "ack":
        return Label.DROP, f"content-free kind; {reason}"
    predictable = f.mean_surprisal is not None and f.mean_surprisal < thresholds.low_surprisal
    if segment.num_tokens <= thresholds.short_tokens and not f.distinctive and predictable:
        return Label.DROP, f"short and predictable; {reason}"
    if f.distinctive:
        return Label.KEEP, f"distinctive; {reason}"
    if f.attention_density >= thresholds.attended_density:
        return Label.KEEP, f"attended; {reason}"
    if f.age < thresholds.recent_turns:
        return Label.KEEP, f"recent; {reason}"
    if (
        segment.num_tokens >= thresholds.compress_min_tokens
        and f.mean_surprisal is not None
        and f.mean_surprisal < thresholds.compress_surprisal
    ):
        return Label.COMPRESS, f"long and predictable; {reason}"
    return Label.KEEP, f"default; {reason}"


def attention_densities(
    mass_per_segment: dict[str, float], tokens_per_segment: dict[str, int], total_tokens: int
) -> dict[str, float]:
    """Share of attention ÷ share of tokens, per segment."""
    densities = {}
    for segment, mass in mass_per_segment.items():
        tokens = tokens_per_segment.get(segment, 0)
        if tokens and total_tokens:
            densities[segment] = mass / (tokens / total_tokens)
    return densities
