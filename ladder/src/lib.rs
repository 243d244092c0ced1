//! The ladder: every stage in one process, on the same device, weights and input, checked
//! against the same fp32 reference and timed the same way, in one table.
//!
//! Run it: `cargo run --release -p ladder` (CPU) ·
//! `cargo run --release --features cuda -p ladder -- --device cuda` (GPU).

use clap::{Args, FromArgMatches};
use shared::cli::{exit_with, RunArgs};
use shared::device::GemmSwitches;
use shared::report::{table, write_json, LadderReport, Record, Skipped, CANDLE_VERSION, LADDER_SCHEMA};
use shared::runner::Session;
use shared::weights::save_tensors;
use shared::{PrecisionRequest, SpeedkitError, StageSpec};
use std::process::ExitCode;

/// The stages, in order. The first is the baseline: speedups are against it, and it always
/// runs at fp32 (`--precision` applies to the stages after it).
pub fn stages() -> Vec<StageSpec> {
    vec![
        StageSpec::of::<stage0_baseline::Block>(),
        StageSpec::of::<stage1_tensorcore::Block>(),
        StageSpec::of::<stage2_sdpa::Block>(),
        StageSpec::of::<stage3_fused::Block>(),
    ]
}

/// The fp32 block every stage is checked against.
pub fn reference() -> StageSpec {
    StageSpec::of::<stage0_baseline::Block>()
}

/// Run every stage; a stage that cannot run here becomes a "skipped: why" row, one that fails
/// its check a "FAILED" row (and the run's error, after the table is printed).
pub fn run(args: RunArgs) -> anyhow::Result<(LadderReport, Option<anyhow::Error>)> {
    let session = Session::open(args, &reference())?;
    let mut records: Vec<Record> = Vec::new();
    let mut skipped = Vec::new();
    let mut failure = None;
    let mut outputs: Vec<(String, candle_core::Tensor)> = Vec::new();
    let mut baseline_ms = None; // stage 0's median, if it ran
    for (i, spec) in stages().iter().enumerate() {
        let requested = if i == 0 { PrecisionRequest::Auto } else { session.args.precision };
        match session.run(spec, requested) {
            Ok((mut record, y)) => {
                println!("ran       {} at {}: {}", spec.name, record.precision, record.precision_reason);
                if session.args.save_output.is_some() {
                    outputs.push((format!("y_{}", spec.name), y));
                }
                if i == 0 {
                    baseline_ms = Some(record.timing.median_ms);
                }
                record.speedup_vs_stage0 = baseline_ms.map(|b| b / record.timing.median_ms);
                record.speedup_vs_prev = records.last().map(|p| p.timing.median_ms / record.timing.median_ms);
                records.push(record);
            }
            Err(e) => {
                let (reason, failed) = match e.downcast_ref::<SpeedkitError>() {
                    Some(SpeedkitError::Usage(m)) => (m.clone(), false),
                    Some(SpeedkitError::CheckFailed(m)) => (m.clone(), true),
                    None => return Err(e),
                };
                println!("{}    {}: {reason}", if failed { "FAILED" } else { "skipped" }, spec.name);
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

/// `ladder report`: the device, candle's global switches now, and for every stage the
/// precision, switches and notes it would run with, and why — without running anything.
pub fn report(args: &RunArgs) -> anyhow::Result<String> {
    use std::fmt::Write;
    let shared::runner::Resolved { device, info, shape, .. } = shared::runner::resolve(args)?;
    let mut out = String::new();
    writeln!(out, "device    {}", info.describe())?;
    writeln!(
        out,
        "build     cuda feature {} · candle {CANDLE_VERSION} · commit {}",
        if cfg!(feature = "cuda") { "on" } else { "off (CPU only; build with --features cuda for the GPU)" },
        shared::report::commit()
    )?;
    writeln!(out, "switches  now: {} (process-wide; every stage's build sets all three)", switches_text(GemmSwitches::current()))?;
    writeln!(out, "shape     {shape}")?;
    writeln!(out, "\nwhat each stage would run (--precision {}):", precision_text(args.precision))?;
    for (i, spec) in stages().iter().enumerate() {
        let requested = if i == 0 { PrecisionRequest::Auto } else { args.precision };
        match spec.plan(&device, &info, shape, requested) {
            Ok(plan) => {
                writeln!(out, "  {:<18} {:<5} {}", spec.name, plan.precision.name(), plan.precision_reason)?;
                writeln!(out, "  {:<18} {:<5} applies: {}", "", "", switches_text((spec.switches)(&plan)))?;
                if let Err(e) = (spec.check_shape)(&shape) {
                    writeln!(out, "  {:<18} {:<5} cannot run this shape: {e}", "", "")?;
                }
                for note in (spec.notes)(&plan) {
                    writeln!(out, "  {:<18} {:<5} note: {note}", "", "")?;
                }
            }
            Err(e) => writeln!(out, "  {:<18} skipped: {e}", spec.name)?,
        }
    }
    Ok(out)
}

fn switches_text(s: GemmSwitches) -> String {
    let on = |b: bool| if b { "on" } else { "off" };
    format!("TF32 {} · reduced-precision f16 {} · bf16 {}", on(s.tf32), on(s.reduced_f16), on(s.reduced_bf16))
}

fn precision_text(p: PrecisionRequest) -> String {
    match p {
        PrecisionRequest::Auto => "auto".into(),
        PrecisionRequest::Exactly(p) => p.name().into(),
    }
}

pub fn main() -> ExitCode {
    let about = "Every stage of the transformer block side by side: same weights, same input, checked, timed";
    let cmd = RunArgs::augment_args(clap::Command::new("ladder").about(about)).subcommand(RunArgs::augment_args(
        clap::Command::new("report").about("Print the device, candle's global switches, and what every stage would run and why"),
    ));
    let matches = cmd.get_matches();
    exit_with(|| {
        if let Some(sub) = matches.subcommand_matches("report") {
            let args = RunArgs::from_arg_matches(sub)?;
            print!("{}", report(&args)?);
            return Ok(());
        }
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
