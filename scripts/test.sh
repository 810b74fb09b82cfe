#!/usr/bin/env bash
# The whole test suite, twice: with DeepSpeed, and where DeepSpeed is not installed at all.
#
#   bash scripts/test.sh [PYTEST_ARGS...]
#
# Sets up .venv (with DeepSpeed) and .venv-nods (without), runs ruff and mypy, then pytest
# in each environment; exits non-zero if anything failed.
set -uo pipefail
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
bash scripts/setup_env.sh .venv || exit 1
# DeepSpeed compiles its CPU-Adam op on first use (about a minute); build it into the
# torch_extensions cache while the second environment installs.
.venv/bin/python -c "from deepspeed.ops.op_builder import CPUAdamBuilder; CPUAdamBuilder().load()" \
  > .cpu_adam_build.log 2>&1 &
prebuild=$!
bash scripts/setup_env.sh .venv-nods --no-deepspeed || exit 1
wait "$prebuild" || echo "[setup] CPU-Adam prebuild failed (tests will build it): see .cpu_adam_build.log"
status=0
echo "== lint: ruff + mypy"
.venv/bin/ruff check ds_engine tests scripts || status=1
.venv/bin/ruff format --check ds_engine tests scripts || status=1
.venv/bin/mypy || status=1
echo "== suite 1/2: DeepSpeed installed (every test not marked 'nodeepspeed')"
.venv/bin/python -m pytest -m "not nodeepspeed" --durations=15 "$@" || status=1
echo "== suite 2/2: DeepSpeed not installed (every test not marked 'deepspeed')"
.venv-nods/bin/python -m pytest -m "not deepspeed" --durations=15 "$@" || status=1
if [ "$status" = 0 ]; then echo "== all passed"; else echo "== FAILED"; fi
exit $status
