"""Run by tests/test_train.py under `torchrun --nproc_per_node 2`: every method of
baselines.METHODS (and the VARIANTS below) through train.py's own start-up and steps, on one engine and one sharded model,
from a fresh gate (and controller) and trainer state, with the weight sync probed at every step:
two steps for the methods that carry state from step to step (STARE's gate, EntroPIC's
controller) and for GRPO and the variants, one for the others (their loss reads nothing of an
earlier step).
Writes each method's step metrics, with the parameters left unsharded after each step, as JSON,
and an HF export of the final weights.

    PYTHONPATH=. python -m torch.distributed.run --nproc_per_node 2 tests/methods_two_ranks.py \\
        RESULT_JSON CONFIG_YAML [section.key=value ...]

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
import stare
import train


# settings beyond the methods' defaults, run the same way on the same engine and model
VARIANTS = {
    # the reference's per-micro-batch selection, two optimizer steps per training step, a small
    # token budget
    "stare_micro_scope": ["algorithm.method=stare", "algorithm.selection_scope=micro",
                          "train.mini_batch_size=8", "train.micro_token_budget=600"]}
TWO_STEPS = {"grpo", "stare", "entropic", *VARIANTS}


def main(result_path, config_path, overrides):
    cfg = config.load(config_path, overrides)
    rank, world, device = runs.setup_distributed()
    lock = runs.RunLock(cfg.train.out_dir)
    run, _ = train.start_run(cfg, rank, world, device, lock)
    settings = {method: [f"algorithm.method={method}"] for method in baselines.METHODS}
    results = {}
    try:
        for method, changes in {**settings, **VARIANTS}.items():
            method_cfg = config.apply_overrides(cfg, changes)
            config.check(method_cfg, world_size=world)
            method_run = dataclasses.replace(run, cfg=method_cfg,
                                             gate=stare.EntropyGate(**vars(cfg.gate)),
                                             controller=train.entropy_controller(method_cfg))
            state = train.TrainerState()
            results[method] = []
            for step in (1, 2) if method in TWO_STEPS else (1,):
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
