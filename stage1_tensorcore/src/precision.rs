//! The precision policy: which number format the block's matrix multiplications use on a
//! given device, and why. A pure function of the device's capabilities and the user's request,
//! so it can be tested for every GPU generation without owning one. Later stages import it.
//!
//! | device                | auto  | why                                                        |
//! |-----------------------|-------|------------------------------------------------------------|
//! | CPU with AVX512-BF16 or AMX-BF16 | bf16 | bf16 dot-product units (`bf16_gemm`), f32 accumulate |
//! | CPU without them      | fp32  | no bf16 units: bf16/f16 GEMMs convert and run slower       |
//! | SM < 7.0 (Pascal)     | fp32  | no tensor cores, no TF32                                   |
//! | SM 7.x (Volta/Turing) | f16   | f16 tensor cores; bf16 and TF32 do not exist before Ampere |
//! | SM >= 8.0 (Ampere+)   | bf16  | bf16 tensor cores, fp32's exponent range: no loss scaling  |
//!
//! Overrides that the hardware cannot do (bf16 or TF32 below SM 8.0, TF32 on CPU) are errors;
//! fp8 is stage 4's technique and is refused here.
//!
//! To lift the policy into your own model: `auto_dtype(&device)` gives the GEMM dtype the table
//! picks for that device (on a CPU, run bf16 GEMMs through `bf16_gemm::matmul`) (store weights and activations in it, keep LayerNorm statistics,
//! softmax and the residual stream in f32 as stage 1 does). The rest of this file is the
//! benchmark's version, which also explains its choice and refuses impossible requests.

use candle_core::{DType, Device};
use cpu_kernels::bf16_gemm::Kernel;
#[cfg(feature = "harness")]
use shared::device::{DeviceInfo, GemmSwitches};
#[cfg(feature = "harness")]
use shared::preset::Shape;
#[cfg(feature = "harness")]
use shared::stage::PrecisionChoice;
#[cfg(feature = "harness")]
use shared::{Precision, PrecisionRequest, SpeedkitError};

/// The table's GEMM dtype for a GPU of compute capability `sm` (None: a CPU without bf16 units).
pub fn auto_dtype_for(sm: Option<(u32, u32)>) -> DType {
    match sm {
        None => DType::F32,                      // no tensor cores, no bf16 dot products
        Some(sm) if sm >= (8, 0) => DType::BF16, // Ampere and later: bf16, fp32's exponent range
        Some(sm) if sm >= (7, 0) => DType::F16,  // Volta, Turing: f16 tensor cores only
        Some(_) => DType::F32,
    }
}

/// The table's GEMM dtype for `device`: on a CPU bf16 where it has a bf16 unit
/// (`Kernel::detect`), else f32; by compute capability on a GPU.
pub fn auto_dtype(device: &Device) -> candle_core::Result<DType> {
    match device {
        #[cfg(feature = "cuda")]
        Device::Cuda(d) => {
            let (major, minor) = d.cuda_stream().context().compute_capability().map_err(|e| candle_core::Error::Msg(format!("{e:?}")))?;
            Ok(auto_dtype_for(Some((major as u32, minor as u32))))
        }
        _ if Kernel::detect().is_native() => Ok(DType::BF16),
        _ => Ok(auto_dtype_for(None)),
    }
}

#[cfg(feature = "harness")]
/// Decide the GEMM precision for `info` and `requested` (see the module table), with this CPU's
/// bf16 kernel (`Kernel::detect`).
pub fn choose(info: &DeviceInfo, requested: PrecisionRequest) -> Result<PrecisionChoice, SpeedkitError> {
    choose_with(info, requested, Kernel::detect())
}

#[cfg(feature = "harness")]
/// `choose` for a CPU whose bf16 GEMM kernel is `cpu` (ignored on a GPU): a pure function, so
/// the table is tested for CPUs with and without bf16 units on any machine.
pub fn choose_with(info: &DeviceInfo, requested: PrecisionRequest, cpu: Kernel) -> Result<PrecisionChoice, SpeedkitError> {
    let sm = info.sm.map(|(a, b)| format!("SM {a}.{b}")).unwrap_or_else(|| "the CPU".into());
    let refuse = |p: Precision, why: &str, fix: &str| {
        Err(SpeedkitError::usage(format!("--precision {p} cannot run on {} ({sm}): {why}. Fix: {fix}.", info.name)))
    };
    match requested {
        PrecisionRequest::Auto => Ok(if !info.is_cuda() && cpu.is_native() {
            (Precision::Bf16, format!("auto on CPU: bf16 GEMMs on {}, f32 accumulate; LayerNorm, softmax and the residual stay f32", unit(cpu)))
        } else if !info.is_cuda() {
            (Precision::Fp32, "auto on CPU: no bf16 units (AVX512-BF16, AMX-BF16) and no tensor cores, so fp32 is fastest (bf16/f16 GEMMs convert their operands and run slower)".into())
        } else if info.has_bf16_tensor_cores() {
            (Precision::Bf16, format!("auto on {sm}: bf16 tensor cores, f32 accumulate; bf16 keeps fp32's exponent range"))
        } else if info.has_f16_tensor_cores() {
            (Precision::F16, format!("auto on {sm}: f16 tensor cores (bf16 and TF32 need SM 8.0), f32 accumulate"))
        } else {
            (Precision::Fp32, format!("auto on {sm}: no tensor cores and no TF32 before SM 7.0/8.0"))
        }),
        PrecisionRequest::Exactly(p) => match p {
            Precision::Fp32 => Ok((p, "requested: fp32, TF32 off".into())),
            Precision::Tf32 if !info.is_cuda() => {
                refuse(p, "TF32 is a tensor-core input format and the CPU has none", "use --precision fp32 on the CPU, or run on an SM 8.0+ GPU")
            }
            Precision::Tf32 if !info.has_bf16_tensor_cores() => {
                refuse(p, "TF32 tensor cores arrived with Ampere (SM 8.0)", "use --precision f16 or fp32 on this GPU")
            }
            Precision::Tf32 => Ok((p, format!("requested: f32 storage, GEMMs on TF32 tensor cores ({sm})"))),
            Precision::Bf16 if info.is_cuda() && !info.has_bf16_tensor_cores() => {
                refuse(p, "bf16 arrived with Ampere (SM 8.0)", "use --precision f16 on this GPU")
            }
            Precision::Bf16 if !info.is_cuda() && cpu.is_native() => {
                Ok((p, format!("requested: bf16 GEMMs on {} (kernel {}), f32 accumulate", unit(cpu), cpu.name())))
            }
            Precision::Bf16 | Precision::F16 if !info.is_cuda() => {
                Ok((p, format!("requested: {p} on CPU — numerics as on a GPU, but slower than fp32 here (no {p} matrix units; every GEMM converts its operands)")))
            }
            Precision::Bf16 | Precision::F16 => Ok((p, format!("requested: {p} GEMMs on tensor cores, f32 accumulate ({sm})"))),
            Precision::Fp8 => Err(SpeedkitError::usage(
                "--precision fp8 is stage 4's technique (stage4_fp8); this stage does fp32, tf32, bf16 and f16. \
                 Fix: pick one of those, or run stage4_fp8."
                    .to_string(),
            )),
        },
    }
}

#[cfg(feature = "harness")]
/// The CPU unit behind a kernel, for the reader.
fn unit(k: Kernel) -> &'static str {
    match k {
        Kernel::Amx => "this CPU's AMX-BF16 tiles (tdpbf16ps: a 16 × 16 × 32 tile product per instruction)",
        Kernel::Avx512Bf16 => "this CPU's AVX512-BF16 (vdpbf16ps: two bf16 products per f32 lane per instruction)",
        Kernel::Mkl => "MKL's bf16 GEMM (cblas_gemm_bf16bf16f32)",
        Kernel::ConvertedF32 => "no bf16 unit",
    }
}

#[cfg(feature = "harness")]
/// What runs a plan's bf16 GEMMs on a CPU, for the table's implementation cell: the kernel's
/// name (`avx512-bf16`, `amx`, or `converted to f32`); `None` on a GPU or at other precisions.
pub fn cpu_bf16_kernel(plan: &shared::Plan) -> Option<&'static str> {
    (!plan.info.is_cuda() && plan.precision == Precision::Bf16).then(|| Kernel::detect().name())
}

#[cfg(feature = "harness")]
/// candle's global GEMM switches for each precision, set deliberately:
/// - tf32: `set_gemm_reduced_precision_f32(true)` is *the* TF32 switch (cuBLAS compute type
///   32F_FAST_TF32): f32 tensors, inputs rounded to 10 mantissa bits inside the tensor core.
/// - bf16, f16: all off. For f16, candle's "reduced precision" means COMPUTE_16F — accumulating
///   in f16, which over K = 3072 loses ~3 digits and can overflow at 65504; we keep f32
///   accumulation. For bf16 it selects 32F_FAST_16BF, which for bf16 operands is the same f32
///   accumulation; we leave it off so the setting says plainly what runs.
/// - fp32: all off, like stage 0.
pub fn switches(p: Precision) -> GemmSwitches {
    GemmSwitches { tf32: p == Precision::Tf32, ..GemmSwitches::OFF }
}

#[cfg(feature = "harness")]
/// candle dtype that GEMM operands are stored in for `p` (TF32 keeps f32 storage).
pub fn gemm_dtype(p: Precision) -> DType {
    match p {
        Precision::Bf16 => DType::BF16,
        Precision::F16 => DType::F16,
        Precision::Fp32 | Precision::Tf32 | Precision::Fp8 => DType::F32,
    }
}

#[cfg(feature = "harness")]
/// Whether this plan is a training step on the CPU with bf16 GEMMs: then the tensors candle's
/// autograd records stay f32 (`activation_dtype`) and the weights go in as their f32 masters
/// (`PackedWeight::bf16_master`), while every GEMM and the attention still multiply bf16 operands,
/// rounded as the kernels read them. The reason is candle's CPU autograd: it adds each gradient
/// into a zero tensor of the recorded tensor's dtype, and its CPU add of two bf16 tensors runs
/// many times slower than its f32 add (`results/train-engine/candle-add.txt`), so every
/// recorded bf16 activation and weight cast would cost the training step a slow pass per use.
/// Only where the CPU's bf16 unit runs the engine's kernels: elsewhere an f32 operand would not be
/// rounded to bf16 by every GEMM, and the row's bf16 would not say what ran.
pub fn trains_f32_on_cpu(plan: &shared::Plan) -> bool {
    plan.train && plan.device.is_cpu() && gemm_dtype(plan.precision) == DType::BF16 && Kernel::detect().is_native()
}

#[cfg(feature = "harness")]
/// The dtype the block's activations are stored in: the GEMM dtype, except in a training step on
/// the CPU at bf16 (`trains_f32_on_cpu`), f32.
pub fn activation_dtype(plan: &shared::Plan) -> DType {
    if trains_f32_on_cpu(plan) {
        DType::F32
    } else {
        gemm_dtype(plan.precision)
    }
}

#[cfg(feature = "harness")]
/// A linear layer's weight W (n × k, f32 master) for this plan: cast to the GEMM dtype once and,
/// on a CPU's bf16 unit, packed once (`PackedWeight::new`); in a training step on the CPU at bf16,
/// the f32 master itself with bf16 products (`PackedWeight::bf16_master`).
pub fn weight(w: &candle_core::Tensor, plan: &shared::Plan) -> candle_core::Result<cpu_kernels::bf16_gemm::PackedWeight> {
    use cpu_kernels::bf16_gemm::PackedWeight;
    match trains_f32_on_cpu(plan) {
        true => PackedWeight::bf16_master(w),
        false => PackedWeight::new(&w.to_dtype(gemm_dtype(plan.precision))?.contiguous()?),
    }
}

#[cfg(feature = "harness")]
/// Tensor cores work on tiles whose inner dimensions are multiples of 8 elements (16 bytes of
/// bf16/f16; 16 elements for FP8). A GEMM dimension that is not gets padded internally or
/// falls back to slower kernels. One warning per misaligned dimension, with the padded size.
pub fn alignment_advice(shape: &Shape, p: Precision) -> Vec<String> {
    let multiple = match p {
        Precision::Fp32 => return Vec::new(),
        Precision::Fp8 => 16,
        Precision::Tf32 | Precision::Bf16 | Precision::F16 => 8,
    };
    [("C (--d-model)", shape.d_model), ("FF (--ff)", shape.ff), ("d_head (C / n_head)", shape.d_head())]
        .into_iter()
        .filter(|(_, v)| !v.is_multiple_of(multiple))
        .map(|(what, v)| {
            let padded = v.div_ceil(multiple) * multiple;
            format!("{what} = {v} is not a multiple of {multiple}: {p} tensor cores will be underused; pad it to {padded}")
        })
        .collect()
}

#[cfg(all(test, feature = "harness"))]
mod tests {
    use super::*;
    use shared::device::DeviceKind;
    use Precision::*;

    fn cpu() -> DeviceInfo {
        DeviceInfo {
            kind: DeviceKind::Cpu,
            ordinal: 0,
            name: "cpu".into(),
            sm: None,
            memory_bytes: None,
            threads: 2,
            why: "test".into(),
            cpu_flags: Vec::new(),
        }
    }

    /// A device name, its SM (None = CPU), and the outcome for each of the six requests.
    type Row = (&'static str, Option<(u32, u32)>, [Option<Precision>; 6]);

    /// Expected outcome for every device × request: Some(precision) or None (= refused).
    #[test]
    fn policy_table_is_exhaustive() {
        let requests = [
            PrecisionRequest::Auto,
            PrecisionRequest::Exactly(Fp32),
            PrecisionRequest::Exactly(Tf32),
            PrecisionRequest::Exactly(Bf16),
            PrecisionRequest::Exactly(F16),
            PrecisionRequest::Exactly(Fp8),
        ];
        #[rustfmt::skip]
        let table: [Row; 8] = [
            //            device   SM            auto        fp32        tf32        bf16        f16        fp8
            ("CPU",       None,         [Some(Fp32), Some(Fp32), None,       Some(Bf16), Some(F16), None]), // no bf16 unit
            ("GTX 1080",  Some((6, 1)), [Some(Fp32), Some(Fp32), None,       None,       Some(F16), None]),
            ("V100",      Some((7, 0)), [Some(F16),  Some(Fp32), None,       None,       Some(F16), None]),
            ("T4",        Some((7, 5)), [Some(F16),  Some(Fp32), None,       None,       Some(F16), None]),
            ("A100",      Some((8, 0)), [Some(Bf16), Some(Fp32), Some(Tf32), Some(Bf16), Some(F16), None]),
            ("RTX 3090",  Some((8, 6)), [Some(Bf16), Some(Fp32), Some(Tf32), Some(Bf16), Some(F16), None]),
            ("L40S",      Some((8, 9)), [Some(Bf16), Some(Fp32), Some(Tf32), Some(Bf16), Some(F16), None]),
            ("H100",      Some((9, 0)), [Some(Bf16), Some(Fp32), Some(Tf32), Some(Bf16), Some(F16), None]),
        ];
        for (name, sm, expected) in table {
            let info = match sm {
                None => cpu(),
                Some(sm) => DeviceInfo::simulated_cuda(name, sm),
            };
            for (req, want) in requests.iter().zip(expected) {
                let got = choose_with(&info, *req, Kernel::ConvertedF32);
                match (want, got) {
                    (Some(p), Ok((q, why))) => {
                        assert_eq!(p, q, "{name} {req:?}");
                        assert!(!why.is_empty());
                    }
                    (None, Err(e)) => assert!(e.to_string().contains("Fix:"), "{name} {req:?}: {e}"),
                    (want, got) => panic!("{name} {req:?}: expected {want:?}, got {got:?}"),
                }
            }
        }
    }

    #[test]
    fn refusals_name_the_cause() {
        let t4 = DeviceInfo::simulated_cuda("T4", (7, 5));
        let e = choose(&t4, PrecisionRequest::Exactly(Bf16)).unwrap_err().to_string();
        assert!(e.contains("SM 7.5") && e.contains("Ampere"), "{e}");
        let e = choose(&cpu(), PrecisionRequest::Exactly(Tf32)).unwrap_err().to_string();
        assert!(e.contains("CPU has none"), "{e}");
        let (_, why) = choose_with(&cpu(), PrecisionRequest::Exactly(Bf16), Kernel::ConvertedF32).unwrap();
        assert!(why.contains("slower than fp32"), "{why}");
    }

    /// A CPU with a bf16 unit: auto is bf16 and says which unit; every other request as on a
    /// CPU without one. Without: auto is fp32 and says why.
    #[test]
    fn cpu_auto_follows_its_bf16_unit() {
        for kernel in [Kernel::Avx512Bf16, Kernel::Amx] {
            let (p, why) = choose_with(&cpu(), PrecisionRequest::Auto, kernel).unwrap();
            assert_eq!(p, Bf16, "{why}");
            assert!(why.contains(if kernel == Kernel::Amx { "AMX-BF16" } else { "AVX512-BF16" }) && why.contains("stay f32"), "{why}");
            let (p, why) = choose_with(&cpu(), PrecisionRequest::Exactly(Bf16), kernel).unwrap();
            assert!(p == Bf16 && why.contains(kernel.name()), "{why}");
            for (req, want) in [(Fp32, Some(Fp32)), (F16, Some(F16)), (Tf32, None), (Fp8, None)] {
                assert_eq!(choose_with(&cpu(), PrecisionRequest::Exactly(req), kernel).ok().map(|c| c.0), want, "{req:?}");
            }
        }
        let (p, why) = choose_with(&cpu(), PrecisionRequest::Auto, Kernel::ConvertedF32).unwrap();
        assert!(p == Fp32 && why.contains("no bf16 units"), "{why}");
    }

    #[test]
    fn switches_per_precision() {
        assert_eq!(switches(Tf32), GemmSwitches { tf32: true, reduced_f16: false, reduced_bf16: false });
        for p in [Fp32, Bf16, F16] {
            assert_eq!(switches(p), GemmSwitches::OFF);
        }
    }

    #[test]
    fn alignment() {
        let s = Shape { batch: 1, seq: 8, d_model: 100, n_head: 4, ff: 400 };
        let a = alignment_advice(&s, Bf16);
        // C = 100 → 104; FF = 400 is fine; d_head = 25 → 32
        assert_eq!(a.len(), 2, "{a:?}");
        assert!(a[0].contains("pad it to 104") && a[1].contains("pad it to 32"), "{a:?}");
        assert!(alignment_advice(&s, Fp32).is_empty());
        assert!(alignment_advice(&shared::Preset::Small.shape(), Bf16).is_empty());
        let s = Shape { batch: 1, seq: 8, d_model: 24, n_head: 1, ff: 96 };
        assert_eq!(alignment_advice(&s, Fp8).len(), 2); // 24 → 32, d_head 24 → 32; 96 is fine
    }
}
