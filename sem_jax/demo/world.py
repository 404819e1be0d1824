"""A synthetic world for the CPU demo, generated from a seed: no downloads, and a clean split
between what a tiny model can know and what it must look up.

* Invented people, cities and organisations. Each person was born in a city and works for an
  organisation; each organisation was founded in a city. The corpus (one passage per person
  and per organisation) is the only place these facts appear.
* *Unknown* questions (source "unknown", like MuSiQue): one hop (where was P born, whom does P
  work for) and two hops (where was P's organisation founded). RL-train and eval questions are
  about disjoint people.
* *Known* questions (source "known", like MMLU): single-digit sums and the capitals of invented
  countries. The warm start teaches all of them; RL-train and eval use disjoint subsets, and
  every held-out sum's answer is also the answer of an RL sum.

Every question comes in one of two phrasings. The warm-start traces (`warm_start_pairs`)
search after 80% of questions in phrasing A and 40% in phrasing B (the demo's
`warm_start.search_prob_a` and `_b`), known or not: a habit
tied to wording, not knowledge, so greedy decoding searches about half the time and sampling
still explores both choices. Whether RL replaces the habit with "search when you do not know"
is what the demo measures.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from collections.abc import Sequence

import numpy as np

from sem_jax.data.example import Example
from sem_jax.data.questions import question_row
from sem_jax.protocol import SEM
from sem_jax.protocol.sem import direct_trace, result_text, search_call
from sem_jax.config import Config
from sem_jax.config import World as WorldSettings

_ONSETS = ["b", "d", "f", "g", "k", "l", "m", "n", "p", "r", "s", "t", "v", "z", "br", "dr", "kr", "st", "tr"]
_VOWELS = ["a", "e", "i", "o", "u"]
_CITY_ENDS = ["ford", "holm", "mouth", "wick", "stead", "vale"]
_ORG_KINDS = ["Guild", "Company", "Society", "Union", "Works", "Trust"]

PHRASINGS = {  # (phrasing A, phrasing B). Names never open a question: " Madre" (with its space)
    # is then the same token in the question, the search query and the passage, so that
    # looking someone up is a plain copy (a sentence-initial "Madre" is another token).
    "born": ("Where was {p} born?", "In which city was {p} born?"),
    "works": ("Which organisation does {p} work for?", "For which organisation does {p} work?"),
    "founded": ("Where was the organisation {p} works for founded?",
                "In which city was the organisation that {p} works for founded?"),
    "sum": ("What is {a} plus {b}?", "How much is {a} plus {b}?"),
    "capital": ("What is the capital of {c}?", "Which city is the capital of {c}?"),
}
THINK_FIRST, THINK_AFTER = "ok", "found"  # what the traces think before each answer


@dataclasses.dataclass(frozen=True)
class WorldConfig(WorldSettings):
    """A world's settings (`sem_jax.config.World`, the demo config's `world`) and its seed."""
    seed: int = 0


@dataclasses.dataclass
class World:
    corpus: list[dict]          # {"id", "title", "text"}
    train: list[Example]        # RL questions: known and unknown, balanced
    eval: list[Example]         # held out: unseen people, known facts not used in RL
    known: list[Example]        # every known question, both phrasings (taught by the warm start)
    warm_unknown: list[Example]  # the warm start's lookups (its own people)
    facts: dict[str, dict]      # person -> {"born", "works"}; organisation -> {"founded"}
    subject: dict[str, str]     # unknown question id -> the person it asks about
    cities: list[str]
    orgs: list[str]

    def write(self, directory: str) -> dict[str, str]:
        """corpus.jsonl, train.jsonl, eval.jsonl in `directory`; returns their paths."""
        os.makedirs(directory, exist_ok=True)
        paths = world_files(directory)
        rows = {"corpus": self.corpus, "train": [question_row(e) for e in self.train],
                "eval": [question_row(e) for e in self.eval]}
        for name, path in paths.items():
            tmp = f"{path}.tmp{os.getpid()}"  # several processes may write the same (identical) world
            with open(tmp, "w") as fh:
                fh.writelines(json.dumps(r) + "\n" for r in rows[name])
            os.replace(tmp, path)
        return paths


def world_files(directory: str) -> dict[str, str]:
    """Paths of a written world's corpus, train and eval files."""
    return {name: os.path.join(directory, f"{name}.jsonl") for name in ("corpus", "train", "eval")}


def use_world_files(config: Config, paths: dict[str, str]) -> Config:
    """`config` with its data and retrieval pointed at a written world."""
    return config.replace(**{"data.train_file": paths["train"], "data.eval_file": paths["eval"],
                             "retrieval.corpus": paths["corpus"], "retrieval.index_dir": None})


def _names(rng: np.random.RandomState, n: int, syllables: tuple[int, int], taken: set[str]) -> list[str]:
    out = []
    while len(out) < n:
        k = rng.randint(syllables[0], syllables[1] + 1)
        name = "".join(rng.choice(_ONSETS) + rng.choice(_VOWELS) for _ in range(k)).capitalize()
        if name not in taken:
            taken.add(name)
            out.append(name)
    return out


def build_world(cfg: WorldConfig = WorldConfig()) -> World:
    """The world of `cfg.seed`: the same seed gives the same corpus and questions."""
    rng = np.random.RandomState(cfg.seed)
    taken: set[str] = set()
    cities = [n + rng.choice(_CITY_ENDS) for n in _names(rng, cfg.cities, (1, 2), taken)]
    orgs = [f"{n} {rng.choice(_ORG_KINDS)}" for n in _names(rng, cfg.orgs, (2, 2), taken)]
    # People combine a small stock of first names and surnames: each name is frequent enough to
    # become one BPE token, so looking a person up means copying two tokens.
    n_people = cfg.rl_people + cfg.eval_people + cfg.warm_people
    stock = int(np.ceil(np.sqrt(n_people * 2)))
    firsts, lasts = _names(rng, stock, (2, 2), taken), _names(rng, stock, (2, 2), taken)
    pairs = rng.permutation(stock * stock)[:n_people]
    # "Mx" before every name: the model copies a name into its query token by token, and a
    # token that always precedes names cues the first one (after a plain " was" or " does" a
    # tiny model wrote its favourite first name; the surname after a copied first name it got right).
    people = [f"Mx {firsts[k // stock]} {lasts[k % stock]}" for k in pairs]
    countries = _names(rng, cfg.countries, (2, 3), taken)
    capitals = [n + rng.choice(_CITY_ENDS) for n in _names(rng, cfg.countries, (1, 2), taken)]

    facts: dict[str, dict] = {}
    corpus = []
    for i, org in enumerate(orgs):
        facts[org] = {"founded": cities[rng.randint(len(cities))]}
        corpus.append({"id": f"o{i}", "title": org, "text": f"{org} was founded in {facts[org]['founded']}."})
    for i, p in enumerate(people):
        facts[p] = {"born": cities[rng.randint(len(cities))], "works": orgs[rng.randint(len(orgs))]}
        corpus.append({"id": f"p{i}", "title": p,
                       "text": f"{p} was born in {facts[p]['born']}. {p} works for {facts[p]['works']}."})

    def q(qid, kind, answer, source, style, fmt, ex_kind="qa"):
        return Example(id=f"{qid}-{'ab'[style]}", question=PHRASINGS[kind][style].format(**fmt), answers=(answer,),
                       source=source, needs_search=source == "unknown", kind=ex_kind)

    subject: dict[str, str] = {}

    def about(i):  # one question per person: a random hop type and phrasing
        p = people[i]
        kind = ("born", "works", "founded")[rng.randint(3)]
        answer = facts[facts[p]["works"]]["founded"] if kind == "founded" else facts[p][kind]
        ex = q(f"{kind}{i}", kind, answer, "unknown", rng.randint(2), {"p": p})
        subject[ex.id] = p
        return ex

    n_rl, n_eval = cfg.rl_people, cfg.eval_people
    rl_unknown = [about(i) for i in range(n_rl)]
    eval_unknown = [about(i) for i in range(n_rl, n_rl + n_eval)]
    warm_unknown = [about(i) for i in range(n_rl + n_eval, n_people)]

    items = [("sum", f"sum{a}_{b}", str(a + b), {"a": a, "b": b}, "math")
             for a in range(1, cfg.sum_max + 1) for b in range(1, cfg.sum_max + 1)]
    items += [("capital", f"capital{i}", cap, {"c": c}, "qa") for i, (c, cap) in enumerate(zip(countries, capitals))]
    n_eval_known = int(round(len(items) * cfg.eval_fraction_known))
    known, rl_known, eval_known = [], [], []
    held: set[int] = set()
    for j in rng.permutation(len(items)):
        kind, qid, answer, fmt, ex_kind = items[j]
        both = [q(qid, kind, answer, "known", style, fmt, ex_kind) for style in (0, 1)]
        known += both
        # A sum is held out only while another sum with its answer stays in RL (as MMLU's option
        # letters all occur in training): GRPO sees an answer it never rewards only as a sampled
        # wrong one and learns to avoid it everywhere (measured: held-out 1 + 1 forgotten).
        partner = kind != "sum" or any(i != j and i not in held and items[i][0] == "sum" and items[i][2] == answer
                                       for i in range(len(items)))
        if len(held) < n_eval_known and partner:
            held.add(j)
        (eval_known if j in held else rl_known).extend(both)

    # Balanced, as SEM mixes MuSiQue and MMLU: as many unknown as known RL questions.
    shuffle = lambda xs: [xs[i] for i in rng.permutation(len(xs))]
    n = min(len(rl_unknown), len(rl_known))
    rl_unknown, rl_known = rl_unknown[:n], shuffle(rl_known)[:n]
    return World(corpus=corpus, train=shuffle(rl_unknown + rl_known), eval=shuffle(eval_unknown + eval_known),
                 known=known, warm_unknown=warm_unknown, facts=facts, subject=subject, cities=cities, orgs=orgs)


def world_config(config: Config) -> WorldConfig:
    """The synthetic world of a demo config (`config.world`; its seed is the run's seed)."""
    return WorldConfig(seed=config.seed, **dataclasses.asdict(config.world))


def texts(world: World) -> list[str]:
    """What the demo's BPE is trained on: the world's text, and the chat roles and protocol tags
    (repeated, so that they merge: a response is then a few tokens of format, not dozens of
    characters)."""
    protocol = ("system\nuser\nassistant\n" + direct_trace(THINK_FIRST, " x") + search_call(" q") +
                result_text("(1) t: x") + direct_trace(THINK_AFTER, " x"))
    return [f"{d['title']} {d['text']}" for d in world.corpus] + [
        e.question + " " + e.answers[0] for e in world.train + world.eval + world.known + world.warm_unknown] + \
        [protocol] * 50


# -- warm-start traces ----------------------------------------------------------------------

def _query_chain(world: World, ex: Example) -> list[str]:
    """The search queries the warm-start traces write for `ex`: the question itself (bm25 ranks
    the person's passage first: the names are the rare words), then for two hops the
    organisation named in that passage. Copying the whole question makes lookups an induction
    pattern over many tokens, which a tiny model picks up far sooner than copying a two-token
    name out of the middle of a sentence (tried: it learned the first name, not the second)."""
    first = ex.question.rstrip("?")
    if ex.source == "unknown" and _kind(ex) == "founded":
        return [first, world.facts[world.subject[ex.id]]["works"]]
    return [first]


def _guess(world: World, ex: Example, rng: np.random.RandomState) -> str:
    """A confident wrong-or-lucky first answer for an unknown question."""
    pool = sorted(world.orgs if _kind(ex) == "works" else world.cities)
    return pool[rng.randint(len(pool))]


def warm_start_pairs(world: World, tokenizer, retriever, *, top_k: int, max_tokens_per_passage: int,
                     system_prompt: str = SEM.system_prompt, search_prob: tuple[float, float] = (0.8, 0.2),
                     copies: tuple[int, int] = (8, 1), seed: int = 0, eos: str = "<|im_end|>") -> list[tuple[list[int], list[tuple[list[int], bool]]]]:
    """(prompt ids, [(segment ids, trained)]) pairs in the answer-first format: every known
    question (both phrasings) `copies[0]` times and every warm-start lookup `copies[1]` times
    (known facts need repetition to be memorised), each copy deciding afresh whether to
    search (probability by phrasing). Result blocks are real retriever output, tokenized apart
    from the sampled text exactly as the rollout inserts them (trained=False)."""
    rng = np.random.RandomState(seed)
    questions = world.known + world.warm_unknown
    enc = lambda s: tokenizer.encode(s, add_special_tokens=False)
    pairs = []
    for ex in questions:
        for _ in range(copies[0] if ex.source == "known" else copies[1]):
            style = 0 if ex.id.endswith("-a") else 1
            first = ex.answers[0] if ex.source == "known" else _guess(world, ex, rng)
            # A space inside the tags: names are then the same tokens as in the question and the
            # passages (" Madre", not "Madre"), so looking up and answering are plain copies.
            text = direct_trace(THINK_FIRST, f" {first}")
            if rng.rand() >= search_prob[style]:
                pairs.append((SEM.encode_prompt(tokenizer, ex, system_prompt), [(enc(text + eos), True)]))
                continue
            segments = []
            for query in _query_chain(world, ex):
                segments.append((enc(text + search_call(f" {query}")), True))
                hits = retriever.search([query], top_k)[0]
                segments.append((enc(SEM.format_results(hits, tokenizer, max_tokens_per_passage)), False))
                text = ""
            segments.append((enc(direct_trace(THINK_AFTER, f" {ex.answers[0]}") + eos), True))
            pairs.append((SEM.encode_prompt(tokenizer, ex, system_prompt), segments))
    return pairs


def _kind(e: Example) -> str:
    return re.match("[a-z]+", e.id).group()


def summarize(world: World) -> str:
    by = lambda xs, s: sum(e.source == s for e in xs)
    return (f"world: {len(world.facts) - len(world.orgs)} people, {len(world.corpus)} passages; "
            f"RL train {len(world.train)} questions ({by(world.train, 'unknown')} unknown, "
            f"{by(world.train, 'known')} known), eval {len(world.eval)} ({by(world.eval, 'unknown')} unknown, "
            f"{by(world.eval, 'known')} known), {len(world.known)} known questions taught")


__all__: Sequence[str] = ("WorldConfig", "World", "build_world", "world_config", "texts", "warm_start_pairs",
                          "summarize")
