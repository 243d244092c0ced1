//! Unit tests of `shared/src/report.rs`, compiled into that module (`#[path]`), so they
//! reach its private items.

use super::*;

/// The embedded commit is this checkout's HEAD (when git is here, as in CI's clone), or
/// "unknown".
#[test]
fn the_commit_is_embedded_at_build_time() {
    let c = commit();
    let head = std::process::Command::new("git")
        .args(["rev-parse", "--short=12", "HEAD"])
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string());
    match head {
        Some(h) => assert!(c == h || c == format!("{h}-dirty"), "embedded {c}, HEAD {h}"),
        None => assert_eq!(c, "unknown"),
    }
}

#[test]
fn noise_is_overlapping_p10_p90_intervals() {
    let st =
        |p10: f64, med: f64, p90: f64| Stats { median_ms: med, p10_ms: p10, p90_ms: p90, min_ms: p10, max_ms: p90, samples_ms: vec![] };
    assert!(overlaps(&st(10.0, 11.0, 12.0), &st(11.5, 13.0, 14.0)));
    assert!(!overlaps(&st(10.0, 11.0, 12.0), &st(12.5, 13.0, 14.0)));
    assert_eq!(speedup_text(Some(1.18), true), "≈1.0x");
    assert_eq!(speedup_text(Some(1.18), false), "1.18x");
    assert_eq!(speedup_text(None, false), "–");
}

#[test]
fn json_write_to_a_directory_is_usage_error_naming_the_path() {
    let e = write_json(&std::env::temp_dir(), &1).unwrap_err();
    let (code, msg) = crate::error::classify(&e);
    assert_eq!(code, crate::error::EXIT_USAGE);
    assert!(msg.contains("is a directory") && msg.contains("Fix:"), "{msg}");
}

/// The table's header follows the records' `mode`, with or without their `train` record; a
/// report's mode is `None` when its records mix modes.
#[test]
fn table_header_follows_the_mode() {
    let rec = |mode| Record { stage: "stage0_baseline".into(), mode, timing: Stats::from_samples(vec![1.0]), ..Default::default() };
    let report = |modes: &[Mode]| LadderReport { records: modes.iter().map(|&m| rec(m)).collect(), ..Default::default() };
    let train = report(&[Mode::Train, Mode::Train]);
    assert_eq!(train.mode(), Some(Mode::Train));
    let md = train.table(true);
    assert!(md.starts_with("| stage | precision | forward + backward ms (p10–p90) |") && md.contains("| optimizer ms |"), "{md}");
    assert!(md.lines().nth(2).unwrap().ends_with("| – | – |"), "{md}");
    let forward = report(&[Mode::Forward]);
    assert_eq!(forward.mode(), Some(Mode::Forward));
    let t = forward.table(false);
    assert!(t.lines().next().unwrap().contains("median ms (p10–p90)") && !t.contains("backward") && !t.contains("optimizer"), "{t}");
    assert_eq!(report(&[Mode::Forward, Mode::Train]).mode(), None);
    // No record at all: the arguments say what was asked.
    assert_eq!(LadderReport { args: vec!["--train".into()], ..Default::default() }.mode(), Some(Mode::Train));
    assert_eq!(LadderReport::default().mode(), Some(Mode::Forward));
    assert_eq!((Mode::Forward.per(), Mode::Train.per()), ("forward", "training step"));
}
