#!/usr/bin/env bash
# The accelerator check of issue 36, in one command: installs Keras from the bundle's wheels
# (the GPU machines have JAX, PyTorch and numpy but no TensorFlow, no Keras and no package
# index), then runs benchmarks/accelerator_check.py under KERAS_BACKEND=jax: the trainer step
# of small/base/big with MFU, the PyTorch peer (eager, torch.compile), and the 300-step
# agreement of the multi30k recipe with the CPU reference. One JSON object on stdout, also
# written to $OUT/accelerator_check.json when $OUT is set (the parts' logs beside it).
#
# 1. Build the bundle once, on a machine with TensorFlow and /work/shared/data/multi30k
#    (8 to 30 min on a 2-core CPU, as busy as it is; build/ is ignored by git; under 20 MB):
#        python benchmarks/accelerator_bundle.py
# 2. In a session with a GPU, the device tool `run` with:
#        command:   bash benchmarks/accelerator_check.sh
#        carry:     ["build/accelerator_bundle"]
#        timeout_s: 300
#    The check keeps to --budget seconds (default 265: first the compilation caches warmed
#    by parallel processes, then the parts in turn, each in its own process, killed at its
#    share) and writes what it finished even if a part is stopped.
#    Arguments go to the Python check, e.g. only some parts, or fewer steps:
#        bash benchmarks/accelerator_check.sh --parts step,agreement --steps 40
#        bash benchmarks/accelerator_check.sh --parts torch --presets base,big --budget 200
#    The candidates for a faster step (issue 36's aim), each measured alone, and where the
#    device time goes (a JAX profiler trace of 5 steps, summarised by kind of work), with
#    timeout_s 330:
#        bash benchmarks/accelerator_check.sh --parts step --budget 280 \
#            --presets base,base+autodiffloss,base+flash,big,big+flash,base+dropout0,base+vocab8000 \
#            --profile base,base+flash
# 3. Here, on a CPU, a test of every code path (tiny shapes, 20 float32 agreement steps):
#        bash benchmarks/accelerator_check.sh --quick
#
# Environment: PYTHON (default: the first of python3, python, python3.12 that has JAX),
# ACCELERATOR_BUNDLE (default build/accelerator_bundle), JAX_COMPILATION_CACHE_DIR (default
# build/jax_cache: a rerun on the same warm machine skips the XLA compilations; the JSON says
# whether the cache held anything at the start).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -z "${PYTHON:-}" ]; then  # the first Python that has JAX
    for PYTHON in python3 python python3.12 ""; do
        [ -n "$PYTHON" ] && "$PYTHON" -c "import jax" >/dev/null 2>&1 && break
    done
    PYTHON=${PYTHON:-python3}
fi
BUNDLE=${ACCELERATOR_BUNDLE:-build/accelerator_bundle}
WHEELS=$BUNDLE/wheels
KERAS_VERSION=3.15.1
export KERAS_BACKEND=jax
export TF_CPP_MIN_LOG_LEVEL=${TF_CPP_MIN_LOG_LEVEL:-2}
export JAX_COMPILATION_CACHE_DIR=${JAX_COMPILATION_CACHE_DIR:-$PWD/build/jax_cache}
mkdir -p "$JAX_COMPILATION_CACHE_DIR"

have_keras() {
    "$PYTHON" -c "import sys, keras; sys.exit(keras.__version__ != '$KERAS_VERSION')" \
        >/dev/null 2>&1
}

install_keras() {
    if have_keras; then
        echo "keras $KERAS_VERSION: installed already" >&2
        return
    fi
    if [ ! -d "$WHEELS" ]; then
        echo "no $WHEELS: build the bundle (python benchmarks/accelerator_bundle.py) and" \
             "carry build/accelerator_bundle" >&2
        exit 2
    fi
    # Into the running Python (JAX and torch stay as they are: pip only adds what is missing).
    if "$PYTHON" -m pip install --disable-pip-version-check --no-index --find-links "$WHEELS" \
            "keras==$KERAS_VERSION" >&2 && have_keras; then
        return
    fi
    # An externally managed Python: a venv that still sees JAX and torch.
    local venv=build/accelerator_venv
    if "$PYTHON" -m venv --system-site-packages "$venv" >&2 \
            && "$venv/bin/python" -m pip install --disable-pip-version-check --no-index \
                --find-links "$WHEELS" "keras==$KERAS_VERSION" >&2 \
            && PYTHON=$venv/bin/python have_keras; then
        PYTHON=$venv/bin/python
        return
    fi
    # No pip at all: the wheels the running Python lacks, unpacked onto PYTHONPATH.
    echo "pip failed: unpacking the wheels into build/accelerator_pydeps" >&2
    "$PYTHON" benchmarks/accelerator_check.py --unpack-wheels "$WHEELS" build/accelerator_pydeps
    export PYTHONPATH=$PWD/build/accelerator_pydeps${PYTHONPATH:+:$PYTHONPATH}
    have_keras || { echo "keras $KERAS_VERSION could not be installed" >&2; exit 2; }
}

start=$(date +%s)
install_keras
echo "keras ready in $(( $(date +%s) - start )) s ($PYTHON)" >&2
if [ -n "$(ls -A "$JAX_COMPILATION_CACHE_DIR" 2>/dev/null)" ]; then
    export ACCELERATOR_CHECK_WARM_CACHE=1
fi
args=(--bundle "$BUNDLE")
if [ -n "${OUT:-}" ]; then
    mkdir -p "$OUT"
    args+=(--json-out "$OUT/accelerator_check.json" --log-dir "$OUT")
fi
exec "$PYTHON" benchmarks/accelerator_check.py "${args[@]}" "$@"
