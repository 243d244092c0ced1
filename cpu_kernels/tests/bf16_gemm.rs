//! The bf16 GEMM against its scalar twin and against an f32 GEMM: ragged shapes (M, N, K not
//! multiples of the tiles, K odd so the last pair is half empty), strided and transposed views,
//! accumulation, NaN and inf, batched candle tensors, and the conversion fallback.

use candle_core::{DType, Device, Tensor};
use cpu_kernels::bf16_gemm::{
    self, gemm, gemm_packed, gemm_packed_bf16, gemm_scalar, Kernel, MatRef, PackedB, PackedWeight, KC, MC, MC_AMX, MR, NC, NR,
};
use half::bf16;

/// A small deterministic generator (xorshift), values in [-1, 1) rounded to bf16.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> f32 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        (self.0 >> 40) as f32 / (1u64 << 23) as f32 - 1.0
    }

    fn below(&mut self, n: usize) -> usize {
        ((self.next() + 1.0) * 0.5 * n as f32) as usize % n
    }

    fn bf16s(&mut self, n: usize) -> Vec<bf16> {
        (0..n).map(|_| bf16::from_f32(self.next())).collect()
    }
}

/// The kernels this CPU and build run without converting (none on a CPU without bf16
/// instructions in a build without MKL).
fn native() -> Vec<Kernel> {
    [Kernel::Amx, Kernel::Avx512Bf16, Kernel::Mkl].into_iter().filter(|k| k.available()).collect()
}

/// |got − want| within f32 rounding of a k-term sum of products bounded by `scale`.
fn assert_close(got: &[f32], want: &[f32], k: usize, scale: f32, what: &str) {
    assert_eq!(got.len(), want.len(), "{what}");
    let tol = 4.0 * f32::EPSILON * (k as f32 + 2.0) * scale;
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        let ok = (g - w).abs() <= tol || (g.is_nan() && w.is_nan()) || (g == w);
        assert!(ok, "{what}: element {i}: {g} vs {w} (tolerance {tol})");
    }
}

/// Shapes around the tile edges: 1, odd, just under and over MR, NR, MC, NC, and K odd; K over
/// two slices of KC pairs (C carried from slice to slice), the last one ragged.
fn ragged_shapes(rng: &mut Rng) -> Vec<(usize, usize, usize)> {
    let mut shapes = vec![(1, 1, 1), (MR, NR, 2), (MR + 1, NR - 1, 3), (MC + 5, NC + 3, 257), (2 * MC - 1, 33, 511), (13, 2 * NC + 17, 64)];
    shapes.push((MR + 1, NR + 7, 4 * KC + 3));
    // A row-major A over more than one column block is packed whole before the tasks (on the
    // AVX-512 kernel): several row blocks, column blocks and K slices, all ragged.
    shapes.push((MC + 5, NC + 3, 2 * KC + 3));
    shapes.push((MC_AMX + 7, NR + 5, 129)); // across AMX's task rows
                                            // Several row blocks × several column blocks × several K slices: AMX packs each row block's A
                                            // once per call and reuses it for the next column block on the same thread.
    shapes.push((2 * MC_AMX + 8, NC + 8, 401));
    for _ in 0..6 {
        shapes.push((1 + rng.below(150), 1 + rng.below(300), 1 + 2 * rng.below(200)));
        // K odd
    }
    shapes
}

#[test]
fn kernel_matches_scalar_twin_and_f32_gemm_on_ragged_shapes() {
    let mut rng = Rng(0x5eed_1234_abcd_ef01);
    let kernels = native();
    if kernels.is_empty() {
        eprintln!("no bf16 unit on this CPU: the kernels are checked where one is (they refuse to run here, see below)");
    }
    for (m, n, k) in ragged_shapes(&mut rng) {
        let (a, b) = (rng.bf16s(m * k), rng.bf16s(k * n));
        let (av, bv) = (MatRef::row_major(&a, m, k), MatRef::row_major(&b, k, n));
        let mut twin = vec![0f32; m * n];
        gemm_scalar(&mut twin, av, bv, false);
        // An f32 GEMM on the widened operands (f64 sums, then f32): the reference both approximate.
        let f32_gemm: Vec<f32> =
            (0..m * n).map(|ij| (0..k).map(|kk| a[ij / n * k + kk].to_f64() * b[kk * n + ij % n].to_f64()).sum::<f64>() as f32).collect();
        assert_close(&twin, &f32_gemm, k, 1.0, &format!("scalar twin vs f32 GEMM at {m}×{n}×{k}"));
        for &kernel in &kernels {
            for parallel in [false, true] {
                let mut c = vec![f32::NAN; m * n]; // overwritten, never read, when not accumulating
                gemm(kernel, &mut c, av, bv, false, parallel).unwrap();
                assert_close(&c, &twin, k, 1.0, &format!("{} vs scalar twin at {m}×{n}×{k}", kernel.name()));
                if kernel == Kernel::Mkl {
                    continue; // MKL reads b unpacked
                }
                // B packed once, then read by `gemm_packed` (what a layer's weight gets).
                let packed = PackedB::new(kernel, bv, parallel).unwrap();
                assert_eq!((packed.k(), packed.n(), packed.kernel()), (k, n, kernel));
                let mut c = vec![f32::NAN; m * n];
                gemm_packed(&mut c, av, &packed, false, parallel).unwrap();
                assert_close(&c, &twin, k, 1.0, &format!("{} packed vs scalar twin at {m}×{n}×{k}", kernel.name()));
                // bf16 out: the same f32 sums (per-task scratch), each rounded to bf16 as stored.
                let mut c16 = vec![bf16::NAN; m * n];
                gemm_packed_bf16(&mut c16, av, &packed, parallel).unwrap();
                let mut narrowed = vec![bf16::ZERO; m * n];
                bf16_gemm::narrow_bf16(&c, &mut narrowed);
                assert!(c16.iter().zip(&narrowed).all(|(x, y)| x.to_bits() == y.to_bits()), "{} bf16 out at {m}×{n}×{k}", kernel.name());
                // f32 out with an output pass and the pre-pass values kept (a training step's
                // bias + GELU): keep is exactly the product, c the pass applied to it.
                let bias: Vec<f32> = (0..n).map(|j| j as f32 * 0.25 - 1.0).collect();
                // and a residual row by its index i, as stage 3's fc2 adds x
                let resid = |i: usize, j: usize| ((i * 7 + j * 3) % 5) as f32 - 2.0;
                let pass = |i: usize, j0: usize, row: &mut [f32]| {
                    row.iter_mut().enumerate().for_each(|(j, v)| *v = (*v + bias[j0 + j]).max(0.0) + resid(i, j0 + j))
                };
                let (mut out, mut kept) = (vec![f32::NAN; m * n], vec![f32::NAN; m * n]);
                bf16_gemm::gemm_packed_with(&mut out, Some(&mut kept), av, &packed, parallel, Some(&pass)).unwrap();
                assert!(kept.iter().zip(&c).all(|(x, y)| x.to_bits() == y.to_bits()), "{} kept at {m}×{n}×{k}", kernel.name());
                let want: Vec<f32> = c.iter().enumerate().map(|(ij, v)| (v + bias[ij % n]).max(0.0) + resid(ij / n, ij % n)).collect();
                assert!(out.iter().zip(&want).all(|(x, y)| x.to_bits() == y.to_bits()), "{} f32 out pass at {m}×{n}×{k}", kernel.name());
                // The same pass with a bf16 out (a training step's fc1 on the CPU): keep exactly
                // the product again, c the pass's result rounded as stored.
                let (mut out16, mut kept16) = (vec![bf16::NAN; m * n], vec![f32::NAN; m * n]);
                bf16_gemm::gemm_packed_bf16_with(&mut out16, Some(&mut kept16), av, &packed, parallel, Some(&pass)).unwrap();
                assert!(kept16.iter().zip(&c).all(|(x, y)| x.to_bits() == y.to_bits()), "{} kept, bf16 out at {m}×{n}×{k}", kernel.name());
                bf16_gemm::narrow_bf16(&want, &mut narrowed);
                assert!(
                    out16.iter().zip(&narrowed).all(|(x, y)| x.to_bits() == y.to_bits()),
                    "{} bf16 out pass at {m}×{n}×{k}",
                    kernel.name()
                );
            }
        }
    }
}

#[test]
fn strided_and_transposed_views_and_accumulation() {
    let mut rng = Rng(77);
    for &kernel in &native() {
        for (m, n, k) in [(37, 45, 19), (MC + 1, NR + 1, 129)] {
            // A is every other column of a wider matrix; B is read transposed from an (n, k) W,
            // as a linear layer's x·Wᵀ is.
            let wide = rng.bf16s(m * 2 * k + 1);
            let a = MatRef { data: &wide, offset: 1, rows: m, cols: k, rs: 2 * k, cs: 2 };
            let w = rng.bf16s(n * k);
            let b = MatRef::row_major(&w, n, k).t();
            let start: Vec<f32> = (0..m * n).map(|_| rng.next()).collect();
            let (mut want, mut got) = (start.clone(), start.clone());
            gemm_scalar(&mut want, a, b, true);
            gemm(kernel, &mut got, a, b, true, true).unwrap();
            assert_close(&got, &want, k, 2.0, &format!("{} strided, accumulating, {m}×{n}×{k}", kernel.name()));
            if kernel != Kernel::Mkl {
                // The same W packed once serves two products (packing does not consume it).
                let packed = PackedB::new(kernel, b, true).unwrap();
                for _ in 0..2 {
                    let mut got = start.clone();
                    gemm_packed(&mut got, a, &packed, true, true).unwrap();
                    assert_close(&got, &want, k, 2.0, &format!("{} packed, strided, accumulating, {m}×{n}×{k}", kernel.name()));
                }
                // bf16 out from the strided A: the f32 product, rounded.
                let (mut f, mut c16, mut narrowed) = (vec![0f32; m * n], vec![bf16::NAN; m * n], vec![bf16::ZERO; m * n]);
                gemm_packed(&mut f, a, &packed, false, true).unwrap();
                gemm_packed_bf16(&mut c16, a, &packed, true).unwrap();
                bf16_gemm::narrow_bf16(&f, &mut narrowed);
                assert!(c16.iter().zip(&narrowed).all(|(x, y)| x.to_bits() == y.to_bits()), "{} strided bf16 out", kernel.name());
            }
        }
    }
}

/// The backward's orientations on ragged shapes: dX = dZ·W reads W (n × k, row-major) as B
/// itself, and dW = dZᵀ·X reads dZ transposed as A (column-major: a row's elements a column
/// apart); both packed in memory order (`pack_pairs`). K odd, and every size just off the tiles.
#[test]
fn backward_orientations_match_the_scalar_twin_on_ragged_shapes() {
    let mut rng = Rng(0xbac_4a2d);
    let mut shapes = vec![(1, 1, 1), (MR + 1, NR - 1, 3), (MC + 5, NR + 3, 257), (33, 2 * NR + 1, 2 * KC + 5), (2 * MC + 7, 45, 130)];
    // A packed whole before the tasks (every column-major A on the AVX-512 kernel): several row
    // blocks (the last ragged), column blocks and K slices (the last ragged), K odd.
    shapes.push((2 * MC + 7, NC + 5, 2 * KC + 5));
    // K over 1024 pairs: AMX's K slices (512 pairs) carry C from one to the next, the last ragged.
    shapes.push((MC_AMX + 3, NR + 9, 2 * 1024 + 37));
    for _ in 0..4 {
        shapes.push((1 + rng.below(200), 1 + rng.below(200), 1 + 2 * rng.below(150)));
    }
    for &kernel in &native() {
        for &(m, n, k) in &shapes {
            // A column-major: the m × k operand is the transpose of a stored k × m matrix.
            let stored = rng.bf16s(k * m);
            let a = MatRef::row_major(&stored, k, m).t();
            // B row-major k × n, as a weight W read untransposed (dX = dZ·W).
            let w = rng.bf16s(k * n);
            let b = MatRef::row_major(&w, k, n);
            // And f32 operands in the same orientations, rounded as packed.
            let stored32: Vec<f32> = stored.iter().map(|v| v.to_f32() * 1.001).collect();
            let a32 = MatRef::row_major(&stored32, k, m).t();
            let w32: Vec<f32> = w.iter().map(|v| v.to_f32() * 0.999).collect();
            let b32 = MatRef::row_major(&w32, k, n);
            for (what, parallel) in [("sequential", false), ("parallel", true)] {
                let mut want = vec![0f32; m * n];
                gemm_scalar(&mut want, a, b, false);
                let mut got = vec![f32::NAN; m * n];
                gemm(kernel, &mut got, a, b, false, parallel).unwrap();
                assert_close(&got, &want, k, 1.0, &format!("{} column-major A · row-major B, {what}, {m}×{n}×{k}", kernel.name()));
                let mut want = vec![0f32; m * n];
                gemm_scalar(&mut want, a32, b, false);
                let mut got = vec![f32::NAN; m * n];
                gemm(kernel, &mut got, a32, b, false, parallel).unwrap();
                assert_close(&got, &want, k, 1.0, &format!("{} f32 column-major A, {what}, {m}×{n}×{k}", kernel.name()));
                let mut want = vec![0f32; m * n];
                gemm_scalar(&mut want, a32, b32, false);
                let mut got = vec![f32::NAN; m * n];
                gemm(kernel, &mut got, a32, b32, false, parallel).unwrap();
                assert_close(&got, &want, k, 1.0, &format!("{} f32 column-major A · f32 row-major B, {what}, {m}×{n}×{k}", kernel.name()));
            }
        }
    }
}

#[test]
fn nan_and_inf_propagate_as_in_an_f32_gemm() {
    let (m, n, k) = (MR + 3, NR + 5, 9);
    let mut rng = Rng(9);
    for &kernel in &native() {
        let mut a = rng.bf16s(m * k);
        let b = rng.bf16s(k * n);
        a[2 * k + 4] = bf16::NAN; // row 2: NaN everywhere
        a[5 * k] = bf16::INFINITY; // row 5: ±inf (sign of b[0][j]), or NaN where b[0][j] = 0
        a[7 * k + 1] = bf16::INFINITY;
        a[7 * k + 2] = bf16::NEG_INFINITY; // row 7: inf − inf = NaN where both b are nonzero
        let (av, bv) = (MatRef::row_major(&a, m, k), MatRef::row_major(&b, k, n));
        let mut want = vec![0f32; m * n];
        gemm_scalar(&mut want, av, bv, false);
        let mut got = vec![0f32; m * n];
        gemm(kernel, &mut got, av, bv, false, true).unwrap();
        for i in 0..m * n {
            let (g, w) = (got[i], want[i]);
            if w.is_nan() || w.is_infinite() {
                assert!(g.is_nan() == w.is_nan() && (w.is_nan() || g == w), "{}: element {i}: {g} vs {w}", kernel.name());
            }
        }
        assert!((0..n).all(|j| got[2 * n + j].is_nan()), "a NaN in row 2 makes all of row 2 NaN");
        assert!((0..n).all(|j| got[5 * n + j].is_infinite() || b[j].to_f32() == 0.0), "inf in row 5");
        assert_close(&got[..2 * n], &want[..2 * n], k, 1.0, "finite rows are untouched");
    }
}

#[test]
fn kernels_the_cpu_lacks_are_refused_not_run() {
    let (a, b) = (vec![bf16::ONE; 4], vec![bf16::ONE; 4]);
    let (av, bv) = (MatRef::row_major(&a, 2, 2), MatRef::row_major(&b, 2, 2));
    let mut c = vec![0f32; 4];
    for kernel in [Kernel::Amx, Kernel::Avx512Bf16, Kernel::Mkl, Kernel::ConvertedF32] {
        let r = gemm(kernel, &mut c, av, bv, false, false);
        assert_eq!(r.is_ok(), kernel.is_native() && kernel.available(), "{kernel:?}: {r:?}");
        if let Ok(()) = r {
            assert_eq!(c, [2.0; 4]);
        }
    }
    // Shapes that do not fit are an error too.
    assert!(gemm(Kernel::detect(), &mut c, av, MatRef::row_major(&b, 1, 4), false, false).is_err());
    // Packing: only for our kernels, and only those this CPU has; a packed b of another k refused.
    for kernel in [Kernel::Amx, Kernel::Avx512Bf16, Kernel::Mkl, Kernel::ConvertedF32] {
        let packed = PackedB::new(kernel, bv, false);
        let ours = kernel.available() && matches!(kernel, Kernel::Amx | Kernel::Avx512Bf16);
        assert_eq!(packed.is_ok(), ours, "{kernel:?}: {packed:?}");
        if let Ok(packed) = packed {
            let long = vec![bf16::ONE; 6];
            let r = gemm_packed(&mut c, MatRef::row_major(&long, 2, 3), &packed, false, false);
            assert!(r.is_err(), "{kernel:?}: a (2 × 3) · packed (2 × 2) must be refused");
        }
    }
}

#[test]
fn detection_falls_back_when_told_to() {
    assert_eq!(Kernel::detect_with(Some("off")), Kernel::ConvertedF32);
    assert_eq!(Kernel::detect_with(Some("f32")), Kernel::ConvertedF32);
    assert_ne!(Kernel::detect_with(Some("avx512-bf16")), Kernel::Amx);
    // Case does not matter: `OFF` is `off`, not auto.
    assert_eq!(Kernel::detect_with(Some("OFF")), Kernel::ConvertedF32);
    assert_ne!(Kernel::detect_with(Some("AVX512-BF16")), Kernel::Amx);
    let auto = Kernel::detect_with(None);
    assert!(auto.available());
    // On a CPU with a bf16 unit, auto finds it; without one, conversion.
    assert_eq!(auto.is_native(), Kernel::Amx.available() || Kernel::Avx512Bf16.available());
}

/// The candle op against its slow twin: a linear's x·Wᵀ (W read transposed), attention's
/// batched Q·Kᵀ on strided views, f32 and the forced fallback.
#[test]
fn matmul_op_matches_its_slow_twin() {
    let dev = Device::Cpu;
    let bf = |t: Tensor| t.to_dtype(DType::BF16).unwrap();
    let x = bf(Tensor::randn(0f32, 1.0, (67, 131), &dev).unwrap());
    let w = bf(Tensor::randn(0f32, 0.02, (45, 131), &dev).unwrap());
    let q = bf(Tensor::randn(0f32, 1.0, (2, 3, 29, 16), &dev).unwrap());
    let kt = bf(Tensor::randn(0f32, 1.0, (2, 29, 3, 16), &dev).unwrap()).transpose(1, 2).unwrap(); // (2, 3, 29, 16) strided
    let cases = [(x.clone(), w.t().unwrap()), (q, kt.t().unwrap())];
    let mut kernels = native();
    kernels.push(Kernel::ConvertedF32);
    for (a, b) in &cases {
        let want = bf16_gemm::matmul_slow(a, b).unwrap().to_dtype(DType::F32).unwrap();
        for &kernel in &kernels {
            let got = bf16_gemm::matmul_with(a, b, kernel).unwrap();
            assert_eq!((got.dims(), got.dtype()), (want.dims(), DType::BF16), "{}", kernel.name());
            let got = got.to_dtype(DType::F32).unwrap();
            // Both round an f32 sum to bf16: at most one bf16 step apart (2^-8 relative).
            let diff = (&got - &want).unwrap().abs().unwrap();
            let bound = (want.abs().unwrap() * (1.0 / 128.0)).unwrap() + 1e-6;
            let over = diff.gt(&bound.unwrap()).unwrap().to_dtype(DType::F32).unwrap().sum_all().unwrap().to_scalar::<f32>().unwrap();
            assert_eq!(over, 0.0, "{} on {:?}", kernel.name(), a.dims());
        }
    }
    // f32 operands are candle's matmul, unchanged.
    let (a, b) = (x.to_dtype(DType::F32).unwrap(), w.t().unwrap().to_dtype(DType::F32).unwrap());
    let same = (bf16_gemm::matmul(&a, &b).unwrap() - a.matmul(&b).unwrap()).unwrap().abs().unwrap().max_all().unwrap();
    assert_eq!(same.to_scalar::<f32>().unwrap(), 0.0);
}

/// f32 operands, rounded to bf16 as the kernel packs them: the kernel against its scalar twin
/// on ragged shapes (f32 A with bf16 B, as a linear's f32 activation times a bf16 weight; both
/// f32 and strided, as attention's products), and against the twin fed operands rounded first.
#[test]
fn f32_operands_are_rounded_as_packed() {
    let mut rng = Rng(0xf32);
    for &kernel in &native() {
        for (m, n, k) in ragged_shapes(&mut rng) {
            let a: Vec<f32> = (0..m * k).map(|_| rng.next() * 3.0).collect(); // not bf16 values
            let b = rng.bf16s(k * n);
            let (av, bv) = (MatRef::row_major(&a, m, k), MatRef::row_major(&b, k, n));
            let mut twin = vec![0f32; m * n];
            gemm_scalar(&mut twin, av, bv, false);
            let rounded: Vec<bf16> = a.iter().map(|&x| bf16::from_f32(x)).collect();
            let mut rounded_first = vec![0f32; m * n];
            gemm_scalar(&mut rounded_first, MatRef::row_major(&rounded, m, k), bv, false);
            assert_eq!(twin, rounded_first, "the twin rounds f32 to bf16 (nearest even) at {m}×{n}×{k}");
            let mut c = vec![f32::NAN; m * n];
            gemm(kernel, &mut c, av, bv, false, true).unwrap();
            assert_close(&c, &twin, k, 3.0, &format!("{} f32 × bf16 at {m}×{n}×{k}", kernel.name()));
            // Both f32, B strided (every other column of a wider matrix).
            let wide: Vec<f32> = (0..k * 2 * n).map(|_| rng.next()).collect();
            let bw = MatRef { data: &wide, offset: 1, rows: k, cols: n, rs: 2 * n, cs: 2 };
            let (mut want, mut got) = (vec![0f32; m * n], vec![0f32; m * n]);
            gemm_scalar(&mut want, av, bw, false);
            gemm(kernel, &mut got, av, bw, false, false).unwrap();
            assert_close(&got, &want, k, 3.0, &format!("{} f32 × f32 strided at {m}×{n}×{k}", kernel.name()));
        }
    }
}

/// The op with f32 operands: `matmul` (f32 activation × bf16 weight) and `matmul_bf16` (two f32
/// operands, batched, strided) give f32, against the slow twin (round, widen, f32 matmul), on
/// every kernel including the forced fallback.
#[test]
fn matmul_op_with_f32_operands_gives_f32() {
    let dev = Device::Cpu;
    let x = Tensor::randn(0f32, 1.0, (67, 131), &dev).unwrap();
    let w = Tensor::randn(0f32, 0.02, (45, 131), &dev).unwrap().to_dtype(DType::BF16).unwrap();
    let q = Tensor::randn(0f32, 1.0, (2, 3, 29, 16), &dev).unwrap();
    let kt = Tensor::randn(0f32, 1.0, (2, 29, 3, 16), &dev).unwrap().transpose(1, 2).unwrap(); // strided
    let mut kernels = native();
    kernels.push(Kernel::ConvertedF32);
    for (a, b) in [(x.clone(), w.t().unwrap()), (q.clone(), kt.t().unwrap())] {
        let want = bf16_gemm::matmul_slow(&a, &b).unwrap();
        assert_eq!(want.dtype(), DType::F32);
        for &kernel in &kernels {
            // Two f32 operands: `matmul_bf16`, on the detected kernel.
            let got =
                if b.dtype() == DType::BF16 { bf16_gemm::matmul_with(&a, &b, kernel) } else { bf16_gemm::matmul_bf16(&a, &b) }.unwrap();
            assert_eq!((got.dims(), got.dtype()), (want.dims(), DType::F32), "{}", kernel.name());
            let worst = (&got - &want).unwrap().abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap();
            assert!(worst < 1e-4, "{} on {:?}: {worst}", kernel.name(), a.dims());
        }
    }
}

/// `matmul_prepacked` (W packed once in `PackedWeight`) against its slow twin and against
/// `matmul` on x·Wᵀ: bf16 and f32 activations, batched, ragged sizes, every kernel including the
/// forced fallback (which holds W unpacked); f32 weights are never packed and give candle's matmul.
#[test]
fn prepacked_matmul_matches_matmul_and_its_slow_twin() {
    let dev = Device::Cpu;
    let w = Tensor::randn(0f32, 0.02, (NR + 13, 131), &dev).unwrap().to_dtype(DType::BF16).unwrap(); // (N, K), K odd
    let x = Tensor::randn(0f32, 1.0, (2, MR + 55, 131), &dev).unwrap(); // (B, T, K)
    let mut kernels = native();
    kernels.push(Kernel::ConvertedF32);
    for x in [x.clone(), x.to_dtype(DType::BF16).unwrap()] {
        let (flat, wt) = (x.reshape(((), 131)).unwrap(), w.t().unwrap());
        let want = bf16_gemm::matmul_slow(&flat, &wt).unwrap().reshape((2, MR + 55, NR + 13)).unwrap();
        for &kernel in &kernels {
            let pw = PackedWeight::with_kernel(&w, kernel).unwrap();
            assert_eq!(pw.packed().is_some(), matches!(kernel, Kernel::Amx | Kernel::Avx512Bf16), "{}", kernel.name());
            let got = bf16_gemm::matmul_prepacked(&x, &pw).unwrap();
            assert_eq!((got.dims(), got.dtype()), (want.dims(), x.dtype()), "{}", kernel.name());
            let unpacked = bf16_gemm::matmul_with(&flat, &wt, kernel).unwrap().reshape(got.dims()).unwrap();
            let same = (got.to_dtype(DType::F32).unwrap() - unpacked.to_dtype(DType::F32).unwrap()).unwrap();
            let same = same.abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap();
            assert_eq!(same, 0.0, "{}: packed once or per call, the same products in the same order", kernel.name());
            let (got, want) = (got.to_dtype(DType::F32).unwrap(), want.to_dtype(DType::F32).unwrap());
            let diff = (&got - &want).unwrap().abs().unwrap();
            let bound = (want.abs().unwrap() * (1.0 / 128.0)).unwrap() + 1e-4;
            let over = diff.gt(&bound.unwrap()).unwrap().to_dtype(DType::F32).unwrap().sum_all().unwrap().to_scalar::<f32>().unwrap();
            assert_eq!(over, 0.0, "{} on {:?} {:?}", kernel.name(), x.dims(), x.dtype());
        }
    }
    // An f32 weight is held as it is: candle's f32 matmul, unchanged.
    let (x, wf) = (x.to_dtype(DType::F32).unwrap(), w.to_dtype(DType::F32).unwrap());
    let pw = PackedWeight::new(&wf).unwrap();
    assert!(pw.packed().is_none());
    let want = x.reshape(((), 131)).unwrap().matmul(&wf.t().unwrap()).unwrap().reshape((2, MR + 55, NR + 13)).unwrap();
    let same = (bf16_gemm::matmul_prepacked(&x, &pw).unwrap() - want).unwrap();
    assert_eq!(same.abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap(), 0.0);
    // A K that does not match W is an error, not a fault.
    let short = Tensor::zeros((3, 130), DType::BF16, &dev).unwrap();
    assert!(bf16_gemm::matmul_prepacked(&short, &PackedWeight::new(&w).unwrap()).is_err());
}
