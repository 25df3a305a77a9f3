#!/usr/bin/env bash
# Does vLLM load `tailrl drafter export --for vllm` output, and accept as much as tailrl does?
#   scripts/check_vllm.sh DRAFTER_DIR [-k K] [--num-prompts N] [--max-new-tokens N]
# Needs a drafter (tailrl drafter warmup --out DIR) and vLLM in the project's .venv (`bash run
# test` installs it, or `.venv/bin/pip install -e '.[vllm]'`). Not part of the test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
drafter="${1:?usage: scripts/check_vllm.sh DRAFTER_DIR [-k K] [--num-prompts N] [--max-new-tokens N]}"
shift
extra=()
while [ $# -gt 0 ]; do
    case "$1" in
        -k|--num-prompts|--max-new-tokens) extra+=("$1" "$2"); shift ;;
        *) echo "unknown argument $1" >&2; exit 2 ;;
    esac
    shift
done
python=.venv/bin/python
if ! "$python" -c "import vllm" 2>/dev/null; then
    echo "vLLM is not installed in .venv: run 'bash run test' once, or .venv/bin/pip install -e '.[vllm]'" >&2
    exit 2
fi
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
# Two processes: the vllm half imports nothing from tailrl, so it shows what a serving engine sees.
"$python" scripts/check_vllm.py tailrl --drafter "$drafter" --export "$work/eagle-vllm" --result "$work/result.json" "${extra[@]}"
"$python" scripts/check_vllm.py vllm --result "$work/result.json"
