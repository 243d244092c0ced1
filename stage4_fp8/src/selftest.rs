//! Stage 4's rows of `ladder selftest`: the FP8 GEMMs, the FP8 kernels and the producer
//! fusions alone, against the CPU quantiser and the emulated layer.

use candle_core::{DType, Device, Tensor};
use shared::device::DeviceInfo;
use shared::selftest::{randn, Rows};

pub fn fp8(r: &mut Rows, device: &Device, info: &DeviceInfo) {
    use crate::fp8::Fp8Recipe;
    use crate::fp8::{quantize, Fp8Linear, Fp8Mode, ScalingConfig};
    use cublaslt_model::matmul;
    if !device.is_cuda() {
        r.ran = "cublaslt_model(fp8_gemm_args)".into();
    }
    let (t, k, n) = (48, 64, 96); // multiples of 16, as FP8 GEMMs need
    for recipe in [Fp8Recipe::Delayed, Fp8Recipe::Current] {
        for gelu in [false, true] {
            let case = format!("{recipe:?} {} M={t} K={k} N={n}", if gelu { "bias+gelu" } else { "bias" });
            if device.is_cuda() && !info.has_fp8_tensor_cores() {
                r.skip("FP8 GEMM", case, "FP8 tensor cores need SM 8.9+; this GPU has none".into());
                continue;
            }
            r.compare("FP8 GEMM", case, || {
                let scaling = ScalingConfig { recipe, history_len: 4, margin: 0 };
                let (w, b) = (randn(&[n, k], 8, 0.05, 0.0)?, randn(&[n], 9, 0.05, 0.0)?);
                let (x1, x) = (randn(&[1, t, k], 10, 3.0, 0.0)?, randn(&[1, t, k], 11, 1.0, 0.0)?);
                let twin = Fp8Linear::new(&w, &b, gelu, Fp8Mode::Emulated, scaling, "twin")?;
                twin.forward(&x1)?; // the second call's delayed scale comes from this one's amax
                let want = twin.forward(&x)?;
                if device.is_cuda() {
                    let on = |x: &Tensor| x.to_device(device);
                    let layer = Fp8Linear::new(&on(&w)?, &on(&b)?, gelu, Fp8Mode::Cublaslt, scaling, "fp8")?;
                    layer.forward(&on(&x1)?.to_dtype(DType::BF16)?)?;
                    let got = layer.forward(&on(&x)?.to_dtype(DType::BF16)?)?;
                    // the twin read f32 x, the GPU bf16 x: one bf16 rounding of x apart, before E4M3's
                    return Ok((got, want, 3e-2));
                }
                let s_x = twin.last_input_scale().ok_or_else(|| anyhow::anyhow!("no scale recorded"))?;
                let xq = quantize(&x, &s_x)?;
                let host = |x: &Tensor| -> candle_core::Result<Vec<f32>> { x.to_dtype(DType::F32)?.flatten_all()?.to_vec1() };
                let args = crate::gemm::fp8_gemm_args(t, k, n, gelu).map_err(anyhow::Error::msg)?.contract();
                let scales = (twin.weight().scale.to_scalar::<f32>()?, s_x.to_scalar::<f32>()?);
                let d = matmul(&args, &host(&twin.weight().data)?, &host(&xq)?, None, Some(&host(twin.bias())?), scales)
                    .map_err(anyhow::Error::msg)?;
                Ok((Tensor::from_vec(d, (1, t, n), &Device::Cpu)?, want, 1e-2))
            });
        }
    }
}

/// Our FP8 kernels (stage4_fp8/kernels/fp8.cu) alone: on CUDA against the CPU quantiser, which
/// must agree bit for bit (rel. error 0: the tolerance only admits float noise in the norm).
pub fn fp8_kernels(r: &mut Rows, device: &Device) {
    use crate::fp8::{amax, dequantize, quantize, quantize_dequantize_cpu, scale_from_amax, ScaleState, ScalingConfig};
    if !device.is_cuda() {
        r.ran = "cpu quantiser (the .cu: host emulation, run.sh)".into();
    }
    // 5000 values: one whole 4096-value chunk of the kernel and a partial one; magnitudes over
    // E4M3's whole range, so subnormals and the top binade both occur.
    let x = || randn(&[5000], 16, 1.0, 0.0).and_then(|t| t * 3.0);
    r.compare("FP8 kernel", "amax f32 n=5000".into(), || {
        let x = x()?;
        let want = x.abs()?.max(0)?;
        Ok((amax(&x.to_device(device)?)?.to_device(&Device::Cpu)?, want, 1e-7))
    });
    for dtype in [DType::F32, DType::BF16] {
        r.compare("FP8 kernel", format!("quantise + dequantise {dtype:?} n=5000"), || {
            let x = x()?.to_dtype(dtype)?;
            let s = scale_from_amax(&amax(&x)?, 0)?;
            let want = quantize_dequantize_cpu(&x, &s)?; // = candle's CPU cast, tested bit for bit
            let got = if device.is_cuda() {
                let (xd, sd) = (x.to_device(device)?, s.to_device(device)?);
                dequantize(&quantize(&xd, &sd)?, &sd, DType::F32)?
            } else {
                dequantize(&quantize(&x, &s)?, &s, DType::F32)?
            };
            Ok((got, want, 1e-7))
        });
    }
    r.compare("FP8 kernel", "delayed scale update (history 3; amax 448, 896, 224, 1792)".into(), || {
        let mut st = ScaleState::new(ScalingConfig { recipe: crate::fp8::Fp8Recipe::Delayed, history_len: 3, margin: 0 })
            .map_err(anyhow::Error::msg)?;
        let mut scales = Vec::new();
        for a in [448f32, 896.0, 224.0, 1792.0] {
            let x = Tensor::new(&[a, -a / 2.0, 1.0, 0.0], &Device::Cpu)?.to_device(device)?;
            st.quantize(&x)?;
            scales.push(st.last_scale().ok_or_else(|| anyhow::anyhow!("no scale recorded"))?.to_device(&Device::Cpu)?.to_scalar::<f32>()?);
        }
        // the window before each call: (first: its own) 448 | 448·3 | 448,448,896 | 448,896,224
        let mut got = scales;
        got.extend(st.history()?);
        let want = [1.0f32, 1.0, 2.0, 2.0, 896.0, 224.0, 1792.0];
        Ok((Tensor::new(got.as_slice(), &Device::Cpu)?, Tensor::new(&want, &Device::Cpu)?, 1e-7))
    });
}

/// Stage 4's producer fusions alone (`--fp8-fusions`): each producer writes E4M3 with a given
/// scale and records the amax of what it quantised. Compared as s·q, with the amax appended.
/// On CUDA against the CPU producers; on the CPU, the CPU producers against plain LayerNorm +
/// quantiser, and fc1's E4M3-output arguments run by the cuBLASLt model against the emulated fc1.
pub fn fp8_fusions(r: &mut Rows, device: &Device, info: &DeviceInfo) {
    use crate::fp8::{amax, dequantize, quantize, Fp8Linear, Fp8Mode, Fp8Target, Input, Quantized, ScalingConfig};
    use crate::producers::{add_layer_norm_e4m3, layer_norm_e4m3};
    if !device.is_cuda() {
        r.ran = "cpu producers (the .cu: host emulation, run.sh; the GEMM: cublaslt_model)".into();
    }
    // A target on `device` with scale s and fresh buffers, as a layer's state holds.
    let target = |s: f32| -> candle_core::Result<Fp8Target> { Fp8Target::new(&Tensor::new(s, device)?) };
    // s·q and the amax it recorded in the target's amax buffer, on the CPU.
    let values = |q: &Quantized, t: &Fp8Target| -> candle_core::Result<Tensor> {
        let sq = match q.data.dtype() {
            DType::F8E4M3 => dequantize(&q.data, &q.scale, DType::F32)?,
            _ => q.data.clone(),
        };
        let a = Tensor::new(&[t.amax()?], &Device::Cpu)?;
        Tensor::cat(&[&sq.flatten_all()?.to_device(&Device::Cpu)?, &a], 0)
    };
    // C = 257 (not a multiple of the 256 threads); s = 0.8·amax/448, so the top saturates.
    // Tolerance: a code moves by one E4M3 step (2⁻³) only where the two LayerNorms' f32 values
    // straddle a rounding boundary; at row mean 10⁴ the f32 input rounding makes that ~2 %.
    for mean in [0.0f32, 1e4] {
        for add in [false, true] {
            let case =
                format!("{} rows=5 C=257 row mean {mean}", if add { "add_layer_norm_e4m3 (bf16 branch)" } else { "layer_norm_e4m3" });
            r.compare("FP8 fusion", case, || {
                let (g, b) = (randn(&[257], 12, 0.1, 1.0)?, randn(&[257], 13, 0.1, 0.0)?);
                let x = randn(&[1, 5, 257], 14, 1.0, mean)?;
                let br = randn(&[1, 5, 257], 15, 1.0, 0.0)?.to_dtype(DType::BF16)?;
                let sum = if add { (&x + br.to_dtype(DType::F32)?)? } else { x.clone() };
                let h = stage0_baseline::layer_norm(&sum, &g, &b)?; // the slow twin, f32
                let s = 0.8 * amax(&h)?.to_scalar::<f32>()? / 448.0;
                let cpu = Fp8Target::new(&Tensor::new(s, &Device::Cpu)?)?;
                let want = values(&cpu.quantize(&h)?, &cpu)?;
                let on = |t: &Tensor| t.to_device(device);
                let t = target(s)?;
                let got = match add {
                    true => add_layer_norm_e4m3(&on(&x)?, &on(&br)?, &on(&g)?, &on(&b)?, &t)?.1,
                    false => layer_norm_e4m3(&on(&x)?, &on(&g)?, &on(&b)?, &t)?,
                };
                Ok((values(&got, &t)?, want, if mean > 0.0 { 3e-2 } else { 1e-2 }))
            });
        }
    }
    let (tok, k, n) = (48, 64, 96);
    let case = format!("fc1 E4M3 out (bias+gelu, D scale, amax_D) M={tok} K={k} N={n}");
    if device.is_cuda() && !info.has_fp8_tensor_cores() {
        r.skip("FP8 fusion", case, "FP8 tensor cores need SM 8.9+; this GPU has none".into());
        return;
    }
    if device.is_cuda() {
        // cuBLASLt may offer no algorithm for this epilogue with an E4M3 output; stage 4 then
        // runs the next configuration (Block::fc1_writes_e4m3), and this row says so.
        let supported = (|| -> anyhow::Result<bool> {
            let (w, b) = (randn(&[n, k], 8, 0.05, 0.0)?.to_device(device)?, randn(&[n], 9, 0.05, 0.0)?.to_device(device)?);
            let layer = Fp8Linear::new(&w, &b, true, Fp8Mode::Cublaslt, ScalingConfig::default(), "fc1")?;
            Ok(layer.e4m3_output_supported(tok)?)
        })();
        match supported {
            Ok(true) => {}
            Ok(false) => {
                let why = "cuBLASLt offers no algorithm for a GELU + bias epilogue with an E4M3 output on this GPU; stage 4 \
                           runs fc1 with a bf16 output and quantises it for fc2 instead (its row's notes say so)";
                return r.unsupported("FP8 fusion", case, why.into());
            }
            Err(e) => return r.outcome("FP8 fusion", case, Err(e)),
        }
    }
    r.compare("FP8 fusion", case, || {
        let (w, b) = (randn(&[n, k], 8, 0.05, 0.0)?, randn(&[n], 9, 0.05, 0.0)?);
        let x = randn(&[1, tok, k], 11, 1.0, 0.0)?;
        let twin = Fp8Linear::with_output(&w, &b, true, Fp8Mode::Emulated, ScalingConfig::default(), "fc1", DType::F32)?;
        let y = twin.forward(&x)?; // f32: GELU(x̃ W̃ᵀ + b), and x's scale recorded
        let s = 0.8 * amax(&y)?.to_scalar::<f32>()? / 448.0; // fc2's scale, a little small: the top saturates
        let cpu = Fp8Target::new(&Tensor::new(s, &Device::Cpu)?)?;
        let want = values(&twin.forward_e4m3(&Input::Plain(x.clone()), &cpu)?, &cpu)?;
        // The arguments cuda.rs passes, 1/s as D scale, on the operands of the call just made.
        let s_x = twin.last_input_scale().ok_or_else(|| anyhow::anyhow!("no scale recorded"))?;
        if device.is_cuda() {
            let on = |x: &Tensor| x.to_device(device);
            let layer = Fp8Linear::new(&on(&w)?, &on(&b)?, true, Fp8Mode::Cublaslt, ScalingConfig::default(), "fc1")?;
            let xb = on(&x)?.to_dtype(DType::BF16)?;
            let t = target(s)?;
            let got = layer.forward_e4m3(&Input::Plain(xb), &t)?;
            // the twin read f32 x, the GPU bf16 x: one bf16 rounding of x apart, before E4M3's
            return Ok((values(&got, &t)?, want, 3e-2));
        }
        let host = |x: &Tensor| -> candle_core::Result<Vec<f32>> { x.to_dtype(DType::F32)?.flatten_all()?.to_vec1() };
        let args = crate::gemm::fp8_gemm_args_e4m3_out(tok, k, n, true).map_err(anyhow::Error::msg)?.contract();
        let scales = (twin.weight().scale.to_scalar::<f32>()?, s_x.to_scalar::<f32>()?);
        let xq = quantize(&x, &s_x)?;
        let (d, amax_d) =
            cublaslt_model::matmul_fp8_out(&args, &host(&twin.weight().data)?, &host(&xq)?, Some(&host(twin.bias())?), scales, 1.0 / s)
                .map_err(anyhow::Error::msg)?;
        let mut got: Vec<f32> = d.iter().map(|q| q * s).collect(); // read back with fc2's scale
        got.push(amax_d);
        // a value on a rounding boundary may land on the neighbour (1/s multiplies, the CPU divides)
        Ok((Tensor::from_vec(got, tok * n + 1, &Device::Cpu)?, want, 1e-2))
    });
}

/// Stage 4's training GEMMs alone (the HYBRID backward of one linear: dX = dY·W and dW = dYᵀ·X,
/// E4M3 × E5M2, `hybrid::linear_bwd_hybrid_fp8`), against the CPU emulation of the recipe on the
/// same operands and scales (all current). On CUDA: our E5M2 cast and transposes, then
/// cuBLASLt's FP8 GEMMs; where cuBLASLt offers no algorithm for one, its row says so. On the CPU
/// the same steps, the GEMMs' arguments (`gemm::fp8_grad_args`) executed by `cublaslt_model`.
/// A row per GEMM for its fallback too (`gemm::fp8_grad_gemm_fallback`), on either device.
pub fn fp8_train(r: &mut Rows, device: &Device, info: &DeviceInfo) {
    use crate::gemm::Fp8Grad;
    // What the CPU rows run in place of the GPU: the GEMMs' arguments by the cuBLASLt model, and
    // the fallback's f32 GEMM by candle.
    let cpu_ran = |what: &str| if device.is_cuda() { "cuda".to_string() } else { what.to_string() };
    let (m, k, n) = (48, 64, 96); // multiples of 16, as FP8 GEMMs need
    for grad in [Fp8Grad::Data, Fp8Grad::Weight] {
        let case = match grad {
            Fp8Grad::Data => format!("dX = dY·W, E4M3 W × E5M2 dY, bf16 out, M={m} K={k} N={n}"),
            Fp8Grad::Weight => format!("dW = dYᵀ·X, E4M3 X × E5M2 dY, f32 out, M={m} K={k} N={n}"),
        };
        if device.is_cuda() && !info.has_fp8_tensor_cores() {
            r.skip("FP8 training GEMM", case, "FP8 tensor cores need SM 8.9+; this GPU has none".into());
            continue;
        }
        // The fallback where cuBLASLt offers no algorithm: the same values in an f32 GEMM.
        let fallback = format!("{case}, fallback (f32 GEMM on the decoded codes)");
        let supported: candle_core::Result<bool> = match device.as_cuda_device() {
            #[cfg(feature = "cuda")]
            Ok(dev) => crate::cuda::has_grad_algorithm(dev, grad, m, k, n),
            _ => Ok(true), // the CPU: the cuBLASLt model runs every configuration
        };
        r.ran = cpu_ran("cublaslt_model(fp8_grad_args)");
        match supported {
            Ok(true) => r.compare("FP8 training GEMM", case, || train_gemm_row(device, grad, (m, k, n), &Default::default())),
            Ok(false) => {
                let why = "cuBLASLt offers no E4M3 × E5M2 algorithm for this GEMM on this GPU; stage 4's --train \
                           multiplies the same E4M3 and E5M2 values in an f32 GEMM instead (the fallback row), and its \
                           row's notes say so";
                r.unsupported("FP8 training GEMM", case, why.into());
            }
            Err(e) => r.outcome("FP8 training GEMM", case, Err(e.into())),
        }
        r.ran = cpu_ran("candle f32 matmul (the fallback)");
        r.compare("FP8 training GEMM", fallback, || train_gemm_row(device, grad, (m, k, n), &crate::hybrid::GradFallbacks::always()));
    }
}

/// One of `fp8_train`'s rows: `grad`'s output of `hybrid::linear_bwd_hybrid_fp8` on `device`
/// (with `fallbacks` as given) against the CPU emulation on the same operands and scales.
fn train_gemm_row(
    device: &Device,
    grad: crate::gemm::Fp8Grad,
    (m, k, n): (usize, usize, usize),
    fallbacks: &crate::hybrid::GradFallbacks,
) -> anyhow::Result<(Tensor, Tensor, f64)> {
    use crate::fp8::{amax, quantize, quantize_dequantize_cpu, scale_from_amax, Fp8Recipe};
    use crate::gemm::Fp8Grad;
    use crate::hybrid::{grad_scale_state, linear_bwd_hybrid, linear_bwd_hybrid_fp8};
    let (x, w) = (randn(&[1, m, k], 20, 1.0, 0.0)?, randn(&[n, k], 21, 0.05, 0.0)?);
    let dy = randn(&[1, m, n], 22, 1e-3, 0.0)?; // a gradient's size
    let (sx, sw) = (scale_from_amax(&amax(&x)?, 0)?, scale_from_amax(&amax(&w)?, 0)?);
    let (xq, wq) = (quantize_dequantize_cpu(&x, &sx)?, quantize_dequantize_cpu(&w, &sw)?); // s·q, f32
    let (dx, dw, _) = linear_bwd_hybrid(&xq, &wq, &dy, 0)?; // the emulation, dY's scale current
    let on = |t: &Tensor| t.to_device(device);
    let (sx, sw) = (on(&sx)?, on(&sw)?);
    let (xq, wq) = (quantize(&on(&x)?, &sx)?, quantize(&on(&w)?, &sw)?); // E4M3 codes
    let state = std::sync::Mutex::new(grad_scale_state(Fp8Recipe::Current, 1, 0).map_err(anyhow::Error::msg)?);
    let (got_dx, got_dw, _) = linear_bwd_hybrid_fp8((&xq, &sx), (&wq, &sw), &on(&dy)?, &state, fallbacks)?;
    let (got, want) = match grad {
        Fp8Grad::Data => (got_dx.to_dtype(DType::F32)?, dx),
        Fp8Grad::Weight => (got_dw, dw),
    };
    // dX is stored bf16 (2⁻⁹ per value); dY's scale (E4M3's rule with 7 bits less margin) may
    // sit an ulp from the emulation's, moving a few E5M2 codes.
    Ok((got.to_device(&Device::Cpu)?, want, 1e-2))
}

/// Stage 4 with delayed scaling under a CUDA graph: the scale update runs inside the graph, so
/// replays must advance the amax history. The input grows ×4 after the capture; a history
/// frozen at the captured call would saturate the top of every activation (a large error).
/// CUDA only: on the CPU the capture's order of steps is checked for every stage instead.
/// `ladder selftest` runs it with its other graph rows, after every row that captures nothing.
pub fn graph_delayed_scaling(r: &mut Rows, device: &Device, info: &DeviceInfo, stage: &crate::Fp8) {
    use shared::Stage;
    if !device.is_cuda() {
        return;
    }
    let case = "stage4_fp8 delayed scaling, replays on a ×4 input (tiny)".to_string();
    let shape = shared::Preset::Tiny.shape();
    let stage = crate::Fp8 { args: crate::Args { fp8_recipe: crate::fp8::Fp8Recipe::Delayed, ..stage.args }, ..*stage };
    let auto = shared::PrecisionRequest::Auto;
    // A plan refusal (no FP8 tensor cores) is a skip, anything after it a failure.
    let plan = match shared::stage::plan(&stage, device, info, shape, auto, auto, true, false) {
        Ok(plan) => plan,
        Err(e) => return r.skip("CUDA graph", case, e.to_string()),
    };
    r.compare("CUDA graph", case, || {
        let weights = shared::BlockWeights::from_seed(&shape, 1)?.to_device(device)?;
        let x = shared::weights::random_input(&shape, 2)?.to_device(device)?;
        let x4 = (&x * 4.0)?;
        let plain = stage.build(&weights, &plan)?;
        for input in [&x, &x, &x4, &x4] {
            plain.forward(input)?;
        }
        let want = plain.forward(&x4)?;
        let graphed = shared::graph::capture(stage.name(), stage.build(&weights, &plan)?, &x)?; // calls 1, 2
        x.slice_set(&x4, 0, 0)?; // the captured input buffer now holds 4x
        for _ in 0..2 {
            graphed.forward(&x)?; // calls 3, 4
        }
        Ok((graphed.forward(&x)?.copy()?, want, 1e-3))
    });
}
