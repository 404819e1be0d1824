"""The config files' starting points and the command line's errors. `configs/*.py` start from
`base_config()` (every field at its default, from `sem_jax.settings`) and override; every field
can be overridden on the command line: `--config.rl.beta=0.0`. `sem_jax.settings.load` turns the
result into the typed settings every module reads.
"""

from __future__ import annotations

import contextlib
import difflib
import importlib.util
import os
import sys

from ml_collections import ConfigDict

from sem_jax.settings import to_config_dict


def base_config() -> ConfigDict:
    """Every field at its default (`sem_jax.settings`, which owns them): what `configs/*.py` start from."""
    return to_config_dict()


def cpu_config() -> ConfigDict:
    """The embedded CPU default of `sem_jax.train`: a tiny random-init Qwen2 on the bundled
    questions, no downloads. Its sizes and RL settings are the demo's (`sem_jax.demo`), which
    runs this training on its own world from its warm start."""
    c = base_config()
    # The tiny model reads every prompt token on every pass: a short instruction, same protocol.
    c.system_prompt = "Answer first. Search only if unsure."
    # Untied output embeddings (as Qwen2.5-7B) learnt the demo's known facts and copying where tied
    # ones were slow and unreliable; RoPE theta 1e4 suits its short contexts.
    c.model.init.update(tokenizer_vocab=1024, hidden_size=128, intermediate_size=384, num_layers=4,
                        num_heads=4, num_kv_heads=2, tie_word_embeddings=False, rope_theta=1e4)
    c.retrieval.top_k = 1               # one passage per search: short contexts for a tiny model
    c.retrieval.max_tokens_per_passage = 48
    c.rollout.group_size = 8
    c.rollout.max_new_tokens = 192
    c.rollout.temperature = 0.7          # at T = 1 the tiny model samples its known answers wrong too often
    c.data.prompts_per_step = 8
    c.rl.beta = 0.0
    c.rl.micro_batch = 32
    c.optim.lr = 1e-4                    # higher rates broke the answer format within ~10 steps
    c.optim.schedule = "cosine"          # decays to 0 at the last step: held-out answers stay put once
                                         # the search decision is learnt
    c.optim.warmup_steps = 10            # Adam's first steps move every weight by about the full rate:
                                         # without a warmup the demo's policy stopped all searching
                                         # (known and unknown) within 5 steps
    c.train.total_steps = 100
    c.train.ckpt_every = 20
    return c


def paper_recipe(c: ConfigDict) -> ConfigDict:
    """Settings shared by the accelerator configs, after ReSearch/SEM: G = 5, top-5 passages,
    lr 1e-6, KL 0.001 (k3), clip 0.2, and a 1024-token response budget."""
    c.retrieval.top_k = 5
    c.retrieval.max_tokens_per_passage = 128
    c.rollout.group_size = 5
    c.rollout.max_new_tokens = 1024
    c.rl.beta = 0.001
    c.rl.clip_eps = 0.2
    c.rl.logprob_chunk = 256
    c.optim.lr = 1e-6
    c.model.dtype = "float32"            # master weights
    c.model.compute_dtype = "bfloat16"
    c.model.eval_dtype = "bfloat16"      # evaluation needs no master weights: half the memory
    return c


def parse_flags(argv: list[str]) -> list[str]:
    """absl's flag parsing (`app.run(main, flags_parser=parse_flags)`), with an unknown config
    field said in one line (`unknown_field`) instead of a traceback."""
    from absl import flags
    path = config_path(argv)
    if path and not os.path.isfile(path.partition(":")[0]):
        sys.exit(f"--config {path}: no such file ({os.path.abspath(path.partition(':')[0])})")
    try:
        return flags.FLAGS(argv)
    except (flags.Error, AttributeError, KeyError) as e:
        message = unknown_field(argv)
        if message:
            sys.exit(message)
        if isinstance(e, flags.Error):
            sys.exit(f"FATAL Flags parsing error: {e}\nPass --helpshort or --helpfull to see help on flags.")
        raise


@contextlib.contextmanager
def one_line_config_errors(default_config: str | None = None):
    """Around `config_flags.DEFINE_config_file` with a default config, which applies the command
    line's overrides as it loads it: an unknown field then fails there."""
    try:
        yield
    except (AttributeError, KeyError):
        message = unknown_field(sys.argv, default_config)
        if message:
            sys.exit(message)
        raise


def config_path(argv: list[str], default_config: str | None = None) -> str | None:
    """The `--config` of `argv` (FILE or FILE:ARG), else `default_config`."""
    path = default_config
    for i, arg in enumerate(argv[1:], start=1):
        if arg.startswith("--config="):
            path = arg.split("=", 1)[1]
        elif arg == "--config" and i + 1 < len(argv):
            path = argv[i + 1]
    return path


def unknown_field(argv: list[str], default_config: str | None = None) -> str | None:
    """"unknown config field 'rl.bta'; did you mean rl.beta?" for the first `--config.X` of `argv`
    that the config file (`--config`, else `default_config`) does not have; None if all exist."""
    path = config_path(argv, default_config)
    if not path:
        return None
    file, _, arg = path.partition(":")
    try:
        spec = importlib.util.spec_from_file_location("_config_for_flags", file)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        config = module.get_config(arg) if arg else module.get_config()
    except Exception:  # noqa: BLE001 - the config's own error is shown by absl instead
        return None
    for arg in argv[1:]:
        name = arg.lstrip("-").split("=", 1)[0]
        if name.startswith("config.") and not _has(config, name[7:]):
            close = difflib.get_close_matches(name[7:], _paths(config), n=3, cutoff=0.5)
            return f"unknown config field {name[7:]!r}" + (f"; did you mean {', '.join(close)}?" if close else "")
    return None


def _has(config: ConfigDict, path: str) -> bool:
    node = config
    for part in path.split("."):
        if not isinstance(node, ConfigDict) or part not in node:
            return False
        node = node[part]
    return True


def _paths(config: ConfigDict, prefix: str = "") -> list[str]:
    out = []
    for k, v in config.items():
        out += _paths(v, f"{prefix}{k}.") if isinstance(v, ConfigDict) else [f"{prefix}{k}"]
    return out
