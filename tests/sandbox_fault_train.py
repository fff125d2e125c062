"""Run by tests/test_train.py: train.py whose sandbox fails after its start-up probe passed, as a
sandbox that breaks mid-run does (a full disk, a vanished interpreter): every tool call's code
then never runs, and run_code reports Result.error "sandbox".

    PYTHONPATH=. python tests/sandbox_fault_train.py --config configs/tiny_tool.yaml [section.key=value ...]
"""

import sys

import runs
import sandbox
import train

real_run = sandbox._run


def failing_after_the_probe(code, config, mode):
    if code == "print('sandbox ok')":  # the start-up probe (sandbox._probe)
        return real_run(code, config, mode)
    raise OSError(28, "No space left on device (injected)")


sandbox._run = failing_after_the_probe
runs.exit_process(train.main(sys.argv[1:]))
