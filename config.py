"""config.py: the one typed configuration of a run, loaded from YAML, overridable from the command
line (docs/usage.md, "Configs").

    cfg = config.load("configs/tiny.yaml", ["train.total_steps=20", "gate.target_entropy=0.2"])
    print(config.to_yaml(cfg))  # the resolved config: logged, saved with metrics and checkpoints

Every field has a type and a comment, the reference of its meaning. A config is checked completely
before anything heavy is built; a bad one fails with a ConfigError naming the key (an unknown one
with the nearest valid one suggested). An override's value is read as YAML (`3`, `0.5`, `true`,
`null`, `[a, b]`, or a bare string). The modules that use a section take it as an argument.
"""

import contextlib
import dataclasses
import difflib
import importlib.util
import json
import math
import os
import resource
import stat
import types
import typing
from pathlib import Path

import yaml

import baselines
import data
import rewards
import stare


class ConfigError(ValueError):
    """A configuration problem, with the offending key in the message."""


@dataclasses.dataclass
class ModelConfig:
    path: str = "runs/tiny/model"  # local HF checkpoint directory (nothing is downloaded)
    param_dtype: str = "bfloat16"  # FSDP2 compute dtype of parameters: bfloat16 | float16 | float32
    reduce_dtype: str = "float32"  # FSDP2 gradient reduction dtype
    gradient_checkpointing: bool = False  # recompute activations in backward (long responses)
    # varlen (modeling.py: packed rows) | sdpa | eager | flash_attention_2
    attn_implementation: str = "varlen"


@dataclasses.dataclass
class DataConfig:
    train_files: list[str] = dataclasses.field(default_factory=list)  # .jsonl / .parquet (data.py)
    prompt_suffix: str | None = data.STARE_SUFFIX  # added to plain problem/answer rows; null: none
    max_prompt_tokens: int = 1024  # longer prompts are handled by `overflow`
    overflow: str = "left_truncate"  # left_truncate (verl's "left") | skip | error
    shuffle: bool = True  # reshuffle the prompts every epoch (deterministically from train.seed)


@dataclasses.dataclass
class RolloutConfig:
    n: int = 8  # responses per prompt (the GRPO group size)
    temperature: float = 1.0  # the trainer divides its logits by the same value
    top_p: float = 1.0  # keep 1: truncating makes sampler and trainer log-probs differ (TRL #6789)
    top_k: int = 0  # 0 = off, for the same reason
    max_tokens: int = 3072  # max response tokens
    dtype: str = "auto"  # vLLM weights dtype; auto = vLLM's choice (float32 runs in bfloat16)
    gpu_memory_utilization: float = 0.3  # GPU: vLLM's share (weights + KV cache); leave FSDP room
    kv_cache_gib: float | None = None  # CPU: the KV cache size in GiB (required there); GPU: null
    tensor_parallel_size: int = 1  # GPUs per vLLM engine: consecutive ranks share one
    max_num_seqs: int = 256  # concurrent sequences per engine
    enable_sleep_mode: bool = False  # GPU: release the KV cache and weights while training
    sleep_level: int = 2  # 2: drop weights (synced anew); 1: keep a host copy (vLLM #29341)
    enforce_eager: bool = False  # no CUDA graphs / compilation (faster start-up, slower sampling)
    model_runner: str = "v1"  # vLLM's GPU runner: v1 (the CPU one's sibling) | v2 (0.32's default)
    sync_check_every: int = 10  # steps between weight-sync probes (and the first step); 0 = never
    max_sync_probe_error: float = 2.0  # stop past this max |engine - trainer| log-prob of the probe
    # the probe also compares the next-token distributions over the engine's k most likely tokens
    sync_check_topk: int = 20  # k (rollout.topk_divergence); 0 = the probe's own tokens only
    max_sync_probe_tv: float = 0.5  # stop past this largest total variation over those k (+ rest)
    max_logprob_mismatch: float = 0.25  # stop past this step mean |rollout - trainer| log-prob
    tools: bool = False  # multi-turn code-interpreter rollouts (tool_use.py; the sandbox section)
    max_turns: int = 4  # tools: model turns per response; max_tokens bounds model + tool tokens
    max_tool_response_tokens: int = 512  # tools: tokens of one tool output shown (head and tail)


@dataclasses.dataclass
class AlgorithmConfig:
    method: str = "stare"  # one of baselines.METHODS
    normalize_std: bool = True  # GRPO advantages (r - mean) / std; false = Dr.GRPO's (r - mean)
    dynamic_sampling: bool = True  # DAPO: drop groups whose rewards are all equal, refill the batch
    max_num_gen_batches: int = 10  # rounds per step before giving up with an error; 0 = no limit
    gen_batch_size: int = 192  # prompts a generation round, all ranks; >= train.train_batch_size
    # where every method picks its tokens (L+/L-, ranked or masked): step (once per optimizer step,
    # whole batch, all ranks: the same whatever the micro-batch and world sizes) | micro (in each
    # micro-batch on current log-probs, exactly as the references do)
    selection_scope: str = "step"
    importance_sampling: bool = False  # token loss times min(pi_old / pi_rollout, is_cap) (opt-in)
    is_cap: float = 2.0


@dataclasses.dataclass
class GateConfig:
    """STARE's closed-loop entropy gate and weights (Eqs. 8, 10): stare.EntropyGate's arguments."""

    target_entropy: float = 0.3  # reweight only while the batch entropy is below this
    w: float = 1.1  # weight on L+ (the most surprising positive-advantage tokens)
    m: float = 0.9  # weight on L- (variant C2)
    adaptive: bool = False  # move w and m by alpha a step towards stronger reweighting below target
    alpha: float = 0.01
    w_max: float = 1.5  # adaptive: w stays in [1, w_max]
    m_min: float = 0.5  # adaptive: m stays in [m_min, 1]


@dataclasses.dataclass
class EntropicConfig:
    """EntroPIC's PI controller of its coefficient alpha (Eq. 26): the arguments of
    baselines.EntropyPIController. Defaults: the reference's script (yk7333/EntroPIC)."""

    target_entropy: float | None = None  # the entropy it holds; null = gate.target_entropy
    kp: float = 1.0  # proportional gain on H - target
    ki: float = 0.01  # integral gain on the sum of the earlier steps' errors
    coef_min: float = -1.0  # alpha is clipped to [coef_min, coef_max]; the integral is not
    coef_max: float = 1.0
    # not the reference's (deviations, off by default): "crossing" keeps alpha and the integral at
    # 0 until the entropy first reaches the target from above; anti_windup stops integrating while
    # alpha is held at a bound by an error that would push it further
    start: str = "first_step"
    anti_windup: bool = False


@dataclasses.dataclass
class LossConfig:
    """The policy loss, shared by every method (a controlled comparison: only the token-level
    change differs), with STARE/DAPO's clip settings, and each method's knobs, defaulting to its
    paper's reference scripts (Eqs. 12-19, 22-24). The Lp-Reg, Clip-Cov and W-REINFORCE references
    use no dual clip and clip_low/clip_high 1.0/9.0, 1.0/1.0, 0.2/0.2: set those to match them."""

    # --- the policy loss: ppo_clip (Eq. 2, verl's "vanilla"), gspo, cispo, sapo (Eqs. 27-29; verl's
    # loss_mode names; their knobs' defaults are their papers') ---
    policy_loss: str = "ppo_clip"
    gspo_clip_low: float = 3e-4  # GSPO's sequence-ratio clip (its Sec. 5.1)
    gspo_clip_high: float = 4e-4
    cispo_clip_low: float = 10.0  # CISPO's weight clip: no lower bound in effect (verl's example)
    cispo_clip_high: float = 0.2
    sapo_tau_pos: float = 1.0  # SAPO's gate temperatures for A > 0 and A <= 0
    sapo_tau_neg: float = 1.05
    # --- PPO-clip and the aggregation of every loss (Eqs. 2, 3) ---
    clip_low: float = 0.2  # ratio clip below 1 - clip_low
    clip_high: float = 0.28  # ratio clip above 1 + clip_high (DAPO's clip-higher)
    dual_clip: float | None = 10.0  # dual-clip bound c for A < 0 (STARE/DAPO scripts); None = off
    agg_mode: str = "token-mean"  # one of stare.LOSS_AGG_MODES; Dr.GRPO: seq-mean-token-sum-norm
    # Dr.GRPO's constant (e.g. the max response length); None = padded width
    loss_scale_factor: float | None = None
    # --- STARE's selection (Eqs. 7, 8); its weights and gate: the `gate` section ---
    stare_variant: str = "O1"  # O1: amplify L+ only; C2: also damp L-
    stare_top_ratio: float = 0.1  # P: fraction of A > 0 (and A < 0) tokens of highest surprisal
    # --- STAPO (Eq. 12); no public code: tau_p, tau_h from a secondary source (a DiDi article) ---
    stapo_prob_threshold: float = 0.01  # tau_p: spurious tokens have pi < tau_p ...
    stapo_entropy_quantile: float = 0.05  # ... and H below this quantile of the batch's valid H
    # --- Lp-Reg (Eqs. 13, 14) ---
    lp_reg_kappa: float = 0.02  # min-p proxy keeps tokens with p >= kappa * max p
    lp_reg_soft: bool = False  # filtered tokens get the row's minimum logit, not -1e4 (minp_soft)
    lp_reg_neg_ratio: float = 0.01  # rho-: share of A<0 tokens (lowest pi) regularised; 32B: 0.005
    lp_reg_coef: float = 1.0  # beta on the k3 term (ppo_kl_coef)
    # --- Clip-Cov / KL-Cov (Eqs. 15-17); ratios are fractions, not the PRIME repo's percentages ---
    clip_cov_ratio: float = 0.0002  # fraction of valid tokens detached
    clip_cov_lb: float = 1.0  # covariance window (lb, ub) for Clip-Cov candidates
    clip_cov_ub: float = 5.0
    kl_cov_ratio: float = 0.002  # fraction of valid tokens of highest covariance penalised (7B)
    kl_cov_coef: float = 1.0  # beta on |log pi - log pi_old|
    # --- 80/20 high-entropy tokens (Eq. 18) ---
    high_entropy_ratio: float = 0.2  # rho: fraction of valid tokens (highest H) keeping gradient
    # paper: ceil(rho N) kept, all valid tokens in the denominator; lp_reg_dev: max(1, int(rho N))
    # kept, only kept tokens in the denominator
    high_entropy_convention: str = "paper"
    # --- entropy bonus (Eq. 19) ---
    entropy_coef: float = 0.001  # beta in loss - beta * H
    # --- STEER (Eqs. 22, 23) and W-REINFORCE (Eq. 24); defaults from their reference scripts ---
    steer_weight_min: float = 0.8  # lambda_min, the smallest token weight (both scripts: 0.8)
    steer_weight_max: float = 1.2  # lambda_max, the largest: linear mapping only (run_linear.sh)
    steer_linear: bool = False  # False: exp(-k |Omega|) (run_exp.sh, the paper's); True: linear
    steer_estimate: str = "steer"  # steer: |A r (1 - pi)(log pi + H)|; sensitivity: |A r S| (Eq. 5)
    w_reinforce_lambda: float = 0.1  # lambda: weight of positive-advantage tokens (paper: 0.1)
    # --- EntroPIC (Eq. 25); its controller is the `entropic` section ---
    entropic_prob_threshold: float = 0.95  # its term acts on tokens with pi above this (reference)
    # --- adaptive entropy coefficient (Eq. 30): Skywork-OR1's paper runs' values (target 0.2) ---
    adaptive_entropy_target: float | None = None  # the entropy it holds; null = gate.target_entropy
    adaptive_entropy_coef_init: float = 0.0
    adaptive_entropy_coef_min: float = 0.0
    adaptive_entropy_coef_max: float = 0.005
    adaptive_entropy_delta: float = 1e-4  # the coefficient's move per step
    # --- GRPODropout (Eq. 31): its "balance" variant (hexuandeng/GRPODropout, balance.env) ---
    grpo_dropout_drop: bool = True  # drop rollouts by their entropy push (false: keep all)
    grpo_dropout_center: bool = True  # shift the kept advantages to a softmax(l)-weighted mean 0
    grpo_dropout_basis: str = "avg"  # l: the mean ("avg") or sum ("sum") of a response's log-probs

    def __post_init__(self):
        positive = ("clip_low", "clip_high", "gspo_clip_low", "gspo_clip_high", "cispo_clip_low",
                    "cispo_clip_high", "sapo_tau_pos", "sapo_tau_neg")
        fractions = ("stare_top_ratio", "stapo_prob_threshold", "stapo_entropy_quantile",
                     "lp_reg_neg_ratio", "clip_cov_ratio", "kl_cov_ratio", "high_entropy_ratio",
                     "entropic_prob_threshold")
        checks = {
            **{name: getattr(self, name) > 0 for name in positive},
            **{name: 0 <= getattr(self, name) <= 1 for name in fractions},
            "dual_clip": self.dual_clip is None or self.dual_clip > 1,
            "agg_mode": self.agg_mode in stare.LOSS_AGG_MODES,
            "stare_variant": self.stare_variant.upper() in ("O1", "C2"),
            "lp_reg_kappa": 0 < self.lp_reg_kappa <= 1,
            "clip_cov_ub": self.clip_cov_ub > self.clip_cov_lb,
            "high_entropy_convention": self.high_entropy_convention in ("paper", "lp_reg_dev"),
            "steer_weight_min": 0 < self.steer_weight_min <= min(1.0, self.steer_weight_max),
            "steer_estimate": self.steer_estimate in ("steer", "sensitivity"),
            "w_reinforce_lambda": self.w_reinforce_lambda >= 0,
            "adaptive_entropy_target": (self.adaptive_entropy_target is None
                                        or self.adaptive_entropy_target > 0),
            "adaptive_entropy_coef_max": (0 <= self.adaptive_entropy_coef_min
                                          <= self.adaptive_entropy_coef_max),
            "adaptive_entropy_delta": self.adaptive_entropy_delta >= 0,
            "grpo_dropout_basis": self.grpo_dropout_basis in ("avg", "sum")}
        bad = [name for name, ok in checks.items() if not ok]
        if bad:
            raise ValueError("invalid loss config: "
                             + ", ".join(f"{name}={getattr(self, name)!r}" for name in bad))


@dataclasses.dataclass
class RewardConfig:
    answer_format: str = "boxed"  # boxed: the last \boxed{} only; any: math-verify reads all text
    timeout_s: float = 5.0  # deadline for checking one response (main thread only; rewards.py)
    overlong_buffer_len: int = 0  # DAPO overlong shaping over the last N tokens; 0 = off (STARE's)
    overlong_penalty_factor: float = 1.0  # the penalty at max_response_len, which is -factor
    max_response_len: int = 0  # the sampler's max new tokens; > overlong_buffer_len when shaping
    format_weight: float = 0.0  # reward += it * format_ok; 0 = logged, not rewarded (the reference)

    def __post_init__(self):
        if self.answer_format not in rewards.ANSWER_FORMATS:
            raise ValueError(f"answer_format must be one of {rewards.ANSWER_FORMATS}, got "
                             f"{self.answer_format!r}")
        if not self.timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {self.timeout_s}")
        if self.overlong_buffer_len < 0:
            raise ValueError(
                f"overlong_buffer_len must be >= 0 (0 = off), got {self.overlong_buffer_len}")
        if not self.overlong_penalty_factor >= 0:
            raise ValueError(
                f"overlong_penalty_factor must be >= 0, got {self.overlong_penalty_factor}")
        if self.max_response_len < 0:
            raise ValueError(f"max_response_len must be >= 0, got {self.max_response_len}")
        if self.overlong_buffer_len > 0 and self.max_response_len <= self.overlong_buffer_len:
            raise ValueError(
                f"max_response_len ({self.max_response_len}) must be > overlong_buffer_len "
                f"({self.overlong_buffer_len}) when overlong shaping is on")
        if not math.isfinite(self.format_weight):
            raise ValueError(f"format_weight must be finite, got {self.format_weight}")


@dataclasses.dataclass
class SandboxConfig:
    """The tool sandbox's limits and isolation (sandbox.py; docs/sandbox.md)."""

    timeout_s: float = 10.0  # wall clock per execution; then the code and all it started are killed
    cpu_s: int = 10  # CPU seconds per process (RLIMIT_CPU)
    memory_mb: int = 1024  # address space per process (RLIMIT_AS); numpy + sympy need ~170 MB
    max_processes: int = 8  # processes + threads, its own too (RLIMIT_NPROC in its user namespace)
    max_file_mb: int = 32  # largest file (RLIMIT_FSIZE); "namespaces" mode: the private tmpfs too
    max_output_bytes: int = 8192  # stdout+stderr kept: the first and last half, the middle dropped
    max_workers: int = 8  # concurrent executions in run_batch
    network: bool = False  # True: the code shares the host network
    python: str = ""  # interpreter for the code; "" = the trainer's own (sys.executable)
    isolation: str = "auto"  # auto | namespaces | process (docs/sandbox.md)
    # "auto" where user namespaces fail (twice): true = run the code in "process" mode, false = stop
    allow_process_fallback: bool = False
    tmp_root: str = ""  # "process" mode: where private directories go; "" = tempfile.gettempdir()
    # failures of the sandbox itself (not the code's) that stop a run (train.sandbox_guard): a share
    # of one step's tool calls, and of the calls over the last window_steps steps; 1 = never
    max_failure_frac: float = 0.25
    max_window_failure_frac: float = 0.02
    window_steps: int = 20

    def __post_init__(self):
        if self.isolation not in ("auto", "namespaces", "process"):
            raise ValueError(
                f"isolation must be auto, namespaces or process, not {self.isolation!r}")
        for name in ("timeout_s", "cpu_s", "memory_mb", "max_processes", "max_file_mb",
                     "max_output_bytes", "max_workers", "window_steps"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive, not {getattr(self, name)!r}")
        for name in ("max_failure_frac", "max_window_failure_frac"):
            if not 0 <= getattr(self, name) <= 1:
                raise ValueError(f"{name} must be in [0, 1], not {getattr(self, name)!r}")


@dataclasses.dataclass
class OptimConfig:
    lr: float = 1e-6
    weight_decay: float = 0.01  # verl's default (STARE's scripts do not change it)
    betas: list[float] = dataclasses.field(default_factory=lambda: [0.9, 0.999])
    warmup_steps: int = 0  # linear warm-up from 0
    schedule: str = "constant"  # constant | cosine (to min_lr_ratio * lr at train.total_steps)
    min_lr_ratio: float = 0.0
    grad_clip: float = 1.0  # max global gradient norm; 0 = off
    max_nonfinite_steps: int = 3  # skipped steps in a row (non-finite loss or grad norm) stop a run
    loss_scale_init: float = 65536.0  # float16 compute only: dynamic loss scaling's first scale
    loss_scale_window: int = 1000  # float16: optimizer steps without overflow before it doubles


@dataclasses.dataclass
class TrainConfig:
    train_batch_size: int = 64  # prompts per step, all ranks (each brings rollout.n responses)
    mini_batch_size: int = 64  # prompts an optimizer step; = train_batch_size: 1 update, on-policy
    micro_token_budget: int = 8192  # tokens per micro-batch per rank (prompt + response, all rows)
    total_steps: int = 1000
    seed: int = 0  # everything random derives from it (data order, sampling, Clip-Cov)
    out_dir: str = "runs/default"  # config.yaml, metrics.jsonl, checkpoints/, hf/ go here
    save_every: int = 10  # steps between checkpoints; 0 = only at the end
    keep_last: int = 3  # checkpoints kept (>= 1)
    resume: str = "auto"  # auto: out_dir's latest checkpoint, if any | never | a checkpoint path
    # resume: auto, and no checkpoint in out_dir passes its checks: true = train from step 0
    # (replacing them), false = stop in one line with all of them intact
    start_over_if_unusable: bool = False
    log_every: int = 1  # steps between console lines (metrics.jsonl gets every step)
    wandb: bool = False  # also log to Weights & Biases (needs `pip install wandb`)
    wandb_project: str = "stare"  # the W&B project; the run is named after out_dir
    nccl_timeout_minutes: int = 60  # how long collectives wait for a slow rank (rollouts, compiles)
    tensorboard: bool = False  # also log to out_dir/tensorboard (needs `pip install tensorboard`)
    # zero-signal guard (train.py): a step has no learning signal when the share of groups judged
    # differently (rollout/varied_group_frac), or of responses with a readable answer (1 -
    # rollout/no_answer_frac - rollout/parse_error_frac), is at or below its floor; 0 = none at all
    min_varied_group_frac: float = 0.0
    min_answered_frac: float = 0.0
    zero_signal_warn_steps: int = 3  # consecutive steps without signal before a warning; 0 = never
    zero_signal_stop_steps: int = 10  # ... before the run stops after a checkpoint; 0 = never


@dataclasses.dataclass
class EvalConfig:
    every: int = 10  # steps between evaluations (and after the last step); 0 = never
    before_train: bool = True  # also evaluate the starting model (logged as step 0; not on resume)
    files: list[str] = dataclasses.field(default_factory=list)  # benchmarks (data.py formats)
    # samples per prompt (avg@n, pass@k); null = the paper's per benchmark (evaluate.default_n)
    n: int | None = None
    temperature: float = 1.0
    top_p: float = 0.7  # the paper's validation setting
    max_tokens: int = 3072


@dataclasses.dataclass
class HardwareConfig:
    """What the run is planned for: `train.py --plan` and a GPU run, before it loads anything,
    check every phase's memory against it (plan.py)."""

    nodes: int = 1
    gpus_per_node: int = 1  # ranks per node: one per GPU
    gpu_gib: float = 79.0  # memory per GPU as PyTorch reports it (H100 80GB: ~79 GiB; H200: ~139)
    host_gib: float | None = None  # RAM per node; null = not checked


@dataclasses.dataclass
class Config:
    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    rollout: RolloutConfig = dataclasses.field(default_factory=RolloutConfig)
    reward: RewardConfig = dataclasses.field(default_factory=RewardConfig)
    algorithm: AlgorithmConfig = dataclasses.field(default_factory=AlgorithmConfig)
    gate: GateConfig = dataclasses.field(default_factory=GateConfig)
    entropic: EntropicConfig = dataclasses.field(default_factory=EntropicConfig)
    loss: LossConfig = dataclasses.field(default_factory=LossConfig)
    optim: OptimConfig = dataclasses.field(default_factory=OptimConfig)
    train: TrainConfig = dataclasses.field(default_factory=TrainConfig)
    eval: EvalConfig = dataclasses.field(default_factory=EvalConfig)
    sandbox: SandboxConfig = dataclasses.field(default_factory=SandboxConfig)  # rollout.tools
    hardware: HardwareConfig = dataclasses.field(default_factory=HardwareConfig)


RENAMED = {  # old key -> its name now: an old config fails in one line that names the new key
    "algorithm.stare_scope": "algorithm.selection_scope", "loss.stare_w": "gate.w",
    "loss.stare_m": "gate.m", "algorithm.target_entropy": "gate.target_entropy",
    **{f"algorithm.gate_{k}": f"gate.{k}" for k in ("adaptive", "alpha", "w_max", "m_min")}}

CHOICES = {  # fields with a fixed set of values
    "model.param_dtype": ("bfloat16", "float16", "float32"),
    "model.reduce_dtype": ("bfloat16", "float16", "float32"),
    "model.attn_implementation": ("varlen", "sdpa", "eager", "flash_attention_2"),
    "rollout.sleep_level": (1, 2), "rollout.model_runner": ("v1", "v2"),
    "data.overflow": data.OVERFLOW_MODES, "algorithm.method": baselines.METHODS,
    "loss.policy_loss": baselines.POLICY_LOSSES, "algorithm.selection_scope": ("step", "micro"),
    "entropic.start": ("first_step", "crossing"), "optim.schedule": ("constant", "cosine")}


# --------------------------------------------------------------------------------------------------
# Loading
# --------------------------------------------------------------------------------------------------


def load(path=None, overrides=()):
    """The checked Config of a YAML file (None: the defaults) with `section.key=value` overrides."""
    raw = {}
    if path is not None:
        if Path(path).exists() and not Path(path).is_file():  # a FIFO would block the read
            raise ConfigError(f"config file {path} {_not_a_file(path)}")
        try:
            with open(path) as f:
                raw = yaml.load(f, Loader=_UniqueKeyLoader)
        except OSError as error:
            raise ConfigError(f"cannot read config file {path}: {error.strerror}") from None
        except UnicodeDecodeError:
            raise ConfigError(_not_utf8(path)) from None
        except yaml.YAMLError as error:  # one line: where, and what
            mark = getattr(error, "problem_mark", None)
            where = f"{path}:{mark.line + 1}" if mark is not None else path
            problem = getattr(error, "problem", None) or " ".join(str(error).split())
            raise ConfigError(f"config file {where} is not valid YAML: {problem}") from None
        if raw is None:
            raise ConfigError(
                f"config file {path} is empty (a run's settings are a mapping of sections)")
        if not isinstance(raw, dict):
            raise ConfigError(
                f"config file {path} must hold a mapping of sections, got {type(raw).__name__}")
    return _overridden(raw, overrides)


def _not_utf8(path):
    """Where a config file stops being UTF-8, as a line (the reader's error counts in chunks)."""
    text = Path(path).read_bytes()
    try:
        text.decode("utf-8")
    except UnicodeDecodeError as error:
        line = text[:error.start].count(b"\n") + 1
        return f"config file {path}:{line} is not UTF-8 text (byte 0x{text[error.start]:02x})"
    return f"config file {path} is not UTF-8 text"


class _UniqueKeyLoader(yaml.SafeLoader):
    """yaml.safe_load that refuses a key given twice in one mapping (safe_load keeps the last, so
    the first value, which the reader may be looking at, would silently not count)."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"key {key!r} is given twice", key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def apply_overrides(cfg, overrides):
    """A new Config: `cfg` with `section.key=value` overrides applied, fully checked."""
    return _overridden(to_dict(cfg), overrides)


def _overridden(raw, overrides):
    """The checked Config of a raw dict with `section.key=value` overrides applied to it."""
    for override in overrides:
        key, sep, text = override.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"override {override!r} must look like section.key=value")
        *sections, name = key.strip().split(".")
        node = raw
        for section in sections:
            node = node.setdefault(section, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override {override!r}: {section!r} is not a section")
        try:
            node[name] = yaml.safe_load(text) if text.strip() else ""
        except yaml.YAMLError:
            node[name] = text  # not YAML: a bare string
    cfg = _build(Config, raw, "")
    check(cfg)
    return cfg


def _build(cls, raw, prefix):
    """Dataclass `cls` from a dict, every key and type checked; nested dataclasses recurse."""
    if not isinstance(raw, dict):
        raise ConfigError(
            f"config key {prefix.rstrip('.') or '<root>'!r} must be a mapping, got {raw!r}")
    hints = typing.get_type_hints(cls)  # the fields, in order
    for key in raw:
        if prefix + str(key) in RENAMED:
            raise ConfigError(
                f"config key {prefix + str(key)!r} is now {RENAMED[prefix + str(key)]!r}")
        if key not in hints:
            close = difflib.get_close_matches(str(key), hints, n=1)
            hint = (f" (did you mean {prefix + close[0]!r}?)" if close
                    else f" (valid: {', '.join(hints)})")
            raise ConfigError(f"config key {prefix + str(key)!r}: unknown key{hint}")
    values = {name: _build(hints[name], value, f"{prefix}{name}.")
              if dataclasses.is_dataclass(hints[name])
              else _coerce(value, hints[name], prefix + name) for name, value in raw.items()}
    try:
        return cls(**values)
    except ValueError as error:  # a section's own checks (LossConfig, RewardConfig, SandboxConfig)
        raise ConfigError(f"config section {prefix.rstrip('.')!r}: {error}") from None


def _coerce(value, hint, key):
    """Check `value` against the type hint; ints are accepted where floats are expected."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        (inner,) = [a for a in args if a is not type(None)]
        return _coerce(value, inner, key)
    if origin is list:
        if not isinstance(value, list):
            raise ConfigError(f"config key {key!r}: expected a list, got {value!r}")
        return [_coerce(item, args[0], f"{key}[{i}]") for i, item in enumerate(value)]
    if hint is float and isinstance(value, (int, str)) and not isinstance(value, bool):
        with contextlib.suppress(ValueError):  # YAML 1.1 reads 1e-6 (no dot) as a string
            value = float(value)
    if hint is float and isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(f"config key {key!r}: must be a finite number, got {value!r}")
    if not isinstance(value, hint) or (hint is int and isinstance(value, bool)):
        raise ConfigError(
            f"config key {key!r}: expected {hint.__name__}, got {value!r} ({type(value).__name__})")
    return value


# --------------------------------------------------------------------------------------------------
# Checks
# --------------------------------------------------------------------------------------------------


# keys whose values must be > 0 (gate.target_entropy: the gate compares it with an entropy, which
# is >= 0, so at 0 or below it never opens) and >= 0
POSITIVE = (
    "rollout.n", "rollout.max_tokens", "data.max_prompt_tokens", "train.train_batch_size",
    "train.mini_batch_size", "train.micro_token_budget", "train.total_steps",
    "algorithm.gen_batch_size", "rollout.temperature", "rollout.tensor_parallel_size",
    "train.keep_last", "rollout.max_num_seqs", "optim.lr", "eval.temperature", "eval.max_tokens",
    "rollout.max_turns", "rollout.max_tool_response_tokens", "hardware.nodes",
    "hardware.gpus_per_node", "hardware.gpu_gib", "rollout.max_sync_probe_error",
    "rollout.max_sync_probe_tv", "rollout.max_logprob_mismatch", "optim.loss_scale_init",
    "optim.loss_scale_window", "train.nccl_timeout_minutes", "train.log_every",
    "gate.target_entropy", "gate.w", "gate.m")
NON_NEGATIVE = (
    "optim.weight_decay", "optim.warmup_steps", "optim.grad_clip", "optim.min_lr_ratio",
    "train.save_every", "eval.every", "rollout.sync_check_every", "algorithm.max_num_gen_batches",
    "gate.alpha", "optim.max_nonfinite_steps", "entropic.kp", "entropic.ki",
    "train.zero_signal_warn_steps", "train.zero_signal_stop_steps", "rollout.sync_check_topk")


def check(cfg, world_size=None):
    """Ranges, choices and combinations; with world_size, also what the ranks must divide."""
    for key, allowed in CHOICES.items():
        value = _get(cfg, key)
        if value not in allowed:
            close = difflib.get_close_matches(str(value), allowed, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ConfigError(f"config key {key!r}: {value!r} is not one of {allowed}{hint}")
    refused = baselines.refused_combination(cfg.algorithm.method, cfg.loss.policy_loss)
    if refused:
        raise ConfigError(f"config keys 'algorithm.method' and 'loss.policy_loss': {refused}")
    for key, ok, message in _rules(cfg, world_size):
        if not ok:
            raise ConfigError(f"config key {key!r}: {message}, got {_get(cfg, key)!r}")


# responses per prompt vLLM samples at most (vllm/sampling_params.py; its default 16384)
VLLM_MAX_N = int(os.environ.get("VLLM_MAX_N_SEQUENCES", "16384"))


def _rules(cfg, world_size):
    """(key, whether it holds, what the value must be) for every rule, lazily: the ranges first
    (the later rules divide by some of those values)."""
    yield from ((key, _get(cfg, key) > 0, "must be > 0") for key in POSITIVE)
    yield from ((key, _get(cfg, key) >= 0, "must be >= 0") for key in NON_NEGATIVE)
    r, a, t, hw = cfg.rollout, cfg.algorithm, cfg.train, cfg.hardware
    yield from [
        ("rollout.top_p", 0 < r.top_p <= 1, "must be in (0, 1]"),
        ("algorithm.selection_scope", a.method != "grpo_dropout" or a.selection_scope == "step",
         "must be step for grpo_dropout (it chooses among whole groups)"),
        ("algorithm.normalize_std", a.method != "grpo_dropout" or a.normalize_std,
         "must be true for grpo_dropout (its advantages are recomputed as GRPO's)"),
        ("eval.top_p", 0 < cfg.eval.top_p <= 1, "must be in (0, 1]"),
        ("eval.n", cfg.eval.n is None or cfg.eval.n >= 1, "must be >= 1 or null"),
        ("rollout.top_k", r.top_k >= -1, "must be >= -1 (0 or -1 = off)"),
        ("rollout.n", r.n >= 2, "must be >= 2: a group of one response has no baseline"),
        *((key, _get(cfg, key) is None or _get(cfg, key) <= VLLM_MAX_N,
           f"must be <= {VLLM_MAX_N}, vLLM's limit (VLLM_MAX_N_SEQUENCES)")
          for key in ("rollout.n", "eval.n")),
        ("train.out_dir", t.out_dir.strip() != "",
         "must name a directory (empty would write the run into the working directory)"),
        ("rollout.tensor_parallel_size", r.tensor_parallel_size == 1 or not r.tools,
         "must be 1 with rollout.tools (the ranks of one engine would each run the tool calls)"),
        ("rollout.tensor_parallel_size", hw.gpus_per_node % r.tensor_parallel_size == 0,
         f"must divide hardware.gpus_per_node ({hw.gpus_per_node}): an engine stays on one node"),
        ("train.mini_batch_size", t.train_batch_size % t.mini_batch_size == 0,
         f"must divide train.train_batch_size ({t.train_batch_size})"),
        ("algorithm.gen_batch_size", a.gen_batch_size >= t.train_batch_size,
         f"must be >= train.train_batch_size ({t.train_batch_size})"),
        ("optim.betas", len(cfg.optim.betas) == 2 and all(0 <= b < 1 for b in cfg.optim.betas),
         "must be two numbers in [0, 1)"),
        ("optim.min_lr_ratio", cfg.optim.min_lr_ratio <= 1, "must be <= 1"),
        ("train.min_varied_group_frac", 0 <= t.min_varied_group_frac < 1, "must be in [0, 1)"),
        ("train.min_answered_frac", 0 <= t.min_answered_frac < 1, "must be in [0, 1)"),
        ("rollout.gpu_memory_utilization", 0 < r.gpu_memory_utilization <= 1, "must be in (0, 1]"),
        *((key, _get(cfg, key) is None or _get(cfg, key) > 0, "must be > 0 or null")
          for key in ("rollout.kv_cache_gib", "hardware.host_gib")),
        ("algorithm.is_cap", a.is_cap >= 1, "must be >= 1"),
        ("gate.w_max", cfg.gate.w_max >= 1, "must be >= 1"),
        ("gate.m_min", 0 <= cfg.gate.m_min <= 1, "must be in [0, 1]"),
        ("entropic.target_entropy",
         cfg.entropic.target_entropy is None or cfg.entropic.target_entropy > 0,
         "must be > 0 or null (gate.target_entropy)"),
        ("entropic.coef_max", cfg.entropic.coef_min <= cfg.entropic.coef_max,
         f"must be >= entropic.coef_min ({cfg.entropic.coef_min})"),
        *((f"train.{name}", not getattr(t, name) or importlib.util.find_spec(name) is not None,
           f"needs the {name} package (pip install {name})") for name in ("wandb", "tensorboard")),
        ("reward.max_response_len",
         cfg.reward.overlong_buffer_len == 0 or cfg.reward.max_response_len == r.max_tokens,
         f"must equal rollout.max_tokens ({r.max_tokens}) when overlong shaping is on")]
    if world_size is not None:
        yield from [
            *((key, _get(cfg, key) % world_size == 0,
               f"must be divisible by the number of ranks ({world_size})")
              for key in ("train.mini_batch_size", "algorithm.gen_batch_size")),
            ("rollout.tensor_parallel_size", world_size % r.tensor_parallel_size == 0,
             f"must divide the number of ranks ({world_size}): consecutive ranks share an engine")]


def _get(cfg, key):
    for part in key.split("."):
        cfg = getattr(cfg, part)
    return cfg


def to_dict(cfg):
    return dataclasses.asdict(cfg)


def to_yaml(cfg):
    return yaml.safe_dump(to_dict(cfg), sort_keys=False, width=120)


# --------------------------------------------------------------------------------------------------
# Paths: checked before anything heavy starts (and never looked up on a hub: nothing is downloaded)
# --------------------------------------------------------------------------------------------------


def describe_path(path):
    """A path as an error message should show it: a relative one with the working directory."""
    path = Path(path)
    return str(path) if path.is_absolute() else (
        f"{path} (relative to the working directory {Path.cwd()})")


def _named(key):
    """How an error names a setting: a command-line option as it is, a config key quoted."""
    return key if key.startswith("--") else f"config key {key!r}"


def check_model_path(path, key="model.path"):
    """A local Hugging Face model directory: config.json, a tokenizer and weights. Raises
    ConfigError naming what is missing and where to get it."""
    path, key, where = Path(path), _named(key), describe_path(path)
    get_it = (f"nothing is downloaded at run time: fetch it first, e.g. `huggingface-cli download "
              f"<org>/{path.name} --local-dir {path}` (docs/usage.md, "
              f'"Models and data for GPU runs")')
    if not path.exists():
        raise ConfigError(f"{key}: {where} does not exist; {get_it}")
    if not path.is_dir():
        raise ConfigError(f"{key}: {where} is a file, not a model directory")
    if (path / "hf" / "config.json").exists():
        raise ConfigError(
            f"{key}: {where} is a training run's directory; its model is {path / 'hf'}")
    found = [(what, sorted(path.glob(pattern))) for what, pattern in (
        ("a training checkpoint", "trainer.pt"), ("a run's checkpoints directory",
         "step_*/trainer.pt"), ("a training run's directory", "checkpoints/step_*/trainer.pt"))]
    what, checkpoint = next(((what, files[-1].parent) for what, files in found if files),
                            (None, None))
    if checkpoint is not None:  # its latest checkpoint, in the advice
        raise ConfigError(
            f"{key}: {where} is {what}, not a model: export it as one with `python train.py "
            f"--config {checkpoint / 'config.yaml'} --export train.resume={checkpoint}` (writes "
            f"its out_dir/hf_step_N), or continue training from it with train.resume={checkpoint}")
    for file in [path / "config.json", *sorted(path.glob("*.safetensors"))]:
        if file.exists() and not file.is_file():  # a FIFO would block the reads below
            raise ConfigError(f"{key}: {file} {_not_a_file(file)}")
    quantization = _config_json(path).get("quantization_config") or {}
    if isinstance(quantization, dict) and quantization.get("quant_method") == "gguf":
        raise ConfigError(
            f"{key}: {where}/config.json still names the GGUF quantization it was converted from, "
            f"which vLLM refuses; convert it with `python -m tools.convert_gguf` (docs/usage.md, "
            f'"A small real model, offline")')
    missing = [what for what, names in (
        ("config.json", ("config.json",)),
        ("a tokenizer (tokenizer.json)", ("tokenizer.json", "tokenizer_config.json")))
        if not any((path / name).exists() for name in names)]
    if not any(path.glob("*.safetensors")) and not any(path.glob("pytorch_model*.bin")):
        missing.append("weights (*.safetensors)")
    if missing:
        raise ConfigError(f"{key}: {where} is not a Hugging Face model directory "
                          f"(missing: {', '.join(missing)}); {get_it}")
    try:
        config_json = json.loads((path / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:  # ValueError: invalid JSON or UTF-8
        raise ConfigError(f"{key}: {path / 'config.json'} cannot be read as JSON "
                          f"({type(error).__name__}: {error})") from None
    if not isinstance(config_json, dict):
        raise ConfigError(f"{key}: {path / 'config.json'} holds a {type(config_json).__name__}, "
                          f"not the model's settings (a JSON object)")
    for file in sorted(path.glob("*.safetensors")):
        problem = _safetensors_problem(file)
        if problem:
            raise ConfigError(f"{key}: {file} {problem}: a copy cut short or damaged; fetch it "
                              f"again")


def _safetensors_problem(file):
    """Why a .safetensors file cannot hold what its header lists (reading only that), or None."""
    size = file.stat().st_size
    try:
        with open(file, "rb") as f:
            header_size = int.from_bytes(f.read(8), "little")
            if size < 8 or header_size > size - 8:
                return f"is truncated ({size} bytes, its header alone needs {8 + header_size})"
            header = json.loads(f.read(header_size))
        ends = [entry["data_offsets"][1] for name, entry in header.items()
                if name != "__metadata__"]
    except (OSError, ValueError, TypeError, KeyError, IndexError, AttributeError) as error:
        return f"has no readable safetensors header ({type(error).__name__}: {error})"
    needed = 8 + header_size + max(ends, default=0)
    return f"is truncated ({size} bytes, its header needs {needed})" if size < needed else None


def check_write_limit(model_path):
    """That the file-size limit (ulimit -f) lets a run write its files: the largest is at least
    model_path's largest weight file (a checkpoint's shard, the export), and vLLM's compile cache
    writes files of many MB. Past the limit a write fails deep inside a library."""
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    largest = max((p.stat().st_size for p in Path(model_path).glob("*.safetensors")), default=0)
    needed = max(largest, 256 << 20)
    if limit != resource.RLIM_INFINITY and limit < needed:
        raise ConfigError(
            f"the file-size limit (ulimit -f) is {limit / 2**20:.1f} MiB: a run writes larger "
            f"files (checkpoints, the export, vLLM's compile cache: at least "
            f"{needed / 2**20:.0f} MiB); raise it, e.g. `ulimit -f unlimited`")


def check_model_config(path, key="model.path"):
    """The config.json of a model directory (all that a memory plan reads) -> the directory;
    ConfigError without it."""
    if not (Path(path) / "config.json").is_file():
        raise ConfigError(
            f"{_named(key)}: {describe_path(path)} holds no config.json (a memory plan needs only "
            f"that file of the model)")
    return path


def check_context(model_path, max_model_len, keys):
    """That prompts and responses fit the model's context (config.json's max_position_embeddings):
    vLLM refuses a longer max_model_len only once its engine is half built. keys: what sets
    max_model_len, for the message."""
    positions = _config_json(model_path).get("max_position_embeddings")
    if positions is not None and max_model_len > positions:
        raise ConfigError(
            f"{keys} = {max_model_len} tokens exceeds the model's context "
            f"(max_position_embeddings = {positions} in {Path(model_path) / 'config.json'})")


def _config_json(model_path):
    """A model directory's config.json; {} when it cannot be read (check_model_path says why)."""
    try:
        settings = json.loads((Path(model_path) / "config.json").read_text())
    except (OSError, ValueError):
        return {}
    return settings if isinstance(settings, dict) else {}


def check_files(paths, key):
    """Every path is a readable regular file."""
    for i, path in enumerate(paths):
        if not Path(path).is_file():
            raise ConfigError(f"{_named(f'{key}[{i}]')}: {describe_path(path)} {_not_a_file(path)}")
        if not os.access(path, os.R_OK):
            raise ConfigError(f"{_named(f'{key}[{i}]')}: {describe_path(path)} is not readable")


def _not_a_file(path):
    """What a path that is not a regular file is instead, as the end of a sentence."""
    path = Path(path)
    if path.is_symlink() and not path.exists():
        return f"is a symbolic link to {os.readlink(path)}, which does not exist"
    if not path.exists():
        return "does not exist"
    mode = path.stat().st_mode
    kinds = [(stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a named pipe (FIFO)"),
             (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a character device"),
             (stat.S_ISBLK, "a block device")]
    return f"is {next((name for test, name in kinds if test(mode)), 'special')}, not a regular file"


def check_paths(cfg, config_path=None):
    """The model, data and resume paths a run reads, and that train.out_dir and what a run writes
    there can be written without overwriting any of them (or the config file, config_path)."""
    if not cfg.data.train_files:  # a training run's (evaluate.py loads a config without them)
        raise ConfigError("config key 'data.train_files': needs at least one file")
    check_model_path(cfg.model.path)
    check_write_limit(cfg.model.path)
    longest = max(
        cfg.rollout.max_tokens, cfg.eval.max_tokens if cfg.eval.every and cfg.eval.files else 0)
    check_context(cfg.model.path, cfg.data.max_prompt_tokens + longest,
                  "data.max_prompt_tokens + rollout.max_tokens (or eval.max_tokens)")
    check_files(cfg.data.train_files, "data.train_files")
    if cfg.eval.every:
        check_files(cfg.eval.files, "eval.files")
    if cfg.train.resume not in ("auto", "never") and not (
            Path(cfg.train.resume) / "trainer.pt").is_file():
        raise ConfigError(
            f"config key 'train.resume': {describe_path(cfg.train.resume)} is not a complete "
            f"checkpoint (no trainer.pt)")
    out_dir = Path(cfg.train.out_dir)
    # what a run writes: checkpoints/ is pruned, hf/ replaced at the end
    outputs = [("train.out_dir", out_dir, "dir")] + [
        (f"train.out_dir ({name})", out_dir / name, kind) for name, kind, written in (
            ("config.yaml", "file", True), ("metrics.jsonl", "file", True),
            ("run.lock", "file", True), ("checkpoints", "dir", True), ("hf", "dir", True),
            ("tensorboard", "dir", cfg.train.tensorboard),
            ("wandb_run_id", "file", cfg.train.wandb))
        if written]
    inputs = [("model.path", cfg.model.path)] + [
        (f"{key}[{i}]", path) for key, paths in (("data.train_files", cfg.data.train_files),
                                                 ("eval.files", cfg.eval.files))
        for i, path in enumerate(paths)]
    # a run's own config.yaml may be its --config: it is rewritten with the same values and the
    # overrides, which is what it records
    own = (out_dir / "config.yaml").resolve()
    if config_path is not None and Path(config_path).resolve() != own:
        inputs.append(("--config", config_path))
    check_outputs(outputs[:1])  # it may hold inputs (a model, data): what the run writes may not
    for output in outputs[1:]:
        check_outputs([output], inputs)


def check_outputs(outputs, inputs=()):
    """That a command's outputs can be written and clobber nothing, before anything loads (creates
    nothing). outputs: (key, path, "file" | "dir"); inputs: (key, path) the command reads. An
    output must be of its kind where it exists, writable (or its nearest existing parent a writable
    directory), and not an input file, hold an input (a directory), be an existing file of an
    input directory (a file), or overlap another output. ConfigError naming the keys."""
    def inside(path, folder):  # path is folder or lies under it (links resolved)
        return path.resolve() == folder.resolve() or folder.resolve() in path.resolve().parents

    def same(a, b):  # one file or directory under two names (links resolved, hard links too)
        return a.resolve() == b.resolve() or (a.exists() and b.exists() and a.samefile(b))

    for i, (key, path, kind) in enumerate(outputs):
        path, name, where = Path(path), _named(key), describe_path(path)
        for input_key, source in inputs:
            source = Path(source)
            if (same(path, source) or (kind == "dir" and inside(source, path)) or (
                    kind == "file" and source.is_dir() and path.exists() and inside(path, source))):
                raise ConfigError(f"{name}: {where} would overwrite "
                                  f"{_named(input_key)} ({describe_path(source)}), which it reads")
        for other_key, other, other_kind in outputs[:i]:
            other = Path(other)
            if same(path, other) or (other_kind == "dir" and inside(path, other)) or (
                    kind == "dir" and inside(other, path)):
                raise ConfigError(f"{name} and {_named(other_key)} both name {where}")
        existing = next(p for p in [path, *path.parents] if p.exists())
        if existing == path and (kind == "dir") != path.is_dir():
            raise ConfigError(f"{name}: {where} is a " + (
                "file, not a directory" if kind == "dir" else "directory, not a file"))
        if existing != path and not existing.is_dir():
            raise ConfigError(f"{name}: {where} cannot be created ({existing} is a file)")
        if not os.access(existing, os.W_OK | (os.X_OK if existing.is_dir() else 0)):
            raise ConfigError(f"{name}: {where} cannot be written ({existing} is not writable)")
