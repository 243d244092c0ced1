//! What only the benchmark harness needs from stage 2's attention: refusals phrased in the
//! runner's terms (`DeviceInfo`, `--precision`, `--attention-kernel`) and the memory estimate.
//! The techniques themselves (`attention`,
//! `elementwise`) depend on candle alone.

use crate::attention::{AttentionKernel, Implementation};
use crate::attention_cuda;
use candle_core::Device;
use shared::device::DeviceInfo;
use shared::train::TrainBytes;
use shared::{Precision, Shape, SpeedkitError};

/// What a stage runs on `device` with `--attention-kernel` = `kernel` (None: the default).
/// The flag picks between our two CUDA kernels; where neither runs (the CPU, a build with
/// candle-flash-attn) asking for one is an error, not a request quietly ignored.
pub fn for_run(device: &Device, kernel: Option<AttentionKernel>) -> Result<Implementation, SpeedkitError> {
    let default = Implementation::on(device);
    let Some(k) = kernel else { return Ok(default) };
    Implementation::with_kernel(device, k).ok_or_else(|| {
        SpeedkitError::usage(format!(
            "--attention-kernel {} chooses between stage 2's two CUDA kernels (v1: WMMA, v2: mma.sync), and \
             this run's attention is {} instead. Fix: drop --attention-kernel (and SPEEDKIT_ATTENTION_KERNEL), \
             or run on a GPU (--device cuda) with a build without the flash-attn feature.",
            k.name(),
            default.description()
        ))
    })
}

/// Can this device run fused attention at precision `p`? On CUDA both kernels (ours and
/// candle-flash-attn) take bf16 or f16 on SM 8.0+. The CPU kernel takes any precision stage 1
/// allows.
pub fn check_device(info: &DeviceInfo, p: Precision) -> Result<(), SpeedkitError> {
    if !info.is_cuda() {
        return Ok(());
    }
    check_cuda(Implementation::cuda(), &attention_cuda::built_archs(), info, p)
}

/// `built`: the architectures our kernels' cubins were compiled for (10·major + minor; empty
/// without the `cuda` feature).
fn check_cuda(imp: Implementation, built: &[u32], info: &DeviceInfo, p: Precision) -> Result<(), SpeedkitError> {
    let who = match imp {
        Implementation::FlashAttn => "candle-flash-attn",
        _ => "stage 2's CUDA attention kernels (kernels/flash_attn.cu, flash_attn_v2.cu)",
    };
    let sm = info.sm.map_or("?".into(), |(a, b)| format!("{a}.{b}"));
    if !info.has_bf16_tensor_cores() {
        return Err(SpeedkitError::usage(format!(
            "{who} needs SM 8.0+ (Ampere or newer: bf16 tensor cores), and {} is SM {sm}. \
             Fix: run stage 2 with --device cpu; stages 0-1 run on this GPU.",
            info.name
        )));
    }
    if let (Implementation::SpeedkitCuda | Implementation::SpeedkitCudaV1, false, Some((major, minor))) = (imp, built.is_empty(), info.sm) {
        if let Err(e) = kernel_cache::pick_arch(&format!("{who} ({})", info.name), built, 10 * major + minor) {
            return Err(SpeedkitError::usage(format!("{e} Or run stage 2 with --device cpu.")));
        }
    }
    if !matches!(p, Precision::Bf16 | Precision::F16) {
        return Err(SpeedkitError::usage(format!(
            "{who} computes in bf16 or f16, so stage 2 cannot run --precision {p} on CUDA. \
             Fix: use --precision bf16 (the auto choice on this GPU) or f16."
        )));
    }
    Ok(())
}

/// Working set of a block with fused attention, in bytes: weights, a handful of (B, T, C)
/// activations and the MLP's (B, T, FF) ones — and no (B, n_head, T, T) term.
pub fn estimate_fused_bytes(s: &Shape) -> u128 {
    let (b, t, c, ff) = (s.batch as u128, s.seq as u128, s.d_model as u128, s.ff as u128);
    4 * (4 * c * c + 2 * c * ff + 9 * c + ff + 10 * b * t * c + 4 * b * t * ff)
}

/// One training step of a block with fused attention, by part: weights, gradients and AdamW's
/// moments (4 f32 copies), and the (B, T, C) and (B, T, FF) tensors the backward holds: the
/// attention keeps only its output and the log-sum-exp (B, n_head, T), never the T × T scores.
/// Fitted to stage 2's measured CPU peaks (bf16 on an AVX512-BF16 CPU) like
/// `Shape::estimate_naive_train_bytes`, rounded up: at B=4 T=2048 C=768 n_head=12 FF=3072 it gives
/// 4.04 GiB against the 3.91 GiB recorded in results/train-memory/ (+3.5 %); at T=512, 1.09 GiB
/// against stage 2's 0.87 and stage 4's 1.18 GiB in results/ladder-cpu-train.json (+25 %, −8 %,
/// inside the fit check's 10 % headroom). Stage 3's fused backward holds less (0.33 GiB there).
/// At `te` it is 45 GiB; on an H100 stage 2 peaked at 42.75 GiB there
/// (results/h100-db5a7c9/train-te/train-te.json, −5 %).
pub fn estimate_fused_train_bytes(s: &Shape) -> TrainBytes {
    let (b, t, c, ff) = (s.batch as u128, s.seq as u128, s.d_model as u128, s.ff as u128);
    TrainBytes {
        params: 16 * (4 * c * c + 2 * c * ff + 9 * c + ff),
        scores: 0,
        activations: 4 * (FUSED_TRAIN_FF * b * t * ff + FUSED_TRAIN_C * b * t * c),
    }
}

/// (B, T, FF) and (B, T, C) f32 tensors a fused training step holds at its peak.
const FUSED_TRAIN_FF: u128 = 24;
const FUSED_TRAIN_C: u128 = 72;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cuda_refusals_name_the_fix() {
        let h100 = DeviceInfo::simulated_cuda("H100", (9, 0));
        let a100 = DeviceInfo::simulated_cuda("A100", (8, 0));
        let t4 = DeviceInfo::simulated_cuda("T4", (7, 5));
        let cpu = DeviceInfo { kind: shared::device::DeviceKind::Cpu, ..DeviceInfo::simulated_cuda("cpu", (0, 0)) };
        assert!(check_device(&cpu, Precision::Fp32).is_ok());
        // A CUDA GPU needs no flash-attn feature: ours runs when it is not built.
        assert!(check_device(&h100, Precision::Bf16).is_ok());
        assert!(check_device(&h100, Precision::F16).is_ok());
        for imp in [Implementation::SpeedkitCuda, Implementation::FlashAttn] {
            let who = if imp == Implementation::FlashAttn { "candle-flash-attn" } else { "kernels/flash_attn.cu" };
            assert!(check_cuda(imp, &[], &a100, Precision::Bf16).is_ok());
            let e = check_cuda(imp, &[], &t4, Precision::F16).unwrap_err().to_string();
            assert!(e.contains(who) && e.contains("SM 8.0+") && e.contains("SM 7.5") && e.contains("--device cpu"), "{e}");
            for p in [Precision::Fp32, Precision::Tf32] {
                let e = check_cuda(imp, &[], &h100, p).unwrap_err().to_string();
                assert!(e.contains(who) && e.contains(&format!("--precision {p}")) && e.contains("--precision bf16"), "{e}");
            }
        }
        // A cubin built for sm_90 does not run on an A100 (nor sm_80's on an H100): say so, and how to rebuild.
        let e = check_cuda(Implementation::SpeedkitCuda, &[90], &a100, Precision::Bf16).unwrap_err().to_string();
        assert!(e.contains("sm_90") && e.contains("CUDA_COMPUTE_CAP=80") && e.contains("--device cpu"), "{e}");
        assert!(!e.contains("  "), "one paragraph: {e}");
        assert!(check_cuda(Implementation::SpeedkitCuda, &[80], &h100, Precision::Bf16).is_err());
        assert!(check_cuda(Implementation::SpeedkitCuda, &[80, 90], &h100, Precision::Bf16).is_ok());
        assert!(check_cuda(Implementation::FlashAttn, &[90], &a100, Precision::Bf16).is_ok());
    }

    #[test]
    fn attention_kernel_flag_is_refused_where_it_cannot_apply() {
        // The CPU has one attention kernel: asking for v1 or v2 there is an error naming the fix.
        let cpu = candle_core::Device::Cpu;
        assert_eq!(for_run(&cpu, None).unwrap(), Implementation::Cpu);
        for k in [AttentionKernel::V1, AttentionKernel::V2] {
            let e = for_run(&cpu, Some(k)).unwrap_err().to_string();
            assert!(e.contains(&format!("--attention-kernel {}", k.name())) && e.contains("Fix:"), "{e}");
            assert!(!e.contains("  "), "one paragraph, no source indentation: {e}");
        }
    }
}
