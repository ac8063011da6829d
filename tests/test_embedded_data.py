"""Offline data layer of the recipes: synthetic SQuAD, local WordPiece tokenizer, QA glue, digits image folder."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("datasets")
pytest.importorskip("tokenizers")
pytest.importorskip("transformers")

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "recipes"))

import embedded_data  # noqa: E402
import qa_utils  # noqa: E402

NUM_TRAIN, NUM_EVAL = 120, 30

# Real SQuAD v1.1 layout: several paragraphs per article, several answers per dev question, a context with
# leading whitespace (HF's loader keeps it).
REAL_FORMAT = {
    "version": "1.1",
    "data": [
        {
            "title": "Normans",
            "paragraphs": [
                {
                    "context": " The Normans were the people who in the 10th and 11th centuries gave their name to "
                    "Normandy, a region in France.",
                    "qas": [
                        {
                            "id": "56ddde6b9a695914005b9628",
                            "question": "In what country is Normandy located?",
                            "answers": [
                                {"text": "France", "answer_start": 105},
                                {"text": "France", "answer_start": 105},
                                {"text": "a region in France", "answer_start": 93},
                            ],
                        },
                        {
                            "id": "56ddde6b9a695914005b9629",
                            "question": "When were the Normans in Normandy?",
                            "answers": [{"text": "10th and 11th centuries", "answer_start": 40}],
                        },
                    ],
                },
                {
                    "context": "Rollo was a Viking leader.",
                    "qas": [
                        {
                            "id": "5ad39d53604f3c001a3fe8d3",
                            "question": "Who was Rollo?",
                            "answers": [{"text": "a Viking leader", "answer_start": 10}],
                        }
                    ],
                },
            ],
        }
    ],
}


@pytest.fixture(scope="module")
def squad(tmp_path_factory):
    out = tmp_path_factory.mktemp("squad")
    train_path, eval_path = embedded_data.make_squad_dataset(out, num_train=NUM_TRAIN, num_eval=NUM_EVAL)
    train = embedded_data.load_squad_json(train_path)
    dev = embedded_data.load_squad_json(eval_path)
    tokenizer = embedded_data.build_wordpiece_tokenizer(list(train["context"]) + list(train["question"]))
    return train_path, eval_path, train, dev, tokenizer


def _qas(path):
    with open(path, encoding="utf-8") as f:
        data = json.load(f)["data"]
    return [(p["context"], qa) for article in data for p in article["paragraphs"] for qa in p["qas"]]


# --- synthetic SQuAD ---------------------------------------------------------------------------------------------


def test_squad_is_deterministic(tmp_path):
    a = embedded_data.make_squad_dataset(tmp_path / "a", num_train=60, num_eval=9, seed=3)
    b = embedded_data.make_squad_dataset(tmp_path / "b", num_train=60, num_eval=9, seed=3)
    c = embedded_data.make_squad_dataset(tmp_path / "c", num_train=60, num_eval=9, seed=4)
    for x, y, z in zip(a, b, c):
        assert Path(x).read_bytes() == Path(y).read_bytes()
        assert Path(x).read_bytes() != Path(z).read_bytes()


def test_squad_format_is_valid(squad):
    train_path, eval_path, *_ = squad
    for path, expected in ((train_path, NUM_TRAIN), (eval_path, NUM_EVAL)):
        with open(path, encoding="utf-8") as f:
            payload = json.load(f)
        assert payload["version"] == "1.1"
        assert all(set(a) == {"title", "paragraphs"} for a in payload["data"])
        qas = _qas(path)
        assert len(qas) == expected
        assert len({qa["id"] for _, qa in qas}) == expected
        for context, qa in qas:
            assert len(context.split()) <= 100
            assert qa["question"].endswith("?") and qa["answers"]
            for answer in qa["answers"]:
                start = answer["answer_start"]
                assert context[start : start + len(answer["text"])] == answer["text"]
    # train and eval paragraphs differ
    assert not {c for c, _ in _qas(train_path)} & {c for c, _ in _qas(eval_path)}


def test_squad_has_same_type_distractors(squad):
    # every year answer has another year in its paragraph: the answer type alone does not decide
    hits = 0
    for context, qa in _qas(squad[0]):
        text = qa["answers"][0]["text"]
        if text.isdigit() and len(text) == 4:
            years = [w.strip(".,") for w in context.split() if w.strip(".,").isdigit() and len(w.strip(".,")) == 4]
            hits += len(years) > 1
    assert hits > 5


def test_squad_rejects_bad_arguments(tmp_path):
    with pytest.raises(ValueError, match="unknown relations"):
        embedded_data.make_squad_dataset(tmp_path, relations=["born_year", "shoe_size"])
    with pytest.raises(ValueError, match="facts_per_person"):
        embedded_data.make_squad_dataset(tmp_path, facts_per_person=(3, 9))


def test_load_squad_json_matches_hf_squad_columns(squad):
    _, eval_path, train, dev, _ = squad
    assert train.column_names == ["id", "title", "context", "question", "answers"]
    assert len(train) == NUM_TRAIN and len(dev) == NUM_EVAL
    assert set(train.features["answers"]) == {"text", "answer_start"}
    # round trip: every JSON question is one row, in file order, with its context and answers
    for row, (context, qa) in zip(dev, _qas(eval_path)):
        assert row["id"] == qa["id"] and row["question"] == qa["question"] and row["context"] == context
        assert row["answers"] == {
            "text": [a["text"] for a in qa["answers"]],
            "answer_start": [a["answer_start"] for a in qa["answers"]],
        }


def test_load_squad_json_reads_real_squad_layout(tmp_path):
    path = tmp_path / "dev-v1.1.json"
    path.write_text(json.dumps(REAL_FORMAT), encoding="utf-8")
    ds = embedded_data.load_squad_json(path)
    assert len(ds) == 3
    assert ds[0]["title"] == "Normans" and ds[0]["context"].startswith(" The Normans")  # not stripped
    assert ds[0]["answers"] == {"text": ["France", "France", "a region in France"], "answer_start": [105, 105, 93]}
    assert ds[2]["context"] == "Rollo was a Viking leader."
    for row in ds:
        for text, start in zip(row["answers"]["text"], row["answers"]["answer_start"]):
            assert row["context"][start : start + len(text)] == text


# --- tokenizer ----------------------------------------------------------------------------------------------------


def test_wordpiece_tokenizer_is_real(squad, tmp_path):
    from transformers import AutoTokenizer

    *_, train, _, tokenizer = squad
    text = train[0]["context"]
    ids = tokenizer(text)["input_ids"]
    assert ids[0] == tokenizer.cls_token_id and ids[-1] == tokenizer.sep_token_id
    body = ids[1:-1]
    assert tokenizer.unk_token_id not in body  # transformers v5 ignores BertTokenizer(vocab_file=...): all [UNK]
    assert len(set(body)) > 10
    # decoding gives the text back up to case and spacing around punctuation
    assert tokenizer.decode(ids, skip_special_tokens=True).replace(" ", "") == text.lower().replace(" ", "")
    # an unseen word becomes word pieces, not [UNK]
    unseen = tokenizer.tokenize("Zellerbach")
    assert "[UNK]" not in unseen and len(unseen) > 1 and unseen[1].startswith("##")

    # pairs: token types, sequence ids and character offsets into the context
    question, context = train[0]["question"], train[0]["context"]
    enc = tokenizer(question, context, return_offsets_mapping=True)
    seq = enc.sequence_ids()
    assert seq[0] is None and seq[-1] is None and 0 in seq and 1 in seq
    assert all(t == (1 if s == 1 else 0) for t, s in zip(enc["token_type_ids"], seq) if s is not None)
    words = [context[s:e].lower() for (s, e), sid in zip(enc["offset_mapping"], seq) if sid == 1]
    assert "".join(w for w in words) == "".join(context.lower().split())

    tokenizer.save_pretrained(tmp_path)
    reloaded = AutoTokenizer.from_pretrained(tmp_path)
    assert reloaded(question, context)["input_ids"] == enc["input_ids"]
    assert len(reloaded) == len(tokenizer)

    saved_dir = tmp_path / "direct"
    embedded_data.build_wordpiece_tokenizer(["tiny corpus of words"] * 3, out_dir=saved_dir, vocab_size=60)
    assert (saved_dir / "tokenizer.json").exists() and (saved_dir / "tokenizer_config.json").exists()


# --- QA glue ------------------------------------------------------------------------------------------------------


def _long_examples(dev, n=8):
    # contexts longer than the window, so examples split into several overlapping windows
    rows = dev.select(range(n))
    return rows.map(lambda r: {"context": r["context"] + " " + r["context"]})


def test_prepare_train_features_labels_point_at_the_answer(squad):
    *_, train, dev, tokenizer = squad
    for examples, max_len, stride in ((train[:40], 128, 32), (_long_examples(dev)[:], 48, 16)):
        feats = qa_utils.prepare_train_features(examples, tokenizer, max_seq_length=max_len, doc_stride=stride)
        enc = tokenizer(
            [q.lstrip() for q in examples["question"]],
            examples["context"],
            truncation="only_second",
            max_length=max_len,
            stride=stride,
            return_overflowing_tokens=True,
            return_offsets_mapping=True,
            padding="max_length",
        )
        assert feats["input_ids"] == enc["input_ids"]
        assert all(len(ids) == max_len for ids in feats["input_ids"])
        in_span = set()
        for w, (s, e) in enumerate(zip(feats["start_positions"], feats["end_positions"])):
            ex = enc["overflow_to_sample_mapping"][w]
            if s == 0:
                assert e == 0
                continue
            offsets = enc["offset_mapping"][w]
            context = examples["context"][ex]
            assert context[offsets[s][0] : offsets[e][1]] == examples["answers"][ex]["text"][0]
            in_span.add(ex)
        assert in_span == set(range(len(examples["id"])))  # every answer fits in some window


def test_postprocess_perfect_logits_scores_100(squad):
    *_, dev, tokenizer = squad
    for examples, max_len, stride in ((dev, 128, 32), (_long_examples(dev), 48, 16)):
        feats = examples.map(
            qa_utils.prepare_eval_features,
            batched=True,
            remove_columns=examples.column_names,
            fn_kwargs={"tokenizer": tokenizer, "max_seq_length": max_len, "doc_stride": stride},
        )
        assert len(feats) >= len(examples)
        answers = dict(zip(examples["id"], examples["answers"]))
        start_logits = np.full((len(feats), max_len), -10.0, dtype=np.float32)
        end_logits = np.full((len(feats), max_len), -10.0, dtype=np.float32)
        for f, (example_id, offsets) in enumerate(zip(feats["example_id"], feats["offset_mapping"])):
            char_start = answers[example_id]["answer_start"][0]
            char_end = char_start + len(answers[example_id]["text"][0])
            for i, o in enumerate(offsets):
                if o is None:
                    continue
                if o[0] == char_start:  # peaks at the gold tokens, in every window that holds them
                    start_logits[f, i] = 10.0
                if o[1] == char_end:
                    end_logits[f, i] = 10.0
        predictions = qa_utils.postprocess_qa_predictions(examples, feats, start_logits, end_logits)
        assert set(predictions) == set(examples["id"])
        assert qa_utils.squad_metrics(predictions, examples) == {"exact_match": 100.0, "f1": 100.0}

    with pytest.raises(ValueError, match="features"):
        qa_utils.postprocess_qa_predictions(dev, feats, start_logits[:-1], end_logits[:-1])


def test_squad_metrics_known_values():
    refs = {"q1": ["the cat"], "q2": ["a big cat"], "q3": ["Paris", "in Paris, France"], "q4": ["dog"]}
    assert qa_utils.normalize_answer("  The  Cat! ") == "cat"
    assert qa_utils.squad_metrics({"q1": "cat"}, {"q1": ["the cat"]}) == {"exact_match": 100.0, "f1": 100.0}
    # "big cat" vs "small cat" after normalization: 1 common token, precision = recall = 1/2 -> F1 = 0.5
    assert qa_utils.squad_metrics({"q2": "the small cat"}, {"q2": ["a big cat"]}) == {"exact_match": 0.0, "f1": 50.0}
    # the best ground truth wins: "paris france" vs "paris" -> F1 2/3; vs "in paris france": p = 1, r = 2/3 -> 0.8
    m = qa_utils.squad_metrics({"q3": "Paris France"}, {"q3": ["Paris", "in Paris, France"]})
    assert m["exact_match"] == 0.0 and m["f1"] == pytest.approx(80.0)
    # a missing prediction counts as 0, like the official script; extra predictions are ignored
    preds = {"q1": "cat", "q2": "big cat", "q3": "paris", "extra": "x"}
    assert qa_utils.squad_metrics(preds, refs) == {"exact_match": 75.0, "f1": 75.0}
    # a HF-squad-style dataset (dict of columns) works as references too
    columns = {"id": ["q1"], "answers": [{"text": ["the cat"], "answer_start": [0]}]}
    assert qa_utils.squad_metrics({"q1": "The cat."}, columns)["exact_match"] == 100.0


# --- digits image folder ------------------------------------------------------------------------------------------


def test_digits_image_folder(tmp_path):
    from PIL import Image

    root = embedded_data.write_digits_image_folder(tmp_path / "digits", image_size=16, val_fraction=0.2)
    counts = {}
    for split in ("train", "val"):
        classes = sorted(os.listdir(os.path.join(root, split)))
        assert classes == [str(c) for c in range(10)]
        counts[split] = {c: len(os.listdir(os.path.join(root, split, c))) for c in classes}
    assert sum(counts["train"].values()) + sum(counts["val"].values()) == 1797
    for c in range(10):  # stratified: about 20 % of each class in val
        total = counts["train"][str(c)] + counts["val"][str(c)]
        assert counts["val"][str(c)] == round(total * 0.2)
    image = Image.open(os.path.join(root, "val", "3", sorted(os.listdir(os.path.join(root, "val", "3")))[0]))
    assert image.size == (16, 16) and image.mode == "RGB"
    assert len(set(np.asarray(image).ravel().tolist())) > 2  # a real digit, not a blank image

    # idempotent: a second call with the same arguments touches nothing
    files = sorted(Path(root).rglob("*.png"))
    mtimes = [f.stat().st_mtime_ns for f in files]
    assert embedded_data.write_digits_image_folder(root, image_size=16, val_fraction=0.2) == root
    assert [f.stat().st_mtime_ns for f in files] == mtimes
    # other arguments rewrite the folder without leaving stale images
    embedded_data.write_digits_image_folder(root, image_size=16, val_fraction=0.5)
    assert len(list(Path(root).rglob("*.png"))) == 1797
    assert sum(len(os.listdir(os.path.join(root, "val", str(c)))) for c in range(10)) in range(890, 910)


def test_wordpiece_tokenizer_is_the_same_in_every_process(tmp_path):
    # tokenizers' WordPieceTrainer broke ties in hash-map order: two processes built different ids for one corpus,
    # and a run resumed from a checkpoint read its data with ids the model had not been trained on
    code = (
        "import sys; sys.path.insert(0, 'recipes'); import embedded_data as e; "
        "d = e.make_squad_dataset(sys.argv[1], 60, 10, seed=0)[0]; t = e.load_squad_json(d); "
        "e.build_wordpiece_tokenizer(list(t['context']) + list(t['question']), out_dir=sys.argv[2])"
    )
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    for name in ("a", "b"):
        argv = [sys.executable, "-c", code, str(tmp_path / "data"), str(tmp_path / name)]
        subprocess.run(argv, cwd=root, check=True)
    assert (tmp_path / "a" / "tokenizer.json").read_bytes() == (tmp_path / "b" / "tokenizer.json").read_bytes()
