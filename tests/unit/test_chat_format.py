import pytest

from clm_middleware.errors import ChatTemplateError
from clm_middleware.models import tiny_tokenizer
from clm_middleware.render import ChatFormat

MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi there"},
    {"role": "assistant", "content": "Hello! How can I help?"},
    {"role": "user", "content": "Tell me a joke."},
]


def test_token_rendering_equals_the_chat_template(tiny_tok):
    chat = ChatFormat.from_tokenizer(tiny_tok)
    ids = chat.render([(m["role"], chat.encode(m["content"])) for m in MESSAGES])
    expected = tiny_tok.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    assert tiny_tok.decode(ids) == expected


def test_rendering_is_append_only(tiny_tok):
    chat = ChatFormat.from_tokenizer(tiny_tok)
    pairs = [(m["role"], chat.encode(m["content"])) for m in MESSAGES]
    shorter = chat.render(pairs[:2], add_generation_prompt=False)
    longer = chat.render(pairs, add_generation_prompt=False)
    assert longer[: len(shorter)] == shorter


def test_template_default_preamble_precedes_a_chat_without_system_message():
    tokenizer = tiny_tokenizer()
    tokenizer.chat_template = (
        "{% if messages[0]['role'] != 'system' %}{{ 'SYS: default\\n' }}{% endif %}"
        "{% for m in messages %}{{ m['role'] + ': ' + m['content'] + '\\n' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ 'assistant: ' }}{% endif %}"
    )
    chat = ChatFormat.from_tokenizer(tokenizer)
    ids = chat.render([("user", chat.encode("hi"))])
    assert tokenizer.decode(ids) == "SYS: default\nuser: hi\nassistant: "
    with_system = chat.render([("system", chat.encode("s")), ("user", chat.encode("hi"))])
    assert tokenizer.decode(with_system) == "system: s\nuser: hi\nassistant: "


def test_a_template_that_rewrites_history_is_refused():
    tokenizer = tiny_tokenizer()
    tokenizer.chat_template = (
        "{% for m in messages %}{{ m['role'] + ('*' if loop.last else '') + ': ' + m['content'] }}{% endfor %}"
    )
    with pytest.raises(ChatTemplateError, match="append-only"):
        ChatFormat.from_tokenizer(tokenizer)


def test_a_tokenizer_without_template_is_refused():
    tokenizer = tiny_tokenizer()
    tokenizer.chat_template = None
    with pytest.raises(ChatTemplateError, match="no chat template"):
        ChatFormat.from_tokenizer(tokenizer)
