"""The public config.json values of the models the shipped configs name (the sizes a memory plan
reads), written as a model directory that holds nothing but config.json: what `train.py --plan`
needs."""

import json
from pathlib import Path

QWEN2 = dict(
    architectures=["Qwen2ForCausalLM"], model_type="qwen2", hidden_act="silu",
    torch_dtype="bfloat16", bos_token_id=151643, eos_token_id=151643, rms_norm_eps=1e-6,
    use_sliding_window=False)
ARCHITECTURES = {  # the model directory name each shipped config uses -> its config.json
    "DeepSeek-R1-Distill-Qwen-7B": dict(
        QWEN2, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
        num_attention_heads=28, num_key_value_heads=4, vocab_size=152064,
        max_position_embeddings=131072, rope_theta=10000.0, tie_word_embeddings=False),
    "DeepSeek-R1-Distill-Qwen-14B": dict(
        QWEN2,
        hidden_size=5120,
        intermediate_size=13824,
        num_hidden_layers=48,
        num_attention_heads=40,
        num_key_value_heads=8,
        vocab_size=152064,
        max_position_embeddings=131072,
        rope_theta=1e6,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False),
    "DeepSeek-R1-Distill-Qwen-32B": dict(
        QWEN2,
        hidden_size=5120,
        intermediate_size=27648,
        num_hidden_layers=64,
        num_attention_heads=40,
        num_key_value_heads=8,
        vocab_size=152064,
        max_position_embeddings=131072,
        rope_theta=1e6,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False),
    "Qwen2.5-Math-7B": dict(
        QWEN2, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
        num_attention_heads=28, num_key_value_heads=4, vocab_size=152064,
        max_position_embeddings=4096, rope_theta=10000.0, tie_word_embeddings=False),
    "Qwen2.5-Math-1.5B": dict(
        QWEN2, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
        num_attention_heads=12, num_key_value_heads=2, vocab_size=151936,
        max_position_embeddings=4096, rope_theta=10000.0, tie_word_embeddings=True),
    "Qwen2.5-0.5B-Instruct": dict(
        QWEN2, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
        num_attention_heads=14, num_key_value_heads=2, vocab_size=151936,
        max_position_embeddings=32768, rope_theta=1e6, tie_word_embeddings=True,
        eos_token_id=151645),
    "Qwen2.5-7B-Instruct": dict(
        QWEN2, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
        num_attention_heads=28, num_key_value_heads=4, vocab_size=152064,
        max_position_embeddings=32768, rope_theta=1e6, tie_word_embeddings=False),
    # SmolLM2-135M-Instruct as tools/convert_gguf.py writes it (the directory
    # configs/smollm2_add.yaml names)
    "smollm2": dict(
        architectures=["LlamaForCausalLM"], model_type="llama", hidden_act="silu",
        torch_dtype="float32", hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
        num_attention_heads=9, num_key_value_heads=3, vocab_size=49152,
        max_position_embeddings=8192, rope_theta=100000.0, rms_norm_eps=1e-5,
        tie_word_embeddings=True, bos_token_id=1, eos_token_id=2),
}


def write_config_dir(root, name):
    """root/name/config.json for the named architecture -> the directory."""
    directory = Path(root) / name
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(ARCHITECTURES[name], indent=1))
    return directory
