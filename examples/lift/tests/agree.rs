//! The lifted model gives candle-nn's logits (within `TOLERANCE`) and gradients (within
//! `GRAD_TOLERANCE`) at shapes smaller than the binary's, each tolerance tight enough to catch a
//! real difference; with the MLP in FP8, logits within `FP8_TOLERANCE`.

use candle_core::{DType, Device, Tensor};
use candle_nn::VarBuilder;
use lift::{
    grad_errors, random_tokens, random_weights, relative_error, Config, Gpt, Ops, Trainable, FP8_TOLERANCE, GRAD_TOLERANCE, TOLERANCE,
};
use std::collections::HashMap;

fn load(cfg: &Config, weights: HashMap<String, Tensor>) -> Gpt {
    Gpt::load(cfg, VarBuilder::from_tensors(weights, DType::F32, &Device::Cpu)).unwrap()
}

fn logits(model: &Gpt, cfg: &Config, (b, t): (usize, usize), ops: Ops) -> Tensor {
    model.forward(&random_tokens(cfg, (b, t), 7, &Device::Cpu).unwrap(), ops).unwrap()
}

/// d_head 32 and 64 run stage 2's register-blocked kernel, d_head 24 its GEMM-tile kernel; T not a
/// multiple of any tile size covers the ragged edges and the causal diagonal's partial blocks.
#[test]
fn lifted_matches_candle_nn() {
    for (n_embd, n_head, t) in [(64, 2, 16), (128, 2, 37), (96, 4, 29)] {
        let cfg = Config { vocab: 50, block_size: t, n_layer: 2, n_head, n_embd, ln_eps: 1e-5 };
        let model = load(&cfg, random_weights(&cfg, 1, &Device::Cpu).unwrap());
        let (candle, lifted) = (logits(&model, &cfg, (2, t), Ops::Candle), logits(&model, &cfg, (2, t), Ops::Lifted));
        assert_eq!(lifted.dims(), [2, t, cfg.vocab]);
        let err = relative_error(&lifted, &candle).unwrap();
        assert!(err < TOLERANCE, "C={n_embd} n_head={n_head} T={t}: relative error {err:e}");
    }
}

/// A 10 % change in one bias (the first layer's fc1) moves the logits by ~1e-3 relative, past
/// the tolerance: the check is not vacuous.
#[test]
fn tolerance_catches_a_real_difference() {
    let cfg = Config { vocab: 50, block_size: 16, n_layer: 2, n_head: 2, n_embd: 64, ln_eps: 1e-5 };
    let weights = random_weights(&cfg, 1, &Device::Cpu).unwrap();
    let mut changed = weights.clone();
    let b = changed.get_mut("h.0.mlp.c_fc.bias").unwrap();
    *b = (&*b * 1.1).unwrap();
    let y = logits(&load(&cfg, weights), &cfg, (2, 16), Ops::Candle);
    let y_changed = logits(&load(&cfg, changed), &cfg, (2, 16), Ops::Lifted);
    let err = relative_error(&y_changed, &y).unwrap();
    assert!(err > TOLERANCE, "a 10 % bias change gave only {err:e}");
}

/// Stage 3's LayerNorm takes the model's ε: at ε = 0.1 (where GPT-2's 1e-5 would move the logits
/// by far more than the tolerance: the last assertion) the lifted model still gives candle-nn's.
#[test]
fn the_models_layer_norm_eps_is_used() {
    let cfg = |ln_eps| Config { vocab: 50, block_size: 16, n_layer: 1, n_head: 2, n_embd: 64, ln_eps };
    let model = |eps| load(&cfg(eps), random_weights(&cfg(eps), 1, &Device::Cpu).unwrap());
    let (wide, gpt2) = (model(0.1), model(1e-5));
    let candle = logits(&wide, &cfg(0.1), (2, 16), Ops::Candle);
    let err = relative_error(&logits(&wide, &cfg(0.1), (2, 16), Ops::Lifted), &candle).unwrap();
    assert!(err < TOLERANCE, "ε = 0.1: relative error {err:e}");
    let other = relative_error(&logits(&gpt2, &cfg(1e-5), (2, 16), Ops::Lifted), &candle).unwrap();
    assert!(other > TOLERANCE, "ε = 1e-5 against ε = 0.1 moved the logits by only {other:e}");
}

/// Stage 4's `Fp8Linear` in the MLP (emulated on the CPU): the logits within the FP8 tolerance
/// of candle-nn's fp32 ones, and not equal to the fp32 lifted ones (the E4M3 rounding happened).
#[test]
fn fp8_mlp_is_within_the_fp8_tolerance() {
    let cfg = Config { vocab: 50, block_size: 32, n_layer: 2, n_head: 2, n_embd: 64, ln_eps: 1e-5 };
    let mut model = load(&cfg, random_weights(&cfg, 1, &Device::Cpu).unwrap());
    assert!(model.forward(&random_tokens(&cfg, (2, 32), 7, &Device::Cpu).unwrap(), Ops::LiftedFp8).is_err(), "before quantize_mlp");
    model.quantize_mlp().unwrap();
    let candle = logits(&model, &cfg, (2, 32), Ops::Candle);
    for call in 0..3 {
        // the first call scales from its own amax; later ones from the history (delayed scaling)
        let err = relative_error(&logits(&model, &cfg, (2, 32), Ops::LiftedFp8), &candle).unwrap();
        assert!(err < FP8_TOLERANCE && err > TOLERANCE, "call {call}: relative error {err:e}");
    }
}

/// One training step: every parameter's gradient through the lifted ops agrees with candle-nn's
/// (`GRAD_TOLERANCE`), and a 10 % change in one bias moves some gradient past it.
#[test]
fn lifted_gradients_match_candle_nn() {
    let cfg = Config { vocab: 50, block_size: 29, n_layer: 2, n_head: 4, n_embd: 96, ln_eps: 1e-5 };
    let dev = Device::Cpu;
    let (idx, targets) = (random_tokens(&cfg, (2, 29), 7, &dev).unwrap(), random_tokens(&cfg, (2, 29), 8, &dev).unwrap());
    let weights = random_weights(&cfg, 1, &dev).unwrap();
    let grads = |w: HashMap<String, Tensor>, ops| {
        let train = Trainable::new(&cfg, w, &dev).unwrap();
        let (loss, store) = train.backward(&idx, &targets, ops).unwrap();
        assert!(loss.is_finite());
        train.grads(&store).unwrap()
    };
    let candle = grads(weights.clone(), Ops::Candle);
    assert_eq!(candle.len(), weights.len(), "a gradient for every parameter");
    let worst = |g: &[(String, Tensor)]| grad_errors(g, &candle).unwrap().into_iter().map(|(_, e)| e).fold(0f64, f64::max);
    let same = worst(&grads(weights.clone(), Ops::Lifted));
    assert!(same < GRAD_TOLERANCE, "worst gradient relative error {same:e}");
    let mut changed = weights;
    let b = changed.get_mut("h.0.mlp.c_fc.bias").unwrap();
    *b = (&*b * 1.1).unwrap();
    let other = worst(&grads(changed, Ops::Lifted));
    assert!(other > GRAD_TOLERANCE, "a 10 % bias change moved the gradients by only {other:e}");
}
