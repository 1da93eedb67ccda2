"""A patch of ExecuTorch 1.5's quant fusion (`to_executorch`'s rewrite of dequantize +
embedding into its quantized embedding kernels).

`fusion.branch_delegates`: a delegate lowered inside a torch.cond branch (`--experts
chosen`: one per expert) is a submodule of the branch's graph module, which names it in a
`get_attr`. `to_executorch`'s quant fusion (run where quantized embeddings are rewritten)
rewrites patterns with torch.fx's subgraph rewriter, which then drops every submodule the root's
own graph does not name (`delete_all_unused_submodules`), the branches' delegates too; the
dead-code elimination that follows walks each branch and raised "references nonexistent
attribute lowered_module_0". The branches' submodules are noted before the pass and given back
before that elimination: the graphs and the program are what they would be had none been
dropped.
"""

from __future__ import annotations

import importlib

import torch

from . import Patch

_QUANT_FUSION = importlib.import_module("executorch.exir.passes.quant_fusion_pass")
_UPSTREAM_QUANT_FUSION_CALL = _QUANT_FUSION.QuantFusionPass.call
_UPSTREAM_REMOVE_DTYPE_GETATTR = _QUANT_FUSION._remove_dtype_getattr_nodes
_BRANCH_MODULES: list = []  # (branch graph module, name, module) while a QuantFusionPass runs


def _quant_fusion_call(self, graph_module: torch.fx.GraphModule):
    """Upstream's QuantFusionPass.call, the modules each branch graph module's `get_attr` nodes
    name (its delegates) noted first, for `_remove_dtype_getattr_nodes` to give back."""
    for child in graph_module.modules():
        if child is not graph_module and isinstance(child, torch.fx.GraphModule):
            _BRANCH_MODULES.extend(
                (child, node.target, getattr(child, node.target))
                for node in child.graph.find_nodes(op="get_attr")
                if "." not in node.target and isinstance(getattr(child, node.target, None),
                                                         torch.nn.Module))
    try:
        return _UPSTREAM_QUANT_FUSION_CALL(self, graph_module)
    finally:
        _BRANCH_MODULES.clear()


def _remove_dtype_getattr_nodes(model: torch.fx.GraphModule) -> None:
    """Upstream's, each branch's modules given back first: the pattern rewrites before it drop
    every submodule the root's own graph does not name (`delete_all_unused_submodules`), a
    branch's delegates too, which its graph still names."""
    for child, name, module in _BRANCH_MODULES:
        if not hasattr(child, name):
            setattr(child, name, module)
    _UPSTREAM_REMOVE_DTYPE_GETATTR(model)


def _install_quant_fusion() -> None:
    _QUANT_FUSION.QuantFusionPass.call = _quant_fusion_call
    _QUANT_FUSION._remove_dtype_getattr_nodes = _remove_dtype_getattr_nodes


def _restore_quant_fusion() -> None:
    _QUANT_FUSION.QuantFusionPass.call = _UPSTREAM_QUANT_FUSION_CALL
    _QUANT_FUSION._remove_dtype_getattr_nodes = _UPSTREAM_REMOVE_DTYPE_GETATTR


PATCHES = (
    Patch(name="fusion.branch_delegates", summary="quant fusion keeps the delegates "
          "of torch.cond branches, which its pattern rewrites dropped", written_for={
              "executorch": "1.5."}, pins={
              "executorch.exir.passes.quant_fusion_pass:QuantFusionPass.call":
                  "d7227181ced3dff7",
              "executorch.exir.passes.quant_fusion_pass:_remove_dtype_getattr_nodes":
                  "7705509362e564b1",
              "torch.fx.graph_module:GraphModule.delete_all_unused_submodules": "aa9dc7fa3c2c19fa"},
          install=_install_quant_fusion, restore=_restore_quant_fusion,
          installed=lambda: _QUANT_FUSION._remove_dtype_getattr_nodes
          is _remove_dtype_getattr_nodes),
)
