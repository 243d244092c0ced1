//! The rows of `ladder selftest`: each GPU building block alone, on small shapes, against its
//! CPU twin; each stage adds its own (`Stage::selftest`).

use crate::check::compare_within;
use crate::weights::SplitMix64;
use candle_core::{Device, Tensor};
use serde::Serialize;

#[derive(Clone, Debug, Serialize)]
pub struct Check {
    pub block: String,
    pub case: String,
    /// What ran: "cuda", or the CPU stand-in's name.
    pub ran: String,
    /// "pass", "FAIL", "skipped", "unsupported" or "error".
    pub status: String,
    pub rel_err: Option<f64>,
    pub tolerance: Option<f64>,
    /// The error message, the skip reason, or a note.
    pub detail: String,
}

pub struct Rows {
    pub rows: Vec<Check>,
    /// What the next rows ran on: "cuda", or the CPU stand-in's name.
    pub ran: String,
}

impl Rows {
    fn push(&mut self, block: &str, case: String, status: &str, errs: Option<(f64, f64)>, detail: String) {
        let (rel_err, tolerance) = errs.unzip();
        self.rows.push(Check { block: block.into(), case, ran: self.ran.clone(), status: status.into(), rel_err, tolerance, detail });
    }

    /// Pass when rel. error < tolerance and all values finite. Any error is a failure, whatever
    /// its kind (a CUDA error wrapped as "cannot run here" once showed as skipped); only `skip` skips.
    pub fn compare(&mut self, block: &str, case: String, f: impl FnOnce() -> anyhow::Result<(Tensor, Tensor, f64)>) {
        match f().and_then(|(got, want, tol)| Ok((compare_within(&got, &want, tol)?, tol))) {
            Ok((c, tol)) => {
                let detail = if c.non_finite > 0 { format!("{} values NaN or infinite", c.non_finite) } else { String::new() };
                self.push(block, case, if c.passed { "pass" } else { "FAIL" }, Some((c.rel_err, tol)), detail)
            }
            Err(e) => self.push(block, case, "error", None, message(&e)),
        }
    }

    /// A row this device lacks the hardware for (`why` names it, e.g. FP8 tensor cores below SM 8.9).
    pub fn skip(&mut self, block: &str, case: String, why: String) {
        self.push(block, case, "skipped", None, crate::error::strip_backtrace(&why))
    }

    /// A configuration this device's libraries do not offer (no cuBLASLt algorithm) and the stage
    /// replaces at run time: not a failure; `why` says what runs instead.
    pub fn unsupported(&mut self, block: &str, case: String, why: String) {
        self.push(block, case, "unsupported", None, crate::error::strip_backtrace(&why))
    }

    /// A check with no tolerance: passed with a note, or any error a failure.
    pub fn outcome(&mut self, block: &str, case: String, r: anyhow::Result<String>) {
        match r {
            Ok(detail) => self.push(block, case, "pass", None, detail),
            Err(e) => self.push(block, case, "error", None, message(&e)),
        }
    }
}

/// An error as one paragraph, without the backtrace candle appends when RUST_BACKTRACE is set.
pub fn message(e: &anyhow::Error) -> String {
    crate::error::strip_backtrace(&format!("{e:#}"))
}

pub fn randn(dims: &[usize], seed: u64, scale: f32, offset: f32) -> candle_core::Result<Tensor> {
    let n = dims.iter().product();
    let v: Vec<f32> = SplitMix64::new(seed).normals(n).into_iter().map(|x| x * scale + offset).collect();
    Tensor::from_vec(v, dims, &Device::Cpu)
}
