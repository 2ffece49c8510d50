"""A tiny randomly initialised Llama and a byte-level ChatML tokenizer, for tests.

Both are built from code, in milliseconds, with no file on disk, so unit tests can
check cache arithmetic exactly without a trained model. The tokenizer maps each
UTF-8 byte to one token and adds the ChatML specials, so any text round-trips.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
TINY_VOCAB_SIZE = 258  # 256 byte tokens + <|im_start|> + <|im_end|>


def tiny_tokenizer(merges: Sequence[tuple[str, str]] = ()):
    """Byte-level tokenizer: ids 0-255 are bytes, 256 is ``<|im_start|>``, 257 ``<|im_end|>`` (EOS).

    ``merges`` (byte-level BPE pairs, ``("t", "h")``, ``("Ġ", "the")``) add tokens from id
    258 on, and words are then pre-split as GPT-2 does: another tokenization of the same
    text, for tests of what crosses tokenizers (a model for it needs ``vocab_size=len(tok)``)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {c: i for i, c in enumerate(alphabet)}
    if merges:
        vocab["<|im_start|>"], vocab["<|im_end|>"] = 256, 257
        for first, second in merges:
            vocab.setdefault(first + second, len(vocab))
    backend = Tokenizer(models.BPE(vocab=vocab, merges=list(merges)))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=bool(merges))
    backend.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        pad_token="<|im_end|>",
        additional_special_tokens=["<|im_start|>", "<|im_end|>"],
    )
    tokenizer.chat_template = CHATML_TEMPLATE
    return tokenizer


def tiny_llama(
    *,
    seed: int = 0,
    num_layers: int = 2,
    hidden_size: int = 64,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    vocab_size: int = TINY_VOCAB_SIZE,
    max_positions: int = 4096,
    dtype: torch.dtype = torch.float32,
) -> torch.nn.Module:
    """A randomly initialised ``LlamaForCausalLM``, identical for identical arguments."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=hidden_size * 2,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_positions,
        bos_token_id=256,
        eos_token_id=257,
        pad_token_id=257,
        tie_word_embeddings=True,
    )
    generator_state = torch.random.get_rng_state()
    try:
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    finally:
        torch.random.set_rng_state(generator_state)
    model = model.to(dtype).eval()
    object.__setattr__(model, "_clm_model_name", f"tiny-llama-seed{seed}")
    return model
