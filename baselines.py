"""baselines.py: the token-level entropy controls STARE is compared with, behind one switch.

    loss, metrics = baselines.policy_loss(method, batch, cfg)  # cfg: a config.LossConfig

runs any of METHODS on the same tensors, on top of one of POLICY_LOSSES (`cfg.policy_loss`):
PPO-clip (`stare.clipped_surrogate`) or verl's GSPO, CISPO and SAPO; `refused_combination` says
which pairs have no meaning. GRPO, DAPO and Dr.GRPO are settings of `config.LossConfig`, not
methods. "Eq. N" refers to docs/method.md; its "Methods" lists the sources, the knobs, and the
places a new method edits.

`batch` is a dict of [B, T] tensors (advantages may be [B]):
    logprobs        log pi_theta of the sampled tokens, current policy, with grad
    old_logprobs    log pi_old (the behaviour policy, from the no-grad pass)
    advantages      [B] or [B, T]
    rewards, groups [B]: each response's reward and its group's id (grpo_dropout)
    mask            1 = a response token that counts
    entropy         next-token entropy (stapo, high_entropy: may be detached; entropy_bonus: grad)
    old_entropy     H under pi_old, for STEER's weights (optional: `entropy` when absent)
    proxy_logprobs  Lp-Reg's proxy log-prob of the sampled token (`minp_proxy_logprobs`, pi_old)
    sensitivity     STEER's steer_estimate="sensitivity": stare.entropy_sensitivity, pi_old

Each method first decides per token what to change (`token_selection`), then the loss applies it.
`policy_loss` alone selects within the batch it is given (the references' per-micro-batch
behaviour); the trainer selects once over the optimizer step and passes each micro-batch its slice
(`selection=`), so the update does not depend on the micro-batch size (Eq. 7).

Pure functions of tensors: no I/O, no torch.distributed, no global state. Randomness comes from a
torch.Generator passed in; state across steps lives in the stare.MethodState objects that
`method_states` builds, the trainer updates once per step and `policy_loss` reads (`states=`).
"""

import difflib
import math

import torch

import stare

METHODS = ("grpo", "stare", "stapo", "lp_reg", "clip_cov", "kl_cov", "high_entropy",
           "entropy_bonus", "steer", "w_reinforce", "entropic", "adaptive_entropy",
           "grpo_dropout")
# What the trainer gives each method: the per-token inputs of pi_old it needs beyond logprobs,
# old_logprobs, advantages, mask and entropy; and whether `token_selection` decides anything for it.
EXTRA_INPUTS = {"lp_reg": ("proxy_logprobs",), "steer": ("sensitivity",)}
SELECTING = ("stare", "stapo", "lp_reg", "clip_cov", "kl_cov", "high_entropy", "steer", "entropic",
             "grpo_dropout")
POLICY_LOSSES = ("ppo_clip", "gspo", "cispo", "sapo")
# methods whose selected tokens get an objective of their own in place of the policy loss's token
# loss (-A r unclipped, Eqs. 14 and 17): defined against PPO-clip's ratio only
OWN_OBJECTIVE = {"lp_reg": "its regularised tokens take -A r unclipped plus a KL term (Eq. 14)",
                 "kl_cov": "its loss is -A r unclipped plus a KL penalty on every token (Eq. 17)"}


def refused_combination(method, policy_loss):
    """Why `method` on top of `policy_loss` has no meaning, or None when it runs."""
    if policy_loss != "ppo_clip" and method in OWN_OBJECTIVE:
        return (f"{method} on loss.policy_loss {policy_loss}: {OWN_OBJECTIVE[method]}, a "
                f"replacement of PPO-clip's token loss; it composes with ppo_clip only")
    return None


def method_states(cfg):
    """The run's state across steps, by name (stare.MethodState): STARE's gate for every method
    (its entropy signal is logged for all; only STARE acts on it) and the method's own (STATEFUL).
    cfg: the run's config (config.Config)."""
    states = {"gate": stare.EntropyGate(**vars(cfg.gate))}
    make = STATEFUL.get(cfg.algorithm.method)
    if make is not None:
        state = make(cfg)
        states[state.name] = state
    return states


def old_policy_inputs(method, logits, ids, temperature, cfg):
    """The per-token inputs of pi_old that `method` needs from the no-grad pass's logits beyond
    log-probs, entropy and sensitivity (EXTRA_INPUTS): name -> [N]. logits [N, V], ids [N]."""
    if method == "lp_reg":  # Eq. 13
        return {"proxy_logprobs": minp_proxy_logprobs(logits, ids, temperature, cfg.lp_reg_kappa,
                                                      cfg.lp_reg_soft)}
    return {}


# ==================================================================================================
# Selections: which tokens each method changes (no grad)
# ==================================================================================================


def _count_k(ratio, n, rule):
    """k from a fraction of n (a 0-dim device tensor) by the counting rules of Eqs. 14, 16-18 (see
    the note after Eq. 11): 'ceil' = ceil(ratio n), 'floor1' = max(1, int(ratio n)); 0 at ratio 0.
    The 1e-9 of slack makes 0.29 * 100 = 28.999999999999996 give 29 (the reference's int(): 28)."""
    if ratio == 0:
        return torch.zeros((), dtype=torch.int32, device=n.device)
    x = ratio * n.double()
    k = torch.ceil(x - 1e-9) if rule == "ceil" else torch.floor(x + 1e-9).clamp(min=1)
    return k.int()


def _masked_quantile(values, mask, q):
    """The q-quantile (linear interpolation, as torch.quantile) of values[mask], without a host sync
    or a size limit. values, mask [...] -> 0-dim float32; +inf when mask is empty."""
    if values.numel() == 0:
        return torch.full((), float("inf"), device=values.device)
    # valid values first
    ascending = torch.where(mask, values.float(), float("inf")).reshape(-1).sort().values
    n = mask.sum()
    position = q * (n - 1).clamp(min=0).double()
    below, above = position.floor().long().view(1), position.ceil().long().view(1)
    low, high = ascending.gather(0, below), ascending.gather(0, above)
    return (low + (high - low) * (position - position.floor()).float()).squeeze(0)


def stapo_spurious_mask(logprobs, entropy, advantages, mask, prob_threshold=0.01,
                        entropy_quantile=0.05):
    """STAPO's spurious tokens (Liu et al. 2026, arXiv 2602.15620; Eq. 12): the valid tokens with
    A > 0, pi < prob_threshold and H below the `entropy_quantile` of the valid tokens' entropies.

    logprobs, entropy, mask [B, T] (old policy in step scope); advantages [B] or [B, T] ->
    (spurious bool [B, T], entropy threshold 0-dim). Compared in float32 (bf16 would round).
    """
    valid = mask.bool()
    entropy = entropy.detach().float()
    threshold = _masked_quantile(entropy, valid, entropy_quantile)
    advantages = stare.broadcastable_advantages(advantages, logprobs)
    # tau_p = 0: STAPO off
    log_threshold = math.log(prob_threshold) if prob_threshold > 0 else -math.inf
    spurious = valid & (advantages > 0) & (logprobs.detach().float() < log_threshold) & (
        entropy < threshold)
    return spurious, threshold


@torch.no_grad()
def minp_proxy_logprobs(logits, tokens, temperature=1.0, kappa=0.02, soft=False, chunk_size=None):
    """Lp-Reg's proxy log-prob of the sampled token (Huang et al. 2025, arXiv 2510.03222; Eq. 13):
    the min-p filter on p = softmax(logits), without temperature; other logits set to -1e4 (soft:
    the row's minimum logit), then the temperature and a softmax. (The reference's `fixed` variant,
    p_a >= kappa, is not implemented.)

    logits [..., T, V] of the *old* policy (the pass that gives the old log-probs), tokens [..., T]
    -> log pi_proxy(token) [..., T] float32, in row chunks like `stare.token_logprobs_and_entropy`.
    """
    import kernels

    if not (temperature > 0 and 0 < kappa <= 1):
        raise ValueError(f"need temperature > 0 and 0 < kappa <= 1, got {temperature=}, {kappa=}")
    logits_2d, tokens_1d = stare.flatten_logits(logits, tokens)
    # CUDA: two Triton passes per row instead of the chunk loop below
    if kernels.supported(logits_2d):
        return kernels.minp_proxy(logits_2d, tokens_1d, temperature, kappa, soft).view(tokens.shape)
    chunk_rows = stare.rows_per_chunk(logits_2d.shape[0], logits_2d.shape[1], chunk_size)
    proxy = torch.empty(logits_2d.shape[0], device=logits_2d.device)  # [N] float32
    # p_a >= kappa max p  <=>  x_a - max x >= log(kappa) / T
    log_kappa_tempered = math.log(kappa) / temperature
    # x = logits / T, [n, V]
    for start, end, x in stare.tempered_chunks(logits_2d, temperature, chunk_rows):
        row_max = x.amax(-1, keepdim=True)
        filtered_value = (
            x.amin(-1, keepdim=True) if soft else torch.full_like(row_max, -1e4 / temperature))
        kept = torch.where(x - row_max >= log_kappa_tempered, x, filtered_value)  # [n, V]
        proxy[start:end] = (kept.gather(-1, tokens_1d[start:end, None]).squeeze(-1)
                            - torch.logsumexp(kept, -1))
    return proxy.view(tokens.shape)


def lp_reg_mask(logprobs, proxy_logprobs, advantages, mask, neg_ratio=0.01):
    """Lp-Reg's regularised tokens (Eq. 14): among the valid A < 0 tokens, the k = max(1, int(rho
    n)) with the lowest current log pi, kept only if log pi < log pi_proxy. As in the reference,
    nothing is selected unless k > 1 (a batch needs >= 2 / rho negative tokens). logprobs,
    proxy_logprobs, mask [B, T] -> bool [B, T]."""
    logprobs = logprobs.detach()
    negative = mask.bool() & (stare.broadcastable_advantages(advantages, logprobs) < 0)
    k = _count_k(neg_ratio, negative.sum(), "floor1")
    k = torch.where(k > 1, k, torch.zeros_like(k))
    lowest = stare.select_top_k(-logprobs, negative, k)  # lowest probability = highest surprisal
    return lowest & (logprobs < proxy_logprobs)


def advantage_logprob_covariance(logprobs, advantages, mask):
    """Cov_t = (A_t - mean A)(log pi_t - mean log pi), both means over the valid tokens (Cui et al.
    2025; Eq. 15). logprobs, mask [B, T], advantages [B] or [B, T] -> [B, T] float32 (0 on invalid
    tokens). No grad."""
    valid = mask.bool()
    count = valid.sum().clamp(min=1)
    logprobs = logprobs.detach().float()
    advantages = stare.token_advantages(advantages, logprobs).float()
    centred_adv = advantages - (advantages * valid).sum() / count
    centred_logprobs = logprobs - (logprobs * valid).sum() / count
    return centred_adv * centred_logprobs * valid


def clip_cov_mask(logprobs, old_logprobs, advantages, mask, ratio, lb, ub, clip_low, clip_high,
                  generator=None):
    """Clip-Cov's detached tokens (Cui et al. 2025, arXiv 2505.22617; Eq. 16): of the valid tokens
    not already clipped with lb < Cov < ub, min(k, n) drawn uniformly with `generator` (required, on
    the tensors' device: reproducible, no global RNG state), k = max(1, int(ratio N_valid)).
    logprobs, old_logprobs, mask [B, T], advantages [B] or [B, T] -> bool [B, T]."""
    valid = mask.bool()
    if ratio == 0:
        return torch.zeros_like(valid)
    if generator is None:
        raise ValueError(
            "clip_cov_mask needs a torch.Generator (pass generator=...): it draws random tokens")
    logprobs = logprobs.detach()
    advantages = stare.token_advantages(advantages, logprobs)
    ratio_pi = torch.exp(torch.clamp(logprobs - old_logprobs, -20.0, 20.0))
    already_clipped = (
        -advantages * torch.clamp(ratio_pi, 1 - clip_low, 1 + clip_high) > -advantages * ratio_pi)
    covariance = advantage_logprob_covariance(logprobs, advantages, mask)
    candidates = valid & ~already_clipped & (covariance > lb) & (covariance < ub)
    k = _count_k(ratio, valid.sum(), "floor1")
    # top-k of i.i.d. uniform keys = a uniformly random subset of size min(k, n), with no host sync
    random_keys = torch.rand(candidates.shape, generator=generator, device=candidates.device)
    return stare.select_top_k(random_keys, candidates, k)


def kl_cov_mask(logprobs, advantages, mask, ratio):
    """KL-Cov's penalised tokens (Cui et al. 2025; Eq. 17): the k = max(1, int(ratio N_valid)) valid
    tokens with the largest Cov. -> bool [B, T]."""
    valid = mask.bool()
    covariance = advantage_logprob_covariance(logprobs, advantages, mask)  # [B, T], of either sign
    # signed: ranked exactly as they are (shifted to >= 0 in float32, near-ties would merge)
    return stare.select_top_k(
        covariance, valid, _count_k(ratio, valid.sum(), "floor1"), signed=True)


def high_entropy_mask(entropy, mask, top_ratio=0.2, convention="paper"):
    """The 80/20 rule (Wang et al. 2025, arXiv 2506.01939; Eq. 18): the valid tokens with the
    highest entropy keep their gradient. paper: k = ceil(rho N) (the top rho of the batch);
    lp_reg_dev: k = max(1, int(rho N)). Ties at the k-th entropy are broken by position (the paper's
    quantile would keep them all). -> bool [B, T]."""
    valid = mask.bool()
    rule = "ceil" if convention == "paper" else "floor1"
    return stare.select_top_k(entropy.detach(), valid, _count_k(top_ratio, valid.sum(), rule))


def steer_entropy_change(logprobs, old_logprobs, advantages, entropy, mask, sensitivity=None):
    """STEER's estimate |Omega| of the entropy change a token's update causes (Hao et al. 2025,
    arXiv 2510.10150; Eq. 22). logprobs, old_logprobs, entropy, mask [B, T], advantages [B] or
    [B, T] -> |Omega| [B, T] float32, 0 off the mask. No grad.

    pi is from `logprobs` (pi_theta in micro scope, pi_old in step scope: ratio 1), clamped to
    [1e-8, 1 - 1e-8], pi_old to [1e-8, 1], as in the reference; H is the entropy passed in. Omega is
    Eq. 5's sampled-logit term divided by pi; with `sensitivity` (S of Eq. 5 under pi_old) it is
    A (pi / pi_old) S, Eq. 6's whole first-order change.
    """
    valid = mask.bool()
    logprobs, old_logprobs = logprobs.detach().float(), old_logprobs.detach().float()
    advantages = stare.broadcastable_advantages(advantages, logprobs).float()  # [B, 1] or [B, T]
    pi = logprobs.exp().clamp(1e-8, 1 - 1e-8)  # [B, T]
    # A / pi_old * pi = A times the ratio, written as the reference does so its clamps act the same
    scaled_adv = advantages / old_logprobs.exp().clamp(1e-8, 1.0) * pi  # [B, T]
    if sensitivity is None:
        omega = scaled_adv * (1 - pi) * (pi.log() + entropy.detach().float())
    else:
        omega = scaled_adv * sensitivity.detach().float()
    # as the reference: a non-finite value (a NaN entropy, say) counts as 0, not as the scale
    return torch.where(valid & torch.isfinite(omega), omega.abs(), 0.0)


def steer_weights(omega, mask, weight_min=0.8, weight_max=1.2, linear=False):
    """STEER's token weights lambda from |Omega| (Eq. 23): the larger a token's estimated entropy
    change, either way, the smaller its weight: exponential (default) or `linear`, max and min over
    the valid tokens passed in (the trainer's: the whole step). All |Omega| equal, linear: the
    midpoint. weight_min = weight_max = 1 gives lambda = 1 exactly (GRPO).

    omega [B, T] (>= 0, `steer_entropy_change`), mask [B, T] -> (weights [B, T] float32, 1 off the
    mask; the batch's largest |Omega|, 0-dim).
    """
    valid = mask.bool()
    empty = omega.numel() == 0
    omega_max = omega.new_zeros(()) if empty else torch.where(valid, omega, -math.inf).amax()
    if linear:
        omega_min = omega.new_zeros(()) if empty else torch.where(valid, omega, math.inf).amin()
        spread = omega_max - omega_min  # nan (inf - inf) without a valid token: the midpoint then
        slope = (weight_max - weight_min) / torch.where(spread > 0, spread, 1.0)
        weights = torch.clamp(weight_max - (omega - omega_min) * slope, weight_min, weight_max)
        weights = torch.where(spread > 0, weights, (weight_min + weight_max) / 2)
    else:
        k = -math.log(weight_min) / omega_max.clamp(min=0.02)  # 0-dim
        weights = torch.clamp(torch.exp(-k * omega), weight_min, 1.0)
    return torch.where(valid, weights, 1.0), omega_max.clamp(min=0.0)


def entropic_high_prob_mask(logprobs, mask, prob_threshold=0.95):
    """EntroPIC's controlled tokens (Yang et al. 2025, arXiv 2511.15248; Eq. 25): the valid tokens
    whose sampled token has pi > prob_threshold (strict), of either advantage sign. logprobs, mask
    [B, T] -> bool [B, T]. The reference tests the current log-prob inside the loss; here that is
    micro scope, and step scope tests pi_old's. prob_threshold 1 selects nothing."""
    # threshold 0: every valid token
    log_threshold = math.log(prob_threshold) if prob_threshold > 0 else -math.inf
    return mask.bool() & (logprobs.detach().float() > log_threshold)


class EntropyPIController(stare.MethodState):
    """EntroPIC's proportional-integral controller of the coefficient alpha (Eq. 26), fed the
    gate's entropy: alpha = clip(kp e + ki I, coef_min, coef_max), e = H - target, I the sum of the
    earlier steps' errors (the reference adds this step's after using it); alpha > 0 sharpens
    (Eq. 25). Starts at alpha = 0 (the GRPO loss).

    Off by default, two deviations from the reference (Eq. 26): start="crossing" holds alpha and I
    at 0 until the entropy first reaches the target (so a target below the starting entropy is not
    approached by sharpening first); anti_windup=True (conditional integration).
    """

    def __init__(self, target_entropy=0.3, kp=1.0, ki=0.01, coef_min=-1.0, coef_max=1.0,
                 start="first_step", anti_windup=False):
        if not (math.isfinite(target_entropy) and kp >= 0 and ki >= 0 and coef_min <= coef_max
                and start in ("first_step", "crossing")):
            raise ValueError(f"need a finite target, kp, ki >= 0, coef_min <= coef_max and start "
                             f"'first_step' or 'crossing'; got {target_entropy=}, {kp=}, {ki=}, "
                             f"{coef_min=}, {coef_max=}, {start=}")
        self.target_entropy, self.kp, self.ki = float(target_entropy), float(kp), float(ki)
        self.coef_min, self.coef_max = float(coef_min), float(coef_max)
        self.start, self.anti_windup = start, bool(anti_windup)
        self.started = start == "first_step"  # whether the PI law acts yet
        self.integral = 0.0  # sum of the errors of the steps so far
        self.error = 0.0  # this step's H - target
        self.coef = 0.0  # alpha for this step's update

    def step(self, entropy):  # Eq. 26
        self.error = entropy - self.target_entropy
        self.started = self.started or self.error <= 0
        if not self.started:
            return
        unclipped = self.kp * self.error + self.ki * self.integral
        self.coef = min(max(unclipped, self.coef_min), self.coef_max)
        # at a bound, an error of the sign that pushes past it would only wind the integral up
        held = ((unclipped > self.coef_max and self.error > 0)
                or (unclipped < self.coef_min and self.error < 0))
        if not (self.anti_windup and held):
            self.integral += self.error

    name = "entropic"
    STATE_KEYS = ("target_entropy", "kp", "ki", "coef_min", "coef_max", "integral", "error",
                  "coef", "current_entropy", "start", "anti_windup", "started")
    # keys a checkpoint from before the deviations lacks: their reference values
    ADDED_KEYS = {"start": "first_step", "anti_windup": False, "started": True}

    def metrics(self, accepted):  # after this step's error: coef is what the update uses
        return {"entropic/update_accepted": float(accepted), "entropic/error": self.error,
                "entropic/coef": self.coef, "entropic/integral": self.integral}

    def carried(self):
        # the integral and last error carry over (the reference restarts at 0); gains, bounds and
        # target come from the resumed run's config
        return ("integral", "error", "coef", "current_entropy", "started")


def _entropic_controller(cfg):
    # its target defaults to the gate's, so that both hold the same entropy
    target = cfg.entropic.target_entropy
    target = cfg.gate.target_entropy if target is None else target
    return EntropyPIController(**{**vars(cfg.entropic), "target_entropy": target})


class AdaptiveEntropyCoefficient(stare.MethodState):
    """The entropy bonus's coefficient following a target entropy (Eq. 30: Skywork-OR1's
    EntController, TRL PR #6140's rule). At each `update` the bonus applied this step, `applied`, is
    the one the earlier steps set (a step's entropy acts from the next step, as there); then H <
    target raises the coefficient by delta, else lowers it, within [coef_min, coef_max], and enables
    the next step's bonus only while H < target.
    """

    name = "adaptive_entropy"
    STATE_KEYS = ("target_entropy", "coef_min", "coef_max", "delta", "coef", "enabled", "applied",
                  "current_entropy")

    def __init__(self, target_entropy=0.2, coef_init=0.0, coef_min=0.0, coef_max=0.005,
                 delta=1e-4):
        if not (math.isfinite(target_entropy) and 0 <= coef_min <= coef_max and delta >= 0):
            raise ValueError(f"need a finite target, 0 <= coef_min <= coef_max and delta >= 0; got "
                             f"{target_entropy=}, {coef_min=}, {coef_max=}, {delta=}")
        self.target_entropy, self.delta = float(target_entropy), float(delta)
        self.coef_min, self.coef_max = float(coef_min), float(coef_max)
        self.coef, self.enabled = float(coef_init), True  # the reference's start
        self.applied = 0.0  # the coefficient of this step's bonus

    def step(self, entropy):  # Eq. 30
        self.applied = self.coef if self.enabled else 0.0
        below = entropy < self.target_entropy
        change = self.delta if below else -self.delta
        self.coef = min(max(self.coef + change, self.coef_min), self.coef_max)
        self.enabled = below

    def metrics(self, accepted):
        return {"adaptive_entropy/update_accepted": float(accepted),
                "adaptive_entropy/coef": self.applied, "adaptive_entropy/next_coef": self.coef}

    def carried(self):
        # target, bounds and delta come from the resumed run's config
        return ("coef", "enabled", "applied", "current_entropy")


def _adaptive_entropy(cfg):
    target = cfg.loss.adaptive_entropy_target
    return AdaptiveEntropyCoefficient(
        cfg.gate.target_entropy if target is None else target, cfg.loss.adaptive_entropy_coef_init,
        cfg.loss.adaptive_entropy_coef_min, cfg.loss.adaptive_entropy_coef_max,
        cfg.loss.adaptive_entropy_delta)


# method -> the factory of the state it carries across steps, from the run's config
STATEFUL = {"entropic": _entropic_controller, "adaptive_entropy": _adaptive_entropy}


def token_selection(method, batch, cfg, states=None, generator=None):
    """What `method` changes, per token, decided on `batch` -> (selection dict of [B, T] tensors,
    metrics dict): the sets of Eqs. 7-8, 12-18, 25, STEER's weights (Eqs. 22-23), GRPODropout's
    responses (Eq. 31). On a micro-batch or the whole step (slice the result per micro-batch for
    `policy_loss(..., selection=...)`); batch["logprobs"] is used detached: in step scope pass the
    old log-probs there. STARE uses `states`' gate (none: EntropyGate()'s defaults, on).
    """
    _check_method(method)
    logprobs, advantages, mask = batch["logprobs"].detach(), batch["advantages"], batch["mask"]
    # candidate counts: when a method touches nothing, they say why (no token of the sign, too few)
    signed, valid = stare.broadcastable_advantages(advantages, logprobs), mask.bool()
    positive, negative = (valid & (signed > 0)).sum(), (valid & (signed < 0)).sum()
    if method == "stare":
        gate = (states or {}).get("gate") or stare.EntropyGate()
        weights, stats = stare.stare_weights(
            logprobs, advantages, mask, cfg.stare_variant, cfg.stare_top_ratio, gate.w, gate.m,
            gate.gate_on)
        return {"weights": weights}, {**{f"stare/{key}": value for key, value in stats.items()},
                                      "stare/positive_tokens": positive,
                                      "stare/negative_tokens": negative}
    if method == "stapo":
        spurious, threshold = stapo_spurious_mask(
            logprobs, batch["entropy"], advantages, mask, cfg.stapo_prob_threshold,
            cfg.stapo_entropy_quantile)
        return {"spurious": spurious}, {"stapo/entropy_threshold": threshold,
                                        "stapo/candidates": positive}
    if method == "lp_reg":
        k = _count_k(cfg.lp_reg_neg_ratio, negative, "floor1")  # Eq. 14; nothing unless k > 1
        regularized = lp_reg_mask(
            logprobs, batch["proxy_logprobs"], advantages, mask, cfg.lp_reg_neg_ratio)
        return {"regularized": regularized}, {"lp_reg/candidates": negative,
                                              "lp_reg/k": torch.where(k > 1, k, 0),
                                              "lp_reg/selected": regularized.sum()}
    if method == "clip_cov":
        return {"detached": clip_cov_mask(
            logprobs, batch["old_logprobs"], advantages, mask, cfg.clip_cov_ratio, cfg.clip_cov_lb,
            cfg.clip_cov_ub, cfg.clip_low, cfg.clip_high, generator)}, {}
    if method == "kl_cov":
        return {"penalized": kl_cov_mask(logprobs, advantages, mask, cfg.kl_cov_ratio)}, {}
    if method == "high_entropy":
        return {"kept": high_entropy_mask(batch["entropy"], mask, cfg.high_entropy_ratio,
                                          cfg.high_entropy_convention)}, {}
    if method == "steer":  # the weights' scale is the batch's largest |Omega|: batch-level
        sensitivity = batch["sensitivity"] if cfg.steer_estimate == "sensitivity" else None
        # H under pi_old, as the reference, also in micro scope (where `entropy` is pi_theta's)
        entropy = batch.get("old_entropy", batch["entropy"])
        omega = steer_entropy_change(logprobs, batch["old_logprobs"], advantages, entropy, mask,
                                     sensitivity)
        weights, omega_max = steer_weights(omega, mask, cfg.steer_weight_min,
                                           cfg.steer_weight_max, cfg.steer_linear)
        return {"weights": weights}, {"steer/omega_max": omega_max, "steer/weight_mean":
                                      (weights * mask).sum() / valid.sum().clamp(min=1)}
    if method == "entropic":
        high_prob = entropic_high_prob_mask(logprobs, mask, cfg.entropic_prob_threshold)
        return {"high_prob": high_prob}, {
            "entropic/high_prob_frac": high_prob.sum() / valid.sum().clamp(min=1)}
    if method == "grpo_dropout":  # whole responses: their rows, broadcast over the tokens
        kept, new_advantages = grpo_dropout(logprobs, advantages, batch["rewards"], batch["groups"],
                                            mask, cfg, generator)
        rows = torch.ones_like(mask, dtype=torch.bool)
        sequence = advantages if advantages.dim() == 1 else advantages[:, 0]
        changed = ~kept | (new_advantages != sequence.float())
        return {"kept": kept[:, None] & rows, "changed": changed[:, None] & rows,
                "advantages": new_advantages[:, None].to(logprobs.dtype) * rows}, {
            "grpo_dropout/kept_frac": kept.float().mean()}
    return {}, {}  # grpo, entropy_bonus, w_reinforce, adaptive_entropy: nothing to select


def balanced_push_selection(push, generator=None, eps=1e-12):
    """GRPODropout's choice of one group's rollouts (Eq. 31; the reference's
    select_balanced_push_zero): push [G] float64, u_k = A_k (s_k - mean s) -> kept [G] bool.

    Kept as Eq. 31 says, padded to max(1, G // 4) by zero pushes first. A group of one sign keeps
    its positive pushes, padded by zero, then by the least negative ones. All pushes zero: max(1,
    G // 4) rollouts drawn with `generator` (the reference seeds Python's random by group)."""
    size = push.numel()
    minimum = max(1, size // 4)
    values = push.tolist()
    positive = sorted((k for k in range(size) if values[k] > eps), key=lambda k: -values[k])
    negative = sorted((k for k in range(size) if values[k] < -eps), key=lambda k: -values[k])
    zero = [k for k in range(size) if abs(values[k]) <= eps]
    if len(zero) == size:
        chosen = torch.randperm(size, generator=generator)[:minimum].tolist()
    elif not positive or not negative:
        chosen = positive + zero[:max(minimum - len(positive), 0)]
        chosen += negative[:max(minimum - len(chosen), 0)]
    else:
        chosen, running = list(positive), sum(values[k] for k in positive)
        for k in negative:
            if running + values[k] <= eps:
                break
            chosen.append(k)
            running += values[k]
        chosen += zero[:max(minimum - len(chosen), 0)]
    kept = torch.zeros(size, dtype=torch.bool)
    kept[chosen] = True
    return kept


def grpo_dropout(logprobs, advantages, rewards, groups, mask, cfg, generator=None):
    """GRPODropout (Eq. 31, "balance" variant): which whole responses update, and their new
    advantages (the dropped ones': 0). logprobs [B, T] (pi_old), advantages, rewards, groups [B] (a
    group id per response), mask [B, T] -> (kept [B] bool, advantages [B]). l_k is the mean of the
    response's log-probs (grpo_dropout_basis "sum": the sum)."""
    valid = mask.to(logprobs.dtype)
    ell = (logprobs.detach() * valid).sum(-1)  # [B]
    if cfg.grpo_dropout_basis == "avg":
        ell = ell / valid.sum(-1).clamp(min=1)
    if advantages.dim() > 1:  # [B, T]: the sequence's, a masked mean as the reference reads it
        advantages = (advantages * valid).sum(-1) / valid.sum(-1).clamp(min=1)
    kept = torch.ones(len(ell), dtype=torch.bool)
    new_advantages = advantages.detach().float().clone()
    for group in torch.unique(groups).tolist():
        chosen = rows = (groups == group).nonzero().flatten()
        if cfg.grpo_dropout_drop:
            surprisal = -ell[rows].double()
            push = advantages[rows].double() * (surprisal - surprisal.mean())
            chosen = rows[balanced_push_selection(push, generator)]
            kept[rows] = False
            kept[chosen] = True
            if len(chosen) < len(rows):  # Eq. 1 over the kept responses
                new_advantages[rows] = 0.0
                new_advantages[chosen] = stare.group_advantages(
                    rewards[chosen].float(), len(chosen))
        if cfg.grpo_dropout_center:
            weights = torch.softmax(ell[chosen].float(), dim=0)
            new_advantages[chosen] -= (weights * new_advantages[chosen]).sum()
    return kept, new_advantages


# ==================================================================================================
# Policy losses beside PPO-clip: GSPO, CISPO, SAPO (per-token losses for stare.aggregate_loss)
# ==================================================================================================
# Each matches verl's function bit for bit, values and gradients, when aggregated as verl's recipe
# does (see the note after Eq. 29; tests/test_policy_losses.py).


def gspo_surrogate(logprobs, old_logprobs, advantages, mask, clip_low=3e-4, clip_high=4e-4):
    """GSPO's per-token loss (Zheng et al. 2025, arXiv 2507.18071; Eq. 27; verl's
    compute_policy_loss_gspo): PPO's clip, without dual clip, of a sequence-level,
    length-normalised ratio s_i (no +-20 clamp per token) whose gradient is s_i d log pi_{i,t} (0
    where the clamp at 10 acts). Defaults: the paper's (Sec. 5.1) and verl's recipes' clip ranges.

    logprobs [B, T] (with grad), old_logprobs, mask [B, T], advantages [B] or [B, T] ->
    (token_loss [B, T], stats as stare.clipped_surrogate's).
    """
    stare.check_clip(clip_low, clip_high)
    token_adv = stare.token_advantages(advantages, logprobs).to(logprobs.dtype)  # [B, T]
    log_ratio = logprobs - old_logprobs  # [B, T]
    seq_lengths = mask.sum(-1).clamp(min=1)  # [B], an integer count for bool masks
    seq_log_ratio = (log_ratio * mask).sum(-1) / seq_lengths  # [B]: log s_i
    # sg[log s_i] + log pi - sg[log pi]: the value log s_i, the gradient of log pi
    log_seq_ratio = logprobs - logprobs.detach() + seq_log_ratio.detach().unsqueeze(-1)  # [B, T]
    seq_ratio = torch.exp(torch.clamp(log_seq_ratio, max=10.0))  # [B, T]
    loss_unclipped = -token_adv * seq_ratio
    loss_clipped = -token_adv * torch.clamp(seq_ratio, 1 - clip_low, 1 + clip_high)
    token_loss = torch.maximum(loss_unclipped, loss_clipped)
    return token_loss, _surrogate_stats(log_ratio, mask, clipped=loss_clipped > loss_unclipped,
                                        below=(token_adv < 0) & (seq_ratio < 1 - clip_low),
                                        above=(token_adv > 0) & (seq_ratio > 1 + clip_high))


def cispo_surrogate(logprobs, old_logprobs, advantages, mask, clip_low=10.0, clip_high=0.2):
    """CISPO's per-token loss (MiniMax-M1, arXiv 2506.13585; Eq. 28; verl's
    compute_policy_loss_cispo): REINFORCE on every token, weighted by the clipped importance ratio
    with its gradient stopped; the value holds log pi itself (on-policy -A log pi). A clipped ratio
    only caps the weight. Defaults: verl's CISPO example (the paper gives no values).

    logprobs [B, T] (with grad), old_logprobs, mask [B, T], advantages [B] or [B, T] ->
    (token_loss [B, T], stats as stare.clipped_surrogate's).
    """
    stare.check_clip(clip_low, clip_high)
    token_adv = stare.token_advantages(advantages, logprobs).to(logprobs.dtype)  # [B, T]
    log_ratio = torch.clamp(logprobs - old_logprobs, -20.0, 20.0)  # [B, T]
    ratio = torch.exp(log_ratio)
    clipped_ratio = torch.clamp(ratio, 1 - clip_low, 1 + clip_high)
    token_loss = -clipped_ratio.detach() * token_adv * logprobs
    return token_loss, _surrogate_stats(log_ratio, mask, clipped=ratio != clipped_ratio,
                                        below=ratio < 1 - clip_low, above=ratio > 1 + clip_high)


def sapo_surrogate(logprobs, old_logprobs, advantages, mask, tau_pos=1.0, tau_neg=1.05):
    """SAPO's per-token loss (Gao et al. 2025, arXiv 2511.20347; Eq. 29; verl's
    compute_policy_loss_sapo): a sigmoid gate of the ratio in place of the clip, steeper (tau_neg >
    tau_pos) for A < 0; on-policy the gradient is GRPO's. tau is a tensor of the loss's dtype, as in
    verl, so that 4 / tau rounds as there. Defaults: the paper's and verl's.

    logprobs [B, T] (with grad), old_logprobs, mask [B, T], advantages [B] or [B, T] ->
    (token_loss [B, T], stats as stare.clipped_surrogate's; SAPO clips nothing: fractions 0).
    """
    if not (tau_pos > 0 and tau_neg > 0):
        raise ValueError(f"SAPO's tau_pos and tau_neg must be > 0, got {tau_pos}, {tau_neg}")
    token_adv = stare.token_advantages(advantages, logprobs).to(logprobs.dtype)  # [B, T]
    log_ratio = torch.clamp(logprobs - old_logprobs, -20.0, 20.0)  # [B, T]
    ratio = torch.exp(log_ratio)
    tau = torch.where(token_adv > 0, token_adv.new_tensor(tau_pos), token_adv.new_tensor(tau_neg))
    gate = torch.sigmoid(tau * (ratio - 1.0)) * (4.0 / tau)  # [B, T]
    token_loss = -gate * token_adv
    never = torch.zeros_like(mask, dtype=torch.bool)
    return token_loss, _surrogate_stats(log_ratio, mask, clipped=never, below=never, above=never)


def _surrogate_stats(log_ratio, mask, clipped, below, above):
    """stare.surrogate_stats without dual clip, over `mask` [B, T], with d = 0 on the padding
    (GSPO's d is unclamped: padding may be inf)."""
    valid = mask.bool()
    return stare.surrogate_stats(torch.where(valid, log_ratio.detach(), 0.0), valid, clipped,
                                 below, above)


# ==================================================================================================
# The loss
# ==================================================================================================


def loss_mask(method, mask, selection, cfg):
    """The tokens in the denominator of Eq. 3: the valid ones, except STAPO's spurious tokens
    (Eq. 12), and only the kept ones for 80/20 under lp_reg_dev (Eq. 18) and GRPODropout (its
    dropped responses leave the loss). The trainer sums this mask over the optimizer step to get
    `num_tokens`. mask [B, T] -> bool [B, T]."""
    valid = mask.bool()
    if method == "stapo":
        return valid & ~selection["spurious"]
    if method == "grpo_dropout" or (
            method == "high_entropy" and cfg.high_entropy_convention == "lp_reg_dev"):
        return valid & selection["kept"]
    return valid


def control_mask(method, mask, selection):
    """The tokens of EntroPIC's control term (Eq. 25), which it aggregates over its own count as the
    reference does: the trainer sums this mask over the step too. None for the other methods.
    mask [B, T] -> bool [B, T] or None."""
    return mask.bool() & selection["high_prob"] if method == "entropic" else None


def method_token_loss(method, batch, cfg, selection, surrogate, unclipped, token_adv, states):
    """Each method's per-token loss [B, T] and the tokens it treats unlike GRPO [B, T] bool, from
    the policy loss's token loss (Eqs. 2, 27-29), the unclipped -A r, the token advantages, its
    selection and its state (`method_states`'s): one branch per method. EntroPIC's control term is
    added after aggregation (`policy_loss`)."""
    logprobs, old_logprobs, valid = batch["logprobs"], batch["old_logprobs"], batch["mask"].bool()
    # Eq. 12: STAPO's change is in the mask, spurious tokens leave loss and denominator
    if method in ("grpo", "stapo"):
        token_loss = surrogate
        touched = selection["spurious"] if method == "stapo" else torch.zeros_like(valid)
    elif method in ("stare", "steer"):  # Eqs. 9, 23: the weights multiply the clipped token loss
        token_loss = surrogate * selection["weights"]
        touched = selection["weights"] != 1
    elif method == "lp_reg":  # Eq. 14: -A r + beta k3(log pi_proxy - log pi) where selected
        # verl's low_var_kl: the log-ratio clamped to +-20, k3 (>= 0) to at most 10: past
        # pi_proxy / pi = 13.6 the regulariser is flat and its gradient 0
        delta = torch.clamp(batch["proxy_logprobs"] - logprobs, -20.0, 20.0)
        # d/d log pi = 1 - pi_proxy / pi < 0 if pi < pi_proxy
        k3 = torch.clamp(torch.exp(delta) - delta - 1, max=10.0)
        touched = selection["regularized"]
        token_loss = torch.where(touched, unclipped + cfg.lp_reg_coef * k3, surrogate)
    elif method in ("clip_cov", "high_entropy"):  # Eq. 16: the selected tokens' loss is zeroed,
        # still counted; Eq. 18: gradient only through the high-entropy tokens
        touched = selection["detached"] if method == "clip_cov" else ~selection["kept"]
        token_loss = surrogate * ~touched
    elif method == "kl_cov":  # Eq. 17: unclipped -A r, + beta |log pi - log pi_old| on the top-Cov
        touched = selection["penalized"]
        token_loss = unclipped + cfg.kl_cov_coef * (logprobs - old_logprobs).abs() * touched
    elif method == "w_reinforce":  # Eq. 24: lambda x the loss of A > 0 tokens (= lambda x their A)
        positive = token_adv > 0
        token_loss = torch.where(positive, cfg.w_reinforce_lambda * surrogate, surrogate)
        touched = positive & (cfg.w_reinforce_lambda != 1)
    elif method == "entropic":  # Eq. 25: GRPO's loss, plus the control term below
        token_loss = surrogate
        touched = selection["high_prob"] & (_coef(states, "entropic", "coef") != 0)
    elif method == "grpo_dropout":  # Eq. 31: the selection's advantages, dropped rows masked
        token_loss, touched = surrogate, selection["changed"]
    else:  # entropy_bonus, Eq. 19: -beta H per token, H with grad; adaptive_entropy, Eq. 30: with
        # the controller's coefficient
        coef = (_coef(states, "adaptive_entropy", "applied") if method == "adaptive_entropy"
                else cfg.entropy_coef)
        token_loss = surrogate - coef * batch["entropy"]
        touched = torch.full_like(valid, coef != 0)
    return token_loss, touched


def policy_surrogate(batch, cfg):
    """The token loss of the policy loss `cfg.policy_loss` names (Eqs. 2, 27-29), before any
    method's change -> (token_loss [B, T], stats: clip fractions and KL estimates)."""
    args = (batch["logprobs"], batch["old_logprobs"], batch["advantages"])
    if cfg.policy_loss == "ppo_clip":
        return stare.clipped_surrogate(*args, cfg.clip_low, cfg.clip_high, cfg.dual_clip,
                                       mask=batch["mask"])
    if cfg.policy_loss == "gspo":
        return gspo_surrogate(*args, batch["mask"], cfg.gspo_clip_low, cfg.gspo_clip_high)
    if cfg.policy_loss == "cispo":
        return cispo_surrogate(*args, batch["mask"], cfg.cispo_clip_low, cfg.cispo_clip_high)
    if cfg.policy_loss == "sapo":
        return sapo_surrogate(*args, batch["mask"], cfg.sapo_tau_pos, cfg.sapo_tau_neg)
    raise ValueError(f"unknown policy loss {cfg.policy_loss!r}; choose from {POLICY_LOSSES}")


def policy_loss(method, batch, cfg, selection=None, states=None, counts=None, token_weights=None,
                generator=None):
    """The policy loss of `method` on `batch` -> (scalar loss to minimise, metrics of 0-dim
    tensors): the token loss of `cfg.policy_loss` (Eqs. 2, 27-29) changed by the method (Eqs. 9,
    12-19, 23, 24, 30, 31), times token_weights (Eq. 11), aggregated by Eq. 3; EntroPIC adds its
    control term (Eq. 25).

    selection: from `token_selection` (sliced to this batch); None = select within this batch.
    states: `method_states`'s (None: the gate on at its defaults, controllers' coefficients 0).
    counts: the optimizer step's "num_tokens" / "num_sequences" of `loss_mask` and
    "num_control_tokens" / "num_control_sequences" of `control_mask`, so that micro-batch losses
    add up to the full-batch loss (stare.aggregate_loss); None: this batch's own.
    token_weights: [B, T] constants multiplying every token's loss (Eq. 11's), or None.

    metrics: the policy loss's clip statistics, "touched_frac" (the fraction of valid tokens whose
    loss term differs from GRPO's: `method_token_loss`'s `touched`) and, when the selection is made
    here, its own metrics (stare/..., stapo/...).
    """
    _check_method(method)
    refused = refused_combination(method, cfg.policy_loss)
    if refused:
        raise ValueError(refused)
    metrics, states, counts = {}, states or {}, counts or {}
    if selection is None:
        selection, metrics = token_selection(method, batch, cfg, states=states,
                                             generator=generator)
    if "advantages" in selection:  # a method that reassigns the advantages (GRPODropout)
        batch = {**batch, "advantages": selection["advantages"]}
    logprobs, old_logprobs, mask = batch["logprobs"], batch["old_logprobs"], batch["mask"]
    valid = mask.bool()
    token_adv = stare.token_advantages(batch["advantages"], logprobs).to(logprobs.dtype)  # [B, T]
    surrogate, surrogate_stats = policy_surrogate(batch, cfg)
    ratio = torch.exp(torch.clamp(logprobs - old_logprobs, -20.0, 20.0))  # [B, T]
    # -A r without clipping: Lp-Reg's regularised tokens and KL-Cov's base loss
    unclipped = -token_adv * ratio

    # ----------------------------------------------- ALGO LOGIC: one branch per method -----------
    token_loss, touched = method_token_loss(method, batch, cfg, selection, surrogate, unclipped,
                                            token_adv, states)

    if token_weights is not None:
        token_loss = token_loss * token_weights.detach()
    loss = stare.aggregate_loss(
        token_loss, loss_mask(method, mask, selection, cfg), cfg.agg_mode,
        counts.get("num_tokens"), counts.get("num_sequences"), cfg.loss_scale_factor)
    if method == "entropic":
        # Eq. 25: alpha x the mean of -r |A| over the high-probability tokens, aggregated over their
        # own count; the ratio unclipped, no importance weight (both as the reference)
        control = stare.aggregate_loss(
            -token_adv.abs() * ratio, control_mask(method, mask, selection),
            cfg.agg_mode, counts.get("num_control_tokens"), counts.get("num_control_sequences"),
            cfg.loss_scale_factor)
        loss = loss + _coef(states, "entropic", "coef") * control
    metrics.update(surrogate_stats)
    metrics["touched_frac"] = (touched & valid).sum() / valid.sum().clamp(min=1)
    return loss, metrics


def _coef(states, name, attribute):
    """A controller's coefficient; 0 (GRPO's loss) when the state is not given."""
    state = states.get(name)
    return getattr(state, attribute) if state is not None else 0.0


def _check_method(method):
    if method not in METHODS:
        close = difflib.get_close_matches(str(method), METHODS, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ValueError(f"unknown loss method {method!r}{hint}: expected one of {METHODS}")
