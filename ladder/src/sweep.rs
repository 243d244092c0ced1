//! `ladder --sweep seq=512,1024,2048`: the ladder once per value of one dimension, so a reader
//! sees where each technique starts to pay (fused attention as T grows, precision as GEMMs grow).

use shared::cli::RunArgs;
use shared::report::{Skipped, SweepReport, SWEEP_SCHEMA};
use shared::SpeedkitError;

/// The dimension a sweep varies: T, B, or C (FF = 4·C and d_head kept unless --ff / --heads given), in `AXES` order.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Axis {
    Seq,
    Batch,
    DModel,
}

impl Axis {
    /// As the JSON stores it.
    pub fn name(self) -> &'static str {
        crate::render::AXES[self as usize].0
    }

    /// The flag that sets this dimension.
    fn flag(self, a: &mut RunArgs) -> &mut Option<usize> {
        match self {
            Axis::Seq => &mut a.seq,
            Axis::Batch => &mut a.batch,
            Axis::DModel => &mut a.d_model,
        }
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Sweep {
    pub axis: Axis,
    pub values: Vec<usize>,
}

impl std::str::FromStr for Sweep {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        let usage = || format!("'{s}' is not a sweep; write AXIS=V1,V2,... with AXIS seq, batch or d_model, e.g. seq=512,1024,2048");
        let (axis, values) = s.split_once('=').ok_or_else(usage)?;
        let axis = match axis.trim().to_ascii_lowercase().replace('-', "_").as_str() {
            "seq" | "t" => Axis::Seq,
            "batch" | "b" => Axis::Batch,
            "d_model" | "c" => Axis::DModel,
            _ => return Err(usage()),
        };
        let values = values.split(',').map(|v| v.trim().parse::<usize>()).collect::<Result<Vec<_>, _>>().map_err(|_| usage())?;
        Ok(Sweep { axis, values })
    }
}

/// Most values one sweep takes: each is a whole ladder run.
pub const MAX_VALUES: usize = 64;

/// Refuse, before any run, too many values, flags that fix the swept dimension or write one file.
pub fn check_values(args: &RunArgs, sweep: &Sweep) -> Result<(), SpeedkitError> {
    let (n, axis, name) = (sweep.values.len(), sweep.axis, sweep.axis.name());
    let flag = format!("--{}", name.replace('_', "-"));
    let saves = [("--save-output", &args.save_output), ("--save-weights", &args.save_weights)].into_iter().find(|f| f.1.is_some());
    let why = if n > MAX_VALUES {
        format!("--sweep has {n} values; each is a whole ladder run. Fix: sweep at most {MAX_VALUES} values.")
    } else if axis.flag(&mut args.clone()).is_some() {
        format!("{flag} and --sweep {name}=... both set the same dimension. Fix: drop {flag}; the sweep sets it for each run.")
    } else if args.input.is_some() && axis != Axis::DModel {
        format!("--input fixes B and T from its file, so it cannot be swept over {name}. Fix: drop --input, or sweep d_model.")
    } else if (args.weights.is_some() || args.input.is_some()) && axis == Axis::DModel {
        "--weights and --input fix C from their files, so a sweep cannot vary d_model. Fix: drop them, or sweep seq or batch.".into()
    } else if let Some((f, _)) = saves {
        format!("{f} writes one file per run, and a sweep's runs would overwrite each other. Fix: drop {f}, or run the one shape you want without --sweep.")
    } else {
        return Ok(());
    };
    Err(SpeedkitError::usage(why))
}

/// The flags for one value, or why that value cannot run (it becomes skipped rows).
fn args_for(args: &RunArgs, axis: Axis, value: usize, d_head: usize) -> Result<RunArgs, SpeedkitError> {
    let mut a = args.clone();
    a.json = None;
    *axis.flag(&mut a) = Some(value);
    if axis != Axis::DModel {
        return Ok(a);
    }
    let ff = value.checked_mul(4).ok_or_else(|| {
        SpeedkitError::usage(format!("C = {value} is too large: FF = 4·C overflows. Fix: sweep d_model values below 2^31."))
    })?;
    a.ff = args.ff.or(Some(ff));
    if args.heads.is_none() {
        if value == 0 || !value.is_multiple_of(d_head) {
            return Err(SpeedkitError::usage(format!(
                "C = {value} is not a positive multiple of d_head = {d_head}, which the sweep keeps fixed (n_head = C / d_head). \
                 Fix: sweep multiples of {d_head}, or pass --heads to fix n_head instead."
            )));
        }
        a.heads = Some(value / d_head);
    }
    Ok(a)
}

/// The ladder once per value (one that cannot run here is skipped rows), and the first failure. A sticky
/// CUDA fault ends the sweep at its value: no later work on the device can run in this process.
pub fn run(
    args: &RunArgs,
    stages: &[Box<dyn shared::Stage>],
    sweep: &Sweep,
    which: &[usize],
    argv: &[String],
    measure: crate::Measure,
) -> anyhow::Result<(SweepReport, Option<anyhow::Error>)> {
    let base = shared::runner::resolve(args)?;
    let (mut runs, mut failure) = (Vec::new(), None);
    for &value in &sweep.values {
        let label = crate::render::axis_label(sweep.axis.name(), value);
        println!("\n=== sweep {label}");
        let mut shape = base.shape;
        match sweep.axis {
            Axis::Seq => shape.seq = value,
            Axis::Batch => shape.batch = value,
            Axis::DModel => {
                shape.d_model = value;
                shape.ff = args.ff.unwrap_or(value.saturating_mul(4));
                shape.n_head = args.heads.unwrap_or(if base.shape.d_head() > 0 { value / base.shape.d_head() } else { 0 });
            }
        }
        let outcome = args_for(args, sweep.axis, value, base.shape.d_head())
            .map_err(anyhow::Error::from)
            .and_then(|a| crate::run(a, stages, which, measure));
        let mut sticky = false;
        let mut report = match outcome {
            Ok((report, f)) => {
                sticky = f.as_ref().is_some_and(shared::error::is_sticky_cuda_fault);
                failure = if sticky { f } else { failure.or(f) };
                report
            }
            Err(e) => {
                let Some(SpeedkitError::Usage(reason)) = e.downcast_ref::<SpeedkitError>() else { return Err(e) };
                let reason = format!("{label}: {}", shared::error::strip_backtrace(reason));
                println!("skipped   {reason}");
                let mut report = crate::new_report(&base.info, shape, which.iter().map(|&i| stages[i].name().to_string()).collect());
                let skip = |s: &dyn shared::Stage| Skipped {
                    stage: s.name().into(),
                    technique: s.technique().into(),
                    reason: reason.clone(),
                    failed: false,
                };
                report.skipped = which.iter().map(|&i| skip(stages[i].as_ref())).collect();
                report
            }
        };
        report.args = argv.to_vec();
        runs.push(report);
        if sticky {
            println!("stopped   the sweep at {label}: a sticky CUDA fault leaves the device unusable in this process");
            break;
        }
    }
    let values = sweep.values[..runs.len()].to_vec();
    let report = SweepReport { schema: SWEEP_SCHEMA.into(), axis: sweep.axis.name().into(), values, runs };
    Ok((report, failure))
}

#[cfg(test)]
#[path = "../tests/unit/sweep.rs"]
mod tests;
