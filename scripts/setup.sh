#!/usr/bin/env bash
# Project set-up: a Python 3.11 venv in .venv with the runtime, the ROS 2 Kilted wheels and the
# litevlm_msgs interface package built into it. Idempotent: every step is skipped when a stamp
# file says its inputs have not changed, so a second run takes about a second.
#
# --peers: also the optional peer engines of `litevlm bench --peers` (step 6: llama-cpp-python with
# libmtmd built from source, ~20 minutes on 2 cores, logged to $VENV/.litevlm-peers.log; OpenVINO
# GenAI and optimum-intel in their own venv, .venv-openvino). Nothing else needs them.
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

# 5. The low-bit CPU kernels (kernels/lowbit_kernels.cpp: backend.weights int4/int8/fp16), built by
#    torch.utils.cpp_extension against this venv's torch once (about half a minute; kept per digest of
#    the source, so a second run is a lookup). A CPU they do not cover (aarch64, x86 without AVX2) or a
#    failed build is not fatal: those forms then run their reference path, and the line says why.
"$PY" -c 'from litevlm_runtime.kernels import lowbit_kernels as k; print("[setup] low-bit CPU kernels:", k.path_in_words(k.load()))'

# 6. Optional: the peer engines of `litevlm bench --peers` (bench/peers/), keyed on their
#    requirements files and the CMake flags:
#    a) llama.cpp: llama-cpp-python built from its source package for this CPU, with libmtmd (the
#       multimodal library), and the llama.cpp tree that package vendors (convert_hf_to_gguf.py,
#       conversion/, gguf-py/) kept in $VENV/share/litevlm-peers/llama.cpp: converter and library of
#       one version. ~20 minutes on 2 cores, logged to $VENV/.litevlm-peers.log.
#    b) OpenVINO GenAI and optimum-intel in their own venv ($ROOT/.venv-openvino, or
#       $LITEVLM_OPENVINO_VENV): their pins clash with this project's (requirements-peers-openvino.txt).
if [ "${1:-}" = "--peers" ]; then
    # GGML_NATIVE: llama.cpp compiled for this CPU's instruction sets (-march=native), as its own build
    # does by default; tests and examples are not built. LLAVA_BUILD=ON (the package's default) builds
    # libmtmd from the vendored tools/mtmd; quantizing uses libllama's llama_model_quantize.
    LLAMA_CMAKE_ARGS="${CMAKE_ARGS:--DGGML_NATIVE=ON -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAVA_BUILD=ON}"
    LLAMA_SRC="$VENV/share/litevlm-peers/llama.cpp"
    peers_stamp="$VENV/.litevlm-peers-$(cat requirements-peers.txt <(echo "$LLAMA_CMAKE_ARGS") | sha256sum | cut -c1-16)"
    if [ ! -f "$peers_stamp" ] || [ ! -f "$LLAMA_SRC/convert_hf_to_gguf.py" ] \
            || ! "$PY" -c 'import llama_cpp, llama_cpp.mtmd_cpp' 2>/dev/null; then
        log "building llama-cpp-python with libmtmd from its source package (~20 minutes on 2 cores)"
        peers_log="$VENV/.litevlm-peers.log"
        sdist_dir="$VENV/.litevlm-build/llama-cpp-sdist"
        version="$(sed -n 's/^llama-cpp-python==\([0-9.]*\).*/\1/p' requirements-peers.txt)"
        rm -rf "$sdist_dir"
        mkdir -p "$sdist_dir"
        {
            "$PY" -m pip download --disable-pip-version-check --no-deps --no-binary :all: \
                "llama-cpp-python==$version" -d "$sdist_dir" \
            && tar -xzf "$sdist_dir/llama_cpp_python-$version.tar.gz" -C "$sdist_dir" \
            && rm -rf "$LLAMA_SRC" && mkdir -p "$LLAMA_SRC" \
            && cp -r "$sdist_dir/llama_cpp_python-$version/vendor/llama.cpp/"{convert_hf_to_gguf.py,conversion,gguf-py,LICENSE} \
                "$LLAMA_SRC/" \
            && CMAKE_ARGS="$LLAMA_CMAKE_ARGS" CMAKE_BUILD_PARALLEL_LEVEL="$(nproc)" \
                "$PY" -m pip install --disable-pip-version-check --no-cache-dir --force-reinstall --no-deps \
                "$sdist_dir/llama_cpp_python-$version.tar.gz" \
            && "$PY" -m pip install --disable-pip-version-check -r requirements-peers.txt ; } > "$peers_log" 2>&1 \
            || { tail -30 "$peers_log"; echo "[setup] peers install failed: $peers_log" >&2; exit 1; }
        # --no-cache-dir and --force-reinstall: a wheel built earlier with other flags (without
        # libmtmd) is neither reused from pip's cache nor kept as "already satisfied".
        "$PY" -c 'import llama_cpp.mtmd_cpp' \
            || { echo "[setup] llama-cpp-python built without libmtmd (CMAKE_ARGS: $LLAMA_CMAKE_ARGS)" >&2; exit 1; }
        rm -rf "$sdist_dir"
        rm -f "$VENV"/.litevlm-peers-*
        touch "$peers_stamp"
    else
        log "llama.cpp peer up to date"
    fi
    # optimum-intel 2.2 requires torchvision, whose index wheel is a CUDA build that breaks
    # transformers' imports beside the CPU torch: installed with --no-deps after its other pins.
    OPTIMUM_INTEL="optimum-intel==2.2.0"
    OV_VENV="${LITEVLM_OPENVINO_VENV:-$ROOT/.venv-openvino}"
    ov_stamp="$OV_VENV/.litevlm-openvino-$(cat requirements-peers-openvino.txt <(echo "$OPTIMUM_INTEL") | sha256sum | cut -c1-16)"
    if [ ! -f "$ov_stamp" ] || ! "$OV_VENV/bin/python" -c 'import openvino_genai, optimum.intel' 2>/dev/null; then
        log "installing OpenVINO GenAI and optimum-intel into $OV_VENV (a few minutes)"
        [ -x "$OV_VENV/bin/python" ] || "$PYTHON" -m venv "$OV_VENV"
        ov_log="$OV_VENV/.litevlm-openvino.log"
        { "$OV_VENV/bin/python" -m pip install --disable-pip-version-check -r requirements-peers-openvino.txt \
            && "$OV_VENV/bin/python" -m pip install --disable-pip-version-check --no-deps "$OPTIMUM_INTEL" \
            && { "$OV_VENV/bin/python" -m pip uninstall -y torchvision || true; } \
            && "$OV_VENV/bin/python" -c 'import openvino_genai, optimum.intel' ; } > "$ov_log" 2>&1 \
            || { tail -30 "$ov_log"; echo "[setup] OpenVINO peers install failed: $ov_log" >&2; exit 1; }
        rm -f "$OV_VENV"/.litevlm-openvino-*
        touch "$ov_stamp"
    else
        log "OpenVINO peer up to date"
    fi
fi

log "ready: $VENV (run tests with scripts/test.sh)"
