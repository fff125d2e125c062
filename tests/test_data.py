"""Tests for data.py: both row formats in both file formats, the suffix rule, every malformed-input
message, the save/load round trip, and tokenization against an independent character-by-character
construction of the chat template. The tokenizer is built here, offline: one token per character
plus Qwen's three special tokens."""

import json
import re

import numpy as np
import pyarrow
import pyarrow.parquet
import pytest
import torch
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

import data

SPECIAL_TOKENS = ["<|im_start|>", "<|im_end|>", "<|endoftext|>"]
CHARACTERS = [chr(code) for code in range(32, 127)] + ["\n"]
VOCAB = {token: index for index, token in enumerate(SPECIAL_TOKENS + ["<unk>"] + CHARACTERS)}
QWEN_STYLE_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.fixture(scope="module")
def tokenizer():
    backend = Tokenizer(models.WordLevel(VOCAB, unk_token="<unk>"))
    # every character is a token
    backend.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
    backend.decoder = decoders.Fuse()
    backend.add_special_tokens(SPECIAL_TOKENS)
    wrapped = transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    wrapped.chat_template = QWEN_STYLE_TEMPLATE
    return wrapped


def expected_ids(messages):
    """The chat template written out by hand, then tokenized by walking the string: special token or one character."""
    text = (
        "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
        + "<|im_start|>assistant\n")
    ids, position = [], 0
    while position < len(text):
        special = next(
            (token for token in SPECIAL_TOKENS if text.startswith(token, position)), None)
        token = special or text[position]
        ids.append(VOCAB[token])
        position += len(token)
    return ids


def write_jsonl(path, rows):
    """Rows may be dicts/lists (dumped as JSON) or raw strings (written verbatim, for malformed lines)."""
    lines = [row if isinstance(row, str) else json.dumps(row) for row in rows]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def write_parquet(path, rows):
    pyarrow.parquet.write_table(pyarrow.Table.from_pylist(rows), path)
    return path


VERL_ROWS = [
    {
        "prompt": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "1+1? Answer in \\boxed{}."}],
        "reward_model": {"ground_truth": "2", "style": "rule"},
        "data_source": "Short_CoT",
        "extra_info": {"index": 0},
    },
    {
        "prompt": [{"role": "user", "content": "6*7?"}],
        "reward_model": {"ground_truth": 42},
        "data_source": "AIME24",
    }]
PLAIN_ROWS = [
    {"problem": "What is 2+3?", "answer": "5", "data_source": "toy"},
    {"problem": "What is 6*7?", "answer": 42}]


# --------------------------------------------------------------------------------------------------
# Loading: each format
# --------------------------------------------------------------------------------------------------


def check_verl_examples(examples, origins):
    # as given, no suffix
    assert [e.messages for e in examples] == [VERL_ROWS[0]["prompt"], VERL_ROWS[1]["prompt"]]
    assert [e.ground_truth for e in examples] == ["2", "42"]
    assert [e.data_source for e in examples] == ["Short_CoT", "AIME24"]
    assert [e.origin for e in examples] == origins


def check_plain_examples(examples, origins, stem):
    assert [e.messages for e in examples] == [
        [{"role": "user", "content": "What is 2+3?\n" + data.STARE_SUFFIX}],
        [{"role": "user", "content": "What is 6*7?\n" + data.STARE_SUFFIX}]]
    assert [e.ground_truth for e in examples] == ["5", "42"]
    assert [e.data_source for e in examples] == ["toy", stem]
    assert [e.origin for e in examples] == origins


def test_verl_jsonl(tmp_path):
    # blank lines skipped
    path = write_jsonl(tmp_path / "verl.jsonl", [VERL_ROWS[0], "", "   ", VERL_ROWS[1]])
    check_verl_examples(data.load_examples(path), [f"{path}:1", f"{path}:4"])


def test_plain_jsonl(tmp_path):
    path = write_jsonl(tmp_path / "plain.jsonl", PLAIN_ROWS)
    check_plain_examples(data.load_examples(path), [f"{path}:1", f"{path}:2"], stem="plain")


def test_verl_parquet(tmp_path):
    # A Parquet column has one type, so the integer ground truth 42 is stored as the string "42"
    # next to "2".
    second = {
        **VERL_ROWS[1],
        "reward_model": {"ground_truth": "42", "style": "rule"},
        "extra_info": {"index": 1},
    }
    path = write_parquet(tmp_path / "verl.parquet", [VERL_ROWS[0], second])
    check_verl_examples(data.load_examples(path), [f"{path} row 1", f"{path} row 2"])


def test_verl_parquet_integer_ground_truth_column(tmp_path):
    rows = [
        {
            "prompt": [{"role": "user", "content": "q"}],
            "reward_model": {"ground_truth": 7},
            "data_source": "d",
        }]
    assert data.load_examples(write_parquet(tmp_path / "ints.parquet", rows))[0].ground_truth == "7"


def test_plain_parquet(tmp_path):
    rows = [
        {**PLAIN_ROWS[0], "answer": "5"}, {**PLAIN_ROWS[1], "answer": "42", "data_source": None}]
    # a null data_source falls back like an absent one
    path = write_parquet(tmp_path / "plain.parquet", rows)
    check_plain_examples(data.load_examples(path), [f"{path} row 1", f"{path} row 2"], stem="plain")


def test_verl_row_from_pandas_style_numpy_arrays():
    # pandas.read_parquet hands back the prompt column as numpy object arrays of dicts and numbers
    # as numpy scalars.
    row = {
        "prompt": np.array([{"role": "user", "content": "q"}], dtype=object),
        "reward_model": {"ground_truth": np.int64(12)},
    }
    example = data._example_from_row(row, "x.parquet row 1", "x", data.STARE_SUFFIX)
    assert example.messages == [{"role": "user", "content": "q"}] and type(example.messages) is list
    assert example.ground_truth == "12"
    plain = {"problem": "p", "answer": np.float64(3.0)}
    assert data._example_from_row(plain, "x.parquet row 2", "x", None).ground_truth == "3"


# --------------------------------------------------------------------------------------------------
# Suffix rule, ground truth numbers, data_source precedence
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("suffix", [None, ""])
def test_no_suffix_means_problem_alone(tmp_path, suffix):
    path = write_jsonl(tmp_path / "plain.jsonl", PLAIN_ROWS)
    examples = data.load_examples(path, prompt_suffix=suffix)
    assert [e.messages[0]["content"] for e in examples] == ["What is 2+3?", "What is 6*7?"]


def test_custom_suffix_is_added_to_plain_but_never_to_verl(tmp_path):
    path = write_jsonl(tmp_path / "mixed.jsonl", [PLAIN_ROWS[0], VERL_ROWS[1]])
    plain, verl = data.load_examples(path, prompt_suffix="Think.")
    assert plain.messages == [{"role": "user", "content": "What is 2+3?\nThink."}]
    assert verl.messages == VERL_ROWS[1]["prompt"]


def test_stare_suffix_matches_the_reference():
    # docs/method.md, "The reference release": the reference appends "\n" + this sentence to every
    # DAPO-Math-17K problem.
    assert (
        data.STARE_SUFFIX
        == r"Please reason step by step, and put your final answer within \boxed{}.")


@pytest.mark.parametrize(
    "answer, expected",
    [
        (42, "42"),
        (-3, "-3"),
        (0, "0"),
        (10**30, "1" + "0" * 30),
        (42.0, "42"),
        (-0.0, "0"),
        (0.1, "0.1"),
        (2.5e-07, "0.00000025"),  # not "2.5e-07": math-verify reads that "e" as Euler's number
        (1e-05, "0.00001"),
        (1.5e20, "150000000000000000000"),
        ("  3/4 ", "  3/4 "),  # strings are kept exactly
        ("\\frac{1}{2}", "\\frac{1}{2}")])
def test_ground_truth_numbers_and_strings(tmp_path, answer, expected):
    plain = write_jsonl(tmp_path / "plain.jsonl", [{"problem": "p", "answer": answer}])
    verl = write_jsonl(
        tmp_path / "verl.jsonl", [{**VERL_ROWS[1], "reward_model": {"ground_truth": answer}}])
    assert data.load_examples(plain)[0].ground_truth == expected
    assert data.load_examples(verl)[0].ground_truth == expected


def test_data_source_precedence(tmp_path):
    rows = [{"problem": "a", "answer": 1, "data_source": "own"}, {"problem": "b", "answer": 2}]
    path = write_jsonl(tmp_path / "math_train.jsonl", rows)
    # row, else file stem
    assert [e.data_source for e in data.load_examples(path)] == ["own", "math_train"]
    assert [e.data_source for e in data.load_examples(path, default_data_source="dflt")] == [
        "own", "dflt"]


# --------------------------------------------------------------------------------------------------
# Malformed input: every message names the file, the line or row, and the problem
# --------------------------------------------------------------------------------------------------

GOOD_PLAIN = {"problem": "p", "answer": "1"}
GOOD_VERL = {"prompt": [{"role": "user", "content": "q"}], "reward_model": {"ground_truth": "1"}}

MALFORMED_JSONL_ROWS = [
    ('{"problem": "p", "answer": ', "invalid JSON (Expecting value at column 28)"),
    ("[1, 2]", "row must be a JSON object, got list"),
    ('"just a string"', "row must be a JSON object, got str"),
    (
        {"question": "p", "answer": 1},
        "row has neither 'prompt' (verl format) nor 'problem' (plain format)"),
    ({"problem": "p"}, "missing field 'answer'"),
    ({"problem": "p", "answer": None}, "missing field 'answer'"),
    ({"problem": None, "answer": 1}, "missing field 'problem'"),
    ({"problem": "   ", "answer": 1}, "field 'problem' is empty"),
    ({"problem": 5, "answer": 1}, "field 'problem' must be a string, got int"),
    ({"problem": "p", "answer": ""}, "field 'answer' is empty"),
    ({"problem": "p", "answer": True}, "field 'answer' must be a string or a number, got bool"),
    ({"problem": "p", "answer": [1, 2]}, "field 'answer' must be a string or a number, got list"),
    ({**GOOD_PLAIN, "data_source": 3}, "field 'data_source' must be a string, got int"),
    ({**GOOD_PLAIN, "data_source": ""}, "field 'data_source' is empty"),
    ({"prompt": [{"role": "user", "content": "q"}]}, "missing field 'reward_model'"),
    (
        {**GOOD_VERL, "reward_model": "1"},
        "field 'reward_model' must be an object with a 'ground_truth'"),
    ({**GOOD_VERL, "reward_model": {"style": "rule"}}, "missing field 'reward_model.ground_truth'"),
    (
        {**GOOD_VERL, "reward_model": {"ground_truth": " "}},
        "field 'reward_model.ground_truth' is empty"),
    (
        {**GOOD_VERL, "prompt": []},
        "field 'prompt' must be a non-empty list of {role, content} messages"),
    (
        {**GOOD_VERL, "prompt": "q"},
        "field 'prompt' must be a non-empty list of {role, content} messages"),
    (
        {**GOOD_VERL, "prompt": None},
        "field 'prompt' must be a non-empty list of {role, content} messages"),
    (
        {**GOOD_VERL, "prompt": ["q"]},
        "field 'prompt' must be a non-empty list of {role, content} messages"),
    (
        {**GOOD_VERL, "prompt": [{"role": "user"}]},
        "field 'prompt' message 1 needs a string 'content', got None"),
    (
        {**GOOD_VERL, "prompt": [{"content": "q"}]},
        "field 'prompt' message 1 needs a string 'role', got None"),
    (
        {
            **GOOD_VERL,
            "prompt": [{"role": "system", "content": "s"}, {"role": "user", "content": ""}],
        },
        "field 'prompt' message 2 has empty 'content'")]


@pytest.mark.parametrize("bad_row, problem", MALFORMED_JSONL_ROWS)
def test_malformed_jsonl_row_names_file_line_and_problem(tmp_path, bad_row, problem):
    # The bad row sits on line 4, after a good row and two blank lines: the line number counts blank
    # lines too.
    path = write_jsonl(tmp_path / "bad.jsonl", [GOOD_PLAIN, "", "", bad_row, GOOD_VERL])
    with pytest.raises(ValueError) as raised:
        data.load_examples(path)
    assert str(raised.value) == f"{path}:4: {problem}"


@pytest.mark.parametrize(
    "rows, problem",
    [
        ([GOOD_PLAIN, {"problem": "p", "answer": None}], "row 2: missing field 'answer'"),
        ([GOOD_PLAIN, {"problem": "", "answer": "1"}], "row 2: field 'problem' is empty"),
        ([GOOD_VERL, {**GOOD_VERL, "reward_model": {"ground_truth": None}}],
         "row 2: missing field 'reward_model.ground_truth'"),
        ([{**GOOD_VERL, "prompt": []}, GOOD_VERL],
         "row 1: field 'prompt' must be a non-empty list of {role, content} messages")])
def test_malformed_parquet_row_names_file_row_and_problem(tmp_path, rows, problem):
    path = write_parquet(tmp_path / "bad.parquet", rows)
    with pytest.raises(ValueError) as raised:
        data.load_examples(path)
    assert str(raised.value) == f"{path} {problem}"


def test_invalid_utf8_names_the_line(tmp_path):
    path = tmp_path / "bytes.jsonl"
    path.write_bytes(
        json.dumps(GOOD_PLAIN).encode() + b"\n" + b'{"problem": "\xff", "answer": 1}\n')
    with pytest.raises(ValueError, match=re.escape(f"{path}:2: not valid UTF-8")):
        data.load_examples(path)


def test_byte_order_mark_is_tolerated(tmp_path):
    path = tmp_path / "bom.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + json.dumps(GOOD_PLAIN).encode() + b"\n")
    assert data.load_examples(path)[0].ground_truth == "1"


def test_unicode_line_separator_inside_a_string_is_not_a_line_break(tmp_path):
    path = tmp_path / "u2028.jsonl"
    # valid JSON, unescaped U+2028
    path.write_text('{"problem": "a\u2028b", "answer": 1}\n', encoding="utf-8")
    assert data.load_examples(path, prompt_suffix=None)[0].messages[0]["content"] == "a\u2028b"


def test_file_level_errors(tmp_path):
    missing = tmp_path / "nope.jsonl"
    with pytest.raises(ValueError, match=re.escape(f"{missing}: no such file")):
        data.load_examples(missing)
    csv = tmp_path / "train.csv"
    csv.write_text("problem,answer\n")
    with pytest.raises(
        ValueError,
        match=re.escape(f"{csv}: unknown extension '.csv' (expected .jsonl or .parquet)")):
        data.load_examples(csv)
    blank = tmp_path / "blank.jsonl"
    blank.write_text("\n  \n\n")
    with pytest.raises(ValueError, match=re.escape(f"{blank}: no examples")):
        data.load_examples(blank)
    empty_table = tmp_path / "empty.parquet"
    pyarrow.parquet.write_table(
        pyarrow.table({"problem": pyarrow.array([], pyarrow.string())}), empty_table)
    with pytest.raises(ValueError, match=re.escape(f"{empty_table}: no examples")):
        data.load_examples(empty_table)
    corrupt = tmp_path / "corrupt.parquet"
    corrupt.write_text("not parquet")
    with pytest.raises(ValueError, match=re.escape(f"{corrupt}: not a readable Parquet file")):
        data.load_examples(corrupt)


# --------------------------------------------------------------------------------------------------
# save_jsonl
# --------------------------------------------------------------------------------------------------


def test_save_jsonl_round_trip(tmp_path):
    rows = [
        {"problem": "What is 2+3?", "answer": "5", "data_source": "toy"},
        # non-ASCII survives; no data_source -> file stem
        {"problem": "Solve x² = 4, x > 0.", "answer": 2},
        {"problem": "Half of 1?", "answer": 0.5, "data_source": None}]
    path = tmp_path / "splits" / "train.jsonl"  # parent directory is created
    assert data.save_jsonl((row for row in rows), path) == 3  # a generator is fine
    written = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]
    assert written == [rows[0], rows[1], {"problem": "Half of 1?", "answer": 0.5}]
    examples = data.load_examples(path)
    assert [e.messages[0]["content"] for e in examples] == [
        r["problem"] + "\n" + data.STARE_SUFFIX for r in rows]
    assert [e.ground_truth for e in examples] == ["5", "2", "0.5"]
    assert [e.data_source for e in examples] == ["toy", "train", "train"]


@pytest.mark.parametrize(
    "bad_row, problem",
    [
        ({"problem": "p", "answer": 1, "split": "train"}, "unknown field(s) ['split']"),
        ({"answer": 1}, "missing field 'problem'"), ({"problem": "p"}, "missing field 'answer'"),
        ({"problem": "p", "answer": float("nan")}, "field 'answer' must be finite, got nan"),
        ("p", "row must be a dict, got str")])
def test_save_jsonl_rejects_bad_rows_and_writes_nothing(tmp_path, bad_row, problem):
    path = tmp_path / "out.jsonl"
    with pytest.raises(ValueError) as raised:
        data.save_jsonl([GOOD_PLAIN, bad_row], path)
    assert str(raised.value).startswith(f"save_jsonl({path}) row 2: {problem}")
    assert list(tmp_path.iterdir()) == []


def test_save_jsonl_rejects_no_rows(tmp_path):
    with pytest.raises(ValueError, match="no rows to write"):
        data.save_jsonl([], tmp_path / "out.jsonl")


# --------------------------------------------------------------------------------------------------
# Tokenization
# --------------------------------------------------------------------------------------------------


def make_example(content, origin="t.jsonl:1", system=None):
    messages = ([{"role": "system", "content": system}] if system else []) + [
        {"role": "user", "content": content}]
    return data.Example(messages=messages, ground_truth="1", data_source="t", origin=origin)


def test_tokenizer_fixture_is_character_level(tokenizer):
    assert tokenizer.decode(expected_ids([{"role": "user", "content": "a b"}])) == (
        "<|im_start|>user\na b<|im_end|>\n<|im_start|>assistant\n")


def test_tokenization_matches_hand_built_template(tokenizer, tmp_path):
    examples = data.load_examples(write_jsonl(tmp_path / "mixed.jsonl", PLAIN_ROWS + VERL_ROWS))
    ids, kept, stats = data.tokenize_prompts(examples, tokenizer, max_prompt_tokens=10_000)
    assert ids == [expected_ids(e.messages) for e in examples]
    assert kept == examples
    lengths = [len(x) for x in ids]
    assert stats == {
        "num_prompts": 4,
        "num_truncated": 0,
        "num_skipped": 0,
        "max_tokens": max(lengths),
        "mean_tokens": sum(lengths) / 4,
    }


class StubTokenizer:
    """apply_chat_template returning whatever shape a tokenizer version might: list, dict, batch of one, tensor."""

    def __init__(self, wrap):
        self.wrap = wrap

    def apply_chat_template(self, messages, add_generation_prompt, tokenize):
        assert add_generation_prompt and tokenize
        return self.wrap([len(m["content"]) for m in messages] + [99])


@pytest.mark.parametrize(
    "wrap",
    [
        lambda ids: ids, lambda ids: {"input_ids": ids, "attention_mask": [1] * len(ids)},
        lambda ids: transformers.BatchEncoding({"input_ids": ids}), lambda ids: [ids],
        lambda ids: torch.tensor([ids]), lambda ids: np.array(ids)])
def test_chat_template_ids_accepts_every_return_shape(wrap):
    ids = data.chat_template_ids(StubTokenizer(wrap), [{"role": "user", "content": "abc"}])
    assert ids == [3, 99] and all(type(token) is int for token in ids)


def overflow_examples():
    # Lengths: fixed overhead + content length. Example 1 fits, 2 and 4 overflow, 3 is exactly at
    # the cap.
    overhead = len(expected_ids([{"role": "user", "content": ""}]))
    cap = overhead + 10
    contents = ["short", "x" * 25 + "TAIL", "y" * 10, "z" * 40 + "END"]
    examples = [
        make_example(content, origin=f"t.jsonl:{i}") for i, content in enumerate(contents, start=1)]
    return examples, cap


def test_overflow_left_truncate_keeps_the_tail(tokenizer):
    examples, cap = overflow_examples()
    ids, kept, stats = data.tokenize_prompts(examples, tokenizer, cap)  # default mode
    full = [expected_ids(e.messages) for e in examples]
    assert kept == examples
    assert ids == [full[0], full[1][-cap:], full[2], full[3][-cap:]]
    assert tokenizer.decode(ids[1]).endswith("xxTAIL<|im_end|>\n<|im_start|>assistant\n")
    assert "<|im_start|>user" not in tokenizer.decode(ids[3])  # the head is what is lost
    assert stats == {
        "num_prompts": 4,
        "num_truncated": 2,
        "num_skipped": 0,
        "max_tokens": cap,
        "mean_tokens": (len(full[0]) + 3 * cap) / 4,
    }


def test_overflow_skip_drops_long_prompts(tokenizer):
    examples, cap = overflow_examples()
    ids, kept, stats = data.tokenize_prompts(examples, tokenizer, cap, overflow="skip")
    assert kept == [examples[0], examples[2]]
    assert ids == [expected_ids(examples[0].messages), expected_ids(examples[2].messages)]
    assert stats == {
        "num_prompts": 4,
        "num_truncated": 0,
        "num_skipped": 2,
        "max_tokens": cap,
        "mean_tokens": (len(ids[0]) + cap) / 2,
    }


def test_overflow_error_names_origin_and_length(tokenizer):
    examples, cap = overflow_examples()
    length = len(expected_ids(examples[1].messages))
    with pytest.raises(ValueError) as raised:
        data.tokenize_prompts(examples, tokenizer, cap, overflow="error")
    assert (
        str(raised.value) == f"t.jsonl:2: prompt is {length} tokens, over max_prompt_tokens={cap}")
    _, kept, _ = data.tokenize_prompts(
        examples[:1] + examples[2:3], tokenizer, cap, overflow="error")
    assert len(kept) == 2  # at the cap is not over it


def test_everything_skipped_gives_zero_stats(tokenizer):
    ids, kept, stats = data.tokenize_prompts([make_example("abc")], tokenizer, 3, overflow="skip")
    assert ids == [] and kept == []
    assert stats == {
        "num_prompts": 1,
        "num_truncated": 0,
        "num_skipped": 1,
        "max_tokens": 0,
        "mean_tokens": 0.0,
    }


def test_invalid_arguments(tokenizer):
    with pytest.raises(
        ValueError, match=re.escape("overflow must be one of ('left_truncate', 'skip', 'error')")):
        data.tokenize_prompts([make_example("a")], tokenizer, 10, overflow="right")
    for cap in (0, -1, 2.5, True):
        with pytest.raises(ValueError, match="max_prompt_tokens must be a positive int"):
            data.tokenize_prompts([make_example("a")], tokenizer, cap)


def test_tools_reach_the_chat_template(tokenizer):
    # a template that lists the tools' names, as Qwen's "# Tools" block does
    import copy

    listing = copy.copy(tokenizer)
    listing.chat_template = (
        "{% if tools %}<|im_start|>system\n{% for t in tools %}{{ t['function']['name'] }}"
        "{% endfor %}<|im_end|>\n{% endif %}" + QWEN_STYLE_TEMPLATE)
    messages = [{"role": "user", "content": "abc"}]
    tool = {"type": "function", "function": {"name": "code_interpreter", "parameters": {}}}
    plain = data.chat_template_ids(listing, messages)
    with_tools = data.chat_template_ids(listing, messages, tools=[tool])
    assert "code_interpreter" in listing.decode(
        with_tools) and "code_interpreter" not in listing.decode(plain)
    ids, _, _ = data.tokenize_prompts(
        [data.Example(messages, "1", "x", "t")], listing, 500, tools=[tool])
    assert ids == [with_tools]
