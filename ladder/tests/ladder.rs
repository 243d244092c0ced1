//! The ladder binary end to end on `tiny`: table on stdout, JSON that parses into the report.

use shared::report::{LadderReport, LADDER_SCHEMA};
use std::process::Command;

#[test]
fn ladder_end_to_end_on_tiny() {
    let dir = std::env::temp_dir().join(format!("speedkit-ladder-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let json = dir.join("ladder.json");
    let o = Command::new(env!("CARGO_BIN_EXE_ladder"))
        .args(["--preset", "tiny", "--warmup", "1", "--iters", "3", "--json", json.to_str().unwrap()])
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&o.stdout);
    assert!(o.status.success(), "{stdout}{}", String::from_utf8_lossy(&o.stderr));
    assert!(stdout.contains("vs s0") && stdout.contains("stage0_baseline"), "{stdout}");

    let report: LadderReport = serde_json::from_slice(&std::fs::read(&json).unwrap()).unwrap();
    assert_eq!(report.schema, LADDER_SCHEMA);
    let names: Vec<&str> = report.records.iter().map(|r| r.stage.as_str()).chain(report.skipped.iter().map(|s| s.stage.as_str())).collect();
    let expected: Vec<&str> = ladder::stages().iter().map(|s| s.name).collect();
    assert_eq!(names, expected, "every stage is a row, run or skipped");
    let s0 = &report.records[0];
    assert_eq!(s0.speedup_vs_stage0, Some(1.0));
    assert_eq!(s0.timing.samples_ms.len(), 3);
    assert!(s0.check.as_ref().unwrap().passed);
    assert_eq!(report.shape, shared::Preset::Tiny.shape());
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn report_lists_every_stage_with_its_reason() {
    let o = Command::new(env!("CARGO_BIN_EXE_ladder")).args(["report", "--preset", "tiny"]).output().unwrap();
    let stdout = String::from_utf8_lossy(&o.stdout);
    assert!(o.status.success(), "{stdout}{}", String::from_utf8_lossy(&o.stderr));
    assert!(stdout.contains("switches  now: TF32 off"), "{stdout}");
    for spec in ladder::stages() {
        assert!(stdout.contains(spec.name), "{} missing:\n{stdout}", spec.name);
    }
    assert!(stdout.contains("auto on CPU: no tensor cores"), "{stdout}");
    // An override the device cannot do is reported per stage, not a crash.
    let o = Command::new(env!("CARGO_BIN_EXE_ladder")).args(["report", "--preset", "tiny", "--precision", "tf32"]).output().unwrap();
    let stdout = String::from_utf8_lossy(&o.stdout);
    assert!(o.status.success(), "{stdout}");
    assert!(stdout.contains("stage1_tensorcore  skipped: --precision tf32 cannot run"), "{stdout}");
}

#[test]
fn report_knows_which_stages_need_the_score_matrix() {
    // T = 100 000: a 4·10¹⁰-element score matrix. Stages 0-1 cannot run it; stage 2 never
    // builds that matrix, so the report must not refuse it for that.
    let o = Command::new(env!("CARGO_BIN_EXE_ladder")).args(["report", "--preset", "tiny", "--seq", "100000"]).output().unwrap();
    let stdout = String::from_utf8_lossy(&o.stdout);
    assert!(o.status.success(), "{stdout}");
    let block = |stage: &str| -> String {
        let start = stdout.find(stage).unwrap();
        let rest = &stdout[start + stage.len()..];
        let end = rest.find("\n  stage").unwrap_or(rest.len());
        rest[..end].to_string()
    };
    assert!(block("stage0_baseline").contains("cannot run this shape"), "{stdout}");
    assert!(block("stage1_tensorcore").contains("cannot run this shape"), "{stdout}");
    assert!(!block("stage2_sdpa").contains("cannot run this shape"), "{stdout}");
}
