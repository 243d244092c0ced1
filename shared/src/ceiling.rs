//! A measured ceiling for "% of peak" on a CPU, where no datasheet number means much: this
//! machine's GEMM rate at the block's own four GEMM shapes, with the GEMM backend this binary
//! uses, and its memory bandwidth (a STREAM-style triad). A CPU row's % of peak is then
//! "% of the measured GEMM ceiling": how close the whole block comes to the rate its GEMMs could
//! reach alone on this machine (the non-GEMM part of the block is what separates the two).
//!
//! Also here: which GEMM backend and SIMD level ran (detected at run time), recorded in every
//! JSON record.
//!
//! Cost: a few hundred milliseconds on `small` (each shape: one untimed call, then the best of
//! up to 3 timed ones within a time box), and ~30 ms for the triad.

use crate::preset::Shape;
use candle_core::{Device, Tensor};
use serde::{Deserialize, Serialize};
use std::time::{Duration, Instant};

/// One GEMM shape of the block, measured: y (m × n) = x (m × k) · Wᵀ, W (n × k), as the block's
/// `linear` runs it (candle's `matmul` against a transposed weight).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct GemmRate {
    /// "qkv", "proj", "fc1" or "fc2".
    pub name: String,
    pub m: usize,
    pub n: usize,
    pub k: usize,
    /// 2·m·n·k / best time.
    pub gflops: f64,
}

/// The CPU ceiling the runner computes % of peak against. Read by the ladder's report and its
/// charts (a roofline: `gemm_gflops` is the compute roof, `bandwidth_gbs` the memory slope).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct CpuCeiling {
    /// e.g. "gemm x86-v4 (AVX-512)", "gemm (AVX2)", "MKL (mkl feature)".
    pub gemm_backend: String,
    /// The widest SIMD the CPU offers, detected at run time, e.g. "AVX-512", "AVX2+FMA".
    pub simd: String,
    /// The block's four GEMMs at this run's shape (M = B·T).
    pub gemms: Vec<GemmRate>,
    /// All four together: their FLOPs over the sum of their best times, in GFLOP/s. This is the
    /// ceiling a block row's % of peak is relative to (the block runs these four GEMMs once each).
    pub gemm_gflops: f64,
    /// STREAM triad a[i] = b[i] + s·c[i] over 3 × 32 MiB arrays, all threads; 12 bytes per i.
    pub bandwidth_gbs: f64,
    /// Threads the probe ran on (candle's, = rayon's pool).
    pub threads: usize,
    /// How it was measured, in words, for the JSON reader.
    pub method: String,
}

impl CpuCeiling {
    /// Peak in TFLOP/s, the unit of `Record::peak_tflops`.
    pub fn peak_tflops(&self) -> f64 {
        self.gemm_gflops / 1e3
    }

    /// One line for the terminal.
    pub fn describe(&self) -> String {
        let each: Vec<String> = self.gemms.iter().map(|g| format!("{} {:.0}", g.name, g.gflops)).collect();
        format!(
            "{} · SIMD {} · GEMM {:.1} GFLOP/s at the block's shapes ({}) · triad {:.1} GB/s · {} threads",
            self.gemm_backend,
            self.simd,
            self.gemm_gflops,
            each.join(", "),
            self.bandwidth_gbs,
            self.threads
        )
    }
}

/// The widest SIMD level this CPU has, detected at run time (what the run-time dispatched
/// kernels, gemm's and ours, pick).
pub fn simd_level() -> &'static str {
    #[cfg(target_arch = "x86_64")]
    {
        if has_avx512() {
            return "AVX-512";
        }
        if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma") {
            return "AVX2+FMA";
        }
        "SSE2"
    }
    #[cfg(target_arch = "aarch64")]
    {
        "NEON"
    }
    #[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
    {
        "scalar"
    }
}

/// The AVX-512 subsets gemm's x86-v4 kernels (pulp's V4 level) need.
#[cfg(target_arch = "x86_64")]
pub fn has_avx512() -> bool {
    std::arch::is_x86_feature_detected!("avx512f")
        && std::arch::is_x86_feature_detected!("avx512bw")
        && std::arch::is_x86_feature_detected!("avx512cd")
        && std::arch::is_x86_feature_detected!("avx512dq")
        && std::arch::is_x86_feature_detected!("avx512vl")
}

/// Which GEMM candle's CPU matmul (and stage 3's direct gemm calls) run in this binary on this
/// CPU: the build's `mkl` feature decides the library, the CPU decides gemm's kernels.
pub fn gemm_backend() -> String {
    if cfg!(feature = "mkl") {
        return "MKL (mkl feature)".into();
    }
    match simd_level() {
        "AVX-512" => "gemm x86-v4 (AVX-512)".into(),
        "AVX2+FMA" => "gemm (AVX2)".into(),
        other => format!("gemm ({other})"),
    }
}

/// The block's four GEMMs at `shape`: (name, m, n, k) with m = B·T.
pub fn block_gemms(shape: &Shape) -> [(&'static str, usize, usize, usize); 4] {
    let (m, c, ff) = (shape.batch * shape.seq, shape.d_model, shape.ff);
    [("qkv", m, 3 * c, c), ("proj", m, c, c), ("fc1", m, ff, c), ("fc2", m, c, ff)]
}

/// Bytes of each of the triad's three arrays.
pub const TRIAD_ARRAY_BYTES: usize = 32 << 20;

/// Bytes the probe holds at its widest, from the shapes it measures (`block_gemms`), so a shape
/// added there is counted here: each GEMM's x (m × k), W (n × k) and y (m × n) in f32 are alive
/// together and freed before the next; the triad's three arrays come after.
pub fn probe_bytes(shape: &Shape) -> u128 {
    let gemm =
        block_gemms(shape).iter().map(|&(_, m, n, k)| 4 * (m as u128 * k as u128 + n as u128 * k as u128 + m as u128 * n as u128)).max();
    gemm.unwrap_or(0).max(3 * TRIAD_ARRAY_BYTES as u128)
}

/// Refuse (exit 2) a probe that cannot fit before it allocates: `probe_bytes` against the
/// memory available (MemAvailable, and the address-space limit `ulimit -v` sets), then a
/// fallible reservation of that many bytes, which fails where an infallible allocation would
/// abort the process (Rust aborts on allocation failure).
pub fn check_fit(shape: &Shape) -> Result<(), crate::SpeedkitError> {
    let need = probe_bytes(shape);
    let refuse = |have: String| {
        crate::SpeedkitError::usage(format!(
            "the CPU ceiling probe (the block's GEMMs timed alone, for % of peak) needs about {:.2} GiB of memory at its widest \
             (x, W and y of its largest GEMM at {shape}), but {have}. Fix: lower --d-model or --ff (or --batch / --seq), \
             or free memory (or raise `ulimit -v`).",
            need as f64 / (1u64 << 30) as f64
        ))
    };
    if let Some(avail) = crate::device::available_bytes(&Device::Cpu) {
        if need > avail as u128 * 9 / 10 {
            return Err(refuse(format!("only {:.2} GiB is available to this process", avail as f64 / (1u64 << 30) as f64)));
        }
    }
    let bytes = usize::try_from(need).map_err(|_| refuse("that is more than this machine can address".into()))?;
    let mut trial: Vec<u8> = Vec::new();
    trial.try_reserve_exact(bytes).map_err(|_| refuse("allocating it failed".into()))?;
    drop(trial); // never touched, so it cost address space only
    Ok(())
}

/// Measure the ceiling on the CPU for `shape`. Each GEMM: one untimed call (page faults,
/// gemm's packing buffers), then timed calls until 3 are done or 0.5 s has passed; the best
/// time counts (a ceiling is what the machine can do, not what it usually does).
pub fn measure(shape: &Shape) -> candle_core::Result<CpuCeiling> {
    let dev = Device::Cpu;
    let mut gemms = Vec::new();
    let (mut flops, mut secs) = (0.0, 0.0);
    for (name, m, n, k) in block_gemms(shape) {
        let x = Tensor::randn(0f32, 1.0, (m, k), &dev)?;
        let w = Tensor::randn(0f32, 0.02, (n, k), &dev)?;
        let wt = w.t()?; // (k, n) view, as the block's `linear` passes it
        let best = best_time(|| x.matmul(&wt).map(|_| ()), 3, Duration::from_millis(500))?;
        let f = 2.0 * (m * n * k) as f64;
        gemms.push(GemmRate { name: name.into(), m, n, k, gflops: f / best / 1e9 });
        flops += f;
        secs += best;
    }
    Ok(CpuCeiling {
        gemm_backend: gemm_backend(),
        simd: simd_level().into(),
        gemms,
        gemm_gflops: flops / secs / 1e9,
        bandwidth_gbs: triad_gbs(TRIAD_ARRAY_BYTES),
        threads: candle_core::utils::get_num_threads(),
        method: "best of up to 3 timed f32 x·Wᵀ via candle matmul per block GEMM shape (after one untimed call); \
                 STREAM triad a = b + s·c over 3 × 32 MiB, rayon, best of 5"
            .into(),
    })
}

fn best_time(mut f: impl FnMut() -> candle_core::Result<()>, reps: usize, budget: Duration) -> candle_core::Result<f64> {
    f()?; // untimed
    let start = Instant::now();
    let mut best = f64::INFINITY;
    for _ in 0..reps {
        let t = Instant::now();
        f()?;
        best = best.min(t.elapsed().as_secs_f64());
        if start.elapsed() > budget {
            break;
        }
    }
    Ok(best)
}

/// STREAM triad over three arrays of `bytes` each, in GB/s (12 bytes moved per element: two
/// reads and a write; write-allocate traffic not counted, as STREAM does).
pub fn triad_gbs(bytes: usize) -> f64 {
    use rayon::prelude::*;
    let n = bytes / 4;
    let (b, c) = (vec![1.0f32; n], vec![2.0f32; n]);
    let mut a = vec![0f32; n];
    let chunk = (n / (4 * rayon::current_num_threads().max(1))).max(4096);
    let mut best = f64::INFINITY;
    for _ in 0..5 {
        let t = Instant::now();
        a.par_chunks_mut(chunk).zip(b.par_chunks(chunk).zip(c.par_chunks(chunk))).for_each(|(a, (b, c))| {
            for ((a, &b), &c) in a.iter_mut().zip(b).zip(c) {
                *a = b + 3.0 * c;
            }
        });
        best = best.min(t.elapsed().as_secs_f64());
    }
    std::hint::black_box(&a);
    12.0 * n as f64 / best / 1e9
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::preset::Preset;

    #[test]
    fn shapes_are_the_blocks_linears() {
        // small: B·T = 2048, C = 768, FF = 3072
        let g = block_gemms(&Preset::Small.shape());
        assert_eq!(g, [("qkv", 2048, 2304, 768), ("proj", 2048, 768, 768), ("fc1", 2048, 3072, 768), ("fc2", 2048, 768, 3072)]);
        // together they are the linears' share of block_flops
        let s = Preset::Tiny.shape();
        let linears: f64 = block_gemms(&s).iter().map(|&(_, m, n, k)| 2.0 * (m * n * k) as f64).sum();
        let attention = 2.0 * (s.batch * s.seq * s.seq * s.d_model) as f64;
        assert_eq!(linears + attention, crate::perf::block_flops(&s));
    }

    // Issue 19, class B: the probe's bytes come from the shapes it measures, and a probe that
    // cannot fit is exit 2 before it allocates anything.
    #[test]
    fn probe_bytes_count_its_widest_gemm_and_refuse_before_allocating() {
        let s = Preset::Small.shape();
        let widest = block_gemms(&s).iter().map(|&(_, m, n, k)| 4 * (m * k + n * k + m * n) as u128).max().unwrap();
        assert_eq!(widest, 4 * (2048 * 768 + 3072 * 768 + 2048 * 3072), "fc1 (and fc2) on small");
        assert_eq!(probe_bytes(&s), widest.max(3 * TRIAD_ARRAY_BYTES as u128));
        // ~42 GB for fc1 alone: more than this process has, refused at once (not an abort).
        let huge = Shape { batch: 1, seq: 80_000, d_model: 26_000, n_head: 1000, ff: 80_000 };
        let e = check_fit(&huge).unwrap_err().to_string();
        assert!(e.contains("ceiling probe") && e.contains("memory") && e.contains("Fix:"), "{e}");
        assert!(check_fit(&Preset::Tiny.shape()).is_ok());
    }

    #[test]
    fn tiny_probe_measures_something_finite() {
        let _alone = crate::BIG_ALLOCATION_TESTS.lock().unwrap_or_else(|e| e.into_inner());
        let c = measure(&Preset::Tiny.shape()).unwrap();
        assert_eq!(c.gemms.len(), 4);
        assert!(c.gemms.iter().all(|g| g.gflops.is_finite() && g.gflops > 0.0));
        assert!(c.gemm_gflops.is_finite() && c.gemm_gflops > 0.0 && c.bandwidth_gbs > 0.0);
        assert_eq!(c.gemm_backend, gemm_backend());
        let json = serde_json::to_string(&c).unwrap();
        let back: CpuCeiling = serde_json::from_str(&json).unwrap(); // the JSON a reader (the roofline) gets
        assert_eq!((back.gemms.len(), back.gemm_backend, back.simd), (4, c.gemm_backend.clone(), c.simd.clone()));
    }
}
