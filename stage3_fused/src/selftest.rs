//! Stage 3's rows of `ladder selftest`: the cuBLASLt epilogues (the forward's, and the training
//! ones through `ops::mlp`'s gradients) and the LayerNorm kernels alone, against stage 0's ops
//! (on the CPU: the argument builders run by the cuBLASLt contract model, `mlp`'s CPU backward,
//! and the CPU fused ops); and the fused AdamW against its plain-ops twin.

use candle_core::{DType, Device, Tensor};
use shared::selftest::{randn, Rows};

pub fn epilogues(r: &mut Rows, device: &Device) {
    use crate::gemm_args::{linear_args, LinearKind};
    use cublaslt_model::{matmul, DataType};
    if !device.is_cuda() {
        r.ran = "cublaslt_model(linear_args)".into();
    }
    // M = 80 tokens, non-square.
    let (bsz, t, k, n) = (2, 40, 96, 80);
    // (name, kind, GEMM dtype, residual dtype): the residual rides in C when its dtype is the GEMM's.
    let cases = [
        ("bias", LinearKind::Bias, DType::BF16, None),
        ("bias+gelu", LinearKind::BiasGelu, DType::BF16, None),
        ("bias+gelu", LinearKind::BiasGelu, DType::F16, None),
        ("bias+residual in C (beta=1)", LinearKind::BiasResidualInC, DType::BF16, Some(DType::BF16)),
        ("bias, f32 residual after", LinearKind::Bias, DType::BF16, Some(DType::F32)),
        ("bias (tf32)", LinearKind::Bias, DType::F32, None),
    ];
    for (name, kind, dtype, residual) in cases {
        let case = format!("{name} {dtype:?} M={} K={k} N={n}", bsz * t);
        r.compare("cuBLASLt epilogue", case, || {
            let (x, w, b, res) = (
                randn(&[bsz, t, k], 4, 1.0, 0.0)?,
                randn(&[n, k], 5, 0.1, 0.0)?,
                randn(&[n], 6, 0.1, 0.0)?,
                randn(&[bsz, t, n], 7, 1.0, 0.0)?,
            );
            // Inputs rounded to the GEMM's dtype on both sides; the twin computes in f32.
            let round = |x: &Tensor| x.to_dtype(dtype)?.to_dtype(DType::F32);
            let (x, w, b) = (round(&x)?, round(&w)?, round(&b)?);
            let res = match residual {
                Some(rd) => Some(res.to_dtype(rd)?.to_dtype(DType::F32)?),
                None => None,
            };
            let mut want = stage0_baseline::linear(&x, &w, &b)?;
            if kind == LinearKind::BiasGelu {
                want = stage0_baseline::gelu_tanh(&want)?;
            }
            if let Some(res) = &res {
                want = (want + res)?;
            }
            let tol = match dtype {
                DType::BF16 => 1e-2,
                DType::F16 => 2e-3,
                _ => 5e-3, // TF32: 10-bit mantissa inputs
            };
            if device.is_cuda() {
                let on = |x: &Tensor| x.to_dtype(dtype)?.to_device(device);
                let (xd, wd, bd) = (on(&x)?, on(&w)?, on(&b)?);
                let got = match (kind, &res) {
                    (LinearKind::BiasGelu, _) => crate::ops::linear_bias_gelu(&xd, &wd, &bd)?,
                    (_, Some(res)) => {
                        let rd = res.to_dtype(residual.unwrap_or(DType::F32))?.to_device(device)?;
                        crate::ops::linear_bias_residual(&xd, &wd, &bd, &rd)?
                    }
                    _ => crate::ops::linear_bias(&xd, &wd, &bd)?,
                };
                return Ok((got, want, tol));
            }
            let model_dtype = match dtype {
                DType::BF16 => DataType::Bf16,
                DType::F16 => DataType::F16,
                _ => DataType::F32,
            };
            let m = bsz * t;
            let args = linear_args(m, k, n, model_dtype, kind);
            let host = |x: &Tensor| -> candle_core::Result<Vec<f32>> { x.flatten_all()?.to_vec1() };
            let mut d = match (kind, &res) {
                (LinearKind::BiasResidualInC, Some(res)) => {
                    matmul(&args, &host(&w)?, &host(&x)?, Some(&host(res)?), Some(&host(&b)?), (1.0, 1.0))
                }
                _ => matmul(&args, &host(&w)?, &host(&x)?, None, Some(&host(&b)?), (1.0, 1.0)),
            }
            .map_err(anyhow::Error::msg)?;
            if let (LinearKind::Bias, Some(res)) = (kind, &res) {
                d.iter_mut().zip(host(res)?).for_each(|(d, r)| *d += r); // cuda.rs adds it after, in f32
            }
            Ok((Tensor::from_vec(d, (bsz, t, n), &Device::Cpu)?, want, tol))
        });
    }
}

/// `ops::mlp`'s gradients at bf16 and f16 — on CUDA fc1's GELU_AUX_BIAS, fc2's BGRADB and
/// DGELU_BGRAD, fc1's plain backward GEMMs — against candle's autograd through stage 0's ops in
/// f32 on the same (rounded) values, one row per gradient.
pub fn training_epilogues(r: &mut Rows, device: &Device) {
    if !device.is_cuda() {
        r.ran = "ops::mlp's CPU backward (GELU's derivative by candle ops)".into();
    }
    // M = 80 tokens, C = 96, FF = 128 (a multiple of 8: the aux matrix's leading dimension).
    let (bsz, t, c, ff) = (2, 40, 96, 128);
    for dtype in [DType::BF16, DType::F16] {
        for (i, name) in ["dx", "dW1", "db1", "dW2", "db2"].into_iter().enumerate() {
            let case = format!("mlp {name} {dtype:?} M={} C={c} FF={ff}", bsz * t);
            r.compare("cuBLASLt training epilogues", case, || {
                let inputs = [
                    randn(&[bsz, t, c], 20, 1.0, 0.0)?,
                    randn(&[ff, c], 21, 0.1, 0.0)?,
                    randn(&[ff], 22, 0.1, 0.0)?,
                    randn(&[c, ff], 23, 0.1, 0.0)?,
                    randn(&[c], 24, 0.1, 0.0)?,
                ];
                let dy = randn(&[bsz, t, c], 25, 1.0, 0.0)?;
                let rounded = inputs.iter().map(|x| x.to_dtype(dtype)?.to_dtype(DType::F32)).collect::<candle_core::Result<Vec<_>>>()?;
                let want = crate::backward::grads_of(
                    &rounded.iter().collect::<Vec<_>>(),
                    |v| {
                        let h = stage0_baseline::gelu_tanh(&stage0_baseline::linear(&v[0], &v[1], &v[2])?)?;
                        Ok(vec![stage0_baseline::linear(&h, &v[3], &v[4])?])
                    },
                    &[&dy],
                )?;
                let on = rounded.iter().map(|x| x.to_dtype(dtype)?.to_device(device)).collect::<candle_core::Result<Vec<_>>>()?;
                let got = crate::backward::grads_of(
                    &on.iter().collect::<Vec<_>>(),
                    |v| Ok(vec![crate::ops::mlp(&v[0], &v[1], &v[2], &v[3], &v[4])?]),
                    &[&dy.to_device(device)?],
                )?;
                // h, z, dz₁ and the gradients rounded to the GEMM's dtype on the way
                let tol = if dtype == DType::BF16 { 2e-2 } else { 3e-3 };
                Ok((got[i].clone(), want[i].clone(), tol))
            });
        }
    }
}

pub fn layer_norms(r: &mut Rows, device: &Device) {
    if !device.is_cuda() {
        r.ran = "cpu fused ops (the .cu: host emulation, run.sh)".into();
    }
    // C = 257: not a multiple of the 256 threads; mean 1e4: where a one-pass variance cancels.
    for mean in [0.0f32, 1e4] {
        for dtype in [DType::F32, DType::BF16, DType::F16] {
            for add in [false, true] {
                let name = if add { "add_layer_norm" } else { "layer_norm" };
                let case = format!("{name} {dtype:?} rows=5 C=257 row mean {mean}");
                r.compare("LayerNorm kernel", case, || {
                    let (g, b) = (randn(&[257], 12, 0.1, 1.0)?, randn(&[257], 13, 0.1, 0.0)?);
                    let x = randn(&[5, 257], 14, 1.0, mean)?;
                    let br = randn(&[5, 257], 15, 1.0, 0.0)?.to_dtype(dtype)?;
                    let sum = if add { (&x + br.to_dtype(DType::F32)?)? } else { x.clone() };
                    let want = stage0_baseline::layer_norm(&sum, &g, &b)?.to_dtype(dtype)?;
                    // f32: the input's own rounding at 1e4 (ulp 1e-3) against a spread of 1 bounds any f32 LayerNorm
                    let tol = match dtype {
                        DType::BF16 => 1e-2,
                        DType::F16 => 2e-3,
                        _ if mean > 0.0 => 5e-3,
                        _ => 1e-5,
                    };
                    let on = |t: &Tensor| t.to_device(device);
                    let (xd, gd, bd) = (on(&x)?, on(&g)?, on(&b)?);
                    let got = if add {
                        crate::ops::add_layer_norm(&xd, &on(&br)?, &gd, &bd, crate::ops::LN_EPS)?.1
                    } else {
                        crate::ops::layer_norm(&xd, &gd, &bd, crate::ops::LN_EPS, dtype)?
                    };
                    Ok((got, want, tol))
                });
            }
        }
    }
}

/// LayerNorm's backward (on CUDA one launch of `layer_norm_bwd_*`, on the CPU the one-pass
/// rows) against its candle-ops twin on the CPU, one row per gradient: 37 rows (on CUDA two
/// blocks of rows, the last ragged), C = 257, dy in f32, bf16 and f16, with and without the
/// residual's gradient added to dx, and rows of mean 1e4 in f32.
pub fn layer_norm_backward(r: &mut Rows, device: &Device) {
    if !device.is_cuda() {
        r.ran = "cpu one-pass rows (the .cu: host emulation, run.sh)".into();
    }
    let cases = [(DType::F32, 0.0f32), (DType::BF16, 0.0), (DType::F16, 0.0), (DType::F32, 1e4)];
    for (dtype, mean) in cases {
        for plus in [false, true] {
            for (i, name) in ["dx", "dg", "db"].into_iter().enumerate() {
                let with = if plus { " + residual grad" } else { "" };
                let case = format!("{name} dy {dtype:?}{with} rows=37 C=257 row mean {mean}");
                r.compare("LayerNorm backward kernel", case, || {
                    let g = randn(&[257], 16, 0.1, 1.0)?;
                    let x = randn(&[37, 257], 17, 1.0, mean)?;
                    let dy = randn(&[37, 257], 18, 1.0, 0.0)?.to_dtype(dtype)?;
                    let res = randn(&[37, 257], 19, 1.0, 0.0)?;
                    let [dx, dg, db] = crate::backward::layer_norm_bwd_ops(&x, &g, &dy.to_dtype(DType::F32)?, crate::ops::LN_EPS)?;
                    let want = [if plus { (dx + &res)? } else { dx }, dg, db];
                    let on = |t: &Tensor| t.to_device(device);
                    let res_d = on(&res)?;
                    let got =
                        crate::backward::layer_norm_bwd_plus(&on(&x)?, &on(&g)?, &on(&dy)?, crate::ops::LN_EPS, plus.then_some(&res_d))?;
                    // f32 arithmetic on the same (rounded) dy; at mean 1e4, x's own f32 rounding
                    // against a spread of 1 bounds x̂, as in the forward's rows.
                    let tol = if mean > 0.0 { 5e-3 } else { 1e-5 };
                    Ok((got[i].to_device(&Device::Cpu)?, want[i].clone(), tol))
                });
            }
        }
    }
}

/// Attention on the one QKV output while training: on CUDA `ops::qkv_attention_cuda` (stage 2's
/// v2 forward on qkv's three slices, its backward kernel, dq, dk, dv written as one gradient), on
/// the CPU `ops::qkv_attention`; d(qkv) against candle's autograd through stage 2's slow twin on
/// the three slices (`grads_slow`), causal, d_head 64 and 128 at T not a multiple of the tiles.
pub fn qkv_attention_backward(r: &mut Rows, device: &Device) {
    use candle_core::{IndexOp, Var};
    use stage2_sdpa::attention::backward::grads_slow;
    r.ran = if device.is_cuda() { "cuda".into() } else { "cpu ops::qkv_attention".into() };
    let dtypes: &[DType] = if device.is_cuda() { &[DType::BF16, DType::F16] } else { &[DType::F32] };
    for &dtype in dtypes {
        for (b, t, h, d) in [(2, 100, 2, 64), (1, 200, 2, 128)] {
            let case = format!("d(qkv) {dtype:?} d_head={d} causal B={b} T={t} n_head={h}");
            r.compare("qkv attention backward", case, || {
                let c = h * d;
                let qkv = randn(&[b, t, 3 * c], 35, 1.0, 0.0)?.to_dtype(dtype)?;
                let d_o = randn(&[b, t, c], 36, 1.0, 0.0)?; // f32: the loss's ⟨o, dO⟩ takes it as it is
                let var = Var::from_tensor(&qkv.to_device(device)?)?;
                let o = qkv_attention_on(var.as_tensor(), h)?;
                let grads = (o.to_dtype(DType::F32)? * d_o.to_device(device)?)?.sum_all()?.backward()?;
                let got = grads.get(var.as_tensor()).cloned().ok_or_else(|| anyhow::anyhow!("no gradient reached qkv"))?;
                let heads = qkv.reshape((b, t, 3, h, d))?;
                let part = |i: usize| heads.i((.., .., i));
                let [dq, dk, dv] = grads_slow(&part(0)?, &part(1)?, &part(2)?, &d_o.reshape((b, t, h, d))?, true)?;
                let want = Tensor::stack(&[dq, dk, dv], 2)?.reshape((b, t, 3 * c))?;
                // as stage 2's attention backward rows: 16-bit O, P and dS on CUDA
                let tol = match dtype {
                    DType::BF16 => 2e-2,
                    DType::F16 => 5e-3,
                    _ => 1e-4,
                };
                Ok((got.to_device(&Device::Cpu)?.to_dtype(DType::F32)?, want, tol))
            });
        }
    }
}

/// The op `qkv_attention_backward` checks on qkv's device.
fn qkv_attention_on(qkv: &Tensor, n_head: usize) -> candle_core::Result<Tensor> {
    #[cfg(feature = "cuda")]
    if qkv.device().is_cuda() {
        return crate::ops::qkv_attention_cuda(qkv, n_head, stage2_sdpa::attention::AttentionKernel::V2, true);
    }
    crate::ops::qkv_attention(qkv, n_head, stage2_sdpa::attention::CpuKernel::Registers, true)
}

/// The fused AdamW alone: four parameters of odd sizes (one element; 37 × 19; one chunk and five
/// elements, so a chunk is partial; 3 × 5 × 7), three steps with the same gradients, on CUDA
/// every parameter in one launch of `kernels/adamw.cu`, on the CPU the fused pass; θ, m and v
/// against the plain-ops twin (`adamw::step_twin`) in f32.
pub fn adamw(r: &mut Rows, device: &Device) {
    use crate::adamw::{step_twin, AdamW, ParamsAdamW, CHUNK};
    use candle_core::{backprop::GradStore, Var};
    r.ran = if device.is_cuda() { "cuda".into() } else { "cpu fused AdamW (the .cu: host emulation, run.sh)".into() };
    let shapes: [&[usize]; 4] = [&[1], &[37, 19], &[CHUNK + 5], &[3, 5, 7]];
    let steps = 3;
    // Non-default hyper-parameters, so each one is exercised: a large λ, a small β2.
    let params = ParamsAdamW { lr: 0.01, beta1: 0.8, beta2: 0.95, eps: 1e-6, weight_decay: 0.1 };
    let res = (|| -> anyhow::Result<[(Tensor, Tensor); 3]> {
        let init: Vec<Tensor> =
            shapes.iter().enumerate().map(|(i, s)| randn(s, 40 + i as u64, 1.0, 0.0)).collect::<candle_core::Result<_>>()?;
        let vars: Vec<Var> = init.iter().map(|t| Var::from_tensor(&t.to_device(device)?)).collect::<candle_core::Result<_>>()?;
        let mut fused = AdamW::new(vars.clone(), params)?;
        let mut twin: Vec<[Tensor; 3]> =
            init.iter().map(|t| Ok([t.clone(), t.zeros_like()?, t.zeros_like()?])).collect::<candle_core::Result<_>>()?;
        for step in 1..=steps {
            let mut grads = GradStore::default();
            for (i, (var, state)) in vars.iter().zip(twin.iter_mut()).enumerate() {
                let g = randn(shapes[i], 50 + 10 * step as u64 + i as u64, 1.0, 0.0)?;
                *state = step_twin(&state[0], &g, &state[1], &state[2], params, step)?;
                grads.insert(var.as_tensor(), g.to_device(device)?);
            }
            fused.step(&grads)?;
        }
        // Every parameter's values end to end, one row per quantity.
        let flat = |ts: Vec<Tensor>| -> candle_core::Result<Tensor> {
            let ts = ts.iter().map(|t| t.to_device(&Device::Cpu)?.flatten_all()).collect::<candle_core::Result<Vec<_>>>()?;
            Tensor::cat(&ts, 0)
        };
        let moments = fused.moments()?;
        let got = |f: &dyn Fn(usize) -> Tensor| flat((0..shapes.len()).map(f).collect());
        let want = |j: usize| flat(twin.iter().map(|s| s[j].clone()).collect());
        Ok([
            (got(&|i| vars[i].as_tensor().clone())?, want(0)?),
            (got(&|i| moments[i][0].clone())?, want(1)?),
            (got(&|i| moments[i][1].clone())?, want(2)?),
        ])
    })();
    // f32 on both sides, the same equations: only the order of rounding differs (a fused
    // multiply-add, the GPU's √ and division), ~1e-7 relative; the fp32 check's tolerance.
    let tol = 1e-5;
    for (j, name) in ["θ", "m", "v"].into_iter().enumerate() {
        let case = format!("{name} after {steps} steps: 4 tensors of 1, 37×19, {}, 3×5×7", CHUNK + 5);
        r.compare("fused AdamW", case, || match &res {
            Ok(pairs) => Ok((pairs[j].0.clone(), pairs[j].1.clone(), tol)),
            Err(e) => Err(anyhow::anyhow!(shared::selftest::message(e))),
        });
    }
}
