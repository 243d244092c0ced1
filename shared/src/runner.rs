//! The one path every stage binary and the ladder take: resolve flags into a device, shape,
//! weights and input; compute the fp32 reference; then per stage plan, build, check, time
//! and report.

use crate::ceiling::CpuCeiling;
use crate::check::{compare, CheckResult};
use crate::cli::{exit_with, validate, RunArgs};
use crate::device::{self, DeviceInfo, DeviceKind, GemmSwitches, MemProbe};
use crate::error::SpeedkitError;
use crate::perf::{block_flops, peak_tflops};
use crate::preset::{Preset, Shape};
use crate::report::{gemm_backends, grid, table, write_json, Mode, Record, Row, MEASURED_PEAK, RECORD_SCHEMA};
use crate::stage::{plan, Plan, Precision, PrecisionRequest, Stage, StageEntry, EMULATED};
use crate::timing::time_forward;
use crate::weights::{load_input, random_input, save_tensors, BlockWeights};
use candle_core::{Device, Tensor, Var};
use clap::{Args, FromArgMatches};

use std::process::ExitCode;

/// Everything the stages share in one run: same device, same weights, same input, and the
/// reference output they are checked against.
pub struct Session {
    pub args: RunArgs,
    pub device: Device,
    pub info: DeviceInfo,
    pub shape: Shape,
    /// On `device`, f32.
    pub weights: BlockWeights,
    /// "seed 0" or "path (layer N)".
    pub weights_source: String,
    /// (B, T, C) on `device`, f32.
    pub x: Tensor,
    pub warmup: usize,
    pub iters: usize,
    /// The fp32 stage-0 output for `x`; `None` with --no-check.
    pub reference: Option<Tensor>,
    /// `--train`: the loss's upstream gradient r, and stage 0's fp32 gradients for (x, r)
    /// (`None` with --no-check).
    pub upstream: Option<Tensor>,
    pub reference_grads: Option<Vec<Tensor>>,
    /// On the CPU: this machine's GEMM rate at the block's shapes and its memory bandwidth,
    /// measured once when the session opens; each CPU row's % of peak is against it.
    pub ceiling: Option<CpuCeiling>,
}

/// A dimension given both by a flag and by a file must agree; the file wins, so say so.
fn agree_with_file(what: &str, path: &std::path::Path, dims: &[(&str, Option<usize>, usize)]) -> Result<(), SpeedkitError> {
    for &(flag, given, file) in dims {
        if let Some(g) = given.filter(|&g| g != file) {
            return Err(SpeedkitError::usage(format!(
                "{flag} {g} contradicts the {what} file {}, which has {file}. Fix: drop {flag}; it is read from the file.",
                path.display()
            )));
        }
    }
    Ok(())
}

/// The shape of one piece of the reference: `chunk` sequences (`check::reference_batch_chunk`).
fn reference_piece(shape: &Shape, limit: usize) -> Result<Shape, SpeedkitError> {
    Ok(Shape { batch: crate::check::reference_batch_chunk(shape, limit)?, ..*shape })
}

/// Bytes as GiB for messages.
fn gib(b: u128) -> String {
    format!("{:.2} GiB", b as f64 / (1u64 << 30) as f64)
}

/// What the flags and files resolve to before anything runs: the device, the shape, and the
/// weights and input if they came from files. Shared by runs and by `ladder report`.
pub struct Resolved {
    pub device: Device,
    pub info: DeviceInfo,
    pub preset: Preset,
    pub shape: Shape,
    pub weights: Option<BlockWeights>,
    pub x: Option<Tensor>,
}

/// Resolve device and shape: the preset, then the files (weights fix C and FF, the input B
/// and T), then the flags; then validate the shape.
pub fn resolve(args: &RunArgs) -> anyhow::Result<Resolved> {
    validate(args)?;
    let (device, info) = device::select(args.device)?;
    let preset = args.preset.unwrap_or(if info.is_cuda() { Preset::Te } else { Preset::Small });
    let mut shape = preset.shape();

    // Weights from a file fix C and FF; n_head comes from --heads, then the file's
    // metadata, then GPT-2's convention of d_head = 64.
    let mut loaded = None;
    if let Some(path) = &args.weights {
        let (w, meta_heads) = BlockWeights::load_gpt2(path, args.layer)?;
        let (c, ff) = w.dims();
        agree_with_file("weights", path, &[("--d-model", args.d_model, c), ("--ff", args.ff, ff)])?;
        shape.d_model = c;
        shape.ff = ff;
        shape.n_head = args.heads.or(meta_heads).unwrap_or(if c.is_multiple_of(64) { c / 64 } else { shape.n_head });
        loaded = Some(w);
    }
    let x_file = match &args.input {
        Some(path) => {
            let x = load_input(path)?;
            let (b, t, c) = x.dims3()?;
            let c_model = loaded.as_ref().map(|w| w.dims().0).or(args.d_model).unwrap_or(shape.d_model);
            if c != c_model {
                anyhow::bail!(SpeedkitError::usage(format!(
                    "the input file {} has C = {c} channels but the block has C = {c_model}. Fix: give an input of shape (B, T, {c_model}) or a matching --d-model / --weights.",
                    path.display()
                )));
            }
            agree_with_file("input", path, &[("--batch", args.batch, b), ("--seq", args.seq, t)])?;
            (shape.batch, shape.seq, shape.d_model) = (b, t, c);
            Some(x)
        }
        None => None,
    };
    shape.batch = args.batch.unwrap_or(shape.batch);
    shape.seq = args.seq.unwrap_or(shape.seq);
    if loaded.is_none() {
        shape.d_model = args.d_model.unwrap_or(shape.d_model);
        shape.ff = args.ff.unwrap_or(shape.ff);
        shape.n_head = args.heads.unwrap_or(shape.n_head);
    }
    shape.validate_as(args.input.as_deref())?;
    Ok(Resolved { device, info, preset, shape, weights: loaded, x: x_file })
}

impl Session {
    /// Resolve the flags, print what will run, and compute the reference with `reference`.
    pub fn open(args: RunArgs, reference: &dyn Stage) -> anyhow::Result<Session> {
        Self::open_for(args, reference, &[])
    }

    /// `open`, after refusing up front — before any weights are made or anything runs — every
    /// stage in `must_run` whose plan this device refuses (e.g. `--precision tf32` on a CPU),
    /// and a run whose memory cannot fit: the session's weights, x and reference, plus the
    /// widest of the reference and `must_run` stages. (The ladder passes none: a stage that
    /// cannot run there is a row.)
    pub fn open_for(args: RunArgs, reference: &dyn Stage, must_run: &[(&dyn Stage, PrecisionRequest)]) -> anyhow::Result<Session> {
        let Resolved { device, info, preset, shape, weights: loaded, x: x_file } = resolve(&args)?;
        let mut widest: u128 = 0;
        for (stage, asked) in must_run {
            plan(*stage, &device, &info, shape, *asked, args.precision, args.cuda_graph, args.train)?;
            stage.check_shape(&shape)?;
            widest = widest.max(stage.estimate_bytes(&shape));
        }
        if !args.no_check {
            // The reference runs in pieces along B (`reference_output`): one piece's shape.
            let piece = reference_piece(&shape, crate::preset::MAX_TENSOR_ELEMENTS)?;
            reference.check_shape(&piece)?;
            widest = widest.max(reference.estimate_bytes(&piece));
        }
        if let Some(avail) = device::available_bytes(&device) {
            let name = must_run.first().map_or(reference.name(), |(s, _)| s.name());
            // On a CPU the ceiling probe's buffers count too: it runs beside the session.
            if info.kind == DeviceKind::Cpu {
                widest = widest.max(crate::ceiling::probe_bytes(&shape));
            }
            check_fits(name, &shape, shape.estimate_session_bytes().saturating_add(widest), avail)?;
        }
        if args.cuda_graph {
            crate::graph::prepare(&device)?;
        }
        let (weights, weights_source) = match loaded {
            Some(w) => {
                (w, format!("{} (layer {})", args.weights.as_ref().unwrap().display(), args.layer.map_or("only".into(), |l| l.to_string())))
            }
            None => (BlockWeights::from_seed(&shape, args.seed)?, format!("seed {}", args.seed)),
        };
        if let Some(path) = &args.save_weights {
            weights.save_gpt2(path, args.layer.unwrap_or(0), shape.n_head)?;
        }
        let x = x_file.map_or_else(|| random_input(&shape, args.seed), Ok)?;
        let (warmup, iters) = match info.kind {
            DeviceKind::Cpu => (args.warmup.unwrap_or(2), args.iters.unwrap_or(10)),
            DeviceKind::Cuda => (args.warmup.unwrap_or(10), args.iters.unwrap_or(50)),
        };

        println!("device    {}", info.describe());
        println!(
            "shape     {}{} · {:.2} GFLOP per forward",
            if args.preset.is_some() { format!("{} ", preset.name()) } else { format!("{} (default) ", preset.name()) },
            shape,
            block_flops(&shape) / 1e9
        );
        println!(
            "data      weights: {weights_source} · input: {}",
            args.input.as_ref().map_or(format!("N(0,1), seed {}", args.seed), |p| p.display().to_string())
        );
        println!("timing    {warmup} warm-up + {iters} timed iterations, device synchronized after each");
        let ceiling = (info.kind == DeviceKind::Cpu).then(|| crate::ceiling::measure(&shape)).transpose()?;
        if let Some(c) = &ceiling {
            println!("ceiling   {} (measured now; % of peak is against it)", c.describe());
        }

        let x = x.to_device(&device)?;
        let upstream = args.train.then(|| crate::train::upstream(&x, args.seed)).transpose()?;
        let mut session = Session {
            device: device.clone(),
            info,
            shape,
            weights: weights.to_device(&device)?,
            weights_source,
            x,
            warmup,
            iters,
            reference: None,
            upstream,
            reference_grads: None,
            ceiling,
            args,
        };
        if !session.args.no_check {
            session.reference = Some(session.reference_output(reference, crate::preset::MAX_TENSOR_ELEMENTS)?);
            if session.args.train {
                session.reference_grads = Some(session.reference_gradients(reference)?);
            }
        } else {
            println!("check     skipped (--no-check): these timings vouch for nothing");
        }
        Ok(session)
    }

    /// The fp32 output of `reference` (stage 0) for the session's x, computed in pieces along B
    /// so that no piece's (b, n_head, T, T) scores pass `limit` elements (`check::
    /// reference_batch_chunk`; the runner passes 2^31 - 1, tests a small limit).
    pub fn reference_output(&self, reference: &dyn Stage, limit: usize) -> anyhow::Result<Tensor> {
        let piece = reference_piece(&self.shape, limit)?;
        reference.check_shape(&piece)?;
        if let Some(avail) = device::available_bytes(&self.device) {
            check_fits(reference.name(), &piece, reference.estimate_bytes(&piece), avail)?;
        }
        let fp32 = PrecisionRequest::Exactly(Precision::Fp32);
        let plan = plan(reference, &self.device, &self.info, self.shape, fp32, fp32, false, false)?;
        let stage = reference.build(&self.weights, &plan)?;
        Ok(crate::check::forward_in_pieces(&self.x, piece.batch, |x| {
            let y = stage.forward(x)?;
            self.device.synchronize()?; // one piece's working set freed before the next
            Ok(y)
        })?)
    }

    /// `--train`: stage 0's fp32 gradients of ⟨y, r⟩ for every weight and x, in pieces along B
    /// as `reference_output` computes y.
    fn reference_gradients(&self, reference: &dyn Stage) -> anyhow::Result<Vec<Tensor>> {
        let piece = reference_piece(&self.shape, crate::preset::MAX_TENSOR_ELEMENTS)?;
        let fp32 = PrecisionRequest::Exactly(Precision::Fp32);
        let plan = plan(reference, &self.device, &self.info, self.shape, fp32, fp32, false, true)?;
        let vars = crate::train::vars(&self.weights)?;
        let forward = reference.build_train(&crate::train::weights_of(&vars), &plan)?;
        let r = self.upstream.as_ref().expect("set with --train");
        Ok(crate::train::reference_gradients(forward.as_ref(), &vars, &self.x, r, piece.batch)?)
    }

    /// `y` against the reference (`None` with --no-check); a failed check is the error.
    fn check(&self, y: &Tensor, spec: &dyn Stage, plan: &Plan) -> anyhow::Result<Option<CheckResult>> {
        let Some(reference) = &self.reference else { return Ok(None) };
        let c = compare(y, reference, plan.precision)?;
        match c.to_error(spec.name(), plan.precision) {
            Some(e) => Err(e.into()),
            None => Ok(Some(c)),
        }
    }

    /// The forward's measurement: build, check against the reference, time.
    fn measure(&self, spec: &dyn Stage, plan: &Plan, iters: usize, probe: &mut MemProbe) -> anyhow::Result<Measured> {
        let stage = spec.build(&self.weights, plan)?;
        let stage = if self.args.cuda_graph { crate::graph::capture(spec.name(), stage, &self.x)? } else { stage };
        let switches = GemmSwitches::current();
        if switches != spec.switches(plan) {
            anyhow::bail!(
                "{}'s build left candle's GEMM switches at {switches:?}, not the {:?} it declares",
                spec.name(),
                spec.switches(plan)
            );
        }

        // Check before timing: nothing is timed until it matched the reference.
        let y = stage.forward(&self.x)?;
        self.device.synchronize()?;
        let (check, mut extra_checks) = (self.check(&y, spec, plan)?, Vec::new());
        if check.is_some() {
            // The stage's own check, on the same output; what it allocates is not the stage's memory.
            if let Some(c) = probe.exclude(|| stage.self_check(&self.x, &y))? {
                if !c.result.passed {
                    let (name, rel, tol, nan) = (&c.name, c.result.rel_err, c.result.tolerance, c.result.non_finite);
                    anyhow::bail!(SpeedkitError::CheckFailed(format!(
                        "{} failed its own check \"{name}\": relative error {rel:.3e} above {tol:.1e} ({nan} values NaN or infinite). \
                         {} Nothing was timed. Fix: report it with this command line.",
                        spec.name(),
                        c.meaning
                    )));
                }
                extra_checks.push(c);
            }
        }

        let device = &self.device;
        let stats = time_forward(spec.name(), device, self.warmup, iters, || stage.forward(&self.x))?;
        // After the uninstrumented timing, never mixed into it: the same forward with a clock
        // read at each part boundary.
        let breakdown = self.args.breakdown.then(|| crate::breakdown::record(device, self.warmup.min(1), iters, || stage.forward(&self.x)));
        Ok(Measured { y, stats, breakdown: breakdown.transpose()?, check, extra_checks, ran: stage.ran(), train: None })
    }

    /// `--train`'s measurement of a built plan: the gradient and update checks, then the timed steps.
    fn measure_train(&self, spec: &dyn Stage, plan: &Plan, iters: usize, probe: &mut MemProbe) -> anyhow::Result<Measured> {
        use crate::train::*;
        let vars = vars(&self.weights)?;
        let forward = spec.build_train(&weights_of(&vars), plan)?;
        let mut opt = spec.optimizer(vars.clone(), plan)?;
        let x = candle_core::Var::from_tensor(&self.x)?;
        let r = self.upstream.as_ref().expect("set with --train");
        let (y, grads) = step(forward.as_ref(), &x, r, opt.loss_scale())?;
        self.device.synchronize()?;
        let check = self.check(&y, spec, plan)?;
        let (mut grad_check, mut worst_grad, mut optimizer_check) = (None, String::new(), None);
        if let Some(ref_grads) = &self.reference_grads {
            let got = gradients(&grads, &vars, &x, opt.loss_scale())?;
            let (g, worst) = compare_grads(&got, ref_grads, plan.precision)?;
            if !g.passed {
                return Err(check_failed(spec.name(), &format!("gradient of {worst}"), &g, plan).into());
            }
            // The update from the reference's gradients, on copies: what it allocates is not the stage's.
            let make = |v: Vec<Var>| spec.optimizer(v, plan);
            let o = probe.exclude(|| check_optimizer(&make, &self.weights, ref_grads))?;
            if !o.passed {
                return Err(check_failed(spec.name(), "optimizer update", &o, plan).into());
            }
            (grad_check, worst_grad, optimizer_check) = (Some(g), worst, Some(o));
        }
        drop(grads);
        let (stats, optimizer_timing, parts, skipped_steps) =
            time_steps(forward.as_ref(), opt.as_mut(), &x, r, (self.warmup, iters, self.args.breakdown))?;
        let method = "instrumented: a synchronize after the forward and after the backward".to_string();
        let breakdown = parts.map(|p| crate::breakdown::summarise(&p, iters, method)).transpose()?;
        let train = TrainRecord { optimizer: opt.name(), optimizer_timing, grad_check, worst_grad, optimizer_check, skipped_steps };
        Ok(Measured { y, stats, breakdown, check, extra_checks: Vec::new(), ran: forward.ran(), train: Some(train) })
    }

    /// Plan, build, check and time one stage with `iters` timed iterations (the ladder's rounds
    /// take a share of `--iters` each). Errors of kind `Usage` mean "cannot run here";
    /// `CheckFailed` means it ran and is wrong.
    pub fn run_with(&self, spec: &dyn Stage, asked: PrecisionRequest, iters: usize) -> anyhow::Result<(Record, Tensor)> {
        let plan = plan(spec, &self.device, &self.info, self.shape, asked, self.args.precision, self.args.cuda_graph, self.args.train)?;
        spec.check_shape(&self.shape)?;
        if let Some(avail) = device::available_bytes(&self.device) {
            // A training step also holds what the forward saves for the backward, the gradients
            // and the optimizer's moments: about four forwards' worth.
            let need = spec.estimate_bytes(&self.shape) * if plan.train { 4 } else { 1 };
            check_fits(spec.name(), &self.shape, need, avail)?;
        }
        let mut probe = MemProbe::start(&self.device);
        let Measured { y, stats, breakdown, check, extra_checks, ran, train } =
            if plan.train { self.measure_train(spec, &plan, iters, &mut probe)? } else { self.measure(spec, &plan, iters, &mut probe)? };
        let (peak_mem_bytes, mem_method) = probe.finish();
        // A training step's FLOPs: the forward's, and twice them for the backward (dX and dW).
        let flops = block_flops(&self.shape) * if plan.train { 3.0 } else { 1.0 };

        let secs = stats.median_ms / 1e3;
        let tflops = flops / secs / 1e12;
        let implementation = spec.implementation(&plan);
        let emulated = implementation.as_deref().is_some_and(|i| i.starts_with(EMULATED));
        let (peak, peak_source) = match (self.args.peak_tflops, &self.ceiling) {
            _ if emulated => (None, None), // an emulation's speed is not the number format's: no % of its peak
            (Some(p), _) => (Some(p), Some("--peak-tflops")),
            (None, _) if self.info.is_cuda() => {
                let p = peak_tflops(&self.info.name, plan.precision);
                (p, p.map(|_| "datasheet"))
            }
            (None, Some(c)) => (Some(c.peak_tflops_for(plan.precision)), Some(MEASURED_PEAK)),
            (None, None) => (None, None),
        };
        let mut notes = spec.notes(&plan);
        notes.extend(ran);
        if self.args.cuda_graph {
            notes.push("timed as CUDA graph replays of one captured forward (--cuda-graph)".into());
        }
        if let Some(t) = &train {
            notes.push(format!(
                "a training step: forward, loss <y, r>, backward to every weight and x (timed, 3x the forward's FLOPs); \
                 then {} (timed apart, {:.3} ms median)",
                t.optimizer, t.optimizer_timing.median_ms
            ));
        }
        if emulated {
            notes.push(format!(
                "{} is emulated here: the time measures the emulation, not {} hardware (no % of peak)",
                plan.precision, plan.precision
            ));
        } else if peak.is_none() {
            notes.push(format!("no {} peak known for this device: pass --peak-tflops for % of peak", plan.precision));
        }
        let record = Record {
            schema: RECORD_SCHEMA.into(),
            stage: spec.name().into(),
            technique: spec.technique().into(),
            precision: plan.precision,
            precision_reason: plan.precision_reason.clone(),
            implementation,
            device: self.info.clone(),
            shape: self.shape,
            seed: self.args.seed,
            weights: self.weights_source.clone(),
            gemm_switches: GemmSwitches::current(),
            warmup: self.warmup,
            iters,
            tokens_per_s: self.shape.tokens() as f64 / secs,
            flops_per_forward: flops,
            tflops,
            peak_tflops: peak,
            pct_of_peak: peak.map(|p| 100.0 * tflops / p),
            peak_source: peak_source.map(String::from),
            gemm_backend: Some(if self.info.is_cuda() { "cuBLAS/cuBLASLt".into() } else { crate::ceiling::gemm_backend() }),
            simd: (!self.info.is_cuda()).then(|| crate::ceiling::simd_level().to_string()),
            ceiling: self.ceiling.clone(),
            timing: stats,
            check,
            extra_checks,
            peak_mem_bytes,
            mem_method: mem_method.into(),
            notes,
            breakdown,
            mode: if train.is_some() { Mode::Train } else { Mode::Forward },
            train,
            ..Default::default() // the speedups, set by the ladder
        };
        Ok((record, y))
    }
}

/// What one plan's measurement gives the record.
struct Measured {
    y: Tensor,
    stats: crate::timing::Stats,
    breakdown: Option<crate::breakdown::Breakdown>,
    check: Option<CheckResult>,
    extra_checks: Vec<crate::check::NamedCheck>,
    ran: Vec<String>,
    train: Option<crate::train::TrainRecord>,
}

/// `need` bytes against `avail` free, with 10 % headroom for the allocator and the runtime.
pub fn check_fits(stage: &str, s: &Shape, need: u128, avail: u64) -> Result<(), SpeedkitError> {
    if need <= avail as u128 * 9 / 10 {
        return Ok(());
    }
    let scores = 4 * (s.batch as u128 * s.n_head as u128).saturating_mul(s.seq as u128 * s.seq as u128);
    // Name the larger of the two usual culprits: the T × T scores or the weights (C and FF).
    let (c, ff) = (s.d_model as u128, s.ff as u128);
    let weights = c.saturating_mul(c).saturating_mul(16).saturating_add(c.saturating_mul(ff).saturating_mul(8));
    let why = if scores >= weights {
        format!("naive attention's (B, n_head, T, T) scores alone would be {} in f32", gib(scores))
    } else {
        format!("the block's weights alone are {} in f32", gib(weights))
    };
    Err(SpeedkitError::usage(format!(
        "{stage} needs about {} at its widest for {s} ({why}), but {} is available to this process (free memory, \
         or the address-space limit `ulimit -v` leaves). Fix: lower --batch or --seq (or --d-model / --ff, which size \
         the weights), or pick a smaller --preset.",
        gib(need),
        gib(avail as u128)
    )))
}

/// Print one record's details that do not fit the table.
pub fn print_details(r: &Record) {
    println!("precision {} ({}) — {}", r.precision, r.stage, r.precision_reason);
    if let Some(i) = &r.implementation {
        println!("runs      {i}");
    }
    println!("switches  {}", r.gemm_switches.describe());
    match &r.check {
        Some(c) => println!(
            "check     rel err {:.3e}, max abs {:.3e} vs fp32 reference (tolerance {:.0e}): passed",
            c.rel_err, c.max_abs_err, c.tolerance
        ),
        None => println!("check     skipped"),
    }
    for c in &r.extra_checks {
        println!("check     {}: rel err {:.3e} (tolerance {:.0e}): passed — {}", c.name, c.result.rel_err, c.result.tolerance, c.meaning);
    }
    println!(
        "speed     median {:.3} ms (p10 {:.3}, p90 {:.3}) · {:.0} tokens/s · {:.1} GFLOP/s",
        r.timing.median_ms,
        r.timing.p10_ms,
        r.timing.p90_ms,
        r.tokens_per_s,
        r.tflops * 1e3
    );
    for n in &r.notes {
        println!("note      {n}");
    }
    if let Some(t) = &r.train {
        if let (Some(g), Some(o)) = (&t.grad_check, &t.optimizer_check) {
            println!(
                "check     gradients: worst max|Δ|/max|ref| {:.3e} (d{}) vs stage 0's fp32 autograd (tolerance {:.0e}); update vs candle-nn AdamW {:.3e}: passed",
                g.rel_err, t.worst_grad, g.tolerance, o.rel_err
            );
        }
        println!("optimizer {}: median {:.3} ms per update ({} steps skipped)", t.optimizer, t.optimizer_timing.median_ms, t.skipped_steps);
    }
    if let Some(b) = &r.breakdown {
        print!("{}", crate::breakdown::text(b, r.timing.median_ms));
    }
}

/// The whole of a stage binary: `shared::runner::main(&[stage0_baseline::STAGE, ...,
/// this stage's STAGE])`. `stages` lists every stage up to this one: the first is the fp32
/// reference the output is checked against, the last is the stage that runs, and each adds the
/// flags it introduces (a later stage honours an earlier one's, as stage 4 runs stage 3's fusions).
pub fn main(stages: &[StageEntry]) -> ExitCode {
    let cmd = stages.iter().fold(RunArgs::augment_args(clap::Command::new("stage")), |c, e| (e.args)(c));
    if let Err(e) = crate::cli::check_env(&cmd) {
        return exit_with(|| Err(e.into()));
    }
    let matches = cmd.get_matches();
    exit_with(|| {
        let args = RunArgs::from_arg_matches(&matches)?;
        let (Some(first), Some(last)) = (stages.first(), stages.last()) else { anyhow::bail!("a stage binary names its stages") };
        let (reference, stage) = ((first.make)(&matches)?, (last.make)(&matches)?);
        // Every output path is checked before any work (writable, not a directory, no two on
        // one file, none an input), so a run never ends in a refusal to save it.
        let outputs = crate::output::check_all(&crate::cli::output_flags(&args))?;
        crate::output::check_not_inputs(&outputs, &crate::cli::input_flags(&args))?;
        let session = Session::open_for(args.clone(), reference.as_ref(), &[(stage.as_ref(), args.precision)])?;
        let (record, y) = session.run_with(stage.as_ref(), session.args.precision, session.iters)?;
        print_details(&record);
        println!();
        let rows = [Row::Ran(&record)];
        print!("{}{}", gemm_backends(&rows), table(grid(&rows, &[], record.device.is_cuda()), false));
        if let Some(path) = &session.args.save_output {
            save_tensors(path, &[("x", &session.x), ("y", &y)])?;
            println!("saved     x and y to {}", path.display());
        }
        if let Some(path) = &session.args.json {
            write_json(path, &record)?;
            println!("saved     JSON record to {}", path.display());
        }
        Ok(())
    })
}

#[cfg(test)]
#[path = "../tests/unit/runner.rs"]
mod tests;
