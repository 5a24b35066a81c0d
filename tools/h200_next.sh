# H200 measurements, one mode per queue entry; each device call stays under 10 minutes.
# Carry .whl. Everything the modes write comes back as one $OUT/logs.tgz (a device call returns at most 8 files);
# a second run of this script in the same device call adds its own logs-2.tgz, logs-3.tgz, ... beside it.
#   bash tools/h200_next.sh tests        # every GPU test: Triton GDN (packed, sequence-parallel), state scan, KDA
#   bash tools/h200_next.sh stages       # per-kernel GDN backward times at (2,8192,16) and (1,16384,16)
#   bash tools/h200_next.sh verify       # rewy-hf verify --device cuda, timed (a cold machine, as a user has)
#   bash tools/h200_next.sh bench-gdn    # rewy-hf bench: delta_rule + gdn, six shapes, both policies, B and FB
#   bash tools/h200_next.sh bench-kda    # rewy-hf bench: kda + gdn2, Triton backward, same grid
#                                        # (bench-kda:gdn2 / bench-gdn:gdn: those ops only, own file names)
#   bash tools/h200_next.sh kda          # benchmarks/kda_gpu_check.py (checks, timing, per-kernel profile)
#   bash tools/h200_next.sh kda-prec     # benchmarks/kda_precision.py; bench-kda then uses its choice
#   bash tools/h200_next.sh configs      # benchmarks/kernel_configs.py: launch configs outside the autotune lists;
#                                        # configs:kda-wy,gdn-local picks kernels; T_configs per kernel, CONFIG_ARGS
#   bash tools/h200_next.sh scan         # benchmarks/state_scan_timing.py (SCAN_ARGS): sequence-parallel recurrences vs FLA
#   bash tools/h200_next.sh ckpt         # benchmarks/checkpoint_timing.py (CKPT_ARGS): state rebuild from checkpoints
#   bash tools/h200_next.sh gaps         # benchmarks/timing_gaps.py (GAP_ARGS): bench time vs chained runs, host time, kernel sum
#   bash tools/h200_next.sh ncu          # Nsight Compute sections for one launch of each rewy backward kernel
#   bash tools/h200_next.sh kda-profile  # per-kernel profile (KDA, GDN2) + GVA / state_v_first / cu_seqlens checks
#   bash tools/h200_next.sh model-gdn2   # rewy-hf bench --model gdn2-1b (Triton backward)
#   bash tools/h200_next.sh model-qwen   # rewy-hf bench --model qwen3.5-1b
#   bash tools/h200_next.sh model-profile # benchmarks/model_profile.py (PROFILE_MODEL, default qwen3.5-1b)
#   bash tools/h200_next.sh gdn2-1b      # the gdn2-1b recipe run with --kernels triton
#   bash tools/h200_next.sh qla-a        # carry [".qla/a"]: FLA + FlashQLA wheels without z3 into /tmp/site_qla
#   bash tools/h200_next.sh qla-b        # right after (warm machine), carry [".qla/b", ".whl"]: z3, then GDN bench
#                                        # against FlashQLA (FLA dispatches GDN to it once it imports)
# Two GPUs: bash tools/h200_next.sh pair "verify bench-gdn" "kda bench-kda"  (one queue per GPU)
# env:NAME=VALUE in a queue exports a variable for the modes after it in that queue only (+ for a space in VALUE).
# Next calls (nvidia-h200, one GPU, carry [".whl"]; the first op's first shape compiles FLA for about 3.5 minutes;
# chain the calls within 30 s so the machine and its ~/.triton cache stay warm, or use SAVE_CACHE=1 below):
# 0. GDN recompute sits at the 1.4x line (eighteenth session, reverse walk on auto: 1.40x as run, 1.41x on fastest
#    rounds, 1.39x against FLA's fastest quiet rounds) and DeltaNet recompute at 1.25x as run, both with host stalls
#    at H = 16 rows. First the GPU test of the walk's auto rule through the op (written after the device time was
#    spent), then both benches again, the first on a warm machine, and the state checkpoints in the KDA backward:
#   T_tests=200 TESTS_K="walk_auto or walk_matches or prestage" bash tools/h200_next.sh tests
#   BENCH_POLICY=recompute T_bench_gdn=300 bash tools/h200_next.sh bench-gdn:gdn   (right after, machine warm)
#   BENCH_POLICY=recompute T_bench_gdn=560 bash tools/h200_next.sh bench-gdn:delta_rule
#   T_gaps=250 bash tools/h200_next.sh "env:REWY_HF_STATE_CHECKPOINTS=off" \
#       "env:GAP_ARGS=--op+kda+--policy+recompute+--sides+rewy+--shapes+2,8192,16+1,16384,16+1,32768,32" gaps \
#       "env:REWY_HF_STATE_CHECKPOINTS=auto" gaps
# 1. The KDA / GDN2 bench at the six shapes with the direct launch, the BV 16 state launch, the checkpoints and the
#    early frees of u and the local dv (their rows are the tenth session's; one call per op at the H = 16 shapes, then
#    both at H = 32, as the tenth session did):
#   T_bench_kda=540 SHAPES_KDA="8,2048,16 4,4096,16 2,8192,16 1,16384,16" bash tools/h200_next.sh bench-kda:kda
#   T_bench_kda=540 SHAPES_KDA="8,2048,16 4,4096,16 2,8192,16 1,16384,16" bash tools/h200_next.sh bench-kda:gdn2
#   T_bench_kda=540 SHAPES_KDA="4,4096,32 1,32768,32" bash tools/h200_next.sh bench-kda
# 2. The model-level steps with the current kernels: model-qwen, model-gdn2; then gdn2-1b (the recipe run).
# Done in the eighteenth session (one H200): TESTS_K="walk or prestage" (11 passed), timing_gaps --per-kernel for GDN
#   recompute with neither walk, the reverse walk, both, the rebuild walk alone (reverse walk -2.6 to -2.9 % at
#   B x H = 64 / 128, slower below: auto since; rebuild walk no gain: removed), GDN recompute bench (two calls) and
#   DeltaNet recompute bench (two calls) with the walk on auto.
# Done in the seventeenth session (one H200): timing_gaps for GDN recompute at the six shapes with the reverse
#   recurrence first and with the fused prestage (prestage -1.1 % geomean: now on; the order: no change, dropped),
#   GPU tests "prestage or checkpoint or direct_launch or (test_gpu_triton_gdn and fp32_reference)" (27 passed), GDN
#   recompute bench twice (the first cold and cut at four shapes), DeltaNet recompute bench (two calls).
# Done in the sixteenth session (one H200): checkpoint_timing (GDN gate, L 4-64; KDA gate at auto), timing_gaps for
#   GDN recompute with the checkpoints off / auto, the GPU tests "checkpoint", GDN fp32-reference / packed / direct
#   launch and KDA "saturated or state_launch or launch_configs" (57 + 7 passed), GDN recompute bench twice (1.36x on
#   the quiet run).
# Done in the fifteenth session (one H200): the GPU tests of the two second-stream candidates (7 passed),
#   timing_gaps with a gpu column at five shapes without, with one and with both (no shape faster by more than
#   0.5 %, three 1-5 % slower: removed), DeltaNet recompute bench at the shipped defaults (1.28x as run, 1.26x on
#   fastest rounds), GDN full bench with dX from dY (1.77x / 1.69x).
# Done in the fourteenth session (one H200): the GPU tests of the fused prestage and of dX from dY (20 + 10 passed),
#   timing_gaps --per-kernel for GDN recompute with dX from dY and with both (local kernel 0.506 -> 0.459 ms at
#   (2,8192,16); the prestage 0.13 ms against 0.15 ms for FLA's two stages, but bwd_dhu up to 0.02 ms slower after it),
#   the local kernel's full sweep (shipped config 0.466 ms, best 0.460), GDN recompute benches (1.39x as run,
#   1.33x on fastest rounds; with the prestage 1.34x), DeltaNet recompute with both (1.29x).
# Done in the thirteenth session (one H200): TESTS_K="direct_launch or fp32_reference" (16 passed), timing_gaps for
#   GDN recompute with the direct launch off and on (host 1.12 -> 0.75 ms per backward at (8,2048,16)),
#   bench-gdn:gdn and bench-gdn:delta_rule at the six shapes with it (GDN 1.38x / 1.64x, DeltaNet 1.29x / 1.67x),
#   and GDN recompute again (BENCH_POLICY=recompute, 1.36x).
# Done in the twelfth session (one H200): timing_gaps --host-profile for GDN and DeltaNet at (8,2048,16) (about
#   0.12 ms of host time per Triton launch on both sides), the A/B of the GDN local kernel's lean end phase
#   (0.506 vs 0.594 ms) and of a split into value and key kernels (no faster, dropped), DeltaNet's precision with
#   it, bench-gdn:gdn at the six shapes, TESTS_K="triton_gdn or gdn-local" (14 + 10 passed once key blocks were 64 wide).
# Done in the eleventh session (one H200): TESTS_K=state_launch (14 passed), timing_gaps --state-widths at the six
#   shapes (BV 16 fastest only at (1,16384,16)), the A/B of a fused local-dv walk (slower, dropped), KDA full bench
#   at (1,16384,16) with BV 16 (1.94x).
# Done in the tenth session (one H200): the KDA / GDN2 bench at all six shapes with the lower-bound gate check
#   (bench-kda:kda and bench-kda:gdn2 with SHAPES_KDA set to the H = 16 shapes, then (4,4096,32), then
#   (1,32768,32)), TESTS_K=saturated (4 passed) and TESTS_K="triton_kda or launch_configs" (25 passed).
# Done in the ninth session: the six-shape bench of all four ops with per-shape autotune picks (three pair calls:
#   bench-kda:kda / bench-kda:gdn2 with SHAPES_KDA set to the H = 16 shapes, then the H = 32 shapes; then
#   bench-gdn:delta_rule / bench-gdn:gdn; 333, 263 and 480 s), and timing_gaps.py for GDN / DeltaNet recompute.
# Done in the eighth session: all 46 GPU tests (per-config tests included), the tf32x3 scan's timing, the
# per-kernel profile on the launch order, FLA's bwd_dhu per config (timing_gaps.py --dhu-configs).
# The Matrix Intra register caps and 32-channel configs were timed in the seventh session: all slower.
# Per-kernel A/B of a kernel change: put the old kernel files in an untracked folder and run
#   T_configs=100 CONFIG_ARGS="--pick 0 --repeat 2 --baseline baseline" bash tools/h200_next.sh "configs:kda-wy,kda-intra"
# Each mode's time limit is T_<mode> seconds when set (e.g. T_bench_gdn=400). The benches take OPS_GDN / OPS_KDA
# and SHAPES_GDN / SHAPES_KDA (e.g. SHAPES_KDA=1,32768,32 to finish a run cut short; combine the JSON files with
# rewy-hf bench --from-json), kda-profile takes KDA_SECTIONS (profile, extras or both), tests TESTS_K (a pytest -k expression).
source tools/h200_env.sh
O=${OUT:-gpu_out}; mkdir -p $O
lim() { local v="T_${1//-/_}"; echo "${!v:-$2}"; }

one() {
case "$1" in
tests)
  # --timeout: one slow or stuck test fails alone and prints where it was, instead of the whole run being killed
  # appends, so that runs in one queue under different env: settings share the log (each under its own header)
  echo "== pytest -k '${TESTS_K:-}' (set: $(env | grep '^REWY' | sort | tr '\n' ' '))" >> $O/gpu_tests.log
  (cd tests && timeout $(lim tests 400) python3 -m pytest -v -p no:cacheprovider -m gpu --timeout 150 ${TESTS_K:+-k "$TESTS_K"} \
      test_gpu_triton_gdn.py test_gpu_state_scan.py test_gpu_triton_kda.py test_gpu_torch_backend.py \
      test_gpu_launch_configs.py test_gpu_state_launch.py \
      test_bench_command.py >> $O/gpu_tests.log 2>&1)
  tail -n 30 $O/gpu_tests.log ;;
stages)
  timeout $(lim stages 120) python3 benchmarks/gdn_bwd_stages.py --B 2 --T 8192 --H 16 > $O/stages_2_8192.log 2>&1
  timeout $(lim stages 120) python3 benchmarks/gdn_bwd_stages.py --B 1 --T 16384 --H 16 > $O/stages_1_16384.log 2>&1
  tail -n 14 $O/stages_*.log ;;
verify)
  (cd /tmp && /usr/bin/time -f "verify wall %e s" timeout $(lim verify 200) python3 -m rewy_hf verify --device cuda \
      --json $O/verify.json > $O/verify.log 2>&1; echo "exit $?" >> $O/verify.log)
  tail -n 30 $O/verify.log ;;
bench-gdn|bench-kda|bench-gdn:*|bench-kda:*)
  # bench-kda:gdn2 (ops after the colon, comma-separated) writes bench-kda-gdn2.{json,md,log}: one op per GPU
  ops=${1#*:}; [ "$ops" = "$1" ] && ops=""; ops=${ops//,/ }; name=${1//:/-}; name=${name//,/-}
  if [[ $1 == bench-gdn* ]]; then set -- $name "${ops:-${OPS_GDN:-delta_rule gdn}}" "${SHAPES_GDN:-suite}" bench-gdn
  else set -- $name "${ops:-${OPS_KDA:-kda gdn2}}" "${SHAPES_KDA:-suite}" bench-kda; fi
  if [ -f $O/kda_choice.env ]; then source $O/kda_choice.env; fi
  # cd /tmp: the repo's rewy_hf/ (without kernels/) must not shadow the assembled package
  (cd /tmp && timeout $(lim $4 520) python3 -m rewy_hf bench --device cuda --op $2 --lift-gdn-guard \
      --shapes $3 --policy ${BENCH_POLICY:-both} --boundary both --backend triton --json $O/$1.json --markdown $O/$1.md > $O/$1.log 2>&1)
  tail -n 45 $O/$1.log ;;
configs|configs:*)
  # configs:k1,k2 (kernels of benchmarks/kernel_configs.py; plain "configs": both Matrix Intra kernels);
  # CONFIG_ARGS go to the script (e.g. "--repeat 3")
  kernels=kda-intra,gdn2-intra; [ "$1" != configs ] && kernels=${1#configs:}
  for kn in ${kernels//,/ }; do
    timeout $(lim configs 300) python3 benchmarks/kernel_configs.py --kernel $kn --budget $(( $(lim configs 300) - 30 )) $CONFIG_ARGS \
        >> $O/kernel_configs${CUDA_VISIBLE_DEVICES}.log 2>&1
  done
  tail -n 60 $O/kernel_configs${CUDA_VISIBLE_DEVICES}.log ;;
scan)
  # benchmarks/state_scan_timing.py: the sequence-parallel recurrences against FLA's sequential ones (SCAN_ARGS)
  timeout $(lim scan 300) python3 benchmarks/state_scan_timing.py $SCAN_ARGS > $O/state_scan.log 2>&1
  tail -n 60 $O/state_scan.log ;;
ckpt)
  # benchmarks/checkpoint_timing.py (CKPT_ARGS): the recompute policy's state rebuild from checkpoints vs sequential
  timeout $(lim ckpt 200) python3 benchmarks/checkpoint_timing.py $CKPT_ARGS >> $O/checkpoints.log 2>&1
  tail -n 40 $O/checkpoints.log ;;
gaps)
  # benchmarks/timing_gaps.py (GAP_ARGS): the bench's backward time against chained runs, host time, the GPU's own
  # time and kernel sum
  # appends, so that runs in one queue under different env: settings share the log (each under its own header)
  echo "== timing_gaps.py $GAP_ARGS (REWY_HF_STATE_BLOCK_V=${REWY_HF_STATE_BLOCK_V:-auto}; set: $(env | grep '^REWY' | sort | tr '\n' ' '))" >> $O/gaps${CUDA_VISIBLE_DEVICES}.log
  timeout $(lim gaps 200) python3 benchmarks/timing_gaps.py $GAP_ARGS >> $O/gaps${CUDA_VISIBLE_DEVICES}.log 2>&1
  tail -n 20 $O/gaps${CUDA_VISIBLE_DEVICES}.log ;;
ncu)
  # Nsight Compute on one launch of each of rewy's backward kernels at (2, 8192, 16): throughput, occupancy, stall
  # reasons. Says so and stops if ncu is not on the machine.
  NCU=$(command -v ncu || ls /usr/local/cuda*/bin/ncu 2>/dev/null | head -n 1)
  if [ -z "$NCU" ]; then echo "ncu not found on this machine" | tee $O/ncu.log; return 0; fi
  for pair in "kda-intra:rewy_kda_bwd_intra_kernel" "kda-wy:rewy_kda_bwd_wy_kernel" "gdn-local:rewy_gdn_bwd_local_kernel"; do
    timeout $(lim ncu 150) $NCU --target-processes all -k "regex:${pair#*:}" -c 1 --section SpeedOfLight \
        --section Occupancy --section LaunchStats --section WarpStateStats --section MemoryWorkloadAnalysis \
        python3 benchmarks/kernel_configs.py --kernel ${pair%%:*} --pick 0 >> $O/ncu.log 2>&1
  done
  grep -E "==PROF==|rewy_|Duration|Throughput|Occupancy|Registers|Stall|Block Limit" $O/ncu.log | head -n 80 ;;
kda-prec)
  timeout $(lim kda-prec 240) python3 benchmarks/kda_precision.py --choice $O/kda_choice.env > $O/kda_prec.log 2>&1
  tail -n 20 $O/kda_prec.log ;;
kda-profile)
  # PROFILE_ARGS: e.g. --profile-impls ours --profile-shapes 2,8192,16 1,16384,16 (FLA's cold first calls autotune
  # for minutes; "ours" alone skips its backward kernels)
  timeout $(lim kda-profile 300) python3 benchmarks/kda_gpu_check.py --sections ${KDA_SECTIONS:-profile,extras} \
      --budget $(( $(lim kda-profile 300) - 20 )) $PROFILE_ARGS > $O/kda_profile${CUDA_VISIBLE_DEVICES}.log 2>&1
  tail -n 40 $O/kda_profile${CUDA_VISIBLE_DEVICES}.log ;;
kda)
  timeout $(lim kda 540) python3 benchmarks/kda_gpu_check.py --budget $(( $(lim kda 540) - 40 )) > $O/kda.log 2>&1
  tail -n 60 $O/kda.log ;;
model-gdn2|model-qwen)
  if [ "$1" = model-gdn2 ]; then m=gdn2-1b; else m=qwen3.5-1b; fi
  (cd /tmp && timeout $(lim $1 400) python3 -m rewy_hf bench --device cuda --model $m --backend triton \
      --seq-len 4096 --batch-size 1 --lift-gdn-guard --json $O/$1.json > $O/$1.log 2>&1)
  tail -n 25 $O/$1.log ;;
model-profile)
  (cd /tmp && timeout $(lim model-profile 240) python3 $REPO/benchmarks/model_profile.py --model ${PROFILE_MODEL:-qwen3.5-1b} \
      > $O/model_profile.log 2>&1)
  tail -n 45 $O/model_profile.log ;;
gdn2-1b)
  timeout $(lim gdn2-1b 540) python3 recipes/finetune_gdn2.py --model gdn2-1b --seq-len 2048 --batch-size 4 \
      --max-steps 30 --save-every 0 --data recipes/data/corpus.txt --no-progress --log-every 5 --warmup-steps 3 \
      --backend optimized --kernels triton --output-dir /tmp/r1b_triton > $O/1b_triton.log 2>&1
  cp /tmp/r1b_triton/metrics.jsonl $O/1b_triton.metrics.jsonl
  cp /tmp/r1b_triton/dispatch_report.json $O/1b_triton.dispatch.json
  tail -n 12 $O/1b_triton.log ;;
qla-a)
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site_qla .qla/a/*.whl
  ls /tmp/site_qla ;;
qla-b)
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site_qla2 .qla/b/*.whl
  (cd /tmp && PYTHONPATH=/tmp/site_qla:/tmp/site_qla2:$PYTHONPATH timeout $(lim qla-b 540) python3 -m rewy_hf bench \
      --device cuda --op gdn --policy both --boundary both --backend triton --json $O/bench_gdn_flashqla.json \
      --markdown $O/bench_gdn_flashqla.md > $O/bench_gdn_flashqla.log 2>&1)
  tail -n 40 $O/bench_gdn_flashqla.log ;;
env:*)
  # env:NAME=VALUE sets a variable for the rest of this queue only (e.g. one GPU runs with REWY_KDA_INTRA_PRECISION=bf16);
  # a + in VALUE stands for a space (queues are split on spaces): env:CONFIG_ARGS=--B+1+--T+16384
  kv=${1#env:}; kv=${kv//+/ }; export "$kv"; echo "exported $kv" ;;
*) echo "unknown mode $1: tests|gaps|stages|verify|bench-gdn|bench-kda|kda|kda-prec|configs|ncu|kda-profile|ckpt|model-gdn2|model-qwen|model-profile|gdn2-1b|qla-a|qla-b|env:NAME=VALUE"; return 2 ;;
esac
}

queue() { for m in $1; do echo "== $m (GPU ${CUDA_VISIBLE_DEVICES:-all}, $(date +%T))"; one $m; done; }

if [ "$1" = pair ]; then
  CUDA_VISIBLE_DEVICES=0 queue "$2" > $O/queue0.txt 2>&1 &
  CUDA_VISIBLE_DEVICES=1 queue "$3" > $O/queue1.txt 2>&1 &
  wait
  cat $O/queue0.txt $O/queue1.txt
else
  queue "$*"
fi
# At most 8 files come back from one device call and the Triton cache is too large to: every log and JSON goes
# into one logs.tgz (the loose copies are removed so that it is never the one left out). An earlier run's archive in
# the same call is kept: the seventeenth session lost a test log when the second run's clean-up deleted it.
(cd $O && name=logs.tgz && n=2 && while [ -e $name ]; do name=logs-$n.tgz; n=$((n + 1)); done
 tar czf /tmp/logs.tgz --exclude='logs*.tgz' . && find . -mindepth 1 ! -name 'logs*.tgz' -delete && mv /tmp/logs.tgz $name)
# SAVE_CACHE=1: the Triton cache (compiled kernels and, with TRITON_CACHE_AUTOTUNING, autotune choices: a cold
# bench spends about 4 minutes per op on them) comes back in 15 MiB parts, when it fits beside the 15 MiB of wheels
# in a call's 64 MiB carry. Here: mkdir -p .triton-cache && cp /work/.device/N/tritoncache.part* .triton-cache/,
# then carry [".whl", ".triton-cache"]; h200_env.sh unpacks it.
# Every file of the cache travels: on a hit, Triton (3.9 at least) treats a group with a missing file as a miss,
# so leaving out the text IRs (most of the size) would need the __grp__ files rewritten too.
if [ "${SAVE_CACHE:-0}" = 1 ] && [ -d ~/.triton/cache ]; then
  tar czf /tmp/tritoncache.tgz -C ~/.triton cache
  size=$(stat -c %s /tmp/tritoncache.tgz)
  echo "Triton cache: $((size / 1048576)) MiB compressed ($(du -sh ~/.triton/cache | cut -f1) on disk)"
  if [ $size -le $((45 * 1024 * 1024)) ]; then split -b 15m -d /tmp/tritoncache.tgz $O/tritoncache.part
  else echo "too large to carry beside the wheels: not returned"; fi
fi
