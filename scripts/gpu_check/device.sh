#!/bin/bash
# The series' GPU checks (issues 35 and 36) on the lent device machine, run from the repository root after
# the upload calls of docs/gpu-check.md: torch and Triton from the kit's parts, the series' torch/ diff on top,
# then the series' CUDA tests and profile_cuda.py (cold and warm caches, Triton and CUDA graphs).
set -u -o pipefail
export PYTHONUNBUFFERED=1 TORCH_USE_RTLD_GLOBAL=1
T0=$(date +%s); el() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
mkdir -p /tmp/parts && cp .gpu/parts/p* /tmp/parts/ && ls /tmp/parts | tr '\n' ' '; echo
(cd /tmp/parts && cat p0* | sha256sum) ; cat .gpu/parts.sha256
mkdir -p /tmp/s215 && cat /tmp/parts/p0* | xz -d -T0 | tar -x -C /tmp/s215 || exit 4
el extracted
# torch's RPATH ($ORIGIN/../../nvidia/...) then finds the machine's CUDA 13 libraries, linked here, but for nvshmem's
# host library, this torch's own (libtorch_nvshmem reads a variable older ones lack); NCCL functions newer than the
# machine's are bound lazily (TORCH_USE_RTLD_GLOBAL) and never called on one GPU.
NV=$(python3 -c "import nvidia; print(' '.join(nvidia.__path__))")
mkdir -p /tmp/s215/nvidia && for p in $NV; do for d in "$p"/*; do [ -e /tmp/s215/nvidia/$(basename $d) ] || ln -s "$d" /tmp/s215/nvidia/; done; done; ls /tmp/s215/nvidia | tr '\n' ' '; echo
rm -f /tmp/s215/nvidia/nvshmem && mkdir -p /tmp/s215/nvidia/nvshmem/lib && xz -dc .gpu/run/libnvshmem_host.so.3.xz > /tmp/s215/nvidia/nvshmem/lib/libnvshmem_host.so.3
patch -p1 -s -d /tmp/s215 < .gpu/run/series-torch.diff || exit 5
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .gpu/whl/*.whl || exit 2
export PYTHONPATH=/tmp/s215:/tmp/site
SANITY="import torch, triton; print(torch.__version__, torch.version.cuda, triton.__version__, torch.cuda.get_device_name()); x = torch.randn(64, 64, device='cuda'); print(float((x @ x).sum())); print(torch.compile(lambda a: a.sin() + 1)(x).sum().item())"
if ! python3 -c "$SANITY" 2>&1 | tail -4; then
  export TRITON_PTXAS_PATH=$(command -v ptxas || echo /usr/local/cuda/bin/ptxas); echo "retry with $TRITON_PTXAS_PATH"
  python3 -c "$SANITY" 2>&1 | tail -4 || exit 6
fi
el sanity
timeout 300 python3 .gpu/run/test_call_hierarchy.py -v -k test_cuda -k test_device_kernel 2>&1 | tee $OUT/test_0019.log | grep -E "^test_|^Ran|^OK|^FAILED|Error" | head -20
el "0019 tests"
timeout 120 python3 .gpu/run/test_rng_functionalization_meta.py -v 2>&1 | tee $OUT/test_0003.log | grep -E "^test_|^Ran|^OK|^FAILED|Error" | head -10
el "0003 test"
mkdir -p /tmp/tr
for mode in default reduce-overhead; do for run in cold warm; do
  timeout 150 python3 .gpu/run/profile_cuda.py $mode /tmp/tr/$mode-$run > /tmp/tr/$mode-$run.log 2>&1
  echo "rc=$? $mode $run"; grep -E "^model|^\{|compile and|Error" /tmp/tr/$mode-$run.log | cut -c1-900
  tar czf $OUT/$mode-$run.tgz -C /tmp/tr $mode-$run $mode-$run.log
  el "$mode $run"
done; done
# Triton GEMM templates, whose scopes 0019 narrows as C++ templates' (checked on CPU only): last, cold only
mode=max-autotune-no-cudagraphs
timeout 180 python3 .gpu/run/profile_cuda.py $mode /tmp/tr/$mode > /tmp/tr/$mode.log 2>&1
echo "rc=$? $mode cold"; grep -E "^model|^\{|compile and|Error" /tmp/tr/$mode.log | cut -c1-1400
tar czf $OUT/$mode.tgz -C /tmp/tr $mode $mode.log
el "$mode cold"
