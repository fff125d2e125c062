"""tool_use.py: multi-turn tool use on the rollout engine. The model writes Python in Hermes-style
tool calls, sandbox.py runs it, the output comes back as a tool turn, and the model goes on.

    batch = tool_use.generate_with_tools(engine, tokenizer, prompt_token_ids, seeds, cfg.rollout,
                                         cfg.sandbox)
    # batch.tool_mask[i][t]: token t of response i is tool output, context kept out of the loss

Each turn is one rollout engine call (rollout.py); this file adds the conversation around it: call
parsing, the tool turns and their mask, per-turn seeds and the tool statistics (a demo:
`python -m tools.sample --max-turns 3`). The reference release has only configuration stubs for
tool use (docs/method.md, "The reference release"), so the format is this project's choice:
Hermes-style calls of one function, code_interpreter, in Qwen2.5's chat format.
"""

import dataclasses
import json

import data
import rollout

# the one function the model may call (the reference's function_name)
CODE_INTERPRETER = "code_interpreter"
TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>", "</tool_call>"
# (prefix, suffix) around a tool turn's content, as the "tool" branch of Qwen2.5-*-Instruct's chat
# template renders it (Qwen3's is the same), then the generation prompt. The model stops on
# </tool_call>, so the <|im_end|>\n that closes its message opens the tool turn. Another template
# needs another pair; the tiny tokenizer (<|im_start|> and <|im_end|> single ids, the rest character
# by character) uses this one.
QWEN_TOOL_TURN = ("<|im_end|>\n<|im_start|>user\n<tool_response>\n",
                  "\n</tool_response><|im_end|>\n<|im_start|>assistant\n")
# The function as a JSON schema, for the prompt's tool list (apply_chat_template(...,
# tools=[CODE_INTERPRETER_TOOL]) renders Qwen's "# Tools" system block with it)
CODE_INTERPRETER_TOOL = {"type": "function", "function": {
    "name": CODE_INTERPRETER, "description": "Run Python code and return what it prints.",
    "parameters": {"type": "object",
                   "properties": {"code": {"type": "string", "description": "the Python code"}},
                   "required": ["code"]}}}


@dataclasses.dataclass
class ToolRollouts(rollout.Rollouts):
    """Rollouts of multi-turn tool use. token_ids is the whole response, model and tool turns
    interleaved: exactly the ids the model saw after the prompt. Tool tokens are context, not
    actions: a trainer leaves them (tool_mask) out of the loss, the entropy statistics and the
    log-prob mismatch. texts holds what the verifier scores: the model's last turn only (after the
    last tool turn, or the call that ended the response), so an answer printed by the code earns
    nothing; full_texts holds everything. finish_reasons: "stop" (answered without a call),
    "length" (out of tokens, in a model or a tool turn) or "max_turns" (the last allowed turn still
    made a call, which is not run)."""

    # [N] per response token: True = a tool-turn token (not sampled: its logprobs entry is 0.0)
    tool_mask: list
    full_texts: list  # [N] the whole response decoded, special tokens and tool turns included
    num_turns: list  # [N] model turns (engine requests) in the response
    num_calls: list  # [N] tool turns appended: calls executed plus calls rejected as invalid
    # [N] tool turns that report an error: invalid calls and failed runs (timeouts included)
    num_errors: list
    num_timeouts: list  # [N] runs killed at the sandbox's timeout_s
    # [N] runs the sandbox itself failed (Result.error "sandbox": the code never ran or was lost)
    num_sandbox_failures: list
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
    num_sandbox_failures: int = 0
    num_invalid: int = 0


def generate_with_tools(engine, tokenizer, prompt_token_ids, seeds, cfg, sandbox_cfg):
    """cfg.n multi-turn responses per prompt -> ToolRollouts, prompt-major like `generate`. cfg:
    config.RolloutConfig (sampling as in `generate`, max_turns, max_tool_response_tokens);
    sandbox_cfg: config.SandboxConfig; tokenizer: the engine's (for the tool turns and full_texts).

    Each turn is one engine.generate call over the unfinished conversations, stopping at
    </tool_call>; the valid calls of a turn run in one sandbox.run_batch, an invalid one gets an
    error message instead. max_tokens bounds the whole response, model and tool tokens together: a
    tool turn that does not fit is cut to it, and a call runs only if its result can be shown.

    seeds: one per prompt, in [0, 2**56); each turn samples with `turn_seed`, so a response depends
    on its own seed only, not on the batch or on when the other conversations finish (on CPU; GPU
    kernels may vary with batch composition). The call tags must reach vLLM's detokenized text:
    plain text, or added tokens not marked special (as <tool_call> is in Qwen2.5). A prompt may end
    inside the assistant's message: a <tool_call> it leaves open (`_open_call`) is read with the
    first turn's text, so such a prefill asks every first turn for a call.
    """
    rollout.check_seeds(seeds, prompt_token_ids)
    if cfg.max_turns < 1 or cfg.max_tokens < 1:
        raise ValueError(f"max_turns and max_tokens must be >= 1, got {cfg.max_turns} and "
                         f"{cfg.max_tokens}")
    # tokenised once per call
    wrapper = [tokenizer.encode(part, add_special_tokens=False) for part in QWEN_TOOL_TURN]
    conversations = [_Conversation(i, j, list(ids))
                     for i, ids in enumerate(prompt_token_ids) for j in range(cfg.n)]
    for turn in range(cfg.max_turns):
        active = [c for c in conversations if c.finish_reason is None]
        if not active:
            break
        seeds_now = None if seeds is None else [
            turn_seed(seeds[c.prompt_index], cfg.n, c.sample, turn) for c in active]
        calls = [_model_turn(c, completion, turn, cfg, tokenizer)
                 for c, completion in zip(active, _sample_turn(engine, active, seeds_now, cfg))]
        _tool_turns([call for call in calls if call is not None], tokenizer, wrapper, cfg,
                    sandbox_cfg)
    shared = ("prompt_index", "token_ids", "logprobs", "tool_mask", "num_turns", "num_calls",
              "num_errors", "num_timeouts", "num_sandbox_failures", "num_invalid")
    return ToolRollouts(
        **{name: [getattr(c, name) for c in conversations] for name in shared},
        finish_reasons=[c.finish_reason for c in conversations],
        texts=[c.answer_text for c in conversations], full_texts=[
            tokenizer.decode(c.token_ids, skip_special_tokens=False) for c in conversations])


def _sample_turn(engine, active, seeds, cfg):
    """One engine.generate call over the unfinished conversations: each is its own request (n=1) on
    its own context, prompt + response so far (the prefix cache spares recomputing what an earlier
    turn processed), with what is left of the budget. -> one CompletionOutput per conversation."""
    from vllm import SamplingParams

    params = [SamplingParams(n=1, temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k,
                             max_tokens=cfg.max_tokens - len(c.token_ids), stop=[TOOL_CALL_CLOSE],
                             include_stop_str_in_output=True, logprobs=0, flat_logprobs=True,
                             seed=None if seeds is None else seeds[k])
              for k, c in enumerate(active)]
    outputs = engine.generate(
        [{"prompt_token_ids": c.prompt_ids + c.token_ids} for c in active], params, use_tqdm=False)
    return [request.outputs[0] for request in outputs]


def _model_turn(conversation, completion, turn, cfg, tokenizer):
    """Append a sampled turn and decide what follows it. -> (conversation, code or None, error or
    None) when a tool turn is due, else None (the conversation is finished)."""
    logprobs = rollout.sampled_logprobs(completion)
    _append(conversation, list(completion.token_ids), logprobs, tool=False)
    conversation.num_turns += 1
    conversation.answer_text = completion.text
    if completion.finish_reason != "stop" or completion.stop_reason != TOOL_CALL_CLOSE:
        conversation.finish_reason = completion.finish_reason  # an answer, or out of budget
    elif turn + 1 == cfg.max_turns:  # no turn left to read the result: the call is not run
        conversation.finish_reason = "max_turns"
    elif len(conversation.token_ids) == cfg.max_tokens:
        conversation.finish_reason = "length"  # no room left for the result: the call is not run
    else:
        text = completion.text
        if turn == 0 and TOOL_CALL_OPEN not in text:  # the call may have begun in a prefill
            text = _open_call(tokenizer, conversation.prompt_ids) + text
        return (conversation, *parse_tool_call(text))
    return None


def _tool_turns(calls, tokenizer, wrapper, cfg, sandbox_cfg):
    """Run the valid calls of a turn in one bounded parallel batch, and append every call's tool
    turn (the output, or the error message of an invalid call), cut to the budget."""
    import sandbox

    codes = [code for _, code, _ in calls if code is not None]
    results = iter(sandbox.run_batch(codes, sandbox_cfg) if codes else [])
    for conversation, code, error in calls:
        result = next(results) if code is not None else None  # None: rejected without running
        conversation.num_calls += 1
        conversation.num_invalid += result is None
        conversation.num_errors += result is None or not result.ok
        conversation.num_timeouts += result is not None and result.error == "timeout"
        conversation.num_sandbox_failures += result is not None and result.error == "sandbox"
        content = error if result is None else sandbox.format_result(result)
        ids = tool_turn_ids(tokenizer, content, wrapper, cfg.max_tool_response_tokens)
        room = cfg.max_tokens - len(conversation.token_ids)
        _append(conversation, ids[:room], [0.0] * min(len(ids), room), tool=True)
        if len(ids) >= room:  # the result filled the budget: no room for an answer
            conversation.finish_reason = "length"


def turn_seed(seed, n, sample, turn):
    """The sampling seed of sample `sample` (0 .. n-1) of the prompt seeded `seed`, at model turn
    `turn`. Turn 0's is seed * n + sample, the seed vLLM gives that sample in `generate` (child j
    of a request seeded seed * n gets seed * n + j), so a first turn is exactly what `generate`
    samples; later turns derive one from (seed, sample, turn), whatever other conversations run."""
    if turn == 0:
        return seed * n + sample
    return data.derive_seed(seed, "turn", sample, turn)


def parse_tool_call(text):
    """The code of the call that ends `text` (a model turn that stopped on </tool_call>) -> (code,
    None), or (None, error message for the model) when the call is not valid.

    The call is what lies between the last <tool_call> and the final </tool_call>: JSON {"name":
    "code_interpreter", "arguments": {"code": "..."}} (whitespace around it is allowed, as Qwen's
    template writes it on its own lines). The arguments may also be a JSON string holding that
    object (OpenAI's style)."""
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
    """The ids of one tool turn: prefix + content + suffix ids (wrapper: QWEN_TOOL_TURN tokenised).
    The content (the sandbox's output and error line) loses its trailing newlines (the template
    puts one before </tool_response>) and is tokenised with special tokens split: a program
    printing "<|im_end|>" shows the model those characters, not the control token. Longer than
    max_content_tokens, it keeps the first and the last half with a marker between them, as
    sandbox.py does with bytes (the error line is last). Tokenising the parts apart can differ from
    apply_chat_template at the seams, where BPE would merge the content's edge whitespace with the
    template's newline; the model sees these ids whatever they are, and the trainer the same."""
    ids = tokenizer.encode(
        content.rstrip("\n"), add_special_tokens=False, split_special_tokens=True)
    if len(ids) > max_content_tokens:
        keep_tail, omitted = max_content_tokens // 2, len(ids) - max_content_tokens
        marker = tokenizer.encode(
            f"\n[... {omitted} tokens of output omitted ...]\n", add_special_tokens=False)
        ids = ids[:max_content_tokens - keep_tail] + marker + ids[len(ids) - keep_tail:]
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


def tool_sums(out):
    """The tool statistics of a ToolRollouts as sums, which add up over batches (the rounds and
    ranks of a training step) before `tool_metrics` turns them into means."""
    return {"responses": len(out.token_ids), "tokens": sum(out.lengths),
            "tool_calls": sum(out.num_calls), "tool_errors": sum(out.num_errors),
            "tool_timeouts": sum(out.num_timeouts), "tool_invalid": sum(out.num_invalid),
            "sandbox_failures": sum(out.num_sandbox_failures),
            "tool_tokens": sum(map(sum, out.tool_mask)),
            "max_turns": out.finish_reasons.count("max_turns")}


def tool_metrics(sums):
    """rollout/ metrics of `tool_sums` (added up over any batches): calls per response, errors,
    timeouts, the sandbox's own failures (also errors) and invalid calls per call, the tool tokens'
    share of the tokens; the counts of calls and sandbox failures (train.sandbox_guard's window)."""
    responses, calls = max(sums["responses"], 1), max(sums["tool_calls"], 1)
    return {"rollout/tool_calls": sums["tool_calls"],
            "rollout/sandbox_failures": sums["sandbox_failures"],
            "rollout/sandbox_failure_frac": sums["sandbox_failures"] / calls,
            "rollout/tool_calls_mean": sums["tool_calls"] / responses,
            "rollout/tool_error_frac": sums["tool_errors"] / calls,
            "rollout/tool_timeout_frac": sums["tool_timeouts"] / calls,
            "rollout/tool_invalid_frac": sums["tool_invalid"] / calls,
            "rollout/tool_token_frac": sums["tool_tokens"] / max(sums["tokens"], 1),
            "rollout/max_turns_frac": sums["max_turns"] / responses}
