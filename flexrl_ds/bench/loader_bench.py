"""`flexrl bench loader`: centralised (veRL-style) loading vs ShadowLoader on real media.

Setup per run (one mode, one global batch B, one actor count K), each in its own controller
process connected to one shared local Ray cluster, so that the controller's memory is measured
alone and from a clean start:
- W workers (`BenchWorker`, one per rank of a `runtime/worker_group.RayWorkerGroup`) stand in for
  training ranks. Each holds a `Materializer`; a step is "wait for my data, then simulate
  `compute_ms` of compute". The B*n samples of a step are dealt round-robin to the workers by
  (slot, k) (`loader/destinations.RankDealing`); a worker requests every media item of the prompts
  it holds. The dealing is fixed before decoding, so the shadow loader decodes each prompt near its
  workers' node(s) (`routing.route_near`); bytes pulled across nodes are reported.
- centralised: the controller probes and decodes every prompt itself (`CentralLoader`) right
  before the step, and ships the pixel tensors to the workers inside their assignments.
- shadow: the controller probes metadata on K preprocessing actors and dispatches decode tasks
  one step ahead (`ProxyLoader`); workers prefetch the next step's slices from the actors'
  object stores while the current step computes.

Measured per step (after `warmup_steps`): exposed data time = step wall time - compute_ms (what
the training loop waits for data, including Ray call latency), split into phases along the worker
that finished last (`step_phases`: the loader's next_step, sending prefetches, the step call
reaching the worker, its wait in `Materializer.get`, compute overrun, the result coming back), the
Materializer's background pull/cut times and how early the data was ready, bytes through the
controller (serialized data the controller sent/received, object refs counted as their ids),
controller peak RSS and the summed RSS of controller + actors + workers (sampled every 20 ms with
psutil), and samples/s. Stamps across processes use `time.time()`: one host's clock.
"""

from __future__ import annotations

import functools
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import psutil
import ray

from flexrl_ds.bench.loader_bench_config import LoaderBenchConfig, RunResult, run_settings
from flexrl_ds.loader.actors import PreprocessPool
from flexrl_ds.loader.central_loader import CentralLoader
from flexrl_ds.loader.config import DataConfig, LoaderConfig, PoolConfig
from flexrl_ds.loader.destinations import RankDealing
from flexrl_ds.loader.materializer import Materializer, RayFetcher, WorkerAssignment
from flexrl_ds.loader.proxy_loader import LoaderStats, LoaderStep, ProxyLoader, requests_for_samples
from flexrl_ds.media.preprocess import SamplePreprocessor
from flexrl_ds.media.records import read_dataset
from flexrl_ds.runtime.ray_session import connect_ray, gcs_address, join_ray
from flexrl_ds.runtime.worker_group import RayWorkerGroup, WorkerPlace

EXPOSED_PHASES = ("next_step", "send", "call", "wait", "overrun", "return", "other")
"""Parts of the exposed data time, in loop order (see `step_phases`); they sum to it exactly."""


def step_phases(compute_ms: float, stamps: tuple[float, float, float, float], outs: list[dict],
                wall_s: float) -> dict[str, float]:
    """Split one step's exposed time (wall - compute) along the worker that returned last.

    `stamps` = controller wall-clock times (step begin, next_step returned, prefetches sent,
    results back). next_step: the loader's call; send: building assignments and sending the
    prefetches; call: from sending the step call to the worker entering it (Ray dispatch, the call
    queued behind the prefetch — for the centralised path, unpickling the shipped pixels —, GIL
    and CPU contention); wait: the worker's wait for its data; overrun: compute that took longer
    than asked (a sleep woken late by contention); return: result back to the controller; other:
    the loop's own remainder (release, bookkeeping). Also, over workers: worst `ready_margin`
    (ms the data was ready before the step needed it; negative: late) and most background
    `pull`/`cut`/`task_wait` time (Materializer threads, overlapping compute)."""
    begin_at, loaded_at, sent_at, results_at = stamps
    last = max(outs, key=lambda out: out["compute_end_at"])
    ms = {
        "next_step": loaded_at - begin_at, "send": sent_at - loaded_at, "call": last["entered_at"] - sent_at,
        "wait": last["data_ready_at"] - last["entered_at"],
        "overrun": last["compute_end_at"] - last["data_ready_at"] - compute_ms / 1e3,
        "return": results_at - last["compute_end_at"],
    }
    ms = {name: 1e3 * value for name, value in ms.items()}
    ms["other"] = wall_s * 1e3 - compute_ms - sum(ms.values())
    ms["exposed"] = wall_s * 1e3 - compute_ms
    if all("ready_at" in out for out in outs):
        ms["ready_margin"] = 1e3 * min(out["entered_at"] - out["ready_at"] for out in outs)
        for name in ("task_wait", "pull", "cut"):
            ms[name] = 1e3 * max(out[f"{name}_s"] for out in outs)
    return ms


class _RssSampler:
    """Peak RSS of this process and of the sum over `pids`, sampled in a thread."""

    def __init__(self, interval_s: float = 0.02):
        self.interval_s = interval_s
        self.me = psutil.Process()
        self.start_rss = self.peak_self = self.me.memory_info().rss
        self.peak_total = self.peak_self
        self.pids: list[int] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            own = self.me.memory_info().rss
            total = own
            for pid in self.pids:
                try:
                    total += psutil.Process(pid).memory_info().rss
                except psutil.Error:
                    pass
            self.peak_self, self.peak_total = max(self.peak_self, own), max(self.peak_total, total)

    def __enter__(self) -> _RssSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


class BenchWorker:
    """A training rank's data side: prefetch, then wait + simulated compute per step. One per rank
    of a `RayWorkerGroup` (runtime/worker_group.py)."""

    def __init__(self, place: WorkerPlace, bad_record_policy: str, timeout_s: float):
        self.place = place
        self.materializer = Materializer(RayFetcher(timeout_s=timeout_s), bad_record_policy=bad_record_policy)

    def prefetch(self, assignment) -> None:
        self.materializer.prefetch(assignment)

    def run_step(self, step: int, compute_ms: float) -> dict[str, float]:
        """Wall-clock stamps (`time.time()`, comparable across processes of one host) of method
        entry, data ready and compute end, plus the Materializer's background timings."""
        entered_at = time.time()
        out = self.materializer.get(step)
        data_ready_at = time.time()
        time.sleep(compute_ms / 1000.0)
        return {"wait_s": out.wait_s, "bytes": out.bytes_fetched, "cross_bytes": out.bytes_cross_node,
                "withdrawn": len(out.withdrawn),
                "entered_at": entered_at, "data_ready_at": data_ready_at, "compute_end_at": time.time(),
                **out.timing}

    def pid(self) -> int:
        return os.getpid()


WORKER_CPUS = 0.01
"""Ray CPUs reserved per bench worker (they only wait and sleep)."""


class _NoDataLoader:
    """Steps without prompts: measures the bench loop's own overhead."""

    def __init__(self):
        self.stats, self._index = LoaderStats(), 0

    def next_step(self):
        self._index += 1
        return LoaderStep(self._index - 1, 0, [], 1)

    def assignment(self, step, requests):
        return WorkerAssignment(step.step, (), {})

    def release(self, step) -> None:
        pass


def _build_loader(mode: str, records: list, data_config: DataConfig, loader_config: LoaderConfig,
                  pool_config: PoolConfig, dealing: Any = None):
    """(loader, preprocessing pool or None) of one run."""
    make_preprocessor = functools.partial(SamplePreprocessor, data_config)
    if mode == "none":
        return _NoDataLoader(), None
    if mode == "central":
        return CentralLoader(records, make_preprocessor, loader_config, data_config.bad_record_policy), None
    pool = PreprocessPool(make_preprocessor, pool_config)
    pool.wait_ready()
    return ProxyLoader(records, pool, loader_config, data_config.bad_record_policy, destinations=dealing), pool


@dataclass
class _Measured:
    """What the measured steps of one run recorded (see `_run_steps`)."""

    walls: list[float] = field(default_factory=list)
    waits: list[float] = field(default_factory=list)
    phases: list[dict[str, float]] = field(default_factory=list)
    asked: list[tuple[int, float]] = field(default_factory=list)
    """(step asked for by `next_step`, wall-clock time asked), per measured step."""
    pixel_bytes: int = 0
    cross_bytes: int = 0
    num_withdrawn: int = 0
    loader_s: float = 0.0
    """Controller time inside `next_step` over the measured steps."""
    elapsed_s: float = 0.0


def _send(loader: Any, workers: Any, step: Any, dealing: Any) -> None:
    """Deal the step's samples to the workers (`dealing.shares`) and start their prefetch."""
    shares = dealing.shares(step.sample_ids())
    workers.run_each_async(BenchWorker.prefetch, [(loader.assignment(step, requests_for_samples(step, share)),)
                                        for share in shares])


def _run_steps(label: str, config: LoaderBenchConfig, loader: Any, workers: Any, rss: _RssSampler,
               dealing: Any) -> _Measured:
    """The bench loop: warm-up then measured steps, each loading the next one (the steady state
    of a long run, the last step included), sampling RSS throughout."""
    total, measured = config.warmup_steps + config.steps, _Measured()
    step = loader.next_step()
    _send(loader, workers, step, dealing)
    with rss:
        for index in range(total):
            if index == config.warmup_steps:
                loader_s_start, started = loader.stats.loader_s, time.perf_counter()
            begin, begin_at = time.perf_counter(), time.time()
            upcoming = loader.next_step()
            loaded_at = time.time()
            _send(loader, workers, upcoming, dealing)
            sent_at = time.time()
            outs = ray.get(workers.run_async(BenchWorker.run_step, step.step, config.compute_ms))
            results_at = time.time()
            loader.release(step)
            measured.pixel_bytes += sum(out["bytes"] for out in outs)
            measured.cross_bytes += sum(out["cross_bytes"] for out in outs)
            measured.num_withdrawn += sum(out["withdrawn"] for out in outs)
            wall = time.perf_counter() - begin
            if index >= config.warmup_steps:
                measured.walls.append(wall)
                measured.waits.append(max(out["wait_s"] for out in outs))
                stamps = (begin_at, loaded_at, sent_at, results_at)
                measured.phases.append(step_phases(config.compute_ms, stamps, outs, wall))
                measured.asked.append((upcoming.step, begin_at))
            print(f"  {label}: step {index + 1}/{total} {wall * 1e3:.0f} ms", file=sys.stderr, flush=True)
            step = upcoming
        measured.elapsed_s = time.perf_counter() - started
    measured.loader_s = loader.stats.loader_s - loader_s_start
    return measured


def _run_result(mode: str, config: LoaderBenchConfig, loader_config: Any, num_actors: int, loader: Any,
                measured: _Measured, rss: _RssSampler) -> RunResult:
    total, phases = config.warmup_steps + config.steps, measured.phases
    exposed = [max(0.0, wall * 1e3 - config.compute_ms) for wall in measured.walls]
    return RunResult(
        mode=mode, global_batch=loader_config.global_batch, actors=num_actors if mode == "shadow" else 0,
        steps=config.steps, compute_ms=config.compute_ms, exposed_ms=statistics.mean(exposed),
        exposed_ms_max=max(exposed), worker_wait_ms=1e3 * statistics.mean(measured.waits),
        controller_loader_ms=1e3 * measured.loader_s / config.steps,
        # bytes: over all steps loaded (warm-up and the one extra included); the shadow loader's
        # count also holds one more look-ahead step's probe and dispatch, so it over-counts a little
        controller_bytes_per_step=loader.stats.bytes_through_controller / (total + 1),
        pixel_bytes_per_step=measured.pixel_bytes / total, cross_node_bytes_per_step=measured.cross_bytes / total,
        controller_rss_start_mb=rss.start_rss / 2**20, controller_rss_peak_mb=rss.peak_self / 2**20,
        total_rss_peak_mb=rss.peak_total / 2**20,
        samples_per_s=loader_config.global_batch * loader_config.num_samples_per_prompt * config.steps
        / measured.elapsed_s,
        num_bad=loader.stats.num_bad, num_withdrawn=measured.num_withdrawn,
        compose_ms=1e3 * loader.stats.compose_s / (total + 1), step_ms=[1e3 * wall for wall in measured.walls],
        phases_ms={name: statistics.mean(p[name] for p in phases if name in p) for name in dict.fromkeys(
            name for p in phases for name in p)}, step_phases_ms=phases,
    )


def run_one(mode: str, config: LoaderBenchConfig, batch: int, num_actors: int) -> RunResult:
    """One measured run in this (controller) process; Ray must already be initialised."""
    rss = _RssSampler()  # baseline: this process before it holds any data
    data_config = config.data_config()
    loader_config, pool_config = run_settings(data_config, batch, num_actors)
    records = read_dataset(config.data)
    workers = RayWorkerGroup(BenchWorker, config.num_workers, {"bad_record_policy": data_config.bad_record_policy,
                                                               "timeout_s": pool_config.timeout_s},
                             num_cpus_per_rank=WORKER_CPUS, name="bench workers", timeout_s=pool_config.timeout_s)
    dealing = RankDealing(tuple(workers.node_ids), loader_config.num_samples_per_prompt)
    loader, pool = _build_loader(mode, records, data_config, loader_config, pool_config, dealing)
    rss.pids = workers.run(BenchWorker.pid) + ([s["pid"] for s in pool.stats()] if pool else [])
    label = f"{mode} B={batch} K={num_actors}"
    measured = _run_steps(label, config, loader, workers, rss, dealing)
    if pool is not None:
        add_decode_timings(measured.phases, measured.asked, pool.decode_log())
    result = _run_result(mode, config, loader_config, num_actors, loader, measured, rss)
    if hasattr(loader, "close"):
        loader.close()
    if pool is not None:
        pool.shutdown()
    workers.shutdown()
    return result


def add_decode_timings(phases: list[dict[str, float]], asked: list[tuple[int, float]],
                       decode_log: dict[Any, tuple[float, float]]) -> None:
    """Add to each step's phases, from the actors' decode log (ShadowLoader): `decode_late` = ms
    from the loop asking for the *next* step (`next_step`, which waits for that step's decodes) to
    its last decode finishing (negative: finished early, hidden), and `decode_busy` = actor ms spent
    decoding that step's prompts (summed over actors)."""
    for step_phase, (step, asked_at) in zip(phases, asked):
        times = [times for key, times in decode_log.items() if key.step == step]
        if times:
            step_phase["decode_late"] = 1e3 * (max(end for _, end in times) - asked_at)
            step_phase["decode_busy"] = 1e3 * sum(end - start for start, end in times)


def _child_main(spec_json: str) -> int:
    spec = json.loads(spec_json)
    config = LoaderBenchConfig(**spec["config"])
    join_ray(spec["address"])
    result = run_one(spec["mode"], config, spec["batch"], spec["actors"])
    print("RESULT " + json.dumps(asdict(result)), flush=True)
    return 0


def run_bench(config: LoaderBenchConfig) -> list[RunResult]:
    """Start a local Ray cluster (or join RAY_ADDRESS's), then one controller process per (mode, B, K)."""
    runs = [("none", config.global_batches[0], 0)]
    runs += [("central", batch, 0) for batch in config.global_batches]
    runs += [("shadow", batch, k) for batch in config.global_batches for k in config.actors]
    runs = [run for run in runs if run[0] in config.modes]
    data = config.data_config()
    print(f"bench loader: flexrl.data from {config.run_config or 'defaults'}: policy {data.bad_record_policy}, "
          f"n={data.loader.num_samples_per_prompt}, seed {data.loader.seed}, shuffle {data.loader.shuffle}, "
          f"look-ahead {data.loader.lookahead_steps}, {data.loader.groups_per_chunk} groups/slice, "
          f"{data.pool.num_cpus_per_actor} CPU/actor", file=sys.stderr, flush=True)
    num_cpus = max(4, int(max(config.actors) * data.pool.num_cpus_per_actor) + 2)
    started = connect_ray(num_cpus)
    address = gcs_address()
    results = []
    try:
        for mode, batch, actors in runs:
            print(f"bench loader: {mode} B={batch}" + (f" K={actors}" if actors else ""), file=sys.stderr, flush=True)
            spec = {"config": asdict(config), "mode": mode, "batch": batch, "actors": actors, "address": address}
            proc = subprocess.run([sys.executable, "-m", "flexrl_ds.bench.loader_bench", "--child", json.dumps(spec)],
                                  stdout=subprocess.PIPE, text=True, timeout=3600)
            lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
            if proc.returncode != 0 or not lines:
                raise RuntimeError(f"bench loader: the {mode} B={batch} run failed (exit {proc.returncode})")
            results.append(RunResult(**json.loads(lines[-1][len("RESULT "):])))
    finally:
        if started:
            ray.shutdown()
    return results


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--child":
        raise SystemExit(_child_main(sys.argv[2]))
    raise SystemExit("usage: flexrl bench loader ... (this module's __main__ is the per-run controller process)")
