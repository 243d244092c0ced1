//! What only the benchmark harness needs from stage 4's FP8 modules: FP8 errors in the runner's terms (a refusal is a usage
//! error, exit 2). `fp8`, `gemm` and the CUDA modules depend on candle alone.

use crate::fp8::Fp8Error;
use shared::SpeedkitError;

/// A refusal becomes a usage error (exit 2, its paragraph printed); a failed op stays one.
pub fn fp8_error(e: Fp8Error) -> anyhow::Error {
    match e {
        Fp8Error::Refused(why) => SpeedkitError::usage(why).into(),
        Fp8Error::Candle(e) => e.into(),
    }
}
