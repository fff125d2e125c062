"""tools/stats.py against closed forms, hand counts and independent Monte Carlo estimates, and
tools/decisive.py's analysis on synthetic runs whose answer is known."""

import math
import random
import statistics

import pytest

from tools import decisive, stats


def test_t_quantile_and_beta_against_closed_forms():
    for p in (0.6, 0.9, 0.975, 0.995, 0.1):
        assert stats.t_quantile(p, 1) == pytest.approx(math.tan(math.pi * (p - 0.5)), rel=1e-9)
        assert stats.t_quantile(p, 2) == pytest.approx(
            (2 * p - 1) / math.sqrt(2 * p * (1 - p)), rel=1e-9)
        # many degrees of freedom: the normal quantile
        assert stats.t_quantile(p, 10**6) == pytest.approx(
            statistics.NormalDist().inv_cdf(p), abs=1e-4)
    # printed tables (two-sided 95%)
    for df, table in ((4, 2.776), (7, 2.365), (30, 2.042)):
        assert stats.t_quantile(0.975, df) == pytest.approx(table, abs=5e-4)
    for x in (0.01, 0.3, 0.7, 0.99):
        assert stats.regularized_beta(x, 3.5, 1) == pytest.approx(x ** 3.5, rel=1e-10)
        assert stats.regularized_beta(x, 1, 2.5) == pytest.approx(1 - (1 - x) ** 2.5, rel=1e-10)
    assert stats.t_cdf(0.0, 5) == pytest.approx(0.5)
    with pytest.raises(ValueError):
        stats.t_quantile(1.0, 3)


def test_t_interval_by_hand():
    mean, low, high = stats.t_interval([1.0, 2.0, 3.0, 4.0])
    half = 3.182446 * statistics.stdev([1, 2, 3, 4]) / 2  # t(3) 97.5%, from a table
    assert (mean, low, high) == pytest.approx((2.5, 2.5 - half, 2.5 + half), abs=1e-5)


def test_sign_flip_p_by_hand_and_against_monte_carlo():
    assert stats.sign_flip_p([0.3] * 8) == 2 / 256  # all one sign: the two extreme patterns
    # +-1 +-2 +-0.5: |sum| >= 2.5 in 4 of the 8 patterns (3.5, 2.5 and their negatives)
    assert stats.sign_flip_p([1.0, 2.0, -0.5]) == 0.5
    assert stats.sign_flip_p([0.0, 0.0, 0.0]) == 1.0
    rng = random.Random(1)
    differences = [rng.gauss(0.4, 1.0) for _ in range(10)]
    observed = abs(sum(differences))
    draws = 40_000
    estimate = sum(abs(sum(d * rng.choice((1, -1)) for d in differences)) >= observed
                   for _ in range(draws)) / draws
    assert stats.sign_flip_p(differences) == pytest.approx(estimate, abs=0.01)


def test_holm_by_hand():
    # sorted: 0.01*4 = 0.04, 0.03*3 = 0.09, 0.04*2 = 0.08 -> 0.09 (monotone), 0.2*1
    assert stats.holm([0.01, 0.04, 0.03, 0.2]) == pytest.approx([0.04, 0.09, 0.09, 0.2])
    assert stats.holm([0.5, 0.9]) == [1.0, 1.0]


def test_clustered_bootstrap_against_closed_forms():
    # a constant difference: no uncertainty
    mean, low, high, se = stats.clustered_bootstrap([[0.25] * 6] * 5, list(range(6)), 200)
    assert (mean, low, high, se) == pytest.approx((0.25, 0.25, 0.25, 0.0))
    # variation only between seeds: the bootstrap SE of a mean of n values,
    # sqrt((n - 1) / n) * SD / sqrt(n)
    rng = random.Random(0)
    seed_effects = [rng.gauss(0, 1) for _ in range(12)]
    grid = [[effect] * 8 for effect in seed_effects]
    _, low, high, se = stats.clustered_bootstrap(grid, list(range(8)), 4000)
    expected = math.sqrt(11 / 12) * statistics.stdev(seed_effects) / math.sqrt(12)
    assert se == pytest.approx(expected, rel=0.08)
    assert low < statistics.fmean(seed_effects) < high
    # variation only between prompts, in clusters of 4 identical prompts: resampling the clusters
    # gives the SE of a mean of 10 cluster values; treating the 40 prompts as independent would
    # give half of it
    cluster_values = [rng.gauss(0, 1) for _ in range(10)]
    row = [value for value in cluster_values for _ in range(4)]
    clusters = [c for c in range(10) for _ in range(4)]
    _, _, _, clustered = stats.clustered_bootstrap([row] * 3, clusters, 4000)
    expected = math.sqrt(9 / 10) * statistics.stdev(cluster_values) / math.sqrt(10)
    assert clustered == pytest.approx(expected, rel=0.1)
    _, _, _, naive = stats.clustered_bootstrap([row] * 3, list(range(40)), 4000)
    assert naive == pytest.approx(clustered / 2, rel=0.15)


def test_clustered_bootstrap_weights_prompts_not_clusters():
    """Clusters of 1 prompt (difference 0) and 7 prompts (difference 1): drawing the two clusters
    with replacement gives a mean over prompts of 0, 7/8 or 1 with probabilities 1/4, 1/2, 1/4
    (SD 0.400); weighting the clusters equally would give 0, 1/2, 1 (SD 0.354)."""
    mean, low, high, se = stats.clustered_bootstrap([[0.0] + [1.0] * 7] * 4, [0] + [1] * 7, 8000)
    values, weights = (0.0, 7 / 8, 1.0), (0.25, 0.5, 0.25)
    centre = sum(v * w for v, w in zip(values, weights))
    sd = math.sqrt(sum(w * (v - centre) ** 2 for v, w in zip(values, weights)))
    assert se == pytest.approx(sd, rel=0.04)
    assert (mean, low, high) == (7 / 8, 0.0, 1.0)


def test_value_at_level_by_hand():
    xs, ys = [0.1, 0.2, 0.15, 0.3], [0.5, 0.7, 0.6, 0.9]
    assert stats.value_at_level(xs, ys, 0.15) == pytest.approx(0.6)  # halfway along the first leg
    assert stats.value_at_level(xs, ys, 0.25) == pytest.approx(0.8)  # the first crossing
    assert stats.value_at_level(xs, ys, 0.05) == 0.5
    assert stats.value_at_level(xs, ys, 0.4) is None


def synthetic_runs(seeds=8, prompts=8):
    """GRPO's pass@1 rises 0.1 -> 0.3 over 100 steps, then stays; "better" solves 1 + seed more
    samples (of 64) of every prompt at every step after 0; the others equal GRPO."""
    def record(step, extra):
        counts = [round(64 * (0.1 + 0.2 * min(step, 100) / 100)) + (extra if step else 0)] * prompts
        pass1 = statistics.fmean(c / 64 for c in counts)
        metrics = {"heldout/pass@1": pass1, "heldout/pass@8": 1 - (1 - pass1) ** 8,
                   "heldout/pass@64": min(1.0, 2 * pass1), "heldout/correct": counts,
                   "heldout/distinct_correct_frac": 0.5}
        if step % 100 == 0:
            metrics.update({"fresh/pass@1": pass1, "fresh/pass@8": 0.5, "fresh/pass@64": 0.9})
        return {"step": step, **metrics}

    runs = {}
    for name in decisive.SETTINGS:
        last = 400 if name == "grpo" else 200
        runs[name] = [
            ([{"train/entropy": 0.2}] * last,
             {s: record(s, 1 + seed if name == "stare_w4" else 0) for s in range(0, last + 1, 25)})
            for seed in range(seeds)]
    return runs


def test_analysis_finds_the_plateau_and_the_one_real_difference():
    runs = synthetic_runs()
    summary = decisive.analyze(runs, 200, clusters=[0, 0, 1, 1, 2, 2, 3, 3], resamples=500)
    # 0.3 from step 100 on: the first step whose next 200 steps gain < 0.01 is 100
    assert summary["plateau"]["first_step"] == 100
    assert summary["plateau"]["compared_at"] == 100
    assert not summary["plateau"]["capped_by_budget"]
    h2 = summary["primary"]["H2"]  # stare_w4 - grpo: (1 + seed) / 64 on every prompt
    differences = [(1 + seed) / 64 for seed in range(8)]
    assert h2["per_seed"] == pytest.approx(differences)
    half = 2.364624 * statistics.stdev(differences) / math.sqrt(8)  # t(7) 97.5%, from a table
    assert h2["t95"] == pytest.approx([4.5 / 64 - half, 4.5 / 64 + half], abs=1e-6)
    assert h2["p_sign_flip"] == 2 / 256 and h2["above"] == 8
    assert h2["p_holm"] == pytest.approx(6 * 2 / 256) and h2["rejected_at_0.05"]
    assert h2["bootstrap95"][0] <= 4.5 / 64 <= h2["bootstrap95"][1]
    # H6 (stare_w4 - entropy_bonus) carries the same differences, Holm's second step
    assert summary["primary"]["H6"]["p_holm"] == pytest.approx(6 * 2 / 256)
    for label in ("H1", "H3", "H4", "H5"):  # equal to GRPO: every sign pattern ties
        assert summary["primary"][label]["p_sign_flip"] == 1.0
        assert not summary["primary"][label]["rejected_at_0.05"]
    better = summary["settings"]["stare_w4"]
    assert better["fresh/pass@1"]["minus_grpo"]["mean"] == pytest.approx(4.5 / 64)
    # the frontier: the highest pass@1 every run reaches is GRPO's plateau, 19/64; there pass@8 is
    # the same function of pass@1 for both, so the matched difference is only the interpolation's
    # (a chord of a concave curve: at most a little below)
    frontier = summary["frontier"]["stare_w4_vs_grpo"]["pass@8"]
    assert frontier["level"] == pytest.approx(19 / 64)
    assert frontier["y"] == pytest.approx([1 - (1 - 19 / 64) ** 8] * 8)
    assert -0.01 < frontier["mean"] <= 1e-12
    assert frontier["informative"] and frontier["step_y"] == [100] * 8
    # a setting that never rises above its start: the pairs would match at step 0, flagged
    runs["steer"] = [(records, {s: heldout[0] for s in heldout})
                     for records, heldout in runs["grpo"]]
    flat = decisive.analyze(runs, 200, [0, 0, 1, 1, 2, 2, 3, 3], resamples=50)
    assert not flat["frontier"]["steer_vs_grpo"]["pass@8"]["informative"]
