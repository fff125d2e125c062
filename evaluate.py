"""evaluate.py: score a checkpoint on math benchmarks with the training sampler and the training
verifier.

    python evaluate.py --model runs/x/hf --data data/aime24.jsonl data/math500.jsonl --out e.json
    torchrun --nproc_per_node 8 evaluate.py --model runs/x/hf --data data/*.jsonl --out e.json
    python evaluate.py --config configs/tiny.yaml eval.n=4 --model runs/tiny-stare/hf --out e.json
    python evaluate.py --model runs/tiny/model --data runs/tiny/data/sum_test.jsonl --out e.json \\
        --prompt-suffix "" --max-tokens 16 --max-prompt-tokens 64 --dtype float32  # CPU demo

Benchmark files are what data.load_examples reads (`python -m tools.benchmarks` converts the public
downloads); each file is one benchmark, named by its stem ("data/aime24.jsonl" -> "aime24").
Sampling is rollout.generate and scoring rewards.compute_rewards: exactly the code that trains, so
"correct" means here what it meant for the reward. Under torchrun the engines share each
benchmark's prompts (`evaluate`) and rank 0 prints and writes. train.py calls `evaluate` on its own
engine and logs `flatten_metrics(result)` ("eval/aime24/avg@n", "eval/overall/pass@1", ...).

Settings are config.py's keys, as for train.py: `--config` (else config.py's defaults, the paper's
validation settings; without --config also `load_config`'s engine settings), then the
`section.key=value` overrides, then the flags, short aliases of keys (`--top-p` is eval.top_p;
ALIASES). n comes from the benchmark's name (`default_n`). The metrics (avg@n with a bootstrap SE,
unbiased pass@k, maj@k, lengths and fractions) are defined in docs/usage.md ("Evaluation metrics").

Simplified relative to the reference (verl's validation): verl logs mean@n, best@k/worst@k and maj@k
from bootstrap resamples of the n responses; here pass@k is the closed-form unbiased estimator and
maj@k averages disjoint blocks, both deterministic. The verifier is rewards.py's (one extraction,
one checker), not the reference's heuristic extraction with three checkers: the one that trained the
model.
"""

import argparse
import json
import math
import re
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

import config
import data
import plan
import rewards
import rollout
import runs

# The paper's n per benchmark (avg@32 on the small competition sets, avg@4 on the larger ones),
# matched against the name lower-cased, letters and digits only ("MATH-500" -> "math500")
PAPER_N = (
    (r"aime(20)?24", 32), (r"aime(20)?25", 32), (r"amc(20)?23", 32), (r"math500", 4),
    (r"minerva", 4), (r"olympiad", 4))
# other benchmarks: by size
FALLBACK_SMALL_N, FALLBACK_LARGE_N, FALLBACK_SMALL_MAX_PROMPTS = 32, 4, 100
BOOTSTRAP_RESAMPLES = 1000


# ==================================================================================================
# Metrics: pure functions of counts, answers and texts
# ==================================================================================================


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples with c correct (docs/usage.md, "Evaluation metrics"), as the
    numerically stable product 1 - prod_{i=n-c+1}^{n} (1 - k/i) (no huge binomials)."""
    if not (0 <= c <= n and 1 <= k <= n):
        raise ValueError(f"need 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:  # every k-subset holds a correct sample
        return 1.0
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


def ks_for(n: int) -> list[int]:
    """The ks reported for n samples: 1, 2, 4, ... up to n, plus n itself."""
    ks = [2**i for i in range(n.bit_length()) if 2**i <= n]
    return ks + ([n] if ks[-1] != n else [])


def canonical_answer(text: str) -> str | None:
    """The vote key of a boxed answer; None when nothing is left. \\text{..} unwrapped, \\left
    \\right \\! \\, \\; \\: "\\ " ~ $ removed, \\dfrac/\\tfrac -> \\frac, degree marks dropped, all
    whitespace removed, a trailing period dropped, and plain numbers (integers, decimals, p/q,
    \\frac{p}{q}) replaced by their exact value, so 0.5, 1/2 and \\frac{1}{2} vote together.
    Grouping is by these strings, not by the verifier's notion of equality: spellings that
    canonicalise differently (\\sqrt3 and \\sqrt{3}) split their votes, so maj@k is a slight lower
    bound."""
    s = re.sub(r"\\(?:text|textbf|mathrm|mbox)\s*\{([^{}]*)\}", r"\1", text)
    s = re.sub(r"\\left|\\right|\\[,;:! ]|~|\$", "", s)
    s = re.sub(r"\\[dt]frac", r"\\frac", s)
    s = re.sub(r"\^\s*\{?\s*\\circ\s*\}?", "", s)
    s = "".join(s.split()).rstrip(".")
    # the verifier's own reader of plain numbers (exact: 0.5 == 1/2)
    value = rewards._plain_number(s)
    return (s or None) if value is None else str(value)


def answer_key(response: str, data_source: str) -> str | None:
    """The answer a response votes for: its last \\boxed{} canonicalised; None (abstain) without
    one."""
    boxed = rewards.extract_boxed(response) if isinstance(response, str) else None
    if boxed is None:
        return None
    if data_source == rewards.SUM_TASK_SOURCE:  # "a+b": the decomposition itself is the answer
        return "".join(boxed.split()) or None
    return canonical_answer(boxed)


def majority_vote(keys, correct) -> float:
    """Score of one vote: 0 without votes; else the mean correctness over the tied most frequent
    keys (the expectation under a random tie-break), each key judged by its first sample's
    verdict."""
    counts, verdict = {}, {}
    for key, ok in zip(keys, correct):
        if key is None:
            continue
        counts[key] = counts.get(key, 0) + 1
        verdict.setdefault(key, float(ok))
    if not counts:
        return 0.0
    top = max(counts.values())
    winners = [key for key, count in counts.items() if count == top]
    return sum(verdict[key] for key in winners) / len(winners)


def maj_at_k(keys, correct, k: int) -> float:
    """maj@k of one prompt: the mean vote score over the len(keys) // k disjoint blocks of k
    samples, in order. Samples are i.i.d., so every block is a draw of maj@k; k = n is one vote.
    With the expected tie-break of `majority_vote`, maj@1 and maj@2 both equal avg@n unless samples
    abstain."""
    if not 1 <= k <= len(keys):
        raise ValueError(f"need 1 <= k <= {len(keys)}, got k={k}")
    blocks = len(keys) // k
    return sum(majority_vote(keys[b * k:(b + 1) * k], correct[b * k:(b + 1) * k])
               for b in range(blocks)) / blocks


def bootstrap_se(values, resamples: int = BOOTSTRAP_RESAMPLES, seed: int = 0) -> float:
    """Bootstrap standard error of the mean of `values` (resampled with replacement, seeded): the
    ddof=1 standard deviation of `resamples` resampled means. 0.0 for fewer than two values."""
    values = np.asarray(values, dtype=np.float64)
    if len(values) < 2:
        return 0.0
    rng = np.random.default_rng(seed)
    # [resamples]
    means = values[rng.integers(0, len(values), size=(resamples, len(values)))].mean(axis=1)
    return float(means.std(ddof=1))


def default_n(name: str, num_prompts: int) -> int:
    """The paper's n for a benchmark PAPER_N recognises (aime2024, AIME_2025, minerva_math, ...),
    else the rule behind it (small sets need more samples for a stable average): FALLBACK_SMALL_N
    up to FALLBACK_SMALL_MAX_PROMPTS prompts, FALLBACK_LARGE_N above."""
    key = re.sub(r"[^a-z0-9]", "", name.lower())
    for pattern, n in PAPER_N:
        if re.search(pattern, key):
            return n
    return FALLBACK_SMALL_N if num_prompts <= FALLBACK_SMALL_MAX_PROMPTS else FALLBACK_LARGE_N


def prompt_seed(seed: int, benchmark: str, index: int) -> int:
    """The sampling seed of a benchmark's index-th prompt: independent of ranks and of the other
    benchmarks, and the same at every evaluation of a run, so step-to-step differences are the
    model's (on GPU, batch composition can still change kernels' rounding). rollout.generate spaces
    it by n for vLLM's per-sample seed + j."""
    return data.derive_seed(seed, "eval", benchmark, index)


# ==================================================================================================
# Evaluation on a built engine (single process or one share per rank)
# ==================================================================================================


def load_benchmarks(files, prompt_suffix=data.STARE_SUFFIX, limit=None) -> dict:
    """{file stem: [data.Example]} in the given order; `limit` keeps the first N prompts of each.
    Two files with the same stem are an error (their results would share a name)."""
    benchmarks = {}
    for path in files:
        name = Path(path).stem
        if name in benchmarks:
            raise ValueError(
                f"{path}: a benchmark named {name!r} was already given (names are file stems)")
        examples = data.load_examples(path, prompt_suffix=prompt_suffix or None)
        benchmarks[name] = examples[:limit] if limit else examples
    return benchmarks


def _prompt_record(name, index, example, texts, lengths, finish_reasons, accuracies, ks,
                   return_samples):
    """Everything the aggregate needs from one prompt's n samples (small: what ranks exchange)."""
    n = len(texts)
    keys = [answer_key(text, example.data_source) for text in texts]
    correct = [bool(a) for a in accuracies]
    hits_words = [rewards.reflection_counts(text) for text in texts]
    record = {
        "benchmark": name, "index": index, "correct": sum(correct),
        "pass": [pass_at_k(n, sum(correct), k) for k in ks],
        "maj": [maj_at_k(keys, correct, k) for k in ks],
        "length_sum": sum(lengths), "length_max": max(lengths, default=0),
        "truncated": sum(reason == "length" for reason in finish_reasons),
        "no_answer": sum(key is None for key in keys),
        "reflections": sum(h for h, _ in hits_words), "words": sum(w for _, w in hits_words)}
    if return_samples:
        record["samples"] = [
            {"benchmark": name, "index": index, "sample": j, "origin": example.origin,
             "ground_truth": example.ground_truth, "prompt": example.messages[-1]["content"],
             "response": texts[j], "answer": keys[j], "correct": correct[j],
             "length": lengths[j], "finish_reason": finish_reasons[j]}
            for j in range(n)]
    return record


def _aggregate(records, n, ks, prompt_stats, bootstrap_seed):
    """One benchmark's metrics from its prompt records (docs/usage.md, "Evaluation metrics")."""
    num = len(records)
    samples = num * n
    accuracy = [r["correct"] / n for r in records]
    metrics = {"n": n, "prompts": num, "avg@n": sum(accuracy) / num,
               "avg@n_se": bootstrap_se(accuracy, seed=bootstrap_seed)}
    for kind in ("pass", "maj"):
        metrics.update({f"{kind}@{k}": sum(r[kind][j] for r in records) / num
                        for j, k in enumerate(ks)})
    words = sum(r["words"] for r in records)
    metrics.update({
        "response_length_mean": sum(r["length_sum"] for r in records) / samples,
        "response_length_max": max(r["length_max"] for r in records),
        "truncated_frac": sum(r["truncated"] for r in records) / samples,
        "no_answer_frac": sum(r["no_answer"] for r in records) / samples,
        "reflection_per_1k_words":
            1000.0 * sum(r["reflections"] for r in records) / words if words else 0.0,
        "prompts_truncated": prompt_stats["num_truncated"],
        "prompts_skipped": prompt_stats["num_skipped"]})
    return metrics


def _overall(per_benchmark):
    """Unweighted mean over benchmarks; SE of that mean; common ks only; summed counts; maxima."""
    values = list(per_benchmark.values())
    count = len(values)

    def mean(key):
        return sum(v[key] for v in values) / count

    overall = {"benchmarks": count, "prompts": sum(v["prompts"] for v in values),
               "avg@n": mean("avg@n"),
               "avg@n_se": math.sqrt(sum(v["avg@n_se"] ** 2 for v in values)) / count}
    common = [key for key in values[0]
              if key.startswith(("pass@", "maj@")) and all(key in v for v in values)]
    means = ("response_length_mean", "truncated_frac", "no_answer_frac", "reflection_per_1k_words")
    overall.update({key: mean(key) for key in common + list(means)})
    overall["response_length_max"] = max(v["response_length_max"] for v in values)
    return overall


def evaluate(engine, tokenizer, benchmarks, cfg, return_samples=False, use_tqdm=False):
    """Sample and score every benchmark on an already built engine -> the result dict (its keys:
    docs/usage.md, "Evaluation metrics"). benchmarks: {name: [data.Example]} (load_benchmarks);
    cfg.eval.n None: `default_n` of each. The engine's max_model_len must be >= max_prompt_tokens +
    max_tokens. Under an initialised torch.distributed group every rank must call this with the
    same arguments: each engine (the tensor_parallel_size consecutive ranks that share one) samples
    prompts e, e + engines, ... of each benchmark, the per-prompt records are all-gathered, and
    every rank returns the same full result. return_samples: also result["samples"], the responses
    as dicts in benchmark, prompt, sample order."""
    if not benchmarks:
        raise ValueError("no benchmarks to evaluate")
    distributed = dist.is_available() and dist.is_initialized()
    rank, world = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)
    tp, n, overflow = cfg.rollout.tensor_parallel_size, cfg.eval.n, cfg.data.overflow
    started = time.time()
    ns, kss, stats, records = {}, {}, {}, []
    for name, examples in benchmarks.items():
        prompt_ids, kept, stats[name] = data.tokenize_prompts(
            examples, tokenizer, cfg.data.max_prompt_tokens, overflow)
        if not kept:
            raise ValueError(
                f"benchmark {name!r}: no prompt left after tokenization (overflow={overflow!r})")
        ns[name] = default_n(name, len(kept)) if n is None else n
        if ns[name] < 1:
            raise ValueError(f"benchmark {name!r}: n must be >= 1, got {ns[name]}")
        kss[name] = ks_for(ns[name])
        mine = list(range(rank // tp, len(kept), world // tp))
        if mine:  # else more ranks than prompts: this rank only joins the gather
            records += _share_records(engine, name, [prompt_ids[i] for i in mine],
                                      [(i, kept[i]) for i in mine], ns[name], kss[name], cfg,
                                      return_samples, use_tqdm)
    # through host memory (runs.all_gather); the first rank of each engine sends its records
    records = [r for rank_records in runs.all_gather(records if rank % tp == 0 else [])
               for r in rank_records]
    order = {name: position for position, name in enumerate(benchmarks)}
    records.sort(key=lambda r: (order[r["benchmark"]], r["index"]))
    per_benchmark = {
        name: _aggregate([r for r in records if r["benchmark"] == name], ns[name], kss[name],
                         stats[name], cfg.train.seed)
        for name in benchmarks}
    sampling = {
        "n": ns, "temperature": cfg.eval.temperature, "top_p": cfg.eval.top_p, "top_k": 0,
        "max_tokens": cfg.eval.max_tokens, "max_prompt_tokens": cfg.data.max_prompt_tokens,
        "overflow": overflow, "seed": cfg.train.seed, "answer_format": cfg.reward.answer_format,
        "world_size": world}
    result = {"sampling": sampling, "benchmarks": per_benchmark, "overall": _overall(per_benchmark),
              "seconds": time.time() - started}
    if return_samples:
        result["samples"] = [sample for r in records for sample in r["samples"]]
    return result


def _share_records(engine, name, prompt_ids, examples, n, ks, cfg, return_samples, use_tqdm):
    """This engine's share of one benchmark, sampled and scored -> one `_prompt_record` per prompt.
    examples: (index in the benchmark, data.Example) per prompt of prompt_ids."""
    out = rollout.generate(
        engine, prompt_ids, n=n, temperature=cfg.eval.temperature, top_p=cfg.eval.top_p, top_k=0,
        max_tokens=cfg.eval.max_tokens,
        seeds=[prompt_seed(cfg.train.seed, name, i) for i, _ in examples], use_tqdm=use_tqdm)
    example_of = [examples[p][1] for p in out.prompt_index]
    _, accuracies, _ = rewards.compute_rewards(
        out.texts, [e.ground_truth for e in example_of], [e.data_source for e in example_of],
        out.lengths, cfg.reward)
    # prompt-major: prompt j's samples are rows j*n ... j*n + n - 1
    rows = [slice(j * n, (j + 1) * n) for j in range(len(examples))]
    return [_prompt_record(name, i, example, out.texts[r], out.lengths[r], out.finish_reasons[r],
                           accuracies[r], ks, return_samples)
            for (i, example), r in zip(examples, rows)]


def flatten_metrics(result, prefix="eval") -> dict:
    """{"eval/<benchmark>/<metric>": value} for every numeric metric of every benchmark and of
    "overall", for a metrics.jsonl line: eval/aime24/avg@n, eval/aime24/pass@32, eval/overall/avg@n,
    ..."""
    flat = {}
    for name, metrics in [*result["benchmarks"].items(), ("overall", result["overall"])]:
        for key, value in metrics.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                flat[f"{prefix}/{name}/{key}"] = value
    return flat


# ==================================================================================================
# Command line: the console table, the arguments, main
# ==================================================================================================


def format_table(result) -> str:
    """Two plain-text tables: the headline metrics per benchmark, then pass@k and maj@k by k
    (accuracies in %)."""
    rows = [*result["benchmarks"].items(), ("overall", result["overall"])]
    width = max(12, *(len(name) for name, _ in rows)) + 2

    def pct(value):
        return f"{100 * value:.1f}" if value is not None else "-"

    head = (
        f"{'benchmark':<{width}}{'n':>4}{'prompts':>9}{'avg@n%':>8}{'±se':>6}{'pass@n%':>9}{'maj@n%':>8}"
        f"{'len mean':>10}{'len max':>9}{'trunc%':>8}{'refl/1kw':>10}")
    lines = [head, "-" * len(head)]
    for name, m in rows:
        n = m.get("n")
        top = f"@{n}" if n else ""
        lines.append(
            f"{name:<{width}}{n if n else '-':>4}{m['prompts']:>9}{pct(m['avg@n']):>8}"
            f"{pct(m['avg@n_se']):>6}{pct(m.get('pass' + top)):>9}{pct(m.get('maj' + top)):>8}"
            f"{m['response_length_mean']:>10.1f}{m['response_length_max']:>9}{pct(m['truncated_frac']):>8}"
            f"{m['reflection_per_1k_words']:>10.2f}")
    ks = sorted({int(key[5:]) for _, m in rows for key in m if key.startswith("pass@")})
    head = f"{'k':<{width + 8}}" + "".join(f"{k:>7}" for k in ks)
    lines += ["", head, "-" * len(head)]
    for name, m in rows:
        for kind in ("pass", "maj"):
            label = f"{name if kind == 'pass' else '':<{width}}{kind + '@k%':<8}"
            lines.append(label + "".join(f"{pct(m.get(f'{kind}@{k}')):>7}" for k in ks))
    return "\n".join(lines)


# The flags that are config keys, as short aliases: `--top-p 0.5` is the override `eval.top_p=0.5`,
# applied after the positional ones; a flag not given overrides nothing.
ALIASES = (
    ("--model", "model.path", {}), ("--data", "eval.files", {"nargs": "+"}),
    ("--n", "eval.n", {"type": int}), ("--temperature", "eval.temperature", {"type": float}),
    ("--top-p", "eval.top_p", {"type": float}), ("--max-tokens", "eval.max_tokens", {"type": int}),
    ("--max-prompt-tokens", "data.max_prompt_tokens", {"type": int}),
    ("--overflow", "data.overflow", {}), ("--prompt-suffix", "data.prompt_suffix", {}),
    ("--answer-format", "reward.answer_format", {}), ("--seed", "train.seed", {"type": int}),
    ("--dtype", "rollout.dtype", {}), ("--kv-cache-gib", "rollout.kv_cache_gib", {"type": float}),
    ("--gpu-memory-utilization", "rollout.gpu_memory_utilization", {"type": float}),
    ("--max-num-seqs", "rollout.max_num_seqs", {"type": int}),
    ("--enforce-eager", "rollout.enforce_eager",
     {"action": "store_const", "const": True, "help": "rollout.enforce_eager=true"}))


def parse_args(argv):
    parser = argparse.ArgumentParser(
        description="avg@n, pass@k, maj@k of a checkpoint on benchmark files "
        '(definitions: docs/usage.md, "Evaluation metrics"). Settings are config.py\'s keys.')
    parser.add_argument("--config", help="a YAML config (default: config.py's defaults)")
    parser.add_argument("overrides", nargs="*", metavar="section.key=value",
                        help="as for train.py (not right after --data: its files)")
    for flag, key, kwargs in ALIASES:
        parser.add_argument(flag, dest=key, **kwargs)
    parser.add_argument("--out", required=True, help="results JSON")
    parser.add_argument("--samples", default=None, help="also write every response here (JSONL)")
    parser.add_argument(
        "--limit", type=int, default=0, help="first N prompts of each benchmark (0 = all)")
    return parser.parse_intermixed_args(argv)


def load_config(args):
    """The checked config.Config of a command line: --config, the positional overrides, then the
    flags given (config.ConfigError naming the key). Without --config, the flags' defaults from
    before they were aliases come first where config.py's differ (its rollout section is a training
    engine's, which leaves the GPU to the trainer; enforce_eager on CPU only)."""
    on_cpu = not torch.cuda.is_available()
    base = [] if args.config else [
        "rollout.gpu_memory_utilization=0.9", f"rollout.enforce_eager={str(on_cpu).lower()}"] + (
        [f"rollout.kv_cache_gib={rollout.CPU_KV_CACHE_GIB}"] if on_cpu else [])
    flags = [f"{key}={json.dumps(vars(args)[key], ensure_ascii=False)}"  # exact: quoted strings
             for _, key, _ in ALIASES if vars(args)[key] is not None]
    return config.load(args.config, base + args.overrides + flags)


def main(argv):
    from transformers import AutoTokenizer

    args = parse_args(argv)
    # errors name what the user typed: the flag, or the config key
    model_key = "--model" if vars(args)["model.path"] else "model.path"
    data_key = "--data" if vars(args)["eval.files"] else "eval.files"
    try:  # every value, path and file, before any engine start-up
        cfg = load_config(args)
        if args.limit < 0:
            raise config.ConfigError(f"--limit must be >= 0 (0 = all), got {args.limit}")
        if not cfg.eval.files:
            raise config.ConfigError("config key 'eval.files' (--data): no benchmark file given")
        config.check_model_path(cfg.model.path, key=model_key)
        config.check_write_limit(cfg.model.path)
        config.check_context(cfg.model.path, cfg.data.max_prompt_tokens + cfg.eval.max_tokens,
                             "data.max_prompt_tokens + eval.max_tokens")
        config.check_files(cfg.eval.files, data_key)
        config.check_outputs(
            [(option, path, "file") for option, path in (("--out", args.out),
                                                          ("--samples", args.samples)) if path],
            [(model_key, cfg.model.path)] + [("--config", p) for p in [args.config] if p]
            + [(f"{data_key}[{i}]", p) for i, p in enumerate(cfg.eval.files)])
        benchmarks = load_benchmarks(cfg.eval.files, cfg.data.prompt_suffix, args.limit)
    except (config.ConfigError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    problem = plan.no_cuda_problem(cfg, args.config or "this command line")
    if problem:  # or the engine takes the CPU path and fails later, inside vLLM
        print(problem, file=sys.stderr)
        return 2
    # the run's plumbing: a process group of one without torchrun; collectives wait
    # train.nccl_timeout_minutes (the engines' shares of the prompts differ)
    rank, _, _ = runs.setup_distributed(cfg.train.nccl_timeout_minutes)
    tokenizer = AutoTokenizer.from_pretrained(cfg.model.path)
    # one seed per engine, shared by its ranks, as in train.py
    engine = rollout.build_engine(
        cfg.rollout, cfg.model.path, seed=cfg.train.seed + rank // cfg.rollout.tensor_parallel_size,
        max_model_len=cfg.data.max_prompt_tokens + cfg.eval.max_tokens)
    runs.align_timeouts()
    result = evaluate(engine, tokenizer, benchmarks, cfg, return_samples=args.samples is not None,
                      use_tqdm=rank == 0)
    if rank == 0:
        samples = result.pop("samples", None)
        result["sampling"].update(prompt_suffix=cfg.data.prompt_suffix or None,
                                  dtype=cfg.rollout.dtype, limit=args.limit or None)
        result = {"model": str(cfg.model.path),
                  "data": {Path(p).stem: str(p) for p in cfg.eval.files}, **result}
        print(format_table(result))
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {out}")
        if samples is not None:
            path = Path(args.samples)
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text("".join(json.dumps(sample, ensure_ascii=False) + "\n"
                                    for sample in samples), encoding="utf-8")
            print(f"wrote {path} ({len(samples)} responses)")
    # with external_launcher this also tears down the process group (rollout.py)
    rollout.shutdown_engine(engine)
    if dist.is_initialized():
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":  # vLLM may spawn processes: the entry point must be guarded
    runs.exit_process(main(sys.argv[1:]))
