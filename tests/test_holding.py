"""tools/holding.py (docs/data/holding/PLAN.md): the break rule, the paired t-tests and their
power, the base model's pass@k, and the screen's decision rule on synthetic runs, against closed
forms and hand computations."""

import argparse
import json
import math
import random
import statistics

import numpy as np
import pytest

from tools import holding
from tools import target_compare as tc


def records(steps, dead=(), no_update=(), entropy=0.3):
    """Per-step records: accuracy 0 at the steps in dead, no update (no train/entropy) at those
    in no_update."""
    out = []
    for step in range(1, steps + 1):
        record = {"step": step, "rollout/acc_before_filter": 0.0 if step in dead else 0.2}
        if step not in no_update:
            record["train/entropy"] = entropy
        out.append(record)
    return out


def test_a_break_is_the_25th_dead_step_in_a_row_of_either_kind():
    assert holding.BREAK_STEPS == 25
    assert holding.break_step(records(100)) is None
    assert holding.break_step(records(100, dead=range(10, 34))) is None  # 24 in a row
    assert holding.break_step(records(100, dead=range(10, 35))) == 34
    # no update counts as dead; an alive step in between starts the count again
    assert holding.break_step(records(100, dead=range(10, 21), no_update=range(21, 35))) == 34
    assert holding.break_step(records(100, dead={*range(10, 22), *range(23, 47)})) is None
    assert holding.break_step(records(100, dead=range(76, 101))) == 100


def t_cdf_closed_form(t, df):
    """Student's t CDF for 1 and 2 degrees of freedom (Cauchy; the df-2 algebraic form)."""
    if df == 1:
        return 0.5 + math.atan(t) / math.pi
    assert df == 2
    return 0.5 + t / (2 * math.sqrt(2 + t * t))


@pytest.mark.parametrize("differences", [[0.1, 0.3], [-0.05, 0.2], [0.02, 0.11, -0.04],
                                         [-0.2, -0.1, -0.15]])
def test_the_paired_t_test_against_the_closed_form_cdf(differences):
    n = len(differences)
    mean = float(np.mean(differences))
    se = float(np.std(differences, ddof=1)) / math.sqrt(n)
    two_sided = holding.t_test(differences)
    assert two_sided["mean"] == pytest.approx(mean, abs=1e-15)
    assert two_sided["p"] == pytest.approx(2 * (1 - t_cdf_closed_form(abs(mean / se), n - 1)),
                                           abs=1e-9)
    assert two_sided["above"] + two_sided["below"] == n
    assert two_sided["per_seed"] == differences
    margin = 0.03
    one_sided = holding.t_test(differences, margin)
    assert one_sided["p"] == pytest.approx(1 - t_cdf_closed_form((mean + margin) / se, n - 1),
                                           abs=1e-9)
    assert one_sided["margin"] == margin


def test_power_is_alpha_under_the_null_one_when_the_effect_dwarfs_the_spread_and_matches_a_loop():
    assert holding.t_test_power(0.1, 0.0, 12, 0.05) == pytest.approx(0.05, abs=4 * 0.0016)
    assert holding.t_test_power(0.01, 0.08, 12, 0.025) == 1.0
    # two seeds: one degree of freedom, critical value tan(pi (1 - alpha/2 - 1/2)) in closed form
    alpha, sd, delta = 0.2, 0.1, 0.15
    critical = math.tan(math.pi * (0.5 - alpha / 2))
    rng = random.Random(1)
    sims, hits = 20000, 0
    for _ in range(sims):
        a, b = rng.gauss(delta, sd), rng.gauss(delta, sd)
        hits += abs((a + b) / 2) / (abs(a - b) / math.sqrt(2) / math.sqrt(2)) >= critical
    assert holding.t_test_power(sd, delta, 2, alpha) == pytest.approx(hits / sims, abs=0.015)


def test_at_the_issues_spread_the_plan_needs_about_24_to_28_seeds():
    """SD 0.12, delta 0.08, alpha 0.05 / 2 (Holm's first step of two): the issue's estimate."""
    powers = {n: holding.t_test_power(0.12, 0.08, n, 0.025) for n in range(20, 30)}
    needed = next(n for n, p in powers.items() if p >= 0.8)
    assert 24 <= needed <= 28


def heldout_at(counts_a, counts_b, pass1=0.2):
    return {"heldout/pass@1": pass1,
            "endpoint": {"A": {"heldout/correct": counts_a}, "B": {"heldout/correct": counts_b}}}


def test_the_base_models_pass_at_k_is_the_binomial_closed_form_over_a_and_b():
    n = tc.ENDPOINT_N
    counts_a, counts_b = [0, 3, 64], [10, 1]
    heldout = {0: heldout_at(counts_a, counts_b)}
    counts = counts_a + counts_b
    assert holding.step0_value(heldout, 1) == pytest.approx(sum(counts) / n / 5, abs=1e-15)
    expected = statistics.fmean(1 - math.comb(n - c, 16) / math.comb(n, 16) for c in counts)
    assert holding.step0_value(heldout, 16) == pytest.approx(expected, abs=1e-12)


def synthetic_run(seed, steps, broken, counts):
    """A run whose entropy falls from 0.5 to 0.2, with the endpoint's per-prompt correct counts
    (4 prompts of A, then 4 of B); broken: 30 dead steps at the end."""
    rng = random.Random(seed)
    run = records(steps, dead=range(steps - 29, steps + 1) if broken else ())
    for record in run:
        record["train/entropy"] = 0.5 - 0.3 * record["step"] / steps + rng.uniform(-0.01, 0.01)
    heldout = {0: heldout_at([2] * 4, [2] * 4, 0.1)}
    for step in (*tc.endpoint_steps(steps), 2 * steps // 3):
        heldout[step] = heldout_at(counts[:4], counts[4:], 0.15)
    return run, heldout


@pytest.fixture
def screen_with(monkeypatch, tmp_path):
    """run_screen over synthetic runs; broken: the seeds whose run breaks; counts: a seed's
    endpoint counts (default 3 for every prompt)."""
    def run(broken, counts=None):
        counts = counts or {}

        def load(jobs):
            return {str(d): synthetic_run(spec.seed, spec.steps, spec.seed in broken,
                                          counts.get(spec.seed, [3] * 8))
                    for spec, _, d in jobs}

        monkeypatch.setattr(holding, "load", load)
        args = argparse.Namespace(out=str(tmp_path), tiny="unused")
        code = holding.run_screen(args)
        return code, json.loads((tmp_path / "screen.json").read_text()), args
    return run


def test_a_break_in_the_candidate_screens_the_fallback_and_two_breaks_stop_the_plan(screen_with):
    code, screen, args = screen_with(broken={305})
    assert code == 0 and len(screen["candidates"]) == 2
    first, second = screen["candidates"]
    assert first["broken"] == 1 and first["breaks"]["305"] == holding.SETTING["steps"] - 5
    assert second["broken"] == 0 and screen["accepted"] == holding.FALLBACK
    assert second["seeds"] == list(holding.FALLBACK_SEEDS)

    code, screen, args = screen_with(broken={303, 315})
    assert code == 1 and screen["accepted"] is None
    with pytest.raises(SystemExit, match="no setting passed the screen"):
        holding.read(args, "screen.json")


def pass16(count):
    return 1 - math.comb(tc.ENDPOINT_N - count, 16) / math.comb(tc.ENDPOINT_N, 16)


def test_the_accepted_screen_sets_target_spread_and_seeds_by_the_plan(screen_with):
    # seed i solves (0, 0, 1, 3, 5, 7)[i % 6] of its 8 prompts once in 64: a paired SD of pass@16
    # just above the plan's floor of 0.12
    solved = {seed: (0, 0, 1, 3, 5, 7)[i % 6] for i, seed in enumerate(holding.SCREEN_SEEDS)}
    counts = {seed: [1] * k + [0] * (8 - k) for seed, k in solved.items()}
    code, screen, _ = screen_with(broken=set(), counts=counts)
    assert code == 0 and len(screen["candidates"]) == 1
    assert screen["accepted"] == holding.SETTING
    sd = statistics.stdev(k / 8 * pass16(1) for k in solved.values())
    assert screen["spread"]["16"]["paired_sd"] == pytest.approx(math.sqrt(2) * sd, abs=1e-12)
    assert screen["spread"]["16"]["df"] == 11
    assert screen["planning_sd"] == pytest.approx(math.sqrt(2) * sd, abs=1e-12)
    assert 0.12 < screen["planning_sd"] < 0.125
    entropy_start = statistics.fmean(
        statistics.fmean(r["train/entropy"] for r in synthetic_run(seed, 450, False, [])[0][:10])
        for seed in holding.SCREEN_SEEDS)
    assert screen["target_entropy"] == pytest.approx(0.6 * entropy_start, abs=1e-12)
    for m, seeds in screen["seeds"].items():  # the smallest n with power >= 0.8, else 28
        power = {int(n): p for n, p in screen["power"][m].items()}
        assert sorted(power) == list(range(12, 29))
        reached = [n for n in power if power[n] >= 0.8]
        assert seeds == (min(reached) if reached else 28)
    assert screen["seeds"]["2"] < 28  # two arms: powered within the range at this spread

    # every run alike: the spread is 0, so the plan's floor of 0.12 sets the seed count
    code, screen, _ = screen_with(broken=set())
    assert screen["spread"]["16"]["paired_sd"] == 0.0 and screen["planning_sd"] == 0.12
    assert 24 <= screen["seeds"]["2"] <= 28

    # a spread no count in 12..28 can power: 28 (the plan), with its power on record
    counts = {seed: [(0, 16)[i % 2]] * 8 for i, seed in enumerate(holding.SCREEN_SEEDS)}
    code, screen, _ = screen_with(broken=set(), counts=counts)
    assert screen["seeds"] == {"2": 28, "3": 28} and screen["power"]["2"]["28"] < 0.8
