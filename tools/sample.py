"""tools/sample.py: a demo of the rollout engine. Load prompts, sample n responses each with vLLM
(rollout.generate, or tool_use.generate_with_tools with --max-turns), score them with the training
verifier, print samples and metrics (JSON).

    python -m tools.sample --model runs/tiny/model --data runs/tiny/data/sum_test.jsonl \\
        --prompt-suffix ""
    python -m tools.sample --model runs/tiny/tool_model --data runs/tiny/data/mul_test.jsonl \\
        --prompt-suffix "" --max-turns 3 --max-tokens 400 \\
        --max-prompt-tokens 64   # tools/tiny.py --tool
"""

import argparse
import json
import time

import config
import data
import rewards
import rollout
import tool_use


def parse_args(argv):
    parser = argparse.ArgumentParser(
        description="Sample and score responses with the local vLLM engine.")
    parser.add_argument("--model", required=True, help="local HF checkpoint directory")
    parser.add_argument(
        "--data", required=True, help="prompt set: .jsonl or .parquet (see data.py)")
    parser.add_argument(
        "--prompt-suffix", default=data.STARE_SUFFIX, help='appended to plain rows; "" for none')
    parser.add_argument("--n", type=int, default=4, help="responses per prompt")
    parser.add_argument("--limit", type=int, default=16, help="first N prompts only (0 = all)")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--max-prompt-tokens", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument(
        "--kv-cache-gib", type=float, default=None, help="KV cache size; needed on CPU")
    parser.add_argument(
        "--max-turns", type=int, default=0, help="> 0: tool use (code interpreter) with up to this "
        "many model turns, max-tokens counting model and tool tokens; 0: plain sampling")
    return parser.parse_args(argv)


def main(argv=None):
    from transformers import AutoTokenizer

    args = parse_args(argv)
    examples = data.load_examples(args.data, prompt_suffix=args.prompt_suffix or None)
    examples = examples[:args.limit] if args.limit else examples
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    prompt_ids, kept, prompt_stats = data.tokenize_prompts(
        examples, tokenizer, args.max_prompt_tokens)
    # enforce_eager None: on CPU only (rollout.build_engine)
    rollout_cfg = config.RolloutConfig(
        n=args.n, temperature=args.temperature, max_tokens=args.max_tokens,
        max_turns=args.max_turns, dtype=args.dtype, kv_cache_gib=args.kv_cache_gib,
        enforce_eager=None)
    engine = rollout.build_engine(rollout_cfg, args.model, seed=args.seed,
                                  max_model_len=args.max_prompt_tokens + args.max_tokens)
    start = time.time()
    seeds = [data.derive_seed(args.seed, "prompt", i) for i in range(len(prompt_ids))]
    if args.max_turns > 0:
        out = tool_use.generate_with_tools(engine, tokenizer, prompt_ids, seeds, rollout_cfg,
                                           config.SandboxConfig())
        print("\n\n".join(f"--- {reason}, {calls} call(s):\n{text}" for text, reason, calls in
                          zip(out.full_texts[:4], out.finish_reasons, out.num_calls)))
    else:
        out = rollout.generate(
            engine, prompt_ids, n=args.n, temperature=args.temperature, max_tokens=args.max_tokens,
            seeds=seeds, use_tqdm=True)
    seconds = time.time() - start
    truths = [kept[i].ground_truth for i in out.prompt_index]
    scores, accuracies, metrics = rewards.compute_rewards(
        out.texts, truths, [kept[i].data_source for i in out.prompt_index], out.lengths,
        config.RewardConfig())
    for i in range(0, len(out.texts), args.n):
        print(f"[{kept[out.prompt_index[i]].origin}] answer {truths[i]}: " + " | ".join(
            f"{text!r}={acc:g}"
            for text, acc in zip(out.texts[i : i + args.n], accuracies[i : i + args.n])))
    metrics.update({
        "rollout/responses": len(out.texts),
        "rollout/response_length_mean": sum(out.lengths) / max(len(out.lengths), 1),
        "rollout/truncated_frac": out.finish_reasons.count("length") / max(len(out.texts), 1),
        "rollout/tokens_per_s": sum(out.lengths) / seconds,
        "prompts/truncated": prompt_stats["num_truncated"],
        "prompts/skipped": prompt_stats["num_skipped"],
    })
    if args.max_turns > 0:
        metrics.update(tool_use.tool_metrics(tool_use.tool_sums(out)))
        metrics["rollout/tool_turns_mean"] = sum(out.num_turns) / max(len(out.texts), 1)
    print(json.dumps({key: round(value, 4) if isinstance(value, float) else value
                      for key, value in metrics.items()}))


if __name__ == "__main__":  # vLLM may spawn processes: the entry point must be guarded
    main()
