"""tools/target_compare.py: the pilot's rules, the one-sided exact test and its power, the endpoint
measure and the primary family, against hand computations and closed forms; one short run through
tools/repro.py with EntroPIC's controller and the endpoint evaluations."""

import itertools
import json
import math
import statistics

import pytest

import evaluate
from tools import repro, stats
from tools import target_compare as tc


def test_one_sided_sign_flip_p_by_hand_and_by_enumeration():
    # sums of +-1 +-2 +-3 at least the observed: 6 only; 6, 4, 2
    assert stats.sign_flip_p([1, 2, 3], "greater") == 1 / 8
    assert stats.sign_flip_p([1, -2, 3], "greater") == 3 / 8
    assert stats.sign_flip_p([-1, -2, -3], "greater") == 1.0
    values = [0.3, -0.1, 0.25, 0.05, -0.2]
    sums = [sum(s * abs(v) for s, v in zip(signs, values))
            for signs in itertools.product((1, -1), repeat=5)]
    assert stats.sign_flip_p(values, "greater") == sum(x >= sum(values) - 1e-12 for x in sums) / 32


def test_power_against_the_closed_form_of_four_seeds():
    """With 4 seeds at alpha 1/16 the one-sided exact test rejects only when all four differences
    are positive: power = Phi(effect / sd)^4; the two-sided test at 2/16 rejects when all four
    share a sign."""
    phi = statistics.NormalDist().cdf
    one = tc.sign_flip_power(1.0, 0.5, 4, 1 / 16, one_sided=True, sims=20000)
    assert one == pytest.approx(phi(0.5) ** 4, abs=0.01)
    two = tc.sign_flip_power(1.0, 0.5, 4, 2 / 16, sims=20000)
    assert two == pytest.approx(phi(0.5) ** 4 + phi(-0.5) ** 4, abs=0.01)
    assert tc.sign_flip_power(0.01, 1.0, 16, 0.05 / 3, sims=50) == 1.0


def pilot_runs(start, middle, end_entropy, pass1, seeds=2, steps=300):
    """Runs whose entropy is `start` for steps 1-10, `middle` for 141-150 and `end_entropy`
    elsewhere; pass1: {step: value} for every seed."""
    def entropy(step):
        return start if step <= 10 else middle if 141 <= step <= 150 else end_entropy

    records = [{"step": s, "train/entropy": entropy(s)} for s in range(1, steps + 1)]
    heldout = {s: {"heldout/pass@1": v} for s, v in pass1.items()}
    return [(records, heldout)] * seeds


def test_pilot_rule_picks_the_smallest_qualifying_lr():
    levelled = {0: 0.10, 200: 0.20, 250: 0.205, 300: 0.205}
    rows = {
        6e-4: tc.pilot_row(pilot_runs(0.3, 0.2, 0.1, levelled), 300),  # entropy not halved
        1e-3: tc.pilot_row(pilot_runs(0.3, 0.14, 0.1, levelled), 300),  # qualifies
        2e-3: tc.pilot_row(pilot_runs(0.3, 0.1, 0.1, levelled), 300),
    }
    assert not rows[6e-4]["entropy_halved"] and rows[1e-3]["qualifies"]
    assert tc.choose_lr(rows) == 1e-3
    still_rising = {0: 0.10, 200: 0.20, 250: 0.21, 300: 0.22}
    collapsed = {0: 0.10, 200: 0.05, 250: 0.05, 300: 0.05}
    rows = {1e-3: tc.pilot_row(pilot_runs(0.3, 0.1, 0.1, still_rising), 300),
            2e-3: tc.pilot_row(pilot_runs(0.3, 0.1, 0.1, collapsed), 300)}
    assert not rows[1e-3]["levelled_off"] and rows[2e-3]["levelled_off"]
    assert not rows[2e-3]["not_collapsed"]
    assert tc.choose_lr(rows) is None
    assert tc.plateau_step(pilot_runs(0.3, 0.1, 0.1, levelled), 300) == 200


def endpoint_record(counts_a, counts_b):
    return {"endpoint": {"A": {"heldout/correct": counts_a,
                               "heldout/pass@1": statistics.fmean(c / 64 for c in counts_a)},
                         "B": {"heldout/correct": counts_b,
                               "heldout/pass@1": statistics.fmean(c / 64 for c in counts_b)}}}


def test_endpoint_value_is_the_mean_over_steps_and_prompts_of_unbiased_pass_at_k():
    heldout = {250: endpoint_record([0, 64], [32, 1]), 275: endpoint_record([1, 1], [1, 1]),
               300: endpoint_record([64, 64], [0, 0])}
    at_250 = (0 + 1 + (1 - math.comb(32, 16) / math.comb(64, 16)) + 16 / 64) / 4
    at_275 = 16 / 64
    assert tc.endpoint_value(heldout, 300, 16) == pytest.approx((at_250 + at_275 + 0.5) / 3)
    assert tc.endpoint_value(heldout, 300, 1) == pytest.approx(
        ((0 + 64 + 32 + 1) / 256 + 1 / 64 + 0.5) / 3)
    assert tc.per_prompt_endpoint(heldout, 300, 1)[1] == pytest.approx((64 + 1 + 64) / 3 / 64)


def test_primary_family_on_synthetic_runs():
    """STARE solves (1 + seed) more samples of 64 on every prompt than GRPO and EntroPIC, which are
    equal: H1 and H2 all 16 seeds above (p = 2 / 2^16 two-sided), H3's non-inferiority holds."""
    def run(extra, entropy):
        records = [{"step": s, "train/entropy": entropy, "stare/gate_on": 0.0}
                   for s in range(1, 301)]
        heldout = {s: endpoint_record([10 + extra] * 4, [20 + extra] * 4) for s in (250, 275, 300)}
        return records, heldout

    runs = {"grpo": [run(0, 0.1 + 0.001 * seed) for seed in range(16)],  # seeds told apart
            "stare": [run(1 + seed, 0.2) for seed in range(16)],
            "entropic": [run(0, 0.15) for _ in range(16)]}
    # GRPO's seed 3 stops updating after step 150 (every group all wrong): no entropy is measured
    for record in runs["grpo"][3][0][150:]:
        del record["train/entropy"]
    summary = tc.analyze(runs, 300, clusters=[0, 1, 2, 3, 4, 5, 6, 7], resamples=200)
    h1, h2, h3 = (summary["primary"][h] for h in ("H1", "H2", "H3"))
    assert h1["above"] == 16 and h1["p"] == 2 / 2 ** 16 and h1["rejected_at_0.05"]
    assert h2["per_seed"] == pytest.approx(h1["per_seed"])
    expected = [statistics.fmean([(10 + 1 + s) / 64] * 4 + [(20 + 1 + s) / 64] * 4)
                - statistics.fmean([10 / 64] * 4 + [20 / 64] * 4) for s in range(16)]
    assert h3["per_seed"] == pytest.approx(expected)
    assert h3["p"] == 1 / 2 ** 16 and h3["margin"] == 0.02  # one-sided: all shifted up
    # Holm: H3's 1/2^16 x 3, then H1's and H2's 2/2^16 x 2 (and x 1, held monotone)
    assert h3["p_holm"] == pytest.approx(3 / 2 ** 16)
    assert h1["p_holm"] == h2["p_holm"] == pytest.approx(4 / 2 ** 16)
    assert summary["settings"]["stare"]["entropy_mean"]["mean"] == pytest.approx(0.2)
    grpo_last = summary["settings"]["grpo"]["entropy_last_third"]
    assert grpo_last["per_seed"][3] is None and grpo_last["n"] == 15
    assert summary["settings"]["grpo"]["updated_frac_last_third"]["per_seed"][3] == 0.0
    stare_last = summary["settings"]["stare"]["entropy_last_third"]["minus_grpo"]
    # the 15 pairs with both measured, each STARE seed against its own GRPO seed
    assert stare_last["per_seed"] == pytest.approx([0.2 - 0.1 - 0.001 * s for s in range(16)
                                                    if s != 3])
    json.dumps(summary, allow_nan=False)  # summary.json: no NaN
    assert summary["settings"]["entropic"]["pass@16"]["minus_grpo"]["p"] == 1.0


def test_non_inferiority_fails_when_the_loss_exceeds_the_margin():
    worse = [-0.03 + 0.001 * s for s in range(8)]  # every seed below -0.02 but the last ones
    result = tc.test_pair(worse, [0.0] * 8, margin=0.02)
    assert result["p"] > 0.5 and result["mean"] < -0.02


def test_entropic_run_with_endpoint_evaluations(countdown_dir, tmp_path):
    """Two steps of EntroPIC through tools/repro.py: the controller's error is logged at every
    step, and an endpoint step holds both splits with endpoint_n samples and per-prompt counts."""
    spec = repro.RunSpec("entropic", dict(method="entropic"), seed=3, steps=2,
                         prompts_per_step=4, target_entropy=0.15, predict_ps=(),
                         task="countdown", eval_every=2, eval_n=1, endpoint_steps=(1,),
                         endpoint_n=4)
    records = repro.train_run(spec, countdown_dir, tmp_path)
    for r in records:
        if "train/entropy" in r:  # a step with an update
            assert r["entropic/error"] == pytest.approx(r["train/entropy"] - 0.15, abs=1e-5)
    heldout = repro.read_heldout(tmp_path)
    # evaluated at 0 and the last step (eval_every), and at the endpoint step 1
    assert sorted(heldout) == [0, 1, 2]
    assert [s for s in heldout if "endpoint" in heldout[s]] == [1]
    for split in ("A", "B"):
        counts = heldout[1]["endpoint"][split]["heldout/correct"]
        assert len(counts) == 64 and all(0 <= c <= 4 for c in counts)
    value = statistics.fmean(evaluate.pass_at_k(4, c, 1) for split in "AB"
                             for c in heldout[1]["endpoint"][split]["heldout/correct"])
    assert value == pytest.approx(statistics.fmean(
        heldout[1]["endpoint"][split]["heldout/pass@1"] for split in "AB"))
    # the export: the run's spec, its per-step controller state and its counts, read back
    import gzip
    import json

    tc.write_runs(tmp_path / "runs.jsonl.gz", [tmp_path])
    (line,) = gzip.open(tmp_path / "runs.jsonl.gz", "rt").read().splitlines()
    exported = json.loads(line)
    assert exported["spec"]["loss"] == {"method": "entropic"}
    assert [r["step"] for r in exported["steps"]] == [1, 2]
    assert [r.get("entropic/error") for r in exported["steps"]] == [
        r.get("entropic/error") for r in records]
    assert exported["evaluations"][1]["endpoint"]["B"]["heldout/correct"] == (
        heldout[1]["endpoint"]["B"]["heldout/correct"])
