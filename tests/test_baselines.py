"""Tests for baselines.py: each method against a naive token loop, the invariants of each paper, and
the neutral setting of every knob reproducing GRPO's loss and gradient exactly."""

import dataclasses
import math

import pytest
import torch

import baselines
import config
import stare


def make_batch(seed=0, batch_size=6, width=9, vocab=12, on_policy=False):
    """Random logits -> every tensor a loss needs, with log-probs as a leaf that collects gradients."""
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(batch_size, width, vocab, generator=generator) * 2.5
    tokens = torch.randint(0, vocab, (batch_size, width), generator=generator)
    old_logprobs, entropy = stare.token_logprobs_and_entropy(logits, tokens)
    drift = 0.0 if on_policy else 0.3 * torch.randn(batch_size, width, generator=generator)
    logprobs = (old_logprobs + drift).clamp(max=0.0).requires_grad_(True)
    mask = torch.rand(batch_size, width, generator=generator) < 0.85
    mask[2, 5:] = False
    rewards = (torch.rand(batch_size, generator=generator) < 0.5).float()
    rewards = rewards + 0.1 * torch.arange(batch_size)
    advantages = stare.group_advantages(rewards, group_size=2)
    return {"logits": logits, "tokens": tokens, "logprobs": logprobs, "old_logprobs": old_logprobs,
            "advantages": advantages, "mask": mask, "entropy": entropy, "rewards": rewards,
            "groups": torch.arange(batch_size) // 2,
            "proxy_logprobs": baselines.minp_proxy_logprobs(logits, tokens, kappa=1e-3),  # uniform
            "sensitivity": stare.entropy_sensitivity(logits, tokens)}


def cells(batch):
    """(i, t, advantage) for every valid token, in flattened order."""
    mask, adv = batch["mask"], batch["advantages"]
    return [
        (i, t, adv[i].item())
        for i in range(mask.shape[0])
        for t in range(mask.shape[1])
        if mask[i, t]]


def surrogate_loop(lp, old, a, cfg):
    r = math.exp(max(-20.0, min(20.0, lp - old)))
    loss = max(-a * r, -a * min(max(r, 1 - cfg.clip_low), 1 + cfg.clip_high))
    return min(loss, -a * cfg.dual_clip) if (cfg.dual_clip is not None and a < 0) else loss


def token_mean_loop(batch, per_token, denominator_cells=None):
    """sum over valid tokens of per_token(i, t, a) / the number of tokens in the denominator."""
    valid = cells(batch)
    return sum(per_token(i, t, a) for i, t, a in valid) / len(
        denominator_cells if denominator_cells else valid)


def lp(batch, key, i, t):
    return batch[key][i, t].item()


# --------------------------------------------------------------------------------------------------
# Lp-Reg's min-p proxy
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("temperature,soft", [(1.0, False), (0.7, False), (1.3, True)])
def test_minp_proxy_matches_loop(temperature, soft):
    batch = make_batch(seed=1)
    proxy = baselines.minp_proxy_logprobs(
        batch["logits"], batch["tokens"], temperature=temperature, kappa=0.1, soft=soft,
        chunk_size=4)
    logits = batch["logits"].double()
    for i in range(6):
        for t in range(9):
            z = logits[i, t].tolist()
            p = torch.softmax(logits[i, t], -1).tolist()
            fill = min(z) if soft else -1e4
            filtered = [zi if pi >= 0.1 * max(p) else fill for zi, pi in zip(z, p)]
            log_norm = math.log(
                sum(math.exp(f / temperature - max(filtered) / temperature) for f in filtered))
            expected = (
                filtered[batch["tokens"][i, t]] / temperature
                - max(filtered) / temperature
                - log_norm)
            # filtered: ~ -1e4
            assert proxy[i, t].item() == pytest.approx(expected, rel=1e-6, abs=1e-4)


def test_minp_proxy_is_a_distribution_over_the_kept_set():
    logits = torch.randn(5, 30, generator=torch.Generator().manual_seed(2)) * 3
    every_token = torch.arange(30).expand(5, 30)
    proxy = baselines.minp_proxy_logprobs(
        logits[:, None, :].expand(5, 30, 30), every_token, kappa=0.05).exp()
    probs = torch.softmax(logits, -1)
    kept = probs >= 0.05 * probs.amax(-1, keepdim=True)
    torch.testing.assert_close(proxy.sum(-1), torch.ones(5), atol=1e-5, rtol=0)
    assert (proxy[~kept] < 1e-30).all()
    # inside the kept set the proxy is pi renormalised, so it amplifies every kept token by the same
    # factor
    renormalised = torch.where(kept, probs, 0) / (probs * kept).sum(-1, keepdim=True)
    torch.testing.assert_close(proxy, renormalised, atol=1e-6, rtol=1e-4)


# --------------------------------------------------------------------------------------------------
# STAPO
# --------------------------------------------------------------------------------------------------


def test_stapo_mask_and_loss_match_loop():
    batch = make_batch(seed=3)
    # loose, to select some
    cfg = config.LossConfig(stapo_prob_threshold=0.2, stapo_entropy_quantile=0.6)
    spurious, threshold = baselines.stapo_spurious_mask(
        batch["logprobs"], batch["entropy"], batch["advantages"], batch["mask"], 0.2, 0.6)
    expected_threshold = torch.quantile(batch["entropy"][batch["mask"]], 0.6).item()
    assert threshold.item() == pytest.approx(expected_threshold, rel=1e-6)
    expected = [
        (i, t)
        for i, t, a in cells(batch)
        if a > 0
        and math.exp(lp(batch, "logprobs", i, t)) < 0.2
        and batch["entropy"][i, t] < expected_threshold]
    assert sorted(map(tuple, spurious.nonzero().tolist())) == expected and expected
    # only positive-advantage tokens
    assert (batch["advantages"][:, None].expand(6, 9)[spurious] > 0).all()
    # the loss is the plain (GRPO) loss over the unmasked tokens, renormalised by their count
    loss, metrics = baselines.policy_loss("stapo", batch, cfg)
    kept = [(i, t, a) for i, t, a in cells(batch) if (i, t) not in expected]
    plain = sum(surrogate_loop(lp(batch, "logprobs", i, t), lp(batch, "old_logprobs", i, t), a, cfg)
                for i, t, a in kept) / len(kept)
    assert loss.item() == pytest.approx(plain, rel=1e-5)
    assert metrics["touched_frac"].item() == pytest.approx(len(expected) / len(cells(batch)))


# --------------------------------------------------------------------------------------------------
# Lp-Reg
# --------------------------------------------------------------------------------------------------


def test_lp_reg_selection_and_loss_match_loop():
    batch = make_batch(seed=4)
    cfg = config.LossConfig(lp_reg_neg_ratio=0.4, lp_reg_coef=0.7)
    selected = baselines.lp_reg_mask(
        batch["logprobs"], batch["proxy_logprobs"], batch["advantages"], batch["mask"], 0.4)
    negative = [(i, t) for i, t, a in cells(batch) if a < 0]
    k = max(1, int(0.4 * len(negative)))
    lowest = sorted(negative, key=lambda it: lp(batch, "logprobs", *it))[:k] if k > 1 else []
    expected = sorted(
        it for it in lowest if lp(batch, "logprobs", *it) < lp(batch, "proxy_logprobs", *it))
    assert sorted(map(tuple, selected.nonzero().tolist())) == expected and expected
    # invariants: A < 0 and pi < pi_proxy on every selected token
    assert (batch["advantages"][:, None].expand(6, 9)[selected] < 0).all()
    assert (batch["logprobs"][selected] < batch["proxy_logprobs"][selected]).all()

    def per_token(i, t, a):
        logp, old = lp(batch, "logprobs", i, t), lp(batch, "old_logprobs", i, t)
        if (i, t) not in expected:
            return surrogate_loop(logp, old, a, cfg)
        delta = lp(batch, "proxy_logprobs", i, t) - logp
        # k3 capped at 10
        return -a * math.exp(logp - old) + 0.7 * min(10.0, math.exp(delta) - delta - 1)

    loss, _ = baselines.policy_loss("lp_reg", batch, cfg)
    assert loss.item() == pytest.approx(token_mean_loop(batch, per_token), rel=1e-5)


def test_lp_reg_regulariser_pushes_low_probabilities_up():
    batch = make_batch(seed=5)
    with_reg = config.LossConfig(lp_reg_neg_ratio=0.4, lp_reg_coef=1.0)
    without = dataclasses.replace(with_reg, lp_reg_coef=0.0)
    selection, _ = baselines.token_selection("lp_reg", batch, with_reg)
    (grad_with,) = torch.autograd.grad(
        baselines.policy_loss("lp_reg", batch, with_reg, selection)[0], batch["logprobs"])
    (grad_without,) = torch.autograd.grad(
        baselines.policy_loss("lp_reg", batch, without, selection)[0], batch["logprobs"])
    regulariser_grad = grad_with - grad_without  # d(beta k3)/d log pi / N
    selected = selection["regularized"]
    assert selected.any()
    # gradient descent raises log pi towards the proxy
    assert (regulariser_grad[selected] < 0).all()
    assert (regulariser_grad[~selected] == 0).all()


def test_lp_reg_k3_is_capped_at_ten():
    # Far below the proxy (pi_proxy / pi > 13.6) the reference's k3 is clamped at 10: flat, with
    # zero gradient.
    probs = torch.tensor([[0.001, 0.002, 0.5, 0.6]])
    logprobs = probs.log().requires_grad_(True)
    batch = {
        "logprobs": logprobs,
        "old_logprobs": probs.log(),
        "advantages": torch.tensor([-1.0]),
        "mask": torch.ones(1, 4, dtype=torch.bool),
        "proxy_logprobs": torch.full((1, 4), math.log(0.5)),
    }
    cfg = config.LossConfig(lp_reg_neg_ratio=0.5, lp_reg_coef=1.0)
    loss, metrics = baselines.policy_loss("lp_reg", batch, cfg)
    # the two lowest-probability tokens are regularised: 1 (= -A r) + 10 (capped k3) each; the
    # others 1 each
    assert loss.item() == pytest.approx((11 + 11 + 1 + 1) / 4)
    (grad,) = torch.autograd.grad(loss, logprobs)
    torch.testing.assert_close(grad, torch.full((1, 4), 0.25))  # only -A r's gradient is left
    assert metrics["touched_frac"] == 0.5


def test_lp_reg_needs_more_than_one_token():
    # the reference applies the rule only if k = max(1, int(rho n)) > 1
    batch = make_batch(seed=6)
    num_negative = sum(a < 0 for _, _, a in cells(batch))
    rho = 1.5 / num_negative  # int(rho n) = 1
    assert not baselines.lp_reg_mask(
        batch["logprobs"], batch["proxy_logprobs"], batch["advantages"], batch["mask"], rho).any()


# --------------------------------------------------------------------------------------------------
# Clip-Cov and KL-Cov
# --------------------------------------------------------------------------------------------------


def covariance_loop(batch):
    valid = cells(batch)
    mean_a = sum(a for _, _, a in valid) / len(valid)
    mean_lp = sum(lp(batch, "logprobs", i, t) for i, t, _ in valid) / len(valid)
    return {(i, t): (a - mean_a) * (lp(batch, "logprobs", i, t) - mean_lp) for i, t, a in valid}


def test_covariance_matches_loop():
    batch = make_batch(seed=7)
    covariance = baselines.advantage_logprob_covariance(
        batch["logprobs"], batch["advantages"], batch["mask"])
    for (i, t), value in covariance_loop(batch).items():
        assert covariance[i, t].item() == pytest.approx(value, abs=1e-6)
    assert (covariance[~batch["mask"]] == 0).all()


def test_clip_cov_detaches_the_documented_count_reproducibly():
    batch = make_batch(seed=8, batch_size=12, width=20)
    cfg = config.LossConfig(clip_cov_ratio=0.05, clip_cov_lb=0.0, clip_cov_ub=5.0)
    covariance = covariance_loop(batch)

    def candidate(i, t, a):
        logp, old = lp(batch, "logprobs", i, t), lp(batch, "old_logprobs", i, t)
        r = math.exp(logp - old)
        clipped = -a * min(max(r, 1 - cfg.clip_low), 1 + cfg.clip_high) > -a * r
        return not clipped and 0.0 < covariance[(i, t)] < 5.0

    candidates = {(i, t) for i, t, a in cells(batch) if candidate(i, t, a)}
    k = max(1, int(0.05 * len(cells(batch))))
    first, _ = baselines.token_selection(
        "clip_cov", batch, cfg, generator=torch.Generator().manual_seed(0))
    again, _ = baselines.token_selection(
        "clip_cov", batch, cfg, generator=torch.Generator().manual_seed(0))
    other, _ = baselines.token_selection(
        "clip_cov", batch, cfg, generator=torch.Generator().manual_seed(1))
    detached = set(map(tuple, first["detached"].nonzero().tolist()))
    assert torch.equal(first["detached"], again["detached"])  # same generator state, same tokens
    assert not torch.equal(first["detached"], other["detached"])  # it is random
    assert len(detached) == min(k, len(candidates)) and detached <= candidates
    # detached tokens contribute 0 and stay in the denominator
    loss, metrics = baselines.policy_loss("clip_cov", batch, cfg, selection=first)

    def per_token(i, t, a):
        return (
            0.0
            if (i, t) in detached
            else surrogate_loop(
                lp(batch, "logprobs", i, t), lp(batch, "old_logprobs", i, t), a, cfg))

    assert loss.item() == pytest.approx(token_mean_loop(batch, per_token), rel=1e-5)
    (grad,) = torch.autograd.grad(loss, batch["logprobs"])
    assert all(grad[i, t] == 0 for i, t in detached)


def test_kl_cov_penalises_only_the_top_covariance_tokens():
    batch = make_batch(seed=9, batch_size=12, width=20)
    cfg = config.LossConfig(kl_cov_ratio=0.03, kl_cov_coef=0.5)
    covariance = covariance_loop(batch)
    k = max(1, int(0.03 * len(covariance)))
    top = set(sorted(covariance, key=lambda it: -covariance[it])[:k])
    selection, _ = baselines.token_selection("kl_cov", batch, cfg)
    assert set(map(tuple, selection["penalized"].nonzero().tolist())) == top

    def per_token(i, t, a):  # KL-Cov's base loss is the unclipped -A r
        logp, old = lp(batch, "logprobs", i, t), lp(batch, "old_logprobs", i, t)
        return -a * math.exp(logp - old) + (0.5 * abs(logp - old) if (i, t) in top else 0.0)

    loss, metrics = baselines.policy_loss("kl_cov", batch, cfg, selection=selection)
    assert loss.item() == pytest.approx(token_mean_loop(batch, per_token), rel=1e-5)
    assert metrics["touched_frac"].item() == pytest.approx(k / len(covariance))


def test_kl_cov_ranks_near_tied_covariances_exactly(monkeypatch):
    # a very negative covariance beside two positive ones 4e-6 apart: shifted by the minimum in
    # float32 they merge into a tie that position breaks; ranked as they are, the larger (later) one
    # is penalised, as topk does
    covariance = torch.tensor([[-1000.0, 1e-3, 1e-3 + 4e-6, -5.0, 0.0, -1e-3]])
    # the shift merges them
    assert covariance[0, 1] - covariance[0, 0] == covariance[0, 2] - covariance[0, 0]
    monkeypatch.setattr(
        baselines, "advantage_logprob_covariance", lambda logprobs, advantages, mask: covariance)
    mask = torch.ones_like(covariance, dtype=torch.bool)
    # k = 1
    chosen = baselines.kl_cov_mask(torch.zeros_like(covariance), torch.zeros(1), mask, ratio=0.2)
    assert (
        chosen.nonzero().tolist()
        == [[0, int(torch.topk(covariance.flatten(), 1).indices)]]
        == [[0, 2]])
    # k = 3
    chosen = baselines.kl_cov_mask(torch.zeros_like(covariance), torch.zeros(1), mask, ratio=0.5)
    assert chosen.nonzero().tolist() == [[0, 1], [0, 2], [0, 4]]


# --------------------------------------------------------------------------------------------------
# 80/20 high-entropy tokens and the entropy bonus
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("convention", ["paper", "lp_reg_dev"])
def test_high_entropy_mask_and_denominators(convention):
    batch = make_batch(seed=10, batch_size=8, width=11)
    cfg = config.LossConfig(high_entropy_ratio=0.2, high_entropy_convention=convention)
    valid = cells(batch)
    n = len(valid)
    k = math.ceil(0.2 * n) if convention == "paper" else max(1, int(0.2 * n))
    top = sorted((it[:2] for it in valid), key=lambda it: -batch["entropy"][it].item())[:k]
    selection, _ = baselines.token_selection("high_entropy", batch, cfg)
    assert sorted(map(tuple, selection["kept"].nonzero().tolist())) == sorted(top)

    def per_token(i, t, a):
        if (i, t) not in top:
            return 0.0
        return surrogate_loop(lp(batch, "logprobs", i, t), lp(batch, "old_logprobs", i, t), a, cfg)

    # paper: all valid tokens; lp_reg_dev: kept only
    denominator = valid if convention == "paper" else top
    loss, _ = baselines.policy_loss("high_entropy", batch, cfg, selection=selection)
    assert loss.item() == pytest.approx(token_mean_loop(batch, per_token, denominator), rel=1e-5)


def test_entropy_bonus_value_and_gradient():
    batch = make_batch(seed=11)
    batch["entropy"] = batch["entropy"].clone().requires_grad_(True)
    cfg = config.LossConfig(entropy_coef=0.05)
    loss, metrics = baselines.policy_loss("entropy_bonus", batch, cfg)
    grpo, _ = baselines.policy_loss("grpo", batch, cfg)
    mean_entropy = batch["entropy"][batch["mask"]].mean()
    assert loss.item() == pytest.approx((grpo - 0.05 * mean_entropy).item(), rel=1e-6)
    (entropy_grad,) = torch.autograd.grad(loss, batch["entropy"])
    expected = torch.where(batch["mask"], -0.05 / batch["mask"].sum(), 0.0)
    torch.testing.assert_close(entropy_grad, expected)
    assert metrics["touched_frac"] == 1


# --------------------------------------------------------------------------------------------------
# STEER, against a re-statement of its reference (zz-haooo/STEER @b31df71,
# verl/trainer/ppo/core_algos.py: compute_token_weights, compute_policy_loss_with_entropy)
# --------------------------------------------------------------------------------------------------


def steer_reference_loss(log_prob, old_log_prob, advantages, mask, entropys, w_min, w_max, linear,
                         clip_low=0.2, clip_high=0.28, clip_ratio_c=10.0):
    """The reference's STEER loss on one micro-batch, re-stated step by step: [B, T] advantages,
    weights from the current log-probs under no_grad, verl's dual-clip losses, a token-mean."""
    with torch.no_grad():
        p = log_prob.detach().exp().clamp(1e-8, 1 - 1e-8)
        f = p * (1 - p) * (p.log() + entropys)
        metric = advantages / old_log_prob.exp().clamp(1e-8, 1.0) * f
        metric = torch.where(torch.isfinite(metric), metric, torch.zeros_like(metric)).abs()
        valid_metric = metric[mask]
        lo, hi = valid_metric.min(), valid_metric.max()
        weights = torch.zeros_like(metric)
        if linear:
            if hi > lo:
                w = w_max - (valid_metric - lo) * (w_max - w_min) / (hi - lo)
            else:
                w = torch.full_like(valid_metric, (w_min + w_max) / 2)
            w = w.clamp(w_min, w_max)
        else:
            k = -math.log(w_min) / max(hi.item(), 0.02)
            w = torch.exp(-k * valid_metric).clamp(w_min, 1.0)
        weights[mask] = w
    ratio = torch.exp(torch.clamp(log_prob - old_log_prob, -20.0, 20.0))
    losses1 = -advantages * ratio
    losses2 = -advantages * torch.clamp(ratio, 1 - clip_low, 1 + clip_high)
    clipped = torch.maximum(losses1, losses2)
    dual = torch.min(-advantages * clip_ratio_c, clipped)
    losses = torch.where(advantages < 0, dual, clipped) * weights
    return (losses * mask).sum() / mask.sum()


@pytest.mark.parametrize("linear,w_min,w_max", [(False, 0.8, 1.0), (True, 0.8, 1.2)])  # exp, linear
def test_steer_matches_the_reference_loss_and_gradient(linear, w_min, w_max):
    batch = make_batch(seed=30, batch_size=8, width=10)  # off-policy: the ratio enters the estimate
    batch["entropy"][1, 2] = float("nan")  # the reference zeroes a non-finite estimate
    batch["mask"][1, 2] = True
    cfg = config.LossConfig(steer_linear=linear, steer_weight_min=w_min, steer_weight_max=w_max)
    loss, metrics = baselines.policy_loss("steer", batch, cfg)  # micro scope, as the reference
    (grad,) = torch.autograd.grad(loss, batch["logprobs"])
    token_adv = batch["advantages"][:, None].expand(8, 10) * batch["mask"]  # verl's [B, T]
    expected = steer_reference_loss(batch["logprobs"], batch["old_logprobs"], token_adv,
                                    batch["mask"], batch["entropy"], w_min, w_max, linear)
    (expected_grad,) = torch.autograd.grad(expected, batch["logprobs"])
    torch.testing.assert_close(loss, expected, atol=1e-7, rtol=1e-5)
    torch.testing.assert_close(grad, expected_grad, atol=1e-8, rtol=1e-5)
    assert 0 < metrics["touched_frac"] <= 1


def test_steer_weights_read_the_old_entropy_in_micro_scope():
    # the trainer's micro-batches carry pi_theta's entropy in "entropy" and pi_old's in
    # "old_entropy": the weights use pi_old's, as the reference does (its old-log-prob pass)
    batch = make_batch(seed=34, batch_size=8, width=10)
    theta_entropy = batch["entropy"] * 1.7 + 0.1
    micro = {**batch, "entropy": theta_entropy, "old_entropy": batch["entropy"]}
    cfg = config.LossConfig()
    loss, _ = baselines.policy_loss("steer", micro, cfg)
    token_adv = batch["advantages"][:, None].expand(8, 10) * batch["mask"]
    expected = steer_reference_loss(batch["logprobs"], batch["old_logprobs"], token_adv,
                                    batch["mask"], batch["entropy"], 0.8, 1.2, False)
    torch.testing.assert_close(loss, expected, atol=1e-7, rtol=1e-5)
    on_theta = steer_reference_loss(batch["logprobs"], batch["old_logprobs"], token_adv,
                                    batch["mask"], theta_entropy, 0.8, 1.2, False)
    assert abs(loss.item() - on_theta.item()) > 1e-4


def test_steer_estimate_is_the_sampled_logit_term_of_eq5():
    # Eq. 22, on-policy: |Omega| pi_k = |dH| / eta when a step moves only the sampled token's own
    # logit, by its share eta A (1 - pi_k) of the policy-gradient step eta A (e_k - pi); and the
    # sensitivity estimate |A S| = |dH| / eta of the whole step (Eq. 5). Finite differences.
    generator = torch.Generator().manual_seed(31)
    logits = torch.randn(40, 7, generator=generator, dtype=torch.float64) * 2
    tokens = torch.randint(0, 7, (40,), generator=generator)
    advantages = torch.randn(40, generator=generator, dtype=torch.float64)

    def entropy(z):
        return -(torch.softmax(z, -1) * torch.log_softmax(z, -1)).sum(-1)

    def entropy_change(direction, eta=1e-6):  # dH / eta along a logit step, central difference
        return (entropy(logits + eta * direction) - entropy(logits - eta * direction)) / (2 * eta)

    pi = torch.softmax(logits, -1)
    one_hot = torch.nn.functional.one_hot(tokens, 7).double()
    step = advantages[:, None] * (one_hot - pi)  # [40, 7] per unit eta
    logprobs = torch.log_softmax(logits, -1).gather(-1, tokens[:, None])  # [40, 1]: one-token rows
    h, mask = entropy(logits)[:, None], torch.ones(40, 1, dtype=torch.bool)
    omega = baselines.steer_entropy_change(logprobs, logprobs, advantages, h, mask)[:, 0].double()
    pi_k = logprobs[:, 0].exp()
    own_logit_change = entropy_change(step * one_hot).abs()
    torch.testing.assert_close(omega * pi_k, own_logit_change, atol=1e-6, rtol=1e-4)
    sensitivity = stare.entropy_sensitivity(logits.float(), tokens)[:, None]
    omega_s = baselines.steer_entropy_change(logprobs, logprobs, advantages, h, mask, sensitivity)
    whole_step_change = entropy_change(step).abs()
    torch.testing.assert_close(omega_s[:, 0].double(), whole_step_change, atol=1e-6, rtol=1e-4)


def test_steer_weights_span_their_range():
    omega = torch.tensor([[0.0, 0.5, 2.0, 9.0], [1.0, 4.0, 0.0, 0.0]])
    mask = torch.tensor([[True, True, True, False], [True, True, False, False]])  # 9.0: padding
    weights, omega_max = baselines.steer_weights(omega, mask, 0.8, 1.2, linear=False)
    assert omega_max == 4.0 and weights[1, 1].item() == pytest.approx(0.8) and weights[0, 0] == 1
    assert weights[0, 2].item() == pytest.approx(0.8 ** (2.0 / 4.0)) and (weights[~mask] == 1).all()
    weights, _ = baselines.steer_weights(omega, mask, 0.8, 1.2, linear=True)
    assert weights[0, 0].item() == pytest.approx(1.2) and weights[1, 1].item() == pytest.approx(0.8)
    assert weights[0, 1].item() == pytest.approx(1.2 - 0.5 * 0.4 / 4.0)
    # tiny changes everywhere: the 0.02 floor on the scale keeps the weights near 1
    weights, _ = baselines.steer_weights(omega * 1e-3, mask, 0.8, 1.2, linear=False)
    assert weights[1, 1].item() == pytest.approx(0.8 ** (4e-3 / 0.02))


# --------------------------------------------------------------------------------------------------
# W-REINFORCE, against a re-statement of its reference (TianHongZXY/RLVR-Decomposed @a5d4e7c,
# verl/trainer/ppo/core_algos.py: compute_psr_nsr_outcome_advantage, compute_policy_loss)
# --------------------------------------------------------------------------------------------------


def w_reinforce_batch(seed):
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(8, 12, 10, generator=generator) * 2
    tokens = torch.randint(0, 10, (8, 12), generator=generator)
    old_logprobs, entropy = stare.token_logprobs_and_entropy(logits, tokens)
    drift = 0.3 * torch.randn(8, 12, generator=generator)
    logprobs = (old_logprobs + drift).clamp(max=0).requires_grad_(True)
    lengths = torch.randint(3, 13, (8,), generator=generator)
    mask = torch.arange(12)[None, :] < lengths[:, None]  # verl's contiguous response mask
    rewards = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0, 0.0, 1.0, 0.0])  # the reference's 0/1 accuracy
    batch = {"logprobs": logprobs, "old_logprobs": old_logprobs, "mask": mask, "entropy": entropy}
    return batch, rewards, lengths


def reference_weighted_advantages(rewards, lengths, mask, positive_weight, gamma=1.0):
    """compute_psr_nsr_outcome_advantage(advantage="weighted"), re-stated: the reward at the last
    response token, returns summed backwards (reset where the mask is 0), correct x lambda,
    incorrect - 1, times the mask."""
    token_rewards = torch.zeros(mask.shape)
    token_rewards[torch.arange(len(rewards)), lengths - 1] = rewards
    returns = torch.zeros(mask.shape)
    running = torch.zeros(len(rewards))
    for t in reversed(range(mask.shape[1])):
        running = token_rewards[:, t] + gamma * running
        returns[:, t] = running
        running = running * mask[:, t]
    advantages = returns.clone()
    advantages[rewards == 1] *= positive_weight
    advantages[rewards == 0] -= 1
    return advantages * mask


def reference_ppo_loss(log_prob, old_log_prob, advantages, mask, cliprange=0.2):
    """compute_policy_loss without positive_learning_weight, re-stated: no log-ratio clamp, no dual
    clip, one symmetric clip range, a token-mean over the micro-batch."""
    ratio = torch.exp(log_prob - old_log_prob)
    clipped_ratio = torch.clamp(ratio, 1 - cliprange, 1 + cliprange)
    losses = torch.max(-advantages * ratio, -advantages * clipped_ratio)
    return (losses * mask).sum() / mask.sum()


@pytest.mark.parametrize("lam", [0.1, 0.5, 1.0])
def test_w_reinforce_matches_the_reference_with_its_advantages(lam):
    # the reference's W-REINFORCE = this loss on the +-1 advantages 2r - 1 (no group baseline)
    batch, rewards, lengths = w_reinforce_batch(seed=32)
    cfg = config.LossConfig(w_reinforce_lambda=lam, clip_low=0.2, clip_high=0.2, dual_clip=None)
    plus_minus_one = {**batch, "advantages": 2 * rewards - 1}
    loss, metrics = baselines.policy_loss("w_reinforce", plus_minus_one, cfg)
    (grad,) = torch.autograd.grad(loss, batch["logprobs"])
    advantages = reference_weighted_advantages(rewards, lengths, batch["mask"], lam)
    expected = reference_ppo_loss(batch["logprobs"], batch["old_logprobs"], advantages,
                                  batch["mask"])
    (expected_grad,) = torch.autograd.grad(expected, batch["logprobs"])
    torch.testing.assert_close(loss, expected, atol=1e-7, rtol=1e-5)
    torch.testing.assert_close(grad, expected_grad, atol=1e-8, rtol=1e-5)
    positive_share = (batch["mask"][rewards == 1].sum() / batch["mask"].sum()).item()
    assert metrics["touched_frac"].item() == pytest.approx(positive_share if lam != 1 else 0.0)


def test_w_reinforce_matches_the_reference_loss_weight_on_group_advantages():
    # The reference's other route, the actor's positive_learning_weight: lambda x the correct
    # responses' token-mean x their token share, plus the incorrect ones'. On GRPO advantages it is
    # this loss too: a correct response has A > 0 unless its whole group is correct (A = 0).
    batch, rewards, lengths = w_reinforce_batch(seed=33)
    advantages = stare.group_advantages(rewards, group_size=4)
    cfg = config.LossConfig(w_reinforce_lambda=0.3, clip_low=0.2, clip_high=0.2, dual_clip=None)
    loss, _ = baselines.policy_loss("w_reinforce", {**batch, "advantages": advantages}, cfg)
    (grad,) = torch.autograd.grad(loss, batch["logprobs"])
    token_adv = advantages[:, None] * batch["mask"]
    ratio = torch.exp(batch["logprobs"] - batch["old_logprobs"])
    losses = torch.max(-token_adv * ratio, -token_adv * torch.clamp(ratio, 0.8, 1.2))
    mask = batch["mask"].float()

    def part(rows):  # eos_mask[rows].sum() / eos_mask.sum() * masked_mean over those rows
        return mask[rows].sum() / mask.sum() * (losses[rows] * mask[rows]).sum() / mask[rows].sum()

    expected = 0.3 * part(rewards == 1) + part(rewards == 0)
    (expected_grad,) = torch.autograd.grad(expected, batch["logprobs"])
    torch.testing.assert_close(loss, expected, atol=1e-7, rtol=1e-5)
    torch.testing.assert_close(grad, expected_grad, atol=1e-8, rtol=1e-5)


# --------------------------------------------------------------------------------------------------
# All methods: neutral knobs reproduce GRPO, step-scope selection is micro-batch invariant, one
# switch
# --------------------------------------------------------------------------------------------------

NEUTRAL = {
    "stare": {"stare_top_ratio": 0.0},
    "steer": {"steer_weight_min": 1.0, "steer_weight_max": 1.0},
    "w_reinforce": {"w_reinforce_lambda": 1.0},
    "stapo": {"stapo_prob_threshold": 0.0},
    "lp_reg": {"lp_reg_neg_ratio": 0.0},
    "clip_cov": {"clip_cov_ratio": 0.0},
    "kl_cov": {"kl_cov_ratio": 0.0},
    "high_entropy": {"high_entropy_ratio": 1.0},
    "entropy_bonus": {"entropy_coef": 0.0},
    "entropic": {"entropic_prob_threshold": 1.0},
}
# EntroPIC's coefficient alpha, for the tests that run every method (the others ignore it)
CONTROLLER = baselines.EntropyPIController()
CONTROLLER.coef = 0.5
ADAPTIVE = baselines.AdaptiveEntropyCoefficient()
ADAPTIVE.applied = 0.02
STATES = {"entropic": CONTROLLER, "adaptive_entropy": ADAPTIVE}


@pytest.mark.parametrize("method", sorted(NEUTRAL))
def test_neutral_setting_reproduces_grpo_exactly(method):
    # KL-Cov's base loss is unclipped, so it equals GRPO's only on-policy (r = 1), where no clip is
    # active.
    batch = make_batch(seed=12, on_policy=(method == "kl_cov"))
    cfg = config.LossConfig(**NEUTRAL[method])
    grpo_loss, _ = baselines.policy_loss("grpo", batch, cfg)
    (grpo_grad,) = torch.autograd.grad(grpo_loss, batch["logprobs"])
    loss, metrics = baselines.policy_loss(
        method, batch, cfg, generator=torch.Generator().manual_seed(0), states=STATES)
    (grad,) = torch.autograd.grad(loss, batch["logprobs"])
    assert torch.equal(loss, grpo_loss) and torch.equal(grad, grpo_grad)
    assert metrics["touched_frac"] == 0
    # and with STARE's weights at 1 (not just P = 0)
    if method == "stare":
        ones = dataclasses.replace(cfg, stare_top_ratio=0.3, stare_variant="C2")
        gate = stare.EntropyGate(w=1.0, m=1.0)
        assert torch.equal(baselines.policy_loss("stare", batch, ones, states={"gate": gate})[0], grpo_loss)
    if method == "steer":  # weights 1 are neutral for the linear map and the sensitivity too
        for linear, estimate in ((True, "steer"), (False, "sensitivity"), (True, "sensitivity")):
            other = dataclasses.replace(cfg, steer_linear=linear, steer_estimate=estimate)
            loss, _ = baselines.policy_loss("steer", batch, other)
            (grad,) = torch.autograd.grad(loss, batch["logprobs"])
            assert torch.equal(loss, grpo_loss) and torch.equal(grad, grpo_grad)


ACTIVE = {
    "grpo": {},
    "stare": {"stare_top_ratio": 0.3, "stare_variant": "C2"},
    "stapo": {"stapo_prob_threshold": 0.2, "stapo_entropy_quantile": 0.6},
    "lp_reg": {"lp_reg_neg_ratio": 0.4},
    "clip_cov": {"clip_cov_ratio": 0.05, "clip_cov_lb": 0.0},
    "kl_cov": {"kl_cov_ratio": 0.05},
    "high_entropy": {"high_entropy_ratio": 0.3, "high_entropy_convention": "lp_reg_dev"},
    "entropy_bonus": {"entropy_coef": 0.01},
    "steer": {},
    "w_reinforce": {},
    "entropic": {"entropic_prob_threshold": 0.3},
    "adaptive_entropy": {},  # its coefficient: STATES'
    "grpo_dropout": {},
}


@pytest.mark.parametrize("method", baselines.METHODS)
@pytest.mark.parametrize("agg_mode", ["token-mean", "seq-mean-token-mean"])
@pytest.mark.parametrize("policy_loss", baselines.POLICY_LOSSES)
def test_step_selection_makes_micro_batches_add_up(method, agg_mode, policy_loss):
    # Select once on the whole step, then run the loss per micro-batch with the step's counts: the
    # sum of the micro-batch losses and gradients equals the full-batch loss and gradient, under
    # every policy loss the method composes with.
    if baselines.refused_combination(method, policy_loss):
        pytest.skip(f"{method} composes with ppo_clip only")
    batch = make_batch(seed=13, batch_size=8, width=10)
    cfg = config.LossConfig(agg_mode=agg_mode, policy_loss=policy_loss, **ACTIVE[method])
    selection, _ = baselines.token_selection(
        method, batch, cfg, generator=torch.Generator().manual_seed(0))
    # the selection is not trivial (not constant over the batch), so the test can tell the scopes
    # apart
    assert method not in baselines.SELECTING or any(
        (m != m.flatten()[0]).any() for m in selection.values())
    denominator = baselines.loss_mask(method, batch["mask"], selection, cfg)
    num_tokens, num_sequences = denominator.sum(), (denominator.sum(-1) > 0).sum()
    control = baselines.control_mask(method, batch["mask"], selection)  # EntroPIC's own counts
    counts = {} if control is None else {"num_control_tokens": control.sum(),
                                         "num_control_sequences": (control.sum(-1) > 0).sum()}
    full, _ = baselines.policy_loss(method, batch, cfg, selection=selection, states=STATES)
    (full_grad,) = torch.autograd.grad(full, batch["logprobs"])

    accumulated = 0.0
    for rows in (slice(0, 3), slice(3, 4), slice(4, 8)):
        micro = {key: value[rows] for key, value in batch.items()}
        micro_selection = {key: value[rows] for key, value in selection.items()}
        loss, _ = baselines.policy_loss(
            method, micro, cfg, selection=micro_selection, states=STATES,
            counts={"num_tokens": num_tokens, "num_sequences": num_sequences, **counts})
        accumulated = accumulated + loss
    (accumulated_grad,) = torch.autograd.grad(accumulated, batch["logprobs"])
    torch.testing.assert_close(accumulated, full, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(accumulated_grad, full_grad, atol=1e-7, rtol=1e-5)


def test_every_method_reports_the_same_touched_key_and_one_switch_selects_it():
    batch = make_batch(seed=14)
    keys = None
    for method in baselines.METHODS:
        cfg = config.LossConfig(**ACTIVE[method])
        selection, _ = baselines.token_selection(
            method, batch, cfg, generator=torch.Generator().manual_seed(0))
        loss, metrics = baselines.policy_loss(method, batch, cfg, selection=selection,
                                              states=STATES)
        assert torch.isfinite(loss) and loss.dim() == 0
        keys = keys or set(metrics)
        assert set(metrics) == keys and "touched_frac" in keys
        assert (metrics["touched_frac"] > 0) == (method != "grpo"), method
    with pytest.raises(ValueError, match="did you mean 'stapo'"):
        baselines.policy_loss("stappo", batch, config.LossConfig())


@pytest.mark.parametrize("method", baselines.METHODS)
def test_token_advantages_bf16_and_empty_batches(method):
    batch = make_batch(seed=15)
    cfg = config.LossConfig(**ACTIVE[method])
    generator = torch.Generator().manual_seed(0)
    selection, _ = baselines.token_selection(method, batch, cfg, generator=generator)
    # [B, T] advantages (the broadcast of [B]) give the same loss
    loss, _ = baselines.policy_loss(method, batch, cfg, selection=selection, states=STATES)
    token_batch = dict(batch, advantages=batch["advantages"][:, None].expand(6, 9))
    assert torch.equal(baselines.policy_loss(method, token_batch, cfg, selection=selection,
                                             states=STATES)[0], loss)
    # bf16 log-probs run and stay close to float32
    bf16_batch = {k: (v.detach().bfloat16() if v.is_floating_point() and k != "advantages" else v)
                  for k, v in batch.items()}
    bf16_loss, _ = baselines.policy_loss(method, bf16_batch, cfg, selection=selection,
                                         states=STATES)
    assert bf16_loss.dtype == torch.float32 and bf16_loss.item() == pytest.approx(
        loss.item(), abs=0.05)
    # a batch with no rows gives 0, not an error
    empty = {k: v[:0] for k, v in batch.items()}
    assert baselines.policy_loss(method, empty, cfg, generator=generator,
                                 states=STATES)[0].item() == 0.0


def test_selections_make_no_host_sync():
    # meta tensors raise on .item() or any data-dependent Python branch (see test_stare.py)
    batch = {
        "logprobs": torch.empty(4, 8, device="meta"),
        "old_logprobs": torch.empty(4, 8, device="meta"),
        "advantages": torch.empty(4, device="meta"),
        "mask": torch.empty(4, 8, dtype=torch.bool, device="meta"),
        "entropy": torch.empty(4, 8, device="meta"),
        "proxy_logprobs": torch.empty(4, 8, device="meta"),
        "sensitivity": torch.empty(4, 8, device="meta"),
    }
    for method in baselines.METHODS:
        # torch.rand has no meta generator; its selection is select_top_k, checked here.
        # GRPODropout decides per group on the host, once a step (step scope only, CPU tensors)
        if method in ("clip_cov", "grpo_dropout"):
            continue
        loss, metrics = baselines.policy_loss(method, batch, config.LossConfig(**ACTIVE[method]),
                                              states=STATES)
        assert loss.device.type == "meta"


def test_clip_cov_requires_a_generator():
    with pytest.raises(ValueError, match="Generator"):
        baselines.policy_loss("clip_cov", make_batch(seed=16), config.LossConfig())


def test_loss_config_rejects_bad_values_by_name():
    with pytest.raises(ValueError, match="high_entropy_convention"):
        config.LossConfig(high_entropy_convention="trl")
    with pytest.raises(ValueError, match="dual_clip=1.0"):
        config.LossConfig(dual_clip=1.0)
    with pytest.raises(ValueError, match="stare_top_ratio"):
        config.LossConfig(stare_top_ratio=1.5)
    with pytest.raises(ValueError, match="steer_weight_min"):  # > 1: exp(-k |Omega|) would grow
        config.LossConfig(steer_weight_min=1.1, steer_weight_max=1.2)
    with pytest.raises(ValueError, match="w_reinforce_lambda"):
        config.LossConfig(w_reinforce_lambda=-0.1)


def test_token_weights_multiply_each_token_loss():
    # e.g. truncated importance weights: the loss becomes the weighted sum over the same denominator
    batch = make_batch(seed=17)
    cfg = config.LossConfig()
    weights = torch.rand(6, 9, generator=torch.Generator().manual_seed(1)) * 2
    weighted, _ = baselines.policy_loss("grpo", batch, cfg, token_weights=weights)

    def per_token(i, t, a):
        return weights[i, t].item() * surrogate_loop(
            lp(batch, "logprobs", i, t), lp(batch, "old_logprobs", i, t), a, cfg)

    assert weighted.item() == pytest.approx(token_mean_loop(batch, per_token), rel=1e-5)
    assert torch.equal(baselines.policy_loss("grpo", batch, cfg, token_weights=torch.ones(6, 9))[0],
                       baselines.policy_loss("grpo", batch, cfg)[0])


def test_selection_metrics_say_why_a_method_touched_nothing():
    # Lp-Reg regularises among the negative-advantage tokens only when k = int(rho n) > 1: with
    # every reward equal there is no candidate, and with few negative tokens k is 0; the counts show
    # both
    generator = torch.Generator().manual_seed(0)
    logprobs = -torch.rand(4, 50, generator=generator) * 5  # [B, T]
    mask = torch.ones(4, 50, dtype=torch.bool)
    cfg = config.LossConfig()
    batch = {
        "logprobs": logprobs,
        "old_logprobs": logprobs,
        "entropy": torch.rand(4, 50, generator=generator),
        "mask": mask,
        "proxy_logprobs": logprobs + 1.0,
    }
    _, flat = baselines.token_selection("lp_reg", {**batch, "advantages": torch.zeros(4)}, cfg)
    assert (
        int(flat["lp_reg/candidates"]),
        int(flat["lp_reg/k"]),
        int(flat["lp_reg/selected"]),
    ) == (0, 0, 0)
    # 100 negative tokens: int(0.01 * 100) = 1, not > 1
    advantages = torch.tensor([1.0, -1.0, 1.0, -1.0])
    _, few = baselines.token_selection("lp_reg", {**batch, "advantages": advantages}, cfg)
    assert (int(few["lp_reg/candidates"]), int(few["lp_reg/k"]), int(few["lp_reg/selected"])) == (
        100, 0, 0)
    wide = config.LossConfig(lp_reg_neg_ratio=0.05)  # k = 5: the 5 least likely negative tokens
    _, some = baselines.token_selection("lp_reg", {**batch, "advantages": advantages}, wide)
    assert (int(some["lp_reg/k"]), int(some["lp_reg/selected"])) == (5, 5)
    _, stare_metrics = baselines.token_selection("stare", {**batch, "advantages": advantages}, cfg)
    assert (
        int(stare_metrics["stare/positive_tokens"])
        == int(stare_metrics["stare/negative_tokens"])
        == 100)
