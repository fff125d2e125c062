"""kernels.py: Triton kernels for stare.py's per-token reductions over the vocabulary, used on CUDA.

The chunked PyTorch code in stare.py reads each row of logits several times and makes float32
temporaries per chunk; on a GPU that is an order of magnitude above the memory-bandwidth floor of
one read of the [N, V] logits. Here one program handles one row and streams it once, keeping running
sums rescaled to the running maximum m (x = logits / T):

    s = sum e^(x-m),  t = sum e^(x-m) (x-m),  u = sum e^(2(x-m)),  w = sum e^(2(x-m)) (x-m)
    lse = m + log s,   H = log s - t/s,   B = sum pi^2 (s_a - H) = -(u/s^2) (w/u - t/s)

Both terms of H are non-negative (x - m <= 0), so H has no cancellation even for peaked rows.
Backward reads the row once more and writes dL/dlogits = (g_lp (e_k - pi) - g_H pi (log pi + H)) / T
in the logits' dtype.

Without CUDA (or Triton) nothing here runs; with TRITON_INTERPRET=1 the kernels run on CPU tensors
in Triton's interpreter, which is how the CPU tests check them against stare.py's exact chunked
code.
"""

import math
import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs need no Triton
    triton = None

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
BLOCK = 4096  # vocabulary entries per loop iteration of one row's program
NUM_WARPS = 8


def supported(logits_2d):
    """Can the kernels run on this [N, V] tensor (CUDA or Triton's interpreter, V unit-strided)?"""
    return triton is not None and (logits_2d.is_cuda or INTERPRET) and logits_2d.stride(-1) == 1


if triton is not None:
    _FLOAT32_MIN = tl.constexpr(-3.4028234663852886e38)  # log pi is clamped here, as in stare.py

    @triton.jit
    def _row_stats_kernel(logits_ptr, row_stride, tokens_ptr, inv_temp, vocab_size, logprob_ptr,
                          entropy_ptr, lse_ptr, cov_b_ptr, s_min_ptr, HAS_TOKENS: tl.constexpr,
                          WITH_COV_B: tl.constexpr, BLOCK_V: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        row_ptr = logits_ptr + row * row_stride
        cols = tl.arange(0, BLOCK_V)
        m = -1e30  # finite, so that the first rescale is 0 * finite
        s, t, u, w = 0.0, 0.0, 0.0, 0.0
        for start in range(0, vocab_size, BLOCK_V):
            x = tl.load(row_ptr + start + cols, mask=start + cols < vocab_size, other=float("-inf"))
            x = x.to(tl.float32) * inv_temp  # [BLOCK_V]
            m_new = tl.maximum(m, tl.max(x, 0))
            d = m - m_new  # <= 0
            scale = tl.exp(d)
            t = scale * (t + d * s)
            s = scale * s
            if WITH_COV_B:
                w = scale * scale * (w + d * u)
                u = scale * scale * u
            e = tl.exp(x - m_new)  # [BLOCK_V], 0 for -inf logits and masked lanes
            shifted = x - m_new
            s += tl.sum(e, 0)
            t += tl.sum(tl.where(e > 0, e * shifted, 0.0), 0)
            if WITH_COV_B:
                e2 = e * e
                u += tl.sum(e2, 0)
                w += tl.sum(tl.where(e2 > 0, e2 * shifted, 0.0), 0)
            m = m_new
        log_s = tl.log(s)
        lse = m + log_s
        entropy = log_s - t / s
        tl.store(entropy_ptr + row, entropy)
        tl.store(lse_ptr + row, lse)
        if HAS_TOKENS:
            token = tl.load(tokens_ptr + row)
            x_token = tl.load(row_ptr + token).to(tl.float32) * inv_temp
            tl.store(logprob_ptr + row, tl.maximum(x_token - lse, _FLOAT32_MIN))
        if WITH_COV_B:
            tl.store(cov_b_ptr + row, -(u / (s * s)) * (w / u - t / s))
            tl.store(s_min_ptr + row, log_s)

    @triton.jit
    def _backward_kernel(logits_ptr, row_stride, grad_ptr, tokens_ptr, lse_ptr, entropy_ptr,
                         grad_logprob_ptr, grad_entropy_ptr, inv_temp, vocab_size,
                         BLOCK_V: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        row_ptr = logits_ptr + row * row_stride
        out_ptr = grad_ptr + row * vocab_size
        cols = tl.arange(0, BLOCK_V)
        lse = tl.load(lse_ptr + row)
        entropy = tl.load(entropy_ptr + row)
        g_lp = tl.load(grad_logprob_ptr + row)
        g_h = tl.load(grad_entropy_ptr + row)
        token = tl.load(tokens_ptr + row)
        for start in range(0, vocab_size, BLOCK_V):
            in_range = start + cols < vocab_size
            x = tl.load(row_ptr + start + cols, mask=in_range, other=0.0).to(tl.float32) * inv_temp
            log_pi = tl.maximum(x - lse, _FLOAT32_MIN)  # [BLOCK_V]
            pi = tl.exp(log_pi)
            # pi * (...) first: 0 where log pi is clamped
            grad = -(pi * g_lp + g_h * (pi * (log_pi + entropy)))
            grad = tl.where(start + cols == token, grad + g_lp, grad) * inv_temp
            tl.store(out_ptr + start + cols, grad.to(grad_ptr.dtype.element_ty), mask=in_range)

    @triton.jit
    def _minp_proxy_kernel(logits_ptr, row_stride, tokens_ptr, proxy_ptr, inv_temp, log_kappa,
                           hard_value, vocab_size, SOFT: tl.constexpr, BLOCK_V: tl.constexpr):
        # two passes over the row: its max (and min), then the log-sum-exp of the min-p filtered
        # logits
        row = tl.program_id(0).to(tl.int64)
        row_ptr = logits_ptr + row * row_stride
        cols = tl.arange(0, BLOCK_V)
        top, bottom = -float("inf"), float("inf")
        for start in range(0, vocab_size, BLOCK_V):
            in_range = start + cols < vocab_size
            x = tl.load(row_ptr + start + cols, mask=in_range, other=0.0).to(tl.float32) * inv_temp
            top = tl.maximum(top, tl.max(tl.where(in_range, x, -float("inf")), 0))
            bottom = tl.minimum(bottom, tl.min(tl.where(in_range, x, float("inf")), 0))
        filtered = bottom if SOFT else hard_value
        total = 0.0
        for start in range(0, vocab_size, BLOCK_V):
            in_range = start + cols < vocab_size
            x = tl.load(row_ptr + start + cols, mask=in_range, other=0.0).to(tl.float32) * inv_temp
            # x >= top + c, not x - top >= c: a fused multiply-add (x = logit / T) would skip x's
            # rounding there, and the row's own maximum could fail the test at kappa = 1
            kept = tl.where(x >= top + log_kappa, x, filtered)
            total += tl.sum(tl.where(in_range, tl.exp(kept - top), 0.0), 0)
        x_token = tl.load(row_ptr + tl.load(tokens_ptr + row)).to(tl.float32) * inv_temp
        token_kept = tl.where(x_token >= top + log_kappa, x_token, filtered)
        tl.store(proxy_ptr + row, token_kept - (top + tl.log(total)))


def minp_proxy(logits_2d, tokens_1d, temperature, kappa, soft):
    """baselines.minp_proxy_logprobs on logits_2d [N, V], tokens_1d [N] -> [N] float32: logits below
    kappa times the row's largest probability are set to -1e4 / T (soft: to the row's smallest
    logit) before the softmax."""
    proxy = torch.empty(logits_2d.shape[0], dtype=torch.float32, device=logits_2d.device)
    if logits_2d.shape[0]:
        _minp_proxy_kernel[(logits_2d.shape[0],)](
            logits_2d, logits_2d.stride(0), tokens_1d, proxy, 1.0 / temperature,
            math.log(kappa) / temperature, -1e4 / temperature, logits_2d.shape[1], SOFT=soft,
            BLOCK_V=BLOCK, num_warps=NUM_WARPS)
    return proxy


def row_stats(logits_2d, tokens_1d, temperature, with_cov_b=False):
    """One pass over logits_2d [N, V]: (log pi(token) or None, H, lse, B or None, s_min or None),
    each [N] float32, for pi = softmax(logits / temperature). tokens_1d [N] int64 or None."""
    num_rows, vocab_size = logits_2d.shape
    out = [torch.empty(num_rows, dtype=torch.float32, device=logits_2d.device) for _ in range(5)]
    logprob, entropy, lse, cov_b, s_min = out
    if num_rows:
        _row_stats_kernel[(num_rows,)](
            logits_2d, logits_2d.stride(0), tokens_1d if tokens_1d is not None else lse,
            1.0 / temperature, vocab_size, logprob, entropy, lse, cov_b, s_min,
            HAS_TOKENS=tokens_1d is not None, WITH_COV_B=with_cov_b, BLOCK_V=BLOCK,
            num_warps=NUM_WARPS)
    return (logprob if tokens_1d is not None else None, entropy, lse,
            cov_b if with_cov_b else None, s_min if with_cov_b else None)


class LogprobEntropy(torch.autograd.Function):
    """(log pi(token), H) [N] float32 from logits_2d [N, V]; saves the logits, two floats a row."""

    @staticmethod
    def forward(ctx, logits_2d, tokens_1d, temperature):
        logprob, entropy, lse, _, _ = row_stats(logits_2d, tokens_1d, temperature)
        ctx.save_for_backward(logits_2d, tokens_1d, lse, entropy)
        ctx.temperature = temperature
        ctx.set_materialize_grads(False)
        return logprob, entropy

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_logprob, grad_entropy):
        logits_2d, tokens_1d, lse, entropy = ctx.saved_tensors
        num_rows, vocab_size = logits_2d.shape
        zeros = torch.zeros(num_rows, dtype=torch.float32, device=logits_2d.device)
        grad_logprob = zeros if grad_logprob is None else grad_logprob.float().contiguous()
        grad_entropy = zeros if grad_entropy is None else grad_entropy.float().contiguous()
        grad_logits = torch.empty(
            (num_rows, vocab_size), dtype=logits_2d.dtype, device=logits_2d.device)
        if num_rows:
            _backward_kernel[(num_rows,)](
                logits_2d, logits_2d.stride(0), grad_logits, tokens_1d, lse, entropy, grad_logprob,
                grad_entropy, 1.0 / ctx.temperature, vocab_size, BLOCK_V=BLOCK, num_warps=NUM_WARPS)
        return grad_logits, None, None
