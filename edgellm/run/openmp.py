"""OpenMP's team size for running programs in a Python process.

In a Python process, ExecuTorch's LLM attention (`llama::custom_sdpa` of the pip wheel's AOT
library) multiplies through torch's BLAS from inside ExecuTorch's threadpool workers, and with
OpenMP's default team size each worker starts a team of its own on the cores XNNPACK's threads
already use: attention, and with it prefill, runs slower, for export_llm's program as for
edgellm's. ExecuTorch's C++ runner on a device has no second pool.
OpenMP reads the team size once, when torch loads it: `torch.set_num_threads` later reaches the
calling thread only, not the workers. So it has to be in the environment before torch is
imported, and since it also makes torch's own eager work single-threaded, it is set for the
commands that only run programs (bench, generate, chat, serve) and the speed benchmarks in
bench/, never for export.

Light on purpose: importing this module imports neither torch nor ExecuTorch.
"""

from __future__ import annotations

import os
import sys

VARIABLE = "OMP_NUM_THREADS"


def one_thread_per_team() -> str | None:
    """OMP_NUM_THREADS=1 for this process unless the user set it or torch is already imported
    (then OpenMP has read it). Returns the value OpenMP runs with, None for its default."""
    if "torch" not in sys.modules:
        os.environ.setdefault(VARIABLE, "1")
    return os.environ.get(VARIABLE)
