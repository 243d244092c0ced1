//! `ladder selftest`: each GPU building block alone, on small shapes, against its CPU twin — the
//! first command to run on a new GPU, and the JSON to send back when something is wrong
//! (docs/gpu.md). On the CPU the same list runs through the CPU stand-ins: the CPU kernels, the
//! cuBLASLt contract model executing the real argument builders, the capture sequence on a
//! recording model, the CPU memory probe. So CI runs the list too; a CPU pass says the logic
//! is right, not that the GPU code works.
//!
//! | block | on CUDA | on the CPU |
//! |---|---|---|
//! | attention (d_head 32/64/128, bf16/f16, causal or not, T = 67) | kernels/flash_attn.cu (v1) and flash_attn_v2.cu (v2), each vs the CPU kernel | the CPU kernel vs plain ops |
//! | cuBLASLt epilogues (bias, bias+GELU, residual in C, residual after) | stage 3's GEMMs vs stage 0's ops | `linear_args` run by `cublaslt_model` vs stage 0's ops |
//! | FP8 GEMM (delayed, current; bias, GELU) | cuBLASLt E4M3 vs the emulated layer | `fp8_gemm_args` run by `cublaslt_model` vs the emulated layer |
//! | NVRTC kernels (layer_norm, add_layer_norm; f32/bf16/f16; a row of mean 10⁴) | add_layer_norm.cu vs plain ops | the CPU fused ops vs plain ops |
//! | FP8 kernels (amax; quantise + dequantise from f32 and bf16; the delayed scale update) | stage4_fp8/kernels/fp8.cu vs the CPU quantiser (candle's CPU cast) | the CPU quantiser vs candle's cast; the recipe on hand-worked amaxes |
//! | FP8 producer fusions (LayerNorm and add+LayerNorm writing E4M3 + amax; fc1's GEMM writing E4M3 with D scale and amax_D) | kernels/ln_fp8.cu and cuBLASLt's E4M3 output vs the CPU producers | the CPU producers vs plain LayerNorm + quantiser; `fp8_gemm_args_e4m3_out` run by `cublaslt_model` vs the emulated fc1 |
//! | graph capture + replay, each stage (tiny); stage 4 with delayed scaling and a ×4 input after capture | replay vs an uncaptured forward | the capture's order of steps |
//! | breakdown (stage 0, tiny) | CUDA timing events at each part boundary | synchronize + clock |
//! | memory probe | a 64 MiB allocation must show up | same, CPU probe |
//!
//! A row is "skipped" only when this device lacks the hardware feature it needs (FP8 tensor
//! cores below SM 8.9, as a stage's plan says); any error is a failure (exit 1).

use candle_core::{DType, Device, Tensor};
use serde::Serialize;
use shared::check::compare_within;
use shared::device::{DeviceInfo, MemProbe};
use shared::weights::SplitMix64;
use std::time::Instant;

pub const SELFTEST_SCHEMA: &str = "candle-speedkit/selftest/1";

/// One row of the table.
#[derive(Clone, Debug, Serialize)]
pub struct Check {
    pub block: String,
    pub case: String,
    /// What ran: "cuda", or the CPU stand-in's name.
    pub ran: String,
    /// "pass", "FAIL", "skipped" or "error".
    pub status: String,
    pub rel_err: Option<f64>,
    pub tolerance: Option<f64>,
    /// The error message, the skip reason, or a note.
    pub detail: String,
}

/// What a user attaches to a bug report.
#[derive(Debug, Serialize)]
pub struct SelftestReport {
    pub schema: &'static str,
    pub device: DeviceInfo,
    pub nvidia_driver: Option<String>,
    pub cuda_driver_version: Option<String>,
    pub commit: String,
    pub versions: std::collections::BTreeMap<String, String>,
    pub seconds: f64,
    pub passed: usize,
    pub failed: usize,
    pub skipped: usize,
    pub results: Vec<Check>,
}

struct Rows {
    rows: Vec<Check>,
    ran: String,
}

impl Rows {
    /// Record a comparison: pass when rel. error < tolerance and all values finite.
    fn compare(&mut self, block: &str, case: String, f: impl FnOnce() -> anyhow::Result<(Tensor, Tensor, f64)>) {
        let row = match f() {
            Ok((got, want, tol)) => match compare_within(&got, &want, tol) {
                Ok(c) => Check {
                    block: block.into(),
                    case,
                    ran: self.ran.clone(),
                    status: if c.passed { "pass" } else { "FAIL" }.into(),
                    rel_err: Some(c.rel_err),
                    tolerance: Some(tol),
                    detail: if c.non_finite > 0 { format!("{} values NaN or infinite", c.non_finite) } else { String::new() },
                },
                Err(e) => self.error(block, case, e.into()),
            },
            Err(e) => self.error(block, case, e),
        };
        self.rows.push(row);
    }

    /// Any error is a failure, whatever its kind: on the first H100 run a CUDA error wrapped as
    /// "cannot run here" showed as skipped. Only `skip` skips.
    fn error(&self, block: &str, case: String, e: anyhow::Error) -> Check {
        Check {
            block: block.into(),
            case,
            ran: self.ran.clone(),
            status: "error".into(),
            rel_err: None,
            tolerance: None,
            detail: message(&e),
        }
    }

    /// A row this device cannot run because it lacks the hardware feature (`why` names it, e.g.
    /// FP8 tensor cores below SM 8.9). Nothing else is a skip.
    fn skip(&mut self, block: &str, case: String, why: String) {
        let row = Check {
            block: block.into(),
            case,
            ran: self.ran.clone(),
            status: "skipped".into(),
            rel_err: None,
            tolerance: None,
            detail: shared::error::strip_backtrace(&why),
        };
        self.rows.push(row);
    }

    fn outcome(&mut self, block: &str, case: String, r: anyhow::Result<String>) {
        let row = match r {
            Ok(detail) => {
                Check { block: block.into(), case, ran: self.ran.clone(), status: "pass".into(), rel_err: None, tolerance: None, detail }
            }
            Err(e) => self.error(block, case, e),
        };
        self.rows.push(row);
    }
}

/// An error as one paragraph for the table and the JSON: no backtrace (candle appends one to
/// its errors' text when RUST_BACKTRACE is set, 20 lines per cell on the H100 run).
fn message(e: &anyhow::Error) -> String {
    shared::error::strip_backtrace(&format!("{e:#}"))
}

fn randn(dims: &[usize], seed: u64, scale: f32, offset: f32) -> candle_core::Result<Tensor> {
    let n = dims.iter().product();
    let v: Vec<f32> = SplitMix64::new(seed).normals(n).into_iter().map(|x| x * scale + offset).collect();
    Tensor::from_vec(v, dims, &Device::Cpu)
}

/// Run every check on `device` (described by `info`).
pub fn run(device: &Device, info: &DeviceInfo) -> SelftestReport {
    let start = Instant::now();
    let mut r = Rows { rows: Vec::new(), ran: if device.is_cuda() { "cuda".into() } else { String::new() } };
    // Graphs first, on a device with no other tensors yet (event tracking is off from
    // `device::select` on, before any tensor exists).
    graphs(&mut r, device, info);
    attention(&mut r, device);
    epilogues(&mut r, device);
    fp8(&mut r, device, info);
    fp8_kernels(&mut r, device);
    fp8_fusions(&mut r, device, info);
    layer_norms(&mut r, device);
    breakdown(&mut r, device, info);
    memory(&mut r, device);
    let count = |s: &str| r.rows.iter().filter(|c| c.status == s).count();
    SelftestReport {
        schema: SELFTEST_SCHEMA,
        device: info.clone(),
        nvidia_driver: crate::provenance::nvidia_driver(info),
        cuda_driver_version: crate::provenance::cuda_driver_version(info),
        commit: shared::report::commit(),
        versions: crate::provenance::versions(),
        seconds: start.elapsed().as_secs_f64(),
        passed: count("pass"),
        failed: count("FAIL") + count("error"),
        skipped: count("skipped"),
        results: r.rows,
    }
}

/// Plain-ops attention in f32: softmax(q kᵀ/√d + mask) v over (B, T, n_head, d_head).
fn attention_twin(q: &Tensor, k: &Tensor, v: &Tensor, causal: bool) -> candle_core::Result<Tensor> {
    let f = |x: &Tensor| x.to_device(&Device::Cpu)?.to_dtype(DType::F32)?.transpose(1, 2)?.contiguous(); // (B, n_head, T, d_head)
    let (q, k, v) = (f(q)?, f(k)?, f(v)?);
    let (t, d) = (q.dim(2)?, q.dim(3)?);
    let s = (q.matmul(&k.t()?)? / (d as f64).sqrt())?; // (B, n_head, T, T)
    let s = if causal { s.broadcast_add(&stage0_baseline::causal_mask(t, &Device::Cpu)?)? } else { s };
    stage0_baseline::softmax(&s)?.matmul(&v)?.transpose(1, 2)?.contiguous() // (B, T, n_head, d_head)
}

fn attention(r: &mut Rows, device: &Device) {
    use stage2_sdpa::attention::{attention_with, Implementation};
    if !device.is_cuda() {
        r.ran = "cpu kernel (the .cu: host emulation, run.sh)".into();
    }
    // On CUDA both of our kernels, v1 (WMMA) and v2 (mma.sync); on the CPU its one kernel (the
    // .cu sources run under the host emulation instead: host_emulation/run.sh).
    let kernels: &[(&str, Implementation)] = if device.is_cuda() {
        &[("v1 ", Implementation::SpeedkitCudaV1), ("v2 ", Implementation::SpeedkitCuda)]
    } else {
        &[("", Implementation::Cpu)]
    };
    // T = 67: not a multiple of the kernels' 64-row tile, so the last tile is partial.
    for &(label, imp) in kernels {
        for dtype in [DType::BF16, DType::F16] {
            for d in [32, 64, 128] {
                for causal in [false, true] {
                    let case = format!("{label}{dtype:?} d_head={d} causal={causal} B=2 T=67 n_head=2");
                    r.compare("attention", case, || {
                        let mk = |seed| -> anyhow::Result<Tensor> { Ok(randn(&[2, 67, 2, d], seed, 1.0, 0.0)?.to_dtype(dtype)?) };
                        let (q, k, v) = (mk(1)?, mk(2)?, mk(3)?);
                        let tol = if dtype == DType::BF16 { 1e-2 } else { 2e-3 };
                        if device.is_cuda() {
                            let on = |x: &Tensor| x.to_device(device);
                            let got = attention_with(imp, &on(&q)?, &on(&k)?, &on(&v)?, causal)?;
                            Ok((got, attention_with(Implementation::Cpu, &q, &k, &v, causal)?, tol))
                        } else {
                            Ok((attention_with(imp, &q, &k, &v, causal)?, attention_twin(&q, &k, &v, causal)?, tol))
                        }
                    });
                }
            }
        }
    }
}

fn epilogues(r: &mut Rows, device: &Device) {
    use stage3_fused::cublaslt_model::{matmul, DataType};
    use stage3_fused::gemm_args::{linear_args, LinearKind};
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
                    (LinearKind::BiasGelu, _) => stage3_fused::ops::linear_bias_gelu(&xd, &wd, &bd)?,
                    (_, Some(res)) => {
                        let rd = res.to_dtype(residual.unwrap_or(DType::F32))?.to_device(device)?;
                        stage3_fused::ops::linear_bias_residual(&xd, &wd, &bd, &rd)?
                    }
                    _ => stage3_fused::ops::linear_bias(&xd, &wd, &bd)?,
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

fn fp8(r: &mut Rows, device: &Device, info: &DeviceInfo) {
    use stage3_fused::cublaslt_model::matmul;
    use stage4_fp8::fp8::Fp8Recipe;
    use stage4_fp8::fp8::{quantize, Fp8Linear, Fp8Mode, ScalingConfig};
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
                let args = stage4_fp8::gemm::fp8_gemm_args(t, k, n, gelu).map_err(anyhow::Error::msg)?.contract();
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
fn fp8_kernels(r: &mut Rows, device: &Device) {
    use stage4_fp8::fp8::{amax, dequantize, quantize, quantize_dequantize_cpu, scale_from_amax, ScaleState, ScalingConfig};
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
        let mut st = ScaleState::new(ScalingConfig { recipe: stage4_fp8::fp8::Fp8Recipe::Delayed, history_len: 3, margin: 0 })
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
fn fp8_fusions(r: &mut Rows, device: &Device, info: &DeviceInfo) {
    use stage4_fp8::fp8::{amax, dequantize, quantize, Fp8Linear, Fp8Mode, Fp8Target, Input, Quantized, ScalingConfig};
    use stage4_fp8::producers::{add_layer_norm_e4m3, layer_norm_e4m3};
    if !device.is_cuda() {
        r.ran = "cpu producers (the .cu: host emulation, run.sh; the GEMM: cublaslt_model)".into();
    }
    // A target on `device` with scale s: on CUDA, fresh device buffers as a layer's state holds.
    let target = |s: f32| -> candle_core::Result<Fp8Target> {
        let scale = Tensor::new(&[s], device)?;
        Ok(match device.is_cuda() {
            true => Fp8Target { scale, device: Some((Tensor::zeros(1, DType::U32, device)?, Tensor::zeros(1, DType::F32, device)?)) },
            false => Fp8Target { scale: scale.reshape(())?, device: None },
        })
    };
    // s·q and the amax it recorded, on the CPU (CUDA: the amax from the device buffer).
    let values = |q: &Quantized, t: &Fp8Target| -> candle_core::Result<Tensor> {
        let sq = match q.data.dtype() {
            DType::F8E4M3 => dequantize(&q.data, &q.scale, DType::F32)?,
            _ => q.data.clone(),
        };
        let a = match (&q.amax, &t.device) {
            (Some(a), _) => a.reshape(1)?,
            (None, Some((bits, _))) => Tensor::from_vec(vec![f32::from_bits(bits.to_vec1::<u32>()?[0])], 1, &Device::Cpu)?,
            (None, None) => candle_core::bail!("a producer recorded no amax"),
        };
        Tensor::cat(&[&sq.flatten_all()?.to_device(&Device::Cpu)?, &a.to_device(&Device::Cpu)?], 0)
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
                let cpu = Fp8Target { scale: Tensor::new(s, &Device::Cpu)?, device: None };
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
    r.compare("FP8 fusion", case, || {
        let (w, b) = (randn(&[n, k], 8, 0.05, 0.0)?, randn(&[n], 9, 0.05, 0.0)?);
        let x = randn(&[1, tok, k], 11, 1.0, 0.0)?;
        let twin = Fp8Linear::with_output(&w, &b, true, Fp8Mode::Emulated, ScalingConfig::default(), "fc1", DType::F32)?;
        let y = twin.forward(&x)?; // f32: GELU(x̃ W̃ᵀ + b), and x's scale recorded
        let s = 0.8 * amax(&y)?.to_scalar::<f32>()? / 448.0; // fc2's scale, a little small: the top saturates
        let cpu = Fp8Target { scale: Tensor::new(s, &Device::Cpu)?, device: None };
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
        let args = stage4_fp8::gemm::fp8_gemm_args_e4m3_out(tok, k, n, true).map_err(anyhow::Error::msg)?.contract();
        let scales = (twin.weight().scale.to_scalar::<f32>()?, s_x.to_scalar::<f32>()?);
        let xq = quantize(&x, &s_x)?;
        let (d, amax_d) = stage3_fused::cublaslt_model::matmul_fp8_out(
            &args,
            &host(&twin.weight().data)?,
            &host(&xq)?,
            Some(&host(twin.bias())?),
            scales,
            1.0 / s,
        )
        .map_err(anyhow::Error::msg)?;
        let mut got: Vec<f32> = d.iter().map(|q| q * s).collect(); // read back with fc2's scale
        got.push(amax_d);
        // a value on a rounding boundary may land on the neighbour (1/s multiplies, the CPU divides)
        Ok((Tensor::from_vec(got, tok * n + 1, &Device::Cpu)?, want, 1e-2))
    });
}

fn layer_norms(r: &mut Rows, device: &Device) {
    if !device.is_cuda() {
        r.ran = "cpu fused ops (the .cu: host emulation, run.sh)".into();
    }
    // C = 257: not a multiple of the 256 threads; mean 1e4: where a one-pass variance cancels.
    for mean in [0.0f32, 1e4] {
        for dtype in [DType::F32, DType::BF16, DType::F16] {
            for add in [false, true] {
                let name = if add { "add_layer_norm" } else { "layer_norm" };
                let case = format!("{name} {dtype:?} rows=5 C=257 row mean {mean}");
                r.compare("NVRTC kernel", case, || {
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
                        stage3_fused::ops::add_layer_norm(&xd, &on(&br)?, &gd, &bd)?.1
                    } else {
                        stage3_fused::ops::layer_norm(&xd, &gd, &bd, dtype)?
                    };
                    Ok((got, want, tol))
                });
            }
        }
    }
}

fn graphs(r: &mut Rows, device: &Device, info: &DeviceInfo) {
    use shared::graph::{run_capture, CaptureSteps};
    if !device.is_cuda() {
        r.ran = "recording model of the capture".into();
        #[derive(Default)]
        struct Order(Vec<&'static str>, bool);
        impl CaptureSteps for Order {
            fn enable_htod_cache(&mut self) {
                self.1 = true;
                self.0.push("cache");
            }
            fn forward(&mut self) -> anyhow::Result<()> {
                anyhow::ensure!(self.1, "a forward ran before candle's h2d cache was on");
                self.0.push("forward");
                Ok(())
            }
            fn synchronize(&mut self) -> anyhow::Result<()> {
                self.0.push("sync");
                Ok(())
            }
            fn begin_capture(&mut self) -> anyhow::Result<()> {
                self.0.push("begin");
                Ok(())
            }
            fn end_capture(&mut self) -> anyhow::Result<()> {
                self.0.push("end");
                Ok(())
            }
            fn abort_capture(&mut self) -> anyhow::Result<()> {
                self.0.push("abort");
                Ok(())
            }
            fn release_captured(&mut self) {
                self.0.push("release");
            }
        }
        let mut o = Order::default();
        let res = run_capture(&mut o).and_then(|_| {
            anyhow::ensure!(o.0 == ["cache", "forward", "sync", "begin", "forward", "end"], "order {:?}", o.0);
            Ok(o.0.join(" → "))
        });
        r.outcome("CUDA graph", "capture sequence (every stage; replay needs a GPU)".into(), res);
        return;
    }
    let shape = shared::Preset::Tiny.shape();
    for spec in crate::stages() {
        let case = format!("{} capture + replay (tiny)", spec.name);
        // Current scaling here; delayed scaling has its own row below.
        let opts = shared::StageOptions { cuda_graph: true, fp8_recipe: shared::Fp8Recipe::Current, ..Default::default() };
        // The plan is where a stage says this device lacks what it needs (FP8 below SM 8.9): a
        // skip. Anything after it that errs is a failure.
        let plan = match spec.plan_with(device, info, shape, spec.ladder_request(shared::PrecisionRequest::Auto), opts) {
            Ok(plan) => plan,
            Err(e) => {
                r.skip("CUDA graph", case, e.to_string());
                continue;
            }
        };
        r.compare("CUDA graph", case, || {
            let weights = shared::BlockWeights::from_seed(&shape, 1)?.to_device(device)?;
            let x = shared::weights::random_input(&shape, 2)?.to_device(device)?;
            let plain = (spec.build)(&weights, &plan)?.forward(&x)?;
            let graphed = shared::graph::capture(spec.name, (spec.build)(&weights, &plan)?, &x)?;
            graphed.forward(&x)?;
            let replayed = graphed.forward(&x)?.copy()?; // the second replay

            // The same kernels on the same input; only a GEMM algorithm choice could differ.
            Ok((replayed, plain, 1e-3))
        });
    }
    // Stage 4 with delayed scaling: the scale update runs inside the graph, so replays must
    // advance the amax history. The input grows ×4 after the capture; a history frozen at the
    // captured call would saturate the top of every activation (a large error).
    let case = "stage4_fp8 delayed scaling, replays on a ×4 input (tiny)".to_string();
    let Some(spec) = crate::stages().into_iter().find(|s| s.name == "stage4_fp8") else {
        r.outcome("CUDA graph", case, Err(anyhow::anyhow!("no stage 4 in this build")));
        return;
    };
    let opts = shared::StageOptions { cuda_graph: true, fp8_recipe: shared::Fp8Recipe::Delayed, ..Default::default() };
    // As above: a plan refusal (no FP8 tensor cores) is a skip, anything after it a failure.
    let plan = match spec.plan_with(device, info, shape, spec.ladder_request(shared::PrecisionRequest::Auto), opts) {
        Ok(plan) => plan,
        Err(e) => return r.skip("CUDA graph", case, e.to_string()),
    };
    r.compare("CUDA graph", case, || {
        let weights = shared::BlockWeights::from_seed(&shape, 1)?.to_device(device)?;
        let x = shared::weights::random_input(&shape, 2)?.to_device(device)?;
        let x4 = (&x * 4.0)?;
        let plain = (spec.build)(&weights, &plan)?;
        for input in [&x, &x, &x4, &x4] {
            plain.forward(input)?;
        }
        let want = plain.forward(&x4)?;
        let graphed = shared::graph::capture(spec.name, (spec.build)(&weights, &plan)?, &x)?; // calls 1, 2
        x.slice_set(&x4, 0, 0)?; // the captured input buffer now holds 4x
        for _ in 0..2 {
            graphed.forward(&x)?; // calls 3, 4
        }
        Ok((graphed.forward(&x)?.copy()?, want, 1e-3))
    });
}

/// `--breakdown`'s recorder on this device: stage 0 at tiny, every part of the block timed,
/// each time finite and not negative, the parts' sum above zero. On CUDA this is the event path
/// that failed on the first H100 run (events created without timing); on the CPU the
/// synchronize-and-clock path.
fn breakdown(r: &mut Rows, device: &Device, info: &DeviceInfo) {
    r.ran = if device.is_cuda() { "cuda".into() } else { "cpu (synchronize + clock)".into() };
    let res = (|| -> anyhow::Result<String> {
        let shape = shared::Preset::Tiny.shape();
        let spec = crate::reference();
        let plan = spec.plan_with(device, info, shape, spec.ladder_request(shared::PrecisionRequest::Auto), Default::default())?;
        let weights = shared::BlockWeights::from_seed(&shape, 1)?.to_device(device)?;
        let x = shared::weights::random_input(&shape, 2)?.to_device(device)?;
        let stage = (spec.build)(&weights, &plan)?;
        let b = shared::breakdown::record(device, 1, 2, || stage.forward(&x))?;
        check_breakdown(&b)?;
        Ok(format!("{} parts, {:.3} ms in all ({})", b.parts.len(), b.total_ms, b.method))
    })();
    r.outcome("breakdown", "records on this device (stage 0, tiny)".into(), res);
}

/// What a recorded breakdown of a stage 0–2 forward must hold: the block's parts in order, each
/// time finite and not negative, a positive total.
fn check_breakdown(b: &shared::breakdown::Breakdown) -> anyhow::Result<()> {
    let names: Vec<&str> = b.parts.iter().map(|p| p.name.as_str()).collect();
    anyhow::ensure!(names == shared::breakdown::PARTS, "parts {names:?}, not the block's {:?}", shared::breakdown::PARTS);
    for p in &b.parts {
        anyhow::ensure!(p.samples_ms.iter().all(|t| t.is_finite() && *t >= 0.0), "part {} timed {:?}", p.name, p.samples_ms);
    }
    anyhow::ensure!(b.total_ms.is_finite() && b.total_ms > 0.0, "total {} ms", b.total_ms);
    Ok(())
}

fn memory(r: &mut Rows, device: &Device) {
    if !device.is_cuda() {
        r.ran = "cpu probe".into();
    }
    const BYTES: u64 = 64 << 20;
    let res = (|| -> anyhow::Result<String> {
        let probe = MemProbe::start(device);
        {
            // Allocated and freed before the end: only a high-water mark sees it.
            let t = Tensor::ones((BYTES / 4) as usize, DType::F32, device)?;
            device.synchronize()?;
            drop(t);
        }
        device.synchronize()?;
        let (peak, method) = probe.finish(device);
        let peak = peak.ok_or_else(|| anyhow::anyhow!("the probe could not measure ({method})"))?;
        // 60 of 64 MiB: the CPU's RSS counts pages, and a few of them may already be resident.
        anyhow::ensure!(
            peak >= BYTES / 16 * 15,
            "a transient 64 MiB allocation showed as {:.1} MiB ({method})",
            peak as f64 / (1u64 << 20) as f64
        );
        Ok(format!("{:.1} MiB seen for 64 MiB ({method})", peak as f64 / (1u64 << 20) as f64))
    })();
    r.outcome("memory probe", "transient 64 MiB allocation".into(), res);
}

/// The pass/fail table.
pub fn table(rep: &SelftestReport) -> String {
    let mut s = format!("selftest on {} (commit {})\n", rep.device.describe(), rep.commit);
    s += &format!("{:<18} {:<58} {:<8} {:>9} {:>8}  {}\n", "block", "case", "result", "rel err", "tol", "ran / detail");
    for c in &rep.results {
        let e = c.rel_err.map(|e| format!("{e:.2e}")).unwrap_or_default();
        let t = c.tolerance.map(|t| format!("{t:.0e}")).unwrap_or_default();
        let detail = if c.detail.is_empty() { c.ran.clone() } else { format!("{}: {}", c.ran, c.detail) };
        s += &format!("{:<18} {:<58} {:<8} {:>9} {:>8}  {}\n", c.block, c.case, c.status, e, t, detail);
    }
    s += &format!("{} passed, {} failed, {} skipped in {:.1} s\n", rep.passed, rep.failed, rep.skipped, rep.seconds);
    s
}

/// `ladder selftest` flags.
#[derive(clap::Args, Debug)]
pub struct SelftestArgs {
    /// auto, cpu, cuda or cuda:N
    #[arg(long, env = "SPEEDKIT_DEVICE", default_value = "auto")]
    pub device: String,
    /// Where to write the JSON to attach to a bug report.
    #[arg(long, default_value = "selftest.json")]
    pub json: std::path::PathBuf,
}

/// The subcommand: run, print the table, write the JSON; an error (exit 1) if anything failed.
pub fn command(args: &SelftestArgs) -> anyhow::Result<()> {
    let req: shared::device::DeviceRequest = args.device.parse().map_err(shared::SpeedkitError::usage)?;
    // Checked by the output policy before anything runs (a directory, a device, a folder that
    // cannot take a new file, a closed /dev/fd/N), so a run never ends in a refusal to save it.
    let out = shared::output::check("--json", &args.json)?;
    let (device, info) = shared::device::select(req)?;
    let rep = run(&device, &info);
    print!("{}", table(&rep));
    let mut bytes = serde_json::to_vec_pretty(&rep)?;
    bytes.push(b'\n');
    out.write(&bytes)?;
    println!("wrote {} — attach it to a bug report (docs/gpu.md)", args.json.display());
    if rep.failed > 0 {
        // Exit 1: a building block is broken (a wrong result or an error), whatever its kind.
        anyhow::bail!("selftest: {} of {} checks failed (see the table and {}).", rep.failed, rep.results.len(), args.json.display());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The CPU side of the list passes, covers every block, and the JSON carries what a bug
    /// report needs.
    #[test]
    fn cpu_selftest_passes_and_covers_every_block() {
        let (device, info) = shared::device::select(shared::device::DeviceRequest::Cpu).unwrap();
        let rep = run(&device, &info);
        assert_eq!(rep.failed, 0, "{}", table(&rep));
        for block in ["attention", "cuBLASLt epilogue", "FP8 GEMM", "FP8 kernel", "NVRTC kernel", "CUDA graph", "breakdown", "memory probe"]
        {
            assert!(rep.results.iter().any(|c| c.block == block && c.status == "pass"), "{block} missing");
        }
        assert_eq!(
            rep.results.iter().filter(|c| c.block == "FP8 kernel" && c.status == "pass").count(),
            4,
            "amax, 2 casts, delayed update"
        );
        assert_eq!(rep.results.iter().filter(|c| c.block == "attention").count(), 12, "3 d_head × 2 dtypes × causal or not");
        let json = serde_json::to_value(&rep).unwrap();
        for key in ["device", "nvidia_driver", "cuda_driver_version", "commit", "versions", "results"] {
            assert!(json.get(key).is_some(), "{key}");
        }
    }

    /// Regression (issue 24, item 4): an error is a failure whatever its kind (on the H100 a
    /// CUDA error wrapped as "cannot run here" showed as skipped), its text carries no
    /// backtrace, and only `skip` skips.
    #[test]
    fn an_error_is_a_failure_without_its_backtrace_and_only_skip_skips() {
        let mut r = Rows { rows: Vec::new(), ran: "cuda".into() };
        let wrapped = "cannot quantise fp8's weight to FP8: DriverError(CUDA_ERROR_NOT_FOUND, \"named symbol not found\")\n   0: <unknown>\n   1: <unknown>\n  19: __libc_start_main";
        r.compare("FP8 GEMM", "usage-wrapped driver error".into(), || Err(shared::SpeedkitError::usage(wrapped).into()));
        r.outcome("x", "plain error".into(), Err(anyhow::anyhow!("{wrapped}")));
        r.skip("FP8 GEMM", "no FP8 units".into(), "FP8 tensor cores need SM 8.9+; this GPU has none".into());
        let status: Vec<&str> = r.rows.iter().map(|c| c.status.as_str()).collect();
        assert_eq!(status, ["error", "error", "skipped"]);
        for c in &r.rows[..2] {
            assert!(c.detail.ends_with("named symbol not found\")") && !c.detail.contains("<unknown>"), "{}", c.detail);
        }
    }

    /// The breakdown row's own check fails on what a broken recorder gives.
    #[test]
    fn breakdown_check_refuses_missing_parts_and_bad_times() {
        use shared::breakdown::{summarise, PARTS};
        let good: Vec<(&'static str, f64)> = PARTS.iter().map(|p| (*p, 0.5)).collect();
        let ok = summarise(std::slice::from_ref(&good), 1, "m".into()).unwrap();
        check_breakdown(&ok).unwrap();
        let short = summarise(&[good[..3].to_vec()], 1, "m".into()).unwrap();
        assert!(check_breakdown(&short).is_err());
        let mut nan = good.clone();
        nan[2].1 = f64::NAN;
        assert!(check_breakdown(&summarise(&[nan], 1, "m".into()).unwrap()).is_err());
        let zero: Vec<(&'static str, f64)> = PARTS.iter().map(|p| (*p, 0.0)).collect();
        assert!(check_breakdown(&summarise(&[zero], 1, "m".into()).unwrap()).is_err());
    }
}
