"""Tests for rewards.py. Expected values come from the mathematics of each case (written by hand),
from closed forms (the overlong penalty), or from math-verify itself where rewards.py adds a
shortcut in front of it; the code under test is never its own oracle."""

import math
import random
import signal
import sys
import threading
import time

import pytest
from math_verify import parse, verify

import config
import rewards

# --------------------------------------------------------------------------------------------------
# extract_boxed
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("text, expected", [
    (r"so \boxed{42}.", "42"),
    (r"\boxed{\frac{1}{2}}", r"\frac{1}{2}"),  # nested braces
    (r"\boxed{\frac{\sqrt{2}}{2}} done", r"\frac{\sqrt{2}}{2}"),
    (r"first \boxed{1}, then \boxed{2}", "2"),  # the last one wins
    (r"\boxed {7}", "7"),  # a space before the brace
    (r"\boxed{\{1,2\}}", r"\{1,2\}"),  # escaped braces are not structure
    (r"\boxed{\left\{ x \right.}", r"\left\{ x \right."),  # an unbalanced escaped brace inside
    (r"\boxed{}", ""),
    (r"\boxed{1} and \boxed{2", None),  # the last box is never closed
    ("no box at all", None),
    (r"\boxed 5", None),  # no brace
    ("", None)])
def test_extract_boxed(text, expected):
    assert rewards.extract_boxed(text) == expected


# --------------------------------------------------------------------------------------------------
# verify_math
# --------------------------------------------------------------------------------------------------

EQUIVALENT = [  # (ground truth, boxed prediction): the same mathematical answer
    (r"\frac{1}{2}", "0.5"),
    ("0.5", r"\frac{1}{2}"),
    (r"\dfrac{3}{4}", "3/4"),
    ("0.75", r"\frac{3}{4}"),
    (r"10\%", "10"),  # math-verify accepts a percentage written without the sign
    ("10", r"10\%"),
    ("[1,2)", "[1, 2)"),
    (r"\sqrt{2}/2", r"\frac{\sqrt{2}}{2}"),
    (r"2\sqrt{3}", r"\sqrt{12}"),
    ("-3", "-3"),
    (r"-\frac{1}{2}", "-0.5"),
    ("-0.5", r"\frac{-1}{2}"),
    ("42", "42"),
    ("42", "42.0"),
    ("007", "7"),
    ("1000", "1,000"),  # thousands separator
    ("1000", "1{,}000"),
    ("x^2+1", "1+x^2"),
    (r"\{1,2\}", r"\{2,1\}"),
    ("(1,2)", "(1, 2)"),
    ("5", "x=5"),  # the prediction's equation is unwrapped when the gold is a plain value
    (r"\frac{1}{3}", "0.333333"),  # 6-decimal rounding
    (r"\pi", r"\pi"),
    (r"\text{Evelyn}", r"\text{Evelyn}")]

NOT_EQUIVALENT = [
    (r"\frac{1}{2}", "0.25"), ("3/4", "4/3"), ("0.75", "0.7"), ("[1,2)", "[1,2]"),
    ("(1,2)", "[1,2]"), ("(1,2)", "(2,1)"), ("-3", "3"), ("x^2+1", "x^2-1"), ("1000", "100"),
    (r"\sqrt{2}", "2"), (r"\pi", "3.14"), ("10", "11"), ("0.5", "0.50001"),
    (r"\{1,2\}", r"\{1,3\}"), ("2", "x=3")]


@pytest.mark.parametrize("gold, prediction", EQUIVALENT)
def test_equivalent_answers_are_correct(gold, prediction):
    assert rewards.verify_math(rf"Thus the answer is \boxed{{{prediction}}}.", gold) == (True, "ok")


@pytest.mark.parametrize("gold, prediction", NOT_EQUIVALENT)
def test_different_answers_are_wrong(gold, prediction):
    assert rewards.verify_math(rf"Thus the answer is \boxed{{{prediction}}}.", gold) == (
        False, "ok")


def math_verify_verdict(gold, prediction):
    """math-verify alone, with the same parse config rewards.py uses for boxed answers."""
    config = rewards._math_verify()[2]
    return verify(parse(rf"\boxed{{{gold}}}", extraction_config=config, parsing_timeout=None),
                  parse(rf"\boxed{{{prediction}}}", extraction_config=config, parsing_timeout=None),
                  timeout_seconds=None)


@pytest.mark.parametrize(
    "gold, prediction",
    [
        ("0.75", r"\frac{3}{4}"),
        ("3", "3.00"),
        ("-2", "2"),
        ("12", "012"),
        (r"\frac{6}{8}", "0.75"),
        ("1/3", "0.333"),
        # within 1e-5: left to math-verify's own rounding rules, in both directions
        (r"\frac{1}{3}", "0.333333"),
        ("0.3333333", "0.3333334"),
        ("1", "1.0000000001"),
        ("0.75", "0.7500000001"),
        ("123456789012345678901", "123456789012345678902"),
        ("5", "1/0")])
def test_plain_number_shortcut_agrees_with_math_verify(gold, prediction):
    # rewards.py decides pairs of plain numbers without sympy; math-verify is the independent oracle
    assert rewards.verify_math(rf"\boxed{{{prediction}}}", gold) == (
        math_verify_verdict(gold, prediction), "ok")


@pytest.mark.parametrize("response, gold, expected", [
    ("", "42", (False, "no_answer")),
    ("I have no idea.", "42", (False, "no_answer")),
    (r"\boxed{}", "42", (False, "parse_error")),  # a box with nothing math-verify can read
    (r"\boxed{42", "42", (False, "no_answer")),  # never closed
    (r"\boxed{42}", "", (False, "parse_error")),  # an empty gold
    ("\x00\ud800 \\boxed{\\frac{", "1", (False, "no_answer")),
    (r"\boxed{\frac{1}{0}}", "1", (False, "ok")),
    (None, "42", (False, "parse_error")),  # not even a string: still no exception
])
def test_empty_and_garbage_inputs(response, gold, expected):
    assert rewards.verify_math(response, gold) == expected


def test_missing_box_is_no_answer_in_boxed_mode_but_found_in_any_mode():
    response = "Adding the two numbers gives 42. The final answer is 42."
    assert rewards.verify_math(response, "42", answer_format="boxed") == (False, "no_answer")
    assert rewards.verify_math(response, "42", answer_format="any") == (True, "ok")
    assert rewards.verify_math(response, "41", answer_format="any") == (False, "ok")
    assert rewards.verify_math("", "42", answer_format="any") == (False, "no_answer")


def test_only_the_last_box_counts_in_boxed_mode():
    assert rewards.verify_math(r"maybe \boxed{41}, no: \boxed{42}", "42") == (True, "ok")
    assert rewards.verify_math(r"maybe \boxed{42}, no: \boxed{41}", "42") == (False, "ok")


def test_unknown_answer_format_is_a_programming_error():
    with pytest.raises(ValueError, match="answer_format"):
        rewards.verify_math(r"\boxed{1}", "1", answer_format="boxd")


@pytest.mark.parametrize(
    "answer", [r"9^{9^{9^{9^{9}}}}", r"\frac{1}{2}" * 2000, r"\sqrt{" * 300 + "2" + "}" * 300])
def test_pathological_input_returns_within_the_deadline(answer, monkeypatch):
    # Python's own hook for exceptions raised in __del__ (sympy's caches), as in a run: pytest's
    # hook fails the test when the deadline's alarm lands while it formats one
    monkeypatch.setattr(sys, "unraisablehook", sys.__unraisablehook__)
    start = time.monotonic()
    correct, status = rewards.verify_math(rf"\boxed{{{answer}}}", "3", timeout_s=0.5)
    elapsed = time.monotonic() - start
    # the point is the deadline: a fast machine may finish the check in time ("ok", and still not
    # equal to 3)
    assert not correct and status in ("timeout", "parse_error", "ok")
    assert elapsed < 0.5 + 2.0  # slack for a loaded CI machine; unbounded, these take minutes


def test_a_dropped_timeout_still_ends_the_check():
    """Python drops an exception raised inside a weakref callback or __del__ ("Exception ignored in
    ..."; seen with sympy's caches): the check must still end at the deadline, and count as timed
    out if it returns after it."""
    def drops_the_first_then_computes():
        try:
            while True:
                pass
        except rewards._Timeout:  # dropped, as Python does in a weakref callback
            pass
        start = time.monotonic()
        while time.monotonic() - start < 2.0:  # keeps computing: the next tick must interrupt it
            pass
        return "late"

    def drops_every_one():
        for _ in range(3):
            try:
                while True:
                    pass
            except rewards._Timeout:
                pass
        return "late"

    for fn in (drops_the_first_then_computes, drops_every_one):
        start = time.monotonic()
        with pytest.raises(rewards._Timeout):
            rewards._call_with_deadline(0.05, fn)
        assert time.monotonic() - start < 1.0


def test_deadline_restores_the_callers_alarm():
    fired = []

    def callers_handler(signum, frame):
        fired.append(signum)

    previous = signal.signal(signal.SIGALRM, callers_handler)
    try:
        signal.setitimer(signal.ITIMER_REAL, 5.0)
        assert rewards.verify_math(r"\boxed{9^{9^{9^{9^{9}}}}}", "3", timeout_s=0.2) == (
            False, "timeout")
        left, _ = signal.getitimer(signal.ITIMER_REAL)
        assert 4.0 < left < 4.9  # the caller's timer runs on, less the time the check took
        assert signal.getsignal(signal.SIGALRM) is callers_handler and not fired
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def test_verify_math_in_a_non_main_thread_does_not_raise():
    results, errors = [], []

    def worker():
        try:
            results.append(rewards.verify_math(r"so \boxed{\frac{3}{4}}", "0.75"))
            results.append(rewards.verify_math(r"so \boxed{x^2+2}", "x^2+1"))
            results.append(rewards.verify_math("The final answer is 6.", "6", answer_format="any"))
        except BaseException as error:  # noqa: BLE001 - anything at all is a failure here
            errors.append(error)

    thread = threading.Thread(target=worker)
    thread.start()
    thread.join(timeout=30)
    assert not errors and results == [(True, "ok"), (False, "ok"), (True, "ok")]


def test_batch_of_1000_with_known_correctness():
    responses, golds, expected = [], [], []
    for i in range(1000):
        kind, n = i % 5, i // 5
        if kind == 0:  # integer, right
            golds.append(str(n)), responses.append(rf"... \boxed{{{n}}}"), expected.append(1.0)
        elif kind == 1:  # integer, off by one
            golds.append(str(n)), responses.append(rf"... \boxed{{{n + 1}}}"), expected.append(0.0)
        elif kind == 2:  # fraction answered as a decimal: n/8 is exact in at most 3 decimals
            (
                golds.append(rf"\frac{{{n}}}{{8}}"), responses.append(rf"... \boxed{{{n / 8}}}"),
                expected.append(1.0))
        elif kind == 3:  # radicals through sympy: a*sqrt(2) = sqrt(2 a^2); a*sqrt(3) is not
            a = n % 10 + 1
            right = n % 2 == 0
            golds.append(rf"{a}\sqrt{{2}}"), expected.append(float(right))
            responses.append(
                rf"... \boxed{{\sqrt{{{2 * a * a}}}}}" if right else rf"... \boxed{{{a}\sqrt{{3}}}}"
            )
        else:  # no box
            golds.append(str(n)), responses.append(f"the answer is {n}"), expected.append(0.0)
    _, accuracies, metrics = rewards.compute_rewards(
        responses, golds, ["Short_CoT"] * 1000, [0] * 1000, config.RewardConfig())
    assert accuracies == expected
    assert metrics["rollout/no_answer_frac"] == 0.2 and metrics["rollout/parse_error_frac"] == 0.0


# --------------------------------------------------------------------------------------------------
# verify_sum
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("response, gold, expected", [
    (r"\boxed{3+4}", "7", (True, "ok")),
    (r"I pick \boxed{1+6} as my answer.", "7", (True, "ok")),  # text outside the box is fine
    (r"\boxed{ 3 + 4 }", "7", (True, "ok")),  # whitespace inside is ignored
    (r"\boxed{3+4}", " 7 ", (True, "ok")),
    (r"\boxed{1+1} no, \boxed{2+5}", "7", (True, "ok")),  # the last box counts
    (r"\boxed{007+0}", "7", (False, "ok")),  # zero operand
    (r"\boxed{0+7}", "7", (False, "ok")),
    (r"\boxed{2+4}", "7", (False, "ok")),  # wrong sum
    (r"\boxed{-1+8}", "7", (False, "parse_error")),  # a sign is not allowed
    (r"\boxed{+3+4}", "7", (False, "parse_error")),
    (r"\boxed{3+4=7}", "7", (False, "parse_error")),
    (r"\boxed{3+4 apples}", "7", (False, "parse_error")),
    (r"\boxed{3.0+4}", "7", (False, "parse_error")),
    (r"\boxed{1+2+4}", "7", (False, "parse_error")),
    (r"\boxed{7}", "7", (False, "parse_error")),
    ("\\boxed{\u0663+4}", "7", (False, "parse_error")),  # an Arabic-Indic digit
    (r"\boxed{}", "7", (False, "parse_error")),
    ("3+4", "7", (False, "no_answer")),
    ("", "7", (False, "no_answer")),
    (r"\boxed{3+4}", "seven", (False, "parse_error")),  # a bad ground truth
    # beyond int()'s digit limit: valid form, wrong sum
    ("\\boxed{" + "1" * 5000 + "+1}", "7", (False, "ok"))])
def test_verify_sum(response, gold, expected):
    assert rewards.verify_sum(response, gold) == expected


@pytest.mark.parametrize("response, gold, expected", [
    (r"\boxed{8*4-3}", "3,4,8=29", (True, "ok")),
    (r"\boxed{ 3 - 4 + 8 }", "3,4,8=7", (True, "ok")),  # whitespace is ignored
    (r"\boxed{3+4*8}", "3,4,8=35", (True, "ok")),  # * before +
    (r"\boxed{3+4*8}", "3,4,8=56", (False, "ok")),  # not left to right
    (r"\boxed{8*4}", "3,4,8=32", (False, "ok")),  # a number left out
    (r"\boxed{8*4-3-3}", "3,4,8=26", (False, "ok")),  # a number used twice
    (r"\boxed{8*4-9}", "3,4,8=23", (False, "ok")),  # a number not given
    (r"\boxed{34+8}", "3,4,8=42", (False, "ok")),  # digits glued into another number
    (r"\boxed{(8-4)*3}", "3,4,8=12", (False, "parse_error")),  # no parentheses
    (r"\boxed{8/4+3}", "3,4,8=5", (False, "parse_error")),
    (r"\boxed{-3+8*4}", "3,4,8=29", (False, "parse_error")),  # a leading sign
    (r"\boxed{8*4-3=29}", "3,4,8=29", (False, "parse_error")),
    ("8*4-3", "3,4,8=29", (False, "no_answer")),
    (r"\boxed{8*4-3}", "29", (False, "parse_error")),  # a malformed ground truth
    ("\\boxed{" + "9*" * 40 + "9}", "3,4,8=29", (False, "ok")),  # long: not multiplied out
])
def test_verify_countdown(response, gold, expected):
    assert rewards.verify_countdown(response, gold) == expected


def test_countdown_value_agrees_with_python_on_random_expressions():
    rng = random.Random(0)
    for _ in range(2000):
        numbers = [str(rng.randint(0, 99)) for _ in range(rng.randint(1, 5))]
        expression = numbers[0] + "".join(rng.choice("+-*") + n for n in numbers[1:])
        # an independent evaluator
        assert rewards.countdown_value(expression) == eval(expression), expression


# --------------------------------------------------------------------------------------------------
# overlong_penalty and format_ok
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("length, expected", [
    (0, 0.0), (50, 0.0), (80, 0.0),  # up to expected = 100 - 20: no penalty
    (85, -0.25), (90, -0.5), (100, -1.0),  # linear down to -factor at max_response_len
    (110, -1.5),  # beyond max_response_len: DAPO's formula, not clipped
])
def test_overlong_penalty_closed_form(length, expected):
    assert rewards.overlong_penalty(length, max_response_len=100, buffer_len=20) == pytest.approx(
        expected)


def test_overlong_penalty_factor_and_invalid_buffer():
    assert rewards.overlong_penalty(100, 100, 20, factor=0.5) == pytest.approx(-0.5)
    assert rewards.overlong_penalty(90, 100, 20, factor=2.0) == pytest.approx(-1.0)
    with pytest.raises(ValueError, match="buffer_len"):
        rewards.overlong_penalty(10, 100, 0)


@pytest.mark.parametrize("response, expected", [
    ("<think>reasoning</think>\n<answer>42</answer>", True),
    ("preamble <think>a</think>\n<answer>b</answer> tail", True),
    # both tags present: the newline is required
    ("<think>reasoning</think><answer>42</answer>", False),
    ("<think>reasoning</think>\n<answer>42", False),  # <answer> never closed
    ("<answer>42</answer> <think>x</think>", False),
    ("<think>reasoning</think>The answer is 42.", True),  # ^<think>X</think>Y$
    ("so </think> 42", True),  # contains </think>
    (r"The answer is \boxed{42}.", True),  # contains "boxed"
    ("The answer is 42.", False),
    ("<think>unfinished", False),
    ("", False)])
def test_format_ok(response, expected):
    assert rewards.format_ok(response) is expected


# --------------------------------------------------------------------------------------------------
# compute_rewards and RewardConfig
# --------------------------------------------------------------------------------------------------


def test_compute_rewards_routing_composition_and_metrics():
    cfg = config.RewardConfig(
        timeout_s=0.5, overlong_buffer_len=10, max_response_len=100, format_weight=0.5)
    batch = [  # (response, ground truth, data source, length, acc, overlong penalty, format_ok)
        (r"\boxed{3+4}", "7", "tiny_sum", 50, 1.0, 0.0, True),
        (r"\boxed{7}", "7", "tiny_sum", 95, 0.0, -0.5, True),  # the sum task needs a+b: parse_error
        # the math verifier accepts the same text
        (r"\boxed{7}", "7", "Short_CoT", 100, 1.0, -1.0, True),
        ("The answer is 7.", "7", "Short_CoT", 10, 0.0, 0.0, False),  # no box
        (r"<think>hm</think> so \boxed{\frac{3}{4}}", "0.75", "AIME24", 90, 1.0, 0.0, True),
        (r"\boxed{9^{9^{9^{9^{9}}}}}", "3", "Math500", 0, 0.0, 0.0, True),  # times out
        (r"\boxed{2*3+1}", "1,2,3=7", "tiny_countdown", 0, 1.0, 0.0, True)]
    responses, golds, sources, lengths, accs, penalties, formats = map(list, zip(*batch))
    scores, accuracies, metrics = rewards.compute_rewards(responses, golds, sources, lengths, cfg)
    assert accuracies == accs
    assert scores == pytest.approx([a + p + 0.5 * f for a, p, f in zip(accs, penalties, formats)])
    assert scores == pytest.approx([1.5, 0.0, 0.5, 0.0, 1.5, 0.5, 1.5])
    expected_metrics = {
        "rollout/reward_mean": 5.5 / 7,
        "rollout/acc": 4 / 7,
        "rollout/no_answer_frac": 1 / 7,
        "rollout/parse_error_frac": 1 / 7,
        "rollout/timeout_frac": 1 / 7,
        "rollout/format_ok_frac": 6 / 7,
        "rollout/overlong_penalty_mean": -1.5 / 7,
    }
    assert set(metrics) == set(expected_metrics) | {"rollout/verify_seconds"}
    for key, value in expected_metrics.items():
        assert metrics[key] == pytest.approx(value), key
    assert 0.4 < metrics["rollout/verify_seconds"] < 5.0  # includes the 0.5 s timeout
    assert all(isinstance(value, float) for value in metrics.values())


def test_default_config_rewards_accuracy_only():
    responses = [r"\boxed{2}", r"\boxed{3}", "no box", "<think>x</think>\n<answer>1</answer>"]
    scores, accuracies, metrics = rewards.compute_rewards(
        responses, ["2", "2", "2", "1"], ["math"] * 4, [10**6] * 4, config.RewardConfig())
    assert scores == accuracies == [1.0, 0.0, 0.0, 0.0]
    assert metrics["rollout/overlong_penalty_mean"] == 0.0  # off, whatever the lengths
    assert metrics["rollout/format_ok_frac"] == 0.75  # logged though not rewarded


def test_compute_rewards_empty_batch_and_length_mismatch():
    scores, accuracies, metrics = rewards.compute_rewards([], [], [], [], config.RewardConfig())
    assert scores == accuracies == [] and metrics["rollout/acc"] == 0.0
    with pytest.raises(ValueError, match="differ in length"):
        rewards.compute_rewards(["a", "b"], ["1"], ["math", "math"], [1, 1], config.RewardConfig())


def test_compute_rewards_never_raises_on_content():
    weird = [
        "", "\x00", "\\boxed{", "}}}{{{", "\\boxed{\\boxed{\\boxed{}}}", "\ud800", "$" * 10_000,
        "\\boxed{3+}"]
    scores, accuracies, _ = rewards.compute_rewards(
        weird * 2, ["1", "x"] * len(weird), ["math"] * len(weird) + ["tiny_sum"] * len(weird),
        [0] * (2 * len(weird)), config.RewardConfig(timeout_s=1.0))
    assert len(scores) == 2 * len(weird) and set(accuracies) == {0.0}


@pytest.mark.parametrize("kwargs, field", [
    ({"answer_format": "latex"}, "answer_format"),
    ({"timeout_s": 0}, "timeout_s"),
    ({"timeout_s": math.nan}, "timeout_s"),
    ({"overlong_buffer_len": -1}, "overlong_buffer_len"),
    ({"overlong_penalty_factor": -0.5}, "overlong_penalty_factor"),
    ({"max_response_len": -1}, "max_response_len"),
    ({"overlong_buffer_len": 100}, "max_response_len"),  # shaping on, max_response_len left at 0
    ({"overlong_buffer_len": 100, "max_response_len": 100}, "max_response_len"),
    ({"format_weight": math.inf}, "format_weight")])
def test_reward_config_errors_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        config.RewardConfig(**kwargs)


def test_reward_config_accepts_overlong_shaping_when_consistent():
    cfg = config.RewardConfig(
        overlong_buffer_len=4096, max_response_len=20480, overlong_penalty_factor=1.0)
    assert cfg.overlong_buffer_len == 4096


def test_exponent_notation_and_missing_responses():
    # "2.5e-07" as a ground truth or an answer is a number, not 2.5 * e - 7 (math-verify's reading
    # of "e")
    assert rewards.verify_math("\\boxed{0.00000025}", "2.5e-07") == (True, "ok")
    assert rewards.verify_math("\\boxed{2.5e-07}", "0.00000025") == (True, "ok")
    assert rewards.verify_math("\\boxed{2.5e-06}", "2.5e-07") == (False, "ok")
    scores, accuracies, metrics = rewards.compute_rewards(
        [None, "\\boxed{1}"], ["1", "1"], ["x", "x"], [0, 1], config.RewardConfig())
    assert accuracies == [0.0, 1.0] and metrics["rollout/no_answer_frac"] == 0.5
