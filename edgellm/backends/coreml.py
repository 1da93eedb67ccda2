"""Core ML, for Apple devices. Static shapes (T=1); attention as ATen SDPA.

Where state lives is a policy, not an accident: with `state: io` (the default) KV caches and conv
states stay ExecuTorch mutable buffers and the delegate takes and returns them, which is what
ExecuTorch's open-source Core ML runtime executes; `state: coreml` turns every mutable buffer into a
Core ML state (iOS 18+) for apps whose runtime binds states. See pytorch/executorch #21855.
"""

from __future__ import annotations

import hashlib
import json
import re
import uuid
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from ..errors import VerificationError
from . import Backend, switch_workarounds

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


def config_problems(cfg, options: CoreMLOptions) -> list[str]:
    from ..quantize import coreml_problems

    out = coreml_problems(cfg, options.min_ios)
    if cfg.prefill_chunk and options.state == "coreml":
        out.append("prefill_chunk with coreml.state: coreml: Core ML states live inside each "
                   "method's delegate, so prefill and forward would not share the cache. Use "
                   "coreml.state: io (the default) or prefill_chunk: 0")
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

    _lean_lowering()
    _fresh_op_names()
    return [CoreMLPartitioner(compile_specs=compile_specs(options),
                              take_over_mutable_buffer=options.state == "coreml")]


def _fresh_op_names() -> None:
    """MIL op names count from zero in this export's conversion, as in a fresh process.
    coremltools numbers ops by a class-level counter that it clears after each conversion, not
    before, so a MIL program built earlier in the process (outside `ct.convert`) renamed every op
    of the next conversion, and the payload's content-derived identifier with them."""
    try:
        from coremltools.converters.mil.converter import _reset_conversion_state
    except ImportError:  # another coremltools: its conversions number ops their own way
        return
    _reset_conversion_state()


def _lean_lowering() -> None:
    """Install (or, with EDGELLM_UPSTREAM_COPIES=1, remove) the workarounds in coreml_lean.py,
    which save a copy of the weights and coremltools' temporaries while lowering (LFM2.5-350M fp32
    lower stage: 6.8 -> 2.9 GB with the checkpoint's pages dropped, 25 -> 14 s; docs/design.md)
    and give the same .pte. They patch
    ExecuTorch 1.5's and coremltools 9's internals, so other versions lower as those do. Called
    each time partitioners are made; idempotent."""
    import coremltools
    from executorch.version import __version__

    switch_workarounds("coreml_lean", __version__.startswith("1.5.")
                       and coremltools.__version__.startswith("9."))


# --- What the program ships: each Core ML payload, described and checked against the policy ----

TARGETS = {8: "iOS17", 9: "iOS18"}  # coremltools' ct.target values in the compile specs


def inspect_delegates(pte: Path, options: CoreMLOptions, states: dict) -> list[dict]:
    """Open every Core ML delegate payload of the written program (an mlpackage coremltools reads
    on Linux), describe it for the report and check where state ended up against `options.state`.
    `states` is {method: {buffer fqn: {"shape", "dtype", "kept_by_executorch"}}}, taken from the
    exported programs. Raises VerificationError naming every buffer in the wrong place."""
    entries = describe_payloads(pte)
    problems = [p for e in entries for p in _lint(e, options.state, states.get(e["method"], {}))]
    if problems:
        raise VerificationError(
            f"The Core ML delegate disagrees with state policy '{options.state}': "
            + "; ".join(problems) + ". This is an edgellm bug; please report it with report.json.")
    return entries


def describe_payloads(pte: Path) -> list[dict]:
    """What every Core ML delegate of any .pte holds (edgellm's or another exporter's): method,
    compile settings, inputs, outputs, states and MIL operations."""
    return [{"method": method, "index": index, **_compile_settings(specs),
             **_describe(spec, method)} for method, index, specs, spec in _model_specs(pte)]


def _regions(pte: Path) -> list[tuple[str, int, list, tuple[int, int] | bytes]]:
    """(method, delegate index, compile specs, payload) for every Core ML delegate, the payload
    as (file offset, size) when it lies in a segment (ExecuTorch's default), else its bytes. A
    multifunction delegate's reference into the named data is followed. Only the program's
    flatbuffer is read: deserializing the whole program would hold every segment twice."""
    from executorch.exir._serialize._program import (_flatbuffer_to_program,
                                                      _get_extended_header)
    from executorch.exir.schema import DataLocation

    with open(pte, "rb") as f:
        header = _get_extended_header(f.read(64))
        f.seek(0)
        program = _flatbuffer_to_program(f.read(header.program_size) if header else f.read())
        base = header.segment_base_offset if header else 0

        def segment(i: int) -> tuple[int, int]:
            return base + program.segments[i].offset, program.segments[i].size

        named = {e.key: e.segment_index for e in program.named_data or ()}
        out = []
        for plan in program.execution_plan:
            for index, delegate in enumerate(plan.delegates):
                if delegate.id != "CoreMLBackend":
                    continue
                ref = delegate.processed
                payload = (segment(ref.index) if ref.location == DataLocation.SEGMENT
                           else program.backend_delegate_data[ref.index].data)
                head = _read(f, payload, 4) if isinstance(payload, tuple) else payload[:4]
                if head == b"CMJR":  # multifunction: a reference into the named data
                    reference = _read(f, payload) if isinstance(payload, tuple) else payload
                    payload = segment(named[json.loads(reference[4:])["key"]])
                out.append((plan.name, index, delegate.compile_specs, payload))
    return out


def _read(f, region: tuple[int, int], size: int | None = None) -> bytes:
    f.seek(region[0])
    return f.read(region[1] if size is None else min(size, region[1]))


def _model_specs(pte: Path):
    """(method, delegate index, compile specs, Core ML model spec) for every Core ML delegate.
    The spec (model.mlmodel) is read straight from the payload through its index; a payload
    without one is unpacked into a temporary folder for coremltools to read."""
    import io
    import tempfile

    import coremltools as ct
    from coremltools.proto import Model_pb2
    from executorch.backends.apple.coreml import executorchcoreml

    with open(pte, "rb") as f, tempfile.TemporaryDirectory(prefix="edgellm-coreml-") as tmp:
        for method, index, specs, payload in _regions(pte):
            source, region = (f, payload) if isinstance(payload, tuple) else (
                io.BytesIO(payload), (0, len(payload)))
            files = _mlmodel_files(source, region)
            if files:
                spec = Model_pb2.Model()
                spec.ParseFromString(_read(source, files[0]))
                yield method, index, specs, spec
                continue
            folder = Path(tmp) / f"{method}-{index}"
            folder.mkdir()
            if not executorchcoreml.unflatten_directory_contents(_read(source, region),
                                                                 str(folder)):
                raise VerificationError(f"Could not unpack Core ML delegate {index} of "
                                        f"method {method}")
            package = next(folder.rglob("*.mlpackage"))
            yield method, index, specs, ct.models.MLModel(str(package),
                                                          skip_model_load=True).get_spec()


def _mlmodel_files(f, payload: tuple[int, int]) -> list[tuple[int, int]]:
    """Where the payload's .mlmodel files lie in `f`, from the index `flatten_directory_contents`
    appends to it (JSON, reversed); [] for a payload without one."""
    start, size = payload
    tail = _read(f, (start + size - min(size, 1 << 20), min(size, 1 << 20)))
    try:
        index, _ = json.JSONDecoder().raw_decode(tail[::-1].decode("utf-8", "replace"))
        return [(start + n["dataRegion"]["offset"], n["dataRegion"]["size"])
                for n in index["nodes"] if n["kind"] == 0 and n["name"].endswith(".mlmodel")]
    except (ValueError, KeyError, TypeError):
        return []


def canonical_specs(pte: Path) -> int:
    """Rewrite, in place, each Core ML payload's model.mlmodel with protobuf's deterministic
    serialization (map entries sorted by key): coremltools writes the spec's maps (metadata,
    every op's inputs and attributes) in an order that changes from process to process. Same
    content, same length. The file is found through the index `flatten_directory_contents`
    appends to the payload (JSON, reversed); a payload without one is left alone. Returns how
    many specs were rewritten."""
    from coremltools.proto import Model_pb2

    rewritten = 0
    with open(pte, "r+b") as f:
        done = set()
        for *_, payload in _regions(pte):
            if not isinstance(payload, tuple) or payload in done:
                continue
            done.add(payload)
            for at in _mlmodel_files(f, payload):
                data = _read(f, at)
                spec = Model_pb2.Model()
                spec.ParseFromString(data)
                canonical = spec.SerializeToString(deterministic=True)
                if canonical != data and len(canonical) == len(data):
                    f.seek(at[0])
                    f.write(canonical)
                    rewritten += 1
    return rewritten


def finish_program(pte: Path) -> dict[str, str]:
    """Make a written Core ML program's bytes a function of its content: canonical specs, then
    content-derived identifiers. Returns the identifiers replaced, {old: new}."""
    canonical_specs(pte)
    return repeatable_identifiers(pte)


def _compile_settings(specs) -> dict:
    values = {s.key: bytes(s.value).decode() for s in specs}
    target = values.get("min_deployment_target", "")
    return {"compute_units": values.get("compute_units"),
            "precision": values.get("model_compute_precision"),
            "min_deployment_target": TARGETS.get(int(target), target) if target else None}


def _describe(spec, method: str) -> dict:
    """Inputs, outputs and states with shapes and dtypes; MIL operations (constants excluded).
    A multifunction package (several methods sharing weights) is described for `method`."""
    from coremltools.proto import FeatureTypes_pb2

    dtype_name = FeatureTypes_pb2.ArrayFeatureType.ArrayDataType.Name

    def features(items, state=False):
        out = []
        for f in items:
            array = f.type.stateType.arrayType if state else f.type.multiArrayType
            out.append({"name": f.name, "shape": list(array.shape),
                        "dtype": dtype_name(array.dataType).lower()})
        return out

    functions = spec.mlProgram.functions
    name = method if method in functions else "main"
    ops = Counter()
    for block in functions[name].block_specializations.values():
        _count_ops(block, ops)
    mil = {op: n for op, n in sorted(ops.items()) if op != "const"}
    d = next((f for f in spec.description.functions if f.name == name), spec.description)
    return {"inputs": features(d.input), "outputs": features(d.output),
            "states": features(d.state, state=True), "functions": sorted(functions),
            "mil_ops": sum(mil.values()), "mil_histogram": mil}


def _count_ops(block, ops: Counter) -> None:
    for op in block.operations:
        ops[op.type] += 1
        for inner in op.blocks:
            _count_ops(inner, ops)


def _lint(entry: dict, policy: str, states: dict) -> list[str]:
    """Where every mutable buffer of the method must be under the policy, and where it is.
    Core ML names a buffer input `b_<fqn with dots as _>` and a state `<fqn with dots as _>`."""
    inputs = {f["name"]: f["shape"] for f in entry["inputs"]}
    core_states = {f["name"]: f["shape"] for f in entry["states"]}
    known = {fqn.replace(".", "_") for fqn in states}
    wrong = [f"state {name} belongs to no mutable buffer of the program"
             for name in sorted(set(core_states) - known)]
    for fqn, buf in sorted(states.items()):
        name = fqn.replace(".", "_")
        as_input, as_state = inputs.get(f"b_{name}"), core_states.get(name)
        if policy == "io":
            if as_state is not None or not buf["kept_by_executorch"]:
                wrong.append(f"{fqn} became a Core ML state, not a delegate input and output")
            elif as_input is not None and as_input != buf["shape"]:
                wrong.append(f"{fqn} enters the delegate as {as_input}, not {buf['shape']}")
        else:
            if as_state is None or buf["kept_by_executorch"]:
                wrong.append(f"{fqn} stayed an ExecuTorch buffer"
                             + (" passed in and out of the delegate" if as_input else "")
                             + ", not a Core ML state")
            elif as_state != buf["shape"]:
                wrong.append(f"{fqn} is a Core ML state of shape {as_state}, not {buf['shape']}")
    return wrong


UUID = re.compile(rb"[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}")
MANIFEST = b'{\n    "fileFormatVersion": "1.0.0",\n    "itemInfoEntries": {'


def repeatable_identifiers(pte: Path, chunk: int = 64 << 20) -> dict[str, str]:
    """Make a Core ML program's bytes a function of its content. ExecuTorch names each payload
    `executorch_<uuid4>`, and coremltools keys the mlpackage manifest's entries by fresh uuid4s
    (written in key order, so the entries' order changes too); nothing else differed between two
    exports of the same model. Every uuid becomes one derived from a hash of the file with the
    uuids masked and each manifest in a canonical order; manifests are rewritten with the new keys
    in the same format (same length, so every offset in the program stays valid). The same inputs
    give the same bytes, different content different identifiers (the device's compiled-model
    cache keys on them). Returns {old: new}."""
    found, manifests = _scan(pte, chunk)
    blocks = []
    with open(pte, "r+b") as f:
        for start in manifests:
            f.seek(start)
            text = f.read(1 << 20).decode("utf-8", "replace")
            obj, end = json.JSONDecoder().raw_decode(text)
            blocks.append((start, len(text[:end].encode()), obj))
        inside = {o for o in found for s, n, _ in blocks if s <= o < s + n}
        masked = [(o, 36) for o in found] + [(s, n) for s, n, _ in blocks]
        digest = hashlib.sha256()
        f.seek(0)
        base = 0
        while block := bytearray(f.read(chunk)):
            for start, n in masked:
                lo, hi = max(start, base) - base, min(start + n, base + len(block)) - base
                if lo < hi:
                    block[lo:hi] = bytes(hi - lo)
            digest.update(block)
            base += len(block)
        for _, _, obj in blocks:  # the manifests without their keys, entries by path
            digest.update(json.dumps(sorted(obj["itemInfoEntries"].values(),
                                            key=lambda e: e["path"])).encode())
        seed = digest.digest()

        def derived(*parts) -> str:
            h = hashlib.sha256(seed + repr(parts).encode()).digest()
            return str(uuid.UUID(bytes=h[:16], version=4))

        mapping: dict[str, str] = {}
        for o in sorted(found - inside):
            f.seek(o)
            old = f.read(36).decode()
            mapping.setdefault(old, derived("id", len(mapping)))
            f.seek(o)
            f.write(mapping[old].encode())
        for i, (start, n, obj) in enumerate(blocks):
            entries = obj["itemInfoEntries"]
            keys = {k: derived("manifest", i, e["path"]) for k, e in entries.items()}
            mapping.update(keys)
            obj["itemInfoEntries"] = {keys[k]: e for k, e in entries.items()}
            obj["rootModelIdentifier"] = keys.get(obj.get("rootModelIdentifier"),
                                                  obj.get("rootModelIdentifier"))
            text = json.dumps(obj, indent=4, sort_keys=True).encode()
            if len(text) != n:  # not coremltools' format after all: leave this one alone
                continue
            f.seek(start)
            f.write(text)
    return mapping


def _scan(pte: Path, chunk: int) -> tuple[set[int], list[int]]:
    """Offsets of every uuid and of every mlpackage manifest in the file, read in chunks (the
    file can be gigabytes; keep it out of resident memory)."""
    found: set[int] = set()
    manifests: set[int] = set()
    with open(pte, "rb") as f:
        base, tail = 0, b""
        while block := f.read(chunk):
            data, start = tail + block, base - len(tail)
            found.update(start + at for at in _uuids(data))
            at = data.find(MANIFEST)
            while at != -1:
                manifests.add(start + at)
                at = data.find(MANIFEST, at + 1)
            tail, base = data[-len(MANIFEST):], base + len(block)
    return found, sorted(manifests)


def _uuids(data: bytes):
    """Offsets of the uuid4s in `data`. A regex scan tries every byte of the weights (7 s for
    700 MB); every uuid4 has "-4" at offset 13, which `find` skips to at memory speed."""
    at = data.find(b"-4", 13)
    while at != -1:
        if UUID.match(data, at - 13):
            yield at - 13
        at = data.find(b"-4", at + 1)


BACKEND = Backend(
    name="coreml",
    summary="Apple CPU/GPU/Neural Engine through Core ML; static shapes; builds here, runs on device",
    dynamic_shapes=False,
    runs_here=False,  # the Linux runtime has no such backend; programs run on device
    make_partitioners=_partitioners,
    # What Core ML receives follows how the model is written (../shared/reference/
    # lowering-findings.md and docs/design.md): one ATen node per norm whose weight is folded into
    # the next linear where one follows, q and k heads normalized and rotated together, RoPE as
    # one matmul, the short conv as a time-major multiply-and-sum without transposes.
    writing={"attention": "sdpa", "norm": "rms_norm", "rope": "matrix", "conv": "window",
             "fold_norms": True, "fuse_qk": True},
    options=CoreMLOptions,
    requires=("coremltools", "executorch.backends.apple.coreml"),
    inspect_delegates=inspect_delegates,
    config_problems=config_problems,
    finish_program=finish_program,
)
