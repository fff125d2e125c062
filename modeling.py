"""modeling.py: the policy model as the trainer uses it: built and sharded with FSDP2, and run on padding-free
micro-batches of (prompt, response) rows with the LM head only at response positions.

    model = modeling.build_model(cfg, device, world_size)
    for indices in modeling.micro_batches(lengths, token_budget):          # lengths: prompt + response tokens per row
        packed = modeling.pack_rows([prompts[i] for i in indices], [responses[i] for i in indices], device)
        logits = modeling.response_logits(model, packed)                    # [N, V], N = response tokens of the batch
        logprobs_bt = packed.to_rows(stare.token_logprobs_and_entropy(logits, packed.response_ids)[0])   # [b, R]

Packing: the rows of a micro-batch are concatenated into one [1, L] sequence (L = the sum of their lengths, no
padding token anywhere), RoPE position ids restart at 0 at each row, and attention is confined to each row by the
row boundaries `cu_seq_lens` ([b + 1] cumulative lengths), which reach the attention function through the model's
keyword arguments. The head runs only at the N positions that predict a response token (`logits_to_keep` given as
an index tensor), so the model returns [1, N, V] directly.

Attention ("varlen", registered with transformers' AttentionInterface and the default of model.attn_implementation):
  * CUDA, bf16/fp16: PyTorch's `torch.nn.attention.varlen.varlen_attn` (FlashAttention over cu_seq_lens, causal):
    no mask tensor, no query that attends to nothing, no work across rows. KV heads are repeated for GQA because
    the varlen wrapper of older PyTorch releases takes equal head counts only.
  * otherwise (CPU, float32, PyTorch without varlen_attn): one causal SDPA call per row, exact by construction.
    transformers' own sdpa path would detect packing from the position ids and build an [L, L] block mask; the
    per-row loop needs no mask and costs nothing on the tiny CPU model.
  * a call without cu_seq_lens (one unpadded sequence, as in rollout.trainer_logprobs) is plain causal SDPA.
No mask function is registered, so transformers builds no mask (its packing detection would cost a host-device
sync per forward) and drops a padding `attention_mask`: under "varlen", pass packed or unpadded rows only.
model.attn_implementation may still name "sdpa", "eager" or "flash_attention_2": packed rows stay exact under each
(they detect packing from the restarting position ids or read cu_seq_lens), only slower.

Per-token values come out flat ([N], one per response token, row after row) and `Packed.to_rows` lays them out as
the [b, R] zero-padded rows that the loss functions of stare.py and baselines.py take, with `Packed.mask` marking
the real tokens.
"""

import dataclasses

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

try:
    from torch.nn.attention.varlen import varlen_attn
except ImportError:  # PyTorch < 2.11
    varlen_attn = None

ATTENTION = "varlen"


def _varlen_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, sliding_window=None,
                      cu_seq_lens_q=None, cu_seq_lens_k=None, max_length_q=None, max_length_k=None, **kwargs):
    """transformers attention function. query [1, H, L, D], key/value [1, H_kv, L, D] -> ([1, L, H, D], None)."""
    if cu_seq_lens_q is None:  # one unpadded sequence: plain causal SDPA
        return sdpa_attention_forward(module, query, key, value, None, dropout=dropout, scaling=scaling, **kwargs)
    if sliding_window is not None or dropout:
        raise NotImplementedError("packed attention supports neither sliding windows nor attention dropout")
    groups = query.shape[1] // key.shape[1]
    if groups > 1:
        key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)  # [1, H, L, D]
    if query.is_cuda and varlen_attn is not None and query.dtype in (torch.bfloat16, torch.float16):
        q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))  # [L, H, D]
        out = varlen_attn(q, k, v, cu_seq_lens_q, cu_seq_lens_k, max_length_q, max_length_k, scale=scaling,
                          window_size=(-1, 0))  # [L, H, D], causal within each row
        return out[None], None
    bounds = cu_seq_lens_q.tolist()
    rows = [torch.nn.functional.scaled_dot_product_attention(query[:, :, s:e], key[:, :, s:e], value[:, :, s:e],
                                                             is_causal=True, scale=scaling)
            for s, e in zip(bounds[:-1], bounds[1:])]  # each [1, H, len, D]
    return torch.cat(rows, dim=2).transpose(1, 2), None


AttentionInterface.register(ATTENTION, _varlen_attention)


def build_model(cfg, device, world_size):
    """The HF model in float32, sharded with FSDP2 per decoder layer and then at the root (parameters cast to
    model.param_dtype for compute, gradients reduced in model.reduce_dtype)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(cfg.model.path, dtype=torch.float32,
                                                 attn_implementation=cfg.model.attn_implementation).to(device)
    return shard_model(model, cfg, device, world_size)


def shard_model(model, cfg, device, world_size):
    """Gradient checkpointing (if configured) and FSDP2 on an HF causal LM already on `device`."""
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


def micro_batches(lengths, token_budget):
    """Row indices grouped so that each group's tokens, summed over its rows, stay within token_budget (longest rows
    first; a row longer than the budget goes alone). lengths: prompt + response tokens per row."""
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
    """One micro-batch of rows packed into one sequence. L = prompt + response tokens over all rows, N = response
    tokens over all rows, b rows, R the longest response (at least 1)."""

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
    """Rows concatenated into one sequence: row i holds its prompt then its response, its position ids restart at 0,
    and the logits at the position before each response token predict it. prompts (each at least one token),
    responses (possibly empty): lists of token-id lists."""
    if not prompts or len(prompts) != len(responses) or min(len(p) for p in prompts) < 1:
        raise ValueError("pack_rows needs as many responses as prompts, and a non-empty prompt in every row")
    lengths = [len(p) + len(r) for p, r in zip(prompts, responses)]
    cu_seq_lens = torch.tensor([0] + lengths).cumsum(0)  # [b + 1]
    input_ids = torch.tensor([t for p, r in zip(prompts, responses) for t in list(p) + list(r)], dtype=torch.long)
    position_ids = torch.cat([torch.arange(n) for n in lengths])  # [L]
    keep = torch.cat([torch.arange(start + len(p) - 1, start + len(p) - 1 + len(r))
                      for start, p, r in zip(cu_seq_lens[:-1].tolist(), prompts, responses)])  # [N]
    response_width = max(1, max(len(r) for r in responses))
    mask = torch.arange(response_width)[None, :] < torch.tensor([len(r) for r in responses])[:, None]  # [b, R]
    cu_seq_lens = cu_seq_lens.to(device=device, dtype=torch.int32)
    return Packed(model_inputs={"input_ids": input_ids[None].to(device), "position_ids": position_ids[None].to(device),
                                "logits_to_keep": keep.to(device),
                                "cu_seq_lens_q": cu_seq_lens, "cu_seq_lens_k": cu_seq_lens,
                                "max_length_q": max(lengths), "max_length_k": max(lengths)},
                  response_ids=input_ids[keep + 1].to(device), mask=mask.to(device), num_tokens=sum(lengths))


def response_logits(model, packed):
    """Logits at the response positions only, [N, V]: the LM head never runs over the prompt."""
    return model(**packed.model_inputs, use_cache=False).logits[0]  # [1, N, V] -> [N, V]
