#!/bin/bash
# GPU check of patch 0003's CUDA branch (graphsafe RNG functionalization), run from the repo root.
set -u
export PYTHONUNBUFFERED=1
nvidia-smi -L
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .gpu/whl/*.whl && export PYTHONPATH=/tmp/site || exit 2
python3 -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__, torch.cuda.get_device_name())"
SITE=$(python3 -c "import torch, os; print(os.path.dirname(os.path.dirname(torch.__file__)))")
echo "== without 0003 (the graphsafe test must fail)"
python3 .gpu/test_rng_functionalization_meta.py -v 2>&1 | tee $OUT/without.log | tail -25
echo "== with 0003's torch/ change"
patch -p1 -d "$SITE" < .gpu/0003-torch.diff || exit 3
python3 .gpu/test_rng_functionalization_meta.py -v 2>&1 | tee $OUT/with.log | tail -25
