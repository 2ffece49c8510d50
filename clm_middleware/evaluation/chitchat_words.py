"""Vocabulary of the chit-chat generator, written for this project (no external data).

Invariants the tests check: no fact value occurs, as a whole word, in any filler
sentence, header, persona name or other pool's value (so a probe's answer lives only in
the message that states it); filler holds no digits (so no number fact can leak); fact
pools are disjoint. Pet names, hobbies, jobs and foods are lowercase on purpose: value
rules that look for capitals or digits miss them.
"""

from __future__ import annotations

# (key, values, statements with {v}, recall questions, probe question with {name})
FACTS: tuple[tuple[str, tuple[str, ...], tuple[str, ...], tuple[str, ...], str], ...] = (
    (
        "dog",
        ("biscuit", "pickle", "waffles", "mochi", "pretzel", "noodle", "turnip", "bramble"),
        (
            "We had to rush our dog {v} to the vet on Tuesday because he ate half a sock, he's fine now.",
            "Our dog {v} has decided the postman is his mortal enemy, so mornings are loud.",
            "My partner keeps sneaking {v}, our dog, bits of cheese under the table and thinks I don't notice.",
        ),
        ("Bet you don't remember what our dog is called.", "Quick test: what's the name of my dog again?"),
        "What is the name of {name}'s dog?",
    ),
    (
        "cat",
        ("pepper", "saffron", "marzipan", "dumpling", "hazel", "button", "sprout"),
        (
            "The cat, {v}, has started sleeping in the laundry basket, clean laundry only of course.",
            "Our old cat {v} knocked a whole plant off the windowsill at three in the morning.",
        ),
        ("Do you still remember my cat's name? I feel like I told you.",),
        "What is {name}'s cat called?",
    ),
    (
        "hobby",
        ("bouldering", "pottery", "birdwatching", "woodturning", "fencing", "beekeeping", "calligraphy"),
        (
            "I signed up for {v} on Thursday evenings, mostly to get away from screens for a bit.",
            "Lately I've been really into {v}, which I know sounds random for me.",
            "A friend dragged me to try {v} and I'm annoyingly hooked already.",
        ),
        ("What was that new hobby I told you I'd picked up? I'm curious if you remember.",),
        "Which hobby did {name} take up?",
    ),
    (
        "job",
        ("radiographer", "cartographer", "sommelier", "arborist", "actuary", "luthier", "archivist"),
        (
            "I still can't believe I've been working as a {v} for this long, it was meant to be temporary.",
            "People always look confused when I say I'm a {v}, and then they ask a million questions.",
        ),
        ("Do you even remember what I do for a living? Be honest.",),
        "What does {name} do for a living?",
    ),
    (
        "employer",
        ("Harlow & Finch", "Brightwater Labs", "Kestrel Analytics", "Old Mill Press", "Tidewater Freight"),
        (
            "The new place, {v}, has a much nicer office than my last job, there's even a roof terrace.",
            "Everyone at {v} seems to bring their dog to work, which is honestly the best perk.",
        ),
        ("Where did I say I work now? I've changed jobs so often I'd understand if you forgot.",),
        "Which company does {name} work for?",
    ),
    (
        "trip",
        ("Ljubljana", "Tbilisi", "Porto", "Oaxaca", "Trondheim", "Cusco", "Tallinn", "Matera"),
        (
            "We're thinking of going to {v} in the spring, my cousin says it's gorgeous and not too touristy.",
            "I've already started a list of cafés to try in {v}, even though the trip is ages away.",
        ),
        ("Where was I going on holiday again? I keep telling people different places.",),
        "Where is {name} planning to travel?",
    ),
    (
        "birthday",
        ("March 14", "June 3", "September 22", "November 8", "April 29", "July 17", "January 11"),
        (
            "My birthday is on {v}, and I'm already dreading the office singing.",
            "I'll probably do something small on {v}, my birthday, just dinner with a few people.",
        ),
        ("Do you remember when my birthday is? No pressure.",),
        "When is {name}'s birthday?",
    ),
    (
        "sister",
        ("Ingrid", "Priya", "Rosalind", "Marisol", "Yevgenia", "Oona", "Beatriz"),
        (
            "My sister {v} is moving in with us for a month while her flat gets repaired.",
            "My sister {v} called me for two hours last night about her new boyfriend.",
        ),
        ("What's my sister's name again? You met her once, I think.",),
        "What is the name of {name}'s sister?",
    ),
    (
        "neighbour",
        ("Desmond", "Tomasz", "Ezekiel", "Lorcan", "Anselm", "Caspian", "Thaddeus"),
        (
            "Our neighbour {v} lent me his ladder and then stayed for an hour telling me about his roses.",
            "The guy next door, {v}, plays the trumpet every Sunday morning, badly.",
        ),
        ("Remember my neighbour, the one I complained about? What was his name?",),
        "What is the name of {name}'s neighbour?",
    ),
    (
        "food",
        ("shakshuka", "pierogi", "laksa", "tamales", "bibimbap", "khachapuri", "gnocchi"),
        (
            "If I could only eat one thing forever it would be {v}, no contest.",
            "I made {v} from scratch for the first time and it was a total mess but delicious.",
        ),
        ("Do you remember my all-time favourite food?",),
        "What is {name}'s favourite food?",
    ),
    (
        "instrument",
        ("cello", "banjo", "accordion", "ukulele", "clarinet", "harmonica", "mandolin"),
        (
            "I dug my old {v} out of the attic and it is badly out of tune, but I've been practising anyway.",
            "I'm taking {v} lessons again, my teacher is very patient with me.",
        ),
        ("What instrument did I say I'm playing again?",),
        "Which instrument does {name} play?",
    ),
    (
        "allergy",
        ("cashews", "kiwi", "shellfish", "sesame", "buckwheat"),
        (
            "I'm allergic to {v}, which makes eating out a bit of an adventure.",
            "Remember to never let me near {v}, my allergy is no joke.",
        ),
        ("Quick one, do you remember what I'm allergic to? Asking for dinner planning reasons.",),
        "What is {name} allergic to?",
    ),
    (
        "street",
        ("Alder Lane", "Wrenfield Road", "Quarry Hill", "Tanner Street", "Marigold Close"),
        (
            "We finally moved into the new place on {v}, there are boxes everywhere.",
            "The house on {v} has a tiny garden, but it gets the evening sun.",
        ),
        ("Do you remember which street we moved to?",),
        "On which street does {name} live now?",
    ),
    (
        "band",
        ("The Paper Foxes", "Lantern Parade", "Velvet Harbour", "The Quiet Orchards", "Static Meadow"),
        (
            "I've had {v} on repeat all week, their new album is so good.",
            "We got tickets to see {v} next month, I'm ridiculously excited.",
        ),
        ("What was that band I kept going on about?",),
        "Which band has {name} been listening to?",
    ),
    (
        "race",
        ("41 minutes", "44 minutes", "47 minutes", "49 minutes", "52 minutes", "56 minutes"),
        (
            "I finally ran the riverside ten kilometres in {v}, which is a personal best.",
            "My time for the charity run was {v}, not amazing but I didn't stop once.",
        ),
        ("How fast did I say I ran that race? I want to see if you were listening.",),
        "How long did {name} take to run the race?",
    ),
)

USER_NAMES = ("Maya", "Leo", "Nora", "Iris", "Theo", "Lena", "Felix", "Ada")
PARTNER_NAMES = ("Jonah", "Clara", "Ravi", "Elise", "Marco", "Hana")

TIMES = (
    "Yesterday",
    "Last night",
    "This morning",
    "On Saturday",
    "Over the weekend",
    "The other day",
    "On the way home",
    "After work",
)
ACTIVITIES = (
    "I tried that new bakery by the station",
    "I finally cleaned out the fridge",
    "we walked along the river",
    "I watched half a season of that detective show",
    "I tried to bake bread from scratch",
    "I got caught in the rain without a jacket",
    "we rearranged the whole living room",
    "I went to a quiz night with some colleagues",
    "I spent ages looking for my keys",
    "I fixed the wobbly kitchen chair",
    "we had friends over for dinner",
    "I went for a long bike ride",
    "I repotted all the plants on the balcony",
    "I fell asleep on the sofa embarrassingly early",
    "I got lost in a bookshop for the whole afternoon",
    "I tried a yoga class for the first time",
    "I helped out at the community garden",
    "I watched the sunset from the hill behind our place",
    "I made soup with whatever was left in the cupboard",
    "I spent the evening on the phone with my mum",
)
REACTIONS = (
    "and it was honestly the best part of my week",
    "which went about as well as you'd expect",
    "and I regret nothing",
    "and now I'm completely exhausted",
    "and it made me weirdly happy",
    "though I'm not sure I'd do it again",
    "and I kept thinking you'd have loved it",
    "and somehow it took the whole day",
    "which was a nice change from staring at screens",
    "and of course I forgot to take any photos",
)
THOUGHTS = (
    "The weather can't make up its mind at all, sunny one hour and pouring the next.",
    "Work has been a lot lately, everyone wants everything yesterday.",
    "I've been trying to go to bed earlier but it never actually happens.",
    "I keep meaning to read more and then scroll on my phone instead.",
    "Someone at work brought homemade brownies and now I think about them constantly.",
    "The evenings are getting darker so early, it throws me off every year.",
    "I've been cooking a lot more at home, mostly to save money, but it's fun too.",
    "My phone screen cracked again, so I'm squinting at everything through a spiderweb.",
    "There's a new café on the corner and I'm trying very hard not to go every day.",
    "I've decided I'm going to learn to make proper coffee, wish me luck.",
    "The train was late again, I swear it's late more often than it's on time.",
    "We've been talking about repainting the kitchen for months and still haven't picked a colour.",
    "My knees have started complaining about the stairs, which feels premature.",
    "I finally finished that huge novel everyone recommended, the ending was a letdown.",
    "I'm trying to drink less coffee, and so far I'm mostly just grumpy.",
    "The heating in our building makes a noise like a ghost dragging chains.",
    "It's been ages since I saw a film in an actual cinema, I miss it.",
    "I found a jumper I thought I'd lost years ago at the back of the wardrobe.",
)
QUESTIONS = (
    "How was your week?",
    "What have you been up to?",
    "Did you end up doing anything fun?",
    "How's work treating you?",
    "Have you watched anything good lately?",
    "Any plans for the weekend?",
    "How are you sleeping these days?",
    "Did you ever try that recipe you mentioned?",
    "What's the weather doing over there?",
    "How's your family doing?",
)
RESPONSES = (
    "Ha, that sounds exactly like something you'd do.",
    "Ha, classic {user}.",
    "That sounds lovely, honestly.",
    "I love that.",
    "Okay, I'm a bit jealous now.",
    "Same here, more or less.",
    "That made me laugh.",
    "Oh nice, {user}.",
    "That's brilliant.",
    "Wait, really?",
    "Honestly, fair enough.",
    "Sounds like quite a week.",
)
SHORT = ("haha yes", "same honestly", "true", "ha, fair", "right??", "lol okay", "mm, maybe", "oh totally")
SHORT_REPLIES = ("Ha, exactly.", "Right?", "I know!", "Yep.", "Glad it's not just me.", "Same, same.")
RECALL_REPLIES = (
    "Oh, it's on the tip of my tongue, give me a second, I'll get it.",
    "Ha, I definitely know this one, hang on, I'm thinking.",
    "Don't rush me! I'll remember, I promise.",
    "You're testing me now, aren't you? Let me think about it for a bit.",
    "Hmm, I know you told me, I'm just blanking right now.",
)
GAPS = ("a few days later", "the following week", "two weeks later", "a month later", "the next evening")
GREETINGS = (
    "Hey {partner}! Sorry, it's been a while.",
    "Hi again, {partner}!",
    "Hey you, how's it going?",
    "Hello hello, {partner}, I'm back.",
)
