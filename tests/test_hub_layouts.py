"""The data sets as the hub publishes them (configs, nested rows, list-of-lists fields), written
locally with `datasets` in each exact schema; nothing is downloaded. And seeded, stratified
samples."""

import json
from collections import Counter

import datasets
import pytest

from sem_jax.data.corpus import corpus_from_datasets
from sem_jax.data.example import Example
from sem_jax.data.mix import stratified_sample
from sem_jax.data.sources import load_source

MMLU = datasets.Features({"question": datasets.Value("string"), "subject": datasets.Value("string"),
                          "choices": datasets.Sequence(datasets.Value("string")),
                          "answer": datasets.ClassLabel(names=["A", "B", "C", "D"])})
HOTPOT = datasets.Features({
    "id": datasets.Value("string"), "question": datasets.Value("string"), "answer": datasets.Value("string"),
    "type": datasets.Value("string"), "level": datasets.Value("string"),
    "supporting_facts": datasets.Sequence({"title": datasets.Value("string"), "sent_id": datasets.Value("int32")}),
    "context": datasets.Sequence({"title": datasets.Value("string"),
                                  "sentences": datasets.Sequence(datasets.Value("string"))})})
MUSIQUE_ROWS = [
    {"id": "2hop__1_2", "question": "Who founded the maker of X?", "answer": "Ada Byron", "answer_aliases": ["Ada"],
     "answerable": True,
     "paragraphs": [{"idx": 0, "title": "X", "paragraph_text": "X is made by Y.", "is_supporting": True},
                    {"idx": 1, "title": "Y", "paragraph_text": "Y was founded by Ada Byron.", "is_supporting": True}],
     "question_decomposition": [{"id": 1, "question": "maker of X", "answer": "Y", "paragraph_support_idx": 0},
                                {"id": 2, "question": "#1 founder", "answer": "Ada Byron", "paragraph_support_idx": 1}]},
    {"id": "3hop1__3_4_5", "question": "Where is Z?", "answer": "Oslo", "answer_aliases": [], "answerable": False,
     "paragraphs": [{"idx": 0, "title": "Z", "paragraph_text": "Z is in Oslo.", "is_supporting": False}],
     "question_decomposition": [{"id": i, "question": "q", "answer": "a", "paragraph_support_idx": 0} for i in range(3)]},
    {"id": "3hop1__6_7_8", "question": "Which river?", "answer": "Nile", "answer_aliases": ["River Nile"],
     "answerable": True, "paragraphs": [],
     "question_decomposition": [{"id": i, "question": "q", "answer": "a", "paragraph_support_idx": 0} for i in range(3)]},
]


def _mmlu_rows():
    return [{"question": "2+2?", "subject": "arith", "choices": ["3", "4", "5", "6"], "answer": 1},
            {"question": "Capital of Italy?", "subject": "geo", "choices": ["Rome", "Milan", "Turin", "Pisa"], "answer": 0}]


@pytest.fixture
def hub(tmp_path):
    """Local copies of the hub repositories, in their folder and file names."""
    def write(rows, path, features=None, fmt="parquet"):
        path.parent.mkdir(parents=True, exist_ok=True)
        ds = datasets.Dataset.from_list(rows, features=features)
        ds.to_parquet(str(path)) if fmt == "parquet" else ds.to_json(str(path), lines=True)
        return path

    write(_mmlu_rows(), tmp_path / "mmlu/all/test-00000-of-00001.parquet", MMLU)
    aux = [{"train": r} for r in _mmlu_rows()]  # the auxiliary_train config nests each row
    write(aux, tmp_path / "mmlu/auxiliary_train/train-00000-of-00001.parquet",
          datasets.Features({"train": MMLU}))
    hotpot = [{"id": "h1", "question": "Which is older, Rome or Oslo?", "answer": "Rome", "type": "comparison",
               "level": "hard", "supporting_facts": {"title": ["Rome", "Oslo"], "sent_id": [0, 0]},
               "context": {"title": ["Rome", "Oslo", "Bergen"],
                           "sentences": [["Rome is old. ", "Very old."], ["Oslo is newer."], ["Bergen is wet."]]}}]
    write(hotpot, tmp_path / "hotpot_qa/distractor/validation-00000-of-00001.parquet", HOTPOT)
    write([{"question": "3 + 4?", "answer": "3 + 4 = 7\n#### 7"}], tmp_path / "gsm8k/main/test-00000-of-00001.parquet")
    write(MUSIQUE_ROWS, tmp_path / "musique/validation-00000-of-00001.parquet")
    write(MUSIQUE_ROWS, tmp_path / "musique_dev.jsonl", fmt="jsonl")
    write(hotpot, tmp_path / "hotpot_dev.jsonl", HOTPOT, fmt="jsonl")
    return tmp_path


def test_hub_layouts_read_in_full(hub, capsys):
    mm = load_source("mmlu", str(hub / "mmlu"), split="test")  # the config defaults to "all"
    assert [(e.answers, e.category, e.options[e.answers[0] == "B"]) for e in mm] == [(("B",), "arith", "4"),
                                                                                     (("A",), "geo", "Rome")]
    aux = load_source("mmlu", f"{hub / 'mmlu'}:auxiliary_train", split="auxiliary_train")
    assert [(e.question, e.answers) for e in aux] == [(e.question, e.answers) for e in mm]
    hot = load_source("hotpotqa", str(hub / "hotpot_qa"), split="validation")
    assert [(e.id, e.answers, e.category) for e in hot] == [("h1", ("Rome",), "comparison")]
    gsm = load_source("gsm8k", str(hub / "gsm8k"), split="test")
    assert [e.answers for e in gsm] == [("7",)]
    for spec in (hub / "musique", hub / "musique_dev.jsonl"):
        mus = load_source("musique", str(spec), split="validation")
        assert [(e.id, e.answers, e.category) for e in mus] == [("2hop__1_2", ("Ada Byron", "Ada"), "2hop"),
                                                                ("3hop1__6_7_8", ("Nile", "River Nile"), "3hop")]
    out = capsys.readouterr().out
    assert f"{hub / 'musique'} (musique): 3 rows read, 2 used, 1 left out (1 x unanswerable)" in out
    assert f"{hub / 'mmlu'}:auxiliary_train (mmlu): 2 rows read, 2 used" in out
    with pytest.raises(ValueError, match=r"no 'test' files.*all/test-\*"):
        load_source("mmlu", str(hub / "hotpot_qa"), split="test")


def test_rows_skipped_are_counted_by_reason(tmp_path, capsys):
    rows = [{"question": "ok?", "answer": "#### 1"}, {"question": "no final", "answer": "5"},
            {"question": "no final either", "answer": "6"}, {"answer": "#### 2"}]
    path = tmp_path / "gsm8k.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n{cut\n")
    assert [e.answers for e in load_source("gsm8k", str(path))] == [("1",)]
    assert (f"{path} (gsm8k): 5 rows read, 1 used, 4 broken and skipped (2 x field 'answer' has no '#### N' final "
            "line, 1 x field 'question' missing or not str, 1 x not JSON)") in capsys.readouterr().out


def test_hub_ids_name_their_config_and_split(monkeypatch):
    calls = []

    def fake_load(path, name=None, split=None):
        calls.append((path, name, split))
        rows = {"cais/mmlu": [{"train": r} for r in _mmlu_rows()] if name == "auxiliary_train" else _mmlu_rows(),
                "openai/gsm8k": [{"question": "1+1?", "answer": "#### 2"}]}
        if path not in rows:
            raise ConnectionError("no network")
        return datasets.Dataset.from_list(rows[path])

    monkeypatch.setattr(datasets, "load_dataset", fake_load)
    assert len(load_source("mmlu", "cais/mmlu", split="test")) == 2
    assert len(load_source("mmlu", "cais/mmlu:auxiliary_train", split="auxiliary_train")) == 2
    assert len(load_source("gsm8k", "openai/gsm8k", split="test")) == 1
    assert len(load_source("gsm8k", "openai/gsm8k:socratic", split="test")) == 1
    assert calls == [("cais/mmlu", "all", "test"), ("cais/mmlu", "auxiliary_train", "train"),
                     ("openai/gsm8k", "main", "test"), ("openai/gsm8k", "socratic", "test")]
    with pytest.raises(ValueError, match=r"hotpot_qa:fullwiki: no such local file or directory, and the hub data set "
                                         r"'hotpot_qa' \(config 'fullwiki', split 'validation'\).*no network"):
        load_source("hotpotqa", "hotpot_qa:fullwiki", split="validation")


def test_corpus_reads_every_hotpotqa_and_musique_layout(hub, capsys):
    for hot in (hub / "hotpot_qa:distractor", hub / "hotpot_dev.jsonl"):
        docs = corpus_from_datasets([], [str(hot)], split="validation")
        assert [(d["title"], d["text"]) for d in docs] == [("Rome", "Rome is old. Very old."),
                                                           ("Oslo", "Oslo is newer."), ("Bergen", "Bergen is wet.")]
    docs = corpus_from_datasets([str(hub / "musique"), str(hub / "musique_dev.jsonl")], [], split="validation")
    assert [d["title"] for d in docs] == ["X", "Y", "Z"]
    out = capsys.readouterr().out
    assert "(hotpotqa): 1 rows read; 3 paragraphs, 3 new, 0 seen before" in out
    assert "musique_dev.jsonl (musique): 3 rows read; 3 paragraphs, 0 new, 3 seen before" in out


def _ex(i, category):
    return Example(f"q{i}", f"question {i}?", ("a",), "mmlu", False, options=("a", "b"), kind="mc", category=category)


def test_stratified_sample_by_category():
    # Sorted by subject, as MMLU's test split is: the first 10 rows would be one subject.
    sorted_set = [_ex(i, f"s{i // 20}") for i in range(100)]
    pick = stratified_sample(sorted_set, 10, seed=0)
    assert Counter(e.category for e in pick) == {f"s{j}": 2 for j in range(5)}
    assert [e.id for e in pick] == [e.id for e in stratified_sample(sorted_set, 10, seed=0)]
    assert [e.id for e in pick] != [e.id for e in stratified_sample(sorted_set, 10, seed=1)]
    assert [int(e.id[1:]) for e in pick] == sorted(int(e.id[1:]) for e in pick)  # in the set's order
    # Shares 50/30/20 of 7 seats: 3.5, 2.1, 1.4 -> floors 3, 2, 1; the seat left to the largest remainder.
    uneven = [_ex(i, "a") for i in range(50)] + [_ex(50 + i, "b") for i in range(30)] + [_ex(80 + i, "c") for i in range(20)]
    assert Counter(e.category for e in stratified_sample(uneven, 7, seed=3)) == {"a": 4, "b": 2, "c": 1}
    assert len({e.id for e in stratified_sample(uneven, 99, seed=0)}) == 99
    assert stratified_sample(uneven, 500, seed=0) == uneven
