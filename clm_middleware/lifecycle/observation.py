"""Record what a generation observed onto the segments it computed.

Self-information is recorded once per segment, when its tokens are first computed
(later turns serve them from the pool, so there is nothing new to read). Attention
densities are refreshed every turn the probe ran: each visible segment keeps
``max(previous × ATTENTION_DECAY, density now)``.
"""

from __future__ import annotations

from collections.abc import Sequence

from clm_middleware.engine import Generation
from clm_middleware.lifecycle.renderer import RenderedContext
from clm_middleware.lifecycle.segments import Segment, Status
from clm_middleware.lifecycle.signals import ATTENTION_DECAY


def record_observation(
    rendered: RenderedContext,
    generation: Generation,
    segments: Sequence[Segment],
    generated_segment: Segment | None,
    prefix_tokens: int,
) -> None:
    """``generated_segment`` holds ``prefix_tokens`` forced tokens (no decode log-prob),
    then, if the context keeps them as generated, the generated ones: their decode
    log-probs are its self-information (a reply tokenized another way has none from
    decoding)."""
    logprobs = generation.prompt_logprobs
    if logprobs is not None:
        for segment in segments:
            span = rendered.spans.get(segment.id)
            if segment.surprisal is not None or span is None or segment.status is not Status.ACTIVE:
                continue
            values = logprobs[span[0] : span[1]]
            if values and any(v is not None for v in values):  # word-initial tokens carry values
                segment.surprisal = [None if v is None else -v for v in values]
    if generated_segment is not None and generation.token_logprobs:
        decoded = generated_segment.token_ids[prefix_tokens:]
        values = [-v for v in generation.token_logprobs[: len(decoded)]]
        if len(values) == len(decoded) and decoded == list(generation.token_ids[: len(decoded)]):
            generated_segment.surprisal = [None] * prefix_tokens + values
    attention = generation.attention
    if attention is None:
        return
    total = float(attention.shape[0])
    for segment in segments:
        segment.attention *= ATTENTION_DECAY
        span = rendered.spans.get(segment.id)
        if span is None or span[1] <= span[0]:
            continue
        mass = float(attention[span[0] : span[1]].sum())
        density = mass / ((span[1] - span[0]) / total)
        segment.attention = max(segment.attention, density)
