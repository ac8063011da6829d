"""Extractive question answering glue for the BERT recipe: feature preparation, span decoding, SQuAD v1.1 metric.

Follows the design of transformers' ``examples/pytorch/question-answering`` (``run_qa.py``, ``utils_qa.py``):
long contexts are split into overlapping windows (``doc_stride``); a training window whose span misses the
answer is labelled with the [CLS] position; at evaluation each window keeps its example id and an offset
mapping with ``None`` outside the context, and the best-scoring valid span over all windows of an example wins.

`squad_metrics` re-implements the official SQuAD v1.1 evaluation script (exact match and token F1 after
lowercasing and removing punctuation, articles and extra whitespace; max over the ground truths), because
``evaluate.load("squad")`` needs the Hub.
"""

from __future__ import annotations

import collections
import re
import string
from collections.abc import Mapping, Sequence

import numpy as np

__all__ = [
    "prepare_train_features",
    "prepare_eval_features",
    "postprocess_qa_predictions",
    "normalize_answer",
    "squad_metrics",
]


def _tokenize_windows(examples, tokenizer, max_seq_length: int, doc_stride: int, pad_to_max_length: bool):
    # question first unless the tokenizer pads on the left (then the context goes first, as in run_qa)
    question_first = tokenizer.padding_side == "right"
    # questions with leading spaces waste window room (SQuAD has a few)
    questions = [q.lstrip() for q in examples["question"]]
    contexts = examples["context"]
    encodings = tokenizer(
        questions if question_first else contexts,
        contexts if question_first else questions,
        truncation="only_second" if question_first else "only_first",
        max_length=max_seq_length,
        stride=doc_stride,
        return_overflowing_tokens=True,
        return_offsets_mapping=True,
        padding="max_length" if pad_to_max_length else False,
    )
    return encodings, (1 if question_first else 0)


def prepare_train_features(
    examples: Mapping[str, Sequence],
    tokenizer,
    max_seq_length: int = 384,
    doc_stride: int = 128,
    pad_to_max_length: bool = True,
) -> dict:
    """Tokenize a batch of SQuAD examples into training windows with ``start_positions``/``end_positions``.

    Meant for ``dataset.map(..., batched=True, remove_columns=dataset.column_names)``: one example may give
    several windows. Labels are token indices of the first answer; a window that does not contain the whole
    answer points both labels at its [CLS] token.
    """
    encodings, context_id = _tokenize_windows(examples, tokenizer, max_seq_length, doc_stride, pad_to_max_length)
    window_to_example = encodings.pop("overflow_to_sample_mapping")
    offsets_per_window = encodings.pop("offset_mapping")
    starts, ends = [], []
    for w, offsets in enumerate(offsets_per_window):
        input_ids = encodings["input_ids"][w]
        cls_index = input_ids.index(tokenizer.cls_token_id) if tokenizer.cls_token_id in input_ids else 0
        answers = examples["answers"][window_to_example[w]]
        if len(answers["answer_start"]) == 0:
            starts.append(cls_index)
            ends.append(cls_index)
            continue
        char_start = answers["answer_start"][0]
        char_end = char_start + len(answers["text"][0])

        # the context's token range inside this window
        sequence_ids = encodings.sequence_ids(w)
        context_tokens = [i for i, s in enumerate(sequence_ids) if s == context_id]
        first, last = context_tokens[0], context_tokens[-1]
        if offsets[first][0] > char_start or offsets[last][1] < char_end:
            starts.append(cls_index)
            ends.append(cls_index)
            continue
        # first token ending after the answer start; last token starting before the answer end
        token_start = first
        while token_start <= last and offsets[token_start][1] <= char_start:
            token_start += 1
        token_end = last
        while token_end >= first and offsets[token_end][0] >= char_end:
            token_end -= 1
        starts.append(token_start)
        ends.append(token_end)
    encodings["start_positions"] = starts
    encodings["end_positions"] = ends
    return dict(encodings)


def prepare_eval_features(
    examples: Mapping[str, Sequence],
    tokenizer,
    max_seq_length: int = 384,
    doc_stride: int = 128,
    pad_to_max_length: bool = True,
) -> dict:
    """Tokenize a batch of SQuAD examples into evaluation windows.

    Each window keeps ``example_id`` and an ``offset_mapping`` whose entries are ``None`` outside the context,
    which `postprocess_qa_predictions` uses to map token spans back to context text. Drop both columns
    before feeding the model.
    """
    encodings, context_id = _tokenize_windows(examples, tokenizer, max_seq_length, doc_stride, pad_to_max_length)
    window_to_example = encodings.pop("overflow_to_sample_mapping")
    example_ids, offset_mapping = [], []
    for w, offsets in enumerate(encodings["offset_mapping"]):
        sequence_ids = encodings.sequence_ids(w)
        example_ids.append(examples["id"][window_to_example[w]])
        offset_mapping.append([tuple(o) if sequence_ids[i] == context_id else None for i, o in enumerate(offsets)])
    encodings["example_id"] = example_ids
    encodings["offset_mapping"] = offset_mapping
    return dict(encodings)


def postprocess_qa_predictions(
    examples,
    features,
    start_logits: np.ndarray,
    end_logits: np.ndarray,
    n_best_size: int = 20,
    max_answer_length: int = 30,
) -> dict[str, str]:
    """Turn per-window start/end logits into one answer string per example id.

    ``examples`` needs ``id`` and ``context`` columns, ``features`` the ``example_id`` and ``offset_mapping``
    columns from `prepare_eval_features` (a `datasets.Dataset` or a dict of lists). ``start_logits`` and
    ``end_logits`` have one row per feature (rows may be padded past the feature's length). Candidate spans
    are the ``n_best_size`` best starts x ends that lie in the context, end at or after the start and are at
    most ``max_answer_length`` tokens; the span with the highest ``start + end`` logit wins. An example without
    a valid span gets ``""``.
    """
    start_logits = np.asarray(start_logits)
    end_logits = np.asarray(end_logits)
    feature_ids = list(features["example_id"])
    all_offsets = list(features["offset_mapping"])
    if len(feature_ids) != start_logits.shape[0] or start_logits.shape != end_logits.shape:
        raise ValueError(
            f"got {len(feature_ids)} features but logits of shape {start_logits.shape} / {end_logits.shape}; "
            "pass the logits of exactly the features from prepare_eval_features, in order"
        )
    windows = collections.defaultdict(list)
    for f, example_id in enumerate(feature_ids):
        windows[example_id].append(f)

    predictions: dict[str, str] = {}
    for example_id, context in zip(examples["id"], examples["context"]):
        best_score, best_text = -np.inf, ""
        for f in windows.get(example_id, ()):
            offsets = all_offsets[f]
            n = len(offsets)
            starts, ends = start_logits[f][:n], end_logits[f][:n]
            top_starts = np.argsort(starts)[::-1][:n_best_size]
            top_ends = np.argsort(ends)[::-1][:n_best_size]
            for s in top_starts:
                if offsets[s] is None:
                    continue
                for e in top_ends:
                    if offsets[e] is None or e < s or e - s + 1 > max_answer_length:
                        continue
                    score = starts[s] + ends[e]
                    if score > best_score:
                        best_score, best_text = score, context[offsets[s][0] : offsets[e][1]]
        predictions[example_id] = best_text
    return predictions


# ---------------------------------------------------------------------------------------------------------------
# SQuAD v1.1 metric
# ---------------------------------------------------------------------------------------------------------------

_PUNCTUATION = frozenset(string.punctuation)
_ARTICLES = re.compile(r"\b(a|an|the)\b")


def normalize_answer(text: str) -> str:
    """Lowercase, drop punctuation, drop articles, collapse whitespace (official SQuAD v1.1 order)."""
    text = "".join(ch for ch in text.lower() if ch not in _PUNCTUATION)
    text = _ARTICLES.sub(" ", text)
    return " ".join(text.split())


def _exact_match(prediction: str, truth: str) -> float:
    return float(normalize_answer(prediction) == normalize_answer(truth))


def _f1(prediction: str, truth: str) -> float:
    pred_tokens = normalize_answer(prediction).split()
    truth_tokens = normalize_answer(truth).split()
    num_same = sum((collections.Counter(pred_tokens) & collections.Counter(truth_tokens)).values())
    if num_same == 0:
        return 0.0
    precision = num_same / len(pred_tokens)
    recall = num_same / len(truth_tokens)
    return 2 * precision * recall / (precision + recall)


def _references_by_id(references) -> dict[str, list[str]]:
    if isinstance(references, Mapping) and "id" not in references:
        return {k: list(v) for k, v in references.items()}  # already id -> list of answer strings
    return {i: list(a["text"]) for i, a in zip(references["id"], references["answers"])}


def squad_metrics(predictions: Mapping[str, str], references) -> dict[str, float]:
    """Official SQuAD v1.1 exact match and F1, both in 0-100.

    ``references`` is a dataset (or dict of columns) with ``id`` and ``answers`` columns in the HF squad
    format, or a dict ``id -> list of answer strings``. Each prediction scores its best ground truth; like the
    official script, a reference without a prediction counts as 0 and predictions without a reference are
    ignored.
    """
    refs = _references_by_id(references)
    if not refs:
        raise ValueError("references is empty")
    em = f1 = 0.0
    for qid, truths in refs.items():
        if qid not in predictions:
            continue
        em += max(_exact_match(predictions[qid], t) for t in truths)
        f1 += max(_f1(predictions[qid], t) for t in truths)
    return {"exact_match": 100.0 * em / len(refs), "f1": 100.0 * f1 / len(refs)}
