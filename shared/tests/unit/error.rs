//! Unit tests of `shared/src/error.rs`, compiled into that module (`#[path]`), so they
//! reach its private items.

use super::*;

#[test]
fn backtraces_are_not_part_of_a_message() {
    let t = "shape mismatch in matmul, lhs: [2, 3]\n   0: candle_core::error::Error::bt\n             at src/error.rs:1\n   1: main";
    assert_eq!(strip_backtrace(t), "shape mismatch in matmul, lhs: [2, 3]");
    let e: anyhow::Error = SpeedkitError::usage(format!("cannot use weights file w: {t}. Fix: x")).into();
    assert!(!classify(&e).1.contains("candle_core::error"));
    assert_eq!(strip_backtrace("two\nlines"), "two\nlines");
}

#[test]
fn codes() {
    let e: anyhow::Error = SpeedkitError::usage("bad").into();
    assert_eq!(classify(&e), (EXIT_USAGE, "bad".into()));
    let e: anyhow::Error = SpeedkitError::CheckFailed("off".into()).into();
    assert_eq!(classify(&e).0, EXIT_CHECK_FAILED);
    let e = anyhow::anyhow!("DriverError(CUDA_ERROR_OUT_OF_MEMORY, \"out of memory\")");
    let (code, msg) = classify(&e);
    assert_eq!(code, EXIT_USAGE);
    assert!(msg.contains("lower --batch"));
    assert_eq!(classify(&anyhow::anyhow!("disk on fire")).0, EXIT_FAILURE);
}

#[test]
fn sticky_cuda_faults_are_told_from_the_rest() {
    let sticky = [
        "DriverError(CUDA_ERROR_ILLEGAL_ADDRESS, \"an illegal memory access was encountered\")",
        "an illegal memory access was encountered",
        "DriverError(CUDA_ERROR_LAUNCH_FAILED, \"unspecified launch failure\")",
        "unspecified launch failure",
        "DriverError(CUDA_ERROR_MISALIGNED_ADDRESS, \"misaligned address\")",
        "DriverError(CUDA_ERROR_ILLEGAL_INSTRUCTION, \"an illegal instruction was encountered\")",
        "device-side assert triggered",
    ];
    for t in sticky {
        assert!(is_sticky_cuda_fault(&anyhow::anyhow!("{t}")), "{t}");
    }
    // Found in the context chain too, as a stage's error wraps the driver's.
    assert!(is_sticky_cuda_fault(&anyhow::anyhow!("unspecified launch failure").context("stage4_fp8 forward")));
    let not = [
        "DriverError(CUDA_ERROR_OUT_OF_MEMORY, \"out of memory\")",
        "DriverError(CUDA_ERROR_INVALID_VALUE, \"invalid argument\")",
        "DriverError(CUDA_ERROR_NOT_FOUND, \"named symbol not found\")",
        "shape mismatch in matmul, lhs: [2, 3], rhs: [4, 5]",
        "disk on fire",
    ];
    for t in not {
        assert!(!is_sticky_cuda_fault(&anyhow::anyhow!("{t}")), "{t}");
    }
    let e: anyhow::Error = SpeedkitError::CheckFailed("relative error 1e-1 exceeds the tolerance".into()).into();
    assert!(!is_sticky_cuda_fault(&e));
}
