#!/usr/bin/env bash
# The main job: set up .venv (with DeepSpeed) and fine-tune the real pretrained MiniLM for
# sentiment classification on 2 CPU processes with DeepSpeed ZeRO-3.
#
#   bash scripts/main.sh [EXTRA ARGS FOR scripts/examples/finetune_classification.py]
#
# Prints the untrained and final validation accuracy, the accuracy of the saved model reloaded
# with plain `from_pretrained`, and where the model and the metrics went (out/classification).
set -euo pipefail
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
bash scripts/setup_env.sh .venv --extras examples
exec .venv/bin/ds-engine launch --nproc-per-node 2 scripts/examples/finetune_classification.py \
  --zero-stage 3 --output-dir out/classification "$@"
