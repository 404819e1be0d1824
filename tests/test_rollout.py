"""Stop detection on the real Qwen2.5 vocabulary, and the full search loop with a scripted policy."""

import jax
import numpy as np
import pytest
from policies import ScriptedPolicy

from sem_jax.protocol import SEM
from sem_jax.protocol.sem import LIMIT_NOTE, NO_QUERY, format_results, parse_query, result_block
from sem_jax.retrieval import Passage, Retriever
from sem_jax.sampling import RolloutConfig, Sampler, SamplingConfig, build_stop_automaton, rollout
from sem_jax.sampling.stop import _byte_decoder, trie_states

IM_END = 151645


@pytest.fixture(scope="module")
def automaton(qwen25_tokenizer):
    return build_stop_automaton(qwen25_tokenizer, SEM.stop_strings)


def _ids(tok, pieces):
    """Each piece (text) as exactly one token of the real vocabulary."""
    enc = {b: c for c, b in _byte_decoder().items()}
    out = []
    for piece in pieces:
        i = tok.convert_tokens_to_ids("".join(enc[b] for b in piece.encode()))
        assert i is not None and i != tok.unk_token_id and tok.decode([i]) == piece, piece
        out.append(i)
    return out


def _first_hit(tok, ids):
    text = b""
    for n, i in enumerate(ids):
        text += tok.decode([i]).encode()
        if b"</search>" in text:
            return n
    return None


STOP_PIECES = [
    ["</", "search", ">"],
    [" </", "search", ">\n"],
    ["?</", "search", ">\n\n"],
    ["<", "/", "search", ">"],
    ["</", "se", "arch", ">"],
    list("</search>"),                       # byte by byte
    ["x", "</", "search", ">.", " The"],     # stop inside a token that carries more text
    ["<", "search", ">", "a", "</", "search", ">"],
]
NEAR_MISSES = ["</searc", "</ search>", "<search>", "</Search>", "</search", "search>", "< /search>"]


@pytest.mark.parametrize("pieces", STOP_PIECES, ids=lambda p: "+".join(p))
def test_stop_on_every_tokenization(qwen25_tokenizer, automaton, pieces):
    ids = _ids(qwen25_tokenizer, pieces)
    hit = _first_hit(qwen25_tokenizer, ids)
    assert automaton.feed(ids) == [n == hit for n in range(len(ids))]


def test_stop_in_tokenizer_contexts(qwen_tokenizer):
    """Also beside tags that are one token (Qwen3's `</think>`), special or not."""
    automaton = build_stop_automaton(qwen_tokenizer, SEM.stop_strings)
    for text in ["Why </search>", "x?</search>\n\nok", "<search>capital of France</search>",
                 "a</search></search>b", "((</search>))", "<think>x</think><search>q</search><think>",
                 "</think></search></think>", "<tool_response></search></tool_response>"]:
        ids = qwen_tokenizer.encode(text, add_special_tokens=False)
        hits = automaton.feed(ids)
        assert sum(hits) == text.count("</search>") and hits.index(True) == _first_hit(qwen_tokenizer, ids)


def test_near_misses_do_not_stop(qwen25_tokenizer, automaton):
    for text in NEAR_MISSES:
        for ids in (qwen25_tokenizer.encode(text, add_special_tokens=False),
                    [qwen25_tokenizer.convert_tokens_to_ids(_byte_decoder_inv(b)) for b in text.encode()]):
            assert not any(automaton.feed(ids)), text


def _byte_decoder_inv(b):
    return {v: k for k, v in _byte_decoder().items()}[b]


def test_device_loop_pauses_at_the_right_token(qwen25_tokenizer, automaton):
    """The compiled loop, not only the host replay: each variant pauses its row at the stop token."""
    variants = [_ids(qwen25_tokenizer, ["Hi"] + p + ["more", "text"]) for p in STOP_PIECES]
    width = max(map(len, variants)) + 4
    prompt = [151644]
    script = np.full((len(variants), width + 1), 198)
    for r, ids in enumerate(variants):
        script[r, 1:1 + len(ids)] = ids
    policy = ScriptedPolicy(script, len(qwen25_tokenizer))
    sampler = Sampler(policy, automaton, SamplingConfig(max_new_tokens=width, greedy=True))
    state = sampler.decode(sampler.start([prompt] * len(variants), 1, jax.random.key(0)))
    assert np.asarray(state.paused).all()
    for r, ids in enumerate(variants):
        assert int(state.resp_len[r]) == _first_hit(qwen25_tokenizer, ids) + 1, STOP_PIECES[r]


@pytest.mark.parametrize("stops", [SEM.stop_strings, ["</search>", "</sea", "<x>"], ["ab", "b"]])
def test_trie_states_is_the_automatons_table_width(qwen25_tokenizer, stops):
    """Compile-only checks size the stop table by `trie_states`; the sampler's is the automaton's."""
    assert trie_states(stops) == build_stop_automaton(qwen25_tokenizer, stops).num_states


def test_parse_query():
    assert parse_query("<answer>x</answer><search> capital of France </search>") == "capital of France"
    assert parse_query("<search>a</search><result>r</result><search>b</search>\n") == "b"
    assert parse_query("no tags </search>") == ""
    assert parse_query("<search>a</search> then </search>") == ""
    assert parse_query("plain") == ""


def test_result_block_tells_a_blank_query_how_to_ask(qwen25_tokenizer):
    hit = [Passage("d", "Paris", "Paris is the capital of France.", 1.0)]
    assert result_block("capital", hit, qwen25_tokenizer, 32) == format_results(hit, qwen25_tokenizer, 32)
    assert result_block("  ", hit, qwen25_tokenizer, 32) == f"\n<result>\n(1) {NO_QUERY}\n</result>\n"


DOCS = [
    {"id": "d1", "title": "Paris", "text": "Paris is the capital and largest city of France."},
    {"id": "d2", "title": "Mount Everest", "text": "Everest is the highest mountain on Earth."},
    {"id": "d3", "title": "Nile", "text": "The Nile is a river in Africa."},
]


class CountingRetriever:
    def __init__(self, inner):
        self.inner, self.batches = inner, []

    def search(self, queries, k):
        self.batches.append(list(queries))
        return self.inner.search(queries, k)


@pytest.fixture(scope="module")
def retriever():
    return Retriever.build(DOCS, show_progress=False)


def _script(tok, prompt, parts, group_size):
    ids = list(prompt)
    for p in parts:
        ids += p if isinstance(p, list) else tok.encode(p, add_special_tokens=False)
    return np.array([ids] * group_size), ids


def test_scripted_rollout_two_searches(qwen_tokenizer, retriever):
    tok = qwen_tokenizer
    cfg = RolloutConfig(group_size=3, max_searches=2, top_k=2, max_tokens_per_passage=32, max_block_tokens=512,
                        max_note_tokens=64)
    enc = lambda s: tok.encode(s, add_special_tokens=False)
    # What the retriever will answer, tokenized as the rollout must insert it.
    b1 = enc(format_results(retriever.search(["capital of France"], 2)[0], tok, 32))
    b2 = enc(format_results(retriever.search(["highest mountain"], 2)[0], tok, 32))
    t1 = "<think>I think so.</think><answer>Lyon</answer><search>capital of France</search>"
    t2 = "<think>Lyon was wrong.</think><search>highest mountain</search>"
    t3 = "<think>Done.</think><answer>Paris</answer>"
    prompt = enc("<|im_start|>user\nQ?<|im_end|>\n<|im_start|>assistant\n")
    script, full = _script(tok, prompt, [t1, b1, t2, b2, t3, [IM_END]], 1)
    policy = ScriptedPolicy(script, len(tok))
    stop = build_stop_automaton(tok, SEM.stop_strings)
    sampler = Sampler(policy, stop, SamplingConfig(max_new_tokens=len(full) + 16, greedy=True,
                                                   eos_ids=(IM_END,)))
    counting = CountingRetriever(retriever)
    trajs, stats = rollout(sampler, tok, counting, [prompt], jax.random.key(0), cfg)
    assert len(trajs) == 3 and stats.retriever_calls == 2
    # Once per pause round, for all paused rows at once.
    assert counting.batches == [["capital of France"] * 3, ["highest mountain"] * 3]
    sampled = enc(t1) + enc(t2) + enc(t3) + [IM_END]
    for t in trajs:
        assert t.end_reason == "eos" and t.num_searches == 2
        assert t.queries == ["capital of France", "highest mountain"]
        # Token-in/token-out: sampled ids are the scripted ids, inserted ids the blocks' tokenization.
        assert t.response_ids.tolist() == full[len(prompt):]
        assert t.response_ids[t.loss_mask == 1].tolist() == sampled
        assert t.response_ids[t.loss_mask == 0].tolist() == b1 + b2
        assert (t.logprobs[t.loss_mask == 0] == 0).all() and (t.logprobs[t.loss_mask == 1] > -1e-3).all()
        assert "(1) Paris: Paris is the capital" in t.text and "(1) Mount Everest:" in t.text
        assert t.text.endswith("<answer>Paris</answer>") and t.text.startswith("<think>I think so.</think>")
        parsed = SEM.parse(t.text)
        assert parsed.valid and parsed.answer == "Paris" and parsed.thinks[0] == "I think so.", parsed


def test_search_limit_note_then_stop(qwen25_tokenizer, retriever):
    tok = qwen25_tokenizer
    enc = lambda s: tok.encode(s, add_special_tokens=False)
    b1 = enc(format_results(retriever.search(["Nile"], 1)[0], tok, 96))
    note = enc(LIMIT_NOTE)
    t1, t2, t3 = "<search>Nile</search>", "<search>Nile again</search>", "<search>third</search>"
    prompt = enc("Q")
    script, full = _script(tok, prompt, [t1, b1, t2, note, t3, "never reached"], 2)
    sampler = Sampler(ScriptedPolicy(script, len(tok)), build_stop_automaton(tok, SEM.stop_strings),
                      SamplingConfig(max_new_tokens=200, greedy=True, eos_ids=(IM_END,)))
    trajs, _ = rollout(sampler, tok, retriever, [prompt], jax.random.key(0),
                       RolloutConfig(group_size=2, max_searches=1, top_k=1, max_tokens_per_passage=96,
                                     max_block_tokens=512, max_note_tokens=64))
    for t in trajs:
        assert t.end_reason == "search_limit" and t.num_searches == 1
        assert t.response_ids[t.loss_mask == 0].tolist() == b1 + note
        assert t.text.endswith("<search>third</search>")


def test_sampled_budget_apart_from_the_room_for_inserted_tokens(qwen25_tokenizer, retriever):
    """max_new_tokens counts sampled tokens only: a search's block goes into room of its own, and a
    block over max_block_tokens is cut (and counted)."""
    tok = qwen25_tokenizer
    enc = lambda s: tok.encode(s, add_special_tokens=False)
    t1 = enc("<search>Paris</search>")
    block = enc(format_results(retriever.search(["Paris"], 3)[0], tok, 96))
    prompt = enc("Q")
    new = len(t1) + 7
    script, _ = _script(tok, prompt, [t1, block, enc("x" * 50)], 1)
    cfg = lambda cut: RolloutConfig(group_size=1, max_searches=2, top_k=3, max_tokens_per_passage=96,
                                    max_block_tokens=cut, max_note_tokens=64)
    for room, cut in ((len(block), len(block)), (len(block), len(block) - 4)):
        sampler = Sampler(ScriptedPolicy(script, len(tok)), build_stop_automaton(tok, SEM.stop_strings),
                          SamplingConfig(max_new_tokens=new, greedy=True, max_inserted_tokens=room))
        (t,), stats = rollout(sampler, tok, retriever, [prompt], jax.random.key(0), cfg(cut))
        assert t.end_reason == "length" and int(t.loss_mask.sum()) == new  # every sampled token it may have
        inserted = t.response_ids[t.loss_mask == 0].tolist()
        # Cut inside the passages, never through the tags: the block still closes.
        want = block if cut == len(block) else SEM.block_ids("Paris", retriever.search(["Paris"], 3)[0], tok, 96,
                                                             cut)[0]
        assert inserted == want and len(inserted) <= cut and tok.decode(inserted).endswith("</result>\n")
        assert stats.cut_blocks == (cut < len(block))


LONG_TITLES = ["2014–15 UEFA Champions League knockout phase", "List of Knight's Cross of the Iron Cross recipients (A)",
               "1998 FIFA World Cup qualification (CONMEBOL)", "Timeline of the 2011–2012 Syrian uprising",
               "Results of the 2016 United States presidential election in Texas"]


@pytest.mark.parametrize("protocol", ["sem", "research"])
def test_result_blocks_fit_their_budget_and_always_close(qwen25_tokenizer, protocol):
    """At the paper's settings (top 5, 128 tokens a passage) five long titles over full passages
    made a block one token over the budget, cut through `</result>`: the response then parsed
    invalid. A block over budget has its titles cut (the budget's room for them), then is cut
    inside its passages."""
    from sem_jax.config import base_config, paper_recipe
    from sem_jax.protocol import get_protocol
    from sem_jax.protocol.chat import TITLE_TOKENS
    from sem_jax.config import load
    tok, proto = qwen25_tokenizer, get_protocol(protocol)
    block_budget, _ = load(paper_recipe(base_config())).inserted_tokens()
    text = " ".join(["The knockout phase began on 17 February 2015 and ended with the final."] * 20)
    hits = [Passage(str(i), title, text, 1.0) for i, title in enumerate(LONG_TITLES)]
    whole = tok.encode(proto.result_block("champions league", hits, tok, 128), add_special_tokens=False)
    assert len(whole) > block_budget or protocol == "research"  # the case found (ReSearch's marks are fewer)
    block_budget = min(block_budget, len(whole) - 1)
    ids, shortened = proto.block_ids("champions league", hits, tok, 128, block_budget)
    # Sized from the cut parts: titles cut to chat.TITLE_TOKENS, every text kept at its 128 tokens.
    assert shortened and ids == tok.encode(proto.result_block("champions league", hits, tok, 128, TITLE_TOKENS),
                                           add_special_tokens=False) and len(ids) <= block_budget
    block = tok.decode(ids)
    assert block.rstrip().endswith("</result>") and block.count("<result>") == 1
    assert "2014–15 UEFA Champions League knockout" not in block
    # A block that fits keeps its titles whole.
    assert proto.block_ids("champions league", hits[:2], tok, 128, block_budget) == (
        tok.encode(proto.result_block("champions league", hits[:2], tok, 128), add_special_tokens=False), False)
    for budget in (block_budget // 2, 60):  # tighter: passages cut shorter, then dropped; tags kept
        small, shortened = proto.block_ids("champions league", hits, tok, 128, budget)
        assert shortened and len(small) <= budget and tok.decode(small).rstrip().endswith("</result>")
    if protocol == "sem":
        response = (f"<think>Unsure.</think>\n<answer>Real Madrid</answer>\n<search>champions league</search>"
                    f"{tok.decode(small)}<think>Found.</think>\n<answer>Barcelona</answer>")
        parsed = proto.parse(response, True)
        assert parsed.valid, parsed.reason
    with pytest.raises(ValueError, match="cannot hold"):
        proto.block_ids("champions league", hits, tok, 128, 5)


@pytest.mark.parametrize("protocol", ["sem", "research"])
def test_result_blocks_fit_a_small_vocabularys_budget(protocol):
    """A tiny config's own BPE spends more tokens on the tags and marks than the budget's fixed
    room for them (19 on the tags alone against BLOCK_EXTRA_TOKENS = 16): with a long title and
    max_tokens_per_passage <= 7 the block did not fit even cut to one passage with no text, and
    the rollout raised. The one passage left has its title cut shorter, then dropped."""
    from sem_jax.config import BLOCK_EXTRA_TOKENS, PASSAGE_EXTRA_TOKENS
    from sem_jax.model.tokenizer import train_bpe_tokenizer
    from sem_jax.protocol import get_protocol
    tok = train_bpe_tokenizer(["The knockout phase began on 17 February 2015 and ended with the final."] * 4, 300)
    proto = get_protocol(protocol)
    title = "Ωμέγα λόγος supercalifragilistic " + LONG_TITLES[0]
    hit = Passage("0", title, "The knockout phase began on 17 February 2015.", 1.0)
    for per in range(1, 8):
        budget = PASSAGE_EXTRA_TOKENS + per + BLOCK_EXTRA_TOKENS  # top_k = 1
        ids, shortened = proto.block_ids("champions league", [hit], tok, per, budget)
        block = tok.decode(ids)
        assert shortened and len(ids) <= budget and block.rstrip().endswith("</result>"), (per, block)
        assert block.count("<result>") == 1 and "supercalifragilistic" not in block, (per, block)


def test_budget_counts_inserted_tokens(qwen25_tokenizer, retriever):
    tok = qwen25_tokenizer
    enc = lambda s: tok.encode(s, add_special_tokens=False)
    t1 = enc("<search>Paris</search>")
    prompt = enc("Q")
    budget = len(t1) + 5  # the result block does not fit
    script, _ = _script(tok, prompt, [t1, enc("x" * 50)], 1)
    sampler = Sampler(ScriptedPolicy(script, len(tok)), build_stop_automaton(tok, SEM.stop_strings),
                      SamplingConfig(max_new_tokens=budget, greedy=True))
    (t,), _ = rollout(sampler, tok, retriever, [prompt], jax.random.key(0),
                      RolloutConfig(group_size=1, max_searches=2, top_k=3, max_tokens_per_passage=96,
                                    max_block_tokens=512, max_note_tokens=64))
    assert t.end_reason == "length" and len(t.response_ids) == budget
    assert t.loss_mask.tolist() == [1] * len(t1) + [0] * 5


@pytest.mark.parametrize("tokenizer", ["qwen25_tokenizer", "qwen3_special_tags_tokenizer"])
def test_research_protocol_rollout_inserts_researchs_blocks_and_scores_the_boxed_answer(tokenizer, request, retriever):
    """The whole loop under protocol=research: its prompt, its ` <result>` blocks, its parser and
    reward on what was sampled; also where `<think>` is one special token (skip_special_tokens
    would drop it from the text the parser reads)."""
    from sem_jax.data.example import Example
    from sem_jax.policy_eval import score_trajectory
    from sem_jax.protocol import RESEARCH
    from sem_jax.rewards.rules import RewardParams, get_reward

    tok = request.getfixturevalue(tokenizer)
    enc = lambda s: tok.encode(s, add_special_tokens=False)
    ex = Example("q", "What is the capital of France?", ("Paris",), "musique", True)
    prompt = RESEARCH.encode_prompt(tok, ex)
    assert tok.decode(prompt).startswith("<|im_start|>system\nYou are a helpful assistant that can solve")
    t1 = "<think> I should look it up. </think> <search> capital of France </search>"
    block = enc(RESEARCH.result_block("capital of France", retriever.search(["capital of France"], 2)[0], tok, 64))
    t2 = " <think> It is Paris. </think> <answer> The final answer is \\[ \\boxed{Paris} \\] </answer>"
    script, _ = _script(tok, prompt, [t1, block, t2, [IM_END]], 2)
    sampler = Sampler(ScriptedPolicy(script, len(tok)), build_stop_automaton(tok, RESEARCH.stop_strings),
                      SamplingConfig(max_new_tokens=100, greedy=True, eos_ids=(IM_END,), max_inserted_tokens=200))
    cfg = RolloutConfig(group_size=2, max_searches=2, top_k=2, max_tokens_per_passage=64, max_block_tokens=200,
                        max_note_tokens=64)
    trajs, _ = rollout(sampler, tok, retriever, [prompt], jax.random.key(0), cfg, RESEARCH)
    for t in trajs:
        assert t.end_reason == "eos" and t.queries == ["capital of France"]
        assert t.response_ids[t.loss_mask == 0].tolist() == block
        assert ' <result>\n"Paris"\nParis is the capital' in t.text
        parsed = RESEARCH.parse(t.text, t.end_reason == "eos")
        assert parsed.valid and parsed.answer == "Paris"
        assert get_reward(RESEARCH.reward)(parsed, ex, RewardParams()) == (1.0, "research_correct")
        rec = score_trajectory(t, ex, RESEARCH)
        assert rec["em"] == 1.0 and rec["valid"] and rec["searches"] == 1


class SlowRetriever:
    """A remote retriever's latency: `delay` seconds a call (the engine decodes meanwhile)."""

    def __init__(self, inner, delay):
        self.inner, self.delay = inner, delay

    def search(self, queries, k):
        import time
        time.sleep(self.delay)
        return self.inner.search(queries, k)


def _scripted_workload(tok, rows, width, seed=0):
    """Per row: free (sampled) tokens, with forced search tags or a forced EOS at varied positions."""
    enc = lambda s: tok.encode(s, add_special_tokens=False)
    rng = np.random.RandomState(seed)
    script = np.full((rows, width), -1, np.int32)
    for r in range(rows):
        at = rng.randint(1, 6)
        if r % 3 != 2:  # search once or twice
            for query in (["capital of France"] if r % 3 == 0 else ["Nile", "highest mountain"]):
                ids = enc(f"<search>{query}</search>")
                script[r, at:at + len(ids)] = ids
                at += len(ids) + rng.randint(2, 5)
        script[r, at + rng.randint(2, 9)] = IM_END
    return script


ENGINE_BASE = dict(max_searches=1, top_k=1, max_tokens_per_passage=24, max_block_tokens=100, max_note_tokens=16)


def _engine_case(tok, greedy, mesh=None, window_steps=8):
    """A random Qwen2 over the real vocabulary, 3 prompts x G 3 under a scripted workload."""
    from policies import Qwen2Config, random_qwen2

    model = random_qwen2(3, Qwen2Config(vocab_size=151936, hidden_size=32, intermediate_size=64, num_layers=2,
                                        num_heads=4, num_kv_heads=2, rope_theta=1e6), scale=0.2)
    enc = lambda s: tok.encode(s, add_special_tokens=False)
    prompts = [enc("Q: capital?"), enc("Where is the Nile and how high is Everest, and why?"), enc("x y")]
    sampler = Sampler(model, build_stop_automaton(tok, SEM.stop_strings, 151936),
                      SamplingConfig(max_new_tokens=40, greedy=greedy, eos_ids=(IM_END,), max_inserted_tokens=200),
                      window_steps=window_steps, mesh=mesh)
    return sampler, prompts, _scripted_workload(tok, len(prompts) * 3, 48)


@pytest.mark.parametrize("greedy", [True, False])
def test_continuous_engine_samples_what_lockstep_samples(qwen25_tokenizer, retriever, greedy):
    """Row-keyed draws: the same step's trajectories (tokens, masks, searches; log-probs within
    1e-4) under the lockstep setting and under the continuous engine with fewer slots than rows
    (groups split over boundaries), short chunks and a slow retriever answered beside decoding;
    sampled, also with the batch narrowed at the tail (rows moved to other slots mid-search)."""
    tok = qwen25_tokenizer
    enc = lambda s: tok.encode(s, add_special_tokens=False)
    g = 3
    # Greedy reads the whole cache (one window: fewer programs to compile); sampled grows windows.
    sampler, prompts, script = _engine_case(tok, greedy, window_steps=0 if greedy else 8)
    base = dict(group_size=g, **ENGINE_BASE)
    runs = {}
    settings = [("lockstep", dict(lockstep=True), retriever),
                ("4 slots", dict(slots=4, chunk_steps=3, narrow=False), SlowRetriever(retriever, 0.05))]
    if not greedy:  # (each setting compiles its own shapes: the greedy case checks the two that matter most)
        settings += [("5 slots, narrowed", dict(slots=5, chunk_steps=7, narrow_floor=1),
                      SlowRetriever(retriever, 0.05))]
    for name, extra, r in settings:
        trajs, stats = rollout(sampler, tok, r, prompts, jax.random.key(7), RolloutConfig(**base, **extra),
                               script=script)
        runs[name] = trajs, stats
    want, lock = runs["lockstep"]
    assert lock.narrowed == 0 and lock.slot_steps == lock.decode_steps * len(want)  # narrow (the default) is a no-op
    assert sum(t.num_searches for t in want) >= 6 and "eos" in {t.end_reason for t in want}
    assert any(tok.decode(enc(LIMIT_NOTE)[:16]) in t.text for t in want)  # a second search got the note
    assert len({len(t.response_ids) for t in want}) > 3  # rows of many lengths
    for name, (got, stats) in runs.items():
        assert [t.prompt_index for t in got] == [t.prompt_index for t in want]
        for a, b in zip(got, want):
            assert a.response_ids.tolist() == b.response_ids.tolist(), name
            assert a.loss_mask.tolist() == b.loss_mask.tolist() and a.queries == b.queries, name
            assert a.end_reason == b.end_reason and a.text == b.text, name
            np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-4, err_msg=name)
        # Every active slot-step samples one token: the sampled tokens are the active slot-steps.
        assert stats.active_slot_steps == sum(int(t.loss_mask.sum()) for t in got), name
    four = runs["4 slots"][1]
    assert four.slot_steps == four.decode_steps * 4 and four.narrowed == 0 and four.admissions == 9 - 4
    assert four.prefills == len(prompts)  # groups of 3 split over 4 slots: each prompt still prefilled once
    if not greedy:  # the draws differ between rows of one group
        assert len({tuple(t.response_ids.tolist()) for t in want[:g]}) > 1
        # Its tail decodes 2 then 1 slot wide (rows move between slots while their search is pending).
        narrowed = runs["5 slots, narrowed"][1]
        assert narrowed.narrowed >= 1 and narrowed.slot_steps < narrowed.decode_steps * 5


class JitteryRetriever(SlowRetriever):
    """Latencies that differ call to call (0 to 60 ms, seeded)."""

    def __init__(self, inner, seed):
        super().__init__(inner, 0.0)
        self.rng = np.random.RandomState(seed)

    def search(self, queries, k):
        self.delay = float(self.rng.uniform(0, 0.06))
        return super().search(queries, k)


@pytest.mark.parametrize("narrow", [False, True])
def test_a_step_replays_bit_for_bit_whatever_the_retrievers_latency(qwen25_tokenizer, retriever, narrow):
    """The continuous engine's schedule (when answers are appended, which rows share an append,
    the attention windows, the narrowed widths) depends on the rows alone: an instant retriever,
    a 250 ms one and a jittery one give the same boundaries and bit-identical log-probs. (At 50 ms,
    on a loaded machine, 3 decode steps outlasted the retriever and nothing was waited for.)"""
    tok = qwen25_tokenizer
    sampler, prompts, script = _engine_case(tok, False, window_steps=8)
    cfg = RolloutConfig(group_size=3, **ENGINE_BASE, slots=5 if narrow else 4, chunk_steps=3, narrow=narrow,
                        narrow_floor=1)
    runs = [rollout(sampler, tok, r, prompts, jax.random.key(7), cfg, script=script)
            for r in (retriever, SlowRetriever(retriever, 0.25), JitteryRetriever(retriever, 0))]
    (want, first), rest = runs[0], runs[1:]
    assert sum(t.num_searches for t in want) >= 6 and (first.narrowed > 0) == narrow
    for got, stats in rest:
        assert (stats.boundaries, stats.decode_steps, stats.refills, stats.inserts, stats.narrowed) == \
               (first.boundaries, first.decode_steps, first.refills, first.inserts, first.narrowed)
        for a, b in zip(got, want):
            assert a.response_ids.tolist() == b.response_ids.tolist()
            assert np.array_equal(a.logprobs, b.logprobs)
    assert runs[1][1].retrieval_wait_s > 0  # the slow retriever was waited for at its answers' step


def test_a_boundary_is_agreed_between_processes_in_one_exchange(qwen25_tokenizer, retriever, monkeypatch):
    """Multi-process runs agree a boundary (device work, rows left, the next due step, the refill
    call's shapes) in one exchange: a step's exchanges are its set-up's three (prompt count, slots,
    prompt width) and one a boundary, however many rows it appends to and admits there."""
    from sem_jax import hosts

    tok = qwen25_tokenizer
    sampler, prompts, script = _engine_case(tok, False, window_steps=8)
    calls = []
    for name in ("agree_max", "agree_max_each"):
        monkeypatch.setattr(hosts, name, lambda *v, _f=getattr(hosts, name): (calls.append(v), _f(*v))[1])
    trajs, stats = rollout(sampler, tok, retriever, prompts, jax.random.key(7),
                           RolloutConfig(group_size=3, **ENGINE_BASE, slots=4, chunk_steps=3), script=script)
    assert stats.admissions == 9 - 4 and stats.inserts >= 6 and stats.refills >= 6
    assert len(calls) == 3 + stats.boundaries + 1  # the last boundary agrees that no rows are left


def test_continuous_engine_on_the_spread_sampler_mesh(qwen25_tokenizer, retriever):
    """The engine's device calls (admissions into freed slots, appends to a gathered sub-batch) on
    the spread sampler layout (8 devices as 4 groups of 2, rows over the groups, the MLP and the
    LM head over all 8, each device drawing its share's Gumbel-max candidate with the row's key):
    the trajectories of the lockstep engine on the same layout."""
    from sem_jax.sharding import make_mesh, tensor_groups

    tok = qwen25_tokenizer
    cfg = lambda **kw: RolloutConfig(group_size=3, **ENGINE_BASE, **kw)
    mesh = tensor_groups(make_mesh(data=1, fsdp=-1, tensor=1), 2, spread=True)
    sampler, prompts, script = _engine_case(tok, False, mesh, window_steps=0)
    with jax.set_mesh(mesh):
        want, _ = rollout(sampler, tok, retriever, prompts, jax.random.key(5), cfg(lockstep=True), script=script)
        got, stats = rollout(sampler, tok, retriever, prompts, jax.random.key(5), cfg(slots=4, chunk_steps=3),
                             script=script)
    assert stats.admissions == 9 - 4 and sum(t.num_searches for t in got) >= 6
    for a, b in zip(got, want):
        assert a.response_ids.tolist() == b.response_ids.tolist() and a.queries == b.queries
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-4)


def _rows_of_known_lengths(tok):
    """A greedy sampler and 8 rows (4 prompts x G 2) forced to end after these many sampled tokens
    (EOS included): (sampler, lengths, script, prompts)."""
    from policies import Qwen2Config, random_qwen2

    model = random_qwen2(1, Qwen2Config(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_layers=1,
                                        num_heads=4, num_kv_heads=2, rope_theta=1e6), scale=0.2)
    lengths = [2, 12, 3, 11, 4, 10, 5, 9]
    script = np.full((8, 16), -1, np.int32)
    for r, n in enumerate(lengths):
        script[r, n - 1] = IM_END
    sampler = Sampler(model, build_stop_automaton(tok, SEM.stop_strings),
                      SamplingConfig(max_new_tokens=16, greedy=True, eos_ids=(IM_END,)))
    return sampler, lengths, script, [[100 + i, 7] for i in range(4)]


def test_lockstep_admits_a_new_batch_only_when_every_slot_is_free(qwen25_tokenizer, retriever):
    """Lockstep with fewer slots than rows decodes the rows in successive batches: its slot-steps
    are each batch's longest row times the slots; the continuous engine refills and needs fewer."""
    tok = qwen25_tokenizer
    sampler, lengths, script, prompts = _rows_of_known_lengths(tok)
    cfg = dict(group_size=2, max_searches=0, top_k=1, max_tokens_per_passage=8, max_block_tokens=64,
               max_note_tokens=8, slots=2)
    (lock, ls), (cont, cs) = (rollout(sampler, tok, retriever, prompts, jax.random.key(0),
                                      RolloutConfig(**cfg, lockstep=lockstep, chunk_steps=1), script=script)
                              for lockstep in (True, False))
    assert [len(t.response_ids) for t in lock] == lengths == [len(t.response_ids) for t in cont]
    assert ls.decode_steps == sum(max(lengths[i], lengths[i + 1]) for i in range(0, 8, 2))  # 12 + 11 + 10 + 9
    assert ls.active_slot_steps == cs.active_slot_steps == sum(lengths)
    assert cs.decode_steps < ls.decode_steps and cs.occupancy > ls.occupancy
    # Every row in a slot, nothing to refill, no search: one call decodes the step to its end.
    _, alone = rollout(sampler, tok, retriever, prompts, jax.random.key(0),
                       RolloutConfig(**{**cfg, "slots": 0}, chunk_steps=1, narrow=False), script=script)
    assert alone.boundaries == 1 and alone.decode_steps == max(lengths)
    # Narrowed: the engine halves its batch as rows end; before step t the rows longer than t hold
    # slots, and the width halves while they fit in half of it: 8 wide for steps 0-4, 4 for 5-9, 2
    # for 10, 1 for 11 (63, not 12 x 8). The device comes back only when enough rows have ended to
    # halve it (after 4 ends, 2, 1, then the last row's), not at each of the 7 ends before the last.
    def narrowed(floor):
        return rollout(sampler, tok, retriever, prompts, jax.random.key(0),
                       RolloutConfig(**{**cfg, "slots": 0}, chunk_steps=1, narrow_floor=floor), script=script)[1]

    def slot_steps(floor):
        width, total = 8, 0
        for t in range(max(lengths)):
            while sum(n > t for n in lengths) <= width // 2 and width // 2 >= floor:
                width //= 2
            total += width
        return total

    whole = narrowed(1)
    assert whole.slot_steps == slot_steps(1) == 63 and whole.active_slot_steps == sum(lengths) and whole.narrowed == 3
    assert whole.boundaries == 4 and whole.decode_steps == max(lengths)
    # `narrow_floor`: no narrower than 4 slots (8 for steps 0-4, 4 after: 40 + 28), one halving, and
    # no return to the host once the batch cannot narrow further (the last row's end).
    floored = narrowed(4)
    assert floored.slot_steps == slot_steps(4) == 68 and floored.narrowed == 1 and floored.boundaries == 2
    default = narrowed(8)  # 8 rows at the default floor: no narrowing, one decode call
    assert default.narrowed == 0 and default.boundaries == 1


def admission_schedule(lengths: list[int], slots: int, batch: int) -> tuple[int, int]:
    """(decode steps, boundaries) of rows of these lengths through `slots` slots, in order, when a
    decode call comes back once `batch` rows have ended (at most as many as are queued) and the
    boundary admits queued rows into every free slot."""
    queue, ends, t, boundaries = list(lengths), [], 0, 0
    while queue or ends:
        while queue and len(ends) < slots:
            ends.append(t + queue.pop(0))
        ends.sort()
        wait = min(batch, len(queue)) or len(ends)  # nothing queued: to the last end
        t = ends[wait - 1]
        ends = [e for e in ends if e > t]
        boundaries += 1
    return t, boundaries


@pytest.mark.parametrize("share,batch", [(0.0, 1), (0.5, 2), (1.0, 4)])
def test_queued_rows_are_admitted_once_a_share_of_the_slots_has_ended(qwen25_tokenizer, retriever, share, batch):
    """`admit_share`: with rows queued, a decode call comes back once that share of the slots has
    ended, and the boundary fills every free slot: the decode steps and boundaries of a hand
    schedule (8 rows of known lengths through 4 slots: 20 steps and 5 boundaries one end at a time,
    20 and 3 two at a time, 22 and 2 four at a time, as lockstep's 12 + 10)."""
    tok = qwen25_tokenizer
    sampler, lengths, script, prompts = _rows_of_known_lengths(tok)
    cfg = RolloutConfig(group_size=2, max_searches=0, top_k=1, max_tokens_per_passage=8, max_block_tokens=64,
                        max_note_tokens=8, slots=4, chunk_steps=1, narrow=False, admit_share=share)
    got, stats = rollout(sampler, tok, retriever, prompts, jax.random.key(0), cfg, script=script)
    assert [len(t.response_ids) for t in got] == lengths
    assert (stats.decode_steps, stats.boundaries) == admission_schedule(lengths, 4, batch)
    assert admission_schedule(lengths, 4, batch) == {1: (20, 5), 2: (20, 3), 4: (22, 2)}[batch]
    assert stats.active_slot_steps == sum(lengths) and stats.admissions == 4


def test_a_decode_call_returns_after_so_many_pauses_or_so_many_ends(qwen25_tokenizer):
    """`decode_counted(pauses=p, ends=e)`: back to the host once p rows have paused at `</search>`
    or e rows have ended (0: never for that kind); else when no row is active (the paused row
    waits). Row 0 ends at step 3, row 1 pauses at len(search), row 2 ends at step 12."""
    from policies import Qwen2Config, random_qwen2

    tok = qwen25_tokenizer
    enc = lambda s: tok.encode(s, add_special_tokens=False)
    model = random_qwen2(1, Qwen2Config(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_layers=1,
                                        num_heads=4, num_kv_heads=2, rope_theta=1e6), scale=0.2)
    sampler = Sampler(model, build_stop_automaton(tok, SEM.stop_strings),
                      SamplingConfig(max_new_tokens=16, greedy=True, eos_ids=(IM_END,)))
    search = enc("<search> x</search>")
    assert 3 < len(search) < 12
    script = np.full((3, 16), enc(" a")[0], np.int32)  # every token forced: no draw can end a row
    script[0, 2] = script[2, 11] = IM_END               # row 0 ends at step 3, row 2 at step 12
    script[1, :len(search)] = search                    # row 1 pauses at step len(search)
    forced = jax.numpy.asarray(script)
    for pauses, ends, steps in ((1, 1, 3), (1, 0, len(search)), (0, 0, 12), (0, 1, 3), (0, 2, 12), (2, 2, 12)):
        state = sampler.start([[100, 7]], 3, jax.random.key(0))
        state, ran, _ = sampler.decode_counted(state, None, forced, pauses=pauses, ends=ends)
        paused, done, _ = sampler.flags(state)
        assert ran == steps, (pauses, ends)
        assert done[0] and paused[1] == (steps >= len(search)) and done[2] == (steps == 12)


def test_a_row_ended_at_its_search_limit_is_not_served_again(qwen25_tokenizer, retriever):
    """A row that searches again after the limit note is ended by the host while paused; at the
    next boundary it is collected, not taken for a new pause (that asked the retriever for slot -1
    and failed when the answer came due while another row still decoded)."""
    from policies import Qwen2Config, random_qwen2

    tok = qwen25_tokenizer
    enc = lambda s: tok.encode(s, add_special_tokens=False)
    model = random_qwen2(1, Qwen2Config(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_layers=1,
                                        num_heads=4, num_kv_heads=2, rope_theta=1e6), scale=0.2)
    sampler = Sampler(model, build_stop_automaton(tok, SEM.stop_strings),
                      SamplingConfig(max_new_tokens=64, greedy=True, eos_ids=(IM_END,), max_inserted_tokens=160))
    search = enc("<search> Nile</search>")
    script = np.full((2, 64), enc(" a")[0], np.int32)
    script[0, :3 * len(search)] = search * 3   # searches, is refused with the note, searches again
    script[1, 60] = IM_END                     # decodes on well past row 0's end
    cfg = RolloutConfig(group_size=2, max_searches=1, top_k=1, max_tokens_per_passage=8, max_block_tokens=40,
                        max_note_tokens=16, chunk_steps=2)
    got, stats = rollout(sampler, tok, retriever, [[100, 7]], jax.random.key(0), cfg, script=script)
    assert [t.end_reason for t in got] == ["search_limit", "eos"]
    assert [t.num_searches for t in got] == [1, 0] and stats.retriever_calls == 1
    assert int(got[1].loss_mask.sum()) == 61


class ShortRetriever:
    """Answers one query fewer than asked (a broken retriever or a remote one that drops rows)."""

    def __init__(self, inner):
        self.inner = inner

    def search(self, queries, k):
        return self.inner.search(queries, k)[:-1]


class SilentRetriever:
    """Never answers (a hung remote retriever): each call waits on an event no one sets."""

    def __init__(self):
        import threading
        self.never = threading.Event()

    def search(self, queries, k):
        self.never.wait(30)
        return []


@pytest.mark.parametrize("broken,message", [
    ("short", r"ShortRetriever\.search returned 2 result lists for 3 queries"),
    ("silent", r"SilentRetriever\.search: 1 call\(s\) not back 0\.5 s after their answer was due "
               r"\(rollout\.retrieval_timeout_s\)")])
def test_a_retriever_that_answers_short_or_never_fails_the_rollout_naming_it(qwen_tokenizer, retriever, broken,
                                                                             message):
    """Rows whose answer is missing used to stay paused: the rollout never ended, silently."""
    import time
    from sem_jax.sampling.rollout import RetrieverError
    tok = qwen_tokenizer
    enc = lambda s: tok.encode(s, add_special_tokens=False)
    prompt = enc("<|im_start|>user\nQ?<|im_end|>\n<|im_start|>assistant\n")
    script, full = _script(tok, prompt, ["<think>No.</think><answer>Lyon</answer><search>capital of France</search>",
                                         "<answer>Paris</answer>", [IM_END]], 1)
    sampler = Sampler(ScriptedPolicy(script, len(tok)), build_stop_automaton(tok, SEM.stop_strings),
                      SamplingConfig(max_new_tokens=len(full) + 16, greedy=True, eos_ids=(IM_END,)))
    cfg = RolloutConfig(group_size=3, max_searches=1, top_k=2, max_tokens_per_passage=32, max_block_tokens=512,
                        max_note_tokens=64, retrieval_timeout_s=0.5)
    bad = ShortRetriever(retriever) if broken == "short" else SilentRetriever()
    t0 = time.perf_counter()
    with pytest.raises(RetrieverError, match=message):
        rollout(sampler, tok, bad, [prompt], jax.random.key(0), cfg)
    assert time.perf_counter() - t0 < 25  # not waiting on the hung call's thread
    if broken == "silent":
        bad.never.set()
