"""The GRPO driver: one step = data → rollout → reward → plan → log-probs → advantages → update → sync.

`GRPOTrainer(run, options, policy, rollout, controller)` runs the GRPO step loop
(docs/ARCHITECTURE.md "One GRPO step, end to end") with the groups it is given (trainer/launch.py
builds them: Ray actors under `flexrl train`, the launcher's
processes under `deepspeed --hostfile`). Per step it moves token ids, lengths, rewards and plans —
never pixels: the rollout hosts and the policy ranks pull their own from the preprocessing actors.

1. data: the next step's prompts from the ShadowLoader (metadata; the look-ahead decodes meanwhile);
   under `flexrl.sp.max_tokens_per_rank`, prompts whose samples could outgrow a sequence's share
   are set aside before the rollout, each said with its reason (`num_prompts_too_long`);
2. rollout: n samples per prompt, each seeded by (seed, step, slot, k) (trainer/samples.py);
3. reward: the configured reward over the responses' text and their records (rl/reward_fn.py; DAPO's
   dynamic sampling and overlong penalty: trainer/rl_step.py); a raising one scores its samples 0;
4. plan: FlexUlysses over prompt + response lengths (planning/planner.py), with `flexrl.sp`; with
   several SP domains (`flexrl.sp.domain_size` < policy ranks) each pass's samples are split over
   the domains (trainer/samples.split_domains) and every domain gets a plan of its own share; a
   pass whose samples together overflow `flexrl.sp.max_tokens_per_rank` (the log-prob passes:
   `logprob_max_tokens_per_rank` where set) runs as micro-batches (planning/micro_batches.py;
   said, and counted in `micro_batches`);
5. inference: reference and old-policy log-probs (the latter skipped where the update's are the same);
6. advantages, TIS weights (trainer/rl_step.py) and the update: `ppo_epochs` x `mini_batches_per_step` steps, each
   mini-batch planned on its own, loss normalised by the mini-batch's response tokens (micro-batches
   of a cut mini-batch accumulate their gradients into its one optimizer step);
7. sync: the policy's weights to the rollout engines, gathered from ZeRO-3 in buckets.
Metrics, rollouts, plans, checkpoints and HF exports go under OUT (trainer/metrics.py, checkpoint.py).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from flexrl_ds.common import RunInputError
from flexrl_ds.planning.plan import Workload
from flexrl_ds.planning.micro_batches import plan_micro_batches
from flexrl_ds.rl.reward_fn import score_batch
from flexrl_ds.runtime.data_controller import record_fields
from flexrl_ds.runtime.pieces import assemble
from flexrl_ds.runtime.rank_failures import is_lost_worker, lost_at_step
from flexrl_ds.trainer.checkpoint import (RunPaths, disk_full_explained, latest_checkpoint, write_checkpoint,
                                         write_trainer_state)
from flexrl_ds.trainer.floor_metrics import floor_metrics
from flexrl_ds.trainer.loader_metrics import LoaderAccounting
from flexrl_ds.trainer.metrics import StepLog
from flexrl_ds.trainer.phase_peaks import PEAK_KEYS, _max_peaks, _phase_peaks, warn_host_memory  # noqa: F401 (tests)
from flexrl_ds.trainer.policy_worker import PassJob, PolicyWorker
from flexrl_ds.trainer.step_figures import (INFERENCE_PARTS, degrees, plans_json,  # noqa: F401 (tests)
                                           report_bad_records, step_mfu, vision_forward_flops)
from flexrl_ds.trainer.rl_step import (DynamicSampling, KLCoefficient, equal_reward_groups, merge_rounds,
                                       mini_batch_prompts, sample_advantages, shape_rewards, skips_old_pass,
                                       token_shaping)
from flexrl_ds.trainer.rollout_host import PromptJob
if TYPE_CHECKING:
    from flexrl_ds.models.flops import DecoderShape, VisionShape
    from flexrl_ds.models.processing import SampleEncoder
    from flexrl_ds.planning.config import SPConfig
    from flexrl_ds.planning.cost_model import CostModel
    from flexrl_ds.rl.config import GRPOConfig
    from flexrl_ds.rl.reward_fn import RewardFn
    from flexrl_ds.rollout.base import SamplingParams
    from flexrl_ds.runtime.data_controller import DataController
    from flexrl_ds.runtime.worker_group import RayWorkerGroup, SPMDWorkerGroup
    from flexrl_ds.trainer.rollout_group import ColocatedRollout, SeparateRollout
from flexrl_ds.trainer.samples import (LogprobGaps, StepSamples, encode_prompts, logprob_gaps, media_of,
                                       parse_sample_name, sample_seed, sequence_token_limit, split_domains,
                                       split_mini_batches, too_long_prompts)

logger = logging.getLogger(__package__)


@dataclass
class TrainOptions:
    """What the driver needs besides the groups (resolved from the CLI and the run config)."""

    out_dir: Path
    max_steps: int
    start_step: int
    seed: int
    save_every: int
    save_last: bool
    save_rollouts: bool
    sampling: SamplingParams
    """`rollout.base.SamplingParams`."""
    rl: GRPOConfig
    """`GRPOConfig`."""
    sp: SPConfig
    """`SPConfig`."""
    cost: CostModel
    """`planning.cost_model.CostModel` of the trained model."""
    num_ranks: int
    bucket_bytes: int
    run_config: dict
    decoder: DecoderShape | None = None
    """`models.flops.DecoderShape` of the trained model (for `mfu`)."""
    vision: VisionShape | None = None
    """`models.flops.VisionShape` of its vision tower (for `mfu`); None for a text model."""
    peak_flops: float | None = None
    """The policy ranks' GPU's bf16 dense peak FLOP/s; None (no `mfu`) on CPU or an unknown GPU."""
    peak_bytes_per_s: float | None = None
    """Its memory bandwidth; None (no `floor_s`) on CPU or an unknown GPU."""
    floor_gpus: int = 1
    """The GPUs the step floor spreads the phases over (trainer/floor_metrics.py `job_gpus`)."""
    loading: str = "shadow"
    """`flexrl.data.loading` (metrics.jsonl `loader`)."""
    profile_step: int | None = None
    """`TrainerConfig.profile_step`."""
    grad_accum_dtype: str = "float32"
    """The dtype micro-batch gradients add up in (trainer/validation.py `gradient_accumulation_dtype`)."""
    memory_hint: str = ""
    """What of a policy rank this run keeps in host memory, by setting (`launch.policy_memory_hint`)."""
    resume_from: Path | None = None
    """The checkpoint a resumed run continues from (the adaptive KL coefficient comes back from it)."""
    restarts: int = 0
    """Times this job rebuilt its workers after losing one (`flexrl.trainer.max_restarts`)."""


class GRPOTrainer:
    """The loop of the module docstring over given groups."""

    def __init__(self, options: TrainOptions, encoder: SampleEncoder, reward_fn: RewardFn, controller: DataController,
                 policy: RayWorkerGroup | SPMDWorkerGroup, rollout: ColocatedRollout | SeparateRollout, log: StepLog):
        self.o, self.encoder, self.reward_fn = options, encoder, reward_fn
        self.controller, self.policy, self.rollout, self.log = controller, policy, rollout, log
        self.paths = RunPaths(options.out_dir)
        self.loader_accounting = LoaderAccounting(controller, options.loading)
        self.kl_coef = KLCoefficient(options.rl)
        self.kl_coef.load(options.resume_from)

    def run(self) -> list[dict[str, Any]]:
        profiled = self.o.profile_step
        if profiled is not None and not self.o.start_step <= profiled < self.o.max_steps:
            logger.info(f"profile: flexrl.trainer.profile_step {profiled} is not one of this run's steps "
                        f"{self.o.start_step}..{self.o.max_steps - 1}: nothing is profiled")
        rows = []
        for step in range(self.o.start_step, self.o.max_steps):
            self.policy.note_step(step)
            try:
                rows.append(self.train_step(step))
                last = self.o.save_last and step == self.o.max_steps - 1
                if last or (self.o.save_every and (step + 1) % self.o.save_every == 0):
                    self.save(step)
            except Exception as error:  # a lost worker: said with its step and where --resume would continue
                if not is_lost_worker(error):
                    raise
                raise lost_at_step(error, step, str(latest_checkpoint(self.o.out_dir) or "")) from error
        return rows

    def train_step(self, step: int) -> dict[str, Any]:
        times: dict[str, float] = {}
        started = time.perf_counter()
        cstep = self._timed(times, "data", self.controller.next_step)
        assert cstep.step == step, (cstep.step, step)
        bad_records = report_bad_records(step, cstep.report, trained_on=len(cstep.prompts))
        prompts = self._fitting(step, encode_prompts(self.encoder, cstep))
        too_long = len(cstep.prompts) - len(prompts)
        peaks: dict[str, dict[str, float]] = {}  # phase -> peak memory on the policy ranks' devices
        rollout_info: dict[str, Any] = {}
        samples, reward_info = self._samples(times, peaks, step, prompts, rollout_info)
        profiling = step == self.o.profile_step
        if profiling:
            self.policy.run(PolicyWorker.start_profile)
        inference = self._phase(times, peaks, "inference", self._inference, step, samples)
        shaping = token_shaping(samples.names, samples.advantages, inference["old"], inference["ref"],
                                samples.engine_logprobs, self.o.rl, self.kl_coef.value)
        update = self._phase(times, peaks, "update", self._update, step, samples, inference, shaping)
        times["sync"] = self._phase({}, peaks, "sync", self.rollout.sync, self.policy, self.o.bucket_bytes)
        if profiling:
            written = self.policy.run(PolicyWorker.stop_profile, str(self.paths.out_dir / "profile"), step)
            logger.info(f"profile: step {step}: log-prob, update and sync phases of each policy rank in {written[0]} "
                        f"... ({len(written)} ranks; .json.gz beside each: the trace for ui.perfetto.dev)")
        self.policy.run(PolicyWorker.release_pixels)
        self.controller.release(step)
        times["step"] = time.perf_counter() - started
        gaps = logprob_gaps(samples, inference["old"])
        metrics = self._metrics(step, samples, reward_info, inference, update, times, gaps)
        metrics.update(rollout_info, num_bad_records=bad_records, num_prompts_too_long=too_long)
        metrics.update(_phase_peaks(peaks), **shaping.metrics, kl_coef=self.kl_coef.value,
                       overlong_penalty_mean=sum(reward_info["penalties"].values()) / len(samples.names))
        metrics.update(self.loader_accounting.step(times, rollout_info))
        self.kl_coef.update(shaping.metrics.get("kl_k1"), len(samples.names))
        self.log.write(metrics, self.o.max_steps)
        if self.o.save_rollouts:
            self._save_rollouts(step, samples, reward_info, gaps, shaping)
        return metrics

    @staticmethod
    def _timed(times: dict[str, float], name: str, function, *args):
        started = time.perf_counter()
        result = function(*args)
        times[name] = time.perf_counter() - started
        return result

    def _phase(self, times: dict[str, float], peaks: dict[str, dict[str, float]], name: str, function, *args):
        """`_timed`, and the phase's peak memory (the largest over the policy ranks) into peaks[name]."""
        self.policy.run(PolicyWorker.reset_peaks)
        result = self._timed(times, name, function, *args)
        peaks[name] = _max_peaks(self.policy.run(PolicyWorker.peaks))
        if peaks[name]["alloc_retries"]:
            logger.info(f"memory: {name}: torch's device allocator found no free cached block "
                        f"{peaks[name]['alloc_retries']:.0f} time(s) and freed its whole cache to retry (each a "
                        "synchronising pause; the phase's memory is near the device's limit)")
        warn_host_memory(name, peaks[name], self.o.memory_hint)
        return result

    def _fitting(self, step: int, prompts: list) -> list:
        """The prompts whose samples fit a sequence's share under flexrl.sp.max_tokens_per_rank; the
        others are said, with their record, and left out of the step."""
        limit = sequence_token_limit(self.o.sp, self.o.cost, self.o.sp.domain_ranks(self.o.num_ranks))
        if limit is None:
            return prompts
        reasons = too_long_prompts(prompts, self.o.sampling.max_new_tokens, limit.tokens)
        why = limit.explained(self.o.sp.max_tokens_per_rank)
        for prompt in prompts:
            if prompt.name in reasons:
                logger.info(f"data: step {step}: prompt {prompt.name!r} (record {prompt.record.id!r}) not rolled out: "
                            f"{reasons[prompt.name]} ({why})")
        kept = [prompt for prompt in prompts if prompt.name not in reasons]
        if not kept:
            raise RunInputError(f"step {step}: every prompt is too long ({len(prompts)} prompts, e.g. "
                               f"{next(iter(reasons.values()))}; {why})")
        return kept

    # ---- phases -------------------------------------------------------------------------------
    def _rollout(self, step: int, prompts: list, info: dict[str, Any]) -> StepSamples:
        """The step's samples; `info` gets the metrics of the phase: where its time went
        (`rollout_time_s`, `ROLLOUT_PARTS`), the pixels the hosts pulled (`rollout_pixel_mb`) and, for
        engines inside policy ranks on GPUs, the device's peak while they were awake (`rollout_engine_peak_gb`)."""
        jobs = [PromptJob(p.key, tuple(p.prompt_ids),
                          tuple((i.kind, tuple(i.grid_thw), float(i.second_per_grid_t), tuple(i.frame_indices),
                                 i.source_fps) for i in p.items),
                          tuple((name, sample_seed(self.o.seed, parse_sample_name(name))) for name in p.sample_names))
                for p in prompts]
        output = self.rollout.generate(step, jobs, self.o.sampling)
        results, withdrawn = output.results, output.withdrawn
        prior = info.get("rollout_time_s", {})  # rounds of dynamic sampling add up
        info.update(rollout_time_s={k: prior.get(k, 0.0) + v for k, v in output.times_s.items()},
                    rollout_pixel_mb=info.get("rollout_pixel_mb", 0.0) + output.pixel_bytes / 2**20,
                    rollout_engine_peak_gb=max(info.get("rollout_engine_peak_gb", 0.0),
                                               output.engine_peak_bytes / 2**30))
        for name, reason in withdrawn.items():
            logger.info(f"data: step {step}: prompt {name!r} withdrawn after hand-out, not trained on: {reason}")
        kept = [p for p in prompts if p.name not in withdrawn]
        samples = StepSamples(kept, {r.sample_key: list(r.response_ids) for r in results},
                              {r.sample_key: list(r.logprobs) for r in results},
                              {r.sample_key: r.finish_reason for r in results})
        if not samples.names:
            raise RuntimeError(f"step {step}: no prompt could be rolled out (withdrawn: {withdrawn})")
        return samples

    def _samples(self, times, peaks, step: int, prompts: list, info: dict[str, Any]) -> tuple[StepSamples, dict]:
        """The step's scored samples with their advantages: one rollout, or under dynamic sampling
        rounds of them (rl_step.DynamicSampling; their phases' seconds added up)."""
        if not self.o.rl.dynamic_sampling:
            samples = self._phase(times, peaks, "rollout", self._rollout, step, prompts, info)
            return samples, self._advantages(samples, self._timed(times, "reward", self._reward, samples))
        parts: list[tuple[StepSamples, dict]] = []

        def roll(batch: list) -> tuple[list, set]:
            round_times: dict[str, float] = {}
            if parts:  # engines that dropped their weights at the last round's sleep get them again
                self._timed(round_times, "resync", self.rollout.sync, self.policy, self.o.bucket_bytes)
            part = self._phase(round_times, peaks, "rollout", self._rollout, step, batch, info)
            round_times["rollout"] += round_times.pop("resync", 0.0)
            parts.append((part, self._timed(round_times, "reward", self._reward, part)))
            for key, value in round_times.items():
                times[key] = times.get(key, 0.0) + value
            return part.prompts, equal_reward_groups(part.prompts, part.rewards)

        sampling = DynamicSampling(self.o.rl.dynamic_sampling_prompts, self.o.rl.dynamic_sampling_max_rounds)
        samples, reward_info = merge_rounds(sampling.run(prompts, roll), parts)
        if sampling.dropped == sampling.rolled_out:
            logger.info(f"data: step {step}: every group of its {sampling.rounds} rollout round(s) had equal "
                        "rewards; training on the first round's (their advantages are 0)")
        info["dynamic_sampling"] = sampling.metrics()
        return samples, self._advantages(samples, reward_info)

    def _reward(self, samples: StepSamples) -> dict[str, Any]:
        names, prompts = samples.names, samples.prompt_of()
        texts = self.encoder.tokenizer.batch_decode([samples.response_ids[n] for n in names], skip_special_tokens=True)
        records = [record_fields(prompts[n].record) for n in names]
        scored = score_batch(self.reward_fn, texts, records, names, timeout_s=self.o.rl.reward_timeout_s)
        for message in scored.messages():
            logger.info(f"reward: {message}")
        if scored.all_failed():
            first = scored.raised_by or next(iter(scored.errors))
            where = f" (raised at {scored.raised_at})" if scored.raised_at else ""
            raise RunInputError(f"reward: flexrl.rl.reward_fn {self.o.rl.reward_fn!r} failed on all {len(names)} "
                               f"samples of the step, e.g. {first!r}: {scored.errors[first]}{where}; stopping "
                               "rather than training on zero rewards")
        rewards, penalties = list(scored.scores), [0.0] * len(names)
        if self.o.rl.overlong_buffer_length:  # DAPO's overlong penalty (rl/shaping.py)
            rewards, penalties = shape_rewards(scored.scores, [len(samples.response_ids[n]) for n in names],
                                               self.o.rl, self.o.sampling.max_new_tokens)
        samples.rewards = dict(zip(names, rewards))
        return {"texts": dict(zip(names, texts)), "num_reward_errors": len(scored.errors),
                "penalties": dict(zip(names, penalties))}

    def _advantages(self, samples: StepSamples, reward_info: dict[str, Any]) -> dict[str, Any]:
        """The samples' advantages (rl_step.sample_advantages); `reward_info` with the share of groups
        trained on whose rewards are all equal."""
        names, n = samples.names, len(samples.prompts[0].sample_names)
        samples.advantages = sample_advantages(samples.rewards, names, n, self.o.rl)
        equal = equal_reward_groups(samples.prompts, samples.rewards)
        return {**reward_info, "zero_variance_groups": len(equal) / len(samples.prompts)}

    def _plan(self, step: int, samples: StepSamples, names: list[str], what: str, sp: SPConfig):
        """The pass's micro-batches (one unless the pass overflows `sp.max_tokens_per_rank`:
        planning/micro_batches.py), each one `PlanResult` per SP domain over its share of `names`;
        and every name's EncodedSample. `what` names the pass in the line said when it is cut."""
        encoded = samples.encoded(names)
        domain_size = self.o.sp.domain_ranks(self.o.num_ranks)
        shares = split_domains(samples.prompts, names, self.o.num_ranks // domain_size,
                               lambda n: self.o.cost.cost(encoded[n].length))
        micro_batches = plan_micro_batches([Workload(tuple(encoded[n].sequence_spec(n) for n in share))
                                            for share in shares], domain_size, self.o.cost, sp)
        if len(micro_batches) > 1:
            largest = max(sum(encoded[n].length for n in share) for share in shares)
            setting = "max_tokens_per_rank" if sp.max_tokens_per_rank == self.o.sp.max_tokens_per_rank else \
                "logprob_max_tokens_per_rank"
            logger.info(f"plan: step {step}: {what}: {len(names)} samples do not plan in one pass under "
                        f"flexrl.sp.{setting} {sp.max_tokens_per_rank} x {domain_size} ranks (the largest SP "
                        f"domain's share holds {largest} tokens): run as {len(micro_batches)} micro-batches")
        for domain, share in enumerate(shares):
            idle = [str(index) for index, results in enumerate(micro_batches) if not results[domain].plan.packs]
            if idle:
                cause = (f"it has {len(share)} samples for {len(micro_batches)} micro-batches" if share
                         else "no sample of the pass fell to it")
                logger.info(f"plan: step {step}: {what}: SP domain {domain} idles in micro-batch(es) {', '.join(idle)} "
                            f"(numbered from 0, as the plan files; {cause})")
        return micro_batches, encoded

    def _save_plans(self, micro_batches, step: int, suffix: str = "") -> None:
        for index, results in enumerate(micro_batches):
            part = suffix + (f"_micro{index}" if len(micro_batches) > 1 else "")
            for domain, result in enumerate(results):
                result.plan.save(self.paths.plan(step, part + (f"_d{domain}" if len(results) > 1 else "")))

    def _inference(self, step: int, samples: StepSamples) -> dict[str, Any]:
        """The old policy's and the reference's log-probs of the step's samples, and where the phase's
        time went (`inference_time_s`, `INFERENCE_PARTS`)."""
        times: dict[str, float] = {}
        micro_batches, encoded = self._timed(times, "plan", self._plan, step, samples, samples.names,
                                             "old-policy and reference log-probs", self.o.sp.for_logprob_passes())
        self._save_plans(micro_batches, step)
        job = PassJob(step, plans_json(micro_batches), encoded, samples.prompt_keys())
        skip = skips_old_pass(self.o.rl, min(self.o.rl.mini_batches_per_step, len(samples.prompts)))
        old, old_parts = ({}, {}) if skip else self._logprob_pass(times, "old", job)
        ref, ref_parts = {}, {}
        if self.o.rl.init_kl_coef > 0:
            ref, ref_parts = self._logprob_pass(times, "reference", dataclasses.replace(job, model="reference"))
        times.update({part: old_parts.get(part, 0.0) + ref_parts.get(part, 0.0) for part in ("batches", "forward")})
        return {"old": old, "ref": ref, "micro_batches": micro_batches, "encoded": encoded, "times_s": times,
                "old_pass_skipped": skip}

    def _logprob_pass(self, times: dict[str, float], name: str, job: PassJob):
        """One log-prob pass on the ranks, timed into times[name]: its log-probs by sample, and the
        slowest rank's seconds by part ("batches", "forward"; both the one rank's: a rank that built
        its batches sooner waits longer in the forward's collectives)."""
        per_rank = self._timed(times, name, self.policy.run, PolicyWorker.logprobs, job)
        _, slowest = max(per_rank, key=lambda result: sum(result[1].values()))
        return assemble(job.samples, [pieces for pieces, _ in per_rank]), dict(slowest)

    def _update(self, step: int, samples: StepSamples, inference: dict[str, Any], shaping) -> list[dict[str, float]]:
        """`ppo_epochs` passes over the step's mini-batches (dealt by rl_step.mini_batch_prompts)."""
        asked, rl = self.o.rl.mini_batches_per_step, self.o.rl
        if len(samples.prompts) < asked:  # prompts set aside or withdrawn: one mini-batch per prompt left
            logger.info(f"data: step {step}: {len(samples.prompts)} prompts left of the step's, so as many "
                        f"mini-batches instead of flexrl.rl.mini_batches_per_step = {asked}")
        per_batch = []
        for epoch in range(rl.ppo_epochs):
            order = mini_batch_prompts(samples.prompts, self.o.seed, step, epoch, rl.shuffle_mini_batches)
            batches = split_mini_batches(order, samples.names, min(asked, len(samples.prompts)))
            suffix = f"_e{epoch}" if rl.ppo_epochs > 1 else ""
            per_batch += self._mini_batches(step, samples, inference, shaping, batches, suffix)
        return per_batch

    def _mini_batches(self, step: int, samples: StepSamples, inference: dict[str, Any], shaping, batches,
                      suffix: str) -> list[dict[str, float]]:
        """One optimizer step per mini-batch of `batches` (the old policy's log-probs, or, where its
        pass was skipped, the update's own: `PassJob.old_is_current`)."""
        per_batch = []
        same_cap = self.o.sp.for_logprob_passes().max_tokens_per_rank == self.o.sp.max_tokens_per_rank
        skipped = inference["old_pass_skipped"]
        for index, names in enumerate(batches):
            if len(batches) == 1 and same_cap:  # the whole step, as the log-prob pass planned it
                micro_batches, encoded = inference["micro_batches"], inference["encoded"]
                if len(micro_batches) > 1:
                    logger.info(f"plan: step {step}: update: the log-prob pass's {len(micro_batches)} micro-batches, "
                                f"their gradients {self._accumulation()}")
            else:
                micro_batches, encoded = self._plan(step, samples, names, f"update mini-batch {index} (gradients "
                                                    f"{self._accumulation()})", self.o.sp)
                self._save_plans(micro_batches, step, f"{suffix}_mb{index}")
            job = PassJob(step, plans_json(micro_batches), encoded, samples.prompt_keys(),
                          old_logprobs={} if skipped else {n: inference["old"][n] for n in names},
                          ref_logprobs={n: inference["ref"][n] for n in names} if inference["ref"] else {},
                          advantages={n: shaping.advantages[n] for n in names},
                          is_weights={n: shaping.is_weights[n] for n in names} if shaping.is_weights else {},
                          kl_coef=self.kl_coef.value, old_is_current=skipped)
            per_rank = self.policy.run(PolicyWorker.train, job)
            if skipped:  # the update's forward gave the old policy's log-probs
                inference["old"] = assemble(job.samples, [result.pop("pieces") for result in per_rank])
            # all-reduced: the same on every rank
            per_batch.append({**per_rank[0], "micro_batches": len(micro_batches)})
        return per_batch

    def _accumulation(self) -> str:
        """How an update's micro-batch gradients add up, for the lines that say it is cut."""
        dtype = self.o.grad_accum_dtype
        hint = "" if dtype == "float32" else ' (DeepSpeed\'s data_types.grad_accum_dtype "fp32" adds them in float32)'
        return f"accumulated in {dtype} into one optimizer step{hint}"

    # ---- outputs ------------------------------------------------------------------------------
    def _metrics(self, step, samples, reward_info, inference, update, times, gaps: LogprobGaps) -> dict[str, Any]:
        names = samples.names
        rewards = torch.tensor([samples.rewards[n] for n in names], dtype=torch.float64)
        lengths = [len(samples.response_ids[n]) for n in names]
        tokens = sum(len(p.prompt_ids) * len(p.sample_names) for p in samples.prompts) + sum(lengths)
        total_tokens = max(sum(b["num_tokens"] for b in update), 1.0)
        plans = [result for results in inference["micro_batches"] for result in results]  # every domain's

        def token_weighted(key: str) -> float:
            return sum(b[key] * b["num_tokens"] for b in update) / total_tokens

        passes = bool(inference["ref"]) + (not inference["old_pass_skipped"])  # log-prob passes that ran
        return {
            "step": step, "reward_mean": float(rewards.mean()),
            "reward_std": float(rewards.std()) if len(names) > 1 else 0.0,
            "loss": token_weighted("loss"), "pg_loss": token_weighted("pg_loss"), "kl": token_weighted("kl"),
            "entropy": token_weighted("entropy"), "clip_frac": token_weighted("clip_frac"),
            "dual_clip_frac": token_weighted("dual_clip_frac"), "approx_kl": token_weighted("approx_kl"),
            "grad_norm": sum(b["grad_norm"] for b in update) / len(update),  # mean over the mini-batches
            "lr": update[0]["lr"], "optimizer_steps": len(update),
            **({"router_aux_loss": sum(b["router_aux_loss"] for b in update) / len(update)}
               if "router_aux_loss" in update[0] else {}),  # a sparse MoE decoder: the mini-batches' mean
            "old_logprob_pass": "skipped" if inference["old_pass_skipped"] else "run",
            "response_length_mean": sum(lengths) / len(lengths),
            "clipped_length_ratio": sum(samples.finish_reasons[n] == "length" for n in names) / len(names),
            "zero_variance_groups": reward_info["zero_variance_groups"],
            "num_reward_errors": reward_info["num_reward_errors"], "num_samples": len(names),
            "num_restarts": self.o.restarts, "num_engine_restarts": self.rollout.restarts,
            "time_s": times, "tokens_per_gpu_s": tokens / self.o.num_ranks / max(times["step"], 1e-9),
            "attention_balance": max(float(r.metrics.attention_balance) for r in plans),
            "rollout_logprob_diff": gaps.mean, "rollout_logprob_diff_by_media": gaps.by_media,
            "degrees": degrees(plans),
            "inference_time_s": inference["times_s"],
            "micro_batches": {"inference": len(inference["micro_batches"]),
                              "update": sum(b["micro_batches"] for b in update)},
            **step_mfu(self.o, samples, lengths, times, passes=passes,
                       vision_forward=vision_forward_flops(self.o.vision, inference["micro_batches"],
                                                           inference["encoded"])),
            **floor_metrics(self.o, samples, inference["encoded"], times, logprob_passes=passes),
        }

    def _save_rollouts(self, step: int, samples: StepSamples, reward_info: dict[str, Any], gaps: LogprobGaps,
                       shaping) -> None:
        path = self.paths.rollouts(step)
        path.parent.mkdir(parents=True, exist_ok=True)
        prompts = samples.prompt_of()
        with path.open("w") as handle:
            for name in samples.names:
                extra = {"token_advantages": shaping.advantages[name]} if self.o.rl.kl_in_reward else {}
                handle.write(json.dumps({
                    "sample": name, "id": prompts[name].record.id, "k": parse_sample_name(name).sample_index,
                    "prompt_ids": prompts[name].prompt_ids, "response_ids": samples.response_ids[name],
                    "response": reward_info["texts"][name], "reward": samples.rewards[name],
                    "overlong_penalty": reward_info["penalties"][name], "advantage": samples.advantages[name],
                    "finish_reason": samples.finish_reasons[name], **extra,
                    "media": media_of(prompts[name]), "logprob_diff": gaps.per_sample[name]}) + "\n")

    def save(self, step: int) -> None:
        """checkpoints/step_N (DeepSpeed on every rank, then the trainer state) and hf/step_N."""
        directory = self.paths.checkpoint(step)  # written as step_N.partial, renamed when complete

        def state(partial: Path) -> None:
            self.kl_coef.save(partial)
            write_trainer_state(partial, step, step + 1, self.o.run_config)  # last: it lists the other files

        write_checkpoint(directory, lambda partial: self.policy.run(PolicyWorker.save_checkpoint, str(partial),
                                                                    {"step": step}), state)
        with disk_full_explained(f"HF export {self.paths.hf_export(step)} (checkpoint {directory.name} is complete)"):
            self.policy.run(PolicyWorker.export_hf, str(self.paths.hf_export(step)))
        logger.info(f"saved checkpoint {directory} and HF export {self.paths.hf_export(step)}")
