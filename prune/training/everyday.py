"""Everyday prompts for distillation: what users ask a chat model that is neither code nor competition math.

Four kinds, each built from word lists and templates of our own (no dataset, no evaluation prompt):

    instruction   "Write a short poem about autumn mornings", "Plan a three-day trip to ...", lists of tips
    question      how-to, why, comparisons and recommendations on household, money, health, travel, nature
    arithmetic    word problems with seeded numbers (discounts, recipes, speeds, bills, ages, interest, areas)
    editing       fix, shorten, formalise, simplify or restructure a short message written from templates

`everyday_prompts(n, seed)` is a pure function of (n, seed): records `{id, source, prompt}`, distinct, in a
seeded order; the kinds come in equal shares, and the record with a given id is the same for every n. The pool holds several thousand distinct prompts; asking
for more than it holds is a ConfigError naming the limit.
"""

import random

from models.errors import ConfigError

TOPICS = (
    "autumn mornings", "a rainy day in the city", "learning to ride a bicycle", "a grandmother's kitchen",
    "the first day at a new job", "a long train journey", "friendship", "moving to a new town", "the ocean at night",
    "a small bakery", "growing tomatoes", "a lost umbrella", "winter holidays", "a busy airport", "running a marathon",
    "an old library", "a cat that refuses to come inside", "the smell of coffee", "a power cut", "a school reunion",
    "saving money", "a mountain hike", "a street market", "the last day of summer", "a broken phone",
    "learning a new language", "a neighbour's garden", "a thunderstorm", "a birthday surprise", "working from home",
)
FORMS = (
    "a short poem", "a haiku", "a limerick", "the opening paragraph of a short story", "a diary entry",
    "a short speech for a friend's wedding toast", "a product description for an online shop",
    "a thank-you note", "a short blog post introduction", "a song chorus", "a two-line slogan",
    "a short letter to a future self",
)
INSTRUCTIONS = (
    "Write {form} about {topic}.",
    "Write {form} about {topic}. Keep it under 100 words.",
    "Give me five practical tips for {activity}.",
    "Plan a {days}-day trip to {place} for someone who likes {interest}. List each day briefly.",
    "Suggest a weekly meal plan for a {household} on a tight budget.",
    "Make a checklist for {event}.",
    "Explain {concept} to a ten-year-old.",
    "Write a polite message to {recipient} asking to {request}.",
    "Create a simple {weeks}-week plan for {activity}.",
    "List the pros and cons of {choice}.",
)
ACTIVITIES = (
    "sleeping better", "studying for exams", "keeping a small apartment tidy", "starting to run", "saving for a holiday",
    "learning to cook", "reducing screen time", "making new friends in a new city", "preparing for a job interview",
    "keeping houseplants alive", "drinking more water", "staying focused while working from home",
    "learning to play the guitar", "reading more books", "cutting down on food waste",
)
PLACES = ("Lisbon", "Kyoto", "the Scottish Highlands", "Mexico City", "Vienna", "a national park", "the seaside",
          "Istanbul", "Cape Town", "a small mountain village", "Montreal", "Copenhagen")
INTERESTS = ("history", "food", "hiking", "museums", "photography", "quiet places", "music", "architecture")
HOUSEHOLDS = ("family of four", "single student", "couple", "family with a toddler", "group of flatmates")
EVENTS = ("moving house", "a camping weekend", "a child's birthday party", "the first week at university",
          "hosting a dinner party", "a long-haul flight", "preparing a garden for winter", "adopting a dog")
CONCEPTS = ("how rainbows form", "why we have seasons", "what a budget is", "how vaccines work", "what gravity is",
            "how the internet sends a message", "why leaves change colour", "what inflation means",
            "how bees make honey", "why the sky is blue", "how a bank loan works", "what electricity is")
RECIPIENTS = ("a landlord", "a teacher", "a manager", "a neighbour", "a customer service team", "a colleague")
REQUESTS = ("fix a leaking tap", "move a meeting to next week", "return a borrowed book", "lower the music at night",
            "explain a charge on my bill", "review a draft before Friday", "extend a deadline by two days")
CHOICES = ("renting versus buying a home", "working from home", "buying an electric car", "learning online",
           "living in a big city", "having a pet", "taking a gap year", "cycling to work")

QUESTIONS = (
    "How do I {task}?",
    "What is the best way to {task}?",
    "What is the difference between {pair}?",
    "Why {phenomenon}?",
    "Can you recommend {thing} and explain why?",
    "What should I consider before {decision}?",
    "Is it true that {claim}? Explain briefly.",
)
TASKS = (
    "remove a coffee stain from a shirt", "make a simple budget", "get rid of fruit flies", "boil an egg perfectly",
    "write a good cover letter", "clean a cast-iron pan", "change a flat bicycle tyre", "keep bread fresh longer",
    "start a vegetable garden on a balcony", "prepare for a long flight", "negotiate a lower phone bill",
    "choose a good pair of running shoes", "back up photos from my phone", "unclog a bathroom sink",
    "memorise a speech", "train a puppy to sit", "fall asleep faster", "pack a suitcase efficiently",
)
PAIRS = ("weather and climate", "a virus and a bacterium", "baking soda and baking powder", "a debit and a credit card",
         "a crocodile and an alligator", "speed and velocity", "a simile and a metaphor", "stocks and bonds",
         "a hurricane and a tornado", "jam and jelly", "an introvert and an extrovert", "a lake and a pond")
PHENOMENA = ("does bread go stale", "do onions make us cry", "do cats purr", "is the sea salty",
             "do we get goosebumps", "does ice float on water", "do planes leave white trails in the sky",
             "do we yawn", "does metal feel colder than wood", "do leaves fall in autumn", "do we dream")
THINGS = ("a good book for a long holiday", "a hobby I can do at home", "a healthy breakfast",
          "a board game for a family evening", "an easy houseplant", "a simple dinner for guests",
          "a way to learn basic statistics", "a gift for a friend who likes gardening")
DECISIONS = ("buying a used car", "adopting a cat", "changing careers", "moving abroad", "starting a small business",
             "signing a gym contract", "lending money to a friend", "taking out a mortgage")
CLAIMS = ("we only use ten percent of our brains", "goldfish have a three-second memory",
          "lightning never strikes the same place twice", "cracking your knuckles causes arthritis",
          "bulls are angered by the colour red", "you should wait an hour after eating to swim")

# Who is asking and how they want the answer: the same question reads differently to the target with each.
CONTEXTS = ("", " I am a complete beginner.", " I live in a small flat.", " I am on a tight budget.",
            " Please answer step by step.", " Keep the answer short.", " I have about an hour.",
            " Explain it simply.", " Give me a few options.", " I tried once and it did not work.")

NAMES = ("Maria", "Tom", "Aisha", "Ken", "Sofia", "Liam", "Priya", "Jonas", "Elena", "Sam", "Noor", "Pedro")
ITEMS = ("notebooks", "apples", "bus tickets", "candles", "flower pots", "pencils", "jars of honey", "books")


def _arithmetic(rng: random.Random) -> str:
    name, other, item = rng.choice(NAMES), rng.choice(NAMES), rng.choice(ITEMS)
    price, count, percent = rng.randint(2, 60), rng.randint(3, 40), rng.choice((10, 15, 20, 25, 30, 40))
    hours, speed, people = rng.randint(2, 9), rng.randint(40, 120), rng.randint(3, 8)
    templates = (
        f"A jacket costs ${price * 5}. It is on sale for {percent}% off. What is the sale price?",
        f"{name} buys {count} {item} at ${price} each and pays with ${(count * price // 50 + 1) * 50}. How much "
        f"change does {name} get?",
        f"A recipe for {people} people needs {count * 25} grams of flour. How much flour is needed for "
        f"{people * 2 + 1} people?",
        f"A car travels at {speed} km per hour for {hours} hours. How far does it go? How long would the same trip "
        f"take at {speed + 20} km per hour?",
        f"A dinner bill of ${price * people + 17} is shared equally by {people} friends, with a {percent}% tip added "
        f"first. How much does each person pay?",
        f"{name} is {count} years old and {other} is {count + hours * 3} years old. In how many years will {other} "
        f"be twice as old as {name}, if ever? Explain.",
        f"${price * 100} is saved at {rng.choice((2, 3, 4, 5))}% simple interest per year. How much interest is "
        f"earned after {hours} years?",
        f"A rectangular garden is {count} m long and {hours + 2} m wide. What is its area, and how many metres of "
        f"fence go around it?",
        f"{name} reads {count} pages a day. A book has {count * (hours + 7) + price} pages. How many days does it "
        f"take to finish it?",
        f"The temperatures this week were {', '.join(str(rng.randint(-5, 30)) for _ in range(7))} degrees. What "
        f"was the average, and what was the difference between the warmest and coldest day?",
        f"A phone plan costs ${price} a month plus ${rng.randint(1, 5)} per gigabyte over {hours} GB. {name} used "
        f"{hours + rng.randint(1, 6)} GB. What is the bill?",
        f"A tank holds {count * 10} litres and fills at {rng.randint(2, 9)} litres per minute. How long does it "
        f"take to fill from empty, in minutes and seconds?",
    )
    return rng.choice(templates)


MESSAGES = (
    "hi {name}, just wanted to let you know that the {event} on {day} has been moved to {time}. sorry for the late "
    "notice, their was a problem with the room. let me know if you cant make it",
    "Dear team, as discussed in yesterdays meeting we will be changing the {thing} process starting {day}. Everyone "
    "need to submit there requests through the new form. Thanks for you patience.",
    "Hey {name}! Thanks so much for the {gift}, I absolutely love it and have been using it every day since {day}. "
    "We should definately meet up soon, maybe for coffee at {time}?",
    "To whom it may concern, I am writing to complain about the {thing} I ordered, it arrived late and one part "
    "was broken. I would like a refund or a replacement as soon as posible.",
    "{name}, the report is nearly finished but I still need the numbers for {thing}. Could you send them before "
    "{day} at {time}? Otherwise we wont be able to make the deadline.",
    "Reminder: the {event} starts at {time} on {day}. Please bring a water bottle, comfortable shoes and your "
    "ticket. Parking is limited so we recommend to come by bus.",
)
EDITS = (
    "Fix the spelling and grammar in this message:\n\n{text}",
    "Rewrite this message in a more formal tone:\n\n{text}",
    "Rewrite this message in a friendly, casual tone:\n\n{text}",
    "Shorten this message to one clear sentence:\n\n{text}",
    "Turn this message into a short bullet list of the key points:\n\n{text}",
    "Rewrite this so that a non-native English speaker can understand it easily:\n\n{text}",
    "Write a polite reply to this message:\n\n{text}",
)
DAYS = ("Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday")
TIMES = ("9am", "10:30", "noon", "2pm", "3:15", "5pm", "7pm")
GIFTS = ("scarf", "cookbook", "plant", "headphones", "mug", "board game")
MESSAGE_EVENTS = ("team lunch", "yoga class", "parents' evening", "book club", "workshop", "charity run")
MESSAGE_THINGS = ("expense", "holiday booking", "lamp", "quarterly sales", "printer", "chair", "survey")


def _instruction(rng: random.Random) -> str:
    return rng.choice(INSTRUCTIONS).format(
        form=rng.choice(FORMS), topic=rng.choice(TOPICS), activity=rng.choice(ACTIVITIES), days=rng.randint(2, 5),
        place=rng.choice(PLACES), interest=rng.choice(INTERESTS), household=rng.choice(HOUSEHOLDS),
        event=rng.choice(EVENTS), concept=rng.choice(CONCEPTS), recipient=rng.choice(RECIPIENTS),
        request=rng.choice(REQUESTS), weeks=rng.randint(2, 8), choice=rng.choice(CHOICES))


def _question(rng: random.Random) -> str:
    return rng.choice(QUESTIONS).format(
        task=rng.choice(TASKS), pair=rng.choice(PAIRS), phenomenon=rng.choice(PHENOMENA), thing=rng.choice(THINGS),
        decision=rng.choice(DECISIONS), claim=rng.choice(CLAIMS)) + rng.choice(CONTEXTS)


def _editing(rng: random.Random) -> str:
    text = rng.choice(MESSAGES).format(
        name=rng.choice(NAMES), event=rng.choice(MESSAGE_EVENTS), day=rng.choice(DAYS), time=rng.choice(TIMES),
        thing=rng.choice(MESSAGE_THINGS), gift=rng.choice(GIFTS))
    return rng.choice(EDITS).format(text=text)


KINDS = {"instruction": _instruction, "question": _question, "arithmetic": _arithmetic, "editing": _editing}
# Draws per wanted prompt before the pool counts as exhausted (templates repeat more as the pool empties).
_DRAWS_PER_PROMPT = 40


def everyday_prompts(num_prompts: int, seed: int = 0) -> list[dict]:
    """`num_prompts` distinct everyday prompt records `{id, source, prompt}` (see the module docstring)."""
    if num_prompts < 1:
        raise ConfigError(f"--num-prompts must be at least 1 (got {num_prompts})")
    per_kind = {kind: -(-num_prompts // len(KINDS)) for kind in KINDS}
    records, seen = [], set()
    for kind, make in KINDS.items():
        # One stream per kind: prompt i of a kind is the same whatever the count asked for.
        rng = random.Random(f"everyday:{seed}:{kind}")
        made, draws = 0, 0
        while made < per_kind[kind]:
            draws += 1
            if draws > _DRAWS_PER_PROMPT * per_kind[kind]:
                raise ConfigError(f"the everyday pool ran out of distinct {kind} prompts after {made}; "
                                  f"ask for at most {made * len(KINDS)} prompts (--num-prompts)")
            text = make(rng)
            if text in seen:
                continue
            seen.add(text)
            records.append({"id": f"everyday:{kind}:{made}", "source": f"synthetic/{kind}", "prompt": text})
            made += 1
    random.Random(f"everyday-order:{seed}").shuffle(records)
    return records[:num_prompts]
