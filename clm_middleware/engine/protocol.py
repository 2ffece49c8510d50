"""What the lifecycle layer needs from an engine, written down as a ``Protocol``.

``Conversation``, the compactor, the compressor, the tagger, the reclaimer and the
adapters call only what is listed here. Two implementations exist:

- :class:`clm_middleware.engine.Engine`: a local model over our block pool. It can
  observe everything (per-token log-probabilities of the prompt, attention mass) and
  its pool holds and reclaims the blocks of a conversation.
- :class:`clm_middleware.remote.RemoteEngine`: a serving engine (vLLM, SGLang,
  llama.cpp's server) behind its OpenAI-compatible completions API. The server's own
  prefix cache does the reuse; its ``pool`` holds nothing (``NullPool``); what it can
  observe depends on the server (``signals_source``).

The contract a caller may rely on, whatever the implementation:

- ``generate`` takes token ids, never text: the renderer's ids go to the model as
  they are, so no re-tokenization can break a cached prefix.
- ``generate`` returns a :class:`Generation`; nothing runs until it is iterated; after
  the iteration ``token_ids``, ``finish_reason`` and ``stats`` (a ``CallStats``: prompt,
  cached, prefill tokens, TTFT) are final. ``close()`` stops it early.
- With ``hold_blocks=True`` the caller owns ``generation.block_ids`` and gives them
  back with ``engine.pool.release(reversed(block_ids))`` (an empty list for an engine
  whose cache lives elsewhere).
- ``Observe`` is a request, not a promise: an engine that cannot observe something
  leaves ``prompt_logprobs`` / ``attention`` at ``None``, and callers fall back.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

from clm_middleware.engine.generation import Generation, LogitsProcessor
from clm_middleware.engine.observe import Observe
from clm_middleware.engine.penalties import GenerationDefaults


@runtime_checkable
class KVPool(Protocol):
    """The part of a block pool the lifecycle layer touches: references and statistics."""

    def acquire(self, block_ids: Sequence[int]) -> None: ...

    def release(self, block_ids: Sequence[int]) -> None: ...

    def stats(self) -> Any: ...  # a cache.block_pool.PoolStats


@runtime_checkable
class ServingEngine(Protocol):
    """An engine the lifecycle layer can drive (see the module docstring for the contract)."""

    tokenizer: Any  # a Hugging Face tokenizer: encode, decode, chat template
    pool: KVPool
    memo: dict[str, Any]  # one-off measurements of this model, by the module that measures
    fingerprint: str  # identifies the model's weights; keys calibrations on disk
    default_stop_ids: frozenset[int]
    max_positions: int  # 0: unknown
    vocab_size: int
    logits_processors: tuple[LogitsProcessor, ...]

    @property
    def model_name(self) -> str: ...

    @property
    def block_size(self) -> int: ...

    @property
    def num_parameters(self) -> int: ...  # 0: unknown

    @property
    def generation_defaults(self) -> GenerationDefaults: ...

    @property
    def sees_logits(self) -> bool: ...  # False: grammar-constrained output and custom processors cannot run

    def generate(
        self,
        prompt_token_ids: Sequence[int],
        max_new_tokens: int = 128,
        temperature: float = 0.0,
        top_p: float = 1.0,
        seed: int | None = None,
        stop: Sequence[str] | None = None,
        *,
        stop_token_ids: Sequence[int] | None = None,
        use_pool: bool = True,
        cache_salt: str | None = None,
        hold_blocks: bool = False,
        return_logits: bool = False,
        observe: Observe | None = None,
        logits_processors: Sequence[LogitsProcessor] = (),
        forced_token_ids: Sequence[int] | None = None,
        top_k: int | None = None,
        min_p: float | None = None,
    ) -> Generation: ...

    def score(
        self, prefix_ids: Sequence[int], continuations: Sequence[Sequence[int]], *, cache_salt: str | None = None
    ) -> list[float]:
        """Log-probability of each continuation after ``prefix_ids`` (sum over its tokens)."""
        ...

    def choose(
        self,
        prefix_ids: Sequence[int],
        pieces: Sequence[Sequence[int]],
        choices: Sequence[int],
        *,
        continuations: Sequence[Sequence[int]] | None = None,
        cache_salt: str | None = None,
        sequential: bool = True,
    ) -> list[tuple[int, list[float]]]:
        """Constrained continuation: per piece, the chosen index and the probabilities over ``choices``."""
        ...

    def working_kv_bytes(self, num_tokens: int, *, pooled: bool = True) -> int:
        """K/V bytes a request over ``num_tokens`` positions holds beside the pool (0: not
        counted); ``pooled``: whether the request used the pool (``use_pool``)."""
        ...

    def close(self) -> None: ...

    def disk_stats(self) -> dict[str, int]: ...


def signals_source(engine: Any) -> str:
    """Where the engine's self-information and attention come from: ``local`` (its own
    prefill: the local ``Engine``), ``server`` (the server's prompt log-probabilities; no
    attention), ``scorer:<model>`` (a small local model scores the prompt), ``none``."""
    return str(getattr(engine, "signals_source", "local"))
