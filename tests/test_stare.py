"""Tests for stare.py: every function against an independent computation (a Python loop, a closed
form, torch.distributions.Categorical, or finite differences), plus the edge cases the trainer will
hit."""

import math
import statistics

import pytest
import torch

import stare


def random_logits(*shape, scale=3.0, seed=0, dtype=torch.float64):
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=generator, dtype=torch.float64) * scale).to(dtype)


def entropy_of(logits):  # [..., V] -> [...], float64 reference
    return torch.distributions.Categorical(logits=logits.double()).entropy()


# --------------------------------------------------------------------------------------------------
# token_logprobs_and_entropy
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("temperature", [1.0, 0.6, 1.7])
def test_logprobs_and_entropy_match_categorical(temperature):
    logits = random_logits(3, 7, 50, dtype=torch.float32)
    tokens = torch.randint(0, 50, (3, 7), generator=torch.Generator().manual_seed(1))
    logprobs, entropy = stare.token_logprobs_and_entropy(logits, tokens, temperature=temperature)
    reference = torch.distributions.Categorical(logits=logits.double() / temperature)
    assert logprobs.dtype == entropy.dtype == torch.float32 and logprobs.shape == (3, 7)
    torch.testing.assert_close(logprobs.double(), reference.log_prob(tokens), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(entropy.double(), reference.entropy(), atol=1e-5, rtol=1e-5)


def test_entropy_is_accurate_for_peaked_rows():
    # One dominant logit, H = 2.7e-6. In float32, lse - sum(p x) is off by 1.1e-6 here (cancellation
    # at |x| = 50); -sum(p log p) is off by 1.6e-7 (the float32 resolution of log p near 0).
    logits = torch.tensor([[50.0, 34.0, 33.0, 30.0]])
    _, entropy = stare.token_logprobs_and_entropy(logits, torch.tensor([0]))
    assert entropy.item() == pytest.approx(entropy_of(logits).item(), abs=3e-7)


@pytest.mark.parametrize("chunk_size", [1, 3, 8, 1000])
def test_chunked_equals_unchunked(chunk_size):
    logits = random_logits(4, 5, 33, dtype=torch.float32)
    tokens = torch.randint(0, 33, (4, 5))
    full = stare.token_logprobs_and_entropy(logits, tokens, chunk_size=10**9)
    chunked = stare.token_logprobs_and_entropy(logits, tokens, chunk_size=chunk_size)
    for a, b in zip(full, chunked):
        assert torch.equal(a, b)  # row chunks do the same arithmetic per row


@pytest.mark.parametrize("use", ["both", "logprobs", "entropy"])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_gradients_match_autograd_of_naive_computation(use, temperature):
    # The chunked custom backward against autograd through log_softmax, in float64 for the
    # reference.
    logits = random_logits(2, 6, 20, dtype=torch.float32).requires_grad_(True)
    reference_logits = logits.detach().double().requires_grad_(True)
    tokens = torch.randint(0, 20, (2, 6), generator=torch.Generator().manual_seed(3))
    upstream_lp, upstream_h = (
        torch.randn(2, 6, dtype=torch.float64), torch.randn(2, 6, dtype=torch.float64))

    logprobs, entropy = stare.token_logprobs_and_entropy(
        logits, tokens, temperature=temperature, chunk_size=5)
    log_pi = torch.log_softmax(reference_logits / temperature, dim=-1)
    ref_logprobs = log_pi.gather(-1, tokens[..., None]).squeeze(-1)
    ref_entropy = -(log_pi.exp() * log_pi).sum(-1)

    def objective(lp, h):
        terms = {"both": [(lp, upstream_lp), (h, upstream_h)], "logprobs": [(lp, upstream_lp)],
                 "entropy": [(h, upstream_h)]}[use]
        return sum((x.double() * g).sum() for x, g in terms)

    objective(logprobs, entropy).backward()
    objective(ref_logprobs, ref_entropy).backward()
    torch.testing.assert_close(logits.grad.double(), reference_logits.grad, atol=1e-5, rtol=1e-4)


def test_backward_saves_no_float32_copy_of_the_logits():
    # Autograd through a plain chunk loop would save each chunk's float32 softmax: the whole [N, V]
    # again. The custom function must save only the input logits themselves plus per-row vectors.
    logits = random_logits(4, 6, 40, dtype=torch.bfloat16).requires_grad_(True)
    tokens = torch.randint(0, 40, (4, 6))
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        logprobs, entropy = stare.token_logprobs_and_entropy(logits, tokens, chunk_size=5)
    assert any(t.data_ptr() == logits.data_ptr() for t in saved)
    other_bytes = sum(
        t.numel() * t.element_size() for t in saved if t.data_ptr() != logits.data_ptr())
    # per-row vectors only (lse, entropy, tokens); a float32 copy is 3840
    assert other_bytes <= 3 * 4 * 24 + 8 * 24
    (logprobs.sum() + entropy.sum()).backward()  # and backward still works from what was saved
    assert logits.grad.shape == logits.shape


def test_bf16_logits():
    logits = random_logits(2, 4, 64, dtype=torch.bfloat16)
    tokens = torch.randint(0, 64, (2, 4))
    logprobs, entropy = stare.token_logprobs_and_entropy(logits, tokens, chunk_size=3)
    reference = torch.distributions.Categorical(logits=logits.double())
    assert logprobs.dtype == torch.float32
    torch.testing.assert_close(logprobs.double(), reference.log_prob(tokens), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(entropy.double(), reference.entropy(), atol=1e-5, rtol=1e-5)
    # and the gradient comes back in the logits' dtype
    logits.requires_grad_(True)
    stare.token_logprobs_and_entropy(logits, tokens)[0].sum().backward()
    assert logits.grad.dtype == torch.bfloat16 and torch.isfinite(logits.grad.float()).all()


def test_minus_inf_logits_and_strided_input():
    # A -inf logit (a masked vocabulary entry) has probability 0 and contributes 0 log 0 = 0: no NaN
    # anywhere.
    logits = random_logits(2, 3, 10, dtype=torch.float32)
    logits[..., 7:] = float("-inf")
    tokens = torch.randint(0, 7, (2, 3))
    leaf = logits.clone().requires_grad_(True)
    logprobs, entropy = stare.token_logprobs_and_entropy(leaf, tokens, chunk_size=2)
    reference = torch.distributions.Categorical(logits=logits[..., :7].double())
    torch.testing.assert_close(entropy.double(), reference.entropy(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(logprobs.double(), reference.log_prob(tokens), atol=1e-5, rtol=1e-5)
    (logprobs.sum() + entropy.sum()).backward()
    assert torch.isfinite(leaf.grad).all() and (leaf.grad[..., 7:] == 0).all()
    assert torch.isfinite(stare.entropy_sensitivity(logits, tokens)).all()
    # a non-contiguous view (the usual logits[:, :-1]) gives the same numbers as its contiguous copy
    wide = random_logits(2, 5, 10, dtype=torch.float32)
    strided = wide[:, :-1]
    assert not strided.is_contiguous()
    for a, b in zip(stare.token_logprobs_and_entropy(strided, tokens.new_zeros(2, 4)),
                    stare.token_logprobs_and_entropy(strided.contiguous(), tokens.new_zeros(2, 4))):
        assert torch.equal(a, b)


def test_logprob_input_errors():
    tokens = torch.zeros(2, 3, dtype=torch.long)
    with pytest.raises(TypeError, match="float"):
        stare.token_logprobs_and_entropy(torch.zeros(2, 3, 5, dtype=torch.long), tokens)
    with pytest.raises(ValueError, match="vocab dim"):
        stare.token_logprobs_and_entropy(torch.zeros(2, 4, 5), tokens)
    with pytest.raises(ValueError, match="temperature"):
        stare.token_logprobs_and_entropy(torch.zeros(2, 3, 5), tokens, temperature=0.0)
    with pytest.raises(ValueError, match="chunk_size"):
        stare.token_logprobs_and_entropy(torch.zeros(2, 3, 5), tokens, chunk_size=0)


# --------------------------------------------------------------------------------------------------
# entropy_sensitivity and critical_surprisal (docs/method.md, Eq. 5)
# --------------------------------------------------------------------------------------------------


def sensitivity_loop(probs, k):
    """S for one distribution (a list of floats) and sampled index k, straight from the formula of Eq. 5."""
    entropy = -sum(p * math.log(p) for p in probs if p > 0)
    first = sum(p * p * (math.log(p) + entropy) for p in probs if p > 0)
    return first - probs[k] * (math.log(probs[k]) + entropy)


def test_sensitivity_matches_python_loop():
    logits = random_logits(3, 4, 9)
    tokens = torch.randint(0, 9, (3, 4), generator=torch.Generator().manual_seed(5))
    sensitivity = stare.entropy_sensitivity(logits, tokens)
    probs = torch.softmax(logits, -1)
    for i in range(3):
        for t in range(4):
            expected = sensitivity_loop(probs[i, t].tolist(), tokens[i, t].item())
            assert sensitivity[i, t].item() == pytest.approx(expected, abs=1e-6)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_sensitivity_equals_finite_difference_of_entropy(temperature):
    # Raw logits z, pi = softmax(z / T). A policy-gradient step on token k in raw logits:
    # z' = z + eps * grad_z log pi_k = z + eps * (e_k - pi) / T, so dH/d eps = S / T^2.
    logits = random_logits(40, 12, seed=7)
    tokens = torch.randint(0, 12, (40,), generator=torch.Generator().manual_seed(8))
    sensitivity = stare.entropy_sensitivity(logits, tokens, temperature=temperature).double()
    pi = torch.softmax(logits / temperature, -1)
    direction = (torch.nn.functional.one_hot(tokens, 12).double() - pi) / temperature
    eps = 1e-4
    finite_diff = (entropy_of((logits + eps * direction) / temperature)
                   - entropy_of((logits - eps * direction) / temperature)) / (2 * eps)
    torch.testing.assert_close(sensitivity / temperature**2, finite_diff, atol=2e-6, rtol=1e-3)


def test_sensitivity_has_zero_mean_under_the_policy():
    logits = random_logits(6, 15, seed=9)
    all_tokens = torch.arange(15).expand(6, 15)
    # S for every possible token k of each row: feed the same row once per k
    sensitivity = stare.entropy_sensitivity(
        logits[:, None, :].expand(6, 15, 15), all_tokens
    ).double()  # [6, 15]
    expected_drift = (torch.softmax(logits, -1) * sensitivity).sum(-1)
    torch.testing.assert_close(
        expected_drift, torch.zeros(6, dtype=torch.float64), atol=1e-6, rtol=0)


def test_sensitivity_closed_form_cases():
    # Uniform pi: every token has S = 0.
    assert torch.allclose(
        stare.entropy_sensitivity(torch.zeros(1, 5), torch.tensor([2])), torch.zeros(1), atol=1e-7)
    # Two tokens: reinforcing the rare one raises entropy, the common one lowers it.
    logits = torch.log(torch.tensor([[0.9, 0.1], [0.9, 0.1]]))
    sensitivity = stare.entropy_sensitivity(logits, torch.tensor([1, 0]))
    assert sensitivity[0] > 0 > sensitivity[1]
    # The worked example of Eq. 5 (pi = [.70, .15, .08, .04, .02, .01]).
    probs = torch.tensor([0.70, 0.15, 0.08, 0.04, 0.02, 0.01], dtype=torch.float64)
    sensitivity = stare.entropy_sensitivity(probs.log().expand(3, 6), torch.tensor([0, 1, 5]))
    torch.testing.assert_close(
        sensitivity.double(), torch.tensor([-0.16822, 0.41082, 0.31081], dtype=torch.float64),
        atol=1e-5, rtol=0)


def test_critical_surprisal_is_the_sign_change_of_sensitivity():
    logits = random_logits(200, 30, scale=2.5, seed=11)
    tokens = torch.randint(0, 30, (200,), generator=torch.Generator().manual_seed(12))
    s0 = stare.critical_surprisal(logits).double()
    sensitivity = stare.entropy_sensitivity(logits, tokens).double()
    log_pi = torch.log_softmax(logits, -1)
    surprisal = -log_pi.gather(-1, tokens[:, None]).squeeze(-1)
    entropy = entropy_of(logits)
    # g(s0) = 0 with g(s) = e^{-s}(s - H) - B, B computed here independently
    cov_b = (log_pi.exp() ** 2 * (-log_pi - entropy[:, None])).sum(-1)
    torch.testing.assert_close(
        torch.exp(-s0) * (s0 - entropy) - cov_b, torch.zeros(200, dtype=torch.float64), atol=1e-6,
        rtol=0)
    assert (s0 <= entropy + 1e-6).all() and (s0 >= -log_pi.max(-1).values - 1e-6).all()
    clear = (surprisal - s0).abs() > 1e-4  # away from the root, the signs must agree
    assert clear.sum() > 150
    assert torch.equal((sensitivity > 0)[clear], (surprisal > s0)[clear])


def test_critical_surprisal_of_uniform_is_entropy():
    s0 = stare.critical_surprisal(torch.zeros(2, 3, 8))
    assert s0.shape == (2, 3)
    torch.testing.assert_close(s0, torch.full((2, 3), math.log(8)))


# --------------------------------------------------------------------------------------------------
# select_top_surprisal
# --------------------------------------------------------------------------------------------------


def select_loop(surprisal, candidates, top_ratio):
    """Reference: sort the candidates by surprisal in Python (stable: ties keep their order), keep the first ceil(P n)."""
    flat_s, flat_c = surprisal.reshape(-1).tolist(), candidates.reshape(-1).tolist()
    candidate_idx = [i for i, c in enumerate(flat_c) if c]
    n = len(candidate_idx)
    k = 0 if (n == 0 or top_ratio == 0) else min(n, max(1, math.ceil(round(top_ratio * n, 9))))
    chosen = sorted(candidate_idx, key=lambda i: -flat_s[i])[:k]
    selected = torch.zeros(len(flat_c), dtype=torch.bool)
    selected[chosen] = True
    return selected.view(candidates.shape)


@pytest.mark.parametrize("shape", [(17,), (4, 9), (2, 3, 11)])
@pytest.mark.parametrize("top_ratio", [0.0, 0.01, 0.1, 0.25, 0.5, 0.999, 1.0])
def test_select_top_surprisal_matches_loop(shape, top_ratio):
    generator = torch.Generator().manual_seed(len(shape) + int(top_ratio * 1000))
    surprisal = torch.rand(shape, generator=generator) * 5  # distinct with probability 1
    candidates = torch.rand(shape, generator=generator) < 0.6
    selected = stare.select_top_surprisal(surprisal, candidates, top_ratio)
    assert selected.shape == candidates.shape and selected.dtype == torch.bool
    assert torch.equal(selected, select_loop(surprisal, candidates, top_ratio))


def test_select_exact_k_edge_cases():
    surprisal = torch.arange(100, dtype=torch.float32)
    everyone = torch.ones(100, dtype=torch.bool)
    # 0.07 * 100 = 7.000000000000001 in floating point; the intended k is 7
    assert stare.select_top_surprisal(surprisal, everyone, 0.07).sum() == 7
    # at least one when there is a candidate and P > 0
    one = torch.zeros(100, dtype=torch.bool)
    one[42] = True
    assert torch.equal(stare.select_top_surprisal(surprisal, one, 1e-6), one)
    # none without candidates, or with P = 0
    assert not stare.select_top_surprisal(surprisal, torch.zeros(100, dtype=torch.bool), 0.5).any()
    assert not stare.select_top_surprisal(surprisal, everyone, 0.0).any()
    # P = 1: every candidate
    assert torch.equal(stare.select_top_surprisal(surprisal, surprisal > 30, 1.0), surprisal > 30)
    # empty tensors
    assert stare.select_top_surprisal(
        torch.zeros(0, 5), torch.zeros(0, 5, dtype=torch.bool), 0.3).shape == (0, 5)


def test_select_with_ties_takes_exactly_k_first_in_order():
    surprisal = torch.tensor([1.0, 2.0, 2.0, 2.0, 2.0, 0.5, 3.0, 2.0])
    candidates = torch.ones(8, dtype=torch.bool)
    # k = 4: the 3.0 and the first three 2.0s
    selected = stare.select_top_surprisal(surprisal, candidates, 0.5)
    assert selected.tolist() == [False, True, True, True, False, False, True, False]
    # many ties, zeros and -0.0 (the surprisal of a token with log-prob 0), against the loop (stable
    # sort)
    generator = torch.Generator().manual_seed(43)
    for trial in range(50):
        surprisal = torch.randint(0, 4, (60,), generator=generator).float()
        surprisal[surprisal == 0] = -0.0 if trial % 2 else 0.0
        candidates = torch.rand(60, generator=generator) < 0.7
        for top_ratio in (0.05, 0.3, 0.77):
            assert torch.equal(stare.select_top_surprisal(surprisal, candidates, top_ratio),
                               select_loop(surprisal, candidates, top_ratio))


def test_select_orders_large_and_infinite_surprisal():
    surprisal = torch.tensor([1e-30, 3.0e38, float("inf"), 7.0, 7.000001, 65536.0, 65537.0, 1e-3])
    order = stare.select_top_surprisal(surprisal, torch.ones(8, dtype=torch.bool), 0.5)
    assert order.tolist() == [False, True, True, False, False, True, True, False]
    top5 = stare.select_top_surprisal(surprisal, torch.ones(8, dtype=torch.bool), 0.625)
    assert top5[4] and not top5[3]  # 7.000001 > 7.0: they differ only in the low 16 bits


def test_select_special_values_and_negative_surprisal():
    # NaN ranks as +inf; negative values (log-prob rounding above 0) and -0.0 count as 0; denormals
    # order correctly.
    surprisal = torch.tensor([float("nan"), -1e-3, 1e-40, 2e-40, 0.5, -0.0, float("inf"), 1e-3])
    everyone = torch.ones(8, dtype=torch.bool)
    ranking, previous = [], torch.zeros(8, dtype=torch.bool)
    # the top k must contain the top k - 1: read off which element joins at each k
    for k in range(1, 9):
        picked = stare.select_top_k(surprisal, everyone, k)
        assert picked.sum() == k and picked[previous].all()
        ranking.append(int((picked & ~previous).nonzero()))
        previous = picked
    # inf and NaN first (their order among themselves is unspecified), then 0.5, 1e-3, the two
    # denormals, then the three zeros (-1e-3 counted as 0, and -0.0) in positional order
    assert set(ranking[:2]) == {0, 6} and ranking[2:] == [4, 7, 3, 2, 1, 5]


def test_select_large_batch_with_a_crowded_top_bucket():
    # > 65,536 distinct values share their top 16 bits, so the second radix pass decides; plus heavy
    # exact ties.
    generator = torch.Generator().manual_seed(47)
    base = torch.tensor(1.5).view(torch.int32)
    low_bits = torch.randint(0, 1 << 16, (200_000,), generator=generator, dtype=torch.int32)
    # all in [1.5, 1.5 + 2^-7), same top 16 bits
    surprisal = ((base & ~0xFFFF) | low_bits).view(torch.float32)
    candidates = torch.rand(200_000, generator=generator) < 0.8
    for k in (1, 777, 50_000, 159_000):
        selected = stare.select_top_k(surprisal, candidates, k)
        order = torch.sort(
            torch.where(candidates, surprisal, -1.0), descending=True, stable=True).indices[:k]
        expected = torch.zeros(200_000, dtype=torch.bool)
        expected[order] = True
        assert torch.equal(selected, expected)


def test_signed_select_top_k_orders_every_float_as_sort_does():
    generator = torch.Generator().manual_seed(59)
    near = torch.tensor(1e-3)
    values = torch.cat(
        [
            torch.randn(3000, generator=generator)
            * 10.0 ** torch.randint(-30, 30, (3000,), generator=generator),
            torch.tensor([-0.0, 0.0, -1e-40, 1e-40, float("-inf"), float("inf")]),
            # near-ties that a float32 shift by -100 would merge
            near + 4e-6 * torch.arange(5)])
    values = values[torch.randperm(len(values), generator=generator)]
    candidates = torch.rand(len(values), generator=generator) < 0.9
    for k in (1, 2, 57, int(candidates.sum()) - 1):
        selected = stare.select_top_k(values, candidates, k, signed=True)
        # -0.0 and 0.0 are one value for sort but two keys here: compare the values taken, not the
        # positions
        order = torch.sort(
            torch.where(candidates, values, float("-inf")), descending=True, stable=True
        ).indices[:k]
        assert selected.sum() == k and not (selected & ~candidates).any()
        assert torch.equal(values[selected].sort().values, values[order].sort().values)


def test_select_top_k_counts():
    values = torch.rand(5, 7, generator=torch.Generator().manual_seed(53))
    candidates = values > 0.3
    n = int(candidates.sum())
    for k in (0, 1, n - 1, n, n + 5, torch.tensor(3), torch.tensor(10**6)):
        expected = min(int(k), n)
        selected = stare.select_top_k(values, candidates, k)
        assert selected.sum() == expected and not (selected & ~candidates).any()
        if 0 < expected < n:
            assert values[selected].min() > values[candidates & ~selected].max()


def test_selection_makes_no_host_sync():
    # On the meta device any .item() or data-dependent Python branch raises, so this catches,
    # without a GPU, what the CUDA test below catches with sync-debug mode.
    logprobs = torch.empty(8, 32, device="meta")
    advantages, mask = (
        torch.empty(8, device="meta"), torch.empty(8, 32, dtype=torch.bool, device="meta"))
    stare.select_top_surprisal(-logprobs, mask, 0.1)
    stare.select_top_k(-logprobs, mask, torch.empty((), dtype=torch.int64, device="meta"))
    for variant in ("O1", "C2"):
        for gate_on in (True, False, torch.empty((), dtype=torch.bool, device="meta")):
            weights, stats = stare.stare_weights(
                logprobs, advantages, mask, variant=variant, gate_on=gate_on)
            assert weights.device.type == "meta" and all(
                v.device.type == "meta" for v in stats.values())


def test_select_bad_ratio_and_shapes():
    for bad in (-0.1, 1.5, float("nan")):
        with pytest.raises(ValueError, match="top_ratio"):
            stare.select_top_surprisal(torch.zeros(3), torch.ones(3, dtype=torch.bool), bad)
    with pytest.raises(ValueError, match="differ"):
        stare.select_top_surprisal(torch.zeros(3), torch.ones(4, dtype=torch.bool), 0.5)


# --------------------------------------------------------------------------------------------------
# quadrant_masks
# --------------------------------------------------------------------------------------------------


def test_quadrant_masks_match_loop():
    generator = torch.Generator().manual_seed(13)
    advantages = torch.tensor([1.0, -0.5, 0.0, 2.0])
    surprisal = torch.rand(4, 6, generator=generator) * 3
    mask = torch.rand(4, 6, generator=generator) < 0.8
    threshold = torch.rand(4, 6, generator=generator) * 3  # a per-token threshold such as s0
    masks = stare.quadrant_masks(advantages, surprisal, mask, threshold)
    for i in range(4):
        for t in range(6):
            a, valid, high = (
                advantages[i].item(), mask[i, t].item(), surprisal[i, t] >= threshold[i, t])
            expected = [valid and a > 0 and high, valid and a > 0 and not high,
                        valid and a < 0 and high, valid and a < 0 and not high]
            assert [q[i, t].item() for q in masks] == expected
    # a scalar threshold works the same as a full tensor of it
    scalar = stare.quadrant_masks(advantages, surprisal, mask, 1.5)
    full = stare.quadrant_masks(advantages, surprisal, mask, torch.full((4, 6), 1.5))
    assert all(torch.equal(a, b) for a, b in zip(scalar, full))


# --------------------------------------------------------------------------------------------------
# stare_weights
# --------------------------------------------------------------------------------------------------


def stare_weights_loop(logprobs, advantages, mask, variant, top_ratio, w, m, gate_on):
    """Eqs. 7-8 written out: flatten, split the valid tokens by advantage sign, sort each by surprisal."""
    weights = torch.ones(logprobs.shape)
    if not gate_on:
        return weights
    flat = [
        (i, t) for i in range(logprobs.shape[0]) for t in range(logprobs.shape[1]) if mask[i, t]]
    for sign, value in ((1, w), (-1, m)):
        if sign < 0 and variant == "O1":
            continue
        group = [(i, t) for i, t in flat if (advantages[i] * sign) > 0]
        if not group or top_ratio == 0:
            continue
        k = min(len(group), max(1, math.ceil(round(top_ratio * len(group), 9))))
        # lowest logprob = highest surprisal
        for i, t in sorted(group, key=lambda it: logprobs[it].item())[:k]:
            weights[i, t] = value
    return weights


@pytest.mark.parametrize("variant", ["O1", "C2", "c2"])
@pytest.mark.parametrize("top_ratio", [0.0, 0.1, 0.3, 1.0])
def test_stare_weights_match_loop(variant, top_ratio):
    generator = torch.Generator().manual_seed(17)
    logprobs = -torch.rand(6, 10, generator=generator) * 4
    advantages = torch.tensor([1.2, -0.7, 0.0, 0.4, -1.1, 0.9])
    mask = torch.rand(6, 10, generator=generator) < 0.85
    mask[3] = False  # an all-masked row
    weights, stats = stare.stare_weights(
        logprobs, advantages, mask, variant=variant, top_ratio=top_ratio, w=1.2, m=0.8)
    expected = stare_weights_loop(
        logprobs, advantages, mask, variant.upper(), top_ratio, 1.2, 0.8, True)
    torch.testing.assert_close(weights, expected)
    # the stats count what the loop selected
    valid = mask.sum().item()
    assert stats["pos_selected_frac"].item() == pytest.approx(
        ((expected == 1.2) & mask).sum().item() / valid)
    assert stats["neg_selected_frac"].item() == pytest.approx(
        ((expected == 0.8) & mask).sum().item() / valid)
    assert stats["mean_weight"].item() == pytest.approx(expected[mask].mean().item(), rel=1e-6)
    token_adv = advantages[:, None].expand(6, 10)
    assert stats["pos_candidate_frac"].item() == pytest.approx(
        ((token_adv > 0) & mask).sum().item() / valid)


def test_stare_weights_gate_and_advantage_shapes():
    generator = torch.Generator().manual_seed(19)
    logprobs = -torch.rand(4, 8, generator=generator) * 3
    advantages = torch.tensor([1.0, -1.0, 0.5, -0.5])
    mask = torch.ones(4, 8, dtype=torch.bool)
    on, _ = stare.stare_weights(logprobs, advantages, mask, variant="C2", top_ratio=0.25)
    # token-level advantages give the same result as sequence advantages broadcast
    on_tokens, _ = stare.stare_weights(
        logprobs, advantages[:, None].expand(4, 8), mask, variant="C2", top_ratio=0.25)
    assert torch.equal(on, on_tokens)
    assert (on != 1).any()
    # gate off (bool or tensor): all ones, but the stats still report the selection
    off, stats = stare.stare_weights(
        logprobs, advantages, mask, variant="C2", top_ratio=0.25, gate_on=False)
    assert (
        torch.equal(off, torch.ones(4, 8))
        and stats["pos_selected_frac"] > 0
        and stats["mean_weight"] == 1)
    off_tensor, _ = stare.stare_weights(logprobs, advantages, mask, variant="C2", top_ratio=0.25,
                                        gate_on=torch.tensor(False))
    on_tensor, _ = stare.stare_weights(logprobs, advantages, mask, variant="C2", top_ratio=0.25,
                                       gate_on=torch.tensor(True))
    assert torch.equal(off_tensor, off) and torch.equal(on_tensor, on)
    # zero advantages: nothing is selected
    zero, stats = stare.stare_weights(logprobs, torch.zeros(4), mask, variant="C2", top_ratio=0.5)
    assert torch.equal(zero, torch.ones(4, 8)) and stats["pos_candidate_frac"] == 0
    # bf16 log-probs
    bf16, _ = stare.stare_weights(logprobs.bfloat16(), advantages, mask, top_ratio=0.25)
    assert bf16.dtype == torch.float32 and (bf16 == 1.1).sum() == math.ceil(0.25 * 16)
    with pytest.raises(ValueError, match="variant"):
        stare.stare_weights(logprobs, advantages, mask, variant="O2")
    with pytest.raises(ValueError, match="top_ratio"):
        stare.stare_weights(logprobs, advantages, mask, top_ratio=2.0)


# --------------------------------------------------------------------------------------------------
# EntropyGate
# --------------------------------------------------------------------------------------------------


def test_gate_follows_a_scripted_entropy_sequence():
    gate = stare.EntropyGate(
        target_entropy=0.3, w=1.1, m=0.9, adaptive=True, alpha=0.1, w_max=1.25, m_min=0.8)
    assert gate.gate_on  # on before the first update, as the reference
    script = [  # (batch entropy, gate_on, w, m) after the update
        (0.5, False, 1.0, 1.0),       # above target: w, m move towards 1 (clipped there)
        (0.2, True, 1.1, 0.9),        # below: one alpha step each way
        (0.1, True, 1.2, 0.8),
        (0.05, True, 1.25, 0.8),      # clipped at w_max and m_min
        (float("nan"), True, 1.25, 0.8),  # not finite: nothing changes
        # exactly at target: strict '<' turns it off, sign 0 leaves w, m
        (0.3, False, 1.25, 0.8),
        (float("inf"), False, 1.25, 0.8),
        (0.31, False, 1.15, 0.9)]
    for entropy, gate_on, w, m in script:
        accepted = gate.update(entropy)
        assert accepted == math.isfinite(entropy)
        assert (gate.gate_on, gate.w, gate.m) == (gate_on, pytest.approx(w), pytest.approx(m)), (
            entropy)
    assert gate.current_entropy == 0.31
    # a 0-dim tensor works too
    assert gate.update(torch.tensor(0.1, dtype=torch.float64)) and gate.gate_on


def test_gate_without_adaptation_and_state_roundtrip():
    gate = stare.EntropyGate(target_entropy=0.5)
    gate.update(0.1)
    assert gate.gate_on and (gate.w, gate.m) == (1.1, 0.9)  # non-adaptive weights never move
    restored = stare.EntropyGate()
    restored.load_state_dict(gate.state_dict())
    assert restored.state_dict() == gate.state_dict()
    for entropy in (0.7, 0.2):  # the copy behaves identically afterwards
        assert gate.update(entropy) == restored.update(entropy)
        assert gate.state_dict() == restored.state_dict()
    with pytest.raises(KeyError, match="missing"):
        restored.load_state_dict({"w": 1.0})
    with pytest.raises(ValueError):
        stare.EntropyGate(w_max=0.5)


# --------------------------------------------------------------------------------------------------
# group_advantages
# --------------------------------------------------------------------------------------------------


def test_group_advantages_match_loop():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.5, 0.2, 0.9, 0.1, 1.0, 1.0, 1.0, 1.0])
    advantages = stare.group_advantages(rewards, group_size=4)
    for g in range(3):
        group = rewards[4 * g:4 * g + 4].tolist()
        # stdev is the unbiased (n - 1) one
        mean, std = statistics.mean(group), statistics.stdev(group)
        for j, r in enumerate(group):
            expected = 0.0 if max(group) == min(group) else (r - mean) / (std + 1e-6)
            assert advantages[4 * g + j].item() == pytest.approx(expected, abs=1e-6)
    centred = stare.group_advantages(rewards, group_size=4, normalize_std=False)  # Dr.GRPO
    torch.testing.assert_close(centred, rewards - rewards.view(3, 4).mean(1).repeat_interleave(4))


def test_group_advantages_equal_rewards_are_exactly_zero():
    rewards = torch.full((6,), 0.1)  # the mean of 0.1s is not exactly 0.1 in floating point
    assert torch.equal(stare.group_advantages(rewards, 3), torch.zeros(6))
    assert torch.equal(stare.group_advantages(rewards, 3, normalize_std=False), torch.zeros(6))


def test_group_advantages_size_one_and_errors():
    torch.testing.assert_close(
        stare.group_advantages(torch.tensor([1.0, 0.0]), 1), torch.tensor([1 / (1 + 1e-6), 0.0]))
    rewards = torch.tensor([1.0, 0.0])
    # mean 0: A = r
    assert torch.equal(stare.group_advantages(rewards, 1, normalize_std=False), rewards)
    with pytest.raises(ValueError, match="group_size"):
        stare.group_advantages(torch.zeros(5), 2)
    with pytest.raises(ValueError, match="1-D"):
        stare.group_advantages(torch.zeros(2, 2), 2)


# --------------------------------------------------------------------------------------------------
# clipped_surrogate
# --------------------------------------------------------------------------------------------------


def surrogate_loop(logprob, old_logprob, advantage, clip_low, clip_high, dual_clip):
    ratio = math.exp(max(-20.0, min(20.0, logprob - old_logprob)))
    loss = max(-advantage * ratio, -advantage * min(max(ratio, 1 - clip_low), 1 + clip_high))
    if dual_clip is not None and advantage < 0:
        loss = min(loss, -advantage * dual_clip)
    return loss


@pytest.mark.parametrize("dual_clip", [None, 3.0])
def test_clipped_surrogate_matches_loop(dual_clip):
    generator = torch.Generator().manual_seed(23)
    old = -torch.rand(5, 7, generator=generator) * 3
    new = old + torch.randn(5, 7, generator=generator) * 0.8  # ratios well outside the band too
    new[0, 0] = old[0, 0] + 30  # beyond the +-20 log-ratio clamp
    advantages = torch.tensor([1.0, -1.0, 0.3, -2.0, 0.0])
    mask = torch.ones(5, 7, dtype=torch.bool)
    mask[2, 3:] = False
    loss, stats = stare.clipped_surrogate(
        new, old, advantages, clip_low=0.2, clip_high=0.28, dual_clip=dual_clip, mask=mask)
    clipped = dual = 0
    for i in range(5):
        for t in range(7):
            a, lp, olp = advantages[i].item(), new[i, t].item(), old[i, t].item()
            expected = surrogate_loop(lp, olp, a, 0.2, 0.28, dual_clip)
            assert loss[i, t].item() == pytest.approx(expected, rel=1e-5, abs=1e-6)
            if mask[i, t]:
                r = math.exp(max(-20, min(20, lp - olp)))
                clipped += -a * min(max(r, 0.8), 1.28) > -a * r
                dual += (
                    dual_clip is not None
                    and a < 0
                    and max(-a * r, -a * min(max(r, 0.8), 1.28)) > -a * dual_clip)
    num_valid = mask.sum().item()
    assert stats["clip_frac"].item() == pytest.approx(clipped / num_valid)
    assert stats["dual_clip_frac"].item() == pytest.approx(dual / num_valid)
    log_ratio = (new - old).clamp(-20, 20)  # verl reports the KL of the clamped log-ratio too
    assert stats["approx_kl"].item() == pytest.approx(-log_ratio[mask].mean().item(), rel=1e-5)
    k3 = [math.expm1(d) - d for d in log_ratio[mask].tolist()]
    assert stats["approx_kl_k3"].item() == pytest.approx(sum(k3) / len(k3), rel=1e-5)
    token_adv, ratio = advantages[:, None].expand(5, 7), log_ratio.exp()
    low = ((token_adv < 0) & (ratio < 0.8) & mask).sum().item()
    high = ((token_adv > 0) & (ratio > 1.28) & mask).sum().item()
    assert low > 0 and high > 0
    assert stats["clip_low_frac"].item() == pytest.approx(low / num_valid)
    assert stats["clip_high_frac"].item() == pytest.approx(high / num_valid)
    assert stats["clip_frac"].item() == pytest.approx((low + high) / num_valid)


def test_on_policy_gradient_is_advantage_times_score():
    # At r = 1 no clipping is active: d loss / d logprob = -A per token.
    logprobs = (-torch.rand(3, 4)).requires_grad_(True)
    advantages = torch.tensor([0.5, -1.5, 2.0])
    loss, stats = stare.clipped_surrogate(logprobs, logprobs.detach(), advantages, dual_clip=10.0)
    loss.sum().backward()
    torch.testing.assert_close(logprobs.grad, -advantages[:, None].expand(3, 4))
    assert stats["clip_frac"] == 0 and stats["approx_kl"] == 0


def test_clipped_surrogate_rejects_bad_clips():
    x = torch.zeros(2, 2)
    with pytest.raises(ValueError, match="clip_low"):
        stare.clipped_surrogate(x, x, torch.zeros(2), clip_low=0.0)
    with pytest.raises(ValueError, match="dual_clip"):
        stare.clipped_surrogate(x, x, torch.zeros(2), dual_clip=1.0)


# --------------------------------------------------------------------------------------------------
# aggregate_loss
# --------------------------------------------------------------------------------------------------


def aggregate_loop(loss, mask, mode, scale=None):
    rows = [
        [loss[i, t].item() for t in range(loss.shape[1]) if mask[i, t]]
        for i in range(loss.shape[0])]
    nonempty = [row for row in rows if row]
    if mode == "token-mean":
        return sum(sum(row) for row in rows) / max(1, sum(len(row) for row in rows))
    if mode == "seq-mean-token-mean":
        return sum(sum(row) / len(row) for row in nonempty) / max(1, len(nonempty))
    if mode == "seq-mean-token-sum":
        return sum(sum(row) for row in nonempty) / max(1, len(nonempty))
    return sum(sum(row) / (scale or loss.shape[1]) for row in nonempty) / max(1, len(nonempty))


@pytest.mark.parametrize("mode", stare.LOSS_AGG_MODES)
def test_aggregate_loss_matches_loop(mode):
    generator = torch.Generator().manual_seed(29)
    loss = torch.randn(5, 8, generator=generator)
    mask = torch.rand(5, 8, generator=generator) < 0.7
    mask[1] = False  # an empty sequence
    assert stare.aggregate_loss(loss, mask, mode).item() == pytest.approx(
        aggregate_loop(loss, mask, mode), rel=1e-5)
    # nothing valid: 0, not NaN
    assert stare.aggregate_loss(loss, torch.zeros_like(mask), mode).item() == 0.0
    if mode == "seq-mean-token-sum-norm":
        assert stare.aggregate_loss(
            loss, mask, mode, loss_scale_factor=100
        ).item() == pytest.approx(aggregate_loop(loss, mask, mode, scale=100), rel=1e-5)
    with pytest.raises(ValueError, match="aggregation mode"):
        stare.aggregate_loss(loss, mask, "token-sum")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_aggregate_loss_in_half_precision(dtype):
    # the count must not be rounded (bf16 holds 257 as 256) or overflow (fp16's max is 65504)
    loss = torch.ones(1, 257, dtype=dtype)
    mask = torch.ones(1, 257, dtype=torch.bool)
    assert stare.aggregate_loss(loss, mask).item() == 1.0
    assert stare.aggregate_loss(loss, mask, num_tokens=100_000).item() == pytest.approx(
        257 / 100_000)
    assert stare.aggregate_loss(
        loss, mask, num_tokens=torch.tensor(100_000)).item() == pytest.approx(257 / 100_000)
    assert stare.aggregate_loss(loss, mask).dtype == torch.float32


@pytest.mark.parametrize("mode", stare.LOSS_AGG_MODES)
def test_micro_batch_accumulation_equals_full_batch(mode):
    # The full pipeline on one batch vs. the sum of micro-batch shares normalised by the global
    # counts: same value, same gradient. Micro-batches have different padded widths, as token-budget
    # packing makes them.
    generator = torch.Generator().manual_seed(31)
    logits = torch.randn(6, 9, 16, generator=generator, requires_grad=True)
    tokens = torch.randint(0, 16, (6, 9), generator=generator)
    old_logprobs = -torch.rand(6, 9, generator=generator) * 3
    advantages = torch.randn(6, generator=generator)
    mask = torch.rand(6, 9, generator=generator) < 0.8
    weights, _ = stare.stare_weights(old_logprobs, advantages, mask, variant="C2", top_ratio=0.2)
    scale = 9  # a constant, as Dr.GRPO requires

    # the weighted token losses of a micro-batch of rows cut to `width` positions
    def loss_of(rows, width):
        logprobs, _ = stare.token_logprobs_and_entropy(logits[rows, :width], tokens[rows, :width])
        token_loss, _ = stare.clipped_surrogate(
            logprobs, old_logprobs[rows, :width], advantages[rows], dual_clip=3.0)
        return token_loss * weights[rows, :width], None

    mask[0:2, 7:] = False  # rows 0-1 end by position 7, so their micro-batch can be cut to width 7

    token_loss, _ = loss_of(slice(0, 6), 9)
    full_loss = stare.aggregate_loss(token_loss, mask, mode=mode, loss_scale_factor=scale)
    (full_grad,) = torch.autograd.grad(full_loss, logits)

    num_tokens, num_sequences = mask.sum(), (mask.sum(-1) > 0).sum()  # the step's global counts
    accumulated = 0.0
    for rows, width in ((slice(0, 2), 7), (slice(2, 5), 9), (slice(5, 6), 9)):
        token_loss, _ = loss_of(rows, width)
        accumulated = accumulated + stare.aggregate_loss(
            token_loss, mask[rows, :width], mode=mode, num_tokens=num_tokens,
            num_sequences=num_sequences, loss_scale_factor=scale)
    (accumulated_grad,) = torch.autograd.grad(accumulated, logits)
    torch.testing.assert_close(accumulated, full_loss, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(accumulated_grad, full_grad, atol=1e-7, rtol=1e-5)


# --------------------------------------------------------------------------------------------------
# entropy_dynamics
# --------------------------------------------------------------------------------------------------


def test_entropy_dynamics_matches_loop_and_quadrant_sum():
    generator = torch.Generator().manual_seed(37)
    logits = torch.randn(4, 6, 10, generator=generator, dtype=torch.float64) * 2
    tokens = torch.randint(0, 10, (4, 6), generator=generator)
    advantages = torch.tensor([1.0, -1.0, 0.5, 0.0])
    mask = torch.rand(4, 6, generator=generator) < 0.8
    weights = 1 + 0.2 * torch.rand(4, 6, generator=generator)
    sensitivity = stare.entropy_sensitivity(logits, tokens)
    stats = stare.entropy_dynamics(advantages, sensitivity, mask, weights=weights)
    num_valid = mask.sum().item()
    totals = {q: [0, 0.0] for q in stare.QUADRANTS}
    for i in range(4):
        for t in range(6):
            a, s = advantages[i].item(), sensitivity[i, t].item()
            if not mask[i, t] or a == 0:
                continue
            quadrant = ("pos_" if a > 0 else "neg_") + ("high" if s >= 0 else "low")
            totals[quadrant][0] += 1
            totals[quadrant][1] += weights[i, t].item() * a * s
    for q, (count, dh) in totals.items():
        assert stats[f"{q}/frac"].item() == pytest.approx(count / num_valid)
        assert stats[f"{q}/dH"].item() == pytest.approx(dh / num_valid, abs=1e-6)
    assert stats["total/dH"].item() == pytest.approx(
        sum(stats[f"{q}/dH"].item() for q in stare.QUADRANTS), abs=1e-6)
    # The quadrant signs of Eq. 6: A*S > 0 exactly in pos_high and neg_low (pos_high's S = 0
    # boundary aside).
    assert stats["pos_high/dH"] >= 0 and stats["neg_low/dH"] >= 0
    assert stats["pos_low/dH"] <= 0 and stats["neg_high/dH"] <= 0


def test_entropy_dynamics_predicts_the_entropy_change_of_a_tabular_step():
    # Each token is its own context with its own logits: take the step eta*omega*A*(e_k - pi) on
    # every context and compare the measured mean entropy change with eta * total/dH.
    generator = torch.Generator().manual_seed(41)
    logits = torch.randn(3, 5, 12, generator=generator, dtype=torch.float64) * 2
    tokens = torch.randint(0, 12, (3, 5), generator=generator)
    advantages = torch.tensor([1.3, -0.6, 0.8])
    mask = torch.ones(3, 5, dtype=torch.bool)
    weights, _ = stare.stare_weights(
        torch.log_softmax(logits, -1).gather(-1, tokens[..., None]).squeeze(-1), advantages, mask,
        variant="C2", top_ratio=0.3, w=1.5, m=0.5)
    stats = stare.entropy_dynamics(
        advantages, stare.entropy_sensitivity(logits, tokens), mask, weights=weights)
    eta = 1e-5
    step = (torch.nn.functional.one_hot(tokens, 12) - torch.softmax(logits, -1)) * (
        weights.double() * advantages[:, None].double())[..., None]
    measured = (entropy_of(logits + eta * step) - entropy_of(logits - eta * step)).mean() / (
        2 * eta)
    assert stats["total/dH"].item() == pytest.approx(measured.item(), rel=1e-4, abs=1e-7)


# --------------------------------------------------------------------------------------------------
# GPU only: no host-device synchronisation in the selection path
# --------------------------------------------------------------------------------------------------


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_selection_never_syncs_host_and_device():
    device = torch.device("cuda")
    logprobs = -torch.rand(64, 256, device=device) * 5
    advantages = torch.randn(64, device=device)
    mask = torch.rand(64, 256, device=device) < 0.9
    # made before sync-debug mode: a host-to-device copy syncs
    gate_off = torch.tensor(False, device=device)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        stare.select_top_surprisal(-logprobs, mask & (advantages[:, None] > 0), 0.1)
        for variant in ("O1", "C2"):
            stare.stare_weights(
                logprobs, advantages, mask, variant=variant, top_ratio=0.1, gate_on=True)
            stare.stare_weights(
                logprobs, advantages, mask, variant=variant, top_ratio=0.1, gate_on=gate_off)
    finally:
        torch.cuda.set_sync_debug_mode("default")
