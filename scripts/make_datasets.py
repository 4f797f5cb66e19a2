"""Generate the small bundled datasets in ``recipes/data/``.

Everything is synthetic and deterministic (fixed seeds), so re-running the
script reproduces byte-identical files::

    .venv/bin/python scripts/make_datasets.py

Files written (see ``recipes/data/README.md`` for the formats):

* ``reverse_train.jsonl`` / ``reverse_eval.jsonl`` - alpaca-style letter reversal
* ``reverse_pref_train.jsonl`` / ``reverse_pref_eval.jsonl`` - preference pairs of the same task (task: dpo)
* ``reverse_prompts_train.jsonl`` / ``reverse_prompts_eval.jsonl`` - prompts with their answers (task: grpo)
* ``shift_train.jsonl`` / ``shift_eval.jsonl`` - reversal with each letter moved one on (the LoRA quickstart's task)
* ``topics_train.jsonl`` / ``topics_eval.jsonl`` - 4-way topic classification
* ``tiny_chat.jsonl`` - chat ``messages`` rows (system / multi-turn variants)
* ``tiny_completion.jsonl`` - plain ``text`` rows for causal LM smoke tests
* ``tiny_classification.csv`` - ``text,label`` CSV with integer labels 0/1/2
* ``tools_train.jsonl`` / ``tools_eval.jsonl`` - chat rows with tools: call one of three tools with arguments
  from the request (the tools quickstart's task)
"""

from __future__ import annotations

import csv
import json
import random
import string
from collections import Counter
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
DATA_DIR = REPO_ROOT / "recipes" / "data"

SEED = 1234
LETTERS = string.ascii_lowercase
REVERSE_INSTRUCTION = "Reverse the letters."
SHIFT_INSTRUCTION = "Reverse and shift the letters."  # each letter moved one on: a to b, z to a

# ---------------------------------------------------------------------------
# Letter reversal (alpaca format)
# ---------------------------------------------------------------------------


def random_letters(rng: random.Random) -> str:
    """Return 3 to 5 random lowercase letters separated by single spaces."""
    n = rng.randint(3, 5)
    return " ".join(rng.choice(LETTERS) for _ in range(n))


def reverse_letters(letters: str) -> str:
    """Reverse a space separated letter sequence (``"a b c"`` -> ``"c b a"``)."""
    return " ".join(reversed(letters.split(" ")))


def unique_inputs(rng: random.Random, count: int) -> list[str]:
    """``count`` distinct random letter sequences, in the order ``rng`` draws them."""
    inputs: list[str] = []
    seen: set[str] = set()
    while len(inputs) < count:
        letters = random_letters(rng)
        if letters not in seen:
            seen.add(letters)
            inputs.append(letters)
    return inputs


def make_reverse(n_train: int, n_eval: int, seed: int) -> tuple[list[dict[str, str]], list[dict[str, str]]]:
    """Build disjoint train/eval splits (unique inputs) of the reversal task."""
    inputs = unique_inputs(random.Random(seed), n_train + n_eval)
    rows = [{"instruction": REVERSE_INSTRUCTION, "input": x, "output": reverse_letters(x)} for x in inputs]
    return rows[:n_train], rows[n_train:]


def shift_letters(letters: str) -> str:
    """Each letter of a space separated sequence moved one on in the alphabet, z to a (``"a z"`` -> ``"b a"``)."""
    return " ".join(LETTERS[(LETTERS.index(c) + 1) % len(LETTERS)] for c in letters.split(" "))


def make_shift(n_train: int, n_eval: int, seed: int) -> tuple[list[dict[str, str]], list[dict[str, str]]]:
    """Disjoint train/eval splits of the reverse-and-shift task (the LoRA quickstart's new task): the input reversed,
    each letter moved one on. A model fine-tuned on the reversal task answers with the plain reversal, which is
    wrong at every letter, until an adapter teaches it the shift."""
    inputs = unique_inputs(random.Random(seed), n_train + n_eval)
    rows = [{"instruction": SHIFT_INSTRUCTION, "input": x, "output": shift_letters(reverse_letters(x))} for x in inputs]
    return rows[:n_train], rows[n_train:]


def reverse_eval_report(rows: list[dict[str, str]]) -> dict[str, float]:
    """Compute (and print) trivial baselines on the reversal eval split."""
    outputs = Counter(r["output"] for r in rows)
    top_output, top_count = outputs.most_common(1)[0]
    majority = top_count / len(rows)
    copy_acc = sum(r["input"] == r["output"] for r in rows) / len(rows)
    lengths = Counter(len(r["input"].split()) for r in rows)
    print(
        f"reverse_eval: {len(rows)} rows, {len(outputs)} distinct outputs; most common output "
        f"{top_output!r} x{top_count} -> majority baseline {majority:.2%} "
        f"(check < 5%: {'OK' if majority < 0.05 else 'FAIL'}); copy-input baseline {copy_acc:.2%}; "
        f"lengths {dict(sorted(lengths.items()))}"
    )
    assert majority < 0.05, "reverse eval answers are not diverse enough"
    return {"majority": majority, "copy": copy_acc}


# ---------------------------------------------------------------------------
# Letter reversal preference pairs (data.format: preference)
# ---------------------------------------------------------------------------

# the alpaca prompt finetune renders for {instruction, input} rows (finetune.data.formats.ALPACA_PROMPT_INPUT):
# written verbatim into each pair's prompt, so a model fine-tuned on reverse_train.jsonl sees the prompt it knows
REVERSE_PROMPT = "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n"


def swap_two(letters: list[str], rng: random.Random) -> list[str] | None:
    """``letters`` with two adjacent, different letters swapped at a random place (None when all are equal)."""
    places = [i for i in range(len(letters) - 1) if letters[i] != letters[i + 1]]
    if not places:
        return None
    i = rng.choice(places)
    out = list(letters)
    out[i], out[i + 1] = out[i + 1], out[i]
    return out


def wrong_reversal(row: dict[str, str], kind: int, rng: random.Random) -> str:
    """A wrong answer to a reversal row: the input copied unreversed (``kind`` 0) or the reversal with two
    adjacent letters swapped (``kind`` 1); whichever kind would equal the right answer falls back to the other,
    and a run of one repeated letter gets one letter replaced. Never the right answer."""
    answer = row["output"].split(" ")
    candidates = [row["input"].split(" "), swap_two(answer, rng)]
    for wrong in (candidates[kind], candidates[1 - kind]):
        if wrong is not None and wrong != answer:
            return " ".join(wrong)
    i = rng.randrange(len(answer))
    replaced = list(answer)
    replaced[i] = rng.choice([c for c in LETTERS if c != answer[i]])
    return " ".join(replaced)


def make_reverse_preference(rows: list[dict[str, str]], seed: int) -> list[dict[str, str]]:
    """``{prompt, chosen, rejected}`` pairs from reversal rows: chosen is the right reversal, rejected a wrong one
    (kinds alternate: the unreversed input, then a reversal with two letters swapped)."""
    rng = random.Random(seed)
    pairs = []
    for i, row in enumerate(rows):
        rejected = wrong_reversal(row, i % 2, rng)
        assert rejected != row["output"]
        pairs.append({"prompt": REVERSE_PROMPT.format(instruction=row["instruction"], input=row["input"]),
                      "chosen": row["output"], "rejected": rejected})
    return pairs


def make_reverse_prompts(rows: list[dict[str, str]]) -> list[dict[str, str]]:
    """``{prompt, answer}`` rows from reversal rows (``data.format: prompt``, task: grpo): the prompt finetune renders
    for the row, verbatim, and the right reversal, which the ``exact_match`` reward compares a completion with."""
    return [{"prompt": REVERSE_PROMPT.format(instruction=row["instruction"], input=row["input"]),
             "answer": row["output"]} for row in rows]


# ---------------------------------------------------------------------------
# Topic classification
# ---------------------------------------------------------------------------

SHARED_SLOTS: dict[str, list[str]] = {
    "name": [
        "Maria",
        "James",
        "Aisha",
        "Tom",
        "Priya",
        "Lucas",
        "Emma",
        "Kenji",
        "Sofia",
        "Daniel",
        "Olivia",
        "Mateo",
        "Hannah",
        "Omar",
        "Grace",
        "Leo",
        "Chloe",
        "Ivan",
        "Nora",
        "Sam",
    ],
    "time": [
        "this morning",
        "last night",
        "on Saturday",
        "yesterday",
        "after work",
        "over the weekend",
        "on Sunday afternoon",
        "earlier today",
        "last week",
        "this afternoon",
    ],
    "city": [
        "Lisbon",
        "Chicago",
        "Nairobi",
        "Osaka",
        "Melbourne",
        "Toronto",
        "Madrid",
        "Seoul",
        "Denver",
        "Glasgow",
        "Cape Town",
        "Lima",
    ],
    "feeling": ["thrilled", "disappointed", "surprised", "relieved", "annoyed", "impressed", "nervous"],
}

TOPIC_SLOTS: dict[str, dict[str, list[str]]] = {
    "sports": {
        "sport": [
            "soccer",
            "basketball",
            "tennis",
            "baseball",
            "hockey",
            "cricket",
            "rugby",
            "volleyball",
            "golf",
            "badminton",
            "handball",
            "water polo",
        ],
        "event": [
            "championship",
            "tournament",
            "final",
            "playoff game",
            "derby",
            "league match",
            "semifinal",
            "cup final",
            "grand slam",
            "world cup qualifier",
        ],
        "athlete": [
            "striker",
            "goalkeeper",
            "point guard",
            "pitcher",
            "sprinter",
            "midfielder",
            "captain",
            "defender",
            "quarterback",
            "marathon runner",
        ],
        "result": [
            "won by two goals",
            "lost in overtime",
            "came back from a ten point deficit",
            "drew in the last minute",
            "won on penalties",
            "got knocked out in the first round",
        ],
        "race": ["marathon", "triathlon", "100 meter sprint", "cycling race", "relay", "half marathon"],
        "team": ["home team", "visitors", "national team", "underdogs", "defending champions", "rookies"],
    },
    "food": {
        "dish": [
            "lasagna",
            "curry",
            "ramen",
            "paella",
            "risotto",
            "banana bread",
            "vegetable soup",
            "pizza",
            "apple pie",
            "omelette",
            "stir fry",
            "chili",
            "fried rice",
            "mushroom pasta",
            "shepherd's pie",
        ],
        "ingredient": [
            "garlic",
            "fresh basil",
            "butter",
            "cinnamon",
            "lemon zest",
            "ginger",
            "brown sugar",
            "olive oil",
            "cumin",
            "parmesan",
            "coconut milk",
            "smoked paprika",
        ],
        "verb": ["baked", "cooked", "grilled", "roasted", "simmered", "fried", "whipped up", "tasted"],
        "meal": ["breakfast", "lunch", "dinner", "brunch", "a late snack", "the picnic"],
        "taste": ["spicy", "sweet", "salty", "creamy", "crunchy", "tangy", "bland", "delicious"],
        "place": ["bakery", "restaurant", "food truck", "cafe", "noodle shop", "farmers market"],
    },
    "technology": {
        "device": [
            "laptop",
            "phone",
            "tablet",
            "smartwatch",
            "router",
            "graphics card",
            "keyboard",
            "monitor",
            "server",
            "printer",
            "headset",
            "hard drive",
        ],
        "software": [
            "operating system",
            "browser",
            "spreadsheet app",
            "photo editor",
            "antivirus",
            "messaging app",
            "code editor",
            "database",
            "video player",
            "password manager",
        ],
        "action": [
            "installed the update",
            "rebooted the machine",
            "reset the password",
            "cleared the cache",
            "backed up the files",
            "reinstalled the drivers",
            "upgraded the memory",
        ],
        "problem": [
            "kept crashing",
            "ran out of storage",
            "would not connect to the network",
            "overheated",
            "lost all my settings",
            "froze on the loading screen",
            "drained the battery",
        ],
        "feature": [
            "faster processor",
            "better camera",
            "longer battery life",
            "new chip",
            "bigger screen",
            "fingerprint reader",
            "cloud backup option",
            "voice assistant",
            "dark mode",
        ],
        "field": ["software engineers", "programmers", "developers", "the IT team", "hackers", "data scientists"],
    },
    "weather": {
        "condition": [
            "heavy rain",
            "snow",
            "thick fog",
            "thunderstorms",
            "hail",
            "strong winds",
            "sleet",
            "extreme heat",
            "drizzle",
            "heavy snowfall",
            "freezing rain",
            "thunder and lightning",
        ],
        "temp": [
            "below freezing",
            "around thirty degrees",
            "unusually mild",
            "bitterly cold",
            "hot and humid",
            "a few degrees warmer",
            "chilly",
        ],
        "sky": ["cloudy", "overcast", "sunny", "clear", "grey", "stormy", "hazy"],
        "forecast": [
            "forecast",
            "meteorologist",
            "weather service",
            "radar",
            "weather report",
            "storm warning",
        ],
        "season": ["spring", "summer", "autumn", "winter", "monsoon season"],
        "gear": ["umbrella", "raincoat", "sunscreen", "gloves", "boots", "scarf", "sunglasses"],
    },
}

TOPIC_TEMPLATES: dict[str, list[str]] = {
    "sports": [
        "{name} scored twice in the {sport} match {time}.",
        "The {team} {result} in the {event} {time}.",
        "Who do you think will win the {sport} {event} this year?",
        "Our {athlete} was injured, so the coach had to change the lineup.",
        "{name} has been training every day for the {race} in {city}.",
        "Fans filled the stadium in {city} to watch the {event}.",
        "I can't believe the {athlete} missed such an easy shot at the end.",
        "The {sport} season starts next month and the tickets are already sold out.",
        "After losing three games in a row, the {team} replaced their coach.",
        "{name} crossed the finish line of the {race} just ahead of everyone else.",
        "We played a friendly game of {sport} in the park {time}.",
        "The referee showed the {athlete} a red card in the second half.",
        "She signed a two year contract to play {sport} for a club in {city}.",
        "Highlights of the {event} were replayed all evening.",
        "My knees still hurt from the {race} {time}, but I beat my personal best.",
        "Is it true that the {team} are favourites to win the {event}?",
        "{name} was {feeling} when the {athlete} was picked for the national squad.",
        "The crowd went silent when the {athlete} went down with a cramp.",
    ],
    "food": [
        "{name} {verb} a {taste} {dish} for {meal} {time}.",
        "Add a pinch of {ingredient} before you serve the {dish}.",
        "The new {place} in {city} makes the best {dish} I have ever had.",
        "Is the {dish} supposed to be this {taste}?",
        "I ran out of {ingredient}, so I had to improvise the sauce.",
        "My grandmother's recipe for {dish} uses {ingredient} and a lot of patience.",
        "We shared a huge plate of {dish} at the {place} {time}.",
        "{name} let the dough rest for an hour before putting it in the oven.",
        "{name} was {feeling} that the {place} had stopped selling {dish}.",
        "The secret to a good {dish} is plenty of {ingredient}.",
        "For {meal} I usually have something {taste} and quick.",
        "Could you pick up some {ingredient} on your way home?",
        "The crust came out {taste} and golden after twenty minutes.",
        "Everyone asked for seconds of the {dish} at the family dinner.",
        "Stir the {ingredient} into the pan and simmer it until it thickens.",
        "{name} {verb} too much {dish} and had no room left for dessert.",
        "I tried a {taste} street snack from a stall in {city}.",
        "The chef sprinkled {ingredient} over the plate right before serving it.",
    ],
    "technology": [
        "My {device} {problem} right after I {action}.",
        "{name} {action} on the {device} and now it works fine.",
        "The new {device} comes with a {feature} and costs less than last year's model.",
        "Does the latest {device} really have a {feature}?",
        "The {software} {problem} twice {time}, so I filed a bug report.",
        "A startup in {city} is hiring {field} to build a smarter {software}.",
        "I finally {action}, and the {device} is much faster now.",
        "{name} was {feeling} when the {device} {problem} during the presentation.",
        "Most {field} say the {feature} is the biggest improvement this year.",
        "You should always keep a copy of your files somewhere other than your {device}.",
        "The company released a patch for the {software} {time}.",
        "Can you help me figure out why my {device} {problem}?",
        "The {software} asked me to sign in again after the restart.",
        "{name} built a small robot that streams video to a {device}.",
        "{name}'s screen went black and the fan started spinning loudly.",
        "Our office replaced every {device} because the old ones {problem}.",
        "After I {action}, the {software} stopped asking for permissions.",
        "Reviewers praised the {feature} but complained about the price of the {device}.",
    ],
    "weather": [
        "The {forecast} says there will be {condition} in {city} {time}.",
        "It was {temp} {time}, so {name} wore {gear}.",
        "Don't forget your {gear}, the sky looks {sky} and we might get {condition}.",
        "Will the {condition} stop before the weekend?",
        "The {forecast} warned about {condition} along the coast.",
        "{name} had to scrape ice off the car windshield {time}.",
        "This {season} has been {temp} compared to last year.",
        "The roads in {city} were flooded after hours of {condition}.",
        "The sky stayed {sky} all day and the temperature barely changed.",
        "{name} was {feeling} that the {condition} cancelled the outdoor concert.",
        "According to the {forecast}, tomorrow will be {sky} and {temp}.",
        "We stayed indoors because of the {condition}.",
        "It is {temp} outside, so I think I will need my {gear}.",
        "The wind knocked over our fence during the storm {time}.",
        "By noon the fog had lifted and it turned {sky}.",
        "Every {season} in {city} brings a few days of {condition}.",
        "Is it going to be {sky} for the picnic or should we bring {gear}?",
        "The airport in {city} delayed flights because of {condition}.",
    ],
}

TOPIC_LABELS = ["sports", "food", "technology", "weather"]


def fill_template(template: str, slots: dict[str, list[str]], rng: random.Random) -> str:
    """Fill every ``{slot}`` of ``template`` with a random value from ``slots``."""
    names = [field for _, field, _, _ in string.Formatter().parse(template) if field]
    values = {name: rng.choice(slots[name]) for name in names}
    text = template.format(**values)
    return text[0].upper() + text[1:]


def make_topic_texts(label: str, n: int, rng: random.Random, exclude: set[str]) -> list[str]:
    """Generate ``n`` unique sentences for ``label`` (not in ``exclude``)."""
    slots = {**SHARED_SLOTS, **TOPIC_SLOTS[label]}
    templates = TOPIC_TEMPLATES[label]
    texts: list[str] = []
    seen = set(exclude)
    attempts = 0
    while len(texts) < n:
        attempts += 1
        if attempts > 100 * n:
            raise RuntimeError(f"could not generate {n} unique texts for {label}")
        # Cycle templates so every structure is represented, randomise the slot fill.
        text = fill_template(
            templates[len(texts) % len(templates)] if attempts % 3 else rng.choice(templates), slots, rng
        )
        if text not in seen:
            seen.add(text)
            texts.append(text)
    return texts


def make_topics(n_train_per_label: int, n_eval_per_label: int, seed: int) -> tuple[list[dict[str, str]], ...]:
    """Build balanced, disjoint train/eval topic classification splits."""
    rng = random.Random(seed)
    train: list[dict[str, str]] = []
    eval_: list[dict[str, str]] = []
    for label in TOPIC_LABELS:
        texts = make_topic_texts(label, n_train_per_label + n_eval_per_label, rng, set())
        rng.shuffle(texts)
        train += [{"text": t, "label": label} for t in texts[:n_train_per_label]]
        eval_ += [{"text": t, "label": label} for t in texts[n_train_per_label:]]
    rng.shuffle(train)
    rng.shuffle(eval_)
    return train, eval_


def topic_report(train: list[dict[str, str]], eval_: list[dict[str, str]]) -> None:
    """Print label balance and vocabulary statistics; assert no train/eval overlap."""
    overlap = {r["text"] for r in train} & {r["text"] for r in eval_}
    assert not overlap, f"train/eval overlap: {sorted(overlap)[:3]}"
    assert len({r["text"] for r in train}) == len(train)
    assert len({r["text"] for r in eval_}) == len(eval_)
    for label in TOPIC_LABELS:
        words = {w for values in TOPIC_SLOTS[label].values() for v in values for w in v.split()}
        print(
            f"  {label:<11} templates={len(TOPIC_TEMPLATES[label])} content words={len(words)} "
            f"train={sum(r['label'] == label for r in train)} eval={sum(r['label'] == label for r in eval_)}"
        )
    print(f"topics: train={len(train)} eval={len(eval_)}, no overlap, no duplicates")


# ---------------------------------------------------------------------------
# Tiny chat / completion / CSV classification
# ---------------------------------------------------------------------------

SYSTEM_PROMPTS = [
    "You are a helpful assistant.",
    "You are a concise assistant. Answer in as few words as possible.",
    "You follow instructions exactly.",
]

ECHO_PHRASES = [
    "hello world",
    "good morning",
    "the cat sat down",
    "blue sky",
    "see you soon",
    "thank you",
    "open the door",
    "red apple",
    "it is raining",
    "one two three",
    "happy birthday",
    "nice to meet you",
]


def chat_turn(rng: random.Random) -> tuple[str, str]:
    """Return one simple (user, assistant) exchange."""
    kind = rng.randrange(4)
    if kind == 0:
        letters = random_letters(rng)
        return f"Reverse the letters: {letters}", reverse_letters(letters)
    if kind == 1:
        phrase = rng.choice(ECHO_PHRASES)
        return f"Repeat after me: {phrase}", phrase
    if kind == 2:
        letters = random_letters(rng)
        return f"What is the first letter of: {letters}?", letters.split()[0]
    letters = random_letters(rng)
    return f"How many letters are in: {letters}?", str(len(letters.split()))


def make_tiny_chat(n: int, seed: int) -> list[dict[str, Any]]:
    """Chat rows; every third row has a system message and every other row has two turns."""
    rng = random.Random(seed)
    rows: list[dict[str, Any]] = []
    for i in range(n):
        messages: list[dict[str, str]] = []
        if i % 3 == 0:
            messages.append({"role": "system", "content": SYSTEM_PROMPTS[(i // 3) % len(SYSTEM_PROMPTS)]})
        for _ in range(2 if i % 2 == 1 else 1):
            user, assistant = chat_turn(rng)
            messages += [{"role": "user", "content": user}, {"role": "assistant", "content": assistant}]
        rows.append({"messages": messages})
    return rows


SUBJECTS = [
    "The old man",
    "A small dog",
    "My neighbour",
    "The teacher",
    "The postman",
    "My aunt",
    "A young girl",
    "The mayor",
    "Every student",
    "The baker",
    "A tired farmer",
    "The new doctor",
]
PREDICATES = [
    "walked slowly to the market",
    "slept under the warm blanket",
    "painted the fence green",
    "waited at the station for an hour",
    "sang a quiet song",
    "read the letter twice",
    "crossed the bridge before sunset",
    "fixed the broken chair",
    "planted tomatoes in the garden",
    "laughed at the silly joke",
    "closed the window",
    "counted the coins on the table",
]
EXTENSIONS = [
    "because it was getting late",
    "while the children played outside",
    "and nobody noticed",
    "before anyone else arrived",
    "even though it was raining",
    "after a long and tiring day",
    "so that everyone could rest",
    "without saying a single word",
    "and then went home",
    "as the bells rang in the distance",
]

SHORT_ENDINGS = ["again", "quietly", "for a while", "at noon", "once more", "by the door"]


def generic_sentence(rng: random.Random, n_extensions: int) -> str:
    """A simple English sentence with ``n_extensions`` trailing clauses."""
    parts = [rng.choice(SUBJECTS), rng.choice(PREDICATES)]
    parts += rng.sample(EXTENSIONS, n_extensions)
    return " ".join(parts) + "."


def make_tiny_completion(n: int, seed: int) -> list[dict[str, str]]:
    """Plain text rows with 5 to 40 words each (lengths spread over the range)."""
    rng = random.Random(seed)
    rows: list[dict[str, str]] = []
    seen: set[str] = set()
    while len(rows) < n:
        kind = len(rows) % 4
        if kind == 0:  # short: 5-7 words
            verb = rng.choice(["smiled", "waited", "slept", "left", "stopped", "listened"])
            text = f"{rng.choice(SUBJECTS)} {verb} {rng.choice(SHORT_ENDINGS)}."
        else:
            text = generic_sentence(rng, {1: 0, 2: rng.randint(1, 2), 3: rng.randint(3, 5)}[kind])
        if text not in seen and 5 <= len(text.split()) <= 40:
            seen.add(text)
            rows.append({"text": text})
    return rows


CSV_LABELS = ["sports", "food", "weather"]  # label ids 0, 1, 2


def make_tiny_classification(n: int, seed: int) -> list[dict[str, Any]]:
    """Small 3-class topic dataset with integer labels (0=sports, 1=food, 2=weather)."""
    rng = random.Random(seed)
    per_label = [n // len(CSV_LABELS) + (i < n % len(CSV_LABELS)) for i in range(len(CSV_LABELS))]
    rows: list[dict[str, Any]] = []
    for label_id, (label, count) in enumerate(zip(CSV_LABELS, per_label, strict=True)):
        rows += [{"text": t, "label": label_id} for t in make_topic_texts(label, count, rng, set())]
    rng.shuffle(rows)
    return rows


# ---------------------------------------------------------------------------
# Writers
# ---------------------------------------------------------------------------
# Tool calling (chat rows with tools and tool_calls)
# ---------------------------------------------------------------------------

def _tool(name: str, description: str, properties: dict[str, str]) -> dict[str, Any]:
    """A tool's JSON schema, as a chat template's ``tools`` takes it (every property required)."""
    return {"type": "function", "function": {
        "name": name, "description": description,
        "parameters": {"type": "object", "properties": {key: {"type": kind} for key, kind in properties.items()},
                       "required": list(properties)}}}


TOOLS = [
    _tool("get_weather", "The weather in a city on a day", {"city": "string", "day": "string"}),
    _tool("set_timer", "Start a timer", {"minutes": "integer", "label": "string"}),
    _tool("convert", "Convert an amount of money", {"amount": "integer", "currency": "string"}),
]
CITIES = ["paris", "lyon", "rome", "oslo", "lima", "cairo", "tokyo", "delhi", "quito", "dakar", "bern", "kyiv",
          "riga", "doha", "hanoi", "perth", "accra", "minsk", "sofia", "tunis", "milan", "seoul", "dubai", "lagos",
          "porto", "vienna", "athens", "havana", "nairobi", "prague"]
DAYS = ["today", "tomorrow", "monday", "tuesday", "wednesday", "thursday", "friday", "saturday", "sunday"]
MINUTES = [2, 5, 10, 15, 20, 25, 30, 45, 60, 90]
LABELS = ["tea", "pasta", "eggs", "laundry", "bread", "rice", "nap", "oven", "break", "call"]
AMOUNTS = [5, 10, 20, 25, 40, 50, 75, 100, 150, 200, 250, 300, 400, 500, 600, 750, 800, 900, 1000, 2000]
CURRENCIES = ["euro", "dollar", "yen", "pound", "rupee", "franc"]
ASKS = {
    "get_weather": ["what is the weather in {city} {day}?", "weather in {city} on {day} please",
                    "will it rain in {city} {day}?", "{day}: how warm is {city}?",
                    "tell me the {day} weather for {city}"],
    "set_timer": ["set a {label} timer for {minutes} minutes", "start a {minutes} minute timer for {label}",
                  "{label} timer {minutes} min", "remind me of the {label} in {minutes} minutes",
                  "count down {minutes} minutes for {label}"],
    "convert": ["convert {amount} to {currency}", "how much is {amount} in {currency}?",
                "{amount} in {currency} please", "change {amount} into {currency}", "what are {amount} in {currency}?"],
}


def _tool_row(name: str, phrase: int, rng: random.Random) -> dict[str, Any]:
    """One row: the tools, a user's request in phrasing ``phrase`` of tool ``name``, and the call that answers it."""
    if name == "get_weather":
        arguments: dict[str, Any] = {"city": rng.choice(CITIES), "day": rng.choice(DAYS)}
    elif name == "set_timer":
        arguments = {"minutes": rng.choice(MINUTES), "label": rng.choice(LABELS)}
    else:
        arguments = {"amount": rng.choice(AMOUNTS), "currency": rng.choice(CURRENCIES)}
    return {"tools": TOOLS, "messages": [
        {"role": "user", "content": ASKS[name][phrase].format(**arguments)},
        {"role": "assistant", "tool_calls": [{"type": "function", "function": {"name": name,
                                                                             "arguments": arguments}}]}]}


def make_tools(n_train: int, n_eval: int, seed: int) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Tool-calling rows: pick the one of three tools a request needs and fill its arguments from the request's
    words, as many rows of each tool. Each argument takes a few values (a tiny model learns which word goes where
    in minutes); held out: every eval request is one no training row makes (its tool, phrasing and arguments
    together), a new combination of the values and phrasings training saw."""
    rng = random.Random(seed)
    seen: set[str] = set()
    per_tool: dict[str, list[dict[str, Any]]] = {name: [] for name in sorted(ASKS)}
    want = (n_train + n_eval) // len(ASKS)
    while any(len(rows) < want for rows in per_tool.values()):
        name = rng.choice([name for name, rows in per_tool.items() if len(rows) < want])
        row = _tool_row(name, rng.randrange(len(ASKS[name])), rng)
        if row["messages"][0]["content"] not in seen:
            seen.add(row["messages"][0]["content"])
            per_tool[name].append(row)
    train_each, eval_each = n_train // len(ASKS), n_eval // len(ASKS)
    train = [row for rows in per_tool.values() for row in rows[:train_each]]
    held = [row for rows in per_tool.values() for row in rows[train_each:train_each + eval_each]]
    rng.shuffle(train)
    rng.shuffle(held)
    return train, held


# ---------------------------------------------------------------------------


def write_jsonl(path: Path, rows: list[dict[str, Any]]) -> None:
    """Write ``rows`` as JSON lines (UTF-8, ``\\n`` line endings)."""
    with path.open("w", encoding="utf-8", newline="\n") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    print(f"wrote {path.relative_to(REPO_ROOT)} ({len(rows)} rows)")


def write_csv(path: Path, rows: list[dict[str, Any]], fields: list[str]) -> None:
    """Write ``rows`` as a CSV with a header line."""
    with path.open("w", encoding="utf-8", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields, lineterminator="\n")
        writer.writeheader()
        writer.writerows(rows)
    print(f"wrote {path.relative_to(REPO_ROOT)} ({len(rows)} rows)")


def main() -> None:
    """Generate and write every bundled dataset."""
    DATA_DIR.mkdir(parents=True, exist_ok=True)

    reverse_train, reverse_eval = make_reverse(2000, 200, seed=SEED)
    assert not {r["input"] for r in reverse_train} & {r["input"] for r in reverse_eval}
    write_jsonl(DATA_DIR / "reverse_train.jsonl", reverse_train)
    write_jsonl(DATA_DIR / "reverse_eval.jsonl", reverse_eval)
    reverse_eval_report(reverse_eval)
    write_jsonl(DATA_DIR / "reverse_pref_train.jsonl", make_reverse_preference(reverse_train[:1000], seed=SEED + 5))
    write_jsonl(DATA_DIR / "reverse_pref_eval.jsonl", make_reverse_preference(reverse_eval, seed=SEED + 6))
    write_jsonl(DATA_DIR / "reverse_prompts_train.jsonl", make_reverse_prompts(reverse_train[1000:]))
    write_jsonl(DATA_DIR / "reverse_prompts_eval.jsonl", make_reverse_prompts(reverse_eval))

    shift_train, shift_eval = make_shift(1000, 200, seed=SEED + 7)
    write_jsonl(DATA_DIR / "shift_train.jsonl", shift_train)
    write_jsonl(DATA_DIR / "shift_eval.jsonl", shift_eval)
    print(f"shift_eval: {len(shift_eval)} rows, {len({r['output'] for r in shift_eval})} distinct outputs")

    topics_train, topics_eval = make_topics(200, 50, seed=SEED + 1)
    topic_report(topics_train, topics_eval)
    write_jsonl(DATA_DIR / "topics_train.jsonl", topics_train)
    write_jsonl(DATA_DIR / "topics_eval.jsonl", topics_eval)

    write_jsonl(DATA_DIR / "tiny_chat.jsonl", make_tiny_chat(48, seed=SEED + 2))
    completion = make_tiny_completion(48, seed=SEED + 3)
    lengths = [len(r["text"].split()) for r in completion]
    print(f"tiny_completion word counts: min={min(lengths)} max={max(lengths)}")
    write_jsonl(DATA_DIR / "tiny_completion.jsonl", completion)
    write_csv(DATA_DIR / "tiny_classification.csv", make_tiny_classification(40, seed=SEED + 4), ["text", "label"])

    tools_train, tools_eval = make_tools(1200, 180, seed=SEED + 8)
    write_jsonl(DATA_DIR / "tools_train.jsonl", tools_train)
    write_jsonl(DATA_DIR / "tools_eval.jsonl", tools_eval)


if __name__ == "__main__":
    main()
