//! A measured ceiling for "% of peak" on a CPU, where no datasheet number means much: this
//! machine's GEMM rate at the block's own GEMM shapes (attention's thin ones, k = d_head, run
//! slower even bare, so they get their own rate) and its memory bandwidth (STREAM triad). With a
//! bf16 GEMM registered (`register_bf16_gemm`), the linears are timed in bf16 too, for bf16 rows.

use crate::preset::Shape;
use crate::Precision;
use candle_core::{DType, Device, Result, Tensor};
use serde::{Deserialize, Serialize};
use std::time::{Duration, Instant};

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct GemmRate {
    pub name: String,
    /// Records from before attention was measured have no `batch`.
    #[serde(default = "one")]
    pub batch: usize,
    pub m: usize,
    pub n: usize,
    pub k: usize,
    pub gflops: f64,
}

fn one() -> usize {
    1
}

/// `gemm_gflops` (`block_ceiling_gflops`) is the compute roof, `bandwidth_gbs` (triad) the memory one.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct CpuCeiling {
    pub gemm_backend: String,
    pub simd: String,
    pub gemms: Vec<GemmRate>,
    pub gemm_gflops: f64,
    pub bandwidth_gbs: f64,
    pub threads: usize,
    pub method: String,
    /// The linears timed in bf16; absent without a bf16 unit (and in older records).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bf16: Option<Bf16Ceiling>,
}

/// `kernel` ran the linears at `gemms`' rates; `gemm_gflops` has attention at its f32 rates (stage 2's
/// fused attention widens bf16 to f32).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Bf16Ceiling {
    pub kernel: String,
    pub gemms: Vec<GemmRate>,
    pub gemm_gflops: f64,
}

/// A bf16 matmul `a (m, k) · b (k, n)` for the probe, and its kernel's name (stage 1 registers it).
#[derive(Clone, Copy, Debug)]
pub struct Bf16Gemm {
    pub kernel: &'static str,
    pub matmul: fn(&Tensor, &Tensor) -> Result<Tensor>,
}

static BF16_GEMM: std::sync::OnceLock<Bf16Gemm> = std::sync::OnceLock::new();

/// Make `measure` time the linears in bf16 too (the first registration holds).
pub fn register_bf16_gemm(g: Bf16Gemm) {
    let _ = BF16_GEMM.set(g);
}

impl CpuCeiling {
    /// The bf16 ceiling for bf16 rows where it was measured, else the f32 one.
    pub fn peak_tflops_for(&self, p: Precision) -> f64 {
        match (&self.bf16, p) {
            (Some(b), Precision::Bf16) => b.gemm_gflops / 1e3,
            _ => self.gemm_gflops / 1e3,
        }
    }

    pub fn describe(&self) -> String {
        let CpuCeiling { gemm_backend, simd, gemm_gflops, bandwidth_gbs, threads, .. } = self;
        let each = |gemms: &[GemmRate]| gemms.iter().map(|g| format!("{} {:.0}", g.name, g.gflops)).collect::<Vec<_>>().join(", ");
        let bf16 = |b: &Bf16Ceiling| format!(" · bf16 GEMM ({}) {:.1} GFLOP/s ({})", b.kernel, b.gemm_gflops, each(&b.gemms));
        let bf16 = self.bf16.as_ref().map_or(String::new(), bf16);
        let each = each(&self.gemms);
        format!(
            "{gemm_backend} · SIMD {simd} · GEMM {gemm_gflops:.1} GFLOP/s at the block's shapes ({each}){bf16} · \
             triad {bandwidth_gbs:.1} GB/s · {threads} threads"
        )
    }
}

/// The widest SIMD level this CPU has, detected at run time as gemm's and our kernels do.
pub fn simd_level() -> &'static str {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::is_x86_feature_detected as has;
        // The AVX-512 subsets gemm's x86-v4 kernels (pulp's V4 level) need.
        if has!("avx512f") && has!("avx512bw") && has!("avx512cd") && has!("avx512dq") && has!("avx512vl") {
            return "AVX-512";
        } else if has!("avx2") && has!("fma") {
            return "AVX2+FMA";
        }
    }
    match std::env::consts::ARCH {
        "x86_64" => "SSE2",
        "aarch64" => "NEON",
        _ => "scalar",
    }
}

/// The GEMM candle's CPU matmul and stage 3 run: the `mkl` feature picks the library, the CPU gemm's kernels.
pub fn gemm_backend() -> String {
    match simd_level() {
        _ if cfg!(feature = "mkl") => "MKL (mkl feature)".into(),
        "AVX-512" => "gemm x86-v4 (AVX-512)".into(),
        "AVX2+FMA" => "gemm (AVX2)".into(),
        other => format!("gemm ({other})"),
    }
}

/// `batch` products y (m × n) = x (m × k) · w (k × n): "qkv", "proj", "fc1", "fc2" (batch 1),
/// "attn_qk", "attn_pv" (batch: heads).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ProbeGemm {
    pub name: &'static str,
    pub batch: usize,
    pub m: usize,
    pub n: usize,
    pub k: usize,
}

impl ProbeGemm {
    pub fn flops(&self) -> f64 {
        2.0 * (self.batch * self.m * self.n * self.k) as f64
    }

    /// The rate of one best time of it.
    fn rate(&self, best_s: f64) -> GemmRate {
        let ProbeGemm { name, batch, m, n, k } = *self;
        GemmRate { name: name.into(), batch, m, n, k, gflops: self.flops() / best_s / 1e9 }
    }
}

/// Score elements the attention probe may hold (64 MiB): past a few heads per thread the rate holds.
const ATTENTION_PROBE_SCORES: usize = 16 << 20;

/// The four linears (m = B·T), then Q·Kᵀ and P·V over as many heads as fit.
pub fn probe_gemms(shape: &Shape) -> Vec<ProbeGemm> {
    let (m, c, ff) = (shape.batch * shape.seq, shape.d_model, shape.ff);
    let linear = |name, n, k| ProbeGemm { name, batch: 1, m, n, k };
    // Past T = 4096 the rate no longer changes, and T = 100 000 would need 40 GB for one head.
    let (t, d) = (shape.seq.min(4096), shape.d_head());
    let heads = (shape.batch * shape.n_head).min((ATTENTION_PROBE_SCORES / (t * t).max(1)).max(1));
    vec![
        linear("qkv", 3 * c, c),
        linear("proj", c, c),
        linear("fc1", ff, c),
        linear("fc2", c, ff),
        ProbeGemm { name: "attn_qk", batch: heads, m: t, n: t, k: d },
        ProbeGemm { name: "attn_pv", batch: heads, m: t, n: d, k: t },
    ]
}

const TRIAD_ARRAY_BYTES: usize = 32 << 20;

/// Bytes the probe holds at its widest: one shape's f32 x, W and y at a time, or the triad.
pub fn probe_bytes(shape: &Shape) -> u128 {
    let bytes = |g: ProbeGemm| 4 * g.batch as u128 * (g.m * g.k + g.k * g.n + g.m * g.n) as u128;
    probe_gemms(shape).into_iter().map(bytes).max().unwrap_or(0).max(3 * TRIAD_ARRAY_BYTES as u128)
}

/// Refuse (exit 2) a probe that cannot fit in the memory available, before it allocates.
pub fn check_fit(shape: &Shape) -> std::result::Result<(), crate::SpeedkitError> {
    let (need, gib) = (probe_bytes(shape), crate::runner::gib);
    let Some(avail) = crate::device::available_bytes(&Device::Cpu).filter(|&a| need > a as u128 * 9 / 10) else { return Ok(()) };
    Err(crate::SpeedkitError::usage(format!(
        "the CPU ceiling probe (the block's GEMMs timed alone, for % of peak) needs about {} of memory at its widest \
         (x, W and y of its largest GEMM at {shape}), but only {} is available to this process. Fix: lower --d-model \
         or --ff (or --batch / --seq), or free memory (or raise `ulimit -v`).",
        gib(need),
        gib(avail as u128)
    )))
}

/// The best time counts: a ceiling is what the machine can do, not what it usually does.
pub fn measure(shape: &Shape) -> Result<CpuCeiling> {
    let (linears, attention): (Vec<_>, Vec<_>) = probe_gemms(shape).into_iter().partition(|g| !g.name.starts_with("attn_"));
    let mut gemms = linears.iter().map(|g| linear_rate(g, DType::F32, |x, wt| x.matmul(wt))).collect::<Result<Vec<_>>>()?;
    for g in attention {
        let x = Tensor::randn(0f32, 1.0, g.batch * g.m * g.k, &Device::Cpu)?.to_vec1::<f32>()?;
        let w = Tensor::randn(0f32, 1.0, g.batch * g.k * g.n, &Device::Cpu)?.to_vec1::<f32>()?;
        let mut y = vec![0f32; g.batch * g.m * g.n];
        let best = best_time(|| {
            attention_gemms(&g, &x, &w, &mut y);
            Ok(())
        })?;
        gemms.push(g.rate(best));
    }
    let bf16 = BF16_GEMM.get().map(|b| {
        let bf16: Vec<_> = linears.iter().map(|g| linear_rate(g, DType::BF16, b.matmul)).collect::<Result<_>>()?;
        let all: Vec<GemmRate> = bf16.iter().chain(&gemms[linears.len()..]).cloned().collect();
        Ok::<_, candle_core::Error>(Bf16Ceiling { kernel: b.kernel.into(), gemm_gflops: block_ceiling_gflops(shape, &all), gemms: bf16 })
    });
    let bf16 = bf16.transpose()?;
    Ok(CpuCeiling {
        gemm_backend: gemm_backend(),
        simd: simd_level().into(),
        gemm_gflops: block_ceiling_gflops(shape, &gemms),
        gemms,
        bandwidth_gbs: triad_gbs(TRIAD_ARRAY_BYTES),
        threads: candle_core::utils::get_num_threads(),
        method: "best of up to 3 timed f32 products per GEMM shape of the block (after one untimed call): the four \
                 linears x·Wᵀ via candle matmul, and attention's Q·Kᵀ and P·V per head via the gemm crate, rayon over \
                 heads, as stage 2's CPU kernel runs them; ceiling = the block's FLOPs \
                 over their time at those rates (attention's causal FLOPs at the rate of Q·Kᵀ and P·V together); \
                 STREAM triad a = b + s·c over 3 × 32 MiB, rayon, best of 5"
            .into(),
        bf16,
    })
}

/// A linear's rate: x (m, k) · Wᵀ in `dtype` through `matmul`, W passed as the block's `linear` passes it.
fn linear_rate(g: &ProbeGemm, dtype: DType, matmul: impl Fn(&Tensor, &Tensor) -> Result<Tensor>) -> Result<GemmRate> {
    let x = Tensor::randn(0f32, 1.0, (g.m, g.k), &Device::Cpu)?.to_dtype(dtype)?;
    let wt = Tensor::randn(0f32, 0.02, (g.n, g.k), &Device::Cpu)?.to_dtype(dtype)?.t()?; // (k, n) view
    Ok(g.rate(best_time(|| matmul(&x, &wt).map(|_| ()))?))
}

/// An attention shape as stage 2's CPU kernel runs it (MKL builds too): a single-threaded gemm-crate
/// product per head, rayon over heads; attn_qk reads K (n × k) transposed.
pub fn attention_gemms(g: &ProbeGemm, x: &[f32], w: &[f32], y: &mut [f32]) {
    use gemm::{gemm, Parallelism::None as Serial};
    use rayon::prelude::*;
    let ProbeGemm { name, batch, m, n, k } = *g;
    assert!(x.len() == batch * m * k && w.len() == batch * k * n && y.len() == batch * m * n, "operands sized for {g:?}");
    let (ni, ki) = (n as isize, k as isize);
    let (cs, rs) = if name == "attn_qk" { (ki, 1) } else { (1, ni) }; // w's column and row strides
    y.par_chunks_mut(m * n).zip(x.par_chunks(m * k).zip(w.par_chunks(k * n))).for_each(|(y, (x, w))| {
        // SAFETY: y, x and w hold m·n, m·k and k·n elements (asserted above, then chunked), and
        // the strides address exactly those.
        unsafe { gemm(m, n, k, y.as_mut_ptr(), 1, ni, false, x.as_ptr(), 1, ki, w.as_ptr(), cs, rs, 0.0, 1.0, false, false, false, Serial) }
    });
}

/// The block's FLOPs over their time at the measured rates: each linear at its own, attention's
/// causal FLOPs (as `perf::block_flops`) at attn_qk's and attn_pv's combined.
pub fn block_ceiling_gflops(shape: &Shape, gemms: &[GemmRate]) -> f64 {
    // (FLOPs, seconds) of the linears (`false`) or of attention's products (`true`).
    let sum = |attn: bool| {
        let f = |g: &GemmRate| 2.0 * (g.batch * g.m * g.n * g.k) as f64;
        let of = gemms.iter().filter(|g| g.name.starts_with("attn_") == attn);
        of.fold((0.0, 0.0), |(fl, s), g| (fl + f(g), s + f(g) / (g.gflops * 1e9)))
    };
    let ((mut flops, mut secs), (attn_flops, attn_secs)) = (sum(false), sum(true));
    if attn_secs > 0.0 {
        let causal = 2.0 * (shape.batch * shape.seq * shape.seq * shape.d_model) as f64;
        flops += causal;
        secs += causal / (attn_flops / attn_secs);
    }
    flops / secs / 1e9
}

/// One untimed call (page faults, packing buffers), then the best of up to 3 within 0.5 s, in s.
fn best_time(mut f: impl FnMut() -> Result<()>) -> Result<f64> {
    f()?;
    let (start, mut best) = (Instant::now(), f64::INFINITY);
    for _ in 0..3 {
        let t = Instant::now();
        f()?;
        best = best.min(t.elapsed().as_secs_f64());
        if start.elapsed() > Duration::from_millis(500) {
            break;
        }
    }
    Ok(best)
}

/// STREAM triad a = b + s·c over three arrays of `bytes` each, in GB/s (12 bytes per element, as STREAM counts).
fn triad_gbs(bytes: usize) -> f64 {
    use rayon::prelude::*;
    let n = bytes / 4;
    let (b, c, mut a) = (vec![1.0f32; n], vec![2.0f32; n], vec![0f32; n]);
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
#[path = "../tests/unit/ceiling.rs"]
mod tests;
