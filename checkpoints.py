"""checkpoints.py: sharded, atomic checkpoints for exact resume, and the Hugging Face export (used by train.py).

out_dir/checkpoints/step_00000010/   sharded/ (model + optimizer, one file per rank: torch.distributed.checkpoint),
                                     trainer.pt (step, data position, scheduler, gate, probe), rng_rank{r}.pt (every
                                     RNG of rank r), config.yaml (the resolved config of the run that wrote it)
A checkpoint is written under a hidden .tmp name and renamed once every rank has finished, so a run killed mid-save
never leaves a half checkpoint that looks complete; the newest step_* directory is the latest. With several nodes,
out_dir must be on a shared file system (every rank writes its own shard).
"""

import json
import os
import random
import re
import sys
from pathlib import Path

import numpy
import torch
import torch.distributed as dist

import config

CHECKPOINT_NAME = re.compile(r"step_(\d+)")


def list_checkpoints(out_dir):
    """Complete checkpoints under out_dir/checkpoints, oldest first (hidden .tmp / .deleting ones never count)."""
    root = Path(out_dir) / "checkpoints"
    found = [p for p in root.glob("step_*") if CHECKPOINT_NAME.fullmatch(p.name) and (p / "trainer.pt").exists()]
    return sorted(found, key=checkpoint_step)


def checkpoint_step(path):
    return int(CHECKPOINT_NAME.fullmatch(Path(path).name)[1])


def rng_states():
    """Every RNG of this process. No step draws from them today (sampling, data order and Clip-Cov's ties are seeded
    from (seed, step, index)); they are kept so that a change that does (dropout, say) still resumes exactly."""
    states = {"python": random.getstate(), "numpy": numpy.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        states["cuda"] = torch.cuda.get_rng_state()
    return states


def set_rng_states(states):
    random.setstate(states["python"])
    numpy.random.set_state(states["numpy"])
    torch.set_rng_state(states["torch"])
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state(states["cuda"])


def save_checkpoint(out_dir, step, model, optimizer, trainer_state, cfg, rank, world):
    """Every rank writes its shard into a hidden directory; rank 0 renames it once all are done, then prunes."""
    import shutil

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

    root = Path(out_dir) / "checkpoints"
    final, partial = root / f"step_{step:08d}", root / f".step_{step:08d}.tmp"
    if rank == 0:
        for leftover in root.glob(".step_*"):  # of runs killed while saving or pruning (possibly huge)
            shutil.rmtree(leftover, ignore_errors=True)
        partial.mkdir(parents=True)
    dist.barrier()
    # an optimizer that has not stepped yet has no state; get_state_dict would create it with a zero-lr step, and
    # the next real update would then use the wrong bias correction: save the model alone
    has_optimizer_state = bool(optimizer.state)
    if has_optimizer_state:
        model_state, optimizer_state = get_state_dict(model, optimizer)
        shards = {"model": model_state, "optimizer": optimizer_state}
    else:
        shards = {"model": get_model_state_dict(model)}
    dcp.save(shards, checkpoint_id=partial / "sharded")
    torch.save(rng_states(), partial / f"rng_rank{rank}.pt")
    if rank == 0:
        torch.save({**trainer_state, "world_size": world, "has_optimizer_state": has_optimizer_state},
                   partial / "trainer.pt")
        (partial / "config.yaml").write_text(config.to_yaml(cfg))
    dist.barrier()  # every shard is on disk
    if rank == 0:
        shutil.rmtree(final, ignore_errors=True)  # a checkpoint of the same step from an earlier attempt
        os.replace(partial, final)  # the atomic step: from here on this checkpoint counts
        for old in list_checkpoints(out_dir)[:-cfg.train.keep_last]:
            doomed = old.with_name("." + old.name + ".deleting")  # hidden first, so a half-deleted one never counts
            os.replace(old, doomed)
            shutil.rmtree(doomed, ignore_errors=True)
    dist.barrier()
    return final


def load_checkpoint(path, model, optimizer, rank):
    """Restore the model's shards (DCP reshards if the world size changed), the optimizer's when given and saved, and
    this rank's RNGs; -> the trainer state (step, data position, scheduler, gate, probe, ...)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (get_model_state_dict, get_state_dict, set_model_state_dict,
                                                         set_state_dict)

    path = Path(path)
    if not (path / "trainer.pt").exists():
        raise FileNotFoundError(f"{path} is not a complete checkpoint (no trainer.pt)")
    trainer_state = torch.load(path / "trainer.pt", weights_only=False)
    if optimizer is not None and trainer_state["has_optimizer_state"]:
        model_state, optimizer_state = get_state_dict(model, optimizer)
        shards = {"model": model_state, "optimizer": optimizer_state}
        dcp.load(shards, checkpoint_id=path / "sharded")
        set_state_dict(model, optimizer, model_state_dict=shards["model"], optim_state_dict=shards["optimizer"])
    else:
        shards = {"model": get_model_state_dict(model)}
        dcp.load(shards, checkpoint_id=path / "sharded")
        set_model_state_dict(model, shards["model"])
    rng_file = path / f"rng_rank{rank}.pt"
    if not rng_file.exists():  # fewer ranks wrote this checkpoint: the stream of random numbers will differ
        print(f"warning: {rng_file} missing (checkpoint written by {trainer_state['world_size']} ranks); "
              f"using rank 0's RNG state, so the resumed run is not bit-exact", file=sys.stderr)
        rng_file = path / "rng_rank0.pt"
    set_rng_states(torch.load(rng_file, weights_only=False))
    return trainer_state


def resume_path(cfg):
    """The checkpoint train.resume names: auto = the latest under out_dir (None when there is none), never = None."""
    if cfg.train.resume == "never":
        return None
    if cfg.train.resume == "auto":
        found = list_checkpoints(cfg.train.out_dir)
        return found[-1] if found else None
    return Path(cfg.train.resume)


def keep_metrics(path, last_step):
    """Rewrite metrics.jsonl with its records up to last_step (None: none, a fresh start), atomically; the records
    after it belong to the interrupted attempt and will be recomputed, a half-written line is dropped."""
    kept = []
    for line in (path.read_text().splitlines() if last_step is not None and path.exists() else []):
        try:
            if json.loads(line)["step"] <= last_step:
                kept.append(line)
        except (json.JSONDecodeError, KeyError, TypeError):
            continue
    partial = path.with_name(path.name + ".tmp")
    partial.write_text("".join(line + "\n" for line in kept))
    os.replace(partial, path)


def config_differences(old_yaml, cfg):
    """Keys whose value differs between a checkpoint's config and this run's (a resumed run should match)."""
    import yaml

    def flat(d, prefix=""):
        for k, v in d.items():
            if isinstance(v, dict):
                yield from flat(v, prefix + k + ".")
            else:
                yield prefix + k, v

    old, new = dict(flat(yaml.safe_load(old_yaml))), dict(flat(config.to_dict(cfg)))
    return sorted(k for k in old.keys() | new.keys() if old.get(k) != new.get(k))


def export_hf(model, cfg, tokenizer, path, rank):
    """The full model as a Hugging Face checkpoint (safetensors + config + tokenizer), written by rank 0."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from transformers import AutoConfig, AutoModelForCausalLM

    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank == 0:
        with torch.device("meta"):
            fresh = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(cfg.model.path))
        fresh.load_state_dict(state, assign=True)
        fresh.tie_weights()  # assign=True replaced the tied parameters with separate tensors
        fresh.to(getattr(torch, cfg.model.param_dtype)).save_pretrained(path)  # the dtype the model trained in
        tokenizer.save_pretrained(path)
    dist.barrier()
