"""tool_use.generate_with_tools on the real vLLM engine, the real sandbox and tools/tiny.py's
tool-use model (the tiny model after a short warm-up on code-interpreter conversations). No fake
engine, no fake sandbox."""

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import config
import data
import rollout
import sandbox
import tool_use

MAX_TURNS = 3
MAX_TOKENS = 400
# a wall-clock ceiling no run here reaches, even on a loaded machine: a timeout would change a
# tool turn's text, and the tests compare conversations token for token
SANDBOX = config.SandboxConfig(timeout_s=60, max_workers=4)
# a prefill: the first turn calls
CALL_HEAD = '<tool_call>\n{"name": "code_interpreter", "arguments": {"code": '


def rollout_cfg(n=4, max_tokens=MAX_TOKENS, max_turns=MAX_TURNS):
    """The rollout section of a tool-use call here (temperature 1, no top-p or top-k)."""
    return config.RolloutConfig(n=n, max_tokens=max_tokens, max_turns=max_turns, tools=True)


@pytest.fixture(scope="module")
def model_dir(tool_dir):
    return tool_dir / "tool_model"


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    return AutoTokenizer.from_pretrained(model_dir)


@pytest.fixture(scope="module")
def engine(model_dir):
    # as in test_rollout.py: float32 (agreement with a transformers forward), eager, 32-token blocks
    engine_cfg = config.RolloutConfig(dtype="float32", kv_cache_gib=0.25, max_num_seqs=64,
                                      enforce_eager=True)
    engine = rollout.build_engine(engine_cfg, model_dir, seed=0, max_model_len=512, block_size=32)
    yield engine
    # and its process group, so that another module can build its own engine
    rollout.shutdown_engine(engine)


@pytest.fixture(scope="module")
def examples(tiny_dir):
    # "What is a*b?"
    return data.load_examples(tiny_dir / "data" / "mul_test.jsonl", prompt_suffix=None)[:4]


@pytest.fixture(scope="module")
def prompts(examples, tokenizer):
    prompt_ids, _, _ = data.tokenize_prompts(examples, tokenizer, max_prompt_tokens=96)
    return prompt_ids


@pytest.fixture(scope="module")
def recorded(engine, tokenizer, prompts):
    """One batch (4 prompts x 4 samples), with what reached the engine and the sandbox recorded along the way."""
    engine_calls, sandbox_calls = [], []
    real_generate, real_run_batch = engine.generate, sandbox.run_batch

    def recording_generate(requests, params, **kwargs):
        engine_calls.append([p.seed for p in params])
        return real_generate(requests, params, **kwargs)

    def recording_run_batch(codes, config=None):
        sandbox_calls.append(list(codes))
        return real_run_batch(codes, config)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(engine, "generate", recording_generate)
        patch.setattr(sandbox, "run_batch", recording_run_batch)
        out = tool_use.generate_with_tools(
            engine, tokenizer, prompts, [0, 1, 2, 3], rollout_cfg(), SANDBOX)
    return out, engine_calls, sandbox_calls


def runs(mask):
    """[(is_tool, start, end)] of the maximal runs of equal tool_mask values."""
    out, start = [], 0
    for t in range(1, len(mask) + 1):
        if t == len(mask) or mask[t] != mask[start]:
            out.append((mask[start], start, t))
            start = t
    return out


def expected_tool_turn(model_text):
    """The tool turn that must follow a model turn ending in a call, computed independently of
    rollout.py: the JSON parsed here, the code run in a fresh sandbox, the output wrapped as
    Qwen2.5's template writes a tool message. -> (prefix, content or None for an invalid call,
    suffix)."""
    try:  # a call without its opening tag is invalid too (rindex raises ValueError)
        body = model_text[
            model_text.rindex("<tool_call>") + len("<tool_call>") : model_text.rindex(
                "</tool_call>")]
        call = json.loads(body)
        assert call["name"] == "code_interpreter"
        content = sandbox.format_result(sandbox.run_code(call["arguments"]["code"], SANDBOX))
    except (ValueError, KeyError, TypeError, AssertionError):
        # an invalid call: the content is rollout.py's error message, tested on its own
        content = None
    return ("<|im_end|>\n<|im_start|>user\n<tool_response>\n", content,
            "\n</tool_response><|im_end|>\n<|im_start|>assistant\n")


def test_conversations_stop_at_different_turns(recorded, tokenizer):
    out, engine_calls, sandbox_calls = recorded
    eos = tokenizer.eos_token_id
    assert out.prompt_index == [i for i in range(4) for _ in range(4)]
    assert len(out.token_ids) == len(out.logprobs) == len(out.tool_mask) == len(out.texts) == 16
    # some answered at once, some after a call
    assert len(set(out.num_turns)) > 1 and max(out.num_calls) > 0
    for i in range(16):
        ids, reason, turns, calls = (
            out.token_ids[i], out.finish_reasons[i], out.num_turns[i], out.num_calls[i])
        assert len(ids) == len(out.logprobs[i]) == len(out.tool_mask[i]) <= MAX_TOKENS
        assert reason in ("stop", "length", "max_turns")
        model_runs = [r for r in runs(out.tool_mask[i]) if not r[0]]
        assert len(model_runs) == turns and sum(r[0] for r in runs(out.tool_mask[i])) == calls
        if reason == "stop":  # answered: one more model turn than calls, ending on EOS
            assert turns == calls + 1 and ids[-1] == eos
        if reason == "max_turns":  # the last allowed turn made a call, which was not run
            assert (
                turns == MAX_TURNS
                and calls == MAX_TURNS - 1
                and out.texts[i].endswith("</tool_call>"))
        if reason == "length":
            assert len(ids) == MAX_TOKENS
        assert out.num_errors[i] <= calls and out.num_timeouts[i] <= out.num_errors[i]
        assert out.num_invalid[i] <= out.num_errors[i]
    # one engine.generate call per turn, over every unfinished conversation; one sandbox batch per
    # turn with calls
    assert len(engine_calls) == max(out.num_turns)
    active = [sum(t > k for t in out.num_turns) for k in range(len(engine_calls))]
    assert [len(seeds) for seeds in engine_calls] == active
    assert sum(map(len, sandbox_calls)) == sum(out.num_calls) - sum(out.num_invalid)
    assert len(sandbox_calls) <= MAX_TURNS - 1
    # the verifier's text is the final model turn: after the last tool turn, special tokens skipped
    for i in range(16):
        last = runs(out.tool_mask[i])[-1]
        if not last[0]:
            assert out.texts[i] == tokenizer.decode(
                out.token_ids[i][last[1] :], skip_special_tokens=True)
        assert out.full_texts[i] == tokenizer.decode(out.token_ids[i])


def test_tool_mask_marks_exactly_the_tool_turns(recorded, tokenizer):
    out = recorded[0]
    encode = lambda text: tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    checked = 0
    for ids, mask, logprobs, reason in zip(
        out.token_ids, out.tool_mask, out.logprobs, out.finish_reasons):
        pieces = runs(mask)
        assert not pieces[0][0]  # a response starts with the model's turn (no prefill here)
        for k, (is_tool, start, end) in enumerate(pieces):
            if not is_tool:  # the model's own tokens: no part of a tool turn among them
                assert "<tool_response>" not in tokenizer.decode(ids[start:end])
                continue
            # a tool run follows a model turn that ends in a call, and is exactly the tool turn of
            # that call
            model_text = tokenizer.decode(
                ids[pieces[k - 1][1] : pieces[k - 1][2]], skip_special_tokens=True)
            assert model_text.endswith("</tool_call>")
            prefix, content, suffix = expected_tool_turn(model_text)
            turn, head, tail = ids[start:end], encode(prefix), encode(suffix)
            cut = end == len(ids) and reason == "length"  # the last tool turn, cut to the budget
            if content is not None:
                expected = head + encode(content.rstrip("\n")) + tail
                assert turn == (expected[:len(turn)] if cut else expected)
                checked += 1
            else:
                assert turn[: len(head)] == head[: len(turn)] and (
                    cut or turn[len(turn) - len(tail) :] == tail)
            assert all(lp == 0.0 for lp in logprobs[start:end])
            # and the model speaks next
            assert cut or (k + 1 < len(pieces) and not pieces[k + 1][0])
    assert checked > 0


def test_model_token_logprobs_match_an_independent_forward(recorded, tokenizer, prompts, model_dir):
    # the sequence a trainer rebuilds, prompt + token_ids, is what the model saw at every turn: a
    # transformers forward over it (float64 softmax) gives the engine's log-probs at every model
    # token
    out = recorded[0]
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    worst, model_tokens = 0.0, 0
    for prompt_index, ids, logprobs, mask in zip(
        out.prompt_index, out.token_ids, out.logprobs, out.tool_mask):
        prompt = prompts[prompt_index]
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([list(prompt) + ids])).logits[0].double()
        log_pi = torch.log_softmax(logits, -1)[
            torch.arange(len(prompt) - 1, len(prompt) + len(ids) - 1), torch.tensor(ids)]
        keep = ~torch.tensor(mask)
        worst = max(
            worst,
            (torch.tensor(logprobs, dtype=torch.float64)[keep] - log_pi[keep]).abs().max().item())
        model_tokens += int(keep.sum())
    print(f"max |engine - transformers| over {model_tokens} model tokens = {worst:.2e}")
    assert worst < 1e-4


def test_same_seeds_same_responses_whatever_the_batch(recorded, engine, tokenizer, prompts):
    out = recorded[0]
    again = tool_use.generate_with_tools(
        engine, tokenizer, prompts, [0, 1, 2, 3], rollout_cfg(), SANDBOX)
    assert again.token_ids == out.token_ids and again.tool_mask == out.tool_mask
    assert again.finish_reasons == out.finish_reasons
    # a prompt alone samples what it sampled in the batch, although the batch's conversations ended
    # at other turns
    alone = tool_use.generate_with_tools(
        engine, tokenizer, prompts[2:3], [2], rollout_cfg(), SANDBOX)
    assert alone.token_ids == out.token_ids[8:12]
    # the first turn is what rollout.generate samples with the same seed (seed * n + j, vLLM's child
    # seeds)
    single = rollout.generate(engine, prompts, n=4, max_tokens=MAX_TOKENS, seeds=[0, 1, 2, 3])
    for i in range(16):
        if out.num_turns[i] == 1 and out.finish_reasons[i] == "stop":
            assert single.token_ids[i] == out.token_ids[i]
        first = runs(out.tool_mask[i])[0][2]
        assert single.token_ids[i][:first] == out.token_ids[i][:first]


def test_max_turns_ends_conversations_whose_last_turn_calls(recorded, engine, tokenizer, prompts,
                                                            monkeypatch):
    # the same seeds with one turn fewer: every turn samples what it sampled before (a turn's seed
    # does not depend on max_turns), so the conversations that called twice now end by max_turns,
    # their second call not run
    out, _, sandbox_calls = recorded
    ran = []
    real_run_batch = sandbox.run_batch
    monkeypatch.setattr(
        sandbox, "run_batch",
        lambda codes, config=None: ran.extend(codes) or real_run_batch(codes, config))
    short = tool_use.generate_with_tools(
        engine, tokenizer, prompts, [0, 1, 2, 3], rollout_cfg(max_turns=MAX_TURNS - 1), SANDBOX)
    # (which conversations call twice depends on the warmed-up model, hence on the CPU it was built
    # on)
    assert ("max_turns" in short.finish_reasons) == any(
        calls >= MAX_TURNS - 1 for calls in out.num_calls)
    assert ran == sandbox_calls[0]  # the first turn's calls only
    for i in range(16):
        tool_runs = [r for r in runs(out.tool_mask[i]) if r[0]]
        # its turn MAX_TURNS - 1 did not call (or never came): nothing changes
        if len(tool_runs) < MAX_TURNS - 1:
            assert (
                short.token_ids[i] == out.token_ids[i]
                and short.finish_reasons[i] == out.finish_reasons[i])
        else:
            _, _, end = [r for r in runs(out.tool_mask[i]) if not r[0]][MAX_TURNS - 2]
            assert (
                short.finish_reasons[i] == "max_turns"
                and short.token_ids[i] == out.token_ids[i][:end])
            assert short.num_turns[i] == MAX_TURNS - 1 and short.num_calls[i] == MAX_TURNS - 2
            assert short.texts[i].endswith("</tool_call>")
    # a single turn: no code runs at all
    monkeypatch.setattr(sandbox, "run_batch", lambda codes, config=None: pytest.fail("code ran"))
    one = tool_use.generate_with_tools(
        engine, tokenizer, prompts, [0, 1, 2, 3], rollout_cfg(max_turns=1), SANDBOX)
    assert not any(map(any, one.tool_mask)) and sum(one.num_calls) == 0
    assert [r == "max_turns" for r in one.finish_reasons] == [t > 1 for t in out.num_turns]
    assert "max_turns" in one.finish_reasons  # most first turns call: the single-turn run ends them


def prefilled(prompts, examples, tokenizer, quote):
    """The prompts with the assistant's message prefilled with a call of print(a*b) up to its closing tag, which the
    model writes (the warmed-up model does, in context; the call is read from the prefill and the sampled tag).
    quote: '"' makes valid JSON; "'" makes a call that is not JSON, of the same length (the tiny model keeps its
    place in the template by counting characters)."""
    heads = [
        CALL_HEAD
        + quote
        + "print("
        + e.messages[0]["content"].removeprefix("What is ").removesuffix("?")
        + ")"
        + quote
        + "}}\n"
        for e in examples]
    return [
        list(p) + tokenizer.encode(head, add_special_tokens=False)
        for p, head in zip(prompts, heads)]


@pytest.mark.parametrize("quote", ['"', "'"])
def test_prefilled_calls_valid_and_invalid(
    engine, tokenizer, prompts, examples, monkeypatch, quote):
    ran = []
    real_run_batch = sandbox.run_batch
    monkeypatch.setattr(
        sandbox, "run_batch",
        lambda codes, config=None: ran.extend(codes) or real_run_batch(codes, config))
    out = tool_use.generate_with_tools(
        engine, tokenizer, prefilled(prompts[:2], examples, tokenizer, quote), [5, 6],
        rollout_cfg(n=2, max_turns=2), SANDBOX)
    close = tokenizer.encode("</tool_call>", add_special_tokens=False)
    prefix = tokenizer.encode(tool_use.QWEN_TOOL_TURN[0], add_special_tokens=False)
    for i in range(4):
        ids, mask = out.token_ids[i], out.tool_mask[i]
        # the model closed the call
        assert runs(mask)[0] == (False, 0, len(close)) and ids[:len(close)] == close
        _, start, end = runs(mask)[1]
        assert ids[start:start + len(prefix)] == prefix and out.num_calls[i] == 1
        text = tokenizer.decode(ids[start:end])
        if quote == '"':  # run in the sandbox, the product comes back
            product = examples[out.prompt_index[i]].ground_truth
            assert f"<tool_response>\n{product}\n</tool_response>" in text
            assert out.num_invalid[i] == out.num_errors[i] == 0
        else:  # not run: the parser's message comes back instead
            assert "<tool_response>\nError: the tool call is not valid JSON (" in text
            assert out.num_invalid[i] == out.num_errors[i] == 1
    codes = [f"print({e.messages[0]['content'][8:-1]})" for e in examples[:2] for _ in range(2)]
    # the second turn's calls, if any, end by max_turns: not run
    assert ran == (codes if quote == '"' else [])


def test_token_budget_counts_tool_tokens(engine, tokenizer, prompts, examples):
    # a budget that ends inside the tool turn: the result is cut to it and the conversation ends by
    # length
    out = tool_use.generate_with_tools(
        engine, tokenizer, prefilled(prompts[:2], examples, tokenizer, '"'), [5, 6],
        rollout_cfg(n=2, max_tokens=30, max_turns=3), SANDBOX)
    assert out.finish_reasons == ["length"] * 4 and out.lengths == [30] * 4
    # 12: the model's "</tool_call>"
    assert all(mask == [False] * 12 + [True] * 18 for mask in out.tool_mask)
    # a budget that ends inside the model's first turn: no tool turn at all
    out = tool_use.generate_with_tools(
        engine, tokenizer, prompts, [0, 1, 2, 3], rollout_cfg(n=2, max_tokens=12, max_turns=3),
        SANDBOX)
    assert max(out.lengths) <= 12 and not any(map(any, out.tool_mask)) and sum(out.num_calls) == 0
    assert all(
        r == "stop" or (r == "length" and n == 12) for r, n in zip(out.finish_reasons, out.lengths))
    assert "length" in out.finish_reasons  # a call is longer than 12 tokens


def test_parse_tool_call():
    call = (
        '<tool_call>\n{"name": "code_interpreter", "arguments": {"code": "print(1)"}}\n</tool_call>'
    )
    assert tool_use.parse_tool_call("Let me compute. " + call) == ("print(1)", None)
    assert tool_use.parse_tool_call(call.replace("\n", "")) == ("print(1)", None)
    as_string = '<tool_call>{"name": "code_interpreter", "arguments": "{\\"code\\": \\"x = 2\\"}"}</tool_call>'
    assert tool_use.parse_tool_call(as_string) == ("x = 2", None)
    # the last opening tag counts: an earlier, abandoned one does not
    assert tool_use.parse_tool_call("<tool_call> oops " + call) == ("print(1)", None)
    for text, expected in [
        (
            '<tool_call>{"name": "code_interpreter", "arguments": {"code": print(1)}}</tool_call>',
            "not valid JSON"),
        (
            '<tool_call>{"name": "python", "arguments": {"code": "print(1)"}}</tool_call>',
            "unknown function 'python'"),
        ('<tool_call>["code_interpreter"]</tool_call>', "unknown function None"),
        (
            '<tool_call>{"name": "code_interpreter", "arguments": {"cmd": "ls"}}</tool_call>',
            '{"code"'),
        (
            '<tool_call>{"name": "code_interpreter", "arguments": {"code": 3}}</tool_call>',
            '{"code"'),
        (
            '{"name": "code_interpreter", "arguments": {"code": "1"}}</tool_call>',
            "without <tool_call>")]:
        code, error = tool_use.parse_tool_call(text)
        assert code is None and error.startswith("Error: ") and expected in error, (text, error)


def test_tool_turn_ids(tokenizer):
    wrapper = [tokenizer.encode(part, add_special_tokens=False) for part in tool_use.QWEN_TOOL_TURN]
    ids = tool_use.tool_turn_ids(tokenizer, "42\n", wrapper, 100)
    assert (
        tokenizer.decode(ids)
        == "<|im_end|>\n<|im_start|>user\n<tool_response>\n42\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n")
    # a program printing a control token shows the model its characters, not the token
    ids = tool_use.tool_turn_ids(tokenizer, "<|im_end|>", wrapper, 100)
    content = ids[len(wrapper[0]):len(ids) - len(wrapper[1])]
    assert tokenizer.eos_token_id not in content and tokenizer.decode(content) == "<|im_end|>"
    # a long output keeps its head and its tail (where the error line is) around a marker
    long = "".join(f"{i}\n" for i in range(200)) + "Error: uncaught exception"
    ids = tool_use.tool_turn_ids(tokenizer, long, wrapper, 60)
    text = tokenizer.decode(ids[len(wrapper[0]):len(ids) - len(wrapper[1])])
    assert text.startswith("0\n1\n2\n") and text.endswith("\nError: uncaught exception")
    omitted = len(tokenizer.encode(long, add_special_tokens=False)) - 60
    assert f"[... {omitted} tokens of output omitted ...]" in text
    assert len(ids) - len(wrapper[0]) - len(wrapper[1]) - len(tokenizer.encode(
        f"\n[... {omitted} tokens of output omitted ...]\n", add_special_tokens=False)) == 60


def test_turn_seeds():
    # as generate: 7 * 4 + j
    assert [tool_use.turn_seed(7, 4, j, 0) for j in range(4)] == [28, 29, 30, 31]
    seeds = {tool_use.turn_seed(s, 4, j, t) for s in range(50) for j in range(4) for t in range(5)}
    assert len(seeds) == 50 * 4 * 5 and all(0 <= s < 2**56 for s in seeds)
    # a pure function (no Python hash())
    assert tool_use.turn_seed(3, 4, 1, 2) == tool_use.turn_seed(3, 4, 1, 2)


def test_tool_mask_and_metrics(recorded):
    out = recorded[0]
    assert [len(row) for row in out.tool_mask] == out.lengths == [len(row) for row in out.logprobs]
    assert all(
        lp == 0.0
        for row, tools in zip(out.logprobs, out.tool_mask)
        for lp, tool in zip(row, tools)
        if tool)
    metrics = tool_use.tool_metrics(tool_use.tool_sums(out))
    assert metrics["rollout/tool_calls_mean"] == sum(out.num_calls) / 16
    assert 0 < metrics["rollout/tool_token_frac"] < 1


def test_many_long_contexts_in_one_step(engine, tokenizer, prompts):
    # later turns send long contexts; more prompt tokens than one engine step takes
    # (max_num_batched_tokens, 8192 here) used to split a seeded prompt across steps, which crashes
    # vLLM 0.32 on CPU (see rollout.build_engine) 24 x ~450 tokens > 8192, all different (a shared
    # prefix would come from the prefix cache)
    long = [tokenizer.encode(f"{i:03d}4567\n" * 52, add_special_tokens=False) + list(prompts[i % 4])
            for i in range(24)]
    out = tool_use.generate_with_tools(
        engine, tokenizer, long, list(range(24)), rollout_cfg(n=1, max_tokens=8, max_turns=2),
        SANDBOX)
    assert len(out.token_ids) == 24 and all(0 < n <= 8 for n in out.lengths)
