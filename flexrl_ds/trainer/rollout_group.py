"""The rollout engines of a run, as the driver sees them: generate a step, take the new weights.

- `ColocatedRollout`: an engine inside every policy rank (`flexrl.trainer.colocate`): a step's
  prompts are dealt over the ranks, and after an update every rank copies the gathered ZeRO-3
  weights into its own engine in process (no transfer between processes).
- `SeparateRollout`: `num_engines` Ray actors of their own (`RolloutHost`), with their own CPUs /
  GPUs (or a share of the policy's GPU); after an update rank 0 of the policy group sends the
  gathered buckets over a process group of its own with the engines (runtime/weight_channel.py:
  shared in place on one GPU, NCCL between GPUs, gloo on CPU) and every engine loads them as they arrive.
Both return the step's merged `RolloutOutput` from `generate` and the seconds a sync took from `sync`.

A separate engine that Ray loses (killed, crashed) in a rollout or a sync is recreated in place while
`flexrl.trainer.max_restarts` allows (`RestartBudget`, shared with the driver's whole restarts), and
the call retried: every engine is replaced (the weight channel is one group: its ranks are rebuilt
together), given the policy's current weights (the last sync's: the engines always hold those, since
every update is followed by a sync; before any sync, the model folder's, which are the policy's) and
the rollout or the sync runs again. The step's samples draw from their own seeds
(trainer/samples.py), so the retried rollout gives the responses the lost one would have. Where it
is not safe the error goes on as before (the run ends naming the step and the checkpoint): a policy
rank lost in the same call, a policy call of the failed sync that does not end within
`SETTLE_S`, or no engine found dead. Recreations are counted (`restarts`: `num_engine_restarts`).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Sequence

import ray

from flexrl_ds.common import notes
from flexrl_ds.runtime.lost_workers import ray_get_explained
from flexrl_ds.runtime.rank_failures import is_lost_worker
from flexrl_ds.runtime.worker_group import print_said_lines, print_worker_notes
from flexrl_ds.trainer.policy_worker import PolicyWorker
from flexrl_ds.trainer.rollout_host import PromptJob, RolloutHost, RolloutOutput, spread_jobs

if TYPE_CHECKING:
    from flexrl_ds.rollout.base import SamplingParams
    from flexrl_ds.runtime.data_controller import PixelSource
    from flexrl_ds.runtime.worker_group import RayWorkerGroup, SPMDWorkerGroup

logger = logging.getLogger(__package__)

SETTLE_S = 60.0
"""Seconds the policy's calls of a failed sync get to end before an engine is recreated (a policy rank
0 still in the broken channel's collective is not safe to give a new one)."""
PROBE_S = 10.0
"""Seconds an engine gets to answer whether it is alive after a failed call."""


@dataclass
class RestartBudget:
    """`flexrl.trainer.max_restarts`, spent by the driver's whole restarts (trainer/launch.py) and by
    separate engines recreated in place."""

    allowed: int
    """Restarts the run may make in all."""
    used: int = 0
    """Restarts made so far."""

    def take(self) -> bool:
        """One restart, if any is left."""
        if self.used >= self.allowed:
            return False
        self.used += 1
        return True


def merge_outputs(outputs: Sequence[RolloutOutput]) -> RolloutOutput:
    """One step's output from its hosts': results and withdrawn prompts together, pixel bytes
    summed, each part's time the slowest host's (the step waits for that one)."""
    merged = RolloutOutput([], {})
    for output in outputs:
        merged.results.extend(output.results)
        merged.withdrawn.update(output.withdrawn)
        merged.pixel_bytes += output.pixel_bytes
        merged.engine_peak_bytes = max(merged.engine_peak_bytes, output.engine_peak_bytes)
        for part, seconds in output.times_s.items():
            merged.times_s[part] = max(seconds, merged.times_s.get(part, 0.0))
    return merged


def _wait_all(refs: list, timeout_s: float, what: str, memory_hint: str = "") -> None:
    """Wait for every reference, raising the first failure as soon as it happens (a dead engine must
    not leave policy rank 0 waiting in a broadcast until the timeout)."""
    pending, deadline = list(refs), time.monotonic() + timeout_s
    while pending:
        ready, pending = ray.wait(pending, num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
        if not ready:
            raise TimeoutError(f"{what}: {len(pending)} of {len(refs)} calls unfinished after {timeout_s:.0f} s")
        ray_get_explained(ready, what, memory_hint=memory_hint)


class ColocatedRollout:
    """Engines inside the policy ranks."""

    def __init__(self, policy: RayWorkerGroup | SPMDWorkerGroup):
        self.policy = policy

    def generate(self, step: int, jobs: Sequence[PromptJob], params: SamplingParams) -> RolloutOutput:
        shares = spread_jobs(jobs, self.policy.num_ranks)
        return merge_outputs(self.policy.run_each(PolicyWorker.generate, [(step, share, params) for share in shares]))

    def sync(self, policy: RayWorkerGroup | SPMDWorkerGroup, bucket_bytes: int) -> float:
        started = time.perf_counter()
        policy.run(PolicyWorker.sync_rollout, bucket_bytes)
        return time.perf_counter() - started

    restarts = 0
    """Engines recreated in place: none (an engine inside a rank is lost with its rank)."""

    def shutdown(self) -> None:
        pass


def channel_first_ranks(ranks_per_host: Sequence[int]) -> list[int]:
    """Each host's first weight-channel rank: rank 0 is the sender, then each host's receivers in a row."""
    return [1 + sum(ranks_per_host[:index]) for index in range(len(ranks_per_host))]


def channel_may_use_gpus(gpus_per_policy_rank: float, gpus_per_engine: float) -> bool:
    """Whether the weight channel may use GPUs: both ends hold one, whole or a share of one (which
    transport then fits is agreed at set-up, runtime/weight_channel.choose_transport)."""
    return gpus_per_policy_rank > 0 and gpus_per_engine > 0


class _RolloutActor(notes.NoteKeeper, RolloutHost):
    """A separate engine's Ray actor body: a `RolloutHost` whose said lines the driver prints
    (common/notes.py)."""


class SeparateRollout:
    """`num_engines` Ray actors hosting one engine each."""

    def __init__(self, num_engines: int, backend: str, model_dir: str, pixels: PixelSource, dtype: str,
                 num_cpus: float, num_gpus: float, max_batch_sequences: int, timeout_s: float,
                 engine_options: dict[str, Any] | None = None, gpus_per_policy_rank: float = 0.0,
                 env: dict[str, str] | None = None, restart_budget: RestartBudget | None = None):
        """gpus_per_policy_rank: the policy ranks' GPUs (whole or a share); with GPUs at both ends
        the weight channel uses them: shared in place where every engine is on policy rank 0's GPU,
        NCCL where every rank has a GPU of its own, else gloo through host memory (chosen at set-up,
        runtime/weight_channel.choose_transport). env: the engines' environment variables (the
        policy ranks' NCCL settings among them). restart_budget: the run's `max_restarts` (module
        docstring; None: none)."""
        self.timeout_s = timeout_s
        self.channel_broken: str | None = None
        """Why a sync failed: its ranks may be anywhere in a bucket, so the channel is never used again."""
        self.channel_on_gpu = channel_may_use_gpus(gpus_per_policy_rank, num_gpus)
        self.transport: str | None = None
        """The weight channel's, once set up (runtime/weight_channel.py); None: not set up yet."""
        runtime_env = {"env_vars": dict(env)} if env else None
        self._actor = ray.remote(_RolloutActor).options(num_cpus=num_cpus, num_gpus=num_gpus, runtime_env=runtime_env)
        self._host_args = (backend, model_dir, pixels, dtype, None, max_batch_sequences, engine_options)
        self.hosts = [self._actor.remote(*self._host_args) for _ in range(num_engines)]
        self.budget = restart_budget or RestartBudget(0)
        self.restarts = 0
        """Times the engines were recreated in place (module docstring)."""
        self.last_sync: tuple[RayWorkerGroup, int] | None = None
        """(policy, bucket bytes) of the last sync that completed: whence a recreated engine's weights."""
        self._policy_calls: list = []
        """The policy's calls of the sync under way."""

    def generate(self, step: int, jobs: Sequence[PromptJob], params: SamplingParams) -> RolloutOutput:
        while True:
            try:
                return self._generate(step, jobs, params)
            except Exception as error:
                self._recreate_or_raise(error, f"the rollout of step {step + 1} (0-based {step})", resync=True)

    def _generate(self, step: int, jobs: Sequence[PromptJob], params: SamplingParams) -> RolloutOutput:
        shares = spread_jobs(jobs, len(self.hosts))
        refs = [host.generate.remote(step, share, params) for host, share in zip(self.hosts, shares) if share]
        try:
            return merge_outputs(ray_get_explained(refs, "rollout engines.generate", self.timeout_s))
        finally:
            print_worker_notes(self.hosts)

    def sync(self, policy: RayWorkerGroup, bucket_bytes: int) -> float:
        """Policy rank 0 broadcasts each gathered bucket to every engine over the weight channel
        (set up on the first sync); the engines load them as they arrive."""
        if self.channel_broken is not None:
            raise RuntimeError(f"weight channel: unusable since a sync failed ({self.channel_broken}); "
                               "restart the run (--resume continues from the last checkpoint)")
        try:
            while True:
                try:
                    seconds = self._sync(policy, bucket_bytes)
                    self.last_sync = (policy, bucket_bytes)
                    return seconds
                except Exception as error:
                    self._recreate_or_raise(error, "a weight sync", resync=False, settled=self._settled())
        except Exception as error:
            first_line = (str(error).splitlines() or [""])[0]
            self.channel_broken = f"{type(error).__name__}: {first_line}"
            raise
        finally:  # the policy's ranks too: rank 0's channel lines were said in calls no group waited on
            print_worker_notes(self.hosts + list(getattr(policy, "actors", [])))

    def _sync(self, policy: RayWorkerGroup, bucket_bytes: int) -> float:
        started = time.perf_counter()
        self._policy_calls = []
        hint = getattr(policy, "memory_hint", "")  # its ranks are among those waited on
        if self.transport is None:
            ranks = ray_get_explained([host.channel_ranks.remote() for host in self.hosts],
                                      "rollout engines.channel_ranks", self.timeout_s)
            address = policy.run(PolicyWorker.weight_channel_address, sum(ranks), self.timeout_s,
                                 self.channel_on_gpu)[0]
            joins = [host.join_weight_channel.remote(address, first)
                     for host, first in zip(self.hosts, channel_first_ranks(ranks))]
            policy_joins = self._policy_calls = policy.run_async(PolicyWorker.join_weight_channel, address)
            _wait_all(joins + policy_joins, self.timeout_s, "weight channel set-up", hint)
            self.transport = ray_get_explained([policy_joins[0]], "weight channel set-up", memory_hint=hint)[0]
            logger.info(f"weight channel: {self.transport}, policy rank 0 to {sum(ranks)} engine receivers")
        loads = [host.receive_weights.remote() for host in self.hosts]
        sends = self._policy_calls = policy.run_async(PolicyWorker.send_weights, bucket_bytes)
        _wait_all(loads + sends, self.timeout_s, "weight sync", hint)
        return time.perf_counter() - started

    def _recreate_or_raise(self, error: Exception, what: str, resync: bool, settled: bool = True) -> None:
        """Recreate every engine after `error` lost one in `what`, where it is safe and the budget
        allows (module docstring), and give them the policy's current weights (`resync`: the last
        sync's; a sync's own retry sends them itself); else raise `error`."""
        if not settled or not is_lost_worker(error):
            raise error
        dead = self._dead_hosts()
        if not dead or not self.budget.take():
            raise error
        self.restarts += 1
        first_line = (str(error).splitlines() or [""])[0]
        logger.info(f"rollout engines: engine {', '.join(map(str, dead))} of {len(self.hosts)} lost in {what} "
                    f"({first_line[:200]}); every engine recreated in place, restart {self.budget.used} of "
                    f"{self.budget.allowed} (flexrl.trainer.max_restarts); the call retried")
        for host in self.hosts:
            ray.kill(host, no_restart=True)
        self.hosts = [self._actor.remote(*self._host_args) for _ in self.hosts]
        self.transport, self._policy_calls = None, []
        if resync and self.last_sync is not None:
            self._sync(*self.last_sync)

    def _dead_hosts(self) -> list[int]:
        """The engines Ray reports dead (their lines said, from those that answer)."""
        refs = [host.take_notes.remote() for host in self.hosts]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=PROBE_S)
        dead, said = [], []
        for index, ref in enumerate(refs):
            if ref in ready:
                try:
                    said.append(ray.get(ref))
                except ray.exceptions.RayActorError:
                    dead.append(index)
        print_said_lines(said)
        return dead

    def _settled(self) -> bool:
        """Whether every policy call of the failed sync has ended, within SETTLE_S, none by its rank's
        loss: the policy is then free to set a new channel up."""
        calls = self._policy_calls
        ready, pending = ray.wait(calls, num_returns=len(calls), timeout=SETTLE_S) if calls else ([], [])
        if pending:
            return False
        for ref in ready:
            try:
                ray.get(ref)
            except ray.exceptions.RayActorError:
                return False
            except Exception:  # noqa: BLE001 - rank 0's channel failure: the call ended, the rank is alive
                continue
        return True

    def shutdown(self) -> None:
        for host in self.hosts:
            ray.kill(host, no_restart=True)
