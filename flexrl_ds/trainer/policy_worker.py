"""One policy rank of the GRPO trainer: DeepSpeed ZeRO-3 policy and reference engines with FlexUlysses.

`PolicyWorker(place, setup)` is a plain class (a `runtime/worker_group` group hosts one per rank,
as a Ray actor or in a launcher-started process). It joins the group's process group, builds the
nested SP groups, loads the policy and (when the KL term is on) the reference model, and wraps
them in ZeRO-3 engines built from the run's DeepSpeed JSON as written (models/zero3.py). With
`flexrl.trainer.colocate` it also hosts a rollout engine (trainer/rollout_host.py) that gets the
policy's weights in process.

Every method is collective over the group (all ranks are called with the same arguments):
- `logprobs(job)`: one no-grad FlexUlysses pass of the policy or the reference over the job's
  plan; returns this rank's pieces {sample: [(first position, log-probs)]} and its seconds by part;
- `train(job)`: one mini-batch: FlexUlysses forward with grad, the GRPO loss over this rank's
  tokens normalised by the mini-batch's global denominator, backward (per micro-batch, where the
  driver cut the mini-batch under flexrl.sp.max_tokens_per_rank), one optimizer step; returns
  summed statistics (the driver adds them over ranks) and the global grad norm;
- `sync_rollout` (colocated engines) / `send_weights` (separate engines, over the weight channel
  that `weight_channel_address` + `join_weight_channel` set up): ZeRO-3 parameters gathered in
  buckets for the rollout engines;
- `save_checkpoint` / `load_checkpoint` / `export_hf`.
Each rank pulls its own pixels: exactly the vision units the step's vision balancing gives it, once
per step (`StepSlices`: the reference's and the update's passes reuse what the first pass pulled).
"""

from __future__ import annotations

import os
import random
import time
from pathlib import Path
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Mapping

import numpy as np
import torch

from flexrl_ds.common import notes
from flexrl_ds.loader.metastore import PromptKey
from flexrl_ds.models import policy_update
from flexrl_ds.models import weights as model_weights
from flexrl_ds.models import zero3
from flexrl_ds.models.flex_model import build_step_batch, place_rank
from flexrl_ds.models.loading import load_model
from flexrl_ds.parallel import device as device_mod
from flexrl_ds.parallel.group_tree import GroupTree, SPTopology
from flexrl_ds.parallel.launch import ensure_deepspeed_comm
from flexrl_ds.parallel.profiling import RankProfiler, region
from flexrl_ds.planning.plan import parse_plan
from flexrl_ds.runtime import host_memory
from flexrl_ds.runtime.gc_pauses import GCPauses
from flexrl_ds.runtime.host_threads import HostThreads, apply_host_threads, automatic_host_threads, usable_cores
from flexrl_ds.runtime.rank_pixels import StepSlices, fetched_items, unit_requests
from flexrl_ds.runtime.weight_channel import ChannelAddress, WeightChannel
from flexrl_ds.runtime.worker_group import WorkerPlace, join_process_group, node_address, open_store
from flexrl_ds.sp.attention import FlexUlyssesAttention
from flexrl_ds.trainer.device_oom import phase
from flexrl_ds.trainer.rollout_host import RolloutHost

if TYPE_CHECKING:
    from flexrl_ds.rl.config import GRPOConfig
    from flexrl_ds.rollout.base import SamplingParams
    from flexrl_ds.runtime.data_controller import PixelSource


@dataclass(frozen=True)
class PolicySetup:
    """What every policy rank is built with (the same on all ranks)."""

    model_dir: str
    """HF model directory the policy and the reference start from."""
    ds_config: dict
    """The run config without its `flexrl` section: handed to DeepSpeed as written."""
    p_max: int
    """Largest Ulysses degree (`flexrl.sp.p_max`): the nested groups built."""
    rl: GRPOConfig
    """`GRPOConfig` (flexrl.rl)."""
    pixels: PixelSource
    """The run's `PixelSource`."""
    dtype: str = "float32"
    """Model dtype (bfloat16 when the DeepSpeed config enables bf16)."""
    domain_size: int | None = None
    """Ranks of one SP domain (`flexrl.sp.domain_size`); None: all ranks form one domain."""
    overlap: bool = True
    """`flexrl.sp.overlap`: prefetch pack j+1's all-to-all during pack j's attention."""
    timeout_s: float = 900.0
    """Process-group collective timeout."""
    seed: int = 0
    """Seeds torch / numpy / random on every rank."""
    rollout_backend: str | None = None
    """Backend of a colocated rollout engine in this rank (None: the engines live elsewhere)."""
    max_batch_sequences: int = 64
    """Sequences per generate call of the colocated engine."""
    rollout_options: dict = field(default_factory=dict)
    """Backend-specific engine settings (`RolloutConfig.engine_options(colocated=True)`: at sleep_level 2
    the engine starts without reading the model directory's weights; the first sync writes them)."""
    activation_checkpointing: bool = False
    """`flexrl.trainer.activation_checkpointing`: the policy recomputes layers in backward."""
    zero3_leaf_layers: bool = True
    """`flexrl.trainer.zero3_leaf_layers`: each layer's parameters fetched and released as one."""
    vision_attention: str = "varlen"
    """`flexrl.trainer.vision_attention`: "varlen" or "sdpa"."""
    offload_states_in_rollout: bool = True
    """`flexrl.trainer.offload_states_in_rollout`: the policy's states wait in host memory while the
    colocated engine generates (GPU only)."""
    reference_offload_param: bool = False
    """`flexrl.trainer.reference_offload_param`: the reference engine's parameters in host memory."""
    logprob_temperature: float = 1.0
    """`flexrl.rollout.temperature`: the policy's and the reference's log-probs are those of their logits
    divided by it, the distribution the rollout samples from (before top-k / top-p)."""
    logprob_chunk_bytes: int = 1 << 30
    """`flexrl.sp.logprob_chunk_bytes`: the byte budget of one LM-head chunk (models/logprob_chunks.py)."""
    host_threads: HostThreads | None = None
    """`flexrl.trainer.host_threads_per_rank` (runtime/host_threads.py); None: the node's cores over its ranks."""
    loader_cpus_per_node: float = 0.0
    """CPUs the data-loading actors reserve on a node (flexrl.data.pool), left to them by `host_threads` None."""


@dataclass
class PassJob:
    """One FlexUlysses pass over planned samples (no pixels inside)."""

    step: int
    """Loader step (where the pixels live)."""
    plans_json: list[list[dict]]
    """The pass's plans (docs/PLAN_SCHEMA.md): per micro-batch (run one after the other; one, unless
    the pass overflows its token cap: planning/micro_batches.py), one plan per SP
    domain: domain d runs plans_json[m][d] over its share of `samples` (the sequences of that plan)."""
    samples: dict[str, Any]
    """EncodedSample per sample name, of EVERY domain (the loss denominators cover them all);
    vision items hold placeholders."""
    prompt_keys: dict[str, PromptKey]
    """Sample name -> its prompt (pixel source)."""
    model: str = "policy"
    """"policy" or "reference" (logprobs only)."""
    old_logprobs: dict[str, list[float]] = field(default_factory=dict)
    """train: per sample, the old policy's log-prob of each response token."""
    ref_logprobs: dict[str, list[float]] = field(default_factory=dict)
    """train: per sample, the reference's log-prob of each response token (empty: no KL)."""
    advantages: dict[str, Any] = field(default_factory=dict)
    """train: per sample advantage (a float, or one per response token under flexrl.rl.kl_in_reward)."""
    is_weights: dict[str, list[float]] = field(default_factory=dict)
    """train: per sample, the TIS weight of each response token (empty: no correction)."""
    kl_coef: float | None = None
    """train: the KL coefficient of the adaptive controller (None: flexrl.rl.init_kl_coef)."""
    old_is_current: bool = False
    """train: no old-policy pass ran (one mini-batch, one epoch): the old log-probs are the update
    forward's own, detached (ratio 1), and the result carries them ("pieces", as `logprobs` gives)."""


def _seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


class PolicyWorker:
    """One rank's policy/reference engines (see the module docstring)."""

    def __init__(self, place: WorkerPlace, setup: PolicySetup):
        import torch.distributed as dist

        self.place, self.setup, self.rank = place, setup, place.rank
        self.host_threads = setup.host_threads or automatic_host_threads(usable_cores(), place.ranks_on_node,
                                                                         setup.loader_cpus_per_node)
        apply_host_threads(self.host_threads)  # for this thread, on which the actor runs every call
        notes.say(f"host threads per policy rank: {self.host_threads.threads} ({self.host_threads.reason})")
        os.environ.update(RANK=str(place.rank), WORLD_SIZE=str(place.world_size), LOCAL_RANK=str(place.local_rank),
                          MASTER_ADDR=place.master_addr, MASTER_PORT=str(place.master_port))
        info = self.device_info = device_mod.detect()
        self.device = device_mod.set_local_device(info, place.local_rank)
        self.device_usage = device_mod.DeviceUsageMonitor(info)
        self.host_usage = device_mod.DeviceUsageMonitor(info, interval_s=0.25, used_bytes=host_memory.bytes_in_use)
        """The node's host memory in use (runtime/host_memory.py), sampled like the device's."""
        self.allocator_at_reset = device_mod.allocator_counts(info)
        self.gc_pauses = GCPauses()
        if not dist.is_initialized():
            join_process_group(place, info.backend, setup.timeout_s)
        ensure_deepspeed_comm(info.backend)
        _seed_everything(setup.seed)
        topology = SPTopology(place.world_size, setup.domain_size or place.world_size, setup.p_max)
        self.tree = GroupTree.create(topology, place.rank)
        self.hf_config = None
        self.slices = StepSlices()  # the step's pulled pixels, for its later passes
        self.profiler = RankProfiler()
        self.policy = self._engine(train=True)
        self.reference = self._engine(train=False) if setup.rl.init_kl_coef > 0 else None
        self.rollout = None
        self.rollout_offload = rollout_offload(self.policy, setup)
        """The policy's states in host memory while a colocated engine generates (GPU only); None when
        the run keeps them on the device, or once DeepSpeed refused to move any."""
        self._offload_reported = False
        if setup.rollout_backend is not None:
            self.rollout = RolloutHost(setup.rollout_backend, setup.model_dir, setup.pixels, setup.dtype,
                                       self.device, setup.max_batch_sequences, setup.rollout_options)
            self.rollout.sleep()  # asleep while the policy trains (frees an accelerator; no-op on CPU)

    def _engine(self, train: bool):
        model = load_model(self.setup.model_dir, self.setup.dtype)
        self.hf_config = model.config
        if self.device is not None:
            model = model.to(self.device)
        ds_config = self.setup.ds_config
        if not train and self.setup.reference_offload_param:
            ds_config = zero3.with_param_offload(ds_config)
        return zero3.build_engine(model, ds_config, attention=FlexUlyssesAttention(overlap=self.setup.overlap),
                                  vision_group=self.tree.domain_group, train=train,
                                  activation_checkpointing=train and self.setup.activation_checkpointing,
                                  temperature=self.setup.logprob_temperature,
                                  vision_attention=self.setup.vision_attention,
                                  logits_chunk_bytes=self.setup.logprob_chunk_bytes,
                                  leaf_layers=self.setup.zero3_leaf_layers)

    # ---- passes -------------------------------------------------------------------------------
    def _batches(self, job: PassJob) -> list:
        """This rank's StepBatch of each micro-batch of the job, with its vision units' pixels: the
        slices the step's earlier passes did not pull are pulled at once, while the batches are built."""
        if any(len(plans) != self.tree.topology.num_domains for plans in job.plans_json):
            raise ValueError(f"pass of step {job.step}: {[len(p) for p in job.plans_json]} plans per micro-batch "
                             f"for {self.tree.topology.num_domains} SP domains")
        parts = []
        for plans in job.plans_json:
            plan = parse_plan(plans[self.tree.domain])
            samples = {s: job.samples[s] for pack in plan.packs for s in pack.sequences}
            placement = place_rank(self.hf_config, plan, samples, self.tree.local_rank, self.tree)
            parts.append((plan, samples, placement,
                          unit_requests(placement.units, job.prompt_keys) if placement.units else []))
        missing = self.slices.missing(job.step, [r for *_, requests in parts for r in requests])
        materializer = self.setup.pixels.start(job.step, missing) if missing else None
        batches = [build_step_batch(self.policy.module.hf_model, plan, samples, self.tree.local_rank, self.tree,
                                    placement=placement) for plan, samples, placement, _ in parts]
        if materializer is not None:
            self._pull(job.step, materializer, missing)
        for batch, (*_, requests) in zip(batches, parts):
            if requests:
                batch.items = fetched_items(job.samples, job.prompt_keys, requests, self.slices.tensors(requests))
        return batches

    def _pull(self, step: int, materializer, requests) -> None:
        """Wait for the pulled slices and keep them for the step's later passes."""
        try:
            fetched = materializer.get(step)
        finally:
            materializer.close()
        if fetched.withdrawn:
            raise ValueError(f"step {step}: media of prompt(s) {sorted(map(str, fetched.withdrawn))} failed to "
                             f"decode after the step was planned: {fetched.withdrawn_reasons()}")
        self.slices.add(step, requests, fetched.tensors)

    @phase("logprobs")
    def logprobs(self, job: PassJob) -> tuple[dict[str, list], dict[str, float]]:
        """This rank's pieces of next-token log-probs (no grad) of the policy or the reference, and
        its seconds: {"batches": building the micro-batches (the pixel pulls included), "forward":
        the forwards, each to its log-probs on the host}."""
        engine = self.reference if job.model == "reference" else self.policy
        pieces: dict[str, list] = {}
        started = time.perf_counter()
        with region("build_batches"):
            batches = self._batches(job)
        built = time.perf_counter()
        for batch in batches:
            with torch.no_grad(), region("logprob_forward"):
                logprobs = engine(batch).logprobs.float().cpu()  # one copy to the host, not one per piece
            for seq_id, lo, hi, local in batch.layout.segments():
                pieces.setdefault(seq_id, []).append((lo, logprobs[local:local + hi - lo].tolist()))
        return pieces, {"batches": built - started, "forward": time.perf_counter() - built}

    @phase("update")
    def train(self, job: PassJob) -> dict[str, Any]:
        """One mini-batch update (models/policy_update.train_step); the mini-batch's statistics
        (all-reduced: the same on every rank), the global grad norm and the step's learning rate;
        with `job.old_is_current`, also this rank's "pieces" of the forward's log-probs."""
        started = time.perf_counter()
        values = policy_update.local_response_values
        with region("build_batches"):
            batches = self._batches(job)
            micro_batches = [policy_update.UpdateInputs(
                batch, None if job.old_is_current else values(batch, job.old_logprobs),
                values(batch, job.ref_logprobs) if job.ref_logprobs else None, values(batch, job.advantages),
                values(batch, job.is_weights) if job.is_weights else None) for batch in batches]
        everyone = {s: x.length - x.response_start for s, x in job.samples.items()}  # all domains' sequences
        result = policy_update.train_step(self.policy, micro_batches, self.setup.rl,
                                          policy_update.denominators(everyone), kl_coef=job.kl_coef,
                                          keep_logprobs=job.old_is_current)
        stats: dict[str, Any] = policy_update.reduce_stats(result.stats, device=self.device)
        stats.update(grad_norm=result.grad_norm, lr=result.lr, update_s=time.perf_counter() - started)
        if result.logprobs is not None:
            pieces: dict[str, list] = {}
            for batch, logprobs in zip(batches, result.logprobs):
                for seq_id, lo, hi, local in batch.layout.segments():
                    pieces.setdefault(seq_id, []).append((lo, logprobs[local:local + hi - lo].tolist()))
            stats["pieces"] = pieces
        return stats

    def release_pixels(self) -> None:
        """Drop the step's pulled slices (the driver's end of a step: their object-store buffers go)."""
        self.slices = StepSlices()

    def reset_peaks(self) -> None:
        """Start new peaks for `peaks` (the driver calls it before a phase)."""
        device_mod.reset_peak_memory(self.device_info)
        self.device_usage.reset()
        self.host_usage.reset()
        self.gc_pauses.reset()
        self.allocator_at_reset = device_mod.allocator_counts(self.device_info)

    def start_profile(self) -> None:
        """Profile this rank until `stop_profile` (parallel/profiling.py)."""
        self.profiler.start()

    def stop_profile(self, directory: str, step: int) -> str:
        """End the profile; write DIRECTORY/step_N_rank_R.txt and .json.gz; returns the .txt path."""
        return self.profiler.stop(Path(directory) / f"step_{step}_rank_{self.rank}")

    def reference_params_on_host(self) -> bool:
        """Whether this rank's reference engine keeps its ZeRO-3 parameters in host memory
        (DeepSpeed's `offload_param`, set by `flexrl.trainer.reference_offload_param`)."""
        offload = self.reference.zero_offload_param() if self.reference is not None else None
        return offload is not None and getattr(offload.device, "value", str(offload.device)) != "none"

    def accelerator_name(self) -> str | None:
        """This rank's GPU (e.g. "NVIDIA H200"; picks the calibration and the MFU peak), None on CPU."""
        return device_mod.accelerator_name()

    def peaks(self) -> dict[str, float]:
        """Peak device memory since `reset_peaks` (GiB; 0 on CPU): torch's allocations
        (`peak_memory_gb`) and all memory in use on the device (`peak_device_used_gb`); what torch's
        allocator did since (`alloc_retries`, `device_mallocs`: device.allocator_counts); and the
        node's host memory in use, in GiB and as a share of the node's (`peak_host_used_gb`,
        `peak_host_used_share`: runtime/host_memory.py), of which torch's pinned allocator held at
        most `peak_pinned_host_gb` of this rank's (device.pinned_host_bytes); and the seconds Python's
        garbage collector held the rank (`gc_pause_s`: runtime/gc_pauses.py)."""
        now = device_mod.allocator_counts(self.device_info)
        before = self.allocator_at_reset
        host_peak = self.host_usage.peak_bytes()  # one reading for both figures
        pinned = device_mod.pinned_host_bytes(self.device_info)
        return {"peak_memory_gb": device_mod.max_memory_allocated(self.device_info) / 2**30,
                "peak_device_used_gb": self.device_usage.peak_bytes() / 2**30,
                "peak_host_used_gb": host_peak / 2**30,
                "peak_host_used_share": host_peak / host_memory.bytes_total(),
                "peak_pinned_host_gb": pinned["peak"] / 2**30,
                "gc_pause_s": self.gc_pauses.seconds,
                **{key: float(now[key] - before[key]) for key in now}}

    # ---- weights ------------------------------------------------------------------------------
    @phase("sync")
    def sync_rollout(self, bucket_bytes: int) -> dict[str, float]:
        """Colocated: every rank gathers the policy's weights in buckets into its own engine. A rank
        whose engine fails to load a bucket still joins the remaining gathers (the other ranks wait on
        them), then raises: the step fails at once, not at the group's timeout. On a GPU torch's cached
        blocks go back to the device first: a sleeping vLLM engine brings its weights back outside
        torch's cache, and blocks cached for an update that filled the device left it no room."""
        started, count, failure = time.perf_counter(), 0, None
        if self.rollout is not None and self.device_info.is_gpu:
            device_mod.release_cached_memory(self.device_info)
        for bucket in model_weights.iter_weight_buckets(self.policy.module.hf_model, bucket_bytes, self.device):
            if self.rollout is not None and failure is None:
                try:
                    self.rollout.engine.load_weights(bucket)
                except Exception as error:  # raised below, once every gather has run
                    failure = error
            count += len(bucket)
        if failure is not None:
            raise RuntimeError(f"rank {self.rank}: the rollout engine failed to load the weights "
                               f"({type(failure).__name__}: {failure})") from failure
        if self.rollout is not None:
            self.rollout.engine.reset_caches()
        return {"sync_s": time.perf_counter() - started, "num_tensors": float(count)}

    def weight_channel_address(self, num_receivers: int, timeout_s: float, use_gpu: bool) -> ChannelAddress | None:
        """Separate engines: rank 0 opens its weight channel's store and names it (others: None);
        num_receivers: the engines' receiving ranks (one per engine worker)."""
        if self.rank != 0:
            return None
        host = node_address()
        self.channel_store = open_store(host, num_receivers + 1, timeout_s)
        return ChannelAddress(host, self.channel_store.port, num_receivers + 1, timeout_s, use_gpu)

    def join_weight_channel(self, address: ChannelAddress) -> str | None:
        """Rank 0 becomes the sender of the channel (blocks until every receiver, one per engine
        worker, has joined) and returns the transport agreed (others: None)."""
        if self.rank != 0:
            return None
        self.channel = WeightChannel(address, 0, self.channel_store)
        return self.channel.transport

    @phase("sync")
    def send_weights(self, bucket_bytes: int) -> dict[str, float]:
        """Separate engines: every rank gathers the buckets (collective); rank 0 copies each one and
        broadcasts it over the weight channel as it is gathered (runtime/weight_channel.py). If the
        channel fails, rank 0 still joins the remaining gathers before it raises, so the other policy
        ranks do not wait for the group's timeout (the engines wait for the channel's)."""
        started = time.perf_counter()
        hf_model = self.policy.module.hf_model
        if self.rank == 0:
            buckets = model_weights.iter_weight_buckets(hf_model, bucket_bytes, self.device)
            try:
                sent = self.channel.send(buckets)
            except Exception:
                for _ in buckets:  # the gathers the other ranks are in
                    pass
                raise
        else:
            model_weights.join_weight_gathers(hf_model, bucket_bytes)
            sent = 0
        return {"sync_s": time.perf_counter() - started, "bytes": float(sent)}

    @phase("rollout")
    def generate(self, step: int, jobs: list, params: SamplingParams):
        """Colocated rollout of this rank's share of the step's prompts. On a GPU the policy's states
        leave the device first (`_offload_states`) and torch's cached blocks go back to it: a vLLM
        engine allocates outside torch's cache, so blocks cached for the update would be lost to it.
        The output's `engine_peak_bytes` is the device's peak from the wake to the end of generation."""
        assert self.rollout is not None, "generate on a policy rank without a colocated engine"
        started = time.perf_counter()
        offloaded, waking, failed = started, False, True
        try:
            if self.device_info.is_gpu:
                self._offload_states()
                device_mod.release_cached_memory(self.device_info)
            offloaded, waking = time.perf_counter(), True
            self.device_usage.start_window()
            self.rollout.wake()
            woken = time.perf_counter()
            output = self.rollout.generate(step, jobs, params)
            output.engine_peak_bytes = self.device_usage.end_window()
            failed = False
        finally:
            generated = time.perf_counter()
            slept = self._sleep_and_reload(waking, failed)
        output.times_s.update(offload=offloaded - started, wake=woken - offloaded, sleep=slept - generated,
                              reload=time.perf_counter() - slept)
        return output

    def _sleep_and_reload(self, engine_woke: bool, rollout_failed: bool = False) -> float:
        """After a rollout, also a failed one: the engine sleeps again if it was asked to wake, then the
        policy's states come back, also when that sleep fails. After a failed rollout a failed sleep is
        said, not raised: the rollout's error is the one the run ends with (a wake that ran out of
        memory leaves vLLM unable to sleep). Returns when the sleep ended."""
        try:
            if engine_woke:
                try:
                    self.rollout.sleep()
                except Exception as error:
                    if not rollout_failed:
                        raise
                    notes.say(f"rank {self.rank}: after the failed rollout the engine's sleep failed too "
                              f"({type(error).__name__}: {(str(error).splitlines() or [''])[0][:160]})",
                              console=self.rank == 0)
        finally:
            slept = time.perf_counter()
            if self.rollout_offload is not None and self.rollout_offload.offloaded():
                self.rollout_offload.reload()
        return slept

    def _offload_states(self) -> None:
        """Move the policy's ZeRO-3 states to host memory while the engine generates, as many as
        DeepSpeed moves with this optimizer (`zero3.RolloutOffload`); the first time, say which. An
        engine whose states cannot move keeps them, said once."""
        if self.rollout_offload is None:
            return
        try:
            moved = self.rollout_offload.offload()
        except (AssertionError, NotImplementedError) as error:
            self.rollout_offload = None
            notes.say(f"rank {self.rank}: ZeRO-3 states stay on the device during rollout ({error})",
                      console=self.rank == 0)  # every rank alike: rank 0's line on the console
            return
        if not self._offload_reported:
            self._offload_reported = True
            refusal = self.rollout_offload.refusal
            notes.say(f"rank {self.rank}: in host memory during rollout: {', '.join(moved) or 'nothing'}"
                      + (f" (DeepSpeed keeps the rest: {refusal})" if refusal else ""), console=self.rank == 0)

    # ---- checkpoints --------------------------------------------------------------------------
    def save_checkpoint(self, directory: str, client_state: Mapping[str, Any]) -> bool:
        rng = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}
        self.policy.save_checkpoint(directory, tag="policy", client_state={**client_state, f"rng_{self.rank}": rng})
        return True

    def load_checkpoint(self, directory: str) -> dict[str, Any]:
        _, client_state = self.policy.load_checkpoint(directory, tag="policy")
        rng = (client_state or {}).get(f"rng_{self.rank}")
        if rng is not None:
            torch.set_rng_state(rng["torch"])
            np.random.set_state(rng["numpy"])
            random.setstate(rng["python"])
        return {key: value for key, value in (client_state or {}).items() if not key.startswith("rng_")}

    def export_hf(self, out_dir: str) -> bool:
        model_weights.save_hf_export(self.policy.module.hf_model, out_dir, self.setup.model_dir, rank=self.rank)
        return True


def rollout_offload(policy_engine, setup: PolicySetup) -> zero3.RolloutOffload | None:
    """What moves the policy's states out of the way of a colocated engine's rollout; None when
    `setup.offload_states_in_rollout` keeps them on the device."""
    return zero3.RolloutOffload(policy_engine) if setup.offload_states_in_rollout else None
