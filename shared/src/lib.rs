//! Everything the stages share and nothing they teach: the block's shapes and weights, the
//! stage contract, device handling, the reference check, timing, performance arithmetic and
//! reporting, and the runner every binary calls.

pub mod breakdown;
pub mod ceiling;
pub mod check;
pub mod cli;
pub mod device;
pub mod error;
pub mod graph;
pub mod output;
pub mod perf;
pub mod preset;
pub mod ran;
pub mod regime;
pub mod report;
pub mod runner;
pub mod selftest;
pub mod stage;
pub mod timing;
pub mod train;
pub mod weights;

/// Held by unit tests that allocate tens of MiB or measure peak RSS, so one does not show up in
/// the other's peak (a crate's tests are threads of one process).
#[cfg(test)]
pub(crate) static BIG_ALLOCATION_TESTS: std::sync::Mutex<()> = std::sync::Mutex::new(());

pub use error::SpeedkitError;
pub use preset::{Preset, Shape};
pub use stage::{Forward, Plan, Precision, PrecisionRequest, Stage, StageEntry, TrainPass};
pub use weights::BlockWeights;
