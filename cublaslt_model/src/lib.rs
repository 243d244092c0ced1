//! A CPU model of cuBLASLt's matmul contract, written from NVIDIA's cuBLASLt documentation
//! (`cublasLtMatmul`, `cublasLtMatrixLayout_t`, `cublasLtEpilogue_t`, the A/B scale pointers),
//! so the arguments the project passes to cuBLASLt can be executed — and checked against each
//! op's slow twin — on a machine with no GPU.
//!
//! The contract, column-major throughout (element (i, j) of a matrix with leading dimension ld
//! lives at `i + j·ld`):
//!
//! ```text
//! D = α·(scale_A·scale_B)·op(A)·op(B) + β·C          op(X) = X or Xᵀ per TRANSA / TRANSB
//! D = epilogue(D): BIAS adds bias[i] to row i of D; GELU_BIAS then applies GELU (tanh form)
//! ```
//!
//! The training epilogues (`matmul_ex`, which returns what they write besides D):
//!
//! ```text
//! GELU_AUX_BIAS  z = D + bias[i];  aux(i, j) = z (rounded to aux's type);  D = GELU(z)
//! DGELU_BGRAD    D = gelu′(aux(i, j)) · D;  bias[i] = Σ_j D(i, j)       (bias: m long, written)
//! BGRADA         D as is;  bias[i] = Σ_l op(A)(i, l)                    (m long: rows of D)
//! BGRADB         D as is;  bias[j] = Σ_l op(B)(l, j)                    (n long: columns of D)
//! ```
//!
//! aux is an m × n column-major matrix with its own leading dimension
//! (CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD), which for GELU's aux must be a multiple of 8 and at
//! least m; its type defaults to D's (EPILOGUE_AUX_DATA_TYPE). The bias gradient is written
//! through the bias pointer, in D's type unless BIAS_DATA_TYPE says otherwise (we never set it
//! outside FP8, as TransformerEngine does not). The BGRAD reductions run over the GEMM's k.
//! Transposes: the model accepts the combinations TransformerEngine's LayerNormMLP runs through
//! `cublaslt_gemm.cu` (GELU's derivative on the "NN" data-gradient GEMM, BGRADB with B
//! transposed on the "NT" weight-gradient GEMM; BGRADA with A not transposed, its mirror) and
//! refuses the others, which we have not seen cuBLASLt promise: such a call should fail loudly
//! rather than compute something else.
//!
//! with op(A) m × k, op(B) k × n, C and D m × n. A layout states its type, rows, columns and
//! leading dimension (≥ rows); the stored A is k × m when transposed, m × k when not (B: n × k,
//! k × n). The model refuses what cuBLASLt would refuse (a shape that does not fit, ld < rows,
//! a bias not m long) and rounds D to D's type at the end (the accumulation is f32 in cuBLASLt,
//! f64 here: the difference is far below the bf16/f16 roundings the tests compare through).
//!
//! FP8 output (`matmul_fp8_out`): with D in E4M3, cuBLASLt's documented FP8 contract adds a D
//! scale and an amax of the result (CUBLASLT_MATMUL_DESC_D_SCALE_POINTER, AMAX_D_POINTER):
//!
//! ```text
//! D_temp = epilogue(α·scale_A·scale_B·op(A)·op(B) + β·scale_C·C)
//! amax_D = max |D_temp|              (before the D scale: the value a delayed recipe records)
//! D      = E4M3(scale_D · D_temp)    (scale_D multiplies: it is the *quantisation* scale, 1/s)
//! ```
//!
//! C (not read at β = 0) is typed bf16 or f16 with an E4M3 D, as cuBLAS's table of FP8 type
//! combinations asks. The cast is modelled saturating (±448), as TransformerEngine relies on.
//!
//! FP8 inputs (E4M3 or E5M2 A or B) follow cuBLASLt's FP8 rules, which the model enforces:
//! the "TN" form only (A transposed, B not: both operands K-major, as the FP8 tensor cores load
//! them), and not both E5M2 (E4M3 × E4M3, E4M3 × E5M2 and E5M2 × E4M3 are the combinations
//! cuBLAS lists). A training GEMM whose gradient is E5M2 therefore needs its other operand in
//! E4M3 and, where the natural form is not TN, transposed copies of its operands.
//!
//! Not modelled: algorithm choice, workspace, split-K order of summation, FP8 fast accumulation
//! (Hopper's reduced-precision partial sums), alignment rules. Those need a GPU.

/// The element types the project's GEMMs use.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DataType {
    F32,
    Bf16,
    F16,
    /// FP8 E4M3 (inputs; or D, with a D scale: `matmul_fp8_out`).
    E4m3,
    /// FP8 E5M2 (inputs only): 2 mantissa bits, f16's exponent range; training's gradients.
    E5m2,
}

impl DataType {
    /// Bytes per element.
    pub fn size_in_bytes(self) -> u64 {
        match self {
            DataType::F32 => 4,
            DataType::Bf16 | DataType::F16 => 2,
            DataType::E4m3 | DataType::E5m2 => 1,
        }
    }

    /// `v` rounded to this type (round to nearest even, saturating for E4M3 as the cast does).
    pub fn round(self, v: f64) -> f64 {
        match self {
            DataType::F32 => v as f32 as f64,
            DataType::Bf16 => half::bf16::from_f64(v).to_f64(),
            DataType::F16 => half::f16::from_f64(v).to_f64(),
            DataType::E4m3 => e4m3(v),
            DataType::E5m2 => e5m2(v),
        }
    }

    /// Whether this is one of the 8-bit float formats (cuBLASLt's FP8 rules apply).
    pub fn is_fp8(self) -> bool {
        matches!(self, DataType::E4m3 | DataType::E5m2)
    }
}

/// v rounded to E4M3: 3 mantissa bits, round to nearest even, subnormals below 2⁻⁶ in steps of
/// 2⁻⁹, saturating at ±448, NaN kept. (Inputs arrive already quantised: exact for them.)
pub fn e4m3(v: f64) -> f64 {
    if v.is_nan() {
        return v;
    }
    let a = v.abs();
    if a.is_infinite() {
        return 448f64.copysign(v);
    }
    let quantum = 2f64.powf(a.log2().floor().max(-6.0) - 3.0); // one unit in the last place
    ((a / quantum).round_ties_even() * quantum).min(448.0).copysign(v)
}

/// v rounded to E5M2: 2 mantissa bits, round to nearest even, subnormals below 2⁻¹⁴ in steps
/// of 2⁻¹⁶, saturating at ±57344 (the "satfinite" cast), NaN kept.
pub fn e5m2(v: f64) -> f64 {
    if v.is_nan() {
        return v;
    }
    let a = v.abs();
    if a.is_infinite() {
        return 57344f64.copysign(v);
    }
    let quantum = 2f64.powf(a.log2().floor().max(-14.0) - 2.0); // one unit in the last place
    ((a / quantum).round_ties_even() * quantum).min(57344.0).copysign(v)
}

/// cuBLASLt's FP8 rules for the inputs (see the module notes): TN only, not E5M2 × E5M2.
fn check_fp8_rules(args: &MatmulArgs) -> Result<(), String> {
    let (a, b) = (args.a.dtype, args.b.dtype);
    if !a.is_fp8() && !b.is_fp8() {
        return Ok(());
    }
    if !args.transa || args.transb {
        return Err(format!(
            "FP8 inputs ({a:?} × {b:?}) take the \"TN\" form only (A transposed, B not); this call has transa {}, transb {}",
            args.transa, args.transb
        ));
    }
    if a == DataType::E5m2 && b == DataType::E5m2 {
        return Err("E5M2 × E5M2 is not a supported FP8 combination (one operand must be E4M3)".into());
    }
    Ok(())
}

/// `cublasLtMatrixLayout_t`: type, rows × cols of the stored (column-major) matrix, ld.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MatrixLayout {
    pub dtype: DataType,
    pub rows: u64,
    pub cols: u64,
    pub ld: i64,
}

/// `CUBLASLT_MATMUL_DESC_EPILOGUE`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Epilogue {
    Default,
    Bias,
    GeluBias,
    /// GELU_AUX_BIAS: GELU_BIAS that also stores the pre-activation z in `aux` (training's fc1).
    GeluAuxBias {
        aux: AuxLayout,
    },
    /// DGELU_BGRAD: D ∘ gelu′(aux), and Σ over D's columns of that into the bias pointer.
    DGeluBgrad {
        aux: AuxLayout,
    },
    /// BGRADA: Σ over k of op(A), one value per row of D, into the bias pointer.
    BgradA,
    /// BGRADB: Σ over k of op(B), one value per column of D, into the bias pointer.
    BgradB,
}

impl Epilogue {
    /// Whether the bias pointer is read (a bias added) rather than written (a bias gradient).
    pub fn reads_bias(self) -> bool {
        matches!(self, Epilogue::Bias | Epilogue::GeluBias | Epilogue::GeluAuxBias { .. })
    }

    /// Whether the bias pointer is written: a bias gradient.
    pub fn writes_bias(self) -> bool {
        matches!(self, Epilogue::DGeluBgrad { .. } | Epilogue::BgradA | Epilogue::BgradB)
    }
}

/// The epilogue's auxiliary matrix (m × n, column-major): EPILOGUE_AUX_LD and EPILOGUE_AUX_DATA_TYPE.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AuxLayout {
    pub dtype: DataType,
    pub ld: i64,
}

/// What `matmul_ex` returns: D, and what the epilogue writes besides (GELU_AUX_BIAS's aux, a
/// BGRAD epilogue's bias gradient).
#[derive(Clone, Debug, PartialEq)]
pub struct Outputs {
    pub d: Vec<f32>,
    pub aux: Option<Vec<f32>>,
    pub bias_grad: Option<Vec<f32>>,
}

/// Everything a `cublasLtMatmul` call states: the descriptor (transposes, epilogue, scales)
/// and the four layouts, plus α and β.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct MatmulArgs {
    pub m: u64,
    pub n: u64,
    pub k: u64,
    pub transa: bool,
    pub transb: bool,
    pub a: MatrixLayout,
    pub b: MatrixLayout,
    pub c: MatrixLayout,
    pub d: MatrixLayout,
    pub alpha: f32,
    pub beta: f32,
    pub epilogue: Epilogue,
    /// Length of the bias vector when the epilogue has one: m (one per row of D), or n (one per
    /// column) for BGRADB's gradient.
    pub bias_len: u64,
    /// Whether A_SCALE_POINTER / B_SCALE_POINTER are set (FP8): D gets scale_A·scale_B.
    pub scaled: bool,
}

/// GELU, tanh approximation, as cuBLASLt's GELU epilogues compute it.
pub fn gelu_tanh(v: f64) -> f64 {
    0.5 * v * (1.0 + ((2.0 / std::f64::consts::PI).sqrt() * (v + 0.044715 * v * v * v)).tanh())
}

/// d/dv of `gelu_tanh`: 0.5·(1 + tanh u) + 0.5·v·(1 − tanh² u)·√(2/π)·(1 + 3·0.044715·v²), the
/// factor DGELU's epilogue multiplies by.
pub fn gelu_tanh_grad(v: f64) -> f64 {
    let c = (2.0 / std::f64::consts::PI).sqrt();
    let t = (c * (v + 0.044715 * v * v * v)).tanh();
    0.5 * (1.0 + t) + 0.5 * v * (1.0 - t * t) * c * (1.0 + 3.0 * 0.044715 * v * v)
}

fn check_layout(what: &str, l: &MatrixLayout, rows: u64, cols: u64, len: usize) -> Result<(), String> {
    if (l.rows, l.cols) != (rows, cols) {
        return Err(format!("{what}: layout is {}×{}, the operation needs {rows}×{cols}", l.rows, l.cols));
    }
    if l.ld < l.rows.max(1) as i64 {
        return Err(format!("{what}: leading dimension {} below its {} rows", l.ld, l.rows));
    }
    let need = if cols == 0 { 0 } else { l.ld as u64 * (cols - 1) + rows };
    if (len as u64) < need {
        return Err(format!("{what}: {len} values given, the layout addresses {need}"));
    }
    Ok(())
}

/// Execute `args` on column-major buffers (values already in their types). `c` is read only
/// when β ≠ 0, `bias` only with a bias epilogue. Returns D (ld = args.d.ld), rounded to D's type.
/// An epilogue that writes more than D (aux, a bias gradient) goes through `matmul_ex`.
pub fn matmul(
    args: &MatmulArgs,
    a: &[f32],
    b: &[f32],
    c: Option<&[f32]>,
    bias: Option<&[f32]>,
    scales: (f32, f32),
) -> Result<Vec<f32>, String> {
    if matches!(args.epilogue, Epilogue::GeluAuxBias { .. }) || args.epilogue.writes_bias() {
        return Err(format!("the {:?} epilogue writes more than D: use matmul_ex", args.epilogue));
    }
    matmul_ex(args, a, b, c, bias, None, scales).map(|o| o.d)
}

/// The aux layout's rules for GELU (EPILOGUE_AUX_LD): a multiple of 8, at least m.
fn check_aux(aux: &AuxLayout, m: u64) -> Result<(), String> {
    if aux.ld < m as i64 || aux.ld % 8 != 0 {
        return Err(format!("aux: leading dimension {} must be a multiple of 8 and at least m = {m}", aux.ld));
    }
    Ok(())
}

/// `matmul` with every epilogue: `bias` is read by BIAS, GELU_BIAS and GELU_AUX_BIAS; `aux_in`
/// (m × n, the epilogue's aux ld) is read by DGELU_BGRAD. Returns D, GELU_AUX_BIAS's aux (m × n
/// at its ld, in aux's type) and a BGRAD epilogue's bias gradient (rounded to D's type).
pub fn matmul_ex(
    args: &MatmulArgs,
    a: &[f32],
    b: &[f32],
    c: Option<&[f32]>,
    bias: Option<&[f32]>,
    aux_in: Option<&[f32]>,
    (scale_a, scale_b): (f32, f32),
) -> Result<Outputs, String> {
    check_fp8_rules(args)?;
    let (m, n, k) = (args.m, args.n, args.k);
    let (ar, ac) = if args.transa { (k, m) } else { (m, k) };
    let (br, bc) = if args.transb { (n, k) } else { (k, n) };
    check_layout("A", &args.a, ar, ac, a.len())?;
    check_layout("B", &args.b, br, bc, b.len())?;
    let d_len = (args.d.ld as u64 * n.saturating_sub(1) + m) as usize;
    check_layout("D", &args.d, m, n, d_len)?;
    let c = if args.beta != 0.0 {
        let c = c.ok_or("β ≠ 0 reads C, and none was given")?;
        check_layout("C", &args.c, m, n, c.len())?;
        Some(c)
    } else {
        None
    };
    let bias = match args.epilogue {
        Epilogue::Bias | Epilogue::GeluBias | Epilogue::GeluAuxBias { .. } => {
            let bias = bias.ok_or("the epilogue adds a bias, and none was given")?;
            if args.bias_len != m || bias.len() as u64 != m {
                return Err(format!("the bias has one value per row of D (m = {m}); bias_len is {} ({} given)", args.bias_len, bias.len()));
            }
            Some(bias)
        }
        _ => None,
    };
    // The bias gradient's length: rows of D (DGELU_BGRAD, BGRADA) or columns (BGRADB).
    let grad_len = match args.epilogue {
        Epilogue::DGeluBgrad { .. } | Epilogue::BgradA => Some(m),
        Epilogue::BgradB => Some(n),
        _ => None,
    };
    if let Some(len) = grad_len {
        if args.bias_len != len {
            let per = if matches!(args.epilogue, Epilogue::BgradB) { "column" } else { "row" };
            return Err(format!(
                "the {:?} bias gradient has one value per {per} of D ({len}); bias_len is {}",
                args.epilogue, args.bias_len
            ));
        }
    }
    match args.epilogue {
        Epilogue::DGeluBgrad { .. } if args.transa || args.transb => {
            return Err("DGELU_BGRAD: modelled for the NN data-gradient GEMM only (TransformerEngine's form)".into())
        }
        Epilogue::BgradB if !args.transb => return Err("BGRADB: modelled with B transposed only (the NT weight-gradient GEMM)".into()),
        Epilogue::BgradA if args.transa => return Err("BGRADA: modelled with A not transposed only".into()),
        _ => {}
    }
    let aux_in = match args.epilogue {
        Epilogue::GeluAuxBias { aux } => {
            check_aux(&aux, m)?;
            None
        }
        Epilogue::DGeluBgrad { aux } => {
            check_aux(&aux, m)?;
            let z = aux_in.ok_or("DGELU_BGRAD reads the forward's pre-activation (aux), and none was given")?;
            let need = aux.ld as u64 * n.saturating_sub(1) + m;
            if (z.len() as u64) < need {
                return Err(format!("aux: {} values given, the layout addresses {need}", z.len()));
            }
            Some((z, aux.ld as usize))
        }
        _ => None,
    };
    let (lda, ldb, ldc, ldd) = (args.a.ld as usize, args.b.ld as usize, args.c.ld as usize, args.d.ld as usize);
    let op_a = |i: usize, l: usize| if args.transa { a[l + i * lda] } else { a[i + l * lda] } as f64;
    let op_b = |l: usize, j: usize| if args.transb { b[j + l * ldb] } else { b[l + j * ldb] } as f64;
    let scale = args.alpha as f64 * if args.scaled { scale_a as f64 * scale_b as f64 } else { 1.0 };
    let mut d = vec![0f32; d_len];
    let mut aux_out = match args.epilogue {
        Epilogue::GeluAuxBias { aux } => Some((vec![0f32; (aux.ld as u64 * n.saturating_sub(1) + m) as usize], aux)),
        _ => None,
    };
    let mut grad = vec![0f64; grad_len.unwrap_or(0) as usize];
    for j in 0..n as usize {
        for i in 0..m as usize {
            let acc: f64 = (0..k as usize).map(|l| op_a(i, l) * op_b(l, j)).sum();
            let mut v = scale * acc;
            if let Some(c) = c {
                v += args.beta as f64 * c[i + j * ldc] as f64;
            }
            if let Some(bias) = bias {
                v += bias[i] as f64;
            }
            match args.epilogue {
                Epilogue::GeluBias => v = gelu_tanh(v),
                Epilogue::GeluAuxBias { .. } => {
                    if let Some((aux, l)) = aux_out.as_mut() {
                        aux[i + j * l.ld as usize] = l.dtype.round(v) as f32; // z, before GELU
                    }
                    v = gelu_tanh(v);
                }
                Epilogue::DGeluBgrad { .. } => {
                    if let Some((z, ld)) = aux_in {
                        v *= gelu_tanh_grad(z[i + j * ld] as f64);
                    }
                    grad[i] += v; // Σ over the columns of the dGELU'd result
                }
                _ => {}
            }
            d[i + j * ldd] = args.d.dtype.round(v) as f32;
        }
    }
    match args.epilogue {
        Epilogue::BgradA => (0..m as usize).for_each(|i| grad[i] = (0..k as usize).map(|l| op_a(i, l)).sum()),
        Epilogue::BgradB => (0..n as usize).for_each(|j| grad[j] = (0..k as usize).map(|l| op_b(l, j)).sum()),
        _ => {}
    }
    let bias_grad = grad_len.map(|_| grad.iter().map(|v| args.d.dtype.round(*v) as f32).collect());
    Ok(Outputs { d, aux: aux_out.map(|(a, _)| a), bias_grad })
}

/// `matmul` with an E4M3 D, D scale and amax_D (see the module notes): returns D (E4M3 values,
/// as f32) and amax_D. `args.d` must be E4M3 and `args.c` bf16 or f16.
pub fn matmul_fp8_out(
    args: &MatmulArgs,
    a: &[f32],
    b: &[f32],
    bias: Option<&[f32]>,
    scales: (f32, f32),
    scale_d: f32,
) -> Result<(Vec<f32>, f32), String> {
    if args.d.dtype != DataType::E4m3 {
        return Err("an FP8 output needs D typed E4M3".into());
    }
    if !matches!(args.c.dtype, DataType::Bf16 | DataType::F16) {
        return Err("with an E4M3 D, cuBLASLt takes C as bf16 or f16".into());
    }
    let unrounded = MatmulArgs { d: MatrixLayout { dtype: DataType::F32, ..args.d }, ..*args };
    // D_temp in f32 (the compute type), as `matmul` leaves it with an f32 D
    let d_temp = matmul(&unrounded, a, b, None, bias, scales)?;
    let amax = d_temp.iter().fold(0f32, |m, v| if v.is_nan() || v.abs() > m { v.abs() } else { m });
    Ok((d_temp.iter().map(|v| e4m3(scale_d as f64 * *v as f64) as f32).collect(), amax))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn layout(rows: u64, cols: u64) -> MatrixLayout {
        MatrixLayout { dtype: DataType::F32, rows, cols, ld: rows as i64 }
    }

    /// A 2×3 · 3×2 product worked by hand, with the transposes, β, bias and scales.
    #[test]
    fn by_hand() {
        // op(A) = [[1,2,3],[4,5,6]] stored transposed: A is 3×2 column-major = [1,2,3 | 4,5,6]
        let a = [1., 2., 3., 4., 5., 6.];
        // op(B) = [[1,0],[0,1],[1,1]] stored as is: 3×2 column-major = [1,0,1 | 0,1,1]
        let b = [1., 0., 1., 0., 1., 1.];
        let args = MatmulArgs {
            m: 2,
            n: 2,
            k: 3,
            transa: true,
            transb: false,
            a: layout(3, 2),
            b: layout(3, 2),
            c: layout(2, 2),
            d: layout(2, 2),
            alpha: 1.0,
            beta: 1.0,
            epilogue: Epilogue::Bias,
            bias_len: 2,
            scaled: true,
        };
        // A·B = [[4,5],[10,11]]; ×(0.5·4) = [[8,10],[20,22]]; + C = 1; + bias per row (10, 20)
        let d = matmul(&args, &a, &b, Some(&[1.; 4]), Some(&[10., 20.]), (0.5, 4.0)).unwrap();
        assert_eq!(d, [19., 41., 21., 43.]); // column-major: column 0 = (19, 41)
        let bad = MatmulArgs { bias_len: 3, ..args };
        assert!(matmul(&bad, &a, &b, Some(&[1.; 4]), Some(&[1., 2., 3.]), (1., 1.)).unwrap_err().contains("per row of D"));
        let bad = MatmulArgs { a: MatrixLayout { ld: 2, ..layout(3, 2) }, ..args };
        assert!(matmul(&bad, &a, &b, Some(&[1.; 4]), Some(&[10., 20.]), (1., 1.)).unwrap_err().contains("leading dimension"));
        // FP8 out: D_temp = A·B·2 + bias = [[18, 20], [40, 42]]; amax 42; D = E4M3(D_temp / 4):
        // 4.5, 10 and 5 are E4M3 values; 10.5 lies halfway between 10 and 11: to even, 10
        let fp8 = MatmulArgs {
            beta: 0.0,
            c: MatrixLayout { dtype: DataType::Bf16, ..layout(2, 2) },
            d: MatrixLayout { dtype: DataType::E4m3, ..layout(2, 2) },
            ..args
        };
        let (d, amax) = matmul_fp8_out(&fp8, &a, &b, Some(&[10., 20.]), (0.5, 4.0), 0.25).unwrap();
        assert_eq!((d, amax), (vec![4.5, 10.0, 5.0, 10.0], 42.0)); // column-major
        assert!(matmul_fp8_out(&args, &a, &b, None, (1., 1.), 1.).unwrap_err().contains("E4M3"));
    }

    /// The training epilogues on a 2×2 · 2×3 product worked by hand: which operand each BGRAD
    /// sums, along which axis, and GELU's aux in and out.
    #[test]
    fn training_epilogues_by_hand() {
        // op(A) = [[1, 2], [3, 4]] (A as is, column-major [1,3 | 2,4]); op(B) = Bᵀ with
        // B (3×2, column-major [1,0,2 | 0,1,1]) so op(B) = [[1, 0, 2], [0, 1, 1]].
        let (a, b) = ([1., 3., 2., 4.], [1., 0., 2., 0., 1., 1.]);
        let base = MatmulArgs {
            m: 2,
            n: 3,
            k: 2,
            transa: false,
            transb: true,
            a: layout(2, 2),
            b: layout(3, 2),
            c: layout(2, 3),
            d: layout(2, 3),
            alpha: 1.0,
            beta: 0.0,
            epilogue: Epilogue::BgradB,
            bias_len: 3,
            scaled: false,
        };
        // A·op(B) = [[1, 2, 4], [3, 4, 10]]; column-major D = [1,3 | 2,4 | 4,10]
        let out = matmul_ex(&base, &a, &b, None, None, None, (1., 1.)).unwrap();
        assert_eq!(out.d, [1., 3., 2., 4., 4., 10.]);
        assert_eq!(out.bias_grad.unwrap(), [1., 1., 3.]); // BGRADB: op(B)'s column sums over k
        let bgrad_a = MatmulArgs { epilogue: Epilogue::BgradA, bias_len: 2, ..base };
        assert_eq!(matmul_ex(&bgrad_a, &a, &b, None, None, None, (1., 1.)).unwrap().bias_grad.unwrap(), [3., 7.]); // op(A)'s row sums
        assert!(matmul_ex(&MatmulArgs { bias_len: 2, ..base }, &a, &b, None, None, None, (1., 1.)).unwrap_err().contains("per column"));
        assert!(matmul(&base, &a, &b, None, None, (1., 1.)).unwrap_err().contains("matmul_ex"));
        // GELU_AUX_BIAS with bias (−1, −3): z = [[0, 1, 3], [0, 1, 7]] in aux (ld 8), D = GELU(z)
        let aux = AuxLayout { dtype: DataType::F32, ld: 8 };
        let fwd = MatmulArgs { epilogue: Epilogue::GeluAuxBias { aux }, bias_len: 2, ..base };
        let out = matmul_ex(&fwd, &a, &b, None, Some(&[-1., -3.]), None, (1., 1.)).unwrap();
        let z = out.aux.unwrap();
        assert_eq!((z.len(), [z[0], z[1], z[8], z[9], z[16], z[17]]), (18, [0., 0., 1., 1., 3., 7.]));
        assert_eq!(out.d[2], gelu_tanh(1.0) as f32);
        // DGELU_BGRAD (data-gradient form: neither transposed) at that z: D = gelu′(z) ∘ A·B, and
        // the bias gradient the row sums of D
        let b_nn = [1., 0., 0., 1., 2., 1.]; // B 2×3 = [[1, 0, 2], [0, 1, 1]]: the same product
        let bwd = MatmulArgs { transb: false, b: layout(2, 3), epilogue: Epilogue::DGeluBgrad { aux }, bias_len: 2, ..base };
        let out = matmul_ex(&bwd, &a, &b_nn, None, None, Some(&z), (1., 1.)).unwrap();
        let want =
            [1. * 0.5, 3. * 0.5, 2. * gelu_tanh_grad(1.), 4. * gelu_tanh_grad(1.), 4. * gelu_tanh_grad(3.), 10. * gelu_tanh_grad(7.)];
        assert!(out.d.iter().zip(want).all(|(d, w)| (*d as f64 - w).abs() < 1e-5), "{:?}", out.d);
        let db = out.bias_grad.unwrap();
        assert!((db[0] as f64 - (want[0] + want[2] + want[4])).abs() < 1e-5 && (db[1] as f64 - (want[1] + want[3] + want[5])).abs() < 1e-5);
        let odd = MatmulArgs { epilogue: Epilogue::DGeluBgrad { aux: AuxLayout { ld: 4, ..aux } }, ..bwd };
        assert!(matmul_ex(&odd, &a, &b_nn, None, None, Some(&z), (1., 1.)).unwrap_err().contains("multiple of 8"));
        assert!(matmul_ex(&MatmulArgs { transa: true, ..bwd }, &a, &b_nn, None, None, Some(&z), (1., 1.)).is_err(), "NN only");
    }

    /// The FP8 rules: an FP8 call that is not TN, or E5M2 × E5M2, is refused; E4M3 × E5M2 in TN
    /// runs (A = [[1, 2]] transposed, B = [[3], [4]]: D = 11, times the scales 0.5·2).
    #[test]
    fn fp8_rules() {
        let fp8 = |dtype, rows, cols| MatrixLayout { dtype, rows, cols, ld: rows as i64 };
        let args = MatmulArgs {
            m: 1,
            n: 1,
            k: 2,
            transa: true,
            transb: false,
            a: fp8(DataType::E4m3, 2, 1),
            b: fp8(DataType::E5m2, 2, 1),
            c: layout(1, 1),
            d: layout(1, 1),
            alpha: 1.0,
            beta: 0.0,
            epilogue: Epilogue::Default,
            bias_len: 0,
            scaled: true,
        };
        assert_eq!(matmul(&args, &[1., 2.], &[3., 4.], None, None, (0.5, 2.0)).unwrap(), [11.0]);
        let nn = MatmulArgs { transa: false, a: fp8(DataType::E4m3, 1, 2), ..args };
        assert!(matmul(&nn, &[1., 2.], &[3., 4.], None, None, (1., 1.)).unwrap_err().contains("TN"));
        let both = MatmulArgs { a: fp8(DataType::E5m2, 2, 1), ..args };
        assert!(matmul(&both, &[1., 2.], &[3., 4.], None, None, (1., 1.)).unwrap_err().contains("E5M2 × E5M2"));
    }

    /// The model's E5M2 rounding on hand-picked values: ties to even, subnormals, saturation.
    #[test]
    fn e5m2_rounding() {
        for (v, want) in [
            (1.125, 1.0),
            (1.375, 1.5),
            (7.5, 8.0),
            (61440.0, 57344.0),
            (1e9, 57344.0),
            (2f64.powi(-17), 0.0),
            (3.0 * 2f64.powi(-17), 2f64.powi(-15)),
        ] {
            assert_eq!(e5m2(v), want, "{v}");
            assert_eq!(e5m2(-v), -want, "{v}");
        }
        assert!(e5m2(f64::NAN).is_nan());
    }

    /// The model's E4M3 rounding on hand-picked values: ties to even, subnormals, saturation.
    #[test]
    fn e4m3_rounding() {
        for (v, want) in [
            (1.0625, 1.0),
            (1.1875, 1.25),
            (17.0, 16.0),
            (464.0, 448.0),
            (1e9, 448.0),
            (2f64.powi(-10), 0.0),
            (3.0 * 2f64.powi(-10), 2f64.powi(-8)),
        ] {
            assert_eq!(e4m3(v), want, "{v}");
            assert_eq!(e4m3(-v), -want, "{v}");
        }
        assert!(e4m3(f64::NAN).is_nan());
        assert_eq!(e4m3(f64::INFINITY), 448.0);
    }
}
