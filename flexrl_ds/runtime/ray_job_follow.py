"""Follow a submitted Ray job to its end: print its log as it comes and return its final status.

`ray job logs --follow` was the launcher's one wait without a bound (both launcher tests once ran
past their 600 s on the 2-core machine; the cause was not found). Here the job's status is polled
beside the log stream; once the status is final the stream gets `drain_s` to finish, and whatever part of the log it
did not print (a stream cut short, or one that failed) is printed from the job's stored log, so no
line is lost and none is printed twice.

    python -m flexrl_ds.runtime.ray_job_follow ADDRESS JOB_ID   (exit 0 iff the job SUCCEEDED)
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from dataclasses import dataclass
from typing import TextIO

from ray.job_submission import JobStatus, JobSubmissionClient

logger = logging.getLogger(__package__)


@dataclass
class FollowSettings:
    poll_s: float = 2.0  # how often the status is asked
    drain_s: float = 10.0  # how long the stream may go on after the status is final


@dataclass
class _Printed:
    out: TextIO
    chars: int = 0
    stream_error: str | None = None

    def write(self, text: str) -> None:
        self.out.write(text)
        self.out.flush()
        self.chars += len(text)


async def _stream_log(client, job_id: str, printed: _Printed) -> None:
    try:
        async for lines in client.tail_job_logs(job_id):
            printed.write(lines)
    except Exception as error:  # the stored log fills in what the stream missed
        printed.stream_error = f"{type(error).__name__}: {error}"


async def follow_job(client, job_id: str, out: TextIO = sys.stdout,
                     settings: FollowSettings = FollowSettings()) -> str:
    """Print job `job_id`'s log to `out` until the job ends; return its final status's name.
    `client` is a ray.job_submission.JobSubmissionClient (or anything with its three methods)."""
    printed = _Printed(out)
    stream = asyncio.ensure_future(_stream_log(client, job_id, printed))
    try:
        status = JobStatus(await asyncio.to_thread(client.get_job_status, job_id))
        while not status.is_terminal():
            await asyncio.sleep(settings.poll_s)
            status = JobStatus(await asyncio.to_thread(client.get_job_status, job_id))
        await asyncio.wait([stream], timeout=settings.drain_s)
    finally:
        stream.cancel()
    stored = await asyncio.to_thread(client.get_job_logs, job_id)
    if len(stored) > printed.chars:
        printed.write(stored[printed.chars:])
    if printed.stream_error:
        logger.warning(f"[ray_job_follow] the log stream of {job_id} failed ({printed.stream_error}); "
                       "the rest of the log was read from the job's stored log")
    return status.value


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("address", help="the job server, e.g. http://127.0.0.1:8265")
    parser.add_argument("job_id", help="the submission id")
    args = parser.parse_args(argv)
    status = asyncio.run(follow_job(JobSubmissionClient(args.address), args.job_id))
    logger.info(f"[train_ray_job] job {args.job_id}: {status}")
    return 0 if status == "SUCCEEDED" else 1


if __name__ == "__main__":
    sys.exit(main())
