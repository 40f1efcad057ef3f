"""The Ray job follower ends when the job does, whatever its log stream does, and prints the whole
log exactly once (a fake client stands in for Ray's JobSubmissionClient)."""

from __future__ import annotations

import asyncio
import io

import pytest

from flexrl_ds.runtime.ray_job_follow import FollowSettings, follow_job

FAST = FollowSettings(poll_s=0.01, drain_s=0.05)
LOG = "".join(f"line {i}\n" for i in range(6))


class FakeJobClient:
    """Statuses in the given order (the last repeats); a stream that yields `streamed` chunks of the
    log and then hangs, ends, or fails."""

    def __init__(self, statuses, streamed, after="end"):
        self.statuses, self.streamed, self.after = list(statuses), streamed, after

    def get_job_status(self, job_id):
        return self.statuses.pop(0) if len(self.statuses) > 1 else self.statuses[0]

    def get_job_logs(self, job_id):
        return LOG

    async def tail_job_logs(self, job_id):
        for chunk in self.streamed:
            yield chunk
        if self.after == "hang":
            await asyncio.Event().wait()
        if self.after == "fail":
            raise ConnectionError("websocket closed")


def follow(client) -> tuple[str, str]:
    out = io.StringIO()
    status = asyncio.run(follow_job(client, "job-1", out, FAST))
    return status, out.getvalue()


def halves():
    lines = LOG.splitlines(keepends=True)
    return ["".join(lines[:3]), "".join(lines[3:])]


@pytest.mark.parametrize("final", ["SUCCEEDED", "FAILED", "STOPPED"])
def test_the_final_status_is_returned_after_the_running_ones(final):
    status, out = follow(FakeJobClient(["PENDING", "RUNNING", "RUNNING", final], halves()))
    assert status == final
    assert out == LOG


def test_a_stream_that_outlives_its_job_is_cut_after_the_drain_time():
    status, out = follow(FakeJobClient(["RUNNING", "SUCCEEDED"], halves(), after="hang"))
    assert (status, out) == ("SUCCEEDED", LOG)


@pytest.mark.parametrize("after", ["hang", "fail", "end"])
def test_what_the_stream_did_not_print_comes_from_the_stored_log_once(after):
    status, out = follow(FakeJobClient(["RUNNING", "FAILED"], halves()[:1], after=after))
    assert (status, out) == ("FAILED", LOG)


def test_ray_job_status_enums_are_accepted():
    from ray.job_submission import JobStatus

    status, out = follow(FakeJobClient([JobStatus.RUNNING, JobStatus.SUCCEEDED], [LOG]))
    assert (status, out) == ("SUCCEEDED", LOG)
