"""Offline data for the recipes: a synthetic SQuAD v1.1 set, a WordPiece tokenizer trained locally, and
sklearn's digits written as an ImageNet-style folder.

The Hub is not reachable in CI, so each recipe keeps its real loading path (SQuAD JSON, an image folder) and
feeds it data made here:

- `make_squad_dataset` writes extractive-QA files in the SQuAD v1.1 JSON format. Paragraphs describe 2-3
  invented people with facts of the same kinds (birth year, city, job, favorite color, counts of things), so
  every question has same-type distractors in its paragraph and the model must match the person and the
  relation, not just the answer type (picking a random fact of the right type scores about 40 EM).
- `load_squad_json` flattens SQuAD JSON into the columns of the HF ``squad`` dataset; real files load too.
- `build_wordpiece_tokenizer` trains a BERT WordPiece vocabulary with `tokenizers` and wraps it as a
  transformers fast tokenizer (offsets, ``sequence_ids``, ``save_pretrained``).
- `write_digits_image_folder` writes the 1797 real 8x8 digits as ``train/<class>/*.png`` and
  ``val/<class>/*.png``.
"""

from __future__ import annotations

import json
import os
import random
from collections.abc import Iterable

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
_PRONOUN_PROB = 0.0
_NUM_PEOPLE = (2, 3)
_THINGS = ["cats", "dogs", "books", "bicycles", "guitars", "paintings", "chickens", "clocks", "lamps", "boats"]

# Each relation: how a fact is written (subject is a name or a pronoun) and how it is asked.
_FACT_TEMPLATES = {
    "year": ["{S} was born in {V}.", "{S} was born in the year {V}.", "The year {V} is when {s} was born."],
    "city": ["{S} lives in {V}.", "{S} moved to {V} and still lives there.", "These days {s} lives in {V}."],
    "job": ["{S} works as {A} {V}.", "{S} earns a living as {A} {V}.", "By profession {s} is {A} {V}."],
    "color": ["{P} favorite color is {V}.", "{S} likes the color {V} best.", "{S} always wears {V}."],
    "count": ["{S} owns {V} {T}.", "{S} keeps {V} {T} at home.", "At home {s} has {V} {T}."],
}
_QUESTION_TEMPLATES = {
    "year": ["What year was {N} born?", "In which year was {N} born?", "When was {N} born?"],
    "city": ["Which city does {N} live in?", "Where does {N} live?", "In what city is {N}'s home?"],
    "job": ["What is {N}'s job?", "What does {N} do for a living?", "What is the profession of {N}?"],
    "color": ["What is {N}'s favorite color?", "Which color does {N} like best?", "What color does {N} prefer?"],
    "count": ["How many {T} does {N} own?", "How many {T} does {N} have?", "What number of {T} does {N} keep?"],
}


def _draw_values(rng: random.Random, relation: str, n: int) -> list[str]:
    """n distinct values of one relation, so that same-type facts in a paragraph are real distractors."""
    if relation == "year":
        return [str(y) for y in rng.sample(range(1820, 2011), n)]
    if relation == "count":
        return [str(c) for c in rng.sample(range(2, 60), n)]
    pool = {"city": _CITIES, "job": _JOBS, "color": _COLORS}[relation]
    return rng.sample(pool, n)


def _make_paragraph(rng: random.Random, num_people: int, questions_per_paragraph: int) -> tuple[str, str, list]:
    """One context with its questions as (question, answer_text, answer_start) triples."""
    relations = list(_FACT_TEMPLATES)
    genders = [rng.choice(("she", "he")) for _ in range(num_people)]
    firsts: list[str] = []
    for g in genders:  # first names unique within a paragraph
        firsts.append(rng.choice([f for f in _FIRST_NAMES[g] if f not in firsts]))
    lasts = rng.sample(_LAST_NAMES, num_people)
    values = {r: _draw_values(rng, r, num_people) for r in relations}
    things = [rng.choice(_THINGS) for _ in range(num_people)]  # may repeat: the name must decide

    context = ""
    facts = []  # (person, relation, value, char_start)
    for p in range(num_people):
        full, pronoun = f"{firsts[p]} {lasts[p]}", genders[p]
        possessive = "her" if pronoun == "she" else "his"
        person_relations = rng.sample(relations, rng.randint(3, 4))
        for k, rel in enumerate(person_relations):
            # the first fact names the person in full; later ones use the first name or a pronoun
            later = rng.random() < _PRONOUN_PROB
            subject = full if k == 0 else (pronoun if later else firsts[p])
            poss = f"{full}'s" if k == 0 else (possessive if later else f"{firsts[p]}'s")
            template = rng.choice(_FACT_TEMPLATES[rel])
            value = values[rel][p]
            article = "an" if value[0] in "aeiou" else "a"
            filled = template.format(S=subject, s=subject, P=poss, A=article, V="\x00", T=things[p])
            filled = filled[0].upper() + filled[1:]
            start = len(context) + (1 if context else 0) + filled.index("\x00")
            context = f"{context} {filled}" if context else filled
            context = context.replace("\x00", value)
            facts.append((p, rel, value, start))

    qas = []
    for p, rel, value, start in rng.sample(facts, min(questions_per_paragraph, len(facts))):
        name = rng.choice((f"{firsts[p]} {lasts[p]}", firsts[p]))
        question = rng.choice(_QUESTION_TEMPLATES[rel]).format(N=name, T=things[p])
        assert context[start : start + len(value)] == value
        qas.append((question, value, start))
    title = f"{lasts[0]} and {lasts[1]}" if num_people == 2 else f"{lasts[0]}, {lasts[1]} and {lasts[2]}"
    return title, context, qas


def _squad_split(rng: random.Random, num_questions: int, prefix: str, questions_per_paragraph: int) -> dict:
    data, count, para_id = [], 0, 0
    while count < num_questions:
        title, context, qas = _make_paragraph(rng, rng.choice(_NUM_PEOPLE), questions_per_paragraph)
        qas = qas[: num_questions - count]
        entries = []
        for q_idx, (question, text, start) in enumerate(qas):
            entries.append(
                {
                    "id": f"{prefix}-{para_id:05d}-{q_idx}",
                    "question": question,
                    "answers": [{"text": text, "answer_start": start}],
                }
            )
        data.append({"title": title, "paragraphs": [{"context": context, "qas": entries}]})
        count += len(entries)
        para_id += 1
    return {"version": "1.1", "data": data}


def make_squad_dataset(
    out_dir: str | os.PathLike,
    num_train: int = 2400,
    num_eval: int = 240,
    seed: int = 0,
    questions_per_paragraph: int = 3,
) -> tuple[str, str]:
    """Write a synthetic extractive-QA set as SQuAD v1.1 JSON (``train.json``, ``dev.json``) and return the paths.

    Pure Python and deterministic: the same arguments give the same bytes. Train and eval paragraphs come from
    separate random streams, so eval contexts are unseen combinations of names and facts. Contexts are 30-100
    words (fits ``max_seq_length=128`` with the question).

    Args:
        out_dir: folder for ``train.json`` and ``dev.json`` (created if missing).
        num_train / num_eval: number of questions in each split.
        seed: seed of `random.Random`.
        questions_per_paragraph: questions asked about each paragraph (the rest of its facts are distractors).
    """
    os.makedirs(out_dir, exist_ok=True)
    paths = []
    for split, n, tag in (("train", num_train, "syn-train"), ("dev", num_eval, "syn-dev")):
        rng = random.Random(f"{seed}-{split}")  # str seeds hash deterministically (sha512), unlike tuples
        payload = _squad_split(rng, n, tag, questions_per_paragraph)
        path = os.path.join(out_dir, f"{split}.json")
        with open(path, "w", encoding="utf-8") as f:
            json.dump(payload, f, ensure_ascii=False, indent=None, sort_keys=False)
        paths.append(path)
    return paths[0], paths[1]


def load_squad_json(path: str | os.PathLike):
    """Load a SQuAD v1.1-format JSON file as a `datasets.Dataset` with the HF ``squad`` columns.

    Columns: ``id``, ``title``, ``context``, ``question``, ``answers`` = ``{"text": [...], "answer_start": [...]}``,
    one row per question, in file order, as HF's squad loader flattens it (contexts are not stripped).
    """
    from datasets import Dataset, Features, List, Value

    features = Features(
        {
            "id": Value("string"),
            "title": Value("string"),
            "context": Value("string"),
            "question": Value("string"),
            "answers": {"text": List(Value("string")), "answer_start": List(Value("int32"))},
        }
    )
    with open(path, encoding="utf-8") as f:
        squad = json.load(f)
    columns: dict[str, list] = {name: [] for name in features}
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
    """Train a lowercase BERT WordPiece tokenizer on ``texts`` and return it as a transformers `BertTokenizerFast`.

    The pipeline is BERT's (BertNormalizer(lowercase), BertPreTokenizer, WordPiece with ``##`` continuation,
    ``[CLS] A [SEP] B [SEP]`` template). The result supports ``return_offsets_mapping``/``sequence_ids`` and, when
    ``out_dir`` is given, is saved there with ``save_pretrained`` (reload with ``AutoTokenizer.from_pretrained``).
    The vocabulary stops short of ``vocab_size`` when the texts do not need more.

    It is wrapped through ``tokenizer_object=`` rather than ``BertTokenizer(vocab_file=...)``: transformers v5
    ignores ``vocab_file`` and would map every word to ``[UNK]``.
    """
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
    from transformers import BertTokenizerFast

    backend = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    backend.normalizer = normalizers.BertNormalizer(lowercase=True)
    backend.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    backend.decoder = decoders.WordPiece(prefix="##")
    trainer = trainers.WordPieceTrainer(
        vocab_size=vocab_size, min_frequency=min_frequency, special_tokens=BERT_SPECIAL_TOKENS
    )
    backend.train_from_iterator(texts, trainer=trainer)
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
