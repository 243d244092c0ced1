//! The multi-tensor AdamW's launch table (`adamw::chunks`) and its kernel's constants, on any
//! machine; with the `cuda` feature, the fused AdamW on a GPU against candle-nn's.

use stage3_fused::adamw::{chunks, CHUNK};

#[test]
fn every_element_is_in_exactly_one_chunk() {
    let lens = [1i64, CHUNK as i64, CHUNK as i64 + 1, 0, 3 * CHUNK as i64 + 77, 768];
    let (owners, starts) = chunks(&lens);
    assert_eq!(owners.len(), starts.len());
    for (t, &n) in lens.iter().enumerate() {
        let mine: Vec<i64> = owners.iter().zip(&starts).filter(|(o, _)| **o as usize == t).map(|(_, s)| *s).collect();
        // Chunk starts 0, CHUNK, 2·CHUNK, ... below n: together they cover 0..n once.
        assert_eq!(mine, (0..n).step_by(CHUNK).collect::<Vec<_>>(), "tensor {t} of {n}");
    }
    assert_eq!(owners.len(), 9, "1, 1, 2, none, 4 and 1 chunks");
    assert!(owners.windows(2).all(|w| w[0] <= w[1]), "tensor order");
}

#[test]
fn the_kernel_uses_the_same_chunk_and_step_layout() {
    let src = include_str!("../kernels/adamw.cu");
    assert!(src.contains(&format!("constexpr long long CHUNK = {} * 1024;", CHUNK / 1024)));
    // `adamw::Coefs` is #[repr(C)] with these seven f32 fields in this order.
    assert!(src.contains("float lr, decay, beta1, beta2, scale_m, scale_v, eps;"));
}

#[cfg(feature = "cuda")]
#[test]
fn fused_adamw_on_cuda_matches_candle_nn() {
    use candle_core::{backprop::GradStore, Device, Tensor, Var};
    use candle_nn::Optimizer;
    use stage3_fused::adamw::{AdamW, ParamsAdamW};
    let dev = Device::new_cuda(0).expect("needs an NVIDIA GPU");
    let shapes: [&[usize]; 4] = [&[1], &[768], &[3 * 768, 768], &[CHUNK + 5]];
    let init: Vec<Tensor> = shapes.iter().map(|s| Tensor::randn(0f32, 1.0, *s, &dev).unwrap()).collect();
    let ours: Vec<Var> = init.iter().map(|t| Var::from_tensor(&t.copy().unwrap()).unwrap()).collect();
    let theirs: Vec<Var> = init.iter().map(|t| Var::from_tensor(&t.copy().unwrap()).unwrap()).collect();
    let p = ParamsAdamW::default();
    let mut a = AdamW::new(ours.clone(), p).unwrap();
    let cp = candle_nn::ParamsAdamW { lr: p.lr, beta1: p.beta1, beta2: p.beta2, eps: p.eps, weight_decay: p.weight_decay };
    let mut b = candle_nn::AdamW::new(theirs.clone(), cp).unwrap();
    for step in 0..3 {
        let (mut ga, mut gb) = (GradStore::default(), GradStore::default());
        for (i, s) in shapes.iter().enumerate() {
            let g = Tensor::randn(0f32, 1.0, *s, &dev).unwrap();
            ga.insert(ours[i].as_tensor(), g.clone());
            gb.insert(theirs[i].as_tensor(), g);
        }
        a.step(&ga).unwrap();
        b.step(&gb).unwrap();
        for (x, y) in ours.iter().zip(&theirs) {
            let d = (x.as_tensor() - y.as_tensor()).unwrap().abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap();
            assert!(d < 1e-6, "step {step}: max |Δθ| {d}");
        }
    }
}
