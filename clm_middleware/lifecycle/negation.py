"""Negations a word-deleting compression must carry along.

A compression that deletes words may say less, never something else; deleting a "not"
says the opposite ("I'm not available on Tuesday" → "available Tuesday", "Don't call
me, text only" → "call text"). So a negator is kept whenever anything it governs is
kept, and with it the words it negates ("not available Tuesday"), and a negator kept
on its own brings them too.

A negator's **scope** runs from the word after it to the end of its clause: a word
ending in ``, ; : . ! ?``, or the word before "but", "though", "although", "however" or
"yet". The words it negates are the first few of the scope that are not function words
("not *comfortable* with very *crowded* *trains*", "never *suggest* anything with
*nuts*"), and the small words between them when the clause is short: a dropped
"before" or "only" changes what is negated. Two-word negators ("no longer", "no more")
count as one.
By word lists: English, and the common negators of Portuguese, Spanish, French, German
and Italian (a negator, not the grammar: "Não quero refrigerante" keeps its "Não").
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

from clm_middleware.lifecycle.distinctive import folded_word

_NEGATORS = frozenset(
    [
        "not",
        "no",
        "never",
        "nor",
        "neither",
        "none",
        "nobody",
        "nothing",
        "nowhere",
        "without",
        "except",
        "cannot",
        "dont",
        "doesnt",
        "didnt",
        "isnt",
        "arent",
        "wasnt",
        "werent",
        "wont",
        "wouldnt",
        "cant",
        "couldnt",
        "shouldnt",
        "havent",
        "hasnt",
        "hadnt",
        "mustnt",
        "neednt",
        "aint",
        # the negators of the other languages people chat in most here (Portuguese,
        # Spanish, French, German, Italian): "Não quero refrigerante" condensed to
        # "quero refrigerante" said the opposite
        *("não", "nem", "nunca", "nada", "nenhum", "nenhuma", "ninguém", "sem", "jamais"),
        *("ni", "ningún", "ninguno", "ninguna", "nadie", "sin", "jamás", "tampoco"),
        *("ne", "pas", "rien", "aucun", "aucune", "sans"),
        *("nicht", "kein", "keine", "keinen", "keinem", "keiner", "nie", "niemals", "nichts", "niemand", "ohne"),
        *("non", "mai", "niente", "nulla", "nessuno", "nessuna", "senza"),
    ]
)
NEGATED_WORDS = 3  # the words of a negated clause carried with its negator: what it says is not so
NEGATED_SPAN = 8  # a negated clause up to this many words is kept as said, its small words too
_SECOND_WORDS = frozenset({"longer", "more"})  # "no longer", "no more": one negator
_CLAUSE_ENDS = (",", ";", ":", ".", "!", "?")
_SCOPE_BREAKS = frozenset({"but", "though", "although", "however", "yet"})
_APOSTROPHES = str.maketrans("", "", "'’")


def is_negator(word: str) -> bool:
    """ "not", "never", "without", "don't", "can’t", "isn't" ...: a word that turns what
    follows it into its opposite."""
    return folded_word(word).translate(_APOSTROPHES) in _NEGATORS


def has_negation(text: str) -> bool:
    return any(is_negator(word) for word in text.split())


def negation_scopes(words: Sequence[str]) -> list[tuple[list[int], list[int]]]:
    """For each negator of ``words`` (in order): the indices of the negator (one or two
    words) and of its scope."""
    scopes: list[tuple[list[int], list[int]]] = []
    index = 0
    while index < len(words):
        if not is_negator(words[index]):
            index += 1
            continue
        negator = [index]
        if (
            folded_word(words[index]) == "no"
            and not words[index].endswith(_CLAUSE_ENDS)
            and index + 1 < len(words)
            and folded_word(words[index + 1]) in _SECOND_WORDS
        ):
            negator.append(index + 1)
        scope: list[int] = []
        position = negator[-1]
        while not words[position].endswith(_CLAUSE_ENDS) and position + 1 < len(words):
            position += 1
            if folded_word(words[position]) in _SCOPE_BREAKS:
                break
            scope.append(position)
        scopes.append((negator, scope))
        index = negator[-1] + 1
    return scopes


def with_negations(words: Sequence[str], kept: Iterable[int], is_function_word: Callable[[str], bool]) -> set[int]:
    """``kept`` (indices into ``words``) and, for each negator whose scope has a kept word
    or which is kept itself: the negator and the first ``NEGATED_WORDS`` words of its
    scope that are not function words (none in "a no for me"), with every word between
    when that span and the scope's kept words lie within ``NEGATED_SPAN`` words ("Don't
    book anything before 10 am", not "Don't book 10 am"); and the word that ends its
    clause when a later word is kept ("Don't call me, text" rather than "Don't call text")."""
    result = set(kept)
    for negator, scope in negation_scopes(words):
        if not (result.intersection(negator) or result.intersection(scope)):
            continue
        negated = [i for i in scope if not is_function_word(words[i])][:NEGATED_WORDS]
        last = max([i for i in scope if i in result] + negated, default=negator[-1])
        if last - negator[0] < NEGATED_SPAN:  # the clause as said, up to its last kept word
            result.update(range(negator[0], last + 1))
        else:
            result.update(negator + negated)
        end = scope[-1] if scope else negator[-1]
        if words[end].endswith(_CLAUSE_ENDS) and any(i > end for i in result):
            result.add(end)  # the clause's end, so that what follows is not read as negated
    return result
