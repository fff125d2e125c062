"""Run by tests/test_train.py under `torchrun --nproc_per_node 2`: every method of
baselines.METHODS on top of every policy loss of baselines.POLICY_LOSSES it composes with (and the
VARIANTS below) through train.py's own start-up and steps, on one engine and one sharded model,
from fresh method states and trainer state: two steps each. Results are keyed by method (PPO-clip)
or "method+loss". On PPO-clip the weight sync is probed at every step; the other losses run at
half the batch without the probe (OTHER_LOSSES), their sampler/trainer gap checked instead.
Writes each setting's step metrics, with the parameters left unsharded after each step, as JSON,
and an HF export of the final weights.

    PYTHONPATH=. python -m torch.distributed.run --nproc_per_node 2 tests/methods_two_ranks.py \\
        RESULT_JSON CONFIG_YAML [section.key=value ...]

One process pair for all settings, not one per setting: the start-up (imports, engine, model) is
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
# the combinations with the other losses: 4 prompts a step, no sync probe (PPO-clip's probe it)
OTHER_LOSSES = ["rollout.sync_check_every=0", "train.train_batch_size=4",
                "train.mini_batch_size=4", "algorithm.gen_batch_size=8"]


def settings():
    """Every method on PPO-clip, the VARIANTS, then every allowed method on each other loss ->
    {name: config overrides}."""
    on_ppo_clip, on_others = {}, {}
    for loss in baselines.POLICY_LOSSES:
        for method in baselines.METHODS:
            if baselines.refused_combination(method, loss) is None:
                changes = [f"algorithm.method={method}", f"loss.policy_loss={loss}"]
                if loss == "ppo_clip":
                    on_ppo_clip[method] = changes
                else:
                    on_others[f"{method}+{loss}"] = changes + OTHER_LOSSES
    return {**on_ppo_clip, **VARIANTS, **on_others}


def main(result_path, config_path, overrides):
    cfg = config.load(config_path, overrides)
    rank, world, device = runs.setup_distributed()
    lock = runs.RunLock(cfg.train.out_dir)
    run, _ = train.start_run(cfg, rank, world, device, lock)
    results = {}
    try:
        for method, changes in settings().items():
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
    main(sys.argv[1], sys.argv[2], sys.argv[3:])
    runs.exit_process(0)
