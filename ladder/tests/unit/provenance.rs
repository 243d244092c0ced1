//! Unit tests of `ladder/src/provenance.rs`, compiled into that module (`#[path]`), so they
//! reach its private items.

use super::*;

#[test]
fn dates() {
    assert_eq!(date_utc(0), "1970-01-01");
    assert_eq!(date_utc(951_782_400), "2000-02-29");
    assert_eq!(date_utc(1_795_265_999), "2026-11-21");
}

#[test]
fn versions_are_exact() {
    let v = versions();
    let candle = &v["candle-core"];
    assert!(candle.starts_with("0.11.") && candle.split('.').count() == 3, "{candle}");
    assert!(v["rustc"].starts_with("rustc "), "{v:?}");
    assert_eq!(v.contains_key("cudarc"), cfg!(feature = "cuda"));
}

#[test]
fn driver_line() {
    let text = "NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  580.65.06  Release Build  (dvs-builder@U16-I3-B03-4-3)  Sun Jul 27 07:09:50 UTC 2025\nGCC version:  gcc version 13.3.0\n";
    assert_eq!(parse_nvidia_version(text).as_deref(), Some("580.65.06"));
    let text = "NVRM version: NVIDIA UNIX x86_64 Kernel Module  550.54.15  Tue Mar  5 22:23:56 UTC 2024\n";
    assert_eq!(parse_nvidia_version(text).as_deref(), Some("550.54.15"));
    assert_eq!(parse_nvidia_version("nothing"), None);
}
