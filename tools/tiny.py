"""tools/tiny.py: the offline tiny default: a tokenizer, a tiny Qwen2 model and two verifiable
tasks, made from nothing.

    python -m tools.tiny --out runs/tiny          # reuses the directory when it is complete
    python -m tools.tiny --out runs/tiny --tool   # + the tool-use variant (the default first if missing)
    python -m tools.tiny --out runs/tiny --countdown   # + the countdown variant (likewise)
    python -m tools.tiny --out runs/tiny --data-only   # the tasks' data files only: no model is built or trained
    python -m tools.tiny --out runs/ref --tool --countdown --from-scratch   # train all three here (~20 min)

Nothing here downloads anything. It writes:

    runs/tiny/model/          a Qwen2-architecture causal LM (2 layers, hidden 128, 2 heads of head_dim 64: vLLM's CPU
                              attention rejects smaller heads), float32, with a character-level tokenizer and a
                              Qwen-style chat template; loadable by transformers and by vLLM like any HF checkpoint
    runs/tiny/data/sum_{train,test}.jsonl    "Write N as a+b with a, b > 0." for N in 10..29 (4 N held
                                             out for test). Many correct answers per prompt (\\boxed{a+b} for
                                             any a + b = N), checked by rewards.verify_sum ("tiny_sum").
    runs/tiny/data/add_{train,test}.jsonl    "What is a+b?" for a, b in 1..15. One correct answer, checked
                                             by math-verify ("tiny_add").
    runs/tiny/tiny.json       what was built: sizes, warm-up loss, sampled success rate at temperature 1

and, with --tool (build_tiny_tool), the tool-use variant next to it, leaving the files above as they
are:

    runs/tiny/data/mul_{train,test}.jsonl    "What is a*b?" for a 3-digit a and a 2-digit b (512 / 64 prompts),
                                             checked by math-verify ("tiny_mul"): too long to do in one's head
    runs/tiny/tool_model/     the tiny model after 300 more warm-up steps on code-interpreter conversations in the
                              rollout's own format (tool_use.QWEN_TOOL_TURN): 20% answer at once, 60% call
                              print(a*b) and copy the output into \\boxed{}, 20% check with print(b*a) before answering
    runs/tiny/tool.json       what was built, with the first turns' call rates at temperature 1 (~70% make a valid
                              call; the copied digits are mostly wrong: copying a*b into the code is what RL can
                              then teach, the answer being the program's output)

and, with --countdown (build_tiny_countdown), a search task next to it:

    runs/tiny/data/countdown_{train,test,fresh}.jsonl   "Make T from a b c." for digits 1..9 and T in 10..99
                              reachable as a?b?c in some order with + - * (no parentheses); 1-8 solutions per prompt,
                              checked by rewards.verify_countdown ("tiny_countdown"). The 64 test prompts (split A)
                              and the 64 fresh ones (split B) use digit triples that no training prompt has.
    runs/tiny/countdown_model/  the tiny model after 1,500 warm-up steps on random solutions of the training prompts:
                              ~10% of samples solve a train or test prompt at temperature 1, and 64 samples solve
                              ~94% of test prompts; what RL can add is finding the combination more often
    runs/tiny/countdown.json  what was built, with those success rates

Why the "sum" task: with a unique answer, entropy must fall as accuracy rises, so no method can show
an exploration effect. With many correct answers, plain GRPO tends to collapse onto a few of them,
while an entropy-stabilising method keeps them diverse, which a tiny run can show. A short
supervised warm-up on random correct answers puts the model where RL has something to learn:
sampling at temperature 1 it answers ~15% of sum prompts and ~40% of add prompts correctly (exact
arithmetic is what a 0.5M-parameter model learns slowly; the numbers are kept small so that a minute
of training gets there).

Reproducible bytes: every build runs under BUILD_ENV (one thread, ATen's AVX2 kernels, MKL's
COMPATIBLE branch; in a child process when the caller was not started under it), so that the same
code builds the same model.safetensors on one machine whatever its thread count or kernels; another
CPU builds other bytes (measured: docs/results.md, "Which model a result came from"). tiny.json,
countdown.json and tool.json record its sha256 (model_sha256) and the CPU that built it,
tools/tiny.py prints it, and a default build that is not REFERENCE_SHA256 says why: another CPU
than REFERENCE_CPU (a fact, one line) or a change (a warning). The three models trained with the
default settings are committed (assets/tiny/: 2 MB each, with their builds' summaries), so that a
default build copies them and checks their sha256 in seconds instead of training for minutes;
--from-scratch trains them here.

The prompts go through data.py exactly as a user's data would (plain {"problem", "answer"} rows and
the chat template), so the warm-up trains on the very token sequences the trainer will later sample
from. They carry no STARE suffix (load with prompt_suffix=None): on a CPU every prompt token costs
time, and the tiny model cannot read.
"""

import argparse
import contextlib
import hashlib
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import torch

import data

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# Qwen's chat template, reduced to what the tasks use (system messages pass through like any other
# role)
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
MODEL_SIZE = dict(
    hidden_size=128, intermediate_size=384, num_hidden_layers=2, num_attention_heads=2,
    num_key_value_heads=2, head_dim=64, max_position_embeddings=512)


def build_tokenizer():
    """A byte-level BPE tokenizer with no merges, i.e. one token per byte (256) plus Qwen's three
    special tokens.

    Why this shape: transformers 5 loads any checkpoint whose config says model_type "qwen2" with
    Qwen2Tokenizer, which rebuilds Qwen's own pipeline (regex split + byte-level mapping) around the
    saved vocabulary and merges. A byte-level vocabulary without merges is character-level under
    that pipeline, so the tokenizer built here, the one transformers loads and the one vLLM loads
    all produce the same ids (tests/test_tiny.py checks it).
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    # 256 printable stand-ins for the bytes
    byte_alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS + byte_alphabet)}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, eos_token="<|im_end|>", pad_token="<|endoftext|>",
        additional_special_tokens=SPECIAL_TOKENS)
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def build_model(tokenizer, seed=0):
    """A freshly initialised tiny Qwen2 (float32), with the tokenizer's special ids in its config."""
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    # padded like real checkpoints (Qwen2.5: 151,936 rows)
    vocab_size = 64 * ((len(tokenizer) + 63) // 64)
    eos_id, pad_id = tokenizer.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])
    config = Qwen2Config(
        vocab_size=vocab_size, bos_token_id=pad_id, eos_token_id=eos_id, pad_token_id=pad_id,
        tie_word_embeddings=False, dtype="float32", **MODEL_SIZE)
    model = Qwen2ForCausalLM(config)
    model.generation_config = GenerationConfig(
        eos_token_id=eos_id, pad_token_id=pad_id, bos_token_id=pad_id)
    return model


# --------------------------------------------------------------------------------------------------
# The tasks
# --------------------------------------------------------------------------------------------------


def sum_task_rows(numbers):
    return [
        {"problem": f"Write {n} as a+b with a, b > 0.", "answer": str(n), "data_source": "tiny_sum"}
        for n in numbers]


def add_task_rows(pairs):
    return [
        {"problem": f"What is {a}+{b}?", "answer": str(a + b), "data_source": "tiny_add"}
        for a, b in pairs]


def warmup_response(row, rng):
    """A correct answer for the warm-up: a random split a + b = N with a single-digit a (sum task;
    two-digit subtraction is beyond a model this small in a minute of training, and 9 answers per
    prompt are plenty to see diversity collapse or survive), or the sum itself (add task). Any a + b
    = N scores 1 later."""
    n = int(row["answer"])
    if row["data_source"] == "tiny_sum":
        a = rng.randint(1, 9)
        return f"\\boxed{{{a}+{n - a}}}"
    return f"\\boxed{{{n}}}"


def make_splits(seed=0, num_test=64):
    """Deterministic train/test splits of both tasks; test prompts never appear in train."""
    rng = random.Random(seed)
    numbers = list(range(10, 30))
    rng.shuffle(numbers)
    sum_test, sum_train = sorted(numbers[:4]), numbers[4:]
    pairs = [(a, b) for a in range(1, 16) for b in range(1, 16)]
    rng.shuffle(pairs)
    add_test, add_train = pairs[:num_test // 2], pairs[num_test // 2:]
    return {
        "sum_train": sum_task_rows(sum_train),
        "sum_test": sum_task_rows(sum_test),
        "add_train": add_task_rows(add_train),
        "add_test": add_task_rows(add_test),
    }


# --------------------------------------------------------------------------------------------------
# Supervised warm-up
# --------------------------------------------------------------------------------------------------


def load_split(data_dir, name, tokenizer):
    """A split as the trainer sees it: (rows as dicts, prompt token ids)."""
    examples = data.load_examples(Path(data_dir) / f"{name}.jsonl", prompt_suffix=None)
    prompt_ids, _, _ = data.tokenize_prompts(
        examples, tokenizer, max_prompt_tokens=512, overflow="error")
    rows = [
        {
            "answer": e.ground_truth,
            "data_source": e.data_source,
            "problem": e.messages[-1]["content"],
        }
        for e in examples]
    return rows, prompt_ids


def answer_sequence(tokenizer, prompt_ids, response):
    """(ids, labels) of prompt + response + EOS, the loss on the response and EOS only."""
    response_ids = tokenizer.encode(response, add_special_tokens=False) + [tokenizer.eos_token_id]
    return prompt_ids + response_ids, [-100] * len(prompt_ids) + response_ids


def warmup(
    model, tokenizer, rows, prompt_ids, steps, batch_size=32, lr=3e-3, seed=0, sequence=None):
    """Teacher-force random correct responses after each prompt (loss on response tokens only).
    Returns the mean loss of the last 50 steps. sequence(i, rng) -> (ids, labels) makes one training
    sequence for row i; the default is prompt + a random correct answer (warmup_response) + EOS."""
    if sequence is None:
        sequence = lambda i, rng: answer_sequence(
            tokenizer, prompt_ids[i], warmup_response(rows[i], rng)
        )  # noqa: E731
    rng = random.Random(seed)
    by_task = {}
    for i, row in enumerate(rows):
        by_task.setdefault(row["data_source"], []).append(i)
    tasks = sorted(by_task)
    pad_id = tokenizer.pad_token_id
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / 50) * (1 - s / steps))
    model.train()
    recent = []
    for step in range(steps):
        # the tasks in equal shares
        batch = [rng.choice(by_task[rng.choice(tasks)]) for _ in range(batch_size)]
        sequences, labels = [], []
        for i in batch:
            ids, label_ids = sequence(i, rng)
            sequences.append(ids)
            labels.append(label_ids)
        width = max(map(len, sequences))
        input_ids = torch.tensor([s + [pad_id] * (width - len(s)) for s in sequences])
        label_ids = torch.tensor([s + [-100] * (width - len(s)) for s in labels])
        attention = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in sequences])
        loss = model(input_ids=input_ids, attention_mask=attention, labels=label_ids).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        recent = (recent + [loss.item()])[-50:]
    model.eval()
    return sum(recent) / len(recent)


@torch.no_grad()
def sample_responses(model, tokenizer, prompt_ids, temperature, max_new_tokens, seed):
    """One sampled response per prompt (HF generate, left-padded batch, seeded), decoded without special tokens."""
    torch.manual_seed(seed)
    width = max(map(len, prompt_ids))
    pad_id = tokenizer.pad_token_id
    # left padding for generate
    input_ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompt_ids])
    attention = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompt_ids])
    output = model.generate(
        input_ids=input_ids, attention_mask=attention, do_sample=True, temperature=temperature,
        top_k=0, top_p=1.0, max_new_tokens=max_new_tokens)
    return tokenizer.batch_decode(output[:, width:], skip_special_tokens=True)


@torch.no_grad()
def sampled_success_rate(model, tokenizer, rows, prompt_ids, temperature=1.0, max_new_tokens=16,
                         seed=0):
    """Fraction of prompts whose sampled response (HF generate, temperature 1) the task's verifier accepts."""
    import config
    import rewards

    responses = sample_responses(model, tokenizer, prompt_ids, temperature, max_new_tokens, seed)
    _, accuracies, _ = rewards.compute_rewards(responses, [r["answer"] for r in rows],
                                               [r["data_source"] for r in rows], [0] * len(rows),
                                               config.RewardConfig())
    return sum(accuracies) / len(accuracies), responses


# --------------------------------------------------------------------------------------------------
# The tool-use variant: multiplication, which the tiny model cannot do in its head but can hand to
# the interpreter
# --------------------------------------------------------------------------------------------------

MUL_SOURCE = "tiny_mul"
# the warm-up's mix of conversation shapes
TOOL_SHAPES = {"direct": 0.2, "one_call": 0.6, "two_calls": 0.2}


def mul_task_rows(pairs):
    return [
        {"problem": f"What is {a}*{b}?", "answer": str(a * b), "data_source": MUL_SOURCE}
        for a, b in pairs]


def make_tool_splits(seed=0, num_train=512, num_test=64):
    """Deterministic, disjoint train/test splits of "What is a*b?" with a 3-digit a and a 2-digit b."""
    rng = random.Random(seed)
    pairs = rng.sample(
        [(a, b) for a in range(100, 1000) for b in range(10, 100)], num_train + num_test)
    return {
        "mul_train": mul_task_rows(pairs[num_test:]),
        "mul_test": mul_task_rows(sorted(pairs[:num_test])),
    }


def tool_call_text(code):
    """A call as Qwen's chat template writes one (its own lines around the JSON)."""
    import tool_use

    call = json.dumps({"name": tool_use.CODE_INTERPRETER, "arguments": {"code": code}})
    return f"{tool_use.TOOL_CALL_OPEN}\n{call}\n{tool_use.TOOL_CALL_CLOSE}"


def tool_warmup_turns(problem, answer, rng):
    """A warm-up conversation for "What is a*b?" as [(text, is_tool_output)]: a guess at the product
    (direct), or a call printing a*b, its output and the answer copied from it (one_call), or a
    second call checking b*a first (two_calls). The mix (TOOL_SHAPES) makes a sampled response stop
    after 1, 2 or 3 model turns."""
    a, b = problem.removeprefix("What is ").removesuffix("?").split("*")
    shape = rng.choices(list(TOOL_SHAPES), weights=list(TOOL_SHAPES.values()))[0]
    codes = {
        "direct": [],
        "one_call": [f"print({a}*{b})"],
        "two_calls": [f"print({a}*{b})", f"print({b}*{a})"],
    }
    turns = []
    for code in codes[shape]:
        turns += [(tool_call_text(code), False), (answer, True)]  # the program prints the product
    return turns + [(f"\\boxed{{{answer}}}", False)]


def tool_warmup_sequence(tokenizer, prompt_ids, turns, wrapper):
    """(ids, labels) of one warm-up conversation, built with the rollout's own tool-turn ids; tool
    outputs get label -100 (not trained: the model does not write them)."""
    import tool_use

    ids, labels = list(prompt_ids), [-100] * len(prompt_ids)
    for text, is_tool in turns:
        if is_tool:
            turn = tool_use.tool_turn_ids(tokenizer, text, wrapper, max_content_tokens=512)
            ids, labels = ids + turn, labels + [-100] * len(turn)
        else:
            turn = tokenizer.encode(text, add_special_tokens=False)
            ids, labels = ids + turn, labels + turn
    return ids + [tokenizer.eos_token_id], labels + [tokenizer.eos_token_id]


@torch.no_grad()
def first_turn_calls(
    model, tokenizer, rows, prompt_ids, temperature=1.0, max_new_tokens=96, seed=0):
    """Sample each prompt's first model turn (HF generate) and sort it: -> fractions of turns that
    make a call, that make a valid call, and whose code is exactly print(a*b) for the prompt's a*b;
    and the sampled turns."""
    import tool_use

    turns = [
        text.split(tool_use.TOOL_CALL_CLOSE)[0] + tool_use.TOOL_CALL_CLOSE
        if tool_use.TOOL_CALL_CLOSE in text
        else text
        for text in sample_responses(
            model, tokenizer, prompt_ids, temperature, max_new_tokens, seed)]
    calls = [
        tool_use.parse_tool_call(t)[0] if t.endswith(tool_use.TOOL_CALL_CLOSE) else None
        for t in turns]
    expected = [
        f"print({row['problem'].removeprefix('What is ').removesuffix('?')})" for row in rows]
    count = len(turns)
    return {"call_rate": sum(t.endswith(tool_use.TOOL_CALL_CLOSE) for t in turns) / count,
            "valid_call_rate": sum(c is not None for c in calls) / count,
            "exact_code_rate": sum(c == e for c, e in zip(calls, expected)) / count}, turns


# --------------------------------------------------------------------------------------------------
# The countdown variant: a search task, where the right combination for a prompt must be found by
# trying
# --------------------------------------------------------------------------------------------------

COUNTDOWN_SOURCE = "tiny_countdown"
COUNTDOWN_TARGETS = range(10, 100)  # two digits: every prompt tokenises to the same length


def countdown_solutions():
    """{(digits sorted, target): sorted solution strings}: every way of writing three digits 1..9 in
    some order with + - * between them (no parentheses, usual precedence) whose value lies in
    COUNTDOWN_TARGETS."""
    import itertools

    import rewards

    solutions = {}
    for digits in itertools.combinations_with_replacement(range(1, 10), 3):
        for a, b, c in set(itertools.permutations(digits)):
            for op1, op2 in itertools.product("+-*", repeat=2):
                expression = f"{a}{op1}{b}{op2}{c}"
                value = rewards.countdown_value(expression)
                if value in COUNTDOWN_TARGETS:
                    solutions.setdefault((digits, value), set()).add(expression)
    return {key: sorted(found) for key, found in sorted(solutions.items())}


def countdown_rows(keys):
    return [{"problem": f"Make {target} from {' '.join(map(str, digits))}.",
             "answer": f"{','.join(map(str, digits))}={target}", "data_source": COUNTDOWN_SOURCE}
            for digits, target in keys]


def make_countdown_splits(seed=0, num_test=64, num_fresh=64):
    """Train and two held-out splits of the countdown task, disjoint in their digit triples: a
    held-out prompt's three digits appear in no training prompt, so solving it takes arithmetic
    that transfers, not a memorised answer. "countdown_test" (split A) is evaluated during
    training; "countdown_fresh" (split B, from other triples) is kept for a second, independent
    held-out check. Split A is the same whatever num_fresh."""
    solutions = countdown_solutions()
    by_digits = {}
    for digits, target in solutions:
        by_digits.setdefault(digits, []).append((digits, target))
    triples = sorted(by_digits)
    random.Random(seed).shuffle(triples)

    def held_out(count):  # whole triples from the end of the shuffled list, cut to count prompts
        taken = []
        while len(taken) < count:
            taken += by_digits[triples.pop()]
        return sorted(taken[:count])

    test = held_out(num_test)
    fresh = held_out(num_fresh) if num_fresh else []
    held_triples = {digits for digits, _ in test + fresh}
    train = [key for key in solutions if key[0] not in held_triples]
    return {
        "countdown_train": countdown_rows(train),
        "countdown_test": countdown_rows(test),
        "countdown_fresh": countdown_rows(fresh),
    }, solutions


def build_tiny_countdown(out_dir, seed=0, warmup_steps=1500, force=False, from_scratch=False):
    """Create (or reuse) the countdown variant next to the tiny default (built first if needed):
    data/countdown_{train,test}.jsonl and countdown_model/, the tiny model after a warm-up on random
    correct solutions of the training prompts (the committed reference weights with the default
    settings, as build_tiny). Returns the summary dict written to countdown.json."""
    out_dir = Path(out_dir)
    summary_path = out_dir / "countdown.json"
    # written last, so its presence means the variant is complete
    if summary_path.exists() and not force:
        return json.loads(summary_path.read_text())
    from_assets = (not from_scratch and seed == 0 and warmup_steps == 1500
                   and default_base(out_dir, seed))
    if not from_assets and not build_here():
        return run_pinned("build_tiny_countdown", out_dir=str(out_dir), seed=seed,
                          warmup_steps=warmup_steps, force=force, from_scratch=from_scratch)
    splits, solutions = make_countdown_splits(seed=seed)
    if from_assets:
        write_splits(splits, out_dir)
        return obtain_reference(out_dir, "countdown_model", summary_path)
    tokenizer, model = load_default(out_dir, seed, from_scratch)
    start = time.time()
    write_splits(splits, out_dir)
    rows, prompt_ids = load_split(out_dir / "data", "countdown_train", tokenizer)

    def sequence(i, rng):
        digits, target = rows[i]["answer"].split("=")
        choice = rng.choice(solutions[tuple(map(int, digits.split(","))), int(target)])
        return answer_sequence(tokenizer, prompt_ids[i], f"\\boxed{{{choice}}}")

    with build_numerics():
        final_loss = warmup(model, tokenizer, rows, prompt_ids, warmup_steps, seed=seed,
                            sequence=sequence)
        rates = {}
        for name in splits:
            split_rows, split_prompts = load_split(out_dir / "data", name, tokenizer)
            rates[name], samples = sampled_success_rate(model, tokenizer, split_rows,
                                                        split_prompts, seed=seed)
        save_variant(model, out_dir, "countdown_model")
    counts = [len(solutions[key]) for key in solutions]
    summary = {
        "model_dir": str(out_dir / "countdown_model"),
        "data_dir": str(out_dir / "data"),
        "train_prompts": len(splits["countdown_train"]),
        "test_prompts": len(splits["countdown_test"]),
        "fresh_prompts": len(splits["countdown_fresh"]),
        "solutions_per_prompt": {
            "min": min(counts),
            "median": sorted(counts)[len(counts) // 2],
            "max": max(counts),
        },
        "warmup_steps": warmup_steps,
        "warmup_final_loss": round(final_loss, 4),
        **{f"{name}_success_rate_t1": round(rate, 3) for name, rate in rates.items()},
        "test_samples": samples[:8],
        "seconds": round(time.time() - start, 1),
        "seed": seed,
    }
    check_reference(summary, "countdown_model",
                    seed == 0 and warmup_steps == 1500 and default_base(out_dir, seed))
    summary_path.write_text(json.dumps(summary, indent=2))
    return summary


# --------------------------------------------------------------------------------------------------
# The same model bytes on every x86 CPU (docs/results.md, "Which model a result came from")
# --------------------------------------------------------------------------------------------------

# The numerics every build runs under. float32 sums round differently in another order, and the
# order follows the kernel: ATen picks 8-wide AVX2 or 16-wide AVX-512 loops by CPU; MKL's GEMM picks
# its code path by CPU (its AVX2/AVX-512 reproducible branches are Intel-only; COMPATIBLE, SSE2, is
# the one meant to hold on AMD too) and may split work by thread count. torch and MKL read these
# once, at start-up: hence a child process (run_pinned).
BUILD_ENV = {"ATEN_CPU_CAPABILITY": "avx2", "MKL_CBWR": "COMPATIBLE", "OMP_NUM_THREADS": "1",
             "MKL_NUM_THREADS": "1"}
# The CPU the pinned bytes below (and tests/test_tiny.py's) were recorded on: under BUILD_ENV
# another x86 CPU still builds other bytes (an Intel Xeon with AVX-512 did): they hold only here
REFERENCE_CPU = {"vendor": "AuthenticAMD", "family": 25, "model": 1, "avx512": False,
                 "name": "AMD EPYC"}
# sha256 of model.safetensors as
# `python -m tools.tiny --out runs/tiny --tool --countdown --from-scratch`
# builds it (seed 0, default warm-up steps) under BUILD_ENV on REFERENCE_CPU with torch 2.13.0+cpu
# and transformers 5.19.0: the bytes in ASSETS; a default build that differs there says so loudly
REFERENCE_SHA256 = {
    "model": "830092b6290c17ff51896542c3c255cd8a1bedbfaf3c848f03e30564de899de0",
    "countdown_model": "207d5b3e8cfcc5ac961e110cdf29daf100043c45d9f7a430c593c6d5161d3dc8",
    "tool_model": "3d454fdb76a8d93536ba26b281a63dbb062d18b669c43607c609b04e584f8d6b",
}


# The reference builds' weights and summaries, committed: a default build copies them (seconds) and
# checks their sha256 instead of training for minutes; `--from-scratch` trains them again here, and
# `--save-assets` replaces them after a change to the build (tests/test_tiny.py pins a short
# build's bytes, so such a change cannot go unnoticed)
ASSETS = Path(__file__).resolve().parents[1] / "assets" / "tiny"


def obtain_reference(out_dir, name, summary_path):
    """Complete out_dir/name (tokenizer and config already there for "model"; copied from the
    default for a variant) with the committed weights of the reference build, checked against
    REFERENCE_SHA256; write and return its summary (the reference build's, with this directory's
    paths)."""
    import shutil

    out_dir = Path(out_dir)
    if name != "model":
        shutil.copytree(out_dir / "model", out_dir / name, dirs_exist_ok=True)
    target = out_dir / name / "model.safetensors"
    shutil.copyfile(ASSETS / f"{name}.safetensors", target)
    found = file_sha256(target)
    if found != REFERENCE_SHA256[name]:
        raise SystemExit(f"tools/tiny.py: {ASSETS / name}.safetensors has sha256 {found}, not the "
                         f"reference {REFERENCE_SHA256[name]} (a damaged checkout?); "
                         "`python -m tools.tiny --from-scratch` trains it again")
    summary = json.loads((ASSETS / "builds.json").read_text())[name]
    summary = {"model_dir": str(out_dir / name), "data_dir": str(out_dir / "data"), **summary,
               "model_sha256": found, "weights": f"committed ({ASSETS.name}/{name}.safetensors)"}
    summary_path.write_text(json.dumps(summary, indent=2))
    return summary


def save_assets(summaries):
    """Replace the committed weights and summaries with those of a from-scratch build of the
    default settings (summaries as build_* returned them, each already checked against
    REFERENCE_SHA256)."""
    import shutil

    ASSETS.mkdir(parents=True, exist_ok=True)
    builds = {}
    for summary in summaries:
        name = Path(summary["model_dir"]).name
        if summary.get("weights") or summary["model_sha256"] != REFERENCE_SHA256[name]:
            raise SystemExit(f"tools/tiny.py --save-assets: {summary['model_dir']} is not a "
                             "from-scratch build with REFERENCE_SHA256 (update REFERENCE_SHA256 "
                             "first if the build changed on purpose)")
        shutil.copyfile(Path(summary["model_dir"]) / "model.safetensors",
                        ASSETS / f"{name}.safetensors")
        builds[name] = {key: value for key, value in summary.items()
                        if key not in ("model_dir", "data_dir", "model_sha256")}
    path = ASSETS / "builds.json"
    old = json.loads(path.read_text()) if path.exists() else {}
    path.write_text(json.dumps({**old, **builds}, indent=2) + "\n")


def file_sha256(path):
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def can_pin():
    """Whether this CPU runs BUILD_ENV's kernels: x86-64 with AVX2 and FMA (Intel since 2013, AMD
    since 2015)."""
    import platform

    if platform.machine().lower() not in ("x86_64", "amd64"):
        return False
    try:
        flags = set(Path("/proc/cpuinfo").read_text().split())
    except OSError:
        return False
    return {"avx2", "fma"} <= flags


def cpu_identity(cpuinfo=None):
    """This CPU as far as a pinned build's bytes depend on it: vendor, family and model numbers and
    AVX-512 (from /proc/cpuinfo, or the text `cpuinfo`; {} where there is none), plus the model
    name, for people."""
    fields, flags = {}, set()
    with contextlib.suppress(OSError):
        if cpuinfo is None:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        for line in cpuinfo.splitlines():
            key, _, value = (part.strip() for part in line.partition(":"))
            if key == "processor" and fields:
                break  # the first processor tells
            fields[key] = value
            if key == "flags":
                flags = set(value.split())
    if "vendor_id" not in fields:
        return {}
    return {"vendor": fields["vendor_id"], "family": int(fields.get("cpu family", -1)),
            "model": int(fields.get("model", -1)), "avx512": "avx512f" in flags,
            "name": fields.get("model name", "")}


def same_cpu(recorded, identity=None):
    """Whether this CPU is the kind `recorded` (a cpu_identity, name aside) was taken on."""
    identity = cpu_identity() if identity is None else identity
    return bool(identity) and all(identity.get(key) == value for key, value in recorded.items()
                                  if key != "name")


def describe_cpu(identity):
    if not identity:
        return "an unknown CPU"
    return (f"{identity.get('name') or identity['vendor']} ({identity['vendor']} family "
            f"{identity['family']} model {identity['model']}, "
            f"{'AVX-512' if identity['avx512'] else 'no AVX-512'})")


def pinned():
    """Whether this process runs under BUILD_ENV (set before torch started: ATen's kernels say so)."""
    return (all(os.environ.get(key) == value for key, value in BUILD_ENV.items())
            and torch.backends.cpu.get_cpu_capability() == "AVX2")


def run_pinned(name, **kwargs):
    """tiny.<name>(**kwargs), run in a child process under BUILD_ENV -> its result (a JSON-able
    dict). Progress goes to stderr as usual; the child's last stdout line is the result."""
    code = ("import json, sys; from tools import tiny; "
            f"print(json.dumps(tiny.{name}(**json.loads(sys.argv[1]))))")
    root = str(Path(__file__).resolve().parents[1])  # the repository root: tools.tiny, data, ...
    path = os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))
    env = {**os.environ, **BUILD_ENV, "PYTHONPATH": path, "STARE_TINY_PINNED_CHILD": "1"}
    completed = subprocess.run([sys.executable, "-c", code, json.dumps(kwargs)], env=env,
                               stdout=subprocess.PIPE, text=True, check=True)
    return json.loads(completed.stdout.strip().splitlines()[-1])


def build_here():
    """True: build in this process (under BUILD_ENV, or on a CPU that cannot be pinned, with a
    warning); False: the caller builds through run_pinned instead."""
    if pinned():
        return True
    if os.environ.get("STARE_TINY_PINNED_CHILD"):  # still not pinned in the child: never fork again
        raise RuntimeError("tools/tiny.py: BUILD_ENV did not take effect (ATen runs "
                           f"{torch.backends.cpu.get_cpu_capability()} kernels)")
    if can_pin():
        return False
    print("tools/tiny.py: WARNING: this CPU has no AVX2+FMA, so the build cannot run under "
          "BUILD_ENV; the model will differ from REFERENCE_SHA256 and from every committed result",
          file=sys.stderr)
    return True


@contextlib.contextmanager
def build_numerics():
    """One intra-op thread and deterministic algorithms for the build, restored afterwards (a
    pinned process may still have called torch.set_num_threads)."""
    threads = torch.get_num_threads()
    deterministic = torch.are_deterministic_algorithms_enabled()
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
        torch.use_deterministic_algorithms(deterministic)


def check_reference(summary, name, default_settings):
    """Record the built model's sha256 and numerics in its summary; say loudly when a build with
    the default settings is not the reference."""
    summary["model_sha256"] = file_sha256(Path(summary["model_dir"]) / "model.safetensors")
    summary["build_env"] = {**{key: os.environ.get(key) for key in BUILD_ENV},
                            "cpu_capability": torch.backends.cpu.get_cpu_capability(),
                            "torch": torch.__version__, "cpu": cpu_identity()}
    expected = REFERENCE_SHA256.get(name)
    if default_settings and expected and summary["model_sha256"] != expected:
        if same_cpu(REFERENCE_CPU):
            print(f"tools/tiny.py: WARNING: {summary['model_dir']}/model.safetensors has sha256 "
                  f"{summary['model_sha256']}, not the reference {expected}: results made with "
                  "it will not match the committed ones (docs/results.md, \"Which model a result "
                  "came from\")", file=sys.stderr)
        else:
            print(f"tools/tiny.py: built on {describe_cpu(cpu_identity())}, not the "
                  f"{describe_cpu(REFERENCE_CPU)} the reference was built on: sha256 "
                  f"{summary['model_sha256'][:12]}…, not {expected[:12]}…, as expected on another "
                  "CPU (docs/results.md, \"Which model a result came from\"); the committed "
                  "weights (a build without --from-scratch) are the reference", file=sys.stderr)
    return summary


# --------------------------------------------------------------------------------------------------
# The command
# --------------------------------------------------------------------------------------------------


def build_tiny(out_dir, seed=0, warmup_steps=800, force=False, from_scratch=False):
    """Create (or reuse) the tiny default under out_dir; returns the summary dict written to
    tiny.json. With the default settings the committed reference weights are obtained (seconds)
    unless from_scratch; otherwise the model is trained here under BUILD_ENV (minutes)."""
    out_dir = Path(out_dir)
    summary_path = out_dir / "tiny.json"
    # written last, so its presence means the directory is complete
    if summary_path.exists() and not force:
        return json.loads(summary_path.read_text())
    from_assets = not from_scratch and seed == 0 and warmup_steps == 800
    if not from_assets and not build_here():
        return run_pinned("build_tiny", out_dir=str(out_dir), seed=seed,
                          warmup_steps=warmup_steps, force=force, from_scratch=from_scratch)
    from transformers import AutoTokenizer

    start = time.time()
    built_tokenizer = build_tokenizer()
    model = build_model(built_tokenizer, seed=seed)
    built_tokenizer.save_pretrained(out_dir / "model")
    # config.json first: it makes AutoTokenizer pick Qwen2Tokenizer
    model.config.save_pretrained(out_dir / "model")
    splits = make_splits(seed=seed)
    write_splits(splits, out_dir)
    if from_assets:
        model.save_pretrained(out_dir / "model")  # config and generation config, as trained
        return obtain_reference(out_dir, "model", summary_path)
    with build_numerics():
        tokenizer = AutoTokenizer.from_pretrained(out_dir / "model")  # what the trainer will load
        loaded = {name: load_split(out_dir / "data", name, tokenizer) for name in splits}
        train_rows = loaded["sum_train"][0] + loaded["add_train"][0]
        train_prompts = loaded["sum_train"][1] + loaded["add_train"][1]
        final_loss = warmup(model, tokenizer, train_rows, train_prompts, warmup_steps, seed=seed)
        # several samples per prompt: the sum splits have only 16 and 4 prompts
        sum_train_rate, _ = sampled_success_rate(model, tokenizer,
                                                 *(x * 4 for x in loaded["sum_train"]), seed=seed)
        sum_rate, sum_samples = sampled_success_rate(
            model, tokenizer, *(x * 16 for x in loaded["sum_test"]), seed=seed)
        add_rate, _ = sampled_success_rate(model, tokenizer, *loaded["add_test"], seed=seed)
        model.save_pretrained(out_dir / "model")
    summary = {
        "model_dir": str(out_dir / "model"),
        "data_dir": str(out_dir / "data"),
        "parameters": sum(p.numel() for p in model.parameters()),
        "vocab_size": model.config.vocab_size,
        "warmup_steps": warmup_steps,
        "warmup_final_loss": round(final_loss, 4),
        "sum_train_success_rate_t1": round(sum_train_rate, 3),
        "sum_test_success_rate_t1": round(sum_rate, 3),
        "add_test_success_rate_t1": round(add_rate, 3),
        "sum_test_samples": sum_samples[:8],
        "seconds": round(time.time() - start, 1),
        "seed": seed,
    }
    check_reference(summary, "model", seed == 0 and warmup_steps == 800)
    summary_path.write_text(json.dumps(summary, indent=2))
    return summary


def load_default(out_dir, seed, from_scratch=False):
    """The tiny default (built first if missing) as a variant's warm-up starts from it -> (tokenizer, model)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    build_tiny(out_dir, seed=seed, from_scratch=from_scratch)
    tokenizer = AutoTokenizer.from_pretrained(out_dir / "model")
    return tokenizer, AutoModelForCausalLM.from_pretrained(out_dir / "model", dtype=torch.float32)


def save_variant(model, out_dir, name):
    """A variant's model saved as out_dir/name, with the default's tokenizer files and config beside it."""
    import shutil

    shutil.copytree(out_dir / "model", out_dir / name, dirs_exist_ok=True)
    model.save_pretrained(out_dir / name)


def build_tiny_tool(out_dir, seed=0, warmup_steps=300, force=False, from_scratch=False):
    """Create (or reuse) the tool-use variant next to the tiny default (built first if needed):
    data/mul_{train, test}.jsonl and tool_model/, the tiny model after a warm-up on tool
    conversations (the committed reference weights with the default settings, as build_tiny).
    Returns the summary dict written to tool.json. The tiny default's own files are left as they
    are."""
    import tool_use

    out_dir = Path(out_dir)
    summary_path = out_dir / "tool.json"
    # written last, so its presence means the variant is complete
    if summary_path.exists() and not force:
        return json.loads(summary_path.read_text())
    from_assets = (not from_scratch and seed == 0 and warmup_steps == 300
                   and default_base(out_dir, seed))
    if not from_assets and not build_here():
        return run_pinned("build_tiny_tool", out_dir=str(out_dir), seed=seed,
                          warmup_steps=warmup_steps, force=force, from_scratch=from_scratch)
    if from_assets:
        write_splits(make_tool_splits(seed=seed), out_dir)
        return obtain_reference(out_dir, "tool_model", summary_path)
    tokenizer, model = load_default(out_dir, seed, from_scratch)
    start = time.time()
    write_splits(make_tool_splits(seed=seed), out_dir)
    rows, prompt_ids = load_split(out_dir / "data", "mul_train", tokenizer)
    wrapper = [tokenizer.encode(part, add_special_tokens=False) for part in tool_use.QWEN_TOOL_TURN]

    def sequence(i, rng):
        turns = tool_warmup_turns(rows[i]["problem"], rows[i]["answer"], rng)
        return tool_warmup_sequence(tokenizer, prompt_ids[i], turns, wrapper)

    with build_numerics():
        final_loss = warmup(model, tokenizer, rows, prompt_ids, warmup_steps, batch_size=8,
                            seed=seed, sequence=sequence)
        test_rows, test_prompts = load_split(out_dir / "data", "mul_test", tokenizer)
        rates, turns = first_turn_calls(model, tokenizer, test_rows, test_prompts, seed=seed)
        save_variant(model, out_dir, "tool_model")
    summary = {
        "model_dir": str(out_dir / "tool_model"),
        "data_dir": str(out_dir / "data"),
        "warmup_steps": warmup_steps,
        "warmup_final_loss": round(final_loss, 4),
        "shapes": TOOL_SHAPES,
        **{f"first_turn_{k}_t1": round(v, 3) for k, v in rates.items()},
        "first_turn_samples": turns[:4],
        "seconds": round(time.time() - start, 1),
        "seed": seed,
    }
    check_reference(summary, "tool_model",
                    seed == 0 and warmup_steps == 300 and default_base(out_dir, seed))
    summary_path.write_text(json.dumps(summary, indent=2))
    return summary


def default_base(out_dir, seed):
    """Whether a variant's warm-up starts from the reference default: out_dir's default is (or,
    built now, will be) the one of 800 steps with seed 0."""
    summary_path = Path(out_dir) / "tiny.json"
    if summary_path.exists():
        return seed == 0 and json.loads(summary_path.read_text())["warmup_steps"] == 800
    return seed == 0


def write_splits(splits, out_dir):
    (Path(out_dir) / "data").mkdir(parents=True, exist_ok=True)
    for name, rows in splits.items():
        data.save_jsonl(rows, Path(out_dir) / "data" / f"{name}.jsonl")


def write_data(out_dir, seed=0):
    """The tasks' prompt files only (out_dir/data/*.jsonl: sum, add, mul, countdown), in seconds and
    without building or training a model: the data to try another model on (docs/usage.md, "A small
    real model")."""
    splits = {
        **make_splits(seed=seed),
        **make_tool_splits(seed=seed),
        **make_countdown_splits(seed=seed)[0],
    }
    write_splits(splits, out_dir)
    return {name: len(rows) for name, rows in splits.items()}


def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="runs/tiny",
                        help="directory to create (reused if complete)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--warmup-steps", type=int, default=800)
    parser.add_argument("--force", action="store_true",
                        help="rebuild even if the directory is complete")
    parser.add_argument("--tool", action="store_true",
                        help="also build the tool-use variant (tool_model/, mul_*)")
    parser.add_argument("--countdown", action="store_true",
                        help="also build the countdown variant (countdown_model/, countdown_*)")
    parser.add_argument("--data-only", action="store_true",
                        help="write the tasks' data files only (no model)")
    parser.add_argument("--from-scratch", action="store_true",
                        help="train the default models here instead of copying the committed "
                             "reference weights (minutes; checked against REFERENCE_SHA256)")
    parser.add_argument("--save-assets", action="store_true",
                        help="replace the committed reference weights with this from-scratch "
                             "build's (after a deliberate change to the build)")
    args = parser.parse_args()
    if args.warmup_steps < 0:
        parser.error(f"--warmup-steps must be >= 0, got {args.warmup_steps}")
    existing = next(p for p in [Path(args.out), *Path(args.out).parents] if p.exists())
    if not existing.is_dir() or not os.access(existing, os.W_OK | os.X_OK):
        parser.error(
            f"--out {args.out}: cannot create or write it ({existing} is not a writable directory)")
    if args.data_only:
        print(json.dumps(write_data(args.out, args.seed), indent=2))
        return
    options = dict(force=args.force, from_scratch=args.from_scratch)
    built = [build_tiny(args.out, args.seed, args.warmup_steps, **options)]
    if args.tool:
        built.append(build_tiny_tool(args.out, args.seed, **options))
    if args.countdown:
        built.append(build_tiny_countdown(args.out, args.seed, **options))
    for summary in built:
        print(json.dumps(summary, indent=2))
    if args.save_assets:
        save_assets(built)
    # what a result made with these models should name (repro.py records them too)
    for summary in built:
        sha = summary.get("model_sha256", "(not recorded: built before tools/tiny.py recorded it)")
        print(f"{summary['model_dir']}/model.safetensors sha256 {sha}")


if __name__ == "__main__":
    main()
