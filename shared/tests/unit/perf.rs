//! Unit tests of `shared/src/perf.rs`, compiled into that module (`#[path]`), so they
//! reach its private items.

use super::*;
use crate::preset::Preset;

#[test]
fn flops_by_hand() {
    // tiny: B=2 T=64 C=128 FF=512
    // linears 2·128·(4·16384 + 2·128·512) = 256·196608 = 50_331_648
    // attention 2·2·4096·128 = 2_097_152
    assert_eq!(block_flops(&Preset::Tiny.shape()), 52_428_800.0);
}

#[test]
fn peaks() {
    assert_eq!(peak_tflops("NVIDIA H100 80GB HBM3", Precision::Bf16), Some(989.4));
    assert_eq!(peak_tflops("NVIDIA H100 PCIe", Precision::Fp8), Some(1513.0));
    assert_eq!(peak_tflops("NVIDIA H200", Precision::Tf32), Some(494.7));
    assert_eq!(peak_tflops("NVIDIA A100-SXM4-80GB", Precision::Fp8), None);
    assert_eq!(peak_tflops("NVIDIA L40S", Precision::Bf16), Some(362.1));
    assert_eq!(peak_tflops("AMD EPYC 7B13", Precision::Fp32), None);
}

#[test]
fn bandwidths() {
    assert_eq!(peak_bandwidth_gbs("NVIDIA H100 80GB HBM3"), Some(3350.0));
    assert_eq!(peak_bandwidth_gbs("NVIDIA H100 PCIe"), Some(2000.0));
    assert_eq!(peak_bandwidth_gbs("NVIDIA GH200 480GB"), Some(4000.0));
    assert_eq!(peak_bandwidth_gbs("NVIDIA A100-SXM4-80GB"), Some(2039.0));
    assert_eq!(peak_bandwidth_gbs("NVIDIA L40S"), Some(864.0));
    assert_eq!(peak_bandwidth_gbs("AMD EPYC 7B13"), None);
}

/// Regression: "NVIDIA H200 NVL" matched the H200 SXM row.
#[test]
fn h200_nvl_is_not_the_sxm_part() {
    assert_eq!(peak_tflops("NVIDIA H200 NVL", Precision::Bf16), Some(835.0));
    assert_eq!(peak_tflops("NVIDIA H200 NVL", Precision::Fp8), Some(1670.5));
    assert_eq!(peak_tflops("NVIDIA H200", Precision::Bf16), Some(989.4));
}

/// First match wins, so a fragment must never be shadowed by an earlier one it contains.
#[test]
fn no_row_is_shadowed_by_an_earlier_one() {
    for (i, (later, ..)) in PEAKS.iter().enumerate() {
        for (earlier, ..) in &PEAKS[..i] {
            assert!(!later.contains(earlier), "{later:?} is unreachable: {earlier:?} comes first and matches it");
        }
    }
}
