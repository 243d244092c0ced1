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
    // dw_qkv, dw_qkv) on a CPU with AVX512-BF16. The training forward adds fc2's residual after
    // the GEMM instead of in it (`tests/backward.rs`): a rounding, ≤ 1e-6 at fp32, fc2's output
    // rounded to 16 bits first at bf16/f16 (≤ 1e-3).
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
