"""Run asyncrl on an existing Ray cluster instead of a local ``ray.init``.

Three ways, from least to most setup:

1. Submit any example as a Ray job; the cluster runs the driver. From the repository root::

       ray job submit --address http://127.0.0.1:8265 --working-dir . \\
           -- python examples/opd_quickstart.py pipeline.ray_address=auto

   (the nodes need asyncrl installed, e.g. ``pip install -e .`` on each node or
   ``--runtime-env-json '{"pip": ["./"]}'``).

2. The same, from Python: ``python examples/submit_to_cluster.py --submit http://127.0.0.1:8265``
   submits this script itself through ``JobSubmissionClient`` and follows its logs.

3. Run the driver on a cluster node: ``ray start --head`` (and ``ray start --address ...`` on
   the others), then ``python examples/submit_to_cluster.py [key=value ...]``. The run config
   gets ``pipeline.ray_address=auto``, so ``asyncrl.run`` connects to the running cluster and
   leaves it up afterwards; actors and learner workers are scheduled across its nodes.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import asyncrl
from asyncrl.config import RunConfig, load_config

CONFIG = Path(__file__).resolve().parent / "configs" / "opd_tiny.yaml"


def build_config(overrides: list[str]) -> RunConfig:
    """The tiny OPD config pointed at the running cluster (``pipeline.ray_address=auto``)."""
    return load_config(CONFIG, ["run_dir=runs/cluster", "pipeline.ray_address=auto", *overrides])


def submit(address: str, overrides: list[str]) -> int:
    """Submit this script as a Ray job at ``address`` (the dashboard URL) and stream its logs."""
    import asyncio

    from ray.job_submission import JobStatus, JobSubmissionClient

    client = JobSubmissionClient(address)
    entrypoint = " ".join(["python", "examples/submit_to_cluster.py", *overrides])
    job_id = client.submit_job(entrypoint=entrypoint, runtime_env={"working_dir": str(CONFIG.parents[2])})
    print(f"submitted {job_id}: {entrypoint}")

    async def follow() -> None:
        async for lines in client.tail_job_logs(job_id):
            print(lines, end="")

    asyncio.run(follow())
    status = client.get_job_status(job_id)
    print(f"job {job_id}: {status}")
    return 0 if status == JobStatus.SUCCEEDED else 1


def main(argv: list[str] | None = None) -> int:
    """Run the tiny OPD config on the cluster this process can reach (``ray_address=auto``)."""
    parser = argparse.ArgumentParser(description="Run asyncrl on an existing Ray cluster.")
    parser.add_argument(
        "--submit", metavar="DASHBOARD_URL", help="submit as a Ray job instead of running here"
    )
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="config overrides")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    if args.submit:
        return submit(args.submit, args.overrides)
    result = asyncrl.run(build_config(args.overrides))
    print(f"done: {result.run_dir} ({result.summary['samples_per_s']} samples/s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
