#!/usr/bin/env bash
# Create (or reuse) a virtual environment and install ds-engine into it.
#
#   bash scripts/setup_env.sh [VENV_DIR] [--no-deepspeed] [--extras LIST]
#
# LIST: the ds-engine extras to install (comma-separated; default dev,peft,ray: what the test
# suite uses); the main job asks for `examples` only. DeepSpeed's extra is added unless
# --no-deepspeed.
#
# torch is installed first, with pip, from DS_ENGINE_TORCH (default `torch==2.13.0`, the CPU
# wheel on CPU machines here); the rest with uv (installed into the environment by pip; pip
# does it where uv cannot be had), torch held at that build. GPU users pick their own build, e.g.
#   DS_ENGINE_TORCH="torch==2.13.0" DS_ENGINE_TORCH_INDEX=https://download.pytorch.org/whl/cu128 bash scripts/setup_env.sh
# With --no-deepspeed the environment gets everything except DeepSpeed, which is uninstalled
# if present: the fallback suite runs where DeepSpeed is absent, not merely hidden.
set -euo pipefail
cd "$(dirname "$0")/.."
venv=.venv
with_deepspeed=1
extras=dev,peft,ray
while [ $# -gt 0 ]; do
  case "$1" in
    --no-deepspeed) with_deepspeed=0 ;;
    --extras) extras=${2:?"setup_env.sh: --extras needs a list, e.g. --extras examples"}; shift ;;
    -*) echo "setup_env.sh: unknown option $1 (known: --no-deepspeed, --extras LIST)" >&2; exit 2 ;;
    *) venv=$1 ;;
  esac
  shift
done
if [ "$with_deepspeed" = 1 ]; then extras="deepspeed,$extras"; fi
python=${PYTHON:-python3}
if [ ! -x "$venv/bin/python" ]; then
  echo "[setup] creating $venv"
  "$python" -m venv "$venv"
fi
pip=("$venv/bin/python" -m pip --disable-pip-version-check)
torch_spec=${DS_ENGINE_TORCH:-torch==2.13.0}
# A warm rerun skips pip: the stamp records what the environment was built from (the project's
# dependencies, the torch build, with or without DeepSpeed) and the extras installed; it is up
# to date when that matches and the extras asked for are among those installed. The package is
# installed editable, so source changes need no reinstall.
stamp="$venv/.ds_engine_setup"
want="$(cat pyproject.toml) | $torch_spec | ${DS_ENGINE_TORCH_INDEX:-} | deepspeed=$with_deepspeed"
want_hash=$(printf '%s' "$want" | sha256sum | cut -d' ' -f1)
have_hash=$(sed -n 1p "$stamp" 2>/dev/null || true)
have_extras=$(sed -n 2p "$stamp" 2>/dev/null || true)
if [ "$have_hash" = "$want_hash" ]; then
  missing=$(comm -23 <(tr ',' '\n' <<<"$extras" | sort -u) <(tr ',' '\n' <<<"$have_extras" | sort -u))
  if [ -z "$missing" ] && "$venv/bin/python" -c "import torch, ds_engine" 2>/dev/null; then
    echo "[setup] $venv: up to date (delete $stamp to reinstall)"
    exit 0
  fi
  # keep what is installed: a later run asking for fewer extras stays up to date
  extras=$(tr ',' '\n' <<<"$extras,$have_extras" | sed '/^$/d' | sort -u | paste -sd, -)
fi
rm -f "$stamp"
index_args=()
if [ -n "${DS_ENGINE_TORCH_INDEX:-}" ]; then index_args=(--index-url "$DS_ENGINE_TORCH_INDEX"); fi
echo "[setup] $venv: installing $torch_spec"
"${pip[@]}" install -q "${index_args[@]}" "$torch_spec"
# The rest is resolved and installed by uv (from PyPI, as pip would, and compiled to bytecode
# as pip does: about 20 s where pip takes about 2 minutes of CPU), with torch held at the build
# just installed, so no dependency can swap it for another build. Where uv cannot be had, pip
# does it.
pins="$venv/.ds_engine_pins.txt"
"$venv/bin/python" -c "from importlib.metadata import version; print('torch==' + version('torch'))" > "$pins"
echo "[setup] $venv: installing ds-engine[$extras]"
if "${pip[@]}" install -q uv && "$venv/bin/uv" pip install --python "$venv/bin/python" -q --compile-bytecode -c "$pins" -e ".[$extras]"; then
  :
else
  echo "[setup] $venv: uv unavailable or failed; installing with pip"
  "${pip[@]}" install -q -c "$pins" -e ".[$extras]"
fi
if [ "$with_deepspeed" = 0 ]; then
  if "$venv/bin/python" -c "import importlib.util,sys; sys.exit(importlib.util.find_spec('deepspeed') is None)"; then
    "${pip[@]}" uninstall -q -y deepspeed
  fi
fi
if [ "$with_deepspeed" = 1 ]; then
  # DeepSpeed compiles its CPU communication op at the first launch (cached under
  # ~/.cache/torch_extensions): build it now, so the first run's first step comes sooner.
  echo "[setup] $venv: building DeepSpeed's CPU ops that a launch needs (once; cached)"
  "$venv/bin/python" - <<'PY' > "$venv/.ds_engine_ops.log" 2>&1 || echo "[setup] op pre-build skipped: see $venv/.ds_engine_ops.log"
from deepspeed.accelerator import get_accelerator

if get_accelerator().device_name() == "cpu":
    builder = get_accelerator().create_op_builder("ShareMemCommBuilder")
    if builder is not None and builder.is_compatible():
        builder.load()
PY
fi
"$venv/bin/python" -c "import torch, ds_engine; print('[setup] ready:', '$venv', 'torch', torch.__version__, 'ds_engine', ds_engine.__version__)"
printf '%s\n%s\n' "$want_hash" "$extras" > "$stamp"
