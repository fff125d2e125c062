"""stare.py: STARE's math and the GRPO objective as pure tensor functions.

STARE (Surprisal-guided Token-level Advantage Reweighting, Luo et al. 2026) keeps a GRPO policy's
entropy from collapsing: it up-weights the most surprising positive-advantage tokens (L+, w > 1;
variant C2 also down-weights the most surprising negative-advantage ones, L-, m < 1) while a gate
sees the batch entropy below a target. "Eq. N" refers to docs/method.md, which also lists where
this code departs from the reference (hp-luo/STARE) and why.

Read top to bottom:
  1. log-probs and entropy from logits, chunked over rows                          Eq. 4
  2. first-order entropy dynamics: sensitivity S, the critical surprisal s0        Eq. 5
  3. STARE proper: top-surprisal selection, the weights omega, the entropy gate    Eqs. 7, 8, 10
  4. the GRPO objective: group advantages, the clipped surrogate, aggregation      Eqs. 1-3
  5. diagnostics: per-quadrant predicted entropy change                            Eq. 6
  6. shared helpers (row chunks, advantages, exact top-k), also used by baselines.py

    weights, stats = stare.stare_weights(old_logprobs, advantages, mask, "O1", top_ratio=0.1, w=1.1)
    loss = stare.aggregate_loss(token_loss * weights, mask, "token-mean", num_tokens=step_tokens)

Pure functions of tensors: no I/O, no torch.distributed, no config objects, no global state. The
selections never synchronise host and device (no `.item()`, no data-dependent branches). Shapes:
B sequences, T response positions, V vocabulary, N = B*T flattened rows.
"""

import math

import torch

# log pi is clamped here so that a -inf logit gives 0 * log 0 = 0
_FLOAT32_MIN = torch.finfo(torch.float32).min

# One float32 chunk of logits stays under this many bytes (≈220 rows at Qwen2.5's V = 151,936);
# with ~3 float32 temporaries per chunk the extra memory stays far below one full copy.
DEFAULT_CHUNK_BYTES = 128 * 2**20


# ==================================================================================================
# 1. Log-probs and entropy from logits (chunked)
# ==================================================================================================


class _ChunkedLogprobEntropy(torch.autograd.Function):
    """log pi(token) and H(pi) for pi = softmax(logits / T), row-chunked in forward *and* backward.

    Autograd through a plain chunk loop would save every chunk's float32 copy for backward, i.e. the
    whole [N, V] in float32 after all. This function saves only the input logits (held by the model
    anyway) and two floats per row, and recomputes each chunk's softmax in backward.
    """

    @staticmethod
    def forward(ctx, logits_2d, tokens_1d, temperature, chunk_rows):
        # logits_2d [N, V], tokens_1d [N] (int64) -> logprobs, entropy, lse_all: [N] float32
        logprobs, entropy, lse_all = (torch.empty(
            logits_2d.shape[0], dtype=torch.float32, device=logits_2d.device) for _ in range(3))
        for start, end, x in tempered_chunks(logits_2d, temperature, chunk_rows):
            lse = torch.logsumexp(x, dim=-1)  # [n]
            log_pi = (x - lse[:, None]).clamp_(min=_FLOAT32_MIN)  # [n, V]
            logprobs[start:end] = log_pi.gather(-1, tokens_1d[start:end, None]).squeeze(-1)
            # H = -sum p log p, not lse - sum p x: that cancels catastrophically for peaked rows
            entropy[start:end] = -(log_pi.exp().mul_(log_pi)).sum(-1)
            lse_all[start:end] = lse
        ctx.save_for_backward(logits_2d, tokens_1d, lse_all, entropy)
        ctx.temperature, ctx.chunk_rows = temperature, chunk_rows
        ctx.set_materialize_grads(False)
        return logprobs, entropy

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_logprobs, grad_entropy):
        # grad_logprobs, grad_entropy: [N] or None (an output that was not used)
        logits_2d, tokens_1d, lse_all, entropy = ctx.saved_tensors
        grad_logits = torch.empty_like(logits_2d)  # [N, V]
        for start, end, x in tempered_chunks(logits_2d, ctx.temperature, ctx.chunk_rows):
            log_pi = (x - lse_all[start:end, None]).clamp_(min=_FLOAT32_MIN)  # [n, V]
            pi = log_pi.exp()  # [n, V]
            # d log pi_k / dx = e_k - pi;  dH/dx = -pi * (log pi + H)   (x = logits / T)
            coef = torch.zeros_like(pi)  # [n, V]: dL/dx without the one-hot term
            if grad_logprobs is not None:
                coef.sub_(pi * grad_logprobs[start:end, None])
            if grad_entropy is not None:
                coef.sub_(pi * (log_pi + entropy[start:end, None]) * grad_entropy[start:end, None])
            if grad_logprobs is not None:
                coef.scatter_add_(
                    -1, tokens_1d[start:end, None], grad_logprobs[start:end, None].float())
            grad_logits[start:end] = (coef / ctx.temperature).to(grad_logits.dtype)
        return grad_logits, None, None, None


def token_logprobs_and_entropy(logits, tokens, temperature=1.0, chunk_size=None):
    """log pi(token) and the full next-token entropy H of pi = softmax(logits / temperature), Eq. 4.

    logits [..., T, V] (any float dtype; position t scores token t), tokens [..., T] valid ids (pad
    with any id and mask later) -> (logprobs [..., T], entropy [..., T]), both float32, both
    differentiable w.r.t. the logits (an entropy bonus needs H's gradient).

    `chunk_size` rows at a time (default DEFAULT_CHUNK_BYTES) in forward and backward, never a
    float32 copy of the whole [N, V]; on CUDA one Triton pass per row (kernels.py), equal up to
    float32 rounding. Pass contiguous logits: the flattening reshape copies a strided view such as
    logits[:, :-1] whole, and backward keeps that copy. A -inf logit is fine (0 log 0 = 0).
    """
    import kernels

    logits_2d, tokens_1d = flatten_logits(logits, tokens, temperature)
    if kernels.supported(logits_2d):
        logprobs, entropy = kernels.LogprobEntropy.apply(logits_2d, tokens_1d, float(temperature))
    else:
        chunk_rows = rows_per_chunk(logits_2d.shape[0], logits_2d.shape[1], chunk_size)
        logprobs, entropy = _ChunkedLogprobEntropy.apply(
            logits_2d, tokens_1d, float(temperature), chunk_rows)
    return logprobs.view(tokens.shape), entropy.view(tokens.shape)


# ==================================================================================================
# 2. First-order entropy dynamics (Eq. 5)
# ==================================================================================================
# A step eta*A*(e_k - pi) of the tempered logits changes H by eta * A * S(pi, k), to first order:
#     S(pi, k) = pi_k (s_k - H) - B,   B = sum_a pi_a^2 (s_a - H) <= 0,   s = -log pi,
# negative at the mode, zero at one critical surprisal s0 <= H: reinforcing a token with s_k > s0
# raises the entropy, one with s_k < s0 lowers it; the signs flip for A < 0.


@torch.no_grad()
def _entropy_geometry(logits, tokens, temperature, chunk_size):
    """Per row of pi = softmax(logits / T): log pi(token) (if tokens given), H, B = sum_a pi_a^2
    (s_a - H), and the smallest surprisal s_min = -log max_a pi_a. logits [..., T, V] -> four
    float32 tensors [N]. One Triton pass per row on CUDA (kernels.py), row chunks elsewhere."""
    import kernels

    logits_2d, tokens_1d = flatten_logits(logits, tokens, temperature)
    if kernels.supported(logits_2d):
        logprobs, entropy, _, cov_b, s_min = kernels.row_stats(
            logits_2d, tokens_1d, float(temperature), True)
        return logprobs, entropy, cov_b, s_min
    chunk_rows = rows_per_chunk(logits_2d.shape[0], logits_2d.shape[1], chunk_size)
    num_rows, device = logits_2d.shape[0], logits_2d.device
    # [N] float32 each
    logprobs, entropy, cov_b, s_min = (torch.empty(num_rows, device=device) for _ in range(4))
    for start, end, x in tempered_chunks(logits_2d, temperature, chunk_rows):
        lse = torch.logsumexp(x, dim=-1)  # [n]
        log_pi = (x - lse[:, None]).clamp_(min=_FLOAT32_MIN)  # [n, V]
        if tokens_1d is not None:
            logprobs[start:end] = log_pi.gather(-1, tokens_1d[start:end, None]).squeeze(-1)
        s_min[start:end] = lse - x.amax(-1)
        pi = log_pi.exp()  # [n, V]
        h = -(pi * log_pi).sum(-1)  # [n]
        entropy[start:end] = h
        # B = sum pi^2 (s - H) = -sum pi^2 (log pi + H), in place: log_pi and pi are done with
        cov_b[start:end] = -(pi.square_().mul_(log_pi.add_(h[:, None]))).sum(-1)
    return logprobs, entropy, cov_b, s_min


def entropy_sensitivity(logits, tokens, temperature=1.0, chunk_size=None):
    """S: the first-order entropy change per unit eta*A of a policy-gradient step on the sampled
    token, in the tempered logits z / T (Eq. 5; in the raw logits it is S / T^2).

    S = sum_a pi_a^2 (log pi_a + H) - pi_k (log pi_k + H),  pi = softmax(logits / temperature), k =
    token. logits [..., T, V], tokens [..., T] -> S [..., T] float32. No gradient. S > 0:
    reinforcing the token (A > 0) raises the entropy.
    """
    logprobs, entropy, cov_b, _ = _entropy_geometry(logits, tokens, temperature, chunk_size)
    sensitivity = logprobs.exp() * (-logprobs - entropy) - cov_b  # pi_k (s_k - H) - B, [N]
    return sensitivity.view(tokens.shape)


def critical_surprisal(logits, temperature=1.0, chunk_size=None, iterations=60):
    """s0: the surprisal at which S changes sign, the root of g(s) = e^{-s} (s - H) - B (Eq. 5).

    logits [..., T, V] -> s0 [..., T] float32. g is increasing on [0, H + 1], negative at s_min (the
    mode) and -B >= 0 at H, so bisection on [s_min, H] finds the unique root; 60 halvings reach
    float64 resolution. Diagnostics only: the trainer's quadrants use the sign of S.
    """
    _, entropy, cov_b, s_min = _entropy_geometry(logits, None, temperature, chunk_size)
    h, b = entropy.double(), cov_b.double()  # [N]
    lo, hi = torch.minimum(s_min.double(), h), h.clone()  # [N]
    for _ in range(iterations):
        mid = 0.5 * (lo + hi)
        below = torch.exp(-mid) * (mid - h) - b < 0  # g(mid) < 0: the root is above mid
        lo, hi = torch.where(below, mid, lo), torch.where(below, hi, mid)
    return (0.5 * (lo + hi)).to(torch.float32).view(logits.shape[:-1])


def quadrant_masks(advantages, surprisal, mask, threshold):
    """The advantage-sign x surprisal partition of the valid tokens (Eq. 6): (pos_high, pos_low,
    neg_high, neg_low), "high" meaning surprisal >= threshold; tokens with A = 0 are in none.

    advantages [B] or [B, T]; surprisal [B, T] (= -log pi); mask [B, T]; threshold a scalar or a
    tensor broadcastable to [B, T] (e.g. s0) -> four bool [B, T].
    """
    token_adv = token_advantages(advantages, surprisal)  # [B, T]
    valid = mask.bool()
    high = surprisal >= threshold
    pos, neg = valid & (token_adv > 0), valid & (token_adv < 0)
    return pos & high, pos & ~high, neg & high, neg & ~high


# ==================================================================================================
# 3. STARE: top-surprisal selection, token weights, the entropy gate (Eqs. 7, 8, 10)
# ==================================================================================================


def select_top_surprisal(surprisal, candidates, top_ratio):
    """Among the n candidate tokens, exactly k = ceil(top_ratio * n) with the highest surprisal
    (Eq. 7); k >= 1 when n > 0 and top_ratio > 0.

    surprisal [...] float (= -log pi; slightly negative counts as 0), candidates [...] bool of the
    same, any, shape -> bool mask [...]. Ties go by position; n and k stay on the device
    (`select_top_k`), so there is no host-device sync.
    """
    if not 0.0 <= top_ratio <= 1.0:  # also rejects NaN
        raise ValueError(f"top_ratio must be in [0, 1], got {top_ratio}")
    if top_ratio == 0:
        return torch.zeros(candidates.shape, dtype=torch.bool, device=candidates.device)
    n = candidates.sum(dtype=torch.int32)  # 0-dim, on the device
    k = torch.ceil(top_ratio * n.double() - 1e-9).clamp(min=1)  # 0-dim; select_top_k clamps it to n
    return select_top_k(surprisal, candidates, k)


def stare_weights(logprobs, advantages, mask, variant="O1", top_ratio=0.1, w=1.1, m=0.9,
                  gate_on=True):
    """omega, STARE's token weights (Eq. 8): w on L+, m on L- (C2 only), 1 elsewhere; all ones
    with the gate off. L+ / L-: the top_ratio most surprising valid tokens with A > 0 / < 0 (Eq. 7).

    logprobs [B, T] (of the sampled tokens; detached here), advantages [B] or [B, T], mask [B, T] ->
    (weights [B, T] float32, stats dict of 0-dim tensors). gate_on: a Python bool or a bool tensor
    (no sync either way); the selection and its stats are computed with the gate off too.
    """
    variant = variant.upper()
    if variant not in ("O1", "C2"):
        raise ValueError(f"unknown STARE variant {variant!r}: expected 'O1' or 'C2'")
    surprisal = -logprobs.detach().float()  # [B, T]
    advantages = broadcastable_advantages(advantages, surprisal)  # [B, 1] or [B, T]
    valid = mask.bool()  # [B, T]
    pos_candidates = valid & (advantages > 0)  # [B, T]
    neg_candidates = valid & (advantages < 0)
    pos_selected = select_top_surprisal(surprisal, pos_candidates, top_ratio)  # L+, [B, T]
    # 0-dim 0/1; non_blocking: a CPU flag must not stall the GPU stream
    if isinstance(gate_on, torch.Tensor):
        gate = gate_on.to(device=surprisal.device, dtype=torch.float32, non_blocking=True)
    else:  # torch.full makes it on the device; torch.tensor(x, device=cuda) is a blocking copy
        gate = torch.full((), float(bool(gate_on)), device=surprisal.device)
    # omega = 1 + gate * ((w - 1) [L+] + (m - 1) [L-]): arithmetic on masks, cheaper than where
    weights = pos_selected.float().mul_((w - 1.0) * gate)  # [B, T] float32
    if variant == "C2":
        neg_selected = select_top_surprisal(surprisal, neg_candidates, top_ratio)  # L-
        weights.add_(neg_selected.float().mul_((m - 1.0) * gate))
        num_neg_selected = neg_selected.sum(dtype=torch.int32)
    else:
        num_neg_selected = torch.zeros((), dtype=torch.int32, device=weights.device)
    weights.add_(1.0)

    # the mean weight follows from the counts, without another pass
    num_valid = valid.sum(dtype=torch.int32).clamp(min=1).float()
    pos_selected_frac = pos_selected.sum(dtype=torch.int32) / num_valid
    neg_selected_frac = num_neg_selected / num_valid
    mean_weight = 1.0 + ((w - 1.0) * pos_selected_frac + (m - 1.0) * neg_selected_frac) * gate
    # fractions of the valid tokens; the mean weight over them (1 when the gate is off)
    return weights, {"pos_candidate_frac": pos_candidates.sum(dtype=torch.int32) / num_valid,
                     "neg_candidate_frac": neg_candidates.sum(dtype=torch.int32) / num_valid,
                     "pos_selected_frac": pos_selected_frac, "neg_selected_frac": neg_selected_frac,
                     "mean_weight": mean_weight, "gate_on": gate.float()}


class MethodState:
    """What a method that carries state from step to step implements (STARE's gate, EntroPIC's
    controller; baselines.STATEFUL lists them): the trainer calls `update` once per optimizer step,
    before the update, with the step's token-mean entropy under pi_old over all ranks, logs
    `metrics(accepted)`, checkpoints `state_dict()` under `name` and, on resume, `resume(saved)`
    restores the keys of `carried()` (the rest comes from the resumed run's config). A subclass
    sets `name`, `STATE_KEYS` (its attributes, saved) and `ADDED_KEYS` (keys added after
    checkpoints were written -> the value an older checkpoint means), and defines `step(entropy)`
    (the update rule, for a finite entropy), `metrics(accepted)` -> {"prefix/name": float} and
    `carried()` -> the STATE_KEYS a resume restores."""

    name = ""
    STATE_KEYS = ()
    ADDED_KEYS = {}
    current_entropy = float("nan")  # last accepted batch entropy

    def update(self, batch_entropy):
        """Feed the batch-mean entropy (float or 0-dim tensor) -> whether it was accepted: a
        non-finite one leaves the state unchanged; a finite one becomes `current_entropy`."""
        entropy = float(batch_entropy)  # one host read per optimizer step
        if not math.isfinite(entropy):
            return False
        self.current_entropy = entropy
        self.step(entropy)
        return True

    def state_dict(self):
        return {key: getattr(self, key) for key in self.STATE_KEYS}

    def load_state_dict(self, state):
        state = {**self.ADDED_KEYS, **state}
        missing, unknown = set(self.STATE_KEYS) - set(state), set(state) - set(self.STATE_KEYS)
        if missing or unknown:
            raise KeyError(f"{type(self).__name__} state: missing keys {sorted(missing)}, unknown "
                           f"keys {sorted(unknown)}")
        for key in self.STATE_KEYS:
            setattr(self, key, state[key])

    def resume(self, saved):
        """This run's state with the carried keys of a checkpoint's `saved` state."""
        saved = {**self.ADDED_KEYS, **saved}
        self.load_state_dict({**self.state_dict(), **{key: saved[key] for key in self.carried()}})

    def __repr__(self):
        items = self.state_dict().items()
        return f"{type(self).__name__}(" + ", ".join(f"{k}={v!r}" for k, v in items) + ")"


class EntropyGate(MethodState):
    """The closed-loop entropy controller of STARE (Eq. 10; the reference's STAREController).

    After `update`, `gate_on` says whether to reweight this step (H < target, strict) and `w`, `m`
    are the weights to use. With `adaptive`, w and m move by alpha a step towards stronger
    reweighting while H < target and back towards 1 while H > target, within [1, w_max] and
    [m_min, 1], gate on or off, as in the reference.
    """

    def __init__(self, target_entropy=0.3, w=1.1, m=0.9, adaptive=False, alpha=0.01, w_max=1.5,
                 m_min=0.5):
        if not math.isfinite(target_entropy):
            raise ValueError(f"target_entropy must be finite, got {target_entropy}")
        if not (alpha >= 0 and w_max >= 1 and 0 <= m_min <= 1):
            raise ValueError(
                f"need alpha >= 0, w_max >= 1, 0 <= m_min <= 1; got {alpha=}, {w_max=}, {m_min=}")
        self.target_entropy = float(target_entropy)
        self.w, self.m = float(w), float(m)
        self.adaptive, self.alpha = bool(adaptive), float(alpha)
        self.w_max, self.m_min = float(w_max), float(m_min)
        self.gate_on = True  # the reference starts with the gate on

    def step(self, entropy):
        self.gate_on = entropy < self.target_entropy
        if self.adaptive and self.alpha != 0.0:
            # sign(H_tgt - H)
            direction = float((self.target_entropy > entropy) - (self.target_entropy < entropy))
            self.w = min(max(self.w + self.alpha * direction, 1.0), self.w_max)
            self.m = min(max(self.m - self.alpha * direction, self.m_min), 1.0)

    name = "gate"
    STATE_KEYS = ("target_entropy", "w", "m", "adaptive", "alpha", "w_max", "m_min", "gate_on",
                  "current_entropy")

    def metrics(self, accepted):
        return {"stare/gate_update_accepted": float(accepted), "stare/gate_on": float(self.gate_on),
                "stare/w": self.w, "stare/m": self.m}

    def carried(self):
        # its settings come from the resumed run's config; w and m too, unless they adapt
        return ("gate_on", "current_entropy") + (("w", "m") if self.adaptive else ())


# ==================================================================================================
# 4. The GRPO objective (Eqs. 1-3)
# ==================================================================================================


def group_advantages(rewards, group_size, normalize_std=True, eps=1e-6):
    """GRPO advantages (Eq. 1): A_i = (r_i - mean_g) / (std_g + eps) within each group.

    rewards [B] float, in contiguous groups of `group_size` responses to the same prompt ->
    advantages [B] float32. std unbiased (n - 1), as verl's torch.std; normalize_std=False: Dr.GRPO.
    Equal rewards give exactly 0 (not rounding noise / eps); a group of size 1 has no baseline:
    like verl, mean = 0 and std = 1, so A = r / (1 + eps).
    """
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D [B], got shape {tuple(rewards.shape)}")
    if group_size < 1 or rewards.numel() % group_size != 0:
        raise ValueError(
            f"{rewards.numel()} rewards do not split into groups of group_size={group_size}")
    grouped = rewards.float().view(-1, group_size)  # [num_groups, G]
    if group_size == 1:
        return (grouped / (1.0 + eps) if normalize_std else grouped).view(-1)
    centred = grouped - grouped.mean(dim=1, keepdim=True)  # [num_groups, G]
    advantages = centred / (grouped.std(dim=1, keepdim=True) + eps) if normalize_std else centred
    # [num_groups, 1]
    all_equal = grouped.amax(dim=1, keepdim=True) == grouped.amin(dim=1, keepdim=True)
    return torch.where(all_equal, torch.zeros_like(advantages), advantages).view(-1)


def clipped_surrogate(logprobs, old_logprobs, advantages, clip_low=0.2, clip_high=0.28,
                      dual_clip=None, mask=None):
    """The per-token PPO/GRPO loss to minimise, with clip-higher and optional dual clip (Eq. 2).

    logprobs [B, T] (current policy, with grad), old_logprobs [B, T] (behaviour policy), advantages
    [B] or [B, T] -> (token_loss [B, T], `surrogate_stats` over `mask` [B, T] if given, else over
    all tokens). The dual clip c = dual_clip > 1 bounds the loss of very off-policy A < 0 tokens;
    verl always applies it (c = 3; 10 in the STARE and DAPO scripts), here only when given.
    """
    check_clip(clip_low, clip_high)
    if dual_clip is not None and not dual_clip > 1.0:
        raise ValueError(f"dual_clip must be > 1 (or None), got {dual_clip}")
    token_adv = token_advantages(advantages, logprobs).to(logprobs.dtype)  # [B, T]
    log_ratio = torch.clamp(logprobs - old_logprobs, -20.0, 20.0)  # [B, T]
    ratio = torch.exp(log_ratio)
    loss_unclipped = -token_adv * ratio
    loss_clipped = -token_adv * torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    token_loss = torch.maximum(loss_unclipped, loss_clipped)
    dual_bounded = None
    if dual_clip is not None:
        dual_bounded = (token_adv < 0) & (token_loss > -token_adv * dual_clip)
        token_loss = torch.where(
            token_adv < 0, torch.minimum(token_loss, -token_adv * dual_clip), token_loss)
    valid = torch.ones_like(log_ratio, dtype=torch.bool) if mask is None else mask.bool()
    return token_loss, surrogate_stats(log_ratio, valid, loss_clipped > loss_unclipped,
                                       (token_adv < 0) & (ratio < 1.0 - clip_low),
                                       (token_adv > 0) & (ratio > 1.0 + clip_high), dual_bounded)


def check_clip(clip_low, clip_high):
    """Reject a clip range not > 0 on both sides (the clipped policy losses, Eqs. 2, 27, 28)."""
    if not (clip_low > 0 and clip_high > 0):
        raise ValueError(f"clip_low and clip_high must be > 0, got {clip_low}, {clip_high}")


@torch.no_grad()
def surrogate_stats(log_ratio, valid, clipped, below, above, dual=None):
    """A policy loss's logged statistics over the `valid` tokens (Eq. 2): the fractions whose clip
    acts (clip_frac), whose ratio lies below / above the band where that matters (clip_low_frac /
    clip_high_frac; not verl's pg_clipfrac_lower, which is dual_clip_frac, 0 without `dual`), and
    with d = log_ratio, approx_kl = mean -d (verl's ppo_kl) and approx_kl_k3 = mean e^d - 1 - d
    (Schulman's low-variance KL(old || new)). All [B, T] -> dict of 0-dim tensors. No grad."""
    num_valid = valid.sum().clamp(min=1).float()

    def frac(flags):
        return (flags & valid).sum() / num_valid

    d = log_ratio.detach()
    return {"clip_frac": frac(clipped), "clip_low_frac": frac(below), "clip_high_frac": frac(above),
            "dual_clip_frac": torch.zeros((), device=d.device) if dual is None else frac(dual),
            "approx_kl": (-d * valid).sum() / num_valid,
            "approx_kl_k3": ((torch.expm1(d) - d) * valid).sum() / num_valid}


LOSS_AGG_MODES = (
    "token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")


def aggregate_loss(token_loss, mask, mode="token-mean", num_tokens=None, num_sequences=None,
                   loss_scale_factor=None):
    """Reduce per-token losses [B, T] over `mask` [B, T] to a scalar by one of LOSS_AGG_MODES
    (Eq. 3); seq-mean-token-sum-norm divides by `loss_scale_factor` (default T: pass a constant,
    e.g. the max response length, so it does not vary with each micro-batch's padded width).

    N_tok and N_seq (sequences with >= 1 valid token) default to this tensor's counts. Pass
    `num_tokens` / `num_sequences` of the whole optimizer step (all micro-batches, all ranks): the
    micro-batches' shares, and their gradients, then add up exactly to the full-batch value (under
    data parallelism the caller multiplies by the world size, as gradients are averaged). An empty
    selection gives 0, not NaN. Sums and result are float32 for any loss dtype (bf16 holds 257 as
    256).
    """
    if mode not in LOSS_AGG_MODES:
        raise ValueError(
            f"unknown loss aggregation mode {mode!r}: expected one of {LOSS_AGG_MODES}")
    valid = mask.to(torch.float32)  # [B, T]
    masked_loss = token_loss.float() * valid  # [B, T]: sums in float32 whatever the loss dtype
    if mode == "token-mean":
        return _divide_by_count(
            masked_loss.sum(), valid.sum() if num_tokens is None else num_tokens)

    tokens_per_seq = valid.sum(-1)  # [B]
    seq_loss = masked_loss.sum(-1)  # [B]
    if mode == "seq-mean-token-mean":
        seq_loss = seq_loss / tokens_per_seq.clamp(min=1)
    elif mode == "seq-mean-token-sum-norm":
        seq_loss = seq_loss / float(
            token_loss.shape[-1] if loss_scale_factor is None else loss_scale_factor)
    return _divide_by_count(
        seq_loss.sum(), (tokens_per_seq > 0).sum() if num_sequences is None else num_sequences)


# ==================================================================================================
# 5. Diagnostics: which quadrant drives the entropy? (Eq. 6)
# ==================================================================================================

QUADRANTS = ("pos_high", "pos_low", "neg_high", "neg_low")


def entropy_dynamics(advantages, sensitivity, mask, weights=None, num_tokens=None):
    """Per-quadrant token fractions and predicted first-order entropy change, per unit eta, of one
    token-mean update with weights omega (Eq. 6).

    advantages [B] or [B, T], sensitivity S [B, T] (`entropy_sensitivity`), mask [B, T], optional
    STARE weights omega [B, T] -> dict of 0-dim float32 tensors, for q in QUADRANTS:
      "{q}/frac"  fraction of valid tokens in quadrant q
      "{q}/dH"    sum_{tokens in q} omega A S / N_tok
      "total/dH"  the sum over all valid tokens (A = 0 tokens contribute nothing)
    "high" is s >= s0, the same as S >= 0 (Eq. 5), so no s0 is computed. Pass num_tokens = the
    step's valid-token count so that micro-batch values add up to the full-batch ones.
    """
    token_adv = token_advantages(advantages, sensitivity).float()  # [B, T]
    valid = mask.bool()
    contribution = token_adv * sensitivity.float()  # [B, T]
    if weights is not None:
        contribution = contribution * weights.float()
    contribution = contribution * valid
    count = valid.sum() if num_tokens is None else num_tokens
    quadrants = quadrant_masks(token_adv, sensitivity, mask, 0.0)  # S >= 0 <=> s >= s0
    stats = {}
    for name, in_quadrant in zip(QUADRANTS, quadrants):
        stats[f"{name}/frac"] = _divide_by_count(in_quadrant.sum().float(), count)
        stats[f"{name}/dH"] = _divide_by_count((contribution * in_quadrant).sum(), count)
    stats["total/dH"] = _divide_by_count(contribution.sum(), count)
    return stats


# ==================================================================================================
# 6. Shared helpers: row chunks, advantage broadcasting, exact top-k (baselines.py uses them too)
# ==================================================================================================


def rows_per_chunk(num_rows, vocab_size, chunk_size):
    """Rows per chunk: `chunk_size` if given, else as many as fit DEFAULT_CHUNK_BYTES of float32."""
    if chunk_size is None:
        chunk_size = DEFAULT_CHUNK_BYTES // (4 * max(vocab_size, 1))
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    return max(1, min(int(chunk_size), num_rows))


def tempered_chunks(logits_2d, temperature, chunk_rows):
    """Yield (start, end, x), x = logits_2d[start:end] / temperature in float32, a chunk at a time.

    logits_2d: [N, V] any float dtype -> x: [n, V] float32 (a view of the input when it is float32
    and T = 1, so callers must not modify x in place).
    """
    for start in range(0, logits_2d.shape[0], chunk_rows):
        end = min(start + chunk_rows, logits_2d.shape[0])
        x = logits_2d[start:end].to(torch.float32)  # [n, V]
        if temperature != 1.0:
            x = x / temperature
        yield start, end, x


def flatten_logits(logits, tokens, temperature=1.0):
    """Check temperature and shapes; logits [..., T, V] -> [N, V], tokens [..., T] -> [N] int64."""
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if not torch.is_floating_point(logits):
        raise TypeError(f"logits must be a float tensor, got {logits.dtype}")
    if tokens is not None and tuple(logits.shape[:-1]) != tuple(tokens.shape):
        raise ValueError(
            f"logits {tuple(logits.shape)} must be tokens {tuple(tokens.shape)} plus a vocab dim")
    logits_2d = logits.reshape(-1, logits.shape[-1])  # a view when contiguous
    tokens_1d = None if tokens is None else tokens.reshape(-1).to(torch.long)
    return logits_2d, tokens_1d


def broadcastable_advantages(advantages, like):
    """Sequence advantages [B] -> [B, 1], so they broadcast against tokens `like` [B, T]; [B, T]
    pass through. (Comparisons on [B, 1] cost B operations instead of B*T.)"""
    if advantages.dim() == like.dim() - 1:
        advantages = advantages.unsqueeze(-1)  # [B, 1]
    if advantages.dim() != like.dim() or any(
        a not in (1, t) for a, t in zip(advantages.shape, like.shape)):
        raise ValueError(f"advantages {tuple(advantages.shape)} must be [B] or [B, T] for tokens "
                         f"{tuple(like.shape)}")
    return advantages


def token_advantages(advantages, like):
    """Advantages [B] or [B, T] broadcast to the token shape of `like` [B, T] (a view, no copy)."""
    return torch.broadcast_to(broadcastable_advantages(advantages, like), like.shape)


def select_top_k(values, candidates, k, signed=False):
    """Among the candidates, exactly min(k, n) with the largest values; ties broken by position
    (Eqs. 7, 14, 16-18).

    values [...] float, >= 0 (negative values count as 0, NaN as +inf; signed=True: every float32 in
    its own order, negatives included, -NaN lowest and NaN highest), candidates [...] bool of the
    same shape (any shape), k an int or a 0-dim integer tensor (it may live on the device) -> bool
    mask [...]. n = number of candidates; of equal values at the k-th place the first ones win.

    No host-device sync and no sort: the k-th largest value is found by radix select. Non-negative
    float32 numbers order like their bit patterns read as integers, so one histogram of the top 16
    bits finds the bucket of the k-th value, and one histogram of the low 16 bits inside that bucket
    finds the value itself: O(N) work in about fifteen int32 kernels.
    """
    if values.shape != candidates.shape:
        raise ValueError(
            f"values {tuple(values.shape)} and candidates {tuple(candidates.shape)} differ")
    if candidates.numel() == 0:
        return torch.zeros(candidates.shape, dtype=torch.bool, device=candidates.device)
    flat_candidates = candidates.reshape(-1)  # [N] bool
    if not isinstance(k, torch.Tensor):
        # made on the device: no copy
        k = torch.full((), int(k), dtype=torch.int32, device=candidates.device)
    k = k.to(torch.int32).clamp(min=0).clamp(max=flat_candidates.sum(dtype=torch.int32))  # 0-dim

    bits = values.reshape(-1).float().view(torch.int32)  # [N]
    if signed:  # [N] int64 keys in [0, 2^32) ordered as the floats: negatives' bits flipped, offset
        key, high_digits = (bits ^ ((bits >> 31) & 0x7FFFFFFF)).long() + 2**31, 1 << 16
    else:  # [N] the bit pattern of a float >= 0; sign-bit patterns -> 0, NaN patterns -> +inf
        key, high_digits = bits.clamp(0, 0x7F800000), 1 << 15
    in_play = flat_candidates.int()  # [N] 1 for candidates
    # pass 1: the top 16 bits (15 in use unless signed); bin = bits + 1, non-candidates in bin 0
    high_bins = ((key >> 16) + 1) * in_play
    high, above_high = _kth_largest_digit(high_bins, high_digits, k)
    # pass 2: the low 16 bits of the candidates in that bucket; lower buckets land in bin 0, higher
    # ones past the end
    low_bins = (key - ((high << 16) - 1)).clamp_(0, (1 << 16) + 1) * in_play
    low, above_low = _kth_largest_digit(low_bins, 1 << 16, k - above_high)
    kth_key = (high << 16) | low  # 0-dim: the bit pattern of the k-th largest value

    # [N]: above_high + above_low elements (none if k = 0)
    selected = (key > kth_key) & flat_candidates
    # [N]: take the first ones, in order, to reach exactly k
    ties = (key == kth_key) & flat_candidates
    selected |= ties & (ties.cumsum(0, dtype=torch.int32) <= k - above_high - above_low)
    return selected.view(candidates.shape)


def _kth_largest_digit(bins, num_digits, k):
    """One radix-select pass: bins [N] int32 (digit + 1 for elements in play, 0 or > num_digits for
    the rest) -> 0-dim tensors (digit, above): the digit of the k-th largest in-play element, and
    how many in-play elements have a larger digit. One histogram and a cumulative count; no sync.
    """
    counts = torch.zeros(num_digits + 2, dtype=torch.int32, device=bins.device)  # [D + 2]
    counts.index_add_(
        0, bins, torch.ones(1, dtype=torch.int32, device=bins.device).expand(bins.numel()))
    # [D]: in-play elements with digit >= d
    at_or_above = counts[1:num_digits + 1].flip(0).cumsum(0).flip(0)
    digit = (at_or_above >= k).sum() - 1  # the largest digit with >= k elements at or above it
    padded = torch.cat([at_or_above, at_or_above.new_zeros(1)])  # [D + 1]
    # gather, not padded[digit + 1]: indexing with a 0-dim tensor calls .item(), a host sync on CUDA
    above = padded.gather(0, (digit + 1).view(1)).squeeze(0)
    return digit, above


def _divide_by_count(total, count):
    """total / max(count, 1) in float32; count: a Python number or a tensor (no host-device copy)"""
    if isinstance(count, torch.Tensor):
        return total / count.to(torch.float32).clamp(min=1)
    return total / max(float(count), 1.0)
