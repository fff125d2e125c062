"""tools/trl_compare.py: `python -m tools.bench trl-compare`, train.py's step against TRL's
GRPOTrainer at equal work on the tiny default (TRL: `pip install -r requirements-bench.txt`).

    python -m tools.bench trl-compare [--tiny runs/tiny] [--steps 6] [--prompts 16] [--threads N]

Each side runs in a fresh process, one after the other; what is aligned and what is not: trl_trainer
and the report's "unequal_work". `--threads 1` when other jobs share the cores: every side then runs
one OpenMP thread (pin_threads). Measured numbers: docs/benchmarks.md.
"""

import json
import statistics
import time
from pathlib import Path

import torch

from tools.bench import REPO, run_train_py, stage_times, tiny_overrides

TRL_MISSING = (
    "trl-compare needs TRL (not in requirements.txt): pip install -r requirements-bench.txt")


def compare_overrides(prompts):
    """train.py overrides for equal work with TRL's GRPOTrainer: plain GRPO, every generated group
    trained on (no dynamic sampling: TRL has none), `prompts` prompts x rollout.n responses per
    step, one optimizer step each. rollout.n, rollout.max_tokens, the sampling and the optimizer are
    configs/tiny.yaml's (8, 16, T=1, AdamW)."""
    return [
        "algorithm.method=grpo", "algorithm.dynamic_sampling=false",
        f"algorithm.gen_batch_size={prompts}", f"train.train_batch_size={prompts}",
        f"train.mini_batch_size={prompts}"]


def compare_config(tiny_dir, prompts):
    """The resolved (and checked) config train.py runs with in trl-compare; TRL's settings are read from it too."""
    import config

    return config.load(REPO / "configs" / "tiny.yaml",
                       tiny_overrides(tiny_dir) + compare_overrides(prompts))


class TrlStepTimes:
    """Wall times of TRL's optimizer steps, and of the stages inside them, from a TrainerCallback (on_step_begin to
    on_step_end: generation, reward, loss forward/backward, clipping, AdamW; TRL's per-step logging, which comes
    after on_step_end, is left out) and from timing wrappers around the trainer's own methods (no behaviour change).
    Built inside the worker, where transformers is imported."""

    def __init__(self):
        from transformers import TrainerCallback

        self.steps, self.stages, self.begin = [], {}, None
        timer = self

        class Callback(TrainerCallback):
            def on_step_begin(self, args, state, control, **kwargs):
                timer.begin, timer.stages = time.perf_counter(), {}

            def on_step_end(self, args, state, control, **kwargs):
                timer.steps.append({"step_s": time.perf_counter() - timer.begin, **timer.stages})

        self.callback = Callback()

    def add(self, key, value):
        self.stages[key] = self.stages.get(key, 0.0) + value

    def wrap(self, owner, name, key, only_without_grad=False):
        """Replace owner.name (a bound method) by one that adds its wall time to `key` of the current step."""
        method = getattr(owner, name)

        def timed(*args, **kwargs):
            if only_without_grad and torch.is_grad_enabled():
                return method(*args, **kwargs)
            start = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                self.add(key, time.perf_counter() - start)

        setattr(owner, name, timed)


def trl_trainer(cfg, out_dir, steps, use_vllm, timer=None):
    """TRL's GRPOTrainer set up to do the work train.py does with `cfg` (compare_config), for
    `steps` steps.

    Aligned: the model directory (float32), the prompts (data.py's examples: the same chat messages, which TRL
    renders with the same chat template and generation prompt), the verifier (rewards.compute_rewards), n responses
    per prompt, max_tokens, temperature / top_p / top_k, group advantages (mean and std per group), no KL and no
    reference model, the clipped surrogate (clip_low / clip_high) averaged over every response token of the batch
    (TRL's "dapo" = our token-mean), one AdamW step per generation batch (on-policy), lr / betas / weight decay /
    gradient clipping, a constant learning rate, the seed. Nothing is logged to a service or saved.
    timer: a TrlStepTimes, which also counts the completions and response tokens TRL scores each step."""
    import datasets
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    import data
    import rewards

    examples = [e for path in cfg.data.train_files
                for e in data.load_examples(path, prompt_suffix=cfg.data.prompt_suffix)]
    tokenizer = AutoTokenizer.from_pretrained(cfg.model.path)
    _, _, stats = data.tokenize_prompts(
        examples, tokenizer, cfg.data.max_prompt_tokens, cfg.data.overflow)
    # TRL would not cut them as data.py does: unequal prompts
    if stats["num_truncated"] or stats["num_skipped"]:
        raise ValueError(
            f"prompts longer than data.max_prompt_tokens={cfg.data.max_prompt_tokens}: {stats}")
    # conversational rows: TRL applies the tokenizer's chat template with add_generation_prompt, as
    # data.py does
    dataset = datasets.Dataset.from_list([{"prompt": e.messages, "ground_truth": e.ground_truth,
                                           "data_source": e.data_source} for e in examples])

    def verifier(completions, completion_ids, ground_truth, data_source, **kwargs):
        """train.py's reward: rewards.compute_rewards on the decoded responses (special tokens
        skipped, like vLLM's text), routed to verify_sum by the tiny task's data_source."""
        # conversational: one assistant message per completion
        texts = [c[-1]["content"] for c in completions]
        if timer is not None:
            timer.add("completions", len(completion_ids))
            timer.add("response_tokens", sum(len(ids) for ids in completion_ids))
        scores, _, _ = rewards.compute_rewards(
            texts, ground_truth, data_source, [len(i) for i in completion_ids], cfg.reward)
        return scores

    completions = cfg.train.train_batch_size * cfg.rollout.n
    args = GRPOConfig(
        output_dir=str(out_dir),
        max_steps=steps,
        seed=cfg.train.seed,
        use_cpu=not torch.cuda.is_available(),  # the device train.py picks
        # the batch: TRL counts completions, not prompts. One generation batch of train_batch_size
        # prompts x n, one optimizer step on all of it (no accumulation), used once
        # (num_iterations=1): on-policy like train.py
        num_generations=cfg.rollout.n,
        per_device_train_batch_size=completions,
        gradient_accumulation_steps=1,
        steps_per_generation=1,
        num_iterations=1,
        shuffle_dataset=cfg.data.shuffle,
        # sampling
        max_completion_length=cfg.rollout.max_tokens,
        temperature=cfg.rollout.temperature,
        top_p=cfg.rollout.top_p,
        top_k=cfg.rollout.top_k,  # 0 = off in both
        # the loss: no KL (beta=0 also means no reference model), the clip-higher surrogate,
        # token-mean over the global batch ("dapo"), std-normalised group advantages, truncated
        # responses kept (as train.py does)
        beta=0.0,
        loss_type="dapo",
        epsilon=cfg.loss.clip_low,
        epsilon_high=cfg.loss.clip_high,
        scale_rewards="group" if cfg.algorithm.normalize_std else "none",
        mask_truncated_completions=False,
        # the optimizer: plain torch.optim.AdamW like train.py (TRL's default is the fused variant),
        # constant rate
        optim="adamw_torch",
        learning_rate=cfg.optim.lr,
        adam_beta1=cfg.optim.betas[0],
        adam_beta2=cfg.optim.betas[1],
        weight_decay=cfg.optim.weight_decay,
        max_grad_norm=cfg.optim.grad_clip,
        lr_scheduler_type="constant",
        warmup_steps=cfg.optim.warmup_steps,
        # float32 end to end, activation checkpointing as train.py's (off; TRL's defaults: bf16,
        # checkpointing on)
        bf16=False,
        fp16=False,
        gradient_checkpointing=cfg.model.gradient_checkpointing,
        disable_dropout=True,
        # nothing external, nothing saved; the loop's own metrics every step, as train.py's
        # metrics.jsonl
        report_to="none",
        save_strategy="no",
        logging_steps=1,
        disable_tqdm=True,
        log_completions=False,
        dataloader_num_workers=0,
        # vLLM colocated in this process (the trl_vllm variant), with train.py's engine's context
        # length
        use_vllm=use_vllm,
        vllm_mode="colocate",
        vllm_max_model_length=cfg.data.max_prompt_tokens + cfg.rollout.max_tokens)
    model = AutoModelForCausalLM.from_pretrained(cfg.model.path, dtype=torch.float32,
                                                 attn_implementation=cfg.model.attn_implementation)
    trainer = GRPOTrainer(
        model=model, reward_funcs=verifier, args=args, train_dataset=dataset,
        processing_class=tokenizer, callbacks=[timer.callback] if timer is not None else None)
    if timer is not None:
        # includes the vLLM weight sync, taken out below
        timer.wrap(trainer, "_generate_single_turn", "generate")
        timer.wrap(trainer, "_calculate_rewards", "reward")
        timer.wrap(
            trainer, "_get_per_token_logps_and_entropies", "old_logprobs", only_without_grad=True)
        if use_vllm:
            timer.wrap(trainer.vllm_generation, "sync_weights", "sync")
    return trainer


def trl_worker(args):
    """One TRL run in this (fresh) process; writes its step records, or the error that stopped it, to args.result."""
    import tempfile

    result = {}
    try:
        cfg = compare_config(args.tiny, args.prompts)
        timer = TrlStepTimes()
        with tempfile.TemporaryDirectory() as out_dir:
            trainer = trl_trainer(
                cfg, out_dir, args.steps, use_vllm=args.trl_worker == "vllm", timer=timer)
            start = time.perf_counter()
            trainer.train()
            result = {"train_s": time.perf_counter() - start, "steps": timer.steps}
            # TRL passes no dtype to vllm.LLM: record what the engine chose
            if args.trl_worker == "vllm":
                dtype = trainer.vllm_generation.llm.llm_engine.model_config.dtype
                result["engine_dtype"] = str(dtype).removeprefix("torch.")
    except Exception as error:  # reported by the parent, e.g. "trl_vllm": "unsupported on CPU: ..."
        message = (str(error).strip().splitlines() or [""])[0]  # its first line
        result = {"error": f"{type(error).__name__}: {message}"}
        raise
    finally:
        Path(args.result).write_text(json.dumps(result))


def run_trl(tiny_dir, steps, prompts, variant):
    """trl_worker in a fresh process, as train.py runs in one -> (its result dict, wall seconds of the process)."""
    import os
    import subprocess
    import sys
    import tempfile

    with tempfile.TemporaryDirectory() as scratch:
        result_path = Path(scratch) / "result.json"
        command = [
            sys.executable, "-m", "tools.bench", "trl-compare", f"--tiny={tiny_dir}",
            f"--steps={steps}", f"--prompts={prompts}", f"--trl-worker={variant}",
            f"--result={result_path}"]
        # everything is local
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
        start = time.perf_counter()
        completed = subprocess.run(command, cwd=REPO, capture_output=True, text=True, env=env)
        wall = time.perf_counter() - start
        result = json.loads(result_path.read_text()) if result_path.exists() else {}
    # died without a Python exception (a signal, vLLM)
    if completed.returncode != 0 and "error" not in result:
        lines = [line for line in completed.stderr.splitlines() if line.strip()]
        result = {"error": lines[-1] if lines else f"exit status {completed.returncode}"}
    return result, wall


def trl_summary(result, wall):
    """The TRL side of the report from trl_worker's step records, averaged over the steps after the first."""
    steps = result["steps"][1:]

    def mean(key):
        return statistics.mean(s.get(key, 0.0) for s in steps)

    summary = {
        "step_s": round(mean("step_s"), 3),
        "total_s": round(wall, 1),
        "completions_per_step": mean("completions"),
        "response_tokens_per_step": mean("response_tokens"),
        "generate_s": round(mean("generate") - mean("sync"), 3),
        "reward_s": round(mean("reward"), 3),
        "old_logprobs_s": round(mean("old_logprobs"), 3),
    }
    if "engine_dtype" in result:
        summary["sync_s"] = round(mean("sync"), 3)
        summary["engine_dtype"] = result["engine_dtype"]
    # the rest of the step: the loss forward and backward, clipping, AdamW, TRL's batch preparation
    # and metrics
    summary["update_and_rest_s"] = round(
        mean("step_s") - mean("generate") - mean("reward") - mean("old_logprobs"), 3)
    summary["tokens_per_s"] = round(summary["response_tokens_per_step"] / mean("step_s"), 1)
    return summary


def pin_threads(threads):
    """Make the processes started from here use `threads` OpenMP threads: torch reads
    OMP_NUM_THREADS at start-up, and vLLM's CPU worker (in-process, in train.py and in TRL's
    colocate mode) binds its OpenMP threads to the cores VLLM_CPU_OMP_THREADS_BIND lists instead of
    choosing them itself."""
    import os

    cores = sorted(os.sched_getaffinity(0))[:threads]
    os.environ.update(
        OMP_NUM_THREADS=str(threads), VLLM_CPU_OMP_THREADS_BIND=",".join(map(str, cores)))


def bench_trl_compare(args):
    import importlib.metadata
    import importlib.util
    import sys

    if args.trl_worker:
        return trl_worker(args)
    if importlib.util.find_spec("trl") is None:
        sys.exit(TRL_MISSING)
    if args.steps < 2:
        sys.exit(
            "trl-compare: --steps must be >= 2 (the first step of each side is start-up and not averaged)"
        )
    from tools import tiny

    if args.threads:
        pin_threads(args.threads)
    tiny.build_tiny(args.tiny)  # reused when complete
    cfg = compare_config(args.tiny, args.prompts)  # checks the settings before anything runs
    records, ours_wall = run_train_py(args.tiny, args.steps, compare_overrides(args.prompts))
    # on each side the first step pays for start-up (allocations, first calls), as in train-step
    steps = records[1:]
    stages = stage_times(steps)
    ours = {
        "step_s": stages.pop("step_s"),
        "total_s": round(ours_wall, 1),
        # tokens / mean length: the responses the step really trained on, not what the config
        # asked for
        "completions_per_step": round(
            statistics.mean(s["train/tokens"] / s["rollout/response_length_mean"] for s in steps), 2
        ),
        "response_tokens_per_step": statistics.mean(s["train/tokens"] for s in steps),
        **stages,
    }
    result = {
        "steps": args.steps,
        "steps_averaged": len(steps),
        "prompts_per_step": args.prompts,
        "n": cfg.rollout.n,
        "max_tokens": cfg.rollout.max_tokens,
        "threads": args.threads or torch.get_num_threads(),  # each side's OpenMP threads
        "versions": {
            name: importlib.metadata.version(name) for name in ("trl", "transformers", "torch")
        },
        "ours": ours,
    }
    # one after the other: never two at once
    for variant, key in (("hf", "trl"), ("vllm", "trl_vllm")):
        trl_result, wall = run_trl(args.tiny, args.steps, args.prompts, variant)
        if "error" in trl_result:
            if variant == "hf":  # the mandatory side
                raise RuntimeError(f"TRL's GRPOTrainer failed: {trl_result['error']}")
            result[key] = f"unsupported on CPU: {trl_result['error']}"
            continue
        result[key] = trl_summary(trl_result, wall)
        result[f"ratio_{key}_over_ours"] = round(result[key]["step_s"] / ours["step_s"], 2)
    result["measured"] = {
        "ours": "train.py in its own process; time/step of metrics.jsonl (rollout to the step's metrics; the "
        "checkpoint after the last step excluded), mean over steps 2..N; the stages are its time/* keys",
        "trl": "GRPOTrainer.train() in its own process; a TrainerCallback's on_step_begin -> on_step_end wall time "
        "(generation, reward, loss forward/backward, clipping, AdamW; TRL's per-step logging, after "
        "on_step_end, excluded), mean over steps 2..N; the stages from timing wrappers on the trainer's "
        "_generate_single_turn, _calculate_rewards, no-grad _get_per_token_logps_and_entropies and vLLM's "
        "sync_weights; update_and_rest_s is the step minus those",
        "total_s": "wall time of each side's whole process: imports, model (and engine) start-up, all steps, exit",
    }
    result["unequal_work"] = [
        "ours does a no-grad pass for the old log-probs (with entropy and entropy sensitivity, for its metrics); "
        "TRL's on-policy HF path skips it (old = current log-probs, detached); TRL with vLLM does it (its "
        "importance-sampling correction, on by default)",
        "ours samples with its vLLM engine and streams the new weights into it every step (sync_s), with a log-prob "
        f"probe every rollout.sync_check_every={cfg.rollout.sync_check_every} steps; TRL's HF path samples with "
        "model.generate on the training weights",
        "ours computes more per-step metrics (entropy dynamics, reflection counts, sampler/trainer log-prob "
        "mismatch); TRL computes entropy, clip fractions and reward statistics",
        f"ours dual-clips negative advantages (c={cfg.loss.dual_clip}); TRL does not (on-policy the ratio is 1)",
        f"ours splits the update into micro-batches of <= train.micro_token_budget={cfg.train.micro_token_budget} "
        "tokens; TRL runs the whole batch at once",
        "ours' total_s includes a final checkpoint and HF export; TRL saves nothing (save_strategy='no')",
        "TRL's colocated vLLM engine keeps vLLM's defaults where TRL exposes no setting: its dtype "
        f"(trl_vllm.engine_dtype; ours rollout.dtype={cfg.rollout.dtype}), torch.compile of the model (ours "
        f"rollout.enforce_eager={str(cfg.rollout.enforce_eager).lower()}), and a KV cache sized as a fraction of RAM "
        f"(vllm_gpu_memory_utilization; ours rollout.kv_cache_gib={cfg.rollout.kv_cache_gib}); it sends n requests "
        "of one sample per prompt where ours sends one request of n samples"]
    return result
