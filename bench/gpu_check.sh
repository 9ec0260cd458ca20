#!/usr/bin/env bash
# The GPU check: what rlbus can verify on one accelerator, in one short run, with nothing downloaded.
#
#   bench/gpu_check.sh                 on a CUDA machine (under 8 minutes on one H200)
#   bench/gpu_check.sh --device cpu    the same parts on CPU, small (a smoke run: the script itself works)
#
# Parts, each a bench of its own whose last stdout line is a JSON object:
#   trainer   bench/gpu_check_trainer.py: the trainer's Learner, bf16 mixed precision vs float32, on a tiny Llama
#             and on a random-init Llama of SmolLM2-135M's shape (step time, training tokens/s, peak memory)
#   engine    bench/engine.py --quick: rlbus's torch engine vs transformers' generate (static batch, sequential)
#             on the device, tiny and SmolLM2-shaped models (tokens/s, ratios)
#   vllm      only where vLLM is importable: bench/engine.py --vllm-only (direct AsyncLLM vs rlbus's VllmEngine)
# The last line of this script is one JSON object: {"device", "gpu", "verified_gpu", "parts": {...}, "failed": [...]}.
# Without a CUDA device (and without --device cpu) it says so and verifies nothing: GPU figures are then
# NOT verified, and the JSON line says "verified_gpu": false with the reason.
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PY="${PYTHON:-}"
if [[ -z "$PY" ]]; then
  if [[ -x "$ROOT/.venv/bin/python" ]]; then PY="$ROOT/.venv/bin/python"; else PY=python3; fi
fi
DEVICE=cuda
while [[ $# -gt 0 ]]; do
  case "$1" in
    --device) DEVICE="$2"; shift 2 ;;
    -h|--help) sed -n '2,16p' "$0"; exit 0 ;;
    *) echo "gpu_check.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
done
OUT="$(mktemp -d)"
trap 'rm -rf "$OUT"' EXIT

if [[ "$DEVICE" != cpu ]]; then
  if ! "$PY" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
    echo "gpu_check: no CUDA device visible to $PY: GPU figures are NOT verified (run with --device cpu for a smoke run)" >&2
    echo '{"device": "none", "gpu": null, "verified_gpu": false, "reason": "no CUDA device", "parts": {}, "failed": []}'
    exit 0
  fi
fi

# part NAME TIMEOUT_S COMMAND...: runs it, keeps its last stdout line (its JSON) or records the failure
FAILED=()
part() {
  local name="$1" limit="$2"; shift 2
  local start=$SECONDS
  echo "[gpu_check] $name: $*" >&2
  if timeout "$limit" "$@" > "$OUT/$name.out" 2> "$OUT/$name.err"; then
    tail -n 1 "$OUT/$name.out" > "$OUT/$name.json"
    echo "[gpu_check] $name done in $((SECONDS - start)) s" >&2
  else
    FAILED+=("$name")
    echo "[gpu_check] $name FAILED after $((SECONDS - start)) s; last lines:" >&2
    tail -n 15 "$OUT/$name.err" >&2
  fi
}

if [[ "$DEVICE" == cpu ]]; then
  part trainer 300 "$PY" bench/gpu_check_trainer.py --device cpu --models tiny --steps 1 --warmup 0
  part engine_tiny 300 "$PY" bench/engine.py --quick --device cpu --requests 8 --max-new 16
else
  part trainer 240 "$PY" bench/gpu_check_trainer.py --device "$DEVICE"
  part engine_tiny 90 "$PY" bench/engine.py --quick --device "$DEVICE" --threads 4
  part engine_smollm2 120 "$PY" bench/engine.py --quick --device "$DEVICE" --threads 4 --shape smollm2 --dtype bfloat16
fi
if "$PY" -c "import importlib.util as u, sys; s = u.find_spec('vllm'); sys.exit(0 if s and s.origin else 1)" 2>/dev/null; then
  part vllm 240 "$PY" bench/engine.py --vllm-only --quick --smollm2 off --shape "$([[ $DEVICE == cpu ]] && echo tiny || echo smollm2)"
else
  echo "[gpu_check] vllm: not installed for $PY: the vLLM engine on this device is NOT verified" >&2
fi

"$PY" - "$OUT" "$DEVICE" "${FAILED[@]}" <<'EOF'
import json, pathlib, sys

out, device, failed = pathlib.Path(sys.argv[1]), sys.argv[2], sys.argv[3:]
parts = {}
for f in sorted(out.glob("*.json")):
    try:
        parts[f.stem] = json.loads(f.read_text())
    except ValueError:
        failed.append(f.stem + " (no JSON line)")
gpu = None
if device != "cpu":
    import torch
    gpu = torch.cuda.get_device_name(torch.device(device))
print(json.dumps({"device": device, "gpu": gpu, "verified_gpu": gpu is not None and not failed,
                  "vllm": "vllm" in parts, "parts": parts, "failed": failed}))
EOF
[[ ${#FAILED[@]} -eq 0 ]]
