"""rewards.py: verifiable rewards. Checks math answers with math-verify and the tiny "sum" task with
plain integers. Pure Python: no vLLM, no torch, no torch.distributed, no file I/O.

    cfg = config.RewardConfig()                         # acc only, as in STARE
    scores, accs, metrics = rewards.compute_rewards(responses, ground_truths, data_sources,
                                                    response_lengths, cfg)
    rewards.verify_math(r"... so the answer is \\boxed{\\frac{3}{4}}", "0.75")      # (True, "ok")
    rewards.verify_sum(r"\\boxed{3+4}", "7")                                        # (True, "ok")
    rewards.reflection_counts(response)                 # ("aha" words, words): logged, not rewarded
    python -m tools.bench reward-throughput             # responses per second on this machine

The reward of a response is docs/method.md's Eq. 21 (`compute_rewards`); acc comes from the data
source's verifier (verify_math's docstring has the rules for math). Every check returns (correct,
status), status one of "ok", "no_answer", "parse_error", "timeout", and the fraction of each is
logged.

Timeouts: sympy can run for minutes on a pathological answer, so one deadline of timeout_s bounds
each whole check ("the deadline" below). It needs signals, so call compute_rewards from the main
thread, as the trainer does, or from a process pool with your own outer limit.

Simplified relative to the STARE reference's reward, which finds the answer heuristically and
accepts it if any of three checkers does: one strict extraction (the last \\boxed{}, which STARE's
prompt asks for) and one checker (math-verify), so "correct" has one meaning. An answer stated only
in prose scores 0 here but may score 1 there; answer_format="any" is more lenient.
"""

import functools
import logging
import math
import re
import signal
import threading
import time
from fractions import Fraction

# math-verify's own timeouts are off (a single deadline is enforced here, see _call_with_deadline);
# its warning saying so would only alarm the reader of every training log
logging.getLogger("math_verify").setLevel(logging.ERROR)

# data_source of tools/tiny.py's "write N as a sum of two positive integers" task
SUM_TASK_SOURCE = "tiny_sum"
# data_source of tools/tiny.py's "reach T from three digits with + - *" task
COUNTDOWN_TASK_SOURCE = "tiny_countdown"
ANSWER_FORMATS = ("boxed", "any")

# The gold and a boxed prediction are parsed with the same config, so two identical strings parse
# identically. boxed_match_priority=0: a \boxed{} match wins over any other LaTeX match.
@functools.cache
def _math_verify():
    """math-verify, imported at the first score (config.py, and the tools that read configs only,
    run where it is not installed) -> (parse, verify, the boxed extraction config)."""
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

    return parse, verify, [LatexExtractionConfig(boxed_match_priority=0), ExprExtractionConfig()]


# --------------------------------------------------------------------------------------------------
# answer extraction
# --------------------------------------------------------------------------------------------------

_BOXED_OPEN = re.compile(r"\\boxed\s*\{")
# an escape such as \{ \} or \\ is one token, not a brace
_ESCAPE_OR_BRACE = re.compile(r"\\.|[{}]", re.DOTALL)


def extract_boxed(text: str) -> str | None:
    """The content of the last \\boxed{...} in text, braces balanced: '\\boxed{\\frac{1}{2}}' ->
    '\\frac{1}{2}'. '\\boxed {x}' also counts. Returns None if there is no \\boxed{, or if the last
    one is never closed."""
    last_open = max(_BOXED_OPEN.finditer(text), key=lambda match: match.start(), default=None)
    if last_open is None:
        return None
    depth = 1
    for token in _ESCAPE_OR_BRACE.finditer(text, last_open.end()):
        if token.group() == "{":
            depth += 1
        elif token.group() == "}":
            depth -= 1
            if depth == 0:
                return text[last_open.end():token.start()]
    return None


# --------------------------------------------------------------------------------------------------
# the deadline
# --------------------------------------------------------------------------------------------------
# math-verify's own timeouts use signal.alarm, which raises ValueError outside the main thread
# (Math-Verify issues #50, #55), counts whole seconds, and applies to each parse and each (gold,
# prediction) pair, so one response can cost several timeouts. So math-verify runs with timeout=None
# and one deadline surrounds the whole check: a SIGALRM interval timer (setitimer, fractional
# seconds) whose handler raises _Timeout, a BaseException that the `except Exception` blocks of
# math-verify and sympy cannot swallow. Python itself can: an exception raised while a weakref
# callback or a __del__ runs (sympy's caches trigger both) is printed as "Exception ignored" and
# dropped, so after the deadline the timer fires every 10 ms until the exception gets through, and a
# check that still returns after its deadline counts as a timeout too. The caller's SIGALRM handler
# is restored afterwards, and so is what was left of a pending alarm of the caller's (it goes off
# late, when the check ends). The timer interrupts Python code only, between bytecodes: a single
# long C call runs to its end first. Outside the main thread there is no deadline.


class _Timeout(BaseException):
    """Raised by the SIGALRM handler; a BaseException, so math-verify and sympy let it through."""


def _call_with_deadline(seconds: float, fn, *args):
    """fn(*args), cut off by _Timeout after `seconds` in the main thread; elsewhere unbounded."""
    if (seconds is None or seconds <= 0 or not hasattr(signal, "setitimer")
            or threading.current_thread() is not threading.main_thread()):
        return fn(*args)
    started = time.monotonic()
    expired, stopped = [], []

    def raise_timeout(signum, frame):
        if stopped:  # a tick delivered after the check ended: nothing left to interrupt
            return
        expired.append(True)
        raise _Timeout

    def stop_timer():
        stopped.append(True)  # first: a tick handled from here on raises nothing
        signal.setitimer(signal.ITIMER_REAL, 0)

    previous_handler = signal.signal(signal.SIGALRM, raise_timeout)
    previous_timer = (0.0, 0.0)
    try:
        # at the deadline, then every 10 ms: a _Timeout that Python dropped is raised again
        previous_timer = signal.setitimer(signal.ITIMER_REAL, seconds, 0.01)
        try:
            result = fn(*args)
        finally:
            stop_timer()
        # the deadline passed and every _Timeout was dropped: the answer came too late all the same
        if expired:
            raise _Timeout
        return result
    finally:
        # again: a tick may have interrupted the first call before it stopped the timer
        stop_timer()
        # None: the handler was not installed from Python; the default is the closest equivalent
        signal.signal(
            signal.SIGALRM, signal.SIG_DFL if previous_handler is None else previous_handler)
        left, interval = previous_timer
        # the caller had an alarm pending: re-arm what is left of it (at least a microsecond)
        if left > 0:
            signal.setitimer(
                signal.ITIMER_REAL, max(left - (time.monotonic() - started), 1e-6), interval)


# --------------------------------------------------------------------------------------------------
# verifiers
# --------------------------------------------------------------------------------------------------


# A plain number: an integer, a decimal (optionally with an exponent: "2.5e-07"; math-verify would
# read that "e" as Euler's number), \frac{p}{q} (also \dfrac, \tfrac) or p/q, with an optional
# leading minus. At most 50 digits per part, so int() never meets Python's 4300-digit limit.
_PLAIN_NUMBER = re.compile(
    r"(?P<minus>-?)(?:(?P<decimal>[0-9]{1,50}(?:\.[0-9]{1,50})?(?:[eE][-+]?[0-9]{1,3})?)"
    r"|\\[dt]?frac\{(?P<frac_p>[0-9]{1,50})\}\{(?P<frac_q>[0-9]{1,50})\}"
    r"|(?P<slash_p>[0-9]{1,50})/(?P<slash_q>[0-9]{1,50}))")


def _plain_number(text: str) -> Fraction | None:
    """The exact value of a plain number ("-12", "0.75", "\\frac{3}{4}", "3/4"); else None."""
    match = _PLAIN_NUMBER.fullmatch(text.strip())
    if match is None:
        return None
    if match["decimal"] is not None:
        value = Fraction(match["decimal"])
    else:
        p, q = match["frac_p"] or match["slash_p"], match["frac_q"] or match["slash_q"]
        if int(q) == 0:
            return None
        value = Fraction(int(p), int(q))
    return -value if match["minus"] else value


def _plain_numbers_verdict(ground_truth: str, answer: str) -> bool | None:
    """The verdict on two plain numbers, without sympy, where it is certain; None where math-verify
    must decide.

    Equal exact values are correct. math-verify would agree, and where it would not (a 16-digit
    decimal, which sympy rounds to 15 digits) the answer is still right. Values further apart than
    1e-5 (plus a relative 1e-9 for sympy's 15-digit floats) are wrong: math-verify accepts two
    unequal numbers only when both round to the same 6 decimals. Nearer values are left to
    math-verify, so that for example 0.333333 still matches 1/3.
    """
    gold, prediction = _plain_number(ground_truth), _plain_number(answer)
    if gold is None or prediction is None:
        return None
    if gold == prediction:
        return True
    if abs(gold - prediction) > Fraction(1, 10**5) + max(abs(gold), abs(prediction)) / 10**9:
        return False
    return None


@functools.lru_cache(maxsize=4096)
def _parse_gold(ground_truth: str) -> list:
    # the box makes plain "42", "\frac{1}{2}", "x^2+1" a LaTeX match (the string form is kept too)
    parse, _, boxed = _math_verify()
    return parse("\\boxed{" + ground_truth + "}", extraction_config=boxed, parsing_timeout=None)


@functools.lru_cache(maxsize=65536)
def _boxed_answer_matches(ground_truth: str, answer: str) -> tuple[bool, str]:
    # cached: a group of n samples often repeats an answer (a _Timeout leaves the cache untouched)
    parse, verify, boxed = _math_verify()
    gold = _parse_gold(ground_truth)
    prediction = parse("\\boxed{" + answer + "}", extraction_config=boxed, parsing_timeout=None)
    if not gold or not prediction:
        return False, "parse_error"
    return verify(gold, prediction, timeout_seconds=None), "ok"


def _check_math(response: str, ground_truth: str, answer_format: str) -> tuple[bool, str]:
    if answer_format == "boxed":
        answer = extract_boxed(response)
        if answer is None:
            return False, "no_answer"
        # identical strings: math-verify agrees
        if answer.strip() and answer.strip() == ground_truth.strip():
            return True, "ok"
        verdict = _plain_numbers_verdict(ground_truth, answer)  # ~50x faster than parsing the LaTeX
        if verdict is not None:
            return verdict, "ok"
        return _boxed_answer_matches(ground_truth, answer)
    parse, verify, _ = _math_verify()
    gold = _parse_gold(ground_truth)
    # math-verify's default extraction, over the whole text
    prediction = parse(response, parsing_timeout=None)
    if not prediction:
        return False, "no_answer"
    if not gold:
        return False, "parse_error"
    return verify(gold, prediction, timeout_seconds=None), "ok"


def verify_math(response: str, ground_truth: str, answer_format: str = "boxed",
                timeout_s: float = 5.0) -> tuple[bool, str]:
    """Is the response's final answer mathematically equal to ground_truth? -> (correct, status).

    Prediction: with answer_format "boxed" (the default) the content of the last \\boxed{...}
    (`extract_boxed`) and nothing else; without one, (False, "no_answer"). With "any",
    math-verify's own extraction searches the whole response (LaTeX environments, boxes, "final
    answer is", bare expressions): more lenient, it also accepts a bare "answer 42".
    Gold: parsed from "\\boxed{" + ground_truth + "}", so "42", "\\frac{1}{2}", "x^2+1" and "[1,2)"
    all parse. Comparison: math_verify.verify(gold, prediction), gold first (it is asymmetric);
    symbolic and numeric (6 decimal places), sets, intervals and equations too. math-verify's
    leniencies are kept: 10\\% equals both 10 and 0.1, the gold 5 accepts x=5, the gold "1,2" is
    the set {1, 2} but "1,000" is 1000, and a space between digits multiplies ("1 000" equals 0).
    Shortcuts in boxed mode, none of which can turn a wrong answer into a right one: a string
    identical to the ground truth; two plain numbers decided by exact arithmetic where that is
    certain (`_plain_numbers_verdict`); cached golds and verdicts (a timed-out check never is).
    status: "ok" (compared), "no_answer", "parse_error" (math-verify understood nothing, or an
    error), "timeout" (the whole check exceeded timeout_s; main thread only). Never raises on any
    response or ground truth; an unknown answer_format is a programming error: ValueError.
    """
    if answer_format not in ANSWER_FORMATS:
        raise ValueError(f"answer_format must be one of {ANSWER_FORMATS}, got {answer_format!r}")
    try:
        return _call_with_deadline(timeout_s, _check_math, response, ground_truth, answer_format)
    except _Timeout:
        return False, "timeout"
    except Exception:  # math-verify catches its own errors; this the rest (e.g. a non-str input)
        return False, "parse_error"


# ASCII digits only: \d would also accept e.g. Arabic-Indic digits
_SUM_ANSWER = re.compile(r"([0-9]+)\+([0-9]+)")


def verify_sum(response: str, ground_truth: str) -> tuple[bool, str]:
    """The tiny "sum" task's verifier: is the last \\boxed{} exactly "a+b" (whitespace ignored, a
    and b plain decimal digits: no sign, no other symbol), with a, b > 0 and a + b == ground_truth?
    status: "no_answer" without a box, "parse_error" if the box is not of the form a+b (or the
    ground truth is not an integer), else "ok". No sympy. Never raises."""
    try:
        answer = extract_boxed(response)
        if answer is None:
            return False, "no_answer"
        match = _SUM_ANSWER.fullmatch("".join(answer.split()))
        if match is None:
            return False, "parse_error"
        target = int(ground_truth)
    except Exception:  # a non-str input, or a ground truth that is not an integer
        return False, "parse_error"
    try:
        a, b = int(match.group(1)), int(match.group(2))
    except ValueError:
        # more digits than Python converts (4300): the form is right, the sum cannot be this small
        return False, "ok"
    return a > 0 and b > 0 and a + b == target, "ok"


_COUNTDOWN_EXPRESSION = re.compile(r"[0-9]+(?:[-+*][0-9]+)*")
_COUNTDOWN_TRUTH = re.compile(r"([0-9]+(?:,[0-9]+)*)=([0-9]+)")


def countdown_value(expression: str) -> int:
    """Value of a digits-and-operators expression such as "8*4-3" ([-+*] between plain numbers, no
    parentheses, * before + and -), read term by term without eval. The caller checked the form."""
    value = 0
    for sign, term in re.findall(r"([-+]?)([0-9*]+)", expression):
        product = math.prod(int(factor) for factor in term.split("*"))
        value += -product if sign == "-" else product
    return value


def verify_countdown(response: str, ground_truth: str) -> tuple[bool, str]:
    """The tiny "countdown" task's verifier: does the last \\boxed{} (whitespace ignored) combine
    exactly the given numbers, each once, with + - * (no parentheses, usual precedence), into the
    target? ground_truth: "3,4,8=20" (the numbers, then the target). status: "no_answer" without a
    box, "parse_error" if the box is not numbers joined by + - * (or the ground truth is
    malformed), else "ok". Never raises."""
    try:
        answer = extract_boxed(response)
        if answer is None:
            return False, "no_answer"
        expression = "".join(answer.split())
        truth = _COUNTDOWN_TRUTH.fullmatch(ground_truth)
        if _COUNTDOWN_EXPRESSION.fullmatch(expression) is None or truth is None:
            return False, "parse_error"
        numbers = sorted(int(n) for n in re.findall(r"[0-9]+", expression))
        # far longer than any use of three numbers: not worth multiplying out
        if len(expression) > 64:
            return False, "ok"
    except Exception:  # a non-str input
        return False, "parse_error"
    given = sorted(int(n) for n in truth.group(1).split(","))
    return numbers == given and countdown_value(expression) == int(truth.group(2)), "ok"


def format_ok(response: str) -> bool:
    """STARE's format check (docs/method.md, Eq. 21). The reference only logs it.

    If both <think> and <answer> appear, a "<think>...</think>\\n<answer>...</answer>" block is
    required. Otherwise the response passes if it matches ^<think>X</think>Y$, if it contains
    "</think>", or if it contains "boxed" (the first implies the second: not tested apart)."""
    if "<think>" in response and "<answer>" in response:
        block = r"<think>.*?</think>\n<answer>.*?</answer>"
        return re.search(block, response, re.DOTALL) is not None
    return "</think>" in response or "boxed" in response


def overlong_penalty(
    length: int, max_response_len: int, buffer_len: int, factor: float = 1.0) -> float:
    """DAPO's overlong reward shaping (docs/method.md, Eq. 21): 0 up to max_response_len -
    buffer_len, then linear down to -factor at max_response_len. Like DAPO, it does not clip below
    -factor: a length beyond max_response_len (which the sampler never produces) costs more."""
    if buffer_len <= 0:
        raise ValueError(f"buffer_len must be > 0, got {buffer_len}")
    expected = max_response_len - buffer_len
    return min(-(length - expected) / buffer_len * factor, 0.0)


# --------------------------------------------------------------------------------------------------
# the batch reward
# --------------------------------------------------------------------------------------------------


def compute_rewards(
    responses: list[str], ground_truths: list[str], data_sources: list[str],
    response_lengths: list[int], cfg) -> tuple[list[float], list[float], dict[str, float]]:
    """Score a batch -> (rewards, accuracies, rollout/ metrics: batch means, 0.0 for an empty batch,
    and verify_seconds, the wall time of the call). An accuracy is 0.0 or 1.0, the reward Eq. 21;
    response_lengths (token counts) serve the overlong penalty only. Raises ValueError if the lists
    differ in length; never on response content."""
    if len({len(responses), len(ground_truths), len(data_sources), len(response_lengths)}) != 1:
        raise ValueError(
            f"responses, ground_truths, data_sources and response_lengths differ in length: "
            f"{len(responses)}, {len(ground_truths)}, {len(data_sources)}, {len(response_lengths)}")
    started = time.perf_counter()
    rewards, accuracies, statuses, formats, penalties = [], [], [], [], []
    for response, ground_truth, source, length in zip(
        responses, ground_truths, data_sources, response_lengths):
        # a missing response scores as no answer
        response = response if isinstance(response, str) else ""
        if source == SUM_TASK_SOURCE:
            correct, status = verify_sum(response, ground_truth)
        elif source == COUNTDOWN_TASK_SOURCE:
            correct, status = verify_countdown(response, ground_truth)
        else:
            correct, status = verify_math(response, ground_truth, cfg.answer_format, cfg.timeout_s)
        penalty = 0.0 if cfg.overlong_buffer_len <= 0 else overlong_penalty(
            length, cfg.max_response_len, cfg.overlong_buffer_len, cfg.overlong_penalty_factor)
        well_formatted = format_ok(response)
        accuracies.append(float(correct))
        rewards.append(float(correct) + penalty + cfg.format_weight * well_formatted)
        statuses.append(status)
        formats.append(well_formatted)
        penalties.append(penalty)

    def mean(values):
        return sum(values) / len(values) if values else 0.0

    metrics = {
        "rollout/reward_mean": mean(rewards),
        "rollout/acc": mean(accuracies),
        "rollout/no_answer_frac": mean([s == "no_answer" for s in statuses]),
        "rollout/parse_error_frac": mean([s == "parse_error" for s in statuses]),
        "rollout/timeout_frac": mean([s == "timeout" for s in statuses]),
        "rollout/format_ok_frac": mean(formats),
        "rollout/overlong_penalty_mean": mean(penalties),
        "rollout/verify_seconds": time.perf_counter() - started,
    }
    return rewards, accuracies, metrics


# --------------------------------------------------------------------------------------------------
# response statistics, logged next to the rewards (never rewarded)
# --------------------------------------------------------------------------------------------------

# Words that mark self-reflection in a chain of thought ("aha" words). Whole words,
# case-insensitive; inflected forms are listed explicitly so that "checkpoint" or "awaiting" never
# count.
REFLECTION_WORDS = (
    "wait", "hmm", "however", "alternatively", "actually", "verify", "verifying", "verified",
    "check", "checking", "recheck", "re-check", "double-check", "double-checking", "reconsider",
    "re-evaluate", "re-examine", "mistake")
# longest first: at one position the regex takes the first alternative that matches ("double-check",
# not "check")
_REFLECTION_RE = re.compile(
    r"(?<![\w-])(?:"
    + "|".join(re.escape(w) for w in sorted(REFLECTION_WORDS, key=len, reverse=True))
    + r")(?![\w-])",
    re.IGNORECASE)


def reflection_counts(text: str) -> tuple[int, int]:
    """(occurrences of REFLECTION_WORDS, whitespace-separated words) in one response."""
    return len(_REFLECTION_RE.findall(text)), len(text.split())


def distinct_correct_fraction(groups):
    """Diversity of the correct answers: over the groups with at least one correct response, the
    mean of (distinct correct responses, as token sequences) / (correct responses); None if no group
    has one. groups: lists of (response token ids, accuracy) pairs. Entropy collapse on a task with
    many right answers shows here first: the group keeps being right, with ever fewer different
    answers."""
    fractions = []
    for group in groups:
        correct = [tuple(tokens) for tokens, accuracy in group if accuracy > 0]
        if correct:
            fractions.append(len(set(correct)) / len(correct))
    return sum(fractions) / len(fractions) if fractions else None
