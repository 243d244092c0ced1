//! Stage 4's own flags as clap parses them, from the command line and from their environment
//! variables. One test in this file: it sets the process's environment, which parallel tests
//! in the same binary would otherwise read.

use clap::Parser;
use stage4_fp8::Args;

#[derive(Parser, Debug)]
struct Cli {
    #[command(flatten)]
    args: Args,
}

fn parse(argv: &[&str]) -> Result<Args, clap::Error> {
    Cli::try_parse_from(std::iter::once("stage4_fp8").chain(argv.iter().copied())).map(|c| c.args)
}

#[test]
fn fp8_fast_accum_takes_on_and_off_from_the_flag_and_the_environment() {
    std::env::remove_var("SPEEDKIT_FP8_FAST_ACCUM");
    assert!(parse(&[]).unwrap().fp8_fast_accum, "on by default");
    assert!(parse(&["--fp8-fast-accum", "on"]).unwrap().fp8_fast_accum);
    assert!(!parse(&["--fp8-fast-accum", "off"]).unwrap().fp8_fast_accum);
    assert!(!parse(&["--fp8-fast-accum=off"]).unwrap().fp8_fast_accum);
    let bad = parse(&["--fp8-fast-accum", "yes"]).unwrap_err();
    assert_eq!(bad.kind(), clap::error::ErrorKind::InvalidValue, "{bad}");
    assert!(bad.to_string().contains("'yes'") && bad.to_string().contains("on, off"), "{bad}");

    std::env::set_var("SPEEDKIT_FP8_FAST_ACCUM", "off");
    assert!(!parse(&[]).unwrap().fp8_fast_accum, "SPEEDKIT_FP8_FAST_ACCUM=off");
    assert!(parse(&["--fp8-fast-accum", "on"]).unwrap().fp8_fast_accum, "the flag wins over the variable");
    std::env::set_var("SPEEDKIT_FP8_FAST_ACCUM", "on");
    assert!(parse(&[]).unwrap().fp8_fast_accum, "SPEEDKIT_FP8_FAST_ACCUM=on");
    std::env::set_var("SPEEDKIT_FP8_FAST_ACCUM", "maybe");
    assert_eq!(parse(&[]).unwrap_err().kind(), clap::error::ErrorKind::InvalidValue);
    std::env::remove_var("SPEEDKIT_FP8_FAST_ACCUM");
}
