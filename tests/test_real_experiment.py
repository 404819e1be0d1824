"""`python -m sem_jax.experiment --config configs/real_experiment.py:smoke` end to end on the real
checkpoint and the real MMLU and GSM8K (`make test-real` fetches both): every stage runs, the
report holds every policy, mode and data set, and a second invocation resumes rather than redoes.
The smoke sizes check the plumbing; their scores are not the experiment's result."""

import json
import os
import subprocess
import sys

import pytest

from sem_jax.experiment.data import EVAL_SETS
from sem_jax.experiment.pipeline import POLICIES, STAGES

SMOKE_STAGES = [name for name in STAGES if name != "known"]  # the smoke config's known is the label's

pytestmark = pytest.mark.real

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DATA_ENV = "SEM_JAX_REAL_DATA"


def _experiment(out, real_model_dir):
    env = dict(os.environ, JAX_PLATFORMS="cpu", SEM_JAX_REAL_MODEL=real_model_dir)
    env.pop("XLA_FLAGS", None)
    proc = subprocess.run([sys.executable, "-m", "sem_jax.experiment", "--config",
                           os.path.join(REPO, "configs", "real_experiment.py:smoke"), f"--out={out}"],
                          capture_output=True, text=True, timeout=1200, cwd=REPO, env=env)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return proc.stdout


def test_smoke_experiment_runs_every_stage_and_resumes(real_model_dir, tmp_path, real_report):
    data = os.environ.get(DATA_ENV)
    if not data or not os.path.exists(os.path.join(os.path.expanduser(data), "sources.json")):
        pytest.fail(f"${DATA_ENV} is not a finished data directory; run `python scripts/fetch_real_data.py --out DIR`")
    out = tmp_path / "exp"
    first = _experiment(out, real_model_dir)
    report = json.loads((out / "report.json").read_text())
    assert set(report["results"]) == set(POLICIES)
    for policy, modes in report["results"].items():
        assert set(modes) == {"policy", "direct", "naive_rag"}, policy
        for mode, per in modes.items():
            assert set(per) == set(EVAL_SETS), (policy, mode)
            assert all(0.0 <= per[d]["em"] <= 1.0 for d in EVAL_SETS)
        assert modes["naive_rag"]["mmlu"]["search_ratio"] == 1.0 and modes["direct"]["mmlu"]["search_ratio"] == 0.0
    assert json.loads((out / "eval" / "research" / "finished.json").read_text())["protocol"] == "research"
    assert (out / "curves.png").stat().st_size > 10_000 and "| goal | value | needs | met |" in (out / "report.md").read_text()
    for run in ("sem", "research"):  # one GRPO step each, checkpointed
        rows = [json.loads(line) for line in (out / run / "metrics.jsonl").read_text().splitlines()]
        assert [r["step"] for r in rows if r["split"] == "train"] == [1]
    # Again, with one evaluation undone: only that stage runs.
    os.remove(out / "eval" / "sem" / "finished.json")
    again = _experiment(out, real_model_dir)
    reused = [name for name in STAGES if f"{out / name}: finished before, reused" in again]
    assert reused == [name for name in SMOKE_STAGES if name != "eval/sem"], again[-3000:]
    assert "warm start:" not in again and json.loads((out / "report.json").read_text())["results"].keys() == \
        report["results"].keys()
    real_report["experiment_smoke_stages"] = len(SMOKE_STAGES)
    assert "=== experiment: report" in first
