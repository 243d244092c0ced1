fn main() -> std::process::ExitCode {
    shared::runner::main::<stage4_fp8::Block, stage0_baseline::Block>()
}
