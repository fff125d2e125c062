"""Worker of test_modeling.py's sharded start-up test (and of `tools/bench.py startup-memory`), run
by torchrun: modeling.build_model on a checkpoint, measured and checked on every rank.

    torchrun --standalone --nproc_per_node 2 tests/startup_two_ranks.py MODEL_DIR OUT_DIR  # or 3

Writes OUT_DIR/rank{r}.json: the growth of this process's peak resident memory during build_model
(Linux VmHWM, reset just before the call), the fp32 size of the model, whether every local shard
equals the checkpoint's rows (read back with the safetensors library, an independent reader), and
the largest difference between the sharded model's logits and those of the same checkpoint loaded
whole by transformers.
"""

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
# imported before the measurement: the classes cost the same whatever the model's size
import transformers.models.llama.modeling_llama  # noqa: E402,F401
import transformers.models.qwen2.modeling_qwen2  # noqa: E402,F401

import config  # noqa: E402
import modeling  # noqa: E402
import runs  # noqa: E402


def status_kib(field):
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def main(model_dir, out_dir):
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    dist.init_process_group("gloo")
    rank, world, device = dist.get_rank(), dist.get_world_size(), torch.device("cpu")
    cfg = config.load(overrides=["data.train_files=[unused.jsonl]", f"model.path={model_dir}",
                                 "model.param_dtype=float32"])
    dist.barrier()
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := the current resident size
    before = status_kib("VmRSS")
    model = modeling.build_model(cfg, device, world)
    growth = (status_kib("VmHWM") - before) * 1024
    parameters = dict(model.named_parameters())
    fp32_bytes = 4 * sum(p.numel() for p in parameters.values())

    mismatched = []
    for file in Path(model_dir).glob("*.safetensors"):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                if name not in parameters:
                    continue
                start, end = modeling.shard_rows(parameters[name])
                expected = f.get_slice(name)[start:end].to(torch.float32)
                if not torch.equal(parameters[name].to_local(), expected):
                    mismatched.append(name)
    tied = model.get_output_embeddings().weight is model.get_input_embeddings().weight

    ids = torch.randint(
        0, model.config.vocab_size, (1, 24), generator=torch.Generator().manual_seed(0))
    model.eval()
    with torch.no_grad():
        sharded_logits = model(input_ids=ids, use_cache=False).logits
    reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        reference_logits = reference(input_ids=ids, use_cache=False).logits
    result = {"rank": rank, "world": world, "growth_bytes": growth, "fp32_bytes": fp32_bytes,
              "growth_over_fp32": growth / fp32_bytes, "mismatched": mismatched, "tied": tied,
              "shard_rows": {name: modeling.shard_rows(p) for name, p in parameters.items()
                             if name.endswith(("embed_tokens.weight", "model.norm.weight"))},
              "logits_max_abs_diff": float((sharded_logits - reference_logits).abs().max())}
    (Path(out_dir) / f"rank{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main(sys.argv[1], sys.argv[2])
    runs.exit_process(0)
