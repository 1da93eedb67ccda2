"""Core ML, for Apple devices. Static shapes (T=1); attention as ATen SDPA.

Where state lives is a policy, not an accident: with `state: io` KV caches and conv states stay
ExecuTorch mutable buffers and the delegate takes and returns them on every call, which is what
ExecuTorch's open-source Core ML runtime executes; `state: coreml` turns every mutable buffer into a
Core ML state (iOS 18+) for apps whose runtime binds states (see pytorch/executorch #21855).
`state: auto` (the default) settles on one by what `io` moves per decode call at the exported
context (`settle`), and the report says which and why.

What a written program's Core ML payloads hold, and the rewrite that makes them repeatable, is
coreml_payload.py; lowering runs with edgellm's Core ML patches (edgellm/patches/coreml.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from .base import Backend

COMPUTE_UNITS = ("cpu_only", "cpu_and_gpu", "cpu_and_ne", "all")
PRECISIONS = ("fp16", "fp32")
MIN_IOS = (17, 18)
STATES = ("auto", "io", "coreml")


@dataclass(frozen=True)
class CoreMLOptions:
    min_ios: int = 18
    compute_units: str = "cpu_and_ne"
    precision: str = "fp16"
    state: str = "auto"

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


def config_problems(cfg, options: CoreMLOptions) -> list[str]:
    out = _weights_before_ios18(cfg, options.min_ios)
    if cfg.prefill_chunk and options.state == "coreml":
        out.append("prefill_chunk with coreml.state: coreml: Core ML states live inside each "
                   "method's delegate, so prefill and forward would not share the cache. Use "
                   "coreml.state: io (the default) or prefill_chunk: 0")
    return out


def settle(cfg, options: CoreMLOptions, state_bytes: int, weight_bytes: int) -> tuple:
    """`state: auto` made io or coreml, and what each policy moves in and out of the delegate per
    decode call: under io every mutable buffer (`state_bytes`) enters and leaves, under coreml
    none. Auto keeps io (which every ExecuTorch Core ML runtime executes) unless those copies
    exceed the weights a decode step reads (`weight_bytes`): past that, at long contexts, io would
    more than double a step's memory traffic. Returns (options, report entry)."""
    from dataclasses import replace

    moved = {"io": {"in": state_bytes, "out": state_bytes}, "coreml": {"in": 0, "out": 0}}
    mb = f"{2 * state_bytes / 1e6:.1f} MB in and out per decode call"
    if options.state != "auto":
        policy, why = options.state, "asked for (coreml.state)"
    elif cfg.prefill_chunk:
        policy, why = "io", ("prefill_chunk: prefill and forward share their caches only as "
                             "ExecuTorch buffers")
    elif options.min_ios < 18:
        policy, why = "io", "Core ML states need min_ios 18"
    elif 2 * state_bytes > weight_bytes:
        policy, why = "coreml", (f"io would move {mb}, more than the {weight_bytes / 1e6:.1f} MB "
                                 "of weights a step reads; the caches stay inside Core ML. It "
                                 "needs a runtime that binds Core ML states (ExecuTorch's pip "
                                 "runtime does not, pytorch/executorch#21855); coreml.state=io "
                                 "keeps them ExecuTorch buffers")
    else:
        policy, why = "io", (f"io moves {mb}, {2 * state_bytes / weight_bytes:.0%} of the "
                             f"{weight_bytes / 1e6:.1f} MB of weights a step reads; io runs on "
                             "every ExecuTorch Core ML runtime")
    return replace(options, state=policy), {"bytes_per_decode_call": moved,
                                            "state_policy": policy, "reason": why}


def _weights_before_ios18(cfg, min_ios: int) -> list[str]:
    """Core ML stores 4-bit and block-wise weights from iOS 18 (constexpr_blockwise_shift_scale);
    below it only 8-bit per channel (constexpr_affine_dequantize)."""
    from ..quantize.recipes import RECIPES, group_of, parse_embedding

    out = []
    if min_ios >= 18:
        return out
    if cfg.quantize in RECIPES and (RECIPES[cfg.quantize].bits == 4 or group_of(cfg) > 0):
        out.append(f"quantize: {cfg.quantize} with group_size {group_of(cfg)} needs "
                   f"coreml.min_ios 18 (4-bit and block-wise weights arrive in iOS 18), not "
                   f"{min_ios}; set coreml.min_ios=18 or use 8w per channel (group_size 0)")
    if cfg.embedding_quantize is not None:
        try:
            bits, group = parse_embedding(cfg.embedding_quantize)
        except ValueError:
            return out
        if bits == 4 or group > 0:
            out.append(f"embedding_quantize: {cfg.embedding_quantize!r} needs coreml.min_ios 18 "
                       f"(4-bit and block-wise weights arrive in iOS 18), not {min_ios}; set "
                       "coreml.min_ios=18 or use '8,0'")
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


# backend.coreml.quantize of export_llm -> (recipe, group_size)
QUANTIZE = {"b4w": ("4w", 32), "c4w": ("4w", 0)}


def _from_executorch(fields: dict) -> tuple[dict, dict, list[str]]:
    """export_llm's backend.coreml fields onto Core ML options: `ios` is min_ios,
    `enable_state` the state policy, `quantize` a recipe; `preserve_sdpa` is what edgellm does
    from iOS 18 on and cannot do below it."""
    options, recipes, problems = {}, {}, []
    for theirs, ours in (("ios", "min_ios"), ("compute_units", "compute_units")):
        if theirs in fields:
            options[ours] = fields.pop(theirs)
    if "enable_state" in fields:
        options["state"] = "coreml" if fields.pop("enable_state") else "io"
    if fields.get("quantize") in QUANTIZE:
        recipes["backend.coreml.quantize"] = QUANTIZE[fields.pop("quantize")]
    preserve, ios = fields.pop("preserve_sdpa", None), options.get("min_ios", 18)
    if preserve is True and isinstance(ios, int) and ios < 18:
        problems.append(f"backend.coreml.preserve_sdpa: true needs ios 18 or later (Core ML's "
                        f"fused attention op), got ios {ios}")
    if preserve is False and isinstance(ios, int) and ios >= 18:
        problems.append("backend.coreml.preserve_sdpa: false is not supported with ios 18; "
                        "edgellm hands Core ML fused attention from iOS 18 on. Set ios: 17 for "
                        "decomposed attention")
    return options, recipes, problems


def _inspect(pte: Path, options: CoreMLOptions, states: dict) -> list[dict]:
    from .coreml_payload import inspect_delegates

    return inspect_delegates(pte, options.state, states)


def _finish(pte: Path) -> None:
    from .coreml_payload import finish_program

    finish_program(pte)


BACKEND = Backend(
    name="coreml",
    summary="Apple CPU/GPU/Neural Engine through Core ML; static shapes; builds here, runs on "
            "device",
    dynamic_shapes=False,
    runs_here=False,  # the Linux runtime has no such backend; programs run on device
    build_bytes_per_parameter=2,  # the MIL program's fp16 copy of the weights
    make_partitioners=_partitioners,
    # What Core ML receives follows how the model is written (../shared/reference/
    # lowering-findings.md and docs/design.md): one ATen node per norm whose weight is folded into
    # the next linear where one follows, q and k heads normalized and rotated together, RoPE as
    # one matmul, the short conv as a time-major multiply-and-sum without transposes.
    writing={"attention": "sdpa", "norm": "rms_norm", "rope": "matrix", "conv": "window",
             "fold_norms": True, "fuse_qk": True},
    options=CoreMLOptions,
    requires=("coremltools", "executorch.backends.apple.coreml"),
    recipes=("4w", "8w"),
    quantized_embeddings=True,
    kv_caches={"int8": "ExecuTorch's int8 cache is read by llama::custom_quantized_sdpa, a CPU "
                       "kernel that coremltools cannot convert, and Core ML has no int8 "
                       "attention; its caches are fp16 (precision) and `coreml.state: coreml` "
                       "keeps them inside Core ML"},
    quantized_experts=(
        "Core ML would hold quantized experts as constants it dequantizes whole (every expert "
        "in fp16), and ExecuTorch's llama::quantized_moe_ffn runs outside Core ML, which would "
        "cut the model into a delegate per layer; export without --quantize (float experts, "
        "gathered per token inside one Core ML delegate) or for xnnpack with 8da4w"),
    external_weights=("its weights are inside the compiled Core ML model it delegates to, which "
                      "ExecuTorch 1.5.1 cannot write into a data file"),
    patches=("coreml",),
    from_executorch=_from_executorch,
    inspect_delegates=_inspect,
    config_problems=config_problems,
    settle=settle,
    finish_program=_finish,
)
