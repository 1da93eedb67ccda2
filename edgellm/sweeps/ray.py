"""A sweep's exports as Ray tasks (`edgellm sweep --ray ADDRESS`, or `--ray local` for a cluster
started on this machine): each export is `sweeps.run_export` in a task that asks for one CPU and
its estimated peak as Ray's `memory` resource, so Ray starts on each node as many as fit; a
cluster of any size runs the sweep. Benchmarks are tasks too, one at a time after the exports.
On a cluster of several machines, the model and the sweep's folder must be on storage every node
sees at the same path (a task that cannot find them fails its row, saying so). Ray is the
optional extra `edgellm[ray]`."""

from __future__ import annotations

import os
from pathlib import Path

from ..errors import InputError


def _export_task(run_export, first_fields, job, output: str) -> dict:
    """run_export (sweeps.run_export) on a node, after checking the node sees the sweep's
    files."""
    missing = [p for p in (output, job.model) if not Path(p).exists()]
    if missing:
        return {**first_fields(job), "status": "failed", "error": f"{', '.join(missing)} not "
                "found on this node: a Ray sweep needs the model and the output folder on storage "
                "every node sees"}
    return run_export(job, output)


class RayRunner:
    """`exports` and `bench` as sweeps' local runner has them, each call a Ray task running
    `run_export` or `run_bench` (sweeps' own functions, handed over with `first_fields`: this
    module imports nothing of sweeps')."""

    def __init__(self, address: str, run_export, run_bench, first_fields):
        try:
            import ray
        except ModuleNotFoundError as e:
            raise InputError("--ray needs Ray: pip install 'edgellm[ray]'") from e
        self.ray, self.run_export, self.run_bench = ray, run_export, run_bench
        self.first_fields = first_fields
        if address == "local":
            ray.init(num_cpus=os.cpu_count(), include_dashboard=False, log_to_driver=False)
        else:
            ray.init(address=address, log_to_driver=False)
        # a task asking more memory than any node has would never start: the largest node's
        # share is the most a task asks, and such a task runs alone there
        nodes = [n["Resources"].get("memory", 0) for n in ray.nodes() if n.get("Alive")]
        self.largest = int(max(nodes, default=0))

    def _memory(self, job) -> int:
        want = job.estimate_mb * 2**20
        return min(want, self.largest) if self.largest else want

    def exports(self, jobs: list, output: str, say):
        task = self.ray.remote(_export_task)
        pending = {}
        for job in jobs:
            ref = task.options(num_cpus=1, memory=self._memory(job)).remote(
                self.run_export, self.first_fields, job, output)
            pending[ref] = job
        say(f"{len(jobs)} tasks submitted to Ray ({self.ray.cluster_resources().get('CPU', 0):.0f}"
            " CPUs in the cluster)")
        while pending:
            done, _ = self.ray.wait(list(pending), num_returns=1)
            del pending[done[0]]
            yield self.ray.get(done[0])

    def bench(self, name: str, output: str) -> dict:
        task = self.ray.remote(self.run_bench).options(num_cpus=1)
        return self.ray.get(task.remote(name, output))

    def close(self) -> None:
        self.ray.shutdown()
