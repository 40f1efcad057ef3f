"""flexrl_ds: load-balanced GRPO training of vision-language models.

ShadowLoader (metadata-only controller, distributed preprocessing) and FlexUlysses (per-sequence
Ulysses degrees on nested device groups) on DeepSpeed ZeRO-3 with Ray orchestration.
"""

__version__ = "0.1.0"

from flexrl_ds.common import logs as _logs

_logs.setup()  # console logging at FLEXRL_LOG_LEVEL (default INFO): the lines flexrl_ds prints
