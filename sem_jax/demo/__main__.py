"""The CPU demo (`make demo`): a synthetic world, a warm start, then GRPO with the SEM reward.

    python -m sem_jax.demo                                   # configs/demo_cpu.py
    python -m sem_jax.demo --config.seed=1 --config.run_dir=runs/demo-seed1

Writes run_dir/world (corpus, train and eval questions) and run_dir/warm_start (an HF
directory), then runs `sem_jax.train` on them; `python -m sem_jax.demo.report run_dir` prints
the before/after table. Restarting with the same run_dir resumes.
"""

from __future__ import annotations

import os

from absl import app
from ml_collections import config_flags

from sem_jax.config import one_line_config_errors, parse_flags
from sem_jax.demo.stage import prepare
from sem_jax.train import cli

DEFAULT_CONFIG = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                              "configs", "demo_cpu.py")
with one_line_config_errors(DEFAULT_CONFIG):
    _CONFIG = config_flags.DEFINE_config_file("config", DEFAULT_CONFIG, "Demo config file (ml_collections).",
                                              lock_config=True)

if __name__ == "__main__":
    app.run(lambda argv: cli(argv, _CONFIG.value, prepare), flags_parser=parse_flags)
