"""A Qwen3 Hugging Face directory through every command unchanged: the format warm start
(`sem_jax.sft`), GRPO (`sem_jax.train --config.model.path=DIR`), `sem_jax.export` and
`sem_jax.evaluate --hf`; what comes out is a Qwen3 that transformers loads and computes alike."""

import json
import os
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
from flax import nnx
from subprocs import cpu_env

from sem_jax.data.questions import DEMO_DIR, load_questions
from sem_jax.model import Qwen2, Qwen2Config, from_pretrained, save_pretrained
from sem_jax.model.tokenizer import train_bpe_tokenizer

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CPU = os.path.join(REPO, "configs", "cpu.py")


def _run(*args, timeout=600):
    proc = subprocess.run([sys.executable, "-m", *args], capture_output=True, text=True, timeout=timeout, cwd=REPO,
                          env=cpu_env())
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def test_a_qwen3_directory_goes_through_sft_train_export_and_evaluate(tmp_path):
    import torch
    import transformers

    train = load_questions(os.path.join(DEMO_DIR, "train.jsonl"))
    tok = train_bpe_tokenizer([e.question + " " + e.answers[0] for e in train], 400)
    tok.add_tokens(["<think>", "</think>"])  # as in Qwen3's vocabulary: one token each, not special
    cfg = Qwen2Config(vocab_size=-(-len(tok) // 64) * 64, hidden_size=64, intermediate_size=128, num_layers=2,
                      num_heads=4, num_kv_heads=2, head_dim=24, tie_word_embeddings=True, bos_token_id=None,
                      eos_token_id=tok.eos_token_id, model_type="qwen3")
    base = tmp_path / "base"
    save_pretrained(Qwen2(cfg, rngs=nnx.Rngs(0)), str(base))
    tok.save_pretrained(str(base))
    assert json.loads((base / "config.json").read_text())["architectures"] == ["Qwen3ForCausalLM"]

    warm, run, out, ev = (tmp_path / name for name in ("warm", "run", "hf", "eval"))
    # The policy's Qwen3 responses are read by `evaluate` below: the warm start and GRPO skip their own
    # evaluations before training (each a compile of the greedy sampler).
    _run("sem_jax.sft", "--config", CPU, f"--config.model.path={base}", f"--out={warm}", "--config.sft.traces=16",
         "--config.sft.steps=2", "--config.sft.rows=4", "--config.sft.micro_batch=2", "--config.sft.eval=False")
    _run("sem_jax.train", "--config", CPU, f"--config.run_dir={run}", f"--config.model.path={warm}",
         "--config.train.total_steps=1", "--config.data.eval_questions=2", "--config.rollout.max_new_tokens=16",
         "--config.data.prompts_per_step=2", "--config.rollout.group_size=2", "--config.rl.micro_batch=4",
         "--config.train.eval_at_start=False")
    _run("sem_jax.export", f"--checkpoint={run}/ckpt", f"--out={out}", "--dtype=float32")
    proc = _run("sem_jax.evaluate", "--config", CPU, f"--config.run_dir={run}", "--config.rollout.max_new_tokens=16",
                f"--hf={out}", "--limit=2", "--modes=policy", f"--out={ev}")
    assert "policy" in json.loads((ev / "results.json").read_text()), proc.stdout[-2000:]

    hf = transformers.AutoModelForCausalLM.from_pretrained(str(out)).eval()
    assert type(hf).__name__ == "Qwen3ForCausalLM" and hf.config.head_dim == 24
    ours = from_pretrained(str(out))
    assert ours.config.model_type == "qwen3" and "q_norm" in ours.layers and "q_bias" not in ours.layers
    # The warm start trained every parameter, the per-head norms among them.
    before, after = from_pretrained(str(base)), from_pretrained(str(warm))
    for name in ("q_norm", "k_norm", "q_kernel"):
        assert not np.array_equal(np.asarray(before.layers[name][...]), np.asarray(after.layers[name][...])), name
    scores = json.loads((ev / "results.json").read_text())["policy"]["eval"]
    assert {"valid", "search_ratio", "em"} <= set(scores)
    tokens = np.random.RandomState(0).randint(0, len(tok), (2, 12))
    with torch.no_grad():
        want = hf(torch.tensor(tokens)).logits.numpy()
    np.testing.assert_allclose(np.asarray(ours(jnp.asarray(tokens))), want, atol=1e-4)
