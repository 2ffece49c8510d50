"""Planted-fact transcripts: a long chat with facts stated once, and a question about each at the end.

Each fact (a code, a name, a date, an amount...) is stated once by the user, early,
inside ordinary text; the assistant acknowledges it without repeating it, so the fact
lives in exactly one place. Between facts come filler: questions with long background
answers, small talk and acknowledgements. The last turns ask about each fact, with
neutral replies that do not leak the answer. Everything is drawn from ``seed``.
"""

from __future__ import annotations

import random
import string
from dataclasses import dataclass

from clm_middleware.evaluation.probes import Probe

_FACTS = [
    (
        "locker",
        "My gym locker code is {value}, in case I forget it.",
        "What is my gym locker code?",
        lambda r: f"{r.randint(1000, 9999)}",
    ),
    (
        "booking",
        "The booking reference for the flight is {value}.",
        "What was the flight booking reference?",
        lambda r: f"{_letters(r, 2)}{r.randint(1, 9)}-{r.randint(1000, 9999)}",
    ),
    (
        "doctor",
        "My new doctor is called Dr. {value} and she is very kind.",
        "What is my new doctor's name?",
        lambda r: r.choice(
            [
                "Okafor",
                "Lindqvist",
                "Haddad",
                "Moreau",
                "Tanaka",
                "Kowalski",
                "Ferreira",
                "Nakamura",
            ]
        ),
    ),
    (
        "email",
        "You can reach my landlord at {value} if anything breaks.",
        "What is my landlord's email address?",
        lambda r: (
            f"{r.choice(['ana', 'tom', 'lee', 'sam'])}.{r.choice(['ortiz', 'berg', 'chen', 'silva'])}@{r.choice(['mailbox', 'postly', 'inbox'])}.org"
        ),
    ),
    (
        "appointment",
        "The dentist appointment is on {value}, please keep that in mind.",
        "When is the dentist appointment?",
        lambda r: f"{r.choice(['March', 'April', 'May', 'June'])} {r.randint(2, 28)}",
    ),
    (
        "amount",
        "The deposit we agreed on was {value} euros.",
        "How much was the agreed deposit?",
        lambda r: f"{r.randint(11, 99) * 25}",
    ),
    (
        "room",
        "Our meeting moved to room {value} on the third floor.",
        "Which room did the meeting move to?",
        lambda r: f"{r.choice('ABCD')}-{r.randint(100, 399)}",
    ),
    (
        "phone",
        "The plumber's phone number is {value}.",
        "What is the plumber's phone number?",
        lambda r: f"{r.randint(200, 899)}-{r.randint(100, 999)}-{r.randint(1000, 9999)}",
    ),
    (
        "wifi",
        "The wifi password at the cabin is {value}.",
        "What is the wifi password at the cabin?",
        lambda r: f"{_letters(r, 4).lower()}{r.randint(10, 99)}{_letters(r, 2)}",
    ),
    (
        "time",
        "The train to the coast leaves at {value} sharp.",
        "When does the train to the coast leave?",
        lambda r: f"{r.randint(6, 11)}:{r.choice(['05', '15', '25', '35', '45', '55'])}",
    ),
    (
        "pet",
        "Our neighbour's cat is named {value}, she sometimes visits.",
        "What is the neighbour's cat called?",
        lambda r: r.choice(["Biscuit", "Marzipan", "Pixel", "Clementine", "Noodle", "Saffron"]),
    ),
    (
        "plate",
        "My rental car has the licence plate {value}.",
        "What is the rental car's licence plate?",
        lambda r: f"{_letters(r, 3)} {r.randint(100, 999)}",
    ),
]

_FILLER_QUESTIONS = [
    (
        "What is a good way to start running again after a long break?",
        "Start slowly with run-walk intervals three times a week, and add a few minutes each week. Your joints and tendons adapt more slowly than your lungs, so patience pays off.",
    ),
    (
        "Can you explain why the sky looks blue during the day?",
        "Sunlight scatters off air molecules, and shorter blue wavelengths scatter much more than red ones. So blue light reaches your eyes from every direction of the sky, while at sunset the long path through air leaves mostly reds and oranges.",
    ),
    (
        "How do I keep basil alive on a windowsill?",
        "Give it at least six hours of light, water when the top of the soil feels dry, and pinch off the flower buds. Regular trimming above a pair of leaves makes it bushier.",
    ),
    (
        "What should I read if I liked long historical novels?",
        "You might enjoy sweeping family sagas or novels set during big historical changes. Pick one with a strong narrator, and give it fifty pages before deciding.",
    ),
    (
        "Is it better to rent or buy a house in general?",
        "It depends on how long you will stay, local prices and your savings. Buying tends to pay off over many years; renting keeps you flexible and avoids maintenance costs.",
    ),
    (
        "How can I make my mornings less rushed?",
        "Prepare what you can the evening before, like clothes and breakfast, and keep a fixed wake-up time. Doing the most important task first also helps the day feel calmer.",
    ),
    (
        "Why do onions make people cry?",
        "Cutting an onion breaks its cells and releases enzymes that form a volatile sulfur compound. It reaches your eyes and irritates them, so they produce tears to wash it away.",
    ),
    (
        "What are some easy dinners for a busy week?",
        "Sheet-pan vegetables with chickpeas, a big pot of soup, stir-fries and pasta with a simple sauce all work well. Cooking a double batch gives you lunch for the next day.",
    ),
    (
        "How often should I back up my laptop?",
        "Weekly is a good minimum, daily if you work on important files. Keep one copy on an external drive and another off-site or in the cloud.",
    ),
    (
        "Tell me something interesting about octopuses.",
        "Octopuses have three hearts and blue blood, and most of their neurons sit in their arms. Each arm can taste and react on its own.",
    ),
    (
        "How do I get better at remembering names?",
        "Repeat the name when you hear it, link it to something memorable about the person, and use it once more before you part. Writing it down later helps too.",
    ),
    (
        "What is the difference between weather and climate?",
        "Weather is what the atmosphere does over hours and days; climate is the long-term pattern over decades. One cold week says little about the climate.",
    ),
    (
        "Any tips for sleeping better?",
        "Keep a regular schedule, a dark and cool room, and screens away for the last hour. Caffeine late in the day and heavy meals at night often get in the way.",
    ),
    (
        "Why do cats purr?",
        "Cats purr when content, but also when stressed or healing. The vibration comes from rapid twitching of muscles in the larynx.",
    ),
    (
        "How can I learn to cook without recipes?",
        "Master a few techniques like sautéing, roasting and making a pan sauce, then vary the ingredients. Taste as you go and adjust salt, acid and heat.",
    ),
    (
        "What makes a good cup of coffee at home?",
        "Fresh beans, a burr grinder, water just off the boil and the right ratio, about one to sixteen. Clean equipment matters more than people think.",
    ),
]

_STORIES = [
    "We finally visited the botanical garden on Sunday, and the glasshouses were warmer than expected, full of ferns and orchids and a huge water lily pond. A volunteer showed us how they pollinate some of the plants by hand with a small brush, which I had never seen before, and we ended the afternoon in the café reading about the history of the place.",
    "I tried to fix the squeaky door in the hallway with some oil, but it only got quieter for a day before the noise came back. Then I took the hinge apart, cleaned off years of dust, and put it back with a bit of grease, and now it opens silently, which honestly made me happier than it should have.",
    "Last weekend we walked along the old canal path, which was much longer than I remembered, and we ended up at a little bakery that had just opened. The owner told us about the building, which used to be a printing shop, and we stayed for almost an hour talking about bread and old machines.",
    "I spent most of yesterday sorting out the garage, which had become a mess of boxes, bikes and garden tools. It felt good to give away things we never use, although it took far longer than planned because every box held some old memory.",
    "My sister is thinking about changing jobs, and we talked for a long time about what matters more, the salary or the people you work with. She likes her team a lot but feels she stopped learning anything new there a year ago.",
    "The neighbours are renovating their kitchen and the noise starts every morning at eight. They apologised and brought cookies, which was nice, but I still work from home most days and it makes calls rather difficult.",
]

_ELABORATIONS = [
    "If you want, we can go through it step by step, and I can suggest a simple plan for the next few weeks that fits around your other commitments.",
    "Small, regular changes usually work better than big resolutions, so pick the easiest part to start with and build from there once it feels natural.",
    "It also helps to write down what you try and how it goes, because patterns become much easier to see after a couple of weeks of notes.",
    "Different sources give slightly different advice on the details, but the general idea is well established and a good place to begin.",
]
_ACKS = ["ok thanks", "cool", "great, thanks", "ok", "thanks!", "nice", "got it", "sounds good"]
_ACK_REPLIES = ["You're welcome.", "Glad to help.", "Happy to help.", "Anytime."]
_FACT_REPLIES = [
    "Got it, I'll keep that in mind.",
    "Noted.",
    "Thanks, noted for later.",
    "Understood, I have noted that.",
]
_QUESTION_REPLIES = [
    "Let me look back at what you told me.",
    "Let me check my notes on that.",
    "One moment, let me recall that.",
]


@dataclass(frozen=True, slots=True)
class PlantedTranscript:
    messages: list[dict[str, str]]
    probes: list[Probe]


def planted_transcript(
    *,
    user_turns: int = 60,
    facts: int = 10,
    seed: int = 0,
    system: str | None = "You are a helpful assistant.",
) -> PlantedTranscript:
    """A ``user_turns``-turn chat with ``facts`` planted facts and a question about each at the end."""
    if not 1 <= facts <= len(_FACTS):
        raise ValueError(f"facts must be between 1 and {len(_FACTS)}")
    if user_turns < 2 * facts + 2:
        raise ValueError(f"user_turns must be at least {2 * facts + 2} for {facts} facts")
    rng = random.Random(seed)
    chosen = rng.sample(_FACTS, facts)
    values = [make(rng) for _, _, _, make in chosen]
    body_turns = user_turns - facts  # the last `facts` turns ask the questions
    # facts go in the first 60% of the body, never in the last few turns before the questions
    slots = sorted(rng.sample(range(1, max(facts + 1, int(body_turns * 0.6))), facts))
    messages: list[dict[str, str]] = [{"role": "system", "content": system}] if system else []
    fact_at = dict(zip(slots, range(facts), strict=True))
    for turn in range(body_turns):
        if turn in fact_at:
            index = fact_at[turn]
            sentence = chosen[index][1].format(value=values[index])
            lead = rng.choice(["Oh, before I forget.", "One more thing.", "By the way.", "Quick note."])
            messages += [
                {"role": "user", "content": f"{lead} {sentence}"},
                {"role": "assistant", "content": rng.choice(_FACT_REPLIES)},
            ]
            continue
        kind = rng.random()
        if kind < 0.15:
            messages += [
                {"role": "user", "content": rng.choice(_ACKS)},
                {"role": "assistant", "content": rng.choice(_ACK_REPLIES)},
            ]
        elif kind < 0.5:
            messages += [
                {"role": "user", "content": rng.choice(_STORIES)},
                {"role": "assistant", "content": "That sounds like quite a day."},
            ]
        else:
            question, answer = rng.choice(_FILLER_QUESTIONS)
            answer = f"{answer} {rng.choice(_ELABORATIONS)}"
            messages += [
                {"role": "user", "content": question},
                {"role": "assistant", "content": answer},
            ]
    order = list(range(facts))
    rng.shuffle(order)
    probes = []
    for index in order:
        question = chosen[index][2]
        messages += [
            {"role": "user", "content": question},
            {"role": "assistant", "content": rng.choice(_QUESTION_REPLIES)},
        ]
        probes.append(Probe(question, values[index]))
    return PlantedTranscript(messages, probes)


def _letters(rng: random.Random, count: int) -> str:
    return "".join(rng.choice(string.ascii_uppercase) for _ in range(count))
