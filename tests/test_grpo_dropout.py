"""GRPODropout (Eq. 31): the choice of rollouts against a plain-loop re-statement of its reference
(hexuandeng/GRPODropout @4ad3b3b: selector.py's pushes, selector_methods.py:
select_balanced_push_zero; ray_trainer.py: the advantages recomputed on the kept rollouts and
_apply_adv_p_center_after_select, mode weighted_center), the loss it feeds, its neutral setting and
its config."""

import math
import random

import pytest
import torch

import baselines
import config
import stare

EPS = 1e-12


def reference_selection(pushes):
    """select_balanced_push_zero as the reference reads, on Python floats: indices kept (None for
    the all-zero case, which the reference draws at random)."""
    idxs = list(range(len(pushes)))
    positive = [i for i in idxs if pushes[i] > EPS]
    negative = [i for i in idxs if pushes[i] < -EPS]
    zero = [i for i in idxs if abs(pushes[i]) <= EPS]
    minimum = max(1, len(idxs) // 4)
    if len(zero) == len(idxs):
        return None
    if not positive or not negative:
        chosen = sorted(positive, key=lambda i: pushes[i], reverse=True)
        if len(chosen) < minimum:
            chosen.extend(sorted(zero)[:minimum - len(chosen)])
        if len(chosen) < minimum:
            pool = negative if negative else positive
            ordered = sorted(pool, key=lambda i: pushes[i], reverse=True)
            chosen.extend([i for i in ordered if i not in chosen][:minimum - len(chosen)])
        return sorted(chosen)
    selected = sorted(positive, key=lambda i: pushes[i], reverse=True)
    running = sum(pushes[i] for i in selected)
    for i in sorted(negative, key=lambda i: pushes[i], reverse=True):
        if running + pushes[i] <= EPS:
            break
        selected.append(i)
        running += pushes[i]
    if len(selected) < minimum:
        selected.extend([i for i in sorted(zero) if i not in selected][:minimum - len(selected)])
    return sorted(selected)


def reference_dropout(logprobs, mask, rewards, group_size, basis="avg"):
    """The whole procedure in plain loops: (kept indices, advantage per kept index)."""
    rows, width = len(logprobs), len(logprobs[0])
    ell = []
    for i in range(rows):
        values = [logprobs[i][t] for t in range(width) if mask[i][t]]
        total = sum(values)
        ell.append(total / max(len(values), 1) if basis == "avg" else total)

    def grpo(values):  # Eq. 1 as verl's compute_grpo_outcome_advantage
        if len(values) == 1:
            return [values[0] / (1 + 1e-6)]
        mean = sum(values) / len(values)
        std = math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1))
        return [(v - mean) / (std + 1e-6) for v in values]

    kept, advantage = [], {}
    for start in range(0, rows, group_size):
        members = list(range(start, start + group_size))
        group_adv = grpo([rewards[i] for i in members])
        surprisal = [-ell[i] for i in members]
        centre = sum(surprisal) / len(surprisal)
        pushes = [a * (s - centre) for a, s in zip(group_adv, surprisal)]
        local = reference_selection(pushes)
        assert local is not None
        chosen = [members[k] for k in local]
        new = grpo([rewards[i] for i in chosen]) if len(chosen) < len(members) else \
            [group_adv[k] for k in local]
        top = max(ell[i] for i in chosen)
        weights = [math.exp(ell[i] - top) for i in chosen]
        weights = [w / sum(weights) for w in weights]
        shift = sum(w * a for w, a in zip(weights, new))
        kept += chosen
        advantage.update({i: a - shift for i, a in zip(chosen, new)})
    return kept, advantage


def test_the_choice_matches_the_reference_on_random_pushes():
    rng = random.Random(0)
    for case in range(400):
        size = rng.choice([2, 3, 4, 5, 8, 16])
        kind = case % 4
        pushes = [rng.gauss(0, 1) for _ in range(size)]
        if kind == 1:  # one sign only
            pushes = [abs(p) for p in pushes] if rng.random() < 0.5 else [-abs(p) for p in pushes]
        if kind == 2:  # some exact zeros
            pushes = [0.0 if rng.random() < 0.4 else p for p in pushes]
        if kind == 3 and size > 2:  # a negative that exactly cancels the positives
            pushes[0], pushes[1] = 0.5, -0.5
        expected = reference_selection(pushes)
        kept = baselines.balanced_push_selection(torch.tensor(pushes, dtype=torch.float64))
        if expected is None:
            assert int(kept.sum()) == max(1, size // 4)
        else:
            assert kept.nonzero().flatten().tolist() == expected, pushes
    # every push zero: max(1, G // 4) rollouts drawn from the generator
    drawn = baselines.balanced_push_selection(torch.zeros(8, dtype=torch.float64),
                                              torch.Generator().manual_seed(1))
    assert int(drawn.sum()) == 2


@pytest.mark.parametrize("basis", ["avg", "sum"])
@pytest.mark.parametrize("seed", range(6))
def test_kept_rollouts_and_advantages_match_the_reference(seed, basis):
    # 4 groups of 8: most seeds drop some rollouts (the greedy stops at the first negative push
    # that would take the kept sum to 0), some keep all
    generator = torch.Generator().manual_seed(seed)
    groups, size, width = 4, 8, 7
    rows = groups * size
    logprobs = -torch.rand(rows, width, generator=generator) * 3
    mask = torch.rand(rows, width, generator=generator) < 0.8
    mask[:, 0] = True
    rewards = (torch.rand(rows, generator=generator) < 0.4).float()
    rewards[::size] = 1.0  # every group varied
    rewards[1::size] = 0.0
    advantages = stare.group_advantages(rewards, size)
    cfg = config.LossConfig(grpo_dropout_basis=basis)
    kept, new = baselines.grpo_dropout(logprobs, advantages, rewards,
                                       torch.arange(rows) // size, mask, cfg)
    expected_kept, expected = reference_dropout(logprobs.tolist(), mask.tolist(),
                                                rewards.tolist(), size, basis)
    assert kept.nonzero().flatten().tolist() == sorted(expected_kept)
    for i in expected_kept:
        assert new[i].item() == pytest.approx(expected[i], abs=2e-6)
    assert (new[~kept] == 0).all()
    # the kept pushes (frozen full-group centre) sum to > 0 wherever both signs were present
    for g in range(groups):
        members = torch.arange(g * size, (g + 1) * size)
        ell = (logprobs[members] * mask[members]).sum(-1)
        if basis == "avg":
            ell = ell / mask[members].sum(-1)
        push = advantages[members].double() * (-ell.double() + ell.double().mean())
        if (push > EPS).any() and (push < -EPS).any():
            assert push[kept[members]].sum() > 0


def on_policy_batch(seed):
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(8, 6, 10, generator=generator) * 2
    tokens = torch.randint(0, 10, (8, 6), generator=generator)
    old_logprobs, entropy = stare.token_logprobs_and_entropy(logits, tokens)
    rewards = torch.tensor([1.0, 0.0, 1.0, 0.0, 0.0, 1.0, 1.0, 1.0])
    return {"logprobs": old_logprobs.clone().requires_grad_(True), "old_logprobs": old_logprobs,
            "entropy": entropy, "mask": torch.ones(8, 6, dtype=torch.bool),
            "advantages": stare.group_advantages(rewards, 4), "rewards": rewards,
            "groups": torch.arange(8) // 4}


def test_its_loss_is_grpos_on_the_kept_rollouts_with_their_new_advantages():
    batch = on_policy_batch(seed=3)
    cfg = config.LossConfig()
    loss, metrics = baselines.policy_loss("grpo_dropout", batch, cfg)
    kept, new = baselines.grpo_dropout(batch["old_logprobs"], batch["advantages"],
                                       batch["rewards"], batch["groups"], batch["mask"], cfg)
    assert 0 < kept.sum() < 8
    # on-policy GRPO: -mean over the kept tokens of A' log pi's gradient, by hand
    (gradient,) = torch.autograd.grad(loss, batch["logprobs"])
    tokens = batch["mask"][kept].sum()
    expected = torch.zeros(8, 6)
    expected[kept] = -new[kept, None].expand(-1, 6) / tokens
    torch.testing.assert_close(gradient, expected, rtol=1e-6, atol=1e-7)
    assert metrics["touched_frac"] > 0
    # neither dropping nor centring: GRPO bit for bit
    neutral = config.LossConfig(grpo_dropout_drop=False, grpo_dropout_center=False)
    same, metrics = baselines.policy_loss("grpo_dropout", batch, neutral)
    assert torch.equal(same, baselines.policy_loss("grpo", batch, neutral)[0])
    assert metrics["touched_frac"] == 0


def test_its_config_needs_the_step_scope_and_grpo_advantages():
    with pytest.raises(config.ConfigError, match="selection_scope"):
        config.load("configs/tiny.yaml", ["algorithm.method=grpo_dropout",
                                          "algorithm.selection_scope=micro"])
    with pytest.raises(config.ConfigError, match="normalize_std"):
        config.load("configs/tiny.yaml", ["algorithm.method=grpo_dropout",
                                          "algorithm.normalize_std=false"])
    with pytest.raises(config.ConfigError, match="grpo_dropout_basis"):
        config.load("configs/tiny.yaml", ["loss.grpo_dropout_basis=median"])
