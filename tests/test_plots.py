"""tools/plots.py on hand-written metrics.jsonl files with train.py's keys: which figures appear,
what the entropy panel draws (curve, gate-on markers, target region), missing keys, several runs, a
run still writing its last line."""

import json

import matplotlib.image
import pytest

import config
from tools import plots

QUADRANTS = ("pos_high", "pos_low", "neg_high", "neg_low")


def record(step, with_stare=True, with_eval=False):
    """One metrics.jsonl line shaped like train.py's (a subset of its keys, with plausible values)."""
    entropy = 0.40 - 0.01 * step
    r = {
        "step": step,
        "rollout/acc": 0.2 + 0.01 * step,
        "rollout/reward_mean": 0.2 + 0.01 * step,
        "rollout/response_length_mean": 12.0 + step,
        "rollout/truncated_frac": 0.05,
        "rollout/reflection_per_1k_words": 3.0 + 0.1 * step,
        "train/entropy": entropy,
        "train/surprisal": entropy + 0.1,
        "train/loss": 0.01,
        "train/touched_frac": 0.05 if with_stare else 0.0,
        "stare/gate_on": float(entropy < 0.3),
        "stare/w": 1.1,
        "stare/m": 0.9,
        "time/step": 2.0,
    }
    if with_stare:
        r.update({"stare/pos_selected_frac": 0.05, "stare/neg_selected_frac": 0.0})
    for i, q in enumerate(QUADRANTS):
        r[f"stare/dynamics/{q}/frac"] = 0.25
        r[f"stare/dynamics/{q}/dH"] = (-1) ** i * 1e-3 * step
    r["stare/dynamics/total/dH"] = 1e-4 * step
    if with_eval:
        r.update({"eval/aime24/avg@n": 0.1 + 0.01 * step, "eval/aime24/avg@n_se": 0.02,
                  "eval/overall/avg@n": 0.1 + 0.01 * step, "eval/overall/pass@1": 0.1})
    return r


def write_run(directory, records, target=None, tail="", method="stare"):
    directory.mkdir(parents=True)
    (directory / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records) + tail)
    if target is not None:  # as train.py writes it
        (directory / "config.yaml").write_text(config.to_yaml(config.load(
            "configs/tiny.yaml", [f"gate.target_entropy={target}", f"algorithm.method={method}"])))
    return directory


def assert_png(path):
    image = matplotlib.image.imread(path)
    assert image.ndim == 3 and image.shape[0] > 200 and image.shape[1] > 200


def test_two_runs_give_every_figure(tmp_path, monkeypatch):
    stare_run = write_run(
        tmp_path / "stare", [record(s, with_eval=s % 5 == 0) for s in range(1, 16)], target=0.3)
    # GRPO-ds: no selection keys, a target that no gate uses (no region of its own), and a
    # half-written last line (still running)
    grpo_run = write_run(
        tmp_path / "grpo", [record(s, with_stare=False) for s in range(1, 11)], target=0.5,
        tail='{"step": 11, "rollout/a', method="grpo")
    drawn = {}
    real_finish = plots._finish

    def capture(fig, axes, path):
        drawn[path.stem] = axes
        return real_finish(fig, axes, path)

    monkeypatch.setattr(plots, "_finish", capture)
    assert plots.main([str(stare_run), str(grpo_run), "--out", str(tmp_path / "figs")]) == 0
    names = sorted(p.stem for p in (tmp_path / "figs").glob("*.png"))
    assert names == ["accuracy", "dynamics", "entropy", "eval", "length", "selection"]
    for path in (tmp_path / "figs").glob("*.png"):
        assert_png(path)

    entropy_ax = drawn["entropy"][0]
    lines = {line.get_label(): line for line in entropy_ax.get_lines()}
    assert list(lines["stare"].get_xdata()) == list(range(1, 16))
    assert list(lines["stare"].get_ydata()) == pytest.approx(
        [0.40 - 0.01 * s for s in range(1, 16)])
    assert list(lines["grpo"].get_xdata()) == list(range(1, 11))  # the partial line 11 was skipped
    gate_markers = [line for line in entropy_ax.get_lines() if line.get_linestyle() == "None"
                    and len(line.get_xdata()) > 0]
    # entropy 0.40 - 0.01 s < 0.3 from step 11 on: only the STARE run gets there
    assert [list(m.get_xdata()) for m in gate_markers] == [list(range(11, 16))]
    spans = [p for p in entropy_ax.patches]  # the gate region of the one positive target
    assert len(spans) == 1 and spans[0].get_extents().height > 0
    assert [ax.get_title().split(":")[0] for ax in drawn["dynamics"]] == [
        "pos_high", "pos_low", "neg_high", "neg_low", "total"]
    pos_high = [line for line in drawn["dynamics"][0].get_lines() if line.get_label() == "stare"][0]
    assert list(pos_high.get_ydata()) == pytest.approx([1e-3 * s for s in range(1, 16)])
    assert [ax.get_title() for ax in drawn["eval"]] == ["aime24", "overall"]
    for ax in drawn["accuracy"] + drawn["length"]:
        assert ax.get_xlabel() == "training step" and ax.get_ylabel()


def test_missing_keys_are_skipped(tmp_path):
    run = write_run(
        tmp_path / "minimal",
        [{"step": s, "rollout/acc": 0.1 * s, "train/loss": float("nan")} for s in range(1, 5)])
    written = plots.plot_runs([run], tmp_path / "figs")
    assert [p.name for p in written] == ["accuracy.png"]
    assert_png(written[0])
    nothing = write_run(tmp_path / "nothing", [{"step": 1, "other/key": 1.0}])
    assert plots.plot_runs([nothing], tmp_path / "figs2") == []


def test_series_keeps_finite_numbers_and_falls_back_to_the_next_key():
    records = [
        {"step": 1, "a": 1.0}, {"step": 2, "a": float("nan")}, {"step": 3}, {"step": 4, "a": True},
        {"step": 5, "a": 2}, {"step": 6, "b": 7.0}]
    assert plots.series(records, ("a",)) == ([1, 5], [1.0, 2])
    assert plots.series(records, ("missing", "b")) == ([6], [7.0])
    assert plots.series(records, ("missing",)) == ([], [])


def test_reading_errors_and_labels(tmp_path, monkeypatch):
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "metrics.jsonl").write_text('{"step": 1}\nnot json\n{"step": 3}\n')
    with pytest.raises(ValueError, match=r"metrics\.jsonl:2: invalid JSON"):
        plots.read_metrics(bad / "metrics.jsonl")
    assert plots.main([str(tmp_path / "absent"), "--out", str(tmp_path / "f")]) == 1
    with pytest.raises(ValueError, match="2 labels for 1 runs"):
        plots.plot_runs([bad], tmp_path / "f", labels=["a", "b"])
    # two runs with the same directory name are told apart by their paths
    a = write_run(tmp_path / "x" / "run", [record(1)], target=0.3)
    b = write_run(tmp_path / "y" / "run", [record(1)], target=0.3)
    assert (
        plots.target_entropy(a / "config.yaml") == 0.3
        and plots.target_entropy(tmp_path / "none.yaml") is None)
    (tmp_path / "old.yaml").write_text("algorithm:\n  target_entropy: 0.2\n")  # before the rename
    assert plots.target_entropy(tmp_path / "old.yaml") == 0.2
    labels = {}
    real_finish = plots._finish

    def capture(fig, axes, path):
        labels[path.stem] = axes[0].get_legend_handles_labels()[1]
        return real_finish(fig, axes, path)

    monkeypatch.setattr(plots, "_finish", capture)
    plots.plot_runs([a, b], tmp_path / "figs")
    assert labels["accuracy"] == [str(a), str(b)]
    plots.plot_runs([a, b], tmp_path / "figs", labels=["STARE", "GRPO"])
    assert labels["accuracy"] == ["STARE", "GRPO"]


def test_values_that_cannot_be_plotted_are_reported_with_their_file(tmp_path, capsys):
    run = write_run(
        tmp_path / "run", [record(1), {**record(2), "train/entropy": "n/a"}], target=0.3)
    records = plots.read_metrics(run / "metrics.jsonl")
    assert len(records) == 2
    note = capsys.readouterr().err
    assert (
        f"{run / 'metrics.jsonl'}: 'train/entropy' is not a number on 1 line(s) (line 2: 'n/a')"
        in note)
    (run / "config.yaml").write_text("algorithm: [target_entropy\n")
    assert plots.main([str(run), "--out", str(tmp_path / "figs")]) == 1
    assert f"{run / 'config.yaml'}: not valid YAML" in capsys.readouterr().err
    (run / "config.yaml").write_text("- a list\n")
    with pytest.raises(ValueError, match="config.yaml: expected a mapping"):
        plots.target_entropy(run / "config.yaml")


def test_non_finite_values_and_rows_without_a_step_are_noted(tmp_path, capsys):
    lines = [json.dumps(record(1)), json.dumps({**record(2), "train/entropy": float("nan")}),
             json.dumps({**record(3), "rollout/acc": float("inf")}),
             json.dumps({"rollout/acc": 0.5}), json.dumps(record(4))]
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text("\n".join(lines) + "\n")  # json.dumps writes NaN
    records = plots.read_metrics(run / "metrics.jsonl")
    assert len(records) == 5
    note = capsys.readouterr().err
    assert (f"note: {run / 'metrics.jsonl'}: 'train/entropy' is not finite on 1 line(s) (line 2: "
            f"nan); those values are not plotted") in note
    assert "'rollout/acc' is not finite on 1 line(s) (line 3: inf)" in note
    assert (f"note: {run / 'metrics.jsonl'}: 1 line(s) have no numeric 'step' (line 4); nothing "
            f"of them is plotted") in note
    # and indeed they are not: the series keeps the finite values with a step
    steps, values = plots.series(records, ["rollout/acc"])
    assert steps == [1, 2, 4] and values == pytest.approx([0.21, 0.22, 0.24])
