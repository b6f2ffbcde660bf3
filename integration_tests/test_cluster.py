"""Multi-node placement (simulated 2-node cluster) and `ray job submit` against a local head node."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from conftest import CACHE, REPO, tiny_config

from asyncrl.pipeline import run
from asyncrl.raysetup import RAY_ENV
from asyncrl.telemetry.summary import read_samples

pytestmark = [pytest.mark.ray, pytest.mark.slow]


def test_simulated_two_node_cluster(tiny_pair, tmp_path):
    """Actors spread over two nodes: generators pinned to one, teacher scorers to the other."""
    import ray
    from ray.cluster_utils import Cluster

    cluster = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 2, "resources": {"node_a": 1.0}},
    )
    cluster.add_node(num_cpus=2, resources={"node_b": 1.0})
    ray.init(address=cluster.address, runtime_env={"env_vars": dict(RAY_ENV)})
    try:
        nodes = [n for n in ray.nodes() if n["Alive"]]
        assert len(nodes) == 2
        cfg = tiny_config(
            tmp_path / "cluster",
            "pipeline.max_lag=1",
            "train.steps=4",
            "train.eval_every=0",
            "pipeline.generator_resources={node_a: 0.01}",
            "pipeline.scorer_resources={node_b: 0.01}",
        )
        result = run(cfg)
        samples = read_samples(result.run_dir)
        assert samples["kept"].sum() == 4 * cfg.train.batch_size
        node_ids = set(samples["gen_node"].unique()) | set(samples["score_node"].unique())
        assert len(node_ids) == 2, node_ids
    finally:
        ray.shutdown()
        cluster.shutdown()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_ray_job_submit_runs_example(tiny_pair, tmp_path):
    """`ray start --head` + `ray job submit -- python examples/opd_quickstart.py` to completion."""
    ray_bin = Path(sys.executable).with_name("ray")
    if not ray_bin.exists():
        ray_bin = Path(shutil.which("ray") or "ray")
    dash = _free_port()
    env = {**os.environ, **RAY_ENV, "ASYNCRL_CACHE_DIR": str(CACHE)}
    temp = Path(tempfile.mkdtemp(prefix="ray", dir="/tmp"))  # AF_UNIX socket paths must stay < 108 bytes
    start = subprocess.run(
        [
            str(ray_bin),
            "start",
            "--head",
            "--num-cpus=4",
            "--include-dashboard=true",
            f"--dashboard-port={dash}",
            "--dashboard-host=127.0.0.1",
            f"--port={_free_port()}",
            f"--temp-dir={temp}",
            "--disable-usage-stats",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert start.returncode == 0, start.stderr
    try:
        run_dir = tmp_path / "job_run"
        cmd = [
            str(ray_bin),
            "job",
            "submit",
            f"--address=http://127.0.0.1:{dash}",
            "--working-dir",
            str(REPO / "examples"),
            "--",
            sys.executable,
            "opd_quickstart.py",
            f"run_dir={run_dir}",
            "train.steps=3",
            "train.eval_every=0",
            "pipeline.ray_address=auto",
            f"workload.cache_dir={CACHE}",
        ]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=420)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        assert "succeeded" in (proc.stdout + proc.stderr).lower()
        assert (run_dir / "summary.json").exists()
    finally:
        subprocess.run([str(ray_bin), "stop", "--force"], env=env, capture_output=True, timeout=120)
        shutil.rmtree(temp, ignore_errors=True)
