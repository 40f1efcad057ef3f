# Sourced by the GPU-machine runners: NCCL settings of that machine, DeepSpeed/Ray from .whl/ when
# present (bash ../shared/device/fetch-wheels.sh), PYTHONPATH, and the versions found.
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
if ls .whl/deepspeed-*.tar.gz >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl \
    && mkdir -p /tmp/ds && tar xzf .whl/deepspeed-*.tar.gz -C /tmp/ds \
    && (cd /tmp/ds/deepspeed-* && DS_BUILD_OPS=0 python3 -m pip install -q --no-deps --no-build-isolation \
        --no-index --target /tmp/site .)
fi
export PYTHONPATH=/tmp/site:$PWD
nvidia-smi -L
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
python3 -c "import deepspeed; print('deepspeed', deepspeed.__version__)" 2>&1 | tail -1
