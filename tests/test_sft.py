"""The format warm start: traces from training questions (sem_jax/traces.py), the supervised
objective of the training update, and `python -m sem_jax.sft` writing a model train can load."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from sem_jax.config import cpu_config
from sem_jax.config import load
from sem_jax.data.example import Example
from sem_jax.data.questions import DEMO_DIR, load_questions
from sem_jax.export import write_hf_dir
from policies import packing_case

from sem_jax.model import Qwen2, Qwen2Config, from_pretrained, save_pretrained
from sem_jax.model.tokenizer import load_tokenizer, train_bpe_tokenizer
from sem_jax.protocol import RESEARCH, SEM
from sem_jax.protocol.chat import chat_prompt
from sem_jax.retrieval import Retriever
from sem_jax.rl.loss import GRPOConfig, token_logprobs
from sem_jax.rl.trainer import OptimConfig, Trainer
from sem_jax.rewards.rules import RewardParams, sem_reward
from sem_jax.sft import finetune, pack
from sem_jax.traces import build_traces

PROMPT = "Answer first; search if unsure."


@pytest.fixture(scope="module")
def demo():
    return load_questions(os.path.join(DEMO_DIR, "train.jsonl")), Retriever.from_jsonl(
        os.path.join(DEMO_DIR, "corpus.jsonl"), show_progress=False)


def test_traces_follow_the_protocol_and_earn_their_paths_reward(demo, qwen_tokenizer):
    """On each tokenizer: the tags as BPE pieces (Qwen2.5), one token (Qwen3), one special token."""
    tok = qwen_tokenizer
    questions, retriever = demo
    pairs, stats = build_traces(questions, tok, retriever, SEM, count=41, search_share=0.3, top_k=2,
                                max_tokens_per_passage=24, system_prompt=PROMPT, seed=3)
    assert (stats.search, stats.direct) == (12, 29) and len(pairs) == 41
    by_prompt = {tuple(SEM.encode_prompt(tok, e, PROMPT)): e for e in questions}
    rp, rewards = RewardParams(), []
    for prompt, segments in pairs:
        ex = by_prompt[tuple(prompt)]
        assert tok.decode(prompt) == chat_prompt(ex, PROMPT)
        text = "".join(tok.decode(ids) for ids, _ in segments)
        think = tok.convert_tokens_to_ids("<think>")
        if think is not None and think != tok.unk_token_id:  # Qwen3: each think tag trained as its one token
            trained = [i for ids, t in segments if t for i in ids]
            assert trained.count(think) == text.count("<think>") > 0
        assert text.endswith("<|im_end|>") and segments[-1][1]
        parsed = SEM.parse(text.removesuffix("<|im_end|>"))
        assert parsed.valid, (parsed.reason, text)
        reward, case = sem_reward(parsed, ex, rp)
        rewards.append(case)
        if ex.needs_search:
            # Trained text, the retriever's block as the rollout inserts it (no loss), trained text.
            assert [t for _, t in segments] == [True, False, True]
            assert parsed.searches[0][0] == ex.question and parsed.answer == ex.answers[0]
            block = SEM.format_results(retriever.search([ex.question], 2)[0], tok, 24)
            assert segments[1][0] == tok.encode(block, add_special_tokens=False)
            assert (case, reward) == ("search_after_wrong", pytest.approx(rp.r_search_base + rp.r_search_scale))
        else:
            assert [t for _, t in segments] == [True] and parsed.num_searches == 0
            assert (case, reward) == ("direct_correct", rp.r_direct)
    assert rewards.count("search_after_wrong") == 12
    assert stats.questions == len({tuple(p) for p, _ in pairs})
    # Every search here finds its person's passage, which holds the answer.
    assert stats.answer_in_results == 12


def test_format_only_traces_search_whatever_the_question(demo, qwen25_tokenizer):
    """sft.decision=random: a search_share of the traces search, drawn apart from the questions'
    labels, so the warm start teaches the format and leaves GRPO the decision."""
    tok = qwen25_tokenizer
    questions, retriever = demo
    kw = dict(top_k=2, max_tokens_per_passage=24, system_prompt=PROMPT, seed=5)
    by_prompt = {tuple(SEM.encode_prompt(tok, e, PROMPT)): e for e in questions}
    label, _ = build_traces(questions, tok, retriever, SEM, count=200, search_share=0.5, **kw)
    pairs, stats = build_traces(questions, tok, retriever, SEM, count=200, search_share=0.5, decision="random", **kw)
    assert (stats.search, stats.direct) == (100, 100)
    searched = {True: [], False: []}  # by the question's label
    for prompt, segments in pairs:
        ex = by_prompt[tuple(prompt)]
        parsed = SEM.parse("".join(tok.decode(ids) for ids, _ in segments).removesuffix("<|im_end|>"))
        assert parsed.valid and parsed.answer == ex.answers[0]  # every path ends with the gold answer
        searched[ex.needs_search].append(parsed.num_searches > 0)
    share = {k: np.mean(v) for k, v in searched.items()}
    assert (stats.search_known, stats.search_unknown) == pytest.approx((share[False], share[True]))
    assert 0.3 < share[False] < 0.7 and 0.3 < share[True] < 0.7  # near 0.5 on both, not 0 / 1
    label_share = {k: np.mean([len(s) > 1 for p, s in label if by_prompt[tuple(p)].needs_search == k])
                   for k in (True, False)}
    assert label_share == {True: 1.0, False: 0.0}  # the label decides (the default)
    with pytest.raises(ValueError, match="sft.decision='always'"):
        build_traces(questions, tok, retriever, SEM, count=4, search_share=0.5, decision="always", **kw)


def test_traces_refuse_what_they_cannot_build(demo, qwen25_tokenizer):
    questions, retriever = demo
    kw = dict(top_k=1, max_tokens_per_passage=16, system_prompt=PROMPT)
    known = [e for e in questions if not e.needs_search]
    with pytest.raises(ValueError, match="needs_search=True"):
        build_traces(known, qwen25_tokenizer, retriever, SEM, count=4, search_share=0.5, **kw)
    with pytest.raises(ValueError, match="search_share=1.5"):
        build_traces(questions, qwen25_tokenizer, retriever, SEM, count=4, search_share=1.5, **kw)
    with pytest.raises(ValueError, match="protocol='research'"):
        build_traces(questions, qwen25_tokenizer, retriever, RESEARCH, count=4, search_share=0.5, **kw)
    # A lone unknown question still gets a wrong first answer, never its own.
    one = [Example("x", "Where was Alvin Varga born?", ("Selbury",), "demo_unknown", True)]
    pairs, _ = build_traces(one, qwen25_tokenizer, retriever, SEM, count=1, search_share=1.0, **kw)
    parsed = SEM.parse("".join(qwen25_tokenizer.decode(s) for s, _ in pairs[0][1]).removesuffix("<|im_end|>"))
    assert parsed.valid and parsed.first_answer == "I don't know"


def test_nll_objective_is_the_masked_token_mean_in_any_micro_batching():
    model, pairs = packing_case(1, 9)
    batch = pack(pairs, 24)
    rows = len(batch["inputs"]) // 2 * 2
    batch = {k: jnp.asarray(v[:rows]) for k, v in batch.items()}
    lp, _ = token_logprobs(model, batch["inputs"], batch["targets"], segment_ids=batch["segment_ids"])
    want = -float(jnp.sum(lp * batch["mask"]) / jnp.sum(batch["mask"]))
    _, params = nnx.split(model)
    out = {}
    for micro in (rows, 1):
        trainer = Trainer(model, GRPOConfig(beta=0.0), OptimConfig(lr=1e-2, eps=1.0, weight_decay=0.0), micro_batch=micro,
                              logprob_chunk=8, objective="nll")
        p = jax.tree.map(jnp.copy, params)
        # eps = 1: the step is about lr * gradient, so that it shows gradient differences unscaled
        new, _, m = trainer.update(p, trainer.init_opt_state(p), batch)
        out[micro] = (float(m["loss"]), new)
    assert out[rows][0] == pytest.approx(want, rel=1e-5) and out[1][0] == pytest.approx(want, rel=1e-5)
    diff = jax.tree.map(lambda a, b: float(jnp.max(jnp.abs(a - b))), out[rows][1], out[1][1])
    assert max(jax.tree.leaves(diff)) < 1e-6
    moved = jax.tree.map(lambda a, b: float(jnp.max(jnp.abs(a - b))), params, out[1][1])
    assert min(jax.tree.leaves(moved)) > 0  # every weight took the step
    with pytest.raises(ValueError, match="objective='ppo'"):
        Trainer(model, GRPOConfig(), OptimConfig(), micro_batch=1, objective="ppo")


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory, demo):
    questions, retriever = demo
    texts = [cpu_config().system_prompt] + [e.question + " " + e.answers[0] for e in questions] + \
        [d["text"] for d in retriever.passages()]
    tok = train_bpe_tokenizer(texts, 600)
    cfg = Qwen2Config(vocab_size=-(-len(tok) // 64) * 64, hidden_size=64, intermediate_size=128, num_layers=2,
                      num_heads=4, num_kv_heads=2, tie_word_embeddings=False, bos_token_id=None,
                      eos_token_id=tok.eos_token_id)
    path = tmp_path_factory.mktemp("tiny")
    save_pretrained(Qwen2(cfg, rngs=nnx.Rngs(0)), str(path))
    tok.save_pretrained(str(path))
    return path


def test_sft_stage_writes_a_model_that_loads_and_learnt(tiny_dir, tmp_path):
    c = load(cpu_config()).replace(**{"model.path": str(tiny_dir), "run_dir": str(tmp_path / "run"),
                                      "data.eval_questions": 2, "sft.traces": 48, "sft.steps": 12, "sft.rows": 4,
                                      "sft.micro_batch": 2, "sft.lr": 3e-3})
    out = tmp_path / "sft"
    report = finetune(c, str(out))
    assert sorted(os.listdir(out)) == ["chat_template.jinja", "config.json", "generation_config.json",
                                       "model.safetensors", "sem_jax_sft.json", "tokenizer.json",
                                       "tokenizer_config.json"]
    assert json.loads((out / "sem_jax_sft.json").read_text()) == json.loads(json.dumps(report))
    assert report["traces"]["search"] == 24 and len(report["losses"]) == 12
    assert report["losses"][-1] < report["losses"][0] - 1.0
    assert {"valid", "em", "search_ratio"} <= set(report["before"]) and "valid" in report["after"]
    before, after = from_pretrained(str(tiny_dir)), from_pretrained(str(out))
    changed = jax.tree.map(lambda a, b: bool(jnp.any(a != b)), nnx.state(before), nnx.state(after))
    assert all(jax.tree.leaves(changed))
    # A finished directory is not overwritten by accident, and is checked before any work.
    with pytest.raises(FileExistsError, match="not empty"):
        finetune(c, str(out))
    with pytest.raises(ValueError, match="model.path"):
        finetune(c.replace(**{"model.path": None}), str(tmp_path / "other"))


def test_write_hf_dir_replaces_a_whole_directory(tiny_dir, tmp_path):
    model = from_pretrained(str(tiny_dir))
    tok = load_tokenizer(str(tiny_dir))
    out = tmp_path / "export"
    out.mkdir()
    (out / "model-00001-of-00002.safetensors").write_text("stale")
    (out / "model.safetensors.index.json").write_text("{}")
    with pytest.raises(FileExistsError, match="--overwrite"):
        write_hf_dir(model, tok, str(out))
    assert sorted(os.listdir(out)) == ["model-00001-of-00002.safetensors", "model.safetensors.index.json"]
    write_hf_dir(model, tok, str(out), overwrite=True, extra={"note.json": {"a": 1}})
    assert "model.safetensors.index.json" not in os.listdir(out) and "model.safetensors" in os.listdir(out)
    assert json.loads((out / "note.json").read_text()) == {"a": 1}
    assert not [p for p in os.listdir(tmp_path) if p.startswith(".export.")]  # no scratch left
    reloaded = from_pretrained(str(out))
    same = jax.tree.map(lambda a, b: bool(jnp.all(a == b)), nnx.state(model), nnx.state(reloaded))
    assert all(jax.tree.leaves(same))


def test_traces_longer_than_the_packed_row_are_skipped_and_reported_before_training(capsys):
    from sem_jax.sft import fitting_pairs
    pairs = [([1] * 5, [([2] * 4, True)]), ([1] * 9, [([2] * 8, True)]), ([1] * 3, [([2] * 3, True)])]
    assert fitting_pairs(pairs, None) == pairs
    assert fitting_pairs(pairs, 9) == [pairs[0], pairs[2]]  # 9 + 1 tokens fit a row of 9 (shifted by one)
    assert "skipped 1 of 3 traces longer than sft.width=9 (the longest has 17 tokens)" in capsys.readouterr().out
    with pytest.raises(ValueError, match="no warm-start trace fits a packed row of sft.width=4"):
        fitting_pairs(pairs, 4)


def test_write_hf_dir_never_deletes_a_users_old_or_partial_directory(tiny_dir, tmp_path):
    """The scratch names are the program's own: `OUT.old` and `OUT.partial` of the user's stay."""
    model, tok = from_pretrained(str(tiny_dir)), load_tokenizer(str(tiny_dir))
    out = tmp_path / "run"
    for name in ("run.old", "run.partial"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "keep.txt").write_text(name)
    write_hf_dir(model, tok, str(out))
    write_hf_dir(model, tok, str(out), overwrite=True)  # replacing an existing export too
    for name in ("run.old", "run.partial"):
        assert (tmp_path / name / "keep.txt").read_text() == name
    assert (out / "config.json").exists() and sorted(os.listdir(tmp_path)) == ["run", "run.old", "run.partial"]
