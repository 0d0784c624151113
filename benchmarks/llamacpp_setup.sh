#!/usr/bin/env bash
# llama.cpp for benchmarks/llamacpp_compare.py, made under one directory (outside the repo):
#
#   bash benchmarks/llamacpp_setup.sh DIR        (or LLAMA_CPP_HOME=DIR; PYTHON: the
#                                                 loraplex interpreter, default python3)
#
# 1. DIR/llama_cpp_python-$VERSION: the llama-cpp-python sdist from the package registry;
#    its vendor/llama.cpp is built with cmake (Release, CPU only, this CPU's own ISA:
#    GGML_NATIVE; GGML_NATIVE=OFF plus GGML_* flags where the native build dies, as AMX did
#    on one VM) for llama-bench, llama-server and llama-quantize. ~10-25 min on 2 cores.
# 2. DIR/venv: the converters' interpreter (convert_hf_to_gguf.py, convert_lora_to_gguf.py):
#    their pinned transformers, sentencepiece, protobuf and the vendored gguf-py; torch is
#    the loraplex interpreter's, seen through a .pth file (never resolved by pip: the
#    registry's default torch is a multi-GB CUDA build).
#
# Prints the two paths llamacpp_compare.py takes (LLAMA_CPP, LLAMA_CPP_PYTHON). Each step is
# skipped when its output is there, so a rerun finishes an interrupted setup.
set -euo pipefail

DIR=${1:-${LLAMA_CPP_HOME:?give DIR or set LLAMA_CPP_HOME}}
VERSION=${LLAMA_CPP_PYTHON_VERSION:-0.3.36}
PYTHON=${PYTHON:-python3}
JOBS=${JOBS:-$(nproc)}
CMAKE_FLAGS=${LLAMA_CPP_CMAKE_FLAGS:--DGGML_NATIVE=ON}
mkdir -p "$DIR"
DIR=$(cd "$DIR" && pwd)
SRC=$DIR/llama_cpp_python-$VERSION
TREE=$SRC/vendor/llama.cpp

if [ ! -d "$TREE" ]; then
    "$PYTHON" -m pip download --no-deps --no-binary :all: "llama-cpp-python==$VERSION" -d "$DIR"
    tar xzf "$DIR/llama_cpp_python-$VERSION.tar.gz" -C "$DIR"
fi

if [ ! -x "$TREE/build/bin/llama-server" ] || [ ! -x "$TREE/build/bin/llama-bench" ] \
        || [ ! -x "$TREE/build/bin/llama-quantize" ]; then
    # shellcheck disable=SC2086  # CMAKE_FLAGS is a list of flags
    cmake -S "$TREE" -B "$TREE/build" -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF \
        -DGGML_CUDA=OFF -DGGML_BLAS=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
        -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_OPENSSL=OFF $CMAKE_FLAGS
    nice cmake --build "$TREE/build" --config Release -j "$JOBS" \
        --target llama-bench llama-server llama-quantize
fi

VENV=$DIR/venv
if [ ! -x "$VENV/bin/python" ] || ! "$VENV/bin/python" -c "import sentencepiece, torch, gguf" \
        2>/dev/null; then
    "$PYTHON" -m venv "$VENV"
    SITE=$("$VENV/bin/python" -c "import sysconfig; print(sysconfig.get_path('purelib'))")
    # the loraplex interpreter's packages, after the venv's own (so its pins win)
    "$PYTHON" -c "import site, sysconfig; print(sysconfig.get_path('purelib'))" \
        > "$SITE/loraplex-interpreter.pth"
    "$VENV/bin/pip" install -q "numpy~=2.2.6" "sentencepiece>=0.1.98,<0.3.0" \
        "transformers==4.57.6" "protobuf>=4.21.0,<5.0.0" safetensors "$TREE/gguf-py"
    "$VENV/bin/python" -c "import torch, sentencepiece, transformers, gguf"
fi

echo "LLAMA_CPP=$TREE"
echo "LLAMA_CPP_PYTHON=$VENV/bin/python"
