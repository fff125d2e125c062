"""config.py: every shipped config loads and validates; bad input fails with a message naming the key."""

import dataclasses
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import config

REPO = Path(__file__).resolve().parents[1]

CONFIGS = sorted((Path(__file__).resolve().parents[1] / "configs").glob("*.yaml"))


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_every_shipped_config_loads_and_round_trips(path, tmp_path):
    cfg = config.load(path)
    gpus = {"1.5b": 8, "7b": 16, "14b": 16, "32b": 32}  # the node counts the configs' comments give
    config.check(
        cfg, world_size=next((n for size, n in gpus.items() if f"{size}_" in path.name), 2))
    resolved = tmp_path / "config.yaml"
    resolved.write_text(config.to_yaml(cfg))
    assert config.load(resolved) == cfg  # what a run saves reloads to the same config


def test_paper_config_values():
    cfg = config.load(Path(CONFIGS[0]).with_name("qwen2.5_math_7b_short_stare.yaml"))
    # the reference run (docs/method.md, "The reference release"): spot checks of every section
    assert (cfg.loss.clip_low, cfg.loss.clip_high, cfg.loss.dual_clip) == (0.2, 0.28, 10.0)
    assert (cfg.loss.stare_variant, cfg.loss.stare_top_ratio, cfg.gate.w, cfg.gate.m) == (
        "O1", 0.1, 1.1, 0.9)
    assert (
        cfg.gate.target_entropy,
        cfg.algorithm.gen_batch_size,
        cfg.algorithm.max_num_gen_batches,
    ) == (0.3, 192, 10)
    assert (cfg.train.train_batch_size, cfg.rollout.n, cfg.train.micro_token_budget) == (
        64, 8, 8192)
    assert (
        cfg.optim.lr,
        cfg.optim.grad_clip,
        cfg.data.max_prompt_tokens,
        cfg.rollout.max_tokens,
    ) == (1e-6, 1.0, 1024, 3072)
    assert (cfg.eval.n, cfg.eval.top_p) == (32, 0.7)
    twin = config.load(Path(CONFIGS[0]).with_name("qwen2.5_math_7b_short_grpo_ds.yaml"))
    differing = {k for k, v in config.to_dict(twin).items() if v != config.to_dict(cfg)[k]}
    assert differing == {"algorithm", "train"} and twin.algorithm.method == "grpo"


def test_long_cot_configs_scale_the_reweighting_and_length():
    short = config.load(Path(CONFIGS[0]).with_name("qwen2.5_math_7b_short_stare.yaml"))
    long7 = config.load(Path(CONFIGS[0]).with_name("qwen7b_long.yaml"))
    assert (long7.gate.w, long7.gate.m) == (
        1.1, 0.9) and long7.rollout.max_tokens > short.rollout.max_tokens
    # the reference README: W = 1.05, M = 0.95 and a longer max_response
    for size in ("14b", "32b"):
        cfg = config.load(Path(CONFIGS[0]).with_name(f"qwen{size}_long.yaml"))
        assert (cfg.gate.w, cfg.gate.m) == (1.05, 0.95)
        assert (
            cfg.rollout.max_tokens > long7.rollout.max_tokens
            and cfg.eval.max_tokens == cfg.rollout.max_tokens)
        assert cfg.train.micro_token_budget >= cfg.data.max_prompt_tokens + cfg.rollout.max_tokens
        assert (cfg.loss, cfg.algorithm) == (long7.loss, long7.algorithm)
        assert cfg.gate == dataclasses.replace(long7.gate, w=1.05, m=0.95)


def test_overrides_are_typed(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("data:\n  train_files: [a.jsonl]\n")
    cfg = config.load(
        path,
        [
            "train.total_steps=7", "optim.lr=3e-5", "loss.dual_clip=null", "rollout.kv_cache_gib=1",
            "data.train_files=[x.jsonl, y.parquet]", "data.prompt_suffix=",
            "algorithm.method=kl_cov"])
    assert cfg.train.total_steps == 7 and cfg.optim.lr == 3e-5 and cfg.loss.dual_clip is None
    # ints widen to floats
    assert cfg.rollout.kv_cache_gib == 1.0 and isinstance(cfg.rollout.kv_cache_gib, float)
    assert cfg.data.train_files == ["x.jsonl", "y.parquet"] and cfg.data.prompt_suffix == ""
    assert cfg.algorithm.method == "kl_cov"


@pytest.mark.parametrize(
    "override,message",
    [
        (
            "algorithm.methd=grpo",
            "'algorithm.methd': unknown key (did you mean 'algorithm.method'?)"),
        ("trian.total_steps=3", "'trian': unknown key (did you mean 'train'?)"),
        ("train.total_steps=3.5", "'train.total_steps': expected int, got 3.5"),
        ("train.total_steps=true", "'train.total_steps': expected int, got True"),
        ("rollout.enforce_eager=1", "'rollout.enforce_eager': expected bool, got 1"),
        ("data.train_files=a.jsonl", "'data.train_files': expected a list"),
        ("algorithm.method=stapoo", "'algorithm.method': 'stapoo' is not one of"),
        ("algorithm.method=stapoo", "did you mean 'stapo'?"),
        (
            "train.mini_batch_size=24",
            "'train.mini_batch_size': must divide train.train_batch_size (64)"),
        (
            "algorithm.gen_batch_size=32",
            "'algorithm.gen_batch_size': must be >= train.train_batch_size (64)"),
        ("rollout.n=1", "'rollout.n': must be >= 2"),
        ("optim.lr=0", "'optim.lr': must be > 0"),
        (
            "loss.stare_top_ratio=1.5",
            "config section 'loss': invalid loss config: stare_top_ratio=1.5"),
        ("loss.clip_low=-0.1", "config section 'loss': invalid loss config: clip_low=-0.1"),
        (
            "reward.overlong_buffer_len=512",
            "config section 'reward': max_response_len (0) must be > overlong_buffer_len"),
        ("optim.lr=fast", "'optim.lr': expected float, got 'fast'"),
        ("rollout.top_p=1.5", "'rollout.top_p': must be in (0, 1]"),
        ("totalsteps", "must look like section.key=value"),
        ("optim.lr=.inf", "'optim.lr': must be a finite number, got inf"),
        ("loss.clip_high=.nan", "'loss.clip_high': must be a finite number, got nan"),
        ("gate.target_entropy=-1e999", "'gate.target_entropy': must be a finite number, got -inf"),
        # values that ran before without doing what was meant
        ("gate.target_entropy=0", "'gate.target_entropy': must be > 0"),  # the gate never opened
        ("train.log_every=0", "'train.log_every': must be > 0"),  # a crash after the first step
        ("rollout.gpu_memory_utilization=1.5",
         "'rollout.gpu_memory_utilization': must be in (0, 1]"),
        ("rollout.kv_cache_gib=0", "'rollout.kv_cache_gib': must be > 0 or null"),
        ("hardware.host_gib=-1", "'hardware.host_gib': must be > 0 or null"),
        # vLLM refused these only once its engine had started
        ("rollout.n=16385", "'rollout.n': must be <= 16384, vLLM's limit (VLLM_MAX_N_SEQUENCES)"),
        ("eval.n=20000", "'eval.n': must be <= 16384, vLLM's limit"),
        # an empty out_dir trained the run into the working directory
        ("train.out_dir=", "'train.out_dir': must name a directory (empty would write the run "
                           "into the working directory), got ''")])
def test_bad_overrides_name_the_key(override, message, tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("data:\n  train_files: [a.jsonl]\n")
    with pytest.raises(config.ConfigError) as error:
        config.load(path, [override])
    assert message in str(error.value)


def test_world_size_and_file_errors(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(
        "data:\n  train_files: [a.jsonl]\ntrain:\n  train_batch_size: 6\n  mini_batch_size: 6\n"
        "algorithm:\n  gen_batch_size: 6\n")
    cfg = config.load(path)
    config.check(cfg, world_size=3)
    with pytest.raises(config.ConfigError, match="divisible by the number of ranks \\(4\\)"):
        config.check(cfg, world_size=4)
    with pytest.raises(config.ConfigError, match="cannot read config file"):
        config.load(tmp_path / "missing.yaml")
    (tmp_path / "bad.yaml").write_text("model: [1, 2\n")
    with pytest.raises(config.ConfigError, match="not valid YAML"):
        config.load(tmp_path / "bad.yaml")
    # yaml.safe_load keeps the last of two values silently
    (tmp_path / "twice.yaml").write_text("optim:\n  lr: 1.0e-6\n  warmup_steps: 3\n  lr: 1.0e-4\n")
    with pytest.raises(config.ConfigError) as error:
        config.load(tmp_path / "twice.yaml")
    assert str(error.value) == (f"config file {tmp_path / 'twice.yaml'}:4 is not valid YAML: "
                                f"key 'lr' is given twice")
    (tmp_path / "list.yaml").write_text("- a\n- b\n")
    with pytest.raises(config.ConfigError, match="must hold a mapping"):
        config.load(tmp_path / "list.yaml")
    # the defaults load (evaluate.py needs no training data); a training run refuses them
    with pytest.raises(config.ConfigError, match="'data.train_files': needs at least one file"):
        config.check_paths(config.load(None))
    (tmp_path / "empty.yaml").write_text("# nothing but a comment\n")
    with pytest.raises(config.ConfigError, match=f"config file {tmp_path / 'empty.yaml'} is empty"):
        config.load(tmp_path / "empty.yaml")


def test_paths_are_checked_with_where_they_are_read_from(tiny_dir, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    base = [
        f"model.path={tiny_dir / 'model'}",
        f"data.train_files=[{tiny_dir / 'data' / 'sum_train.jsonl'}]", "eval.files=[]",
        f"train.out_dir={tmp_path / 'run'}"]
    config.check_paths(config.load(REPO / "configs" / "tiny.yaml", base))  # all good

    def problem(*overrides):
        with pytest.raises(config.ConfigError) as error:
            config.check_paths(config.load(REPO / "configs" / "tiny.yaml", base + list(overrides)))
        return str(error.value)

    # relative: read from the working directory, not a hub
    message = problem("model.path=models/Qwen2.5-7B")
    assert "'model.path'" in message and f"relative to the working directory {tmp_path}" in message
    assert (
        "does not exist" in message
        and "nothing is downloaded" in message
        and "--local-dir models/Qwen2.5-7B" in message)
    (tmp_path / "run_dir" / "hf").mkdir(parents=True)
    (tmp_path / "run_dir" / "hf" / "config.json").write_text("{}")
    assert "training run's directory; its model is" in problem("model.path=run_dir")
    (tmp_path / "notes").mkdir()
    message = problem("model.path=notes")
    assert (
        "not a Hugging Face model directory" in message
        and "config.json" in message
        and "weights" in message)
    assert "'data.train_files[1]'" in problem(
        f"data.train_files=[{tiny_dir / 'data' / 'sum_train.jsonl'},x.jsonl]")
    assert "'eval.files[0]'" in problem("eval.files=[missing.jsonl]")
    assert problem("rollout.max_tokens=500") == (  # 64 + 500 > the tiny model's 512 positions
        "data.max_prompt_tokens + rollout.max_tokens (or eval.max_tokens) = 564 tokens exceeds the model's context "
        f"(max_position_embeddings = 512 in {tiny_dir / 'model' / 'config.json'})")
    assert "'train.resume'" in problem("train.resume=nowhere") and "no trainer.pt" in problem(
        "train.resume=nowhere")
    (tmp_path / "file").write_text("")
    assert "'train.out_dir'" in problem("train.out_dir=file/run")
    # what a run writes may not be what it reads, nor of the wrong kind
    data_file = tmp_path / "run" / "metrics.jsonl"
    data_file.parent.mkdir()
    data_file.write_text((tiny_dir / "data" / "sum_train.jsonl").read_text())
    assert problem(f"data.train_files=[{data_file}]") == (
        f"config key 'train.out_dir (metrics.jsonl)': {data_file} would overwrite config key "
        f"'data.train_files[0]' ({data_file}), which it reads")
    shutil.copytree(tiny_dir / "model", tmp_path / "run" / "hf")  # a model exported there
    assert problem(f"model.path={tmp_path / 'run' / 'hf'}").startswith(
        f"config key 'train.out_dir (hf)': {tmp_path / 'run' / 'hf'} would overwrite config key "
        f"'model.path'")
    (tmp_path / "run" / "checkpoints").write_text("")
    assert problem() == (f"config key 'train.out_dir (checkpoints)': "
                         f"{tmp_path / 'run' / 'checkpoints'} is a file, not a directory")
    (tmp_path / "run" / "checkpoints").unlink()
    # the run's own config.yaml may be its --config (rewritten with the same values)
    config.check_paths(config.load(REPO / "configs" / "tiny.yaml", base),
                       config_path=tmp_path / "run" / "config.yaml")


@pytest.mark.parametrize("package", ["wandb", "tensorboard"])
def test_optional_loggers_need_their_package(package):
    import importlib.util
    if importlib.util.find_spec(package) is not None:
        pytest.skip(f"{package} is installed here")
    with pytest.raises(config.ConfigError, match=f"train.{package}.*pip install {package}"):
        config.load("configs/tiny.yaml", [f"train.{package}=true"])


def test_inputs_that_failed_late_or_raw_are_one_line(tiny_dir, tmp_path):
    base = [f"model.path={tiny_dir / 'model'}",
            f"data.train_files=[{tiny_dir / 'data' / 'sum_train.jsonl'}]", "eval.files=[]",
            f"train.out_dir={tmp_path / 'run'}"]

    def problem(*overrides):
        with pytest.raises(config.ConfigError) as error:
            config.check_paths(config.load(REPO / "configs" / "tiny.yaml", base + list(overrides)))
        assert "\n" not in str(error.value)
        return str(error.value)

    (tmp_path / "latin1.yaml").write_bytes("model:\n  path: caf\xe9\n".encode("latin-1"))
    with pytest.raises(config.ConfigError) as error:
        config.load(tmp_path / "latin1.yaml")
    assert str(error.value) == (
        f"config file {tmp_path / 'latin1.yaml'}:2 is not UTF-8 text (byte 0xe9)")
    # a named pipe is not "missing": it exists, and reading it would wait for a writer
    os.mkfifo(tmp_path / "pipe.jsonl")
    assert problem(f"data.train_files=[{tmp_path / 'pipe.jsonl'}]") == (
        f"config key 'data.train_files[0]': {tmp_path / 'pipe.jsonl'} is a named pipe (FIFO), not "
        f"a regular file")
    with pytest.raises(config.ConfigError, match="pipe.jsonl is a named pipe"):
        config.load(tmp_path / "pipe.jsonl")  # as --config: refused, not read (it would block)
    (tmp_path / "dangling.jsonl").symlink_to(tmp_path / "gone.jsonl")
    assert problem(f"eval.files=[{tmp_path / 'dangling.jsonl'}]").endswith(
        f"is a symbolic link to {tmp_path / 'gone.jsonl'}, which does not exist")
    # a model directory copied in part, or edited by hand
    model = tmp_path / "model"
    shutil.copytree(tiny_dir / "model", model)
    weights = (model / "model.safetensors").read_bytes()
    (model / "model.safetensors").write_bytes(weights[:len(weights) // 2])
    assert problem(f"model.path={model}") == (
        f"config key 'model.path': {model / 'model.safetensors'} is truncated "
        f"({len(weights) // 2} bytes, its header needs {len(weights)}): a copy cut short or "
        f"damaged; fetch it again")
    (model / "model.safetensors").write_bytes(weights[:4])
    assert "its header alone needs" in problem(f"model.path={model}")
    (model / "model.safetensors").write_bytes(weights)
    settings = (model / "config.json").read_text()
    (model / "config.json").write_text(settings[:len(settings) // 2])
    assert problem(f"model.path={model}").startswith(
        f"config key 'model.path': {model / 'config.json'} cannot be read as JSON "
        f"(JSONDecodeError: ")
    (model / "config.json").write_text("[]")
    assert "holds a list, not the model's settings" in problem(f"model.path={model}")
    (model / "config.json").unlink()
    os.mkfifo(model / "config.json")
    assert problem(f"model.path={model}") == (
        f"config key 'model.path': {model / 'config.json'} is a named pipe (FIFO), not a regular "
        f"file")
    # a checkpoint is not a model, and the Hub has nothing to do with it
    step = tmp_path / "old_run" / "checkpoints" / "step_00000004"
    (step / "sharded").mkdir(parents=True)
    (step / "trainer.pt").write_bytes(b"")
    for given in (step, step.parent, step.parent.parent):
        message = problem(f"model.path={given}")
        assert "not a model: export it as one with `python train.py --config " in message
        assert f"--export train.resume={step}`" in message and "train.resume=" in message
        assert "download" not in message


def test_a_file_size_limit_below_what_a_run_writes_is_one_line(tiny_dir):
    # Python ignores SIGXFSZ: past the limit a write raises EFBIG deep inside vLLM's compiler
    checked = subprocess.run([sys.executable, "-c", (
        "import resource, sys, config\n"
        "resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, resource.RLIM_INFINITY))\n"
        f"config.check_write_limit({str(tiny_dir / 'model')!r})\n")],
        capture_output=True, text=True, cwd=REPO)
    assert checked.returncode == 1
    assert checked.stderr.strip().splitlines()[-1] == (
        "config.ConfigError: the file-size limit (ulimit -f) is 1.0 MiB: a run writes larger "
        "files (checkpoints, the export, vLLM's compile cache: at least 256 MiB); raise it, e.g. "
        "`ulimit -f unlimited`")
    config.check_write_limit(tiny_dir / "model")  # this process has none
