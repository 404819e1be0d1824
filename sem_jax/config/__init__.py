"""The config: one typed layer, from the config files to the runtime's objects.

- `schema`: every field's default, type and range as frozen sections (`Config`), checked once by
  `load`, with the checks that span fields beside them; the sections build the runtime dataclasses
  they describe (`Config.sampling`, `Config.engine`, `Config.grpo`, `Optim.build`, `Mesh.build`);
  what a resumed run may change (`resume_changes`).
- `presets`: the config files' starting points (`base_config`, `cpu_config`, `paper_recipe`,
  `demo_config`).
- `flags`: the command line's config errors in one line.

The user's interface is ml_collections: `configs/*.py` return a ConfigDict, `--config.x=y`
overrides it, and `load` turns it into the `Config` every module reads.
"""

from sem_jax.config.flags import one_line_config_errors, parse_flags
from sem_jax.config.presets import DEMO_SECTIONS, base_config, cpu_config, demo_config, paper_recipe, training_config
from sem_jax.config.schema import (BLOCK_EXTRA_TOKENS, NOTE_TOKENS, OPTIONAL_SECTIONS, PASSAGE_EXTRA_TOKENS, RESUMABLE,
                                   RL, SFT, Config, ConfigError, Data, Distributed, Experiment, Lora, Mesh, Model,
                                   ModelInit, Optim, Retrieval, RewardParams, Rollout, Train, WarmStart, World,
                                   changed_fields, flat_fields, from_dict, load, resume_changes, run_config,
                                   to_config_dict, to_dict)

__all__ = ["BLOCK_EXTRA_TOKENS", "DEMO_SECTIONS", "NOTE_TOKENS", "OPTIONAL_SECTIONS", "PASSAGE_EXTRA_TOKENS",
           "RESUMABLE", "RL", "SFT", "Config", "ConfigError", "Data", "Distributed", "Experiment", "Lora", "Mesh",
           "Model", "ModelInit", "Optim", "Retrieval", "RewardParams", "Rollout", "Train", "WarmStart", "World",
           "base_config", "changed_fields", "cpu_config", "demo_config", "flat_fields", "from_dict", "load",
           "one_line_config_errors", "paper_recipe", "parse_flags", "resume_changes", "run_config", "to_config_dict",
           "to_dict", "training_config"]
