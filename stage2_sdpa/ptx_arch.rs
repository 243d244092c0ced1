//! Which PTX architecture `build.rs` compiles the attention kernel for, as a pure function so a
//! test can pin it down (`tests/ptx_arch.rs` includes this file).
//!
//! Plain `sm_XX` PTX is forward-compatible: the driver JIT-compiles it for the GPU it meets, so
//! sm_80 PTX runs on Ampere, Ada, Hopper and Blackwell. Arch-specific PTX (`sm_90a`, `sm_100a`)
//! loads only on that exact architecture; the kernel uses no arch-specific instruction (no
//! wgmma, no TMA), so an `a` suffix in CUDA_COMPUTE_CAP is dropped, never followed: a Blackwell
//! user of a binary built with CUDA_COMPUTE_CAP=90a would otherwise get a raw module-load error.

/// The compute capability to build plain PTX for (e.g. 90 for `sm_90`), and a warning to print
/// when the request was changed. `requested` is CUDA_COMPUTE_CAP (candle's variable; 80 when
/// unset): "90", "90a", "9.0", "sm_90" and "compute_90" all name SM 9.0.
pub fn ptx_arch(requested: Option<&str>) -> Result<(u32, Option<String>), String> {
    let requested = requested.unwrap_or("80");
    let digits: String = requested.chars().filter(char::is_ascii_digit).collect();
    let cap: u32 = digits.parse().map_err(|_| format!("CUDA_COMPUTE_CAP={requested:?} is not a compute capability such as 80 or 90"))?;
    if cap < 80 {
        return Ok((
            80,
            Some(format!(
                "stage2_sdpa: CUDA_COMPUTE_CAP={requested} is below 80; the attention kernel (bf16 tensor cores) is built for sm_80 and stage 2 will refuse this GPU at run time"
            )),
        ));
    }
    let warning = requested.trim().ends_with(['a', 'f']).then(|| {
        format!(
            "stage2_sdpa: CUDA_COMPUTE_CAP={requested} asks for arch-specific PTX, which loads on no other GPU; the attention kernel needs none of its instructions, so it is built as plain sm_{cap} (runs on SM {}.{} and newer)",
            cap / 10,
            cap % 10
        )
    });
    Ok((cap, warning))
}
