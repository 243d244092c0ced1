//! Each part's regime: is its time explained by the compute roof, the memory roof, or neither?
//!
//! For one part of the block (`--breakdown`'s ln1, qkv, attention, ...) this counts
//! - **FLOPs**: the part's useful arithmetic. GEMMs 2·M·N·K (attention: 2·B·T²·C with the causal
//!   half, as `perf::block_flops` counts it), LayerNorm 7 per element (mean, x − μ, (x − μ)²
//!   accumulated, × rstd, × γ, + β), bias or residual 1 per element, GELU 9 per element (bias,
//!   the cubic, tanh counted as one, the products). The part FLOPs of the block add up to
//!   `block_flops` plus these element-wise few.
//! - **Minimum bytes**: what the part must read and write at least, once each, if nothing stays in
//!   cache between parts: its input activations, its weights, its output. Activations in `act`
//!   bytes per element, GEMM operands (the input a GEMM reads and its weight) in `operand` bytes.
//!   Attention's minimum is q, k, v in and its output out — stage 0's T × T score passes are not
//!   part of the minimum, they are what fused attention deletes.
//!
//! Against the two measured ceilings (on a CPU the probe's GEMM rate and STREAM bandwidth; on a
//! GPU a probe's figures when the run has them, else the datasheet's, labelled as such), the part's
//! roofline time is max(FLOPs / compute roof, bytes / memory roof), and its label:
//! - **compute-bound** when the compute term is the larger and the part reaches at least
//!   `EXPLAINED` of its roofline time's rate,
//! - **memory-bound** when the memory term is the larger and it reaches at least `EXPLAINED`,
//! - **overhead** when it reaches less: neither roof explains its time, which goes to work beyond
//!   the minimum (extra passes over memory, launches and syncs, scalar code, thread dispatch).

use crate::preset::Shape;
use crate::report::Record;
use crate::stage::Precision;
use serde::{Deserialize, Serialize};

/// A part whose time is within 1 / EXPLAINED of its roofline time is bound by that roof; one
/// slower than that is "overhead". A third: a GEMM library reaches 70–100 % of the measured rate,
/// a good element-wise pass 40–90 % of STREAM; an unfused or scalar part lands well below.
pub const EXPLAINED: f64 = 0.3;

/// The block's parts in forward order, longest name first where one name starts another.
const PART_NAMES: [&str; 7] = ["ln1", "qkv", "attention", "proj+residual", "ln2", "fc1+gelu", "fc2+residual"];

/// Work and traffic of one part.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct PartWork {
    pub flops: f64,
    pub min_bytes: f64,
}

/// The roofs a part is measured against.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Roofs {
    /// Compute roof in GFLOP/s at the part's precision.
    pub gflops: f64,
    /// Memory roof in GB/s.
    pub gbs: f64,
    /// Where they come from, e.g. "measured: GEMM at the block's shapes + STREAM triad".
    pub source: String,
}

/// What the breakdown table and JSON carry per part.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct PartRegime {
    pub flops: f64,
    pub min_bytes: f64,
    pub gflops: f64,
    pub gbs: f64,
    /// Achieved GFLOP/s as a % of the compute roof, and GB/s as a % of the memory roof.
    pub pct_of_compute_roof: f64,
    pub pct_of_memory_roof: f64,
    /// "compute-bound", "memory-bound" or "overhead".
    pub regime: String,
}

/// Bytes of one GEMM operand element at `p` (fp8: E4M3, one byte).
pub fn operand_bytes(p: Precision) -> f64 {
    match p {
        Precision::Fp32 | Precision::Tf32 => 4.0,
        Precision::Bf16 | Precision::F16 => 2.0,
        Precision::Fp8 => 1.0,
    }
}

/// The block's parts a (possibly fused) part name holds, e.g. "proj+residual+ln2" →
/// ["proj+residual", "ln2"]. `None` if the name is not made of the block's parts.
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

/// FLOPs and minimum bytes of one of the block's parts (not fused), see the module notes.
fn single(part: &str, s: &Shape, operand: f64, act: f64) -> PartWork {
    let (b, t, c, ff) = (s.batch as f64, s.seq as f64, s.d_model as f64, s.ff as f64);
    let n = b * t;
    // GEMM (n, k) x (k, m) with `extra` element-wise FLOPs per output and `more_in` extra
    // activation elements read (a residual).
    let gemm = |k: f64, m: f64, extra: f64, more_in: f64| PartWork {
        flops: 2.0 * n * k * m + extra * n * m,
        min_bytes: n * k * operand + k * m * operand + n * m * act + more_in * act,
    };
    match part {
        "ln1" | "ln2" => PartWork { flops: 7.0 * n * c, min_bytes: n * c * act + n * c * operand },
        "qkv" => gemm(c, 3.0 * c, 1.0, 0.0),
        "attention" => PartWork { flops: 2.0 * b * t * t * c, min_bytes: 4.0 * n * c * act },
        "proj+residual" => gemm(c, c, 2.0, n * c),
        "fc1+gelu" => gemm(c, ff, 9.0, 0.0),
        "fc2+residual" => gemm(ff, c, 2.0, n * c),
        _ => unreachable!("components() only yields the block's part names"),
    }
}

/// FLOPs and minimum bytes of a part, fused or not. A fused part's minimum drops the hand-off
/// between its pieces: the next piece does not read back the (N, C) activation the previous one
/// wrote (e.g. stage 3's add + LayerNorm reads x once).
pub fn part_work(name: &str, s: &Shape, operand: f64, act: f64) -> Option<PartWork> {
    let parts = components(name)?;
    let handoffs = (parts.len() - 1) as f64;
    let n_c = (s.batch * s.seq * s.d_model) as f64;
    let mut w = PartWork { flops: 0.0, min_bytes: -handoffs * n_c * act };
    for p in parts {
        let one = single(p, s, operand, act);
        w.flops += one.flops;
        w.min_bytes += one.min_bytes;
    }
    Some(w)
}

/// The label and rates of a part that took `ms`.
pub fn classify(work: PartWork, ms: f64, roofs: &Roofs) -> Option<PartRegime> {
    if !(ms > 0.0 && roofs.gflops > 0.0 && roofs.gbs > 0.0) {
        return None;
    }
    let gflops = work.flops / ms / 1e6;
    let gbs = work.min_bytes / ms / 1e6;
    let (pct_of_compute_roof, pct_of_memory_roof) = (100.0 * gflops / roofs.gflops, 100.0 * gbs / roofs.gbs);
    // The roofline time, in ms: the larger of the two terms decides which roof applies.
    let (t_compute, t_memory) = (work.flops / roofs.gflops / 1e6, work.min_bytes / roofs.gbs / 1e6);
    let explained = t_compute.max(t_memory) / ms;
    let regime = match (explained >= EXPLAINED, t_compute >= t_memory) {
        (false, _) => "overhead",
        (true, true) => "compute-bound",
        (true, false) => "memory-bound",
    };
    Some(PartRegime {
        flops: work.flops,
        min_bytes: work.min_bytes,
        gflops,
        gbs,
        pct_of_compute_roof,
        pct_of_memory_roof,
        regime: regime.into(),
    })
}

/// The table cell's tag: "C 98%" (compute-bound, % of the compute roof), "M 40%" (memory-bound,
/// % of the memory roof), "O 4%" (overhead, % of the roof its intensity puts it under).
pub fn tag(r: &PartRegime) -> String {
    let (letter, pct) = match r.regime.as_str() {
        "compute-bound" => ("C", r.pct_of_compute_roof),
        "memory-bound" => ("M", r.pct_of_memory_roof),
        _ => ("O", r.pct_of_compute_roof.max(r.pct_of_memory_roof)),
    };
    format!("{letter} {pct:.0}%")
}

/// The roofs a record's parts are measured against: the compute roof its % of peak uses
/// (on a CPU the measured GEMM rate, on a GPU the datasheet or `--peak-tflops`), and the memory
/// roof `bandwidth_gbs` (the run's: a flag, the CPU's STREAM triad, a GPU's datasheet), else
/// the CPU probe's own. `None` when either is unknown.
pub fn roofs(r: &Record, bandwidth_gbs: Option<f64>) -> Option<Roofs> {
    // An emulated stage has no peak of its own; on a CPU its GEMMs run at the probe's rate.
    let gflops = r.peak_tflops.map(|t| t * 1e3).or(r.ceiling.as_ref().map(|c| c.gemm_gflops))?;
    let gbs = bandwidth_gbs.or(r.ceiling.as_ref().map(|c| c.bandwidth_gbs))?;
    let compute = r.peak_source.clone().unwrap_or_else(|| "datasheet".into());
    let memory = match (&r.ceiling, r.device.is_cuda()) {
        (Some(c), false) if bandwidth_gbs.is_none_or(|b| b == c.bandwidth_gbs) => "measured STREAM triad",
        (_, true) => "memory bandwidth (datasheet unless --bandwidth-gbs)",
        _ => "--bandwidth-gbs",
    };
    Some(Roofs { gflops, gbs, source: format!("compute: {compute}; memory: {memory}") })
}

/// Fill every breakdown part's `regime` of `r` (nothing without a breakdown or roofs). GEMM
/// operands are stored at the record's precision; activations too, except FP8 (stage 4 keeps
/// stage 3's activations: 16-bit on a GPU, f32 on a CPU).
pub fn annotate(r: &mut Record, bandwidth_gbs: Option<f64>) {
    let Some(roofs) = roofs(r, bandwidth_gbs) else { return };
    let operand = operand_bytes(r.precision);
    let act = match r.precision {
        Precision::Fp8 if r.device.is_cuda() => 2.0,
        Precision::Fp8 => 4.0,
        p => operand_bytes(p),
    };
    let shape = r.shape;
    if let Some(b) = r.breakdown.as_mut() {
        for p in &mut b.parts {
            p.regime = part_work(&p.name, &shape, operand, act).and_then(|w| classify(w, p.median_ms, &roofs));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::preset::Preset;

    fn roofs() -> Roofs {
        Roofs { gflops: 173.0, gbs: 19.0, source: "test".into() }
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
        let qkv = classify(part_work("qkv", &s, 4.0, 4.0).unwrap(), 40.0, &roofs()).unwrap();
        assert_eq!(qkv.regime, "compute-bound");
        assert!(qkv.pct_of_compute_roof > 90.0, "{qkv:?}");
        // ln1 at small moves 12.6 MB at least: 1.0 ms is 12.6 GB/s, two thirds of STREAM.
        let ln = classify(part_work("ln1", &s, 4.0, 4.0).unwrap(), 1.0, &roofs()).unwrap();
        assert_eq!(ln.regime, "memory-bound");
        // The same LayerNorm taking 10 ms is far from both roofs.
        let slow = classify(part_work("ln1", &s, 4.0, 4.0).unwrap(), 10.0, &roofs()).unwrap();
        assert_eq!(slow.regime, "overhead");
        assert_eq!(tag(&slow), "O 7%");
        // Stage 0's attention at small (1.6 GFLOP in 223 ms) is overhead: the T × T passes.
        let att = classify(part_work("attention", &s, 4.0, 4.0).unwrap(), 223.0, &roofs()).unwrap();
        assert_eq!(att.regime, "overhead");
        assert!(classify(part_work("qkv", &s, 4.0, 4.0).unwrap(), 0.0, &roofs()).is_none());
    }
}
