#!/usr/bin/env bash
# Download TRL 1.16.0 and the py3.12 x86-64 wheels it needs that the GPU machine lacks (accelerate, datasets
# with pyarrow, pandas and their small dependencies; torch, transformers, numpy, huggingface_hub, requests,
# httpx, fsspec, aiohttp, psutil, pyyaml, jinja2 are there) into .trl/ (git-ignored), with .trl/install.sh,
# for `flexrl bench trl-peer` (flexrl_ds/bench/trl_peer.py). About 56 MiB: .trl alone fits one `run` call
# (64 MiB with the working tree). TRL 1.16's GRPOTrainer imports `datasets` (and so pyarrow, 43 MB) and
# pandas at its top and takes only a `datasets.Dataset`: they cannot be left out.
# Usage: bash scripts/fetch-trl-wheels.sh   (from the project root; prints the lines for the device calls)
set -euo pipefail
root=$(git rev-parse --show-toplevel)
cd "$root"
rm -rf .trl && mkdir -p .trl/wheels
bin="--only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64"
# Versions: TRL's floor or what pairs with it (datasets 4.7 takes dill < 0.4.1, multiprocess < 0.70.19).
python3 -m pip download -q --no-deps $bin -d .trl/wheels trl==1.16.0 accelerate==1.16.0 datasets==4.7.0 \
  pyarrow==21.0.0 pandas==2.3.3 dill==0.4.0 multiprocess==0.70.18 xxhash==4.1.0 python-dateutil==2.9.0.post0 \
  pytz==2026.6 tzdata==2026.6 six==1.17.0
cat > .trl/install.sh <<'SH'
#!/usr/bin/env bash
# On the GPU machine: install the carried wheels (folder $1, default this script's wheels/) whose
# distribution is not installed yet, without dependencies and without touching what is there, then import TRL.
set -euo pipefail
wheels=${1:-$(cd "$(dirname "$0")" && pwd)/wheels}
missing=()
for wheel in "$wheels"/*.whl; do
  name=$(basename "$wheel" | cut -d- -f1)
  python3 -c "import importlib.metadata as m, sys; m.version(sys.argv[1])" "$name" 2>/dev/null || missing+=("$wheel")
done
[ ${#missing[@]} -eq 0 ] || python3 -m pip install -q --no-index --no-deps --no-compile "${missing[@]}" 2>&1 \
  | grep -v '^WARNING' || true
python3 -c "import trl, datasets, accelerate, pandas, pyarrow; print('trl', trl.__version__, 'datasets', \
datasets.__version__, 'accelerate', accelerate.__version__, 'pandas', pandas.__version__, 'pyarrow', pyarrow.__version__)"
SH
chmod +x .trl/install.sh
du -sh .trl
cat <<'LINE'
# On the GPU machine (device tool, carry .trl; with .whl too only if it fits, else copy it in a call before):
bash .trl/install.sh && PEER=trl bash tests/gpu/run_trainer_on_gpu_machine.sh
# With vLLM (TRL's colocate mode), in ONE batch of calls: carry .vllm/p0, .vllm/p1 as usual; then
#   carry .trl:      mkdir -p /tmp/trlw && cp .trl/wheels/* .trl/install.sh /tmp/trlw/
#   carry .vllm/p2:  bash .vllm/p2/install.sh && bash /tmp/trlw/install.sh /tmp/trlw && PEER=trl BACKEND=vllm bash tests/gpu/run_trainer_on_gpu_machine.sh
LINE
