"""Run by tests/test_train.py: train.py, recording after every step the parameters that are not
DTensors (FSDP2 left them gathered, unsharded, on the device the engine samples on next).

    PYTHONPATH=. python tests/resharded_train.py OUT_JSON --config configs/tiny.yaml [key=value ...]
"""

import json
import sys
from pathlib import Path

from torch.distributed.tensor import DTensor

import train

gathered, real_train_step = [], train.train_step


def train_step_then_look(run, state, step, *args, **kwargs):
    metrics = real_train_step(run, state, step, *args, **kwargs)
    gathered.append([n for n, p in run.model.named_parameters() if not isinstance(p, DTensor)])
    return metrics


train.train_step = train_step_then_look
code = train.main(sys.argv[2:])
Path(sys.argv[1]).write_text(json.dumps(gathered))
sys.exit(code)
