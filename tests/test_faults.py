"""The CLIs under faults a hostile but realistic user meets: a checkpoint directory that cannot be
written, a resume under another config, an export or evaluation pointed at the run itself.

One tiny random-init run is trained once; each test works on a copy of it."""

import json
import os
import shutil
import subprocess
import sys

import pytest

from subprocs import cpu_env

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMALL = ["--config.rollout.group_size=2", "--config.data.prompts_per_step=2", "--config.rollout.max_new_tokens=16",
         "--config.data.eval_questions=2", "--config.train.eval_at_start=False", "--config.rl.micro_batch=4",
         "--config.train.ckpt_every=1", "--config.model.init.num_layers=1"]
SHAPE = ["--config.model.init.hidden_size=64", "--config.model.init.intermediate_size=128"]


def _run(module, *args, timeout=300):
    return subprocess.run([sys.executable, "-m", module, *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, cwd=REPO, env=cpu_env())


def _train(run_dir, *extra, timeout=300):
    return _run("sem_jax.train", "--config", os.path.join(REPO, "configs", "cpu.py"), f"--config.run_dir={run_dir}",
                *SMALL, *extra, timeout=timeout)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    run = tmp_path_factory.mktemp("faults") / "run"
    proc = _train(run, *SHAPE, "--config.train.total_steps=2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return run


@pytest.fixture
def run(trained, tmp_path):
    copy = tmp_path / "run"
    shutil.copytree(trained, copy)
    (copy / ".lock").unlink(missing_ok=True)
    return copy


def test_a_failed_checkpoint_save_ends_the_process_with_its_error(run):
    """It hung: orbax's save threads (not daemons) waited for a signal the failed save never sent."""
    ckpt = run / "ckpt"
    if subprocess.run(["chattr", "+i", str(ckpt)], capture_output=True).returncode:
        pytest.skip("chattr +i is not available here (not root, or a file system without it)")
    try:
        proc = _train(run, *SHAPE, "--config.train.total_steps=4", timeout=240)  # a hang is killed by the timeout
    finally:
        subprocess.run(["chattr", "-i", str(ckpt)], check=True)
    assert proc.returncode == 1
    assert (f"{ckpt}: a checkpoint save failed (PermissionError: [Errno 1] Operation not permitted" in
            proc.stderr.strip().splitlines()[-1])
    assert "the last complete checkpoint is step 2" in proc.stderr
    assert sorted(os.listdir(ckpt)) == ["1", "2"]


def test_a_refused_resume_changes_nothing_of_the_run(run):
    config = (run / "config.json").read_text()
    proc = _train(run, "--config.model.init.hidden_size=32", "--config.model.init.intermediate_size=128",
                  "--config.train.total_steps=3")
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines() == [
        f"refused: {run}/config.json: a resumed run cannot change what it trains (model.init.hidden_size: 64 -> 32)."
        " Nothing was changed; resume with the run's config, or train in a new run_dir"]
    assert (run / "config.json").read_text() == config  # evaluate and export still read the run's own
    assert sorted(os.listdir(run / "ckpt")) == ["1", "2"]
    # A run without config.json (written before there was one): the checkpoint's shapes refuse it.
    (run / "config.json").unlink()
    proc = _train(run, "--config.model.init.hidden_size=32", "--config.model.init.intermediate_size=128",
                  "--config.train.total_steps=3")
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines() == [
        f"refused: {run}/ckpt: step 2 was written by another model or optimizer config: params.embed.value is "
        f"(640, 64) in the checkpoint, (640, 32) in this config. Nothing was restored or changed; use the config it "
        "was trained with (run_dir/config.json), or a new run_dir"]
    assert not (run / "config.json").exists() and sorted(os.listdir(run / "ckpt")) == ["1", "2"]
    (run / "config.json").write_text(config)

    # A random-init run's tokenizer is part of its checkpoints: a resume never trains another.
    shutil.rmtree(run / "tokenizer")
    proc = _train(run, *SHAPE, "--config.train.total_steps=3")
    assert proc.returncode == 1 and f"refused: {run}/tokenizer: no tokenizer.json, but {run}/ckpt holds" in proc.stderr
    assert not (run / "tokenizer").exists() and sorted(os.listdir(run / "ckpt")) == ["1", "2"]


def test_export_never_replaces_the_run_it_reads(run):
    before = sorted(os.listdir(run))
    for out, how in ((run, "is"), (run.parent, "holds"), (run / "ckpt" / "hf", "lies inside")):
        proc = _run("sem_jax.export", f"--checkpoint={run}/ckpt", f"--out={out}", "--overwrite")
        assert proc.returncode == 1, out
        assert proc.stderr.strip().splitlines()[-1] == (
            f"refused: --out={out}: {how} {run}, which this job reads; writing there would replace it. Choose an "
            "--out outside it")
    assert sorted(os.listdir(run)) == before and sorted(os.listdir(run / "ckpt")) == ["1", "2"]


def test_evaluate_checks_its_flags_first_and_writes_beside_the_checkpoint_it_reads(run, trained):
    for flags, message in (
            (["--modes=direct,bogus"], "refused: --modes: unknown 'bogus'; choose from policy, direct, naive_rag"),
            (["--modes="], "refused: --modes='': no mode given; choose from policy, direct, naive_rag"),
            (["--data=musique=a,musique=b"], "refused: --data: 'musique' given twice ('a' and 'b'); one path per "
                                             "data set")):
        proc = _run("sem_jax.evaluate", f"--checkpoint={run}/ckpt", *flags)
        assert proc.returncode == 1 and proc.stderr.strip().splitlines()[-1] == message, proc.stderr[-2000:]
        assert not (run / "eval").exists()  # refused before any mode ran
    # `run` is a copy: its config.json still names the original run_dir, which must stay untouched.
    assert json.loads((run / "config.json").read_text())["run_dir"] == str(trained)
    proc = _run("sem_jax.evaluate", f"--checkpoint={run}/ckpt", "--modes=direct", "--limit=1")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (run / "eval" / "results.json").exists() and not (trained / "eval").exists()


def test_a_run_stopped_during_its_final_evaluation_redoes_it_on_restart(run):
    """Killed after its last checkpoint, during the final evaluation: the restart wrote nothing and
    exited 0, and that evaluation's row was lost for good. It now redoes the evaluation (and only
    that: no step is trained again)."""
    path = run / "metrics.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    final = [r for r in rows if r["split"] == "eval" and r["step"] == 2]
    assert len(final) == 1
    path.write_text("".join(json.dumps(r) + "\n" for r in rows if r not in final))
    proc = _train(run, *SHAPE, "--config.train.total_steps=2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    again = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r for r in again if r["split"] == "train"] == [r for r in rows if r["split"] == "train"]
    redone = [r for r in again if r["split"] == "eval" and r["step"] == 2]
    assert len(redone) == 1 and redone[0].keys() == final[0].keys()
    assert sorted(os.listdir(run / "ckpt")) == ["1", "2"]
    # Restarted once more, with the row there: nothing to do.
    proc = _train(run, *SHAPE, "--config.train.total_steps=2")
    assert proc.returncode == 0 and path.read_text().count('"split": "eval"') == len([r for r in again
                                                                                     if r["split"] == "eval"])


def test_a_resume_may_change_how_a_run_goes_not_what_it_trains(run):
    """A resume under another reward, protocol or optimizer was accepted and config.json rewritten.
    Now such a resume is refused naming every field (nothing written); one that changes only how
    long the run goes and how it computes is accepted and recorded in resumes.jsonl, and
    config.json stays the config the run started with."""
    config = (run / "config.json").read_text()
    proc = _train(run, *SHAPE, "--config.train.total_steps=3", "--config.reward=research",
                  "--config.optim.lr=0.5", "--config.protocol=research")
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines()[-1] == (
        f"refused: {run}/config.json: a resumed run cannot change what it trains (optim.lr: 0.0001 -> 0.5; "
        "protocol: 'sem' -> 'research'; reward: None -> 'research'). Nothing was changed; resume with the run's "
        "config, or train in a new run_dir")
    assert (run / "config.json").read_text() == config and not (run / "resumes.jsonl").exists()
    assert sorted(os.listdir(run / "ckpt")) == ["1", "2"]

    proc = _train(run, *SHAPE, "--config.train.total_steps=3", "--config.rollout.slots=2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (run / "config.json").read_text() == config
    (record,) = [json.loads(line) for line in (run / "resumes.jsonl").read_text().splitlines()]
    assert record["step"] == 2 and record["changed"]["train.total_steps"] == [2, 3]
    assert record["changed"]["rollout.slots"] == [0, 2] and sorted(os.listdir(run / "ckpt"))[-1] == "3"
