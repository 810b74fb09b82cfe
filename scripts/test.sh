#!/usr/bin/env bash
# The whole test suite, twice: with DeepSpeed, and where DeepSpeed is not installed at all.
#
#   bash scripts/test.sh [PYTEST_ARGS...]
#
# Sets up .venv (with DeepSpeed) and .venv-nods (without), runs ruff and mypy, then pytest
# in each environment; exits non-zero if anything failed.
#
# The distributed tests with DeepSpeed (every test is a real 2-rank launch, one at a time; the
# longest part) start as soon as .venv is ready; lint and the unit tests (on 2 pytest-xdist
# workers, CPU-bound) run beside them, then the distributed tests where DeepSpeed is absent.
# A launch that waits on a restart, a signal or a timeout leaves the cores about half idle,
# which the other work uses. Each background part's log is printed when it ends. Launches of
# the fallback or the launcher alone (marked `dsfree`, see tests/conftest.py) run only where
# DeepSpeed is absent: nothing in them depends on DeepSpeed being installed.
# With PYTEST_ARGS, each environment runs one plain pytest with them instead (`dsfree`
# included), one environment after the other.
set -uo pipefail
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
# every launch imports the project's modules: compiled once, not in each of its processes
unset PYTHONDONTWRITEBYTECODE
# Both environments install at once (scripts/setup_env.sh: torch with pip, the rest with uv);
# the distributed tests with DeepSpeed, lint and the unit tests with DeepSpeed start as soon as
# the first is ready.
logs=$(mktemp -d)
bash scripts/setup_env.sh .venv > "$logs/venv.log" 2>&1 &
setup_ds=$!
bash scripts/setup_env.sh .venv-nods --no-deepspeed > "$logs/venv-nods.log" 2>&1 &
setup_nods=$!
wait "$setup_ds"; rc_ds=$?
cat "$logs/venv.log"
if [ "$rc_ds" != 0 ]; then wait "$setup_nods"; exit 1; fi
# DeepSpeed compiles its CPU optimizer ops on first use (about 40 s each): DeepSpeedCPUAdam
# (offload) and the CPU build of FusedAdam (a config's "optimizer" block on CPU ranks). Build
# both into the torch_extensions cache while the second environment finishes installing, so
# no test waits for a compiler.
prebuilds=()
for op in CPUAdamBuilder FusedAdamBuilder; do
  .venv/bin/python -c "from deepspeed.accelerator import get_accelerator as a; a().create_op_builder('$op').load()" \
    > ".prebuild_$op.log" 2>&1 &
  prebuilds+=("$!:$op")
done
ARGS=("$@")
if [ "${#ARGS[@]}" = 0 ]; then
  echo "== distributed 1/2 started at ${SECONDS} s: DeepSpeed installed (every test not marked 'nodeepspeed' nor 'dsfree'; log printed when it ends)"
  .venv/bin/python -m pytest tests/distributed -m "not nodeepspeed and not dsfree" --durations=15 \
    --basetemp "$logs/tmp-deepspeed" > "$logs/distributed-deepspeed.log" 2>&1 &
  dist_ds=$!
fi
status=0
echo "== lint: ruff + mypy (while the second environment installs)"
.venv/bin/ruff check ds_engine tests scripts || status=1
.venv/bin/ruff format --check ds_engine tests scripts || status=1
.venv/bin/mypy || status=1
echo "== lint done at ${SECONDS} s"
if [ "${#ARGS[@]}" = 0 ]; then
  echo "== unit 1/2: DeepSpeed installed (every test not marked 'nodeepspeed')"
  .venv/bin/python -m pytest tests --ignore=tests/distributed -m "not nodeepspeed" -n 2 --durations=10 \
    --basetemp "$logs/tmp-unit-deepspeed" || status=1
  echo "== unit 1/2 done at ${SECONDS} s"
fi
wait "$setup_nods"; rc_nods=$?
cat "$logs/venv-nods.log"
for job in "${prebuilds[@]}"; do
  wait "${job%%:*}" || echo "[setup] ${job#*:} prebuild failed (tests will build it): see .prebuild_${job#*:}.log"
done
if [ "$rc_nods" != 0 ]; then
  if [ -n "${dist_ds:-}" ]; then kill "$dist_ds" 2>/dev/null; wait "$dist_ds"; fi
  exit 1
fi
echo "== set-up done at ${SECONDS} s"
if [ "${#ARGS[@]}" -gt 0 ]; then
  echo "== suite 1/2: DeepSpeed installed"
  .venv/bin/python -m pytest -m "not nodeepspeed" --durations=15 "${ARGS[@]}" || status=1
  echo "== suite 2/2: DeepSpeed not installed"
  .venv-nods/bin/python -m pytest -m "not deepspeed" --durations=15 "${ARGS[@]}" || status=1
else
  echo "== unit 2/2: DeepSpeed not installed (every test not marked 'deepspeed')"
  .venv-nods/bin/python -m pytest tests --ignore=tests/distributed -m "not deepspeed" -n 2 --durations=10 \
    --basetemp "$logs/tmp-unit-nodeepspeed" || status=1
  echo "== unit tests done at ${SECONDS} s"
  echo "== distributed 2/2: DeepSpeed not installed (every test not marked 'deepspeed')"
  # its Ray test first: one local Ray cluster runs at a time on the machine, and the other
  # half, which ends last, reaches its own Ray test near its end
  .venv-nods/bin/python -m pytest tests/distributed/test_ray_train.py -m "not deepspeed" --durations=15 \
    --basetemp "$logs/tmp-nodeepspeed-ray" || status=1
  .venv-nods/bin/python -m pytest tests/distributed -m "not deepspeed" --durations=15 \
    --ignore tests/distributed/test_ray_train.py --basetemp "$logs/tmp-nodeepspeed" || status=1
  echo "== distributed without DeepSpeed done at ${SECONDS} s"
  wait "$dist_ds" || status=1
  echo "== distributed with DeepSpeed done at ${SECONDS} s"
  echo "== distributed 1/2: DeepSpeed installed (every test not marked 'nodeepspeed' nor 'dsfree')"
  cat "$logs/distributed-deepspeed.log"
fi
if [ "$status" = 0 ]; then echo "== all passed"; else echo "== FAILED"; fi
exit $status
