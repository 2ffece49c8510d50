"""The plain drivers' reply text: what a token cap leaves is readable, held as its text tokenizes."""

from types import SimpleNamespace

from clm_middleware.render import ChatFormat
from clm_middleware.replay.plain import reply_of


def test_a_cap_inside_a_character_leaves_no_replacement_character(engine):
    ids = engine.tokenizer.encode("Hi 👧", add_special_tokens=False)
    cut = next(n for n in range(len(ids), 0, -1) if "\ufffd" in engine.tokenizer.decode(ids[:n]))
    generation = SimpleNamespace(token_ids=ids[:cut], request=SimpleNamespace(forced=None))
    text, kept = reply_of(generation, None, ChatFormat.from_tokenizer(engine.tokenizer), engine)
    assert "\ufffd" not in text and text.startswith("Hi")
    # the history keeps the text a client would re-send: the bytes of the cut character go
    assert kept == engine.tokenizer.encode(text, add_special_tokens=False) and kept == ids[: len(kept)]
