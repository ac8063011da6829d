"""Offline data for the recipes: a synthetic SQuAD v1.1 set, a WordPiece tokenizer built locally, and
sklearn's digits written as an ImageNet-style folder.

The Hub is not reachable in CI, so each recipe keeps its real loading path (SQuAD JSON, an image folder) and
feeds it data made here:

- `make_squad_dataset` writes extractive-QA files in the SQuAD v1.1 JSON format. Paragraphs describe 2-3
  invented people with facts of the same kinds (birth year, city, job, favorite color, counts of things), so
  every question has same-type distractors in its paragraph: the answer type alone gives about 55 EM (a random
  fact of the right type), the name and relation words are needed for the rest. A 2-layer BERT trained from
  scratch learns the answer types within a few hundred steps; the binding to names takes far longer.
- `load_squad_json` flattens SQuAD JSON into the columns of the HF ``squad`` dataset; real files load too.
- `build_wordpiece_tokenizer` builds a BERT WordPiece vocabulary (deterministically) and wraps it as a
  transformers fast tokenizer (offsets, ``sequence_ids``, ``save_pretrained``).
- `write_digits_image_folder` writes the 1797 real 8x8 digits as ``train/<class>/*.png`` and
  ``val/<class>/*.png``.
"""

from __future__ import annotations

import collections
import json
import os
import random
from collections.abc import Iterable, Sequence

__all__ = ["make_squad_dataset", "load_squad_json", "build_wordpiece_tokenizer", "write_digits_image_folder"]

BERT_SPECIAL_TOKENS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]

# ---------------------------------------------------------------------------------------------------------------
# Synthetic SQuAD
# ---------------------------------------------------------------------------------------------------------------

_FIRST_NAMES = {
    "she": [
        "Alice", "Beatrix", "Clara", "Daria", "Elena", "Freya", "Greta", "Hanna", "Irene", "Julia", "Katya",
        "Lena", "Maren", "Nadia", "Olga", "Petra", "Rosa", "Sonia", "Tilda", "Vera", "Wanda", "Yara", "Zofia",
        "Mira", "Ingrid",
    ],
    "he": [
        "Anton", "Bruno", "Carlo", "Dmitri", "Emil", "Felix", "Gustav", "Henrik", "Igor", "Jonas", "Karl",
        "Lukas", "Marek", "Nils", "Oskar", "Pavel", "Rafael", "Stefan", "Tomas", "Viktor", "Walter", "Yusuf",
        "Zoran", "Milan", "Hugo",
    ],
}  # fmt: skip
_LAST_NAMES = [
    "Abbot", "Brandt", "Castell", "Dorn", "Ekberg", "Falk", "Grimaldi", "Holm", "Ivers", "Jansen", "Kessler",
    "Lindqvist", "Moreau", "Novak", "Ostrow", "Pellegrini", "Quist", "Rostova", "Sandoval", "Thorne", "Ulrich",
    "Varga", "Weller", "Yilmaz", "Zeller", "Adler", "Bianchi", "Coelho", "Dvorak", "Engel", "Fischer", "Horvat",
    "Kowalski", "Larsen", "Mazur", "Nowak", "Petrov", "Richter", "Svensson", "Vogel",
]  # fmt: skip
_CITIES = [
    "Tolvik", "Quenby", "Marrowgate", "Ostrava", "Lindenfeld", "Port Aster", "Kelmarsh", "Valbruna", "Esterhoff",
    "Dunmore", "Saltcombe", "Rivenholt", "Amberley", "Corvallo", "Northwick", "Bellhaven", "Kastelruth", "Pinecrest",
    "Glenmoor", "Westerly", "Halden", "Brightwater", "Oakridge", "Stonebury", "Fairhollow", "Redcliff", "Ironvale",
    "Lakeshire", "Silverton", "Mistral Bay",
]  # fmt: skip
_JOBS = [
    "baker", "carpenter", "chemist", "dentist", "engineer", "farmer", "gardener", "historian", "journalist",
    "lawyer", "librarian", "mechanic", "musician", "nurse", "painter", "pharmacist", "pilot", "plumber", "sculptor",
    "surgeon", "tailor", "teacher", "translator", "veterinarian", "architect", "geologist", "potter", "weaver",
]  # fmt: skip
_COLORS = [
    "red", "blue", "green", "yellow", "purple", "orange", "teal", "crimson", "violet", "amber", "silver", "gold",
    "indigo", "maroon", "turquoise", "beige",
]  # fmt: skip
_THINGS = ["cats", "dogs", "books", "bicycles", "guitars", "paintings", "chickens", "clocks", "lamps", "boats"]

# Relations, grouped by answer type: name -> (fact templates, question templates). In facts {S}/{s} is the subject
# (a name or a pronoun), {P} its possessive, {A} "a"/"an", {V} the answer, {T} a plural noun; in questions {N} is
# the name. Same-type facts in a paragraph are the distractors: the name and the relation words (born, retired,
# sister, car, ...) around each value are what tells them apart.
RELATIONS = {
    "year": {
        "born_year": (
            ["{S} was born in {V}.", "{S} was born in the year {V}."],
            ["When was {N} born?", "In which year was {N} born?"],
        ),
        "graduated": (
            ["{S} graduated from college in {V}.", "In {V}, {s} graduated from college."],
            ["When did {N} graduate from college?", "In what year did {N} graduate?"],
        ),
        "married": (
            ["{S} got married in {V}.", "In {V}, {s} got married."],
            ["When did {N} get married?", "In which year did {N} marry?"],
        ),
        "retired": (
            ["{S} retired in {V}.", "In {V}, {s} retired."],
            ["When did {N} retire?", "In what year did {N} retire?"],
        ),
    },
    "city": {
        "born_city": (
            ["{S} was born in {V}.", "{S} was born in the city of {V}."],
            ["Where was {N} born?", "In which city was {N} born?"],
        ),
        "lives": (
            ["{S} lives in {V}.", "{S} now lives in {V}."],
            ["Where does {N} live?", "Which city does {N} live in?"],
        ),
        "works_in": (
            ["{S} works in {V}.", "{P} office is in {V}."],
            ["Where does {N} work?", "In which city does {N} work?"],
        ),
        "sister_city": (
            ["{P} sister lives in {V}.", "{P} sister moved to {V}."],
            ["Where does {N}'s sister live?", "Which city does {N}'s sister live in?"],
        ),
    },
    "job": {
        "job": (
            ["{S} works as {A} {V}.", "{S} is {A} {V}."],
            ["What is {N}'s job?", "What does {N} do for a living?"],
        ),
        "father_job": (
            ["{P} father was {A} {V}.", "{P} father worked as {A} {V}."],
            ["What was {N}'s father's job?", "What did {N}'s father do?"],
        ),
        "sister_job": (
            ["{P} sister is {A} {V}.", "{P} sister works as {A} {V}."],
            ["What does {N}'s sister do?", "What is the job of {N}'s sister?"],
        ),
    },
    "color": {
        "favorite": (
            ["{P} favorite color is {V}.", "{S} likes the color {V} best."],
            ["What is {N}'s favorite color?", "Which color does {N} like best?"],
        ),
        "car": (
            ["{S} drives {A} {V} car.", "{P} car is {V}."],
            ["What color is {N}'s car?", "What color car does {N} drive?"],
        ),
        "house": (
            ["{P} house is painted {V}.", "{S} lives in {A} {V} house."],
            ["What color is {N}'s house?", "What color is the house of {N}?"],
        ),
    },
    "count": {
        "owns": (
            ["{S} owns {V} {T}.", "{S} has {V} {T}."],
            ["How many {T} does {N} own?", "How many {T} does {N} have?"],
        ),
    },
}
# One relation per answer type: the other people's facts are the distractors (learnable by a tiny BERT).
DEFAULT_RELATIONS = ("born_year", "lives", "job", "favorite", "owns")
_VALUE_POOLS = {
    "year": [str(y) for y in range(1850, 2021)],
    "count": [str(c) for c in range(2, 60)],
    "city": _CITIES,
    "job": _JOBS,
    "color": _COLORS,
}


def _make_paragraph(
    rng: random.Random, num_people: int, facts_per_person: tuple[int, int], relations: dict, num_questions: int
) -> tuple[str, str, list]:
    """A paragraph about ``num_people`` people with a few facts each; returns title, context and questions.

    Questions are (question, answer_text, answer_start) triples. All values of one answer type in a paragraph
    are distinct, so every other fact of that type is a distractor with a different answer.
    """
    people = []
    for _ in range(num_people):
        pronoun = rng.choice(("she", "he"))
        taken = {p[0] for p in people}  # first names are unique within a paragraph
        first = rng.choice([f for f in _FIRST_NAMES[pronoun] if f not in taken])
        facts = rng.sample(sorted(relations), rng.randint(*facts_per_person))
        people.append((first, rng.choice(_LAST_NAMES), pronoun, facts))
    # draw each answer type's values at once, so they are distinct across people and relations
    needed = collections.Counter(relations[r][0] for p in people for r in p[3])
    values = {t: rng.sample(_VALUE_POOLS[t], n) for t, n in sorted(needed.items())}
    nouns = rng.sample(_THINGS, needed["count"])

    context, qas = "", []
    for first, last, pronoun, facts in people:
        full, possessive = f"{first} {last}", "her" if pronoun == "she" else "his"
        for k, rel in enumerate(facts):
            answer_type, fact_templates, question_templates = relations[rel]
            value = values[answer_type].pop()
            noun = nouns.pop() if answer_type == "count" else ""
            # the first sentence names the person in full; later ones the first name or a pronoun
            use_pronoun = k > 0 and rng.random() < 0.5
            subject = full if k == 0 else (pronoun if use_pronoun else first)
            poss = f"{full}'s" if k == 0 else (possessive if use_pronoun else f"{first}'s")
            article = "an" if value[0] in "aeiou" else "a"
            sentence = rng.choice(fact_templates).format(S=subject, s=subject, P=poss, A=article, V="\0", T=noun)
            sentence = sentence[0].upper() + sentence[1:]
            if context:
                context += " "
            start = len(context) + sentence.index("\0")
            context += sentence.replace("\0", value)
            question = rng.choice(question_templates).format(N=rng.choice((full, first)), T=noun)
            qas.append((question, value, start))
    title = " and ".join(f"{p[0]} {p[1]}" for p in people)
    return title, context, rng.sample(qas, min(num_questions, len(qas)))


def _squad_split(
    rng: random.Random, num_questions: int, prefix: str, people_range: tuple[int, int], paragraph_kwargs: dict
) -> dict:
    data, count = [], 0
    while count < num_questions:
        title, context, qas = _make_paragraph(rng, rng.randint(*people_range), **paragraph_kwargs)
        qas = qas[: num_questions - count]
        entries = [
            {"id": f"{prefix}-{len(data):05d}-{i}", "question": q, "answers": [{"text": text, "answer_start": start}]}
            for i, (q, text, start) in enumerate(qas)
        ]
        data.append({"title": title, "paragraphs": [{"context": context, "qas": entries}]})
        count += len(entries)
    return {"version": "1.1", "data": data}


def make_squad_dataset(
    out_dir: str | os.PathLike,
    num_train: int = 2400,
    num_eval: int = 240,
    seed: int = 0,
    people_per_paragraph: tuple[int, int] = (2, 3),
    facts_per_person: tuple[int, int] = (3, 4),
    questions_per_paragraph: int = 3,
    relations: Sequence[str] = DEFAULT_RELATIONS,
) -> tuple[str, str]:
    """Write a synthetic extractive-QA set as SQuAD v1.1 JSON (``train.json``, ``dev.json``); return both paths.

    Each paragraph describes a few invented people, e.g. "Oskar Larsen lives in Marrowgate. He owns 51 books.
    Emil Engel lives in Tolvik. ..." and asks "Where does Oskar live?". Answers are spans of the context; the
    other facts of the same type are distractors, so the question's name and relation words must be used.
    With the defaults, contexts are 25-70 words (``max_seq_length=128`` fits them with the question) and
    picking a random fact of the right type gives about 55 EM.

    Pure Python and deterministic: the same arguments give the same bytes. Train and eval come from separate
    random streams, so eval paragraphs are new combinations of names and values.

    Args:
        out_dir: folder for the two files (created if missing).
        num_train, num_eval: number of questions in each split (eval has answers, as SQuAD dev does).
        seed: seed of the `random.Random` streams.
        people_per_paragraph: inclusive (min, max) number of people in a paragraph (more => more distractors).
        facts_per_person: inclusive (min, max) number of facts per person, at most one per relation.
        questions_per_paragraph: questions asked about each paragraph; its other facts stay unasked.
        relations: names from `RELATIONS`. Several of one answer type (e.g. "born_year" and "retired") add
            distractors within a person's own facts (harder).
    """
    unknown = sorted(set(relations) - {name for group in RELATIONS.values() for name in group})
    if unknown:
        raise ValueError(f"unknown relations {unknown}; choose from {[n for g in RELATIONS.values() for n in g]}")
    chosen = {n: (t, *RELATIONS[t][n]) for t in RELATIONS for n in RELATIONS[t] if n in relations}
    lo, hi = people_per_paragraph
    f_lo, f_hi = facts_per_person
    if not (1 <= lo <= hi <= len(_FIRST_NAMES["he"])) or not (1 <= f_lo <= f_hi <= len(chosen)):
        raise ValueError(
            f"need 1 <= people_per_paragraph[0] <= [1] and 1 <= facts_per_person[0] <= [1] <= {len(chosen)} "
            f"(the number of relations), got {people_per_paragraph} and {facts_per_person}"
        )
    per_type = collections.Counter(t for t, *_ in chosen.values())
    for answer_type, n in per_type.items():  # worst case: every person has every relation of this type
        pool = len(_THINGS) if answer_type == "count" else len(_VALUE_POOLS[answer_type])
        if hi * min(n, f_hi) > pool:
            raise ValueError(f"{hi} people x {min(n, f_hi)} '{answer_type}' facts exceed the {pool} distinct values")
    if questions_per_paragraph < 1 or num_train < 0 or num_eval < 0:
        raise ValueError("questions_per_paragraph must be >= 1 and num_train, num_eval >= 0")

    os.makedirs(out_dir, exist_ok=True)
    paths = []
    for split, num_questions in (("train", num_train), ("dev", num_eval)):
        rng = random.Random(f"{seed}-{split}")  # str seeds are hashed with sha512: stable across runs
        paragraph_kwargs = {
            "facts_per_person": (f_lo, f_hi),
            "relations": chosen,
            "num_questions": questions_per_paragraph,
        }
        payload = _squad_split(rng, num_questions, f"synth-{split}", (lo, hi), paragraph_kwargs)
        path = os.path.join(out_dir, f"{split}.json")
        # atomically: several processes of one job may write the same bytes while others already read them
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(payload, f, ensure_ascii=False)
        os.replace(tmp, path)
        paths.append(path)
    return paths[0], paths[1]


def load_squad_json(path: str | os.PathLike):
    """Load a SQuAD v1.1-format JSON file as a `datasets.Dataset` with the HF ``squad`` columns.

    Columns: ``id``, ``title``, ``context``, ``question``, ``answers`` = ``{"text": [...], "answer_start": [...]}``,
    one row per question, in file order, as HF's squad loader flattens it (contexts are not stripped).
    """
    from datasets import Dataset, Features, Value

    try:
        from datasets import List
    except ImportError:  # datasets < 4
        from datasets import Sequence as List

    features = Features(
        {
            "id": Value("string"),
            "title": Value("string"),
            "context": Value("string"),
            "question": Value("string"),
            "answers": {"text": List(Value("string")), "answer_start": List(Value("int32"))},
        }
    )
    fmt = 'SQuAD v1.1 format: {"data": [{"title": ..., "paragraphs": [{"context": ..., "qas": [...]}]}]}'
    with open(path, encoding="utf-8") as f:
        try:
            squad = json.load(f)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path} is not valid JSON ({exc}); the dataset files need {fmt}.") from exc
    if not isinstance(squad, dict) or not isinstance(squad.get("data"), list):
        raise ValueError(f"{path} has no 'data' list; the dataset files need {fmt}.")
    columns: dict[str, list] = {name: [] for name in features}
    try:
        for article in squad["data"]:
            title = article.get("title", "")
            for paragraph in article["paragraphs"]:
                for qa in paragraph["qas"]:
                    columns["id"].append(qa["id"])
                    columns["title"].append(title)
                    columns["context"].append(paragraph["context"])
                    columns["question"].append(qa["question"])
                    columns["answers"].append(
                        {
                            "text": [a["text"] for a in qa["answers"]],
                            "answer_start": [a["answer_start"] for a in qa["answers"]],
                        }
                    )
    except (KeyError, TypeError, AttributeError) as exc:
        where = f"question {len(columns['id'])}" if columns["id"] else "its first article"
        raise ValueError(f"{path}: {where} does not follow {fmt} ({type(exc).__name__}: {exc}).") from exc
    return Dataset.from_dict(columns, features=features)


# ---------------------------------------------------------------------------------------------------------------
# Tokenizer
# ---------------------------------------------------------------------------------------------------------------


def build_wordpiece_tokenizer(
    texts: Iterable[str],
    out_dir: str | os.PathLike | None = None,
    vocab_size: int = 8192,
    min_frequency: int = 1,
    model_max_length: int = 512,
):
    """Build a lowercase BERT WordPiece tokenizer for ``texts`` and return it as a transformers `BertTokenizerFast`.

    The pipeline is BERT's (BertNormalizer(lowercase), BertPreTokenizer, WordPiece with ``##`` continuation,
    ``[CLS] A [SEP] B [SEP]`` template). The vocabulary is the special tokens, every character seen (alone and as a
    ``##`` continuation, so no word of these characters is ``[UNK]``), then whole words by falling frequency (ties
    alphabetical) while ``vocab_size`` allows; it stops short of ``vocab_size`` when the texts do not need more.
    It is a pure function of ``texts``: `tokenizers`' ``WordPieceTrainer`` breaks ties in hash-map order, so two
    processes trained different vocabularies on the same texts, and a resumed run read its data with other ids than
    the checkpoint was trained on. The result supports ``return_offsets_mapping``/``sequence_ids`` and, when
    ``out_dir`` is given, is saved there with ``save_pretrained`` (reload with ``AutoTokenizer.from_pretrained``).

    It is wrapped through ``tokenizer_object=`` rather than ``BertTokenizer(vocab_file=...)``: transformers v5
    ignores ``vocab_file`` and would map every word to ``[UNK]``.
    """
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
    from transformers import BertTokenizerFast

    normalizer, pre_tokenizer = normalizers.BertNormalizer(lowercase=True), pre_tokenizers.BertPreTokenizer()
    counts: collections.Counter[str] = collections.Counter()
    for text in texts:
        counts.update(word for word, _ in pre_tokenizer.pre_tokenize_str(normalizer.normalize_str(text)))
    chars = sorted({c for word in counts for c in word})
    vocab = [*BERT_SPECIAL_TOKENS, *chars, *(f"##{c}" for c in chars)]
    room = max(0, vocab_size - len(vocab))
    words = [w for w, n in counts.items() if n >= min_frequency and len(w) > 1]
    vocab += sorted(words, key=lambda w: (-counts[w], w))[:room]
    backend = Tokenizer(models.WordPiece({t: i for i, t in enumerate(vocab)}, unk_token="[UNK]"))
    backend.normalizer, backend.pre_tokenizer = normalizer, pre_tokenizer
    backend.decoder = decoders.WordPiece(prefix="##")
    cls_id, sep_id = backend.token_to_id("[CLS]"), backend.token_to_id("[SEP]")
    backend.post_processor = processors.TemplateProcessing(
        single="[CLS]:0 $A:0 [SEP]:0",
        pair="[CLS]:0 $A:0 [SEP]:0 $B:1 [SEP]:1",
        special_tokens=[("[CLS]", cls_id), ("[SEP]", sep_id)],
    )
    tokenizer = BertTokenizerFast(
        tokenizer_object=backend,
        do_lower_case=True,
        unk_token="[UNK]",
        sep_token="[SEP]",
        pad_token="[PAD]",
        cls_token="[CLS]",
        mask_token="[MASK]",
        model_max_length=model_max_length,
    )
    if out_dir is not None:
        tokenizer.save_pretrained(out_dir)
    return tokenizer


# ---------------------------------------------------------------------------------------------------------------
# Digits as an image folder
# ---------------------------------------------------------------------------------------------------------------

_DIGITS_MARKER = ".complete.json"


def write_digits_image_folder(
    out_dir: str | os.PathLike, image_size: int = 32, val_fraction: float = 0.2, seed: int = 0
) -> str:
    """Write sklearn's ``load_digits()`` (1797 8x8 images, 10 classes) as ``out_dir/{train,val}/<class>/NNNN.png``.

    Images are scaled from 0..16 to 0..255, upscaled to ``image_size`` (bilinear) and saved as RGB PNG, so
    `torchvision.datasets.ImageFolder` and timm's `ImageDataset` read them like ImageNet. The split is stratified
    and deterministic: per class, ``round(n * val_fraction)`` images go to ``val``. A marker file records the
    arguments; a second call with the same arguments returns at once, other arguments rewrite the folder.
    Returns ``out_dir`` as a string.
    """
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
    out_dir = os.fspath(out_dir)
    marker = os.path.join(out_dir, _DIGITS_MARKER)
    params = {"image_size": image_size, "val_fraction": val_fraction, "seed": seed}
    if os.path.exists(marker):
        with open(marker, encoding="utf-8") as f:
            if json.load(f) == params:
                return out_dir
        os.remove(marker)

    import numpy as np
    from PIL import Image
    from sklearn.datasets import load_digits

    digits = load_digits()
    rng = random.Random(seed)
    wanted = {}  # path -> image index
    for label in range(10):
        indices = [i for i, y in enumerate(digits.target) if y == label]
        rng.shuffle(indices)
        n_val = round(len(indices) * val_fraction)
        for split, chunk in (("val", indices[:n_val]), ("train", indices[n_val:])):
            for i in chunk:
                wanted[os.path.join(out_dir, split, str(label), f"{i:04d}.png")] = i

    # drop files of an earlier call with other arguments, so a class folder never holds a stale image
    for split in ("train", "val"):
        for label in range(10):
            folder = os.path.join(out_dir, split, str(label))
            os.makedirs(folder, exist_ok=True)
            for name in os.listdir(folder):
                path = os.path.join(folder, name)
                if name.endswith(".png") and path not in wanted:
                    os.remove(path)

    for path, i in wanted.items():
        pixels = (digits.images[i] * (255.0 / 16.0)).round().clip(0, 255).astype(np.uint8)
        image = Image.fromarray(pixels).resize((image_size, image_size), Image.Resampling.BILINEAR).convert("RGB")
        image.save(path)
    with open(marker, "w", encoding="utf-8") as f:  # written last: marks the folder complete
        json.dump(params, f)
    return out_dir
