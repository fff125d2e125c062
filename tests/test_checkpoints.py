"""checkpoints.py: nothing a run wrote is lost by a fault: the out_dir lock, metrics kept on a fresh
start, an unreadable checkpoint skipped for the one before it, a failed save cleaned up with a clear
reason."""

import errno
import json
import os
import socket
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

import checkpoints
import config
import forked
import runs


def write_trainer_state(out_dir, step, corrupt=False):
    """A complete checkpoint directory of a small model (DCP shards, one RNG file, trainer.pt)."""
    import torch.distributed.checkpoint as dcp

    path = out_dir / "checkpoints" / f"step_{step:08d}"
    path.mkdir(parents=True)
    dcp.save(
        {"model": {"weight": torch.arange(4096.0), "bias": torch.ones(3)}},
        checkpoint_id=path / "sharded")
    torch.save({}, path / "rng_rank0.pt")
    if corrupt:
        (path / "trainer.pt").write_bytes(b"PK\x03\x04 truncated")
    else:
        torch.save({"step": step}, path / "trainer.pt")
    return path


def test_one_run_per_out_dir_and_a_stale_lock_is_taken_over(tmp_path):
    first, second = runs.RunLock(tmp_path / "run"), runs.RunLock(tmp_path / "run")
    first.acquire()
    with pytest.raises(runs.RunError, match=f"in use by the run with pid {os.getpid()} on host"):
        second.acquire()
    first.release()
    second.acquire()  # free again
    second.release()
    # a lock left by a process that is gone (killed) does not block the next run
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    (tmp_path / "run" / "run.lock").write_text(f"{gone.pid} {socket.gethostname()}\n")
    first.acquire()
    assert (tmp_path / "run" / "run.lock").read_text().split()[0] == str(os.getpid())
    first.release()
    # one held on another host may be alive: not taken over
    (tmp_path / "run" / "run.lock").write_text("1 another-host\n")
    with pytest.raises(runs.RunError, match="another-host"):
        first.acquire()


def test_a_fresh_start_keeps_earlier_metrics_and_a_resume_drops_only_later_steps(tmp_path, capsys):
    path = tmp_path / "metrics.jsonl"
    path.write_text(
        "".join(json.dumps({"step": s, "x": s}) + "\n" for s in range(1, 6)) + '{"step": 6, "x"')
    assert runs.keep_metrics(path, 3) is None
    assert f"warning: {path}:6 is not a metrics record (JSONDecodeError" in capsys.readouterr().err
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [1, 2, 3]
    # no checkpoint to resume from: start over, keeping the old file
    kept = runs.keep_metrics(path, None)
    assert kept == tmp_path / "metrics.jsonl.1" and len(kept.read_text().splitlines()) == 3
    assert path.read_text() == ""
    path.write_text('{"step": 1}\n')
    # never overwrites a backup
    assert runs.keep_metrics(path, None) == tmp_path / "metrics.jsonl.2"
    assert runs.keep_metrics(path, None) is None  # an empty file needs no backup


def test_an_unreadable_checkpoint_falls_back_to_the_one_before(tmp_path, capsys):
    cfg = config.load("configs/tiny.yaml", [f"train.out_dir={tmp_path}"])
    write_trainer_state(tmp_path, 2)
    write_trainer_state(tmp_path, 4, corrupt=True)
    assert checkpoints.resume_checkpoint(cfg).name == "step_00000002"
    assert "step_00000004/trainer.pt cannot be read" in capsys.readouterr().err
    named = config.load(
        "configs/tiny.yaml",
        [f"train.out_dir={tmp_path}", f"train.resume={tmp_path / 'checkpoints' / 'step_00000004'}"])
    with pytest.raises(runs.RunError, match="cannot be read.*train.resume="):
        # a checkpoint named explicitly is used or refused, never replaced
        checkpoints.resume_checkpoint(named)
    with pytest.raises(
        runs.RunError, match="checkpoints after step 0.*step_00000002, step_00000004"):
        checkpoints.resume_checkpoint(config.load("configs/tiny.yaml", [f"train.out_dir={tmp_path}",
                                                                        "train.resume=never"]))


def test_a_truncated_or_missing_shard_is_found_before_anything_loads(tmp_path, capsys):
    cfg = config.load("configs/tiny.yaml", [f"train.out_dir={tmp_path}"])
    write_trainer_state(tmp_path, 2)
    latest = write_trainer_state(tmp_path, 4)
    shard = next((latest / "sharded").glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:1000])  # a copy cut short
    assert checkpoints.resume_checkpoint(cfg).name == "step_00000002"  # auto: the one before it
    warning = capsys.readouterr().err
    assert (
        f"{shard} is truncated" in warning and "falling back to the checkpoint before it" in warning
    )
    named = config.load(
        "configs/tiny.yaml", [f"train.out_dir={tmp_path}", f"train.resume={latest}"])
    with pytest.raises(runs.RunError, match="is truncated.*train.resume="):
        checkpoints.resume_checkpoint(named)
    shard.unlink()
    with pytest.raises(runs.RunError, match=f"{shard} is missing"):
        checkpoints.check_files(latest)


@pytest.fixture
def process_group():
    """A gloo group of one in this process, for the functions that save with torch.distributed."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def stepped_linear(inputs, outputs):
    """A linear layer after one AdamW step (its optimizer has state to save) -> (model,
    optimizer)."""
    model = torch.nn.Linear(inputs, outputs)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.ones(1, inputs)).sum().backward()
    optimizer.step()
    return model, optimizer


def test_a_failed_save_says_why_removes_its_files_and_keeps_the_previous_checkpoint(
    tmp_path, monkeypatch, process_group):
    cfg = config.load("configs/tiny.yaml", [f"train.out_dir={tmp_path}", "train.keep_last=3"])
    model, optimizer = stepped_linear(3, 2)
    first = checkpoints.save_checkpoint(tmp_path, 1, model, optimizer, {"step": 1}, cfg, 0, 1)
    real_save = torch.save

    def disk_full(obj, path, *args, **kwargs):
        if str(path).endswith("trainer.pt"):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_save(obj, path, *args, **kwargs)

    monkeypatch.setattr(torch, "save", disk_full)
    with pytest.raises(runs.RunError) as error:
        checkpoints.save_checkpoint(tmp_path, 2, model, optimizer, {"step": 2}, cfg, 0, 1)
    message = str(error.value)
    assert "step 2" in message and "No space left on device" in message and "MiB free" in message
    assert str(first) in message
    # no partial files
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_00000001"]
    assert checkpoints.read_trainer_state(first)["step"] == 1


@pytest.fixture
def small_disk(tmp_path):
    """A 2 MiB tmpfs (root only: skipped where mounting is not permitted)."""
    mount_point = tmp_path / "small_disk"
    mount_point.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mount_point)],
                             capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    yield mount_point
    subprocess.run(["umount", str(mount_point)], check=True)


def test_a_full_disk_at_the_metrics_write_leaves_no_partial_line(small_disk):
    from tqdm import tqdm

    cfg = config.load("configs/tiny.yaml")
    log = runs.MetricsLog(small_disk, cfg, rank=0)
    log.write(1, {"x": 1.0}, tqdm(disable=True))
    before = (small_disk / "metrics.jsonl").read_bytes()
    # the disk is full, but for the rest of the last page of metrics.jsonl
    with open(small_disk / "filler", "wb", buffering=0) as filler:
        with pytest.raises(OSError):
            while True:
                filler.write(b"\0" * 4096)
    with pytest.raises(runs.RunError) as error:  # past the metrics file's last page
        log.write(2, {"long": "y" * 9000}, tqdm(disable=True))
    assert str(error.value) == (f"error: step 2: writing {small_disk / 'metrics.jsonl'} failed "
                                f"(No space left on device); its partial line was removed, the "
                                f"checkpoints are as they were")
    log.close()
    assert (small_disk / "metrics.jsonl").read_bytes() == before


def test_a_full_disk_during_a_save_loses_nothing(small_disk, process_group):
    # the real thing: DCP's writer fails on a full tmpfs (a CheckpointException, which derives from
    # BaseException)
    cfg = config.load("configs/tiny.yaml", [f"train.out_dir={small_disk}", "train.keep_last=3"])
    # 0.36 MB of weights: with AdamW's state a checkpoint is ~1.1 MB
    model, optimizer = stepped_linear(300, 300)
    first = checkpoints.save_checkpoint(small_disk, 1, model, optimizer, {"step": 1}, cfg, 0, 1)
    with pytest.raises(runs.RunError) as error:
        checkpoints.save_checkpoint(small_disk, 2, model, optimizer, {"step": 2}, cfg, 0, 1)
    message = str(error.value)
    assert message.startswith(
        f"error: saving the checkpoint of step 2 to {small_disk / 'checkpoints'} failed")
    assert "(the file system is full)" in message and str(first) in message and "\n" not in message
    # no .tmp left
    assert sorted(p.name for p in (small_disk / "checkpoints").iterdir()) == ["step_00000001"]
    checkpoints.check_files(first)
    assert checkpoints.resume_checkpoint(cfg).name == "step_00000001"  # a rerun continues from it


def flip_middle_bytes(path):
    """A disk error or a bad copy: bytes in the middle of a file changed, its size the same."""
    data = bytearray(path.read_bytes())
    middle = len(data) // 2
    data[middle:middle + 8] = bytes(b ^ 0xFF for b in data[middle:middle + 8])
    path.write_bytes(bytes(data))


def test_checksums_are_written_at_save_and_a_changed_shard_is_never_loaded(tmp_path, capsys,
                                                                           process_group):
    from tools import checkpoint as checkpoint_tool

    cfg = config.load("configs/tiny.yaml", [f"train.out_dir={tmp_path}", "train.keep_last=3"])
    model, optimizer = stepped_linear(64, 64)
    first = checkpoints.save_checkpoint(tmp_path, 1, model, optimizer, {"step": 1}, cfg, 0, 1)
    latest = checkpoints.save_checkpoint(tmp_path, 2, model, optimizer, {"step": 2}, cfg, 0, 1)
    # an independent implementation checks every hash, and every file is listed
    checked = subprocess.run(["sha256sum", "--strict", "-c", checkpoints.CHECKSUMS], cwd=latest,
                             capture_output=True, text=True)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    lines = (latest / checkpoints.CHECKSUMS).read_text().splitlines()
    listed = {line.split("  ")[1] for line in lines}
    on_disk = {p.relative_to(latest).as_posix() for p in latest.rglob("*") if p.is_file()}
    assert listed == on_disk - {checkpoints.CHECKSUMS} and "sharded/.metadata" in listed
    assert checkpoint_tool.main(["verify", str(tmp_path)]) == 0

    shard = next((latest / "sharded").glob("*.distcp"))
    size = shard.stat().st_size
    flip_middle_bytes(shard)
    assert shard.stat().st_size == size
    checkpoints.check_files(latest)  # sizes alone see nothing
    capsys.readouterr()
    assert checkpoints.resume_checkpoint(cfg).name == first.name  # auto: the one before it
    warning = capsys.readouterr().err
    assert f"{shard} does not match its sha256" in warning and "falling back" in warning
    named = config.load("configs/tiny.yaml",
                        [f"train.out_dir={tmp_path}", f"train.resume={latest}"])
    with pytest.raises(runs.RunError, match=f"{shard} does not match.*train.resume=") as error:
        checkpoints.resume_checkpoint(named, check_later=False)
    assert "\n" not in str(error.value)
    assert checkpoint_tool.main(["verify", str(latest)]) == 1
    assert checkpoint_tool.main(["verify", str(first)]) == 0
    assert f"FAILED {shard} does not match" in capsys.readouterr().out
    # removing the checksums does not make the changed shard loadable: its trainer.pt records them
    (latest / checkpoints.CHECKSUMS).unlink()
    assert checkpoint_tool.main(["verify", str(latest)]) == 1
    capsys.readouterr()
    assert checkpoints.resume_checkpoint(cfg).name == first.name
    assert (f"{latest / checkpoints.CHECKSUMS} is missing, but its trainer.pt records that it was "
            f"saved with one" in capsys.readouterr().err)
    with pytest.raises(runs.RunError, match="is missing, but its trainer.pt records"):
        checkpoints.resume_checkpoint(named, check_later=False)


def test_a_checkpoint_without_checksums_loads_only_if_its_run_never_had_them(tmp_path, capsys,
                                                                             process_group):
    cfg = config.load("configs/tiny.yaml", [f"train.out_dir={tmp_path}"])
    # saved before checkpoints carried checksums (and before trainer.pt recorded them)
    legacy = write_trainer_state(tmp_path, 1)
    assert checkpoints.resume_checkpoint(cfg).name == legacy.name
    assert f"{legacy} has no {checkpoints.CHECKSUMS}" in capsys.readouterr().err
    # saved with checksums, but before trainer.pt recorded them (the record dropped here): a
    # checkpoint beside it that carries them says the run had them
    out_dir = tmp_path / "with_checksums"
    model, optimizer = stepped_linear(64, 64)
    first, latest = [checkpoints.save_checkpoint(out_dir, step, model, optimizer, {"step": step},
                                                 cfg, 0, 1) for step in (1, 2)]
    state = torch.load(latest / "trainer.pt", weights_only=False)
    del state["checksums"]
    torch.save(state, latest / "trainer.pt")
    (latest / checkpoints.CHECKSUMS).unlink()
    with pytest.raises(runs.RunError) as error:
        checkpoints.verify_checksums(latest)
    assert str(error.value) == (f"error: {latest / checkpoints.CHECKSUMS} is missing, but "
                                f"{first.name} of the same run carries one: its bytes cannot be "
                                f"verified")
    (first / checkpoints.CHECKSUMS).unlink()  # the run's last trace of checksums gone too
    assert checkpoints.verify_checksums(latest) is False  # a legacy run, as far as can be told
    with pytest.raises(runs.RunError, match="its trainer.pt records that it was saved with one"):
        checkpoints.verify_checksums(first)


def test_a_run_whose_every_checkpoint_fails_stops_with_all_of_them_intact(tmp_path, capsys,
                                                                          process_group):
    cfg = config.load("configs/tiny.yaml", [f"train.out_dir={tmp_path}", "train.keep_last=3"])
    model, optimizer = stepped_linear(64, 64)
    saved = [checkpoints.save_checkpoint(tmp_path, step, model, optimizer, {"step": step}, cfg, 0,
                                         1) for step in (1, 2)]
    shards = [next((path / "sharded").glob("*.distcp")) for path in saved]
    for shard in shards:
        flip_middle_bytes(shard)
    before = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    with pytest.raises(runs.RunError) as error:
        checkpoints.resume_checkpoint(cfg)
    message = str(error.value)
    assert message.startswith(f"error: no checkpoint in {tmp_path / 'checkpoints'} passes its "
                              f"checks, so the run stops with all of them intact: ")
    assert all(f"{shard} does not match its sha256" in message for shard in shards)
    assert "train.start_over_if_unusable=true" in message and "\n" not in message
    assert {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()} == before
    # told to, the run starts over from step 0: they do not count as later checkpoints
    told = config.load("configs/tiny.yaml",
                       [f"train.out_dir={tmp_path}", "train.start_over_if_unusable=true"])
    assert checkpoints.resume_checkpoint(told) is None


def test_a_checkpoint_of_another_shape_is_refused_in_one_line(tmp_path, process_group):
    cfg = config.load("configs/tiny.yaml", [f"train.out_dir={tmp_path}"])
    small = torch.nn.Linear(4, 3)
    saved = checkpoints.save_checkpoint(
        tmp_path, 1, small, torch.optim.AdamW(small.parameters()), {"step": 1}, cfg, 0, 1)
    larger = torch.nn.Linear(4, 5)
    with pytest.raises(runs.RunError) as error:
        checkpoints.load_checkpoint(saved, larger, None, 0)
    message = str(error.value)
    assert message == (f"error: {saved} was saved from another model: its weight has shape [3, 4], "
                       f"the model.path model's has shape [5, 4]; resume with the same model (or "
                       f"another train.out_dir)")


def test_model_path_files_are_checked_on_the_names_both_hold(tmp_path, process_group):
    # before the model exists, model.path's safetensors headers stand in for it: a tensor only the
    # files hold (another format's copy, a buffer the model drops) is not a reason to refuse
    import types

    cfg = config.load("configs/tiny.yaml", [f"train.out_dir={tmp_path}"])
    small = torch.nn.Linear(4, 3)
    saved = checkpoints.save_checkpoint(
        tmp_path, 1, small, torch.optim.AdamW(small.parameters()), {"step": 1}, cfg, 0, 1)
    files = {"weight": types.SimpleNamespace(shape=(3, 4)),
             "layers.0.attention.wq.weight": types.SimpleNamespace(shape=(8, 8))}
    checkpoints.check_shapes(saved, files, shared_only=True)
    with pytest.raises(runs.RunError, match="layers.0.attention.wq.weight has no such tensor"):
        checkpoints.check_shapes(saved, files)
    files["weight"] = types.SimpleNamespace(shape=(5, 4))
    with pytest.raises(runs.RunError, match=r"its weight has shape \[3, 4\], the model.path"):
        checkpoints.check_shapes(saved, files, shared_only=True)


def test_a_load_that_dcp_refuses_is_one_line(tmp_path, process_group):
    # AMSGrad keeps a state tensor the saved AdamW has not: DCP raises a CheckpointException (a
    # BaseException), which used to end the run in raw tracebacks
    cfg = config.load("configs/tiny.yaml", [f"train.out_dir={tmp_path}"])

    def stepped(**options):
        model = torch.nn.Linear(4, 3)
        optimizer = torch.optim.AdamW(model.parameters(), **options)
        model(torch.ones(1, 4)).sum().backward()
        optimizer.step()
        return model, optimizer

    saved = checkpoints.save_checkpoint(tmp_path, 1, *stepped(), {"step": 1}, cfg, 0, 1)
    with pytest.raises(runs.RunError) as error:
        checkpoints.load_checkpoint(saved, *stepped(amsgrad=True), 0)
    message = str(error.value)
    assert message.startswith(f"error: {saved} cannot be loaded (") and "\n" not in message
    assert "max_exp_avg_sq" in message


VIEWS = """
import json, os, sys
sys.path.insert(0, os.path.join(os.getcwd(), "tests"))
import torch
import checkpoints, config, runs
from test_checkpoints import write_trainer_state
from pathlib import Path
rank, world, device = runs.setup_distributed(timeout_minutes=1)
os.chdir(Path(sys.argv[1]) / f"rank{rank}")  # the same out_dir, "run", holds what this rank sees
cfg = config.load(sys.argv[2], ["train.out_dir=run"])
seen = {}
for case, check_later in (("listing", True), ("one_rank_truncated", True), ("trainer_pt", False)):
    os.rename(f"run_{case}", "run")
    try:
        seen[case] = str(checkpoints.agreed_checkpoint(cfg, check_later=check_later, rank=rank))
    except runs.RunError as error:
        seen[case] = str(error)
    os.rename("run", f"run_{case}")
Path("seen.json").write_text(json.dumps(seen))
torch.distributed.barrier()
torch.distributed.destroy_process_group()  # or gloo's threads may abort the exit
"""


def test_ranks_that_see_different_checkpoints_stop_in_one_line(tmp_path):
    # two ranks, each with its own copy of out_dir (as a node-local out_dir would be)
    for rank in (0, 1):
        root = tmp_path / f"rank{rank}"
        write_trainer_state(root / "run_listing", 2)
        if rank == 0:
            write_trainer_state(root / "run_listing", 4)
        for case in ("one_rank_truncated", "trainer_pt"):
            write_trainer_state(root / f"run_{case}", 2)
            write_trainer_state(root / f"run_{case}", 4)
        # rank 1's step 4: a shard cut short, then a trainer.pt of another step
        shard = root / "run_one_rank_truncated/checkpoints/step_00000004/sharded/__0_0.distcp"
        if rank == 1:
            shard.write_bytes(shard.read_bytes()[:100])
            torch.save({"step": 3}, root / "run_trainer_pt/checkpoints/step_00000004/trainer.pt")
    (tmp_path / "views.py").write_text(VIEWS)
    completed = forked.run(tmp_path / "views.py", [tmp_path, os.path.abspath("configs/tiny.yaml")],
                           env=dict(os.environ, OMP_NUM_THREADS="1"), nproc=2, timeout=300)
    assert completed.returncode == 0, completed.stderr[-3000:]
    seen = [json.loads((tmp_path / f"rank{r}" / "seen.json").read_text()) for r in (0, 1)]
    assert seen[0] == seen[1]
    assert seen[0]["listing"] == (
        "error: the ranks see different checkpoints in run/checkpoints: rank 0: step_00000002, "
        "step_00000004; rank 1: step_00000002; every rank must see the same train.out_dir (a "
        "shared file system)")
    # one rank's failed check is every rank's: both fall back to step 2
    assert seen[0]["one_rank_truncated"] == "run/checkpoints/step_00000002"
    assert seen[0]["trainer_pt"] == (
        "error: the ranks see different checkpoints to resume: rank 0: "
        "run/checkpoints/step_00000004 at step 4; rank 1: run/checkpoints/step_00000004 at step "
        "3; every rank must see the same train.out_dir (a shared file system)")
