"""runs.py: the plumbing of one run (used by train.py): its errors, its lock on out_dir, its metrics
log, the stop signals, and what a resume keeps of the metrics and checks of the config.

    lock = runs.RunLock(out_dir)       # lock.acquire(): one run per out_dir (a stale lock is taken)
    log = runs.MetricsLog(out_dir, cfg, rank)  # metrics.jsonl, console line, wandb / TensorBoard
    stop = runs.StopSignals()          # SIGTERM / SIGUSR1 / SIGINT: finish the step, save, exit
    raise runs.RunError("error: ...")  # a run that cannot start or go on: one line, exit 2
"""

import atexit
import contextlib
import ctypes
import dataclasses
import datetime
import errno
import functools
import json
import os
import pickle
import signal
import socket
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist


class RunError(Exception):
    """A run that cannot start or go on (a bad checkpoint, a clash with another run, a failed save):
    one line for the user, and nothing that the run wrote before is lost."""


class RunLock:
    """One run per out_dir: out_dir/run.lock holds the pid and host of the run that owns it. A lock
    left by a process that no longer runs on this host (killed) is stale and taken over; one held on
    another host is not (a shared file system: that run may be alive)."""

    def __init__(self, out_dir):
        self.path = Path(out_dir) / "run.lock"
        self.held = False

    def acquire(self):
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as error:
            raise RunError(f"error: train.out_dir {self.path.parent} cannot be created "
                           f"({error.strerror})") from None
        for _ in range(2):
            try:
                descriptor = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
            except FileExistsError:
                try:
                    pid, _, host = self.path.read_text().strip().partition(" ")
                except FileNotFoundError:  # released between the two calls: try again
                    continue
                if host == socket.gethostname() and pid.isdigit() and not process_alive(int(pid)):
                    self.path.unlink(missing_ok=True)  # stale: its run was killed
                    continue
                raise RunError(
                    f"error: train.out_dir {self.path.parent} is in use by the run with pid {pid} "
                    f"on host {host} ({self.path}); wait for it to end or use another "
                    f"train.out_dir (delete the lock only if that run is gone)") from None
            except OSError as error:
                raise RunError(
                    f"error: cannot create the lock {self.path} ({error.strerror})") from None
            self.held = True
            try:
                with os.fdopen(descriptor, "w") as f:
                    f.write(f"{os.getpid()} {socket.gethostname()}\n")
            except OSError as error:
                self.release()
                raise RunError(
                    f"error: cannot write the lock {self.path} ({error.strerror})") from None
            return
        raise RunError(f"error: could not take the lock {self.path}")

    def release(self):
        if self.held:
            self.path.unlink(missing_ok=True)
            self.held = False


def process_alive(pid):
    """Whether a process of this host's pid namespace has this pid (another user's counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's
        return True
    return True


def keep_metrics(path, last_step):
    """Rewrite metrics.jsonl with its records up to last_step, atomically; the records after it
    belong to the interrupted attempt and will be recomputed, a half-written line is dropped.
    A line that is not a record is dropped with a warning naming it.
    last_step None (a fresh start): an existing non-empty metrics.jsonl is kept as metrics.jsonl.N,
    never deleted -> that path, or None."""
    kept, path = [], Path(path)
    if last_step is None:
        backup = None
        if path.exists() and path.read_text().strip():
            backup = next(path.with_name(f"{path.name}.{i}") for i in range(1, 10**6)
                          if not path.with_name(f"{path.name}.{i}").exists())
            os.replace(path, backup)
        path.write_text("")
        return backup
    for number, line in enumerate(path.read_text().splitlines() if path.exists() else [], 1):
        try:
            if json.loads(line)["step"] <= last_step:
                kept.append(line)
        except (json.JSONDecodeError, KeyError, TypeError) as error:  # a run killed mid-line, say
            print(f"warning: {path}:{number} is not a metrics record ({type(error).__name__}: "
                  f"{error}); dropped", file=sys.stderr)
    partial = path.with_name(path.name + ".tmp")
    partial.write_text("".join(line + "\n" for line in kept))
    os.replace(partial, path)
    return None


def config_differences(old_yaml, cfg):
    """Keys whose value differs between a checkpoint's config and this run's config.Config (a
    resumed run should match)."""
    import yaml

    def flat(d, prefix=""):
        for k, v in d.items():
            if isinstance(v, dict):
                yield from flat(v, prefix + k + ".")
            else:
                yield prefix + k, v

    old, new = dict(flat(yaml.safe_load(old_yaml))), dict(flat(dataclasses.asdict(cfg)))
    return sorted(k for k in old.keys() | new.keys() if old.get(k) != new.get(k))


class MetricsLog:
    """metrics.jsonl (one object per step, rank 0), a console line every log_every steps, and wandb
    / TensorBoard when the config turns them on (optional imports; config.check makes sure they are
    installed)."""

    CONSOLE_KEYS = (
        "rollout/acc_before_filter", "rollout/acc", "eval/overall/avg@n", "train/entropy",
        "train/loss", "stare/gate_on", "train/grad_norm", "time/step")

    def __init__(self, out_dir, cfg, rank, first_step=1):
        self.rank, self.log_every = rank, cfg.train.log_every
        self.path, self.descriptor = Path(out_dir) / "metrics.jsonl", None
        if rank == 0:
            try:
                self.descriptor = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            except OSError as error:
                raise RunError(f"error: cannot write {self.path} ({error.strerror})") from None
        self.wandb_run = self.tensorboard = None
        if rank == 0 and cfg.train.wandb:
            # one W&B run per out_dir, continued on resume (repeated steps keep their first values
            # there: W&B ignores steps it has seen)
            import wandb
            id_file = Path(out_dir) / "wandb_run_id"
            run_id = id_file.read_text().strip() if id_file.exists() else wandb.util.generate_id()
            id_file.write_text(run_id)
            self.wandb_run = wandb.init(
                project=cfg.train.wandb_project, name=Path(out_dir).name, id=run_id, resume="allow",
                dir=str(out_dir), config=dataclasses.asdict(cfg))
        if rank == 0 and cfg.train.tensorboard:
            from torch.utils.tensorboard import SummaryWriter
            # purge_step: the old events of the steps a resume recomputes are dropped
            self.tensorboard = SummaryWriter(
                str(Path(out_dir) / "tensorboard"), purge_step=first_step)

    def write(self, step, metrics, progress):
        if self.rank != 0:
            return
        record = {"step": step,
                  **{k: (round(v, 6) if isinstance(v, float) else v) for k, v in metrics.items()}}
        self._append((json.dumps(record) + "\n").encode(), step)
        if self.wandb_run is not None:
            self.wandb_run.log(metrics, step=step)
        if self.tensorboard is not None:
            for key, value in metrics.items():
                self.tensorboard.add_scalar(key, value, step)
            self.tensorboard.flush()
        progress.set_postfix(
            acc=metrics.get("rollout/acc_before_filter"), entropy=metrics.get("train/entropy"),
            gate=metrics.get("stare/gate_on"), refresh=False)
        if step % self.log_every == 0:
            progress.write(f"step {step}: " + " ".join(
                f"{k}={metrics[k]:.4g}" for k in self.CONSOLE_KEYS if k in metrics))

    def _append(self, line, step):
        """One whole line or none: a write that fails (a full disk) is cut back off the file."""
        size = os.fstat(self.descriptor).st_size
        try:
            written = 0
            while written < len(line):
                count = os.write(self.descriptor, line[written:])
                if count == 0:
                    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
                written += count
        except OSError as error:
            with contextlib.suppress(OSError):
                os.ftruncate(self.descriptor, size)
            raise RunError(
                f"error: step {step}: writing {self.path} failed ({error.strerror}); its partial "
                f"line was removed, the checkpoints are as they were") from None

    def close(self):
        if self.descriptor is not None:
            os.close(self.descriptor)
            self.descriptor = None
        if self.wandb_run is not None:
            self.wandb_run.finish()
        if self.tensorboard is not None:
            self.tensorboard.close()


class StopSignals:
    """SIGTERM, SIGUSR1 (e.g. SLURM's --signal=USR1@300) and SIGINT ask the run to finish its step,
    save and exit. A second Ctrl-C stops at once; a repeated SIGTERM does not (a scheduler may
    signal every process and torchrun forward the same signal again). Under torchrun pass
    --shutdown-timeout longer than a step plus a save: torchrun SIGKILLs its workers 30 s after
    forwarding a signal."""

    def __init__(self):
        self.received = []
        for signum in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT):
            signal.signal(signum, self._request)

    def _request(self, signum, frame):
        self.received.append(signum)
        if signum == signal.SIGINT:
            signal.signal(signum, signal.SIG_DFL)

    @property
    def requested(self):
        return bool(self.received)

    @property
    def signal_number(self):
        """The first signal received; SIGTERM when another rank's signal stopped this one."""
        return self.received[0] if self.received else signal.SIGTERM


# --------------------------------------------------------------------------------------------------
# Distributed plumbing (a single process is a group of one) and step timing
# --------------------------------------------------------------------------------------------------


def exit_process(code):
    """sys.exit(code) minus the interpreter's teardown, whose collections take ~2 s after vLLM."""
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    ctypes.CDLL(None).fflush(None)  # and what C and C++ code printed into stdio's buffers
    os._exit(code)


def setup_distributed(timeout_minutes=60):
    """A process group in every case (a single process gets a group of one), so one code path serves
    both. Collectives wait timeout_minutes for the slowest rank (a long rollout tail, math-verify,
    the first compile)."""
    if "RANK" not in os.environ:  # plain `python train.py`: a local group of one
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(port))
    use_cuda = torch.cuda.is_available()
    device = torch.device(f"cuda:{int(os.environ['LOCAL_RANK'])}" if use_cuda else "cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    dist.init_process_group(
        "nccl" if use_cuda else "gloo", timeout=datetime.timedelta(minutes=timeout_minutes))
    return dist.get_rank(), dist.get_world_size(), device


def world_size():
    return dist.get_world_size() if dist.is_initialized() else 1


def all_reduce(values, device, op=dist.ReduceOp.SUM):
    """Numbers (floats or 0-dim tensors) by key, reduced over ranks in one collective -> floats."""
    keys = sorted(values)
    stacked = torch.stack(
        [torch.as_tensor(values[k], dtype=torch.float64, device=device) for k in keys])
    if dist.is_initialized():
        dist.all_reduce(stacked, op=op)
    return dict(zip(keys, stacked.tolist()))


def agree(problem):
    """Raise RunError on every rank when any rank found a problem (a collective: all ranks call)."""
    problems = [p for p in all_gather(problem) if p is not None]
    if problems:
        raise RunError(problems[0])


def all_gather(obj):
    """Every rank's obj, in rank order (pickled, through host memory: host_group). Each rank's
    pickle moves at its own size, one broadcast per rank: all_gather_object pads every rank's to
    the largest, world x it (the ranks of a tensor-parallel engine send nothing but one's)."""
    if not dist.is_initialized():
        return [obj]
    group, rank = host_group(dist.group.WORLD), dist.get_rank()
    payload = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
    sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(dist.get_world_size())]
    dist.all_gather(sizes, torch.tensor([payload.numel()]), group=group)
    gathered = []
    for source, size in enumerate(sizes):
        buffer = payload if source == rank else torch.empty(int(size), dtype=torch.uint8)
        dist.broadcast(buffer, src=source, group=group)
        gathered.append(pickle.loads(buffer.numpy()))
    return gathered


def group_timeout(group=None):
    """How long a collective of `group` (None: the default group) waits for the slowest rank."""
    group = group or dist.group.WORLD
    return group._get_backend(group._device_types[0]).options._timeout


def align_timeouts():
    """Every process group of this process waits as long as the default group (the run's
    train.nccl_timeout_minutes): vLLM's engine makes its own groups with torch's defaults (NCCL 10,
    gloo 30 minutes; its engine arguments distributed_timeout_seconds and
    cpu_distributed_timeout_seconds). Call after building the engine."""
    timeout = group_timeout()
    for group in list(dist.distributed_c10d._world.pg_map):
        if group_timeout(group) != timeout:
            dist.distributed_c10d._set_pg_timeout(timeout, group)


@functools.cache
def host_group(world_group):
    """A gloo group of `world_group`'s ranks (the default group), made once, with its timeout:
    objects exchanged while the engine holds the GPU (a step's sampled groups) go through host
    memory, where NCCL's all_gather_object stages world x the largest pickle on the GPU
    (distributed_c10d.py). None: the group is gloo already. A collective the first time: all ranks
    call it at the same point."""
    if dist.get_backend(world_group) == "gloo":
        return None
    return dist.new_group(backend="gloo", timeout=group_timeout(world_group))


def add_sums(sums, values):
    """sums[k] += values[k] for every key (a new key starts at values[k])."""
    for key, value in values.items():
        sums[key] = sums[key] + value if key in sums else value


class Timer:
    """`with timer("time/x"):` adds the block's wall time to timer.times["time/x"]."""

    def __init__(self):
        self.times = {}

    @contextlib.contextmanager
    def __call__(self, key):
        start = time.time()
        yield
        add_sums(self.times, {key: time.time() - start})
