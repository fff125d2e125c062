"""tools/bench.py: benchmarks of the training code (the update path, log-probs, the STARE loss,
rewards, the whole step).

    python -m tools.bench logprob-memory   [--tokens 4096] [--vocab 151936] [--device cpu|cuda]
    python -m tools.bench logprob-time     [--tokens 16384] [--vocab 151936] [--dtype bfloat16] [--sweep]     (CUDA)
    python -m tools.bench stare-overhead   [--tokens 1048576] [--repeats 15] [--device cpu|cuda]
    python -m tools.bench update           [--size tiny|0.5b|1.5b|7b] [--method stare] [--rows 32] [--budget 16384] [--gc]
    python -m tools.bench reward-throughput [--responses 2000]
    python -m tools.bench train-step       [--tiny runs/tiny] [--steps 6] [--method stare]
    python -m tools.bench trl-compare      [--tiny runs/tiny] [--steps 6] [--prompts 16] [--threads N]
    python -m tools.bench startup-memory   [--ranks 2] [--tied]        (a random ~0.25B Qwen2, gloo ranks on CPU)
    python -m tools.bench gpu-smoke        [--out runs/gpu_smoke.json] [--runner v1] [--sleep-level 2]      (CUDA)

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
    results["goal_ratio"] = 0.125
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

    import baselines
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
    """train.Response rows with random tokens and binary rewards, advantages normalised per group."""
    import train

    generator = torch.Generator().manual_seed(seed)
    rewards = torch.randint(0, 2, (len(lengths),), generator=generator).float()
    advantages = torch.cat(
        [
            stare.group_advantages(rewards[i : i + group_size], len(rewards[i : i + group_size]))
            for i in range(0, len(lengths), group_size)])
    return [
        train.Response(
            prompt=torch.randint(0, vocab_size, (p,), generator=generator).tolist(),
            tokens=torch.randint(0, vocab_size, (r,), generator=generator).tolist(),
            rollout_logprobs=[-1.0] * r, reward=float(rewards[i]), accuracy=float(rewards[i]),
            truncated=False, reflection=(0, r), policy_mask=torch.ones(r, dtype=torch.bool),
            advantage=float(advantages[i]))
        for i, (p, r) in enumerate(lengths)]


def bench_update(args):
    """The no-grad pass and the update through train.py's own stages (old_policy_pass, update_gate,
    select_tokens, policy_update) on a random-init Qwen2.5 shape, FSDP2 with world size 1; methods
    interleaved, median times."""
    import config
    import modeling
    import train

    rank, world, device = train.setup_distributed()
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
        gate = stare.EntropyGate(**vars(cfg.gate))
        no_grad = timed(lambda: train.old_policy_pass(model, responses, cfg, device))
        train.update_gate(gate, responses, device)
        select = timed(lambda: train.select_tokens(responses, cfg, gate, step, device))
        update = timed(
            lambda: train.policy_update(model, optimizer, responses, cfg, gate, step, device))
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
    import tiny

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
# trl-compare
# --------------------------------------------------------------------------------------------------

TRL_MISSING = (
    "trl-compare needs TRL (not in requirements.txt): pip install -r requirements-bench.txt")


def compare_overrides(prompts):
    """train.py overrides for equal work with TRL's GRPOTrainer: plain GRPO, every generated group
    trained on (no dynamic sampling: TRL has none), `prompts` prompts x rollout.n responses per
    step, one optimizer step each. rollout.n, rollout.max_tokens, the sampling and the optimizer are
    configs/tiny.yaml's (8, 16, T=1, AdamW)."""
    return [
        "algorithm.method=grpo", "algorithm.dynamic_sampling=false",
        f"algorithm.gen_batch_size={prompts}", f"train.train_batch_size={prompts}",
        f"train.mini_batch_size={prompts}"]


def compare_config(tiny_dir, prompts):
    """The resolved (and checked) config train.py runs with in trl-compare; TRL's settings are read from it too."""
    import config

    return config.load(REPO / "configs" / "tiny.yaml",
                       tiny_overrides(tiny_dir) + compare_overrides(prompts))


class TrlStepTimes:
    """Wall times of TRL's optimizer steps, and of the stages inside them, from a TrainerCallback (on_step_begin to
    on_step_end: generation, reward, loss forward/backward, clipping, AdamW; TRL's per-step logging, which comes
    after on_step_end, is left out) and from timing wrappers around the trainer's own methods (no behaviour change).
    Built inside the worker, where transformers is imported."""

    def __init__(self):
        from transformers import TrainerCallback

        self.steps, self.stages, self.begin = [], {}, None
        timer = self

        class Callback(TrainerCallback):
            def on_step_begin(self, args, state, control, **kwargs):
                timer.begin, timer.stages = time.perf_counter(), {}

            def on_step_end(self, args, state, control, **kwargs):
                timer.steps.append({"step_s": time.perf_counter() - timer.begin, **timer.stages})

        self.callback = Callback()

    def add(self, key, value):
        self.stages[key] = self.stages.get(key, 0.0) + value

    def wrap(self, owner, name, key, only_without_grad=False):
        """Replace owner.name (a bound method) by one that adds its wall time to `key` of the current step."""
        method = getattr(owner, name)

        def timed(*args, **kwargs):
            if only_without_grad and torch.is_grad_enabled():
                return method(*args, **kwargs)
            start = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                self.add(key, time.perf_counter() - start)

        setattr(owner, name, timed)


def trl_trainer(cfg, out_dir, steps, use_vllm, timer=None):
    """TRL's GRPOTrainer set up to do the work train.py does with `cfg` (compare_config), for
    `steps` steps.

    Aligned: the model directory (float32), the prompts (data.py's examples: the same chat messages, which TRL
    renders with the same chat template and generation prompt), the verifier (rewards.compute_rewards), n responses
    per prompt, max_tokens, temperature / top_p / top_k, group advantages (mean and std per group), no KL and no
    reference model, the clipped surrogate (clip_low / clip_high) averaged over every response token of the batch
    (TRL's "dapo" = our token-mean), one AdamW step per generation batch (on-policy), lr / betas / weight decay /
    gradient clipping, a constant learning rate, the seed. Nothing is logged to a service or saved.
    timer: a TrlStepTimes, which also counts the completions and response tokens TRL scores each step."""
    import datasets
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    import data
    import rewards

    examples = [e for path in cfg.data.train_files
                for e in data.load_examples(path, prompt_suffix=cfg.data.prompt_suffix)]
    tokenizer = AutoTokenizer.from_pretrained(cfg.model.path)
    _, _, stats = data.tokenize_prompts(
        examples, tokenizer, cfg.data.max_prompt_tokens, cfg.data.overflow)
    # TRL would not cut them as data.py does: unequal prompts
    if stats["num_truncated"] or stats["num_skipped"]:
        raise ValueError(
            f"prompts longer than data.max_prompt_tokens={cfg.data.max_prompt_tokens}: {stats}")
    # conversational rows: TRL applies the tokenizer's chat template with add_generation_prompt, as
    # data.py does
    dataset = datasets.Dataset.from_list([{"prompt": e.messages, "ground_truth": e.ground_truth,
                                           "data_source": e.data_source} for e in examples])

    def verifier(completions, completion_ids, ground_truth, data_source, **kwargs):
        """train.py's reward: rewards.compute_rewards on the decoded responses (special tokens
        skipped, like vLLM's text), routed to verify_sum by the tiny task's data_source."""
        # conversational: one assistant message per completion
        texts = [c[-1]["content"] for c in completions]
        if timer is not None:
            timer.add("completions", len(completion_ids))
            timer.add("response_tokens", sum(len(ids) for ids in completion_ids))
        scores, _, _ = rewards.compute_rewards(
            texts, ground_truth, data_source, [len(i) for i in completion_ids], cfg.reward)
        return scores

    completions = cfg.train.train_batch_size * cfg.rollout.n
    args = GRPOConfig(
        output_dir=str(out_dir),
        max_steps=steps,
        seed=cfg.train.seed,
        use_cpu=not torch.cuda.is_available(),  # the device train.py picks
        # the batch: TRL counts completions, not prompts. One generation batch of train_batch_size
        # prompts x n, one optimizer step on all of it (no accumulation), used once
        # (num_iterations=1): on-policy like train.py
        num_generations=cfg.rollout.n,
        per_device_train_batch_size=completions,
        gradient_accumulation_steps=1,
        steps_per_generation=1,
        num_iterations=1,
        shuffle_dataset=cfg.data.shuffle,
        # sampling
        max_completion_length=cfg.rollout.max_tokens,
        temperature=cfg.rollout.temperature,
        top_p=cfg.rollout.top_p,
        top_k=cfg.rollout.top_k,  # 0 = off in both
        # the loss: no KL (beta=0 also means no reference model), the clip-higher surrogate,
        # token-mean over the global batch ("dapo"), std-normalised group advantages, truncated
        # responses kept (as train.py does)
        beta=0.0,
        loss_type="dapo",
        epsilon=cfg.loss.clip_low,
        epsilon_high=cfg.loss.clip_high,
        scale_rewards="group" if cfg.algorithm.normalize_std else "none",
        mask_truncated_completions=False,
        # the optimizer: plain torch.optim.AdamW like train.py (TRL's default is the fused variant),
        # constant rate
        optim="adamw_torch",
        learning_rate=cfg.optim.lr,
        adam_beta1=cfg.optim.betas[0],
        adam_beta2=cfg.optim.betas[1],
        weight_decay=cfg.optim.weight_decay,
        max_grad_norm=cfg.optim.grad_clip,
        lr_scheduler_type="constant",
        warmup_steps=cfg.optim.warmup_steps,
        # float32 end to end, activation checkpointing as train.py's (off; TRL's defaults: bf16,
        # checkpointing on)
        bf16=False,
        fp16=False,
        gradient_checkpointing=cfg.model.gradient_checkpointing,
        disable_dropout=True,
        # nothing external, nothing saved; the loop's own metrics every step, as train.py's
        # metrics.jsonl
        report_to="none",
        save_strategy="no",
        logging_steps=1,
        disable_tqdm=True,
        log_completions=False,
        dataloader_num_workers=0,
        # vLLM colocated in this process (the trl_vllm variant), with train.py's engine's context
        # length
        use_vllm=use_vllm,
        vllm_mode="colocate",
        vllm_max_model_length=cfg.data.max_prompt_tokens + cfg.rollout.max_tokens)
    model = AutoModelForCausalLM.from_pretrained(cfg.model.path, dtype=torch.float32,
                                                 attn_implementation=cfg.model.attn_implementation)
    trainer = GRPOTrainer(
        model=model, reward_funcs=verifier, args=args, train_dataset=dataset,
        processing_class=tokenizer, callbacks=[timer.callback] if timer is not None else None)
    if timer is not None:
        # includes the vLLM weight sync, taken out below
        timer.wrap(trainer, "_generate_single_turn", "generate")
        timer.wrap(trainer, "_calculate_rewards", "reward")
        timer.wrap(
            trainer, "_get_per_token_logps_and_entropies", "old_logprobs", only_without_grad=True)
        if use_vllm:
            timer.wrap(trainer.vllm_generation, "sync_weights", "sync")
    return trainer


def trl_worker(args):
    """One TRL run in this (fresh) process; writes its step records, or the error that stopped it, to args.result."""
    import tempfile

    result = {}
    try:
        cfg = compare_config(args.tiny, args.prompts)
        timer = TrlStepTimes()
        with tempfile.TemporaryDirectory() as out_dir:
            trainer = trl_trainer(
                cfg, out_dir, args.steps, use_vllm=args.trl_worker == "vllm", timer=timer)
            start = time.perf_counter()
            trainer.train()
            result = {"train_s": time.perf_counter() - start, "steps": timer.steps}
            # TRL passes no dtype to vllm.LLM: record what the engine chose
            if args.trl_worker == "vllm":
                dtype = trainer.vllm_generation.llm.llm_engine.model_config.dtype
                result["engine_dtype"] = str(dtype).removeprefix("torch.")
    except Exception as error:  # reported by the parent, e.g. "trl_vllm": "unsupported on CPU: ..."
        message = (str(error).strip().splitlines() or [""])[0]  # its first line
        result = {"error": f"{type(error).__name__}: {message}"}
        raise
    finally:
        Path(args.result).write_text(json.dumps(result))


def run_trl(tiny_dir, steps, prompts, variant):
    """trl_worker in a fresh process, as train.py runs in one -> (its result dict, wall seconds of the process)."""
    import os
    import subprocess
    import sys
    import tempfile

    with tempfile.TemporaryDirectory() as scratch:
        result_path = Path(scratch) / "result.json"
        command = [
            sys.executable, "-m", "tools.bench", "trl-compare", f"--tiny={tiny_dir}",
            f"--steps={steps}", f"--prompts={prompts}", f"--trl-worker={variant}",
            f"--result={result_path}"]
        # everything is local
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
        start = time.perf_counter()
        completed = subprocess.run(command, cwd=REPO, capture_output=True, text=True, env=env)
        wall = time.perf_counter() - start
        result = json.loads(result_path.read_text()) if result_path.exists() else {}
    # died without a Python exception (a signal, vLLM)
    if completed.returncode != 0 and "error" not in result:
        lines = [line for line in completed.stderr.splitlines() if line.strip()]
        result = {"error": lines[-1] if lines else f"exit status {completed.returncode}"}
    return result, wall


def trl_summary(result, wall):
    """The TRL side of the report from trl_worker's step records, averaged over the steps after the first."""
    steps = result["steps"][1:]

    def mean(key):
        return statistics.mean(s.get(key, 0.0) for s in steps)

    summary = {
        "step_s": round(mean("step_s"), 3),
        "total_s": round(wall, 1),
        "completions_per_step": mean("completions"),
        "response_tokens_per_step": mean("response_tokens"),
        "generate_s": round(mean("generate") - mean("sync"), 3),
        "reward_s": round(mean("reward"), 3),
        "old_logprobs_s": round(mean("old_logprobs"), 3),
    }
    if "engine_dtype" in result:
        summary["sync_s"] = round(mean("sync"), 3)
        summary["engine_dtype"] = result["engine_dtype"]
    # the rest of the step: the loss forward and backward, clipping, AdamW, TRL's batch preparation
    # and metrics
    summary["update_and_rest_s"] = round(
        mean("step_s") - mean("generate") - mean("reward") - mean("old_logprobs"), 3)
    summary["tokens_per_s"] = round(summary["response_tokens_per_step"] / mean("step_s"), 1)
    return summary


def pin_threads(threads):
    """Make the processes started from here use `threads` OpenMP threads: torch reads
    OMP_NUM_THREADS at start-up, and vLLM's CPU worker (in-process, in train.py and in TRL's
    colocate mode) binds its OpenMP threads to the cores VLLM_CPU_OMP_THREADS_BIND lists instead of
    choosing them itself."""
    import os

    cores = sorted(os.sched_getaffinity(0))[:threads]
    os.environ.update(
        OMP_NUM_THREADS=str(threads), VLLM_CPU_OMP_THREADS_BIND=",".join(map(str, cores)))


def bench_trl_compare(args):
    import importlib.metadata
    import importlib.util
    import sys

    if args.trl_worker:
        return trl_worker(args)
    if importlib.util.find_spec("trl") is None:
        sys.exit(TRL_MISSING)
    if args.steps < 2:
        sys.exit(
            "trl-compare: --steps must be >= 2 (the first step of each side is start-up and not averaged)"
        )
    import tiny

    if args.threads:
        pin_threads(args.threads)
    tiny.build_tiny(args.tiny)  # reused when complete
    cfg = compare_config(args.tiny, args.prompts)  # checks the settings before anything runs
    records, ours_wall = run_train_py(args.tiny, args.steps, compare_overrides(args.prompts))
    # on each side the first step pays for start-up (allocations, first calls), as in train-step
    steps = records[1:]
    stages = stage_times(steps)
    ours = {
        "step_s": stages.pop("step_s"),
        "total_s": round(ours_wall, 1),
        # tokens / mean length: the responses the step really trained on, not what the config
        # asked for
        "completions_per_step": round(
            statistics.mean(s["train/tokens"] / s["rollout/response_length_mean"] for s in steps), 2
        ),
        "response_tokens_per_step": statistics.mean(s["train/tokens"] for s in steps),
        **stages,
    }
    result = {
        "steps": args.steps,
        "steps_averaged": len(steps),
        "prompts_per_step": args.prompts,
        "n": cfg.rollout.n,
        "max_tokens": cfg.rollout.max_tokens,
        "threads": args.threads or torch.get_num_threads(),  # each side's OpenMP threads
        "versions": {
            name: importlib.metadata.version(name) for name in ("trl", "transformers", "torch")
        },
        "ours": ours,
    }
    # one after the other: never two at once
    for variant, key in (("hf", "trl"), ("vllm", "trl_vllm")):
        trl_result, wall = run_trl(args.tiny, args.steps, args.prompts, variant)
        if "error" in trl_result:
            if variant == "hf":  # the mandatory side
                raise RuntimeError(f"TRL's GRPOTrainer failed: {trl_result['error']}")
            result[key] = f"unsupported on CPU: {trl_result['error']}"
            continue
        result[key] = trl_summary(trl_result, wall)
        result[f"ratio_{key}_over_ours"] = round(result[key]["step_s"] / ours["step_s"], 2)
    result["goal_ratio"] = 2.0  # trl step / our step, TRL's HF path (its default) at least
    result["measured"] = {
        "ours": "train.py in its own process; time/step of metrics.jsonl (rollout to the step's metrics; the "
        "checkpoint after the last step excluded), mean over steps 2..N; the stages are its time/* keys",
        "trl": "GRPOTrainer.train() in its own process; a TrainerCallback's on_step_begin -> on_step_end wall time "
        "(generation, reward, loss forward/backward, clipping, AdamW; TRL's per-step logging, after "
        "on_step_end, excluded), mean over steps 2..N; the stages from timing wrappers on the trainer's "
        "_generate_single_turn, _calculate_rewards, no-grad _get_per_token_logps_and_entropies and vLLM's "
        "sync_weights; update_and_rest_s is the step minus those",
        "total_s": "wall time of each side's whole process: imports, model (and engine) start-up, all steps, exit",
    }
    result["unequal_work"] = [
        "ours does a no-grad pass for the old log-probs (with entropy and entropy sensitivity, for its metrics); "
        "TRL's on-policy HF path skips it (old = current log-probs, detached); TRL with vLLM does it (its "
        "importance-sampling correction, on by default)",
        "ours samples with its vLLM engine and streams the new weights into it every step (sync_s), with a log-prob "
        f"probe every rollout.sync_check_every={cfg.rollout.sync_check_every} steps; TRL's HF path samples with "
        "model.generate on the training weights",
        "ours computes more per-step metrics (entropy dynamics, reflection counts, sampler/trainer log-prob "
        "mismatch); TRL computes entropy, clip fractions and reward statistics",
        f"ours dual-clips negative advantages (c={cfg.loss.dual_clip}); TRL does not (on-policy the ratio is 1)",
        f"ours splits the update into micro-batches of <= train.micro_token_budget={cfg.train.micro_token_budget} "
        "tokens; TRL runs the whole batch at once",
        "ours' total_s includes a final checkpoint and HF export; TRL saves nothing (save_strategy='no')",
        "TRL's colocated vLLM engine keeps vLLM's defaults where TRL exposes no setting: its dtype "
        f"(trl_vllm.engine_dtype; ours rollout.dtype={cfg.rollout.dtype}), torch.compile of the model (ours "
        f"rollout.enforce_eager={str(cfg.rollout.enforce_eager).lower()}), and a KV cache sized as a fraction of RAM "
        f"(vllm_gpu_memory_utilization; ours rollout.kv_cache_gib={cfg.rollout.kv_cache_gib}); it sends n requests "
        "of one sample per prompt where ours sends one request of n samples"]
    return result


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
# gpu-smoke: the first thing to run on a new GPU machine
# --------------------------------------------------------------------------------------------------

SMOKE_SHAPE = dict(QWEN25["0.5b"], max_position_embeddings=4096)


def smoke_model(directory, shape=SMOKE_SHAPE):
    """A random Qwen2 in bfloat16 with the tiny default's tokenizer (ids < 259 < its vocabulary):
    nothing is downloaded. -> its directory."""
    import tiny
    from transformers import Qwen2Config, Qwen2ForCausalLM

    tokenizer = tiny.build_tokenizer()
    eos, pad = tokenizer.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(
        Qwen2Config(eos_token_id=eos, pad_token_id=pad, bos_token_id=pad, **shape))
    model.to(torch.bfloat16).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def free_gib(device):
    """Free device memory (GiB), None off CUDA."""
    return round(torch.cuda.mem_get_info(device)[0] / 2**30, 2) if device.type == "cuda" else None


def allocated_gib(device):
    """Device memory held by tensors (freed memory stays with the caching allocator), None off
    CUDA."""
    return torch.cuda.memory_allocated(device) / 2**30 if device.type == "cuda" else None


def growth_gib(before, after):
    return None if before is None else round(after - before, 3)


def peak_gib(device, fn):
    """The device memory fn allocates at its peak (GiB), None off CUDA."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    before = allocated_gib(device)
    fn()
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if before is not None else None
    return growth_gib(before, peak)


def smoke_config(model_dir, device, prompts, max_tokens):
    import config

    return config.load(overrides=[
        "data.train_files=[unused.jsonl]", f"model.path={model_dir}",
        "model.param_dtype=" + ("bfloat16" if device.type == "cuda" else "float32"),
        "algorithm.method=grpo", "optim.lr=1e-5", f"rollout.max_tokens={max_tokens}",
        "rollout.n=4", f"train.train_batch_size={prompts}", f"train.mini_batch_size={prompts}"])


def smoke_groups(prompt_ids, out, generator):
    """train.Group's of 4 from sampled output (rollout.generate's fields), random 0/1 rewards."""
    import train

    rewards = torch.randint(0, 2, (len(out.token_ids),), generator=generator).float()
    responses = [
        train.Response(prompt=prompt_ids[out.prompt_index[i]], tokens=out.token_ids[i] or [3],
                       rollout_logprobs=out.logprobs[i] or [0.0], reward=float(rewards[i]),
                       accuracy=float(rewards[i]), truncated=out.finish_reasons[i] == "length",
                       reflection=(0, 0),
                       policy_mask=torch.ones(max(1, len(out.token_ids[i])), dtype=torch.bool))
        for i in range(len(out.token_ids))]
    return [train.Group(responses[j].prompt, responses[j:j + 4])
            for j in range(0, len(responses), 4)]


def gather_memory(groups, device):
    """Device memory of gathering the groups through train.all_gather (a gloo group: host memory)
    and through the default group (NCCL on a GPU: world x the pickled object on the device)."""
    import train

    free, world = free_gib(device), torch.distributed.get_world_size()
    return dict(
        gather_gib=peak_gib(device, lambda: train.all_gather(groups)),
        gather_default_group_gib=peak_gib(
            device, lambda: torch.distributed.all_gather_object([None] * world, groups)),
        free_gib_gather=[free, free_gib(device)])


def probe_memory(model, probe, device):
    """The probe's no-grad forward again: which parameters it leaves gathered (FSDP2's root unit),
    the device memory they hold, and what modeling.reshard_root frees."""
    import modeling
    import rollout

    free, before = free_gib(device), allocated_gib(device)
    rollout.trainer_logprobs(model, *probe)
    gathered = [n for n, p in model.named_parameters() if not hasattr(p, "to_local")]
    after, free_gathered = allocated_gib(device), free_gib(device)
    modeling.reshard_root(model)
    return dict(probe_gathered=gathered, probe_gathered_gib=growth_gib(before, after),
                probe_freed_gib=growth_gib(allocated_gib(device), after),
                free_gib_probe=[free, free_gathered, free_gib(device)],
                resharded=all(hasattr(p, "to_local") for p in model.parameters()))


def update_on(model, optimizer, gate, groups, cfg, cycle, device):
    """train.py's no-grad pass, gate and update on the groups -> (responses, record)."""
    import train

    responses = train.group_responses(groups, cfg, 0, 1)
    train.old_policy_pass(model, responses, cfg, device)
    mismatch = torch.cat(
        [(torch.tensor(r.rollout_logprobs) - r.old_logprobs).abs() for r in responses])
    train.update_gate(gate, responses, device)
    metrics = train.policy_update(model, optimizer, responses, cfg, gate, cycle, device)
    return responses, dict(
        logprob_mismatch_mean=float(mismatch.mean()), grad_norm=metrics["train/grad_norm"],
        skipped=metrics["train/skipped_updates"], free_gib_update=free_gib(device))


def update_failures(record):
    if record["skipped"] or not math.isfinite(record["grad_norm"]):
        return [f"cycle {record['cycle']}: the update was not finite"]
    return []


def trainer_cycles(model_dir, device, cycles=2, prompts=16, max_tokens=128):
    """gpu-smoke's cycles where vLLM does not import: random responses instead of sampled ones, then
    the same gather, no-grad pass, update and probe forward as engine_cycles, with the same memory
    readings (gather_*, probe_*). -> report dict (report["ok"] False on a non-finite update, a probe
    that leaves a decoder layer gathered or anything left unsharded after reshard_root)."""
    import types

    import modeling
    import stare

    cfg = smoke_config(model_dir, device, prompts, max_tokens)
    model = modeling.build_model(cfg, device, 1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.optim.lr)
    gate = stare.EntropyGate(cfg.gate.target_entropy)
    report = {"cycles": [], "failures": [], "free_gib_trainer": free_gib(device)}
    generator = torch.Generator().manual_seed(0)
    prompt_ids = [torch.randint(3, 259, (64,), generator=generator).tolist()
                  for _ in range(prompts)]
    for cycle in range(1, cycles + 1):
        lengths = torch.randint(1, max_tokens + 1, (4 * prompts,), generator=generator).tolist()
        out = types.SimpleNamespace(
            prompt_index=[i // 4 for i in range(4 * prompts)],
            token_ids=[torch.randint(3, 259, (n,), generator=generator).tolist() for n in lengths],
            logprobs=[[0.0] * n for n in lengths], finish_reasons=["stop"] * (4 * prompts))
        groups = smoke_groups(prompt_ids, out, generator)
        record = {"cycle": cycle, **gather_memory(groups, device)}
        responses, update = update_on(model, optimizer, gate, groups, cfg, cycle, device)
        record.update(update)
        del record["logprob_mismatch_mean"]  # random tokens: no sampler to compare with
        probe = (responses[0].prompt + responses[0].tokens, len(responses[0].prompt))
        record.update(probe_memory(model, probe, device))
        report["failures"] += update_failures(record)
        if any(".layers." in name for name in record["probe_gathered"]) or not record["resharded"]:
            report["failures"].append(f"cycle {cycle}: the probe left a decoder layer gathered "
                                      "or reshard_root left a parameter unsharded")
        report["cycles"].append(record)
    report["ok"] = not report["failures"]
    return report


def engine_cycles(model_dir, device, cycles=3, runner="v1", sleep_level=2, sleep=True,
                  kv_cache_gib=None, utilization=0.3, prompts=16, max_tokens=128,
                  max_probe_error=2.0, max_mismatch=0.25):
    """`cycles` x (generate -> gather the groups -> sleep -> update -> wake weights -> sync ->
    trainer side of the probe -> wake KV cache -> engine side of the probe), in train.py's order and
    with its functions, on one rank -> report dict. Free device memory is read after every phase; a
    probe error or a rollout/trainer mismatch past the bounds, a non-finite update or an exception
    is a failure (report["ok"] False, report["failures"]). Each cycle also measures two things an
    NCCL group and a GPU decide (gather_memory, probe_memory): the device memory of gathering the
    groups, and what a no-grad forward of the probe leaves gathered and reshard_root frees."""
    import dataclasses
    import logging
    import re

    import config
    import modeling
    import rollout
    import train

    report = {"cycles": [], "failures": []}
    graph_gib = []

    class GraphLog(logging.Handler):  # vLLM logs the CUDA-graph memory it captured
        def emit(self, record):
            found = re.search(
                r"[Gg]raph capturing finished.*?took ([0-9.]+) GiB", record.getMessage())
            if found:
                graph_gib.append(float(found[1]))

    handler = GraphLog()
    logging.getLogger("vllm").addHandler(handler)
    cfg = smoke_config(model_dir, device, prompts, max_tokens)
    sync_cfg = config.apply_overrides(cfg, [f"rollout.enable_sleep_mode={str(sleep).lower()}"])
    report["free_gib_start"] = free_gib(device)
    # sleep mode as sync_cfg says; enforce_eager None: on CPU only (rollout.build_engine)
    engine_cfg = dataclasses.replace(
        sync_cfg.rollout, dtype="bfloat16", gpu_memory_utilization=utilization,
        kv_cache_gib=kv_cache_gib, model_runner=runner, enforce_eager=None)
    engine = rollout.build_engine(engine_cfg, model_dir, seed=0, max_model_len=64 + max_tokens + 1)
    try:
        vllm_config = engine.llm_engine.vllm_config
        shape = vllm_config.model_config.hf_config
        kv_heads, head_dim = (shape.num_key_value_heads,
                              shape.hidden_size // shape.num_attention_heads)
        token_bytes = 2 * shape.num_hidden_layers * kv_heads * head_dim * 2
        blocks = vllm_config.cache_config.num_gpu_blocks or 0
        report.update(
            runner=rollout.engine_runner(engine), engine_dtype=str(rollout.engine_dtype(engine)),
            kv_cache_gib=round(blocks * vllm_config.cache_config.block_size * token_bytes / 2**30,
                               2),
            cuda_graph_gib=graph_gib[-1] if graph_gib else None, free_gib_engine=free_gib(device))
        model = modeling.build_model(cfg, device, 1)
        optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.optim.lr)
        gate = stare.EntropyGate(cfg.gate.target_entropy)
        report["free_gib_trainer"] = free_gib(device)
        generator = torch.Generator().manual_seed(0)
        prompt_ids = [torch.randint(3, 259, (64,), generator=generator).tolist()
                      for _ in range(prompts)]
        for cycle in range(1, cycles + 1):
            out = rollout.generate(engine, prompt_ids, n=4, max_tokens=max_tokens,
                                   seeds=[(cycle - 1) * prompts + i for i in range(prompts)])
            record = {"cycle": cycle, "free_gib_rollout": free_gib(device)}
            groups = smoke_groups(prompt_ids, out, generator)
            record.update(gather_memory(groups, device))
            if sleep:
                rollout.release_memory(engine, sleep_level)
            record["free_gib_asleep"] = free_gib(device)
            responses, update = update_on(model, optimizer, gate, groups, cfg, cycle, device)
            record.update(update)
            probe, error = train.sync_engine(engine, model, sync_cfg, responses, cycle, None,
                                             first=True)
            record.update(probe_error=error, probe_tokens=len(probe[0]) - probe[1] if probe else 0,
                          free_gib_synced=free_gib(device),
                          resharded=all(hasattr(p, "to_local") for p in model.parameters()))
            if probe:  # the probe's forward again, then reshard_root, as train.sync_engine does
                record.update({k: v for k, v in probe_memory(model, probe, device).items()
                               if k != "resharded"})
            if error is None or not error <= max_probe_error:
                report["failures"].append(
                    f"cycle {cycle}: probe error {error} (bound {max_probe_error})")
            if not record["logprob_mismatch_mean"] <= max_mismatch:
                report["failures"].append(
                    f"cycle {cycle}: rollout/trainer mismatch "
                    f"{record['logprob_mismatch_mean']:.3g} (bound {max_mismatch})")
            report["failures"] += update_failures(record)
            report["cycles"].append(record)
    except Exception as error:  # noqa: BLE001  (a smoke test reports every failure)
        report["failures"].append(f"{type(error).__name__}: {error}")
    finally:
        logging.getLogger("vllm").removeHandler(handler)
        rollout.shutdown_engine(engine)
    report["ok"] = not report["failures"]
    return report


def bench_gpu_smoke(args):
    """The first command on a new GPU machine (docs/benchmarks.md, "A new GPU machine"): the
    engine's sleep / sync / probe cycles, then the GPU tests and `update --size 1.5b`; one JSON,
    exit 1 on any failure."""
    import subprocess
    import sys
    import tempfile
    import traceback

    if not torch.cuda.is_available():
        print(
            'gpu-smoke needs CUDA: run it on a GPU machine (docs/benchmarks.md, "A new GPU machine")',
            file=sys.stderr)
        sys.exit(2)
    import plan
    import train

    repo = REPO
    installed = plan.installed_versions()
    errors, warnings = plan.machine_problems(installed)
    result = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "installed": installed,
        "preflight": errors + warnings,
    }
    rank, world, device = train.setup_distributed()
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = smoke_model(tmp + "/model")
        try:
            import vllm  # noqa: F401
        except ImportError as error:
            result["engine"] = {"ok": False,
                                "failures": [f"not run: vllm does not import here ({error})"]}
            try:
                result["trainer"] = trainer_cycles(model_dir, device)
            except Exception:  # noqa: BLE001  (a smoke test reports every failure)
                result["trainer"] = {"ok": False, "failures": [traceback.format_exc()[-3000:]]}
        else:
            result["engine"] = engine_cycles(model_dir, device, runner=args.runner,
                                             sleep_level=args.sleep_level)
    torch.distributed.destroy_process_group()
    torch.cuda.empty_cache()  # the tests and the update benchmark below get the whole device
    # the children start process groups of their own, not on this one's address
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    tests = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "tests/test_gpu.py", "tests/test_baselines.py",
         "tests/test_stare.py::test_selection_never_syncs_host_and_device",
         "tests/test_modeling.py"],
        cwd=repo, env=env, capture_output=True, text=True)
    result["gpu_tests"] = {"returncode": tests.returncode,
                           "summary": (tests.stdout.strip().splitlines() or [""])[-1]}
    if tests.returncode:
        result["gpu_tests"]["output"] = (tests.stdout + tests.stderr)[-20000:]
    update = subprocess.run(
        [sys.executable, "-m", "tools.bench", "update", "--size", "1.5b", "--gc",
         "--budget", "32768", "--repeats", "2"], cwd=repo, env=env, capture_output=True, text=True)
    try:
        result["update"] = json.loads(update.stdout.strip().splitlines()[-1])
    except (IndexError, json.JSONDecodeError):
        result["update"] = {"returncode": update.returncode, "error": update.stderr[-2000:]}
    failed = (not result["engine"]["ok"] or not result.get("trainer", {"ok": True})["ok"]
              or tests.returncode != 0 or update.returncode != 0
              or any(line.startswith("error") for line in errors))
    result["ok"] = not failed
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(json.dumps(result))
    sys.exit(1 if failed else 0)


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
    speed.add_argument(
        "--bandwidth",
        type=float,
        default=3.0e12,
        help="device memory bytes/s for the floor "
        "(an H100 SXM copy measures ~3.0e12 counting reads and writes)")
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
    compare.add_argument(
        "--threads",
        type=int,
        help="OpenMP threads of every side (default: one per core); 1 "
        "when other jobs share the cores (see the module docstring)")
    # internal: one TRL run
    compare.add_argument("--trl-worker", choices=["hf", "vllm"], help=argparse.SUPPRESS)
    # internal: where the TRL run writes its records
    compare.add_argument("--result", help=argparse.SUPPRESS)
    smoke = commands.add_parser("gpu-smoke", help="the first command on a new GPU machine (CUDA)")
    smoke.add_argument("--out", default="runs/gpu_smoke.json", help="where the JSON report goes")
    smoke.add_argument("--runner", default="v1", choices=["v1", "v2"], help="vLLM's model runner")
    smoke.add_argument("--sleep-level", type=int, default=2, choices=[1, 2])
    startup = commands.add_parser(
        "startup-memory", help="peak memory per rank of the sharded start-up (CPU)")
    startup.add_argument("--ranks", type=int, default=2)
    startup.add_argument("--tied", action="store_true", help="tied input and output embeddings")
    args = parser.parse_args()
    run = {
        "logprob-memory": bench_logprob_memory,
        "logprob-time": bench_logprob_time,
        "update": bench_update,
        "stare-overhead": bench_stare_overhead,
        "reward-throughput": bench_reward_throughput,
        "train-step": bench_train_step,
        "trl-compare": bench_trl_compare,
        "startup-memory": bench_startup_memory,
        "gpu-smoke": bench_gpu_smoke,
    }[args.command]
    result = run(args)
    if result is not None:  # None: a trl-compare worker, which reports through its --result file
        print(json.dumps(result))


if __name__ == "__main__":
    main()
