"""Tests for the policy losses beside PPO-clip (baselines.gspo_surrogate, cispo_surrogate,
sapo_surrogate): bit for bit against re-statements of verl's functions on generated cases (values
and gradients), and against plain loops written from Eqs. 27-29.

The reference is volcengine/verl @b178a3c, verl/trainer/ppo/core_algos.py:
compute_policy_loss_gspo, compute_policy_loss_cispo, compute_policy_loss_sapo and agg_loss (with
masked_sum, masked_mean of verl/utils/torch_functional.py), re-stated below operation by
operation, so that the floats round alike.
"""

import math

import pytest
import torch

import baselines
import stare

NUM_CASES = 120  # generated cases per loss

# --------------------------------------------------------------------------------------------------
# verl's computation, re-stated (advantages [B, T] as verl's, zero on padding)
# --------------------------------------------------------------------------------------------------


def verl_masked_sum(values, mask, axis=None):
    # masked-out values are replaced by 0 before the product with the mask (NaN-safe)
    return (torch.where(mask.bool(), values, 0.0) * mask).sum(axis=axis)


def verl_masked_mean(values, mask):
    return verl_masked_sum(values, mask) / (mask.sum() + 1e-8)


def verl_agg_loss(loss_mat, loss_mask, mode, batch_num_tokens=None, global_batch_size=None,
                  dp_size=1):
    """verl's agg_loss for the three modes it shares with stare.aggregate_loss (its
    seq-mean-token-sum-norm does not divide by the number of sequences: docs/method.md)."""
    if mode == "token-mean":
        if batch_num_tokens is None:
            batch_num_tokens = loss_mask.sum()
        return verl_masked_sum(loss_mat, loss_mask) / batch_num_tokens * dp_size
    if mode == "seq-mean-token-sum":
        per_sequence = torch.sum(loss_mat * loss_mask, dim=-1)
        non_empty = (torch.sum(loss_mask, dim=-1) > 0).float()
    elif mode == "seq-mean-token-mean":
        counts = torch.sum(loss_mask, dim=-1)
        per_sequence = torch.sum(loss_mat * loss_mask, dim=-1) / (counts + 1e-8)
        non_empty = (counts > 0).float()
    else:
        raise ValueError(mode)
    if global_batch_size is None:
        global_batch_size = non_empty.sum()
    return verl_masked_sum(per_sequence, non_empty) / global_batch_size * dp_size


def verl_gspo(old_log_prob, log_prob, advantages, response_mask, clip_ratio_low, clip_ratio_high,
              **global_batch_info):
    """compute_policy_loss_gspo: the sequence log-ratio over the valid tokens, the stop-gradient
    combination, the clamp at 10 in log space, PPO's max without dual clip, seq-mean-token-mean
    always."""
    log_ratio = log_prob - old_log_prob
    lengths = torch.sum(response_mask, dim=-1).clamp(min=1)
    seq_log_ratio = torch.sum(log_ratio * response_mask, dim=-1) / lengths
    combined = log_prob - log_prob.detach() + seq_log_ratio.detach().unsqueeze(-1)
    ratio = torch.exp(torch.clamp(combined, max=10.0))
    losses1 = -advantages * ratio
    losses2 = -advantages * torch.clamp(ratio, 1 - clip_ratio_low, 1 + clip_ratio_high)
    losses = torch.maximum(losses1, losses2)
    loss = verl_agg_loss(losses, response_mask, "seq-mean-token-mean", **global_batch_info)
    clipfrac = verl_masked_mean(torch.gt(losses2, losses1).float(), response_mask)
    return loss, clipfrac, verl_masked_mean(-log_ratio, response_mask)


def verl_cispo(old_log_prob, log_prob, advantages, response_mask, clip_ratio_low, clip_ratio_high,
               loss_agg_mode="token-mean", **global_batch_info):
    """compute_policy_loss_cispo: the +-20 clamp, the clipped ratio detached, times A and log pi
    itself; aggregated by loss_agg_mode."""
    log_ratio = torch.clamp(log_prob - old_log_prob, min=-20.0, max=20.0)
    ratio = torch.exp(log_ratio)
    clipped = torch.clamp(ratio, 1 - clip_ratio_low, 1 + clip_ratio_high)
    losses = -clipped.detach() * advantages * log_prob
    loss = verl_agg_loss(losses, response_mask, loss_agg_mode, **global_batch_info)
    clipfrac = verl_masked_mean((ratio != clipped).float(), response_mask)
    return loss, clipfrac, verl_masked_mean(-log_ratio, response_mask)


def verl_sapo(old_log_prob, log_prob, advantages, response_mask, tau_pos, tau_neg,
              **global_batch_info):
    """compute_policy_loss_sapo: taus as tensors of the advantages' dtype, tau_neg where A <= 0,
    the gate sigmoid(tau (r - 1)) 4 / tau, seq-mean-token-mean always."""
    tau_pos = torch.as_tensor(tau_pos, dtype=advantages.dtype, device=advantages.device)
    tau_neg = torch.as_tensor(tau_neg, dtype=advantages.dtype, device=advantages.device)
    log_ratio = torch.clamp(log_prob - old_log_prob, min=-20.0, max=20.0)
    ratio = torch.exp(log_ratio)
    taus = torch.where(advantages > 0, tau_pos, tau_neg)
    gates = torch.sigmoid(taus * (ratio - 1.0)) * (4.0 / taus)
    losses = -gates * advantages
    loss = verl_agg_loss(losses, response_mask, "seq-mean-token-mean", **global_batch_info)
    return loss, verl_masked_mean(-log_ratio, response_mask)


# --------------------------------------------------------------------------------------------------
# Generated cases
# --------------------------------------------------------------------------------------------------

ADVANTAGE_SIGNS = ("mixed", "positive", "negative", "with_zeros")
# (scale of the log-ratio noise, its offset): on-policy, near 1, far from 1, past the clamps
DRIFTS = ((0.0, 0.0), (1e-4, 0.0), (3e-3, 0.0), (0.1, 0.0), (0.7, 0.0), (3.0, 0.0), (1.0, 12.0),
          (1.0, -12.0), (25.0, 0.0))
MASK_DTYPES = (torch.bool, torch.int64, torch.float32)  # verl's response masks come in any of these


def make_case(seed):
    """A random batch: B in 1..8, T in 1..12, masks with empty rows (at least one valid token),
    sequence or token advantages of either or one sign, ratios near and far from 1."""
    generator = torch.Generator().manual_seed(seed)

    def pick(options):
        return options[int(torch.randint(len(options), (), generator=generator))]

    batch_size = int(torch.randint(1, 9, (), generator=generator))
    width = int(torch.randint(1, 13, (), generator=generator))
    old_logprobs = torch.log(torch.rand(batch_size, width, generator=generator)).clamp(min=-15.0)
    scale, offset = pick(DRIFTS)
    drift = scale * torch.randn(batch_size, width, generator=generator) + offset
    logprobs = (old_logprobs + drift).requires_grad_(True)
    if seed % 3 == 0:  # contiguous responses, as verl's attention masks
        lengths = torch.randint(0, width + 1, (batch_size,), generator=generator)
        mask = torch.arange(width)[None, :] < lengths[:, None]
    else:  # holes anywhere, as tool output leaves
        mask = torch.rand(batch_size, width, generator=generator) < pick((0.3, 0.7, 1.0))
    mask &= torch.rand(batch_size, 1, generator=generator) > 0.2  # empty rows
    if not mask.any():
        mask[int(torch.randint(batch_size, (), generator=generator)), 0] = True
    token_level = seed % 4 == 1
    shape = (batch_size, width) if token_level else (batch_size,)
    advantages = torch.randn(shape, generator=generator)
    sign = pick(ADVANTAGE_SIGNS)
    if sign == "positive":
        advantages = advantages.abs() + 0.01
    elif sign == "negative":
        advantages = -advantages.abs() - 0.01
    elif sign == "with_zeros":
        advantages = torch.where(torch.rand(shape, generator=generator) < 0.4, 0.0, advantages)
    verl_advantages = stare.token_advantages(advantages, logprobs) * mask  # verl's [B, T]
    return {"logprobs": logprobs, "old_logprobs": old_logprobs, "advantages": advantages,
            "mask": mask, "verl_advantages": verl_advantages,
            "verl_mask": mask.to(MASK_DTYPES[seed % 3 - 1]), "pick": pick}


def value_and_grad(loss, logprobs):
    (grad,) = torch.autograd.grad(loss, logprobs)
    return loss.detach(), grad


def assert_bit_identical(ours, reference, logprobs, label):
    loss, grad = value_and_grad(ours, logprobs)
    expected_loss, expected_grad = value_and_grad(reference, logprobs)
    assert loss.dtype == expected_loss.dtype == torch.float32, label
    assert torch.equal(loss, expected_loss), f"{label}: {loss.item()!r} != {expected_loss.item()!r}"
    assert torch.equal(grad, expected_grad), f"{label}: gradients differ by " \
        f"{(grad - expected_grad).abs().max().item()!r}"
    assert torch.isfinite(loss) and torch.isfinite(grad).all(), label


def assert_stats_match(stats, clipfrac, ppo_kl, label):
    # the same fractions and means; divided by n here, by n + 1e-8 there: equal to a few ulps
    if clipfrac is not None:
        torch.testing.assert_close(stats["clip_frac"], clipfrac, rtol=1e-6, atol=0, msg=label)
    torch.testing.assert_close(stats["approx_kl"], ppo_kl, rtol=1e-5, atol=1e-7, msg=label)


# --------------------------------------------------------------------------------------------------
# Bit for bit against verl, values and gradients
# --------------------------------------------------------------------------------------------------


def test_gspo_matches_verl_bit_for_bit():
    clipped_somewhere = 0
    for seed in range(NUM_CASES):
        case = make_case(seed)
        # the paper's / verl recipe's ranges, and PPO's
        clip_low, clip_high = case["pick"](((3e-4, 4e-4), (0.2, 0.28)))
        token_loss, stats = baselines.gspo_surrogate(
            case["logprobs"], case["old_logprobs"], case["advantages"], case["mask"], clip_low,
            clip_high)
        ours = stare.aggregate_loss(token_loss, case["mask"], "seq-mean-token-mean")
        reference, clipfrac, ppo_kl = verl_gspo(
            case["old_logprobs"], case["logprobs"], case["verl_advantages"], case["verl_mask"],
            clip_low, clip_high)
        assert_bit_identical(ours, reference, case["logprobs"], f"gspo case {seed}")
        assert_stats_match(stats, clipfrac, ppo_kl, f"gspo case {seed}")
        clipped_somewhere += bool(stats["clip_frac"] > 0)
    assert 0 < clipped_somewhere < NUM_CASES  # the cases exercise both sides of the clip


def test_cispo_matches_verl_bit_for_bit():
    for seed in range(NUM_CASES):
        case = make_case(seed)
        # verl's CISPO example (no lower bound), PPO's ranges, a wide upper bound
        clip_low, clip_high = case["pick"](((10.0, 0.2), (0.2, 0.28), (0.2, 5.0)))
        agg_mode = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum")[seed % 3]
        token_loss, stats = baselines.cispo_surrogate(
            case["logprobs"], case["old_logprobs"], case["advantages"], case["mask"], clip_low,
            clip_high)
        ours = stare.aggregate_loss(token_loss, case["mask"], agg_mode)
        reference, clipfrac, ppo_kl = verl_cispo(
            case["old_logprobs"], case["logprobs"], case["verl_advantages"], case["verl_mask"],
            clip_low, clip_high, agg_mode)
        assert_bit_identical(ours, reference, case["logprobs"], f"cispo case {seed} {agg_mode}")
        assert_stats_match(stats, clipfrac, ppo_kl, f"cispo case {seed}")


def test_sapo_matches_verl_bit_for_bit():
    for seed in range(NUM_CASES):
        case = make_case(seed)
        tau_pos, tau_neg = case["pick"](((1.0, 1.05), (0.5, 2.0), (3.0, 0.7)))  # paper's first
        token_loss, stats = baselines.sapo_surrogate(
            case["logprobs"], case["old_logprobs"], case["advantages"], case["mask"], tau_pos,
            tau_neg)
        ours = stare.aggregate_loss(token_loss, case["mask"], "seq-mean-token-mean")
        reference, ppo_kl = verl_sapo(
            case["old_logprobs"], case["logprobs"], case["verl_advantages"], case["verl_mask"],
            tau_pos, tau_neg)
        assert_bit_identical(ours, reference, case["logprobs"], f"sapo case {seed}")
        assert_stats_match(stats, None, ppo_kl, f"sapo case {seed}")
        assert stats["clip_frac"] == 0


@pytest.mark.parametrize("loss_name", ["gspo", "cispo", "sapo"])
def test_micro_batches_with_the_step_counts_match_verl_with_global_batch_info(loss_name):
    # verl's engines pass the step's counts (global_batch_info); here aggregate_loss's num_tokens /
    # num_sequences: each micro-batch's share is verl's, and the shares add up to the whole batch
    case = next(case for case in map(make_case, range(7, 100))  # >= 4 rows, tokens in both parts
                if case["logprobs"].shape[0] >= 4 and case["mask"][:2].any()
                and case["mask"][2:].any())
    mode = "token-mean" if loss_name == "cispo" else "seq-mean-token-mean"
    mask = case["mask"]
    num_tokens, num_sequences = mask.sum(), (mask.sum(-1) > 0).sum()
    surrogate = getattr(baselines, f"{loss_name}_surrogate")
    reference_fn = {"gspo": verl_gspo, "cispo": verl_cispo, "sapo": verl_sapo}[loss_name]
    knobs = {"gspo": (0.2, 0.28), "cispo": (10.0, 0.2), "sapo": (1.0, 1.05)}[loss_name]
    shares = 0.0
    for rows in (slice(0, 2), slice(2, None)):
        token_loss, _ = surrogate(case["logprobs"][rows], case["old_logprobs"][rows],
                                  case["advantages"][rows], mask[rows], *knobs)
        ours = stare.aggregate_loss(token_loss, mask[rows], mode, num_tokens, num_sequences)
        reference = reference_fn(
            case["old_logprobs"][rows], case["logprobs"][rows], case["verl_advantages"][rows],
            case["verl_mask"][rows], *knobs, batch_num_tokens=num_tokens,
            global_batch_size=num_sequences)[0]
        assert_bit_identical(ours, reference, case["logprobs"], f"{loss_name} rows {rows}")
        shares = shares + ours
    whole, _ = surrogate(case["logprobs"], case["old_logprobs"], case["advantages"], mask, *knobs)
    torch.testing.assert_close(shares, stare.aggregate_loss(whole, mask, mode), rtol=1e-6,
                               atol=1e-7)


@pytest.mark.parametrize("loss_name", ["gspo", "cispo", "sapo"])
def test_an_empty_batch_gives_zero_not_nan(loss_name):
    # verl divides by the counts (0 / 0 = NaN) where aggregate_loss gives 0 and a zero gradient
    case = make_case(seed=3)
    mask = torch.zeros_like(case["mask"])
    for mode in ("token-mean", "seq-mean-token-mean"):
        token_loss, stats = getattr(baselines, f"{loss_name}_surrogate")(
            case["logprobs"], case["old_logprobs"], case["advantages"], mask)
        loss, grad = value_and_grad(stare.aggregate_loss(token_loss, mask, mode), case["logprobs"])
        assert loss == 0 and (grad == 0).all()
    assert all(torch.isfinite(value) for value in stats.values())


# --------------------------------------------------------------------------------------------------
# Closed forms and plain loops from Eqs. 27-29
# --------------------------------------------------------------------------------------------------


def loop_case(seed, on_policy):
    case = make_case(seed)
    if on_policy:
        case["logprobs"] = case["old_logprobs"].clone().requires_grad_(True)
    rows = [[t for t in range(case["mask"].shape[1]) if case["mask"][i, t]]
            for i in range(case["mask"].shape[0])]
    adv = stare.token_advantages(case["advantages"], case["logprobs"]).double()
    return case, rows, adv


def expected_seq_mean(rows, per_token):
    """Eq. 3's seq-mean-token-mean of per_token(i, t) -> (loss, {(i, t): d loss / d value})."""
    non_empty = [i for i, ts in enumerate(rows) if ts]
    loss = sum(sum(per_token(i, t) for t in rows[i]) / len(rows[i]) for i in non_empty)
    weights = {(i, t): 1 / (len(rows[i]) * len(non_empty)) for i in non_empty for t in rows[i]}
    return loss / len(non_empty), weights


@pytest.mark.parametrize("seed", [40, 41, 42, 43])
@pytest.mark.parametrize("on_policy", [True, False])
def test_gspo_against_a_loop(seed, on_policy):
    # on-policy s_i = 1: the loss is -A per token and the gradient GRPO's, -A / (n_i N_seq);
    # off-policy: s_i = exp(mean_t d), loss max(-A s, -A clip(s)); the gradient -A s while unclipped
    case, rows, adv = loop_case(seed, on_policy)
    low, high = 0.2, 0.28
    d = (case["logprobs"] - case["old_logprobs"]).detach().double()
    seq_ratio = [math.exp(min(sum(d[i, t] for t in ts) / len(ts), 10.0)) if ts else 1.0
                 for i, ts in enumerate(rows)]

    def per_token(i, t):
        a, s = adv[i, t].item(), seq_ratio[i]
        return max(-a * s, -a * min(max(s, 1 - low), 1 + high))

    expected, weights = expected_seq_mean(rows, per_token)
    token_loss, _ = baselines.gspo_surrogate(case["logprobs"], case["old_logprobs"],
                                             case["advantages"], case["mask"], low, high)
    loss, grad = value_and_grad(stare.aggregate_loss(token_loss, case["mask"],
                                                     "seq-mean-token-mean"), case["logprobs"])
    expected_grad = torch.zeros_like(grad, dtype=torch.float64)
    for (i, t), w in weights.items():
        a, s = adv[i, t].item(), seq_ratio[i]
        unclipped_wins = -a * s >= -a * min(max(s, 1 - low), 1 + high)
        expected_grad[i, t] = -a * s * w if unclipped_wins else 0.0
    if on_policy:
        assert (token_loss == -stare.token_advantages(case["advantages"], token_loss))[
            case["mask"]].all()
    assert loss.item() == pytest.approx(expected, rel=1e-5, abs=1e-6)
    torch.testing.assert_close(grad.double(), expected_grad, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("seed", [50, 51, 52, 53])
@pytest.mark.parametrize("on_policy", [True, False])
def test_cispo_against_a_loop(seed, on_policy):
    # loss -w A log pi, w = clip(r) detached; token-mean; the gradient -w A / N_tok on every valid
    # token, clipped or not (on-policy w = 1: -A / N_tok)
    case, rows, adv = loop_case(seed, on_policy)
    low, high = 0.2, 0.28
    lp, old = case["logprobs"].detach().double(), case["old_logprobs"].double()
    cells = [(i, t) for i, ts in enumerate(rows) for t in ts]
    weight = {(i, t): min(max(math.exp(max(-20.0, min(20.0, lp[i, t] - old[i, t]))), 1 - low),
                          1 + high) for i, t in cells}
    expected = sum(-weight[c] * adv[c].item() * lp[c].item() for c in cells) / len(cells)
    token_loss, _ = baselines.cispo_surrogate(case["logprobs"], case["old_logprobs"],
                                              case["advantages"], case["mask"], low, high)
    loss, grad = value_and_grad(stare.aggregate_loss(token_loss, case["mask"], "token-mean"),
                                case["logprobs"])
    expected_grad = torch.zeros_like(grad, dtype=torch.float64)
    for c in cells:
        expected_grad[c] = -weight[c] * adv[c].item() / len(cells)
    if on_policy:
        assert all(weight[c] == 1.0 for c in cells)
    assert loss.item() == pytest.approx(expected, rel=1e-5, abs=1e-6)
    torch.testing.assert_close(grad.double(), expected_grad, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("seed", [60, 61, 62, 63])
@pytest.mark.parametrize("on_policy", [True, False])
def test_sapo_against_a_loop(seed, on_policy):
    # loss -(4 / tau) sigmoid(tau (r - 1)) A; d/d log pi = -4 sigmoid (1 - sigmoid) r A, which is
    # -A on-policy whatever tau (the gate 2 / tau): GRPO's gradient
    case, rows, adv = loop_case(seed, on_policy)
    tau_pos, tau_neg = 1.0, 1.05
    d = (case["logprobs"] - case["old_logprobs"]).detach().double()

    def gate_and_slope(i, t):
        a = adv[i, t].item()
        tau = tau_pos if a > 0 else tau_neg
        r = math.exp(max(-20.0, min(20.0, d[i, t].item())))
        sig = 1 / (1 + math.exp(-tau * (r - 1)))
        return 4 / tau * sig, 4 * sig * (1 - sig) * r

    expected, weights = expected_seq_mean(rows, lambda i, t: -gate_and_slope(i, t)[0] * adv[i, t])
    token_loss, _ = baselines.sapo_surrogate(case["logprobs"], case["old_logprobs"],
                                             case["advantages"], case["mask"], tau_pos, tau_neg)
    loss, grad = value_and_grad(stare.aggregate_loss(token_loss, case["mask"],
                                                     "seq-mean-token-mean"), case["logprobs"])
    expected_grad = torch.zeros_like(grad, dtype=torch.float64)
    for (i, t), w in weights.items():
        expected_grad[i, t] = -gate_and_slope(i, t)[1] * adv[i, t] * w
    if on_policy:
        tau = torch.where(stare.token_advantages(case["advantages"], token_loss) > 0, 1.0, 1.05)
        on_mask = case["mask"]
        torch.testing.assert_close(token_loss[on_mask], (-2 / tau * stare.token_advantages(
            case["advantages"], token_loss))[on_mask], rtol=1e-6, atol=0)
    assert float(loss) == pytest.approx(float(expected), rel=1e-5, abs=1e-6)
    torch.testing.assert_close(grad.double(), expected_grad, rtol=1e-5, atol=1e-7)


def test_bad_hyperparameters_are_named():
    case = make_case(seed=1)
    args = (case["logprobs"], case["old_logprobs"], case["advantages"], case["mask"])
    with pytest.raises(ValueError, match="clip_low and clip_high"):
        baselines.gspo_surrogate(*args, clip_low=0.0)
    with pytest.raises(ValueError, match="clip_low and clip_high"):
        baselines.cispo_surrogate(*args, clip_high=-1.0)
    with pytest.raises(ValueError, match="tau_pos and tau_neg"):
        baselines.sapo_surrogate(*args, tau_neg=0.0)
