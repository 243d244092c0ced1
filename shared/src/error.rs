//! Errors a user can act on, and the exit codes they map to: 0 ran and matched the reference ·
//! 1 unexpected failure (a bug, I/O) · 2 bad input or unsupported configuration (shape, flag,
//! device, feature, memory) · 3 the output did not match the fp32 reference.

use thiserror::Error;

pub const EXIT_FAILURE: u8 = 1;
pub const EXIT_USAGE: u8 = 2;
pub const EXIT_CHECK_FAILED: u8 = 3;

#[derive(Debug, Error)]
pub enum SpeedkitError {
    /// One paragraph naming the cause and the fix.
    #[error("{0}")]
    Usage(String),
    #[error("{0}")]
    CheckFailed(String),
}

impl SpeedkitError {
    pub fn usage(msg: impl Into<String>) -> Self {
        SpeedkitError::Usage(msg.into())
    }
}

/// The exit code and message for an error that reached `main`. Device out-of-memory errors (strings
/// from deep inside candle/cudarc) are bad input, so they get the usage code and a fix.
pub fn classify(err: &anyhow::Error) -> (u8, String) {
    match err.downcast_ref::<SpeedkitError>() {
        Some(e @ SpeedkitError::Usage(_)) => (EXIT_USAGE, strip_backtrace(&e.to_string())),
        Some(e @ SpeedkitError::CheckFailed(_)) => (EXIT_CHECK_FAILED, strip_backtrace(&e.to_string())),
        None => {
            let text = strip_backtrace(&format!("{err:#}"));
            if !(text.contains("OUT_OF_MEMORY") || text.contains("out of memory")) {
                return (EXIT_FAILURE, text);
            }
            let why = "The chosen shape does not fit next to what else is on this device";
            let fix = "Fix: lower --batch or --seq, pick a smaller --preset, or free the device.";
            (EXIT_USAGE, format!("the device ran out of memory ({text}). {why}. {fix}"))
        }
    }
}

/// Whether `err` is a CUDA fault that poisons the context: after an illegal address, a kernel
/// trap or a failed launch, every later CUDA call in this process fails with the same error, so
/// nothing more can run on the device. Out-of-memory is not one (the next, smaller allocation
/// works). Classified by the driver's error names and messages, which reach us only as text.
pub fn is_sticky_cuda_fault(err: &anyhow::Error) -> bool {
    const STICKY: [&str; 14] = [
        "CUDA_ERROR_ILLEGAL_ADDRESS",
        "CUDA_ERROR_LAUNCH_FAILED",
        "CUDA_ERROR_MISALIGNED_ADDRESS",
        "CUDA_ERROR_ILLEGAL_INSTRUCTION",
        "CUDA_ERROR_HARDWARE_STACK_ERROR",
        "CUDA_ERROR_INVALID_PC",
        "CUDA_ERROR_ASSERT",
        "CUDA_ERROR_ECC_UNCORRECTABLE",
        "an illegal memory access",
        "unspecified launch failure",
        "misaligned address",
        "illegal instruction",
        "device-side assert",
        "uncorrectable ECC error",
    ];
    let text = format!("{err:#}");
    STICKY.iter().any(|s| text.contains(s))
}

/// `text` without the backtrace candle appends when RUST_BACKTRACE is set: a message is one paragraph.
pub fn strip_backtrace(text: &str) -> String {
    let end = |t: &str| t.starts_with("0: ") || t == "stack backtrace:" || t.starts_with("disabled backtrace");
    let lines: Vec<&str> = text.lines().take_while(|l| !end(l.trim_start())).collect();
    lines.join("\n").trim_end().to_string()
}

#[cfg(test)]
#[path = "../tests/unit/error.rs"]
mod tests;
