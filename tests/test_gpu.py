"""The update path on a GPU (skipped without CUDA): packed rows through every attention kernel the
trainer may meet give finite gradients that match a float32 reference within bf16 tolerance, and the
Triton log-prob/entropy kernels match the exact chunked code."""

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

import modeling
import stare

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

BACKENDS = ["default", "FLASH_ATTENTION", "EFFICIENT_ATTENTION", "CUDNN_ATTENTION", "MATH"]


def gpu_model(attn_implementation, dtype):
    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=4096, hidden_size=256, intermediate_size=512, num_hidden_layers=3,
        num_attention_heads=8, num_key_value_heads=2, head_dim=32, max_position_embeddings=4096,
        tie_word_embeddings=False, attn_implementation=attn_implementation)
    return Qwen2ForCausalLM(config).to(device="cuda", dtype=dtype)


def ragged_rows(seed=0):
    """Rows of very different lengths, including a 1-token prompt and an empty response."""
    generator = torch.Generator().manual_seed(seed)
    lengths = [(1, 300), (200, 1), (37, 0), (120, 900), (5, 17)] + [
        (int(p), int(r)) for p, r in zip(torch.randint(1, 300, (6,), generator=generator),
                                         torch.randint(1, 600, (6,), generator=generator))]
    return ([torch.randint(0, 4096, (p,), generator=generator).tolist() for p, _ in lengths],
            [torch.randint(0, 4096, (r,), generator=generator).tolist() for _, r in lengths])


def packed_gradients(model, prompts, responses):
    """Parameter gradients (float32) of a policy-gradient-like loss over packed rows, and the loss."""
    packed = modeling.pack_rows(prompts, responses, torch.device("cuda"))
    logits = modeling.response_logits(model, packed)  # [N, V]
    logprobs, entropy = stare.token_logprobs_and_entropy(logits, packed.response_ids)
    weights = torch.linspace(-1, 1, logprobs.shape[0], device="cuda")  # signed, like advantages
    loss = (weights * logprobs).mean() - 0.01 * entropy.mean()
    loss.backward()
    return {name: p.grad.float() for name, p in model.named_parameters()}, loss.item()


@pytest.fixture(scope="module")
def float32_reference():
    prompts, responses = ragged_rows()
    grads, loss = packed_gradients(gpu_model("eager", torch.float32), prompts, responses)
    return prompts, responses, grads, loss


@pytest.mark.parametrize("attention", ["varlen"] + [f"sdpa/{b}" for b in BACKENDS])
def test_packed_bf16_update_is_finite_and_matches_float32(attention, float32_reference):
    prompts, responses, want, want_loss = float32_reference
    implementation, _, backend = attention.partition("/")
    model = gpu_model(implementation, torch.bfloat16)
    if backend and backend != "default":
        with torch.nn.attention.sdpa_kernel(getattr(torch.nn.attention.SDPBackend, backend)):
            try:
                grads, loss = packed_gradients(model, prompts, responses)
            except RuntimeError as error:  # e.g. flash attention takes no mask (packed sdpa has)
                pytest.skip(f"{backend} cannot run packed rows: {str(error)[:200]}")
    else:
        grads, loss = packed_gradients(model, prompts, responses)
    assert all(g.isfinite().all() for g in grads.values())
    total_error = sum((grads[k] - want[k]).square().sum() for k in want).sqrt()
    total_norm = sum(want[k].square().sum() for k in want).sqrt()
    relative = (total_error / total_norm).item()
    print(
        f"{attention}: relative gradient error vs float32 {relative:.2e}, loss {loss:.5f} vs {want_loss:.5f}"
    )
    assert relative < 0.05
    assert abs(loss - want_loss) < 0.02 * (1 + abs(want_loss))


def test_varlen_attention_confines_rows_on_gpu():
    # bf16 varlen: a change in one row leaves the others' logits bit-identical
    prompts, responses = ragged_rows(1)
    model = gpu_model("varlen", torch.bfloat16).eval()
    with torch.no_grad():
        before = modeling.response_logits(
            model, modeling.pack_rows(prompts, responses, torch.device("cuda")))
        prompts[3] = [(t + 1) % 4096 for t in prompts[3]]
        after = modeling.response_logits(
            model, modeling.pack_rows(prompts, responses, torch.device("cuda")))
    first, last = sum(len(r) for r in responses[:3]), sum(len(r) for r in responses[:4])
    assert torch.equal(before[:first], after[:first]) and torch.equal(before[last:], after[last:])
    assert not torch.equal(before[first:last], after[first:last])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_kernels_match_the_exact_code(dtype):
    from kernel_check import check  # tests/ is on sys.path under pytest

    print(
        f"{dtype}: worst error {check(torch.device('cuda'), vocab_size=151936, num_rows=64, dtype=dtype):.2e}"
    )
