"""The shipped configs load, select what they say, and keep their fields overridable."""

import dataclasses
import importlib.util
import os
import re

import pytest

from sem_jax.config import load

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _load(name, *args):
    spec = importlib.util.spec_from_file_location(name, os.path.join(REPO, "configs", f"{name}.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.get_config(*args)


def test_configs():
    demo = _load("demo_cpu")
    assert demo.model.path is None and demo.protocol == "sem" and load(demo).reward_name() == "sem"
    gpu = _load("gpu")
    assert load(gpu).prompt().startswith("Answer the question. First think briefly")
    gpu.protocol = "research"  # the protocol brings its own prompt and reward
    assert load(gpu).reward_name() == "research" and "wikipedia search tool" in load(gpu).prompt()
    gpu = _load("gpu")
    assert "Qwen2.5-1.5B-Instruct" in gpu.model.path and gpu.model.compute_dtype == "bfloat16"
    assert gpu.rollout.group_size == 5 and gpu.retrieval.top_k == 5 and gpu.optim.lr == 1e-6
    assert "7B" in _load("tpu_v4").model.path and "14B" in _load("tpu_v4", "14b").model.path
    for name in ("qwen3-8b", "qwen3-14b"):
        c = _load("tpu_v4", name)
        assert c.model.preset == name and c.model.path.endswith("Qwen3-" + name.split("-")[1].upper())
        assert load(c).reward_name() == "sem"
    qwen3 = _load("gpu", "qwen3-1.7b")
    assert qwen3.model.preset == "qwen3-1.7b" and qwen3.model.path.endswith("Qwen3-1.7B") and qwen3.run_dir != gpu.run_dir
    with pytest.raises(ValueError, match="choose one of"):
        _load("gpu", "qwen3-32b")
    for variant in ("gpu", "cpu", "cpu_known", "smoke"):  # the experiment: its own section, which its stages strip
        exp = load(_load("real_experiment", variant))
        assert exp.experiment is not None and exp.sft.decision == "random" and exp.model.path.endswith("instruct")
        assert exp.replace(experiment=None).reward_name() == "sem"
    assert load(_load("real_experiment", "smoke")).train.total_steps == 1 < load(_load("real_experiment")).train.total_steps
    cpu = load(_load("real_experiment", "cpu"))  # the floor: 20 steps of 16 rows, 48 questions a data set
    assert cpu.train.total_steps >= 20 and cpu.data.prompts_per_step * cpu.rollout.group_size >= 16
    assert min(cpu.experiment.mmlu_eval, cpu.experiment.gsm8k_eval, cpu.experiment.multihop_eval) >= 48
    assert cpu.lora.rank and load(_load("real_experiment", "smoke")).lora.rank and not load(_load("real_experiment")).lora.rank
    with pytest.raises(ValueError, match="choose one of"):
        _load("tpu_v4", "70b")
    real = _load("real_cpu")  # the real-checkpoint check: paper recipe at a CPU's sizes, no reference copy
    assert real.model.path.endswith("qwen2.5-coder-0.5b-instruct") and real.model.compute_dtype == "float32"
    real = load(real)
    assert real.grpo().beta == 0 and real.rl.micro_batch == 1 and real.optim.build(10).lr == 1e-6
    # Placeholders accept a value of their type.
    demo = _load("demo_cpu")
    demo.rl.clip_eps_high = 0.28
    demo.train.debug_kill_at_step = 2


# Qwen3 model cards: parameters in all and without the embeddings (billions, as rounded there).
QWEN3_CARDS = {"qwen3-0.6b": ("0.6", "0.44"), "qwen3-1.7b": ("1.7", "1.4"), "qwen3-4b": ("4.0", "3.6"),
               "qwen3-8b": ("8.2", "6.95"), "qwen3-14b": ("14.8", "13.2")}


@pytest.mark.parametrize("name", sorted(QWEN3_CARDS))
def test_qwen3_presets_have_their_model_cards_parameter_counts(name):
    import numpy as np

    from sem_jax.model import param_shapes
    from sem_jax.model.presets import preset

    cfg = preset(name)
    total = sum(int(np.prod(shape)) for shape, _ in param_shapes(cfg).values())
    embeddings = cfg.vocab_size * cfg.hidden_size * (1 if cfg.tie_word_embeddings else 2)
    # Equal to the card's figure where it rounds: within half a unit of its last digit.
    rounds_to = lambda x, card: abs(x / 1e9 - float(card)) <= 0.5 * 10.0 ** -len(card.split(".")[1])
    total_card, body_card = QWEN3_CARDS[name]
    assert rounds_to(total, total_card) and rounds_to(total - embeddings, body_card), (total, embeddings)
    assert cfg.model_type == "qwen3" and cfg.qk_norm and not cfg.attention_bias and cfg.head_dim == 128


def test_default_configs_are_the_cpu_ones():
    from sem_jax.train import DEFAULT_CONFIG
    assert DEFAULT_CONFIG == os.path.join(REPO, "configs", "cpu.py")
    # The demo is the CPU training config plus its own two sections, which training never sees.
    from sem_jax.config import DEMO_SECTIONS, training_config
    demo, cpu = _load("demo_cpu"), _load("cpu")
    assert set(demo) - set(cpu) == set(DEMO_SECTIONS)
    assert training_config(load(demo)) == load(cpu)


@pytest.mark.parametrize("field,value,message", [
    ("rollout.group_size", 0, "config.rollout.group_size=0: must be > 0"),
    ("rl.micro_batch", -2, "config.rl.micro_batch=-2: must be > 0"),
    ("train.ckpt_every", 0, "config.train.ckpt_every=0: must be > 0"),
    ("data.prompts_per_step", 0, "config.data.prompts_per_step=0: must be > 0"),
    ("optim.lr", -1e-6, "config.optim.lr=-1e-06: must be in (0.0, 1.0]"),
    ("optim.lr", 0.0, "config.optim.lr=0.0: must be in (0.0, 1.0] (an update of size 0 trains nothing)"),
    ("rollout.temperature", 0.0, "config.rollout.temperature=0.0: must be > 0.0 (sampling divides"),
    ("rollout.max_searches", -1, "config.rollout.max_searches=-1: must be >= 0"),
    ("train.total_steps", -5, "config.train.total_steps=-5: must be >= 0"),
    ("sft.steps", 0, "config.sft.steps=0: must be > 0"),
    ("reward_params.tau", 0.0, "config.reward_params.tau=0.0: must be in (0.0, 1.0] (F1 at or above it counts"),
    ("reward_params.tau", -1.0, "config.reward_params.tau=-1.0: must be in (0.0, 1.0]"),
    ("reward_params.tau", 5.0, "config.reward_params.tau=5.0: must be in (0.0, 1.0]"),
    ("optim.b2", 1.5, "config.optim.b2=1.5: must be in [0.0, 1.0) (Adam's decay)"),
    ("rl.clip_eps_high", -0.1, "config.rl.clip_eps_high=-0.1: must be in [0.0, 10.0]"),
    ("rollout.top_k", -5, "config.rollout.top_k=-5: must be >= 0 (0: all tokens)"),
    ("sft.lr", 1e30, "config.sft.lr=1e+30: must be in [0.0, 1.0]"),
    ("optim.lr", float("nan"), "config.optim.lr=nan: must be a finite number"),
    ("rollout.top_p", 0.0, "config.rollout.top_p=0.0: must be in (0.0, 1.0]"),
])
def test_out_of_range_fields_are_refused_by_name(field, value, message):
    c = _load("cpu")
    section, name = field.split(".")
    c[section][name] = value
    with pytest.raises(ValueError, match=re.escape(message)):
        load(c)


def test_one_trajectory_a_question_is_refused_for_training_not_for_evaluation():
    """GRPO needs groups of 2 or more; an evaluation samples one greedy row a question whatever it is."""
    from sem_jax.assemble import build_train
    from sem_jax.config import ConfigError
    c = load(_load("cpu")).replace(**{"rollout.group_size": 1})
    with pytest.raises(ConfigError, match=r"config.rollout.group_size=1: training needs at least 2 \(GRPO's "):
        build_train(c)
    assert load(_load("cpu")).replace(**{"rollout.group_size": 1}).rollout.group_size == 1  # loads: evaluate takes it


def test_narrowing_is_on_by_default_and_a_no_op_under_lockstep():
    c = _load("cpu")
    assert load(c).engine().narrow
    c.rollout.lockstep = True
    assert load(c).engine().narrow  # loads: the engine narrows only continuous batches (test_rollout)


def test_a_rollout_longer_than_the_models_positions_is_refused():
    from sem_jax.assemble import check_positions
    from sem_jax.model import Qwen2Config
    c = load(_load("cpu"))
    s = c.sampling()
    longest = c.data.max_prompt_tokens + s.max_new_tokens + s.max_inserted_tokens
    shape = dict(vocab_size=64, hidden_size=8, intermediate_size=8, num_layers=1, num_heads=1, num_kv_heads=1)
    check_positions(c, Qwen2Config(**shape, max_position_embeddings=longest))
    with pytest.raises(ValueError, match=rf"data\.max_prompt_tokens=256 \+ rollout\.max_new_tokens=192 \+ \d+ inserted "
                                         rf".* = {longest} is over the model's max_position_embeddings={longest - 1}"):
        check_positions(c, Qwen2Config(**shape, max_position_embeddings=longest - 1))


def test_the_settings_own_every_field_and_refuse_what_they_do_not_know():
    from sem_jax.config import Config, ConfigError, from_dict, to_config_dict, to_dict
    assert load(to_config_dict()) == Config()  # the config files' starting point is the settings' defaults
    demo = load(_load("demo_cpu"))
    assert load(to_config_dict(demo)) == demo and from_dict(to_dict(demo)) == demo
    assert demo.replace(**{"model.path": "/m", "world": None}).model.path == "/m"
    with pytest.raises(ConfigError, match=r"^unknown config field 'rl\.bta'; did you mean rl\.beta\?$"):
        from_dict({"rl": {"bta": 0.1}})
    for tree, message in (({"model": {"remat": "some"}}, "config.model.remat='some': choose one of none, full, dots, "
                                                          "dots_no_batch"),
                          ({"rollout": {"group_size": "8"}}, "config.rollout.group_size='8': must be a int"),
                          ({"rl": {"beta": True}}, "config.rl.beta=True: must be a float"),
                          ({"data": 3}, "config.data: a section, not 3")):
        with pytest.raises(ConfigError, match=re.escape(message)):
            from_dict(tree)
    # A run's config.json from before a field existed: the newer field keeps its default.
    assert from_dict({"rl": {"beta": 0.5}}).rl == dataclasses.replace(Config().rl, beta=0.5)


def test_a_missing_config_file_is_named_in_one_line():
    """It was absl's traceback ending "Failed loading config file config_config"."""
    from sem_jax.config import parse_flags
    for argv in (["prog", "--config", "configs/nope.py:x"], ["prog", "--config=configs/nope.py"]):
        with pytest.raises(SystemExit, match=r"^--config configs/nope\.py(:x)?: no such file \(/.*configs/nope\.py\)$"):
            parse_flags(argv)


def test_a_resume_may_change_how_the_engine_runs_not_what_it_samples():
    """Every engine setting is resumable (the schedule, not the draws: a row's tokens are keyed by
    its row); the group size is what trains and is refused, naming the field."""
    from sem_jax.config import ConfigError, cpu_config, resume_changes

    before = load(cpu_config())
    engine = {"slots": 4, "chunk_steps": 3, "lockstep": True, "narrow": False, "narrow_floor": 2,
              "admit_share": 0.5, "window_steps": 0, "retrieval_threads": 2, "retrieval_timeout_s": 60.0}
    now = cpu_config()
    for k, v in engine.items():
        setattr(now.rollout, k, v)
    assert sorted(resume_changes(before, load(now), "run/config.json")) == sorted(f"rollout.{k}" for k in engine)
    now.rollout.group_size = before.rollout.group_size + 1
    with pytest.raises(ConfigError, match=r"cannot change what it trains \(rollout.group_size: "):
        resume_changes(before, load(now), "run/config.json")
