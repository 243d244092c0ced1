// TEMPORARY tuning bench (not committed): paired A/B of blocking configs, interleaved with f32.
use candle_core::{DType, Device, Tensor};
use shared::weights::SplitMix64;
use stage1_tensorcore::bf16_gemm::{self, TUNE};
use std::sync::atomic::Ordering;
use std::time::Instant;

fn randn(dims: &[usize], seed: u64, std: f32) -> Tensor {
    let n = dims.iter().product();
    let v: Vec<f32> = SplitMix64::new(seed).normals(n).into_iter().map(|x| x * std).collect();
    Tensor::from_vec(v, dims, &Device::Cpu).unwrap()
}

fn main() {
    let rounds: usize = std::env::var("ROUNDS").ok().and_then(|s| s.parse().ok()).unwrap_or(10);
    let cfgs: Vec<[usize; 3]> = std::env::var("CFGS")
        .unwrap()
        .split(';')
        .map(|c| {
            let v: Vec<usize> = c.split(',').map(|x| x.parse().unwrap()).collect();
            [v[0], v[1], v[2]]
        })
        .collect();
    let f32x = std::env::var("F32X").is_ok();
    let shape = shared::Preset::Small.shape();
    let gemms: Vec<_> = shared::ceiling::probe_gemms(&shape).into_iter().filter(|g| g.batch == 1).collect();
    let data: Vec<_> = gemms
        .iter()
        .map(|g| {
            let (x, w) = (randn(&[g.m, g.k], 1, 1.0), randn(&[g.n, g.k], 2, 0.02));
            let wb = w.to_dtype(DType::BF16).unwrap();
            let xb = if f32x { x.clone() } else { x.to_dtype(DType::BF16).unwrap() };
            (x, w.t().unwrap(), xb, bf16_gemm::PackedWeight::new(&wb).unwrap())
        })
        .collect();
    let set = |c: &[usize; 3]| {
        for i in 0..3 {
            TUNE[i].store(c[i], Ordering::Relaxed)
        }
    };
    // times[shape][variant][round]; variant 0 = f32
    let mut times = vec![vec![Vec::new(); cfgs.len() + 1]; gemms.len()];
    for r in 0..rounds + 2 {
        for (s, (x, wt, xb, pw)) in data.iter().enumerate() {
            let t0 = Instant::now();
            drop(x.matmul(wt).unwrap());
            let t = t0.elapsed().as_secs_f64();
            if r >= 2 {
                times[s][0].push(t);
            }
            for (c, cfg) in cfgs.iter().enumerate() {
                set(cfg);
                let t0 = Instant::now();
                drop(bf16_gemm::matmul_prepacked(xb, pw).unwrap());
                let t = t0.elapsed().as_secs_f64();
                if r >= 2 {
                    times[s][c + 1].push(t);
                }
            }
        }
    }
    if std::env::var("NARROW").is_ok() {
        use rayon::prelude::*;
        for (s, g) in gemms.iter().enumerate() {
            let mut tn = Vec::new();
            let mut ta = Vec::new();
            for _ in 0..10 {
                let t0 = Instant::now();
                let out = vec![0f32; g.m * g.n];
                ta.push(t0.elapsed().as_secs_f64());
                let t0 = Instant::now();
                let v: Vec<half::bf16> = out.par_iter().map(|&v| half::bf16::from_f32(v)).collect();
                tn.push(t0.elapsed().as_secs_f64());
                drop(v);
            }
            tn.sort_by(f64::total_cmp);
            ta.sort_by(f64::total_cmp);
            let mut tg = times[s][1].clone();
            tg.sort_by(f64::total_cmp);
            println!("{}: alloc {:.2} ms, narrow {:.2} ms, whole op {:.2} ms", g.name, ta[5] * 1e3, tn[5] * 1e3, tg[tg.len() / 2] * 1e3);
        }
    }
    let med = |v: &mut Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    println!("load {}", std::fs::read_to_string("/proc/loadavg").unwrap().trim());
    for (c, cfg) in cfgs.iter().enumerate() {
        let mut line = format!("{:?}:", cfg);
        for (s, g) in gemms.iter().enumerate() {
            let flops = 2.0 * (g.m * g.n * g.k) as f64;
            let mut ratio: Vec<f64> = (0..rounds).map(|r| times[s][0][r] / times[s][c + 1][r]).collect();
            let mut vs0: Vec<f64> = (0..rounds).map(|r| times[s][1][r] / times[s][c + 1][r]).collect();
            let mut t = times[s][c + 1].clone();
            let gf = flops / med(&mut t) / 1e9;
            let best = flops / t[0] / 1e9;
            line += &format!(" {} {:.0}(best {:.0}) r{:.2} vsA{:.3} |", g.name, gf, best, med(&mut ratio), med(&mut vs0));
        }
        println!("{line}");
    }
}
