"""tools/checkpoint.py: check a checkpoint's bytes against the sha256 checksums written at its save.

    python -m tools.checkpoint verify runs/x/checkpoints/step_00000010   # one checkpoint
    python -m tools.checkpoint verify runs/x                             # every checkpoint of a run

Each checkpoint gets one line: "ok", or the first file that is missing, truncated or changed since
the save. Exit 0 when every checkpoint is verified, 1 when one is not (or has no checksums, from
before checkpoints carried them), 2 when DIR holds no checkpoint. The same checks run before a
resume and an export (checkpoints.usable_step); `sha256sum -c checksums.sha256` inside a checkpoint
checks the hashes alone.
"""

import argparse
import sys
from pathlib import Path

import checkpoints
from runs import RunError


def verify(checkpoint):
    """-> None when every file of the checkpoint matches its checksum, else the problem's line."""
    try:
        if not checkpoints.verify_checksums(checkpoint):
            return f"{checkpoint}: no {checkpoints.CHECKSUMS}, its bytes cannot be verified"
        checkpoints.check_files(checkpoint)
        checkpoints.read_trainer_state(checkpoint)
    except RunError as error:
        return str(error).removeprefix("error: ")
    return None


def main(argv):
    parser = argparse.ArgumentParser(description="Verify checkpoints against their checksums.")
    parser.add_argument("command", choices=["verify"])
    parser.add_argument("dir", help="a checkpoint (step_N), or a run's out_dir")
    args = parser.parse_args(argv)
    path = Path(args.dir)
    found = [path] if (path / "trainer.pt").is_file() else checkpoints.list_checkpoints(
        path.parent if path.name == "checkpoints" else path)
    if not found:
        print(f"error: {path} is not a checkpoint and holds none (no step_N/trainer.pt)",
              file=sys.stderr)
        return 2
    problems = 0
    for checkpoint in found:
        problem = verify(checkpoint)
        problems += problem is not None
        print(f"{checkpoint}: ok" if problem is None else f"FAILED {problem}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
