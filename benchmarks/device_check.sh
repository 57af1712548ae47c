#!/usr/bin/env bash
# The accelerator check: one prepared command for a GPU (or TPU) machine that can install nothing.
#
# It answers what a CPU cannot: do the compiled Pallas kernels pick the jnp verifier's tokens bit
# for bit, what does a K-token verification cost against a decode step when a step is bound by
# reading the weights, and does speculative decoding beat the fastest plain decoder there.
#
# Prepare on a machine with the package registry (writes .device/, ignored by git):
#     .venv/bin/python -m benchmarks.device_bundle --target <target workdir> \
#         --drafter mtp=<head workdir> [--drafter dspark=<drafter workdir>]
# Run on the accelerator machine, from the repository root, with the bundle beside it:
#     bash benchmarks/device_check.sh OUT_DIR [BUNDLE_DIR]      # BUNDLE_DIR defaults to .device
#     QUICK=1 bash benchmarks/device_check.sh OUT_DIR           # smoke run (any backend, ~3 min on CPU)
#
# Steps, each under its own time limit so that one failure leaves time for the rest (together at
# most 9.5 minutes, start-up included, so that the whole check fits one 10-minute command):
#   env         jax version, backend and devices                        -> device_check.log
#   pallas      tests/test_pallas_rejection.py::test_kernel_on_accelerator_matches_jnp
#   step_cost   benchmarks/model_step_cost.py, small + base50m, device loop -> model_step_cost.json
#               (written after each preset, marked "partial" until complete)
#   verify      benchmarks/verify_throughput.py --quick: the jnp verifier and each compiled Pallas
#               kernel of the platform, timed             -> verify_throughput.json
#   spec        benchmarks/spec_vs_plain.py on the bundle's target and drafters (math, code)
#                                                   -> spec_vs_plain.{json,md,png}
#               (its JSON is written after every cell, marked "partial" until the run completes,
#               so a step stopped by its limit keeps the cells it measured)
# OUT_DIR then holds at most these 6 files plus steps.txt (one line per step: rc and seconds).
# The installed jax may be newer than constraints.txt's; device_check.log records which.
set -uo pipefail

out=${1:?usage: bash benchmarks/device_check.sh OUT_DIR [BUNDLE_DIR]}
bundle=${2:-.device}
py=${PYTHON:-python3}
quick=${QUICK:-0}
mkdir -p "$out"
log="$out/device_check.log"
: >"$log"
: >"$out/steps.txt"
export PYTHONUNBUFFERED=1

# Packages the machine's image lacks travel as wheels (benchmarks/device_bundle.py lists them).
if compgen -G "$bundle/wheels/*.whl" >/dev/null; then
  site=${TMPDIR:-/tmp}/specjax_site
  "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$site" "$bundle"/wheels/*.whl >>"$log" 2>&1 || { echo "wheel install failed" | tee -a "$log"; exit 1; }
  export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}"

step() {  # step NAME SECONDS CMD...: run CMD under a time limit, log it, record rc and seconds
  local name=$1 limit=$2 start=$SECONDS rc
  shift 2
  echo "===== $name: $*" >>"$log"
  timeout "$limit" "$@" >>"$log" 2>&1
  rc=$?
  echo "$name rc=$rc seconds=$((SECONDS - start))" | tee -a "$out/steps.txt" "$log"
}

step env 60 "$py" -c "
import importlib.metadata as md, json, platform, jax
pkgs = {p: md.version(p) for p in ('jax', 'jaxlib', 'flax', 'optax', 'orbax-checkpoint', 'chex',
                                   'ml-collections', 'numpy', 'tokenizers')}
print(json.dumps({'backend': jax.default_backend(), 'devices': [d.device_kind for d in jax.devices()],
                  'python': platform.python_version(), 'packages': pkgs}))"

# tests/conftest.py defaults JAX_PLATFORMS to cpu; empty lets jax take the accelerator.
step pallas 120 env JAX_PLATFORMS= "$py" -m pytest -q -p no:cacheprovider -o addopts= \
  tests/test_pallas_rejection.py -k test_kernel_on_accelerator_matches_jnp -rs

if [ "$quick" = 1 ]; then
  step step_cost 120 "$py" -m benchmarks.model_step_cost --quick --out "$out/model_step_cost.json"
else
  step step_cost 120 "$py" -m benchmarks.model_step_cost --presets small,base50m --loops device \
    --max-k 8 --reps 9 --out "$out/model_step_cost.json"
fi

reps=()
[ "$quick" = 1 ] && reps=(--reps 1)
step verify 60 "$py" benchmarks/verify_throughput.py --quick "${reps[@]}" --out "$out/verify_throughput.json"

drafters=()
for d in "$bundle"/drafters/*/; do
  [ -d "$d" ] && drafters+=(--drafter "$(basename "$d")=${d%/}")
done
if [ -d "$bundle/target" ] && [ ${#drafters[@]} -gt 0 ]; then
  # math and code at B = 1, 8, 32 and T = 0, 1: the cells of the speed goals.
  extra=(--domains math code)
  [ "$quick" = 1 ] && extra=(--quick)
  step spec 210 "$py" -m benchmarks.spec_vs_plain --target "$bundle/target" "${drafters[@]}" \
    --out "$out/spec_vs_plain.json" --md "$out/spec_vs_plain.md" --png "$out/spec_vs_plain.png" \
    "${extra[@]}"
else
  echo "spec skipped: no $bundle/target or $bundle/drafters/*" | tee -a "$out/steps.txt" "$log"
fi
cat "$out/steps.txt"
