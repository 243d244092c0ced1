//! Stage 2's rows of `ladder selftest`: the attention kernels alone, the forward against the CPU
//! kernel (on CUDA) or plain ops (on the CPU), the backward against candle's autograd through
//! plain ops.

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

/// The attention backward alone, as training runs it: dQ, dK and dV through `loss.backward()`
/// (the forward keeps each row's log-sum-exp, the op's `bwd` starts from it), on CUDA our kernel
/// (`kernels/flash_attn_bwd.cu`), on the CPU the tiled backward; both against the slow twin,
/// candle's autograd through the naive attention in f32 on the same 16-bit values.
pub fn attention_backward(r: &mut Rows, device: &Device) {
    use crate::attention::{attention_with, backward::grads_slow, Implementation};
    use candle_core::Var;
    r.ran = if device.is_cuda() { "cuda".into() } else { "cpu tiled backward (the .cu: host emulation, run.sh)".into() };
    // The v2 forward writes L on CUDA; the backward kernel is the same after either forward.
    let imp = if device.is_cuda() { Implementation::SpeedkitCuda } else { Implementation::Cpu };
    // T = 100 and 200: neither a multiple of the 64-row tiles, so the last query and key tiles
    // are partial; with causal, the diagonal tile is partial too.
    for dtype in [DType::BF16, DType::F16] {
        for (b, t, h, d) in [(2, 100, 2, 64), (1, 200, 2, 128)] {
            for causal in [false, true] {
                let res = (|| -> anyhow::Result<([Tensor; 3], [Tensor; 3])> {
                    let mk = |seed| -> anyhow::Result<Tensor> { Ok(randn(&[b, t, h, d], seed, 1.0, 0.0)?.to_dtype(dtype)?) };
                    let (q, k, v) = (mk(31)?, mk(32)?, mk(33)?);
                    let d_o = randn(&[b, t, h, d], 34, 1.0, 0.0)?; // f32: the loss's ⟨o, dO⟩ takes it as it is
                    let on = |x: &Tensor| -> anyhow::Result<Var> { Ok(Var::from_tensor(&x.to_device(device)?)?) };
                    let (qv, kv, vv) = (on(&q)?, on(&k)?, on(&v)?);
                    let o = attention_with(imp, qv.as_tensor(), kv.as_tensor(), vv.as_tensor(), causal)?;
                    let grads = (o.to_dtype(DType::F32)? * d_o.to_device(device)?)?.sum_all()?.backward()?;
                    let grad = |x: &Var| grads.get(x.as_tensor()).cloned().ok_or_else(|| anyhow::anyhow!("no gradient reached q, k or v"));
                    let got = [grad(&qv)?, grad(&kv)?, grad(&vv)?];
                    Ok((got, grads_slow(&q, &k, &v, &d_o, causal)?))
                })();
                // 16-bit gradients from a 16-bit O; on CUDA P and dS also rounded to 16 bits as
                // tensor-core operands (f32 accumulation throughout). The kernel's own rounding
                // under host emulation: ~2e-3 (bf16), ~2e-4 (f16) against f64; bf16's tolerance is
                // the training check's for bf16 gradients (`shared::train::grad_tolerance`), f16
                // has 3 more bits.
                let tol = if dtype == DType::BF16 { 2e-2 } else { 5e-3 };
                for (i, name) in ["dQ", "dK", "dV"].into_iter().enumerate() {
                    let case = format!("{name} {dtype:?} d_head={d} causal={causal} B={b} T={t} n_head={h}");
                    r.compare("attention backward", case, || match &res {
                        Ok((got, want)) => Ok((got[i].clone(), want[i].clone(), tol)),
                        Err(e) => Err(anyhow::anyhow!(shared::selftest::message(e))),
                    });
                }
            }
        }
    }
}
