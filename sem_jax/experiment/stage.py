"""One stage of the experiment in a process of its own (`pipeline.run_experiment` starts it):

    python -m sem_jax.experiment.stage OUT STAGE

reads the config OUT/experiment.json holds, and shares one persistent compilation cache
(OUT/xla_cache) with the other stages: both GRPO runs compile the same programs, and so do the
four evaluations.
"""

from __future__ import annotations

import os
import sys

import jax

from sem_jax.errors import exit_on_error, read_json
from sem_jax.experiment.pipeline import STAGES, run_stage
from sem_jax.config import load


def main(argv: list[str]) -> None:
    if len(argv) != 2 or argv[1] not in STAGES:
        raise SystemExit(f"usage: python -m sem_jax.experiment.stage OUT STAGE (STAGE one of {', '.join(STAGES)})")
    out, name = argv
    config = load(read_json(os.path.join(out, "experiment.json"), "the experiment's config, written at its first "
                                                                   "start"))
    jax.config.update("jax_compilation_cache_dir", os.path.join(out, "xla_cache"))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)
    run_stage(config, out, name)


if __name__ == "__main__":
    exit_on_error(lambda: main(sys.argv[1:]))
