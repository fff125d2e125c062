"""Run by tests/test_train.py under `torchrun --nproc_per_node 2`: every method of
baselines.METHODS on top of every policy loss of baselines.POLICY_LOSSES it composes with (and the
VARIANTS below) through train.py's own start-up and steps, on one engine and one sharded model,
from fresh method states and trainer state, with the weight sync probed at every step: two steps
each. Results are keyed by method (PPO-clip) or "method+loss".
Writes each method's step metrics, with the parameters left unsharded after each step, as JSON,
and an HF export of the final weights.

    PYTHONPATH=. python -m torch.distributed.run --nproc_per_node 2 tests/methods_two_ranks.py \\
        ppo_clip|other_losses RESULT_JSON CONFIG_YAML [section.key=value ...]

ppo_clip: every method on PPO-clip, and the VARIANTS; other_losses: every allowed method on each
other policy loss (two process pairs, so that the suite runs them side by side).

One process pair for all methods, not one per method: the start-up (imports, engine, model) is
most of a tiny run's cost. train.py's loop around the steps (metrics file, checkpoints, export,
resume) is checked by the other tests of tests/test_train.py.
"""

import dataclasses
import json
import sys
from pathlib import Path

import torch.distributed as dist
from torch.distributed.tensor import DTensor

import baselines
import checkpoints
import config
import grpo
import rollout
import runs
import train


# settings beyond the methods' defaults, run the same way on the same engine and model
VARIANTS = {
    # the reference's per-micro-batch selection, two optimizer steps per training step, a small
    # token budget
    "stare_micro_scope": ["algorithm.method=stare", "algorithm.selection_scope=micro",
                          "train.mini_batch_size=4", "train.micro_token_budget=250"]}


def settings(part):
    """part "ppo_clip": every method on PPO-clip, then the VARIANTS; "other_losses": every allowed
    method x other policy loss -> {name: config overrides}."""
    combinations = {}
    losses = ("ppo_clip",) if part == "ppo_clip" else baselines.POLICY_LOSSES[1:]
    for loss in losses:
        for method in baselines.METHODS:
            if baselines.refused_combination(method, loss) is None:
                name = method if loss == "ppo_clip" else f"{method}+{loss}"
                combinations[name] = [f"algorithm.method={method}", f"loss.policy_loss={loss}"]
    return {**combinations, **VARIANTS} if part == "ppo_clip" else combinations


def main(part, result_path, config_path, overrides):
    cfg = config.load(config_path, overrides)
    rank, world, device = runs.setup_distributed()
    lock = runs.RunLock(cfg.train.out_dir)
    run, _ = train.start_run(cfg, rank, world, device, lock)
    results = {}
    try:
        for method, changes in settings(part).items():
            method_cfg = config.apply_overrides(cfg, changes)
            config.check(method_cfg, world_size=world)
            method_run = dataclasses.replace(run, cfg=method_cfg,
                                             states=baselines.method_states(method_cfg))
            state = train.TrainerState()
            results[method] = []
            for step in (1, 2):
                metrics = grpo.train_step(method_run, state, step)
                problem = train.sync_guard(metrics, method_cfg, step)
                assert problem is None, f"{method}, step {step}: {problem}"
                gathered = [name for name, parameter in run.model.named_parameters()
                            if not isinstance(parameter, DTensor)]
                results[method].append({"step": step, **metrics, "gathered_parameters": gathered})
        checkpoints.export_hf(run.model, cfg, run.tokenizer, Path(cfg.train.out_dir) / "hf", rank)
    finally:
        lock.release()
        rollout.shutdown_engine(run.engine)
    if rank == 0:
        Path(result_path).write_text(json.dumps(results, default=float))
    if dist.is_initialized():  # shutting the engine down may have ended the group (train.main)
        dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4:])
    runs.exit_process(0)
