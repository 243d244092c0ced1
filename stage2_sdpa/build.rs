//! With the `cuda` feature: compile `kernels/flash_attn.cu` and `kernels/flash_attn_v2.cu` (stage
//! 2's FlashAttention-2 kernels, v1 and v2) to PTX with nvcc — the compiler the feature already needs for candle's own kernels — into
//! OUT_DIR, where `src/attention_cuda.rs` includes it. CPU builds do nothing here and need no nvcc.
//!
//! Target: `-arch=sm_$CUDA_COMPUTE_CAP` (candle's variable; 80 when unset), always plain PTX
//! (`ptx_arch.rs`: an `a` suffix is dropped). PTX for an architecture runs on that SM and newer
//! ones (the driver compiles it on first load), so the default sm_80 runs on every Ampere, Ada,
//! Hopper and Blackwell part. The kernel's bf16 tensor-core ops need
//! SM 8.0, so a lower CUDA_COMPUTE_CAP still builds it for sm_80 (with a warning); stage 2 then
//! refuses such a GPU at run time with the reason.

use std::env;
use std::path::PathBuf;
use std::process::Command;

#[path = "ptx_arch.rs"]
mod ptx_arch;

fn main() {
    println!("cargo:rerun-if-changed=kernels/flash_attn.cu");
    println!("cargo:rerun-if-changed=kernels/flash_attn_v2.cu");
    println!("cargo:rerun-if-changed=kernels/ptx_warp.h");
    println!("cargo:rerun-if-changed=ptx_arch.rs");
    println!("cargo:rerun-if-env-changed=CUDA_COMPUTE_CAP");
    println!("cargo:rerun-if-env-changed=NVCC");
    println!("cargo:rerun-if-env-changed=CUDA_HOME");
    if env::var_os("CARGO_FEATURE_CUDA").is_none() {
        return;
    }
    let requested = env::var("CUDA_COMPUTE_CAP").ok();
    let (cap, warning) = ptx_arch::ptx_arch(requested.as_deref()).unwrap_or_else(|e| panic!("{e}"));
    if let Some(w) = warning {
        println!("cargo:warning={w}");
    }
    let arch = cap.to_string();
    let nvcc = env::var_os("NVCC")
        .map(PathBuf::from)
        .or_else(|| env::var_os("CUDA_HOME").map(|h| PathBuf::from(h).join("bin/nvcc")).filter(|p| p.exists()))
        .unwrap_or_else(|| PathBuf::from("nvcc"));
    let out_dir = PathBuf::from(env::var("OUT_DIR").expect("cargo sets OUT_DIR"));
    // -I kernels: flash_attn_v2.cu includes <ptx_warp.h>, the inline PTX (the host emulation
    // puts its CPU twin of that header first on its own include path instead).
    for name in ["flash_attn", "flash_attn_v2"] {
        let src = format!("kernels/{name}.cu");
        let result = Command::new(&nvcc)
            .args(["--ptx", &format!("-arch=sm_{arch}"), "-std=c++17", "-O3", "-I", "kernels", "-o"])
            .arg(out_dir.join(format!("{name}.ptx")))
            .arg(&src)
            .output();
        match result {
            Err(e) => panic!(
                "\nstage2_sdpa: the `cuda` feature compiles {src} with nvcc, and running `{}` failed: {e}.\n\
                 Fix: install a CUDA toolkit (nvcc on PATH, or CUDA_HOME / NVCC set), or, with no toolkit, \
                 `source scripts/cuda-toolchain.sh` (CUDA 13.0 from PyPI wheels), then rebuild.\n",
                nvcc.display()
            ),
            Ok(o) if !o.status.success() => panic!(
                "\nstage2_sdpa: nvcc could not compile {src} for sm_{arch}:\n{}{}",
                String::from_utf8_lossy(&o.stdout),
                String::from_utf8_lossy(&o.stderr)
            ),
            Ok(_) => {}
        }
    }
    // The architecture the PTX was built for: stage 2 refuses older GPUs with the reason.
    println!("cargo:rustc-env=SPEEDKIT_ATTN_ARCH={arch}");
}
