"""kernels.py (the Triton path of stare.token_logprobs_and_entropy, entropy_sensitivity,
critical_surprisal and baselines.minp_proxy_logprobs) against the exact chunked code, on CPU through
Triton's interpreter."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")


def test_kernels_match_the_exact_code_in_the_triton_interpreter():
    script = Path(__file__).with_name("kernel_check.py")
    completed = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=600,
        env={**os.environ, "TRITON_INTERPRET": "1"})
    assert completed.returncode == 0, completed.stdout + completed.stderr[-3000:]
    assert "bfloat16: worst error" in completed.stdout
