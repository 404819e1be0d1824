"""SEM's effect on a real checkpoint in one command (sem_jax/experiment/pipeline.py says what runs):

    python scripts/fetch_real_data.py --out ~/.cache/sem_jax/data      # once: real MMLU and GSM8K
    python -m sem_jax.experiment --config configs/real_experiment.py --out runs/experiment
    python -m sem_jax.experiment --config configs/real_experiment.py:smoke --out runs/experiment-smoke

Run it again with the same --out to resume where it stopped.
"""

from __future__ import annotations

from absl import app, flags
from absl import logging as absl_logging
from ml_collections import config_flags

from sem_jax.config import parse_flags
from sem_jax.errors import exit_on_error
from sem_jax.experiment.pipeline import run_experiment
from sem_jax.config import load

_CONFIG = config_flags.DEFINE_config_file("config", None, "Experiment config file (configs/real_experiment.py).",
                                          lock_config=True)
flags.DEFINE_string("out", None, "output directory (every stage's files; the same one resumes)", required=True)


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    if _CONFIG.value is None:
        raise app.UsageError("--config is required (configs/real_experiment.py)")
    absl_logging.set_verbosity(absl_logging.WARNING)
    run_experiment(load(_CONFIG.value), flags.FLAGS.out)


if __name__ == "__main__":
    app.run(lambda argv: exit_on_error(lambda: main(argv)), flags_parser=parse_flags)
