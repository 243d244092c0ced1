//! Unit tests of `shared/src/cli.rs`, compiled into that module (`#[path]`), so they
//! reach its private items.

use super::*;

fn flags(flags: &[&str]) -> RunArgs {
    use clap::{Args, FromArgMatches};
    let m = RunArgs::augment_args(clap::Command::new("t")).try_get_matches_from(std::iter::once("t").chain(flags.iter().copied())).unwrap();
    RunArgs::from_arg_matches(&m).unwrap()
}

#[test]
fn counts_and_peaks_are_bounded() {
    assert!(validate(&flags(&["--iters", "1000000"])).is_ok());
    let e = validate(&flags(&["--iters", "18446744073709551615"])).unwrap_err().to_string();
    assert!(e.contains("--iters") && e.contains("Fix:"), "{e}");
    assert!(validate(&flags(&["--warmup", "1000000000000"])).is_err());
    for bad in ["1e-300", "0", "-5", "inf", "NaN", "1e300"] {
        assert!(validate(&flags(&[&format!("--peak-tflops={bad}")])).is_err(), "{bad}");
    }
    assert!(validate(&flags(&["--peak-tflops", "989"])).is_ok());
    // --bandwidth-gbs is bounded like --peak-tflops.
    for bad in ["1e-300", "0", "-5", "inf", "NaN", "1e300", "1.7976931348623157e308"] {
        let e = validate(&flags(&[&format!("--bandwidth-gbs={bad}")])).unwrap_err().to_string();
        assert!(e.contains("--bandwidth-gbs") && e.contains("Fix:"), "{e}");
    }
    assert!(validate(&flags(&["--bandwidth-gbs", "3350"])).is_ok());
}

#[test]
fn precision_flag() {
    assert_eq!("auto".parse::<PrecisionRequest>().unwrap(), PrecisionRequest::Auto);
    assert_eq!("BF16".parse::<PrecisionRequest>().unwrap(), PrecisionRequest::Exactly(Precision::Bf16));
    assert!("fp4".parse::<PrecisionRequest>().is_err());
}

#[test]
fn cpu_bf16_values_are_checked() {
    use std::ffi::OsStr;
    assert!(check_cpu_bf16(None).is_ok());
    // Case does not matter (`Kernel::detect_with` lowercases too).
    for ok in ["auto", "off", "OFF", "Off", "f32", "avx512-bf16", "AVX512-BF16"] {
        assert!(check_cpu_bf16(Some(OsStr::new(ok))).is_ok(), "{ok}");
    }
    for bad in ["", "garbage", "of", "0", "false", "amx", " off"] {
        let e = check_cpu_bf16(Some(OsStr::new(bad))).unwrap_err().to_string();
        assert!(e.contains("SPEEDKIT_CPU_BF16") && e.contains(&format!("{bad:?}")), "{e}");
        assert!(e.contains("auto, off, f32, avx512-bf16, mkl") && e.contains("Fix:"), "{e}");
    }
    // mkl only where it is built: otherwise it would quietly mean auto.
    let mkl = check_cpu_bf16(Some(OsStr::new("MKL")));
    assert_eq!(mkl.is_ok(), cpu_kernels::bf16_gemm::Kernel::Mkl.available(), "{mkl:?}");
}
