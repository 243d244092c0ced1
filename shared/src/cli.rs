//! Flags shared by every stage binary and the ladder. Each flag can also come from a
//! `SPEEDKIT_*` environment variable (the flag wins when both are given).

use crate::device::DeviceRequest;
use crate::error::{classify, SpeedkitError};
use crate::preset::Preset;
use crate::stage::{Precision, PrecisionRequest};
use clap::builder::TypedValueParser;
use clap::ValueEnum;
use cpu_kernels::elementwise::Elementwise;
use std::path::PathBuf;
use std::process::ExitCode;

impl std::str::FromStr for PrecisionRequest {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        if s.eq_ignore_ascii_case("auto") {
            return Ok(PrecisionRequest::Auto);
        }
        Precision::from_str(s, true)
            .map(PrecisionRequest::Exactly)
            .map_err(|_| format!("'{s}' is not a precision; use auto, fp32, tf32, bf16, f16 or fp8"))
    }
}

/// The flags every binary takes; each stage adds its own (`StageEntry::args`).
#[derive(clap::Args, Clone, Debug)]
pub struct RunArgs {
    /// auto (first GPU if this build has CUDA and one is present, else CPU), cpu, cuda or cuda:N
    #[arg(long, env = "SPEEDKIT_DEVICE", default_value = "auto")]
    pub device: DeviceRequest,
    /// Named shape [default: small on CPU, te on GPU]
    #[arg(long, env = "SPEEDKIT_PRESET", value_enum)]
    pub preset: Option<Preset>,
    /// B: sequences per forward (overrides the preset)
    #[arg(long, env = "SPEEDKIT_BATCH")]
    pub batch: Option<usize>,
    /// T: tokens per sequence (overrides the preset)
    #[arg(long, env = "SPEEDKIT_SEQ")]
    pub seq: Option<usize>,
    /// C: model width (overrides the preset)
    #[arg(long, env = "SPEEDKIT_D_MODEL")]
    pub d_model: Option<usize>,
    /// n_head: attention heads, must divide C (overrides the preset)
    #[arg(long, env = "SPEEDKIT_HEADS")]
    pub heads: Option<usize>,
    /// FF: MLP hidden width (overrides the preset)
    #[arg(long, env = "SPEEDKIT_FF")]
    pub ff: Option<usize>,
    /// auto (each stage's policy decides), fp32, tf32, bf16, f16 or fp8
    #[arg(long, env = "SPEEDKIT_PRECISION", default_value = "auto")]
    pub precision: PrecisionRequest,
    /// Untimed iterations before timing [default: 2 on CPU, 10 on GPU]
    #[arg(long, env = "SPEEDKIT_WARMUP")]
    pub warmup: Option<usize>,
    /// Timed iterations, at least 1 [default: 10 on CPU, 50 on GPU]
    #[arg(long, env = "SPEEDKIT_ITERS")]
    pub iters: Option<usize>,
    /// CPU element-wise work (LayerNorm, GELU, bias, residual, casts) of every stage: parallel (the engine's passes, multi-threaded and vectorised, one per op) or candle (candle's own ops, single-threaded), to measure what the engine buys
    #[arg(long, env = "SPEEDKIT_ELEMENTWISE", default_value = "parallel", value_parser = clap::builder::PossibleValuesParser::new(["parallel", "candle"]).map(|s| if s == "candle" { Elementwise::Candle } else { Elementwise::Parallel }))]
    pub elementwise: Elementwise,
    /// Seed for the weights and the input (same seed, same block, on every device)
    #[arg(long, env = "SPEEDKIT_SEED", default_value_t = 0)]
    pub seed: u64,
    /// Also write the measurements as JSON to this path
    #[arg(long, env = "SPEEDKIT_JSON")]
    pub json: Option<PathBuf>,
    /// Skip the check against the fp32 reference (the timing then vouches for nothing)
    #[arg(long, env = "SPEEDKIT_NO_CHECK", action = clap::ArgAction::SetTrue, value_parser = clap::builder::BoolishValueParser::new())]
    pub no_check: bool,
    /// Peak TFLOP/s to compute % of peak against (for devices not in the built-in table)
    #[arg(long, env = "SPEEDKIT_PEAK_TFLOPS")]
    pub peak_tflops: Option<f64>,
    /// Capture each stage's forward once as a CUDA graph and time its replays (GPU only)
    #[arg(long, env = "SPEEDKIT_CUDA_GRAPH", action = clap::ArgAction::SetTrue, value_parser = clap::builder::BoolishValueParser::new())]
    pub cuda_graph: bool,
    /// Read the block's weights from a safetensors file in GPT-2 naming (h.N.ln_1.weight, ...)
    #[arg(long, env = "SPEEDKIT_WEIGHTS")]
    pub weights: Option<PathBuf>,
    /// Which layer N of the --weights file to use (needed when it holds several)
    #[arg(long, env = "SPEEDKIT_LAYER")]
    pub layer: Option<usize>,
    /// Write the weights used as a GPT-2-named safetensors file (layer --layer, default 0)
    #[arg(long, env = "SPEEDKIT_SAVE_WEIGHTS")]
    pub save_weights: Option<PathBuf>,
    /// Read the input x (B, T, C) from a safetensors file (tensor "x"); sets B and T
    #[arg(long, env = "SPEEDKIT_INPUT")]
    pub input: Option<PathBuf>,
    /// Write x and the block's output as safetensors, to compare with another framework
    #[arg(long, env = "SPEEDKIT_SAVE_OUTPUT")]
    pub save_output: Option<PathBuf>,
    /// Also time the block's named parts (ln1, qkv, attention, ...) in an instrumented forward: a sync (CPU) or CUDA event (GPU) at each boundary
    #[arg(long, env = "SPEEDKIT_BREAKDOWN", action = clap::ArgAction::SetTrue, value_parser = clap::builder::BoolishValueParser::new())]
    pub breakdown: bool,
    /// Time a training step instead of a forward: forward, loss ⟨y, r⟩, backward to every weight and x (gradients checked against stage 0's autograd first), then the optimizer's update
    #[arg(long, env = "SPEEDKIT_TRAIN", action = clap::ArgAction::SetTrue, value_parser = clap::builder::BoolishValueParser::new())]
    pub train: bool,
    /// Memory bandwidth in GB/s for the roofline's memory ceiling (for devices not in the built-in table, e.g. a CPU's STREAM figure)
    #[arg(long, env = "SPEEDKIT_BANDWIDTH_GBS")]
    pub bandwidth_gbs: Option<f64>,
}

/// Run `body`; an error becomes a message on stderr and its exit code (`error::classify`).
/// Panics are not caught: they are bugs, and should look like bugs.
pub fn exit_with(body: impl FnOnce() -> anyhow::Result<()>) -> ExitCode {
    let Err(e) = body() else { return ExitCode::SUCCESS };
    let (code, msg) = classify(&e);
    eprintln!("error: {msg}");
    ExitCode::from(code)
}

/// Most timed (or warm-up) iterations: a million tiny forwards take minutes; more is a typo.
pub const MAX_ITERS: usize = 1_000_000;

/// `--peak-tflops`: 1 GFLOP/s (a slow CPU core) to 100 PFLOP/s; outside, % of peak is noise or overflow.
pub const PEAK_TFLOPS_RANGE: (f64, f64) = (1e-3, 1e5);

/// `--bandwidth-gbs`: 1 MB/s to 1 PB/s (an H200 has 4.8 TB/s).
pub const BANDWIDTH_GBS_RANGE: (f64, f64) = (1e-3, 1e6);

/// Check the environment before clap reads it: a `SPEEDKIT_*` variable set but empty (clap would
/// blame the flag, which the user never typed), and `RAYON_NUM_THREADS`.
pub fn check_env(cmd: &clap::Command) -> Result<(), SpeedkitError> {
    let args = cmd.get_arguments().chain(cmd.get_subcommands().flat_map(|c| c.get_arguments()));
    for (var, a) in args.filter_map(|a| Some((a.get_env()?.to_string_lossy(), a))) {
        let flag = a.get_long().map_or(a.get_id().to_string(), |l| format!("--{l}"));
        if std::env::var_os(&*var).is_some_and(|v| v.is_empty()) {
            return Err(SpeedkitError::usage(format!(
                "the environment variable {var} is set but empty; it stands for {flag}, and an empty value is no value. \
                 Fix: unset {var} (e.g. `unset {var}`), or give it a value."
            )));
        }
    }
    // Rayon starts every thread of its pool at once (candle's CPU ops and the GEMMs run on it):
    // 100,000 of them take minutes and measure nothing but the scheduler. At most 8 per core, and 64.
    // Parsed as rayon-core and candle parse it, untrimmed (`usize::from_str`): a value they would
    // ignore for one thread per core (" 1 ") is refused, not passed on as another count.
    let max = std::thread::available_parallelism().map_or(1, |n| n.get()).saturating_mul(8).max(64);
    if let Some(v) =
        std::env::var_os("RAYON_NUM_THREADS").filter(|v| v.to_str().and_then(|s| s.parse::<usize>().ok()).is_none_or(|n| n > max))
    {
        return Err(SpeedkitError::usage(format!(
            "RAYON_NUM_THREADS = {:?} is not a thread count from 0 (rayon's default: one per core) to {max} \
             (8 per core here; every thread of the pool is started at once). Fix: unset RAYON_NUM_THREADS, or give a count up to {max}.",
            v.to_string_lossy().chars().take(40).collect::<String>()
        )));
    }
    Ok(())
}

/// `SPEEDKIT_CPU_BF16` (environment only, read by `cpu_kernels::bf16_gemm::Kernel::detect`): one of
/// `REQUESTS`, ignoring ASCII case, and `mkl` only in a build with MKL; an unknown value would
/// silently mean auto.
pub fn check_cpu_bf16(value: Option<&std::ffi::OsStr>) -> Result<(), SpeedkitError> {
    use cpu_kernels::bf16_gemm::{Kernel, REQUESTS};
    let Some(value) = value else { return Ok(()) };
    let shown: String = value.to_string_lossy().chars().take(40).collect();
    let valid = REQUESTS.join(", ");
    let Some(v) = value.to_str().map(str::to_ascii_lowercase).filter(|v| REQUESTS.contains(&v.as_str())) else {
        return Err(SpeedkitError::usage(format!(
            "the environment variable SPEEDKIT_CPU_BF16 is {shown:?}, which is none of {valid} (case does not matter); it picks \
             the CPU's bf16 GEMM kernel, and an unknown value would quietly mean auto. Fix: unset SPEEDKIT_CPU_BF16 (auto), or \
             set it to one of {valid}, e.g. SPEEDKIT_CPU_BF16=off."
        )));
    };
    if v == "mkl" && !Kernel::Mkl.available() {
        return Err(SpeedkitError::usage(
            "the environment variable SPEEDKIT_CPU_BF16 is mkl, which asks for MKL's bf16 GEMM, but this build has no MKL, so \
             it would quietly mean auto. Fix: build with --features mkl (scripts/mkl.sh sets it up), or unset SPEEDKIT_CPU_BF16.",
        ));
    }
    Ok(())
}

/// Validate flags that clap cannot check by type, and `SPEEDKIT_CPU_BF16`.
pub fn validate(args: &RunArgs) -> Result<(), SpeedkitError> {
    check_cpu_bf16(std::env::var_os("SPEEDKIT_CPU_BF16").as_deref())?;
    for (flag, v, min) in [("--iters", args.iters, 1), ("--warmup", args.warmup, 0)] {
        if let Some(v) = v.filter(|v| !(min..=MAX_ITERS).contains(v)) {
            return Err(SpeedkitError::usage(format!(
                "{flag} is {v}, not from {min} to {MAX_ITERS}: a time needs one timed iteration, and more would run for hours \
                 holding a sample each. Fix: pass {flag} from {min} to {MAX_ITERS} (10 to 100 is plenty), or drop it."
            )));
        }
    }
    let peak = ("--peak-tflops", args.peak_tflops, PEAK_TFLOPS_RANGE, "a device peak in TFLOP/s", "989 for an H100 SXM at bf16");
    let bw = ("--bandwidth-gbs", args.bandwidth_gbs, BANDWIDTH_GBS_RANGE, "a memory bandwidth in GB/s", "20 for a laptop's STREAM triad");
    for (flag, v, (lo, hi), what, e_g) in [peak, bw] {
        if let Some(v) = v.filter(|v| !(v.is_finite() && (lo..=hi).contains(v))) {
            return Err(SpeedkitError::usage(format!(
                "{flag} {v:e} is not {what} (it must be a finite number from {lo} to {hi:e}). Fix: give the device's figure, e.g. {e_g}."
            )));
        }
    }
    let breakdown = "--breakdown times each part of a forward as it runs, and a CUDA graph replays the whole forward as one launch, \
                     so there is no part boundary to time";
    let train = "--cuda-graph replays one captured forward, and --train times forward, backward and the optimizer's update, \
                 whose gradients a replay of the forward alone does not make";
    for (on, flag, why) in [(args.breakdown, "--breakdown", breakdown), (args.train, "--train", train)] {
        if on && args.cuda_graph {
            return Err(SpeedkitError::usage(format!("{why}. Fix: drop one of {flag} and --cuda-graph.")));
        }
    }
    if args.layer.is_some() && args.weights.is_none() && args.save_weights.is_none() {
        return Err(SpeedkitError::usage("--layer picks a layer of --weights (or names the one --save-weights writes), but neither was given. Fix: add --weights PATH or drop --layer."));
    }
    Ok(())
}

/// The runner's output paths, by flag.
pub fn output_flags(args: &RunArgs) -> Vec<(&'static str, &std::path::Path)> {
    given([("--json", &args.json), ("--save-output", &args.save_output), ("--save-weights", &args.save_weights)])
}

/// The runner's input paths, by flag.
pub fn input_flags(args: &RunArgs) -> Vec<(&'static str, &std::path::Path)> {
    given([("--weights", &args.weights), ("--input", &args.input)])
}

fn given<'a, const N: usize>(flags: [(&'static str, &'a Option<PathBuf>); N]) -> Vec<(&'static str, &'a std::path::Path)> {
    flags.into_iter().filter_map(|(f, p)| p.as_deref().map(|p| (f, p))).collect()
}

#[cfg(test)]
#[path = "../tests/unit/cli.rs"]
mod tests;
