//! Unit tests of `shared/src/runner.rs`, compiled into that module (`#[path]`), so they
//! reach its private items.

use super::*;

#[test]
fn refuses_what_cannot_fit() {
    let s = Preset::Te.shape();
    let need = s.estimate_naive_bytes();
    assert!(check_fits("stage0_baseline", &s, need, None, Some((need * 2) as u64)).is_ok());
    let e = check_fits("stage0_baseline", &s, need, None, Some((need / 2) as u64)).unwrap_err().to_string();
    assert!(e.contains("available") && e.contains("lower --batch"), "{e}");
    // te on a 24 GiB CPU box: the naive block needs ~14 GiB of scores alone.
    assert!(check_fits("stage0_baseline", &s, need, None, Some(8 << 30)).is_err());
}

#[test]
fn refuses_a_training_step_that_cannot_fit_naming_its_parts() {
    // te on an 80 GB H100 (~79 GiB free): stage 0's training step keeps many (B, n_head, T, T) tensors.
    let s = Preset::Te.shape();
    let step = s.estimate_naive_train_bytes();
    assert!(step.scores > step.activations && step.scores > step.params);
    let e = check_fits("stage0_baseline", &s, step.total(), Some(step), Some(79 << 30)).unwrap_err().to_string();
    for want in [
        "training step (--train)",
        "(B, n_head, T, T) tensors kept for the backward",
        "79.00 GiB is available",
        "lower --batch or --seq",
        "drop --train",
    ] {
        assert!(e.contains(want), "{want}: {e}");
    }
    // The forward alone would pass the same check: the training step is what does not fit.
    assert!(check_fits("stage0_baseline", &s, s.estimate_naive_bytes(), None, Some(79 << 30)).is_ok());
    // small at T=512 trains on a 24 GiB machine.
    let s = Preset::Small.shape();
    let step = s.estimate_naive_train_bytes();
    assert!(check_fits("stage0_baseline", &s, step.total(), Some(step), Some(23 << 30)).is_ok());
}
