"""The stack on a real Qwen2.5 checkpoint (Qwen2.5-Coder-0.5B-Instruct, float32, CPU) against
transformers and the GGUF file it came from. `make test-real` fetches the model and runs these;
figures go to $SEM_JAX_REAL_REPORT (JSON) when set."""

import os
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from sem_jax.data.example import Example
from sem_jax.model import from_pretrained
from sem_jax.model.tokenizer import build_qwen25_tokenizer, load_tokenizer
from sem_jax.protocol import SEM
from sem_jax.sampling import Sampler, SamplingConfig, Trajectory, build_stop_automaton

pytestmark = pytest.mark.real

IM_END, ENDOFTEXT = 151645, 151643
NEVER = "\x00\x00\x00"  # a stop string the model never writes: decoding as HF generate does
# Tokenizer texts: code, CJK, emoji, the protocol's tags, whitespace runs, digits, specials.
TEXTS = [
    "def f(x):\n    return x ** 2  # square\n\n\nclass A:\n\tpass\n",
    "你好，世界！日本語のテキストと한국어 텍스트。",
    "emoji 🚀🔥👩‍👩‍👧 ok 🇫🇷",
    "<think>Not sure.</think>\n<answer>Paris</answer>\n<search>capital of France</search>\n<result>\n(1) x\n</result>",
    "a   b\t\tc\n\n\n   d    \n\r\n  ",
    "1234567890 3.14159 -2e-9 0x1F 1,000,000",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "Ünïcödé naïve café — “quotes” ‘single’ … ½ ∑ ∫ √",
    "   leading spaces and trailing   ",
    "URL https://example.com/a?b=c&d=e#f and email a.b@c.org",
]
QUESTIONS = ["What is the capital of France?", "Where was Alvin Varga born?", "What is 32 plus 6?",
             "Who wrote Hamlet?"]


def example(question: str, needs_search: bool = False) -> Example:
    return Example(id=question, question=question, answers=("x",), source="real", needs_search=needs_search)


def sem_prompt(tok, question: str, system_prompt: str | None = None) -> list[int]:
    return SEM.encode_prompt(tok, example(question), system_prompt)


@pytest.fixture(scope="module")
def real(real_model_dir):
    import torch
    import transformers

    tok = load_tokenizer(real_model_dir)
    hf = transformers.AutoModelForCausalLM.from_pretrained(real_model_dir, dtype=torch.float32).eval()
    return SimpleNamespace(dir=real_model_dir, tok=tok, hf=hf, model=from_pretrained(real_model_dir))


def hf_greedy(hf, prompt: list[int], new: int) -> tuple[list[int], np.ndarray]:
    """transformers' greedy tokens for one unpadded prompt, and their log-probs."""
    import torch

    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=new, do_sample=False, eos_token_id=[IM_END, ENDOFTEXT],
                          pad_token_id=ENDOFTEXT, output_scores=True, return_dict_in_generate=True)
    tokens = out.sequences[0, len(prompt):].tolist()
    logp = [torch.log_softmax(s[0].float(), -1)[t].item() for s, t in zip(out.scores, tokens)]
    return tokens, np.array(logp)


def test_tokenizers_give_the_gguf_tokenizers_ids(real, real_report):
    import transformers

    directory, name = os.path.split(real.dir.rstrip("/") + ".gguf")
    gguf = transformers.AutoTokenizer.from_pretrained(directory, gguf_file=name)
    built = build_qwen25_tokenizer()
    for text in TEXTS:
        want = gguf.encode(text, add_special_tokens=False)
        assert real.tok.encode(text, add_special_tokens=False) == want, text
        assert built.encode(text, add_special_tokens=False) == want, text
        assert real.tok.decode(want) == text
    for token in ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tool_call>", "<|file_sep|>"):
        assert real.tok.convert_tokens_to_ids(token) == built.convert_tokens_to_ids(token) == \
            gguf.convert_tokens_to_ids(token), token
    messages = [{"role": "system", "content": SEM.system_prompt}, {"role": "user", "content": "Who wrote Hamlet?"}]
    text = gguf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert built.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == text
    assert real.tok.decode(sem_prompt(real.tok, "Who wrote Hamlet?")) == text  # the protocol's prompt is Qwen's
    real_report["tokenizer_texts_identical"] = len(TEXTS)


def test_logits_match_transformers_on_sem_trajectories(real, real_report):
    import torch

    tok = real.tok
    trace = ("<think>I do not know who Alvin Varga is.</think>\n<answer>London</answer>\n<search>Alvin Varga "
             "birthplace</search>\n<result>\n(1) Alvin Varga: Alvin Varga was born in Selbury.\n</result>\n"
             "<think>The result says Selbury.</think>\n<answer>Selbury</answer><|im_end|>")
    seqs = [sem_prompt(tok, "Where was Alvin Varga born?") + tok.encode(trace, add_special_tokens=False),
            sem_prompt(tok, "What is 32 plus 6?") + tok.encode("<think>32 + 6 = 38.</think>\n<answer>38</answer>",
                                                              add_special_tokens=False),
            sem_prompt(tok, "Who wrote Hamlet?")]
    width = max(map(len, seqs))
    tokens = np.full((len(seqs), width), ENDOFTEXT, np.int32)
    for i, s in enumerate(seqs):  # right padding: causal, so real positions never see it
        tokens[i, :len(s)] = s
    ours = np.asarray(jax.jit(lambda m, t: m(t))(real.model, jnp.asarray(tokens)))
    with torch.no_grad():
        want = real.hf(torch.tensor(tokens, dtype=torch.long)).logits.numpy()
    real_pos = np.arange(width)[None] < np.array([len(s) for s in seqs])[:, None]
    diff, scale = np.abs(ours - want)[real_pos].max(), np.abs(want[real_pos]).max()
    agree = (ours.argmax(-1) == want.argmax(-1))[real_pos].mean()
    real_report.update(logits_max_abs_diff=float(diff), logits_scale=float(scale), logits_positions=int(real_pos.sum()),
                       argmax_agreement=float(agree))
    assert diff / scale < 2e-5, (diff, scale)
    assert agree == 1.0


def test_greedy_sampler_equals_hf_generate_on_a_ragged_batch(real, real_report):
    tok, new = real.tok, 64
    long_system = SEM.system_prompt + " " + "Be careful and precise in every step of your reasoning. " * 6
    prompts = [sem_prompt(tok, q) for q in QUESTIONS] + [
        sem_prompt(tok, "Write a Python function that returns the n-th Fibonacci number, with a docstring."),
        sem_prompt(tok, "Explain what a hash map is.", long_system),
        sem_prompt(tok, "Who wrote Hamlet?", long_system),
        tok.encode("def quicksort(xs):\n", add_special_tokens=False)]  # a raw code prompt, no chat format
    assert len({len(p) for p in prompts}) == len(prompts)
    stop = build_stop_automaton(tok, [NEVER], vocab_size=real.model.config.vocab_size)
    sampler = Sampler(real.model, stop, SamplingConfig(max_new_tokens=new, greedy=True, eos_ids=(IM_END, ENDOFTEXT)))
    state = sampler.decode(sampler.start(prompts, 1, jax.random.key(0)))
    resp, lens, logp = np.asarray(state.resp), np.asarray(state.resp_len), np.asarray(state.resp_logprob)
    full = 0
    for i, p in enumerate(prompts):
        want, want_logp = hf_greedy(real.hf, p, new)
        assert resp[i, :lens[i]].tolist() == want, f"prompt {i}: {tok.decode(resp[i, :lens[i]])!r} vs {tok.decode(want)!r}"
        np.testing.assert_allclose(logp[i, :lens[i]], want_logp, atol=2e-3)
        full += len(want) == new
    assert full >= 3  # most rows run the whole budget, not just a short answer
    real_report.update(greedy_rows=len(prompts), greedy_new_tokens=new, greedy_rows_full_budget=full,
                       greedy_prompt_lengths=[len(p) for p in prompts])


def test_sampler_pauses_where_the_models_own_output_closes_search(real, real_report):
    tok = real.tok
    unsure = "<think>I do not know this.</think>\n<answer>unknown</answer>\n<search>"
    guess = "<think>I am not sure.</think>\n<answer>London</answer>\n<search>"
    cases = [("Where was Alvin Varga born?", unsure), ("Who directed the film Quiet Harbour?", unsure),
             ("Who directed the film Quiet Harbour?", guess), ("What is the population of Selbury?", unsure),
             ("Where was Alvin Varga born?", guess)]
    prompts = [sem_prompt(tok, q) + tok.encode(pre, add_special_tokens=False) for q, pre in cases]
    new = 32
    stop = build_stop_automaton(tok, SEM.stop_strings, vocab_size=real.model.config.vocab_size)
    sampler = Sampler(real.model, stop, SamplingConfig(max_new_tokens=new, greedy=True, eos_ids=(IM_END, ENDOFTEXT)))
    state = sampler.decode(sampler.start(prompts, 1, jax.random.key(0)))
    resp, lens, paused = np.asarray(state.resp), np.asarray(state.resp_len), np.asarray(state.paused)
    closings = set()
    for i, p in enumerate(prompts):
        want, _ = hf_greedy(real.hf, p, new)
        # The first token after which the model's own text holds `</search>`.
        close = next((k for k in range(len(want)) if "</search>" in tok.decode(want[:k + 1])), None)
        got = resp[i, :lens[i]].tolist()
        if close is None:  # never closes within the budget: must run on, never pause
            assert not paused[i] and got == want, i
            continue
        assert paused[i] and got == want[:close + 1], (i, tok.decode(got), tok.decode(want))
        closings.add(tuple(tok.convert_ids_to_tokens(want[close - 2:close + 1])))
        query = tok.decode(got).split("</search>")[0].strip()
        assert query and SEM.parse_query(cases[i][1] + tok.decode(got)) == query
    # The tag closes in several tokenizations ('.</' 'search' '>', 'Ġ</' ..., '</' ...): all caught.
    assert len(closings) >= 3, closings
    real_report["search_closings"] = sorted("".join(c) for c in closings)


def test_grpo_update_on_real_weights_moves_logprobs_by_the_advantage(real, real_report):
    from sem_jax.rl.batch import build_batch
    from sem_jax.rl.loss import GRPOConfig
    from sem_jax.rl.trainer import OptimConfig, Trainer

    tok, g = real.tok, 4
    prompt = sem_prompt(tok, "Where was Alvin Varga born?")
    stop = build_stop_automaton(tok, [NEVER], vocab_size=real.model.config.vocab_size)
    sampler = Sampler(real.model, stop, SamplingConfig(max_new_tokens=24, temperature=1.0, eos_ids=(IM_END, ENDOFTEXT)))
    state = sampler.decode(sampler.start([prompt], g, jax.random.key(3)))
    resp, lens, logp = np.asarray(state.resp), np.asarray(state.resp_len), np.asarray(state.resp_logprob)
    trajs = [Trajectory(0, prompt, resp[i, :lens[i]], np.ones(lens[i], np.int8), logp[i, :lens[i]], 0, [],
                        tok.decode(resp[i, :lens[i]]), "eos") for i in range(g)]
    adv = np.array([1.0, -1.0, 1.0, -1.0], np.float32)
    batch = build_batch(trajs, adv, micro_batch=2, pad_id=ENDOFTEXT, group_size=g)
    trainer = Trainer(real.model, GRPOConfig(beta=0.0), OptimConfig(lr=1e-7, weight_decay=0.0),
                          micro_batch=2, group_size=g)
    _, params = nnx.split(real.model)
    params = jax.tree.map(jnp.copy, params)  # the update donates its input; the model stays intact
    mask = batch["mask"]
    before = np.asarray(trainer.logprobs(params, batch))
    # The trainer's log-probs of the sampled tokens are the sampler's.
    assert np.abs((before - batch["sampler_logprobs"]) * mask).max() < 2e-3
    params, _, metrics = trainer.update(params, trainer.init_opt_state(params), batch)
    after = np.asarray(trainer.logprobs(params, batch))
    metrics = {k: float(v) for k, v in metrics.items()}
    assert metrics["skipped"] == 0 and np.isfinite(metrics["loss"]) and metrics["grad_norm"] > 0
    seq_before, seq_after = (before * mask).sum(1)[:g], (after * mask).sum(1)[:g]
    # The step raises the rows with positive advantage and lowers the others.
    assert (np.sign(seq_after - seq_before) == np.sign(adv)).all(), (seq_before, seq_after)
    real_report.update(grpo_update_loss=metrics["loss"], grpo_grad_norm=metrics["grad_norm"],
                       grpo_logprob_change=(seq_after - seq_before).round(3).tolist())
