"""SEM semantics: scoring, parser (incl. adversarial text), and the reward tables."""

import pytest
from hypothesis import given, settings, strategies as st

from sem_jax.data import Example
from sem_jax.protocol.sem import parse_response
from sem_jax.sem import RewardParams, exact_match, normalize_answer, research_reward, score_answer, sem_reward, token_f1

QA = Example("q1", "Capital of France?", ("Paris", "Paris, France"), "musique", True)
MC = Example("m1", "2+2?", ("B",), "mmlu", False, options=("3", "4", "5", "22"), kind="mc")
MATH = Example("g1", "How many?", ("1,234",), "gsm8k", False, kind="math")


def test_normalisation_em_f1():
    assert normalize_answer("  The  Eiffel-Tower! ") == "eiffeltower"
    assert normalize_answer("An apple, a pear") == "apple pear"
    assert exact_match("the Paris", "Paris") == 1.0
    assert token_f1("Paris France", "Paris") == pytest.approx(2 * 0.5 * 1 / 1.5)
    assert token_f1("yes", "no") == 0.0 and token_f1("no", "no") == 1.0
    assert score_answer("paris, france.", QA) == (1.0, 1.0)
    assert score_answer("Lyon", QA) == (0.0, 0.0)
    assert score_answer(None, QA) == (0.0, 0.0)


@pytest.mark.parametrize("pred,ok", [("B", 1), ("(B)", 1), ("b.", 1), ("B. 4", 1), ("4", 1), ("A", 0),
                                     ("22", 0), ("A dog", 0), ("C) 5", 0), ("", 0)])
def test_multiple_choice(pred, ok):
    assert score_answer(pred, MC) == (ok, ok)


@pytest.mark.parametrize("pred,ok", [("1234", 1), ("The answer is $1,234.", 1), ("1234.0", 1), ("123", 0),
                                     ("no number", 0)])
def test_numeric(pred, ok):
    assert score_answer(pred, MATH) == (ok, ok)


DIRECT = "<think>I know it.</think><answer>Paris</answer>"
SEARCH = ("<think>Unsure.</think><answer>Lyon</answer><search>capital of France</search>"
          "<result>(1) Paris: capital of France</result><think>It is Paris.</think><answer>Paris</answer>")


def test_parser_valid_forms():
    p = parse_response(DIRECT + "\n")
    assert p.valid and p.first_answer == "Paris" and p.num_searches == 0 and p.answer == "Paris"
    p = parse_response(SEARCH)
    assert p.valid and p.first_answer == "Lyon" and p.final_answer == "Paris"
    assert p.searches == (("capital of France", "(1) Paris: capital of France"),)
    two = SEARCH.replace("<answer>Paris</answer>", "<search>again</search><result>r</result><answer>X</answer>")
    assert parse_response(two).valid and parse_response(two).num_searches == 2


@pytest.mark.parametrize("text,reason", [
    ("", "must start"),
    ("<answer>Paris</answer>", "must start"),
    ("<think>a</think><answer>Paris", "not closed"),
    ("<think>a<think>b</think></think><answer>x</answer>", "nested"),
    ("<think>a</answer>", "closes"),
    ("Sure! <think>a</think><answer>x</answer>", "outside tags"),
    (DIRECT + " trailing", "after the last tag"),
    (DIRECT + "<search>q</search>", "not followed by <result>"),
    (DIRECT + "<search>q</search><result>r</result>", "no final <answer>"),
    (DIRECT + "<think>more</think>", "after the answer without a search"),
    (DIRECT + "<search> </search><result>r</result><answer>x</answer>", "empty search query"),
    ("</think>", "without"),
])
def test_parser_invalid(text, reason):
    p = parse_response(text)
    assert not p.valid and reason in p.reason


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from(["<think>", "</think>", "<answer>", "</answer>", "<search>", "</search>",
                                 "<result>", "</result>", "x", " ", "\n", "<", ">", "/", "Paris", "<thin",
                                 "</answer", "<<answer>>"]), max_size=30),
       st.text(max_size=20))
def test_parser_never_raises(pieces, noise):
    text = "".join(pieces) + noise
    p = parse_response(text)
    assert isinstance(p.valid, bool)
    if p.valid:  # anything accepted really has the shape
        assert text.lstrip().startswith("<think>") and p.first_answer is not None
        assert (p.final_answer is None) == (p.num_searches == 0)
        for ex in (QA, MC, MATH):
            sem_reward(p, ex, RewardParams())
            research_reward(p, ex, RewardParams())


RP = RewardParams()  # 1.0, 0.5, 0.0, 0.1, 0.9, tau 0.8


@pytest.mark.parametrize("text,reward,case", [
    ("<think>t</think><answer>Paris", 0.0, "invalid"),
    (DIRECT, 1.0, "direct_correct"),
    (DIRECT.replace("Paris", "Lyon"), 0.0, "direct_wrong"),
    (SEARCH.replace("<answer>Lyon", "<answer>Paris"), 0.5, "redundant_search"),
    (SEARCH, 0.1 + 0.9 * 1.0, "search_after_wrong"),
    (SEARCH.replace("<answer>Paris</answer>", "<answer>Marseille</answer>"), 0.1, "search_after_wrong"),
    # F1("Paris France", "Paris") = 2/3 -> 0.1 + 0.9 * 2/3 = 0.7.
    (SEARCH.replace("<answer>Paris</answer>", "<answer>Paris Texas</answer>"), 0.7, "search_after_wrong"),
    # First answer F1 2/3 < tau 0.8 counts as wrong.
    (DIRECT.replace("Paris", "Paris Texas"), 0.0, "direct_wrong"),
])
def test_sem_reward_table(text, reward, case):
    r, c = sem_reward(parse_response(text), QA, RP)
    assert c == case and r == pytest.approx(reward)


def test_sem_reward_constants_are_config():
    rp = RewardParams(r_direct=2.0, search_penalty=1.5, r_no_search_wrong=-0.5, r_search_base=0.0,
                      r_search_scale=1.0, tau=0.5)
    assert sem_reward(parse_response(DIRECT), QA, rp) == (2.0, "direct_correct")
    assert sem_reward(parse_response(SEARCH.replace("Lyon", "Paris")), QA, rp) == (0.5, "redundant_search")
    assert sem_reward(parse_response(DIRECT.replace("Paris", "Lyon")), QA, rp) == (-0.5, "direct_wrong")
    # With tau 0.5, F1 2/3 is correct.
    assert sem_reward(parse_response(DIRECT.replace("Paris", "Paris Texas")), QA, rp)[1] == "direct_correct"


@pytest.mark.parametrize("text,reward,case", [
    ("<answer>Paris</answer>", 0.0, "invalid"),
    (DIRECT, 1.0, "research_correct"),
    (DIRECT.replace("Paris", "Lyon"), 0.1, "research_wrong"),
    (SEARCH, 1.0, "research_correct"),                       # final answer counts
    (SEARCH.replace("<answer>Paris</answer>", "<answer>Paris Texas</answer>"), 2 / 3, "research_correct"),
    (SEARCH.replace("Lyon", "Paris"), 1.0, "research_correct"),  # no search penalty
])
def test_research_reward_table(text, reward, case):
    r, c = research_reward(parse_response(text), QA, RP)
    assert c == case and r == pytest.approx(reward)
