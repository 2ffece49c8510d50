"""Whether a model follows the free-form ``[LIFECYCLE]`` protocol, measured once per model and prompt.

Following the protocol is a property of the weights and the protocol prompt, not of a
conversation, so ``auto`` tagging asks before its first turn instead of finding out by
showing the protocol prompt and segment markers to a model that may copy them into
its answers. The calibration:

- replays ``CALIBRATION_CHATS`` (short, fixed conversations) exactly as a ``free`` turn
  renders them (protocol prompt, markers) and generates greedily, with room for a short
  answer and a block; a probe passes when its output holds a parseable block;
- the model follows the protocol when the share of passes reaches ``threshold``
  (``TaggingConfig.auto_parse_rate``); it stops at the first failure that makes the
  threshold unreachable, so a model that cannot follow costs one probe;
- its cost is bounded: at most ``len(CALIBRATION_CHATS)`` generations of at most
  ``PROBE_ANSWER_TOKENS + PROBE_BLOCK_TOKENS`` tokens each, and it is reported
  (``ProtocolVerdict.seconds``, ``Conversation.stats()["protocol_calibration"]``).

Verdicts are remembered on the engine (``Engine.memo``) and on disk, keyed by the model
fingerprint and a hash of the protocol prompt, under ``<cache dir>/calibration/``
(directory 0700, files 0600, written atomically). A file that cannot be read, does
not parse, or names another key is ignored and the calibration runs again; a cache
directory that cannot be written leaves the verdict in memory only. An engine with
logits processors of its own (e.g. scripted replies) is not the bare model: its
verdict is kept in memory only.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

import xxhash

from clm_middleware.private_dirs import make_private_dirs

if TYPE_CHECKING:
    from clm_middleware.engine.protocol import ServingEngine

log = logging.getLogger(__name__)

PROBE_ANSWER_TOKENS = 48  # enough for a one-sentence answer before the block
PROBE_BLOCK_TOKENS = 64  # a block labelling the few segments of a calibration chat
FORMAT_VERSION = 1  # bump when the chats or the pass rule change: old verdicts are then ignored
_MEMO = "protocol_calibration"

CALIBRATION_CHATS: tuple[tuple[tuple[str, str], ...], ...] = (
    (
        ("system", "You are a helpful customer support agent."),
        ("user", "Hi there!"),
        ("assistant", "Hello! How can I help you today?"),
        ("user", "My order number is 48213-KX. It has not arrived yet."),
    ),
    (
        ("system", "You are a helpful assistant."),
        ("user", "Please remember that my sister's name is Ana and she lives in Porto."),
        ("assistant", "Got it: your sister Ana lives in Porto."),
        ("user", "ok thanks"),
    ),
    (
        ("system", "You are a travel assistant."),
        ("user", "I need a table for four people at 7 pm on Friday, near the central station."),
    ),
)


@dataclass(frozen=True, slots=True)
class ProtocolVerdict:
    follows: bool
    passed: int
    probes: int  # probes run (fewer than the chats when a failure decided early)
    seconds: float  # time the measurement took (0 when read from a cache)
    source: str  # "measured" | "disk" | "memory" | "runtime" (auto saw the model fail later)
    model_fingerprint: str
    prompt_hash: str

    def as_dict(self) -> dict[str, object]:
        return asdict(self)


def prompt_hash(protocol_text: str) -> str:
    return xxhash.xxh64(f"{FORMAT_VERSION}\0{protocol_text}".encode()).hexdigest()


def calibration_dir() -> Path:
    from clm_middleware.models.loading import default_cache_dir

    return default_cache_dir() / "calibration"


def protocol_verdict(
    engine: ServingEngine,
    protocol_text: str,
    *,
    threshold: float,
    cache_dir: Path | None = None,
) -> ProtocolVerdict:
    """The model's verdict for ``protocol_text``: from memory, from disk, or measured now."""
    key = prompt_hash(protocol_text)
    memo = engine.memo.setdefault(_MEMO, {})
    if key in memo:
        return replace(memo[key], source="memory") if memo[key].source != "runtime" else memo[key]
    on_disk = not engine.logits_processors
    path = _verdict_path(engine, key, cache_dir)
    verdict = _read(path, engine.fingerprint, key) if on_disk else None
    if verdict is None:
        verdict = measure(engine, protocol_text, threshold=threshold)
        if on_disk:
            _write(path, verdict)
    memo[key] = verdict
    return verdict


def known_verdict(
    engine: ServingEngine, protocol_text: str, *, cache_dir: Path | None = None
) -> ProtocolVerdict | None:
    """The verdict for ``protocol_text`` if one was measured already (in memory or on
    disk); None otherwise. Never measures: an explicit ``free`` or ``constrained`` mode
    runs no calibration, but may be told what one found."""
    key = prompt_hash(protocol_text)
    memo = engine.memo.get(_MEMO, {})
    if key in memo:
        return memo[key]
    if engine.logits_processors:
        return None
    return _read(_verdict_path(engine, key, cache_dir), engine.fingerprint, key)


def _verdict_path(engine: ServingEngine, key: str, cache_dir: Path | None) -> Path:
    return (cache_dir or calibration_dir()) / f"{engine.fingerprint}-{key}.json"


def record_runtime_failure(engine: ServingEngine, protocol_text: str) -> None:
    """``auto`` saw the model fail its probes in a conversation: later conversations on
    this engine start without the protocol (in memory only: a calibration stays the
    on-disk verdict)."""
    key = prompt_hash(protocol_text)
    memo = engine.memo.setdefault(_MEMO, {})
    memo[key] = ProtocolVerdict(False, 0, 0, 0.0, "runtime", engine.fingerprint, key)


def measure(engine: ServingEngine, protocol_text: str, *, threshold: float) -> ProtocolVerdict:
    """Run the calibration chats (see the module docstring)."""
    from clm_middleware.conversation import Conversation
    from clm_middleware.lifecycle.config import GenerationSettings

    started = time.perf_counter()
    chats = CALIBRATION_CHATS
    needed = _needed_passes(len(chats), threshold)
    passed = probes = 0
    for chat in chats:
        probes += 1
        conversation = Conversation(
            engine,
            tagging="free",
            protocol_prompt=protocol_text,
            generation=GenerationSettings(max_new_tokens=PROBE_ANSWER_TOKENS, block_tokens=PROBE_BLOCK_TOKENS),
        )
        try:
            for role, text in chat:
                conversation.add(role, text)
            passed += bool(conversation.respond().stats.parse_ok)
        finally:
            conversation.close()
        if passed + (len(chats) - probes) < needed:
            break  # the threshold can no longer be reached
    verdict = ProtocolVerdict(
        follows=passed >= needed,
        passed=passed,
        probes=probes,
        seconds=time.perf_counter() - started,
        source="measured",
        model_fingerprint=engine.fingerprint,
        prompt_hash=prompt_hash(protocol_text),
    )
    log.info("protocol calibration: %d/%d probes parsed in %.1f s", passed, probes, verdict.seconds)
    return verdict


def _needed_passes(probes: int, threshold: float) -> int:
    needed = 0
    while needed < probes and needed / probes < threshold:
        needed += 1
    return needed


def _read(path: Path, fingerprint: str, key: str) -> ProtocolVerdict | None:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        verdict = ProtocolVerdict(**{**data, "source": "disk", "seconds": 0.0})
    except (OSError, ValueError, TypeError):
        return None  # missing, unreadable or corrupt: measure again
    if verdict.model_fingerprint != fingerprint or verdict.prompt_hash != key:
        return None
    if not isinstance(verdict.follows, bool):
        return None
    return verdict


def _write(path: Path, verdict: ProtocolVerdict) -> None:
    try:
        make_private_dirs(path.parent)
        descriptor, temporary = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
        try:
            with os.fdopen(descriptor, "w", encoding="utf-8") as handle:
                json.dump(verdict.as_dict(), handle)
            os.chmod(temporary, 0o600)
            os.replace(temporary, path)
        except BaseException:
            Path(temporary).unlink(missing_ok=True)
            raise
    except OSError as error:
        log.warning("protocol calibration not cached at %s: %s", path, error)
