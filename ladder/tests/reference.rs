//! The fp32 reference in pieces along B: on the H100 the reference refused
//! te at T = 4096 for stages 2 and 3, which never build the (B, n_head, T, T) scores it needs.
//! Here, on the CPU, with a limit small enough that the full score matrix does not fit it.

use clap::{Args, FromArgMatches};
use shared::check::compare_within;
use shared::cli::RunArgs;
use shared::runner::Session;
use shared::Stage;
use shared::{Precision, PrecisionRequest};

#[test]
fn a_reference_in_pieces_is_the_reference_and_checks_a_fused_stage() {
    let flags = ["t", "--preset", "tiny", "--batch", "3", "--warmup", "0", "--iters", "1"];
    let m = RunArgs::augment_args(clap::Command::new("t")).try_get_matches_from(flags).unwrap();
    let session = Session::open(RunArgs::from_arg_matches(&m).unwrap(), &stage0_baseline::Baseline, &[]).unwrap();
    let s = session.shape;
    let per_sequence = s.n_head * s.seq * s.seq;
    // Two sequences' scores at a time: the whole (3, n_head, T, T) matrix is past the limit.
    let limit = 2 * per_sequence;
    assert!(s.batch * per_sequence > limit);
    let pieces = session.reference_output(&stage0_baseline::Baseline, limit).unwrap();
    let whole = session.reference.as_ref().expect("the session's own reference, in one piece at tiny");
    let c = compare_within(&pieces, whole, 1e-6).unwrap();
    assert!(c.passed && c.max_abs_err < 1e-5, "{c:?}");

    // A fused stage checked against the pieces passes as against the whole.
    let spec = &stage2_sdpa::Sdpa::default();
    let plan = shared::stage::plan_alone(spec, &session.device, &session.info, s, PrecisionRequest::Exactly(Precision::Fp32)).unwrap();
    let y = spec.build(&session.weights, &plan).unwrap().forward(&session.x).unwrap();
    assert!(compare_within(&y, &pieces, shared::check::tolerance(Precision::Fp32)).unwrap().passed);

    // One sequence past the limit: refused with a fix, not a crash.
    let e = session.reference_output(&stage0_baseline::Baseline, per_sequence - 1).unwrap_err();
    assert!(e.to_string().contains("Fix:"), "{e}");
}
