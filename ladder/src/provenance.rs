//! Where a run's numbers come from beyond the device: exact crate, compiler and GPU driver versions, and the date.

use shared::device::DeviceInfo;
use std::collections::BTreeMap;

/// Exact versions this binary was built from (build.rs): cudarc and candle-flash-attn when built in.
pub fn versions() -> BTreeMap<String, String> {
    let all = [
        ("candle-core", env!("SPEEDKIT_LOCKED_CANDLE_CORE"), true),
        ("candle-speedkit", env!("CARGO_PKG_VERSION"), true),
        ("rustc", env!("SPEEDKIT_RUSTC_VERSION"), true),
        ("cudarc", env!("SPEEDKIT_LOCKED_CUDARC"), cfg!(feature = "cuda")),
        ("candle-flash-attn", env!("SPEEDKIT_LOCKED_CANDLE_FLASH_ATTN"), cfg!(feature = "flash-attn")),
    ];
    all.into_iter().filter(|(_, _, built_in)| *built_in).map(|(k, v, _)| (k.into(), v.into())).collect()
}

/// The CUDA version the driver the run used supports, e.g. "13.0"; `None` off a GPU.
pub fn cuda_driver_version(info: &DeviceInfo) -> Option<String> {
    info.is_cuda().then(driver_api_version).flatten().map(|v| format!("{}.{}", v / 1000, (v % 1000) / 10))
}

#[cfg(feature = "cuda")]
fn driver_api_version() -> Option<i32> {
    use candle_core::cuda::cudarc::driver::sys;
    let mut version: std::ffi::c_int = 0;
    // SAFETY: cuDriverGetVersion writes one int through the pointer and needs no context; the
    // driver library is already loaded, since the run opened a device through it.
    let status = unsafe { sys::cuDriverGetVersion(&mut version) };
    (status == sys::CUresult::CUDA_SUCCESS).then_some(version)
}

#[cfg(not(feature = "cuda"))]
fn driver_api_version() -> Option<i32> {
    None
}

/// The NVIDIA kernel module's version, e.g. "580.65.06"; `None` off a GPU or when a container hides /proc's file.
pub fn nvidia_driver(info: &DeviceInfo) -> Option<String> {
    let text = info.is_cuda().then(|| std::fs::read_to_string("/proc/driver/nvidia/version").ok()).flatten()?;
    parse_nvidia_version(&text)
}

/// "NVRM version: NVIDIA UNIX x86_64 Kernel Module  580.65.06  Sun Jul 27 ..." → "580.65.06".
fn parse_nvidia_version(text: &str) -> Option<String> {
    let line = text.lines().find(|l| l.starts_with("NVRM version"))?;
    let rest = line.split("Kernel Module").nth(1)?;
    let is_version = |w: &&str| w.contains('.') && w.chars().all(|c| c.is_ascii_digit() || c == '.');
    rest.split_whitespace().find(is_version).map(str::to_string)
}

/// A Unix time as a UTC calendar date, "YYYY-MM-DD" (Howard Hinnant's days-to-civil).
pub fn date_utc(unix: u64) -> String {
    let z = (unix / 86_400) as i64 + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!("{y:04}-{m:02}-{d:02}")
}

#[cfg(test)]
#[path = "../tests/unit/provenance.rs"]
mod tests;
