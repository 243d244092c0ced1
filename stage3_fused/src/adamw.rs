//! A fused AdamW: each parameter's update is one pass that reads θ, g, m and v and writes θ, m
//! and v (28 bytes per f32 parameter), where `candle_nn::AdamW` runs about a dozen tensor ops per
//! parameter, each a pass over memory with a tensor allocated for its result. On CUDA every
//! parameter goes in one launch (`kernels/adamw.cu`, multi-tensor: a table of the tensors and of
//! the chunks the blocks walk).
//!
//! The same hyper-parameters, defaults and bias correction as `candle_nn::AdamW` (decoupled
//! weight decay, Loshchilov & Hutter 2019), at step t:
//!
//! ```text
//! m = β1·m + (1 − β1)·g              v = β2·v + (1 − β2)·g²
//! m̂ = m / (1 − β1ᵗ)                  v̂ = v / (1 − β2ᵗ)
//! θ = θ·(1 − lr·λ) − lr · m̂ / (√v̂ + ε)
//! ```
//!
//! All parameters in one `step` call. On the CPU each parameter's pass runs on all threads in
//! chunks, in place on the `Var`'s own storage (a candle in-place op), m and v held here as plain
//! f32 buffers; on CUDA m and v are f32 tensors beside the parameters. f32 parameters only.

use candle_core::backprop::GradStore;
use candle_core::{CpuStorage, DType, InplaceOp2, Layout, Tensor, Var};
use rayon::prelude::*;
use std::sync::Mutex;

/// Elements per rayon task (and per CUDA chunk, `CHUNK` in kernels/adamw.cu): 16 Ki f32 = 64 KiB
/// of each of θ, g, m, v, enough work (~10 µs on a core) to amortise a task; a bias or a LayerNorm
/// gain (C values) is one task.
pub const CHUNK: usize = 16 * 1024;

/// The CUDA launch's chunk list for tensors of `lens` elements: (tensor, first element) of every
/// CHUNK-sized piece, in tensor order.
pub fn chunks(lens: &[i64]) -> (Vec<i32>, Vec<i64>) {
    let pieces = lens.iter().enumerate().flat_map(|(i, &n)| (0..n).step_by(CHUNK).map(move |s| (i as i32, s)));
    pieces.unzip()
}

/// AdamW's hyper-parameters, with `candle_nn::ParamsAdamW`'s names and defaults.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ParamsAdamW {
    pub lr: f64,
    pub beta1: f64,
    pub beta2: f64,
    pub eps: f64,
    pub weight_decay: f64,
}

impl Default for ParamsAdamW {
    fn default() -> Self {
        ParamsAdamW { lr: 0.001, beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay: 0.01 }
    }
}

/// The optimizer: the parameters, their first and second moments, the step count.
pub struct AdamW {
    vars: Vec<Var>,
    moments: Moments,
    step_t: usize,
    params: ParamsAdamW,
}

/// First and second moments, one per parameter, its element count.
enum Moments {
    Cpu(Vec<Vec<f32>>, Vec<Vec<f32>>),
    /// On the parameters' CUDA device.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    Cuda(Vec<Tensor>, Vec<Tensor>),
}

impl AdamW {
    /// An optimizer over `vars`, f32, all on the CPU or all on one CUDA device; m = v = 0.
    pub fn new(vars: Vec<Var>, params: ParamsAdamW) -> candle_core::Result<Self> {
        let cuda = vars.first().is_some_and(|v| v.device().is_cuda());
        for var in &vars {
            if var.dtype() != DType::F32 || !var.device().same_device(vars[0].device()) || !(cuda || var.device().is_cpu()) {
                candle_core::bail!(
                    "fused AdamW updates f32 parameters all on the CPU or all on one CUDA device, got {:?} on {:?}. \
                     Fix: keep f32 master weights on one device (cast to the GEMM dtype in the forward), or use \
                     candle_nn::AdamW for other dtypes",
                    var.dtype(),
                    var.device().location()
                );
            }
        }
        let moments = if cuda {
            let zeros = || vars.iter().map(|var| var.zeros_like()).collect::<candle_core::Result<Vec<_>>>();
            if !cfg!(feature = "cuda") {
                candle_core::bail!("fused AdamW on CUDA needs this crate's cuda feature");
            }
            Moments::Cuda(zeros()?, zeros()?)
        } else {
            let zeros = || vars.iter().map(|var| vec![0f32; var.elem_count()]).collect();
            Moments::Cpu(zeros(), zeros())
        };
        Ok(AdamW { moments, vars, step_t: 0, params })
    }

    /// Each parameter's first and second moments (m, v), as tensors on the parameters' device.
    pub fn moments(&self) -> candle_core::Result<Vec<[Tensor; 2]>> {
        match &self.moments {
            Moments::Cpu(ms, vs) => ms
                .iter()
                .zip(vs)
                .zip(&self.vars)
                .map(|((m, v), var)| {
                    Ok([Tensor::from_slice(m, var.shape(), var.device())?, Tensor::from_slice(v, var.shape(), var.device())?])
                })
                .collect(),
            Moments::Cuda(ms, vs) => Ok(ms.iter().zip(vs).map(|(m, v)| [m.clone(), v.clone()]).collect()),
        }
    }

    pub fn learning_rate(&self) -> f64 {
        self.params.lr
    }

    pub fn set_learning_rate(&mut self, lr: f64) {
        self.params.lr = lr
    }

    /// One update of every parameter that has a gradient in `grads` (as `candle_nn::AdamW`,
    /// parameters without one are left as they are, their moments too).
    pub fn step(&mut self, grads: &GradStore) -> candle_core::Result<()> {
        self.step_t += 1;
        let p = self.params;
        let t = self.step_t as i32;
        let coefs = Coefs {
            lr: p.lr as f32,
            decay: (1.0 - p.lr * p.weight_decay) as f32, // θ·(1 − lr·λ): weight decay, decoupled from g
            beta1: p.beta1 as f32,
            beta2: p.beta2 as f32,
            scale_m: (1.0 / (1.0 - p.beta1.powi(t))) as f32, // bias corrections 1/(1 − βᵗ)
            scale_v: (1.0 / (1.0 - p.beta2.powi(t))) as f32,
            eps: p.eps as f32,
        };
        match &mut self.moments {
            Moments::Cpu(ms, vs) => {
                for ((var, m), v) in self.vars.iter().zip(ms).zip(vs) {
                    if let Some(g) = grads.get(var.as_tensor()) {
                        let g = g.to_dtype(DType::F32)?;
                        var.as_tensor().inplace_op2(&g, &Update { coefs, moments: Mutex::new((m, v)) })?;
                    }
                }
            }
            #[cfg(feature = "cuda")]
            Moments::Cuda(ms, vs) => {
                // Every parameter with a gradient, in one launch.
                let (mut theta, mut g, mut m, mut v) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
                for (i, var) in self.vars.iter().enumerate() {
                    if let Some(grad) = grads.get(var.as_tensor()) {
                        theta.push(var.as_tensor().clone());
                        g.push(grad.to_dtype(DType::F32)?.contiguous()?);
                        m.push(ms[i].clone());
                        v.push(vs[i].clone());
                    }
                }
                crate::cuda::adamw_step(&theta, &g, &m, &v, coefs)?;
            }
            #[cfg(not(feature = "cuda"))]
            Moments::Cuda(..) => candle_core::bail!("fused AdamW on CUDA needs this crate's cuda feature"),
        }
        Ok(())
    }
}

/// The slow twin: one parameter's step `t` (counted from 1) as plain candle ops, the equations
/// above line by line in f32. Returns the new (θ, m, v).
pub fn step_twin(theta: &Tensor, g: &Tensor, m: &Tensor, v: &Tensor, p: ParamsAdamW, t: i32) -> candle_core::Result<[Tensor; 3]> {
    let m = ((m * p.beta1)? + (g * (1.0 - p.beta1))?)?; // m = β1·m + (1 − β1)·g
    let v = ((v * p.beta2)? + (g.sqr()? * (1.0 - p.beta2))?)?; // v = β2·v + (1 − β2)·g²
    let m_hat = (&m / (1.0 - p.beta1.powi(t)))?; // m̂ = m / (1 − β1ᵗ)
    let v_hat = (&v / (1.0 - p.beta2.powi(t)))?; // v̂ = v / (1 − β2ᵗ)
    let theta = ((theta * (1.0 - p.lr * p.weight_decay))? - ((m_hat / (v_hat.sqrt()? + p.eps)?)? * p.lr)?)?; // θ·(1 − lr·λ) − lr·m̂/(√v̂ + ε)
    Ok([theta, m, v])
}

/// One step's constants, in f32 (the arithmetic `candle_nn::AdamW` does on f32 tensors); on
/// CUDA the kernel's `AdamWStep` argument, field for field.
#[derive(Clone, Copy, Debug)]
#[repr(C)]
pub struct Coefs {
    lr: f32,
    decay: f32,
    beta1: f32,
    beta2: f32,
    scale_m: f32,
    scale_v: f32,
    eps: f32,
}

/// One parameter's update as a candle in-place op on θ's storage, g the second input; m and v
/// lent for the call.
struct Update<'a> {
    coefs: Coefs,
    moments: Mutex<(&'a mut Vec<f32>, &'a mut Vec<f32>)>,
}

impl InplaceOp2 for Update<'_> {
    fn name(&self) -> &'static str {
        "speedkit-adamw"
    }

    fn cpu_fwd(&self, theta: &mut CpuStorage, tl: &Layout, g: &CpuStorage, gl: &Layout) -> candle_core::Result<()> {
        let (CpuStorage::F32(theta), CpuStorage::F32(g)) = (theta, g) else { candle_core::bail!("adamw: θ and g must be f32") };
        let (Some((t0, t1)), Some((g0, g1))) = (tl.contiguous_offsets(), gl.contiguous_offsets()) else {
            candle_core::bail!("adamw: θ and g must be contiguous")
        };
        let mut moments = self.moments.lock().map_err(|_| candle_core::Error::Msg("adamw: poisoned lock".into()))?;
        let (m, v) = &mut *moments;
        let (theta, g) = (&mut theta[t0..t1], &g[g0..g1]);
        if g.len() != theta.len() || m.len() != theta.len() {
            candle_core::bail!("adamw: θ has {} values, g {}, m {}", theta.len(), g.len(), m.len());
        }
        let k = self.coefs;
        theta.par_chunks_mut(CHUNK).zip(g.par_chunks(CHUNK)).zip(m.par_chunks_mut(CHUNK).zip(v.par_chunks_mut(CHUNK))).for_each(
            |((theta, g), (m, v))| {
                // Zipped slices: no index checks in the loop, so it vectorises.
                for (((theta, &g), m), v) in theta.iter_mut().zip(g).zip(m.iter_mut()).zip(v.iter_mut()) {
                    *m = k.beta1 * *m + (1.0 - k.beta1) * g; // m = β1·m + (1 − β1)·g
                    *v = k.beta2 * *v + (1.0 - k.beta2) * (g * g); // v = β2·v + (1 − β2)·g²
                    let (m_hat, v_hat) = (*m * k.scale_m, *v * k.scale_v);
                    *theta = *theta * k.decay - (m_hat / (v_hat.sqrt() + k.eps)) * k.lr;
                    // θ·(1 − lr·λ) − lr·m̂/(√v̂ + ε)
                }
            },
        );
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, Tensor};
    use candle_nn::Optimizer;
    use shared::weights::SplitMix64;

    #[test]
    fn three_steps_match_candle_nn_adamw() {
        // Parameters of several sizes (one over a rayon chunk, one not a multiple of a vector),
        // the same gradients to both optimizers, non-default hyper-parameters: θ after each of 3
        // steps within 1e-6 of candle-nn's (both f32; the same operations, possibly fused
        // multiply-adds here).
        let shapes: [&[usize]; 4] = [&[40_000], &[37, 19], &[7], &[3, 5, 2]];
        let init =
            |i: usize| Tensor::from_vec(SplitMix64::new(i as u64).normals(shapes[i].iter().product()), shapes[i], &Device::Cpu).unwrap();
        let ours: Vec<Var> = (0..shapes.len()).map(|i| Var::from_tensor(&init(i)).unwrap()).collect();
        let theirs: Vec<Var> = (0..shapes.len()).map(|i| Var::from_tensor(&init(i)).unwrap()).collect();
        let params = ParamsAdamW { lr: 0.01, beta1: 0.8, beta2: 0.95, eps: 1e-6, weight_decay: 0.1 };
        let mut fused = AdamW::new(ours.clone(), params).unwrap();
        let nn = candle_nn::ParamsAdamW {
            lr: params.lr,
            beta1: params.beta1,
            beta2: params.beta2,
            eps: params.eps,
            weight_decay: params.weight_decay,
        };
        let mut reference = candle_nn::AdamW::new(theirs.clone(), nn).unwrap();
        let mut worst = 0f32;
        for step in 0..3u64 {
            // loss = Σ_i ⟨θ_i, G_i⟩, so each gradient is exactly G_i.
            let g: Vec<Tensor> = shapes
                .iter()
                .enumerate()
                .map(|(i, s)| {
                    Tensor::from_vec(SplitMix64::new(100 * step + i as u64).normals(s.iter().product()), *s, &Device::Cpu).unwrap()
                })
                .collect();
            let grads = |vars: &[Var]| {
                let terms: Vec<Tensor> = vars.iter().zip(&g).map(|(v, g)| (v.as_tensor() * g).unwrap().sum_all().unwrap()).collect();
                Tensor::stack(&terms, 0).unwrap().sum_all().unwrap().backward().unwrap()
            };
            fused.step(&grads(&ours)).unwrap();
            reference.step(&grads(&theirs)).unwrap();
            for (a, b) in ours.iter().zip(&theirs) {
                let d = (a.as_tensor() - b.as_tensor())
                    .unwrap()
                    .abs()
                    .unwrap()
                    .flatten_all()
                    .unwrap()
                    .max(0)
                    .unwrap()
                    .to_scalar::<f32>()
                    .unwrap();
                assert!(d <= 1e-6, "step {}: max |Δθ| = {d}", step + 1);
                worst = worst.max(d);
            }
            // Not vacuous: the parameters moved.
            assert!((ours[1].as_tensor() - init(1)).unwrap().abs().unwrap().sum_all().unwrap().to_scalar::<f32>().unwrap() > 0.1);
        }
        eprintln!("fused AdamW vs candle_nn::AdamW, 3 steps: max |Δθ| = {worst:.2e}");
    }

    #[test]
    fn the_twin_steps_as_the_fused_optimizer_does() {
        // θ, m and v after 3 steps of the fused CPU pass and of the plain-ops twin: both f32, the
        // same equations (the fused pass may contract multiply-adds).
        let shapes: [&[usize]; 3] = [&[CHUNK + 3], &[5, 7], &[1]];
        let init =
            |i: usize| Tensor::from_vec(SplitMix64::new(i as u64).normals(shapes[i].iter().product()), shapes[i], &Device::Cpu).unwrap();
        let vars: Vec<Var> = (0..shapes.len()).map(|i| Var::from_tensor(&init(i)).unwrap()).collect();
        let params = ParamsAdamW { lr: 0.01, beta1: 0.8, beta2: 0.95, eps: 1e-6, weight_decay: 0.1 };
        let mut fused = AdamW::new(vars.clone(), params).unwrap();
        let mut twin: Vec<[Tensor; 3]> =
            (0..shapes.len()).map(|i| [init(i), init(i).zeros_like().unwrap(), init(i).zeros_like().unwrap()]).collect();
        for step in 1..=3 {
            let mut grads = GradStore::default();
            for (i, (var, state)) in vars.iter().zip(twin.iter_mut()).enumerate() {
                let g = Tensor::from_vec(SplitMix64::new(10 * step as u64 + i as u64).normals(var.elem_count()), var.shape(), &Device::Cpu)
                    .unwrap();
                *state = step_twin(&state[0], &g, &state[1], &state[2], params, step).unwrap();
                grads.insert(var.as_tensor(), g);
            }
            fused.step(&grads).unwrap();
        }
        for ((var, [m, v]), [theta, tm, tv]) in vars.iter().zip(fused.moments().unwrap()).zip(&twin) {
            for (got, want) in [(var.as_tensor(), theta), (&m, tm), (&v, tv)] {
                let d = (got - want).unwrap().abs().unwrap().flatten_all().unwrap().max(0).unwrap().to_scalar::<f32>().unwrap();
                assert!(d <= 1e-6, "max |Δ| = {d}");
            }
        }
    }

    #[test]
    fn refuses_what_it_cannot_update() {
        let v = Var::zeros(4, DType::BF16, &Device::Cpu).unwrap();
        let e = AdamW::new(vec![v], ParamsAdamW::default()).err().expect("bf16 refused").to_string();
        assert!(e.contains("f32") && e.contains("candle_nn::AdamW"), "{e}");
    }
}
