"""The ShadowLoader's runtime settings, read from the run config's `flexrl.data` section.

`loader_settings(data_config)` is the one place that turns `DataConfig` (the DeepSpeed JSON's
`flexrl.data`, see ds_configs/) into the configs the loader classes take:

- `proxy_loader.LoaderConfig` from `flexrl.data.loader` plus `flexrl.data.bad_record_policy`
  (the same policy setting the offline tools read), and
- `actors.PoolConfig` from `flexrl.data.pool`, with `groups_per_chunk` from
  `flexrl.data.loader.groups_per_chunk` (one key drives the slice size on both sides).

Usage::

    run = load_run_config("ds_configs/zero3_flexrl.json")
    loader_config, pool_config = loader_settings(run.flexrl.data)
    pool = PreprocessPool(functools.partial(SamplePreprocessor, run.flexrl.data), pool_config)
    loader = ProxyLoader(records, pool, loader_config)
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from flexrl_ds.media.config import DataConfig

if TYPE_CHECKING:
    from flexrl_ds.loader.actors import PoolConfig
    from flexrl_ds.loader.proxy_loader import LoaderConfig


def loader_settings(data_config: DataConfig) -> tuple[LoaderConfig, PoolConfig]:
    """(LoaderConfig, PoolConfig) for a ProxyLoader and its PreprocessPool (or a CentralLoader)."""
    from flexrl_ds.loader.actors import PoolConfig
    from flexrl_ds.loader.proxy_loader import LoaderConfig

    if not isinstance(data_config, DataConfig):
        raise ValueError(f"loader_settings: expected a DataConfig (flexrl.data), got {type(data_config).__name__}")
    loader, pool = data_config.loader, data_config.pool
    loader_config = LoaderConfig(
        global_batch=loader.global_batch, num_samples_per_prompt=loader.num_samples_per_prompt,
        seed=loader.seed, shuffle=loader.shuffle, bad_record_policy=data_config.bad_record_policy,
        lookahead_steps=loader.lookahead_steps, groups_per_chunk=loader.groups_per_chunk,
    )
    pool_config = PoolConfig(
        num_actors_per_node=pool.num_actors_per_node, num_cpus_per_actor=pool.num_cpus_per_actor,
        groups_per_chunk=loader.groups_per_chunk, probe_chunk_size=pool.probe_chunk_size,
        timeout_s=pool.timeout_s,
    )
    return loader_config, pool_config
