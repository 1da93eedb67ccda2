"""Core ML payloads inside a written .pte: read without deserializing the program, described for
the report, checked against the state policy, and rewritten so that the same export gives the same
bytes.

Reading: ExecuTorch stores each Core ML delegate as an mlpackage flattened into one payload
(`flatten_directory_contents`, which appends a JSON index of its files); the spec
(model.mlmodel) is parsed where that index says it lies. Rewriting, in place and at the same
length: coremltools writes the spec's protobuf maps in an order that changes from process to
process (`canonical_specs`), and ExecuTorch and coremltools name payloads and manifest entries by
fresh uuid4s, which become identifiers derived from the file's content
(`repeatable_identifiers`).
"""

from __future__ import annotations

import hashlib
import json
import re
import uuid
from collections import Counter
from pathlib import Path

from ..errors import VerificationError

TARGETS = {8: "iOS17", 9: "iOS18"}  # coremltools' ct.target values in the compile specs


def inspect_delegates(pte: Path, policy: str, states: dict) -> list[dict]:
    """Open every Core ML delegate payload of the written program (an mlpackage coremltools reads
    on Linux), describe it for the report and check where state ended up against the state
    `policy` ("io" or "coreml"). `states` is {method: {buffer fqn: {"shape", "dtype",
    "kept_by_executorch"}}}, taken from the exported programs. Raises VerificationError naming
    every buffer in the wrong place."""
    entries = describe_payloads(pte)
    problems = [p for e in entries for p in _lint(e, policy, states.get(e["method"], {}))]
    if problems:
        raise VerificationError(
            f"The Core ML delegate disagrees with state policy '{policy}': "
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
    (written in key order, so the entries' order changes too); nothing else differs between two
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
    """Offsets of the uuid4s in `data`. A regex scan would try every byte of the weights; every
    uuid4 has "-4" at offset 13, which `find` skips to at memory speed."""
    at = data.find(b"-4", 13)
    while at != -1:
        if UUID.match(data, at - 13):
            yield at - 13
        at = data.find(b"-4", at + 1)
