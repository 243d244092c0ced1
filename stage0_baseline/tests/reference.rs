//! Stage 0 against an independent reference: the block's equations as plain Rust f64 loops,
//! sharing no code with the candle implementation (not even its LayerNorm or softmax).

use candle_core::{Device, Tensor};
use shared::device::{DeviceInfo, DeviceKind};
use shared::weights::random_input;
use shared::{BlockWeights, Forward, Plan, Precision, Preset, Shape, Stage};
use stage0_baseline::{Baseline, Block};

fn host(t: &Tensor) -> Vec<f64> {
    t.flatten_all().unwrap().to_vec1::<f32>().unwrap().into_iter().map(f64::from).collect()
}

/// y[r][o] = Σ_i x[r][i] · w[o][i] + b[o]; x: rows × n_in, w: n_out × n_in.
fn linear(x: &[f64], w: &[f64], b: &[f64], n_in: usize) -> Vec<f64> {
    let n_out = b.len();
    let mut y = Vec::with_capacity(x.len() / n_in * n_out);
    for row in x.chunks(n_in) {
        for o in 0..n_out {
            let wo = &w[o * n_in..(o + 1) * n_in];
            y.push(row.iter().zip(wo).map(|(a, b)| a * b).sum::<f64>() + b[o]);
        }
    }
    y
}

fn layer_norm(x: &[f64], g: &[f64], b: &[f64]) -> Vec<f64> {
    let c = g.len();
    let mut y = Vec::with_capacity(x.len());
    for row in x.chunks(c) {
        let mean = row.iter().sum::<f64>() / c as f64;
        let var = row.iter().map(|v| (v - mean) * (v - mean)).sum::<f64>() / c as f64;
        let inv = 1.0 / (var + 1e-5).sqrt();
        y.extend(row.iter().enumerate().map(|(i, v)| (v - mean) * inv * g[i] + b[i]));
    }
    y
}

fn gelu_tanh(v: f64) -> f64 {
    0.5 * v * (1.0 + ((2.0 / std::f64::consts::PI).sqrt() * (v + 0.044715 * v * v * v)).tanh())
}

fn block_f64(s: &Shape, w: &BlockWeights, x: &[f64]) -> Vec<f64> {
    let (bsz, t, c, nh, ff) = (s.batch, s.seq, s.d_model, s.n_head, s.ff);
    let dh = c / nh;
    let h = layer_norm(x, &host(&w.ln1_g), &host(&w.ln1_b));
    let qkv = linear(&h, &host(&w.w_qkv), &host(&w.b_qkv), c); // rows of 3C: [q | k | v]
    let mut a = vec![0.0; bsz * t * c];
    for b in 0..bsz {
        for head in 0..nh {
            let at = |tok: usize, part: usize, d: usize| qkv[(b * t + tok) * 3 * c + part * c + head * dh + d];
            for i in 0..t {
                // scores over keys 0..=i only: the causal mask
                let s: Vec<f64> = (0..=i).map(|j| (0..dh).map(|d| at(i, 0, d) * at(j, 1, d)).sum::<f64>() / (dh as f64).sqrt()).collect();
                let m = s.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let e: Vec<f64> = s.iter().map(|v| (v - m).exp()).collect();
                let l: f64 = e.iter().sum();
                for d in 0..dh {
                    a[(b * t + i) * c + head * dh + d] = (0..=i).map(|j| e[j] / l * at(j, 2, d)).sum();
                }
            }
        }
    }
    let proj = linear(&a, &host(&w.w_proj), &host(&w.b_proj), c);
    let x1: Vec<f64> = x.iter().zip(&proj).map(|(a, b)| a + b).collect();
    let h2 = layer_norm(&x1, &host(&w.ln2_g), &host(&w.ln2_b));
    let m: Vec<f64> = linear(&h2, &host(&w.w_fc1), &host(&w.b_fc1), c).into_iter().map(gelu_tanh).collect();
    let out = linear(&m, &host(&w.w_fc2), &host(&w.b_fc2), ff);
    x1.iter().zip(&out).map(|(a, b)| a + b).collect()
}

fn plan(shape: Shape) -> Plan {
    let info = DeviceInfo {
        kind: DeviceKind::Cpu,
        ordinal: 0,
        name: "cpu".into(),
        sm: None,
        memory_bytes: None,
        threads: 1,
        why: "test".into(),
        cpu_flags: Vec::new(),
    };
    Plan {
        device: Device::Cpu,
        info,
        precision: Precision::Fp32,
        precision_reason: "test".into(),
        shape,
        requested: shared::PrecisionRequest::Auto,
        cuda_graph: false,
        train: false,
    }
}

fn rel_err(y: &[f64], r: &[f64]) -> f64 {
    let d: f64 = y.iter().zip(r).map(|(a, b)| (a - b) * (a - b)).sum();
    let n: f64 = r.iter().map(|b| b * b).sum();
    (d / n).sqrt()
}

#[test]
fn stage0_matches_f64_loops_on_tiny() {
    let shape = Preset::Tiny.shape();
    let w = BlockWeights::from_seed(&shape, 42).unwrap();
    let x = random_input(&shape, 42).unwrap();
    let y = host(&Block::build(&w, &plan(shape), Default::default()).unwrap().forward(&x).unwrap());
    let r = block_f64(&shape, &w, &host(&x));
    let e = rel_err(&y, &r);
    assert!(e < 1e-5, "relative error {e}");
    // Not vacuous: the block moves x by much more than the tolerance.
    assert!(rel_err(&host(&x), &r) > 1e-2);
}

#[test]
fn stage0_matches_f64_loops_on_odd_shape() {
    // T not a power of two, one head, C not a multiple of 8: no shape-specific luck.
    let shape = Shape { batch: 3, seq: 7, d_model: 12, n_head: 1, ff: 20 };
    let w = BlockWeights::from_seed(&shape, 1).unwrap();
    let x = random_input(&shape, 1).unwrap();
    let y = host(&Block::build(&w, &plan(shape), Default::default()).unwrap().forward(&x).unwrap());
    let e = rel_err(&y, &block_f64(&shape, &w, &host(&x)));
    assert!(e < 1e-5, "relative error {e}");
}

#[test]
fn weights_round_trip_through_safetensors_gives_identical_output() {
    let shape = Preset::Tiny.shape();
    let w = BlockWeights::from_seed(&shape, 9).unwrap();
    let x = random_input(&shape, 9).unwrap();
    let dir = std::env::temp_dir().join(format!("speedkit-s0-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("layer.safetensors");
    w.save_gpt2(&path, 0, shape.n_head).unwrap();
    let (back, _) = BlockWeights::load_gpt2(&path, Some(0)).unwrap();
    let y1 = host(&Block::build(&w, &plan(shape), Default::default()).unwrap().forward(&x).unwrap());
    let y2 = host(&Block::build(&back, &plan(shape), Default::default()).unwrap().forward(&x).unwrap());
    assert_eq!(y1, y2);
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn fp32_only() {
    let info = plan(Preset::Tiny.shape()).info;
    let e = Baseline.choose_precision(&info, shared::PrecisionRequest::Exactly(Precision::Bf16)).unwrap_err();
    assert!(e.to_string().contains("fp32 only"));
}
