//! The block's four linears on the `small` preset, fp32 and bf16 timed *interleaved*: each round
//! runs every variant of every shape once, in turn, so a neighbour's compile (this bench's
//! machines are shared) slows all variants alike. Prints the median GFLOP/s (min–max beside it)
//! per variant and the bf16 / f32 ratio of the medians, and the load average before and after.
//! - `f32`: candle's f32 matmul (the `gemm` crate): what stages 0–3 run at fp32;
//! - `bf16`: `bf16_gemm::matmul` on bf16 x and Wᵀ (packs W in every call);
//! - `bf16 prepacked`: `bf16_gemm::matmul_prepacked` with W packed once, as the blocks hold it;
//! - `bf16 f32-x prepacked`: stage 1's case, an f32 activation rounded to bf16 as it is packed.
//!
//! `cargo bench -p stage1_tensorcore --bench bf16_gemm_pairs` (`BENCH_ROUNDS=n`, default 15;
//! `BENCH_ONLY="bf16 prepacked"` keeps f32 and that variant).

use candle_core::{DType, Device, Tensor};
use cpu_kernels::bf16_gemm::{self, Kernel};
use shared::weights::SplitMix64;
use std::time::Instant;

fn randn(dims: &[usize], seed: u64, std: f32) -> Tensor {
    let n = dims.iter().product();
    let v: Vec<f32> = SplitMix64::new(seed).normals(n).into_iter().map(|x| x * std).collect();
    Tensor::from_vec(v, dims, &Device::Cpu).unwrap()
}

fn loadavg() -> String {
    std::fs::read_to_string("/proc/loadavg").unwrap_or_default().trim().to_string()
}

type Run<'a> = Box<dyn Fn() + 'a>;

fn main() {
    let rounds: usize = std::env::var("BENCH_ROUNDS").ok().and_then(|s| s.parse().ok()).unwrap_or(15);
    println!("bf16 kernel: {}; rayon threads: {}; rounds: {rounds}", Kernel::detect().name(), rayon::current_num_threads());
    println!("loadavg before: {}", loadavg());
    let shape = shared::Preset::Small.shape();
    let gemms: Vec<_> = shared::ceiling::probe_gemms(&shape).into_iter().filter(|g| g.batch == 1).collect();
    let data: Vec<_> = gemms
        .iter()
        .map(|g| {
            let (x, w) = (randn(&[g.m, g.k], 1, 1.0), randn(&[g.n, g.k], 2, 0.02)); // x (m, k), W (n, k)
            let (xb, wb) = (x.to_dtype(DType::BF16).unwrap(), w.to_dtype(DType::BF16).unwrap());
            let packed = bf16_gemm::PackedWeight::new(&wb).unwrap();
            (x, w.t().unwrap(), xb, wb.t().unwrap(), packed)
        })
        .collect();
    let mut variants: Vec<(usize, &str, Run)> = Vec::new();
    for (s, (x, wt, xb, wbt, packed)) in data.iter().enumerate() {
        variants.push((s, "f32", Box::new(move || drop(x.matmul(wt).unwrap()))));
        variants.push((s, "bf16", Box::new(move || drop(bf16_gemm::matmul(xb, wbt).unwrap()))));
        variants.push((s, "bf16 prepacked", Box::new(move || drop(bf16_gemm::matmul_prepacked(xb, packed).unwrap()))));
        variants.push((s, "bf16 f32-x prepacked", Box::new(move || drop(bf16_gemm::matmul_prepacked(x, packed).unwrap()))));
    }
    if let Ok(only) = std::env::var("BENCH_ONLY") {
        variants.retain(|(_, name, _)| *name == "f32" || *name == only); // f32 stays: the ratio's denominator
    }
    for (_, _, run) in &variants {
        for _ in 0..3 {
            run(); // warm-up: pages touched, caches and rayon's pool up
        }
    }
    let mut times = vec![Vec::new(); variants.len()];
    for _ in 0..rounds {
        for (v, (_, _, run)) in variants.iter().enumerate() {
            let t0 = Instant::now();
            run();
            times[v].push(t0.elapsed().as_secs_f64());
        }
    }
    println!("loadavg after: {}", loadavg());
    println!("{:<6} {:<16} {:<22} {:>10} {:>17} {:>8}", "shape", "m×n×k", "variant", "GFLOP/s", "(min–max)", "vs f32");
    let mut f32_median = 0.0;
    for (v, (s, name, _)) in variants.iter().enumerate() {
        let g = &gemms[*s];
        let flops = 2.0 * (g.m * g.n * g.k) as f64;
        let mut t = times[v].clone();
        t.sort_by(f64::total_cmp);
        let rate = |secs: f64| flops / secs / 1e9;
        let median = rate(t[t.len() / 2]);
        if *name == "f32" {
            f32_median = median;
        }
        println!(
            "{:<6} {:<16} {:<22} {:>10.1} {:>8.1}–{:<8.1} {:>7.2}x",
            g.name,
            format!("{}x{}x{}", g.m, g.n, g.k),
            name,
            median,
            rate(t[t.len() - 1]),
            rate(t[0]),
            median / f32_median
        );
    }
}
