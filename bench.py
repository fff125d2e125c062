"""bench.py: benchmarks for stare.py. Each subcommand prints one JSON object.

    python bench.py logprob-memory   [--tokens 4096] [--vocab 151936] [--device cpu|cuda]
    python bench.py stare-overhead   [--tokens 1048576] [--repeats 15] [--device cpu|cuda]
    python bench.py reward-throughput [--responses 2000]

logprob-memory: peak *extra* memory (beyond the input logits) of stare.token_logprobs_and_entropy vs the naive
    log_softmax + entropy on the full tensor, for float32 and bfloat16 logits. On CUDA it reads the allocator's
    peak; on CPU (Linux) the process's peak resident memory, reset just before each measurement
    (/proc/self/clear_refs), so every byte the computation touched counts. Goal: ratio <= 0.125.
train-step: per-stage time of the real training loop (train.py on the tiny default, CPU: rollout, reward, the
    no-grad pass, update, sync) and tokens/s, averaged over the steps after the first (start-up excluded).
stare-overhead: time of stare_weights + clipped_surrogate + aggregate_loss vs clipped_surrogate + aggregate_loss
    alone, on the same tokens in the same run (interleaved, median of repeats). overhead_ratio = stare/grpo - 1.
    Goal: <= 0.25. The forward+backward numbers include the backward of the loss, which training always pays.
reward-throughput: rewards.compute_rewards (math-verify, main thread, 5 s deadline) on a mixed batch like a rollout's:
    groups of 16 samples per prompt; answers are integers (50% of prompts), decimals (10%), fractions (15%),
    radicals (10%), polynomials (10%) and intervals (5%); about 40% of responses are correct (half written as the
    gold, half in another form), 50% wrong, 10% without a box. Caches start cold for this batch (the warm-up uses
    other prompts). Goal: >= 500 responses/s on 2 CPU cores.
"""

import argparse
import gc
import json
import random
import statistics
import time

import torch

import stare


# ----------------------------------------------------------------------------------------------------------------------
# logprob-memory
# ----------------------------------------------------------------------------------------------------------------------


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
               "chunk_rows": stare._chunk_rows(args.tokens, args.vocab, None)}
    for dtype in (torch.float32, torch.bfloat16):
        logits = torch.randn(args.tokens, args.vocab, generator=generator, device=device, dtype=dtype) * 4
        tokens = torch.randint(0, args.vocab, (args.tokens,), generator=generator, device=device)
        # warm-up (allocator, kernels), then check the two agree before measuring them
        chunked_out = stare.token_logprobs_and_entropy(logits, tokens)
        naive_out = naive_logprobs_and_entropy(logits, tokens)
        max_diff = max((a - b).abs().max().item() for a, b in zip(chunked_out, naive_out))
        del chunked_out, naive_out
        with torch.no_grad():
            naive = peak_extra_bytes(lambda: naive_logprobs_and_entropy(logits, tokens), device)
            chunked = peak_extra_bytes(lambda: stare.token_logprobs_and_entropy(logits, tokens), device)
        name = "float32" if dtype == torch.float32 else "bfloat16"
        results[name] = {"naive_peak_mib": round(naive / 2**20, 1), "chunked_peak_mib": round(chunked / 2**20, 1),
                         "ratio": round(chunked / naive, 4), "max_abs_diff": max_diff}
        del logits, tokens
    # the headline keys: the worse of the two dtypes
    worst = max(("float32", "bfloat16"), key=lambda name: results[name]["ratio"])
    results.update({key: results[worst][key] for key in ("naive_peak_mib", "chunked_peak_mib", "ratio")})
    results["goal_ratio"] = 0.125
    return results


# ----------------------------------------------------------------------------------------------------------------------
# stare-overhead
# ----------------------------------------------------------------------------------------------------------------------


def make_step_batch(num_tokens, device, seed=0):
    """A synthetic optimizer-step batch with a realistic shape: groups of 8 responses, ragged lengths, binary
    rewards, most tokens confident (surprisal ~ exponential with mean 0.3 nats)."""
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
    token_loss, _ = stare.clipped_surrogate(logprobs, old_logprobs, advantages, dual_clip=10.0, mask=mask)
    return stare.aggregate_loss(token_loss, mask)


def stare_loss(logprobs, old_logprobs, advantages, mask):
    weights, _ = stare.stare_weights(old_logprobs, advantages, mask, variant="O1", top_ratio=0.1, gate_on=True)
    token_loss, _ = stare.clipped_surrogate(logprobs, old_logprobs, advantages, dual_clip=10.0, mask=mask)
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

    cases = {"grpo": lambda: forward(grpo_loss), "stare": lambda: forward(stare_loss),
             "grpo_fwd_bwd": lambda: forward_backward(grpo_loss), "stare_fwd_bwd": lambda: forward_backward(stare_loss)}
    for fn in cases.values():  # warm-up
        fn()
    samples = {name: [] for name in cases}
    for _ in range(args.repeats):  # interleaved, so drift in machine load hits both sides alike
        for name, fn in cases.items():
            samples[name].append(time_ms(fn, device))
    median = {name: statistics.median(values) for name, values in samples.items()}
    return {
        "tokens": int(mask.numel()), "valid_tokens": int(mask.sum()), "device": str(device),
        "threads": torch.get_num_threads(), "repeats": args.repeats,
        "grpo_ms": round(median["grpo"], 2), "stare_ms": round(median["stare"], 2),
        "overhead_ratio": round(median["stare"] / median["grpo"] - 1, 3),
        "grpo_fwd_bwd_ms": round(median["grpo_fwd_bwd"], 2), "stare_fwd_bwd_ms": round(median["stare_fwd_bwd"], 2),
        "overhead_ratio_fwd_bwd": round(median["stare_fwd_bwd"] / median["grpo_fwd_bwd"] - 1, 3),
        "goal_overhead_ratio": 0.25,
    }


# ----------------------------------------------------------------------------------------------------------------------
# reward-throughput
# ----------------------------------------------------------------------------------------------------------------------


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
        return str(a / q), f"\\frac{{{a}}}{{{q}}}", lambda: f"\\frac{{{a + rng.randint(1, 9)}}}{{{q}}}"
    if kind == "fraction":
        return f"\\frac{{{a}}}{{{b + a}}}", f"{a}/{b + a}", lambda: f"\\dfrac{{{b + a}}}{{{a + rng.randint(0, 5)}}}"
    if kind == "radical":
        return f"{a}\\sqrt{{2}}", f"\\sqrt{{{2 * a * a}}}", lambda: f"{a}\\sqrt{{{rng.choice([3, 5, 6])}}}"
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
            answer = gold if draw < 0.2 else other_form if draw < 0.4 else wrong_answer() if draw < 0.9 else None
            reasoning = "Let me work through this step by step. " * rng.randint(2, 12)
            ending = f"So the final answer is \\boxed{{{answer}}}." if answer else "So the final answer is unclear."
            responses.append(reasoning + ending)
            ground_truths.append(gold)
    return responses, ground_truths, ["Short_CoT"] * num_responses


def bench_reward_throughput(args):
    import rewards  # lazily: the other subcommands do not need math-verify

    cfg = rewards.RewardConfig()
    warmup = reward_batch(64, seed=1)  # first-call costs (sympy and antlr set-up), on prompts the timed batch lacks
    rewards.compute_rewards(*warmup, [0] * 64, cfg)
    responses, ground_truths, data_sources = reward_batch(args.responses, seed=0)
    start = time.perf_counter()
    _, accuracies, _ = rewards.compute_rewards(responses, ground_truths, data_sources, [0] * len(responses), cfg)
    seconds = time.perf_counter() - start
    return {"responses": len(responses), "seconds": round(seconds, 3),
            "responses_per_s": round(len(responses) / seconds, 1), "acc": round(sum(accuracies) / len(accuracies), 4)}


# ----------------------------------------------------------------------------------------------------------------------
# train-step
# ----------------------------------------------------------------------------------------------------------------------


def bench_train_step(args):
    import subprocess
    import sys
    import tempfile
    from pathlib import Path

    import tiny

    tiny_dir = Path(args.tiny)
    tiny.build_tiny(tiny_dir)  # reused when complete
    with tempfile.TemporaryDirectory() as out_dir:
        command = [sys.executable, "train.py", "--config", "configs/tiny.yaml", f"model.path={tiny_dir / 'model'}",
                   f"data.train_files=[{tiny_dir / 'data' / 'sum_train.jsonl'}]", "eval.files=[]",
                   f"train.out_dir={out_dir}", f"train.total_steps={args.steps}", f"algorithm.method={args.method}"]
        completed = subprocess.run(command, cwd=Path(__file__).parent, capture_output=True, text=True)
        if completed.returncode != 0:
            raise RuntimeError(completed.stderr[-3000:])
        steps = [json.loads(line) for line in (Path(out_dir) / "metrics.jsonl").read_text().splitlines()][1:]
    keys = ["time/rollout", "time/reward", "time/old_logprobs", "time/update", "time/sync", "time/step",
            "time/tokens_per_s"]
    result = {"method": args.method, "steps_averaged": len(steps), "threads": torch.get_num_threads(),
              "response_tokens_per_step": statistics.mean(s["train/tokens"] for s in steps)}
    result.update({key.replace("time/", "") + ("" if key.endswith("_per_s") else "_s"):
                   round(statistics.mean(s[key] for s in steps), 3) for key in keys})
    return result


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    memory = commands.add_parser("logprob-memory", help="peak memory of chunked vs naive log-probs/entropy")
    memory.add_argument("--tokens", type=int, default=4096)
    memory.add_argument("--vocab", type=int, default=151_936)  # Qwen2.5
    train_step = commands.add_parser("train-step", help="per-stage time of train.py on the tiny default")
    train_step.add_argument("--tiny", default="runs/tiny", help="the tiny default's directory (built if missing)")
    train_step.add_argument("--steps", type=int, default=6)
    train_step.add_argument("--method", default="stare")
    overhead = commands.add_parser("stare-overhead", help="time of the STARE loss vs the GRPO loss")
    overhead.add_argument("--tokens", type=int, default=2**20)
    overhead.add_argument("--repeats", type=int, default=15)
    for sub in (memory, overhead):
        sub.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    throughput = commands.add_parser("reward-throughput", help="responses per second of rewards.compute_rewards")
    throughput.add_argument("--responses", type=int, default=2000)
    args = parser.parse_args()
    run = {"logprob-memory": bench_logprob_memory, "stare-overhead": bench_stare_overhead,
           "reward-throughput": bench_reward_throughput, "train-step": bench_train_step}[args.command]
    print(json.dumps(run(args)))


if __name__ == "__main__":
    main()
