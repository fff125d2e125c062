"""train.py: the hand-written GRPO/STARE loop on torchrun + FSDP2, with one vLLM engine per rank.

    python tiny.py --out runs/tiny && python train.py --config configs/tiny.yaml        # CPU, one process
    torchrun --nproc_per_node 2 train.py --config configs/tiny.yaml                      # CPU, two ranks (gloo)
    torchrun --nproc_per_node 8 train.py --config configs/qwen2.5_math_7b_short_stare.yaml train.out_dir=runs/x

    python train.py --config configs/tiny.yaml --export                                 # the latest checkpoint as HF

Any config value can be overridden as section.key=value (see config.py). Everything a run writes goes under
train.out_dir: config.yaml (the resolved config), metrics.jsonl (one JSON object per step), checkpoints/ (sharded
by checkpoints.py, every train.save_every steps and at the end, the last train.keep_last kept), hf/ (the final model, loadable by
transformers and vLLM), hf_step_N/ (--export). Rerunning the same command resumes from the latest checkpoint
(train.resume=auto) exactly: model, optimizer, scheduler, step, data position, every RNG, the gate; the metrics of
steps after that checkpoint are dropped from metrics.jsonl and recomputed. A run refuses to start where checkpoints
newer than its starting step exist (another trajectory). SIGTERM, SIGUSR1 and SIGINT finish the current step, save a
checkpoint and exit with 128 + the signal number (a second Ctrl-C kills at once); under torchrun pass
--shutdown-timeout longer than a step plus a save, as torchrun SIGKILLs its workers 30 s after forwarding a signal.

Metrics (metrics.jsonl): rollout/acc_before_filter and the rollout/*_frac reward fractions cover every response
sampled in the step; rollout/acc, reward_mean, response_length_*, truncated_frac and reflection_per_1k_words cover
the kept groups, i.e. the training batch (dynamic sampling drops the all-equal ones, so its accuracy is pulled
towards 0.5). train/entropy and train/surprisal are token means over the batch, tool-result tokens excluded.

One step, top to bottom (the banners below follow it):
  1. prompts      each rank takes its share of a deterministic, seeded order of the training prompts
  2. rollout      n responses per prompt from the local engine, one seed per prompt from (seed, its global index
                  in the seeded prompt stream), so samples do not depend on the number of ranks
  3. rewards      verifier -> group advantages; dynamic sampling keeps groups whose rewards differ, samples more
                  rounds until the global batch holds train_batch_size groups, then deals them out evenly
  4. no-grad pass old log-probs, true entropies and entropy sensitivities (and Lp-Reg's proxy) from one forward;
                  the batch's token-mean entropy, over all ranks, updates the EntropyGate
  5. selection    algorithm.stare_scope=step: every method's token selection is made once over the whole batch
                  (all ranks), so the update does not depend on micro-batch size or world size; micro: inside
                  each micro-batch on current log-probs, as the reference
  6. update       micro-batches by token budget (the same count on every rank); step scope: loss normalised by the
                  global count of loss tokens; micro scope: each micro-batch's own mean, weighted by its share of
                  rows (verl's dynamic batch size); gradient clipping, AdamW; a non-finite loss or gradient skips
                  the optimizer step
  7. sync         stream the new weights into the engine; check the log-prob probe every few steps
  8. log          evaluation every eval.every steps (evaluate.py's sampler and verifier on the synced engine);
                  metrics.jsonl and the console (and wandb / TensorBoard when train.wandb / train.tensorboard)
  9. checkpoint   on schedule, at the end, and on SIGTERM / SIGINT

Simplified relative to the reference (verl): no Ray, no separate reference model (no KL term: STARE's runs use none),
on-policy by default, and the whole batch is exchanged between ranks with all_gather_object after dynamic sampling
(fine up to a few thousand responses per step). Old log-probs come from a separate no-grad pass (verl sets
pi_old := pi_theta.detach() on-policy, so its ratio is exactly 1; here it is 1 up to float noise). With several
mini-batches per step, step-scope selections are still made once per step on the old log-probs. Without dynamic
sampling the first train_batch_size groups of a generation round are used. No balance_batch reordering.
"""

import dataclasses
import functools
import json
import math
import os
import random
import signal
import socket
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

import baselines
import checkpoints
import config
import data
import evaluate
import rewards
import rollout
import stare


# ======================================================================================================================
# Plumbing: processes, model, batches
# ======================================================================================================================


def setup_distributed():
    """A process group in every case (a single process gets a group of one), so one code path serves both."""
    if "RANK" not in os.environ:  # plain `python train.py`: a local group of one
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    use_cuda = torch.cuda.is_available()
    if use_cuda:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl" if use_cuda else "gloo")
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if use_cuda else torch.device("cpu")
    return dist.get_rank(), dist.get_world_size(), device


def build_model(cfg, device, world_size):
    """The HF model, sharded with FSDP2 per decoder layer and then at the root (engineering.md §3)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(cfg.model.path, dtype=torch.float32,
                                                 attn_implementation=cfg.model.attn_implementation).to(device)
    model.config.use_cache = False
    if cfg.model.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    mesh = init_device_mesh(device.type, (world_size,))
    policy = MixedPrecisionPolicy(param_dtype=getattr(torch, cfg.model.param_dtype),
                                  reduce_dtype=getattr(torch, cfg.model.reduce_dtype))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    return model


def learning_rate_lambda(cfg):
    def factor(step):
        if step < cfg.optim.warmup_steps:
            return (step + 1) / cfg.optim.warmup_steps
        if cfg.optim.schedule == "constant":
            return 1.0
        progress = (step - cfg.optim.warmup_steps) / max(1, cfg.train.total_steps - cfg.optim.warmup_steps)
        return cfg.optim.min_lr_ratio + (1 - cfg.optim.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
    return factor


def pad_rows(rows, key, width, value=0.0, dtype=torch.float32):
    """[len(rows), width] tensor of rows[i][key] (lists or 1-D tensors), right-padded with value."""
    out = torch.full((len(rows), width), value, dtype=dtype)
    for i, row in enumerate(rows):
        values = torch.as_tensor(row[key], dtype=dtype)
        out[i, :len(values)] = values
    return out


def policy_token_mask(length, tool_mask=None):
    """[length] bool: True at the response tokens the policy sampled; False at tool-result tokens (multi-turn), which
    carry no gradient and count in no statistic (loss denominators, entropy, selection, mismatch)."""
    if tool_mask is None:
        return torch.ones(length, dtype=torch.bool)
    return ~torch.as_tensor(tool_mask, dtype=torch.bool)


def sequence_tensors(rows, pad_id, device):
    """Prompts left-padded to a common width P and responses right-padded to R, so every row's response starts at
    column P: the logits of positions P-1 ... P+R-2 predict the response tokens. -> dict of tensors."""
    prompt_width = max(len(r["prompt"]) for r in rows)
    response_width = max(1, max(len(r["response"]) for r in rows))
    input_ids = torch.full((len(rows), prompt_width + response_width), pad_id, dtype=torch.long)
    attention = torch.zeros_like(input_ids)
    for i, row in enumerate(rows):
        start = prompt_width - len(row["prompt"])
        input_ids[i, start:prompt_width] = torch.tensor(row["prompt"])
        input_ids[i, prompt_width:prompt_width + len(row["response"])] = torch.tensor(row["response"], dtype=torch.long)
        attention[i, start:prompt_width + len(row["response"])] = 1
    position_ids = (attention.cumsum(-1) - 1).clamp(min=0)  # RoPE positions restart at each prompt's first token
    response_mask = torch.arange(response_width)[None, :] < torch.tensor([len(r["response"]) for r in rows])[:, None]
    if "policy_mask" in rows[0]:  # tool-result tokens are part of the sequence but not of the loss
        response_mask &= pad_rows(rows, "policy_mask", response_width, value=False, dtype=torch.bool)
    return {"input_ids": input_ids.to(device), "attention_mask": attention.to(device),
            "position_ids": position_ids.to(device), "response_ids": input_ids[:, prompt_width:].to(device),
            "mask": response_mask.to(device), "prompt_width": prompt_width, "response_width": response_width}


def response_logits(model, tensors):
    """Logits at the response positions only ([b, R, V]): the LM head never runs over the prompt."""
    keep = torch.arange(tensors["prompt_width"] - 1, tensors["prompt_width"] + tensors["response_width"] - 1,
                        device=tensors["input_ids"].device)
    return model(input_ids=tensors["input_ids"], attention_mask=tensors["attention_mask"],
                 position_ids=tensors["position_ids"], logits_to_keep=keep, use_cache=False).logits


def micro_batches(rows, token_budget):
    """Row indices grouped so that rows x padded width stays within the budget (longest first). The width is the
    longest prompt plus the longest response: prompts are left-padded and responses right-padded separately."""
    order = sorted(range(len(rows)), key=lambda i: -(len(rows[i]["prompt"]) + len(rows[i]["response"])))
    batches, current, prompt_width, response_width = [], [], 0, 0
    for i in order:
        p, r = len(rows[i]["prompt"]), max(1, len(rows[i]["response"]))
        if current and (len(current) + 1) * (max(prompt_width, p) + max(response_width, r)) > token_budget:
            batches.append(current)
            current, prompt_width, response_width = [], 0, 0
        current.append(i)
        prompt_width, response_width = max(prompt_width, p), max(response_width, r)
    return batches + ([current] if current else [])


def equal_count_micro_batches(rows, token_budget, device):
    """micro_batches, padded with empty ones to the largest count over ranks: FSDP2's forward and backward are
    collectives, so every rank must run the same number of them (a mismatch hangs)."""
    batches = micro_batches(rows, token_budget)
    count = torch.tensor([len(batches)], device=device)
    dist.all_reduce(count, op=dist.ReduceOp.MAX)
    return batches + [[]] * (int(count) - len(batches))


REWARD_FRACTIONS = ("rollout/no_answer_frac", "rollout/parse_error_frac", "rollout/timeout_frac",
                    "rollout/format_ok_frac")


def all_sum(values, device):
    """Sum a list of floats over ranks."""
    tensor = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(tensor)
    return tensor.tolist()


class MetricsLog:
    """metrics.jsonl (one object per step, rank 0), a console line every log_every steps, and wandb / TensorBoard
    when the config turns them on (optional imports; config.check makes sure they are installed)."""

    def __init__(self, out_dir, cfg, rank, first_step=1):
        self.rank, self.log_every = rank, cfg.train.log_every
        self.file = open(Path(out_dir) / "metrics.jsonl", "a") if rank == 0 else None
        self.wandb_run = self.tensorboard = None
        if rank == 0 and cfg.train.wandb:  # one W&B run per out_dir, continued on resume (repeated steps keep their
            import wandb                   # first values there: W&B ignores steps it has seen)
            id_file = Path(out_dir) / "wandb_run_id"
            run_id = id_file.read_text().strip() if id_file.exists() else wandb.util.generate_id()
            id_file.write_text(run_id)
            self.wandb_run = wandb.init(project=cfg.train.wandb_project, name=Path(out_dir).name, id=run_id,
                                        resume="allow", dir=str(out_dir), config=config.to_dict(cfg))
        if rank == 0 and cfg.train.tensorboard:
            from torch.utils.tensorboard import SummaryWriter
            # purge_step: events of the steps a resume recomputes are dropped from the old event files
            self.tensorboard = SummaryWriter(str(Path(out_dir) / "tensorboard"), purge_step=first_step)

    def write(self, step, metrics, progress):
        if self.rank != 0:
            return
        record = {"step": step, **{k: (round(v, 6) if isinstance(v, float) else v) for k, v in metrics.items()}}
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()
        if self.wandb_run is not None:
            self.wandb_run.log(metrics, step=step)
        if self.tensorboard is not None:
            for key, value in metrics.items():
                self.tensorboard.add_scalar(key, value, step)
            self.tensorboard.flush()
        progress.set_postfix(acc=metrics.get("rollout/acc_before_filter"), entropy=metrics.get("train/entropy"),
                             gate=metrics.get("stare/gate_on"), refresh=False)
        if step % self.log_every == 0:
            keys = ("rollout/acc_before_filter", "rollout/acc", "eval/overall/avg@n", "train/entropy", "train/loss",
                    "stare/gate_on", "train/grad_norm", "time/step")
            progress.write(f"step {step}: " + " ".join(f"{k}={metrics[k]:.4g}" for k in keys if k in metrics))

    def close(self):
        if self.file is not None:
            self.file.close()
        if self.wandb_run is not None:
            self.wandb_run.finish()
        if self.tensorboard is not None:
            self.tensorboard.close()


# ======================================================================================================================
# The loop
# ======================================================================================================================


def main(argv):
    # ------------------------------------------------------------------------------------- config, processes, files
    export_only = "--export" in argv  # write an HF export of the checkpoint train.resume names, then stop
    argv = [a for a in argv if a != "--export"]
    if not argv or argv[0] != "--config" or len(argv) < 2:
        print("usage: train.py --config CONFIG.yaml [--export] [section.key=value ...]", file=sys.stderr)
        return 2
    try:
        cfg = config.load(argv[1], argv[2:])
    except config.ConfigError as error:
        print(f"config error: {error}", file=sys.stderr)
        return 2
    rank, world, device = setup_distributed()
    try:
        config.check(cfg, world_size=world)
    except config.ConfigError as error:
        if rank == 0:
            print(f"config error: {error}", file=sys.stderr)
        dist.destroy_process_group()
        return 2
    from tqdm import tqdm
    from transformers import AutoTokenizer

    out_dir = Path(cfg.train.out_dir)
    tokenizer = AutoTokenizer.from_pretrained(cfg.model.path)
    checkpoint = checkpoints.resume_path(cfg)
    problem = None
    if checkpoint is not None and not (checkpoint / "trainer.pt").exists():
        problem = f"train.resume={cfg.train.resume!r}: {checkpoint} is not a complete checkpoint (no trainer.pt)"
    elif not export_only:
        start_step = torch.load(checkpoint / "trainer.pt", weights_only=False)["step"] if checkpoint else 0
        later = [p.name for p in checkpoints.list_checkpoints(out_dir) if checkpoints.checkpoint_step(p) > start_step]
        if later:  # another trajectory's: pruning and `resume: auto` would mix the two
            problem = (f"{out_dir}/checkpoints holds checkpoints after step {start_step}, where this run starts "
                       f"(train.resume={cfg.train.resume!r}): {', '.join(later)}; use another train.out_dir or "
                       f"delete them")
    if problem:
        if rank == 0:
            print(f"error: {problem}", file=sys.stderr)
        dist.destroy_process_group()
        return 2
    if export_only:
        return export_checkpoint(cfg, checkpoint, tokenizer, device, rank, world)
    if rank == 0:
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "config.yaml").write_text(config.to_yaml(cfg))
        print(config.to_yaml(cfg))
    examples = [e for path in cfg.data.train_files
                for e in data.load_examples(path, prompt_suffix=cfg.data.prompt_suffix)]
    tools = [rollout.CODE_INTERPRETER_TOOL] if cfg.rollout.tools else None  # listed in the prompt's system block
    prompt_ids, examples, prompt_stats = data.tokenize_prompts(examples, tokenizer, cfg.data.max_prompt_tokens,
                                                               cfg.data.overflow, tools=tools)
    benchmarks = (evaluate.load_benchmarks(cfg.eval.files, prompt_suffix=cfg.data.prompt_suffix)
                  if cfg.eval.files and cfg.eval.every else {})

    # ----------------------------------------------------- engine (after the process group, before optimizer state)
    response_budget = max(cfg.rollout.max_tokens, cfg.eval.max_tokens if benchmarks else 0)
    engine = rollout.build_engine(
        cfg.model.path, seed=cfg.train.seed + rank, max_model_len=cfg.data.max_prompt_tokens + response_budget,
        dtype=cfg.rollout.dtype, gpu_memory_utilization=cfg.rollout.gpu_memory_utilization,
        kv_cache_gib=cfg.rollout.kv_cache_gib, max_num_seqs=cfg.rollout.max_num_seqs,
        enable_sleep_mode=cfg.rollout.enable_sleep_mode, enforce_eager=cfg.rollout.enforce_eager)
    torch.manual_seed(cfg.train.seed)  # after build_engine, which reseeds every global RNG (see rollout.py)
    random.seed(cfg.train.seed)
    model = build_model(cfg, device, world)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.optim.lr, betas=tuple(cfg.optim.betas),
                                  weight_decay=cfg.optim.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, learning_rate_lambda(cfg))
    gate = stare.EntropyGate(cfg.algorithm.target_entropy, cfg.loss.stare_w, cfg.loss.stare_m,
                             cfg.algorithm.gate_adaptive, cfg.algorithm.gate_alpha, cfg.algorithm.gate_w_max,
                             cfg.algorithm.gate_m_min)
    method, n, temperature = cfg.algorithm.method, cfg.rollout.n, cfg.rollout.temperature
    if cfg.loss.agg_mode == "seq-mean-token-sum-norm" and cfg.loss.loss_scale_factor is None:
        # Dr.GRPO's constant must not be the padded width of each micro-batch: use the response budget
        cfg.loss = dataclasses.replace(cfg.loss, loss_scale_factor=float(cfg.rollout.max_tokens))
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id

    # ----------------------------------------------------------------------------- resume: everything a step reads
    state = {"step": 0,  # the last finished step
             "data_position": 0,  # prompts consumed so far (global), the index into the seeded order below
             "nonfinite_in_a_row": 0, "probe": None}  # the probe: (token ids, prompt length) of the sync check
    if checkpoint is not None:
        state.update(checkpoints.load_checkpoint(checkpoint, model, optimizer, rank))
        scheduler.load_state_dict(state.pop("scheduler"))
        saved_gate = state.pop("gate")  # its state, not its settings: those come from this run's config
        for key in ("gate_on", "current_entropy") + (("w", "m") if gate.adaptive else ()):
            setattr(gate, key, saved_gate[key])
        rollout.sync_weights(engine, rollout.full_parameters(model))  # the engine started from model.path
        changed = checkpoints.config_differences((checkpoint / "config.yaml").read_text(), cfg)
        if rank == 0:
            print(f"resumed from {checkpoint} at step {state['step']}"
                  + (f"; config keys changed since: {', '.join(changed)}" if changed else ""), file=sys.stderr)
    data_position, nonfinite_in_a_row, probe = state["data_position"], state["nonfinite_in_a_row"], state["probe"]
    if rank == 0:
        checkpoints.keep_metrics(out_dir / "metrics.jsonl", state["step"] if checkpoint is not None else None)
    log = MetricsLog(out_dir, cfg, rank, first_step=state["step"] + 1)

    # SIGTERM / SIGUSR1 (e.g. SLURM's --signal=USR1@300) / SIGINT: finish the step, save a checkpoint, exit. Under
    # torchrun, give it --shutdown-timeout longer than a step plus a save: it SIGKILLs its workers 30 s after
    # forwarding a signal by default. A second Ctrl-C stops at once; a repeated SIGTERM does not (a scheduler may
    # signal every process and torchrun forward the same signal again).
    stop_signals = []

    def request_stop(signum, frame):
        stop_signals.append(signum)
        if signum == signal.SIGINT:
            signal.signal(signum, signal.SIG_DFL)

    for signum in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT):
        signal.signal(signum, request_stop)

    @functools.lru_cache(maxsize=2)
    def prompt_order(epoch):
        order = list(range(len(prompt_ids)))
        if cfg.data.shuffle:
            random.Random(cfg.train.seed * 100_003 + epoch).shuffle(order)
        return order

    def evaluation():  # evaluate.py's sampler and verifier on the engine's current weights -> eval/... metrics
        start = time.time()
        result = evaluate.evaluate(engine, tokenizer, benchmarks, n=cfg.eval.n, temperature=cfg.eval.temperature,
                                   top_p=cfg.eval.top_p, max_tokens=cfg.eval.max_tokens, reward_cfg=cfg.reward,
                                   seed=cfg.train.seed, max_prompt_tokens=cfg.data.max_prompt_tokens,
                                   overflow=cfg.data.overflow)
        return {**evaluate.flatten_metrics(result), "time/eval": time.time() - start}

    progress = tqdm(range(state["step"] + 1, cfg.train.total_steps + 1), desc="train", disable=rank != 0,
                    initial=state["step"], total=cfg.train.total_steps)
    if benchmarks and cfg.eval.before_train and state["step"] == 0:
        log.write(0, evaluation(), progress)  # the starting point of every eval curve
    for step in progress:
        timings, step_start = {}, time.time()
        metrics = {}

        # ---------------------------------------------------------------- 1-3. prompts, rollout, rewards, filtering
        kept_groups, rounds, generated_groups, varied_groups, generated_responses = [], 0, 0, 0, []
        generated_correct = 0.0  # accuracy before dynamic sampling's filter (kept groups are never all-correct)
        generated = []  # every group sampled in this step, all ranks (every rank holds the same list)
        tool_sums = []  # per round: calls, errors, timeouts, invalid calls, tool tokens, tokens, max_turns, responses
        while len(kept_groups) < cfg.train.train_batch_size:
            if cfg.algorithm.max_num_gen_batches and rounds >= cfg.algorithm.max_num_gen_batches:
                raise RuntimeError(
                    f"step {step}: dynamic sampling kept {len(kept_groups)} of the {cfg.train.train_batch_size} "
                    f"groups needed after {rounds} rounds (algorithm.max_num_gen_batches); the task is too easy or "
                    f"too hard for the model: raise the limit or turn algorithm.dynamic_sampling off")
            share = cfg.algorithm.gen_batch_size // world
            global_indices = [data_position + rank * share + i for i in range(share)]
            data_position += cfg.algorithm.gen_batch_size
            local_prompts = [prompt_order(g // len(prompt_ids))[g % len(prompt_ids)] for g in global_indices]
            start = time.time()
            seeds = [(cfg.train.seed * 1_000_003 + g) % 2**48 for g in global_indices]  # the global index decides
            sampling = dict(n=n, temperature=temperature, top_p=cfg.rollout.top_p, top_k=cfg.rollout.top_k,
                            max_tokens=cfg.rollout.max_tokens, seeds=seeds)
            if cfg.rollout.tools:  # multi-turn: the code interpreter's output comes back as tool turns
                out = rollout.generate_with_tools(engine, tokenizer, [prompt_ids[p] for p in local_prompts],
                                                  max_turns=cfg.rollout.max_turns, sandbox_config=cfg.sandbox,
                                                  max_tool_response_tokens=cfg.rollout.max_tool_response_tokens,
                                                  **sampling)
                tool_sums.append([sum(out.num_calls), sum(out.num_errors), sum(out.num_timeouts),
                                  sum(out.num_invalid), sum(map(sum, out.tool_mask)), sum(out.lengths),
                                  out.finish_reasons.count("max_turns"), len(out.texts)])
            else:
                out = rollout.generate(engine, [prompt_ids[p] for p in local_prompts], **sampling)
            timings["time/rollout"] = timings.get("time/rollout", 0.0) + time.time() - start
            start = time.time()
            truths = [examples[local_prompts[i]].ground_truth for i in out.prompt_index]
            sources = [examples[local_prompts[i]].data_source for i in out.prompt_index]
            scores, accuracies, reward_metrics = rewards.compute_rewards(out.texts, truths, sources, out.lengths,
                                                                         cfg.reward)
            timings["time/reward"] = timings.get("time/reward", 0.0) + time.time() - start
            groups = []
            for j in range(len(local_prompts)):
                rows = range(j * n, (j + 1) * n)
                groups.append({"prompt": prompt_ids[local_prompts[j]], "responses": [out.token_ids[r] for r in rows],
                               "rollout_logprobs": [out.logprobs[r] for r in rows],
                               "rewards": [scores[r] for r in rows], "accuracies": [accuracies[r] for r in rows],
                               "finish_reasons": [out.finish_reasons[r] for r in rows],
                               "reflection": [evaluate.reflection_counts(out.texts[r]) for r in rows],
                               "tool_masks": [out.tool_mask[r] for r in rows] if cfg.rollout.tools else [None] * n})
            generated_responses.append([reward_metrics[k] * len(out.texts) for k in REWARD_FRACTIONS]
                                       + [len(out.texts)])
            generated_correct += sum(accuracies)
            gathered = [None] * world
            dist.all_gather_object(gathered, groups)
            for rank_groups in gathered:  # rank order: every rank sees the same global list
                for group in rank_groups:
                    generated.append(group)
                    generated_groups += 1
                    varied = len(set(group["accuracies"])) > 1
                    varied_groups += varied
                    if varied or not cfg.algorithm.dynamic_sampling:
                        kept_groups.append(group)
            rounds += 1
        if cfg.rollout.enable_sleep_mode:
            rollout.release_memory(engine)  # free the KV cache and weights for the update (GPU)
        kept_groups = kept_groups[:cfg.train.train_batch_size]
        per_rank = cfg.train.train_batch_size // world
        my_groups = kept_groups[rank * per_rank:(rank + 1) * per_rank]  # balanced shares

        # advantages, one row per response
        rows = []
        for group in my_groups:
            advantages = stare.group_advantages(torch.tensor(group["rewards"]), n, cfg.algorithm.normalize_std)
            for k in range(n):
                rows.append({"prompt": group["prompt"], "response": group["responses"][k],
                             "rollout_logprobs": group["rollout_logprobs"][k], "advantage": advantages[k].item(),
                             "reward": group["rewards"][k], "accuracy": group["accuracies"][k],
                             "truncated": group["finish_reasons"][k] == "length",
                             "reflection": group["reflection"][k],
                             "policy_mask": policy_token_mask(len(group["responses"][k]), group["tool_masks"][k])})

        # ---------------------------------------------------------------- 4. no-grad pass: old log-probs, entropy
        start = time.time()
        model.eval()
        with torch.no_grad():
            for indices in equal_count_micro_batches(rows, cfg.train.micro_token_budget, device):
                batch_rows = [rows[i] for i in indices] or rows[:1]  # an empty batch: a collective-only forward
                tensors = sequence_tensors(batch_rows, pad_id, device)
                logits = response_logits(model, tensors)
                logprobs, entropy = stare.token_logprobs_and_entropy(logits, tensors["response_ids"], temperature)
                sensitivity = stare.entropy_sensitivity(logits, tensors["response_ids"], temperature)
                proxy = (baselines.minp_proxy_logprobs(logits, tensors["response_ids"], temperature,
                                                       cfg.loss.lp_reg_kappa, cfg.loss.lp_reg_soft)
                         if method == "lp_reg" else None)
                for j, i in enumerate(indices):  # nothing for an empty batch
                    length = len(rows[i]["response"])
                    rows[i]["old_logprobs"] = logprobs[j, :length].cpu()
                    rows[i]["entropy"] = entropy[j, :length].cpu()
                    rows[i]["sensitivity"] = sensitivity[j, :length].cpu()
                    if proxy is not None:
                        rows[i]["proxy_logprobs"] = proxy[j, :length].cpu()
        timings["time/old_logprobs"] = time.time() - start
        token_entropy_sum = sum(float(r["entropy"][r["policy_mask"]].sum()) for r in rows)
        token_count = sum(int(r["policy_mask"].sum()) for r in rows)
        token_surprisal_sum = sum(float(-r["old_logprobs"][r["policy_mask"]].sum()) for r in rows)
        entropy_sum, surprisal_sum, tokens = all_sum([token_entropy_sum, token_surprisal_sum, token_count], device)
        batch_entropy = entropy_sum / max(tokens, 1)
        gate_accepted = gate.update(batch_entropy)  # once per step, before the update (§1.3)

        # ---------------------------------------------------------------- 5. token selection over the whole step
        selection_metrics = {}
        if cfg.algorithm.stare_scope == "step" and method not in ("grpo", "entropy_bonus"):
            shared_keys = ["old_logprobs", "entropy", "advantage", "response", "policy_mask"] + (
                ["proxy_logprobs"] if method == "lp_reg" else [])
            gathered = [None] * world
            dist.all_gather_object(gathered, [{k: r[k] for k in shared_keys} for r in rows])
            everyone = [r for rank_rows in gathered for r in rank_rows]
            width = max(1, max(len(r["response"]) for r in everyone))
            step_batch = {"logprobs": pad_rows(everyone, "old_logprobs", width),
                          "old_logprobs": pad_rows(everyone, "old_logprobs", width),
                          "entropy": pad_rows(everyone, "entropy", width),
                          "advantages": torch.tensor([r["advantage"] for r in everyone]),
                          "mask": pad_rows(everyone, "policy_mask", width, value=False, dtype=torch.bool)}
            if method == "lp_reg":
                step_batch["proxy_logprobs"] = pad_rows(everyone, "proxy_logprobs", width)
            generator = torch.Generator().manual_seed(cfg.train.seed * 7919 + step)  # the same on every rank
            selection, selection_metrics = baselines.token_selection(method, step_batch, cfg.loss, gate=gate,
                                                                     generator=generator)
            offset = rank * len(rows)
            for j, row in enumerate(rows):
                row["selection"] = {k: v[offset + j, :len(row["response"])] for k, v in selection.items()}

        # ---------------------------------------------------------------- 6. update
        start = time.time()
        model.train()
        loss_sum, stats_sum, stats_weight = 0.0, {}, 0.0
        num_mini = cfg.train.train_batch_size // cfg.train.mini_batch_size
        mini_size = len(rows) // num_mini
        grad_norms = []
        step_scope = cfg.algorithm.stare_scope == "step"
        micro_batch_count, skipped_updates = 0, 0
        for mini in range(num_mini):
            mini_rows = rows[mini * mini_size:(mini + 1) * mini_size]
            batches = equal_count_micro_batches(mini_rows, cfg.train.micro_token_budget, device)
            micro_batch_count += len(batches)
            if step_scope:  # the denominator: this mini-batch's loss tokens (and sequences) over all ranks
                local_tokens = local_sequences = 0.0
                for row in mini_rows:
                    row_selection = {k: v[None] for k, v in row.get("selection", {}).items()}
                    row_mask = baselines.loss_mask(method, row["policy_mask"][None], row_selection, cfg.loss)
                    local_tokens += float(row_mask.sum())
                    local_sequences += float(row_mask.any())
                num_tokens, num_sequences = all_sum([local_tokens, local_sequences], device)
            else:  # the reference: each micro-batch's own mean, weighted by its share of rows (and ranks by FSDP)
                num_tokens = num_sequences = None
            mini_loss = 0.0
            for indices in batches:
                # step scope: the loss is already a share of the global mean and FSDP averages gradients over
                # ranks, hence x world; micro scope: weighted by the rows it holds (0 for a padding batch)
                scale = world if step_scope else len(indices) / len(mini_rows)
                batch_rows = [mini_rows[i] for i in indices] or mini_rows[:1]  # an empty batch reruns one row x 0
                tensors = sequence_tensors(batch_rows, pad_id, device)
                logits = response_logits(model, tensors)
                logprobs, entropy = stare.token_logprobs_and_entropy(logits, tensors["response_ids"], temperature)
                width = tensors["response_width"]
                batch = {"logprobs": logprobs, "entropy": entropy,
                         "old_logprobs": pad_rows(batch_rows, "old_logprobs", width).to(device),
                         "advantages": torch.tensor([r["advantage"] for r in batch_rows], device=device),
                         "mask": tensors["mask"] & bool(indices)}
                if method == "lp_reg":
                    batch["proxy_logprobs"] = pad_rows(batch_rows, "proxy_logprobs", width).to(device)
                token_weights = None
                if cfg.algorithm.importance_sampling:  # truncated IS: pi_old / pi_rollout, capped (TIS)
                    rollout_logprobs = pad_rows(batch_rows, "rollout_logprobs", width).to(device)
                    token_weights = torch.exp(batch["old_logprobs"] - rollout_logprobs).clamp(max=cfg.algorithm.is_cap)
                selection = None  # micro scope (or grpo / entropy_bonus): policy_loss selects within this micro-batch
                if "selection" in batch_rows[0]:
                    row_selections = [r["selection"] for r in batch_rows]
                    selection = {k: pad_rows(row_selections, k, width, dtype=v.dtype).to(device)
                                 for k, v in row_selections[0].items()}
                generator = torch.Generator(device=device).manual_seed(cfg.train.seed * 7919 + step)
                loss, loss_metrics = baselines.policy_loss(
                    method, batch, cfg.loss, selection=selection, gate=gate, generator=generator,
                    num_tokens=num_tokens, num_sequences=num_sequences, token_weights=token_weights)
                (loss * scale).backward()
                mini_loss += loss.item() * (1.0 if step_scope else scale)
                weight = float(batch["mask"].sum())
                if weight == 0:  # a padding batch: its statistics are 0/0
                    continue
                stats_weight += weight
                for k, v in loss_metrics.items():
                    stats_sum[k] = stats_sum.get(k, 0.0) + v.item() * weight
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.optim.grad_clip or float("inf"))
            grad_norm = float(grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm)
            grad_norms.append(grad_norm)
            loss_sum += mini_loss
            finite = all_sum([float(math.isfinite(grad_norm) and math.isfinite(mini_loss))], device)[0] == world
            if finite:
                optimizer.step()
            else:
                skipped_updates += 1
            optimizer.zero_grad(set_to_none=True)
        nonfinite_in_a_row = nonfinite_in_a_row + 1 if skipped_updates else 0
        if nonfinite_in_a_row > cfg.optim.max_nonfinite_steps:
            raise RuntimeError(f"step {step}: non-finite loss or gradient norm in {nonfinite_in_a_row} consecutive "
                               f"steps (optim.max_nonfinite_steps={cfg.optim.max_nonfinite_steps})")
        learning_rate = scheduler.get_last_lr()[0]  # the rate this step used
        scheduler.step()
        timings["time/update"] = time.time() - start

        # ---------------------------------------------------------------- 7. sync the engine
        start = time.time()
        if cfg.rollout.enable_sleep_mode:
            rollout.wake_weights(engine)  # weights first, then load, then the KV cache (engineering.md §1)
        rollout.sync_weights(engine, rollout.full_parameters(model))
        if cfg.rollout.enable_sleep_mode:
            rollout.wake_kv_cache(engine)
        timings["time/sync"] = time.time() - start
        sync_error = None
        if cfg.rollout.sync_check_every and step % cfg.rollout.sync_check_every == 0:
            if probe is None:  # a finished, non-empty response: room in the context and at least one log-prob
                usable = [r for r in rows if r["response"] and not r["truncated"]]
                probes = [None] * world
                dist.all_gather_object(probes, (usable[0]["prompt"] + usable[0]["response"],
                                                len(usable[0]["prompt"])) if usable else None)
                probe = next((p for p in probes if p is not None), None)  # the same on every rank: a collective
            if probe is not None:
                model.eval()
                sync_error = rollout.weight_sync_error(engine, model, probe[0], probe[1])

        # ---------------------------------------------------------------- 8. metrics
        accuracy_sum = sum(r["accuracy"] for r in rows)
        reward_sum = sum(r["reward"] for r in rows)
        lengths = [len(r["response"]) for r in rows]
        mismatch = [(torch.tensor(r["rollout_logprobs"]) - r["old_logprobs"]).abs()[r["policy_mask"]] for r in rows
                    if r["policy_mask"].any()]
        mismatch_sum = sum(float(m.sum()) for m in mismatch)
        maxima = torch.tensor([max([float(m.max()) for m in mismatch] or [0.0]), max(lengths, default=0)],
                              dtype=torch.float64, device=device)
        dist.all_reduce(maxima, op=dist.ReduceOp.MAX)
        mismatch_max, length_max = maxima.tolist()
        totals = all_sum([accuracy_sum, reward_sum, len(rows), sum(lengths), sum(r["truncated"] for r in rows),
                          mismatch_sum, stats_weight, loss_sum, sum(r["reflection"][0] for r in rows),
                          sum(r["reflection"][1] for r in rows)], device)
        width = max(1, max(lengths))
        dynamics = stare.entropy_dynamics(torch.tensor([r["advantage"] for r in rows]),
                                          pad_rows(rows, "sensitivity", width),
                                          pad_rows(rows, "policy_mask", width, value=False, dtype=torch.bool),
                                          num_tokens=tokens)
        dynamics_keys = sorted(dynamics)
        dynamics_sum = all_sum([float(dynamics[k]) for k in dynamics_keys], device)
        fraction_sums = all_sum([sum(column) for column in zip(*generated_responses)] + [generated_correct], device)
        generated_acc = fraction_sums.pop() / max(fraction_sums[-1], 1)
        metric_keys = sorted(stats_sum)
        loss_stats = all_sum([stats_sum[k] for k in metric_keys], device)
        metrics.update({
            "rollout/acc": totals[0] / totals[2], "rollout/reward_mean": totals[1] / totals[2],
            "rollout/response_length_mean": totals[3] / totals[2], "rollout/truncated_frac": totals[4] / totals[2],
            "rollout/response_length_max": length_max,
            "rollout/logprob_mismatch_mean": totals[5] / max(tokens, 1), "rollout/logprob_mismatch_max": mismatch_max,
            "rollout/acc_before_filter": generated_acc,
            "rollout/reflection_per_1k_words": 1000 * totals[8] / max(totals[9], 1),
            "rollout/gen_rounds": rounds, "rollout/varied_group_frac": varied_groups / max(generated_groups, 1),
            "train/entropy": batch_entropy, "train/surprisal": surprisal_sum / max(tokens, 1),
            "train/loss": totals[7] / num_mini / (1 if step_scope else world),
            "train/grad_norm": sum(grad_norms) / num_mini,
            "train/grad_norm_max": float(torch.tensor(grad_norms).max()),  # NaN if any is (Python's max hides it)
            "train/lr": learning_rate,
            "train/tokens": tokens, "train/micro_batches": micro_batch_count, "train/skipped_updates": skipped_updates,
            "stare/gate_on": float(gate.gate_on), "stare/w": gate.w, "stare/m": gate.m,
            "stare/gate_update_accepted": float(gate_accepted),
            **{(k if "/" in k else f"train/{k}"): v / max(totals[6], 1) for k, v in zip(metric_keys, loss_stats)},
            **{f"stare/dynamics/{k}": v for k, v in zip(dynamics_keys, dynamics_sum)},
            **{k: float(v) for k, v in selection_metrics.items()},
            **dict(zip(REWARD_FRACTIONS, [v / max(fraction_sums[-1], 1) for v in fraction_sums[:-1]])),
            **timings, "time/step": time.time() - step_start,
            "time/tokens_per_s": tokens / max(time.time() - step_start, 1e-9),
        })
        if sync_error is not None:
            metrics["rollout/sync_probe_error"] = sync_error
        diversity = evaluate.distinct_correct_fraction(generated)
        if diversity is not None:
            metrics["rollout/distinct_correct_frac"] = diversity
        if cfg.rollout.tools:  # over every response sampled in the step, all ranks
            calls, errors, timeouts, invalid, tool_tokens, all_tokens, max_turns, responses = all_sum(
                [sum(column) for column in zip(*tool_sums)], device)
            metrics.update({"rollout/tool_calls_mean": calls / max(responses, 1),
                            "rollout/tool_error_frac": errors / max(calls, 1),
                            "rollout/tool_timeout_frac": timeouts / max(calls, 1),
                            "rollout/tool_invalid_frac": invalid / max(calls, 1),
                            "rollout/tool_token_frac": tool_tokens / max(all_tokens, 1),
                            "rollout/max_turns_frac": max_turns / max(responses, 1)})
        if benchmarks and (step % cfg.eval.every == 0 or step == cfg.train.total_steps):
            metrics.update(evaluation())
        log.write(step, metrics, progress)

        # ---------------------------------------------------------------- 9. checkpoint
        stop = all_sum([float(bool(stop_signals))], device)[0] > 0  # a signal to any rank stops all of them
        if stop or step == cfg.train.total_steps or (cfg.train.save_every and step % cfg.train.save_every == 0):
            trainer_state = {"step": step, "data_position": data_position, "nonfinite_in_a_row": nonfinite_in_a_row,
                             "probe": probe, "scheduler": scheduler.state_dict(), "gate": gate.state_dict()}
            path = checkpoints.save_checkpoint(out_dir, step, model, optimizer, trainer_state, cfg, rank, world)
            if rank == 0:
                progress.write(f"step {step}: checkpoint {path}")
        if stop and step < cfg.train.total_steps:  # at the last step: finish normally (export included)
            if rank == 0:
                progress.write(f"stopped by a signal after step {step}; `resume: auto` continues from {path}")
            log.close()
            rollout.shutdown_engine(engine)
            return 128 + (stop_signals[0] if stop_signals else signal.SIGTERM)

    # ------------------------------------------------------------------------------------------ export and shut down
    checkpoints.export_hf(model, cfg, tokenizer, out_dir / "hf", rank)
    log.close()
    rollout.shutdown_engine(engine)
    if dist.is_initialized():
        dist.destroy_process_group()
    return 0


def export_checkpoint(cfg, checkpoint, tokenizer, device, rank, world):
    """`train.py --config C --export`: the checkpoint train.resume names as an HF model in out_dir/hf_step_N."""
    if checkpoint is None:
        print(f"--export: no checkpoint under {cfg.train.out_dir}/checkpoints (train.resume={cfg.train.resume!r})",
              file=sys.stderr)
        dist.destroy_process_group()
        return 2
    model = build_model(cfg, device, world)
    step = checkpoints.load_checkpoint(checkpoint, model, None, rank)["step"]  # the weights only
    path = Path(cfg.train.out_dir) / f"hf_step_{step}"
    checkpoints.export_hf(model, cfg, tokenizer, path, rank)
    if rank == 0:
        print(f"exported {checkpoint} to {path}")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
