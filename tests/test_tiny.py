"""The offline tiny default: what tools/tiny.py builds must load everywhere the same way, and be worth training on."""

import json
import random

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import data
import config
import rewards
from tools import tiny
import tool_use


def test_summary_and_starting_success_rates(tiny_dir):
    # (its build time is recorded there, not asserted)
    summary = json.loads((tiny_dir / "tiny.json").read_text())
    # the regime where RL has something to learn: some, not most, sampled answers correct (loose
    # bounds: a CPU that tiny.BUILD_ENV cannot pin builds another model)
    assert 0.08 <= summary["sum_train_success_rate_t1"] <= 0.7
    assert 0.1 <= summary["add_test_success_rate_t1"] <= 0.7
    assert summary["sum_test_success_rate_t1"] <= 0.7  # held-out N: harder, often lower
    # a second call reuses the directory instead of training again
    assert tiny.build_tiny(tiny_dir) == summary


def test_saved_tokenizer_matches_the_built_one(tiny_dir):
    # transformers loads a qwen2 checkpoint's tokenizer as Qwen2Tokenizer; it must give the very
    # same ids
    loaded = AutoTokenizer.from_pretrained(tiny_dir / "model")
    built = tiny.build_tokenizer()
    assert type(loaded).__name__ == "Qwen2Tokenizer"
    for text in ["Write 17 as a+b with a, b > 0.", "a  b\n\nc\t\\boxed{3+4}", "unicode: é → ∑", ""]:
        ids = built.encode(text, add_special_tokens=False)
        assert loaded.encode(text, add_special_tokens=False) == ids
        assert loaded.decode(ids) == text
    messages = [{"role": "user", "content": "What is 3+4?"}]
    expected = "<|im_start|>user\nWhat is 3+4?<|im_end|>\n<|im_start|>assistant\n"
    ids = data.chat_template_ids(loaded, messages)
    assert ids == data.chat_template_ids(built, messages)
    assert loaded.decode(ids) == expected
    # special tokens are single ids
    assert ids.count(loaded.convert_tokens_to_ids("<|im_start|>")) == 2


def test_model_shape(tiny_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_dir / "model", dtype=torch.float32)
    config = model.config
    # vLLM's CPU attention needs head_dim >= 64
    assert config.model_type == "qwen2" and config.head_dim == 64
    assert config.hidden_size == config.num_attention_heads * config.head_dim
    tokenizer = AutoTokenizer.from_pretrained(tiny_dir / "model")
    assert (
        config.eos_token_id
        == tokenizer.eos_token_id
        == tokenizer.convert_tokens_to_ids("<|im_end|>"))
    assert config.vocab_size >= len(tokenizer)


def test_splits_are_disjoint_and_verifiable(tiny_dir):
    splits = {name: data.load_examples(tiny_dir / "data" / f"{name}.jsonl", prompt_suffix=None)
              for name in ("sum_train", "sum_test", "add_train", "add_test")}
    for task in ("sum", "add"):
        train = {e.messages[0]["content"] for e in splits[f"{task}_train"]}
        test = {e.messages[0]["content"] for e in splits[f"{task}_test"]}
        assert train and test and not train & test
    # every warm-up answer is accepted by the task's verifier, and a wrong one is not
    rng = random.Random(0)
    for examples in splits.values():
        rows = [{"answer": e.ground_truth, "data_source": e.data_source} for e in examples]
        responses = [tiny.warmup_response(row, rng) for row in rows]
        _, accuracies, _ = rewards.compute_rewards(
            responses, [r["answer"] for r in rows], [r["data_source"] for r in rows],
            [0] * len(rows), config.RewardConfig())
        assert all(a == 1.0 for a in accuracies)
        wrong = [f"\\boxed{{{int(r['answer']) + 1}}}" for r in rows]
        _, accuracies, _ = rewards.compute_rewards(
            wrong, [r["answer"] for r in rows], [r["data_source"] for r in rows], [0] * len(rows),
            config.RewardConfig())
        assert not any(accuracies)


def test_tool_variant(tiny_dir):
    summary = tiny.build_tiny_tool(tiny_dir)
    # ~0.7: the warm-up taught the call format
    assert summary["first_turn_valid_call_rate_t1"] >= 0.3
    assert tiny.build_tiny_tool(tiny_dir) == summary  # reused
    train, test = (data.load_examples(tiny_dir / "data" / f"mul_{split}.jsonl", prompt_suffix=None)
                   for split in ("train", "test"))
    assert not {e.messages[0]["content"] for e in train} & {e.messages[0]["content"] for e in test}
    for e in train[:20]:
        a, b = e.messages[0]["content"].removeprefix("What is ").removesuffix("?").split("*")
        assert e.ground_truth == str(int(a) * int(b)) and e.data_source == "tiny_mul"
    # a warm-up conversation: trained on the model's turns only; its tool turns are the rollout's
    # own ids
    tokenizer = AutoTokenizer.from_pretrained(tiny_dir / "tool_model")
    wrapper = [tokenizer.encode(part, add_special_tokens=False) for part in tool_use.QWEN_TOOL_TURN]
    turns = [
        (tiny.tool_call_text("print(347*29)"), False), ("10063", True), ("\\boxed{10063}", False)]
    prompt = data.chat_template_ids(tokenizer, [{"role": "user", "content": "What is 347*29?"}])
    ids, labels = tiny.tool_warmup_sequence(tokenizer, prompt, turns, wrapper)
    call = tokenizer.encode(turns[0][0], add_special_tokens=False)
    tool = tool_use.tool_turn_ids(tokenizer, "10063\n", wrapper, 512)
    answer = tokenizer.encode("\\boxed{10063}", add_special_tokens=False) + [tokenizer.eos_token_id]
    assert ids == prompt + call + tool + answer
    assert labels == [-100] * len(prompt) + call + [-100] * len(tool) + answer
    assert tool_use.parse_tool_call(turns[0][0]) == ("print(347*29)", None)
    _, accuracies, _ = rewards.compute_rewards(
        [turns[-1][0]], ["10063"], ["tiny_mul"], [0], config.RewardConfig())
    assert accuracies == [1.0]


def test_countdown_variant(countdown_dir):
    summary = tiny.build_tiny_countdown(countdown_dir)
    assert tiny.build_tiny_countdown(countdown_dir) == summary  # reused
    # well below saturation on both splits, so that RL has something to find (loose bounds, as
    # above)
    assert 0.03 <= summary["countdown_train_success_rate_t1"] <= 0.5
    assert summary["countdown_test_success_rate_t1"] <= 0.5
    splits = {
        split: data.load_examples(
            countdown_dir / "data" / f"countdown_{split}.jsonl", prompt_suffix=None)
        for split in ("train", "test", "fresh")
    }
    digits = {
        split: {e.ground_truth.split("=")[0] for e in examples}
        for split, examples in splits.items()
    }
    # held out by digit triple: two splits (A, B) that share no triple with training or each other
    assert len(splits["test"]) == len(splits["fresh"]) == 64 == summary["fresh_prompts"]
    assert not digits["train"] & digits["test"] and not digits["train"] & digits["fresh"]
    assert not digits["test"] & digits["fresh"]
    # split A does not depend on split B's existence (the held-out prompts of earlier results)
    assert tiny.make_countdown_splits(num_fresh=0)[0]["countdown_test"] == tiny.countdown_rows(
        [(tuple(map(int, e.ground_truth.split("=")[0].split(","))),
          int(e.ground_truth.split("=")[1])) for e in splits["test"]])
    tokenizer = AutoTokenizer.from_pretrained(countdown_dir / "countdown_model")
    # fixed-width prompts: the miniature batches them without padding
    for examples in splits.values():
        assert len({len(data.chat_template_ids(tokenizer, e.messages)) for e in examples}) == 1
    # the solutions, against an independent enumeration (Python's eval over every order and operator
    # pair)
    solutions = tiny.countdown_solutions()
    rng = random.Random(0)
    for example in rng.sample(splits["train"], 30) + splits["test"] + splits["fresh"]:
        numbers, target = example.ground_truth.split("=")
        a, b, c = numbers.split(",")
        found = {
            f"{x}{o1}{y}{o2}{z}"
            for x, y, z in {(a, b, c), (a, c, b), (b, a, c), (b, c, a), (c, a, b), (c, b, a)}
            for o1 in "+-*"
            for o2 in "+-*"
            if eval(f"{x}{o1}{y}{o2}{z}") == int(target)
        }
        assert set(solutions[tuple(map(int, (a, b, c))), int(target)]) == found
        assert all(
            rewards.verify_countdown(f"\\boxed{{{s}}}", example.ground_truth) == (True, "ok")
            for s in found)


def test_data_only_writes_the_tasks_without_a_model(tiny_dir, tmp_path):
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]
    completed = subprocess.run(
        [sys.executable, "-m", "tools.tiny", "--out", str(tmp_path / "d"), "--data-only"], cwd=repo,
        capture_output=True, text=True, timeout=120)
    assert completed.returncode == 0, completed.stderr[-2000:]
    assert not (tmp_path / "d" / "model").exists()
    written = sorted(p.name for p in (tmp_path / "d" / "data").iterdir())
    assert written == [
        "add_test.jsonl", "add_train.jsonl", "countdown_fresh.jsonl", "countdown_test.jsonl",
        "countdown_train.jsonl", "mul_test.jsonl", "mul_train.jsonl", "sum_test.jsonl",
        "sum_train.jsonl"]
    for name in ("add_train.jsonl", "sum_test.jsonl"):  # the very files the full build writes
        assert (tmp_path / "d" / "data" / name).read_bytes() == (
            tiny_dir / "data" / name
        ).read_bytes()
    (tmp_path / "a_file").write_text("")
    for argv, message in (
        (["--out", str(tmp_path / "a_file" / "x")], "is not a writable directory"),
        (["--warmup-steps", "-1"], "--warmup-steps must be >= 0, got -1")):
        bad = subprocess.run(
            [sys.executable, "-m", "tools.tiny", *argv], cwd=repo, capture_output=True, text=True,
            timeout=120)
        assert bad.returncode == 2 and message in bad.stderr


BUILD_CHILD = """
import json, sys
from pathlib import Path

import torch

torch.set_num_threads(int(sys.argv[2]))  # the caller's own setting, which the build must not depend on
from tools import tiny

seen = {"threads": torch.get_num_threads(), "kernels": torch.backends.cpu.get_cpu_capability()}
builds = [tiny.build_tiny, tiny.build_tiny_countdown, tiny.build_tiny_tool][:int(sys.argv[3])]
for build in builds:
    summary = build(sys.argv[1], warmup_steps=5)
    seen[Path(summary["model_dir"]).name] = summary["model_sha256"]
print(json.dumps(seen))
"""
# The bytes of 5-step builds under tiny.BUILD_ENV on tiny.REFERENCE_CPU (another CPU builds other
# bytes). A change to the build code changes them: then the committed reference weights
# (tiny.ASSETS) no longer follow from the code, and must be trained again (`python -m tools.tiny
# --out runs/ref --tool --countdown --from-scratch --save-assets`, with the new hashes in
# tiny.REFERENCE_SHA256) before these are updated.
SHORT_BUILD_SHA256 = {
    "model": "a0dee37dd8da74e3314f299982c93db9082dcc251cf43f45f429ed7a2793c89b",
    "countdown_model": "fd6edfe07f0b88864b60ce18a1aa89ee077a70a99e21ef4307b4c751495cfdf4",
    "tool_model": "490b62d29965fb86d1fb90f7d22c74b0748063b529a40fa64b9e4641053b50ba",
}


def test_build_is_the_same_bytes_under_other_thread_counts_and_kernels(tmp_path, tiny_dir):
    """Reduced builds (5 warm-up steps) in two processes: one thread under tiny.BUILD_ENV, all
    three models; two threads with ATen's generic kernels, the default. The bytes must be the same
    in both, on any CPU; on tiny.REFERENCE_CPU they must also be the pinned ones
    (SHORT_BUILD_SHA256), which another CPU does not build (docs/results.md, "Which model a result
    came from"). Without tiny.BUILD_ENV the second differs (the thread count alone did not change
    the bytes on a 2-core AMD EPYC; the kernels did). Apart from the weights, a trained directory
    is the one a default build obtains."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    if not tiny.can_pin():
        pytest.skip("no AVX2+FMA x86 CPU: tools/tiny.py builds unpinned here (docs/results.md)")
    repo = Path(__file__).resolve().parents[1]
    # the first builds in its own process (started under BUILD_ENV), the second in the pinned child
    # tools/tiny.py starts for it
    callers = {
        "1 thread": ({**tiny.BUILD_ENV}, 3),
        "2 threads, generic kernels": ({"OMP_NUM_THREADS": "2", "ATEN_CPU_CAPABILITY": "default"},
                                       1),
    }
    clean = {key: value for key, value in os.environ.items() if key not in tiny.BUILD_ENV}
    seen = {}
    for name, (env, count) in callers.items():
        completed = subprocess.run([sys.executable, "-c", BUILD_CHILD, str(tmp_path / name),
                                    env["OMP_NUM_THREADS"], str(count)], cwd=repo,
                                   env={**clean, **env, "PYTHONPATH": str(repo)},
                                   capture_output=True, text=True, timeout=600, check=False)
        assert completed.returncode == 0, completed.stderr[-2000:]
        seen[name] = json.loads(completed.stdout.strip().splitlines()[-1])
    # the callers really differ...
    assert [s["threads"] for s in seen.values()] == [1, 2]
    assert seen["2 threads, generic kernels"]["kernels"] == "DEFAULT"
    # ...and the models do not
    assert seen["1 thread"]["model"] == seen["2 threads, generic kernels"]["model"], seen
    built = {k: seen["1 thread"][k] for k in SHORT_BUILD_SHA256}
    if tiny.same_cpu(tiny.REFERENCE_CPU):
        assert built == SHORT_BUILD_SHA256
    else:  # a fact about this CPU, not a failure
        print(f"\n{tiny.describe_cpu(tiny.cpu_identity())}: 5-step builds {built}; the pinned "
              f"ones are {tiny.describe_cpu(tiny.REFERENCE_CPU)}'s")
    # the obtained default differs from a trained one in its weights only
    tiny.build_tiny_countdown(tiny_dir)
    tiny.build_tiny_tool(tiny_dir)
    trained = tmp_path / "1 thread"
    for path in sorted(trained.glob("*_model/*")) + sorted(trained.glob("model/*")):
        relative = path.relative_to(trained)
        if path.name != "model.safetensors":
            assert path.read_bytes() == (tiny_dir / relative).read_bytes(), relative


def test_default_builds_are_the_committed_reference_weights(tiny_dir, tmp_path, monkeypatch):
    """The committed weights are the reference build's bytes, a default build obtains exactly
    them, and a damaged copy is refused, not used."""
    import shutil

    from tools.tiny import file_sha256

    tiny.build_tiny_tool(tiny_dir)
    tiny.build_tiny_countdown(tiny_dir)
    for name, sha in tiny.REFERENCE_SHA256.items():
        assert file_sha256(tiny.ASSETS / f"{name}.safetensors") == sha
        assert file_sha256(tiny_dir / name / "model.safetensors") == sha
    # the summaries are the reference builds' records, with this directory's paths
    builds = json.loads((tiny.ASSETS / "builds.json").read_text())
    assert set(builds) == set(tiny.REFERENCE_SHA256)
    summary = json.loads((tiny_dir / "countdown.json").read_text())
    assert summary["warmup_steps"] == 1500 and summary["model_sha256"] == (
        tiny.REFERENCE_SHA256["countdown_model"])
    assert summary["model_dir"] == str(tiny_dir / "countdown_model")
    damaged = tmp_path / "assets"
    shutil.copytree(tiny.ASSETS, damaged)
    weights = bytearray((damaged / "model.safetensors").read_bytes())
    weights[len(weights) // 2] ^= 1
    (damaged / "model.safetensors").write_bytes(bytes(weights))
    monkeypatch.setattr(tiny, "ASSETS", damaged)
    with pytest.raises(SystemExit, match="not the reference"):
        tiny.build_tiny(tmp_path / "out")
    assert not (tmp_path / "out" / "tiny.json").exists()


def test_a_build_on_another_cpu_says_so_as_a_fact(tmp_path, monkeypatch, capsys):
    # /proc/cpuinfo as an Intel Xeon with AVX-512 shows it (two processors: the first tells)
    xeon = ("processor\t: 0\nvendor_id\t: GenuineIntel\ncpu family\t: 6\nmodel\t\t: 143\n"
            "model name\t: Intel(R) Xeon(R) Platinum 8480+\nflags\t\t: fpu avx2 fma avx512f\n\n"
            "processor\t: 1\nvendor_id\t: AuthenticAMD\n")
    identity = tiny.cpu_identity(xeon)
    assert identity == {"vendor": "GenuineIntel", "family": 6, "model": 143, "avx512": True,
                        "name": "Intel(R) Xeon(R) Platinum 8480+"}
    assert not tiny.same_cpu(tiny.REFERENCE_CPU, identity)
    assert tiny.same_cpu(tiny.REFERENCE_CPU, {**tiny.REFERENCE_CPU, "name": "AMD EPYC 7B13"})
    assert tiny.cpu_identity("") == {} and not tiny.same_cpu(tiny.REFERENCE_CPU, {})
    # the committed weights say where they were built
    for build in json.loads((tiny.ASSETS / "builds.json").read_text()).values():
        assert tiny.same_cpu(tiny.REFERENCE_CPU, build["build_env"]["cpu"])
    # a default build whose bytes are not the reference's: a fact on another CPU, a warning on the
    # reference's own
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "model.safetensors").write_bytes(b"other bytes")
    for cpu, said in ((identity, "as expected on another CPU"), (tiny.REFERENCE_CPU, "WARNING")):
        monkeypatch.setattr(tiny, "cpu_identity", lambda cpu=cpu: cpu)
        summary = tiny.check_reference({"model_dir": str(tmp_path / "model")}, "model", True)
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1 and said in lines[0], lines
        assert summary["build_env"]["cpu"] == cpu
