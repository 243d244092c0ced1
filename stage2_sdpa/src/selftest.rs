//! Stage 2's rows of `ladder selftest`: the attention kernels alone, against the CPU kernel
//! (on CUDA) or plain ops (on the CPU).

use candle_core::{DType, Device, Tensor};
use shared::selftest::{randn, Rows};

/// Plain-ops attention in f32: softmax(q kᵀ/√d + mask) v over (B, T, n_head, d_head).
fn attention_twin(q: &Tensor, k: &Tensor, v: &Tensor, causal: bool) -> candle_core::Result<Tensor> {
    let f = |x: &Tensor| x.to_device(&Device::Cpu)?.to_dtype(DType::F32)?.transpose(1, 2)?.contiguous(); // (B, n_head, T, d_head)
    let (q, k, v) = (f(q)?, f(k)?, f(v)?);
    let (t, d) = (q.dim(2)?, q.dim(3)?);
    let s = (q.matmul(&k.t()?)? / (d as f64).sqrt())?; // (B, n_head, T, T)
    let s = if causal { s.broadcast_add(&stage0_baseline::causal_mask(t, &Device::Cpu)?)? } else { s };
    stage0_baseline::softmax(&s)?.matmul(&v)?.transpose(1, 2)?.contiguous() // (B, T, n_head, d_head)
}

pub fn attention(r: &mut Rows, device: &Device) {
    use crate::attention::{attention_with, Implementation};
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
