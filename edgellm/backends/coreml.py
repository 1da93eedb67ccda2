"""Core ML, for Apple devices. Static shapes (T=1); attention as ATen SDPA.

Where state lives is a policy, not an accident: with `state: io` (the default) KV caches and conv
states stay ExecuTorch mutable buffers and the delegate takes and returns them, which is what
ExecuTorch's open-source Core ML runtime executes; `state: coreml` turns every mutable buffer into a
Core ML state (iOS 18+) for apps whose runtime binds states. See pytorch/executorch #21855.
"""

from __future__ import annotations

from dataclasses import dataclass

from . import Backend

COMPUTE_UNITS = ("cpu_only", "cpu_and_gpu", "cpu_and_ne", "all")
PRECISIONS = ("fp16", "fp32")
MIN_IOS = (17, 18)
STATES = ("io", "coreml")


@dataclass(frozen=True)
class CoreMLOptions:
    min_ios: int = 18
    compute_units: str = "cpu_and_ne"
    precision: str = "fp16"
    state: str = "io"

    def problems(self) -> list[str]:
        out = []
        for name, value, allowed in (("min_ios", self.min_ios, MIN_IOS),
                                     ("compute_units", self.compute_units, COMPUTE_UNITS),
                                     ("precision", self.precision, PRECISIONS),
                                     ("state", self.state, STATES)):
            if value not in allowed:
                out.append(f"{name}: {value!r} is not one of {', '.join(map(str, allowed))}")
        if self.state == "coreml" and self.min_ios in MIN_IOS and self.min_ios < 18:
            out.append(f"state: 'coreml' needs min_ios 18 or later (Core ML states arrived in "
                       f"iOS 18), got min_ios {self.min_ios}; use state: io or min_ios: 18")
        return out


def compile_specs(options: CoreMLOptions) -> list:
    import coremltools as ct
    from executorch.backends.apple.coreml.compiler import CoreMLBackend

    units = {"cpu_only": ct.ComputeUnit.CPU_ONLY, "cpu_and_gpu": ct.ComputeUnit.CPU_AND_GPU,
             "cpu_and_ne": ct.ComputeUnit.CPU_AND_NE, "all": ct.ComputeUnit.ALL}
    return CoreMLBackend.generate_compile_specs(
        compute_unit=units[options.compute_units],
        minimum_deployment_target={17: ct.target.iOS17, 18: ct.target.iOS18}[options.min_ios],
        compute_precision={"fp16": ct.precision.FLOAT16,
                           "fp32": ct.precision.FLOAT32}[options.precision],
    )


def _partitioners(options: CoreMLOptions) -> list:
    from executorch.backends.apple.coreml.partition import CoreMLPartitioner

    return [CoreMLPartitioner(compile_specs=compile_specs(options),
                              take_over_mutable_buffer=options.state == "coreml")]


BACKEND = Backend(
    name="coreml",
    summary="Apple CPU/GPU/Neural Engine through Core ML; static shapes; builds here, runs on device",
    dynamic_shapes=False,
    attention="sdpa",
    norm="mean",
    make_partitioners=_partitioners,
    options=CoreMLOptions,
    requires=("coremltools", "executorch.backends.apple.coreml"),
    keeps_state_in_delegate=lambda options: options.state == "coreml",
)
