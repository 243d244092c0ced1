//! The ladder: every stage in one process on the same device, weights and input, checked against one fp32
//! reference and timed alike, in one table (or markdown, an SVG chart, the README's region, a sweep).
//!
//! Run it: `cargo run --release -p ladder` (CPU) · `cargo run --release --features cuda -p ladder -- --device cuda` (GPU).

pub mod chart;
pub mod provenance;
pub mod render;
pub mod roofline;
pub mod selftest;
pub mod sweep;

use candle_core::Device;
use clap::{Args, FromArgMatches};
use shared::cli::{exit_with, RunArgs};
use shared::device::{DeviceInfo, GemmSwitches};
use shared::report::{
    commit, write_json, Ablation, AblationOut, LadderReport, Mode, Record, Skipped, SweepReport, LADDER_SCHEMA, LADDER_SCHEMA_V1,
    RECORD_SCHEMA, SWEEP_SCHEMA, SWEEP_SCHEMA_V1,
};
use shared::runner::Session;
use shared::stage::{ladder_request, plan, Plan};
use shared::timing::Stats;
use shared::weights::save_tensors;
use shared::{PrecisionRequest, Shape, SpeedkitError, Stage, StageEntry};
use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use sweep::Sweep;

/// The stages, in order (a new stage is one crate and one line here). The first is the baseline: speedups are
/// against it, every stage is checked against its fp32 output, and it always runs at fp32 (`ladder_request`).
pub const STAGES: [StageEntry; 5] =
    [stage0_baseline::STAGE, stage1_tensorcore::STAGE, stage2_sdpa::STAGE, stage3_fused::STAGE, stage4_fp8::STAGE];

pub fn with_stage_args(cmd: clap::Command) -> clap::Command {
    STAGES.iter().fold(cmd, |c, e| (e.args)(c))
}

/// Every stage, configured by flags parsed by a command `with_stage_args` made.
pub fn stages_from(m: &clap::ArgMatches) -> Result<Vec<Box<dyn Stage>>, clap::Error> {
    STAGES.iter().map(|e| (e.make)(m)).collect()
}

/// Every stage with its flags' defaults (`ladder selftest`, the traffic model of a recorded run).
pub fn default_stages() -> Vec<Box<dyn Stage>> {
    let m = with_stage_args(clap::Command::new("defaults")).try_get_matches_from(["defaults"]).unwrap_or_default();
    stages_from(&m).unwrap_or_else(|e| panic!("every stage flag has a default: {e}"))
}

/// `--stages 0,2,4` as indices into `STAGES`, in ladder order whatever the order given; all when `None`.
pub fn select(requested: Option<&[usize]>) -> Result<Vec<usize>, SpeedkitError> {
    let all = default_stages();
    let every: Vec<usize> = (0..all.len()).collect();
    let requested = requested.unwrap_or(&every);
    let bad = requested.iter().find(|&&i| i >= all.len()).map(|b| format!("names stage {b}, but the ladder has {} stages", all.len()));
    if let Some(bad) = bad.or(requested.is_empty().then(|| "is empty".into())) {
        let valid = all.iter().enumerate().map(|(i, s)| format!("{i} {}", s.name())).collect::<Vec<_>>().join(", ");
        return Err(SpeedkitError::usage(format!("--stages {bad}. Fix: list stage numbers among {valid}, e.g. --stages 0,2.")));
    }
    let mut which = requested.to_vec();
    which.sort_unstable();
    which.dedup();
    Ok(which)
}

/// `stage`'s plan in a ladder run with `args`: asked for `ladder_request`.
fn ladder_plan(stage: &dyn Stage, device: &Device, info: &DeviceInfo, shape: Shape, args: &RunArgs) -> Result<Plan, SpeedkitError> {
    plan(stage, device, info, shape, ladder_request(stage, args.precision), args.precision, args.cuda_graph, args.train)
}

/// A ladder report with no rows yet: where, what, when, and which stages were asked for.
pub fn new_report(info: &DeviceInfo, shape: Shape, names: Vec<String>) -> LadderReport {
    let versions = provenance::versions();
    LadderReport {
        schema: LADDER_SCHEMA.into(),
        device: info.clone(),
        shape,
        commit: commit(),
        candle_version: versions["candle-core"].clone(),
        cuda_build: cfg!(feature = "cuda"),
        unix_time: std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0),
        stages: names,
        versions,
        cuda_driver_version: provenance::cuda_driver_version(info),
        nvidia_driver: provenance::nvidia_driver(info),
        ..Default::default()
    }
}

/// How the ladder measures: `--rounds`, `--ablate` (`Stage::ablations`), `--reference`.
#[derive(Clone, Copy, Debug)]
pub struct Measure {
    /// Each round runs every row once with its share of `--iters`, order rotated, so drift is spread over every row.
    pub rounds: usize,
    pub ablate: bool,
    pub reference: bool,
}

/// One thing the rounds time: a stage as written, an ablation variant (`change`), or a reference row.
#[derive(Default)]
struct Entry {
    stage: usize,
    variant: Option<Box<dyn Stage>>,
    change: Option<String>,
    reference: bool,
    records: Vec<Record>,
    y: Option<candle_core::Tensor>,
    out: bool, // skipped or failed: not run again
}

impl Entry {
    /// The stage this entry stands for: its reference's own, or the ladder's stage (a variant's too).
    fn spec<'a>(&'a self, all: &'a [Box<dyn Stage>]) -> &'a dyn Stage {
        if self.reference {
            self.variant.as_deref().expect("a reference entry holds its stage")
        } else {
            all[self.stage].as_ref()
        }
    }

    fn label(&self, spec: &dyn Stage) -> String {
        self.change.as_ref().map_or(spec.name().to_string(), |c| format!("{} ({c})", spec.name()))
    }
}

/// `e` as a skipped or FAILED row of its kind (stage, ablation variant, reference).
fn leave(report: &mut LadderReport, e: &Entry, spec: &dyn Stage, reason: String, failed: bool) {
    println!("{}    {}: {reason}", if failed { "FAILED" } else { "skipped" }, e.label(spec));
    let skipped = Skipped { stage: spec.name().into(), technique: spec.technique().into(), reason, failed };
    match &e.change {
        None if e.reference => report.references_out.push(skipped),
        None => report.skipped.push(skipped),
        Some(c) => report.ablation_out.push(AblationOut { against: skipped.stage, change: c.clone(), reason: skipped.reason, failed }),
    }
}

/// One stage's rounds as one record (samples pooled, rates recomputed, largest peak memory); `None` if it left.
fn merge_rounds(records: Vec<Record>) -> Option<Record> {
    let mut records = records.into_iter();
    let mut first = records.next()?;
    let mut samples = std::mem::take(&mut first.timing.samples_ms);
    for r in records {
        samples.extend(&r.timing.samples_ms);
        first.iters += r.iters;
        first.peak_mem_bytes = first.peak_mem_bytes.max(r.peak_mem_bytes);
        first.breakdown = first.breakdown.as_ref().zip(r.breakdown.as_ref()).and_then(|(a, b)| shared::breakdown::merge(a, b));
    }
    first.timing = Stats::from_samples(samples);
    let secs = first.timing.median_ms / 1e3;
    first.tokens_per_s = first.shape.tokens() as f64 / secs;
    first.tflops = first.flops_per_forward / secs / 1e12;
    first.pct_of_peak = first.peak_tflops.map(|p| 100.0 * first.tflops / p);
    Some(first)
}

/// `--train` where no selected stage's training step fits: refused before any work (the reference
/// gradients alone can take minutes, and every row would then be skipped), with the first stage's
/// paragraph. A run where some stage fits goes on, and the others are rows that say why.
fn check_some_training_step_fits(args: &RunArgs, all: &[Box<dyn Stage>], which: &[usize]) -> anyhow::Result<()> {
    if !args.train || which.is_empty() {
        return Ok(());
    }
    let shared::runner::Resolved { device, shape, .. } = shared::runner::resolve(args)?;
    let (session, avail) = (shape.estimate_session_bytes(), shared::device::available_bytes(&device));
    let mut refusals: Vec<SpeedkitError> = which
        .iter()
        .filter_map(|&i| {
            let step = all[i].estimate_train_bytes(&shape);
            shared::runner::check_fits(all[i].name(), &shape, session.saturating_add(step.total()), Some(step), avail).err()
        })
        .collect();
    match refusals.len() == which.len() {
        true => Err(refusals.remove(0).into()),
        false => Ok(()),
    }
}

/// Run the stages `which` in interleaved rounds, each checked against stage 0's fp32 output. A stage that
/// cannot run here, or fails, is a row; the first failure is returned.
pub fn run(args: RunArgs, all: &[Box<dyn Stage>], which: &[usize], m: Measure) -> anyhow::Result<(LadderReport, Option<anyhow::Error>)> {
    check_some_training_step_fits(&args, all, which)?;
    let session = Session::open(args, default_stages()[0].as_ref(), &[])?; // the fp32 reference: STAGES[0] as written
    let mut report = new_report(&session.info, session.shape, which.iter().map(|&i| all[i].name().to_string()).collect());
    report.ceiling = session.ceiling.clone();
    let (mut failure, mut sticky) = (None, false);
    let entry = |stage, variant, change| Entry { stage, variant, change, ..Default::default() };
    let mut entries: Vec<Entry> = which.iter().map(|&i| entry(i, None, None)).collect();
    for &i in which.iter().filter(|_| m.ablate) {
        let stage = all[i].as_ref();
        // A stage this device cannot run has no variants to time: its row says why.
        let Ok(plan) = ladder_plan(stage, &session.device, &session.info, session.shape, &session.args) else { continue };
        for (change, variant) in stage.ablations(&plan) {
            entries.push(entry(i, Some(variant), Some(change)));
        }
    }
    for r in reference::REFERENCES.iter().filter(|_| m.reference) {
        let stage = (r.make)(&clap::ArgMatches::default()).map_err(|e| anyhow::anyhow!("a reference row: {e}"))?;
        entries.push(Entry { reference: true, ..entry(0, Some(stage), None) });
    }
    let rounds = m.rounds.clamp(1, session.iters);
    report.rounds = Some(rounds);
    'rounds: for round in 0..rounds {
        let iters = session.iters / rounds + usize::from(round < session.iters % rounds);
        let n = entries.len();
        for j in 0..n {
            let e = &mut entries[(j + round) % n];
            if e.out {
                continue;
            }
            let spec = e.spec(all);
            let label = e.label(spec);
            let run = e.variant.as_deref().unwrap_or(spec);
            match session.run_with(run, ladder_request(spec, session.args.precision), iters) {
                Ok((mut record, y)) => {
                    if round == 0 {
                        println!("ran       {label} at {}: {}", record.precision, record.precision_reason);
                    }
                    if session.args.save_output.is_some() && e.change.is_none() && e.y.is_none() {
                        e.y = Some(y);
                    }
                    record.variant = e.change.clone();
                    e.records.push(record);
                }
                Err(err) => {
                    // Every error is a row: "skipped" when the stage cannot run here, "FAILED" when it
                    // ran and is wrong or broke (the run then exits with that error's code).
                    let (reason, failed) = match err.downcast_ref::<SpeedkitError>() {
                        Some(SpeedkitError::Usage(m)) => (m.clone(), false),
                        Some(SpeedkitError::CheckFailed(m)) => (m.clone(), true),
                        None => (format!("error: {}", shared::error::classify(&err).1), true),
                    };
                    let reason = shared::error::strip_backtrace(&reason).replace('\n', " ");
                    // A sticky fault poisons the CUDA context: every later CUDA call in this process fails.
                    let sticky_fault = shared::error::is_sticky_cuda_fault(&err);
                    let why = "a sticky CUDA fault: later work on this device in this process could not run, so the rounds stopped here";
                    let reason = if sticky_fault { format!("{reason} ({why})") } else { reason };
                    leave(&mut report, e, spec, reason, failed);
                    // A stage that leaves in a later round leaves whole (fewer rounds are no row).
                    (e.out, e.records) = (true, Vec::new());
                    if !sticky_fault {
                        failure = failure.or(failed.then_some(err));
                        continue;
                    }
                    // Stop the rounds: what has run keeps its rounds so far, what has not is a row saying why.
                    for other in entries.iter_mut().filter(|o| !o.out && o.records.is_empty()) {
                        let reason =
                            format!("did not run: the earlier sticky CUDA fault in {label} left the device unusable in this process");
                        leave(&mut report, other, other.spec(all), reason, true);
                        other.out = true;
                    }
                    println!("stopped   in round {} of {rounds}: the rows that ran keep the rounds they finished", round + 1);
                    (sticky, failure) = (true, Some(err));
                    break 'rounds;
                }
            }
        }
    }

    // Speedups against stage 0 only, "vs previous" only against stage N-1 (not the row before it in --stages).
    let mut outputs: Vec<(String, candle_core::Tensor)> = Vec::new();
    let mut measured: Vec<(usize, Record)> = Vec::new();
    let mut variants: Vec<(usize, Record)> = Vec::new();
    for e in entries {
        let Some(record) = merge_rounds(e.records) else { continue };
        match e.change {
            None if e.reference => report.references.push(record),
            None => {
                if let Some(y) = e.y {
                    outputs.push((format!("y_{}", all[e.stage].name()), y));
                }
                measured.push((e.stage, record));
            }
            Some(_) => variants.push((e.stage, record)),
        }
    }
    let timings: Vec<(usize, Stats)> = measured.iter().map(|(i, r)| (*i, r.timing.clone())).collect();
    let timing_of = |i: usize| timings.iter().find(|(s, _)| *s == i).map(|(_, t)| t);
    let best_reference = report.references.iter().map(|r| r.timing.median_ms).reduce(f64::min);
    let rows = measured.iter_mut().map(|(i, r)| (Some(*i), r)).chain(report.references.iter_mut().map(|r| (None, r)));
    for (i, record) in rows {
        let t = record.timing.clone();
        record.vs_reference = best_reference.map(|best| best / t.median_ms);
        if let Some(b) = timing_of(0) {
            record.speedup_vs_stage0 = Some(b.median_ms / t.median_ms);
            record.noise_vs_stage0 = i != Some(0) && shared::report::overlaps(b, &t);
        }
        if let Some(p) = i.and_then(|i| i.checked_sub(1)).and_then(timing_of) {
            record.speedup_vs_prev = Some(p.median_ms / t.median_ms);
            record.noise_vs_prev = shared::report::overlaps(p, &t);
        }
    }
    for (i, record) in variants {
        let full = timing_of(i);
        report.ablation.push(Ablation {
            against: all[i].name().into(),
            change: record.variant.clone().unwrap_or_default(),
            buys: full.map(|f| record.timing.median_ms / f.median_ms),
            buys_within_noise: full.is_some_and(|f| shared::report::overlaps(f, &record.timing)),
            record,
        });
    }
    report.records = measured.into_iter().map(|(_, r)| r).collect();
    report.ceilings =
        roofline::ceilings(&session.info, &session.args, session.ceiling.as_ref(), report.records.iter().map(|r| r.precision));
    annotate(&mut report); // each breakdown part's FLOPs, minimum bytes and regime against these ceilings
    if !which.contains(&0) {
        println!("note      stage 0 was not selected: no speedups over it");
    }
    if let (Some(path), true) = (&session.args.save_output, sticky) {
        println!("not saved {}: the sticky CUDA fault leaves no tensor on the device readable", path.display());
    } else if let Some(path) = &session.args.save_output {
        // x, then each stage's output as y_<stage>, for comparison outside the program; with
        // --train also r and stage 0's gradients (`Session::train_outputs`).
        outputs.extend(session.train_outputs());
        let named: Vec<_> = std::iter::once(("x", &session.x)).chain(outputs.iter().map(|(n, t)| (n.as_str(), t))).collect();
        save_tensors(path, &named)?;
    }
    Ok((report, failure))
}

/// `ladder report`: the device, candle's switches, and what every stage would run and why.
pub fn report(args: &RunArgs, stages: &[Box<dyn Stage>]) -> anyhow::Result<String> {
    use std::fmt::Write;
    if let Some((flag, _)) = shared::cli::output_flags(args).first() {
        anyhow::bail!(SpeedkitError::usage(format!(
            "`ladder report` runs nothing, so there is nothing for {flag} to write. Fix: drop {flag}, or run `ladder {flag} PATH` (without `report`)."
        )));
    }
    let shared::runner::Resolved { device, info, shape, .. } = shared::runner::resolve(args)?;
    let mut out = String::new();
    writeln!(out, "device    {}", info.describe())?;
    let cuda = if cfg!(feature = "cuda") { "on" } else { "off (CPU only; build with --features cuda for the GPU)" };
    writeln!(out, "build     cuda feature {cuda} · candle-core {} · commit {}", provenance::versions()["candle-core"], commit())?;
    writeln!(out, "switches  now: {} (process-wide; every stage's build sets all three)", GemmSwitches::current().describe())?;
    writeln!(out, "shape     {shape}")?;
    if !info.is_cuda() {
        // The ceiling a CPU row's % of peak is against, measured now (under a second on `small`).
        shared::ceiling::check_fit(&shape)?;
        writeln!(out, "ceiling   {}", shared::ceiling::measure(&shape)?.describe())?;
    }
    let asked = if let PrecisionRequest::Exactly(p) = args.precision { p.name() } else { "auto" };
    writeln!(out, "\nwhat each stage would run (--precision {asked}):")?;
    for stage in stages {
        match ladder_plan(stage.as_ref(), &device, &info, shape, args) {
            Ok(plan) => {
                writeln!(out, "  {:<18} {:<5} {}", stage.name(), plan.precision.name(), plan.precision_reason)?;
                let mut more = vec![format!("applies: {}", stage.switches(&plan).describe())];
                more.extend(stage.implementation(&plan).map(|i| format!("runs: {i}")));
                more.extend(stage.check_shape(&shape).err().map(|e| format!("cannot run this shape: {e}")));
                if args.train {
                    // The estimate the run's up-front memory check uses (`Stage::estimate_train_bytes`).
                    let step = stage.estimate_train_bytes(&shape);
                    let total = shared::report::fmt_bytes(Some(u64::try_from(step.total()).unwrap_or(u64::MAX)));
                    more.push(format!("memory: a training step needs about {total} (estimate: {})", step.describe()));
                }
                more.extend(stage.notes(&plan).iter().map(|n| format!("note: {n}")));
                for line in more {
                    writeln!(out, "{:27}{line}", "")?;
                }
            }
            Err(e) => writeln!(out, "  {:<18} skipped: {e}", stage.name())?,
        }
    }
    Ok(out)
}

/// What to make of a run, or of a recorded one (`ladder render`).
#[derive(Args, Clone, Debug)]
pub struct OutputArgs {
    /// Print the table as GitHub markdown instead of the terminal table
    #[arg(long, env = "SPEEDKIT_MARKDOWN", action = clap::ArgAction::SetTrue, value_parser = clap::builder::BoolishValueParser::new())]
    pub markdown: bool,
    /// Write a chart as SVG: median ms per stage with the speedup over stage 0 on each bar and the error under it (a sweep: ms and speedup over the swept values)
    #[arg(long, env = "SPEEDKIT_SVG")]
    pub svg: Option<PathBuf>,
    /// Rewrite one region of --readme (between its markers) from this run, and write the chart it links, and a run's JSON [default: results/ladder-<cpu|cuda>.svg and .json beside the README; ladder-<cpu|cuda>-train.* for --train]
    #[arg(long, env = "SPEEDKIT_UPDATE_README", action = clap::ArgAction::SetTrue, value_parser = clap::builder::BoolishValueParser::new())]
    pub update_readme: bool,
    /// The README that --update-readme rewrites
    #[arg(long, env = "SPEEDKIT_README", default_value = "README.md")]
    pub readme: PathBuf,
    /// Which region of the README --update-readme rewrites: the lines between `<!-- NAME:begin -->` and `<!-- NAME:end -->`; a region with a `train` word in its name (results-train) takes training runs only, any other forward runs only. README.md's results and results-gpu show a run's table and chart, and write the run in full into docs/measuring.md's results-cpu and docs/gpu.md's results-gpu-te; the other regions of the H100 runs live on docs/gpu.md, and results-train and results-gpu-train (the CPU's and the H100's training runs) on docs/training.md
    #[arg(long, env = "SPEEDKIT_README_REGION", default_value = "results", value_parser = render::region_name)]
    pub readme_region: String,
}

/// The ladder's own flags, beside every runner flag.
#[derive(Args, Clone, Debug)]
pub struct LadderArgs {
    /// Run only these stages, by number, e.g. 0,2,4 [default: all]. Speedups are over stage 0 and "vs previous" over stage N-1, so each needs that stage in the run
    #[arg(long, env = "SPEEDKIT_STAGES", value_delimiter = ',')]
    pub stages: Option<Vec<usize>>,
    /// Run the ladder once per value of one dimension, e.g. seq=512,1024,2048 (also batch=..., d_model=... with FF = 4·C and d_head kept); one table per value, one summary table, one chart with --svg
    #[arg(long, env = "SPEEDKIT_SWEEP")]
    pub sweep: Option<Sweep>,
    /// Also run each stage with each of its changes undone in turn (stage 2 with the head split/merge copies kept and, on the CPU, its row-wise kernel; stage 3 without each fusion, stage 4 without each FP8 fusion): what each part buys
    #[arg(long, env = "SPEEDKIT_ABLATE", action = clap::ArgAction::SetTrue, value_parser = clap::builder::BoolishValueParser::new())]
    pub ablate: bool,
    /// Also time the reference rows: the same block on candle-nn's own ops (its fused LayerNorm, its CPU flash attention; candle-flash-attn in a flash-attn build), in the same rounds; each stage's "vs ref" is the fastest reference's median over its own
    #[arg(long, env = "SPEEDKIT_REFERENCE", action = clap::ArgAction::SetTrue, value_parser = clap::builder::BoolishValueParser::new())]
    pub reference: bool,
    /// Split the timed iterations into this many interleaved rounds (every stage once per round, order rotated), so drift does not favour a row
    #[arg(long, env = "SPEEDKIT_ROUNDS", default_value_t = 3, value_parser = clap::value_parser!(u64).range(1..))]
    pub rounds: u64,
    #[command(flatten)]
    pub output: OutputArgs,
}

/// `ladder render`: a recorded run, rendered again without running anything.
#[derive(Args, Clone, Debug)]
pub struct RenderArgs {
    /// A JSON file written by `ladder --json` (one run or a sweep)
    #[arg(long, env = "SPEEDKIT_FROM")]
    pub from: PathBuf,
    /// Also draw every --breakdown part of the run on the roofline, each under its own precision's roof, with its regime (C, M, U), to this SVG
    #[arg(long, env = "SPEEDKIT_PARTS_ROOFLINE")]
    pub parts_roofline: Option<PathBuf>,
    #[command(flatten)]
    pub output: OutputArgs,
}

/// A ladder run or a sweep: what the outputs are made from (its JSON is the report's own).
#[derive(serde::Serialize)]
#[serde(untagged)]
pub enum Results {
    Ladder(Box<LadderReport>),
    Sweep(SweepReport),
}

/// Read a JSON file written by `ladder --json`: untrusted input, checked before it is rendered.
pub fn load(path: &Path) -> anyhow::Result<Results> {
    let pass = "Fix: pass --from the JSON a `ladder --json PATH` run wrote";
    let usage = |why: String| SpeedkitError::usage(format!("{} {why}", path.display()));
    let damaged = |why: String| {
        usage(format!(
            "cannot be rendered: {why}. A ladder run never writes that, so the file was edited or damaged. {pass} (or run it again)."
        ))
    };
    let bytes = read_capped(path).map_err(|e| SpeedkitError::usage(format!("cannot read {} ({e}). {pass}.", path.display())))?;
    let bad = |e: serde_json::Error| usage(format!("is not a ladder JSON file ({e}). {pass}."));
    let value: serde_json::Value = serde_json::from_slice(&bytes).map_err(bad)?;
    check_value(&value, &mut Vec::new()).map_err(damaged)?;
    let mut results = match value.get("schema").and_then(|s| s.as_str()) {
        Some(LADDER_SCHEMA | LADDER_SCHEMA_V1) => Results::Ladder(Box::new(serde_json::from_value(value).map_err(bad)?)),
        Some(SWEEP_SCHEMA | SWEEP_SCHEMA_V1) => Results::Sweep(serde_json::from_value(value).map_err(bad)?),
        Some(s) if s.starts_with(RECORD_SCHEMA.trim_end_matches("v2")) => {
            let why = "is one stage's record (a stage binary's --json), not a ladder's. Fix: render the JSON of `ladder --json PATH`.";
            return Err(usage(why.into()).into());
        }
        other => return Err(usage(format!("has schema {other:?}; this ladder reads {LADDER_SCHEMA} and {SWEEP_SCHEMA}. {pass}.")).into()),
    };
    match &mut results {
        Results::Ladder(r) => check_report(r).map(|()| annotate(r)),
        Results::Sweep(s) => check_sweep(s).map(|()| s.runs.iter_mut().for_each(annotate)),
    }
    .map_err(damaged)?;
    Ok(results)
}

/// Most rows, breakdown parts, GEMM shapes or roofs a file may hold: a chart's width would overflow.
const MAX_ROWS: usize = 64;

/// Longest string (in characters) a file may hold anywhere, keys included (longer ones overflowed the padding).
pub const MAX_TEXT: usize = 4096;

/// Everywhere in a file: strings of at most `MAX_TEXT` characters, numbers 0 or from 1e-30 to 1e21 (a run writes
/// no negative number; no axis should span hundreds of decades).
fn check_value(v: &serde_json::Value, at: &mut Vec<String>) -> Result<(), String> {
    use serde_json::Value;
    let place = |at: &[String]| if at.is_empty() { "the top level".to_string() } else { at.join(".") };
    let long = |s: &str| s.len() > MAX_TEXT && s.chars().count() > MAX_TEXT;
    let mut each = |k: String, x: &Value| {
        if long(&k) {
            return Err(format!("a key in {} is {} characters long, more than {MAX_TEXT}", place(at), k.chars().count()));
        }
        at.push(k);
        let r = check_value(x, at);
        at.pop();
        r
    };
    match v {
        Value::String(s) if long(s) => {
            Err(format!("the string at {} is {} characters long, more than {MAX_TEXT}", place(at), s.chars().count()))
        }
        Value::Number(n) => match n.as_f64() {
            Some(x) if x == 0.0 || (1e-30..=1e21).contains(&x) => Ok(()),
            _ => Err(format!("{} is {n}, not 0 or a number from 1e-30 to 1e21", place(at))),
        },
        Value::Array(a) => a.iter().enumerate().try_for_each(|(i, x)| each(i.to_string(), x)),
        Value::Object(m) => m.iter().try_for_each(|(k, x)| each(k.clone(), x)),
        _ => Ok(()),
    }
}

/// What `check_value` cannot see: valid shapes, times and FLOPs above zero (they divide), at most `MAX_ROWS` of each.
fn check_report(r: &LadderReport) -> Result<(), String> {
    if r.mode().is_none() {
        return Err("its records mix forward and training (`mode`) rows, and one table or chart cannot be labelled for both".into());
    }
    r.shape.validate(None).map_err(|e| format!("its shape {:?} is invalid ({e})", r.shape))?;
    let rows = [r.records.len() + r.skipped.len(), r.stages.len(), r.ablation.len(), r.references.len() + r.references_out.len()];
    let roofs = [r.ceilings.as_ref().map_or(0, |c| c.tflops.len()), r.ceiling.as_ref().map_or(0, |c| c.gemms.len())];
    if rows.iter().chain(&roofs).any(|&n| n > MAX_ROWS) {
        return Err(format!("it holds more than {MAX_ROWS} rows, ablation rows, reference rows, roofs or GEMMs"));
    }
    for rec in r.records.iter().chain(&r.references).chain(r.ablation.iter().map(|a| &a.record)) {
        rec.shape.validate(None).map_err(|e| format!("{}'s shape is invalid ({e})", rec.stage))?;
        let parts = rec.breakdown.as_ref().map_or(0, |b| b.parts.len());
        let gemms = rec.ceiling.as_ref().map_or(0, |c| c.gemms.len());
        if rec.timing.median_ms <= 0.0 || rec.flops_per_forward <= 0.0 || rec.tflops <= 0.0 || parts.max(gemms) > MAX_ROWS {
            return Err(format!("{}'s median_ms, flops_per_forward or tflops is 0, or it has more than {MAX_ROWS} parts", rec.stage));
        }
    }
    Ok(())
}

fn check_sweep(s: &SweepReport) -> Result<(), String> {
    if s.values.len() != s.runs.len() || s.values.is_empty() || s.values.len() > MAX_ROWS {
        return Err(format!("it has {} values and {} runs (need the same number, 1 to {MAX_ROWS})", s.values.len(), s.runs.len()));
    }
    if !["seq", "batch", "d_model"].contains(&s.axis.as_str()) {
        return Err(format!("its axis {:?} is not seq, batch or d_model", s.axis));
    }
    s.runs.iter().try_for_each(check_report)?;
    if s.runs.windows(2).any(|w| w[0].mode() != w[1].mode()) {
        return Err("its runs mix forward and training (`mode`) runs, and one chart cannot be labelled for both".into());
    }
    Ok(())
}

/// Each breakdown part's regime computed from the record and the run's ceilings, whatever a file says.
fn annotate(r: &mut LadderReport) {
    let bandwidth = r.ceilings.as_ref().and_then(|c| c.bandwidth_gbs);
    for rec in r.records.iter_mut().chain(r.references.iter_mut()).chain(r.ablation.iter_mut().map(|a| &mut a.record)) {
        rec.breakdown.iter_mut().flat_map(|b| b.parts.iter_mut().chain(&mut b.backward)).for_each(|p| p.regime = None);
        shared::regime::annotate(rec, bandwidth);
    }
}

/// The README's folder ("." for a bare file name).
pub(crate) fn readme_dir(readme: &Path) -> PathBuf {
    readme.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new(".")).to_path_buf()
}

/// Where --update-readme puts a file it was not given a path for: results/ladder-<kind>.<ext>, and
/// results/ladder-<kind>-train.<ext> for training steps, so neither replaces the other's files.
fn default_beside_readme(readme: &Path, info: &DeviceInfo, mode: Mode, ext: &str) -> PathBuf {
    let kind = if info.is_cuda() { "cuda" } else { "cpu" };
    let train = if mode == Mode::Train { "-train" } else { "" };
    readme_dir(readme).join("results").join(format!("ladder-{kind}{train}.{ext}"))
}

/// `path` as a link from the README's folder; refused outside it, where the link would not work on GitHub.
fn link_from_readme(readme: &Path, flag: &str, path: &Path) -> Result<String, SpeedkitError> {
    // Resolved as the output policy does, so this works before the file exists (checked up front).
    let canon = |p: &Path| {
        shared::output::resolve(p)
            .map_err(|e| SpeedkitError::usage(format!("cannot resolve {} ({e}). Fix: pick a path under the README's folder.", p.display())))
    };
    let (dir, file) = (canon(&readme_dir(readme))?, canon(path)?);
    let rel = file.strip_prefix(&dir).map_err(|_| {
        SpeedkitError::usage(format!(
            "{flag} {} is outside {}, the README's folder, so the README could not link to it. Fix: {}.",
            path.display(),
            dir.display(),
            match flag {
                "--from" => "copy the JSON under the README's folder and render that copy, or drop --update-readme".to_string(),
                f => format!("give {f} a path under that folder (or drop {f} for the default results/ path)"),
            }
        ))
    })?;
    Ok(rel.components().map(|c| c.as_os_str().to_string_lossy().into_owned()).collect::<Vec<_>>().join("/"))
}

/// The bytes of a regular file, refused past `MAX_READ` (a README read in part would be written back in part).
/// A device or pipe is refused unopened: /dev/zero never ends, a pipe or FIFO may wait for ever.
fn read_capped(path: &Path) -> std::io::Result<Vec<u8>> {
    if !std::fs::metadata(path)?.is_file() {
        return Err(std::io::Error::other("it is not a regular file"));
    }
    let mut bytes = Vec::new();
    std::fs::File::open(path)?.take(MAX_READ + 1).read_to_end(&mut bytes)?;
    if bytes.len() as u64 > MAX_READ {
        return Err(std::io::Error::other(format!("it is larger than {} MiB", MAX_READ >> 20)));
    }
    Ok(bytes)
}

/// Most bytes read from any one input file (256 MiB).
const MAX_READ: u64 = 256 << 20;

/// Read the README and check its markers before a run, so a long run does not end in a refusal.
fn read_readme(readme: &Path, region: &str) -> Result<String, SpeedkitError> {
    let name = readme.display();
    let text = read_capped(readme).and_then(|b| String::from_utf8(b).map_err(std::io::Error::other)).map_err(|e| {
        SpeedkitError::usage(format!(
            "--update-readme: cannot read {name} ({e}). Fix: run from the repository root, or pass --readme PATH."
        ))
    })?;
    render::splice_readme(&text, region, "").map_err(|e| SpeedkitError::usage(format!("{name}: {e}")))?;
    Ok(text)
}

/// Print the table, write the charts, and rewrite the README's region (linking `json`), as asked.
pub fn emit(results: &Results, out: &OutputArgs, json: Option<&Path>, svg_path: Option<&Path>) -> anyhow::Result<()> {
    println!();
    match results {
        Results::Ladder(r) => {
            print!("{}", r.table(out.markdown));
            if !r.ablation.is_empty() || !r.ablation_out.is_empty() {
                println!("\none change at a time (--ablate): \"what it buys\" = variant median / stage median, ≈1.0x within p10-p90 noise");
                print!("{}", render::ablation_table(r, out.markdown));
            }
            if r.records.iter().any(|rec| rec.breakdown.is_some()) {
                println!("\nwhere the time goes (--breakdown, instrumented: a sync at each part boundary)");
                print!("{}", render::breakdown_table(r, out.markdown));
                if r.records.iter().any(|rec| rec.breakdown.as_ref().is_some_and(|b| !b.backward.is_empty())) {
                    println!("\nthe backward by part (--train --breakdown: each part's backward, in the order it runs, then the optimizer's update)");
                    print!("{}", render::backward_table(r, out.markdown));
                }
                println!("{}", render::REGIME_LEGEND.replace("**", ""));
            }
        }
        Results::Sweep(s) => print!("{}", render::sweep_tables(s, out.markdown)),
    }
    if let Some(path) = svg_path {
        let svg = match results {
            Results::Ladder(r) => chart::ladder_svg(r)?,
            Results::Sweep(s) => chart::sweep_svg(s)?,
        };
        shared::output::write("--svg", path, svg.as_bytes())?;
        println!("\nsaved     chart to {}", path.display());
        if let Results::Ladder(r) = results {
            // Beside the bar chart, from the same report: the roofline, and the breakdown if recorded.
            let [roofline, b] = chart_siblings(path);
            shared::output::write("--svg (the roofline chart beside it)", &roofline, roofline::roofline_svg(r)?.as_bytes())?;
            println!("saved     roofline to {}", roofline.display());
            if r.records.iter().any(|rec| rec.breakdown.is_some()) {
                shared::output::write("--svg (the breakdown chart beside it)", &b, chart::breakdown_svg(r)?.as_bytes())?;
                println!("saved     breakdown chart to {}", b.display());
            }
        }
    }
    if out.update_readme {
        let (Results::Ladder(report), Some(json), Some(svg)) = (results, json, svg_path) else {
            anyhow::bail!("--update-readme needs one ladder run's JSON and chart paths");
        };
        let (json_link, svg_link) = (link_from_readme(&out.readme, "--json", json)?, link_from_readme(&out.readme, "--svg", svg)?);
        let (page, up) = render::region_page(&out.readme, &out.readme_region);
        let text = read_readme(&page, &out.readme_region)?;
        let region = render::region_text(&out.readme_region, report, &format!("{up}{json_link}"), &format!("{up}{svg_link}"));
        write_region(&page, &text, &out.readme_region, &region, json)?;
        // A summary region's run in full goes on its docs page, where that page holds the region.
        if let Some(full) = render::full_region(&out.readme_region) {
            let (page, up) = render::region_page(&out.readme, full);
            match read_capped(&page).ok().and_then(|b| String::from_utf8(b).ok()) {
                Some(text) if render::splice_readme(&text, full, "").is_ok() => {
                    let region = render::readme_region(report, &format!("{up}{json_link}"), &format!("{up}{svg_link}"));
                    write_region(&page, &text, full, &region, json)?;
                }
                _ => println!("not written {}: no such page, or no {full} region on it (the run in full)", page.display()),
            }
        }
    }
    Ok(())
}

/// Splice `region` into region `name` of `page` (whose bytes are `text`), and say what changed.
fn write_region(page: &Path, text: &str, name: &str, region: &str, json: &Path) -> anyhow::Result<()> {
    let updated = render::splice_readme(text, name, region)?;
    if updated == text {
        println!("unchanged {}: its {name} region already shows this run", page.display());
    } else {
        shared::output::write("--readme", page, updated.as_bytes())?;
        println!("updated   {}: {name} region rewritten from {}", page.display(), json.display());
    }
    Ok(())
}

/// With --update-readme: refuse a sweep, and check the page's markers now, before any work.
fn check_readme(out: &OutputArgs, sweep: bool) -> anyhow::Result<()> {
    if out.update_readme {
        anyhow::ensure!(
            !sweep,
            SpeedkitError::usage(
                "--update-readme writes one ladder run into the README's results region, and a sweep is several. \
                 Fix: drop --update-readme and use --markdown and --svg for the sweep's tables and chart.",
            )
        );
        read_readme(&render::region_page(&out.readme, &out.readme_region).0, &out.readme_region)?;
    }
    Ok(())
}

/// Every file a run or render writes, checked up front; with --update-readme, the JSON and chart under the README's folder.
fn check_outputs(
    args: Option<&RunArgs>,
    out: &OutputArgs,
    json: Option<&Path>,
    svg: Option<&Path>,
    more: &[(&str, &Path)],
    inputs: &[(&str, &Path)],
) -> Result<(), SpeedkitError> {
    let mut list = args.map(shared::cli::output_flags).unwrap_or_default();
    list.extend(more.iter().copied());
    // With --update-readme and no --json, the JSON goes to the default path beside the README.
    let json_flag = if args.is_some_and(|a| a.json.is_some()) || !out.update_readme { "--json" } else { "--update-readme (its JSON)" };
    list.retain(|(flag, _)| *flag != "--json");
    list.extend(json.map(|p| (json_flag, p)));
    list.extend(svg.map(|p| ("--svg", p)));
    // The roofline and breakdown charts are written beside the bar chart (`render::sibling`).
    let beside: Vec<PathBuf> = svg.iter().flat_map(|p| chart_siblings(p)).collect();
    list.extend(beside.iter().map(|p| ("--svg (the chart beside it)", p.as_path())));
    let page = render::region_page(&out.readme, &out.readme_region).0;
    list.extend(out.update_readme.then_some(("--readme", page.as_path())));
    // A summary region's docs page, written beside it when it exists (`emit`).
    let full = render::full_region(&out.readme_region).map(|full| render::region_page(&out.readme, full).0);
    list.extend(full.as_deref().filter(|p| out.update_readme && p.exists()).map(|p| ("--readme (the run in full)", p)));
    let checked = shared::output::check_all(&list)?;
    shared::output::check_not_inputs(&checked, inputs)?;
    for (flag, p) in [(json_flag, json), ("--svg", svg)].into_iter().filter(|_| out.update_readme) {
        p.map(|p| link_from_readme(&out.readme, flag, p)).transpose()?;
    }
    Ok(())
}

/// The charts written beside the bar chart at `svg`: the roofline and the breakdown.
fn chart_siblings(svg: &Path) -> [PathBuf; 2] {
    ["roofline", "breakdown"].map(|w| PathBuf::from(render::sibling(&svg.to_string_lossy(), w)))
}

/// `--ablate` with nothing to undo on this device with these flags, refused before any work.
fn check_ablate(args: &RunArgs, stages: &[Box<dyn Stage>], which: &[usize]) -> anyhow::Result<()> {
    let shared::runner::Resolved { device, info, shape, .. } = shared::runner::resolve(args)?;
    let undoable = which.iter().any(|&i| {
        let stage = stages[i].as_ref();
        ladder_plan(stage, &device, &info, shape, args).is_ok_and(|p| !stage.ablations(&p).is_empty())
    });
    if !undoable {
        let names: Vec<&str> = which.iter().map(|&i| stages[i].name()).collect();
        anyhow::bail!(SpeedkitError::usage(format!(
            "--ablate times each stage with one of its changes undone (on a CPU stage 0's engine passes, stage 2's head \
             split/merge and kernel, stage 3's fusions, stage 4's FP8 fusions), but none of the stages in this run ({}) \
             has a change to undo on this device with these flags, so it would add no rows. Fix: include stage 2, 3 or 4 \
             in --stages (with some --fusions or --fp8-fusions on), or stage 0 on a CPU without --elementwise candle, or \
             drop --ablate.",
            names.join(", ")
        )));
    }
    Ok(())
}

/// The ladder command: run (or sweep), then print, chart and record as asked.
fn run_command(args: RunArgs, ladder: LadderArgs, stages: Vec<Box<dyn Stage>>) -> anyhow::Result<()> {
    let which = select(ladder.stages.as_deref())?;
    if ladder.ablate && ladder.sweep.is_some() {
        anyhow::bail!(SpeedkitError::usage(
            "--ablate adds rows to one ladder run, and a sweep is several runs. Fix: drop --ablate, or run the ablation \
             at one shape (e.g. --seq 2048) without --sweep.",
        ));
    }
    let out = &ladder.output;
    check_readme(out, ladder.sweep.is_some())?;
    shared::cli::validate(&args)?;
    ladder.sweep.as_ref().map(|s| sweep::check_values(&args, s)).transpose()?;
    // The default results paths depend on the device kind and the mode (results/ladder-cpu.*, -cuda.*,
    // -cpu-train.*, -cuda-train.*); a training run goes into a training region only, a forward into a forward one.
    let mode = if args.train { Mode::Train } else { Mode::Forward };
    if out.update_readme {
        render::check_region_mode(&out.readme_region, mode, "this run")?;
    }
    let default_kind = if out.update_readme { Some(shared::device::select(args.device)?.1) } else { None };
    let beside = |ext| default_kind.as_ref().map(|i| default_beside_readme(&out.readme, i, mode, ext));
    let planned_json = args.json.clone().or_else(|| beside("json"));
    let planned_svg = out.svg.clone().or_else(|| beside("svg"));
    if ladder.ablate {
        check_ablate(&args, &stages, &which)?;
    }
    check_outputs(Some(&args), out, planned_json.as_deref(), planned_svg.as_deref(), &[], &shared::cli::input_flags(&args))?;
    let argv: Vec<String> = std::env::args().skip(1).collect();
    let measure = Measure { rounds: ladder.rounds as usize, ablate: ladder.ablate, reference: ladder.reference };
    let (results, failure) = match &ladder.sweep {
        Some(s) => sweep::run(&args, &stages, s, &which, &argv, measure).map(|(r, f)| (Results::Sweep(r), f))?,
        None => {
            run(args.clone(), &stages, &which, measure).map(|(r, f)| (Results::Ladder(Box::new(LadderReport { args: argv, ..r })), f))?
        }
    };
    // A failed run never replaces the recorded results (paths the user named are written either way).
    let (json, svg) = if failure.is_none() { (planned_json, planned_svg) } else { (args.json.clone(), out.svg.clone()) };
    json.as_ref().map(|path| write_json(path, &results)).transpose()?;
    // A failed check is reported in the table and the files, but never becomes the README's.
    let out = OutputArgs { update_readme: out.update_readme && failure.is_none(), ..out.clone() };
    emit(&results, &out, json.as_deref(), svg.as_deref())?;
    if let Some(path) = &json {
        println!("saved     JSON to {}", path.display());
    }
    if failure.is_some() && ladder.output.update_readme {
        let readme = ladder.output.readme.display();
        println!("not updating {readme} or its results files: a stage failed (the recorded results stay as they were)");
    }
    failure.map_or(Ok(()), Err)
}

pub fn main() -> ExitCode {
    shared::device::keep_freed_memory(); // no mmap, page faults and munmap per large tensor
    shared::output::clean_up_on_signals(); // a signal mid-write leaves no temp file
                                           // `about` after `augment_args`: the flag structs' doc comments would otherwise replace it.
    let cmd = with_stage_args(LadderArgs::augment_args(RunArgs::augment_args(clap::Command::new("ladder"))))
        .about("Every stage of the transformer block side by side: same weights, same input, checked, timed")
        .subcommand(
            with_stage_args(RunArgs::augment_args(clap::Command::new("report")))
                .about("Print the device, candle's global switches, and what every stage would run and why"),
        )
        .subcommand(
            selftest::SelftestArgs::augment_args(clap::Command::new("selftest")).about(
                "Run each GPU building block alone against its CPU twin; print a pass/fail table and write a JSON to send back (on the CPU: the emulations and models)",
            ),
        )
        .subcommand(
            RenderArgs::augment_args(clap::Command::new("render"))
                .about("Print, chart or put in the README a run recorded with --json, without running anything again"),
        );
    if let Err(e) = shared::cli::check_env(&cmd) {
        return exit_with(|| Err(e.into()));
    }
    let matches = cmd.get_matches();
    exit_with(|| match matches.subcommand() {
        Some(("report", sub)) => {
            print!("{}", report(&RunArgs::from_arg_matches(sub)?, &stages_from(sub)?)?);
            Ok(())
        }
        Some(("selftest", sub)) => selftest::command(&selftest::SelftestArgs::from_arg_matches(sub)?),
        Some(("render", sub)) => {
            let args = RenderArgs::from_arg_matches(sub)?;
            let results = load(&args.from)?;
            check_readme(&args.output, matches!(results, Results::Sweep(_)))?;
            if let (true, Results::Ladder(r)) = (args.output.update_readme, &results) {
                let failed = r.skipped.iter().filter(|s| s.failed).map(|s| s.stage.clone());
                let failed = failed.chain(r.ablation_out.iter().filter(|o| o.failed).map(|o| format!("{} ({})", o.against, o.change)));
                if let Some(bad) = failed.into_iter().next() {
                    anyhow::bail!(SpeedkitError::usage(format!(
                        "{} records a run in which {bad} FAILED, and the README only shows runs that passed. Fix: render it with --markdown or --svg, or run the ladder again.",
                        args.from.display(),
                    )));
                }
            }
            if let (true, Results::Ladder(r)) = (args.output.update_readme, &results) {
                // `load` refused a file whose records mix modes.
                render::check_region_mode(&args.output.readme_region, r.mode().unwrap_or_default(), &args.from.display().to_string())?;
            }
            let svg = args.output.svg.clone().or_else(|| match &results {
                Results::Ladder(r) if args.output.update_readme => {
                    Some(default_beside_readme(&args.output.readme, &r.device, r.mode().unwrap_or_default(), "svg"))
                }
                _ => None,
            });
            // Every output, the charts beside --svg and the README included, against the file read.
            let parts: Vec<(&str, &Path)> = args.parts_roofline.iter().map(|p| ("--parts-roofline", p.as_path())).collect();
            check_outputs(None, &args.output, None, svg.as_deref(), &parts, &[("--from", args.from.as_path())])?;
            if args.output.update_readme {
                link_from_readme(&args.output.readme, "--from", &args.from)?;
            }
            // Drawn before anything is written: a run without parts is refused with nothing changed.
            let parts_svg = match (&args.parts_roofline, &results) {
                (None, _) => None,
                (Some(_), Results::Ladder(r)) => Some(roofline::parts_roofline_svg(r)?),
                (Some(_), Results::Sweep(_)) => anyhow::bail!(SpeedkitError::usage(
                    "--parts-roofline draws one run's --breakdown parts, and this file is a sweep. Fix: render a ladder run's JSON."
                        .to_string()
                )),
            };
            emit(&results, &args.output, Some(&args.from), svg.as_deref())?;
            if let (Some(path), Some(svg)) = (&args.parts_roofline, parts_svg) {
                shared::output::write("--parts-roofline", path, svg.as_bytes())?;
            }
            Ok(())
        }
        _ => run_command(RunArgs::from_arg_matches(&matches)?, LadderArgs::from_arg_matches(&matches)?, stages_from(&matches)?),
    })
}
