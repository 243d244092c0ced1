//! Unit tests of `shared/src/ran.rs`, compiled into that module (`#[path]`).

use super::*;
use crate::breakdown::{enter, part};
use candle_core::{Device, Tensor};

/// A forward of two parts: what it takes in and names is what `observe` hands back.
#[test]
fn observe_records_each_parts_input_dtypes_and_kernels() {
    let x = Tensor::zeros((2, 3), DType::F32, &Device::Cpu).unwrap();
    let h = x.to_dtype(DType::BF16).unwrap();
    let forward = || -> Result<Tensor> {
        cpu_kernels::trace::ran("cast: before any part");
        let [x] = enter("ln1", [&x])?;
        cpu_kernels::trace::ran("layer_norm: engine pass");
        let [h] = enter("qkv", [&h])?;
        cpu_kernels::trace::ran("gemm bf16: avx512-bf16");
        cpu_kernels::trace::ran("gemm bf16: avx512-bf16");
        part("attention")?;
        cpu_kernels::trace::ran("attention: register-blocked, bf16 pairs (avx512-bf16)");
        x.add(&h.to_dtype(DType::F32)?)
    };
    let (_, parts) = observe(forward).unwrap();
    let got: Vec<(&str, &[DType], &[String])> = parts.iter().map(|p| (p.name.as_str(), &p.inputs[..], &p.kernels[..])).collect();
    assert_eq!(got.len(), 4, "{got:?}");
    assert_eq!(got[0], ("forward", &[][..], &["cast: before any part".to_string()][..]));
    assert_eq!(got[1], ("ln1", &[DType::F32][..], &["layer_norm: engine pass".to_string()][..]));
    assert_eq!(got[2], ("qkv", &[DType::BF16][..], &["gemm bf16: avx512-bf16 ×2".to_string()][..]));
    assert_eq!(got[3].0, "attention");
    // Off again: a forward outside `observe` records nothing, and `part` stays a no-op.
    assert!(!cpu_kernels::trace::recording());
    part("ln1").unwrap();
    assert!(OBSERVED.with(|o| o.borrow().is_none()));
}

#[test]
fn the_notes_name_the_activations_the_gemms_and_the_attention_that_ran() {
    let part = |name: &str, inputs: &[DType], kernels: &[&str]| RanPart {
        name: name.into(),
        inputs: inputs.to_vec(),
        kernels: kernels.iter().map(|k| k.to_string()).collect(),
    };
    let parts = [
        part("ln1", &[DType::F32], &["layer_norm: engine pass (AVX-512)", "cast: engine pass (AVX-512)"]),
        part("qkv", &[DType::BF16], &["gemm bf16: avx512-bf16, prepacked W ×3", "add: engine pass (AVX-512) ×3"]),
        part("attention", &[DType::BF16], &["attention: register-blocked, bf16 pairs (avx512-bf16)"]),
        part("fc1+gelu", &[DType::BF16], &["gemm bf16: avx512-bf16, prepacked W", "gelu: engine pass (AVX-512)"]),
    ];
    let notes = notes(&parts);
    assert_eq!(
        notes,
        [
            "ran: activations f32 into ln1; bf16 into qkv, attention, fc1+gelu",
            "ran: GEMMs by kernel: gemm bf16: avx512-bf16, prepacked W (qkv, fc1+gelu)",
            "ran: attention kernel register-blocked, bf16 pairs (avx512-bf16)",
        ]
    );
    assert!(super::notes(&[]).is_empty(), "nothing observed (a CUDA graph's replay): no note");
}
