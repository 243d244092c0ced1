# candle-speedkit on an NVIDIA GPU: the whole ladder, built with --features cuda, so stages 2–4
# run the project's own attention kernel (the one the lesson is about).
#
#   docker build -t candle-speedkit --build-arg CUDA_COMPUTE_CAP=90 .
#   docker run --rm --gpus all candle-speedkit
#
# Opt in to candle-flash-attn instead of our kernel (its build fetches CUTLASS, so it needs the
# network): --build-arg FEATURES=cuda,flash-attn. Every table says which attention ran.
# The devel image: the build runs nvcc, which compiles our hand-written kernels (stages 2–4) to
# machine code (cubins) for CUDA_COMPUTE_CAP, and candle's own kernels to PTX. The host needs the
# NVIDIA Container Toolkit and a driver for CUDA 13 (580 or newer).
FROM nvidia/cuda:13.0.2-devel-ubuntu24.04

# nvidia-smi does not exist while `docker build` runs, so the GPU architecture the CUDA kernels
# are compiled for is an argument: 90 = Hopper (H100, H200), 89 = Ada (L40S, RTX 4090), 80 = A100.
# From 90 up, cudaforge builds candle's own kernels as arch-specific PTX (sm_90a), which loads on
# SM 9.0 only, not on Blackwell or later. --build-arg CUDA_COMPUTE_CAP=80 makes candle's PTX load
# on any GPU of SM 8.0 or newer (the driver compiles it at first load), but our cubins built for
# sm_80 run on SM 8.x only and refuse a 9.0 GPU (docs/gpu.md, "sm_90a, and a portable build").
ARG CUDA_COMPUTE_CAP=90
# The toolchain the workspace is developed and tested with (Cargo.toml's rust-version is the floor).
ARG RUST_VERSION=1.95.0
# cuda (default): our own kernels; cuda,flash-attn: stages 2–4 attention through candle-flash-attn.
ARG FEATURES=cuda

ENV CUDA_COMPUTE_CAP=${CUDA_COMPUTE_CAP} \
    RUSTUP_HOME=/usr/local/rustup \
    CARGO_HOME=/usr/local/cargo \
    PATH=/usr/local/cargo/bin:${PATH}

# build-essential: the C++ host compiler for nvcc; git: candle-flash-attn's build fetches
# CUTLASS; curl and ca-certificates: rustup. Ubuntu's package versions float within the
# 24.04 release, which is what we want for these build tools.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends build-essential ca-certificates curl git pkg-config \
    && rm -rf /var/lib/apt/lists/*

SHELL ["/bin/bash", "-o", "pipefail", "-c"]
RUN curl --proto '=https' --tlsv1.2 -sSf https://sh.rustup.rs \
    | sh -s -- -y --profile minimal --default-toolchain "${RUST_VERSION}" --no-modify-path \
    && rustc --version

# The whole checkout, .git included: the ladder records the commit it was built from.
WORKDIR /src
COPY . .
RUN cargo build --release --locked --features "${FEATURES}" -p ladder \
    && cp target/release/ladder /usr/local/bin/ladder

# The ladder on TransformerEngine's getting-started shape. Any ladder flags can follow the image
# name instead, e.g. `docker run --rm --gpus all candle-speedkit ladder --preset gpt2 --markdown`.
CMD ["ladder", "--preset", "te", "--device", "cuda"]
