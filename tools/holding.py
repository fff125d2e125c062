"""tools/holding.py: STARE holding a target entropy against GRPO (and EntroPIC, if a variant holds
it), in a setting screened for breaks first: the plan is docs/data/holding/PLAN.md, committed
before any of its runs; this file implements it.

    python -m tools.tiny --out runs/tiny --countdown
    python -m tools.holding --tiny runs/tiny --out runs/holding screen   # then checks, main
    python -m tools.holding --tiny runs/tiny --out runs/holding analyze --export docs/data/holding

screen   GRPO at SETTING over SCREEN_SEEDS; accepted with no break (BREAK_STEPS), else FALLBACK
         over FALLBACK_SEEDS; from the accepted setting's runs: the plateau rule, the target
         entropy and the number of seeds for the main runs -> screen.json.
checks   STARE at each of STARE_WS and the EntroPIC variants over CHECK_SEEDS: STARE's W is the
         smallest that holds the band on both seeds; EntroPIC is an arm only if a variant does
         -> checks.json.
main     the arms over seeds 0..n-1 (n from the screen).
analyze  the primary family, the secondary measures and the figure once every run is complete;
         --export writes the screen's, the checks' and the main runs' records and summary.json.

A complete run is not rerun: an interrupted stage resumes (an unfinished run from its last
resume point, tools/repro.py RESUME_EVERY).
"""

import argparse
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

import evaluate
from tools import decisive, plots, repro, stats, target_compare

# the candidate setting: the miniature's loop refills a short batch (one more round of 16 prompts),
# makes no update from fewer than 2 varied groups, and leaves the answer (~14 tokens) 10 tokens of
# slack; the fallback, screened only if the candidate breaks: a lower lr and up to 3 refills
SETTING = {"lr": 6e-4, "steps": 450, "max_tokens": 24, "refill_rounds": 1, "min_kept_groups": 2}
FALLBACK = {**SETTING, "lr": 4e-4, "refill_rounds": 3}
SCREEN_SEEDS = tuple(range(300, 312))
FALLBACK_SEEDS = tuple(range(312, 324))
CHECK_SEEDS = (400, 401)
BREAK_STEPS = 25  # a break: this many steps in a row at training accuracy 0, or without an update
TARGET_FRACTION = 0.6  # of GRPO's entropy over steps 1-10
HOLD_BAND = 0.3  # held: mean entropy over the last third within +-30% of the target
STARE = {"method": "stare", "stare_variant": "O1", "stare_top_ratio": 0.05}
STARE_WS = (4.0, 8.0)
# deviations from the reference (docs/method.md, Eq. 26), at the gains the last study's rule chose
ENTROPIC_VARIANTS = {
    "entropic_crossing": {"method": "entropic", "entropic_kp": 10.0, "entropic_ki": 0.1,
                          "entropic_start": "crossing"},
    "entropic_crossing_antiwindup": {"method": "entropic", "entropic_kp": 10.0,
                                     "entropic_ki": 0.1, "entropic_start": "crossing",
                                     "entropic_anti_windup": True}}
DELTA, MIN_PAIRED_SD, POWER, MIN_SEEDS, MAX_SEEDS = 0.08, 0.12, 0.8, 12, 28
NON_INFERIORITY_MARGIN = 0.03  # pass@1
KEEP = ("step", "train/entropy", "stare/gate_on", "entropic/coef", "entropic/integral",
        "entropic/error", "rollout/acc_before_filter", "train/kept_groups", "rollout/gen_rounds",
        "rollout/varied_group_frac", "train/zero_signal_steps", "rollout/distinct_correct_frac",
        "train/touched_frac", "rollout/response_length_mean", "rollout/truncated_frac")


def spec_for(name, loss, seed, setting, target):
    return repro.RunSpec(
        name, loss, seed=seed, steps=setting["steps"], prompts_per_step=16,
        target_entropy=target, lr=setting["lr"], predict_ps=(), task="countdown",
        eval_every=target_compare.EVAL_EVERY, eval_n=target_compare.CURVE_N,
        endpoint_steps=(0, *target_compare.endpoint_steps(setting["steps"])),
        endpoint_n=target_compare.ENDPOINT_N, refill_rounds=setting["refill_rounds"],
        min_kept_groups=setting["min_kept_groups"], max_tokens=setting["max_tokens"])


def break_step(records):
    """The step at which a run is broken (BREAK_STEPS in a row at training accuracy 0 or without
    an update), or None."""
    run = 0
    for record in records:
        dead = record["rollout/acc_before_filter"] == 0 or "train/entropy" not in record
        run = run + 1 if dead else 0
        if run == BREAK_STEPS:
            return record["step"]
    return None


def last_third_entropy(records, steps):
    return target_compare.mean_entropy(records, steps - steps // 3 + 1, steps)


def holds(records, steps, target):
    return abs(last_third_entropy(records, steps) - target) <= HOLD_BAND * target


def t_test_power(sd, delta, n, alpha, sims=20000, seed=0):
    """Power of the two-sided paired t-test at level alpha for n differences ~ N(delta, sd^2)."""
    rng = np.random.default_rng(seed)
    d = rng.normal(delta, sd, (sims, n))
    t = d.mean(1) / (d.std(1, ddof=1) / math.sqrt(n))
    return float(np.mean(np.abs(t) >= stats.t_quantile(1 - alpha / 2, n - 1)))


def t_test(differences, margin=None):
    """Paired t-test of the per-seed differences: two-sided when margin is None, else one-sided
    non-inferiority (H0: mean <= -margin)."""
    n = len(differences)
    mean, low, high = stats.t_interval(differences)
    se = statistics.stdev(differences) / math.sqrt(n)
    if margin is None:
        p = 2 * (1 - stats.t_cdf(abs(mean) / se, n - 1))
    else:
        p = 1 - stats.t_cdf((mean + margin) / se, n - 1)
    return {"mean": mean, "t95": [low, high], "p": p, "n": n, "margin": margin,
            "above": sum(d > 0 for d in differences), "below": sum(d < 0 for d in differences),
            "per_seed": differences}


def load(jobs):
    """[(spec, tiny, dir)] after repro.run_all -> {dir: (records, held-out by step)}."""
    results = repro.run_all(jobs, WORKERS)
    return {str(d): (results[str(d)], repro.read_heldout(d)) for _, _, d in jobs}


# --------------------------------------------------------------------------------------------------
# The stages
# --------------------------------------------------------------------------------------------------


def family_size(checks=None):
    return 3 if checks and checks.get("entropic") else 2


def screen_setting(args, name, setting, seeds):
    out = Path(args.out) / "screen"
    jobs = [(spec_for("grpo", {"method": "grpo"}, seed, setting, 0.2), args.tiny,
             out / f"{name}_seed{seed}") for seed in seeds]
    runs = load(jobs)
    steps = setting["steps"]
    breaks = {str(spec.seed): break_step(runs[str(d)][0]) for spec, _, d in jobs}
    pairs = list(runs.values())
    row = target_compare.pilot_row(pairs, steps)
    result = {"setting": setting, "seeds": list(seeds), "breaks": breaks,
              "broken": sum(b is not None for b in breaks.values()), "plateau_rule": row,
              "runs": [d.name for _, _, d in jobs]}
    endpoint = {k: [target_compare.endpoint_value(h, steps, k) for _, h in pairs] for k in (1, 16)}
    result["endpoint"] = endpoint
    result["step0"] = {k: [step0_value(h, k) for _, h in pairs] for k in (1, 16)}
    return result


def step0_value(heldout, k):
    """The base model's pass@k on A u B (ENDPOINT_N samples per prompt at step 0)."""
    counts = heldout[0]["endpoint"]["A"]["heldout/correct"] + heldout[0]["endpoint"]["B"][
        "heldout/correct"]
    return statistics.fmean(evaluate.pass_at_k(target_compare.ENDPOINT_N, c, k) for c in counts)


def run_screen(args):
    screens = [screen_setting(args, "S1", SETTING, SCREEN_SEEDS)]
    if screens[0]["broken"]:
        screens.append(screen_setting(args, "S2", FALLBACK, FALLBACK_SEEDS))
    screen = {"candidates": screens}
    accepted = next((s for s in screens if not s["broken"]), None)
    if accepted is None:
        screen["accepted"] = None
        write(args, "screen.json", screen)
        print("no setting passed the screen: the plan stops here", file=sys.stderr)
        return 1
    pairs_sd = {}
    for k in (1, 16):
        sd = statistics.stdev(accepted["endpoint"][k])
        pairs_sd[k] = {"between_seed_sd": sd, "paired_sd": math.sqrt(2) * sd,
                       "df": len(accepted["seeds"]) - 1}
    planning_sd = max(pairs_sd[16]["paired_sd"], MIN_PAIRED_SD)
    target = TARGET_FRACTION * accepted["plateau_rule"]["entropy_start"]
    powers = {}
    for m in (2, 3):  # the family without and with an EntroPIC arm (Holm's first step: alpha/m)
        powers[m] = {n: t_test_power(planning_sd, DELTA, n, 0.05 / m)
                     for n in range(MIN_SEEDS, MAX_SEEDS + 1)}
    seeds = {m: next((n for n, p in powers[m].items() if p >= POWER), MAX_SEEDS) for m in powers}
    screen.update(accepted=accepted["setting"], target_entropy=target, spread=pairs_sd,
                  planning_sd=planning_sd, power=powers, seeds=seeds)
    write(args, "screen.json", screen)
    print(json.dumps({key: screen[key] for key in ("accepted", "target_entropy", "planning_sd",
                                                   "seeds")}, indent=1))
    return 0


def run_checks(args):
    screen = read(args, "screen.json")
    setting, target = screen["accepted"], screen["target_entropy"]
    out, steps = Path(args.out) / "checks", setting["steps"]
    arms = {f"stare_w{w:g}": {**STARE, "stare_w": w} for w in STARE_WS}
    arms.update(ENTROPIC_VARIANTS)
    jobs = [(spec_for(name, loss, seed, setting, target), args.tiny, out / f"{name}_seed{seed}")
            for name, loss in arms.items() for seed in CHECK_SEEDS]
    runs = load(jobs)
    held = {name: {str(spec.seed): last_third_entropy(runs[str(d)][0], steps)
                   for spec, _, d in jobs if spec.name == name} for name in arms}
    inside = {name: all(abs(h - target) <= HOLD_BAND * target for h in seeds.values())
              for name, seeds in held.items()}
    w = next((w for w in STARE_WS if inside[f"stare_w{w:g}"]), STARE_WS[-1])
    entropic = next((name for name in ENTROPIC_VARIANTS if inside[name]), None)
    checks = {"target_entropy": target, "band": [(1 - HOLD_BAND) * target,
                                                 (1 + HOLD_BAND) * target],
              "last_third_entropy": held, "held": inside, "stare_w": w,
              "stare_held": inside[f"stare_w{w:g}"], "entropic": entropic,
              "seeds": screen["seeds"][str(family_size({"entropic": entropic}))],
              "runs": [d.name for _, _, d in jobs]}
    write(args, "checks.json", checks)
    print(json.dumps({k: checks[k] for k in ("held", "stare_w", "entropic", "seeds")}, indent=1))
    return 0


def arms_of(checks):
    arms = {"grpo": {"method": "grpo"}, "stare": {**STARE, "stare_w": checks["stare_w"]}}
    if checks["entropic"]:
        arms["entropic"] = ENTROPIC_VARIANTS[checks["entropic"]]
    return arms


def main_jobs(args, screen, checks):
    setting, target = screen["accepted"], screen["target_entropy"]
    return [(spec_for(name, loss, seed, setting, target), args.tiny,
             Path(args.out) / "main" / f"{name}_seed{seed}")
            for seed in range(checks["seeds"]) for name, loss in arms_of(checks).items()]


def analyze(runs, steps, target, clusters, resamples=4000):
    """runs: {arm: [(records, held-out by step) per seed]}, seeds aligned -> the primary family
    (paired t-tests, Holm) and the pre-registered secondary measures."""
    value = {name: {k: [target_compare.endpoint_value(h, steps, k) for _, h in seeds]
                    for k in (1, 16)} for name, seeds in runs.items()}
    family = [("H1", "stare", "grpo", 16, None), ("H2", "stare", "grpo", 1,
                                                   NON_INFERIORITY_MARGIN)]
    if "entropic" in runs:
        family.append(("H3", "stare", "entropic", 16, None))
    primary = {}
    for label, x, y, k, margin in family:
        differences = [a - b for a, b in zip(value[x][k], value[y][k])]
        result = {"setting": x, "against": y, "measure": f"pass@{k}",
                  "endpoint_means": [statistics.fmean(value[x][k]), statistics.fmean(value[y][k])],
                  **t_test(differences, margin)}
        rows = [[a - b for a, b in zip(target_compare.per_prompt_endpoint(hx, steps, k),
                                       target_compare.per_prompt_endpoint(hy, steps, k))]
                for (_, hx), (_, hy) in zip(runs[x], runs[y])]
        result["clustered95"] = list(stats.clustered_bootstrap(rows, clusters, resamples)[1:3])
        primary[label] = result
    for result, p in zip(primary.values(), stats.holm([r["p"] for r in primary.values()])):
        result["p_holm"], result["rejected_at_0.05"] = p, p <= 0.05
    breaks = {name: [break_step(r) for r, _ in seeds] for name, seeds in runs.items()}
    secondary = {
        "breaks": breaks,
        "broken": {name: sum(b is not None for b in b_) for name, b_ in breaks.items()},
        "last_third_entropy": {name: [last_third_entropy(r, steps) for r, _ in seeds]
                               for name, seeds in runs.items()},
        "in_band": {name: sum(holds(r, steps, target) for r, _ in seeds)
                    for name, seeds in runs.items()},
        "step0": {k: [step0_value(h, k) for _, h in runs["grpo"]] for k in (1, 16)},
        "endpoint": value}
    clean = [i for i in range(len(runs["grpo"]))
             if breaks["grpo"][i] is None and breaks["stare"][i] is None]
    if len(clean) >= 2:
        secondary["H1_unbroken_pairs"] = t_test(
            [value["stare"][16][i] - value["grpo"][16][i] for i in clean])
    if "entropic" in runs:
        secondary["entropic_coef_by_50_steps"] = [
            statistics.fmean(statistics.fmean(r[s].get("entropic/coef", 0.0)
                                              for s in range(b, min(b + 50, steps)))
                             for r, _ in runs["entropic"]) for b in range(0, steps, 50)]
    return {"primary": primary, "secondary": secondary}


def run_main(args, analyze_only):
    screen, checks = read(args, "screen.json"), read(args, "checks.json")
    jobs = main_jobs(args, screen, checks)
    arms = arms_of(checks)
    if analyze_only:
        done = sum(repro.is_complete(*job) for job in jobs)
        print(f"{done}/{len(jobs)} runs complete", file=sys.stderr)
        if done < len(jobs):
            print("the tests wait for every run (the plan)", file=sys.stderr)
            return 0
    started = time.time()
    loaded = load(jobs)
    runs = {name: [loaded[str(d)] for spec, _, d in jobs if spec.name == name] for name in arms}
    steps, target = screen["accepted"]["steps"], screen["target_entropy"]
    clusters = (decisive.prompt_clusters(args.tiny)
                + decisive.prompt_clusters(args.tiny, "countdown_fresh"))
    summary = {"plan": "docs/data/holding/PLAN.md",
               "model_sha256": repro.check_model(args.tiny, "countdown")["countdown"],
               "setting": screen["accepted"], "target_entropy": target, "steps": steps,
               "endpoint_steps": list(target_compare.endpoint_steps(steps)),
               "arms": {name: {**loss, "seeds": list(range(checks["seeds"]))}
                        for name, loss in arms.items()},
               "screen": screen, "checks": checks, **analyze(runs, steps, target, clusters)}
    summary["seconds_this_invocation"] = round(time.time() - started, 1)
    out = Path(args.out)
    write(args, "summary.json", summary)
    plots.plot_target(runs, summary, out / "holding.png")
    if args.export:
        export(Path(args.export), out, jobs)
    for label, r in summary["primary"].items():
        print(f"{label} {r['setting']} - {r['against']} {r['measure']}: {r['mean']:+.4f} "
              f"t95 [{r['t95'][0]:+.3f}, {r['t95'][1]:+.3f}] {r['above']}/{r['below']} "
              f"p {r['p']:.4f} Holm {r['p_holm']:.4f}")
    return 0


def export(path, out, jobs):
    """Under path: screen_runs.jsonl.gz, checks_runs.jsonl.gz, runs.jsonl.gz (every run's spec,
    per-step record and per-prompt evaluation counts) and the stages' JSON files."""
    path.mkdir(parents=True, exist_ok=True)
    for stage in ("screen", "checks"):
        if not (out / f"{stage}.json").exists():
            continue
        record = json.loads((out / f"{stage}.json").read_text())
        names = (record["runs"] if stage == "checks"
                 else [r for c in record["candidates"] for r in c["runs"]])
        target_compare.write_runs(path / f"{stage}_runs.jsonl.gz",
                                  [out / stage / name for name in names], KEEP)
    if jobs:
        target_compare.write_runs(path / "runs.jsonl.gz", [Path(d) for _, _, d in jobs], KEEP)
    for name in ("screen.json", "checks.json", "summary.json"):
        if (out / name).exists():
            (path / name).write_text((out / name).read_text())


def write(args, name, record):
    (Path(args.out) / name).write_text(json.dumps(record, indent=1))


def read(args, name):
    path = Path(args.out) / name
    if not path.exists():
        raise SystemExit(f"{path} is missing: run the stage that writes it first")
    record = json.loads(path.read_text())
    if name == "screen.json" and record.get("accepted") is None:
        raise SystemExit(f"{path}: no setting passed the screen")
    return record


WORKERS = 2


def main(argv):
    global WORKERS
    from tools import tiny

    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("stage", choices=("screen", "checks", "main", "analyze", "export"))
    parser.add_argument("--tiny", default="runs/tiny", help="the tiny build (with --countdown)")
    parser.add_argument("--out", default="runs/holding")
    parser.add_argument("--workers", type=int, default=None, help="default: CPU cores")
    parser.add_argument("--export", default=None, help="where the stages' data go")
    args = parser.parse_args(argv)
    tiny.build_tiny_countdown(args.tiny)  # reused when complete
    repro.check_model(args.tiny, "countdown")
    WORKERS = args.workers or max(1, min(len(os.sched_getaffinity(0)), 8))
    Path(args.out).mkdir(parents=True, exist_ok=True)
    if args.stage == "export":  # the stages done so far, before the main runs
        export(Path(args.export), Path(args.out), [])
        return 0
    stage = {"screen": run_screen, "checks": run_checks}.get(args.stage)
    if stage:
        return stage(args)
    return run_main(args, analyze_only=args.stage == "analyze")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
