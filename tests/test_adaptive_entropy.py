"""The adaptive entropy coefficient (Eq. 30): the controller against a hand computation of
Skywork-OR1's EntController (SkyworkAI/Skywork-OR1 @64e96af, core_algos.py; moved after the
update, so a step's entropy acts from the next step), the loss against an entropy bonus of the
same coefficient computed by hand, its config (its state across a resume: tests/test_train.py)."""

import pytest
import torch

import baselines
import config
import stare


def test_the_controller_matches_a_hand_computation():
    # target 0.3, delta 0.1, coefficient in [0, 0.25]: this step's bonus is the coefficient the
    # earlier steps set while the last entropy was below the target (strict), then it moves
    controller = baselines.AdaptiveEntropyCoefficient(0.3, coef_init=0.05, coef_min=0.0,
                                                      coef_max=0.25, delta=0.1)
    steps = [  # (entropy, accepted, applied this step, coefficient after, enabled after)
        (0.2, True, 0.05, 0.15, True),  # the start: coef_init, enabled
        (0.1, True, 0.15, 0.25, True),
        (0.25, True, 0.25, 0.25, True),  # 0.35 clipped to 0.25
        (float("nan"), False, 0.25, 0.25, True),  # rejected: nothing moves
        (0.3, True, 0.25, 0.15, False),  # at the target: not below, lowered, disabled
        (0.5, True, 0.0, 0.05, False),  # disabled: no bonus this step
        (0.4, True, 0.0, 0.0, False),  # -0.05 clipped to 0
        (0.29, True, 0.0, 0.1, True)]
    for entropy, accepted, applied, coef, enabled in steps:
        assert controller.update(torch.tensor(entropy, dtype=torch.float64)) == accepted
        assert (controller.applied, controller.coef, controller.enabled) == (
            pytest.approx(applied, abs=1e-12), pytest.approx(coef, abs=1e-12), enabled), entropy
    copy = baselines.AdaptiveEntropyCoefficient()
    copy.load_state_dict(controller.state_dict())
    assert copy.update(0.1) and controller.update(0.1)
    assert copy.state_dict() == controller.state_dict()
    # a resume carries the coefficient, not the settings
    resumed = baselines.AdaptiveEntropyCoefficient(0.5, coef_max=1.0, delta=0.5)
    resumed.resume(controller.state_dict())
    assert (resumed.coef, resumed.applied, resumed.delta, resumed.coef_max) == (
        controller.coef, controller.applied, 0.5, 1.0)
    with pytest.raises(ValueError, match="coef_min"):
        baselines.AdaptiveEntropyCoefficient(coef_min=0.1, coef_max=0.0)


def batch_with_entropy(seed):
    generator = torch.Generator().manual_seed(seed)
    logits = (torch.randn(6, 9, 12, generator=generator) * 2).requires_grad_(True)
    tokens = torch.randint(0, 12, (6, 9), generator=generator)
    logprobs, entropy = stare.token_logprobs_and_entropy(logits, tokens)
    mask = torch.rand(6, 9, generator=generator) < 0.8
    mask[2] = False  # an empty row
    advantages = torch.tensor([1.0, -1.0, 0.5, 0.0, -0.5, 1.5])
    return logits, {"logprobs": logprobs, "old_logprobs": logprobs.detach() + 0.05,
                    "entropy": entropy, "advantages": advantages, "mask": mask}


@pytest.mark.parametrize("policy_loss", baselines.POLICY_LOSSES)
def test_its_loss_is_the_entropy_bonus_at_the_coefficient_applied(policy_loss):
    # the policy loss minus applied x the token-mean entropy (with its gradient), by hand
    logits, batch = batch_with_entropy(seed=5)
    cfg = config.LossConfig(policy_loss=policy_loss)
    controller = baselines.AdaptiveEntropyCoefficient()
    controller.applied = 0.03
    loss, metrics = baselines.policy_loss("adaptive_entropy", batch, cfg,
                                          states={"adaptive_entropy": controller})
    grpo, _ = baselines.policy_loss("grpo", batch, cfg)
    mask = batch["mask"]
    expected = grpo - 0.03 * (batch["entropy"] * mask).sum() / mask.sum()
    torch.testing.assert_close(loss, expected, rtol=1e-6, atol=1e-7)
    (gradient,) = torch.autograd.grad(loss, logits, retain_graph=True)
    (expected_gradient,) = torch.autograd.grad(expected, logits, retain_graph=True)
    torch.testing.assert_close(gradient, expected_gradient, rtol=1e-5, atol=1e-7)
    assert metrics["touched_frac"] == 1.0
    # a coefficient of 0 (the start, or coef_max 0): GRPO's loss bit for bit
    controller.applied = 0.0
    neutral, metrics = baselines.policy_loss("adaptive_entropy", batch, cfg,
                                             states={"adaptive_entropy": controller})
    assert torch.equal(neutral, grpo) and metrics["touched_frac"] == 0.0


def test_it_holds_the_gates_target_unless_given_its_own():
    cfg = config.load("configs/tiny.yaml", ["algorithm.method=adaptive_entropy"])
    state = baselines.method_states(cfg)["adaptive_entropy"]
    assert (state.target_entropy, state.coef, state.coef_max, state.delta) == (
        cfg.gate.target_entropy, 0.0, 0.005, 1e-4)
    own = config.load("configs/tiny.yaml", ["algorithm.method=adaptive_entropy",
                                            "loss.adaptive_entropy_target=0.2"])
    assert baselines.method_states(own)["adaptive_entropy"].target_entropy == 0.2
    with pytest.raises(config.ConfigError, match="adaptive_entropy_coef_max"):
        config.load("configs/tiny.yaml", ["loss.adaptive_entropy_coef_max=-1"])
