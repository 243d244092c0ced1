//! Unit tests of `ladder/src/sweep.rs`, compiled into that module (`#[path]`), so they
//! reach its private items.

use super::*;

#[test]
fn parses_sweeps() {
    assert_eq!("seq=512,1024".parse::<Sweep>().unwrap(), Sweep { axis: Axis::Seq, values: vec![512, 1024] });
    assert_eq!("d-model=256".parse::<Sweep>().unwrap().axis, Axis::DModel);
    assert_eq!("d_model=256, 512".parse::<Sweep>().unwrap().values, vec![256, 512]);
    assert_eq!("batch=1".parse::<Sweep>().unwrap().axis, Axis::Batch);
    for bad in ["seq", "seq=", "seq=1,x", "heads=4", "=4"] {
        let e = bad.parse::<Sweep>().unwrap_err();
        assert!(e.contains("seq=512,1024,2048"), "{bad}: {e}");
    }
}

fn flags(flags: &[&str]) -> RunArgs {
    use clap::{Args, FromArgMatches};
    let m = RunArgs::augment_args(clap::Command::new("t")).try_get_matches_from(std::iter::once("t").chain(flags.iter().copied())).unwrap();
    RunArgs::from_arg_matches(&m).unwrap()
}

#[test]
fn d_model_keeps_d_head_and_scales_ff() {
    let a = args_for(&flags(&["--preset", "tiny", "--json", "x.json"]), Axis::DModel, 256, 32).unwrap();
    assert_eq!((a.d_model, a.ff, a.heads, a.json), (Some(256), Some(1024), Some(8), None));
    let a = args_for(&flags(&["--ff", "100", "--heads", "2"]), Axis::DModel, 256, 32).unwrap();
    assert_eq!((a.ff, a.heads), (Some(100), Some(2)));
    let e = args_for(&flags(&[]), Axis::DModel, 48, 32).unwrap_err().to_string();
    assert!(e.contains("d_head = 32") && e.contains("Fix:"), "{e}");
    assert_eq!(args_for(&flags(&[]), Axis::Seq, 16, 32).unwrap().seq, Some(16));
}

#[test]
fn refuses_flags_that_fight_the_sweep() {
    let seq = Sweep { axis: Axis::Seq, values: vec![8] };
    let e = check_values(&flags(&["--seq", "8"]), &seq).unwrap_err().to_string();
    assert!(e.contains("--seq and --sweep seq=... both set"), "{e}");
    let e = check_values(&flags(&["--save-output", "y.safetensors"]), &seq).unwrap_err().to_string();
    assert!(e.contains("overwrite"), "{e}");
    let c = Sweep { axis: Axis::DModel, values: vec![256] };
    assert!(check_values(&flags(&["--weights", "w.safetensors"]), &c).is_err());
    assert!(check_values(&flags(&["--seq", "8"]), &c).is_ok());
}
