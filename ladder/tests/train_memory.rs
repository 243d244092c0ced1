//! `--train`'s memory on the CPU: the fp32 reference's gradients in pieces sized by free memory
//! equal the one-piece ones, and a training step that cannot fit is refused before any work.

use clap::{Args, FromArgMatches};
use shared::cli::RunArgs;
use shared::runner::Session;
use shared::train::compare_grads;
use shared::{Precision, Shape};
use std::process::Command;

fn args(flags: &[&str]) -> RunArgs {
    let base = ["t", "--preset", "tiny", "--warmup", "0", "--iters", "1"];
    let m = RunArgs::augment_args(clap::Command::new("t")).try_get_matches_from(base.iter().chain(flags)).unwrap();
    RunArgs::from_arg_matches(&m).unwrap()
}

#[test]
fn reference_gradients_in_pieces_equal_one_piece() {
    let stages = ladder::default_stages();
    let stage0 = stages[0].as_ref();
    let session = Session::open(args(&["--train"]), stage0, &[]).unwrap();
    let b = session.shape.batch;
    assert!(b >= 2, "tiny has B = {b}: nothing to split");
    // With the free memory unknown: one piece of the whole batch, as the session computed it.
    let (chunk, whole) = session.reference_gradients(stage0, None).unwrap();
    assert_eq!(chunk, b);
    let (same, _) = compare_grads(&whole, session.reference_grads.as_ref().unwrap(), Precision::Fp32).unwrap();
    assert!(same.passed && same.max_norm_ratio == 0.0, "{same:?}");
    // Free memory that holds one sequence's training step but not two: pieces of one sequence.
    let one = stage0.estimate_train_bytes(&Shape { batch: 1, ..session.shape }).total();
    let (chunk, pieces) = session.reference_gradients(stage0, Some((one * 10 / 9 + 1) as u64)).unwrap();
    assert_eq!(chunk, 1);
    // Weight gradients summed over pieces, dx joined: equal to the one-piece ones but for f32 summation order.
    let (same, worst) = compare_grads(&pieces, &whole, Precision::Fp32).unwrap();
    assert!(same.passed && same.max_norm_ratio < 1e-6, "d{worst}: {same:?}");
}

#[test]
fn a_training_rows_output_holds_no_graph() {
    // The ladder keeps each stage's y for --save-output while the later stages run: a y that still
    // recorded its forward would keep that stage's activations (stage 0's T × T scores) alive.
    let stages = ladder::default_stages();
    let session = Session::open(args(&["--train"]), stages[0].as_ref(), &[]).unwrap();
    for stage in [stages[0].as_ref(), stages[3].as_ref()] {
        let (record, y) = session.run_with(stage, session.args.precision, 1).unwrap();
        assert!(record.train.is_some() && !y.track_op(), "{}: y still records its forward", stage.name());
    }
}

#[test]
fn a_training_step_that_cannot_fit_is_refused_before_any_work() {
    // ~3.8 GiB of address space: the forward's reference at B=4 T=2048 would fit (~3 GiB), but one
    // sequence of stage 0's training step keeps several (n_head, T, T) tensors (over 4 GiB).
    let o = Command::new("sh")
        .arg("-c")
        .arg("ulimit -v 4000000 && exec \"$0\" --train --stages 0 --preset small --seq 2048 --batch 4 --iters 1 --warmup 0")
        .arg(env!("CARGO_BIN_EXE_ladder"))
        .output()
        .unwrap();
    let (out, err) = (String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr));
    assert_eq!(o.status.code(), Some(2), "{out}{err}");
    for want in ["training step (--train)", "(B, n_head, T, T) tensors", "is available", "lower --batch or --seq", "drop --train"] {
        assert!(err.contains(want), "{want}: {err}");
    }
    assert!(!out.contains("ceiling") && !out.contains("ran "), "refused before any work: {out}");
}

#[test]
fn report_gives_each_stages_training_step_estimate() {
    // The estimate the up-front check uses, per stage, before anything runs (`ladder report --train`).
    let o = Command::new(env!("CARGO_BIN_EXE_ladder")).args(["report", "--train", "--preset", "small", "--seq", "2048"]).output().unwrap();
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(o.status.success(), "{out}{}", String::from_utf8_lossy(&o.stderr));
    let lines: Vec<&str> = out.lines().filter(|l| l.contains("memory: a training step needs about")).collect();
    let stages = ladder::default_stages();
    assert_eq!(lines.len(), stages.len(), "{out}");
    let shape = Shape { seq: 2048, ..shared::Preset::Small.shape() };
    for (line, stage) in lines.iter().zip(&stages) {
        let total = shared::report::fmt_bytes(Some(stage.estimate_train_bytes(&shape).total() as u64));
        assert!(line.contains(&format!("about {total} (estimate: ")), "{}: {line}", stage.name());
    }
    // Stage 0 keeps the (B, n_head, T, T) tensors, its largest part; stage 2 keeps none.
    assert!(lines[0].contains("(estimate: naive attention's (B, n_head, T, T)"), "{}", lines[0]);
    assert!(!lines[2].contains("naive attention"), "{}", lines[2]);
}

#[test]
fn a_ladder_whose_every_stage_cannot_fit_is_refused_before_the_reference() {
    // 2 GiB of address space: one sequence of the fp32 reference's gradients at T = 512 fits, no
    // stage-0 training step of B = 8 does. Without the check the reference gradients would run
    // first, then the only row be skipped; with a stage that fits beside it the run goes on.
    let o = Command::new("sh")
        .arg("-c")
        .arg("ulimit -v 2000000 && exec \"$0\" --train --stages 0 --preset small --seq 512 --batch 8 --iters 1 --warmup 0")
        .arg(env!("CARGO_BIN_EXE_ladder"))
        .output()
        .unwrap();
    let (out, err) = (String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr));
    assert_eq!(o.status.code(), Some(2), "{out}{err}");
    assert!(err.contains("stage0_baseline needs about") && err.contains("a training step (--train)"), "{err}");
    assert!(!out.contains("ceiling") && !out.contains("ran "), "refused before any work: {out}");
}
