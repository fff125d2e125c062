"""tools/repro.py: its sampler against independent computations (a full forward per row, the
softmax), the first-order critical W against entropy_dynamics, and a short run end to end through
train.py's stages."""

import copy
import dataclasses
import hashlib
import json
import math
import shutil
import statistics

import pytest
import torch

from tools import repro, tiny
import stare


@pytest.fixture(scope="module")
def random_tiny():
    """An untrained tiny Qwen2 (random weights: every token has a visible probability) and its tokenizer."""
    tokenizer = tiny.build_tokenizer()
    model = tiny.build_model(tokenizer, seed=3)
    model.eval()
    return model, tokenizer


def test_sampler_logprobs_mask_and_first_token_distribution(random_tiny):
    model, tokenizer = random_tiny
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    prompts = torch.randint(3, 200, (2, 6), generator=torch.Generator().manual_seed(1))
    eos_model = copy.deepcopy(model)  # EOS made likely, so that responses end at many lengths
    with torch.no_grad():
        eos_model.lm_head.weight[eos] *= 6.0
    tokens, mask, logprobs = repro.sample(
        eos_model, prompts, 16, 12, eos, pad, torch.Generator().manual_seed(0))
    assert tokens.shape == mask.shape == logprobs.shape and tokens.shape[0] == 32
    lengths = mask.sum(1)
    # some stop early, not all at once
    assert lengths.min() < tokens.shape[1] and (lengths > 1).any()
    # masked positions: a prefix, ending at the first EOS (included) or at max_tokens
    for row in range(32):
        length = int(lengths[row])
        assert (
            mask[row, :length].all()
            and not mask[row, length:].any()
            and (tokens[row, length:] == pad).all())
        ends = (tokens[row, :length] == eos).nonzero()
        assert (len(ends) == 0 and length == 12) or ends.flatten().tolist() == [length - 1]
    if (tokens == eos).any(1).all():  # every row ended: the tensors stop at the longest response
        assert tokens.shape[1] == int(lengths.max())
    # the sampler's log-probs are those of a full forward of each [prompt; response] row, at the
    # sampled tokens
    with torch.no_grad():
        for row in range(32):
            length = int(lengths[row])
            sequence = torch.cat([prompts[row // 16], tokens[row, :length]])[None]
            forward = torch.log_softmax(
                eos_model(input_ids=sequence).logits[0, prompts.shape[1] - 1 : -1], -1)
            want = forward.gather(-1, tokens[row, :length, None])[:, 0]
            assert (
                torch.allclose(logprobs[row, :length], want, atol=1e-5)
                and (logprobs[row, length:] == 0).all())
    # all rows stop at EOS -> the width is the longest response, not max_tokens
    with torch.no_grad():
        eos_model.lm_head.weight[eos] *= 5.0
    short, short_mask, _ = repro.sample(
        eos_model, prompts, 16, 200, eos, pad, torch.Generator().manual_seed(0))
    assert short.shape[1] == int(short_mask.sum(1).max()) < 200

    # first tokens of many samples follow the softmax: every frequency within 5 standard errors
    samples = 4000
    first, _, _ = repro.sample(
        model, prompts[:1], samples, 1, eos, pad, torch.Generator().manual_seed(2))
    with torch.no_grad():
        probs = torch.softmax(model(input_ids=prompts[:1]).logits[0, -1], -1)
    counts = torch.bincount(first[:, 0], minlength=probs.numel()).float() / samples
    tolerance = 5 * torch.sqrt(probs * (1 - probs) / samples) + 1e-3
    assert ((counts - probs).abs() <= tolerance).all()


def test_critical_w_cancels_the_first_order_entropy_change():
    generator = torch.Generator().manual_seed(0)
    advantages = torch.randn(16, generator=generator)
    sensitivity = torch.randn(16, 9, generator=generator)
    logprobs = -torch.rand(16, 9, generator=generator) * 4
    mask = torch.rand(16, 9, generator=generator) > 0.2
    # make GRPO's drift negative and the top-surprisal positive tokens raise entropy (the case where
    # W* exists)
    surprisal = -logprobs
    sensitivity = torch.where(surprisal > 2.5, sensitivity.abs(), -sensitivity.abs())
    dh_grpo, dh_lplus, w_star = repro.critical_w(advantages, sensitivity, logprobs, mask, 0.2)
    assert dh_grpo < 0 < dh_lplus and w_star > 1
    weights, _ = stare.stare_weights(logprobs, advantages, mask, "O1", 0.2, w=float(w_star))
    total = stare.entropy_dynamics(advantages, sensitivity, mask, weights=weights)["total/dH"]
    assert abs(float(total)) < 1e-6
    # no W* when amplifying L+ lowers the entropy too, nor when GRPO's own drift is not negative
    _, dh_lplus, w_star = repro.critical_w(advantages, -sensitivity.abs(), logprobs, mask, 0.2)
    assert dh_lplus < 0 and math.isnan(w_star)
    dh_grpo, _, w_star = repro.critical_w(advantages, -sensitivity, logprobs, mask, 0.2)
    assert dh_grpo > 0 and math.isnan(w_star)


def test_crossing_and_predicted_critical_w_by_hand():
    assert repro.crossing([1, 2, 4], [0.1, 0.2, 0.4], 0.3) == pytest.approx(3.0)
    assert repro.crossing([1, 2], [0.5, 0.6], 0.3) == 1
    assert repro.crossing([1, 2], [0.1, 0.2], 0.3) is None
    batches = [{"train/entropy": 0.2, "repro/dH_grpo": -0.02, "repro/dH_lplus@0.1": 0.01},
               {"train/entropy": 0.22, "repro/dH_grpo": -0.04, "repro/dH_lplus@0.1": 0.03},
               # outside the band
               {"train/entropy": 0.5, "repro/dH_grpo": -9.0, "repro/dH_lplus@0.1": 1.0}]
    w_c, dh_grpo, dh_lplus, count = repro.predicted_critical_w([batches[:1], batches[1:]], 0.2, 0.1)
    assert count == 2 and dh_grpo == pytest.approx(-0.03) and dh_lplus == pytest.approx(0.02)
    assert w_c == pytest.approx(1 + 0.03 / 0.02)
    flipped = [{**b, "repro/dH_lplus@0.1": -b["repro/dH_lplus@0.1"]} for b in batches]
    # amplifying L+ lowers entropy: no W_c
    assert repro.predicted_critical_w([flipped], 0.2, 0.1)[0] is None
    assert repro.predicted_critical_w([batches], 0.2, 0.05)[3] == 0  # no batch logged this P


def test_short_runs_end_to_end_and_resume(tiny_dir, tmp_path, capsys):
    """Three steps of GRPO and of STARE (gate always on) on the tiny default through main():
    metrics, held-out evaluations, summary and figures are written, the same seed gives GRPO and
    STARE the same first batch, the comparison's stare_o1 (a sweep point) is not run twice, and a
    second call reruns nothing."""
    argv = [
        "--tiny", str(tiny_dir), "--out", str(tmp_path), "--methods", "grpo", "stare_o1", "--ws",
        "4", "--ps", "0.05", "--seeds", "0", "--steps", "3", "--prompts-per-step", "4",
        "--target-entropy", "10", "--workers", "1", "--eval-n", "8", "--final-window", "2"]
    assert repro.main(argv) == 0
    grpo = repro.read_records(tmp_path / "compare" / "grpo_seed0" / "metrics.jsonl")
    stare_run = repro.read_records(tmp_path / "sweep" / "stare_o1_w4_p0.05_seed0" / "metrics.jsonl")
    assert [r["step"] for r in grpo] == [r["step"] for r in stare_run] == [1, 2, 3]
    for key in (
        "train/kept_groups", "rollout/acc_before_filter", "rollout/distinct_correct_frac",
        "train/entropy"):
        # same model, seed and prompts: the same first batch
        assert grpo[0].get(key) == stare_run[0].get(key)
    assert all(r["stare/gate_on"] == 1.0 for r in stare_run)
    updated = [r for r in stare_run if "train/loss" in r]
    assert updated and all(r["train/touched_frac"] > 0 for r in updated)  # L+ was reweighted
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert sorted(p.name for p in (tmp_path / "compare").iterdir()) == ["grpo_seed0"]
    assert summary["compare"]["stare_o1"] == summary["sweep"]["runs"]["P=0.05"]["W=4"]
    assert summary["settings"]["runs"] == 2 and "0.05" in summary["sweep"]["critical"]
    assert (tmp_path / "compare.png").stat().st_size > 0 and (
        tmp_path / "sweep.png"
    ).stat().st_size > 0
    # the held-out sum prompts, evaluated before training and after the last step, the same samples
    # before it
    heldout = [repro.read_heldout(tmp_path / "compare" / "grpo_seed0"),
               repro.read_heldout(tmp_path / "sweep" / "stare_o1_w4_p0.05_seed0")]
    assert [sorted(h) for h in heldout] == [[0, 3], [0, 3]] and heldout[0][0] == heldout[1][0]
    assert summary["compare_heldout"]["stare_o1"]["heldout/pass@8"]["per_seed"] == [
        heldout[1][3]["heldout/pass@8"]]
    assert (tmp_path / "compare_heldout.png").stat().st_size > 0
    runs = [tmp_path / "compare" / "grpo_seed0" / "metrics.jsonl",
            tmp_path / "sweep" / "stare_o1_w4_p0.05_seed0" / "metrics.jsonl"]
    before = [path.stat().st_mtime_ns for path in runs]
    assert repro.main(argv) == 0  # complete runs are read back, not rerun
    assert [path.stat().st_mtime_ns for path in runs] == before
    # other settings: rerun
    assert repro.main(argv[:-2] + ["--final-window", "2", "--target-entropy", "9"]) == 0
    assert all(path.stat().st_mtime_ns != old for path, old in zip(runs, before))
    # the summary names the starting model by content, and a run made from another model is rerun
    sha = hashlib.sha256((tiny_dir / "model" / "model.safetensors").read_bytes()).hexdigest()
    assert json.loads((tmp_path / "summary.json").read_text())["model_sha256"] == {"sum": sha}
    record = tmp_path / "compare" / "grpo_seed0" / "repro.json"
    assert json.loads(record.read_text())["model_sha256"] == sha
    record.write_text(json.dumps({**json.loads(record.read_text()), "model_sha256": "0" * 64}))
    before = [path.stat().st_mtime_ns for path in runs]
    assert repro.main(argv[:-2] + ["--final-window", "2", "--target-entropy", "9"]) == 0
    assert [path.stat().st_mtime_ns != old for path, old in zip(runs, before)] == [True, False]


def test_refill_rounds_fill_the_batch_and_min_kept_groups_withholds_the_update(tiny_dir, tmp_path):
    """Dynamic sampling's refill as train.py does it: more rounds of prompts while fewer than
    prompts_per_step groups varied; a step under min_kept_groups varied groups makes no update and
    counts as a step without signal."""
    base = dict(loss={"method": "grpo"}, seed=1, steps=2, prompts_per_step=8)
    plain = repro.train_run(repro.RunSpec("plain", **base), tiny_dir, tmp_path / "plain")
    refilled = repro.train_run(repro.RunSpec("refilled", refill_rounds=3, **base), tiny_dir,
                               tmp_path / "refilled")
    assert [r["rollout/gen_rounds"] for r in plain] == [1, 1]
    # step 1's first round is the plain run's round: same prompts, same samples
    first = plain[0]["train/kept_groups"]
    assert first == round(plain[0]["rollout/varied_group_frac"] * 8) < 8  # the batch was short
    record = refilled[0]
    assert record["rollout/gen_rounds"] >= 2 and record["train/zero_signal_steps"] == 0
    varied = round(record["rollout/varied_group_frac"] * 8 * record["rollout/gen_rounds"])
    assert record["train/kept_groups"] == min(8, varied) and varied > first
    assert varied >= 8 or record["rollout/gen_rounds"] == 4  # filled, or out of rounds
    # never enough varied groups: no step updates, each counts
    starved = repro.train_run(repro.RunSpec("starved", min_kept_groups=9, **base), tiny_dir,
                              tmp_path / "starved")
    assert [r["train/zero_signal_steps"] for r in starved] == [1, 2]
    assert not any("train/loss" in r for r in starved) and "train/loss" in plain[0]
    # a spec at the defaults of fields added later records as it did before them
    assert "refill_rounds" not in repro.spec_record(repro.RunSpec("plain", **base), tiny_dir)
    assert repro.spec_record(repro.RunSpec("x", refill_rounds=3, **base), tiny_dir)[
        "refill_rounds"] == 3


def test_a_killed_run_goes_on_from_its_resume_point_bit_exactly(tiny_dir, tmp_path, monkeypatch):
    """A run killed while saving its resume point at step 2 goes on from step 1's: every step's
    metrics and held-out evaluation are the uninterrupted run's (step 2's, written before the kill,
    are dropped and redone), and the resume file is gone once the run is complete."""
    monkeypatch.setattr(repro, "RESUME_EVERY", 1)
    spec = repro.RunSpec("stare", loss={"method": "stare"}, seed=3, steps=3, prompts_per_step=4,
                         target_entropy=10.0, eval_every=1, eval_n=2)
    whole = repro.train_run(spec, tiny_dir, tmp_path / "whole")
    save, saves = torch.save, []

    def killed_at_the_second_save(*args):
        saves.append(1)
        if len(saves) == 2:
            raise KeyboardInterrupt
        return save(*args)

    monkeypatch.setattr(torch, "save", killed_at_the_second_save)
    with pytest.raises(KeyboardInterrupt):
        repro.train_run(spec, tiny_dir, tmp_path / "killed")
    monkeypatch.setattr(torch, "save", save)
    assert sorted(repro.read_heldout(tmp_path / "killed")) == [0, 1, 2]

    def timeless(records):  # as JSON: NaN (an undefined first-order W) equals NaN
        return json.dumps([{k: v for k, v in r.items() if k != "time/step"} for r in records])

    # another spec in that directory starts over rather than going on from this run's state
    shutil.copytree(tmp_path / "killed", tmp_path / "renamed")
    renamed = dataclasses.replace(spec, name="renamed")
    assert timeless(repro.train_run(renamed, tiny_dir, tmp_path / "renamed")) == timeless(whole)
    # it goes on from step 1's point: steps 2 and 3 sampled, not the run again (one round a step)
    sample_groups, rounds = repro.sample_groups, []

    def counted(*args):
        rounds.append(1)
        return sample_groups(*args)

    monkeypatch.setattr(repro, "sample_groups", counted)
    resumed = repro.train_run(spec, tiny_dir, tmp_path / "killed")
    monkeypatch.setattr(repro, "sample_groups", sample_groups)
    assert len(rounds) == 2
    on_disk = repro.read_records(tmp_path / "killed" / "metrics.jsonl")
    assert timeless(resumed) == timeless(on_disk) == timeless(whole) and len(whole) == 3
    assert whole[-1]["stare/gate_on"] == 1.0 and "train/loss" in whole[-1]
    assert repro.read_heldout(tmp_path / "killed") == repro.read_heldout(tmp_path / "whole")
    assert sorted(repro.read_heldout(tmp_path / "whole")) == [0, 1, 2, 3]
    assert not (tmp_path / "killed" / repro.RESUME_FILE).exists()
    assert repro.is_complete(spec, tiny_dir, tmp_path / "killed")


def test_heldout_summary_against_subset_enumeration():
    """pass@k of each prompt = the fraction of its k-subsets of samples holding a correct one,
    counted by brute force; avg@n, the solved fraction and the diversity of correct answers by
    hand."""
    import itertools

    n = 6
    correct = [[1, 0, 0, 1, 0, 0], [0] * 6, [1] * 6, [0, 0, 0, 0, 0, 1]]
    # two distinct answers
    groups = [[((i % 2,), float(c)) for i, c in enumerate(row)] for row in correct]
    metrics = repro.heldout_summary(groups, n)
    for k in (1, 2, 4, 6):
        by_hand = [
            statistics.mean(
                any(row[i] for i in subset) for subset in itertools.combinations(range(n), k))
            for row in correct]
        assert metrics[f"heldout/pass@{k}"] == pytest.approx(statistics.mean(by_hand))
    assert set(metrics) == {f"heldout/pass@{k}" for k in (1, 2, 4, 6)} | {
        "heldout/avg@6", "heldout/solved_frac", "heldout/distinct_correct_frac", "heldout/correct"}
    assert metrics["heldout/correct"] == [2, 0, 6, 1]
    assert metrics["heldout/avg@6"] == pytest.approx(9 / 24)
    assert metrics["heldout/solved_frac"] == 0.75
    # correct answers of the solved prompts: (0,) and (1,) -> 2/2; (0,) and (1,) thrice each -> 2/6;
    # (1,) -> 1/1
    assert metrics["heldout/distinct_correct_frac"] == pytest.approx((2 / 2 + 2 / 6 + 1 / 1) / 3)


def test_paired_difference_by_hand():
    diff = repro.paired_difference([0.5, 0.7, 0.4], [0.3, 0.4, 0.5])
    assert diff["per_seed"] == pytest.approx([0.2, 0.3, -0.1])
    assert diff["mean"] == pytest.approx(0.4 / 3)
    assert diff["paired_se"] == pytest.approx(statistics.stdev([0.2, 0.3, -0.1]) / math.sqrt(3))
    assert (diff["seeds_above"], diff["seeds_below"]) == (2, 1)
    # a seed with nothing to measure
    with_nan = repro.paired_difference([0.5, math.nan, 0.7, 0.4], [0.3, 0.1, 0.4, 0.5])
    assert with_nan["mean"] == pytest.approx(diff["mean"]) and with_nan[
        "paired_se"
    ] == pytest.approx(diff["paired_se"])


def test_payoff_quick_variant(countdown_dir, tmp_path, capsys):
    """The payoff comparison in miniature (one seed, 4 steps, 4 samples per held-out prompt): every
    setting is evaluated on the held-out prompts before training (the same model and samples for
    all), every 2 steps and at the end; pass@k rises with k, and the summary pairs each setting with
    GRPO."""
    argv = [
        "--tiny", str(countdown_dir), "--out", str(tmp_path), "--part", "payoff", "--seeds", "0",
        "--steps", "4", "--eval-every", "2", "--eval-n", "4", "--entropy-coefs", "0.05",
        "--prompts-per-step", "4", "--workers", "1"]
    assert repro.main(argv) == 0
    summary = json.loads((tmp_path / "payoff" / "summary.json").read_text())
    settings = ["grpo", "stare_paper", "stare_holding", "lp_reg", "entropy_bonus_0.05"]
    if summary["prediction"]["w"] is not None:
        settings.append(f"stare_predicted_w{summary['prediction']['w']:.2f}")
    assert list(summary["runs"]) == settings
    initial = None
    for name in settings:
        heldout = repro.read_heldout(tmp_path / "payoff" / f"{name}_seed0")
        assert sorted(heldout) == [0, 2, 4]
        # paired: the same model and samples before training
        assert initial is None or heldout[0] == initial
        initial = heldout[0]
        for record in heldout.values():
            passes = [record[f"heldout/pass@{k}"] for k in (1, 2, 4)]
            assert passes == sorted(passes) and record["heldout/pass@1"] == pytest.approx(
                record["heldout/avg@4"])
            assert record["heldout/pass@4"] == pytest.approx(record["heldout/solved_frac"])
        final = summary["runs"][name]["heldout/pass@4"]
        assert final["per_seed"] == [heldout[4]["heldout/pass@4"]]
        assert ("minus_grpo" in final) == (name != "grpo")
    lp_reg = summary["runs"]["lp_reg"]["heldout/pass@1"]
    grpo = summary["runs"]["grpo"]["heldout/pass@1"]
    assert lp_reg["minus_grpo"]["mean"] == pytest.approx(lp_reg["mean"] - grpo["mean"])
    assert set(summary["entropy_matched_bonus"]) == {
        name for name in settings if name.startswith("stare")
    }
    assert set(summary["entropy_matched_bonus"].values()) == {"entropy_bonus_0.05"}
    assert (tmp_path / "payoff" / "payoff.png").stat().st_size > 0
    sha = hashlib.sha256(
        (countdown_dir / "countdown_model" / "model.safetensors").read_bytes()).hexdigest()
    assert summary["model_sha256"] == {"countdown": sha}
    assert "paired difference from GRPO" in capsys.readouterr().out
    # a subset of the settings: GRPO comes along, and complete runs are read back, not rerun
    metrics = tmp_path / "payoff" / "lp_reg_seed0" / "metrics.jsonl"
    before = metrics.stat().st_mtime_ns
    assert repro.main(argv + ["--payoff-runs", "lp_reg"]) == 0
    summary = json.loads((tmp_path / "payoff" / "summary.json").read_text())
    assert list(summary["runs"]) == ["grpo", "lp_reg"] and metrics.stat().st_mtime_ns == before


def test_decisive_quick_variant(countdown_dir, tmp_path, capsys):
    """tools/decisive.py in miniature (2 seeds, GRPO 4 steps and the others 2, 2 samples per
    held-out prompt): every setting of a seed starts from the same model and held-out samples,
    split A is evaluated every 2 steps with per-prompt counts and split B with it; the analysis
    pairs the settings, and a second invocation reads the complete runs back."""
    from tools import decisive

    argv = ["--tiny", str(countdown_dir), "--out", str(tmp_path), "--seeds", "0", "1",
            "--steps", "2", "--grpo-steps", "4", "--eval-every", "2", "--fresh-every", "2",
            "--eval-n", "2", "--prompts-per-step", "4", "--workers", "1", "--resamples", "50"]
    with pytest.raises(SystemExit, match="12 runs are not complete"):
        decisive.main(argv + ["--analyze-only"])  # nothing run yet: it says so, starts nothing
    assert not (tmp_path / "grpo_seed0").exists()
    assert decisive.main(argv) == 0
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["plateau"]["compared_at"] == 2 and summary["plateau"]["capped_by_budget"]
    assert list(summary["primary"]) == ["H1", "H2", "H3", "H4", "H5", "H6"]
    for seed in (0, 1):
        start = None
        for name in decisive.SETTINGS:
            heldout = repro.read_heldout(tmp_path / f"{name}_seed{seed}")
            assert sorted(heldout) == ([0, 2, 4] if name == "grpo" else [0, 2])
            assert start is None or heldout[0] == start  # paired: one model, one set of samples
            start = heldout[0]
            for record in heldout.values():
                for split in ("heldout", "fresh"):
                    counts = record[f"{split}/correct"]
                    assert len(counts) == 64 and all(0 <= c <= 2 for c in counts)
                    assert record[f"{split}/pass@1"] == pytest.approx(statistics.mean(counts) / 2)
    # the primary test's differences are the per-seed pass@1 differences at the comparison step
    grpo = [repro.read_heldout(tmp_path / f"grpo_seed{s}")[2]["heldout/pass@1"] for s in (0, 1)]
    steer = [repro.read_heldout(tmp_path / f"steer_seed{s}")[2]["heldout/pass@1"] for s in (0, 1)]
    h4 = summary["primary"]["H4"]
    assert h4["per_seed"] == pytest.approx([a - b for a, b in zip(steer, grpo)])
    assert h4["p_sign_flip"] in (0.5, 1.0) and h4["p_holm"] >= h4["p_sign_flip"]  # 2 seeds
    assert (tmp_path / "frontier.png").stat().st_size > 0
    assert "| H6 | stare_w4 − entropy_bonus |" in capsys.readouterr().out
    metrics = tmp_path / "steer_seed1" / "metrics.jsonl"
    before = metrics.stat().st_mtime_ns
    assert decisive.main(argv) == 0 and decisive.main(argv + ["--analyze-only"]) == 0
    assert metrics.stat().st_mtime_ns == before
