//! Element-wise passes for the CPU, multi-threaded (rayon) and vectorised (AVX-512 or AVX2+FMA
//! bodies chosen at run time), UNFUSED: one primitive op is one pass over memory, the same op
//! sequence as stage 0's candle primitives (LayerNorm's in four passes: row means, centring,
//! row variances, normalise with g and b; GELU's nine). Every stage runs its element-wise work
//! through here on the CPU (`Elementwise::Parallel`, the default), so that stage to stage the
//! time measures the technique and not candle's CPU element-wise kernels, which run
//! single-threaded and, for `tanh`, scalar. Stage 3's fusions then show their gain as fewer
//! passes over memory, against these passes.
//!
//! f32 and bf16 tensors alike: a bf16 pass widens each chunk of its inputs to f32 in a task's
//! own buffer (in cache), computes in f32, and rounds the chunk once as it stores it.
//!
//! Where a pass does not apply it runs candle's op, and says so in the kernel trace: on a GPU
//! (every candle kernel is parallel there already), for other dtypes, and for tracked tensors —
//! while training, candle's ops are the ones its autograd can differentiate — except LayerNorm,
//! GELU and the softmax on f32, whose last pass is then a custom op with the engine's backward
//! (`grad`).
//! `--elementwise candle` runs candle's own ops everywhere, to measure what the engine buys.
//!
//! Each op has its slow twin (the candle expression named in its doc) and a property test.

use crate::bf16_gemm::{self, narrow_bf16, PackedWeight};
use crate::trace;
use candle_core::{CpuStorage, DType, Device, Storage, Tensor};
use half::bf16;
use rayon::prelude::*;
use std::sync::OnceLock;

mod grad;

/// Which element-wise ops run on the CPU.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Elementwise {
    /// This module: multi-threaded, vectorised, one pass per op. The default.
    #[default]
    Parallel,
    /// candle's CPU ops (single-threaded).
    Candle,
}

impl Elementwise {
    /// The flag's value: "parallel" or "candle".
    pub fn name(self) -> &'static str {
        match self {
            Elementwise::Parallel => "parallel",
            Elementwise::Candle => "candle",
        }
    }
}

/// The run's choice (`--elementwise`), read by every stage's block when it is built.
static MODE: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false); // false: Parallel

/// n zeros of a candle dtype, set by one memset, for an output buffer the kernels then
/// overwrite: `vec![bf16::ZERO; n]` (or `vec![T::zero(); n]` for a generic T) writes them one
/// element at a time, as the standard library cannot know that zero is all-zero bits for bf16
/// (4.5 % of stage 3's forward in perf: its bf16 outputs' allocations).
pub fn zeros_of<T: candle_core::WithDType>(n: usize) -> Vec<T> {
    let mut v = Vec::<T>::with_capacity(n);
    // SAFETY: every candle dtype (integers, bf16, f16, f32, f64, the fp8 ones) is plain bits whose
    // all-zero pattern is its zero; the n elements are written before the length is set.
    unsafe {
        std::ptr::write_bytes(v.as_mut_ptr(), 0, n);
        v.set_len(n);
    }
    v
}

/// `zeros_of::<bf16>`.
pub fn zeros_bf16(n: usize) -> Vec<bf16> {
    zeros_of(n)
}

/// n elements of a candle dtype whose values are whatever the allocator handed back, for an
/// output the caller overwrites whole before anything reads it: `zeros_of` without its memset,
/// which on one thread cost more than the pass that overwrites the buffer (a 25 MB GEMM output
/// zeroed, then written by the GEMM; 14 % of stage 3's forward in perf went to such memsets).
/// candle's CPU backend allocates its own op outputs the same way (`alloc_uninit`).
///
/// # Safety
/// Every one of the n elements is written before any is read (a GEMM's or a pass's whole
/// output); the dtypes are plain bits, valid in every pattern, and never dropped element-wise.
#[allow(clippy::uninit_vec)] // the contract above: written whole before read
pub unsafe fn uninit_of<T: candle_core::WithDType>(n: usize) -> Vec<T> {
    let mut v = Vec::<T>::with_capacity(n);
    v.set_len(n);
    v
}

/// dst = src in dst's dtype: a copy for f32, `narrow_bf16` (16 at a time on AVX512-BF16) for
/// bf16, one element at a time otherwise — the store of an f32 row a kernel computed.
pub fn store_f32<T: candle_core::WithDType>(src: &[f32], dst: &mut [T]) {
    assert_eq!(src.len(), dst.len(), "store_f32: one row for one row");
    match T::DTYPE {
        // SAFETY: T::DTYPE says T is f32 (resp. bf16): the same slice, retyped to what it is.
        DType::F32 => unsafe { std::slice::from_raw_parts_mut(dst.as_mut_ptr() as *mut f32, dst.len()) }.copy_from_slice(src),
        DType::BF16 => narrow_bf16(src, unsafe { std::slice::from_raw_parts_mut(dst.as_mut_ptr() as *mut bf16, dst.len()) }),
        _ => dst.iter_mut().zip(src).for_each(|(d, &s)| *d = T::from_f64(s as f64)),
    }
}

/// Set the run's element-wise ops (the runner does, from `--elementwise`).
pub fn set_mode(mode: Elementwise) {
    MODE.store(mode == Elementwise::Candle, std::sync::atomic::Ordering::Relaxed);
}

/// The run's element-wise ops: `Parallel` unless `set_mode` said otherwise.
pub fn mode() -> Elementwise {
    match MODE.load(std::sync::atomic::Ordering::Relaxed) {
        true => Elementwise::Candle,
        false => Elementwise::Parallel,
    }
}

/// The AVX-512 subsets gemm's x86-v4 kernels (pulp's V4 level) need, and that the bodies
/// below are compiled for.
#[cfg(target_arch = "x86_64")]
pub fn has_avx512() -> bool {
    std::arch::is_x86_feature_detected!("avx512f")
        && std::arch::is_x86_feature_detected!("avx512bw")
        && std::arch::is_x86_feature_detected!("avx512cd")
        && std::arch::is_x86_feature_detected!("avx512dq")
        && std::arch::is_x86_feature_detected!("avx512vl")
}

/// LayerNorm's ε, as in GPT-2 (and stage 0).
pub const LN_EPS: f64 = 1e-5;

/// Elements per rayon task: 16 Ki floats = 64 KiB, enough work to amortise a task (~1 µs) and
/// small enough to spread a (2048, 768) activation over many cores.
const CHUNK: usize = 16 * 1024;

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Level {
    Scalar,
    #[cfg(target_arch = "x86_64")]
    Avx2,
    #[cfg(target_arch = "x86_64")]
    Avx512,
}

fn level() -> Level {
    static LEVEL: OnceLock<Level> = OnceLock::new();
    *LEVEL.get_or_init(|| {
        #[cfg(target_arch = "x86_64")]
        {
            if has_avx512() {
                return Level::Avx512;
            }
            if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma") {
                return Level::Avx2;
            }
        }
        Level::Scalar
    })
}

/// The SIMD level the passes run at on this CPU, for the kernel trace.
fn simd() -> &'static str {
    match level() {
        Level::Scalar => "scalar",
        #[cfg(target_arch = "x86_64")]
        Level::Avx2 => "avx2",
        #[cfg(target_arch = "x86_64")]
        Level::Avx512 => "avx512",
    }
}

/// The loop every op runs, written so the compiler vectorises it: `f` is inlined into a body
/// compiled for the CPU's widest SIMD (the `#[target_feature]` twins below).
#[inline(always)]
fn body<F: Fn(usize, f32) -> f32>(dst: &mut [f32], src: &[f32], f: &F) {
    for (i, (d, &s)) in dst.iter_mut().zip(src).enumerate() {
        *d = f(i, s);
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vl,avx2,fma")]
unsafe fn body_avx512<F: Fn(usize, f32) -> f32>(dst: &mut [f32], src: &[f32], f: &F) {
    body(dst, src, f)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn body_avx2<F: Fn(usize, f32) -> f32>(dst: &mut [f32], src: &[f32], f: &F) {
    body(dst, src, f)
}

/// dst[i] = f(i, src[i]) with the widest SIMD body this CPU has (i is the index within the slice).
#[inline]
pub fn map_slice<F: Fn(usize, f32) -> f32>(dst: &mut [f32], src: &[f32], f: &F) {
    match level() {
        // SAFETY: the CPU has the features these bodies are compiled for (checked in `level`).
        #[cfg(target_arch = "x86_64")]
        Level::Avx512 => unsafe { body_avx512(dst, src, f) },
        #[cfg(target_arch = "x86_64")]
        Level::Avx2 => unsafe { body_avx2(dst, src, f) },
        Level::Scalar => body(dst, src, f),
    }
}

#[inline(always)]
fn body_mut<F: Fn(usize, f32) -> f32>(v: &mut [f32], f: &F) {
    for (i, x) in v.iter_mut().enumerate() {
        *x = f(i, *x);
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vl,avx2,fma")]
unsafe fn body_mut_avx512<F: Fn(usize, f32) -> f32>(v: &mut [f32], f: &F) {
    body_mut(v, f)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn body_mut_avx2<F: Fn(usize, f32) -> f32>(v: &mut [f32], f: &F) {
    body_mut(v, f)
}

/// row[j] = GELU(row[j] + bias[j]), tanh approximation, in the form with one exponential:
/// v·σ(2u) = v / (1 + e^(−2u)), u = √(2/π)·(v + 0.044715·v³) — a fused linear's bias + GELU
/// output pass. On AVX-512 the exponential is `exp_f32`'s algorithm with `vrndscaleps` and
/// `vscalefps` (about 10 instructions per 16 values) and the division a `vrcp14ps` estimate and
/// one Newton step (≤ 2 ulp, where `vdivps` alone held the pass to its throughput); elsewhere
/// exactly that formula with `exp_f32` and a division.
pub fn bias_gelu_tanh(row: &mut [f32], bias: &[f32]) {
    assert_eq!(row.len(), bias.len(), "bias_gelu_tanh: one bias per column");
    #[cfg(target_arch = "x86_64")]
    if level() == Level::Avx512 {
        // SAFETY: the CPU has AVX-512 F (checked in `level`).
        return unsafe { bias_gelu_tanh_avx512(row, bias) };
    }
    for (v, &b) in row.iter_mut().zip(bias) {
        *v = gelu_tanh_exp(*v + b);
    }
}

/// d/dv of `gelu_tanh_exp`, v·σ(2u) with u = √(2/π)·(v + 0.044715·v³):
/// σ(2u) + v·σ(2u)·(1 − σ(2u))·2·√(2/π)·(1 + 3·0.044715·v²). One exp, no libm (vectorises);
/// 0 and 1 in the far tails, as the exact derivative.
#[inline(always)]
pub fn gelu_tanh_grad(v: f32) -> f32 {
    const SQRT_2_OVER_PI: f32 = 0.797_884_6;
    let u = SQRT_2_OVER_PI * (v + 0.044715 * v * v * v);
    let s = 1.0 / (1.0 + exp_f32(-2.0 * u)); // σ(2u) = (1 + tanh u) / 2
    s + v * s * (1.0 - s) * 2.0 * SQRT_2_OVER_PI * (1.0 + 3.0 * 0.044715 * v * v)
}

/// fc1's bias + GELU backward for one row: dz[j] = dy[j] · gelu′(acc[j] + bias[j]) (acc: the
/// forward's x·Wᵀ, before the bias) and db[j] += dz[j]. On AVX-512 16 values at a time with
/// `bias_gelu_tanh`'s exponential and reciprocal (`gelu_tanh_grad`'s formula); elsewhere that
/// function.
pub fn bias_gelu_tanh_grad(dy: &[f32], acc: &[f32], bias: &[f32], dz: &mut [f32], db: &mut [f32]) {
    let n = dz.len();
    assert!(dy.len() == n && acc.len() == n && bias.len() == n && db.len() == n, "bias_gelu_tanh_grad: one row, one bias per column");
    #[cfg(target_arch = "x86_64")]
    if level() == Level::Avx512 {
        // SAFETY: the CPU has AVX-512 F (checked in `level`); the lengths are equal (asserted).
        return unsafe { bias_gelu_tanh_grad_avx512(dy, acc, bias, dz, db) };
    }
    for j in 0..n {
        dz[j] = dy[j] * gelu_tanh_grad(acc[j] + bias[j]);
        db[j] += dz[j];
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn bias_gelu_tanh_grad_avx512(dy: &[f32], acc: &[f32], bias: &[f32], dz: &mut [f32], db: &mut [f32]) {
    use std::arch::x86_64::*;
    const C: f32 = 0.797_884_6; // √(2/π)
    let n = dz.len();
    let whole = n / 16 * 16;
    for j in (0..whole).step_by(16) {
        let v = _mm512_add_ps(_mm512_loadu_ps(acc.as_ptr().add(j)), _mm512_loadu_ps(bias.as_ptr().add(j)));
        let v2 = _mm512_mul_ps(v, v);
        // x = −2u = v·(−2√(2/π))·(1 + 0.044715·v²), clamped to exp_f32's range; s = 1/(1 + e^x)
        let x =
            _mm512_mul_ps(_mm512_mul_ps(v, _mm512_set1_ps(-2.0 * C)), _mm512_fmadd_ps(v2, _mm512_set1_ps(0.044715), _mm512_set1_ps(1.0)));
        let x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-86.6)), _mm512_set1_ps(88.7));
        let d = _mm512_add_ps(exp_clamped_avx512(x), _mm512_set1_ps(1.0));
        let q = _mm512_rcp14_ps(d); // 1/d to 14 bits, then one Newton step: q·(2 − d·q)
        let s = _mm512_mul_ps(q, _mm512_fnmadd_ps(d, q, _mm512_set1_ps(2.0)));
        // gelu′ = s + v·s·(1 − s)·2√(2/π)·(1 + 3·0.044715·v²)
        let slope = _mm512_mul_ps(_mm512_set1_ps(2.0 * C), _mm512_fmadd_ps(v2, _mm512_set1_ps(3.0 * 0.044715), _mm512_set1_ps(1.0)));
        let vs = _mm512_mul_ps(v, _mm512_mul_ps(s, _mm512_sub_ps(_mm512_set1_ps(1.0), s)));
        let grad = _mm512_fmadd_ps(vs, slope, s);
        let g = _mm512_mul_ps(_mm512_loadu_ps(dy.as_ptr().add(j)), grad);
        _mm512_storeu_ps(dz.as_mut_ptr().add(j), g);
        _mm512_storeu_ps(db.as_mut_ptr().add(j), _mm512_add_ps(_mm512_loadu_ps(db.as_ptr().add(j)), g));
    }
    for j in whole..n {
        dz[j] = dy[j] * gelu_tanh_grad(acc[j] + bias[j]);
        db[j] += dz[j];
    }
}

/// The scalar GELU of `bias_gelu_tanh`: v / (1 + e^(−2u)).
#[inline(always)]
pub fn gelu_tanh_exp(v: f32) -> f32 {
    const SQRT_2_OVER_PI: f32 = 0.797_884_6;
    let u = SQRT_2_OVER_PI * (v + 0.044715 * v * v * v);
    v / (1.0 + exp_f32(-2.0 * u))
}

/// e^x for 16 values already clamped to exp_f32's range [−86.6, 88.7]: `exp_f32`'s algorithm
/// (x = n·ln2 + r, the same degree-5 polynomial for e^r) with two AVX-512 instructions in place
/// of its scalar-friendly tricks: `vrndscaleps` rounds x/ln2, `vscalefps` multiplies by 2^n;
/// about 10 instructions. The AVX-512 bodies that need exponentials (the fused GELU, the
/// attention softmax) inline it.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
#[inline]
pub(crate) unsafe fn exp_clamped_avx512(xc: std::arch::x86_64::__m512) -> std::arch::x86_64::__m512 {
    use std::arch::x86_64::*;
    let n = _mm512_roundscale_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(_mm512_mul_ps(
        xc,
        _mm512_set1_ps(std::f32::consts::LOG2_E),
    ));
    let r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693_359_4), xc); // r = x − n·ln2, in two parts
    let r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.121_944_4e-4), r);
    let mut p = _mm512_set1_ps(1.987_569_1e-4);
    for k in [1.398_199_9e-3, 8.333_452e-3, 4.166_579_6e-2, 1.666_666_5e-1, 0.5] {
        p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(k));
    }
    let er = _mm512_add_ps(_mm512_fmadd_ps(_mm512_mul_ps(p, r), r, r), _mm512_set1_ps(1.0)); // p·r² + r + 1
    _mm512_scalef_ps(er, n) // e^r · 2^n
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn bias_gelu_tanh_avx512(row: &mut [f32], bias: &[f32]) {
    use std::arch::x86_64::*;
    let mut rows = row.chunks_exact_mut(16);
    let mut biases = bias.chunks_exact(16);
    for (c, b) in (&mut rows).zip(&mut biases) {
        let v = _mm512_add_ps(_mm512_loadu_ps(c.as_ptr()), _mm512_loadu_ps(b.as_ptr()));
        // x = −2u = v·(−2√(2/π))·(1 + 0.044715·v²), clamped to exp_f32's range
        let v2 = _mm512_mul_ps(v, v);
        let inner = _mm512_fmadd_ps(v2, _mm512_set1_ps(0.044715), _mm512_set1_ps(1.0));
        let x = _mm512_mul_ps(_mm512_mul_ps(v, _mm512_set1_ps(-2.0 * 0.797_884_6)), inner);
        let x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-86.6)), _mm512_set1_ps(88.7));
        let e = exp_clamped_avx512(x);
        let d = _mm512_add_ps(e, _mm512_set1_ps(1.0));
        let q = _mm512_rcp14_ps(d); // 1/d to 14 bits, then one Newton step: q·(2 − d·q)
        let q = _mm512_mul_ps(q, _mm512_fnmadd_ps(d, q, _mm512_set1_ps(2.0)));
        _mm512_storeu_ps(c.as_mut_ptr(), _mm512_mul_ps(v, q));
    }
    for (v, &b) in rows.into_remainder().iter_mut().zip(biases.remainder()) {
        *v = gelu_tanh_exp(*v + b);
    }
}

/// v[i] = f(i, v[i]) on one slice, with the widest SIMD body this CPU has (i is the index within
/// the slice; no threads: for callers that already run in parallel, e.g. per block of rows).
#[inline]
pub fn map_slice_in_place<F: Fn(usize, f32) -> f32>(v: &mut [f32], f: &F) {
    match level() {
        // SAFETY: the CPU has the features these bodies are compiled for (checked in `level`).
        #[cfg(target_arch = "x86_64")]
        Level::Avx512 => unsafe { body_mut_avx512(v, f) },
        #[cfg(target_arch = "x86_64")]
        Level::Avx2 => unsafe { body_mut_avx2(v, f) },
        Level::Scalar => body_mut(v, f),
    }
}

/// v[i] = f(v[i]) in place, in parallel over chunks, SIMD inside.
pub fn map_in_place<F: Fn(f32) -> f32 + Sync>(v: &mut [f32], f: F) {
    v.par_chunks_mut(CHUNK).for_each(|c| map_slice_in_place(c, &|_, x| f(x)));
}

/// A contiguous CPU tensor's values, f32 or bf16, borrowed from its storage.
#[derive(Clone, Copy)]
enum Src<'a> {
    F32(&'a [f32]),
    Bf16(&'a [bf16]),
}

impl Src<'_> {
    fn len(&self) -> usize {
        match self {
            Src::F32(v) => v.len(),
            Src::Bf16(v) => v.len(),
        }
    }

    /// Elements [at, at + n) as f32: borrowed, or widened into `buf` (a task's own, in cache).
    fn f32s<'b>(&'b self, at: usize, n: usize, buf: &'b mut Vec<f32>) -> &'b [f32] {
        match self {
            Src::F32(v) => &v[at..at + n],
            Src::Bf16(v) => {
                buf.clear();
                buf.extend(v[at..at + n].iter().map(|x| x.to_f32()));
                buf
            }
        }
    }
}

/// `f` on a contiguous f32 or bf16 CPU tensor's values.
fn with_src<R>(t: &Tensor, f: impl FnOnce(Src) -> candle_core::Result<R>) -> candle_core::Result<R> {
    let t = t.contiguous()?;
    let (storage, layout) = t.storage_and_layout();
    match (&*storage, layout.contiguous_offsets()) {
        (Storage::Cpu(CpuStorage::F32(v)), Some((a, b))) => f(Src::F32(&v[a..b])),
        (Storage::Cpu(CpuStorage::BF16(v)), Some((a, b))) => f(Src::Bf16(&v[a..b])),
        _ => candle_core::bail!("elementwise: expected a contiguous f32 or bf16 CPU tensor, got {:?} on {:?}", t.dtype(), t.device()),
    }
}

/// Whether the engine's pass applies: untracked f32 or bf16 tensors on the CPU, one dtype.
fn fast(ts: &[&Tensor]) -> bool {
    let dt = ts[0].dtype();
    ts.iter().all(|t| t.device().is_cpu() && t.dtype() == dt && matches!(dt, DType::F32 | DType::BF16) && !t.track_op())
}

/// The trace's name for an op that ran on the engine or as candle's op.
fn ran(op: &str, engine: bool) {
    ran_passes(op, 1, engine)
}

/// `ran` for an op the engine runs in `passes` passes (LayerNorm's four, GELU's nine).
fn ran_passes(op: &str, passes: usize, engine: bool) {
    match (engine, passes) {
        (true, 1) => trace::ran_with(|| format!("{op}: engine pass ({})", simd())),
        (true, n) => trace::ran_with(|| format!("{op}: engine passes ×{n} ({})", simd())),
        (false, _) => trace::ran_with(|| format!("{op}: candle")),
    }
}

/// An output of `n` elements in `dtype` (f32 or bf16), written chunk by chunk on all threads:
/// `f(at, out)` fills f32 elements [at, at + len) and a bf16 output rounds each chunk once as it
/// stores it. Chunks are whole multiples of `row` elements (at least `CHUNK`), so `f` can work
/// row by row.
fn produce(
    n: usize,
    row: usize,
    dtype: DType,
    shape: &candle_core::Shape,
    f: impl Fn(usize, &mut [f32]) + Sync,
) -> candle_core::Result<Tensor> {
    let chunk = (CHUNK / row.max(1)).max(1) * row.max(1);
    match dtype {
        DType::BF16 => {
            // SAFETY: the chunks cover out, and each is written whole by narrow_bf16.
            let mut out = unsafe { uninit_of::<bf16>(n) };
            out.par_chunks_mut(chunk).enumerate().for_each(|(i, o)| {
                let mut tmp = vec![0f32; o.len()];
                f(i * chunk, &mut tmp);
                narrow_bf16(&tmp, o);
            });
            Tensor::from_vec(out, shape, &Device::Cpu)
        }
        _ => Tensor::from_vec(par_fill(n, row, f), shape, &Device::Cpu),
    }
}

/// n f32s written chunk by chunk on all threads: `f(at, out)` fills [at, at + out.len()), out a
/// whole number of `row`s.
fn par_fill(n: usize, row: usize, f: impl Fn(usize, &mut [f32]) + Sync) -> Vec<f32> {
    let chunk = (CHUNK / row.max(1)).max(1) * row.max(1);
    // SAFETY: the chunks cover the vector and `f` writes each whole (its contract).
    let mut out = unsafe { uninit_of::<f32>(n) };
    out.par_chunks_mut(chunk).enumerate().for_each(|(i, o)| f(i * chunk, o));
    out
}

/// y = f(x) element-wise, one parallel pass, in x's dtype.
fn unary(x: &Tensor, f: impl Fn(f32) -> f32 + Sync) -> candle_core::Result<Tensor> {
    with_src(x, |xs| {
        produce(xs.len(), 1, x.dtype(), x.shape(), |at, o| {
            let mut buf = Vec::new();
            map_slice(o, xs.f32s(at, o.len(), &mut buf), &|_, v| f(v))
        })
    })
}

/// y = f(a, b) element-wise where b is a's shape, or a's last dimension (broadcast over rows), in
/// a's dtype.
fn binary(a: &Tensor, b: &Tensor, f: impl Fn(f32, f32) -> f32 + Sync) -> candle_core::Result<Tensor> {
    with_src(a, |xs| {
        with_src(b, |bs| {
            let (n, nb) = (xs.len(), bs.len());
            if nb == n {
                return produce(n, 1, a.dtype(), a.shape(), |at, o| {
                    let (mut buf, mut buf2) = (Vec::new(), Vec::new());
                    let (s, r) = (xs.f32s(at, o.len(), &mut buf), bs.f32s(at, o.len(), &mut buf2));
                    map_slice(o, s, &|i, v| f(v, r[i]));
                });
            }
            // b is one row: whole rows per chunk, b's values once as f32.
            let mut row = Vec::new();
            let row = bs.f32s(0, nb, &mut row).to_vec();
            produce(n, nb, a.dtype(), a.shape(), |at, o| {
                let mut buf = Vec::new();
                let s = xs.f32s(at, o.len(), &mut buf);
                for (o, s) in o.chunks_mut(nb).zip(s.chunks(nb)) {
                    map_slice(o, s, &|i, v| f(v, row[i]));
                }
            })
        })
    })
}

/// a + b, b of a's shape or a's last dimension. Slow twin: `a.broadcast_add(b)`.
pub fn add(a: &Tensor, b: &Tensor, mode: Elementwise) -> candle_core::Result<Tensor> {
    let engine = mode == Elementwise::Parallel && fast(&[a, b]) && fits(a, b);
    ran("add", engine);
    match engine {
        true => binary(a, b, |x, y| x + y),
        false => a.broadcast_add(b),
    }
}

/// b has a's shape, or is one row of a's last dimension.
fn fits(a: &Tensor, b: &Tensor) -> bool {
    b.dims() == a.dims() || (b.rank() == 1 && a.dims().last() == b.dims().first())
}

/// y = x Wᵀ + b for x (B, T, in), W held by `w` (out, in): the engine's GEMM
/// (`bf16_gemm::matmul_prepacked`: bf16 W on the CPU's bf16 unit, packed once; an f32 x is
/// rounded to bf16 as it is packed and y stays f32; candle's matmul otherwise), then the bias add
/// as one pass. b in y's dtype. Slow twin: `stage0_baseline::linear`.
pub fn linear(x: &Tensor, w: &PackedWeight, b: &Tensor, mode: Elementwise) -> candle_core::Result<Tensor> {
    let (bsz, t, c_in) = x.dims3()?;
    let c_out = w.weight().dim(0)?;
    let y = bf16_gemm::matmul_prepacked(&x.reshape((bsz * t, c_in))?, w)?; // (B·T, out)
    if y.dtype() != DType::F32 && [x, w.weight(), b].iter().any(|t| t.track_op()) {
        // Training: the bias is added in f32, so that its gradient, a sum over the B·T rows,
        // accumulates in f32 (candle's CPU sum of a bf16 tensor accumulates in bf16, which loses
        // the bias gradient at a few thousand rows). The output is the same bits: candle's
        // 16-bit add is an f32 add rounded once.
        ran("add", false);
        let z = y.to_dtype(DType::F32)?.broadcast_add(&b.to_dtype(DType::F32)?)?;
        return z.to_dtype(y.dtype())?.reshape((bsz, t, c_out));
    }
    add(&y, &b.to_dtype(y.dtype())?, mode)?.reshape((bsz, t, c_out))
}

/// The cast, in parallel where it is between f32 and bf16/f16 on the CPU (candle's is a
/// single-threaded loop). Slow twin: `x.to_dtype(dtype)`.
pub fn to_dtype(x: &Tensor, dtype: DType, mode: Elementwise) -> candle_core::Result<Tensor> {
    if x.dtype() == dtype {
        return Ok(x.clone()); // no pass at all
    }
    if mode == Elementwise::Candle || !x.device().is_cpu() || x.track_op() {
        ran("cast", false);
        return x.to_dtype(dtype);
    }
    let x = x.contiguous()?;
    let (storage, layout) = x.storage_and_layout();
    let Some((a, b)) = layout.contiguous_offsets() else { return x.to_dtype(dtype) };
    let shape = x.shape().clone();
    let out = match (&*storage, dtype) {
        (Storage::Cpu(CpuStorage::F32(v)), DType::BF16) => {
            // SAFETY: the chunks cover out, each written whole by narrow_bf16.
            let mut out = unsafe { uninit_of::<bf16>(b - a) };
            out.par_chunks_mut(CHUNK).zip(v[a..b].par_chunks(CHUNK)).for_each(|(o, s)| narrow_bf16(s, o));
            Tensor::from_vec(out, shape, &Device::Cpu)
        }
        (Storage::Cpu(CpuStorage::F32(v)), DType::F16) => Tensor::from_vec(par_convert(&v[a..b], half::f16::from_f32), shape, &Device::Cpu),
        (Storage::Cpu(CpuStorage::BF16(v)), DType::F32) => Tensor::from_vec(par_convert(&v[a..b], bf16::to_f32), shape, &Device::Cpu),
        (Storage::Cpu(CpuStorage::F16(v)), DType::F32) => Tensor::from_vec(par_convert(&v[a..b], half::f16::to_f32), shape, &Device::Cpu),
        _ => {
            ran("cast", false);
            return x.to_dtype(dtype);
        }
    };
    ran("cast", true);
    out
}

/// `f` over `src` on all threads, into a new vector (the casts between f32 and bf16/f16).
pub fn par_convert<S: Copy + Sync, D: Copy + Send + Default>(src: &[S], f: impl Fn(S) -> D + Sync) -> Vec<D> {
    let mut out = vec![D::default(); src.len()];
    out.par_chunks_mut(CHUNK).zip(src.par_chunks(CHUNK)).for_each(|(o, s)| o.iter_mut().zip(s).for_each(|(o, &s)| *o = f(s)));
    out
}

/// LayerNorm over the last dimension as stage 0 writes it, each step a pass on all threads:
/// the row means (one read of x), x − mean (a read and a write), the row variances of that
/// (a read), then (x − mean)·(1/√(var + ε))·g + b (a read and a write) — four passes over
/// (rows, C), where stage 3's fused LayerNorm makes one. The statistics sum in f64 per row.
/// In x's dtype (f32 or bf16). Slow twin: `stage0_baseline::layer_norm`, i.e. the nine primitives
/// (mean, sub, sqr, mean, +ε, sqrt, div, ·g, +b) — the candle branch below.
pub fn layer_norm(x: &Tensor, g: &Tensor, b: &Tensor, eps: f64, mode: Elementwise) -> candle_core::Result<Tensor> {
    let train = mode == Elementwise::Parallel && grad::tracked_f32(&[x, g, b]);
    let engine = train || mode == Elementwise::Parallel && fast(&[x]) && fast(&[g, b]) && g.dtype() == DType::F32;
    ran_passes("layer_norm", 4, engine);
    if !engine {
        let mean = x.mean_keepdim(candle_core::D::Minus1)?; // (B, T, 1)
        let xc = x.broadcast_sub(&mean)?;
        let var = xc.sqr()?.mean_keepdim(candle_core::D::Minus1)?;
        let xhat = xc.broadcast_div(&(var + eps)?.sqrt()?)?;
        return xhat.broadcast_mul(g)?.broadcast_add(b);
    }
    let c = x.dim(candle_core::D::Minus1)?;
    if g.dims() != [c] || b.dims() != [c] {
        candle_core::bail!("layer_norm: g {:?} and b {:?} must be ({c}), the last dimension of x {:?}", g.dims(), b.dims(), x.dims());
    }
    let rows = x.elem_count() / c.max(1);
    // Pass 1: row means.
    let means: Vec<f64> = with_src(x, |xs| {
        Ok((0..rows)
            .into_par_iter()
            .map_init(Vec::new, |buf, r| xs.f32s(r * c, c, buf).iter().map(|&v| v as f64).sum::<f64>() / c as f64)
            .collect())
    })?;
    // Pass 2: x − mean, in f64 and rounded once to f32 (a mean of 1e4 rounded to f32 first would
    // be off by 5e-4, a large error next to a spread of 0.01).
    let centred = with_src(x, |xs| {
        produce(xs.len(), c, DType::F32, x.shape(), |at, o| {
            let mut buf = Vec::new();
            let s = xs.f32s(at, o.len(), &mut buf);
            for (r, (o, s)) in o.chunks_mut(c).zip(s.chunks(c)).enumerate() {
                let m = means[at / c + r];
                map_slice(o, s, &|_, v| (v as f64 - m) as f32);
            }
        })
    })?;
    // Pass 3: row variances of the centred values.
    let inv_std: Vec<f32> = with_src(&centred, |cs| {
        Ok((0..rows)
            .into_par_iter()
            .map_init(Vec::new, |buf, r| {
                let var = cs.f32s(r * c, c, buf).iter().map(|&v| (v as f64) * (v as f64)).sum::<f64>() / c as f64;
                (1.0 / (var + eps).sqrt()) as f32
            })
            .collect())
    })?;
    if train {
        // Pass 4 as a custom op, so that autograd records it (`grad::LayerNorm`, its backward).
        return x.apply_op3(&g.contiguous()?, &b.contiguous()?, grad::LayerNorm { centred, inv_std });
    }
    // Pass 4: normalise, scale and shift, in x's dtype.
    with_src(&centred, |cs| {
        with_src(g, |gs| {
            with_src(b, |bs| {
                let (Src::F32(gs), Src::F32(bs)) = (gs, bs) else { candle_core::bail!("layer_norm: g and b must be f32") };
                produce(cs.len(), c, x.dtype(), x.shape(), |at, o| {
                    let mut buf = Vec::new();
                    let s = cs.f32s(at, o.len(), &mut buf);
                    for (r, (o, s)) in o.chunks_mut(c).zip(s.chunks(c)).enumerate() {
                        let inv = inv_std[at / c + r];
                        map_slice(o, s, &|i, v| v * inv * gs[i] + bs[i]);
                    }
                })
            })
        })
    })
}

/// A row's LayerNorm statistics, in the form that normalises accurately in f32:
/// x̂ = ((x − shift) + shift_minus_mean) · inv_std. `shift` is the row's first value, so for a
/// row with a large mean and a small spread x − shift is exact (Sterbenz) and small, and the
/// rounding of the mean to f32 (ulp(1e4) ≈ 1e-3, a large error next to a spread of 0.01) never
/// enters: only the small f64-computed `shift − mean` is rounded.
#[derive(Clone, Copy, Debug)]
pub struct RowStats {
    pub shift: f32,
    pub shift_minus_mean: f32,
    /// 1 / √(var + ε), var biased (as PyTorch).
    pub inv_std: f32,
}

/// A row's statistics from ONE read of the row: Σ(x − K) and Σ(x − K)² in f64, shifted by
/// K = the row's first value, then var = (S₂ − S₁²/n)/n. The shift is what keeps this accurate
/// when the mean is large next to the spread: unshifted, E[x²] − mean² subtracts two numbers
/// ~mean² apart by ~σ² and loses log₁₀(mean²/σ²) digits (8 at mean 1e4, σ = 1: all f32 has);
/// shifted, the sums are of values ~σ and nothing cancels unless x₀ itself is many σ from the
/// mean. f64 holds x − K and its square exactly for f32 x. 32 partial sums of each, so the
/// loop vectorises (AVX-512: four registers of f64 lanes each, four independent chains of adds:
/// with one register each, every add waited for the last, 4 cycles a step).
#[inline]
pub fn row_stats(row: &[f32], eps: f64) -> RowStats {
    let Some(&first) = row.first() else { return RowStats { shift: 0.0, shift_minus_mean: 0.0, inv_std: 0.0 } };
    let k = first as f64;
    let (mut s1, mut s2) = ([0f64; 32], [0f64; 32]);
    let mut chunks = row.chunks_exact(32);
    for ch in &mut chunks {
        for ((a, b), &v) in s1.iter_mut().zip(s2.iter_mut()).zip(ch) {
            let y = v as f64 - k;
            *a += y;
            *b += y * y;
        }
    }
    let (mut t1, mut t2) = (s1.iter().sum::<f64>(), s2.iter().sum::<f64>());
    for &v in chunks.remainder() {
        let y = v as f64 - k;
        t1 += y;
        t2 += y * y;
    }
    let n = row.len() as f64;
    let var = ((t2 - t1 * t1 / n) / n).max(0.0);
    RowStats { shift: first, shift_minus_mean: (-t1 / n) as f32, inv_std: (1.0 / (var + eps).sqrt()) as f32 }
}

/// Σ row with 16 partial sums, so the loop vectorises (a single f32 accumulator cannot be
/// reordered by the compiler).
#[inline]
pub fn sum_f32(row: &[f32]) -> f32 {
    let mut acc = [0f32; 16];
    let mut chunks = row.chunks_exact(16);
    for c in &mut chunks {
        for (a, &v) in acc.iter_mut().zip(c) {
            *a += v;
        }
    }
    acc.iter().sum::<f32>() + chunks.remainder().iter().sum::<f32>()
}

/// max of a row with 16 partial maxima, so the loop vectorises; −∞ for an empty row.
#[inline]
pub fn max_f32(row: &[f32]) -> f32 {
    let mut acc = [f32::NEG_INFINITY; 16];
    let mut chunks = row.chunks_exact(16);
    for c in &mut chunks {
        for (a, &v) in acc.iter_mut().zip(c) {
            *a = if v > *a { v } else { *a };
        }
    }
    acc.iter().chain(chunks.remainder()).fold(f32::NEG_INFINITY, |m, &v| if v > m { v } else { m })
}

/// GELU, tanh approximation, from the same nine primitives as `stage0_baseline::gelu_tanh`
/// (x², ·x, ·0.044715, +x, ·√(2/π), tanh, +1, ·x, ·0.5), each one parallel pass; `tanh` is
/// `tanh_f32` (vectorised) instead of libm's. Slow twin: `stage0_baseline::gelu_tanh`.
pub fn gelu_tanh(x: &Tensor, mode: Elementwise) -> candle_core::Result<Tensor> {
    let train = mode == Elementwise::Parallel && grad::tracked_f32(&[x]);
    let engine = train || mode == Elementwise::Parallel && fast(&[x]);
    ran_passes("gelu", 9, engine);
    if !engine {
        let x3 = (x.sqr()? * x)?;
        let inner = ((x + (x3 * 0.044715)?)? * (2.0 / std::f64::consts::PI).sqrt())?;
        return ((inner.tanh()? + 1.0)? * x)? * 0.5;
    }
    let k = (2.0 / std::f64::consts::PI).sqrt() as f32;
    let x2 = unary(x, |v| v * v)?;
    let x3 = binary(&x2, x, |a, b| a * b)?;
    let x3 = unary(&x3, |v| v * 0.044715)?;
    let inner = binary(x, &x3, |a, b| a + b)?;
    let inner = unary(&inner, |v| v * k)?;
    let th = unary(&inner, tanh_f32)?;
    let th = unary(&th, |v| v + 1.0)?;
    let y = binary(&th, x, |a, b| a * b)?;
    if train {
        return x.apply_op1(grad::Gelu { t: y }); // the ninth pass, recorded with its backward
    }
    unary(&y, |v| v * 0.5)
}

/// Softmax over the last dimension as stage 0 writes it, each step a pass on all threads: the
/// row maxima (a read), s − max (a read and a write), exp (a read and a write; `exp_f32`), the
/// row sums (a read), then e / Σe (a read and a write) — five passes. f32 only (scores are f32
/// in every stage). Slow twin: `stage0_baseline::softmax`, i.e. candle's five ops — the candle
/// branch below.
pub fn softmax_last_dim(s: &Tensor, mode: Elementwise) -> candle_core::Result<Tensor> {
    let train = mode == Elementwise::Parallel && grad::tracked_f32(&[s]);
    let engine = train || mode == Elementwise::Parallel && fast(&[s]) && s.dtype() == DType::F32;
    ran_passes("softmax", 5, engine);
    if !engine {
        let m = s.max_keepdim(candle_core::D::Minus1)?;
        let e = s.broadcast_sub(&m)?.exp()?;
        return e.broadcast_div(&e.sum_keepdim(candle_core::D::Minus1)?);
    }
    let n = s.dim(candle_core::D::Minus1)?;
    let rows = s.elem_count() / n.max(1);
    // Pass 1: row maxima.
    let maxima: Vec<f32> =
        with_src(s, |ss| Ok((0..rows).into_par_iter().map_init(Vec::new, |buf, r| max_f32(ss.f32s(r * n, n, buf))).collect()))?;
    // Passes 2 and 3: s − max, then exp of that.
    let shifted = with_src(s, |ss| {
        produce(ss.len(), n, DType::F32, s.shape(), |at, o| {
            let mut buf = Vec::new();
            let src = ss.f32s(at, o.len(), &mut buf);
            for (r, (o, src)) in o.chunks_mut(n).zip(src.chunks(n)).enumerate() {
                let m = maxima[at / n + r];
                map_slice(o, src, &|_, v| v - m);
            }
        })
    })?;
    let e = unary(&shifted, exp_f32)?;
    drop(shifted);
    // Pass 4: row sums.
    let sums: Vec<f32> =
        with_src(&e, |es| Ok((0..rows).into_par_iter().map_init(Vec::new, |buf, r| sum_f32(es.f32s(r * n, n, buf))).collect()))?;
    if train {
        return s.apply_op1(grad::Softmax { e, sums }); // pass 5, recorded with its backward
    }
    // Pass 5: e / Σe.
    with_src(&e, |es| {
        let Src::F32(es) = es else { candle_core::bail!("softmax: expected f32") };
        Tensor::from_vec(grad::div_rows(es, &sums, n), s.shape(), &Device::Cpu)
    })
}

/// e^x in f32 without libm, so loops over it vectorise (Cephes' expf: x = n·ln2 + r, |r| ≤ ln2/2,
/// a degree-5 polynomial for e^r, 2^n by building the exponent bits). Within 2 ulp of libm on
/// [−86.6, 88.7]; 0 below (no subnormal results), +∞ above 88.72 (as libm); NaN stays NaN.
#[inline(always)]
pub fn exp_f32(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    const ROUND: f32 = 12_582_912.0; // 1.5·2²³: adding and subtracting it rounds to an integer
    let xc = x.clamp(-86.6, 88.7);
    let shifted = xc * LOG2E + ROUND; // round(x / ln2) + 1.5·2²³: the integer sits in the low mantissa bits
    let n = shifted - ROUND; // round(x / ln2), in [−125, 128]
                             // The same integer read from the bits, not by `n as i32`: Rust's saturating float-to-int
                             // cast kept LLVM from vectorising loops over this function (one scalar conversion per value).
    let n_int = shifted.to_bits().wrapping_sub(ROUND.to_bits()) as i32;
    let r = xc - n * LN2_HI - n * LN2_LO;
    let p = 1.987_569_1e-4;
    let p = p * r + 1.398_199_9e-3;
    let p = p * r + 8.333_452e-3;
    let p = p * r + 4.166_579_6e-2;
    let p = p * r + 1.666_666_5e-1;
    let p = p * r + 0.5; // Cephes: 5.0000001201e-1, which is 0.5 in f32
    let er = p * r * r + r + 1.0;
    let y = er * f32::from_bits(((n_int + 126) as u32) << 23) * 2.0; // 2^(n−1)·2: n = 128 stays finite
    if x < -86.6 {
        0.0
    } else if x > 88.72 {
        f32::INFINITY
    } else {
        y
    }
}

/// tanh without libm (vectorises): (e^{2u} − 1)/(e^{2u} + 1), and its Taylor series near 0 where
/// that form cancels; ±1 beyond |u| = 9 (tanh(9) rounds to 1 in f32). Absolute error < 2e-7.
#[inline(always)]
pub fn tanh_f32(u: f32) -> f32 {
    let uc = u.clamp(-9.0, 9.0);
    let e = exp_f32(2.0 * uc);
    let big = (e - 1.0) / (e + 1.0);
    let u2 = u * u;
    let small = u * (1.0 + u2 * (-1.0 / 3.0 + u2 * (2.0 / 15.0 + u2 * (-17.0 / 315.0))));
    if u.abs() < 0.04 {
        small
    } else {
        big
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn max_abs_diff(a: &Tensor, b: &Tensor) -> f32 {
        (a - b).unwrap().abs().unwrap().flatten_all().unwrap().max(0).unwrap().to_scalar::<f32>().unwrap()
    }

    fn rand(dims: &[usize], seed: u64, scale: f64) -> Tensor {
        // A seeded host RNG (splitmix), so a failing case reproduces.
        let n: usize = dims.iter().product();
        let mut s = seed.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let v: Vec<f32> = (0..n)
            .map(|_| {
                s = s.wrapping_add(0x9E37_79B9_7F4A_7C15);
                let mut z = s;
                z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
                z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
                z ^= z >> 31;
                (((z >> 40) as f64 / (1u64 << 24) as f64 - 0.5) * 2.0 * scale) as f32
            })
            .collect();
        Tensor::from_vec(v, dims, &Device::Cpu).unwrap()
    }

    #[test]
    fn exp_and_tanh_match_libm() {
        let mut worst = (0f32, 0f32);
        for i in -200_000..=200_000 {
            let x = i as f32 * 4.3e-4; // [−86, 86]
            let rel = (exp_f32(x) - x.exp()).abs() / x.exp();
            worst.0 = worst.0.max(rel);
            let u = i as f32 * 5e-5; // [−10, 10]
            worst.1 = worst.1.max((tanh_f32(u) - u.tanh()).abs());
        }
        assert!(worst.0 < 3e-7, "exp relative error {}", worst.0);
        assert!(worst.1 < 2e-7, "tanh absolute error {}", worst.1);
        assert!(exp_f32(f32::NAN).is_nan() && tanh_f32(f32::NAN).is_nan());
        assert_eq!((tanh_f32(50.0), tanh_f32(-50.0)), (1.0, -1.0));
        assert_eq!((exp_f32(-1000.0), exp_f32(1000.0)), (0.0, f32::INFINITY));
        assert!((exp_f32(88.7) - 88.7f32.exp()).abs() / 88.7f32.exp() < 3e-7);
    }

    /// An untracked input runs the engine's pass, for f32 and bf16 alike; a tracked one
    /// (training) the engine's custom op where there is one for f32 (`grad`), candle's op
    /// otherwise — differentiable either way, and named so in the kernel trace.
    #[test]
    fn tracked_tensors_take_candles_ops_and_the_trace_says_which_ran() {
        for dt in [DType::F32, DType::BF16] {
            let x = rand(&[3, 40], 1, 1.0).to_dtype(dt).unwrap();
            let (g, b) = (rand(&[40], 2, 0.1).affine(1.0, 1.0).unwrap(), rand(&[40], 3, 0.1));
            crate::trace::start();
            let y = gelu_tanh(
                &add(&layer_norm(&x, &g, &b, LN_EPS, Elementwise::Parallel).unwrap(), &x, Elementwise::Parallel).unwrap(),
                Elementwise::Parallel,
            )
            .unwrap();
            let ran = crate::trace::stop();
            assert!(ran.iter().all(|k| k.contains(": engine pass")), "{dt:?}: {ran:?}");
            assert_eq!(y.dtype(), dt);
            let v = candle_core::Var::from_tensor(&x).unwrap();
            crate::trace::start();
            let y = gelu_tanh(&add(v.as_tensor(), v.as_tensor(), Elementwise::Parallel).unwrap(), Elementwise::Parallel).unwrap();
            let grads = y.sum_all().unwrap().backward().unwrap();
            let ran = crate::trace::stop();
            match dt {
                DType::F32 => assert_eq!(
                    ran,
                    [
                        "add: candle".to_string(),
                        format!("gelu: engine passes ×9 ({})", simd()),
                        format!("gelu backward: engine pass ({})", simd())
                    ]
                ),
                _ => assert_eq!(ran, ["add: candle", "gelu: candle"]),
            }
            assert!(grads.get(v.as_tensor()).is_some(), "a gradient reaches the tracked input");
        }
    }

    #[test]
    fn bf16_passes_match_candles_bf16_ops() {
        // One rounding per pass, as candle's bf16 ops round once per op: within one bf16 ulp.
        let x = rand(&[7, 300], 4, 3.0).to_dtype(DType::BF16).unwrap();
        let r = rand(&[300], 5, 1.0).to_dtype(DType::BF16).unwrap();
        let up = |t: &Tensor| t.to_dtype(DType::F32).unwrap();
        let got = add(&x, &r, Elementwise::Parallel).unwrap();
        let want = x.broadcast_add(&r).unwrap();
        assert_eq!(got.dtype(), DType::BF16);
        assert!(max_abs_diff(&up(&got), &up(&want)) <= 0.0625, "{}", max_abs_diff(&up(&got), &up(&want)));
        let (g, b) = (rand(&[300], 6, 0.1).affine(1.0, 1.0).unwrap(), rand(&[300], 7, 0.1));
        let got = layer_norm(&x, &g, &b, LN_EPS, Elementwise::Parallel).unwrap();
        let want = layer_norm(&up(&x), &g, &b, LN_EPS, Elementwise::Candle).unwrap();
        assert!(max_abs_diff(&up(&got), &want) < 2e-2, "{}", max_abs_diff(&up(&got), &want));
    }

    #[test]
    fn store_f32_rounds_as_the_scalar_conversion_in_every_dtype() {
        // 37 values (two 16-lane vectors and a tail), halfway cases and specials included.
        let mut src: Vec<f32> = (0..31).map(|i| (i as f32 - 15.0) * 0.731 + 1e-3 * i as f32).collect();
        src.extend([1.0 + 1.0 / 256.0, 1.0 + 3.0 / 256.0, -0.0, f32::INFINITY, 3.0e38, 1e-30]);
        let (mut f, mut b, mut h) = (vec![0f32; 37], vec![bf16::ZERO; 37], vec![half::f16::ZERO; 37]);
        store_f32(&src, &mut f);
        store_f32(&src, &mut b);
        store_f32(&src, &mut h);
        for (i, &v) in src.iter().enumerate() {
            assert_eq!(f[i].to_bits(), v.to_bits(), "f32 {v}");
            assert_eq!(b[i].to_bits(), bf16::from_f32(v).to_bits(), "bf16 {v}");
            assert_eq!(h[i].to_bits(), half::f16::from_f32(v).to_bits(), "f16 {v}");
        }
    }

    #[test]
    fn bias_gelu_grad_agrees_with_its_formula() {
        // The same sweep as the forward's test below (both tails, zero, a ragged tail of 9): dz
        // against dy·gelu_tanh_grad within a few ulp of its scale plus e^(−2u)'s condition, and
        // db the sum of dz over two rows.
        let n = 1001;
        let acc: Vec<f32> = (0..n).map(|i| (i as f32 - 500.0) * 0.023 + if i % 97 == 0 { 60.0 } else { 0.0 }).collect();
        let b: Vec<f32> = (0..n).map(|i| ((i * 37) % 11) as f32 * 0.05 - 0.25).collect();
        let dy: Vec<f32> = (0..n).map(|i| ((i * 13) % 7) as f32 * 0.3 - 1.0).collect();
        let (mut dz, mut db) = (vec![0f32; n], vec![0.5f32; n]);
        bias_gelu_tanh_grad(&dy, &acc, &b, &mut dz, &mut db);
        bias_gelu_tanh_grad(&dy, &acc, &b, &mut dz, &mut db);
        for j in 0..n {
            let y = acc[j] + b[j];
            let want = dy[j] * gelu_tanh_grad(y);
            let two_u = (2.0 * 0.797_884_6 * (y + 0.044715 * y * y * y)).abs().min(90.0);
            let tol = (8.0 + 4.0 * two_u) * f32::EPSILON * (dy[j].abs() * (1.0 + y.abs())) + 1e-30;
            assert!((dz[j] - want).abs() <= tol, "{y}: {} vs {want}", dz[j]);
            assert!((db[j] - (0.5 + 2.0 * dz[j])).abs() <= 4.0 * f32::EPSILON * (0.5 + 2.0 * dz[j].abs()), "db at {j}");
        }
    }

    #[test]
    fn bias_gelu_agrees_with_its_formula_to_a_few_ulp() {
        // 1001 values: two thousand-wide sweeps of both tails, zero, and a ragged tail of 9.
        let v: Vec<f32> = (0..1001).map(|i| (i as f32 - 500.0) * 0.023 + if i % 97 == 0 { 60.0 } else { 0.0 }).collect();
        let b: Vec<f32> = (0..1001).map(|i| ((i * 37) % 11) as f32 * 0.05 - 0.25).collect();
        let mut got = v.clone();
        bias_gelu_tanh(&mut got, &b);
        for ((&g, &x), &bb) in got.iter().zip(&v).zip(&b) {
            let want = gelu_tanh_exp(x + bb);
            // A few ulp, plus e^(−2u)'s condition: its argument is rounded differently (one ulp
            // of |2u| moves e^(−2u), and the far negative tail, by |2u|·ε relative).
            let y = x + bb;
            let two_u = (2.0 * 0.797_884_6 * (y + 0.044715 * y * y * y)).abs();
            // Past e^88.7 the scalar form divides by ∞ (−0), the vector one clamps (~1e-38).
            assert!((g - want).abs() <= (4.0 + 2.0 * two_u) * f32::EPSILON * want.abs() + 1e-30, "{x} + {bb}: {g} vs {want}");
            // and the function it stands for: 0.5·v·(1 + tanh u), to the formula's own accuracy
            let y = (x + bb) as f64;
            let exact = 0.5 * y * (1.0 + (0.797_884_560_802_865_4 * (y + 0.044715 * y * y * y)).tanh());
            assert!((g as f64 - exact).abs() <= 1e-6 * exact.abs().max(1e-3), "{y}: {g} vs {exact}");
        }
    }

    #[test]
    fn every_simd_body_agrees_with_the_scalar_one() {
        let src: Vec<f32> = (0..1000).map(|i| (i as f32 - 500.0) * 0.013).collect();
        let f = |i: usize, v: f32| tanh_f32(v) + i as f32;
        let (mut a, mut b) = (vec![0f32; 1000], vec![0f32; 1000]);
        body(&mut a, &src, &f);
        map_slice(&mut b, &src, &f);
        for (x, y) in a.iter().zip(&b) {
            assert!((x - y).abs() <= 1e-6 * x.abs().max(1.0), "{x} vs {y}");
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(24))]

        #[test]
        fn layer_norm_matches_primitives(rows in 1usize..40, c in 1usize..300, seed in 0u64..1000, scale in 0.1f64..20.0) {
            let x = (rand(&[rows, c], seed, scale) + 3.0).unwrap(); // a non-zero mean
            let g = (rand(&[c], seed + 1, 0.1) + 1.0).unwrap();
            let b = rand(&[c], seed + 2, 0.1);
            let fast = layer_norm(&x, &g, &b, 1e-5, Elementwise::Parallel).unwrap();
            let slow = layer_norm(&x, &g, &b, 1e-5, Elementwise::Candle).unwrap();
            prop_assert!(max_abs_diff(&fast, &slow) < 2e-4, "diff {}", max_abs_diff(&fast, &slow));
        }

        #[test]
        fn layer_norm_matches_f64(rows in 1usize..30, c in 1usize..1100, seed in 0u64..1000,
                                           mean in prop_oneof![Just(0.0f64), -50.0f64..50.0, Just(1e4), Just(-3e4)],
                                           scale in 0.01f64..20.0) {
            // Against LayerNorm computed in f64 from the same f32 values, with rows whose mean is
            // far from zero next to their spread (1e4 ± 0.01 and up): where E[x²] − mean² would fail.
            let x = (rand(&[rows, c], seed, scale) + mean).unwrap();
            let g = (rand(&[c], seed + 1, 0.1) + 1.0).unwrap();
            let b = rand(&[c], seed + 2, 0.1);
            let got = layer_norm(&x, &g, &b, 1e-5, Elementwise::Parallel).unwrap().to_vec2::<f32>().unwrap();
            let (xs, gs, bs) = (x.to_vec2::<f32>().unwrap(), g.to_vec1::<f32>().unwrap(), b.to_vec1::<f32>().unwrap());
            for (row, out) in xs.iter().zip(&got) {
                let n = c as f64;
                let m = row.iter().map(|&v| v as f64).sum::<f64>() / n;
                let var = row.iter().map(|&v| (v as f64 - m).powi(2)).sum::<f64>() / n;
                let inv = 1.0 / (var + 1e-5).sqrt();
                for (i, (&v, &o)) in row.iter().zip(out).enumerate() {
                    let want = (v as f64 - m) * inv * gs[i] as f64 + bs[i] as f64;
                    // A few f32 ulps of each step: (x − x₀), + (x₀ − mean), ·1/σ, ·g, + b.
                    let eps = f32::EPSILON as f64;
                    let tol = 4.0 * eps * ((v as f64 - row[0] as f64).abs() + (row[0] as f64 - m).abs()) * inv * gs[i].abs() as f64
                        + 4.0 * eps * (want.abs() + bs[i].abs() as f64) + 1e-7;
                    prop_assert!((o as f64 - want).abs() <= tol, "row mean {m} var {var}: {o} vs {want} (tol {tol})");
                }
            }
        }

        #[test]
        fn gelu_matches_primitives(n in 1usize..70_000, seed in 0u64..1000, scale in 0.01f64..12.0) {
            let x = rand(&[n], seed, scale);
            let fast = gelu_tanh(&x, Elementwise::Parallel).unwrap();
            let slow = gelu_tanh(&x, Elementwise::Candle).unwrap();
            prop_assert!(max_abs_diff(&fast, &slow) < 2e-6 * scale.max(1.0) as f32, "diff {}", max_abs_diff(&fast, &slow));
        }

        #[test]
        fn add_linear_and_casts_match_candle(rows in 1usize..50, k in 1usize..64, n in 1usize..90, seed in 0u64..1000) {
            let x = rand(&[2, rows, k], seed, 1.0);
            let w = rand(&[n, k], seed + 1, 0.5);
            let b = rand(&[n], seed + 2, 0.5);
            let w = PackedWeight::new(&w).unwrap();
            let fast = linear(&x, &w, &b, Elementwise::Parallel).unwrap();
            let slow = linear(&x, &w, &b, Elementwise::Candle).unwrap();
            prop_assert_eq!(fast.to_vec3::<f32>().unwrap(), slow.to_vec3::<f32>().unwrap()); // same GEMM, same add
            let r = rand(&[2, rows, n], seed + 3, 1.0);
            prop_assert_eq!(add(&fast, &r, Elementwise::Parallel).unwrap().to_vec3::<f32>().unwrap(),
                            (&fast + &r).unwrap().to_vec3::<f32>().unwrap());
            for dt in [DType::BF16, DType::F16] {
                let fast = to_dtype(&r, dt, Elementwise::Parallel).unwrap();
                let slow = r.to_dtype(dt).unwrap();
                prop_assert_eq!(fast.dtype(), dt);
                let (f, s) = (fast.to_dtype(DType::F32).unwrap(), slow.to_dtype(DType::F32).unwrap());
                prop_assert_eq!(f.to_vec3::<f32>().unwrap(), s.to_vec3::<f32>().unwrap()); // same rounding (RNE)
                let back = to_dtype(&slow, DType::F32, Elementwise::Parallel).unwrap();
                prop_assert_eq!(back.to_vec3::<f32>().unwrap(), s.to_vec3::<f32>().unwrap());
            }
        }
    }
}
