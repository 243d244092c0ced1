//! Stage 3 trains through the contract (`build_train`, `optimizer`): its block gradients against
//! stage 0's autograd at every precision it runs on the CPU (all fusions, and none), one step of
//! its fused AdamW against `candle_nn::AdamW` on the same gradients.

#[path = "../../stage0_baseline/tests/support/train.rs"]
mod train;

use shared::Precision;
use stage3_fused::{Fused, Fusions};

#[test]
fn block_gradients_match_stage_0_autograd_on_tiny() {
    // Tolerance, max |Δ| / max |g| per tensor: 1e-5 at fp32 (tiled attention and fused passes
    // sum in other orders than stage 0's primitive ops); 2e-2 at bf16 and 1e-2 at f16 (GEMM
    // operands, q, k, v and the gradients between the ops rounded to 8 and 11 significant bits;
    // the fused ops sum bias gradients in f32). Measured 4.8e-7, 5.0e-3 and 7.6e-4 (dw_proj,
    // dw_qkv, dw_qkv) on a CPU with AVX512-BF16. At f16 (the tape) the training forward adds
    // fc2's residual after the GEMM instead of in it (`tests/backward.rs`), fc2's output rounded
    // to 16 bits first (≤ 1e-3); the CPU's scheduled step (fp32, bf16) adds it in the GEMM's
    // epilogue as `build`'s forward does.
    train::check_against_stage_0(
        &Fused::default(),
        &[(Precision::Fp32, 1e-5, 1e-6), (Precision::Bf16, 2e-2, 1e-3), (Precision::F16, 1e-2, 1e-3)],
    );
    // Every fusion off: stage 2's candle passes, differentiated by candle.
    train::check_against_stage_0(&Fused { fusions: Fusions::NONE, ..Fused::default() }, &[(Precision::Fp32, 1e-5, 1e-6)]);
}

#[test]
fn one_fused_adamw_step_matches_candle_adamw() {
    // The fused update is candle-nn's arithmetic in another order: ≤ 1e-6 of the weights
    // (`adamw.rs`'s own test), at fp32 and at bf16's gradients alike.
    for p in [Precision::Fp32, Precision::Bf16] {
        let (name, skipped) = train::step_matches_candle_adamw(&Fused::default(), p, 1e-6);
        assert_eq!((name.as_str(), skipped), ("fused AdamW", 0));
    }
}

#[test]
fn the_scheduled_backward_matches_candle_autograd_of_the_same_block() {
    // The CPU step with every fusion on schedules its backward by hand (`scheduled.rs`); the
    // same block's forward differentiated by candle's tape runs the same kernels, so the two
    // differ only in summation order: fc2's residual added in the GEMM's epilogue instead of
    // after it, and the residual stream's gradient added inside the LayerNorm backward's pass
    // instead of by candle. Every gradient within 1e-5 of its largest value, at fp32 and at
    // bf16 products.
    let pr = train::Problem::new();
    for p in [Precision::Fp32, Precision::Bf16] {
        let stage = Fused::default();
        let plan = train::train_plan(&stage, p);
        cpu_kernels::trace::start();
        let (y, scheduled) = pr.backward(&stage, &plan, 1.0);
        let ran = cpu_kernels::trace::stop().join("; ");
        assert!(ran.contains("layer_norm backward: one pass, + the residual's gradient"), "{p}: the scheduled step did not run: {ran}");
        let (y_tape, tape) = pr.backward_on_tape(&stage, &plan, 1.0);
        assert!(train::rel_max(&y, &y_tape) <= 1e-6, "{p}: the forwards differ by {}", train::rel_max(&y, &y_tape));
        for ((name, a), b) in train::NAMES.iter().zip(pr.grads(&scheduled)).zip(pr.grads(&tape)) {
            let e = train::rel_max(&a, &b);
            eprintln!("{p} d{name}: scheduled vs tape {e:.1e}");
            assert!(e <= 1e-5, "{p}: d{name} off by {e} from the tape's");
        }
    }
}
