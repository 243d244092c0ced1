//! `ladder selftest`: each GPU building block alone, on small shapes, against its CPU twin — the first command
//! on a new GPU, and the JSON to send back (docs/gpu.md). On the CPU the same list runs through the CPU
//! stand-ins (CI runs it): a CPU pass says the logic is right, not that the GPU code works.
//! docs/gpu.md lists every block, what runs on CUDA and what on the CPU.
//!
//! The rows run stage by stage, then the breakdown and memory probe, and the CUDA graph captures
//! last, so a fault a capture leaves behind cannot fail a row after it.
//!
//! A row is "skipped" only when this device lacks the hardware feature it needs (FP8 tensor
//! cores below SM 8.9, as a stage's plan says); any error is a failure (exit 1).

use candle_core::{DType, Device, Tensor};
use serde::Serialize;
use shared::device::{DeviceInfo, MemProbe};
use shared::selftest::Check;
use std::time::Instant;

pub const SELFTEST_SCHEMA: &str = "candle-speedkit/selftest/1";

/// What a user attaches to a bug report.
#[derive(Debug, Serialize)]
pub struct SelftestReport {
    pub schema: &'static str,
    pub device: DeviceInfo,
    pub nvidia_driver: Option<String>,
    pub cuda_driver_version: Option<String>,
    pub commit: String,
    pub versions: std::collections::BTreeMap<String, String>,
    pub seconds: f64,
    pub passed: usize,
    pub failed: usize,
    pub skipped: usize,
    pub results: Vec<Check>,
}

/// Run every check on `device` (described by `info`).
pub fn run(device: &Device, info: &DeviceInfo) -> SelftestReport {
    let start = Instant::now();
    let mut r = shared::selftest::Rows { rows: Vec::new(), ran: if device.is_cuda() { "cuda".into() } else { String::new() } };
    for stage in crate::default_stages() {
        r.ran = if device.is_cuda() { "cuda".into() } else { String::new() };
        stage.selftest(device, info, &mut r);
    }
    breakdown(&mut r, device, info);
    memory(&mut r, device);
    // Graphs last: a capture that goes wrong can leave a sticky CUDA fault that fails every
    // later call, and here no row comes after them. Nothing else needs them first: a capture
    // needs every tensor it reads untracked by events, and `device::select` turned event
    // tracking off before the first tensor of the process existed, so every tensor made since
    // (the earlier rows' caches too: cuBLASLt handles, workspaces, loaded modules) is untracked.
    graphs(&mut r, device, info);
    let count = |s: &str| r.rows.iter().filter(|c| c.status == s).count();
    SelftestReport {
        schema: SELFTEST_SCHEMA,
        device: info.clone(),
        nvidia_driver: crate::provenance::nvidia_driver(info),
        cuda_driver_version: crate::provenance::cuda_driver_version(info),
        commit: shared::report::commit(),
        versions: crate::provenance::versions(),
        seconds: start.elapsed().as_secs_f64(),
        passed: count("pass"),
        failed: count("FAIL") + count("error"),
        skipped: count("skipped") + count("unsupported"), // neither ran its check; the row's status says which
        results: r.rows,
    }
}

fn graphs(r: &mut shared::selftest::Rows, device: &Device, info: &DeviceInfo) {
    r.ran = if device.is_cuda() { "cuda".into() } else { String::new() };
    if !device.is_cuda() {
        // The order of a capture's steps is a unit test of `shared::graph`; the replay needs a GPU.
        r.skip("CUDA graph", "capture + replay (every stage, tiny)".into(), "needs a GPU".into());
        return;
    }
    let shape = shared::Preset::Tiny.shape();
    for stage in crate::default_stages() {
        let case = format!("{} capture + replay (tiny)", stage.name());
        // The plan is where a stage says this device lacks what it needs (FP8 below SM 8.9): a
        // skip. Anything after it that errs is a failure.
        let asked = shared::stage::ladder_request(stage.as_ref(), shared::PrecisionRequest::Auto);
        match shared::stage::plan(stage.as_ref(), device, info, shape, asked, shared::PrecisionRequest::Auto, true, false) {
            Err(e) => r.skip("CUDA graph", case, e.to_string()),
            Ok(plan) => r.compare("CUDA graph", case, || {
                let weights = shared::BlockWeights::from_seed(&shape, 1)?.to_device(device)?;
                let x = shared::weights::random_input(&shape, 2)?.to_device(device)?;
                // The capture runs a warm-up and records the second call; its second replay is the
                // third, so a stage with state (delayed scaling) is compared at call 3.
                let plain = stage.build(&weights, &plan)?;
                for _ in 0..2 {
                    plain.forward(&x)?;
                }
                let want = plain.forward(&x)?;
                let graphed = shared::graph::capture(stage.name(), stage.build(&weights, &plan)?, &x)?;
                graphed.forward(&x)?;
                let replayed = graphed.forward(&x)?.copy()?; // the second replay

                // The same kernels on the same input; only a GEMM algorithm choice could differ.
                Ok((replayed, want, 1e-3))
            }),
        }
    }
    // Stage 4's scale update inside a graph (its flags' defaults, delayed scaling).
    stage4_fp8::selftest::graph_delayed_scaling(r, device, info, &stage4_fp8::Fp8::default());
}

/// `--breakdown`'s recorder on this device (CUDA events, or synchronize + clock): stage 0 at tiny, every part timed.
fn breakdown(r: &mut shared::selftest::Rows, device: &Device, info: &DeviceInfo) {
    r.ran = if device.is_cuda() { "cuda".into() } else { "cpu (synchronize + clock)".into() };
    let res = (|| -> anyhow::Result<String> {
        let shape = shared::Preset::Tiny.shape();
        let spec = stage0_baseline::Baseline;
        let fp32 = shared::PrecisionRequest::Exactly(shared::Precision::Fp32);
        let plan = shared::stage::plan(&spec, device, info, shape, fp32, fp32, false, false)?;
        let weights = shared::BlockWeights::from_seed(&shape, 1)?.to_device(device)?;
        let x = shared::weights::random_input(&shape, 2)?.to_device(device)?;
        let stage = shared::Stage::build(&spec, &weights, &plan)?;
        let b = shared::breakdown::record(device, 1, 2, || stage.forward(&x))?;
        check_breakdown(&b)?;
        Ok(format!("{} parts, {:.3} ms in all ({})", b.parts.len(), b.total_ms, b.method))
    })();
    r.outcome("breakdown", "records on this device (stage 0, tiny)".into(), res);
}

/// A stage 0–2 forward's breakdown: the block's parts in order, each time finite and not negative, a positive total.
fn check_breakdown(b: &shared::breakdown::Breakdown) -> anyhow::Result<()> {
    let names: Vec<&str> = b.parts.iter().map(|p| p.name.as_str()).collect();
    anyhow::ensure!(names == shared::breakdown::PARTS, "parts {names:?}, not the block's {:?}", shared::breakdown::PARTS);
    for p in &b.parts {
        anyhow::ensure!(p.samples_ms.iter().all(|t| t.is_finite() && *t >= 0.0), "part {} timed {:?}", p.name, p.samples_ms);
    }
    anyhow::ensure!(b.total_ms.is_finite() && b.total_ms > 0.0, "total {} ms", b.total_ms);
    Ok(())
}

fn memory(r: &mut shared::selftest::Rows, device: &Device) {
    r.ran = if device.is_cuda() { "cuda" } else { "cpu probe" }.into();
    const BYTES: u64 = 64 << 20;
    let res = (|| -> anyhow::Result<String> {
        let probe = MemProbe::start(device);
        // Allocated and freed before the end: only a high-water mark sees it.
        let t = Tensor::ones((BYTES / 4) as usize, DType::F32, device)?;
        device.synchronize()?;
        drop(t);
        device.synchronize()?;
        let (peak, method) = probe.finish();
        let peak = peak.ok_or_else(|| anyhow::anyhow!("the probe could not measure ({method})"))?;
        let mib = peak as f64 / (1u64 << 20) as f64;
        // 60 of 64 MiB: the CPU's RSS counts pages, and a few of them may already be resident.
        anyhow::ensure!(peak >= BYTES / 16 * 15, "a transient 64 MiB allocation showed as {mib:.1} MiB ({method})");
        Ok(format!("{mib:.1} MiB seen for 64 MiB ({method})"))
    })();
    r.outcome("memory probe", "transient 64 MiB allocation".into(), res);
}

/// The pass/fail table.
pub fn table(rep: &SelftestReport) -> String {
    let mut s = format!("selftest on {} (commit {})\n", rep.device.describe(), rep.commit);
    s += &format!("{:<18} {:<58} {:<8} {:>9} {:>8}  {}\n", "block", "case", "result", "rel err", "tol", "ran / detail");
    for c in &rep.results {
        let e = c.rel_err.map(|e| format!("{e:.2e}")).unwrap_or_default();
        let t = c.tolerance.map(|t| format!("{t:.0e}")).unwrap_or_default();
        let detail = if c.detail.is_empty() { c.ran.clone() } else { format!("{}: {}", c.ran, c.detail) };
        s += &format!("{:<18} {:<58} {:<8} {:>9} {:>8}  {}\n", c.block, c.case, c.status, e, t, detail);
    }
    s += &format!("{} passed, {} failed, {} skipped in {:.1} s\n", rep.passed, rep.failed, rep.skipped, rep.seconds);
    s
}

/// `ladder selftest` flags.
#[derive(clap::Args, Debug)]
pub struct SelftestArgs {
    /// auto, cpu, cuda or cuda:N
    #[arg(long, env = "SPEEDKIT_DEVICE", default_value = "auto")]
    pub device: String,
    /// Where to write the JSON to attach to a bug report.
    #[arg(long, default_value = "selftest.json")]
    pub json: std::path::PathBuf,
}

/// The subcommand: run, print the table, write the JSON; an error (exit 1) if anything failed.
pub fn command(args: &SelftestArgs) -> anyhow::Result<()> {
    let req: shared::device::DeviceRequest = args.device.parse().map_err(shared::SpeedkitError::usage)?;
    // Checked by the output policy before anything runs, so a run never ends in a refusal to save it.
    let out = shared::output::check("--json", &args.json)?;
    shared::cli::check_cpu_bf16(std::env::var_os("SPEEDKIT_CPU_BF16").as_deref())?; // the CPU blocks' bf16 kernel
    let (device, info) = shared::device::select(req)?;
    let rep = run(&device, &info);
    print!("{}", table(&rep));
    let mut bytes = serde_json::to_vec_pretty(&rep)?;
    bytes.push(b'\n');
    out.write(&bytes)?;
    println!("wrote {} — attach it to a bug report (docs/gpu.md)", args.json.display());
    // Exit 1: a building block is broken (a wrong result or an error), whatever its kind.
    if rep.failed > 0 {
        anyhow::bail!("selftest: {} of {} checks failed (see the table and {}).", rep.failed, rep.results.len(), args.json.display());
    }
    Ok(())
}

#[cfg(test)]
#[path = "../tests/unit/selftest.rs"]
mod tests;
