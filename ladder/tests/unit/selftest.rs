//! Unit tests of `ladder/src/selftest.rs`, compiled into that module (`#[path]`), so they
//! reach its private items.

use super::*;

/// The CPU side of the list passes, covers every block, runs the graph rows last, and the JSON carries what a bug
/// report needs.
#[test]
fn cpu_selftest_passes_and_covers_every_block() {
    let (device, info) = shared::device::select(shared::device::DeviceRequest::Cpu).unwrap();
    let rep = run(&device, &info);
    assert_eq!(rep.failed, 0, "{}", table(&rep));
    for block in [
        "attention",
        "cuBLASLt epilogue",
        "cuBLASLt training epilogues",
        "FP8 GEMM",
        "FP8 kernel",
        "FP8 training GEMM",
        "LayerNorm kernel",
        "attention backward",
        "fused AdamW",
        "breakdown",
        "memory probe",
    ] {
        assert!(rep.results.iter().any(|c| c.block == block && c.status == "pass"), "{block} missing");
    }
    assert!(rep.results.iter().any(|c| c.block == "CUDA graph" && c.status == "skipped"), "a CPU has no graph to replay");
    assert_eq!(rep.results.iter().filter(|c| c.block == "FP8 kernel" && c.status == "pass").count(), 4, "amax, 2 casts, delayed update");
    assert_eq!(
        rep.results.iter().filter(|c| c.block == "FP8 training GEMM" && c.status == "pass").count(),
        4,
        "dgrad, wgrad, each with its fallback"
    );
    assert_eq!(rep.results.iter().filter(|c| c.block == "attention").count(), 12, "3 d_head × 2 dtypes × causal or not");
    assert_eq!(
        rep.results.iter().filter(|c| c.block == "attention backward").count(),
        24,
        "dQ, dK, dV × 2 shapes × 2 dtypes × causal or not"
    );
    assert_eq!(rep.results.iter().filter(|c| c.block == "fused AdamW").count(), 3, "θ, m, v");
    // The graph rows last: a sticky CUDA fault a capture leaves cannot fail a row after it.
    let first_graph = rep.results.iter().position(|c| c.block == "CUDA graph").expect("a graph row");
    assert!(rep.results[first_graph..].iter().all(|c| c.block == "CUDA graph" && c.ran.is_empty()), "{}", table(&rep));
    let json = serde_json::to_value(&rep).unwrap();
    for key in ["device", "nvidia_driver", "cuda_driver_version", "commit", "versions", "results"] {
        assert!(json.get(key).is_some(), "{key}");
    }
}

/// Regression: an error is a failure whatever its kind (on the H100 a
/// CUDA error wrapped as "cannot run here" showed as skipped), its text carries no
/// backtrace, and only `skip` skips.
#[test]
fn an_error_is_a_failure_without_its_backtrace_and_only_skip_skips() {
    let mut r = shared::selftest::Rows { rows: Vec::new(), ran: "cuda".into() };
    let wrapped = "cannot quantise fp8's weight to FP8: DriverError(CUDA_ERROR_NOT_FOUND, \"named symbol not found\")\n   0: <unknown>\n   1: <unknown>\n  19: __libc_start_main";
    r.compare("FP8 GEMM", "usage-wrapped driver error".into(), || Err(shared::SpeedkitError::usage(wrapped).into()));
    r.outcome("x", "plain error".into(), Err(anyhow::anyhow!("{wrapped}")));
    r.skip("FP8 GEMM", "no FP8 units".into(), "FP8 tensor cores need SM 8.9+; this GPU has none".into());
    let status: Vec<&str> = r.rows.iter().map(|c| c.status.as_str()).collect();
    assert_eq!(status, ["error", "error", "skipped"]);
    for c in &r.rows[..2] {
        assert!(c.detail.ends_with("named symbol not found\")") && !c.detail.contains("<unknown>"), "{}", c.detail);
    }
}

/// The breakdown row's own check fails on what a broken recorder gives.
#[test]
fn breakdown_check_refuses_missing_parts_and_bad_times() {
    use shared::breakdown::{summarise, PARTS};
    let good: Vec<(&'static str, f64)> = PARTS.iter().map(|p| (*p, 0.5)).collect();
    let ok = summarise(std::slice::from_ref(&good), 1, "m".into()).unwrap();
    check_breakdown(&ok).unwrap();
    let short = summarise(&[good[..3].to_vec()], 1, "m".into()).unwrap();
    assert!(check_breakdown(&short).is_err());
    let mut nan = good.clone();
    nan[2].1 = f64::NAN;
    assert!(check_breakdown(&summarise(&[nan], 1, "m".into()).unwrap()).is_err());
    let zero: Vec<(&'static str, f64)> = PARTS.iter().map(|p| (*p, 0.0)).collect();
    assert!(check_breakdown(&summarise(&[zero], 1, "m".into()).unwrap()).is_err());
}
