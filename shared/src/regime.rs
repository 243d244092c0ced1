//! Each `--breakdown` part's regime: is its time explained by the compute roof, the memory roof,
//! or neither? FLOPs: GEMMs 2·M·N·K (attention 2·B·T²·C, causal), LayerNorm 7 per element, bias or
//! residual 1, GELU 9. Minimum bytes: inputs, weights and output each moved once, nothing cached
//! between parts (attention: q, k, v in, output out; stage 0's T × T passes are what fusion deletes).
//! Roofline time = max(FLOPs / compute roof, bytes / memory roof); reaching `EXPLAINED` of the larger
//! term's rate is compute- or memory-bound, else unexplained: neither roof accounts for the time, which
//! goes to work beyond the minimum (extra passes, launches, syncs, scalar code, latency). The name is
//! what is measured; it is not "overhead" in the sense of launch or framework overhead alone.

use crate::breakdown::PARTS as PART_NAMES;
use crate::perf::operand_bytes;
use crate::preset::Shape;
use crate::report::Record;
use crate::stage::Precision;
use serde::{Deserialize, Serialize};

/// A part within 1 / EXPLAINED of its roofline time is bound by that roof: a GEMM library reaches
/// 70–100 % of the measured rate, a good element-wise pass 40–90 % of STREAM, a scalar part far less.
pub const EXPLAINED: f64 = 0.3;

/// The regime of a part under `EXPLAINED` of both roofs.
pub const UNEXPLAINED: &str = "unexplained";

/// Reads a recorded regime, mapping the name files written before the rename used ("overhead").
fn regime_name<'de, D: serde::Deserializer<'de>>(d: D) -> Result<String, D::Error> {
    let name = String::deserialize(d)?;
    Ok(if name == "overhead" { UNEXPLAINED.to_string() } else { name })
}

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
    /// "compute-bound", "memory-bound" or "unexplained". Files written before the rename say
    /// "overhead" for the last; it reads as "unexplained".
    #[serde(deserialize_with = "regime_name")]
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

/// Fill `r`'s breakdown parts' `regime`: compute roof as its % of peak (else the CPU probe's), memory
/// roof `bandwidth_gbs` (else the triad's). Activations are at the record's precision, except FP8
/// (stage 4 keeps stage 3's: 16-bit on a GPU, f32 on a CPU).
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
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::preset::Preset;

    fn roofs() -> Roofs {
        Roofs { gflops: 173.0, gbs: 19.0 }
    }

    #[test]
    fn fused_names_split_into_the_blocks_parts() {
        assert_eq!(components("proj+residual+ln2"), Some(vec!["proj+residual", "ln2"]));
        assert_eq!(components("fc1+gelu"), Some(vec!["fc1+gelu"]));
        assert_eq!(components("ln1"), Some(vec!["ln1"]));
        assert_eq!(components("proj+"), None);
        assert_eq!(components("softmax"), None);
        assert_eq!(components(""), None);
    }

    #[test]
    fn the_parts_gemm_flops_add_up_to_the_blocks() {
        let s = Preset::Small.shape();
        let total: f64 = PART_NAMES.iter().map(|p| part_work(p, &s, 4.0, 4.0).unwrap().flops).sum();
        let (n, c, ff) = ((s.batch * s.seq) as f64, s.d_model as f64, s.ff as f64);
        let elementwise = 7.0 * n * c * 2.0 + n * 3.0 * c + 2.0 * n * c * 2.0 + 9.0 * n * ff;
        let block = crate::perf::block_flops(&s);
        assert!((total - elementwise - block).abs() <= 1e-9 * block, "{total} vs {block} + {elementwise}");
    }

    #[test]
    fn fusing_drops_the_handoff_but_keeps_the_work() {
        let s = Preset::Small.shape();
        let (a, b) = (part_work("proj+residual", &s, 4.0, 4.0).unwrap(), part_work("ln2", &s, 4.0, 4.0).unwrap());
        let fused = part_work("proj+residual+ln2", &s, 4.0, 4.0).unwrap();
        assert_eq!(fused.flops, a.flops + b.flops);
        let n_c = (s.batch * s.seq * s.d_model) as f64;
        assert_eq!(fused.min_bytes, a.min_bytes + b.min_bytes - 4.0 * n_c);
    }

    #[test]
    fn labels_follow_the_roof_that_explains_the_time() {
        let s = Preset::Small.shape();
        // qkv at small: 7.25 GFLOP; at 40 ms that is 181 GFLOP/s, the measured GEMM rate.
        let qkv = classify(part_work("qkv", &s, 4.0, 4.0).unwrap(), 40.0, roofs()).unwrap();
        assert_eq!(qkv.regime, "compute-bound");
        assert!(qkv.pct_of_compute_roof > 90.0, "{qkv:?}");
        // ln1 at small moves 12.6 MB at least: 1.0 ms is 12.6 GB/s, two thirds of STREAM.
        let ln = classify(part_work("ln1", &s, 4.0, 4.0).unwrap(), 1.0, roofs()).unwrap();
        assert_eq!(ln.regime, "memory-bound");
        // The same LayerNorm taking 10 ms is far from both roofs.
        let slow = classify(part_work("ln1", &s, 4.0, 4.0).unwrap(), 10.0, roofs()).unwrap();
        assert_eq!(slow.regime, UNEXPLAINED);
        assert_eq!(tag(&slow), "U 7%");
        // Stage 0's attention at small (1.6 GFLOP in 223 ms) is unexplained by both roofs: the T × T passes.
        let att = classify(part_work("attention", &s, 4.0, 4.0).unwrap(), 223.0, roofs()).unwrap();
        assert_eq!(att.regime, UNEXPLAINED);
        assert!(classify(part_work("qkv", &s, 4.0, 4.0).unwrap(), 0.0, roofs()).is_none());
    }

    #[test]
    fn a_recorded_overhead_reads_as_unexplained() {
        let old = r#"{"flops":1.0,"min_bytes":1.0,"gflops":1.0,"gbs":1.0,"pct_of_compute_roof":1.0,"pct_of_memory_roof":1.0,"regime":"overhead"}"#;
        let r: PartRegime = serde_json::from_str(old).unwrap();
        assert_eq!(r.regime, UNEXPLAINED);
        assert_eq!(tag(&r), "U 1%");
        let new = serde_json::to_string(&r).unwrap();
        assert!(new.contains(r#""regime":"unexplained""#), "{new}");
    }
}
