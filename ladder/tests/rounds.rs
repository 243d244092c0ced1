//! Every way a stage can leave the ladder's interleaved rounds, on the CPU: refused in round 1,
//! broken in a later round, every stage out, ablation variants out, and in a sweep. Each is a
//! row (skipped or FAILED, with why); the table, JSON and charts are still made; the run's
//! error says what happened (exit 2 for "cannot run here", 3 for a failed check, 1 otherwise).
//! On the first GPU run a skipped stage 4 made `ladder` panic in `merge_rounds` (issue 24).
//!
//! The stages that fail here are the real stages with their `build` replaced by one that
//! errs on its Nth call: the ladder builds each stage once per round, so call N is round N.

use anyhow::Result;
use clap::{Args, FromArgMatches};
use ladder::{run_stages, stages, Measure};
use shared::cli::RunArgs;
use shared::report::LadderReport;
use shared::stage::{Forward, Plan};
use shared::weights::BlockWeights;
use shared::SpeedkitError;
use std::process::Command;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;

/// One in-process run at a time: candle's GEMM switches are process-wide, and each stage's
/// build checks it left them as it declares.
static RUN: Mutex<()> = Mutex::new(());

fn args(flags: &[&str]) -> RunArgs {
    let base = ["t", "--preset", "tiny", "--warmup", "0", "--iters", "3"];
    let m = RunArgs::augment_args(clap::Command::new("t")).try_get_matches_from(base.iter().chain(flags)).unwrap();
    RunArgs::from_arg_matches(&m).unwrap()
}

fn run(all: &[shared::StageSpec], which: &[usize], ablate: bool) -> (LadderReport, Option<anyhow::Error>) {
    let _one = RUN.lock().unwrap_or_else(|e| e.into_inner());
    run_stages(args(&[]), all, which, Measure { rounds: 3, ablate }).expect("a stage leaving is a row, not an error of the run")
}

/// Calls of each test's replacement `build`, one counter per test.
static CALLS: [AtomicUsize; 8] = [const { AtomicUsize::new(0) }; 8];

/// How a replaced build errs.
#[derive(Clone, Copy)]
enum How {
    Refused, // SpeedkitError::Usage: the stage cannot run here ("skipped")
    Wrong,   // SpeedkitError::CheckFailed ("FAILED", exit 3)
    Broke,   // any other error ("FAILED", exit 1)
}

fn err(how: How, what: String) -> anyhow::Error {
    match how {
        How::Refused => SpeedkitError::usage(format!("refused by the test: {what}")).into(),
        How::Wrong => SpeedkitError::CheckFailed(format!("wrong by the test: {what}")).into(),
        How::Broke => anyhow::anyhow!("broken by the test: {what}"),
    }
}

fn how(h: usize) -> How {
    [How::Refused, How::Wrong, How::Broke][h]
}

/// Stage `STAGE`'s real build, except that call `N` (round N) errs as `H` says.
fn fail_on_call<const ID: usize, const STAGE: usize, const N: usize, const H: usize>(
    w: &BlockWeights,
    p: &Plan,
) -> Result<Box<dyn Forward>> {
    let call = CALLS[ID].fetch_add(1, Ordering::SeqCst) + 1;
    if call == N {
        return Err(err(how(H), format!("call {call}")));
    }
    (stages()[STAGE].build)(w, p)
}

/// Stage `STAGE`'s real build, except for its ablation variants (`Plan::options` differs from
/// the default), which err as `H` says from call `N` of the variant on.
fn fail_variants<const ID: usize, const STAGE: usize, const N: usize, const H: usize>(
    w: &BlockWeights,
    p: &Plan,
) -> Result<Box<dyn Forward>> {
    let variant = p.options.attention_copies || p.options.fusions != shared::stage::Fusions::default();
    if variant && CALLS[ID].fetch_add(1, Ordering::SeqCst) + 1 >= N {
        return Err(err(how(H), "a variant".into()));
    }
    (stages()[STAGE].build)(w, p)
}

fn with_build(i: usize, build: fn(&BlockWeights, &Plan) -> Result<Box<dyn Forward>>) -> Vec<shared::StageSpec> {
    let mut all = stages();
    all[i].build = build;
    all
}

/// What every output of a report makes of it, without a panic: the table, the markdown, the
/// JSON round trip, and both charts.
fn outputs(r: &LadderReport) -> String {
    let text = r.table();
    let md = ladder::render::markdown_table(r);
    let back: LadderReport = serde_json::from_str(&serde_json::to_string(r).unwrap()).unwrap();
    // (Floats may differ in their last digit through serde_json; the rows may not.)
    assert_eq!((names(&back), &back.skipped, &back.ablation_out), (names(r), &r.skipped, &r.ablation_out));
    ladder::chart::ladder_svg(r).unwrap();
    ladder::roofline::roofline_svg(r).unwrap();
    format!("{text}\n{md}\n{}", ladder::render::ablation_markdown(r))
}

fn names(r: &LadderReport) -> Vec<&str> {
    r.records.iter().map(|x| x.stage.as_str()).collect()
}

#[test]
fn refused_in_round_one_is_a_skipped_row_and_the_rest_run() {
    let (r, failure) = run(&with_build(1, fail_on_call::<0, 1, 1, 0>), &[0, 1, 2], false);
    assert!(failure.is_none(), "a refused stage is not a failure of the run");
    assert_eq!(names(&r), ["stage0_baseline", "stage2_sdpa"]);
    assert_eq!(r.skipped.len(), 1);
    assert_eq!((r.skipped[0].stage.as_str(), r.skipped[0].failed), ("stage1_tensorcore", false));
    assert!(r.skipped[0].reason.contains("refused by the test: call 1"), "{}", r.skipped[0].reason);
    // Stage 2 has no stage 1 to compare with, but still has its speedup over stage 0.
    let s2 = &r.records[1];
    assert!(s2.speedup_vs_prev.is_none() && s2.speedup_vs_stage0.is_some());
    assert_eq!(s2.iters, 3, "the stages that stayed ran every round");
    let out = outputs(&r);
    assert!(out.contains("skipped: refused by the test"), "{out}");
}

#[test]
fn failed_in_a_later_round_is_a_failed_row_without_its_earlier_rounds() {
    // Stage 2 passes round 1 and breaks in round 2 (a check failure), then is not run again.
    let (r, failure) = run(&with_build(2, fail_on_call::<1, 2, 2, 1>), &[0, 1, 2, 3], false);
    let failure = failure.expect("a failed stage is the run's error");
    assert_eq!(shared::error::classify(&failure).0, shared::error::EXIT_CHECK_FAILED);
    assert_eq!(names(&r), ["stage0_baseline", "stage1_tensorcore", "stage3_fused"]);
    assert_eq!((r.skipped[0].stage.as_str(), r.skipped[0].failed), ("stage2_sdpa", true));
    assert_eq!(CALLS[1].load(Ordering::SeqCst), 2, "not built again after it failed");
    // Stage 3's "vs previous" is against stage 2 only, which has no row.
    assert!(r.records[2].speedup_vs_prev.is_none());
    let out = outputs(&r);
    assert!(out.contains("FAILED: wrong by the test: call 2"), "{out}");

    // The same in the last round, with an error that is not a check (exit 1).
    let (r, failure) = run(&with_build(0, fail_on_call::<2, 0, 3, 2>), &[0, 1], false);
    assert_eq!(shared::error::classify(&failure.unwrap()).0, shared::error::EXIT_FAILURE);
    assert_eq!(names(&r), ["stage1_tensorcore"]);
    assert!(r.records[0].speedup_vs_stage0.is_none(), "no stage 0 row, no speedup over it");
    assert!(r.skipped[0].failed && r.skipped[0].reason.contains("broken by the test: call 3"), "{:?}", r.skipped);
    outputs(&r);
}

#[test]
fn every_stage_out_is_a_table_of_reasons() {
    let mut all = stages();
    all[0].build = fail_on_call::<3, 0, 1, 0>;
    all[1].build = fail_on_call::<4, 1, 2, 2>;
    let (r, failure) = run(&all, &[0, 1], false);
    assert!(r.records.is_empty());
    assert_eq!(
        r.skipped.iter().map(|s| (s.stage.as_str(), s.failed)).collect::<Vec<_>>(),
        [("stage0_baseline", false), ("stage1_tensorcore", true)]
    );
    assert!(failure.is_some());
    let out = outputs(&r);
    assert!(out.contains("skipped: refused") && out.contains("FAILED: error: broken by the test: call 2"), "{out}");
}

#[test]
fn ablation_variants_out_are_rows_of_the_ablation_table() {
    // Stage 2's variant (copies kept) breaks in round 2; stage 3's variants are refused.
    let mut all = stages();
    all[2].build = fail_variants::<5, 2, 2, 1>;
    all[3].build = fail_variants::<6, 3, 1, 0>;
    let (r, failure) = run(&all, &[0, 2, 3], true);
    assert!(failure.is_some(), "a failed variant fails the run");
    assert_eq!(names(&r), ["stage0_baseline", "stage2_sdpa", "stage3_fused"], "the stages as written all ran");
    assert!(r.skipped.is_empty());
    let copies = r.ablation_out.iter().find(|o| o.against == "stage2_sdpa" && o.change.contains("copies")).expect("stage 2's variant");
    assert!(copies.failed);
    let fusions = r.ablation_out.iter().filter(|o| o.against == "stage3_fused" && !o.failed).count();
    assert_eq!(fusions, shared::stage::Fusions::default().on().len(), "{:?}", r.ablation_out);
    assert!(r.ablation.iter().all(|a| a.against != "stage3_fused"));
    let out = outputs(&r);
    assert!(out.contains("FAILED: wrong by the test") && out.contains("skipped: refused by the test"), "{out}");
}

#[test]
fn the_binary_writes_its_files_and_exits_0_when_stages_are_skipped() {
    // The reproduction from the H100 run on the CPU: only stages 0 and 4 take fp8.
    let dir = std::env::temp_dir().join(format!("speedkit-rounds-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let (json, svg) = (dir.join("l.json"), dir.join("l.svg"));
    let o = Command::new(env!("CARGO_BIN_EXE_ladder"))
        .args(["--preset", "tiny", "--warmup", "0", "--iters", "2", "--precision", "fp8", "--ablate"])
        .args(["--json", json.to_str().unwrap(), "--svg", svg.to_str().unwrap()])
        .output()
        .unwrap();
    let (out, errs) = (String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr));
    assert_eq!(o.status.code(), Some(0), "{out}{errs}");
    let r: LadderReport = serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    assert_eq!(names(&r), ["stage0_baseline", "stage4_fp8"]);
    assert_eq!(r.skipped.len(), 3);
    // Every variant of a refused stage is refused too; stage 4's (its FP8 fusions) run.
    assert!(r.ablation.iter().all(|a| a.against == "stage4_fp8") && r.ablation.len() == 2, "{:?}", r.ablation);
    assert!(r.ablation_out.len() > 1 && r.ablation_out.iter().all(|o| o.against != "stage4_fp8"), "{:?}", r.ablation_out);
    assert!(std::fs::read_to_string(&svg).unwrap().contains("skipped"));

    // A sweep in which a stage is skipped at every value.
    let sweep = dir.join("s.json");
    let o = Command::new(env!("CARGO_BIN_EXE_ladder"))
        .args(["--preset", "tiny", "--warmup", "0", "--iters", "1", "--precision", "fp8", "--stages", "0,1"])
        .args(["--sweep", "seq=16,32", "--json", sweep.to_str().unwrap(), "--svg", dir.join("s.svg").to_str().unwrap()])
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(0), "{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr));
    let s: shared::report::SweepReport = serde_json::from_str(&std::fs::read_to_string(&sweep).unwrap()).unwrap();
    assert_eq!(s.runs.len(), 2);
    for run in &s.runs {
        assert_eq!((names(run), run.skipped[0].stage.as_str()), (vec!["stage0_baseline"], "stage1_tensorcore"));
    }
    let _ = std::fs::remove_dir_all(&dir);
}
