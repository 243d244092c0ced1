//! A bf16 GEMM for the CPU: stage 1's lesson on a CPU's own matrix units.
//!
//! `matmul(a, b)` is candle's `a.matmul(b)` when either operand is bf16, run on the widest bf16
//! unit this CPU has, f32 accumulation inside, the result in a's dtype: bf16 × bf16 gives bf16
//! (as on a GPU's tensor cores), an f32 activation × a bf16 weight gives f32, the activation
//! rounded to bf16 as it is packed (no conversion pass). `matmul_bf16` runs two f32 operands
//! the same way. On CUDA, and for other dtypes, it is candle's matmul. Its slow twin is
//! `matmul_slow` (round to bf16, widen to f32, candle's f32 matmul, narrow), and the kernel's
//! scalar twin is `gemm_scalar`; `tests/bf16_gemm.rs` pairs them.
//!
//! | kernel             | instruction                                 | per instruction                         |
//! |--------------------|---------------------------------------------|-----------------------------------------|
//! | `amx`              | `tdpbf16ps` on 16 × 32 bf16 tiles           | a 16 × 16 f32 tile += 16 × 32 · 32 × 16 |
//! | `avx512-bf16`      | `vdpbf16ps` (`_mm512_dpbf16_ps`)            | 16 f32 lanes += two bf16 products each  |
//! | `mkl`              | MKL's `cblas_gemm_bf16bf16f32` (`mkl` build) | MKL's own kernels                       |
//! | `converted to f32` | none: widen, f32 GEMM, narrow               | (a CPU without bf16 instructions)       |
//!
//! **Why it is faster.** `vdpbf16ps` reads bf16 *pairs*: each 32-bit lane of its operands holds
//! two adjacent-k bf16 values, and it adds both products into one f32 lane — twice the
//! multiply-adds of an f32 FMA per instruction, from half the bytes. AMX's `tdpbf16ps` does a
//! whole 16 × 16 × 32 product per instruction. An f32 GEMM on bf16 data instead widens every
//! operand first and runs at the f32 rate.
//!
//! **The pair layout.** Both operands are packed so that the instruction's pairs are adjacent k:
//! A (m × k) as micro-panels of `MR` rows, each k-pair of a row one u32 (broadcast to all lanes);
//! B (k × n) as micro-panels of `NR` columns, each k-pair of a column one u32 (a row of 32 u32 is
//! two zmm registers, and AMX's B tile reads the same layout). An odd K leaves the last pair half
//! empty: the packing writes a zero there, which adds 0·0 and changes nothing. Rows and columns
//! past the edge are zero too, and their results are never stored.
//!
//! **Blocking and threads**, as the fp32 paths (the gemm crate, BLIS): B is packed once per
//! call (or once per layer: `PackedB`, `PackedWeight`); each rayon task takes `MC` rows × `NC`
//! columns of C and, per `KC`-pair slice of k, packs its A block (`MC × KC` pairs, 144 KiB: L2)
//! and runs the micro-kernel over every `MR × NR` tile with one B micro-panel (`KC × NR` pairs,
//! 48 KiB, streamed from L2) at a time. Each slice loads and stores the C tile once, so the
//! slice is long: at K = 768 (the block's C) all of k is one slice. Where a task would pack rows
//! another task packs too (C wider than one column block: fc1, and dX of fc2) or would read them
//! a page apart (a column-major A: the weight gradient's dZᵀ), A is packed whole before the
//! tasks instead (`pack_a_whole`, two bytes per element, once per call); a row-major B (the
//! weight gradient's x) is read row pair by row pair in memory order (`pack_across`).
//! A bf16 C (`gemm_packed_bf16`, what `matmul_prepacked` gives bf16 activations) is summed per
//! task in an f32 scratch that stays in L2 and rounded to bf16 as the task stores it.
//! The `MR × NR` = 12 × 32 accumulator tile is 24 zmm registers, leaving room for two B rows and
//! the broadcast A pair.
//!
//! **What it costs.** Operands are bf16 (8 significant bits), so the products carry bf16's
//! ~4e-3 relative rounding of each input; they are exact in f32, and the sums accumulate in f32.
//! `vdpbf16ps` treats f32 denormals as zero (DAZ/FTZ), which no block value comes near.
//!
//! **Detection** is at run time (`Kernel::detect`): a binary built anywhere runs on a CPU without
//! AVX-512 and never executes these instructions there. `SPEEDKIT_CPU_BF16=off` turns both units
//! off (what a CPU without them runs), `=avx512-bf16` keeps AMX off, and in a build with the `mkl`
//! feature `=mkl` runs MKL's bf16 GEMM instead of ours (to compare the two; MKL picks slower
//! code paths on AMD CPUs, so ours stays the default).

#[cfg(target_arch = "x86_64")]
pub(crate) mod amx;

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp1, CustomOp2, DType, Layout, Shape, Tensor};
use half::bf16;
use rayon::prelude::*;
use std::sync::OnceLock;

/// Rows of C per micro-kernel tile (one broadcast A pair each).
pub const MR: usize = 12;
/// Columns of C per micro-kernel tile: two zmm registers of 16 f32.
pub const NR: usize = 32;
/// k-pairs per slice: 384 pairs = 768 k. Every slice starts by loading the 24-register C tile
/// and ends by storing it (48 accesses to C rows `n` floats apart). With 128 pairs those were
/// ~6% of the micro-kernel's perf samples (2% now) and fc1 (K = 768) ran 12–15% slower (Zen 4,
/// 2 cores, paired runs on a loaded machine: `results/cpu-bf16/prepacked/tuning/tuning.txt`;
/// qkv 4–10%, proj and fc2 within noise). The B micro-panel (KC × NR × 4 bytes = 48 KiB) no
/// longer fits a 32 KiB L1: it streams from L2 in order.
pub const KC: usize = 384;
/// Rows of C per task: the packed A block is MC × KC × 4 bytes = 144 KiB, well within L2.
pub const MC: usize = 96;
/// Rows of C per task on AMX: each task streams its columns' B panels once (fc1's are 1.2 MiB,
/// from L3), so more rows per task read B fewer times; with the scratch (MC_AMX × NC f32 =
/// 768 KiB) and the packed A block (512 KiB) the task still fits a 2 MiB L2. Two threads at the
/// block's linears: 1.65–1.91 TFLOP/s at 96 rows, 1.81–2.04 at 256 (AMX Xeon, quiet machine).
pub const MC_AMX: usize = 256;
/// Columns of C per task: tasks = ⌈m / MC⌉ · ⌈n / NC⌉, many more than cores at the block's
/// shapes, and each packed A block serves up to NC / NR = 24 B micro-panels.
pub const NC: usize = 768;

/// The kernel that runs a bf16 GEMM on this CPU.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kernel {
    /// AMX-BF16 tiles (`tdpbf16ps`), where the CPU has them and Linux grants the tile state.
    Amx,
    /// AVX512-BF16 (`vdpbf16ps`), our micro-kernel in this file.
    Avx512Bf16,
    /// MKL's `cblas_gemm_bf16bf16f32` (builds with the `mkl` feature; asked for by name).
    Mkl,
    /// No bf16 instructions: operands widened to f32, the f32 GEMM, the result narrowed.
    ConvertedF32,
}

/// The values `SPEEDKIT_CPU_BF16` takes, matched ignoring ASCII case (`Kernel::detect_with`).
pub const REQUESTS: [&str; 5] = ["auto", "off", "f32", "avx512-bf16", "mkl"];

impl Kernel {
    /// The label reports and tables carry.
    pub fn name(self) -> &'static str {
        match self {
            Kernel::Amx => "amx",
            Kernel::Avx512Bf16 => "avx512-bf16",
            Kernel::Mkl => "mkl",
            Kernel::ConvertedF32 => "converted to f32",
        }
    }

    /// Whether this kernel runs bf16 products on a bf16 unit (so bf16 beats fp32 here).
    pub fn is_native(self) -> bool {
        self != Kernel::ConvertedF32
    }

    /// Whether this CPU can run `self`.
    pub fn available(self) -> bool {
        match self {
            Kernel::Amx => amx_available(),
            Kernel::Avx512Bf16 => avx512_bf16_available(),
            Kernel::Mkl => cfg!(feature = "mkl"),
            Kernel::ConvertedF32 => true,
        }
    }

    /// The fastest kernel this CPU has, detected once per process: AMX, then AVX512-BF16, then
    /// conversion. `SPEEDKIT_CPU_BF16=off` (or `f32`) forces conversion, `=avx512-bf16` skips AMX,
    /// `=mkl` picks MKL's in an `mkl` build.
    pub fn detect() -> Kernel {
        static KERNEL: OnceLock<Kernel> = OnceLock::new();
        *KERNEL.get_or_init(|| Kernel::detect_with(std::env::var("SPEEDKIT_CPU_BF16").ok().as_deref()))
    }

    /// `detect` with the override given, matched ignoring ASCII case (`OFF` is `off`): `None` or
    /// `"auto"` picks the fastest available. The binaries refuse a value not in `REQUESTS` before
    /// any work (`shared::cli::check_cpu_bf16`); here one is taken as auto.
    pub fn detect_with(request: Option<&str>) -> Kernel {
        let request = request.map(str::to_ascii_lowercase);
        let request = request.as_deref();
        if request == Some("mkl") && Kernel::Mkl.available() {
            return Kernel::Mkl;
        }
        let allow_amx = !matches!(request, Some("off" | "f32" | "avx512-bf16"));
        let allow_avx = !matches!(request, Some("off" | "f32"));
        if allow_amx && Kernel::Amx.available() {
            Kernel::Amx
        } else if allow_avx && Kernel::Avx512Bf16.available() {
            Kernel::Avx512Bf16
        } else {
            Kernel::ConvertedF32
        }
    }
}

fn avx512_bf16_available() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::arch::is_x86_feature_detected!("avx512f") && std::arch::is_x86_feature_detected!("avx512bf16")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

fn amx_available() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        static GRANTED: OnceLock<bool> = OnceLock::new();
        *GRANTED.get_or_init(amx::request)
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// An element the kernel reads: bf16 as it is, or f32 rounded to bf16 (to nearest even) as the
/// kernel packs it, so an f32 activation needs no conversion pass of its own.
pub trait Operand: Copy + Send + Sync + std::fmt::Debug + 'static {
    /// The bf16 bits the instruction multiplies.
    fn bf16_bits(self) -> u16;
    /// The value the instruction multiplies, as f32 (for the scalar twin).
    #[inline(always)]
    fn rounded(self) -> f32 {
        f32::from_bits((self.bf16_bits() as u32) << 16)
    }
    /// The slice itself when it is bf16 already (for MKL, which reads bf16 only).
    fn as_bf16(data: &[Self]) -> Option<&[bf16]>;
    /// `out[p]` = the pair (`src[2p]`, `src[2p + 1]`): a row's neighbours, as packed.
    #[inline(always)]
    fn pairs_along(src: &[Self], out: &mut [u32]) {
        for (o, two) in out.iter_mut().zip(src.chunks_exact(2)) {
            *o = two[0].bf16_bits() as u32 | (two[1].bf16_bits() as u32) << 16;
        }
    }
    /// `out[r]` = the pair (`lo[r]`, `hi[r]`): two rows interleaved, as packed.
    #[inline(always)]
    fn pairs_across(lo: &[Self], hi: &[Self], out: &mut [u32]) {
        for ((o, &lo), &hi) in out.iter_mut().zip(lo).zip(hi) {
            *o = lo.bf16_bits() as u32 | (hi.bf16_bits() as u32) << 16;
        }
    }
    /// A 16 × 16 tile of pairs from 16 rows of a row-major matrix: `out[16·r + p]` = the pair
    /// (`data[r·rs + 2p]`, `data[r·rs + 2p + 1]`) for r, p < 16 (AMX's A tile of activations).
    #[inline(always)]
    fn pair_tile_of_rows(data: &[Self], rs: usize, out: &mut [u32]) {
        for r in 0..16 {
            Self::pairs_along(&data[r * rs..][..32], &mut out[16 * r..][..16]);
        }
    }
    /// A 16 × 16 tile of pairs from 32 columns of a column-major matrix: `out[16·r + p]` = the
    /// pair (`data[2p·cs + r]`, `data[(2p + 1)·cs + r]`) for r, p < 16 (AMX's A tile of dZᵀ).
    #[inline(always)]
    fn pair_tile_of_columns(data: &[Self], cs: usize, out: &mut [u32]) {
        let mut columns = [0u32; 256];
        for p in 0..16 {
            Self::pairs_across(&data[2 * p * cs..][..16], &data[(2 * p + 1) * cs..][..16], &mut columns[16 * p..][..16]);
        }
        transpose_16x16(&columns, out);
    }
}

impl Operand for bf16 {
    #[inline(always)]
    fn bf16_bits(self) -> u16 {
        self.to_bits()
    }
    /// Two neighbouring bf16 in memory are already the u32 the instruction reads (on a
    /// little-endian CPU the lower k in the low half): a copy, not one word built at a time.
    #[inline(always)]
    fn pairs_along(src: &[bf16], out: &mut [u32]) {
        let n = out.len().min(src.len() / 2);
        #[cfg(target_endian = "little")]
        // SAFETY: 4·n bytes lie in both slices (n ≤ out.len() and 2·n ≤ src.len()), which do
        // not overlap (one is borrowed shared, the other exclusively); any bits are a valid u32.
        unsafe {
            std::ptr::copy_nonoverlapping(src.as_ptr() as *const u8, out.as_mut_ptr() as *mut u8, 4 * n)
        };
        #[cfg(not(target_endian = "little"))]
        for (o, two) in out[..n].iter_mut().zip(src.chunks_exact(2)) {
            *o = two[0].bf16_bits() as u32 | (two[1].bf16_bits() as u32) << 16;
        }
    }
    /// Two rows interleaved 16 values at a time: each row's bf16 widened to 32-bit lanes, the
    /// second shifted into the high halves (one word built at a time, packing a weight
    /// gradient's bf16 x was a scalar loop over every element).
    #[inline(always)]
    fn pairs_across(lo: &[bf16], hi: &[bf16], out: &mut [u32]) {
        #[cfg(target_arch = "x86_64")]
        if Kernel::Avx512Bf16.available() {
            // SAFETY: the CPU has AVX512-F (checked on the line above, with AVX512-BF16).
            return unsafe { pairs_across_bf16_avx512(lo, hi, out) };
        }
        for ((o, &lo), &hi) in out.iter_mut().zip(lo).zip(hi) {
            *o = lo.to_bits() as u32 | (hi.to_bits() as u32) << 16;
        }
    }
    fn as_bf16(data: &[bf16]) -> Option<&[bf16]> {
        Some(data)
    }
}

/// `pairs_across` for bf16: 16 values of each row zero-extended to 32 bits and merged, the last
/// n mod 16 one at a time.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn pairs_across_bf16_avx512(lo: &[bf16], hi: &[bf16], out: &mut [u32]) {
    use std::arch::x86_64::{
        __m256i, __m512i, _mm256_loadu_si256, _mm512_cvtepu16_epi32, _mm512_or_si512, _mm512_slli_epi32, _mm512_storeu_si512,
    };
    let n = out.len().min(lo.len()).min(hi.len());
    let widen = |x: &[bf16], r: usize| _mm512_cvtepu16_epi32(_mm256_loadu_si256(x.as_ptr().add(r) as *const __m256i));
    let whole = n / 16 * 16;
    for r in (0..whole).step_by(16) {
        let pairs = _mm512_or_si512(widen(lo, r), _mm512_slli_epi32::<16>(widen(hi, r)));
        _mm512_storeu_si512(out.as_mut_ptr().add(r) as *mut __m512i, pairs);
    }
    for r in whole..n {
        out[r] = lo[r].to_bits() as u32 | (hi[r].to_bits() as u32) << 16;
    }
}

impl Operand for f32 {
    #[inline(always)]
    fn bf16_bits(self) -> u16 {
        bf16::from_f32(self).to_bits()
    }
    fn as_bf16(_: &[f32]) -> Option<&[bf16]> {
        None
    }
    // f32 operands (a training step's activations and gradients, f32 master weights) are rounded
    // as they are packed: 16 or 32 at a time with AVX512-BF16's conversions where the CPU has
    // them, instead of one value at a time (a sixth of a backward GEMM's time was this packing).
    #[inline(always)]
    fn pairs_along(src: &[f32], out: &mut [u32]) {
        #[cfg(target_arch = "x86_64")]
        if Kernel::Avx512Bf16.available() {
            // SAFETY: the CPU has AVX512-F and AVX512-BF16 (checked on the line above).
            return unsafe { pairs_along_avx512(src, out) };
        }
        for (o, two) in out.iter_mut().zip(src.chunks_exact(2)) {
            *o = two[0].bf16_bits() as u32 | (two[1].bf16_bits() as u32) << 16;
        }
    }
    #[inline(always)]
    fn pairs_across(lo: &[f32], hi: &[f32], out: &mut [u32]) {
        #[cfg(target_arch = "x86_64")]
        if Kernel::Avx512Bf16.available() {
            // SAFETY: the CPU has AVX512-F and AVX512-BF16 (checked on the line above).
            return unsafe { pairs_across_avx512(lo, hi, out) };
        }
        for ((o, &lo), &hi) in out.iter_mut().zip(lo).zip(hi) {
            *o = lo.bf16_bits() as u32 | (hi.bf16_bits() as u32) << 16;
        }
    }
    #[inline(always)]
    fn pair_tile_of_rows(data: &[f32], rs: usize, out: &mut [u32]) {
        assert!(data.len() >= 15 * rs + 32 && out.len() >= 256, "a tile of 16 rows × 32 columns");
        #[cfg(target_arch = "x86_64")]
        if Kernel::Avx512Bf16.available() {
            // SAFETY: the CPU has AVX512-F and AVX512-BF16 (checked on the line above); the rows
            // and the tile lie inside the slices (asserted above).
            return unsafe { pair_tile_of_rows_avx512(data, rs, out) };
        }
        for r in 0..16 {
            Self::pairs_along(&data[r * rs..][..32], &mut out[16 * r..][..16]);
        }
    }
    #[inline(always)]
    fn pair_tile_of_columns(data: &[f32], cs: usize, out: &mut [u32]) {
        assert!(data.len() >= 31 * cs + 16 && out.len() >= 256, "a tile of 32 columns × 16 rows");
        #[cfg(target_arch = "x86_64")]
        if Kernel::Avx512Bf16.available() {
            // SAFETY: the CPU has AVX512-F and AVX512-BF16 (checked on the line above); the
            // columns and the tile lie inside the slices (asserted above).
            return unsafe { pair_tile_of_columns_avx512(data, cs, out) };
        }
        let mut columns = [0u32; 256];
        for p in 0..16 {
            Self::pairs_across(&data[2 * p * cs..][..16], &data[(2 * p + 1) * cs..][..16], &mut columns[16 * p..][..16]);
        }
        transpose_16x16(&columns, out);
    }
}

/// `pair_tile_of_rows` for f32 in one call: per row, 32 values rounded by one
/// `vcvtne2ps2bf16` (pairs in order) and stored as the tile's row.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bf16")]
unsafe fn pair_tile_of_rows_avx512(data: &[f32], rs: usize, out: &mut [u32]) {
    use std::arch::x86_64::*;
    let (p, o) = (data.as_ptr(), out.as_mut_ptr());
    for r in 0..16 {
        let (lo, hi) = (_mm512_loadu_ps(p.add(r * rs)), _mm512_loadu_ps(p.add(r * rs + 16)));
        let pairs: __m512i = std::mem::transmute(_mm512_cvtne2ps_pbh(hi, lo)); // bf16 of lo, then of hi
        _mm512_storeu_si512(o.add(16 * r) as *mut __m512i, pairs);
    }
}

/// `pair_tile_of_columns` for f32 in one call: each column pair rounded and merged into a
/// register, then the 16 registers transposed (`transpose_16x16_avx512`'s rounds).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bf16")]
unsafe fn pair_tile_of_columns_avx512(data: &[f32], cs: usize, out: &mut [u32]) {
    use std::arch::x86_64::*;
    let round = |x: *const f32| -> __m512i {
        _mm512_cvtepu16_epi32(std::mem::transmute::<__m256bh, __m256i>(_mm512_cvtneps_pbh(_mm512_loadu_ps(x))))
    };
    let p = data.as_ptr();
    let r: [__m512i; 16] =
        std::array::from_fn(|c| _mm512_or_si512(round(p.add(2 * c * cs)), _mm512_slli_epi32::<16>(round(p.add((2 * c + 1) * cs)))));
    transpose_16x16_registers(r, out);
}

/// `pairs_along` for f32: 32 values (16 pairs) per `vcvtne2ps2bf16`, whose 32 bf16 come out in
/// the order they went in, so two neighbours land in one u32 as the pair layout wants.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bf16")]
unsafe fn pairs_along_avx512(src: &[f32], out: &mut [u32]) {
    use std::arch::x86_64::{
        __m512i, _mm512_cvtne2ps_pbh, _mm512_loadu_ps, _mm512_mask_storeu_epi32, _mm512_maskz_loadu_ps, _mm512_storeu_si512,
    };
    let n = out.len().min(src.len() / 2);
    let whole = n / 16 * 16;
    for p in (0..whole).step_by(16) {
        let (lo, hi) = (_mm512_loadu_ps(src.as_ptr().add(2 * p)), _mm512_loadu_ps(src.as_ptr().add(2 * p + 16)));
        let pairs: __m512i = std::mem::transmute(_mm512_cvtne2ps_pbh(hi, lo)); // bf16 of lo, then of hi
        _mm512_storeu_si512(out.as_mut_ptr().add(p) as *mut __m512i, pairs);
    }
    if whole < n {
        // The last n − whole < 16 pairs under masks, not one value at a time.
        let rest = 2 * (n - whole); // f32 left, < 32
        let (lo_mask, hi_mask) = (low_bits(rest.min(16)), low_bits(rest.saturating_sub(16)));
        let at = src.as_ptr().add(2 * whole);
        // `wrapping_add`: past the slice when rest ≤ 16, where hi_mask is 0 and nothing is read.
        let (lo, hi) = (_mm512_maskz_loadu_ps(lo_mask, at), _mm512_maskz_loadu_ps(hi_mask, at.wrapping_add(16)));
        let pairs: __m512i = std::mem::transmute(_mm512_cvtne2ps_pbh(hi, lo));
        _mm512_mask_storeu_epi32(out.as_mut_ptr().add(whole) as *mut i32, low_bits(n - whole), pairs);
    }
}

/// A mask of the lowest `n` of 16 lanes (n ≤ 16).
#[cfg(target_arch = "x86_64")]
#[inline(always)]
fn low_bits(n: usize) -> u16 {
    ((1u32 << n) - 1) as u16
}

/// 16 f32 rounded to bf16, each in the low half of a 32-bit lane.
///
/// # Safety
/// The CPU supports AVX512-F and AVX512-BF16.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
pub(crate) unsafe fn round16(x: std::arch::x86_64::__m512) -> std::arch::x86_64::__m512i {
    use std::arch::x86_64::*;
    _mm512_cvtepu16_epi32(std::mem::transmute::<__m256bh, __m256i>(_mm512_cvtneps_pbh(x)))
}

/// `pairs_across` for f32: 16 values of each row rounded, widened to 32 bits and merged.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bf16")]
unsafe fn pairs_across_avx512(lo: &[f32], hi: &[f32], out: &mut [u32]) {
    use std::arch::x86_64::*;
    let n = out.len().min(lo.len()).min(hi.len());
    let round = |x: __m512| round16(x);
    let whole = n / 16 * 16;
    for r in (0..whole).step_by(16) {
        let pairs = _mm512_or_si512(
            round(_mm512_loadu_ps(lo.as_ptr().add(r))),
            _mm512_slli_epi32::<16>(round(_mm512_loadu_ps(hi.as_ptr().add(r)))),
        );
        _mm512_storeu_si512(out.as_mut_ptr().add(r) as *mut __m512i, pairs);
    }
    if whole < n {
        // The last n − whole < 16 under a mask: the A panels of a transposed operand (dZᵀ of a
        // weight gradient) arrive MR = 12 rows at a time, so this is every call's whole work
        // there (one value at a time, it was a fifth of such a GEMM's time).
        let mask = low_bits(n - whole);
        let load = |x: &[f32]| _mm512_maskz_loadu_ps(mask, x.as_ptr().add(whole));
        let pairs = _mm512_or_si512(round(load(lo)), _mm512_slli_epi32::<16>(round(load(hi))));
        _mm512_mask_storeu_epi32(out.as_mut_ptr().add(whole) as *mut i32, mask, pairs);
    }
}

/// A read-only view of an m × k (or k × n) matrix of bf16 (or f32, rounded as packed) inside a
/// slice: element (r, c) is `data[offset + r·rs + c·cs]`. Any strides: transposed views and
/// stage 3's QKV views alike.
#[derive(Clone, Copy, Debug)]
pub struct MatRef<'a, T: Operand = bf16> {
    pub data: &'a [T],
    pub offset: usize,
    pub rows: usize,
    pub cols: usize,
    /// Distance between rows.
    pub rs: usize,
    /// Distance between columns.
    pub cs: usize,
}

impl<'a, T: Operand> MatRef<'a, T> {
    /// A row-major rows × cols matrix.
    pub fn row_major(data: &'a [T], rows: usize, cols: usize) -> Self {
        MatRef { data, offset: 0, rows, cols, rs: cols, cs: 1 }
    }

    /// The same elements read transposed (cols × rows): no copy.
    pub fn t(self) -> Self {
        MatRef { rows: self.cols, cols: self.rows, rs: self.cs, cs: self.rs, ..self }
    }

    /// The bits of element (r, c), or 0 (+0.0) past the edge.
    #[inline(always)]
    fn bits(&self, r: usize, c: usize) -> u32 {
        if r < self.rows && c < self.cols {
            self.data[self.offset + r * self.rs + c * self.cs].bf16_bits() as u32
        } else {
            0
        }
    }

    /// The pair (r, 2p), (r, 2p + 1) as the instruction reads it: the lower k in the low half.
    #[inline(always)]
    fn pair_along_cols(&self, r: usize, p: usize) -> u32 {
        self.bits(r, 2 * p) | (self.bits(r, 2 * p + 1) << 16)
    }

    fn check(&self, what: &str) -> Result<(), String> {
        if self.rows == 0 || self.cols == 0 {
            return Ok(());
        }
        let last = self.offset + (self.rows - 1) * self.rs + (self.cols - 1) * self.cs;
        if last >= self.data.len() {
            return Err(format!(
                "bf16 gemm: {what} ({} × {}, strides {}, {}) reaches past its {} elements",
                self.rows,
                self.cols,
                self.rs,
                self.cs,
                self.data.len()
            ));
        }
        Ok(())
    }
}

/// c (m × n, row-major f32) = a (m × k) · b (k × n) (+ c when `accumulate`), bf16 products
/// accumulated in f32, on `kernel` (`Avx512Bf16` or `Amx`), rayon over tiles when `parallel`.
/// An error, never a fault, when the CPU lacks the kernel or the shapes do not fit;
/// `ConvertedF32` is the caller's f32 GEMM and is refused here. Packs b, then `gemm_packed`:
/// a caller whose b is a weight (the same every call) packs it once with `PackedB::new`.
pub fn gemm<A: Operand, B: Operand>(
    kernel: Kernel,
    c: &mut [f32],
    a: MatRef<A>,
    b: MatRef<B>,
    accumulate: bool,
    parallel: bool,
) -> Result<(), String> {
    let (m, k, n) = (a.rows, a.cols, b.cols);
    if b.rows != k || c.len() != m * n {
        return Err(format!("bf16 gemm: a {m} × {k}, b {} × {n} and c ({} elements) do not fit c = a·b", b.rows, c.len()));
    }
    a.check("a")?;
    b.check("b")?;
    check_kernel(kernel)?;
    if m == 0 || n == 0 {
        return Ok(()); // nothing to compute (and no b to pack)
    }
    if kernel == Kernel::Mkl {
        #[cfg(feature = "mkl")]
        return mkl::gemm(c, a, b, accumulate);
    }
    gemm_packed(c, a, &PackedB::new(kernel, b, parallel)?, accumulate, parallel)
}

/// An error unless `kernel` is ours to run and this CPU has it.
/// Whether a (m × k) and a packed b (k × n) fit c = a·b with outputs of `outputs` elements (c,
/// and a kept copy where there is one), a's view is in bounds, and b's kernel runs on this CPU.
fn fits_packed<A: Operand>(a: &MatRef<A>, b: &PackedB, outputs: &[usize]) -> Result<(), String> {
    let (m, k, n) = (a.rows, a.cols, b.n);
    if b.k != k || outputs.iter().any(|&len| len != m * n) {
        return Err(format!("bf16 gemm: a {m} × {k}, packed b {} × {n} and outputs of {outputs:?} elements do not fit c = a·b", b.k));
    }
    a.check("a")?;
    check_kernel(b.kernel)
}

fn check_kernel(kernel: Kernel) -> Result<(), String> {
    if !kernel.is_native() || !kernel.available() {
        return Err(format!("bf16 gemm: the {} kernel cannot run on this CPU (detected: {})", kernel.name(), Kernel::detect().name()));
    }
    Ok(())
}

/// A value on a 64-byte boundary: a fixed-size tile buffer on the stack whose rows AMX loads and
/// stores (see `Lines` for what a row across two cache lines costs).
#[repr(C, align(64))]
pub(crate) struct OnLines<T>(pub T);

/// A buffer of 32-bit words (packed pairs, f32 accumulators) starting on a 64-byte boundary, so
/// that every 64-byte row of a packed panel is one cache line. A row that straddles two lines
/// costs two accesses: an AMX tile load (16 such rows) ran 3.3x slower from a 16-byte aligned
/// `Vec` than from a 64-byte aligned one (58 against 18 ns for four loads and four products, L1
/// resident), and the AVX-512 kernel's 64-byte B loads split the same way.
#[derive(Clone, Debug, Default)]
pub struct Lines<T: Copy + Default> {
    lines: Vec<Line<T>>,
    len: usize,
}

/// One cache line of 16 words.
#[derive(Clone, Copy, Debug, Default)]
#[repr(C, align(64))]
struct Line<T: Copy + Default>([T; 16]);

impl<T: Copy + Default> Lines<T> {
    /// An empty buffer (no allocation), for a `const` initialiser.
    pub const fn new() -> Self {
        Lines { lines: Vec::new(), len: 0 }
    }

    /// `len` zeros (`T::default()`).
    pub fn zeroed(len: usize) -> Self {
        let mut buf = Lines { lines: Vec::new(), len: 0 };
        buf.reset(len);
        buf
    }

    /// `len` words the caller writes before any read, without filling them first (a packed B of
    /// the training step's dW GEMMs is up to 12 MiB: zeroing it was a serial pass as long as the
    /// parallel packing). In test and debug builds they start as all-ones bits (bf16 NaN pairs), so
    /// a word the packing misses shows up in the GEMM tests (`cargo test` without `--release`).
    ///
    /// # Safety
    /// Every word must be written before it is read.
    #[allow(clippy::uninit_vec)] // the contract above: written whole before read; plain 32-bit words
    pub unsafe fn uninit(len: usize) -> Self {
        const { assert!(std::mem::size_of::<T>() == 4, "Lines holds 32-bit words: 16 fill a 64-byte line") };
        let mut lines = Vec::<Line<T>>::with_capacity(len.div_ceil(16));
        // SAFETY: capacity reserved above; the caller writes every word before reading it.
        unsafe { lines.set_len(len.div_ceil(16)) };
        #[cfg(any(test, debug_assertions))]
        // SAFETY: Line<T> is 16 words of 4 bytes, any bit pattern of which is a valid T here (u32, f32).
        unsafe {
            std::ptr::write_bytes(lines.as_mut_ptr(), 0xFF, lines.len())
        };
        Lines { lines, len }
    }

    /// Now `len` zeros, reusing the allocation.
    pub fn reset(&mut self, len: usize) {
        const { assert!(std::mem::size_of::<T>() == 4, "Lines holds 32-bit words: 16 fill a 64-byte line") };
        self.lines.clear();
        self.lines.resize(len.div_ceil(16), Line::default());
        self.len = len;
    }

    /// Now `len` words, reusing the allocation without clearing it: words it held keep their
    /// values (for a buffer the caller overwrites whole), words beyond it start at zero.
    pub fn resize_keeping(&mut self, len: usize) {
        const { assert!(std::mem::size_of::<T>() == 4, "Lines holds 32-bit words: 16 fill a 64-byte line") };
        if self.lines.len() < len.div_ceil(16) {
            self.lines.resize(len.div_ceil(16), Line::default());
        }
        self.len = len;
    }
}

impl<T: Copy + Default> std::ops::Deref for Lines<T> {
    type Target = [T];
    fn deref(&self) -> &[T] {
        // SAFETY: `lines` holds ⌈len / 16⌉ lines of 16 T each, contiguous (repr(C), no padding:
        // 16 words of 4 bytes fill the 64-byte alignment exactly).
        unsafe { std::slice::from_raw_parts(self.lines.as_ptr() as *const T, self.len) }
    }
}

impl<T: Copy + Default> std::ops::DerefMut for Lines<T> {
    fn deref_mut(&mut self) -> &mut [T] {
        // SAFETY: as in `deref`.
        unsafe { std::slice::from_raw_parts_mut(self.lines.as_mut_ptr() as *mut T, self.len) }
    }
}

/// B (k × n) packed for `kernel` (`Avx512Bf16` or `Amx`): ⌈n / NR⌉ panels of kp × NR pairs, as
/// `pack_b` lays them out. A linear layer's B is its weight Wᵀ, the same in every forward, so it
/// is packed once (`PackedWeight`, when the layer is built) and `gemm_packed` reads the panels
/// as they are: no pass over the weight per call.
#[derive(Clone, Debug)]
pub struct PackedB {
    panels: Lines<u32>,
    k: usize,
    n: usize,
    /// k-pairs per panel: ⌈k / 2⌉, rounded up to a whole AMX tile (`amx::TK`) for `Amx`.
    kp: usize,
    kernel: Kernel,
}

impl PackedB {
    /// Packs b for `kernel`, rayon over panels when `parallel`. An error when the CPU lacks the
    /// kernel, for `Mkl` (MKL reads bf16 matrices as they are) and for `ConvertedF32`.
    pub fn new<T: Operand>(kernel: Kernel, b: MatRef<T>, parallel: bool) -> Result<PackedB, String> {
        check_kernel(kernel)?;
        if kernel == Kernel::Mkl {
            return Err("bf16 gemm: MKL's kernel reads b unpacked; pack for avx512-bf16 or amx".into());
        }
        b.check("b")?;
        // k-pairs; AMX reads them 16 at a time, so its panels are padded with zero pairs.
        #[cfg(target_arch = "x86_64")]
        let kp = if kernel == Kernel::Amx { b.rows.div_ceil(2).next_multiple_of(amx::TK) } else { b.rows.div_ceil(2) };
        #[cfg(not(target_arch = "x86_64"))]
        let kp = b.rows.div_ceil(2);
        Ok(PackedB { panels: pack_b(b, kp, parallel), k: b.rows, n: b.cols, kp, kernel })
    }

    /// Rows of B (the GEMM's k).
    pub fn k(&self) -> usize {
        self.k
    }

    /// Columns of B (the GEMM's n).
    pub fn n(&self) -> usize {
        self.n
    }

    /// The kernel the panels are laid out for.
    pub fn kernel(&self) -> Kernel {
        self.kernel
    }
}

/// `gemm` with b packed already: c (m × n) = a (m × k) · b (+ c when `accumulate`), on the
/// kernel b was packed for.
pub fn gemm_packed<A: Operand>(c: &mut [f32], a: MatRef<A>, b: &PackedB, accumulate: bool, parallel: bool) -> Result<(), String> {
    let (m, k, n, kp, kernel) = (a.rows, a.cols, b.n, b.kp, b.kernel);
    fits_packed(&a, b, &[c.len()])?;
    if m == 0 || n == 0 {
        return Ok(());
    }
    if k == 0 {
        if !accumulate {
            c.fill(0.0);
        }
        return Ok(());
    }
    let out = OutPtr(c.as_mut_ptr());
    if kernel == Kernel::Amx {
        // On AMX the K slices load and store C's tiles once each: in the per-thread scratch (rows
        // nc apart, L2) rather than in c itself, then one copy (or add) per row. At the training
        // step's backward shapes (K = 2048, c rows 3 or 12 KiB apart) 17–27 % faster.
        through_scratch(a, b, parallel, |i, j0, acc| {
            // SAFETY: row i, columns j0..j0 + acc.len() of c (m × n, length checked above) are
            // this task's alone (tasks tile C without overlap).
            let row = unsafe { std::slice::from_raw_parts_mut(out.at(i * n + j0), acc.len()) };
            match accumulate {
                true => row.iter_mut().zip(acc.iter()).for_each(|(c, a)| *c += a),
                false => row.copy_from_slice(acc),
            }
        });
        return Ok(());
    }
    let whole = packs_a_whole(kernel, &a, n).then(|| pack_a_whole(a, kp, parallel));
    tasks(kernel, m, n, parallel, |(i0, mc), (j0, nc)| {
        let rows = whole.as_ref().map_or(ARows::Pack(0), |w| ARows::Packed(&w[i0 * kp..][..a_block_words(mc, kp)]));
        // SAFETY: the task's rows i0..i0+mc and columns j0..j0+nc are its own (tasks tile C
        // without overlap), and lie inside c (m × n, length checked above); `whole` is this A's.
        unsafe { block(kernel, out, n, a, &b.panels, kp, (i0, mc), (j0, nc), accumulate, rows) }
    });
    Ok(())
}

/// `gemm_packed` with c in bf16: c (m × n) = a · b, accumulated in f32 and rounded to bf16
/// (`narrow_bf16`). Each task computes its MC × NC block into a per-thread f32 scratch (295 KiB:
/// it stays in L2) and narrows it as it stores it, so no m × n f32 intermediate is written,
/// faulted in and read back by a narrowing pass (fc1's would be 24 MiB).
pub fn gemm_packed_bf16<A: Operand>(c: &mut [bf16], a: MatRef<A>, b: &PackedB, parallel: bool) -> Result<(), String> {
    gemm_packed_bf16_with(c, None, a, b, parallel, None)
}

/// A GEMM's output pass: `epilogue(i, j0, row)` gets each f32 accumulator row segment, columns
/// j0..j0 + row.len() of output row i, while the task's block is still in L2, before it is
/// rounded and stored (a bias add, bias + GELU, bias + a residual row).
pub type Epilogue<'a> = &'a (dyn Fn(usize, usize, &mut [f32]) + Sync);

/// `gemm_packed_bf16` with an output pass (`Epilogue`) applied to each block before it is
/// rounded to bf16: c = epilogue(a · b), no m × n pass of its own. With `keep`, each block of
/// a·b is also copied there in f32 as it is, before the epilogue (a training step's
/// pre-activation, for the backward), as `gemm_packed_with` keeps it.
pub fn gemm_packed_bf16_with<A: Operand>(
    c: &mut [bf16],
    keep: Option<&mut [f32]>,
    a: MatRef<A>,
    b: &PackedB,
    parallel: bool,
    epilogue: Option<Epilogue>,
) -> Result<(), String> {
    let (m, k, n) = (a.rows, a.cols, b.n);
    fits_packed(&a, b, &[c.len(), keep.as_ref().map_or(c.len(), |kept| kept.len())])?;
    if m == 0 || n == 0 {
        return Ok(());
    }
    if k == 0 {
        let mut zeros = vec![0f32; n];
        if let Some(kept) = keep {
            kept.fill(0.0);
        }
        for (i, row) in c.chunks_exact_mut(n).enumerate() {
            zeros.fill(0.0);
            if let Some(epilogue) = epilogue {
                epilogue(i, 0, &mut zeros);
            }
            narrow_bf16(&zeros, row);
        }
        return Ok(());
    }
    let (out, kept) = (OutPtr(c.as_mut_ptr()), keep.map(|kept| OutPtr(kept.as_mut_ptr())));
    through_scratch(a, b, parallel, |i, j0, acc| {
        if let Some(kept) = kept {
            // SAFETY: row i, columns j0..j0 + acc.len() of keep (m × n, length checked above)
            // are this task's alone (tasks tile C without overlap).
            unsafe { std::slice::from_raw_parts_mut(kept.at(i * n + j0), acc.len()) }.copy_from_slice(acc);
        }
        if let Some(epilogue) = epilogue {
            epilogue(i, j0, acc);
        }
        // SAFETY: row i, columns j0..j0 + acc.len() of c (m × n, length checked above) are
        // this task's alone (tasks tile C without overlap).
        narrow_bf16(acc, unsafe { std::slice::from_raw_parts_mut(out.at(i * n + j0), acc.len()) });
    });
    Ok(())
}

/// `gemm_packed` into an f32 c with an output pass, as `gemm_packed_bf16_with` does for bf16:
/// each block of a·b, while in L2, is copied to `keep` as it is when given (a training step's
/// pre-activation, for the backward), then through `epilogue`, then stored in c. No m × n pass
/// of its own, and C is written once, never read.
pub fn gemm_packed_with<A: Operand>(
    c: &mut [f32],
    keep: Option<&mut [f32]>,
    a: MatRef<A>,
    b: &PackedB,
    parallel: bool,
    epilogue: Option<Epilogue>,
) -> Result<(), String> {
    let (m, k, n) = (a.rows, a.cols, b.n);
    fits_packed(&a, b, &[c.len(), keep.as_ref().map_or(c.len(), |kept| kept.len())])?;
    if m == 0 || n == 0 {
        return Ok(());
    }
    if k == 0 {
        c.fill(0.0);
        if let Some(kept) = keep {
            kept.fill(0.0);
        }
        if let Some(epilogue) = epilogue {
            c.chunks_exact_mut(n).enumerate().for_each(|(i, row)| epilogue(i, 0, row));
        }
        return Ok(());
    }
    let (out, kept) = (OutPtr(c.as_mut_ptr()), keep.map(|kept| OutPtr(kept.as_mut_ptr())));
    through_scratch(a, b, parallel, |i, j0, acc| {
        // SAFETY (both): row i, columns j0..j0 + acc.len() of c and of keep (m × n, lengths
        // checked above) are this task's alone (tasks tile C without overlap).
        if let Some(kept) = kept {
            unsafe { std::slice::from_raw_parts_mut(kept.at(i * n + j0), acc.len()) }.copy_from_slice(acc);
        }
        if let Some(epilogue) = epilogue {
            epilogue(i, j0, acc);
        }
        unsafe { std::slice::from_raw_parts_mut(out.at(i * n + j0), acc.len()) }.copy_from_slice(acc);
    });
    Ok(())
}

/// The products through a per-thread f32 scratch: each task's MC × NC block of a·b (b's
/// kernel) goes into the scratch (295 KiB: it stays in L2), then `store(i, j0, acc)` gets each
/// of its row segments (row i of C, columns j0..j0 + acc.len()). Shapes checked by the caller.
fn through_scratch<A: Operand>(a: MatRef<A>, b: &PackedB, parallel: bool, store: impl Fn(usize, usize, &mut [f32]) + Sync) {
    thread_local! {
        static SCRATCH: std::cell::RefCell<Lines<f32>> = std::cell::RefCell::new(Lines::default());
    }
    let (m, n, kp, kernel) = (a.rows, b.n, b.kp, b.kernel);
    let a_id = next_call_id(); // this call's A: each row block packed once per thread (`amx::block`)
    let whole = packs_a_whole(kernel, &a, n).then(|| pack_a_whole(a, kp, parallel));
    tasks(kernel, m, n, parallel, |(i0, mc), (j0, nc)| {
        let packed = whole.as_ref().map_or(ARows::Pack(a_id), |w| ARows::Packed(&w[i0 * kp..][..a_block_words(mc, kp)]));
        SCRATCH.with_borrow_mut(|scratch| {
            scratch.resize_keeping(mc * nc); // never read before written: the block overwrites it
                                             // The task's rows of A and its columns' B panels (j0 is a multiple of NC, so of NR)
                                             // as an m = mc, n = nc product at (0, 0), written into the scratch (row length nc).
            let rows = MatRef { offset: a.offset + i0 * a.rs, rows: mc, ..a };
            let panels = &b.panels[(j0 / NR) * kp * NR..];
            // SAFETY: the scratch holds mc × nc f32 and is this thread's alone.
            unsafe { block(kernel, OutPtr(scratch.as_mut_ptr()), nc, rows, panels, kp, (0, mc), (0, nc), false, packed) };
            for (r, acc) in scratch[..mc * nc].chunks_exact_mut(nc).enumerate() {
                store(i0 + r, j0, acc);
            }
        })
    });
}

/// Runs `task((i0, mc), (j0, nc))` over C (m × n) in blocks of MC rows (MC_AMX on AMX) × NC columns, on all
/// threads when `parallel`.
fn tasks(kernel: Kernel, m: usize, n: usize, parallel: bool, task: impl Fn((usize, usize), (usize, usize)) + Sync) {
    let rows = if kernel == Kernel::Amx { MC_AMX } else { MC };
    let (row_blocks, col_blocks) = (m.div_ceil(rows), n.div_ceil(NC));
    let one = |t: usize| {
        let (i0, j0) = ((t / col_blocks) * rows, (t % col_blocks) * NC);
        task((i0, rows.min(m - i0)), (j0, NC.min(n - j0)))
    };
    if parallel {
        (0..row_blocks * col_blocks).into_par_iter().for_each(one);
    } else {
        (0..row_blocks * col_blocks).for_each(one);
    }
}

/// The scalar twin: the same products (of the operands rounded to bf16) and f32 sums, in k
/// order, one element at a time.
pub fn gemm_scalar<A: Operand, B: Operand>(c: &mut [f32], a: MatRef<A>, b: MatRef<B>, accumulate: bool) {
    let (m, k, n) = (a.rows, a.cols, b.cols);
    assert!(b.rows == k && c.len() == m * n, "c = a·b: a {m} × {k}, b {} × {n}, c {}", b.rows, c.len());
    for i in 0..m {
        for j in 0..n {
            let mut acc = if accumulate { c[i * n + j] } else { 0.0 };
            for kk in 0..k {
                let (x, y) = (a.data[a.offset + i * a.rs + kk * a.cs], b.data[b.offset + kk * b.rs + j * b.cs]);
                acc += x.rounded() * y.rounded(); // exact product of two bf16 in f32
            }
            c[i * n + j] = acc;
        }
    }
}

/// B (k × n) as ⌈n / NR⌉ panels of kp × NR pairs: panel q, pair p, column j at
/// `(q·kp + p)·NR + j`. Zero past the edges. A panel is NR rows of Bᵀ, paired along Bᵀ's rows.
fn pack_b<T: Operand>(b: MatRef<T>, kp: usize, parallel: bool) -> Lines<u32> {
    let panels = b.cols.div_ceil(NR);
    // SAFETY: `fill` writes every word of every panel: `pack_pairs` every pair of the columns
    // inside B (zero pairs past k included), and the last panel's columns past B's edge are
    // zeroed first (their products land in C's columns past n, which are never stored; zeros
    // keep them finite). `pack_across` writes every panel's NR words of every pair, zeros past
    // n included.
    let mut packed = unsafe { Lines::uninit(panels * kp * NR) };
    if b.cs == 1 && b.rs != 1 {
        // A row-major B (a training step's x in the weight gradient dW = dZᵀ·x, a weight read as
        // W in dX = dZ·W): a pair is two of B's rows, so read them in memory order, row pair
        // after row pair, and cut each into the panels. Panel by panel instead, each panel walks
        // down all k rows, NR values from each: a page per row at the training step's widths.
        let rows = Runs { data: b.data, offset: b.offset, stride: b.rs, count: b.rows, len: b.cols };
        // SAFETY: (q, p) ↦ (q·kp + p)·NR is one panel row of NR words per (panel q, pair p),
        // disjoint, inside the ⌈n / NR⌉·kp·NR words above.
        unsafe { pack_across::<T, NR>(rows, kp, OutPtr(packed.as_mut_ptr()), |q, p| (q * kp + p) * NR, parallel) };
        return packed;
    }
    let bt = b.t();
    let fill = |(q, panel): (usize, &mut [u32])| {
        if q * NR + NR > b.cols {
            panel.fill(0); // columns past n: pack_pairs leaves them as they arrive
        }
        pack_pairs(&bt, (q * NR, NR), (0, kp), panel, (1, NR))
    };
    if parallel {
        packed.par_chunks_mut(kp * NR).enumerate().for_each(fill);
    } else {
        packed.chunks_mut(kp * NR).enumerate().for_each(fill);
    }
    packed
}

/// A matrix read as lines of contiguous values: line l is `data[offset + l·stride..][..len]`,
/// `count` lines (A's columns when A is column-major, B's rows when B is row-major).
#[derive(Clone, Copy)]
struct Runs<'a, T> {
    data: &'a [T],
    offset: usize,
    stride: usize,
    count: usize,
    len: usize,
}

/// Pairs across lines, read once in memory order: pair p is lines 2p and 2p + 1 interleaved
/// (`pairs_across`; a line past `count` reads as zeros), for p < `pairs`, each pair's `len`
/// words cut into chunks of `WIDTH` and chunk c written at `out[dest(c, p)..][..WIDTH]`, zeros
/// past `len`. Rayon over groups of 16 pairs when `parallel`: a group's chunks for one c are
/// 16 neighbours in every layout here (whole cache lines, so the threads do not share them).
///
/// # Safety
/// `out` holds `dest(c, p) + WIDTH` words for every c < ⌈len / WIDTH⌉ and p < `pairs`, and
/// distinct (c, p) give disjoint ranges.
unsafe fn pack_across<T: Operand, const WIDTH: usize>(
    lines: Runs<T>,
    pairs: usize,
    out: OutPtr<u32>,
    dest: impl Fn(usize, usize) -> usize + Sync,
    parallel: bool,
) {
    let Runs { data, offset, stride, count, len } = lines;
    let buffer = || vec![0u32; len.next_multiple_of(WIDTH)]; // words past len stay zero
    let group = |row: &mut Vec<u32>, g: usize| {
        for p in 16 * g..pairs.min(16 * g + 16) {
            let line = |l: usize| (l < count).then(|| &data[offset + l * stride..][..len]);
            match (line(2 * p), line(2 * p + 1)) {
                (Some(lo), Some(hi)) => T::pairs_across(lo, hi, &mut row[..len]),
                // odd K's last pair (its high half zero), and the zero pairs past K
                (Some(lo), None) => row[..len].iter_mut().zip(lo).for_each(|(o, v)| *o = v.bf16_bits() as u32),
                _ => row.fill(0),
            }
            for (c, chunk) in row.chunks_exact(WIDTH).enumerate() {
                // SAFETY: the caller's contract: dest(c, p)..+WIDTH is inside out, and this
                // (c, p)'s alone. A fixed-size copy: a few vector moves, not a call per chunk.
                unsafe { (out.at(dest(c, p)) as *mut [u32; WIDTH]).write_unaligned(chunk.try_into().unwrap()) };
            }
        }
    };
    if parallel {
        (0..pairs.div_ceil(16)).into_par_iter().for_each_init(buffer, group);
    } else {
        let mut row = buffer();
        (0..pairs.div_ceil(16)).for_each(|g| group(&mut row, g));
    }
}

/// Words of a row block of `mc` rows packed whole: every slice's ⌈mc / MR⌉ micro-panels.
fn a_block_words(mc: usize, kp: usize) -> usize {
    mc.div_ceil(MR) * MR * kp
}

/// Whether A is packed whole before the tasks (`pack_a_whole`) rather than by each task: on the
/// AVX-512 kernel (AMX packs its own tiles and keeps them per thread), when A is column-major
/// (the weight gradient's dZᵀ, whose rows a task would read a page apart) or C has more than one
/// column block (every column block's task would pack the same rows again: four times at
/// n = 3072).
fn packs_a_whole<T: Operand>(kernel: Kernel, a: &MatRef<T>, n: usize) -> bool {
    kernel == Kernel::Avx512Bf16 && ((a.rs == 1 && a.cs != 1) || n > NC)
}

/// A (m × k) packed for the AVX-512 kernel before the tasks run: ⌈m / MC⌉ row blocks, block i0
/// at word i0·kp, each laid out as `block` reads it: slice after slice of KC pairs, slice p0's
/// ⌈mc / MR⌉ micro-panels (`pack_a_slice`'s layout) at `a_block_words(mc, p0)`. A column-major A
/// is read column pair by column pair, each pair's m values in one run (`pack_across`); any
/// other, row block by row block (`pack_a_slice`). Rayon over pairs or row blocks when `parallel`.
fn pack_a_whole<T: Operand>(a: MatRef<T>, kp: usize, parallel: bool) -> Lines<u32> {
    let m = a.rows;
    let block_len = |i0: usize| a_block_words(MC.min(m - i0), kp);
    // SAFETY: every word is written below: `pack_across` every chunk of every pair (zeros past m
    // and K included), `pack_a_slice` every word of its slice.
    let mut words = unsafe { Lines::uninit((0..m).step_by(MC).map(block_len).sum()) };
    if a.rs == 1 && a.cs != 1 {
        let columns = Runs { data: a.data, offset: a.offset, stride: a.cs, count: a.cols, len: m };
        let dest = |c: usize, p: usize| {
            let (i0, r) = (c * MR / MC * MC, c * MR % MC / MR); // the row block, its panel
            let (p0, kc) = (p / KC * KC, KC.min(kp - p / KC * KC)); // the slice
            i0 * kp + a_block_words(MC.min(m - i0), p0) + (r * kc + p - p0) * MR
        };
        // SAFETY: (c, p) ↦ dest is panel c of its row block, pair p of its slice: MR words of
        // their own, inside the row block's words (`a_block_words`).
        unsafe { pack_across::<T, MR>(columns, kp, OutPtr(words.as_mut_ptr()), dest, parallel) };
        return words;
    }
    let fill = |(b, words): (usize, &mut [u32])| {
        let (i0, mc) = (b * MC, MC.min(m - b * MC));
        for p0 in (0..kp).step_by(KC) {
            let kc = KC.min(kp - p0);
            pack_a_slice(a, (i0, mc), (p0, kc), &mut words[a_block_words(mc, p0)..][..a_block_words(mc, kc)]);
        }
    };
    // Row blocks are MC · kp words apart (MC is a multiple of MR); the last may be shorter.
    if parallel {
        words.par_chunks_mut(MC * kp).enumerate().for_each(fill);
    } else {
        words.chunks_mut(MC * kp).enumerate().for_each(fill);
    }
    words
}

/// Rows i0..i0+mc of A, pairs p0..p0+kc, as ⌈mc / MR⌉ micro-panels of kc × MR pairs (row i of
/// panel r, pair p at `(r·kc + p)·MR + i`), zero past the edges: every word of `into` written.
fn pack_a_slice<T: Operand>(a: MatRef<T>, (i0, mc): (usize, usize), (p0, kc): (usize, usize), into: &mut [u32]) {
    debug_assert_eq!(into.len(), a_block_words(mc, kc));
    if !mc.is_multiple_of(MR) {
        into.fill(0); // the last panel's rows past the block: the packings below leave them
    }
    if a.cs == 1 && a.rs != 1 {
        return pack_a_rows(a, (i0, mc), (p0, kc), into);
    }
    for (r, panel) in into.chunks_mut(kc * MR).enumerate() {
        pack_pairs(&a, (i0 + r * MR, MR.min(mc - r * MR)), (p0, kc), panel, (1, MR));
    }
}

/// `pack_a_slice` of a row-major A (the activations of every forward GEMM and of dX = dZ·W): each
/// micro-panel's MR rows, 16 pairs at a time, rounded into a 16 × 16 block (rows past MR or past
/// A zero) and transposed in registers, so that each pair's MR words are written as one run.
/// Placing the pairs one word at a time, MR words apart, was most of the packing's time (the
/// forward GEMM's `block` held 6 % of its perf samples, bf16 rows copied by `memmove` 3 % more).
/// The pairs past the last whole block of 16 go through `pack_pairs`. Rows past A are left as
/// they arrive (`pack_a_slice` zeroes them).
fn pack_a_rows<T: Operand>(a: MatRef<T>, (i0, mc): (usize, usize), (p0, kc): (usize, usize), into: &mut [u32]) {
    let whole = kc.min((a.cols / 2).saturating_sub(p0)) / 16 * 16; // pairs in whole blocks of 16
    for (r, panel) in into.chunks_mut(kc * MR).enumerate() {
        let first = i0 + r * MR;
        let rows = MR.min(mc - r * MR).min(a.rows.saturating_sub(first));
        let mut m = [0u32; 256]; // row i: row first + i's pairs q..q + 16 (rows ≥ `rows` stay zero)
        let mut tr = [0u32; 256]; // row c: pair q + c of rows first..first + 16
        for q in (0..whole).step_by(16) {
            for (i, dst) in m.chunks_exact_mut(16).take(rows).enumerate() {
                T::pairs_along(&a.data[a.offset + (first + i) * a.rs + 2 * (p0 + q)..][..32], dst);
            }
            transpose_16x16(&m, &mut tr);
            for c in 0..16 {
                panel[(q + c) * MR..][..MR].copy_from_slice(&tr[16 * c..][..MR]);
            }
        }
        if whole < kc && rows > 0 {
            // The rest, with odd K's half pair and the zero pairs past K.
            let rest = MatRef { offset: a.offset + 2 * whole * a.cs, cols: a.cols.saturating_sub(2 * whole), ..a };
            pack_pairs(&rest, (first, rows), (p0, kc - whole), &mut panel[whole * MR..], (1, MR));
        }
    }
}

/// Rows i0..i0+mr of A, pairs p0..p0+kc (pair p: columns 2p and 2p + 1, the lower in the low
/// half), each pair's u32 at `out[r·r_step + p·p_step]`: every pair of every row inside A (zero
/// pairs past K included); rows past A's edge are not written, so their words must arrive
/// zeroed. Read in memory order for the two layouts the GEMMs meet: row-major A (a pair
/// is two neighbours: activations, a weight read as Wᵀ) and column-major A (a row's elements are
/// a column apart, and row after row is contiguous: the backward's dZᵀ in AMX's tiles; the
/// AVX-512 kernel's column-major A and any row-major B go through `pack_across` instead). Any
/// other stride, element by element.
#[inline]
fn pack_pairs<T: Operand>(
    a: &MatRef<T>,
    (i0, mr): (usize, usize),
    (p0, kc): (usize, usize),
    out: &mut [u32],
    (r_step, p_step): (usize, usize),
) {
    let rows = mr.min(a.rows.saturating_sub(i0));
    let whole = kc.min((a.cols / 2).saturating_sub(p0)); // pairs wholly inside a row
    let bits = |v: T| v.bf16_bits() as u32;
    if a.cs == 1 && whole == 16 && kc == 16 && (r_step, p_step) == (16, 1) && rows.is_multiple_of(16) {
        // AMX's A tiles (16 rows × 16 pairs, rows 16 pairs apart) from a row-major A (the
        // activations; dZ of the data gradient): one call per tile, not one per row.
        for h in 0..rows / 16 {
            let first = a.offset + (i0 + 16 * h) * a.rs + 2 * p0; // row i0 + 16h, column 2·p0
            T::pair_tile_of_rows(&a.data[first..], a.rs, &mut out[256 * h..][..256]);
        }
    } else if a.cs == 1 && whole > 0 {
        // B's panels from a row-major Bᵀ (pairs p_step = NR apart, rows r_step = 1 apart): 16
        // rows × 16 pairs at a time, rounded by `pairs_along` and transposed in registers, so
        // every store is 16 neighbouring words (scattering single words NR apart, a cache line
        // each, took twice as long for an f32 768 × 3072 weight at two threads).
        let (full_rows, full_pairs) = if (r_step, p_step) == (1, NR) { (rows / 16 * 16, whole / 16 * 16) } else { (0, 0) };
        for r0 in (0..full_rows).step_by(16) {
            for q0 in (0..full_pairs).step_by(16) {
                let mut m = [0u32; 256]; // row i: row r0 + i's pairs q0..q0 + 16
                for (i, dst) in m.chunks_exact_mut(16).enumerate() {
                    T::pairs_along(&a.data[a.offset + (i0 + r0 + i) * a.rs + 2 * (p0 + q0)..][..32], dst);
                }
                let mut tr = [0u32; 256]; // row c: pair q0 + c of rows r0..r0 + 16
                transpose_16x16(&m, &mut tr);
                for c in 0..16 {
                    out[r0 + (q0 + c) * p_step..][..16].copy_from_slice(&tr[16 * c..][..16]);
                }
            }
        }
        for r in 0..rows {
            // What the blocks above did not cover: rows past the last 16-row block, and pairs
            // past the last 16-pair block of the others.
            let first = if r < full_rows { full_pairs } else { 0 };
            if first == whole {
                continue;
            }
            let src = &a.data[a.offset + (i0 + r) * a.rs + 2 * (p0 + first)..][..2 * (whole - first)];
            if p_step == 1 {
                T::pairs_along(src, &mut out[r * r_step + first..][..whole - first]);
                continue;
            }
            // Pairs p_step apart (B's panels from a row-major Bᵀ: a weight W packed as Wᵀ):
            // rounded 64 pairs at a time by the vectorised `pairs_along`, then placed (rounding
            // one f32 at a time was most of the time a training step's forward spent packing).
            let mut pairs = [0u32; 64];
            for (c, chunk) in src.chunks(128).enumerate() {
                let np = chunk.len() / 2;
                T::pairs_along(chunk, &mut pairs[..np]);
                for (q, &v) in pairs[..np].iter().enumerate() {
                    out[r * r_step + (first + 64 * c + q) * p_step] = v;
                }
            }
        }
    } else if a.rs == 1 && whole == 16 && kc == 16 && (r_step, p_step) == (16, 1) && rows.is_multiple_of(16) {
        // AMX's A tiles (16 rows × 16 pairs, rows 16 pairs apart) from a column-major A (the
        // weight gradient's dZᵀ): each pair of A's columns gives one tile column, 16 rows at a
        // time, and a 16 × 16 transpose in registers makes them the tile's rows.
        for h in 0..rows / 16 {
            let first = a.offset + i0 + 16 * h + 2 * p0 * a.cs; // row i0 + 16h, column 2·p0
            T::pair_tile_of_columns(&a.data[first..], a.cs, &mut out[256 * h..][..256]);
        }
    } else if a.rs == 1 && whole > 0 && rows > 0 {
        for p in 0..whole {
            let col = 2 * (p0 + p);
            let lo = &a.data[a.offset + i0 + col * a.cs..][..rows];
            let hi = &a.data[a.offset + i0 + (col + 1) * a.cs..][..rows];
            for (r, (&lo, &hi)) in lo.iter().zip(hi).enumerate() {
                out[r * r_step + p * p_step] = bits(lo) | bits(hi) << 16;
            }
        }
    } else {
        for r in 0..rows {
            for p in 0..whole {
                out[r * r_step + p * p_step] = a.pair_along_cols(i0 + r, p0 + p);
            }
        }
    }
    // An odd K's last pair (half zero) and the zero pairs past K, one by one.
    for r in 0..rows {
        for p in whole..kc {
            out[r * r_step + p * p_step] = a.pair_along_cols(i0 + r, p0 + p);
        }
    }
}

/// `out[16·r + c] = m[16·c + r]`: a 16 × 16 block of u32 transposed (AVX-512 where the CPU has
/// it: four rounds of interleaves, 64 instructions for 256 values).
pub(crate) fn transpose_16x16(m: &[u32; 256], out: &mut [u32]) {
    assert!(out.len() >= 256);
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx512f") {
        // SAFETY: the CPU has AVX-512F (checked on the line above); out holds 256 u32.
        return unsafe { transpose_16x16_avx512(m, out) };
    }
    for r in 0..16 {
        for c in 0..16 {
            out[16 * r + c] = m[16 * c + r];
        }
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn transpose_16x16_avx512(m: &[u32; 256], out: &mut [u32]) {
    use std::arch::x86_64::*;
    transpose_16x16_registers(std::array::from_fn(|i| _mm512_loadu_si512(m.as_ptr().add(16 * i) as *const __m512i)), out)
}

/// Stores the transpose of the 16 × 16 u32 held in `r` (row i in r[i]) at `out`.
///
/// # Safety
/// The CPU has AVX-512F; out holds 256 u32.
#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "avx512f")]
pub(crate) unsafe fn transpose_16x16_registers(mut r: [std::arch::x86_64::__m512i; 16], out: &mut [u32]) {
    use std::arch::x86_64::*;
    let mut t = [_mm512_setzero_si512(); 16];
    for i in (0..16).step_by(2) {
        // 32-bit interleave of row pairs
        t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
    }
    for i in (0..16).step_by(4) {
        // 64-bit interleave
        r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
        r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
        r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
        r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
    }
    for i in [0, 8] {
        // 128-bit lanes, within each group of 8 rows
        for j in 0..4 {
            t[i + j] = _mm512_shuffle_i32x4::<0x88>(r[i + j], r[i + j + 4]);
            t[i + j + 4] = _mm512_shuffle_i32x4::<0xdd>(r[i + j], r[i + j + 4]);
        }
    }
    for j in 0..8 {
        // 128-bit lanes across the two groups
        r[j] = _mm512_shuffle_i32x4::<0x88>(t[j], t[j + 8]);
        r[j + 8] = _mm512_shuffle_i32x4::<0xdd>(t[j], t[j + 8]);
    }
    for (i, row) in r.iter().enumerate() {
        _mm512_storeu_si512(out.as_mut_ptr().add(16 * i) as *mut __m512i, *row);
    }
}

/// C (f32, or bf16 for `gemm_packed_bf16`) written by every task at rows and columns no other
/// task writes.
#[derive(Clone, Copy)]
struct OutPtr<T = f32>(*mut T);
// SAFETY: tasks write disjoint blocks of C (see `gemm`).
unsafe impl<T> Send for OutPtr<T> {}
unsafe impl<T> Sync for OutPtr<T> {}

impl<T> OutPtr<T> {
    /// The element at offset i (a method, so closures capture the Send + Sync wrapper whole).
    ///
    /// # Safety
    /// i is inside the buffer.
    unsafe fn at(self, i: usize) -> *mut T {
        self.0.add(i)
    }
}

/// A number no other GEMM call in this process has had: the key under which `amx::block` keeps a
/// call's packed A rows for its next task (never 0, which means "do not keep").
fn next_call_id() -> u64 {
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
    NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
}

/// Where a task's rows of A come from.
#[derive(Clone, Copy)]
enum ARows<'x> {
    /// Packed by the task, slice by slice; AMX keeps them per thread for the call's next task
    /// with the same rows under this id (`next_call_id`; 0 packs them afresh).
    Pack(u64),
    /// Packed whole before the tasks (`pack_a_whole`): the task's row block, every slice.
    Packed(&'x [u32]),
}

/// One task: C[i0..i0+mc, j0..j0+nc] over all of k, KC pairs at a time, A's rows from `rows`.
///
/// # Safety
/// The block lies inside C (m × n with row length `ldc`), and no other thread writes it; an id
/// in `ARows::Pack`, when not 0, names this call's A alone; `ARows::Packed` holds these rows of
/// this A as `pack_a_whole` packed them.
#[allow(clippy::too_many_arguments)]
unsafe fn block<T: Operand>(
    kernel: Kernel,
    c: OutPtr,
    ldc: usize,
    a: MatRef<T>,
    packed_b: &[u32],
    kp: usize,
    (i0, mc): (usize, usize),
    (j0, nc): (usize, usize),
    accumulate: bool,
    rows: ARows,
) {
    #[cfg(target_arch = "x86_64")]
    if kernel == Kernel::Amx {
        let a_id = if let ARows::Pack(id) = rows { id } else { 0 }; // (AMX is never given A packed whole)
        return amx::block(c.0, ldc, a, packed_b, kp, (i0, mc), (j0, nc), accumulate, a_id);
    }
    let mut own = Lines::default(); // the task's own packing of a slice, when A is not packed whole
    let mut tile = [0f32; MR * NR]; // edge tiles run here, then their valid part is copied
    for p0 in (0..kp).step_by(KC) {
        let kc = KC.min(kp - p0);
        let packed_a: &[u32] = match rows {
            ARows::Packed(words) => &words[a_block_words(mc, p0)..][..a_block_words(mc, kc)],
            ARows::Pack(_) => {
                own.resize_keeping(a_block_words(mc, kc));
                pack_a_slice(a, (i0, mc), (p0, kc), &mut own);
                &own
            }
        };
        let load = accumulate || p0 > 0; // the first slice overwrites C unless accumulating
        for jr in (0..nc).step_by(NR) {
            let (j, nr) = (j0 + jr, NR.min(nc - jr));
            let b_panel = &packed_b[((j / NR) * kp + p0) * NR..][..kc * NR];
            for ir in (0..mc).step_by(MR) {
                let (i, mr) = (i0 + ir, MR.min(mc - ir));
                let a_panel = &packed_a[(ir / MR) * kc * MR..][..kc * MR];
                let corner = c.at(i * ldc + j);
                if mr == MR && nr == NR {
                    micro_kernel(kernel, kc, a_panel, b_panel, corner, ldc, load);
                } else {
                    for r in 0..mr {
                        for q in 0..nr {
                            tile[r * NR + q] = if load { *corner.add(r * ldc + q) } else { 0.0 };
                        }
                    }
                    micro_kernel(kernel, kc, a_panel, b_panel, tile.as_mut_ptr(), NR, true);
                    for r in 0..mr {
                        for q in 0..nr {
                            *corner.add(r * ldc + q) = tile[r * NR + q];
                        }
                    }
                }
            }
        }
    }
}

/// One MR × NR tile of C (row length `ldc`) += its A micro-panel · its B micro-panel.
///
/// # Safety
/// `c` addresses MR rows of NR f32 `ldc` apart; the panels hold kc · MR and kc · NR pairs; the
/// kernel is available (checked in `gemm`).
#[inline(always)]
unsafe fn micro_kernel(kernel: Kernel, kc: usize, a: &[u32], b: &[u32], c: *mut f32, ldc: usize, load: bool) {
    debug_assert!(a.len() >= kc * MR && b.len() >= kc * NR);
    #[cfg(target_arch = "x86_64")]
    if kernel == Kernel::Avx512Bf16 {
        return avx512::micro_kernel(kc, a.as_ptr(), b.as_ptr(), c, ldc, load);
    }
    unreachable!("bf16 gemm: no micro-kernel for {kernel:?} on this architecture (refused in `gemm`)")
}

#[cfg(feature = "mkl")]
mod mkl {
    use super::{MatRef, Operand};
    use half::bf16;
    use std::borrow::Cow;

    extern "C" {
        // MKL's CBLAS (LP64), linked by intel-mkl-src through candle-core's `mkl` feature.
        // MKL_BF16 is an unsigned 16-bit integer holding the bf16 bits.
        fn cblas_gemm_bf16bf16f32(
            layout: i32,
            transa: i32,
            transb: i32,
            m: i32,
            n: i32,
            k: i32,
            alpha: f32,
            a: *const u16,
            lda: i32,
            b: *const u16,
            ldb: i32,
            beta: f32,
            c: *mut f32,
            ldc: i32,
        );
    }
    const ROW_MAJOR: i32 = 101;
    const NO_TRANS: i32 = 111;
    const TRANS: i32 = 112;

    /// A view as (pointer source, transpose flag, leading dimension) in MKL's row-major terms:
    /// rows adjacent → transposed; else columns adjacent; else copied row-major first.
    fn operand<'a, T: Operand>(x: &MatRef<'a, T>) -> (Cow<'a, [bf16]>, i32, usize) {
        let Some(data) = T::as_bf16(x.data) else {
            // f32 operands: rounded to bf16 into a row-major copy (MKL reads bf16 only).
            let v = (0..x.rows)
                .flat_map(|r| (0..x.cols).map(move |c| bf16::from_bits(x.data[x.offset + r * x.rs + c * x.cs].bf16_bits())))
                .collect();
            return (Cow::Owned(v), NO_TRANS, x.cols.max(1));
        };
        if x.cs == 1 && x.rs >= x.cols.max(1) {
            (Cow::Borrowed(&data[x.offset..]), NO_TRANS, x.rs)
        } else if x.rs == 1 && x.cs >= x.rows.max(1) {
            (Cow::Borrowed(&data[x.offset..]), TRANS, x.cs)
        } else {
            let v = (0..x.rows).flat_map(|r| (0..x.cols).map(move |c| data[x.offset + r * x.rs + c * x.cs])).collect();
            (Cow::Owned(v), NO_TRANS, x.cols.max(1))
        }
    }

    pub fn gemm<A: Operand, B: Operand>(c: &mut [f32], a: MatRef<A>, b: MatRef<B>, accumulate: bool) -> Result<(), String> {
        let (m, k, n) = (a.rows, a.cols, b.cols);
        let dim = |v: usize| i32::try_from(v).map_err(|_| format!("bf16 gemm: dimension {v} exceeds MKL's 32-bit (LP64) interface"));
        let ((ad, ta, lda), (bd, tb, ldb)) = (operand(&a), operand(&b));
        let (mi, ni, ki, ldai, ldbi, ldc) = (dim(m)?, dim(n)?, dim(k)?, dim(lda)?, dim(ldb)?, dim(n)?);
        // SAFETY: `gemm` checked that both views lie inside their slices, so every element MKL
        // reads through (pointer, transpose, leading dimension) is in bounds; c holds m·n.
        unsafe {
            cblas_gemm_bf16bf16f32(
                ROW_MAJOR,
                ta,
                tb,
                mi,
                ni,
                ki,
                1.0,
                ad.as_ptr() as *const u16,
                ldai,
                bd.as_ptr() as *const u16,
                ldbi,
                if accumulate { 1.0 } else { 0.0 },
                c.as_mut_ptr(),
                ldc,
            )
        };
        Ok(())
    }
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    use super::{MR, NR};
    use std::arch::x86_64::*;

    /// C (MR × NR) (+)= Σ_p A_p ⊗ B_p over kc pairs: per pair, B's two zmm rows (16 columns ×
    /// one pair each) and, for each of the MR rows, A's pair broadcast to all 16 lanes; then
    /// `vdpbf16ps`: acc[i][lane] += a(i, 2p)·b(2p, lane) + a(i, 2p+1)·b(2p+1, lane).
    ///
    /// # Safety
    /// The CPU has AVX512-F and AVX512-BF16; `a` holds kc·MR pairs, `b` kc·NR; `c` addresses MR
    /// rows of NR f32, `ldc` apart.
    #[target_feature(enable = "avx512f,avx512bf16")]
    pub unsafe fn micro_kernel(kc: usize, a: *const u32, b: *const u32, c: *mut f32, ldc: usize, load: bool) {
        let mut acc = [[_mm512_setzero_ps(); 2]; MR]; // 24 zmm: the C tile stays in registers
        if load {
            for (i, row) in acc.iter_mut().enumerate() {
                row[0] = _mm512_loadu_ps(c.add(i * ldc));
                row[1] = _mm512_loadu_ps(c.add(i * ldc + 16));
            }
        }
        for p in 0..kc {
            let b0: __m512bh = std::mem::transmute(_mm512_loadu_si512(b.add(p * NR) as *const _));
            let b1: __m512bh = std::mem::transmute(_mm512_loadu_si512(b.add(p * NR + 16) as *const _));
            let ap = a.add(p * MR);
            for (i, row) in acc.iter_mut().enumerate() {
                let ai: __m512bh = std::mem::transmute(_mm512_set1_epi32(*ap.add(i) as i32));
                row[0] = _mm512_dpbf16_ps(row[0], ai, b0);
                row[1] = _mm512_dpbf16_ps(row[1], ai, b1);
            }
        }
        for (i, row) in acc.iter().enumerate() {
            _mm512_storeu_ps(c.add(i * ldc), row[0]);
            _mm512_storeu_ps(c.add(i * ldc + 16), row[1]);
        }
    }
}

// ---------------------------------------------------------------------------------------------
// The candle op
// ---------------------------------------------------------------------------------------------

/// `a.matmul(b)` with bf16 GEMMs on this CPU's bf16 unit (`Kernel::detect`) when either
/// operand is bf16: a (…, M, K), b (…, K, N) or (K, N), each bf16 or f32 (an f32 operand is
/// rounded to bf16 as the kernel packs it), any strides; out (…, M, N) in a's dtype, accumulated
/// in f32. So bf16 × bf16 gives bf16, as on a GPU, and an f32 activation times a bf16 weight
/// gives f32 with no conversion pass. Two f32 operands, and other dtypes, are candle's matmul.
pub fn matmul(a: &Tensor, b: &Tensor) -> candle_core::Result<Tensor> {
    matmul_with(a, b, Kernel::detect())
}

/// `matmul` on a given kernel (`ConvertedF32` is the slow twin's path, what a CPU without bf16
/// instructions runs). A kernel this CPU lacks is an error.
pub fn matmul_with(a: &Tensor, b: &Tensor, kernel: Kernel) -> candle_core::Result<Tensor> {
    if a.dtype() == DType::BF16 || b.dtype() == DType::BF16 {
        bf16_matmul(a, b, kernel)
    } else {
        crate::trace::ran_with(|| format!("gemm {:?}: candle matmul", a.dtype()).to_lowercase());
        a.matmul(b)
    }
}

/// `a · b` as a bf16 GEMM whatever the operands' dtypes (bf16 or f32): both rounded to bf16,
/// f32 accumulation, the result in a's dtype. For two f32 activations that still go through a
/// bf16 GEMM (stage 1's attention products on a CPU, which keeps activations in f32). Elsewhere
/// (CUDA, a CPU without bf16 instructions) the operands are cast to bf16 first.
pub fn matmul_bf16(a: &Tensor, b: &Tensor) -> candle_core::Result<Tensor> {
    bf16_matmul(a, b, Kernel::detect())
}

fn bf16_matmul(a: &Tensor, b: &Tensor, kernel: Kernel) -> candle_core::Result<Tensor> {
    let ours = |x: &Tensor| matches!(x.dtype(), DType::BF16 | DType::F32);
    if !a.device().is_cpu() || !ours(a) || !ours(b) {
        // A GPU's tensor cores (or another dtype): candle's matmul on bf16 operands.
        crate::trace::ran("gemm bf16: candle matmul");
        return a.to_dtype(DType::BF16)?.matmul(&b.to_dtype(DType::BF16)?)?.to_dtype(a.dtype());
    }
    if !kernel.is_native() {
        crate::trace::ran("gemm bf16: converted to f32 (candle matmul)");
        return matmul_slow(a, b);
    }
    a.apply_op2(b, Bf16Matmul { kernel }) // recorded with its `bwd` when a or b is tracked
}

/// Slow twin of `matmul`: operands rounded to bf16 and widened to f32, candle's f32 matmul, the
/// result in a's dtype. What runs on a CPU without bf16 instructions ("converted to f32").
pub fn matmul_slow(a: &Tensor, b: &Tensor) -> candle_core::Result<Tensor> {
    let wide = |x: &Tensor| x.to_dtype(DType::BF16)?.to_dtype(DType::F32);
    wide(a)?.matmul(&wide(b)?)?.to_dtype(a.dtype())
}

/// A linear layer's weight W (n × k, as stored: y = x·Wᵀ), with Wᵀ packed once into the bf16
/// kernel's pair panels when W is bf16 on a CPU whose bf16 unit runs our kernel. A layer builds
/// it in `build`, outside the timed forward; every forward's `matmul_prepacked` then reads the
/// panels as they are, where `matmul(x, &w.t())` packs W again in every call (W is the larger
/// operand of fc1: FF × C). Otherwise (f32 or f16 W, CUDA, MKL, a CPU without bf16
/// instructions) it holds W only and `matmul_prepacked` is `matmul`.
#[derive(Clone, Debug)]
pub struct PackedWeight {
    w: Tensor,
    packed: Option<PackedB>,
    kernel: Kernel,
    /// The products run in bf16 whatever W's dtype (`PackedWeight::bf16_master`).
    bf16_master: bool,
}

impl PackedWeight {
    /// W (n × k) for the kernel this CPU runs (`Kernel::detect`).
    pub fn new(w: &Tensor) -> candle_core::Result<PackedWeight> {
        PackedWeight::with_kernel(w, Kernel::detect())
    }

    /// W (n × k) for a given kernel; one this CPU lacks is an error, as in `matmul_with`.
    pub fn with_kernel(w: &Tensor, kernel: Kernel) -> candle_core::Result<PackedWeight> {
        let (n, k) = w.dims2()?;
        // A tracked weight (training) is not packed: the packed product has no backward, and the
        // weight changes every step anyway.
        let ours = w.device().is_cpu() && w.dtype() == DType::BF16 && kernel.is_native() && kernel != Kernel::Mkl && !w.track_op();
        let packed = match ours {
            false => None,
            true => {
                let w = w.contiguous()?;
                let (storage, layout) = w.storage_and_layout();
                let (candle_core::Storage::Cpu(CpuStorage::BF16(data)), Some((start, end))) = (&*storage, layout.contiguous_offsets())
                else {
                    candle_core::bail!("bf16 gemm: a contiguous bf16 CPU weight read as something else");
                };
                let wt = MatRef::row_major(&data[start..end], n, k).t(); // (k, n): W read transposed, no copy
                Some(PackedB::new(kernel, wt, true).map_err(candle_core::Error::Msg)?)
            }
        };
        Ok(PackedWeight { w: w.clone(), packed, kernel, bf16_master: false })
    }

    /// An f32 master weight W (n × k) whose products run in bf16 on this CPU's bf16 unit: what a
    /// training step on the CPU holds. W is tracked (the optimizer updates it) and goes into the
    /// GEMM as it is, rounded to bf16 as the kernel packs it (no cast pass, no bf16 copy); its
    /// gradient comes back in f32 from a bf16 GEMM with f32 accumulation (`Bf16Matmul::bwd`).
    pub fn bf16_master(w: &Tensor) -> candle_core::Result<PackedWeight> {
        w.dims2()?;
        Ok(PackedWeight { w: w.clone(), packed: None, kernel: Kernel::detect(), bf16_master: true })
    }

    /// Whether the products run in bf16 (a bf16 W, or an f32 master from `bf16_master`).
    pub fn bf16_products(&self) -> bool {
        self.bf16_master || self.w.dtype() == DType::BF16
    }

    /// W as given (n × k).
    pub fn weight(&self) -> &Tensor {
        &self.w
    }

    /// Wᵀ's panels, when packed.
    pub fn packed(&self) -> Option<&PackedB> {
        self.packed.as_ref()
    }
}

/// a · Wᵀ for a (…, M, K), W held by `w` (N × K): `matmul(a, &w.t())` without packing W, out
/// (…, M, N) in a's dtype (bf16 or f32), f32 accumulation. Unpacked weights (see `PackedWeight`)
/// and tracked activations (training) run `matmul_with` on their kernel (an f32 master from
/// `PackedWeight::bf16_master`: the bf16 GEMM on f32 operands, f32 out), a's leading dimensions
/// flattened into M.
pub fn matmul_prepacked(a: &Tensor, w: &PackedWeight) -> candle_core::Result<Tensor> {
    match &w.packed {
        // Untracked only: a tracked activation (training) takes `matmul_with`, whose op has a backward.
        Some(b) if a.device().is_cpu() && matches!(a.dtype(), DType::BF16 | DType::F32) && !a.track_op() => {
            a.apply_op1_no_bwd(&Bf16MatmulPacked { b })
        }
        _ => {
            // candle's matmul takes a 2-d right-hand side only with a 2-d left: (…·M, K) · (K, N).
            let (dims, k) = (a.dims(), a.dim(candle_core::D::Minus1)?);
            let mut out_dims = dims[..dims.len().saturating_sub(1)].to_vec();
            out_dims.push(w.w.dim(0)?);
            let a2 = a.reshape(((), k))?;
            match w.bf16_master {
                true => bf16_matmul(&a2, &w.w.t()?, w.kernel)?.reshape(out_dims),
                false => matmul_with(&a2, &w.w.t()?, w.kernel)?.reshape(out_dims),
            }
        }
    }
}

/// The op behind `matmul`.
struct Bf16Matmul {
    kernel: Kernel,
}

impl CustomOp2 for Bf16Matmul {
    fn name(&self) -> &'static str {
        "speedkit-bf16-matmul"
    }

    fn cpu_fwd(&self, s1: &CpuStorage, l1: &Layout, s2: &CpuStorage, l2: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        crate::trace::ran_with(|| format!("gemm bf16: {}", self.kernel.name()));
        match (s1, s2) {
            (CpuStorage::BF16(a), CpuStorage::BF16(b)) => self.run(a, l1, b, l2),
            (CpuStorage::BF16(a), CpuStorage::F32(b)) => self.run(a, l1, b, l2),
            (CpuStorage::F32(a), CpuStorage::BF16(b)) => self.run(a, l1, b, l2),
            (CpuStorage::F32(a), CpuStorage::F32(b)) => self.run(a, l1, b, l2),
            _ => candle_core::bail!("bf16 matmul: operands must be bf16 or f32, got {:?} and {:?}", s1.dtype(), s2.dtype()),
        }
    }

    /// The backward GEMMs in the forward's precision, as autocast runs them: dA = dC·Bᵀ and
    /// dB = Aᵀ·dC, each a bf16 GEMM on the same kernel (dC and the saved operands rounded to
    /// bf16 as they are packed), f32 accumulation; each gradient in its argument's dtype. A B
    /// shared by every product of a batched A, (K, N), gets the sum over the batch: one
    /// (K, batch·M) · (batch·M, N) GEMM.
    fn bwd(&self, a: &Tensor, b: &Tensor, _c: &Tensor, dc: &Tensor) -> candle_core::Result<(Option<Tensor>, Option<Tensor>)> {
        let gemm = |x: &Tensor, y: &Tensor| bf16_matmul(x, y, self.kernel); // out in x's dtype
        let da = gemm(dc, &b.t()?)?.to_dtype(a.dtype())?; // (…, M, N) · (…, N, K)
        let db = if b.rank() == 2 && a.rank() > 2 {
            let (k, n) = (a.dim(candle_core::D::Minus1)?, dc.dim(candle_core::D::Minus1)?);
            gemm(&a.reshape(((), k))?.t()?, &dc.reshape(((), n))?)? // (K, batch·M) · (batch·M, N)
        } else {
            gemm(&a.t()?, dc)? // (…, K, M) · (…, M, N)
        };
        Ok((Some(da), Some(db.to_dtype(b.dtype())?)))
    }
}

/// dst = src rounded to bf16 (nearest even): 16 at a time with AVX512-BF16's `vcvtneps2bf16`
/// where the CPU's bf16 unit runs (`Kernel::detect`; it reads f32 denormals as zero, as its dot
/// products do), else one at a time (`half`).
pub fn narrow_bf16(src: &[f32], dst: &mut [bf16]) {
    debug_assert_eq!(src.len(), dst.len());
    #[cfg(target_arch = "x86_64")]
    if Kernel::detect().is_native() && Kernel::Avx512Bf16.available() {
        // SAFETY: the CPU has AVX512-F and AVX512-BF16 (checked on the line above).
        return unsafe { narrow_bf16_avx512(src, dst) };
    }
    dst.iter_mut().zip(src).for_each(|(d, &s)| *d = bf16::from_f32(s));
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bf16")]
unsafe fn narrow_bf16_avx512(src: &[f32], dst: &mut [bf16]) {
    use std::arch::x86_64::{__m256i, _mm256_storeu_si256, _mm512_cvtneps_pbh, _mm512_loadu_ps};
    let (mut s, mut d) = (src.chunks_exact(16), dst.chunks_exact_mut(16));
    for (s, d) in (&mut s).zip(&mut d) {
        let h: __m256i = std::mem::transmute(_mm512_cvtneps_pbh(_mm512_loadu_ps(s.as_ptr())));
        _mm256_storeu_si256(d.as_mut_ptr() as *mut __m256i, h);
    }
    d.into_remainder().iter_mut().zip(s.remainder()).for_each(|(d, &s)| *d = bf16::from_f32(s));
}

impl Bf16Matmul {
    /// The products in a's dtype: bf16 activations give bf16, as on a GPU (`gemm_packed_bf16`,
    /// rounded as each task stores its block; MKL's f32 result narrowed after); f32 ones stay f32.
    fn run<A: Operand, B: Operand>(&self, a: &[A], l1: &Layout, b: &[B], l2: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        let (ad, bd) = (l1.shape().dims(), l2.shape().dims());
        if ad.len() < 2 || bd.len() < 2 {
            candle_core::bail!("bf16 matmul: operands must be at least 2-d, got {ad:?} and {bd:?}");
        }
        let (batch_dims, k) = (&ad[..ad.len() - 2], ad[ad.len() - 1]);
        let (kb, n) = (bd[bd.len() - 2], bd[bd.len() - 1]);
        let b_batched = bd.len() > 2;
        if kb != k || (b_batched && &bd[..bd.len() - 2] != batch_dims) {
            candle_core::bail!("bf16 matmul: shapes {ad:?} and {bd:?} do not fit (…, M, K) · (…, K, N) or (K, N)");
        }
        let b_of = |t: usize| batch_view(b, l2, if b_batched { t } else { 0 }, k, n);
        let bf16_out = A::as_bf16(a).is_some();
        if bf16_out && self.kernel != Kernel::Mkl {
            let (out, shape) = products(a, l1, n, false, |t, c, av, parallel| {
                gemm_packed_bf16(c, av, &PackedB::new(self.kernel, b_of(t), parallel)?, parallel)
            })?;
            return Ok((CpuStorage::BF16(out), shape));
        }
        // MKL threads each product itself (OpenMP): one at a time.
        let (out, shape) =
            products(a, l1, n, self.kernel == Kernel::Mkl, |t, c, av, parallel| gemm(self.kernel, c, av, b_of(t), false, parallel))?;
        if !bf16_out {
            return Ok((CpuStorage::F32(out), shape));
        }
        // SAFETY: the chunks cover narrow, each written whole by narrow_bf16.
        let mut narrow = unsafe { crate::elementwise::uninit_of::<bf16>(out.len()) };
        narrow.par_chunks_mut(16 * 1024).zip(out.par_chunks(16 * 1024)).for_each(|(n, o)| narrow_bf16(o, n));
        Ok((CpuStorage::BF16(narrow), shape))
    }
}

/// The op behind `matmul_prepacked`: a is its one input, the packed weight its state.
struct Bf16MatmulPacked<'a> {
    b: &'a PackedB,
}

impl CustomOp1 for Bf16MatmulPacked<'_> {
    fn name(&self) -> &'static str {
        "speedkit-bf16-matmul-prepacked"
    }

    /// bf16 activations give bf16, each task's block narrowed as it is stored
    /// (`gemm_packed_bf16`); f32 ones give f32.
    fn cpu_fwd(&self, s1: &CpuStorage, l1: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        let ad = l1.shape().dims();
        if ad.len() < 2 || ad[ad.len() - 1] != self.b.k {
            candle_core::bail!("bf16 matmul: a {ad:?} does not fit (…, M, K) · Wᵀ with W ({}, {})", self.b.n, self.b.k);
        }
        let n = self.b.n;
        crate::trace::ran_with(|| format!("gemm bf16: {}, prepacked W", self.b.kernel.name()));
        match s1 {
            CpuStorage::BF16(a) => {
                let (out, shape) = products(a, l1, n, false, |_, c, av, parallel| gemm_packed_bf16(c, av, self.b, parallel))?;
                Ok((CpuStorage::BF16(out), shape))
            }
            CpuStorage::F32(a) => {
                let (out, shape) = products(a, l1, n, false, |_, c, av, parallel| gemm_packed(c, av, self.b, false, parallel))?;
                Ok((CpuStorage::F32(out), shape))
            }
            _ => candle_core::bail!("bf16 matmul: the activation must be bf16 or f32, got {:?}", s1.dtype()),
        }
    }
}

/// The products of a (…, M, K) with its right-hand sides, (…, M, N) in `O` (f32, or bf16):
/// `one(t, c, a_t, parallel)` writes product t into c. One product runs on all threads; several
/// run one per task unless `sequential`.
fn products<A: Operand, O: Copy + Default + Send + Sync>(
    a: &[A],
    l1: &Layout,
    n: usize,
    sequential: bool,
    one: impl Fn(usize, &mut [O], MatRef<A>, bool) -> Result<(), String> + Sync,
) -> candle_core::Result<(Vec<O>, Shape)> {
    let ad = l1.shape().dims();
    let (batch_dims, m, k) = (&ad[..ad.len() - 2], ad[ad.len() - 2], ad[ad.len() - 1]);
    let batch: usize = batch_dims.iter().product();
    let mut out = vec![O::default(); batch * m * n];
    let run = |t: usize, c: &mut [O], parallel: bool| one(t, c, batch_view(a, l1, t, m, k), parallel);
    if batch == 1 || sequential {
        out.chunks_mut((m * n).max(1)).enumerate().try_for_each(|(t, c)| run(t, c, true))
    } else {
        out.par_chunks_mut((m * n).max(1)).enumerate().try_for_each(|(t, c)| run(t, c, false))
    }
    .map_err(candle_core::Error::Msg)?;
    let mut dims = batch_dims.to_vec();
    dims.extend([m, n]);
    Ok((out, Shape::from(dims)))
}

/// Product t of a batched operand (…, rows, cols) as a view: its offset from the layout's batch
/// strides (broadcast batch dimensions have stride 0), its strides from the last two.
fn batch_view<'a, T: Operand>(data: &'a [T], l: &Layout, t: usize, rows: usize, cols: usize) -> MatRef<'a, T> {
    let (dims, strides) = (l.shape().dims(), l.stride());
    let nb = dims.len() - 2;
    let (mut rest, mut offset) = (t, l.start_offset());
    for d in (0..nb).rev() {
        offset += (rest % dims[d]) * strides[d];
        rest /= dims[d];
    }
    MatRef { data, offset, rows, cols, rs: strides[nb], cs: strides[nb + 1] }
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_16_by_16_transpose_transposes() {
        let m: [u32; 256] = std::array::from_fn(|i| i as u32 * 7 + 1);
        let mut out = [0u32; 256];
        super::transpose_16x16(&m, &mut out);
        for r in 0..16 {
            for c in 0..16 {
                assert_eq!(out[16 * r + c], m[16 * c + r], "({r}, {c})");
            }
        }
    }

    /// f32's vectorised pairings (whole vectors, then the masked rest) against the scalar
    /// rounding, one value at a time, at every length from 0 to 40 (under, at, and past one and
    /// two vectors), with values whose low bits sit on and around bf16's rounding ties. Nothing
    /// past the length is written. Normal values only: the instruction flushes subnormals.
    #[test]
    fn f32_pairings_match_the_scalar_rounding_at_every_length() {
        use super::Operand;
        let value = |i: usize| {
            let base = [1.0f32, -3.5, 0.1, 65504.0, -1e-3][i % 5];
            f32::from_bits(base.to_bits() ^ [0, 0x7fff, 0x8000, 0x8001, 0x18000][i / 5 % 5])
        };
        let scalar = |lo: f32, hi: f32| lo.bf16_bits() as u32 | (hi.bf16_bits() as u32) << 16;
        for n in 0..=40 {
            let src: Vec<f32> = (0..2 * n).map(value).collect();
            let mut out = vec![7u32; n + 3];
            f32::pairs_along(&src, &mut out[..n]);
            for p in 0..n {
                assert_eq!(out[p], scalar(src[2 * p], src[2 * p + 1]), "pairs_along, length {n}, pair {p}");
            }
            assert_eq!(out[n..], [7, 7, 7], "pairs_along wrote past length {n}");
            let (lo, hi) = (&src[..n], &src[n..]);
            let mut out = vec![7u32; n + 3];
            f32::pairs_across(lo, hi, &mut out[..n]);
            for r in 0..n {
                assert_eq!(out[r], scalar(lo[r], hi[r]), "pairs_across, length {n}, row {r}");
            }
            assert_eq!(out[n..], [7, 7, 7], "pairs_across wrote past length {n}");
        }
    }

    /// bf16's `pairs_across` (16 at a time where the CPU has AVX-512, the rest one by one)
    /// interleaves the two rows' bits exactly, at every length through three vectors, and writes
    /// nothing past the length.
    #[test]
    fn bf16_pairs_across_interleaves_at_every_length() {
        use super::{bf16, Operand};
        for n in 0..=50 {
            let lo: Vec<bf16> = (0..n).map(|i| bf16::from_bits((i as u16).wrapping_mul(0x9e37) ^ 0x8001)).collect();
            let hi: Vec<bf16> = (0..n).map(|i| bf16::from_bits((i as u16).wrapping_mul(0x7f4b) ^ 0x00ff)).collect();
            let mut out = vec![7u32; n + 3];
            bf16::pairs_across(&lo, &hi, &mut out[..n]);
            for r in 0..n {
                assert_eq!(out[r], lo[r].to_bits() as u32 | (hi[r].to_bits() as u32) << 16, "length {n}, row {r}");
            }
            assert_eq!(out[n..], [7, 7, 7], "pairs_across wrote past length {n}");
        }
    }
}
