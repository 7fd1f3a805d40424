"""The fixed, seeded prompt mix the default model's draft head is trained and evaluated on (docs/speculative.md).

Five kinds, as one-turn chat messages: questions (chat), code, copy-editing, translation and summaries. Every
prompt is built from the word lists below, so the mix needs no download. Subjects are split once by a hash into
a training part (about 80 %) and a held-out part, so `split="heldout"` prompts never share a subject with
`split="train"` ones.

    prompts(n, split, seed, mix, exclude) -> list[(kind, text)]   deterministic for its arguments

Mix 1 is the head's first data set; mix 2 adds subjects and templates (the _2 lists) for a second one."""
from __future__ import annotations

import hashlib
import random

TOPICS = [
    "photosynthesis", "black holes", "the water cycle", "inflation", "machine learning", "the immune system",
    "volcanoes", "the French Revolution", "quantum computing", "climate change", "the stock market",
    "plate tectonics", "vaccines", "the Roman Empire", "renewable energy", "DNA", "the internet",
    "electric cars", "sleep", "the solar system", "coffee", "bees", "the printing press", "democracy",
    "gravity", "the ocean tides", "antibiotics", "blockchain", "the Renaissance", "earthquakes",
    "nutrition", "the moon landing", "recycling", "rainbows", "the human brain", "compound interest",
    "the Great Wall of China", "hurricanes", "jazz music", "chess", "the Olympic Games", "deserts",
    "supply and demand", "the speed of light", "rainforests", "meditation", "the Industrial Revolution",
    "tea", "dinosaurs", "the heart", "solar panels", "public libraries", "glaciers", "time zones",
    "the metric system", "honey", "penguins", "the Silk Road", "cloud computing", "opera",
]
ACTIVITIES = [
    "learning a new language", "running a marathon", "saving money", "starting a vegetable garden",
    "writing a resume", "public speaking", "studying for exams", "cooking for a family", "traveling on a budget",
    "working from home", "learning to code", "taking better photos", "reading more books", "staying focused",
    "planning a wedding", "moving to a new city", "training a puppy", "buying a used car", "hiking safely",
    "making friends as an adult", "keeping a journal", "organizing a closet", "preparing for an interview",
]
QUESTIONS = [
    "What is {t}?", "Explain {t} to a ten-year-old.", "Why is {t} important?", "Give me three facts about {t}.",
    "Write a short paragraph about {t}.", "What are common misconceptions about {t}?",
    "How would you describe {t} in simple terms?", "Write a haiku about {t}.", "Tell me a short story involving {t}.",
    "What are the pros and cons of {a}?", "Give me five tips for {a}.", "How do I get started with {a}?",
    "What mistakes should I avoid when {a}?", "Write a short motivational message about {a}.",
]
TASKS = [
    "reverses a string", "checks whether a number is prime", "returns the n-th Fibonacci number",
    "counts the vowels in a string", "merges two sorted lists", "removes duplicates from a list",
    "computes the factorial of a number", "finds the largest element in a list", "checks if a string is a palindrome",
    "converts Celsius to Fahrenheit", "sums the digits of an integer", "flattens a nested list",
    "counts word frequencies in a text", "returns the median of a list", "validates an email address",
    "computes the greatest common divisor of two numbers", "sorts a list of dictionaries by a key",
    "reads a CSV file and prints each row", "finds the second smallest number in a list",
    "capitalizes the first letter of every word", "checks whether two strings are anagrams",
    "implements binary search", "computes the average of a list of numbers", "generates a random password",
    "converts a binary string to an integer", "transposes a matrix", "checks if a year is a leap year",
]
LANGUAGES = ["Python", "JavaScript", "C", "Rust", "Go", "Java", "Bash", "TypeScript"]
CODE = [
    "Write a {l} function that {k}.", "Write a {l} function that {k}, with a docstring and an example.",
    "How do I write a {l} program that {k}?", "Show me {l} code that {k} and explain it line by line.",
    "Write a unit test for a {l} function that {k}.",
]
SENTENCES = [
    "me and him goes to the store yesterday", "their going to the park on sunday", "i has three cat and a dog",
    "the weather are nice today so we should went outside", "she dont like apples but she eat oranges",
    "we was late because the bus dont came", "he have finished his homework already", "its a beautiful day isnt it",
    "the childrens plays in the garden", "I seen that movie last week", "there is many reasons to learn math",
    "can you borrow me a pen", "the informations are on the table", "he is more taller than his brother",
    "I am agree with you", "the meeting will be hold tomorrow", "she sings good", "less people came than expected",
]
PLAIN = [
    "The train leaves at eight in the morning.", "I would like a cup of coffee, please.",
    "Where is the nearest library?", "My brother is learning to play the guitar.",
    "The museum is closed on Mondays.", "We are planning a trip to the mountains.",
    "Could you help me carry these boxes?", "The children are playing in the garden.",
    "This book is more interesting than the film.", "Please turn off the lights when you leave.",
    "It has been raining all week.", "The restaurant serves fresh fish every day.",
]
TARGETS = ["French", "Spanish", "German", "Italian"]
EDITS = [
    "Fix the grammar in this sentence: \"{s}\"", "Correct the spelling and grammar: {s}",
    "Rewrite this sentence in proper English: {s}",
]
TRANSLATIONS = ["Translate into {g}: {p}", "How do you say \"{p}\" in {g}?"]
SUMMARIES = [
    "Summarize in one sentence: {p} {q} {r}", "Rewrite this more formally: {p} {q}",
    "Make this text shorter: {p} {q} {r}", "Turn this into a bulleted list: {p} {q} {r}",
]
# Mix 2 adds these subjects and templates to mix 1's (whose prompts it leaves as they were).
TOPICS_2 = [
    "the Pythagorean theorem", "electricity", "the Cold War", "neural networks", "the stock exchange", "bacteria",
    "the Amazon river", "ancient Egypt", "cryptocurrency", "wind turbines", "the periodic table", "magnets",
    "the Eiffel Tower", "the human eye", "fermentation", "the Byzantine Empire", "nuclear fusion", "migration of birds",
    "coral reefs", "the Moon's phases", "photosynthetic algae", "the Enlightenment", "operating systems", "databases",
    "sound waves", "the Milky Way", "interest rates", "the Magna Carta", "tsunamis", "the printing of money",
    "bread baking", "origami", "the violin", "football", "mountains", "the Sahara", "wolves", "octopuses",
    "the Apollo program", "GPS", "3D printing", "the theory of evolution", "the economy of Japan", "rivers",
    "memory in the brain", "caffeine", "airplanes", "submarines", "the Internet of Things", "encryption",
]
ACTIVITIES_2 = [
    "learning to swim", "managing stress", "writing a novel", "starting a small business", "learning the piano",
    "cooking pasta", "painting with watercolors", "negotiating a salary", "running a meeting", "camping",
    "decorating a small apartment", "teaching a child to read", "growing tomatoes", "cycling to work",
    "writing a cover letter", "learning chess", "giving feedback to a colleague", "planning a road trip",
    "baking sourdough bread", "getting better sleep", "reducing screen time", "learning statistics",
]
QUESTIONS_2 = [
    "Explain the history of {t} briefly.", "What would happen if {t} did not exist?", "List five questions about {t}.",
    "Write a limerick about {t}.", "Describe {t} in three sentences.", "Write a quiz with three questions about {t}.",
    "Write a short dialogue between two friends about {t}.", "What is the most surprising thing about {t}?",
    "Write an email to a friend recommending {a}.", "Make a one-week plan for {a}.",
    "Write a checklist for {a}.", "Explain {a} as a step-by-step guide.", "What equipment do I need for {a}?",
]
TASKS_2 = [
    "parses a date string", "counts lines in a file", "implements a stack", "implements a queue with two stacks",
    "rotates a list by k positions", "finds all prime numbers below n", "converts a number to Roman numerals",
    "checks balanced parentheses", "computes the power set of a list", "finds the longest common prefix",
    "removes whitespace from a string", "merges two dictionaries", "computes a running sum", "chunks a list",
    "finds the mode of a list", "converts a string to title case", "computes the dot product of two vectors",
    "reverses the words in a sentence", "checks whether a list is sorted", "returns the unique characters of a string",
    "implements bubble sort", "implements quicksort", "computes the Levenshtein distance", "validates a phone number",
]
CODE_2 = [
    "Explain how to write a {l} function that {k}, then write it.", "Write a {l} class whose method {k}.",
    "Write a {l} function that {k}, and list its edge cases.", "Write a short {l} script that {k} and prints the result.",
]
KINDS = ("chat", "code", "edit", "translate", "summary")
WEIGHTS = (0.35, 0.35, 0.1, 0.1, 0.1)


def _split_of(subject: str) -> str:
    """'heldout' for about 20 % of subjects (a stable hash), else 'train'."""
    return "heldout" if hashlib.sha256(subject.encode()).digest()[0] < 52 else "train"


def _pick(rng: random.Random, words: list[str], split: str) -> str:
    part = [w for w in words if _split_of(w) == split] or words
    return rng.choice(part)


def prompt(rng: random.Random, split: str, mix: int = 1) -> tuple[str, str]:
    """One (kind, user message) of `split` ('train' or 'heldout') from mix 1 or mix 2 (mix 1 plus the _2 lists)."""
    kind = rng.choices(KINDS, WEIGHTS)[0]
    extra = mix == 2
    if kind == "chat":
        text = rng.choice(QUESTIONS + QUESTIONS_2 * extra).format(
            t=_pick(rng, TOPICS + TOPICS_2 * extra, split), a=_pick(rng, ACTIVITIES + ACTIVITIES_2 * extra, split))
    elif kind == "code":
        text = rng.choice(CODE + CODE_2 * extra).format(l=rng.choice(LANGUAGES),
                                                       k=_pick(rng, TASKS + TASKS_2 * extra, split))
    elif kind == "edit":
        text = rng.choice(EDITS).format(s=_pick(rng, SENTENCES, split))
    elif kind == "translate":
        text = rng.choice(TRANSLATIONS).format(g=rng.choice(TARGETS), p=_pick(rng, PLAIN, split))
    else:
        p, q, r = (_pick(rng, PLAIN, split) for _ in range(3))
        text = rng.choice(SUMMARIES).format(p=p, q=q, r=r)
    return kind, text


def prompts(n: int, split: str = "train", seed: int = 0, mix: int = 1,
            exclude: frozenset[str] = frozenset()) -> list[tuple[str, str]]:
    """n distinct (kind, message) pairs of `split` not in `exclude`, deterministic for the arguments; fewer when
    the mix has fewer distinct prompts than n."""
    if split not in ("train", "heldout"):
        raise ValueError(f"split must be 'train' or 'heldout', got {split!r}")
    rng, seen, out = random.Random(f"{split}:{seed}"), set(exclude), []
    for _ in range(50 * n):
        kind, text = prompt(rng, split, mix)
        if text not in seen:
            seen.add(text)
            out.append((kind, text))
            if len(out) == n:
                break
    return out
