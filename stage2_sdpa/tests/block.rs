//! Stage 2 as a whole block: within tolerance of the fp32 stage-0 reference on `tiny` at every
//! precision the CPU runs, and the binary's refusals.

use shared::check::compare;
use shared::device::{select, DeviceRequest};
use shared::stage::plan_alone;
use shared::weights::random_input;
use shared::{BlockWeights, Precision, PrecisionRequest, Preset, Stage};
use std::process::Command;

#[test]
fn block_matches_reference_on_tiny() {
    let shape = Preset::Tiny.shape();
    let (device, info) = select(DeviceRequest::Cpu).unwrap();
    let w = BlockWeights::from_seed(&shape, 4).unwrap();
    let x = random_input(&shape, 4).unwrap();
    let run = |spec: &dyn Stage, req| {
        let plan = plan_alone(spec, &device, &info, shape, req).unwrap();
        (spec.build(&w, &plan).unwrap().forward(&x).unwrap(), plan.precision)
    };
    let (reference, _) = run(&stage0_baseline::Baseline, PrecisionRequest::Auto);
    for p in [Precision::Fp32, Precision::Bf16, Precision::F16] {
        let (y, got) = run(&stage2_sdpa::Sdpa::default(), PrecisionRequest::Exactly(p));
        assert_eq!(got, p);
        let c = compare(&y, &reference, p).unwrap();
        assert!(c.passed, "{p}: {c:?}");
        if p == Precision::Fp32 {
            // Same math as stage 1 at fp32, only the softmax summation order differs.
            assert!(c.rel_err > 0.0 && c.rel_err < 1e-6, "{c:?}");
        }
    }
}

/// `ladder --ablate`'s CPU variant: the row-wise kernel (the online softmax alone) computes the
/// same block as the register-blocked one, and its label says which ran.
#[test]
fn row_wise_variant_matches_the_stage_and_says_so() {
    let shape = Preset::Tiny.shape();
    let (device, info) = select(DeviceRequest::Cpu).unwrap();
    let w = BlockWeights::from_seed(&shape, 5).unwrap();
    let x = random_input(&shape, 5).unwrap();
    let stage = stage2_sdpa::Sdpa::default();
    let plan = plan_alone(&stage, &device, &info, shape, PrecisionRequest::Exactly(Precision::Fp32)).unwrap();
    let variants = stage.ablations(&plan);
    let (_, row_wise) = variants.iter().find(|(change, _)| change.starts_with("row-wise online softmax")).expect("a CPU ablation row");
    assert_eq!(row_wise.implementation(&plan).as_deref(), Some("speedkit cpu attn (row-wise CPU kernel)"));
    let want = stage.build(&w, &plan).unwrap().forward(&x).unwrap();
    let got = row_wise.build(&w, &plan).unwrap().forward(&x).unwrap();
    let c = compare(&got, &want, Precision::Fp32).unwrap();
    assert!(c.passed && c.rel_err < 1e-6, "{c:?}");
}

#[test]
fn binary_runs_and_names_its_attention() {
    let json = std::env::temp_dir().join(format!("stage2-implementation-{}.json", std::process::id()));
    let o = Command::new(env!("CARGO_BIN_EXE_stage2_sdpa"))
        .args(["--preset", "tiny", "--warmup", "0", "--iters", "1", "--precision", "fp32", "--json"])
        .arg(&json)
        .output()
        .unwrap();
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(o.status.success(), "{out}{}", String::from_utf8_lossy(&o.stderr));
    // tiny's d_head is 32: the register-blocked kernel has a body for it, and the note (recorded
    // from the forward, `shared::ran`) names the kernel that ran.
    assert!(out.contains("note      ran: attention kernel register-blocked, f32"), "{out}");
    // The table's precision cell and the JSON record say which attention ran.
    assert!(out.contains("fp32 (speedkit cpu attn (register-blocked CPU kernel))"), "{out}");
    let record = std::fs::read_to_string(&json).unwrap();
    std::fs::remove_file(&json).ok();
    assert!(record.contains(r#""implementation": "speedkit cpu attn (register-blocked CPU kernel)""#), "{record}");
    // A head size the register kernel has no body for runs the tile-GEMM kernel, and says so;
    // --elementwise candle (candle's ops instead of the engine's passes) is in the label too.
    let o = Command::new(env!("CARGO_BIN_EXE_stage2_sdpa"))
        .args(["--preset", "tiny", "--warmup", "0", "--iters", "1", "--heads", "8", "--elementwise", "candle"])
        .output()
        .unwrap();
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(o.status.success(), "{out}{}", String::from_utf8_lossy(&o.stderr));
    assert!(out.contains("tile-GEMM CPU kernel") && out.contains("candle's element-wise ops"), "{out}");
    assert!(out.contains("note      ran: attention kernel tile GEMMs (gemm crate)"), "{out}");
}

/// A flag this device cannot honour is refused in the plan, before weights, the reference or
/// the CPU ceiling probe exist (at `te` those take tens of seconds); `ladder report` predicts
/// the same refusal for stages 2-4.
#[test]
fn attention_kernel_on_the_cpu_is_refused_before_any_work() {
    let t0 = std::time::Instant::now();
    let o = Command::new(env!("CARGO_BIN_EXE_stage2_sdpa"))
        .args(["--device", "cpu", "--preset", "te", "--batch", "1", "--attention-kernel", "v1"])
        .output()
        .unwrap();
    let (out, err) = (String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr));
    assert_eq!(o.status.code(), Some(2), "{out}{err}");
    assert!(err.contains("--attention-kernel v1") && err.contains("Fix:"), "{err}");
    assert!(!out.contains("ceiling") && !out.contains("data "), "refused after work began: {out}");
    assert!(t0.elapsed() < std::time::Duration::from_secs(10), "took {:?}", t0.elapsed());
}
