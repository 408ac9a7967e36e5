#!/usr/bin/env bash
# Every GPU check, sized for a short device lease: 775 s of stage limits in all, so on a device tool
# with a 10-minute command limit run it as two commands (465 s and 310 s of limits):
#
#   bash benchmarks/gpu_check.sh tests bench sweep
#   bash benchmarks/gpu_check.sh comfy lowvram step
#
#   tests  pytest tests/t5kernels on CUDA: SD3.5 shapes, bf16, bit-repeatability, sm_80/90 compile
#   bench  python3 -m benchmarks.bench_attention --paths sdpa,t5,triton --backward --model-step 1024 2048:
#          one call at SD3.5 Medium's 1K and 2K shapes (B=2, 333 text tokens, bf16), then the whole
#          transformer step                                          -> attention_cuda_kernels.json
#   sweep  python3 -m benchmarks.sweep_kernels (launch settings at 2K)  -> kernels_sweep_cuda.json
#   comfy  python3 -m tools.comfy_dynamic_vram: a real ComfyUI 0.33 server on CUDA (Dynamic VRAM), T5 on,
#          T5 off, a LoRA after the node, the same prompt twice; reports the T5 parameters copied
#          per call (goal: none)                                    -> comfy_dynamic_vram_cuda.json
#   lowvram python3 -m tools.comfy_lowvram: ComfyUI's partial (--lowvram) load in process, with a
#          weight budget of half the model (a tiny model never runs short on a GPU, so the budget is
#          set, not left to free memory): every T5 parameter loaded to the GPU, T5 parameters copied
#          per call (goal: none), latents equal to a full load's  -> comfy_lowvram_cuda.json
#   step   python3 -m benchmarks.bench_comfy_step, bf16: SD3.5 Medium's whole model (24 blocks, random
#          weights) in ComfyUI 0.33 through the node, one CFG step for softmax, paper, all and their
#          hybrids; whole at 1024x1024, composed from per-block times at 1024x1024 (checked against
#          the whole step) and 2048x2048                         -> comfy_step_whole_cuda.json
#
#   bash benchmarks/gpu_check.sh                 # all six, in that order
#   bash benchmarks/gpu_check.sh bench sweep     # some of them
#
# Logs and JSON go to $OUT (the device tool's folder; else benchmarks/results/gpu_check). Each stage
# has its own time limit, so a slow one cannot eat the next; the exit status is 1 if any failed.
#
# The model step needs diffusers, which the H200 image lacks. Carry its wheel (pure Python; the
# image has its dependencies), downloaded beforehand on any machine with pip:
#   echo /.whl/ >> .git/info/exclude
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#       --platform manylinux2014_x86_64 -d .whl diffusers==0.42.1
# and run with carry [".whl"]. Without it the bench stage fails at the model step, after its
# attention table.
#
# The comfy, lowvram and step stages run the ComfyUI tree in $COMFYUI_TREE (default .comfyui/0.33.0, a copy of this
# machine's ~/comfy/0.33.0, README.md 'Tests': `mkdir -p .comfyui && cp -r ~/comfy/0.33.0 .comfyui/`,
# with `echo /.comfyui/ >> .git/info/exclude`; 31 MB) and needs ComfyUI 0.33.0's requirements that the
# device image lacks, as wheels in .whl (the same pip download, one NAME==VERSION each; at least
# comfyui-frontend-package, comfy-aimdo, comfy-kitchen, aiohttp and its deps, torchsde, einops,
# av, alembic, SQLAlchemy, simpleeval, blake3: compare with the image's pip list in the device
# tool's KINDS.md). Carry [".whl", ".comfyui"]. Not yet tried on a device: no GPU was lent so far.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-benchmarks/results/gpu_check}
mkdir -p "$out"
log=$out/gpu_check.log
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/t5-triton-cache}
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/t5-site .whl/*.whl \
        && export PYTHONPATH=$PYTHONPATH:/tmp/t5-site
fi
{
    date -u
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv
    python3 -c "import torch, triton; print('torch', torch.__version__, '| triton', triton.__version__)"
    git log -1 --format='commit %h %s' 2>/dev/null
} 2>&1 | tee "$log"

failed=0
stage() {  # stage NAME LIMIT_S COMMAND...
    local name=$1 limit=$2 start=$SECONDS rc
    shift 2
    echo "== $name (limit ${limit} s): $*" | tee -a "$log"
    timeout "$limit" "$@" 2>&1 | tee "$out/$name.log"
    rc=${PIPESTATUS[0]}
    echo "== $name: exit $rc after $((SECONDS - start)) s" | tee -a "$log"
    [ "$rc" -eq 0 ] || failed=1
}

for name in "${@:-tests bench sweep comfy lowvram step}"; do
    for one in $name; do
        case $one in
            tests) stage tests 230 python3 -m pytest tests/t5kernels -q -n 12 -p no:cacheprovider ;;
            bench) stage bench 150 python3 -m benchmarks.bench_attention --paths sdpa,t5,triton --backward \
                       --grids 64x64 128x128 --batch 2 --text 333 --rounds 10 --model-step 1024 2048 \
                       --suffix _kernels --results-dir "$out" ;;
            sweep) stage sweep 85 python3 -m benchmarks.sweep_kernels --budget-s 60 --results-dir "$out" ;;
            comfy) stage comfy 75 python3 -m tools.comfy_dynamic_vram --comfyui "${COMFYUI_TREE:-.comfyui/0.33.0}" \
                       --results-dir "$out" ;;
            lowvram) stage lowvram 35 python3 -m tools.comfy_lowvram --comfyui "${COMFYUI_TREE:-.comfyui/0.33.0}" \
                       --results-dir "$out" ;;
            step) stage step 200 python3 -m benchmarks.bench_comfy_step --device cuda --dtype bf16 --sizes 1024 \
                       --compose 1024 2048 --warmup 2 --reps 5 --block-reps 3 \
                       --comfyui "${COMFYUI_TREE:-.comfyui/0.33.0}" --results-dir "$out" ;;
            *) echo "unknown stage '$one' (tests, bench, sweep, comfy, lowvram, step)" | tee -a "$log"; exit 2 ;;
        esac
    done
done
exit "$failed"
