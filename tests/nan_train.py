"""Run by tests/test_train.py: train.py with a NaN injected into the policy loss of chosen optimizer
steps.

    PYTHONPATH=. python tests/nan_train.py NAN_STEPS --config configs/tiny.yaml [section.key=value ...]

NAN_STEPS is a comma-separated list of 1-based policy_loss calls (one call per step when a step has
one micro-batch) whose loss becomes NaN, as an overflow in the forward pass would make it.
"""

import sys

import baselines
import runs
import train

nan_calls = {int(s) for s in sys.argv[1].split(",")}
real_policy_loss = baselines.policy_loss
calls = 0


def policy_loss_with_nan(*args, **kwargs):
    global calls
    calls += 1
    loss, metrics = real_policy_loss(*args, **kwargs)
    return (loss * float("nan") if calls in nan_calls else loss), metrics


baselines.policy_loss = policy_loss_with_nan
runs.exit_process(train.main(sys.argv[2:]))
