//! Each `--breakdown` part's regime: is its time explained by the compute roof, the memory roof,
//! or neither? FLOPs: GEMMs 2·M·N·K (attention 2·B·T²·C, causal), LayerNorm 7 per element, bias or
//! residual 1, GELU 9. Minimum bytes: inputs, weights and output each moved once (attention: q, k,
//! v in, output out). Reaching `EXPLAINED` of the larger roofline term's rate is compute- or
//! memory-bound, else unexplained: the time goes to work beyond the minimum (extra passes,
//! launches, syncs, scalar code, latency), not only "overhead".

use crate::breakdown::PARTS as PART_NAMES;
use crate::perf::operand_bytes;
use crate::preset::Shape;
use crate::report::Record;
use crate::stage::Precision;
use serde::{Deserialize, Serialize};

/// A part within 1 / EXPLAINED of its roofline time is bound by that roof: a GEMM library reaches
/// 70–100 % of the measured rate, a good element-wise pass 40–90 % of STREAM, a scalar part far less.
pub const EXPLAINED: f64 = 0.3;

pub const UNEXPLAINED: &str = "unexplained";

#[derive(Clone, Copy, Debug, PartialEq)]
pub struct PartWork {
    pub flops: f64,
    pub min_bytes: f64,
}

/// Compute in GFLOP/s at the part's precision, memory in GB/s.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Roofs {
    pub gflops: f64,
    pub gbs: f64,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct PartRegime {
    pub flops: f64,
    pub min_bytes: f64,
    pub gflops: f64,
    pub gbs: f64,
    pub pct_of_compute_roof: f64,
    pub pct_of_memory_roof: f64,
    /// "compute-bound", "memory-bound" or "unexplained".
    pub regime: String,
}

/// The block's parts in a (fused) part's name, e.g. "proj+residual+ln2" → ["proj+residual", "ln2"].
pub fn components(name: &str) -> Option<Vec<&'static str>> {
    let mut rest = name;
    let mut out = Vec::new();
    while !rest.is_empty() {
        // Longest match first: "proj+residual" before a hypothetical "proj".
        let part = PART_NAMES.iter().filter(|p| rest.starts_with(*p)).max_by_key(|p| p.len())?;
        out.push(*part);
        rest = &rest[part.len()..];
        rest = match rest.strip_prefix('+') {
            Some(r) if !r.is_empty() => r,
            None if rest.is_empty() => rest,
            _ => return None,
        };
    }
    (!out.is_empty()).then_some(out)
}

/// A fused part's minimum drops the (N, C) hand-off between its pieces (stage 3's add + LayerNorm
/// reads x once).
pub fn part_work(name: &str, s: &Shape, operand: f64, act: f64) -> Option<PartWork> {
    let (b, t, c, ff) = (s.batch as f64, s.seq as f64, s.d_model as f64, s.ff as f64);
    let n = b * t;
    // GEMM (n, k) x (k, m) with `extra` FLOPs per output and `more_in` activations read (a residual).
    let gemm = |k: f64, m: f64, extra: f64, more_in: f64| {
        (2.0 * n * k * m + extra * n * m, n * k * operand + k * m * operand + n * m * act + more_in * act)
    };
    let parts = components(name)?;
    let mut w = PartWork { flops: 0.0, min_bytes: -((parts.len() - 1) as f64) * n * c * act };
    for p in parts {
        let (flops, bytes) = match p {
            "ln1" | "ln2" => (7.0 * n * c, n * c * act + n * c * operand),
            "qkv" => gemm(c, 3.0 * c, 1.0, 0.0),
            "attention" => (2.0 * b * t * t * c, 4.0 * n * c * act),
            "proj+residual" => gemm(c, c, 2.0, n * c),
            "fc1+gelu" => gemm(c, ff, 9.0, 0.0),
            _ => gemm(ff, c, 2.0, n * c), // fc2+residual
        };
        w.flops += flops;
        w.min_bytes += bytes;
    }
    Some(w)
}

/// A part's backward (`--train --breakdown`): a linear's two GEMMs (dX = dZ·W, dW = dZᵀ·X) are
/// twice its forward's FLOPs, attention's five tile GEMMs (S recomputed, dV, dP, dQ, dK) two and
/// a half times its two; element-wise work about twice (the forward's values and the output
/// gradient in, the input gradient out), and the minimum bytes twice the forward's (each input
/// read again, its gradient written). "optimizer": AdamW over the block's weights, about 12 FLOPs
/// per parameter; θ, g and both moments read and θ and the moments written, f32: 28 bytes each.
pub fn backward_work(name: &str, s: &Shape, operand: f64, act: f64) -> Option<PartWork> {
    if name == "optimizer" {
        let (c, ff) = (s.d_model as f64, s.ff as f64);
        let params = 4.0 * c * c + 2.0 * c * ff + 9.0 * c + ff; // qkv, proj, fc1, fc2 weights and biases, two LayerNorms
        return Some(PartWork { flops: 12.0 * params, min_bytes: 28.0 * params });
    }
    let w = part_work(name, s, operand, act)?;
    let attention = components(name)?.contains(&"attention");
    Some(PartWork { flops: w.flops * if attention { 2.5 } else { 2.0 }, min_bytes: 2.0 * w.min_bytes })
}

pub fn classify(work: PartWork, ms: f64, roofs: Roofs) -> Option<PartRegime> {
    if !(ms > 0.0 && roofs.gflops > 0.0 && roofs.gbs > 0.0) {
        return None;
    }
    let (gflops, gbs) = (work.flops / ms / 1e6, work.min_bytes / ms / 1e6);
    // Roofline times in ms: the larger decides which roof applies.
    let (t_compute, t_memory) = (work.flops / roofs.gflops / 1e6, work.min_bytes / roofs.gbs / 1e6);
    let regime = match (t_compute.max(t_memory) / ms >= EXPLAINED, t_compute >= t_memory) {
        (false, _) => UNEXPLAINED,
        (true, true) => "compute-bound",
        (true, false) => "memory-bound",
    };
    Some(PartRegime {
        flops: work.flops,
        min_bytes: work.min_bytes,
        gflops,
        gbs,
        pct_of_compute_roof: 100.0 * gflops / roofs.gflops,
        pct_of_memory_roof: 100.0 * gbs / roofs.gbs,
        regime: regime.into(),
    })
}

/// The table cell's tag: "C 98%" (compute-bound, % of the compute roof), "M 40%" (memory-bound,
/// % of the memory roof), "U 4%" (unexplained, % of the roof its intensity puts it under).
pub fn tag(r: &PartRegime) -> String {
    let (letter, pct) = match r.regime.as_str() {
        "compute-bound" => ("C", r.pct_of_compute_roof),
        "memory-bound" => ("M", r.pct_of_memory_roof),
        _ => ("U", r.pct_of_compute_roof.max(r.pct_of_memory_roof)),
    };
    format!("{letter} {pct:.0}%")
}

/// Fill `r`'s breakdown parts' `regime`: compute roof its peak (else the CPU probe's), memory roof
/// `bandwidth_gbs` (else the triad's). FP8's activations are stage 3's: 16-bit on a GPU, f32 on a CPU.
pub fn annotate(r: &mut Record, bandwidth_gbs: Option<f64>) {
    let gflops = r.peak_tflops.map(|t| t * 1e3).or(r.ceiling.as_ref().map(|c| c.gemm_gflops));
    let gbs = bandwidth_gbs.or(r.ceiling.as_ref().map(|c| c.bandwidth_gbs));
    let (Some(gflops), Some(gbs)) = (gflops, gbs) else { return };
    let operand = operand_bytes(r.precision);
    let act = match r.precision {
        Precision::Fp8 if r.device.is_cuda() => 2.0,
        Precision::Fp8 => 4.0,
        p => operand_bytes(p),
    };
    let shape = r.shape;
    for p in r.breakdown.iter_mut().flat_map(|b| &mut b.parts) {
        p.regime = part_work(&p.name, &shape, operand, act).and_then(|w| classify(w, p.median_ms, Roofs { gflops, gbs }));
    }
    for p in r.breakdown.iter_mut().flat_map(|b| &mut b.backward) {
        p.regime = backward_work(&p.name, &shape, operand, act).and_then(|w| classify(w, p.median_ms, Roofs { gflops, gbs }));
    }
}

#[cfg(test)]
#[path = "../tests/unit/regime.rs"]
mod tests;
