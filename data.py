"""data.py: prompt sets. Load examples from JSONL or Parquet, write synthetic splits, tokenize
prompts.

    examples = data.load_examples("data/train.parquet")  # plain rows get STARE's instruction
    prompt_ids, kept, stats = data.tokenize_prompts(examples, tokenizer, max_prompt_tokens=1024)
    data.save_jsonl([{"problem": "Find x if 2x = 84.", "answer": 42}], "data/toy.jsonl")
    seed = data.derive_seed(base_seed, "prompt", index)  # a prompt's sampling seed, and the like

Pure Python plus pyarrow: no vLLM, no torch, no torch.distributed. Files are chosen by extension:
.jsonl (one JSON object per line, blank lines skipped) or .parquet (one row per example). Every
problem is a ValueError that starts with where it is ("data/train.jsonl:3: ...", "data/train.parquet
row 5: ..."): a missing file, an unknown extension, no examples, invalid JSON, a missing or empty
field, a ground truth of the wrong type.

Row formats, detected per row:
  verl   {"prompt": [{"role": "user", "content": "..."}], "reward_model": {"ground_truth": "42"},
          "data_source": ...}: the messages as given (verl data carry their own instruction: NO
         suffix is added).
  plain  {"problem": "Find x if 2x = 84.", "answer": 42, "data_source": "toy"}: one user message,
         problem + "\\n" + prompt_suffix (default STARE_SUFFIX; None or "": the problem alone).
Ground truths are strings, or numbers as the verifier reads them (`_ground_truth`). data_source: the
row's own, else `default_data_source`, else the file's stem.

Tokenization applies the tokenizer's chat template with the generation prompt. A prompt longer than
max_prompt_tokens is handled by `overflow`: "left_truncate" keeps the LAST max_prompt_tokens ids
(verl's truncation="left", the STARE setting: the generation prompt at the end survives, the head of
the question is lost), "skip" drops the example (counted in stats["num_skipped"]), "error" raises.
"""

import dataclasses
import decimal
import functools
import hashlib
import json
import math
import numbers
import os
import random
from collections.abc import Mapping
from pathlib import Path

STARE_SUFFIX = "Please reason step by step, and put your final answer within \\boxed{}."

OVERFLOW_MODES = ("left_truncate", "skip", "error")


@dataclasses.dataclass
class Example:
    """One prompt: chat messages for the tokenizer's template, and what the verifier needs."""

    messages: list[dict]  # [{"role": "user", "content": "..."}, ...]
    ground_truth: str  # the reference answer the reward function compares against
    # routes the reward function and groups eval metrics (e.g. "Short_CoT", "AIME24")
    data_source: str
    # where it came from, for error messages: "data/train.jsonl:7" or "data/train.parquet row 7"
    origin: str


# ==================================================================================================
# Loading
# ==================================================================================================


def load_examples(path, default_data_source: str | None = None,
                  prompt_suffix: str | None = STARE_SUFFIX) -> list[Example]:
    """Read a .jsonl or .parquet prompt set into Examples, in file order; every bad row is a
    ValueError. The module docstring describes the rows, prompt_suffix and default_data_source."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"{path}: no such file")
    readers = {".jsonl": _read_jsonl_rows, ".parquet": _read_parquet_rows}
    extension = path.suffix.lower()
    if extension not in readers:
        raise ValueError(f"{path}: unknown extension {extension!r} (expected .jsonl or .parquet)")
    examples = [
        _example_from_row(row, origin, default_data_source or path.stem, prompt_suffix)
        for origin, row in readers[extension](path)]
    if not examples:
        raise ValueError(f"{path}: no examples")
    return examples


def _read_jsonl_rows(path):
    data = path.read_bytes()
    try:
        text = data.decode("utf-8-sig")  # -sig: tolerate a byte-order mark some editors write
    except UnicodeDecodeError as error:
        line = data[: error.start].count(b"\n") + 1
        raise ValueError(f"{path}:{line}: not valid UTF-8 ({error.reason})") from None
    # split("\n"), not splitlines(): U+2028 and friends may appear unescaped inside JSON strings and
    # are not line ends.
    for number, line in enumerate(text.split("\n"), start=1):
        if not line.strip():
            continue
        origin = f"{path}:{number}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError as error:
            # error.lineno is always 1 here (one line per document), so report the column only.
            raise ValueError(
                f"{origin}: invalid JSON ({error.msg} at column {error.colno})") from None
        yield origin, row


def _read_parquet_rows(path):
    import pyarrow  # imported here so that JSONL-only users never pay for (or need) pyarrow
    import pyarrow.parquet

    try:
        table = pyarrow.parquet.read_table(path)
    except pyarrow.ArrowException as error:
        raise ValueError(f"{path}: not a readable Parquet file ({error})") from None
    for number, row in enumerate(table.to_pylist(), start=1):
        yield f"{path} row {number}", row


def _example_from_row(row, origin, fallback_source, prompt_suffix):
    """One row (verl or plain format), validated, as an Example; ValueError names origin, field."""
    if not isinstance(row, Mapping):
        raise ValueError(f"{origin}: row must be a JSON object, got {type(row).__name__}")
    if "prompt" in row:
        messages = _verl_messages(row["prompt"], origin)
        reward_model = _required(row, "reward_model", origin)
        if not isinstance(reward_model, Mapping):
            raise ValueError(
                f"{origin}: field 'reward_model' must be an object with a 'ground_truth'")
        if reward_model.get("ground_truth") is None:
            raise ValueError(f"{origin}: missing field 'reward_model.ground_truth'")
        ground_truth = _ground_truth(
            reward_model["ground_truth"], "reward_model.ground_truth", origin)
    elif "problem" in row:
        problem = _non_empty_string(_required(row, "problem", origin), "problem", origin)
        content = (problem + "\n" + prompt_suffix) if prompt_suffix else problem
        messages = [{"role": "user", "content": content}]
        ground_truth = _ground_truth(_required(row, "answer", origin), "answer", origin)
    else:
        raise ValueError(
            f"{origin}: row has neither 'prompt' (verl format) nor 'problem' (plain format)")
    source = row.get("data_source")  # None: absent, or a null in a Parquet column other rows fill
    source = fallback_source if source is None else _non_empty_string(source, "data_source", origin)
    return Example(messages, ground_truth, source, origin)


def _verl_messages(prompt, origin):
    """verl's "prompt": a non-empty list of {role, content} dicts (numpy array via pandas)."""
    if hasattr(prompt, "tolist") and not isinstance(prompt, (str, bytes)):
        prompt = prompt.tolist()  # numpy object array -> list, without importing numpy
    if not isinstance(prompt, (list, tuple)) or not prompt or not all(
            isinstance(m, Mapping) for m in prompt):
        raise ValueError(
            f"{origin}: field 'prompt' must be a non-empty list of {{role, content}} messages")
    for index, message in enumerate(prompt, start=1):
        for key in ("role", "content"):
            value = message.get(key)
            if not isinstance(value, str):
                raise ValueError(f"{origin}: field 'prompt' message {index} needs a string "
                                 f"'{key}', got {value!r}")
            if not value.strip():
                raise ValueError(f"{origin}: field 'prompt' message {index} has empty '{key}'")
    return [dict(message) for message in prompt]


def _ground_truth(value, field, origin):
    """A ground truth as a string: strings as given (not blank); ints as str(int); integral floats
    without ".0" (pandas turns int columns with gaps into floats, and "42.0" would only be a second
    spelling of 42); other floats in the digits of Python's shortest round-trip repr, written out
    positionally (0.1 -> "0.1", 2.5e-07 -> "0.00000025"). NaN, inf, booleans and lists are
    errors."""
    if isinstance(value, str):
        return _non_empty_string(value, field, origin)
    # bool is an int subclass; True as an answer is a bug in the data, not the number 1.
    if isinstance(value, numbers.Integral) and not isinstance(value, bool):
        return str(int(value))
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        value = float(value)
        if not math.isfinite(value):
            raise ValueError(f"{origin}: field '{field}' must be finite, got {value}")
        # positional digits: math-verify reads repr's "2.5e-07" as 2.5*e - 7 (Euler's e)
        return str(int(value)) if value.is_integer() else format(decimal.Decimal(repr(value)), "f")
    raise ValueError(
        f"{origin}: field '{field}' must be a string or a number, got {type(value).__name__}")


def _required(row, field, origin):
    # A null counts as missing: Parquet stores an absent value as null.
    if row.get(field) is None:
        raise ValueError(f"{origin}: missing field '{field}'")
    return row[field]


def _non_empty_string(value, field, origin):
    if not isinstance(value, str):
        raise ValueError(f"{origin}: field '{field}' must be a string, got {type(value).__name__}")
    if not value.strip():
        raise ValueError(f"{origin}: field '{field}' is empty")
    return value


# ==================================================================================================
# Writing
# ==================================================================================================

PLAIN_FIELDS = ("problem", "answer", "data_source")


def save_jsonl(rows, path) -> int:
    """Write plain-format rows ({"problem", "answer", optional "data_source"}) as JSONL -> the row
    count. Every row is validated as load_examples would read it, so whatever is written loads
    back; an unknown key is an error rather than silently dropped. The file appears only when all
    rows are valid (a temporary file, renamed), with any missing parent directories."""
    path = Path(path)
    lines = []
    for number, row in enumerate(rows, start=1):
        where = f"save_jsonl({path}) row {number}"
        if not isinstance(row, Mapping):
            raise ValueError(f"{where}: row must be a dict, got {type(row).__name__}")
        unknown = sorted(set(row) - set(PLAIN_FIELDS))
        if unknown:
            raise ValueError(f"{where}: unknown field(s) {unknown} (expected {list(PLAIN_FIELDS)})")
        if "problem" not in row:
            raise ValueError(f"{where}: missing field 'problem'")
        _example_from_row(row, where, "unused", None)  # the same checks as loading
        plain = {key: row[key] for key in PLAIN_FIELDS if row.get(key) is not None}
        lines.append(json.dumps(plain, ensure_ascii=False))
    if not lines:
        raise ValueError(
            f"save_jsonl({path}): no rows to write (load_examples rejects an empty file)")
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(path.name + ".tmp")
    temporary.write_text("\n".join(lines) + "\n", encoding="utf-8")
    os.replace(temporary, path)
    return len(lines)


# ==================================================================================================
# Tokenization
# ==================================================================================================


def tokenize_prompts(examples, tokenizer, max_prompt_tokens: int, overflow: str = "left_truncate",
                     tools=None):
    """Chat-template each example's messages (with the generation prompt) into token ids and enforce
    the length cap (overflow: the module docstring) -> (prompt_ids, kept_examples, stats), in input
    order. stats: num_prompts (input count), num_truncated, num_skipped, and max_tokens /
    mean_tokens over the kept prompts after truncation (0 and 0.0 when none is kept)."""
    if overflow not in OVERFLOW_MODES:
        raise ValueError(f"overflow must be one of {OVERFLOW_MODES}, got {overflow!r}")
    if (isinstance(max_prompt_tokens, bool) or not isinstance(max_prompt_tokens, int)
            or max_prompt_tokens < 1):
        raise ValueError(f"max_prompt_tokens must be a positive int, got {max_prompt_tokens!r}")
    prompt_ids, kept, num_truncated, num_skipped = [], [], 0, 0
    for example in examples:
        ids = chat_template_ids(tokenizer, example.messages, tools)
        if len(ids) > max_prompt_tokens:
            if overflow == "error":
                raise ValueError(f"{example.origin}: prompt is {len(ids)} tokens, over "
                                 f"max_prompt_tokens={max_prompt_tokens}")
            if overflow == "skip":
                num_skipped += 1
                continue
            ids = ids[-max_prompt_tokens:]
            num_truncated += 1
        prompt_ids.append(ids)
        kept.append(example)
    lengths = [len(ids) for ids in prompt_ids]
    stats = {"num_prompts": len(kept) + num_skipped, "num_truncated": num_truncated,
             "num_skipped": num_skipped, "max_tokens": max(lengths, default=0),
             "mean_tokens": sum(lengths) / len(lengths) if lengths else 0.0}
    return prompt_ids, kept, stats


def chat_template_ids(tokenizer, messages, tools=None) -> list[int]:
    """Token ids of `messages` under the tokenizer's chat template, ending with the assistant
    generation prompt. tools: JSON schemas the template lists for the model (Qwen's "# Tools"
    block), e.g. tool_use.CODE_INTERPRETER_TOOL. apply_chat_template(..., tokenize=True) returns a
    BatchEncoding in transformers 5.x, a plain list in 4.x: either is accepted, tensors too."""
    extra = {"tools": tools} if tools else {}
    encoded = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, **extra)
    ids = encoded["input_ids"] if isinstance(encoded, Mapping) else encoded
    if hasattr(ids, "tolist"):
        ids = ids.tolist()  # torch tensor or numpy array
    if ids and isinstance(ids[0], (list, tuple)):  # a batch of one conversation
        (ids,) = ids
    return [int(token) for token in ids]


def derive_seed(seed, *parts):
    """One seed from the run's base seed and what it is for, e.g. derive_seed(seed, "prompt",
    global_index): a hash into [0, 2**48), so seeds of different purposes or indices never coincide
    by arithmetic, and none depends on the number of ranks. (vLLM spaces a request's samples as seed
    * n + j, which stays far below 2**63.)"""
    digest = hashlib.blake2b(repr((seed,) + parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") % 2**48


# --------------------------------------------------------------------------------------------------
# The training prompts of a run and their order
# --------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Task:
    """The training prompts, tokenised once, and the seeded order in which the run reads them."""

    prompt_ids: list[list[int]]
    examples: list  # Example per prompt: ground truth and data source
    seed: int
    shuffle: bool
    # data/...: prompts, truncated and skipped shares
    metrics: dict = dataclasses.field(default_factory=dict)

    def prompt_at(self, position):
        """The prompt index at a position of the stream: epochs, each shuffled by (seed, epoch)."""
        epoch, offset = divmod(position, len(self.prompt_ids))
        return epoch_order(len(self.prompt_ids), self.seed, self.shuffle, epoch)[offset]


@functools.lru_cache(maxsize=2)
def epoch_order(num_prompts, seed, shuffle, epoch):
    order = list(range(num_prompts))
    if shuffle:
        random.Random(derive_seed(seed, "epoch", epoch)).shuffle(order)
    return order
