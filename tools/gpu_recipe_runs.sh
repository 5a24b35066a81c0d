# The GPU runs of the training-recipe issue, on the lent 2 x H200 machine.
#   bash tools/gpu_recipe_runs.sh 1b     # gdn2-1b: original (GPU 0) and optimized (GPU 1) side by side, 30 steps
#   bash tools/gpu_recipe_runs.sh dist   # gdn2-small: 1 GPU, DDP x2, FSDP x2, 50 steps each, same global batch
# Single-GPU runs use plain python with CUDA_VISIBLE_DEVICES (accelerate launch would override it
# with the config's gpu_ids). Logs and metrics go under $OUT (or ./gpu_runs); summarise with tools/compare_runs.py.
source tools/h200_env.sh
export NCCL_NVLS_ENABLE=0          # NVLink multicast off (device docs)
O=${OUT:-gpu_runs}; mkdir -p $O
R=recipes/finetune_gdn2.py
common="--data recipes/data/corpus.txt --no-progress --log-every 5 --warmup-steps 3"
args1b="--model gdn2-1b --seq-len 2048 --batch-size 4 --max-steps 30 --save-every 0 $common"
argsd="--model gdn2-small --seq-len 1024 --max-steps 50 --save-every 25 $common"
case "$1" in
1b)
  CUDA_VISIBLE_DEVICES=0 python3 $R $args1b --backend original --output-dir /tmp/r1b_orig > $O/1b_original.log 2>&1 &
  CUDA_VISIBLE_DEVICES=1 python3 $R $args1b --backend optimized --output-dir /tmp/r1b_opt > $O/1b_optimized.log 2>&1 &
  wait
  for d in orig opt; do cp /tmp/r1b_$d/metrics.jsonl $O/1b_$d.metrics.jsonl; cp /tmp/r1b_$d/dispatch_report.json $O/1b_$d.dispatch.json; done
  ;;
1b-opt+dist)   # the optimized 1b run (GPU 1) beside the single-GPU small run (GPU 0), then DDP and FSDP
  CUDA_VISIBLE_DEVICES=1 python3 $R $args1b --backend optimized --output-dir /tmp/r1b_opt > $O/1b_optimized.log 2>&1 &
  CUDA_VISIBLE_DEVICES=0 python3 $R $argsd --batch-size 8 --output-dir /tmp/rs_single > $O/single.log 2>&1
  wait
  cp /tmp/r1b_opt/metrics.jsonl $O/1b_opt.metrics.jsonl; cp /tmp/r1b_opt/dispatch_report.json $O/1b_opt.dispatch.json
  args=$argsd
  python3 -m accelerate.commands.launch --config_file recipes/configs/ddp.yaml $R $args --batch-size 4 --output-dir /tmp/rs_ddp > $O/ddp.log 2>&1
  python3 -m accelerate.commands.launch --config_file recipes/configs/fsdp.yaml $R $args --batch-size 4 --output-dir /tmp/rs_fsdp > $O/fsdp.log 2>&1
  for d in single ddp fsdp; do cp /tmp/rs_$d/metrics.jsonl $O/$d.metrics.jsonl; cp /tmp/rs_$d/dispatch_report.json $O/$d.dispatch.json; done
  ;;
dist)
  args=$argsd
  CUDA_VISIBLE_DEVICES=0 python3 $R $args --batch-size 8 --output-dir /tmp/rs_single > $O/single.log 2>&1
  python3 -m accelerate.commands.launch --config_file recipes/configs/ddp.yaml $R $args --batch-size 4 --output-dir /tmp/rs_ddp > $O/ddp.log 2>&1
  python3 -m accelerate.commands.launch --config_file recipes/configs/fsdp.yaml $R $args --batch-size 4 --output-dir /tmp/rs_fsdp > $O/fsdp.log 2>&1
  for d in single ddp fsdp; do cp /tmp/rs_$d/metrics.jsonl $O/$d.metrics.jsonl; cp /tmp/rs_$d/dispatch_report.json $O/$d.dispatch.json; done
  ;;
*) echo "usage: $0 1b|dist|1b-opt+dist"; exit 2;;
esac
tail -n 4 $O/*.log
