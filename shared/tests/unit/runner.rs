//! Unit tests of `shared/src/runner.rs`, compiled into that module (`#[path]`), so they
//! reach its private items.

use super::*;

#[test]
fn refuses_what_cannot_fit() {
    let s = Preset::Te.shape();
    let need = s.estimate_naive_bytes();
    assert!(check_fits("stage0_baseline", &s, need, Some((need * 2) as u64)).is_ok());
    let e = check_fits("stage0_baseline", &s, need, Some((need / 2) as u64)).unwrap_err().to_string();
    assert!(e.contains("available") && e.contains("lower --batch"), "{e}");
    // te on a 24 GiB CPU box: the naive block needs ~14 GiB of scores alone.
    assert!(check_fits("stage0_baseline", &s, need, Some(8 << 30)).is_err());
}
