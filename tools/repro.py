"""tools/repro.py: the paper's entropy effect in miniature: GRPO vs STARE (and STAPO, Lp-Reg, an
entropy bonus) on the tiny default, on CPU, and whether held entropy pays back on held-out prompts.

    python -m tools.tiny --out runs/tiny && python -m tools.repro --tiny runs/tiny --out runs/repro  # compare + sweep
    python -m tools.repro --tiny runs/tiny --out runs/repro --part compare --methods grpo stare_o1 stapo
    python -m tools.repro --tiny runs/tiny --out runs/repro --part sweep --ws 1.1 2 3 --ps 0.05 --seeds 0 1 2
    python -m tools.repro --tiny runs/tiny --out runs/repro --part payoff          # the countdown task, 5 seeds

Two tasks (tools/tiny.py), both with many right answers per prompt, so that an entropy collapse shows as the model settling
on few of them (rollout/distinct_correct_frac falls):
  sum        "write N as a+b": the compare and sweep parts' default
  countdown  "make T from three digits with + - *": a search task whose held-out prompts use digit triples never
             trained on; the payoff part's default
Every run evaluates the task's held-out prompts before training, every --eval-every steps and after the last step:
--eval-n samples per prompt, avg@n and unbiased pass@k (evaluate.py's estimator), the diversity of the correct
answers; the same samples' seed for every setting of a seed, so that settings compare in pairs.

Parts, under --out:
  compare/   the runs of COMPARE_RUNS with the same seeds, prompts and steps; compare.png (seed means +- SE)
  sweep/     STARE O1 over a grid of W x P and seeds; sweep.png: final entropy and diversity against W, and the
             critical strength W_c where the final entropy crosses halfway between GRPO's and the gate's target
  summary.json   final values (mean of the last --final-window steps), seed means and SEs, W_c measured and
                 predicted to first order (docs/method.md, Eq. 20: 1 - mean dH_grpo / mean dH_L+
                 over GRPO's batches within 25% of the target entropy).
  payoff/    PAYOFF_RUNS over --seeds: GRPO, STARE at the paper's W/P, Lp-Reg, an entropy bonus per --entropy-coefs,
             then STARE at the W that the GRPO runs' batches predict; payoff/summary.json (final held-out pass@k per
             setting, and its paired difference from GRPO with standard errors), payoff/payoff.png.
Each run writes metrics.jsonl with train.py's metric names (tools/plots.py draws them), heldout.jsonl and its config.yaml;
a complete run is not rerun, an unfinished one goes on from its last resume point (RESUME_EVERY).

Training goes through train.py's stages (group_responses, old_policy_pass, update_states,
select_tokens, policy_update, batch_metrics) in one process; only sampling differs: a batched
KV-cache loop over the same transformers model instead of a vLLM engine (whose start-up and weight
sync dominate a step at this size), on-policy. Dynamic sampling drops groups whose answers were all
judged alike; with RunSpec.refill_rounds it samples up to that many more rounds of prompts to fill
the batch, as train.py does (algorithm.max_num_gen_batches), else the batch stays short. A step
with fewer than RunSpec.min_kept_groups varied groups makes no update, and counts in
train/zero_signal_steps (such steps in a row). Distinct-correct compares token sequences.
"""

import argparse
import dataclasses
import json
import math
import multiprocessing
import os
import statistics
import sys
import time
from pathlib import Path

import torch

import baselines
import config
import data
import evaluate
import grpo
import modeling
import rewards
import stare
from tools import plots

TINY_CONFIG = Path(__file__).resolve().parents[1] / "configs" / "tiny.yaml"

# The comparison's runs: name -> loss settings (method + LossConfig fields); STARE's gate target is
# --target-entropy. "stare_o1"/"stare_c2" use the strength the sweep finds above the threshold;
# "stare_paper" is the paper's W = 1.1.
COMPARE_RUNS = {
    "grpo": dict(method="grpo"),
    "stare_paper": dict(method="stare", stare_variant="O1", stare_w=1.1, stare_top_ratio=0.1),
    "stare_o1": dict(method="stare", stare_variant="O1", stare_w=4.0, stare_top_ratio=0.05),
    "stare_c2": dict(
        method="stare", stare_variant="C2", stare_w=4.0, stare_m=0.5, stare_top_ratio=0.05),
    "stapo": dict(method="stapo"),
    "lp_reg": dict(method="lp_reg"),
    "adaptive_entropy": dict(method="adaptive_entropy"),
    "grpo_dropout": dict(method="grpo_dropout"),
    # the other policy losses under GRPO's advantages, no entropy method
    "gspo": dict(method="grpo", policy_loss="gspo"),
    "cispo": dict(method="grpo", policy_loss="cispo"),
    "sapo": dict(method="grpo", policy_loss="sapo"),
}


@dataclasses.dataclass
class RunSpec:
    """One training run of the miniature."""

    name: str  # directory name under its part
    loss: dict  # {"method": ..., LossConfig field: value, ...}
    seed: int = 0
    steps: int = 150
    prompts_per_step: int = 16
    target_entropy: float = 0.2
    lr: float | None = None  # None: configs/tiny.yaml's
    # the P values whose first-order W* every step logs (repro/w_critical@P)
    predict_ps: tuple = (0.1,)
    task: str = "sum"  # a key of TASKS
    # held-out evaluation before step 1, every eval_every steps and after the last (0: none)
    eval_every: int = 0
    eval_n: int = 64  # samples per held-out prompt
    # the second held-out split (TASKS' fourth entry) at step 0, every fresh_every steps and after
    # the last, under "fresh/" (0: never)
    fresh_every: int = 0
    # at these steps both held-out splits with endpoint_n samples per prompt, under "endpoint"
    endpoint_steps: tuple = ()
    endpoint_n: int = 64
    # rounds of prompts_per_step more prompts sampled while fewer than prompts_per_step groups
    # varied (train.py's dynamic sampling); 0: the first round's varied groups only
    refill_rounds: int = 0
    min_kept_groups: int = 1  # fewer varied groups than this: no update
    max_tokens: int | None = None  # response limit, training and held-out; None: tiny.yaml's (16)


# a run saves what it needs to go on (model, optimizer, method states, generators) every
# RESUME_EVERY steps to RESUME_FILE in its directory, removed once it is complete
RESUME_EVERY, RESUME_FILE = 25, "resume.pt"

# RunSpec fields added after runs were recorded: in a run's record only when not at this default,
# so that the runs recorded before them stay complete (is_complete)
ADDED_LATER = {"refill_rounds": 0, "min_kept_groups": 1, "max_tokens": None}


# --------------------------------------------------------------------------------------------------
# The task and the model
# --------------------------------------------------------------------------------------------------


# task -> (model directory, training split, held-out split, second held-out split or None) under
# the tiny directory (tools/tiny.py builds them)
TASKS = {"sum": ("model", "sum_train", "sum_test", None),
         "countdown": ("countdown_model", "countdown_train", "countdown_test", "countdown_fresh")}


def load_task(tiny_dir, tokenizer, max_prompt_tokens, split="sum_train"):
    """One split of a task's prompts -> (prompt ids [P, Lp] long, ground truths, data sources).

    The prompts of each task differ only in numbers of fixed width, so they tokenise to the same
    length and batch without padding; a prompt set where that fails is an error here rather than
    silently padded."""
    path = Path(tiny_dir) / "data" / f"{split}.jsonl"
    examples = data.load_examples(path, prompt_suffix=None)
    prompt_ids, examples, _ = data.tokenize_prompts(examples, tokenizer, max_prompt_tokens, "error")
    lengths = sorted({len(p) for p in prompt_ids})
    if len(lengths) != 1:
        raise ValueError(
            f"{path}: tools/repro.py batches prompts without padding and needs equal prompt lengths, "
            f"got lengths {lengths}")
    return (
        torch.tensor(prompt_ids), [e.ground_truth for e in examples],
        [e.data_source for e in examples])


def model_sha256(tiny_dir, task):
    """sha256 of the task's starting model.safetensors: what every result names (as tools/tiny.py
    prints it)."""
    import hashlib

    path = Path(tiny_dir) / TASKS[task][0] / "model.safetensors"
    return hashlib.sha256(path.read_bytes()).hexdigest()


def check_model(tiny_dir, task):
    """{task: sha256} of the task's starting model, with a loud warning when it is not
    tools/tiny.py's reference build: the committed results would then not be reproduced."""
    from tools import tiny

    found = model_sha256(tiny_dir, task)
    expected = tiny.REFERENCE_SHA256.get(TASKS[task][0])
    if expected and found != expected:
        print(f"WARNING: {Path(tiny_dir) / TASKS[task][0]}/model.safetensors has sha256 {found},"
              f" not tools/tiny.py's reference {expected}: these runs cannot reproduce the "
              "committed results (docs/results.md, \"Which model a result came from\")",
              file=sys.stderr)
    return {task: found}


def load_model(tiny_dir, task="sum", attn_implementation=modeling.ATTENTION):
    """The task's tiny model in float32, with train.py's attention (the packed rows of
    old_policy_pass and policy_update then cost no [L, L] mask)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        Path(tiny_dir) / TASKS[task][0], dtype=torch.float32,
        attn_implementation=attn_implementation)


@torch.no_grad()
def sample(model, prompts, n, max_tokens, eos_id, pad_id, generator, temperature=1.0):
    """n responses per prompt, sampled token by token from the model's tempered softmax (no
    top-p/top-k).

    prompts [P, Lp] long (equal lengths) -> (tokens [P*n, T] long, mask [P*n, T] bool, logprobs
    [P*n, T] float32), rows grouped by prompt (prompt i owns rows i*n .. i*n+n-1). A response ends
    at eos_id, which it includes (the policy chose it; vLLM's token_ids include it too); later
    positions hold pad_id, mask False. logprobs are the tempered log-probs of the sampled tokens (0
    where masked), as vLLM reports them. The prompt is prefilled once and its KV cache repeated n
    times; every row then costs one token per forward."""
    out = model(input_ids=prompts, use_cache=True, logits_to_keep=1)
    cache = out.past_key_values
    cache.batch_repeat_interleave(n)
    next_logits = out.logits[:, -1].repeat_interleave(n, dim=0)  # [P*n, V]
    rows = next_logits.shape[0]
    tokens = torch.full((rows, max_tokens), pad_id, dtype=torch.long)
    mask = torch.zeros(rows, max_tokens, dtype=torch.bool)
    sampled_logprobs = torch.zeros(rows, max_tokens)
    finished = torch.zeros(rows, dtype=torch.bool)
    width = max_tokens
    for t in range(max_tokens):
        logprobs = torch.log_softmax(next_logits.float() / temperature, dim=-1)  # [P*n, V]
        chosen = torch.multinomial(logprobs.exp(), 1, generator=generator).squeeze(1)  # [P*n]
        alive = ~finished
        tokens[:, t] = torch.where(alive, chosen, pad_id)
        mask[:, t] = alive
        sampled_logprobs[:, t] = logprobs.gather(1, chosen[:, None]).squeeze(1) * alive
        finished |= alive & (chosen == eos_id)
        if bool(finished.all()):
            width = t + 1
            break
        next_logits = model(
            input_ids=tokens[:, t : t + 1], past_key_values=cache, use_cache=True).logits[:, -1]
    return tokens[:, :width], mask[:, :width], sampled_logprobs[:, :width]


def sample_groups(model, tokenizer, prompts, truths, sources, cfg, generator):
    """n responses to each prompt ([G, Lp]) from the in-process sampler, scored -> grpo.Group list."""
    n = cfg.rollout.n
    tokens, mask, logprobs = sample(
        model, prompts, n, cfg.rollout.max_tokens, tokenizer.eos_token_id, tokenizer.pad_token_id,
        generator, cfg.rollout.temperature)
    lengths = mask.sum(1).tolist()
    responses = [tokens[r, :length].tolist() for r, length in enumerate(lengths)]
    texts = tokenizer.batch_decode(responses, skip_special_tokens=True)
    scores, accuracies, _ = rewards.compute_rewards(
        texts, [t for t in truths for _ in range(n)], [s for s in sources for _ in range(n)],
        lengths, cfg.reward)
    rows = [
        grpo.Response(
            prompt=prompts[r // n].tolist(),
            tokens=responses[r],
            rollout_logprobs=logprobs[r, : lengths[r]].tolist(),
            reward=scores[r],
            accuracy=accuracies[r],
            truncated=lengths[r] == cfg.rollout.max_tokens
            and responses[r][-1] != tokenizer.eos_token_id,
            reflection=rewards.reflection_counts(texts[r]),
            policy_mask=torch.ones(lengths[r], dtype=torch.bool))
        for r in range(len(responses))]
    return [grpo.Group(rows[g * n].prompt, rows[g * n:(g + 1) * n]) for g in range(len(prompts))]


@torch.no_grad()
def heldout_metrics(model, tokenizer, prompts, truths, sources, cfg, n, generator,
                    prompts_per_batch=16):
    """n samples for each held-out prompt ([P, Lp]) at the rollout temperature, scored ->
    {"heldout/...": value}: avg@n (mean accuracy), unbiased pass@k for k in evaluate.ks_for(n) (per
    prompt, then the mean over prompts), the fraction of prompts solved by at least one sample, the
    diversity of the correct answers (rewards.distinct_correct_fraction, None when nothing is
    correct) and the per-prompt correct counts, in the prompts' order ("heldout/correct")."""
    model.eval()
    groups = []
    for start in range(0, len(prompts), prompts_per_batch):
        batch = slice(start, start + prompts_per_batch)
        tokens, mask, _ = sample(
            model, prompts[batch], n, cfg.rollout.max_tokens, tokenizer.eos_token_id,
            tokenizer.pad_token_id, generator, cfg.rollout.temperature)
        lengths = mask.sum(1).tolist()
        responses = [tokens[r, :length].tolist() for r, length in enumerate(lengths)]
        texts = tokenizer.batch_decode(responses, skip_special_tokens=True)
        _, accuracies, _ = rewards.compute_rewards(
            texts, [t for t in truths[batch] for _ in range(n)],
            [s for s in sources[batch] for _ in range(n)], lengths, cfg.reward)
        groups += [list(zip(responses[p * n:(p + 1) * n], accuracies[p * n:(p + 1) * n]))
                   for p in range(len(texts) // n)]
    return heldout_summary(groups, n)


def heldout_summary(groups, n):
    """groups: per prompt, its n (response tokens, accuracy) pairs -> the "heldout/" metrics of heldout_metrics."""
    correct_counts = [int(sum(accuracy > 0 for _, accuracy in group)) for group in groups]
    metrics = {f"heldout/avg@{n}": statistics.mean(c / n for c in correct_counts)}
    for k in evaluate.ks_for(n):
        metrics[f"heldout/pass@{k}"] = statistics.mean(
            evaluate.pass_at_k(n, c, k) for c in correct_counts)
    metrics["heldout/solved_frac"] = statistics.mean(c > 0 for c in correct_counts)
    metrics["heldout/distinct_correct_frac"] = rewards.distinct_correct_fraction(groups)
    metrics["heldout/correct"] = correct_counts
    return metrics


# --------------------------------------------------------------------------------------------------
# One run
# --------------------------------------------------------------------------------------------------


def critical_w(advantages, sensitivity, logprobs, mask, top_ratio):
    """The first-order prediction for O1 (module docstring): (dH_grpo, dH_L+, W*) for one batch,
    0-dim tensors.

    advantages [B], sensitivity/logprobs [B, T], mask [B, T]. W* is NaN when it does not exist
    (dH_L+ <= 0, or GRPO's own drift is not negative: nothing to cancel)."""
    grpo = stare.entropy_dynamics(advantages, sensitivity, mask)["total/dH"]
    doubled, _ = stare.stare_weights(
        logprobs, advantages, mask, "O1", top_ratio, w=2.0, gate_on=True
    )  # 2 on L+
    lplus = (
        stare.entropy_dynamics(advantages, sensitivity, mask, weights=doubled)["total/dH"] - grpo)
    exists = (lplus > 0) & (grpo < 0)
    w_star = torch.where(exists, 1.0 - grpo / lplus.clamp(min=1e-12), torch.full((), float("nan")))
    return grpo, lplus, w_star


def run_config(spec):
    """configs/tiny.yaml with the run's loss settings, gate target, seed and steps: the settings train.py would use."""
    # STARE's weights live in the gate section, EntroPIC's gains in its own
    keys = {"stare_w": "gate.w", "stare_m": "gate.m", "entropic_kp": "entropic.kp",
            "entropic_ki": "entropic.ki", "entropic_start": "entropic.start",
            "entropic_anti_windup": "entropic.anti_windup"}
    overrides = [
        f"{keys.get(key, 'loss.' + key)}={value}"
        for key, value in spec.loss.items()
        if key != "method"]
    overrides += [
        f"algorithm.method={spec.loss['method']}", f"gate.target_entropy={spec.target_entropy}",
        f"train.seed={spec.seed}", f"train.total_steps={spec.steps}"]
    if spec.lr is not None:
        overrides.append(f"optim.lr={spec.lr}")
    if spec.max_tokens is not None:
        overrides += [f"rollout.max_tokens={spec.max_tokens}", f"eval.max_tokens={spec.max_tokens}"]
    return config.load(TINY_CONFIG, overrides)


def train_run(spec, tiny_dir, out_dir):
    """Train one run of the miniature through train.py's stages; writes out_dir/config.yaml,
    out_dir/metrics.jsonl (one line per step, as it goes) and, with spec.eval_every,
    out_dir/heldout.jsonl (one line per held-out evaluation, step 0 being the model before
    training); returns the list of per-step metric dicts."""
    from transformers import AutoTokenizer

    cfg = run_config(spec)
    cpu = torch.device("cpu")
    model_dir, train_split, heldout_split, fresh_split = TASKS[spec.task]
    tokenizer = AutoTokenizer.from_pretrained(Path(tiny_dir) / model_dir)
    prompts, truths, sources = load_task(
        tiny_dir, tokenizer, cfg.data.max_prompt_tokens, train_split)
    heldout_task = load_task(tiny_dir, tokenizer, cfg.data.max_prompt_tokens, heldout_split)
    if spec.fresh_every and fresh_split is None:
        raise ValueError(f"task {spec.task!r} has no second held-out split (fresh_every)")
    fresh_task = (load_task(tiny_dir, tokenizer, cfg.data.max_prompt_tokens, fresh_split)
                  if spec.fresh_every or spec.endpoint_steps else None)
    torch.manual_seed(spec.seed)
    model = load_model(tiny_dir, spec.task, cfg.model.attn_implementation)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.optim.lr, betas=tuple(cfg.optim.betas),
                                  weight_decay=cfg.optim.weight_decay)
    states = baselines.method_states(cfg)  # STARE's gate, and EntroPIC's controller
    sampler = torch.Generator().manual_seed(data.derive_seed(spec.seed, "repro", "responses"))
    # the prompt order: the same for every method of a seed
    order = torch.Generator().manual_seed(data.derive_seed(spec.seed, "repro", "prompts"))
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    record, resume_path = spec_record(spec, tiny_dir), out_dir / RESUME_FILE
    # an unfinished run of this very spec goes on from its last resume point
    same_run = (out_dir / "repro.json").exists() and json.loads(
        (out_dir / "repro.json").read_text()) == record
    saved = (torch.load(resume_path, weights_only=False) if same_run and resume_path.exists()
             else None)
    # the objective's settings (tools/plots.py reads the target)
    (out_dir / "config.yaml").write_text(config.to_yaml(cfg))
    # the run's own: batch, steps, swept P, the starting model's sha256
    (out_dir / "repro.json").write_text(json.dumps(record))
    heldout_log = out_dir / "heldout.jsonl"

    # the same samples' seed for every method of a seed: paired comparisons
    def evaluate_heldout(step):
        def due(every):
            return every and (step % every == 0 or step == spec.steps)

        if due(spec.eval_every) or step in spec.endpoint_steps:
            generator = torch.Generator().manual_seed(
                data.derive_seed(spec.seed, "repro", "heldout", step))
            record = {
                "step": step,
                **heldout_metrics(model, tokenizer, *heldout_task, cfg, spec.eval_n, generator),
            }
            if step in spec.endpoint_steps:
                record["endpoint"] = {
                    split: heldout_metrics(
                        model, tokenizer, *task, cfg, spec.endpoint_n, torch.Generator().manual_seed(
                            data.derive_seed(spec.seed, "repro", "endpoint", split, step)))
                    for split, task in (("A", heldout_task), ("B", fresh_task))}
            if due(spec.fresh_every):
                generator = torch.Generator().manual_seed(
                    data.derive_seed(spec.seed, "repro", "fresh", step))
                fresh = heldout_metrics(model, tokenizer, *fresh_task, cfg, spec.eval_n, generator)
                record.update({"fresh/" + key.split("/", 1)[1]: v for key, v in fresh.items()})
            with open(heldout_log, "a") as log:
                log.write(json.dumps(record) + "\n")

    generators = {"sampler": sampler, "order": order}
    if saved is None:
        heldout_log.unlink(missing_ok=True)
        records, zero_signal_steps, first_step = [], 0, 1
        evaluate_heldout(0)
    else:
        model.load_state_dict(saved["model"])
        optimizer.load_state_dict(saved["optimizer"])
        for name, state in states.items():
            state.load_state_dict(saved["states"][name])
        for name, generator in generators.items():
            generator.set_state(saved[name])
        torch.set_rng_state(saved["torch"])
        records = read_records(out_dir / "metrics.jsonl")[:saved["step"]]
        zero_signal_steps, first_step = saved["zero_signal_steps"], saved["step"] + 1
        evaluations = read_records(heldout_log) if heldout_log.exists() else []
        heldout_log.write_text("".join(json.dumps(e) + "\n" for e in evaluations
                                       if e["step"] <= saved["step"]))
    with open(out_dir / "metrics.jsonl", "w") as log:
        log.write("".join(json.dumps(r) + "\n" for r in records))
        for step in range(first_step, spec.steps + 1):
            start = time.time()
            model.eval()
            # train.py's filter; rounds of new prompts while the batch is short (refill_rounds)
            groups, kept, rounds = [], [], 0
            while rounds <= spec.refill_rounds and len(kept) < spec.prompts_per_step:
                chosen = torch.cat(
                    [
                        torch.randperm(len(prompts), generator=order)
                        for _ in range(-(-spec.prompts_per_step // len(prompts)))]
                )[: spec.prompts_per_step]
                sampled_groups = sample_groups(
                    model, tokenizer, prompts[chosen], [truths[p] for p in chosen],
                    [sources[p] for p in chosen], cfg, sampler)
                groups += sampled_groups
                kept += [group for group in sampled_groups if group.varied]
                rounds += 1
            kept = kept[:spec.prompts_per_step]
            updating = len(kept) >= spec.min_kept_groups
            zero_signal_steps = 0 if updating else zero_signal_steps + 1
            sampled = [r for group in groups for r in group.responses]
            metrics = {
                "step": step,
                "rollout/acc_before_filter": statistics.mean(r.accuracy for r in sampled),
                "rollout/distinct_correct_frac": rewards.distinct_correct_fraction(
                    [[(r.tokens, r.accuracy) for r in group.responses] for group in groups]),
                "rollout/response_length_mean": statistics.mean(len(r.tokens) for r in sampled),
                "train/kept_groups": len(kept),
                "rollout/gen_rounds": rounds,
                "rollout/varied_group_frac": sum(g.varied for g in groups) / len(groups),
                "train/zero_signal_steps": zero_signal_steps,
            }
            if updating:
                # train.py's stages, in its order
                responses = grpo.group_responses(kept, cfg, rank=0, world=1)
                grpo.old_policy_pass(model, responses, cfg, cpu)
                num_tokens, state_metrics = grpo.update_states(states, responses, cpu)
                metrics.update(state_metrics)
                metrics.update(grpo.select_tokens(responses, cfg, states, step, cpu))
                metrics.update(grpo.policy_update(model, optimizer, responses, cfg, states, step,
                                                  cpu))
                metrics.update(grpo.batch_metrics(responses, num_tokens, cpu))
                metrics.update(critical_w_metrics(responses, spec.predict_ps))
            metrics["stare/gate_on"] = float(states["gate"].gate_on)
            metrics["time/step"] = time.time() - start
            records.append(metrics)
            log.write(json.dumps(metrics) + "\n")
            log.flush()
            evaluate_heldout(step)
            if step % RESUME_EVERY == 0 and step < spec.steps:
                torch.save({"step": step, "model": model.state_dict(),
                            "optimizer": optimizer.state_dict(),
                            "states": {name: state.state_dict() for name, state in states.items()},
                            **{name: g.get_state() for name, g in generators.items()},
                            "torch": torch.get_rng_state(), "zero_signal_steps": zero_signal_steps},
                           resume_path.with_suffix(".tmp"))
                os.replace(resume_path.with_suffix(".tmp"), resume_path)  # never half-written
    resume_path.unlink(missing_ok=True)
    return records


def critical_w_metrics(responses, predict_ps):
    """The first-order prediction's pieces for this batch (module docstring), for each swept P."""
    advantages = torch.tensor([r.advantage for r in responses])
    sensitivity, logprobs, mask = (modeling.pad_rows([getattr(r, key) for r in responses])
                                   for key in ("sensitivity", "old_logprobs", "policy_mask"))
    metrics = {}
    for top_ratio in predict_ps:
        dh_grpo, dh_lplus, w_star = critical_w(advantages, sensitivity, logprobs, mask, top_ratio)
        metrics.update(
            {
                "repro/dH_grpo": float(dh_grpo),
                f"repro/dH_lplus@{top_ratio:g}": float(dh_lplus),
                f"repro/w_critical@{top_ratio:g}": float(w_star),
            })
    return metrics


# --------------------------------------------------------------------------------------------------
# Many runs: a process pool, one thread per run (a 2x128 model does not use two cores well in one
# process)
# --------------------------------------------------------------------------------------------------


def read_records(path):
    """A run's metrics.jsonl -> list of dicts (a half-written last line, from a run that was killed, is dropped)."""
    records = []
    for line in Path(path).read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            break
    return records


def spec_record(spec, tiny_dir):
    """A RunSpec and its starting model's sha256 as the JSON a run directory keeps: a rerun reuses
    the directory only if it matches (a run from another model is rerun, not mixed in)."""
    record = {key: value for key, value in json.loads(json.dumps(dataclasses.asdict(spec))).items()
              if key not in ADDED_LATER or value != ADDED_LATER[key]}
    return {**record, "model_sha256": model_sha256(tiny_dir, spec.task)}


def _run_in_worker(job):
    spec, tiny_dir, out_dir = job
    torch.set_num_threads(1)
    started = time.time()
    train_run(spec, tiny_dir, out_dir)
    return spec, time.time() - started


def is_complete(spec, tiny_dir, out_dir):
    """Whether out_dir holds a finished run of exactly this spec from this starting model."""
    metrics, record = Path(out_dir) / "metrics.jsonl", Path(out_dir) / "repro.json"
    heldout = Path(out_dir) / "heldout.jsonl"
    evaluations = read_records(heldout) if heldout.exists() else []
    return bool(
        metrics.exists()
        and record.exists()
        and json.loads(record.read_text()) == spec_record(spec, tiny_dir)
        and len(read_records(metrics)) >= spec.steps
        and (not spec.eval_every or (evaluations and evaluations[-1]["step"] == spec.steps)))


def run_all(jobs, workers):
    """Run every (spec, tiny_dir, out_dir) job that out_dir does not already hold complete, with the
    same RunSpec (so an interrupted `tools/repro.py` goes on with only the unfinished runs, each
    from its last resume point; changed settings rerun everything they touch), `workers` at a
    time; returns {out_dir: the first spec.steps records}."""
    from tqdm import tqdm

    todo = [job for job in jobs if not is_complete(*job)]
    if todo:
        progress = tqdm(total=len(todo), desc="runs", unit="run")
        # each worker forked from one server per process that imported the run's modules once
        # (about 15 s a fresh interpreter would spend on every call), with the environment of the
        # server's start; `python -m tools.repro` runs main from the module by name, so what the
        # jobs pickle resolves in the workers
        context = multiprocessing.get_context("forkserver")
        context.set_forkserver_preload(["tools.repro"])  # a run samples in-process, no vLLM
        with context.Pool(min(workers, len(todo))) as pool:
            for spec, seconds in pool.imap_unordered(_run_in_worker, todo):
                progress.set_postfix_str(f"{spec.name} seed {spec.seed}: {seconds:.0f} s")
                progress.update()
        progress.close()
    return {
        str(out_dir): read_records(Path(out_dir) / "metrics.jsonl")[: spec.steps]
        for spec, _, out_dir in jobs
    }


# --------------------------------------------------------------------------------------------------
# Summaries: final values, the measured and the predicted critical strength
# --------------------------------------------------------------------------------------------------

FINAL_KEYS = ("train/entropy", "rollout/distinct_correct_frac", "rollout/acc_before_filter")


def final_values(records, window):
    """Mean of each FINAL_KEYS metric over the last `window` steps (steps where it is None are skipped)."""
    result = {}
    for key in FINAL_KEYS:
        values = [r[key] for r in records[-window:] if r.get(key) is not None]
        result[key] = statistics.mean(values) if values else float("nan")
    return result


def crossing(xs, ys, level):
    """The first x at which the piecewise-linear curve through (xs, ys) (xs increasing) reaches
    `level` from below; None if it never does, xs[0] if it starts there."""
    for i, (x, y) in enumerate(zip(xs, ys)):
        if y >= level:
            if i == 0:
                return x
            x0, y0 = xs[i - 1], ys[i - 1]
            return x0 + (level - y0) * (x - x0) / (y - y0)
    return None


def predicted_critical_w(grpo_runs, target_entropy, top_ratio, band=0.25):
    """The first-order W_c (module docstring) from GRPO's batches whose entropy is within +-band*target of the
    target: 1 - mean(dH_grpo) / mean(dH_L+). Ratio of means, not mean of per-batch ratios: a single batch's dH_L+
    is noisy and crosses zero. Returns (W_c or None when mean dH_L+ <= 0, i.e. amplifying L+ lowers the entropy
    to first order and no W can cancel the drift; the two means; the number of batches)."""
    key = f"repro/dH_lplus@{top_ratio:g}"
    batches = [r for records in grpo_runs for r in records
               if key in r and abs(r["train/entropy"] - target_entropy) <= band * target_entropy]
    if not batches:
        return None, float("nan"), float("nan"), 0
    dh_grpo = statistics.mean(r["repro/dH_grpo"] for r in batches)
    dh_lplus = statistics.mean(r[key] for r in batches)
    w_c = 1.0 - dh_grpo / dh_lplus if dh_lplus > 0 and dh_grpo < 0 else None
    return w_c, dh_grpo, dh_lplus, len(batches)


def summarize_group(records_by_seed, window):
    """Final values (seed mean, SE, per seed) and, per seed, how the run got there: the first step
    with the gate on, the fraction of steps with it on, the mean fraction of tokens whose loss
    differs from GRPO's, the wall time."""
    finals = [final_values(records, window) for records in records_by_seed]
    summary = {}
    for key in FINAL_KEYS:
        mean, se = plots.mean_and_se([f[key] for f in finals])
        summary[key.split("/")[-1]] = {"mean": mean, "se": se, "per_seed": [f[key] for f in finals]}
    updates = [[r for r in records if "train/touched_frac" in r] for records in records_by_seed]
    summary["per_seed"] = {
        "first_gate_on_step": [
            next((r["step"] for r in records if r["stare/gate_on"]), None)
            for records in records_by_seed],
        "gate_on_frac": [
            statistics.mean(r["stare/gate_on"] for r in records) for records in records_by_seed],
        "touched_frac": [
            statistics.mean(r["train/touched_frac"] for r in rows) if rows else 0.0
            for rows in updates],
        "seconds": [round(sum(r["time/step"] for r in records), 1) for records in records_by_seed],
    }
    return summary


# --------------------------------------------------------------------------------------------------
# The payoff comparison: does held entropy pay back on held-out prompts?
# --------------------------------------------------------------------------------------------------

# name -> loss settings. "stare_predicted" gets its stare_w from the first-order analysis of the
# GRPO runs of the same comparison (predicted_critical_w at its stare_top_ratio); "entropy_bonus"
# runs once per --entropy-coefs value, and the summary names, for each STARE setting, the
# coefficient whose mean entropy came closest to its own.
PAYOFF_RUNS = {
    "grpo": dict(method="grpo"),
    "stare_paper": COMPARE_RUNS["stare_paper"],
    "stare_predicted": dict(method="stare", stare_variant="O1", stare_top_ratio=0.05),
    # the strength that held the sum task's entropy at the target
    "stare_holding": COMPARE_RUNS["stare_o1"],
    "lp_reg": dict(method="lp_reg"),
    "entropy_bonus": dict(method="entropy_bonus"),
}


def read_heldout(run_dir):
    """A run's heldout.jsonl -> {step: metrics}."""
    return {record["step"]: record for record in read_records(Path(run_dir) / "heldout.jsonl")}


def paired_difference(values, baseline):
    """Per-seed differences values[i] - baseline[i] -> mean, paired standard error (SD /
    sqrt(seeds)), bootstrap standard error of the mean (evaluate.bootstrap_se), and how many seeds
    are above / below zero. A seed where either value is NaN (e.g. no correct answer to measure the
    diversity of) is left out of the statistics."""
    diffs = [v - b for v, b in zip(values, baseline)]
    finite = [d for d in diffs if not math.isnan(d)]
    mean, se = plots.mean_and_se(finite)
    return {
        "mean": mean,
        "paired_se": se,
        "bootstrap_se": evaluate.bootstrap_se(finite) if finite else math.nan,
        "seeds_above": sum(d > 0 for d in finite),
        "seeds_below": sum(d < 0 for d in finite),
        "per_seed": diffs,
    }


def heldout_comparison(runs, steps, ks):
    """runs: {setting: [(metrics records, held-out records by step) per seed]}, "grpo" among them ->
    per setting: the training entropy (mean over all steps, and over the last 20), the held-out
    pass@k (k in ks), solved and distinct-correct fractions after `steps` (seed means, SE, per
    seed), and each one's paired difference from GRPO's."""
    keys = [f"heldout/pass@{k}" for k in ks] + [
        "heldout/distinct_correct_frac", "heldout/solved_frac"]
    per_setting = {}
    for name, seeds in runs.items():
        values = {
            "entropy_mean": [
                plots.mean_and_se([r.get("train/entropy", math.nan) for r in records])[0]
                # steps without an update (no varied group) skipped
                for records, _ in seeds],
            "entropy_final": [
                plots.mean_and_se([r.get("train/entropy", math.nan) for r in records[-20:]])[0]
                for records, _ in seeds],
        }
        for key in keys:
            finals = [heldout[steps].get(key) for _, heldout in seeds]
            values[key] = [float("nan") if v is None else v for v in finals]
        per_setting[name] = values
    summary = {}
    for name, values in per_setting.items():
        summary[name] = {}
        for key, per_seed in values.items():
            mean, se = plots.mean_and_se(per_seed)
            entry = {"mean": mean, "se": se, "per_seed": per_seed}
            if name != "grpo":
                entry["minus_grpo"] = paired_difference(per_seed, per_setting["grpo"][key])
            summary[name][key] = entry
    return summary


def run_payoff(args, out, workers):
    """--part payoff: every PAYOFF_RUNS setting over --seeds on --task, with held-out evaluations;
    GRPO and the settings that do not depend on it first, then STARE at the W that GRPO's batches
    predict. Writes payoff/summary.json and payoff/payoff.png under out and returns the summary."""
    common = dict(
        steps=args.steps, prompts_per_step=args.prompts_per_step,
        target_entropy=args.target_entropy, lr=args.lr,
        predict_ps=(PAYOFF_RUNS["stare_predicted"]["stare_top_ratio"],), task=args.task,
        eval_every=args.eval_every, eval_n=args.eval_n)
    # GRPO always: the baseline of every pair, and the prediction's data
    chosen = {"grpo", *args.payoff_runs}
    settings = {name: loss for name, loss in PAYOFF_RUNS.items()
                if name in chosen and name not in ("stare_predicted", "entropy_bonus")}
    if "entropy_bonus" in chosen:
        settings.update({f"entropy_bonus_{c:g}": {**PAYOFF_RUNS["entropy_bonus"], "entropy_coef": c}
                         for c in args.entropy_coefs})
    root = out / "payoff"

    def jobs(names):
        return [
            (
                RunSpec(name, settings[name], seed=seed, **common), args.tiny,
                root / f"{name}_seed{seed}")
            for name in names
            for seed in args.seeds]

    first = jobs(list(settings))
    then = ", then STARE at the predicted W" if "stare_predicted" in chosen else ""
    print(
        f"payoff on {args.task}: {len(first)} runs of {args.steps} steps{then}, {workers} at a time, under {root}",
        file=sys.stderr)
    started = time.time()
    results = run_all(first, workers)
    top_ratio = PAYOFF_RUNS["stare_predicted"]["stare_top_ratio"]
    grpo_records = [results[str(root / f"grpo_seed{seed}")] for seed in args.seeds]
    w_c, dh_grpo, dh_lplus, batches = predicted_critical_w(
        grpo_records, args.target_entropy, top_ratio)
    prediction = {
        "w": w_c,
        "top_ratio": top_ratio,
        "dH_grpo": dh_grpo,
        "dH_lplus": dh_lplus,
        "batches": batches,
    }
    if w_c is not None and "stare_predicted" in chosen:
        name = f"stare_predicted_w{w_c:.2f}"
        settings[name] = {**PAYOFF_RUNS["stare_predicted"], "stare_w": round(w_c, 2)}
        results.update(run_all(jobs([name]), workers))
    elif "stare_predicted" in chosen:
        print(
            f"no first-order W at P = {top_ratio:g} ({batches} GRPO batches near the target, "
            f"dH_grpo {dh_grpo:.2e}, dH_L+ {dh_lplus:.2e}): STARE at the predicted W is not run",
            file=sys.stderr)
    runs = {
        name: [
            (results[str(root / f"{name}_seed{seed}")], read_heldout(root / f"{name}_seed{seed}"))
            for seed in args.seeds]
        for name in settings
    }
    ks = evaluate.ks_for(args.eval_n)
    summary = {"settings": {**vars(args), "tiny": str(args.tiny), "out": str(args.out)},
               "model_sha256": check_model(args.tiny, args.task),  # the starting model, by content
               "prediction": prediction, "runs": heldout_comparison(runs, args.steps, ks)}
    bonuses = [name for name in settings if name.startswith("entropy_bonus")]
    # per STARE setting, the bonus whose mean entropy comes closest to it
    summary["entropy_matched_bonus"] = {
        name: min(
            bonuses,
            key=lambda bonus: abs(
                summary["runs"][bonus]["entropy_mean"]["mean"]
                - summary["runs"][name]["entropy_mean"]["mean"]),
            default=None)
        for name in settings
        if name.startswith("stare")
    }
    summary["before_training"] = {
        key: plots.mean_and_se([heldout[0][key] for _, heldout in runs["grpo"]])[0]
        for key, value in runs["grpo"][0][1][0].items()
        if key != "step" and not isinstance(value, list)  # per-prompt counts are not averaged
    }
    summary["seconds_this_invocation"] = round(time.time() - started, 1)
    (root / "summary.json").write_text(json.dumps(summary, indent=1))
    plots.plot_payoff(
        runs, summary["runs"], ks, args.steps, args.target_entropy, root / "payoff.png")
    print_heldout(summary["runs"], ks)
    for name, bonus in summary["entropy_matched_bonus"].items():
        print(f"entropy-matched to {name}: {bonus}")
    print(f"starting model sha256 {summary['model_sha256']}")
    print(f"{summary['seconds_this_invocation']:.0f} s (runs already complete were read back)")
    return summary


def print_heldout(runs, ks):
    """runs: heldout_comparison's result -> a table of entropy and final held-out pass@k with paired differences."""
    shown = [k for k in ks if k in (1, 8, ks[-1])]
    columns = (
        ["entropy_mean"] + [f"heldout/pass@{k}" for k in shown] + ["heldout/distinct_correct_frac"])
    print(f"{'setting':<28}" + "".join(f"{c.split('/')[-1]:>30}" for c in columns))
    for name, stats in runs.items():
        cells = []
        for column in columns:
            entry = stats[column]
            cell = f"{entry['mean']:.3f}"
            if "minus_grpo" in entry:
                diff = entry["minus_grpo"]
                cell += f" ({diff['mean']:+.3f} ± {diff['paired_se']:.3f})"
            cells.append(cell)
        print(f"{name:<28}" + "".join(f"{c:>30}" for c in cells))
    print("(in brackets: the paired difference from GRPO over seeds ± its standard error)")


# --------------------------------------------------------------------------------------------------
# main
# --------------------------------------------------------------------------------------------------


def parse_args(argv):
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--tiny", default="runs/tiny", help="the tiny default's directory (built if missing)")
    parser.add_argument("--out", default="runs/repro")
    parser.add_argument(
        "--part", choices=("all", "compare", "sweep", "payoff"), default="all",
        help="all = compare + sweep; payoff: the held-out comparison (PAYOFF_RUNS), on its own")
    parser.add_argument("--task", choices=list(TASKS), default=None,
                        help="the task (default: sum, but countdown for --part payoff)")
    parser.add_argument(
        "--eval-every", type=int, default=None,
        help="held-out evaluation every this many steps and after the last (default 50; 0: none)")
    parser.add_argument("--eval-n", type=int, default=64, help="samples per held-out prompt")
    parser.add_argument("--entropy-coefs", nargs="+", type=float, default=[0.01, 0.02, 0.03, 0.1],
                        help="the entropy bonus's coefficients in --part payoff")
    parser.add_argument(
        "--payoff-runs", nargs="+", default=list(PAYOFF_RUNS), choices=list(PAYOFF_RUNS),
        help="the settings of --part payoff (see PAYOFF_RUNS; grpo always runs)")
    parser.add_argument(
        "--methods", nargs="+", default=list(COMPARE_RUNS), choices=list(COMPARE_RUNS),
        help="the comparison's runs (see COMPARE_RUNS)")
    parser.add_argument("--ws", nargs="+", type=float, default=[1.1, 2.0, 4.0, 8.0],
                        help="the sweep's W values (STARE O1)")
    parser.add_argument(
        "--ps", nargs="+", type=float, default=[0.05, 0.1, 0.2], help="the sweep's P values")
    parser.add_argument(
        "--seeds", nargs="+", type=int, default=None, help="default: 0 1 2 (payoff: 0 1 2 3 4)")
    parser.add_argument("--steps", type=int, default=None, help="default: 150 (payoff: 300)")
    parser.add_argument("--prompts-per-step", type=int, default=16)
    parser.add_argument(
        "--target-entropy", type=float, default=0.2, help="STARE's gate target (the sweep's too)")
    parser.add_argument(
        "--lr", type=float, default=None, help="default: configs/tiny.yaml's optim.lr")
    parser.add_argument(
        "--final-window", type=int, default=20, help="steps averaged for the final values")
    parser.add_argument(
        "--workers", type=int, default=None, help="runs in parallel (default: CPU cores)")
    args = parser.parse_args(argv)
    payoff = args.part == "payoff"
    defaults = {"seeds": [0, 1, 2, 3, 4] if payoff else [0, 1, 2], "steps": 300 if payoff else 150,
                "task": "countdown" if payoff else "sum", "eval_every": 50}
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.eval_every < 0 or args.eval_n < 1 or any(c < 0 for c in args.entropy_coefs):
        parser.error("--eval-every must be >= 0, --eval-n >= 1 and --entropy-coefs >= 0")
    for name in ("steps", "prompts_per_step", "final_window"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    if any(not 0 < p <= 1 for p in args.ps) or any(w <= 0 for w in args.ws):
        parser.error("--ps must lie in (0, 1] and --ws be > 0")
    return args


def main(argv):
    from tools import tiny

    args = parse_args(argv)
    tiny.build_tiny(args.tiny)  # each reused when complete
    if args.task == "countdown":
        tiny.build_tiny_countdown(args.tiny)
    check_model(args.tiny, args.task)  # warned before the runs, not only in the summary
    out = Path(args.out)
    workers = args.workers or max(1, min(len(os.sched_getaffinity(0)), 8))
    if args.part == "payoff":
        run_payoff(args, out, workers)
        return 0
    common = dict(
        steps=args.steps, prompts_per_step=args.prompts_per_step,
        target_entropy=args.target_entropy, lr=args.lr,
        predict_ps=tuple(sorted(set(args.ps) | {0.1, 0.2})), task=args.task,
        eval_every=args.eval_every, eval_n=args.eval_n)

    def sweep_name(w, p):
        return f"stare_o1_w{w:g}_p{p:g}"

    def sweep_loss(w, p):
        return dict(method="stare", stare_variant="O1", stare_w=w, stare_top_ratio=p)

    jobs = {}  # out_dir -> RunSpec
    run_dirs = {}  # (part, name) -> the directory of its seed-0 run, "{seed}" left to fill
    if args.part in ("all", "sweep"):
        for p in args.ps:
            for w in args.ws:
                run_dirs["sweep", sweep_name(w, p)] = (
                    out / "sweep" / (sweep_name(w, p) + "_seed{seed}"))
                for seed in args.seeds:
                    jobs[out / "sweep" / f"{sweep_name(w, p)}_seed{seed}"] = RunSpec(
                        sweep_name(w, p), sweep_loss(w, p), seed=seed, **common)
    sweep_points = {json.dumps(spec.loss, sort_keys=True): spec.name for spec in jobs.values()}
    compare_names = (
        ["grpo"] + [m for m in args.methods if m != "grpo"]
        if args.part in ("all", "compare")
        else ["grpo"])
    # GRPO always: it is the sweep's baseline and the first-order prediction's data
    for name in compare_names:
        same = sweep_points.get(json.dumps(COMPARE_RUNS[name], sort_keys=True))
        if same is not None:  # e.g. stare_o1 is a sweep point: one run serves both
            run_dirs["compare", name] = run_dirs["sweep", same]
            continue
        run_dirs["compare", name] = out / "compare" / (name + "_seed{seed}")
        for seed in args.seeds:
            jobs[out / "compare" / f"{name}_seed{seed}"] = RunSpec(
                name, COMPARE_RUNS[name], seed=seed, **common)
    print(
        f"{len(jobs)} runs of {args.steps} steps ({args.prompts_per_step} prompts x 8 responses), "
        f"{workers} at a time, under {out}",
        file=sys.stderr)
    started = time.time()
    results = run_all([(spec, args.tiny, out_dir) for out_dir, spec in jobs.items()], workers)

    def seeds_of(part, name):
        return [results[str(run_dirs[part, name]).format(seed=seed)] for seed in args.seeds]

    summary = {"settings": {**vars(args), "runs": len(jobs)},
               "model_sha256": check_model(args.tiny, args.task)}  # the starting model, by content
    compare_groups = {name: seeds_of("compare", name) for name in compare_names}
    summary["compare"] = {
        name: summarize_group(runs, args.final_window) for name, runs in compare_groups.items()
    }
    plots.plot_compare(compare_groups, args.target_entropy, out / "compare.png")
    if args.eval_every:  # the comparison's held-out evaluations, paired with GRPO's
        heldout_runs = {
            name: [
                (records, read_heldout(str(run_dirs["compare", name]).format(seed=seed)))
                for records, seed in zip(compare_groups[name], args.seeds)]
            for name in compare_names
        }
        ks = evaluate.ks_for(args.eval_n)
        summary["compare_heldout"] = heldout_comparison(heldout_runs, args.steps, ks)
        plots.plot_payoff(
            heldout_runs, summary["compare_heldout"], ks, args.steps, args.target_entropy,
            out / "compare_heldout.png")
    if args.part in ("all", "sweep"):
        grpo = summary["compare"]["grpo"]
        sweep = {"runs": {}, "critical": {}}
        for p in args.ps:
            by_w = {
                w: summarize_group(seeds_of("sweep", sweep_name(w, p)), args.final_window)
                for w in args.ws
            }
            sweep["runs"][p] = by_w
            ws = sorted(by_w)
            # halfway from GRPO's end to the target
            level = (grpo["entropy"]["mean"] + args.target_entropy) / 2
            predicted, dh_grpo, dh_lplus, batches = predicted_critical_w(
                compare_groups["grpo"], args.target_entropy, p)
            measured = (crossing(ws, [by_w[w]["entropy"]["mean"] for w in ws], level)
                        # no collapse: no threshold
                        if grpo["entropy"]["mean"] < args.target_entropy else None)
            sweep["critical"][p] = {
                "measured": measured,
                "entropy_level": level,
                "predicted": predicted,
                "dH_grpo": dh_grpo,
                "dH_lplus": dh_lplus,
                "batches": batches,
            }
        plots.plot_sweep(sweep, grpo, args.target_entropy, out / "sweep.png")
        summary["sweep"] = {"critical": {f"{p:g}": v for p, v in sweep["critical"].items()},
                            "runs": {f"P={p:g}": {f"W={w:g}": v for w, v in by_w.items()}
                                     for p, by_w in sweep["runs"].items()}}
    # complete runs are not rerun
    summary["seconds_this_invocation"] = round(time.time() - started, 1)
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    print_summary(summary)
    return 0


def print_summary(summary):
    def cell(stats):
        return f"{stats['mean']:.3f} ± {stats['se']:.3f}"

    print(f"{'run':<26} {'entropy':>15} {'distinct-correct':>17} {'accuracy':>15}")
    rows = list(summary["compare"].items())
    for p_label, by_w in summary.get("sweep", {}).get("runs", {}).items():
        rows += [(f"O1 {w_label} {p_label}", stats) for w_label, stats in by_w.items()]
    for name, stats in rows:
        print(f"{name:<26} {cell(stats['entropy']):>15} {cell(stats['distinct_correct_frac']):>17} "
              f"{cell(stats['acc_before_filter']):>15}")
    for p, found in summary.get("sweep", {}).get("critical", {}).items():
        measured = "none in the grid" if found["measured"] is None else f"{found['measured']:.2f}"
        if found["batches"] == 0:
            predicted = "none (no GRPO batch near the target)"
        elif found["predicted"] is None and found["dH_grpo"] >= 0:
            predicted = "none (GRPO's drift near the target is not negative)"
        elif found["predicted"] is None:
            predicted = "none (amplifying L+ lowers the entropy: dH_L+ <= 0)"
        else:
            predicted = f"{found['predicted']:.2f}"
        print(
            f"P = {p}: critical W measured {measured} (final entropy crosses {found['entropy_level']:.3f}), "
            f"first-order {predicted} (dH_grpo {found['dH_grpo']:.2e}, dH_L+ {found['dH_lplus']:.2e}, "
            f"{found['batches']} batches)")
    if "compare_heldout" in summary:
        print("held-out prompts, after the last step:")
        print_heldout(summary["compare_heldout"], evaluate.ks_for(summary["settings"]["eval_n"]))
    print(f"starting model sha256 {summary['model_sha256']}")
    print(f"{summary['seconds_this_invocation']:.0f} s (runs already complete were read back)")


if __name__ == "__main__":
    from tools import repro  # the module by name: forkserver's workers import it, not __main__

    sys.exit(repro.main(sys.argv[1:]))
