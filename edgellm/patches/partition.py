"""A patch of ExecuTorch 1.5's group partitioner (`GroupBasedPartitioner`, which XNNPACK's
partitioner runs to keep each dynamically quantized linear's nodes in one partition).

`partition.lean_dependencies`: before merging partitions, the partitioner builds a
`_DependencyViewer`: for every node of the program, the set of every node downstream of it and
the set of every node upstream of it, the transitive closures, which hold about N^2 / 2 entries
each for a program of N nodes. On the embedded SmolLM2's 8da4w program (about 4,000 nodes) those
sets peak the whole export: lowering's memory grows with the square of the program. Only the
downstream sets are ever read, by `_can_merge_partitions`, and only to ask whether a partition
pair's outside users lead back into the pair. `_Downstreams` keeps each node's downstream nodes as
one integer bit mask over the program's nodes (N^2 bits in all), and the merge check asks the
same question of the masks: the same partitions, in the same order. The partitioner's base class
(torch.fx's `CapabilityBasedPartitioner`) builds torch.fx's own viewer of both closures in its
`__init__` before the group partitioner replaces it with its own: that one is never built either
(it peaked the embedded SmolLM2's export at 600 MB above its quantized model).
"""

from __future__ import annotations

import importlib

from . import Patch

_GROUPS = importlib.import_module(
    "executorch.exir.backend.canonical_partitioners.group_partitioner")
_UPSTREAM_VIEWER = _GROUPS._DependencyViewer
_UPSTREAM_CAN_MERGE = _GROUPS.GroupBasedPartitioner.__dict__["_can_merge_partitions"]
_UPSTREAM_INIT = _GROUPS.GroupBasedPartitioner.__dict__["__init__"]
_FX = importlib.import_module("torch.fx.passes.infra.partitioner")


class _Downstreams:
    """_DependencyViewer's downstream closure as bit masks: bit i of `masks[node]` is set when
    the program's i-th node is downstream of `node`. Nodes the program gained after it was built
    have no bits, as upstream's defaultdict gives them no downstream nodes."""

    def __init__(self, graph_module):
        nodes = list(graph_module.graph.nodes)
        self.nodes = nodes
        self.bit = {node: 1 << i for i, node in enumerate(nodes)}
        self.masks: dict = {}
        for node in reversed(nodes):  # users come later in a graph's order: already masked
            mask = 0
            for user in node.users:
                mask |= self.bit.get(user, 0) | self.masks.get(user, 0)
            self.masks[node] = mask

    def mask_of(self, nodes) -> int:
        mask = 0
        for node in nodes:
            mask |= self.bit.get(node, 0)
        return mask

    def downstreams_of(self, node) -> set:
        mask = self.masks.get(node, 0)
        return {n for n in self.nodes if mask & self.bit[n]}


def _can_merge_partitions(self, p1, p2, partitions_by_id):
    """Upstream's check, on masks: merging p1 and p2 would make a cycle when a node outside both
    that uses one of theirs leads back into either; then torch.fx's own check on the graph."""
    from torch.fx.passes.utils.fuser_utils import validate_partition

    combined = set(partitions_by_id[p1].nodes) | set(partitions_by_id[p2].nodes)
    viewer = self.dependency_viewer
    inside = viewer.mask_of(combined)
    for node in combined:
        for user in node.users:
            if user not in combined and viewer.masks.get(user, 0) & inside:
                return False
    return validate_partition(list(combined))


def _init(self, graph_module, *args, **kwargs):
    """Upstream's, with its base class's viewer (which it replaces with `_Downstreams`) not built:
    torch.fx's viewer holds both closures as sets."""
    fx_viewer = _FX._DependencyViewer
    _FX._DependencyViewer = lambda graph_module: None
    try:
        _UPSTREAM_INIT(self, graph_module, *args, **kwargs)
    finally:
        _FX._DependencyViewer = fx_viewer


def _install() -> None:
    _GROUPS._DependencyViewer = _Downstreams
    _GROUPS.GroupBasedPartitioner._can_merge_partitions = _can_merge_partitions
    _GROUPS.GroupBasedPartitioner.__init__ = _init


def _restore() -> None:
    _GROUPS._DependencyViewer = _UPSTREAM_VIEWER
    _GROUPS.GroupBasedPartitioner._can_merge_partitions = _UPSTREAM_CAN_MERGE
    _GROUPS.GroupBasedPartitioner.__init__ = _UPSTREAM_INIT


PATCHES = (
    Patch(name="partition.lean_dependencies", summary="the group partitioner keeps each node's "
          "downstream nodes as a bit mask instead of sets of every node up and downstream",
          written_for={"executorch": "1.5.", "torch": "2.13."}, pins={
              "torch.fx.passes.infra.partitioner:CapabilityBasedPartitioner.__init__":
              "657423ae157fa2dd",
              "executorch.exir.backend.canonical_partitioners.group_partitioner:"
              "_DependencyViewer": "a6d3ee37edb6ec3a",
              "executorch.exir.backend.canonical_partitioners.group_partitioner:"
              "GroupBasedPartitioner._can_merge_partitions": "08428a6ba5abd129",
              "executorch.exir.backend.canonical_partitioners.group_partitioner:"
              "GroupBasedPartitioner.__init__": "800c1d1276830fcb"},
          install=_install, restore=_restore,
          installed=lambda: _GROUPS._DependencyViewer is _Downstreams),
)
