"""train.py: the hand-written GRPO/STARE loop on torchrun + FSDP2, with one vLLM engine per rank.

    python tiny.py --out runs/tiny && python train.py --config configs/tiny.yaml        # CPU, one process
    torchrun --nproc_per_node 2 train.py --config configs/tiny.yaml                      # CPU, two ranks (gloo)
    torchrun --nproc_per_node 8 train.py --config configs/qwen7b_long.yaml               # GPU node
    python train.py --config configs/tiny.yaml --export                                 # latest checkpoint as HF

Any config value can be overridden as section.key=value (config.py). A run writes under
train.out_dir: config.yaml, metrics.jsonl (one object per step), checkpoints/ (checkpoints.py), hf/
(the final model). Rerunning the same command resumes exactly from the latest checkpoint; SIGTERM /
SIGUSR1 / SIGINT finish the step, save and exit.

One optimizer step (`train_step`), each stage a function below:
  sample_groups    n responses per prompt from the local engine, scored by the verifier (Eq. 21); dynamic sampling
                   keeps the groups whose rewards differ, over all ranks, until the batch is full
  group_responses  group-normalised advantages, this rank's share of the groups (Eq. 1)
  old_policy_pass  one no-grad forward: old log-probs, entropies, sensitivities S, Lp-Reg's proxy (Eqs. 4-5, 13)
  update_gate      the batch's token-mean entropy over all ranks drives STARE's gate (Eq. 10)
  select_tokens    every method's token selection (Eqs. 7, 12-18), once over the whole step (all ranks)
  policy_update    the chosen method's loss over token-budget micro-batches (Eqs. 2-3, 8-9, 11-19)
  sync_engine      the new weights into the engine (and a log-prob probe)
  batch_metrics    the batch's statistics and the predicted entropy change by quadrant (Eq. 6)
then evaluation, metrics.jsonl and checkpoints on schedule (`train`, in the plumbing section).
Equation numbers refer to docs/method.md.

Simplified relative to the reference (verl): no Ray, no reference model or KL term (STARE's runs use
none), on-policy by default; old log-probs come from a separate no-grad pass (ratio 1 up to float
noise); the kept groups are exchanged between ranks with all_gather_object (on the host);
step-scope selections are made once per step on the old log-probs even with several mini-batches; no
balance_batch reordering.
"""

import contextlib
import dataclasses
import datetime
import functools
import math
import os
import random
import socket
import sys
import time
import types
from pathlib import Path

import torch
import torch.distributed as dist
from tqdm import tqdm

import baselines
import checkpoints
import config
import data
import evaluate
import modeling
import plan
import rewards
import rollout
import runs
import sandbox
import stare
import tool_use


# response tokens of the weight-sync probe: enough to see a missed sync, cheap at any length
PROBE_TOKENS = 512
REWARD_FRACTIONS = ("rollout/no_answer_frac", "rollout/parse_error_frac", "rollout/timeout_frac",
                    "rollout/format_ok_frac")  # of every response sampled in a step


# ==================================================================================================
# ALGORITHM: the data of one step
# ==================================================================================================


@dataclasses.dataclass
class Response:
    """One sampled response: a row of the training batch. The passes of a step fill the fields after `advantage`."""

    prompt: list[int]  # prompt token ids
    tokens: list[int]  # response token ids, T of them (model and tool-result tokens)
    rollout_logprobs: list[float]  # [T] the sampler's log-probs (0.0 at tool-result tokens)
    reward: float
    accuracy: float  # 1.0 if the verifier judged the answer right
    truncated: bool  # stopped by the token budget
    reflection: tuple[int, int]  # (reflection words, words)
    # [T] bool: True at tokens the policy sampled, False at tool-result tokens
    policy_mask: torch.Tensor
    advantage: float = 0.0
    old_logprobs: torch.Tensor | None = None  # [T] log pi_old, from old_policy_pass
    entropy: torch.Tensor | None = None  # [T] next-token entropy under pi_old
    sensitivity: torch.Tensor | None = None  # [T] entropy sensitivity S (Eq. 5)
    proxy_logprobs: torch.Tensor | None = None  # [T] Lp-Reg's min-p proxy log-prob (lp_reg only)
    selection: dict | None = None  # name -> [T], the step-scope token selection of the method


@dataclasses.dataclass
class Group:
    """The n responses to one prompt."""

    prompt: list[int]
    responses: list[Response]

    @property
    def varied(self):
        """Dynamic sampling keeps a group only if its responses were not all judged the same."""
        return len({r.accuracy for r in self.responses}) > 1

    @property
    def distinct_correct(self):  # the share of distinct right responses; None if none is right
        return rewards.distinct_correct_fraction([[(r.tokens, r.accuracy)
                                                    for r in self.responses]])


@dataclasses.dataclass
class Task:
    """The training prompts, tokenised once, and the seeded order in which the run reads them."""

    prompt_ids: list[list[int]]
    examples: list  # data.Example per prompt: ground truth and data source
    seed: int
    shuffle: bool
    # data/...: prompts, truncated and skipped shares
    metrics: dict = dataclasses.field(default_factory=dict)

    def prompt_at(self, position):
        """The prompt index at a position of the stream: epoch after epoch, each shuffled from (seed, epoch)."""
        epoch, offset = divmod(position, len(self.prompt_ids))
        return epoch_order(len(self.prompt_ids), self.seed, self.shuffle, epoch)[offset]


@functools.lru_cache(maxsize=2)
def epoch_order(num_prompts, seed, shuffle, epoch):
    order = list(range(num_prompts))
    if shuffle:
        random.Random(data.derive_seed(seed, "epoch", epoch)).shuffle(order)
    return order


# ==================================================================================================
# ALGORITHM: the stages of one step
# ==================================================================================================


def sample_groups(engine, tokenizer, task, cfg, data_position, rank, world, device):
    """Generation rounds until train_batch_size groups are kept (dynamic sampling: only varied
    groups), over all ranks -> (the kept groups, the same list on every rank; the new data position;
    rollout metrics)."""
    # sampled: (varied, distinct_correct) of every group of the step, all ranks
    kept, sampled, local_sums, rounds = [], [], {}, 0
    while len(kept) < cfg.train.train_batch_size:
        if cfg.algorithm.max_num_gen_batches and rounds >= cfg.algorithm.max_num_gen_batches:
            raise runs.RunError(
                f"error: dynamic sampling kept {len(kept)} of the {cfg.train.train_batch_size} groups needed after "
                f"{rounds} rounds (algorithm.max_num_gen_batches); the task is too easy or too hard for the model: "
                f"raise the limit or turn algorithm.dynamic_sampling off")
        # the ranks of one engine sample the same prompts together
        tp = cfg.rollout.tensor_parallel_size
        global_indices = round_prompts(data_position, cfg.algorithm.gen_batch_size, rank, world, tp)
        data_position += cfg.algorithm.gen_batch_size
        groups, round_sums = generate_round(engine, tokenizer, task, cfg, global_indices)
        leader = rank % tp == 0  # one rank per engine speaks for its samples
        add_sums(
            local_sums,
            {k: v if leader or k.startswith("time/") else 0 for k, v in round_sums.items()})
        # what every rank sampled in two numbers a group, then only the groups the step keeps, the
        # same on all ranks (the ranks of one engine hold the same groups: the first sends them)
        mine = groups if leader else []
        keep = [g for g in mine if g.varied or not cfg.algorithm.dynamic_sampling]
        summaries = all_gather((len(keep), [(g.varied, g.distinct_correct) for g in mine]))
        room = cfg.train.train_batch_size - len(kept) - sum(n for n, _ in summaries[:rank])
        kept += [g for rank_groups in all_gather(keep[:max(room, 0)]) for g in rank_groups]
        sampled += [summary for _, rank_sampled in summaries for summary in rank_sampled]
        rounds += 1
    timings = {key: local_sums.pop(key) for key in ("time/rollout", "time/reward")}
    totals = all_reduce(local_sums, device)
    responses, calls = max(totals["sampled"], 1), max(totals.get("tool_calls", 0), 1)
    metrics = {
        "rollout/gen_rounds": rounds,
        "rollout/acc_before_filter": totals["sampled_correct"] / responses,
        "rollout/varied_group_frac": sum(varied for varied, _ in sampled) / len(sampled),
        **{key: totals[key] / responses for key in REWARD_FRACTIONS},
        **timings,
    }
    diversity = [fraction for _, fraction in sampled if fraction is not None]
    if diversity:  # rewards.distinct_correct_fraction over the step's groups
        metrics["rollout/distinct_correct_frac"] = sum(diversity) / len(diversity)
    if cfg.rollout.tools:  # over every response sampled in the step, all ranks
        metrics.update({"rollout/tool_calls_mean": totals["tool_calls"] / responses,
                        "rollout/tool_error_frac": totals["tool_errors"] / calls,
                        "rollout/tool_timeout_frac": totals["tool_timeouts"] / calls,
                        "rollout/tool_invalid_frac": totals["tool_invalid"] / calls,
                        "rollout/tool_token_frac": totals["tool_tokens"] / max(totals["tokens"], 1),
                        "rollout/max_turns_frac": totals["max_turns"] / responses,
                        # 1: "namespaces", 0: the weaker "process" (decided at start, cached)
                        "rollout/sandbox_namespaces": float(
                            sandbox.isolation(cfg.sandbox) == "namespaces")})
    return kept, data_position, metrics


def round_prompts(data_position, gen_batch_size, rank, world, tensor_parallel_size):
    """The positions in the prompt stream that this rank's engine samples in one generation round:
    the round's gen_batch_size prompts split evenly over the world / tensor_parallel_size engines
    (ranks rank // tp)."""
    engines = world // tensor_parallel_size
    share = gen_batch_size // engines
    return [data_position + (rank // tensor_parallel_size) * share + i for i in range(share)]


def generate_round(engine, tokenizer, task, cfg, global_indices):
    """One generation round of this rank: n responses to each prompt of `global_indices` (positions
    in the seeded prompt stream), scored -> (groups, sums over the round's responses)."""
    n, prompts = cfg.rollout.n, [task.prompt_at(g) for g in global_indices]
    sampling = dict(
        n=n, temperature=cfg.rollout.temperature, top_p=cfg.rollout.top_p, top_k=cfg.rollout.top_k,
        max_tokens=cfg.rollout.max_tokens,
        seeds=[data.derive_seed(cfg.train.seed, "prompt", g) for g in global_indices])
    start = time.time()
    if cfg.rollout.tools:  # multi-turn: the code interpreter's output comes back as tool turns
        out = tool_use.generate_with_tools(
            engine, tokenizer, [task.prompt_ids[p] for p in prompts],
            max_turns=cfg.rollout.max_turns, sandbox_config=cfg.sandbox,
            max_tool_response_tokens=cfg.rollout.max_tool_response_tokens, **sampling)
    else:
        out = rollout.generate(engine, [task.prompt_ids[p] for p in prompts], **sampling)
    sums = {"time/rollout": time.time() - start}
    start = time.time()
    examples = [task.examples[prompts[i]] for i in out.prompt_index]
    scores, accuracies, reward_metrics = rewards.compute_rewards(
        out.texts, [e.ground_truth for e in examples], [e.data_source for e in examples],
        out.lengths, cfg.reward)
    sums["time/reward"] = time.time() - start
    responses = [
        Response(
            prompt=task.prompt_ids[prompts[out.prompt_index[r]]], tokens=out.token_ids[r],
            rollout_logprobs=out.logprobs[r], reward=scores[r], accuracy=accuracies[r],
            truncated=out.finish_reasons[r] == "length",
            reflection=rewards.reflection_counts(out.texts[r]),
            policy_mask=policy_token_mask(out, r))
        for r in range(len(out.texts))]
    sums.update({"sampled": len(responses), "sampled_correct": sum(accuracies),
                 **{key: reward_metrics[key] * len(responses) for key in REWARD_FRACTIONS}})
    if cfg.rollout.tools:
        sums.update({"tool_calls": sum(out.num_calls), "tool_errors": sum(out.num_errors),
                     "tool_timeouts": sum(out.num_timeouts), "tool_invalid": sum(out.num_invalid),
                     "tool_tokens": sum(map(sum, out.tool_mask)), "tokens": sum(out.lengths),
                     "max_turns": out.finish_reasons.count("max_turns")})
    return [
        Group(responses[j * n].prompt, responses[j * n : (j + 1) * n]) for j in range(len(prompts))
    ], sums


def group_responses(groups, cfg, rank, world):
    """Group-normalised advantages (Eq. 1); this rank's share of the groups, as one list of responses."""
    per_rank = len(groups) // world
    mine = []
    for group in groups[rank * per_rank:(rank + 1) * per_rank]:
        rewards_ = torch.tensor([r.reward for r in group.responses])
        advantages = stare.group_advantages(
            rewards_, len(group.responses), cfg.algorithm.normalize_std
        )  # [n]
        mine += [
            dataclasses.replace(r, advantage=float(a)) for r, a in zip(group.responses, advantages)]
    return mine


@torch.no_grad()
def old_policy_pass(model, responses, cfg, device):
    """One no-grad forward per micro-batch: each response's old log-probs, entropies and entropy
    sensitivities (and Lp-Reg's proxy log-probs). Fills those fields of `responses`."""
    model.eval()
    temperature = cfg.rollout.temperature
    for indices in equal_count_micro_batches(responses, cfg.train.micro_token_budget, device):
        # an empty batch: a collective-only forward
        rows = [responses[i] for i in indices] or responses[:1]
        packed = modeling.pack_rows([r.prompt for r in rows], [r.tokens for r in rows], device)
        logits = modeling.response_logits(model, packed)  # [N, V]
        logprobs, entropy = stare.token_logprobs_and_entropy(
            logits, packed.response_ids, temperature
        )  # [N]
        sensitivity = stare.entropy_sensitivity(logits, packed.response_ids, temperature)  # [N]
        lengths = [len(r.tokens) for r in rows]
        per_row = zip(*(values.cpu().split(lengths) for values in (logprobs, entropy, sensitivity)))
        for i, (row_logprobs, row_entropy, row_sensitivity) in zip(indices, per_row):
            responses[i].old_logprobs, responses[i].entropy = row_logprobs, row_entropy
            responses[i].sensitivity = row_sensitivity
        # Lp-Reg's (Eq. 13)
        if "proxy_logprobs" in baselines.EXTRA_INPUTS.get(cfg.algorithm.method, ()):
            proxy = baselines.minp_proxy_logprobs(
                logits,
                packed.response_ids,
                temperature,
                cfg.loss.lp_reg_kappa,
                cfg.loss.lp_reg_soft,
            )  # [N]
            for i, row_proxy in zip(indices, proxy.cpu().split(lengths)):
                responses[i].proxy_logprobs = row_proxy


def update_gate(gate, responses, device):
    """The batch's token-mean entropy under pi_old, over all ranks, drives the gate once per step (Eq. 10)."""
    sums = all_reduce(
        {
            "tokens": sum(float(r.policy_mask.sum()) for r in responses),
            "entropy": sum(float(r.entropy[r.policy_mask].sum()) for r in responses),
            "surprisal": sum(float(-r.old_logprobs[r.policy_mask].sum()) for r in responses),
        },
        device)
    tokens = max(sums["tokens"], 1)
    accepted = gate.update(sums["entropy"] / tokens)
    return sums["tokens"], {
        "train/entropy": sums["entropy"] / tokens,
        "train/surprisal": sums["surprisal"] / tokens,
        "stare/gate_update_accepted": float(accepted),
        "stare/gate_on": float(gate.gate_on),
        "stare/w": gate.w,
        "stare/m": gate.m,
    }


def select_tokens(responses, cfg, gate, step, device):
    """Every method's token selection made once over the whole step, all ranks
    (algorithm.selection_scope=step), so the update depends on neither the micro-batch size nor the
    world size. Fills `selection` -> metrics."""
    method = cfg.algorithm.method
    if cfg.algorithm.selection_scope != "step" or method not in baselines.SELECTING:
        return {}  # nothing to select, or micro scope: policy_loss selects inside each micro-batch
    fields = ("old_logprobs", "entropy", "policy_mask", "advantage") + baselines.EXTRA_INPUTS.get(
        method, ())
    shared = [types.SimpleNamespace(**{key: getattr(r, key) for key in fields}) for r in responses]
    everyone = [row for rank_rows in all_gather(shared) for row in rank_rows]
    # [B, T] each, B = the step's responses
    batch = loss_batch(everyone, pad_rows, method, device=None)
    batch["logprobs"] = batch["old_logprobs"]  # the selection ranks tokens under pi_old
    generator = torch.Generator().manual_seed(
        data.derive_seed(cfg.train.seed, "selection", step))
    selection, metrics = baselines.token_selection(
        method, batch, cfg.loss, gate=gate, generator=generator)
    offset = (dist.get_rank() if dist.is_initialized() else 0) * len(responses)
    for j, response in enumerate(responses):
        response.selection = {k: v[offset + j, :len(response.tokens)] for k, v in selection.items()}
    return {k: float(v) for k, v in metrics.items()}


def loss_batch(rows, lay_out, method, device):
    """The per-token inputs of `method`'s loss for `rows` (responses, or their fields gathered from
    every rank): each response's [T] tensors laid out by `lay_out` (padded [B, T] rows for the
    step's selection, packed rows in a micro-batch), the sequence advantages [B], and what
    baselines.EXTRA_INPUTS says the method needs."""
    batch = {
        "old_logprobs": lay_out([r.old_logprobs for r in rows]),
        "entropy": lay_out([r.entropy for r in rows]),
        "mask": lay_out([r.policy_mask for r in rows]),
        "advantages": torch.tensor([r.advantage for r in rows], device=device),
    }
    for key in baselines.EXTRA_INPUTS.get(method, ()):
        batch[key] = lay_out([getattr(r, key) for r in rows])
    return batch


def policy_update(model, optimizer, responses, cfg, gate, step, device, scaler=None):
    """One optimizer step per mini-batch: the method's loss over token-budget micro-batches,
    gradient clipping, AdamW; a non-finite loss or gradient norm on any rank skips the step. With a
    LossScaler (float16 compute) the loss is scaled before backward and the gradients unscaled
    before clipping; train/nonfinite_updates counts the skips that no loss scale explains.
    -> metrics (device sums read once)."""
    model.train()
    num_mini = cfg.train.train_batch_size // cfg.train.mini_batch_size
    mini_size = len(responses) // num_mini
    sums, grad_norms, micro_batch_count, skipped, nonfinite = {}, [], 0, 0, 0
    for mini in range(num_mini):
        rows = responses[mini * mini_size:(mini + 1) * mini_size]
        denominators = loss_denominators(rows, cfg, device)
        loss_scale = scaler.scale if scaler is not None else 1.0
        mini_sums = {}  # the loss and its statistics, summed on the device, read once at the end
        for indices in equal_count_micro_batches(rows, cfg.train.micro_token_budget, device):
            share = len(indices) / len(rows)  # of the mini-batch's rows; 0: a padding batch
            loss, stats = micro_batch_loss(model, [rows[i] for i in indices] or rows[:1], share,
                                           denominators, cfg, gate, step)
            (loss * loss_scale).backward()  # loss_scale: float16's dynamic scaling (LossScaler)
            add_sums(mini_sums, stats)
            micro_batch_count += 1
        add_sums(sums, mini_sums)
        if scaler is not None:
            scaler.unscale(model)
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.optim.grad_clip or math.inf)
        grad_norms.append(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)  # DTensor
        finite = all_reduce({"loss": torch.isfinite(mini_sums["loss"]),  # the one host read
                             "grad": torch.isfinite(grad_norms[-1])}, device, op=dist.ReduceOp.MIN)
        finite_loss, finite_grad = finite["loss"] > 0, finite["grad"] > 0
        if finite_loss and finite_grad:
            optimizer.step()
        overflow = scaler is not None and scaler.after_step(finite_loss, finite_grad)
        skipped += not (finite_loss and finite_grad)
        nonfinite += not (finite_loss and finite_grad) and not overflow
        optimizer.zero_grad(set_to_none=True)
    totals = all_reduce(sums, device)
    grad_norms = torch.stack(grad_norms).double()  # the same on every rank
    step_scope = cfg.algorithm.selection_scope == "step"
    return {"train/loss": totals.pop("loss") / num_mini / (1 if step_scope else world_size()),
            "train/grad_norm": float(grad_norms.mean()),
            "train/grad_norm_max": float(grad_norms.max()),
            "train/micro_batches": micro_batch_count,
            "train/skipped_updates": skipped,
            "train/nonfinite_updates": nonfinite,
            **({"train/loss_scale": loss_scale} if scaler is not None else {}),
            **{key: value / max(totals["stats_weight"], 1) for key, value in totals.items()
               if key != "stats_weight"}}


def loss_denominators(rows, cfg, device):
    """Step scope: the mini-batch's count of loss tokens and non-empty sequences over all ranks (the
    global token mean, Eq. 3). Micro scope (the reference): None, each micro-batch uses its own
    mean."""
    if cfg.algorithm.selection_scope != "step":
        return None
    tokens = sequences = 0.0
    for row in rows:
        selection = {k: v[None] for k, v in (row.selection or {}).items()}
        # [1, T]
        mask = baselines.loss_mask(cfg.algorithm.method, row.policy_mask[None], selection, cfg.loss)
        tokens, sequences = tokens + float(mask.sum()), sequences + float(mask.any())
    return all_reduce({"num_tokens": tokens, "num_sequences": sequences}, device)


def micro_batch_loss(model, rows, share, denominators, cfg, gate, step):
    """One micro-batch's part of its mini-batch's loss (forward only) -> (the loss to backward, its
    value and statistics as device sums). share: its rows' share of the mini-batch's rows; 0 for a
    padding batch, which only keeps this rank in step with the others' collectives."""
    device = next(model.parameters()).device
    packed = modeling.pack_rows([r.prompt for r in rows], [r.tokens for r in rows], device)
    logits = modeling.response_logits(model, packed)  # [N, V]
    logprobs, entropy = stare.token_logprobs_and_entropy(
        logits, packed.response_ids, cfg.rollout.temperature)  # [N]

    def rows_of(values):  # per-response [T] tensors -> [b, R] as packed lays them out
        return packed.to_rows(torch.cat(list(values)).to(device))

    batch = loss_batch(rows, rows_of, cfg.algorithm.method, device)
    # pi_theta's
    batch["logprobs"], batch["entropy"] = packed.to_rows(logprobs), packed.to_rows(entropy)
    batch["mask"] = batch["mask"] & (share > 0)
    token_weights = None
    if cfg.algorithm.importance_sampling:  # truncated IS: pi_old / pi_rollout, capped (Eq. 11)
        rollout_logprobs = rows_of(
            torch.tensor(r.rollout_logprobs, dtype=torch.float32) for r in rows)
        token_weights = torch.exp(batch["old_logprobs"] - rollout_logprobs).clamp(
            max=cfg.algorithm.is_cap)
    # micro scope (or grpo / entropy_bonus): policy_loss selects within this micro-batch
    selection = None
    if rows[0].selection is not None:
        selection = {k: rows_of(r.selection[k] for r in rows) for k in rows[0].selection}
    generator = torch.Generator(device=device).manual_seed(
        data.derive_seed(cfg.train.seed, "selection", step))
    loss, loss_metrics = baselines.policy_loss(
        cfg.algorithm.method, batch, cfg.loss, selection=selection, gate=gate, generator=generator,
        token_weights=token_weights, **(denominators or {}))
    # step scope: the loss is already this batch's share of the global mean and FSDP averages
    # gradients over ranks, hence x world; micro scope: each micro-batch's mean weighted by its
    # share of the rows (0 for a padding batch)
    scale = world_size() if denominators else share
    weight = batch["mask"].sum()  # the statistics are token means over the step
    return loss * scale, {
        "loss": loss.detach() * (1 if denominators else scale), "stats_weight": weight,
        **{f"train/{k}" if "/" not in k else k: torch.where(weight > 0, v.detach() * weight, 0.0)
           for k, v in loss_metrics.items()}}


def sync_engine(engine, model, cfg, responses, step, probe, first=False):
    """The new weights into the local engine; at step 1 (or when `first`) and every sync_check_every
    steps, the engine's log-probs of a probe sequence against the trainer's -> (the probe, the
    largest difference over all ranks, or None). With sleep mode the trainer's side of the probe
    runs before the engine's KV cache is back, so the two never hold memory at once."""
    if cfg.rollout.enable_sleep_mode:
        rollout.wake_weights(engine)  # weights first, then the KV cache (vLLM's sleep mode)
    rollout.sync_weights(engine, rollout.full_parameters(model, rollout.engine_dtype(engine)))
    checking = cfg.rollout.sync_check_every and (
        first or step == 1 or step % cfg.rollout.sync_check_every == 0)
    if checking and probe is None:
        # same on all ranks
        probe = next((p for p in all_gather(probe_sequence(responses)) if p is not None), None)
    if checking and probe is not None:
        model.eval()
        trainer_side = rollout.trainer_logprobs(model, probe[0], probe[1])
        modeling.reshard_root(model)  # or the root unit stays gathered through the rollout
    if cfg.rollout.enable_sleep_mode:
        rollout.wake_kv_cache(engine)
    if not checking or probe is None:
        return probe, None
    error = (rollout.engine_logprobs(engine, probe[0], probe[1]) - trainer_side).abs().max()
    device = next(model.parameters()).device
    return probe, all_reduce({"error": error}, device, op=dist.ReduceOp.MAX)["error"]


def probe_sequence(responses):
    """(token ids, prompt length) of the weight-sync probe: the first response with a token, cut to
    PROBE_TOKENS (a truncated response fills the context, and the probe asks for one more token: it
    loses its last); or None."""
    for r in responses:
        tokens = r.tokens[:min(PROBE_TOKENS, len(r.tokens) - r.truncated)]
        if tokens:
            return r.prompt + tokens, len(r.prompt)
    return None


def nonfinite_guard(metrics, state, cfg, step):
    """One line when more steps in a row than optim.max_nonfinite_steps had a non-finite loss or
    gradient norm that no float16 loss scale explains (train/nonfinite_updates), else None."""
    skipped = metrics["train/nonfinite_updates"]
    state.nonfinite_in_a_row = state.nonfinite_in_a_row + 1 if skipped else 0
    if state.nonfinite_in_a_row > cfg.optim.max_nonfinite_steps:
        return (f"error: step {step}: non-finite loss or gradient norm in "
                f"{state.nonfinite_in_a_row} consecutive steps "
                f"(optim.max_nonfinite_steps={cfg.optim.max_nonfinite_steps})")
    return None


def sync_guard(metrics, cfg, step):
    """One line when the engine and the trainer disagree beyond their bounds (a failed or partial
    weight sync samples from other weights than the ones trained), else None. The bounds and their
    noise floor: docs/usage.md, "GPU runs: the checks"."""
    for key, name in (("rollout/sync_probe_error", "max_sync_probe_error"),
                      ("rollout/logprob_mismatch_mean", "max_logprob_mismatch")):
        bound = getattr(cfg.rollout, name)
        if key in metrics and not metrics[key] <= bound:
            return (
                f"error: step {step}: {key} = {metrics[key]:.3g} exceeds rollout.{name} = {bound:g}: the "
                f"engine is not sampling from the trained weights (a failed weight sync); stopped before this "
                f"step's checkpoint (metrics.jsonl has the step). Try rollout.sleep_level=1 on GPU")
    return None


def batch_metrics(responses, num_tokens, device):
    """Rollout statistics of the training batch (the kept groups) and the predicted first-order
    entropy change of its update by quadrant (Eq. 6), over all ranks."""
    mismatch = [
        (torch.tensor(r.rollout_logprobs) - r.old_logprobs).abs()[r.policy_mask] for r in responses]
    sums = all_reduce(
        {
            "responses": len(responses),
            "correct": sum(r.accuracy for r in responses),
            "reward": sum(r.reward for r in responses),
            "length": sum(len(r.tokens) for r in responses),
            "zero_advantage": sum(r.advantage == 0 for r in responses),
            "truncated": sum(r.truncated for r in responses),
            "mismatch": sum(float(m.sum()) for m in mismatch),
            "reflection_words": sum(r.reflection[0] for r in responses),
            "words": sum(r.reflection[1] for r in responses),
        },
        device)
    maxima = all_reduce(
        {
            "length": max((len(r.tokens) for r in responses), default=0),
            "mismatch": max((float(m.max()) for m in mismatch if m.numel()), default=0.0),
        },
        device,
        op=dist.ReduceOp.MAX)
    dynamics = stare.entropy_dynamics(
        torch.tensor([r.advantage for r in responses]),
        pad_rows([r.sensitivity for r in responses]), pad_rows([r.policy_mask for r in responses]),
        num_tokens=num_tokens)
    count = sums["responses"]
    return {
        "rollout/acc": sums["correct"] / count,
        "rollout/reward_mean": sums["reward"] / count,
        "rollout/response_length_mean": sums["length"] / count,
        "rollout/response_length_max": maxima["length"],
        "rollout/truncated_frac": sums["truncated"] / count,
        # all 1: no learning signal at all
        "train/zero_advantage_frac": sums["zero_advantage"] / count,
        "rollout/logprob_mismatch_mean": sums["mismatch"] / max(num_tokens, 1),
        "rollout/logprob_mismatch_max": maxima["mismatch"],
        "rollout/reflection_per_1k_words": 1000 * sums["reflection_words"] / max(sums["words"], 1),
        "train/tokens": num_tokens,
        **{f"stare/dynamics/{k}": v for k, v in all_reduce(dynamics, device).items()},
    }


def train_step(run, state, step, stage=lambda name: None, first=False):
    """One optimizer step: the algorithm, stage by stage -> its metrics by name. stage(name) is
    called as each long stage begins (the progress line shows it); first: the first step of this
    process (a resumed run's too), whose weight sync is probed."""
    cfg, device, start, timer = run.cfg, run.device, time.time(), Timer()
    stage("rollout")
    groups, state.data_position, rollout_metrics = sample_groups(
        run.engine, run.tokenizer, run.task, cfg, state.data_position, run.rank, run.world, device)
    if cfg.rollout.enable_sleep_mode:  # free the engine's memory for the update (GPU)
        rollout.release_memory(run.engine, cfg.rollout.sleep_level)
    responses = group_responses(groups, cfg, run.rank, run.world)
    stage("old log-probs")
    with timer("time/old_logprobs"):
        old_policy_pass(run.model, responses, cfg, device)
    num_tokens, gate_metrics = update_gate(run.gate, responses, device)
    selection_metrics = select_tokens(responses, cfg, run.gate, step, device)
    learning_rate = run.optimizer.param_groups[0]["lr"]  # the rate this step uses
    stage("update")
    with timer("time/update"):
        update_metrics = policy_update(run.model, run.optimizer, responses, cfg, run.gate, step,
                                       device, state.scaler)
        run.scheduler.step()
    stage("weight sync")
    with timer("time/sync"):
        state.probe, sync_error = sync_engine(run.engine, run.model, cfg, responses, step,
                                              state.probe, first)
    elapsed = time.time() - start
    return {**rollout_metrics, **batch_metrics(responses, num_tokens, device), **gate_metrics,
            **selection_metrics, **update_metrics, "train/lr": learning_rate, **timer.times,
            "time/step": elapsed, "time/tokens_per_s": num_tokens / max(elapsed, 1e-9),
            **({"rollout/sync_probe_error": sync_error} if sync_error is not None else {})}


# ==================================================================================================
# PLUMBING: the run around the steps
# ==================================================================================================


def main(argv):
    # write an HF export of the checkpoint train.resume names, then stop
    export_only = "--export" in argv
    planning = "--plan" in argv  # print the memory plan of the config on its hardware, then stop
    argv = [a for a in argv if a not in ("--export", "--plan")]
    if len(argv) < 2 or argv[0] != "--config":
        print(
            "usage: train.py --config CONFIG.yaml [--export | --plan] [section.key=value ...]",
            file=sys.stderr)
        return 2
    if planning:
        return plan.main(argv[1], argv[2:])
    try:  # everything that can be checked before a process group, an engine or a model exists
        cfg = config.load(argv[1], argv[2:])
        config.check_paths(cfg, config_path=argv[1])
    except config.ConfigError as error:
        print(f"config error: {error}", file=sys.stderr)
        return 2
    problem = None if export_only else plan.no_cuda_problem(cfg, argv[1])
    if problem:  # or the run takes the CPU path and fails later, inside vLLM
        print(problem, file=sys.stderr)
        return 2
    rank, world, device = setup_distributed(cfg.train.nccl_timeout_minutes)
    lock = runs.RunLock(cfg.train.out_dir)
    try:
        run, state = start_run(cfg, rank, world, device, lock, export_only)
        if export_only:
            return export_checkpoint(run)
        return train(run, state)
    except runs.RunError as error:  # one line; what the run wrote before is intact
        if rank == 0:
            print(error, file=sys.stderr)
        return 2
    finally:
        lock.release()
        if dist.is_initialized():
            dist.destroy_process_group()


def train(run, state):
    """The steps from the one after state.step to train.total_steps; metrics, evaluation and
    checkpoints on schedule -> the exit code (128 + signal when a signal stopped the run early)."""
    cfg, first_step = run.cfg, state.step + 1
    log = runs.MetricsLog(run.out_dir, cfg, run.rank, first_step=first_step)
    stop = runs.StopSignals()
    progress = tqdm(
        range(first_step, cfg.train.total_steps + 1), desc="train", disable=run.rank != 0,
        initial=state.step, total=cfg.train.total_steps)
    if run.benchmarks and cfg.eval.before_train and state.step == 0:
        log.write(0, evaluation(run), progress)  # the starting point of every eval curve
    try:
        for step in progress:
            def stage(name):  # the stage running now, beside the progress bar
                progress.set_postfix_str(f"step {step}: {name}", refresh=True)
            metrics = train_step(run, state, step, first=step == first_step, stage=stage)
            metrics.update(run.task.metrics)  # data/*: what loading the prompts did
            if run.benchmarks and (step % cfg.eval.every == 0 or step == cfg.train.total_steps):
                metrics.update(evaluation(run))
            log.write(step, metrics, progress)
            # before this step's checkpoint: the last one holds finite weights the engine sampled
            problem = nonfinite_guard(metrics, state, cfg, step) or sync_guard(metrics, cfg, step)
            if problem:
                raise runs.RunError(problem)
            state.step = step
            # a signal to any rank
            stopping = all_reduce({"stop": float(stop.requested)}, run.device)["stop"] > 0
            if (stopping or step == cfg.train.total_steps
                    or (cfg.train.save_every and step % cfg.train.save_every == 0)):
                path = checkpoints.save_checkpoint(
                    run.out_dir, step, run.model, run.optimizer, trainer_state(run, state), cfg,
                    run.rank, run.world)
                if run.rank == 0:
                    progress.write(f"step {step}: checkpoint {path}")
            # at the last step: finish normally (export included)
            if stopping and step < cfg.train.total_steps:
                if run.rank == 0:
                    progress.write(
                        f"stopped by a signal after step {step}; `resume: auto` continues from {path}"
                    )
                return 128 + stop.signal_number
        if cfg.rollout.enable_sleep_mode:  # the export's gathers take the engine's memory
            rollout.release_memory(run.engine, cfg.rollout.sleep_level)
        checkpoints.export_hf(run.model, cfg, run.tokenizer, run.out_dir / "hf", run.rank)
        return 0
    finally:
        log.close()
        rollout.shutdown_engine(run.engine)


@dataclasses.dataclass
class Run:
    """What every step uses and no step changes (the model and optimizer change only through their own methods)."""

    cfg: config.Config
    rank: int
    world: int
    device: torch.device
    out_dir: Path
    tokenizer: object
    task: Task | None
    benchmarks: dict
    engine: object
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    gate: stare.EntropyGate
    checkpoint: Path | None


@dataclasses.dataclass
class TrainerState:
    """What a step reads and writes besides the model and optimizer: saved in every checkpoint."""

    step: int = 0  # the last finished step
    # prompts consumed so far (global): the index into the seeded prompt stream
    data_position: int = 0
    nonfinite_in_a_row: int = 0  # consecutive steps whose update was skipped
    probe: tuple | None = None  # (token ids, prompt length) of the weight-sync check
    scaler: "LossScaler | None" = None  # float16 compute: the dynamic loss scale


def start_run(cfg, rank, world, device, lock, export_only=False):
    """Checks, the out_dir lock, data, engine, model, optimizer, gate and the state to resume from
    -> (Run, TrainerState). Raises runs.RunError when the run cannot start; config.yaml is written
    only once it has."""
    from transformers import AutoTokenizer

    try:
        config.check(cfg, world_size=world)
    except config.ConfigError as error:
        raise runs.RunError(f"config error: {error}") from None
    # driver, packages and the memory plan against this GPU, before anything loads
    if device.type == "cuda":
        errors, warnings = plan.preflight(cfg, world, device)
        for line in warnings + errors if rank == 0 else []:
            print(line, file=sys.stderr)
        agree(
            f"error: the GPU preflight found {len(errors)} problem(s), listed above"
            if errors
            else None)
    checkpoint = checkpoints.resume_checkpoint(cfg, check_later=not export_only, rank=rank)
    if cfg.loss.agg_mode == "seq-mean-token-sum-norm" and cfg.loss.loss_scale_factor is None:
        # Dr.GRPO's constant must not be the padded width of each micro-batch: use the response
        # budget (Eq. 3)
        cfg.loss = dataclasses.replace(cfg.loss, loss_scale_factor=float(cfg.rollout.max_tokens))
    tokenizer = AutoTokenizer.from_pretrained(cfg.model.path)
    task, benchmarks, engine = None, {}, None
    if not export_only:
        problem = None
        # one lock per out_dir, taken by the first rank; every rank learns the outcome
        if rank == 0:
            try:
                lock.acquire()
            except runs.RunError as error:
                problem = str(error)
        agree(problem)
        if cfg.rollout.tools:  # the sandbox's mode, decided once for the run (docs/sandbox.md)
            try:
                sandbox.isolation(cfg.sandbox)
            except sandbox.Unavailable as error:
                problem = f"error: {error}"
            agree(problem)
        task, benchmarks = load_task(cfg, tokenizer, rank)
        max_tokens = max(cfg.rollout.max_tokens, cfg.eval.max_tokens if benchmarks else 0)
        say(
            rank,
            "building the vLLM engine (on a GPU the first start compiles and captures CUDA graphs)")
        # one seed per engine, or every engine samples alike (vLLM #15980); the ranks of one
        # engine share it
        engine = rollout.build_engine(
            cfg.rollout, cfg.model.path, max_model_len=cfg.data.max_prompt_tokens + max_tokens,
            seed=cfg.train.seed + rank // cfg.rollout.tensor_parallel_size)
        runner = rollout.engine_runner(engine)
        task.metrics["rollout/model_runner_v2"] = float(runner == "v2")  # recorded with every step
        if runner != cfg.rollout.model_runner and rank == 0:
            print(
                f"warning: vLLM runs model runner {runner}, not rollout.model_runner={cfg.rollout.model_runner}",
                file=sys.stderr)
    try:
        # after the engine, whose start reseeds every global RNG (rollout.py)
        torch.manual_seed(cfg.train.seed)
        random.seed(cfg.train.seed)
        say(rank, f"building the policy model from {cfg.model.path} (each rank reads its shards)")
        model = modeling.build_model(cfg, device, world)
        optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.optim.lr,
                                      betas=tuple(cfg.optim.betas),
                                      weight_decay=cfg.optim.weight_decay)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, learning_rate_lambda(cfg))
        gate = stare.EntropyGate(**vars(cfg.gate))
        run = Run(
            cfg, rank, world, device, Path(cfg.train.out_dir), tokenizer, task, benchmarks, engine,
            model, optimizer, scheduler, gate, checkpoint)
        if export_only:
            return run, None
        state = resume(run, checkpoint) if checkpoint is not None else TrainerState()
        if cfg.model.param_dtype == "float16" and state.scaler is None:
            state.scaler = LossScaler(cfg.optim.loss_scale_init, cfg.optim.loss_scale_window)
        if rank == 0:  # the run has started: record what it runs with
            try:
                (run.out_dir / "config.yaml").write_text(config.to_yaml(cfg))
                kept = runs.keep_metrics(
                    run.out_dir / "metrics.jsonl", state.step if checkpoint is not None else None)
            except OSError as error:
                raise runs.RunError(f"error: cannot write to train.out_dir {run.out_dir} "
                                    f"({error.strerror}: {error.filename})") from None
            print(config.to_yaml(cfg))
            if kept is not None:
                print(
                    f"warning: {run.out_dir} held metrics of an earlier run but no checkpoint "
                    f"to resume from; they are kept as {kept}",
                    file=sys.stderr)
        return run, state
    except BaseException:  # vLLM's clean-up at exit needs the process group main destroys
        if engine is not None:
            rollout.shutdown_engine(engine)
        raise


def say(rank, message):
    """A start-up line on rank 0 (the stages before the first step can take minutes)."""
    if rank == 0:
        print(f"start: {message}", file=sys.stderr, flush=True)


def load_task(cfg, tokenizer, rank):
    """The training prompts, tokenised (tool-use runs list the code interpreter in the system
    block), and the evaluation benchmarks; truncated and skipped prompts reported. A data problem is
    a RunError naming the file."""
    try:
        examples = [example for path in cfg.data.train_files
                    for example in data.load_examples(path, prompt_suffix=cfg.data.prompt_suffix)]
        tools = [tool_use.CODE_INTERPRETER_TOOL] if cfg.rollout.tools else None
        prompt_ids, examples, stats = data.tokenize_prompts(
            examples, tokenizer, cfg.data.max_prompt_tokens, cfg.data.overflow, tools=tools)
        benchmarks = (evaluate.load_benchmarks(cfg.eval.files, prompt_suffix=cfg.data.prompt_suffix)
                      if cfg.eval.files and cfg.eval.every else {})
    except ValueError as error:
        raise runs.RunError(f"data error: {error}") from None
    total = stats["num_prompts"]
    report = (
        f"{total} training prompts; {stats['num_truncated']} ({stats['num_truncated'] / total:.1%}) cut to "
        f"data.max_prompt_tokens={cfg.data.max_prompt_tokens} from the left, {stats['num_skipped']} "
        f"({stats['num_skipped'] / total:.1%}) skipped (data.overflow={cfg.data.overflow})")
    if not prompt_ids:
        raise runs.RunError(f"data error: no training prompt is left: {report}")
    if rank == 0:
        print(f"data: {report}", file=sys.stderr)
    metrics = {"data/prompts": total, "data/truncated_frac": stats["num_truncated"] / total,
               "data/skipped_frac": stats["num_skipped"] / total}
    return Task(prompt_ids, examples, cfg.train.seed, cfg.data.shuffle, metrics), benchmarks


def resume(run, checkpoint):
    """Model, optimizer, scheduler, gate and trainer state from a checkpoint; the engine gets the weights."""
    saved = checkpoints.load_checkpoint(checkpoint, run.model, run.optimizer, run.rank)
    run.scheduler.load_state_dict(saved.pop("scheduler"))
    # the optimizer's saved settings give way to this run's config (a changed optim.lr takes effect,
    # as recorded)
    cfg = run.cfg
    run.scheduler.base_lrs = [cfg.optim.lr] * len(run.optimizer.param_groups)
    factor = learning_rate_lambda(cfg)(run.scheduler.last_epoch)
    for group in run.optimizer.param_groups:
        group.update(
            initial_lr=cfg.optim.lr, lr=cfg.optim.lr * factor, betas=tuple(cfg.optim.betas),
            weight_decay=cfg.optim.weight_decay)
    # the gate's state; its settings come from this run's config (w and m too, unless they adapt)
    carried = ("gate_on", "current_entropy") + (("w", "m") if run.gate.adaptive else ())
    run.gate.load_state_dict(
        {**run.gate.state_dict(), **{key: saved["gate"][key] for key in carried}})
    # the engine started from model.path
    rollout.sync_weights(
        run.engine, rollout.full_parameters(run.model, rollout.engine_dtype(run.engine)))
    changed = runs.config_differences((checkpoint / "config.yaml").read_text(), run.cfg)
    if run.rank == 0:
        print(
            f"resumed from {checkpoint} at step {saved['step']}"
            + (
                f"; config keys changed since, this run's values apply: {', '.join(changed)}"
                if changed
                else ""),
            file=sys.stderr)
    state = TrainerState(
        **{f.name: saved[f.name] for f in dataclasses.fields(TrainerState) if f.name in saved})
    state.scaler = LossScaler(**state.scaler) if isinstance(state.scaler, dict) else state.scaler
    return state


def trainer_state(run, state):
    return {
        **dataclasses.asdict(state),
        "scheduler": run.scheduler.state_dict(),
        "gate": run.gate.state_dict(),
    }


def evaluation(run):
    """evaluate.py's sampler and verifier on the engine's current weights -> eval/... metrics."""
    cfg, start = run.cfg, time.time()
    result = evaluate.evaluate(run.engine, run.tokenizer, run.benchmarks, cfg)
    return {**evaluate.flatten_metrics(result), "time/eval": time.time() - start}


def export_checkpoint(run):
    """`train.py --config C --export`: the checkpoint train.resume names as an HF model in out_dir/hf_step_N."""
    if run.checkpoint is None:
        raise runs.RunError(f"--export: no checkpoint under {run.out_dir}/checkpoints "
                            f"(train.resume={run.cfg.train.resume!r})")
    # the weights only
    step = checkpoints.load_checkpoint(run.checkpoint, run.model, None, run.rank)["step"]
    path = run.out_dir / f"hf_step_{step}"
    checkpoints.export_hf(run.model, run.cfg, run.tokenizer, path, run.rank)
    if run.rank == 0:
        print(f"exported {run.checkpoint} to {path}")
    return 0


def setup_distributed(timeout_minutes=60):
    """A process group in every case (a single process gets a group of one), so one code path serves
    both. Collectives wait timeout_minutes for the slowest rank (a long rollout tail, math-verify,
    the first compile)."""
    if "RANK" not in os.environ:  # plain `python train.py`: a local group of one
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(
            RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
        )
    use_cuda = torch.cuda.is_available()
    if use_cuda:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group(
        "nccl" if use_cuda else "gloo", timeout=datetime.timedelta(minutes=timeout_minutes))
    device = (
        torch.device("cuda", int(os.environ["LOCAL_RANK"])) if use_cuda else torch.device("cpu"))
    return dist.get_rank(), dist.get_world_size(), device


@dataclasses.dataclass
class LossScaler:
    """Dynamic loss scaling for float16 compute (model.param_dtype: float16). The gradients of a
    token-mean loss over ~1M tokens are ~1e-6 per token, under float16's normal range: the loss is
    multiplied by `scale` before backward, the (float32, sharded) gradients are divided by it before
    clipping, a step whose gradients are not finite is skipped and halves the scale, and `window`
    finite steps in a row double it. A non-finite loss (the forward overflowed) is skipped without
    touching the scale, which cannot fix it (train.policy_update)."""

    scale: float = 65536.0
    window: int = 1000
    good_steps: int = 0

    def unscale(self, model):
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        torch._foreach_mul_(
            [g.to_local() if hasattr(g, "to_local") else g for g in grads], 1.0 / self.scale)

    def update(self, finite):
        self.good_steps = self.good_steps + 1 if finite else 0
        if not finite:
            self.scale = max(self.scale / 2, 1.0)
        elif self.good_steps >= self.window:
            self.scale, self.good_steps = self.scale * 2, 0

    def after_step(self, finite_loss, finite_grad):
        """The scale after a mini-batch's step -> whether a skip was the scale's to fix: a gradient
        overflow under a scale > 1. A non-finite loss (the forward overflowed) is not, whatever the
        scale: it keeps the scale."""
        overflow = finite_loss and self.scale > 1
        if finite_loss:
            self.update(finite_grad)
        return overflow


def learning_rate_lambda(cfg):
    """The learning-rate factor of each step: linear warm-up, then constant or cosine to min_lr_ratio."""

    def factor(step):
        if step < cfg.optim.warmup_steps:
            return (step + 1) / cfg.optim.warmup_steps
        if cfg.optim.schedule == "constant":
            return 1.0
        progress = (step - cfg.optim.warmup_steps) / max(
            1, cfg.train.total_steps - cfg.optim.warmup_steps)
        cosine = 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
        return cfg.optim.min_lr_ratio + (1 - cfg.optim.min_lr_ratio) * cosine
    return factor


def equal_count_micro_batches(responses, token_budget, device):
    """modeling.micro_batches, padded with empty batches to the largest count over ranks: FSDP2's
    forward and backward are collectives, so every rank must run the same number of them (a mismatch
    hangs)."""
    batches = modeling.micro_batches(
        [len(r.prompt) + len(r.tokens) for r in responses], token_budget)
    count = all_reduce({"count": len(batches)}, device, op=dist.ReduceOp.MAX)["count"]
    return batches + [[]] * (int(count) - len(batches))


def policy_token_mask(out, index):
    """[T] bool of response `index` of a generation: True at tokens the policy sampled; False at
    tool-result tokens (multi-turn), which carry no gradient and count in no statistic."""
    tool_mask = getattr(out, "tool_mask", None)
    if tool_mask is None:
        return torch.ones(len(out.token_ids[index]), dtype=torch.bool)
    return ~torch.as_tensor(tool_mask[index], dtype=torch.bool)


def pad_rows(values):
    """Per-row 1-D tensors -> [len(values), max length (at least 1)], right-padded with zeros (False)."""
    out = values[0].new_zeros((len(values), max(1, max(len(v) for v in values))))
    for i, row in enumerate(values):
        out[i, :len(row)] = row
    return out


# The stages also run in one process without a process group (tests, tools/repro.py,
# tools/bench.py): then "all ranks" is this one.


def world_size():
    return dist.get_world_size() if dist.is_initialized() else 1


def all_reduce(values, device, op=dist.ReduceOp.SUM):
    """A dict of numbers (floats or 0-dim tensors) reduced over ranks in one collective -> dict of floats."""
    keys = sorted(values)
    stacked = torch.stack(
        [torch.as_tensor(values[k], dtype=torch.float64, device=device) for k in keys])
    if dist.is_initialized():
        dist.all_reduce(stacked, op=op)
    return dict(zip(keys, stacked.tolist()))


def agree(problem):
    """Raise RunError on every rank when any rank found a problem (a collective: every rank calls it)."""
    problems = [p for p in all_gather(problem) if p is not None]
    if problems:
        raise runs.RunError(problems[0])


def all_gather(obj):
    """Every rank's obj, in rank order (pickled, through host memory: rollout.host_group)."""
    if not dist.is_initialized():
        return [obj]
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, obj, group=rollout.host_group(dist.group.WORLD))
    return gathered


def add_sums(sums, values):
    """sums[k] += values[k] for every key (a new key starts at values[k])."""
    for key, value in values.items():
        sums[key] = sums[key] + value if key in sums else value


class Timer:
    """`with timer("time/x"):` adds the block's wall time to timer.times["time/x"]."""

    def __init__(self):
        self.times = {}

    @contextlib.contextmanager
    def __call__(self, key):
        start = time.time()
        yield
        add_sums(self.times, {key: time.time() - start})


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
