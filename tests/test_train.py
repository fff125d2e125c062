"""train.py end to end on the tiny default: real vLLM (CPU), FSDP2 on gloo, one and two torchrun ranks."""

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

import baselines
import checkpoints

REPO = Path(__file__).resolve().parents[1]


def train_command(tiny_dir, out_dir, *overrides, nproc=1):
    """train.py on the tiny default (torchrun --standalone picks a free port) -> (argv, env)."""
    base = [f"model.path={tiny_dir / 'model'}", f"data.train_files=[{tiny_dir / 'data' / 'sum_train.jsonl'}]",
            "eval.files=[]", f"train.out_dir={out_dir}", "train.total_steps=2",
            "algorithm.target_entropy=1.0"]  # above the tiny model's entropy: the gate is on, STARE reweights
    launcher = [sys.executable] if nproc == 1 else [sys.executable, "-m", "torch.distributed.run", "--standalone",
                                                      "--nproc_per_node", str(nproc)]
    env = dict(os.environ, OMP_NUM_THREADS="1" if nproc > 1 else os.environ.get("OMP_NUM_THREADS", "2"))
    return launcher + ["train.py", "--config", "configs/tiny.yaml", *base, *overrides], env


def run_train(tiny_dir, out_dir, *overrides, nproc=1):
    command, env = train_command(tiny_dir, out_dir, *overrides, nproc=nproc)
    return subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)


def read_metrics(out_dir):
    return [json.loads(line) for line in (Path(out_dir) / "metrics.jsonl").read_text().splitlines()]


def check_finished(completed, out_dir, steps=2):
    assert completed.returncode == 0, completed.stdout[-2000:] + completed.stderr[-4000:]
    metrics = read_metrics(out_dir)
    assert [m["step"] for m in metrics if m["step"] > 0] == list(range(1, steps + 1))  # step 0: eval before training
    for record in metrics:
        bad = {k: v for k, v in record.items() if isinstance(v, float) and not math.isfinite(v)}
        assert not bad, bad
    return metrics


@pytest.mark.parametrize("method", baselines.METHODS)
def test_every_method_trains_end_to_end(method, tiny_dir, tmp_path):
    completed = run_train(tiny_dir, tmp_path / "run", f"algorithm.method={method}", "rollout.sync_check_every=1",
                          nproc=2)
    metrics = check_finished(completed, tmp_path / "run")
    assert [p.name for p in checkpoints.list_checkpoints(tmp_path / "run")] == ["step_00000002"]  # the end-of-run checkpoint
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "hf", dtype=torch.float32)
    assert torch.isfinite(exported(input_ids=torch.tensor([[1, 2, 3]])).logits).all()
    for record in metrics:
        assert record["rollout/sync_probe_error"] < 1e-4  # the engine holds the weights just trained
        assert record["rollout/logprob_mismatch_max"] < 1e-3  # float32 sampler vs trainer
        assert 0 <= record["rollout/acc"] <= 1 and record["train/tokens"] > 0
        assert 0 < record["rollout/distinct_correct_frac"] <= 1  # some groups are right at this accuracy
        assert record["stare/gate_on"] == 1.0
    if method == "stare":
        assert metrics[0]["train/touched_frac"] > 0 and metrics[0]["stare/pos_selected_frac"] > 0
    if method == "grpo":
        assert all(record["train/touched_frac"] == 0 for record in metrics)


def test_two_ranks_match_one_and_export_loads(tiny_dir, tmp_path):
    # generation rounds of 16 prompts for 16 varied groups: dynamic sampling needs several rounds per step
    one = check_finished(run_train(tiny_dir, tmp_path / "one", "algorithm.gen_batch_size=16"), tmp_path / "one")
    two = check_finished(run_train(tiny_dir, tmp_path / "two", "algorithm.gen_batch_size=16", nproc=2),
                         tmp_path / "two")
    # step scope + samples seeded by global prompt index: the first update is the same whatever the world size
    for key in ("rollout/acc", "train/entropy", "train/loss", "train/grad_norm", "stare/pos_selected_frac"):
        assert two[0][key] == pytest.approx(one[0][key], rel=1e-4, abs=1e-7), key
    assert one[0]["rollout/gen_rounds"] == two[0]["rollout/gen_rounds"] >= 2
    assert one[0]["rollout/acc_before_filter"] < one[0]["rollout/acc"]  # all-wrong groups were dropped
    positions = [torch.load(checkpoints.list_checkpoints(tmp_path / run)[-1] / "trainer.pt", weights_only=False)["data_position"]
                 for run in ("one", "two")]
    assert positions[0] == positions[1] == 16 * sum(m["rollout/gen_rounds"] for m in one)
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "two" / "hf", dtype=torch.float32)
    initial = AutoModelForCausalLM.from_pretrained(tiny_dir / "model", dtype=torch.float32)
    changed = [name for name, p in exported.state_dict().items() if not torch.equal(p, initial.state_dict()[name])]
    assert len(changed) > len(exported.state_dict()) // 2  # training moved (almost) every weight


def test_update_does_not_depend_on_micro_batch_size(tiny_dir, tmp_path):
    big = check_finished(run_train(tiny_dir, tmp_path / "big", "train.total_steps=1"), tmp_path / "big", steps=1)
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


def test_micro_scope_and_two_mini_batches_on_two_ranks(tiny_dir, tmp_path):
    # the reference's per-micro-batch selection, two optimizer steps per training step, a small token budget
    completed = run_train(tiny_dir, tmp_path / "run", "algorithm.stare_scope=micro", "train.mini_batch_size=8",
                          "train.micro_token_budget=600", "rollout.sync_check_every=1", nproc=2)
    metrics = check_finished(completed, tmp_path / "run")
    for record in metrics:
        assert record["rollout/sync_probe_error"] < 1e-4  # both optimizer steps reached the engine
        assert record["train/micro_batches"] >= 4 and record["train/skipped_updates"] == 0
        assert record["train/touched_frac"] > 0


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
    """SIGKILL a launcher and everything it started, as a machine failure would; returns once all are dead."""
    victims = [process.pid] + descendants(process.pid)
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


def test_killed_run_resumes_bit_exactly(tiny_dir, tmp_path):
    # everything a step reads from the past: a warm-up + cosine schedule, an adaptive gate, the sync probe, evaluations
    steps = ["train.total_steps=4", "train.save_every=2", "train.keep_last=1", "optim.warmup_steps=3",
             "optim.schedule=cosine", "algorithm.gate_adaptive=true", "algorithm.gate_alpha=0.1",
             "rollout.sync_check_every=2", f"eval.files=[{tiny_dir / 'data' / 'sum_test.jsonl'}]", "eval.n=2",
             "eval.every=2"]
    full = check_finished(run_train(tiny_dir, tmp_path / "full", *steps, nproc=2), tmp_path / "full", 4)

    # the same run, killed (SIGKILL, every process) once step 2's checkpoint is written and step 3 is logged
    out = tmp_path / "killed"
    command, env = train_command(tiny_dir, out, *steps, nproc=2)
    process = subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_until(process, lambda: (out / "checkpoints" / "step_00000002").exists() and logged_steps(out) >= 4)
    kill_tree(process)
    assert [p.name for p in (out / "checkpoints").iterdir()] == ["step_00000002"]
    assert [m["step"] for m in read_metrics(out)] == [0, 1, 2, 3]  # step 3 was logged, not saved: to be dropped

    completed = run_train(tiny_dir, out, *steps, nproc=2)
    assert "resumed from" in completed.stderr and "step_00000002 at step 2" in completed.stderr
    resumed = check_finished(completed, out, 4)
    assert comparable(resumed) == comparable(full)  # every metric of every step, bitwise (eval and step 0 included)
    assert len({m["stare/w"] for m in full[1:]}) > 1 and len({m["train/lr"] for m in full[1:]}) > 1  # state moved
    evaluated = [m["step"] for m in full if "eval/sum_test/avg@n" in m]
    assert evaluated == [0, 2, 4] and all(0 <= m["eval/overall/pass@2"] <= 1 for m in full if m["step"] in evaluated)
    want = AutoModelForCausalLM.from_pretrained(tmp_path / "full" / "hf", dtype=torch.float32).state_dict()
    got = AutoModelForCausalLM.from_pretrained(out / "hf", dtype=torch.float32).state_dict()
    assert all(torch.equal(got[name], want[name]) for name in want)
    assert [p.name for p in (out / "checkpoints").iterdir()] == ["step_00000004"]  # keep_last=1

    # plots.py on these two real runs (training curves, evaluations), overlaid
    import plots

    written = plots.plot_runs([tmp_path / "full", out], tmp_path / "figures", labels=["uninterrupted", "resumed"])
    assert sorted(p.name for p in written) == ["accuracy.png", "dynamics.png", "entropy.png", "eval.png",
                                               "length.png", "selection.png"]
    assert all(p.stat().st_size > 10_000 for p in written)


def test_sigterm_saves_a_checkpoint_that_exports(tiny_dir, tmp_path):
    out = tmp_path / "run"
    args = ["train.py", "--config", "configs/tiny.yaml", f"model.path={tiny_dir / 'model'}",
            f"data.train_files=[{tiny_dir / 'data' / 'sum_train.jsonl'}]", "eval.files=[]", f"train.out_dir={out}",
            "train.total_steps=1000", "train.save_every=0"]
    with open(tmp_path / "console.txt", "w") as console:  # a file, not a pipe nobody reads until the end
        process = subprocess.Popen([sys.executable] + args, cwd=REPO, stdout=console, stderr=subprocess.STDOUT)
        wait_until(process, lambda: logged_steps(out) >= 1)
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=300)
    output = (tmp_path / "console.txt").read_text()
    assert process.returncode == 128 + signal.SIGTERM, output[-3000:]
    (checkpoint,) = list((out / "checkpoints").iterdir())
    step = checkpoints.checkpoint_step(checkpoint)
    assert 1 <= step < 1000 and len(read_metrics(out)) == step
    assert "stopped by a signal" in output

    exported = subprocess.run([sys.executable] + args + ["--export"], cwd=REPO, capture_output=True, text=True,
                              timeout=300)
    assert exported.returncode == 0, exported.stderr[-3000:]
    model = AutoModelForCausalLM.from_pretrained(out / f"hf_step_{step}", dtype=torch.float32)
    initial = AutoModelForCausalLM.from_pretrained(tiny_dir / "model", dtype=torch.float32)
    assert any(not torch.equal(p, initial.state_dict()[name]) for name, p in model.state_dict().items())


def test_only_complete_checkpoints_count(tmp_path):
    root = tmp_path / "checkpoints"
    for name, complete in (("step_00000010", True), ("step_00000002", True), (".step_00000020.tmp", True),
                           ("step_00000030", False), (".step_00000001.deleting", True)):
        (root / name).mkdir(parents=True)
        if complete:
            (root / name / "trainer.pt").write_bytes(b"")
    assert [p.name for p in checkpoints.list_checkpoints(tmp_path)] == ["step_00000002", "step_00000010"]


def test_metrics_log_writes_jsonl_and_mirrors_to_wandb(tmp_path, monkeypatch):
    import dataclasses
    import types

    import config
    import train
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
    log = train.MetricsLog(tmp_path, cfg, rank=0)
    log.write(3, {"rollout/acc": 0.123456789, "train/tokens": 7}, tqdm(disable=True))
    log.close()
    assert read_metrics(tmp_path) == [{"step": 3, "rollout/acc": 0.123457, "train/tokens": 7}]
    assert calls[0][0] == "init" and calls[0][1]["config"]["loss"]["stare_w"] == cfg.loss.stare_w
    assert calls[0][1]["id"] == (tmp_path / "wandb_run_id").read_text() == "abc123"  # a resumed run continues it
    assert calls[1:] == [("log", 3, {"rollout/acc": 0.123456789, "train/tokens": 7}), ("finish",)]
    assert train.MetricsLog(tmp_path, cfg, rank=1).file is None  # only rank 0 writes


def checkpoint_weights(checkpoint):
    """The model tensors of a DCP checkpoint, read without a process group."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    target = checkpoint.parent / (checkpoint.name + ".pt")
    dcp_to_torch_save(checkpoint / "sharded", target)
    return torch.load(target, weights_only=False)["model"]


def test_nonfinite_loss_skips_the_step_then_stops_the_run(tiny_dir, tmp_path):
    def run(nan_steps, out, *overrides):
        args = ["tests/nan_train.py", nan_steps, "--config", "configs/tiny.yaml", f"model.path={tiny_dir / 'model'}",
                f"data.train_files=[{tiny_dir / 'data' / 'sum_train.jsonl'}]", "eval.files=[]",
                f"train.out_dir={out}", "train.save_every=1", "train.keep_last=10", "optim.max_nonfinite_steps=2",
                "train.micro_token_budget=100000", *overrides]  # one micro-batch, so policy_loss call k = step k
        return subprocess.run([sys.executable] + args, cwd=REPO, env=dict(os.environ, PYTHONPATH=str(REPO)),
                              capture_output=True, text=True, timeout=900)

    # one bad step: skipped (no update), counted, and the run goes on
    out = tmp_path / "one"
    completed = run("2", out, "train.total_steps=3")
    assert completed.returncode == 0, completed.stderr[-4000:]
    metrics = read_metrics(out)
    assert [m["train/skipped_updates"] for m in metrics] == [0, 1, 0]
    assert not math.isfinite(metrics[1]["train/loss"]) and not math.isfinite(metrics[1]["train/grad_norm"])
    assert all(math.isfinite(m["train/loss"]) and math.isfinite(m["train/grad_norm"]) for m in (metrics[0], metrics[2]))
    weights = [checkpoint_weights(out / "checkpoints" / f"step_{s:08d}") for s in (1, 2, 3)]
    assert all(torch.equal(weights[1][k], weights[0][k]) for k in weights[0])  # step 2 changed nothing
    assert not all(torch.equal(weights[2][k], weights[1][k]) for k in weights[0])  # step 3 trained again

    # more bad steps in a row than optim.max_nonfinite_steps: a clear error, the checkpoints before it intact
    out = tmp_path / "many"
    completed = run("2,3,4,5", out, "train.total_steps=6")
    assert completed.returncode != 0
    assert "non-finite loss or gradient norm in 3 consecutive steps (optim.max_nonfinite_steps=2)" in completed.stderr
    assert [p.name for p in checkpoints.list_checkpoints(out)] == [f"step_{s:08d}" for s in (1, 2, 3)]


def test_dynamic_sampling_gives_up_with_a_clear_error(tiny_dir, tmp_path):
    # every group of the tiny sum task is all-wrong or mixed; demanding 16 varied groups from one round of 16 fails
    completed = run_train(tiny_dir, tmp_path / "run", "algorithm.gen_batch_size=16", "algorithm.max_num_gen_batches=1",
                          "train.total_steps=1")
    assert completed.returncode != 0
    assert "dynamic sampling kept" in completed.stderr and "algorithm.max_num_gen_batches" in completed.stderr


def test_padded_batch_logits_match_unpadded_forwards(tiny_dir):
    # prompts left-padded and responses right-padded to shared widths: every row's response logits must equal
    # those of the row run alone without padding
    import train

    model = AutoModelForCausalLM.from_pretrained(tiny_dir / "model", dtype=torch.float32).eval()
    generator = torch.Generator().manual_seed(0)
    rows = [{"prompt": torch.randint(3, 300, (p,), generator=generator).tolist(),
             "response": torch.randint(3, 300, (r,), generator=generator).tolist()}
            for p, r in ((5, 9), (12, 3), (1, 1), (8, 0))]
    tensors = train.sequence_tensors(rows, pad_id=0, device=torch.device("cpu"))
    with torch.no_grad():
        logits = train.response_logits(model, tensors)
        for i, row in enumerate(rows):
            alone = model(input_ids=torch.tensor([row["prompt"] + row["response"]])).logits[0]
            want = alone[len(row["prompt"]) - 1:len(row["prompt"]) + len(row["response"]) - 1]
            got = logits[i, :len(row["response"])]
            assert torch.allclose(got, want, atol=1e-5), i
            assert tensors["mask"][i].sum() == len(row["response"])
            assert tensors["response_ids"][i, :len(row["response"])].tolist() == row["response"]


@pytest.mark.parametrize("budget", [1, 30, 64, 10_000])
def test_micro_batches_cover_every_row_once_within_the_budget(budget):
    import train

    generator = torch.Generator().manual_seed(budget)
    rows = [{"prompt": [1] * int(p), "response": [2] * int(r)}
            for p, r in zip(torch.randint(1, 20, (25,), generator=generator),
                            torch.randint(0, 20, (25,), generator=generator))]
    batches = train.micro_batches(rows, budget)
    assert sorted(i for batch in batches for i in batch) == list(range(len(rows)))
    for batch in batches:
        width = max(len(rows[i]["prompt"]) for i in batch) + max(max(1, len(rows[i]["response"])) for i in batch)
        assert len(batch) == 1 or len(batch) * width <= budget  # a row longer than the budget goes alone


def test_a_run_refuses_to_mix_with_another_trajectory(tiny_dir, tmp_path):
    out = tmp_path / "run"
    (out / "checkpoints" / "step_00000005").mkdir(parents=True)
    torch.save({"step": 5}, out / "checkpoints" / "step_00000005" / "trainer.pt")
    completed = run_train(tiny_dir, out, "train.resume=never")  # would start at 0 beside another run's step 5
    assert completed.returncode == 2 and "checkpoints after step 0" in completed.stderr
    completed = run_train(tiny_dir, out, f"train.resume={tmp_path / 'nowhere'}")
    assert completed.returncode == 2 and "is not a complete checkpoint" in completed.stderr
    assert sorted(p.name for p in out.iterdir()) == ["checkpoints"]  # nothing written


def test_tool_use_trains_end_to_end_with_tool_tokens_masked(tiny_dir, tmp_path):
    import tiny

    tiny.build_tiny_tool(tiny_dir)  # reused when complete
    out = tmp_path / "run"
    # the tiny tool model is never right; DAPO's overlong shaping makes rewards (and so advantages) differ anyway
    command = [sys.executable, "train.py", "--config", "configs/tiny_tool.yaml", f"model.path={tiny_dir / 'tool_model'}",
               f"data.train_files=[{tiny_dir / 'data' / 'mul_train.jsonl'}]", f"train.out_dir={out}",
               "train.total_steps=2", "reward.overlong_buffer_len=300", "reward.max_response_len=400",
               "rollout.sync_check_every=1", "optim.lr=1e-5"]
    completed = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=900)
    metrics = check_finished(completed, out)
    assert metrics[0]["rollout/tool_calls_mean"] > 0.3 and 0.1 < metrics[0]["rollout/tool_token_frac"] < 0.9
    for record in metrics:
        # the loss and every statistic count only the tokens the policy sampled
        responses = 8 * 4  # train_batch_size x n (no dynamic sampling)
        policy_tokens = record["rollout/response_length_mean"] * responses * (1 - record["rollout/tool_token_frac"])
        assert record["train/tokens"] == pytest.approx(policy_tokens, abs=0.5)
        assert record["rollout/logprob_mismatch_max"] < 1e-3  # tool tokens' rollout log-prob is a 0.0 placeholder
        assert record["rollout/sync_probe_error"] < 1e-4 and record["train/grad_norm"] > 0


def test_tool_tokens_get_no_gradient_no_selection_and_no_denominator():
    # rows as train.py builds them: policy_mask False at tool-result tokens; the batch mask comes from sequence_tensors
    import config
    import stare
    import train

    generator = torch.Generator().manual_seed(0)
    tool_masks = [[False, False, True, True, True, False, False], [False, True, True, False], [False] * 5]
    rows = [{"prompt": [5, 6, 7], "response": list(range(10, 10 + len(m))),
             "policy_mask": train.policy_token_mask(len(m), m)} for m in tool_masks]
    tensors = train.sequence_tensors(rows, pad_id=0, device=torch.device("cpu"))
    tool = train.pad_rows([{"t": m} for m in tool_masks], "t", tensors["response_width"], value=False, dtype=torch.bool)
    assert not (tensors["mask"] & tool).any() and tensors["mask"].sum() == sum(m.count(False) for m in tool_masks)

    shape = tensors["mask"].shape
    logprobs = (-torch.rand(shape, generator=generator) * 3).requires_grad_()
    batch = {"logprobs": logprobs, "old_logprobs": logprobs.detach() + 0.01 * torch.randn(shape, generator=generator),
             "entropy": torch.rand(shape, generator=generator), "advantages": torch.tensor([1.0, -1.0, 0.5]),
             "mask": tensors["mask"]}
    cfg = config.load("configs/tiny.yaml", ["loss.stare_top_ratio=1.0"])  # select every eligible token
    gate = stare.EntropyGate(target_entropy=10.0)  # on
    for method in ("stare", "kl_cov", "high_entropy"):
        selection, _ = baselines.token_selection(method, batch, cfg.loss, gate=gate, generator=generator)
        for name, chosen in selection.items():
            if chosen.dtype == torch.bool and name != "kept":
                assert not (chosen & tool).any(), (method, name)  # never a tool token
        loss, _ = baselines.policy_loss(method, batch, cfg.loss, selection=selection, gate=gate, generator=generator,
                                        num_tokens=float(tensors["mask"].sum()), num_sequences=3.0)
        (gradient,) = torch.autograd.grad(loss, logprobs)
        assert (gradient[tool] == 0).all() and (gradient[tensors["mask"]] != 0).any(), method
