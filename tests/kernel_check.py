"""kernels.py against stare.py's / baselines.py's exact chunked code on the same logits. Run on CUDA
by tests/test_gpu.py, and on CPU by tests/test_kernels.py in a subprocess under TRITON_INTERPRET=1
(Triton's interpreter), since that setting must be made before the kernels are defined."""

import sys
from pathlib import Path
from unittest import mock

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import baselines  # noqa: E402
import kernels  # noqa: E402
import stare  # noqa: E402


def exact(fn, *args):
    """fn through the chunked PyTorch code on float32 copies (the kernels' dispatch switched off)."""
    with mock.patch.object(kernels, "supported", lambda logits_2d: False):
        return fn(*args)


def awkward_logits(num_rows, vocab_size, dtype, device, seed):
    """Random logits with a peaked row, a uniform row, a row of mostly -inf, and a vocabulary that
    is not a multiple of the block size."""
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(num_rows, vocab_size, generator=generator) * 3
    logits[0, 7] = 40.0
    logits[1] = 0.0
    logits[2] = float("-inf")
    logits[2, :3] = torch.tensor([1.0, 2.0, 3.0])
    tokens = torch.randint(0, vocab_size, (num_rows,), generator=generator)
    tokens[2] = 1
    return logits.to(device=device, dtype=dtype), tokens.to(device)


def check(device, vocab_size=1000, num_rows=37, dtype=torch.float32, tolerance=2e-5):
    """Raise AssertionError unless every kernel matches the exact code. Returns the largest error seen."""
    worst = 0.0

    def close(got, want, what, tolerance=tolerance):
        nonlocal worst
        got, want = got.float(), want.float()
        assert torch.equal(got.isfinite(), want.isfinite()), what
        # equal infinities
        error = torch.where(got == want, 0.0, (got - want).abs() / (1 + want.abs())).max().item()
        assert error <= tolerance, f"{what}: {error:.2e}"
        worst = max(worst, error)

    for seed, temperature in ((0, 1.0), (1, 0.7)):
        logits, tokens = awkward_logits(num_rows, vocab_size, dtype, device, seed)
        grad_lp, grad_h = torch.randn(
            2, num_rows, generator=torch.Generator().manual_seed(seed)).to(device)

        fast = logits.clone().requires_grad_()
        lp, h = stare.token_logprobs_and_entropy(fast, tokens, temperature)
        (grad_lp * lp + grad_h * h).sum().backward()
        slow = logits.float().clone().requires_grad_()
        want_lp, want_h = exact(stare.token_logprobs_and_entropy, slow, tokens, temperature)
        (grad_lp * want_lp + grad_h * want_h).sum().backward()
        close(lp, want_lp, "logprobs")
        close(h, want_h, "entropy")
        # the gradient is rounded to the logits' dtype
        grad_tolerance = max(tolerance, torch.finfo(dtype).eps)
        close(fast.grad, slow.grad, "gradient", grad_tolerance)
        assert fast.grad.dtype == logits.dtype

        # one output unused: its gradient is None in backward
        only_entropy = logits.clone().requires_grad_()
        stare.token_logprobs_and_entropy(only_entropy, tokens, temperature)[1].sum().backward()
        slow.grad = None
        exact(stare.token_logprobs_and_entropy, slow, tokens, temperature)[1].sum().backward()
        close(only_entropy.grad, slow.grad, "entropy-only gradient", grad_tolerance)

        with torch.no_grad():
            close(
                stare.entropy_sensitivity(logits, tokens, temperature),
                exact(stare.entropy_sensitivity, logits.float(), tokens, temperature),
                "sensitivity")
            close(
                stare.critical_surprisal(logits, temperature),
                exact(stare.critical_surprisal, logits.float(), temperature), "critical surprisal")
            for soft in (False, True):
                for kappa in (0.02, 1.0):
                    close(
                        baselines.minp_proxy_logprobs(logits, tokens, temperature, kappa, soft),
                        exact(
                            baselines.minp_proxy_logprobs, logits.float(), tokens, temperature,
                            kappa, soft),
                        f"min-p proxy {soft=} {kappa=}")
    empty = torch.zeros(0, vocab_size, device=device, dtype=dtype)
    assert stare.token_logprobs_and_entropy(empty, torch.zeros(0, dtype=torch.long, device=device))[
        0
    ].shape == (0,)
    return worst


if __name__ == "__main__":
    kernels.BLOCK = 256  # several blocks per row (600 = 256 + 256 + 88), the last one partial
    assert kernels.supported(torch.zeros(1, 1)), "run with TRITON_INTERPRET=1"
    for dtype in (torch.float32, torch.bfloat16):
        # the interpreter runs one row's program at a time: 11 rows hold the three awkward ones
        worst = check(torch.device("cpu"), vocab_size=600, num_rows=11, dtype=dtype)
        print(f"{dtype}: worst error {worst:.2e}")
