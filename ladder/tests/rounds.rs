//! Every way a stage can leave the ladder's interleaved rounds, on the CPU: refused in round 1,
//! broken in a later round, every stage out, ablation variants out, a sticky CUDA fault that
//! stops the rounds, and in a sweep. Each is a
//! row (skipped or FAILED, with why); the table, JSON and charts are still made; the run's
//! error says what happened (exit 2 for "cannot run here", 3 for a failed check, 1 otherwise).
//!
//! The stages that fail here are the real stages wrapped in one whose `build` errs on its Nth
//! call: the ladder builds each stage once per round, so call N is round N.

use clap::{Args, FromArgMatches};
use ladder::{default_stages, Measure};
use shared::cli::RunArgs;
use shared::device::{DeviceInfo, GemmSwitches};
use shared::report::LadderReport;
use shared::stage::{Forward, Plan, PrecisionChoice, Stage};
use shared::weights::BlockWeights;
use shared::{Precision, PrecisionRequest, Shape, SpeedkitError};
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

fn run(all: &[Box<dyn Stage>], which: &[usize], ablate: bool) -> (LadderReport, Option<anyhow::Error>) {
    let _one = RUN.lock().unwrap_or_else(|e| e.into_inner());
    ladder::run(args(&[]), all, which, Measure { rounds: 3, ablate, reference: false })
        .expect("a stage leaving is a row, not an error of the run")
}

/// Calls of each test's failing builds, one counter per test.
static CALLS: [AtomicUsize; 9] = [const { AtomicUsize::new(0) }; 9];

/// How a failing build errs.
#[derive(Clone, Copy)]
enum How {
    Refused, // SpeedkitError::Usage: the stage cannot run here ("skipped")
    Wrong,   // SpeedkitError::CheckFailed ("FAILED", exit 3)
    Broke,   // any other error ("FAILED", exit 1)
    Sticky,  // a CUDA fault that poisons the context, as the driver words it ("FAILED", the rounds stop)
}

fn err(how: How, what: String) -> anyhow::Error {
    match how {
        How::Refused => SpeedkitError::usage(format!("refused by the test: {what}")).into(),
        How::Wrong => SpeedkitError::CheckFailed(format!("wrong by the test: {what}")).into(),
        How::Broke => anyhow::anyhow!("broken by the test: {what}"),
        How::Sticky => {
            anyhow::anyhow!("DriverError(CUDA_ERROR_ILLEGAL_ADDRESS, \"an illegal memory access was encountered\") by the test: {what}")
        }
    }
}

/// A real stage whose build errs as `how` says from call `from` on (counted in `CALLS[id]`):
/// the ladder builds each stage once per round, so call N is round N. With `variants`, the
/// stage itself builds and only its ablation variants err.
struct Failing {
    inner: Box<dyn Stage>,
    id: usize,
    from: usize,
    until: usize,
    how: How,
    variants: bool,
}

impl Stage for Failing {
    fn name(&self) -> &'static str {
        self.inner.name()
    }
    fn technique(&self) -> &'static str {
        self.inner.technique()
    }
    fn own_precision(&self) -> Option<Precision> {
        self.inner.own_precision()
    }
    fn choose_precision(&self, info: &DeviceInfo, requested: PrecisionRequest) -> Result<PrecisionChoice, SpeedkitError> {
        self.inner.choose_precision(info, requested)
    }
    fn switches(&self, plan: &Plan) -> GemmSwitches {
        self.inner.switches(plan)
    }
    fn check_shape(&self, shape: &Shape) -> Result<(), SpeedkitError> {
        self.inner.check_shape(shape)
    }
    fn estimate_bytes(&self, shape: &Shape) -> u128 {
        self.inner.estimate_bytes(shape)
    }
    fn estimate_train_bytes(&self, shape: &Shape) -> shared::train::TrainBytes {
        self.inner.estimate_train_bytes(shape)
    }
    fn build(&self, w: &BlockWeights, p: &Plan) -> anyhow::Result<Box<dyn Forward>> {
        if !self.variants {
            let call = CALLS[self.id].fetch_add(1, Ordering::SeqCst) + 1;
            if (self.from..=self.until).contains(&call) {
                return Err(err(self.how, format!("call {call}")));
            }
        }
        self.inner.build(w, p)
    }
    fn ablations(&self, plan: &Plan) -> Vec<(String, Box<dyn Stage>)> {
        let wrap = |(label, v): (String, Box<dyn Stage>)| -> (String, Box<dyn Stage>) {
            match self.variants {
                true => (label, Box::new(Failing { inner: v, variants: false, until: usize::MAX, ..*self })),
                false => (label, v),
            }
        };
        self.inner.ablations(plan).into_iter().map(wrap).collect()
    }
    fn traffic(&self, shape: &Shape, p: Precision, act: f64) -> f64 {
        self.inner.traffic(shape, p, act)
    }
}

/// The stages with stage `i`'s build erring on call `n` only (`id` counts the calls).
fn fail_on_call(i: usize, id: usize, n: usize, how: How) -> Vec<Box<dyn Stage>> {
    fail(default_stages(), i, Failing { inner: Box::new(stage0_baseline::Baseline), id, from: n, until: n, how, variants: false })
}

/// `all` with stage `i` replaced by `f` wrapped around it.
fn fail(mut all: Vec<Box<dyn Stage>>, i: usize, f: Failing) -> Vec<Box<dyn Stage>> {
    let inner = std::mem::replace(&mut all[i], Box::new(stage0_baseline::Baseline));
    all[i] = Box::new(Failing { inner, ..f });
    all
}

/// What every output of a report makes of it, without a panic: the table, the markdown, the
/// JSON round trip, and both charts.
fn outputs(r: &LadderReport) -> String {
    let text = r.table(false);
    let md = r.table(true);
    let back: LadderReport = serde_json::from_str(&serde_json::to_string(r).unwrap()).unwrap();
    // (Floats may differ in their last digit through serde_json; the rows may not.)
    assert_eq!((names(&back), &back.skipped, &back.ablation_out), (names(r), &r.skipped, &r.ablation_out));
    ladder::chart::ladder_svg(r).unwrap();
    ladder::roofline::roofline_svg(r).unwrap();
    format!("{text}\n{md}\n{}", ladder::render::ablation_table(r, true))
}

fn names(r: &LadderReport) -> Vec<&str> {
    r.records.iter().map(|x| x.stage.as_str()).collect()
}

#[test]
fn refused_in_round_one_is_a_skipped_row_and_the_rest_run() {
    let (r, failure) = run(&fail_on_call(1, 0, 1, How::Refused), &[0, 1, 2], false);
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
    let (r, failure) = run(&fail_on_call(2, 1, 2, How::Wrong), &[0, 1, 2, 3], false);
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
    let (r, failure) = run(&fail_on_call(0, 2, 3, How::Broke), &[0, 1], false);
    assert_eq!(shared::error::classify(&failure.unwrap()).0, shared::error::EXIT_FAILURE);
    assert_eq!(names(&r), ["stage1_tensorcore"]);
    assert!(r.records[0].speedup_vs_stage0.is_none(), "no stage 0 row, no speedup over it");
    assert!(r.skipped[0].failed && r.skipped[0].reason.contains("broken by the test: call 3"), "{:?}", r.skipped);
    outputs(&r);
}

#[test]
fn a_sticky_cuda_fault_stops_the_rounds_and_keeps_what_ran() {
    let rows = |r: &LadderReport| r.skipped.iter().map(|s| (s.stage.clone(), s.failed)).collect::<Vec<_>>();
    // Stage 2 faults in round 1 (call 1): stages 0 and 1 ran before it and keep that round;
    // stages 3 and 4, not yet run, are FAILED rows naming the fault, and nothing runs after it.
    let (r, failure) = run(&fail_on_call(2, 7, 1, How::Sticky), &[0, 1, 2, 3, 4], false);
    let failure = failure.expect("the fault is the run's error");
    assert!(shared::error::is_sticky_cuda_fault(&failure), "{failure:#}");
    assert_eq!(names(&r), ["stage0_baseline", "stage1_tensorcore"]);
    assert!(r.records.iter().all(|rec| rec.iters == 1 && rec.check.is_some()), "one round of three each");
    assert_eq!(CALLS[7].load(Ordering::SeqCst), 1, "stage 2 not built again");
    let want: Vec<(String, bool)> = ["stage2_sdpa", "stage3_fused", "stage4_fp8"].iter().map(|s| (s.to_string(), true)).collect();
    assert_eq!(rows(&r), want);
    assert!(
        r.skipped[0].reason.contains("CUDA_ERROR_ILLEGAL_ADDRESS") && r.skipped[0].reason.contains("sticky"),
        "{}",
        r.skipped[0].reason
    );
    for s in &r.skipped[1..] {
        assert!(s.reason.contains("did not run") && s.reason.contains("sticky CUDA fault in stage2_sdpa"), "{}", s.reason);
    }
    let out = outputs(&r);
    assert!(out.contains("did not run"), "{out}");

    // Stage 2 faults in round 2 (call 2), where the order is 1, 2, 3, 4, 0: every stage ran round 1,
    // stage 1 ran round 2 too, so all but stage 2 keep their records.
    let (r, failure) = run(&fail_on_call(2, 8, 2, How::Sticky), &[0, 1, 2, 3, 4], false);
    assert!(failure.is_some_and(|f| shared::error::is_sticky_cuda_fault(&f)));
    assert_eq!(names(&r), ["stage0_baseline", "stage1_tensorcore", "stage3_fused", "stage4_fp8"]);
    assert_eq!(r.records.iter().map(|rec| rec.iters).collect::<Vec<_>>(), [1, 2, 1, 1]);
    assert_eq!(rows(&r), [("stage2_sdpa".to_string(), true)]);
    assert!(r.records[2].speedup_vs_stage0.is_some(), "the rows that ran are compared as usual");
    outputs(&r);
}

#[test]
fn every_stage_out_is_a_table_of_reasons() {
    let all = fail_on_call(0, 3, 1, How::Refused);
    let all =
        fail(all, 1, Failing { inner: Box::new(stage0_baseline::Baseline), id: 4, from: 2, until: 2, how: How::Broke, variants: false });
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
    let variants = |id, from, how| Failing { inner: Box::new(stage0_baseline::Baseline), id, from, until: usize::MAX, how, variants: true };
    let all = fail(fail(default_stages(), 2, variants(5, 2, How::Wrong)), 3, variants(6, 1, How::Refused));
    let (r, failure) = run(&all, &[0, 2, 3], true);
    assert!(failure.is_some(), "a failed variant fails the run");
    assert_eq!(names(&r), ["stage0_baseline", "stage2_sdpa", "stage3_fused"], "the stages as written all ran");
    assert!(r.skipped.is_empty());
    let copies = r.ablation_out.iter().find(|o| o.against == "stage2_sdpa" && o.change.contains("copies")).expect("stage 2's variant");
    assert!(copies.failed);
    let fusions = r.ablation_out.iter().filter(|o| o.against == "stage3_fused" && !o.failed).count();
    let (device, info) = shared::device::select(shared::device::DeviceRequest::Cpu).unwrap();
    let s3 = stage3_fused::Fused::default();
    let plan = shared::stage::plan_alone(&s3, &device, &info, shared::Preset::Tiny.shape(), PrecisionRequest::Auto).unwrap();
    assert_eq!(fusions, s3.ablations(&plan).len(), "{:?}", r.ablation_out);
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
    // A refused stage has no variant rows (its own row says why); stage 0's (candle's element-wise
    // ops) and stage 4's (its FP8 fusions) run.
    let against: Vec<&str> = r.ablation.iter().map(|a| a.against.as_str()).collect();
    assert_eq!(against, ["stage0_baseline", "stage4_fp8", "stage4_fp8"], "{:?}", r.ablation);
    assert!(r.ablation_out.is_empty(), "{:?}", r.ablation_out);
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
