//! The lifted model gives candle-nn's logits (within `TOLERANCE`) at shapes smaller than the
//! binary's, and the tolerance is tight enough to catch a real difference.

use candle_core::{DType, Device, Tensor};
use candle_nn::VarBuilder;
use lift::{random_tokens, random_weights, relative_error, Config, Gpt, Ops, TOLERANCE};
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
