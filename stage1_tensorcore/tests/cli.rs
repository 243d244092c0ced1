//! The stage 1 binary: auto on CPU says why it picked fp32; overrides the device cannot honour
//! exit 2 with the reason; bf16 runs on CPU and says it is slower there.

use std::process::{Command, Output};

fn run(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_stage1_tensorcore"))
        .args(["--preset", "tiny", "--warmup", "0", "--iters", "1"])
        .args(args)
        .output()
        .unwrap()
}

fn text(o: &Output) -> String {
    format!("{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr))
}

#[test]
fn auto_on_cpu_is_fp32_and_says_why() {
    let o = run(&[]);
    assert!(o.status.success(), "{}", text(&o));
    assert!(text(&o).contains("precision fp32 (stage1_tensorcore) — auto on CPU: no tensor cores"), "{}", text(&o));
}

#[test]
fn bf16_runs_on_cpu_and_says_it_is_slower_here() {
    let o = run(&["--precision", "bf16"]);
    assert!(o.status.success(), "{}", text(&o));
    assert!(text(&o).contains("slower than fp32 here"), "{}", text(&o));
}

#[test]
fn overrides_the_device_cannot_do_exit_2() {
    for (precision, needle) in [("tf32", "CPU has none"), ("fp8", "stage 4's technique")] {
        let o = run(&["--precision", precision]);
        assert_eq!(o.status.code(), Some(2), "{}", text(&o));
        assert!(text(&o).contains(needle), "{precision}: {}", text(&o));
    }
}

#[test]
fn misaligned_dimensions_get_padding_advice() {
    let o = run(&["--precision", "bf16", "--d-model", "100", "--heads", "4", "--ff", "400"]);
    assert!(o.status.success(), "{}", text(&o));
    assert!(text(&o).contains("pad it to 104") && text(&o).contains("pad it to 32"), "{}", text(&o));
}
