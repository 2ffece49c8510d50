"""Distinctive tokens: the words a compression must never lose or invent.

Numbers, codes, times, dates, amounts, emails, URLs, names, quoted identifiers and what
code names (paths, files, identifiers) carry the facts of a conversation ("order 88412",
"QX7-4821", "6:20 am", "March 1st", "$121", "Casa do Jardim", "No module named 'yaml'",
"run `make test`", "loader.py, line 14, in parse_row"). They are found by rules,
not by the model, so the check is the same for every model and cannot be argued with.
A distinctive *span* may cover several words ("6:20 am", "New York City", "Abbey Court
Hotel (Hyde Park)"); compressions keep every word a span touches.
"""

from __future__ import annotations

import regex

from clm_middleware.lifecycle.segmenter import UNSPACED_SCRIPTS

_MONTHS = (
    "january|february|march|april|may|june|july|august|september|october|november|december|"
    "jan|feb|mar|apr|jun|jul|aug|sep|sept|oct|nov|dec"
)
# month names of other languages, where a number stands next to them ("3. Mai 2025",
# "15 апреля", "le 3 mars", "3 de mayo", "١٥ أبريل", "१५ अप्रैल"): those spelt as in English
# are left to the English forms
_MONTHS_ABROAD = (
    "januar|februar|märz|mai|juni|juli|oktober|dezember|"  # German
    "janvier|février|mars|avril|juin|juillet|août|septembre|octobre|novembre|décembre|"  # French
    "enero|febrero|marzo|abril|mayo|junio|julio|agosto|septiembre|setiembre|octubre|noviembre|diciembre|"  # Spanish
    "janeiro|fevereiro|março|maio|junho|julho|setembro|outubro|novembro|dezembro|"  # Portuguese
    "gennaio|febbraio|aprile|maggio|giugno|luglio|settembre|ottobre|dicembre|"  # Italian
    "januari|februari|maart|mei|augustus|"  # Dutch
    "января|февраля|марта|апреля|мая|июня|июля|августа|сентября|октября|ноября|декабря|"  # Russian
    "январь|февраль|март|апрель|май|июнь|июль|август|сентябрь|октябрь|ноябрь|декабрь|"
    "يناير|فبراير|مارس|أبريل|ابريل|مايو|يونيو|يوليو|أغسطس|سبتمبر|أكتوبر|نوفمبر|ديسمبر|"  # Arabic
    "जनवरी|फ़रवरी|फरवरी|मार्च|अप्रैल|मई|जून|जुलाई|अगस्त|सितंबर|अक्टूबर|नवंबर|दिसंबर"  # Hindi
)
_CURRENCY_CODES = "usd|eur|gbp|chf|jpy|cny|rmb|inr|brl|ils|aud|cad|nzd|sek|nok|dkk|pln|czk|huf|zar|mxn|krw|sgd|hkd"
# digit groups with one separator between them ("1.500,00", "2'450.50"), possessive: a
# long run of "1'1'1'..." fails in one pass instead of backtracking through every split
_AMOUNT = r"\d++(?:[,.']\d++)*+"
_WEEKDAYS = "monday|tuesday|wednesday|thursday|friday|saturday|sunday"
_ORDINAL = r"\d{1,2}(?:st|nd|rd|th)"
_CAPITALISED = r"\p{Lu}[\p{Ll}\p{Lu}\p{N}'’-]*"
# letters of the scripts written with spaces between words (not Chinese or Japanese)
_SPACED = rf"[\p{{L}}--[{UNSPACED_SCRIPTS}]]"
_CONNECTOR = r"(?:of|de|do|da|del|la|le|du|von|van|by|the|and|&|y)"
_PATTERNS = [
    ("email", r"(?<![\w.+-])[\w.+-]++@[\w-]++(?:\.[\w-]++)+"),
    ("url", r"https?://\S+|www\.\S+"),
    # text in backticks, and one quoted identifier ('yaml', "config.json"): what a user or a
    # log names verbatim (a module, a flag, a file), lowercase or not
    ("literal", r"`[^`\n]{1,80}`|(?<![\w'\"])(?:'[\p{L}_][\w.\-/]{1,40}'|\"[\p{L}_][\w.\-/]{1,40}\")(?![\w'\"])"),
    # what code and logs name: a path ("/home/dana/etl/loader.py", "src/io.py", "C:\\logs"), a
    # dotted name ("loader.py", "csv.DictReader", "os.path.join()": a segment after a dot
    # has two characters or more, so "e.g" is none), a snake_case or camelCase identifier
    # ("parse_row", "KeyError", "parseRow") and a field list ("id;date;Amount;currency")
    (
        "identifier",
        r"(?<![\w/.~])(?:~|\.{1,2})?+(?:/[\w.\-]++){2,}+/?"
        r"|(?<![\w/.\-])[\w\-]++(?:/[\w\-]++)++\.\p{L}{1,5}\b"
        r"|\b\p{L}:\\[\w.\-]++(?:\\[\w.\-]++)*+\\?"
        r"|(?<![\w.])[\p{L}_]\w*+(?:\.[\p{L}_]\w++)++(?:\(\))?+(?!\w)"
        r"|(?<![\w.])_*+\p{L}[\p{L}\p{N}]*+(?:_++[\p{L}\p{N}]++)++_*+(?!\w)"
        r"|\b\p{Ll}++\p{Lu}[\p{L}\p{N}]*+\b|\b\p{Lu}\p{Ll}++(?:\p{Lu}[\p{Ll}\p{N}]*+)++\b"
        r"|(?<![\w;,|])[\p{L}_]\w*+(?:[;,|][\p{L}_]\w*+){2,}+(?![\w;,|])",
    ),
    ("time", r"(?i:\b\d{1,2}(?::\d{2})?\s?(?:[ap]\.?m\b\.?))|\b\d{1,2}:\d{2}\b"),
    # an amount with its currency: a sign before or after it ("$121", "₪ 249.90", "R$ 1.500,00",
    # "12 €") or a currency's code ("CHF 2'450.50", "1,200 euros")
    (
        "money",
        rf"(?:\b\p{{Lu}}{{1,3}}\$|\p{{Sc}})\s?{_AMOUNT}"
        rf"|(?i:\b(?:{_CURRENCY_CODES})\s?{_AMOUNT})"
        rf"|(?<![\d,.'])\b{_AMOUNT}(?:\s?\p{{Sc}}|(?i:\s?(?:euros?|dollars?|{_CURRENCY_CODES})\b))",
    ),
    ("extension", r"(?i:\bext\.?\s?\d{1,6}\b)"),  # of a phone number: "ext. 209"
    # a date and an amount as Chinese and Japanese write them: "2025年3月18日", "3月18日", "2380元"
    ("cjk_date", r"\d{1,4}年(?:\d{1,2}月(?:\d{1,2}日)?)?|\d{1,2}月\d{1,2}日"),
    ("cjk_money", rf"{_AMOUNT}\s?(?:元|円|块|圆)"),
    (
        "date",
        rf"(?i:\b(?:(?:{_MONTHS})\.?\s+{_ORDINAL}|(?:{_MONTHS})\.?\s+\d{{1,2}}\b|{_ORDINAL}\s+(?:of\s+)?(?:{_MONTHS})\b"
        rf"|{_ORDINAL}(?:\s+of\s+(?:this|next)\s+month)?\b"
        rf"|(?:(?:this|next|last)\s+)?(?:{_WEEKDAYS})\b(?:\s+(?:this|next|last)\s+week\b)?))",
    ),
    (
        "date_abroad",
        rf"(?i:(?<![\w.])\d{{1,2}}\.?\s+(?:de\s+)?(?:{_MONTHS_ABROAD})(?!\w)(?:\.?,?\s+(?:de\s+)?\d{{4}}(?!\w))?"
        rf"|(?<!\w)(?:{_MONTHS_ABROAD})\s+\d{{1,2}}(?!\w)(?:,?\s+\d{{4}}(?!\w))?)",
    ),
    # a code mixes letters and digits, or is a digit group with separators (QX7-4821, 2,400, 3.5).
    # Email and code start only where a word starts, and their runs are possessive: letters
    # and digits are disjoint classes, so giving characters back never helps a match, and a
    # long run without a digit or an "@" then fails in one pass instead of backtracking
    # through every split of it at every position (cubic time: a DoS on pasted text)
    # Its letters are those of scripts written with spaces: in Chinese or Japanese text a
    # code starts and ends where the script changes ("订单号是DD-20250318-7741" holds
    # "DD-20250318-7741", not the whole clause)
    (
        "code",
        rf"(?<![{_SPACED}\p{{N}}]|[{_SPACED}\p{{N}}][-_/])(?:{_SPACED}++[-_/]?)*+\p{{N}}++"
        rf"(?:[-_/.:,]?[{_SPACED}\p{{N}}]++)*+",
    ),
    ("name", rf"(?:(?:Mr|Mrs|Ms|Dr|Prof|St)\.\s+)?{_CAPITALISED}(?:\s+(?:{_CONNECTOR}\s+)*\(?{_CAPITALISED}\)?)*"),
]
_TOKEN = regex.compile("|".join(f"(?P<{name}>{pattern})" for name, pattern in _PATTERNS), regex.V1)
_RUN_WORD = regex.compile(r"\S+")
_CONNECTOR_WORD = regex.compile(rf"^{_CONNECTOR}$")
_LEADING_CONNECTORS = regex.compile(rf"(?:\s+{_CONNECTOR}\b)*\s+\(?")
_MONTH_OR_DAY = regex.compile(rf"^(?:{_MONTHS}|{_WEEKDAYS})$", regex.IGNORECASE)
_SENTENCE_LOOKBACK = 64  # characters: punctuation, a quote and the spaces between them and a name
_SENTENCE_START = regex.compile(r"(?:^|[.!?…:;\n]\s*|[.!?…:;\n]\s*[\"“]\s*|^[\"“]\s*)$")
_COMMON_CAPITALISED = frozenset(
    [
        "I",
        "I'm",
        "I've",
        "I'll",
        "I'd",
        "OK",
        "Ok",
        "Okay",
        "Yes",
        "No",
        "Hi",
        "Hello",
        "Hey",
        "Thanks",
        "Please",
        "Sorry",
        "Sure",
        "The",
        "A",
        "An",
        "Oh",
        "Bye",
        "Goodbye",
        "Thank",
        "Great",
        "Perfect",
        "Awesome",
    ]
)


def distinctive_spans(text: str) -> list[tuple[int, int]]:
    """Character spans of the distinctive tokens of ``text``, in order."""
    spans = []
    for match in _TOKEN.finditer(text):
        kind, value = match.lastgroup, match.group()
        if kind == "name":
            span = _name_span(text, match)
            if span is not None:
                spans.append(span)
            continue
        if kind == "code" and not any(ch.isdigit() for ch in value):
            continue
        spans.append((match.start(), match.end()))
    return spans


def _name_span(text: str, match: regex.Match[str]) -> tuple[int, int] | None:
    """A capitalised run is a name once common words ("I", "Thanks") are cut from its
    ends, unless what is left is one word opening a sentence ("Can I" is grammar)."""
    words = list(_RUN_WORD.finditer(match.group()))
    first, last = 0, len(words)
    while first < last and bare_word(words[first].group()) in _COMMON_CAPITALISED:
        first += 1
    while last > first and bare_word(words[last - 1].group()) in _COMMON_CAPITALISED:
        last -= 1
    if first == last:
        return None
    base = match.start()
    start, end = base + words[first].start(), base + words[last - 1].end()
    opens_sentence = bool(_SENTENCE_START.search(_tail_before(text, start)))
    if last - first == 1:
        if opens_sentence and not _MONTH_OR_DAY.match(bare_word(words[first].group())):
            return None  # a capitalised first word is grammar, not a name
        return start, end
    if opens_sentence and _CONNECTOR_WORD.match(words[first + 1].group()):
        # "Try the Abbey Court" keeps "Abbey Court" (a verb opened the sentence)
        rest = _LEADING_CONNECTORS.match(text, start + len(words[first].group()))
        start = rest.end() if rest else start
    return (start, end) if start < end else None


def _tail_before(text: str, start: int) -> str:
    """The text just before ``start``, as far as ``_SENTENCE_START`` needs to look: searching
    the whole prefix for every name would make a long run of names quadratic. A window
    that does not reach the text's start gets a word character first, so ``^`` cannot match."""
    if start <= _SENTENCE_LOOKBACK:
        return text[:start]
    return "x" + text[start - _SENTENCE_LOOKBACK : start]


def bare_word(word: str) -> str:
    """``word`` without the punctuation around it (case kept)."""
    return word.strip(".,;:!?()[]\"'’”“")


def folded_word(word: str) -> str:
    """``bare_word`` case-folded: how the word lists (function words, negators) compare a word."""
    return bare_word(word).casefold()


def distinctive_tokens(text: str) -> set[str]:
    """The distinctive tokens of ``text``, normalised (case-folded, outer punctuation cut)."""
    return {normalise(text[start:end]) for start, end in distinctive_spans(text)}


def normalise(token: str) -> str:
    return token.casefold().strip(".,;:!?)(\"'’”“ ")


def has_distinctive(text: str) -> bool:
    return bool(distinctive_spans(text))


def missing_from(required: set[str], text: str) -> set[str]:
    """Which of ``required`` do not occur in ``text`` (case-insensitive substring match)."""
    haystack = text.casefold()
    return {token for token in required if token not in haystack}


def unstated(facts: set[str], text: str) -> set[str]:
    """Which of ``facts`` ``text`` states neither as written (``missing_from``) nor as the
    same words in the same order, however joined: a reply that runs two sentences together
    ("Je ne sais pas.Bien sûr", read as a dotted name) states no fact that "pas. Bien"
    does not. Stricter matching is the compressor's (``missing_from``): a summary keeps a
    token as written."""
    missing = missing_from(facts, text)
    if not missing:
        return missing
    words = f" {_words(text)} "
    return {fact for fact in missing if f" {_words(fact)} " not in words}


def _words(text: str) -> str:
    return " ".join(regex.findall(r"\w+", text.casefold()))
