"""Reward, checkpoint and loading cases of `flexrl bench faults` (bench/faults.py), without Ray.

Rewards: the driver's scoring (rl/reward_fn.py `score_batch`, with `flexrl.rl.reward_timeout_s`) over
a step of 4 prompts x 2 samples, against a plain per-sample loop of the reward that does not fail.
Checkpoints: trainer/checkpoint.py's atomic save and --resume's choice, on folders shaped like a
DeepSpeed checkpoint (a tag folder of per-rank files), with a save killed mid-write in a child
process, a newest checkpoint cut short, and a save that finds the disk full (OSError ENOSPC
injected). Security: a reward file loaded only from the path the config names, no code-executing
format loaded from a model folder (a `pytorch_model.bin` pickle that writes a file when unpickled),
and no pickle, `torch.load` or `np.load(allow_pickle=True)` in the project's own reading of files.
"""

from __future__ import annotations

import ast
import errno
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import flexrl_ds
from flexrl_ds.bench.faults import Case, Observed
from flexrl_ds.models.loading import load_model
from flexrl_ds.models.tiny import TinyModelConfig, make_tiny_model
from flexrl_ds.rl.reward_fn import TIMEOUTS_IN_A_ROW, load_reward_fn, score_batch
from flexrl_ds.trainer.checkpoint import (CheckpointNotWritten, latest_checkpoint, resume_checkpoint, write_checkpoint,
                                          write_trainer_state)
from flexrl_ds.trainer.launch import TrainArgs, resume_point

IDS = [f"p{p}k{k}" for p in range(4) for k in range(2)]
RESPONSES = [f"answer {index} " * (index + 1) for index in range(len(IDS))]
RECORDS = [{"id": f"p{p}", "answer": "answer", "flaky": p == 2} for p in range(4) for _ in range(2)]
LIMIT_S = 1.0
"""`flexrl.rl.reward_timeout_s` of the reward cases."""


def _length(response: str) -> float:
    return float(len(response.split()))


def _reference() -> list[float]:
    return [_length(response) for response in RESPONSES]


def _raises(responses, records):
    return [_length(r) if not record["flaky"] else {}["no column 'difficulty'"]
            for r, record in zip(responses, records)]


def _nan(responses, records):
    return [math.nan if record["flaky"] else _length(r) for r, record in zip(responses, records)]


def _wrong_length(responses, records):
    return [_length(r) for r in responses][:-1] if len(responses) > 1 else [_length(responses[0])]


def _hangs(responses, records):
    if any(record["flaky"] for record in records):
        time.sleep(LIMIT_S * 5)  # a daemon thread: given up on, it ends by itself
    return [_length(r) for r in responses]


def _reward_case(name: str, function, injected: str, failing: set[str]) -> Case:
    def run(folder: Path) -> Observed:

        started = time.perf_counter()
        scored = score_batch(function, RESPONSES, RECORDS, IDS, timeout_s=LIMIT_S)
        seconds = time.perf_counter() - started
        expected = [0.0 if sample in failing else value for sample, value in zip(IDS, _reference())]
        accounted = set(scored.errors) | {sample for sample in IDS if sample not in scored.errors}
        passed = scored.scores == expected and set(scored.errors) == failing and len(scored.scores) == len(IDS)
        example = next(iter(scored.errors.values()), "none")
        seen = (f"{len(IDS) - len(scored.errors)}/{len(IDS)} scored as the plain loop, {len(scored.errors)} scored 0 "
                f"and reported ({example}) in {seconds:.2f} s")
        return Observed(seen, passed, lost=len(IDS) - len(accounted), duplicated=max(0, len(scored.scores) - len(IDS)),
                        detect_s=seconds)
    return Case(f"reward:{name}", injected, "the failing samples score 0 and are reported, the others are "
                "scored as a plain per-sample loop; the run goes on", run)


def _hangs_always(folder: Path) -> Observed:

    def hangs(responses, records):
        time.sleep(LIMIT_S * 5)
        return [0.0] * len(responses)

    started = time.perf_counter()
    scored = score_batch(hangs, RESPONSES, RECORDS, IDS, timeout_s=LIMIT_S)
    seconds = time.perf_counter() - started
    bound = (1 + TIMEOUTS_IN_A_ROW) * LIMIT_S + 1.0
    seen = (f"every sample failed after {seconds:.2f} s (bound {bound:.1f} s): the driver stops the step with one "
            f"line (trainer/driver.py _reward); e.g. {next(iter(scored.errors.values()))}")
    return Observed(seen, scored.all_failed() and seconds < bound, detect_s=seconds)


def _rank_files(folder: Path, size: int) -> None:
    (folder / "policy").mkdir()
    for rank in range(2):
        (folder / "policy" / f"zero_pp_rank_{rank}_mp_rank_00_model_states.pt").write_bytes(b"m" * size)
        (folder / "policy" / f"bf16_zero_pp_rank_{rank}_mp_rank_00_optim_states.pt").write_bytes(b"o" * 2 * size)
    (folder / "latest").write_text("policy")


def _save(out: Path, step: int, size: int = 4096) -> Path:

    final = out / "checkpoints" / f"step_{step}"
    write_checkpoint(final, lambda partial: _rank_files(partial, size),
                     lambda partial: write_trainer_state(partial, step, step + 1, {"seed": 0}))
    return final


def _snapshot(folder: Path) -> dict[str, bytes]:
    return {str(path.relative_to(folder)): path.read_bytes() for path in sorted(folder.rglob("*")) if path.is_file()}


def _truncated(folder: Path) -> Observed:
    import contextlib
    import io


    older, newest = _save(folder, 1), _save(folder, 3)
    victim = newest / "policy" / "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt"
    victim.write_bytes(victim.read_bytes()[:1000])
    (folder / "run.json").write_text('{"seed": 0}')
    said = io.StringIO()
    started = time.perf_counter()
    with contextlib.redirect_stdout(said):
        checkpoint, start = resume_point(TrainArgs(str(folder / "run.json"), "", "", str(folder), resume=True))
    seconds = time.perf_counter() - started
    lines = [line for line in said.getvalue().splitlines() if "passed over" in line]
    passed = checkpoint == older and start == 2 and len(lines) == 1 and "truncated" in lines[0]
    return Observed(f"--resume chose {checkpoint.name if checkpoint else None}, said: {lines}", passed,
                    detect_s=seconds)


_SLOW_SAVE = """
import sys, time
from pathlib import Path
from flexrl_ds.trainer.checkpoint import write_checkpoint
def write(partial):
    (partial / "policy").mkdir()
    for index in range(1000):
        (partial / "policy" / f"part_{index}.pt").write_bytes(b"x" * 4096)
        print(index, flush=True)
        time.sleep(0.01)
write_checkpoint(Path(sys.argv[1]), write, lambda partial: None)
"""


def _killed_mid_save(folder: Path) -> Observed:

    older = _save(folder, 0)
    before = _snapshot(older)
    child = subprocess.Popen([sys.executable, "-c", _SLOW_SAVE, str(folder / "checkpoints" / "step_1")],
                             stdout=subprocess.PIPE, text=True,
                             env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    for _ in range(20):  # a few files written: the save is under way
        child.stdout.readline()
    child.send_signal(signal.SIGKILL)
    child.wait()
    started = time.perf_counter()
    checkpoint, passed_over = resume_checkpoint(folder)
    seconds = time.perf_counter() - started
    left = sorted(path.name for path in (folder / "checkpoints").iterdir())
    passed = checkpoint == older and _snapshot(older) == before and "step_1" not in left
    return Observed(f"folders after the kill: {left}; --resume chose {checkpoint.name if checkpoint else None}", passed,
                    detect_s=seconds)


def _disk_full(folder: Path) -> Observed:

    previous = _save(folder, 2)
    before = _snapshot(previous)

    def fills_the_disk(partial: Path) -> None:
        _rank_files(partial, 4096)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(partial / "policy" / "optim_states.pt"))

    started = time.perf_counter()
    try:
        write_checkpoint(folder / "checkpoints" / "step_5", fills_the_disk, lambda partial: None)
    except CheckpointNotWritten as error:
        seconds = time.perf_counter() - started
        intact = _snapshot(previous) == before and latest_checkpoint(folder) == previous
        left = sorted(path.name for path in (folder / "checkpoints").iterdir())
        passed = intact and left == ["step_2"] and "step_2 is intact" in str(error) and "\n" not in str(error)
        return Observed(f"one line: {error}; folders left: {left}", passed, detect_s=seconds)
    return Observed("the save went through", False)


class _WritesAFile:
    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def _reward_file_path(folder: Path) -> Observed:

    named, elsewhere = folder / "configs", folder / "cwd"
    named.mkdir()
    elsewhere.mkdir()
    (named / "my_reward.py").write_text("def score(responses, records):\n    return [1.0] * len(responses)\n")
    (elsewhere / "my_reward.py").write_text(f"open({str(folder / 'WRONG_FILE_RAN')!r}, 'w')\n"
                                            "def score(responses, records):\n    return [-1.0] * len(responses)\n")
    path_before, cwd = list(sys.path), os.getcwd()
    os.chdir(elsewhere)
    sys.path.insert(0, str(elsewhere))
    try:
        function = load_reward_fn("my_reward.py:score", base_dir=str(named))
        refused = []
        for spec in ("json.py:dumps", "my_reward:score"):  # an importable module, a module name: not files named
            try:
                load_reward_fn(spec, base_dir=str(named))
            except ValueError as error:
                refused.append(str(error).split(":")[0])
    finally:
        os.chdir(cwd)
        sys.path[:] = path_before
    wrong = (folder / "WRONG_FILE_RAN").exists()
    added = str(named) in sys.path
    passed = function([""], [{}]) == [1.0] and not wrong and not added and len(refused) == 2
    return Observed(f"loaded {named / 'my_reward.py'}; the same name in the working directory and on sys.path "
                    f"{'RAN' if wrong else 'not run'}; its folder {'added to' if added else 'kept off'} sys.path; "
                    f"refused: {refused}", passed)


def _no_pickle_from_model(folder: Path) -> Observed:
    import pickle


    model_dir = make_tiny_model(TinyModelConfig(out_dir=str(folder / "model")), weights=False)
    for path in model_dir.glob("*.safetensors"):
        path.unlink()
    marker = folder / "UNPICKLED"
    (model_dir / "pytorch_model.bin").write_bytes(pickle.dumps({"w": _WritesAFile(str(marker))}))
    try:
        load_model(str(model_dir))
        outcome = "loaded"
    except Exception as error:  # what transformers raises for a refused file varies by version
        outcome = f"{type(error).__name__}: {str(error).splitlines()[0][:160]}"
    ran = marker.exists()
    return Observed(f"the payload {'RAN' if ran else 'did not run'}; loading: {outcome}",
                    not ran and outcome != "loaded")


PICKLE_READERS = {("pickle", "load"), ("pickle", "loads"), ("torch", "load"), ("np", "load"), ("numpy", "load"),
                  ("joblib", "load"), ("dill", "load"), ("dill", "loads")}
ALLOWED_PICKLE = {("flexrl_ds/runtime/weight_channel.py", "loads"):
                  "CUDA IPC handles between policy rank 0 and the engines on its own GPU (torch's sharing needs them)"}


def pickle_reads(root: Path) -> list[tuple[str, int, str]]:
    """(file, line, call) of every call in the package's sources that could unpickle: pickle.load(s),
    torch.load without weights_only=True, np.load with allow_pickle=True, joblib / dill."""
    found = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and isinstance(node.func.value, ast.Name)):
                continue
            pair = (node.func.value.id, node.func.attr)
            keywords = {k.arg: getattr(k.value, "value", None) for k in node.keywords}
            risky = pair in PICKLE_READERS and not (pair[0] == "torch" and keywords.get("weights_only") is True) \
                and not (pair[0] in ("np", "numpy") and keywords.get("allow_pickle") is not True)
            if risky:
                found.append((str(path.relative_to(root.parent)), node.lineno, ".".join(pair)))
    return found


def _no_pickle_in_source(folder: Path) -> Observed:
    root = Path(flexrl_ds.__file__).parent
    found = pickle_reads(root)
    unexplained = [item for item in found if (item[0], item[2].split(".")[1]) not in ALLOWED_PICKLE]
    seen = (f"{len(found)} unpickling call(s) in flexrl_ds: "
            + "; ".join(f"{file}:{line} {call}" + (f" ({ALLOWED_PICKLE[(file, call.split('.')[1])]})"
                                                    if (file, call.split('.')[1]) in ALLOWED_PICKLE else " UNEXPLAINED")
                        for file, line, call in found)
            + "; checkpoints: DeepSpeed reads (torch.load, full pickle) only a folder under --out/checkpoints that "
              "this run's own save wrote and renamed")
    return Observed(seen, not unexplained)


CASES = [
    _reward_case("raises", _raises, "a reward function raising KeyError on 2 of 8 samples", {"p2k0", "p2k1"}),
    _reward_case("nan", _nan, "a reward function returning NaN for 2 of 8 samples", {"p2k0", "p2k1"}),
    Case("reward:wrong_length", "a reward function returning one value too few",
         "every sample of the call scores 0, reported with both counts; a step where all failed stops the run "
         "in one line", lambda folder: _wrong_length_case()),
    _reward_case("hangs", _hangs, f"a reward function sleeping {LIMIT_S * 5:g} s on 2 of 8 samples, "
                 f"flexrl.rl.reward_timeout_s {LIMIT_S:g}", {"p2k0", "p2k1"}),
    Case("reward:hangs_always", f"a reward function sleeping on every call, flexrl.rl.reward_timeout_s {LIMIT_S:g}",
         "given up within 3 limits; every sample failed, so the step stops the run in one line", _hangs_always),
    Case("checkpoint:killed_mid_save", "the saving process SIGKILLed while writing step_1",
         "no step_1 (only step_1.partial); --resume takes step_0, intact", _killed_mid_save),
    Case("checkpoint:truncated", "the newest checkpoint's optimizer file cut short",
         "--resume passes over it in one line and takes the one before", _truncated),
    Case("checkpoint:disk_full", "OSError ENOSPC while a checkpoint is written",
         "one clear line; the partial folder removed; the previous checkpoint intact", _disk_full),
    Case("security:reward_file_path", "a reward file of the same name in the working directory and on sys.path",
         "only the file the config names (against its folder) is imported; its folder stays off sys.path",
         _reward_file_path),
    Case("security:no_pickle_from_model", "a model folder whose weights are a pickle that writes a file",
         "refused (transformers reads .bin with weights_only); the payload never runs", _no_pickle_from_model),
    Case("security:no_pickle_in_source", "(audit) every call in flexrl_ds that could unpickle",
         "none on a dataset, a model or a checkpoint the user did not write", _no_pickle_in_source),
]


def _wrong_length_case() -> Observed:

    scored = score_batch(_wrong_length, RESPONSES, RECORDS, IDS, timeout_s=LIMIT_S)
    reason = next(iter(scored.errors.values()), "")
    passed = scored.all_failed() and f"{len(IDS) - 1} values for {len(IDS)} responses" in reason
    return Observed(f"all {len(scored.errors)} samples scored 0, reported: {reason}", passed)
