"""tools/plots.py: figures from one or more runs' metrics.jsonl, runs overlaid, one PNG per topic.

    python -m tools.plots runs/tiny-stare --out figs/
    python -m tools.plots runs/stare runs/grpo --labels STARE GRPO --out figs/     # two runs in every panel

A run is a train.out_dir (metrics.jsonl and, for the entropy target, config.yaml next to it) or a
metrics.jsonl path. Each figure is written only if at least one run has one of its keys, and each
panel only if some run has its key, so runs of other methods, old runs and runs without evaluation
simply give fewer panels. A run's label is its directory name (--labels overrides). A half-written
last line (a run still going) is skipped.

Figures (x axis: the training step, train.py's "step")
  entropy.png     train/entropy with the gate's region shaded: below gate.target_entropy of the run's
                  config.yaml, where STARE reweights (not for other methods); dots mark steps with
                  stare/gate_on = 1. Below it, train/surprisal (the mean -log pi of the sampled tokens: a different
                  quantity, kept in its own panel).
  accuracy.png    rollout/acc_before_filter (every sampled response), rollout/acc and rollout/reward_mean (the kept
                  groups), rollout/distinct_correct_frac (distinct correct answers / correct answers per group).
  length.png      rollout/response_length_mean (tokens), rollout/truncated_frac, and
                  rollout/reflection_per_1k_words (rewards.reflection_counts pooled over the rollouts).
  dynamics.png    stare/dynamics/<quadrant>/dH for pos_high, pos_low, neg_high, neg_low and total: the predicted
                  first-order entropy change of the update per unit learning rate (stare.entropy_dynamics).
  selection.png   stare/pos_selected_frac (L+), stare/neg_selected_frac (L-) and train/touched_frac (tokens
                  whose loss differs from GRPO's); train/<key> is read where a run logs the selection there.
  eval.png        eval/<benchmark>/avg@n for every benchmark and overall, with ±1 bootstrap SE bars when
                  eval/<benchmark>/avg@n_se is logged.

The reproduction in miniature's figures (compare.png, sweep.png, payoff.png) are drawn here too, by
plot_compare, plot_sweep and plot_payoff, from what tools/repro.py gathers over seeds, and the
decisive comparison's frontier.png by plot_frontier (tools/decisive.py).
"""

import argparse
import json
import math
import statistics
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only: no display needed (CI, GPU nodes)
import matplotlib.pyplot as plt  # noqa: E402  (after the backend is chosen)

QUADRANTS = (
    ("pos_high", "pos_high: A > 0, surprisal ≥ s0"),
    ("pos_low", "pos_low: A > 0, surprisal < s0"),
    ("neg_high", "neg_high: A < 0, surprisal ≥ s0"),
    ("neg_low", "neg_low: A < 0, surprisal < s0"),
    ("total", "total: all tokens"))

# figure -> (title, [(keys tried in order, panel title, y label)])
FIGURES = {
    "accuracy": (
        "Training rollouts: accuracy and reward",
        [
            (
                ("rollout/acc_before_filter", "rollout/acc"),
                "accuracy of all sampled responses (before dynamic sampling's filter)",
                "fraction correct"),
            (
                ("rollout/acc",), "accuracy of the kept groups (the training batch)",
                "fraction correct"),
            (
                ("rollout/reward_mean",), "reward of the kept groups (rollout/reward_mean)",
                "mean reward per response"),
            (
                ("rollout/distinct_correct_frac",),
                "diversity of correct answers (distinct / correct, per group)", "fraction")]),
    "length": (
        "Training rollouts: length and reflection",
        [
            (("rollout/response_length_mean",), "response length", "tokens per response"),
            (("rollout/truncated_frac",), "truncated at max_tokens", "fraction of responses"),
            (
                ("rollout/reflection_per_1k_words",), "reflection words",
                "occurrences per 1000 words")]),
    "dynamics": (
        "Predicted first-order entropy change of each update, by quadrant (s0: critical surprisal)",
        [
            ((f"stare/dynamics/{q}/dH",), title, "predicted ΔH per unit lr (nats)")
            for q, title in QUADRANTS]),
    "selection": (
        "Token selection",
        [
            (
                ("stare/pos_selected_frac", "train/pos_selected_frac"),
                "L+ selected (A > 0, high surprisal)", "fraction of valid tokens"),
            (
                ("stare/neg_selected_frac", "train/neg_selected_frac"),
                "L- selected (A < 0, high surprisal)", "fraction of valid tokens"),
            (
                ("train/touched_frac",), "tokens whose loss differs from GRPO",
                "fraction of valid tokens")]),
}


# --------------------------------------------------------------------------------------------------
# reading runs
# --------------------------------------------------------------------------------------------------


def read_metrics(path):
    """The records of a metrics.jsonl, in file order. A bad line is a ValueError naming file:line,
    except a half-written last line (a run still writing), which is skipped."""
    path = Path(path)
    lines = path.read_text(encoding="utf-8").split("\n")
    while lines and not lines[-1].strip():
        lines.pop()
    records, non_numeric, non_finite, stepless = [], {}, {}, []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as error:
            if number == len(lines):
                print(f"note: {path}:{number}: incomplete last line skipped", file=sys.stderr)
                break
            raise ValueError(f"{path}:{number}: invalid JSON ({error.msg})") from None
        if not isinstance(record, dict):
            raise ValueError(f"{path}:{number}: expected a JSON object")
        for key, value in record.items():
            if not isinstance(value, (int, float)) or isinstance(value, bool):
                non_numeric.setdefault(key, []).append((number, value))
            elif not math.isfinite(value):  # NaN, Infinity: valid to json, not drawn
                non_finite.setdefault(key, []).append((number, value))
        if not isinstance(record.get("step"), (int, float)) or isinstance(record["step"], bool):
            stepless.append(number)
        records.append(record)
    for key, found in non_numeric.items():  # said, not silently dropped
        number, value = found[0]
        print(
            f"note: {path}: {key!r} is not a number on {len(found)} line(s) (line {number}: {value!r}); "
            f"those values are not plotted",
            file=sys.stderr)
    for key, found in non_finite.items():
        number, value = found[0]
        print(f"note: {path}: {key!r} is not finite on {len(found)} line(s) (line {number}: "
              f"{value}); those values are not plotted", file=sys.stderr)
    if stepless:
        print(f"note: {path}: {len(stepless)} line(s) have no numeric 'step' (line {stepless[0]}); "
              f"nothing of them is plotted", file=sys.stderr)
    return records


def target_entropy(config_path):
    """gate.target_entropy of a STARE run's config.yaml; None for another method, no file or no
    such key."""
    import yaml

    if not Path(config_path).is_file():
        return None
    try:
        config = yaml.safe_load(Path(config_path).read_text()) or {}
    except yaml.YAMLError as error:
        raise ValueError(f"{config_path}: not valid YAML ({error})") from None
    # runs saved before the key moved to the gate section have it under algorithm
    sections = [config.get(name) or {} for name in ("gate", "algorithm")] if isinstance(
        config, dict) else [None]
    if not all(isinstance(section, dict) for section in sections):
        raise ValueError(f"{config_path}: expected a mapping of sections with mappings 'gate' "
                         f"and 'algorithm'")
    value = next((s["target_entropy"] for s in sections if "target_entropy" in s), None)
    if sections[1].get("method", "stare") != "stare":  # the gate acts in STARE runs only
        return None
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def load_run(path):
    """-> (default label, records, target entropy or None) of a run directory or a metrics.jsonl file."""
    path = Path(path)
    metrics = path / "metrics.jsonl" if path.is_dir() else path
    if not metrics.is_file():
        raise ValueError(f"{path}: no metrics.jsonl")
    label = (
        metrics.parent.name if path.is_dir() or metrics.name == "metrics.jsonl" else metrics.stem)
    return label, read_metrics(metrics), target_entropy(metrics.parent / "config.yaml")


def series(records, keys):
    """(steps, values) of the first key in `keys` that the records have; finite numbers only; ([], []) if none."""
    for key in keys:
        points = [(r["step"], r[key]) for r in records
                  if isinstance(r.get(key), (int, float)) and not isinstance(r.get(key), bool)
                  and math.isfinite(r[key]) and "step" in r]
        if points:
            return [p[0] for p in points], [p[1] for p in points]
    return [], []


# --------------------------------------------------------------------------------------------------
# drawing
# --------------------------------------------------------------------------------------------------


def _grid(count, title):
    """A figure with `count` panels (up to 3 per row), constrained layout; unused axes removed."""
    cols = min(3, count)
    rows = math.ceil(count / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.6 * cols, 3.4 * rows + 0.6), squeeze=False,
                             layout="constrained")
    axes = axes.ravel()
    for ax in axes[count:]:
        ax.remove()
    fig.suptitle(title)
    return fig, list(axes[:count])


def _finish(fig, axes, path):
    """One legend for the whole figure (below the panels, never over a curve or the title), then save."""
    handles, labels = {}, []
    for ax in axes:
        ax.set_xlabel("training step")
        ax.grid(alpha=0.3)
        for handle, label in zip(*ax.get_legend_handles_labels()):
            if label not in handles:
                handles[label] = handle
                labels.append(label)
    if labels:
        fig.legend([handles[label] for label in labels], labels, loc="outside lower center",
                   ncols=min(len(labels), 4), frameon=False)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_panels(runs, name, title, panels, out_dir):
    """A figure of the panels that some run has; None if no run has any of them."""
    present = [(keys, panel_title, ylabel) for keys, panel_title, ylabel in panels
               if any(series(run["records"], keys)[0] for run in runs)]
    if not present:
        return None
    fig, axes = _grid(len(present), title)
    for ax, (keys, panel_title, ylabel) in zip(axes, present):
        for run in runs:
            steps, values = series(run["records"], keys)
            if steps:
                ax.plot(steps, values, color=run["color"], label=run["label"], lw=1.4)
        if name == "dynamics":  # the sign is the message: + raises entropy, - lowers it
            ax.axhline(0, color="0.35", lw=0.8)
        ax.set_title(panel_title)
        ax.set_ylabel(ylabel)
    return _finish(fig, axes, Path(out_dir) / f"{name}.png")


def plot_entropy(runs, out_dir):
    """Entropy with the gate region and gate-on steps; surprisal below."""
    has_entropy = any(series(run["records"], ("train/entropy",))[0] for run in runs)
    has_surprisal = any(series(run["records"], ("train/surprisal",))[0] for run in runs)
    if not (has_entropy or has_surprisal):
        return None
    fig, axes = _grid(
        int(has_entropy) + int(has_surprisal),
        "Policy entropy and surprisal of the training rollouts")
    panels = iter(axes)
    if has_entropy:
        ax = next(panels)
        targets = sorted(
            {run["target"] for run in runs if run["target"] is not None and run["target"] > 0})
        for target in targets:
            ax.axhspan(
                0, target, color="0.5", alpha=0.10, lw=0, label="gate region: entropy < target")
            ax.axhline(target, color="0.35", ls="--", lw=1, label="target entropy")
        for run in runs:
            steps, values = series(run["records"], ("train/entropy",))
            ax.plot(steps, values, color=run["color"], label=run["label"], lw=1.4)
            gate_steps, gate = series(run["records"], ("stare/gate_on",))
            on = {step for step, value in zip(gate_steps, gate) if value > 0.5}
            marked = [(s, v) for s, v in zip(steps, values) if s in on]
            if marked:
                ax.plot(*zip(*marked), ls="none", marker="o", ms=3.5, color=run["color"],
                        markeredgecolor="black", markeredgewidth=0.4)
                ax.plot(
                    [], [], ls="none", marker="o", ms=3.5, color="white", markeredgecolor="black",
                    markeredgewidth=0.4, label="step with the gate on")
        ax.set_title("token entropy (train/entropy)")
        ax.set_ylabel("nats per token")
        ax.set_ylim(bottom=0)
    if has_surprisal:
        ax = next(panels)
        for run in runs:
            steps, values = series(run["records"], ("train/surprisal",))
            if steps:
                ax.plot(steps, values, color=run["color"], label=run["label"], lw=1.4)
        ax.set_title("surprisal of sampled tokens (train/surprisal)")
        ax.set_ylabel("nats per token")
    return _finish(fig, axes, Path(out_dir) / "entropy.png")


def plot_eval(runs, out_dir):
    """eval/<benchmark>/avg@n per benchmark (overall last), with ±1 SE bars where logged."""
    names = sorted({key.split("/")[1] for run in runs for r in run["records"] for key in r
                    if key.startswith("eval/") and key.endswith("/avg@n") and key.count("/") == 2})
    if not names:
        return None
    names = [name for name in names if name != "overall"] + (
        ["overall"] if "overall" in names else [])
    fig, axes = _grid(len(names), "Evaluation during training: avg@n (±1 bootstrap SE)")
    for ax, name in zip(axes, names):
        for run in runs:
            steps, values = series(run["records"], (f"eval/{name}/avg@n",))
            if not steps:
                continue
            errors = dict(zip(*series(run["records"], (f"eval/{name}/avg@n_se",))))
            ax.errorbar(steps, values, yerr=[errors.get(s, 0.0) for s in steps], color=run["color"],
                        label=run["label"], lw=1.4, marker="o", ms=3, capsize=2)
        ax.set_title(name)
        ax.set_ylabel("avg@n (fraction correct)")
    return _finish(fig, axes, Path(out_dir) / "eval.png")


def plot_runs(paths, out_dir, labels=None):
    """Write every figure that the runs have data for; returns the PNG paths written."""
    if labels is not None and len(labels) != len(paths):
        raise ValueError(f"{len(labels)} labels for {len(paths)} runs")
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    runs = []
    for i, path in enumerate(paths):
        label, records, target = load_run(path)
        runs.append({"label": labels[i] if labels else label, "records": records, "target": target,
                     "color": colors[i % len(colors)]})
    # same directory names: use the paths
    if not labels and len({run["label"] for run in runs}) < len(runs):
        for run, path in zip(runs, paths):
            run["label"] = str(path)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    written = [plot_entropy(runs, out_dir)]
    written += [
        plot_panels(runs, name, title, panels, out_dir) for name, (title, panels) in FIGURES.items()
    ]
    written.append(plot_eval(runs, out_dir))
    return [path for path in written if path is not None]


# --------------------------------------------------------------------------------------------------
# The reproduction in miniature's figures (tools/repro.py): seed mean +- SE over runs
# --------------------------------------------------------------------------------------------------


def mean_and_se(values):
    values = [v for v in values if not math.isnan(v)]
    if not values:
        return float("nan"), float("nan")
    se = statistics.stdev(values) / math.sqrt(len(values)) if len(values) > 1 else float("nan")
    return statistics.mean(values), se


def smoothed(values, window=10):
    """Trailing moving average that skips None."""
    out = []
    for i in range(len(values)):
        recent = [v for v in values[max(0, i - window + 1):i + 1] if v is not None]
        out.append(statistics.mean(recent) if recent else float("nan"))
    return out


def plot_compare(groups, target_entropy, path):
    """groups: {label: [records per seed]} -> one figure, three panels, seed mean +- SE, 10-step moving average."""
    panels = [
        ("train/entropy", "token entropy"),
        ("rollout/distinct_correct_frac", "distinct correct / correct"),
        ("rollout/acc_before_filter", "accuracy (all samples)")]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for (key, title), ax in zip(panels, axes):
        for label, runs in groups.items():
            touched = [r.get("train/touched_frac", 0.0) for records in runs for r in records]
            # e.g. STAPO at this scale: its curves are GRPO's
            if label != "grpo" and not any(touched):
                label += " (changed no token: = grpo)"
            curves = [smoothed([r.get(key) for r in records]) for records in runs]
            length = min(map(len, curves))
            steps = list(range(1, length + 1))
            columns = [[c[i] for c in curves] for i in range(length)]
            means, ses = zip(*[mean_and_se(col) for col in columns])
            ses = [0.0 if math.isnan(s) else s for s in ses]
            line, = ax.plot(steps, means, label=label, lw=1.4)
            ax.fill_between(
                steps, [m - s for m, s in zip(means, ses)], [m + s for m, s in zip(means, ses)],
                color=line.get_color(), alpha=0.2, lw=0)
        if key == "train/entropy":
            ax.axhline(target_entropy, color="gray", ls="--", lw=1, label="gate target")
        ax.set_title(title)
        ax.set_xlabel("step")
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_sweep(sweep, grpo, target_entropy, path):
    """sweep: {P: {W: group summary}}, grpo: group summary -> final entropy / distinct-correct / accuracy vs W."""
    panels = [
        ("entropy", "final token entropy"),
        ("distinct_correct_frac", "final distinct correct / correct"),
        ("acc_before_filter", "final accuracy")]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for (key, title), ax in zip(panels, axes):
        for top_ratio, by_w in sorted(sweep["runs"].items()):
            ws = sorted(by_w)
            means = [by_w[w][key]["mean"] for w in ws]
            ses = [by_w[w][key]["se"] if not math.isnan(by_w[w][key]["se"]) else 0.0 for w in ws]
            line = ax.errorbar(
                ws, means, yerr=ses, marker="o", ms=4, capsize=3,
                label=f"STARE O1, P = {top_ratio:g}")
            found = sweep["critical"][top_ratio]
            if key == "entropy" and found["measured"] is not None:
                ax.axvline(found["measured"], color=line[0].get_color(), ls=":", lw=1.2)
            if key == "entropy" and found["predicted"] is not None:
                ax.axvline(found["predicted"], color=line[0].get_color(), ls="-.", lw=1.2)
        mean, se = grpo[key]["mean"], grpo[key]["se"]
        se = 0.0 if math.isnan(se) else se
        ax.axhspan(mean - se, mean + se, color="black", alpha=0.15, lw=0)
        ax.axhline(mean, color="black", lw=1, label="GRPO (STARE off)")
        if key == "entropy":
            ax.axhline(target_entropy, color="gray", ls="--", lw=1, label="gate target")
            level = next(iter(sweep["critical"].values()))["entropy_level"]
            ax.axhline(level, color="gray", ls=":", lw=1, label="level defining W_c")
        ax.set_xscale("log")
        ws = sorted({w for by_w in sweep["runs"].values() for w in by_w})
        ax.set_xticks(ws, [f"{w:g}" for w in ws])
        ax.minorticks_off()
        ax.set_xlabel("W (weight on L+), log scale")
        ax.set_title(
            title
            + ("\n(dotted: measured W_c, dash-dot: first-order W_c)" if key == "entropy" else ""))
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_payoff(runs, summary, ks, steps, target_entropy, path):
    """Four panels, seed mean +- SE: training entropy per step; held-out pass@1 and pass@max(k) per
    evaluation; held-out pass@k against k at the end of training (and before it, the same model for
    every setting)."""
    fig, axes = plt.subplots(1, 4, figsize=(20, 4.2))
    for name, seeds in runs.items():
        curves = [smoothed([r.get("train/entropy") for r in records]) for records, _ in seeds]
        columns = [[c[i] for c in curves] for i in range(min(map(len, curves)))]
        means, ses = zip(*[mean_and_se(col) for col in columns])
        line, = axes[0].plot(range(1, len(means) + 1), means, label=name, lw=1.3)
        color = line.get_color()
        for ax, key in ((axes[1], "heldout/pass@1"), (axes[2], f"heldout/pass@{ks[-1]}")):
            eval_steps = sorted(seeds[0][1])
            stats = [mean_and_se([heldout[s][key] for _, heldout in seeds]) for s in eval_steps]
            ax.errorbar(
                eval_steps, [m for m, _ in stats],
                yerr=[0 if math.isnan(e) else e for _, e in stats], color=color, marker="o", ms=3,
                capsize=2, lw=1.2)
        final = [summary[name][f"heldout/pass@{k}"] for k in ks]
        axes[3].errorbar(
            ks, [f["mean"] for f in final],
            yerr=[0 if math.isnan(f["se"]) else f["se"] for f in final], color=color, marker="o",
            ms=3, capsize=2, lw=1.2, label=name)
    before = [
        statistics.mean(heldout[0][f"heldout/pass@{k}"] for _, heldout in next(iter(runs.values())))
        for k in ks]
    axes[3].plot(ks, before, color="gray", ls="--", lw=1, label="before training")
    axes[0].axhline(target_entropy, color="gray", ls="--", lw=1, label="gate target")
    axes[0].set(title="token entropy (training batches), log scale", xlabel="step", yscale="log")
    axes[1].set(title="held-out pass@1 (avg@n)", xlabel="step")
    axes[2].set(title=f"held-out pass@{ks[-1]}", xlabel="step")
    axes[3].set(title=f"held-out pass@k after {steps} steps", xlabel="k", xscale="log")
    axes[3].set_xticks(ks, [str(k) for k in ks])
    axes[3].minorticks_off()
    axes[0].legend(fontsize=8)
    axes[3].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_frontier(runs, summary, ks, path):
    """tools/decisive.py's figure, seed means: held-out pass@1 against the step (the comparison step
    marked); for each k, pass@k against pass@1 along the trajectories (a point per evaluation, the
    arrow of training from the shared start); training entropy per step."""
    step = summary["plateau"]["compared_at"]
    fig, axes = plt.subplots(1, 2 + len(ks), figsize=(5.2 * (2 + len(ks)), 4.4))

    def seed_means(seeds, key):
        eval_steps = sorted(set.intersection(*(set(heldout) for _, heldout in seeds)))
        return eval_steps, [statistics.fmean(heldout[s][key] for _, heldout in seeds)
                            for s in eval_steps]

    for name, seeds in runs.items():
        eval_steps, pass1 = seed_means(seeds, "heldout/pass@1")
        stats = [mean_and_se([heldout[s]["heldout/pass@1"] for _, heldout in seeds])
                 for s in eval_steps]
        line, = axes[0].plot(eval_steps, pass1, marker="o", ms=2.5, lw=1.3, label=name)
        color = line.get_color()
        axes[0].fill_between(eval_steps, [m - e for m, e in stats], [m + e for m, e in stats],
                             color=color, alpha=0.15, lw=0)
        for ax, k in zip(axes[1:], ks):
            _, pass_k = seed_means(seeds, f"heldout/pass@{k}")
            ax.plot(pass1, pass_k, marker="o", ms=2.5, lw=1.2, color=color, label=name)
            ax.plot(pass1[-1:], pass_k[-1:], marker="s", ms=6, color=color)
        curves = [smoothed([r.get("train/entropy") for r in records]) for records, _ in seeds]
        length = min(map(len, curves))
        axes[-1].plot(range(1, length + 1),
                      [statistics.fmean(c[i] for c in curves) for i in range(length)],
                      color=color, lw=1.2, label=name)
    axes[0].axvline(step, color="gray", ls=":", lw=1)
    axes[0].set(title="held-out pass@1 (split A), mean ± SE over seeds", xlabel="step")
    for ax, k in zip(axes[1:], ks):
        ax.set(title=f"pass@{k} against pass@1 along training (■: last evaluation)",
               xlabel="pass@1", ylabel=f"pass@{k}")
    axes[-1].axhline(0.2, color="gray", ls="--", lw=1, label="gate target")
    axes[-1].set(title="token entropy (training batches)", xlabel="step", yscale="log")
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_target(runs, summary, path):
    """tools/target_compare.py's figure, seed mean +- SE per setting: training entropy (the target
    dashed), STARE's gate-on fraction (10-step windows) and EntroPIC's coefficient per step, and
    pass@1 and pass@16 on split A along training (16 samples per prompt)."""
    fig, axes = plt.subplots(1, 5, figsize=(25, 4.2))

    def band(ax, xs, columns, label, **style):
        means, ses = zip(*[mean_and_se(col) for col in columns])
        line, = ax.plot(xs, means, lw=1.3, label=label, **style)
        ax.fill_between(xs, [m - e for m, e in zip(means, ses)],
                        [m + e for m, e in zip(means, ses)], color=line.get_color(), alpha=0.15,
                        lw=0)
        return line.get_color()

    for name, seeds in runs.items():
        steps = range(1, min(len(records) for records, _ in seeds) + 1)
        curves = [smoothed([r.get("train/entropy") for r in records]) for records, _ in seeds]
        color = band(axes[0], steps, [[c[i - 1] for c in curves] for i in steps], name)
        if name == "stare":  # per seed, the fraction of the last 10 steps with the gate on
            gates = [smoothed([r["stare/gate_on"] for r in records]) for records, _ in seeds]
            band(axes[1], steps, [[g[i - 1] for g in gates] for i in steps], name, color=color)
        if name == "entropic":
            band(axes[2], steps, [[records[i - 1].get("entropic/coef", math.nan)
                                   for records, _ in seeds] for i in steps], name, color=color)
        evaluated = sorted(set.intersection(*(set(heldout) for _, heldout in seeds)))
        for ax, key in ((axes[3], "heldout/pass@1"), (axes[4], "heldout/pass@16")):
            band(ax, evaluated, [[heldout[s][key] for _, heldout in seeds] for s in evaluated],
                 name, color=color, marker="o", ms=2.5)
    axes[0].axhline(summary["target_entropy"], color="gray", ls="--", lw=1, label="target")
    axes[0].set(title="token entropy (training batches)", xlabel="step", yscale="log")
    axes[1].set(title="STARE: gate on (fraction of the last 10 steps)", xlabel="step")
    axes[2].set(title="EntroPIC: controller coefficient α", xlabel="step")
    axes[3].set(title="pass@1 on split A (16 samples)", xlabel="step")
    axes[4].set(title="pass@16 on split A (16 samples: solved)", xlabel="step")
    for ax in axes[3:]:
        for step in summary["endpoint_steps"]:
            ax.axvline(step, color="gray", ls=":", lw=0.8)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv):
    parser = argparse.ArgumentParser(
        description="Plot metrics.jsonl of one or more runs (see the docstring).")
    parser.add_argument(
        "runs", nargs="+", help="run directories (with metrics.jsonl) or metrics.jsonl files")
    parser.add_argument("--out", default="figs", help="output directory for the PNG files")
    parser.add_argument("--labels", nargs="+", default=None, help="one legend label per run")
    args = parser.parse_args(argv)
    try:
        written = plot_runs(args.runs, args.out, args.labels)
    except (OSError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    for path in written:
        print(f"wrote {path}")
    if not written:
        print("nothing to plot: no known metric in these runs", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
