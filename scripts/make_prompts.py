"""Write prompt files for a task: ``python scripts/make_prompts.py {shapes,geneval,ocr} [--out configs/prompts]``.

Every file is deterministic (the same files every time for the same options), and train and test are disjoint.

shapes: ``shapes_train.jsonl`` (every train-split prompt of ``flowgrpo.shapes``, balanced so that each of the
six tags fills the same number of lines) and ``shapes_test.jsonl`` (held-out prompts, the same number per
tag; a tag with fewer held-out prompts than lines repeats them, and evaluation gives every line its own
noise). The tags take turns line by line, so the first lines (the ones image grids show) cover every tag.
Each line: ``{"prompt": ..., "tag": ...}``.

geneval: GenEval's metadata lines (``{"tag", "include", ["exclude"], "prompt"}``, as djghosh13/geneval
``prompts/create_prompts.py`` writes them; the ``geneval`` reward reads them).
  - ``geneval_test.jsonl``: GenEval's benchmark itself, regenerated with its generator and seed (43, 100 per task:
    553 prompts, 80 / 99 / 80 / 94 / 100 / 100 for single_object / two_object / counting / colors / position /
    color_attr), each prompt ``--test-repeats`` times (4: GenEval's 4 images per prompt, and the 2212 lines of
    Flow-GRPO's ``dataset/geneval`` test set).
  - ``geneval_train.jsonl``: GenEval's six generators with other seeds, ``--train-per-tag`` lines per tag, minus
    every prompt that names the same objects (class, count, colour; in any order, any relation) as a test prompt:
    the deduplication Flow-GRPO describes (its issue #4), made stricter for ``position``. GenEval's suite holds all
    80 single objects, so single_object has no training prompts; counting (240 combinations) and colors (790) have
    fewer unique ones than lines, which then repeat them.

ocr: quoted-text prompts (``ocr_train.txt`` / ``ocr_test.txt``, one a line) from scene templates ("a neon sign
above a bar that reads "{text}"") and generated texts; no text (compared as the OCR reward compares, ignoring
case and spaces) appears in both files. Default sizes: 10000 train, 1018 test (Flow-GRPO's OCR test set size).
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rewards.geneval import CLASSES, COLORS, RELATIONS, TAGS  # noqa: E402

# ------------------------------------------------------------------------------------------------ geneval
# The generators of djghosh13/geneval prompts/create_prompts.py, call for call (same rng draws in the same order).

NUMBERS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten")
PERSON = CLASSES.index("person")  # GenEval writes no "[colour] person" prompts
Sample = dict[str, Any]


def with_article(name: str) -> str:
    return f"an {name}" if name[0] in "aeiou" else f"a {name}"


def make_plural(name: str) -> str:
    return f"{name}es" if name[-1] == "s" else f"{name}s"


def _object(index: Any, count: int = 1, **extra: Any) -> dict[str, Any]:
    return {"class": CLASSES[int(index)], "count": count, **extra}


def single_objects(rng: np.random.Generator, size: int) -> list[Sample]:
    idxs = rng.choice(len(CLASSES), size=size, replace=False)
    return [
        {"tag": "single_object", "include": [_object(i)], "prompt": f"a photo of {with_article(CLASSES[i])}"}
        for i in idxs
    ]


def two_object(rng: np.random.Generator) -> Sample:
    a, b = rng.choice(len(CLASSES), size=2, replace=False)
    prompt = f"a photo of {with_article(CLASSES[a])} and {with_article(CLASSES[b])}"
    return {"tag": "two_object", "include": [_object(a), _object(b)], "prompt": prompt}


def counting(rng: np.random.Generator, max_count: int = 4) -> Sample:
    i = rng.choice(len(CLASSES))
    n = int(rng.integers(2, max_count, endpoint=True))
    return {
        "tag": "counting",
        "include": [_object(i, n)],
        "exclude": [_object(i, n + 1)],
        "prompt": f"a photo of {NUMBERS[n]} {make_plural(CLASSES[i])}",
    }


def colors(rng: np.random.Generator) -> Sample:
    i = (rng.choice(len(CLASSES) - 1) + 1 + PERSON) % len(CLASSES)
    color = COLORS[rng.choice(len(COLORS))]
    prompt = f"a photo of {with_article(color)} {CLASSES[i]}"
    return {"tag": "colors", "include": [_object(i, color=color)], "prompt": prompt}


def position(rng: np.random.Generator) -> Sample:
    a, b = rng.choice(len(CLASSES), size=2, replace=False)
    relation = RELATIONS[rng.choice(len(RELATIONS))]
    prompt = f"a photo of {with_article(CLASSES[a])} {relation} {with_article(CLASSES[b])}"
    return {"tag": "position", "include": [_object(b), _object(a, position=[relation, 0])], "prompt": prompt}


def color_attr(rng: np.random.Generator) -> Sample:
    a, b = (rng.choice(len(CLASSES) - 1, size=2, replace=False) + 1 + PERSON) % len(CLASSES)
    ca, cb = rng.choice(len(COLORS), size=2, replace=False)
    prompt = f"a photo of {with_article(COLORS[ca])} {CLASSES[a]} and {with_article(COLORS[cb])} {CLASSES[b]}"
    return {
        "tag": "color_attr",
        "include": [_object(a, color=COLORS[ca]), _object(b, color=COLORS[cb])],
        "prompt": prompt,
    }


GENERATORS: dict[str, Callable[[np.random.Generator], Sample]] = {
    "single_object": lambda rng: single_objects(rng, 1)[0],
    "two_object": two_object,
    "counting": counting,
    "colors": colors,
    "position": position,
    "color_attr": color_attr,
}


def _exact(sample: Sample) -> str:
    return json.dumps(sample, sort_keys=True)


def geneval_suite(seed: int = 43, per_task: int = 100) -> list[Sample]:
    """GenEval's ``generate_suite``: all 80 single objects, ``per_task`` draws of each other task, exact duplicates
    dropped (seed 43, 100: the benchmark's 553 prompts, in its order)."""
    rng = np.random.default_rng(seed)
    samples = single_objects(rng, len(CLASSES))
    for tag in TAGS[1:]:
        samples += [GENERATORS[tag](rng) for _ in range(per_task)]
    return list({_exact(s): s for s in samples}.values())


def objects_key(sample: Sample) -> tuple:
    """What a prompt asks for, ignoring the order of its objects and its relation: two prompts with the same key are
    one prompt for the train/test split ("a photo of A and B" = "a photo of B and A"; "A left of B" = "B above A")."""
    objects = sorted((o["class"], o["count"], o.get("color", "")) for o in sample["include"])
    return sample["tag"], tuple(objects)


def geneval_train(test: list[Sample], per_tag: int, seed: int = 0, patience: int = 2000) -> list[Sample]:
    """``per_tag`` lines of each tag from GenEval's generators (one random stream per tag, seeded by ``seed``),
    without the test prompts' objects; a tag stops drawing after ``patience`` draws in a row found nothing new, and
    repeats its unique prompts (shuffled) to fill its lines. Tags with no prompt left are omitted."""
    held = {objects_key(s) for s in test}
    by_tag: dict[str, list[Sample]] = {}
    for k, tag in enumerate(TAGS):
        rng = np.random.default_rng([seed, k])
        unique: dict[str, Sample] = {}
        misses = 0
        while len(unique) < per_tag and misses < patience:
            sample = GENERATORS[tag](rng)
            key = _exact(sample)
            if key in unique or objects_key(sample) in held:
                misses += 1
                continue
            unique[key], misses = sample, 0
        pool = list(unique.values())
        if pool:
            order = rng.permutation(len(pool))
            by_tag[tag] = [pool[order[i % len(pool)]] for i in range(per_tag)]
    return round_robin(list(by_tag.values()))


def round_robin(groups: list[list[Any]]) -> list[Any]:
    """One item of each group in turn (the first lines of a file, which image grids show, cover every group)."""
    return [x for row in itertools.zip_longest(*groups) for x in row if x is not None]


def write_jsonl(path: Path, samples: list[Sample]) -> None:
    path.write_text("".join(json.dumps(s) + "\n" for s in samples), encoding="utf-8")


def make_geneval(out: Path, train_per_tag: int, test_repeats: int, seed: int) -> str:
    suite = geneval_suite()
    by_tag = [[s for s in suite if s["tag"] == tag] for tag in TAGS]
    test = round_robin(by_tag) * test_repeats
    train = geneval_train(suite, train_per_tag, seed)
    write_jsonl(out / "geneval_test.jsonl", test)
    write_jsonl(out / "geneval_train.jsonl", train)
    tags = ", ".join(f"{t} {sum(s['tag'] == t for s in train)}" for t in TAGS)
    unique = len({_exact(s) for s in train})
    return (
        f"wrote {out}/geneval_test.jsonl ({len(test)} lines: GenEval's {len(suite)} prompts x {test_repeats}) and "
        f"geneval_train.jsonl ({len(train)} lines, {unique} unique: {tags})"
    )


# ------------------------------------------------------------------------------------------------ ocr

OCR_SCENES = (
    'a wooden sign in a park that says "{text}"',
    'a neon sign above a bar that reads "{text}"',
    'a chalkboard menu outside a cafe with the words "{text}"',
    'a birthday cake with icing that spells "{text}"',
    'a protest banner reading "{text}"',
    'a book cover titled "{text}"',
    'a street sign that says "{text}"',
    'a t-shirt printed with the text "{text}"',
    'a coffee mug with the words "{text}"',
    'a storefront window with the text "{text}"',
    'a vintage travel poster with the text "{text}"',
    'a billboard on a highway that reads "{text}"',
    'a handwritten sticky note that says "{text}"',
    'a movie poster with the title "{text}"',
    'a graffiti mural on a brick wall that says "{text}"',
    'a glowing sign in a dark alley reading "{text}"',
    'a bakery box stamped with "{text}"',
    'a banner above a stage that reads "{text}"',
    'a doormat that says "{text}"',
    'a paper lantern painted with the words "{text}"',
    'a food truck with "{text}" painted on its side',
    'a hot air balloon with "{text}" written across it',
    'the words "{text}" written in the sand on a beach',
    'a laptop sticker that says "{text}"',
    'a typewritten page with the words "{text}"',
    'a cereal box labeled "{text}"',
    'a wine bottle label reading "{text}"',
    'a hand-painted sign on a farm stand that says "{text}"',
    'a magazine cover with the headline "{text}"',
    'a greeting card that says "{text}"',
    'a whiteboard in an office with "{text}" written on it',
    'a baseball cap embroidered with "{text}"',
    'a tote bag printed with "{text}"',
    'a road sign in the desert that reads "{text}"',
    'a spaceship hull painted with "{text}"',
    'a rooftop sign on a city building that says "{text}"',
    'a ribbon on a trophy that reads "{text}"',
    'a skateboard deck with "{text}" in bold letters',
    'a bookstore window with a sign that says "{text}"',
    'a frosted window with "{text}" drawn in it with a finger',
    'an airport departure board showing "{text}"',
    'a pixel art video game title screen reading "{text}"',
    'a wedding invitation with the words "{text}"',
    'a subway station wall tile that says "{text}"',
    'a pumpkin carved with the word "{text}"',
    'a jar of jam with a label that says "{text}"',
    'a school notebook with "{text}" written on the cover',
    'a lighted marquee of an old theater reading "{text}"',
)
_ADJECTIVES = (
    "Fresh",
    "Happy",
    "Grand",
    "Golden",
    "Silver",
    "Wild",
    "Quiet",
    "Lucky",
    "Sunny",
    "Secret",
    "Magic",
    "Royal",
    "Urban",
    "Daily",
    "Green",
    "Blue",
    "Red",
    "Old",
    "New",
    "Sweet",
    "Spicy",
    "Smart",
    "Brave",
    "Cosmic",
    "Electric",
    "Tiny",
    "Super",
    "Lazy",
    "Midnight",
    "Morning",
    "Summer",
    "Winter",
    "Ocean",
    "Crystal",
    "Velvet",
    "Rusty",
    "Honest",
    "Hidden",
    "Little",
    "Northern",
    "Southern",
    "Jolly",
    "Purple",
    "Mighty",
    "Humble",
    "Lonely",
)
_NOUNS = (
    "Coffee",
    "Bakery",
    "Garden",
    "Market",
    "Books",
    "Pizza",
    "Music",
    "Studio",
    "Dreams",
    "Station",
    "Harbor",
    "Tacos",
    "Donuts",
    "Library",
    "Cinema",
    "Theater",
    "Park",
    "Farm",
    "Kitchen",
    "Club",
    "Cafe",
    "Diner",
    "Hotel",
    "Records",
    "Games",
    "Robots",
    "Rockets",
    "Planet",
    "Forest",
    "Island",
    "River",
    "Mountain",
    "Valley",
    "Bridge",
    "Tower",
    "Castle",
    "Lab",
    "Factory",
    "Garage",
    "Salon",
    "Florist",
    "Pets",
    "Circus",
    "Arcade",
    "Bistro",
    "Brewery",
    "Creamery",
    "Deli",
    "Grill",
    "Noodles",
    "Sushi",
    "Lemonade",
    "Cookies",
    "Bikes",
    "Tea House",
    "Radio",
    "Lanterns",
    "Orchard",
    "Workshop",
    "Gallery",
)
_PHRASES = (
    "Keep Off The Grass",
    "Open Late",
    "Save The Bees",
    "Hello World",
    "Grand Opening",
    "No Parking",
    "Welcome Home",
    "Thank You",
    "Stay Calm",
    "Good Vibes Only",
    "Be Kind",
    "Dream Big",
    "Game Over",
    "Exit Only",
    "Do Not Disturb",
    "Wet Paint",
    "Slow Down",
    "Private Office",
    "Staff Only",
    "Push",
    "Pull",
    "Sold Out",
    "Back In Five Minutes",
    "Best Friends Forever",
    "Live Laugh Love",
    "Mind The Gap",
    "Now Boarding",
    "Lost And Found",
    "Handle With Care",
    "This Way Up",
    "Fragile",
    "Think Different",
    "Just Married",
    "Happy Holidays",
    "Merry Christmas",
    "Happy New Year",
    "Trick Or Treat",
    "Reading Is Magic",
    "Coffee First",
    "Plant More Trees",
    "Vote Today",
    "Free Hugs",
    "No Entry",
    "Ring The Bell",
    "Beware Of Dog",
    "Fresh Eggs",
    "Hot Soup",
    "Ice Cold Drinks",
    "Farm To Table",
    "Made With Love",
    "Follow Your Heart",
    "Never Give Up",
    "Stay Curious",
    "Keep Going",
    "Good Morning",
    "See You Soon",
    "Once Upon A Time",
    "The End",
    "Silence Please",
    "Quiet Zone",
)
_NUMBERED = (
    "Open {n} Hours",
    "Exit {n}",
    "Room {n}",
    "Route {n}",
    "Sale {n}% Off",
    "Since {year}",
    "Est. {year}",
    "Happy {n}th Birthday",
    "Gate B{n}",
    "Platform {n}",
    "Table {n}",
    "Class Of {year}",
    "Apartment {n}C",
    "Speed Limit {n}",
    "Aisle {n}",
    "Flight {n}{n}",
)


def ocr_texts() -> list[str]:
    """Every candidate text (unique as the OCR reward compares them), in a fixed order."""
    texts = [f"{a} {n}" for a in _ADJECTIVES for n in _NOUNS] + list(_PHRASES)
    for pattern in _NUMBERED:
        texts += [pattern.format(n=n, year=1900 + 7 * n) for n in range(4, 19)]
    return list({_ocr_key(t): t for t in texts}.values())


def _ocr_key(text: str) -> str:
    return "".join(text.split()).lower()


def ocr_prompts(train_size: int, test_size: int, seed: int = 0) -> tuple[list[str], list[str]]:
    """(train, test): unique prompts; the test texts (one per test prompt) never appear in train."""
    rng = np.random.default_rng(seed)
    texts = ocr_texts()
    texts = [texts[i] for i in rng.permutation(len(texts))]
    if test_size >= len(texts):
        raise ValueError(f"ocr: --test-size must be below the {len(texts)} texts the generator has")
    test_texts, train_texts = texts[:test_size], texts[test_size:]
    test = [OCR_SCENES[rng.integers(len(OCR_SCENES))].format(text=t) for t in test_texts]
    pairs = len(train_texts) * len(OCR_SCENES)
    if train_size > pairs:
        raise ValueError(f"ocr: --train-size must be at most {pairs} (texts x scenes left for training)")
    chosen = rng.choice(pairs, size=train_size, replace=False)
    train = [OCR_SCENES[i % len(OCR_SCENES)].format(text=train_texts[i // len(OCR_SCENES)]) for i in chosen]
    return train, test


def make_ocr(out: Path, train_size: int, test_size: int, seed: int) -> str:
    train, test = ocr_prompts(train_size, test_size, seed)
    (out / "ocr_train.txt").write_text("".join(p + "\n" for p in train), encoding="utf-8")
    (out / "ocr_test.txt").write_text("".join(p + "\n" for p in test), encoding="utf-8")
    return f"wrote {out}/ocr_train.txt ({len(train)} prompts) and ocr_test.txt ({len(test)} prompts, held-out texts)"


# ------------------------------------------------------------------------------------------------ shapes


def make_shapes(out: Path, train_per_tag: int, test_per_tag: int) -> str:
    from flowgrpo.shapes import balanced_prompts, split, write_prompt_file
    from flowgrpo.shapes import round_robin as shapes_round_robin

    train, test = split()
    write_prompt_file(out / "shapes_train.jsonl", shapes_round_robin(balanced_prompts(train, train_per_tag, seed=0)))
    write_prompt_file(out / "shapes_test.jsonl", shapes_round_robin(balanced_prompts(test, test_per_tag, seed=1)))
    return (
        f"wrote {out}/shapes_train.jsonl ({6 * train_per_tag} lines from {len(train)} prompts) and "
        f"shapes_test.jsonl ({6 * test_per_tag} lines from {len(test)} held-out prompts)"
    )


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1; got {value}")
    return value


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    tasks = parser.add_subparsers(dest="task", required=True)
    shapes = tasks.add_parser("shapes", help="the shapes task's prompts (flowgrpo.shapes)")
    shapes.add_argument("--train-per-tag", type=_positive, default=64)
    shapes.add_argument("--test-per-tag", type=_positive, default=32)
    geneval = tasks.add_parser("geneval", help="GenEval metadata: its benchmark as test, generated train prompts")
    geneval.add_argument("--train-per-tag", type=_positive, default=1000, help="train lines per tag")
    geneval.add_argument("--test-repeats", type=_positive, default=4, help="copies of each benchmark prompt")
    geneval.add_argument("--seed", type=int, default=0, help="seed of the train prompts (the test set is fixed)")
    ocr = tasks.add_parser("ocr", help="quoted-text prompts for the OCR reward")
    ocr.add_argument("--train-size", type=_positive, default=10000)
    ocr.add_argument("--test-size", type=_positive, default=1018)
    ocr.add_argument("--seed", type=int, default=0)
    for sub in (shapes, geneval, ocr):
        sub.add_argument("--out", type=Path, default=Path("configs/prompts"), help="folder for the files")
    args = parser.parse_args(argv)

    args.out.mkdir(parents=True, exist_ok=True)
    if args.task == "shapes":
        print(make_shapes(args.out, args.train_per_tag, args.test_per_tag))
    elif args.task == "geneval":
        print(make_geneval(args.out, args.train_per_tag, args.test_repeats, args.seed))
    else:
        try:
            print(make_ocr(args.out, args.train_size, args.test_size, args.seed))
        except ValueError as err:
            parser.error(str(err))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
