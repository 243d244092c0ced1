fn main() -> std::process::ExitCode {
    shared::runner::main(&[stage0_baseline::STAGE, stage1_tensorcore::STAGE, stage2_sdpa::STAGE, stage3_fused::STAGE, stage4_fp8::STAGE])
}
