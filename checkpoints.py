"""checkpoints.py: sharded, atomic checkpoints for exact resume, and the Hugging Face export (used
by train.py).

out_dir/checkpoints/step_00000010/ holds sharded/ (model + optimizer, one file per rank:
torch.distributed.checkpoint), trainer.pt (step, data position, scheduler, gate, probe),
rng_rank{r}.pt (every RNG of rank r), config.yaml (the resolved config of the run that wrote it)
and checksums.sha256 (the sha256 of every other file, written once they are).

A checkpoint is written under a hidden .tmp name and renamed once every rank has finished, so a
run killed mid-save never leaves a half checkpoint that looks complete; the newest step_* is the
latest. Its checksums are checked before anything of it loads (resume, --export, `python -m
tools.checkpoint verify`): bytes changed by a disk error or a bad copy of the right size are
found, not trained on. Removing checksums.sha256 does not turn this off (the rule): a checkpoint
without one loads (its files' sizes checked, with a warning) only if its run never had them, i.e.
its trainer.pt does not record "checksums": True (every checkpoint saved since does) and no
checkpoint beside it carries one; otherwise it is refused like a corrupt one. With several nodes,
out_dir must be on a shared file system (every rank writes its own shard).
"""

import hashlib
import os
import random
import re
import sys
from pathlib import Path

import numpy
import torch
import torch.distributed as dist

import config
from runs import RunError, agree, all_gather

CHECKPOINT_NAME = re.compile(r"step_(\d+)")
CHECKSUMS = "checksums.sha256"
# the files a rank writes (DCP names its shards __{rank}_{n}.distcp): that rank hashes them, at
# save and at load; rank 0 every other file
RANK_FILE = re.compile(r"(?:sharded/__|rng_rank)(\d+)(?:_\d+\.distcp|\.pt)")


def list_checkpoints(out_dir):
    """Complete checkpoints under out_dir/checkpoints, oldest first (no hidden .tmp / .deleting)."""
    found = [p for p in (Path(out_dir) / "checkpoints").glob("step_*")
             if CHECKPOINT_NAME.fullmatch(p.name) and (p / "trainer.pt").exists()]
    return sorted(found, key=checkpoint_step)


def checkpoint_step(path):
    return int(CHECKPOINT_NAME.fullmatch(Path(path).name)[1])


def rng_states():
    """Every RNG of this process. No step draws from them today (sampling, data order and Clip-Cov's
    ties are seeded from (seed, step, index)); they are kept so that a change that does (dropout,
    say) still resumes exactly."""
    states = {"python": random.getstate(), "numpy": numpy.random.get_state(),
              "torch": torch.get_rng_state()}
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
    """Every rank writes its shard into a hidden directory and hashes the files it wrote; rank 0
    writes the checksums, renames the directory once all are done, then prunes."""
    import shutil

    import torch.distributed.checkpoint as dcp

    root = Path(out_dir) / "checkpoints"
    final, partial = root / f"step_{step:08d}", root / f".step_{step:08d}.tmp"
    if rank == 0:
        for leftover in root.glob(".step_*"):  # of runs killed saving or pruning (maybe huge)
            shutil.rmtree(leftover, ignore_errors=True)
        partial.mkdir(parents=True)
    dist.barrier()
    # an optimizer that has not stepped has no state; get_state_dict would create it with a zero-lr
    # step, and the next real update would use the wrong bias correction: save the model alone
    has_optimizer_state = bool(optimizer.state)
    shards = _state(model, optimizer if has_optimizer_state else None)

    def write():
        dcp.save(shards, checkpoint_id=partial / "sharded")
        torch.save(rng_states(), partial / f"rng_rank{rank}.pt")
        if rank == 0:
            torch.save(
                {**trainer_state, "world_size": world, "has_optimizer_state": has_optimizer_state,
                 "checksums": True},  # carries checksums.sha256: without it, refused
                partial / "trainer.pt")
            (partial / "config.yaml").write_text(config.to_yaml(cfg))

    _, failure = _on_every_rank(write, rank)
    if failure is None:
        hashes, failure = _on_every_rank(lambda: {  # {relative path: sha256} of this rank's share
            name: file_sha256(partial / name)
            for name in files_of_rank(checkpoint_files(partial), rank, world)}, rank)
    if failure is None:
        every_hash = {name: digest for share in hashes for name, digest in share.items()}
        _, failure = _on_every_rank(
            lambda: write_checksums(partial, every_hash) if rank == 0 else None, rank)
    if failure is not None:
        if rank == 0:
            shutil.rmtree(partial, ignore_errors=True)
        dist.barrier()
        free = shutil.disk_usage(root).free / 2**20
        full = " (the file system is full)" if free < 64 else ""
        previous = list_checkpoints(out_dir)
        raise RunError(
            f"error: saving the checkpoint of step {step} to {root} failed ({failure}; "
            f"{free:.0f} MiB free there{full}); its partial files were removed, and "
            f"{previous[-1] if previous else 'no earlier checkpoint'} and metrics.jsonl are as "
            f"they were")
    if rank == 0:
        shutil.rmtree(final, ignore_errors=True)  # the same step's, from an earlier attempt
        os.replace(partial, final)  # the atomic step: from here on this checkpoint counts
        for old in list_checkpoints(out_dir)[:-cfg.train.keep_last]:
            # hidden first, so a half-deleted one never counts
            doomed = old.with_name("." + old.name + ".deleting")
            os.replace(old, doomed)
            shutil.rmtree(doomed, ignore_errors=True)
    dist.barrier()
    return final


def _on_every_rank(work, rank):
    """work() on this rank -> (every rank's result, the first failure of any rank as a line, or
    None). A collective: every rank learns of a failure instead of waiting for the rank that had it.
    A full disk shows as any of the errors caught (torch's zip writer: "unexpected pos"; DCP wraps
    its writers' errors in a CheckpointException, which derives from BaseException)."""
    from torch.distributed.checkpoint.api import CheckpointException

    result, failure = None, None
    try:
        result = work()
    except (OSError, RuntimeError, CheckpointException) as error:
        failure = f"rank {rank}: {_cause(error)}"
    gathered = all_gather((failure, result))
    return [r for _, r in gathered], next((f for f, _ in gathered if f is not None), None)


def _cause(error):
    """"Type: its first line" of an error, DCP's CheckpointException unwrapped to the writer's or
    reader's error ({rank: error} in its `failures`)."""
    cause = next(iter(getattr(error, "failures", {}).values()), error)
    cause = cause[0] if isinstance(cause, tuple) else cause
    return f"{type(cause).__name__}: " + (str(cause).strip().splitlines() or [""])[0][:300]


def _state(model, optimizer):
    """The state DCP saves and loads: {"model": ...}, and "optimizer" unless optimizer is None."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

    if optimizer is None:
        return {"model": get_model_state_dict(model)}
    return dict(zip(("model", "optimizer"), get_state_dict(model, optimizer)))


def file_sha256(path):
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def checkpoint_files(checkpoint):
    """Every file of a checkpoint but its checksums: sorted relative paths ('sharded/.metadata')."""
    checkpoint = Path(checkpoint)
    return sorted(p.relative_to(checkpoint).as_posix() for p in checkpoint.rglob("*")
                  if p.is_file() and p.name != CHECKSUMS)


def files_of_rank(names, rank, world):
    """The share of `names` that `rank` hashes: the files it wrote (its shards and RNG file; with
    another world size, those of rank number mod world), and on rank 0 every other file."""
    matches = [(name, RANK_FILE.fullmatch(name)) for name in names]
    return [name for name, match in matches if (int(match[1]) % world if match else 0) == rank]


def write_checksums(checkpoint, hashes):
    with open(Path(checkpoint) / CHECKSUMS, "w") as f:
        f.writelines(f"{digest}  {name}\n" for name, digest in sorted(hashes.items()))
        f.flush()
        os.fsync(f.fileno())


def read_checksums(checkpoint):
    """{relative path: sha256} from a checkpoint's checksums.sha256; None when it has none (saved
    before checksums were written). RunError naming the line that cannot be read."""
    path = Path(checkpoint) / CHECKSUMS
    if not path.exists():
        return None
    hashes = {}
    try:
        lines = path.read_text().splitlines()
    except (OSError, UnicodeDecodeError) as error:
        raise RunError(f"error: {path} cannot be read ({type(error).__name__}: {error})") from None
    for number, line in enumerate(lines, 1):
        digest, _, name = line.partition("  ")
        if not re.fullmatch(r"[0-9a-f]{64}", digest) or not name:
            raise RunError(f"error: {path}:{number} is not a line of sha256 checksums: "
                           f"{line[:80]!r}")
        hashes[name] = digest
    return hashes


def verify_checksums(checkpoint, rank=0, world=1):
    """RunError naming the first file of this rank's share that is missing or changed since the
    save, or checksums.sha256 when the module docstring's rule needs it; -> False when the rule
    lets the checkpoint go without (nothing verified), True when every file of the share matches."""
    expected = read_checksums(checkpoint)
    if expected is None:
        had = _run_had_checksums(checkpoint)
        if had:
            raise RunError(f"error: {Path(checkpoint) / CHECKSUMS} is missing, but {had}: its "
                           f"bytes cannot be verified")
        return False
    # a file a load could read (a shard, an RNG file) that the save did not write
    unlisted = [name for name in set(checkpoint_files(checkpoint)) - set(expected)
                if name.startswith("sharded/") or name.endswith(".pt") or name == "config.yaml"]
    if unlisted and rank == 0:
        raise RunError(f"error: {Path(checkpoint) / sorted(unlisted)[0]} is not listed in "
                       f"{Path(checkpoint) / CHECKSUMS} (added after the save)")
    for name in files_of_rank(sorted(expected), rank, world):
        path = Path(checkpoint) / name
        if not path.is_file():
            raise RunError(f"error: {path} is missing (listed in {CHECKSUMS})")
        try:
            digest = file_sha256(path)
        except OSError as error:  # every rank must reach the gather that follows
            raise RunError(f"error: {path} cannot be read ({error.strerror})") from None
        if digest != expected[name]:
            raise RunError(
                f"error: {path} does not match its sha256 in {CHECKSUMS}: its bytes changed "
                f"after the save (a disk error or a bad copy)")
    return True


def _run_had_checksums(checkpoint):
    """Why a checkpoint without checksums.sha256 must have had one (a phrase), or None: its
    trainer.pt records it, or a checkpoint beside it carries one."""
    if read_trainer_state(checkpoint).get("checksums"):
        return "its trainer.pt records that it was saved with one"
    carriers = sorted(p.parent.name for p in Path(checkpoint).parent.glob("step_*/" + CHECKSUMS))
    return f"{carriers[-1]} of the same run carries one" if carriers else None


def load_checkpoint(path, model, optimizer, rank):
    """Restore the model's shards (DCP reshards if the world size changed), the optimizer's when
    given and saved, and this rank's RNGs; -> the trainer state (step, data position, scheduler,
    gate, probe, ...). RunError in one line when the checkpoint holds another model's tensors or
    cannot be read."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_state_dict

    path = Path(path)
    trainer_state = read_trainer_state(path)
    shards = _state(model, optimizer if trainer_state["has_optimizer_state"] else None)
    check_shapes(path, shards["model"])
    try:
        dcp.load(shards, checkpoint_id=path / "sharded")
        if "optimizer" in shards:
            set_state_dict(model, optimizer, model_state_dict=shards["model"],
                           optim_state_dict=shards["optimizer"])
        else:
            set_model_state_dict(model, shards["model"])
        rng_file = path / f"rng_rank{rank}.pt"
        if not rng_file.exists():
            print(
                f"warning: {rng_file} missing (checkpoint written by {trainer_state['world_size']} "
                f"ranks); using rank 0's RNG state, so the resumed run is not bit-exact",
                file=sys.stderr)
            rng_file = path / "rng_rank0.pt"
        set_rng_states(torch.load(rng_file, weights_only=False))
    except (Exception, CheckpointException) as error:
        # what the checks before cannot see; DCP's CheckpointException derives from BaseException
        raise RunError(f"error: {path} cannot be loaded ({_cause(error)}); name an earlier one "
                       f"with train.resume=PATH") from None
    return trainer_state


def check_shapes(checkpoint, model_state, shared_only=False):
    """RunError when the checkpoint's model tensors are not this model's (another size or
    architecture), from DCP's index of shapes (no data read). model_state: name -> .shape, or before
    the model exists model.path's (shared_only: names the model never loads are not compared)."""
    saved = read_index(checkpoint).state_dict_metadata
    for name, tensor in model_state.items():
        entry = saved.get(f"model.{name}")
        if entry is None and shared_only:
            continue
        shape = getattr(entry, "size", None)
        if entry is None or list(shape) != list(tensor.shape):
            held = "no such tensor" if entry is None else f"shape {list(shape)}"
            raise RunError(
                f"error: {checkpoint} was saved from another model: its {name} has {held}, the "
                f"model.path model's has shape {list(tensor.shape)}; resume with the same model "
                f"(or another train.out_dir)")


def read_trainer_state(checkpoint):
    """trainer.pt of a checkpoint; RunError naming the file when it is missing or cannot be read."""
    path = Path(checkpoint) / "trainer.pt"
    if not path.exists():
        raise RunError(f"error: {checkpoint} is not a complete checkpoint (no trainer.pt)")
    try:
        return torch.load(path, weights_only=False)
    except Exception as error:  # a truncated or corrupt file: EOFError, zip or unpickling errors
        raise RunError(f"error: {path} cannot be read ({type(error).__name__}: {error})") from None


def read_index(checkpoint):
    """DCP's index of a checkpoint (sharded/.metadata); RunError when it cannot be read."""
    import torch.distributed.checkpoint as dcp

    sharded = Path(checkpoint) / "sharded"
    try:
        return dcp.FileSystemReader(str(sharded)).read_metadata()
    except Exception as error:  # missing or corrupt .metadata: pickling, EOF or OS errors
        raise RunError(f"error: {sharded}/.metadata cannot be read ({type(error).__name__}: "
                       f"{error})") from None


def check_files(checkpoint):
    """RunError naming the first file of a checkpoint that is missing or shorter than its index says
    (a save cut short, a truncated copy): DCP's metadata lists every tensor's file, offset and
    length, so this reads no data."""
    sharded = Path(checkpoint) / "sharded"
    needed = {}
    for info in read_index(checkpoint).storage_data.values():
        needed[info.relative_path] = max(
            needed.get(info.relative_path, 0), info.offset + info.length)
    for name, size in sorted(needed.items()):
        path = sharded / name
        if not path.is_file():
            raise RunError(f"error: {path} is missing (the checkpoint's index lists it)")
        if path.stat().st_size < size:
            raise RunError(
                f"error: {path} is truncated ({path.stat().st_size} bytes, its index needs {size})")
    if not list(Path(checkpoint).glob("rng_rank*.pt")):
        raise RunError(f"error: {checkpoint} has no rng_rank*.pt")


def resume_checkpoint(cfg, check_later=True, rank=0):
    """The checkpoint train.resume names (auto: out_dir's latest that passes usable_step, None
    when there is none; never: None; else that path); with auto, one that fails is skipped with a
    warning naming the file. RunError when a named checkpoint cannot be used, with auto when every
    one fails (unless train.start_over_if_unusable), or (check_later) when out_dir holds
    checkpoints after the start step: another trajectory, which pruning and `resume: auto` would
    mix with this one."""
    out_dir, resume = Path(cfg.train.out_dir), cfg.train.resume
    checkpoint, start_step, unreadable = None, 0, {}
    if resume == "auto":
        for candidate in reversed(list_checkpoints(out_dir)):
            try:
                start_step, checkpoint = usable_step(candidate, rank), candidate
                break
            except RunError as error:
                unreadable[candidate] = str(error).removeprefix("error: ")
                if rank == 0:
                    print(f"warning: {unreadable[candidate]}; falling back to the checkpoint "
                          f"before it", file=sys.stderr)
        # a false alarm in every checkpoint (a verifier's bug, a file system's hiccup) must not
        # discard a whole run: nothing has been written or deleted yet
        if unreadable and checkpoint is None and not cfg.train.start_over_if_unusable:
            raise RunError(
                f"error: no checkpoint in {out_dir / 'checkpoints'} passes its checks, so the run "
                f"stops with all of them intact: " + "; ".join(unreadable.values())
                + "; name one with train.resume=PATH, or set train.start_over_if_unusable=true to "
                "train from step 0 (replacing them)")
    elif resume != "never":
        checkpoint = Path(resume)
        try:
            start_step = usable_step(checkpoint, rank)
        except RunError as error:
            raise RunError(f"{error} (train.resume={resume!r})") from None
    later = [p.name for p in list_checkpoints(out_dir)
             if checkpoint_step(p) > start_step and p not in unreadable]
    if check_later and later:
        raise RunError(
            f"error: {out_dir}/checkpoints holds checkpoints after step {start_step}, where this "
            f"run starts (train.resume={resume!r}): {', '.join(later)}; use another train.out_dir "
            f"or delete them")
    return checkpoint


def agreed_checkpoint(cfg, check_later=True, rank=0):
    """resume_checkpoint's choice, the same on every rank (a collective): RunError in one line
    naming the ranks and what each saw when their views of out_dir/checkpoints differ (a node-local
    out_dir, a stale copy), before the choice's own collectives, or when their choices do."""
    same_on_every_rank(f"different checkpoints in {Path(cfg.train.out_dir) / 'checkpoints'}",
                       ", ".join(p.name for p in list_checkpoints(cfg.train.out_dir)) or "none")
    checkpoint = resume_checkpoint(cfg, check_later, rank)
    chosen = "none (a fresh start)" if checkpoint is None else (
        f"{checkpoint} at step {read_trainer_state(checkpoint)['step']}")
    same_on_every_rank("different checkpoints to resume", chosen)
    return checkpoint


def same_on_every_rank(what, seen):
    """RunError on every rank unless `seen` (a string) is the same on all."""
    gathered = all_gather(seen)
    if len(set(gathered)) > 1:
        ranks = {value: [str(r) for r, v in enumerate(gathered) if v == value]
                 for value in dict.fromkeys(gathered)}
        raise RunError(
            f"error: the ranks see {what}: " + "; ".join(
                f"rank{'s' if len(r) > 1 else ''} {', '.join(r)}: {value}"
                for value, r in ranks.items())
            + "; every rank must see the same train.out_dir (a shared file system)")


def usable_step(checkpoint, rank=0):
    """The step of a checkpoint that passes every check that reads no tensor into a model: its
    checksums (each rank of a process group its share), its index and files' sizes, trainer.pt.
    RunError naming the file otherwise, on every rank."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    problem, verified = None, False
    try:
        verified = verify_checksums(checkpoint, rank, world)
        check_files(checkpoint)
        step = read_trainer_state(checkpoint)["step"]
    except RunError as error:
        problem = str(error)
    agree(problem)  # every rank raises, or none
    if not verified and rank == 0:
        print(f"warning: {checkpoint} has no {CHECKSUMS} (saved before checkpoints carried "
              f"them): only its files' sizes are checked", file=sys.stderr)
    return step


def export_hf(model, cfg, tokenizer, path, rank):
    """The full model as a Hugging Face checkpoint (safetensors + config + tokenizer), written by
    rank 0. Each parameter is gathered alone and in the dtype the model trained in
    (model.param_dtype), as the weight sync does: the device holds one such parameter at a time
    (never a float32 copy), rank 0's host the model once."""
    import rollout
    from transformers import AutoConfig, AutoModelForCausalLM

    dtype = getattr(torch, cfg.model.param_dtype)
    state = {name: tensor.cpu() for name, tensor in rollout.full_parameters(model, dtype)
             if rank == 0}
    if rank == 0:
        with torch.device("meta"):
            fresh = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(cfg.model.path))
        fresh.load_state_dict(state, assign=True)
        fresh.tie_weights()  # assign=True replaced the tied parameters with separate tensors
        fresh.to(dtype).save_pretrained(path)
        tokenizer.save_pretrained(path)
    dist.barrier()
