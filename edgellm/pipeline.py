"""The export job: source -> model -> torch.export -> lower -> files, one stage after another.

Outputs are written into a temporary folder beside the destination and moved into place only when
everything is written, so a failed or interrupted export leaves nothing half-written behind.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import glob
import os
import shutil
import sys
import tempfile
from pathlib import Path

from . import patches
from . import report as reports
from .backends import plan_for
from .config import ExportConfig, dump_yaml
from .errors import InputError
from .layout import FOUNDATION
from .memory import long_run_collector, peak_rss_mb, release_memory
from .progress import Stages


def check_destination(dest: Path, force: bool) -> None:
    if dest.exists() and not force:
        raise InputError(f"Output folder {dest} already exists. Pass --force to replace it, or "
                         "choose another folder with -o.")
    if dest.exists() and not dest.is_dir():
        raise InputError(f"Output path {dest} exists and is not a folder. Choose another with -o.")
    parent = dest.parent if str(dest.parent) else Path(".")
    if not parent.is_dir():
        raise InputError(f"Cannot write {dest}: its parent folder {parent} does not exist.")
    if not os.access(parent, os.W_OK):
        raise InputError(f"Cannot write {dest}: its parent folder {parent} is not writable.")


@contextlib.contextmanager
def staging(dest: Path, force: bool):
    """Yield a temporary folder beside `dest`; move it into place when the block succeeds.
    Its name carries this process's id, so the folder of a run that was killed (SIGKILL leaves
    no chance to clean up) is recognised and removed by the next run."""
    remove_stale_partials(dest)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.partial-{os.getpid()}-", dir=dest.parent))
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o777 & ~umask)  # mkdtemp makes it private; the result is an ordinary folder
    try:
        yield tmp
        if dest.exists() and force:
            old = Path(tempfile.mkdtemp(prefix=f".{dest.name}.old-", dir=dest.parent))
            os.replace(dest, old / dest.name)
            os.replace(tmp, dest)
            shutil.rmtree(old)
        else:
            try:
                os.replace(tmp, dest)
            except OSError as e:  # another run wrote dest while this one worked
                if e.errno not in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOTDIR):
                    raise
                raise InputError(f"Output folder {dest} was written by another run while this "
                                 "one worked; it is left as that run wrote it. Pass --force to "
                                 "replace it, or choose another folder with -o.") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def remove_stale_partials(dest: Path) -> None:
    """Remove `.NAME.partial-PID-*` folders beside dest whose process no longer exists."""
    for folder in dest.parent.glob(f".{glob.escape(dest.name)}.partial-*"):
        pid = folder.name.removeprefix(f".{dest.name}.partial-").split("-")[0]
        if pid.isdigit() and not process_alive(int(pid)):
            shutil.rmtree(folder, ignore_errors=True)


def process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, owned by someone else
        return True
    return True


def metadata(cfg: ExportConfig, source, plan) -> dict:
    """Constant methods ExecuTorch's LLM runner reads (see extension/llm/runner);
    use_sdpa_with_kv_cache says what the model is written with (portable's int8 cache writes
    ExecuTorch's custom ops too)."""
    model_cfg = source.hf_config
    custom = plan.model_options(cfg, source.stored_types).attention == "custom_ops"
    meta = {"get_max_seq_len": cfg.max_seq_len, "get_max_context_len": cfg.context_len,
            "get_vocab_size": model_cfg.vocab_size, "get_n_layers": model_cfg.num_hidden_layers,
            "use_kv_cache": True, "use_sdpa_with_kv_cache": custom,
            "enable_dynamic_shape": plan.dynamic_shapes}
    if source.bos_id is not None:
        meta["get_bos_id"] = int(source.bos_id)
    if source.eos_ids:
        meta["get_eos_ids"] = [int(i) for i in source.eos_ids]
    if cfg.attention_sink:  # ours: edgellm's runtime then takes positions past the context
        meta["get_attention_sink"] = [int(n) for n in cfg.attention_sink]
    return meta


def capture(cfg: ExportConfig, plan, model, done, stages: Stages) -> dict:
    """Stages experts (`--experts chosen`: a delegate per expert, lower.lower_experts) and
    export: the program's methods, exported."""
    from .capture import export_methods
    from .lower import lower_experts

    if done and done.experts == "chosen":
        with stages.stage("experts"):
            lower_experts(model, lambda: plan.backends[0].make_partitioners(plan.options[0]),
                          max(cfg.max_seq_len, cfg.prefill_chunk), stages.progress)
    with stages.stage("export"):
        return export_methods(model, cfg.max_seq_len, plan.dynamic_shapes, cfg.prefill_chunk)


def export(cfg: ExportConfig, quiet: bool = False) -> dict:
    """Run one export as configured; returns the report (also written as report.json).

    Stages: load, build, quantize (eager.py), experts (`--experts chosen`), export, lower,
    serialize, inspect. With verification, `made` hands it each stage's product as it is made,
    the one place the two meet; it runs its own stages (reference, expected, graph, verify) on
    them."""
    from .eager import eager_model
    from .lower import LOWERING_PATCHES, lower

    dest = Path(cfg.output)
    check_destination(dest, cfg.force)
    plan = plan_for(cfg)  # refuses unavailable backends before any heavy work
    stages = Stages(quiet=quiet)
    # patches last as long as the export: upstream's functions are back when it returns
    with staging(dest, cfg.force) as tmp, contextlib.ExitStack() as run, patches.scope():
        check = None
        if cfg.verify:
            from .verification import Verification

            check = Verification(cfg, plan, stages)

        def made(stage: str, product) -> None:
            if stage == "load":  # what was imported and read so far lives to the end of the
                run.enter_context(long_run_collector())  # run: collections skip it from here
            if check:
                check.take(stage, product)

        eager = eager_model(cfg, plan, stages, made)
        source, done = eager.source, eager.quantized
        plan, settled = plan.settled(cfg, eager.state["bytes"], eager.weight_bytes)
        # patches first: they apply to the partitioners made from here on
        applied = patches.apply(plan.patches + LOWERING_PATCHES)
        programs = capture(cfg, plan, eager.model, done, stages)
        made("export", programs)
        eager.model = None
        release_memory()  # the module graph holds cycles; free it before lowering
        with stages.stage("lower"):
            partitioners = plan.partitioners()  # imports the backends' toolchains
            lowered = lower(programs, partitioners, metadata(cfg, source, plan), cfg.etrecord,
                            quant_fusion=cfg.embedding_quantize is not None,
                            dedupe=bool(done and done.linears_on_source_grid),
                            external=FOUNDATION if cfg.external_weights else None)
            del programs
        with stages.stage("serialize"):
            files = serialize(tmp, cfg, plan, source, lowered, quiet)
        delegates = {}
        if any(b.inspect_delegates for b in plan.backends):
            with stages.stage("inspect"):
                delegates = inspect_delegates(plan, tmp / "model.pte", lowered.states)
        rep = build_report(cfg, plan, source, lowered, stages, files, tmp)
        rep.update(eager.weights_read, delegates=delegates)
        rep["state"], rep["kv_cache"] = eager.state, {**eager.kv_cache, **settled}
        rep["patches"] = {**(done.patches if done else {}), **applied}
        rep["private_upstream"] = private_upstream(quiet)
        if done:
            rep["quantization"] = done.report()
        reports.write(rep, tmp)
        if check:
            release_memory()
            made("files", tmp)
            rep["verify"] = check.result
            rep["stages"], rep["wall_s"], rep["peak_rss_mb"] = (stages.records, stages.wall_s,
                                                                peak_rss_mb())
            reports.write(rep, tmp)
    if cfg.verify:  # the outputs stay in place for inspection; the caller learns it failed
        from .verification import enforce

        enforce(rep["verify"], f"The program in {dest}")
    return rep


def serialize(tmp: Path, cfg: ExportConfig, plan, source, lowered, quiet: bool) -> dict:
    """The export's files written into `tmp` ({kind: name}, write_outputs), what they lack said on
    stderr, the lowered program let go (what follows reads the file and needs the memory), and
    each backend's finishing step on model.pte."""
    files = write_outputs(tmp, cfg, source, lowered)
    if "tokenizer" not in files and not quiet:
        print(f"[edgellm] serialize: no tokenizer ships beside model.pte ({source.origin} has "
              "none); ExecuTorch's LLM runner and `edgellm generate` need one: add "
              "tokenizer=PATH (a tokenizer.json or its folder)", file=sys.stderr, flush=True)
    if stored_twice(cfg, plan, source) and not quiet:
        print("[edgellm] serialize: model.pte holds the tied table twice (the lookups' and "
              f"{plan.backends[0].name}'s head); --external-weights stores it once, in "
              f"{FOUNDATION}.ptd beside model.pte (the embedded SmolLM2: 111.0 MB -> 93.3 MB)",
              file=sys.stderr, flush=True)
    del lowered.program
    release_memory()
    for backend in plan.backends:
        if backend.finish_program:
            backend.finish_program(tmp / "model.pte")
    return files


def stored_twice(cfg: ExportConfig, plan, source) -> bool:
    """Whether a one-file program holds a tied table twice: the chain's first backend writes
    the head as a linear of its own and could keep the weights in a data file instead."""
    first = plan.backends[0]
    return (not cfg.external_weights and first.writing.get("separate_head", False)
            and first.external_weights is None
            and bool(getattr(source.hf_config, "tie_word_embeddings", False)))


def private_upstream(quiet: bool) -> dict:
    """report.json's `private_upstream` (patches.private): each private upstream name edgellm
    calls, "pinned" or what changed; stderr says when one changed."""
    from .patches import private

    found = private.status()
    changed = {name: why for name, why in found.items() if why != "pinned"}
    if changed and not quiet:
        print("[edgellm] private upstream functions edgellm calls changed since it was tested: "
              + "; ".join(f"{name}: {why}" for name, why in changed.items()), file=sys.stderr,
              flush=True)
    return found


def inspect_delegates(plan, pte: Path, states: dict) -> dict:
    """Each backend that can open its own payloads describes and checks them."""
    return {b.name: b.inspect_delegates(pte, options, states)
            for b, options in zip(plan.backends, plan.options) if b.inspect_delegates}


def write_outputs(folder: Path, cfg: ExportConfig, source, lowered) -> dict:
    with open(folder / "model.pte", "wb") as f:
        lowered.program.write_to_file(f)
    files = {"program": "model.pte", "config": "config.yaml"}
    if cfg.external_weights:  # {tag}.ptd for each tag; lower() gave every weight one
        lowered.program.write_tensor_data_to_file(str(folder))
        if not (folder / f"{FOUNDATION}.ptd").is_file():
            raise RuntimeError(f"external weights were asked but {FOUNDATION}.ptd was not written")
        files["weights"] = f"{FOUNDATION}.ptd"
    # absolute paths: the file replays (and `edgellm verify` reads it) from any directory
    paths = {k: str(Path(v).resolve()) for k, v in (("model", source.origin),
             ("params", cfg.params), ("tokenizer", cfg.tokenizer)) if v is not None}
    (folder / "config.yaml").write_text(dump_yaml(dataclasses.replace(cfg, **paths)))
    if source.write_tokenizer(folder):
        files["tokenizer"] = "tokenizer.json"
    if cfg.etrecord:
        lowered.program.get_etrecord().save(str(folder / "etrecord.bin"))
        if not (folder / "etrecord.bin").is_file():
            raise RuntimeError("ETRecord was requested but etrecord.bin was not written")
        files["etrecord"] = "etrecord.bin"
    return files


def build_report(cfg, plan, source, lowered, stages: Stages, files: dict, folder: Path) -> dict:
    """report.json's fields the export knows once its files are written: `pte_bytes` counts
    every file the program needs (model.pte, and its data file), `file_bytes` each."""
    hf = source.hf_config
    sizes = {files[k]: (folder / files[k]).stat().st_size for k in ("program", "weights")
             if k in files}
    methods = {name: {"delegation": figures} for name, figures in lowered.delegation.items()}
    return {
        "backends": list(cfg.backends),
        "model": {"origin": source.origin, "model_type": hf.model_type,
                  "n_layers": hf.num_hidden_layers, "vocab_size": hf.vocab_size},
        "dtype": cfg.dtype, "max_seq_len": cfg.max_seq_len, "max_context_len": cfg.context_len,
        "dynamic_shapes": plan.dynamic_shapes,
        "methods": methods,
        "preserved_ops": lowered.preserved,
        "deprecation_warnings": len(lowered.deprecations),
        "deprecation_messages": lowered.deprecations,
        "python_deprecation_warnings": lowered.python_deprecations,
        "files": files, "pte_bytes": sum(sizes.values()), "file_bytes": sizes,
        "wall_s": stages.wall_s, "peak_rss_mb": peak_rss_mb(), "stages": stages.records,
    }
