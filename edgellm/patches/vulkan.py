"""Vulkan lowering in ExecuTorch 1.5: the pattern graphs its fusion passes match, built once.

`vulkan.cached_patterns`: the Vulkan partitioner and its `FusePatternsPass` (once per partition)
ask `all_fusable_graph_patterns` / `replace_all_fusable_subgraphs` for every registered pattern
graph, and each asks the function the pattern registry holds. ExecuTorch caches those functions
with `lru_cache`, but registers them before the cache wraps them, so the registry calls the bare
function: every call exports and lowers small RoPE modules again (`to_edge`), for every
partition of every export. The patch puts a cached function in each registry entry: the
same graphs, built once a process. Matching never changes a pattern graph, so sharing them
changes no byte.
"""

from __future__ import annotations

import functools

from executorch.backends.vulkan.patterns.pattern_registry import fusable_patterns

from . import Patch

_UPSTREAM: dict[str, object] = {}  # pattern name -> the registry's own function


def _install() -> None:
    for name, entry in fusable_patterns.items():
        if entry.get_graphs_fn is not None and name not in _UPSTREAM:
            _UPSTREAM[name] = entry.get_graphs_fn
            entry.get_graphs_fn = functools.cache(entry.get_graphs_fn)


def _restore() -> None:
    for name, upstream in _UPSTREAM.items():
        fusable_patterns[name].get_graphs_fn = upstream
    _UPSTREAM.clear()


PATTERNS = "executorch.backends.vulkan.patterns"
PATCHES = (
    Patch(name="vulkan.cached_patterns", summary="the Vulkan fusion passes' pattern graphs are "
          "built once a process, not once per partition", written_for={"executorch": "1.5."},
          pins={f"{PATTERNS}.pattern_registry:register_pattern_graph": "5b9574affcf368aa",
                f"{PATTERNS}:all_fusable_graph_patterns": "53dfdc9abff2f1ef",
                f"{PATTERNS}:replace_all_fusable_subgraphs": "d989df75ddd2a182"},
          install=_install, restore=_restore, installed=lambda: bool(_UPSTREAM)),
)
