"""flexrl_ds: load-balanced GRPO training of vision-language models.

ShadowLoader (metadata-only controller, distributed preprocessing) and FlexUlysses (per-sequence
Ulysses degrees on nested device groups) on DeepSpeed ZeRO-3 with Ray orchestration.
"""

__version__ = "0.1.0"

from flexrl_ds.common import logs as _logs
from flexrl_ds.parallel import network as _network

_logs.setup()  # console logging at FLEXRL_LOG_LEVEL (default INFO): the lines flexrl_ds prints
_network.prepare_ray_environment()  # before any import of Ray: a Ray started here binds to 127.0.0.1
