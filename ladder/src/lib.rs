//! The ladder: every stage in one process, on the same device, weights and input, checked
//! against the same fp32 reference and timed the same way, in one table.
//!
//! Run it: `cargo run --release -p ladder` (CPU) ·
//! `cargo run --release --features cuda -p ladder -- --device cuda` (GPU).

use clap::{Args, FromArgMatches};
use shared::cli::{exit_with, RunArgs};
use shared::report::{table, write_json, LadderReport, Record, Skipped, CANDLE_VERSION, LADDER_SCHEMA};
use shared::runner::Session;
use shared::weights::save_tensors;
use shared::{PrecisionRequest, SpeedkitError, StageSpec};
use std::process::ExitCode;

/// The stages, in order. The first is the baseline: speedups are against it, and it always
/// runs at fp32 (`--precision` applies to the stages after it).
pub fn stages() -> Vec<StageSpec> {
    vec![StageSpec::of::<stage0_baseline::Baseline>()]
}

/// The fp32 block every stage is checked against.
pub fn reference() -> StageSpec {
    StageSpec::of::<stage0_baseline::Baseline>()
}

/// Run every stage; a stage that cannot run here becomes a "skipped: why" row, one that fails
/// its check a "FAILED" row (and the run's error, after the table is printed).
pub fn run(args: RunArgs) -> anyhow::Result<(LadderReport, Option<anyhow::Error>)> {
    let session = Session::open(args, &reference())?;
    let mut records: Vec<Record> = Vec::new();
    let mut skipped = Vec::new();
    let mut failure = None;
    let mut outputs: Vec<(String, candle_core::Tensor)> = Vec::new();
    for (i, spec) in stages().iter().enumerate() {
        let requested = if i == 0 { PrecisionRequest::Auto } else { session.args.precision };
        match session.run(spec, requested) {
            Ok((mut record, y)) => {
                if session.args.save_output.is_some() {
                    outputs.push((format!("y_{}", spec.name), y));
                }
                record.speedup_vs_stage0 =
                    records.first().filter(|r| r.stage == stages()[0].name).map(|r0| r0.timing.median_ms / record.timing.median_ms);
                if i == 0 {
                    record.speedup_vs_stage0 = Some(1.0);
                }
                record.speedup_vs_prev = records.last().map(|p| p.timing.median_ms / record.timing.median_ms);
                records.push(record);
            }
            Err(e) => {
                let (reason, failed) = match e.downcast_ref::<SpeedkitError>() {
                    Some(SpeedkitError::Usage(m)) => (m.clone(), false),
                    Some(SpeedkitError::CheckFailed(m)) => (m.clone(), true),
                    None => return Err(e),
                };
                skipped.push(Skipped { stage: spec.name.into(), technique: spec.technique.into(), reason, failed });
                if failed && failure.is_none() {
                    failure = Some(e);
                }
            }
        }
    }
    let report = LadderReport {
        schema: LADDER_SCHEMA.into(),
        device: session.info.clone(),
        shape: session.shape,
        commit: shared::report::commit(),
        candle_version: CANDLE_VERSION.into(),
        cuda_build: cfg!(feature = "cuda"),
        unix_time: std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0),
        records,
        skipped,
    };
    if let Some(path) = &session.args.json {
        write_json(path, &report)?;
    }
    if let Some(path) = &session.args.save_output {
        // x, then each stage's output as y_<stage>, for comparison outside the program.
        let mut named: Vec<(&str, &candle_core::Tensor)> = vec![("x", &session.x)];
        named.extend(outputs.iter().map(|(n, t)| (n.as_str(), t)));
        save_tensors(path, &named)?;
    }
    Ok((report, failure))
}

pub fn main() -> ExitCode {
    let cmd = RunArgs::augment_args(
        clap::Command::new("ladder").about("Every stage of the transformer block side by side: same weights, same input, checked, timed"),
    );
    let matches = cmd.get_matches();
    exit_with(|| {
        let args = RunArgs::from_arg_matches(&matches)?;
        let json = args.json.clone();
        let (report, failure) = run(args)?;
        println!();
        print!("{}", table(&report.records, &report.skipped));
        if let Some(path) = json {
            println!("\nsaved     JSON records to {}", path.display());
        }
        match failure {
            Some(e) => Err(e),
            None => Ok(()),
        }
    })
}
