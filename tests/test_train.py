"""`python -m sem_jax.train` end to end: metrics, event files, checkpoints, exact resume after SIGKILL."""

import json
import os
import re
import signal
import socket
import subprocess
import sys

import jax
import numpy as np
import pytest
from flax import nnx

from sem_jax.data.questions import DEMO_DIR, load_questions
from sem_jax.checkpoint import Checkpointer
from sem_jax.model import Qwen2, Qwen2Config, from_pretrained, save_pretrained
from sem_jax.model.tokenizer import train_bpe_tokenizer
from sem_jax.config import cpu_config
from sem_jax.protocol import SEM
from sem_jax.sft import supervised_finetune
from subprocs import cpu_env, free_address, run_together

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEMO_PROMPT = cpu_config().system_prompt


@pytest.fixture(scope="module")
def warm_model(tmp_path_factory):
    """A tiny Qwen2 taught the direct-answer format, so GRPO sees varied rewards."""
    train = load_questions(os.path.join(DEMO_DIR, "train.jsonl"))
    texts = [DEMO_PROMPT] + [e.question + " " + e.answers[0] for e in train]
    tok = train_bpe_tokenizer(texts, 400)
    cfg = Qwen2Config(vocab_size=-(-len(tok) // 64) * 64, hidden_size=64, intermediate_size=128, num_layers=2,
                      num_heads=4, num_kv_heads=2, tie_word_embeddings=True, bos_token_id=None,
                      eos_token_id=tok.eos_token_id)
    model = Qwen2(cfg, rngs=nnx.Rngs(0))
    enc = lambda s: tok.encode(s, add_special_tokens=False)
    pairs = [(SEM.encode_prompt(tok, e, DEMO_PROMPT), [(enc(f"<think>Easy.</think><answer>{e.answers[0]}</answer>")
                                       + [tok.eos_token_id], True)]) for e in train]
    losses = supervised_finetune(model, pairs, steps=60, lr=1e-2, rows=4)
    assert losses[-1] < losses[0] / 3
    path = tmp_path_factory.mktemp("warm")
    save_pretrained(model, str(path))
    tok.save_pretrained(str(path))
    return path


def _cmd(run_dir, model_dir, *extra):
    # Micro-batches of 8 rows, groups of 4: on one device each group's prompt runs once, on the
    # two-process test's 4 batch shards each pair of a group's rows shares it (Trainer.share).
    return [sys.executable, "-m", "sem_jax.train", "--config", os.path.join(REPO, "configs", "cpu.py"),
            f"--config.run_dir={run_dir}", f"--config.model.path={model_dir}", "--config.train.total_steps=3",
            "--config.train.ckpt_every=1", "--config.rl.beta=0.04", "--config.optim.lr=0.003",
            "--config.optim.warmup_steps=0",  # 3-step runs: every step a real update
            "--config.data.eval_questions=4", "--config.rollout.max_new_tokens=48",
            "--config.data.prompts_per_step=4", "--config.rollout.group_size=4", "--config.rl.micro_batch=8", *extra]


def _train(run_dir, model_dir, *extra, check=True):
    proc = subprocess.run(_cmd(run_dir, model_dir, *extra), capture_output=True, text=True, timeout=600, cwd=REPO,
                          env=cpu_env())
    if check:
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def _params(run_dir, step, model_dir):
    """Parameters of a checkpoint, whatever devices and processes saved it, as numpy (the
    tree of `model_dir`'s model gives the structure; one device here)."""
    _, like = nnx.split(from_pretrained(str(model_dir)))
    params, got = Checkpointer(os.path.join(run_dir, "ckpt")).restore_params(step, like)
    assert got == step
    return [np.asarray(x) for x in jax.tree.leaves(params)]


def test_three_steps_then_kill_and_resume_exactly(warm_model, tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    _train(a, warm_model)
    lines = [json.loads(x) for x in (a / "metrics.jsonl").read_text().splitlines()]
    train_lines = [x for x in lines if x["split"] == "train"]
    assert [x["step"] for x in train_lines] == [1, 2, 3]
    for x in train_lines:
        assert all(np.isfinite(v) for k, v in x.items() if k != "split")
    assert any(x["grad_norm"] > 0 for x in train_lines)  # rewards varied: real updates
    # The demo config's cosine decay over 3 steps: 0.5 * (1 + cos(pi * t / 3)) of lr 0.003.
    np.testing.assert_allclose([x["lr"] for x in train_lines], [0.003, 0.00225, 0.00075], rtol=1e-5)
    assert any(x["kl"] > 0 for x in train_lines[1:])     # the reference pass ran
    assert any(f.startswith("events.out.tfevents") for f in os.listdir(a / "tb"))
    assert json.loads((a / "config.json").read_text())["rl"]["beta"] == 0.04
    assert sorted(os.listdir(a / "ckpt")) == ["1", "2", "3"]

    killed = _train(b, warm_model, "--config.train.debug_kill_at_step=2", check=False)
    assert killed.returncode == -9, killed.stderr[-2000:]
    assert sorted(os.listdir(b / "ckpt")) == ["1", "2"]
    resumed = _train(b, warm_model)
    assert "resumed from step 2" in resumed.stdout
    lines = [json.loads(x) for x in (b / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines if x["split"] == "train"] == [1, 2, 3]
    pa, pb = _params(a, 3, warm_model), _params(b, 3, warm_model)
    for x, y in zip(pa, pb):
        np.testing.assert_array_equal(x, y)
    # ... and training did move the parameters.
    assert any(not np.array_equal(x, y) for x, y in zip(_params(a, 1, warm_model), pa))


def _two_processes(cmd) -> list[str]:
    """Run `cmd(*distributed flags)` as processes 0 and 1 of one runtime (2 CPU devices each,
    gloo collectives); both must succeed; their outputs."""
    addr = free_address()
    return run_together([(cmd(f"--config.distributed.coordinator_address={addr}", "--config.distributed.num_processes=2",
                              f"--config.distributed.process_id={i}", "--config.distributed.cpu_collectives=gloo"), 2)
                         for i in (0, 1)], REPO)


def test_two_processes_train_as_one(warm_model, tmp_path):
    """Two processes (2 CPU devices each, gloo collectives) train the 4-device FSDP mesh together:
    each rolls out only its half of every step's questions, and the parameters after two steps
    are those of one process driving all 4 devices over the same global batches. Both roll out
    through 4 decode slots a process (16 rows through 4 slots, 8 through 4 on each of the two):
    rows are admitted as slots free up, at boundaries the processes agree on, and a row's draws
    do not depend on the slot or process it runs in."""
    one, two = tmp_path / "one", tmp_path / "two"
    # No evaluation before training: the two-process evaluation has its own test below. Attention
    # over the whole cache: one window, fewer programs for each of the three processes to compile.
    steps = ("--config.train.total_steps=2", "--config.train.debug_hosts=True", "--config.rollout.slots=4",
             "--config.rollout.chunk_steps=5", "--config.train.eval_at_start=False", "--config.rollout.window_steps=0")
    _two_processes(lambda *flags: _cmd(two, warm_model, *steps, *flags))
    single = subprocess.run(_cmd(one, warm_model, *steps), capture_output=True, text=True, timeout=600, cwd=REPO,
                            env=cpu_env(4))
    assert single.returncode == 0, single.stderr[-3000:]

    read = lambda path: [json.loads(x)["ids"] for x in path.read_text().splitlines()]
    halves = [read(two / f"questions.process{i}.jsonl") for i in (0, 1)]
    whole = read(one / "questions.process0.jsonl")
    assert len(whole) == 2 and all(len(ids) == 4 for ids in whole)
    for step in range(2):
        assert halves[0][step] + halves[1][step] == whole[step]  # its own half, in row order
    after = _params(two, 2, warm_model)
    for x, y in zip(after, _params(one, 2, warm_model)):
        np.testing.assert_allclose(x, y, atol=2e-5)
    assert any(not np.array_equal(x, y) for x, y in zip(_params(two, 1, warm_model), after))
    lines = [json.loads(x) for x in (two / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines if x["split"] == "train"] == [1, 2]  # process 0 alone writes


def test_two_processes_evaluate_as_one(warm_model, tmp_path):
    """`sem_jax.evaluate` on two processes (2 CPU devices each, the 4-device mesh) scores each
    process's share of the questions and writes the same results and predictions as one process
    on 4 devices; an odd --limit leaves the shares unequal (one process pads). The two processes
    sample in tensor-parallel pairs (rollout.tensor=2, a pair per process) with the MLP split over
    both pairs (rollout.spread: each decode step gathers its rows across the processes), the one
    process on the FSDP mesh."""
    def cmd(out, *extra):
        return [sys.executable, "-m", "sem_jax.evaluate", "--config", os.path.join(REPO, "configs", "cpu.py"),
                f"--hf={warm_model}", "--limit=7", "--seed=3", "--modes=policy", f"--out={out}",
                "--config.rollout.max_new_tokens=24", "--config.data.prompts_per_step=2",
                "--config.rollout.group_size=2", "--config.rollout.window_steps=0", *extra]  # one window to compile
    outs = _two_processes(lambda *flags: cmd(tmp_path / "two", "--config.rollout.tensor=2",
                                             "--config.rollout.spread=True", *flags))
    assert "| policy |" in outs[0] and "| policy |" not in outs[1]  # process 0 alone reports and writes
    single = subprocess.run(cmd(tmp_path / "one"), capture_output=True, text=True, timeout=600, cwd=REPO,
                            env=cpu_env(4))
    assert single.returncode == 0, single.stderr[-3000:]
    names = sorted(os.listdir(tmp_path / "one"))
    assert names == ["predictions_policy_eval.jsonl", "results.json", "results.md", "sample_eval.json"]
    assert sorted(os.listdir(tmp_path / "two")) == names
    for name in names:
        assert (tmp_path / "two" / name).read_text() == (tmp_path / "one" / name).read_text(), name
    rows = [json.loads(x) for x in (tmp_path / "one" / "predictions_policy_eval.jsonl").read_text().splitlines()]
    assert len(rows) == 7 and [r["id"] for r in rows] == json.loads((tmp_path / "one" / "sample_eval.json").read_text())["ids"]


def test_config_overrides_and_unknown_field(tmp_path):
    run = tmp_path / "r"
    proc = subprocess.run([sys.executable, "-m", "sem_jax.train", f"--config.run_dir={run}",
                           "--config.train.total_steps=0", "--config.train.eval_at_start=False",
                           "--config.rollout.group_size=3",
                           "--config.rl.clip_eps_high=0.28"],
                          capture_output=True, text=True, timeout=300, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-2000:]
    cfg = json.loads((run / "config.json").read_text())
    assert cfg["rollout"]["group_size"] == 3 and cfg["rl"]["clip_eps_high"] == 0.28
    bad = subprocess.run([sys.executable, "-m", "sem_jax.train", f"--config.run_dir={run}",
                          "--config.rl.bta=1"], capture_output=True, text=True, timeout=300, cwd=REPO)
    assert bad.returncode != 0 and "Traceback" not in bad.stderr
    assert bad.stderr.strip().splitlines()[-1].startswith("unknown config field 'rl.bta'; did you mean rl.beta")
    bad_reward = subprocess.run([sys.executable, "-m", "sem_jax.train", f"--config.run_dir={run}",
                                 "--config.reward=nope", "--config.train.total_steps=0"],
                                capture_output=True, text=True, timeout=300, cwd=REPO)
    assert bad_reward.returncode != 0 and "reward='nope'" in bad_reward.stderr


def test_a_start_below_the_format_threshold_warns_with_the_reasons(capsys):
    from sem_jax.train import check_start_validity

    scores = {"valid": 0.1, "em": 0.2, "invalid/must_start_with_think_then_answer": 0.3, "invalid/no_tags": 0.6}
    assert not check_start_validity(scores, 0.25, "sem")
    out = capsys.readouterr().out
    assert "WARNING: at step 0 only 10%" in out and "sem format" in out
    assert "rejected as no_tags 60%, must_start_with_think_then_answer 30%." in out  # most common first
    assert check_start_validity({"valid": 0.25}, 0.25, "sem") and capsys.readouterr().out == ""


def test_a_resume_rewinds_metrics_to_the_restored_step(tmp_path):
    from sem_jax.metrics import rewind_jsonl
    path = tmp_path / "metrics.jsonl"
    rows = [{"step": s, "split": split} for s in range(6) for split in ("train", "eval")]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows[:7]) + "not json\n" +
                    "".join(json.dumps(r) + "\n" for r in rows[7:]))
    assert rewind_jsonl(str(path), 3) == 4
    kept = path.read_text().splitlines()
    assert kept[-1] == json.dumps(rows[7]) and "not json" in kept
    assert [json.loads(x)["step"] for x in kept if x != "not json"] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert rewind_jsonl(str(path), 3) == 0 and rewind_jsonl(str(tmp_path / "none.jsonl"), 0) == 0


def test_a_training_process_never_imports_torch(tmp_path):
    """The runtime needs no torch, and with torch installed (as here) none of a training run's
    imports nor its metric writer loads it (tensorboardX would, to accept torch tensors)."""
    code = ("import sys, sem_jax.train, sem_jax.evaluate, sem_jax.sft, sem_jax.export, sem_jax.demo\n"
            "from sem_jax.metrics import MetricWriter\n"
            f"w = MetricWriter({str(tmp_path)!r}); w.write(1, {{'loss': 0.5}}); w.close()\n"
            "assert 'torch' not in sys.modules, 'torch was imported'\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=REPO,
                          env=cpu_env())
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert any(f.startswith("events.out.tfevents") for f in os.listdir(tmp_path / "tb"))


@pytest.mark.parametrize("torn", ['{"step": 3, "split": "tr', '{"step": 2, "split": "eval"}'])
def test_a_half_written_last_metrics_row_does_not_swallow_the_next(tmp_path, torn):
    """A crash mid-write leaves the last line without its newline: the resumed run's first row
    must not be glued onto it (that row would be lost to every reader)."""
    from sem_jax.metrics import MetricWriter
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": s, "split": "train", "loss": 1.0}) + "\n" for s in (1, 2)) + torn)
    writer = MetricWriter(str(tmp_path), resumed_step=2)
    writer.write(3, {"loss": 0.5})
    writer.close()
    rows = [json.loads(line) for line in path.read_text().splitlines()]  # every line reads
    assert [(r["step"], r["split"]) for r in rows] == [(1, "train"), (2, "train")] + \
        ([(2, "eval")] if torn.endswith("}") else []) + [(3, "train")]


def test_sigterm_finishes_the_step_saves_and_exits_cleanly(warm_model, tmp_path):
    run = tmp_path / "r"
    cmd = _cmd(run, warm_model, "--config.train.total_steps=50", "--config.train.ckpt_every=100",
               "--config.train.eval_at_start=False", "--config.rl.beta=0.0")
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO, env=cpu_env())
    out = []
    for line in proc.stdout:
        out.append(line)
        if line.startswith("[train 1/50"):
            proc.send_signal(signal.SIGTERM)
            break
    rest, _ = proc.communicate(timeout=300)
    text = "".join(out) + rest
    assert proc.returncode == 0, text[-3000:]
    saved = int(re.search(r"SIGTERM: saved step (\d+), exiting", text).group(1))
    assert 1 <= saved < 50 and sorted(os.listdir(run / "ckpt")) == [str(saved)]  # no checkpoint was due
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines if x["split"] == "train"] == list(range(1, saved + 1))
    resumed = _train(run, warm_model, f"--config.train.total_steps={saved + 1}", "--config.train.eval_at_start=False",
                     "--config.rl.beta=0.0")
    assert f"resumed from step {saved}" in resumed.stdout


def test_one_trainer_per_run_dir_and_a_dead_holders_lock_is_taken_over(tmp_path, capsys):
    from sem_jax.run_lock import RunLock, RunLocked
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; from sem_jax.run_lock import RunLock; "
                               f"RunLock({str(tmp_path)!r}).acquire(); print('held', flush=True); time.sleep(120)"],
                              stdout=subprocess.PIPE, text=True, cwd=REPO)
    assert holder.stdout.readline().strip() == "held"
    with pytest.raises(RunLocked, match=rf"another trainer holds this run directory \(host {socket.gethostname()}, "
                                        rf"pid {holder.pid}, since "):
        RunLock(str(tmp_path)).acquire()
    holder.kill()
    holder.wait()
    with RunLock(str(tmp_path)):
        assert f"taking over the lock of a trainer that is gone (host {socket.gethostname()}, pid {holder.pid}" in \
            capsys.readouterr().out
    with RunLock(str(tmp_path)):  # released cleanly: nothing to take over
        assert "taking over" not in capsys.readouterr().out
