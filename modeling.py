"""modeling.py: the policy model as the trainer uses it: built and sharded with FSDP2, and run on micro-batches of
(prompt, response) rows with the LM head only at response positions.

    model = modeling.build_model(cfg, device, world_size)
    for indices in modeling.micro_batches(lengths, token_budget):          # lengths: prompt + response tokens per row
        packed = modeling.pack_rows([prompts[i] for i in indices], [responses[i] for i in indices], device)
        logits = modeling.response_logits(model, packed)                    # [N, V], N = response tokens of the batch
        logprobs_bt = packed.to_rows(stare.token_logprobs_and_entropy(logits, packed.response_ids)[0])   # [b, R]

Per-token values come out flat ([N], one per response token, row after row) and `Packed.to_rows` lays them out as
the [b, R] zero-padded rows that the loss functions of stare.py and baselines.py take, with `Packed.mask` marking
the real tokens.
"""

import dataclasses

import torch


def build_model(cfg, device, world_size):
    """The HF model in float32, sharded with FSDP2 per decoder layer and then at the root (parameters cast to
    model.param_dtype for compute, gradients reduced in model.reduce_dtype)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(cfg.model.path, dtype=torch.float32,
                                                 attn_implementation=cfg.model.attn_implementation).to(device)
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
    """One micro-batch of rows ready for the model. N = response tokens over all rows, b rows, R the longest
    response (at least 1)."""

    model_inputs: dict  # keyword arguments of the model's forward
    response_ids: torch.Tensor  # [N] long: the response tokens, row after row
    mask: torch.Tensor  # [b, R] bool: True where a row has a response token
    gather_index: torch.Tensor  # [N] long: where each response token's logits sit in the model's output

    def to_rows(self, values):
        """[N, ...] per-token values -> [b, R, ...], zero where a row has no token."""
        out = values.new_zeros(self.mask.shape + values.shape[1:])
        out[self.mask] = values
        return out


def pack_rows(prompts, responses, device):
    """Prompts left-padded to a common width P and responses right-padded to R, so that every row's response starts
    at column P and the logits of positions P-1 ... P+R-2 predict it. prompts, responses: lists of token-id lists."""
    prompt_width = max(len(p) for p in prompts)
    response_width = max(1, max(len(r) for r in responses))
    input_ids = torch.zeros((len(prompts), prompt_width + response_width), dtype=torch.long)
    attention = torch.zeros_like(input_ids)
    for i, (prompt, response) in enumerate(zip(prompts, responses)):
        start = prompt_width - len(prompt)
        input_ids[i, start:prompt_width + len(response)] = torch.tensor(prompt + list(response), dtype=torch.long)
        attention[i, start:prompt_width + len(response)] = 1
    position_ids = (attention.cumsum(-1) - 1).clamp(min=0)  # RoPE positions restart at each prompt's first token
    mask = torch.arange(response_width)[None, :] < torch.tensor([len(r) for r in responses])[:, None]  # [b, R]
    keep = torch.arange(prompt_width - 1, prompt_width + response_width - 1)  # [R] positions that predict responses
    flat_index = (torch.arange(len(prompts))[:, None] * response_width + torch.arange(response_width))[mask]  # [N]
    return Packed(model_inputs={"input_ids": input_ids.to(device), "attention_mask": attention.to(device),
                                "position_ids": position_ids.to(device), "logits_to_keep": keep.to(device)},
                  response_ids=input_ids[:, prompt_width:][mask].to(device), mask=mask.to(device),
                  gather_index=flat_index.to(device))


def response_logits(model, packed):
    """Logits at the response positions only, [N, V]: the LM head never runs over the prompt."""
    logits = model(**packed.model_inputs, use_cache=False).logits  # [b, R, V]
    return logits.flatten(0, 1)[packed.gather_index]
