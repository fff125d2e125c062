"""EntroPIC (Eqs. 25, 26): the loss against a re-statement of its reference (yk7333/EntroPIC
@2470730, core_algos.py: compute_policy_loss_entropic; dp_actor.py:
EntroPICDataParallelPPOActor.update_policy), the PI controller against a hand computation, its
wiring beside STARE's gate (its state across a resume: tests/test_train.py)."""

import math

import pytest
import torch

import baselines
import config
import grpo
import stare


def peaked_batch(seed, batch_size=8, width=12, vocab=10):
    """Peaked logits and tokens sampled from them, so that many sampled tokens have pi > 0.95; the
    current log-probs drift off-policy, so the ratio and the clips matter."""
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(batch_size, width, vocab, generator=generator) * 4
    probs = torch.softmax(logits, -1).view(-1, vocab)
    tokens = torch.multinomial(probs, 1, generator=generator).view(batch_size, width)
    old_logprobs, entropy = stare.token_logprobs_and_entropy(logits, tokens)
    drift = 0.2 * torch.randn(batch_size, width, generator=generator)
    logprobs = (old_logprobs + drift).clamp(max=0.0).requires_grad_(True)
    mask = torch.rand(batch_size, width, generator=generator) < 0.85
    mask[3, 6:] = False
    rewards = (torch.rand(batch_size, generator=generator) < 0.5).float()
    advantages = stare.group_advantages(rewards + 0.1 * torch.arange(batch_size), group_size=4)
    return {"logits": logits, "tokens": tokens, "logprobs": logprobs,
            "old_logprobs": old_logprobs, "advantages": advantages, "mask": mask,
            "entropy": entropy}


def controller_with(coef):
    controller = baselines.EntropyPIController()
    controller.coef = coef
    return controller


def reference_entropic_loss(log_prob, old_log_prob, advantages, mask, alpha, agg_mode,
                            clip_low, clip_high, clip_ratio_c, high_prob_thresh=0.95):
    """The reference's loss on one micro-batch, re-stated token by token: verl's dual-clip PPO
    token loss aggregated over the valid tokens, plus alpha x the aggregate of -ratio |A| over the
    valid tokens whose *current* log-prob exceeds log(0.95) (their own count; the ratio with its
    +-20 log clamp, not clipped). verl's masked means divide by count + 1e-8."""
    rows, width = mask.shape

    def aggregate(per_token, chosen):
        if agg_mode == "token-mean":
            cells = [(i, t) for i in range(rows) for t in range(width) if chosen[i][t]]
            return sum((per_token(i, t) for i, t in cells), torch.zeros(())) / (len(cells) + 1e-8)
        seq_means = []
        for i in range(rows):
            cells = [t for t in range(width) if chosen[i][t]]
            if cells:
                seq_means.append(sum(per_token(i, t) for t in cells) / (len(cells) + 1e-8))
        return sum(seq_means, torch.zeros(())) / (len(seq_means) + 1e-8)

    def ratio(i, t):
        return torch.exp(torch.clamp(log_prob[i, t] - old_log_prob[i, t], -20.0, 20.0))

    def ppo(i, t):
        a = float(advantages[i])
        clipped = torch.maximum(-a * ratio(i, t),
                                -a * torch.clamp(ratio(i, t), 1 - clip_low, 1 + clip_high))
        return torch.minimum(torch.tensor(-a * clip_ratio_c), clipped) if a < 0 else clipped

    valid = [[bool(mask[i, t]) for t in range(width)] for i in range(rows)]
    high = [[valid[i][t] and log_prob[i, t].item() > math.log(high_prob_thresh)
             for t in range(width)] for i in range(rows)]
    adjust = aggregate(lambda i, t: -ratio(i, t) * abs(float(advantages[i])), high)
    return aggregate(ppo, valid) + alpha * adjust


@pytest.mark.parametrize("alpha", [0.4, -0.7])
@pytest.mark.parametrize("agg_mode", ["token-mean", "seq-mean-token-mean"])
def test_entropic_matches_the_reference_loss_and_gradient(alpha, agg_mode):
    batch = peaked_batch(seed=40)
    cfg = config.LossConfig(agg_mode=agg_mode, dual_clip=3.0)  # verl's clip_ratio_c default
    # micro scope, as the reference: the high-probability tokens are chosen on the current log-probs
    loss, metrics = baselines.policy_loss("entropic", batch, cfg,
                                          states={"entropic": controller_with(alpha)})
    (grad,) = torch.autograd.grad(loss, batch["logprobs"])
    expected = reference_entropic_loss(
        batch["logprobs"], batch["old_logprobs"], batch["advantages"], batch["mask"], alpha,
        agg_mode, cfg.clip_low, cfg.clip_high, cfg.dual_clip)
    (expected_grad,) = torch.autograd.grad(expected, batch["logprobs"])
    torch.testing.assert_close(loss, expected, atol=1e-7, rtol=1e-5)
    torch.testing.assert_close(grad, expected_grad, atol=1e-8, rtol=1e-5)
    # the test means something: a fair share of the tokens is controlled, and the term is not small
    assert 0.2 < metrics["touched_frac"] < 0.9
    grpo_loss, _ = baselines.policy_loss("grpo", batch, cfg)
    assert abs(loss.item() - grpo_loss.item()) > 0.05


def test_alpha_above_zero_sharpens_and_below_zero_flattens():
    # Eq. 25 on tabular softmax rows: a gradient step on the control term alone raises the sampled
    # token's logit where pi > 0.95 when alpha > 0 (the entropy falls) and lowers it when alpha < 0
    batch = peaked_batch(seed=41, batch_size=40, width=1)
    logits = batch["logits"][:, 0].clone().requires_grad_(True)  # [B, V]
    tokens = batch["tokens"][:, 0]

    def row_entropy(z):  # [B, V] -> [B]
        return -(torch.softmax(z, -1) * torch.log_softmax(z, -1)).sum(-1)

    selected = batch["mask"][:, 0] & (torch.log_softmax(logits, -1).gather(-1, tokens[:, None])[
        :, 0] > math.log(0.95)) & (batch["advantages"] != 0)
    assert selected.sum() >= 2
    before = row_entropy(logits.detach())
    for alpha, direction in ((0.5, -1), (-0.5, 1)):
        logprobs = torch.log_softmax(logits, -1).gather(-1, tokens[:, None])  # [B, 1]
        step = {**batch, "logprobs": logprobs, "old_logprobs": logprobs.detach(),
                "mask": batch["mask"][:, :1], "entropy": batch["entropy"][:, :1]}
        cfg = config.LossConfig()
        term = (baselines.policy_loss("entropic", step, cfg,
                                      states={"entropic": controller_with(alpha)})[0]
                - baselines.policy_loss("grpo", step, cfg)[0])
        (grad,) = torch.autograd.grad(term, logits)
        after = row_entropy(logits.detach() - 0.1 * grad)
        change = (after - before)[selected]
        assert (torch.sign(change) == direction).all(), (alpha, change)
        assert (after == before)[~selected].all()  # no other row moves


def test_the_controller_matches_a_hand_computation():
    # target 0.3, kp 1, ki 0.5, alpha in [-0.2, 0.25]: alpha = clip(kp e + ki I_before), then I += e
    controller = baselines.EntropyPIController(0.3, kp=1.0, ki=0.5, coef_min=-0.2, coef_max=0.25)
    assert controller.coef == 0.0  # GRPO's loss until the first update
    steps = [  # (entropy, accepted, error, alpha, integral after), by hand
        (0.5, True, 0.2, 0.2, 0.2),  # 0.2 + 0.5 x 0
        (0.1, True, -0.2, -0.1, 0.0),  # -0.2 + 0.5 x 0.2
        (0.1, True, -0.2, -0.2, -0.2),  # -0.2 + 0
        (float("nan"), False, -0.2, -0.2, -0.2),  # rejected: nothing moves
        (0.1, True, -0.2, -0.2, -0.4),  # -0.2 + 0.5 x -0.2 = -0.3, clipped; I winds on
        (0.6, True, 0.3, 0.1, -0.1),  # 0.3 + 0.5 x -0.4
        (0.9, True, 0.6, 0.25, 0.5),  # 0.6 + 0.5 x -0.1 = 0.55, clipped
    ]
    for entropy, accepted, error, alpha, integral in steps:
        assert controller.update(torch.tensor(entropy, dtype=torch.float64)) == accepted
        assert (controller.error, controller.coef, controller.integral) == pytest.approx(
            (error, alpha, integral), abs=1e-12), entropy
    # its state round-trips: a copy continues exactly as the original
    copy = baselines.EntropyPIController()
    copy.load_state_dict(controller.state_dict())
    assert copy.update(0.2) and controller.update(0.2)
    assert copy.state_dict() == controller.state_dict()
    with pytest.raises(KeyError, match="missing keys"):
        copy.load_state_dict({"integral": 0.0})


def test_the_controllers_deviations_match_a_hand_computation():
    # start="crossing": nothing moves until the entropy first reaches the target (0.3) from above
    controller = baselines.EntropyPIController(0.3, kp=1.0, ki=0.5, start="crossing")
    steps = [  # (entropy, alpha, integral after), by hand
        (0.5, 0.0, 0.0), (0.4, 0.0, 0.0),  # above the target: GRPO's loss, no integral
        (0.25, -0.05, -0.05),  # the crossing: -0.05 + 0.5 x 0
        (0.35, 0.025, 0.0),  # 0.05 + 0.5 x -0.05; started stays on above the target
        (0.2, -0.1, -0.1)]
    for entropy, alpha, integral in steps:
        assert controller.update(entropy)
        assert (controller.coef, controller.integral) == pytest.approx((alpha, integral),
                                                                       abs=1e-12), entropy
    # anti_windup: at the bound -0.2 an error that pushes below it is not integrated
    held, wound = (baselines.EntropyPIController(0.3, kp=1.0, ki=0.5, coef_min=-0.2,
                                                 coef_max=0.25, anti_windup=on)
                   for on in (True, False))
    expected = [  # (entropy, alpha and integral with anti-windup, the same without)
        (0.1, (-0.2, -0.2), (-0.2, -0.2)),  # -0.2 + 0: at the bound, not past it: integrated
        (0.1, (-0.2, -0.2), (-0.2, -0.4)),  # -0.2 + 0.5 x -0.2 = -0.3 < -0.2: held
        (0.1, (-0.2, -0.2), (-0.2, -0.6)),
        (0.6, (0.2, 0.1), (0.0, -0.3))]  # 0.3 + 0.5 x -0.2; without: 0.3 + 0.5 x -0.6
    for entropy, with_anti_windup, without in expected:
        assert held.update(entropy) and wound.update(entropy)
        assert (held.coef, held.integral) == pytest.approx(with_anti_windup, abs=1e-12)
        assert (wound.coef, wound.integral) == pytest.approx(without, abs=1e-12)
    # the state carries the deviations; a state saved before them loads as the reference's law
    copy = baselines.EntropyPIController(start="crossing")
    copy.load_state_dict(controller.state_dict())
    assert copy.started and copy.update(0.4) and controller.update(0.4)
    assert copy.state_dict() == controller.state_dict()
    old = {key: value for key, value in held.state_dict().items()
           if key not in ("start", "anti_windup", "started")}
    copy.load_state_dict(old)
    assert (copy.start, copy.anti_windup, copy.started) == ("first_step", False, True)
    with pytest.raises(ValueError, match="start"):
        baselines.EntropyPIController(start="later")


def test_the_controller_reads_the_gates_entropy_once_per_step():
    # update_states: the step's token-mean entropy under pi_old drives both, once
    generator = torch.Generator().manual_seed(42)
    responses = []
    for length in (3, 7, 5):
        entropy = torch.rand(length, generator=generator)
        responses.append(grpo.Response(
            prompt=[1], tokens=list(range(length)), rollout_logprobs=[0.0] * length, reward=0.0,
            accuracy=0.0, truncated=False, reflection=(0, 0),
            policy_mask=torch.arange(length) != 1, old_logprobs=-entropy, entropy=entropy))
    gate = stare.EntropyGate(target_entropy=0.4)
    controller = baselines.EntropyPIController(target_entropy=0.4, kp=2.0, ki=0.1)
    _, metrics = grpo.update_states({"gate": gate, "entropic": controller}, responses,
                                    torch.device("cpu"))
    token_mean = torch.cat([r.entropy[r.policy_mask] for r in responses]).mean().item()
    assert controller.current_entropy == gate.current_entropy == metrics["train/entropy"]
    assert metrics["train/entropy"] == pytest.approx(token_mean, rel=1e-6)
    assert metrics["entropic/error"] == pytest.approx(token_mean - 0.4, rel=1e-6)
    assert metrics["entropic/coef"] == pytest.approx(2.0 * (token_mean - 0.4), rel=1e-6)
    assert metrics["entropic/integral"] == metrics["entropic/error"]
    assert metrics["entropic/update_accepted"] == 1.0
    # no controller (any other method): no entropic/ metric
    _, metrics = grpo.update_states({"gate": gate}, responses, torch.device("cpu"))
    assert not any(key.startswith("entropic/") for key in metrics)


def test_the_controller_holds_the_gates_target_unless_given_its_own():
    def controller_of(cfg):
        return baselines.method_states(cfg).get("entropic")

    cfg = config.load("configs/tiny.yaml", ["algorithm.method=entropic", "gate.target_entropy=0.7"])
    controller = controller_of(cfg)
    assert (controller.target_entropy, controller.kp, controller.ki) == (0.7, 1.0, 0.01)
    assert (controller.coef_min, controller.coef_max) == (-1.0, 1.0)
    own = config.load("configs/tiny.yaml", ["algorithm.method=entropic",
                                            "entropic.target_entropy=0.2", "entropic.ki=0.05"])
    assert (controller_of(own).target_entropy, controller_of(own).ki) == (0.2, 0.05)
    assert controller_of(config.load("configs/tiny.yaml", ["algorithm.method=grpo"])) is None
    with pytest.raises(config.ConfigError, match="entropic.coef_max"):
        config.load("configs/tiny.yaml", ["entropic.coef_min=0.5", "entropic.coef_max=0.1"])
    with pytest.raises(config.ConfigError, match="entropic.ki"):
        config.load("configs/tiny.yaml", ["entropic.ki=-1"])
    with pytest.raises(config.ConfigError, match="entropic.start"):
        config.load("configs/tiny.yaml", ["entropic.start=later"])
