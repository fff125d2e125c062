"""tools/decisive.py: the decisive comparison on the countdown task, run and analysed as planned in
docs/results.md ("A decisive comparison"), before any run.

    python -m tools.tiny --out runs/tiny --countdown
    python -m tools.decisive --tiny runs/tiny --out runs/decisive

SETTINGS over --seeds (paired: a seed fixes the prompt order and the held-out samples' seeds for
every setting), each through tools/repro.py's train_run: GRPO for --grpo-steps (the pilot that
decides the comparison's step, and the baseline), the others for --steps. Every 25 steps 64 samples
per prompt of split A (countdown_test), with per-prompt correct counts kept; split B
(countdown_fresh) every 100 steps. A run that is complete is not rerun, so an interrupted
invocation resumes where it stopped (an unfinished run from its last resume point).

The analysis (analyze), under --out:
  summary.json   the plateau decision, the primary tests (H1-H6: paired pass@1 on split A at the
                 comparison step, exact sign-flip p, Holm, t and clustered-bootstrap intervals), the
                 secondary measures (pass@k on A and B, entropy, distinct-correct) and the frontier
                 (pass@k where both settings of a pair first reach the same pass@1), per seed.
  frontier.png   seed means: pass@1 against the step, pass@8 and pass@64 against pass@1 along the
                 trajectories, training entropy.
"""

import argparse
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

import data
from tools import plots, repro, stats

# name -> loss settings (method + LossConfig fields; stare_w is the gate's w), fixed by the plan
SETTINGS = {
    "grpo": dict(method="grpo"),
    "stare_w1.22": dict(method="stare", stare_variant="O1", stare_w=1.22, stare_top_ratio=0.05),
    "stare_w4": dict(method="stare", stare_variant="O1", stare_w=4.0, stare_top_ratio=0.05),
    "entropy_bonus": dict(method="entropy_bonus", entropy_coef=0.02),
    "steer": dict(method="steer"),
    "w_reinforce": dict(method="w_reinforce"),
}
# the primary family: (name, setting, its pair), tested together under Holm
HYPOTHESES = [
    ("H1", "stare_w1.22", "grpo"), ("H2", "stare_w4", "grpo"), ("H3", "entropy_bonus", "grpo"),
    ("H4", "steer", "grpo"), ("H5", "w_reinforce", "grpo"), ("H6", "stare_w4", "entropy_bonus")]
PASS1 = "heldout/pass@1"  # the unbiased pass@1 of n samples per prompt: avg@n


def ks_of(n):
    """The k of the secondary measures and the frontier: 8 and n (64 in the plan)."""
    return sorted({min(8, n), n})


def secondary_keys(n):
    return ([f"heldout/pass@{k}" for k in ks_of(n)] + ["fresh/pass@1"]
            + [f"fresh/pass@{k}" for k in ks_of(n)] + ["heldout/distinct_correct_frac"])


def plan_jobs(args):
    """(RunSpec, tiny directory, run directory) for every setting and seed, seed by seed (an early
    stop leaves whole seeds)."""
    jobs = []
    for seed in args.seeds:
        for name, loss in SETTINGS.items():
            spec = repro.RunSpec(
                name, loss, seed=seed, steps=args.grpo_steps if name == "grpo" else args.steps,
                prompts_per_step=args.prompts_per_step, target_entropy=0.2, lr=3e-4, predict_ps=(),
                task="countdown", eval_every=args.eval_every, eval_n=args.eval_n,
                fresh_every=args.fresh_every)
            jobs.append((spec, args.tiny, Path(args.out) / f"{name}_seed{seed}"))
    return jobs


# --------------------------------------------------------------------------------------------------
# The analysis
# --------------------------------------------------------------------------------------------------


def plateau_step(grpo_runs, window=200, gain=0.01):
    """The first evaluation step s after which GRPO's seed-mean pass@1 on split A gains less than
    `gain` over the next `window` steps (end point against start point), or None when no evaluated
    s + window shows it."""
    steps = sorted(set.intersection(*(set(heldout) for _, heldout in grpo_runs)))
    mean = {s: statistics.fmean(heldout[s][PASS1] for _, heldout in grpo_runs) for s in steps}
    for s in steps:
        if s + window in mean and mean[s + window] - mean[s] < gain:
            return s
    return None


def paired(values, baseline):
    """Per-seed differences -> mean, t interval, exact sign-flip p, seeds above / below zero."""
    differences = [v - b for v, b in zip(values, baseline)]
    mean, low, high = stats.t_interval(differences)
    return {"mean": mean, "t95": [low, high], "p_sign_flip": stats.sign_flip_p(differences),
            "above": sum(d > 0 for d in differences), "below": sum(d < 0 for d in differences),
            "per_seed": differences}


def entropy_until(records, step):
    """Mean training entropy over the steps up to `step` (steps without an update skipped)."""
    values = [r["train/entropy"] for r in records[:step] if "train/entropy" in r]
    return statistics.fmean(values) if values else math.nan


def frontier_pair(seeds_x, seeds_y, k):
    """pass@k of two settings where each seed's run first reaches the same pass@1 on split A, along
    every run's whole trajectory (GRPO's is longer: matched by pass@1, not by step). The level is
    the highest that every run of both reaches. -> {level, per seed x and y, the evaluation step at
    which each first reached it, paired difference, informative}; informative is False when the
    level does not exceed the shared starting pass@1 (some run never rose above its start: the
    pairs would then match at step 0, trivially equal)."""
    def trajectory(heldout):
        steps = sorted(heldout)
        return (steps, [heldout[s][PASS1] for s in steps],
                [heldout[s][f"heldout/pass@{k}"] for s in steps])

    paths_x = [trajectory(h) for _, h in seeds_x]
    paths_y = [trajectory(h) for _, h in seeds_y]
    level = min(max(xs) for _, xs, _ in paths_x + paths_y)
    start = max(xs[0] for _, xs, _ in paths_x + paths_y)

    def reached(path):
        steps, xs, _ = path
        return next(step for step, x in zip(steps, xs) if x >= level)

    at_x = [stats.value_at_level(xs, ys, level) for _, xs, ys in paths_x]
    at_y = [stats.value_at_level(xs, ys, level) for _, xs, ys in paths_y]
    return {"level": level, "informative": level > start, "x": at_x, "y": at_y,
            "step_x": [reached(path) for path in paths_x],
            "step_y": [reached(path) for path in paths_y], **paired(at_x, at_y)}


def prompt_clusters(tiny_dir, split="countdown_test"):
    """Each held-out prompt's digit triple, in the split's order (the clusters of the bootstrap)."""
    examples = data.load_examples(Path(tiny_dir) / "data" / f"{split}.jsonl", prompt_suffix=None)
    return [e.ground_truth.split("=")[0] for e in examples]


def analyze(runs, steps, clusters, n=64, resamples=4000):
    """runs: {setting: [(metrics records, held-out records by step) per seed]} -> the summary
    (module docstring), for n samples per held-out prompt. The comparison step: GRPO's plateau
    rounded up to 100 (at least 100: step 0 is the untrained model), capped at `steps`."""
    for name, seeds in runs.items():
        for _, heldout in seeds:
            if len(heldout[0]["heldout/correct"]) != len(clusters):
                raise ValueError(f"{name}: {len(heldout[0]['heldout/correct'])} held-out prompts, "
                                 f"{len(clusters)} clusters")
    plateau = plateau_step(runs["grpo"])
    wanted = None if plateau is None else max(100, math.ceil(plateau / 100) * 100)
    step = steps if wanted is None else min(wanted, steps)
    summary = {"plateau": {"first_step": plateau, "rule": "seed-mean pass@1 on A gains < 0.01 "
                           "over the next 200 steps", "wanted_step": wanted, "compared_at": step,
                           "capped_by_budget": wanted is None or wanted > steps},
               "grpo_pass1_by_step": {
                   s: statistics.fmean(h[s][PASS1] for _, h in runs["grpo"])
                   for s in sorted(set.intersection(*(set(h) for _, h in runs["grpo"])))}}

    def at(name, key):
        return [heldout[step][key] for _, heldout in runs[name]]

    primary = []
    for label, x, y in HYPOTHESES:
        result = {"setting": x, "against": y, **paired(at(x, PASS1), at(y, PASS1))}
        per_prompt = [[(cx - cy) / n for cx, cy in zip(hx[step]["heldout/correct"],
                                                        hy[step]["heldout/correct"])]
                      for (_, hx), (_, hy) in zip(runs[x], runs[y])]
        mean, low, high, se = stats.clustered_bootstrap(per_prompt, clusters, resamples)
        result["bootstrap95"] = [low, high]
        result["bootstrap_se"] = se
        primary.append((label, result))
    adjusted = stats.holm([result["p_sign_flip"] for _, result in primary])
    for (_, result), p in zip(primary, adjusted):
        result["p_holm"] = p
        result["rejected_at_0.05"] = p <= 0.05
    summary["primary"] = dict(primary)

    summary["settings"] = {}
    for name, seeds in runs.items():
        entry = {"entropy_mean": [entropy_until(records, step) for records, _ in seeds]}
        for key in (PASS1, *secondary_keys(n)):
            entry[key] = [math.nan if v is None else v for v in at(name, key)]
        described = {}
        for key, values in entry.items():
            mean, se = plots.mean_and_se(values)
            described[key] = {"mean": mean, "se": se, "per_seed": values}
            if name != "grpo":
                base = summary["settings"]["grpo"][key]["per_seed"]
                pairs = [(v, b) for v, b in zip(values, base)
                         if not (math.isnan(v) or math.isnan(b))]
                if len(pairs) >= 2:
                    described[key]["minus_grpo"] = paired(*zip(*pairs))
        summary["settings"][name] = described
    summary["frontier"] = {
        f"{x}_vs_{y}": {f"pass@{k}": frontier_pair(runs[x], runs[y], k)
                        for k in ks_of(n)}
        for _, x, y in HYPOTHESES}
    return summary


def print_report(summary, n):
    """The primary table and the secondary one, as Markdown rows."""
    where = summary["plateau"]
    print(f"GRPO plateau rule: first step {where['first_step']}, wanted {where['wanted_step']}, "
          f"compared at step {where['compared_at']} "
          f"(capped by budget: {where['capped_by_budget']})")
    print("| | setting − against | pass@1 difference | t 95% | bootstrap 95% | above/below "
          "| p exact | p Holm |")
    print("|---|---|---|---|---|---|---|---|")
    for label, r in summary["primary"].items():
        print(f"| {label} | {r['setting']} − {r['against']} | {r['mean']:+.4f} | "
              f"[{r['t95'][0]:+.3f}, {r['t95'][1]:+.3f}] | [{r['bootstrap95'][0]:+.3f}, "
              f"{r['bootstrap95'][1]:+.3f}] | {r['above']}/{r['below']} | {r['p_sign_flip']:.4f} "
              f"| {r['p_holm']:.4f} |")
    keys = ["entropy_mean", PASS1, *secondary_keys(n)]
    print("| setting | " + " | ".join(keys) + " |")
    print("|---|" + "---|" * len(keys))
    for name, described in summary["settings"].items():
        cells = []
        for key in keys:
            entry = described[key]
            cell = f"{entry['mean']:.3f}"
            if "minus_grpo" in entry:
                diff = entry["minus_grpo"]
                cell += f" ({diff['mean']:+.3f} [{diff['t95'][0]:+.3f}, {diff['t95'][1]:+.3f}])"
            cells.append(cell)
        print(f"| {name} | " + " | ".join(cells) + " |")
    print("| pair | k | level | difference at matched pass@1 | t 95% | above/below |")
    print("|---|---|---|---|---|---|")
    for pair, by_k in summary["frontier"].items():
        for k, r in by_k.items():
            level = f"{r['level']:.3f}" + ("" if r["informative"] else " (start)")
            print(f"| {pair} | {k} | {level} | {r['mean']:+.3f} | "
                  f"[{r['t95'][0]:+.3f}, {r['t95'][1]:+.3f}] | {r['above']}/{r['below']} |")


def parse_args(argv):
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", default="runs/tiny", help="the tiny build (with --countdown)")
    parser.add_argument("--out", default="runs/decisive")
    parser.add_argument("--seeds", nargs="+", type=int, default=list(range(8)))
    parser.add_argument("--steps", type=int, default=200, help="the other settings' steps")
    parser.add_argument("--grpo-steps", type=int, default=400,
                        help="GRPO's steps: the pilot that finds its plateau (>= --steps)")
    parser.add_argument("--eval-every", type=int, default=25)
    parser.add_argument("--fresh-every", type=int, default=100,
                        help="split B's evaluations (a multiple of --eval-every)")
    parser.add_argument("--eval-n", type=int, default=64, help="samples per held-out prompt")
    parser.add_argument("--prompts-per-step", type=int, default=16)
    parser.add_argument("--workers", type=int, default=None, help="default: CPU cores")
    parser.add_argument("--analyze-only", action="store_true",
                        help="analyse complete runs only; fail, naming them, if any is missing")
    parser.add_argument("--resamples", type=int, default=4000, help="bootstrap resamples")
    args = parser.parse_args(argv)
    if args.eval_n < 1 or args.prompts_per_step < 1:
        parser.error("--eval-n and --prompts-per-step must be >= 1")
    if len(args.seeds) < 2 or len(set(args.seeds)) != len(args.seeds):
        parser.error("--seeds: at least two distinct seeds (paired tests)")
    if not 1 <= args.steps <= args.grpo_steps:
        parser.error("--steps must be >= 1 and <= --grpo-steps")
    if args.eval_every < 1 or args.fresh_every % args.eval_every or args.steps % args.fresh_every:
        parser.error("--fresh-every must be a multiple of --eval-every, and --steps of "
                     "--fresh-every")
    if args.steps >= 100 and (100 % args.eval_every or 100 % args.fresh_every):
        parser.error("--eval-every and --fresh-every must divide 100: the comparison step is a "
                     "multiple of 100 and both splits must be evaluated there")
    if len(args.seeds) > 20:
        parser.error("--seeds: at most 20 (the exact test enumerates 2^seeds sign patterns)")
    return args


def main(argv):
    from tools import tiny

    args = parse_args(argv)
    tiny.build_tiny(args.tiny)
    tiny.build_tiny_countdown(args.tiny)  # each reused when complete
    sha = repro.check_model(args.tiny, "countdown")
    jobs = plan_jobs(args)
    workers = args.workers or max(1, min(len(os.sched_getaffinity(0)), 8))
    print(f"decisive comparison: {len(jobs)} runs ({len(SETTINGS)} settings x {len(args.seeds)} "
          f"seeds), {workers} at a time, under {args.out}", file=sys.stderr)
    started = time.time()
    if args.analyze_only:  # e.g. beside a running invocation: read, never start, runs
        missing = [str(job[2]) for job in jobs if not repro.is_complete(*job)]
        if missing:
            raise SystemExit(f"--analyze-only: {len(missing)} runs are not complete: "
                             + ", ".join(missing))
    results = repro.run_all(jobs, workers)
    runs = {name: [(results[str(out_dir)], repro.read_heldout(out_dir))
                   for spec, _, out_dir in jobs if spec.name == name] for name in SETTINGS}
    summary = {"arguments": {**vars(args), "tiny": str(args.tiny), "out": str(args.out)},
               "model_sha256": sha,
               **analyze(runs, args.steps, prompt_clusters(args.tiny), args.eval_n, args.resamples)}
    summary["run_seconds"] = {name: [round(sum(r["time/step"] for r in records), 1)
                                     for records, _ in seeds] for name, seeds in runs.items()}
    summary["seconds_this_invocation"] = round(time.time() - started, 1)
    out = Path(args.out)
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    plots.plot_frontier(runs, summary, ks_of(args.eval_n), out / "frontier.png")
    print_report(summary, args.eval_n)
    print(f"starting model sha256 {sha}; {summary['seconds_this_invocation']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
