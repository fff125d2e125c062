"""modeling.py: the policy model as the trainer uses it: sharded with FSDP2 from the start
(`build_model`: no rank ever holds the whole model), and run on padding-free micro-batches of
(prompt, response) rows with the LM head only at response positions.

    model = modeling.build_model(cfg, device, world_size)
    for idx in modeling.micro_batches(lengths, token_budget):  # lengths: prompt + response tokens
        packed = modeling.pack_rows([prompts[i] for i in idx], [responses[i] for i in idx], device)
        logits = modeling.response_logits(model, packed)  # [N, V], N = the rows' response tokens
        logprobs = packed.to_rows(stare.token_logprobs_and_entropy(logits, packed.response_ids)[0])

Packing: the rows of a micro-batch are concatenated into one [1, L] sequence (L = the sum of their
lengths, no padding token anywhere), RoPE position ids restart at 0 at each row, and attention is
confined to each row by the row boundaries `cu_seq_lens` ([b + 1] cumulative lengths), which reach
the attention function through the model's keyword arguments. The head runs only at the N positions
that predict a response token (`logits_to_keep` given as an index tensor), so the model returns [1,
N, V] directly. Per-token values come out flat ([N], row after row); `Packed.to_rows` lays them out
as the [b, R] zero-padded rows that the losses of stare.py and baselines.py take.

Attention ("varlen", registered with transformers' AttentionInterface, the default of
model.attn_implementation):
  * CUDA, bf16/fp16: PyTorch's `torch.nn.attention.varlen.varlen_attn` (FlashAttention over
    cu_seq_lens, causal): no mask tensor, no query that attends to nothing, no work across rows.
  * otherwise (CPU, float32, PyTorch without varlen_attn): one causal SDPA call per row, exact by
    construction. transformers' own sdpa path would detect packing from the position ids and build
    an [L, L] block mask; the per-row loop needs no mask and costs nothing on the tiny CPU model.
  * a call without cu_seq_lens (one unpadded sequence, as in rollout.trainer_logprobs) is plain
    causal SDPA.
No mask function is registered, so transformers builds no mask (its packing detection would cost a
host-device sync per forward) and drops a padding `attention_mask`: under "varlen", pass packed or
unpadded rows only. "sdpa", "eager" or "flash_attention_2" keep packed rows exact too (they detect
packing from the restarting position ids or read cu_seq_lens), only slower.
"""

import contextlib
import dataclasses
import inspect
import json
import math
import struct
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

import runs

try:
    from torch.nn.attention.varlen import varlen_attn
except ImportError:  # PyTorch < 2.11
    varlen_attn = None
VARLEN_GQA = varlen_attn is not None and "enable_gqa" in inspect.signature(varlen_attn).parameters

ATTENTION = "varlen"


def _varlen_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                      sliding_window=None, cu_seq_lens_q=None, cu_seq_lens_k=None,
                      max_length_q=None, max_length_k=None, **kwargs):
    """transformers attention function. query [1, H, L, D], key/value [1, H_kv, L, D] -> ([1, L, H,
    D], None). Grouped-query attention runs natively (enable_gqa): the H_kv key/value heads are
    never repeated H / H_kv times in memory."""
    if cu_seq_lens_q is None:  # one unpadded sequence: plain causal SDPA
        return sdpa_attention_forward(
            module, query, key, value, None, dropout=dropout, scaling=scaling, **kwargs)
    if sliding_window is not None or dropout:
        raise NotImplementedError(
            "packed attention supports neither sliding windows nor attention dropout")
    gqa = key.shape[1] != query.shape[1]
    if use_flash_varlen(query):
        if gqa and not VARLEN_GQA:  # an older varlen wrapper takes equal head counts only
            groups = query.shape[1] // key.shape[1]
            key, value = (t.repeat_interleave(groups, dim=1) for t in (key, value))
        q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))  # [L, H, D], [L, H_kv, D]
        out = varlen_attn(
            q, k, v, cu_seq_lens_q, cu_seq_lens_k, max_length_q, max_length_k, scale=scaling,
            window_size=(-1, 0), **({"enable_gqa": True} if gqa and VARLEN_GQA else {}))
        return out[None], None  # [1, L, H, D], causal within each row
    bounds = cu_seq_lens_q.tolist()
    rows = [torch.nn.functional.scaled_dot_product_attention(  # each [1, H, len, D]
        query[:, :, s:e], key[:, :, s:e], value[:, :, s:e], is_causal=True, scale=scaling,
        enable_gqa=gqa) for s, e in zip(bounds[:-1], bounds[1:])]
    return torch.cat(rows, dim=2).transpose(1, 2), None


def use_flash_varlen(query):
    """PyTorch's FlashAttention varlen kernel: CUDA, half precision, a PyTorch that has it."""
    return query.is_cuda and varlen_attn is not None and query.dtype in (torch.bfloat16,
                                                                          torch.float16)


AttentionInterface.register(ATTENTION, _varlen_attention)


def build_model(cfg, device, world_size):
    """The HF model sharded with FSDP2 from the start, in float32 (parameters cast to
    model.param_dtype for compute, gradients reduced in model.reduce_dtype). No rank ever holds the
    whole model: the model is built with its parameters on the meta device, sharded per decoder
    layer and at the root, and each rank then reads only its own rows of every weight from the
    checkpoint into its shard (`load_shards`)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    hf_config = AutoConfig.from_pretrained(cfg.model.path)
    with parameters_on_meta():
        model = AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32,
                                                 attn_implementation=cfg.model.attn_implementation)
    # rotary frequencies: not on disk
    buffers = {name: buffer.clone() for name, buffer in model.named_buffers()}
    model = shard_model(model, cfg, device, world_size)
    model.to_empty(device=device)  # allocates this rank's shards only
    with torch.no_grad():
        for name, value in buffers.items():
            model.get_buffer(name).copy_(value)
    load_shards(model, cfg.model.path)
    return model


@contextlib.contextmanager
def parameters_on_meta():
    """Every parameter created inside lives on the meta device (no memory, and initialising it costs
    nothing); buffers stay real, so the rotary frequencies that no checkpoint holds are computed as
    usual."""
    register = torch.nn.Module.register_parameter

    def register_on_meta(module, name, param):
        # an already-meta parameter may be a tied alias
        if param is not None and param.device.type != "meta":
            param = torch.nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        register(module, name, param)

    torch.nn.Module.register_parameter = register_on_meta
    try:
        yield
    finally:
        torch.nn.Module.register_parameter = register


def load_shards(model, path):
    """Fill every parameter's local FSDP2 shard (rows start:end of dim 0 on this rank, torch.chunk's
    split) and every persistent buffer from the checkpoint at `path`, reading only those rows. Tied
    parameters are one tensor, filled once. Raises ValueError naming the weights the checkpoint
    lacks."""
    tensors = checkpoint_index(path)
    names = dict(model.named_parameters())  # tied aliases appear once, under their first name
    for name, buffer in model.named_buffers():  # the persistent ones: the rest are not on disk
        module_name, _, buffer_name = name.rpartition(".")
        if buffer_name not in model.get_submodule(module_name)._non_persistent_buffers_set:
            names[name] = buffer
    missing = [name for name in names if name not in tensors]
    if missing:
        raise ValueError(f"{path}: the checkpoint has no weights for {', '.join(missing[:5])}"
                         + (f" and {len(missing) - 5} more" if len(missing) > 5 else ""))
    with torch.no_grad():
        for name, target in names.items():
            if tuple(target.shape) != tensors[name].shape:
                raise ValueError(
                    f"{path}: {name} has shape {tensors[name].shape} in the checkpoint but "
                    f"{tuple(target.shape)} in the model of its config.json")
            local = target.to_local() if hasattr(target, "to_local") else target
            start, end = shard_rows(target)
            if start == end:  # fewer rows than ranks (or ceil's split): this rank holds none
                continue
            tensors[name].copy_rows(
                local.view(end - start, -1) if local.dim() else local.view(1, 1), start, end)


def shard_rows(tensor):
    """(start, end): the rows of dim 0 this rank holds of a DTensor sharded on dim 0 (FSDP2's
    torch.chunk split: ceil(rows / world) each, the last ranks fewer or none); all rows of a plain
    tensor."""
    if not hasattr(tensor, "device_mesh") or tensor.dim() == 0:
        return 0, (tensor.shape[0] if tensor.dim() else 1)
    mesh, rows = tensor.device_mesh, tensor.shape[0]
    chunk = -(-rows // mesh.size())
    start = min(rows, mesh.get_local_rank() * chunk)
    return start, min(rows, start + chunk)


SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U8": torch.uint8, "BOOL": torch.bool}


@dataclasses.dataclass
class StoredTensor:
    """One tensor of a checkpoint file, read a row range at a time (nothing mapped or read else)."""

    file: Path
    dtype: torch.dtype
    shape: tuple
    # byte offset of the tensor's data in a .safetensors file; None for a torch.load'ed tensor
    offset: int
    tensor: torch.Tensor | None = None  # a .bin checkpoint's tensor (memory-mapped by torch.load)

    def copy_rows(self, out, start, end, block_bytes=2**22):
        """out[:] = rows start:end, read and converted (to out's dtype and device) a block of at
        most block_bytes at a time, so the transient copy stays small whatever the tensor's size.
        out: [end - start, ...]."""
        row_bytes = max(1, math.prod(self.shape[1:]) * self.dtype.itemsize)
        step = max(1, block_bytes // row_bytes)
        for first in range(start, end, step):
            last = min(end, first + step)
            out[first - start:last - start].copy_(self.rows(first, last).view(last - first, -1))

    def rows(self, start, end):
        """Rows start:end of dim 0 (0-dim: one row) -> a new CPU tensor [end - start, ...]."""
        if self.tensor is not None:
            return self.tensor.reshape(-1, *self.shape[1:])[start:end].clone()
        row_numel = math.prod(self.shape[1:])
        out = torch.empty((end - start) * row_numel, dtype=self.dtype)
        buffer = out.view(torch.uint8).numpy()
        with open(self.file, "rb") as f:
            f.seek(self.offset + start * row_numel * out.element_size())
            if f.readinto(buffer) != len(buffer):
                raise ValueError(
                    f"{self.file}: truncated (a tensor's data runs past the end of the file)")
        return out.view(end - start, *self.shape[1:])


def checkpoint_index(path):
    """name -> StoredTensor for every tensor of the HF checkpoint at `path` (*.safetensors: the
    header is read, the data is not; pytorch_model*.bin: torch.load with mmap, so only the rows
    taken are read)."""
    path, tensors = Path(path), {}
    files = sorted(path.glob("*.safetensors"))
    for file in files:
        with open(file, "rb") as f:
            (header_size,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(header_size))
        for name, entry in header.items():
            if name == "__metadata__":
                continue
            if entry["dtype"] not in SAFETENSORS_DTYPES:
                raise ValueError(f"{file}: tensor {name} has dtype {entry['dtype']}, which this "
                                 f"loader does not read")
            tensors[name] = StoredTensor(
                file, SAFETENSORS_DTYPES[entry["dtype"]], tuple(entry["shape"]),
                8 + header_size + entry["data_offsets"][0])
    if not files:
        for file in sorted(path.glob("pytorch_model*.bin")):
            for name, tensor in torch.load(
                file, mmap=True, weights_only=True, map_location="cpu").items():
                tensors[name] = StoredTensor(file, tensor.dtype, tuple(tensor.shape), None, tensor)
    if not tensors:
        raise ValueError(f"{path}: no *.safetensors or pytorch_model*.bin weights")
    return tensors


def shard_model(model, cfg, device, world_size):
    """Gradient checkpointing (if configured) and FSDP2 on an HF causal LM (on device or meta)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    model.config.use_cache = False
    if cfg.model.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    mesh = init_device_mesh(device.type, (world_size,))
    policy = MixedPrecisionPolicy(param_dtype=getattr(torch, cfg.model.param_dtype),
                                  reduce_dtype=getattr(torch, cfg.model.reduce_dtype))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    return model


def reshard_root(model):
    """Free FSDP2's gathered root unit (embedding, final norm, LM head) after a forward without
    backward: the root unit reshards only after a backward (torch
    distributed/fsdp/_fully_shard/_fsdp_state.py, lazy_init), so a no-grad forward leaves it whole
    on the device. Call it before the engine takes the memory back; a model without FSDP2 is left
    as it is."""
    from torch.distributed.fsdp import FSDPModule

    if isinstance(model, FSDPModule):
        model.reshard()


def micro_batches(lengths, token_budget):
    """Row indices grouped so that each group's tokens, summed over its rows, stay within
    token_budget (longest rows first; a row longer than the budget goes alone). lengths: prompt +
    response tokens per row."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    batches, current, tokens = [], [], 0
    for i in order:
        if current and tokens + lengths[i] > token_budget:
            batches.append(current)
            current, tokens = [], 0
        current.append(i)
        tokens += lengths[i]
    return batches + ([current] if current else [])


@dataclasses.dataclass
class Packed:
    """One micro-batch of rows packed into one sequence. L = prompt + response tokens over all rows,
    N = response tokens over all rows, b rows, R the longest response (at least 1)."""

    model_inputs: dict  # keyword arguments of the model's forward
    response_ids: torch.Tensor  # [N] long: the response tokens, row after row
    mask: torch.Tensor  # [b, R] bool: True where a row has a response token
    num_tokens: int  # L: tokens the model runs on (all real: no padding)

    def to_rows(self, values):
        """[N, ...] per-token values -> [b, R, ...], zero where a row has no token."""
        out = values.new_zeros(self.mask.shape + values.shape[1:])
        out[self.mask] = values
        return out


def pack_rows(prompts, responses, device):
    """Rows concatenated into one sequence: row i holds its prompt then its response, its position
    ids restart at 0, and the logits at the position before each response token predict it. prompts
    (each at least one token), responses (possibly empty): lists of token-id lists."""
    if not prompts or len(prompts) != len(responses) or min(len(p) for p in prompts) < 1:
        raise ValueError(
            "pack_rows needs as many responses as prompts, and a non-empty prompt in every row")
    lengths = [len(p) + len(r) for p, r in zip(prompts, responses)]
    cu_seq_lens = torch.tensor([0] + lengths).cumsum(0)  # [b + 1]
    input_ids = torch.tensor(
        [t for p, r in zip(prompts, responses) for t in list(p) + list(r)], dtype=torch.long)
    position_ids = torch.cat([torch.arange(n) for n in lengths])  # [L]
    keep = torch.cat([torch.arange(start + len(p) - 1, start + len(p) - 1 + len(r))
                      for start, p, r in zip(cu_seq_lens[:-1].tolist(), prompts, responses)])  # [N]
    widths = [len(r) for r in responses]
    mask = torch.arange(max(1, *widths))[None, :] < torch.tensor(widths)[:, None]  # [b, R]
    cu_seq_lens = cu_seq_lens.to(device=device, dtype=torch.int32)
    model_inputs = {
        "input_ids": input_ids[None].to(device), "position_ids": position_ids[None].to(device),
        "logits_to_keep": keep.to(device), "cu_seq_lens_q": cu_seq_lens,
        "cu_seq_lens_k": cu_seq_lens, "max_length_q": max(lengths), "max_length_k": max(lengths)}
    return Packed(model_inputs, response_ids=input_ids[keep + 1].to(device), mask=mask.to(device),
                  num_tokens=sum(lengths))


def response_logits(model, packed):
    """Logits at the response positions only, [N, V]: the LM head never runs over the prompt."""
    return model(**packed.model_inputs, use_cache=False).logits[0]  # [1, N, V] -> [N, V]


# --------------------------------------------------------------------------------------------------
# Micro-batches and float16 loss scaling of the update
# --------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class LossScaler:
    """Dynamic loss scaling for float16 compute (model.param_dtype: float16). The gradients of a
    token-mean loss over ~1M tokens are ~1e-6 per token, under float16's normal range: the loss is
    multiplied by `scale` before backward, the (float32, sharded) gradients are divided by it before
    clipping, a step whose gradients are not finite is skipped and halves the scale, and `window`
    finite steps in a row double it. A non-finite loss (the forward overflowed) is skipped without
    touching the scale, which cannot fix it (grpo.policy_update)."""

    scale: float = 65536.0
    window: int = 1000
    good_steps: int = 0

    def unscale(self, model):
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        torch._foreach_mul_(
            [g.to_local() if hasattr(g, "to_local") else g for g in grads], 1.0 / self.scale)

    def update(self, finite):
        self.good_steps = self.good_steps + 1 if finite else 0
        if not finite:
            self.scale = max(self.scale / 2, 1.0)
        elif self.good_steps >= self.window:
            self.scale, self.good_steps = self.scale * 2, 0

    def after_step(self, finite_loss, finite_grad):
        """The scale after a mini-batch's step -> whether a skip was the scale's to fix: a gradient
        overflow under a scale > 1 (a non-finite loss is not, whatever the scale; see above)."""
        overflow = finite_loss and self.scale > 1
        if finite_loss:
            self.update(finite_grad)
        return overflow


def equal_count_micro_batches(responses, token_budget, device):
    """micro_batches, padded with empty batches to the largest count over ranks: FSDP2's
    forward and backward are collectives, so every rank must run the same number of them (a mismatch
    hangs)."""
    batches = micro_batches([len(r.prompt) + len(r.tokens) for r in responses], token_budget)
    count = runs.all_reduce({"count": len(batches)}, device, op=dist.ReduceOp.MAX)["count"]
    return batches + [[]] * (int(count) - len(batches))


def pad_rows(values):
    """Per-row 1-D tensors -> [len(values), longest (at least 1)], right-padded with 0 (False)."""
    out = values[0].new_zeros((len(values), max(1, max(len(v) for v in values))))
    for i, row in enumerate(values):
        out[i, :len(row)] = row
    return out
