"""grpo.py: one optimizer step of GRPO and the methods beside it, stage by stage: the file to read
and edit to change the algorithm. train.py runs the steps (start-up, resume, evaluation,
checkpoints); equation numbers refer to docs/method.md.

`train_step` calls, in order:
  sample_groups    n scored responses per prompt (Eq. 21), dynamic sampling over all ranks
  group_responses  group-normalised advantages, this rank's share of the groups (Eq. 1)
  old_policy_pass  no-grad: old log-probs, entropies, sensitivities S, method inputs (Eqs. 4-5, 13)
  update_states    the batch's entropy drives STARE's gate (Eq. 10), EntroPIC's controller (Eq. 26)
  select_tokens    every method's token selection, once per step (Eqs. 7, 12-18, 23, 25, 31)
  policy_update    the method's loss over token-budget micro-batches (Eqs. 2-3, 8-9, 11-19, 23-30)
  rollout.sync_engine  the new weights into the engine (and a log-prob probe)
  batch_metrics    the batch's statistics and the predicted entropy change by quadrant (Eq. 6)

Simplified relative to the reference (verl): no Ray, no reference model or KL term (STARE's runs
use none), on-policy by default; old log-probs come from a separate no-grad pass (ratio 1 up to
float noise); the kept groups are exchanged between ranks with runs.all_gather (on the host);
step-scope selections are made once per step on the old log-probs even with several mini-batches;
no balance_batch reordering. The stages also run in one process without a process group (tests,
tools/repro.py, tools/bench.py): then "all ranks" is this one.
"""

import dataclasses
import math
import time
import types

import torch
import torch.distributed as dist

import baselines
import data
import modeling
import rewards
import rollout
import runs
import sandbox
import stare
import tool_use


REWARD_FRACTIONS = ("rollout/no_answer_frac", "rollout/parse_error_frac", "rollout/timeout_frac",
                    "rollout/format_ok_frac")  # of every response sampled in a step


# ==================================================================================================
# The data of one step
# ==================================================================================================


@dataclasses.dataclass
class Response:
    """One sampled response, a row of the training batch; a step's passes fill the fields after
    `advantage`."""

    prompt: list[int]  # prompt token ids
    tokens: list[int]  # response token ids, T of them (model and tool-result tokens)
    rollout_logprobs: list[float]  # [T] the sampler's log-probs (0.0 at tool-result tokens)
    reward: float
    accuracy: float  # 1.0 if the verifier judged the answer right
    truncated: bool  # stopped by the token budget
    reflection: tuple[int, int]  # (reflection words, words)
    policy_mask: torch.Tensor  # [T] bool: True at tokens the policy sampled (policy_token_mask)
    advantage: float = 0.0
    group: int = 0  # the index of its group (prompt) in the step, over all ranks
    old_logprobs: torch.Tensor | None = None  # [T] log pi_old, from old_policy_pass
    entropy: torch.Tensor | None = None  # [T] next-token entropy under pi_old
    sensitivity: torch.Tensor | None = None  # [T] entropy sensitivity S (Eq. 5)
    # name -> [T]: the method's own inputs of pi_old (baselines.old_policy_inputs: Lp-Reg's proxy)
    extra: dict = dataclasses.field(default_factory=dict)
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
        return rewards.distinct_correct_fraction([[(r.tokens, r.accuracy) for r in self.responses]])


# ==================================================================================================
# The stages of one step
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
                f"error: dynamic sampling kept {len(kept)} of the {cfg.train.train_batch_size} "
                f"groups needed after {rounds} rounds (algorithm.max_num_gen_batches); the task is "
                f"too easy or too hard for the model: raise the limit or turn "
                f"algorithm.dynamic_sampling off")
        # the ranks of one engine sample the same prompts together
        tp = cfg.rollout.tensor_parallel_size
        global_indices = round_prompts(data_position, cfg.algorithm.gen_batch_size, rank, world, tp)
        data_position += cfg.algorithm.gen_batch_size
        groups, round_sums = generate_round(engine, tokenizer, task, cfg, global_indices)
        leader = rank % tp == 0  # one rank per engine speaks for its samples
        runs.add_sums(local_sums, {k: v if leader or k.startswith("time/") else 0
                                   for k, v in round_sums.items()})
        # what every rank sampled in two numbers a group, then only the groups the step keeps, the
        # same on all ranks (the ranks of one engine hold the same groups: the first sends them)
        mine = groups if leader else []
        keep = [g for g in mine if g.varied or not cfg.algorithm.dynamic_sampling]
        summaries = runs.all_gather((len(keep), [(g.varied, g.distinct_correct) for g in mine]))
        room = cfg.train.train_batch_size - len(kept) - sum(n for n, _ in summaries[:rank])
        kept += [g for rank_groups in runs.all_gather(keep[:max(room, 0)]) for g in rank_groups]
        sampled += [summary for _, rank_sampled in summaries for summary in rank_sampled]
        rounds += 1
    timings = {key: local_sums.pop(key) for key in ("time/rollout", "time/reward")}
    totals = runs.all_reduce(local_sums, device)
    responses = max(totals["responses"], 1)
    metrics = {"rollout/gen_rounds": rounds,
               "rollout/acc_before_filter": totals["sampled_correct"] / responses,
               "rollout/varied_group_frac": sum(varied for varied, _ in sampled) / len(sampled),
               **{key: totals[key] / responses for key in REWARD_FRACTIONS}, **timings}
    diversity = [fraction for _, fraction in sampled if fraction is not None]
    if diversity:  # rewards.distinct_correct_fraction over the step's groups
        metrics["rollout/distinct_correct_frac"] = sum(diversity) / len(diversity)
    if cfg.rollout.tools:  # over every response sampled in the step, all ranks
        metrics.update(tool_use.tool_metrics(totals))
        isolation = sandbox.isolation(cfg.sandbox)  # decided at start, cached
        metrics["rollout/sandbox_namespaces"] = float(isolation == "namespaces")  # 0: "process"
    return kept, data_position, metrics


def round_prompts(data_position, gen_batch_size, rank, world, tensor_parallel_size):
    """The positions in the prompt stream that this rank's engine samples in one generation round:
    the round's gen_batch_size prompts split evenly over the world / tensor_parallel_size engines
    (ranks rank // tp)."""
    share = gen_batch_size // (world // tensor_parallel_size)
    return [data_position + (rank // tensor_parallel_size) * share + i for i in range(share)]


def generate_round(engine, tokenizer, task, cfg, global_indices):
    """One generation round of this rank: n responses to each prompt of `global_indices` (positions
    in the seeded prompt stream), scored -> (groups, sums over the round's responses)."""
    n, prompts = cfg.rollout.n, [task.prompt_at(g) for g in global_indices]
    prompt_ids = [task.prompt_ids[p] for p in prompts]
    seeds = [data.derive_seed(cfg.train.seed, "prompt", g) for g in global_indices]
    timer = runs.Timer()
    with timer("time/rollout"):
        if cfg.rollout.tools:  # multi-turn: the code interpreter's output comes back as tool turns
            out = tool_use.generate_with_tools(engine, tokenizer, prompt_ids, seeds, cfg.rollout,
                                               cfg.sandbox)
        else:
            out = rollout.generate(engine, prompt_ids, n=n, temperature=cfg.rollout.temperature,
                                   top_p=cfg.rollout.top_p, top_k=cfg.rollout.top_k,
                                   max_tokens=cfg.rollout.max_tokens, seeds=seeds)
    with timer("time/reward"):
        examples = [task.examples[prompts[i]] for i in out.prompt_index]
        scores, accuracies, reward_metrics = rewards.compute_rewards(
            out.texts, [e.ground_truth for e in examples], [e.data_source for e in examples],
            out.lengths, cfg.reward)
    responses = [
        Response(
            prompt=prompt_ids[out.prompt_index[r]], tokens=out.token_ids[r],
            rollout_logprobs=out.logprobs[r], reward=scores[r], accuracy=accuracies[r],
            truncated=out.finish_reasons[r] == "length",
            reflection=rewards.reflection_counts(out.texts[r]),
            policy_mask=policy_token_mask(out, r))
        for r in range(len(out.texts))]
    sums = {**timer.times, "responses": len(responses), "sampled_correct": sum(accuracies),
            **{key: reward_metrics[key] * len(responses) for key in REWARD_FRACTIONS},
            **(tool_use.tool_sums(out) if cfg.rollout.tools else {})}
    return [Group(responses[j * n].prompt, responses[j * n:(j + 1) * n])
            for j in range(len(prompts))], sums


def group_responses(groups, cfg, rank, world):
    """Group-normalised advantages (Eq. 1) of this rank's share of the groups, as one list."""
    per_rank = len(groups) // world
    mine = []
    for index in range(rank * per_rank, (rank + 1) * per_rank):
        group = groups[index]
        rewards_ = torch.tensor([r.reward for r in group.responses])  # [n]
        advantages = stare.group_advantages(rewards_, len(rewards_), cfg.algorithm.normalize_std)
        mine += [dataclasses.replace(r, advantage=float(a), group=index)
                 for r, a in zip(group.responses, advantages)]
    return mine


@torch.no_grad()
def old_policy_pass(model, responses, cfg, device):
    """One no-grad forward per micro-batch fills each response's old log-probs, entropies, entropy
    sensitivities and the method's own inputs (Response.extra)."""
    model.eval()
    temperature = cfg.rollout.temperature
    for indices in modeling.equal_count_micro_batches(responses, cfg.train.micro_token_budget, device):
        # an empty batch: a collective-only forward
        rows = [responses[i] for i in indices] or responses[:1]
        packed = modeling.pack_rows([r.prompt for r in rows], [r.tokens for r in rows], device)
        logits, ids = modeling.response_logits(model, packed), packed.response_ids  # [N, V], [N]
        logprobs, entropy = stare.token_logprobs_and_entropy(logits, ids, temperature)  # [N]
        sensitivity = stare.entropy_sensitivity(logits, ids, temperature)  # [N]
        # what the method needs beyond these (baselines.EXTRA_INPUTS) goes to Response.extra
        extra = baselines.old_policy_inputs(cfg.algorithm.method, logits, ids, temperature,
                                            cfg.loss)
        fields = {"old_logprobs": logprobs, "entropy": entropy, "sensitivity": sensitivity}
        lengths = [len(r.tokens) for r in rows]
        for key, values in {**fields, **extra}.items():
            for i, row_values in zip(indices, values.cpu().split(lengths)):
                target = vars(responses[i]) if key in fields else responses[i].extra
                target[key] = row_values


def update_states(states, responses, device):
    """The batch's token-mean entropy under pi_old, over all ranks, drives every method state once
    per step (baselines.method_states: STARE's gate, Eq. 10; EntroPIC's controller, Eq. 26): the
    same signal for all."""
    sums = runs.all_reduce({
        "tokens": sum(float(r.policy_mask.sum()) for r in responses),
        "entropy": sum(float(r.entropy[r.policy_mask].sum()) for r in responses),
        "surprisal": sum(float(-r.old_logprobs[r.policy_mask].sum()) for r in responses)}, device)
    tokens = max(sums["tokens"], 1)
    metrics = {"train/entropy": sums["entropy"] / tokens,
               "train/surprisal": sums["surprisal"] / tokens}
    for state in states.values():  # the state after this step's entropy: what the update uses
        metrics.update(state.metrics(state.update(sums["entropy"] / tokens)))
    return sums["tokens"], metrics


def select_tokens(responses, cfg, states, step, device):
    """Every method's token selection made once over the whole step, all ranks
    (algorithm.selection_scope=step), so the update depends on neither the micro-batch size nor the
    world size. Fills `selection` -> metrics."""
    method = cfg.algorithm.method
    if cfg.algorithm.selection_scope != "step" or method not in baselines.SELECTING:
        return {}  # nothing to select, or micro scope: policy_loss selects inside each micro-batch
    fields = ("old_logprobs", "entropy", "policy_mask", "advantage", "reward", "group",
              *baselines.EXTRA_INPUTS.get(method, ()))
    shared = [types.SimpleNamespace(**{key: method_input(r, key) for key in fields})
              for r in responses]
    everyone = [row for rank_rows in runs.all_gather(shared) for row in rank_rows]
    # [B, T] each, B = the step's responses
    batch = loss_batch(everyone, modeling.pad_rows, method, device=None)
    batch["logprobs"] = batch["old_logprobs"]  # the selection ranks tokens under pi_old
    generator = torch.Generator().manual_seed(data.derive_seed(cfg.train.seed, "selection", step))
    selection, metrics = baselines.token_selection(
        method, batch, cfg.loss, states=states, generator=generator)
    offset = (dist.get_rank() if dist.is_initialized() else 0) * len(responses)
    for j, response in enumerate(responses):
        response.selection = {k: v[offset + j, :len(response.tokens)] for k, v in selection.items()}
    return {k: float(v) for k, v in metrics.items()}


def loss_batch(rows, lay_out, method, device):
    """The per-token inputs of `method`'s loss for `rows` (responses, or their fields gathered from
    every rank): each response's [T] tensors laid out by `lay_out` (padded [B, T] rows for the
    step's selection, packed rows in a micro-batch), the sequence advantages [B], and what
    baselines.EXTRA_INPUTS says the method needs."""
    per_token = {"old_logprobs": "old_logprobs", "entropy": "entropy", "mask": "policy_mask",
                 **{key: key for key in baselines.EXTRA_INPUTS.get(method, ())}}
    batch = {key: lay_out([method_input(r, name) for r in rows]) for key, name in per_token.items()}
    for key, name in (("advantages", "advantage"), ("rewards", "reward"), ("groups", "group")):
        batch[key] = torch.tensor([getattr(r, name) for r in rows], device=device)
    return batch


def method_input(row, key):
    """A response's (or its gathered fields') per-token input `key`: a field, or one of the
    method's own (Response.extra)."""
    extra = getattr(row, "extra", None) or {}
    return extra[key] if key in extra else getattr(row, key)


def policy_update(model, optimizer, responses, cfg, states, step, device, scaler=None):
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
        for indices in modeling.equal_count_micro_batches(rows, cfg.train.micro_token_budget, device):
            share = len(indices) / len(rows)  # of the mini-batch's rows; 0: a padding batch
            loss, stats = micro_batch_loss(model, [rows[i] for i in indices] or rows[:1], share,
                                           denominators, cfg, states, step)
            (loss * loss_scale).backward()  # loss_scale: float16's dynamic scaling (LossScaler)
            runs.add_sums(mini_sums, stats)
            micro_batch_count += 1
        runs.add_sums(sums, mini_sums)
        if scaler is not None:
            scaler.unscale(model)
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.optim.grad_clip or math.inf)
        grad_norms.append(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)  # DTensor
        finite = runs.all_reduce({"loss": torch.isfinite(mini_sums["loss"]),  # the one host read
                             "grad": torch.isfinite(grad_norms[-1])}, device, op=dist.ReduceOp.MIN)
        finite_loss, finite_grad = finite["loss"] > 0, finite["grad"] > 0
        overflow = scaler is not None and scaler.after_step(finite_loss, finite_grad)
        if finite_loss and finite_grad:
            optimizer.step()
        else:  # skipped; counted as non-finite unless the loss scale explains it
            skipped, nonfinite = skipped + 1, nonfinite + (not overflow)
        optimizer.zero_grad(set_to_none=True)
    totals = runs.all_reduce(sums, device)
    grad_norms = torch.stack(grad_norms).double()  # the same on every rank
    step_scope = cfg.algorithm.selection_scope == "step"
    return {"train/loss": totals.pop("loss") / num_mini / (1 if step_scope else runs.world_size()),
            "train/grad_norm": float(grad_norms.mean()),
            "train/grad_norm_max": float(grad_norms.max()),
            "train/micro_batches": micro_batch_count, "train/skipped_updates": skipped,
            "train/nonfinite_updates": nonfinite,
            **({"train/loss_scale": loss_scale} if scaler is not None else {}),
            **{key: value / max(totals["stats_weight"], 1) for key, value in totals.items()
               if key != "stats_weight"}}


def loss_denominators(rows, cfg, device):
    """Step scope: the mini-batch's count of loss tokens and non-empty sequences over all ranks (the
    global token mean, Eq. 3), and those of EntroPIC's control term (Eq. 25). Micro scope (the
    reference): None, each micro-batch uses its own mean."""
    if cfg.algorithm.selection_scope != "step":
        return None
    method, valid = cfg.algorithm.method, modeling.pad_rows([r.policy_mask for r in rows])
    selection = {k: modeling.pad_rows([r.selection[k] for r in rows])
                 for k in rows[0].selection or {}}  # [B, T] each, as valid
    tokens = baselines.loss_mask(method, valid, selection, cfg.loss)
    control = baselines.control_mask(method, valid, selection)
    # the same keys on every rank and for every method (0 where there is no control term)
    control = torch.zeros_like(tokens) if control is None else control
    return runs.all_reduce({"num_tokens": tokens.sum(), "num_sequences": tokens.any(-1).sum(),
                            "num_control_tokens": control.sum(),
                            "num_control_sequences": control.any(-1).sum()}, device)


def micro_batch_loss(model, rows, share, denominators, cfg, states, step):
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
    batch["old_entropy"] = batch["entropy"]  # STEER's weights read pi_old's (micro scope too)
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
    selection = None if rows[0].selection is None else {
        k: rows_of(r.selection[k] for r in rows) for k in rows[0].selection}
    generator = torch.Generator(device=device).manual_seed(
        data.derive_seed(cfg.train.seed, "selection", step))
    loss, loss_metrics = baselines.policy_loss(
        cfg.algorithm.method, batch, cfg.loss, selection=selection, states=states,
        counts=denominators, token_weights=token_weights, generator=generator)
    # step scope: the loss is already this batch's share of the global mean and FSDP averages
    # gradients over ranks, hence x world; micro scope: each micro-batch's mean weighted by its
    # share of the rows (0 for a padding batch)
    scale = runs.world_size() if denominators else share
    weight = batch["mask"].sum()  # the statistics are token means over the step
    return loss * scale, {
        "loss": loss.detach() * (1 if denominators else scale), "stats_weight": weight,
        **{f"train/{k}" if "/" not in k else k: torch.where(weight > 0, v.detach() * weight, 0.0)
           for k, v in loss_metrics.items()}}


def batch_metrics(responses, num_tokens, device):
    """Rollout statistics of the training batch (the kept groups) and the predicted first-order
    entropy change of its update by quadrant (Eq. 6), over all ranks."""
    mismatch = [
        (torch.tensor(r.rollout_logprobs) - r.old_logprobs).abs()[r.policy_mask] for r in responses]
    sums = runs.all_reduce({
        "responses": len(responses), "correct": sum(r.accuracy for r in responses),
        "reward": sum(r.reward for r in responses), "length": sum(len(r.tokens) for r in responses),
        "zero_advantage": sum(r.advantage == 0 for r in responses),
        "truncated": sum(r.truncated for r in responses),
        "mismatch": sum(float(m.sum()) for m in mismatch),
        "reflection_words": sum(r.reflection[0] for r in responses),
        "words": sum(r.reflection[1] for r in responses)}, device)
    maxima = runs.all_reduce({
        "length": max((len(r.tokens) for r in responses), default=0),
        "mismatch": max((float(m.max()) for m in mismatch if m.numel()), default=0.0)},
        device, op=dist.ReduceOp.MAX)
    dynamics = stare.entropy_dynamics(
        torch.tensor([r.advantage for r in responses]),
        modeling.pad_rows([r.sensitivity for r in responses]),
        modeling.pad_rows([r.policy_mask for r in responses]), num_tokens=num_tokens)
    count = sums["responses"]
    return {
        "rollout/acc": sums["correct"] / count, "rollout/reward_mean": sums["reward"] / count,
        "rollout/response_length_mean": sums["length"] / count,
        "rollout/response_length_max": maxima["length"],
        "rollout/truncated_frac": sums["truncated"] / count,
        "train/zero_advantage_frac": sums["zero_advantage"] / count,  # 1: no learning signal at all
        "rollout/logprob_mismatch_mean": sums["mismatch"] / max(num_tokens, 1),
        "rollout/logprob_mismatch_max": maxima["mismatch"],
        "rollout/reflection_per_1k_words": 1000 * sums["reflection_words"] / max(sums["words"], 1),
        "train/tokens": num_tokens,
        **{f"stare/dynamics/{k}": v for k, v in runs.all_reduce(dynamics, device).items()}}


def train_step(run, state, step, stage=lambda name: None, first=False):
    """One optimizer step: the algorithm, stage by stage -> its metrics by name. stage(name) is
    called as each long stage begins (the progress line shows it); first: the first step of this
    process (a resumed run's too), whose weight sync is probed."""
    cfg, device, start, timer = run.cfg, run.device, time.time(), runs.Timer()
    stage("rollout")
    groups, state.data_position, rollout_metrics = sample_groups(
        run.engine, run.tokenizer, run.task, cfg, state.data_position, run.rank, run.world, device)
    if cfg.rollout.enable_sleep_mode:  # free the engine's memory for the update (GPU)
        rollout.release_memory(run.engine, cfg.rollout.sleep_level)
    responses = group_responses(groups, cfg, run.rank, run.world)
    stage("old log-probs")
    with timer("time/old_logprobs"):
        old_policy_pass(run.model, responses, cfg, device)
    num_tokens, state_metrics = update_states(run.states, responses, device)
    selection_metrics = select_tokens(responses, cfg, run.states, step, device)
    learning_rate = run.optimizer.param_groups[0]["lr"]  # the rate this step uses
    stage("update")
    with timer("time/update"):
        update_metrics = policy_update(run.model, run.optimizer, responses, cfg, run.states, step,
                                       device, state.scaler)
        run.scheduler.step()
    stage("weight sync")
    with timer("time/sync"):
        state.probe, probe_metrics = rollout.sync_engine(run.engine, run.model, cfg.rollout,
                                                         responses, step, state.probe, first)
    elapsed = time.time() - start
    return {**rollout_metrics, **batch_metrics(responses, num_tokens, device), **state_metrics,
            **selection_metrics, **update_metrics, "train/lr": learning_rate, **timer.times,
            "time/step": elapsed, "time/tokens_per_s": num_tokens / max(elapsed, 1e-9),
            **probe_metrics}


def policy_token_mask(out, index):
    """[T] bool of response `index` of a generation: True at tokens the policy sampled; False at
    tool-result tokens (multi-turn), which carry no gradient and count in no statistic."""
    tool_mask = getattr(out, "tool_mask", None)
    if tool_mask is None:
        return torch.ones(len(out.token_ids[index]), dtype=torch.bool)
    return ~torch.as_tensor(tool_mask[index], dtype=torch.bool)
