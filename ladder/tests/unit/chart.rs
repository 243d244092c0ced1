//! Unit tests of `ladder/src/chart.rs`, compiled into that module (`#[path]`), so they
//! reach its private items.

use super::*;

#[test]
fn lines_break_at_missing_values() {
    let pts = [(0.0, 1.0), (1.0, 2.0), (3.0, 4.0)];
    assert_eq!(segments(&pts), vec![vec![(0.0, 1.0), (1.0, 2.0)], vec![(3.0, 4.0)]]);
    assert!(segments(&[]).is_empty());
}

#[test]
fn log_ticks() {
    assert_eq!(ticks_125(0.3, 7.0), vec![0.5, 1.0, 2.0, 5.0]);
    assert_eq!(ticks_125(15.0, 300.0), vec![20.0, 50.0, 100.0, 200.0]);
}

#[test]
fn stage_colours_follow_the_stage_number() {
    assert_eq!(stage_colour("stage4_fp8", 0), COLOURS[4]);
    assert_eq!(stage_colour("custom", 2), COLOURS[2]);
}

fn recorded(name: &str) -> LadderReport {
    match crate::load(&std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../results").join(name)).unwrap() {
        crate::Results::Ladder(r) => *r,
        crate::Results::Sweep(_) => panic!("{name} is one run"),
    }
}

/// A training run's charts say so: the bar chart, the breakdown's axis, the roofline's title and
/// a sweep's title and axis; a forward run's say forward and never training.
#[test]
fn training_charts_say_training() {
    let (train, forward) = (recorded("ladder-cpu-train.json"), recorded("ladder-cpu.json"));
    assert_eq!((train.mode(), forward.mode()), (Some(Mode::Train), Some(Mode::Forward)));
    let bars = ladder_svg(&train).unwrap();
    assert!(bars.contains("median ms per training step (forward + backward)"), "bar chart");
    let parts = breakdown_svg(&train).unwrap();
    assert!(parts.contains("ms per training step (instrumented)") && !parts.contains("ms per forward"), "breakdown");
    let roof = crate::roofline::roofline_svg(&train).unwrap();
    assert!(roof.contains("Roofline of a training step (forward + backward)") && roof.contains("the training step"), "roofline");
    for svg in [ladder_svg(&forward), breakdown_svg(&forward), crate::roofline::roofline_svg(&forward)] {
        assert!(!svg.unwrap().contains("training"));
    }
    assert!(breakdown_svg(&forward).unwrap().contains("ms per forward (instrumented)"));
    let sweep = |run: &LadderReport| SweepReport { schema: "s".into(), axis: "seq".into(), values: vec![512], runs: vec![run.clone()] };
    let s = sweep_svg(&sweep(&train)).unwrap();
    assert!(s.contains("Sweep over T: median ms per training step per stage") && s.contains("median ms per training step (log scale)"));
    let s = crate::render::sweep_tables(&sweep(&train), true);
    assert!(s.contains("cells: median ms per training step") && s.contains("forward + backward ms"), "{s}");
    assert!(!sweep_svg(&sweep(&forward)).unwrap().contains("training"));
    assert!(!crate::render::sweep_tables(&sweep(&forward), false).contains("training"));
}
