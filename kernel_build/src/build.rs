//! How every crate with hand-written CUDA kernels builds them (stages 2, 3 and 4 call
//! `build_cubins` from their `build.rs`; `tests/kernel_build.rs` pins the pure part down).
//!
//! With the `cuda` feature, nvcc compiles each `.cu` file at build time to a cubin — machine
//! code — for every architecture listed in `CUDA_COMPUTE_CAP` (candle's variable: `90`, or a
//! list such as `80,90`; 80 when unset), and writes `$OUT_DIR/cubins.rs`, which the crate
//! includes: one `&[(arch, bytes)]` table per kernel file. At run time `kernel_cache`
//! picks the cubin for the device's SM and loads it once per device. The driver loads machine
//! code as it is: no PTX for it to compile, so no run-time compiler, and no "PTX was built by
//! a newer toolkit than this driver" refusal. CPU builds do nothing here and need no nvcc.
//!
//! A cubin runs on its own major architecture at the same or a later minor version (sm_80 on
//! SM 8.0, 8.6, 8.9; not on 9.0), so the list should name each major the binary is meant for.
//! Arch-specific targets (`90a`) run on one exact GPU; none of our kernels uses their
//! instructions, so an `a`/`f` suffix is dropped with a warning.

use std::path::{Path, PathBuf};

/// The architectures (10·major + minor) to build cubins for, and warnings to print.
/// `requested` is CUDA_COMPUTE_CAP (80 when unset): entries separated by commas or spaces, each
/// spelled "90", "90a", "9.0", "sm_90" or "compute_90". An entry below `min` (the lowest
/// architecture the kernels compile for) is raised to `min`, with a warning saying so.
pub fn cubin_archs(requested: Option<&str>, min: u32, krate: &str) -> Result<(Vec<u32>, Vec<String>), String> {
    let requested = requested.unwrap_or("80");
    let mut archs = Vec::new();
    let mut warnings = Vec::new();
    for entry in requested.split([',', ' ', ';']).map(str::trim).filter(|e| !e.is_empty()) {
        let digits: String = entry.chars().filter(char::is_ascii_digit).collect();
        let cap: u32 = digits
            .parse()
            .map_err(|_| format!("CUDA_COMPUTE_CAP={requested:?}: {entry:?} is not a compute capability such as 80 or 90"))?;
        if entry.ends_with(['a', 'f']) {
            warnings.push(format!(
                "{krate}: CUDA_COMPUTE_CAP entry {entry} asks for arch-specific code, which runs on one GPU model only; our kernels need none of its instructions, so they are built for plain sm_{cap}"
            ));
        }
        let cap = if cap < min {
            warnings.push(format!("{krate}: CUDA_COMPUTE_CAP entry {entry} is below {min}, the oldest architecture these kernels are written for; they are built for sm_{min}, and the op refuses older GPUs at run time"));
            min
        } else {
            cap
        };
        if !archs.contains(&cap) {
            archs.push(cap);
        }
    }
    if archs.is_empty() {
        return Err(format!("CUDA_COMPUTE_CAP={requested:?} names no architecture (e.g. 90, or 80,90)"));
    }
    archs.sort_unstable();
    Ok((archs, warnings))
}

/// Compiles `kernels/<name>.cu` for each architecture in CUDA_COMPUTE_CAP and writes the table
/// `<NAME>: &[(u32, &[u8])]` per kernel into `$OUT_DIR/cubins.rs`. Call from `build.rs`.
/// `sources` lists every file the kernels read (for cargo's rerun-if-changed).
pub fn build_cubins(krate: &str, kernels: &[&str], min_arch: u32, sources: &[&str]) {
    for s in sources {
        println!("cargo:rerun-if-changed={s}");
    }
    for v in ["CUDA_COMPUTE_CAP", "NVCC", "CUDA_HOME"] {
        println!("cargo:rerun-if-env-changed={v}");
    }
    if std::env::var_os("CARGO_FEATURE_CUDA").is_none() {
        return;
    }
    let requested = std::env::var("CUDA_COMPUTE_CAP").ok();
    let (archs, warnings) = cubin_archs(requested.as_deref(), min_arch, krate).unwrap_or_else(|e| panic!("\n{krate}: {e}\n"));
    for w in warnings {
        println!("cargo:warning={w}");
    }
    let nvcc = std::env::var_os("NVCC")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("CUDA_HOME").map(|h| PathBuf::from(h).join("bin/nvcc")).filter(|p| p.exists()))
        .unwrap_or_else(|| PathBuf::from("nvcc"));
    let out_dir = PathBuf::from(std::env::var("OUT_DIR").expect("cargo sets OUT_DIR"));
    let mut table = String::from("// Written by build.rs (kernel_build::build): one cubin per architecture and kernel file.\n");
    for name in kernels {
        let mut rows = Vec::new();
        for arch in &archs {
            let out = out_dir.join(format!("{name}.sm_{arch}.cubin"));
            compile(&nvcc, krate, name, *arch, &out);
            rows.push(format!("({arch}, include_bytes!({:?}))", out.display().to_string()));
        }
        table.push_str(&format!("pub const {}: &[(u32, &[u8])] = &[{}];\n", name.to_uppercase(), rows.join(", ")));
    }
    std::fs::write(out_dir.join("cubins.rs"), table).unwrap_or_else(|e| panic!("{krate}: cannot write cubins.rs into OUT_DIR: {e}"));
}

/// nvcc -cubin for one kernel file and architecture. `-lineinfo`: source lines for Nsight
/// Compute's per-line counters (no change to the code). `-I kernels`: a kernel may include its
/// headers (the host emulation puts its CPU twins of them first on its own include path).
fn compile(nvcc: &Path, krate: &str, name: &str, arch: u32, out: &Path) {
    let src = format!("kernels/{name}.cu");
    let result = std::process::Command::new(nvcc)
        .args(["-cubin", &format!("-arch=sm_{arch}"), "-std=c++17", "-O3", "-lineinfo", "-I", "kernels", "-o"])
        .arg(out)
        .arg(&src)
        .output();
    match result {
        Err(e) => panic!(
            "\n{krate}: the `cuda` feature compiles {src} with nvcc, and running `{}` failed: {e}.\n\
             Fix: install a CUDA toolkit (nvcc on PATH, or CUDA_HOME / NVCC set), or, with no toolkit, \
             `source scripts/cuda-toolchain.sh` (CUDA 13.0 from PyPI wheels), then rebuild.\n",
            nvcc.display()
        ),
        Ok(o) if !o.status.success() => panic!(
            "\n{krate}: nvcc could not compile {src} for sm_{arch}:\n{}{}",
            String::from_utf8_lossy(&o.stdout),
            String::from_utf8_lossy(&o.stderr)
        ),
        Ok(_) => {}
    }
}
