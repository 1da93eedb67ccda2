"""Patches: every place edgellm replaces an internal of ExecuTorch, coremltools, torchao or torch.

Each patch makes quantization or lowering cheaper (fewer copies of the weights, fewer retraces,
fewer checks that change nothing, work in cache-sized blocks) or repeatable, and gives the bytes
upstream's code would give. A module of this package declares its patches as `Patch` objects:
the upstream versions it was written against, the upstream functions it replaces or relies on,
each pinned by a digest of its source (a test compares them: a function that changed upstream
fails it, and the patch is not applied), and how to install it and put upstream's back.

`apply(names)` installs each patch that applies here and restores upstream where one does not:
versions differ, a pinned function changed, or the environment turns it off with
`EDGELLM_NO_PATCHES=all` or a comma-separated list of patch names or modules
(`xnnpack.shared_weights`, `coreml`). Names are `<module>.<patch>`; a module is imported only
when one of its patches is asked for, so Core ML's are never imported for XNNPACK. Inside
`scope()` (an export runs in one) every patch `apply` installs is taken off again when the block
ends, also when it fails: a Python caller gets upstream's functions back.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import importlib.metadata
import inspect
import os
from dataclasses import dataclass, field
from typing import Callable

from ..errors import InputError

SWITCH = "EDGELLM_NO_PATCHES"
MODULES = ("xnnpack", "coreml", "vulkan", "exir", "fusion", "partition", "emit", "torchao")
_SCOPES: list[list] = []  # per open scope(), the patches apply() installed in it


@dataclass(frozen=True)
class Patch:
    name: str  # "<module>.<patch>"
    summary: str
    written_for: dict  # {distribution: version prefix}: {"executorch": "1.5."}
    # {"package.module:Qualified.name": digest of its source}: what it replaces or relies on
    pins: dict
    install: Callable[[], None]
    restore: Callable[[], None]
    installed: Callable[[], bool]
    # the digests of what is installed here, read when the patch is declared: its module is
    # imported before any of its patches is installed, so these are upstream's
    found: dict = field(init=False, repr=False)

    def __post_init__(self):
        object.__setattr__(self, "found", {p: source_digest(resolve(p)) for p in self.pins})

    def changed(self) -> list[str]:
        """The pinned upstream functions whose source is not what this patch was written for."""
        return [pin for pin, digest in self.pins.items() if self.found[pin] != digest]

    def mismatched_versions(self) -> list[str]:
        return [f"{dist} {installed_version(dist)} (written for {prefix}x)"
                for dist, prefix in self.written_for.items()
                if not installed_version(dist).startswith(prefix)]


def replacing(owner, name: str, ours) -> dict:
    """A Patch's install, restore and installed for one attribute of `owner` (a module or class)
    replaced by `ours`: upstream's is the one there when the patch module is imported, before
    any install."""
    upstream = vars(owner)[name]  # a class's own entry: a staticmethod stays one
    return dict(install=lambda: setattr(owner, name, ours),
                restore=lambda: setattr(owner, name, upstream),
                installed=lambda: vars(owner).get(name) is ours)


def source_digest(obj) -> str:
    """The first 16 hex digits of the sha256 of an object's source."""
    return hashlib.sha256(inspect.getsource(obj).encode()).hexdigest()[:16]


def resolve(path: str):
    """'package.module:Class.attribute' -> the object."""
    module, _, qualname = path.partition(":")
    obj = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def installed_version(distribution: str) -> str:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return "none"


def switched_off() -> set[str]:
    """Patch names and modules EDGELLM_NO_PATCHES turns off; {"all"} for every one."""
    value = os.environ.get(SWITCH, "").strip()
    names = {n.strip() for n in value.split(",") if n.strip()}
    unknown = {n for n in names if n != "all" and n not in MODULES and (
        n.split(".")[0] not in MODULES or n not in {p.name for p in patches_of(n.split(".")[0])})}
    if unknown:
        known = ", ".join(p.name for p in everything())
        raise InputError(f"{SWITCH}={value!r} names no patch: {', '.join(sorted(unknown))}. "
                         f"Give 'all', a module ({', '.join(MODULES)}) or patch names: {known}.")
    return names


def patches_of(module: str) -> tuple[Patch, ...]:
    return importlib.import_module(f"{__name__}.{module}").PATCHES


def apply(names) -> dict[str, str]:
    """Install the patches `names` (or every patch of a module named alone) where they apply,
    and put upstream back where they do not. Idempotent. Returns {name: "on" or why not}."""
    off = switched_off()
    out = {}
    for name in names:
        module = name.split(".")[0]
        try:
            declared = patches_of(module)
        except (ImportError, AttributeError) as e:  # what it patches is not there to patch
            out[name] = f"off: {module} patches do not import here ({type(e).__name__}: {e})"
            continue
        for patch in declared:
            if patch.name != name and name != module:
                continue
            why = _why_off(patch, off)
            if why:
                if patch.installed():
                    patch.restore()
            elif not patch.installed():
                patch.install()
                if _SCOPES:
                    _SCOPES[-1].append(patch)
            out[patch.name] = why or "on"
    return out


@contextlib.contextmanager
def scope():
    """A block whose patches end with it: each one `apply` installs inside it is restored to
    upstream's when the block ends, also on an exception, last installed first. A patch already
    installed when the block began stays (whoever installed it takes it off)."""
    _SCOPES.append([])
    try:
        yield
    finally:
        for patch in reversed(_SCOPES.pop()):
            if patch.installed():
                patch.restore()


def _why_off(patch: Patch, off: set[str]) -> str | None:
    if {"all", patch.name, patch.name.split(".")[0]} & off:
        return f"off: {SWITCH}"
    versions = patch.mismatched_versions()
    if versions:
        return "off: " + ", ".join(versions)
    changed = patch.changed()
    if changed:
        return "off: changed upstream: " + ", ".join(changed)
    return None


def everything() -> list[Patch]:
    """Every patch of every module (imports them all: ExecuTorch's and coremltools')."""
    return [p for m in MODULES for p in patches_of(m)]
