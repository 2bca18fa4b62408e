"""The GPU tests' comparison of greedy answers (tests/conftest.py ``greedy_differs``): equal ids, or ids that part
at a near tie and nowhere else."""

from tests.conftest import NEAR_TIE, greedy_differs


def answer(ids, steps):
    """An Engine RESULT of one prompt: ``ids`` and, per step, the [token, logprob] pairs of ``steps``."""
    return {"ids": [ids], "lps": [[[list(p) for p in step] for step in steps]]}


def test_equal_ids_agree():
    a = answer([5, 6], [[(5, -1.0), (9, -2.0)], [(6, -0.5), (1, -3.0)]])
    assert greedy_differs(a, a) is None


def test_ids_parting_at_a_near_tie_agree():
    tie = NEAR_TIE / 2
    got = answer([5, 6, 7], [[(5, -1.0), (9, -2.0)], [(6, -1.0), (8, -1.0 - tie)], [(7, -0.1), (2, -4.0)]])
    ref = answer([5, 8, 3], [[(5, -1.0), (9, -2.0)], [(8, -1.0), (6, -1.0 - tie)], [(3, -0.2), (2, -4.0)]])
    assert greedy_differs(got, ref) is None


def test_ids_parting_without_a_tie_name_the_prompt_and_step():
    got = answer([5, 6], [[(5, -1.0), (9, -2.0)], [(6, -0.1), (8, -3.0)]])
    ref = answer([5, 8], [[(5, -1.0), (9, -2.0)], [(8, -0.1), (6, -3.0)]])
    why = greedy_differs(got, ref)
    assert why is not None and "prompt 0" in why and "step 1" in why and "2.9" in why


def test_a_token_outside_both_top2_is_no_tie():
    got = answer([5], [[(5, -1.0), (9, -1.001)]])
    ref = answer([7], [[(7, -1.0), (9, -1.001)]])
    assert "not both in the top-2" in greedy_differs(got, ref)


def test_other_lengths_or_prompt_counts_differ():
    a = answer([5, 6], [[(5, -1.0), (9, -2.0)], [(6, -0.5), (1, -3.0)]])
    b = answer([5], [[(5, -1.0), (9, -2.0)]])
    assert "2 tokens against 1" in greedy_differs(a, b)
    two = {"ids": a["ids"] * 2, "lps": a["lps"] * 2}
    assert "1 prompts answered against 2" in greedy_differs(a, two)
