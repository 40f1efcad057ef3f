# Sourced by the GPU-machine runners: NCCL settings of that machine, DeepSpeed/Ray from .whl/ (or from
# /tmp/whl, where a previous call of the same batch copied them) when present (bash
# ../shared/device/fetch-wheels.sh), vLLM's settings there, PYTHONPATH, and the versions found.
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export VLLM_USE_FLASHINFER_SAMPLER=0  # flashinfer is not carried there; vLLM's own sampler is used
wheels=.whl
ls "$wheels"/deepspeed-*.tar.gz >/dev/null 2>&1 || wheels=/tmp/whl
if [ ! -d /tmp/site/deepspeed ] && ls "$wheels"/deepspeed-*.tar.gz >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site "$wheels"/*.whl \
    && mkdir -p /tmp/ds && tar xzf "$wheels"/deepspeed-*.tar.gz -C /tmp/ds \
    && (cd /tmp/ds/deepspeed-* && DS_BUILD_OPS=0 python3 -m pip install -q --no-deps --no-build-isolation \
        --no-index --target /tmp/site .)
fi
export PYTHONPATH=/tmp/site:$PWD
nvidia-smi -L
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
python3 -c "import deepspeed; print('deepspeed', deepspeed.__version__)" 2>&1 | tail -1 || true
python3 -c "import vllm; print('vllm', vllm.__version__)" 2>&1 | tail -1 || true
