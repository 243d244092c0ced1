//! The CPU attention kernels: FlashAttention-2's forward (tiled online softmax, no T × T
//! matrix) on f32, bf16 and f16 inputs with f32 statistics and accumulation, rayon over
//! batch × heads. Three designs:
//!
//! - `CpuKernel::Registers` (the default): our register-blocked micro-kernels (`registers`),
//!   12 query rows at a time, S and O tiles in vector registers, d_head a const generic; bf16
//!   products on `vdpbf16ps` where the CPU has AVX512-BF16 (`registers::bf16`, P rounded to bf16
//!   as on a GPU), and on AMX tiles, 32 query rows a block, where the bf16 GEMMs run on AMX;
//! - `CpuKernel::GemmTiles`: Q·Kᵀ and P·V as tile GEMMs on the `gemm` crate's micro-kernels, for
//!   head sizes the register kernels have no body for;
//! - `CpuKernel::RowAxpy`: the first kernel, one query row at a time, kept as the slow twin.
//!
//! All read q, k and v through their strides ((B, T, n_head, d_head) views: a reshaped linear
//! output, or slices of one QKV output), no copy. `backward` is FlashAttention-2's backward on
//! the same engine (its products on AMX tiles where the forward's ran there). Stage 2 wraps `CpuAttention::forward` as the `cpu_fwd` of its candle op.

pub mod backward;
pub mod registers;
use crate::elementwise::{exp_f32, sum_f32};
use candle_core::{CpuStorage, DType, Layout, Shape, WithDType};
use rayon::prelude::*;
use std::borrow::Cow;
use std::sync::Mutex;

/// Query rows per tile of the GEMM-tile kernel (B_r in the paper).
pub const BR: usize = 256;
/// Keys per tile of the GEMM-tile kernel (B_c in the paper).
///
/// Big tiles, because each tile GEMM pays a fixed cost (dispatch, packing K_j or V_j, a scratch
/// buffer) and the products are thin (k = d_head = 64 for S = Q·Kᵀ). On the small preset
/// (T = 512, d = 64, causal; AMD EPYC 2-vCPU, loaded machine) B_r × B_c = 64 × 256 ran at
/// 34–40 GFLOP/s-equivalent, 128 × 512 at 39–41, 256 × 256 at 38–41, and at T = 2048 256 × 256
/// led (39 against 29–36). What one worker holds: S (B_r × B_c f32 = 256 KiB) and O (B_r × d,
/// 64 KiB at d = 64), within a server core's L2 (1 MiB on Zen 4, 1–2 MiB on current Xeons),
/// while each GEMM's micro-tiles stream through L1. The price is waste on the causal diagonal
/// (the upper half of a B_r × B_r block per query tile is computed, then zeroed).
pub const BC: usize = 256;

/// Tile sizes of the row-wise twin (`CpuKernel::RowAxpy`): Q 32 rows, K/V 64 keys.
pub const ROW_BR: usize = 32;
/// Key/value rows per tile of the row-wise twin.
pub const ROW_BC: usize = 64;

/// The CPU kernels: two designs at GEMM speed, and the first kernel, kept as their slow twin.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CpuKernel {
    /// Q_i·K_jᵀ and P_ij·V_j as tile GEMMs through the `gemm` crate (the micro-kernels candle's
    /// CPU matmul and stage 3's linears run), the online softmax on the tile in between. What
    /// `attention` runs for head sizes `Registers` has no body for.
    GemmTiles,
    /// Our own register-blocked micro-kernels (`registers`): 12 query rows at a time, S and O
    /// tiles in vector registers, d_head a const generic (`registers::D_HEADS`; other head
    /// sizes run `GemmTiles`). The default: faster than `GemmTiles` in the criterion bench.
    Registers,
    /// `Registers` with bf16 products whatever the inputs' dtype: f32 q, k and v (a training
    /// step on the CPU keeps its tracked tensors f32) are rounded to bf16 once, as the bf16
    /// kernel reads them, and its output widened back to f32. bf16 inputs run `Registers`.
    RegistersBf16,
    /// The first CPU kernel: one query row at a time, scores by broadcast-FMA, then one axpy per
    /// key into an O row in memory (load/store-bound, ~10 % of the GEMM rate). The slow twin.
    RowAxpy,
}

/// One CPU attention forward: which kernel, and its softmax scale and causality.
#[derive(Debug)]
pub struct CpuAttention {
    pub scale: f32,
    pub causal: bool,
    pub cpu: CpuKernel,
    /// Training: where the forward keeps each row's log-sum-exp L_i = m_i + ln l_i,
    /// (B, n_head, T) f32, for the backward to recompute P from; None otherwise.
    lse: Option<Mutex<Option<Vec<f32>>>>,
}

impl CpuAttention {
    /// `kernel` with softmax scale `scale`; `keep_lse`: keep L for the backward (`take_lse`).
    pub fn new(kernel: CpuKernel, scale: f32, causal: bool, keep_lse: bool) -> CpuAttention {
        CpuAttention { scale, causal, cpu: kernel, lse: keep_lse.then(|| Mutex::new(None)) }
    }

    /// The log-sum-exp the last forward kept (taken: one backward per forward).
    pub fn take_lse(&self) -> Option<Vec<f32>> {
        self.lse.as_ref().and_then(|slot| slot.lock().ok()?.take())
    }

    /// What `forward` runs for inputs of `dtype` at head size `d`, in words (the kernel trace).
    pub fn kernel_name(&self, dtype: DType, d: usize) -> &'static str {
        let bf16_pairs =
            registers::bf16::runs(d) && (dtype == DType::BF16 || (self.cpu == CpuKernel::RegistersBf16 && dtype == DType::F32));
        match self.cpu {
            CpuKernel::RowAxpy => "attention: row-wise online softmax (CPU)",
            CpuKernel::Registers | CpuKernel::RegistersBf16 if bf16_pairs && registers::bf16::amx_runs(d) => {
                "attention: register-blocked, bf16 pairs on AMX tiles (amx)"
            }
            CpuKernel::Registers | CpuKernel::RegistersBf16 if bf16_pairs => "attention: register-blocked, bf16 pairs (avx512-bf16)",
            CpuKernel::Registers | CpuKernel::RegistersBf16 if registers::supports(d) && dtype == DType::F32 => {
                "attention: register-blocked, f32"
            }
            CpuKernel::Registers | CpuKernel::RegistersBf16 if registers::supports(d) => "attention: register-blocked, widened to f32",
            CpuKernel::Registers | CpuKernel::RegistersBf16 | CpuKernel::GemmTiles => "attention: tile GEMMs (gemm crate)",
        }
    }

    /// The forward on three CPU storages with their layouts (q, k, v: (B, T, n_head, d_head),
    /// one dtype); returns the (B, T, n_head, d_head) output in that dtype.
    pub fn forward(
        &self,
        (s1, l1): (&CpuStorage, &Layout),
        (s2, l2): (&CpuStorage, &Layout),
        (s3, l3): (&CpuStorage, &Layout),
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let dims: [usize; 4] = l1.shape().dims().try_into().map_err(|_| candle_core::Error::Msg("attention: q must be 4-d".into()))?;
        let shape = l1.shape().clone();
        crate::trace::ran(self.kernel_name(candle_core::backend::BackendStorage::dtype(s1), dims[3]));
        let out = match (s1, s2, s3) {
            (CpuStorage::F32(q), CpuStorage::F32(k), CpuStorage::F32(v))
                if self.cpu == CpuKernel::RegistersBf16 && registers::bf16::runs(dims[3]) =>
            {
                // Each input rounded to bf16 once (all threads), then the bf16 kernel, writing f32 rows.
                let narrow = |x: &[f32]| {
                    // SAFETY: the chunks cover out, each written whole by narrow_bf16.
                    let mut out = unsafe { crate::elementwise::uninit_of::<half::bf16>(x.len()) };
                    out.par_chunks_mut(1 << 14).zip(x.par_chunks(1 << 14)).for_each(|(o, s)| crate::bf16_gemm::narrow_bf16(s, o));
                    out
                };
                // Views of one storage (stage 3's slices of its QKV output) are converted once.
                let qb = narrow(q);
                let same = |x: &[f32]| std::ptr::eq(x.as_ptr(), q.as_ptr()) && x.len() == q.len();
                let (kb, vb) = (if same(k) { None } else { Some(narrow(k)) }, if same(v) { None } else { Some(narrow(v)) });
                let (kb, vb) = (kb.as_deref().unwrap_or(&qb), vb.as_deref().unwrap_or(&qb));
                let qkv = [(qb.as_slice(), View::of(l1, q.len())?), (kb, View::of(l2, k.len())?), (vb, View::of(l3, v.len())?)];
                CpuStorage::F32(self.run_bf16::<f32>(qkv, dims)?)
            }
            (CpuStorage::F32(q), CpuStorage::F32(k), CpuStorage::F32(v)) => {
                let qkv = [(q.as_slice(), View::of(l1, q.len())?), (k, View::of(l2, k.len())?), (v, View::of(l3, v.len())?)];
                CpuStorage::F32(match self.cpu {
                    CpuKernel::GemmTiles | CpuKernel::Registers | CpuKernel::RegistersBf16 => self.run_tiles(qkv, dims, borrowed),
                    CpuKernel::RowAxpy => self.run_rowwise(qkv, dims),
                })
            }
            (CpuStorage::BF16(q), CpuStorage::BF16(k), CpuStorage::BF16(v)) => {
                let qkv = [(q.as_slice(), View::of(l1, q.len())?), (k, View::of(l2, k.len())?), (v, View::of(l3, v.len())?)];
                CpuStorage::BF16(match self.cpu {
                    CpuKernel::Registers | CpuKernel::RegistersBf16 if registers::bf16::runs(dims[3]) => self.run_bf16(qkv, dims)?,
                    CpuKernel::GemmTiles | CpuKernel::Registers | CpuKernel::RegistersBf16 => self.run_tiles(qkv, dims, widened),
                    CpuKernel::RowAxpy => self.run_rowwise(qkv, dims),
                })
            }
            (CpuStorage::F16(q), CpuStorage::F16(k), CpuStorage::F16(v)) => {
                let qkv = [(q.as_slice(), View::of(l1, q.len())?), (k, View::of(l2, k.len())?), (v, View::of(l3, v.len())?)];
                CpuStorage::F16(match self.cpu {
                    CpuKernel::GemmTiles | CpuKernel::Registers | CpuKernel::RegistersBf16 => self.run_tiles(qkv, dims, widened),
                    CpuKernel::RowAxpy => self.run_rowwise(qkv, dims),
                })
            }
            _ => candle_core::bail!(
                "attention: CPU kernel takes f32, bf16 or f16 (all three alike), got {:?}",
                candle_core::backend::BackendStorage::dtype(s1)
            ),
        };
        Ok((out, shape))
    }
}

/// The forward as a candle op without a backward (`q.apply_op3_no_bwd(&k, &v, &op)`), for
/// benches and tests; stage 2's op wraps `forward` with FlashAttention-2's backward.
impl candle_core::CustomOp3 for CpuAttention {
    fn name(&self) -> &'static str {
        "speedkit-cpu-attention"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        self.forward((s1, l1), (s2, l2), (s3, l3))
    }
}

/// Where a (B, T, n_head, d_head) input lives in its storage: the element offset and the
/// strides of b, t and h (d_head's is 1). Stage 2's contiguous tensors have strides
/// (T·C, C, d, 1); stage 3's q, k and v are views of its (B, T, 3, n_head, d_head) QKV output,
/// strides (3·T·C, 3·C, d, 1) at offsets 0, C and 2·C. The kernels read both in place.
#[derive(Clone, Copy, Debug)]
struct View {
    offset: usize,
    sb: usize,
    st: usize,
    sh: usize,
}

impl View {
    /// The view of a layout over a storage of `len` elements; an error (never an out-of-bounds
    /// read) unless d_head's elements are adjacent and every row lies inside the storage.
    fn of(l: &Layout, len: usize) -> candle_core::Result<View> {
        let (&[b, t, h, d], &[sb, st, sh, sd]) = (l.shape().dims(), l.stride()) else {
            candle_core::bail!("attention: inputs must be 4-d, got {:?}", l.shape())
        };
        if sd != 1 && d > 1 {
            candle_core::bail!("attention: the CPU kernel reads d_head elements adjacent (stride 1), got strides {:?}", l.stride());
        }
        let view = View { offset: l.start_offset(), sb, st, sh };
        let last = view.head(b - 1, h - 1) + (t - 1) * st + d;
        if last > len {
            candle_core::bail!("attention: a view {:?} with strides {:?} reaches past its storage ({len} elements)", l.shape(), l.stride());
        }
        Ok(view)
    }

    /// Offset of row 0 of head h in batch b; row r is `st` further on.
    fn head(&self, b: usize, h: usize) -> usize {
        self.offset + b * self.sb + h * self.sh
    }
}

/// One head's q, k and v rows in f32 (bf16 for `registers::bf16`), for the kernels: slices that
/// start at row 0 and run to the end of row T−1, with the distance between rows (`rs`).
struct HeadRows<'a, T = f32> {
    q: &'a [T],
    k: &'a [T],
    v: &'a [T],
    q_rs: usize,
    k_rs: usize,
    v_rs: usize,
}

/// One head's rows as f32, and the distance between them. f32 inputs are read where they are
/// (`st` apart); bf16/f16 inputs are widened into a (T, d) f32 buffer first (the GEMM
/// micro-kernels are f32; 3·T·d·4 bytes = 384 KiB at T = 512, d = 64 for q, k and v together,
/// so the copy stays in the worker's L2). `part` runs from row 0 to the end of row T−1.
fn borrowed(part: &[f32], _t: usize, _d: usize, st: usize) -> (Cow<'_, [f32]>, usize) {
    (Cow::Borrowed(part), st)
}

fn widened<T: WithDType>(part: &[T], t: usize, d: usize, st: usize) -> (Cow<'_, [f32]>, usize) {
    let mut out = Vec::with_capacity(t * d);
    for r in 0..t {
        out.extend(part[r * st..][..d].iter().map(|x| x.to_f64() as f32));
    }
    (Cow::Owned(out), d)
}

/// The output buffer, written by every task at rows no other task writes.
#[derive(Clone, Copy)]
struct OutPtr<T>(*mut T);
// SAFETY: tasks write disjoint rows (one (batch, head) each); see `run_tiles`.
unsafe impl<T> Send for OutPtr<T> {}
unsafe impl<T> Sync for OutPtr<T> {}

impl<T> OutPtr<T> {
    /// The element at offset i (a method, so closures capture the Send + Sync wrapper whole,
    /// not its raw-pointer field).
    ///
    /// # Safety
    /// i is inside the buffer.
    unsafe fn at(self, i: usize) -> *mut T {
        self.0.add(i)
    }
}

impl CpuAttention {
    /// The GEMM-tile kernel, one task per (batch, head), each writing its rows of the
    /// (B, T, n_head, d_head) output directly. `to_f32` gives a head's rows as f32 (`borrowed`
    /// or `widened`).
    fn run_tiles<'s, T: WithDType>(
        &self,
        [(q, qv), (k, kv), (v, vv)]: [(&'s [T], View); 3],
        [b, t, h, d]: [usize; 4],
        to_f32: impl Fn(&'s [T], usize, usize, usize) -> (Cow<'s, [f32]>, usize) + Sync,
    ) -> Vec<T> {
        // SAFETY: every row of every (batch, head) is written whole by `write` (each head's
        // kernel writes rows 0..T), and the (batch, head) pairs tile the output.
        let mut out = unsafe { crate::elementwise::uninit_of::<T>(b * t * h * d) };
        let ptr = OutPtr(out.as_mut_ptr());
        let mut lse = self.lse_buffer(b * h * t); // (B, n_head, T) while training, else empty
        let lse_ptr = OutPtr(lse.as_mut_ptr());
        (0..b * h).into_par_iter().for_each(|bh| {
            let (bi, hi) = (bh / h, bh % h);
            // Rows 0..T of this head in each input: from its view's offset, `st` apart.
            let rows = |x: &'s [T], view: View| {
                let start = view.head(bi, hi);
                to_f32(&x[start..start + (t - 1) * view.st + d], t, d, view.st)
            };
            let ((qh, q_rs), (kh, k_rs), (vh, v_rs)) = (rows(q, qv), rows(k, kv), rows(v, vv));
            let head = HeadRows { q: &qh, k: &kh, v: &vh, q_rs, k_rs, v_rs };
            // Output row r of this head: ((b·T + r)·n_head + h)·d, rows n_head·d apart.
            let base = (bi * t * h + hi) * d;
            let mut write = |r: usize, o: &[f32], l: f32| {
                // SAFETY: row r of head (bi, hi) lies inside `out` (base + r·h·d + d ≤ B·T·n_head·d)
                // and no other task writes it: tasks own distinct (b, h) pairs, and the rows of
                // different pairs do not overlap. The same for its L at bh·T + r in `lse`.
                let dst = unsafe { std::slice::from_raw_parts_mut(ptr.at(base + r * h * d), d) };
                crate::elementwise::store_f32(o, dst);
                if !lse.is_empty() {
                    unsafe { *lse_ptr.at(bh * t + r) = l };
                }
            };
            if matches!(self.cpu, CpuKernel::Registers | CpuKernel::RegistersBf16) && registers::supports(d) {
                registers::attend_head(&head, t, d, self.scale, self.causal, &mut write);
            } else {
                attend_head_tiles(&head, t, d, self.scale, self.causal, &mut write);
            }
        });
        self.keep_lse(lse);
        out
    }

    /// A buffer for the forward's log-sum-exp, `n` long while training, else empty.
    fn lse_buffer(&self, n: usize) -> Vec<f32> {
        vec![0f32; if self.lse.is_some() { n } else { 0 }]
    }

    /// Keep the log-sum-exp the forward wrote for `bwd`.
    fn keep_lse(&self, lse: Vec<f32>) {
        if let Some(slot) = &self.lse {
            *slot.lock().unwrap_or_else(|e| e.into_inner()) = Some(lse);
        }
    }

    /// The bf16 kernel (`registers::bf16`, products on AVX512-BF16), one task per (batch,
    /// head), reading bf16 q, k and v where they are and writing bf16 output rows directly.
    fn run_bf16<'s, T: WithDType>(
        &self,
        [(q, qv), (k, kv), (v, vv)]: [(&'s [half::bf16], View); 3],
        [b, t, h, d]: [usize; 4],
    ) -> candle_core::Result<Vec<T>> {
        // SAFETY: every row of every (batch, head) is written whole by `write` (each head's
        // kernel writes rows 0..T), and the (batch, head) pairs tile the output.
        let mut out = unsafe { crate::elementwise::uninit_of::<T>(b * t * h * d) };
        let ptr = OutPtr(out.as_mut_ptr());
        let mut lse = self.lse_buffer(b * h * t);
        let lse_ptr = OutPtr(lse.as_mut_ptr());
        (0..b * h).into_par_iter().try_for_each(|bh| {
            let (bi, hi) = (bh / h, bh % h);
            let rows = |x: &'s [half::bf16], view: View| -> &'s [half::bf16] { &x[view.head(bi, hi)..][..(t - 1) * view.st + d] };
            let head = HeadRows { q: rows(q, qv), k: rows(k, kv), v: rows(v, vv), q_rs: qv.st, k_rs: kv.st, v_rs: vv.st };
            let base = (bi * t * h + hi) * d; // output row r of this head at base + r·n_head·d
            let mut write = |r: usize, o: &[f32], l: f32| {
                // SAFETY: as in `run_tiles`: row r of head (bi, hi) is inside `out` and this task's own, its L too.
                let dst = unsafe { std::slice::from_raw_parts_mut(ptr.at(base + r * h * d), d) };
                crate::elementwise::store_f32(o, dst);
                if !lse.is_empty() {
                    unsafe { *lse_ptr.at(bh * t + r) = l };
                }
            };
            registers::bf16::attend_head(&head, t, d, self.scale, self.causal, &mut write).map_err(candle_core::Error::Msg)
        })?;
        self.keep_lse(lse);
        Ok(out)
    }

    /// The row-wise twin, one task per (batch, head): each writes its (T, d_head) result, then
    /// the results are scattered into the (B, T, n_head, d_head) output.
    fn run_rowwise<T: WithDType>(&self, [(q, qv), (k, kv), (v, vv)]: [(&[T], View); 3], [b, t, h, d]: [usize; 4]) -> Vec<T> {
        let heads: Vec<Vec<T>> = (0..b * h)
            .into_par_iter()
            .map(|bh| {
                let (bi, hi) = (bh / h, bh % h);
                let rows = |view: View| Rows { base: view.head(bi, hi), stride: view.st, d };
                rowwise_head(q, k, v, [rows(qv), rows(kv), rows(vv)], t, self.scale, self.causal)
            })
            .collect();
        // SAFETY: the heads' rows tile the output, each copied in whole below.
        let mut out = unsafe { crate::elementwise::uninit_of::<T>(b * t * h * d) };
        for (bh, o) in heads.iter().enumerate() {
            let base = (bh / h) * t * h * d + (bh % h) * d;
            for (r, row) in o.chunks_exact(d).enumerate() {
                out[base + r * h * d..][..d].copy_from_slice(row);
            }
        }
        out
    }
}

/// FlashAttention-2's forward pass for one (batch, head) with the two matrix products done as
/// tile GEMMs (Dao 2023, Algorithm 1, in the paper's notation). For each query tile Q_i
/// (B_r × d) and each key/value tile K_j, V_j (B_c × d):
///
/// ```text
/// S   = Q_i K_jᵀ / √d                      GEMM, B_r × B_c × d   (gemm's micro-kernel)
/// m'  = max(m, rowmax(S));  P = exp(S − m') on the tile, in L1/L2 (vectorised exp)
/// l   = e^(m − m')·l + rowsum(P);  O = e^(m − m')·O
/// O  += P V_j                              GEMM, B_r × d × B_c   (accumulates onto O)
/// ```
///
/// and at the end O_i / l is the output. The row-wise twin spent its time loading and storing
/// one O row per key (an axpy each); here both products are register-blocked GEMMs, which is
/// where the FLOPs are (4·T²·d per head against T² exponentials). Causal: tiles wholly above the
/// diagonal are never computed (the key loop stops at the query tile's last row), and the
/// diagonal block runs in strips of 64 rows, each against the keys up to its own last row, with
/// the strip's upper triangle masked by zeroing P there.
///
/// The softmax loops are compiled three times (baseline, AVX2+FMA, AVX-512) and picked at run
/// time, as in the row-wise twin; the GEMMs dispatch on their own. `write(r, o)` receives output
/// row r (normalised, f32).
fn attend_head_tiles(head: &HeadRows, t: usize, d: usize, scale: f32, causal: bool, write: &mut dyn FnMut(usize, &[f32], f32)) {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx512f") && std::arch::is_x86_feature_detected!("fma") {
        // SAFETY: this CPU supports AVX-512F and FMA, checked on the line above.
        return unsafe { attend_head_tiles_avx512(head, t, d, scale, causal, write) };
    }
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma") {
        // SAFETY: this CPU supports AVX2 and FMA, checked on the line above.
        return unsafe { attend_head_tiles_avx2_fma(head, t, d, scale, causal, write) };
    }
    attend_head_tiles_impl(head, t, d, scale, causal, write)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn attend_head_tiles_avx2_fma(
    head: &HeadRows,
    t: usize,
    d: usize,
    scale: f32,
    causal: bool,
    write: &mut dyn FnMut(usize, &[f32], f32),
) {
    attend_head_tiles_impl(head, t, d, scale, causal, write)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx2,fma")]
unsafe fn attend_head_tiles_avx512(
    head: &HeadRows,
    t: usize,
    d: usize,
    scale: f32,
    causal: bool,
    write: &mut dyn FnMut(usize, &[f32], f32),
) {
    attend_head_tiles_impl(head, t, d, scale, causal, write)
}

#[inline(always)]
fn attend_head_tiles_impl(head: &HeadRows, t: usize, d: usize, scale: f32, causal: bool, write: &mut dyn FnMut(usize, &[f32], f32)) {
    let HeadRows { q, k, v, q_rs, k_rs, v_rs } = *head;
    // Every row the tile GEMMs address lies inside these slices.
    assert!(
        q.len() >= (t - 1) * q_rs + d && k.len() >= (t - 1) * k_rs + d && v.len() >= (t - 1) * v_rs + d,
        "head rows sized by the caller"
    );
    let mut s = vec![0f32; BR * BC]; // S_ij, then P_ij, in place: B_r × B_c, row stride B_c
    let mut o = vec![0f32; BR * d]; // O_i: B_r × d
    let (mut m, mut l) = ([0f32; BR], [0f32; BR]);
    for i0 in (0..t).step_by(BR) {
        let br = BR.min(t - i0);
        o.fill(0.0); // O_i = 0
        m.fill(f32::NEG_INFINITY); // m_i = −∞
        l.fill(0.0); // l_i = 0
        let mut tile = Tile { head, d, scale, s: &mut s, o: &mut o, m: &mut m, l: &mut l };
        if causal {
            // Keys before i0 are visible to every row of the tile: whole B_c tiles, no mask.
            for j0 in (0..i0).step_by(BC) {
                tile.step(i0, 0..br, j0, BC.min(i0 - j0), false);
            }
            // The diagonal block (keys i0..i0+br) in strips of DIAG rows, each against the keys
            // up to its own last row: the masked waste is a DIAG × DIAG triangle per strip
            // instead of half of B_r × B_r. Tiles above the diagonal are never computed.
            for r0 in (0..br).step_by(DIAG) {
                let rows = r0..br.min(r0 + DIAG);
                tile.step(i0, rows.clone(), i0, rows.end, true);
            }
        } else {
            for j0 in (0..t).step_by(BC) {
                tile.step(i0, 0..br, j0, BC.min(t - j0), false);
            }
        }
        // O_i = diag(l)⁻¹ · O_i
        for r in 0..br {
            let (inv_l, row) = (1.0 / l[r], &mut o[r * d..][..d]);
            row.iter_mut().for_each(|x| *x *= inv_l);
            write(i0 + r, row, m[r] + l[r].ln()); // with L_i = m_i + ln l_i, which the backward can keep
        }
    }
}

/// Rows per strip of the causal diagonal block (`attend_head_tiles_impl`).
const DIAG: usize = 64;

/// One query tile's state: the scratch S/P tile, O_i, m_i and l_i (B_r rows each).
struct Tile<'a, 'h> {
    head: &'a HeadRows<'h>,
    d: usize,
    scale: f32,
    s: &'a mut [f32],
    o: &'a mut [f32],
    m: &'a mut [f32; BR],
    l: &'a mut [f32; BR],
}

impl Tile<'_, '_> {
    /// One step of the online softmax for query rows i0 + `rows` (rows within the tile) against
    /// keys j0..j0+bc: S = Q·Kᵀ/√d, P = exp(S − m'), m, l, O updated, O += P·V. `causal`: row
    /// i0 + r sees keys up to its own position only (the diagonal block).
    #[inline(always)]
    fn step(&mut self, i0: usize, rows: std::ops::Range<usize>, j0: usize, bc: usize, causal: bool) {
        let HeadRows { q, k, v, q_rs, k_rs, v_rs } = *self.head;
        let (d, nr, r0) = (self.d, rows.len(), rows.start);
        // S = (1/√d) · Q K_jᵀ: Q's rows are q_rs apart; K_jᵀ is read as K_j with its strides
        // swapped (column stride k_rs, row stride 1). One thread: rayon is already busy with
        // the other heads.
        // SAFETY: the Q rows i0+r0..i0+r0+nr and K rows j0..j0+bc lie inside q and k (the caller
        // asserted T rows of each; both ranges end at or before T); S has room for nr ≤ B_r rows
        // of B_c ≥ bc; nothing else aliases s.
        unsafe {
            gemm::gemm(
                nr,
                bc,
                d,
                self.s.as_mut_ptr(),
                1,
                BC as isize,
                false,
                q[(i0 + r0) * q_rs..].as_ptr(),
                1,
                q_rs as isize,
                k[j0 * k_rs..].as_ptr(),
                k_rs as isize,
                1,
                0.0,
                self.scale,
                false,
                false,
                false,
                gemm::Parallelism::None,
            )
        };
        for i in 0..nr {
            let r = r0 + i; // row within the tile
                            // Keys this row may see in this tile: all, or up to its own position.
            let n = if causal { bc.min((i0 + r + 1).saturating_sub(j0)) } else { bc };
            let p = &mut self.s[i * BC..][..bc];
            if n == 0 {
                p.fill(0.0); // P = 0: this row sees none of these keys
                continue;
            }
            let m_new = max_f32(&p[..n], self.m[r]); // m' = max(m, rowmax(S))
            let alpha = exp_f32(self.m[r] - m_new); // e^(m − m'): 0 on the first tile (m = −∞)
            p[..n].iter_mut().for_each(|x| *x = exp_f32(*x - m_new)); // P = exp(S − m')
            p[n..].fill(0.0); // masked (causal diagonal): P = 0
            self.l[r] = alpha * self.l[r] + sum_f32(&p[..n]); // l = e^(m − m')·l + rowsum(P)
            if alpha != 1.0 {
                self.o[r * d..][..d].iter_mut().for_each(|x| *x *= alpha); // O = e^(m − m')·O
            }
            self.m[r] = m_new;
        }
        // O += P V_j: P is nr × bc (row stride B_c), V_j's rows v_rs apart.
        // SAFETY: V rows j0..j0+bc lie inside v (as K's above); O has rows r0..r0+nr ≤ B_r of d;
        // P lies in s; o and s do not alias.
        unsafe {
            gemm::gemm(
                nr,
                d,
                bc,
                self.o[r0 * d..].as_mut_ptr(),
                1,
                d as isize,
                true,
                self.s.as_ptr(),
                1,
                BC as isize,
                v[j0 * v_rs..].as_ptr(),
                1,
                v_rs as isize,
                1.0,
                1.0,
                false,
                false,
                false,
                gemm::Parallelism::None,
            )
        };
    }
}

/// max(init, max(row)) with 16 running maxima, so the loop vectorises (a single running max is a
/// dependency chain the compiler may not reorder).
#[inline(always)]
fn max_f32(row: &[f32], init: f32) -> f32 {
    let mut acc = [init; 16];
    let mut chunks = row.chunks_exact(16);
    for c in &mut chunks {
        for (a, &x) in acc.iter_mut().zip(c) {
            *a = if x > *a { x } else { *a };
        }
    }
    let tail = chunks.remainder().iter().fold(init, |a, &x| if x > a { x } else { a });
    acc.iter().fold(tail, |a, &x| if x > a { x } else { a })
}

/// Where one head's rows live inside an input's storage (the row-wise twin's loads).
#[derive(Clone, Copy)]
struct Rows {
    base: usize,
    stride: usize,
    d: usize,
}

impl Rows {
    /// Copy rows r0..r0+n into `dst` (n × d, f32): the tile load.
    fn load<T: WithDType>(&self, src: &[T], r0: usize, n: usize, dst: &mut [f32]) {
        for (i, out) in dst.chunks_exact_mut(self.d).take(n).enumerate() {
            let row = &src[self.base + (r0 + i) * self.stride..][..self.d];
            for (o, x) in out.iter_mut().zip(row) {
                *o = x.to_f64() as f32;
            }
        }
    }

    /// Copy rows r0..r0+n into `dst` transposed (d × B_c, f32): column c of the tile becomes a
    /// contiguous row, so the score loop below runs along keys, one SIMD lane per key.
    fn load_transposed<T: WithDType>(&self, src: &[T], r0: usize, n: usize, dst: &mut [f32]) {
        for j in 0..n {
            let row = &src[self.base + (r0 + j) * self.stride..][..self.d];
            for (c, x) in row.iter().enumerate() {
                dst[c * ROW_BC + j] = x.to_f64() as f32;
            }
        }
    }
}

/// The slow twin (`CpuKernel::RowAxpy`), the first CPU kernel: FlashAttention-2's forward pass for one (batch, head), in the paper's notation (Dao 2023,
/// Algorithm 1): for each query tile Q_i, stream the key/value tiles K_j, V_j and keep per
/// query row a running max m, a running softmax denominator l and an unnormalised output
/// accumulator O, rescaling both whenever the max grows. Scratch is O(T·d) for the result
/// plus the O((B_r + B_c)·d) tiles — never O(T²).
///
/// The CPU's vector width is decided at run time: the same body is compiled three times, for the
/// x86-64 baseline (SSE2: 4 lanes, separate multiply and add), with AVX2 + FMA (8 lanes, fused
/// multiply-add) and with AVX-512 (16 lanes), and the fastest one this CPU supports runs. Release builds for the
/// baseline target would otherwise leave half the vector units idle.
fn rowwise_head<T: WithDType>(q: &[T], k: &[T], v: &[T], [qr, kr, vr]: [Rows; 3], t: usize, scale: f32, causal: bool) -> Vec<T> {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx512f") && std::arch::is_x86_feature_detected!("fma") {
        // SAFETY: this CPU supports AVX-512F and FMA, checked on the line above.
        return unsafe { rowwise_head_avx512(q, k, v, [qr, kr, vr], t, scale, causal) };
    }
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma") {
        // SAFETY: this CPU supports AVX2 and FMA, checked on the line above.
        return unsafe { rowwise_head_avx2_fma(q, k, v, [qr, kr, vr], t, scale, causal) };
    }
    // aarch64 always has fused multiply-add (NEON); elsewhere use separate multiply and add.
    rowwise_head_impl::<T, { cfg!(target_arch = "aarch64") }>(q, k, v, [qr, kr, vr], t, scale, causal)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn rowwise_head_avx2_fma<T: WithDType>(
    q: &[T],
    k: &[T],
    v: &[T],
    [qr, kr, vr]: [Rows; 3],
    t: usize,
    scale: f32,
    causal: bool,
) -> Vec<T> {
    rowwise_head_impl::<T, true>(q, k, v, [qr, kr, vr], t, scale, causal)
}

/// The same body with 16-lane AVX-512 registers: a B_c = 64 score row is four registers.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx2,fma")]
unsafe fn rowwise_head_avx512<T: WithDType>(
    q: &[T],
    k: &[T],
    v: &[T],
    [qr, kr, vr]: [Rows; 3],
    t: usize,
    scale: f32,
    causal: bool,
) -> Vec<T> {
    rowwise_head_impl::<T, true>(q, k, v, [qr, kr, vr], t, scale, causal)
}

#[inline(always)]
fn rowwise_head_impl<T: WithDType, const FMA: bool>(
    q: &[T],
    k: &[T],
    v: &[T],
    [qr, kr, vr]: [Rows; 3],
    t: usize,
    scale: f32,
    causal: bool,
) -> Vec<T> {
    let d = qr.d;
    let mut out = crate::elementwise::zeros_of::<T>(t * d);
    let (mut q_tile, mut o_tile) = (vec![0f32; ROW_BR * d], vec![0f32; ROW_BR * d]);
    let (mut k_tile_t, mut v_tile) = (vec![0f32; d * ROW_BC], vec![0f32; ROW_BC * d]); // K_jᵀ (d × B_c), V_j (B_c × d)
    let (mut m, mut l, mut s) = ([0f32; ROW_BR], [0f32; ROW_BR], [0f32; ROW_BC]);

    for i0 in (0..t).step_by(ROW_BR) {
        let br = ROW_BR.min(t - i0);
        qr.load(q, i0, br, &mut q_tile);
        o_tile.fill(0.0); // O_i = 0
        m.fill(f32::NEG_INFINITY); // m_i = −∞
        l.fill(0.0); // l_i = 0

        // Causal: keys after this tile's last query are masked for every row in it, so those
        // K/V tiles are skipped entirely — about half the work at long T.
        let kv_end = if causal { i0 + br } else { t };
        for j0 in (0..kv_end).step_by(ROW_BC) {
            let bc = ROW_BC.min(kv_end - j0);
            kr.load_transposed(k, j0, bc, &mut k_tile_t);
            vr.load(v, j0, bc, &mut v_tile);
            for r in 0..br {
                // Keys this row may see in this tile: all, or up to its own position.
                let n = if causal { bc.min((i0 + r + 1).saturating_sub(j0)) } else { bc };
                if n == 0 {
                    continue;
                }
                // S_r = q_r · K_jᵀ / √d, all B_c keys at once: for each channel c, broadcast
                // q_rc and multiply-add it into the B_c scores (eight keys per AVX2 register,
                // the whole row of scores held in registers; lanes past n are never read).
                s.fill(0.0);
                for (c, &q_rc) in q_tile[r * d..][..d].iter().enumerate() {
                    let k_c: &[f32; ROW_BC] = k_tile_t[c * ROW_BC..][..ROW_BC].try_into().expect("ROW_BC wide");
                    for (s_j, &k_cj) in s.iter_mut().zip(k_c) {
                        *s_j = fma::<FMA>(q_rc, k_cj, *s_j);
                    }
                }
                let mut m_new = m[r];
                for s_j in s[..n].iter_mut() {
                    *s_j *= scale;
                    m_new = m_new.max(*s_j); // m_new = max(m, rowmax(S))
                }
                // Rescale what was accumulated under the old max: α = exp(m − m_new)
                // (m = −∞ on the first tile gives α = 0).
                let alpha = (m[r] - m_new).exp();
                let o_r = &mut o_tile[r * d..][..d];
                o_r.iter_mut().for_each(|o| *o *= alpha); // O = α·O
                l[r] *= alpha; // l = α·l

                // P_rj = exp(S_rj − m_new) for the whole row first: one loop the compiler
                // vectorises (shared's libm-free exp), instead of a scalar exp per key.
                let mut row_sum = 0f32;
                for s_j in s[..n].iter_mut() {
                    *s_j = exp_f32(*s_j - m_new);
                    row_sum += *s_j;
                }
                l[r] += row_sum; // l += rowsum(P)
                for (j, &p) in s[..n].iter().enumerate() {
                    axpy::<FMA>(p, &v_tile[j * d..][..d], o_r); // O += P_rj · v_j
                }
                m[r] = m_new;
            }
        }
        // O_i = diag(l)⁻¹ · O_i, written out in the input dtype.
        for r in 0..br {
            let inv_l = 1.0 / l[r];
            let dst = &mut out[(i0 + r) * d..][..d];
            for (o, &acc) in dst.iter_mut().zip(&o_tile[r * d..][..d]) {
                *o = T::from_f64((acc * inv_l) as f64);
            }
        }
    }
    out
}

/// a·b + c, as one fused instruction where the CPU has it (and exact rounding either way).
#[inline(always)]
fn fma<const FMA: bool>(a: f32, b: f32, c: f32) -> f32 {
    if FMA {
        a.mul_add(b, c)
    } else {
        a * b + c
    }
}

/// y += a·x
#[inline(always)]
fn axpy<const FMA: bool>(a: f32, x: &[f32], y: &mut [f32]) {
    for (yi, xi) in y.iter_mut().zip(x) {
        *yi = fma::<FMA>(a, *xi, *yi);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn axpy_both_bodies() {
        let x: Vec<f32> = (0..19).map(|i| i as f32).collect();
        let (mut y1, mut y2) = (vec![1f32; 19], vec![1f32; 19]);
        axpy::<false>(2.0, &x, &mut y1);
        axpy::<true>(2.0, &x, &mut y2);
        assert_eq!(y1, y2);
        assert_eq!(y1[3], 7.0);
    }

    #[test]
    fn rowwise_twin_baseline_and_fma_bodies_agree() {
        // Whichever body this CPU dispatches to, the other one is checked here too.
        let (t, h, d) = (77, 2, 64);
        let n = t * h * d;
        let data = shared::weights::SplitMix64::new(3).normals(3 * n);
        let (q, k, v) = (&data[..n], &data[n..2 * n], &data[2 * n..]);
        let rows = [Rows { base: d, stride: h * d, d }; 3]; // the second head
        for causal in [true, false] {
            let a = rowwise_head_impl::<f32, false>(q, k, v, rows, t, 0.125, causal);
            let b = rowwise_head_impl::<f32, true>(q, k, v, rows, t, 0.125, causal);
            let worst = a.iter().zip(&b).map(|(x, y)| (x - y).abs()).fold(0f32, f32::max);
            assert!(worst < 1e-5, "causal={causal}: {worst}");
            // The compiled-for-SIMD bodies, where this CPU has them.
            #[cfg(target_arch = "x86_64")]
            for (name, ok, body) in [
                (
                    "avx2",
                    std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma"),
                    rowwise_head_avx2_fma::<f32> as unsafe fn(_, _, _, _, _, _, _) -> _,
                ),
                (
                    "avx512",
                    std::arch::is_x86_feature_detected!("avx512f") && std::arch::is_x86_feature_detected!("fma"),
                    rowwise_head_avx512::<f32>,
                ),
            ] {
                if ok {
                    // SAFETY: the CPU has the features this body is compiled for (checked in `ok`).
                    let c = unsafe { body(q, k, v, rows, t, 0.125, causal) };
                    let worst = a.iter().zip(&c).map(|(x, y)| (x - y).abs()).fold(0f32, f32::max);
                    assert!(worst < 1e-5, "{name} causal={causal}: {worst}");
                }
            }
        }
    }

    #[test]
    fn gemm_tile_kernel_simd_bodies_agree_with_the_baseline_one() {
        // The tile kernel's baseline body (scalar softmax loops) against the AVX2 and AVX-512
        // ones, on a head read through strides (the second of 2 heads, rows 3·h·d apart as in
        // stage 3's QKV output) with a ragged T (neither a multiple of B_r nor of B_c).
        type Body = unsafe fn(&HeadRows, usize, usize, f32, bool, &mut dyn FnMut(usize, &[f32], f32));
        let (t, h, d) = (BC + BR + 13, 2, 32);
        let rs = 3 * h * d;
        let data = shared::weights::SplitMix64::new(5).normals(t * rs);
        let head = HeadRows { q: &data[d..], k: &data[h * d + d..], v: &data[2 * h * d + d..], q_rs: rs, k_rs: rs, v_rs: rs };
        let run = |body: Body, causal: bool| {
            let mut out = vec![0f32; t * d];
            // SAFETY: called only with bodies this CPU supports (checked by the caller).
            unsafe { body(&head, t, d, 0.17, causal, &mut |r, o, _| out[r * d..][..d].copy_from_slice(o)) };
            out
        };
        fn baseline(h: &HeadRows, t: usize, d: usize, s: f32, c: bool, w: &mut dyn FnMut(usize, &[f32], f32)) {
            attend_head_tiles_impl(h, t, d, s, c, w)
        }
        for causal in [true, false] {
            let a = run(baseline as Body, causal);
            assert!(a.iter().all(|x| x.is_finite()) && a.iter().any(|&x| x != 0.0));
            #[cfg(target_arch = "x86_64")]
            for (name, ok, body) in [
                (
                    "avx2",
                    std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma"),
                    attend_head_tiles_avx2_fma as Body,
                ),
                (
                    "avx512",
                    std::arch::is_x86_feature_detected!("avx512f") && std::arch::is_x86_feature_detected!("fma"),
                    attend_head_tiles_avx512,
                ),
            ] {
                if ok {
                    let c = run(body, causal);
                    let worst = a.iter().zip(&c).map(|(x, y)| (x - y).abs()).fold(0f32, f32::max);
                    assert!(worst < 1e-5, "{name} causal={causal}: {worst}");
                }
            }
        }
    }

    #[test]
    fn max_f32_takes_every_element() {
        for n in [0, 1, 15, 16, 17, 40] {
            for at in 0..n {
                let mut row = vec![-1f32; n];
                row[at] = 2.5;
                assert_eq!(max_f32(&row, -3.0), 2.5, "n={n} at={at}");
            }
            assert_eq!(max_f32(&vec![-1f32; n], 7.0), 7.0);
        }
    }
}
