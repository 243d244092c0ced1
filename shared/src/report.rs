//! What a run reports: one record per stage (versioned JSON), and the human table. Fields added
//! after v1 was first written are optional (`Option`, or `#[serde(default)]`), so older files
//! still load.

use crate::breakdown::Breakdown;
use crate::ceiling::CpuCeiling;
use crate::check::{CheckResult, NamedCheck};
use crate::device::{DeviceInfo, GemmSwitches};
use crate::preset::Shape;
use crate::stage::Precision;
use crate::timing::Stats;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::path::Path;

/// `Record::peak_source` of a CPU row whose % of peak is against the measured GEMM ceiling.
pub const MEASURED_PEAK: &str = "measured GEMM ceiling";

/// Bump when a field changes meaning or disappears; adding fields keeps the version.
pub const RECORD_SCHEMA: &str = "candle-speedkit/record/v1";
pub const LADDER_SCHEMA: &str = "candle-speedkit/ladder/v1";
pub const SWEEP_SCHEMA: &str = "candle-speedkit/sweep/v1";

/// One stage, measured.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Record {
    pub schema: String,
    pub stage: String,
    pub technique: String,
    pub precision: Precision,
    pub precision_reason: String,
    /// Which implementation ran, for stages with more than one (e.g. "emulated" FP8).
    pub implementation: Option<String>,
    pub device: DeviceInfo,
    pub shape: Shape,
    pub seed: u64,
    pub weights: String,
    pub gemm_switches: GemmSwitches,
    pub warmup: usize,
    pub iters: usize,
    pub timing: Stats,
    pub tokens_per_s: f64,
    pub flops_per_forward: f64,
    pub tflops: f64,
    pub peak_tflops: Option<f64>,
    pub pct_of_peak: Option<f64>,
    /// "datasheet", "--peak-tflops" or `MEASURED_PEAK` (the CPU probe, `ceiling`).
    pub peak_source: Option<String>,
    /// The GEMM library detected at run time, e.g. "gemm x86-v4 (AVX-512)", "MKL (mkl feature)", "cuBLAS".
    pub gemm_backend: Option<String>,
    /// The CPU's SIMD level detected at run time ("AVX-512", "AVX2+FMA", ...); `None` on a GPU.
    pub simd: Option<String>,
    /// The CPU ceiling this record's % of peak is relative to; `None` on a GPU.
    pub ceiling: Option<CpuCeiling>,
    /// `None` with --no-check.
    pub check: Option<CheckResult>,
    /// The stage's own checks (`Stage::self_check`), e.g. stage 4's fp8-rounded fp32 twin.
    #[serde(default)]
    pub extra_checks: Vec<NamedCheck>,
    pub peak_mem_bytes: Option<u64>,
    pub mem_method: String,
    pub speedup_vs_stage0: Option<f64>,
    pub speedup_vs_prev: Option<f64>,
    /// Things the reader should know about this number (e.g. "no tensor cores on CPU").
    pub notes: Vec<String>,
    /// The speedup's p10–p90 interval overlaps the compared row's: shown as "≈1.0x" (the
    /// measured ratio stays in `speedup_vs_*`). Filled in by the ladder.
    #[serde(default)]
    pub noise_vs_stage0: bool,
    #[serde(default)]
    pub noise_vs_prev: bool,
    /// `--breakdown`: per-part times of an instrumented forward (see `breakdown`).
    pub breakdown: Option<Breakdown>,
    /// An ablation row (`ladder --ablate`): what this run changed against the stage, e.g. "without ln".
    pub variant: Option<String>,
}

/// A stage the ladder did not measure: it cannot run here (`failed: false`), or it ran and
/// failed its check against the reference (`failed: true`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Skipped {
    pub stage: String,
    pub technique: String,
    pub reason: String,
    pub failed: bool,
}

/// The ladder's JSON: every record, plus where and what it ran on.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct LadderReport {
    pub schema: String,
    pub device: DeviceInfo,
    pub shape: Shape,
    pub commit: String,
    /// candle-core as locked when the binary was built, e.g. "0.11.1" (older files: "0.11").
    pub candle_version: String,
    pub cuda_build: bool,
    pub unix_time: u64,
    pub records: Vec<Record>,
    pub skipped: Vec<Skipped>,
    /// The stages this run was asked for, in ladder order; rows follow it (older files: empty,
    /// rows are then the records followed by the skipped stages).
    #[serde(default)]
    pub stages: Vec<String>,
    /// The command-line arguments after the program name, so a reader can rerun it.
    #[serde(default)]
    pub args: Vec<String>,
    /// Exact versions of what ran: candle-core, speedkit, rustc, and cudarc (and
    /// candle-flash-attn) in CUDA builds.
    #[serde(default)]
    pub versions: BTreeMap<String, String>,
    /// The CUDA version the driver supports (cuDriverGetVersion), e.g. "13.0".
    pub cuda_driver_version: Option<String>,
    /// The NVIDIA kernel driver's version (/proc/driver/nvidia/version), e.g. "580.65.06".
    pub nvidia_driver: Option<String>,
    /// The CPU's measured GEMM ceiling and memory bandwidth (`ceiling`); `None` on a GPU.
    pub ceiling: Option<CpuCeiling>,
    /// `ladder --ablate`: each stage-3 fusion removed in turn, and stage 2 with the head
    /// split/merge copies kept, measured in the same interleaved rounds as the rows.
    #[serde(default)]
    pub ablation: Vec<Ablation>,
    /// `--ablate` variants that did not run (refused here: skipped; broke or failed a check: failed).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub ablation_out: Vec<AblationOut>,
    pub ceilings: Option<Ceilings>,
    /// How many interleaved rounds the timed iterations were split into (older files: 1).
    pub rounds: Option<usize>,
}

/// One ablation row: a stage with one of its sub-techniques undone.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Ablation {
    /// The stage as written, e.g. "stage3_fused".
    pub against: String,
    /// What was undone, e.g. "without qkv" (one fusion) or "head split/merge copies kept".
    pub change: String,
    pub record: Record,
    /// Variant median over the stage's median: what the undone technique buys (>1: it helps).
    pub buys: Option<f64>,
    /// `buys`' p10–p90 intervals overlap: shown as "≈1.0x".
    #[serde(default)]
    pub buys_within_noise: bool,
}

/// An ablation variant that left the rounds, with why (as `Skipped` is for a stage).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct AblationOut {
    pub against: String,
    pub change: String,
    pub reason: String,
    pub failed: bool,
}

/// The roofline's ceilings. Each is `None` when unknown (no % of peak, no line).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Ceilings {
    /// Peak compute per precision name ("fp32", "bf16", ...) in TFLOP/s.
    pub tflops: BTreeMap<String, f64>,
    pub bandwidth_gbs: Option<f64>,
    /// Where the figures come from, e.g. "datasheet (NVIDIA H100 80GB HBM3)", "measured".
    pub source: String,
}

/// `ladder --sweep`: one ladder run per value of one dimension, same flags otherwise.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct SweepReport {
    pub schema: String,
    /// The swept dimension as its flag is spelled: "seq", "batch" or "d_model".
    pub axis: String,
    pub values: Vec<usize>,
    /// One ladder per value, in the order of `values`; a shape that cannot run has every stage skipped.
    pub runs: Vec<LadderReport>,
}

/// Do two timings' p10–p90 intervals overlap? Then their ratio is within run-to-run noise.
pub fn overlaps(a: &Stats, b: &Stats) -> bool {
    a.p10_ms <= b.p90_ms && b.p10_ms <= a.p90_ms
}

/// A speedup as the tables show it: "1.49x", or "≈1.0x" when within noise.
pub fn speedup_text(v: Option<f64>, within_noise: bool) -> String {
    match v {
        None => "-".into(),
        Some(_) if within_noise => "≈1.0x".into(),
        Some(v) => format!("{v:.2}x"),
    }
}

/// One row of the ladder: a measured stage or one that was not measured.
#[derive(Clone, Copy, Debug)]
pub enum Row<'a> {
    Ran(&'a Record),
    Skipped(&'a Skipped),
}

impl Row<'_> {
    pub fn stage(&self) -> &str {
        match self {
            Row::Ran(r) => &r.stage,
            Row::Skipped(s) => &s.stage,
        }
    }
}

impl LadderReport {
    /// Every row, measured or not, in ladder order.
    pub fn rows(&self) -> Vec<Row<'_>> {
        let mut rows: Vec<Row> = self.records.iter().map(Row::Ran).chain(self.skipped.iter().map(Row::Skipped)).collect();
        if !self.stages.is_empty() {
            rows.sort_by_key(|r| self.stages.iter().position(|s| s == r.stage()).unwrap_or(usize::MAX));
        }
        rows
    }

    /// The human table, rows in ladder order.
    pub fn table(&self) -> String {
        table(&self.rows())
    }
}

/// Bytes as "280.0 MiB" or "3.25 GiB"; "n/a" when not measured.
pub fn fmt_bytes(b: Option<u64>) -> String {
    match b {
        None => "n/a".into(),
        Some(b) if b >= 1 << 30 => format!("{:.2} GiB", b as f64 / (1u64 << 30) as f64),
        Some(b) => format!("{:.1} MiB", b as f64 / (1u64 << 20) as f64),
    }
}

/// The human table, one line per row in the order given, under the GEMM backends that ran.
pub fn table(rows: &[Row]) -> String {
    let ran: Vec<&Record> = rows.iter().filter_map(|r| if let Row::Ran(r) = r { Some(*r) } else { None }).collect();
    // "% peak" is against the measured GEMM ceiling when every row that has one says so (CPU).
    let with_peak: Vec<_> = ran.iter().filter(|r| r.pct_of_peak.is_some()).collect();
    let measured = !with_peak.is_empty() && with_peak.iter().all(|r| r.peak_source.as_deref() == Some(MEASURED_PEAK));
    let pct_header = if measured { "% of measured GEMM" } else { "% peak" };
    #[rustfmt::skip]
    let header = ["stage", "technique", "prec", "median ms", "p10-p90 ms", "vs s0", "vs prev", "TFLOP/s", pct_header, "rel err",
        "max abs", "peak mem"];
    let rows: Vec<Vec<String>> = rows
        .iter()
        .map(|row| match row {
            Row::Ran(r) => vec![
                r.stage.clone(),
                r.technique.clone(),
                r.implementation.as_ref().map_or(r.precision.to_string(), |i| format!("{} ({i})", r.precision)),
                format!("{:.3}", r.timing.median_ms),
                format!("{:.3}-{:.3}", r.timing.p10_ms, r.timing.p90_ms),
                speedup_text(r.speedup_vs_stage0, r.noise_vs_stage0),
                speedup_text(r.speedup_vs_prev, r.noise_vs_prev),
                format!("{:.4}", r.tflops),
                r.pct_of_peak.map_or("-".into(), |v| format!("{v:.1}%")),
                r.check.as_ref().map_or("unchecked".into(), |c| format!("{:.2e}", c.rel_err)),
                r.check.as_ref().map_or("-".into(), |c| format!("{:.2e}", c.max_abs_err)),
                fmt_bytes(r.peak_mem_bytes),
            ],
            Row::Skipped(s) => {
                vec![s.stage.clone(), s.technique.clone(), format!("{}: {}", if s.failed { "FAILED" } else { "skipped" }, s.reason)]
            }
        })
        .collect();
    let mut widths: Vec<usize> = header.iter().map(|h| h.len()).collect();
    for row in &rows {
        // A skipped row's reason runs across the remaining columns; it does not widen them.
        for (w, cell) in widths.iter_mut().zip(row.iter().take(if row.len() == header.len() { header.len() } else { 2 })) {
            *w = (*w).max(cell.chars().count());
        }
    }
    let line = |cells: &[String]| -> String {
        let padded = cells.iter().enumerate().map(|(i, cell)| match widths.get(i) {
            Some(&w) if i + 1 < cells.len() || cells.len() == header.len() => format!("{cell:<w$}"),
            _ => cell.clone(),
        });
        padded.collect::<Vec<_>>().join("  ").trim_end().to_string() + "\n"
    };
    let with_simd = |r: &&Record| r.gemm_backend.as_ref().map(|b| r.simd.as_ref().map_or(b.clone(), |s| format!("{b} · SIMD {s}")));
    let mut backends: Vec<String> = ran.iter().filter_map(with_simd).collect();
    let mut seen = std::collections::HashSet::new();
    backends.retain(|b| seen.insert(b.clone()));
    let mut out = if backends.is_empty() { String::new() } else { format!("GEMM backend: {}\n", backends.join("; ")) };
    out.push_str(&line(&header.map(String::from)));
    out.push_str(&line(&widths.iter().map(|&w| "-".repeat(w)).collect::<Vec<_>>()));
    for row in &rows {
        out.push_str(&line(row));
    }
    out
}

/// Serialize `value` and write it to `path` by the output policy (exit 2 naming path and fix).
pub fn write_json<T: Serialize>(path: &Path, value: &T) -> anyhow::Result<()> {
    let mut bytes = serde_json::to_vec_pretty(value)?;
    bytes.push(b'\n');
    crate::output::write("--json", path, &bytes)?;
    Ok(())
}

/// The git commit this binary was built from ("-dirty" when its source differed), embedded by
/// shared/build.rs so it is right wherever the binary runs; "unknown" when built without git.
pub fn commit() -> String {
    env!("SPEEDKIT_COMMIT").to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The embedded commit is this checkout's HEAD (when git is here, as in CI's clone), or
    /// "unknown".
    #[test]
    fn the_commit_is_embedded_at_build_time() {
        let c = commit();
        let head = std::process::Command::new("git")
            .args(["rev-parse", "--short=12", "HEAD"])
            .current_dir(env!("CARGO_MANIFEST_DIR"))
            .output()
            .ok()
            .filter(|o| o.status.success())
            .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string());
        match head {
            Some(h) => assert!(c == h || c == format!("{h}-dirty"), "embedded {c}, HEAD {h}"),
            None => assert_eq!(c, "unknown"),
        }
    }

    #[test]
    fn noise_is_overlapping_p10_p90_intervals() {
        let st =
            |p10: f64, med: f64, p90: f64| Stats { median_ms: med, p10_ms: p10, p90_ms: p90, min_ms: p10, max_ms: p90, samples_ms: vec![] };
        assert!(overlaps(&st(10.0, 11.0, 12.0), &st(11.5, 13.0, 14.0)));
        assert!(!overlaps(&st(10.0, 11.0, 12.0), &st(12.5, 13.0, 14.0)));
        assert_eq!(speedup_text(Some(1.18), true), "≈1.0x");
        assert_eq!(speedup_text(Some(1.18), false), "1.18x");
        assert_eq!(speedup_text(None, false), "-");
    }

    #[test]
    fn json_write_to_a_directory_is_usage_error_naming_the_path() {
        let e = write_json(&std::env::temp_dir(), &1).unwrap_err();
        let (code, msg) = crate::error::classify(&e);
        assert_eq!(code, crate::error::EXIT_USAGE);
        assert!(msg.contains("is a directory") && msg.contains("Fix:"), "{msg}");
    }
}
