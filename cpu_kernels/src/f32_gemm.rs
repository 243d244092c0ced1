//! The f32 GEMM into a destination: dst (m × n) = x (m × k) · Wᵀ, or dst += x · Wᵀ, W (n × k)
//! row-major as a linear layer stores it. What a GEMM with a fused output pass needs (the
//! destination already holds the bias and residual, and the GEMM accumulates onto it); the same
//! library candle's f32 matmul runs in this build (the `gemm` crate, or MKL's sgemm with `mkl`).

/// dst (m × n, row-major) = x (m × k, row-major) · Wᵀ (+ dst when `accumulate`), W (n × k,
/// row-major). With the `mkl` feature: MKL's sgemm (β = 1 accumulates onto dst, β = 0 overwrites it), the library candle's matmul uses in that
/// build, so a fused output pass runs the same GEMM as the stages' matmuls. (MKL could also pre-pack W once in
/// `build` with cblas_sgemm_pack; not done here, see docs/cpu.md.)
#[cfg(feature = "mkl")]
pub fn gemm_into(dst: &mut [f32], x: &[f32], w: &[f32], (m, n, k): (usize, usize, usize), accumulate: bool) {
    extern "C" {
        // MKL's CBLAS, linked by intel-mkl-src through candle-core's `mkl` feature.
        fn cblas_sgemm(
            layout: i32,
            transa: i32,
            transb: i32,
            m: i32,
            n: i32,
            k: i32,
            alpha: f32,
            a: *const f32,
            lda: i32,
            b: *const f32,
            ldb: i32,
            beta: f32,
            c: *mut f32,
            ldc: i32,
        );
    }
    const ROW_MAJOR: i32 = 101;
    const NO_TRANS: i32 = 111;
    const TRANS: i32 = 112;
    assert!(dst.len() == m * n && x.len() == m * k && w.len() == n * k, "gemm operands sized by the caller");
    let dim = |v: usize| i32::try_from(v).expect("GEMM dimension fits MKL's 32-bit (LP64) interface");
    // SAFETY: the slices hold exactly m·n, m·k and n·k elements (asserted above), row-major with
    // leading dimensions k (x), k (W, read transposed) and n (dst); dst is unique.
    unsafe {
        cblas_sgemm(
            ROW_MAJOR,
            NO_TRANS,
            TRANS,
            dim(m),
            dim(n),
            dim(k),
            1.0,
            x.as_ptr(),
            dim(k),
            w.as_ptr(),
            dim(k),
            if accumulate { 1.0 } else { 0.0 },
            dst.as_mut_ptr(),
            dim(n),
        )
    }
}

/// dst (m × n, row-major) = x (m × k, row-major) · Wᵀ (+ dst when `accumulate`), W (n × k,
/// row-major), via the gemm crate (candle's own CPU GEMM): W is read as the k × n right-hand side
/// with column stride k.
#[cfg(not(feature = "mkl"))]
pub fn gemm_into(dst: &mut [f32], x: &[f32], w: &[f32], (m, n, k): (usize, usize, usize), accumulate: bool) {
    let threads = candle_core::utils::get_num_threads();
    let parallelism = if threads > 1 { gemm::Parallelism::Rayon(threads) } else { gemm::Parallelism::None };
    assert!(dst.len() == m * n && x.len() == m * k && w.len() == n * k, "gemm operands sized by the caller");
    // SAFETY: the three slices hold exactly m·n, m·k and n·k elements (asserted above) and the
    // strides below address them row-major, so every access is in bounds; dst is unique.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            dst.as_mut_ptr(),
            1,          // dst column stride
            n as isize, // dst row stride
            accumulate, // read dst: it holds the bias (and residual) to accumulate onto
            x.as_ptr(),
            1,
            k as isize,
            w.as_ptr(),
            k as isize, // rhs[kk][j] = W[j][kk]: next column is the next row of W
            1,
            1.0, // alpha: dst keeps its value (when read)
            1.0, // beta: + x·Wᵀ
            false,
            false,
            false,
            parallelism,
        )
    }
}
