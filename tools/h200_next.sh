# The next H200 session's measurements, one device call per mode (each under 10 minutes).
# Carry .whl (and .triton-cache/cache.tgz if a previous call left one under 16 MB).
#   bash tools/h200_next.sh tests    # every GPU test: Triton GDN (incl. packed, sequence-parallel), state scan, KDA
#   bash tools/h200_next.sh stages   # per-kernel times at (2,8192,16) and (1,16384,16), sequence-parallel rows
#   bash tools/h200_next.sh gdn      # rewy-hf bench, GDN, six shapes, sequential vs sequence-parallel recurrences
#   bash tools/h200_next.sh kda      # benchmarks/kda_gpu_check.py (KDA / GDN2 Triton backward)
#   bash tools/h200_next.sh gdn2-1b  # the gdn2-1b recipe run with the GDN2 Triton backward (--kernels triton),
#                                    # to compare with docs/runs/h200_2026-11-29/1b_orig.metrics.jsonl
source tools/h200_env.sh
O=${OUT:-gpu_out}; mkdir -p $O
case "$1" in
tests)
  (cd tests && timeout 540 python3 -m pytest -q -p no:cacheprovider -m gpu -x \
      test_gpu_triton_gdn.py test_gpu_state_scan.py test_gpu_triton_kda.py test_gpu_torch_backend.py > $O/gpu_tests.log 2>&1)
  tail -n 30 $O/gpu_tests.log ;;
stages)
  timeout 260 python3 benchmarks/gdn_bwd_stages.py --B 2 --T 8192 --H 16 > $O/stages_2_8192.log 2>&1
  timeout 260 python3 benchmarks/gdn_bwd_stages.py --B 1 --T 16384 --H 16 > $O/stages_1_16384.log 2>&1
  tail -n 14 $O/stages_*.log ;;
gdn)
  cd /tmp   # the repo's rewy_hf/ (without kernels/) must not shadow the assembled package
  REWY_HF_SEQUENCE_PARALLEL=auto timeout 280 python3 -m rewy_hf bench --device cuda --op gdn --lift-gdn-guard \
      --policy recompute --reps 3 --json $O/bench_gdn_sp.json --markdown $O/bench_gdn_sp.md > $O/bench_gdn_sp.log 2>&1
  timeout 280 python3 -m rewy_hf bench --device cuda --op gdn --lift-gdn-guard --policy recompute --reps 3 \
      --json $O/bench_gdn.json --markdown $O/bench_gdn.md > $O/bench_gdn.log 2>&1
  tail -n 20 $O/bench_gdn*.log ;;
kda)
  timeout 540 python3 benchmarks/kda_gpu_check.py > $O/kda.log 2>&1; tail -n 40 $O/kda.log ;;
gdn2-1b)
  timeout 540 python3 recipes/finetune_gdn2.py --model gdn2-1b --seq-len 2048 --batch-size 4 --max-steps 30 \
      --save-every 0 --data recipes/data/corpus.txt --no-progress --log-every 5 --warmup-steps 3 \
      --backend optimized --kernels triton --output-dir /tmp/r1b_triton > $O/1b_triton.log 2>&1
  cp /tmp/r1b_triton/metrics.jsonl $O/1b_triton.metrics.jsonl
  cp /tmp/r1b_triton/dispatch_report.json $O/1b_triton.dispatch.json
  tail -n 12 $O/1b_triton.log ;;
*) echo "usage: $0 tests|stages|gdn|kda|gdn2-1b"; exit 2 ;;
esac
if [ -d ~/.triton/cache ]; then tar czf $O/cache.tgz -C ~/.triton cache; fi
