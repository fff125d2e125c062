"""train.py: the hand-written GRPO/STARE loop on torchrun + FSDP2, with one vLLM engine per rank.

    python -m tools.tiny --out runs/tiny && python train.py --config configs/tiny.yaml  # CPU, one process
    torchrun --nproc_per_node 2 train.py --config configs/tiny.yaml                      # CPU, two ranks (gloo)
    torchrun --nproc_per_node 8 train.py --config configs/qwen7b_long.yaml               # GPU node
    python train.py --config configs/tiny.yaml --export                                 # latest checkpoint as HF

Any config value can be overridden as section.key=value (config.py). A run writes under
train.out_dir: config.yaml, metrics.jsonl (one object per step), checkpoints/ (checkpoints.py), hf/
(the final model). Rerunning the same command resumes exactly from the latest checkpoint; SIGTERM /
SIGUSR1 / SIGINT finish the step, save and exit.

The steps: grpo.train_step, whose stages are the algorithm (grpo.py, the file to read and edit);
here, the run around them: start-up and resume (`start_run`), the loop with evaluation, metrics
and checkpoints on schedule (`train`), the guards that stop a run in one line, the export.
"""

import collections
import dataclasses
import math
import random
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from tqdm import tqdm

import baselines
import checkpoints
import config
import data
import evaluate
import grpo
import modeling
import plan
import rollout
import runs
import sandbox
import tool_use


def nonfinite_guard(metrics, state, cfg, step):
    """One line when more steps in a row than optim.max_nonfinite_steps had a non-finite loss or
    gradient norm that no float16 loss scale explains (train/nonfinite_updates), else None."""
    skipped = metrics["train/nonfinite_updates"]
    in_a_row = state.nonfinite_in_a_row = state.nonfinite_in_a_row + 1 if skipped else 0
    if in_a_row > cfg.optim.max_nonfinite_steps:
        return (f"error: step {step}: non-finite loss or gradient norm in {in_a_row} consecutive "
                f"steps (optim.max_nonfinite_steps={cfg.optim.max_nonfinite_steps})")
    return None


def sandbox_guard(metrics, state, cfg, step):
    """One line when the sandbox itself failed (rollout/sandbox_failures: the code never ran, or
    its result was lost) in more of this step's tool calls, or of the last sandbox.window_steps
    steps' (state.sandbox_window), than its bounds allow (config.SandboxConfig), else None. Rewards
    computed without the tool's output make RL with tools silently RL without them."""
    if "rollout/sandbox_failures" not in metrics:  # no tools
        return None
    box = cfg.sandbox
    failures, calls = metrics["rollout/sandbox_failures"], metrics["rollout/tool_calls"]
    state.sandbox_window = (state.sandbox_window + [[failures, calls]])[-box.window_steps:]
    window_failures, window_calls = map(sum, zip(*state.sandbox_window))
    for failed, made, name, where in (
            (failures, calls, "max_failure_frac", "this step's"),
            (window_failures, window_calls, "max_window_failure_frac",
             f"the last {len(state.sandbox_window)} steps'")):
        bound = getattr(box, name)
        if made and failed / made > bound:
            return (
                f"error: step {step}: the sandbox itself failed in {failed:g} of {where} {made:g} "
                f"tool calls ({failed / made:.3g} > sandbox.{name} = {bound:g}); the latest: "
                f"{sandbox.last_failure() or 'on another rank'}. Its code never ran, so the "
                f"rewards were computed without the tool's output. Check that sandbox.python runs "
                f"and sandbox.tmp_root has room (`python sandbox.py` runs one code as a tool call "
                f"would; docs/sandbox.md); stopped before this step's checkpoint")
    return None


def zero_signal_guard(metrics, in_a_row, cfg, step):
    """The zero-signal guard: a step at or below train.min_varied_group_frac or
    train.min_answered_frac (shares defined in config.py) trains on (almost) no signal and raises no
    error. -> (consecutive steps without signal up to this one, given in_a_row before it; the line
    when their count reaches train.zero_signal_warn_steps or zero_signal_stop_steps, else None)."""
    t = cfg.train
    answered = 1 - metrics["rollout/no_answer_frac"] - metrics["rollout/parse_error_frac"]
    lacking = [
        f"{key} = {value:.3g} <= train.{name} = {getattr(t, name):g}"
        for key, value, name in (
            ("rollout/varied_group_frac", metrics["rollout/varied_group_frac"],
             "min_varied_group_frac"),
            ("1 - rollout/no_answer_frac - rollout/parse_error_frac", answered,
             "min_answered_frac"))
        if value <= getattr(t, name)]
    in_a_row = in_a_row + 1 if lacking else 0
    stop = t.zero_signal_stop_steps and in_a_row >= t.zero_signal_stop_steps
    if not lacking or not (stop or in_a_row == t.zero_signal_warn_steps):
        return in_a_row, None
    return in_a_row, (
        f"{'error' if stop else 'warning'}: step {step}: no learning signal in {in_a_row} "
        f"consecutive steps: {'; '.join(lacking)}. Likely: a prompt template or answer format the "
        f"reward never matches, a response limit (rollout.max_tokens) that cuts every answer, or a "
        f"model too weak for groups of rollout.n={cfg.rollout.n}" + (
            f"; stopped after this step's checkpoint (train.zero_signal_stop_steps="
            f"{t.zero_signal_stop_steps}; 0 goes on)" if stop else ""))


def sync_guard(metrics, cfg, step):
    """One line when the engine and the trainer disagree beyond their bounds (a failed or partial
    weight sync samples from other weights than the ones trained), else None. The bounds and their
    noise floor: docs/usage.md, "GPU runs: the checks"."""
    for key, name in (("rollout/sync_probe_error", "max_sync_probe_error"),
                      ("rollout/sync_probe_tv", "max_sync_probe_tv"),
                      ("rollout/logprob_mismatch_mean", "max_logprob_mismatch")):
        bound = getattr(cfg.rollout, name)
        if key in metrics and not metrics[key] <= bound:
            return (f"error: step {step}: {key} = {metrics[key]:.3g} exceeds rollout.{name} = "
                    f"{bound:g}: the engine is not sampling from the trained weights (a failed "
                    f"weight sync); stopped before this step's checkpoint (metrics.jsonl has the "
                    f"step). Try rollout.sleep_level=1 on GPU")
    return None


def main(argv):
    export_only = "--export" in argv  # an HF export of the checkpoint train.resume names, then stop
    planning = "--plan" in argv  # print the memory plan of the config on its hardware, then stop
    argv = [a for a in argv if a not in ("--export", "--plan")]
    if len(argv) < 2 or argv[0] != "--config":
        print("usage: train.py --config CONFIG.yaml [--export | --plan] [section.key=value ...]",
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
    rank, world, device = runs.setup_distributed(cfg.train.nccl_timeout_minutes)
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
    progress = tqdm(range(first_step, cfg.train.total_steps + 1), desc="train",
                    disable=run.rank != 0, initial=state.step, total=cfg.train.total_steps)
    if run.benchmarks and cfg.eval.before_train and state.step == 0:
        log.write(0, evaluation(run), progress)  # the starting point of every eval curve
    try:
        for step in progress:
            def stage(name):  # the stage running now, beside the progress bar
                progress.set_postfix_str(f"step {step}: {name}", refresh=True)
            metrics = grpo.train_step(run, state, step, first=step == first_step, stage=stage)
            metrics.update(run.task.metrics)  # data/*: what loading the prompts did
            if run.benchmarks and (step % cfg.eval.every == 0 or step == cfg.train.total_steps):
                metrics.update(evaluation(run))
            state.zero_signal_in_a_row, no_signal = zero_signal_guard(
                metrics, state.zero_signal_in_a_row, cfg, step)
            metrics["train/zero_signal_steps"] = state.zero_signal_in_a_row
            log.write(step, metrics, progress)
            # before this step's checkpoint: the last one holds finite weights the engine sampled
            problem = (nonfinite_guard(metrics, state, cfg, step) or sync_guard(metrics, cfg, step)
                       or sandbox_guard(metrics, state, cfg, step))
            if problem:
                raise runs.RunError(problem)
            no_signal_stop = no_signal is not None and no_signal.startswith("error")
            if no_signal and not no_signal_stop and run.rank == 0:
                progress.write(no_signal, file=sys.stderr)
            state.step = step
            # a signal to any rank
            stopping = runs.all_reduce({"stop": float(stop.requested)}, run.device)["stop"] > 0
            if (stopping or no_signal_stop or step == cfg.train.total_steps
                    or (cfg.train.save_every and step % cfg.train.save_every == 0)):
                path = checkpoints.save_checkpoint(
                    run.out_dir, step, run.model, run.optimizer, trainer_state(run, state), cfg,
                    run.rank, run.world)
                if run.rank == 0:
                    progress.write(f"step {step}: checkpoint {path}")
            if no_signal_stop:  # the same metrics on every rank: all stop here
                raise runs.RunError(no_signal)
            # at the last step: finish normally (export included)
            if stopping and step < cfg.train.total_steps:
                if run.rank == 0:
                    progress.write(f"stopped by a signal after step {step}; `resume: auto` "
                                   f"continues from {path}")
                return 128 + stop.signal_number
        if cfg.rollout.enable_sleep_mode:  # the export's gathers take the engine's memory
            rollout.release_memory(run.engine, cfg.rollout.sleep_level)
        checkpoints.export_hf(run.model, cfg, run.tokenizer, run.out_dir / "hf", run.rank)
        if cfg.rollout.enable_sleep_mode:  # freeing a sleeping engine's unmapped memory fails
            rollout.wake_weights(run.engine)
            rollout.wake_kv_cache(run.engine)
        return 0
    finally:
        try:
            log.close()
        finally:  # a failing wandb.finish() must not keep the engine from shutting down
            rollout.shutdown_engine(run.engine)


@dataclasses.dataclass
class Run:
    """What every step uses and no step reassigns (the model and optimizer change in place)."""

    cfg: config.Config
    rank: int
    world: int
    device: torch.device
    out_dir: Path
    tokenizer: object
    task: data.Task | None
    benchmarks: dict
    engine: object
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    # name -> stare.MethodState: what the method carries across steps (baselines.method_states)
    states: dict
    checkpoint: Path | None


@dataclasses.dataclass
class TrainerState:
    """What a step reads and writes besides the model and optimizer: saved in every checkpoint."""

    step: int = 0  # the last finished step
    data_position: int = 0  # prompts consumed (all ranks): the index into the seeded prompt stream
    nonfinite_in_a_row: int = 0  # consecutive steps whose update was skipped
    zero_signal_in_a_row: int = 0  # consecutive steps without learning signal (zero_signal_guard)
    # [sandbox failures, tool calls] of the last sandbox.window_steps steps (sandbox_guard)
    sandbox_window: list = dataclasses.field(default_factory=list)
    probe: tuple | None = None  # (token ids, prompt length) of the weight-sync check
    scaler: "modeling.LossScaler | None" = None  # float16 compute: the dynamic loss scale


def start_run(cfg, rank, world, device, lock, export_only=False):
    """Checks, the out_dir lock, data, engine, model, optimizer, gate and the state to resume from
    -> (Run, TrainerState). Raises runs.RunError when the run cannot start; config.yaml is written
    only once it has."""
    from transformers import AutoTokenizer

    check_start(cfg, rank, world, device)
    checkpoint = checkpoints.agreed_checkpoint(cfg, check_later=not export_only, rank=rank)
    if checkpoint is not None:  # another model's checkpoint, refused before the engine starts
        checkpoints.check_shapes(checkpoint, modeling.checkpoint_index(cfg.model.path),
                                 shared_only=True)
    if cfg.loss.agg_mode == "seq-mean-token-sum-norm" and cfg.loss.loss_scale_factor is None:
        # Dr.GRPO's constant: the response budget, not each micro-batch's padded width (Eq. 3)
        cfg.loss = dataclasses.replace(cfg.loss, loss_scale_factor=float(cfg.rollout.max_tokens))
    tokenizer = AutoTokenizer.from_pretrained(cfg.model.path)
    task, benchmarks, engine = ((None, {}, None) if export_only
                                else start_sampling(cfg, tokenizer, rank, lock))
    try:
        # after the engine, whose start reseeds every global RNG (rollout.py)
        torch.manual_seed(cfg.train.seed)
        random.seed(cfg.train.seed)
        say(rank, f"building the policy model from {cfg.model.path} (each rank reads its shards)")
        model = modeling.build_model(cfg, device, world)
        optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.optim.lr,
                                      betas=tuple(cfg.optim.betas),
                                      weight_decay=cfg.optim.weight_decay)
        run = Run(cfg=cfg, rank=rank, world=world, device=device,
                  out_dir=Path(cfg.train.out_dir), tokenizer=tokenizer, task=task,
                  benchmarks=benchmarks, engine=engine, model=model, optimizer=optimizer,
                  scheduler=torch.optim.lr_scheduler.LambdaLR(optimizer, learning_rate_lambda(cfg)),
                  states=baselines.method_states(cfg), checkpoint=checkpoint)
        if export_only:
            return run, None
        state = resume(run, checkpoint) if checkpoint is not None else TrainerState()
        if cfg.model.param_dtype == "float16" and state.scaler is None:
            state.scaler = modeling.LossScaler(cfg.optim.loss_scale_init,
                                               cfg.optim.loss_scale_window)
        if rank == 0:
            record_start(run, state)
        return run, state
    except BaseException:  # vLLM's clean-up at exit needs the process group main destroys
        if engine is not None:
            rollout.shutdown_engine(engine)
        raise


def check_start(cfg, rank, world, device):
    """The config against the ranks, and on a GPU the driver, the packages and the memory plan
    against this device, before anything loads (RunError on every rank when one finds a problem)."""
    try:
        config.check(cfg, world_size=world)
    except config.ConfigError as error:
        raise runs.RunError(f"config error: {error}") from None
    if device.type == "cuda":
        errors, warnings = plan.preflight(cfg, world, device)
        for line in warnings + errors if rank == 0 else []:
            print(line, file=sys.stderr)
        runs.agree(f"error: the GPU preflight found {len(errors)} problem(s), listed above"
                   if errors else None)


def start_sampling(cfg, tokenizer, rank, lock):
    """The out_dir lock (taken by the first rank; every rank learns the outcome), the sandbox's
    mode, the prompts and benchmarks, and this rank's engine -> (task, benchmarks, engine)."""
    problem = None
    if rank == 0:
        try:
            lock.acquire()
        except runs.RunError as error:
            problem = str(error)
    runs.agree(problem)
    if cfg.rollout.tools:  # the sandbox's mode, decided once for the run (docs/sandbox.md)
        try:
            sandbox.isolation(cfg.sandbox)
        except sandbox.Unavailable as error:
            problem = f"error: {error}"
        runs.agree(problem)
    task, benchmarks = load_task(cfg, tokenizer, rank)
    say(rank, "building the vLLM engine (on GPU, a first start compiles and captures CUDA graphs)")
    # one seed per engine, or every engine samples alike (vLLM #15980; rollout.build_engine)
    engine = rollout.build_engine(
        cfg.rollout, cfg.model.path, max_model_len=plan.max_model_len(cfg),
        seed=cfg.train.seed + rank // cfg.rollout.tensor_parallel_size)
    runs.align_timeouts()  # the engine's own groups: the run's timeout too
    runner = rollout.engine_runner(engine)
    task.metrics["rollout/model_runner_v2"] = float(runner == "v2")  # recorded with every step
    if runner != cfg.rollout.model_runner and rank == 0:
        print(f"warning: vLLM runs model runner {runner}, not "
              f"rollout.model_runner={cfg.rollout.model_runner}", file=sys.stderr)
    return task, benchmarks, engine


def record_start(run, state):
    """Rank 0, once the run has started: config.yaml (what it runs with), the console's copy, and
    an earlier run's metrics kept aside when there is no checkpoint to resume them from."""
    resumed = run.checkpoint is not None
    try:
        (run.out_dir / "config.yaml").write_text(config.to_yaml(run.cfg))
        kept = runs.keep_metrics(run.out_dir / "metrics.jsonl", state.step if resumed else None)
    except OSError as error:
        raise runs.RunError(f"error: cannot write to train.out_dir {run.out_dir} "
                            f"({error.strerror}: {error.filename})") from None
    print(config.to_yaml(run.cfg))
    if kept is not None:
        print(f"warning: {run.out_dir} held metrics of an earlier run but no checkpoint to resume "
              f"from; they are kept as {kept}", file=sys.stderr)


def say(rank, message):
    """A start-up line on rank 0 (the stages before the first step can take minutes)."""
    if rank == 0:
        print(f"start: {message}", file=sys.stderr, flush=True)


def load_task(cfg, tokenizer, rank):
    """The training prompts, tokenised (tool-use runs list the code interpreter in the system
    block), and the evaluation benchmarks; truncated and skipped prompts reported. A data problem is
    a RunError naming the file."""
    listed = collections.Counter(Path(path).resolve() for path in cfg.data.train_files)
    for path, times in listed.items():
        if times > 1 and rank == 0:  # oversampling is rarely meant: said, then done
            print(f"warning: data.train_files lists {path} {times} times: its prompts are "
                  f"sampled {times} times as often", file=sys.stderr)
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
    total, truncated, skipped = stats["num_prompts"], stats["num_truncated"], stats["num_skipped"]
    report = (
        f"{total} training prompts; {truncated} ({truncated / total:.1%}) cut to "
        f"data.max_prompt_tokens={cfg.data.max_prompt_tokens} from the left, {skipped} "
        f"({skipped / total:.1%}) skipped (data.overflow={cfg.data.overflow})")
    if not prompt_ids:
        raise runs.RunError(f"data error: no training prompt is left: {report}")
    if rank == 0:
        print(f"data: {report}", file=sys.stderr)
    metrics = {"data/prompts": total, "data/truncated_frac": truncated / total,
               "data/skipped_frac": skipped / total}
    return data.Task(prompt_ids, examples, cfg.train.seed, cfg.data.shuffle, metrics), benchmarks


def resume(run, checkpoint):
    """Model, optimizer, scheduler, the method's states and trainer state from a checkpoint, then
    the weights into the engine (which started from model.path) by a sync with the saved probe. With
    sleep mode the engine sleeps while the checkpoint loads: DCP initialises AdamW's state on zero
    gradients first (plan.py, "resume")."""
    cfg = run.cfg
    if cfg.rollout.enable_sleep_mode:
        rollout.release_memory(run.engine, cfg.rollout.sleep_level)
    saved = checkpoints.load_checkpoint(checkpoint, run.model, run.optimizer, run.rank)
    run.scheduler.load_state_dict(saved.pop("scheduler"))
    # the optimizer's saved settings give way to this run's config (a changed optim.lr takes effect,
    # as recorded)
    run.scheduler.base_lrs = [cfg.optim.lr] * len(run.optimizer.param_groups)
    factor = learning_rate_lambda(cfg)(run.scheduler.last_epoch)
    for group in run.optimizer.param_groups:
        group.update(initial_lr=cfg.optim.lr, lr=cfg.optim.lr * factor,
                     betas=tuple(cfg.optim.betas), weight_decay=cfg.optim.weight_decay)
    # each method state takes what it carries from the checkpoint, the rest from this run's config;
    # one the checkpoint's run did not have starts afresh
    for name, method_state in run.states.items():
        if saved.get(name) is not None:
            method_state.resume(saved[name])
    state = TrainerState(
        **{f.name: saved[f.name] for f in dataclasses.fields(TrainerState) if f.name in saved})
    if isinstance(state.scaler, dict):
        state.scaler = modeling.LossScaler(**state.scaler)
    state.probe, checks = rollout.sync_engine(run.engine, run.model, cfg.rollout, [], state.step,
                                              state.probe, first=True)
    error = checks.get("rollout/sync_probe_error")
    if error is not None and not error <= cfg.rollout.max_sync_probe_error:
        raise runs.RunError(
            f"error: resuming from {checkpoint}: rollout/sync_probe_error = {error:.3g} exceeds "
            f"rollout.max_sync_probe_error = {cfg.rollout.max_sync_probe_error:g}: the engine "
            f"did not take the checkpoint's weights (a failed weight sync). Try "
            f"rollout.sleep_level=1 on GPU")
    changed = runs.config_differences((checkpoint / "config.yaml").read_text(), run.cfg)
    if run.rank == 0:
        print(f"resumed from {checkpoint} at step {saved['step']}" + (
            f" (weight sync probed: {error:.3g})" if error is not None else "") + (
            f"; config keys changed since, this run's values apply: {', '.join(changed)}"
            if changed else ""), file=sys.stderr)
    return state


def trainer_state(run, state):
    return {**dataclasses.asdict(state), "scheduler": run.scheduler.state_dict(),
            **{name: method_state.state_dict() for name, method_state in run.states.items()}}


def evaluation(run):
    """evaluate.py's sampler and verifier on the engine's current weights -> eval/... metrics."""
    cfg, start = run.cfg, time.time()
    result = evaluate.evaluate(run.engine, run.tokenizer, run.benchmarks, cfg)
    return {**evaluate.flatten_metrics(result), "time/eval": time.time() - start}


def export_checkpoint(run):
    """`--export`: the checkpoint train.resume names as an HF model in out_dir/hf_step_N."""
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


def learning_rate_lambda(cfg):
    """A step's learning-rate factor: linear warm-up, then constant or cosine to min_lr_ratio."""

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


if __name__ == "__main__":
    runs.exit_process(main(sys.argv[1:]))
