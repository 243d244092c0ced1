//! The stage 1 binary: auto on CPU picks bf16 where the CPU has a bf16 unit and fp32 where it
//! has none (`SPEEDKIT_CPU_BF16=off` forces that fallback on any machine), and says why;
//! overrides the device cannot honour exit 2 with the reason; bf16 without a bf16 unit runs
//! converted and says it is slower there.

use cpu_kernels::bf16_gemm::Kernel;
use std::process::{Command, Output};

fn run_with(cpu_bf16: &str, args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_stage1_tensorcore"))
        .env("SPEEDKIT_CPU_BF16", cpu_bf16)
        .args(["--preset", "tiny", "--warmup", "0", "--iters", "1"])
        .args(args)
        .output()
        .unwrap()
}

fn run(args: &[&str]) -> Output {
    run_with("auto", args)
}

fn text(o: &Output) -> String {
    format!("{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr))
}

#[test]
fn auto_on_cpu_follows_its_bf16_unit_and_says_why() {
    let o = run(&[]);
    assert!(o.status.success(), "{}", text(&o));
    let kernel = Kernel::detect_with(None);
    if kernel.is_native() {
        assert!(text(&o).contains("precision bf16 (stage1_tensorcore) — auto on CPU: bf16 GEMMs on this CPU's"), "{}", text(&o));
        assert!(text(&o).contains(&format!("bf16 GEMMs {}", kernel.name())), "{}", text(&o));
    } else {
        assert!(text(&o).contains("precision fp32 (stage1_tensorcore) — auto on CPU: no bf16 units"), "{}", text(&o));
    }
}

#[test]
fn without_a_bf16_unit_auto_is_fp32_and_bf16_converts() {
    let o = run_with("off", &[]);
    assert!(o.status.success(), "{}", text(&o));
    assert!(text(&o).contains("precision fp32 (stage1_tensorcore) — auto on CPU: no bf16 units"), "{}", text(&o));
    let o = run_with("off", &["--precision", "bf16"]);
    assert!(o.status.success(), "{}", text(&o));
    assert!(text(&o).contains("slower than fp32 here") && text(&o).contains("bf16 GEMMs converted to f32"), "{}", text(&o));
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
