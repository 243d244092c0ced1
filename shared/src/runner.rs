//! The one path every stage binary and the ladder take: resolve the flags, compute the fp32
//! reference, then per stage plan, build, check, time and report.

use crate::ceiling::CpuCeiling;
use crate::check::{compare, CheckResult};
use crate::cli::{exit_with, validate, RunArgs};
use crate::device::{self, DeviceInfo, GemmSwitches, MemProbe};
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

/// What every stage of one run shares: device, f32 weights and input x (B, T, C) on it, and the
/// reference they are checked against.
pub struct Session {
    pub args: RunArgs,
    pub device: Device,
    pub info: DeviceInfo,
    pub shape: Shape,
    pub weights: BlockWeights,
    /// "seed 0" or "path (layer N)".
    pub weights_source: String,
    pub x: Tensor,
    pub warmup: usize,
    pub iters: usize,
    /// Stage 0's fp32 output for `x`, and with `--train` its gradients for (x, r), r the loss's
    /// upstream gradient; `None` with --no-check.
    pub reference: Option<Tensor>,
    pub upstream: Option<Tensor>,
    pub reference_grads: Option<Vec<Tensor>>,
    /// CPU: the GEMM rate and bandwidth measured when the session opens, for % of peak.
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

pub(crate) fn gib(b: u128) -> String {
    format!("{:.2} GiB", b as f64 / (1u64 << 30) as f64)
}

/// What the flags and files resolve to before anything runs (shared with `ladder report`).
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
    cpu_kernels::elementwise::set_mode(args.elementwise); // every stage and block from here on reads it
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
        (shape.d_model, shape.ff) = (c, ff);
        shape.n_head = args.heads.or(meta_heads).unwrap_or(if c.is_multiple_of(64) { c / 64 } else { shape.n_head });
        loaded = Some(w);
    }
    let mut x_file = None;
    if let Some(path) = &args.input {
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
        x_file = Some(x);
    }
    (shape.batch, shape.seq) = (args.batch.unwrap_or(shape.batch), args.seq.unwrap_or(shape.seq));
    if loaded.is_none() {
        shape.d_model = args.d_model.unwrap_or(shape.d_model);
        shape.ff = args.ff.unwrap_or(shape.ff);
        shape.n_head = args.heads.unwrap_or(shape.n_head);
    }
    shape.validate(args.input.as_deref())?;
    Ok(Resolved { device, info, preset, shape, weights: loaded, x: x_file })
}

impl Session {
    /// Resolve the flags, print what will run, and compute the reference with `reference`; first,
    /// before any work, refuse each `must_run` stage whose plan this device refuses and a run that
    /// cannot fit (the ladder passes none: a stage that cannot run there is a row).
    pub fn open(args: RunArgs, reference: &dyn Stage, must_run: &[(&dyn Stage, PrecisionRequest)]) -> anyhow::Result<Session> {
        let Resolved { device, info, preset, shape, weights: loaded, x: x_file } = resolve(&args)?;
        let (session_bytes, avail) = (shape.estimate_session_bytes(), device::available_bytes(&device));
        let mut widest: u128 = 0;
        for (stage, asked) in must_run {
            plan(*stage, &device, &info, shape, *asked, args.precision, args.cuda_graph, args.train)?;
            stage.check_shape(&shape)?;
            if args.train {
                let step = stage.estimate_train_bytes(&shape);
                check_fits(stage.name(), &shape, session_bytes.saturating_add(step.total()), Some(step), avail)?;
            }
            widest = widest.max(stage.estimate_bytes(&shape));
        }
        if !args.no_check {
            // The reference runs in pieces along B (`reference_output`): one piece's shape.
            let piece = reference_piece(&shape, crate::preset::MAX_TENSOR_ELEMENTS)?;
            reference.check_shape(&piece)?;
            widest = widest.max(reference.estimate_bytes(&piece));
            if args.train {
                // Its gradients run in pieces sized to the free memory then (`reference_gradients`): one sequence must fit.
                let step = reference.estimate_train_bytes(&Shape { batch: 1, ..shape });
                let who = format!("{} (the fp32 reference's gradients, one sequence at a time)", reference.name());
                check_fits(&who, &shape, session_bytes.saturating_add(step.total()), Some(step), avail)?;
            }
        }
        // On a CPU the ceiling probe's buffers count too: it runs beside the session.
        if !info.is_cuda() {
            widest = widest.max(crate::ceiling::probe_bytes(&shape));
        }
        let name = must_run.first().map_or(reference.name(), |(s, _)| s.name());
        check_fits(name, &shape, session_bytes.saturating_add(widest), None, avail)?;
        if args.cuda_graph {
            crate::graph::prepare(&device)?;
        }
        let layer = args.layer.map_or("only".into(), |l| l.to_string());
        let (weights, weights_source) = match (loaded, &args.weights) {
            (Some(w), Some(path)) => (w, format!("{} (layer {layer})", path.display())),
            _ => (BlockWeights::from_seed(&shape, args.seed)?, format!("seed {}", args.seed)),
        };
        if let Some(path) = &args.save_weights {
            weights.save_gpt2(path, args.layer.unwrap_or(0), shape.n_head)?;
        }
        let x = x_file.map_or_else(|| random_input(&shape, args.seed), Ok)?;
        let (w, i) = if info.is_cuda() { (10, 50) } else { (2, 10) };
        let (warmup, iters) = (args.warmup.unwrap_or(w), args.iters.unwrap_or(i));

        println!("device    {}", info.describe());
        let default = if args.preset.is_some() { "" } else { " (default)" };
        println!("shape     {}{default} {shape} · {:.2} GFLOP per forward", preset.name(), block_flops(&shape) / 1e9);
        let input = args.input.as_ref().map_or(format!("N(0,1), seed {}", args.seed), |p| p.display().to_string());
        println!("data      weights: {weights_source} · input: {input}");
        println!("timing    {warmup} warm-up + {iters} timed iterations, device synchronized after each");
        let ceiling = (!info.is_cuda()).then(|| crate::ceiling::measure(&shape)).transpose()?;
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
                let (chunk, grads) = session.reference_gradients(reference, device::available_bytes(&session.device))?;
                if chunk < shape.batch {
                    println!("check     reference gradients in pieces of {chunk} of the {} sequences (to fit free memory)", shape.batch);
                }
                session.reference_grads = Some(grads);
            }
        } else {
            println!("check     skipped (--no-check): these timings vouch for nothing");
        }
        Ok(session)
    }

    /// Stage 0's fp32 output for x, in pieces along B whose scores hold at most `limit` elements
    /// (`check::reference_batch_chunk`; tests pass a small limit).
    pub fn reference_output(&self, reference: &dyn Stage, limit: usize) -> anyhow::Result<Tensor> {
        let piece = reference_piece(&self.shape, limit)?; // open checked its shape and memory
        let fp32 = PrecisionRequest::Exactly(Precision::Fp32);
        let plan = plan(reference, &self.device, &self.info, self.shape, fp32, fp32, false, false)?;
        let stage = reference.build(&self.weights, &plan)?;
        Ok(crate::check::forward_in_pieces(&self.x, piece.batch, |x| {
            let y = stage.forward(x)?;
            self.device.synchronize()?; // one piece's working set freed before the next
            Ok(y)
        })?)
    }

    /// Stage 0's fp32 gradients of ⟨y, r⟩ for every weight and x (`--train`), in pieces along B:
    /// as many sequences at a time as `avail` free bytes hold by `reference`'s training-step
    /// estimate (rows of a batch are independent, so weight gradients sum over pieces and dx joins).
    /// Returns the piece's size, in sequences, and the gradients.
    pub fn reference_gradients(&self, reference: &dyn Stage, avail: Option<u64>) -> anyhow::Result<(usize, Vec<Tensor>)> {
        let fp32 = PrecisionRequest::Exactly(Precision::Fp32);
        let plan = plan(reference, &self.device, &self.info, self.shape, fp32, fp32, false, true)?;
        let r = self.upstream.as_ref().ok_or_else(|| anyhow::anyhow!("the reference gradients need --train's upstream r"))?;
        let vars = crate::train::vars(&self.weights)?;
        let forward = reference.build_train(&crate::train::weights_of(&vars), &plan)?;
        let limit = reference_piece(&self.shape, crate::preset::MAX_TENSOR_ELEMENTS)?.batch;
        let chunk = crate::train::piece_batch(&self.shape, limit, avail, |s| reference.estimate_train_bytes(s).total());
        Ok((chunk, crate::train::reference_gradients(forward.as_ref(), &vars, &self.x, r, chunk)?))
    }

    /// What `--save-output` writes beside x and the outputs in a `--train` run: the upstream
    /// gradient `r` (B, T, C) the loss ⟨y, r⟩ used, and stage 0's fp32 gradients that every stage
    /// was checked against as `grad_<name>` (`train::NAMES`, `BlockWeights`' layout: matrices
    /// (out, in), `grad_x` (B, T, C)). Empty for a forward run; `r` alone with --no-check.
    pub fn train_outputs(&self) -> Vec<(String, Tensor)> {
        let r = self.upstream.iter().map(|r| ("r".to_string(), r.clone()));
        let grads = self.reference_grads.iter().flat_map(|g| crate::train::NAMES.iter().zip(g));
        r.chain(grads.map(|(n, g)| (format!("grad_{n}"), g.clone()))).collect()
    }

    /// `y` against the reference (`None` with --no-check); a failed check is the error.
    fn check(&self, y: &Tensor, spec: &dyn Stage, plan: &Plan) -> anyhow::Result<Option<CheckResult>> {
        let c = self.reference.as_ref().map(|r| compare(y, r, plan.precision)).transpose()?;
        let failed = c.as_ref().and_then(|c| c.to_error(spec.name(), plan.precision));
        failed.map_or(Ok(c), |e| Err(e.into()))
    }

    /// Build, check against the reference, time.
    fn measure(&self, spec: &dyn Stage, plan: &Plan, iters: usize, probe: &mut MemProbe) -> anyhow::Result<Measured> {
        let (name, stage) = (spec.name(), spec.build(&self.weights, plan)?);
        let stage = if self.args.cuda_graph { crate::graph::capture(name, stage, &self.x)? } else { stage };
        let (switches, declared) = (GemmSwitches::current(), spec.switches(plan));
        if switches != declared {
            anyhow::bail!("{name}'s build left candle's GEMM switches at {switches:?}, not the {declared:?} it declares");
        }

        // Check before timing: nothing is timed until it matched the reference. The forward is
        // observed, and the row's notes say what it ran (`ran::notes`).
        let (y, mut observed) = crate::ran::observe(|| stage.forward(&self.x))?;
        self.device.synchronize()?;
        let (check, mut extra_checks) = (self.check(&y, spec, plan)?, Vec::new());
        if check.is_some() {
            // The stage's own check, on the same output; what it allocates is not the stage's memory.
            if let Some(c) = probe.exclude(|| stage.self_check(&self.x, &y))? {
                if !c.result.passed {
                    let (rel, tol, nan) = (c.result.rel_err, c.result.tolerance, c.result.non_finite);
                    anyhow::bail!(SpeedkitError::CheckFailed(format!(
                        "{name} failed its own check \"{}\": relative error {rel:.3e} above {tol:.1e} ({nan} values NaN or infinite). \
                         {} Nothing was timed. Fix: report it with this command line.",
                        c.name, c.meaning
                    )));
                }
                extra_checks.push(c);
            }
        }

        if !stage.steady() {
            // The first forward took a path later ones do not (stage 4's, before a delayed scale
            // exists): the notes describe the next one, the path that is timed.
            observed = crate::ran::observe(|| stage.forward(&self.x))?.1;
        }
        let ran = crate::ran::notes(&observed).into_iter().chain(stage.ran()).collect();
        let device = &self.device;
        let stats = time_forward(name, device, self.warmup, iters, || stage.forward(&self.x))?;
        // After the uninstrumented timing, never mixed into it: the same forward with a clock
        // read at each part boundary.
        let breakdown = self.args.breakdown.then(|| crate::breakdown::record(device, self.warmup.min(1), iters, || stage.forward(&self.x)));
        Ok((y, ran, Record { timing: stats, breakdown: breakdown.transpose()?, check, extra_checks, ..Default::default() }))
    }

    /// `measure` for `--train`: the gradient and update checks, then the timed steps.
    fn measure_train(&self, spec: &dyn Stage, plan: &Plan, iters: usize, probe: &mut MemProbe) -> anyhow::Result<Measured> {
        use crate::train::*;
        let vars = vars(&self.weights)?;
        let forward = spec.build_train(&weights_of(&vars), plan)?;
        let mut opt = spec.optimizer(vars.clone(), plan)?;
        let x = candle_core::Var::from_tensor(&self.x)?;
        let r = self.upstream.as_ref().expect("set with --train");
        // The checked step's forward is observed (its backward is not): the row's notes say what
        // the training forward ran, its activations' dtypes included (`ran::notes`).
        let observed = FirstObserved { inner: forward.as_ref(), parts: std::cell::RefCell::new(None) };
        let (y, got) = accepted_step(&observed, opt.as_mut(), &vars, &x, r)?;
        let observed = crate::ran::notes(&observed.parts.take().unwrap_or_default());
        self.device.synchronize()?;
        let check = self.check(&y, spec, plan)?;
        let (mut grad_check, mut worst_grad, mut optimizer_check) = (None, String::new(), None);
        if let Some(ref_grads) = &self.reference_grads {
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
        drop(got);
        let total = crate::train::total_steps(self.warmup, iters, self.args.breakdown);
        let mut progress = crate::timing::Progress::new(spec.name(), "training steps", total);
        let (stats, optimizer_timing, parts, skipped_steps) =
            time_steps(forward.as_ref(), opt.as_mut(), &x, r, (self.warmup, iters, self.args.breakdown), &mut progress)?;
        let breakdown = parts.map(|p| p.summarise(iters)).transpose()?;
        let train = TrainRecord { optimizer: opt.name(), optimizer_timing, grad_check, worst_grad, optimizer_check, skipped_steps };
        let ran = observed.into_iter().chain(forward.ran()).collect();
        // Detached: the checked step's y records its forward, and the ladder keeps each stage's
        // y for --save-output while the next stages run (on a GPU at `te`, stage 0's forward held
        // that way left too little memory for stage 1's step).
        Ok((y.detach(), ran, Record { timing: stats, breakdown, check, mode: Mode::Train, train: Some(train), ..Default::default() }))
    }

    /// Plan, build, check and time one stage over `iters` (a ladder round's share of `--iters`).
    /// A `Usage` error means "cannot run here"; `CheckFailed`, it ran and is wrong.
    pub fn run_with(&self, spec: &dyn Stage, asked: PrecisionRequest, iters: usize) -> anyhow::Result<(Record, Tensor)> {
        let plan = plan(spec, &self.device, &self.info, self.shape, asked, self.args.precision, self.args.cuda_graph, self.args.train)?;
        spec.check_shape(&self.shape)?;
        // A training step also holds what the forward saves for the backward, the gradients and
        // the optimizer's moments (`Stage::estimate_train_bytes`).
        let step = plan.train.then(|| spec.estimate_train_bytes(&self.shape));
        let need = step.map_or_else(|| spec.estimate_bytes(&self.shape), |t| t.total());
        check_fits(spec.name(), &self.shape, need, step, device::available_bytes(&self.device))?;
        let mut probe = MemProbe::start(&self.device);
        let (y, ran, measured) =
            if plan.train { self.measure_train(spec, &plan, iters, &mut probe)? } else { self.measure(spec, &plan, iters, &mut probe)? };
        let (peak_mem_bytes, mem_method) = probe.finish();
        // A training step's FLOPs: the forward's, and twice them for the backward (dX and dW).
        let flops = block_flops(&self.shape) * if plan.train { 3.0 } else { 1.0 };

        let secs = measured.timing.median_ms / 1e3;
        let tflops = flops / secs / 1e12;
        let implementation = spec.implementation(&plan);
        let emulated = implementation.as_deref().is_some_and(|i| i.starts_with(EMULATED));
        let p = plan.precision;
        let (peak, peak_source) = match (self.args.peak_tflops, &self.ceiling) {
            _ if emulated => (None, None), // an emulation's speed is not the number format's: no % of its peak
            (Some(v), _) => (Some(v), Some("--peak-tflops")),
            (None, _) if self.info.is_cuda() => peak_tflops(&self.info.name, p).map_or((None, None), |v| (Some(v), Some("datasheet"))),
            (None, Some(c)) => (Some(c.peak_tflops_for(p)), Some(MEASURED_PEAK)),
            (None, None) => (None, None),
        };
        let mut notes = spec.notes(&plan);
        notes.extend(ran);
        if self.args.cuda_graph {
            notes.push("timed as CUDA graph replays of one captured forward (--cuda-graph)".into());
        }
        if let Some(t) = &measured.train {
            notes.push(format!(
                "a training step: forward, loss <y, r>, backward to every weight and x (timed, 3x the forward's FLOPs); \
                 then {} (timed apart, {:.3} ms median)",
                t.optimizer, t.optimizer_timing.median_ms
            ));
        }
        if emulated {
            notes.push(format!("{p} is emulated here: the time measures the emulation, not {p} hardware (no % of peak)"));
        } else if peak.is_none() {
            notes.push(format!("no {p} peak known for this device: pass --peak-tflops for % of peak"));
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
            peak_mem_bytes,
            mem_method: mem_method.into(),
            notes,
            ..measured // timing, checks, breakdown, mode and train; the speedups are the ladder's
        };
        Ok((record, y))
    }
}

/// A forward whose first call is observed (`ran::observe`), later ones run as they are.
struct FirstObserved<'a> {
    inner: &'a dyn crate::stage::Forward,
    parts: std::cell::RefCell<Option<Vec<crate::ran::RanPart>>>,
}

impl crate::stage::Forward for FirstObserved<'_> {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        if self.parts.borrow().is_some() {
            return self.inner.forward(x);
        }
        let (y, parts) = crate::ran::observe(|| self.inner.forward(x))?;
        *self.parts.borrow_mut() = Some(parts);
        Ok(y)
    }

    fn train_forward(&self, x: &Tensor) -> Option<candle_core::Result<Box<dyn crate::stage::TrainPass>>> {
        if self.parts.borrow().is_some() {
            return self.inner.train_forward(x);
        }
        let observed = crate::ran::observe(|| self.inner.train_forward(x).transpose());
        match observed {
            Err(e) => Some(Err(e)),
            Ok((None, _)) => None, // the tape's forward comes next, and is observed by `forward`
            Ok((Some(pass), parts)) => {
                *self.parts.borrow_mut() = Some(parts);
                Some(Ok(pass))
            }
        }
    }
}

/// y, what the forwards `ran`, and the record's measured fields (timing, checks, breakdown, train).
type Measured = (Tensor, Vec<String>, Record);

/// `need` bytes against `avail` free (if known), with 10 % headroom for the allocator and the runtime.
/// `train`: a training step's parts, named in the refusal (largest first).
pub fn check_fits(
    stage: &str,
    s: &Shape,
    need: u128,
    train: Option<crate::train::TrainBytes>,
    avail: Option<u64>,
) -> Result<(), SpeedkitError> {
    let Some(avail) = avail.filter(|&a| need > a as u128 * 9 / 10) else { return Ok(()) };
    let scores = 4 * (s.batch as u128 * s.n_head as u128).saturating_mul(s.seq as u128 * s.seq as u128);
    // Name the larger of the two usual culprits: the T × T scores or the weights (C and FF).
    let (c, ff) = (s.d_model as u128, s.ff as u128);
    let weights = c.saturating_mul(c).saturating_mul(16).saturating_add(c.saturating_mul(ff).saturating_mul(8));
    let why = match train {
        Some(t) => format!("a training step (--train): {}", t.describe()),
        None if scores >= weights => format!("naive attention's (B, n_head, T, T) scores alone would be {} in f32", gib(scores)),
        None => format!("the block's weights alone are {} in f32", gib(weights)),
    };
    let drop_train = if train.is_some() { ", or drop --train" } else { "" };
    Err(SpeedkitError::usage(format!(
        "{stage} needs about {} at its widest for {s} ({why}), but {} is available to this process (free memory, \
         or the address-space limit `ulimit -v` leaves). Fix: lower --batch or --seq (or --d-model / --ff, which size \
         the weights), or pick a smaller --preset{drop_train}.",
        gib(need),
        gib(avail as u128)
    )))
}

/// Print one record's details that do not fit the table.
pub fn print_details(r: &Record) {
    println!("precision {} ({}) — {}", r.precision, r.stage, r.precision_reason);
    println!("switches  {}", r.gemm_switches.describe());
    let passed = |c: &CheckResult| {
        format!("rel err {:.3e}, max abs {:.3e} vs fp32 reference (tolerance {:.0e}): passed", c.rel_err, c.max_abs_err, c.tolerance)
    };
    let check = r.check.as_ref().map_or("skipped".into(), passed);
    println!("check     {check}");
    for c in &r.extra_checks {
        println!("check     {}: rel err {:.3e} (tolerance {:.0e}): passed — {}", c.name, c.result.rel_err, c.result.tolerance, c.meaning);
    }
    println!("speed     {:.0} tokens/s · {:.1} GFLOP/s (median and p10-p90 in the table below)", r.tokens_per_s, r.tflops * 1e3);
    for n in &r.notes {
        println!("note      {n}");
    }
    if let Some(t) = &r.train {
        if let (Some(g), Some(o)) = (&t.grad_check, &t.optimizer_check) {
            println!(
                "check     gradients: worst max|Δ|/max|ref| {:.3e} (d{}; max|Δ| {:.3e} over all) vs stage 0's fp32 autograd (tolerance {:.0e}); update vs candle-nn AdamW {:.3e}: passed",
                g.max_norm_ratio, t.worst_grad, g.max_abs_err, g.tolerance, o.max_norm_ratio
            );
        }
        println!("optimizer {}: median {:.3} ms per update ({} steps skipped)", t.optimizer, t.optimizer_timing.median_ms, t.skipped_steps);
    }
    if let Some(b) = &r.breakdown {
        print!("{}", crate::breakdown::text(b, r.timing.median_ms));
    }
}

/// The whole of a stage binary. `stages` lists every stage up to this one: the first is the fp32
/// reference, the last runs, and each adds its flags (stage 4 honours stage 3's fusions).
pub fn main(stages: &[StageEntry]) -> ExitCode {
    crate::device::keep_freed_memory(); // no mmap, page faults and munmap per large tensor
    crate::output::clean_up_on_signals(); // a signal mid-write leaves no temp file
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
        let session = Session::open(args.clone(), reference.as_ref(), &[(stage.as_ref(), args.precision)])?;
        let (record, y) = session.run_with(stage.as_ref(), session.args.precision, session.iters)?;
        print_details(&record);
        println!();
        let rows = [Row::Ran(&record)];
        print!("{}{}", gemm_backends(&rows), table(grid(&rows, &[], record.device.is_cuda()), false));
        if let Some(path) = &session.args.save_output {
            let train = session.train_outputs();
            let named: Vec<_> = [("x", &session.x), ("y", &y)].into_iter().chain(train.iter().map(|(n, t)| (n.as_str(), t))).collect();
            save_tensors(path, &named)?;
            let and = if train.is_empty() { "" } else { ", the upstream gradient r and the reference gradients" };
            println!("saved     x and y{and} to {}", path.display());
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
