"""tools/gpu_smoke.py: `python -m tools.bench gpu-smoke`, the first command on a new GPU machine
(docs/benchmarks.md, "A new GPU machine"): preflight, the engine's sleep / sync / probe cycles (or
the trainer's side alone where vLLM does not import), the GPU tests, `update --size 1.5b`.

    python -m tools.bench gpu-smoke [--out runs/gpu_smoke.json] [--runner v1] [--sleep-level 2]
    python -m tools.bench gpu-smoke --cpu --out /tmp/smoke.json   # the same cycles, tiny, on CPU
"""

import json
import math
import os
from pathlib import Path

import torch

import baselines
from tools.bench import QWEN25, REPO

SMOKE_SHAPE = dict(QWEN25["0.5b"], max_position_embeddings=4096)
# --cpu (the suite's run of this command): a tiny shape, vLLM's CPU build
CPU_SHAPE = dict(QWEN25["tiny"], head_dim=64, num_attention_heads=2, num_key_value_heads=1,
                 vocab_size=320, max_position_embeddings=512)
CPU_SIZES = dict(cycles=2, prompts=4, max_tokens=16)


def smoke_model(directory, shape=SMOKE_SHAPE):
    """A random Qwen2 in bfloat16 with the tiny default's tokenizer (ids < 259 < its vocabulary):
    nothing is downloaded. -> its directory."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from tools import tiny

    tokenizer = tiny.build_tokenizer()
    eos, pad = tokenizer.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(
        Qwen2Config(eos_token_id=eos, pad_token_id=pad, bos_token_id=pad, **shape))
    model.to(torch.bfloat16).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def free_gib(device):
    """Free device memory (GiB), None off CUDA."""
    return round(torch.cuda.mem_get_info(device)[0] / 2**30, 2) if device.type == "cuda" else None


def allocated_gib(device):
    """Device memory held by tensors (freed memory stays with the caching allocator), None off
    CUDA."""
    return torch.cuda.memory_allocated(device) / 2**30 if device.type == "cuda" else None


def growth_gib(before, after):
    return None if before is None else round(after - before, 3)


def peak_gib(device, fn):
    """The device memory fn allocates at its peak (GiB), None off CUDA."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    before = allocated_gib(device)
    fn()
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if before is not None else None
    return growth_gib(before, peak)


def smoke_config(model_dir, device, prompts, max_tokens):
    import config

    return config.load(overrides=[
        "data.train_files=[unused.jsonl]", f"model.path={model_dir}",
        "model.param_dtype=" + ("bfloat16" if device.type == "cuda" else "float32"),
        "algorithm.method=grpo", "optim.lr=1e-5", f"rollout.max_tokens={max_tokens}",
        "rollout.n=4", f"train.train_batch_size={prompts}", f"train.mini_batch_size={prompts}"])


def smoke_groups(prompt_ids, out, generator):
    """grpo.Group's of 4 from sampled output (rollout.generate's fields), random 0/1 rewards."""
    import grpo

    rewards = torch.randint(0, 2, (len(out.token_ids),), generator=generator).float()
    responses = [
        grpo.Response(prompt=prompt_ids[out.prompt_index[i]], tokens=out.token_ids[i] or [3],
                       rollout_logprobs=out.logprobs[i] or [0.0], reward=float(rewards[i]),
                       accuracy=float(rewards[i]), truncated=out.finish_reasons[i] == "length",
                       reflection=(0, 0),
                       policy_mask=torch.ones(max(1, len(out.token_ids[i])), dtype=torch.bool))
        for i in range(len(out.token_ids))]
    return [grpo.Group(responses[j].prompt, responses[j:j + 4])
            for j in range(0, len(responses), 4)]


def gather_memory(groups, device):
    """Device memory of gathering the groups through runs.all_gather (a gloo group: host memory)
    and through the default group (NCCL on a GPU: world x the pickled object on the device)."""
    import runs

    free, world = free_gib(device), torch.distributed.get_world_size()
    return dict(
        gather_gib=peak_gib(device, lambda: runs.all_gather(groups)),
        gather_default_group_gib=peak_gib(
            device, lambda: torch.distributed.all_gather_object([None] * world, groups)),
        free_gib_gather=[free, free_gib(device)])


def probe_memory(model, probe, device):
    """The probe's no-grad forward again: which parameters it leaves gathered (FSDP2's root unit),
    the device memory they hold, and what modeling.reshard_root frees."""
    import modeling
    import rollout

    free, before = free_gib(device), allocated_gib(device)
    rollout.trainer_logprobs(model, *probe)
    gathered = [n for n, p in model.named_parameters() if not hasattr(p, "to_local")]
    after, free_gathered = allocated_gib(device), free_gib(device)
    modeling.reshard_root(model)
    return dict(probe_gathered=gathered, probe_gathered_gib=growth_gib(before, after),
                probe_freed_gib=growth_gib(allocated_gib(device), after),
                free_gib_probe=[free, free_gathered, free_gib(device)],
                resharded=all(hasattr(p, "to_local") for p in model.parameters()))


def update_on(model, optimizer, states, groups, cfg, cycle, device):
    """train.py's no-grad pass, method states and update on the groups -> (responses, record)."""
    import grpo

    responses = grpo.group_responses(groups, cfg, 0, 1)
    grpo.old_policy_pass(model, responses, cfg, device)
    mismatch = torch.cat(
        [(torch.tensor(r.rollout_logprobs) - r.old_logprobs).abs() for r in responses])
    grpo.update_states(states, responses, device)
    metrics = grpo.policy_update(model, optimizer, responses, cfg, states, cycle, device)
    return responses, dict(
        logprob_mismatch_mean=float(mismatch.mean()), grad_norm=metrics["train/grad_norm"],
        skipped=metrics["train/skipped_updates"], free_gib_update=free_gib(device))


def update_failures(record):
    if record["skipped"] or not math.isfinite(record["grad_norm"]):
        return [f"cycle {record['cycle']}: the update was not finite"]
    return []


def trainer_cycles(model_dir, device, cycles=2, prompts=16, max_tokens=128):
    """gpu-smoke's cycles where vLLM does not import: random responses instead of sampled ones, then
    the same gather, no-grad pass, update and probe forward as engine_cycles, with the same memory
    readings (gather_*, probe_*). -> report dict (report["ok"] False on a non-finite update, a probe
    that leaves a decoder layer gathered or anything left unsharded after reshard_root)."""
    import types

    import modeling

    cfg = smoke_config(model_dir, device, prompts, max_tokens)
    model = modeling.build_model(cfg, device, 1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.optim.lr)
    states = baselines.method_states(cfg)
    report = {"cycles": [], "failures": [], "free_gib_trainer": free_gib(device)}
    generator = torch.Generator().manual_seed(0)
    prompt_ids = [torch.randint(3, 259, (64,), generator=generator).tolist()
                  for _ in range(prompts)]
    for cycle in range(1, cycles + 1):
        lengths = torch.randint(1, max_tokens + 1, (4 * prompts,), generator=generator).tolist()
        out = types.SimpleNamespace(
            prompt_index=[i // 4 for i in range(4 * prompts)],
            token_ids=[torch.randint(3, 259, (n,), generator=generator).tolist() for n in lengths],
            logprobs=[[0.0] * n for n in lengths], finish_reasons=["stop"] * (4 * prompts))
        groups = smoke_groups(prompt_ids, out, generator)
        record = {"cycle": cycle, **gather_memory(groups, device)}
        responses, update = update_on(model, optimizer, states, groups, cfg, cycle, device)
        record.update(update)
        del record["logprob_mismatch_mean"]  # random tokens: no sampler to compare with
        probe = (responses[0].prompt + responses[0].tokens, len(responses[0].prompt))
        record.update(probe_memory(model, probe, device))
        report["failures"] += update_failures(record)
        if any(".layers." in name for name in record["probe_gathered"]) or not record["resharded"]:
            report["failures"].append(f"cycle {cycle}: the probe left a decoder layer gathered "
                                      "or reshard_root left a parameter unsharded")
        report["cycles"].append(record)
    report["ok"] = not report["failures"]
    return report


def engine_cycles(model_dir, device, cycles=3, runner="v1", sleep_level=2, sleep=True,
                  kv_cache_gib=None, utilization=0.3, prompts=16, max_tokens=128,
                  max_probe_error=2.0, max_mismatch=0.25):
    """`cycles` x (generate -> gather the groups -> sleep -> update -> wake weights -> sync ->
    trainer side of the probe -> wake KV cache -> engine side of the probe), in train.py's order and
    with its functions, on one rank -> report dict. Free device memory is read after every phase; a
    probe error or a rollout/trainer mismatch past the bounds, a non-finite update or an exception
    is a failure (report["ok"] False, report["failures"]). Each cycle also measures two things an
    NCCL group and a GPU decide (gather_memory, probe_memory): the device memory of gathering the
    groups, and what a no-grad forward of the probe leaves gathered and reshard_root frees."""
    import dataclasses
    import logging
    import re

    import config
    import modeling
    import rollout

    report = {"cycles": [], "failures": []}
    graph_gib = []

    class GraphLog(logging.Handler):  # vLLM logs the CUDA-graph memory it captured
        def emit(self, record):
            found = re.search(
                r"[Gg]raph capturing finished.*?took ([0-9.]+) GiB", record.getMessage())
            if found:
                graph_gib.append(float(found[1]))

    handler = GraphLog()
    logging.getLogger("vllm").addHandler(handler)
    cfg = smoke_config(model_dir, device, prompts, max_tokens)
    sync_cfg = config.apply_overrides(cfg, [f"rollout.enable_sleep_mode={str(sleep).lower()}"])
    report["free_gib_start"] = free_gib(device)
    # sleep mode as sync_cfg says; enforce_eager None: on CPU only (rollout.build_engine)
    engine_cfg = dataclasses.replace(
        sync_cfg.rollout, dtype="bfloat16", gpu_memory_utilization=utilization,
        kv_cache_gib=kv_cache_gib, model_runner=runner, enforce_eager=None)
    engine = rollout.build_engine(engine_cfg, model_dir, seed=0, max_model_len=64 + max_tokens + 1)
    try:
        vllm_config = engine.llm_engine.vllm_config
        shape = vllm_config.model_config.hf_config
        kv_heads, head_dim = (shape.num_key_value_heads,
                              shape.hidden_size // shape.num_attention_heads)
        token_bytes = 2 * shape.num_hidden_layers * kv_heads * head_dim * 2
        blocks = vllm_config.cache_config.num_gpu_blocks or 0
        report.update(
            runner=rollout.engine_runner(engine), engine_dtype=str(rollout.engine_dtype(engine)),
            kv_cache_gib=round(blocks * vllm_config.cache_config.block_size * token_bytes / 2**30,
                               2),
            cuda_graph_gib=graph_gib[-1] if graph_gib else None, free_gib_engine=free_gib(device))
        model = modeling.build_model(cfg, device, 1)
        optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.optim.lr)
        states = baselines.method_states(cfg)
        report["free_gib_trainer"] = free_gib(device)
        generator = torch.Generator().manual_seed(0)
        prompt_ids = [torch.randint(3, 259, (64,), generator=generator).tolist()
                      for _ in range(prompts)]
        for cycle in range(1, cycles + 1):
            out = rollout.generate(engine, prompt_ids, n=4, max_tokens=max_tokens,
                                   seeds=[(cycle - 1) * prompts + i for i in range(prompts)])
            record = {"cycle": cycle, "free_gib_rollout": free_gib(device)}
            groups = smoke_groups(prompt_ids, out, generator)
            record.update(gather_memory(groups, device))
            if sleep:
                rollout.release_memory(engine, sleep_level)
            record["free_gib_asleep"] = free_gib(device)
            responses, update = update_on(model, optimizer, states, groups, cfg, cycle, device)
            record.update(update)
            probe, checks = rollout.sync_engine(engine, model, sync_cfg.rollout, responses, cycle,
                                                None, first=True)
            error = checks.get("rollout/sync_probe_error")
            record.update(probe_error=error, probe_tv=checks.get("rollout/sync_probe_tv"),
                          probe_tokens=len(probe[0]) - probe[1] if probe else 0,
                          free_gib_synced=free_gib(device),
                          resharded=all(hasattr(p, "to_local") for p in model.parameters()))
            if probe:  # the probe's forward again, then reshard_root, as rollout.sync_engine does
                record.update({k: v for k, v in probe_memory(model, probe, device).items()
                               if k != "resharded"})
            if error is None or not error <= max_probe_error:
                report["failures"].append(
                    f"cycle {cycle}: probe error {error} (bound {max_probe_error})")
            if not record["logprob_mismatch_mean"] <= max_mismatch:
                report["failures"].append(
                    f"cycle {cycle}: rollout/trainer mismatch "
                    f"{record['logprob_mismatch_mean']:.3g} (bound {max_mismatch})")
            report["failures"] += update_failures(record)
            report["cycles"].append(record)
    except Exception as error:  # noqa: BLE001  (a smoke test reports every failure)
        report["failures"].append(f"{type(error).__name__}: {error}")
    finally:
        logging.getLogger("vllm").removeHandler(handler)
        rollout.shutdown_engine(engine)
    report["ok"] = not report["failures"]
    return report


def bench_gpu_smoke(args):
    """The first command on a new GPU machine (docs/benchmarks.md, "A new GPU machine"): the
    engine's sleep / sync / probe cycles, then the GPU tests and `update --size 1.5b`; one JSON,
    exit 1 on any failure. --cpu: the trainer's and the engine's cycles on a tiny model with vLLM's
    CPU build (no sleep mode, GPU tests or update), to the same JSON."""
    import subprocess
    import sys
    import tempfile
    import traceback

    if not torch.cuda.is_available() and not args.cpu:
        print(
            'gpu-smoke needs CUDA: run it on a GPU machine (docs/benchmarks.md, "A new GPU machine")',
            file=sys.stderr)
        sys.exit(2)
    import plan
    import runs

    repo = REPO
    installed = plan.installed_versions()
    errors, warnings = ([], []) if args.cpu else plan.machine_problems(installed)
    result = {
        "device": "cpu" if args.cpu else torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "installed": installed,
        "preflight": errors + warnings,
    }
    rank, world, device = runs.setup_distributed()
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = smoke_model(tmp + "/model", CPU_SHAPE if args.cpu else SMOKE_SHAPE)
        sizes = CPU_SIZES if args.cpu else {}
        try:
            import vllm  # noqa: F401
        except ImportError as error:
            result["engine"] = {"ok": False,
                                "failures": [f"not run: vllm does not import here ({error})"]}
        if args.cpu or "engine" in result:  # before the engine's shutdown ends the process group
            try:
                result["trainer"] = trainer_cycles(model_dir, device, **sizes)
            except Exception:  # noqa: BLE001  (a smoke test reports every failure)
                result["trainer"] = {"ok": False, "failures": [traceback.format_exc()[-3000:]]}
        if "engine" not in result:
            result["engine"] = engine_cycles(
                model_dir, device, runner=args.runner, sleep_level=args.sleep_level,
                sleep=not args.cpu, kv_cache_gib=0.1 if args.cpu else None, **sizes)
    # the engine's shutdown destroys the default group with its own (vLLM's
    # cleanup_dist_env_and_memory): a second destroy fails
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    if args.cpu:
        result["ok"] = result["engine"]["ok"] and result["trainer"]["ok"]
        return finish(result, args.out)
    torch.cuda.empty_cache()  # the tests and the update benchmark below get the whole device
    # the children start process groups of their own, not on this one's address
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    tests = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-o", "addopts=-ra",  # one process, no xdist
         "tests/test_gpu.py", "tests/test_baselines.py", "tests/test_modeling.py",
         "tests/test_stare.py::test_selection_never_syncs_host_and_device"],
        cwd=repo, env=env, capture_output=True, text=True)
    result["gpu_tests"] = {"returncode": tests.returncode,
                           "summary": (tests.stdout.strip().splitlines() or [""])[-1]}
    if tests.returncode:
        result["gpu_tests"]["output"] = (tests.stdout + tests.stderr)[-20000:]
    update = subprocess.run(
        [sys.executable, "-m", "tools.bench", "update", "--size", "1.5b", "--gc",
         "--budget", "32768", "--repeats", "2"], cwd=repo, env=env, capture_output=True, text=True)
    try:
        result["update"] = json.loads(update.stdout.strip().splitlines()[-1])
    except (IndexError, json.JSONDecodeError):
        result["update"] = {"returncode": update.returncode, "error": update.stderr[-2000:]}
    failed = (not result["engine"]["ok"] or not result.get("trainer", {"ok": True})["ok"]
              or tests.returncode != 0 or update.returncode != 0
              or any(line.startswith("error") for line in errors))
    result["ok"] = not failed
    return finish(result, args.out)


def finish(result, out):
    """The report to `out` and stdout; exit 1 unless it is ok."""
    import sys

    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps(result, indent=1))
    print(json.dumps(result))
    sys.exit(0 if result["ok"] else 1)
