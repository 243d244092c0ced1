//! One `ladder` run at `tiny` on the CPU with `--breakdown` (one iteration, no warm-up) and the
//! arguments given, read back from its JSON: what the kernel-trace tests check.

use shared::report::LadderReport;
use std::process::Command;

/// Runs the ladder binary with `extra` after the common arguments; `name` keeps concurrent
/// tests' JSON files apart. Panics with the run's output when it fails.
pub fn run_tiny(name: &str, extra: &[&str]) -> LadderReport {
    let json = std::env::temp_dir().join(format!("speedkit-{name}-{}.json", std::process::id()));
    let o = Command::new(env!("CARGO_BIN_EXE_ladder"))
        .args(["--device", "cpu", "--preset", "tiny", "--warmup", "0", "--iters", "1", "--breakdown", "--json"])
        .arg(&json)
        .args(extra)
        .env_remove("SPEEDKIT_ELEMENTWISE")
        .env_remove("SPEEDKIT_FUSIONS")
        .output()
        .unwrap();
    assert!(o.status.success(), "{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr));
    let report = serde_json::from_slice(&std::fs::read(&json).unwrap()).unwrap();
    std::fs::remove_file(&json).ok();
    report
}
