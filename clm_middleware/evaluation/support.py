"""Technical-support chats: a customer and an agent troubleshooting one device over several contacts.

Facts are the details a real support chat turns on: error codes (``E-4471``), firmware
versions, serial numbers, IP addresses, the step a guide failed at, a purchase date and
an internet provider (said by the customer); a ticket number, a config key to change, a
port to forward, how long to hold reset (inside a numbered list), a callback time and a
backup job's name (said by the agent). Each is one sentence inside a longer message;
later the customer asks back for it ("what was that config key?"), and the agent looks
it up without repeating it, so the answer stays in exactly one message (``weave``
checks it). Every value is drawn from the seed; filler holds no digits.
"""

from __future__ import annotations

import random
import string
from collections.abc import Callable

from clm_middleware.evaluation import support_words as words
from clm_middleware.evaluation.generated import Deck, Fact, Script, join, ordinal_date, weave
from clm_middleware.evaluation.sessions import Session

DEFAULT_TURNS = 90  # user turns: 180 messages, ~7.6k tokens, under SmolLM2's 8,192 positions
DEFAULT_SESSIONS = 3

# key -> (who says it, value maker, statement with {v}, recall, probe question with {p} the product)
_Maker = Callable[[random.Random], str]
_FACTS: dict[str, tuple[str, _Maker, str, str, str]] = {
    "error": (
        "user",
        lambda r: f"E-{r.randint(1000, 9999)}",
        "Every time it drops out, the app shows error {v} and the light goes amber.",
        "Sorry, what was the error code I gave you at the start? I need it for a form.",
        "What error code did the {p} show?",
    ),
    "firmware": (
        "user",
        lambda r: f"{r.randint(2, 5)}.{r.randint(0, 19)}.{r.randint(1, 40)}",
        "According to the about screen it's running firmware {v}, if that helps.",
        "Which firmware version did I say I was on?",
        "Which firmware version was the {p} running?",
    ),
    "serial": (
        "user",
        lambda r: f"{_letters(r, 3)}-{r.randint(10000, 99999)}-{_letters(r, 1)}",
        "The serial number on the sticker underneath is {v}.",
        "Can you remind me of the serial number I read out earlier?",
        "What is the serial number of the customer's {p}?",
    ),
    "ip": (
        "user",
        lambda r: f"192.168.{r.randint(2, 99)}.{r.randint(2, 250)}",
        "On the router page it shows up at {v}, I checked just now.",
        "What was the IP address I found on the router page?",
        "What IP address did the {p} have on the customer's network?",
    ),
    "step": (
        "user",
        lambda r: f"step {r.randint(4, 9)}",
        "I followed the reset guide on your website but got stuck at {v}, where it asks for an admin PIN.",
        "Which step of the guide did I say I got stuck on?",
        "At which step of the reset guide did the customer get stuck?",
    ),
    "bought": (
        "user",
        lambda r: f"{r.choice(words.MONTHS)} {r.randint(2, 28)}",
        "I bought it on {v} from your online store, so it should still be under warranty.",
        "When did I tell you I bought it? The warranty form asks.",
        "When did the customer buy the {p}?",
    ),
    "provider": (
        "user",
        lambda r: r.choice(words.PROVIDERS),
        "My internet provider is {v}, in case that matters.",
        "Did I tell you who my internet provider is? Which one did I say?",
        "Who is the customer's internet provider?",
    ),
    "hostname": (
        "user",
        lambda r: "-".join(r.choice(p) for p in words.HOSTNAME_PARTS) + f"-{r.randint(10, 99)}",
        "I renamed it {v} so I could find it on the network more easily.",
        "What did I say I named the device on the network?",
        "What hostname did the customer give the {p}?",
    ),
    "ticket": (
        "assistant",
        lambda r: f"TCK-{r.randint(10000, 99999)}",
        "I've opened ticket {v} for this, so you won't have to explain everything again.",
        "What was my ticket number again? I didn't write it down.",
        "What ticket number did the agent open?",
    ),
    "config": (
        "assistant",
        lambda r: r.choice(words.CONFIG_KEYS),
        "In the advanced settings, please set {v} to " + "{setting}" + " and save.",
        "What was the name of that setting you told me to change?",
        "Which config key did the agent ask the customer to change?",
    ),
    "port": (
        "assistant",
        lambda r: str(r.choice([5001, 6543, 7443, 8443, 8880, 9091])),
        "Also make sure port {v} is forwarded on your modem, otherwise remote access won't work.",
        "Which port did you say needs forwarding?",
        "Which port did the agent say must be forwarded?",
    ),
    "reset": (
        "assistant",
        lambda r: f"{r.choice([12, 15, 20, 25, 40])} seconds",
        "steps:Unplug every cable except power|Press and hold the reset button for {v}"
        "|Wait until the light blinks white|Set it up again in the app",
        "How long was I supposed to hold the reset button?",
        "How long should the reset button of the {p} be held?",
    ),
    "callback": (
        "assistant",
        lambda r: f"{r.randint(9, 16)}:{r.choice(['05', '20', '35', '50'])}",
        "A technician can call you tomorrow at {v}, does that work for you?",
        "What time did you say the technician would call?",
        "At what time will the technician call the customer back?",
    ),
    "backup": (
        "assistant",
        lambda r: r.choice(words.BACKUP_JOBS),
        "Your nightly backup job is called {v} on our side, and it last finished without errors.",
        "What was the name of my backup job again?",
        "What is the name of the customer's nightly backup job?",
    ),
}


def support_session(
    *, user_turns: int = DEFAULT_TURNS, facts: int = len(_FACTS), sessions: int = DEFAULT_SESSIONS, seed: int = 0
) -> Session:
    """A seeded support chat with ``facts`` facts (at most one per kind) and their probes."""
    if not 1 <= facts <= len(_FACTS):
        raise ValueError(f"facts: between 1 and {len(_FACTS)}")
    rng = random.Random(seed)
    product, agent, customer = (rng.choice(pool) for pool in (words.PRODUCTS, words.AGENTS, words.CUSTOMERS))
    chosen = [_fact(rng, key, product) for key in rng.sample(sorted(_FACTS), facts)]
    decks = _Decks(rng)
    script = Script(
        facts=chosen,
        exchange=lambda: _exchange(rng, decks),
        embed=lambda statement, speaker: _embed(rng, decks, statement, speaker),
        reply=lambda: _agent_message(rng, decks),
        recall_reply=decks.recall.draw,
        session_header=lambda n: _header(rng, n, agent, customer, product),
        system=f"You are {agent}, a support agent for the {product}.",
    )
    session = weave(rng, script, user_turns=user_turns, sessions=sessions, min_gap=max(10, user_turns // 4))
    origin = {"generator": "support", "seed": seed, "turns": user_turns, "facts": facts, "sessions": sessions}
    return Session(session.messages, session.probes, origin=origin)


class _Decks:
    def __init__(self, rng: random.Random) -> None:
        self.symptoms, self.context = Deck(rng, words.SYMPTOMS), Deck(rng, words.CONTEXT)
        self.acks, self.explanations = Deck(rng, words.USER_ACKS), Deck(rng, words.EXPLANATIONS)
        self.questions, self.empathy = Deck(rng, words.AGENT_QUESTIONS), Deck(rng, words.EMPATHY)
        self.steps, self.closers = Deck(rng, words.STEP_LISTS), Deck(rng, words.CLOSERS)
        self.recall = Deck(rng, words.RECALL_REPLIES)


def _fact(rng: random.Random, key: str, product: str) -> Fact:
    speaker, make, statement, recall, question = _FACTS[key]
    value, alternatives = make(rng), ()
    if key == "bought":
        month, day = value.split()
        value, alternatives = ordinal_date(month, int(day))
    text = statement.format(v=value, setting=rng.choice(words.SETTINGS))
    if text.startswith("steps:"):
        text = _numbered(text.removeprefix("steps:").split("|"))
    return Fact(key, text, recall, question.format(p=product), value, alternatives, speaker)


def _numbered(steps: list[str]) -> str:
    return "\n".join(f"{number}. {step}." for number, step in enumerate(steps, start=1))


def _exchange(rng: random.Random, decks: _Decks) -> tuple[str, str]:
    kind = rng.random()
    if kind < 0.3:
        return decks.acks.draw(), _agent_message(rng, decks)
    user = [decks.symptoms.draw()] + ([decks.context.draw()] if rng.random() < 0.6 else [])
    return join(user), _agent_message(rng, decks)


def _agent_message(rng: random.Random, decks: _Decks) -> str:
    parts = [decks.empathy.draw(), *decks.explanations.take(rng.choice((1, 1, 2)))]
    if rng.random() < 0.2:
        parts.append("Could you try this for me:\n" + _numbered(list(decks.steps.draw())) + "\n")
    parts.append(decks.questions.draw() if rng.random() < 0.6 else decks.closers.draw())
    return join(parts)


def _embed(rng: random.Random, decks: _Decks, statement: str, speaker: str) -> str:
    """A long message around the fact sentence, in the voice of whoever states it."""
    if speaker == "user":
        before = decks.symptoms.draw() if rng.random() < 0.5 else decks.context.draw()
        return join([before, statement, decks.context.draw()])
    if statement.startswith("1."):  # a numbered list: the agent leads into it and closes after it
        return join([decks.empathy.draw(), decks.explanations.draw(), f"Here is what to do:\n{statement}\n"])
    return join([decks.empathy.draw(), decks.explanations.draw(), statement, decks.closers.draw()])


def _header(rng: random.Random, number: int, agent: str, customer: str, product: str) -> str:
    if number == 1:
        return f"Hi, I'm {customer}. I'm having trouble with my {product}."
    return f"{rng.choice(words.REOPEN)}\n\nHi {agent}, it's {customer} again, about the {product}."


def _letters(rng: random.Random, count: int) -> str:
    return "".join(rng.choice(string.ascii_uppercase) for _ in range(count))
