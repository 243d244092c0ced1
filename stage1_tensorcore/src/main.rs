fn main() -> std::process::ExitCode {
    shared::runner::main::<stage1_tensorcore::Block, stage0_baseline::Block>()
}
