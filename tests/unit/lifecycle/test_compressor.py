"""Faithful compression: extractive keeps every distinctive token; abstractive must not lose or invent one."""

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from clm_middleware.engine import Engine
from clm_middleware.lifecycle.compaction import ContextBudgetError
from clm_middleware.lifecycle.compressor import REQUEST_WORDS, Compressor, check_faithful
from clm_middleware.lifecycle.distinctive import distinctive_tokens
from clm_middleware.lifecycle.prompts import summarizer_prompt
from clm_middleware.lifecycle.segments import Segment, SegmentId, Status
from clm_middleware.models import ScriptedReplies
from clm_middleware.render import ChatFormat

ORIGINAL = (
    "We talked for a while about the weather in Lisbon, which was mild and pleasant for most of the "
    "week, and then I finally remembered to give you my booking reference QX7-4821 for flight TP1357 "
    "landing at 10:40 on April 22, which I keep losing, so please hold on to it for me."
)


def segment(text: str, chat: ChatFormat) -> Segment:
    return Segment(SegmentId("seg_3"), 3, 1, "user", "text", text, chat.encode(text), turn=1)


def compressor(engine: Engine, *, method: str, summarizer: Engine | None = None, ratio: float = 4.0) -> Compressor:
    chat = ChatFormat.from_tokenizer(engine.tokenizer)
    return Compressor(
        engine,
        chat,
        method=method,
        target_ratio=ratio,
        summarizer=summarizer,
        summarizer_prompt=summarizer_prompt(),
    )


def scripted_summarizer(tiny_model, tiny_tok, *texts: str) -> tuple[Engine, ScriptedReplies]:
    chat_ids = [[*tiny_tok.encode(text, add_special_tokens=False), tiny_tok.eos_token_id] for text in texts]
    script = ScriptedReplies(chat_ids)
    return Engine(tiny_model, tiny_tok, logits_processors=[script]), script


def test_extractive_keeps_every_distinctive_token_verbatim_and_shrinks(engine):
    chat = ChatFormat.from_tokenizer(engine.tokenizer)
    result = compressor(engine, method="extractive").compress(segment(ORIGINAL, chat))
    assert result.ok and result.method == "extractive"
    for token in ("QX7-4821", "TP1357", "10:40", "April", "22", "Lisbon"):
        assert token in result.text
    assert distinctive_tokens(result.text) <= distinctive_tokens(ORIGINAL)
    assert len(result.token_ids) < len(chat.encode(ORIGINAL))


def test_extractive_respects_the_target_ratio_when_facts_allow(engine):
    chat = ChatFormat.from_tokenizer(engine.tokenizer)
    plain = "the weather was mild and pleasant and we walked along the river all afternoon " * 4
    result = compressor(engine, method="extractive", ratio=4.0).compress(segment(plain, chat))
    original_tokens = len(chat.encode(plain))
    assert result.ok
    assert original_tokens / len(result.token_ids) >= 3.0  # 4x target; word boundaries round up


CONFIRMATION = "please confirm your booking for 3 tickets to comedysportz in philadelphia on march 11th"


def scored(text: str, chat: ChatFormat, rare: dict[str, float]) -> Segment:
    """A segment whose recorded self-information is 1 nat per token, or ``rare[word]`` on that word."""
    encoded = chat.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    spans = {word: (text.index(word), text.index(word) + len(word)) for word in rare}
    surprisal = [
        next((rare[w] for w, (a, b) in spans.items() if start < b and end > a), 1.0)
        for start, end in encoded["offset_mapping"]
    ]
    made = segment(text, chat)
    assert made.token_ids == list(encoded["input_ids"])
    made.surprisal = surprisal
    return made


def test_extractive_ratio_applies_to_the_words_not_kept_verbatim(engine):
    chat = ChatFormat.from_tokenizer(engine.tokenizer)
    text = "confirm 3 tickets for comedysportz, order QX7-4821 on March 11th at 6:30 pm, gate B12, row 14"
    dense = scored(text, chat, {"comedysportz": 12.0, "tickets": 6.0})
    result = compressor(engine, method="extractive").compress(dense)
    # the facts do not use up the room of the most informative other word
    assert result.ok and "comedysportz" in result.text
    assert all(fact in result.text for fact in ("QX7-4821", "March 11th", "6:30 pm", "B12", "14"))


def test_extractive_takes_function_words_only_when_nothing_else_is_there(engine):
    chat = ChatFormat.from_tokenizer(engine.tokenizer)
    request = "okay then, could you please look for one in the north instead for me, thanks"
    result = compressor(engine, method="extractive").compress(segment(request, chat))
    assert result.ok and "north" in result.text
    assert not any(word in result.text.split() for word in ("the", "for", "me", "you", "okay"))


def test_tighten_keeps_the_facts_and_the_words_the_model_found_rare(engine):
    chat = ChatFormat.from_tokenizer(engine.tokenizer)
    condensed = scored(CONFIRMATION, chat, {"comedysportz": 12.0, "tickets": 9.0, "booking": 3.0})
    condensed.status, condensed.summary = Status.COMPRESSED, "confirm booking 3 tickets comedysportz march 11th"
    condensed.summary_ids = chat.encode(condensed.summary)
    result = compressor(engine, method="extractive").tighten(condensed)
    assert result.ok and result.text == "3 tickets comedysportz march 11th"


def test_tighten_without_scores_keeps_the_distinctive_tokens_alone(engine, monkeypatch):
    chat = ChatFormat.from_tokenizer(engine.tokenizer)
    condensed = segment(CONFIRMATION, chat)  # no recorded self-information: scoring needs the engine
    condensed.status, condensed.summary = Status.COMPRESSED, "confirm booking 3 tickets comedysportz march 11th"
    condensed.summary_ids = chat.encode(condensed.summary)
    tightener = compressor(engine, method="extractive")

    def engine_down(*args):
        raise RuntimeError("engine down")

    monkeypatch.setattr(tightener, "_compute_word_scores", engine_down)
    result = tightener.tighten(condensed)
    assert result.ok and result.text == "3 march 11th"


def test_tighten_keeps_the_most_surprising_words_of_a_plain_word_request(engine):
    chat = ChatFormat.from_tokenizer(engine.tokenizer)
    text = "I have been learning to play the clarinet on weekends at the old music school downtown"
    rare = {"clarinet": 7.0, "weekends": 5.0, "music": 4.0, "downtown": 6.0, "learning": 2.0}
    request = scored(text, chat, rare)
    request.status, request.summary = Status.COMPRESSED, "learning play clarinet weekends old music school downtown"
    request.summary_ids = chat.encode(request.summary)
    result = compressor(engine, method="extractive").tighten(request)
    assert REQUEST_WORDS == 4
    assert result.ok and result.text == "clarinet weekends music downtown"  # the four highest, in order


def test_tighten_leaves_a_short_plain_word_request_and_one_it_cannot_score(engine, monkeypatch):
    chat = ChatFormat.from_tokenizer(engine.tokenizer)
    request = scored("could you look for a cheap place in the north", chat, {"cheap": 9.0})
    request.status, request.summary = Status.COMPRESSED, "cheap place north"
    request.summary_ids = chat.encode(request.summary)
    tightener = compressor(engine, method="extractive")
    result = tightener.tighten(request)
    assert not result.ok and result.error == "not shorter than the original"  # under four words already

    def engine_down(*args):
        raise RuntimeError("engine down")

    unscored = segment("I have been learning to play the clarinet on weekends at the old music school", chat)
    unscored.status, unscored.summary = Status.COMPRESSED, "learning play clarinet weekends old music school"
    unscored.summary_ids = chat.encode(unscored.summary)
    monkeypatch.setattr(tightener, "_compute_word_scores", engine_down)
    result = tightener.tighten(unscored)
    assert not result.ok and result.error == "no distinctive token"  # no guess at which words matter


def test_extractive_output_only_deletes_words(engine):
    chat = ChatFormat.from_tokenizer(engine.tokenizer)
    result = compressor(engine, method="extractive").compress(segment(ORIGINAL, chat))
    words = ORIGINAL.split()
    position = 0
    for word in result.text.split():  # kept words appear in the original order
        position = words.index(word, position) + 1


def test_faithful_abstractive_summary_is_accepted(engine, tiny_model, tiny_tok):
    summary = "Booking QX7-4821, flight TP1357, lands 10:40 April 22; Lisbon weather mild."
    summarizer, script = scripted_summarizer(tiny_model, tiny_tok, summary)
    chat = ChatFormat.from_tokenizer(engine.tokenizer)
    result = compressor(engine, method="abstractive", summarizer=summarizer).compress(segment(ORIGINAL, chat))
    assert result.ok and result.method == "abstractive" and result.text == summary
    assert script.started == 1


@pytest.mark.parametrize(
    ("summary", "problem"),
    [
        ("Booking QX7-4821, flight TP1357, lands 11:40 April 22 in Lisbon.", "invented"),
        ("Booking QX7-4821 lands 10:40 April 22 in Lisbon.", "missing"),
    ],
    ids=["invented-number", "missing-number"],
)
def test_unfaithful_abstractive_summary_is_rejected_for_extractive(engine, tiny_model, tiny_tok, summary, problem):
    summarizer, _ = scripted_summarizer(tiny_model, tiny_tok, summary)
    chat = ChatFormat.from_tokenizer(engine.tokenizer)
    result = compressor(engine, method="abstractive", summarizer=summarizer).compress(segment(ORIGINAL, chat))
    assert result.ok and result.method == "extractive"
    assert result.rejected and "unfaithful" in result.rejected and problem in result.rejected
    check = check_faithful(ORIGINAL, summary)
    assert check.invented if problem == "invented" else check.missing


def test_summarizer_failure_is_retried_then_recorded_and_nothing_is_lost(engine, tiny_model, tiny_tok):
    calls = []

    def explode(generated, logits):
        calls.append(1)
        raise RuntimeError("summarizer crashed")

    broken = Engine(tiny_model, tiny_tok, logits_processors=[explode])
    chat = ChatFormat.from_tokenizer(engine.tokenizer)
    tiny_text = "QX7-4821 TP1357"  # all distinctive: extractive cannot shorten it either
    short = compressor(engine, method="abstractive", summarizer=broken).compress(segment(tiny_text, chat))
    assert not short.ok and short.error == "not shorter than the original"
    assert "summarizer failed: summarizer crashed" in short.rejected
    assert len(calls) == 2  # tenacity: two attempts


def test_an_empty_summary_falls_back_to_extractive(engine, tiny_model, tiny_tok):
    chat = ChatFormat.from_tokenizer(engine.tokenizer)
    summarizer, _ = scripted_summarizer(tiny_model, tiny_tok, "")
    result = compressor(engine, method="abstractive", summarizer=summarizer).compress(segment(ORIGINAL, chat))
    assert result.method == "extractive" and result.rejected == "empty summary"


def test_tightening_keeps_the_distinctive_words_of_the_original(engine):
    chat = ChatFormat.from_tokenizer(engine.tokenizer)
    original = segment("One more thing. My rental car has the licence plate EJE 873, and it is blue.", chat)
    original.summary = "thing. EJE 873, blue."  # a condensed form where EJE opens a "sentence"
    original.summary_ids = chat.encode(original.summary)
    original.status = Status.COMPRESSED
    assert original.visible_text == original.summary
    result = compressor(engine, method="extractive").tighten(original)
    assert result.ok and result.text == "EJE 873,"


@settings(max_examples=200, deadline=None)
@given(st.text(alphabet="ab .", max_size=60), st.data())
def test_word_means_sweep_equals_pairing_every_word_with_every_token(text, data):
    import regex as re_

    from clm_middleware.lifecycle.compressor import word_means

    words = list(re_.finditer(r"\S+", text))
    cuts = sorted(set(data.draw(st.lists(st.integers(0, len(text)), max_size=20))) | {0, len(text)})
    offsets = list(itertools.pairwise(cuts))
    values = data.draw(st.lists(st.one_of(st.none(), st.floats(0, 10)), min_size=len(offsets), max_size=len(offsets)))
    brute = []
    for word in words:
        hits = [
            v
            for (s, e), v in zip(offsets, values, strict=True)
            if s < word.end() and e > word.start() and v is not None
        ]
        brute.append(sum(hits) / len(hits) if hits else 0.0)
    assert word_means(words, offsets, values) == pytest.approx(brute)


def test_a_new_message_over_budget_times_ratio_is_refused_before_any_model_work(converse, engine):
    conversation = converse(budget=256)
    conversation.send("hello")
    computed = engine.stats.prefill_tokens
    conversation.add("user", "lorem ipsum dolor " * 400)  # far over 256 × 4 tokens
    with pytest.raises(ContextBudgetError, match=r"none over 1024 \(the budget × the compression target_ratio, 4\)"):
        conversation.respond()
    assert engine.stats.prefill_tokens == computed  # nothing was scored or prefilled for it
    conversation.discard(2)
    assert conversation.send("short again").text is not None


def test_trim_keeps_facts_first_then_the_rarest_words_in_order_within_the_room(engine):
    chat = ChatFormat.from_tokenizer(engine.tokenizer)
    log = scored(ORIGINAL, chat, {"weather": 9.0, "mild": 7.0})
    room = len(chat.encode(" weather Lisbon, QX7-4821 TP1357 10:40 April 22,"))  # the facts and one word
    result = compressor(engine, method="extractive").trim(log, room)
    assert result.ok and result.method == "trimmed" and len(result.token_ids) <= room + 2
    words = result.text.split()
    assert words == sorted(words, key=ORIGINAL.index)  # in the order they were said
    assert {"QX7-4821", "TP1357"} <= set(words) and "weather" in words  # facts, then the rarest word
    assert "mild" not in words and "the" not in words
    assert check_faithful(ORIGINAL, result.text).invented == ()


def test_trim_with_no_room_for_a_word_fails_and_keeps_the_segment(engine):
    chat = ChatFormat.from_tokenizer(engine.tokenizer)
    result = compressor(engine, method="extractive").trim(segment(ORIGINAL, chat), 0)
    assert not result.ok


NEGATED = "I am not available on Tuesday 14 May, but Thursday 16 May works well for the whole family."


def test_no_deleting_method_keeps_a_negated_clause_without_its_negation(engine):
    chat = ChatFormat.from_tokenizer(engine.tokenizer)
    squeezer = compressor(engine, method="extractive")
    results = [
        squeezer.compress(segment(NEGATED, chat)),
        squeezer.tighten(segment(NEGATED, chat)),
        squeezer.trim(segment(NEGATED, chat), len(chat.encode(NEGATED)) // 2),
    ]
    for result in results:
        assert result.ok and "Tuesday" in result.text
        assert "not available on Tuesday" in result.text, result  # never "available Tuesday"
        assert check_faithful(NEGATED, result.text).faithful


def test_tighten_keeps_a_word_where_it_was_judged_not_where_it_recurs(engine):
    chat = ChatFormat.from_tokenizer(engine.tokenizer)
    orders = "Order 77120-B arrived but the blender was broken; order 77121-B never arrived at all."
    result = compressor(engine, method="extractive").tighten(scored(orders, chat, {"arrived": 9.0}))
    # "Order" is said twice within a few words (kept where first said); "arrived" stays with
    # the order it was judged for: not "77121-B arrived"
    assert result.ok and result.text == "Order 77120-B arrived 77121-B"


def test_a_reply_that_calls_a_tool_is_never_cut_down(engine):
    chat = ChatFormat.from_tokenizer(engine.tokenizer)
    arguments = '{"doctor": "Dr. Okafor", "slot": "B-214"}'
    call = f'Booking it now. <tool_call>{{"name": "book", "arguments": {arguments}}}</tool_call>'
    squeezer = compressor(engine, method="extractive")
    reply = segment(call, chat)
    for result in (squeezer.compress(reply), squeezer.tighten(reply), squeezer.trim(reply, 8)):
        assert not result.ok and "whole" in result.error


@pytest.mark.parametrize(
    "text",
    [
        '```sh\ncat /var/log/app.log | grep -E "ERROR|FATAL" | sort | uniq -c | sort -rn | head -5\n```',
        "Here is the loader, it strips each line:\n```python\ndef load(path):\n    with open(path) as fh:\n"
        "        return [line.rstrip() for line in fh]\n```\nCall it with the CSV path from before.",
        "~~~yaml\nresources:\n  limits:\n    cpu: 500m\n    memory: 256Mi\n~~~",
    ],
    ids=["shell", "prose-and-python", "tilde-yaml"],
)
def test_a_segment_with_a_code_block_is_never_cut_down(engine, text):
    # code cut to some of its words is other code ("head -5" read as "sort -5"), its lines
    # and indentation run together: it stays whole or leaves whole
    chat = ChatFormat.from_tokenizer(engine.tokenizer)
    squeezer = compressor(engine, method="extractive")
    code = segment(text, chat)
    for result in (squeezer.compress(code), squeezer.tighten(code), squeezer.trim(code, 8)):
        assert not result.ok and result.error == "a code block is kept or dropped whole"


def test_an_abstractive_summary_that_loses_the_negation_is_unfaithful():
    original = "I am not flying on April 22 with TP1357."
    assert check_faithful(original, "Flying April 22 TP1357.").lost_negation
    assert not check_faithful(original, "Flying April 22 TP1357.").faithful
    assert check_faithful(original, "Not flying April 22 on TP1357.").faithful


def test_a_content_word_said_again_close_by_is_kept_however_predictable(engine):
    chat = ChatFormat.from_tokenizer(engine.tokenizer)
    text = "One guest is vegan, and I am allergic to peanuts, so nothing with peanuts at all, thank you"
    # every word at 1 nat but "vegan" and "allergic": "peanuts" is predictable after "allergic to"
    allergy = scored(text, chat, {"vegan": 9.0, "allergic": 9.0})
    extracted = compressor(engine, method="extractive").compress(allergy)
    assert extracted.ok and "peanuts" in extracted.text.split(", ")[1]  # first said: "allergic to peanuts,"
    allergy.status, allergy.summary = Status.COMPRESSED, "guest vegan, allergic peanuts, nothing peanuts"
    allergy.summary_ids = chat.encode(allergy.summary)
    tightened = compressor(engine, method="extractive").tighten(allergy)
    assert tightened.ok and "vegan, allergic peanuts," in tightened.text


def test_a_message_no_context_could_hold_is_refused_at_add_before_any_work(converse, engine):
    """A helper's sweep: an 8 MB message cost clm serve seconds and a gigabyte before its
    refusal (and a MemoryError, a 500, in the segmenter). At the longest token's length a
    character count alone shows it cannot fit."""
    from clm_middleware.errors import ContextWindowError
    from clm_middleware.render.chat_format import longest_token_chars

    conversation = converse(budget=256)
    per_token = longest_token_chars(engine.tokenizer)
    with pytest.raises(ContextBudgetError, match=r"at least [\d,]+ tokens; under a budget of 256 none over 1024"):
        conversation.add("user", "x" * (1024 * per_token + 1))
    with pytest.raises(ContextWindowError, match=r"more than the model's \d+ positions"):
        conversation.add("system", "x" * (engine.max_positions * per_token + 1))
    assert conversation.messages == []  # nothing was added
    conversation.add("tool", "x" * (1024 * per_token + 1))  # a tool's result is trimmed to fit instead
    assert [m.role for m in conversation.messages] == ["tool"]


CHINESE = (
    "我叫王小明，我的订单号是DD-20250318-7741，手机是138-0013-8000。上个月在你们的网站上买了一台咖啡机，"
    "到现在还没有收到，麻烦帮我查一下物流，谢谢你们的帮助。"
)


@pytest.mark.parametrize("method", ["extractive", "tighten"])
def test_chinese_is_condensed_character_by_character_with_its_facts_whole(engine, method):
    """A script written without spaces was one "word" per clause: nothing condensed, and a
    Chinese chat under a budget lost every early message whole (a helper's sweep)."""
    chat = ChatFormat.from_tokenizer(engine.tokenizer)
    condense = compressor(engine, method="extractive")
    result = (
        condense.compress(segment(CHINESE, chat))
        if method == "extractive"
        else condense.tighten(segment(CHINESE, chat))
    )
    assert result.ok and len(result.token_ids) < len(chat.encode(CHINESE))
    assert "DD-20250318-7741" in result.text and "138-0013-8000" in result.text
    remaining = iter(CHINESE)  # only deletions: what is kept stands in the original's order
    assert all(character in remaining for character in result.text.replace(" ", ""))
