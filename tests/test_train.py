"""train.py end to end on the tiny default: real vLLM (CPU), FSDP2 on gloo, one and two torchrun ranks."""

import dataclasses
import getpass
import json
import math
import os
import pickle
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

import baselines
import checkpoints
import config
import forked
import rollout
import runs
import sandbox

REPO = Path(__file__).resolve().parents[1]


def train_args(tiny_dir, out_dir, *overrides):
    """train.py's arguments for a run of the tiny default."""
    base = [
        f"model.path={tiny_dir / 'model'}",
        f"data.train_files=[{tiny_dir / 'data' / 'sum_train.jsonl'}]",
        "eval.files=[]",
        f"train.out_dir={out_dir}",
        "train.total_steps=2",
        # above the tiny model's entropy: the gate is on, STARE reweights
        "gate.target_entropy=1.0"]
    return ["--config", "configs/tiny.yaml", *base, *overrides]


def train_env(nproc):
    return dict(
        os.environ, OMP_NUM_THREADS="1" if nproc > 1 else os.environ.get("OMP_NUM_THREADS", "2"))


def train_command(tiny_dir, out_dir, *overrides, nproc=1):
    """train.py on the tiny default in a fresh interpreter, under torchrun when nproc > 1
    (--standalone picks a free port) -> (argv, env)."""
    launcher = (
        [sys.executable]
        if nproc == 1
        else [
            sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
            str(nproc), "--log-dir", str(Path(out_dir).parent / "torchrun")])  # not in $TMPDIR
    return launcher + ["train.py", *train_args(tiny_dir, out_dir, *overrides)], train_env(nproc)


def run_train(tiny_dir, out_dir, *overrides, nproc=1, env=None):
    """train.py on the tiny default, forked with its imports made (tests/forked.py), on nproc
    ranks as torchrun starts them -> subprocess.CompletedProcess."""
    return forked.run(REPO / "train.py", train_args(tiny_dir, out_dir, *overrides),
                      env=train_env(nproc) if env is None else env, nproc=nproc)


def read_metrics(out_dir):
    return [json.loads(line) for line in (Path(out_dir) / "metrics.jsonl").read_text().splitlines()]


def check_finished(completed, out_dir, steps=2):
    assert completed.returncode == 0, completed.stdout[-2000:] + completed.stderr[-4000:]
    metrics = read_metrics(out_dir)
    # step 0: eval before training
    assert [m["step"] for m in metrics if m["step"] > 0] == list(range(1, steps + 1))
    for record in metrics:
        bad = {k: v for k, v in record.items() if isinstance(v, float) and not math.isfinite(v)}
        assert not bad, bad
    return metrics


@pytest.fixture(scope="session")  # once per worker: other modules may run between its tests
def default_run(tiny_dir, tmp_path_factory):
    """One run of the tiny default, 2 steps, a checkpoint after each: the starting point several
    tests share (each copies the directory before it changes anything) -> (its directory, its
    metrics)."""
    out = tmp_path_factory.mktemp("default") / "run"
    return out, check_finished(run_train(tiny_dir, out, "train.save_every=1"), out)


def copy_run(run_dir, to, steps=None):
    """A copy of a run's directory; with `steps`, as a run of that many steps would have left it:
    later checkpoints and metrics lines removed."""
    shutil.copytree(run_dir, to)
    if steps is not None:
        for checkpoint in checkpoints.list_checkpoints(to)[steps:]:
            shutil.rmtree(checkpoint)
        kept = [line for line in (to / "metrics.jsonl").read_text().splitlines()
                if json.loads(line)["step"] <= steps]
        (to / "metrics.jsonl").write_text("".join(line + "\n" for line in kept))
    return to


@pytest.fixture(scope="session")  # once per worker: other modules may run between its tests
def one_rank_gen16(tiny_dir, tmp_path_factory):
    """The tiny default on one rank with generation rounds of 16 prompts (dynamic sampling needs
    several rounds a step), the reference of the two-rank tests -> (directory, metrics)."""
    out = tmp_path_factory.mktemp("gen16") / "one"
    return out, check_finished(run_train(tiny_dir, out, "algorithm.gen_batch_size=16"), out)


# 8 prompts a step: every method's steps on two ranks, at half the tiny default's batch
SMALL_STEPS = ("train.train_batch_size=8", "train.mini_batch_size=8", "algorithm.gen_batch_size=16")


@pytest.fixture(scope="session")  # once per worker: other modules may run between its tests
def every_method(tiny_dir, tmp_path_factory):
    """tests/methods_two_ranks.py on two torchrun ranks: every allowed method x loss (and its
    VARIANTS), 2 steps each, the sync probed at every step on PPO-clip -> (each setting's steps'
    metrics, the run's directory with its HF export)."""
    out_dir = tmp_path_factory.mktemp("methods")
    _, *config_and_overrides = train_args(tiny_dir, out_dir / "run", "rollout.sync_check_every=1",
                                          *SMALL_STEPS)
    completed = forked.run(REPO / "tests" / "methods_two_ranks.py",
                           [out_dir / "metrics.json", *config_and_overrides],
                           env=train_env(2), nproc=2)
    assert completed.returncode == 0, completed.stdout[-2000:] + completed.stderr[-4000:]
    return json.loads((out_dir / "metrics.json").read_text()), out_dir / "run"


@pytest.mark.parametrize("method", baselines.METHODS)
def test_every_method_trains_end_to_end(method, every_method):
    """Each method's steps on two ranks through train.py's stages (one process pair for all:
    tests/methods_two_ranks.py)."""
    results, run_dir = every_method
    metrics = results[method]
    assert [m["step"] for m in metrics] == [1, 2]
    for record in metrics:
        bad = {k: v for k, v in record.items() if isinstance(v, float) and not math.isfinite(v)}
        assert not bad, bad
        # the engine holds the weights just trained
        assert record["rollout/sync_probe_error"] < 1e-4
        assert record["rollout/logprob_mismatch_max"] < 1e-3  # float32 sampler vs trainer
        assert 0 <= record["rollout/acc"] <= 1 and record["train/tokens"] > 0
        # some groups are right at this accuracy
        assert 0 < record["rollout/distinct_correct_frac"] <= 1
        assert record["stare/gate_on"] == 1.0
        # the probe's no-grad forward gathers FSDP2's root unit (embedding, final norm, LM head),
        # which only a backward would free: it must not stay gathered through the rollout
        assert record["gathered_parameters"] == []
    if method == "stare":
        assert metrics[0]["train/touched_frac"] > 0 and metrics[0]["stare/pos_selected_frac"] > 0
    if method == "grpo":
        assert all(record["train/touched_frac"] == 0 for record in metrics)
    if method == "entropic":  # the controller acts from step 1 (below the target: alpha < 0)
        assert all(m["entropic/coef"] < 0 and m["train/touched_frac"] > 0 for m in metrics)
        assert metrics[1]["entropic/integral"] == pytest.approx(
            metrics[0]["entropic/error"] + metrics[1]["entropic/error"], abs=3e-6)
    else:
        assert not any(key.startswith("entropic/") for key in metrics[0])
    exported = AutoModelForCausalLM.from_pretrained(run_dir / "hf", dtype=torch.float32)
    assert torch.isfinite(exported(input_ids=torch.tensor([[1, 2, 3]])).logits).all()


@pytest.mark.parametrize("policy_loss", [loss for loss in baselines.POLICY_LOSSES
                                         if loss != "ppo_clip"])
def test_every_method_trains_on_every_policy_loss_it_composes_with(policy_loss, every_method):
    # 2 steps of each allowed method on GSPO, CISPO and SAPO, finite gradients that move the
    # weights the engine then holds; the refused ones are refused
    results, _ = every_method
    for method in baselines.METHODS:
        name = f"{method}+{policy_loss}"
        if baselines.refused_combination(method, policy_loss):
            assert name not in results
            continue
        metrics = results[name]
        assert [m["step"] for m in metrics] == [1, 2], name
        for record in metrics:
            bad = {k: v for k, v in record.items()
                   if isinstance(v, float) and not math.isfinite(v)}
            assert not bad, (name, bad)
            assert record["train/grad_norm"] > 0 and record["train/skipped_updates"] == 0, name
            # the engine holds the weights just trained: the mean sampler/trainer gap
            assert record["rollout/logprob_mismatch_max"] < 1e-3, name


def test_two_ranks_match_one_and_export_loads(tiny_dir, tmp_path, one_rank_gen16):
    # generation rounds of 16 prompts for 16 varied groups: dynamic sampling needs several rounds
    # per step
    one_dir, one = one_rank_gen16
    two = check_finished(
        run_train(tiny_dir, tmp_path / "two", "algorithm.gen_batch_size=16", nproc=2),
        tmp_path / "two")
    # step scope + samples seeded by global prompt index: the first update is the same whatever the
    # world size
    for key in (
        "rollout/acc", "train/entropy", "train/loss", "train/grad_norm", "stare/pos_selected_frac"):
        assert two[0][key] == pytest.approx(one[0][key], rel=1e-4, abs=1e-7), key
    assert one[0]["rollout/gen_rounds"] == two[0]["rollout/gen_rounds"] >= 2
    # all-wrong groups were dropped
    assert one[0]["rollout/acc_before_filter"] < one[0]["rollout/acc"]
    positions = [
        torch.load(
            checkpoints.list_checkpoints(run)[-1] / "trainer.pt", weights_only=False
        )["data_position"]
        for run in (one_dir, tmp_path / "two")]
    assert positions[0] == positions[1] == 16 * sum(m["rollout/gen_rounds"] for m in one)
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "two" / "hf", dtype=torch.float32)
    initial = AutoModelForCausalLM.from_pretrained(tiny_dir / "model", dtype=torch.float32)
    changed = [
        name
        for name, p in exported.state_dict().items()
        if not torch.equal(p, initial.state_dict()[name])]
    assert len(changed) > len(exported.state_dict()) // 2  # training moved (almost) every weight


def test_two_ranks_sharing_one_tensor_parallel_engine_match_one_rank(tiny_dir, tmp_path,
                                                                     one_rank_gen16, request):
    # rollout.tensor_parallel_size=2 on 2 ranks: one engine, half of the weights and KV cache on
    # each rank; the ranks sample the same prompts with the same seeds, so the step equals the
    # one-rank step
    one_dir, one = one_rank_gen16
    host_tmp = private_tmp(request)
    shm_before = set(os.listdir("/dev/shm"))

    def run_tp(steps, torchrun):
        settings = ["algorithm.gen_batch_size=16", "rollout.tensor_parallel_size=2",
                    "hardware.gpus_per_node=2", "rollout.sync_check_every=1",
                    f"train.total_steps={steps}"]
        if torchrun:  # the README's two-rank command itself
            command, env = train_command(tiny_dir, tmp_path / "tp", *settings, nproc=2)
            completed = subprocess.run(command, cwd=REPO, env={**env, "TMPDIR": str(host_tmp)},
                                       capture_output=True, text=True, timeout=900)
        else:
            completed = run_train(tiny_dir, tmp_path / "tp", *settings, nproc=2,
                                  env={**train_env(2), "TMPDIR": str(host_tmp)})
        # nothing of the run's is left on the host but torch's compile cache, kept on purpose
        # (vLLM's sockets were in the temp directory, AVX-512 builds' segments in /dev/shm, named
        # after a constant before: the second run then failed on the first's)
        assert left_on_host(host_tmp) == []
        assert not [name for name in set(os.listdir("/dev/shm")) - shm_before
                    if name.startswith(rollout.HOST_TAG) or "cpushm" in name]
        return completed

    tp = check_finished(run_tp(2, torchrun=True), tmp_path / "tp")
    for key in (
        "rollout/acc", "rollout/acc_before_filter", "rollout/gen_rounds", "train/entropy",
        "train/loss", "train/grad_norm", "stare/pos_selected_frac"):
        assert tp[0][key] == pytest.approx(one[0][key], rel=1e-4, abs=1e-6), key
    for record in tp:
        # both halves of the engine hold the new weights
        assert record["rollout/sync_probe_error"] < 1e-4
    positions = [torch.load(checkpoints.list_checkpoints(run)[-1] / "trainer.pt",
                            weights_only=False)["data_position"] for run in (one_dir, tmp_path / "tp")]
    assert positions[0] == positions[1]  # each round's prompts were sampled once, not once per rank
    # a second tensor-parallel run on the same host: it resumes the first and adds a step
    assert check_finished(run_tp(3, torchrun=False), tmp_path / "tp", steps=3)[-1]["step"] == 3


def test_round_prompts_give_each_engine_its_share_once():
    import grpo

    for world, tp in ((1, 1), (4, 1), (4, 2), (8, 4), (8, 8)):
        shares = [grpo.round_prompts(32, 64, rank, world, tp) for rank in range(world)]
        for rank in range(world):
            assert shares[rank] == shares[rank - rank % tp]  # the ranks of one engine ask the same
        assert sorted(i for share in shares[::tp] for i in share) == list(range(32, 96))


def test_update_does_not_depend_on_micro_batch_size(tiny_dir, tmp_path, default_run):
    # step 1 of the default run (its loss and gradient come before any optimizer step, so the run's
    # length does not change them)
    big = default_run[1][-2:-1]
    small = check_finished(run_train(tiny_dir, tmp_path / "small", "train.total_steps=1",
                                     "train.micro_token_budget=256"), tmp_path / "small", steps=1)
    assert small[0]["train/micro_batches"] > big[0]["train/micro_batches"]
    for key in ("train/loss", "train/grad_norm", "stare/pos_selected_frac"):
        assert small[0][key] == pytest.approx(big[0][key], rel=1e-4, abs=1e-7), key


def test_config_errors_exit_before_writing(tmp_path):
    completed = subprocess.run([sys.executable, "train.py", "--config", "configs/tiny.yaml",
                                "algorithm.methd=grpo", f"train.out_dir={tmp_path / 'never'}"],
                               cwd=REPO, capture_output=True, text=True, timeout=120)
    assert completed.returncode == 2
    assert "did you mean 'algorithm.method'" in completed.stderr
    assert not (tmp_path / "never").exists()


def test_micro_scope_and_two_mini_batches_on_two_ranks(every_method):
    # the reference's per-micro-batch selection, two optimizer steps per training step, a small
    # token budget (methods_two_ranks.VARIANTS), in the every_method process pair
    metrics = every_method[0]["stare_micro_scope"]
    assert [m["step"] for m in metrics] == [1, 2]
    for record in metrics:
        assert record["rollout/sync_probe_error"] < 1e-4  # both optimizer steps reached the engine
        assert record["train/micro_batches"] >= 4 and record["train/skipped_updates"] == 0
        assert record["train/touched_frac"] > 0


def pop_probe(record):
    """The sync probe's metrics, removed from a step's record (a resumed run probes its first step,
    which the uninterrupted run may not have)."""
    return {key: record.pop(key) for key in list(record) if key.startswith("rollout/sync_probe")}


def comparable(metrics):
    """Per-step metrics without the wall-clock timings."""
    return [{k: v for k, v in record.items() if not k.startswith("time/")} for record in metrics]


def logged_steps(out_dir):
    path = Path(out_dir) / "metrics.jsonl"
    return path.read_text().count("\n") if path.exists() else 0


def wait_until(process, condition, timeout=600):
    deadline = time.time() + timeout
    while not condition():
        assert process.poll() is None, "the run ended before the condition was met"
        assert time.time() < deadline, "timed out"
        time.sleep(0.05)


def descendants(pid):
    """Every process below pid (torchrun starts its workers in sessions of their own: killing its group misses them)."""
    children = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            parent = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(parent, []).append(int(stat.parent.name))
    found, queue = [], [pid]
    while queue:
        below = children.get(queue.pop(), [])
        found += below
        queue += below
    return found


def dead(pid):
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except OSError:
        return True


def kill_tree(process):
    """SIGKILL a launcher (or a forked run's ranks) and everything it started, as a machine failure
    would; returns once all are dead."""
    victims = [pid for top in getattr(process, "pids", [process.pid])
               for pid in [top] + descendants(top)]
    for pid in victims:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    process.wait()
    deadline = time.time() + 60
    while not all(dead(pid) for pid in victims):
        assert time.time() < deadline, "processes survived SIGKILL"
        time.sleep(0.05)


def private_tmp(request):
    """A temp directory of a test's own, to see what runs leave there (short: vLLM makes sockets
    there), removed after the test."""
    host_tmp = Path(tempfile.mkdtemp(prefix="stare-test-"))
    request.addfinalizer(lambda: shutil.rmtree(host_tmp, ignore_errors=True))
    return host_tmp


def left_on_host(host_tmp):
    """What runs left in host_tmp, torch's compile cache (kept on purpose) aside."""
    return sorted(set(os.listdir(host_tmp)) - {f"torchinductor_{getpass.getuser()}"})


def test_killed_run_resumes_bit_exactly(tiny_dir, tmp_path, request):
    # everything a step reads from the past: a warm-up + cosine schedule, an adaptive gate, the sync
    # probe, evaluations
    steps = [
        "train.total_steps=4", "train.save_every=2", "train.keep_last=1", "optim.warmup_steps=3",
        "optim.schedule=cosine", "gate.adaptive=true", "gate.alpha=0.1",
        "rollout.sync_check_every=2", f"eval.files=[{tiny_dir / 'data' / 'sum_test.jsonl'}]",
        "eval.n=2", "eval.every=2", *SMALL_STEPS]
    full = check_finished(
        run_train(tiny_dir, tmp_path / "full", *steps, nproc=2), tmp_path / "full", 4)

    # the same run, killed (SIGKILL, every process) once step 2's checkpoint is written and step 3
    # is logged
    out = tmp_path / "killed"
    env = {**train_env(2), "TMPDIR": str(host_tmp := private_tmp(request))}
    process = forked.Forked(REPO / "train.py", train_args(tiny_dir, out, *steps), env, nproc=2)
    wait_until(
        process, lambda: (out / "checkpoints" / "step_00000002").exists() and logged_steps(out) >= 4
    )
    kill_tree(process)
    assert [p.name for p in (out / "checkpoints").iterdir()] == ["step_00000002"]
    # step 3 was logged, not saved: to be dropped
    assert [m["step"] for m in read_metrics(out)] == [0, 1, 2, 3]
    # a SIGKILL leaves each rank's socket directory; the next run on the host removes them
    stale = left_on_host(host_tmp)
    assert len(stale) == 2 and all(name.startswith(rollout.HOST_TAG) for name in stale)

    completed = run_train(tiny_dir, out, *steps, nproc=2, env=env)
    assert left_on_host(host_tmp) == []
    assert "resumed from" in completed.stderr and "step_00000002 at step 2" in completed.stderr
    resumed = check_finished(completed, out, 4)
    # the resumed run probed the sync at its first step, 3, which the uninterrupted one did not
    (first,) = [m for m in resumed if m["step"] == 3]
    assert pop_probe(first)["rollout/sync_probe_error"] < 1e-4
    # every metric of every step, bitwise (eval and step 0 included)
    assert comparable(resumed) == comparable(full)
    # state moved
    assert len({m["stare/w"] for m in full[1:]}) > 1 and len({m["train/lr"] for m in full[1:]}) > 1
    evaluated = [m["step"] for m in full if "eval/sum_test/avg@n" in m]
    assert evaluated == [0, 2, 4] and all(
        0 <= m["eval/overall/pass@2"] <= 1 for m in full if m["step"] in evaluated)
    want = AutoModelForCausalLM.from_pretrained(
        tmp_path / "full" / "hf", dtype=torch.float32).state_dict()
    got = AutoModelForCausalLM.from_pretrained(out / "hf", dtype=torch.float32).state_dict()
    assert all(torch.equal(got[name], want[name]) for name in want)
    assert [p.name for p in (out / "checkpoints").iterdir()] == ["step_00000004"]  # keep_last=1

    # tools/plots.py on these two real runs (training curves, evaluations), overlaid
    from tools import plots

    written = plots.plot_runs(
        [tmp_path / "full", out], tmp_path / "figures", labels=["uninterrupted", "resumed"])
    assert sorted(p.name for p in written) == [
        "accuracy.png", "dynamics.png", "entropy.png", "eval.png", "length.png", "selection.png"]
    assert all(p.stat().st_size > 10_000 for p in written)


def test_sigterm_saves_a_checkpoint_that_exports(tiny_dir, tmp_path, request):
    out = tmp_path / "run"
    host_tmp = private_tmp(request)
    args = train_args(tiny_dir, out, "train.total_steps=1000", "train.save_every=0")
    # a file, not a pipe nobody reads until the end
    console = tmp_path / "console.txt"
    process = forked.Forked(REPO / "train.py", args, {**os.environ, "TMPDIR": str(host_tmp)},
                            stdout=console, stderr=console)
    wait_until(process, lambda: logged_steps(out) >= 1)
    process.send_signal(signal.SIGTERM)
    process.wait(timeout=300)
    output = console.read_text()
    assert process.returncode == 128 + signal.SIGTERM, output[-3000:]
    assert left_on_host(host_tmp) == []  # a signal's exit removes what the run made there
    (checkpoint,) = list((out / "checkpoints").iterdir())
    step = checkpoints.checkpoint_step(checkpoint)
    assert 1 <= step < 1000 and len(read_metrics(out)) == step
    assert "stopped by a signal" in output

    exported = forked.run(REPO / "train.py", args + ["--export"], timeout=300)
    assert exported.returncode == 0, exported.stderr[-3000:]
    model = AutoModelForCausalLM.from_pretrained(out / f"hf_step_{step}", dtype=torch.float32)
    initial = AutoModelForCausalLM.from_pretrained(tiny_dir / "model", dtype=torch.float32)
    assert any(
        not torch.equal(p, initial.state_dict()[name]) for name, p in model.state_dict().items())


def test_only_complete_checkpoints_count(tmp_path):
    root = tmp_path / "checkpoints"
    for name, complete in (
        ("step_00000010", True), ("step_00000002", True), (".step_00000020.tmp", True),
        ("step_00000030", False), (".step_00000001.deleting", True)):
        (root / name).mkdir(parents=True)
        if complete:
            (root / name / "trainer.pt").write_bytes(b"")
    assert [p.name for p in checkpoints.list_checkpoints(tmp_path)] == [
        "step_00000002", "step_00000010"]


def test_metrics_log_writes_jsonl_and_mirrors_to_wandb(tmp_path, monkeypatch):
    import dataclasses
    import types

    import config
    from tqdm import tqdm

    calls = []

    class Run:
        def log(self, metrics, step):
            calls.append(("log", step, dict(metrics)))

        def finish(self):
            calls.append(("finish",))

    stub = types.SimpleNamespace(init=lambda **kw: calls.append(("init", kw)) or Run(),
                                 util=types.SimpleNamespace(generate_id=lambda: "abc123"))
    monkeypatch.setitem(sys.modules, "wandb", stub)
    cfg = config.load("configs/tiny.yaml")
    cfg.train = dataclasses.replace(cfg.train, wandb=True, log_every=100)
    log = runs.MetricsLog(tmp_path, cfg, rank=0)
    log.write(3, {"rollout/acc": 0.123456789, "train/tokens": 7}, tqdm(disable=True))
    log.close()
    assert read_metrics(tmp_path) == [{"step": 3, "rollout/acc": 0.123457, "train/tokens": 7}]
    assert calls[0][0] == "init" and calls[0][1]["config"]["gate"]["w"] == cfg.gate.w
    # a resumed run continues it
    assert calls[0][1]["id"] == (tmp_path / "wandb_run_id").read_text() == "abc123"
    assert calls[1:] == [("log", 3, {"rollout/acc": 0.123456789, "train/tokens": 7}), ("finish",)]
    assert runs.MetricsLog(tmp_path, cfg, rank=1).descriptor is None  # only rank 0 writes


def checkpoint_weights(checkpoint):
    """The model tensors of a DCP checkpoint, read without a process group."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    target = checkpoint.parent / (checkpoint.name + ".pt")
    dcp_to_torch_save(checkpoint / "sharded", target)
    return torch.load(target, weights_only=False)["model"]


def test_nonfinite_loss_skips_the_step_then_stops_the_run(tiny_dir, tmp_path):
    # NaN losses at steps 2, 4 and 5 (one micro-batch: policy_loss call k is step k), at most
    # optim.max_nonfinite_steps=1 in a row. In float32: that a non-finite loss counts whatever
    # float16's loss scale is, tests/fp16_update.py shows inside policy_update
    out = tmp_path / "run"
    completed = forked.run(REPO / "tests" / "nan_train.py", ["2,4,5", *train_args(
        tiny_dir, out, "train.total_steps=6", "train.save_every=1", "train.keep_last=10",
        "optim.max_nonfinite_steps=1", "train.micro_token_budget=100000",
        "rollout.sync_check_every=1", *SMALL_STEPS)])
    assert (out / "metrics.jsonl").exists(), completed.stderr[-4000:]
    # one bad step (2): skipped (no update), counted, and the run goes on
    metrics = read_metrics(out)
    assert [m["train/skipped_updates"] for m in metrics] == [0, 1, 0, 1, 1], (
        completed.stderr[-4000:])
    bad = [2, 4, 5]
    assert all(math.isfinite(m["train/loss"]) != (m["step"] in bad) for m in metrics)
    assert all(math.isfinite(m["train/grad_norm"]) != (m["step"] in bad) for m in metrics)
    weights = [checkpoint_weights(out / "checkpoints" / f"step_{s:08d}") for s in (1, 2, 3, 4)]
    # step 2 changed nothing, step 3 trained again, step 4 changed nothing
    assert all(torch.equal(weights[1][k], weights[0][k]) for k in weights[0])
    assert not all(torch.equal(weights[2][k], weights[1][k]) for k in weights[0])
    assert all(torch.equal(weights[3][k], weights[2][k]) for k in weights[0])
    # more bad steps in a row than optim.max_nonfinite_steps (4 and 5): a clear error, the
    # checkpoints before it intact
    assert completed.returncode != 0
    assert (
        "non-finite loss or gradient norm in 2 consecutive steps (optim.max_nonfinite_steps=1)"
        in completed.stderr)
    assert [p.name for p in checkpoints.list_checkpoints(out)] == [
        f"step_{s:08d}" for s in (1, 2, 3, 4)]


def test_the_zero_signal_guard_counts_steps_without_signal_in_a_row():
    import config
    import train

    cfg = config.Config()
    cfg.train = dataclasses.replace(cfg.train, zero_signal_warn_steps=2, zero_signal_stop_steps=4,
                                    min_answered_frac=0.1)

    def step(varied, no_answer, parse_error=0.0):
        return {"rollout/varied_group_frac": varied, "rollout/no_answer_frac": no_answer,
                "rollout/parse_error_frac": parse_error}

    # signal, none (no group varied), none (5% answered, under the floor of 10%), signal again
    # (resets), then five steps with none: warned at the 2nd, stopped at the 4th and every later one
    steps = [step(0.5, 0.0), step(0.0, 0.0), step(0.3, 0.9, 0.05), step(0.1, 0.5)] + [
        step(0.0, 1.0)] * 5
    in_a_row, counts, lines = 0, [], []
    for number, metrics in enumerate(steps, 1):
        in_a_row, line = train.zero_signal_guard(metrics, in_a_row, cfg, number)
        counts.append(in_a_row)
        lines.append(line and line.split(":")[0])
    assert counts == [0, 1, 2, 0, 1, 2, 3, 4, 5]
    assert lines == [None, None, "warning", None, None, "warning", None, "error", "error"]
    _, line = train.zero_signal_guard(step(0.0, 1.0), 3, cfg, 7)
    assert line.startswith("error: step 7: no learning signal in 4 consecutive steps: "
                           "rollout/varied_group_frac = 0 <= train.min_varied_group_frac = 0; "
                           "1 - rollout/no_answer_frac - rollout/parse_error_frac = 0 <= "
                           "train.min_answered_frac = 0.1. Likely: ")
    # 0: never warn, never stop
    cfg.train = dataclasses.replace(cfg.train, zero_signal_warn_steps=0, zero_signal_stop_steps=0)
    assert train.zero_signal_guard(step(0.0, 1.0), 100, cfg, 101) == (101, None)


def test_a_run_without_signal_warns_then_stops_after_a_checkpoint(tiny_dir, tmp_path, default_run):
    # the quick start's steps have signal: the guard counted none
    assert [m["train/zero_signal_steps"] for m in default_run[1]] == [0, 0]
    # two response tokens cut every answer: no box, no group judged differently
    out = tmp_path / "run"
    small = ["rollout.max_tokens=2", "algorithm.dynamic_sampling=false",
             "algorithm.gen_batch_size=4", "train.train_batch_size=4", "train.mini_batch_size=4",
             "train.save_every=0", "train.zero_signal_warn_steps=2",
             "train.zero_signal_stop_steps=3"]
    completed = run_train(tiny_dir, out, *small, "train.total_steps=5")
    assert completed.returncode == 2, completed.stderr[-3000:]
    lines = completed.stderr.splitlines()
    warning = [line for line in lines if line.startswith("warning: step 2: no learning signal")]
    assert len(warning) == 1 and "rollout/varied_group_frac = 0 <=" in warning[0], lines[-20:]
    assert lines[-1].startswith("error: step 3: no learning signal in 3 consecutive steps: "
                                "rollout/varied_group_frac = 0"), lines[-20:]
    assert "rollout.max_tokens" in lines[-1] and "train.zero_signal_stop_steps=3" in lines[-1]
    assert [m["train/zero_signal_steps"] for m in read_metrics(out)] == [1, 2, 3]
    assert [p.name for p in checkpoints.list_checkpoints(out)] == ["step_00000003"]
    assert checkpoints.read_trainer_state(out / "checkpoints" / "step_00000003")[
        "zero_signal_in_a_row"] == 3  # a resumed run goes on counting


def test_dynamic_sampling_gives_up_with_a_clear_error(tiny_dir, tmp_path):
    # every group of the tiny sum task is all-wrong or mixed; demanding 16 varied groups from one
    # round of 16 fails
    completed = run_train(
        tiny_dir, tmp_path / "run", "algorithm.gen_batch_size=16",
        "algorithm.max_num_gen_batches=1", "train.total_steps=1")
    assert completed.returncode != 0
    assert (
        "dynamic sampling kept" in completed.stderr
        and "algorithm.max_num_gen_batches" in completed.stderr)


def test_a_changed_shard_is_never_loaded_and_another_model_is_refused_in_one_line(
    tiny_dir, tmp_path, default_run):
    from transformers import AutoConfig

    out = copy_run(default_run[0], tmp_path / "run")  # 2 steps, a checkpoint after each
    first, latest = checkpoints.list_checkpoints(out)
    shard = next((latest / "sharded").glob("*.distcp"))
    data = bytearray(shard.read_bytes())  # bytes in its middle changed, the size the same: only
    data[len(data) // 2] ^= 0xFF            # the checksums can tell
    shard.write_bytes(bytes(data))
    exported = run_train(tiny_dir, out, "--export")
    assert exported.returncode == 0, exported.stderr[-3000:]
    assert f"warning: {shard} does not match its sha256" in exported.stderr
    assert (out / "hf_step_1").is_dir() and not (out / "hf_step_2").exists()
    for extra in (["--export"], []):  # named: refused before anything loads
        refused = run_train(tiny_dir, out, f"train.resume={latest}", *extra)
        assert refused.returncode == 2 and "Traceback" not in refused.stderr
        assert refused.stderr.strip().splitlines()[-1].startswith(f"error: {shard} does not match")
    # resuming onto a model of another shape: one line, before the engine starts, and nothing else
    # goes wrong on the way out
    other = AutoConfig.from_pretrained(tiny_dir / "model")
    other.intermediate_size //= 2
    AutoModelForCausalLM.from_config(other).save_pretrained(tmp_path / "other")
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(tiny_dir / "model" / name, tmp_path / "other")
    completed = run_train(tiny_dir, out, f"model.path={tmp_path / 'other'}", "train.total_steps=3")
    assert completed.returncode == 2 and "Traceback" not in completed.stderr
    error_lines = [line for line in completed.stderr.splitlines()
                   if line.startswith("error") or "Error" in line or "Exception" in line]
    assert error_lines == [
        f"error: {first} was saved from another model: its model.layers.0.mlp.down_proj.weight has "
        f"shape [128, 384], the model.path model's has shape [128, 192]; resume with the same "
        f"model (or another train.out_dir)"
    ], completed.stderr[-3000:]
    assert "building the vLLM engine" not in completed.stderr


def test_a_run_refuses_to_mix_with_another_trajectory(tiny_dir, tmp_path):
    out = tmp_path / "run"
    (out / "checkpoints" / "step_00000005").mkdir(parents=True)
    torch.save({"step": 5}, out / "checkpoints" / "step_00000005" / "trainer.pt")
    # would start at 0 beside another run's step 5
    completed = run_train(tiny_dir, out, "train.resume=never")
    assert completed.returncode == 2 and "checkpoints after step 0" in completed.stderr
    completed = run_train(tiny_dir, out, f"train.resume={tmp_path / 'nowhere'}")
    assert completed.returncode == 2 and "is not a complete checkpoint" in completed.stderr
    assert sorted(p.name for p in out.iterdir()) == ["checkpoints"]  # nothing written


def test_tool_use_trains_end_to_end_with_tool_tokens_masked(tool_dir, tmp_path):
    tiny_dir = tool_dir
    out = tmp_path / "run"
    # the tiny tool model is never right; DAPO's overlong shaping makes rewards (and so advantages)
    # differ anyway
    completed = forked.run(REPO / "train.py", [
        "--config", "configs/tiny_tool.yaml", f"model.path={tiny_dir / 'tool_model'}",
        f"data.train_files=[{tiny_dir / 'data' / 'mul_train.jsonl'}]", f"train.out_dir={out}",
        "train.total_steps=2", "reward.overlong_buffer_len=300", "reward.max_response_len=400",
        "rollout.sync_check_every=1", "optim.lr=1e-5"])
    metrics = check_finished(completed, out)
    # never right: no group varies, counted; the config turns the zero-signal guard's lines off
    assert [m["train/zero_signal_steps"] for m in metrics] == [1, 2]
    assert "no learning signal" not in completed.stderr
    assert (
        metrics[0]["rollout/tool_calls_mean"] > 0.3
        and 0.1 < metrics[0]["rollout/tool_token_frac"] < 0.9)
    # the code's own errors are not the sandbox's failures
    assert all(m["rollout/sandbox_failures"] == 0 for m in metrics)
    # the mode the run used, as this process finds it (auto stops rather than fall back)
    assert metrics[0]["rollout/sandbox_namespaces"] == float(sandbox.isolation() == "namespaces")
    for record in metrics:
        # the loss and every statistic count only the tokens the policy sampled
        responses = 8 * 4  # train_batch_size x n (no dynamic sampling)
        policy_tokens = (
            record["rollout/response_length_mean"]
            * responses
            * (1 - record["rollout/tool_token_frac"]))
        assert record["train/tokens"] == pytest.approx(policy_tokens, abs=0.5)
        # tool tokens' rollout log-prob is a 0.0 placeholder
        assert record["rollout/logprob_mismatch_max"] < 1e-3
        assert record["rollout/sync_probe_error"] < 1e-4 and record["train/grad_norm"] > 0


def test_a_sandbox_that_fails_mid_run_stops_the_run_in_one_line(tool_dir, tmp_path):
    # the start-up probe passes, then every execution fails in the sandbox itself
    out = tmp_path / "run"
    completed = forked.run(REPO / "tests" / "sandbox_fault_train.py", [
        "--config", "configs/tiny_tool.yaml", f"model.path={tool_dir / 'tool_model'}",
        f"data.train_files=[{tool_dir / 'data' / 'mul_train.jsonl'}]", f"train.out_dir={out}",
        "train.total_steps=3", "train.save_every=1"])
    assert completed.returncode == 2, completed.stderr[-3000:]
    line = completed.stderr.strip().splitlines()[-1]
    (record,) = read_metrics(out)  # on record, and not saved: no checkpoint after it
    # every call that ran (not rejected as invalid) failed in the sandbox
    failures, calls = record["rollout/sandbox_failures"], record["rollout/tool_calls"]
    assert failures == round(calls * (1 - record["rollout/tool_invalid_frac"])) > 0
    assert record["rollout/tool_error_frac"] == 1.0
    assert line.startswith(
        f"error: step 1: the sandbox itself failed in {failures:g} of this step's {calls:g} tool "
        f"calls ({failures / calls:.3g} > sandbox.max_failure_frac = 0.25); the latest: Error: "
        "sandbox failure (OSError: [Errno 28] No space left on device (injected)). Its code never "
        "ran"), line
    assert checkpoints.list_checkpoints(out) == []


def test_the_sandbox_guard_bounds_a_step_and_a_window_of_steps():
    import config
    import train

    cfg = config.Config()
    cfg.sandbox = dataclasses.replace(cfg.sandbox, max_failure_frac=0.5,
                                      max_window_failure_frac=0.1, window_steps=3)
    state = train.TrainerState()

    def step(failures, calls):
        return {"rollout/sandbox_failures": failures, "rollout/tool_calls": calls}

    # per step under 0.5; over the window: 1/10, 2/20 (= the bound: goes on), 3/30, then 4 of the
    # last three steps' 30 calls (the first step left the window)
    lines = [train.sandbox_guard(step(f, 10), state, cfg, number)
             for number, f in enumerate([1, 1, 1, 1, 2], 1)]
    assert lines[:4] == [None] * 4 and state.sandbox_window == [[1, 10], [1, 10], [2, 10]]
    assert lines[4].startswith("error: step 5: the sandbox itself failed in 4 of the last 3 "
                               "steps' 30 tool calls (0.133 > sandbox.max_window_failure_frac = 0.1)")
    assert train.sandbox_guard(step(6, 10), train.TrainerState(), cfg, 1).startswith(
        "error: step 1: the sandbox itself failed in 6 of this step's 10 tool calls (0.6 > "
        "sandbox.max_failure_frac = 0.5)")
    assert train.sandbox_guard(step(0, 0), train.TrainerState(), cfg, 1) is None  # no calls
    assert train.sandbox_guard({}, state, cfg, 6) is None  # no tools


def test_a_sandbox_that_cannot_run_stops_the_run_before_the_engine(tool_dir, tmp_path):
    """Under "auto", a probe that fails twice (here: no interpreter) stops in one line with its
    reason, rather than every tool call of the run failing in a weaker mode."""
    tiny_dir = tool_dir
    completed = forked.run(REPO / "train.py", [
        "--config", "configs/tiny_tool.yaml", f"model.path={tiny_dir / 'tool_model'}",
        f"data.train_files=[{tiny_dir / 'data' / 'mul_train.jsonl'}]",
        f"train.out_dir={tmp_path / 'out'}", "sandbox.python=/nonexistent/python3"], timeout=300)
    assert completed.returncode == 2, completed.stderr[-2000:]
    last = completed.stderr.strip().splitlines()[-1]
    assert last.startswith("error: sandbox: user namespaces failed twice") and (
        "No such file or directory: '/nonexistent/python3'" in last)
    assert "vLLM engine" not in completed.stderr


def test_tool_tokens_get_no_gradient_no_selection_and_no_denominator():
    # responses as train.py builds them: policy_mask False at tool-result tokens
    import types

    import config
    import grpo
    import modeling
    import stare

    generator = torch.Generator().manual_seed(0)
    tool_masks = [
        [False, False, True, True, True, False, False], [False, True, True, False], [False] * 5]
    out = types.SimpleNamespace(
        token_ids=[list(range(10, 10 + len(m))) for m in tool_masks], tool_mask=tool_masks)
    policy_masks = [grpo.policy_token_mask(out, i) for i in range(len(tool_masks))]
    mask = modeling.pad_rows(policy_masks)
    tool = modeling.pad_rows([torch.tensor(m) for m in tool_masks])
    assert not (mask & tool).any() and mask.sum() == sum(m.count(False) for m in tool_masks)
    tensors = {"mask": mask}

    shape = tensors["mask"].shape
    logprobs = (-torch.rand(shape, generator=generator) * 3).requires_grad_()
    batch = {
        "logprobs": logprobs,
        "old_logprobs": logprobs.detach() + 0.01 * torch.randn(shape, generator=generator),
        "entropy": torch.rand(shape, generator=generator),
        "advantages": torch.tensor([1.0, -1.0, 0.5]),
        "mask": tensors["mask"],
    }
    # select every eligible token
    cfg = config.load("configs/tiny.yaml", ["loss.stare_top_ratio=1.0"])
    gate = stare.EntropyGate(target_entropy=10.0)  # on
    for method in ("stare", "kl_cov", "high_entropy"):
        selection, _ = baselines.token_selection(
            method, batch, cfg.loss, states={"gate": gate}, generator=generator)
        for name, chosen in selection.items():
            if chosen.dtype == torch.bool and name != "kept":
                assert not (chosen & tool).any(), (method, name)  # never a tool token
        loss, _ = baselines.policy_loss(
            method, batch, cfg.loss, selection=selection, states={"gate": gate},
            counts={"num_tokens": float(tensors["mask"].sum()), "num_sequences": 3.0},
            generator=generator)
        (gradient,) = torch.autograd.grad(loss, logprobs)
        assert (gradient[tool] == 0).all() and (gradient[tensors["mask"]] != 0).any(), method


def test_the_sync_probe_is_the_prompt_and_at_most_512_response_tokens():
    import grpo
    import rollout

    def response(length, truncated=False):
        return grpo.Response(
            prompt=[1, 2, 3], tokens=list(range(10, 10 + length)), rollout_logprobs=[0.0] * length,
            reward=0.0, accuracy=0.0, truncated=truncated, reflection=(0, 0),
            policy_mask=torch.ones(length, dtype=torch.bool))

    assert rollout.PROBE_TOKENS == 512
    assert rollout.probe_sequence([response(0), response(17_000)]) == (
        [1, 2, 3] + list(range(10, 522)), 3)
    # a truncated response filled the context: the probe asks for one more token, so it drops the
    # last
    assert rollout.probe_sequence([response(5, truncated=True)]) == ([1, 2, 3, 10, 11, 12, 13], 3)
    assert rollout.probe_sequence([response(1, truncated=True), response(0)]) is None


def random_responses(generator, groups=3, n=4, vocab=300):
    """Groups of n responses with random prompts, tokens and 0/1 rewards (each group varied), as sample_groups makes."""
    import grpo

    out = []
    for _ in range(groups):
        prompt = torch.randint(3, vocab, (int(torch.randint(1, 9, (1,), generator=generator)),),
                               generator=generator).tolist()
        responses = []
        for k in range(n):
            length = int(torch.randint(1, 12, (1,), generator=generator))
            tokens = torch.randint(3, vocab, (length,), generator=generator).tolist()
            reward = (
                float(k % 2) if k < 2 else float(torch.randint(0, 2, (1,), generator=generator)))
            responses.append(
                grpo.Response(
                    prompt=prompt, tokens=tokens, rollout_logprobs=[0.0] * length, reward=reward,
                    accuracy=reward, truncated=False, reflection=(0, 0),
                    policy_mask=torch.ones(length, dtype=torch.bool)))
        out.append(grpo.Group(prompt, responses))
    return out


@pytest.mark.parametrize("budget", [8, 10_000])  # one row per micro-batch, or all rows in one
def test_stages_give_the_log_probs_and_the_update_of_an_independent_computation(tiny_dir, budget):
    # the stages in one process (no process group): old_policy_pass against a forward of each row
    # alone, and policy_update's GRPO step against the closed-form gradient at ratio 1, -sum A_i
    # grad log pi / N_tokens
    import config
    import grpo

    cfg = config.load(
        "configs/tiny.yaml",
        [
            "algorithm.method=grpo", "optim.grad_clip=0", f"train.micro_token_budget={budget}",
            "train.train_batch_size=3", "train.mini_batch_size=3", "rollout.n=4"])
    model = AutoModelForCausalLM.from_pretrained(tiny_dir / "model", dtype=torch.float32)
    reference = AutoModelForCausalLM.from_pretrained(tiny_dir / "model", dtype=torch.float32)
    responses = grpo.group_responses(
        random_responses(torch.Generator().manual_seed(budget)), cfg, 0, 1)
    grpo.old_policy_pass(model, responses, cfg, torch.device("cpu"))

    reference_loss = 0.0
    for r in responses:
        logits = reference(input_ids=torch.tensor([r.prompt + r.tokens])).logits[
            0, len(r.prompt) - 1 : -1
        ]  # [T, V]
        logprobs = torch.log_softmax(logits, -1).gather(-1, torch.tensor(r.tokens)[:, None])[:, 0]
        entropy = torch.distributions.Categorical(logits=logits.detach()).entropy()
        assert torch.allclose(r.old_logprobs, logprobs.detach(), atol=1e-5)
        assert torch.allclose(r.entropy, entropy, atol=1e-5)
        reference_loss = reference_loss - r.advantage * logprobs.sum()
    (reference_loss / sum(len(r.tokens) for r in responses)).backward()

    states = baselines.method_states(cfg)
    num_tokens, gate_metrics = grpo.update_states(states, responses, torch.device("cpu"))
    assert num_tokens == sum(len(r.tokens) for r in responses)
    assert gate_metrics["train/entropy"] == pytest.approx(
        float(torch.cat([r.entropy for r in responses]).mean()), rel=1e-6)
    before = [p.detach().clone() for p in model.parameters()]
    # the parameter change is minus the gradient
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    metrics = grpo.policy_update(model, optimizer, responses, cfg, states, 1, torch.device("cpu"))
    assert metrics["train/skipped_updates"] == 0 and (metrics["train/micro_batches"] > 1) == (
        budget == 8)
    for old, new, ref in zip(before, model.parameters(), reference.parameters()):
        # float32: a parameter minus its updated value keeps ~1e-7 of the parameter's size
        assert (old - new.detach() - ref.grad).abs().max() <= 1e-5 * ref.grad.abs().max() + 1e-6


def test_bad_starts_fail_fast_in_one_line_and_leave_the_run_as_it_was(tiny_dir, tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    (out / "config.yaml").write_text("the earlier run's config\n")
    (out / "metrics.jsonl").write_text('{"step": 1}\n')
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"problem": "1+1", "answer": "2"}\n{"problem": \n')
    cases = [  # (overrides, what the one line must say)
        ([f"data.train_files=[{broken}]"], f"{broken}:2: invalid JSON"),
        (["data.overflow=skip", "data.max_prompt_tokens=2", "train.micro_token_budget=4096"],
         "no training prompt is left: 16 training prompts; 0 (0.0%) cut"),
        (["model.path=models/not-here"], "nothing is downloaded")]
    for overrides, message in cases:
        start = time.time()
        completed = run_train(tiny_dir, out, *overrides)
        assert completed.returncode == 2 and message in completed.stderr, completed.stderr[-2000:]
        assert "Traceback" not in completed.stderr and time.time() - start < 120
        assert (out / "config.yaml").read_text() == "the earlier run's config\n"
        assert (out / "metrics.jsonl").read_text() == '{"step": 1}\n' and not (
            out / "run.lock"
        ).exists()


def test_a_gpu_config_without_cuda_stops_in_one_line_before_anything_loads(tiny_dir, tmp_path):
    start = time.time()
    completed = subprocess.run(
        [sys.executable, "train.py", "--config", "configs/qwen7b_long.yaml",
         f"model.path={tiny_dir / 'model'}",
         f"data.train_files=[{tiny_dir / 'data' / 'sum_train.jsonl'}]",
         "eval.files=[]", "data.max_prompt_tokens=64", "rollout.max_tokens=16",
         f"train.out_dir={tmp_path / 'run'}"],
        cwd=REPO, capture_output=True, text=True, timeout=300)
    assert completed.returncode == 2 and time.time() - start < 60
    (line,) = completed.stderr.strip().splitlines()
    assert line.startswith("error: configs/qwen7b_long.yaml is planned for a GPU, but CUDA is not "
                           "available here") and "rollout.kv_cache_gib=GIB" in line
    assert not (tmp_path / "run").exists()


def test_a_changed_learning_rate_takes_effect_on_resume(tiny_dir, tmp_path, default_run):
    out = copy_run(default_run[0], tmp_path / "run", steps=1)  # as a 1-step run leaves it
    completed = run_train(tiny_dir, out, "optim.lr=1e-4")
    metrics = check_finished(completed, out)
    assert [m["train/lr"] for m in metrics] == [pytest.approx(3e-4), pytest.approx(1e-4)]
    # tiny.yaml probes every 5th step: step 2 is probed as the resumed run's first, and the
    # resume's own sync with the checkpoint's probe before it
    assert metrics[1]["rollout/sync_probe_error"] < 1e-4
    probed = re.search(r"resumed from \S+ at step 1 \(weight sync probed: (\S+)\)",
                       completed.stderr)
    assert probed and float(probed[1]) < 1e-4
    assert "this run's values apply: optim.lr" in completed.stderr
    assert "lr: 0.0001" in (out / "config.yaml").read_text()


# each stateful method's settings that make its state move from step to step
STATEFUL_SETTINGS = {"entropic": ["entropic.ki=0.5"],
                     "adaptive_entropy": ["loss.adaptive_entropy_target=10"]}


@pytest.mark.parametrize("method", sorted(baselines.STATEFUL))
def test_a_resumed_run_continues_every_stateful_methods_state_exactly(method, tiny_dir, tmp_path):
    # 2 steps with a checkpoint after each, against the same run resumed from step 1's checkpoint:
    # the state carried (EntroPIC: step 1's error in the integral) and every metric of step 2
    # bitwise
    settings = [f"algorithm.method={method}", "train.total_steps=2", "train.save_every=1",
                "train.keep_last=2", *STATEFUL_SETTINGS[method], *SMALL_STEPS]
    full = check_finished(run_train(tiny_dir, tmp_path / "full", *settings), tmp_path / "full", 2)
    out = copy_run(tmp_path / "full", tmp_path / "resumed", steps=1)
    resumed = check_finished(run_train(tiny_dir, out, *settings), out, 2)
    for record in resumed + full:  # the resumed run probes the sync at its first step
        pop_probe(record)
    assert comparable(resumed) == comparable(full)
    # the state moved: a resume that restarted it would differ
    name = baselines.STATEFUL[method](config.load(REPO / "configs" / "tiny.yaml", settings)).name
    state_metrics = [{k: v for k, v in m.items() if k.startswith(f"{name}/")}
                     for m in full if m["step"] > 0]
    assert state_metrics[0] and state_metrics[0] != state_metrics[1]
    if method == "entropic":
        integrals = [m["entropic/integral"] for m in full if m["step"] > 0]
        errors = [m["entropic/error"] for m in full if m["step"] > 0]
        # metrics.jsonl rounds to 6 digits
        assert integrals[1] == pytest.approx(errors[0] + errors[1], abs=3e-6)


# --------------------------------------------------------------------------------------------------
# The GPU-only paths, checked as far as CPU allows: the sync guard, float16 loss scaling, the
# collective timeout
# --------------------------------------------------------------------------------------------------


def test_the_sync_probe_runs_at_step_one_and_a_broken_bound_stops_the_run_in_one_line(
        tiny_dir, tmp_path, default_run):
    # tiny.yaml checks every 5th step: step 1 is checked all the same (the first sync of the run)
    first, second = default_run[1][-2:]  # steps 1 and 2
    assert first["rollout/sync_probe_error"] < 1e-4 and "rollout/sync_probe_error" not in second
    assert first["rollout/model_runner_v2"] == 0.0  # the V1 runner, as rollout.model_runner asks

    # the probe's distributions too: the engine's top 20 at every position, ~0 apart when synced
    assert first["rollout/sync_probe_tv"] < 1e-5 and first["rollout/sync_probe_kl"] < 1e-6
    assert 0 < first["rollout/sync_probe_mass_out"] < 1

    for key, bound in (("rollout/logprob_mismatch_mean", "max_logprob_mismatch"),
                       ("rollout/sync_probe_tv", "max_sync_probe_tv")):
        out = tmp_path / bound
        completed = run_train(tiny_dir, out, f"rollout.{bound}=1e-12")
        assert completed.returncode == 2, completed.stderr[-2000:]
        assert "Traceback" not in completed.stderr
        line = next(line for line in completed.stderr.splitlines() if line.startswith("error:"))
        assert line.startswith(f"error: step 1: {key} = ")
        assert f"exceeds rollout.{bound} = 1e-12" in line
        logged = read_metrics(out)
        # the step that tripped the guard is on record
        assert [m["step"] for m in logged if m["step"] > 0] == [1]
        assert f"{bound}: 1.0e-12" in (out / "config.yaml").read_text()
        # nothing saved from weights the engine may not hold
        assert checkpoints.list_checkpoints(out) == []


def test_float16_loss_scaling_keeps_the_gradients_that_float16_loses(tiny_dir, tmp_path):
    # gradients of ~1e-7 per entry, as a token mean over ~10^7 tokens gives: float16 compute flushes
    # all of them to zero; scaled by 2^16 before backward and unscaled after, the update matches the
    # float32 one
    completed = forked.run(REPO / "tests" / "fp16_update.py",
                           [tiny_dir / "model", tmp_path / "fp16.json"], timeout=600)
    assert completed.returncode == 0, completed.stderr[-3000:]
    result = json.loads((tmp_path / "fp16.json").read_text())
    assert result["reference_max_abs"] < 1e-4  # the premise: a tiny update (entries ~1e-7 to 1e-5)
    assert (
        result["plain"]["underflowed"] == result["entries"]
        and result["plain"]["relative_error"] == 1.0)
    assert result["scaled"]["underflowed"] < 0.01 * result["entries"]
    assert result["scaled"]["relative_error"] < 0.05  # float16 compute against float32
    assert result["scaled_loss_scale"] == 2.0**16 and result["scale_after"] == 2.0**16
    assert result["good_steps_after"] == 1
    # a scale that overflows float16: the step is skipped, the parameters stay, the scale halves
    assert result["overflow_skipped"] == 1 and not result["overflow_changed"]
    assert result["overflow_scale_after"] == 2.0**59 and result["overflow_nonfinite"] == 0
    # a non-finite loss (a forward overflow): skipped and counted towards optim.max_nonfinite_steps
    # whatever the scale, which it leaves as it was
    assert result["nan_skipped"] == result["nan_nonfinite"] == 1
    assert result["nan_scale_after"] == 2.0**16
    # the export gathers each parameter in float16, never a float32 copy, and writes the shards
    assert result["export_gathered"] == result["export_dtypes"] == ["torch.float16"]
    assert result["export_exact"]


def test_the_loss_scale_grows_after_a_window_of_finite_steps_and_halves_on_overflow():
    import modeling

    scaler = modeling.LossScaler(scale=8.0, window=2)
    history = []
    for finite in (True, True, True, False, False, True):
        scaler.update(finite)
        history.append((scaler.scale, scaler.good_steps))
    assert history == [(8.0, 1), (16.0, 0), (16.0, 1), (8.0, 0), (4.0, 0), (4.0, 1)]
    floor = modeling.LossScaler(scale=1.0, window=2)
    floor.update(False)
    assert floor.scale == 1.0


def test_the_collective_timeout_reaches_init_process_group(tiny_dir, monkeypatch):
    import datetime

    import train

    seen = {}

    class Stop(Exception):
        pass

    def fake_init(backend, **kwargs):
        seen.update(backend=backend, **kwargs)
        raise Stop

    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(key, raising=False)  # setup_distributed sets them for a single process
    monkeypatch.setattr(train.dist, "init_process_group", fake_init)
    monkeypatch.chdir(REPO)
    argv = ["--config", "configs/tiny.yaml", f"model.path={tiny_dir / 'model'}",
            f"data.train_files=[{tiny_dir / 'data' / 'sum_train.jsonl'}]", "eval.files=[]",
            "train.nccl_timeout_minutes=7"]
    with pytest.raises(Stop):
        train.main(argv)
    assert seen == {"backend": "gloo", "timeout": datetime.timedelta(minutes=7)}
    assert train.config.TrainConfig().nccl_timeout_minutes == 60


def test_sampling_gathers_only_the_groups_the_step_keeps(monkeypatch):
    # rounds of 8 groups, 5 of them varied, for a batch of 6: round 2 sends 1 group, not 8
    import config
    import grpo
    import rewards

    cfg = config.load("configs/tiny.yaml", ["train.train_batch_size=6", "train.mini_batch_size=6",
                                            "algorithm.gen_batch_size=8", "rollout.n=2"])
    made = []

    def generate_round(engine, tokenizer, task, cfg, global_indices):
        groups = []
        for g in global_indices:  # accuracies (1, 0) x 5, then (1, 1) same tokens, (1, 1), (0, 0)
            accuracies = [(1.0, 0.0)] * 5 + [(1.0, 1.0)] * 2 + [(0.0, 0.0)]
            tokens = [[g], [g]] if g % 8 == 5 else [[g], [g, 1]]
            groups.append(grpo.Group([g], [
                grpo.Response([g], t, [0.0] * len(t), a, a, False, (0, 0), torch.ones(len(t)))
                for t, a in zip(tokens, accuracies[g % 8])]))
        made.extend(groups)
        return groups, {"time/rollout": 0.0, "time/reward": 0.0, "responses": 16,
                        "sampled_correct": 10.0, **{k: 0.0 for k in grpo.REWARD_FRACTIONS}}

    sent, real_all_gather = [], runs.all_gather
    monkeypatch.setattr(grpo, "generate_round", generate_round)
    monkeypatch.setattr(runs, "all_gather", lambda obj: sent.append(obj) or real_all_gather(obj))
    kept, position, metrics = grpo.sample_groups(None, None, None, cfg, 0, 0, 1, None)
    varied = [g for g in made if g.varied]
    assert position == 16 and metrics["rollout/gen_rounds"] == 2
    assert kept == varied[:6] and all(a is b for a, b in zip(kept, varied))
    sent_groups = [x for obj in sent if isinstance(obj, list) for x in obj]
    assert len(sent_groups) == 6 and all(isinstance(x, grpo.Group) for x in sent_groups)
    assert metrics["rollout/varied_group_frac"] == 10 / 16
    assert metrics["rollout/distinct_correct_frac"] == rewards.distinct_correct_fraction(
        [[(r.tokens, r.accuracy) for r in g.responses] for g in made])


HOST_GROUP = """
import json, sys
import torch.distributed as dist
import runs
rank, world, device = runs.setup_distributed(timeout_minutes=7)
moved = []
broadcast = dist.broadcast
dist.broadcast = lambda tensor, **kw: moved.append(tensor.numel()) or broadcast(tensor, **kw)
dist.get_backend = lambda group=None: "nccl"  # as on a GPU: the host group is a group of its own
gathered = [runs.all_gather("x" * 1000 if rank == 0 else None), runs.all_gather(rank)]
host = runs.host_group(dist.group.WORLD)
json.dump(dict(gathered=gathered, moved=moved, host_is_new=host is not dist.group.WORLD,
               timeouts=[str(runs.group_timeout(g)) for g in (None, host)]),
          open(sys.argv[1] + f"/rank{rank}.json", "w"))
dist.barrier()
dist.destroy_process_group()  # or gloo's threads may abort the exit ("terminate called ...")
"""


def test_objects_go_between_ranks_through_a_gloo_group_with_the_runs_timeout(tmp_path):
    # two CPU ranks; the default group says it is NCCL, so the host group is made as on a GPU
    (tmp_path / "host_group.py").write_text(HOST_GROUP)
    completed = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
         "--log-dir", str(tmp_path / "torchrun"), str(tmp_path / "host_group.py"), str(tmp_path)],
        cwd=REPO, capture_output=True,
        text=True, timeout=300, env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO)))
    assert completed.returncode == 0, completed.stderr[-3000:]
    for rank in (0, 1):
        result = json.loads((tmp_path / f"rank{rank}.json").read_text())
        # the default group and the host group wait the run's timeout, not gloo's 30 minutes
        assert result["timeouts"] == ["0:07:00", "0:07:00"] and result["host_is_new"]
        assert result["gathered"] == [["x" * 1000, None], [0, 1]]
        # each rank's pickle moves at its own size (all_gather_object pads both to the largest)
        assert len(result["moved"]) == 4
        assert result["moved"][0] == len(pickle.dumps("x" * 1000)) > 1000
        assert result["moved"][1] == len(pickle.dumps(None)) < 10


def test_a_training_file_listed_twice_is_named_in_a_warning(tiny_dir, capsys):
    import config
    import train
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_dir / "model")
    train_file = tiny_dir / "data" / "sum_train.jsonl"
    other_name = tiny_dir / "data" / ".." / "data" / "sum_train.jsonl"  # the same file

    def task(*files):
        cfg = config.load("configs/tiny.yaml", [
            f"model.path={tiny_dir / 'model'}", "eval.every=0",
            f"data.train_files=[{','.join(map(str, files))}]"])
        return train.load_task(cfg, tokenizer, rank=0)[0]

    once = task(train_file)
    assert "warning" not in capsys.readouterr().err
    twice = task(train_file, other_name)
    assert (f"warning: data.train_files lists {train_file.resolve()} 2 times: its prompts are "
            f"sampled 2 times as often") in capsys.readouterr().err
    assert twice.prompt_ids == once.prompt_ids * 2  # said, then done as configured
