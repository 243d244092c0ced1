//! Block shapes: the named presets, and the checks that turn an impossible or overflowing shape
//! into a clear error before anything is allocated.

use crate::error::SpeedkitError;
use serde::{Deserialize, Serialize};
use std::path::Path;

/// (B, n_head, T, T), (B, T, FF) and (B, T, C) f32 tensors a naive training step holds at its peak
/// (`Shape::estimate_naive_train_bytes`).
const NAIVE_TRAIN_SCORES: u128 = 20;
const NAIVE_TRAIN_FF: u128 = 20;
const NAIVE_TRAIN_C: u128 = 80;

/// `tiny` keeps the tests fast, `small` is one GPT-2 small layer, `gpt2` the seed tutorial's
/// shape, `te` TransformerEngine's getting-started shape.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Preset {
    Tiny,
    Small,
    Gpt2,
    Te,
}

impl Preset {
    pub fn shape(self) -> Shape {
        let (batch, seq, d_model, n_head, ff) = match self {
            Preset::Tiny => (2, 64, 128, 4, 512),
            Preset::Small => (4, 512, 768, 12, 3072),
            Preset::Gpt2 => (8, 512, 768, 12, 3072),
            Preset::Te => (8, 2048, 4096, 32, 16384),
        };
        Shape { batch, seq, d_model, n_head, ff }
    }

    pub fn name(self) -> String {
        format!("{self:?}").to_lowercase()
    }
}

/// The block's dimensions in the literature's names: B, T, C, n_head and the MLP width FF (4·C in GPT-2).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Shape {
    pub batch: usize,
    pub seq: usize,
    pub d_model: usize,
    pub n_head: usize,
    pub ff: usize,
}

/// Largest tensor we accept: cuBLAS and most kernels index with 32-bit ints.
pub const MAX_TENSOR_ELEMENTS: usize = i32::MAX as usize;

/// Up to two divisors of `c` below `h` and two above. C may be huge here (before the size
/// checks): divisors come in pairs (i, C / i), i ≤ min(√C, 10^6).
pub fn near_divisors(c: usize, h: usize) -> Vec<usize> {
    let mut divs: Vec<usize> =
        (1..=1_000_000usize).take_while(|i| i.saturating_mul(*i) <= c).filter(|i| c.is_multiple_of(*i)).flat_map(|i| [i, c / i]).collect();
    divs.sort_unstable();
    divs.dedup();
    let split = divs.partition_point(|&d| d < h);
    divs[split.saturating_sub(2)..split].iter().chain(divs[split..].iter().filter(|&&d| d > h).take(2)).copied().collect()
}

impl Shape {
    /// 0 when n_head is 0 (`validate` refuses it; a JSON file read back may hold one).
    pub fn d_head(&self) -> usize {
        self.d_model.checked_div(self.n_head).unwrap_or(0)
    }

    /// B·T (saturating: `validate` refuses shapes where it would overflow).
    pub fn tokens(&self) -> usize {
        self.batch.saturating_mul(self.seq)
    }

    /// Refuse an impossible shape, naming B and T by the `input` file that fixed them, when one did.
    pub fn validate(&self, input: Option<&Path>) -> Result<(), SpeedkitError> {
        let from = |d: &str, flag: &str| input.map_or(format!("{flag} ({d})"), |p| format!("{d} (from the input file {})", p.display()));
        let (b, t) = (from("B", "--batch"), from("T", "--seq"));
        let Shape { batch, seq, d_model: c, n_head: h, ff } = *self;
        let dims = [(&*b, batch), (&*t, seq), ("--d-model (C)", c), ("--heads (n_head)", h), ("--ff (FF)", ff)];
        if let Some((flag, _)) = dims.iter().find(|(_, v)| *v == 0) {
            return Err(SpeedkitError::usage(format!(
                "{flag} is 0; every dimension of the block must be at least 1. Fix: pass a positive value or drop the flag to use the preset's."
            )));
        }
        if !c.is_multiple_of(h) {
            let more = if h > c { " (there are more heads than channels)" } else { "" };
            return Err(SpeedkitError::usage(format!(
                "C = {c} is not divisible by n_head = {h}{more}: attention splits C into n_head heads of d_head = C / n_head \
                 channels each. Fix: choose --heads among {:?} (the divisors of C nearest {h}) or change --d-model.",
                near_divisors(c, h)
            )));
        }
        // Tensors every stage materialises; W_qkv (3C, C) is the largest weight whenever FF < 3C.
        self.check_elements(
            (&b, &t),
            &[
                ("the activations (B, T, C)", [batch, seq, c, 1]),
                ("the q/k/v projections (B, T, 3C)", [batch, seq, 3, c]),
                ("the MLP hidden state (B, T, FF)", [batch, seq, ff, 1]),
                ("W_qkv (3C, C)", [3, c, c, 1]),
                ("W_fc1 (FF, C)", [ff, c, 1, 1]),
            ],
        )
    }

    /// Naive attention's (stages 0 and 1) (B, n_head, T, T) scores must be addressable too.
    pub fn validate_score_matrix(&self) -> Result<(), SpeedkitError> {
        let dims = [self.batch, self.n_head, self.seq, self.seq];
        self.check_elements(("--batch (B)", "--seq (T)"), &[("the attention scores (B, n_head, T, T)", dims)])
    }

    /// Refuse a tensor past `MAX_TENSOR_ELEMENTS` (checked_mul: past usize too), naming the flags to lower.
    fn check_elements(&self, (b, t): (&str, &str), tensors: &[(&str, [usize; 4])]) -> Result<(), SpeedkitError> {
        for (what, dims) in tensors {
            let n = dims.iter().try_fold(1usize, |acc, &d| acc.checked_mul(d));
            if n.is_some_and(|n| n <= MAX_TENSOR_ELEMENTS) {
                continue;
            }
            let Shape { batch, seq, d_model, n_head, ff } = *self;
            let lower = if what.starts_with('W') { "--d-model or --ff".to_string() } else { format!("{b} or {t}") };
            let squared = " (the T x T scores grow with T squared; fused attention in stage 2+ never stores them)";
            let squared = if what.contains("T, T") { squared } else { "" };
            return Err(SpeedkitError::usage(format!(
                "{what} would hold {} elements for B={batch} T={seq} C={d_model} n_head={n_head} FF={ff}, past the 2^31 - 1 \
                 limit of 32-bit GEMM and kernel indexing. Fix: lower {lower}{squared}.",
                n.map_or("more than 2^64".to_string(), |n| n.to_string()),
            )));
        }
        Ok(())
    }

    /// Bytes of the naive fp32 block at its widest: weights, plus three (B, n_head, T, T) tensors
    /// and a few (B, T, C) in attention, or ~4 (B, T, FF) in the MLP.
    pub fn estimate_naive_bytes(&self) -> u128 {
        let (b, t, c, h, ff) = (self.batch as u128, self.seq as u128, self.d_model as u128, self.n_head as u128, self.ff as u128);
        // u128 holds every product of validated dims; saturating keeps unvalidated ones sane.
        let weights = (4 * c * c).saturating_add(2 * c * ff).saturating_add(9 * c + ff);
        let attention = (3 * b * h).saturating_mul(t * t).saturating_add(8 * b * t * c);
        let mlp = (4 * b * t).saturating_mul(ff).saturating_add(4 * b * t * c);
        weights.saturating_add(attention.max(mlp)).saturating_mul(4)
    }

    /// One training step of the naive fp32 block (stages 0 and 1, and the reference's gradients), by
    /// part. candle's autograd keeps every forward tensor until the backward ends, and each op's
    /// backward adds temporaries of its output's size:
    /// - params: weights, gradients and AdamW's m and v, 4 f32 copies of 4C² + 2C·FF (+ vectors);
    /// - scores: the forward keeps six (B, n_head, T, T) tensors (q·kᵀ, scaled, masked, shifted, exp,
    ///   p); the backward of the broadcast max/sum/division adds more of that size (the divisor's
    ///   square, gradient accumulators, and the reductions back from each broadcast);
    /// - activations: the (B, T, FF) chain of fc1 and GELU (x², x³, inner, tanh, ...) with their
    ///   gradients, and the LayerNorms' and residuals' (B, T, C) tensors.
    ///
    /// The counts are fitted to stage 0's measured CPU peaks (peak RSS growth, VmHWM), varying
    /// n_head, FF and T one at a time at B=1: within 2 % of each. At B=4 T=2048 C=768 n_head=12
    /// FF=3072 it gives 18.86 GiB against the 18.78 GiB recorded in results/train-memory/ (+0.4 %);
    /// at T=512, 1.98 GiB against 1.60 GiB in results/ladder-cpu-train.json (+24 %: an
    /// overestimate, the safe side for the fit check; that run's machine peaked lower than the one
    /// the counts were fitted on). At `te` it is 123 GiB, 80 of them the T × T tensors. On an H100
    /// (results/h100-db5a7c9/train-te/train-te-b4.json) stage 0 at `te`, B=4 peaked at 67.91 GiB
    /// against 63.0 estimated (−7 %, inside the fit check's 10 % headroom), stage 1 at 61.85 GiB (−2 %).
    pub fn estimate_naive_train_bytes(&self) -> crate::train::TrainBytes {
        let (b, t, c, h, ff) = (self.batch as u128, self.seq as u128, self.d_model as u128, self.n_head as u128, self.ff as u128);
        let weights = (4 * c * c).saturating_add(2 * c * ff).saturating_add(9 * c + ff);
        crate::train::TrainBytes {
            params: weights.saturating_mul(4 * 4),
            scores: (NAIVE_TRAIN_SCORES * b * h).saturating_mul(t * t).saturating_mul(4),
            activations: (NAIVE_TRAIN_FF * b * t).saturating_mul(ff).saturating_add(NAIVE_TRAIN_C * b * t * c).saturating_mul(4),
        }
    }

    /// What a run holds beside each stage's working set: f32 weights, x and the reference output.
    pub fn estimate_session_bytes(&self) -> u128 {
        let (b, t, c, ff) = (self.batch as u128, self.seq as u128, self.d_model as u128, self.ff as u128);
        4 * (4 * c * c + 2 * c * ff + 9 * c + ff + 2 * b * t * c)
    }
}

impl std::fmt::Display for Shape {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "B={} T={} C={} n_head={} d_head={} FF={}", self.batch, self.seq, self.d_model, self.n_head, self.d_head(), self.ff)
    }
}

#[cfg(test)]
#[path = "../tests/unit/preset.rs"]
mod tests;
