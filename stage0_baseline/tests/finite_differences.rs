//! Stage 0's autograd, the reference every stage's gradients are checked against, checked itself
//! against central finite differences in f64 on `tiny`. Stage 0's `Block` builds an f32 mask, so
//! the f64 block here is its `forward` again over stage 0's own primitives (`layer_norm`,
//! `linear`, `attention`, `gelu_tanh`) with an f64 mask; it is first checked equal to `Block`'s
//! forward, and its autograd equal to `Block`'s f32 autograd through `build_train`.

#[path = "support/train.rs"]
mod train;

use candle_core::{DType, Tensor, Var};
use shared::weights::SplitMix64;
use shared::{BlockWeights, Precision, Preset};
use stage0_baseline::{attention, causal_mask, gelu_tanh, layer_norm, linear, Baseline};

/// `Block::forward`'s dataflow over `w` (12 tensors in `BlockWeights` order) in their dtype.
fn block(w: &[Tensor], x: &Tensor, n_head: usize, mask: &Tensor) -> candle_core::Result<Tensor> {
    let [ln1_g, ln1_b, w_qkv, b_qkv, w_proj, b_proj, ln2_g, ln2_b, w_fc1, b_fc1, w_fc2, b_fc2] = w else {
        candle_core::bail!("12 weights")
    };
    let c = x.dim(2)?;
    let h = layer_norm(x, ln1_g, ln1_b)?;
    let part = |t: &Tensor, i: usize| t.narrow(0, i * c, c); // q, k, v rows of W_qkv, as `Block::build` splits them
    let q = linear(&h, &part(w_qkv, 0)?, &part(b_qkv, 0)?)?;
    let k = linear(&h, &part(w_qkv, 1)?, &part(b_qkv, 1)?)?;
    let v = linear(&h, &part(w_qkv, 2)?, &part(b_qkv, 2)?)?;
    let a = attention(&q, &k, &v, n_head, mask)?;
    let x = (x + linear(&a, w_proj, b_proj)?)?;
    let h = layer_norm(&x, ln2_g, ln2_b)?;
    let m = gelu_tanh(&linear(&h, w_fc1, b_fc1)?)?;
    x + linear(&m, w_fc2, b_fc2)?
}

fn tensors(w: &BlockWeights) -> Vec<Tensor> {
    [&w.ln1_g, &w.ln1_b, &w.w_qkv, &w.b_qkv, &w.w_proj, &w.b_proj, &w.ln2_g, &w.ln2_b, &w.w_fc1, &w.b_fc1, &w.w_fc2, &w.b_fc2]
        .map(|t| t.clone())
        .to_vec()
}

/// `t` with flat element `i` moved by `d` (f64).
fn nudged(t: &Tensor, i: usize, d: f64) -> Tensor {
    let mut v = t.flatten_all().unwrap().to_vec1::<f64>().unwrap();
    v[i] += d;
    Tensor::from_vec(v, t.shape(), t.device()).unwrap()
}

#[test]
fn stage_0_autograd_matches_central_differences_in_f64() {
    let shape = Preset::Tiny.shape();
    let pr = train::Problem::new();
    let f64s = |t: &Tensor| t.to_dtype(DType::F64).unwrap();
    let (w, x, r) = (tensors(&pr.w).iter().map(f64s).collect::<Vec<_>>(), f64s(pr.xv.as_tensor()), f64s(&pr.r));
    let mask = f64s(&causal_mask(shape.seq, x.device()).unwrap());
    let loss = |w: &[Tensor], x: &Tensor| (block(w, x, shape.n_head, &mask).unwrap() * &r).unwrap().sum_all().unwrap();

    // The f64 block is stage 0's: its forward and its f32 autograd (through `build_train`).
    let plan = train::train_plan(&Baseline, Precision::Fp32);
    let (y32, g32) = pr.backward(&Baseline, &plan, 1.0);
    let moved = train::rel_max(&block(&w, &x, shape.n_head, &mask).unwrap(), &y32);
    assert!(moved <= 1e-6, "the f64 block is not stage 0's forward: {moved}");
    let vars: Vec<Var> = w.iter().chain([&x]).map(|t| Var::from_tensor(t).unwrap()).collect();
    let ts: Vec<Tensor> = vars.iter().map(|v| v.as_tensor().clone()).collect();
    let g = loss(&ts[..12], &ts[12]).backward().unwrap();
    let ad: Vec<Tensor> = vars.iter().map(|v| g.get(v.as_tensor()).unwrap().clone()).collect();
    let mut worst32 = 0f32;
    for ((name, a64), a32) in train::NAMES.iter().zip(&ad).zip(pr.grads(&g32)) {
        let e = train::rel_max(&a32, a64);
        assert!(e <= 1e-5, "d{name}: stage 0's f32 autograd is {e} off its f64 autograd");
        worst32 = worst32.max(e);
    }

    // Central differences, h = 1e-5, at 24 coordinates of each tensor.
    let h = 1e-5;
    let mut rng = SplitMix64::new(0xfd);
    let mut worst = (0f64, "");
    for (ti, name) in train::NAMES.iter().enumerate() {
        let a = ad[ti].flatten_all().unwrap().to_vec1::<f64>().unwrap();
        let scale = a.iter().fold(0f64, |m, v| m.max(v.abs()));
        for _ in 0..24 {
            let i = (rng.next_u64() % a.len() as u64) as usize;
            let at = |d: f64| {
                let mut ts = w.clone();
                ts.push(x.clone());
                ts[ti] = nudged(&ts[ti], i, d);
                loss(&ts[..12], &ts[12]).to_scalar::<f64>().unwrap()
            };
            let fd = (at(h) - at(-h)) / (2.0 * h);
            let e = (fd - a[i]).abs() / scale; // relative to the tensor's largest gradient
            assert!(e <= 1e-6, "d{name}[{i}]: autograd {:e}, central difference {fd:e} ({e:.1e} of max |g| {scale:e})", a[i]);
            if e >= worst.0 {
                worst = (e, name);
            }
        }
    }
    eprintln!(
        "stage 0, tiny: f64 autograd vs central differences (h = {h:e}, 24 coordinates per tensor): worst {:.1e} of max |g| (d{}); \
         f32 autograd vs f64 autograd: worst max |Δ| / max |g| {worst32:.1e}",
        worst.0, worst.1
    );
}
