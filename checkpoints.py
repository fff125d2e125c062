"""checkpoints.py: sharded, atomic checkpoints for exact resume, and the Hugging Face export (used
by train.py).

out_dir/checkpoints/step_00000010/   sharded/ (model + optimizer, one file per rank: torch.distributed.checkpoint),
                                     trainer.pt (step, data position, scheduler, gate, probe), rng_rank{r}.pt (every
                                     RNG of rank r), config.yaml (the resolved config of the run that wrote it)
A checkpoint is written under a hidden .tmp name and renamed once every rank has finished, so a run killed mid-save
never leaves a half checkpoint that looks complete; the newest step_* directory is the latest. With several nodes,
out_dir must be on a shared file system (every rank writes its own shard).
"""

import os
import random
import re
import sys
from pathlib import Path

import numpy
import torch
import torch.distributed as dist

import config
from runs import RunError

CHECKPOINT_NAME = re.compile(r"step_(\d+)")


def list_checkpoints(out_dir):
    """Complete checkpoints under out_dir/checkpoints, oldest first (hidden .tmp / .deleting ones never count)."""
    root = Path(out_dir) / "checkpoints"
    found = [
        p
        for p in root.glob("step_*")
        if CHECKPOINT_NAME.fullmatch(p.name) and (p / "trainer.pt").exists()
    ]
    return sorted(found, key=checkpoint_step)


def checkpoint_step(path):
    return int(CHECKPOINT_NAME.fullmatch(Path(path).name)[1])


def rng_states():
    """Every RNG of this process. No step draws from them today (sampling, data order and Clip-Cov's
    ties are seeded from (seed, step, index)); they are kept so that a change that does (dropout,
    say) still resumes exactly."""
    states = {
        "python": random.getstate(),
        "numpy": numpy.random.get_state(),
        "torch": torch.get_rng_state(),
    }
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
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

    root = Path(out_dir) / "checkpoints"
    final, partial = root / f"step_{step:08d}", root / f".step_{step:08d}.tmp"
    if rank == 0:
        # of runs killed while saving or pruning (possibly huge)
        for leftover in root.glob(".step_*"):
            shutil.rmtree(leftover, ignore_errors=True)
        partial.mkdir(parents=True)
    dist.barrier()
    # an optimizer that has not stepped yet has no state; get_state_dict would create it with a
    # zero-lr step, and the next real update would then use the wrong bias correction: save the
    # model alone
    has_optimizer_state = bool(optimizer.state)
    if has_optimizer_state:
        model_state, optimizer_state = get_state_dict(model, optimizer)
        shards = {"model": model_state, "optimizer": optimizer_state}
    else:
        shards = {"model": get_model_state_dict(model)}
    failure = None
    try:
        dcp.save(shards, checkpoint_id=partial / "sharded")
        torch.save(rng_states(), partial / f"rng_rank{rank}.pt")
        if rank == 0:
            torch.save(
                {**trainer_state, "world_size": world, "has_optimizer_state": has_optimizer_state},
                partial / "trainer.pt",
            )
            (partial / "config.yaml").write_text(config.to_yaml(cfg))
    # a full disk shows as any of these (torch's zip writer: "unexpected pos"; DCP wraps its
    # writers' errors in a CheckpointException, which derives from BaseException)
    except (OSError, RuntimeError, CheckpointException) as error:
        # DCP's: {rank: the writer's error}
        cause = next(iter(getattr(error, "failures", {}).values()), error)
        cause = cause[0] if isinstance(cause, tuple) else cause
        failure = f"rank {rank}: {type(cause).__name__}: {(str(cause).strip().splitlines() or [''])[0][:300]}"
    failures = [None] * world
    # every shard is on disk, or every rank learns which one is not
    dist.all_gather_object(failures, failure)
    failures = [f for f in failures if f is not None]
    if failures:
        if rank == 0:
            shutil.rmtree(partial, ignore_errors=True)
        dist.barrier()
        free = shutil.disk_usage(root).free / 2**20
        full = " (the file system is full)" if free < 64 else ""
        previous = list_checkpoints(out_dir)
        raise RunError(
            f"error: saving the checkpoint of step {step} to {root} failed ({failures[0]}; {free:.0f} MiB "
            f"free there{full}); its partial files were removed, and "
            f"{previous[-1] if previous else 'no earlier checkpoint'} and metrics.jsonl are as they were"
        )
    if rank == 0:
        # a checkpoint of the same step from an earlier attempt
        shutil.rmtree(final, ignore_errors=True)
        os.replace(partial, final)  # the atomic step: from here on this checkpoint counts
        for old in list_checkpoints(out_dir)[:-cfg.train.keep_last]:
            # hidden first, so a half-deleted one never counts
            doomed = old.with_name("." + old.name + ".deleting")
            os.replace(old, doomed)
            shutil.rmtree(doomed, ignore_errors=True)
    dist.barrier()
    return final


def load_checkpoint(path, model, optimizer, rank):
    """Restore the model's shards (DCP reshards if the world size changed), the optimizer's when
    given and saved, and this rank's RNGs; -> the trainer state (step, data position, scheduler,
    gate, probe, ...)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_state_dict,
        set_model_state_dict,
        set_state_dict,
    )

    path = Path(path)
    if not (path / "trainer.pt").exists():
        raise FileNotFoundError(f"{path} is not a complete checkpoint (no trainer.pt)")
    trainer_state = torch.load(path / "trainer.pt", weights_only=False)
    if optimizer is not None and trainer_state["has_optimizer_state"]:
        model_state, optimizer_state = get_state_dict(model, optimizer)
        shards = {"model": model_state, "optimizer": optimizer_state}
        dcp.load(shards, checkpoint_id=path / "sharded")
        set_state_dict(
            model, optimizer, model_state_dict=shards["model"], optim_state_dict=shards["optimizer"]
        )
    else:
        shards = {"model": get_model_state_dict(model)}
        dcp.load(shards, checkpoint_id=path / "sharded")
        set_model_state_dict(model, shards["model"])
    rng_file = path / f"rng_rank{rank}.pt"
    # fewer ranks wrote this checkpoint: the stream of random numbers will differ
    if not rng_file.exists():
        print(
            f"warning: {rng_file} missing (checkpoint written by {trainer_state['world_size']} ranks); "
            f"using rank 0's RNG state, so the resumed run is not bit-exact",
            file=sys.stderr,
        )
        rng_file = path / "rng_rank0.pt"
    set_rng_states(torch.load(rng_file, weights_only=False))
    return trainer_state


def read_trainer_state(checkpoint):
    """trainer.pt of a checkpoint; RunError naming the file when it is missing or cannot be read."""
    path = Path(checkpoint) / "trainer.pt"
    if not path.exists():
        raise RunError(f"error: {checkpoint} is not a complete checkpoint (no trainer.pt)")
    try:
        return torch.load(path, weights_only=False)
    except Exception as error:  # a truncated or corrupt file: EOFError, zip or unpickling errors
        raise RunError(f"error: {path} cannot be read ({type(error).__name__}: {error})") from None


def check_files(checkpoint):
    """RunError naming the first file of a checkpoint that is missing or shorter than its index says
    (a save cut short, a truncated copy): DCP's metadata lists every tensor's file, offset and
    length, so this reads no data."""
    import torch.distributed.checkpoint as dcp

    sharded = Path(checkpoint) / "sharded"
    try:
        metadata = dcp.FileSystemReader(str(sharded)).read_metadata()
    except Exception as error:  # missing or corrupt .metadata: pickling, EOF or OS errors
        raise RunError(
            f"error: {sharded}/.metadata cannot be read ({type(error).__name__}: {error})"
        ) from None
    needed = {}
    for info in metadata.storage_data.values():
        needed[info.relative_path] = max(
            needed.get(info.relative_path, 0), info.offset + info.length
        )
    for name, size in sorted(needed.items()):
        path = sharded / name
        if not path.is_file():
            raise RunError(f"error: {path} is missing (the checkpoint's index lists it)")
        if path.stat().st_size < size:
            raise RunError(
                f"error: {path} is truncated ({path.stat().st_size} bytes, its index needs {size})"
            )
    if not list(Path(checkpoint).glob("rng_rank*.pt")):
        raise RunError(f"error: {checkpoint} has no rng_rank*.pt")


def resume_checkpoint(cfg, check_later=True, rank=0):
    """The checkpoint train.resume names (auto: out_dir's latest readable one, None when there is
    none; never: None; else that path). With auto, an unreadable checkpoint is skipped with a
    warning for the one before it. Raises RunError when a named checkpoint cannot be used, or
    (check_later) when out_dir holds checkpoints after the step this run would start at: they belong
    to another trajectory, which pruning and `resume: auto` would mix with this one."""
    out_dir, resume = Path(cfg.train.out_dir), cfg.train.resume
    checkpoint, start_step, unreadable = None, 0, []
    if resume == "auto":
        for candidate in reversed(list_checkpoints(out_dir)):
            try:
                step = read_trainer_state(candidate)["step"]
                check_files(candidate)
            except RunError as error:
                unreadable.append(candidate)
                if rank == 0:
                    print(
                        f"warning: {error}; falling back to the checkpoint before it",
                        file=sys.stderr,
                    )
                continue
            start_step, checkpoint = step, candidate
            break
    elif resume != "never":
        checkpoint = Path(resume)
        try:
            start_step = read_trainer_state(checkpoint)["step"]
            check_files(checkpoint)
        except RunError as error:
            raise RunError(f"{error} (train.resume={resume!r})") from None
    later = [
        p.name
        for p in list_checkpoints(out_dir)
        if checkpoint_step(p) > start_step and p not in unreadable
    ]
    if check_later and later:
        raise RunError(
            f"error: {out_dir}/checkpoints holds checkpoints after step {start_step}, where this run "
            f"starts (train.resume={resume!r}): {', '.join(later)}; use another train.out_dir "
            f"or delete them"
        )
    return checkpoint


def export_hf(model, cfg, tokenizer, path, rank):
    """The full model as a Hugging Face checkpoint (safetensors + config + tokenizer), written by
    rank 0. Each parameter is gathered alone and in the dtype the model trained in
    (model.param_dtype), as the weight sync does: the device holds one such parameter at a time
    (never a float32 copy), rank 0's host the model once."""
    import rollout
    from transformers import AutoConfig, AutoModelForCausalLM

    state = {}
    for name, tensor in rollout.full_parameters(model, getattr(torch, cfg.model.param_dtype)):
        if rank == 0:
            state[name] = tensor.cpu()
    if rank == 0:
        with torch.device("meta"):
            fresh = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(cfg.model.path))
        fresh.load_state_dict(state, assign=True)
        fresh.tie_weights()  # assign=True replaced the tied parameters with separate tensors
        fresh.to(getattr(torch, cfg.model.param_dtype)).save_pretrained(path)
        tokenizer.save_pretrained(path)
    dist.barrier()
