//! Exact versions for the ladder's JSON: the crates as locked in the workspace's Cargo.lock, and
//! the compiler. Read at build time, so a run reports what it was built from.

use std::path::PathBuf;

fn main() {
    let lock = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR").unwrap()).join("../Cargo.lock");
    println!("cargo:rerun-if-changed={}", lock.display());
    println!("cargo:rerun-if-changed=build.rs");
    let text = std::fs::read_to_string(&lock).unwrap_or_default();
    for (krate, var) in [
        ("candle-core", "SPEEDKIT_LOCKED_CANDLE_CORE"),
        ("cudarc", "SPEEDKIT_LOCKED_CUDARC"),
        ("candle-flash-attn", "SPEEDKIT_LOCKED_CANDLE_FLASH_ATTN"),
    ] {
        println!("cargo:rustc-env={var}={}", locked_versions(&text, krate));
    }
    let rustc = std::env::var("RUSTC").unwrap_or_else(|_| "rustc".into());
    let version = std::process::Command::new(rustc)
        .arg("--version")
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .unwrap_or_else(|| "unknown".into());
    println!("cargo:rustc-env=SPEEDKIT_RUSTC_VERSION={version}");
}

/// Every version of `krate` in Cargo.lock (`[[package]]` blocks: name, then version), joined
/// with ", " when the lock holds more than one; "unknown" without a lock file.
fn locked_versions(lock: &str, krate: &str) -> String {
    let name = format!("name = \"{krate}\"");
    let mut found = Vec::new();
    let mut lines = lock.lines();
    while let Some(line) = lines.next() {
        if line.trim() == name {
            if let Some(v) = lines.next().and_then(|l| l.trim().strip_prefix("version = \"")).and_then(|v| v.strip_suffix('"')) {
                found.push(v.to_string());
            }
        }
    }
    if found.is_empty() {
        "unknown".into()
    } else {
        found.join(", ")
    }
}
