//! The engine's element-wise ops in a training step: candle custom ops, so that candle's
//! autograd records them and their backward runs on the engine too (all threads, vectorised),
//! where it would otherwise differentiate candle's single-threaded primitives one by one, each
//! with a zero-filled gradient buffer and an add. The forward is the untracked call's passes
//! (the op's own is the last of them, so a tracked call makes no extra pass); the backward is the
//! op's derivative as PyTorch's eager autograd writes it, one backward per op — LayerNorm's in
//! two passes, GELU's and the softmax's in one. Stage 3's fusions show their gain against these.
//!
//! f32 only (a training step's activations on the CPU); anything else takes candle's ops.
//! Slow twins: candle's autograd of the same primitives (`--elementwise candle`), in the tests.

use super::{gelu_tanh_grad, map_slice, par_fill, ran, with_src, Src, CHUNK};
use candle_core::{bail, CpuStorage, CustomOp1, CustomOp3, DType, Layout, Shape, Tensor};
use rayon::prelude::*;

/// CPU f32 tensors of which at least one is tracked: a training step's, which the ops below take.
pub(super) fn tracked_f32(ts: &[&Tensor]) -> bool {
    ts.iter().all(|t| t.device().is_cpu() && t.dtype() == DType::F32) && ts.iter().any(|t| t.track_op())
}

/// A contiguous f32 tensor's values (the ops' saved forward tensors are made contiguous).
fn f32s<R>(t: &Tensor, f: impl FnOnce(&[f32]) -> candle_core::Result<R>) -> candle_core::Result<R> {
    with_src(t, |s| match s {
        Src::F32(v) => f(v),
        Src::Bf16(_) => bail!("grad: expected an f32 tensor"),
    })
}

/// GELU's last pass, y = 0.5·t with t = (1 + tanh(√(2/π)(x + 0.044715x³)))·x from the first
/// eight; backward dx = dy·gelu′(x) (`gelu_tanh_grad`), one pass.
pub(super) struct Gelu {
    pub t: Tensor,
}

impl CustomOp1 for Gelu {
    fn name(&self) -> &'static str {
        "gelu (engine)"
    }

    fn cpu_fwd(&self, _x: &CpuStorage, l: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        let y = f32s(&self.t, |t| Ok(par_fill(t.len(), 1, |at, o| map_slice(o, &t[at..at + o.len()], &|_, v| v * 0.5))))?;
        Ok((CpuStorage::F32(y), l.shape().clone()))
    }

    fn bwd(&self, x: &Tensor, _y: &Tensor, dy: &Tensor) -> candle_core::Result<Option<Tensor>> {
        ran("gelu backward", true);
        let (x, dy) = (x.detach().contiguous()?, dy.detach().to_dtype(DType::F32)?.contiguous()?);
        let dx = f32s(&x, |xs| {
            f32s(&dy, |gs| {
                Ok(par_fill(xs.len(), 1, |at, o| {
                    let g = &gs[at..at + o.len()];
                    map_slice(o, &xs[at..at + o.len()], &|i, v| g[i] * gelu_tanh_grad(v))
                }))
            })
        })?;
        Ok(Some(Tensor::from_vec(dx, x.shape(), x.device())?))
    }
}

/// One task's rows of LayerNorm's backward: per row (Σd, Σd·x̂), and its partial dg and db.
type TaskSums = (Vec<(f32, f32)>, Vec<f32>, Vec<f32>);

/// LayerNorm's last pass, y = (x − mean)·inv_std·g + b from the forward's centred rows and
/// 1/√(var + ε) per row. Backward, with x̂ = (x − mean)·inv_std and d = dy·g per row:
/// dx = inv_std·(d − mean(d) − x̂·mean(d·x̂)), dg = Σ_rows dy·x̂, db = Σ_rows dy — one pass for
/// the row sums and the column sums, one for dx.
pub(super) struct LayerNorm {
    pub centred: Tensor,
    pub inv_std: Vec<f32>,
}

impl CustomOp3 for LayerNorm {
    fn name(&self) -> &'static str {
        "layer_norm (engine)"
    }

    fn cpu_fwd(
        &self,
        _x: &CpuStorage,
        _lx: &Layout,
        g: &CpuStorage,
        lg: &Layout,
        b: &CpuStorage,
        lb: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let (CpuStorage::F32(g), CpuStorage::F32(b)) = (g, b) else { bail!("layer_norm: g and b must be f32") };
        let (Some((g0, g1)), Some((b0, b1))) = (lg.contiguous_offsets(), lb.contiguous_offsets()) else {
            bail!("layer_norm: g and b must be contiguous")
        };
        let (g, b) = (&g[g0..g1], &b[b0..b1]);
        let c = g.len();
        let y = f32s(&self.centred, |cs| {
            Ok(par_fill(cs.len(), c, |at, o| {
                let len = o.len();
                for (r, (o, s)) in o.chunks_mut(c).zip(cs[at..at + len].chunks(c)).enumerate() {
                    let inv = self.inv_std[at / c + r];
                    map_slice(o, s, &|i, v| v * inv * g[i] + b[i]);
                }
            }))
        })?;
        Ok((CpuStorage::F32(y), self.centred.shape().clone()))
    }

    fn bwd(
        &self,
        x: &Tensor,
        g: &Tensor,
        _b: &Tensor,
        _y: &Tensor,
        dy: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        ran("layer_norm backward", true);
        let c = g.elem_count();
        let rows = self.inv_std.len();
        let (g, dy) = (g.detach().contiguous()?, dy.detach().to_dtype(DType::F32)?.contiguous()?);
        // Pass 1: per row Σd and Σd·x̂; per task, partial column sums of dy·x̂ and dy.
        let (row_sums, dg, db) = f32s(&self.centred, |cs| {
            f32s(&g, |gs| {
                f32s(&dy, |ds| {
                    let rows_per_task = (CHUNK / c.max(1)).max(1);
                    let parts: Vec<TaskSums> = (0..rows.div_ceil(rows_per_task))
                        .into_par_iter()
                        .map(|task| {
                            let (r0, r1) = (task * rows_per_task, ((task + 1) * rows_per_task).min(rows));
                            let (mut sums, mut dg, mut db) = (Vec::with_capacity(r1 - r0), vec![0f32; c], vec![0f32; c]);
                            for r in r0..r1 {
                                let (xc, d, inv) = (&cs[r * c..(r + 1) * c], &ds[r * c..(r + 1) * c], self.inv_std[r]);
                                let (mut s1, mut s2) = ([0f32; 16], [0f32; 16]);
                                for i in 0..c {
                                    let xh = xc[i] * inv;
                                    let dd = d[i] * gs[i];
                                    s1[i % 16] += dd;
                                    s2[i % 16] += dd * xh;
                                    dg[i] += d[i] * xh;
                                    db[i] += d[i];
                                }
                                sums.push((s1.iter().sum(), s2.iter().sum()));
                            }
                            (sums, dg, db)
                        })
                        .collect();
                    let (mut dg, mut db) = (vec![0f32; c], vec![0f32; c]);
                    let mut row_sums = Vec::with_capacity(rows);
                    for (s, pg, pb) in parts {
                        row_sums.extend(s);
                        dg.iter_mut().zip(&pg).for_each(|(a, b)| *a += b);
                        db.iter_mut().zip(&pb).for_each(|(a, b)| *a += b);
                    }
                    Ok((row_sums, dg, db))
                })
            })
        })?;
        // Pass 2: dx.
        let dx = f32s(&self.centred, |cs| {
            f32s(&g, |gs| {
                f32s(&dy, |ds| {
                    Ok(par_fill(cs.len(), c, |at, o| {
                        let first = at / c;
                        for (r, o) in o.chunks_mut(c).enumerate() {
                            let row = first + r;
                            let (xc, d, inv) = (&cs[row * c..(row + 1) * c], &ds[row * c..(row + 1) * c], self.inv_std[row]);
                            let (s1, s2) = row_sums[row];
                            let (m1, m2) = (s1 / c as f32, s2 / c as f32);
                            map_slice(o, xc, &|i, v| inv * (d[i] * gs[i] - m1 - v * inv * m2));
                        }
                    }))
                })
            })
        })?;
        let dev = x.device();
        Ok((Some(Tensor::from_vec(dx, x.shape(), dev)?), Some(Tensor::from_vec(dg, c, dev)?), Some(Tensor::from_vec(db, c, dev)?)))
    }
}

/// Softmax's last pass over the last dimension, p = e / Σe with e = exp(s − max) and Σe per row
/// from the passes before it. Backward ds = p·(dp − Σ dp·p) per row, one pass (each row read
/// twice while it is in cache).
pub(super) struct Softmax {
    pub e: Tensor,
    pub sums: Vec<f32>,
}

impl CustomOp1 for Softmax {
    fn name(&self) -> &'static str {
        "softmax (engine)"
    }

    fn cpu_fwd(&self, _s: &CpuStorage, _l: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        let n = self.e.dim(candle_core::D::Minus1)?;
        let p = f32s(&self.e, |es| Ok(div_rows(es, &self.sums, n)))?;
        Ok((CpuStorage::F32(p), self.e.shape().clone()))
    }

    fn bwd(&self, _s: &Tensor, p: &Tensor, dp: &Tensor) -> candle_core::Result<Option<Tensor>> {
        ran("softmax backward", true);
        let n = p.dim(candle_core::D::Minus1)?;
        let (p, dp) = (p.detach().contiguous()?, dp.detach().to_dtype(DType::F32)?.contiguous()?);
        let ds = f32s(&p, |ps| {
            f32s(&dp, |gs| {
                Ok(par_fill(ps.len(), n, |at, o| {
                    let len = o.len();
                    for (o, (p, g)) in o.chunks_mut(n).zip(ps[at..at + len].chunks(n).zip(gs[at..at + len].chunks(n))) {
                        let mut acc = [0f32; 16];
                        for (i, (&p, &g)) in p.iter().zip(g).enumerate() {
                            acc[i % 16] += p * g;
                        }
                        let dot: f32 = acc.iter().sum();
                        map_slice(o, p, &|i, v| v * (g[i] - dot));
                    }
                }))
            })
        })?;
        Ok(Some(Tensor::from_vec(ds, p.shape(), p.device())?))
    }
}

/// e / Σe row by row, on all threads: softmax's last pass.
pub(super) fn div_rows(es: &[f32], sums: &[f32], n: usize) -> Vec<f32> {
    par_fill(es.len(), n, |at, o| {
        let len = o.len();
        for (r, (o, e)) in o.chunks_mut(n).zip(es[at..at + len].chunks(n)).enumerate() {
            let sum = sums[at / n + r];
            map_slice(o, e, &|_, v| v / sum);
        }
    })
}

#[cfg(test)]
mod tests {
    use super::super::{gelu_tanh, layer_norm, softmax_last_dim, Elementwise, LN_EPS};
    use candle_core::{DType, Device, Tensor, Var};

    fn rand(dims: &[usize], seed: u64, scale: f32) -> Tensor {
        let n: usize = dims.iter().product();
        let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        let v: Vec<f32> = (0..n)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                ((s >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 2.0 * scale
            })
            .collect();
        Tensor::from_vec(v, dims, &Device::Cpu).unwrap()
    }

    /// max |a − b| / max |b|.
    fn rel(a: &Tensor, b: &Tensor) -> f32 {
        let m = |t: Tensor| t.abs().unwrap().flatten_all().unwrap().max(0).unwrap().to_scalar::<f32>().unwrap();
        m((a - b).unwrap()) / m(b.clone()).max(f32::MIN_POSITIVE)
    }

    /// ⟨f(inputs), r⟩'s output and gradients with `mode`, the trace of the forward and backward.
    fn run(
        inputs: &[Tensor],
        r: &Tensor,
        mode: Elementwise,
        f: &dyn Fn(&[Tensor], Elementwise) -> Tensor,
    ) -> (Tensor, Vec<Tensor>, Vec<String>) {
        let vars: Vec<Var> = inputs.iter().map(|t| Var::from_tensor(t).unwrap()).collect();
        let ts: Vec<Tensor> = vars.iter().map(|v| v.as_tensor().clone()).collect();
        crate::trace::start();
        let y = f(&ts, mode);
        let grads = (&y * r).unwrap().sum_all().unwrap().backward().unwrap();
        let ran = crate::trace::stop();
        (y.detach(), ts.iter().map(|t| grads.get(t).expect("every input gets a gradient").clone()).collect(), ran)
    }

    /// Each op's engine forward and backward against candle's autograd of its primitives (the
    /// slow twin), on ragged shapes, and the trace names the engine for both directions.
    fn check(name: &str, inputs: &[Tensor], r: &Tensor, tol: f32, f: &dyn Fn(&[Tensor], Elementwise) -> Tensor) {
        let (y, g, ran) = run(inputs, r, Elementwise::Parallel, f);
        let (y0, g0, ran0) = run(inputs, r, Elementwise::Candle, f);
        assert!(ran.iter().any(|k| k.starts_with(&format!("{name}: engine passes"))), "{ran:?}");
        assert!(ran.iter().any(|k| k.starts_with(&format!("{name} backward: engine pass"))), "{ran:?}");
        assert!(ran0.iter().all(|k| k.ends_with(": candle")), "{ran0:?}");
        assert!(rel(&y, &y0) < tol, "{name} forward {:?}: {}", y.dims(), rel(&y, &y0));
        for (i, (a, b)) in g.iter().zip(&g0).enumerate() {
            assert_eq!(a.dims(), b.dims());
            assert!(rel(a, b) < tol, "{name} gradient {i} {:?}: {}", y.dims(), rel(a, b));
        }
    }

    #[test]
    fn gelu_backward_matches_candles_autograd() {
        for (i, dims) in [[1usize, 1], [3, 37], [17, 300]].iter().enumerate() {
            let x = rand(dims, 10 + i as u64, 4.0);
            check("gelu", &[x], &rand(dims, 20 + i as u64, 1.0), 1e-5, &|t, m| gelu_tanh(&t[0], m).unwrap());
        }
    }

    #[test]
    fn layer_norm_backward_matches_candles_autograd() {
        for (i, &(rows, c)) in [(1usize, 2usize), (3, 37), (2 * 9, 768), (5, 1000)].iter().enumerate() {
            let s = i as u64;
            let x = (rand(&[rows, c], 30 + s, 2.0) + 3.0).unwrap(); // a mean away from 0
            let g = (rand(&[c], 40 + s, 0.2) + 1.0).unwrap();
            let b = rand(&[c], 50 + s, 0.2);
            check("layer_norm", &[x, g, b], &rand(&[rows, c], 60 + s, 1.0), 1e-4, &|t, m| {
                layer_norm(&t[0], &t[1], &t[2], LN_EPS, m).unwrap()
            });
        }
    }

    #[test]
    fn softmax_backward_matches_candles_autograd_with_a_causal_mask() {
        for (i, &(h, t)) in [(1usize, 1usize), (2, 33), (3, 130)].iter().enumerate() {
            let s = i as u64;
            // (h, T, T) scores plus a causal mask: −∞ above the diagonal, as the blocks' attention.
            let mask: Vec<f32> = (0..t * t).map(|k| if k % t > k / t { f32::NEG_INFINITY } else { 0.0 }).collect();
            let mask = Tensor::from_vec(mask, (t, t), &Device::Cpu).unwrap();
            let scores = rand(&[h, t, t], 70 + s, 6.0);
            let r = rand(&[h, t, t], 80 + s, 1.0);
            check("softmax", &[scores], &r, 1e-5, &|x, m| softmax_last_dim(&x[0].broadcast_add(&mask).unwrap(), m).unwrap());
        }
    }

    /// An untracked call runs the same passes, with no custom op in the way: the same values.
    #[test]
    fn untracked_and_tracked_calls_agree() {
        let x = rand(&[6, 50], 90, 3.0);
        let (g, b) = ((rand(&[50], 91, 0.1) + 1.0).unwrap(), rand(&[50], 92, 0.1));
        let v = Var::from_tensor(&x).unwrap();
        let same = |a: Tensor, b: Tensor| assert_eq!(a.to_vec2::<f32>().unwrap(), b.to_vec2::<f32>().unwrap());
        let p = Elementwise::Parallel;
        same(gelu_tanh(&x, p).unwrap(), gelu_tanh(v.as_tensor(), p).unwrap().detach());
        same(softmax_last_dim(&x, p).unwrap(), softmax_last_dim(v.as_tensor(), p).unwrap().detach());
        same(layer_norm(&x, &g, &b, LN_EPS, p).unwrap(), layer_norm(v.as_tensor(), &g, &b, LN_EPS, p).unwrap().detach());
        assert_eq!(softmax_last_dim(&x.to_dtype(DType::F32).unwrap(), p).unwrap().dims(), [6, 50]);
    }
}
