"""What a serving engine is and can do, read once at start; and the tokenizer check.

Kinds (``dialect``), told apart by endpoints only one of them has:

- ``llamacpp``: llama.cpp's ``llama-server`` (``GET /props`` with ``total_slots``).
  Extra request fields: ``cache_prompt``, ``id_slot``, ``n_probs`` (the generated
  token ids come back in ``logprobs.content[].id``). Cache count: ``timings.cache_n``
  and ``usage.prompt_tokens_details.cached_tokens``. No prompt log-probabilities.
- ``vllm``: ``GET /version``. Extra fields: ``return_token_ids``, ``prompt_logprobs``.
  Cache count: ``usage.prompt_tokens_details.cached_tokens`` (with
  ``--enable-prompt-tokens-details``).
- ``openai``: anything else speaking ``/v1/completions`` (SGLang, a proxy): token ids
  from ``token_ids`` if the server sends them, else the reply text re-tokenized.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from clm_middleware.remote.client import RemoteEngineError, ServerClient

log = logging.getLogger(__name__)

# Text, digits, accents and the chat template's special tokens: a tokenizer that
# agrees on this agrees on what the renderer sends.
TOKENIZER_PROBE = "Hello, world! Room 1234 costs €85 — naïve café.\n<|im_start|>user\nok<|im_end|>"


@dataclass(frozen=True, slots=True)
class ServerInfo:
    dialect: str  # llamacpp | vllm | openai
    model_id: str
    num_slots: int  # llama.cpp slots (0: the server has none to choose)
    context_tokens: int  # per request; 0 unknown
    vocab_size: int  # 0 unknown
    num_parameters: int = 0  # 0 unknown (llama.cpp says; vLLM does not)


def read_server_info(client: ServerClient, model_id: str | None) -> ServerInfo:
    """The engine's kind and limits. A server that answers none of ``GET /v1/models``,
    ``/props`` and ``/version`` is no serving engine (a web server on that port, a wrong
    path): refused here, at start, where serving would have answered every request with
    its error page (a helper's sweep: a static file server was taken for model "default")."""
    listed = client.get_json("/v1/models", missing_ok=True)
    props = client.get_json("/props", missing_ok=True)
    version = client.get_json("/version", missing_ok=True)
    if not any(isinstance(answer, dict) for answer in (listed, props, version)):
        raise RemoteEngineError(
            f"{client.config.base_url} answers none of GET /v1/models, /props and /version: not a serving engine "
            "of the OpenAI API",
            hint="give --engine the base URL of vLLM, llama.cpp's llama-server or another OpenAI-compatible server",
        )
    models = listed if isinstance(listed, dict) else {}
    entries = models.get("data") or []
    first: dict[str, Any] = entries[0] if entries else {}
    chosen = model_id or str(first.get("id") or "default")
    meta = first.get("meta") or {}
    if isinstance(props, dict) and "total_slots" in props:
        settings = props.get("default_generation_settings") or {}
        context = int(settings.get("n_ctx") or meta.get("n_ctx_train") or 0)
        vocab, parameters = int(meta.get("n_vocab") or 0), int(meta.get("n_params") or 0)
        return ServerInfo("llamacpp", chosen, int(props["total_slots"]), context, vocab, parameters)
    dialect = "vllm" if isinstance(version, dict) and "version" in version else "openai"
    return ServerInfo(dialect, chosen, 0, int(first.get("max_model_len") or 0), 0)


def server_tokens(client: ServerClient, info: ServerInfo, text: str) -> list[int] | None:
    """The server's token ids for ``text`` (no BOS, special tokens parsed); None if it has no tokenize endpoint."""
    if info.dialect == "llamacpp":
        answer = client.post_json("/tokenize", {"content": text, "add_special": False, "parse_special": True})
    else:
        body = {"model": info.model_id, "prompt": text, "add_special_tokens": False}
        answer = client.post_json("/tokenize", body, missing_ok=True)
    if not isinstance(answer, dict) or "tokens" not in answer:
        return None
    return [int(t["id"]) if isinstance(t, dict) else int(t) for t in answer["tokens"]]


def check_tokenizer(client: ServerClient, info: ServerInfo, tokenizer: Any) -> bool:
    """Raise if the server tokenizes the probe differently from ``tokenizer``.

    Prompts go as token ids, so a different vocabulary would not fail loudly: the
    server would read other words. Returns False (and logs) if the server cannot tokenize.
    """
    local = list(tokenizer.encode(TOKENIZER_PROBE, add_special_tokens=False))
    remote = server_tokens(client, info, TOKENIZER_PROBE)
    if remote is None:
        log.warning("the engine has no /tokenize endpoint: the local tokenizer is not checked against it")
        return False
    local_vocab = len(tokenizer)
    if remote != local or (info.vocab_size and info.vocab_size != local_vocab):
        raise RemoteEngineError(
            f"the engine's tokenizer ({info.model_id}, vocab {info.vocab_size or '?'}) differs from the local one "
            f"(vocab {local_vocab}): {TOKENIZER_PROBE!r} is {remote[:12]}... there and {local[:12]}... here",
            hint="give --model the model (HF directory or .gguf) the server runs",
        )
    return True
