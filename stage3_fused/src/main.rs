fn main() -> std::process::ExitCode {
    shared::runner::main::<stage3_fused::Block, stage0_baseline::Block>()
}
