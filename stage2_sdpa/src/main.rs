fn main() -> std::process::ExitCode {
    shared::runner::main::<stage2_sdpa::Block, stage0_baseline::Block>()
}
