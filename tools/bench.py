"""tools/bench.py: benchmarks of the training code (the update path, log-probs, the STARE loss,
rewards, the whole step), and the command line of every benchmark.

    python -m tools.bench logprob-memory    [--tokens 4096] [--vocab 151936] [--device cpu|cuda]
    python -m tools.bench logprob-time      [--tokens 16384] [--vocab 151936] [--dtype bfloat16]
                                            [--sweep]                                       (CUDA)
    python -m tools.bench stare-overhead    [--tokens 1048576] [--repeats 15] [--device cpu|cuda]
    python -m tools.bench update            [--size tiny|0.5b|1.5b|7b] [--method stare] [--rows 32]
                                            [--budget 16384] [--gc]
    python -m tools.bench reward-throughput [--responses 2000]
    python -m tools.bench train-step        [--tiny runs/tiny] [--steps 6] [--method stare]
    python -m tools.bench trl-compare       [--tiny runs/tiny] [--steps 6] [--prompts 16]
                                            [--threads N]                 (tools/trl_compare.py)
    python -m tools.bench startup-memory    [--ranks 2] [--tied]  (a random ~0.25B Qwen2, CPU ranks)
    python -m tools.bench resume-memory     [--size 1.5b|small]   (a resume's load, one rank)
    python -m tools.bench gpu-smoke         [--out runs/gpu_smoke.json] [--runner v1]
                                            [--sleep-level 2]         (CUDA; tools/gpu_smoke.py)

What each subcommand counts and the measured numbers: docs/benchmarks.md.
"""

import argparse
import gc
import json
import math
import os
import random
import statistics
import time
from pathlib import Path

import torch

import baselines
import stare

REPO = Path(__file__).resolve().parents[1]  # the repository root: configs/, tests/, train.py


# --------------------------------------------------------------------------------------------------
# logprob-memory
# --------------------------------------------------------------------------------------------------


def naive_logprobs_and_entropy(logits, tokens, temperature=1.0):
    """What one writes first: a float32 log_softmax over the whole [N, V], then gather and -sum p log p."""
    log_pi = torch.log_softmax(logits.float() / temperature, dim=-1)  # [N, V] float32
    logprobs = log_pi.gather(-1, tokens[:, None]).squeeze(-1)
    entropy = -(log_pi.exp() * log_pi).sum(-1)
    return logprobs, entropy


def _rss_bytes(field):
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not found in /proc/self/status")


def peak_extra_bytes(fn, device):
    """Peak memory that fn() allocates on top of what is live before the call."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        baseline = torch.cuda.memory_allocated()
        fn()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - baseline
    with open("/proc/self/clear_refs", "w") as clear_refs:
        clear_refs.write("5")  # reset the peak-RSS high-water mark (Linux >= 4.0)
    baseline = _rss_bytes("VmRSS")
    fn()
    return _rss_bytes("VmHWM") - baseline


def bench_logprob_memory(args):
    device = torch.device(args.device)
    generator = torch.Generator(device=device).manual_seed(0)
    results = {"tokens": args.tokens, "vocab": args.vocab, "device": str(device),
               "chunk_rows": stare.rows_per_chunk(args.tokens, args.vocab, None)}
    for dtype in (torch.float32, torch.bfloat16):
        logits = (
            torch.randn(args.tokens, args.vocab, generator=generator, device=device, dtype=dtype)
            * 4)
        tokens = torch.randint(0, args.vocab, (args.tokens,), generator=generator, device=device)
        # warm-up (allocator, kernels), then check the two agree before measuring them
        chunked_out = stare.token_logprobs_and_entropy(logits, tokens)
        naive_out = naive_logprobs_and_entropy(logits, tokens)
        max_diff = max((a - b).abs().max().item() for a, b in zip(chunked_out, naive_out))
        del chunked_out, naive_out
        with torch.no_grad():
            naive = peak_extra_bytes(lambda: naive_logprobs_and_entropy(logits, tokens), device)
            chunked = peak_extra_bytes(
                lambda: stare.token_logprobs_and_entropy(logits, tokens), device)
        name = "float32" if dtype == torch.float32 else "bfloat16"
        results[name] = {
            "naive_peak_mib": round(naive / 2**20, 1),
            "chunked_peak_mib": round(chunked / 2**20, 1),
            "ratio": round(chunked / naive, 4),
            "max_abs_diff": max_diff,
        }
        del logits, tokens
    # the headline keys: the worse of the two dtypes
    worst = max(("float32", "bfloat16"), key=lambda name: results[name]["ratio"])
    results.update(
        {key: results[worst][key] for key in ("naive_peak_mib", "chunked_peak_mib", "ratio")})
    return results


# --------------------------------------------------------------------------------------------------
# logprob-time
# --------------------------------------------------------------------------------------------------


def cuda_ms(fn, repeats=10):
    """Median time of fn() in ms over `repeats` runs after one warm-up, with CUDA events."""
    fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def bench_logprob_time(args):
    """token_logprobs_and_entropy forward + backward (and the no-grad pass's functions) on CUDA: the
    Triton path, stare.py's chunked path, and the naive formula; time, peak extra memory, and the
    bandwidth floor."""
    from unittest import mock

    import kernels

    device = torch.device("cuda")
    dtype = getattr(torch, args.dtype)
    generator = torch.Generator(device=device).manual_seed(0)
    logits = (
        torch.randn(args.tokens, args.vocab, generator=generator, device=device, dtype=dtype) * 4)
    tokens = torch.randint(0, args.vocab, (args.tokens,), generator=generator, device=device)
    weights = torch.randn(2, args.tokens, generator=generator, device=device)

    def forward_backward(fn):
        def run():
            x = logits.detach().requires_grad_()
            logprobs, entropy = fn(x)
            (weights[0] * logprobs + weights[1] * entropy).sum().backward()
        return run

    def chunked(fn):  # stare.py's PyTorch path on the same device
        def run(*a):
            with mock.patch.object(kernels, "supported", lambda logits_2d: False):
                return fn(*a)
        return run

    variants = {"triton": lambda x: stare.token_logprobs_and_entropy(x, tokens),
                "chunked": chunked(lambda x: stare.token_logprobs_and_entropy(x, tokens)),
                "naive": lambda x: naive_logprobs_and_entropy(x, tokens)}
    logits_bytes = logits.numel() * logits.element_size()
    # read in forward, read + write the gradient in backward
    floor_ms = 3 * logits_bytes / args.bandwidth * 1e3
    result = {
        "tokens": args.tokens,
        "vocab": args.vocab,
        "dtype": args.dtype,
        "device": torch.cuda.get_device_name(),
        "bandwidth_floor_ms": round(floor_ms, 2),
        "bandwidth_assumed_gb_s": args.bandwidth / 1e9,
    }
    for name, fn in variants.items():
        run = forward_backward(fn)
        result[name] = {"fwd_bwd_ms": round(cuda_ms(run, args.repeats), 2),
                        "peak_extra_mib": round(peak_extra_bytes(run, device) / 2**20, 1)}
    result["ratio_to_floor"] = round(result["triton"]["fwd_bwd_ms"] / floor_ms, 2)
    result["memory_ratio_to_naive"] = round(
        result["triton"]["peak_extra_mib"] / result["naive"]["peak_extra_mib"], 4)
    with torch.no_grad():
        for name, fn in {
            "sensitivity": lambda: stare.entropy_sensitivity(logits, tokens),
            "minp_proxy": lambda: baselines.minp_proxy_logprobs(logits, tokens),
        }.items():
            result[name + "_ms"] = {"triton": round(cuda_ms(fn, args.repeats), 2),
                                    "chunked": round(cuda_ms(chunked(fn), 3), 2)}
    if args.sweep:  # block size and warps of the kernels
        sweep = {}
        for block, warps in (
            (1024, 4), (2048, 4), (2048, 8), (4096, 8), (4096, 16), (8192, 8), (8192, 16)):
            with (
                mock.patch.object(kernels, "BLOCK", block),
                mock.patch.object(kernels, "NUM_WARPS", warps)):
                sweep[f"{block}x{warps}"] = round(
                    cuda_ms(forward_backward(variants["triton"]), args.repeats), 2)
        result["sweep_fwd_bwd_ms"] = sweep
    return result


# --------------------------------------------------------------------------------------------------
# update
# --------------------------------------------------------------------------------------------------

# Qwen2.5 shapes (the Math models share them); "tiny" is a CPU-sized model of the same architecture.
QWEN25 = {
    "tiny": dict(
        hidden_size=128, intermediate_size=384, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=4096, tie_word_embeddings=False),
    "small": dict(  # ~33M parameters: resume-memory's CPU measurement (its test)
        hidden_size=512, intermediate_size=1536, num_hidden_layers=8, num_attention_heads=8,
        num_key_value_heads=2, vocab_size=8192, tie_word_embeddings=False),
    "0.5b": dict(
        hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
        num_key_value_heads=2, vocab_size=151_936, tie_word_embeddings=True),
    "1.5b": dict(
        hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
        num_key_value_heads=2, vocab_size=151_936, tie_word_embeddings=True),
    "7b": dict(
        hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
        num_key_value_heads=4, vocab_size=152_064, tie_word_embeddings=False),
}
PEAK_BF16_FLOPS = {"H100": 989e12, "H200": 989e12}  # dense bf16 tensor-core peak (SXM datasheet)


def random_qwen(size, device, attn_implementation="varlen"):
    """A randomly initialised Qwen2.5-shaped causal LM in float32, built directly on `device` (no download)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    import modeling  # noqa: F401  (registers the "varlen" attention)

    config = Qwen2Config(
        max_position_embeddings=32_768, rope_theta=10_000.0,
        attn_implementation=attn_implementation, **QWEN25[size])
    with torch.device(device):
        return Qwen2ForCausalLM(config).to(torch.float32)


def model_flops(config, rows, backward):
    """Model FLOPs of one pass over packed rows [(prompt_len, response_len)]: 2 per weight per token
    in the body (embedding lookup excluded), the head on response tokens only, causal attention
    (QK^T and PV over the lower triangle); x3 with backward. Gradient-checkpointing recomputation is
    not counted (model FLOPs, not hardware)."""
    hidden, layers = config.hidden_size, config.num_hidden_layers
    head_dim = getattr(config, "head_dim", None) or hidden // config.num_attention_heads
    q_dim, kv_dim = config.num_attention_heads * head_dim, config.num_key_value_heads * head_dim
    body = layers * (
        hidden * (q_dim + 2 * kv_dim) + q_dim * hidden + 3 * hidden * config.intermediate_size)
    tokens = sum(p + r for p, r in rows)
    responses = sum(r for _, r in rows)
    # 4 * q_dim * L^2 / 2 per layer
    attention = layers * sum(2 * q_dim * (p + r) ** 2 for p, r in rows)
    forward = 2 * body * tokens + 2 * hidden * config.vocab_size * responses + attention
    return forward * (3 if backward else 1)


def realistic_lengths(num_rows, seed, max_response=3000):
    """(prompt, response) token counts like a math RL batch at max_response = 3000: prompts 100-400,
    responses log-normal around 900 tokens, some cut at max_response (all scaled with
    max_response)."""
    rng, scale = random.Random(seed), max_response / 3000
    return [
        (
            max(1, int(rng.randint(100, 400) * scale)),
            max(1, min(max_response, int(rng.lognormvariate(6.8, 0.7) * scale))))
        for _ in range(num_rows)]


def synthetic_responses(lengths, vocab_size, seed, group_size=8):
    """grpo.Response rows with random tokens and binary rewards, advantages normalised per group."""
    import grpo

    generator = torch.Generator().manual_seed(seed)
    rewards = torch.randint(0, 2, (len(lengths),), generator=generator).float()
    advantages = torch.cat(
        [
            stare.group_advantages(rewards[i : i + group_size], len(rewards[i : i + group_size]))
            for i in range(0, len(lengths), group_size)])
    return [
        grpo.Response(
            prompt=torch.randint(0, vocab_size, (p,), generator=generator).tolist(),
            tokens=torch.randint(0, vocab_size, (r,), generator=generator).tolist(),
            rollout_logprobs=[-1.0] * r, reward=float(rewards[i]), accuracy=float(rewards[i]),
            truncated=False, reflection=(0, r), policy_mask=torch.ones(r, dtype=torch.bool),
            advantage=float(advantages[i]))
        for i, (p, r) in enumerate(lengths)]


def bench_update(args):
    """The no-grad pass and the update through train.py's own stages (old_policy_pass, update_states,
    select_tokens, policy_update) on a random-init Qwen2.5 shape, FSDP2 with world size 1; methods
    interleaved, median times."""
    import config
    import grpo
    import modeling
    import runs

    rank, world, device = runs.setup_distributed()
    on_cuda = device.type == "cuda"
    methods = list(dict.fromkeys([args.method, "grpo"]))

    def cfg_for(method):
        return config.load(
            overrides=[
                "data.train_files=[unused.jsonl]",
                f"algorithm.method={method}",
                "gate.target_entropy=1e9",  # gate on
                f"train.micro_token_budget={args.budget}",
                f"model.gradient_checkpointing={str(args.gc).lower()}",
                f"model.attn_implementation={args.attention}"])

    torch.manual_seed(0)
    model = modeling.shard_model(
        random_qwen(args.size, device, args.attention), cfg_for(methods[0]), device, world)
    cfg = cfg_for(methods[0])
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.optim.lr, betas=tuple(cfg.optim.betas),
                                  weight_decay=cfg.optim.weight_decay)
    lengths = realistic_lengths(args.rows, args.seed, args.max_response)
    responses = synthetic_responses(lengths, model.config.vocab_size, args.seed)

    def synchronize():
        if on_cuda:
            torch.cuda.synchronize()

    def timed(fn):
        synchronize()
        if on_cuda:
            torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        out = fn()
        synchronize()
        peak = torch.cuda.max_memory_allocated() / 2**30 if on_cuda else None
        return time.perf_counter() - start, peak, out

    def one_step(method, step):
        cfg = cfg_for(method)
        states = baselines.method_states(cfg)
        no_grad = timed(lambda: grpo.old_policy_pass(model, responses, cfg, device))
        grpo.update_states(states, responses, device)
        select = timed(lambda: grpo.select_tokens(responses, cfg, states, step, device))
        update = timed(
            lambda: grpo.policy_update(model, optimizer, responses, cfg, states, step, device))
        return {"no_grad": no_grad, "select": select, "update": update}

    for method in methods:  # warm-up: kernel compilation, the allocator, cuDNN/cuBLAS heuristics
        one_step(method, 0)
    runs = {method: [] for method in methods}
    for repeat in range(args.repeats):  # interleaved, so that drift hits every method alike
        for method in methods:
            runs[method].append(one_step(method, repeat + 1))

    device_name = torch.cuda.get_device_name() if on_cuda else "cpu"
    peak = next((flops for name, flops in PEAK_BF16_FLOPS.items() if name in device_name), None)
    no_grad_flops, update_flops = (
        model_flops(model.config, lengths, False), model_flops(model.config, lengths, True))
    batches = modeling.micro_batches([p + r for p, r in lengths], args.budget)
    real_tokens = sum(p + r for p, r in lengths)
    padded_tokens = sum(
        len(b) * (max(lengths[i][0] for i in b) + max(lengths[i][1] for i in b)) for b in batches)
    result = {
        "size": args.size,
        "device": device_name,
        "rows": args.rows,
        "budget": args.budget,
        "gradient_checkpointing": args.gc,
        "attention": args.attention,
        "repeats": args.repeats,
        "tokens": real_tokens,
        "response_tokens": sum(r for _, r in lengths),
        "micro_batches": len(batches),
        "padding_share": 0.0,  # packed rows: the model runs on real tokens only
        "padding_share_if_padded": round(1 - real_tokens / padded_tokens, 3),
        "peak_flops": peak,
        "peak_note": "H100/H200 SXM dense bf16 tensor-core peak" if peak else None,
        "model_tflop": {
            "no_grad": round(no_grad_flops / 1e12, 1),
            "update": round(update_flops / 1e12, 1),
        },
    }
    for method, method_runs in runs.items():
        summary = {}
        for stage, flops in (
            ("no_grad", no_grad_flops), ("select", None), ("update", update_flops)):
            seconds = statistics.median(run[stage][0] for run in method_runs)
            summary[stage] = {"s": round(seconds, 4)}
            if flops and peak:
                summary[stage]["mfu"] = round(flops / seconds / peak, 3)
            if on_cuda:
                summary[stage]["peak_gib"] = round(max(run[stage][1] for run in method_runs), 1)
        metrics = [run["update"][2] for run in method_runs]
        summary["finite_gradients"] = all(
            math.isfinite(m["train/grad_norm"]) and m["train/skipped_updates"] == 0 for m in metrics
        )
        summary["grad_norm"] = metrics[-1]["train/grad_norm"]
        result[method] = summary
    if args.method != "grpo":
        update = {m: statistics.median(run["update"][0] for run in runs[m]) for m in methods}
        result[f"{args.method}_over_grpo_update"] = round(
            update[args.method] / update["grpo"] - 1, 4)
    torch.distributed.destroy_process_group()
    return result


# --------------------------------------------------------------------------------------------------
# stare-overhead
# --------------------------------------------------------------------------------------------------


def make_step_batch(num_tokens, device, seed=0):
    """A synthetic optimizer-step batch with a realistic shape: groups of 8 responses, ragged
    lengths, binary rewards, most tokens confident (surprisal ~ exponential with mean 0.3 nats)."""
    generator = torch.Generator(device="cpu").manual_seed(seed)
    width = 1024
    num_seqs = num_tokens // width
    lengths = torch.randint(width // 8, width + 1, (num_seqs,), generator=generator)
    mask = torch.arange(width)[None, :] < lengths[:, None]  # [B, T]
    old_logprobs = -torch.empty(num_seqs, width).exponential_(1 / 0.3, generator=generator)
    logprobs = old_logprobs + 0.01 * torch.randn(num_seqs, width, generator=generator)
    rewards = (torch.rand(num_seqs, generator=generator) < 0.4).float()
    advantages = stare.group_advantages(rewards, group_size=8)
    return [t.to(device) for t in (logprobs, old_logprobs, advantages, mask)]


def grpo_loss(logprobs, old_logprobs, advantages, mask):
    token_loss, _ = stare.clipped_surrogate(
        logprobs, old_logprobs, advantages, dual_clip=10.0, mask=mask)
    return stare.aggregate_loss(token_loss, mask)


def stare_loss(logprobs, old_logprobs, advantages, mask):
    weights, _ = stare.stare_weights(
        old_logprobs, advantages, mask, variant="O1", top_ratio=0.1, gate_on=True)
    token_loss, _ = stare.clipped_surrogate(
        logprobs, old_logprobs, advantages, dual_clip=10.0, mask=mask)
    return stare.aggregate_loss(token_loss * weights, mask)


def time_ms(fn, device):
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - start) * 1000


def bench_stare_overhead(args):
    device = torch.device(args.device)
    logprobs, old_logprobs, advantages, mask = make_step_batch(args.tokens, device)
    leaf = logprobs.clone().requires_grad_(True)

    def forward(loss_fn):
        with torch.no_grad():
            loss_fn(logprobs, old_logprobs, advantages, mask)

    def forward_backward(loss_fn):
        leaf.grad = None
        loss_fn(leaf, old_logprobs, advantages, mask).backward()

    cases = {
        "grpo": lambda: forward(grpo_loss),
        "stare": lambda: forward(stare_loss),
        "grpo_fwd_bwd": lambda: forward_backward(grpo_loss),
        "stare_fwd_bwd": lambda: forward_backward(stare_loss),
    }
    for fn in cases.values():  # warm-up
        fn()
    samples = {name: [] for name in cases}
    for _ in range(args.repeats):  # interleaved, so drift in machine load hits both sides alike
        for name, fn in cases.items():
            samples[name].append(time_ms(fn, device))
    median = {name: statistics.median(values) for name, values in samples.items()}
    return {
        "tokens": int(mask.numel()),
        "valid_tokens": int(mask.sum()),
        "device": str(device),
        "threads": torch.get_num_threads(),
        "repeats": args.repeats,
        "grpo_ms": round(median["grpo"], 2),
        "stare_ms": round(median["stare"], 2),
        "overhead_ratio": round(median["stare"] / median["grpo"] - 1, 3),
        "grpo_fwd_bwd_ms": round(median["grpo_fwd_bwd"], 2),
        "stare_fwd_bwd_ms": round(median["stare_fwd_bwd"], 2),
        "overhead_ratio_fwd_bwd": round(median["stare_fwd_bwd"] / median["grpo_fwd_bwd"] - 1, 3),
        "goal_overhead_ratio": 0.25,
    }


# --------------------------------------------------------------------------------------------------
# reward-throughput
# --------------------------------------------------------------------------------------------------


def random_math_problem(rng):
    """(ground truth, a correct answer written differently, a wrong answer maker) for one of six answer kinds."""
    a, b = rng.randint(2, 99), rng.randint(2, 99)
    # roughly the mix of MATH-style answers: mostly integers, then fractions, then LaTeX expressions
    kind = rng.choices(["integer", "decimal", "fraction", "radical", "polynomial", "interval"],
                       weights=[50, 10, 15, 10, 10, 5])[0]
    if kind == "integer":
        return str(a * b), f"{a * b}.0", lambda: str(a * b + rng.randint(1, 50))
    if kind == "decimal":  # gold 0.75-style, answered as a fraction
        q = rng.choice([2, 4, 5, 8, 20, 25])
        return (
            str(a / q),
            f"\\frac{{{a}}}{{{q}}}",
            lambda: f"\\frac{{{a + rng.randint(1, 9)}}}{{{q}}}")
    if kind == "fraction":
        return (
            f"\\frac{{{a}}}{{{b + a}}}", f"{a}/{b + a}",
            lambda: f"\\dfrac{{{b + a}}}{{{a + rng.randint(0, 5)}}}")
    if kind == "radical":
        return (
            f"{a}\\sqrt{{2}}", f"\\sqrt{{{2 * a * a}}}",
            lambda: f"{a}\\sqrt{{{rng.choice([3, 5, 6])}}}")
    if kind == "polynomial":
        return f"x^2+{a}x+{b}", f"{b}+{a}x+x^2", lambda: f"x^2+{b}x+{a + rng.randint(1, 9)}"
    return f"[{a}, {a + b})", f"[{a},{a + b})", lambda: f"({a}, {a + b + rng.randint(0, 3)}]"


def reward_batch(num_responses, seed, group_size=16):
    """Rollout-like responses, ground truths and data sources: group_size samples per prompt."""
    rng = random.Random(seed)
    responses, ground_truths = [], []
    while len(responses) < num_responses:
        gold, other_form, wrong_answer = random_math_problem(rng)
        for _ in range(min(group_size, num_responses - len(responses))):
            draw = rng.random()
            answer = (
                gold
                if draw < 0.2
                else other_form
                if draw < 0.4
                else wrong_answer()
                if draw < 0.9
                else None)
            reasoning = "Let me work through this step by step. " * rng.randint(2, 12)
            ending = (
                f"So the final answer is \\boxed{{{answer}}}."
                if answer
                else "So the final answer is unclear.")
            responses.append(reasoning + ending)
            ground_truths.append(gold)
    return responses, ground_truths, ["Short_CoT"] * num_responses


def bench_reward_throughput(args):
    import config
    import rewards  # lazily: the other subcommands do not need math-verify

    cfg = config.RewardConfig()
    # first-call costs (sympy and antlr set-up), on prompts the timed batch lacks
    warmup = reward_batch(64, seed=1)
    rewards.compute_rewards(*warmup, [0] * 64, cfg)
    responses, ground_truths, data_sources = reward_batch(args.responses, seed=0)
    start = time.perf_counter()
    _, accuracies, _ = rewards.compute_rewards(
        responses, ground_truths, data_sources, [0] * len(responses), cfg)
    seconds = time.perf_counter() - start
    return {
        "responses": len(responses),
        "seconds": round(seconds, 3),
        "responses_per_s": round(len(responses) / seconds, 1),
        "acc": round(sum(accuracies) / len(accuracies), 4),
    }


# --------------------------------------------------------------------------------------------------
# train-step
# --------------------------------------------------------------------------------------------------


STAGE_KEYS = [
    "time/rollout", "time/reward", "time/old_logprobs", "time/update", "time/sync", "time/step",
    "time/tokens_per_s"]


def tiny_overrides(tiny_dir):
    """configs/tiny.yaml pointed at the tiny default in tiny_dir, without evaluation (the benchmarks time steps)."""

    tiny_dir = Path(tiny_dir).resolve()  # train.py runs in this file's directory
    return [
        f"model.path={tiny_dir / 'model'}",
        f"data.train_files=[{tiny_dir / 'data' / 'sum_train.jsonl'}]", "eval.files=[]"]


def run_train_py(tiny_dir, steps, overrides=()):
    """train.py on the tiny default (tiny_overrides) for `steps` steps, in a fresh process. -> (one
    metrics.jsonl record per step, wall seconds of the whole process: start-up, steps, final
    save)."""
    import subprocess
    import sys
    import tempfile

    with tempfile.TemporaryDirectory() as out_dir:
        command = [
            sys.executable, "train.py", "--config", "configs/tiny.yaml", *tiny_overrides(tiny_dir),
            f"train.out_dir={out_dir}", f"train.total_steps={steps}", *overrides]
        start = time.perf_counter()
        completed = subprocess.run(command, cwd=REPO, capture_output=True, text=True)
        wall = time.perf_counter() - start
        if completed.returncode != 0:
            raise RuntimeError(completed.stderr[-3000:])
        records = [
            json.loads(line) for line in (Path(out_dir) / "metrics.jsonl").read_text().splitlines()]
    return records, wall


def stage_times(steps):
    """train.py's per-stage times (STAGE_KEYS), averaged over the given metrics records: rollout_s,
    ..., step_s, tokens_per_s."""
    return {key.replace("time/", "") + ("" if key.endswith("_per_s") else "_s"):
            round(statistics.mean(s[key] for s in steps), 3) for key in STAGE_KEYS}


def bench_train_step(args):
    from tools import tiny

    tiny.build_tiny(args.tiny)  # reused when complete
    records, _ = run_train_py(args.tiny, args.steps, [f"algorithm.method={args.method}"])
    steps = records[1:]  # the first step pays for start-up (allocations, first-call set-ups)
    result = {
        "method": args.method,
        "steps_averaged": len(steps),
        "threads": torch.get_num_threads(),
        "response_tokens_per_step": statistics.mean(s["train/tokens"] for s in steps),
    }
    result.update(stage_times(steps))
    return result


# --------------------------------------------------------------------------------------------------
# sync-probe
# --------------------------------------------------------------------------------------------------


def bench_sync_probe(args):
    """The weight-sync probe of rollout.sync_engine on a model directory: a float32 trainer (a
    transformers model, as FSDP2 computes it on CPU) against an engine of --engine-dtype holding
    the same weights, then against a trainer moved away from them (every weight plus --stale times
    its tensor's standard deviation of noise, a stand-in for a missed sync). Reports the probe's
    log-prob error and its top-k divergences (rollout.topk_divergence), and the probe's cost with
    and without the top-k (engine and trainer side, the best of --repeats)."""
    import time

    from transformers import AutoModelForCausalLM, AutoTokenizer

    import config
    import rollout

    engine = rollout.build_engine(
        config.RolloutConfig(dtype=args.engine_dtype, kv_cache_gib=0.5, enforce_eager=True),
        args.model, seed=0, max_model_len=args.tokens + 128)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    prompt = tokenizer(args.prompt).input_ids
    response = rollout.generate(engine, [prompt], n=1, max_tokens=args.tokens, seeds=[0],
                                temperature=1.0).token_ids[0]
    probe, prompt_len = prompt + response, len(prompt)

    def best_time(call):
        times = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            value = call()
            times.append(time.perf_counter() - start)
        return value, min(times)

    def checks():
        (engine_side, top_ids, engine_top), engine_s = best_time(
            lambda: rollout.engine_logprobs(engine, probe, prompt_len, args.topk))
        (trainer_side, logits, logsumexp), trainer_s = best_time(
            lambda: rollout.trainer_logprobs(model, probe, prompt_len, with_logits=True))
        total_variation, kl, mass_out = rollout.topk_divergence(
            engine_top, logits.gather(-1, top_ids).float() - logsumexp[:, None])
        return {"sync_probe_error": (engine_side - trainer_side).abs().max().item(),
                "tv_max": total_variation.max().item(), "tv_mean": total_variation.mean().item(),
                "kl_max": kl.max().item(), "mass_out_mean": mass_out.mean().item()}, {
                    f"engine_top{args.topk}_s": engine_s, "trainer_with_logits_s": trainer_s}

    synced, seconds = checks()
    _, seconds["engine_s"] = best_time(lambda: rollout.engine_logprobs(engine, probe, prompt_len))
    _, seconds["trainer_s"] = best_time(lambda: rollout.trainer_logprobs(model, probe, prompt_len))
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(args.stale * parameter.std() * torch.randn(
                parameter.shape, generator=generator))
    stale, _ = checks()
    rollout.shutdown_engine(engine)
    return {"model": str(args.model), "engine_dtype": args.engine_dtype, "topk": args.topk,
            "probe_tokens": len(response), "vocab": model.config.vocab_size,
            "threads": torch.get_num_threads(), "synced": synced, "stale": stale,
            "stale_noise": args.stale, "seconds": {k: round(v, 4) for k, v in seconds.items()}}


# --------------------------------------------------------------------------------------------------
# startup-memory
# --------------------------------------------------------------------------------------------------

STARTUP_SHAPE = dict(
    hidden_size=1024,
    intermediate_size=2816,
    num_hidden_layers=16,
    num_attention_heads=16,
    # ~0.25B
    num_key_value_heads=4,
    vocab_size=32_000,
    max_position_embeddings=2048)


def bench_startup_memory(args):
    """modeling.build_model on --ranks gloo ranks from a random ~0.25B Qwen2 written to a temporary
    directory: each rank's peak resident-memory growth during the build over the fp32 model's size
    (tests/startup_two_ranks.py measures and checks every shard against the checkpoint)."""
    import subprocess
    import sys
    import tempfile

    from transformers import Qwen2Config, Qwen2ForCausalLM

    with tempfile.TemporaryDirectory() as tmp:
        torch.manual_seed(0)
        Qwen2ForCausalLM(
            Qwen2Config(tie_word_embeddings=args.tied, **STARTUP_SHAPE)
        ).save_pretrained(tmp + "/model")
        gc.collect()
        repo = REPO
        command = [
            sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
            str(args.ranks), str(repo / "tests" / "startup_two_ranks.py"), tmp + "/model", tmp]
        subprocess.run(
            command, check=True, capture_output=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
        ranks = [json.loads((Path(tmp) / f"rank{r}.json").read_text()) for r in range(args.ranks)]
    return {
        "ranks": args.ranks,
        "tied": args.tied,
        "fp32_model_gib": round(ranks[0]["fp32_bytes"] / 2**30, 3),
        "growth_over_fp32": [round(r["growth_over_fp32"], 3) for r in ranks],
        "shards_equal_checkpoint": all(not r["mismatched"] for r in ranks),
        "logits_max_abs_diff": max(r["logits_max_abs_diff"] for r in ranks),
    }


# --------------------------------------------------------------------------------------------------
# resume-memory
# --------------------------------------------------------------------------------------------------


def bench_resume_memory(args):
    """train.py's resume on one rank (FSDP2; NCCL on GPU, gloo on CPU): a random-init Qwen2.5 shape
    (config.json written here) saves a checkpoint with checkpoints.py after one AdamW step, then
    checkpoints.load_checkpoint loads it into a fresh model and optimizer. Measured: what the load
    allocates at its peak and keeps, over the float32 shards, in bytes per parameter (CUDA: the
    allocator's peak; CPU: the peak resident set), against plan.py's resume terms."""
    import tempfile

    from transformers import Qwen2Config

    import checkpoints
    import config
    import modeling
    import plan
    import runs

    rank, world, device = runs.setup_distributed()
    with tempfile.TemporaryDirectory() as tmp:
        Qwen2Config(max_position_embeddings=32_768, **QWEN25[args.size]).save_pretrained(tmp)
        arch = plan.Architecture.from_config_json(tmp)
        cfg = config.load(overrides=["data.train_files=[unused.jsonl]", f"model.path={tmp}"])

        def fresh():
            torch.manual_seed(0)
            model = modeling.shard_model(random_qwen(args.size, device), cfg, device, world)
            # foreach: torch's choice for CUDA tensors (train.py's AdamW), asked for on CPU too
            return model, torch.optim.AdamW(model.parameters(), lr=cfg.optim.lr, foreach=True)

        model, optimizer = fresh()
        for parameter in model.parameters():
            parameter.grad = torch.ones_like(parameter)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        path = checkpoints.save_checkpoint(
            Path(tmp) / "run", 1, model, optimizer, {"step": 1}, cfg, rank, world)
        del model, optimizer
        model, optimizer = fresh()
        parameters = sum(p.numel() for p in model.parameters())
        peak, held = load_memory(lambda: checkpoints.load_checkpoint(path, model, optimizer, rank),
                                 device)
        moments = sum(s.numel() for state in optimizer.state.values() for s in state.values()
                      if torch.is_tensor(s) and s.dim() > 0)
    planned = plan.update_gib(arch, world, 4, 4, True, 1, 1)  # the resume's trainer terms
    torch.distributed.destroy_process_group()
    return {
        "size": args.size, "device": torch.cuda.get_device_name() if device.type == "cuda"
        else "cpu", "torch": torch.__version__, "parameters": parameters,
        "planned_parameters": arch.parameters,
        "fp32_shards_gib": round(4 * parameters / 2**30, 3),
        "peak_bytes_per_parameter": round(peak / parameters, 2),
        "held_bytes_per_parameter": round(held / parameters, 2),
        "moment_bytes_per_parameter": round(4 * moments / parameters, 2),
        # plan.py's resume phase over the shards: zero gradients and moments, AdamW's temporary
        "planned_bytes_per_parameter": round(
            (planned["state"] + planned["step"]) * 2**30 / arch.parameters - 4, 2),
        "planned_held_bytes_per_parameter": 8}


def load_memory(fn, device):
    """(peak, held) bytes that fn() allocates over what is live before it: CUDA's allocator
    statistics, or on CPU the resident set (freed heap memory is returned first, so that the load
    cannot reuse pages that are already counted)."""
    import ctypes

    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        baseline = torch.cuda.memory_allocated()
        fn()
        torch.cuda.synchronize()
        return (torch.cuda.max_memory_allocated() - baseline,
                torch.cuda.memory_allocated() - baseline)
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/clear_refs", "w") as clear_refs:
        clear_refs.write("5")  # reset the peak-RSS high-water mark (Linux >= 4.0)
    baseline = _rss_bytes("VmRSS")
    fn()
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    return _rss_bytes("VmHWM") - baseline, _rss_bytes("VmRSS") - baseline


def main():
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    memory = commands.add_parser(
        "logprob-memory", help="peak memory of chunked vs naive log-probs/entropy")
    memory.add_argument("--tokens", type=int, default=4096)
    memory.add_argument("--vocab", type=int, default=151_936)  # Qwen2.5
    train_step = commands.add_parser(
        "train-step", help="per-stage time of train.py on the tiny default")
    train_step.add_argument(
        "--tiny", default="runs/tiny", help="the tiny default's directory (built if missing)")
    train_step.add_argument("--steps", type=int, default=6)
    train_step.add_argument("--method", default="stare")
    update = commands.add_parser(
        "update", help="the no-grad pass and the update of train.py on a Qwen2.5 shape")
    update.add_argument("--size", default="1.5b", choices=list(QWEN25))
    update.add_argument("--method", default="stare", help="timed against grpo in the same run")
    update.add_argument("--rows", type=int, default=32, help="responses in the step")
    update.add_argument("--budget", type=int, default=16_384, help="train.micro_token_budget")
    update.add_argument("--gc", action="store_true", help="gradient checkpointing")
    update.add_argument("--attention", default="varlen", help="model.attn_implementation")
    update.add_argument(
        "--max-response", type=int, default=3000, help="longest response (lengths scale with it)")
    update.add_argument("--repeats", type=int, default=3)
    update.add_argument("--seed", type=int, default=0)
    speed = commands.add_parser("logprob-time", help="time of the log-prob/entropy kernels (CUDA)")
    speed.add_argument("--tokens", type=int, default=16_384)
    speed.add_argument("--vocab", type=int, default=151_936)
    speed.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    speed.add_argument("--repeats", type=int, default=10)
    speed.add_argument("--bandwidth", type=float, default=3.0e12, help="device memory bytes/s for "
                       "the floor (an H100 SXM copy measures ~3.0e12 counting reads and writes)")
    speed.add_argument(
        "--sweep", action="store_true", help="also time other block sizes and warp counts")
    overhead = commands.add_parser("stare-overhead", help="time of the STARE loss vs the GRPO loss")
    overhead.add_argument("--tokens", type=int, default=2**20)
    overhead.add_argument("--repeats", type=int, default=15)
    for sub in (memory, overhead):
        sub.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    throughput = commands.add_parser(
        "reward-throughput", help="responses per second of rewards.compute_rewards")
    throughput.add_argument("--responses", type=int, default=2000)
    compare = commands.add_parser(
        "trl-compare", help="train.py's step vs TRL's GRPOTrainer step at equal work")
    compare.add_argument(
        "--tiny", default="runs/tiny", help="the tiny default's directory (built if missing)")
    compare.add_argument("--steps", type=int, default=6)
    compare.add_argument(
        "--prompts", type=int, default=16, help="prompts per step (each gets rollout.n responses)")
    compare.add_argument("--threads", type=int, help="OpenMP threads of every side (default: one "
                         "per core); 1 when other jobs share the cores (see tools/trl_compare.py)")
    # internal: one TRL run
    compare.add_argument("--trl-worker", choices=["hf", "vllm"], help=argparse.SUPPRESS)
    # internal: where the TRL run writes its records
    compare.add_argument("--result", help=argparse.SUPPRESS)
    smoke = commands.add_parser("gpu-smoke", help="the first command on a new GPU machine (CUDA)")
    smoke.add_argument("--out", default="runs/gpu_smoke.json", help="where the JSON report goes")
    smoke.add_argument("--runner", default="v1", choices=["v1", "v2"], help="vLLM's model runner")
    smoke.add_argument("--sleep-level", type=int, default=2, choices=[1, 2])
    smoke.add_argument("--cpu", action="store_true",
                       help="the trainer's and engine's cycles on a tiny model on CPU (a test)")
    probe = commands.add_parser(
        "sync-probe", help="the weight-sync probe's divergences and cost on a model (CPU)")
    probe.add_argument("--model", required=True, help="a local HF model directory")
    probe.add_argument("--engine-dtype", default="float32", choices=["float32", "bfloat16"])
    probe.add_argument("--topk", type=int, default=20, help="rollout.sync_check_topk")
    probe.add_argument("--tokens", type=int, default=512, help="the probe's response tokens")
    probe.add_argument("--prompt", default="What is 7 + 5? Think step by step.")
    probe.add_argument("--stale", type=float, default=0.01)
    probe.add_argument("--repeats", type=int, default=3)
    resume = commands.add_parser(
        "resume-memory", help="peak memory of a resume's checkpoint load over the fp32 shards")
    resume.add_argument("--size", default="1.5b", choices=list(QWEN25))
    startup = commands.add_parser(
        "startup-memory", help="peak memory per rank of the sharded start-up (CPU)")
    startup.add_argument("--ranks", type=int, default=2)
    startup.add_argument("--tied", action="store_true", help="tied input and output embeddings")
    args = parser.parse_args()
    if args.command == "trl-compare":  # in a module of its own, as gpu-smoke (both import this one)
        from tools.trl_compare import bench_trl_compare as run
    elif args.command == "gpu-smoke":
        from tools.gpu_smoke import bench_gpu_smoke as run
    else:
        run = {
            "logprob-memory": bench_logprob_memory,
            "logprob-time": bench_logprob_time,
            "update": bench_update,
            "stare-overhead": bench_stare_overhead,
            "reward-throughput": bench_reward_throughput,
            "train-step": bench_train_step,
            "startup-memory": bench_startup_memory,
            "resume-memory": bench_resume_memory,
            "sync-probe": bench_sync_probe,
        }[args.command]
    result = run(args)
    if result is not None:  # None: a trl-compare worker, which reports through its --result file
        print(json.dumps(result))


if __name__ == "__main__":
    main()
