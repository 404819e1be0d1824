"""Data adapters (official schemas, through `datasets`), the SEM mix, evaluation tables, export."""

import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest
from policies import ScriptedPolicy

from sem_jax.data.example import Example
from sem_jax.data.mix import process_share, sem_mix
from sem_jax.data.sources import load_source
from subprocs import cpu_env

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _jsonl(path, rows):
    path.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in rows) + "\n")
    return str(path)


@pytest.fixture
def files(tmp_path):
    mus = _jsonl(tmp_path / "musique_dev.jsonl", [
        {"id": "2hop_1", "question": "Who founded the company that makes X?", "answer": "Ada Byron",
         "answer_aliases": ["Ada"], "answerable": True, "paragraphs": [{"idx": 0, "title": "X", "paragraph_text": "..."}]},
        {"id": "2hop_2", "question": "Where is Y?", "answer": "Oslo", "answer_aliases": [], "answerable": False,
         "paragraphs": []},
        {"id": "2hop_3", "question": "", "answer": "Oslo", "answerable": True},          # broken: empty question
        {"id": "2hop_4", "question": "What year?", "answer": 1999, "answerable": True},  # broken: answer type
        {"id": "2hop_5", "question": "Which river?", "answer": "Nile", "answer_aliases": ["River Nile"],
         "answerable": True, "paragraphs": []},
    ])
    hotpot = tmp_path / "hotpot_dev.json"  # the official file is one JSON array
    hotpot.write_text(json.dumps([
        {"_id": "h1", "question": "Which is older?", "answer": "Rome", "type": "comparison", "level": "hard",
         "supporting_facts": [["Rome", 0]], "context": [["Rome", ["Rome is old."]]]},
        {"_id": "h2", "question": "Who?", "type": "bridge", "level": "easy", "supporting_facts": [], "context": []},
    ]))
    mmlu_hub = _jsonl(tmp_path / "mmlu.jsonl", [
        {"question": "2+2?", "subject": "math", "choices": ["3", "4", "5", "6"], "answer": 1},
        {"question": "Capital of Italy?", "subject": "geo", "choices": ["Rome", "Milan", "Turin", "Pisa"], "answer": 0},
        {"question": "Bad", "subject": "geo", "choices": ["a", "b"], "answer": 7},
    ])
    mmlu_csv = tmp_path / "astronomy_test.csv"  # per-subject layout: no header, answer letter
    mmlu_csv.write_text('"Closest star?",Sun,Sirius,Vega,Polaris,A\n"Red planet?",Venus,Mars,Earth,Moon,B\n'
                        '"Broken",a,b,c,d,Z\n')
    gsm = _jsonl(tmp_path / "gsm8k_test.jsonl", [
        {"question": "3 apples and 4 more?", "answer": "3 + 4 = 7\n#### 7"},
        {"question": "Big?", "answer": "#### 1,234"},
        {"question": "No final line", "answer": "it is 5"},
    ])
    return dict(musique=mus, hotpotqa=str(hotpot), mmlu=mmlu_hub, mmlu_csv=str(mmlu_csv), gsm8k=gsm)


def test_adapters_on_official_schemas(files, caplog):
    mus = load_source("musique", files["musique"])
    assert [e.id for e in mus] == ["2hop_1", "2hop_5"]
    assert mus[0].answers == ("Ada Byron", "Ada") and mus[0].needs_search and mus[0].source == "musique"
    assert "skipped 2 broken row(s)" in caplog.text and "musique_dev.jsonl" in caplog.text
    hot = load_source("hotpotqa", files["hotpotqa"])
    assert [(e.id, e.answers) for e in hot] == [("h1", ("Rome",))]
    mm = load_source("mmlu", files["mmlu"])
    assert [(e.answers, e.kind, e.needs_search) for e in mm] == [(("B",), "mc", False), (("A",), "mc", False)]
    assert mm[1].options == ("Rome", "Milan", "Turin", "Pisa")
    csv = load_source("mmlu", files["mmlu_csv"])
    assert [(e.question, e.answers, e.options[1]) for e in csv] == [("Closest star?", ("A",), "Sirius"),
                                                                    ("Red planet?", ("B",), "Mars")]
    gsm = load_source("gsm8k", files["gsm8k"])
    assert [e.answers for e in gsm] == [("7",), ("1234",)] and gsm[0].kind == "math"


def test_no_usable_row_is_an_error(tmp_path):
    bad = _jsonl(tmp_path / "bad.jsonl", [{"question": "q"}])
    with pytest.raises(ValueError, match=r"bad\.jsonl \(gsm8k\): no usable row.*answer"):
        load_source("gsm8k", bad)
    with pytest.raises(ValueError, match="unknown data set"):
        load_source("squad", bad)


def test_undecodable_and_malformed_lines_are_broken_rows_with_file_and_line(tmp_path, caplog):
    from sem_jax.data.questions import load_questions
    from sem_jax.retrieval import read_corpus
    row = lambda i: json.dumps({"id": f"q{i}", "question": f"Question {i}?", "answers": ["x"], "source": "s",
                                "needs_search": False})
    path = tmp_path / "questions.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + row(0).encode() + b"\n" + row(1).encode().replace(b"Question", b"Qu\xe9stion")
                     + b"\n{not json\n" + row(3).encode() + b"\n")
    assert [e.id for e in load_questions(str(path))] == ["q0", "q3"]  # the BOM is no broken row
    assert f"{path}: skipped 2 broken row(s); first: {path}:2: not UTF-8 (byte 0xe9 at column" in caplog.text
    # A data set file in JSON Lines loses only its broken line, not the whole file.
    mus = tmp_path / "musique.jsonl"
    good = {"id": "m1", "question": "Where?", "answer": "Oslo", "answerable": True, "paragraphs": []}
    mus.write_bytes(b'{"id": "m0", "quest\n' + json.dumps(good).encode() + b"\n")
    assert [e.id for e in load_source("musique", str(mus))] == ["m1"]
    assert f"{mus}:1: not JSON" in caplog.text
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_bytes(json.dumps({"id": "p0", "text": "fine"}).encode() + b"\n" +
                       b'{"id": "p1", "text": "caf\xe9"}\n')
    assert [d["id"] for d in read_corpus(str(corpus))] == ["p0"]
    utf16 = tmp_path / "utf16.jsonl"
    utf16.write_bytes((row(0) + "\n").encode("utf-16"))
    with pytest.raises(ValueError, match=rf"{utf16}: no usable question \(\d broken; first: {utf16}:1: not UTF-8 .*save it as UTF-8"):
        load_questions(str(utf16))


def test_flags_duplicate_ids_and_multiple_choice_answers_are_checked_per_row(tmp_path, capsys):
    from sem_jax.data.questions import load_questions
    rows = [{"id": "a", "needs_search": "false"}, {"id": "b", "needs_search": "True"}, {"id": "c", "needs_search": 1},
            {"id": "d", "needs_search": False}, {"id": "e", "needs_search": "no"}, {"id": "f", "needs_search": 2},
            {"id": "a", "needs_search": True},  # the id of the first row again
            {"id": "g", "kind": "mc", "options": ["red", "blue"], "answers": ["B"]},
            {"id": "h", "kind": "mc", "options": ["red", "blue"], "answers": ["blue"]},
            {"id": "i", "kind": "mc", "options": ["red", "blue"], "answers": ["C"]},
            {"id": "j", "kind": "mc", "options": ["red", "blue"], "answers": ["green"]}]
    path = tmp_path / "q.jsonl"
    path.write_text("".join(json.dumps({"question": "Q?", "answers": ["x"], **r}) + "\n" for r in rows))
    got = load_questions(str(path))
    assert [(e.id, e.needs_search) for e in got] == [("a", False), ("b", True), ("c", True), ("d", False),
                                                     ("g", False), ("h", False)]
    line = capsys.readouterr().out
    assert (f"{path}: 11 questions read, 6 used, 5 broken and skipped (2 x field 'needs_search' is not true or false, "
            "2 x multiple-choice answer neither an option's letter nor its text, 1 x duplicate id)") in line


def _examples(n, source, search):
    return [Example(f"{source}{i}", f"q{i}", ("a",), source, search) for i in range(n)]


def test_mix_ratio_determinism_and_shares():
    mus, mmlu = _examples(100, "musique", True), _examples(300, "mmlu", False)
    mix = sem_mix(mus, mmlu, seed=3)
    assert sum(e.source == "musique" for e in mix) == sum(e.source == "mmlu" for e in mix) == 100
    assert [e.id for e in mix] == [e.id for e in sem_mix(mus, mmlu, seed=3)]
    assert [e.id for e in mix] != [e.id for e in sem_mix(mus, mmlu, seed=4)]
    two = sem_mix(mus, mmlu, ratio=2.0, seed=0)
    assert sum(e.source == "musique" for e in two) == 2 * sum(e.source == "mmlu" for e in two) == 100
    shares = [process_share(mix, i, 2) for i in range(2)]
    ids = [{e.id for e in s} for s in shares]
    assert not ids[0] & ids[1] and ids[0] | ids[1] == {e.id for e in mix}


# -- evaluation with a scripted policy ------------------------------------------------------

QA = [Example("u1", "Where was Ada born?", ("Selbury",), "toy", True),
      Example("u2", "Where was Bo born?", ("Kelmsby",), "toy", True),
      Example("k1", "What is 2 plus 2?", ("4",), "toy", False, kind="math"),
      Example("k2", "What is 3 plus 3?", ("6",), "toy", False, kind="math")]
DOCS = [{"id": "d1", "title": "Ada", "text": "Ada was born in Selbury."},
        {"id": "d2", "title": "Bo", "text": "Bo was born in Kelmsby."}]


class CountingRetriever:
    def __init__(self, inner):
        self.inner, self.queries = inner, []

    def search(self, queries, k):
        self.queries += list(queries)
        return self.inner.search(queries, k)


def test_evaluate_table_and_naive_rag_calls(qwen25_tokenizer, tmp_path, monkeypatch, capsys):
    from sem_jax import policy_eval
    from sem_jax.evaluate import evaluate_modes, results_table
    from sem_jax.protocol import SEM
    from sem_jax.protocol.sem import format_results
    from sem_jax.retrieval import Retriever
    from sem_jax.sampling import RolloutConfig, Sampler, SamplingConfig, build_stop_automaton

    tok = qwen25_tokenizer
    enc = lambda s: tok.encode(s, add_special_tokens=False)
    retriever = CountingRetriever(Retriever.build(DOCS, show_progress=False))
    cfg = RolloutConfig(group_size=1, max_searches=1, top_k=1, max_tokens_per_passage=32, max_block_tokens=512,
                        max_note_tokens=64)
    # The scripted "policy": u1 searches and gets it right (F1 1); u2 answers directly and wrong;
    # k1 answers right directly; k2 searches needlessly, then answers right.
    block = lambda q: enc(format_results(retriever.inner.search([q], 1)[0], tok, 32))
    responses = {
        "u1": ["<think>?</think><answer>Paris</answer><search>Ada born</search>", block("Ada born"),
               "<think>ok</think><answer>Selbury</answer>"],
        "u2": ["<think>?</think><answer>Kelmsby town</answer>"],
        "k1": ["<think>easy</think><answer>4</answer>"],
        "k2": ["<think>easy</think><answer>6</answer><search>3 plus 3</search>", block("3 plus 3"),
               "<think>ok</think><answer>6</answer>"],
    }
    rows = []
    for ex in QA:
        ids = SEM.encode_prompt(tok, ex)
        for part in responses[ex.id]:
            ids += part if isinstance(part, list) else enc(part)
        rows.append(ids + [151645])
    width = max(map(len, rows)) + 2
    script = np.array([r + [151645] * (width - len(r)) for r in rows])
    sampler = Sampler(ScriptedPolicy(script, len(tok)), build_stop_automaton(tok, SEM.stop_strings),
                      SamplingConfig(max_new_tokens=200, greedy=True, eos_ids=(151645,)))
    res = evaluate_modes(sampler, tok, retriever, {"toy": QA}, ["policy"], cfg, batch_size=4, out_dir=str(tmp_path))
    m = res["policy"]["toy"]
    # Hand-computed: EM 3/4; F1 (1 + 2/3 + 1 + 1) / 4 (u2: "kelmsby town" vs "kelmsby": precision
    # 1/2, recall 1); SR 2/4 (u1, k2 searched); searches/question 0.5.
    assert m["em"] == pytest.approx(0.75)
    assert m["f1"] == pytest.approx((1 + 2 / 3 + 1 + 1) / 4)
    assert m["search_ratio"] == pytest.approx(0.5) and m["searches_per_q"] == pytest.approx(0.5)
    assert m["search_ratio/toy"] == pytest.approx(0.5)
    lines = (tmp_path / "predictions_policy_toy.jsonl").read_text().splitlines()
    assert [json.loads(x)["answer"] for x in lines] == ["Selbury", "Kelmsby town", "4", "6"]
    assert "| policy | 75.00 | 91.67 | 50.00 |" in (tmp_path / "results.md").read_text()
    assert results_table(res, ["toy"]).startswith("| method | toy EM | toy F1 | toy SR |")
    assert m["length"] == 0.0 and m["valid"] == 1.0  # every response ended with EOS
    # Five sampled tokens: every response is cut by the budget, and counted so.
    short = Sampler(ScriptedPolicy(script, len(tok)), build_stop_automaton(tok, SEM.stop_strings),
                    SamplingConfig(max_new_tokens=5, greedy=True, eos_ids=(151645,)))
    cut = evaluate_modes(short, tok, retriever, {"toy": QA}, ["policy"], cfg, batch_size=4)["policy"]["toy"]
    assert cut["length"] == 1.0 and cut["length/toy"] == 1.0 and cut["valid"] == 0.0
    # Why they are invalid, counted by the parser's reason (none where all are valid).
    assert {k: v for k, v in cut.items() if k.startswith("invalid/")} == {"invalid/think_not_closed": 1.0}
    assert not any(k.startswith("invalid/") for k in m)

    # naive_rag: the retriever is asked exactly once per question, with the question.
    retriever.queries.clear()
    monkeypatch.setattr(policy_eval, "PROGRESS_S", 0.0)  # a long set says how far it is: here after each batch
    capsys.readouterr()
    evaluate_modes(sampler, tok, retriever, {"toy": QA}, ["naive_rag"], cfg, batch_size=2)
    assert sorted(retriever.queries) == sorted(e.question for e in QA)
    said = [x.split("questions")[0] for x in capsys.readouterr().out.splitlines() if x.startswith("[eval] naive_rag:")]
    assert said == ["[eval] naive_rag: 2 of 4 ", "[eval] naive_rag: 4 of 4 "]


# -- export -----------------------------------------------------------------------------------

def test_export_and_evaluate_cli_on_a_trained_checkpoint(tmp_path):
    import torch
    import transformers
    from flax import nnx

    from sem_jax.model import from_pretrained

    run = tmp_path / "run"
    env = cpu_env()
    proc = subprocess.run([sys.executable, "-m", "sem_jax.train", f"--config.run_dir={run}",
                           "--config.train.total_steps=1", "--config.data.eval_questions=2",
                           "--config.rollout.max_new_tokens=16"],
                          capture_output=True, text=True, timeout=600, cwd=REPO, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = tmp_path / "hf"
    proc = subprocess.run([sys.executable, "-m", "sem_jax.export", f"--checkpoint={run}/ckpt", f"--out={out}",
                           "--dtype=float32"], capture_output=True, text=True, timeout=600, cwd=REPO, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "exported step 1" in proc.stdout
    assert (out / "tokenizer.json").exists() and (out / "config.json").exists()
    hf = transformers.Qwen2ForCausalLM.from_pretrained(str(out)).eval()
    ours = from_pretrained(str(out))
    # The export holds the trained weights of the checkpoint, not the initial ones.
    from sem_jax.checkpoint import Checkpointer
    _, abstract = nnx.split(ours)
    params, _ = Checkpointer(str(run / "ckpt")).restore_params(None, abstract)
    np.testing.assert_array_equal(np.asarray(params["embed"][...]), np.asarray(ours.embed[...]))
    tokens = np.random.RandomState(0).randint(0, 300, (2, 10))
    with torch.no_grad():
        want = hf(torch.tensor(tokens)).logits.numpy()
    np.testing.assert_allclose(np.asarray(ours(jax.numpy.asarray(tokens))), want, atol=1e-4)
    tok = transformers.AutoTokenizer.from_pretrained(str(out))
    assert tok.eos_token == "<|im_end|>" and "<|im_start|>" in tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False)
    # A second export into the same directory is refused (no old shard stays beside new ones), and
    # a mistyped checkpoint is named before any work, creating nothing.
    again = subprocess.run([sys.executable, "-m", "sem_jax.export", f"--checkpoint={run}/ckpt", f"--out={out}"],
                           capture_output=True, text=True, timeout=600, cwd=REPO, env=env)
    assert again.returncode != 0 and f"{out}: not empty (pass --overwrite to replace it)" in again.stderr
    typo = tmp_path / "rnu" / "ckpt"
    for cmd in (["sem_jax.export", f"--out={tmp_path / 'hf2'}"], ["sem_jax.evaluate"]):
        bad = subprocess.run([sys.executable, "-m", *cmd, f"--checkpoint={typo}"], capture_output=True, text=True,
                             timeout=600, cwd=REPO, env=env)
        assert bad.returncode != 0 and f"{typo}: no checkpoint directory there" in bad.stderr + bad.stdout, cmd
    assert not (tmp_path / "rnu").exists() and not (tmp_path / "hf2").exists()
    zero = subprocess.run([sys.executable, "-m", "sem_jax.evaluate", f"--checkpoint={run}/ckpt", "--limit=0"],
                          capture_output=True, text=True, timeout=600, cwd=REPO, env=env)
    assert zero.returncode != 0 and "--limit=0: give at least 1 question" in zero.stderr + zero.stdout

    # The evaluate command on the same checkpoint: a table per mode, per-question outputs.
    ev = tmp_path / "eval"
    proc = subprocess.run([sys.executable, "-m", "sem_jax.evaluate", "--config", "configs/cpu.py",
                           f"--config.run_dir={run}", "--config.rollout.max_new_tokens=16",
                           f"--checkpoint={run}/ckpt", "--limit=3", "--seed=1", f"--out={ev}"],
                          capture_output=True, text=True, timeout=600, cwd=REPO, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads((ev / "results.json").read_text())
    assert set(results) == {"policy", "direct", "naive_rag"}
    assert results["naive_rag"]["eval"]["search_ratio"] == 1.0
    # --limit is the seeded sample written beside the results, the same questions in every mode.
    sample = json.loads((ev / "sample_eval.json").read_text())
    config = json.loads((run / "config.json").read_text())
    from sem_jax.data.mix import stratified_sample
    from sem_jax.data.questions import load_questions
    assert sample["ids"] == [e.id for e in stratified_sample(load_questions(config["data"]["eval_file"]), 3, 1)]
    assert sample["seed"] == 1 and sample["of"] > 3
    for mode in results:
        rows = [json.loads(line) for line in (ev / f"predictions_{mode}_eval.jsonl").read_text().splitlines()]
        assert [r["id"] for r in rows] == sample["ids"]


def test_corpus_from_data_sets_dedups(files, tmp_path):
    from sem_jax.data.corpus import corpus_from_datasets
    from sem_jax.retrieval import Retriever

    dup = _jsonl(tmp_path / "m2.jsonl", [{"id": "x", "question": "q", "answer": "a", "paragraphs": [
        {"idx": 0, "title": "X", "paragraph_text": "..."},          # same as in the first file
        {"idx": 1, "title": "Oslo", "paragraph_text": "Oslo is the capital of Norway."}]}])
    docs = corpus_from_datasets([files["musique"], dup], [files["hotpotqa"]])
    assert [(d["title"], d["text"]) for d in docs] == [("X", "..."), ("Oslo", "Oslo is the capital of Norway."),
                                                        ("Rome", "Rome is old.")]
    out = tmp_path / "idx"
    proc = subprocess.run([sys.executable, "scripts/build_index.py", "--musique", files["musique"], "--musique", dup,
                           "--hotpotqa", files["hotpotqa"], "--out", str(out)], capture_output=True, text=True,
                          timeout=300, cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    assert Retriever.load(str(out)).search(["capital of Norway"], 1)[0][0].title == "Oslo"


def test_prepare_data_writes_loadable_mix(files, tmp_path):
    from sem_jax.data.questions import load_questions

    proc = subprocess.run([sys.executable, "scripts/prepare_data.py", "--musique", files["musique"], "--mmlu",
                           files["mmlu"], "--out", str(tmp_path), "--eval", "1"], capture_output=True, text=True,
                          timeout=300, cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    rows = load_questions(str(tmp_path / "sem_train.jsonl")) + load_questions(str(tmp_path / "sem_eval.jsonl"))
    assert sorted(e.source for e in rows) == ["mmlu", "mmlu", "musique", "musique"]
    mc = [e for e in rows if e.kind == "mc"][0]
    assert mc.options and mc.answers[0] in "AB"
    empty = subprocess.run([sys.executable, "scripts/prepare_data.py", "--musique", files["musique"], "--mmlu",
                            files["mmlu"], "--out", str(tmp_path / "none"), "--eval", "4"], capture_output=True,
                           text=True, timeout=300, cwd=REPO)
    assert empty.returncode != 0 and "the mix holds 4 questions; --eval=4 held out would leave 0" in empty.stderr
    assert not (tmp_path / "none").exists()


def test_prompts_over_the_cap_are_skipped_with_counts_and_refused_by_the_sampler(files, tmp_path, qwen25_tokenizer,
                                                                                  capsys):
    from sem_jax.assemble import cap_prompts
    from sem_jax.data.questions import load_questions
    from sem_jax.protocol import SEM
    from sem_jax.sampling import Sampler, SamplingConfig, build_stop_automaton
    tok = qwen25_tokenizer
    short = Example("s", "Capital of Italy?", ("Rome",), "mmlu", False)
    passage = " ".join(["The reading passage goes on."] * 100)  # as MMLU's auxiliary_train RACE rows
    long = Example("l", passage + " What is it about?", ("x",), "mmlu", False)
    other = Example("m", "Who founded X?", ("Ada",), "musique", True)
    n = lambda e: len(SEM.encode_prompt(tok, e))
    limit = n(short) + 20
    assert n(long) > limit
    kept = cap_prompts([short, long, other, long], SEM, SEM.system_prompt, tok, limit, "train.jsonl")
    assert kept == [short, other]
    assert "train.jsonl: skipped 2 of 4 questions whose prompt is over data.max_prompt_tokens" in capsys.readouterr().out
    # The sampler refuses a longer prompt instead of compiling a bucket the fit check never saw.
    sampler = Sampler(ScriptedPolicy(np.zeros((2, 8), np.int32), len(tok)), build_stop_automaton(tok, SEM.stop_strings),
                      SamplingConfig(max_new_tokens=4, greedy=True), max_prompt_tokens=limit)
    with pytest.raises(ValueError, match=r"prompt 1 has \d+ tokens, over data.max_prompt_tokens"):
        sampler.start([SEM.encode_prompt(tok, short), SEM.encode_prompt(tok, long)], 1, jax.random.key(0))

    # prepare_data.py skips them before the mix, per source.
    tok_dir = tmp_path / "tok"
    tok.save_pretrained(str(tok_dir))
    rows = [json.loads(x) for x in open(files["mmlu"])]
    rows.append({"question": passage, "subject": "race", "choices": ["a", "b", "c", "d"], "answer": 2})
    mmlu = _jsonl(tmp_path / "mmlu_aux.jsonl", rows)
    out = tmp_path / "mix"
    proc = subprocess.run([sys.executable, "scripts/prepare_data.py", "--musique", files["musique"], "--mmlu", mmlu,
                           "--out", str(out), "--eval", "1", "--tokenizer", str(tok_dir), "--max_prompt_tokens", "200"],
                          capture_output=True, text=True, timeout=300, cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    assert "mmlu_aux.jsonl: skipped 1 of 3 questions whose prompt is over data.max_prompt_tokens=200 (mmlu 1)" \
        in proc.stdout
    rows = load_questions(str(out / "sem_train.jsonl")) + load_questions(str(out / "sem_eval.jsonl"))
    assert len(rows) == 4 and not any("reading passage" in e.question for e in rows)


def test_aggregate_splits_by_source_and_by_label():
    """Scores per source and per label (known: needs no search; unknown: needs one), by hand."""
    from sem_jax.policy_eval import aggregate
    row = lambda source, needs, em, searches: dict(source=source, needs_search=needs, em=em, f1=em, searches=searches,
                                                   response_tokens=10, valid=True, reason="", end_reason="eos")
    records = [row("mmlu", False, 1.0, 0), row("mmlu", False, 0.0, 1), row("musique", True, 1.0, 1),
               row("musique", True, 0.0, 0), row("musique", True, 1.0, 2),
               row("known", False, 1.0, 0), row("unknown", True, 0.0, 1)]  # the demo names its sources by label
    m = aggregate(records)
    assert m["search_ratio"] == pytest.approx(4 / 7) and m["em"] == pytest.approx(4 / 7)
    assert (m["search_ratio/mmlu"], m["search_ratio/musique"]) == (0.5, pytest.approx(2 / 3))
    assert (m["search_ratio/known"], m["em/known"]) == (pytest.approx(1 / 3), pytest.approx(2 / 3))
    assert (m["search_ratio/unknown"], m["em/unknown"], m["searches_per_q/unknown"]) == (0.75, 0.5, 1.0)
