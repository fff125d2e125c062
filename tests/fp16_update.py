"""Worker of test_train.py's float16 test, one gloo process: grpo.policy_update on the tiny model
under FSDP2 with float32, float16 and float16 + loss-scaled compute, on a batch whose gradients are
as small as a paper-scale token mean's (~1e-7 per parameter entry); then checkpoints.export_hf of a
float16 model.

    python tests/fp16_update.py TINY_MODEL_DIR OUT_JSON
"""

import json
import socket
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import baselines  # noqa: E402
import checkpoints  # noqa: E402
import config  # noqa: E402
import grpo  # noqa: E402
import modeling  # noqa: E402

DEVICE = torch.device("cpu")
ADVANTAGE_SCALE = 1e-5  # a token mean over ~10^7 tokens instead of this batch's few hundred


def responses(cfg):
    generator = torch.Generator().manual_seed(0)
    rows = []
    for _ in range(3):  # 3 prompts x 4 responses, random tokens, binary rewards
        prompt = torch.randint(3, 300, (int(torch.randint(4, 12, (1,), generator=generator)),),
                               generator=generator).tolist()
        for _ in range(4):
            length = int(torch.randint(8, 24, (1,), generator=generator))
            reward = float(torch.randint(0, 2, (1,), generator=generator))
            rows.append(
                grpo.Response(
                    prompt=prompt,
                    tokens=torch.randint(3, 300, (length,), generator=generator).tolist(),
                    rollout_logprobs=[0.0] * length, reward=reward, accuracy=reward,
                    truncated=False, reflection=(0, 0),
                    policy_mask=torch.ones(length, dtype=torch.bool)))
    groups = [grpo.Group(rows[i].prompt, rows[i:i + 4]) for i in range(0, 12, 4)]
    out = grpo.group_responses(groups, cfg, 0, 1)
    for r in out:
        r.advantage *= ADVANTAGE_SCALE
    return out


def full(parameter):  # the whole float32 parameter (FSDP2 reshards after the backward)
    return parameter.full_tensor() if hasattr(parameter, "full_tensor") else parameter


REAL_POLICY_LOSS = baselines.policy_loss


def nan_policy_loss(*args, **kwargs):
    loss, metrics = REAL_POLICY_LOSS(*args, **kwargs)
    return loss * float("nan"), metrics


def update(model_dir, param_dtype, scaler, nan_loss=False):
    """The parameter change of one SGD(lr=1) step (minus the unscaled gradient) and the update's
    metrics; nan_loss: the loss is NaN, as a forward overflow makes it."""
    cfg = config.load(
        "configs/tiny.yaml",
        [
            f"model.path={model_dir}", f"model.param_dtype={param_dtype}", "algorithm.method=grpo",
            "optim.grad_clip=0", "rollout.n=4", "train.train_batch_size=3",
            "train.mini_batch_size=3"])
    model = modeling.build_model(cfg, DEVICE, 1)
    # the float32 shards, before any forward
    before = [full(p).detach().clone() for p in model.parameters()]
    rows = responses(cfg)
    grpo.old_policy_pass(model, rows, cfg, DEVICE)
    states = baselines.method_states(cfg)
    grpo.update_states(states, rows, DEVICE)
    baselines.policy_loss = nan_policy_loss if nan_loss else REAL_POLICY_LOSS
    try:
        metrics = grpo.policy_update(
            model, torch.optim.SGD(model.parameters(), lr=1.0), rows, cfg, states, 1, DEVICE, scaler)
    finally:
        baselines.policy_loss = REAL_POLICY_LOSS
    change = torch.cat(
        [(b - full(p).detach()).flatten() for b, p in zip(before, model.parameters())])
    return change, metrics


def export(model_dir, out_dir):
    """checkpoints.export_hf of the float16 model: the dtypes its gathers moved, and what it wrote
    against the model's own shards."""
    from safetensors.torch import load_file
    from torch.distributed.tensor import DTensor
    from transformers import AutoTokenizer

    cfg = config.load("configs/tiny.yaml", [f"model.path={model_dir}", "model.param_dtype=float16"])
    model = modeling.build_model(cfg, DEVICE, 1)
    gathered, full_tensor = set(), DTensor.full_tensor
    DTensor.full_tensor = lambda self, *a, **k: gathered.add(str(self.dtype)) or full_tensor(
        self, *a, **k)
    try:
        checkpoints.export_hf(model, cfg, AutoTokenizer.from_pretrained(model_dir), out_dir, 0)
    finally:
        DTensor.full_tensor = full_tensor
    written = load_file(Path(out_dir) / "model.safetensors")
    return {"export_gathered": sorted(gathered),
            "export_dtypes": sorted({str(t.dtype) for t in written.values()}),
            "export_exact": all(torch.equal(written[name], full(p).detach().half())
                                for name, p in model.named_parameters())}


def main(model_dir, out_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    reference, _ = update(model_dir, "float32", None)
    plain, _ = update(model_dir, "float16", None)
    scaler = modeling.LossScaler(scale=2.0**16, window=1000)
    scaled, scaled_metrics = update(model_dir, "float16", scaler)
    overflowing = modeling.LossScaler(scale=2.0**60, window=1000)
    overflow_change, overflow_metrics = update(model_dir, "float16", overflowing)
    nan_scaler = modeling.LossScaler(scale=2.0**16, window=1000)
    _, nan_metrics = update(model_dir, "float16", nan_scaler, nan_loss=True)
    nonzero = reference != 0

    def summary(change):
        return {"underflowed": int((nonzero & (change == 0)).sum()),
                "relative_error": float((change - reference).norm() / reference.norm())}

    result = {"entries": int(nonzero.sum()), "reference_max_abs": float(reference.abs().max()),
              "plain": summary(plain), "scaled": summary(scaled),
              "scaled_loss_scale": scaled_metrics["train/loss_scale"], "scale_after": scaler.scale,
              "good_steps_after": scaler.good_steps,
              "overflow_skipped": overflow_metrics["train/skipped_updates"], "overflow_scale_after":
              overflowing.scale, "overflow_changed": bool((overflow_change != 0).any()),
              "overflow_nonfinite": overflow_metrics["train/nonfinite_updates"],
              "nan_skipped": nan_metrics["train/skipped_updates"],
              "nan_nonfinite": nan_metrics["train/nonfinite_updates"],
              "nan_scale_after": nan_scaler.scale,
              **export(model_dir, Path(out_path).parent / "export")}
    Path(out_path).write_text(json.dumps(result))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
