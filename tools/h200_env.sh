# Source this on the lent GPU machine (see ../shared/gpu.md): installs the
# carried FLA wheels into /tmp/site, puts rewy_hf (with its kernels/ and
# adapters/ subpackages) on PYTHONPATH, and restores a carried Triton cache.
set -e
# FLA's wheels come from .whl, or from .qla/a when that is carried instead (FlashQLA runs, 64 MiB per call)
FLA_WHEELS=$(ls .whl/fla_core*.whl .whl/flash_linear*.whl 2>/dev/null || ls .qla/a/fla_core*.whl .qla/a/flash_linear*.whl)
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site $FLA_WHEELS
rm -rf /tmp/pkg && mkdir -p /tmp/pkg/rewy_hf   # a warm machine keeps /tmp: never copy into an old tree
cp -r rewy_hf/. /tmp/pkg/rewy_hf/
cp -r kernels /tmp/pkg/rewy_hf/kernels
cp -r adapters /tmp/pkg/rewy_hf/adapters
# TRITON_CACHE_AUTOTUNING keeps autotune choices in the cache too, so a carried
# cache skips FLA's first-call autotuning as well as compilation.
export PYTHONPATH=/tmp/site:/tmp/pkg PYTHONUNBUFFERED=1 REPO=$PWD TRITON_CACHE_AUTOTUNING=1
# A carried Triton cache (tools/h200_next.sh with SAVE_CACHE=1 returns it in parts)
if ls .triton-cache/tritoncache.part* > /dev/null 2>&1; then
  mkdir -p ~/.triton && cat .triton-cache/tritoncache.part* | tar xzf - -C ~/.triton
fi
set +e
