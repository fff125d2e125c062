"""modeling.py: packed rows give every row exactly what the row gives alone (values and gradients),
micro-batches cover every row once within the token budget, and the sharded start-up gives each rank
exactly its rows of the checkpoint without ever holding the whole model."""

import json
import os
import random
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

import forked
import modeling
import stare


def small_model(attn_implementation, seed=0):
    """A random Qwen2 with grouped-query attention (4 query heads, 2 KV heads), in float64."""
    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
        tie_word_embeddings=False, attn_implementation=attn_implementation)
    return Qwen2ForCausalLM(config).to(torch.float64)


def random_rows(lengths, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return ([torch.randint(1, 97, (p,), generator=generator).tolist() for p, _ in lengths],
            [torch.randint(1, 97, (r,), generator=generator).tolist() for _, r in lengths])


def logprobs_and_entropy64(logits, tokens):
    """The plain formula in the logits' own dtype (float64 here): stare.py's float32 would blur the comparison."""
    log_pi = torch.log_softmax(logits, -1)  # [n, V]
    return log_pi.gather(-1, tokens[:, None]).squeeze(-1), -(log_pi.exp() * log_pi).sum(-1)


def per_row_reference(model, prompts, responses, weights_lp, weights_h):
    """Each row alone, unpadded, through the eager attention: response logits, log-probs and
    entropies, and the gradient of sum(weights_lp * logprob + weights_h * entropy) over all rows."""
    model.zero_grad(set_to_none=True)
    all_logits, logprobs, entropies, offset = [], [], [], 0
    for prompt, response in zip(prompts, responses):
        ids = torch.tensor([prompt + response])
        logits = model(input_ids=ids, use_cache=False).logits[0, len(prompt) - 1:-1]  # [r, V]
        logprob, entropy = logprobs_and_entropy64(logits, torch.tensor(response, dtype=torch.long))
        n = len(response)
        (
            (weights_lp[offset : offset + n] * logprob).sum()
            + (weights_h[offset : offset + n] * entropy).sum()
        ).backward()
        all_logits.append(logits.detach())
        logprobs.append(logprob.detach())
        entropies.append(entropy.detach())
        offset += n
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    return torch.cat(all_logits), torch.cat(logprobs), torch.cat(entropies), grads


LENGTH_MIXES = {
    "ragged": [(5, 9), (12, 3), (7, 20), (3, 1)],
    "single": [(6, 11)],
    "one_token_prompts_and_responses": [(1, 1), (1, 1), (1, 1)],
    "long_next_to_short": [(150, 90), (1, 1), (2, 1), (40, 3)],
    "empty_responses": [(4, 0), (6, 5), (3, 0), (2, 7)],
}


@pytest.mark.parametrize("attn_implementation", ["varlen", "sdpa"])
@pytest.mark.parametrize("mix", list(LENGTH_MIXES))
def test_packed_rows_match_each_row_alone(mix, attn_implementation):
    prompts, responses = random_rows(LENGTH_MIXES[mix])
    num_response = sum(len(r) for r in responses)
    generator = torch.Generator().manual_seed(1)
    weights_lp = torch.randn(num_response, generator=generator, dtype=torch.float64)
    weights_h = torch.randn(num_response, generator=generator, dtype=torch.float64)
    reference = small_model("eager")
    want_logits, want_lp, want_h, want_grads = per_row_reference(
        reference, prompts, responses, weights_lp, weights_h)

    model = small_model(attn_implementation)
    packed = modeling.pack_rows(prompts, responses, torch.device("cpu"))
    # no padding token
    assert packed.num_tokens == sum(len(p) + len(r) for p, r in zip(prompts, responses))
    assert packed.model_inputs["input_ids"].shape == (1, packed.num_tokens)
    assert packed.response_ids.tolist() == [t for r in responses for t in r]
    logits = modeling.response_logits(model, packed)
    assert logits.shape == (num_response, 97)
    logprobs, entropy = logprobs_and_entropy64(logits, packed.response_ids)
    ((weights_lp * logprobs).sum() + (weights_h * entropy).sum()).backward()

    # the reference's eager attention softmaxes in float32: agreement to ~1e-7, not to float64's
    # last bits
    torch.testing.assert_close(logits, want_logits, rtol=0, atol=1e-6)
    torch.testing.assert_close(logprobs, want_lp, rtol=0, atol=1e-6)
    torch.testing.assert_close(entropy, want_h, rtol=0, atol=1e-6)
    for name, param in model.named_parameters():
        torch.testing.assert_close(param.grad, want_grads[name], rtol=1e-5, atol=1e-6, msg=name)
    stare_logprobs, stare_entropy = stare.token_logprobs_and_entropy(
        logits.detach(), packed.response_ids)
    torch.testing.assert_close(stare_logprobs, want_lp.float(), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(stare_entropy, want_h.float(), rtol=1e-6, atol=1e-6)


def test_rows_do_not_see_each_other():
    # changing one row's tokens leaves every other row's logits untouched, to the last bit
    prompts, responses = random_rows([(5, 6), (7, 4), (3, 5)])
    model = small_model("varlen").eval()
    with torch.no_grad():
        before = modeling.response_logits(
            model, modeling.pack_rows(prompts, responses, torch.device("cpu")))
        prompts[1] = [t % 96 + 1 for t in prompts[1]]
        after = modeling.response_logits(
            model, modeling.pack_rows(prompts, responses, torch.device("cpu")))
    assert torch.equal(before[:6], after[:6]) and torch.equal(before[10:], after[10:])
    assert not torch.equal(before[6:10], after[6:10])


def test_to_rows_lays_out_flat_values_as_padded_rows():
    prompts, responses = random_rows([(2, 3), (2, 0), (1, 1)])
    packed = modeling.pack_rows(prompts, responses, torch.device("cpu"))
    values = torch.arange(1.0, 5.0)  # [N = 4]
    assert packed.mask.tolist() == [[True, True, True], [False, False, False], [True, False, False]]
    assert packed.to_rows(values).tolist() == [[1, 2, 3], [0, 0, 0], [4, 0, 0]]
    assert packed.to_rows(values[:, None].expand(4, 2)).shape == (3, 3, 2)


def test_pack_rows_rejects_an_empty_prompt():
    with pytest.raises(ValueError, match="non-empty prompt"):
        modeling.pack_rows([[1, 2], []], [[3], [4]], torch.device("cpu"))


def test_a_plain_sequence_without_boundaries_is_causal_attention():
    # what rollout.trainer_logprobs does: one unpadded sequence, no cu_seq_lens
    ids = torch.tensor([random_rows([(9, 8)])[0][0] + random_rows([(9, 8)])[1][0]])
    with torch.no_grad():
        got = small_model("varlen")(input_ids=ids, use_cache=False).logits
        want = small_model("eager")(input_ids=ids, use_cache=False).logits
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)  # eager softmaxes in float32


@pytest.mark.parametrize("budget", [1, 30, 64, 10_000])
def test_micro_batches_cover_every_row_once_within_the_budget(budget):
    rng = random.Random(budget)
    lengths = [rng.randint(1, 80) for _ in range(37)]
    batches = modeling.micro_batches(lengths, budget)
    assert sorted(i for batch in batches for i in batch) == list(range(len(lengths)))
    for batch in batches:
        assert len(batch) == 1 or sum(lengths[i] for i in batch) <= budget
    assert modeling.micro_batches([], budget) == []


# --------------------------------------------------------------------------------------------------
# Sharded start-up (modeling.build_model): two gloo ranks, each measured and checked by
# tests/startup_two_ranks.py
# --------------------------------------------------------------------------------------------------

STARTUP_SHAPE = dict(
    hidden_size=768,
    intermediate_size=2048,
    num_hidden_layers=8,
    num_attention_heads=12,
    # ~0.1B; an odd
    num_key_value_heads=4,
    vocab_size=32_003,
    max_position_embeddings=512)
#                     vocabulary, so the two ranks' shards of the embedding differ in size


@pytest.mark.parametrize("architecture,tied", [("qwen2", False), ("qwen2", True), ("llama", True)])
def test_sharded_start_up_reads_each_rank_its_rows_and_never_the_whole_model(architecture, tied,
                                                                             tmp_path):
    config_class, model_class = {"qwen2": (Qwen2Config, Qwen2ForCausalLM),
                                 "llama": (LlamaConfig, LlamaForCausalLM)}[architecture]
    torch.manual_seed(0)
    model = model_class(config_class(tie_word_embeddings=tied, **STARTUP_SHAPE))
    if architecture == "llama":  # stored in bfloat16, as most released checkpoints are
        model = model.to(torch.bfloat16)
    model.save_pretrained(tmp_path / "model")
    del model
    completed = forked.run(Path(__file__).with_name("startup_two_ranks.py"),
                           [tmp_path / "model", tmp_path], env=dict(os.environ, OMP_NUM_THREADS="1"),
                           nproc=2, timeout=600)
    assert completed.returncode == 0, completed.stdout[-3000:] + completed.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    vocab = STARTUP_SHAPE["vocab_size"]
    assert [r["shard_rows"]["model.embed_tokens.weight"] for r in ranks] == [
        [0, 16_002], [16_002, vocab]]
    for rank in ranks:
        # every local shard equals the checkpoint's rows, in float32
        assert rank["mismatched"] == []
        assert rank["tied"] == tied
        # the sharded model computes what the whole one does
        assert rank["logits_max_abs_diff"] < 1e-4
        # half the model is this rank's shard; the whole model would be 1.0 (1.06-1.08 before the
        # sharded start-up)
        assert rank["growth_over_fp32"] < 0.7, rank


def test_a_rank_without_rows_of_a_weight_starts_and_computes_the_whole_model(tmp_path):
    # hidden size 2 on 3 ranks: every norm and attention weight has 2 rows, so rank 2 holds none
    torch.manual_seed(0)
    Qwen2ForCausalLM(Qwen2Config(hidden_size=2, intermediate_size=4, num_hidden_layers=1,
                                 num_attention_heads=1, num_key_value_heads=1, vocab_size=64,
                                 max_position_embeddings=64)).save_pretrained(tmp_path / "model")
    completed = forked.run(Path(__file__).with_name("startup_two_ranks.py"),
                           [tmp_path / "model", tmp_path], env=dict(os.environ, OMP_NUM_THREADS="1"),
                           nproc=3, timeout=600)
    assert completed.returncode == 0, completed.stdout[-3000:] + completed.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(3)]
    assert [r["shard_rows"]["model.norm.weight"] for r in ranks] == [[0, 1], [1, 2], [2, 2]]
    for rank in ranks:
        assert rank["mismatched"] == [] and rank["logits_max_abs_diff"] < 1e-5


# --------------------------------------------------------------------------------------------------
# Grouped-query attention on packed rows: native (enable_gqa), never the key/value heads repeated in
# memory
# --------------------------------------------------------------------------------------------------


def packed_qkv(lengths=(5, 1, 9), heads=4, kv_heads=2, dim=16, seed=0):
    generator = torch.Generator().manual_seed(seed)
    total = sum(lengths)
    query = torch.randn(1, heads, total, dim, generator=generator, dtype=torch.float64)
    key, value = (
        torch.randn(1, kv_heads, total, dim, generator=generator, dtype=torch.float64)
        for _ in range(2))
    cu_seq_lens = torch.tensor([0, *lengths]).cumsum(0).to(torch.int32)
    return query, key, value, cu_seq_lens, max(lengths)


def repeated_reference(query, key, value, cu_seq_lens, scale):
    """Each row alone, its key/value heads repeated to the query heads: plain causal attention. -> [1, L, H, D]"""
    groups = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    bounds = cu_seq_lens.tolist()
    rows = []
    for s, e in zip(bounds[:-1], bounds[1:]):
        scores = query[0, :, s:e] @ key[0, :, s:e].transpose(-1, -2) * scale  # [H, n, n]
        causal = torch.ones(e - s, e - s, dtype=torch.bool).tril()
        # [H, n, D]
        rows.append(scores.masked_fill(~causal, float("-inf")).softmax(-1) @ value[0, :, s:e])
    return torch.cat(rows, dim=1).transpose(0, 1)[None]


def test_packed_grouped_query_attention_equals_repeated_heads():
    query, key, value, cu, longest = packed_qkv()
    out, _ = modeling._varlen_attention(
        None, query, key, value, None, scaling=0.25, cu_seq_lens_q=cu, cu_seq_lens_k=cu,
        max_length_q=longest, max_length_k=longest)
    assert torch.allclose(out, repeated_reference(query, key, value, cu, 0.25), atol=1e-12)


@pytest.mark.parametrize("native", [True, False])
def test_the_flash_varlen_call_gets_unrepeated_heads_and_the_right_arguments(native, monkeypatch):
    # the CUDA kernel, replaced by a stub that checks its arguments and computes the same attention
    # on CPU
    query, key, value, cu, longest = packed_qkv()
    calls = []

    def stub(q, k, v, cu_seq_q, cu_seq_k, max_q, max_k, *, scale=None, window_size=(-1, -1),
             enable_gqa=False):
        calls.append(
            dict(
                q=tuple(q.shape),
                k=tuple(k.shape),
                v=tuple(v.shape),
                dtype=cu_seq_q.dtype,
                same_cu=cu_seq_q is cu_seq_k,
                max=(max_q, max_k),
                window=window_size,
                gqa=enable_gqa))
        out = repeated_reference(
            q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], cu_seq_q,
            scale)
        return out[0]  # [L, H, D]

    monkeypatch.setattr(modeling, "use_flash_varlen", lambda q: True)
    monkeypatch.setattr(modeling, "varlen_attn", stub)
    monkeypatch.setattr(modeling, "VARLEN_GQA", native)
    out, _ = modeling._varlen_attention(
        None, query, key, value, None, scaling=0.25, cu_seq_lens_q=cu, cu_seq_lens_k=cu,
        max_length_q=longest, max_length_k=longest)
    total = int(cu[-1])
    # native: the two KV heads as they are; else repeated for the older wrapper
    kv_heads = 2 if native else 4
    assert calls == [
        dict(
            q=(total, 4, 16), k=(total, kv_heads, 16), v=(total, kv_heads, 16), dtype=torch.int32,
            same_cu=True, max=(9, 9), window=(-1, 0), gqa=native)]
    assert torch.allclose(out, repeated_reference(query, key, value, cu, 0.25), atol=1e-12)
