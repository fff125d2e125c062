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
                  config.yaml, where STARE reweights (none for target <= 0); dots mark the steps with
                  stare/gate_on = 1. Below it, train/surprisal (the mean -log pi of the sampled tokens: a different
                  quantity, kept in its own panel).
  accuracy.png    rollout/acc_before_filter (every sampled response), rollout/acc and rollout/reward_mean (the kept
                  groups), rollout/distinct_correct_frac (distinct correct answers / correct answers per group).
  length.png      rollout/response_length_mean (tokens), rollout/truncated_frac, and
                  rollout/reflection_per_1k_words (evaluate.reflection_counts pooled over the rollouts).
  dynamics.png    stare/dynamics/<quadrant>/dH for pos_high, pos_low, neg_high, neg_low and total: the predicted
                  first-order entropy change of the update per unit learning rate (stare.entropy_dynamics).
  selection.png   stare/pos_selected_frac (L+), stare/neg_selected_frac (L-) and train/touched_frac (tokens
                  whose loss differs from GRPO's); train/<key> is read where a run logs the selection there.
  eval.png        eval/<benchmark>/avg@n for every benchmark and overall, with ±1 bootstrap SE bars when
                  eval/<benchmark>/avg@n_se is logged.
"""

import argparse
import json
import math
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
    ("total", "total: all tokens"),
)

# figure -> (title, [(keys tried in order, panel title, y label)])
FIGURES = {
    "accuracy": (
        "Training rollouts: accuracy and reward",
        [
            (
                ("rollout/acc_before_filter", "rollout/acc"),
                "accuracy of all sampled responses (before dynamic sampling's filter)",
                "fraction correct",
            ),
            (
                ("rollout/acc",),
                "accuracy of the kept groups (the training batch)",
                "fraction correct",
            ),
            (
                ("rollout/reward_mean",),
                "reward of the kept groups (rollout/reward_mean)",
                "mean reward per response",
            ),
            (
                ("rollout/distinct_correct_frac",),
                "diversity of correct answers (distinct / correct, per group)",
                "fraction",
            ),
        ],
    ),
    "length": (
        "Training rollouts: length and reflection",
        [
            (("rollout/response_length_mean",), "response length", "tokens per response"),
            (("rollout/truncated_frac",), "truncated at max_tokens", "fraction of responses"),
            (
                ("rollout/reflection_per_1k_words",),
                "reflection words",
                "occurrences per 1000 words",
            ),
        ],
    ),
    "dynamics": (
        "Predicted first-order entropy change of each update, by quadrant (s0: critical surprisal)",
        [
            ((f"stare/dynamics/{q}/dH",), title, "predicted ΔH per unit lr (nats)")
            for q, title in QUADRANTS
        ],
    ),
    "selection": (
        "Token selection",
        [
            (
                ("stare/pos_selected_frac", "train/pos_selected_frac"),
                "L+ selected (A > 0, high surprisal)",
                "fraction of valid tokens",
            ),
            (
                ("stare/neg_selected_frac", "train/neg_selected_frac"),
                "L- selected (A < 0, high surprisal)",
                "fraction of valid tokens",
            ),
            (
                ("train/touched_frac",),
                "tokens whose loss differs from GRPO",
                "fraction of valid tokens",
            ),
        ],
    ),
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
    records, non_numeric = [], {}
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
        records.append(record)
    for key, found in non_numeric.items():  # said, not silently dropped
        number, value = found[0]
        print(
            f"note: {path}: {key!r} is not a number on {len(found)} line(s) (line {number}: {value!r}); "
            f"those values are not plotted",
            file=sys.stderr,
        )
    return records


def target_entropy(config_path):
    """gate.target_entropy from a run's config.yaml, or None (no file, or no such key)."""
    import yaml

    if not Path(config_path).is_file():
        return None
    try:
        config = yaml.safe_load(Path(config_path).read_text()) or {}
    except yaml.YAMLError as error:
        raise ValueError(f"{config_path}: not valid YAML ({error})") from None
    if not isinstance(config, dict) or not isinstance(config.get("algorithm") or {}, dict):
        raise ValueError(
            f"{config_path}: expected a mapping of sections with an 'algorithm' mapping"
        )
    value = (config.get("algorithm") or {}).get("target_entropy")
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def load_run(path):
    """-> (default label, records, target entropy or None) of a run directory or a metrics.jsonl file."""
    path = Path(path)
    metrics = path / "metrics.jsonl" if path.is_dir() else path
    if not metrics.is_file():
        raise ValueError(f"{path}: no metrics.jsonl")
    label = (
        metrics.parent.name if path.is_dir() or metrics.name == "metrics.jsonl" else metrics.stem
    )
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
        "Policy entropy and surprisal of the training rollouts",
    )
    panels = iter(axes)
    if has_entropy:
        ax = next(panels)
        targets = sorted(
            {run["target"] for run in runs if run["target"] is not None and run["target"] > 0}
        )
        for target in targets:
            ax.axhspan(
                0, target, color="0.5", alpha=0.10, lw=0, label="gate region: entropy < target"
            )
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
                    [],
                    [],
                    ls="none",
                    marker="o",
                    ms=3.5,
                    color="white",
                    markeredgecolor="black",
                    markeredgewidth=0.4,
                    label="step with the gate on",
                )
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
        ["overall"] if "overall" in names else []
    )
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


def main(argv):
    parser = argparse.ArgumentParser(
        description="Plot metrics.jsonl of one or more runs (see the docstring)."
    )
    parser.add_argument(
        "runs", nargs="+", help="run directories (with metrics.jsonl) or metrics.jsonl files"
    )
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
