//! `cargo run --release -p lift [-- --iters N] [--json PATH]`: the same model, the same weights and the same
//! tokens through candle-nn's ops, through the lifted ones, and through those with the MLP in
//! FP8 (stage 4's `Fp8Linear`, emulated on the CPU); checks the logits agree, runs one training
//! step through the lifted ops with its gradients checked against candle-nn's, then times the
//! forwards; `--json` also writes the checks and the timings, with the CPU they ran on, to PATH.
//! Plain `std::env` arguments: the lift needs no harness.

use candle_core::{Device, Tensor};
use candle_nn::VarBuilder;
use lift::{
    grad_errors, random_tokens, random_weights, relative_error, Config, Gpt, Ops, Trainable, FP8_TOLERANCE, GRAD_TOLERANCE, TOLERANCE,
};
use std::time::Instant;

const B: usize = 2;
const WARMUP: usize = 2;

fn main() -> candle_core::Result<()> {
    check_rayon_threads();
    let Args { iters, json } = args();
    let (cfg, device) = (Config::small(), Device::Cpu);
    let t = cfg.block_size;
    let weights = random_weights(&cfg, 0x5EED, &device)?;
    let vb = VarBuilder::from_tensors(weights.clone(), candle_core::DType::F32, &device);
    let mut model = Gpt::load(&cfg, vb)?;
    let idx = random_tokens(&cfg, (B, t), 0x70CE5, &device)?; // (B, T)
    println!(
        "lift: GPT-2-style model, {} layers, B={B} T={t} C={} n_head={} vocab={}, fp32, CPU ({} threads)",
        cfg.n_layer,
        cfg.n_embd,
        cfg.n_head,
        cfg.vocab,
        candle_core::utils::get_num_threads()
    );

    // Check before timing: the lifted model must give candle-nn's logits.
    let y_candle = model.forward(&idx, Ops::Candle)?;
    let err = relative_error(&model.forward(&idx, Ops::Lifted)?, &y_candle)?;
    println!("check: ||y_lifted - y_candle|| / ||y_candle|| = {err:.1e} (tolerance {TOLERANCE:.0e})");
    let fp32_err = err;
    if err.is_nan() || err > TOLERANCE {
        eprintln!(
            "lift: the lifted model's logits differ from candle-nn's by {err:.1e} relative, above the fp32 tolerance \
             {TOLERANCE:.0e}. Both run the same weights on the same tokens and differ only in summation order, which \
             moves the logits by ~1e-6, so this is a real difference in what one op computes: a dropped bias, a \
             LayerNorm ε other than the model's, a mask or scale that differs, or a changed op layout. Nothing \
             was timed. Fix: run `cargo test --release -p lift` and compare the op that changed with its candle-nn \
             line in examples/lift/src/lib.rs (`impl Ops`)."
        );
        std::process::exit(1);
    }
    // Stage 4's FP8 linears in the MLP: W quantised once here; E4M3's 3 mantissa bits cost accuracy.
    model.quantize_mlp().map_err(|e| candle_core::Error::Msg(e.to_string()))?;
    let err = relative_error(&model.forward(&idx, Ops::LiftedFp8)?, &y_candle)?;
    println!(
        "check: ||y_fp8 - y_candle|| / ||y_candle|| = {err:.1e} (tolerance {FP8_TOLERANCE:.0e}; MLP linears in E4M3, emulated on the CPU)"
    );
    if err.is_nan() || err > FP8_TOLERANCE {
        eprintln!(
            "lift: with the MLP's linears in FP8 the logits differ from candle-nn's by {err:.1e} relative, above \
             {FP8_TOLERANCE:.0e}, stage 4's tolerance for E4M3. Nothing was timed. Fix: run `cargo test --release -p \
             lift` and `cargo test --release -p stage4_fp8`, and compare `fp8_linear` in examples/lift/src/lib.rs with \
             stage 4's Fp8Linear."
        );
        std::process::exit(1);
    }
    let fp8_err = err;
    let grad_err = train_step(&cfg, weights, &idx)?;

    // Warm-up, then the versions interleaved so drift (clock, other load) hits all alike.
    let mut times = [Vec::new(), Vec::new(), Vec::new()];
    for i in 0..WARMUP + iters {
        for (k, ops) in [Ops::Candle, Ops::Lifted, Ops::LiftedFp8].into_iter().enumerate() {
            let start = Instant::now();
            let y: Tensor = model.forward(&idx, ops)?; // the CPU ops run eagerly: done when it returns
            let ms = start.elapsed().as_secs_f64() * 1e3;
            drop(y);
            if i >= WARMUP {
                times[k].push(ms);
            }
        }
    }
    let stats = |v: &mut Vec<f64>| {
        v.sort_by(f64::total_cmp);
        (v[v.len() / 2], v[0], v[v.len() - 1])
    };
    let (candle, lifted, fp8) = (stats(&mut times[0]), stats(&mut times[1]), stats(&mut times[2]));
    for (name, (median, min, max)) in [("candle-nn ops", candle), ("lifted ops", lifted), ("lifted + FP8", fp8)] {
        println!("{name:<14} median {median:7.2} ms  (min {min:.2}, max {max:.2}; {iters} iters after {WARMUP} warm-up)");
    }
    println!("speedup {:.2}x (median candle-nn / median lifted)", candle.0 / lifted.0);
    println!("FP8 is emulated on the CPU (quantise, dequantise, f32 GEMM): its row shows FP8's numerics, not an FP8 speed");
    if let Some(path) = json {
        let timing = |(median, min, max): (f64, f64, f64)| format!("{{\"median_ms\": {median}, \"min_ms\": {min}, \"max_ms\": {max}}}");
        let (cpu, flags) = cpu();
        let text = format!(
            "{{\n  \"schema\": \"lift-1\",\n  \"model\": {{\"n_layer\": {}, \"n_embd\": {}, \"n_head\": {}, \"vocab\": {}, \"batch\": {B}, \"seq\": {t}, \"dtype\": \"f32\"}},\n  \
             \"cpu\": {},\n  \"cpu_flags\": [{}],\n  \"threads\": {},\n  \"iters\": {iters},\n  \"warmup\": {WARMUP},\n  \
             \"check\": {{\"fp32_rel_err\": {fp32_err}, \"fp8_rel_err\": {fp8_err}, \"train_worst_grad_rel_err\": {grad_err}}},\n  \
             \"forward\": {{\"candle_nn\": {}, \"lifted\": {}, \"lifted_fp8_emulated\": {}}},\n  \"speedup\": {}\n}}\n",
            cfg.n_layer,
            cfg.n_embd,
            cfg.n_head,
            cfg.vocab,
            json_string(&cpu),
            flags.iter().map(|f| json_string(f)).collect::<Vec<_>>().join(", "),
            candle_core::utils::get_num_threads(),
            timing(candle),
            timing(lifted),
            timing(fp8),
            candle.0 / lifted.0
        );
        if let Err(e) = std::fs::write(&path, text) {
            eprintln!(
                "lift: could not write the JSON to {}: {e}. Fix: give --json a path in a folder that exists and that you can write.",
                path.display()
            );
            std::process::exit(1);
        }
        println!("saved     JSON to {}", path.display());
    }
    Ok(())
}

/// `s` as a JSON string: quotes, backslashes and control characters escaped (Rust's `{:?}` is
/// not JSON for every string).
fn json_string(s: &str) -> String {
    let mut out = String::from('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            c if (c as u32) < 0x20 => out.push_str(&format!("\\u{:04x}", c as u32)),
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

/// The CPU's model name and the flags that decide its kernels (from /proc/cpuinfo; empty where
/// there is none).
fn cpu() -> (String, Vec<String>) {
    let info = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let field = |key: &str| info.lines().find(|l| l.starts_with(key)).and_then(|l| l.split_once(':')).map(|(_, v)| v.trim().to_string());
    let have = field("flags").unwrap_or_default();
    let flags = ["avx2", "fma", "avx512f", "avx512_bf16", "amx_bf16"]
        .iter()
        .filter(|f| have.split_whitespace().any(|h| h == **f))
        .map(|f| f.to_string())
        .collect();
    (field("model name").unwrap_or_else(|| std::env::consts::ARCH.to_string()), flags)
}

/// One training step: next-token cross-entropy, the gradients of every parameter through the
/// lifted ops checked against candle-nn's, then an AdamW step with them and the loss after it.
/// Returns the worst gradient's relative error.
fn train_step(cfg: &Config, weights: std::collections::HashMap<String, Tensor>, idx: &Tensor) -> candle_core::Result<f64> {
    use candle_nn::Optimizer;
    let device = idx.device();
    let train = Trainable::new(cfg, weights, device)?;
    let targets = random_tokens(cfg, idx.dims2()?, 0x7A76E7, device)?; // (B, T): any fixed tokens will do
    let (loss, store_candle) = train.backward(idx, &targets, Ops::Candle)?;
    let (loss_lifted, store) = train.backward(idx, &targets, Ops::Lifted)?;
    let errs = grad_errors(&train.grads(&store)?, &train.grads(&store_candle)?)?;
    let (worst, worst_err) = errs.iter().fold(("", 0f64), |w, (n, e)| if e.is_nan() || *e > w.1 { (n.as_str(), *e) } else { w });
    println!(
        "train: loss {loss:.4} (candle-nn) {loss_lifted:.4} (lifted); {} gradients, worst ||g_lifted - g_candle|| / ||g_candle|| = {worst_err:.1e} ({worst}; tolerance {GRAD_TOLERANCE:.0e})",
        errs.len()
    );
    if worst_err.is_nan() || worst_err > GRAD_TOLERANCE {
        for (name, e) in errs.iter().filter(|(_, e)| e.is_nan() || *e > GRAD_TOLERANCE) {
            eprintln!("  {name}: {e:.1e}");
        }
        eprintln!(
            "lift: one training step's gradient of {worst} through the lifted ops differs from candle-nn's by \
             {worst_err:.1e} relative, above {GRAD_TOLERANCE:.0e}. The forwards agreed, so one op's backward computes \
             something else. Fix: run `cargo test --release -p lift` and `cargo test --release -p stage3_fused` (the \
             backward tests), and compare that parameter's op with its candle-nn line in examples/lift/src/lib.rs."
        );
        std::process::exit(1);
    }
    let mut opt = candle_nn::AdamW::new_lr(train.varmap.all_vars(), 1e-3)?;
    opt.step(&store)?; // the lifted ops' gradients
    let after = train.loss(idx, &targets, Ops::Lifted)?.to_scalar::<f32>()?;
    println!("train: one AdamW step (lr 1e-3) with the lifted gradients: loss {loss_lifted:.4} -> {after:.4}");
    Ok(worst_err)
}

struct Args {
    iters: usize,
    json: Option<std::path::PathBuf>,
}

/// `--iters N` (default 10) and `--json PATH`; anything else is refused with a sentence, and a
/// JSON path whose folder does not exist (or that is a folder) before any work.
fn args() -> Args {
    let mut out = Args { iters: 10, json: None };
    let args: Vec<String> = std::env::args().skip(1).collect();
    let mut it = args.iter();
    while let Some(flag) = it.next() {
        let Some(value) = it.next() else { usage(&format!("{flag} needs a value")) };
        match flag.as_str() {
            "--iters" => match value.parse::<usize>() {
                Ok(n) if n > 0 => out.iters = n,
                _ => usage(&format!("--iters takes a positive whole number, got {value:?}")),
            },
            "--json" => {
                let path = std::path::PathBuf::from(value);
                let dir = path.parent().filter(|d| !d.as_os_str().is_empty()).unwrap_or(std::path::Path::new("."));
                if path.is_dir() || !dir.is_dir() {
                    usage(&format!("--json {value:?} is a folder, or its folder does not exist; give a file path in an existing folder"))
                }
                out.json = Some(path);
            }
            _ => usage(&format!("unknown argument {flag:?}")),
        }
    }
    out
}

/// Refuse a `RAYON_NUM_THREADS` the pool cannot start (or would ignore) before candle starts it.
/// Rayon starts every thread at once, and a pool of 100,000 fails inside candle's first op:
/// at most 8 per core, and 64. Parsed as rayon-core and candle parse it, untrimmed
/// (`usize::from_str`), so a value they would ignore for one thread per core (" 1 ") is refused
/// rather than run with another count than it says.
fn check_rayon_threads() {
    let max = std::thread::available_parallelism().map_or(1, |n| n.get()).saturating_mul(8).max(64);
    let Some(v) = std::env::var_os("RAYON_NUM_THREADS") else { return };
    if v.to_str().and_then(|s| s.parse::<usize>().ok()).is_none_or(|n| n > max) {
        let shown: String = v.to_string_lossy().chars().take(40).collect();
        eprintln!(
            "lift: RAYON_NUM_THREADS = {shown:?} is not a thread count from 0 (rayon's default: one per core) to {max} \
             (8 per core here; every thread of the pool is started at once). Fix: unset RAYON_NUM_THREADS, or give a \
             count up to {max}, with no spaces."
        );
        std::process::exit(2);
    }
}

fn usage(why: &str) -> ! {
    eprintln!("lift: {why}. Usage: cargo run --release -p lift [-- --iters N] [--json PATH] (the shapes are Config::small in examples/lift/src/lib.rs).");
    std::process::exit(2);
}

#[cfg(test)]
mod tests {
    #[test]
    fn json_strings_escape_what_json_requires() {
        assert_eq!(super::json_string("Xeon(R) \"Gold\" \\ é\n"), "\"Xeon(R) \\\"Gold\\\" \\\\ é\\u000a\"");
    }
}
