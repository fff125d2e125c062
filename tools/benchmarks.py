"""tools/benchmarks.py: convert downloaded public math benchmarks into the project's prompt format
(data.py plain JSONL).

    python -m tools.benchmarks aime24 ~/Downloads/aime_2024/train-00000-of-00001.parquet --out data/aime24.jsonl
    python -m tools.benchmarks aime25 aime2025-I.jsonl aime2025-II.jsonl --out data/aime25.jsonl   # files concatenated
    python -m tools.benchmarks math500 test.jsonl --out data/math500.jsonl
    python evaluate.py --model MODEL --data data/aime24.jsonl data/aime25.jsonl data/math500.jsonl --out eval.json

Nothing is downloaded: give it the files you fetched yourself (for example with `huggingface-cli
download --repo-type dataset HuggingFaceH4/MATH-500`). Inputs: .parquet (pyarrow), .jsonl (one
object per line) or .json (a JSON array of objects, or JSON lines under a .json name). Output:
data.save_jsonl rows {"problem", "answer", "data_source"}; data.load_examples later appends STARE's
instruction to each problem. Name the output after the benchmark (aime24.jsonl, math500.jsonl, ...):
evaluate.py takes the benchmark name, and its default n, from the file stem. data_source is the
reference's name for the set (docs/method.md, "The reference release").

Field mapping (the first field present in a row wins; matching is exact, so "Problem" and "problem"
are both listed)

| benchmark | data_source | usual HF copies (what their rows look like) | problem | answer |
|---|---|---|---|---| | aime24 | AIME24 | HuggingFaceH4/aime_2024 (problem, answer, solution, ...),
Maxwell-Jia/AIME_2024 (Problem, Answer, Solution), math-ai/aime24 | problem, Problem, question |
answer, Answer | | aime25 | AIME25 | opencompass/AIME2025 (question, answer; files aime2025-I/II),
yentinglin/aime_2025, math-ai/aime25, MathArena/aime_2025 (problem, answer) | problem, Problem,
question | answer, Answer | | amc23 | AMC23 | math-ai/amc23 and similar 40-problem sets (question or
problem, answer); AI-MO/aimo-validation-amc (problem, answer as a float such as 27.0; it holds 83
problems of AMC 2022 and 2023: filter it yourself for AMC 2023 only) | problem, Problem, question |
answer, Answer | | math500 | Math500 | HuggingFaceH4/MATH-500 (problem, solution, answer, subject,
level, unique_id) | problem | answer | | minerva | Minerva | math-ai/minervamath (question, answer);
Qwen2.5-Math's minerva_math test.jsonl and its copies (problem, solution with the answer in the last
\\boxed{}) | problem, question | answer, else the last \\boxed{} of solution | | olympiadbench |
OlympiadBench | Hothan/OlympiadBench, config OE_TO_maths_en_COMP (question, final_answer as a list
of LaTeX strings such as ["$\\\\frac{1}{2}$"], ...); math-ai/olympiadbench | question, problem |
final_answer (list: "$" delimiters stripped, entries joined by ", ", which math-verify reads as a
set), else answer |

Answers keep their original spelling (numbers are written by data.save_jsonl as data.py describes:
27.0 -> "27"). Not converted: OlympiadBench's "unit" (the maths subsets have none) and "context";
images of multimodal rows (text-only rows are expected). A row without a problem or an answer is an
error, never skipped silently: the message names the file, the line (JSONL) or row (Parquet, JSON
array), the field looked for and the keys the row has. Rows with a blank problem or answer are
errors too.
"""

import argparse
import json
import math
import sys
from collections.abc import Mapping
from pathlib import Path

import config
import data
import rewards

# benchmark -> (data_source, problem fields, answer fields, how the answer is read)
BENCHMARKS = {
    "aime24": ("AIME24", ("problem", "Problem", "question"), ("answer", "Answer"), "plain"),
    "aime25": ("AIME25", ("problem", "Problem", "question"), ("answer", "Answer"), "plain"),
    "amc23": ("AMC23", ("problem", "Problem", "question"), ("answer", "Answer"), "plain"),
    "math500": ("Math500", ("problem",), ("answer",), "plain"),
    "minerva": ("Minerva", ("problem", "question"), ("answer", "solution"), "boxed_solution"),
    "olympiadbench": (
        "OlympiadBench", ("question", "problem"), ("final_answer", "answer"), "answer_list"),
}


# --------------------------------------------------------------------------------------------------
# reading
# --------------------------------------------------------------------------------------------------


def read_rows(path):
    """Yield (origin, row) from a .parquet, .jsonl or .json file; origin is "path:LINE" or "path row N" (1-based)."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"{path}: no such file")
    extension = path.suffix.lower()
    if extension == ".parquet":
        import pyarrow.parquet

        try:
            rows = pyarrow.parquet.read_table(path).to_pylist()
        except Exception as error:  # pyarrow raises several unrelated types for a bad file
            raise ValueError(f"{path}: not a readable Parquet file ({error})") from None
        yield from ((f"{path} row {i}", row) for i, row in enumerate(rows, start=1))
    elif extension in (".jsonl", ".json"):
        text = path.read_text(encoding="utf-8-sig")
        if extension == ".json":
            try:
                whole = json.loads(text)
            except json.JSONDecodeError:
                whole = None  # JSON lines under a .json name (common for datasets' to_json)
            if isinstance(whole, list):
                yield from ((f"{path} row {i}", row) for i, row in enumerate(whole, start=1))
                return
            if whole is not None and not isinstance(whole, Mapping):
                raise ValueError(f"{path}: expected a JSON array of objects or JSON lines")
            if isinstance(whole, Mapping):  # a single object: one row
                yield f"{path} row 1", whole
                return
        for number, line in enumerate(text.split("\n"), start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as error:
                raise ValueError(
                    f"{path}:{number}: invalid JSON ({error.msg} at column {error.colno})"
                ) from None
            yield f"{path}:{number}", row
    else:
        raise ValueError(
            f"{path}: unknown extension {extension!r} (expected .parquet, .jsonl or .json)")


# --------------------------------------------------------------------------------------------------
# converting
# --------------------------------------------------------------------------------------------------


def _first_present(row, fields):
    """(field, value) of the first of `fields` with a non-null value in row, else (None, None)."""
    for field in fields:
        if row.get(field) is not None:
            return field, row[field]
    return None, None


def _strip_dollars(text):
    """"$x$" / "$$x$$" -> "x"; delimiters are dropped only around the whole answer: "$x=1$ or $x=2$"
    has inner ones and stays as it is (stripping its ends would leave "x=1$ or $x=2")."""
    text = text.strip()
    for delimiter in ("$$", "$"):
        inner = text[len(delimiter):-len(delimiter)]
        if (
            len(text) > 2 * len(delimiter)
            and text.startswith(delimiter)
            and text.endswith(delimiter)
            and "$" not in inner):
            return inner.strip()
    return text


def convert_row(benchmark, origin, row):
    """One source row -> {"problem", "answer", "data_source"}; ValueError naming origin and the missing field."""
    source, problem_fields, answer_fields, reading = BENCHMARKS[benchmark]
    if not isinstance(row, Mapping):
        raise ValueError(f"{origin}: row must be an object, got {type(row).__name__}")
    keys = sorted(row)
    _, problem = _first_present(row, problem_fields)
    if problem is None:
        raise ValueError(
            f"{origin}: missing field {' or '.join(map(repr, problem_fields))} (row has {keys})")
    if not isinstance(problem, str) or not problem.strip():
        raise ValueError(f"{origin}: the problem must be a non-empty string, got {problem!r}")
    field, answer = _first_present(row, answer_fields)
    if answer is None:
        raise ValueError(
            f"{origin}: missing field {' or '.join(map(repr, answer_fields))} (row has {keys})")
    if reading == "boxed_solution" and field == "solution":
        boxed = rewards.extract_boxed(answer) if isinstance(answer, str) else None
        if boxed is None or not boxed.strip():
            raise ValueError(
                f"{origin}: field 'solution' has no \\boxed{{...}} answer (and there is no 'answer')"
            )
        answer = boxed.strip()
    elif reading == "answer_list" and field == "final_answer":
        if hasattr(answer, "tolist"):
            answer = answer.tolist()  # numpy array from a pandas-written Parquet file
        items = answer if isinstance(answer, (list, tuple)) else [answer]
        if not items or not all(isinstance(a, str) and _strip_dollars(a) for a in items):
            raise ValueError(
                f"{origin}: field 'final_answer' must be a non-empty list of strings, got {answer!r}"
            )
        answer = ", ".join(_strip_dollars(a) for a in items)
    elif isinstance(answer, str):
        answer = answer.strip()
    if isinstance(answer, bool) or not isinstance(answer, (str, int, float)) or answer == "" or (
            isinstance(answer, float) and not math.isfinite(answer)):
        raise ValueError(
            f"{origin}: field {field!r} must be a non-empty string or a number, got {answer!r}")
    return {"problem": problem, "answer": answer, "data_source": source}


def convert(benchmark, inputs, out) -> int:
    """Convert `inputs` (in order, concatenated) into the JSONL file `out`; returns the row count.
    Nothing is written if any row is bad."""
    if benchmark not in BENCHMARKS:
        raise ValueError(
            f"unknown benchmark {benchmark!r} (expected one of {', '.join(BENCHMARKS)})")
    rows = [
        convert_row(benchmark, origin, row) for path in inputs for origin, row in read_rows(path)]
    if not rows:
        raise ValueError(f"{', '.join(map(str, inputs))}: no rows")
    return data.save_jsonl(rows, out)


def main(argv):
    parser = argparse.ArgumentParser(
        description="Convert a downloaded benchmark into data.py's JSONL format.")
    parser.add_argument("benchmark", choices=sorted(BENCHMARKS))
    parser.add_argument(
        "inputs", nargs="+", help=".parquet / .jsonl / .json files (concatenated in order)")
    parser.add_argument(
        "--out", required=True,
        help="output .jsonl (name it after the benchmark, e.g. aime24.jsonl)")
    args = parser.parse_args(argv)
    try:
        config.check_files(args.inputs, "inputs")
        config.check_outputs([("--out", args.out, "file")],
                             [(f"inputs[{i}]", path) for i, path in enumerate(args.inputs)])
        count = convert(args.benchmark, args.inputs, args.out)
    except (ValueError, config.ConfigError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    print(f"wrote {count} {args.benchmark} problems to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
