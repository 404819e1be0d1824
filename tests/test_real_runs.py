"""The programs a user runs, on the real checkpoint (configs/real_cpu.py): evaluation in its three
modes, and two GRPO steps whose checkpoint is exported and reloaded in transformers."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from sem_jax.data.example import Example
from sem_jax.protocol import SEM
from sem_jax.rewards.answers import exact_match

pytestmark = pytest.mark.real

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KNOWN = [("What is the capital of France?", "Paris"), ("What is 12 plus 30?", "42"),
         ("Who wrote the play Hamlet?", "William Shakespeare"), ("What is the chemical symbol for gold?", "Au")]
# Invented people: only the corpus knows these.
UNKNOWN = [("Where was Alvin Varga born?", "Selbury"), ("What does Berta Holm work as?", "glassblower"),
           ("In which year was the Kelmsby lighthouse built?", "1873"),
           ("Who founded the company Drummoor Instruments?", "Delia Mirelle")]
PASSAGES = ["Alvin Varga was born in Selbury. He works as a violin maker.",
            "Berta Holm works as a glassblower in Drummoor.",
            "The Kelmsby lighthouse was built in 1873 on the northern cliffs.",
            "Drummoor Instruments was founded by Delia Mirelle, a cartographer.",
            "Cosmo Quist was born in Kelmsby and works as a beekeeper.",
            "Selbury is a small market town on the river Wend."]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("real_data")
    with open(d / "questions.jsonl", "w") as f:
        for i, (q, a) in enumerate(KNOWN):
            f.write(json.dumps({"id": f"k{i}", "question": q, "answers": [a], "source": "known",
                                "needs_search": False, "kind": "qa"}) + "\n")
        for i, (q, a) in enumerate(UNKNOWN):
            f.write(json.dumps({"id": f"u{i}", "question": q, "answers": [a], "source": "unknown",
                                "needs_search": True, "kind": "qa"}) + "\n")
    with open(d / "corpus.jsonl", "w") as f:
        for i, text in enumerate(PASSAGES):
            f.write(json.dumps({"id": f"p{i}", "title": text.split(" ")[0], "text": text}) + "\n")
    return d


def run(*args, timeout=900):
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env.pop("XLA_FLAGS", None)  # one CPU device, as a user's run
    proc = subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=timeout, cwd=REPO, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


def data_flags(files):
    q = files / "questions.jsonl"
    return [f"--config.data.train_file={q}", f"--config.data.eval_file={q}",
            f"--config.retrieval.corpus={files / 'corpus.jsonl'}"]


def test_evaluate_three_modes_end_to_end(real_model_dir, files, tmp_path, real_report):
    out = tmp_path / "eval"
    stdout = run("-m", "sem_jax.evaluate", "--config", "configs/real_cpu.py", "--hf", real_model_dir,
                 *data_flags(files), f"--out={out}")
    results = json.loads((out / "results.json").read_text())
    assert sorted(results) == ["direct", "naive_rag", "policy"]
    for mode, per in results.items():
        records = [json.loads(x) for x in (out / f"predictions_{mode}_eval.jsonl").read_text().splitlines()]
        assert len(records) == len(KNOWN) + len(UNKNOWN)
        m = per["eval"]
        # The reported shares are the saved responses' own: re-parsed and re-scored here.
        valid = [SEM.parse(r["response"], r["end_reason"] == "eos").valid for r in records]
        assert m["valid"] == pytest.approx(np.mean(valid))
        assert m["em"] == pytest.approx(np.mean([max(exact_match(r["answer"] or "", g) for g in r["gold"])
                                                 for r in records]))
        assert f"{mode:9s} eval" in stdout and f"valid {100 * m['valid']:6.2f}" in stdout
        real_report[f"eval_{mode}"] = {k: round(v, 4) for k, v in m.items()
                                       if k.split("/")[0] in ("em", "search_ratio", "valid")}
    # The passages reach the prompt: naive RAG's answers hold facts only the corpus knows (this
    # 0.5B model copies the passage into <answer>, so F1 and containment, not EM, show it).
    def holds_gold(mode):
        rows = [json.loads(x) for x in (out / f"predictions_{mode}_eval.jsonl").read_text().splitlines()]
        return sum(r["gold"][0].lower() in (r["answer"] or "").lower() for r in rows if r["source"] == "unknown")
    assert holds_gold("naive_rag") >= 3 and holds_gold("direct") <= 1
    assert results["naive_rag"]["eval"]["f1/unknown"] > results["direct"]["eval"]["f1/unknown"]
    assert results["naive_rag"]["eval"]["search_ratio"] == 1.0 and results["direct"]["eval"]["search_ratio"] == 0.0


def test_two_grpo_steps_checkpoint_and_export_reload_in_transformers(real_model_dir, files, tmp_path, real_report):
    import jax
    import jax.numpy as jnp
    import torch
    import transformers
    from flax import nnx

    from sem_jax.checkpoint import Checkpointer
    from sem_jax.model import from_pretrained
    from sem_jax.model.safetensors_io import SafetensorsFile

    run_dir, exported = tmp_path / "run", tmp_path / "exported"
    stdout = run("-m", "sem_jax.train", "--config", "configs/real_cpu.py", f"--config.run_dir={run_dir}",
                 *data_flags(files), "--config.data.eval_questions=4")
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = [x for x in lines if x["split"] == "train"]
    start = next(x for x in lines if x["split"] == "eval" and x["step"] == 0)  # the initial policy, evaluated
    # The run says when the initial policy seldom follows the format (then GRPO's groups tie).
    assert ("WARNING: at step 0 only" in stdout) == (start["valid"] < 0.25)
    assert [x["step"] for x in train] == [1, 2]
    assert all(np.isfinite(x["loss"]) and np.isfinite(x["grad_norm"]) and x["skipped_steps"] == 0 for x in train)
    assert all(0 <= x["groups/tied"] <= 1 for x in train)
    assert sorted(os.listdir(run_dir / "ckpt")) == ["1", "2"]
    real_report["grpo_cli_start_valid"] = start["valid"]
    real_report["grpo_cli_steps"] = [{k: round(x[k], 5) for k in ("loss", "grad_norm", "reward/mean", "valid",
                                                                   "groups/tied", "time/step")} for x in train]

    run("-m", "sem_jax.export", f"--checkpoint={run_dir / 'ckpt'}", f"--out={exported}", "--dtype=float32")
    # The checkpoint's parameters, through sem_jax, against the export, through transformers.
    model = from_pretrained(real_model_dir)
    _, like = nnx.split(model)
    params, got = Checkpointer(str(run_dir / "ckpt")).restore_params(None, like)
    assert got == 2
    nnx.update(model, params)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(exported), dtype=torch.float32).eval()
    question = Example(id="u0", question=UNKNOWN[0][0], answers=(UNKNOWN[0][1],), source="unknown", needs_search=True)
    tokens = np.array([SEM.encode_prompt(transformers.AutoTokenizer.from_pretrained(str(exported)), question)])
    ours = np.asarray(jax.jit(lambda m, t: m(t))(model, jnp.asarray(tokens)))
    with torch.no_grad():
        want = hf(torch.tensor(tokens, dtype=torch.long)).logits.numpy()
    diff, scale = np.abs(ours - want).max(), np.abs(want).max()
    assert diff / scale < 2e-5, (diff, scale)
    fetched, weights = SafetensorsFile(os.path.join(real_model_dir, "model.safetensors")), hf.state_dict()
    changed = [not np.array_equal(weights[name].numpy(), fetched[name]) for name in
               ("model.layers.0.self_attn.q_proj.weight", "model.layers.23.mlp.down_proj.weight", "lm_head.weight")]
    if all(x["groups/tied"] == 1 for x in train):
        # No group's rewards differed: zero advantages and gradients, and AdamW's decay (lr x wd,
        # 1e-8 of each weight) rounds away in float32: the weights must come back unchanged.
        assert not any(changed)
    else:
        assert all(changed)
    real_report["grpo_cli_weights_changed"] = all(changed)
    real_report["export_logits_max_abs_diff"] = float(diff)
