"""Run by tests/test_rollout.py under `torchrun --nproc_per_node 2`: two ranks, an engine each,
FSDP2 sync.

    PYTHONPATH=. python -m torch.distributed.run --nproc_per_node 2 tests/rollout_two_ranks.py MODEL_DIR RESULT_JSON
"""

import json
import os
import sys
import types
from multiprocessing import shared_memory

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from transformers import AutoModelForCausalLM, AutoTokenizer

import config
import data
import rollout
import runs


def main(model_dir, result_path):
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    # the engine is built after the process group (its construction is a collective) and before any
    # optimizer
    engine_cfg = config.RolloutConfig(dtype="float32", kv_cache_gib=0.2, max_num_seqs=32,
                                      enforce_eager=True)
    engine = rollout.build_engine(engine_cfg, model_dir, seed=1234 + rank, max_model_len=128)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompt = data.chat_template_ids(
        tokenizer, [{"role": "user", "content": "Write 23 as a+b with a, b > 0."}])

    # same prompt, no per-prompt seed: each rank's own stream (seeded base + rank) decides
    samples = rollout.generate(engine, [prompt], n=8, max_tokens=16).token_ids
    gathered = [None, None]
    dist.all_gather_object(gathered, samples)

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    torch.manual_seed(0)  # the same change on every rank, applied to each rank's shard
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(0.05 * torch.randn_like(parameter))
    probe = prompt + gathered[0][0]
    # collective forward on all ranks
    stale_error = rollout.weight_sync_error(engine, model, probe, len(prompt))
    # the sync gathers in the engine's dtype: each shard is cast before its all-gather, never
    # gathered in float32
    gathered_dtypes, full_tensor = set(), DTensor.full_tensor
    DTensor.full_tensor = lambda self, *a, **k: (
        gathered_dtypes.add(str(self.dtype)) or full_tensor(self, *a, **k))
    try:
        half = dict(rollout.full_parameters(model, torch.bfloat16))
    finally:
        DTensor.full_tensor = full_tensor
    half_exact = all(torch.equal(half[name], full.to(torch.bfloat16))
                     for name, full in rollout.full_parameters(model))
    rollout.sync_weights(engine, rollout.full_parameters(model, rollout.engine_dtype(engine)))
    synced_error = rollout.weight_sync_error(engine, model, probe, len(prompt))
    errors = [None, None]
    dist.all_gather_object(errors, (stale_error, synced_error))
    # what vLLM's CPU workers name a tensor-parallel group's shared memory after, and that name
    idents = [None, None]
    dist.all_gather_object(idents, os.environ["VLLM_DIST_IDENT"])
    from vllm.distributed.device_communicators.cpu_communicator import _CPUSHMDistributed

    group_name = _CPUSHMDistributed.make_group_name(
        types.SimpleNamespace(unique_name="tp:0", ranks=[0, 1]))

    if rank == 0:
        with open(result_path, "w") as f:
            json.dump(
                {
                    "rank_samples_differ": gathered[0] != gathered[1],
                    "stale_error": min(e[0] for e in errors),
                    "synced_error": [e[1] for e in errors],
                    "gathered_dtypes": sorted(gathered_dtypes),
                    "half_exact": half_exact,
                    "engine_dtype": str(rollout.engine_dtype(engine)),
                    "dist_idents": idents, "shm_group_name": group_name,
                    "engine_tag": rollout._engine_tag,
                    # what a tensor-parallel group's broadcast buffer is named (shm_broadcast.py)
                    "broadcast_name": shared_memory._make_filename(),
                },
                f)
    dist.barrier()
    # this also tears down the default process group (see rollout.shutdown_engine)
    rollout.shutdown_engine(engine)
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
    runs.exit_process(0)
