"""tools/bench.py, tools/trl_compare.py and tools/gpu_smoke.py: trl-compare keeps TRL optional and
sets its GRPOTrainer up to do the work of grpo.py's step; gpu-smoke's engine cycles run on CPU as
they will on a GPU (sleep mode aside), and the command says it needs CUDA."""

import argparse
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import data
import forked
from tools import bench, trl_compare


def test_bench_does_not_import_trl():
    # a fresh interpreter: another test may already have imported trl into this one
    code = "import sys; from tools import bench, trl_compare; assert 'trl' not in sys.modules and 'transformers' not in sys.modules"
    subprocess.run(
        [sys.executable, "-c", code], check=True, cwd=Path(bench.__file__).resolve().parents[1])


def test_trl_compare_without_trl_names_the_requirements_file(monkeypatch):
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *rest: None if name == "trl" else real_find_spec(name, *rest))
    args = argparse.Namespace(
        trl_worker=None, tiny="unused", steps=6, prompts=16, threads=None, result=None)
    with pytest.raises(SystemExit) as exit_info:
        trl_compare.bench_trl_compare(args)
    assert "pip install -r requirements-bench.txt" in str(exit_info.value.code)


def test_trl_step_does_the_work_of_ours(tiny_dir, tmp_path):
    pytest.importorskip("trl")
    prompts, steps = 4, 2  # a small batch keeps it fast; trl-compare uses 16
    cfg = trl_compare.compare_config(tiny_dir, prompts)
    # ours, from the config train.py runs with: every group of the one generation round is trained
    # on, in one step
    assert cfg.algorithm.method == "grpo" and not cfg.algorithm.dynamic_sampling
    assert (
        cfg.algorithm.gen_batch_size
        == cfg.train.train_batch_size
        == cfg.train.mini_batch_size
        == prompts)
    completions = prompts * cfg.rollout.n

    timer = trl_compare.TrlStepTimes()
    trainer = trl_compare.trl_trainer(cfg, tmp_path, steps, use_vllm=False, timer=timer)
    args = trainer.args
    # one generation batch of the same size per optimizer step, used once (on-policy), no KL /
    # reference model
    assert args.generation_batch_size == args.per_device_train_batch_size == completions
    assert (args.steps_per_generation, args.gradient_accumulation_steps, args.num_iterations) == (
        1, 1, 1)
    assert (
        args.num_generations == cfg.rollout.n
        and args.max_completion_length == cfg.rollout.max_tokens)
    assert (args.temperature, args.top_p, args.top_k) == (
        cfg.rollout.temperature, cfg.rollout.top_p, cfg.rollout.top_k)
    assert args.beta == 0.0 and trainer.ref_model is None
    assert (args.learning_rate, args.lr_scheduler_type) == (cfg.optim.lr, "constant")
    assert not args.gradient_checkpointing and not args.bf16 and not args.fp16
    assert all(p.dtype == torch.float32 for p in trainer.model.parameters())
    # the same prompt token ids as data.py gives train.py
    examples = data.load_examples(cfg.data.train_files[0], prompt_suffix=cfg.data.prompt_suffix)
    ours_ids, _, _ = data.tokenize_prompts(
        examples, trainer.processing_class, cfg.data.max_prompt_tokens)
    trl_ids, _, _ = trainer._tokenize_prompts([e.messages for e in examples])
    assert [list(ids) for ids in trl_ids] == ours_ids

    trainer.train()
    assert len(timer.steps) == steps
    # what TRL scored each step: every completion, within the response budget
    for step in timer.steps:
        assert step["completions"] == completions
        assert 0 < step["response_tokens"] <= completions * cfg.rollout.max_tokens
        # on-policy: no no-grad pass
        assert step["step_s"] > step["generate"] > 0 and "old_logprobs" not in step
    # the report averages the steps after the first
    summary = trl_compare.trl_summary({"steps": timer.steps}, wall=0.0)
    assert summary["completions_per_step"] == completions
    assert summary["response_tokens_per_step"] == timer.steps[1]["response_tokens"]


def test_update_runs_train_stages_on_cpu():
    # the tiny shape through train.py's stages in a fresh process (it starts its own process group)
    completed = forked.run("-m", ["tools.bench", "update", "--size", "tiny", "--rows", "6",
                                  "--max-response", "40", "--budget", "60", "--repeats", "1"],
                           timeout=300)
    assert completed.returncode == 0, completed.stderr[-3000:]
    result = json.loads(completed.stdout.strip().splitlines()[-1])
    assert result["padding_share"] == 0.0 and result["micro_batches"] >= 2
    for method in ("stare", "grpo"):
        assert result[method]["finite_gradients"] and result[method]["update"]["s"] > 0
    assert "stare_over_grpo_update" in result


def test_gpu_smoke_runs_its_cycles_to_its_json_on_cpu(tmp_path):
    # the command itself, to its end: generate -> update -> wake/sync -> probe, twice, with
    # train.py's own functions, a real engine (vLLM's CPU build, bfloat16) against a float32
    # trainer; the engine's shutdown ends the process group, and the command still finishes (the
    # GPU adds sleep mode, CUDA graphs, the free-memory readings, its tests and `update`)
    completed = forked.run("-m", ["tools.bench", "gpu-smoke", "--cpu", "--out",
                                  tmp_path / "smoke.json"], timeout=600)
    assert completed.returncode == 0, completed.stderr[-3000:]
    reports = json.loads(completed.stdout.strip().splitlines()[-1])
    assert json.loads((tmp_path / "smoke.json").read_text()) == reports
    assert reports["ok"] and reports["device"] == "cpu"
    report = reports["engine"]
    assert report["ok"] and report["failures"] == [], report["failures"]
    assert report["runner"] == "v1" and report["engine_dtype"] == "torch.bfloat16"
    assert [c["cycle"] for c in report["cycles"]] == [1, 2]
    for cycle in report["cycles"]:
        # bf16 rounding, not a missed sync
        assert 0 < cycle["probe_error"] < 0.05 and cycle["probe_tokens"] > 0
        assert cycle["logprob_mismatch_mean"] < 0.05 and cycle["skipped"] == 0
        # the probe's forward gathers the root unit only; after rollout.sync_engine all is sharded
        assert cycle["resharded"] and cycle["probe_gathered"]
        assert not any(".layers." in name for name in cycle["probe_gathered"])
    # without vLLM (gpu-smoke on a machine that lacks it): the same trainer side on random responses
    trainer = reports["trainer"]
    assert trainer["ok"] and [c["cycle"] for c in trainer["cycles"]] == [1, 2]
    for cycle in trainer["cycles"]:
        assert cycle["resharded"] and cycle["skipped"] == 0 and cycle["grad_norm"] > 0
        assert cycle["probe_gathered"] and not any(".layers." in n for n in cycle["probe_gathered"])


def test_gpu_smoke_without_cuda_says_so_in_one_line():
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    completed = subprocess.run(
        [sys.executable, "-m", "tools.bench", "gpu-smoke"], capture_output=True, text=True,
        cwd=Path(bench.__file__).resolve().parents[1], timeout=120)
    assert completed.returncode == 2 and completed.stdout == ""
    assert completed.stderr.strip().splitlines() == [
        'gpu-smoke needs CUDA: run it on a GPU machine (docs/benchmarks.md, "A new GPU machine")']


def test_a_resume_allocates_what_the_plan_says_per_parameter():
    # checkpoints.load_checkpoint into a fresh model and optimizer, measured (the peak resident
    # set over the float32 shards) on a ~33M-parameter Qwen2.5 shape: zero gradients and AdamW's
    # moments (DCP's _init_optim_state) and foreach AdamW's sqrt temporary, as plan.py's resume
    # phase counts them; without vLLM or math-verify, as on a GPU machine that lacks them
    blocked = ("import sys; sys.modules.update(vllm=None, math_verify=None); "
               "sys.argv[1:] = ['resume-memory', '--size', 'small']; "
               "from tools import bench; bench.main()")
    completed = subprocess.run(
        [sys.executable, "-c", blocked], capture_output=True, text=True, timeout=300,
        cwd=Path(bench.__file__).resolve().parents[1], env=dict(os.environ, OMP_NUM_THREADS="2"))
    assert completed.returncode == 0, completed.stderr[-3000:]
    result = json.loads(completed.stdout.strip().splitlines()[-1])
    assert result["planned_bytes_per_parameter"] == 16
    assert abs(result["peak_bytes_per_parameter"] - 16) < 1.0
    # what stays: the two moments (the gradients are freed, the temporary too)
    assert result["moment_bytes_per_parameter"] == 8
    assert abs(result["held_bytes_per_parameter"] - 8) < 1.0
