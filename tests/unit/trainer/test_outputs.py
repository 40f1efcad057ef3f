"""Pure parts of the trainer's outputs and hosts: spread_jobs, metrics, StepLog, checkpoints."""

from __future__ import annotations

import itertools
import json
import random

import pytest

from flexrl_ds.loader.metastore import PromptKey
from flexrl_ds.trainer.checkpoint import STATE_FILE, latest_checkpoint, read_trainer_state, write_trainer_state
from flexrl_ds.trainer.metrics import PHASES, StepLog, flatten, plot_metrics, progress_line, trailing_mean
from flexrl_ds.trainer.rollout_host import PromptJob, spread_jobs


def _jobs(rng: random.Random, num: int) -> list[PromptJob]:
    jobs = []
    for slot in range(num):
        n = rng.randint(1, 4)
        jobs.append(PromptJob(PromptKey(0, slot), tuple(range(rng.randint(1, 9))), (),
                              tuple((f"s0p{slot}k{k}", k) for k in range(n))))
    return jobs


def _load(job: PromptJob) -> int:
    return len(job.prompt_ids) * len(job.samples)


def _best_makespan(jobs: list[PromptJob], num_hosts: int) -> int:
    best = None
    for assignment in itertools.product(range(num_hosts), repeat=len(jobs)):
        loads = [0] * num_hosts
        for job, host in zip(jobs, assignment):
            loads[host] += _load(job)
        best = max(loads) if best is None else min(best, max(loads))
    return best


def test_spread_jobs_covers_each_job_once_and_balances():
    rng = random.Random(5)
    for _ in range(40):
        num_jobs, num_hosts = rng.randint(0, 6), rng.randint(1, 3)
        jobs = _jobs(rng, num_jobs)
        shares = spread_jobs(jobs, num_hosts)
        assert len(shares) == num_hosts
        dealt = [job.key for share in shares for job in share]
        assert sorted(dealt, key=lambda k: k.slot) == [job.key for job in jobs]
        if not jobs:
            continue
        makespan = max(sum(_load(j) for j in share) for share in shares)
        best = _best_makespan(jobs, num_hosts)
        assert makespan <= (4 / 3 - 1 / (3 * num_hosts)) * best + 1e-9  # Graham's LPT bound
        if num_jobs <= num_hosts:
            assert makespan == best and all(len(share) <= 1 for share in shares)


def _metrics(step: int, rng: random.Random) -> dict:
    return {"step": step, "reward_mean": rng.random(), "reward_std": rng.random(), "loss": rng.uniform(-1, 1),
            "kl": rng.random() / 10, "clip_frac": rng.random(), "response_length_mean": rng.uniform(1, 16),
            "tokens_per_gpu_s": rng.uniform(10, 1000), "time_s": {phase: rng.uniform(0.1, 2) for phase in PHASES},
            "note": "text", "flag": True, "nested": {"deeper": {"x": 3}}}


def _flatten_reference(metrics: dict) -> dict:
    out, stack = {}, [("", metrics)]
    while stack:
        prefix, node = stack.pop()
        for key, value in node.items():
            if isinstance(value, dict):
                stack.append((prefix + key + "/", value))
            elif type(value) in (int, float):
                out[prefix + key] = float(value)
    return out


def test_flatten_keeps_numbers_with_slash_names():
    metrics = _metrics(4, random.Random(0))
    flat = flatten(metrics)
    assert flat == _flatten_reference(metrics)
    assert all(isinstance(value, float) for value in flat.values())
    assert "flag" not in flat and "note" not in flat


def test_progress_line_shows_the_step_and_numbers():
    metrics = _metrics(2, random.Random(1))
    line = progress_line(metrics, max_steps=9)
    assert line.startswith(f"step {metrics['step'] + 1}/9")
    for text in (f"{metrics['reward_mean']:.3f}", f"{metrics['reward_std']:.3f}", f"{metrics['loss']:+.4f}",
                 f"{metrics['kl']:.4f}", f"{metrics['time_s']['step']:.1f} s",
                 f"(data {metrics['time_s']['data']:.1f}, rollout {metrics['time_s']['rollout']:.1f},",
                 f"{metrics['tokens_per_gpu_s']:.0f} tok/GPU/s"):
        assert text in line, (text, line)


def _rows(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_step_log_resume_drops_rows_after_the_checkpoint(tmp_path, capsys):
    rng = random.Random(2)
    first = [_metrics(step, rng) for step in range(5)]
    log = StepLog(tmp_path, tensorboard=False)
    for row in first:
        log.write(row, max_steps=5)
    log.close()
    assert capsys.readouterr().out.splitlines() == [progress_line(row, 5) for row in first]
    assert _rows(tmp_path / "metrics.jsonl") == first
    assert (tmp_path / "metrics.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    resumed = StepLog(tmp_path, resume_after_step=2, tensorboard=False)
    assert _rows(tmp_path / "metrics.jsonl") == [row for row in first if row["step"] <= 2]
    again = _metrics(3, rng)
    resumed.write(again, max_steps=5)
    resumed.close()
    assert _rows(tmp_path / "metrics.jsonl") == [row for row in first if row["step"] <= 2] + [again]

    fresh = StepLog(tmp_path, tensorboard=False)  # not a resume: the file starts over
    fresh.close()
    assert _rows(tmp_path / "metrics.jsonl") == []


def test_plot_metrics_writes_a_png(tmp_path):
    """Four panels without memory figures, a fifth for the peak host memory on the nodes (every run
    since it is measured), a sixth for the peak device memory on GPUs: each wider."""
    from PIL import Image

    rng = random.Random(3)
    sizes = {}
    for name, device, host in (("none", 0.0, 0.0), ("cpu", 0.0, 12.0), ("gpu", 40.0, 90.0)):
        rows = [dict(_metrics(step, rng), peak_device_used_gb={"rollout": device, "inference": device / 2, "update": device},
                     peak_host_used_gb={"rollout": host, "update": host * 1.1})
                for step in range(3)]
        path = tmp_path / f"{name}.png"
        plot_metrics(rows, path)
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        sizes[name] = Image.open(path).size
    assert sizes["none"][0] < sizes["cpu"][0] < sizes["gpu"][0]


@pytest.mark.parametrize("window", [1, 2, 5, 40])
def test_trailing_mean_matches_the_mean_of_each_slice(window):
    rng = random.Random(window)
    values = [rng.uniform(-1, 1) for _ in range(23)]
    expected = [sum(values[max(0, i - window + 1):i + 1]) / len(values[max(0, i - window + 1):i + 1])
                for i in range(len(values))]
    assert trailing_mean(values, window) == pytest.approx(expected, abs=1e-12)


def test_plot_metrics_draws_a_long_run(tmp_path):
    """A run long enough for the reward's trailing mean (a tenth of the steps) still gives one PNG."""
    rng = random.Random(4)
    rows = [_metrics(step, rng) for step in range(40)]
    plot_metrics(rows, tmp_path / "long.png")
    assert (tmp_path / "long.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_latest_checkpoint_picks_the_highest_complete_step(tmp_path):
    assert latest_checkpoint(tmp_path) is None
    root = tmp_path / "checkpoints"
    complete, incomplete = [2, 9, 10], [11, 30]
    for step in complete + incomplete:
        (root / f"step_{step}").mkdir(parents=True)
    for step in complete:
        write_trainer_state(root / f"step_{step}", step, step + 1, {"seed": step})
    (root / "step_99.tmp").mkdir()
    (root / "step_99.tmp" / STATE_FILE).write_text("{}")
    (root / "notes").write_text("not a checkpoint")
    best = max(complete)  # numeric order: step_10 > step_9 > step_2
    assert latest_checkpoint(tmp_path) == root / f"step_{best}"
    state = read_trainer_state(latest_checkpoint(tmp_path))
    assert (state["step"], state["loader_steps"], state["run_config"]) == (best, best + 1, {"seed": best})


def test_latest_checkpoint_none_when_all_incomplete(tmp_path):
    (tmp_path / "checkpoints" / "step_3").mkdir(parents=True)
    assert latest_checkpoint(tmp_path) is None


@pytest.mark.parametrize("save_every,save_last,saved", [(0, True, [3]), (0, False, []), (2, False, [1, 3]),
                                                        (3, True, [2, 3])])
def test_checkpoint_steps_follow_save_every_and_save_last(save_every, save_last, saved):
    """The driver's loop saves every `save_every` steps and, with `save_last`, after the last one."""
    from types import SimpleNamespace

    from flexrl_ds.trainer.driver import GRPOTrainer

    trainer = object.__new__(GRPOTrainer)  # only the step loop: no workers behind it
    trainer.o = SimpleNamespace(start_step=0, max_steps=4, save_every=save_every, save_last=save_last,
                                profile_step=None)
    written, noted = [], []
    trainer.policy = SimpleNamespace(note_step=noted.append)  # the worker group told each step (lost-rank lines)
    trainer.train_step = lambda step: {"step": step}
    trainer.save = written.append
    assert trainer.run() == [{"step": step} for step in range(4)]
    assert written == saved and noted == [0, 1, 2, 3]


def test_a_steps_rollout_output_merges_its_hosts_and_takes_each_parts_slowest():
    from flexrl_ds.rollout.base import RolloutResult
    from flexrl_ds.trainer.rollout_group import merge_outputs
    from flexrl_ds.trainer.rollout_host import RolloutOutput

    def result(name):
        return RolloutResult(name, [1, 2], [-0.5, -0.25], "length")

    first = RolloutOutput([result("a")], {"p1": "bad video"}, 100, {"pixels": 0.5, "generate": 2.0})
    second = RolloutOutput([result("b"), result("c")], {}, 50, {"pixels": 1.5, "generate": 1.0, "wake": 0.25})
    merged = merge_outputs([first, second])
    assert [r.sample_key for r in merged.results] == ["a", "b", "c"]
    assert merged.withdrawn == {"p1": "bad video"} and merged.pixel_bytes == 150
    assert merged.times_s == {"pixels": 1.5, "generate": 2.0, "wake": 0.25}
    assert first.times_s == {"pixels": 0.5, "generate": 2.0}  # the hosts' own outputs are left as they were


def test_the_host_memory_panel_marks_where_ray_kills(monkeypatch):
    """The dotted line sits at the busiest node's memory (a peak over its share) times Ray's kill share."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from flexrl_ds.trainer.metrics import _plot_memory

    monkeypatch.setenv("RAY_memory_usage_threshold", "0.9")
    rows = [{"step": 0, "peak_host_used_gb": {"update": 50.0, "sync": 30.0},
             "peak_host_used_share": {"update": 0.4, "sync": 0.24}}]  # a node of 125 GiB
    figure, axis = plt.subplots()
    _plot_memory(axis, rows, "peak_host_used_gb")
    kill = [line for line in axis.get_lines() if line.get_label() == "Ray kills above"]
    assert len(kill) == 1 and kill[0].get_ydata()[0] == pytest.approx(125 * 0.9)
    plt.close(figure)
