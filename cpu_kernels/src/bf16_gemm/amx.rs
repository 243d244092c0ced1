//! The AMX-BF16 path: `tdpbf16ps` multiplies a 16-row × 16-pair A tile by a 16-pair × 16-column
//! B tile into a 16 × 16 f32 C tile, one instruction for 16·16·32 = 8192 multiply-adds. Eight tile
//! registers (tmm0–7) of 1 KiB each: here four C tiles (a 32 × 32 block of C), two A tiles and two
//! B tiles, so every A and B tile loaded feeds two products.
//!
//! B's packed panels (`pack_b`, NR = 32 columns, pairs along k) are already AMX's B layout: a
//! tile is 16 consecutive pairs (rows) of 16 columns, rows 128 bytes apart. A is packed as its
//! tiles: per 32-row panel and 16 pairs of k, two 16-row tiles of 64-byte rows, each one
//! contiguous KiB, so a tile load reads 16 neighbouring cache lines (rows a whole slice apart
//! were 20–40 % slower in a loop of loads and products alone). K is padded to a multiple of 16
//! pairs with zeros. Every packed buffer starts on a 64-byte boundary (`Lines`).
//!
//! Linux hands out the tile state on request only (`arch_prctl(ARCH_REQ_XCOMP_PERM,
//! XFEATURE_XTILEDATA)`); without it the first tile instruction kills the process, so `request`
//! asks first and the kernel is used only when Linux said yes. Rust's AMX intrinsics are not
//! stable, so the instructions are written with `asm!`.

use super::{Lines, MatRef, Operand, NR};

/// Rows of C per block of four C tiles.
const TM: usize = 32;
/// k-pairs per slice: each slice loads and stores every C tile once, so K ≤ 1024 is one slice
/// (qkv, proj and fc1, and dX of proj and fc2), the weight gradients' K = 2048 two, and K = 3072
/// (fc2, dX of fc1) three. A B panel slice (KCA × NR × 4 bytes = 64 KiB) does not stay in L1:
/// the tile product prefetches each step's next B rows (and A's) instead. At `small`'s linears,
/// their dX and their dW, two threads on the AMX Xeon, paired calls against 192 pairs (a 24 KiB
/// B slice that stayed in L1): 512 ran 0.85–0.98 of its time on all twelve shapes, 384 and 768
/// about the same. Before the prefetches, 512 had lost 5–15 % to 128 pairs.
const KCA: usize = 512;
/// k-pairs per tile (64 bytes of bf16 pairs per tile row).
pub const TK: usize = 16;

/// Whether the CPU has AMX-TILE and AMX-BF16, the OS enabled their state (XCR0 bits 17, 18), and
/// Linux granted this process the tile data. Asked once (see `amx_available`).
pub fn request() -> bool {
    #[cfg(target_os = "linux")]
    {
        use std::arch::x86_64::{__cpuid, __cpuid_count};
        // SAFETY: cpuid is available on every x86_64 CPU (safe to call on newer Rust, hence the allow).
        #[allow(unused_unsafe)]
        let (max_leaf, leaf7) = unsafe { (__cpuid(0).eax, __cpuid_count(7, 0)) };
        let amx_tile = max_leaf >= 7 && leaf7.edx & (1 << 24) != 0;
        let amx_bf16 = max_leaf >= 7 && leaf7.edx & (1 << 22) != 0;
        if !(amx_tile && amx_bf16 && std::arch::is_x86_feature_detected!("xsave")) {
            return false;
        }
        // SAFETY: xgetbv(0) is valid where XSAVE is (checked above).
        let xcr0 = unsafe { xcr0() };
        if xcr0 & (0b11 << 17) != 0b11 << 17 {
            return false;
        }
        const ARCH_REQ_XCOMP_PERM: libc::c_long = 0x1023;
        const XFEATURE_XTILEDATA: libc::c_long = 18;
        // SAFETY: arch_prctl with these arguments only changes this process's permissions.
        unsafe { libc::syscall(libc::SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0 }
    }
    #[cfg(not(target_os = "linux"))]
    {
        false
    }
}

#[cfg(target_os = "linux")]
#[target_feature(enable = "xsave")]
unsafe fn xcr0() -> u64 {
    std::arch::x86_64::_xgetbv(0)
}

/// The tile configuration (palette 1): tmm0–7 all 16 rows of 64 bytes.
#[repr(C, align(64))]
struct TileConfig([u8; 64]);

impl TileConfig {
    fn all_16_by_64() -> Self {
        let mut cfg = [0u8; 64];
        cfg[0] = 1; // palette 1
        for t in 0..8 {
            cfg[16 + 2 * t..][..2].copy_from_slice(&64u16.to_le_bytes()); // bytes per row
            cfg[48 + t] = 16; // rows
        }
        TileConfig(cfg)
    }
}

/// Configures the tiles as every AMX kernel here uses them: tmm0–7, each 16 rows of 64 bytes
/// (16 × 16 f32, or 16 rows × 16 bf16 pairs). Pair with `release` on the same thread.
///
/// # Safety
/// `request()` returned true in this process.
pub(crate) unsafe fn configure() {
    let cfg = TileConfig::all_16_by_64();
    core::arch::asm!("ldtilecfg [{}]", in(reg) cfg.0.as_ptr(), options(nostack, readonly));
}

/// Hands the tile state back (`tilerelease`), after `configure`.
///
/// # Safety
/// `configure` ran on this thread.
pub(crate) unsafe fn release() {
    core::arch::asm!("tilerelease", options(nostack, nomem));
}

/// One task's block of C, as `super::block`, on AMX tiles. `kp` is a multiple of `TK` here.
///
/// A's rows are packed once per GEMM call and row block, not once per task: the packed block
/// (every K slice, `mc` × `kp` pairs: 1.5 MiB at fc2's K = 3072) stays in a per-thread buffer
/// keyed by `a_id` (the call's, from `super::next_call_id`; 0: never reused) and the block's
/// first element, so the next task on this thread with the same rows — the next NC columns —
/// reads it instead of converting and interleaving A again (four times per row block at
/// n = 3072, three at 2304).
///
/// # Safety
/// `request()` returned true in this process; the block lies inside C (row length `ldc`) and no
/// other thread writes it; `packed_b` holds ⌈n / NR⌉ panels of kp × NR pairs; `a_id`, when not
/// 0, names this GEMM call's A alone.
#[allow(clippy::too_many_arguments)]
pub unsafe fn block<T: Operand>(
    c: *mut f32,
    ldc: usize,
    a: MatRef<T>,
    packed_b: &[u32],
    kp: usize,
    (i0, mc): (usize, usize),
    (j0, nc): (usize, usize),
    accumulate: bool,
    a_id: u64,
) {
    debug_assert!(kp.is_multiple_of(TK) && NR == 32);
    /// (call id, offset of the block's first row in A's data, rows, pairs).
    type Key = (u64, usize, usize, usize);
    thread_local! {
        /// The last packed A block on this thread, and its key.
        static PACKED_A: std::cell::RefCell<(Key, Lines<u32>)> = std::cell::RefCell::new(((0, 0, 0, 0), Lines::default()));
    }
    PACKED_A.with_borrow_mut(|(key, packed_all)| {
        let slice_len = mc.div_ceil(TM) * TM * KCA; // one full K slice of the block
        let want = (a_id, a.offset + i0 * a.rs, mc, kp);
        let cached = a_id != 0 && *key == want;
        if !cached {
            // Rows i0..i0+mc, all pairs, slice after slice (slice p0 / KCA at its multiple of
            // `slice_len`), each in panels of TM rows (zero rows past m); a panel is kc / TK steps
            // of two A tiles, each tile 16 rows × 16 pairs in one contiguous KiB. Every word is
            // written (no clearing pass): pack_pairs writes all kc pairs of the block's rows,
            // zeros past K included.
            *key = (0, 0, 0, 0); // invalid until packed whole
            packed_all.resize_keeping(kp.div_ceil(KCA) * slice_len);
            for (slice, p0) in (0..kp).step_by(KCA).enumerate() {
                let kc = KCA.min(kp - p0);
                let steps = kc / TK;
                let packed_a = &mut packed_all[slice * slice_len..][..mc.div_ceil(TM) * TM * kc];
                for (panel, out) in packed_a.chunks_mut(TM * kc).enumerate() {
                    let rows = TM.min(mc - panel * TM);
                    for (s, tiles) in out.chunks_mut(TM * TK).enumerate().take(steps) {
                        super::pack_pairs(&a, (i0 + panel * TM, rows), (p0 + s * TK, TK), tiles, (TK, 1));
                        tiles[rows * TK..].fill(0); // rows past the block: zero products, never stored
                    }
                }
            }
            *key = want;
        }
        block_packed(c, ldc, packed_all, slice_len, packed_b, kp, (i0, mc), (j0, nc), accumulate);
    });
}

/// `block` from A's packed block (`slice_len` words per K slice).
#[allow(clippy::too_many_arguments)]
unsafe fn block_packed(
    c: *mut f32,
    ldc: usize,
    packed_all: &[u32],
    slice_len: usize,
    packed_b: &[u32],
    kp: usize,
    (i0, mc): (usize, usize),
    (j0, nc): (usize, usize),
    accumulate: bool,
) {
    configure();
    let mut tile = Lines::<f32>::zeroed(TM * NR); // four C tiles, rows 128 bytes apart
    for (slice, p0) in (0..kp).step_by(KCA).enumerate() {
        let kc = KCA.min(kp - p0);
        let packed_a = &packed_all[slice * slice_len..];
        let load = accumulate || p0 > 0;
        // A: the panel's two contiguous 1 KiB tiles per step; B: the panel's pair rows, NR wide.
        let a_base = packed_a.as_ptr();
        let operands = |ir: usize, b_panel: *const u32| TileOperands {
            a: a_base.wrapping_add(ir * kc) as *const u8,
            lda: TK * 4,
            a_step: TM * TK * 4,
            b: b_panel as *const u8,
            ldb: NR * 4,
            b_step: TK * NR * 4,
        };
        for jr in (0..nc).step_by(NR) {
            let (j, nr) = (j0 + jr, NR.min(nc - jr));
            let b_panel = packed_b[((j / NR) * kp + p0) * NR..][..kc * NR].as_ptr();
            for ir in (0..mc).step_by(TM) {
                let (i, mr) = (i0 + ir, TM.min(mc - ir));
                if mr == TM && nr == NR {
                    // A whole 32 × 32 block: the C tiles load from and store to C itself.
                    tile_product(kc / TK, &operands(ir, b_panel), c.add(i * ldc + j) as *mut u8, ldc * 4, load);
                    continue;
                }
                // An edge block: staged in a 32 × 32 buffer (zeros past the edge), then copied back.
                tile.fill(0.0);
                if load {
                    for r in 0..mr {
                        for q in 0..nr {
                            tile[r * NR + q] = *c.add((i + r) * ldc + j + q);
                        }
                    }
                }
                tile_product(kc / TK, &operands(ir, b_panel), tile.as_mut_ptr() as *mut u8, NR * 4, load);
                for r in 0..mr {
                    for q in 0..nr {
                        *c.add((i + r) * ldc + j + q) = tile[r * NR + q];
                    }
                }
            }
        }
    }
    release();
}

/// Where a 2 × 2 tile product reads its operands, in bytes: A's two 16-row tiles (rows `lda`
/// apart, the second 16 rows below the first) and B's two 16-column tiles (rows `ldb` apart, the
/// second 64 bytes right of the first), both moving on by `a_step` / `b_step` per 16 pairs.
pub(crate) struct TileOperands {
    pub a: *const u8,
    pub lda: usize,
    pub a_step: usize,
    pub b: *const u8,
    pub ldb: usize,
    pub b_step: usize,
}

/// `prefetcht0` of the line holding `p`; an address outside any buffer is ignored (no fault).
#[inline(always)]
fn prefetch(p: *const u8) {
    // SAFETY: a prefetch reads nothing architecturally and never faults.
    unsafe { core::arch::x86_64::_mm_prefetch::<{ core::arch::x86_64::_MM_HINT_T0 }>(p as *const i8) }
}

/// C (32 × 32 f32, rows `ldc` bytes apart) = A (32 rows × 16·steps pairs) · B (16·steps pairs ×
/// 32 columns) (+ C when `load`; else C's tiles start at zero), 16 pairs per step: C00 += A0·B0,
/// C01 += A0·B1, C10 += A1·B0, C11 += A1·B1 in tmm0–3, A in tmm4–5 and B in tmm6–7, each tile
/// loaded just before its first product. C is read and written where it lies. The GEMM's block
/// (A packed as contiguous tiles) and the attention's two products (Q·Kᵀ, P·V) all run on it.
///
/// # Safety
/// Tiles are configured (`configure`); the operands address `steps` steps as described, and
/// the 32 × 32 block at `c` is this thread's own.
pub(crate) unsafe fn tile_product(steps: usize, ops: &TileOperands, c: *mut u8, ldc: usize, load: bool) {
    if load {
        core::arch::asm!(
            "tileloadd tmm0, [{c0} + {ldc}*1]",
            "tileloadd tmm1, [{c0} + {ldc}*1 + 64]",
            "tileloadd tmm2, [{c1} + {ldc}*1]",
            "tileloadd tmm3, [{c1} + {ldc}*1 + 64]",
            c0 = in(reg) c, c1 = in(reg) c.add(16 * ldc), ldc = in(reg) ldc,
            options(nostack, readonly),
        );
    } else {
        core::arch::asm!("tilezero tmm0", "tilezero tmm1", "tilezero tmm2", "tilezero tmm3", options(nostack, nomem));
    }
    let TileOperands { a, lda, a_step, b, ldb, b_step } = *ops;
    for step in 0..steps {
        let (a0, b0) = (a.add(step * a_step), b.add(step * b_step));
        // The next step's A and B rows into L1 while this step's products run: tile registers
        // are not renamed, so a tile load that misses L1 holds up the products after it.
        let (a_next, b_next) = (a0.wrapping_add(a_step), b0.wrapping_add(b_step));
        for r in 0..32 {
            prefetch(a_next.wrapping_add(r * lda));
        }
        for r in 0..16 {
            prefetch(b_next.wrapping_add(r * ldb));
            prefetch(b_next.wrapping_add(r * ldb + 64));
        }
        core::arch::asm!(
            "tileloadd tmm4, [{a0} + {lda}*1]",
            "tileloadd tmm6, [{b0} + {ldb}*1]",
            "tdpbf16ps tmm0, tmm4, tmm6",
            "tileloadd tmm7, [{b0} + {ldb}*1 + 64]",
            "tdpbf16ps tmm1, tmm4, tmm7",
            "tileloadd tmm5, [{a1} + {lda}*1]",
            "tdpbf16ps tmm2, tmm5, tmm6",
            "tdpbf16ps tmm3, tmm5, tmm7",
            a0 = in(reg) a0, a1 = in(reg) a0.add(16 * lda), lda = in(reg) lda, b0 = in(reg) b0, ldb = in(reg) ldb,
            options(nostack, readonly),
        );
    }
    core::arch::asm!(
        "tilestored [{c0} + {ldc}*1], tmm0",
        "tilestored [{c0} + {ldc}*1 + 64], tmm1",
        "tilestored [{c1} + {ldc}*1], tmm2",
        "tilestored [{c1} + {ldc}*1 + 64], tmm3",
        c0 = in(reg) c, c1 = in(reg) c.add(16 * ldc), ldc = in(reg) ldc,
        options(nostack),
    );
}
