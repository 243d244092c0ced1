//! What a run reports: one record per stage (versioned JSON), and the human table. Fields added
//! after v1 are `Option` or `#[serde(default)]`, so older files still load.

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

/// Bumped when a field changes meaning or disappears, not when one is added. v2: `mode` (a training
/// step's `timing` and `flops_per_forward` are forward + backward's); every v1 record is a forward.
pub const RECORD_SCHEMA: &str = "candle-speedkit/record/v2";
pub const LADDER_SCHEMA: &str = "candle-speedkit/ladder/v2";
pub const SWEEP_SCHEMA: &str = "candle-speedkit/sweep/v2";
pub const LADDER_SCHEMA_V1: &str = "candle-speedkit/ladder/v1";
pub const SWEEP_SCHEMA_V1: &str = "candle-speedkit/sweep/v1";

/// What a record timed: a forward, or (`--train`) forward + backward, the update apart in `Record::train`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Mode {
    #[default]
    Forward,
    Train,
}

impl Mode {
    /// What one timing covers, for titles and axes: "forward" or "training step".
    pub fn per(self) -> &'static str {
        match self {
            Mode::Forward => "forward",
            Mode::Train => "training step",
        }
    }
}

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Record {
    pub schema: String,
    pub stage: String,
    pub technique: String,
    pub precision: Precision,
    pub precision_reason: String,
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
    /// "datasheet", "--peak-tflops" or `MEASURED_PEAK`.
    pub peak_source: Option<String>,
    /// `gemm_backend`, `simd` and `ceiling` are `None` on a GPU.
    pub gemm_backend: Option<String>,
    pub simd: Option<String>,
    pub ceiling: Option<CpuCeiling>,
    pub check: Option<CheckResult>,
    #[serde(default)]
    pub extra_checks: Vec<NamedCheck>,
    pub peak_mem_bytes: Option<u64>,
    pub mem_method: String,
    pub speedup_vs_stage0: Option<f64>,
    pub speedup_vs_prev: Option<f64>,
    pub notes: Vec<String>,
    /// The p10–p90 intervals overlap: shown as "≈1.0x" (`speedup_vs_*` keeps the ratio).
    #[serde(default)]
    pub noise_vs_stage0: bool,
    #[serde(default)]
    pub noise_vs_prev: bool,
    pub breakdown: Option<Breakdown>,
    /// `ladder --ablate`: what this row changed, e.g. "without ln".
    pub variant: Option<String>,
    /// `ladder --reference`: the fastest reference row's median over this row's.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub vs_reference: Option<f64>,
    #[serde(default)]
    pub mode: Mode,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub train: Option<crate::train::TrainRecord>,
}

/// A stage the ladder did not measure: it cannot run here, or (`failed`) it failed its check.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Skipped {
    pub stage: String,
    pub technique: String,
    pub reason: String,
    pub failed: bool,
}

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct LadderReport {
    pub schema: String,
    pub device: DeviceInfo,
    pub shape: Shape,
    pub commit: String,
    /// candle-core as locked at build time, e.g. "0.11.1" (older files: "0.11").
    pub candle_version: String,
    pub cuda_build: bool,
    pub unix_time: u64,
    pub records: Vec<Record>,
    pub skipped: Vec<Skipped>,
    /// The stages asked for, in ladder order (older files: empty).
    #[serde(default)]
    pub stages: Vec<String>,
    /// The command line after the program name.
    #[serde(default)]
    pub args: Vec<String>,
    #[serde(default)]
    pub versions: BTreeMap<String, String>,
    /// cuDriverGetVersion, e.g. "13.0"; the kernel driver (/proc/driver/nvidia/version), e.g. "580.65.06".
    pub cuda_driver_version: Option<String>,
    pub nvidia_driver: Option<String>,
    pub ceiling: Option<CpuCeiling>,
    /// `--ablate`: each variant, measured in the same rounds as the rows, and those that did not run.
    #[serde(default)]
    pub ablation: Vec<Ablation>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub ablation_out: Vec<AblationOut>,
    pub ceilings: Option<Ceilings>,
    /// Interleaved rounds the timed iterations were split into (older files: 1).
    pub rounds: Option<usize>,
    /// `--reference`: the `reference` crate's blocks, timed in the same rounds; and those that did not run.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub references: Vec<Record>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub references_out: Vec<Skipped>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Ablation {
    /// e.g. "stage3_fused".
    pub against: String,
    /// e.g. "without qkv" or "head split/merge copies kept".
    pub change: String,
    pub record: Record,
    /// Variant median over the stage's: what the undone technique buys (>1: it helps).
    pub buys: Option<f64>,
    #[serde(default)]
    pub buys_within_noise: bool,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct AblationOut {
    pub against: String,
    pub change: String,
    pub reason: String,
    pub failed: bool,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Ceilings {
    /// TFLOP/s per precision name ("fp32", "bf16", ...).
    pub tflops: BTreeMap<String, f64>,
    pub bandwidth_gbs: Option<f64>,
    /// e.g. "datasheet (NVIDIA H100 80GB HBM3)", "measured".
    pub source: String,
}

/// `ladder --sweep`: one ladder run per value of `axis` ("seq", "batch" or "d_model").
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct SweepReport {
    pub schema: String,
    pub axis: String,
    pub values: Vec<usize>,
    pub runs: Vec<LadderReport>,
}

/// Do two timings' p10–p90 intervals overlap? Then their ratio is within run-to-run noise.
pub fn overlaps(a: &Stats, b: &Stats) -> bool {
    a.p10_ms <= b.p90_ms && b.p10_ms <= a.p90_ms
}

/// "1.49x", or "≈1.0x" when within noise (the JSON keeps the ratio); "–" for none.
pub fn speedup_text(v: Option<f64>, within_noise: bool) -> String {
    match v {
        None => "–".into(),
        Some(_) if within_noise => "≈1.0x".into(),
        Some(v) => format!("{v:.2}x"),
    }
}

/// Milliseconds to about three significant digits: "452", "21.3", "1.23", "0.052".
pub fn fmt_ms(ms: f64) -> String {
    match ms {
        m if m >= 100.0 => format!("{m:.0}"),
        m if m >= 10.0 => format!("{m:.1}"),
        m if m >= 1.0 => format!("{m:.2}"),
        m => format!("{m:.3}"),
    }
}

/// "452 (429–465)": median and p10–p90.
pub fn fmt_timing(t: &Stats) -> String {
    format!("{} ({}–{})", fmt_ms(t.median_ms), fmt_ms(t.p10_ms), fmt_ms(t.p90_ms))
}

/// Relative error against the fp32 reference, or "unchecked" (--no-check).
pub fn fmt_rel_err(r: &Record) -> String {
    match &r.check {
        None => "unchecked".into(),
        Some(c) if c.rel_err == 0.0 => "0".into(),
        Some(c) => format!("{:.1e}", c.rel_err),
    }
}

/// "skipped: why" or "FAILED: why", on one line.
pub fn not_measured(failed: bool, reason: &str) -> String {
    format!("{}: {}", if failed { "FAILED" } else { "skipped" }, reason.split_whitespace().collect::<Vec<_>>().join(" "))
}

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
    /// What every record (rows, reference rows, ablation rows) timed; forward when there is none
    /// (a run whose every stage was skipped: its arguments say `--train` if it was one); `None`
    /// when they differ, which no run writes (the renderers refuse such a file).
    pub fn mode(&self) -> Option<Mode> {
        let all = self.records.iter().chain(&self.references).chain(self.ablation.iter().map(|a| &a.record));
        let mut modes = all.map(|r| r.mode);
        let asked = if self.args.iter().any(|a| a == "--train") { Mode::Train } else { Mode::Forward };
        let first = modes.next().unwrap_or(asked);
        modes.all(|m| m == first).then_some(first)
    }

    /// Every row in ladder order.
    pub fn rows(&self) -> Vec<Row<'_>> {
        let mut rows: Vec<Row> = self.records.iter().map(Row::Ran).chain(self.skipped.iter().map(Row::Skipped)).collect();
        if !self.stages.is_empty() {
            rows.sort_by_key(|r| self.stages.iter().position(|s| s == r.stage()).unwrap_or(usize::MAX));
        }
        rows
    }

    /// The stages' rows, then the reference rows: GitHub markdown, or the terminal's columns
    /// under the GEMM backends that ran.
    pub fn table(&self, markdown: bool) -> String {
        let mut rows = self.rows();
        rows.extend(self.references.iter().map(Row::Ran).chain(self.references_out.iter().map(Row::Skipped)));
        let backends = if markdown { String::new() } else { gemm_backends(&rows) };
        backends + &table(grid(&rows, &self.references, self.device.is_cuda()), markdown)
    }
}

/// "280.0 MiB" or "3.25 GiB"; "n/a" when not measured.
pub fn fmt_bytes(b: Option<u64>) -> String {
    match b {
        None => "n/a".into(),
        Some(b) if b >= 1 << 30 => format!("{:.2} GiB", b as f64 / (1u64 << 30) as f64),
        Some(b) => format!("{:.1} MiB", b as f64 / (1u64 << 20) as f64),
    }
}

/// A table: its header, then its rows. A row shorter than the header (why a row did not run)
/// runs across the rest in the terminal, and is filled with "–" in markdown.
pub type Grid = (Vec<String>, Vec<Vec<String>>);

/// The ladder's grid (a stage binary's is one row); `references` are the reference rows among
/// `rows`, each stage's "vs best reference" against the fastest of them. GFLOP/s on a CPU (a
/// few hundred at most), TFLOP/s on a GPU.
pub fn grid(rows: &[Row], references: &[Record], cuda: bool) -> Grid {
    let (unit, scale) = if cuda { ("TFLOP/s", 1.0) } else { ("GFLOP/s", 1e3) };
    let mut header: Vec<String> =
        ["stage", "precision", "median ms (p10–p90)", "vs stage 0", "vs previous", unit, "% of peak", "rel. error", "peak mem"]
            .map(String::from)
            .to_vec();
    let with_ref = !references.is_empty();
    if with_ref {
        header.push("vs best reference".into());
    }
    // The header follows what the rows timed (`mode`), whether or not they carry a `train` record.
    let with_train = rows.iter().any(|r| matches!(r, Row::Ran(r) if r.mode == Mode::Train));
    if with_train {
        header[2] = "forward + backward ms (p10–p90)".into();
        header.extend(["optimizer ms".into(), "worst grad error".into()]);
    }
    let rows = rows
        .iter()
        .map(|row| match row {
            Row::Ran(r) => [
                if references.iter().any(|x| std::ptr::eq(x, *r)) { format!("reference: {}", r.stage) } else { r.stage.clone() },
                format!("{}{}", r.precision, r.implementation.as_ref().map(|i| format!(" ({i})")).unwrap_or_default()),
                fmt_timing(&r.timing),
                speedup_text(r.speedup_vs_stage0, r.noise_vs_stage0),
                speedup_text(r.speedup_vs_prev, r.noise_vs_prev),
                format!("{:.1}", r.tflops * scale),
                r.pct_of_peak.map_or("–".into(), |p| format!("{p:.1}%")),
                fmt_rel_err(r),
                fmt_bytes(r.peak_mem_bytes),
            ]
            .into_iter()
            .chain(with_ref.then(|| speedup_text(r.vs_reference, false)))
            .chain(match (&r.train, with_train) {
                (_, false) => vec![],
                (None, true) => vec!["–".into(), "–".into()],
                (Some(t), true) => {
                    let grad = t.grad_check.as_ref().map_or("-".into(), |c| format!("{:.1e}", c.max_norm_ratio));
                    vec![format!("{:.3}", t.optimizer_timing.median_ms), grad]
                }
            })
            .collect(),
            Row::Skipped(s) => vec![s.stage.clone(), not_measured(s.failed, &s.reason)],
        })
        .collect();
    (header, rows)
}

/// "GEMM backend: ...\n" for the backends (and SIMD levels) the rows ran on; empty when none says.
pub fn gemm_backends(rows: &[Row]) -> String {
    let with_simd = |r: &Record| r.gemm_backend.as_ref().map(|b| r.simd.as_ref().map_or(b.clone(), |s| format!("{b} · SIMD {s}")));
    let mut all: Vec<String> = rows.iter().filter_map(|r| if let Row::Ran(r) = r { with_simd(r) } else { None }).collect();
    let mut seen = std::collections::HashSet::new();
    all.retain(|b| seen.insert(b.clone()));
    if all.is_empty() {
        String::new()
    } else {
        format!("GEMM backend: {}\n", all.join("; "))
    }
}

/// `grid` as GitHub markdown, or for the terminal as columns padded to their widest cell,
/// trailing padding trimmed.
pub fn table((header, rows): Grid, markdown: bool) -> String {
    if markdown {
        let row = |cells: &[String]| {
            let cells = cells.iter().map(|c| c.replace('|', "\\|").replace('\n', " ")).chain(std::iter::repeat("–".to_string()));
            format!("| {} |\n", cells.take(header.len()).collect::<Vec<_>>().join(" | "))
        };
        let rule = format!("|{}\n", "---|".repeat(header.len()));
        return std::iter::once(row(&header)).chain([rule]).chain(rows.iter().map(|r| row(r))).collect();
    }
    let mut widths: Vec<usize> = header.iter().map(|h| h.chars().count()).collect();
    for row in &rows {
        let cells = if row.len() == header.len() { &row[..] } else { &row[..row.len().saturating_sub(1)] };
        widths.iter_mut().zip(cells).for_each(|(w, cell)| *w = (*w).max(cell.chars().count()));
    }
    let line = |cells: &[String]| {
        cells.iter().zip(&widths).map(|(c, &w)| format!("{c:<w$}")).collect::<Vec<_>>().join("  ").trim_end().to_string() + "\n"
    };
    let rule: Vec<String> = widths.iter().map(|&w| "-".repeat(w)).collect();
    [&header[..], &rule[..]].into_iter().chain(rows.iter().map(|r| &r[..])).map(line).collect()
}

/// `value` as JSON to `path`, by the output policy.
pub fn write_json<T: Serialize>(path: &Path, value: &T) -> anyhow::Result<()> {
    let mut bytes = serde_json::to_vec_pretty(value)?;
    bytes.push(b'\n');
    Ok(crate::output::write("--json", path, &bytes)?)
}

/// The git commit this binary was built from ("-dirty", "unknown"), embedded by shared/build.rs.
pub fn commit() -> String {
    env!("SPEEDKIT_COMMIT").to_string()
}

#[cfg(test)]
#[path = "../tests/unit/report.rs"]
mod tests;
