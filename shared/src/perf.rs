//! Work per forward and the hardware's peak, to turn a time into TFLOP/s and % of peak.

use crate::preset::Shape;
use crate::stage::Precision;

/// Useful FLOPs of one forward: linears 2·B·T·(4C² + 2·C·FF); attention 2·B·T²·C (QKᵀ and PV,
/// halved by causality). Stage 0 computes the full T×T anyway; useful work keeps stages comparable.
pub fn block_flops(s: &Shape) -> f64 {
    let (b, t, c, ff) = (s.batch as f64, s.seq as f64, s.d_model as f64, s.ff as f64);
    2.0 * b * t * (4.0 * c * c + 2.0 * c * ff) + 2.0 * b * t * t * c
}

/// Datasheets: (name fragment, dense TFLOP/s at fp32 non-tensor, tf32, bf16/f16 with f32 accumulate,
/// fp8; GB/s). The first fragment in the device name wins, so "H200 NVL" precedes "H200" (tested).
/// Measured GEMMs reach ~790 of 989 bf16 TFLOP/s on H100/H200 SXM: 80 % is excellent for a block.
type Gpu = (&'static str, f64, f64, f64, Option<f64>, f64);
const PEAKS: &[Gpu] = &[
    ("GH200", 67.0, 494.7, 989.4, Some(1978.9), 4000.0),
    ("H200 NVL", 60.0, 417.5, 835.0, Some(1670.5), 4800.0), // PCIe card, 600 W
    ("H200", 67.0, 494.7, 989.4, Some(1978.9), 4800.0),     // SXM (HBM3e)
    ("H100 NVL", 60.0, 417.5, 835.0, Some(1670.5), 3900.0),
    ("H100 PCIe", 51.2, 378.0, 756.0, Some(1513.0), 2000.0),
    ("H100", 67.0, 494.7, 989.4, Some(1978.9), 3350.0), // SXM5 (HBM3)
    ("A100-SXM4-80GB", 19.5, 156.0, 312.0, None, 2039.0),
    ("A100 80GB PCIe", 19.5, 156.0, 312.0, None, 1935.0),
    ("A100", 19.5, 156.0, 312.0, None, 1555.0), // 40 GB
    ("L40S", 91.6, 183.0, 362.1, Some(733.0), 864.0),
    ("L40", 90.5, 90.5, 181.0, Some(362.0), 864.0),
    ("L4", 30.3, 60.0, 121.0, Some(242.0), 300.0),
    ("RTX 4090", 82.6, 82.6, 165.2, Some(330.3), 1008.0),
    ("RTX 3090", 35.6, 35.6, 71.0, None, 936.0),
    ("A10", 31.2, 62.5, 125.0, None, 600.0),
    ("V100", 15.7, 15.7, 125.0, None, 900.0), // no TF32/bf16: the f16 figure is in the bf16 column
    ("T4", 8.1, 8.1, 65.0, None, 320.0),
];

fn known(name: &str) -> Option<&'static Gpu> {
    PEAKS.iter().find(|(frag, ..)| name.contains(frag))
}

pub fn peak_bandwidth_gbs(name: &str) -> Option<f64> {
    known(name).map(|p| p.5)
}

/// Datasheet TFLOP/s, if known; fp32 means plain CUDA cores, f16 has bf16's tensor-core rate.
pub fn peak_tflops(name: &str, precision: Precision) -> Option<f64> {
    let &(_, fp32, tf32, half, fp8, _) = known(name)?;
    match precision {
        Precision::Fp32 => Some(fp32),
        Precision::Tf32 => Some(tf32),
        Precision::Bf16 | Precision::F16 => Some(half),
        Precision::Fp8 => fp8,
    }
}

/// Bytes of one element of the GEMM operands at `p` (fp8: E4M3, one byte).
pub fn operand_bytes(p: Precision) -> f64 {
    match p {
        Precision::Fp32 | Precision::Tf32 => 4.0,
        Precision::Bf16 | Precision::F16 => 2.0,
        Precision::Fp8 => 1.0,
    }
}

/// The roofline's traffic terms `Stage::traffic` combines: the minimum bytes each op moves if
/// nothing stays in cache (docs/measuring.md). `pass_c`: one read + write of an (N, C) activation.
/// `unfused`: the passes around the GEMMs (stage 3's header table): over (N, C), LayerNorm 1 with
/// its cast 8, q/k/v bias 3, proj's bias + residual + LayerNorm 2 11, fc2's 3; bias + GELU 10 over (N, FF).
pub struct Traffic {
    /// Input (N·K), weight (K·M), output (N·M); at fp8 also the pass that quantises each input.
    pub gemms: f64,
    pub pass_c: f64,
    /// Reads q, k, v once and writes its output once.
    pub fused_attention: f64,
    /// The f32 (B, n_head, T, T) scores written, ~10 more score-sized accesses (scale, mask, max,
    /// exp, sum, divide) and read by P·V; plus the head split and merge copies.
    pub naive_attention: f64,
    pub unfused: f64,
}

impl Traffic {
    pub fn new(s: &Shape, p: Precision, act: f64) -> Traffic {
        let (n, c, ff) = ((s.batch * s.seq) as f64, s.d_model as f64, s.ff as f64);
        let scores = (s.batch * s.n_head) as f64 * (s.seq * s.seq) as f64; // (B, n_head, T, T)
        let e = operand_bytes(p);
        let gemm = |k: f64, m: f64| {
            let quantise = if p == Precision::Fp8 { n * k * (act + 1.0) } else { 0.0 }; // read x, write E4M3
            n * k * e + k * m * e + n * m * act + quantise
        };
        let pass_c = 2.0 * n * c * act;
        let pass_ff = 2.0 * n * ff * act;
        Traffic {
            gemms: gemm(c, 3.0 * c) + gemm(c, c) + gemm(c, ff) + gemm(ff, c),
            pass_c,
            fused_attention: 4.0 * n * c * act,
            naive_attention: 4.0 * scores * (1.0 + 10.0 + 1.0) + 4.0 * pass_c + 2.0 * n * c * act,
            unfused: 25.0 * pass_c + 10.0 * pass_ff,
        }
    }
}

#[cfg(test)]
#[path = "../tests/unit/perf.rs"]
mod tests;
