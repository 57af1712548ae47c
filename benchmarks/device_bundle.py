"""Pack what ``benchmarks/device_check.sh`` needs for a machine that can install nothing.

An accelerator machine lent for a short check often has JAX and the usual scientific stack but no
network, and only a small upload. This writes a bundle directory (default ``.device/``, ignored by
git) holding:

* ``target/``: the target run's ``config.json`` and a **params-only** checkpoint of its newest
  step (the trainer's checkpoints also hold the optimizer state, about 3x the bytes), in the
  layout :func:`specjax.training.drafter_task.load_target` reads. The config's ``data.data_dir``
  points at ``<bundle>/data/...`` (a path relative to the repository root), where the run's
  ``tokenizer.json`` is copied.
* ``drafters/<name>/``: each drafter run's ``config.json`` and params-only newest checkpoint.
* ``wheels/``: wheels, for the device's Python (``--python-version``), of the packages this
  repository needs beyond what a JAX-on-GPU image carries (:data:`WHEELS`, versions from
  ``constraints.txt``). Skipped with ``--no-wheels``.

Run (after ``make quickstart``; its output names the two workdirs)::

    .venv/bin/python -m benchmarks.device_bundle --target <target workdir> \\
        --drafter mtp=<head workdir> [--drafter dspark=<drafter workdir>] [--out .device]

The bundle's size is printed; keep it (with the repository) under what the machine accepts.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys

#: Packages ``benchmarks/device_check.sh`` imports that a JAX-on-GPU image does not carry (its
#: other needs -- jax, flax, optax, orbax, numpy, tokenizers, matplotlib, pytest -- are there).
WHEELS = ("ml-collections",)


def _pin(name: str, constraints: str = "constraints.txt") -> str:
    """``name==version`` from constraints.txt (or the bare name when it is not pinned there)."""
    key = name.lower().replace("_", "-")
    with open(constraints) as f:
        for line in f:
            pkg, _, version = line.strip().partition("==")
            if pkg.lower().replace("_", "-") == key and version:
                return f"{name}=={version}"
    return name


def _save_params(params, step: int, workdir: str) -> None:
    import orbax.checkpoint as ocp
    from specjax.training.checkpoint import run_checkpoints_dir
    manager = ocp.CheckpointManager(run_checkpoints_dir(workdir))
    try:
        manager.save(step, args=ocp.args.Composite(state=ocp.args.PyTreeSave({"params": params})))
        manager.wait_until_finished()
    finally:
        manager.close()


def _newest_step(workdir: str) -> int:
    import orbax.checkpoint as ocp
    from specjax.training.checkpoint import run_checkpoints_dir
    if not os.path.isfile(os.path.join(workdir, "config.json")) \
            or not os.path.isdir(os.path.join(workdir, "checkpoints")):
        raise SystemExit(f"{workdir}: not a specjax run workdir (no config.json / checkpoints/)")
    manager = ocp.CheckpointManager(run_checkpoints_dir(workdir))
    try:
        step = manager.latest_step()
    finally:
        manager.close()
    if step is None:
        raise SystemExit(f"{workdir}: no complete checkpoint under checkpoints/")
    return step


def pack_target(workdir: str, out: str) -> dict:
    """Params-only copy of a target run into ``out``; its tokenizer into ``<bundle>/data``."""
    from experiments.reproduce_steps import target_config_of
    from specjax.training.drafter_task import load_target
    from specjax.training.lm_task import model_config_from
    from specjax.training.run import data_dir_of
    step = _newest_step(workdir)
    config = target_config_of(workdir)
    mcfg = model_config_from(config)
    _, params = load_target(mcfg, workdir, step=step)
    _save_params(params, step, out)
    run_data_dir = data_dir_of(config, mcfg.vocab_size)
    tokenizer = os.path.join(run_data_dir, "tokenizer.json")
    if not os.path.isfile(tokenizer):
        raise SystemExit(f"{workdir}: its tokenizer {tokenizer} is not on disk")
    data_dir = os.path.join(os.path.dirname(out.rstrip("/")), "data",
                            os.path.basename(run_data_dir))
    os.makedirs(data_dir, exist_ok=True)
    shutil.copy(tokenizer, data_dir)
    packed = config.to_dict()  # as the trainer writes it, with the data dir moved into the bundle
    packed["data"]["data_dir"] = os.path.relpath(data_dir)
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(packed, f, indent=2, sort_keys=True)
    return {"step": step, "params": mcfg.num_params()}


def pack_drafter(workdir: str, out: str) -> dict:
    """Params-only copy of a drafter run into ``out``."""
    from specjax.training.drafter_run import load_drafter
    step = _newest_step(workdir)
    _, params, task = load_drafter(workdir, step=step)
    _save_params(params, step, out)
    shutil.copy(os.path.join(workdir, "config.json"), out)
    return {"step": step, "gamma": task.gamma}


def download_wheels(out: str, python_version: str) -> list[str]:
    """Wheels of :data:`WHEELS` for a manylinux x86-64 CPython ``python_version``."""
    os.makedirs(out, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
           "--python-version", python_version, "--implementation", "cp",
           "--platform", "manylinux_2_28_x86_64", "--platform", "manylinux_2_17_x86_64",
           "--platform", "manylinux2014_x86_64", "-d", out] + [_pin(w) for w in WHEELS]
    subprocess.run(cmd, check=True)
    return sorted(os.listdir(out))


def _size(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", required=True, help="target training workdir")
    ap.add_argument("--drafter", action="append", default=[], help="name=drafter workdir")
    ap.add_argument("--out", default=".device")
    ap.add_argument("--python-version", default="3.12", help="the device's Python (for wheels)")
    ap.add_argument("--no-wheels", action="store_true")
    args = ap.parse_args(argv)
    # --drafter specs are checked before anything is removed or packed
    drafters = [spec.partition("=") for spec in args.drafter]
    for spec, (name, sep, path) in zip(args.drafter, drafters):
        if not sep or not name or not path:
            raise SystemExit(f"--drafter wants name=workdir, got {spec!r}")
    if os.path.exists(args.out):
        # Replace an earlier bundle, never some other directory given by mistake.
        if os.listdir(args.out) and not os.path.isfile(os.path.join(args.out, "bundle.json")):
            raise SystemExit(f"--out {args.out!r} exists and is not a bundle (no bundle.json); "
                             "give a new or an earlier bundle's directory")
        shutil.rmtree(args.out)
    summary = {"target": pack_target(args.target, os.path.join(args.out, "target")),
               "drafters": {}}
    for name, _, path in drafters:
        summary["drafters"][name] = pack_drafter(path, os.path.join(args.out, "drafters", name))
    if not args.no_wheels:
        summary["wheels"] = download_wheels(os.path.join(args.out, "wheels"), args.python_version)
    summary["bytes"] = _size(args.out)
    with open(os.path.join(args.out, "bundle.json"), "w") as f:
        json.dump(summary, f, indent=1)
    print(json.dumps(summary, indent=1))
    print(f"bundle: {args.out} ({summary['bytes'] / 2**20:.1f} MiB)")
    return summary


if __name__ == "__main__":
    main()
