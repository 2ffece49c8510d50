#!/usr/bin/env bash
# Build llama.cpp's own HTTP server (llama-server) once, for `make test-remote`.
#
# Why build it: the remote-engine tests need llama.cpp's server proper (token-id
# prompts, cache_prompt, id_slot, timings.cache_n, /tokenize); llama-cpp-python's
# Python server accepts only text prompts and reports no cache counts. No registry
# we can reach ships a llama-server binary, so we compile the llama.cpp that the
# llama-cpp-python sdist vendors (pip fetches it; pip's cache keeps it), CPU only,
# and keep the binary under ~/.cache so later runs (and CI on this machine) reuse it.
#
# Prints the binary's path on its last line. LLAMA_CPP_PYTHON_VERSION picks the sdist.
set -euo pipefail

VERSION="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"
CACHE="${CLM_LLAMA_SERVER_CACHE:-$HOME/.cache/clm-middleware/llama-server-$VERSION}"
BIN="$CACHE/bin/llama-server"
PYTHON="${PYTHON:-python3}"

if [ -x "$BIN" ]; then
    echo "$BIN"
    exit 0
fi

WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT
"$PYTHON" -m pip download --quiet --no-deps --no-binary llama-cpp-python "llama-cpp-python==$VERSION" -d "$WORK" >&2
tar -xzf "$WORK"/llama_cpp_python-"$VERSION".tar.gz -C "$WORK"
SRC="$WORK/llama_cpp_python-$VERSION/vendor/llama.cpp"

# Offline and CPU only: no web UI download (LLAMA_USE_PREBUILT_UI), no curl, no TLS;
# static so the binary needs nothing from the build tree.
cmake -S "$SRC" -B "$WORK/build" -G Ninja \
    -DCMAKE_BUILD_TYPE=Release \
    -DBUILD_SHARED_LIBS=OFF \
    -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_COMMON=ON \
    -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_APP=OFF \
    -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF \
    -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF \
    -DGGML_NATIVE=ON >&2
cmake --build "$WORK/build" --target llama-server -j "${JOBS:-$(nproc)}" >&2
mkdir -p "$CACHE/bin"
cp "$WORK/build/bin/llama-server" "$BIN.partial"
mv "$BIN.partial" "$BIN"  # atomic: a half-copied binary is never taken for a built one
echo "$BIN"
