"""tools/target_compare.py: two ways to hold the same target entropy, STARE's gated surprisal
reweighting and EntroPIC's PI-controlled loss term, against GRPO run until its entropy has fallen
and its pass@1 has levelled off, on the countdown task; run and analysed as planned in
docs/results.md ("Holding a target entropy"), the plan committed before any run.

    python -m tools.tiny --out runs/tiny --countdown
    python -m tools.target_compare --tiny runs/tiny --out runs/target pilot
    python -m tools.target_compare --tiny runs/tiny --out runs/target main
    python -m tools.target_compare --tiny runs/tiny --out runs/target analyze \
        --export docs/data/target

pilot    GRPO at each of PILOT_LRS over PILOT_SEEDS (never reused), split A evaluated every 25
         steps with 64 samples; choose_lr's rule picks the learning rate, the target is
         TARGET_FRACTION x GRPO's mean batch entropy over its first 10 steps; then one EntroPIC
         run checks that its controller holds that target (HOLD_RULE). -> pilot.json.
main     SETTINGS over --seeds at the pilot's lr and target: split A every 25 steps with 16
         samples (the curves), splits A and B at the endpoint steps with 64 (the tests).
analyze  the primary tests (HYPOTHESES), the secondary measures and the figure from the complete
         runs; beside running runs it reports the seeds complete so far, and no test until all are.
         --export writes every run's per-step record and every evaluation's per-prompt correct
         counts (runs.jsonl.gz) and summary.json, from which every number recomputes.

A run that is complete is not rerun, so an interrupted invocation resumes where it stopped (an
unfinished run goes on from its last resume point).
"""

import argparse
import gzip
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

import evaluate
from tools import decisive, plots, repro, stats

PILOT_LRS = (6e-4, 1e-3, 2e-3)
PILOT_SEEDS = (100, 101)
TARGET_FRACTION = 0.6  # of GRPO's starting entropy: the target both methods hold
SETTINGS = {
    "grpo": dict(method="grpo"),
    # the strength that held the target on this task (docs/results.md, the payoff runs)
    "stare": dict(method="stare", stare_variant="O1", stare_w=4.0, stare_top_ratio=0.05),
    "entropic": dict(method="entropic"),  # gains: config.py's EntropicConfig (the reference's)
}
# (label, setting, against, measure, non-inferiority margin or None for a two-sided test)
HYPOTHESES = [("H1", "stare", "grpo", "pass@16", None),
              ("H2", "stare", "entropic", "pass@16", None),
              ("H3", "stare", "grpo", "pass@1", 0.02)]
ENDPOINT_N = 64
CURVE_N = 16
EVAL_EVERY = 25
HOLD_BAND = 0.3  # the controller check: mean entropy of the last third within +-30% of the target
HOLD_RULE = "EntroPIC's kp and ki x10, once, if the check run misses the band"


def endpoint_steps(steps):
    return (steps - 50, steps - 25, steps)


def spec_for(name, loss, seed, lr, target, steps, pilot):
    return repro.RunSpec(
        name, loss, seed=seed, steps=steps, prompts_per_step=16, target_entropy=target, lr=lr,
        predict_ps=(), task="countdown", eval_every=EVAL_EVERY,
        eval_n=ENDPOINT_N if pilot else CURVE_N, endpoint_steps=endpoint_steps(steps),
        endpoint_n=ENDPOINT_N)


# --------------------------------------------------------------------------------------------------
# The pilot's rules
# --------------------------------------------------------------------------------------------------


def mean_entropy(records, first, last):
    """Mean train/entropy over steps first..last (1-based, inclusive; steps without an update
    skipped)."""
    values = [r["train/entropy"] for r in records[first - 1:last] if "train/entropy" in r]
    return statistics.fmean(values) if values else math.nan


def pilot_row(runs, steps):
    """One learning rate's pilot runs [(records, heldout by step)] -> the rule's measures (seed
    means): starting entropy (steps 1-10), entropy at the half-way point (the 10 steps ending at
    steps/2), pass@1 on A at 0, 2/3 of the way and the end, and the three conditions."""
    half, two_thirds = steps // 2, 2 * steps // 3
    start = statistics.fmean(mean_entropy(records, 1, 10) for records, _ in runs)
    middle = statistics.fmean(mean_entropy(records, half - 9, half) for records, _ in runs)

    def pass1(step):
        return statistics.fmean(heldout[step]["heldout/pass@1"] for _, heldout in runs)

    row = {"entropy_start": start, "entropy_half": middle, "pass1_start": pass1(0),
           "pass1_two_thirds": pass1(two_thirds), "pass1_end": pass1(steps)}
    row["entropy_halved"] = middle < 0.5 * start
    row["levelled_off"] = row["pass1_end"] - row["pass1_two_thirds"] < 0.01
    row["not_collapsed"] = all(h[steps]["heldout/pass@1"] >= h[0]["heldout/pass@1"]
                               for _, h in runs)
    row["qualifies"] = row["entropy_halved"] and row["levelled_off"] and row["not_collapsed"]
    return row


def choose_lr(rows):
    """{lr: pilot_row} -> the smallest lr that qualifies, or None."""
    return min((lr for lr, row in rows.items() if row["qualifies"]), default=None)


def plateau_step(runs, steps):
    """The first evaluated step s from which the seed-mean pass@1 on A gains < 0.01 by the end."""
    evaluated = sorted(set.intersection(*(set(h) for _, h in runs)))
    mean = {s: statistics.fmean(h[s]["heldout/pass@1"] for _, h in runs) for s in evaluated}
    return next(s for s in evaluated if mean[steps] - mean[s] < 0.01)


def sign_flip_power(sd, effect, seeds, alpha, one_sided=False, sims=2000, seed=0):
    """Power of the exact sign-flip test at level alpha for `seeds` paired differences drawn from
    N(effect, sd^2), by simulation over all 2^seeds sign patterns."""
    rng = np.random.default_rng(seed)
    signs = 1 - 2 * ((np.arange(2 ** seeds)[:, None] >> np.arange(seeds)) & 1)  # [2^n, n]
    rejected = 0
    for _ in range(sims):
        d = rng.normal(effect, sd, seeds)
        sums = signs @ np.abs(d)  # [2^n]
        observed = d.sum()
        if one_sided:
            p = np.mean(sums >= observed - 1e-12 * np.abs(d).sum())
        else:
            p = np.mean(np.abs(sums) >= abs(observed) - 1e-12 * np.abs(d).sum())
        rejected += p <= alpha
    return rejected / sims


# --------------------------------------------------------------------------------------------------
# Endpoint measures and the tests
# --------------------------------------------------------------------------------------------------


def endpoint_counts(heldout, steps):
    """Per endpoint step, the per-prompt correct counts of A then B (A u B)."""
    return {s: heldout[s]["endpoint"]["A"]["heldout/correct"]
            + heldout[s]["endpoint"]["B"]["heldout/correct"] for s in endpoint_steps(steps)}


def endpoint_value(heldout, steps, k, n=ENDPOINT_N):
    """The endpoint measure: unbiased pass@k on A u B (mean over prompts), averaged over the
    endpoint steps."""
    return statistics.fmean(
        statistics.fmean(evaluate.pass_at_k(n, c, k) for c in counts)
        for counts in endpoint_counts(heldout, steps).values())


def per_prompt_endpoint(heldout, steps, k, n=ENDPOINT_N):
    """Per prompt of A u B: pass@k averaged over the endpoint steps (the bootstrap's rows)."""
    columns = list(endpoint_counts(heldout, steps).values())
    return [statistics.fmean(evaluate.pass_at_k(n, c, k) for c in prompt)
            for prompt in zip(*columns)]


def test_pair(x, y, margin):
    """decisive.paired's differences x - y, mean, t interval and counts, with the exact sign-flip p
    ("p"): two-sided when margin is None, else one-sided for non-inferiority (H0: difference <=
    -margin)."""
    result = decisive.paired(x, y)
    p = result.pop("p_sign_flip")
    if margin is not None:
        p = stats.sign_flip_p([d + margin for d in result["per_seed"]], alternative="greater")
    return {**result, "p": p, "margin": margin}


def analyze(runs, steps, clusters, resamples=4000):
    """runs: {setting: [(metrics records, held-out records by step) per seed]}, seeds aligned ->
    the primary family (Holm), secondary measures per setting and their difference from GRPO."""
    ks = (1, 16)
    value = {name: {k: [endpoint_value(h, steps, k) for _, h in seeds] for k in ks}
             for name, seeds in runs.items()}
    primary = {}
    for label, x, y, measure, margin in HYPOTHESES:
        k = int(measure.split("@")[1])
        result = {"setting": x, "against": y, "measure": measure,
                  **test_pair(value[x][k], value[y][k], margin)}
        rows = [[a - b for a, b in zip(per_prompt_endpoint(hx, steps, k),
                                       per_prompt_endpoint(hy, steps, k))]
                for (_, hx), (_, hy) in zip(runs[x], runs[y])]
        _, low, high, _ = stats.clustered_bootstrap(rows, clusters, resamples)
        result["clustered95"] = [low, high]
        primary[label] = result
    for result, p in zip(primary.values(), stats.holm([r["p"] for r in primary.values()])):
        result["p_holm"] = p
        result["rejected_at_0.05"] = p <= 0.05
    settings, measured = {}, {}
    late = steps - steps // 3 + 1  # the last third of the steps: late..steps, 1-based
    for name, seeds in runs.items():
        measures = {f"pass@{k}": value[name][k] for k in ks}
        measures["entropy_mean"] = [mean_entropy(r, 1, steps) for r, _ in seeds]
        measures["entropy_last_third"] = [mean_entropy(r, late, steps) for r, _ in seeds]
        measures["gate_on_frac"] = [statistics.fmean(x["stare/gate_on"] for x in r)
                                    for r, _ in seeds]
        # a run whose groups are all wrong (or all right) stops updating: its entropy is not
        # measured after that, so this says how many steps of the last third updated
        measures["updated_frac_last_third"] = [
            statistics.fmean("train/entropy" in x for x in r[late - 1:steps])
            for r, _ in seeds]
        for split in ("A", "B"):
            measures[f"pass@1_{split}"] = [
                statistics.fmean(h[s]["endpoint"][split]["heldout/pass@1"]
                                 for s in endpoint_steps(steps)) for _, h in seeds]
        measured[name] = measures
        described = {}
        for key, values in measures.items():
            # NaN: not measured (an entropy over steps without an update); pairs need both seeds
            mean, se = plots.mean_and_se(values)
            described[key] = {"mean": mean, "se": se, "n": sum(map(math.isfinite, values)),
                              "per_seed": [v if math.isfinite(v) else None for v in values]}
            pairs = [(a, b) for a, b in zip(values, measured["grpo"][key])
                     if math.isfinite(a) and math.isfinite(b)]
            if name != "grpo" and len(pairs) > 1:
                described[key]["minus_grpo"] = test_pair(*zip(*pairs), None)
        settings[name] = described
    return {"primary": primary, "settings": settings}


# --------------------------------------------------------------------------------------------------
# The command line
# --------------------------------------------------------------------------------------------------


def run_pilot(args, workers):
    out = Path(args.out) / "pilot"
    by_lr, rows = {}, {}
    for lr in sorted(PILOT_LRS):  # the rule takes the smallest that qualifies: larger ones wait
        jobs = [(spec_for("grpo", SETTINGS["grpo"], seed, lr, 0.2, args.steps, pilot=True),
                 args.tiny, out / f"grpo_lr{lr:g}_T{args.steps}_seed{seed}")
                for seed in PILOT_SEEDS]
        results = repro.run_all(jobs, workers)
        by_lr[lr] = [(results[str(d)], repro.read_heldout(d)) for _, _, d in jobs]
        rows[lr] = pilot_row(by_lr[lr], args.steps)
        if rows[lr]["qualifies"]:
            break
    lr = choose_lr(rows)
    pilot = {"steps": args.steps, "seeds": list(PILOT_SEEDS), "rows": {str(k): v
                                                                      for k, v in rows.items()}}
    if lr is None:
        print("no learning rate qualifies: change the budget (--steps), not the rule",
              file=sys.stderr)
        write_pilot(args, pilot)
        return 1
    target = TARGET_FRACTION * rows[lr]["entropy_start"]
    pilot.update(lr=lr, target_entropy=target, plateau_step=plateau_step(by_lr[lr], args.steps))
    # the paired SD for the power: sqrt(2) x the pooled between-seed SD of GRPO's endpoint
    for k in (1, 16):
        variances = [statistics.variance([endpoint_value(h, args.steps, k) for _, h in runs])
                     for runs in by_lr.values()]
        sd = math.sqrt(2 * statistics.fmean(variances))
        pilot[f"paired_sd_pass@{k}"] = sd
        pilot[f"power_pass@{k}"] = {
            f"{effect:g}": sign_flip_power(sd, effect, len(args.seeds), 0.05 / len(HYPOTHESES))
            for effect in (0.02, 0.04, 0.06, 0.1)}
    gains = {}
    for attempt in range(2):  # HOLD_RULE: the check, and at most one change of the gains
        loss = {**SETTINGS["entropic"], **gains}
        spec = spec_for("entropic", loss, PILOT_SEEDS[0], lr, target, args.steps, pilot=True)
        check = out / f"entropic_T{args.steps}_check{attempt}"
        records = repro.run_all([(spec, args.tiny, check)], workers)[str(check)]
        held = mean_entropy(records, args.steps - args.steps // 3 + 1, args.steps)
        pilot[f"entropic_check{attempt}"] = {"gains": gains, "entropy_last_third": held,
                                             "held": abs(held - target) <= HOLD_BAND * target}
        if pilot[f"entropic_check{attempt}"]["held"]:
            break
        gains = {"entropic_kp": 10.0, "entropic_ki": 0.1}
    pilot["entropic_gains"] = gains
    write_pilot(args, pilot)
    print(json.dumps(pilot, indent=1))
    return 0


def write_pilot(args, pilot):
    """pilot.json (what main reads) and pilot_T<steps>.json (kept when the budget changes)."""
    for name in ("pilot.json", f"pilot_T{args.steps}.json"):
        (Path(args.out) / name).write_text(json.dumps(pilot, indent=1))


def main_jobs(args, pilot):
    """Every setting and seed, seed by seed (an early stop leaves whole seeds)."""
    losses = {**SETTINGS, "entropic": {**SETTINGS["entropic"], **pilot["entropic_gains"]}}
    return [(spec_for(name, losses[name], seed, pilot["lr"], pilot["target_entropy"], args.steps,
                      pilot=False), args.tiny, Path(args.out) / "main" / f"{name}_seed{seed}")
            for seed in args.seeds for name in SETTINGS]


# the per-step metrics an export keeps
KEEP = ("step", "train/entropy", "stare/gate_on", "stare/gate_update_accepted", "entropic/coef",
        "entropic/integral", "entropic/error", "rollout/acc_before_filter", "train/kept_groups",
        "rollout/distinct_correct_frac", "train/touched_frac", "rollout/response_length_mean")


def write_runs(path, run_dirs, keep=KEEP):
    """One line per run directory: its spec (repro.json), per-step record and every evaluation
    with its per-prompt correct counts, gzip-compressed."""
    with gzip.open(path, "wt") as f:
        for run_dir in run_dirs:
            f.write(json.dumps({
                "run": run_dir.name, "spec": json.loads((run_dir / "repro.json").read_text()),
                "steps": [{k: r[k] for k in keep if k in r}
                          for r in repro.read_records(run_dir / "metrics.jsonl")],
                "evaluations": repro.read_records(run_dir / "heldout.jsonl")}) + "\n")


def export(path, out, jobs, summary):
    """Under path: runs.jsonl.gz (the main runs), pilot_runs.jsonl.gz (every pilot run), the pilot's
    decisions (pilot*.json) and summary.json: every number of the analysis recomputes from them."""
    path.mkdir(parents=True, exist_ok=True)
    write_runs(path / "runs.jsonl.gz", [Path(out_dir) for _, _, out_dir in jobs])
    write_runs(path / "pilot_runs.jsonl.gz", sorted(
        d for d in (out / "pilot").iterdir() if (d / "repro.json").exists()))
    for pilot in out.glob("pilot*.json"):
        (path / pilot.name).write_text(pilot.read_text())
    (path / "summary.json").write_text(json.dumps(summary, indent=1))


def run_main(args, workers, analyze_only):
    pilot_path = Path(args.out) / "pilot.json"
    if not pilot_path.exists():
        raise SystemExit(f"{pilot_path} is missing: run the pilot first")
    pilot = json.loads(pilot_path.read_text())
    if "lr" not in pilot:
        raise SystemExit(f"{pilot_path}: no learning rate qualified; rerun the pilot with --steps")
    if args.steps != pilot["steps"]:  # the budget is the pilot's decision
        print(f"--steps {args.steps} -> {pilot['steps']}, the pilot's budget", file=sys.stderr)
        args.steps = pilot["steps"]
    jobs = main_jobs(args, pilot)
    if analyze_only:
        done = [job for job in jobs if repro.is_complete(*job)]
        seeds = [s for s in args.seeds
                 if sum(job[0].seed == s for job in done) == len(SETTINGS)]
        print(f"{len(done)}/{len(jobs)} runs complete; whole seeds: {seeds}", file=sys.stderr)
        if len(seeds) < len(args.seeds):
            print("the tests wait for every seed (the plan)", file=sys.stderr)
            return 0
    started = time.time()
    results = repro.run_all(jobs, workers)
    runs = {name: [(results[str(d)], repro.read_heldout(d)) for spec, _, d in jobs
                   if spec.name == name] for name in SETTINGS}
    clusters = (decisive.prompt_clusters(args.tiny)
                + decisive.prompt_clusters(args.tiny, "countdown_fresh"))
    summary = {"plan": "docs/results.md, Holding a target entropy",
               "model_sha256": repro.check_model(args.tiny, "countdown")["countdown"],
               # the arms as run ("settings" is the analysis' measures per setting, below)
               "arms": {name: {**loss, "seeds": list(args.seeds)}
                        for name, loss in SETTINGS.items()},
               "lr": pilot["lr"], "target_entropy": pilot["target_entropy"],
               "plateau_step": pilot["plateau_step"], "steps": args.steps,
               "endpoint_steps": list(endpoint_steps(args.steps)), "pilot": pilot,
               **analyze(runs, args.steps, clusters)}
    summary["seconds_this_invocation"] = round(time.time() - started, 1)
    out = Path(args.out)
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    plots.plot_target(runs, summary, out / "target.png")
    if args.export:
        export(Path(args.export), out, jobs, summary)
    for label, r in summary["primary"].items():
        print(f"{label} {r['setting']} - {r['against']} {r['measure']}: {r['mean']:+.4f} "
              f"t95 [{r['t95'][0]:+.3f}, {r['t95'][1]:+.3f}] clustered [{r['clustered95'][0]:+.3f},"
              f" {r['clustered95'][1]:+.3f}] {r['above']}/{r['below']} p {r['p']:.4f} "
              f"Holm {r['p_holm']:.4f}")
    return 0


def parse_args(argv):
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("stage", choices=("pilot", "main", "analyze"))
    parser.add_argument("--tiny", default="runs/tiny", help="the tiny build (with --countdown)")
    parser.add_argument("--out", default="runs/target")
    parser.add_argument("--seeds", nargs="+", type=int, default=list(range(16)))
    parser.add_argument("--steps", type=int, default=300,
                        help="the pilot's budget T (main and analyze take pilot.json's)")
    parser.add_argument("--workers", type=int, default=None, help="default: CPU cores")
    parser.add_argument("--export", default=None, help="analyze: where runs.jsonl.gz goes")
    args = parser.parse_args(argv)
    if args.steps < 100 or args.steps % EVAL_EVERY:
        parser.error(f"--steps must be >= 100 and a multiple of {EVAL_EVERY}")
    if len(args.seeds) < 2 or len(set(args.seeds)) != len(args.seeds) or len(args.seeds) > 20:
        parser.error("--seeds: 2 to 20 distinct seeds (the exact test enumerates 2^seeds)")
    if set(args.seeds) & set(PILOT_SEEDS):
        parser.error(f"--seeds: the pilot's seeds {PILOT_SEEDS} are not reused")
    return args


def main(argv):
    from tools import tiny

    args = parse_args(argv)
    tiny.build_tiny_countdown(args.tiny)  # reused when complete
    repro.check_model(args.tiny, "countdown")
    workers = args.workers or max(1, min(len(os.sched_getaffinity(0)), 8))
    if args.stage == "pilot":
        return run_pilot(args, workers)
    return run_main(args, workers, analyze_only=args.stage == "analyze")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
