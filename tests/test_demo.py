"""The CPU demo's parts: the synthetic world, the warm-start traces, packed SFT, the report,
and `python -m sem_jax.demo` end to end (tiny step counts)."""

import json
import os
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest
from policies import packing_case

from sem_jax.demo.world import PHRASINGS, WorldConfig, build_world, texts, warm_start_pairs
from sem_jax.model.tokenizer import train_bpe_tokenizer
from sem_jax.protocol.sem import format_results, parse_response
from sem_jax.retrieval import Retriever
from sem_jax.rl.loss import token_logprobs
from sem_jax.sft import copy_pairs, pack, packed_batches
from subprocs import cpu_env

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMALL = WorldConfig(seed=3, rl_people=30, eval_people=10, warm_people=60)


@pytest.fixture(scope="module")
def world():
    return build_world(SMALL)


def test_world_is_deterministic_split_and_answerable_only_from_the_corpus(world):
    again = build_world(SMALL)
    assert again.corpus == world.corpus and again.train == world.train and again.eval == world.eval
    assert build_world(WorldConfig(seed=4, rl_people=30, eval_people=10, warm_people=60)).corpus != world.corpus
    people = lambda xs: {world.subject[e.id] for e in xs if e.source == "unknown"}
    rl, ev, warm = people(world.train), people(world.eval), people(world.warm_unknown)
    assert rl and ev and warm and not (rl & ev) and not (rl & warm) and not (ev & warm)
    # Balanced RL mix; known eval facts are held out of RL (both phrasings asked).
    assert sum(e.source == "known" for e in world.train) == sum(e.source == "unknown" for e in world.train)
    known_ids = lambda xs: {e.id[:-2] for e in xs if e.source == "known"}
    assert known_ids(world.eval) and not (known_ids(world.eval) & known_ids(world.train))
    by_title = {d["title"]: d["text"] for d in world.corpus}
    corpus_text = " ".join(by_title.values())
    for e in world.train + world.eval + world.warm_unknown:
        if e.source == "known":
            assert e.answers[0] not in corpus_text or e.kind == "math"
            continue
        p = world.subject[e.id]
        text = by_title[p]
        if e.id.startswith("founded"):  # two hops: the person's organisation, then its passage
            org = world.facts[p]["works"]
            assert f"works for {org}." in text and f"founded in {e.answers[0]}." in by_title[org]
        else:
            assert e.answers[0] in text
        assert e.question in (PHRASINGS[e.id.split("-")[0].rstrip("0123456789")][k].format(p=p) for k in (0, 1))


@pytest.mark.parametrize("seed", range(6))
def test_held_out_sums_answers_are_also_rl_answers(seed):
    cfg = WorldConfig(seed=seed, rl_people=30, eval_people=10, warm_people=60)
    w = build_world(cfg)
    sums = lambda xs: {e.id[:-2]: e.answers[0] for e in xs if e.kind == "math"}
    held, rl = sums(w.eval), sums(w.train)
    assert held and set(held.values()) <= set(rl.values())
    # The share of known facts held out is still the configured one.
    n_items = cfg.sum_max ** 2 + cfg.countries
    assert len({e.id for e in w.eval if e.source == "known"}) == 2 * round(n_items * cfg.eval_fraction_known)


def test_warm_start_traces_are_rollout_shaped_and_correct(world):
    tok = train_bpe_tokenizer(texts(world), 400)
    retriever = Retriever.build(world.corpus, show_progress=False)
    pairs = warm_start_pairs(world, tok, retriever, top_k=2, max_tokens_per_passage=48, copies=(2, 3), seed=0)
    questions = world.known + world.warm_unknown
    assert len(pairs) == 2 * len(world.known) + 3 * len(world.warm_unknown)
    searched = {"a": [], "b": []}
    k = 0
    for ex in questions:
        for _ in range(2 if ex.source == "known" else 3):
            prompt, segments = pairs[k]
            k += 1
            text = "".join(tok.decode(ids) for ids, _ in segments)
            parsed = parse_response(text.replace("<|im_end|>", ""))
            assert parsed.valid, (text, parsed.reason)
            if ex.source == "known":
                assert parsed.first_answer == parsed.answer == ex.answers[0]
            elif parsed.num_searches:  # a guess first, then the looked-up answer
                assert parsed.final_answer == ex.answers[0]
            else:  # a guess of the right kind
                kind = "works" if ex.id.startswith("works") else "born"
                assert parsed.first_answer in {f[kind] for f in world.facts.values() if kind in f}
            searched[ex.id[-1]].append(parsed.num_searches > 0)
            # Inserted blocks are exactly the retriever's formatted results for the query before
            # them, tokenized on their own, as the rollout inserts them; the rest is trained.
            for (ids, trained), (prev, _) in zip(segments[1:], segments):
                if not trained:
                    query = tok.decode(prev).rsplit("<search>", 1)[1].split("</search>")[0]
                    assert ids == tok.encode(format_results(retriever.search([query], 2)[0], tok, 48),
                                             add_special_tokens=False)
            if ex.source == "unknown" and parsed.num_searches:
                first_hit = parsed.searches[0][1]
                assert f"(1) {world.subject[ex.id]}:" in first_hit  # rank 1 is the person
    assert 0.65 < np.mean(searched["a"]) < 0.95 and 0.05 < np.mean(searched["b"]) < 0.35


def test_packed_rows_equal_separate_sequences():
    model, pairs = packing_case(0, 7)
    d = pack(pairs, 32)
    assert d["segment_ids"].max(axis=1).sum() == len(pairs) and len(d["inputs"]) < len(pairs)
    lp, _ = token_logprobs(model, jnp.asarray(d["inputs"]), jnp.asarray(d["targets"]),
                           segment_ids=jnp.asarray(d["segment_ids"]))
    n = 0
    for r in range(len(d["inputs"])):
        for k in range(1, d["segment_ids"][r].max() + 1):
            sel = d["segment_ids"][r] == k
            prompt, segs = pairs[n]
            ids = prompt + [t for s, _ in segs for t in s]
            mask = [0] * len(prompt) + [int(tr) for s, tr in segs for _ in s]
            np.testing.assert_array_equal(d["inputs"][r][sel], ids[:-1])
            np.testing.assert_array_equal(d["mask"][r][sel], mask[1:])
            alone, _ = token_logprobs(model, jnp.asarray([ids[:-1]]), jnp.asarray([ids[1:]]))
            np.testing.assert_allclose(np.asarray(lp[r][sel]), np.asarray(alone[0]), atol=1e-5)
            n += 1
    with pytest.raises(ValueError, match="pair 0"):
        pack([([1] * 40, [])], 32)
    batches = list(packed_batches(pairs, 3, rows=2, width=32, seed=0))
    assert all(b["inputs"].shape == (2, 32) for b in batches)


def _write_metrics(run_dir, rows):
    os.makedirs(run_dir, exist_ok=True)
    with open(os.path.join(run_dir, "metrics.jsonl"), "w") as fh:
        fh.writelines(json.dumps(r) + "\n" for r in rows)


def test_copy_pairs_train_only_the_repeat():
    pairs = copy_pairs(range(300, 310), 200, seed=1, lengths=(3, 6))
    assert len(pairs) == 200 and copy_pairs(range(300, 310), 200, seed=1, lengths=(3, 6)) == pairs
    for prompt, [(first, f_trained), (second, s_trained)] in pairs:
        assert prompt == [] and first == second and 3 <= len(first) <= 6 and set(first) <= set(range(300, 310))
        assert not f_trained and s_trained
    batch = pack(pairs[:3], 64)
    # The mask covers exactly the repeats: each target under the mask is the token a copy predicts.
    lengths = [len(p[1][0][0]) for p in pairs[:3]]
    assert batch["mask"].sum() == sum(lengths)
    rows = batch["targets"][0][batch["mask"][0] > 0].tolist()
    assert rows == [t for p in pairs[:3] for t in p[1][1][0]]


def test_demo_report_table_and_png(tmp_path):
    from sem_jax.demo.report import main, table
    ev = lambda step, sk, su, ek, eu: {"step": step, "split": "eval", "search_ratio/known": sk,
                                         "search_ratio/unknown": su, "em/known": ek, "em/unknown": eu}
    tr = lambda step: {"step": step, "split": "train", "reward/mean": 0.1 * step, "search_ratio/known": 0.5,
                       "search_ratio/unknown": 0.5, "em/known": 1.0, "em/unknown": 0.2}
    _write_metrics(tmp_path / "sem", [ev(0, 0.5, 0.45, 0.9, 0.3), tr(1), tr(2), ev(2, 0.04, 0.95, 0.95, 0.7)])
    _write_metrics(tmp_path / "res", [ev(0, 0.5, 0.45, 0.9, 0.3), tr(1), tr(2), ev(2, 0.55, 0.9, 0.9, 0.65)])
    text, picked = table({"SEM": str(tmp_path / "sem"), "ReSearch": str(tmp_path / "res")})
    assert text.splitlines()[2] == "| warm start | 50% | 45% | 90% | 30% |"
    assert text.splitlines()[3] == "| after SEM (step 2) | 4% | 95% | 95% | 70% |"
    assert text.splitlines()[4] == "| after ReSearch (step 2) | 55% | 90% | 90% | 65% |"
    assert main([str(tmp_path / "sem"), str(tmp_path / "res")]) == 0
    assert (tmp_path / "sem" / "demo_curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(FileNotFoundError, match="metrics.jsonl"):
        table({"SEM": str(tmp_path / "missing")})


def test_demo_config_end_to_end_with_tiny_budgets(tmp_path, capsys):
    run = tmp_path / "demo"
    small_model = ["--config.model.init.hidden_size=32", "--config.model.init.intermediate_size=64",
                   "--config.model.init.num_layers=2"]
    cmd = lambda steps: [
        sys.executable, "-m", "sem_jax.demo", f"--config.run_dir={run}", "--config.warm_start.steps=10",
        "--config.warm_start.lookup_steps=5", "--config.warm_start.copy_steps=3",
        "--config.world.rl_people=16", "--config.world.eval_people=6", "--config.world.warm_people=40",
        f"--config.train.total_steps={steps}", "--config.train.ckpt_every=1", "--config.data.prompts_per_step=2",
        "--config.rollout.group_size=2", "--config.data.eval_questions=6", *small_model]
    env = cpu_env()
    proc = subprocess.run(cmd(2), capture_output=True, text=True, timeout=600, cwd=REPO, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "copying random token strings, 3 steps" in proc.stdout and "lookup traces, 5 steps" in proc.stdout
    assert "world: 62 people" in proc.stdout
    assert sorted(os.listdir(run / "world")) == ["corpus.jsonl", "eval.jsonl", "train.jsonl"]
    assert (run / "warm_start" / "config.json").exists() and (run / "warm_start" / "tokenizer.json").exists()
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if r["split"] == "eval"] == [0, 2]
    assert [r["step"] for r in rows if r["split"] == "train"] == [1, 2]
    # Resuming (one more step) loads the saved warm start instead of training it again.
    proc = subprocess.run(cmd(3), capture_output=True, text=True, timeout=600, cwd=REPO, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "warm start: loading" in proc.stdout and "resumed from step 2" in proc.stdout
    from sem_jax.demo.report import main as report  # in this process: the report needs no device
    assert report([str(run)]) == 0
    printed = capsys.readouterr().out
    assert "| warm start |" in printed and "| after SEM (step 3) |" in printed and (run / "demo_curves.png").exists()
    # `sem_jax.evaluate` on the demo run (the run's own config) asks the world's held-out questions.
    ev = tmp_path / "eval"
    proc = subprocess.run([sys.executable, "-m", "sem_jax.evaluate",
                           f"--checkpoint={run}/ckpt", "--modes=policy", "--limit=4", f"--out={ev}"],
                          capture_output=True, text=True, timeout=300, cwd=REPO, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    from sem_jax.data.mix import stratified_sample
    from sem_jax.data.questions import load_questions
    ids = lambda path: [json.loads(x)["id"] for x in path.read_text().splitlines()]
    held_out = load_questions(str(run / "world" / "eval.jsonl"))
    assert ids(ev / "predictions_policy_eval.jsonl") == [e.id for e in stratified_sample(held_out, 4, 0)]
