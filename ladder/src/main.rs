fn main() -> std::process::ExitCode {
    ladder::main()
}
