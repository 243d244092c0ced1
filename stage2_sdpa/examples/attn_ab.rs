use candle_core::{Device, IndexOp, Tensor};
use stage2_sdpa::attention::{attention_cpu, CpuKernel};
fn cpu_ns() -> u64 {
    let mut s = 0;
    for e in std::fs::read_dir("/proc/self/task").unwrap() {
        let p = e.unwrap().path().join("schedstat");
        if let Ok(x) = std::fs::read_to_string(p) {
            s += x.split_whitespace().next().unwrap().parse::<u64>().unwrap();
        }
    }
    s
}
fn main() {
    if std::env::var("GELU").is_ok() {
        gelu_time();
        return;
    }
    let args: Vec<String> = std::env::args().collect();
    let t: usize = args.get(1).map(|x| x.parse().unwrap()).unwrap_or(512);
    let d: usize = args.get(2).map(|x| x.parse().unwrap()).unwrap_or(64);
    let strided = args.get(3).map(|x| x == "s").unwrap_or(true);
    let (b, h) = (4, 768 / d);
    let dev = Device::Cpu;
    let mk = |seed: u64| Tensor::from_vec(shared::weights::SplitMix64::new(seed).normals(b * t * h * d), (b, t, h, d), &dev).unwrap();
    let (q, k, v) = (mk(1), mk(2), mk(3));
    let (q, k, v) = if strided {
        let qkv = Tensor::stack(&[&q, &k, &v], 2).unwrap();
        (qkv.i((.., .., 0)).unwrap(), qkv.i((.., .., 1)).unwrap(), qkv.i((.., .., 2)).unwrap())
    } else {
        (q, k, v)
    };
    let flops = (2 * b * t * t * h * d) as f64;
    let kernels = [(CpuKernel::GemmTiles, "gemm_tiles"), (CpuKernel::Registers, "registers")];
    let mut res: Vec<Vec<(f64, f64)>> = vec![vec![]; kernels.len()];
    {
        let a = Tensor::from_vec(shared::weights::SplitMix64::new(9).normals(2048 * 768), (2048, 768), &dev).unwrap();
        let w = Tensor::from_vec(shared::weights::SplitMix64::new(8).normals(3072 * 768), (768, 3072), &dev).unwrap();
        for _ in 0..3 {
            a.matmul(&w).unwrap();
        }
        let mut best = f64::MAX;
        for _ in 0..10 {
            let t0 = std::time::Instant::now();
            a.matmul(&w).unwrap();
            best = best.min(t0.elapsed().as_secs_f64());
        }
        println!("gemm 2048x768x3072: best {:.2} ms = {:.0} GFLOP/s", best * 1e3, 2.0 * 2048.0 * 768.0 * 3072.0 / best / 1e9);
    }
    for _ in 0..3 {
        for (kk, _) in kernels {
            attention_cpu(kk, &q, &k, &v, true).unwrap();
        }
    }
    for _round in 0..15 {
        for (i, (kk, _)) in kernels.iter().enumerate() {
            let (w0, c0) = (std::time::Instant::now(), cpu_ns());
            let n = 5;
            for _ in 0..n {
                attention_cpu(*kk, &q, &k, &v, true).unwrap();
            }
            res[i].push((w0.elapsed().as_secs_f64() / n as f64, (cpu_ns() - c0) as f64 / 1e9 / n as f64));
        }
    }
    for (i, (_, name)) in kernels.iter().enumerate() {
        let mut w: Vec<f64> = res[i].iter().map(|x| x.0).collect();
        w.sort_by(|a, b| a.partial_cmp(b).unwrap());
        let mut c: Vec<f64> = res[i].iter().map(|x| x.1).collect();
        c.sort_by(|a, b| a.partial_cmp(b).unwrap());
        println!("{name:12} T={t} d={d} wall median {:.2} ms (min {:.2}) = {:.0} GFLOP/s | cpu-time median {:.2} ms = {:.0} GFLOP/s per cpu-second", w[7]*1e3, w[0]*1e3, flops / w[7] / 1e9, c[7]*1e3, flops / c[7] / 1e9);
    }
}
#[allow(dead_code)]
fn gelu_time() {
    let mut v = shared::weights::SplitMix64::new(4).normals(2048 * 3072);
    let g = |v: f32| {
        let u = 0.797_884_6 * (v + 0.044715 * v * v * v);
        v / (1.0 + shared::elementwise::exp_f32(-2.0 * u))
    };
    for _ in 0..3 {
        shared::elementwise::map_in_place(&mut v, g);
    }
    let mut best = f64::MAX;
    for _ in 0..10 {
        let t0 = std::time::Instant::now();
        shared::elementwise::map_in_place(&mut v, g);
        best = best.min(t0.elapsed().as_secs_f64());
    }
    println!("gelu over 2048x3072: best {:.2} ms", best * 1e3);
}
