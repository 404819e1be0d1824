"""SEM's effect on the real Qwen2.5-Coder-0.5B-Instruct, in one command (`sem_jax.experiment`):
a format warm start, GRPO with SEM's protocol, GRPO with ReSearch's, and the evaluation of the
base model, the warm start and both trained policies on real MMLU, real GSM8K and invented
multi-hop questions.

    python scripts/fetch_real_model.py --out ~/.cache/sem_jax/qwen2.5-coder-0.5b-instruct
    python scripts/fetch_real_data.py --out ~/.cache/sem_jax/data
    python -m sem_jax.experiment --config configs/real_experiment.py --out runs/experiment         # one GPU
    python -m sem_jax.experiment --config configs/real_experiment.py:smoke --out runs/exp-smoke   # CPU plumbing
    python -m sem_jax.experiment --config configs/real_experiment.py:cpu --out ~/exp-cpu        # 2-core CPU, LoRA
    python -m sem_jax.experiment --config configs/real_experiment.py:cpu_known --out ~/exp-known

On a GPU machine that reaches no network: scripts/gpu_experiment.sh (docs/experiment.md).

`gpu` (the default) is the experiment, sized for one H100 or H200 in bfloat16. Its budget is an
estimate, not a measurement. The H200 ran a `configs/gpu.py` step (Qwen2.5-1.5B's shape, 80 rows
of a 1024-token budget) in 9.9 s; the 0.5B has a third of the weights and a sixth of the KV cache.
So 80 rows of a 384-token budget should take about 2 s a step:
- 2 x 30 GRPO steps, about 2 minutes;
- the warm start's 48 steps and the evaluation's 4 policies x 3 modes x 250 questions, about 2
  more;
- compiling, about 2 to 3 minutes, once per program shape thanks to the persistent compilation
  cache in OUT/xla_cache.

`cpu` is the experiment sized for a 2-core CPU with LoRA (rank 16 on every projection of the top
4 of 24 layers; the update starts from the residual stream the sampler kept there): 30 GRPO steps
of 4 prompts x 4 per protocol, 48 questions of each data set in the policy mode. A step of that
shape (320 prompt tokens, 192 sampled) takes about 100 s here (`scripts/bench_lora.py`: rollout 60,
reference 8, update 30); the experiment's responses are shorter (a first answer, at most one
search), so the headline stages (data, warm start, SEM, the evaluation of the warm start and of
SEM) should take about 1.5 hours and the whole experiment about 3. Sizes chosen for that budget:
- group 4 (16 rows a step, the least the goal allows), 160 sampled tokens, one search of 2
  passages of 48 tokens: a first answer and one search fit, the rollout is most of a step;
- beta 0: LoRA's rank already bounds how far the policy moves (and the reference pass is a
  tenth of a step);
- lr 1e-4 (LoRA wants about 10x a full fine-tune's; 30 steps must move it);
- the warm start: 48 steps of 2 rows of 1024 tokens at lr 4e-4 (a prompt, a search and an answer fit a row);
- the policy mode only (`experiment.modes`): the direct and naive-RAG modes would double the
  evaluation, and the goal's checks read the policy mode;
- GRPO's own evaluation only at its end, on 8 questions (the eval stages score the policies).

`cpu_known` is `cpu` for a model that knows little of MMLU (the 0.5B answers 31% of it right,
so under SEM's reward a search after almost any first answer paid, and `cpu` taught it to search
everything): GRPO's known questions are the training MMLU questions the warm start answers right
first (`experiment.known = "warm_right"`; the evaluation's questions stay as drawn), and a
trajectory may search twice (a 2- or 3-hop question rarely resolves in one search of 2 passages).

`smoke` runs the same stages on this CPU at toy sizes (float32, one GRPO step each, one question of
each data set in each mode) in about 10 minutes. It checks the plumbing: its numbers are not the
experiment's result.
"""

import os

from sem_jax.config import base_config, paper_recipe
from sem_jax.config import Experiment, to_config_dict

REAL_MODEL = os.path.expanduser(os.environ.get("SEM_JAX_REAL_MODEL", "~/.cache/sem_jax/qwen2.5-coder-0.5b-instruct"))
REAL_DATA = os.environ.get("SEM_JAX_REAL_DATA", "~/.cache/sem_jax/data")


def get_config(variant: str = "gpu"):
    if variant not in ("gpu", "cpu", "cpu_known", "smoke"):
        raise ValueError(f"configs/real_experiment.py:{variant}: choose gpu, cpu, cpu_known or smoke")
    c = paper_recipe(base_config())
    c.experiment = to_config_dict(Experiment(data_dir=REAL_DATA))
    c.run_dir = "runs/experiment"  # the stages put their runs under --out
    c.model.path = REAL_MODEL
    c.rollout.group_size = 5
    c.rollout.max_new_tokens = 384
    c.rollout.max_searches = 2
    c.retrieval.top_k = 3
    c.retrieval.max_tokens_per_passage = 64
    c.data.prompts_per_step = 16
    c.data.eval_questions = 64          # GRPO's periodic evaluation, known and unknown
    c.data.max_prompt_tokens = 768      # MMLU's longest questions (law, passages) with the system prompt
    c.rl.micro_batch = 8
    c.optim.lr = 2e-6
    c.optim.warmup_steps = 3
    # The warm start teaches the format only: a share of its traces search whatever the question.
    c.sft.update(traces=384, steps=48, rows=8, width=512, lr=2e-5, search_share=0.5, decision="random")
    c.train.total_steps = 30
    c.train.eval_every = 10
    c.train.ckpt_every = 10
    c.experiment.update(mmlu_train=400, mmlu_eval=100, gsm8k_eval=50, multihop_eval=100)
    if variant in ("cpu", "cpu_known"):
        c.model.compute_dtype = "float32"   # bf16 matmuls are slow on XLA:CPU
        c.model.eval_dtype = "float32"
        c.lora.update(rank=16, alpha=32.0, layers=4)
        c.rollout.group_size = 4
        c.rollout.max_new_tokens = 160
        c.rollout.max_searches = 1
        c.retrieval.top_k = 2
        c.retrieval.max_tokens_per_passage = 48
        c.data.prompts_per_step = 4
        c.data.eval_questions = 8
        c.data.max_prompt_tokens = 512
        c.rl.micro_batch = 8
        c.rl.beta = 0.0
        c.optim.lr = 1e-4
        c.optim.warmup_steps = 2
        # 2 rows of 1024 tokens (a prompt, a search and an answer fit). At 24 steps and lr 2e-4 the loss
        # was still falling (2.1 -> 0.8) and GRPO's first steps wrote the format in a third of their rows.
        c.sft.update(traces=192, steps=48, rows=2, width=1024, lr=4e-4, eval=False)
        c.train.total_steps = 30
        c.train.eval_every = 0
        c.train.eval_at_start = False
        c.train.ckpt_every = 3
        c.experiment.update(mmlu_eval=48, gsm8k_eval=48, multihop_eval=48, modes="policy")
    if variant == "cpu_known":
        c.experiment.known = "warm_right"
        c.rollout.max_searches = 2
    if variant == "smoke":
        c.model.compute_dtype = "float32"   # bf16 matmuls are slow on XLA:CPU
        c.lora.update(rank=4, alpha=8.0, layers=2)
        c.model.eval_dtype = "float32"
        c.rollout.group_size = 2
        c.rollout.max_new_tokens = 32
        c.rollout.max_searches = 1
        c.retrieval.top_k = 2
        c.retrieval.max_tokens_per_passage = 32
        c.data.prompts_per_step = 2
        c.data.eval_questions = 2
        c.rl.micro_batch = 1
        c.rl.beta = 0.0                     # no reference copy of the weights (memory)
        c.sft.update(traces=8, steps=2, rows=1, width=384, eval=False)
        c.train.total_steps = 1
        c.train.eval_every = 0              # GRPO evaluates once, after its step (the eval stages score it)
        c.train.eval_at_start = False
        c.train.ckpt_every = 1
        c.experiment.update(mmlu_train=16, mmlu_eval=1, gsm8k_eval=1, people=40, eval_people=8, organisations=10,
                            cities=8, countries=4, multihop_eval=1)
    return c
