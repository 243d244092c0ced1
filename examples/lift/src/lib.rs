//! # A worked lift — this repo's techniques in a model that is not this repo's block
//!
//! **What it shows.** A small GPT-2-style decoder (token and position embeddings, two pre-LN
//! layers, a final LayerNorm and an LM head) written the way a candle user writes one:
//! `candle_nn::{Embedding, Linear, LayerNorm}` loaded through a `VarBuilder`. Its forward pass
//! takes an [`Ops`] switch; each of the six places a technique applies is one `match` with the
//! candle-nn line and the lifted line side by side. Nothing else in the model changes: the same
//! `Linear` and `LayerNorm` values feed both, the lifted ops only read their weights.
//!
//! **What is lifted.** Stage 2's fused attention (`stage2_sdpa::attention::attention`: no
//! (B, n_head, T, T) score matrix, q/k/v read in the projection's layout, no transposes) and
//! stage 3's fused ops (`stage3_fused::ops`: one-pass LayerNorm, bias / GELU / residual in the
//! GEMM's epilogue, residual add + LayerNorm in one pass). And stage 4's `Fp8Linear`
//! (`stage4_fp8::fp8`): the MLP's two linears with E4M3 weights and inputs (`Ops::LiftedFp8`,
//! after `Gpt::quantize_mlp`), emulated on the CPU, cuBLASLt's FP8 GEMMs on a GPU (SM 8.9+).
//!
//! **What it costs.** Nothing in accuracy at fp32: the same arithmetic summed in another order
//! (`TOLERANCE` below says how much that moves the logits). FP8 costs precision:
//! `FP8_TOLERANCE`.
//!
//! **Training.** The lifted ops carry their backward: `Trainable` loads the same weights as
//! `Var`s, and one step's gradients through the lifted ops are checked against candle-nn's
//! (`GRAD_TOLERANCE`) before an optimizer step is taken with them.
//!
//! **Run it.** `cargo run --release -p lift` (CPU; `--iters N` to time longer). On a GPU the ops
//! run on CUDA tensors in a build with the `cuda` feature (nvcc on PATH, `CUDA_COMPUTE_CAP` set);
//! this binary itself checks and times on the CPU.

use candle_core::backprop::GradStore;
use candle_core::{DType, Device, IndexOp, Module, Tensor, Var};
use candle_nn::{Embedding, LayerNorm, Linear, VarBuilder, VarMap};
use stage4_fp8::fp8::{Fp8Linear, Fp8Mode, ScalingConfig};
use std::collections::HashMap;

/// The largest relative error ||y_lifted − y_candle|| / ||y_candle|| of the logits we accept at
/// fp32. Both versions compute the same function; they differ only in summation order (GEMM
/// blocking, the online softmax's rescaling, LayerNorm statistics in f64 vs f32) and in GELU's
/// formula (v / (1 + e^(−2u)) vs 0.5·v·(1 + tanh u), equal in exact arithmetic). Each op then
/// moves its output by a few f32 ulps relative, ~1e-7..1e-6 after sums of C or FF = 4C terms, and
/// two layers and a head compound that to ~1e-7..1e-6. 1e-4 leaves two orders of magnitude of headroom
/// for other shapes and CPUs, yet any real mistake — a missing bias, a wrong scale, an unmasked
/// future token, a LayerNorm with another ε — moves the logits by 1e-3 or more (tests/agree.rs
/// checks that a 10 % change in one bias is caught).
pub const TOLERANCE: f64 = 1e-4;

/// The largest relative error of the logits with the MLP's linears in FP8 (`Ops::LiftedFp8`)
/// against candle-nn's fp32 ones: stage 4's tolerance for the block at fp8 (`shared::check`).
/// E4M3 keeps 3 mantissa bits, so each quantised value is off by up to 1/16 relative; summed
/// over a GEMM's K products the errors partly cancel, and at `Config::small` the logits moved by
/// about 1e-2 (CPU, emulated).
pub const FP8_TOLERANCE: f64 = 8e-2;

/// The largest relative error ||g_lifted − g_candle|| / ||g_candle|| of any parameter's gradient
/// in one training step (`Trainable::grads`). The backward passes sum in other orders too, and
/// the gradient of the first layer's weights has passed through every op above them, so the
/// bound is the forward's, with the same headroom: ≤ 7e-7 measured at `Config::small` on the CPU,
/// while a 10 % change in one bias moves some gradient by far more (tests/agree.rs checks it is
/// caught), as would a backward that drops a term.
pub const GRAD_TOLERANCE: f64 = 1e-4;

/// The model's shape. GPT-2's names: vocab, block size (the longest T), n_layer, n_head, C.
#[derive(Clone, Copy, Debug)]
pub struct Config {
    pub vocab: usize,
    pub block_size: usize,
    pub n_layer: usize,
    pub n_head: usize,
    pub n_embd: usize, // C
    pub ln_eps: f64,
}

impl Config {
    /// Small enough to run in seconds on two CPU cores: C = 256, d_head = 64, FF = 1024.
    pub fn small() -> Config {
        Config { vocab: 1000, block_size: 128, n_layer: 2, n_head: 4, n_embd: 256, ln_eps: 1e-5 }
    }
}

/// Which ops the forward pass runs: candle-nn's own (the "before"), the lifted techniques, or
/// those with the MLP's linears in FP8 (stage 4's `Fp8Linear`; needs `Gpt::quantize_mlp`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Ops {
    Candle,
    Lifted,
    LiftedFp8,
}

/// The six places a technique applies. Each arm pair is what a user changes in their model.
/// Shapes: x, r, branch (B, T, C) f32; q, k, v (B, T, n_head, d_head).
impl Ops {
    pub fn layer_norm(self, x: &Tensor, ln: &LayerNorm) -> candle_core::Result<Tensor> {
        match self {
            Ops::Candle => candle_layer_norm(x, ln),
            Ops::Lifted | Ops::LiftedFp8 => stage3_fused::ops::layer_norm(x, ln.weight(), ln_bias(ln)?, ln.eps() as f32, DType::F32), // one pass per row
        }
    }

    /// y = x Wᵀ + b.
    pub fn linear(self, x: &Tensor, l: &Linear) -> candle_core::Result<Tensor> {
        match self {
            Ops::Candle => l.forward(x),
            Ops::Lifted | Ops::LiftedFp8 => stage3_fused::ops::linear_bias(x, l.weight(), bias(l)?), // bias in the GEMM
        }
    }

    /// y = gelu_tanh(x Wᵀ + b).
    pub fn linear_gelu(self, x: &Tensor, l: &Linear) -> candle_core::Result<Tensor> {
        match self {
            Ops::Candle => l.forward(x)?.gelu(),
            Ops::Lifted | Ops::LiftedFp8 => stage3_fused::ops::linear_bias_gelu(x, l.weight(), bias(l)?), // bias + GELU after each block of rows
        }
    }

    /// y = r + x Wᵀ + b (r: the residual stream).
    pub fn linear_residual(self, x: &Tensor, l: &Linear, r: &Tensor) -> candle_core::Result<Tensor> {
        match self {
            Ops::Candle => r + l.forward(x)?,
            Ops::Lifted | Ops::LiftedFp8 => stage3_fused::ops::linear_bias_residual(x, l.weight(), bias(l)?, r), // GEMM accumulates onto r + b
        }
    }

    /// (x + branch, LayerNorm of it): the new residual stream and the next sublayer's input.
    pub fn add_layer_norm(self, x: &Tensor, branch: &Tensor, ln: &LayerNorm) -> candle_core::Result<(Tensor, Tensor)> {
        match self {
            Ops::Candle => {
                let x = (x + branch)?;
                let h = candle_layer_norm(&x, ln)?;
                Ok((x, h))
            }
            Ops::Lifted | Ops::LiftedFp8 => stage3_fused::ops::add_layer_norm(x, branch, ln.weight(), ln_bias(ln)?, ln.eps() as f32), // one pass per row
        }
    }

    /// softmax(q kᵀ / √d_head + causal mask) v → (B, T, n_head, d_head).
    pub fn causal_attention(self, q: &Tensor, k: &Tensor, v: &Tensor) -> candle_core::Result<Tensor> {
        match self {
            Ops::Candle => candle_attention(q, k, v),
            Ops::Lifted | Ops::LiftedFp8 => stage2_sdpa::attention::attention(q, k, v, true), // no (B, n_head, T, T) tensor
        }
    }
}

/// Attention as candle users write it: heads to the front, the (B, n_head, T, T) scores
/// materialised, masked, softmaxed, then heads back. q, k, v: (B, T, n_head, d_head) views.
pub fn candle_attention(q: &Tensor, k: &Tensor, v: &Tensor) -> candle_core::Result<Tensor> {
    let (_, t, _, d_head) = q.dims4()?;
    let heads = |x: &Tensor| x.transpose(1, 2)?.contiguous(); // (B, n_head, T, d_head)
    let (q, k, v) = (heads(q)?, heads(k)?, heads(v)?);
    let scores = (q.matmul(&k.t()?)? / (d_head as f64).sqrt())?; // (B, n_head, T, T)
    let scores = scores.broadcast_add(&causal_mask(t, q.device())?)?;
    let p = match scores.track_op() {
        false => candle_nn::ops::softmax_last_dim(&scores)?,               // one fused op
        true => candle_nn::ops::softmax(&scores, candle_core::D::Minus1)?, // training: the fused op has no backward in candle-nn 0.11
    };
    p.matmul(&v)?.transpose(1, 2)?.contiguous() // (B, T, n_head, d_head)
}

/// (T, T): 0 where key j ≤ query i, −∞ above the diagonal (exp(−∞) = 0 in the softmax).
fn causal_mask(t: usize, device: &Device) -> candle_core::Result<Tensor> {
    let mask: Vec<f32> = (0..t * t).map(|ij| if ij % t > ij / t { f32::NEG_INFINITY } else { 0.0 }).collect();
    Tensor::from_vec(mask, (t, t), device)
}

/// candle-nn's LayerNorm: its module's `forward` (one fused op) for inference. In training, its
/// primitive-op version: candle-nn 0.11's fused LayerNorm op has no backward (`apply_op3_no_bwd`),
/// so no gradient would reach anything below it.
fn candle_layer_norm(x: &Tensor, ln: &LayerNorm) -> candle_core::Result<Tensor> {
    match x.track_op() || ln.weight().track_op() {
        false => ln.forward(x),
        true => candle_nn::ops::layer_norm_slow(x, ln.weight(), ln_bias(ln)?, ln.eps() as f32),
    }
}

/// The fused ops take the bias explicitly; a `Linear` built without one has none to give.
fn bias(l: &Linear) -> candle_core::Result<&Tensor> {
    l.bias().ok_or_else(|| {
        candle_core::Error::Msg(
            "lifted linear: this Linear has no bias, and the fused epilogues add one. Fix: keep it on candle-nn's `forward`.".into(),
        )
    })
}

/// Stage 3's LayerNorm takes a bias (its ε comes from the `LayerNorm` itself: `ln.eps()`).
fn ln_bias(ln: &LayerNorm) -> candle_core::Result<&Tensor> {
    ln.bias()
        .ok_or_else(|| candle_core::Error::Msg("lifted LayerNorm: this LayerNorm has no bias (RMSNorm-style); stage 3's takes one.".into()))
}

/// One pre-LN decoder layer, GPT-2's names.
pub struct Layer {
    ln_1: LayerNorm,
    c_attn: Linear, // (3C, C): q, k, v stacked
    attn_proj: Linear,
    ln_2: LayerNorm,
    c_fc: Linear, // (4C, C)
    mlp_proj: Linear,
    fp8_mlp: Option<(Fp8Linear, Fp8Linear)>, // c_fc (GELU in its epilogue) and mlp_proj in E4M3, once quantised
}

impl Layer {
    fn load(cfg: &Config, vb: VarBuilder) -> candle_core::Result<Layer> {
        let (c, eps) = (cfg.n_embd, cfg.ln_eps);
        Ok(Layer {
            ln_1: candle_nn::layer_norm(c, eps, vb.pp("ln_1"))?,
            c_attn: candle_nn::linear(c, 3 * c, vb.pp("attn.c_attn"))?,
            attn_proj: candle_nn::linear(c, c, vb.pp("attn.c_proj"))?,
            ln_2: candle_nn::layer_norm(c, eps, vb.pp("ln_2"))?,
            c_fc: candle_nn::linear(c, 4 * c, vb.pp("mlp.c_fc"))?,
            mlp_proj: candle_nn::linear(4 * c, c, vb.pp("mlp.c_proj"))?,
            fp8_mlp: None,
        })
    }

    /// x: (B, T, C) f32 → (B, T, C): x += attn(ln_1(x)); x += mlp(ln_2(x)).
    fn forward(&self, x: &Tensor, n_head: usize, ops: Ops) -> candle_core::Result<Tensor> {
        let (b, t, c) = x.dims3()?;
        let h = ops.layer_norm(x, &self.ln_1)?; // (B, T, C)
        let qkv = ops.linear(&h, &self.c_attn)?.reshape((b, t, 3, n_head, c / n_head))?; // (B, T, 3, n_head, d_head), no copy
        let (q, k, v) = (qkv.i((.., .., 0))?, qkv.i((.., .., 1))?, qkv.i((.., .., 2))?); // (B, T, n_head, d_head) views
        let a = ops.causal_attention(&q, &k, &v)?.reshape((b, t, c))?; // (B, T, C)
        let (x, h) = ops.add_layer_norm(x, &ops.linear(&a, &self.attn_proj)?, &self.ln_2)?; // x += proj; h = ln_2(x)
        if ops == Ops::LiftedFp8 {
            let (c_fc, mlp_proj) = self.fp8_mlp.as_ref().ok_or_else(|| {
                candle_core::Error::Msg("Ops::LiftedFp8: the MLP has no FP8 linears yet. Fix: call Gpt::quantize_mlp first.".into())
            })?;
            return mlp_proj.forward_residual(&c_fc.forward(&h)?, &x); // x + mlp, both GEMMs on E4M3 operands
        }
        let m = ops.linear_gelu(&h, &self.c_fc)?; // (B, T, 4C)
        ops.linear_residual(&m, &self.mlp_proj, &x) // x + mlp
    }
}

/// The whole model.
pub struct Gpt {
    wte: Embedding, // (vocab, C)
    wpe: Embedding, // (block_size, C)
    h: Vec<Layer>,
    ln_f: LayerNorm,
    lm_head: Linear, // (vocab, C), no bias, as in GPT-2
    n_head: usize,
}

impl Gpt {
    /// Loads the weights by GPT-2's names: from `random_weights` here, from a checkpoint with
    /// `VarBuilder::from_mmaped_safetensors` in a real model.
    pub fn load(cfg: &Config, vb: VarBuilder) -> candle_core::Result<Gpt> {
        Ok(Gpt {
            wte: candle_nn::embedding(cfg.vocab, cfg.n_embd, vb.pp("wte"))?,
            wpe: candle_nn::embedding(cfg.block_size, cfg.n_embd, vb.pp("wpe"))?,
            h: (0..cfg.n_layer).map(|i| Layer::load(cfg, vb.pp(format!("h.{i}")))).collect::<candle_core::Result<_>>()?,
            ln_f: candle_nn::layer_norm(cfg.n_embd, cfg.ln_eps, vb.pp("ln_f"))?,
            lm_head: candle_nn::linear_no_bias(cfg.n_embd, cfg.vocab, vb.pp("lm_head"))?,
            n_head: cfg.n_head,
        })
    }

    /// Quantise every layer's MLP linears to E4M3 (stage 4's `Fp8Linear`, W once, with current
    /// scaling), for `Ops::LiftedFp8`. The `Linear`s stay, so the other `Ops` still run.
    pub fn quantize_mlp(&mut self) -> Result<(), stage4_fp8::fp8::Fp8Error> {
        for (i, layer) in self.h.iter_mut().enumerate() {
            let c_fc = fp8_linear(&layer.c_fc, true, &format!("h.{i}.mlp.c_fc"))?;
            let mlp_proj = fp8_linear(&layer.mlp_proj, false, &format!("h.{i}.mlp.c_proj"))?;
            layer.fp8_mlp = Some((c_fc, mlp_proj));
        }
        Ok(())
    }

    /// idx: (B, T) u32 token ids → logits (B, T, vocab) f32.
    pub fn forward(&self, idx: &Tensor, ops: Ops) -> candle_core::Result<Tensor> {
        let (_, t) = idx.dims2()?;
        let pos = Tensor::arange(0u32, t as u32, idx.device())?;
        let mut x = self.wte.forward(idx)?.broadcast_add(&self.wpe.forward(&pos)?)?; // (B, T, C)
        for layer in &self.h {
            x = layer.forward(&x, self.n_head, ops)?;
        }
        let h = ops.layer_norm(&x, &self.ln_f)?;
        self.lm_head.forward(&h) // (B, T, vocab): no bias to fuse, candle's matmul in both versions
    }
}

/// A candle-nn `Linear` as stage 4's `Fp8Linear`: y = act(x Wᵀ + b) with W quantised to E4M3
/// once and x on every call, with delayed scaling (the scale from the amax of the last 16 calls).
/// On the CPU emulated (quantise, dequantise, an f32 GEMM: FP8's numerics, not its speed), the
/// output kept in f32; on CUDA cuBLASLt's E4M3 GEMM (SM 8.9+, bf16 out; compiled, not yet run on a
/// GPU in this example).
pub fn fp8_linear(l: &Linear, gelu: bool, name: &str) -> Result<Fp8Linear, stage4_fp8::fp8::Fp8Error> {
    let (w, b, scaling) = (l.weight(), bias(l)?, ScalingConfig::default());
    match w.device().is_cuda() {
        false => Fp8Linear::with_output(w, b, gelu, Fp8Mode::Emulated, scaling, name, DType::F32),
        true => Fp8Linear::new(w, b, gelu, Fp8Mode::Cublaslt, scaling, name),
    }
}

/// The model with its weights as `Var`s (a `VarMap`), for a training step through either `Ops`.
pub struct Trainable {
    pub varmap: VarMap,
    pub model: Gpt,
}

impl Trainable {
    /// `weights` (`random_weights`, or a checkpoint's tensors) become the `VarMap`'s variables.
    pub fn new(cfg: &Config, weights: HashMap<String, Tensor>, device: &Device) -> candle_core::Result<Trainable> {
        let varmap = VarMap::new();
        {
            let mut vars = varmap.data().lock().map_err(|_| candle_core::Error::Msg("VarMap lock poisoned".into()))?;
            for (name, t) in weights {
                vars.insert(name, Var::from_tensor(&t)?);
            }
        }
        let model = Gpt::load(cfg, VarBuilder::from_varmap(&varmap, DType::F32, device))?;
        Ok(Trainable { varmap, model })
    }

    /// Next-token cross-entropy of the logits for `idx` (B, T) against `targets` (B, T) u32.
    pub fn loss(&self, idx: &Tensor, targets: &Tensor, ops: Ops) -> candle_core::Result<Tensor> {
        let logits = self.model.forward(idx, ops)?; // (B, T, vocab)
        let (b, t, v) = logits.dims3()?;
        candle_nn::loss::cross_entropy(&logits.reshape((b * t, v))?, &targets.reshape(b * t)?)
    }

    /// The loss through `ops` and its gradients (candle's `backward`), for an optimizer's `step`.
    pub fn backward(&self, idx: &Tensor, targets: &Tensor, ops: Ops) -> candle_core::Result<(f32, GradStore)> {
        let loss = self.loss(idx, targets, ops)?;
        Ok((loss.to_scalar::<f32>()?, loss.backward()?))
    }

    /// Every parameter's gradient in `store`, by name, sorted.
    pub fn grads(&self, store: &GradStore) -> candle_core::Result<Vec<(String, Tensor)>> {
        let vars = self.varmap.data().lock().map_err(|_| candle_core::Error::Msg("VarMap lock poisoned".into()))?;
        let mut grads = Vec::with_capacity(vars.len());
        for (name, var) in vars.iter() {
            let g = store.get(var).ok_or_else(|| candle_core::Error::Msg(format!("no gradient reached {name}")))?;
            grads.push((name.clone(), g.clone()));
        }
        grads.sort_by(|a, b| a.0.cmp(&b.0));
        Ok(grads)
    }
}

/// Per parameter, ||g − g_ref|| / ||g_ref||; both lists by name, as `Trainable::grads` returns them.
pub fn grad_errors(g: &[(String, Tensor)], g_ref: &[(String, Tensor)]) -> candle_core::Result<Vec<(String, f64)>> {
    if g.len() != g_ref.len() || g.iter().zip(g_ref).any(|(a, b)| a.0 != b.0) {
        candle_core::bail!("grad_errors: the two gradient lists name different parameters");
    }
    g.iter().zip(g_ref).map(|((name, a), (_, b))| Ok((name.clone(), relative_error(a, b)?))).collect()
}

/// A deterministic generator (splitmix64): candle's CPU `Tensor::randn` cannot be seeded.
pub struct SplitMix(pub u64);

impl SplitMix {
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in [−a, a).
    pub fn uniform(&mut self, a: f32) -> f32 {
        let u = (self.next_u64() >> 40) as f32 / (1u64 << 24) as f32; // [0, 1), 24 bits
        (2.0 * u - 1.0) * a
    }

    /// A tensor of `shape` with values uniform in [−a, a), plus `offset`.
    pub fn tensor(&mut self, shape: &[usize], a: f32, offset: f32, device: &Device) -> candle_core::Result<Tensor> {
        let n = shape.iter().product();
        Tensor::from_vec((0..n).map(|_| offset + self.uniform(a)).collect::<Vec<f32>>(), shape, device)
    }
}

/// Random weights under GPT-2's names, reproducible from `seed`. Linears as PyTorch initialises
/// them (uniform ±1/√fan_in, so activations stay O(1)); embeddings with unit variance;
/// LayerNorm gains 1 ± 0.1 and biases ± 0.1, so a swapped or dropped g or b shows in the logits.
pub fn random_weights(cfg: &Config, seed: u64, device: &Device) -> candle_core::Result<HashMap<String, Tensor>> {
    let (c, mut rng, mut w) = (cfg.n_embd, SplitMix(seed), HashMap::new());
    let mut put = |name: String, shape: &[usize], a: f32, offset: f32| -> candle_core::Result<()> {
        w.insert(name, rng.tensor(shape, a, offset, device)?);
        Ok(())
    };
    put("wte.weight".into(), &[cfg.vocab, c], 3f32.sqrt(), 0.0)?;
    put("wpe.weight".into(), &[cfg.block_size, c], 3f32.sqrt(), 0.0)?;
    let mut lns: Vec<String> = (0..cfg.n_layer).flat_map(|i| [format!("h.{i}.ln_1"), format!("h.{i}.ln_2")]).collect();
    lns.push("ln_f".into());
    for p in lns {
        put(format!("{p}.weight"), &[c], 0.1, 1.0)?;
        put(format!("{p}.bias"), &[c], 0.1, 0.0)?;
    }
    for i in 0..cfg.n_layer {
        for (name, n, k) in [("attn.c_attn", 3 * c, c), ("attn.c_proj", c, c), ("mlp.c_fc", 4 * c, c), ("mlp.c_proj", c, 4 * c)] {
            let a = 1.0 / (k as f32).sqrt(); // (N, K) = (out, in), as candle_nn::Linear stores W
            put(format!("h.{i}.{name}.weight"), &[n, k], a, 0.0)?;
            put(format!("h.{i}.{name}.bias"), &[n], a, 0.0)?;
        }
    }
    put("lm_head.weight".into(), &[cfg.vocab, c], 1.0 / (c as f32).sqrt(), 0.0)?;
    Ok(w)
}

/// (B, T) token ids uniform in [0, vocab), reproducible from `seed`.
pub fn random_tokens(cfg: &Config, (b, t): (usize, usize), seed: u64, device: &Device) -> candle_core::Result<Tensor> {
    let mut rng = SplitMix(seed);
    Tensor::from_vec((0..b * t).map(|_| (rng.next_u64() % cfg.vocab as u64) as u32).collect::<Vec<u32>>(), (b, t), device)
}

/// ||y − y_ref|| / ||y_ref|| (Frobenius norms, summed in f64).
pub fn relative_error(y: &Tensor, y_ref: &Tensor) -> candle_core::Result<f64> {
    let (y, r) = (y.flatten_all()?.to_vec1::<f32>()?, y_ref.flatten_all()?.to_vec1::<f32>()?);
    if y.len() != r.len() {
        candle_core::bail!("relative_error: {} values vs {}", y.len(), r.len());
    }
    let (diff, norm) = y.iter().zip(&r).fold((0f64, 0f64), |(d, n), (&a, &b)| (d + (a as f64 - b as f64).powi(2), n + (b as f64).powi(2)));
    Ok((diff / norm).sqrt())
}
